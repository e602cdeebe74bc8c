//! The soft-float library against the CPU's native f32 operations, bit for bit (special values,
//! edge cases, random inputs), the errors of `exp` and SiLU, and the WGSL port's constants.

use super::*;
use proptest::prelude::*;

/// Same result, NaN-ness compared for NaNs.
fn same(got: u32, want: f32) -> bool {
    if want.is_nan() {
        is_nan(got)
    } else {
        got == want.to_bits()
    }
}

fn f(a: u32) -> f32 {
    f32::from_bits(a)
}

fn check_mul(a: u32, b: u32) {
    let want = f(a) * f(b);
    assert!(
        same(mul(a, b), want),
        "mul({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
        mul(a, b),
        want.to_bits()
    );
}

fn check_add(a: u32, b: u32) {
    let want = f(a) + f(b);
    assert!(
        same(add(a, b), want),
        "add({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
        add(a, b),
        want.to_bits()
    );
    let want = f(a) - f(b);
    assert!(
        same(sub(a, b), want),
        "sub({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
        sub(a, b),
        want.to_bits()
    );
}

fn check_fma(a: u32, b: u32, c: u32) {
    let want = f(a).mul_add(f(b), f(c));
    let got = fma(a, b, c);
    assert!(
        same(got, want),
        "fma({a:#010x}, {b:#010x}, {c:#010x}) = {got:#010x}, want {:#010x}",
        want.to_bits()
    );
}

fn check_div(a: u32, b: u32) {
    let want = f(a) / f(b);
    assert!(
        same(div(a, b), want),
        "div({a:#010x}, {b:#010x}) = {:#010x}, want {:#010x}",
        div(a, b),
        want.to_bits()
    );
}

fn check_sqrt(a: u32) {
    let want = f(a).sqrt();
    assert!(
        same(sqrt(a), want),
        "sqrt({a:#010x}) = {:#010x}, want {:#010x}",
        sqrt(a),
        want.to_bits()
    );
}

fn check_round(a: u32) {
    let want = f(a).round() as i32;
    assert_eq!(round_away_i32(a), want, "round_away_i32({a:#010x})");
}

fn check_silu(x: u32) {
    let want = silu(f(x));
    assert!(
        same(silu_soft(x), want),
        "silu_soft({x:#010x}) = {:#010x}, want {:#010x}",
        silu_soft(x),
        want.to_bits()
    );
    let want = exp(f(x));
    assert!(
        same(exp_soft(x), want),
        "exp_soft({x:#010x}) = {:#010x}, want {:#010x}",
        exp_soft(x),
        want.to_bits()
    );
}

/// A cheap deterministic generator for the long loops.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 32) as u32
    }

    /// Bits biased towards the edges: a few exponents and fractions from [`EDGE_EXP`] and
    /// [`EDGE_FRAC`], the rest random.
    fn edge(&mut self) -> u32 {
        let r = self.next();
        let sign = r & SIGN;
        let e = if r & 1 == 0 {
            EDGE_EXP[(r >> 1) as usize % EDGE_EXP.len()]
        } else {
            (r >> 1) & 0xff
        };
        let frac = match (r >> 9) % 4 {
            0 => EDGE_FRAC[(r >> 11) as usize % EDGE_FRAC.len()],
            // Few significant bits: exact products and sums, ties.
            1 => self.next() & 0x007f_0000,
            _ => self.next() & FRAC,
        };
        sign | (e << 23) | frac
    }
}

/// Exponent fields at the edges: zero/subnormal, the smallest normals, around 1, the largest,
/// inf/NaN.
const EDGE_EXP: [u32; 14] = [0, 0, 1, 2, 24, 25, 103, 126, 127, 128, 150, 253, 254, 255];
const EDGE_FRAC: [u32; 6] = [0, 1, 2, 0x40_0000, 0x7f_fffe, 0x7f_ffff];

fn edge_bits() -> impl Strategy<Value = u32> {
    let exp = prop_oneof![prop::sample::select(EDGE_EXP.to_vec()), 0u32..=255];
    let frac = prop_oneof![
        prop::sample::select(EDGE_FRAC.to_vec()),
        (0u32..=0x7f).prop_map(|h| h << 16),
        0u32..=FRAC,
    ];
    (any::<bool>(), exp, frac).prop_map(|(s, e, m)| ((s as u32) << 31) | (e << 23) | m)
}

fn bits() -> impl Strategy<Value = u32> {
    prop_oneof![any::<u32>(), edge_bits()]
}

