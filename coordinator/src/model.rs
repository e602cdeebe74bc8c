//! Model weights as the forward pass uses them, loaded from a [`Checkpoint`] through one table of
//! tensor names. Routed experts go to the expert executor (here: [`RamExperts`]); everything else
//! (the dense skeleton) stays with the coordinator.

use std::path::Path;
use std::sync::Arc;

use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::{AttentionSpec, IndexerKind, MlpKind, ModelSpec};
use charm_shared::kernels::{Matrix, SwiGlu};
use charm_shared::LoadError;
use charm_worker::{ExpertExecutor, RamExperts};

/// MLA projections of one layer.
#[derive(Debug)]
pub struct MlaWeights {
    /// `[q_lora_rank, hidden]`, `None` when queries come from one projection.
    pub q_a: Option<Matrix>,
    pub q_a_norm: Option<Vec<f32>>,
    /// `[heads * qk_head_dim, q_lora_rank or hidden]`
    pub q_b: Matrix,
    /// `[kv_lora_rank + rope, hidden]`
    pub kv_a: Matrix,
    pub kv_a_norm: Vec<f32>,
    /// `[heads * (nope + v), kv_lora_rank]`
    pub kv_b: Matrix,
    /// `[hidden, heads * v]`
    pub o: Matrix,
}

