//! What the architectures read alike, so that each architecture's file keeps only its own keys and
//! rules (as candle-transformers' per-model files do):
//!
//! - [`Base`]: the keys every `config.json` has (sizes, norm epsilon, the router's top-k,
//!   activation, embedding tying), with the RoPE parameters and token ids; `Base::spec` makes
//!   the [`ModelSpec`] of them and what an architecture builds itself (`Parts`).
//! - [`DeepseekKeys`]: what GLM-5 shares with DeepSeek-V3: multi-head latent attention, the
//!   sigmoid router's scoring and scale, shared experts, leading dense layers, MTP layers.
//! - `default`: transformers' defaults for those keys, a column per architecture.
//!
//! A config is read as views: [`Base`], [`DeepseekKeys`] where the architecture has them, and the
//! architecture's own `Config`, each a plain serde struct over the same keys. serde names the
//! first malformed key in the file's order; where several views fail, `both` reports the one
//! whose key comes first, so a config names the same key as one struct holding them all would.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::config::limits::MAX_LAYERS;
use crate::config::{
    parse_arch, token_ids, Arch, AttentionSpec, DsaSpec, LayerSpec, MlaSpec, MlpKind, ModelSpec,
    RopeParams, RopeSpec, RouterSpec, Scoring,
};
use crate::error::LoadError;

/// `glm_moe_dsa`'s column of `default`, and const argument of [`Base`] and [`DeepseekKeys`].
pub const GLM_MOE_DSA: usize = 0;
/// `deepseek_v3`'s (and `kimi_k2`'s) column.
pub const DEEPSEEK_V3: usize = 1;
/// `qwen3_moe`'s column.
pub const QWEN3_MOE: usize = 2;
/// The architecture of each column.
const ARCHS: [Arch; 3] = [Arch::GlmMoeDsa, Arch::DeepseekV3, Arch::Qwen3Moe];

/// transformers' default for each shared key where `config.json` leaves it out, from each
/// `configuration_<arch>.py`: `default::vocab_size::<A>` is column `A`'s.
pub(crate) mod default {
    macro_rules! columns {
        ($($key:ident: $ty:ty = [$($value:expr),+];)*) => {
            $(pub(crate) fn $key<const A: usize>() -> $ty { [$($value),+][A] })*
        };
    }

    columns! {
        // key                            glm_moe_dsa  deepseek_v3  qwen3_moe
        vocab_size: usize =              [154880,      129280,      151936];
        hidden_size: usize =             [6144,        7168,        2048];
        intermediate_size: usize =       [12288,       18432,       6144];
        moe_intermediate_size: usize =   [2048,        2048,        768];
        num_hidden_layers: usize =       [78,          61,          24];
        num_attention_heads: usize =     [64,          128,         32];
        max_position_embeddings: usize = [202752,      4096,        32768];
        rms_norm_eps: f32 =              [1e-5,        1e-6,        1e-6];
        num_experts_per_tok: usize =     [8,           8,           8];
        norm_topk_prob: bool =           [true,        true,        false];
        // `n_routed_experts`; Qwen3's `num_experts`.
        routed_experts: usize =          [256,         256,         128];
        // DeepseekKeys.
        q_lora_rank: Option<usize> =     [Some(2048),  Some(1536)];
        kv_lora_rank: usize =            [512,         512];
        qk_nope_head_dim: usize =        [192,         128];
        qk_rope_head_dim: usize =        [64,          64];
        v_head_dim: usize =              [256,         128];
        n_shared_experts: usize =        [1,           1];
        routed_scaling_factor: f32 =     [2.5,         2.5];
        first_k_dense_replace: usize =   [3,           3];
    }

    /// A default written in place, for a key of one architecture: `default::n::<2048>`.
    pub(crate) fn n<const N: usize>() -> usize {
        N
    }

    pub(crate) fn yes() -> bool {
        true
    }
}

