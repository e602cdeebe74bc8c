//! Held-out evaluation: perplexity, the MTP head's draft acceptance, and expert routing skew.

use crate::decode::sampling::argmax;
use crate::model::cache::KvCache;
use crate::model::forward::{ForwardError, ForwardOptions, Trace};
use crate::model::Model;

/// What [`evaluate`] measured.
#[derive(Debug, Clone, Default)]
pub struct Evaluation {
    /// Tokens predicted (windows x (window - 1)... see [`evaluate`]).
    pub tokens: usize,
    pub windows: usize,
    /// exp(mean negative log-likelihood).
    pub perplexity: f64,
    /// Fraction of positions whose argmax is the next token.
    pub top1_accuracy: f64,
    /// MTP drafts (slot j drafts the token after next): fraction equal to the text's token.
    pub mtp_accuracy: Option<f64>,
    /// Fraction of MTP drafts equal to the main model's own greedy prediction one step later: the
    /// acceptance rate of greedy self-speculative decoding.
    pub mtp_acceptance: Option<f64>,
    /// Per MoE layer: share of routed assignments taken by the most popular 10% of experts.
    pub top10pct_share: Vec<f64>,
    /// Per MoE layer: normalised entropy of expert popularity (1 = perfectly even).
    pub routing_entropy: Vec<f64>,
}

fn log_softmax_at(l: &[f32], i: usize) -> f64 {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = l.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    l[i] as f64 - lse
}

/// Scores `ids` in consecutive windows of `window + 1` tokens (each window predicts its last
/// `window` tokens from the ones before, without cache across windows), at most `max_windows`.
pub fn evaluate(
    model: &Model,
    ids: &[u32],
    window: usize,
    max_windows: usize,
) -> Result<Evaluation, ForwardError> {
    let (v, h) = (model.spec.vocab_size, model.spec.hidden_size);
    let n_experts = model.spec.router.as_ref().map_or(0, |r| r.n_experts);
    let mut counts: Vec<Vec<u64>> = Vec::new();
    let (mut nll, mut tokens, mut correct, mut windows) = (0.0f64, 0usize, 0usize, 0usize);
    let (mut mtp_ok, mut mtp_acc, mut mtp_n) = (0usize, 0usize, 0usize);
    let mut start = 0;
    while start + window < ids.len() && windows < max_windows {
        let w = &ids[start..start + window + 1];
        let mut cache = KvCache::new(&model.spec);
        let mut trace = Trace::default();
        let normed = model.forward(
            &w[..window],
            &mut cache,
            ForwardOptions::default(),
            Some(&mut trace),
        )?;
        let logits = model.logits(&normed, window)?;
        let mut greedy = Vec::with_capacity(window);
        for t in 0..window {
            let l = &logits[t * v..(t + 1) * v];
            nll -= log_softmax_at(l, w[t + 1] as usize);
            let g = argmax(l);
            correct += (g == w[t + 1] as usize) as usize;
            greedy.push(g);
        }
        tokens += window;
        for (li, layer) in trace.router.iter().enumerate() {
            if counts.len() <= li {
                counts.push(vec![0; n_experts]);
            }
            for (ids, _) in layer {
                for &e in ids {
                    counts[li][e as usize] += 1;
                }
            }
        }
        if model.mtp.is_some() {
            // slot j: token w[j+1] with the state at j drafts w[j+2]
            let mut mc = KvCache::with_layers(&model.spec, 1);
            let d = model.mtp_forward(&w[1..window], &normed[..(window - 1) * h], &mut mc)?;
            for j in 0..window - 1 {
                let draft = argmax(&d[j * v..(j + 1) * v]);
                mtp_ok += (draft == w[j + 2] as usize) as usize;
                mtp_acc += (draft == greedy[j + 1]) as usize;
                mtp_n += 1;
            }
        }
        windows += 1;
        start += window;
    }
    let mut e = Evaluation {
        tokens,
        windows,
        perplexity: (nll / tokens.max(1) as f64).exp(),
        top1_accuracy: correct as f64 / tokens.max(1) as f64,
        ..Default::default()
    };
    if mtp_n > 0 {
        e.mtp_accuracy = Some(mtp_ok as f64 / mtp_n as f64);
        e.mtp_acceptance = Some(mtp_acc as f64 / mtp_n as f64);
    }
    for c in &counts {
        let total: u64 = c.iter().sum();
        let mut sorted = c.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let top = (c.len() as f64 * 0.1).ceil() as usize;
        e.top10pct_share
            .push(sorted[..top].iter().sum::<u64>() as f64 / total.max(1) as f64);
        let ent: f64 = c
            .iter()
            .filter(|&&x| x > 0)
            .map(|&x| {
                let p = x as f64 / total as f64;
                -p * p.ln()
            })
            .sum();
        e.routing_entropy.push(ent / (c.len() as f64).ln());
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_softmax_is_normalised() {
        let l = [1.0f32, 2.0, 3.0];
        let s: f64 = (0..3).map(|i| super::log_softmax_at(&l, i).exp()).sum();
        assert!((s - 1.0).abs() < 1e-12);
    }
}
