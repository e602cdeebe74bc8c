//! One file per architecture. Each `Config` mirrors the Hugging Face `config.json` field for field
//! (defaults as in transformers' `configuration_<arch>.py`) and converts to a [`ModelSpec`].
//!
//! [`ModelSpec`]: crate::config::ModelSpec

pub mod deepseek_v3;
pub mod glm_moe_dsa;
pub mod names;
pub mod qwen3_moe;

use std::path::Path;

use crate::config::{AttentionSpec, MlaSpec, ModelSpec, RopeParams, RouterSpec, Scoring};
use crate::error::LoadError;

impl ModelSpec {
    /// Reads `dir/config.json` and dispatches on `model_type`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| LoadError::io(&path, e))?;
        Self::from_json(&text, &path)
    }

    /// Parses a config.json text; `path` is only used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, LoadError> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| LoadError::config(path, format!("invalid JSON: {e}")))?;
        let mt = v
            .get("model_type")
            .and_then(|m| m.as_str())
            .ok_or_else(|| LoadError::config(path, "no string `model_type`"))?;
        let spec = match mt {
            "glm_moe_dsa" => glm_moe_dsa::spec(v, path)?,
            "deepseek_v3" | "kimi_k2" => deepseek_v3::spec(v, path)?,
            "qwen3_moe" => qwen3_moe::spec(v, path)?,
            other => {
                return Err(LoadError::config(
                    path,
                    format!(
                    "unknown model_type `{other}` (charm runs glm_moe_dsa, deepseek_v3, qwen3_moe)"
                ),
                ))
            }
        };
        spec.validate(path)?;
        Ok(spec)
    }
}

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
