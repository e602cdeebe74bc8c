//! The dense skeleton on a GPU (`--dense-device gpu`): the model's dense weights copied to VRAM
//! once, each sequence's KV cache mirrored there, and a forward step that runs every dense kernel
//! on the device ([`forward`]) with the CPU's bits (the kernels of
//! [`charm_shared::quant::gpu::DENSE_SHADER`] do every float step in integer arithmetic). Routed
//! experts stay with the model's executor: at each MoE layer the normed rows and the router's
//! logits come back, the CPU routes and runs (or sends) the experts, and their sum goes back down.
//!
//! The rooms: this file holds the weights in VRAM, what a model must be to run here, and the KV
//! mirror; `forward` records and runs a step.

mod forward;

use std::sync::{Arc, Mutex};

use charm_shared::config::AttentionSpec;
use charm_shared::kernels::Matrix;
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::{Activations, QuantKind};
use charm_worker::gpu::program::Kernels;
use charm_worker::gpu::{Gpu, GpuError};

use crate::model::{AttnWeights, FfnWeights, GqaWeights, LayerWeights, Model};

/// A weight matrix in VRAM: an f32 matrix, or a quantized one row-major as the container lays it
/// out (codes, then scales, then int2's minimums).
#[derive(Debug)]
pub(crate) struct GLinear {
    buf: wgpu::Buffer,
    rows: usize,
    cols: usize,
    /// The dense shader's `kind`: 0 f32, 1 bf16, 2 int8, 3 int4, 4 int2.
    kind: u32,
    group: usize,
    scales: u32,
    mins: u32,
    /// `Some(int4)` where the CPU multiplies it on the integer path (int8 activations).
    int_path: Option<bool>,
}

/// A SwiGLU block in VRAM.
#[derive(Debug)]
struct GSwiGlu {
    gate: GLinear,
    up: GLinear,
    down: GLinear,
}

#[derive(Debug)]
struct GGqa {
    q: GLinear,
    k: GLinear,
    v: GLinear,
    o: GLinear,
    q_bias: Option<wgpu::Buffer>,
    k_bias: Option<wgpu::Buffer>,
    v_bias: Option<wgpu::Buffer>,
    q_norm: Option<wgpu::Buffer>,
    k_norm: Option<wgpu::Buffer>,
}

/// The DSA indexer of a `full` layer in VRAM.
#[derive(Debug)]
struct GIndexer {
    wq_b: GLinear,
    wk: GLinear,
    /// The key norm's weight, then its bias.
    k_norm: wgpu::Buffer,
    weights_proj: GLinear,
}

#[derive(Debug)]
struct GMla {
    q_a: Option<GLinear>,
    q_a_norm: Option<wgpu::Buffer>,
    q_b: GLinear,
    kv_a: GLinear,
    kv_a_norm: wgpu::Buffer,
    kv_b: GLinear,
    o: GLinear,
    indexer: Option<GIndexer>,
}

#[derive(Debug)]
enum GAttn {
    Gqa(Box<GGqa>),
    Mla(Box<GMla>),
}

#[derive(Debug)]
enum GFfn {
    Dense(GSwiGlu),
    Moe {
        router: GLinear,
        shared: Option<GSwiGlu>,
    },
}

#[derive(Debug)]
struct GLayer {
    input_norm: wgpu::Buffer,
    post_norm: wgpu::Buffer,
    attn: GAttn,
    ffn: GFfn,
}

/// The MTP head in VRAM (its embedding stays on the CPU, where the lookup runs).
#[derive(Debug)]
struct GMtp {
    layer: GLayer,
    enorm: wgpu::Buffer,
    hnorm: wgpu::Buffer,
    eh_proj: GLinear,
    head_norm: wgpu::Buffer,
    /// `None`: the main head.
    head: Option<GLinear>,
}

/// The dense skeleton of a model in VRAM, with the kernels that run it.
pub struct DenseGpu {
    gpu: Arc<Gpu>,
    kernels: Kernels,
    layers: Vec<GLayer>,
    norm: wgpu::Buffer,
    head: GLinear,
    /// The multi-token-prediction head, when the model has one.
    mtp: Option<GMtp>,
    /// The most columns of any matrix (the widest input a step quantizes).
    widest: usize,
    /// Bytes of VRAM the weights hold.
    bytes: u64,
    /// The step's working memory, grown as steps need.
    arena: Mutex<Option<wgpu::Buffer>>,
    /// Most words the arena may hold: one binding of the device (tests may ask for less with
    /// `CHARM_GPU_TEST_ARENA_WORDS`, so that short prompts take several passes).
    arena_words: usize,
}

