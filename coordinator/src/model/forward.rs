//! The forward pass: embeddings, decoder layers (MLA or GQA attention, optional DSA sparse
//! selection, dense or MoE feed-forward), final norm and head. One code path serves the
//! one-pass (empty cache) and cached-decode cases: new tokens are appended to the cache and
//! attend causally to everything cached.

use charm_shared::config::{AttentionSpec, IndexerKind, MlaSpec};
use charm_shared::expert::{ExpertBatch, ExpertError, LookaheadPolicy};
use charm_shared::kernels::{
    axpy, dot, dots, dots_heads, rms_norm, softmax, weighted_rows, weighted_rows_heads,
};
use charm_shared::linear::{matmul_each, Linear};
use charm_shared::routing::route;

use crate::model::attention::{gqa, indexer_select};
use crate::model::cache::{KvCache, LayerCache};
use crate::model::profile::{timed, Phase};
use crate::model::rope::RopeAt;
use crate::model::rows::{Rows, Selection};
use crate::model::{AttnWeights, FfnWeights, LayerWeights, MlaWeights, Model};

/// Router choices `ids` of `n` tokens (the same number per token, best first) reordered by rank:
/// every token's first choice, then every token's second, ... down to rank `ranks`.
fn by_rank(ids: &[u32], n: usize, ranks: usize) -> Vec<u32> {
    let k = ids.len() / n.max(1);
    if k == 0 {
        return Vec::new();
    }
    (0..ranks.min(k))
        .flat_map(|r| ids.chunks_exact(k).map(move |t| t[r]))
        .collect()
}

/// RMSNorm epsilon of MLA's `q_a_layernorm` / `kv_a_layernorm` (transformers builds them with the
/// default 1e-6, not `rms_norm_eps`).
const MLA_LATENT_EPS: f32 = 1e-6;

/// A forward pass could not run.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// A token id outside the vocabulary.
    #[error("token id {id} at position {pos} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    /// NaN or infinity appeared.
    #[error("non-finite values in {what}")]
    NonFinite { what: String },
    /// The routed-expert executor failed.
    #[error(transparent)]
    Expert(#[from] ExpertError),
    /// A DSA model without indexer weights asked for more context than dense attention matches.
    #[error("this checkpoint has no DSA indexer weights: attention equals the model's only up to index_topk = {limit} tokens, and {requested} were asked for")]
    NoIndexer { limit: usize, requested: usize },
    /// The model has no MTP layer.
    #[error("this model has no MTP layer")]
    NoMtp,
    /// Inputs whose sizes disagree.
    #[error("{0}")]
    Shape(String),
    /// The GPU running the dense skeleton failed or cannot run this step.
    #[error("dense forward on the GPU: {0}")]
    Gpu(String),
}

/// How MLA attention is evaluated. Both give the same result up to float rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlaMode {
    /// Expand every cached latent into per-head keys and values with `kv_b_proj` (the reference
    /// formulation).
    Naive,
    /// Absorb `kv_b_proj` into the query and the output: attention runs in latent space and the
    /// cache is never expanded (what decode wants).
    #[default]
    Absorbed,
    /// [`Self::Absorbed`] always in the layout a step of many queries takes, `kv_b_proj` read
    /// once per step for all of them; bit for bit the same as [`Self::Absorbed`].
    AbsorbedSplit,
}

/// Options of one forward call.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    pub mla: MlaMode,
}

/// Named intermediates of one forward call, for diffing against the oracle tensor by tensor.
#[derive(Debug, Default, Clone)]
pub struct Trace {
    /// Per decoder layer: `[n, hidden]` residual stream after the layer.
    pub layer_out: Vec<Vec<f32>>,
    /// Per MoE layer: per token, (expert ids, gate weights).
    pub router: Vec<Vec<(Vec<u32>, Vec<f32>)>>,
    /// Per `full` DSA layer: per query token, the selected key positions (ascending).
    pub dsa: Vec<Vec<Vec<u32>>>,
}

/// Each of `n` tokens' router choice: `router` (`[n_experts, hidden]`) on `f` (`[n, hidden]`).
fn route_tokens(
    router: &charm_shared::kernels::Matrix,
    bias: Option<&[f32]>,
    rs: &charm_shared::config::RouterSpec,
    f: &[f32],
    n: usize,
) -> Vec<charm_shared::routing::Route> {
    route_logits(&router.matmul(f, n), bias, rs) // [n, n_experts], f32
}

/// Each token's router choice from its logits (`[n, n_experts]`), on either device's logits.
pub(crate) fn route_logits(
    logits: &[f32],
    bias: Option<&[f32]>,
    rs: &charm_shared::config::RouterSpec,
) -> Vec<charm_shared::routing::Route> {
    logits
        .chunks_exact(rs.n_experts)
        .map(|l| route(l, bias, rs))
        .collect()
}

