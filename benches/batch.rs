//! Batched decode in one process: tokens per second of one forward step (and the head) over
//! `B` sequences at once, each decoding after its own prompt, against `B = 1`; the same steps
//! one sequence at a time show what batching itself buys. Next to it, the bound of weight
//! traffic: a step reads the dense weights once and each distinct routed expert its rows chose
//! once, so `B` tokens cost `dense + distinct experts x expert bytes` against `B` times one
//! token's; the ratio of those is the most batching can give where decode is bound by reading
//! weights.
//!
//! ```sh
//! cargo bench --bench batch -- [--model DIR] [--batches 1,4,8,16] [--steps 16] [--activations f32|int8]
//! ```

mod common;
use std::time::Instant;

use charm_coordinator::{Engine, EngineOptions, ForwardOptions, KvCache, Step, Trace};
use charm_shared::quant::Activations;

fn main() {
    // on a rayon worker, as `charm serve` and `charm generate` run: kernels then split their work
    // without a hand-off from an outside thread per call
    rayon::scope(|_| run());
}

fn run() {
    let args = common::Args::from_env();
    let arg = |k: &str| args.get(k);
    let model = args.model();
    let batches = args.counts("--batches", "1,4,8,16");
    let steps: usize = arg("--steps").map_or(16, |s| s.parse().unwrap());
    let activations = match arg("--activations").as_deref() {
        Some("int8") => Activations::Int8,
        _ => Activations::F32,
    };
    let e = Engine::load(
        &model,
        &EngineOptions {
            context: 512,
            activations,
            ..Default::default()
        },
    )
    .unwrap();
    let m = &e.model;
    let (h, vocab) = (m.spec.hidden_size, m.spec.vocab_size as u32);
    println!(
        "model {}, {steps} decode steps after 32-token prompts, activations {activations:?}, ISA {:?}, {} threads",
        model.display(),
        charm_shared::quant::active_isa(),
        rayon::current_num_threads()
    );
    let opts = ForwardOptions::default();
    let prompt = |s: usize| -> Vec<u32> {
        (0..32)
            .map(|i| (s as u32 * 31 + i * 7 + 2) % vocab)
            .collect()
    };
    let plan = e.plan.as_ref().expect("a container has a plan");
    let (dense, expert) = (plan.dense_bytes as f64, plan.expert_bytes as f64);
    let mut base = 0.0;
    let mut base_bytes = 0.0;
    // the first pass over the weights (page faults, caches) is not timed
    let mut warm = KvCache::new(&m.spec);
    m.forward(&prompt(0), &mut warm, opts, None).unwrap();
    for &b in &batches {
        let mut caches: Vec<KvCache> = (0..b).map(|_| KvCache::new(&m.spec)).collect();
        let prompts: Vec<Vec<u32>> = (0..b).map(prompt).collect();
        for (c, p) in caches.iter_mut().zip(&prompts) {
            m.forward(p, c, opts, None).unwrap();
        }
        // decode: every sequence feeds a token each step (the tokens need not be the argmax
        // for a speed figure; they vary with the step)
        let step_tokens = |k: usize| -> Vec<u32> {
            (0..b)
                .map(|s| (s as u32 * 13 + k as u32 * 5 + 3) % vocab)
                .collect()
        };
        let run = |caches: &mut [KvCache], k: usize, tr: Option<&mut Trace>| {
            let toks = step_tokens(k);
            let mut st: Vec<Step> = caches
                .iter_mut()
                .zip(&toks)
                .map(|(c, t)| Step {
                    tokens: std::slice::from_ref(t),
                    cache: c,
                })
                .collect();
            let x = m.forward_batch(&mut st, opts, tr).unwrap();
            let l = m.logits(&x, b).unwrap();
            assert_eq!(l.len(), b * vocab as usize);
            assert_eq!(x.len(), b * h);
        };
        // the distinct experts of each step, from the same steps on a copy (untimed)
        let mut copy = caches.clone();
        let mut distinct = 0usize;
        for k in 0..steps {
            let mut tr = Trace::default();
            run(&mut copy, k, Some(&mut tr));
            for layer in &tr.router {
                let mut ids: Vec<u32> = layer.iter().flat_map(|r| r.0.iter().copied()).collect();
                ids.sort_unstable();
                ids.dedup();
                distinct += ids.len();
            }
        }
        drop(copy);
        let t = Instant::now();
        for k in 0..steps {
            run(&mut caches, k, None);
        }
        let rate = (b * steps) as f64 / t.elapsed().as_secs_f64();
        // weight bytes per token of this batch size
        let bytes = (dense + expert * distinct as f64 / steps as f64) / b as f64;
        if b == batches[0] {
            base = rate;
            base_bytes = bytes;
        }
        let bound = base_bytes / bytes;
        println!(
            "batch {b:>2}: {rate:8.1} tok/s, {:.2}x batch {} (weight-traffic bound {bound:.2}x: {:.1} MB/token; {:.0}% of it)",
            rate / base,
            batches[0],
            bytes / 1e6,
            100.0 * rate / base / bound
        );
    }
}
