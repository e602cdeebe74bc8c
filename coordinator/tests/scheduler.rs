//! The batch scheduler of `charm serve` driven directly, without HTTP: sequences batched
//! together (with prompts prefilled in chunks between other sequences' decode tokens) give the
//! tokens each gives alone, and a prompt that extends a finished one reuses its KV.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Penalties, Sampler, SamplingParams};
use charm_coordinator::decode::speculative::DraftOptions;
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::serve::scheduler::{Event, Job, Metrics, Schedule, Scheduler};
use charm_coordinator::{Engine, EngineOptions, ForwardOptions};
use tokio::sync::mpsc::UnboundedReceiver;

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/charm-bard-moe")
}

fn greedy(max_tokens: usize, prompt: Vec<u32>) -> Job {
    Job {
        prompt,
        max_tokens,
        params: SamplingParams::default(),
        penalties: Penalties::default(),
        logprobs: None,
        stop: vec![],
        ignore_eos: true,
        ..Default::default()
    }
}

/// The tokens the library generates greedily for `prompt` alone.
fn alone(e: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    generate(
        &e.model,
        prompt,
        n,
        &mut Sampler::new(SamplingParams::default()),
        &[],
        ForwardOptions::default(),
    )
    .unwrap()
    .ids
}

/// The text and token count a generation sends, to its end.
fn collect(mut rx: UnboundedReceiver<Event>) -> (String, usize, usize) {
    let mut text = String::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Text(t) => text += &t,
            Event::Logprobs(_) | Event::Prompt(_) => {}
            Event::Failed(m) => panic!("generation failed: {m}"),
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => return (text, prompt_tokens, completion_tokens),
        }
    }
    panic!("the generation ended without Done");
}

fn start(max_active: usize, batch_tokens: usize) -> (Scheduler, Arc<TextTokenizer>, Arc<Metrics>) {
    let e = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let tok = Arc::new(TextTokenizer::load(&demo()).unwrap());
    let metrics = Arc::new(Metrics::default());
    let schedule = Schedule {
        max_active,
        batch_tokens,
        prefix_bytes: 64 << 20,
        stop_ids: e.model.spec.eos_token_ids.clone(),
        draft: DraftOptions::default(),
        forced_drafts: true,
    };
    let s = Scheduler::start(e, tok.clone(), schedule, 8, None, metrics.clone()).unwrap();
    (s, tok, metrics)
}

#[test]
fn batched_sequences_generate_what_each_generates_alone() {
    let reference = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    // a step of 6 rows: the longer prompts are prefilled in chunks beside the others' tokens
    let (s, tok, metrics) = start(3, 6);
    let prompts = [
        "ROMEO. ",
        "JULIET. O Romeo, Romeo, wherefore art thou Romeo? ",
        "Enter the King, attended by lords and soldiers. KING. ",
    ];
    let lens = [20, 12, 16];
    let jobs: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, n)| {
            let ids = tok.encode(p).unwrap();
            (ids.clone(), n, s.submit(greedy(n, ids)).unwrap())
        })
        .collect();
    for (ids, n, rx) in jobs {
        let (text, prompt_tokens, completion) = collect(rx);
        let want = alone(&reference, &ids, n);
        assert_eq!((prompt_tokens, completion), (ids.len(), want.len()));
        assert_eq!(
            text,
            tok.decode(&want).unwrap(),
            "prompt of {} tokens",
            ids.len()
        );
    }
    // every prompt was longer than one step's budget: some step carried more than one sequence
    assert!(metrics.active_peak.load(Ordering::Relaxed) >= 2);
    assert!(metrics.steps.load(Ordering::Relaxed) > 0);
}

#[test]
fn a_prompt_that_extends_a_finished_one_reuses_its_kv_and_gives_the_same_tokens() {
    let reference = Engine::load(&demo(), &EngineOptions::default()).unwrap();
    let (s, tok, metrics) = start(2, 64);
    let first = tok
        .encode("JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ")
        .unwrap();
    assert!(
        first.len() > 17,
        "the prompt must be longer than the shortest reused prefix"
    );
    let (text, _, n) = collect(s.submit(greedy(8, first.clone())).unwrap());
    assert_eq!(metrics.reused.load(Ordering::Relaxed), 0);
    // the next turn: the first prompt, its answer, and more
    let mut next = first.clone();
    next.extend(tok.encode(&text).unwrap());
    next.extend(tok.encode(" ROMEO. ").unwrap());
    let (text2, _, _) = collect(s.submit(greedy(10, next.clone())).unwrap());
    let reused = metrics.reused.load(Ordering::Relaxed) as usize;
    assert!(
        reused >= first.len() && reused < next.len(),
        "reused {reused} of {} tokens (the first prompt had {}, its answer {n})",
        next.len(),
        first.len()
    );
    assert_eq!(text2, tok.decode(&alone(&reference, &next, 10)).unwrap());
}
