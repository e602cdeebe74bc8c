use std::arch::x86_64::*;

use super::{Codes, QuantKind, QuantizedActs, PREFETCH_GROUPS};

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn hsum_tree(v: __m256) -> f32 {
    // lanes (0+4, 1+5, 2+6, 3+7), then ((a+b) + (c+d)): the scalar tree's order.
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let mut a = [0.0f32; 4];
    // SAFETY: `a` has room for 4 floats.
    unsafe { _mm_storeu_ps(a.as_mut_ptr(), s) };
    (a[0] + a[1]) + (a[2] + a[3])
}

/// AVX2 twin of [`super::scalar::quantize_group`] for lengths that are multiples of 8: the
/// same maximum (NaN ignored), the same scale and reciprocal, and round half away from zero
/// as `trunc(y) + (|y - trunc(y)| >= 0.5 ? sign(y) : 0)` (the difference is exact).
#[target_feature(enable = "avx2,fma")]
pub(super) fn quantize_group(xs: &[f32], out: &mut [i8]) -> f32 {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let mut m = _mm256_setzero_ps();
    for c in xs.chunks_exact(8) {
        // SAFETY: `c` holds 8 floats.
        let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        // max_ps returns its second operand when either is NaN: NaNs are skipped
        m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` has room for 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let amax = lanes.iter().fold(0.0f32, |a, v| a.max(*v));
    let d = amax / 127.0;
    let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    let sign = _mm256_set1_ps(-0.0);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // 8 codes as i32, from 8 floats
    let code = |c: &[f32]| {
        // SAFETY: `c` holds 8 floats.
        let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, inv);
        let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        let f = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
        let away = _mm256_and_ps(_mm256_cmp_ps(f, half, _CMP_GE_OQ), one);
        let r = _mm256_add_ps(t, _mm256_or_ps(away, _mm256_and_ps(y, sign)));
        let r = _mm256_and_ps(r, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    };
    let full = xs.len() - xs.len() % 32;
    // 32 codes at a time, narrowed by two packs (the codes lie within +-127, so nothing
    // saturates) and put back in order across the 128-bit lanes
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (c, o) in xs[..full].chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        let v: [__m256i; 4] = std::array::from_fn(|i| code(&c[8 * i..8 * i + 8]));
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(v[0], v[1]),
            _mm256_packs_epi32(v[2], v[3]),
        );
        let w = _mm256_permutevar8x32_epi32(w, order);
        // SAFETY: `o` holds 32 bytes.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, w) };
    }
    for (c, o) in xs[full..]
        .chunks_exact(8)
        .zip(out[full..].chunks_exact_mut(8))
    {
        let mut v = [0i32; 8];
        // SAFETY: `v` has room for 8 i32.
        unsafe { _mm256_storeu_si256(v.as_mut_ptr() as *mut __m256i, code(c)) };
        for (a, b) in o.iter_mut().zip(v) {
            *a = b as i8;
        }
    }
    d
}

/// `dst` = the codes of `src` in nibble order, blocks of `nb` (32 or 64) codes each: a block's
/// even elements, then its odd ones (see [`super::QuantizedActs`]); lengths are multiples of `nb`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn nibble_order(src: &[i8], dst: &mut [i8], nb: usize) {
    assert!(src.len() == dst.len() && (nb == 32 || nb == 64) && src.len().is_multiple_of(nb));
    // per 128-bit lane: its 8 even bytes, then its 8 odd ones
    let split = _mm256_setr_epi8(
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
        7, 9, 11, 13, 15,
    );
    // 32 codes as (16 evens, 16 odds)
    let halves = |c: &[i8]| {
        // SAFETY: `c` holds 32 bytes.
        let v = unsafe { _mm256_loadu_si256(c.as_ptr() as *const __m256i) };
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(v, split))
    };
    let store = |o: &mut [i8], v: __m256i| {
        // SAFETY: `o` holds 32 bytes.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, v) }
    };
    for (s, d) in src.chunks_exact(nb).zip(dst.chunks_exact_mut(nb)) {
        if nb == 32 {
            store(d, halves(s));
        } else {
            let (a, b) = (halves(&s[..32]), halves(&s[32..]));
            let (evens, odds) = d.split_at_mut(32);
            store(evens, _mm256_permute2x128_si256::<0x20>(a, b));
            store(odds, _mm256_permute2x128_si256::<0x31>(a, b));
        }
    }
}

/// The sum of `xs` (a length that is a multiple of 32).
#[target_feature(enable = "avx2,fma")]
pub(super) fn sum_i8(xs: &[i8]) -> i32 {
    assert!(xs.len().is_multiple_of(32));
    let (ones, mut acc) = (_mm256_set1_epi16(1), _mm256_setzero_si256());
    for c in xs.chunks_exact(32) {
        // SAFETY: `c` holds 32 bytes.
        let v = unsafe { _mm256_loadu_si256(c.as_ptr() as *const __m256i) };
        let lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        let hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(v));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones));
    }
    let mut l = [0i32; 8];
    // SAFETY: `l` has room for 8 i32.
    unsafe { _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, acc) };
    l.iter().sum()
}

/// 8 codes starting at element `i`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn codes8(kind: QuantKind, row: &[u8], i: usize) -> __m256 {
    match kind {
        QuantKind::Bf16 => {
            let b = &row[2 * i..2 * i + 16];
            // SAFETY: `b` holds 16 bytes.
            let h = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
        QuantKind::Int8 => {
            let b = &row[i..i + 8];
            // SAFETY: `b` holds 8 bytes.
            let h = unsafe { _mm_loadl_epi64(b.as_ptr() as *const __m128i) };
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h))
        }
        QuantKind::Int4 => {
            let w = u32::from_le_bytes(row[i / 2..i / 2 + 4].try_into().expect("4 bytes"));
            let v = _mm256_set1_epi32(w as i32);
            let sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let c = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(15));
            _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8)))
        }
        QuantKind::Int2 => {
            let w = u16::from_le_bytes([row[i / 4], row[i / 4 + 1]]);
            let v = _mm256_set1_epi32(w as i32);
            let sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
            let c = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(3));
            _mm256_cvtepi32_ps(c)
        }
    }
}

/// i8 x i8 products of 32 pairs, summed in i32 lanes: `maddubs` on `aw = |w|` and the
/// activations with `w`'s signs.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot32_abs(aw: __m256i, w: __m256i, a: __m256i) -> __m256i {
    let sa = _mm256_sign_epi8(a, w);
    _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1))
}

/// The four sums `[sum(a), sum(b), sum(c), sum(d)]` of 8-lane i32 vectors (exact).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn reduce4(v: [__m256i; 4]) -> __m128i {
    let ab = _mm256_hadd_epi32(v[0], v[1]);
    let cd = _mm256_hadd_epi32(v[2], v[3]);
    let abcd = _mm256_hadd_epi32(ab, cd);
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256(abcd, 1),
    )
}

/// The float step of the integer path for the `R * T <= 4` (row, token) pairs of a block, pair
/// `p = r * T + t` in lane `p`: `acc = fma(sc[r][g] * ascale[t][g], isum, acc)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn fma_step<const R: usize, const T: usize>(
    acc: __m128,
    isum: __m128i,
    sc: [&[f32]; R],
    ascale: [&[f32]; T],
    g: usize,
) -> __m128 {
    let mut p = [0.0f32; 4];
    for r in 0..R {
        for t in 0..T {
            p[r * T + t] = sc[r][g] * ascale[t][g];
        }
    }
    // SAFETY: `p` holds 4 floats.
    let pv = unsafe { _mm_loadu_ps(p.as_ptr()) };
    _mm_fmadd_ps(pv, _mm_cvtepi32_ps(isum), acc)
}

/// Unpacks `acc` (pair `r * T + t` in lane `r * T + t`) into `[rows][tokens]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn unpack<const R: usize, const T: usize>(acc: __m128) -> [[f32; T]; R] {
    let mut v = [0.0f32; 4];
    // SAFETY: `v` has room for 4 floats.
    unsafe { _mm_storeu_ps(v.as_mut_ptr(), acc) };
    std::array::from_fn(|r| std::array::from_fn(|t| v[r * T + t]))
}

/// AVX2 twin of [`super::scalar::row_dot_i8`] for `R` rows and `T` tokens, `R * T` being 1 or
/// 4 (see [`super::block_dot_i8`]): the same exact integer sums and fused float steps, so the
/// same results.
#[target_feature(enable = "avx2,fma")]
pub(super) fn block_dot_i8<const R: usize, const T: usize>(
    kind: QuantKind,
    group: usize,
    rows: [&[u8]; R],
    sc: [&[f32]; R],
    aq: [&[i8]; T],
    ascale: [&[f32]; T],
    ahead: &[u8],
) -> [[f32; T]; R] {
    assert!(R * T <= 4);
    let gb = group * kind.bits() / 8;
    let ng = aq[0].len() / group;
    let pf = super::Prefetch::new(ahead, ng);
    for r in 0..R {
        assert!(rows[r].len() >= ng * gb && sc[r].len() >= ng);
    }
    for t in 0..T {
        assert!(aq[t].len() >= ng * group && ascale[t].len() >= ng);
    }
    let (wp, ap) = (rows.map(|r| r.as_ptr()), aq.map(|a| a.as_ptr()));
    // SAFETY (every load below): weight offsets stay below `ng * gb` and activation offsets
    // below `ng * group`, the lengths asserted above.
    let ld = |p: *const u8| unsafe { _mm256_loadu_si256(p as *const __m256i) };
    let lda = |t: usize, i: usize| unsafe { _mm256_loadu_si256(ap[t].add(i) as *const __m256i) };
    let eight = _mm256_set1_epi8(8);
    let m = _mm256_set1_epi8(15);
    let mut acc = _mm_setzero_ps();
    for g in 0..ng {
        pf.step(g);
        let (wo, base) = (g * gb, g * group);
        let mut s = [[_mm256_setzero_si256(); T]; R];
        match kind {
            QuantKind::Int8 => {
                for c in 0..group / 32 {
                    let av: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 32 * c));
                    for r in 0..R {
                        // SAFETY: see above.
                        let wv = ld(unsafe { wp[r].add(wo + 32 * c) });
                        let aw = _mm256_sign_epi8(wv, wv);
                        for t in 0..T {
                            s[r][t] = _mm256_add_epi32(s[r][t], dot32_abs(aw, wv, av[t]));
                        }
                    }
                }
            }
            _ if group.is_multiple_of(64) => {
                // 64-element nibble blocks: 32 packed bytes, low nibbles meet the first 32
                // activations, high nibbles the next 32.
                for c in 0..group / 64 {
                    let a0: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 64 * c));
                    let a1: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 64 * c + 32));
                    for r in 0..R {
                        // SAFETY: see above.
                        let v = ld(unsafe { wp[r].add(wo + 32 * c) });
                        let lo = _mm256_sub_epi8(_mm256_and_si256(v, m), eight);
                        let hi =
                            _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), m), eight);
                        let (alo, ahi) = (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi));
                        for t in 0..T {
                            let d = _mm256_add_epi32(
                                dot32_abs(alo, lo, a0[t]),
                                dot32_abs(ahi, hi, a1[t]),
                            );
                            s[r][t] = _mm256_add_epi32(s[r][t], d);
                        }
                    }
                }
            }
            _ => {
                let m = _mm_set1_epi8(15);
                for c in 0..group / 32 {
                    let av: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 32 * c));
                    for r in 0..R {
                        // SAFETY: see above (16 bytes).
                        let v =
                            unsafe { _mm_loadu_si128(wp[r].add(wo + 16 * c) as *const __m128i) };
                        let lo = _mm_and_si128(v, m);
                        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
                        let wv = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
                        let aw = _mm256_sign_epi8(wv, wv);
                        for t in 0..T {
                            s[r][t] = _mm256_add_epi32(s[r][t], dot32_abs(aw, wv, av[t]));
                        }
                    }
                }
            }
        }
        let mut v = [_mm256_setzero_si256(); 4];
        for r in 0..R {
            for t in 0..T {
                v[r * T + t] = s[r][t];
            }
        }
        acc = fma_step(acc, reduce4(v), sc, ascale, g);
    }
    unpack(acc)
}

