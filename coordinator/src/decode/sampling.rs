//! Token sampling: greedy at temperature 0, otherwise temperature / top-k / top-p with a seeded
//! generator so a run can be repeated.

/// Sampling settings.
#[derive(Debug, Clone, Copy)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 = no limit.
    pub top_k: usize,
    /// 1.0 = no limit.
    pub top_p: f32,
    pub seed: u64,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (0 = off).
    pub min_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            min_p: 0.0,
        }
    }
}

/// Penalties on tokens already seen, applied to the logits before sampling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// OpenAI's: subtracted once from every token the completion already holds.
    pub presence: f32,
    /// OpenAI's: subtracted per occurrence in the completion.
    pub frequency: f32,
    /// The CTRL / transformers penalty over prompt and completion: positive logits divided by
    /// it, negative ones multiplied (1 = off).
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Self {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
        }
    }
}

impl Penalties {
    /// Whether any penalty applies.
    pub fn active(&self) -> bool {
        *self != Self::default()
    }

    /// Applies the penalties to `logits` given the `prompt` and the `completion` so far.
    pub fn apply(&self, logits: &mut [f32], prompt: &[u32], completion: &[u32]) {
        if !self.active() {
            return;
        }
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in completion {
            *counts.entry(t).or_insert(0) += 1;
        }
        if self.repetition != 1.0 {
            let seen: std::collections::HashSet<u32> =
                prompt.iter().chain(completion).copied().collect();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / self.repetition
                    } else {
                        *l * self.repetition
                    };
                }
            }
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.presence + self.frequency * n as f32;
            }
        }
    }
}

/// `ln softmax(logits)[i]` for each of `ids`, and the `top` most likely tokens with theirs.
pub fn logprobs(logits: &[f32], id: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // (summed in f64: an f32 sum over a large vocabulary drifts by ~1e-5)
    let lse = m + logits
        .iter()
        .map(|&l| f64::from(l - m).exp())
        .sum::<f64>()
        .ln() as f32;
    let lp = |i: usize| logits[i] - lse;
    let mut best: Vec<u32> = Vec::new();
    if top > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = top.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| likelier_first(logits, a, b));
        idx.truncate(k);
        idx.sort_by(|&a, &b| likelier_first(logits, a, b));
        best = idx;
    }
    (
        lp(id as usize),
        best.into_iter().map(|t| (t, lp(t as usize))).collect(),
    )
}

