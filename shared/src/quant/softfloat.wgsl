// Soft-float: IEEE-754 binary32 arithmetic in integers, and charm's exp and SiLU.
//
// Promise: every function here returns, on u32 bit patterns, exactly the bits of the IEEE-754
// binary32 operation rounded to nearest, ties to even, with subnormal inputs and outputs kept (as
// x86 SSE with the default MXCSR does it), signed zeros and infinities as IEEE says; every NaN
// result is the canonical quiet NaN 0x7fc00000. WGSL promises nothing of the kind for f32 (fma may
// fuse or not, division is 2.5 ULP, subnormals may flush), so a kernel that must agree with the CPU
// bit for bit does its float steps with these.
//
// Functions: sf_mul, sf_add, sf_sub, sf_fma, sf_div, sf_sqrt, sf_from_i32, sf_round_away_i32,
// sf_exp, sf_silu. This file mirrors shared/src/softfloat/mod.rs line by line (sf_mul is mul,
// sf_sqrt is sqrt, sf_exp is exp_soft, and so on); the Rust is tested bit for bit against the CPU's
// native f32 ops. Change one, change the other.
//
// Needs u64 (wgpu Features::SHADER_INT64). Only functions, constants and one struct, all named
// sf_ / SF_ / Sf, and no bindings or entry points: it is concatenated in front of the compute
// shaders that use it. Every variable shift is guarded to stay below the width (WGSL leaves larger
// shifts undefined). sf_exp and sf_silu are not the WGSL builtins: they are charm's own, defined in
// softfloat.rs from correctly rounded operations so that the CPU gets the same bits.

const SF_SIGN: u32 = 0x80000000u;
const SF_ABS: u32 = 0x7fffffffu;
const SF_FRAC: u32 = 0x007fffffu;
const SF_IMPLICIT: u32 = 0x00800000u;
const SF_INF: u32 = 0x7f800000u;
const SF_NAN: u32 = 0x7fc00000u;
const SF_ONE: u32 = 0x3f800000u;

fn sf_is_nan(a: u32) -> bool {
    return (a & SF_ABS) > SF_INF;
}

fn sf_is_inf(a: u32) -> bool {
    return (a & SF_ABS) == SF_INF;
}

fn sf_is_zero(a: u32) -> bool {
    return (a & SF_ABS) == 0u;
}

// Leading zeros of a u64 from two u32 counts: naga 30 validates countLeadingZeros on u64, but its
// SPIR-V writer has no polyfill for it (it panics, gfx-rs/wgpu#5276).
fn sf_clz64(x: u64) -> u32 {
    let hi = u32(x >> 32u);
    if (hi != 0u) {
        return countLeadingZeros(hi);
    }
    return 32u + countLeadingZeros(u32(x & 0xfffffffflu));
}

// m >> s with every bit shifted out ORed into bit 0 (the sticky bit), for any s.
fn sf_shr_sticky(m: u64, s: u32) -> u64 {
    if (s == 0u) {
        return m;
    }
    if (s >= 64u) {
        return select(0lu, 1lu, m != 0lu);
    }
    return (m >> s) | select(0lu, 1lu, (m << (64u - s)) != 0lu);
}

// A finite nonzero number as m * 2^(e - 150) with m in [2^23, 2^24); e below 1 for a subnormal.
struct SfUnpacked {
    e: i32,
    m: u32,
}

fn sf_unpack(a: u32) -> SfUnpacked {
    var e = i32((a >> 23u) & 0xffu);
    var m = a & SF_FRAC;
    if (e == 0) {
        let s = countLeadingZeros(m) - 8u;
        m = m << s;
        e = 1 - i32(s);
    } else {
        m = m | SF_IMPLICIT;
    }
    return SfUnpacked(e, m);
}

