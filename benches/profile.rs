//! Where a decode step's time goes: one sequence decoding `--tokens` tokens after a short prompt
//! (greedy), each phase of the forward pass timed (`model::profile`: attention, router, shared
//! expert, routed experts, residual, norms, head, lookahead; within attention its projections,
//! the DSA indexer, attention over the cache and the output projection) as milliseconds per step
//! and its share of the step, beside the step's weight bytes over this machine's memory read
//! bandwidth (the bound a decode step that only read weights would meet).
//!
//! `--rows N` decodes N sequences of the same prompt as one batch: N identical rows a step, which
//! route to the same experts, so the step reads the same weights as one row (the multi-row
//! kernels' case; the line `rows` gives the step's time over a one-row step's, run alternately).
//!
//! `--prompt N` (default 16) sets the prompt's length, so the context the steps attend over:
//! `N + 1` to `N + tokens` positions.
//!
//! `--prefill N` times prompt processing instead: an N-token prompt prefilled into an empty
//! cache (the median of `--runs` runs, default 5, tok/s), then the phases of one more, profiled.
//!
//! ```sh
//! cargo bench --bench profile -- [--model DIR] [--tokens 64] [--prompt 16] [--activations f32|int8] [--rows N]
//! cargo bench --bench profile -- [--model DIR] [--activations f32|int8] --prefill 128
//! ```
//!
//! `DIR` defaults to the demo model; the yardstick's is `charm synth --preset yardstick --out
//! DIR`. The weight bytes a token reads are `charm plan`'s (`dense_read_bytes_per_token` plus
//! `active_expert_bytes_per_token`).

mod common;
use std::time::Instant;

use charm_coordinator::model::profile;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, KvCache, Step};
use charm_shared::quant::Activations;

fn main() {
    // the allocator as `charm` sets it; on a rayon worker, as `charm generate` runs
    charm_coordinator::tune_allocator();
    rayon::scope(|_| run());
}

/// Read bandwidth of this machine's memory, GB/s: the rayon threads summing a 1 GiB buffer, the
/// best of 7 after an untimed pass.
fn memory_gb_s() -> f64 {
    use rayon::prelude::*;
    let buf: Vec<u64> = (0..(1usize << 27)).map(|i| i as u64).collect();
    let mut best = 0.0f64;
    for i in 0..8 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, |a, b| a.wrapping_add(b));
        std::hint::black_box(s);
        if i > 0 {
            best = best.max((buf.len() * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    best
}

fn run() {
    let args = common::Args::from_env();
    let model = args
        .get("--model")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe")
        });
    let tokens: usize = args.parsed("--tokens", 64);
    let prompt_len: usize = args.parsed("--prompt", 16).max(1);
    let prefill: usize = args.parsed("--prefill", 0);
    let rows: usize = args.parsed("--rows", 1).max(1);
    let activations = match args.get("--activations").as_deref() {
        Some("int8") => Activations::Int8,
        _ => Activations::F32,
    };
    let e = Engine::load(
        &model,
        &EngineOptions {
            context: (prompt_len + tokens + 64).max(prefill + 1),
            activations,
            ..Default::default()
        },
    )
    .unwrap();
    let m = &e.model;
    if prefill > 0 {
        return prefill_profile(m, prefill, args.parsed("--runs", 5), activations, &model);
    }
    let plan = charm_coordinator::ops::plan::plan(&model, &Default::default()).unwrap();
    let bytes = (plan.dense_read_bytes_per_token + plan.active_expert_bytes_per_token) as f64;
    let before = memory_gb_s();
    let prompt = prompt_ids(prompt_len, m.spec.vocab_size);
    // the prompt's prefill, then `n` decode steps of `r` identical sequences with the counters
    // on (`profiled`)
    let decode = |n: usize, r: usize, profiled: bool| -> f64 {
        let mut cache = KvCache::new(&m.spec);
        let h = m
            .forward(&prompt, &mut cache, ForwardOptions::default(), None)
            .unwrap();
        let l = m.logits(&h[h.len() - m.spec.hidden_size..], 1).unwrap();
        let mut next = charm_coordinator::decode::sampling::argmax(&l) as u32;
        let mut caches = vec![cache; r];
        profile::take();
        profile::enable(profiled);
        let t = Instant::now();
        for _ in 0..n {
            let tok = [next];
            let mut steps: Vec<Step> = caches
                .iter_mut()
                .map(|cache| Step {
                    tokens: &tok,
                    cache,
                })
                .collect();
            let h = m
                .forward_batch(&mut steps, ForwardOptions::default(), None)
                .unwrap();
            let l = m.logits(&h, r).unwrap();
            next = charm_coordinator::decode::sampling::argmax(&l[..m.spec.vocab_size]) as u32;
        }
        let s = t.elapsed().as_secs_f64() / n as f64;
        profile::enable(false);
        s
    };
    // warm: pages, caches
    decode(8, rows, false);
    // the step's time without the counters (with several rows: the median of three runs,
    // alternating with one-row runs), then the phases with them
    let (step, one) = if rows == 1 {
        (decode(tokens, 1, false), 0.0)
    } else {
        let (mut s, mut o): (Vec<f64>, Vec<f64>) = (0..3)
            .map(|_| (decode(tokens, rows, false), decode(tokens, 1, false)))
            .unzip();
        s.sort_by(f64::total_cmp);
        o.sort_by(f64::total_cmp);
        (s[1], o[1])
    };
    let profiled = decode(tokens, rows, true);
    let phases = profile::take();
    // (the VM's bandwidth wanders: the better of a probe before and one after the steps)
    let bw = before.max(memory_gb_s());
    println!(
        "model {}, activations {activations:?}, ISA {:?}, {} threads, {tokens} decode steps of {rows} row(s) after a {prompt_len}-token prompt",
        model.display(),
        charm_shared::quant::active_isa(),
        rayon::current_num_threads()
    );
    println!(
        "step {:.3} ms ({:.1} tok/s); weights {:.2} MB a step at {bw:.1} GB/s memory read bandwidth = {:.3} ms: {:.1}% of the bound",
        step * 1e3,
        rows as f64 / step,
        bytes / 1e6,
        bytes / bw / 1e6,
        100.0 * (bytes / bw / 1e9) / step
    );
    if rows > 1 {
        println!(
            "rows {rows}: step {:.3} ms against {:.3} ms for one row (medians of 3 alternating runs): {:.2}x",
            step * 1e3,
            one * 1e3,
            step / one
        );
    }
    print_phases(&phases, tokens, profiled, "a profiled step");
}

