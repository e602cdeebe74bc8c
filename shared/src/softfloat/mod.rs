//! IEEE-754 binary32 arithmetic in integers, and charm's own `exp` and SiLU.
//!
//! WGSL promises nothing about float rounding (an `a * b + c` may or may not fuse, division is
//! allowed 2.5 ULP, subnormals may flush to zero), so a GPU that must agree with the CPU bit for bit
//! does every float step in integer arithmetic on `u32` bit patterns. This module is that soft-float
//! library's scalar twin: each function here ([`mul`], [`add`], [`sub`], [`fma`], [`div`],
//! [`sqrt`], [`from_i32`], [`round_away_i32`]) equals the CPU's native f32 operation bit for bit
//! (round to nearest, ties to even; subnormal inputs and outputs kept, as x86 SSE does them with
//! the default MXCSR), and `quant/softfloat.wgsl` is its line-by-line WGSL port (`sf_mul` for
//! [`mul`], and so on). Change one, change the other.
//!
//! Every NaN result is the canonical quiet NaN [`NAN`] (`0x7fc0_0000`); the native ops may return
//! another NaN (a propagated payload), so compare NaN-ness, not NaN bits.
//!
//! Written to port: no recursion, slices or `u128` (u64 is fine: the device is opened with
//! `SHADER_INT64`), every variable shift guarded so that its amount is below the width (WGSL leaves
//! larger shifts undefined), loops of a fixed short count.
//!
//! [`exp`] and [`silu`] are defined only from correctly rounded f32 operations (`*`, `+`, `-`, `/`)
//! and exact integer steps, so the CPU computing them with native f32 ops ([`exp`], [`silu`]) and
//! the GPU computing them with these functions ([`exp_soft`], [`silu_soft`], `sf_exp`, `sf_silu`)
//! get the same bits.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

/// The sign bit.
const SIGN: u32 = 0x8000_0000;
/// Everything but the sign bit.
const ABS: u32 = 0x7fff_ffff;
/// The stored fraction (23 bits).
const FRAC: u32 = 0x007f_ffff;
/// The implicit leading bit of a normal number's significand.
const IMPLICIT: u32 = 0x0080_0000;
/// +infinity.
const INF: u32 = 0x7f80_0000;
/// The canonical quiet NaN every NaN result of this module is.
pub const NAN: u32 = 0x7fc0_0000;
/// 1.0.
const ONE: u32 = 0x3f80_0000;

#[inline]
const fn is_nan(a: u32) -> bool {
    (a & ABS) > INF
}

#[inline]
const fn is_inf(a: u32) -> bool {
    (a & ABS) == INF
}

#[inline]
const fn is_zero(a: u32) -> bool {
    (a & ABS) == 0
}

/// Leading zeros of a u64 from two u32 counts (WGSL's `countLeadingZeros` is for 32 bits).
#[inline]
const fn clz64(x: u64) -> u32 {
    let hi = (x >> 32) as u32;
    if hi != 0 {
        return hi.leading_zeros();
    }
    32 + (x as u32).leading_zeros()
}

/// `m >> s` with every bit shifted out ORed into bit 0 (the sticky bit), for any `s`.
#[inline]
const fn shr_sticky(m: u64, s: u32) -> u64 {
    if s == 0 {
        return m;
    }
    if s >= 64 {
        return (m != 0) as u64;
    }
    (m >> s) | ((m << (64 - s)) != 0) as u64
}

/// A finite nonzero number as `m * 2^(e - 150)` with `m` in `[2^23, 2^24)`: subnormals are
/// normalised, so `e` may be below 1.
#[derive(Clone, Copy, Debug)]
struct Unpacked {
    /// Biased exponent (127 for `[1, 2)`), below 1 for a subnormal.
    e: i32,
    /// Significand with its leading bit at bit 23.
    m: u32,
}

#[inline]
const fn unpack(a: u32) -> Unpacked {
    let mut e = ((a >> 23) & 0xff) as i32;
    let mut m = a & FRAC;
    if e == 0 {
        let s = m.leading_zeros() - 8;
        m <<= s;
        e = 1 - s as i32;
    } else {
        m |= IMPLICIT;
    }
    Unpacked { e, m }
}