/// Dequantizes a packed int8 or int4 row: each code times its group's scale (one rounding, as
/// the scalar `code as f32 * scale`), decoded and scaled in registers.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dequantize_row(
    kind: QuantKind,
    group: usize,
    row: &[u8],
    sc: &[f32],
    out: &mut [f32],
) {
    debug_assert!(matches!(kind, QuantKind::Int8 | QuantKind::Int4) && group.is_multiple_of(8));
    for (g, o) in out.chunks_exact_mut(group).enumerate() {
        let s = _mm256_set1_ps(sc[g]);
        for (j, o8) in o.chunks_exact_mut(8).enumerate() {
            let v = _mm256_mul_ps(codes8(kind, row, g * group + 8 * j), s);
            // SAFETY: `o8` holds 8 floats.
            unsafe { _mm256_storeu_ps(o8.as_mut_ptr(), v) };
        }
    }
}

/// Decodes a packed row into f32 codes.
#[target_feature(enable = "avx2,fma")]
pub(super) fn decode_row(kind: QuantKind, row: &[u8], out: &mut [f32]) {
    for i in (0..out.len()).step_by(8) {
        let o = &mut out[i..i + 8];
        // SAFETY: `o` holds 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), codes8(kind, row, i)) };
    }
}

/// [`row_dot`] of `R` packed rows against one token, their accumulator chains interleaved (each
/// row's arithmetic is exactly `row_dot`'s); `ahead` is prefetched along the way.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub(super) fn rows_dot<const R: usize>(
    kind: QuantKind,
    group: usize,
    rows: [&[u8]; R],
    sc: [&[f32]; R],
    mn: [&[f32]; R],
    x: &[f32],
    xs: &[f32],
    ahead: &[u8],
) -> [f32; R] {
    let ng = x.len() / group;
    let pf = super::Prefetch::new(ahead, ng);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut offs = [0.0f32; R];
    for g in 0..ng {
        pf.step(g);
        let mut l = [_mm256_setzero_ps(); R];
        for i in (g * group..(g + 1) * group).step_by(8) {
            let xv = &x[i..i + 8];
            // SAFETY: `xv` holds 8 floats.
            let xv = unsafe { _mm256_loadu_ps(xv.as_ptr()) };
            for r in 0..R {
                l[r] = _mm256_fmadd_ps(codes8(kind, rows[r], i), xv, l[r]);
            }
        }
        for r in 0..R {
            let s = if kind == QuantKind::Bf16 {
                1.0
            } else {
                sc[r][g]
            };
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), l[r], acc[r]);
            if kind == QuantKind::Int2 {
                offs[r] = mn[r][g].mul_add(xs[g], offs[r]);
            }
        }
    }
    std::array::from_fn(|r| hsum_tree(acc[r]) + offs[r])
}