/// The keys every architecture reads; `A` is its column of `default`.
#[derive(Debug, Clone, Deserialize)]
pub struct Base<const A: usize> {
    #[serde(default = "default::vocab_size::<A>")]
    pub vocab_size: usize,
    #[serde(default = "default::hidden_size::<A>")]
    pub hidden_size: usize,
    /// Width of dense-layer MLPs.
    #[serde(default = "default::intermediate_size::<A>")]
    pub intermediate_size: usize,
    /// Width of one routed expert.
    #[serde(default = "default::moe_intermediate_size::<A>")]
    pub moe_intermediate_size: usize,
    #[serde(default = "default::num_hidden_layers::<A>")]
    pub num_hidden_layers: usize,
    #[serde(default = "default::num_attention_heads::<A>")]
    pub num_attention_heads: usize,
    #[serde(default = "default::max_position_embeddings::<A>")]
    pub max_position_embeddings: usize,
    #[serde(default = "default::rms_norm_eps::<A>")]
    pub rms_norm_eps: f32,
    #[serde(default = "default::num_experts_per_tok::<A>")]
    pub num_experts_per_tok: usize,
    #[serde(default = "default::norm_topk_prob::<A>")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Only SiLU is implemented.
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
    /// `rope_parameters`, or `rope_theta` + `rope_scaling` (filled by `read`, not serde).
    #[serde(skip)]
    pub rope: RopeParams,
    /// `bos_token_id` (filled by `read`).
    #[serde(skip)]
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: an int, a list or null (filled by `read`).
    #[serde(skip)]
    pub eos_token_ids: Vec<u32>,
}

/// The keys GLM-5 shares with DeepSeek-V3, whose modelling code it derives from; `A` is the
/// architecture's column of `default`.
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekKeys<const A: usize> {
    /// `None`: queries come from one `q_proj` (DeepSeek-V2-Lite style).
    #[serde(default = "default::q_lora_rank::<A>")]
    pub q_lora_rank: Option<usize>,
    #[serde(default = "default::kv_lora_rank::<A>")]
    pub kv_lora_rank: usize,
    #[serde(default = "default::qk_nope_head_dim::<A>")]
    pub qk_nope_head_dim: usize,
    #[serde(default = "default::qk_rope_head_dim::<A>")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "default::v_head_dim::<A>")]
    pub v_head_dim: usize,
    /// Only `sigmoid` (noaux_tc) is implemented.
    #[serde(default)]
    pub scoring_func: Option<String>,
    #[serde(default = "default::routed_scaling_factor::<A>")]
    pub routed_scaling_factor: f32,
    #[serde(default = "default::n_shared_experts::<A>")]
    pub n_shared_experts: usize,
    /// Dense layers before the first MoE layer, where `mlp_layer_types` does not list them.
    #[serde(default = "default::first_k_dense_replace::<A>")]
    pub first_k_dense_replace: usize,
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
}

/// Reads a config's [`Base`] keys and the architecture's own (`Own`), and refuses an activation
/// other than SiLU.
pub(crate) fn read<const A: usize, Own: DeserializeOwned>(
    v: Value,
    path: &Path,
) -> Result<(Base<A>, Own), LoadError> {
    read_with(v, path, |v| view(v, path))
}

/// [`read`], with the [`DeepseekKeys`] as well.
pub(crate) fn read_deepseek<const A: usize, Own: DeserializeOwned>(
    v: Value,
    path: &Path,
) -> Result<(Base<A>, DeepseekKeys<A>, Own), LoadError> {
    let (base, (keys, own)) = read_with(v, path, |v| both(view(v, path), view(v, path)))?;
    Ok((base, keys, own))
}

fn read_with<const A: usize, T>(
    v: Value,
    path: &Path,
    views: impl FnOnce(&Value) -> Result<T, Failure>,
) -> Result<(Base<A>, T), LoadError> {
    let rope = RopeParams::from_config(&v, path)?;
    let (mut base, rest) = both(view::<Base<A>>(&v, path), views(&v)).map_err(|f| f.error)?;
    if let Some(act) = base.hidden_act.as_deref() {
        if !matches!(act, "silu" | "swish") {
            return Err(LoadError::config(
                path,
                format!("hidden_act `{act}` is not supported (silu)"),
            ));
        }
    }
    base.rope = rope;
    base.bos_token_id = token_ids(v.get("bos_token_id")).first().copied();
    base.eos_token_ids = token_ids(v.get("eos_token_id"));
    Ok((base, rest))
}

/// The [`ModelSpec`] fields an architecture builds itself (as documented there);
/// [`Base::spec`] adds the values of the shared keys.
#[derive(Debug)]
pub(crate) struct Parts {
    pub attention: AttentionSpec,
    pub softmax_scale: f32,
    pub rope: RopeSpec,
    pub router: RouterSpec,
    pub n_shared_experts: usize,
    pub layers: Vec<LayerSpec>,
    pub dsa: Option<DsaSpec>,
    pub mtp_layers: usize,
}

impl<const A: usize> Base<A> {
    /// The router the shared keys describe: the top `num_experts_per_tok` of `n_experts`, one
    /// group, no scaling; sigmoid scoring comes with its correction bias (noaux_tc).
    pub(crate) fn router(&self, scoring: Scoring, n_experts: usize) -> RouterSpec {
        RouterSpec {
            scoring,
            n_experts,
            top_k: self.num_experts_per_tok,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: 1.0,
            correction_bias: scoring == Scoring::Sigmoid,
        }
    }

