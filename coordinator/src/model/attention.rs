//! Two attention pieces of the forward pass apart from MLA: the DSA lightning indexer that picks
//! each query's keys, and grouped-query attention (Qwen3).

use charm_shared::config::GqaSpec;
use charm_shared::kernels::{axpy, dot, dots, layer_norm, rms_norm, softmax};
use charm_shared::linear::matmul_each;
use charm_shared::routing::top_k_set;

use crate::model::cache::LayerCache;
use crate::model::profile::{timed, Phase};
use crate::model::rope::RopeAt;
use crate::model::rows::{Rows, Selection};
use crate::model::{GqaWeights, IndexerWeights};

/// LayerNorm epsilon of the DSA indexer's key norm.
const INDEXER_KEY_EPS: f32 = 1e-6;

/// DSA lightning indexer: scores every causal key for each new query and keeps the top
/// `index_topk` (all causal keys when there are fewer). Ties, which arise when the ReLU zeroes
/// several scores, go to the lowest position. Appends this step's indexer keys to the cache.
#[allow(clippy::too_many_arguments)]
pub(super) fn indexer_select(
    w: &IndexerWeights,
    d: &charm_shared::config::DsaSpec,
    a: &[f32],
    q_resid: &[f32],
    rows: &Rows,
    rope: &[RopeAt],
    interleaved: bool,
    caches: &mut [&mut LayerCache],
) -> Selection {
    let n = rows.n();
    let (ih, ihd, rd) = (d.n_heads, d.head_dim, d.rope_dim);
    let mut k = w.wk.matmul(a, n); // [n, ihd]
    layer_norm(&mut k, &w.k_norm_w, &w.k_norm_b, INDEXER_KEY_EPS);
    for t in 0..n {
        rope[t].apply(&mut k[t * ihd..t * ihd + rd], interleaved);
    }
    for (c, span) in caches.iter_mut().zip(&rows.spans) {
        c.index_keys
            .extend_from_slice(&k[span.start * ihd..span.end * ihd]);
    }
    // Queries and head weights only score: a step whose every query sees no more than `topk`
    // keys keeps them all.
    if rows.pos.iter().all(|&p| p < d.topk) {
        return rows.pos.iter().map(|&p| (0..=p as u32).collect()).collect();
    }
    let mut q = w.wq_b.matmul(q_resid, n); // [n, ih * ihd]
    for t in 0..n {
        for hh in 0..ih {
            let o = (t * ih + hh) * ihd;
            rope[t].apply(&mut q[o..o + rd], interleaved);
        }
    }
    let hw = w.weights_proj.matmul(a, n); // [n, ih]
    let head_scale = (ih as f32).powf(-0.5);
    let sm = (ihd as f32).powf(-0.5);
    // per head, the terms of four keys (reused by every query)
    let mut terms = vec![[0.0f32; 4]; ih];
    (0..n)
        .map(|t| {
            let (p, cache) = (rows.pos[t], &*caches[rows.seq[t]]);
            if p < d.topk {
                return (0..=p as u32).collect();
            }
            let qh = |hh: usize| &q[(t * ih + hh) * ihd..(t * ih + hh + 1) * ihd];
            let term = |hh: usize, d: f32| hw[t * ih + hh] * head_scale * (d * sm).max(0.0);
            let key = |j: usize| &cache.index_keys[j * ihd..(j + 1) * ihd];
            // four keys at a time against each head (the same dot products), each key's head
            // terms summed in head order as one at a time
            let mut scores: Vec<f32> = Vec::with_capacity(p + 1);
            let full = (p + 1) / 4 * 4;
            for j0 in (0..full).step_by(4) {
                let ks: [&[f32]; 4] = std::array::from_fn(|i| key(j0 + i));
                for (hh, th) in terms.iter_mut().enumerate() {
                    let d = dots(ks, qh(hh));
                    *th = std::array::from_fn(|i| term(hh, d[i]));
                }
                for i in 0..4 {
                    scores.push(terms.iter().map(|th| th[i]).sum());
                }
            }
            for j in full..=p {
                scores.push((0..ih).map(|hh| term(hh, dot(qh(hh), key(j)))).sum());
            }
            top_k_set(&scores, d.topk)
                .into_iter()
                .map(|j| j as u32)
                .collect()
        })
        .collect()
}

/// Grouped-query attention with per-head q/k RMSNorm (Qwen3).
#[allow(clippy::too_many_arguments)]
pub(super) fn gqa(
    w: &GqaWeights,
    g: &GqaSpec,
    eps: f32,
    scale: f32,
    a: &[f32],
    rows: &Rows,
    rope: &[RopeAt],
    caches: &mut [&mut LayerCache],
) -> Vec<f32> {
    let n = rows.n();
    let (nh, nkv, hd) = (g.n_heads, g.n_kv_heads, g.head_dim);
    let add = |v: &mut Vec<f32>, b: &Option<Vec<f32>>| {
        if let Some(b) = b {
            for row in v.chunks_mut(b.len()) {
                for (x, y) in row.iter_mut().zip(b) {
                    *x += y;
                }
            }
        }
    };
    let [mut q, mut k, mut v] = timed(Phase::Projections, || matmul_each([&w.q, &w.k, &w.v], a, n));
    add(&mut q, &w.q_bias);
    add(&mut k, &w.k_bias);
    add(&mut v, &w.v_bias);
    if let Some(qn) = &w.q_norm {
        rms_norm(&mut q, qn, eps);
    }
    if let Some(kn) = &w.k_norm {
        rms_norm(&mut k, kn, eps);
    }
    for t in 0..n {
        for hh in 0..nh {
            rope[t].apply(&mut q[(t * nh + hh) * hd..(t * nh + hh + 1) * hd], false);
        }
        for hh in 0..nkv {
            rope[t].apply(&mut k[(t * nkv + hh) * hd..(t * nkv + hh + 1) * hd], false);
        }
        let cache = &mut caches[rows.seq[t]];
        cache
            .kv
            .extend_from_slice(&k[t * nkv * hd..(t + 1) * nkv * hd]);
        cache
            .kv
            .extend_from_slice(&v[t * nkv * hd..(t + 1) * nkv * hd]);
    }
    let group = nh / nkv;
    let out = timed(Phase::Attend, || {
        let mut out = vec![0.0f32; n * nh * hd];
        let mut scores = Vec::new();
        for t in 0..n {
            let (p, cache) = (rows.pos[t], &*caches[rows.seq[t]]);
            for hh in 0..nh {
                let kvh = hh / group;
                let qh = &q[(t * nh + hh) * hd..(t * nh + hh + 1) * hd];
                scores.clear();
                for j in 0..=p {
                    let e = cache.entry(j);
                    scores.push(dot(qh, &e[kvh * hd..(kvh + 1) * hd]) * scale);
                }
                softmax(&mut scores);
                let o = &mut out[(t * nh + hh) * hd..(t * nh + hh + 1) * hd];
                for (j, &pj) in scores.iter().enumerate() {
                    let e = cache.entry(j);
                    axpy(o, pj, &e[nkv * hd + kvh * hd..nkv * hd + (kvh + 1) * hd]);
                }
            }
        }
        out
    });
    timed(Phase::OutProjection, || w.o.matmul(&out, n))
}
