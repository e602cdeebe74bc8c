//! Model weights as the forward pass uses them, loaded from a [`Checkpoint`] through one table of
//! tensor names. Routed experts go to the expert executor (here: [`RamExperts`]); everything else
//! (the dense skeleton) stays with the coordinator.

mod attention;
pub mod cache;
pub mod engine;
pub mod forward;
pub mod gpu;
pub mod profile;
pub mod rope;
mod rows;
pub mod usage;

use std::path::Path;
use std::sync::Arc;

use charm_shared::arch::names::{self, ExpertLayout};
use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::{AttentionSpec, IndexerKind, MlpKind, ModelSpec};
use charm_shared::container::Container;
use charm_shared::expert::ExpertExecutor;
use charm_shared::kernels::Matrix;
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::Activations;
use charm_shared::LoadError;
use charm_worker::RamExperts;

/// MLA projections of one layer.
#[derive(Debug)]
pub struct MlaWeights {
    /// `[q_lora_rank, hidden]`, `None` when queries come from one projection.
    pub q_a: Option<Linear>,
    pub q_a_norm: Option<Vec<f32>>,
    /// `[heads * qk_head_dim, q_lora_rank or hidden]`
    pub q_b: Linear,
    /// `[kv_lora_rank + rope, hidden]`
    pub kv_a: Linear,
    pub kv_a_norm: Vec<f32>,
    /// `[heads * (nope + v), kv_lora_rank]`, as stored (absorbed attention reads it row by row
    /// through [`Linear::row_into`]).
    pub kv_b: Linear,
    /// `[hidden, heads * v]`
    pub o: Linear,
}

/// GQA projections of one layer.
#[derive(Debug)]
pub struct GqaWeights {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
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
    pub wq_b: Linear,
    /// `[head_dim, hidden]`
    pub wk: Linear,
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
    pub eh_proj: Linear,
    pub layer: LayerWeights,
    pub head_norm: Vec<f32>,
    /// `None`: the main `lm_head` is shared.
    pub head: Option<Linear>,
    /// `None`: the main embedding is shared.
    pub embed: Option<Linear>,
}

/// A loaded model: spec, dense skeleton and the routed-expert executor.
#[derive(Debug)]
pub struct Model {
    pub spec: ModelSpec,
    /// `[vocab, hidden]`
    pub embed: Linear,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    pub mtp: Option<MtpWeights>,
    /// Whoever holds the routed experts: RAM, a streaming store, remote workers.
    pub experts: Arc<dyn ExpertExecutor>,
    /// How activations meet quantized weights in this model (a load option).
    pub activations: Activations,
    /// Forward steps run so far: names each step's expert requests ([`charm_shared::expert::ExpertBatch::step`]).
    pub steps: std::sync::atomic::AtomicU64,
    /// Set when a DSA model was loaded without its indexer weights: attention is then dense,
    /// which is exact only up to this many tokens (`index_topk`); longer contexts are refused.
    pub dense_attention_limit: Option<usize>,
    /// The router's picks per `(layer, expert)` since the load.
    pub expert_use: std::sync::Arc<usage::ExpertUse>,
    /// The dense skeleton's copy on a GPU, when the forward runs there ([`Model::attach_dense_gpu`]).
    pub dense_gpu: Option<gpu::DenseGpu>,
    /// Bytes of routed experts the model holds in RAM itself (a checkpoint's; 0 when another
    /// executor holds them).
    pub ram_expert_bytes: u64,
    /// Set once the dense weights' CPU copies are freed ([`Model::release_cpu_dense`]): the
    /// dense forward then runs on the GPU only.
    pub cpu_dense_released: bool,
}

/// Frees a weight's memory, leaving an empty one in its place; returns the bytes it held.
fn release(w: &mut Linear) -> u64 {
    let empty = Linear::F32(Matrix::new(0, 0, Vec::new()));
    std::mem::replace(w, empty).bytes() as u64
}

fn release_matrix(m: &mut Matrix) -> u64 {
    4 * std::mem::replace(m, Matrix::new(0, 0, Vec::new()))
        .data
        .len() as u64
}