fn check_finite(v: &[f32], what: impl FnOnce() -> String) -> Result<(), ForwardError> {
    if v.iter().all(|x| x.is_finite()) {
        Ok(())
    } else {
        Err(ForwardError::NonFinite { what: what() })
    }
}

/// One sequence of a batched forward step: its new tokens and its KV cache.
#[derive(Debug)]
pub struct Step<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

impl Model {
    /// Runs `tokens` through the main model after what `cache` holds, appending to it.
    /// Returns the final-normed hidden states `[n, hidden]` (the input of the head).
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        opts: ForwardOptions,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ForwardError> {
        self.forward_batch(&mut [Step { tokens, cache }], opts, trace)
    }

    /// One forward step of several sequences at once, each after what its own cache holds
    /// (prefill chunks and single decode tokens alike). Every token-wise part (projections,
    /// router, routed and shared experts, norms) runs once over all rows, so each routed expert
    /// a layer needs is read and run once for the whole batch; attention reads each row's own
    /// cache. A row's values are exactly those it gets alone: every kernel computes a row the
    /// same way whatever else is in the batch. Returns the final-normed hidden states of all
    /// rows, `[total new tokens, hidden]`, sequence after sequence.
    pub fn forward_batch(
        &self,
        steps: &mut [Step<'_>],
        opts: ForwardOptions,
        mut trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>, ForwardError> {
        let spec = &self.spec;
        let h = spec.hidden_size;
        let lens: Vec<usize> = steps.iter().map(|s| s.tokens.len()).collect();
        let cached: Vec<usize> = steps.iter().map(|s| s.cache.len()).collect();
        if let Some(limit) = self.dense_attention_limit {
            if let Some(requested) = lens.iter().zip(&cached).map(|(n, p)| n + p).max() {
                if requested > limit {
                    return Err(ForwardError::NoIndexer { limit, requested });
                }
            }
        }
        if let Some(dg) = &self.dense_gpu {
            return self.forward_batch_gpu(dg, steps, opts, trace);
        }
        self.cpu_dense()?;
        let rows = Rows::new(&lens, &cached);
        let n = rows.n();
        let (x, rope) = timed(Phase::Embed, || -> Result<_, ForwardError> {
            let mut x = Vec::with_capacity(n * h);
            for (s, p0) in steps.iter().zip(&cached) {
                x.extend(self.embed_tokens(&self.embed, s.tokens, *p0)?);
            }
            // cos/sin of the new positions, shared by every layer
            Ok((x, self.rope_tables(&rows.pos)))
        })?;
        let mut x = x;
        let mut sel: Option<Selection> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let mut caches: Vec<&mut LayerCache> =
                steps.iter_mut().map(|s| &mut s.cache.layers[li]).collect();
            self.layer_forward(
                layer,
                &mut x,
                &rows,
                &mut caches,
                &mut sel,
                &rope,
                opts,
                trace.as_deref_mut(),
            )?;
            check_finite(&x, || format!("the output of layer {li}"))?;
            if let Some(t) = trace.as_deref_mut() {
                t.layer_out.push(x.clone());
            }
        }
        timed(Phase::FinalNorm, || {
            rms_norm(&mut x, &self.norm, spec.rms_norm_eps)
        });
        debug_assert_eq!(x.len(), n * h);
        self.experts.step_end();
        self.steps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(x)
    }

    /// RoPE tables for positions `pos`.
    pub(crate) fn rope_tables(&self, pos: &[usize]) -> Vec<RopeAt> {
        pos.iter()
            .map(|&p| RopeAt::new(&self.spec.rope, p))
            .collect()
    }

    /// `[n, hidden]` final-normed states -> `[n, vocab]` logits.
    pub fn logits(&self, normed: &[f32], n: usize) -> Result<Vec<f32>, ForwardError> {
        let l = match &self.dense_gpu {
            Some(dg) => dg.logits(normed, n)?,
            None => {
                self.cpu_dense()?;
                timed(Phase::Head, || {
                    self.lm_head
                        .as_ref()
                        .unwrap_or(&self.embed)
                        .matmul(normed, n)
                })
            }
        };
        check_finite(&l, || "the logits".into())?;
        Ok(l)
    }

    /// `Ok` while the dense weights' CPU copies are here ([`Model::release_cpu_dense`]).
    fn cpu_dense(&self) -> Result<(), ForwardError> {
        if self.cpu_dense_released {
            return Err(ForwardError::Gpu(
                "the dense weights live on the GPU only (their CPU copies were freed)".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn embed_tokens(
        &self,
        table: &Linear,
        tokens: &[u32],
        pos0: usize,
    ) -> Result<Vec<f32>, ForwardError> {
        let mut x = Vec::with_capacity(tokens.len() * table.cols());
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.spec.vocab_size {
                return Err(ForwardError::TokenOutOfRange {
                    id: t,
                    pos: pos0 + i,
                    vocab: self.spec.vocab_size,
                });
            }
            x.extend_from_slice(&table.row_f32(t as usize));
        }
        Ok(x)
    }

    /// MTP draft: slot `j` takes token `next_tokens[j]` (the token after position `pos0 + j`) and
    /// the main model's final-normed state at that position. Appends to `cache` (one layer).
    /// Returns `[n, vocab]` draft logits.
    pub fn mtp_forward(
        &self,
        next_tokens: &[u32],
        main_normed: &[f32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ForwardError> {
        self.mtp_forward_hidden(next_tokens, main_normed, cache)
            .map(|(l, _)| l)
    }

    /// [`Self::mtp_forward`], also returning the MTP layer's output states `[n, hidden]` (before
    /// its head norm): a chained draft feeds its own state where the main model's would go, as
    /// vLLM's MTP proposer does.
    pub fn mtp_forward_hidden(
        &self,
        next_tokens: &[u32],
        main_normed: &[f32],
        cache: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        let mtp = self.mtp.as_ref().ok_or(ForwardError::NoMtp)?;
        if let Some(dg) = &self.dense_gpu {
            if let Some(r) = self.mtp_forward_gpu(dg, next_tokens, main_normed, cache) {
                return r;
            }
        }
        let spec = &self.spec;
        let (h, n) = (spec.hidden_size, next_tokens.len());
        if main_normed.len() != n * h {
            return Err(ForwardError::Shape(format!(
                "mtp: {} hidden values for {n} tokens",
                main_normed.len()
            )));
        }
        let pos0 = cache.len();
        let mut e =
            self.embed_tokens(mtp.embed.as_ref().unwrap_or(&self.embed), next_tokens, pos0)?;
        if pos0 == 0 && n > 0 {
            e[..h].fill(0.0); // vLLM deepseek_mtp: the embedding at position 0 is masked
        }
        rms_norm(&mut e, &mtp.enorm, spec.rms_norm_eps);
        let mut hs = main_normed.to_vec();
        rms_norm(&mut hs, &mtp.hnorm, spec.rms_norm_eps);
        let mut cat = Vec::with_capacity(n * 2 * h);
        for t in 0..n {
            cat.extend_from_slice(&e[t * h..(t + 1) * h]);
            cat.extend_from_slice(&hs[t * h..(t + 1) * h]);
        }
        let mut x = mtp.eh_proj.matmul(&cat, n); // [n, hidden]
        let mut sel = None;
        let rows = Rows::new(&[n], &[pos0]);
        let rope = self.rope_tables(&rows.pos);
        self.layer_forward(
            &mtp.layer,
            &mut x,
            &rows,
            &mut [&mut cache.layers[0]],
            &mut sel,
            &rope,
            ForwardOptions::default(),
            None,
        )?;
        let hidden = x.clone();
        rms_norm(&mut x, &mtp.head_norm, spec.rms_norm_eps);
        let head = mtp
            .head
            .as_ref()
            .or(self.lm_head.as_ref())
            .unwrap_or(&self.embed);
        let l = head.matmul(&x, n);
        check_finite(&l, || "the MTP logits".into())?;
        Ok((l, hidden))
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        layer: &LayerWeights,
        x: &mut [f32],
        rows: &Rows,
        caches: &mut [&mut LayerCache],
        sel: &mut Option<Selection>,
        rope: &[RopeAt],
        opts: ForwardOptions,
        mut trace: Option<&mut Trace>,
    ) -> Result<(), ForwardError> {
        let spec = &self.spec;
        let hd = spec.hidden_size;
        let n = rows.n();
        // Router lookahead: this layer's router on its input (normed as its feed-forward input
        // will be) predicts its experts before attention runs, so a streaming store reads them
        // while attention computes.
        timed(Phase::Lookahead, || {
            if let Some((ids, policy)) = self.predict_experts(layer, x, n) {
                self.hand_prediction(layer.index, &ids, n, policy, false);
            } else {
                // a dense layer: guess at the next MoE layer already (read while the disk idles)
                self.guess_next_moe(layer, x, n);
            }
        });
        // --- attention ---
        let attn_out = timed(Phase::Attention, || {
            let mut a = x.to_vec(); // [n, hidden]
            rms_norm(&mut a, &layer.input_norm, spec.rms_norm_eps);
            match (&layer.attn, &spec.attention) {
                (AttnWeights::Mla(w), AttentionSpec::Mla(m)) => self.mla(
                    w,
                    m,
                    layer,
                    &a,
                    rows,
                    rope,
                    caches,
                    sel,
                    opts,
                    trace.as_deref_mut(),
                ),
                (AttnWeights::Gqa(w), AttentionSpec::Gqa(g)) => gqa(
                    w,
                    g,
                    spec.rms_norm_eps,
                    spec.softmax_scale,
                    &a,
                    rows,
                    rope,
                    caches,
                ),
                _ => unreachable!("weights are loaded from the spec"),
            }
        });
        timed(Phase::Residual, || {
            for (xi, ai) in x.iter_mut().zip(&attn_out) {
                *xi += ai;
            }
        });
        timed(Phase::Lookahead, || self.guess_next_moe(layer, x, n));
        // --- feed-forward ---
        let f = timed(Phase::Route, || {
            let mut f = x.to_vec();
            rms_norm(&mut f, &layer.post_norm, spec.rms_norm_eps);
            f
        });
        let out = match &layer.ffn {
            FfnWeights::Dense(mlp) => timed(Phase::Shared, || mlp.forward(&f, n)),
            FfnWeights::Moe {
                router,
                correction_bias,
                shared,
            } => {
                let rs = spec.router.as_ref().expect("MoE model has a router spec");
                let k = rs.top_k;
                let routes = timed(Phase::Route, || {
                    route_tokens(router, correction_bias.as_deref(), rs, &f, n)
                });
                let (mut ids, mut weights) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
                let mut picks = Vec::with_capacity(n);
                for r in routes {
                    ids.extend_from_slice(&r.ids);
                    weights.extend_from_slice(&r.weights);
                    picks.push((r.ids, r.weights));
                }
                if let Some(tr) = trace {
                    tr.router.push(picks);
                }
                self.expert_use.add(layer.index, &ids);
                // Routed experts start first (they may run elsewhere); the shared expert
                // computes meanwhile (in process: beside the experts, in their parallel loop)
                // and is added after their sum, in that order everywhere.
                let batch = ExpertBatch {
                    step: self.steps.load(std::sync::atomic::Ordering::Relaxed),
                    layer: layer.index,
                    x: &f,
                    n_tokens: n,
                    ids: &ids,
                    weights: &weights,
                    top_k: k,
                };
                let (routed, shared_y) = match shared {
                    Some(s) => {
                        let local = || s.forward(&f, n);
                        let (p, y) =
                            timed(Phase::Routed, || self.experts.start_beside(batch, &local));
                        (p, Some(y))
                    }
                    None => (timed(Phase::Routed, || self.experts.start(batch)), None),
                };
                let mut y = timed(Phase::Routed, || routed.wait())?;
                timed(Phase::Residual, || {
                    if let Some(sy) = shared_y {
                        for (a, b) in y.iter_mut().zip(sy) {
                            *a += b;
                        }
                    }
                });
                y
            }
        };
        debug_assert_eq!(out.len(), n * hd);
        timed(Phase::Residual, || {
            for (xi, oi) in x.iter_mut().zip(&out) {
                *xi += oi;
            }
        });
        Ok(())
    }

    /// Hands the executor the experts predicted for MoE layer `layer` (`ids`, `[n, k]`): its
    /// lookahead (the first `sure_ranks` of each token read for sure), or with `early` a guess a
    /// layer or more ahead, read only while the disk would otherwise idle. Both by rank: every
    /// token's first choice, then every token's second, ...
    pub(crate) fn hand_prediction(
        &self,
        layer: usize,
        ids: &[u32],
        n: usize,
        policy: LookaheadPolicy,
        early: bool,
    ) {
        let k = ids.len() / n.max(1);
        if early {
            self.experts
                .prefetch_early(layer, &by_rank(ids, n, policy.early_ranks(k)));
        } else {
            self.experts.prefetch(
                layer,
                &by_rank(ids, n, usize::MAX),
                n * policy.sure_ranks(k),
            );
        }
    }

    /// Whether a layer without routed experts guesses at the next MoE layer's for `n` rows: the
    /// executor's policy, when it wants predictions at all.
    pub(crate) fn early_policy(&self, n: usize) -> Option<LookaheadPolicy> {
        self.experts.lookahead().filter(|p| n <= p.early_max_tokens)
    }

    /// An early guess at the experts of the next MoE layer after `layer`: its router on `x`, the
    /// residual stream a layer or more before it, read by a streaming store only while its disk
    /// would otherwise idle (between this layer's reads and that layer's own lookahead).
    fn guess_next_moe(&self, layer: &LayerWeights, x: &[f32], n: usize) {
        if self.early_policy(n).is_none() {
            return;
        }
        let Some(next) = self
            .layers
            .iter()
            .find(|l| l.index > layer.index && matches!(l.ffn, FfnWeights::Moe { .. }))
        else {
            return;
        };
        if let Some((ids, policy)) = self.predict_experts(next, x, n) {
            self.hand_prediction(next.index, &ids, n, policy, true);
        }
    }

    /// The experts MoE layer `layer` will probably choose for the residual stream `x`: its router
    /// on `x` normed by its post-attention norm (attention's update is not yet added), with the
    /// executor's policy for them. `None` for dense layers or when the executor wants no
    /// predictions (every expert in RAM).
    fn predict_experts(
        &self,
        layer: &LayerWeights,
        x: &[f32],
        n: usize,
    ) -> Option<(Vec<u32>, LookaheadPolicy)> {
        let policy = self.experts.lookahead()?;
        let FfnWeights::Moe {
            router,
            correction_bias,
            ..
        } = &layer.ffn
        else {
            return None;
        };
        let rs = self.spec.router.as_ref()?;
        let mut f = x.to_vec();
        rms_norm(&mut f, &layer.post_norm, self.spec.rms_norm_eps);
        let ids = route_tokens(router, correction_bias.as_deref(), rs, &f, n)
            .into_iter()
            .flat_map(|r| r.ids)
            .collect();
        Some((ids, policy))
    }

    /// Multi-head latent attention over the cache (with optional DSA selection).
    #[allow(clippy::too_many_arguments)]
    fn mla(
        &self,
        w: &MlaWeights,
        m: &MlaSpec,
        layer: &LayerWeights,
        a: &[f32],
        rows: &Rows,
        rope: &[RopeAt],
        caches: &mut [&mut LayerCache],
        sel: &mut Option<Selection>,
        opts: ForwardOptions,
        trace: Option<&mut Trace>,
    ) -> Vec<f32> {
        let spec = &self.spec;
        let n = rows.n();
        let (nh, nope, rd, vd, kvr) = (
            m.n_heads,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let qkd = m.qk_head_dim();
        let interleaved = spec.rope.interleaved;
        // Queries: [n, heads * (nope + rope)]
        // The query latent and the key latent read the same input: side by side where they are
        // small.
        let (mut q, q_resid, mut ckv) = match (&w.q_a, &w.q_a_norm) {
            (Some(qa), Some(qn)) => {
                // r: [n, q_lora_rank]
                let [mut r, ckv] = timed(Phase::Projections, || matmul_each([qa, &w.kv_a], a, n));
                rms_norm(&mut r, qn, MLA_LATENT_EPS);
                (
                    timed(Phase::Projections, || w.q_b.matmul(&r, n)),
                    Some(r),
                    ckv,
                )
            }
            _ => {
                let [q, ckv] = timed(Phase::Projections, || matmul_each([&w.q_b, &w.kv_a], a, n));
                (q, None, ckv)
            }
        };
        for t in 0..n {
            for hh in 0..nh {
                let o = t * nh * qkd + hh * qkd + nope;
                rope[t].apply(&mut q[o..o + rd], interleaved);
            }
        }
        // Latent + rope key, appended to the cache: [n, kvr + rope]
        for t in 0..n {
            let e = &mut ckv[t * (kvr + rd)..(t + 1) * (kvr + rd)];
            rms_norm(&mut e[..kvr], &w.kv_a_norm, MLA_LATENT_EPS);
            rope[t].apply(&mut e[kvr..], interleaved);
        }
        for (c, span) in caches.iter_mut().zip(&rows.spans) {
            c.kv.extend_from_slice(&ckv[span.start * (kvr + rd)..span.end * (kvr + rd)]);
        }

        // DSA: this layer's own selection, or the previous full layer's.
        if let (Some(kind), Some(dsa)) = (layer.indexer_kind, &spec.dsa) {
            // `shared` layers reuse `sel` (dense causal attention if no full layer ran before).
            if let (IndexerKind::Full, Some(iw), Some(qr)) =
                (kind, &layer.indexer, q_resid.as_ref())
            {
                let s = timed(Phase::Indexer, || {
                    indexer_select(iw, dsa, a, qr, rows, rope, interleaved, caches)
                });
                if let Some(tr) = trace {
                    tr.dsa.push(s.clone());
                }
                *sel = Some(s);
            }
        }
        let sel = sel.as_ref();
        let out = timed(Phase::Attend, || {
            let scale = spec.softmax_scale;
            let mut out = vec![0.0f32; n * nh * vd];
            let caches: Vec<&LayerCache> = caches.iter().map(|c| &**c).collect();
            // Naive: expand each sequence's cached latents once into per-head keys/values
            // [cached, heads*(nope+v)].
            let expanded: Vec<Option<Vec<f32>>> = caches
                .iter()
                .map(|cache| {
                    (opts.mla == MlaMode::Naive).then(|| {
                        let total = cache.len();
                        let lat: Vec<f32> = (0..total)
                            .flat_map(|j| cache.entry(j)[..kvr].to_vec())
                            .collect();
                        // the reference formulation, on the f32 values
                        match &w.kv_b {
                            Linear::F32(m) => m.matmul(&lat, total),
                            q => q.to_f32().matmul(&lat, total),
                        }
                    })
                })
                .collect();
            let stride = nope + vd;
            // Units of `g` heads of one query run in parallel: enough units to share among the
            // threads, and each unit reads its query's cached latents once for all its heads. Every
            // (query, head) pair keeps the arithmetic it has alone, so no split changes a bit.
            let g = if n >= 8 {
                nh
            } else {
                (1..=4).rev().find(|d| nh % d == 0).unwrap_or(1)
            };
            let qh = |t: usize, hh: usize| {
                let qh = &q[t * nh * qkd + hh * qkd..t * nh * qkd + (hh + 1) * qkd];
                qh.split_at(nope)
            };
            let keys_of = |t: usize| -> Vec<usize> {
                match sel {
                    Some(s) => s[t].iter().map(|&j| j as usize).collect(),
                    None => (0..=rows.pos[t]).collect(),
                }
            };
            if opts.mla == MlaMode::Naive {
                charm_shared::par::for_each_chunk_mut(&mut out, vd * g, |u, og| {
                    let (t, h0) = ((u * g) / nh, (u * g) % nh);
                    let cache = caches[rows.seq[t]];
                    let kv = expanded[rows.seq[t]].as_ref().expect("naive mode expands");
                    let keys = keys_of(t);
                    for (k, o) in og.chunks_mut(vd).enumerate() {
                        let hh = h0 + k;
                        let (q_nope, q_rope) = qh(t, hh);
                        let mut scores = Vec::with_capacity(keys.len());
                        for &j in &keys {
                            let kvj = &kv[j * nh * stride + hh * stride..];
                            let s = dot(q_nope, &kvj[..nope]) + dot(q_rope, &cache.entry(j)[kvr..]);
                            scores.push(s * scale);
                        }
                        softmax(&mut scores);
                        for (&j, &pj) in keys.iter().zip(&scores) {
                            let vj = &kv[j * nh * stride + hh * stride + nope
                                ..j * nh * stride + hh * stride + stride];
                            axpy(o, pj, vj);
                        }
                    }
                });
                return out;
            }

            // Absorbed: attention runs in latent space, `W_uk` folded into the queries and `W_uv`
            // applied to each head's latent context. Every (query, head) pair has the same
            // arithmetic in both layouts below.
            // Each unit reads its heads' rows of `kv_b` (heads x (nope + v) x latent, as stored):
            // once per query. A step of several queries splits instead (below) where that would
            // decode quantized rows again for every further query, or re-read more than a few
            // passes over the units cost.
            let rereads = (n - 1) * w.kv_b.bytes();
            let per_query =
                n == 1 || (matches!(w.kv_b, Linear::F32(_)) && rereads < ABSORB_SPLIT_BYTES);
            if opts.mla == MlaMode::Absorbed && per_query {
                charm_shared::par::for_each_chunk_mut(&mut out, vd * g, |u, og| {
                    let (t, h0) = ((u * g) / nh, (u * g) % nh);
                    let mut q_abs = vec![0.0f32; g * kvr];
                    for (k, qa) in q_abs.chunks_mut(kvr).enumerate() {
                        absorb_queries(&w.kv_b, (h0 + k) * stride, &[qh(t, h0 + k).0], qa);
                    }
                    let q_abs: Vec<&[f32]> = q_abs.chunks(kvr).collect();
                    let q_rope: Vec<&[f32]> = (0..g).map(|k| qh(t, h0 + k).1).collect();
                    let mut ctx = vec![0.0f32; g * kvr];
                    let cache = caches[rows.seq[t]];
                    attend_latent(cache, &keys_of(t), scale, &q_abs, &q_rope, &mut ctx);
                    for (k, (o, c)) in og.chunks_mut(vd).zip(ctx.chunks(kvr)).enumerate() {
                        project_values(&w.kv_b, (h0 + k) * stride + nope, &[c], &mut [o]);
                    }
                });
                return out;
            }
            // Split: `kv_b` read once per step for all the queries (a verify step, a batch), head
            // by head, in three parallel passes.
            // q_abs[h][t] = q_nope[t][h] x W_uk[h]
            let mut q_abs = vec![0.0f32; nh * n * kvr];
            charm_shared::par::for_each_chunk_mut(&mut q_abs, n * kvr, |hh, qa| {
                let qs: Vec<&[f32]> = (0..n).map(|t| qh(t, hh).0).collect();
                absorb_queries(&w.kv_b, hh * stride, &qs, qa);
            });
            // ctx[t][h]: units of `g` heads of one query, as above
            let mut ctx = vec![0.0f32; n * nh * kvr];
            charm_shared::par::for_each_chunk_mut(&mut ctx, kvr * g, |u, cg| {
                let (t, h0) = ((u * g) / nh, (u * g) % nh);
                let qa: Vec<&[f32]> = (h0..h0 + g)
                    .map(|hh| &q_abs[(hh * n + t) * kvr..(hh * n + t + 1) * kvr])
                    .collect();
                let q_rope: Vec<&[f32]> = (h0..h0 + g).map(|hh| qh(t, hh).1).collect();
                attend_latent(caches[rows.seq[t]], &keys_of(t), scale, &qa, &q_rope, cg);
            });
            // out[t][h] = W_uv[h] ctx[t][h], head by head, then back to [n, heads * v]
            let mut by_head = vec![0.0f32; nh * n * vd];
            charm_shared::par::for_each_chunk_mut(&mut by_head, n * vd, |hh, oh| {
                let cs: Vec<&[f32]> = (0..n)
                    .map(|t| &ctx[(t * nh + hh) * kvr..(t * nh + hh + 1) * kvr])
                    .collect();
                let mut os: Vec<&mut [f32]> = oh.chunks_mut(vd).collect();
                project_values(&w.kv_b, hh * stride + nope, &cs, &mut os);
            });
            for (t, o) in out.chunks_mut(nh * vd).enumerate() {
                for (hh, oh) in o.chunks_mut(vd).enumerate() {
                    oh.copy_from_slice(&by_head[(hh * n + t) * vd..(hh * n + t + 1) * vd]);
                }
            }
            out
        });
        timed(Phase::OutProjection, || w.o.matmul(&out, n))
    }
}

/// Bytes of an f32 `kv_b` that a step's further queries would re-read, from which absorbed
/// attention runs in three passes that read it once. Below it the two extra passes' hand-offs
/// cost more than the re-reads (f32 rows are read as they are). Quantized rows split from two
/// queries on: decoding them again per query costs more than the hand-offs (the yardstick's
/// 0.26 MB int8 `kv_b`: 0.2-0.35 ms less attention per step of 2-4 tokens, 5 layers; GLM-5.2's
/// is 14.7 MB a layer at int8).
const ABSORB_SPLIT_BYTES: usize = 1 << 20;

/// Absorbed MLA, `W_uk` folded into queries: `out[t][c] = sum_d q[t][d] * kv_b[first + d][c]`,
/// `d` in order for every query, each row of `kv_b` read once for all of them. Rows are decoded
/// [`ABSORB_ROWS`] at a time and added to up to four queries' outputs per pass
/// ([`weighted_rows`]: each output element loaded and stored once per block instead of once per
/// row), with the additions of one row after another, as `axpy` row by row makes them.
fn absorb_queries(kv_b: &Linear, first: usize, q: &[&[f32]], out: &mut [f32]) {
    let kvr = kv_b.cols();
    let nope = q.first().map_or(0, |q| q.len());
    let mut buf = vec![0.0f32; ABSORB_ROWS * kvr];
    for d0 in (0..nope).step_by(ABSORB_ROWS) {
        let b = ABSORB_ROWS.min(nope - d0);
        let rows: Vec<&[f32]> = buf
            .chunks_exact_mut(kvr)
            .take(b)
            .enumerate()
            .map(|(i, chunk)| kv_b.row_into(first + d0 + i, chunk))
            .collect();
        let mut outs: Vec<&mut [f32]> = out.chunks_mut(kvr).collect();
        for (o4, q4) in outs.chunks_mut(4).zip(q.chunks(4)) {
            let p = |i: usize| &q4[i][d0..d0 + b];
            match o4 {
                [a, b_, c, d] => weighted_rows(
                    [a, b_, c, d].map(|x| &mut **x),
                    [p(0), p(1), p(2), p(3)],
                    &rows,
                ),
                [a, b_, c] => {
                    weighted_rows([a, b_, c].map(|x| &mut **x), [p(0), p(1), p(2)], &rows)
                }
                [a, b_] => weighted_rows([a, b_].map(|x| &mut **x), [p(0), p(1)], &rows),
                [a] => weighted_rows([&mut **a], [p(0)], &rows),
                _ => unreachable!("chunks of one to four"),
            }
        }
    }
}

/// Rows of `kv_b` [`absorb_queries`] decodes per block (64 KiB of f32 at GLM-5.2's latent rank).
const ABSORB_ROWS: usize = 32;

/// One query's attention for several heads in latent space: per head, scores against each key's
/// latent (`q_abs`) and rotary part (`q_rope`), softmax, then `ctx[head] = sum over keys, in
/// order, of p[j] * latent[j]` (`ctx`: `[heads, latent]`).
fn attend_latent(
    cache: &LayerCache,
    keys: &[usize],
    scale: f32,
    q_abs: &[&[f32]],
    q_rope: &[&[f32]],
    ctx: &mut [f32],
) {
    let kvr = ctx.len() / q_abs.len().max(1);
    let mut scores = vec![Vec::with_capacity(keys.len()); q_abs.len()];
    // eight keys at a time (the same dot products, interleaved), every head against each cached
    // entry while it is in L1
    let (mut lat, mut rot) = (
        vec![[0.0f32; 8]; q_abs.len()],
        vec![[0.0f32; 8]; q_abs.len()],
    );
    let mut kc = keys.chunks_exact(8);
    for k8 in &mut kc {
        let e: [&[f32]; 8] = std::array::from_fn(|i| cache.entry(k8[i]));
        dots_heads(e.map(|e| &e[..kvr]), q_abs, &mut lat);
        dots_heads(e.map(|e| &e[kvr..]), q_rope, &mut rot);
        for (sk, (l, r)) in scores.iter_mut().zip(lat.iter().zip(&rot)) {
            sk.extend((0..8).map(|i| (l[i] + r[i]) * scale));
        }
    }
    for &j in kc.remainder() {
        let e = cache.entry(j);
        for (k, sk) in scores.iter_mut().enumerate() {
            let s = dot(q_abs[k], &e[..kvr]) + dot(q_rope[k], &e[kvr..]);
            sk.push(s * scale);
        }
    }
    for sk in &mut scores {
        softmax(sk);
    }
    let lats: Vec<&[f32]> = keys.iter().map(|&j| &cache.entry(j)[..kvr]).collect();
    let mut cs: Vec<&mut [f32]> = ctx.chunks_mut(kvr).collect();
    let ps: Vec<&[f32]> = scores.iter().map(|s| &s[..]).collect();
    weighted_rows_heads(&mut cs, &ps, &lats);
}

/// `W_uv` applied to latent contexts: `out[t][i] = kv_b[first + i] . ctx[t]`, eight rows of
/// `kv_b` at a time, each read once for all the contexts.
fn project_values(kv_b: &Linear, first: usize, ctx: &[&[f32]], out: &mut [&mut [f32]]) {
    let (vd, kvr) = (out.first().map_or(0, |o| o.len()), kv_b.cols());
    let full = vd - vd % 8;
    let mut buf = vec![0.0f32; 8 * kvr];
    for c in (0..full).step_by(8) {
        let mut bufs = buf.chunks_exact_mut(kvr);
        let rows: [&[f32]; 8] = std::array::from_fn(|i| {
            kv_b.row_into(first + c + i, bufs.next().expect("eight buffers"))
        });
        for (cx, o) in ctx.iter().zip(out.iter_mut()) {
            o[c..c + 8].copy_from_slice(&dots(rows, cx));
        }
    }
    for d in full..vd {
        let row = kv_b.row_into(first + d, &mut buf[..kvr]);
        for (cx, o) in ctx.iter().zip(out.iter_mut()) {
            o[d] = dot(row, cx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{absorb_queries, by_rank};
    use charm_shared::kernels::{axpy, Matrix};
    use charm_shared::linear::Linear;
    use charm_shared::quant::{QMatrix, QuantKind};

    #[test]
    fn absorbed_queries_have_the_bits_of_one_row_at_a_time() {
        // 2 heads of 40 rows (a block of 32 and a tail) over a latent of 72 (AVX2 tail too)
        let (rows, kvr, nope) = (80, 72, 40);
        let val = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 97.0;
        let m = Matrix::new(rows, kvr, (0..rows * kvr).map(val).collect());
        let int8 = Linear::Quant(QMatrix::quantize(&m, QuantKind::Int8, 8).unwrap());
        for kv_b in [Linear::F32(m), int8] {
            for n in 1..=6 {
                let q: Vec<Vec<f32>> = (0..n)
                    .map(|t| (0..nope).map(|d| val(31 * t + d + 5) / 3.0).collect())
                    .collect();
                let q: Vec<&[f32]> = q.iter().map(|v| &v[..]).collect();
                for first in [0, nope] {
                    let mut got = vec![0.0f32; n * kvr];
                    absorb_queries(&kv_b, first, &q, &mut got);
                    let mut want = vec![0.0f32; n * kvr];
                    let mut buf = vec![0.0f32; kvr];
                    for d in 0..nope {
                        let row = kv_b.row_into(first + d, &mut buf);
                        for (qt, o) in q.iter().zip(want.chunks_mut(kvr)) {
                            axpy(o, qt[d], row);
                        }
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "n={n} first={first}");
                }
            }
        }
    }

    #[test]
    fn predictions_are_queued_by_rank_across_tokens() {
        // two tokens, top-3 each, best first
        let ids = [7, 2, 9, 4, 7, 1];
        assert_eq!(by_rank(&ids, 2, 3), vec![7, 4, 2, 7, 9, 1]);
        assert_eq!(by_rank(&ids, 2, 1), vec![7, 4]);
        assert_eq!(by_rank(&ids, 2, usize::MAX), vec![7, 4, 2, 7, 9, 1]);
        assert!(by_rank(&[], 1, 2).is_empty());
    }
}
