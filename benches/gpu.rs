//! The GPU backend's speed: the device's copy bandwidth, each expert kernel (int4, int8) at a
//! GLM-5.2 expert's shape over 1 to 8 token rows as weight bytes a second beside that bandwidth,
//! and the demo model decoding with its routed experts in VRAM against the CPU alone.
//!
//! ```sh
//! cargo bench --bench gpu -- [--quick] [--rows 1,2,4,8] [--tokens N] [--gpu ID] [--model DIR]
//! ```
//!
//! - Copy: `Gpu::copy_bandwidth`, one buffer copied into another (1 GiB, `--quick` 64 MiB), bytes
//!   read plus bytes written a second, the best of three: the ceiling a kernel that streams its
//!   weights once can approach.
//! - Kernels: one expert's SwiGLU forward (gate, up, SwiGLU, down; int8 activations), hidden
//!   6144, inter 2048, groups of 64 (`--quick`: 1024 x 512), timed by `Gpu::time_run` (the
//!   dispatches repeated in one submission, no read-back), the median of three. Weight bytes are
//!   the three matrices' codes and f32 scales as they lie in VRAM. Each shape's outputs are first
//!   compared bit for bit with `SwiGlu::forward` on the CPU. Both matrix kernels run, the
//!   device's own first (`charm_worker::gpu::Matvec`: `matvec_tiled` on a GPU, `matvec` on a CPU
//!   device), then the other; the dense pass and the end-to-end decode use the device's own, or
//!   the one `CHARM_GPU_MATVEC=tiled|lanes` picks.
//! - Dense pass: the coordinator's dense skeleton of the model (`--model DIR`, the yardstick's
//!   from `charm synth --preset yardstick`; else the converted demo model) for one decoded token,
//!   routed experts answered as zeros (`probe::dense_speed`), on the CPU and on the GPU
//!   (`--dense-device gpu`), int8 activations: milliseconds a token each, and the weight bytes a
//!   token reads (`charm plan`'s `dense_read_bytes_per_token`) a second beside the copy bandwidth.
//!   (The GPU's time includes its round trip to the CPU at every MoE layer.)
//! - End to end: `models/charm-bard-moe` converted with int4 experts, decoding `--tokens` tokens
//!   (sampled, temperature 1, seed 1) with every routed expert in VRAM and on the CPU alone, both
//!   with int8 activations: tok/s each, the tokens checked equal.
//!
//! A difference from the CPU (a device refused by its self-check included) is printed as
//! `MISMATCH` and the bench exits 1, as it does, saying `FAILED`, where no expert ran on the GPU.
//! Without an adapter the bench says why and exits 0.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::median;

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::model::engine::VramBudget;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, HistoryPolicy};
use charm_shared::kernels::Matrix;
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::{Activations, QMatrix, QuantKind};
use charm_worker::gpu::{same_bits, Gpu, GpuError, Job, Matvec};

struct Args {
    quick: bool,
    rows: Vec<usize>,
    tokens: usize,
    gpu: Option<usize>,
    /// A container with int4/int8 experts to decode instead of the converted demo model (the
    /// yardstick's, for example).
    model: Option<PathBuf>,
}

fn args() -> Args {
    let a = common::Args::from_env();
    let quick = a.has("--quick");
    let args = Args {
        quick,
        rows: a.counts("--rows", "1,2,4,8"),
        tokens: a.parsed("--tokens", if quick { 32 } else { 128 }),
        gpu: a
            .get("--gpu")
            .map(|g| g.parse().expect("--gpu: an adapter's number")),
        model: a.get("--model").map(PathBuf::from),
    };
    assert!(
        !args.rows.contains(&0) && args.tokens >= 2,
        "--rows (at least 1) or --tokens (at least 2)"
    );
    args
}

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    common::noise(n, seed)
        .into_iter()
        .map(|v| v * scale)
        .collect()
}

fn expert(kind: QuantKind, group: usize, hidden: usize, inter: usize) -> SwiGlu {
    let q = |rows, cols, seed| {
        let m = Matrix::new(rows, cols, values(rows * cols, seed, 0.2));
        Linear::Quant(QMatrix::quantize(&m, kind, group).expect("quantizes"))
            .prepared(Activations::Int8)
    };
    SwiGlu {
        gate: q(inter, hidden, 1), // [inter, hidden]
        up: q(inter, hidden, 2),   // [inter, hidden]
        down: q(hidden, inter, 3), // [hidden, inter]
    }
}

/// Repetitions that make one measurement last about `target` seconds, given one took `once`.
fn reps_for(once: f64, target: f64, most: u32) -> u32 {
    ((target / once.max(1e-9)) as u32).clamp(1, most)
}

