//! GLM-5.x (`glm_moe_dsa`): MLA with interleaved partial RoPE, DSA lightning-indexer sparse
//! attention with cross-layer top-k sharing, sigmoid noaux_tc router, shared experts.
//! Reference: `transformers/models/glm_moe_dsa/{configuration,modeling}_glm_moe_dsa.py`.

use std::path::Path;

use serde::Deserialize;

use super::common::{check_schedule, default, read_deepseek, GLM_MOE_DSA};
use crate::config::{DsaSpec, IndexerKind, LayerSpec, ModelSpec};
use crate::error::LoadError;

/// `GlmMoeDsaConfig`'s own keys; the ones it shares are read by [`Base`] and [`DeepseekKeys`].
///
/// [`Base`]: super::common::Base
/// [`DeepseekKeys`]: super::common::DeepseekKeys
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(
        default = "default::routed_experts::<GLM_MOE_DSA>",
        alias = "num_experts"
    )]
    pub n_routed_experts: usize,
    #[serde(default)]
    pub n_group: Option<usize>,
    #[serde(default)]
    pub topk_group: Option<usize>,
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default = "default::n::<2048>")]
    pub index_topk: usize,
    #[serde(default = "default::n::<128>")]
    pub index_head_dim: usize,
    #[serde(default = "default::n::<32>")]
    pub index_n_heads: usize,
    #[serde(default)]
    pub indexer_types: Option<Vec<String>>,
    #[serde(default)]
    pub index_topk_pattern: Option<serde_json::Value>,
    #[serde(default = "default::n::<1>")]
    pub index_topk_freq: usize,
    #[serde(default = "default::n::<2>")]
    pub index_skip_topk_offset: usize,
}

/// The per-layer indexer schedule: explicit `indexer_types`, else `index_topk_pattern`, else
/// `index_topk_freq` / `index_skip_topk_offset` (as the released GLM-5.2 config has it).
pub fn indexer_schedule(
    c: &Config,
    n_layers: usize,
    path: &Path,
) -> Result<Vec<IndexerKind>, LoadError> {
    let parse = |s: &str| match s {
        "full" | "F" => Ok(IndexerKind::Full),
        "shared" | "S" => Ok(IndexerKind::Shared),
        o => Err(LoadError::config(
            path,
            format!("unknown indexer type `{o}`"),
        )),
    };
    let kinds: Vec<IndexerKind> = if let Some(t) = &c.indexer_types {
        t.iter().map(|s| parse(s)).collect::<Result<_, _>>()?
    } else if let Some(p) = &c.index_topk_pattern {
        match p {
            serde_json::Value::String(s) => s
                .chars()
                .map(|ch| parse(&ch.to_string()))
                .collect::<Result<_, _>>()?,
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| parse(x.as_str().unwrap_or("?")))
                .collect::<Result<_, _>>()?,
            _ => {
                return Err(LoadError::config(
                    path,
                    "index_topk_pattern must be a string or list",
                ))
            }
        }
    } else {
        let freq = c.index_topk_freq.max(1);
        let off = c.index_skip_topk_offset;
        (0..n_layers)
            .map(|i| {
                if ((i + 1).saturating_sub(off)) % freq == 0 {
                    IndexerKind::Full
                } else {
                    IndexerKind::Shared
                }
            })
            .collect()
    };
    check_schedule("indexer schedule", kinds.len(), n_layers, path)?;
    Ok(kinds)
}

pub(crate) fn spec(v: serde_json::Value, path: &Path) -> Result<ModelSpec, LoadError> {
    let (base, keys, c) = read_deepseek::<GLM_MOE_DSA, Config>(v, path)?;
    let mla = keys.mla(&base, c.n_routed_experts, c.n_group, c.topk_group, path)?;
    if keys.q_lora_rank.is_none() {
        return Err(LoadError::config(
            path,
            "glm_moe_dsa needs q_lora_rank (the DSA indexer reads the q latent)",
        ));
    }
    let mlp = keys.mlp_schedule(&base, c.mlp_layer_types.as_deref(), path)?;
    let indexers = indexer_schedule(&c, base.num_hidden_layers, path)?;
    let layers = mlp
        .into_iter()
        .zip(indexers)
        .map(|(mlp, i)| LayerSpec {
            mlp,
            indexer: Some(i),
        })
        .collect();
    let dsa = DsaSpec {
        n_heads: c.index_n_heads,
        head_dim: c.index_head_dim,
        topk: c.index_topk,
        rope_dim: keys.qk_rope_head_dim,
    };
    keys.spec(base, mla, true, layers, Some(dsa), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_glm52_schedule_from_freq_and_offset() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/data/glm-5.2-config.json"
        ))
        .unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let listed: Vec<String> = serde_json::from_value(v["indexer_types"].clone()).unwrap();
        v.as_object_mut().unwrap().remove("indexer_types");
        let spec = ModelSpec::from_json(&v.to_string(), Path::new("config.json")).unwrap();
        let derived: Vec<&str> = spec
            .layers
            .iter()
            .map(|l| {
                if l.indexer == Some(IndexerKind::Full) {
                    "full"
                } else {
                    "shared"
                }
            })
            .collect();
        assert_eq!(derived, listed);
        assert_eq!(spec.moe_layers(), 75);
    }
}