/// Frees one layer's dense weights but its norms, biases and router correction (small; the
/// router's choice is made on the CPU).
fn release_layer(l: &mut LayerWeights) -> u64 {
    let mut freed = 0;
    match &mut l.attn {
        AttnWeights::Mla(w) => {
            if let Some(q_a) = &mut w.q_a {
                freed += release(q_a);
            }
            for m in [&mut w.q_b, &mut w.kv_a, &mut w.kv_b, &mut w.o] {
                freed += release(m);
            }
        }
        AttnWeights::Gqa(w) => {
            for m in [&mut w.q, &mut w.k, &mut w.v, &mut w.o] {
                freed += release(m);
            }
        }
    }
    if let Some(ix) = &mut l.indexer {
        freed += release(&mut ix.wq_b) + release(&mut ix.wk) + release_matrix(&mut ix.weights_proj);
    }
    let swiglu = |s: &mut SwiGlu| release(&mut s.gate) + release(&mut s.up) + release(&mut s.down);
    match &mut l.ffn {
        FfnWeights::Dense(s) => freed += swiglu(s),
        FfnWeights::Moe { router, shared, .. } => {
            freed += release_matrix(router);
            if let Some(s) = shared {
                freed += swiglu(s);
            }
        }
    }
    freed
}

/// A directory made by colibrì's converter (see [`charm_shared::colibri`]).
#[derive(Debug)]
pub struct ColibriSource(pub Checkpoint);

impl WeightSource for ColibriSource {
    fn has(&self, name: &str) -> bool {
        self.0.has(name)
    }
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        self.0.f32(name, &[n])
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        Ok(self.linear(name, rows, cols)?.to_f32())
    }
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        charm_shared::colibri::linear(&self.0, name, rows, cols)
    }
    fn experts(&self, layer: usize, spec: &ModelSpec) -> Result<Vec<SwiGlu>, LoadError> {
        let r = spec.router.as_ref().expect("MoE layer has a router");
        let (h, i) = (spec.hidden_size, spec.moe_intermediate_size);
        let n = names::Layer::new(layer);
        (0..r.n_experts)
            .map(|e| {
                let m = n.expert(e);
                Ok(SwiGlu {
                    gate: self.linear(&m.gate(), i, h)?,
                    up: self.linear(&m.up(), i, h)?,
                    down: self.linear(&m.down(), h, i)?,
                })
            })
            .collect()
    }
}

/// Where weights come from: a Hugging Face checkpoint (f32 after dequantization) or a charm
/// container (weights in their quantized formats). The model builder only asks by tensor name.
pub trait WeightSource {
    /// Whether a tensor exists.
    fn has(&self, name: &str) -> bool;
    /// A 1-D f32 tensor of `n` values.
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError>;
    /// A 2-D tensor as f32.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError>;
    /// A 2-D tensor in its stored format.
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError>;
    /// [`Self::linear`] multiplied with activations `act`, in the layout its kernels run fastest
    /// on ([`Linear::prepared`]).
    fn linear_prepared(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        act: Activations,
    ) -> Result<Linear, LoadError> {
        Ok(self.linear(name, rows, cols)?.prepared(act))
    }
    /// The routed experts of decoder layer `layer`.
    fn experts(&self, layer: usize, spec: &ModelSpec) -> Result<Vec<SwiGlu>, LoadError>;
}