// Rounds m_in / 2^63 * 2^(be_in - 127) (bit 63 set, sticky in bit 0) to nearest even and packs it.
fn sf_round_pack(sign: u32, be_in: i32, m_in: u64) -> u32 {
    if (be_in >= 255) {
        return sign | SF_INF;
    }
    var m = m_in;
    var be = be_in;
    if (be < 1) {
        m = sf_shr_sticky(m, u32(1 - be));
        be = 1;
    }
    let mant = u32(m >> 40u);
    let rest = m & 0xfffffffffflu;
    let half = 1lu << 39u;
    let up = rest > half || (rest == half && (mant & 1u) == 1u);
    // mant carries the implicit bit (or not, for a subnormal), so it adds 1 to the exponent field; a
    // rounding carry out of the significand moves into the exponent, up to infinity.
    let bits = (u32(be - 1) << 23u) + mant + u32(up);
    return sign | bits;
}

// Rounds m * 2^(be - 190) (m nonzero, any position; sticky in bit 0) and packs it.
fn sf_norm_round_pack(sign: u32, be: i32, m: u64) -> u32 {
    let lz = sf_clz64(m);
    return sf_round_pack(sign, be - i32(lz), m << lz);
}

// a * b.
fn sf_mul(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & SF_SIGN;
    if (sf_is_nan(a) || sf_is_nan(b)) {
        return SF_NAN;
    }
    if (sf_is_inf(a) || sf_is_inf(b)) {
        if (sf_is_zero(a) || sf_is_zero(b)) {
            return SF_NAN;
        }
        return sign | SF_INF;
    }
    if (sf_is_zero(a) || sf_is_zero(b)) {
        return sign;
    }
    let ua = sf_unpack(a);
    let ub = sf_unpack(b);
    // [2^46, 2^48), exact: value p * 2^(ea + eb - 300).
    let p = u64(ua.m) * u64(ub.m);
    return sf_norm_round_pack(sign, ua.e + ub.e - 110, p);
}

// a + b. An exact zero sum is +0 unless both operands are -0.
fn sf_add(a: u32, b: u32) -> u32 {
    if (sf_is_nan(a) || sf_is_nan(b)) {
        return SF_NAN;
    }
    if (sf_is_inf(a)) {
        if (sf_is_inf(b) && ((a ^ b) & SF_SIGN) != 0u) {
            return SF_NAN;
        }
        return a;
    }
    if (sf_is_inf(b)) {
        return b;
    }
    if (sf_is_zero(a)) {
        if (sf_is_zero(b)) {
            return a & b;
        }
        return b;
    }
    if (sf_is_zero(b)) {
        return a;
    }
    // x is the operand of larger magnitude, so its exponent is the larger.
    var x = a;
    var y = b;
    if ((b & SF_ABS) > (a & SF_ABS)) {
        x = b;
        y = a;
    }
    let ux = sf_unpack(x);
    let uy = sf_unpack(y);
    // Significands at bits 39..62, y aligned to x with sticky (39 guard bits).
    let mx = u64(ux.m) << 39u;
    let my = sf_shr_sticky(u64(uy.m) << 39u, u32(ux.e - uy.e));
    var m = mx + my;
    if (((x ^ y) & SF_SIGN) != 0u) {
        m = mx - my;
    }
    if (m == 0lu) {
        return 0u;
    }
    return sf_norm_round_pack(x & SF_SIGN, ux.e + 1, m);
}

// a - b, which IEEE defines as a + (-b).
fn sf_sub(a: u32, b: u32) -> u32 {
    return sf_add(a, b ^ SF_SIGN);
}

