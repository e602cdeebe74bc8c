//! Decoding: prefill the prompt through the KV cache, then one token at a time.

use std::time::Instant;

use crate::cache::KvCache;
use crate::forward::{ForwardError, ForwardOptions};
use crate::model::Model;
use crate::sampling::Sampler;

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
    if prompt.is_empty() {
        return Err(ForwardError::Shape("the prompt is empty".into()));
    }
    let mut cache = KvCache::new(&model.spec);
    cache.reserve(prompt.len() + max_tokens, &model.spec);
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
        });
    }
    let normed = model.forward(prompt, &mut cache, opts, None)?;
    let logits = model.logits(&normed[(prompt.len() - 1) * h..], 1)?;
    let mut next = sampler.sample(&logits);
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        ids.push(next);
        if stop_ids.contains(&next) {
            finish = "stop";
            break;
        }
        if ids.len() >= max_tokens {
            break;
        }
        let normed = model.forward(&[next], &mut cache, opts, None)?;
        let logits = model.logits(&normed, 1)?;
        next = sampler.sample(&logits);
    }
    Ok(Generation {
        ids,
        prompt_tokens: prompt.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
        finish_reason: finish,
    })
}