/// Rounds `m_in / 2^63 * 2^(be_in - 127)` to nearest even and packs it with `sign`. `m_in` has
/// bit 63 set; a nonzero value below its bits is ORed into bit 0 (sticky). `be_in` is any biased
/// exponent: at 255 and above the result is infinite, below 1 it is subnormal (rounded once, from
/// `m_in`).
#[inline]
const fn round_pack(sign: u32, be_in: i32, m_in: u64) -> u32 {
    if be_in >= 255 {
        return sign | INF;
    }
    let mut m = m_in;
    let mut be = be_in;
    if be < 1 {
        m = shr_sticky(m, (1 - be) as u32);
        be = 1;
    }
    let mant = (m >> 40) as u32;
    let rest = m & 0xff_ffff_ffff;
    let half = 1u64 << 39;
    let up = rest > half || (rest == half && (mant & 1) == 1);
    // `mant` carries the implicit bit (or not, for a subnormal), so it adds 1 to the exponent
    // field; a rounding carry out of the significand moves into the exponent, up to infinity.
    let bits = (((be - 1) as u32) << 23) + mant + up as u32;
    sign | bits
}

/// Rounds `m * 2^(be - 190)` (`m` nonzero, any position; sticky in bit 0) and packs it.
#[inline]
const fn norm_round_pack(sign: u32, be: i32, m: u64) -> u32 {
    let lz = clz64(m);
    round_pack(sign, be - lz as i32, m << lz)
}

/// `a * b` (`(f32::from_bits(a) * f32::from_bits(b)).to_bits()`).
#[inline]
pub const fn mul(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & SIGN;
    if is_nan(a) || is_nan(b) {
        return NAN;
    }
    if is_inf(a) || is_inf(b) {
        if is_zero(a) || is_zero(b) {
            return NAN;
        }
        return sign | INF;
    }
    if is_zero(a) || is_zero(b) {
        return sign;
    }
    let ua = unpack(a);
    let ub = unpack(b);
    // [2^46, 2^48), exact: value p * 2^(ea + eb - 300).
    let p = ua.m as u64 * ub.m as u64;
    norm_round_pack(sign, ua.e + ub.e - 110, p)
}

/// `a + b`. An exact zero sum is +0 unless both operands are -0.
#[inline]
pub const fn add(a: u32, b: u32) -> u32 {
    if is_nan(a) || is_nan(b) {
        return NAN;
    }
    if is_inf(a) {
        if is_inf(b) && ((a ^ b) & SIGN) != 0 {
            return NAN;
        }
        return a;
    }
    if is_inf(b) {
        return b;
    }
    if is_zero(a) {
        if is_zero(b) {
            return a & b;
        }
        return b;
    }
    if is_zero(b) {
        return a;
    }
    // x is the operand of larger magnitude, so its exponent is the larger.
    let mut x = a;
    let mut y = b;
    if (b & ABS) > (a & ABS) {
        x = b;
        y = a;
    }
    let ux = unpack(x);
    let uy = unpack(y);
    // Significands at bits 39..62 (bit 63 free for the carry), y aligned to x with sticky. With 39
    // guard bits a sticky bit rounds a difference as the dropped bits would: the shift is exact for
    // exponent gaps up to 39, and beyond, y is too small to move the leading bit of x - y far.
    let mx = (ux.m as u64) << 39;
    let my = shr_sticky((uy.m as u64) << 39, (ux.e - uy.e) as u32);
    let mut m = mx + my;
    if ((x ^ y) & SIGN) != 0 {
        m = mx - my;
    }
    if m == 0 {
        return 0;
    }
    norm_round_pack(x & SIGN, ux.e + 1, m)
}

/// `a - b`, which IEEE defines as `a + (-b)`.
#[inline]
pub const fn sub(a: u32, b: u32) -> u32 {
    add(a, b ^ SIGN)
}

