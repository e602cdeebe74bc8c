//! Running a model on this machine: `charm logits` (one teacher-forced pass) and `charm generate`
//! (decoding through the KV cache). `charm chat`, the third of this group, is in `chat.rs`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use charm_coordinator::decode::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::model::engine::render_stats;
use charm_coordinator::{ForwardOptions, MlaMode};
use charm_shared::quant::Activations;
use clap::{Args, ValueEnum};

use crate::common::{self, parse_ids, Act, DraftArgs, StoreArgs};

/// MLA evaluation (the `--mla` flag).
#[derive(Copy, Clone, Debug, ValueEnum)]
pub enum Mla {
    Naive,
    Absorbed,
}

fn opts(m: Mla) -> ForwardOptions {
    ForwardOptions {
        mla: match m {
            Mla::Naive => MlaMode::Naive,
            Mla::Absorbed => MlaMode::Absorbed,
        },
    }
}

/// The flags of `charm logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long)]
    pub ids: String,
    #[arg(long)]
    pub out: PathBuf,
    /// MLA evaluation: naive expansion or weight absorption.
    #[arg(long, value_enum, default_value = "naive")]
    pub mla: Mla,
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `charm logits`: one teacher-forced pass without cache; writes tensor `logits` [S, vocab] f32.
pub fn logits(a: &LogitsArgs) -> Result<()> {
    let (model, out, mla, store) = (&a.model, &a.out, a.mla, &a.store);
    let act: Activations = a.activations.into();
    let ids = parse_ids(&a.ids)?;
    let e = common::load(model, store, ids.len(), act)?;
    let m = &e.model;
    let mut cache = KvCache::new(&m.spec);
    let normed = m.forward(&ids, &mut cache, opts(mla), None)?;
    let logits = m.logits(&normed, ids.len())?;
    charm_shared::safetensors::write_f32(
        out,
        &[("logits", vec![ids.len(), m.spec.vocab_size], &logits)],
    )
    .with_context(|| format!("writing {}", out.display()))?;
    common::finish(&e, store)?;
    eprintln!(
        "wrote logits [{}, {}] to {}",
        ids.len(),
        m.spec.vocab_size,
        out.display()
    );
    Ok(())
}

/// The flags of `charm generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated prompt token ids.
    #[arg(long, required_unless_present = "prompt", conflicts_with = "prompt")]
    pub ids: Option<String>,
    /// Prompt text, tokenized with the model's tokenizer.json; the output is printed as text.
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop at the model's end-of-sequence tokens.
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[arg(long, value_enum, default_value = "absorbed")]
    pub mla: Mla,
    /// Activations against quantized weights: f32 (exact product of the stored weights) or
    /// int8 (integer dot products: faster, adds activation rounding; see docs/quality.md).
    #[arg(long, value_enum, default_value = "f32")]
    pub activations: Act,
    /// Prefill the prompt this many times before the timed generation, untimed and into a
    /// cache that is then dropped (a warm run, as `llama-bench` times after its warm-up run:
    /// the process's first forward pass also pays for its fresh memory).
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// `charm generate`: decodes through the KV cache; prints the ids (or the text with `--prompt`)
/// and the speed, or one JSON object with `--json`.
pub fn generate(a: &GenerateArgs) -> Result<()> {
    let (model, ids, text) = (&a.model, a.ids.as_deref(), a.prompt.as_deref());
    let (max_tokens, stop_at_eos, json, mla, store) =
        (a.max_tokens, a.stop_at_eos, a.json, a.mla, &a.store);
    let act: Activations = a.activations.into();
    let sp = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        ..Default::default()
    };
    let tok = match text {
        Some(_) => Some(TextTokenizer::load(model)?),
        None => None,
    };
    let prompt = match (ids, text, &tok) {
        (Some(ids), _, _) => parse_ids(ids)?,
        (None, Some(t), Some(tok)) => tok.encode(t)?,
        _ => bail!("give --ids or --prompt"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if !(sp.temperature >= 0.0 && sp.temperature.is_finite()) {
        bail!("--temperature must be >= 0");
    }
    if !(sp.top_p > 0.0 && sp.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1]");
    }
    let t = std::time::Instant::now();
    let draft = a.draft.options(store.cluster.is_some());
    let e = common::load(model, store, prompt.len() + max_tokens + draft.max, act)?;
    let m = &e.model;
    let load_s = t.elapsed().as_secs_f64();
    for _ in 0..a.warmup {
        m.forward(&prompt, &mut KvCache::new(&m.spec), opts(mla), None)?;
    }
    let before = e.stats();
    let stops = if stop_at_eos {
        m.spec.eos_token_ids.clone()
    } else {
        Vec::new()
    };
    let g = generate::generate_with_drafts(
        m,
        &prompt,
        max_tokens,
        &mut Sampler::new(sp),
        &stops,
        opts(mla),
        draft,
    )?;
    common::finish(&e, store)?;
    let run = e
        .stats()
        .map(|s| before.as_ref().map_or(s.clone(), |b| s.since(b)));
    if json {
        let mut v = serde_json::json!({
            "ids": g.ids,
            "prompt_tokens": g.prompt_tokens,
            "finish_reason": g.finish_reason,
            "load_seconds": load_s,
            "warmup": a.warmup,
            "prefill_seconds": g.prefill_seconds,
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_seconds": g.decode_seconds,
            "decode_tok_s": g.decode_tok_s(),
            "isa": format!("{:?}", charm_shared::quant::active_isa()),
            "threads": charm_shared::par::threads(),
        });
        if let Some(tok) = &tok {
            v["text"] = tok.decode(&g.ids)?.into();
        }
        if let Some(s) = &g.speculation {
            v["speculation"] = serde_json::json!({
                "source": s.source,
                "steps": s.steps,
                "drafted": s.drafted,
                "accepted": s.accepted,
                "acceptance": s.acceptance(),
                "lookup_drafted": s.lookup_drafted,
                "lookup_accepted": s.lookup_accepted,
                "tokens_per_step": g.ids.len().saturating_sub(1) as f64 / s.steps.max(1) as f64,
                "steps_by_drafts": s.steps_by_drafts,
            });
        }
        v["stats"] = e.run_stats(run.as_ref());
        println!("{v}");
    } else {
        match &tok {
            Some(tok) => println!("{}{}", text.unwrap_or(""), tok.decode(&g.ids)?),
            None => println!(
                "{}",
                g.ids
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
        eprintln!(
            "prefill {} tokens in {:.3}s ({:.1} tok/s), decode {} tokens in {:.3}s ({:.1} tok/s), finish: {}",
            g.prompt_tokens, g.prefill_seconds, g.prefill_tok_s(), g.ids.len(), g.decode_seconds, g.decode_tok_s(), g.finish_reason
        );
        if let Some(s) = &g.speculation {
            eprintln!(
                "speculative ({}): {} steps, {} of {} drafts accepted ({:.0}%; from prompt lookup {} of {}), {:.2} tokens per step",
                s.source,
                s.steps,
                s.accepted,
                s.drafted,
                100.0 * s.acceptance(),
                s.lookup_accepted,
                s.lookup_drafted,
                g.ids.len().saturating_sub(1) as f64 / s.steps.max(1) as f64
            );
        }
        eprintln!("{}", render_stats(run.as_ref()));
    }
    Ok(())
}
