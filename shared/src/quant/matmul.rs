//! The matmul: dispatch on the activation mode and the ISA, the integer path, row helpers
//! shared by every kernel.

use super::*;

impl QMatrix {
    /// `y[t, o] = sum_i x[t, i] * W[o, i]` for `n` tokens on `isa`; `x` is `[n, cols]`.
    pub fn matmul(&self, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        self.matmul_with(x, n, isa, Activations::F32)
    }

    /// [`QMatrix::matmul`] with an explicit activation mode.
    pub fn matmul_with(&self, x: &[f32], n: usize, isa: Isa, act: Activations) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "matmul input is not [n, cols]");
        if self.layout != Layout::RowMajor
            && !(act == Activations::Int8 && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni))
        {
            // the lane layout has kernels on the integer path of AVX2 and VNNI only
            return self.to_row_major().matmul_with(x, n, isa, act);
        }
        if act == Activations::Int8 && self.integer_path() {
            return self.matmul_int8(x, n, isa);
        }
        let ng = self.groups();
        // Per-token group sums of x, for the affine int2 offset term.
        let xsum: Vec<f32> = if self.kind == QuantKind::Int2 {
            x.chunks(self.group).map(lane_sum_scalar).collect()
        } else {
            Vec::new()
        };
        let rb = self.row_bytes();
        let cols = self.cols;
        // Several tokens: decode each row's codes once, then one pass per token over them. The
        // arithmetic is the same as decoding on the fly, so results do not depend on `n`.
        let scratch = || {
            if n > 1 {
                vec![0.0f32; cols]
            } else {
                Vec::new()
            }
        };
        let (data, scales, mins): (&[u8], &[f32], &[f32]) = (&self.data, &self.scales, &self.mins);
        #[cfg(target_arch = "x86_64")]
        if n == 1 && self.kind != QuantKind::Bf16 && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
            // One token: 4 rows at a time with independent accumulator chains (each row's
            // arithmetic is the one-row kernel's), the next block's weights prefetched. (bf16 rows
            // are cheap to decode and twice as long: one row at a time streams them faster.)
            return par_row_blocks(self.rows, 1, 4, rb, |r0, out| {
                let k = out.len();
                let full = k - k % 4;
                for i in (0..full).step_by(4) {
                    let r = r0 + i;
                    let ahead =
                        &data[((r + 4) * rb).min(data.len())..((r + 8) * rb).min(data.len())];
                    // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma.
                    let v = unsafe {
                        avx2::rows_dot::<4>(
                            self.kind,
                            self.group,
                            std::array::from_fn(|j| &data[(r + j) * rb..(r + j + 1) * rb]),
                            std::array::from_fn(|j| part(scales, r + j, ng)),
                            std::array::from_fn(|j| part(mins, r + j, ng)),
                            x,
                            &xsum,
                            ahead,
                        )
                    };
                    out[i..i + 4].copy_from_slice(&v);
                }
                for i in full..k {
                    let r = r0 + i;
                    out[i] = row_dot(
                        self.kind,
                        self.group,
                        Codes::Packed(&data[r * rb..(r + 1) * rb]),
                        part(scales, r, ng),
                        part(mins, r, ng),
                        x,
                        &xsum,
                        isa,
                    );
                }
            });
        }
        par_rows(self.rows, n, rb, scratch, |codes, r, out| {
            let row = &data[r * rb..(r + 1) * rb];
            let (sc, mn) = (part(scales, r, ng), part(mins, r, ng));
            let xs_of = |t: usize| {
                if xsum.is_empty() {
                    &[][..]
                } else {
                    &xsum[t * ng..(t + 1) * ng]
                }
            };
            if n == 1 {
                out[0] = row_dot(
                    self.kind,
                    self.group,
                    Codes::Packed(row),
                    sc,
                    mn,
                    x,
                    xs_of(0),
                    isa,
                );
            } else {
                // Up to 8 tokens: the packed codes, decoded as each tile reads them (a batch's
                // few tokens per expert); more: decoded once for all of them.
                let few = cfg!(target_arch = "x86_64")
                    && n <= 8
                    && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni);
                if !few {
                    decode_row(self.kind, row, codes, isa);
                }
                let tile_codes = if few {
                    Codes::Packed(row)
                } else {
                    Codes::Decoded(codes)
                };
                // the tokens left to the one-token kernel
                #[allow(unused_mut)]
                let mut start = 0;
                #[cfg(target_arch = "x86_64")]
                if matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
                    // 8 tokens at a time over the decoded codes (enough independent chains to
                    // hide the multiply-add latency), then 4, then the last 2 or 3 together;
                    // per token the one-token arithmetic
                    macro_rules! tiles {
                        ($t:literal) => {
                            while n - start >= $t {
                                let t0 = start;
                                // SAFETY: `Isa::Avx2` is only constructed after checking avx2
                                // and fma.
                                let v = unsafe {
                                    avx2::codes_dot::<$t>(
                                        self.kind,
                                        self.group,
                                        tile_codes,
                                        sc,
                                        mn,
                                        std::array::from_fn(|i| {
                                            &x[(t0 + i) * cols..(t0 + i + 1) * cols]
                                        }),
                                        std::array::from_fn(|i| xs_of(t0 + i)),
                                    )
                                };
                                out[t0..t0 + $t].copy_from_slice(&v);
                                start += $t;
                            }
                        };
                    }
                    tiles!(8);
                    tiles!(4);
                    tiles!(3);
                    tiles!(2);
                }
                for (t, v) in out.iter_mut().enumerate().skip(start) {
                    let xt = &x[t * cols..(t + 1) * cols];
                    *v = row_dot(self.kind, self.group, tile_codes, sc, mn, xt, xs_of(t), isa);
                }
            }
        })
    }
}