/// `a * b + c` rounded once (`f32::mul_add`). An exact zero sum is +0 unless the product and `c`
/// are both negative zeros.
#[inline]
pub const fn fma(a: u32, b: u32, c: u32) -> u32 {
    let sp = (a ^ b) & SIGN;
    if is_nan(a) || is_nan(b) || is_nan(c) {
        return NAN;
    }
    if is_inf(a) || is_inf(b) {
        if is_zero(a) || is_zero(b) {
            return NAN;
        }
        if is_inf(c) && (c & SIGN) != sp {
            return NAN;
        }
        return sp | INF;
    }
    if is_inf(c) {
        return c;
    }
    if is_zero(a) || is_zero(b) {
        if is_zero(c) {
            return sp & c;
        }
        return c;
    }
    if is_zero(c) {
        // The product is nonzero and exact before rounding: round it once.
        return mul(a, b);
    }
    let ua = unpack(a);
    let ub = unpack(b);
    let uc = unpack(c);
    // Product at bits 61..62 and below: value mp * 2^(ea + eb - 315), low 15 bits zero.
    let mut mp = (ua.m as u64 * ub.m as u64) << 15;
    // Addend at bit 62: value mc * 2^(ec - 189), low 39 bits zero.
    let mut mc = (uc.m as u64) << 39;
    let scale_p = ua.e + ub.e - 315;
    let scale_c = uc.e - 189;
    // Align to the larger scale. The shift is exact while it only drops zero bits (up to 15 for the
    // product, 39 for the addend); beyond, the shifted operand is so much the smaller that its
    // sticky bit rounds the sum (or difference) exactly as the dropped bits would.
    let mut scale = scale_p;
    if scale_p >= scale_c {
        mc = shr_sticky(mc, (scale_p - scale_c) as u32);
    } else {
        mp = shr_sticky(mp, (scale_c - scale_p) as u32);
        scale = scale_c;
    }
    let sc = c & SIGN;
    let mut m = mp + mc;
    let mut sign = sp;
    if sp != sc {
        if mp >= mc {
            m = mp - mc;
        } else {
            m = mc - mp;
            sign = sc;
        }
    }
    if m == 0 {
        return 0;
    }
    norm_round_pack(sign, scale + 190, m)
}

/// `a / b`.
#[inline]
pub const fn div(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & SIGN;
    if is_nan(a) || is_nan(b) {
        return NAN;
    }
    if is_inf(a) {
        if is_inf(b) {
            return NAN;
        }
        return sign | INF;
    }
    if is_inf(b) {
        return sign;
    }
    if is_zero(b) {
        if is_zero(a) {
            return NAN;
        }
        return sign | INF;
    }
    if is_zero(a) {
        return sign;
    }
    let ua = unpack(a);
    let ub = unpack(b);
    let mut e = ua.e - ub.e;
    let mut r = ua.m;
    if r < ub.m {
        r <<= 1;
        e -= 1;
    }
    // Long division in base 256 with u32 `/` and `%` (exact): the quotient is in [1, 2), so its
    // leading digit is 1, then 24 more bits; the remainder is the sticky bit. r < mb < 2^24 keeps
    // r << 8 below 2^32.
    r -= ub.m;
    let mut q = 1u32;
    let mut i = 0;
    while i < 3 {
        q = (q << 8) | ((r << 8) / ub.m);
        r = (r << 8) % ub.m;
        i += 1;
    }
    // q in [2^24, 2^25).
    let m = ((q as u64) << 39) | (r != 0) as u64;
    round_pack(sign, e + 127, m)
}

