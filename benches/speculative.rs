//! Speculative decoding: what verifying `k` drafts costs, what it buys end to end, and what that
//! predicts for GLM-5.2.
//!
//! 1. The verify-cost curve: the time of a forward step (and the head) over `1 + k` tokens of one
//!    sequence against a one-token step, `k = 1..K`, fed an oracle draft (the model's own greedy
//!    continuation, so that every draft is accepted). Step `i` runs at the same position for every
//!    `k` (the cache rolls back after it and advances by `K + 1` oracle tokens, untimed), so the
//!    points compare steps over the same contexts, as verifying and plain decoding at one point of
//!    a sequence do. The `k`s take turns step by step (one cache each), so a slow stretch of a
//!    shared machine falls on every point alike.
//!    Beside it, the weight-traffic ratio of the same steps: a step reads the dense weights once
//!    and each distinct routed expert its rows chose once (`dense + distinct experts x expert
//!    bytes`, as `benches/batch.rs` counts), and from both the speed-up a per-draft acceptance
//!    would give.
//! 2. End to end (`--decode N`): N greedy tokens with `--draft 0`, then with `--draft K`
//!    (adaptive) and with K fixed: tokens per second, tokens per step, acceptance, and routed
//!    experts read from disk per token (`--ram GIB` streams them).
//! 3. GLM-5.2 (`--predict DIR`, a directory with its `config.json`): per step, the bytes a
//!    memory-bound box reads (int8 dense, int4 experts, uniform routing over 256 experts: a
//!    pessimistic union) and the round trips a network-bound cluster waits, at the accepted
//!    lengths vLLM (2.9 with 5 drafts) and colibrì (2.2) report.
//!
//! ```sh
//! cargo bench --bench speculative -- --model DIR [--drafts 5] [--steps 16] [--activations int8]
//!                                    [--decode 200] [--ram GIB] [--predict DIR]
//! ```

mod common;
use std::time::Instant;

use charm_coordinator::decode::generate::{generate, generate_with_drafts};
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::speculative::DraftOptions;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, HistoryPolicy, KvCache, Trace};
use charm_shared::config::ModelSpec;
use charm_shared::quant::Activations;

fn main() {
    rayon::scope(|_| run());
}

