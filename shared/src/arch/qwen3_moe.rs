//! Qwen3-MoE (`qwen3_moe`): GQA attention with per-head q/k RMSNorm, half-split RoPE, softmax
//! top-k router with `norm_topk_prob`, no shared expert.
//! Reference: `transformers/models/qwen3_moe/{configuration,modeling}_qwen3_moe.py`.

use std::path::Path;

use serde::Deserialize;

use super::common::{default, read, Parts, QWEN3_MOE};
use crate::config::limits::MAX_LAYERS;
use crate::config::{AttentionSpec, GqaSpec, LayerSpec, MlpKind, ModelSpec, Scoring};
use crate::error::LoadError;

/// `Qwen3MoeConfig`'s own keys; the ones it shares are read by [`Base`].
///
/// [`Base`]: super::common::Base
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "default::n::<4>")]
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(
        default = "default::routed_experts::<QWEN3_MOE>",
        alias = "num_local_experts"
    )]
    pub num_experts: usize,
    #[serde(default = "default::n::<1>")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub use_sliding_window: bool,
}

pub(crate) fn spec(v: serde_json::Value, path: &Path) -> Result<ModelSpec, LoadError> {
    let (base, c) = read::<QWEN3_MOE, Config>(v, path)?;
    if c.use_sliding_window {
        return Err(LoadError::config(
            path,
            "use_sliding_window = true is not supported",
        ));
    }
    if base.num_attention_heads == 0 || base.num_hidden_layers > MAX_LAYERS {
        return Err(LoadError::config(
            path,
            "num_attention_heads must be positive and num_hidden_layers <= 1024",
        ));
    }
    let head_dim = c
        .head_dim
        .unwrap_or(base.hidden_size / base.num_attention_heads);
    let step = c.decoder_sparse_step.max(1);
    let layers = (0..base.num_hidden_layers)
        .map(|i| {
            let moe = !c.mlp_only_layers.contains(&i) && c.num_experts > 0 && (i + 1) % step == 0;
            LayerSpec {
                mlp: if moe { MlpKind::Moe } else { MlpKind::Dense },
                indexer: None,
            }
        })
        .collect();
    let rope = base
        .rope
        .build(head_dim, false, base.max_position_embeddings, path)?;
    let parts = Parts {
        attention: AttentionSpec::Gqa(GqaSpec {
            n_heads: base.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim,
            qk_norm: true,
            bias: base.attention_bias,
        }),
        softmax_scale: (head_dim as f32).powf(-0.5),
        rope,
        router: base.router(Scoring::Softmax, c.num_experts),
        n_shared_experts: 0,
        layers,
        dsa: None,
        mtp_layers: 0,
    };
    Ok(base.spec(parts))
}
