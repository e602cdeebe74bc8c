//! Decoding: prefill the prompt through the KV cache, then one token at a time.

use std::time::Instant;

use crate::decode::sampling::Sampler;
use crate::decode::speculative::{verify_step, Adaptive, DraftOptions, Drafter, SpecStats};
use crate::model::cache::KvCache;
use crate::model::forward::{ForwardError, ForwardOptions};
use crate::model::Model;

/// What a generation produced, with its timings.
#[derive(Debug, Clone)]
pub struct Generation {
    /// New tokens only.
    pub ids: Vec<u32>,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Why decoding stopped: `"length"` or `"stop"`.
    pub finish_reason: &'static str,
    /// What speculative decoding did, when it ran.
    pub speculation: Option<SpecStats>,
}

impl Generation {
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_seconds)
    }
    /// Decode rate over the tokens produced after the first (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.ids.len().saturating_sub(1), self.decode_seconds)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// Generates up to `max_tokens` after `prompt`, stopping early at any of `stop_ids`.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    opts: ForwardOptions,
) -> Result<Generation, ForwardError> {
    let plain = DraftOptions::default();
    generate_with_drafts(model, prompt, max_tokens, sampler, stop_ids, opts, plain)
}

/// [`generate`] with speculative decoding ([`crate::decode::speculative`]): drafts verified in
/// one forward step with the token already chosen. The tokens are exactly [`generate`]'s with the
/// same sampler settings; `draft.max == 0` is [`generate`] itself.
pub fn generate_with_drafts(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    opts: ForwardOptions,
    draft: DraftOptions,
) -> Result<Generation, ForwardError> {
    let f = &mut |_| {};
    generate_streaming(model, prompt, max_tokens, sampler, stop_ids, opts, draft, f)
}

/// [`generate_with_drafts`], handing each token to `on_token` as it is kept (several at once
/// after a step that accepted drafts).
pub fn generate_streaming(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    opts: ForwardOptions,
    draft: DraftOptions,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation, ForwardError> {
    if prompt.is_empty() {
        return Err(ForwardError::Shape("the prompt is empty".into()));
    }
    let mut drafter = match draft.max {
        0 => None,
        _ => Some(Drafter::new(model, draft.source)?),
    };
    let mut adapt = Adaptive::new(draft.max, draft.adaptive);
    let mut stats = drafter.as_ref().map(|d| SpecStats {
        source: d.source().name(),
        steps_by_drafts: vec![0; draft.max + 1],
        ..Default::default()
    });
    let mut cache = KvCache::new(&model.spec);
    cache.reserve(prompt.len() + max_tokens + draft.max, &model.spec);
    let h = model.spec.hidden_size;
    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(max_tokens);
    let mut finish = "length";
    if max_tokens == 0 {
        return Ok(Generation {
            ids,
            prompt_tokens: prompt.len(),
            prefill_seconds: 0.0,
            decode_seconds: 0.0,
            finish_reason: finish,
            speculation: stats,
        });
    }
    let normed = model.forward(prompt, &mut cache, opts, None)?;
    let logits = model.logits(&normed[(prompt.len() - 1) * h..], 1)?;
    let mut next = sampler.sample(&logits);
    if let Some(d) = &mut drafter {
        // the MTP layer's inputs: the token after each prompt position, with its state
        let mut after = prompt[1..].to_vec();
        after.push(next);
        d.push(&after, &normed);
    }
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut context = prompt.to_vec();
    'decode: loop {
        ids.push(next);
        context.push(next);
        on_token(next);
        if stop_ids.contains(&next) {
            finish = "stop";
            break;
        }
        if ids.len() >= max_tokens {
            break;
        }
        let t = Instant::now();
        let drafts = match &mut drafter {
            Some(d) => {
                // (a token drafted past the last one wanted could not be kept)
                let want = adapt.choose().min(max_tokens - ids.len() - 1);
                d.propose(model, &context, want)?
            }
            None => Vec::new(),
        };
        let (got, states) = verify_step(model, &mut cache, sampler, next, &drafts, opts)?;
        sampler.advance(1 + got.accepted.len() as u64);
        if let Some(s) = &mut stats {
            s.steps += 1;
            s.drafted += drafts.len();
            s.accepted += got.accepted.len();
            if drafter.as_ref().is_some_and(|d| d.last_from_lookup()) {
                s.lookup_drafted += drafts.len();
                s.lookup_accepted += got.accepted.len();
            }
            s.steps_by_drafts[drafts.len().min(draft.max)] += 1;
        }
        if let Some(d) = &mut drafter {
            let mut after = got.accepted.clone();
            after.push(got.next);
            d.push(&after, &states);
            d.verified(drafts.len(), got.accepted.len());
            adapt.record(drafts.len(), got.accepted.len(), t.elapsed().as_secs_f64());
            if adapt.stopped() {
                // drafting never paid here: no drafter to keep in step either
                drafter = None;
            }
        }
        for &d in &got.accepted {
            ids.push(d);
            context.push(d);
            on_token(d);
            if stop_ids.contains(&d) {
                finish = "stop";
                break 'decode;
            }
            if ids.len() >= max_tokens {
                break 'decode;
            }
        }
        next = got.next;
    }
    Ok(Generation {
        ids,
        prompt_tokens: prompt.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        finish_reason: finish,
        speculation: stats,
    })
}
