//! Two attention pieces of the forward pass apart from MLA: the DSA lightning indexer that picks
//! each query's keys, and grouped-query attention (Qwen3).

use charm_shared::config::GqaSpec;
use charm_shared::kernels::{key_dots, layer_norm, rms_norm, softmax, weighted_rows_heads};
use charm_shared::linear::matmul_each;
use charm_shared::routing::top_k_set;

use crate::model::cache::LayerCache;
use crate::model::profile::{timed, Phase};
use crate::model::rope::RopeAt;
use crate::model::rows::{Rows, Selection};
use crate::model::{GqaWeights, IndexerWeights};

/// LayerNorm epsilon of the DSA indexer's key norm.
const INDEXER_KEY_EPS: f32 = 1e-6;

/// Multiply-adds of one query's indexer scores from which its keys are split among the threads
/// (about 5 us of one thread's work, a few times a hand-off).
const INDEXER_PAR_MACS: usize = 1 << 17;

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
    (0..n)
        .map(|t| {
            let (p, cache) = (rows.pos[t], &*caches[rows.seq[t]]);
            if p < d.topk {
                return (0..=p as u32).collect();
            }
            let qs: Vec<&[f32]> = (0..ih)
                .map(|hh| &q[(t * ih + hh) * ihd..(t * ih + hh + 1) * ihd])
                .collect();
            let term = |hh: usize, d: f32| hw[t * ih + hh] * head_scale * (d * sm).max(0.0);
            let keys = &cache.index_keys[..(p + 1) * ihd];
            let split = (p + 1) * ih * ihd >= INDEXER_PAR_MACS;
            let scores = index_scores(&qs, keys, term, split);
            top_k_set(&scores, d.topk)
                .into_iter()
                .map(|j| j as u32)
                .collect()
        })
        .collect()
}

/// The indexer's score of each key in `keys` (`[keys, head_dim]`) for one query: its heads'
/// `term(head, q[head] . key)` summed in head order ([`key_dots`] for the products). With
/// `split`, the threads take ranges of keys: each score is its own, so the split changes no bit.
fn index_scores(
    qs: &[&[f32]],
    keys: &[f32],
    term: impl Fn(usize, f32) -> f32 + Sync,
    split: bool,
) -> Vec<f32> {
    let hd = qs.first().map_or(1, |q| q.len().max(1));
    // keys j0.. scored into out: their dot products with every head, then each key's terms
    let score_keys = |j0: usize, out: &mut [f32]| {
        let n = out.len();
        let mut d = vec![0.0f32; qs.len() * n]; // [heads, keys]
        key_dots(n, |j| &keys[(j0 + j) * hd..(j0 + j + 1) * hd], qs, &mut d);
        for (j, o) in out.iter_mut().enumerate() {
            *o = (0..qs.len()).map(|hh| term(hh, d[hh * n + j])).sum();
        }
    };
    let mut scores = vec![0.0f32; keys.len() / hd];
    let threads = charm_shared::par::threads();
    if split && threads > 1 {
        let per = scores.len().div_ceil(2 * threads).next_multiple_of(8);
        charm_shared::par::for_each_chunk_mut(&mut scores, per, |c, out| score_keys(c * per, out));
    } else {
        score_keys(0, &mut scores);
    }
    scores
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
        // Units of one query's heads that share a KV head run in parallel: each unit reads its
        // keys and values once for all its heads (`key_dots`: the same dot products;
        // `weighted_rows_heads`: the additions of `axpy` key after key), so every head keeps the
        // bits it has alone.
        let mut out = vec![0.0f32; n * nh * hd];
        charm_shared::par::for_each_chunk_mut(&mut out, group * hd, |u, og| {
            let (t, kvh) = (u / nkv, u % nkv);
            let (p, cache) = (rows.pos[t], &*caches[rows.seq[t]]);
            let qs: Vec<&[f32]> = (0..group)
                .map(|g| {
                    let hh = kvh * group + g;
                    &q[(t * nh + hh) * hd..(t * nh + hh + 1) * hd]
                })
                .collect();
            let key = |j: usize| &cache.entry(j)[kvh * hd..(kvh + 1) * hd];
            let value = |j: usize| &cache.entry(j)[(nkv + kvh) * hd..(nkv + kvh + 1) * hd];
            let nk = p + 1;
            let mut scores = vec![0.0f32; group * nk]; // [heads of the unit, keys]
            key_dots(nk, key, &qs, &mut scores);
            for s in &mut scores {
                *s *= scale;
            }
            for sg in scores.chunks_mut(nk) {
                softmax(sg);
            }
            let values: Vec<&[f32]> = (0..nk).map(value).collect();
            let ps: Vec<&[f32]> = scores.chunks(nk).collect();
            let mut os: Vec<&mut [f32]> = og.chunks_mut(hd).collect();
            weighted_rows_heads(&mut os, &ps, &values);
        });
        out
    });
    timed(Phase::OutProjection, || w.o.matmul(&out, n))
}

#[cfg(test)]
mod tests {
    use super::index_scores;
    use charm_shared::kernels::dot;

    /// Keys split among the threads, eight at a time or one by one: each score has the bits of
    /// its heads' terms summed in head order, one key at a time.
    #[test]
    fn index_scores_have_the_bits_of_one_key_at_a_time() {
        let val = |i: usize| ((i * 7919 % 1013) as f32 - 506.0) / 97.0;
        for (heads, hd, n) in [(1, 8, 5), (3, 13, 40), (8, 64, 203), (4, 16, 1000)] {
            let keys: Vec<f32> = (0..n * hd).map(|i| val(i + 11)).collect();
            let q: Vec<f32> = (0..heads * hd).map(|i| val(3 * i + 2)).collect();
            let qs: Vec<&[f32]> = q.chunks(hd).collect();
            let term = |h: usize, d: f32| (h as f32 - 1.5) * (d * 0.3).max(0.0);
            let want: Vec<u32> = (0..n)
                .map(|j| {
                    let k = &keys[j * hd..(j + 1) * hd];
                    let s: f32 = (0..heads).map(|h| term(h, dot(qs[h], k))).sum();
                    s.to_bits()
                })
                .collect();
            for split in [false, true] {
                let got: Vec<u32> = index_scores(&qs, &keys, term, split)
                    .iter()
                    .map(|s| s.to_bits())
                    .collect();
                assert_eq!(got, want, "{heads} heads of {hd}, {n} keys, split {split}");
            }
        }
    }
}
