//! A forward step with the dense skeleton on the GPU: the same layers, in the same order, as
//! `model::forward`, each CPU kernel replaced by its GPU twin. One submission runs from one MoE
//! layer's routed experts to the next's: at each MoE layer the normed rows and the router's logits
//! come back, the CPU routes them and the model's executor computes the routed experts (RAM, a
//! streaming store, the VRAM tier or workers), and their sum goes back down. Where the executor
//! reads experts ahead, each layer's router lookahead comes back before its attention too.

use charm_shared::expert::ExpertBatch;
use charm_shared::quant::gpu::{nibble_block, KernelParams};
use charm_worker::gpu::program::{flat_groups, grid, Dispatch, BLOCK_BYTES};
use charm_worker::gpu::GpuError;

use super::{DenseGpu, GAttn, GFfn, GGqa, GLinear, GMla, GSwiGlu, SeqKv};
use crate::model::forward::{route_logits, ForwardError, ForwardOptions, MlaMode, Step, Trace};
use crate::model::rows::{Rows, Selection};
use crate::model::{FfnWeights, LayerWeights, Model};
use charm_shared::config::{AttentionSpec, IndexerKind};

impl From<GpuError> for ForwardError {
    fn from(e: GpuError) -> Self {
        ForwardError::Gpu(e.to_string())
    }
}

/// Words of attention scores a submission holds at once: a sequence's queries go through
/// attention in chunks that fit (64 MiB).
const SCORE_WORDS: usize = 1 << 24;

/// The dense shader's parameter block, by field (see `Params` in `dense.wgsl`).
#[derive(Default, Clone, Copy)]
struct P {
    n: usize,
    rows: usize,
    cols: usize,
    kind: u32,
    group: usize,
    w_data: u32,
    w_scales: u32,
    w_mins: u32,
    in0: u32,
    in1: u32,
    in2: u32,
    out0: u32,
    eps: f32,
    scale: f32,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ctx: usize,
    kv_width: usize,
    kv_off: usize,
    v_off: usize,
    pos0: usize,
    stride_in: usize,
    rope_off: usize,
    half: usize,
    kv_base: usize,
    lat: usize,
    rd: usize,
    nope: usize,
    vd: usize,
    keys: u32,
    sel: bool,
    start: f32,
    hs: f32,
}

impl P {
    fn words(&self) -> [u32; BLOCK_BYTES / 4] {
        let mut w = [0u32; BLOCK_BYTES / 4];
        let v = [
            self.n as u32,
            self.rows as u32,
            self.cols as u32,
            self.kind,
            self.group as u32,
            self.w_data,
            self.w_scales,
            self.w_mins,
            self.in0,
            self.in1,
            self.in2,
            self.out0,
            self.eps.to_bits(),
            self.scale.to_bits(),
            self.heads as u32,
            self.kv_heads as u32,
            self.head_dim as u32,
            self.ctx as u32,
            self.kv_width as u32,
            self.kv_off as u32,
            self.v_off as u32,
            self.pos0 as u32,
            self.stride_in as u32,
            0,
            self.rope_off as u32,
            self.half as u32,
            self.kv_base as u32,
            self.lat as u32,
            self.rd as u32,
            self.nope as u32,
            self.vd as u32,
            self.keys,
            self.sel as u32,
            self.start.to_bits(),
            self.hs.to_bits(),
        ];
        w[..v.len()].copy_from_slice(&v);
        w
    }
}

/// Dispatches recorded for the next submission.
#[derive(Default)]
struct Rec {
    ops: Vec<Dispatch>,
}

impl Rec {
    fn push(
        &mut self,
        entry: &'static str,
        w: Option<&wgpu::Buffer>,
        kv: Option<&wgpu::Buffer>,
        p: P,
        groups: [u32; 3],
    ) {
        self.ops.push(Dispatch {
            entry,
            w: w.cloned(),
            kv: kv.cloned(),
            params: p.words(),
            groups,
        });
    }

    /// `y = l x` for `n` rows (`x` `[n, cols]` at word `x`, `y` `[n, rows]`), as
    /// `Linear::matmul` computes it: the integer path where the CPU takes it (its activations
    /// quantized into `qx` first), else the f32 dot products.
    fn linear(&mut self, l: &GLinear, x: u32, n: usize, y: u32, qx: [u32; 3]) {
        if let Some(int4) = l.int_path {
            let nb = nibble_block(l.group) as u32;
            let k = |p: KernelParams| {
                let mut w = [0u32; BLOCK_BYTES / 4];
                let b = p.to_bytes();
                for (o, c) in w.iter_mut().zip(b.chunks_exact(4)) {
                    *o = u32::from_le_bytes(c.try_into().expect("a word"));
                }
                w
            };
            let ng = l.cols / l.group;
            self.ops.push(Dispatch {
                entry: "quantize",
                w: None,
                kv: None,
                params: k(KernelParams {
                    cols: l.cols as u32,
                    group: l.group as u32,
                    int4: int4 as u32,
                    n: n as u32,
                    nb,
                    in0: x,
                    out0: qx[0],
                    out1: qx[1],
                    out2: qx[2],
                    ..Default::default()
                }),
                groups: grid(ng, n, 1),
            });
            self.ops.push(Dispatch {
                entry: "matvec",
                w: Some(l.buf.clone()),
                kv: None,
                params: k(KernelParams {
                    rows: l.rows as u32,
                    cols: l.cols as u32,
                    group: l.group as u32,
                    int4: int4 as u32,
                    n: n as u32,
                    nb,
                    w_data: 0,
                    w_scales: l.scales,
                    in0: qx[0],
                    in1: qx[1],
                    in2: qx[2],
                    out0: y,
                    ..Default::default()
                }),
                groups: grid(l.rows, n, 1),
            });
            return;
        }
        let p = P {
            n,
            rows: l.rows,
            cols: l.cols,
            kind: l.kind,
            group: l.group,
            w_scales: l.scales,
            w_mins: l.mins,
            in0: x,
            out0: y,
            ..Default::default()
        };
        self.push("linear", Some(&l.buf), None, p, grid(l.rows, n, 1));
    }

    /// RMSNorm of `rows` rows of `cols` at `x` into `out` (may be `x`).
    fn rmsnorm(&mut self, w: &wgpu::Buffer, x: u32, rows: usize, cols: usize, out: u32, eps: f32) {
        self.rmsnorm_strided(w, x, rows, cols, 0, out, eps);
    }