/// A sampler whose randomness is keyed by position: the `i`-th token a sequence samples uses the
/// `i`-th number of a splitmix64 stream seeded by `seed`, drawn directly (not by advancing a
/// state), so a speculative step that samples several positions at once, or samples one
/// position again after a rejected draft, gets the numbers plain decoding would.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// Tokens sampled so far (the index of the next).
    drawn: u64,
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self { params, drawn: 0 }
    }

    /// The settings it samples with.
    pub fn params(&self) -> SamplingParams {
        self.params
    }

    /// Tokens sampled so far: the index the next [`Self::sample`] uses.
    pub fn drawn(&self) -> u64 {
        self.drawn
    }

    /// The uniform number in [0, 1) of the `i`-th token: splitmix64's `i`-th output.
    fn uniform_at(&self, i: u64) -> f32 {
        let mut z =
            (self.params.seed ^ GOLDEN).wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Picks the next token from `[vocab]` logits. Greedy ties go to the lowest id.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = self.sample_at(logits, self.drawn);
        self.drawn += 1;
        t
    }

    /// Marks `n` more tokens as sampled (taken with [`Self::sample_at`]).
    pub fn advance(&mut self, n: u64) {
        self.drawn += n;
    }

    /// The token the `index`-th sample takes from `[vocab]` logits, without drawing it: exactly
    /// the filtered distribution (temperature, top-k, min-p, top-p) sampled by inverse CDF with
    /// that index's number, the tokens taken most likely first (ties to the lowest id). Greedy:
    /// the most likely token, ties to the lowest id.
    ///
    /// Only the head of the order the draw reaches is sorted (a selection, then a sort of that
    /// part, widened as needed): a peaked distribution over a 155k vocabulary costs one pass
    /// over the logits, not a sort of them. Weights are `exp((l - max) / T)`; tokens whose
    /// weight is zero (masked, or underflowed) are never taken.
    pub fn sample_at(&self, logits: &[f32], index: u64) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let m = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        // (id, weight) of every token that can be drawn, by id
        let mut c: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter_map(|(i, &l)| {
                let w = ((l - m) / p.temperature).exp();
                (w > 0.0).then_some((i as u32, w))
            })
            .collect();
        if c.is_empty() {
            // every logit -inf, NaN, or one +inf
            return argmax(logits) as u32;
        }
        let best_first = |a: &(u32, f32), b: &(u32, f32)| likelier_first(logits, a.0, b.0);
        if p.top_k > 0 && c.len() > p.top_k {
            c.select_nth_unstable_by(p.top_k - 1, best_first);
            c.truncate(p.top_k);
            c.sort_unstable_by_key(|e| e.0);
        }
        if p.min_p > 0.0 {
            // the most likely token weighs exp(0) = 1
            c.retain(|e| e.1 >= p.min_p);
        }
        let mut total: f64 = c.iter().map(|e| f64::from(e.1)).sum();
        // c[..sorted] holds the most likely tokens, best first
        let mut sorted = 0;
        let head = |c: &mut [(u32, f32)], sorted: &mut usize, want: usize| {
            if want <= *sorted {
                return;
            }
            let end = want.max(2 * *sorted).max(32).min(c.len());
            if end < c.len() {
                c[*sorted..].select_nth_unstable_by(end - *sorted - 1, best_first);
            }
            c[*sorted..end].sort_unstable_by(best_first);
            *sorted = end;
        };
        if p.top_p < 1.0 {
            // the smallest head whose mass reaches top_p
            let (mut cum, mut keep) = (0.0f64, c.len());
            for j in 0..c.len() {
                head(&mut c, &mut sorted, j + 1);
                cum += f64::from(c[j].1);
                if cum >= f64::from(p.top_p) * total {
                    keep = j + 1;
                    break;
                }
            }
            c.truncate(keep);
            sorted = sorted.min(keep);
            total = c.iter().map(|e| f64::from(e.1)).sum();
        }
        let target = f64::from(self.uniform_at(index)) * total;
        let mut cum = 0.0f64;
        for j in 0..c.len() {
            head(&mut c, &mut sorted, j + 1);
            cum += f64::from(c[j].1);
            if target < cum {
                return c[j].0;
            }
        }
        // (rounding left the number past the last sum: the least likely token drawn)
        c[c.len() - 1].0
    }
}