/// The device's copy bandwidth, GB/s (read + written), the best of three.
fn copy_bandwidth(gpu: &Gpu, quick: bool) -> f64 {
    let bytes: u64 = if quick { 64 << 20 } else { 1 << 30 };
    let first = gpu.copy_bandwidth(bytes, 2).expect("copy");
    let once = 2.0 * bytes as f64 / (first * 1e9);
    let reps = reps_for(once, if quick { 0.1 } else { 0.3 }, 200);
    let best = (0..3)
        .map(|_| gpu.copy_bandwidth(bytes, reps).expect("copy"))
        .fold(first, f64::max);
    println!(
        "copy: {best:.2} GB/s device-to-device (read + written), {} MiB buffer x {reps}, best of 3 [{}]",
        bytes >> 20,
        gpu.name
    );
    best
}

/// Every kernel path at every row count; false where the GPU gave other bits than the CPU.
fn kernels(gpu: &Gpu, a: &Args, copy: f64) -> bool {
    let (hidden, inter, group) = if a.quick {
        (1024, 512, 64)
    } else {
        (6144, 2048, 64)
    };
    let target = if a.quick { 0.1 } else { 0.3 };
    let mut exact = true;
    for kind in [QuantKind::Int4, QuantKind::Int8] {
        let e = expert(kind, group, hidden, inter);
        let on_gpu = gpu.upload(&e).expect("upload");
        let bytes = on_gpu.bytes();
        for &n in &a.rows {
            let x = values(n * hidden, 7 + n as u32, 4.0); // [n, hidden]
            let jobs = [Job {
                expert: &on_gpu,
                x: &x,
                rows: n,
            }];
            let got = gpu.run(&jobs).expect("run").remove(0);
            let want = e.forward(&x, n);
            if let Some(i) = (0..want.len()).find(|&i| !same_bits(got[i], want[i])) {
                println!(
                    "MISMATCH: {} {hidden}x{inter} g{group}, {n} row(s), {}: output {i} is {} on the GPU, {} on the CPU",
                    kind.name(),
                    gpu.matvec_kernel.entry(),
                    got[i],
                    want[i]
                );
                exact = false;
                continue;
            }
            let once = gpu.time_run(&jobs, 1).expect("time");
            let reps = reps_for(once, target, 1000);
            let s = median(
                (0..3)
                    .map(|_| gpu.time_run(&jobs, reps).expect("time"))
                    .collect(),
            );
            let gbs = bytes as f64 / s / 1e9;
            println!(
                "{} expert {hidden}x{inter} g{group}, {n} row(s), {}: {:.1} us per forward, {:.2} MB weights, {gbs:.2} GB/s = {:.1}% of copy, exact [{}]",
                kind.name(),
                gpu.matvec_kernel.entry(),
                s * 1e6,
                bytes as f64 / 1e6,
                100.0 * gbs / copy,
                gpu.name
            );
        }
    }
    exact
}

/// `charm convert --model SRC --out OUT --experts int4`, the binary cargo built beside this bench.
fn convert(src: &Path, out: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["convert", "--model"])
        .arg(src)
        .arg("--out")
        .arg(out)
        .args(["--experts", "int4"])
        .output()
        .expect("runs charm");
    assert!(
        o.status.success(),
        "charm convert: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `tokens` tokens after a fixed prompt (sampled, seed 1); returns the ids and decode tok/s.
fn decode(e: &Engine, tokens: usize) -> (Vec<u32>, f64) {
    let prompt: Vec<u32> = (0..8).map(|i| (i * 37 + 11) % 1000 + 2).collect();
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 1,
        ..Default::default()
    });
    let g = generate(
        &e.model,
        &prompt,
        tokens,
        &mut sampler,
        &[],
        ForwardOptions::default(),
    )
    .expect("generates");
    let tok_s = g.decode_tok_s();
    (g.ids, tok_s)
}

/// `--model`, or the demo model converted with int4 experts into a scratch directory `tag` (the
/// second path, to remove when done).
fn model_dir(a: &Args, tag: &str) -> (PathBuf, PathBuf) {
    let scratch =
        std::env::temp_dir().join(format!("charm-bench-gpu-{tag}-{}", std::process::id()));
    match &a.model {
        Some(m) => (m.clone(), scratch),
        None => {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe");
            let _ = std::fs::remove_dir_all(&scratch);
            convert(&src, &scratch);
            (scratch.clone(), scratch)
        }
    }
}

