use std::arch::x86_64::*;

use super::{QuantKind, QuantizedActs, PREFETCH_SPANS};

/// VNNI twin of [`super::scalar::row_dot_i8`] for `R` rows and `T` tokens, `R * T` being 1
/// or 4 (see [`super::block_dot_i8`]), for groups that are multiples of 64. `vpdpbusd`
/// multiplies unsigned bytes by signed ones, so the weights go in unsigned (int4: the stored
/// nibbles `q + 8`; int8: `w + 128`) and `8 *` (`128 *`) the group's activation sum is
/// subtracted: the integer sums are exact, the float steps the scalar twin's, and so are the
/// results.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub(super) fn block_dot_i8<const R: usize, const T: usize>(
    kind: QuantKind,
    group: usize,
    rows: [&[u8]; R],
    sc: [&[f32]; R],
    a: [&QuantizedActs; T],
    ahead: &[u8],
) -> [[f32; T]; R] {
    assert!(R * T <= 4);
    let gb = group * kind.bits() / 8;
    let ng = a[0].q.len() / group;
    let pf = super::Prefetch::new(ahead, ng);
    for r in 0..R {
        assert!(rows[r].len() >= ng * gb && sc[r].len() >= ng);
    }
    for x in a {
        assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.off.len() >= ng);
    }
    let (wp, ap) = (rows.map(|r| r.as_ptr()), a.map(|x| x.q.as_ptr()));
    // SAFETY (every load below): weight offsets stay below `ng * gb` and activation offsets
    // below `ng * group`, the lengths asserted above.
    let lda = |t: usize, i: usize| unsafe { _mm512_loadu_si512(ap[t].add(i) as *const _) };
    let m = _mm256_set1_epi8(15);
    let flip = _mm512_set1_epi8(-128);
    let fold =
        |v: __m512i| _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    let ascale = a.map(|x| &x.scale[..]);
    let mut acc = _mm_setzero_ps();
    for g in 0..ng {
        pf.step(g);
        let (wo, base) = (g * gb, g * group);
        let mut s = [[_mm512_setzero_si512(); T]; R];
        for c in 0..group / 64 {
            let av: [__m512i; T] = std::array::from_fn(|t| lda(t, base + 64 * c));
            for r in 0..R {
                let w = match kind {
                    // SAFETY: see above (64 bytes).
                    QuantKind::Int8 => _mm512_xor_si512(
                        unsafe { _mm512_loadu_si512(wp[r].add(wo + 64 * c) as *const _) },
                        flip,
                    ),
                    _ => {
                        // SAFETY: see above (32 bytes).
                        let v =
                            unsafe { _mm256_loadu_si256(wp[r].add(wo + 32 * c) as *const __m256i) };
                        // 64-element nibble block: low nibbles meet activations 0..32, high
                        // nibbles 32..64, so the halves go in as they are.
                        let lo = _mm256_and_si256(v, m);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                    }
                };
                for t in 0..T {
                    s[r][t] = _mm512_dpbusd_epi32(s[r][t], w, av[t]);
                }
            }
        }
        let mut v = [_mm256_setzero_si256(); 4];
        let mut corr = [0i32; 4];
        for r in 0..R {
            for t in 0..T {
                v[r * T + t] = fold(s[r][t]);
                corr[r * T + t] = a[t].off[g];
            }
        }
        // SAFETY: `corr` holds 4 i32.
        let cv = unsafe { _mm_loadu_si128(corr.as_ptr() as *const __m128i) };
        let isum = _mm_sub_epi32(super::avx2::reduce4(v), cv);
        acc = super::avx2::fma_step(acc, isum, sc, ascale, g);
    }
    super::avx2::unpack(acc)
}

