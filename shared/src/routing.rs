//! Routing maths: router logits in, chosen experts and gate weights out. Pure, no I/O.
//!
//! Ties are broken towards the lower expert (or group) index, so every implementation of charm
//! (coordinator, tests, a future GPU path) makes the same choice.

use crate::config::{RouterSpec, Scoring};

/// The experts one token is sent to, with their gate weights (already normalised and scaled).
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Chosen expert ids, in descending order of selection score.
    pub ids: Vec<u32>,
    /// Gate weight of each chosen expert.
    pub weights: Vec<f32>,
}

/// Indices of the `k` largest values (ties to the lower index), in descending order of value.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx = top_k_set(values, k);
    idx.sort_by(rank_order(values));
    idx
}

/// The indices [`top_k`] returns, in ascending index order (no ranking among them needed).
///
/// Each index is packed with its value into one integer key whose order is [`rank_order`]'s
/// (value first, then the lower index), so the selection compares plain integers in one array
/// rather than values reached through indices: the DSA indexer runs it over every cached
/// position, for every query of every indexed layer.
pub fn top_k_set(values: &[f32], k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    if k >= values.len() {
        return (0..values.len()).collect();
    }
    if values.len() > u32::MAX as usize {
        let mut idx: Vec<usize> = (0..values.len()).collect();
        idx.select_nth_unstable_by(k - 1, rank_order(values));
        idx.truncate(k);
        idx.sort_unstable();
        return idx;
    }
    let mut keys: Vec<u64> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| (u64::from(rank_bits(v)) << 32) | u64::from(!(i as u32)))
        .collect();
    // the k largest keys: the k best values, ties to the lower index
    let n = keys.len();
    keys.select_nth_unstable(n - k);
    let mut idx: Vec<usize> = keys[n - k..]
        .iter()
        .map(|&key| !(key as u32) as usize)
        .collect();
    idx.sort_unstable();
    idx
}

/// An integer in the values' order, with NaN as negative infinity and -0.0 equal to 0.0: the
/// order [`top_k`] and [`top_k_set`] rank by.
fn rank_bits(v: f32) -> u32 {
    let v = if v.is_nan() {
        f32::NEG_INFINITY
    } else if v == 0.0 {
        0.0
    } else {
        v
    };
    let b = v.to_bits();
    // negative values: every bit flipped (larger magnitude, smaller key); positive: the sign
    // bit set, above every negative
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

/// Largest first (by [`rank_bits`]), ties to the lower index.
fn rank_order(values: &[f32]) -> impl Fn(&usize, &usize) -> std::cmp::Ordering + '_ {
    move |a, b| {
        rank_bits(values[*b])
            .cmp(&rank_bits(values[*a]))
            .then(a.cmp(b))
    }
}