impl std::fmt::Debug for DenseGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DenseGpu({:?}, {} bytes)", self.gpu, self.bytes)
    }
}

/// Why a model's dense skeleton does not run on the GPU, or `None` when it does.
pub fn unsupported(m: &Model) -> Option<String> {
    if let AttentionSpec::Gqa(g) = &m.spec.attention {
        if m.spec.rope.dim != g.head_dim {
            return Some(format!(
                "partial rotary GQA (rotary dimension {} of heads of {}) does not run on the GPU",
                m.spec.rope.dim, g.head_dim
            ));
        }
    }
    None
}

/// Bytes the dense skeleton [`DenseGpu::new`] copies takes in VRAM (before the KV cache).
pub fn skeleton_bytes(m: &Model) -> u64 {
    let vec = |v: &[f32]| 4 * v.len() as u64;
    let lin = |l: &Linear| l.bytes() as u64;
    let swiglu = |s: &SwiGlu| s.bytes() as u64;
    let opt = |v: &Option<Vec<f32>>| v.as_deref().map_or(0, vec);
    let layers: u64 = m
        .layers
        .iter()
        .chain(m.mtp.as_ref().map(|t| &t.layer))
        .map(|l| {
            let attn = match &l.attn {
                AttnWeights::Gqa(g) => {
                    lin(&g.q)
                        + lin(&g.k)
                        + lin(&g.v)
                        + lin(&g.o)
                        + opt(&g.q_bias)
                        + opt(&g.k_bias)
                        + opt(&g.v_bias)
                        + opt(&g.q_norm)
                        + opt(&g.k_norm)
                }
                AttnWeights::Mla(w) => {
                    w.q_a.as_ref().map_or(0, lin)
                        + lin(&w.q_b)
                        + lin(&w.kv_a)
                        + lin(&w.kv_b)
                        + lin(&w.o)
                }
            };
            let ffn = match &l.ffn {
                FfnWeights::Dense(s) => swiglu(s),
                FfnWeights::Moe { router, shared, .. } => {
                    vec(&router.data) + shared.as_ref().map_or(0, swiglu)
                }
            };
            vec(&l.input_norm) + vec(&l.post_norm) + attn + ffn
        })
        .sum();
    let mtp = m.mtp.as_ref().map_or(0, |t| {
        lin(&t.eh_proj) + t.head.as_ref().map_or(0, lin) + vec(&t.enorm) + vec(&t.hnorm)
    });
    layers + mtp + vec(&m.norm) + lin(m.lm_head.as_ref().unwrap_or(&m.embed))
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl DenseGpu {
    /// Copies `m`'s dense skeleton to `gpu`'s memory.
    pub fn new(m: &Model, gpu: Arc<Gpu>) -> Result<Self, GpuError> {
        if let Some(why) = unsupported(m) {
            return Err(GpuError::Format(why));
        }
        let kernels = gpu.dense_kernels()?;
        let mut bytes = 0u64;
        let mut vector = |v: &[f32], what: &str| -> Result<wgpu::Buffer, GpuError> {
            bytes += 4 * v.len() as u64;
            gpu.constant(f32_bytes(v), what)
        };
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in &m.layers {
            layers.push(Self::layer(&gpu, l, &mut vector)?);
        }
        let mtp = match &m.mtp {
            Some(t) => Some(GMtp {
                layer: Self::layer(&gpu, &t.layer, &mut vector)?,
                enorm: vector(&t.enorm, "MTP embedding norm")?,
                hnorm: vector(&t.hnorm, "MTP hidden norm")?,
                eh_proj: linear(&gpu, &t.eh_proj)?,
                head_norm: vector(&t.head_norm, "MTP head norm")?,
                head: t.head.as_ref().map(|h| linear(&gpu, h)).transpose()?,
            }),
            None => None,
        };
        let norm = vector(&m.norm, "final norm")?;
        let head = linear(&gpu, m.lm_head.as_ref().unwrap_or(&m.embed))?;
        let all: Vec<&GLinear> = layers
            .iter()
            .chain(mtp.as_ref().map(|t| &t.layer))
            .flat_map(|l| l.linears())
            .chain([&head])
            .chain(
                mtp.iter()
                    .flat_map(|t| [Some(&t.eh_proj), t.head.as_ref()])
                    .flatten(),
            )
            .collect();
        let weights: u64 = all.iter().map(|l| l.bytes()).sum();
        let widest = all.iter().map(|l| l.cols).max().unwrap_or(0);
        let words = (gpu.max_binding() / 4) as usize;
        let arena_words = std::env::var("CHARM_GPU_TEST_ARENA_WORDS")
            .ok()
            .and_then(|w| w.parse().ok())
            .map_or(words, |w: usize| w.min(words));
        Ok(Self {
            kernels,
            widest,
            layers,
            norm,
            bytes: bytes + weights,
            head,
            mtp,
            gpu,
            arena: Mutex::new(None),
            arena_words,
        })
    }

    /// One decoder layer's weights copied to VRAM.
    fn layer(
        gpu: &Gpu,
        l: &LayerWeights,
        vector: &mut impl FnMut(&[f32], &str) -> Result<wgpu::Buffer, GpuError>,
    ) -> Result<GLayer, GpuError> {
        Ok(GLayer {
            input_norm: vector(&l.input_norm, "input norm")?,
            post_norm: vector(&l.post_norm, "post norm")?,
            attn: match &l.attn {
                AttnWeights::Gqa(_) => GAttn::Gqa(Box::new(Self::gqa(gpu, l, vector)?)),
                AttnWeights::Mla(w) => GAttn::Mla(Box::new(GMla {
                    q_a: w.q_a.as_ref().map(|q| linear(gpu, q)).transpose()?,
                    q_a_norm: w
                        .q_a_norm
                        .as_deref()
                        .map(|v| vector(v, "q_a norm"))
                        .transpose()?,
                    q_b: linear(gpu, &w.q_b)?,
                    kv_a: linear(gpu, &w.kv_a)?,
                    kv_a_norm: vector(&w.kv_a_norm, "kv_a norm")?,
                    kv_b: linear(gpu, &w.kv_b)?,
                    o: linear(gpu, &w.o)?,
                    indexer: match &l.indexer {
                        Some(i) => Some(GIndexer {
                            wq_b: linear(gpu, &i.wq_b)?,
                            wk: linear(gpu, &i.wk)?,
                            k_norm: vector(
                                &[&i.k_norm_w[..], &i.k_norm_b[..]].concat(),
                                "indexer key norm",
                            )?,
                            weights_proj: matrix(gpu, &i.weights_proj)?,
                        }),
                        None => None,
                    },
                })),
            },
            ffn: match &l.ffn {
                FfnWeights::Dense(s) => GFfn::Dense(swiglu(gpu, s)?),
                FfnWeights::Moe { router, shared, .. } => GFfn::Moe {
                    router: matrix(gpu, router)?,
                    shared: shared.as_ref().map(|s| swiglu(gpu, s)).transpose()?,
                },
            },
        })
    }

    fn gqa(
        gpu: &Gpu,
        l: &LayerWeights,
        vector: &mut impl FnMut(&[f32], &str) -> Result<wgpu::Buffer, GpuError>,
    ) -> Result<GGqa, GpuError> {
        let AttnWeights::Gqa(GqaWeights {
            q,
            k,
            v,
            o,
            q_bias,
            k_bias,
            v_bias,
            q_norm,
            k_norm,
        }) = &l.attn
        else {
            return Err(GpuError::Format("not a GQA layer".into()));
        };
        let mut opt =
            |v: &Option<Vec<f32>>, what| v.as_deref().map(|v| vector(v, what)).transpose();
        Ok(GGqa {
            q: linear(gpu, q)?,
            k: linear(gpu, k)?,
            v: linear(gpu, v)?,
            o: linear(gpu, o)?,
            q_bias: opt(q_bias, "q bias")?,
            k_bias: opt(k_bias, "k bias")?,
            v_bias: opt(v_bias, "v bias")?,
            q_norm: opt(q_norm, "q norm")?,
            k_norm: opt(k_norm, "k norm")?,
        })
    }

    /// Bytes of VRAM the dense weights hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the device's memory is its own, not the host's RAM ([`charm_worker::gpu::Gpu`]).
    pub fn dedicated_memory(&self) -> bool {
        self.gpu.dedicated_memory
    }

    /// Whether the device runs the MTP layer too (else drafts run on the CPU).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The device, as its driver names it.
    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }
}