/// `out[r][t] = w[r] . dword k`, i.e. the 16x16 transpose of 16 rows of 16 dwords.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
fn transpose16(u: [__m512i; 16]) -> [__m512i; 16] {
    // rows (2i, 2i+1) interleaved by dword, then rows 4i..4i+4 by dword pairs: q[4i + m] has,
    // in each 128-bit lane L, dword 4L + m of rows 4i..4i+4
    let t: [__m512i; 16] = std::array::from_fn(|j| {
        let (a, b) = (u[j & !1], u[j | 1]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    let q: [__m512i; 16] = std::array::from_fn(|j| {
        let (i, m) = (j / 4, j % 4);
        let (a, b) = (t[4 * i + m / 2], t[4 * i + 2 + m / 2]);
        if m % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let mut out = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        let v = _mm512_shuffle_i32x4::<0x88>(q[m], q[4 + m]);
        let v2 = _mm512_shuffle_i32x4::<0xdd>(q[m], q[4 + m]);
        let w = _mm512_shuffle_i32x4::<0x88>(q[8 + m], q[12 + m]);
        let w2 = _mm512_shuffle_i32x4::<0xdd>(q[8 + m], q[12 + m]);
        out[m] = _mm512_shuffle_i32x4::<0x88>(v, w);
        out[8 + m] = _mm512_shuffle_i32x4::<0xdd>(v, w);
        out[4 + m] = _mm512_shuffle_i32x4::<0x88>(v2, w2);
        out[12 + m] = _mm512_shuffle_i32x4::<0xdd>(v2, w2);
    }
    out
}

/// `dst[d][r] = src[r][d]` for the dwords of 16 rows of `rd` dwords each (`src`, `dst`:
/// `64 * rd` bytes), 16 columns at a time; returns how many columns it did (the rest, fewer
/// than 16, is the caller's).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub(super) fn transpose_dwords(src: &[u8], dst: &mut [u8], rd: usize) -> usize {
    assert!(src.len() == 64 * rd && dst.len() == 64 * rd);
    let full = rd - rd % 16;
    for d0 in (0..full).step_by(16) {
        // SAFETY: row `r`'s dwords `d0..d0 + 16` end at `4 * (r * rd + d0 + 16) <= 64 * rd`.
        let u: [__m512i; 16] = std::array::from_fn(|r| unsafe {
            _mm512_loadu_si512(src.as_ptr().add(4 * (r * rd + d0)) as *const _)
        });
        for (k, v) in transpose16(u).iter().enumerate() {
            // SAFETY: `64 * (d0 + k) + 64 <= 64 * rd`.
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(64 * (d0 + k)) as *mut _, *v) };
        }
    }
    full
}

/// Buffers [`rows16_dot_i8`] reuses from block to block: the transposed weights and the
/// rows' scales by group (16 lanes).
#[derive(Default)]
pub(super) struct LaneScratch {
    w: Vec<__m512i>,
    sc: Vec<[f32; 16]>,
}

/// Up to 16 consecutive rows (`rows`, `sc`: theirs, row-major) against every token in
/// `acts`, one row per lane: the rows' unsigned weight bytes are transposed once into
/// `scratch` (with the scales) so that each `vpdpbusd` takes 4 weights of 16 rows and 4
/// activations broadcast, and the float step runs once per group for all 16 rows. Per row the same exact integer sums
/// and float steps as [`super::scalar::row_dot_i8`]. `out` is `[rows, tokens]`; `ahead` (the
/// next block's weights) is prefetched during the transpose.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub(super) fn rows16_dot_i8(
    kind: QuantKind,
    group: usize,
    rows: &[u8],
    sc: &[f32],
    acts: &[QuantizedActs],
    scratch: &mut LaneScratch,
    out: &mut [f32],
    ahead: &[u8],
) {
    let n = acts.len();
    let gb = group * kind.bits() / 8;
    let ng = acts[0].q.len() / group;
    let rb = ng * gb;
    let nr = rows.len() / rb;
    assert!((1..=16).contains(&nr) && rows.len() == nr * rb);
    assert!(sc.len() == nr * ng && out.len() == nr * n);
    for x in acts {
        assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.off.len() >= ng);
    }
    let kq = group / 4; // dwords per group
    let m = _mm256_set1_epi8(15);
    let flip = _mm512_set1_epi8(-128);
    let LaneScratch {
        w: scratch,
        sc: sct,
    } = scratch;
    scratch.clear();
    scratch.resize(ng * kq, _mm512_setzero_si512());
    let pf = super::Prefetch::new(ahead, ng);
    for g in 0..ng {
        pf.step(g);
        for c in 0..group / 64 {
            let mut u = [_mm512_setzero_si512(); 16];
            for (r, ur) in u.iter_mut().enumerate().take(nr) {
                let p = &rows[r * rb + g * gb..r * rb + (g + 1) * gb];
                *ur = match kind {
                    QuantKind::Int8 => {
                        let b = &p[64 * c..64 * c + 64];
                        // SAFETY: `b` holds 64 bytes.
                        _mm512_xor_si512(
                            unsafe { _mm512_loadu_si512(b.as_ptr() as *const _) },
                            flip,
                        )
                    }
                    _ => {
                        let b = &p[32 * c..32 * c + 32];
                        // SAFETY: `b` holds 32 bytes.
                        let v = unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) };
                        let lo = _mm256_and_si256(v, m);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                    }
                };
            }
            let t = transpose16(u);
            scratch[g * kq + 16 * c..g * kq + 16 * c + 16].copy_from_slice(&t);
        }
    }
    sct.clear();
    sct.resize(ng, [0.0; 16]);
    for r in 0..nr {
        for g in 0..ng {
            sct[g][r] = sc[r * ng + g];
        }
    }
    // tokens in pairs: each weight vector loaded from the scratch serves two tokens
    token_tiles::<2>(n, nr, out, |t, k| {
        if k == 2 {
            lanes_dot::<2>(group, ng, scratch, sct, [&acts[t], &acts[t + 1]])
        } else {
            let [a] = lanes_dot::<1>(group, ng, scratch, sct, [&acts[t]]);
            [a, _mm512_setzero_ps()]
        }
    });
}

