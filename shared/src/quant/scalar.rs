use super::{tree, Codes, QuantKind};

/// Reference twin of [`super::quantize_group`].
pub(super) fn quantize_group(xs: &[f32], out: &mut [i8]) -> f32 {
    let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (o, v) in out.iter_mut().zip(xs) {
        *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    d
}

/// Reference twin of [`super::nibble_order`]: each block of `nb` codes as its even elements,
/// then its odd ones.
pub(super) fn nibble_order(src: &[i8], dst: &mut [i8], nb: usize) {
    for (d, s) in dst.chunks_exact_mut(nb).zip(src.chunks_exact(nb)) {
        for (i, pair) in s.chunks_exact(2).enumerate() {
            d[i] = pair[0];
            d[nb / 2 + i] = pair[1];
        }
    }
}

/// Reference twin of [`super::code_sum`].
pub(super) fn code_sum(xs: &[i8]) -> i32 {
    xs.iter().map(|&v| v as i32).sum()
}

/// Decodes 8 weights starting at element `i` of a packed row into integer codes as f32.
#[inline]
pub(super) fn codes8(kind: QuantKind, row: &[u8], i: usize) -> [f32; 8] {
    let mut c = [0.0f32; 8];
    for k in 0..8 {
        let j = i + k;
        c[k] = match kind {
            QuantKind::Bf16 => {
                crate::dtype::bf16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]]))
            }
            QuantKind::Int8 => (row[j] as i8) as f32,
            QuantKind::Int4 => (((row[j / 2] >> (4 * (j % 2))) & 15) as i32 - 8) as f32,
            QuantKind::Int2 => ((row[j / 4] >> (2 * (j % 4))) & 3) as f32,
        };
    }
    c
}

/// Reference twin of the integer path (see [`super::block_dot_i8`]): per group the exact i32
/// dot product, then `acc = fma(scale_w[g] * scale_x[g], isum, acc)` in group order.
pub(super) fn row_dot_i8(
    kind: QuantKind,
    group: usize,
    row: &[u8],
    sc: &[f32],
    aq: &[i8],
    ascale: &[f32],
) -> f32 {
    let gb = group * kind.bits() / 8;
    // int4: nibble blocks (low nibbles meet the block's first half, high nibbles the second)
    let nb = super::nibble_block(group);
    let mut acc = 0.0f32;
    for g in 0..aq.len() / group {
        let (w, a) = (&row[g * gb..(g + 1) * gb], &aq[g * group..(g + 1) * group]);
        let mut isum = 0i32;
        for (j, &x) in a.iter().enumerate() {
            let wv = match kind {
                QuantKind::Int8 => (w[j] as i8) as i32,
                _ => {
                    let (c, i) = (j / nb, j % nb);
                    let b = w[c * nb / 2 + i % (nb / 2)];
                    (if i < nb / 2 { b & 15 } else { b >> 4 }) as i32 - 8
                }
            };
            isum += wv * x as i32;
        }
        acc = (sc[g] * ascale[g]).mul_add(isum as f32, acc);
    }
    acc
}

/// `sum_g (scale[g] * sum_{i in g} q_i x_i + min[g] * xsum[g])`, or the plain dot for bf16.
///
/// Order: per group, 8 lane partials over the group (fused multiply-adds); each lane then
/// accumulates `scale[g] * partial` (bf16: the partial itself); the 8 accumulators are summed
/// in the fixed tree; int2's `min[g] * xsum[g]` terms are summed separately, in group order,
/// and added last.
pub(super) fn row_dot(
    kind: QuantKind,
    group: usize,
    codes: Codes<'_>,
    sc: &[f32],
    mn: &[f32],
    x: &[f32],
    xs: &[f32],
) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut offs = 0.0f32;
    for g in 0..x.len() / group {
        let mut l = [0.0f32; 8];
        for i in (g * group..(g + 1) * group).step_by(8) {
            let c = match codes {
                Codes::Packed(row) => codes8(kind, row, i),
                Codes::Decoded(d) => d[i..i + 8].try_into().expect("8 codes"),
            };
            for k in 0..8 {
                l[k] = c[k].mul_add(x[i + k], l[k]);
            }
        }
        let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
        for k in 0..8 {
            acc[k] = s.mul_add(l[k], acc[k]);
        }
        if kind == QuantKind::Int2 {
            offs = mn[g].mul_add(xs[g], offs);
        }
    }
    tree(&acc) + offs
}