/// Routes one token given its router logits `[n_experts]` (computed in f32) and, for sigmoid
/// routers, the `e_score_correction_bias`.
pub fn route(logits: &[f32], bias: Option<&[f32]>, spec: &RouterSpec) -> Route {
    let e = spec.n_experts;
    debug_assert_eq!(logits.len(), e);
    match spec.scoring {
        Scoring::Sigmoid => {
            let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
            let mut choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            if spec.n_group > 1 {
                let per = e / spec.n_group;
                // A group's score is the sum of its two best choice scores.
                let group_scores: Vec<f32> = (0..spec.n_group)
                    .map(|g| {
                        let t = top_k(&choice[g * per..(g + 1) * per], 2);
                        t.iter().map(|&i| choice[g * per + i]).sum()
                    })
                    .collect();
                let keep = top_k(&group_scores, spec.topk_group);
                for g in 0..spec.n_group {
                    if !keep.contains(&g) {
                        for c in &mut choice[g * per..(g + 1) * per] {
                            *c = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            let ids = top_k(&choice, spec.top_k);
            let mut weights: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
            if spec.norm_topk_prob {
                let denom: f32 = weights.iter().sum::<f32>() + 1e-20;
                for w in &mut weights {
                    *w /= denom;
                }
            }
            for w in &mut weights {
                *w *= spec.routed_scaling_factor;
            }
            Route {
                ids: ids.into_iter().map(|i| i as u32).collect(),
                weights,
            }
        }
        Scoring::Softmax => {
            let mut p = logits.to_vec();
            crate::kernels::softmax(&mut p);
            let ids = top_k(&p, spec.top_k);
            let mut weights: Vec<f32> = ids.iter().map(|&i| p[i]).collect();
            if spec.norm_topk_prob {
                let s: f32 = weights.iter().sum();
                for w in &mut weights {
                    *w /= s;
                }
            }
            for w in &mut weights {
                *w *= spec.routed_scaling_factor;
            }
            Route {
                ids: ids.into_iter().map(|i| i as u32).collect(),
                weights,
            }
        }
    }
}

#[cfg(test)]
mod tests {

    proptest::proptest! {
        /// Selecting then sorting gives what sorting everything gives: largest first, ties
        /// (including -0.0 against 0.0) to the lower index.
        #[test]
        fn top_k_equals_the_full_sort(
            raw in proptest::collection::vec(-4i8..4, 0..300),
            zeros in proptest::collection::vec(proptest::bool::ANY, 300),
            k in 0usize..320,
        ) {
            let values: Vec<f32> = raw
                .iter()
                .zip(&zeros)
                .map(|(&v, &neg)| match v {
                    0 if neg => -0.0,
                    -4 => f32::NAN,
                    -3 if neg => f32::NEG_INFINITY,
                    3 if neg => f32::INFINITY,
                    _ => v as f32 / 2.0,
                })
                .collect();
            // NaN ranks as negative infinity (ties to the lower index), below every number
            let rank = |v: f32| if v.is_nan() { 0.0 } else { (v + 2.0).max(0.0) };
            let mut want: Vec<usize> = (0..values.len()).collect();
            want.sort_by(|&a, &b| {
                rank(values[b]).partial_cmp(&rank(values[a])).unwrap().then(a.cmp(&b))
            });
            want.truncate(k);
            proptest::prop_assert_eq!(top_k(&values, k), want.clone());
            want.sort_unstable();
            proptest::prop_assert_eq!(top_k_set(&values, k), want);
        }
    }
    use super::*;

    fn spec(n_group: usize, topk_group: usize) -> RouterSpec {
        RouterSpec {
            scoring: Scoring::Sigmoid,
            n_experts: 8,
            top_k: 2,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
            correction_bias: true,
        }
    }

    #[test]
    fn group_limit_excludes_best_expert_of_weak_group() {
        // group 0 = experts 0..4 has one great expert and weak others; group 1 is uniformly good.
        let logits = [5.0, -5.0, -5.0, -5.0, 1.0, 1.0, 1.0, 1.0];
        let r = route(&logits, None, &spec(2, 1));
        // group scores: g0 = s(5)+s(-5) ~ 1.0; g1 = 2*s(1) ~ 1.46 -> only group 1 survives
        assert!(r.ids.iter().all(|&i| i >= 4), "{:?}", r.ids);
        let r = route(&logits, None, &spec(1, 1));
        assert_eq!(r.ids[0], 0);
        let s: f32 = r.weights.iter().sum();
        assert!((s - 2.0).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        assert_eq!(top_k(&[0.0, 1.0, 0.0, 1.0, 0.0], 3), vec![1, 3, 0]);
        assert_eq!(top_k(&[0.0; 6], 2), vec![0, 1]);
    }

    #[test]
    fn bias_changes_choice_not_weight() {
        let logits = [0.0; 8];
        let bias = [0.0, 0.0, 0.0, 0.5, 0.0, 0.4, 0.0, 0.0];
        let r = route(&logits, Some(&bias), &spec(1, 1));
        assert_eq!(r.ids, vec![3, 5]);
        assert_eq!(r.weights, vec![1.0, 1.0]); // equal sigmoid(0) scores, normalised, scaled by 2
    }
}