    /// [`Self::rmsnorm`] of rows `stride` words apart (0: `cols`).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_strided(
        &mut self,
        w: &wgpu::Buffer,
        x: u32,
        rows: usize,
        cols: usize,
        stride: usize,
        out: u32,
        eps: f32,
    ) {
        let p = P {
            n: rows,
            cols,
            stride_in: stride,
            in0: x,
            out0: out,
            eps,
            ..Default::default()
        };
        self.push("rmsnorm", Some(w), None, p, flat_groups(rows));
    }

    /// RoPE on `heads` heads of each of `n` rows: head `h` of row `t` at `x + t * row + h *
    /// head`, its rotary part from `off`, with row `t`'s tables.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &mut self,
        r: &Regions,
        x: u32,
        n: usize,
        heads: usize,
        head: usize,
        row: usize,
        off: usize,
        interleaved: bool,
    ) {
        let p = P {
            n,
            heads,
            cols: head,
            stride_in: row,
            rope_off: off,
            kind: interleaved as u32,
            in0: x,
            in1: r.cos,
            in2: r.sin,
            half: r.half,
            ..Default::default()
        };
        self.push("rope", None, None, p, grid(heads, n, 1));
    }

    /// Copies `n` rows of `cols` (`stride` apart) at `x` into a cache at tokens `pos0..`.
    #[allow(clippy::too_many_arguments)]
    fn append_kv(
        &mut self,
        kv: &wgpu::Buffer,
        base: usize,
        width: usize,
        x: u32,
        n: usize,
        cols: usize,
        stride: usize,
        pos0: usize,
    ) {
        let p = P {
            n,
            cols,
            stride_in: stride,
            in0: x,
            pos0,
            kv_width: width,
            kv_base: base,
            ..Default::default()
        };
        self.push("to_kv", None, Some(kv), p, grid(cols, n, 1));
    }

    /// `out = a + b`, `len` values.
    fn add(&mut self, a: u32, b: u32, len: usize, out: u32) {
        let p = P {
            n: len,
            cols: len,
            in0: a,
            in1: b,
            out0: out,
            ..Default::default()
        };
        self.push("add", None, None, p, flat_groups(len));
    }

    /// `x += bias` on every row of `cols` (`len` values).
    fn add_bias(&mut self, x: u32, bias: &wgpu::Buffer, cols: usize, len: usize) {
        let p = P {
            n: len,
            cols,
            kind: 1,
            in0: x,
            out0: x,
            ..Default::default()
        };
        self.push("add", Some(bias), None, p, flat_groups(len));
    }

    /// `SwiGlu::forward` of `n` rows at `x` into `y`, through `g`, `u`, `h`.
    fn swiglu(&mut self, s: &GSwiGlu, x: u32, n: usize, y: u32, r: &Regions) {
        self.linear(&s.gate, x, n, r.g, r.qx);
        self.linear(&s.up, x, n, r.u, r.qx);
        let len = n * s.gate.rows;
        let p = P {
            n: len,
            in0: r.g,
            in1: r.u,
            out0: r.h,
            ..Default::default()
        };
        self.push("silu_mul", None, None, p, flat_groups(len));
        self.linear(&s.down, r.h, n, y, r.qx);
    }
}

/// The keys a DSA layer's queries attend: every causal key (no query sees more than
/// `index_topk`), or the lists the indexer chose on the device, in the arena's key region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    All,
    Listed,
}

/// Word offsets of a step's activations in the arena.
struct Regions {
    x: u32,
    a: u32,
    cat: u32,
    q: u32,
    k: u32,
    v: u32,
    qr: u32,
    ckv: u32,
    qabs: u32,
    lctx: u32,
    att: u32,
    o: u32,
    f: u32,
    logits: u32,
    /// The router logits of an early guess at the next MoE layer.
    guess: u32,
    g: u32,
    u: u32,
    h: u32,
    shared: u32,
    y: u32,
    scores: u32,
    expanded: u32,
    keys: u32,
    ik: u32,
    iq: u32,
    hw: u32,
    dsa: u32,
    cos: u32,
    sin: u32,
    half: usize,
    qx: [u32; 3],
    /// One word a layer: set when the layer's output is not finite.
    flags: u32,
    end: usize,
}

/// The attention shapes a step needs.
#[derive(Clone, Copy, Default)]
struct Shape {
    /// Query heads and the words of one query head.
    heads: usize,
    qhead: usize,
    /// GQA: KV heads and head size.
    kv_heads: usize,
    hd: usize,
    /// MLA: latent rank, rotary dims, no-rope dims, value dims, q LoRA rank.
    lat: usize,
    rd: usize,
    nope: usize,
    vd: usize,
    q_lora: usize,
    /// Words of one layer's cache entry, and of one indexer key (0 without DSA).
    width: usize,
    iw: usize,
    /// DSA indexer heads.
    ih: usize,
}

impl Shape {
    fn of(m: &Model) -> Self {
        let iw = m.spec.dsa.as_ref().map_or(0, |d| d.head_dim);
        let ih = m.spec.dsa.as_ref().map_or(0, |d| d.n_heads);
        match &m.spec.attention {
            AttentionSpec::Gqa(g) => Shape {
                heads: g.n_heads,
                qhead: g.head_dim,
                kv_heads: g.n_kv_heads,
                hd: g.head_dim,
                width: 2 * g.n_kv_heads * g.head_dim,
                iw,
                ih,
                ..Default::default()
            },
            AttentionSpec::Mla(a) => Shape {
                heads: a.n_heads,
                qhead: a.qk_head_dim(),
                lat: a.kv_lora_rank,
                rd: a.qk_rope_head_dim,
                nope: a.qk_nope_head_dim,
                vd: a.v_head_dim,
                q_lora: a.q_lora_rank.unwrap_or(0),
                width: a.cache_width(),
                iw,
                ih,
                ..Default::default()
            },
        }
    }
}

impl DenseGpu {
    /// The step's regions for `n` rows whose queries see at most `ctx` keys.
    fn regions(&self, m: &Model, s: &Shape, n: usize, ctx: usize, naive: bool) -> Regions {
        let spec = &m.spec;
        let h = spec.hidden_size;
        let experts = spec.router.as_ref().map_or(0, |r| r.n_experts);
        let inter = self
            .layers
            .iter()
            .map(|l| match &l.ffn {
                GFfn::Dense(s) => s.gate.rows,
                GFfn::Moe { shared, .. } => shared.as_ref().map_or(0, |s| s.gate.rows),
            })
            .max()
            .unwrap_or(0);
        let widest = self.widest;
        let half = spec.rope.dim / 2;
        let heads = s.heads.max(1);
        let chunk = (SCORE_WORDS / (heads * ctx).max(1)).clamp(1, n.max(1));
        let kv_b_rows = s.heads * (s.nope + s.vd);
        let mut at = 0usize;
        let mut take = |words: usize| {
            let o = at as u32;
            at += words.max(1);
            o
        };
        Regions {
            x: take(n * h),
            a: take(n * h),
            cat: take(2 * n * h),
            q: take(n * s.heads * s.qhead),
            k: take(n * s.kv_heads * s.hd),
            v: take(n * s.kv_heads * s.hd),
            qr: take(n * s.q_lora),
            ckv: take(n * (s.lat + s.rd)),
            qabs: take(n * s.heads * s.lat),
            lctx: take(n * s.heads * s.lat),
            att: take(n * s.heads * s.hd.max(s.vd)),
            o: take(n * h),
            f: take(n * h),
            logits: take(n * experts),
            guess: take(n * experts),
            g: take(n * inter),
            u: take(n * inter),
            h: take(n * inter),
            shared: take(n * h),
            y: take(n * h),
            scores: take(chunk * s.heads * ctx),
            expanded: take(if naive { ctx * kv_b_rows } else { 0 }),
            keys: take(n * (ctx + 1)),
            ik: take(n * s.iw),
            iq: take(n * s.ih * s.iw),
            hw: take(n * s.ih),
            dsa: take(if s.iw > 0 { n * ctx } else { 0 }),
            cos: take(n * half),
            sin: take(n * half),
            half,
            qx: [
                take(n * widest / 4),
                take(n * widest / 8),
                take(n * widest / 8),
            ],
            flags: take(spec.layers.len()),
            end: at,
        }
    }

