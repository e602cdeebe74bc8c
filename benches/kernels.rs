//! Weight-streaming throughput of the matmul kernels at GLM-5.2's real shapes, per format, ISA
//! path, token count and thread count, printed beside this machine's memory read bandwidth
//! measured in the same run.
//!
//! `cargo bench --bench kernels` (criterion's report) and, for the summary table with ratios to the
//! memory bandwidth, `cargo bench --bench kernels -- --summary [--quick] [--tokens 1,2,4,6,8]`
//! (token counts; default 1 and 8; `--yardstick`: the yardstick model's dense shapes instead of
//! GLM-5.2's); `-- --compute [--tokens 1,4,16,64]` measures the integer
//! path with the weights cache-resident (compute, not memory, as the limit) beside the ISA's
//! multiply-add peak (its int8 multiply-add step over registers only: `vpdpbusd` on AVX-512
//! VNNI, `vpsignb` + `vpmaddubsw` + `vpmaddwd` + `vpaddd` on AVX2), then attention's f32 kernels
//! over cache-resident latents beside the f32 multiply-then-add peak; `-- --experts [--tokens
//! 1,2,4,8] [--top 8] [--glm52]` runs one MoE layer's routed experts at the yardstick's shapes as
//! the expert store computes them (8 of 256 experts, hidden 1024, width 512, one expert per
//! thread at a time), with the weights from DRAM (its share of the memory probe) and
//! cache-resident (its share of the multiply-add peak); `--glm52`: at GLM-5.2's (of 32 experts,
//! hidden 6144, width 2048), from DRAM only, beside the same experts run whole, one a thread;
//! `--top`: experts a layer (a worker holding some of a layer's eight computes fewer).

use std::time::{Duration, Instant};

mod common;

use charm_shared::kernels::Matrix;
use charm_shared::quant::{Activations, Isa, QMatrix, QuantKind};
use criterion::{black_box, BenchmarkId, Criterion, Throughput};

/// GLM-5.2 shapes `[out, in]`.
const SHAPES: [(&str, usize, usize); 4] = [
    ("expert gate/up 2048x6144", 2048, 6144),
    ("expert down 6144x2048", 6144, 2048),
    ("o_proj 6144x16384", 6144, 16384),
    ("q_a 2048x6144", 2048, 6144),
];

fn weight_bytes(q: &QMatrix) -> u64 {
    (q.data.len() + 4 * (q.scales.len() + q.mins.len())) as u64
}

/// Sum of 64-bit words, 8 independent lanes (integer adds: the loop is bound by loads, not by
/// add latency).
#[inline(always)]
fn sum_words(c: &[u64]) -> u64 {
    let mut l = [0u64; 8];
    for ch in c.chunks_exact(8) {
        for k in 0..8 {
            l[k] = l[k].wrapping_add(ch[k]);
        }
    }
    l.iter().fold(0, |a, v| a.wrapping_add(*v))
}

/// [`sum_words`] compiled for AVX2 (32-byte loads).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_words_avx2(c: &[u64]) -> u64 {
    sum_words(c)
}

/// Memory read bandwidth over a buffer far larger than the caches (1 GiB), read with the widest
/// loads the CPU has by the threads of the current rayon pool: the best of `passes` passes.
struct Probe(Vec<u64>);

impl Probe {
    fn new() -> Self {
        Self((0..128u64 << 20).collect())
    }

    fn measure(&self, passes: usize) -> f64 {
        #[cfg(target_arch = "x86_64")]
        let avx2 = is_x86_feature_detected!("avx2");
        let mut best = f64::MAX;
        for _ in 0..passes {
            let t = Instant::now();
            let s: u64 = {
                use rayon::prelude::*;
                self.0
                    .par_chunks(1 << 18)
                    .map(|c| {
                        #[cfg(target_arch = "x86_64")]
                        if avx2 {
                            // SAFETY: avx2 was detected above.
                            return unsafe { sum_words_avx2(c) };
                        }
                        sum_words(c)
                    })
                    .reduce(|| 0, |a, b| a.wrapping_add(b))
            };
            black_box(s);
            best = best.min(t.elapsed().as_secs_f64());
        }
        (8 * self.0.len()) as f64 / best / 1e9
    }
}