/// [`row_dot`] over a row's codes (packed, decoded as they are read, or decoded before) for `T`
/// tokens, their accumulator chains interleaved (each token's arithmetic is exactly
/// `row_dot`'s).
#[target_feature(enable = "avx2,fma")]
pub(super) fn codes_dot<const T: usize>(
    kind: QuantKind,
    group: usize,
    codes: Codes<'_>,
    sc: &[f32],
    mn: &[f32],
    x: [&[f32]; T],
    xs: [&[f32]; T],
) -> [f32; T] {
    let cols = x[0].len();
    let ng = cols / group;
    for xt in x {
        assert_eq!(xt.len(), cols);
    }
    match codes {
        Codes::Decoded(d) => assert_eq!(d.len(), cols),
        Codes::Packed(p) => assert!(8 * p.len() >= cols * kind.bits()),
    }
    let mut acc = [_mm256_setzero_ps(); T];
    let mut offs = [0.0f32; T];
    for g in 0..ng {
        let mut l = [_mm256_setzero_ps(); T];
        for i in (g * group..(g + 1) * group).step_by(8) {
            let c = match codes {
                Codes::Packed(row) => codes8(kind, row, i),
                // SAFETY: `i + 8 <= cols`, the length of `d` (asserted).
                Codes::Decoded(d) => unsafe { _mm256_loadu_ps(d.as_ptr().add(i)) },
            };
            for t in 0..T {
                // SAFETY: as above.
                let xv = unsafe { _mm256_loadu_ps(x[t].as_ptr().add(i)) };
                l[t] = _mm256_fmadd_ps(c, xv, l[t]);
            }
        }
        let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
        for t in 0..T {
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(s), l[t], acc[t]);
            if kind == QuantKind::Int2 {
                offs[t] = mn[g].mul_add(xs[t][g], offs[t]);
            }
        }
    }
    std::array::from_fn(|t| hsum_tree(acc[t]) + offs[t])
}