impl WeightSource for Checkpoint {
    fn has(&self, name: &str) -> bool {
        Checkpoint::has(self, name)
    }
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        self.f32(name, &[n])
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        Ok(Matrix::new(rows, cols, self.f32(name, &[rows, cols])?))
    }
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        self.matrix(name, rows, cols).map(Linear::F32)
    }
    /// Fused `experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I] (transformers >= 5),
    /// or per-expert `experts.{e}.{gate,up,down}_proj.weight`.
    fn experts(&self, layer: usize, spec: &ModelSpec) -> Result<Vec<SwiGlu>, LoadError> {
        let r = spec.router.as_ref().expect("MoE layer has a router");
        let (e, h, i) = (r.n_experts, spec.hidden_size, spec.moe_intermediate_size);
        let n = names::Layer::new(layer);
        (0..e)
            .map(|x| {
                let (g, u, d) = read_expert(self, &n, x, e, h, i)?;
                Ok(SwiGlu {
                    gate: Linear::F32(Matrix::new(i, h, g)),
                    up: Linear::F32(Matrix::new(i, h, u)),
                    down: Linear::F32(Matrix::new(h, i, d)),
                })
            })
            .collect()
    }
}

/// One expert's `(gate [I, H], up [I, H], down [H, I])` weights as f32.
pub type ExpertF32 = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Reads expert `x` of layer `n` as f32 `(gate [I, H], up [I, H], down [H, I])`, whichever
/// layout the checkpoint uses. Only this expert's bytes are decoded.
pub fn read_expert(
    ck: &Checkpoint,
    n: &names::Layer,
    x: usize,
    e: usize,
    h: usize,
    i: usize,
) -> Result<ExpertF32, LoadError> {
    if n.expert_layout(|t| ck.has(t)) == Some(ExpertLayout::Fused) {
        let gu = ck.f32_slice(&n.experts_gate_up(), &[e, 2 * i, h], x)?;
        let d = ck.f32_slice(&n.experts_down(), &[e, h, i], x)?;
        let u = gu[i * h..].to_vec();
        let mut g = gu;
        g.truncate(i * h);
        Ok((g, u, d))
    } else {
        let m = n.expert(x);
        Ok((
            ck.f32(&m.gate(), &[i, h])?,
            ck.f32(&m.up(), &[i, h])?,
            ck.f32(&m.down(), &[h, i])?,
        ))
    }
}

impl WeightSource for Container {
    fn has(&self, name: &str) -> bool {
        Container::has(self, name)
    }
    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        match self.linear(name, &[n])? {
            Linear::F32(m) => Ok(m.data),
            Linear::Quant(q) => Ok(q.dequantize().data),
        }
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        Ok(self.linear(name, &[rows, cols])?.to_f32())
    }
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        Container::linear(self, name, &[rows, cols])
    }
    /// Rearranged in place as it is read: the load holds each tensor once.
    fn linear_prepared(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        act: Activations,
    ) -> Result<Linear, LoadError> {
        let lanes = charm_shared::quant::lanes_wanted(act);
        Ok(Container::linear_as(self, name, &[rows, cols], lanes)?.with_activations(act))
    }
    fn experts(&self, layer: usize, spec: &ModelSpec) -> Result<Vec<SwiGlu>, LoadError> {
        let r = spec.router.as_ref().expect("MoE layer has a router");
        let (h, i) = (spec.hidden_size, spec.moe_intermediate_size);
        (0..r.n_experts)
            .map(|e| {
                let (gate, up, down) = self.expert(layer, e)?;
                for (w, rows, cols) in [(&gate, i, h), (&up, i, h), (&down, h, i)] {
                    if (w.rows(), w.cols()) != (rows, cols) {
                        return Err(LoadError::Shape {
                            path: self.dir.clone(),
                            tensor: format!("layer {layer} expert {e}"),
                            got: vec![w.rows(), w.cols()],
                            want: vec![rows, cols],
                        });
                    }
                }
                Ok(SwiGlu { gate, up, down })
            })
            .collect()
    }
}

struct Loader<'a> {
    src: &'a dyn WeightSource,
    spec: &'a ModelSpec,
    /// Load routed experts into RAM (false: another executor holds them).
    experts: bool,
    act: Activations,
}