impl QMatrix {
    /// The integer path: activations quantized per group, exact i32 dot products per group, then
    /// `acc = fma(scale_w[g] * scale_x[g], isum[g], acc)` in group order, one accumulator per row
    /// and token (the same on every ISA, for any number of rows and tokens computed together).
    fn matmul_int8(&self, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        let (group, ng) = (self.group, self.groups());
        let qx = self.quantize_acts(x, n, isa);
        let rb = self.row_bytes();
        // plain slices once (the weights may live in a shared I/O buffer behind a handle)
        let (data, scales): (&[u8], &[f32]) = (&self.data, &self.scales);
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Lanes16 {
            // 16 rows at a time straight from the lane layout, any number of tokens
            return par_lane_blocks(self.rows, n, rb, |r0, out| {
                self.lanes_rows(r0, out, &qx, isa)
            });
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512Vnni && group.is_multiple_of(64) && n >= LANE_ROWS_MIN_TOKENS {
            // Many tokens: 16 rows at a time, one row per lane (weights transposed once per block).
            return par_row_blocks(self.rows, n, 16, rb, |r0, out| {
                let k = out.len() / n;
                let mut scratch = avx512::LaneScratch::default();
                for i in (0..k).step_by(16) {
                    let nr = 16.min(k - i);
                    let r = r0 + i;
                    // the next block's weights, prefetched while this one is transposed
                    let ahead = &data
                        [((r + nr) * rb).min(data.len())..((r + nr + 16) * rb).min(data.len())];
                    // SAFETY: `Isa::Avx512Vnni` is only constructed after checking
                    // avx512f/bw/vnni and avx2.
                    unsafe {
                        avx512::rows16_dot_i8(
                            self.kind,
                            group,
                            &data[r * rb..(r + nr) * rb],
                            &scales[r * ng..(r + nr) * ng],
                            &qx,
                            &mut scratch,
                            &mut out[i * n..(i + nr) * n],
                            ahead,
                        )
                    };
                }
            });
        }
        let row = |r: usize| &data[r * rb..(r + 1) * rb];
        let sc = |r: usize| &scales[r * ng..(r + 1) * ng];
        // Computes rows `r0..r0 + R` (`k0` within this chunk) against tokens `t0..t0 + T`.
        let block = |out: &mut [f32], k0: usize, r0: usize, t0: usize, r_t: (usize, usize)| {
            macro_rules! run {
                ($r:literal, $t:literal) => {{
                    // the weights of the block after this one
                    let from = ((r0 + $r) * rb).min(data.len());
                    let to = ((r0 + 2 * $r) * rb).min(data.len());
                    let ahead = &data[from..to];
                    let res = block_dot_i8::<$r, $t>(
                        self.kind,
                        group,
                        std::array::from_fn(|i| row(r0 + i)),
                        std::array::from_fn(|i| sc(r0 + i)),
                        std::array::from_fn(|i| &qx[t0 + i]),
                        ahead,
                        isa,
                    );
                    for (i, rr) in res.iter().enumerate() {
                        out[(k0 + i) * n + t0..][..$t].copy_from_slice(rr);
                    }
                }};
            }
            match r_t {
                (1, 4) => run!(1, 4),
                (4, 1) => run!(4, 1),
                _ => run!(1, 1),
            }
        };
        par_row_blocks(self.rows, n, ROW_BLOCK, rb, |r0, out| {
            let k = out.len() / n;
            // Tiles of 4 tokens a row at a time; the remaining tokens 4 rows at a time.
            let full = n - n % 4;
            for i in 0..k {
                for t0 in (0..full).step_by(4) {
                    block(out, i, r0 + i, t0, (1, 4));
                }
            }
            for t0 in full..n {
                let mut i = 0;
                while i < k {
                    let r = if k - i >= 4 { 4 } else { 1 };
                    block(out, i, r0 + i, t0, (r, 1));
                    i += r;
                }
            }
        })
    }
}

/// Elements per nibble block of int4 weights on the integer path: 64 where the group allows
/// (one 32-byte load of packed weights), else 32.
pub(super) fn nibble_block(group: usize) -> usize {
    if group.is_multiple_of(64) {
        64
    } else {
        32
    }
}

impl QMatrix {
    /// `x` (`[n, cols]`) quantized per token in this matrix's groups, in the nibble order of
    /// int4 weights (see [`QuantizedActs`]).
    fn quantize_acts(&self, x: &[f32], n: usize, isa: Isa) -> Vec<QuantizedActs> {
        let cols = self.cols;
        (0..n)
            .map(|t| QuantizedActs::new(&x[t * cols..(t + 1) * cols], self.group, self.kind, isa))
            .collect()
    }

