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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its own random state (splitmix64).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            state: params.seed ^ 0x9e37_79b9_7f4a_7c15,
        }
    }

    fn uniform(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Picks the next token from `[vocab]` logits. Greedy ties go to the lowest id.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| {
            logits[b]
                .partial_cmp(&logits[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let m = logits[idx[0]];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i] - m) / p.temperature).exp())
            .collect();
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
        if p.top_p < 1.0 {
            let mut c = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                c += q;
                if c >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= s);
        }
        let u = self.uniform();
        let mut c = 0.0;
        for (i, q) in probs.iter().enumerate() {
            c += q;
            if u < c {
                return idx[i] as u32;
            }
        }
        idx[probs.len() - 1] as u32
    }
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
    }
}
