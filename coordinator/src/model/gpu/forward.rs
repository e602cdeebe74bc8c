//! A forward step with the dense skeleton on the GPU: the same layers, in the same order, as
//! `model::forward`, each CPU kernel replaced by its GPU twin. One submission runs from one MoE
//! layer's routed experts to the next's: at each MoE layer the normed rows and the router's logits
//! come back, the CPU routes them and the model's executor computes the routed experts (RAM, a
//! streaming store, the VRAM tier or workers), and their sum goes back down.

use charm_shared::expert::ExpertBatch;
use charm_shared::quant::gpu::{nibble_block, KernelParams};
use charm_shared::routing::route;
use charm_worker::gpu::program::{flat_groups, grid, Dispatch, BLOCK_BYTES};
use charm_worker::gpu::GpuError;

use super::{DenseGpu, GFfn, GLinear, GSwiGlu, SeqKv};
use crate::model::forward::{ForwardError, Step, Trace};
use crate::model::rows::Rows;
use crate::model::{FfnWeights, Model};

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
        let p = P {
            n: rows,
            cols,
            in0: x,
            out0: out,
            eps,
            ..Default::default()
        };
        self.push("rmsnorm", Some(w), None, p, flat_groups(rows));
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

/// Word offsets of a step's activations in the arena.
struct Regions {
    x: u32,
    a: u32,
    q: u32,
    k: u32,
    v: u32,
    att: u32,
    o: u32,
    f: u32,
    logits: u32,
    g: u32,
    u: u32,
    h: u32,
    shared: u32,
    y: u32,
    scores: u32,
    cos: u32,
    sin: u32,
    qx: [u32; 3],
    /// One word a layer: set when the layer's output is not finite.
    flags: u32,
    end: usize,
}

impl DenseGpu {
    /// The step's regions for `n` rows whose queries see at most `ctx` keys.
    fn regions(&self, m: &Model, n: usize, ctx: usize) -> Regions {
        let spec = &m.spec;
        let h = spec.hidden_size;
        let (nh, nkv, hd) = gqa_shape(m);
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
        let widest = [h, nh * hd, inter].into_iter().max().unwrap_or(0);
        let half = spec.rope.dim / 2;
        let chunk = (SCORE_WORDS / (nh * ctx).max(1)).clamp(1, n.max(1));
        let mut at = 0usize;
        let mut take = |words: usize| {
            let o = at as u32;
            at += words.max(1);
            o
        };
        Regions {
            x: take(n * h),
            a: take(n * h),
            q: take(n * nh * hd),
            k: take(n * nkv * hd),
            v: take(n * nkv * hd),
            att: take(n * nh * hd),
            o: take(n * h),
            f: take(n * h),
            logits: take(n * experts),
            g: take(n * inter),
            u: take(n * inter),
            h: take(n * inter),
            shared: take(n * h),
            y: take(n * h),
            scores: take(chunk * nh * ctx),
            cos: take(n * half),
            sin: take(n * half),
            qx: [
                take(n * widest / 4),
                take(n * widest / 8),
                take(n * widest / 8),
            ],
            flags: take(spec.layers.len()),
            end: at,
        }
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
        let (h, vocab) = (self.head.cols, self.head.rows);
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
        rec.linear(&self.head, x, n, y, qx);
        let mut out = self.gpu.run_program(
            &self.kernels,
            &arena,
            &rec.ops,
            &[(&arena, y as u64, n * vocab)],
        )?;
        Ok(out.pop().unwrap_or_default())
    }
}

/// GQA's heads, KV heads and head size (zeros for MLA, which does not come here).
fn gqa_shape(m: &Model) -> (usize, usize, usize) {
    match &m.spec.attention {
        charm_shared::config::AttentionSpec::Gqa(g) => (g.n_heads, g.n_kv_heads, g.head_dim),
        charm_shared::config::AttentionSpec::Mla(_) => (0, 0, 0),
    }
}