    /// Rows `r0..r0 + out.len() / n` of a [`Layout::Lanes16`] matrix against the quantized
    /// tokens `qx` into `out`, 16 rows at a time, each 16 rows' part `[n, 16]` (see
    /// [`par_lane_blocks`]); `r0` and the row count are multiples of 16.
    #[cfg(target_arch = "x86_64")]
    fn lanes_rows(&self, r0: usize, out: &mut [f32], qx: &[QuantizedActs], isa: Isa) {
        let (n, ng, rb) = (qx.len(), self.groups(), self.row_bytes());
        let (data, scales): (&[u8], &[f32]) = (&self.data, &self.scales);
        for (i, o) in out.chunks_exact_mut(16 * n).enumerate() {
            let r = r0 + 16 * i;
            let (blk, sc) = (&data[r * rb..(r + 16) * rb], &scales[r * ng..(r + 16) * ng]);
            // SAFETY: a `Lanes16` matrix reaches here only with `Isa::Avx512Vnni` or
            // `Isa::Avx2`, constructed only after checking avx512f/bw/vnni and avx2, or avx2
            // and fma.
            unsafe {
                if isa == Isa::Avx512Vnni {
                    avx512::lanes16_dot_i8(self.kind, self.group, blk, sc, qx, o)
                } else {
                    avx2::lanes16_dot_i8(self.kind, self.group, blk, sc, qx, o)
                }
            };
        }
    }

    /// `a x` and `b x` for two matrices that read the same input (a SwiGLU block's gate and up)
    /// as one parallel loop over their rows, side by side (`[n, a.rows + b.rows]`: each token's
    /// `a x`, then its `b x`; each exactly as [`QMatrix::matmul_with`] computes it), where both
    /// take the lane kernels with int8 activations in the same groups (`x` quantized once);
    /// `None` where they do not.
    pub fn matmul_pair_joined(
        a: &Self,
        b: &Self,
        x: &[f32],
        n: usize,
        isa: Isa,
    ) -> Option<Vec<f32>> {
        #[cfg(target_arch = "x86_64")]
        if a.fuses_with(b, isa) {
            assert_eq!(x.len(), n * a.cols, "matmul input is not [n, cols]");
            let qx = a.quantize_acts(x, n, isa);
            // rows of `a` then rows of `b` (the same row bytes), in 16-row blocks: both row
            // counts are multiples of 16, so no block straddles the two
            return Some(par_lane_blocks(
                a.rows + b.rows,
                n,
                a.row_bytes(),
                |r0, out| {
                    let k = out.len() / n;
                    let split = a.rows.clamp(r0, r0 + k) - r0;
                    let (oa, ob) = out.split_at_mut(split * n);
                    if !oa.is_empty() {
                        a.lanes_rows(r0, oa, &qx, isa);
                    }
                    if !ob.is_empty() {
                        b.lanes_rows(r0 + split - a.rows, ob, &qx, isa);
                    }
                },
            ));
        }
        let _ = (a, b, x, n, isa);
        None
    }