/// Runs `f` over the tokens `T` at a time (`f(t, k)`: tokens `t .. t + k`, `k` = `T` but at the
/// end) and stores the first `nr` lanes of each of the `k` results in `out` (`[rows, n]`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
fn token_tiles<const T: usize>(
    n: usize,
    nr: usize,
    out: &mut [f32],
    mut f: impl FnMut(usize, usize) -> [__m512; T],
) {
    let mut t = 0;
    while t < n {
        let k = (n - t).min(T);
        let res = f(t, k);
        for (i, v) in res.iter().enumerate().take(k) {
            let mut lanes = [0.0f32; 16];
            // SAFETY: `lanes` has room for 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
            for (r, l) in lanes.iter().enumerate().take(nr) {
                out[r * n + t + i] = *l;
            }
        }
        t += k;
    }
}

/// Most tokens [`lanes16_dot_i8`] runs over one read of the weights: with 32 vector registers,
/// eight tokens' two sums and accumulator each still fit beside the weights.
const LANE_TILE: usize = 8;

/// 16 rows stored in [`super::Layout::Lanes16`] (`blk`, `sc`: one block's weights and
/// scales) against every token in `acts`, one row per lane, up to [`LANE_TILE`] tokens sharing
/// each weight load (a verify step or a batch of decoding sequences reads the weights once for
/// all of them, more tokens in even tiles): the arithmetic of [`rows16_dot_i8`] (and so of
/// [`super::scalar::row_dot_i8`]) without its transpose. `out` is `[tokens, 16]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
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
    for x in acts {
        assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.off.len() >= ng);
    }
    let tile = n.div_ceil(n.div_ceil(LANE_TILE));
    for (t, o) in (0..n).step_by(tile).zip(out.chunks_mut(16 * tile)) {
        let x = &acts[t..(t + tile).min(n)];
        // each token's 16 results as one run of `out`
        macro_rules! tile {
            ($p:literal) => {{
                let r = packed_dot::<$p>(kind, group, ng, blk, sc, std::array::from_fn(|i| &x[i]));
                for (v, o) in r.iter().zip(o.chunks_exact_mut(16)) {
                    // SAFETY: `o` has room for 16 floats.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), *v) };
                }
            }};
        }
        match x.len() {
            8 => tile!(8),
            7 => tile!(7),
            6 => tile!(6),
            5 => tile!(5),
            4 => tile!(4),
            3 => tile!(3),
            2 => tile!(2),
            _ => tile!(1),
        }
    }
}

