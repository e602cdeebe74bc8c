//! One file per architecture. Each `Config` mirrors the Hugging Face `config.json` field for field
//! (defaults as in transformers' `configuration_<arch>.py`) and converts to a [`ModelSpec`].
//!
//! [`ModelSpec`]: crate::config::ModelSpec

pub mod deepseek_v3;
pub mod glm_moe_dsa;
pub mod qwen3_moe;

use std::path::Path;

use crate::config::{AttentionSpec, MlaSpec, RopeParams, RouterSpec, Scoring};
use crate::error::LoadError;

/// The MLA + sigmoid-router fields GLM-5.x and DeepSeek-V3 share.
pub(crate) struct MlaParts {
    pub attention: AttentionSpec,
    pub softmax_scale: f32,
    pub router: RouterSpec,
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_parts(
    n_heads: usize,
    q_lora_rank: Option<usize>,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    rope: &RopeParams,
    router: RouterSpec,
) -> MlaParts {
    let qk = (qk_nope_head_dim + qk_rope_head_dim) as f32;
    MlaParts {
        attention: AttentionSpec::Mla(MlaSpec {
            n_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        }),
        softmax_scale: qk.powf(-0.5) * rope.softmax_mscale(),
        router,
    }
}

/// The sigmoid / noaux_tc router of DeepSeek-V3 and GLM-5.
pub(crate) fn sigmoid_router(
    n_experts: usize,
    top_k: usize,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
    scoring_func: Option<&str>,
    path: &Path,
) -> Result<RouterSpec, LoadError> {
    if let Some(s) = scoring_func {
        if s != "sigmoid" {
            return Err(LoadError::config(
                path,
                format!("scoring_func `{s}` is not supported for this architecture (sigmoid)"),
            ));
        }
    }
    Ok(RouterSpec {
        scoring: Scoring::Sigmoid,
        n_experts,
        top_k,
        n_group: n_group.unwrap_or(1).max(1),
        topk_group: topk_group.unwrap_or(1).max(1),
        norm_topk_prob,
        routed_scaling_factor,
        correction_bias: true,
    })
}