impl Model {
    /// [`Model::forward_batch`] with the dense skeleton on `dg`'s GPU: the same rows, the same
    /// bits.
    pub(crate) fn forward_batch_gpu(
        &self,
        dg: &DenseGpu,
        steps: &mut [Step<'_>],
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ForwardError> {
        let spec = &self.spec;
        let h = spec.hidden_size;
        let (nh, nkv, hd) = gqa_shape(self);
        let width = 2 * nkv * hd;
        let half = spec.rope.dim / 2;
        if 2 * half != hd {
            return Err(ForwardError::Gpu(format!(
                "rotary dimension {} differs from the head size {hd}: partial rotary GQA does not run on the GPU",
                spec.rope.dim
            )));
        }
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
        let r = dg.regions(self, n, ctx);
        let arena = dg.arena(r.end)?;
        let gpu = &dg.gpu;

        // the caches' copies in VRAM, with room for this step
        let n_layers = self.layers.len();
        for s in steps.iter_mut() {
            let need = s.cache.len() + s.tokens.len();
            let dev = &mut s.cache.device.0;
            if dev.as_ref().is_none_or(|d| d.cap < need) {
                let cap = need.next_power_of_two().max(64);
                let words = n_layers * cap * width;
                let buf = gpu
                    .storage(words as u64 * 4, "KV cache")
                    .or_else(|_| gpu.storage((n_layers * need * width) as u64 * 4, "KV cache"))?;
                let cap = (buf.size() as usize / 4) / (n_layers * width).max(1);
                *dev = Some(SeqKv { buf, cap, valid: 0 });
            }
            let d = dev.as_mut().expect("made above");
            let have = s.cache.layers.first().map_or(0, |l| l.len());
            if d.valid < have {
                for (l, lc) in s.cache.layers.iter().enumerate() {
                    let at = (l * d.cap + d.valid) * width;
                    gpu.write(&d.buf, at as u64, &lc.kv[d.valid * width..have * width]);
                }
                d.valid = have;
            }
        }

        // embeddings and rotary tables
        let mut x = Vec::with_capacity(n * h);
        for (s, p0) in steps.iter().zip(&cached) {
            x.extend(self.embed_tokens(&self.embed, s.tokens, *p0)?);
        }
        gpu.write(&arena, r.x as u64, &x);
        let rope = self.rope_tables(&rows.pos);
        let cos: Vec<f32> = rope.iter().flat_map(|t| t.cos.iter().copied()).collect();
        let sin: Vec<f32> = rope.iter().flat_map(|t| t.sin.iter().copied()).collect();
        gpu.write(&arena, r.cos as u64, &cos);
        gpu.write(&arena, r.sin as u64, &sin);
        gpu.write(&arena, r.flags as u64, &vec![0.0; n_layers]);

        let eps = spec.rms_norm_eps;
        let mut rec = Rec::default();
        let flags_of = |v: &[f32]| -> Result<(), ForwardError> {
            match v.iter().position(|f| f.to_bits() != 0) {
                Some(li) => Err(ForwardError::NonFinite {
                    what: format!("the output of layer {li}"),
                }),
                None => Ok(()),
            }
        };
        for (li, (layer, gl)) in self.layers.iter().zip(&dg.layers).enumerate() {
            // --- attention ---
            rec.rmsnorm(&gl.input_norm, r.x, n, h, r.a, eps);
            let at = &gl.attn;
            for (lin, out, bias) in [
                (&at.q, r.q, &at.q_bias),
                (&at.k, r.k, &at.k_bias),
                (&at.v, r.v, &at.v_bias),
            ] {
                rec.linear(lin, r.a, n, out, r.qx);
                if let Some(b) = bias {
                    rec.add_bias(out, b, lin.rows, n * lin.rows);
                }
            }
            if let Some(qn) = &at.q_norm {
                rec.rmsnorm(qn, r.q, n * nh, hd, r.q, eps);
            }
            if let Some(kn) = &at.k_norm {
                rec.rmsnorm(kn, r.k, n * nkv, hd, r.k, eps);
            }
            for (reg, heads) in [(r.q, nh), (r.k, nkv)] {
                let p = P {
                    n,
                    heads,
                    cols: hd,
                    stride_in: heads * hd,
                    in0: reg,
                    in1: r.cos,
                    in2: r.sin,
                    half,
                    ..Default::default()
                };
                rec.push("rope", None, None, p, grid(heads, n, 1));
            }
            for (si, span) in rows.spans.iter().enumerate() {
                let len = span.len();
                if len == 0 {
                    continue;
                }
                let d = steps[si].cache.device.0.as_ref().expect("made above");
                let kv_base = li * d.cap * width;
                for (reg, off) in [(r.k, 0), (r.v, nkv * hd)] {
                    let p = P {
                        n: len,
                        cols: nkv * hd,
                        stride_in: nkv * hd,
                        in0: reg + (span.start * nkv * hd) as u32,
                        pos0: cached[si],
                        kv_width: width,
                        kv_off: off,
                        kv_base,
                        ..Default::default()
                    };
                    rec.push("to_kv", None, Some(&d.buf), p, grid(nkv * hd, len, 1));
                }
                let chunk = (SCORE_WORDS / (nh * ctx).max(1)).clamp(1, len);
                for c0 in (0..len).step_by(chunk) {
                    let m = chunk.min(len - c0);
                    let row0 = span.start + c0;
                    let base = P {
                        n: m,
                        heads: nh,
                        kv_heads: nkv,
                        head_dim: hd,
                        ctx,
                        kv_width: width,
                        v_off: nkv * hd,
                        pos0: cached[si] + c0,
                        kv_base,
                        scale: spec.softmax_scale,
                        ..Default::default()
                    };
                    let keys = cached[si] + c0 + m;
                    rec.push(
                        "gqa_scores",
                        None,
                        Some(&d.buf),
                        P {
                            in0: r.q + (row0 * nh * hd) as u32,
                            out0: r.scores,
                            ..base
                        },
                        grid(keys, nh, m),
                    );
                    rec.push(
                        "softmax",
                        None,
                        None,
                        P {
                            in0: r.scores,
                            ..base
                        },
                        grid(nh, m, 1),
                    );
                    rec.push(
                        "gqa_values",
                        None,
                        Some(&d.buf),
                        P {
                            in0: r.scores,
                            out0: r.att + (row0 * nh * hd) as u32,
                            ..base
                        },
                        grid(hd, nh, m),
                    );
                }
            }
            rec.linear(&at.o, r.att, n, r.o, r.qx);
            rec.add(r.x, r.o, n * h, r.x);
            // --- feed-forward ---
            rec.rmsnorm(&gl.post_norm, r.x, n, h, r.f, eps);
            match (&gl.ffn, &layer.ffn) {
                (GFfn::Dense(s), _) => {
                    rec.swiglu(s, r.f, n, r.y, &r);
                    rec.add(r.x, r.y, n * h, r.x);
                }
                (
                    GFfn::Moe { router, shared },
                    FfnWeights::Moe {
                        correction_bias, ..
                    },
                ) => {
                    let rs = spec.router.as_ref().expect("MoE model has a router spec");
                    let e = rs.n_experts;
                    rec.linear(router, r.f, n, r.logits, r.qx);
                    if let Some(s) = shared {
                        rec.swiglu(s, r.f, n, r.shared, &r);
                    }
                    let ops = std::mem::take(&mut rec.ops);
                    let back = gpu.run_program(
                        &dg.kernels,
                        &arena,
                        &ops,
                        &[
                            (&arena, r.f as u64, n * h),
                            (&arena, r.logits as u64, n * e),
                            (&arena, r.flags as u64, li),
                        ],
                    )?;
                    flags_of(&back[2])?;
                    let (f, logits) = (&back[0], &back[1]);
                    let k = rs.top_k;
                    let (mut ids, mut weights) =
                        (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
                    let mut picks = Vec::with_capacity(n);
                    for t in 0..n {
                        let rt = route(&logits[t * e..(t + 1) * e], correction_bias.as_deref(), rs);
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
                    gpu.write(&arena, r.y as u64, &y);
                    if shared.is_some() {
                        rec.add(r.y, r.shared, n * h, r.y);
                    }
                    rec.add(r.x, r.y, n * h, r.x);
                }
                _ => unreachable!("GPU layers are built from the model's"),
            }
            let p = P {
                n: n * h,
                in0: r.x,
                out0: r.flags + li as u32,
                ..Default::default()
            };
            rec.push("finite", None, None, p, flat_groups(n * h));
            if let Some(tr) = trace.as_deref_mut() {
                let ops = std::mem::take(&mut rec.ops);
                let back =
                    gpu.run_program(&dg.kernels, &arena, &ops, &[(&arena, r.x as u64, n * h)])?;
                tr.layer_out.extend(back);
            }
        }
        rec.rmsnorm(&dg.norm, r.x, n, h, r.x, eps);

        // the normed rows, the flags and every layer's new cache entries come back
        let mut reads: Vec<(&wgpu::Buffer, u64, usize)> = vec![
            (&arena, r.x as u64, n * h),
            (&arena, r.flags as u64, n_layers),
        ];
        for (s, span) in steps.iter().zip(&rows.spans) {
            let d = s.cache.device.0.as_ref().expect("made above");
            let p0 = s.cache.len();
            for l in 0..n_layers {
                reads.push((
                    &d.buf,
                    ((l * d.cap + p0) * width) as u64,
                    span.len() * width,
                ));
            }
        }
        let ops = std::mem::take(&mut rec.ops);
        let back = gpu.run_program(&dg.kernels, &arena, &ops, &reads)?;
        flags_of(&back[1])?;
        let mut entries = back[2..].iter();
        for (s, len) in steps.iter_mut().zip(&lens) {
            for lc in s.cache.layers.iter_mut() {
                lc.kv
                    .extend_from_slice(entries.next().expect("one read a layer"));
            }
            if let Some(d) = s.cache.device.0.as_mut() {
                d.valid += len;
            }
        }
        self.experts.step_end();
        self.steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(back.into_iter().next().expect("the rows"))
    }
}