fn time_it(f: impl Fn()) -> f64 {
    f();
    let mut runs = Vec::new();
    let start = Instant::now();
    while runs.len() < 5 || start.elapsed() < Duration::from_millis(300) {
        let t = Instant::now();
        f();
        runs.push(t.elapsed().as_secs_f64());
    }
    runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    runs[runs.len() / 2]
}

/// The yardstick model's dense shapes `[out, in]` (`--yardstick`): its matrices are 0.3-8.4 MB,
/// where the start of each matmul weighs more than at GLM-5.2's.
const YARDSTICK_SHAPES: [(&str, usize, usize); 7] = [
    ("q_a 256x1024", 256, 1024),
    ("q_b 1536x256", 1536, 256),
    ("kv_a 160x1024", 160, 1024),
    ("o_proj 1024x1024", 1024, 1024),
    ("dense gate/up 4096x1024", 4096, 1024),
    ("dense down 1024x4096", 1024, 4096),
    ("head 8192x1024", 8192, 1024),
];

/// The table: every shape, format, ISA path, activation mode and token count in `tokens`, on 1
/// and 2 threads. `quick` keeps the first shape (every yardstick shape with `yardstick`) and
/// int4/int8 only.
fn summary(quick: bool, yardstick: bool, tokens: &[usize]) {
    let kinds = [
        QuantKind::Int4,
        QuantKind::Int8,
        QuantKind::Int2,
        QuantKind::Bf16,
    ];
    let kinds = if quick { &kinds[..2] } else { &kinds[..] };
    let shapes = match (yardstick, quick) {
        (true, _) => &YARDSTICK_SHAPES[..],
        (false, true) => &SHAPES[..1],
        (false, false) => &SHAPES[..],
    };
    let probe = Probe::new();
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let bw = pool.install(|| probe.measure(5));
        println!(
            "\n{threads} thread(s): memory read bandwidth {bw:.1} GB/s (1 GiB buffer, best of 5); \
             each row's ratio is to the higher of two probes taken just before and just after it \
             (the bandwidth of a shared machine drifts)"
        );
        println!(
            "{:<28} {:<6} {:<10} {:<6} {:<5} {:>6} {:>10} {:>9} {:>8}",
            "shape", "format", "isa", "layout", "acts", "tokens", "GB/s", "probe", "of bw"
        );
        for &(name, r, c) in shapes {
            let m = Matrix::new(r, c, common::noise(r * c, 7));
            for &kind in kinds {
                let group = if kind == QuantKind::Bf16 { c } else { 64 };
                let q = QMatrix::quantize(&m, kind, group).unwrap();
                // Copies totalling over 1 GiB, used in turn, so weights come from DRAM and not
                // from the (large) last-level cache, as a model's weights do.
                let count = ((1u64 << 30) / weight_bytes(&q) + 1).min(512);
                let copies: Vec<QMatrix> = (0..count).map(|_| q.clone()).collect();
                // the layout the model loader gives the VNNI integer path
                let lanes: Vec<QMatrix> = q
                    .to_lanes()
                    .map(|l| (0..count).map(|_| l.clone()).collect())
                    .unwrap_or_default();
                let turn = std::sync::atomic::AtomicUsize::new(0);
                for isa in Isa::available() {
                    for act in [Activations::F32, Activations::Int8] {
                        if act == Activations::Int8 && !q.integer_path() {
                            continue;
                        }
                        let mut layouts = vec![("rows", &copies)];
                        if act == Activations::Int8
                            && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni)
                            && !lanes.is_empty()
                        {
                            layouts.push(("lanes", &lanes));
                        }
                        for (layout, mats) in layouts {
                            for &n in tokens {
                                let x = common::noise(n * c, 3);
                                let before = pool.install(|| probe.measure(2));
                                let s = pool.install(|| {
                                    time_it(|| {
                                        let i =
                                            turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        drop(black_box(
                                            mats[i % mats.len()].matmul_with(&x, n, isa, act),
                                        ))
                                    })
                                });
                                let bw = before.max(pool.install(|| probe.measure(2)));
                                let gbs = weight_bytes(&q) as f64 / s / 1e9;
                                let a = if act == Activations::F32 {
                                    "f32"
                                } else {
                                    "int8"
                                };
                                println!(
                                    "{name:<28} {:<6} {:<10} {layout:<6} {a:<5} {n:>6} {gbs:>10.2} {bw:>9.1} {:>7.0}%",
                                    kind.name(),
                                    format!("{isa:?}"),
                                    100.0 * gbs / bw
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Compute throughput with the weights cache-resident (one thread, a 512x1024 matrix, GLM-like
/// row length of the yardstick model): weight bytes times tokens per second, int8 activations.
fn compute_summary(tokens: &[usize]) {
    let (r, c) = (512, 1024);
    let m = Matrix::new(r, c, common::noise(r * c, 7));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut peaks: Vec<(Isa, QuantKind, f64)> = Vec::new();
    for isa in Isa::available() {
        for kind in [QuantKind::Int4, QuantKind::Int8] {
            if let Some(p) = mac_peak(isa, kind) {
                peaks.push((isa, kind, p));
            }
        }
    }
    println!("\ncompute, 1 thread, {r}x{c} weights resident in cache, int8 activations");
    for (isa, kind, p) in &peaks {
        println!(
            "{isa:?} {} multiply-add peak, 1 thread: {p:.1} GMAC/s (its kernel's step over registers only)",
            kind.name()
        );
    }
    println!(
        "{:<6} {:<10} {:<6} {:>6} {:>22} {:>8} {:>8}",
        "format", "isa", "layout", "tokens", "GB/s (bytes x tokens)", "GMAC/s", "of peak"
    );
    for kind in [QuantKind::Int4, QuantKind::Int8] {
        let rows = QMatrix::quantize(&m, kind, 64).unwrap();
        let lanes = rows
            .to_lanes()
            .expect("512 rows in groups of 64 have a lane form");
        let isas = Isa::available().into_iter().filter(|i| *i != Isa::Scalar);
        let mut runs: Vec<(Isa, &str, &QMatrix)> = isas.map(|i| (i, "rows", &rows)).collect();
        for isa in [Isa::Avx2, Isa::Avx512Vnni] {
            if Isa::available().contains(&isa) {
                runs.push((isa, "lanes", &lanes));
            }
        }
        for (isa, layout, q) in runs {
            for &n in tokens {
                let x = common::noise(n * c, 3);
                let reps = (4000 / n).max(20);
                let s = pool.install(|| {
                    time_it(|| {
                        for _ in 0..reps {
                            drop(black_box(q.matmul_with(&x, n, isa, Activations::Int8)));
                        }
                    })
                }) / reps as f64;
                let gbs = (n as u64 * weight_bytes(q)) as f64 / s / 1e9;
                let gmac = (n * r * c) as f64 / s / 1e9;
                let peak = peaks
                    .iter()
                    .find(|(i, k, _)| *i == isa && *k == kind)
                    .map(|p| p.2);
                println!(
                    "{:<6} {:<10} {layout:<6} {n:>6} {gbs:>22.2} {gmac:>8.1} {:>7.0}%",
                    kind.name(),
                    format!("{isa:?}"),
                    peak.map_or(f64::NAN, |p| 100.0 * gmac / p)
                );
            }
        }
    }
}

/// One MoE layer's routed experts (`--experts`): `top` experts a step (default 8), int4 and int8
/// weights in the layout the loader gives them, int8 activations, run as the expert store runs
/// them (`linear::map_blocks`: one expert a thread, or, for experts big enough to split, the
/// ones left over after full rounds each over every thread). At the yardstick's shapes, cold: the
/// experts come in turn from 256 (over 200 MB, so from DRAM); resident: the same ones every time
/// (in cache). With `glm52`, GLM-5.2's shapes (hidden 6144, width 2048: 20-40 MB an expert) from
/// 32 experts, cold only, and beside each row the same experts whole, one a thread (`whole`).
fn experts_summary(tokens: &[usize], glm52: bool, top: usize) {
    use charm_shared::linear::{map_blocks, Linear, SwiGlu};
    let (hidden, width, count) = if glm52 {
        (6144, 2048, 32)
    } else {
        (1024, 512, 256)
    };
    let isa = charm_shared::quant::active_isa();
    let threads = charm_shared::par::threads();
    let probe = Probe::new();
    println!(
        "\nrouted experts, one MoE layer: {top} of {count} experts {width}x{hidden} (gate, up, down), \
         {isa:?}, {threads} threads, int8 activations"
    );
    println!(
        "{:<6} {:<9} {:<8} {:>6} {:>10} {:>8} {:>7} {:>7} {:>8} {:>8}",
        "format",
        "weights",
        "schedule",
        "tokens",
        "us/layer",
        "GB/s",
        "probe",
        "of bw",
        "GMAC/s",
        "of peak"
    );
    for kind in [QuantKind::Int4, QuantKind::Int8] {
        let peak = mac_peak(isa, kind);
        if let Some(p) = peak {
            println!(
                "{isa:?} {} multiply-add peak: {p:.1} GMAC/s a thread, {:.1} on {threads}",
                kind.name(),
                p * threads as f64
            );
        }
        let lin = |r: usize, c: usize, seed: u32| {
            let q = QMatrix::quantize(&Matrix::new(r, c, common::noise(r * c, seed)), kind, 64)
                .unwrap();
            Linear::Quant(q).prepared(Activations::Int8)
        };
        // four distinct experts, copied: what is read matters, not its values
        let distinct: Vec<SwiGlu> = (0..4)
            .map(|e| SwiGlu {
                gate: lin(width, hidden, 3 * e + 1),
                up: lin(width, hidden, 3 * e + 2),
                down: lin(hidden, width, 3 * e + 3),
            })
            .collect();
        let experts: Vec<SwiGlu> = (0..count).map(|e| distinct[e % 4].clone()).collect();
        let bytes = (top * experts[0].bytes()) as f64;
        let params = (top * experts[0].params()) as f64;
        let splits = experts[0].splits();
        let modes: &[(&str, bool, bool)] = if glm52 {
            &[("DRAM", true, true), ("DRAM", true, false)]
        } else {
            &[("DRAM", true, true), ("resident", false, true)]
        };
        for &(label, cold, as_charm) in modes {
            for &n in tokens {
                let x = common::noise(n * hidden, 5);
                let turn = std::sync::atomic::AtomicUsize::new(0);
                let before = probe.measure(2);
                let secs = time_it(|| {
                    let at = if cold {
                        turn.fetch_add(top, std::sync::atomic::Ordering::Relaxed)
                    } else {
                        0
                    };
                    let one = |k: usize| experts[(at + k) % count].forward(&x, n);
                    let ys = if as_charm {
                        map_blocks(top, splits, one)
                    } else {
                        charm_shared::par::map(top, one)
                    };
                    drop(black_box(ys));
                });
                let bw = before.max(probe.measure(2));
                let (gbs, gmac) = (bytes / secs / 1e9, params * n as f64 / secs / 1e9);
                let schedule = if as_charm { "charm" } else { "whole" };
                println!(
                    "{:<6} {label:<9} {schedule:<8} {n:>6} {:>10.1} {gbs:>8.2} {bw:>7.1} {:>6.0}% {gmac:>8.1} {:>7.0}%",
                    kind.name(),
                    secs * 1e6,
                    100.0 * gbs / bw,
                    peak.map_or(f64::NAN, |p| 100.0 * gmac / (p * threads as f64))
                );
            }
        }
    }
}

/// The AVX2 lane kernel's step for one token and 32 weights over registers only, eight
/// independent chains: with `SIGNED` the int8 step (`vpsignb`, `vpmaddubsw`, `vpmaddwd`,
/// `vpaddd`); without it the int4 step (unsigned nibbles: `vpmaddubsw` and a 16-bit `vpaddw`,
/// widened by `vpmaddwd` + `vpaddd` once every four steps, as the kernel sums four lines before
/// widening). Multiply-adds (= weight bytes times tokens for int8) per second, in billions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn avx2_step_ceiling<const SIGNED: bool>(steps: usize) -> (f64, i32) {
    use std::arch::x86_64::*;
    let mut s = [_mm256_set1_epi32(1); 8];
    let mut x = [_mm256_setzero_si256(); 8];
    let mut w = [_mm256_setzero_si256(); 8];
    for (k, w) in w.iter_mut().enumerate() {
        *w = _mm256_set1_epi8(k as i8 + 1);
    }
    let ones = _mm256_set1_epi16(1);
    let t = Instant::now();
    for i in 0..steps / 8 {
        let a = _mm256_set1_epi32(black_box(i as i32));
        for k in 0..8 {
            if SIGNED {
                let p = _mm256_maddubs_epi16(w[k], _mm256_sign_epi8(a, w[k]));
                s[k] = _mm256_add_epi32(s[k], _mm256_madd_epi16(p, ones));
            } else {
                x[k] = _mm256_add_epi16(x[k], _mm256_maddubs_epi16(w[k], a));
                if i % 4 == 3 {
                    s[k] = _mm256_add_epi32(s[k], _mm256_madd_epi16(x[k], ones));
                    x[k] = _mm256_setzero_si256();
                }
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let mut sum = _mm256_setzero_si256();
    for v in s {
        sum = _mm256_add_epi32(sum, v);
    }
    (
        32.0 * steps as f64 / secs / 1e9,
        _mm256_extract_epi32::<0>(sum),
    )
}

/// Attention's f32 kernels over cached latents at the yardstick's shapes (latent 128, rotary 32,
/// 512 keys: 320 KB, cache-resident), one thread, as `attend_latent` runs them for four heads of
/// one query: the scores (`dots_heads` of 8 keys' latents, then of their rotary parts, against
/// the four heads) and the weighted latents (`weighted_rows` of 4 heads), in multiply-adds per second
/// beside the f32 multiply-then-add peak ([`f32_step_ceiling`]); then the scores again over
/// 2,048 keys (1.3 MB) read from memory, the caches flushed before each run, as a decode step
/// finds them after its weights have streamed through.
fn attention_summary() {
    use charm_shared::aligned::AlignedVec;
    use charm_shared::kernels::weighted_rows;
    let (keys, lat, rot, heads) = (512usize, 128usize, 32usize, 4usize);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    // the KV cache's own storage: entries on 64-byte lines, as charm keeps them
    let cache = AlignedVec::from(&common::noise(keys * (lat + rot), 5)[..]);
    let q = common::noise(heads * (lat + rot), 9);
    let entry = |j: usize| &cache[j * (lat + rot)..(j + 1) * (lat + rot)];
    let q_abs: Vec<&[f32]> = (0..heads).map(|h| &q[h * (lat + rot)..][..lat]).collect();
    let q_rope: Vec<&[f32]> = (0..heads)
        .map(|h| &q[h * (lat + rot) + lat..(h + 1) * (lat + rot)])
        .collect();
    let scores = pool.install(|| {
        time_it(|| {
            let (mut l, mut r) = (vec![[0.0f32; 8]; heads], vec![[0.0f32; 8]; heads]);
            for k0 in (0..keys).step_by(8) {
                let e: [&[f32]; 8] = std::array::from_fn(|i| entry(k0 + i));
                score_block(e, (&q_abs, &q_rope), &mut l, &mut r);
                black_box(&l);
            }
        })
    });
    let p = common::noise(heads * keys, 11);
    let rows: Vec<&[f32]> = (0..keys).map(|j| &entry(j)[..lat]).collect();
    let weighted = pool.install(|| {
        time_it(|| {
            let mut out = vec![0.0f32; heads * lat];
            let mut o = out.chunks_mut(lat);
            let outs: [&mut [f32]; 4] = std::array::from_fn(|_| o.next().unwrap());
            let ps: [&[f32]; 4] = std::array::from_fn(|h| &p[h * keys..(h + 1) * keys]);
            weighted_rows(outs, ps, &rows);
            black_box(out);
        })
    });
    let cold = pool.install(|| cold_scores(lat, rot, heads));
    let peak = f32_peak();
    println!("\nattention over cached latents, 1 thread, {keys} keys (latent {lat}, rotary {rot}), {heads} heads of one query");
    if let Some(p) = peak {
        println!(
            "f32 multiply-then-add peak, 1 thread: {p:.1} GMAC/s (8 lanes, over registers only)"
        );
    }
    for (name, secs, macs) in [
        ("scores (dots_heads)", scores, keys * heads * (lat + rot)),
        (
            "weighted latents (weighted_rows)",
            weighted,
            keys * heads * lat,
        ),
        (
            "scores, 2048 keys from memory",
            cold,
            2048 * heads * (lat + rot),
        ),
    ] {
        let g = macs as f64 / secs / 1e9;
        println!(
            "{name:<34} {g:>8.1} GMAC/s {:>7.0}% of peak",
            peak.map_or(f64::NAN, |p| 100.0 * g / p)
        );
    }
}

/// Seconds of the scores ([`score_block`]) over 2,048 keys for `heads` heads with the entries in memory, not
/// in cache: the median of nine runs, each after reading 64 MB of other data.
fn cold_scores(lat: usize, rot: usize, heads: usize) -> f64 {
    use charm_shared::aligned::AlignedVec;
    let (keys, w) = (2048, lat + rot);
    let cache = AlignedVec::from(&common::noise(keys * w, 21)[..]);
    let q = common::noise(heads * w, 22);
    let q_abs: Vec<&[f32]> = (0..heads).map(|h| &q[h * w..][..lat]).collect();
    let q_rope: Vec<&[f32]> = (0..heads).map(|h| &q[h * w + lat..(h + 1) * w]).collect();
    let other = vec![1u64; 8 << 20];
    let mut runs: Vec<f64> = (0..9)
        .map(|_| {
            black_box(other.iter().step_by(8).sum::<u64>());
            let t = Instant::now();
            let (mut l, mut r) = (vec![[0.0f32; 8]; heads], vec![[0.0f32; 8]; heads]);
            for k0 in (0..keys).step_by(8) {
                let e: [&[f32]; 8] = std::array::from_fn(|i| &cache[(k0 + i) * w..][..w]);
                score_block(e, (&q_abs, &q_rope), &mut l, &mut r);
                black_box(&l);
            }
            t.elapsed().as_secs_f64()
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

/// One block of eight entries' scores into `l`, as `attend_latent` computes them: `dots_heads`
/// over the latents (the entries' first `q_abs[h].len()` floats), then over the rotary parts into
/// `r`, the two added and scaled.
fn score_block(
    e: [&[f32]; 8],
    (q_abs, q_rope): (&[&[f32]], &[&[f32]]),
    l: &mut [[f32; 8]],
    r: &mut [[f32; 8]],
) {
    use charm_shared::kernels::dots_heads;
    let lat = q_abs[0].len();
    dots_heads(e.map(|e| &e[..lat]), q_abs, l);
    dots_heads(e.map(|e| &e[lat..]), q_rope, r);
    for (l, r) in l.iter_mut().zip(r.iter()) {
        *l = std::array::from_fn(|i| (l[i] + r[i]) * 0.1);
    }
}

/// [`f32_step_ceiling`]'s best of five, where the CPU has AVX2.
fn f32_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return Some(best_of_five(&|| unsafe { f32_step_ceiling(200_000_000) }));
    }
    None
}

/// The best rate of five runs of a register-only step loop (`f` returns the rate and the
/// loop's result, kept from the optimizer).
#[cfg(target_arch = "x86_64")]
fn best_of_five<T>(f: &dyn Fn() -> (f64, T)) -> f64 {
    (0..5)
        .map(|_| {
            let (g, s) = f();
            black_box(s);
            g
        })
        .fold(0.0, f64::max)
}

/// `vmulps` then `vaddps` (8 lanes of f32, multiplied, then added: the unfused pair charm's f32
/// kernels use so that every device gives each element the same bits) in a loop over registers
/// only, six independent chains: the most f32 multiply-adds per second attention's arithmetic
/// allows on this core.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn f32_step_ceiling(steps: usize) -> (f64, f32) {
    use std::arch::x86_64::*;
    // six chains: with their six multiplicands and the step's multiplier in registers (x86's 16
    // vector registers hold no more without spilling), enough to keep two adders busy through
    // an addition's latency of three cycles
    const CHAINS: usize = 6;
    let mut s = [_mm256_setzero_ps(); CHAINS];
    // lanes of different values, so that no product reduces to a broadcast scalar
    let w: [__m256; CHAINS] = std::array::from_fn(|k| {
        let v: [f32; 8] = black_box(std::array::from_fn(|l| 1.0 + (8 * k + l) as f32 / 64.0));
        // SAFETY: `v` holds 8 floats.
        unsafe { _mm256_loadu_ps(v.as_ptr()) }
    });
    // a new multiplier every step, loaded (no arithmetic of its own)
    let vals: [f32; 16] = black_box(std::array::from_fn(|i| i as f32 * 1e-9));
    let t = Instant::now();
    for i in 0..steps / 8 {
        // SAFETY: `i % 8 + 8 <= 16`.
        let a = unsafe { _mm256_loadu_ps(vals.as_ptr().add(i % 8)) };
        for k in 0..CHAINS {
            s[k] = _mm256_add_ps(s[k], _mm256_mul_ps(w[k], a));
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let mut sum = _mm256_setzero_ps();
    for v in s {
        sum = _mm256_add_ps(sum, v);
    }
    (
        (8 * CHAINS * (steps / 8)) as f64 / secs / 1e9,
        _mm256_cvtss_f32(sum),
    )
}

/// `vpdpbusd` (64 multiply-adds of u8 x i8 into i32) in a loop over registers only, eight
/// independent chains: the most multiply-adds per second the VNNI lane kernel's arithmetic
/// allows on this core.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn vnni_step_ceiling(steps: usize) -> (f64, i32) {
    use std::arch::x86_64::*;
    let mut s = [_mm512_set1_epi32(1); 8];
    let mut w = [_mm512_setzero_si512(); 8];
    for (k, w) in w.iter_mut().enumerate() {
        *w = _mm512_set1_epi8(k as i8 + 1);
    }
    let t = Instant::now();
    for i in 0..steps / 8 {
        let a = _mm512_set1_epi32(black_box(i as i32));
        for k in 0..8 {
            s[k] = _mm512_dpbusd_epi32(s[k], w[k], a);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let mut sum = _mm512_setzero_si512();
    for v in s {
        sum = _mm512_add_epi32(sum, v);
    }
    (
        64.0 * steps as f64 / secs / 1e9,
        _mm512_reduce_add_epi32(sum),
    )
}

/// The multiply-add peak of one core on `isa` for `kind` weights, GMAC/s: its kernel's step over
/// registers only (the best of five loops); `None` for the scalar path.
fn mac_peak(isa: Isa, kind: QuantKind) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        let run = best_of_five;
        match isa {
            // SAFETY: `Isa::Avx512Vnni` is only detected with avx512f/bw/vnni.
            Isa::Avx512Vnni => Some(run(&|| unsafe { vnni_step_ceiling(200_000_000) })),
            // SAFETY: `Isa::Avx2` is only detected with avx2.
            Isa::Avx2 if kind == QuantKind::Int4 => {
                Some(run(&|| unsafe { avx2_step_ceiling::<false>(200_000_000) }))
            }
            // SAFETY: as above.
            Isa::Avx2 => Some(run(&|| unsafe { avx2_step_ceiling::<true>(200_000_000) })),
            Isa::Scalar => None,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, kind);
        None
    }
}

fn criterion_benches(c: &mut Criterion) {
    let isa = Isa::detect();
    for (name, r, cols) in SHAPES {
        let m = Matrix::new(r, cols, common::noise(r * cols, 7));
        let mut g = c.benchmark_group(name);
        g.sample_size(20);
        for kind in [QuantKind::Int4, QuantKind::Int8, QuantKind::Bf16] {
            let group = if kind == QuantKind::Bf16 { cols } else { 64 };
            let q = QMatrix::quantize(&m, kind, group).unwrap();
            g.throughput(Throughput::Bytes(weight_bytes(&q)));
            for n in [1usize, 8] {
                let x = common::noise(n * cols, 3);
                g.bench_with_input(
                    BenchmarkId::new(format!("{}-{isa:?}", kind.name()), n),
                    &n,
                    |b, &n| b.iter(|| q.matmul(&x, n, isa)),
                );
            }
        }
        g.finish();
    }
}

fn main() {
    let args = common::Args::from_env();
    if args.has("--compute") {
        compute_summary(&args.counts("--tokens", "1,4,16,64"));
        attention_summary();
        return;
    }
    if args.has("--experts") {
        experts_summary(
            &args.counts("--tokens", "1,2,4,8"),
            args.has("--glm52"),
            args.parsed("--top", 8),
        );
        return;
    }
    if args.has("--summary") {
        summary(
            args.has("--quick"),
            args.has("--yardstick"),
            &args.counts("--tokens", "1,8"),
        );
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_benches(&mut c);
    c.final_summary();
}