/// Token `a` before token `b` when its logit is larger, or equal with a lower id.
fn likelier_first(logits: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    logits[b as usize]
        .total_cmp(&logits[a as usize])
        .then(a.cmp(&b))
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_seeded() {
        let l = [0.1, 3.0, 2.9, -1.0];
        assert_eq!(Sampler::new(SamplingParams::default()).sample(&l), 1);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&l)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&l)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == 1 || t == 2));
        assert!(a.contains(&1) && a.contains(&2));
        // min_p 0.5: token 2 (e^-0.1 of token 1) stays, nothing else
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 3,
            ..Default::default()
        });
        assert!((0..50).all(|_| matches!(s.sample(&l), 1 | 2)));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.95,
            seed: 3,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&l) == 1));
    }

    #[test]
    fn penalties_follow_their_definitions() {
        let mut l = vec![2.0, -1.0, 0.5, 1.0];
        Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 2.0,
        }
        .apply(&mut l, &[3], &[0, 0, 1]);
        // token 0: /2 then -(0.5 + 2*0.25); token 1: *2 then -(0.5 + 0.25); token 3 (prompt): /2
        assert_eq!(l, vec![0.0, -2.75, 0.5, 0.5]);
        let mut same = vec![2.0, -1.0];
        Penalties::default().apply(&mut same, &[0], &[0, 1]);
        assert_eq!(same, vec![2.0, -1.0]);
    }

    #[test]
    fn logprobs_are_log_softmax_with_the_top_tokens() {
        let l = [1.0f32, 3.0, 2.0, 3.0];
        let (lp, top) = logprobs(&l, 2, 3);
        let z: f32 = l.iter().map(|x| x.exp()).sum();
        assert!((lp - (2f32.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let mass: f32 = top.iter().map(|t| t.1.exp()).sum();
        assert!((mass - (2.0 * 3f32.exp() + 2f32.exp()) / z).abs() < 1e-6);
        assert!(logprobs(&l, 0, 0).1.is_empty());
    }

    /// The sampler as a full sort computes it: every token sorted most likely first, the
    /// normalized weights summed in that order. Returns the token and the cumulative sums
    /// (where a number near one of them may go either way under another summation order).
    fn sample_by_full_sort(p: SamplingParams, logits: &[f32], u: f32) -> (u32, Vec<f32>) {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let m = logits[idx[0]];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i] - m) / p.temperature).exp())
            .collect();
        let norm = |probs: &mut Vec<f32>| {
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= s);
        };
        norm(&mut probs);
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            probs.truncate(keep);
            norm(&mut probs);
        }
        if p.top_p < 1.0 {
            let (mut c, mut keep) = (0.0, probs.len());
            for (i, q) in probs.iter().enumerate() {
                c += q;
                if c >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            norm(&mut probs);
        }
        let mut cums = Vec::new();
        let mut c = 0.0;
        let mut got = None;
        for (i, q) in probs.iter().enumerate() {
            c += q;
            cums.push(c);
            if u < c && got.is_none() {
                got = Some(idx[i] as u32);
            }
        }
        (got.unwrap_or(idx[probs.len() - 1] as u32), cums)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// The partial sort draws what the full sort draws, except for numbers within rounding
        /// of a boundary between two tokens' shares (the normalizer is summed in another order).
        #[test]
        fn the_partial_sort_draws_what_a_full_sort_draws(
            raw in proptest::collection::vec(-8.0f32..8.0, 1..600),
            masked in proptest::collection::vec(proptest::bool::weighted(0.3), 600),
            temperature in proptest::sample::select(vec![0.2f32, 0.7, 1.0, 1.6]),
            top_k in proptest::sample::select(vec![0usize, 1, 3, 40]),
            top_p in proptest::sample::select(vec![1.0f32, 0.95, 0.6]),
            min_p in proptest::sample::select(vec![0.0f32, 0.02, 0.3]),
            seed in 0u64..1000,
        ) {
            let mut logits = raw.clone();
            for (l, &m) in logits.iter_mut().zip(&masked) {
                if m {
                    *l = f32::NEG_INFINITY;
                }
            }
            // at least one token drawable, as a grammar mask leaves
            logits[0] = raw[0];
            let p = SamplingParams { temperature, top_k, top_p, min_p, seed };
            let s = Sampler::new(p);
            let mut off = 0;
            for i in 0..64 {
                let got = s.sample_at(&logits, i);
                proptest::prop_assert!(logits[got as usize] > f32::NEG_INFINITY, "a masked token");
                let u = s.uniform_at(i);
                let (want, cums) = sample_by_full_sort(p, &logits, u);
                if got != want {
                    let near = cums.iter().any(|&c| (c - u).abs() < 1e-5);
                    proptest::prop_assert!(near, "draw {i}: {got} against {want}, u {u}");
                    off += 1;
                }
            }
            proptest::prop_assert!(off <= 1, "{off} of 64 draws differ");
        }
    }
}