// a * b + c rounded once. An exact zero sum is +0 unless the product and c are both -0.
fn sf_fma(a: u32, b: u32, c: u32) -> u32 {
    let sp = (a ^ b) & SF_SIGN;
    if (sf_is_nan(a) || sf_is_nan(b) || sf_is_nan(c)) {
        return SF_NAN;
    }
    if (sf_is_inf(a) || sf_is_inf(b)) {
        if (sf_is_zero(a) || sf_is_zero(b)) {
            return SF_NAN;
        }
        if (sf_is_inf(c) && (c & SF_SIGN) != sp) {
            return SF_NAN;
        }
        return sp | SF_INF;
    }
    if (sf_is_inf(c)) {
        return c;
    }
    if (sf_is_zero(a) || sf_is_zero(b)) {
        if (sf_is_zero(c)) {
            return sp & c;
        }
        return c;
    }
    if (sf_is_zero(c)) {
        // The product is nonzero and exact before rounding: round it once.
        return sf_mul(a, b);
    }
    let ua = sf_unpack(a);
    let ub = sf_unpack(b);
    let uc = sf_unpack(c);
    // Product: value mp * 2^(ea + eb - 315), low 15 bits zero. Addend: mc * 2^(ec - 189), low 39
    // bits zero. Aligned to the larger scale; the sticky bit only matters when the shifted operand
    // is far the smaller.
    var mp = (u64(ua.m) * u64(ub.m)) << 15u;
    var mc = u64(uc.m) << 39u;
    let scale_p = ua.e + ub.e - 315;
    let scale_c = uc.e - 189;
    var scale = scale_p;
    if (scale_p >= scale_c) {
        mc = sf_shr_sticky(mc, u32(scale_p - scale_c));
    } else {
        mp = sf_shr_sticky(mp, u32(scale_c - scale_p));
        scale = scale_c;
    }
    let sc = c & SF_SIGN;
    var m = mp + mc;
    var sign = sp;
    if (sp != sc) {
        if (mp >= mc) {
            m = mp - mc;
        } else {
            m = mc - mp;
            sign = sc;
        }
    }
    if (m == 0lu) {
        return 0u;
    }
    return sf_norm_round_pack(sign, scale + 190, m);
}

// a / b.
fn sf_div(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & SF_SIGN;
    if (sf_is_nan(a) || sf_is_nan(b)) {
        return SF_NAN;
    }
    if (sf_is_inf(a)) {
        if (sf_is_inf(b)) {
            return SF_NAN;
        }
        return sign | SF_INF;
    }
    if (sf_is_inf(b)) {
        return sign;
    }
    if (sf_is_zero(b)) {
        if (sf_is_zero(a)) {
            return SF_NAN;
        }
        return sign | SF_INF;
    }
    if (sf_is_zero(a)) {
        return sign;
    }
    let ua = sf_unpack(a);
    let ub = sf_unpack(b);
    var e = ua.e - ub.e;
    var r = ua.m;
    if (r < ub.m) {
        r = r << 1u;
        e = e - 1;
    }
    // Long division in base 256 with u32 / and % (exact): the quotient is in [1, 2), so its leading
    // digit is 1, then 24 more bits; the remainder is the sticky bit. r < mb < 2^24.
    r = r - ub.m;
    var q = 1u;
    var i = 0;
    while (i < 3) {
        q = (q << 8u) | ((r << 8u) / ub.m);
        r = (r << 8u) % ub.m;
        i = i + 1;
    }
    let m = (u64(q) << 39u) | select(0lu, 1lu, r != 0u);
    return sf_round_pack(sign, e + 127, m);
}

// sqrt(a): sqrt(-0) is -0, sqrt(+inf) is +inf, the root of any other negative number is NaN.
fn sf_sqrt(a: u32) -> u32 {
    if (sf_is_nan(a)) {
        return SF_NAN;
    }
    if (sf_is_zero(a)) {
        return a;
    }
    if ((a & SF_SIGN) != 0u) {
        return SF_NAN;
    }
    if (sf_is_inf(a)) {
        return a;
    }
    let ua = sf_unpack(a);
    // a = m / 2^23 * 2^ex; with ex made even it halves exactly, and m / 2^23 is in [1, 4).
    var ex = ua.e - 127;
    var m = u64(ua.m);
    if ((ex & 1) != 0) {
        m = m << 1u;
        ex = ex - 1;
    }
    // Restoring square root, one root bit per step, of x = m * 2^39 in [2^62, 2^64): root ends as
    // floor(sqrt(x)) in [2^31, 2^32), rem as x - root^2 (the sticky bit).
    var rem = m << 39u;
    var root = 0lu;
    var bit = 1lu << 62u;
    var i = 0;
    while (i < 32) {
        let t = root + bit;
        if (rem >= t) {
            rem = rem - t;
            root = (root >> 1u) + bit;
        } else {
            root = root >> 1u;
        }
        bit = bit >> 2u;
        i = i + 1;
    }
    // The root of a normal or subnormal f32 is normal: no overflow, no underflow.
    let mr = (root << 32u) | select(0lu, 1lu, rem != 0lu);
    return sf_round_pack(0u, ex / 2 + 127, mr);
}

