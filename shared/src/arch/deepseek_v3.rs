//! DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`): MLA (optionally interleaved RoPE, YaRN scaling
//! with mscale on the softmax scale), sigmoid noaux_tc router with group-limited selection.
//! Reference: `transformers/models/deepseek_v3/{configuration,modeling}_deepseek_v3.py`.

use std::path::Path;

use serde::Deserialize;

use super::common::{default, read_deepseek, DEEPSEEK_V3};
use crate::config::{LayerSpec, ModelSpec};
use crate::error::LoadError;

/// `DeepseekV3Config`'s own keys; the ones it shares are read by [`Base`] and [`DeepseekKeys`].
///
/// [`Base`]: super::common::Base
/// [`DeepseekKeys`]: super::common::DeepseekKeys
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "default::routed_experts::<DEEPSEEK_V3>")]
    pub n_routed_experts: usize,
    #[serde(default = "default::n::<8>")]
    pub n_group: usize,
    #[serde(default = "default::n::<4>")]
    pub topk_group: usize,
    #[serde(default = "default::yes")]
    pub rope_interleave: bool,
}

pub(crate) fn spec(v: serde_json::Value, path: &Path) -> Result<ModelSpec, LoadError> {
    let (base, keys, c) = read_deepseek::<DEEPSEEK_V3, Config>(v, path)?;
    let mla = keys.mla(
        &base,
        c.n_routed_experts,
        Some(c.n_group),
        Some(c.topk_group),
        path,
    )?;
    let layers = keys
        .mlp_schedule(&base, None, path)?
        .into_iter()
        .map(|mlp| LayerSpec { mlp, indexer: None })
        .collect();
    keys.spec(base, mla, c.rope_interleave, layers, None, path)
}
