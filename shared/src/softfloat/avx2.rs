//! [`super::exp`] and [`super::silu`] eight lanes at a time on AVX2: the same correctly rounded
//! f32 steps in the same order (multiply, then add: never fused), the same exact integer steps,
//! so every lane equals the scalar function bit for bit (NaN inputs stay NaN).

use std::arch::x86_64::*;

use super::{EXP_C2, EXP_C3, EXP_C4, EXP_C5, EXP_C6, EXP_C7, LN2_HI, LN2_LO, LOG2E};

#[inline]
#[target_feature(enable = "avx2")]
fn splat(bits: u32) -> __m256 {
    _mm256_castsi256_ps(_mm256_set1_epi32(bits as i32))
}

/// [`super::exp`] of eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let t = _mm256_mul_ps(x, splat(LOG2E));
    // round half away from zero: truncate, then step away from zero where the dropped part is at
    // least a half (exact: `t - trunc(t)` is representable)
    let tr = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
    let frac = _mm256_sub_ps(t, tr);
    let abs = splat(0x7fff_ffff);
    let half = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_and_ps(frac, abs), _mm256_set1_ps(0.5));
    let away = _mm256_or_ps(_mm256_and_ps(t, splat(0x8000_0000)), _mm256_set1_ps(1.0));
    let kr = _mm256_add_ps(tr, _mm256_and_ps(half, away));
    // k > 128: +inf; k < -150: 0 (infinite `t` included); NaN: `x` (decided at the end)
    let big = _mm256_cmp_ps::<_CMP_GT_OQ>(kr, _mm256_set1_ps(128.0));
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(kr, _mm256_set1_ps(-150.0));
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    // the lanes decided above compute on a k in range; their result is replaced
    let kf = _mm256_min_ps(
        _mm256_max_ps(kr, _mm256_set1_ps(-150.0)),
        _mm256_set1_ps(128.0),
    );
    let kf = _mm256_andnot_ps(nan, kf);
    let r_hi = _mm256_sub_ps(x, _mm256_mul_ps(kf, splat(LN2_HI)));
    let c = _mm256_mul_ps(kf, splat(LN2_LO));
    let r = _mm256_sub_ps(r_hi, c);
    let mut q = splat(EXP_C7);
    for coef in [EXP_C6, EXP_C5, EXP_C4, EXP_C3, EXP_C2] {
        q = _mm256_add_ps(_mm256_mul_ps(q, r), splat(coef));
    }
    let small = _mm256_add_ps(
        r_hi,
        _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(r, r), q), c),
    );
    let mut p = _mm256_add_ps(_mm256_set1_ps(1.0), small);
    let mut k = _mm256_cvtps_epi32(kf);
    // the scaling's extra step at the ends of the range: k = 128 and k = -150
    let top = _mm256_cmpgt_epi32(k, _mm256_set1_epi32(127));
    p = _mm256_blendv_ps(
        p,
        _mm256_mul_ps(p, _mm256_set1_ps(2.0)),
        _mm256_castsi256_ps(top),
    );
    k = _mm256_add_epi32(k, top); // -1 where `top`
    let bottom = _mm256_cmpgt_epi32(_mm256_set1_epi32(-149), k);
    p = _mm256_blendv_ps(
        p,
        _mm256_mul_ps(p, _mm256_set1_ps(0.5)),
        _mm256_castsi256_ps(bottom),
    );
    k = _mm256_sub_epi32(k, bottom); // +1 where `bottom`

    // 2^k: a normal power of two from k = -126 on, else a subnormal one
    let normal = _mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127)));
    let sub = _mm256_sllv_epi32(
        _mm256_set1_epi32(1),
        _mm256_max_epi32(
            _mm256_add_epi32(k, _mm256_set1_epi32(149)),
            _mm256_setzero_si256(),
        ),
    );
    let is_normal = _mm256_cmpgt_epi32(k, _mm256_set1_epi32(-127));
    let pow2 = _mm256_castsi256_ps(_mm256_blendv_epi8(sub, normal, is_normal));
    let mut y = _mm256_mul_ps(p, pow2);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), big);
    y = _mm256_andnot_ps(tiny, y);
    _mm256_blendv_ps(y, x, nan)
}

/// [`super::silu`] of eight lanes: `x / (1 + exp(-x))`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn silu8(x: __m256) -> __m256 {
    let e = exp8(_mm256_xor_ps(x, splat(0x8000_0000)));
    _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
}

/// `h[i] = silu(h[i]) * u[i]` (a SwiGLU gate), eight at a time, the tail by the scalar function.
#[target_feature(enable = "avx2")]
pub(crate) fn silu_mul(h: &mut [f32], u: &[f32]) {
    assert_eq!(h.len(), u.len());
    let full = h.len() - h.len() % 8;
    for i in (0..full).step_by(8) {
        // SAFETY: `i + 8 <= full <= len` of both slices.
        unsafe {
            let g = _mm256_loadu_ps(h.as_ptr().add(i));
            let v = _mm256_loadu_ps(u.as_ptr().add(i));
            _mm256_storeu_ps(h.as_mut_ptr().add(i), _mm256_mul_ps(silu8(g), v));
        }
    }
    for i in full..h.len() {
        h[i] = super::silu(h[i]) * u[i];
    }
}

/// `x[i] = exp(x[i] - m)`, eight at a time, the tail by the scalar function.
#[target_feature(enable = "avx2")]
pub(crate) fn exp_shifted(x: &mut [f32], m: f32) {
    let full = x.len() - x.len() % 8;
    let mv = _mm256_set1_ps(m);
    for i in (0..full).step_by(8) {
        // SAFETY: `i + 8 <= full <= x.len()`.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            _mm256_storeu_ps(x.as_mut_ptr().add(i), exp8(_mm256_sub_ps(v, mv)));
        }
    }
    for v in &mut x[full..] {
        *v = super::exp(*v - m);
    }
}