// f32(v), rounded to nearest even.
fn sf_from_i32(v: i32) -> u32 {
    if (v == 0) {
        return 0u;
    }
    let sign = bitcast<u32>(v) & SF_SIGN;
    var mag = bitcast<u32>(v);
    if (v < 0) {
        mag = 0u - mag;
    }
    return sf_norm_round_pack(sign, 190, u64(mag));
}

// Rounded half away from zero, saturating at the i32 range (infinities too), NaN to 0; exact.
fn sf_round_away_i32(a: u32) -> i32 {
    if (sf_is_nan(a)) {
        return 0;
    }
    let e = i32((a >> 23u) & 0xffu) - 127;
    let neg = (a & SF_SIGN) != 0u;
    if (e < -1) {
        return 0;
    }
    if (e >= 31) {
        if (neg) {
            return bitcast<i32>(0x80000000u);
        }
        return 0x7fffffff;
    }
    let m = (a & SF_FRAC) | SF_IMPLICIT;
    var r: u32;
    if (e >= 23) {
        r = m << u32(e - 23);
    } else {
        let s = u32(23 - e);
        r = (m + (1u << (s - 1u))) >> s;
    }
    if (neg) {
        return -i32(r);
    }
    return i32(r);
}

// exp and SiLU from correctly rounded operations (constants as in softfloat.rs: log2(e), ln(2) in a
// 15-bit high part and a low part, the Taylor coefficients 1/2 .. 1/5040, 2.0, 0.5).

const SF_LOG2E: u32 = 0x3fb8aa3bu;
const SF_LN2_HI: u32 = 0x3f317200u;
const SF_LN2_LO: u32 = 0x35bfbe8eu;
const SF_EXP_C2: u32 = 0x3f000000u;
const SF_EXP_C3: u32 = 0x3e2aaaabu;
const SF_EXP_C4: u32 = 0x3d2aaaabu;
const SF_EXP_C5: u32 = 0x3c088889u;
const SF_EXP_C6: u32 = 0x3ab60b61u;
const SF_EXP_C7: u32 = 0x39500d01u;
const SF_TWO: u32 = 0x40000000u;
const SF_HALF: u32 = 0x3f000000u;

// 2^k as f32 bits, for k in [-149, 127] (a subnormal below -126).
fn sf_pow2(k: i32) -> u32 {
    if (k >= -126) {
        return u32(k + 127) << 23u;
    }
    return 1u << u32(k + 149);
}

// charm's e^x (softfloat.rs exp_soft / exp): k = round(x log2(e)), Cody-Waite reduction, a
// degree-7 Taylor polynomial in Horner form, scaling by 2^k with exact powers of two.
fn sf_exp(x: u32) -> u32 {
    if (sf_is_nan(x)) {
        return SF_NAN;
    }
    let t = sf_mul(x, SF_LOG2E);
    var k = sf_round_away_i32(t);
    if (k > 128) {
        return SF_INF;
    }
    if (k < -150) {
        return 0u;
    }
    let kf = sf_from_i32(k);
    let r_hi = sf_sub(x, sf_mul(kf, SF_LN2_HI));
    let c = sf_mul(kf, SF_LN2_LO);
    let r = sf_sub(r_hi, c);
    var q = SF_EXP_C7;
    q = sf_add(sf_mul(q, r), SF_EXP_C6);
    q = sf_add(sf_mul(q, r), SF_EXP_C5);
    q = sf_add(sf_mul(q, r), SF_EXP_C4);
    q = sf_add(sf_mul(q, r), SF_EXP_C3);
    q = sf_add(sf_mul(q, r), SF_EXP_C2);
    let small = sf_add(r_hi, sf_sub(sf_mul(sf_mul(r, r), q), c));
    var p = sf_add(SF_ONE, small);
    if (k > 127) {
        p = sf_mul(p, SF_TWO);
        k = k - 1;
    }
    if (k < -149) {
        p = sf_mul(p, SF_HALF);
        k = k + 1;
    }
    return sf_mul(p, sf_pow2(k));
}

// charm's SiLU, x / (1 + e^-x) (softfloat.rs silu_soft / silu).
fn sf_silu(x: u32) -> u32 {
    return sf_div(x, sf_add(SF_ONE, sf_exp(x ^ SF_SIGN)));
}