    pub(crate) fn spec(self, p: Parts) -> ModelSpec {
        ModelSpec {
            arch: ARCHS[A],
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            rms_norm_eps: self.rms_norm_eps,
            intermediate_size: self.intermediate_size,
            moe_intermediate_size: self.moe_intermediate_size,
            n_shared_experts: p.n_shared_experts,
            attention: p.attention,
            softmax_scale: p.softmax_scale,
            rope: p.rope,
            dsa: p.dsa,
            router: Some(p.router),
            layers: p.layers,
            tie_word_embeddings: self.tie_word_embeddings,
            mtp_layers: p.mtp_layers,
            max_position_embeddings: self.max_position_embeddings,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids,
        }
    }
}

/// The attention and router of a DeepSeek-V3-style model, built before its layer schedule.
#[derive(Debug)]
pub(crate) struct Mla {
    attention: AttentionSpec,
    softmax_scale: f32,
    router: RouterSpec,
}

impl<const A: usize> DeepseekKeys<A> {
    /// Refuses what these models cannot have and builds MLA and the sigmoid router. The expert
    /// count and groups are keys each architecture spells its own way.
    pub(crate) fn mla(
        &self,
        base: &Base<A>,
        n_experts: usize,
        n_group: Option<usize>,
        topk_group: Option<usize>,
        path: &Path,
    ) -> Result<Mla, LoadError> {
        let n_layers = base.num_hidden_layers;
        if n_layers == 0 || n_layers > MAX_LAYERS {
            return Err(LoadError::config(
                path,
                format!("num_hidden_layers = {n_layers} is outside 1..=1024"),
            ));
        }
        if base.attention_bias {
            return Err(LoadError::config(
                path,
                "attention_bias = true is not supported for MLA",
            ));
        }
        if let Some(s) = self.scoring_func.as_deref().filter(|s| *s != "sigmoid") {
            return Err(LoadError::config(
                path,
                format!("scoring_func `{s}` is not supported for this architecture (sigmoid)"),
            ));
        }
        let qk = (self.qk_nope_head_dim + self.qk_rope_head_dim) as f32;
        Ok(Mla {
            attention: AttentionSpec::Mla(MlaSpec {
                n_heads: base.num_attention_heads,
                q_lora_rank: self.q_lora_rank,
                kv_lora_rank: self.kv_lora_rank,
                qk_nope_head_dim: self.qk_nope_head_dim,
                qk_rope_head_dim: self.qk_rope_head_dim,
                v_head_dim: self.v_head_dim,
            }),
            softmax_scale: qk.powf(-0.5) * base.rope.softmax_mscale(),
            router: RouterSpec {
                n_group: n_group.unwrap_or(1).max(1),
                topk_group: topk_group.unwrap_or(1).max(1),
                routed_scaling_factor: self.routed_scaling_factor,
                ..base.router(Scoring::Sigmoid, n_experts)
            },
        })
    }