    /// Whether [`QMatrix::matmul_pair_joined`] runs `self` and `other` as one loop on `isa`.
    #[cfg(target_arch = "x86_64")]
    fn fuses_with(&self, other: &Self, isa: Isa) -> bool {
        let lanes = |m: &Self| {
            m.layout == Layout::Lanes16 && m.act == Activations::Int8 && m.integer_path()
        };
        matches!(isa, Isa::Avx2 | Isa::Avx512Vnni)
            && lanes(self)
            && lanes(other)
            && self.kind == other.kind
            && self.cols == other.cols
            && self.group == other.group
    }
}

/// One token's activations quantized to int8 per group. For int4 weights each nibble block (see
/// [`nibble_block`]) is stored in nibble order, its even elements then its odd ones, so that the
/// packed bytes' low nibbles meet the first half and their high nibbles the second.
pub(super) struct QuantizedActs {
    pub(super) q: Vec<i8>,
    pub(super) scale: Vec<f32>,
    /// Per group: the offset correction of kernels that feed weights as unsigned bytes (`q + 8`
    /// for int4, `w + 128` for int8): the offset times the sum of the group's int8 activations.
    pub(super) off: Vec<i32>,
}

impl QuantizedActs {
    /// `kind`: the weights' (int4 or int8), which sets the order and the offset.
    pub(super) fn new(x: &[f32], group: usize, kind: QuantKind, isa: Isa) -> Self {
        let int4 = kind == QuantKind::Int4;
        let mut q = vec![0i8; x.len()];
        let mut scale = Vec::with_capacity(x.len() / group);
        let mut off = Vec::with_capacity(x.len() / group);
        let (nb, bias) = (nibble_block(group), unsigned_offset(kind));
        let mut codes = vec![0i8; if int4 { group } else { 0 }];
        for (g, xs) in x.chunks(group).enumerate() {
            let qg = &mut q[g * group..(g + 1) * group];
            if int4 {
                scale.push(quantize_group(xs, &mut codes, isa));
                nibble_order(&codes, qg, nb, isa);
            } else {
                scale.push(quantize_group(xs, qg, isa));
            }
            off.push(bias * code_sum(qg, isa));
        }
        Self { q, scale, off }
    }
}

/// `dst` = `src`'s codes in nibble order, blocks of `nb` (see [`nibble_block`]): each block's
/// even elements, then its odd ones. Every ISA moves the same bytes.
pub(super) fn nibble_order(src: &[i8], dst: &mut [i8], nb: usize, isa: Isa) {
    assert!(src.len() == dst.len() && src.len().is_multiple_of(nb));
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma (implied by
        // Avx512Vnni).
        Isa::Avx2 | Isa::Avx512Vnni if nb == 32 || nb == 64 => unsafe {
            avx2::nibble_order(src, dst, nb)
        },
        _ => scalar::nibble_order(src, dst, nb),
    }
}

/// The sum of a group's int8 codes, the same on every ISA.
pub(super) fn code_sum(xs: &[i8], isa: Isa) -> i32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in [`nibble_order`].
        Isa::Avx2 | Isa::Avx512Vnni if xs.len().is_multiple_of(32) => unsafe { avx2::sum_i8(xs) },
        _ => scalar::code_sum(xs),
    }
}

/// Quantizes one group of activations to int8 codes (scale `amax / 127`, round half away from
/// zero, clamp to +-127, NaN to 0) and returns the scale. Every ISA gives the same codes.
pub(super) fn quantize_group(xs: &[f32], out: &mut [i8], isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma (implied by
        // Avx512Vnni).
        Isa::Avx2 | Isa::Avx512Vnni if xs.len().is_multiple_of(8) => unsafe {
            avx2::quantize_group(xs, out)
        },
        _ => scalar::quantize_group(xs, out),
    }
}

/// Rows per block of the integer path's parallel split (its row kernels take 1 or 4 rows).
pub(super) const ROW_BLOCK: usize = 4;

/// From this many tokens the VNNI integer path computes 16 rows at a time, one per lane.
#[cfg(target_arch = "x86_64")]
pub(super) const LANE_ROWS_MIN_TOKENS: usize = 4;