/// AVX2 twin of [`super::scalar::row_dot`]: the same lanes, order and fused multiply-adds, so
/// the results are bit-identical.
#[target_feature(enable = "avx2,fma")]
pub(super) fn row_dot(
    kind: QuantKind,
    group: usize,
    codes: Codes<'_>,
    sc: &[f32],
    mn: &[f32],
    x: &[f32],
    xs: &[f32],
) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut offs = 0.0f32;
    for g in 0..x.len() / group {
        let mut l = _mm256_setzero_ps();
        for i in (g * group..(g + 1) * group).step_by(8) {
            let xv = &x[i..i + 8];
            // SAFETY: `xv` holds 8 floats.
            let xv = unsafe { _mm256_loadu_ps(xv.as_ptr()) };
            let c = match codes {
                Codes::Packed(row) => codes8(kind, row, i),
                // SAFETY: `d` holds the row's `cols` codes and `i + 8 <= cols`.
                Codes::Decoded(d) => unsafe { _mm256_loadu_ps(d[i..i + 8].as_ptr()) },
            };
            l = _mm256_fmadd_ps(c, xv, l);
        }
        let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s), l, acc);
        if kind == QuantKind::Int2 {
            offs = mn[g].mul_add(xs[g], offs);
        }
    }
    hsum_tree(acc) + offs
}