/// The dense pass of the demo model (or `--model`) on the CPU and on the GPU.
fn dense_pass(a: &Args, copy_gb_s: f64) {
    let (dir, scratch) = model_dir(a, "dense");
    let plan = charm_coordinator::ops::plan::plan(&dir, &Default::default()).expect("plans");
    let bytes = plan.dense_read_bytes_per_token as f64;
    let speed = |gpu: bool| {
        charm_coordinator::cluster::probe::dense_speed(
            &dir,
            Activations::Int8,
            0,
            64,
            0.0,
            std::time::Duration::from_micros(50),
            gpu,
        )
    };
    let isa = format!("{:?}", charm_shared::quant::active_isa());
    let threads = charm_shared::par::threads();
    let name = match &a.model {
        Some(m) => m.display().to_string(),
        None => "charm-bard-moe".to_string(),
    };
    match speed(false) {
        Ok((s, _)) => println!(
            "dense pass, {name}, CPU: {:.3} ms a token, {:.2} MB of weights = {:.1} GB/s [{isa}, {threads} threads]",
            s * 1e3,
            bytes / 1e6,
            bytes / s / 1e9
        ),
        Err(e) => println!("dense pass on the CPU: {e}"),
    }
    match speed(true) {
        Ok((s, _)) => println!(
            "dense pass, {name}, GPU: {:.3} ms a token = {:.1} GB/s of weights, {:.1}% of the copy bandwidth",
            s * 1e3,
            bytes / s / 1e9,
            100.0 * bytes / s / 1e9 / copy_gb_s
        ),
        Err(e) => println!("dense pass on the GPU: {e}"),
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The demo model (or `--model`) with its experts in VRAM and on the CPU; false where the tokens differ or no
/// expert ran on the GPU.
fn end_to_end(a: &Args) -> bool {
    let (dir, scratch) = model_dir(a, "decode");
    let opts = |vram: Option<VramBudget>| EngineOptions {
        history: HistoryPolicy::Off,
        activations: Activations::Int8,
        context: a.tokens + 32,
        vram,
        gpu: a.gpu.into_iter().collect(),
        ..Default::default()
    };
    let cpu = Engine::load(&dir, &opts(None)).expect("loads");
    // as much as the device has free (where its driver says), else 4 GiB
    let vram = Engine::load(&dir, &opts(Some(VramBudget::Auto)))
        .or_else(|_| Engine::load(&dir, &opts(Some(VramBudget::Bytes(4 << 30)))))
        .expect("loads");
    let name = match &a.model {
        Some(m) => m.display().to_string(),
        None => "charm-bard-moe int4".to_string(),
    };
    let _ = std::fs::remove_dir_all(&scratch);
    let Some(tier) = &vram.vram else {
        println!(
            "FAILED: the demo model's experts did not go to VRAM: {}",
            vram.warnings.join("; ")
        );
        return false;
    };
    let device: Vec<&str> = tier.gpus().iter().map(|g| g.name.as_str()).collect();
    let device = device.join(", ");
    // a first short run of each: pages, caches and the device's first submissions
    decode(&cpu, 4);
    decode(&vram, 4);
    let before = vram.stats().unwrap_or_default();
    let (cpu_ids, cpu_tok_s) = decode(&cpu, a.tokens);
    let (vram_ids, vram_tok_s) = decode(&vram, a.tokens);
    let st = vram.stats().unwrap_or_default().since(&before);
    let isa = format!("{:?}", charm_shared::quant::active_isa());
    let threads = charm_shared::par::threads();
    println!(
        "end to end, {name}, {} tokens, CPU only: {cpu_tok_s:.1} tok/s [{isa}, {threads} threads]",
        a.tokens
    );
    println!(
        "end to end, {name}, {} tokens, experts in VRAM: {vram_tok_s:.1} tok/s = {:.2}x the CPU's, {} expert uses on the GPU ({} experts, {:.2} MiB) [{device}]",
        a.tokens,
        vram_tok_s / cpu_tok_s,
        st.vram_hits,
        st.vram_experts,
        st.vram_bytes as f64 / (1 << 20) as f64
    );
    if let Some(i) =
        (0..cpu_ids.len().max(vram_ids.len())).find(|&i| cpu_ids.get(i) != vram_ids.get(i))
    {
        println!(
            "MISMATCH: token {i} is {:?} with experts in VRAM, {:?} on the CPU",
            vram_ids.get(i),
            cpu_ids.get(i)
        );
        return false;
    }
    if st.vram_hits == 0 {
        println!("FAILED: no expert ran on the GPU");
        return false;
    }
    println!("end to end: the {} tokens are identical", a.tokens);
    true
}

fn main() {
    let a = args();
    let gpu = match Gpu::open(a.gpu) {
        Ok(g) => g,
        Err(e @ GpuError::SelfCheck { .. }) => {
            println!("MISMATCH: {e}");
            std::process::exit(1);
        }
        Err(e) => {
            println!("no GPU benchmark: {e}");
            return;
        }
    };
    println!(
        "device: {} ({}){}",
        gpu.name,
        gpu.driver,
        if a.quick { ", --quick" } else { "" }
    );
    let copy = copy_bandwidth(&gpu, a.quick);
    let mut exact = kernels(&gpu, &a, copy);
    // the other matrix kernel, for comparison (the rest runs the one `CHARM_GPU_MATVEC` picks)
    let other = match gpu.matvec_kernel {
        Matvec::Tiled => Matvec::Lanes,
        Matvec::Lanes => Matvec::Tiled,
    };
    drop(gpu);
    match Gpu::open_with(a.gpu, Some(other)) {
        Ok(g) => exact &= kernels(&g, &a, copy),
        Err(e) => {
            println!("MISMATCH or no device with {}: {e}", other.entry());
            exact = false;
        }
    }
    dense_pass(&a, copy);
    exact &= end_to_end(&a);
    if !exact {
        println!("FAILED: see the lines above");
        std::process::exit(1);
    }
}