/// `a.sqrt()` (`f32::from_bits(a).sqrt().to_bits()`): `sqrt(-0)` is -0, `sqrt(+inf)` is +inf, the
/// root of any other negative number is NaN.
#[inline]
pub const fn sqrt(a: u32) -> u32 {
    if is_nan(a) {
        return NAN;
    }
    if is_zero(a) {
        return a;
    }
    if (a & SIGN) != 0 {
        return NAN;
    }
    if is_inf(a) {
        return a;
    }
    let ua = unpack(a);
    // a = m / 2^23 * 2^ex; with ex made even it halves exactly, and m / 2^23 is in [1, 4).
    let mut ex = ua.e - 127;
    let mut m = ua.m as u64;
    if (ex & 1) != 0 {
        m <<= 1;
        ex -= 1;
    }
    // Restoring square root, one root bit per step, of x = m * 2^39 = m / 2^23 * 2^62 in
    // [2^62, 2^64): `root` ends as floor(sqrt(x)) in [2^31, 2^32), 24 significand bits and 8 more,
    // and `rem` as x - root^2, whose nonzero-ness is the sticky bit.
    let mut rem = m << 39;
    let mut root = 0u64;
    let mut bit = 1u64 << 62;
    let mut i = 0;
    while i < 32 {
        let t = root + bit;
        if rem >= t {
            rem -= t;
            root = (root >> 1) + bit;
        } else {
            root >>= 1;
        }
        bit >>= 2;
        i += 1;
    }
    // The root of a normal or subnormal f32 is normal: no overflow, no underflow.
    let mr = (root << 32) | (rem != 0) as u64;
    round_pack(0, ex / 2 + 127, mr)
}

/// `v as f32`, rounded to nearest even (exact up to 2^24 in magnitude).
#[inline]
pub const fn from_i32(v: i32) -> u32 {
    if v == 0 {
        return 0;
    }
    let sign = (v as u32) & SIGN;
    let mut mag = v as u32;
    if v < 0 {
        mag = 0u32.wrapping_sub(mag);
    }
    norm_round_pack(sign, 190, mag as u64)
}

/// `f32::from_bits(a).round() as i32`: rounded half away from zero, saturating at `i32::MIN` and
/// `i32::MAX` (infinities too), NaN to 0. Exact for every input.
#[inline]
pub const fn round_away_i32(a: u32) -> i32 {
    if is_nan(a) {
        return 0;
    }
    let e = ((a >> 23) & 0xff) as i32 - 127;
    let neg = (a & SIGN) != 0;
    if e < -1 {
        return 0;
    }
    if e >= 31 {
        if neg {
            return i32::MIN;
        }
        return i32::MAX;
    }
    let m = (a & FRAC) | IMPLICIT;
    let r = if e >= 23 {
        m << (e - 23) as u32
    } else {
        let s = (23 - e) as u32;
        (m + (1u32 << (s - 1))) >> s
    };
    if neg {
        return -(r as i32);
    }
    r as i32
}

// ---------------------------------------------------------------------------------------------
// exp and SiLU from correctly rounded operations.

/// log2(e), rounded to f32.
const LOG2E: u32 = 0x3fb8_aa3b;
/// ln(2)'s leading 15 bits (0.693145751953125 = 22713 / 2^15): `k * LN2_HI` is exact for |k| < 512.
const LN2_HI: u32 = 0x3f31_7200;
/// ln(2) - LN2_HI, rounded to f32.
const LN2_LO: u32 = 0x35bf_be8e;
/// Taylor coefficients of `(e^r - 1 - r) / r^2`: 1/2, 1/6, 1/24, 1/120, 1/720, 1/5040, each f32
/// rounded. Degree 7 in all: the truncation error at |r| = ln(2)/2 is below 0.05 ULP.
const EXP_C2: u32 = 0x3f00_0000;
const EXP_C3: u32 = 0x3e2a_aaab;
const EXP_C4: u32 = 0x3d2a_aaab;
const EXP_C5: u32 = 0x3c08_8889;
const EXP_C6: u32 = 0x3ab6_0b61;
const EXP_C7: u32 = 0x3950_0d01;
/// 2.0 and 0.5, for the scaling's extra step at the ends of the range.
const TWO: u32 = 0x4000_0000;
const HALF: u32 = 0x3f00_0000;

/// `2^k` as f32 bits, for `k` in `[-149, 127]` (a subnormal below -126).
#[inline]
const fn pow2(k: i32) -> u32 {
    if k >= -126 {
        return ((k + 127) as u32) << 23;
    }
    1u32 << (k + 149) as u32
}