    /// `mlp_layer_types` where the config lists them, else `first_k_dense_replace` dense layers
    /// then sparse ones.
    pub(crate) fn mlp_schedule(
        &self,
        base: &Base<A>,
        types: Option<&[String]>,
        path: &Path,
    ) -> Result<Vec<MlpKind>, LoadError> {
        let n_layers = base.num_hidden_layers;
        let Some(types) = types else {
            return Ok((0..n_layers)
                .map(|i| {
                    if i < self.first_k_dense_replace {
                        MlpKind::Dense
                    } else {
                        MlpKind::Moe
                    }
                })
                .collect());
        };
        check_schedule("mlp_layer_types", types.len(), n_layers, path)?;
        types
            .iter()
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

    /// The model, with RoPE over the `qk_rope_head_dim` dimensions (`interleaved` pairs or
    /// halves).
    pub(crate) fn spec(
        self,
        base: Base<A>,
        mla: Mla,
        interleaved: bool,
        layers: Vec<LayerSpec>,
        dsa: Option<DsaSpec>,
        path: &Path,
    ) -> Result<ModelSpec, LoadError> {
        let rope = base.rope.build(
            self.qk_rope_head_dim,
            interleaved,
            base.max_position_embeddings,
            path,
        )?;
        Ok(base.spec(Parts {
            attention: mla.attention,
            softmax_scale: mla.softmax_scale,
            rope,
            router: mla.router,
            n_shared_experts: self.n_shared_experts,
            layers,
            dsa,
            mtp_layers: self.num_nextn_predict_layers,
        }))
    }
}

/// Refuses a per-layer schedule (`what`) of `len` entries for `n_layers` layers.
pub(crate) fn check_schedule(
    what: &str,
    len: usize,
    n_layers: usize,
    path: &Path,
) -> Result<(), LoadError> {
    if len == n_layers {
        return Ok(());
    }
    Err(LoadError::config(
        path,
        format!("{what} has {len} entries for {n_layers} layers"),
    ))
}

/// A view of the config that failed to parse.
struct Failure {
    /// How many of the config's leading keys it took to fail.
    at: usize,
    error: LoadError,
}

/// Parses one view of the config.
fn view<T: DeserializeOwned>(v: &Value, path: &Path) -> Result<T, Failure> {
    parse_arch(v.clone(), path).map_err(|error| Failure {
        at: failing_prefix::<T>(v),
        error,
    })
}

/// How many of the config's leading keys `T` needs to see to fail: serde stops at the first
/// malformed key, so this is where that key stands (for an alias given twice, where the second
/// stands). Only runs when parsing has failed.
fn failing_prefix<T: DeserializeOwned>(v: &Value) -> usize {
    let Some(keys) = v.as_object() else {
        return 0;
    };
    (1..=keys.len())
        .find(|&n| {
            let head = keys.iter().take(n).map(|(k, x)| (k.clone(), x.clone()));
            serde_json::from_value::<T>(Value::Object(head.collect())).is_err()
        })
        .unwrap_or(keys.len())
}

/// Both views, or the failure that comes first in the file.
fn both<X, Y>(x: Result<X, Failure>, y: Result<Y, Failure>) -> Result<(X, Y), Failure> {
    match (x, y) {
        (Ok(x), Ok(y)) => Ok((x, y)),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
        (Err(a), Err(b)) => Err(if a.at <= b.at { a } else { b }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(v: Value) -> Result<ModelSpec, String> {
        ModelSpec::from_json(&v.to_string(), Path::new("config.json")).map_err(|e| e.to_string())
    }

    /// Keys of different views malformed at once: the error names the one first in the file, as
    /// one struct would (serde_json orders an object's keys by name).
    #[test]
    fn the_first_malformed_key_is_named_across_views() {
        for (first, second) in [
            ("first_k_dense_replace", "hidden_size"), // DeepseekKeys, Base
            ("hidden_size", "index_topk"),            // Base, the architecture's own
            ("index_topk", "kv_lora_rank"),           // own, DeepseekKeys
        ] {
            let v = serde_json::json!({"model_type": "glm_moe_dsa", first: "x", second: "y"});
            let e = load(v).unwrap_err();
            assert!(
                e.contains(&format!("invalid config field `{first}`")),
                "{e}"
            );
        }
    }

    /// An absurd rotary dimension is refused before anything is sized by it (it once asked for
    /// terabytes and aborted the process).
    #[test]
    fn an_absurd_rotary_dimension_is_an_error_not_an_abort() {
        for t in ["glm_moe_dsa", "deepseek_v3"] {
            let v = serde_json::json!({"model_type": t, "qk_rope_head_dim": 1u64 << 40});
            let e = load(v).unwrap_err();
            assert!(e.contains("rotary dimension"), "{e}");
        }
        let v = serde_json::json!({"model_type": "qwen3_moe", "head_dim": 1u64 << 40});
        assert!(load(v).is_err());
    }

    /// A config that names only its architecture gets transformers' defaults for that one.
    #[test]
    fn each_architecture_takes_its_own_column_of_defaults() {
        let spec = |t: &str| load(serde_json::json!({"model_type": t})).unwrap();
        let (glm, ds, qwen) = (spec("glm_moe_dsa"), spec("deepseek_v3"), spec("qwen3_moe"));
        let dims = |s: &ModelSpec| (s.vocab_size, s.hidden_size, s.layers.len(), s.rms_norm_eps);
        assert_eq!(dims(&glm), (154880, 6144, 78, 1e-5));
        assert_eq!(dims(&ds), (129280, 7168, 61, 1e-6));
        assert_eq!(dims(&qwen), (151936, 2048, 24, 1e-6));
        let q_lora = |s: &ModelSpec| match &s.attention {
            AttentionSpec::Mla(m) => m.q_lora_rank,
            AttentionSpec::Gqa(_) => None,
        };
        assert_eq!((q_lora(&glm), q_lora(&ds)), (Some(2048), Some(1536)));
        let router = |s: &ModelSpec| s.router.clone().unwrap();
        assert_eq!((router(&ds).n_group, router(&ds).topk_group), (8, 4));
        assert_eq!((router(&glm).n_group, router(&qwen).n_experts), (1, 128));
        assert!(!router(&qwen).norm_topk_prob && router(&glm).norm_topk_prob);
    }
}