/// `b` whose exponent puts `a * b` near the overflow or underflow threshold.
fn product_edge_pair() -> impl Strategy<Value = (u32, u32)> {
    (bits(), any::<u32>(), -3i32..=3, 0usize..4).prop_map(|(a, b, d, which)| {
        let ea = ((a >> 23) & 0xff) as i32;
        // Biased exponent sums: 254 + 127 overflows, 1 + 127 is the smallest normal,
        // -23 + 127 the smallest subnormal, -24 + 127 rounds to 0 or it.
        let target = [381, 128, 104, 103][which] + d;
        let eb = (target - ea).clamp(0, 254) as u32;
        (a, (b & (SIGN | FRAC)) | (eb << 23))
    })
}

/// `b` close to `-a`: cancellation.
fn cancel_pair() -> impl Strategy<Value = (u32, u32)> {
    (bits(), -3i32..=3).prop_map(|(a, d)| (a, (a ^ SIGN).wrapping_add(d as u32)))
}

/// `c` close to `-(a * b)`: the fused sum cancels.
fn fma_cancel() -> impl Strategy<Value = (u32, u32, u32)> {
    (bits(), bits(), -3i32..=3)
        .prop_map(|(a, b, d)| (a, b, (f(a) * f(b)).to_bits().wrapping_add(d as u32) ^ SIGN))
}