impl GLinear {
    fn bytes(&self) -> u64 {
        self.buf.size()
    }
}

impl GLayer {
    /// Every matrix of the layer.
    fn linears(&self) -> Vec<&GLinear> {
        let mut v = match &self.attn {
            GAttn::Gqa(a) => vec![&a.q, &a.k, &a.v, &a.o],
            GAttn::Mla(a) => {
                let mut v: Vec<&GLinear> = a.q_a.iter().collect();
                v.extend([&a.q_b, &a.kv_a, &a.kv_b, &a.o]);
                if let Some(i) = &a.indexer {
                    v.extend([&i.wq_b, &i.wk, &i.weights_proj]);
                }
                v
            }
        };
        match &self.ffn {
            GFfn::Dense(s) => v.extend([&s.gate, &s.up, &s.down]),
            GFfn::Moe { router, shared } => {
                v.push(router);
                if let Some(s) = shared {
                    v.extend([&s.gate, &s.up, &s.down]);
                }
            }
        }
        v
    }
}

fn swiglu(gpu: &Gpu, s: &SwiGlu) -> Result<GSwiGlu, GpuError> {
    Ok(GSwiGlu {
        gate: linear(gpu, &s.gate)?,
        up: linear(gpu, &s.up)?,
        down: linear(gpu, &s.down)?,
    })
}

