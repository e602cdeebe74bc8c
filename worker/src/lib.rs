//! charm's worker side: it owns routed experts and executes them.
//!
//! # Layout
//! - [`ExpertExecutor`] (defined in [`charm_shared::expert`], re-exported here): the routed-expert
//!   boundary. The MoE layer hands over token activations, expert ids and gate weights and gets
//!   the weighted sum back, wherever the experts live.
//! - [`RamExperts`]: every expert resident in RAM.
//! - [`store::StreamingExperts`]: experts streamed from a container on disk through a bounded RAM
//!   cache (single-box mode): its cache policy, reader threads and I/O timeline in submodules,
//!   with [`history`] for the pinned hot set and [`io`] for the reads.
//! - [`gpu`]: the GPU backend (wgpu: Vulkan, Metal) with its self-check against the CPU, and
//!   [`gpu::tier::VramExperts`], the VRAM tier over either store.
//! - [`iobench`]: the disk benchmark of `charm iobench`.
//! - [`server`]: the worker's QUIC server; [`tls`]: cluster certificates and mutual TLS;
//!   [`shard`]: the expert records a worker fetches from its coordinator.

pub mod gpu;
pub mod history;
pub mod io;
pub mod iobench;
pub mod server;
pub mod shard;
pub mod store;
pub mod tls;

pub use store::{IoEvent, StoreOptions, StreamingExperts};

use charm_shared::expert::{run_grouped, ExpertBatch, ExpertError, ExpertExecutor};
use charm_shared::linear::SwiGlu;

/// Why files a worker keeps (cluster identities, a fetched shard) could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// Maps an I/O error on `path` to a [`FileError`] naming it.
pub(crate) fn io_at(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> FileError + '_ {
    move |source| FileError::Io {
        path: path.into(),
        source,
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
pub(crate) mod tests {
    use super::*;
    use charm_shared::kernels::Matrix;

    /// A small deterministic expert of width `i` for hidden size `h`.
    pub(crate) fn expert(seed: f32, h: usize, i: usize) -> SwiGlu {
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
                step: 0,
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
                    step: 0,
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
                step: 0,
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
                step: 0,
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