/// `R` rows against `T` tokens' int8 activations (`R * T` is 1 or 4): per row, token and group an
/// exact i32 dot product of the packed weights (int8, or int4 nibbles stored as `q + 8`) with the
/// activations in matching order, then `acc = fma(scale_w[g] * scale_x[g], isum, acc)` in group
/// order, so each result is the same whatever `R` and `T` are: several rows and tokens only share
/// loads, unpacking, the reduction and the loop, and keep independent accumulator chains.
/// `ahead` (the weights computed next, possibly empty) is prefetched into cache along the way: the
/// rows' interleaved reads hide the order from the hardware prefetchers.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) fn block_dot_i8<const R: usize, const T: usize>(
    kind: QuantKind,
    group: usize,
    rows: [&[u8]; R],
    sc: [&[f32]; R],
    a: [&QuantizedActs; T],
    ahead: &[u8],
    isa: Isa,
) -> [[f32; T]; R] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Vnni` is only constructed after checking avx512f/bw/vnni and avx2.
        Isa::Avx512Vnni if group.is_multiple_of(64) => unsafe {
            avx512::block_dot_i8(kind, group, rows, sc, a, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 (implied by Avx512Vnni).
        Isa::Avx2 | Isa::Avx512Vnni => unsafe {
            avx2::block_dot_i8(
                kind,
                group,
                rows,
                sc,
                a.map(|x| &x.q[..]),
                a.map(|x| &x.scale[..]),
                ahead,
            )
        },
        _ => std::array::from_fn(|r| {
            a.map(|x| scalar::row_dot_i8(kind, group, rows[r], sc[r], &x.q, &x.scale))
        }),
    }
}

/// Spreads prefetches of a byte range over the `steps` steps of a loop.
pub(super) struct Prefetch {
    ptr: *const u8,
    len: usize,
    per_step: usize,
}

impl Prefetch {
    const LINE: usize = 64;

    pub(super) fn new(range: &[u8], steps: usize) -> Self {
        Self {
            ptr: range.as_ptr(),
            len: range.len(),
            per_step: range.len().div_ceil(steps.max(1)),
        }
    }

    /// Prefetches step `i`'s share of the range into all cache levels.
    #[inline(always)]
    pub(super) fn step(&self, i: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let end = ((i + 1) * self.per_step).min(self.len);
            let mut o = i * self.per_step;
            while o < end {
                // SAFETY: `o < len`, inside the range; prefetching never faults.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        self.ptr.add(o) as *const i8,
                    )
                };
                o += Self::LINE;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }
}

/// Sum of 8 lanes in the fixed tree every kernel uses.
#[inline]
pub(super) fn tree(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

pub(super) fn lane_sum_scalar(x: &[f32]) -> f32 {
    let mut l = [0.0f32; 8];
    for c in x.chunks_exact(8) {
        for k in 0..8 {
            l[k] += c[k];
        }
    }
    tree(&l)
}

/// Row `r`'s `ng` per-group values (scales or offsets), or nothing for a format without them.
pub(super) fn part(v: &[f32], r: usize, ng: usize) -> &[f32] {
    if v.is_empty() {
        v
    } else {
        &v[r * ng..(r + 1) * ng]
    }
}

/// The offset of the unsigned bytes the VNNI kernels feed `vpdpbusd` as weights: int4 nibbles are
/// stored as `q + 8`, int8 weights go in as `w + 128`; `offset * sum(activations)` is subtracted.
pub(super) fn unsigned_offset(kind: QuantKind) -> i32 {
    if kind == QuantKind::Int8 {
        128
    } else {
        8
    }
}

/// Where a row's integer codes come from: its packed bytes, or already decoded to f32.
#[derive(Clone, Copy)]
pub(super) enum Codes<'a> {
    Packed(&'a [u8]),
    Decoded(&'a [f32]),
}

/// One row times one token, dispatched on `isa`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) fn row_dot(
    kind: QuantKind,
    group: usize,
    codes: Codes<'_>,
    sc: &[f32],
    mn: &[f32],
    x: &[f32],
    xs: &[f32],
    isa: Isa,
) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed by `detect()` after checking avx2 and fma.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::row_dot(kind, group, codes, sc, mn, x, xs) },
        _ => scalar::row_dot(kind, group, codes, sc, mn, x, xs),
    }
}

/// Decodes a packed row's codes (integer levels, or bf16 values) into f32.
pub(super) fn decode_row(kind: QuantKind, row: &[u8], out: &mut [f32], isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::decode_row(kind, row, out) },
        _ => {
            for i in (0..out.len()).step_by(8) {
                out[i..i + 8].copy_from_slice(&scalar::codes8(kind, row, i));
            }
        }
    }
}