/// GQA projections of one layer.
#[derive(Debug)]
pub struct GqaWeights {
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// Attention weights of one layer.
#[derive(Debug)]
pub enum AttnWeights {
    Mla(MlaWeights),
    Gqa(GqaWeights),
}

/// The DSA lightning indexer of a `full` layer.
#[derive(Debug)]
pub struct IndexerWeights {
    /// `[n_heads * head_dim, q_lora_rank]`
    pub wq_b: Matrix,
    /// `[head_dim, hidden]`
    pub wk: Matrix,
    pub k_norm_w: Vec<f32>,
    pub k_norm_b: Vec<f32>,
    /// `[n_heads, hidden]`
    pub weights_proj: Matrix,
}

/// Feed-forward of one layer. Routed experts are not here: they live behind the executor.
#[derive(Debug)]
pub enum FfnWeights {
    Dense(SwiGlu),
    Moe {
        /// `[n_experts, hidden]`, f32.
        router: Matrix,
        correction_bias: Option<Vec<f32>>,
        shared: Option<SwiGlu>,
    },
}

/// One decoder layer (dense skeleton part).
#[derive(Debug)]
pub struct LayerWeights {
    /// Index of this layer in the checkpoint (`model.layers.{index}`); also the expert layer id.
    pub index: usize,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub attn: AttnWeights,
    /// `Some` on layers that run their own DSA indexer.
    pub indexer: Option<IndexerWeights>,
    /// DSA role, `None` for models without DSA.
    pub indexer_kind: Option<IndexerKind>,
    pub ffn: FfnWeights,
}

/// The multi-token-prediction head (DeepSeek-V3 / GLM-5 layout, `model.layers.{L}.*`).
#[derive(Debug)]
pub struct MtpWeights {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[hidden, 2 * hidden]`
    pub eh_proj: Matrix,
    pub layer: LayerWeights,
    pub head_norm: Vec<f32>,
    /// `None`: the main `lm_head` is shared.
    pub head: Option<Matrix>,
    /// `None`: the main embedding is shared.
    pub embed: Option<Matrix>,
}

/// A loaded model: spec, dense skeleton and the routed-expert executor.
#[derive(Debug)]
pub struct Model {
    pub spec: ModelSpec,
    /// `[vocab, hidden]`
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
    pub mtp: Option<MtpWeights>,
    pub experts: Arc<dyn ExpertExecutor>,
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    spec: &'a ModelSpec,
}

impl Loader<'_> {
    fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        self.ck.f32(name, &[n])
    }
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        Ok(Matrix::new(rows, cols, self.ck.f32(name, &[rows, cols])?))
    }
    fn mlp(&self, p: &str, inter: usize) -> Result<SwiGlu, LoadError> {
        let h = self.spec.hidden_size;
        Ok(SwiGlu {
            gate: self.mat(&format!("{p}gate_proj.weight"), inter, h)?,
            up: self.mat(&format!("{p}up_proj.weight"), inter, h)?,
            down: self.mat(&format!("{p}down_proj.weight"), h, inter)?,
        })
    }

    fn attn(&self, p: &str) -> Result<AttnWeights, LoadError> {
        let h = self.spec.hidden_size;
        Ok(match &self.spec.attention {
            AttentionSpec::Mla(m) => {
                let qk = m.n_heads * m.qk_head_dim();
                let (q_a, q_a_norm, q_b) = match m.q_lora_rank {
                    Some(r) => (
                        Some(self.mat(&format!("{p}self_attn.q_a_proj.weight"), r, h)?),
                        Some(self.vec(&format!("{p}self_attn.q_a_layernorm.weight"), r)?),
                        self.mat(&format!("{p}self_attn.q_b_proj.weight"), qk, r)?,
                    ),
                    None => (
                        None,
                        None,
                        self.mat(&format!("{p}self_attn.q_proj.weight"), qk, h)?,
                    ),
                };
                AttnWeights::Mla(MlaWeights {
                    q_a,
                    q_a_norm,
                    q_b,
                    kv_a: self.mat(
                        &format!("{p}self_attn.kv_a_proj_with_mqa.weight"),
                        m.cache_width(),
                        h,
                    )?,
                    kv_a_norm: self.vec(
                        &format!("{p}self_attn.kv_a_layernorm.weight"),
                        m.kv_lora_rank,
                    )?,
                    kv_b: self.mat(
                        &format!("{p}self_attn.kv_b_proj.weight"),
                        m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank,
                    )?,
                    o: self.mat(
                        &format!("{p}self_attn.o_proj.weight"),
                        h,
                        m.n_heads * m.v_head_dim,
                    )?,
                })
            }
            AttentionSpec::Gqa(g) => {
                let (q, kv) = (g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim);
                let bias = |n: &str, len| -> Result<Option<Vec<f32>>, LoadError> {
                    if g.bias {
                        Ok(Some(self.vec(&format!("{p}self_attn.{n}.bias"), len)?))
                    } else {
                        Ok(None)
                    }
                };
                let norm = |n: &str| -> Result<Option<Vec<f32>>, LoadError> {
                    if g.qk_norm {
                        Ok(Some(
                            self.vec(&format!("{p}self_attn.{n}.weight"), g.head_dim)?,
                        ))
                    } else {
                        Ok(None)
                    }
                };
                AttnWeights::Gqa(GqaWeights {
                    q: self.mat(&format!("{p}self_attn.q_proj.weight"), q, h)?,
                    k: self.mat(&format!("{p}self_attn.k_proj.weight"), kv, h)?,
                    v: self.mat(&format!("{p}self_attn.v_proj.weight"), kv, h)?,
                    o: self.mat(&format!("{p}self_attn.o_proj.weight"), h, q)?,
                    q_bias: bias("q_proj", q)?,
                    k_bias: bias("k_proj", kv)?,
                    v_bias: bias("v_proj", kv)?,
                    q_norm: norm("q_norm")?,
                    k_norm: norm("k_norm")?,
                })
            }
        })
    }

    fn indexer(&self, p: &str) -> Result<IndexerWeights, LoadError> {
        let d = self.spec.dsa.as_ref().expect("indexer only on DSA models");
        let h = self.spec.hidden_size;
        let q_rank = match &self.spec.attention {
            AttentionSpec::Mla(m) => m.q_lora_rank.unwrap_or(h),
            AttentionSpec::Gqa(_) => h,
        };
        let p = format!("{p}self_attn.indexer.");
        Ok(IndexerWeights {
            wq_b: self.mat(&format!("{p}wq_b.weight"), d.n_heads * d.head_dim, q_rank)?,
            wk: self.mat(&format!("{p}wk.weight"), d.head_dim, h)?,
            k_norm_w: self.vec(&format!("{p}k_norm.weight"), d.head_dim)?,
            k_norm_b: self.vec(&format!("{p}k_norm.bias"), d.head_dim)?,
            weights_proj: self.mat(&format!("{p}weights_proj.weight"), d.n_heads, h)?,
        })
    }

    /// Routed experts of layer prefix `p`: fused `experts.gate_up_proj` [E, 2I, H] +
    /// `experts.down_proj` [E, H, I] (transformers >= 5), or per-expert `experts.{e}.*_proj.weight`.
    fn experts(&self, p: &str) -> Result<Vec<SwiGlu>, LoadError> {
        let r = self.spec.router.as_ref().expect("MoE layer has a router");
        let (e, h, i) = (
            r.n_experts,
            self.spec.hidden_size,
            self.spec.moe_intermediate_size,
        );
        let fused = format!("{p}mlp.experts.gate_up_proj");
        if self.ck.has(&fused) {
            let gu = self.ck.f32(&fused, &[e, 2 * i, h])?;
            let dn = self
                .ck
                .f32(&format!("{p}mlp.experts.down_proj"), &[e, h, i])?;
            Ok((0..e)
                .map(|x| {
                    let g = &gu[x * 2 * i * h..(x * 2 + 1) * i * h];
                    let u = &gu[(x * 2 + 1) * i * h..(x * 2 + 2) * i * h];
                    SwiGlu {
                        gate: Matrix::new(i, h, g.to_vec()),
                        up: Matrix::new(i, h, u.to_vec()),
                        down: Matrix::new(h, i, dn[x * h * i..(x + 1) * h * i].to_vec()),
                    }
                })
                .collect())
        } else {
            (0..e)
                .map(|x| self.mlp(&format!("{p}mlp.experts.{x}."), i))
                .collect()
        }
    }

    fn layer(
        &self,
        index: usize,
        mlp: MlpKind,
        indexer_kind: Option<IndexerKind>,
        experts: &mut Vec<Option<Vec<SwiGlu>>>,
    ) -> Result<LayerWeights, LoadError> {
        let h = self.spec.hidden_size;
        let p = format!("model.layers.{index}.");
        let ffn = match mlp {
            MlpKind::Dense => {
                FfnWeights::Dense(self.mlp(&format!("{p}mlp."), self.spec.intermediate_size)?)
            }
            MlpKind::Moe => {
                let r = self.spec.router.as_ref().expect("validated");
                let shared = if self.spec.n_shared_experts > 0 {
                    Some(self.mlp(
                        &format!("{p}mlp.shared_experts."),
                        self.spec.moe_intermediate_size * self.spec.n_shared_experts,
                    )?)
                } else {
                    None
                };
                experts.resize_with(experts.len().max(index + 1), || None);
                experts[index] = Some(self.experts(&p)?);
                FfnWeights::Moe {
                    router: self.mat(&format!("{p}mlp.gate.weight"), r.n_experts, h)?,
                    correction_bias: if r.correction_bias {
                        Some(
                            self.vec(&format!("{p}mlp.gate.e_score_correction_bias"), r.n_experts)?,
                        )
                    } else {
                        None
                    },
                    shared,
                }
            }
        };
        Ok(LayerWeights {
            index,
            input_norm: self.vec(&format!("{p}input_layernorm.weight"), h)?,
            post_norm: self.vec(&format!("{p}post_attention_layernorm.weight"), h)?,
            attn: self.attn(&p)?,
            indexer: if indexer_kind == Some(IndexerKind::Full) {
                Some(self.indexer(&p)?)
            } else {
                None
            },
            indexer_kind,
            ffn,
        })
    }
}

impl Model {
    /// Loads `dir` (config.json + safetensors shards) with every routed expert in RAM.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let spec = ModelSpec::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(spec, &ck)
    }

    /// Builds the model from an opened checkpoint.
    pub fn from_checkpoint(spec: ModelSpec, ck: &Checkpoint) -> Result<Self, LoadError> {
        let l = Loader { ck, spec: &spec };
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let mut experts: Vec<Option<Vec<SwiGlu>>> = Vec::new();
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, ls) in spec.layers.iter().enumerate() {
            layers.push(l.layer(i, ls.mlp, ls.indexer, &mut experts)?);
        }
        let embed = l.mat("model.embed_tokens.weight", v, h)?;
        let lm_head = if spec.tie_word_embeddings && !ck.has("lm_head.weight") {
            None
        } else {
            Some(l.mat("lm_head.weight", v, h)?)
        };
        // The MTP layer is loaded when the config announces it and its tensors are present; it is
        // never run as part of the main model.
        let n = spec.layers.len();
        let mtp_prefix = format!("model.layers.{n}.");
        let mtp = if spec.mtp_layers > 0 && ck.has(&format!("{mtp_prefix}eh_proj.weight")) {
            let kind = spec.dsa.as_ref().map(|_| {
                if ck.has(&format!("{mtp_prefix}self_attn.indexer.wk.weight")) {
                    IndexerKind::Full
                } else {
                    IndexerKind::Shared
                }
            });
            let layer = l.layer(n, MlpKind::Moe, kind, &mut experts)?;
            Some(MtpWeights {
                enorm: l.vec(&format!("{mtp_prefix}enorm.weight"), h)?,
                hnorm: l.vec(&format!("{mtp_prefix}hnorm.weight"), h)?,
                eh_proj: l.mat(&format!("{mtp_prefix}eh_proj.weight"), h, 2 * h)?,
                layer,
                head_norm: l.vec(&format!("{mtp_prefix}shared_head.norm.weight"), h)?,
                head: ck
                    .has(&format!("{mtp_prefix}shared_head.head.weight"))
                    .then(|| l.mat(&format!("{mtp_prefix}shared_head.head.weight"), v, h))
                    .transpose()?,
                embed: ck
                    .has(&format!("{mtp_prefix}embed_tokens.weight"))
                    .then(|| l.mat(&format!("{mtp_prefix}embed_tokens.weight"), v, h))
                    .transpose()?,
            })
        } else {
            None
        };
        let norm = l.vec("model.norm.weight", h)?;
        Ok(Self {
            experts: Arc::new(RamExperts {
                hidden: h,
                layers: experts,
            }),
            spec,
            embed,
            layers,
            norm,
            lm_head,
            mtp,
        })
    }
}