/// 16 rows stored in [`super::Layout::Lanes16`] (`blk`, `sc`: one block's weights and scales)
/// against every token in `acts`, one row per 32-bit lane as on the VNNI path: each 64-byte
/// line of the block is read as two 256-bit halves (rows 0-7 and rows 8-15), so a group's
/// integer sums need no horizontal reduction; up to four tokens share each weight load, and
/// each activation broadcast serves both halves.
/// `vpmaddubsw` cannot overflow here: int4 codes are unsigned nibbles (at most 15 x 128 x 2 per
/// pair, and eight such sums stay below 2^15 in 16 bits), int8 codes go in as magnitudes with
/// their signs moved onto the activations (at most 128 x 127 x 2). The integer sums are exact, then per group `acc = fma(scale_w * scale_x,
/// isum, acc)` per lane: the arithmetic (and the bits) of [`super::scalar::row_dot_i8`].
/// `out` is `[tokens, 16]`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn lanes16_dot_i8(
    kind: QuantKind,
    group: usize,
    blk: &[u8],
    sc: &[f32],
    acts: &[QuantizedActs],
    out: &mut [f32],
) {
    let n = acts.len();
    let ng = acts[0].q.len() / group;
    assert!(blk.len() == 16 * ng * group * kind.bits() / 8 && sc.len() == 16 * ng);
    assert!(out.len() == 16 * n && group.is_multiple_of(64));
    assert!(matches!(kind, QuantKind::Int8 | QuantKind::Int4));
    for x in acts {
        assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.off.len() >= ng);
    }
    let z = _mm256_setzero_ps();
    let mut t = 0;
    while t < n {
        let k = (n - t).min(4);
        let x = |i: usize| &acts[t + i];
        let res: [[__m256; 4]; 2] = match k {
            4 => lanes16_dot::<4>(kind, group, ng, blk, sc, [x(0), x(1), x(2), x(3)]),
            3 => lanes16_dot::<3>(kind, group, ng, blk, sc, [x(0), x(1), x(2)])
                .map(|[a, b, c]| [a, b, c, z]),
            2 => {
                lanes16_dot::<2>(kind, group, ng, blk, sc, [x(0), x(1)]).map(|[a, b]| [a, b, z, z])
            }
            _ => lanes16_dot::<1>(kind, group, ng, blk, sc, [x(0)]).map(|[a]| [a, z, z, z]),
        };
        for (half, res) in res.iter().enumerate() {
            for (i, v) in res.iter().enumerate().take(k) {
                let o = &mut out[16 * (t + i) + 8 * half..16 * (t + i) + 8 * half + 8];
                // SAFETY: `o` has room for 8 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *v) };
            }
        }
        t += k;
    }
}

