//! charm's worker side: it owns routed experts and executes them.
//!
//! # Layout
//! - [`ExpertExecutor`]: the routed-expert boundary. The MoE layer hands over token activations,
//!   expert ids and gate weights and gets the weighted sum back. Where the experts live (RAM here;
//!   NVMe streaming and remote workers behind the same trait later) is invisible to the caller.
//! - [`RamExperts`]: every expert resident in RAM.
//! - [`store::StreamingExperts`]: experts streamed from a container on disk through a bounded RAM
//!   cache (single-box mode), with [`history`] for the pinned hot set and [`io`] for the reads.

pub mod history;
pub mod io;
pub mod store;

pub use store::{IoEvent, StoreOptions, StoreStats, StreamingExperts};

use charm_shared::kernels::SwiGlu;
use rayon::prelude::*;

/// Why an expert call failed.
#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    /// The layer has no routed experts (a dense layer, or out of range).
    #[error("layer {layer} has no routed experts")]
    NoSuchLayer { layer: usize },
    /// An expert id past the layer's expert count.
    #[error("layer {layer}: expert {expert} out of range (layer has {count})")]
    NoSuchExpert {
        layer: usize,
        expert: u32,
        count: usize,
    },
    /// Inputs whose lengths disagree.
    #[error("expert call shapes disagree: {0}")]
    Shape(String),
    /// An expert could not be loaded (I/O error, damaged record, bad store setup).
    #[error("expert store: {0}")]
    Load(String),
}

/// One routed-expert computation request for a batch of tokens.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBatch<'a> {
    /// MoE layer index (decoder layer number).
    pub layer: usize,
    /// `[n_tokens, hidden]` post-attention-norm activations.
    pub x: &'a [f32],
    pub n_tokens: usize,
    /// `[n_tokens, top_k]` expert ids.
    pub ids: &'a [u32],
    /// `[n_tokens, top_k]` gate weights.
    pub weights: &'a [f32],
    pub top_k: usize,
}

impl ExpertBatch<'_> {
    fn check(&self, hidden: usize) -> Result<(), ExpertError> {
        let n = self.n_tokens;
        if self.x.len() != n * hidden
            || self.ids.len() != n * self.top_k
            || self.weights.len() != n * self.top_k
        {
            return Err(ExpertError::Shape(format!(
                "x {} (want {}x{hidden}), ids {}, weights {} (want {}x{})",
                self.x.len(),
                n,
                self.ids.len(),
                self.weights.len(),
                n,
                self.top_k
            )));
        }
        Ok(())
    }
}

/// The routed-expert boundary: returns `[n_tokens, hidden]` with
/// `out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`.
///
/// Contract: for each token the `top_k` contributions are added in ascending expert-id order, so
/// the result does not depend on batch composition or on where each expert ran.
pub trait ExpertExecutor: Send + Sync + std::fmt::Debug {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError>;

    /// Whether [`Self::prefetch`] does anything (then the caller should compute predictions;
    /// stores holding everything in RAM say no).
    fn wants_lookahead(&self) -> bool {
        false
    }

    /// MoE layer `layer` will probably use experts `ids`, most likely first: start reading them
    /// in that order, the first `sure` as soon as there is room, the less sure rest only while
    /// the disk would otherwise be idle (stores holding everything in RAM ignore it).
    fn prefetch(&self, layer: usize, ids: &[u32], sure: usize) {
        let _ = (layer, ids, sure);
    }

    /// An earlier, less reliable guess at MoE layer `layer`'s experts (made a layer or more
    /// before it): read them only while the disk would otherwise be idle. A later
    /// [`Self::prefetch`] or `prefetch_early` for the layer replaces the guesses not yet read.
    fn prefetch_early(&self, layer: usize, ids: &[u32]) {
        let _ = (layer, ids);
    }

    /// A forward step (one token of decode, or one prefill) is complete: a safe point to update
    /// caching decisions.
    fn step_end(&self) {}

    /// Counters since start, for stores that keep them.
    fn stats(&self) -> Option<StoreStats> {
        None
    }
}

/// All routed experts resident in RAM, per layer (`None` for dense layers).
#[derive(Debug, Default)]
pub struct RamExperts {
    pub hidden: usize,
    pub layers: Vec<Option<Vec<SwiGlu>>>,
}

impl RamExperts {
    /// Bytes of expert weights held.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|e| e.bytes())
            .sum()
    }
}

/// Slots (`t * top_k + j`) grouped by expert id, ascending: each expert runs once per batch
/// (batch-union) on the tokens that chose it.
pub(crate) fn plan_runs(batch: &ExpertBatch<'_>) -> Vec<(u32, Vec<usize>)> {
    let mut order: Vec<usize> = (0..batch.ids.len()).collect();
    order.sort_by_key(|&s| (batch.ids[s], s));
    let mut runs: Vec<(u32, Vec<usize>)> = Vec::new();
    for s in order {
        let id = batch.ids[s];
        match runs.last_mut() {
            Some((last, slots)) if *last == id => slots.push(s),
            _ => runs.push((id, vec![s])),
        }
    }
    runs
}

/// The activations of the tokens behind `slots`, `[slots, hidden]`.
pub(crate) fn gather(batch: &ExpertBatch<'_>, slots: &[usize], hidden: usize) -> Vec<f32> {
    let mut xs = Vec::with_capacity(slots.len() * hidden);
    for &s in slots {
        let t = s / batch.top_k;
        xs.extend_from_slice(&batch.x[t * hidden..(t + 1) * hidden]);
    }
    xs
}