impl Loader<'_> {
    fn vec(&self, name: &str, n: usize) -> Result<Vec<f32>, LoadError> {
        self.src.vector(name, n)
    }
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, LoadError> {
        self.src.matrix(name, rows, cols)
    }
    fn lin(&self, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        self.src.linear_prepared(name, rows, cols, self.act)
    }
    fn mlp(&self, m: names::Mlp, inter: usize) -> Result<SwiGlu, LoadError> {
        let h = self.spec.hidden_size;
        Ok(SwiGlu {
            gate: self.lin(&m.gate(), inter, h)?,
            up: self.lin(&m.up(), inter, h)?,
            down: self.lin(&m.down(), h, inter)?,
        })
    }

    fn attn(&self, n: &names::Layer) -> Result<AttnWeights, LoadError> {
        let h = self.spec.hidden_size;
        Ok(match &self.spec.attention {
            AttentionSpec::Mla(m) => {
                let qk = m.n_heads * m.qk_head_dim();
                let (q_a, q_a_norm, q_b) = match m.q_lora_rank {
                    Some(r) => (
                        Some(self.lin(&n.q_a(), r, h)?),
                        Some(self.vec(&n.q_a_norm(), r)?),
                        self.lin(&n.q_b(), qk, r)?,
                    ),
                    None => (None, None, self.lin(&n.q(), qk, h)?),
                };
                AttnWeights::Mla(MlaWeights {
                    q_a,
                    q_a_norm,
                    q_b,
                    kv_a: self.lin(&n.kv_a(), m.cache_width(), h)?,
                    kv_a_norm: self.vec(&n.kv_a_norm(), m.kv_lora_rank)?,
                    kv_b: self.src.linear(
                        &n.kv_b(),
                        m.n_heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank,
                    )?,
                    o: self.lin(&n.o(), h, m.n_heads * m.v_head_dim)?,
                })
            }
            AttentionSpec::Gqa(g) => {
                let (q, kv) = (g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim);
                let bias = |name: String, len| -> Result<Option<Vec<f32>>, LoadError> {
                    g.bias.then(|| self.vec(&name, len)).transpose()
                };
                let norm = |name: String| -> Result<Option<Vec<f32>>, LoadError> {
                    g.qk_norm.then(|| self.vec(&name, g.head_dim)).transpose()
                };
                AttnWeights::Gqa(GqaWeights {
                    q: self.lin(&n.q(), q, h)?,
                    k: self.lin(&n.k(), kv, h)?,
                    v: self.lin(&n.v(), kv, h)?,
                    o: self.lin(&n.o(), h, q)?,
                    q_bias: bias(n.q_bias(), q)?,
                    k_bias: bias(n.k_bias(), kv)?,
                    v_bias: bias(n.v_bias(), kv)?,
                    q_norm: norm(n.q_norm())?,
                    k_norm: norm(n.k_norm())?,
                })
            }
        })
    }

    fn indexer(&self, n: &names::Layer) -> Result<IndexerWeights, LoadError> {
        let d = self.spec.dsa.as_ref().expect("indexer only on DSA models");
        let h = self.spec.hidden_size;
        let q_rank = match &self.spec.attention {
            AttentionSpec::Mla(m) => m.q_lora_rank.unwrap_or(h),
            AttentionSpec::Gqa(_) => h,
        };
        Ok(IndexerWeights {
            wq_b: self.lin(&n.indexer_wq_b(), d.n_heads * d.head_dim, q_rank)?,
            wk: self.lin(&n.indexer_wk(), d.head_dim, h)?,
            k_norm_w: self.vec(&n.indexer_k_norm(), d.head_dim)?,
            k_norm_b: self.vec(&n.indexer_k_norm_bias(), d.head_dim)?,
            weights_proj: self.mat(&n.indexer_weights(), d.n_heads, h)?,
        })
    }

    fn layer(
        &self,
        index: usize,
        mlp: MlpKind,
        indexer_kind: Option<IndexerKind>,
        experts: &mut Vec<Option<Vec<SwiGlu>>>,
    ) -> Result<LayerWeights, LoadError> {
        let h = self.spec.hidden_size;
        let n = names::Layer::new(index);
        let ffn = match mlp {
            MlpKind::Dense => FfnWeights::Dense(self.mlp(n.mlp(), self.spec.intermediate_size)?),
            MlpKind::Moe => {
                let r = self.spec.router.as_ref().expect("validated");
                let shared = if self.spec.n_shared_experts > 0 {
                    Some(self.mlp(
                        n.shared_experts(),
                        self.spec.moe_intermediate_size * self.spec.n_shared_experts,
                    )?)
                } else {
                    None
                };
                experts.resize_with(experts.len().max(index + 1), || None);
                if self.experts {
                    let act = self.act;
                    experts[index] = Some(
                        self.src
                            .experts(index, self.spec)?
                            .into_iter()
                            .map(|e| SwiGlu {
                                gate: e.gate.with_activations(act),
                                up: e.up.with_activations(act),
                                down: e.down.with_activations(act),
                            })
                            .collect(),
                    );
                }
                FfnWeights::Moe {
                    router: self.mat(&n.router(), r.n_experts, h)?,
                    correction_bias: if r.correction_bias {
                        Some(self.vec(&n.router_bias(), r.n_experts)?)
                    } else {
                        None
                    },
                    shared,
                }
            }
        };
        Ok(LayerWeights {
            index,
            input_norm: self.vec(&n.input_norm(), h)?,
            post_norm: self.vec(&n.post_norm(), h)?,
            attn: self.attn(&n)?,
            // A checkpoint without indexer weights (colibrì's conversions drop them) runs dense
            // attention, which equals DSA while a query sees at most `index_topk` keys; the
            // forward pass refuses longer contexts (`Model::dense_attention_limit`).
            indexer: if indexer_kind == Some(IndexerKind::Full) && self.src.has(&n.indexer_wk()) {
                Some(self.indexer(&n)?)
            } else {
                None
            },
            indexer_kind,
            ffn,
        })
    }
}

