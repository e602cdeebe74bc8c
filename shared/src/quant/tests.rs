use super::*;

/// Deterministic test values in [-1, 1).
pub(crate) fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

const KINDS: [QuantKind; 4] = [
    QuantKind::Bf16,
    QuantKind::Int8,
    QuantKind::Int4,
    QuantKind::Int2,
];
/// Shapes with odd row counts, per-row and per-group scales, and odd token counts.
const SHAPES: [(usize, usize, usize, usize); 4] = [
    (1, 8, 8, 1),
    (7, 64, 64, 3),
    (33, 192, 64, 5),
    (129, 320, 32, 2),
];

fn reference(q: &QMatrix, x: &[f32], n: usize) -> Vec<f64> {
    let d = q.dequantize();
    (0..n)
        .flat_map(|t| (0..q.rows).map(move |o| (t, o)))
        .map(|(t, o)| {
            (0..q.cols)
                .map(|i| d.row(o)[i] as f64 * x[t * q.cols + i] as f64)
                .sum()
        })
        .collect()
}

#[test]
fn every_isa_matches_dequantized_f32() {
    for kind in KINDS {
        for (r, c, g, n) in SHAPES {
            let q = QMatrix::quantize(&Matrix::new(r, c, data(r as u64, r * c)), kind, g).unwrap();
            let x = data(c as u64 + 1, n * c);
            let want = reference(&q, &x, n);
            for isa in Isa::available() {
                let y = q.matmul(&x, n, isa);
                for (a, b) in y.iter().zip(&want) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()),
                        "{kind:?} {r}x{c} g{g} {isa:?}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_is_bit_identical_to_scalar_twin() {
    for kind in KINDS {
        for (r, c, g, n) in SHAPES {
            let q =
                QMatrix::quantize(&Matrix::new(r, c, data(3 + r as u64, r * c)), kind, g).unwrap();
            let x = data(7, n * c);
            let s = q.matmul(&x, n, Isa::Scalar);
            for isa in Isa::available() {
                let v = q.matmul(&x, n, isa);
                assert_eq!(
                    v, s,
                    "{kind:?} {r}x{c} g{g} {isa:?}: SIMD differs from its scalar twin"
                );
            }
        }
    }
}

#[test]
fn batch_and_thread_invariant_bitwise() {
    for kind in KINDS {
        let (r, c, g) = (67, 256, 64);
        let q = QMatrix::quantize(&Matrix::new(r, c, data(11, r * c)), kind, g).unwrap();
        // every tiling of the multi-token kernels: 8, 4, 3 and 2 tokens together, and a lone one
        for n in [2, 3, 7, 9, 14, 15] {
            let x = data(12, n * c);
            for isa in Isa::available() {
                let all = q.matmul(&x, n, isa);
                let one_thread = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                let serial = one_thread.install(|| q.matmul(&x, n, isa));
                assert_eq!(all, serial, "{kind:?} {isa:?}: thread count changed bits");
                for t in 0..n {
                    let one = q.matmul(&x[t * c..(t + 1) * c], 1, isa);
                    assert_eq!(
                        one,
                        all[t * r..(t + 1) * r].to_vec(),
                        "{kind:?} {isa:?} token {t}"
                    );
                }
            }
        }
    }
}

#[test]
fn int8_activation_path_is_bit_identical_across_isas_and_batches() {
    for kind in [QuantKind::Int8, QuantKind::Int4] {
        for (r, c, g) in [(7, 64, 64), (33, 192, 32), (65, 256, 64), (17, 256, 128)] {
            let q =
                QMatrix::quantize(&Matrix::new(r, c, data(r as u64 + 40, r * c)), kind, g).unwrap();
            assert!(q.integer_path());
            // 11 tokens: two full tiles of the multi-token kernel and a remainder
            let n = 11;
            let x = data(41, n * c);
            let s = q.matmul_with(&x, n, Isa::Scalar, Activations::Int8);
            for isa in Isa::available() {
                let v = q.matmul_with(&x, n, isa, Activations::Int8);
                assert_eq!(v, s, "{kind:?} {r}x{c} {isa:?}");
                for t in 0..n {
                    assert_eq!(
                        q.matmul_with(&x[t * c..(t + 1) * c], 1, isa, Activations::Int8),
                        v[t * r..(t + 1) * r].to_vec(),
                        "{kind:?} {r}x{c} {isa:?} token {t}"
                    );
                }
                for k in [2, 3, 4, 7] {
                    assert_eq!(
                        q.matmul_with(&x[..k * c], k, isa, Activations::Int8),
                        v[..k * r].to_vec(),
                        "{kind:?} {r}x{c} {isa:?}: first {k} tokens"
                    );
                }
            }
            // Close to the f32-activation product: the only extra error is activation rounding.
            let f = q.matmul(&x, n, Isa::Scalar);
            let d = q.dequantize();
            for (i, (a, b)) in s.iter().zip(&f).enumerate() {
                let (t, o) = (i / r, i % r);
                let bound: f32 = (0..c).map(|j| d.row(o)[j].abs()).sum::<f32>()
                    * x[t * c..(t + 1) * c]
                        .iter()
                        .fold(0.0f32, |m, v| m.max(v.abs()))
                    / 254.0;
                assert!(
                    (a - b).abs() <= bound + 1e-5,
                    "{kind:?}: {a} vs {b} (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn lane_layout_is_a_lossless_permutation_with_bit_identical_products() {
    for kind in [QuantKind::Int8, QuantKind::Int4] {
        // 1, 3, 6 and 2 blocks of 16 rows; groups of 64 and 128; a row of 3 groups; one group
        // of the whole row (a per-row scale, as heads stored like embedding tables have)
        for (r, c, g) in [(16, 64, 64), (48, 192, 64), (96, 256, 128), (32, 512, 512)] {
            let q =
                QMatrix::quantize(&Matrix::new(r, c, data(r as u64 + 7, r * c)), kind, g).unwrap();
            let l = q.to_lanes().expect("lane layout applies");
            assert_eq!(l.layout, Layout::Lanes16);
            assert!(l.to_lanes().is_none(), "already in lanes");
            assert_ne!(&l.data[..], &q.data[..], "the bytes move");
            assert!(*l.to_row_major() == q, "{kind:?} {r}x{c}: round trip");
            for row in [0, 1, 15, r - 1] {
                assert_eq!(l.dequantize_row(row), q.dequantize_row(row));
            }
            assert_eq!(l.dequantize(), q.dequantize());
            // 1 to 9 tokens (one tile of up to eight) and 17, 24, 33 and 64 (even tiles, a
            // prefill chunk's sizes), on 1 and 2 threads, against the scalar twin on the
            // row-major matrix, bit for bit; every other path converts back
            let x = data(9, 64 * c);
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for n in [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 24, 33, 64] {
                    let x = &x[..n * c];
                    let want = q.matmul_with(x, n, Isa::Scalar, Activations::Int8);
                    for isa in Isa::available() {
                        for act in [Activations::Int8, Activations::F32] {
                            let got = pool.install(|| l.matmul_with(x, n, isa, act));
                            let row_major = q.matmul_with(x, n, isa, act);
                            assert_eq!(
                                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                row_major.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                "{kind:?} {r}x{c} g{g} {isa:?} {act:?} n={n} {threads}t"
                            );
                            if act == Activations::Int8 {
                                assert_eq!(got, want, "{kind:?} {isa:?} n={n}: scalar twin");
                            }
                        }
                    }
                }
            }
        }
    }
    // the largest integer sums: every code at its extreme and every activation at +-127 (the
    // AVX2 int4 kernel adds eight pair products in 16 bits before widening)
    for kind in [QuantKind::Int8, QuantKind::Int4] {
        let (r, c) = (32, 128);
        let w: Vec<f32> = (0..r * c)
            .map(|i| if i / c % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let q = QMatrix::quantize(&Matrix::new(r, c, w), kind, 64).unwrap();
        let l = q.to_lanes().unwrap();
        for sign in [1.0f32, -1.0] {
            let x = vec![sign; 8 * c];
            for n in [1, 2, 3, 4, 6, 8] {
                let want = q.matmul_with(&x[..n * c], n, Isa::Scalar, Activations::Int8);
                for isa in Isa::available() {
                    let got = l.matmul_with(&x[..n * c], n, isa, Activations::Int8);
                    assert_eq!(got, want, "{kind:?} {isa:?} n={n} extreme sums");
                }
                // exact: each output is +-c times the row's value
                assert!(want
                    .iter()
                    .all(|v| (v.abs() - c as f32).abs() < 1e-3 * c as f32));
            }
        }
    }
    // what does not tile into 16-row blocks of 64-wide groups stays row-major
    let m = Matrix::new(17, 64, data(3, 17 * 64));
    assert!(QMatrix::quantize(&m, QuantKind::Int8, 64)
        .unwrap()
        .to_lanes()
        .is_none());
    let m = Matrix::new(16, 64, data(3, 16 * 64));
    assert!(QMatrix::quantize(&m, QuantKind::Int8, 32)
        .unwrap()
        .to_lanes()
        .is_none());
    assert!(QMatrix::quantize(&m, QuantKind::Int2, 64)
        .unwrap()
        .to_lanes()
        .is_none());
    assert!(QMatrix::quantize(&m, QuantKind::Bf16, 64)
        .unwrap()
        .to_lanes()
        .is_none());
}

#[test]
fn activation_quantization_is_identical_on_every_isa() {
    // amax 127 makes the scale 1, so the exact halves and their neighbours are hit
    let mut edge = vec![
        127.0,
        2.5,
        -2.5,
        0.5,
        -0.5,
        0.49999997,
        -0.49999997,
        1.5000001,
        -126.5,
        0.0,
        -0.0,
        f32::NAN,
        126.49999,
        -127.0,
        3.4999998,
        64.5,
    ];
    edge.extend(data(5, 48).iter().map(|v| v * 300.0));
    let inf = [[f32::INFINITY].as_slice(), &data(6, 63)].concat();
    let groups = [edge, data(7, 64), vec![0.0; 32], inf, vec![f32::NAN; 8]];
    for xs in groups {
        let mut want = vec![0i8; xs.len()];
        let d = scalar::quantize_group(&xs, &mut want);
        for isa in Isa::available() {
            let mut got = vec![0i8; xs.len()];
            let e = quantize_group(&xs, &mut got, isa);
            assert_eq!((e.to_bits(), &got), (d.to_bits(), &want), "{isa:?}");
        }
    }
    let mut codes = [0i8; 4];
    scalar::quantize_group(&[127.0, 2.5, -0.5, 0.49999997], &mut codes);
    assert_eq!(codes, [127, 3, -1, 0], "round half away from zero");
}

#[test]
fn quantized_activations_are_the_same_on_every_isa() {
    // codes in nibble order for int4, the offset corrections, scales: groups of 32 (nibble
    // blocks of 32), 64, 96 (blocks of 32) and 128, with extremes, infinities and NaN
    for group in [32, 64, 96, 128] {
        let mut x: Vec<f32> = data(group as u64, 3 * group)
            .iter()
            .map(|v| v * 300.0)
            .collect();
        x[1] = f32::INFINITY;
        x[group + 2] = f32::NAN;
        x[2 * group + 5] = -1e30;
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            let want = QuantizedActs::new(&x, group, kind, Isa::Scalar);
            let (nb, bias) = (nibble_block(group), unsigned_offset(kind));
            for (g, xs) in x.chunks(group).enumerate() {
                let mut codes = vec![0i8; group];
                scalar::quantize_group(xs, &mut codes);
                let qg = &want.q[g * group..(g + 1) * group];
                for (i, &c) in codes.iter().enumerate() {
                    // int4: block b's element e sits at e / 2, or nb / 2 + e / 2 when odd
                    let at = if kind == QuantKind::Int4 {
                        let (b, e) = (i / nb, i % nb);
                        b * nb + e / 2 + (e % 2) * nb / 2
                    } else {
                        i
                    };
                    assert_eq!(qg[at], c, "{kind:?} g{group}: element {i}");
                }
                let sum: i32 = codes.iter().map(|&c| c as i32).sum();
                assert_eq!(want.off[g], bias * sum);
            }
            for isa in Isa::available() {
                let got = QuantizedActs::new(&x, group, kind, isa);
                assert_eq!(got.q, want.q, "{kind:?} g{group} {isa:?}: codes");
                assert_eq!(got.off, want.off, "{kind:?} g{group} {isa:?}: offsets");
                let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got.scale),
                    bits(&want.scale),
                    "{kind:?} {isa:?}: scales"
                );
            }
        }
    }
}

#[test]
fn quantization_error_is_bounded_by_half_a_step() {
    let (r, c, g) = (5, 128, 64);
    let m = Matrix::new(r, c, data(99, r * c));
    for kind in [QuantKind::Int8, QuantKind::Int4, QuantKind::Int2] {
        let q = QMatrix::quantize(&m, kind, g).unwrap();
        let d = q.dequantize();
        for row in 0..r {
            for i in 0..c {
                let step = q.scales[row * (c / g) + i / g];
                let e = (d.row(row)[i] - m.row(row)[i]).abs();
                assert!(
                    e <= 0.5 * step + 1e-6,
                    "{kind:?}: error {e} > half step {step}"
                );
            }
        }
    }
    let q = QMatrix::quantize(&m, QuantKind::Bf16, c).unwrap();
    for (a, b) in q.dequantize().data.iter().zip(&m.data) {
        assert!((a - b).abs() <= b.abs() / 256.0);
    }
}

#[test]
fn refuses_bad_groups_and_non_finite() {
    let m = Matrix::new(2, 64, vec![0.5; 128]);
    assert!(matches!(
        QMatrix::quantize(&m, QuantKind::Int4, 12),
        Err(QuantError::Group { .. })
    ));
    assert!(matches!(
        QMatrix::quantize(&m, QuantKind::Int4, 0),
        Err(QuantError::Group { .. })
    ));
    assert!(matches!(
        QMatrix::quantize(&m, QuantKind::Int4, 128),
        Err(QuantError::Group { .. })
    ));
    let mut bad = m.clone();
    bad.data[70] = f32::NAN;
    assert_eq!(
        QMatrix::quantize(&bad, QuantKind::Int8, 64),
        Err(QuantError::NonFinite { index: 70 })
    );
    // all-zero groups quantize to zeros, not NaN
    let z = QMatrix::quantize(&Matrix::new(1, 64, vec![0.0; 64]), QuantKind::Int2, 64).unwrap();
    assert!(z
        .matmul(&[1.0; 64], 1, Isa::detect())
        .iter()
        .all(|v| *v == 0.0));
}

#[test]
fn paired_matmuls_equal_each_alone_bitwise() {
    // `matmul_pair_joined`: gate/up shapes of different heights (the split falls inside and
    // between row blocks), lane and row-major layouts, int8 and f32 activations, 1-9 tokens, every
    // ISA, 1 and 2 threads
    for kind in [QuantKind::Int4, QuantKind::Int8] {
        let (ra, rb, c) = (48, 80, 128);
        let qa = QMatrix::quantize(&Matrix::new(ra, c, data(1, ra * c)), kind, 64).unwrap();
        let qb = QMatrix::quantize(&Matrix::new(rb, c, data(2, rb * c)), kind, 64).unwrap();
        let x = data(3, 9 * c);
        for act in [Activations::Int8, Activations::F32] {
            for lanes in [true, false] {
                let prep = |q: &QMatrix| {
                    let q = QMatrix { act, ..q.clone() };
                    if lanes {
                        q.to_lanes().unwrap()
                    } else {
                        q
                    }
                };
                let (a, b) = (prep(&qa), prep(&qb));
                for threads in [1, 2] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    for n in [1, 2, 4, 5, 9] {
                        let x = &x[..n * c];
                        for isa in Isa::available() {
                            let joined =
                                pool.install(|| QMatrix::matmul_pair_joined(&a, &b, x, n, isa));
                            // one loop exactly where both take the lane kernels
                            let fused = lanes
                                && act == Activations::Int8
                                && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni);
                            assert_eq!(
                                joined.is_some(),
                                fused,
                                "{kind:?} {act:?} {isa:?} lanes={lanes}"
                            );
                            let Some(y) = joined else { continue };
                            let w = ra + rb;
                            let ya: Vec<f32> =
                                y.chunks_exact(w).flat_map(|t| &t[..ra]).copied().collect();
                            let yb: Vec<f32> =
                                y.chunks_exact(w).flat_map(|t| &t[ra..]).copied().collect();
                            assert_eq!(
                                ya,
                                a.matmul_with(x, n, isa, act),
                                "{kind:?} {act:?} {isa:?} n={n} lanes={lanes}"
                            );
                            assert_eq!(
                                yb,
                                b.matmul_with(x, n, isa, act),
                                "{kind:?} {act:?} {isa:?} n={n} lanes={lanes}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// [`QMatrix::dequantize_row_into`] (SIMD where the CPU has it) and the scalar path give every
/// element the value of the per-element decode of each format, bit for bit; a
/// [`Layout::Lanes16`] copy gives the same rows.
#[test]
fn dequantized_rows_equal_the_per_element_decode() {
    for kind in KINDS {
        for &(rows, cols, group, _) in &SHAPES {
            let group = if kind == QuantKind::Bf16 { cols } else { group };
            let m = Matrix::new(
                rows,
                cols,
                data(rows as u64 * 31 + cols as u64, rows * cols),
            );
            let q = QMatrix::quantize(&m, kind, group).unwrap();
            let rb = q.row_bytes();
            let mut got = vec![0.0f32; cols];
            let mut scalar = vec![0.0f32; cols];
            for r in 0..rows {
                q.dequantize_row_into(r, &mut got);
                q.dequantize_row_on(r, &mut scalar, Isa::Scalar);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&scalar), "{kind:?} {rows}x{cols}: row {r}");
                let b = &q.data[r * rb..(r + 1) * rb];
                for (i, &v) in got.iter().enumerate() {
                    let g = r * (cols / group) + i / group;
                    let want = match kind {
                        QuantKind::Bf16 => {
                            crate::dtype::bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
                        }
                        QuantKind::Int8 => q.scales[g] * (b[i] as i8) as f32,
                        QuantKind::Int4 => {
                            q.scales[g] * (((b[i / 2] >> (4 * (i % 2))) & 15) as i32 - 8) as f32
                        }
                        QuantKind::Int2 => {
                            q.scales[g] * ((b[i / 4] >> (2 * (i % 4))) & 3) as f32 + q.mins[g]
                        }
                    };
                    assert_eq!(
                        v.to_bits(),
                        want.to_bits(),
                        "{kind:?} {rows}x{cols} ({r}, {i})"
                    );
                }
                if let Some(l) = q.to_lanes() {
                    assert_eq!(l.dequantize_row(r), got, "{kind:?} lanes row {r}");
                }
            }
        }
    }
}