/// The weighted per-token sum of expert outputs `outs[r]` (rows in `runs[r]`'s slot order),
/// added in ascending expert order.
pub(crate) fn combine(
    batch: &ExpertBatch<'_>,
    hidden: usize,
    runs: &[(u32, Vec<usize>)],
    outs: &[Vec<f32>],
) -> Vec<f32> {
    let k = batch.top_k;
    // slot -> (run, row)
    let mut at = vec![(0usize, 0usize); batch.ids.len()];
    for (r, (_, slots)) in runs.iter().enumerate() {
        for (row, &s) in slots.iter().enumerate() {
            at[s] = (r, row);
        }
    }
    let mut out = vec![0.0f32; batch.n_tokens * hidden];
    for t in 0..batch.n_tokens {
        let mut slots: Vec<usize> = (t * k..(t + 1) * k).collect();
        slots.sort_by_key(|&s| batch.ids[s]);
        let o = &mut out[t * hidden..(t + 1) * hidden];
        for s in slots {
            let w = batch.weights[s];
            let (r, row) = at[s];
            for (a, b) in o.iter_mut().zip(&outs[r][row * hidden..(row + 1) * hidden]) {
                *a += w * b;
            }
        }
    }
    out
}

/// Runs `batch` with `expert(id)` giving each expert's weights: each expert runs once per batch
/// (experts in parallel, each with the same arithmetic as alone), then the per-token sum in
/// ascending expert order.
pub fn run_grouped<'e>(
    hidden: usize,
    batch: ExpertBatch<'_>,
    expert: impl Fn(u32) -> Result<&'e SwiGlu, ExpertError>,
) -> Result<Vec<f32>, ExpertError> {
    batch.check(hidden)?;
    let runs = plan_runs(&batch);
    let experts: Vec<&SwiGlu> = runs
        .iter()
        .map(|(id, _)| expert(*id))
        .collect::<Result<_, _>>()?;
    let ys: Vec<Vec<f32>> = runs
        .par_iter()
        .zip(experts.par_iter())
        .map(|((_, slots), e)| e.forward(&gather(&batch, slots, hidden), slots.len()))
        .collect();
    Ok(combine(&batch, hidden, &runs, &ys))
}

impl ExpertExecutor for RamExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        let layer = batch.layer;
        let experts = self
            .layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or(ExpertError::NoSuchLayer { layer })?;
        run_grouped(self.hidden, batch, |id| {
            experts.get(id as usize).ok_or(ExpertError::NoSuchExpert {
                layer,
                expert: id,
                count: experts.len(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use charm_shared::kernels::Matrix;

    fn expert(seed: f32, h: usize, i: usize) -> SwiGlu {
        let m = |r, c, s: f32| {
            Matrix::new(
                r,
                c,
                (0..r * c)
                    .map(|k| ((k as f32 + s) * 0.37).sin() * 0.3)
                    .collect(),
            )
        };
        SwiGlu {
            gate: m(i, h, seed).into(),
            up: m(i, h, seed + 1.0).into(),
            down: m(h, i, seed + 2.0).into(),
        }
    }

    #[test]
    fn weighted_sum_matches_direct_and_is_batch_invariant() {
        let (h, i) = (8, 4);
        let store = RamExperts {
            hidden: h,
            layers: vec![None, Some((0..4).map(|e| expert(e as f32, h, i)).collect())],
        };
        let x: Vec<f32> = (0..3 * h).map(|k| (k as f32 * 0.1).cos()).collect();
        let ids = [2u32, 0, 1, 3, 2, 0];
        let w = [0.5f32, 0.25, 1.0, 2.0, 0.1, 0.9];
        let out = store
            .run(ExpertBatch {
                layer: 1,
                x: &x,
                n_tokens: 3,
                ids: &ids,
                weights: &w,
                top_k: 2,
            })
            .unwrap();
        for t in 0..3 {
            let one = store
                .run(ExpertBatch {
                    layer: 1,
                    x: &x[t * h..(t + 1) * h],
                    n_tokens: 1,
                    ids: &ids[2 * t..2 * t + 2],
                    weights: &w[2 * t..2 * t + 2],
                    top_k: 2,
                })
                .unwrap();
            assert_eq!(one, out[t * h..(t + 1) * h].to_vec());
            let mut want = vec![0.0f32; h];
            for j in 0..2 {
                let e = &store.layers[1].as_ref().unwrap()[ids[2 * t + j] as usize];
                for (a, b) in want.iter_mut().zip(e.forward(&x[t * h..(t + 1) * h], 1)) {
                    *a += w[2 * t + j] * b;
                }
            }
            for (a, b) in want.iter().zip(&one) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        assert!(matches!(
            store.run(ExpertBatch {
                layer: 0,
                x: &x,
                n_tokens: 3,
                ids: &ids,
                weights: &w,
                top_k: 2
            }),
            Err(ExpertError::NoSuchLayer { .. })
        ));
        let bad = [9u32, 0, 1, 3, 2, 0];
        assert!(matches!(
            store.run(ExpertBatch {
                layer: 1,
                x: &x,
                n_tokens: 3,
                ids: &bad,
                weights: &w,
                top_k: 2
            }),
            Err(ExpertError::NoSuchExpert { .. })
        ));
    }
}