/// `b` a given number of binades below `a`: ties and sticky bits in addition.
fn add_aligned_pair() -> impl Strategy<Value = (u32, u32)> {
    (bits(), bits(), 0u32..=30).prop_map(|(a, b, d)| {
        let ea = (a >> 23) & 0xff;
        (a, (b & (SIGN | FRAC)) | (ea.saturating_sub(d) << 23))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn mul_matches_native(a in bits(), b in bits()) { check_mul(a, b); }

    #[test]
    fn mul_matches_native_near_thresholds((a, b) in product_edge_pair()) { check_mul(a, b); }

    #[test]
    fn add_matches_native(a in bits(), b in bits()) { check_add(a, b); }

    #[test]
    fn add_matches_native_cancelling((a, b) in cancel_pair()) { check_add(a, b); }

    #[test]
    fn add_matches_native_aligned((a, b) in add_aligned_pair()) { check_add(a, b); }

    #[test]
    fn fma_matches_native(a in bits(), b in bits(), c in bits()) { check_fma(a, b, c); }

    #[test]
    fn fma_matches_native_cancelling((a, b, c) in fma_cancel()) { check_fma(a, b, c); }

    #[test]
    fn fma_matches_native_near_thresholds((a, b) in product_edge_pair(), c in bits()) {
        check_fma(a, b, c);
        // A small addend against a product near the underflow threshold.
        check_fma(a, b, c & (SIGN | FRAC));
    }

    #[test]
    fn div_matches_native(a in bits(), b in bits()) { check_div(a, b); }

    #[test]
    fn div_matches_native_near_thresholds((a, b) in product_edge_pair()) {
        // a / (1/b') probes the same thresholds as a * b'.
        check_div(a, (1.0 / f(b)).to_bits());
    }

    #[test]
    fn sqrt_matches_native(a in bits()) { check_sqrt(a); }

    #[test]
    fn from_i32_matches_native(v in any::<i32>(), s in 0u32..32) {
        assert_eq!(from_i32(v), (v as f32).to_bits());
        let w = v >> s;
        assert_eq!(from_i32(w), (w as f32).to_bits());
    }

    #[test]
    fn round_away_matches_native(a in bits()) { check_round(a); }

    #[test]
    fn silu_soft_matches_silu(x in bits()) { check_silu(x); }
}

#[test]
fn special_values() {
    let specials = [
        0u32,
        SIGN,
        1,
        SIGN | 1,
        FRAC,
        IMPLICIT,
        IMPLICIT | 1,
        0x7f7f_ffff,
        ONE,
        ONE | SIGN,
        0x3f7f_ffff,
        0x3f80_0001,
        INF,
        INF | SIGN,
        NAN,
        0xffc0_0000,
        0x7f80_0001,
        0x4b40_0000,
        0x3f00_0000,
        0xbf00_0000,
        0x4f00_0000,
        0xcf00_0000,
    ];
    for &a in &specials {
        check_round(a);
        check_sqrt(a);
        check_silu(a);
        for &b in &specials {
            check_mul(a, b);
            check_add(a, b);
            check_div(a, b);
            for &c in &specials {
                check_fma(a, b, c);
            }
        }
    }
    for v in [
        0,
        1,
        -1,
        i32::MAX,
        i32::MIN,
        i32::MIN + 1,
        1 << 24,
        (1 << 24) + 1,
        (1 << 25) + 2,
        (1 << 25) + 6,
    ] {
        assert_eq!(from_i32(v), (v as f32).to_bits(), "from_i32({v})");
    }
    assert_eq!(mul(NAN, ONE), NAN);
    assert_eq!(add(INF, INF | SIGN), NAN);
    assert_eq!(fma(INF, 0, ONE), NAN);
    assert_eq!(div(0, 0), NAN);
    assert_eq!(sqrt(SIGN), SIGN);
    assert_eq!(sqrt(ONE | SIGN), NAN);
    assert_eq!(sqrt(INF | SIGN), NAN);
    assert_eq!(sqrt(0xffc0_0000), NAN);
    assert_eq!(exp_soft(NAN), NAN);
}

#[test]
fn ops_match_native_on_many_random_inputs() {
    let mut g = Lcg(0x5eed);
    for i in 0..4_000_000 {
        let (a, b, c) = if i % 2 == 0 {
            (g.next(), g.next(), g.next())
        } else {
            (g.edge(), g.edge(), g.edge())
        };
        check_mul(a, b);
        check_add(a, b);
        check_fma(a, b, c);
        check_div(a, b);
        check_round(a);
    }
}

#[test]
fn sqrt_matches_native_on_edges() {
    let mut edges = vec![
        0u32,
        IMPLICIT,
        IMPLICIT | 1,
        0x7f7f_ffff,
        0x7f7f_fffe,
        INF,
        NAN,
        0x7f80_0001,
        0x7fff_ffff,
    ];
    // Every subnormal with one or two bits set, and its neighbours.
    for i in 0..23 {
        for j in 0..=i {
            let s = (1u32 << i) | (1 << j);
            edges.extend([s - 1, s, s + 1]);
        }
    }
    // Every power of two and its neighbours: both exponent parities, the exact roots.
    for e in 1..255u32 {
        let p = e << 23;
        edges.extend([p - 1, p, p + 1, p | 0x40_0000, p | FRAC]);
    }
    // Exact squares (the root has at most 12 significant bits) and their neighbours.
    for r in 1..4096u32 {
        let sq = (r as f32 * r as f32).to_bits();
        edges.extend([sq - 1, sq, sq + 1]);
        let tiny = (r as f32 * 2f32.powi(-70)).powi(2).to_bits();
        edges.extend([tiny - 1, tiny, tiny + 1]);
    }
    for a in edges {
        check_sqrt(a);
        check_sqrt(a ^ SIGN);
    }
}

/// About 16.7 million patterns spread over the whole u32 range (every sign, exponent and a
/// fraction sample of each), then 1 million from the edge generator.
#[test]
fn sqrt_matches_native_on_many_inputs() {
    let mut a = 0u32;
    loop {
        check_sqrt(a);
        match a.checked_add(257) {
            Some(n) => a = n,
            None => break,
        }
    }
    let mut g = Lcg(0x5091);
    for _ in 0..1_000_000 {
        check_sqrt(g.edge());
    }
}

#[test]
fn silu_soft_matches_silu_on_many_inputs() {
    let mut g = Lcg(0xc0ffee);
    for i in 0..2_000_000u32 {
        let x = match i % 4 {
            0 => g.next(),
            1 => g.edge(),
            // The range where exp is neither 0 nor inf, and the subnormal results.
            2 => (-110.0 + f(0x3f80_0000 | (g.next() >> 9)) * 200.0 - 200.0).to_bits(),
            _ => {
                let r = g.next();
                ((87.0 + f(0x3f80_0000 | (r >> 9)) * 17.0 - 17.0).to_bits()) | (r & SIGN)
            }
        };
        check_silu(x);
    }
}

/// The f32 spacing at `z` (2^-149 in the subnormal range).
fn ulp_f32(z: f64) -> f64 {
    let e = ((z.abs().to_bits() >> 52) as i32 - 1023).max(-126);
    2f64.powi(e - 23)
}

/// Error of `got` from the exact `want`, in ULP of `want`; a wrong infinity is 1e9.
fn ulp_err(got: f32, want: f64) -> f64 {
    // Rounding to nearest goes to infinity from (2 - 2^-24) * 2^127 on.
    let inf_from = (2.0 - 2f64.powi(-24)) * 2f64.powi(127);
    if got.is_infinite() {
        return if want.abs() >= inf_from && got.is_sign_positive() == (want > 0.0) {
            0.0
        } else {
            1e9
        };
    }
    (got as f64 - want).abs() / ulp_f32(want)
}

#[test]
fn exp_and_silu_are_within_their_measured_bounds() {
    let mut g = Lcg(7);
    for i in 0..200_000u32 {
        let x = if i % 2 == 0 {
            f(g.next())
        } else {
            -104.0 + f(0x3f80_0000 | (g.next() >> 9)) * 194.0 - 194.0
        };
        if x.is_nan() {
            assert!(exp(x).is_nan());
            continue;
        }
        let e = ulp_err(exp(x), (x as f64).exp());
        assert!(e <= 0.94, "exp({x:e}) = {:e}, {e} ULP", exp(x));
        let xd = x as f64;
        let want = xd / (1.0 + (-xd).exp());
        if x > -88.72 && want.abs() >= f32::MIN_POSITIVE as f64 {
            let e = ulp_err(silu(x), want);
            assert!(e <= 2.41, "silu({x:e}) = {:e}, {e} ULP", silu(x));
        }
    }
}

#[test]
fn exp_thresholds_are_the_correctly_rounded_ones() {
    assert_eq!(exp(f(0x42b1_7218)), f32::INFINITY);
    assert!(exp(f(0x42b1_7217)).is_finite());
    assert_eq!(exp(f(0xc2cf_f1b5)), 0.0);
    assert_eq!(exp(f(0xc2cf_f1b4)), f(1));
    assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp(f32::INFINITY), f32::INFINITY);
    for x in [0x42b1_7218, 0x42b1_7217, 0xc2cf_f1b5, 0xc2cf_f1b4] {
        check_silu(x);
    }
}

/// Every f32 input, in release (about 6 minutes): `cargo test -p charm-shared --release --lib
/// softfloat::tests::exhaustive_exp_silu_error -- --ignored --nocapture`. Prints the bounds quoted
/// in [`exp`]'s and [`silu`]'s docs.
#[test]
#[ignore = "4 billion inputs: run in release"]
fn exhaustive_exp_silu_error() {
    let (mut exp_norm, mut exp_sub, mut silu_exact, mut silu_libm) = (0f64, 0f64, 0f64, 0u32);
    for bits in 0..=u32::MAX {
        let x = f(bits);
        if x.is_nan() {
            continue;
        }
        let want = (x as f64).exp();
        let e = ulp_err(exp(x), want);
        if want >= f32::MIN_POSITIVE as f64 {
            exp_norm = exp_norm.max(e);
        } else {
            exp_sub = exp_sub.max(e);
        }
        let s = silu(x);
        let libm = x / (1.0 + (-x).exp());
        if !(s.is_nan() && libm.is_nan()) {
            // Distance in representable values (the sign-magnitude order made monotone).
            let key = |v: f32| {
                let b = v.to_bits() as i64;
                if b & (1 << 31) != 0 {
                    -(b & 0x7fff_ffff)
                } else {
                    b
                }
            };
            silu_libm = silu_libm.max((key(s) - key(libm)).unsigned_abs() as u32);
        }
        let xd = x as f64;
        let want = xd / (1.0 + (-xd).exp());
        // Below x = -88.72, e^-x overflows f32 and the formula gives -0 (as libm's does).
        if exp(-x).is_finite() && want.abs() >= f32::MIN_POSITIVE as f64 {
            silu_exact = silu_exact.max(ulp_err(s, want));
        }
    }
    println!("exp: {exp_norm:.3} ULP (normal results), {exp_sub:.3} ULP (subnormal results)");
    println!(
        "silu: {silu_exact:.3} ULP from exact (normal results, x > -88.72), {silu_libm} ULP from libm"
    );
}

/// Every f32 input against the native `sqrt`, in release (about 2 minutes): `cargo test -p
/// charm-shared --release --lib softfloat::tests::exhaustive_sqrt -- --ignored`.
#[test]
#[ignore = "4 billion inputs: run in release"]
fn exhaustive_sqrt() {
    for a in 0..=u32::MAX {
        check_sqrt(a);
    }
}

/// The WGSL port spells the same constants.
#[test]
fn wgsl_has_the_same_constants() {
    let wgsl = include_str!("../quant/softfloat.wgsl");
    for (name, v) in [
        ("SF_LOG2E", LOG2E),
        ("SF_LN2_HI", LN2_HI),
        ("SF_LN2_LO", LN2_LO),
        ("SF_EXP_C2", EXP_C2),
        ("SF_EXP_C3", EXP_C3),
        ("SF_EXP_C4", EXP_C4),
        ("SF_EXP_C5", EXP_C5),
        ("SF_EXP_C6", EXP_C6),
        ("SF_EXP_C7", EXP_C7),
        ("SF_NAN", NAN),
    ] {
        let line = format!("const {name}: u32 = {v:#010x}u;");
        assert!(wgsl.contains(&line), "softfloat.wgsl lacks `{line}`");
    }
}

#[test]
fn exp_constants_are_what_they_say() {
    assert_eq!(LOG2E, std::f32::consts::LOG2_E.to_bits());
    assert_eq!(f(LN2_HI) as f64, 0.693145751953125);
    assert_eq!(
        LN2_LO,
        ((std::f64::consts::LN_2 - f(LN2_HI) as f64) as f32).to_bits()
    );
    for (c, n) in [
        (EXP_C2, 2.0),
        (EXP_C3, 6.0),
        (EXP_C4, 24.0),
        (EXP_C5, 120.0),
        (EXP_C6, 720.0),
        (EXP_C7, 5040.0),
    ] {
        assert_eq!(c, (1.0f32 / n).to_bits(), "1/{n}");
    }
}

/// Lanes of the AVX2 twins ([`avx2::exp8`], [`avx2::silu8`]) against the scalar functions, bit
/// for bit (NaN-ness for NaNs), for the inputs `bits` yields, eight at a time.
#[cfg(target_arch = "x86_64")]
fn check_simd_exp_silu(bits: impl Iterator<Item = u32>) -> usize {
    use std::arch::x86_64::*;
    if !std::is_x86_feature_detected!("avx2") {
        return 0;
    }
    let same_nan = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    let mut lanes = [0u32; 8];
    let mut n = 0;
    let run = |lanes: &[u32; 8]| {
        let x: [f32; 8] = lanes.map(f);
        let (mut e, mut s) = ([0f32; 8], [0f32; 8]);
        // SAFETY: AVX2 is present (checked above); the arrays hold 8 floats.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr());
            _mm256_storeu_ps(e.as_mut_ptr(), avx2::exp8(v));
            _mm256_storeu_ps(s.as_mut_ptr(), avx2::silu8(v));
        }
        let exp_f: fn(f32) -> f32 = exp;
        for (name, got, f) in [("exp", e, exp_f), ("silu", s, silu)] {
            for i in 0..8 {
                let want = f(x[i]);
                assert!(
                    same_nan(got[i], want),
                    "{name}8({:#x}) = {:#x}, {name} {:#x}",
                    lanes[i],
                    got[i].to_bits(),
                    want.to_bits()
                );
            }
        }
    };
    for b in bits {
        lanes[n % 8] = b;
        n += 1;
        if n % 8 == 0 {
            run(&lanes);
        }
    }
    if n % 8 != 0 {
        run(&lanes);
    }
    n
}

