//! The sampling and length settings every generation route shares, checked field by field.

use axum::body::Bytes;
use serde_json::Value as Json;

use super::error::{bad, ApiError};
use crate::decode::sampling::{Penalties, SamplingParams};

/// The sampling and length settings every generation endpoint shares, validated.
#[derive(Debug)]
pub(super) struct Settings {
    pub(super) params: SamplingParams,
    pub(super) penalties: Penalties,
    pub(super) logprobs: Option<usize>,
    pub(super) max_tokens: Option<usize>,
    pub(super) stop: Vec<String>,
    pub(super) stream: bool,
    /// Generate past the end-of-sequence tokens (vLLM's and llama.cpp's `ignore_eos`).
    pub(super) ignore_eos: bool,
    /// Choices to sample (`n`; choice `i` uses `seed + i`).
    pub(super) n: usize,
    /// The prompt comes back before the completion (`echo`, completions only).
    pub(super) echo: bool,
}

/// Checks `body` against the `known` fields and reads the shared settings.
pub(super) fn settings(body: &Json, known: &[&str]) -> Result<Settings, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(bad("the body must be a JSON object"));
    };
    const UNSUPPORTED: &[(&str, &str)] = &[
        ("tools", "tool calls are not supported yet"),
        ("tool_choice", "tool calls are not supported yet"),
        ("functions", "function calls are not supported yet"),
        ("logit_bias", "logit_bias is not supported yet"),
        ("suffix", "suffix is not supported"),
    ];
    for (k, v) in obj {
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(u, _)| u == k) {
            if !v.is_null() {
                return Err(bad(format!("`{k}`: {why}")));
            }
            continue;
        }
        if !known.contains(&k.as_str()) {
            return Err(bad(format!("unknown field `{k}`")));
        }
    }
    let num = |k: &str| -> Result<Option<f64>, ApiError> {
        match obj.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be a number"))),
        }
    };
    let int = |k: &str| -> Result<Option<u64>, ApiError> {
        match obj.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative integer"))),
        }
    };
    let mut penalties = Penalties::default();
    for (k, slot) in [
        ("presence_penalty", &mut penalties.presence),
        ("frequency_penalty", &mut penalties.frequency),
    ] {
        if let Some(v) = num(k)? {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(format!("`{k}` {v} is outside -2..2")));
            }
            *slot = v as f32;
        }
    }
    if let Some(v) = num("repetition_penalty")? {
        if !(v > 0.0 && v <= 10.0) {
            return Err(bad(format!("`repetition_penalty` {v} is outside (0, 10]")));
        }
        penalties.repetition = v as f32;
    }
    let min_p = num("min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(bad(format!("`min_p` {min_p} is outside 0..1")));
    }
    // chat: `logprobs: true` with `top_logprobs: N`; completions: `logprobs: N`
    let logprobs = match obj.get("logprobs") {
        None | Some(Json::Null) | Some(Json::Bool(false)) => None,
        Some(Json::Bool(true)) => Some(int("top_logprobs")?.unwrap_or(0) as usize),
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| bad("`logprobs` must be true/false or a count"))?
                as usize,
        ),
    };
    if logprobs.is_some_and(|n| n > 20) {
        return Err(bad("at most 20 alternatives (`top_logprobs`)"));
    }
    let n = int("n")?.unwrap_or(1);
    if !(1..=16).contains(&n) {
        return Err(bad(format!("`n` {n} is outside 1..16")));
    }
    let temperature = num("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(format!("`temperature` {temperature} is outside 0..2")));
    }
    let top_p = num("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(format!("`top_p` {top_p} is outside (0, 1]")));
    }
    let echo = match obj.get("echo") {
        None | Some(Json::Null) => false,
        Some(Json::Bool(b)) => *b,
        Some(_) => return Err(bad("`echo` must be true or false")),
    };
    let max_tokens = int("max_completion_tokens")?.or(int("max_tokens")?);
    if max_tokens == Some(0) && !echo {
        return Err(bad(
            "`max_tokens` must be at least 1 (0 only with `echo`: the prompt's log probabilities)",
        ));
    }
    let stop = match obj.get("stop") {
        None | Some(Json::Null) => vec![],
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("`stop` must be a string or a list of strings"))?,
        Some(_) => return Err(bad("`stop` must be a string or a list of strings")),
    };
    if stop.iter().any(|s| s.is_empty()) || stop.len() > 16 {
        return Err(bad("`stop`: up to 16 non-empty strings"));
    }
    let flag = |k: &str| match obj.get(k) {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{k}` must be true or false"))),
    };
    let (stream, ignore_eos) = (flag("stream")?, flag("ignore_eos")?);
    Ok(Settings {
        params: SamplingParams {
            temperature: temperature as f32,
            top_k: int("top_k")?.unwrap_or(0) as usize,
            top_p: top_p as f32,
            // no seed: a fresh one, so unseeded sampled requests differ (as OpenAI, vLLM and
            // llama-server do); a given seed stays reproducible
            seed: int("seed")?.unwrap_or_else(fresh_seed),
            min_p: min_p as f32,
        },
        penalties,
        logprobs,
        max_tokens: max_tokens.map(|n| n as usize),
        stop,
        stream,
        ignore_eos,
        n: n as usize,
        echo,
    })
}

/// A seed for a request that gives none: a hash under std's random keys (drawn from the OS per
/// thread; every `RandomState` gets keys of its own).
fn fresh_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(())
}

pub(super) const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logprobs",
    "top_logprobs",
    "echo",
];

pub(super) fn parse(body: &Bytes) -> Result<Json, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad(format!("the body is not valid JSON: {e}")))
}