/// The per-token loop of [`lanes16_dot_i8`] for `P` tokens sharing each weight load (the
/// callers check the lengths).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
fn packed_dot<const P: usize>(
    kind: QuantKind,
    group: usize,
    ng: usize,
    blk: &[u8],
    sc: &[f32],
    acts: [&QuantizedActs; P],
) -> [__m512; P] {
    let gb = group * kind.bits() / 8;
    let qp = acts.map(|x| x.q.as_ptr());
    let (offp, scp) = (acts.map(|x| x.off.as_ptr()), acts.map(|x| x.scale.as_ptr()));
    let (m, flip) = (_mm512_set1_epi8(15), _mm512_set1_epi8(-128));
    let mut acc = [_mm512_setzero_ps(); P];
    for g in 0..ng {
        // SAFETY (loads below): dword `d < gb / 4` of group `g` lies at `16 * (g * gb + 4 *
        // d)` in `blk`, which holds `16 * ng * gb` bytes; activation offsets stay below
        // `(g + 1) * group <= ng * group`.
        let w = unsafe { blk.as_ptr().add(16 * g * gb) };
        // The lines of the 64-column span PREFETCH_SPANS spans ahead of span `c` of this group
        // (past the block's end: the next block's, which the caller computes next), into L2,
        // as span `c` is read; a prefetch never faults. Prefetched into L1 instead, four tokens
        // read DRAM 0.7-0.8x as fast on Zen 4 (docs/benchmarks.md, design notes). One token
        // keeps up with the hardware prefetchers alone (and runs slower with these).
        let prefetch = |c: usize, lines: usize| {
            if P > 1 {
                let ahead = w.wrapping_add((c + PREFETCH_SPANS) * 64 * lines);
                for l in 0..lines {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * l) as *const i8);
                }
            }
        };
        let ld = |d: usize| unsafe { _mm512_loadu_si512(w.add(64 * d) as *const _) };
        let bc = |t: usize, i: usize| unsafe {
            _mm512_set1_epi32((qp[t].add(g * group + i) as *const i32).read_unaligned())
        };
        let mut s0 = [_mm512_setzero_si512(); P];
        let mut s1 = [_mm512_setzero_si512(); P];
        if kind == QuantKind::Int8 {
            // span `c`: dwords 16c .. 16c + 16 of each row, one line each
            for c in 0..group / 64 {
                prefetch(c, 16);
                for d in (16 * c..16 * c + 16).step_by(2) {
                    let (w0, w1) = (
                        _mm512_xor_si512(ld(d), flip),
                        _mm512_xor_si512(ld(d + 1), flip),
                    );
                    for t in 0..P {
                        s0[t] = _mm512_dpbusd_epi32(s0[t], w0, bc(t, 4 * d));
                        s1[t] = _mm512_dpbusd_epi32(s1[t], w1, bc(t, 4 * d + 4));
                    }
                }
            }
        } else {
            // int4: dword j of a 32-byte nibble block holds elements 4j.. (low nibbles, the
            // block's first half of activations) and 32 + 4j.. (high nibbles)
            for c in 0..group / 64 {
                prefetch(c, 8);
                for j in 0..8 {
                    let p = ld(8 * c + j);
                    let lo = _mm512_and_si512(p, m);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m);
                    for t in 0..P {
                        s0[t] = _mm512_dpbusd_epi32(s0[t], lo, bc(t, 64 * c + 4 * j));
                        s1[t] = _mm512_dpbusd_epi32(s1[t], hi, bc(t, 64 * c + 32 + 4 * j));
                    }
                }
            }
        }
        // SAFETY: `sc` holds `16 * ng` floats.
        let sw = unsafe { _mm512_loadu_ps(sc.as_ptr().add(16 * g)) };
        for t in 0..P {
            // SAFETY: each token's `off` and `scale` hold `ng` values (the callers check).
            let (o, sx) = unsafe { (*offp[t].add(g), *scp[t].add(g)) };
            let isum = _mm512_sub_epi32(_mm512_add_epi32(s0[t], s1[t]), _mm512_set1_epi32(o));
            let scale = _mm512_mul_ps(sw, _mm512_set1_ps(sx));
            acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[t]);
        }
    }
    acc
}

/// The per-token loop of [`rows16_dot_i8`] for `P` tokens sharing each weight load: per
/// group, the exact integer sums of 16 rows (two chains per token), the activation-sum
/// correction, then `acc = fma(scale_w * scale_x, isum, acc)` per lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
fn lanes_dot<const P: usize>(
    group: usize,
    ng: usize,
    wt: &[__m512i],
    sct: &[[f32; 16]],
    acts: [&QuantizedActs; P],
) -> [__m512; P] {
    let kq = group / 4;
    assert!(wt.len() >= ng * kq && sct.len() >= ng && kq.is_multiple_of(2));
    let qp = acts.map(|x| x.q.as_ptr());
    let mut acc = [_mm512_setzero_ps(); P];
    for g in 0..ng {
        let w = &wt[g * kq..(g + 1) * kq];
        // SAFETY: `g * group + 4 * k + 4 <= ng * group` for `k < kq` (the callers assert the
        // activations' lengths).
        let bc = |t: usize, k: usize| unsafe {
            _mm512_set1_epi32((qp[t].add(g * group + 4 * k) as *const i32).read_unaligned())
        };
        let mut s0 = [_mm512_setzero_si512(); P];
        let mut s1 = [_mm512_setzero_si512(); P];
        for (j, w2) in w.chunks_exact(2).enumerate() {
            for t in 0..P {
                s0[t] = _mm512_dpbusd_epi32(s0[t], w2[0], bc(t, 2 * j));
                s1[t] = _mm512_dpbusd_epi32(s1[t], w2[1], bc(t, 2 * j + 1));
            }
        }
        // SAFETY: `sct[g]` holds 16 floats.
        let sw = unsafe { _mm512_loadu_ps(sct[g].as_ptr()) };
        for t in 0..P {
            let sum = _mm512_add_epi32(s0[t], s1[t]);
            let isum = _mm512_sub_epi32(sum, _mm512_set1_epi32(acts[t].off[g]));
            let scale = _mm512_mul_ps(sw, _mm512_set1_ps(acts[t].scale[g]));
            acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[t]);
        }
    }
    acc
}
