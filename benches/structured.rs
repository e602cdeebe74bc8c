//! Structured output: what grammar masks cost against a forward step, and what forced drafts buy.
//!
//! 1. A JSON-schema extraction workload (fixed keys, enums, bounded values) through the batch
//!    scheduler, as `charm serve` runs it: without a grammar (the plain step), then constrained
//!    with forced drafts off, on, and (`--draft K`) on with the model's own drafter as well. Per
//!    mode: tokens per forward step, the time the generating thread spends on grammar masks per
//!    constrained token (waiting for the masks the compute pool's helper computes beside the
//!    forward step, applying them, taking the tokens) against the mean step time, tokens per
//!    second. Then a constrained step (forced drafts off) against the plain step.
//! 2. `--mask-tokenizer DIR`: the mask of every position of a canned answer to the same schema
//!    under a real tokenizer (e.g. `../shared/models/glm-5.2`, 155k tokens): microseconds per mask,
//!    the part that grows with the vocabulary.
//!
//! ```sh
//! cargo bench --bench structured -- [--model DIR] [--tokenizer DIR] [--requests 8]
//!                                   [--max-tokens 120] [--draft 3] [--mask-tokenizer DIR]
//! ```

mod common;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use charm_coordinator::decode::grammar::{GrammarSpec, Grammars};
use charm_coordinator::decode::sampling::SamplingParams;
use charm_coordinator::decode::speculative::DraftOptions;
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::serve::scheduler::{Event, Job, Metrics, Schedule, Scheduler};
use charm_coordinator::{Engine, EngineOptions};
use serde_json::json;

fn schema() -> serde_json::Value {
    json!({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "scene": {"type": "integer", "minimum": 1, "maximum": 9},
        "mood": {"enum": ["comic", "tragic", "pastoral"]},
        "speakers": {"type": "array", "items": {"enum": ["Romeo", "Juliet", "Nurse", "Tybalt"]}, "minItems": 1, "maxItems": 3}},
        "required": ["title", "act", "scene", "mood", "speakers"], "additionalProperties": false})
}