/// `dir`'s config and container, refusing a directory that is not a container (streaming reads
/// expert records) or whose container was made from another architecture.
pub fn open_container(dir: &Path) -> Result<(ModelSpec, Container), LoadError> {
    let spec = ModelSpec::from_dir(dir)?;
    if !Container::is_container(dir) {
        return Err(LoadError::config(
            dir.join(charm_shared::container::MANIFEST),
            "streaming experts from disk needs a charm container: convert the model with `charm convert` first",
        ));
    }
    let c = Container::open(dir)?;
    if c.manifest.model_type != spec.arch.model_type() {
        return Err(LoadError::config(
            dir.join("config.json"),
            format!(
                "config.json says {} but the container was made from {}",
                spec.arch.model_type(),
                c.manifest.model_type
            ),
        ));
    }
    Ok((spec, c))
}

/// A model directory opened for loading: its spec and where its weights come from (a charm
/// container, a colibrì conversion or a Hugging Face checkpoint). The one place that tells them
/// apart.
pub fn open_source(dir: &Path) -> Result<(ModelSpec, Box<dyn WeightSource>), LoadError> {
    if Container::is_container(dir) {
        let (spec, c) = open_container(dir)?;
        return Ok((spec, Box::new(c)));
    }
    let spec = ModelSpec::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    if charm_shared::colibri::is_colibri(dir) {
        return Ok((spec, Box::new(ColibriSource(ck))));
    }
    Ok((spec, Box::new(ck)))
}

