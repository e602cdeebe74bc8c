//! DeepSeek-V3 / R1 and Kimi-K2 (`deepseek_v3`): MLA (optionally interleaved RoPE, YaRN scaling
//! with mscale on the softmax scale), sigmoid noaux_tc router with group-limited selection.
//! Reference: `transformers/models/deepseek_v3/{configuration,modeling}_deepseek_v3.py`.

use std::path::Path;

use serde::Deserialize;

use super::glm_moe_dsa::{check_act, mlp_schedule};
use super::{mla_parts, sigmoid_router};
use crate::config::{parse_arch, token_ids, Arch, LayerSpec, ModelSpec, RopeParams};
use crate::error::LoadError;

fn d_vocab() -> usize {
    129280
}
fn d_hidden() -> usize {
    7168
}
fn d_inter() -> usize {
    18432
}
fn d_moe_inter() -> usize {
    2048
}
fn d_layers() -> usize {
    61
}
fn d_heads() -> usize {
    128
}
fn d_one() -> usize {
    1
}
fn d_experts() -> usize {
    256
}
fn d_scale() -> f32 {
    2.5
}
fn d_kv_lora() -> usize {
    512
}
fn d_q_lora() -> Option<usize> {
    Some(1536)
}
fn d_rope() -> usize {
    64
}
fn d_v() -> usize {
    128
}
fn d_nope() -> usize {
    128
}
fn d_eight() -> usize {
    8
}
fn d_four() -> usize {
    4
}
fn d_true() -> bool {
    true
}
fn d_max_pos() -> usize {
    4096
}
fn d_eps() -> f32 {
    1e-6
}
fn d_dense() -> usize {
    3
}

/// `DeepseekV3Config`, field for field.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_one")]
    pub n_shared_experts: usize,
    #[serde(default = "d_experts")]
    pub n_routed_experts: usize,
    #[serde(default = "d_scale")]
    pub routed_scaling_factor: f32,
    #[serde(default = "d_kv_lora")]
    pub kv_lora_rank: usize,
    #[serde(default = "d_q_lora")]
    pub q_lora_rank: Option<usize>,
    #[serde(default = "d_rope")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "d_v")]
    pub v_head_dim: usize,
    #[serde(default = "d_nope")]
    pub qk_nope_head_dim: usize,
    #[serde(default = "d_eight")]
    pub n_group: usize,
    #[serde(default = "d_four")]
    pub topk_group: usize,
    #[serde(default = "d_eight")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d_dense")]
    pub first_k_dense_replace: usize,
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "d_true")]
    pub rope_interleave: bool,
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    #[serde(default)]
    pub scoring_func: Option<String>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
}

pub(crate) fn spec(v: serde_json::Value, path: &Path) -> Result<ModelSpec, LoadError> {
    let rope = RopeParams::from_config(&v, path)?;
    let bos = token_ids(v.get("bos_token_id")).first().copied();
    let eos = token_ids(v.get("eos_token_id"));
    let c: Config = parse_arch(v, path)?;
    check_act(&c.hidden_act, path)?;
    if c.num_hidden_layers == 0 || c.num_hidden_layers > crate::config::limits::MAX_LAYERS {
        return Err(LoadError::config(
            path,
            format!(
                "num_hidden_layers = {} is outside 1..=1024",
                c.num_hidden_layers
            ),
        ));
    }
    if c.attention_bias {
        return Err(LoadError::config(
            path,
            "attention_bias = true is not supported for MLA",
        ));
    }
    let router = sigmoid_router(
        c.n_routed_experts,
        c.num_experts_per_tok,
        Some(c.n_group),
        Some(c.topk_group),
        c.norm_topk_prob,
        c.routed_scaling_factor,
        c.scoring_func.as_deref(),
        path,
    )?;
    let parts = mla_parts(
        c.num_attention_heads,
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
        &rope,
        router,
    );
    let mlp = mlp_schedule(&None, c.first_k_dense_replace, c.num_hidden_layers, path)?;
    Ok(ModelSpec {
        arch: Arch::DeepseekV3,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        rms_norm_eps: c.rms_norm_eps,
        intermediate_size: c.intermediate_size,
        moe_intermediate_size: c.moe_intermediate_size,
        n_shared_experts: c.n_shared_experts,
        attention: parts.attention,
        softmax_scale: parts.softmax_scale,
        rope: rope.build(
            c.qk_rope_head_dim,
            c.rope_interleave,
            c.max_position_embeddings,
            path,
        )?,
        dsa: None,
        router: Some(parts.router),
        layers: mlp
            .into_iter()
            .map(|mlp| LayerSpec { mlp, indexer: None })
            .collect(),
        tie_word_embeddings: c.tie_word_embeddings,
        mtp_layers: c.num_nextn_predict_layers,
        max_position_embeddings: c.max_position_embeddings,
        bos_token_id: bos,
        eos_token_ids: eos,
    })
}