/// The AVX2 `exp` and SiLU on the edges of their ranges (the overflow and underflow thresholds,
/// subnormal results, the rounding of `x log2(e)` at halves, infinities, NaNs, zeros) and on a
/// sweep of every 997th bit pattern: the scalar functions' bits in every lane.
#[test]
#[cfg(target_arch = "x86_64")]
fn simd_exp_and_silu_equal_the_scalar_ones() {
    let mut edges = vec![
        0,
        SIGN,
        1,
        SIGN | 1,
        ONE,
        ONE | SIGN,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0xffc0_0001,
        0x7f80_0001,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x0080_0000,
        0x007f_ffff,
    ];
    for t in [
        0x42b1_7218u32,
        0xc2cf_f1b5,
        0xc2ae_ac50,
        0xc2ce_0000,
        0x42b0_0000,
        0x3f00_0000,
    ] {
        for d in 0..64 {
            edges.extend([t.wrapping_add(d), t.wrapping_sub(d), t ^ SIGN]);
        }
    }
    // x with x log2(e) near k + 1/2, for k across the range
    for k in -160i32..=140 {
        let x = (k as f32 + 0.5) / std::f32::consts::LOG2_E;
        for d in 0..8u32 {
            edges.extend([x.to_bits().wrapping_add(d), x.to_bits().wrapping_sub(d)]);
        }
    }
    assert!(check_simd_exp_silu(edges.into_iter()) > 0 || !std::is_x86_feature_detected!("avx2"));
    check_simd_exp_silu((0..=u32::MAX).step_by(997));
}

/// Every f32 input through the AVX2 `exp` and SiLU (release: `cargo test -p charm-shared --release
/// --lib softfloat::tests::exhaustive_simd_exp_silu -- --ignored`).
#[test]
#[cfg(target_arch = "x86_64")]
#[ignore = "4 billion inputs: run in release"]
fn exhaustive_simd_exp_silu() {
    assert_eq!(check_simd_exp_silu(0..=u32::MAX), 1 << 32);
}