fn run() {
    let args = common::Args::from_env();
    let arg = |k: &str| args.get(k);
    let drafts: usize = arg("--drafts").map_or(5, |s| s.parse().unwrap());
    if let Some(dir) = arg("--predict") {
        predict(
            &ModelSpec::from_dir(std::path::Path::new(&dir)).unwrap(),
            drafts,
        );
    }
    let Some(_) = arg("--model") else {
        return;
    };
    let model = args.model();
    let steps: usize = arg("--steps").map_or(16, |s| s.parse().unwrap());
    let decode: usize = arg("--decode").map_or(0, |s| s.parse().unwrap());
    let activations = match arg("--activations").as_deref() {
        Some("int8") => Activations::Int8,
        _ => Activations::F32,
    };
    let ram = arg("--ram").map(|g| (g.parse::<f64>().unwrap() * (1u64 << 30) as f64) as u64);
    let ctx = 32 + steps * (drafts + 1) + decode.max(8) + drafts + 8;
    let e = Engine::load(
        &model,
        &EngineOptions {
            context: ctx,
            activations,
            ram,
            history: HistoryPolicy::Off,
            ..Default::default()
        },
    )
    .unwrap();
    let m = &e.model;
    let vocab = m.spec.vocab_size as u32;
    println!(
        "model {}, activations {activations:?}, ISA {:?}, {} threads",
        model.display(),
        charm_shared::quant::active_isa(),
        rayon::current_num_threads()
    );
    let opts = ForwardOptions::default();
    let prompt: Vec<u32> = (0..32).map(|i| (i * 7 + 2) % vocab).collect();
    let greedy = || Sampler::new(SamplingParams::default());
    if ram.is_none() {
        curve(&e, &prompt, drafts, steps, opts);
    }
    if decode == 0 {
        return;
    }
    let reads = || e.stats().map_or(0, |s| s.reads);
    let mut base = 0.0;
    for (name, d) in [
        ("--draft 0", DraftOptions::default()),
        (
            "adaptive",
            DraftOptions {
                max: drafts,
                ..Default::default()
            },
        ),
        (
            "fixed",
            DraftOptions {
                max: drafts,
                adaptive: false,
                ..Default::default()
            },
        ),
    ] {
        let r0 = reads();
        let g = generate_with_drafts(m, &prompt, decode, &mut greedy(), &[], opts, d).unwrap();
        let per_token = (reads() - r0) as f64 / decode as f64;
        let rate = g.decode_tok_s();
        if d.max == 0 {
            base = rate;
        }
        let spec = g.speculation.as_ref().map_or(String::new(), |s| {
            format!(
                " | {:.2} tokens per step, {:.0}% of {} drafts accepted ({}), steps by drafts {:?}",
                (g.ids.len() - 1) as f64 / s.steps.max(1) as f64,
                100.0 * s.acceptance(),
                s.drafted,
                s.source,
                s.steps_by_drafts
            )
        });
        println!(
            "decode {decode} tokens, {name} (at most {}): {rate:.1} tok/s = {:.2}x --draft 0, {per_token:.2} expert reads per token{spec}",
            d.max,
            rate / base
        );
    }
    let plain = generate(m, &prompt, decode, &mut greedy(), &[], opts).unwrap();
    let drafted = generate_with_drafts(
        m,
        &prompt,
        decode,
        &mut greedy(),
        &[],
        opts,
        DraftOptions {
            max: drafts,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(plain.ids, drafted.ids, "speculation changed the tokens");
}

/// The verify-cost curve (see the module header).
fn curve(e: &Engine, prompt: &[u32], drafts: usize, steps: usize, opts: ForwardOptions) {
    let m = &e.model;
    let plan = e.plan.as_ref().expect("a container has a plan");
    let (dense, expert) = (plan.dense_bytes as f64, plan.expert_bytes as f64);
    // the oracle: the model's own greedy continuation, long enough for every step size
    let need = (steps + 1) * (drafts + 1) + 1;
    let mut s = Sampler::new(SamplingParams::default());
    let oracle = generate(m, prompt, need, &mut s, &[], opts).unwrap().ids;
    let prefilled = || {
        let mut c = KvCache::new(&m.spec);
        m.forward(prompt, &mut c, opts, None).unwrap();
        c
    };
    // one verify step of `rows` after `c`, with the head over every row (as a verify step)
    let step = |c: &mut KvCache, rows: &[u32], tr: Option<&mut Trace>| {
        let x = m.forward_batch(
            &mut [charm_coordinator::Step {
                tokens: rows,
                cache: c,
            }],
            opts,
            tr,
        );
        let x = x.unwrap();
        m.logits(&x, rows.len()).unwrap();
    };
    step(&mut prefilled(), &oracle[..1], None); // warm-up
    let mut base: Option<(f64, f64)> = None;
    println!(
        "verify-cost curve: {steps} steps of 1 + k tokens (oracle drafts, all accepted) after a {}-token prompt; dense {:.1} MB, {:.2} MB per routed expert",
        prompt.len(),
        dense / 1e6,
        expert / 1e6
    );
    println!("| k | step time | time / 1-token step | weight traffic / 1-token step | time / traffic | speed-up at acceptance 0.5 / 0.7 / 0.9 |");
    println!("|---|---|---|---|---|---|");
    // Step `i` of every `k` verifies at the same position, `prompt + i * (drafts + 1)`: after
    // it the cache goes back to where the step began and moves on by `drafts + 1` oracle tokens
    // (untimed), so every curve point attends over the same contexts. The timed passes run
    // side by side, one cache per `k`, step `i` of every `k` before step `i + 1` of any, so
    // that a slow stretch of a shared machine falls on every point alike.
    let stride = drafts + 1;
    let advance = |c: &mut KvCache, at: usize| {
        c.truncate(prompt.len() + at);
        m.forward(&oracle[at..at + stride], c, opts, None).unwrap();
    };
    // distinct routed experts per step of `k` drafts, counted on an untimed pass
    let count_distinct = |k: usize| {
        let mut c = prefilled();
        let mut distinct = 0usize;
        for i in 0..steps {
            let at = i * stride;
            let mut tr = Trace::default();
            step(&mut c, &oracle[at..at + k + 1], Some(&mut tr));
            for layer in &tr.router {
                let mut ids: Vec<u32> = layer.iter().flat_map(|r| r.0.iter().copied()).collect();
                ids.sort_unstable();
                ids.dedup();
                distinct += ids.len();
            }
            advance(&mut c, at);
        }
        distinct as f64 / steps as f64
    };
    let distinct: Vec<f64> = (0..=drafts).map(count_distinct).collect();
    let mut caches: Vec<KvCache> = (0..=drafts).map(|_| prefilled()).collect();
    let mut secs = vec![0.0; drafts + 1];
    for i in 0..steps {
        let at = i * stride;
        for (k, c) in caches.iter_mut().enumerate() {
            let t = Instant::now();
            step(c, &oracle[at..at + k + 1], None);
            secs[k] += t.elapsed().as_secs_f64();
            advance(c, at);
        }
    }
    for k in 0..=drafts {
        let secs = secs[k] / steps as f64;
        let bytes = dense + expert * distinct[k];
        let (t0, b0) = *base.get_or_insert((secs, bytes));
        let (tr, br) = (secs / t0, bytes / b0);
        let gain = |a: f64| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>() / tr;
        println!(
            "| {k} | {:.2} ms | {tr:.2}x | {br:.2}x | {:.2} | {:.2}x / {:.2}x / {:.2}x |",
            secs * 1e3,
            tr / br,
            gain(0.5),
            gain(0.7),
            gain(0.9)
        );
    }
}

/// GLM-5.2's speed-up from speculation, memory-bound and network-bound (see the module header).
fn predict(spec: &ModelSpec, drafts: usize) {
    let Some(r) = &spec.router else {
        println!("--predict: the model has no router");
        return;
    };
    let moe = spec
        .layers
        .iter()
        .filter(|l| l.mlp == charm_shared::config::MlpKind::Moe)
        .count() as f64;
    let (h, w) = (spec.hidden_size as f64, spec.moe_intermediate_size as f64);
    // int4 experts with a scale per 64 weights; int8 dense with the same
    let expert = 3.0 * h * w * (0.5 + 4.0 / 64.0);
    use charm_coordinator::ops::info::{Accounting, Category};
    let a = Accounting::from_spec(spec, 1.0);
    // the dense skeleton and the head (one embedding row is noise)
    let params = |c| a.params.get(&c).copied().unwrap_or(0) as f64;
    let dense = (params(Category::Dense) + params(Category::Head)) * (1.0 + 4.0 / 64.0);
    let (n, k) = (r.n_experts as f64, r.top_k as f64);
    let union = |rows: usize| n * (1.0 - (1.0 - k / n).powi(rows as i32));
    let bytes = |rows: usize| dense + moe * union(rows) * expert;
    println!(
        "GLM-5.2 prediction: {moe} MoE layers, {:.2} GB dense at int8, {:.1} MB per expert at int4, {:.1} GB per token without drafts",
        dense / 1e9,
        expert / 1e6,
        bytes(1) / 1e9
    );
    println!("| drafts k | accepted length | memory-bound box: bytes per step / token's | speed-up | network-bound cluster: speed-up |");
    println!("|---|---|---|---|---|");
    for (kk, len) in [(drafts.min(5), 2.9), (2, 2.2), (3, 2.2), (5, 2.2)] {
        let ratio = bytes(kk + 1) / bytes(1);
        println!(
            "| {kk} | {len} | {ratio:.2}x | {:.2}x | {:.2}x |",
            len / ratio,
            len
        );
    }
}