/// One [`lanes16_dot_i8`] block for `P` tokens (the caller checks the lengths), group by
/// group: each line's two halves (rows 0-7 and rows 8-15) are read together, so every line is
/// fetched once and each activation broadcast serves both halves.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lanes16_dot<const P: usize>(
    kind: QuantKind,
    group: usize,
    ng: usize,
    blk: &[u8],
    sc: &[f32],
    acts: [&QuantizedActs; P],
) -> [[__m256; P]; 2] {
    let gb = group * kind.bits() / 8;
    let mut acc = [[_mm256_setzero_ps(); P]; 2];
    for g in 0..ng {
        // the lines of the group PREFETCH_GROUPS ahead (past the block's end: the next
        // block's, which the caller computes next); a prefetch never faults
        let ahead = blk.as_ptr().wrapping_add(16 * (g + PREFETCH_GROUPS) * gb);
        for l in 0..gb / 4 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l) as *const i8);
        }
        lanes16_group::<P>(kind, group, g, blk, sc, acts, &mut acc);
    }
    acc
}

/// Group `g` of the 16 rows of a [`lanes16_dot_i8`] block for `P` tokens, added to `acc`
/// (`acc[half][token]`, lanes: rows `8 * half ..`; the caller checks the lengths).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lanes16_group<const P: usize>(
    kind: QuantKind,
    group: usize,
    g: usize,
    blk: &[u8],
    sc: &[f32],
    acts: [&QuantizedActs; P],
    acc: &mut [[__m256; P]; 2],
) {
    let gb = group * kind.bits() / 8;
    let qp = acts.map(|x| x.q.as_ptr());
    let (m, ones) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1));
    // SAFETY (loads below): line `d < gb / 4` of group `g` lies at `16 * (g * gb + 4 * d)`
    // in `blk`, which holds `16 * ng * gb` bytes, and half `h` is its bytes 32 * h .. 32 * h
    // + 32; activation offsets stay below `(g + 1) * group <= ng * group`.
    let w = unsafe { blk.as_ptr().add(16 * g * gb) };
    let ld = |d: usize| unsafe {
        let p = w.add(64 * d);
        [
            _mm256_loadu_si256(p as *const __m256i),
            _mm256_loadu_si256(p.add(32) as *const __m256i),
        ]
    };
    let bc = |t: usize, i: usize| unsafe {
        _mm256_set1_epi32((qp[t].add(g * group + i) as *const i32).read_unaligned())
    };
    let mut s = [[_mm256_setzero_si256(); P]; 2];
    if kind == QuantKind::Int8 {
        for d in 0..gb / 4 {
            let wv = ld(d);
            let aw = wv.map(|v| _mm256_abs_epi8(v));
            for t in 0..P {
                let a = bc(t, 4 * d);
                for h in 0..2 {
                    let p = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(a, wv[h]));
                    s[h][t] = _mm256_add_epi32(s[h][t], _mm256_madd_epi16(p, ones));
                }
            }
        }
    } else {
        // int4: line j of a 64-weight block holds elements 4j.. (low nibbles) and 32 + 4j..
        // (high nibbles) of each row, as the activations are ordered. The 16-bit pair sums
        // of four lines (8 products of pairs, each at most 15 x 128 x 2) add up exactly below
        // 2^15 before one widening `vpmaddwd`. With one token both halves' nibbles are split
        // first; with more, the tokens' broadcasts are held and the halves go one after the
        // other (fewer live registers: measured faster at 2-6 tokens).
        let nibbles = |v| {
            (
                _mm256_and_si256(v, m),
                _mm256_and_si256(_mm256_srli_epi16(v, 4), m),
            )
        };
        // (low, high) nibbles times their activations, added into `x`
        let add = |x: &mut __m256i, (lo, hi), al, ah| {
            let pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, al), _mm256_maddubs_epi16(hi, ah));
            *x = _mm256_add_epi16(*x, pair);
        };
        for c in 0..group / 64 {
            for j4 in (0..8).step_by(4) {
                let mut x = [[_mm256_setzero_si256(); P]; 2];
                for j in j4..j4 + 4 {
                    let p = ld(8 * c + j);
                    if P == 1 {
                        let n = p.map(nibbles);
                        let (al, ah) = (bc(0, 64 * c + 4 * j), bc(0, 64 * c + 32 + 4 * j));
                        for h in 0..2 {
                            add(&mut x[h][0], n[h], al, ah);
                        }
                        continue;
                    }
                    let al: [__m256i; P] = std::array::from_fn(|t| bc(t, 64 * c + 4 * j));
                    let ah: [__m256i; P] = std::array::from_fn(|t| bc(t, 64 * c + 32 + 4 * j));
                    for h in 0..2 {
                        let n = nibbles(p[h]);
                        for t in 0..P {
                            add(&mut x[h][t], n, al[t], ah[t]);
                        }
                    }
                }
                for h in 0..2 {
                    for t in 0..P {
                        s[h][t] = _mm256_add_epi32(s[h][t], _mm256_madd_epi16(x[h][t], ones));
                    }
                }
            }
        }
        let off: [__m256i; P] = std::array::from_fn(|t| _mm256_set1_epi32(acts[t].off[g]));
        for sh in s.iter_mut() {
            for (st, o) in sh.iter_mut().zip(off) {
                *st = _mm256_sub_epi32(*st, o);
            }
        }
    }
    let sx: [__m256; P] = std::array::from_fn(|t| _mm256_set1_ps(acts[t].scale[g]));
    for h in 0..2 {
        // SAFETY: `sc` holds `16 * ng` floats.
        let sw = unsafe { _mm256_loadu_ps(sc.as_ptr().add(16 * g + 8 * h)) };
        for t in 0..P {
            let scale = _mm256_mul_ps(sw, sx[t]);
            acc[h][t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s[h][t]), acc[h][t]);
        }
    }
}