    /// Most rows of `rows` one pass may take when its queries see up to `ctx` keys: every
    /// region of the arena must fit one binding, and those that grow with rows times keys (DSA
    /// scores, key lists, expanded naive attention) bound it for long contexts; a grid holds
    /// 65,535 rows.
    pub(super) fn rows_per_pass(&self, m: &Model, rows: usize, ctx: usize, naive: bool) -> usize {
        let s = Shape::of(m);
        let fits =
            |n: usize| n <= 65535 && self.regions(m, &s, n, ctx, naive).end <= self.arena_words;
        if fits(rows) {
            return rows;
        }
        let mut n = rows.min(65535);
        while n > 1 && !fits(n) {
            n = n.div_ceil(2);
        }
        n
    }

    /// The step's arena, at least `words` long.
    fn arena(&self, words: usize) -> Result<wgpu::Buffer, GpuError> {
        let mut slot = self.arena.lock().expect("dense arena");
        if let Some(b) = slot.as_ref() {
            if b.size() >= words as u64 * 4 {
                return Ok(b.clone());
            }
        }
        let bytes = (words as u64 * 4).next_power_of_two().max(1 << 16);
        let b = self
            .gpu
            .storage(bytes, "dense arena")
            .or_else(|_| self.gpu.storage(words as u64 * 4, "dense arena"))?;
        *slot = Some(b.clone());
        Ok(b)
    }

    /// `[n, vocab]` logits of `n` final-normed rows: the head on the GPU.
    pub fn logits(&self, normed: &[f32], n: usize) -> Result<Vec<f32>, GpuError> {
        self.logits_with(&self.head, normed, n)
    }

    /// [`Self::logits`] through `head`.
    fn logits_with(&self, head: &GLinear, normed: &[f32], n: usize) -> Result<Vec<f32>, GpuError> {
        let (h, vocab) = (head.cols, head.rows);
        let widest = h.max(vocab);
        let (x, y) = (0u32, (n * h) as u32);
        let qx0 = (n * (h + vocab)) as u32;
        let qx = [
            qx0,
            qx0 + (n * widest / 4) as u32,
            qx0 + (n * widest / 4 + n * widest / 8) as u32,
        ];
        let arena = self.arena(qx[2] as usize + n * widest / 8 + 1)?;
        self.gpu.write(&arena, x as u64, normed);
        let mut rec = Rec::default();
        rec.linear(head, x, n, y, qx);
        let mut out = self.gpu.run_program(
            &self.kernels,
            &arena,
            &rec.ops,
            &[(&arena, y as u64, n * vocab)],
        )?;
        Ok(out.pop().unwrap_or_default())
    }
}

/// What a step's layers share: the device, the arena and its regions, the rows, the caches'
/// VRAM copies, and the dispatches recorded since the last submission.
struct Run<'a> {
    dg: &'a DenseGpu,
    arena: wgpu::Buffer,
    r: Regions,
    s: Shape,
    rows: Rows,
    /// Per sequence: its tokens cached before the step, its cache's VRAM copy (a buffer per
    /// layer, and the word of the indexer keys in each).
    cached: Vec<usize>,
    kv: Vec<(Vec<wgpu::Buffer>, usize)>,
    ctx: usize,
    rec: Rec,
}

/// What `Iterator::sum` of f32 starts from (the DSA terms and the indexer's LayerNorm sum in
/// order from it).
fn sum_start() -> f32 {
    std::hint::black_box(std::iter::empty::<f32>()).sum()
}

