//! Tensor names of the Hugging Face checkpoints charm reads (GLM-5.x, DeepSeek-V3/Kimi-K2 and
//! Qwen3-MoE share one naming scheme), and what each tensor is. Loading, conversion, `charm info`
//! and `charm synth` all name tensors through this table.
//!
//! Decoder layer `i` is `model.layers.{i}.`; multi-token-prediction layers follow the main layers
//! (`model.layers.{n_layers + j}.`) and hold a full decoder layer plus their own projection, norms
//! and optional head and embedding.

use crate::config::{AttentionSpec, MlpKind, ModelSpec};

/// Token embedding table `[vocab, hidden]`.
pub const EMBED: &str = "model.embed_tokens.weight";
/// Output head `[vocab, hidden]` (absent when tied to the embedding).
pub const HEAD: &str = "lm_head.weight";
/// Final norm `[hidden]`.
pub const FINAL_NORM: &str = "model.norm.weight";
/// Prefix of every decoder-layer tensor.
const LAYERS: &str = "model.layers.";

/// The names of decoder layer `i`'s tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer(String);

/// The three weights of a SwiGLU block (dense MLP, shared experts, one routed expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlp(String);

macro_rules! names {
    ($ty:ident { $($(#[$m:meta])* $f:ident => $s:literal,)* }) => {
        impl $ty {
            $($(#[$m])* pub fn $f(&self) -> String { format!(concat!("{}", $s), self.0) })*
        }
    };
}

names!(Layer {
    input_norm => "input_layernorm.weight",
    post_norm => "post_attention_layernorm.weight",
    /// MLA: low-rank query down-projection (`q_lora_rank` set).
    q_a => "self_attn.q_a_proj.weight",
    q_a_norm => "self_attn.q_a_layernorm.weight",
    q_b => "self_attn.q_b_proj.weight",
    /// The query projection of GQA, and of MLA without a query rank.
    q => "self_attn.q_proj.weight",
    kv_a => "self_attn.kv_a_proj_with_mqa.weight",
    kv_a_norm => "self_attn.kv_a_layernorm.weight",
    kv_b => "self_attn.kv_b_proj.weight",
    k => "self_attn.k_proj.weight",
    v => "self_attn.v_proj.weight",
    o => "self_attn.o_proj.weight",
    q_bias => "self_attn.q_proj.bias",
    k_bias => "self_attn.k_proj.bias",
    v_bias => "self_attn.v_proj.bias",
    q_norm => "self_attn.q_norm.weight",
    k_norm => "self_attn.k_norm.weight",
    /// DSA lightning indexer.
    indexer_wq_b => "self_attn.indexer.wq_b.weight",
    indexer_wk => "self_attn.indexer.wk.weight",
    indexer_k_norm => "self_attn.indexer.k_norm.weight",
    indexer_k_norm_bias => "self_attn.indexer.k_norm.bias",
    indexer_weights => "self_attn.indexer.weights_proj.weight",
    /// Router logits `[n_experts, hidden]`.
    router => "mlp.gate.weight",
    /// Sigmoid routers' selection bias `[n_experts]`.
    router_bias => "mlp.gate.e_score_correction_bias",
    /// Routed experts fused (transformers >= 5): `[E, 2I, H]`, gate rows then up rows.
    experts_gate_up => "mlp.experts.gate_up_proj",
    /// Routed experts fused: `[E, H, I]`.
    experts_down => "mlp.experts.down_proj",
    /// MTP: norm of the token embedding.
    mtp_enorm => "enorm.weight",
    /// MTP: norm of the previous hidden state.
    mtp_hnorm => "hnorm.weight",
    /// MTP: `[hidden, 2 hidden]` projection of the two concatenated.
    mtp_eh_proj => "eh_proj.weight",
    mtp_head_norm => "shared_head.norm.weight",
    /// MTP: its own output head (else the model's).
    mtp_head => "shared_head.head.weight",
    /// MTP: its own embedding table (else the model's).
    mtp_embed => "embed_tokens.weight",
});

names!(Mlp {
    gate => "gate_proj.weight",
    up => "up_proj.weight",
    down => "down_proj.weight",
});

impl Layer {
    /// Decoder layer `i` (an MTP layer when `i >= n_layers`).
    pub fn new(i: usize) -> Self {
        Self(format!("{LAYERS}{i}."))
    }

    /// The dense MLP of a dense layer.
    pub fn mlp(&self) -> Mlp {
        Mlp(format!("{}mlp.", self.0))
    }

    /// The shared experts of a MoE layer (one SwiGLU `n_shared` experts wide).
    pub fn shared_experts(&self) -> Mlp {
        Mlp(format!("{}mlp.shared_experts.", self.0))
    }

    /// Routed expert `e`, stored per expert.
    pub fn expert(&self, e: usize) -> Mlp {
        Mlp(format!("{}mlp.experts.{e}.", self.0))
    }

    /// How this layer's routed experts are stored in a checkpoint that `has` the given tensors;
    /// `None` when it has none.
    pub fn expert_layout(&self, has: impl Fn(&str) -> bool) -> Option<ExpertLayout> {
        if has(&self.experts_gate_up()) {
            Some(ExpertLayout::Fused)
        } else if has(&self.expert(0).gate()) {
            Some(ExpertLayout::PerExpert)
        } else {
            None
        }
    }
}

/// How a checkpoint stores a layer's routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// [`Layer::experts_gate_up`] and [`Layer::experts_down`], all experts in one tensor each.
    Fused,
    /// [`Layer::expert`]`(e)`'s three weights.
    PerExpert,
}

/// Whether the checkpoint that `has` the given tensors carries the MTP layer `spec` announces.
pub fn has_mtp(spec: &ModelSpec, has: impl Fn(&str) -> bool) -> bool {
    spec.mtp_layers > 0 && has(&Layer::new(spec.layers.len()).mtp_eh_proj())
}

/// What a tensor is, from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Class {
    /// The decoder layer it belongs to.
    pub layer: Option<usize>,
    /// Part of a multi-token-prediction layer.
    pub mtp: bool,
    pub kind: Kind,
}

/// The kinds of tensor that are stored or accounted differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An embedding table (the model's or an MTP layer's).
    Embedding,
    /// An output head (the model's or an MTP layer's).
    Head,
    /// Kept exact whatever the storage format: norms, biases, router weights and selection bias,
    /// the indexer's head weights.
    Exact,
    /// A routed expert's weight.
    Routed,
    /// Any other weight: attention, dense MLP, shared experts, MTP projection.
    Weight,
}

/// Classifies tensor `name` of a model with `n_layers` main decoder layers.
pub fn classify(name: &str, n_layers: usize) -> Class {
    let layer = name
        .strip_prefix(LAYERS)
        .and_then(|rest| rest.split('.').next())
        .and_then(|s| s.parse::<usize>().ok());
    let exact = name.ends_with("norm.weight")
        || name.ends_with(".bias")
        || name.ends_with("mlp.gate.weight")
        || name.ends_with("e_score_correction_bias")
        || name.ends_with("weights_proj.weight");
    let kind = if exact {
        Kind::Exact
    } else if name == EMBED || name.ends_with(".embed_tokens.weight") {
        Kind::Embedding
    } else if name == HEAD || name.ends_with(".shared_head.head.weight") {
        Kind::Head
    } else if name.contains(".mlp.experts.") {
        Kind::Routed
    } else {
        Kind::Weight
    };
    Class {
        layer,
        mtp: layer.is_some_and(|l| l >= n_layers),
        kind,
    }
}

/// Every non-routed tensor a checkpoint of `spec` holds for main layer `i` (an MTP layer's
/// decoder part too), with its shape.
pub fn layer_tensors(
    spec: &ModelSpec,
    i: usize,
    mlp: MlpKind,
    indexer: bool,
) -> Vec<(String, Vec<usize>)> {
    let h = spec.hidden_size;
    let n = Layer::new(i);
    let mut t = vec![(n.input_norm(), vec![h]), (n.post_norm(), vec![h])];
    match &spec.attention {
        AttentionSpec::Mla(m) => {
            let qk = m.n_heads * m.qk_head_dim();
            match m.q_lora_rank {
                Some(r) => t.extend([
                    (n.q_a(), vec![r, h]),
                    (n.q_a_norm(), vec![r]),
                    (n.q_b(), vec![qk, r]),
                ]),
                None => t.push((n.q(), vec![qk, h])),
            }
            t.extend([
                (n.kv_a(), vec![m.cache_width(), h]),
                (n.kv_a_norm(), vec![m.kv_lora_rank]),
                (
                    n.kv_b(),
                    vec![
                        m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank,
                    ],
                ),
                (n.o(), vec![h, m.n_heads * m.v_head_dim]),
            ]);
        }
        AttentionSpec::Gqa(g) => {
            let (q, kv) = (g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim);
            t.extend([
                (n.q(), vec![q, h]),
                (n.k(), vec![kv, h]),
                (n.v(), vec![kv, h]),
                (n.o(), vec![h, q]),
            ]);
            if g.bias {
                t.extend([
                    (n.q_bias(), vec![q]),
                    (n.k_bias(), vec![kv]),
                    (n.v_bias(), vec![kv]),
                ]);
            }
            if g.qk_norm {
                t.extend([
                    (n.q_norm(), vec![g.head_dim]),
                    (n.k_norm(), vec![g.head_dim]),
                ]);
            }
        }
    }
    if let (true, Some(d)) = (indexer, &spec.dsa) {
        let q_rank = match &spec.attention {
            AttentionSpec::Mla(m) => m.q_lora_rank.unwrap_or(h),
            AttentionSpec::Gqa(_) => h,
        };
        t.extend([
            (n.indexer_wq_b(), vec![d.n_heads * d.head_dim, q_rank]),
            (n.indexer_wk(), vec![d.head_dim, h]),
            (n.indexer_k_norm(), vec![d.head_dim]),
            (n.indexer_k_norm_bias(), vec![d.head_dim]),
            (n.indexer_weights(), vec![d.n_heads, h]),
        ]);
    }
    let swiglu = |t: &mut Vec<_>, m: Mlp, inter: usize| {
        t.extend([
            (m.gate(), vec![inter, h]),
            (m.up(), vec![inter, h]),
            (m.down(), vec![h, inter]),
        ])
    };
    match mlp {
        MlpKind::Dense => swiglu(&mut t, n.mlp(), spec.intermediate_size),
        MlpKind::Moe => {
            let r = spec.router.as_ref().expect("a MoE layer has a router");
            t.push((n.router(), vec![r.n_experts, h]));
            if r.correction_bias {
                t.push((n.router_bias(), vec![r.n_experts]));
            }
            if spec.n_shared_experts > 0 {
                let width = spec.moe_intermediate_size * spec.n_shared_experts;
                swiglu(&mut t, n.shared_experts(), width);
            }
        }
    }
    t
}

/// Every non-routed tensor of the main model (no MTP layers), with its shape: embedding, layers,
/// final norm, and the head unless tied.
pub fn dense_tensors(spec: &ModelSpec) -> Vec<(String, Vec<usize>)> {
    let (v, h) = (spec.vocab_size, spec.hidden_size);
    let mut t = vec![(EMBED.to_string(), vec![v, h])];
    for (i, l) in spec.layers.iter().enumerate() {
        let indexer = l.indexer == Some(crate::config::IndexerKind::Full);
        t.extend(layer_tensors(spec, i, l.mlp, indexer));
    }
    t.push((FINAL_NORM.to_string(), vec![h]));
    if !spec.tie_word_embeddings {
        t.push((HEAD.to_string(), vec![v, h]));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_classify_back_to_their_kind() {
        let l = Layer::new(3);
        assert_eq!(l.q_a(), "model.layers.3.self_attn.q_a_proj.weight");
        assert_eq!(
            l.expert(7).down(),
            "model.layers.3.mlp.experts.7.down_proj.weight"
        );
        let kind = |n: &str| classify(n, 4).kind;
        for n in [
            l.input_norm(),
            l.router(),
            l.router_bias(),
            l.indexer_weights(),
            l.q_bias(),
        ] {
            assert_eq!(kind(&n), Kind::Exact, "{n}");
        }
        for n in [l.q_a(), l.o(), l.shared_experts().gate(), l.mlp().down()] {
            assert_eq!(kind(&n), Kind::Weight, "{n}");
        }
        assert_eq!(kind(&l.expert(0).gate()), Kind::Routed);
        assert_eq!(kind(&l.experts_gate_up()), Kind::Routed);
        assert_eq!(kind(EMBED), Kind::Embedding);
        assert_eq!(kind(HEAD), Kind::Head);
        assert_eq!(kind(FINAL_NORM), Kind::Exact);
        let m = Layer::new(4);
        let c = classify(&m.mtp_head(), 4);
        assert_eq!((c.layer, c.mtp, c.kind), (Some(4), true, Kind::Head));
        assert_eq!(classify(&m.mtp_embed(), 4).kind, Kind::Embedding);
        assert_eq!(classify(&m.mtp_eh_proj(), 4).kind, Kind::Weight);
        assert!(!classify(&l.q_a(), 4).mtp);
    }

    #[test]
    fn expert_layout_and_mtp_are_read_from_the_names_present() {
        let l = Layer::new(1);
        let fused = [l.experts_gate_up(), l.experts_down()];
        assert_eq!(
            l.expert_layout(|n| fused.iter().any(|f| f == n)),
            Some(ExpertLayout::Fused)
        );
        let per = [l.expert(0).gate()];
        assert_eq!(
            l.expert_layout(|n| per.iter().any(|f| f == n)),
            Some(ExpertLayout::PerExpert)
        );
        assert_eq!(l.expert_layout(|_| false), None);
    }
}