impl Model {
    /// Loads `dir` (config.json + safetensors shards, a colibrì conversion or a charm
    /// container) with every routed expert in RAM and f32 activations. [`crate::model::engine`] loads
    /// with a RAM budget (streaming a container's experts) and the other options.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let (spec, src) = open_source(dir)?;
        Self::build(spec, &*src, None, Activations::F32)
    }

    /// Builds the model from any weight source, every routed expert in RAM.
    pub fn from_source(
        spec: ModelSpec,
        src: &dyn WeightSource,
        act: Activations,
    ) -> Result<Self, LoadError> {
        Self::build(spec, src, None, act)
    }

    /// Builds the dense skeleton from `src`; routed experts run on `experts` (`None`: loaded
    /// from `src` into RAM).
    pub fn build(
        spec: ModelSpec,
        src: &dyn WeightSource,
        executor: Option<Arc<dyn ExpertExecutor>>,
        act: Activations,
    ) -> Result<Self, LoadError> {
        let ck = src;
        let l = Loader {
            src,
            spec: &spec,
            experts: executor.is_none(),
            act,
        };
        let (v, h) = (spec.vocab_size, spec.hidden_size);
        let mut ram_experts: Vec<Option<Vec<SwiGlu>>> = Vec::new();
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, ls) in spec.layers.iter().enumerate() {
            layers.push(l.layer(i, ls.mlp, ls.indexer, &mut ram_experts)?);
        }
        let embed = l.lin(names::EMBED, v, h)?;
        let lm_head = if spec.tie_word_embeddings && !ck.has(names::HEAD) {
            None
        } else {
            Some(l.lin(names::HEAD, v, h)?)
        };
        // The MTP layer is loaded when the config announces it and its tensors are present; it is
        // never run as part of the main model.
        let n = spec.layers.len();
        let m = names::Layer::new(n);
        let mtp = if names::has_mtp(&spec, |t| ck.has(t)) {
            let kind = spec.dsa.as_ref().map(|_| {
                if ck.has(&m.indexer_wk()) {
                    IndexerKind::Full
                } else {
                    IndexerKind::Shared
                }
            });
            let layer = l.layer(n, MlpKind::Moe, kind, &mut ram_experts)?;
            Some(MtpWeights {
                enorm: l.vec(&m.mtp_enorm(), h)?,
                hnorm: l.vec(&m.mtp_hnorm(), h)?,
                eh_proj: l.lin(&m.mtp_eh_proj(), h, 2 * h)?,
                layer,
                head_norm: l.vec(&m.mtp_head_norm(), h)?,
                head: ck
                    .has(&m.mtp_head())
                    .then(|| l.lin(&m.mtp_head(), v, h))
                    .transpose()?,
                embed: ck
                    .has(&m.mtp_embed())
                    .then(|| l.lin(&m.mtp_embed(), v, h))
                    .transpose()?,
            })
        } else {
            None
        };
        let norm = l.vec(names::FINAL_NORM, h)?;
        let dense_attention_limit = spec.dsa.as_ref().and_then(|d| {
            layers
                .iter()
                .any(|l| l.indexer_kind == Some(IndexerKind::Full) && l.indexer.is_none())
                .then_some(d.topk)
        });
        let (executor, ram_expert_bytes): (Arc<dyn ExpertExecutor>, u64) = match executor {
            Some(e) => (e, 0),
            None => {
                let r = RamExperts {
                    hidden: h,
                    layers: ram_experts,
                };
                let bytes = r.bytes() as u64;
                (Arc::new(r), bytes)
            }
        };
        let expert_use = std::sync::Arc::new(usage::ExpertUse::new(
            layers.len() + usize::from(mtp.is_some()),
            spec.router.as_ref().map_or(0, |r| r.n_experts),
        ));
        Ok(Self {
            dense_attention_limit,
            expert_use,
            experts: executor,
            activations: act,
            steps: Default::default(),
            spec,
            embed,
            layers,
            norm,
            lm_head,
            mtp,
            dense_gpu: None,
            ram_expert_bytes,
            cpu_dense_released: false,
        })
    }

    /// Where the dense skeleton runs, for status documents: `{"device": "cpu"}`, or `"gpu"` with
    /// the adapter's name and the bytes of weights it holds.
    pub fn dense_status(&self) -> serde_json::Value {
        match &self.dense_gpu {
            Some(d) => serde_json::json!({
                "device": "gpu",
                "gpu": d.device_name(),
                "vram_bytes": d.bytes(),
            }),
            None => serde_json::json!({ "device": "cpu" }),
        }
    }

    /// Frees the CPU copies of the dense weights the GPU holds (every layer's projections,
    /// shared experts and routers, the head, and the MTP layer's where the device runs it),
    /// once [`Model::attach_dense_gpu`] has checked the device: the dense forward then runs
    /// there only, and a CPU path that would need them answers an error. The embedding table,
    /// the norms and the biases stay (the token lookup and the routing run on the CPU). Returns
    /// the bytes freed (0 without a GPU).
    pub fn release_cpu_dense(&mut self) -> u64 {
        let Some(dg) = &self.dense_gpu else {
            return 0;
        };
        let with_mtp = dg.has_mtp();
        let mut freed: u64 = self.layers.iter_mut().map(release_layer).sum();
        // (an MTP layer left to the CPU may share the main head)
        let cpu_mtp = self.mtp.is_some() && !with_mtp;
        if let (Some(h), false) = (&mut self.lm_head, cpu_mtp) {
            freed += release(h);
        }
        if let (Some(m), true) = (&mut self.mtp, with_mtp) {
            freed += release(&mut m.eh_proj) + release_layer(&mut m.layer);
            if let Some(h) = &mut m.head {
                freed += release(h);
            }
        }
        self.cpu_dense_released = true;
        freed
    }

    /// Moves the dense forward to `gpu` (`--dense-device gpu`): the dense weights are copied to
    /// its memory, and every later step runs there with the same bits. Refused, with the reason,
    /// for models the GPU path does not take yet ([`gpu::unsupported`]).
    ///
    /// Before it is used, the device must reproduce the CPU: a short prompt (prefill, then a
    /// cached step) through the whole dense skeleton, with the routed experts left out, must
    /// give the CPU's logits bit for bit; a device that differs is refused, naming it and the
    /// first logit that differs.
    pub fn attach_dense_gpu(
        &mut self,
        gpu: Arc<charm_worker::gpu::Gpu>,
    ) -> Result<u64, charm_worker::gpu::GpuError> {
        let d = gpu::DenseGpu::new(self, gpu.clone())?;
        let bytes = d.bytes();
        // the check runs without the routed experts and leaves no trace in the counters
        let experts = std::mem::replace(
            &mut self.experts,
            Arc::new(gpu::NoExperts(self.spec.hidden_size)),
        );
        let usage = std::mem::replace(&mut self.expert_use, Arc::new(usage::ExpertUse::new(1, 0)));
        let steps = self.steps.load(std::sync::atomic::Ordering::Relaxed);
        let run = |m: &Self| -> Result<Vec<f32>, String> {
            let vocab = m.spec.vocab_size;
            let prompt: Vec<u32> = (0..5).map(|i| ((i * 7919 + 3) % vocab) as u32).collect();
            let mut cache = cache::KvCache::new(&m.spec);
            let mut out = Vec::new();
            for part in [&prompt[..4], &prompt[4..]] {
                let h = m
                    .forward(part, &mut cache, forward::ForwardOptions::default(), None)
                    .map_err(|e| e.to_string())?;
                out.extend(m.logits(&h, part.len()).map_err(|e| e.to_string())?);
            }
            Ok(out)
        };
        let cpu = run(self);
        self.dense_gpu = Some(d);
        let on_gpu = run(self);
        self.experts = experts;
        self.expert_use = usage;
        self.steps
            .store(steps, std::sync::atomic::Ordering::Relaxed);
        let mut refuse = |e: charm_worker::gpu::GpuError| {
            self.dense_gpu = None;
            Err(e)
        };
        let device = |e: String| charm_worker::gpu::GpuError::Device(e);
        let (cpu, on_gpu) = match (cpu, on_gpu) {
            (Ok(c), Ok(g)) => (c, g),
            (Err(e), _) => {
                return refuse(device(format!("the dense check failed on the CPU: {e}")))
            }
            (_, Err(e)) => return refuse(device(format!("the dense check failed: {e}"))),
        };
        if let Some(i) = (0..cpu.len()).find(|&i| !charm_worker::gpu::same_bits(on_gpu[i], cpu[i]))
        {
            return refuse(charm_worker::gpu::GpuError::DenseCheck {
                adapter: gpu.name.clone(),
                driver: gpu.driver.clone(),
                index: i,
                gpu: on_gpu[i],
                cpu: cpu[i],
            });
        }
        Ok(bytes)
    }
}
