//! GLM-5.x (`glm_moe_dsa`): MLA with interleaved partial RoPE, DSA lightning-indexer sparse
//! attention with cross-layer top-k sharing, sigmoid noaux_tc router, shared experts.
//! Reference: `transformers/models/glm_moe_dsa/{configuration,modeling}_glm_moe_dsa.py`.

use std::path::Path;

use serde::Deserialize;

use super::{mla_parts, sigmoid_router};
use crate::config::{
    parse_arch, token_ids, Arch, DsaSpec, IndexerKind, LayerSpec, MlpKind, ModelSpec, RopeParams,
};
use crate::error::LoadError;

fn d_vocab() -> usize {
    154880
}
fn d_hidden() -> usize {
    6144
}
fn d_inter() -> usize {
    12288
}
fn d_moe_inter() -> usize {
    2048
}
fn d_layers() -> usize {
    78
}
fn d_heads() -> usize {
    64
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
    Some(2048)
}
fn d_rope() -> usize {
    64
}
fn d_v() -> usize {
    256
}
fn d_nope() -> usize {
    192
}
fn d_topk() -> usize {
    8
}
fn d_true() -> bool {
    true
}
fn d_max_pos() -> usize {
    202752
}
fn d_eps() -> f32 {
    1e-5
}
fn d_index_topk() -> usize {
    2048
}
fn d_index_hd() -> usize {
    128
}
fn d_index_heads() -> usize {
    32
}
fn d_dense() -> usize {
    3
}
fn d_freq() -> usize {
    1
}
fn d_offset() -> usize {
    2
}

/// `GlmMoeDsaConfig`, field for field.
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
    #[serde(default = "d_experts", alias = "num_experts")]
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
    #[serde(default)]
    pub n_group: Option<usize>,
    #[serde(default)]
    pub topk_group: Option<usize>,
    #[serde(default = "d_topk")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default = "d_dense")]
    pub first_k_dense_replace: usize,
    #[serde(default = "d_index_topk")]
    pub index_topk: usize,
    #[serde(default = "d_index_hd")]
    pub index_head_dim: usize,
    #[serde(default = "d_index_heads")]
    pub index_n_heads: usize,
    #[serde(default)]
    pub indexer_types: Option<Vec<String>>,
    #[serde(default)]
    pub index_topk_pattern: Option<serde_json::Value>,
    #[serde(default = "d_freq")]
    pub index_topk_freq: usize,
    #[serde(default = "d_offset")]
    pub index_skip_topk_offset: usize,
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    #[serde(default)]
    pub scoring_func: Option<String>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
}

/// The per-layer indexer schedule: explicit `indexer_types`, else `index_topk_pattern`, else
/// `index_topk_freq` / `index_skip_topk_offset` (as the released GLM-5.2 config has it).
pub fn indexer_schedule(c: &Config, path: &Path) -> Result<Vec<IndexerKind>, LoadError> {
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
        (0..c.num_hidden_layers)
            .map(|i| {
                if ((i + 1).saturating_sub(off)) % freq == 0 {
                    IndexerKind::Full
                } else {
                    IndexerKind::Shared
                }
            })
            .collect()
    };
    if kinds.len() != c.num_hidden_layers {
        return Err(LoadError::config(
            path,
            format!(
                "indexer schedule has {} entries for {} layers",
                kinds.len(),
                c.num_hidden_layers
            ),
        ));
    }
    Ok(kinds)
}

/// `mlp_layer_types`, or `first_k_dense_replace` dense layers then sparse ones.
pub(crate) fn mlp_schedule(
    types: &Option<Vec<String>>,
    first_k_dense: usize,
    n_layers: usize,
    path: &Path,
) -> Result<Vec<MlpKind>, LoadError> {
    match types {
        Some(t) => {
            if t.len() != n_layers {
                return Err(LoadError::config(
                    path,
                    format!(
                        "mlp_layer_types has {} entries for {n_layers} layers",
                        t.len()
                    ),
                ));
            }
            t.iter()
                .map(|s| match s.as_str() {
                    "dense" => Ok(MlpKind::Dense),
                    "sparse" => Ok(MlpKind::Moe),
                    o => Err(LoadError::config(
                        path,
                        format!("unknown mlp layer type `{o}`"),
                    )),
                })
                .collect()
        }
        None => Ok((0..n_layers)
            .map(|i| {
                if i < first_k_dense {
                    MlpKind::Dense
                } else {
                    MlpKind::Moe
                }
            })
            .collect()),
    }
}

pub(crate) fn check_act(act: &Option<String>, path: &Path) -> Result<(), LoadError> {
    match act.as_deref() {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(o) => Err(LoadError::config(
            path,
            format!("hidden_act `{o}` is not supported (silu)"),
        )),
    }
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
        c.n_group,
        c.topk_group,
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
    if c.q_lora_rank.is_none() {
        return Err(LoadError::config(
            path,
            "glm_moe_dsa needs q_lora_rank (the DSA indexer reads the q latent)",
        ));
    }
    let mlp = mlp_schedule(
        &c.mlp_layer_types,
        c.first_k_dense_replace,
        c.num_hidden_layers,
        path,
    )?;
    let idx = indexer_schedule(&c, path)?;
    Ok(ModelSpec {
        arch: Arch::GlmMoeDsa,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        rms_norm_eps: c.rms_norm_eps,
        intermediate_size: c.intermediate_size,
        moe_intermediate_size: c.moe_intermediate_size,
        n_shared_experts: c.n_shared_experts,
        attention: parts.attention,
        softmax_scale: parts.softmax_scale,
        rope: rope.build(c.qk_rope_head_dim, true, c.max_position_embeddings, path)?,
        dsa: Some(DsaSpec {
            n_heads: c.index_n_heads,
            head_dim: c.index_head_dim,
            topk: c.index_topk,
            rope_dim: c.qk_rope_head_dim,
        }),
        router: Some(parts.router),
        layers: mlp
            .into_iter()
            .zip(idx)
            .map(|(mlp, i)| LayerSpec {
                mlp,
                indexer: Some(i),
            })
            .collect(),
        tie_word_embeddings: c.tie_word_embeddings,
        mtp_layers: c.num_nextn_predict_layers,
        max_position_embeddings: c.max_position_embeddings,
        bos_token_id: bos,
        eos_token_ids: eos,
    })
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