impl Run<'_> {
    /// Submits what is recorded; reads back `(word, len)` of the arena.
    fn flush(&mut self, reads: &[(u32, usize)]) -> Result<Vec<Vec<f32>>, GpuError> {
        let ops = std::mem::take(&mut self.rec.ops);
        let reads: Vec<(&wgpu::Buffer, u64, usize)> = reads
            .iter()
            .map(|&(w, l)| (&self.arena, w as u64, l))
            .collect();
        self.dg
            .gpu
            .run_program(&self.dg.kernels, &self.arena, &ops, &reads)
    }

    /// Sequence `si`'s cache of layer `l`: its buffer, the word of its entries and of its
    /// indexer keys.
    fn kv(&self, si: usize, l: usize) -> (&wgpu::Buffer, usize, usize) {
        let (bufs, index_base) = &self.kv[si];
        (&bufs[l], 0, *index_base)
    }

    /// GQA attention of layer `li` on the normed rows at `a` into `o` (`gqa`).
    fn gqa(&mut self, li: usize, at: &GGqa, m: &Model) {
        let (r, s, n) = (&self.r, self.s, self.rows.n());
        let (nh, nkv, hd) = (s.heads, s.kv_heads, s.hd);
        let eps = m.spec.rms_norm_eps;
        for (lin, out, bias) in [
            (&at.q, r.q, &at.q_bias),
            (&at.k, r.k, &at.k_bias),
            (&at.v, r.v, &at.v_bias),
        ] {
            self.rec.linear(lin, r.a, n, out, r.qx);
            if let Some(b) = bias {
                self.rec.add_bias(out, b, lin.rows, n * lin.rows);
            }
        }
        if let Some(qn) = &at.q_norm {
            self.rec.rmsnorm(qn, r.q, n * nh, hd, r.q, eps);
        }
        if let Some(kn) = &at.k_norm {
            self.rec.rmsnorm(kn, r.k, n * nkv, hd, r.k, eps);
        }
        self.rec.rope(r, r.q, n, nh, hd, nh * hd, 0, false);
        self.rec.rope(r, r.k, n, nkv, hd, nkv * hd, 0, false);
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            let len = span.len();
            if len == 0 {
                continue;
            }
            let (buf, base, _) = self.kv(si, li);
            let buf = buf.clone();
            for (reg, off) in [(r.k, 0), (r.v, nkv * hd)] {
                self.rec.append_kv(
                    &buf,
                    base + off,
                    s.width,
                    reg + (span.start * nkv * hd) as u32,
                    len,
                    nkv * hd,
                    nkv * hd,
                    self.cached[si],
                );
            }
            let chunk = (SCORE_WORDS / (nh * self.ctx).max(1)).clamp(1, len);
            for c0 in (0..len).step_by(chunk) {
                let mm = chunk.min(len - c0);
                let row0 = span.start + c0;
                let base = P {
                    n: mm,
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    ctx: self.ctx,
                    kv_width: s.width,
                    v_off: nkv * hd,
                    pos0: self.cached[si] + c0,
                    kv_base: base,
                    scale: m.spec.softmax_scale,
                    ..Default::default()
                };
                let keys = self.cached[si] + c0 + mm;
                let q = P {
                    in0: r.q + (row0 * nh * hd) as u32,
                    out0: r.scores,
                    ..base
                };
                self.rec
                    .push("gqa_scores", None, Some(&buf), q, grid(keys, nh, mm));
                let sm = P {
                    in0: r.scores,
                    ..base
                };
                self.rec
                    .push("softmax_keys", None, None, sm, grid(nh, mm, 1));
                let v = P {
                    in0: r.scores,
                    out0: r.att + (row0 * nh * hd) as u32,
                    ..base
                };
                self.rec
                    .push("gqa_values", None, Some(&buf), v, grid(hd, nh, mm));
            }
        }
        self.rec.linear(&at.o, r.att, n, r.o, r.qx);
    }

    /// MLA attention of layer `li` (with its DSA selection) on the normed rows at `a` into `o`
    /// (`Model::mla`).
    #[allow(clippy::too_many_arguments)]
    fn mla(
        &mut self,
        li: usize,
        layer: &LayerWeights,
        at: &GMla,
        m: &Model,
        sel: &mut Option<Keys>,
        opts: ForwardOptions,
        trace: Option<&mut Trace>,
    ) -> Result<(), ForwardError> {
        const LATENT_EPS: f32 = 1e-6;
        let (s, n) = (self.s, self.rows.n());
        let r = &self.r;
        let (nh, qkd, kvr, rd) = (s.heads, s.qhead, s.lat, s.rd);
        let interleaved = m.spec.rope.interleaved;
        // queries
        let q_resid = match (&at.q_a, &at.q_a_norm) {
            (Some(qa), Some(qn)) => {
                self.rec.linear(qa, r.a, n, r.qr, r.qx);
                self.rec.rmsnorm(qn, r.qr, n, s.q_lora, r.qr, LATENT_EPS);
                self.rec.linear(&at.q_b, r.qr, n, r.q, r.qx);
                true
            }
            _ => {
                self.rec.linear(&at.q_b, r.a, n, r.q, r.qx);
                false
            }
        };
        self.rec
            .rope(r, r.q, n, nh, qkd, nh * qkd, s.nope, interleaved);
        // latent and rope key, into the cache
        self.rec.linear(&at.kv_a, r.a, n, r.ckv, r.qx);
        self.rec
            .rmsnorm_strided(&at.kv_a_norm, r.ckv, n, kvr, kvr + rd, r.ckv, LATENT_EPS);
        self.rec.rope(r, r.ckv, n, 1, 0, kvr + rd, kvr, interleaved);
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            if span.is_empty() {
                continue;
            }
            let (buf, base, _) = self.kv(si, li);
            let buf = buf.clone();
            let x = r.ckv + (span.start * (kvr + rd)) as u32;
            self.rec.append_kv(
                &buf,
                base,
                s.width,
                x,
                span.len(),
                kvr + rd,
                kvr + rd,
                self.cached[si],
            );
        }
        // DSA: this layer's own selection, or the previous full layer's
        if let (Some(kind), Some(dsa)) = (layer.indexer_kind, &m.spec.dsa) {
            if let (IndexerKind::Full, Some(iw), true) = (kind, &at.indexer, q_resid) {
                let chosen = self.indexer(li, iw, dsa, m)?;
                if let Some(tr) = trace {
                    tr.dsa.push(self.selection(chosen)?);
                }
                *sel = Some(chosen);
            }
        }
        // the key lists the indexer left in the arena (a shared layer reads its full layer's)
        let with_keys = *sel == Some(Keys::Listed);
        let naive = opts.mla == MlaMode::Naive;
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            let len = span.len();
            if len == 0 {
                continue;
            }
            let (buf, base, _) = self.kv(si, li);
            let buf = buf.clone();
            let r = &self.r;
            let kvb = &at.kv_b;
            let total = self.cached[si] + len;
            let wb = P {
                kind: kvb.kind,
                group: kvb.group,
                w_scales: kvb.scales,
                w_mins: kvb.mins,
                cols: kvb.cols,
                rows: kvb.rows,
                ..Default::default()
            };
            if naive {
                let p = P {
                    n: total,
                    lat: kvr,
                    kv_width: s.width,
                    kv_base: base,
                    out0: r.expanded,
                    ..wb
                };
                self.rec.push(
                    "mla_expand",
                    Some(&kvb.buf),
                    Some(&buf),
                    p,
                    grid(kvb.rows, total, 1),
                );
            }
            let chunk = (SCORE_WORDS / (nh * self.ctx).max(1)).clamp(1, len);
            for c0 in (0..len).step_by(chunk) {
                let mm = chunk.min(len - c0);
                let row0 = span.start + c0;
                let b = P {
                    n: mm,
                    heads: nh,
                    head_dim: qkd,
                    ctx: self.ctx,
                    kv_width: s.width,
                    kv_base: base,
                    pos0: self.cached[si] + c0,
                    lat: kvr,
                    rd,
                    nope: s.nope,
                    vd: s.vd,
                    keys: r.keys + (row0 * (self.ctx + 1)) as u32,
                    sel: with_keys,
                    scale: m.spec.softmax_scale,
                    ..wb
                };
                let q = r.q + (row0 * nh * qkd) as u32;
                let att = r.att + (row0 * nh * s.vd) as u32;
                let keys = self.ctx;
                if naive {
                    let sc = P {
                        in0: q,
                        in1: r.expanded,
                        out0: r.scores,
                        ..b
                    };
                    self.rec
                        .push("mla_naive_scores", None, Some(&buf), sc, grid(keys, nh, mm));
                    let sm = P { in0: r.scores, ..b };
                    self.rec
                        .push("softmax_keys", None, None, sm, grid(nh, mm, 1));
                    let v = P {
                        in0: r.scores,
                        in1: r.expanded,
                        out0: att,
                        ..b
                    };
                    self.rec
                        .push("mla_naive_values", None, None, v, grid(s.vd, nh, mm));
                    continue;
                }
                let ab = P {
                    in0: q,
                    out0: r.qabs,
                    ..b
                };
                self.rec
                    .push("mla_absorb", Some(&kvb.buf), None, ab, grid(kvr, nh, mm));
                let sc = P {
                    in0: r.qabs,
                    in1: q,
                    out0: r.scores,
                    ..b
                };
                self.rec
                    .push("mla_scores", None, Some(&buf), sc, grid(keys, nh, mm));
                let sm = P { in0: r.scores, ..b };
                self.rec
                    .push("softmax_keys", None, None, sm, grid(nh, mm, 1));
                let cx = P {
                    in0: r.scores,
                    out0: r.lctx,
                    ..b
                };
                self.rec
                    .push("mla_context", None, Some(&buf), cx, grid(kvr, nh, mm));
                let v = P {
                    in0: r.lctx,
                    out0: att,
                    ..b
                };
                self.rec
                    .push("mla_values", Some(&kvb.buf), None, v, grid(s.vd, nh, mm));
            }
        }
        let r = &self.r;
        self.rec.linear(&at.o, r.att, n, r.o, r.qx);
        Ok(())
    }

    /// The DSA lightning indexer of layer `li` (`indexer_select`): its keys into the cache, the
    /// scores, and each query's top keys chosen from them into the key lists (`dsa_topk`), all
    /// on the device.
    fn indexer(
        &mut self,
        li: usize,
        iw: &super::GIndexer,
        d: &charm_shared::config::DsaSpec,
        m: &Model,
    ) -> Result<Keys, ForwardError> {
        const KEY_EPS: f32 = 1e-6;
        let (s, n) = (self.s, self.rows.n());
        let r = &self.r;
        let (ih, ihd) = (d.n_heads, d.head_dim);
        let interleaved = m.spec.rope.interleaved;
        self.rec.linear(&iw.wk, r.a, n, r.ik, r.qx);
        let ln = P {
            n,
            cols: ihd,
            in0: r.ik,
            w_scales: ihd as u32,
            eps: KEY_EPS,
            start: sum_start(),
            ..Default::default()
        };
        self.rec
            .push("layernorm", Some(&iw.k_norm), None, ln, flat_groups(n));
        self.rec.rope(r, r.ik, n, 1, 0, ihd, 0, interleaved);
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            if span.is_empty() {
                continue;
            }
            let (buf, _, ibase) = self.kv(si, li);
            let buf = buf.clone();
            let x = self.r.ik + (span.start * ihd) as u32;
            self.rec
                .append_kv(&buf, ibase, s.iw, x, span.len(), ihd, ihd, self.cached[si]);
        }
        if self.rows.pos.iter().all(|&p| p < d.topk) {
            return Ok(Keys::All);
        }
        let r = &self.r;
        self.rec.linear(&iw.wq_b, r.qr, n, r.iq, r.qx);
        self.rec.rope(r, r.iq, n, ih, ihd, ih * ihd, 0, interleaved);
        self.rec.linear(&iw.weights_proj, r.a, n, r.hw, r.qx);
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            if span.is_empty() {
                continue;
            }
            let (buf, _, ibase) = self.kv(si, li);
            let buf = buf.clone();
            let r = &self.r;
            let p = P {
                n: span.len(),
                heads: ih,
                head_dim: ihd,
                ctx: self.ctx,
                kv_width: s.iw,
                kv_base: ibase,
                pos0: self.cached[si],
                in0: r.iq + (span.start * ih * ihd) as u32,
                in1: r.hw + (span.start * ih) as u32,
                out0: r.dsa + (span.start * self.ctx) as u32,
                scale: (ihd as f32).powf(-0.5),
                hs: (ih as f32).powf(-0.5),
                start: sum_start(),
                ..Default::default()
            };
            self.rec.push(
                "dsa_scores",
                None,
                Some(&buf),
                p,
                grid(self.ctx, span.len(), 1),
            );
        }
        // each query's top keys, chosen on the device into the key lists
        for si in 0..self.rows.spans.len() {
            let span = self.rows.spans[si].clone();
            if span.is_empty() {
                continue;
            }
            let r = &self.r;
            let p = P {
                n: span.len(),
                rows: d.topk,
                ctx: self.ctx,
                pos0: self.cached[si],
                in0: r.dsa + (span.start * self.ctx) as u32,
                out0: r.keys + (span.start * (self.ctx + 1)) as u32,
                ..Default::default()
            };
            self.rec
                .push("dsa_topk", None, None, p, [span.len() as u32, 1, 1]);
        }
        Ok(Keys::Listed)
    }

    /// Each query's keys as `indexer_select` gives them, for a trace: every causal key, or the
    /// lists read back from the arena.
    fn selection(&mut self, keys: Keys) -> Result<Selection, ForwardError> {
        let (n, stride) = (self.rows.n(), self.ctx + 1);
        if keys == Keys::All {
            return Ok(self
                .rows
                .pos
                .iter()
                .map(|&p| (0..=p as u32).collect())
                .collect());
        }
        let lists = self.flush(&[(self.r.keys, n * stride)])?.remove(0);
        Ok(key_lists(&lists, stride))
    }
}