/// A deterministic `n`-token prompt within the vocabulary.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 11) % vocab as u32)
        .collect()
}

/// `--prefill n`: an `n`-token prompt prefilled into an empty cache, the median of `runs` runs
/// after a warm one, then the phases of a profiled run.
fn prefill_profile(
    m: &charm_coordinator::model::Model,
    n: usize,
    runs: usize,
    activations: Activations,
    model: &std::path::Path,
) {
    let prompt = prompt_ids(n, m.spec.vocab_size);
    let run = |profiled: bool| -> f64 {
        let mut cache = KvCache::new(&m.spec);
        profile::take();
        profile::enable(profiled);
        let t = Instant::now();
        let h = m
            .forward(&prompt, &mut cache, ForwardOptions::default(), None)
            .unwrap();
        let l = m.logits(&h[(n - 1) * m.spec.hidden_size..], 1).unwrap();
        std::hint::black_box(l);
        let s = t.elapsed().as_secs_f64();
        profile::enable(false);
        s
    };
    run(false);
    let mut times: Vec<f64> = (0..runs.max(1)).map(|_| run(false)).collect();
    times.sort_by(f64::total_cmp);
    let (lo, mid, hi) = (times[0], times[times.len() / 2], times[times.len() - 1]);
    let profiled = run(true);
    let phases = profile::take();
    println!(
        "model {}, activations {activations:?}, ISA {:?}, {} threads, prefill of {n} tokens",
        model.display(),
        charm_shared::quant::active_isa(),
        rayon::current_num_threads()
    );
    println!(
        "prefill {:.2} ms ({:.1} tok/s; median of {} runs, {:.2}-{:.2} ms)",
        mid * 1e3,
        n as f64 / mid,
        times.len(),
        lo * 1e3,
        hi * 1e3
    );
    print_phases(&phases, 1, profiled, "a profiled prefill");
}

/// The phases' times divided by `per` runs, against `total` (one run's wall time).
fn print_phases(phases: &[(profile::Phase, f64)], per: usize, total: f64, what: &str) {
    println!(
        "phases ({what}: {:.3} ms, the counters' own cost included):",
        total * 1e3
    );
    let mut counted = 0.0;
    for (p, s) in phases {
        let t = s / per as f64;
        counted += t;
        println!(
            "  {:<14} {:>8.3} ms  {:>5.1}%",
            format!("{p:?}"),
            t * 1e3,
            100.0 * t / total
        );
    }
    println!(
        "  {:<14} {:>8.3} ms  {:>5.1}%  (between phases: the greedy choice, hand-offs)",
        "other",
        (total - counted) * 1e3,
        100.0 * (total - counted) / total
    );
}