fn main() {
    let args = common::Args::from_env();
    let arg = |k: &str| args.get(k);
    println!("ISA: {:?}", charm_shared::quant::active_isa());
    if let Some(dir) = arg("--mask-tokenizer") {
        masks_only(std::path::Path::new(&dir));
    }
    if arg("--mask-tokenizer").is_some() && arg("--model").is_none() {
        return;
    }
    let model = args.model();
    let tok_dir = arg("--tokenizer").map_or(model.clone(), Into::into);
    let requests: usize = arg("--requests").map_or(8, |s| s.parse().unwrap());
    let max_tokens: usize = arg("--max-tokens").map_or(120, |s| s.parse().unwrap());
    let draft: usize = arg("--draft").map_or(0, |s| s.parse().unwrap());
    let tok = Arc::new(TextTokenizer::load(&tok_dir).unwrap());
    // (name, forced drafts, model drafts, constrained)
    let mut modes = vec![
        ("forced drafts off", false, 0, true),
        ("no grammar", false, 0, false),
        ("forced drafts on", true, 0, true),
    ];
    if draft > 0 {
        modes.push(("forced on + --draft", true, draft, true));
    }
    println!(
        "model {} (tokenizer {}), {requests} requests, max {max_tokens} tokens, sampled at T=0.8",
        model.display(),
        tok_dir.display()
    );
    println!(
        "{:<22} {:>7} {:>6} {:>11} {:>10} {:>9} {:>11} {:>8}",
        "mode", "tokens", "steps", "tok/step", "mask us/t", "step ms", "mask/step", "tok/s"
    );
    let mut texts: Vec<Vec<String>> = Vec::new();
    // the constrained answers' lengths (the plain run decodes as many tokens per request, so
    // that its steps see the same context lengths), the constrained step + mask and the plain
    // step, ms
    let mut lengths: Vec<usize> = Vec::new();
    let (mut constrained_ms, mut plain_ms) = (0.0, 0.0);
    for (name, forced, k, constrained) in modes {
        let e = Engine::load(&model, &EngineOptions::default()).unwrap();
        let vocab = e.model.spec.vocab_size;
        let stop_ids = e.model.spec.eos_token_ids.clone();
        let grammars = Grammars::new(&tok, vocab, &stop_ids).unwrap();
        let spec = GrammarSpec::JsonSchema {
            schema: schema(),
            strict: true,
        };
        let metrics = Arc::new(Metrics::default());
        let schedule = Schedule {
            max_active: 1,
            batch_tokens: 512,
            prefix_bytes: 0,
            stop_ids,
            draft: DraftOptions {
                max: k,
                ..DraftOptions::default()
            },
            forced_drafts: forced,
        };
        let s = Scheduler::start(
            e,
            tok.clone(),
            schedule,
            requests + 1,
            None,
            metrics.clone(),
        )
        .unwrap();
        let prompt = tok.encode("ROMEO. ").unwrap();
        let t = Instant::now();
        let mut out = Vec::new();
        let (mut tokens, mut steps0) = (0, 0);
        for i in 0..requests {
            let job = Job {
                prompt: prompt.clone(),
                max_tokens: if constrained { max_tokens } else { lengths[i] },
                ignore_eos: !constrained,
                params: SamplingParams {
                    temperature: 0.8,
                    seed: i as u64,
                    ..SamplingParams::default()
                },
                constraint: constrained.then(|| grammars.constraint(&spec).unwrap()),
                ..Job::default()
            };
            if i == 0 {
                steps0 = metrics.steps.load(Ordering::Relaxed);
            }
            let mut rx = s.submit(job).unwrap();
            let mut text = String::new();
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    Event::Text(t) => text += &t,
                    Event::Done {
                        completion_tokens, ..
                    } => {
                        tokens += completion_tokens;
                        if constrained && !forced && k == 0 {
                            lengths.push(completion_tokens);
                        }
                        break;
                    }
                    Event::Failed(m) => panic!("{m}"),
                    _ => {}
                }
            }
            out.push(text);
        }
        let secs = t.elapsed().as_secs_f64();
        let m = &metrics;
        // one prefill step per request is not a decode step
        let steps = m.steps.load(Ordering::Relaxed) - steps0 - requests as u64;
        let masks = m.masks.load(Ordering::Relaxed).max(1);
        let mask_us = m.mask_us.load(Ordering::Relaxed) as f64;
        let step_ms = m.decode_us.load(Ordering::Relaxed) as f64 / 1e3 / steps as f64;
        println!(
            "{:<22} {:>7} {:>6} {:>11.2} {:>10.1} {:>9.3} {:>10.1}% {:>8.1}",
            name,
            tokens,
            steps,
            tokens as f64 / steps as f64,
            mask_us / masks as f64,
            step_ms,
            100.0 * mask_us / 1e3 / steps as f64 / step_ms,
            tokens as f64 / secs
        );
        if !constrained {
            plain_ms = step_ms;
            continue;
        }
        if k == 0 && !forced {
            // (a step's time runs from its first token to its last: masks and sampling included)
            constrained_ms = step_ms;
        }
        texts.push(out);
    }
    println!(
        "a constrained token (forced drafts off), step with its mask: {constrained_ms:.3} ms, {:+.1}% against a plain step over as many tokens ({plain_ms:.3} ms)",
        100.0 * (constrained_ms / plain_ms - 1.0)
    );
    let same = texts.windows(2).all(|w| w[0] == w[1]);
    println!("same answers in every constrained mode: {same}");
    println!("first answer: {}", texts[0][0]);
}

/// Masks over a canned answer to the schema under the tokenizer in `dir`.
fn masks_only(dir: &std::path::Path) {
    let tok = TextTokenizer::load(dir).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    let eos: Vec<u32> = match &cfg["eos_token_id"] {
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        v => v.as_u64().into_iter().map(|x| x as u32).collect(),
    };
    let t = Instant::now();
    let g = Grammars::new(&tok, vocab, &eos).unwrap();
    let built = t.elapsed();
    let answer = r#"{"title": "The balcony", "act": 2, "scene": 2, "mood": "tragic", "speakers": ["Romeo", "Juliet"]}"#;
    let ids = tok.encode(answer).unwrap();
    let mut logits = vec![0.0f32; vocab];
    let mut per = Vec::new();
    for round in 0..5 {
        let mut c = g
            .constraint(&GrammarSpec::JsonSchema {
                schema: schema(),
                strict: true,
            })
            .unwrap();
        let t = Instant::now();
        for &id in &ids {
            c.apply(&mut logits).unwrap();
            c.accept(id).unwrap();
        }
        if round > 0 {
            per.push(t.elapsed().as_secs_f64() * 1e6 / ids.len() as f64);
        }
    }
    per.sort_by(f64::total_cmp);
    println!(
        "tokenizer {} ({vocab} rows): grammar machinery built in {:.0} ms; {} masks per answer, median {:.1} us per mask (4 rounds, {:.1}-{:.1})",
        dir.display(),
        built.as_secs_f64() * 1e3,
        ids.len(),
        per[per.len() / 2],
        per[0],
        per[per.len() - 1]
    );
}