impl Model {
    /// [`Model::forward_batch`] with the dense skeleton on `dg`'s GPU: the same rows, the same
    /// bits.
    pub(crate) fn forward_batch_gpu(
        &self,
        dg: &DenseGpu,
        steps: &mut [Step<'_>],
        opts: ForwardOptions,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ForwardError> {
        let layers = self.layers.iter().zip(&dg.layers).collect();
        let pass = Pass {
            layers,
            input: Input::Embed,
            norm: &dg.norm,
        };
        let rows = steps.iter().map(|s| s.tokens.len()).sum::<usize>();
        let ctx = steps
            .iter()
            .map(|s| s.cache.len() + s.tokens.len())
            .max()
            .unwrap_or(0);
        let naive =
            opts.mla == MlaMode::Naive && matches!(self.spec.attention, AttentionSpec::Mla(_));
        let per = dg.rows_per_pass(self, rows, ctx, naive);
        if rows <= per {
            return Ok(self.gpu_pass(dg, steps, &pass, opts, trace)?.0);
        }
        // more rows than one arena holds (its scores and key lists grow with rows times keys):
        // each sequence on its own, `per` rows a pass (a row's values do not depend on which
        // rows share its pass)
        let mut trace = trace;
        let mut out = Vec::new();
        for st in steps.iter_mut() {
            for chunk in st.tokens.chunks(per) {
                let mut one = [Step {
                    tokens: chunk,
                    cache: &mut *st.cache,
                }];
                out.extend(
                    self.gpu_pass(dg, &mut one, &pass, opts, trace.as_deref_mut())?
                        .0,
                );
            }
        }
        Ok(out)
    }

    /// [`Model::mtp_forward_hidden`] on the GPU: `None` when the model has no MTP head there.
    pub(crate) fn mtp_forward_gpu(
        &self,
        dg: &DenseGpu,
        next_tokens: &[u32],
        main_normed: &[f32],
        cache: &mut crate::model::cache::KvCache,
    ) -> Option<Result<DraftOut, ForwardError>> {
        let (gm, m) = (dg.mtp.as_ref()?, self.mtp.as_ref()?);
        let h = self.spec.hidden_size;
        if main_normed.len() != next_tokens.len() * h {
            return Some(Err(ForwardError::Shape(format!(
                "mtp: {} hidden values for {} tokens",
                main_normed.len(),
                next_tokens.len()
            ))));
        }
        let opts = ForwardOptions::default();
        let n = next_tokens.len();
        let per = dg.rows_per_pass(self, n, cache.len() + n, false);
        Some((|| {
            let (mut l, mut hidden) = (Vec::new(), Vec::new());
            // (as the main pass: `per` rows at a time, the logits of each as it comes)
            for (i, chunk) in next_tokens.chunks(per).enumerate() {
                let rows = i * per * h..(i * per + chunk.len()) * h;
                let pass = Pass {
                    input: Input::Mtp {
                        main_normed: &main_normed[rows],
                        g: gm,
                        embed: m.embed.as_ref().unwrap_or(&self.embed),
                    },
                    layers: vec![(&m.layer, &gm.layer)],
                    norm: &gm.head_norm,
                };
                let mut steps = [Step {
                    tokens: chunk,
                    cache: &mut *cache,
                }];
                let (normed, hid) = self.gpu_pass(dg, &mut steps, &pass, opts, None)?;
                let head = gm.head.as_ref().unwrap_or(&dg.head);
                l.extend(dg.logits_with(head, &normed, chunk.len())?);
                hidden.extend(hid);
            }
            if !l.iter().all(|v| v.is_finite()) {
                return Err(ForwardError::NonFinite {
                    what: "the MTP logits".into(),
                });
            }
            Ok((l, hidden))
        })())
    }

    /// One pass of `steps` through `pass`'s layers on the GPU: the final-normed rows, and the
    /// rows before that norm.
    fn gpu_pass(
        &self,
        dg: &DenseGpu,
        steps: &mut [Step<'_>],
        pass: &Pass<'_>,
        opts: ForwardOptions,
        mut trace: Option<&mut Trace>,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        let spec = &self.spec;
        let h = spec.hidden_size;
        let s = Shape::of(self);
        let lens: Vec<usize> = steps.iter().map(|s| s.tokens.len()).collect();
        let cached: Vec<usize> = steps.iter().map(|s| s.cache.len()).collect();
        let rows = Rows::new(&lens, &cached);
        let n = rows.n();
        let ctx = lens
            .iter()
            .zip(&cached)
            .map(|(a, b)| a + b)
            .max()
            .unwrap_or(0);
        let naive = opts.mla == MlaMode::Naive && matches!(spec.attention, AttentionSpec::Mla(_));
        let r = dg.regions(self, &s, n, ctx, naive);
        let arena = dg.arena(r.end)?;
        let gpu = &dg.gpu;

        // the caches' copies in VRAM, with room for this step
        let n_layers = pass.layers.len();
        let (width, iw) = (s.width, s.iw);
        let mut kv = Vec::with_capacity(steps.len());
        for st in steps.iter_mut() {
            let need = st.cache.len() + st.tokens.len();
            let dev = &mut st.cache.device.0;
            if dev.as_ref().is_none_or(|d| d.cap < need) {
                // room for twice as many tokens where the device allows, else exactly these
                let per_token = width + iw;
                let layer = |cap: usize| -> Result<Vec<wgpu::Buffer>, GpuError> {
                    (0..n_layers)
                        .map(|_| gpu.storage((cap * per_token) as u64 * 4, "KV cache"))
                        .collect()
                };
                let cap = need.next_power_of_two().max(64);
                let (bufs, cap) = match layer(cap) {
                    Ok(b) => (b, cap),
                    Err(_) => (layer(need)?, need),
                };
                *dev = Some(SeqKv {
                    bufs,
                    cap,
                    valid: 0,
                    width,
                });
            }
            let d = dev.as_mut().expect("made above");
            let have = st.cache.layers.first().map_or(0, |l| l.len());
            if d.valid < have {
                let ib = d.index_base();
                for (buf, lc) in d.bufs.iter().zip(&st.cache.layers) {
                    let from = d.valid;
                    gpu.write(
                        buf,
                        (from * width) as u64,
                        &lc.kv[from * width..have * width],
                    );
                    if iw > 0 && lc.index_keys.len() >= have * iw {
                        gpu.write(
                            buf,
                            (ib + from * iw) as u64,
                            &lc.index_keys[from * iw..have * iw],
                        );
                    }
                }
                d.valid = have;
            }
            kv.push((d.bufs.clone(), d.index_base()));
        }

        // the input rows, and rotary tables
        let mut x = Vec::with_capacity(n * h);
        let mut rec = Rec::default();
        match &pass.input {
            Input::Embed => {
                for (st, p0) in steps.iter().zip(&cached) {
                    x.extend(self.embed_tokens(&self.embed, st.tokens, *p0)?);
                }
                gpu.write(&arena, r.x as u64, &x);
            }
            Input::Mtp {
                main_normed,
                g,
                embed,
            } => {
                // `mtp_forward_hidden`: [enorm(embedding), hnorm(main state)] -> eh_proj
                if main_normed.len() != n * h {
                    return Err(ForwardError::Shape(format!(
                        "mtp: {} hidden values for {n} tokens",
                        main_normed.len()
                    )));
                }
                let p0 = cached.first().copied().unwrap_or(0);
                let mut e = self.embed_tokens(embed, steps[0].tokens, p0)?;
                if p0 == 0 && n > 0 {
                    e[..h].fill(0.0); // vLLM deepseek_mtp: the embedding at position 0 is masked
                }
                let mut cat = Vec::with_capacity(2 * n * h);
                for t in 0..n {
                    cat.extend_from_slice(&e[t * h..(t + 1) * h]);
                    cat.extend_from_slice(&main_normed[t * h..(t + 1) * h]);
                }
                gpu.write(&arena, r.cat as u64, &cat);
                let eps = spec.rms_norm_eps;
                rec.rmsnorm_strided(&g.enorm, r.cat, n, h, 2 * h, r.cat, eps);
                let second = r.cat + h as u32;
                rec.rmsnorm_strided(&g.hnorm, second, n, h, 2 * h, second, eps);
                rec.linear(&g.eh_proj, r.cat, n, r.x, r.qx);
            }
        }
        let rope = self.rope_tables(&rows.pos);
        let cos: Vec<f32> = rope.iter().flat_map(|t| t.cos.iter().copied()).collect();
        let sin: Vec<f32> = rope.iter().flat_map(|t| t.sin.iter().copied()).collect();
        gpu.write(&arena, r.cos as u64, &cos);
        gpu.write(&arena, r.sin as u64, &sin);
        gpu.write(&arena, r.flags as u64, &vec![0.0; n_layers]);

        let eps = spec.rms_norm_eps;
        let mut run = Run {
            dg,
            arena: arena.clone(),
            r,
            s,
            rows,
            cached: cached.clone(),
            kv,
            ctx,
            rec,
        };
        let flags_of = |v: &[f32]| -> Result<(), ForwardError> {
            match v.iter().position(|f| f.to_bits() != 0) {
                Some(li) => Err(ForwardError::NonFinite {
                    what: format!("the output of layer {li}"),
                }),
                None => Ok(()),
            }
        };
        let mut sel: Option<Keys> = None;
        for (li, &(layer, gl)) in pass.layers.iter().enumerate() {
            self.gpu_lookahead(&mut run, pass, li)?;
            // --- attention ---
            let (rx, ra) = (run.r.x, run.r.a);
            run.rec.rmsnorm(&gl.input_norm, rx, n, h, ra, eps);
            match &gl.attn {
                GAttn::Gqa(at) => run.gqa(li, at, self),
                GAttn::Mla(at) => {
                    run.mla(li, layer, at, self, &mut sel, opts, trace.as_deref_mut())?
                }
            }
            let r = &run.r;
            run.rec.add(r.x, r.o, n * h, r.x);
            // the CPU pass's guess at the next MoE layer after attention: an MoE layer's comes
            // back with its rows, a dense layer's at once
            let guess = self.gpu_guess(&mut run, pass, li);
            let moe = matches!(layer.ffn, FfnWeights::Moe { .. });
            if let (Some((next, g)), false) = (guess, moe) {
                let back = run.flush(&[g])?;
                self.hand_guess(next, &back[0], n);
            }
            // --- feed-forward ---
            let r = &run.r;
            run.rec.rmsnorm(&gl.post_norm, r.x, n, h, r.f, eps);
            match (&gl.ffn, &layer.ffn) {
                (GFfn::Dense(sw), _) => {
                    let r = &run.r;
                    run.rec.swiglu(sw, r.f, n, r.y, r);
                    run.rec.add(r.x, r.y, n * h, r.x);
                }
                (
                    GFfn::Moe { router, shared },
                    FfnWeights::Moe {
                        correction_bias, ..
                    },
                ) => {
                    let rs = spec.router.as_ref().expect("MoE model has a router spec");
                    let e = rs.n_experts;
                    let r = &run.r;
                    run.rec.linear(router, r.f, n, r.logits, r.qx);
                    let (f, lg, fl) = (r.f, r.logits, r.flags);
                    let mut reads = vec![(f, n * h), (lg, n * e), (fl, li)];
                    reads.extend(guess.map(|g| g.1));
                    let back = run.flush(&reads)?;
                    // the shared expert runs on the device while the CPU routes and the routed
                    // experts compute (it is added after their sum, as everywhere)
                    if let Some(sw) = shared {
                        let r = &run.r;
                        run.rec.swiglu(sw, r.f, n, r.shared, r);
                        let ops = std::mem::take(&mut run.rec.ops);
                        gpu.submit_program(&dg.kernels, &arena, &ops)?;
                    }
                    flags_of(&back[2])?;
                    if let Some((next, _)) = guess {
                        self.hand_guess(next, &back[3], n);
                    }
                    let (f, logits) = (&back[0], &back[1]);
                    let k = rs.top_k;
                    let (mut ids, mut weights) =
                        (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
                    let mut picks = Vec::with_capacity(n);
                    for rt in route_logits(logits, correction_bias.as_deref(), rs) {
                        ids.extend_from_slice(&rt.ids);
                        weights.extend_from_slice(&rt.weights);
                        picks.push((rt.ids, rt.weights));
                    }
                    if let Some(tr) = trace.as_deref_mut() {
                        tr.router.push(picks);
                    }
                    self.expert_use.add(layer.index, &ids);
                    let y = self
                        .experts
                        .start(ExpertBatch {
                            step: self.steps.load(std::sync::atomic::Ordering::Relaxed),
                            layer: layer.index,
                            x: f,
                            n_tokens: n,
                            ids: &ids,
                            weights: &weights,
                            top_k: k,
                        })
                        .wait()?;
                    let r = &run.r;
                    gpu.write(&arena, r.y as u64, &y);
                    if shared.is_some() {
                        run.rec.add(r.y, r.shared, n * h, r.y);
                    }
                    run.rec.add(r.x, r.y, n * h, r.x);
                }
                _ => unreachable!("GPU layers are built from the model's"),
            }
            let r = &run.r;
            let p = P {
                n: n * h,
                in0: r.x,
                out0: r.flags + li as u32,
                ..Default::default()
            };
            run.rec.push("finite", None, None, p, flat_groups(n * h));
            if let Some(tr) = trace.as_deref_mut() {
                let x = run.r.x;
                tr.layer_out.extend(run.flush(&[(x, n * h)])?);
            }
        }
        let r = &run.r;
        run.rec.rmsnorm(pass.norm, r.x, n, h, r.a, eps);

        // the normed rows, the flags and every layer's new cache entries come back
        let hidden = matches!(pass.input, Input::Mtp { .. });
        let mut reads: Vec<(&wgpu::Buffer, u64, usize)> = vec![
            (&arena, r.a as u64, n * h),
            (&arena, r.flags as u64, n_layers),
            (&arena, r.x as u64, if hidden { n * h } else { 0 }),
        ];
        let with_index: Vec<bool> = pass
            .layers
            .iter()
            .map(|(l, _)| l.indexer_kind == Some(IndexerKind::Full) && iw > 0)
            .collect();
        for (si, span) in run.rows.spans.iter().enumerate() {
            let (bufs, ib) = &run.kv[si];
            let p0 = cached[si];
            for (buf, &idx) in bufs.iter().zip(&with_index) {
                reads.push((buf, (p0 * width) as u64, span.len() * width));
                reads.push((
                    buf,
                    (ib + p0 * iw) as u64,
                    if idx { span.len() * iw } else { 0 },
                ));
            }
        }
        let ops = std::mem::take(&mut run.rec.ops);
        let back = gpu.run_program(&dg.kernels, &arena, &ops, &reads)?;
        flags_of(&back[1])?;
        let mut entries = back[3..].iter();
        for (st, len) in steps.iter_mut().zip(&lens) {
            for lc in st.cache.layers.iter_mut() {
                lc.kv
                    .extend_from_slice(entries.next().expect("one read a layer"));
                lc.index_keys
                    .extend_from_slice(entries.next().expect("one read a layer"));
            }
            if let Some(d) = st.cache.device.0.as_mut() {
                d.valid += len;
            }
        }
        if !hidden {
            // (a draft is no step of the main model: `mtp_forward_hidden` counts none either)
            self.experts.step_end();
            self.steps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut back = back.into_iter();
        let normed = back.next().expect("the rows");
        let hidden = back.nth(1).expect("the rows before the norm");
        Ok((normed, hidden))
    }
}

impl Model {
    /// The router lookahead of the CPU pass (`layer_forward`) for layer `li` of `pass`, before
    /// its attention: an MoE layer's router on the residual stream normed by the layer's
    /// post-attention norm, handed to the executor as its lookahead; a layer without routed
    /// experts guesses at the next MoE layer of the pass the same way ([`Self::gpu_guess`]). The
    /// router runs on the device with the CPU's bits and its logits come back at once, so the
    /// executor gets the CPU pass's predictions and starts their reads while attention runs.
    /// Only while the executor wants predictions (a streaming store): the read-back is one more
    /// wait a layer.
    fn gpu_lookahead(
        &self,
        run: &mut Run<'_>,
        pass: &Pass<'_>,
        li: usize,
    ) -> Result<(), ForwardError> {
        let n = run.rows.n();
        let (layer, gl) = pass.layers[li];
        if !matches!(layer.ffn, FfnWeights::Moe { .. }) {
            if let Some((next, g)) = self.gpu_guess(run, pass, li) {
                let back = run.flush(&[g])?;
                self.hand_guess(next, &back[0], n);
            }
            return Ok(());
        }
        let Some(policy) = self.experts.lookahead() else {
            return Ok(());
        };
        let (f, lg) = (run.r.f, run.r.logits);
        // (the feed-forward's regions: the layer writes them again after attention)
        if let Some(read) = self.record_router(run, gl, f, lg) {
            let back = run.flush(&[read])?;
            let ids = self.route_rows(layer, &back[0]);
            self.hand_prediction(layer.index, &ids, n, policy, false);
        }
        Ok(())
    }

    /// The CPU pass's early guess after layer `li` of `pass` (before it, or after its attention,
    /// as the residual stream `x` stands): the next MoE layer of the pass routes `x`. Recorded
    /// into the attention input's and the guess's regions (free until the next layer); returns
    /// that layer and the read of its logits, `None` when no guess is wanted (more rows than the
    /// executor's policy guesses for, or no MoE layer follows).
    fn gpu_guess<'p>(
        &self,
        run: &mut Run<'_>,
        pass: &Pass<'p>,
        li: usize,
    ) -> Option<(&'p LayerWeights, (u32, usize))> {
        self.early_policy(run.rows.n())?;
        let &(next, gnext) = pass.layers[li + 1..]
            .iter()
            .find(|(l, _)| matches!(l.ffn, FfnWeights::Moe { .. }))?;
        let (a, g) = (run.r.a, run.r.guess);
        let read = self.record_router(run, gnext, a, g)?;
        Some((next, read))
    }

    /// Records MoE layer `gl`'s router on the residual stream normed by its post-attention norm
    /// (into `normed`), its logits into `logits`; returns the read of the logits.
    fn record_router(
        &self,
        run: &mut Run<'_>,
        gl: &super::GLayer,
        normed: u32,
        logits: u32,
    ) -> Option<(u32, usize)> {
        let GFfn::Moe { router, .. } = &gl.ffn else {
            return None;
        };
        let rs = self.spec.router.as_ref()?;
        let (n, h) = (run.rows.n(), self.spec.hidden_size);
        let (x, qx) = (run.r.x, run.r.qx);
        run.rec
            .rmsnorm(&gl.post_norm, x, n, h, normed, self.spec.rms_norm_eps);
        run.rec.linear(router, normed, n, logits, qx);
        Some((logits, n * rs.n_experts))
    }

    /// The experts MoE layer `layer` chooses from its router's `logits` (`[n, experts]`), as
    /// `route` picks them, `[n, top_k]`.
    fn route_rows(&self, layer: &LayerWeights, logits: &[f32]) -> Vec<u32> {
        let (
            FfnWeights::Moe {
                correction_bias, ..
            },
            Some(rs),
        ) = (&layer.ffn, self.spec.router.as_ref())
        else {
            return Vec::new();
        };
        route_logits(logits, correction_bias.as_deref(), rs)
            .into_iter()
            .flat_map(|r| r.ids)
            .collect()
    }

    /// Hands an early guess at MoE layer `next` (its router's `logits`) to the executor.
    fn hand_guess(&self, next: &LayerWeights, logits: &[f32], n: usize) {
        if let Some(policy) = self.early_policy(n) {
            let ids = self.route_rows(next, logits);
            self.hand_prediction(next.index, &ids, n, policy, true);
        }
    }
}

/// Each row's keys from key lists as the arena holds them: `stride` words a row, its count
/// then the keys, ascending (a count past the row is cut to it).
fn key_lists(words: &[f32], stride: usize) -> Selection {
    words
        .chunks_exact(stride)
        .map(|row| {
            let count = row[0].to_bits() as usize;
            row[1..=count.min(stride - 1)]
                .iter()
                .map(|k| k.to_bits())
                .collect()
        })
        .collect()
}

/// A draft's logits and the MTP layer's output states.
type DraftOut = (Vec<f32>, Vec<f32>);

/// What a GPU pass runs: decoder layers (the main model's, or the MTP layer), what its rows
/// start from, and the norm after the last layer.
struct Pass<'a> {
    layers: Vec<(&'a LayerWeights, &'a super::GLayer)>,
    input: Input<'a>,
    norm: &'a wgpu::Buffer,
}

/// Where a pass's rows start: the tokens' embeddings, or the MTP layer's input (the next tokens'
/// embeddings with the main model's final states).
enum Input<'a> {
    Embed,
    Mtp {
        main_normed: &'a [f32],
        g: &'a super::GMtp,
        embed: &'a charm_shared::linear::Linear,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use charm_shared::routing::top_k_set;
    use charm_worker::gpu::Gpu;

    /// `dsa_topk` against `top_k_set` on rows of ties, signed zeros, NaNs, infinities,
    /// subnormals and random bit patterns, with lists shorter and longer than `k`.
    #[test]
    fn the_device_top_k_is_top_k_set() {
        let gpu = match Gpu::open(None) {
            Ok(g) => g,
            Err(e) => {
                assert!(
                    std::env::var("CHARM_REQUIRE_GPU").as_deref() != Ok("1"),
                    "CHARM_REQUIRE_GPU=1 but no GPU opened: {e}"
                );
                eprintln!("no GPU here ({e}): skipped");
                return;
            }
        };
        let kernels = gpu.dense_kernels().unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 32) as u32
        };
        let pool = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            2.5,
            1e-40,
            -1e-40,
            3.0,
        ];
        for case in 0..40 {
            let ctx = 1 + (next() % 700) as usize;
            let n = 1 + (next() as usize % 4).min(ctx - 1);
            let pos0 = ctx - n;
            let topk = [1, 2, 8, 64, ctx / 2, ctx.saturating_sub(1), ctx, ctx + 3][case % 8].max(1);
            let scores: Vec<f32> = (0..n * ctx)
                .map(|_| match case % 3 {
                    0 => pool[next() as usize % pool.len()],
                    1 => f32::from_bits(next()),
                    _ => (next() % 5) as f32 - 2.0,
                })
                .collect();
            let keys = n * ctx;
            let arena = gpu
                .storage((keys + n * (ctx + 1)) as u64 * 4, "test")
                .unwrap();
            gpu.write(&arena, 0, &scores);
            let p = P {
                n,
                rows: topk,
                ctx,
                pos0,
                in0: 0,
                out0: keys as u32,
                ..Default::default()
            };
            let op = Dispatch {
                entry: "dsa_topk",
                w: None,
                kv: None,
                params: p.words(),
                groups: [n as u32, 1, 1],
            };
            let back = gpu
                .run_program(
                    &kernels,
                    &arena,
                    &[op],
                    &[(&arena, keys as u64, n * (ctx + 1))],
                )
                .unwrap();
            for (t, got) in key_lists(&back[0], ctx + 1).into_iter().enumerate() {
                let len = pos0 + t + 1;
                let want: Vec<u32> = top_k_set(&scores[t * ctx..t * ctx + len], topk)
                    .into_iter()
                    .map(|j| j as u32)
                    .collect();
                assert_eq!(
                    got, want,
                    "case {case}: row {t} of {n}, {len} keys, k {topk}"
                );
            }
        }
    }
}