fn matrix(gpu: &Gpu, m: &Matrix) -> Result<GLinear, GpuError> {
    Ok(GLinear {
        buf: gpu.constant(f32_bytes(&m.data), "f32 matrix")?,
        rows: m.rows,
        cols: m.cols,
        kind: 0,
        group: m.cols,
        scales: 0,
        mins: 0,
        int_path: None,
    })
}

fn linear(gpu: &Gpu, l: &Linear) -> Result<GLinear, GpuError> {
    let q = match l {
        Linear::F32(m) => return matrix(gpu, m),
        Linear::Quant(q) => q.to_row_major(),
    };
    let mut bytes = q.data.to_vec();
    bytes.resize(bytes.len().next_multiple_of(4), 0);
    let scales = bytes.len() / 4;
    bytes.extend_from_slice(f32_bytes(&q.scales));
    let mins = bytes.len() / 4;
    bytes.extend_from_slice(f32_bytes(&q.mins));
    let kind = match q.kind {
        QuantKind::Bf16 => 1,
        QuantKind::Int8 => 2,
        QuantKind::Int4 => 3,
        QuantKind::Int2 => 4,
    };
    Ok(GLinear {
        buf: gpu.constant(&bytes, "quantized matrix")?,
        rows: q.rows,
        cols: q.cols,
        kind,
        group: q.group,
        scales: scales as u32,
        mins: mins as u32,
        int_path: (q.act == Activations::Int8 && q.integer_path())
            .then_some(q.kind == QuantKind::Int4),
    })
}

/// Routed experts that add nothing: [`Model::attach_dense_gpu`]'s check compares the dense
/// skeleton alone.
#[derive(Debug)]
pub(crate) struct NoExperts(pub usize);

impl charm_shared::expert::ExpertExecutor for NoExperts {
    fn run(
        &self,
        b: charm_shared::expert::ExpertBatch<'_>,
    ) -> Result<Vec<f32>, charm_shared::expert::ExpertError> {
        Ok(vec![0.0; b.n_tokens * self.0])
    }
}

/// One sequence's KV cache in VRAM: a buffer per layer (so that a long context stays within the
/// device's largest binding), each holding the layer's entries (`width` words a token, `cap`
/// tokens) and then its DSA indexer keys (`iw` words a token, zeros on layers without them), of
/// which the first `valid` tokens equal the cache's own.
#[derive(Debug)]
pub struct SeqKv {
    bufs: Vec<wgpu::Buffer>,
    cap: usize,
    valid: usize,
    width: usize,
}

impl SeqKv {
    /// Word of token 0 of a layer's indexer keys in its buffer (its entries start at 0).
    fn index_base(&self) -> usize {
        self.cap * self.width
    }
}

/// A cache's copy in VRAM, if it has one ([`crate::model::cache::KvCache::device`]). A clone
/// has none: two caches never share one.
#[derive(Default)]
pub struct DeviceKv(Option<SeqKv>);

impl Clone for DeviceKv {
    fn clone(&self) -> Self {
        Self(None)
    }
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(s) => write!(f, "DeviceKv({} of {} tokens)", s.valid, s.cap),
            None => write!(f, "DeviceKv(none)"),
        }
    }
}

impl DeviceKv {
    /// The cache kept its first `tokens` tokens.
    pub fn truncate(&mut self, tokens: usize) {
        if let Some(s) = &mut self.0 {
            s.valid = s.valid.min(tokens);
        }
    }
}
