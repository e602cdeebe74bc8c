//! Comparing a model's logits with reference logits: top-1 agreement and KL divergence.

/// Agreement of `got` with `reference`, both `[positions, vocab]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    pub positions: usize,
    /// Fraction of positions whose argmax matches.
    pub top1: f64,
    /// Mean over positions of KL(reference || got) in nats.
    pub mean_kl: f64,
    pub max_kl: f64,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// Compares two `[positions, vocab]` logit tables.
pub fn compare(got: &[f32], reference: &[f32], vocab: usize) -> Agreement {
    assert_eq!(got.len(), reference.len());
    let n = got.len() / vocab;
    let (mut agree, mut sum, mut max) = (0usize, 0.0f64, 0.0f64);
    for t in 0..n {
        let (g, r) = (
            &got[t * vocab..(t + 1) * vocab],
            &reference[t * vocab..(t + 1) * vocab],
        );
        if crate::decode::sampling::argmax(g) == crate::decode::sampling::argmax(r) {
            agree += 1;
        }
        let (lg, lr) = (log_softmax(g), log_softmax(r));
        let kl: f64 = lr.iter().zip(&lg).map(|(a, b)| a.exp() * (a - b)).sum();
        sum += kl;
        max = max.max(kl);
    }
    Agreement {
        positions: n,
        top1: agree as f64 / n.max(1) as f64,
        mean_kl: sum / n.max(1) as f64,
        max_kl: max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_is_perfect_and_shifted_is_not() {
        let a = [1.0f32, 2.0, 3.0, 0.5, 0.1, 0.2];
        let r = compare(&a, &a, 3);
        assert_eq!((r.top1, r.positions), (1.0, 2));
        assert!(r.mean_kl.abs() < 1e-12);
        let b = [3.0f32, 2.0, 1.0, 0.5, 0.1, 0.2];
        let r = compare(&b, &a, 3);
        assert_eq!(r.top1, 0.5);
        assert!(r.mean_kl > 0.1 && r.max_kl > r.mean_kl);
    }
}