/// `e^x` from correctly rounded f32 `*`, `+`, `-` and exact integer steps, so that [`exp_soft`]
/// (and the GPU's `sf_exp`) gives the same bits.
///
/// `k = round(x * log2(e))`, `r = x - k ln2` (Cody-Waite: `x - k * LN2_HI` is exact, the low part is
/// kept apart), `e^r = 1 + (r_hi + (r^2 Q(r) - k * LN2_LO))` with Q the degree-5 Taylor polynomial
/// (Horner without fused multiply-add: a CPU without FMA would call libm's software `fmaf`), and the
/// result is scaled by `2^k` with one multiply by an exact power of two (two where `2^k` is not an
/// f32), so a subnormal result is rounded from `e^r` once more.
///
/// Measured against f64 `exp` over every f32 input (the ignored test `exhaustive_exp_silu_error`):
/// at most 0.939 ULP for normal results, at most 0.747 of the subnormal spacing (2^-149) for
/// subnormal results, which round twice. The thresholds are those of the correctly rounded `e^x`:
/// +inf from x = 88.722839 (`0x42b1_7218`) up, 0 from x = -103.972084 (`0xc2cf_f1b5`) down. NaN in,
/// NaN out.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let t = x * f32::from_bits(LOG2E);
    let mut k = round_away_i32(t.to_bits());
    if k > 128 {
        return f32::INFINITY;
    }
    if k < -150 {
        return 0.0;
    }
    let kf = k as f32;
    let r_hi = x - kf * f32::from_bits(LN2_HI);
    let c = kf * f32::from_bits(LN2_LO);
    let r = r_hi - c;
    let mut q = f32::from_bits(EXP_C7);
    q = q * r + f32::from_bits(EXP_C6);
    q = q * r + f32::from_bits(EXP_C5);
    q = q * r + f32::from_bits(EXP_C4);
    q = q * r + f32::from_bits(EXP_C3);
    q = q * r + f32::from_bits(EXP_C2);
    let small = r_hi + (r * r * q - c);
    let mut p = 1.0 + small;
    if k > 127 {
        p *= f32::from_bits(TWO);
        k -= 1;
    }
    if k < -149 {
        p *= f32::from_bits(HALF);
        k += 1;
    }
    p * f32::from_bits(pow2(k))
}

/// [`exp`] in soft-float: the same steps, bit for bit.
#[inline]
pub const fn exp_soft(x: u32) -> u32 {
    if is_nan(x) {
        return NAN;
    }
    let t = mul(x, LOG2E);
    let mut k = round_away_i32(t);
    if k > 128 {
        return INF;
    }
    if k < -150 {
        return 0;
    }
    let kf = from_i32(k);
    let r_hi = sub(x, mul(kf, LN2_HI));
    let c = mul(kf, LN2_LO);
    let r = sub(r_hi, c);
    let mut q = EXP_C7;
    q = add(mul(q, r), EXP_C6);
    q = add(mul(q, r), EXP_C5);
    q = add(mul(q, r), EXP_C4);
    q = add(mul(q, r), EXP_C3);
    q = add(mul(q, r), EXP_C2);
    let small = add(r_hi, sub(mul(mul(r, r), q), c));
    let mut p = add(ONE, small);
    if k > 127 {
        p = mul(p, TWO);
        k -= 1;
    }
    if k < -149 {
        p = mul(p, HALF);
        k += 1;
    }
    mul(p, pow2(k))
}

/// charm's SiLU, `x / (1 + e^-x)` with [`exp`]: the CPU's and the GPU's ([`silu_soft`], `sf_silu`)
/// are bit-identical. Like the formula, `silu(-inf)` is NaN (`-inf / inf`).
///
/// Measured over every f32 input: at most 2.40 ULP from the exact SiLU (normal results, x above
/// -88.72) and at most 4 ULP from libm's `x / (1 + (-x).exp())` (the formula turns an exp error of
/// up to 0.94 ULP into up to 1.9 ULP of a result whose significand sits at the other end of its
/// binade). Below x = -88.72, `e^-x` overflows and the result is -0 where the exact SiLU is a
/// negative number of magnitude at most 2.6e-37, as with libm's.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// [`silu`] in soft-float: the same steps, bit for bit.
#[inline]
pub const fn silu_soft(x: u32) -> u32 {
    div(x, add(ONE, exp_soft(x ^ SIGN)))
}

#[cfg(test)]
mod tests;
