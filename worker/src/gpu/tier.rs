//! The VRAM tier: the routed experts that fit a VRAM budget run on the GPU; the rest go to the
//! executor below it (experts in RAM, streamed from disk). A layer whose experts sit partly in
//! VRAM and partly below runs both at once: the GPU's part is submitted from a thread of its own
//! while the CPU computes its part, and the ascending-order combine ([`combine`]) sees the same
//! per-expert rows wherever each expert ran, so the sum has the same bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use charm_shared::expert::{
    combine, gather, plan_runs, ExpertBatch, ExpertError, ExpertExecutor, ExpertStats,
    LookaheadPolicy,
};
use charm_shared::linear::SwiGlu;

use super::{Gpu, GpuError, GpuExpert, Job};

/// Routed experts in VRAM over an executor for the rest.
pub struct VramExperts {
    gpu: Arc<Gpu>,
    below: Arc<dyn ExpertExecutor>,
    hidden: usize,
    resident: HashMap<(usize, u32), GpuExpert>,
    /// VRAM given to experts, bytes.
    pub bytes: u64,
    /// Expert uses computed on the GPU.
    vram_hits: AtomicU64,
}

impl std::fmt::Debug for VramExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VramExperts({:?}, {} experts, {} bytes)",
            self.gpu,
            self.resident.len(),
            self.bytes
        )
    }
}

impl VramExperts {
    /// Uploads experts in `order` (hottest first) while they fit `budget` bytes of VRAM, each
    /// read with `load`; `below` runs the rest. An expert whose formats the GPU does not take
    /// stays below.
    pub fn new(
        gpu: Arc<Gpu>,
        below: Arc<dyn ExpertExecutor>,
        hidden: usize,
        budget: u64,
        order: impl IntoIterator<Item = (usize, u32)>,
        mut load: impl FnMut(usize, u32) -> Result<SwiGlu, String>,
    ) -> Result<Self, GpuError> {
        let mut resident = HashMap::new();
        let mut bytes = 0u64;
        for (layer, id) in order {
            let e = load(layer, id).map_err(GpuError::Format)?;
            // (an expert whose formats the kernels do not take stays below)
            let Ok(words) = charm_shared::quant::gpu::ExpertWords::new(&e) else {
                continue;
            };
            let need = words.bytes.len() as u64;
            if bytes + need > budget {
                break;
            }
            let g = gpu.upload(&e)?;
            bytes += g.bytes();
            resident.insert((layer, id), g);
        }
        Ok(Self {
            gpu,
            below,
            hidden,
            resident,
            bytes,
            vram_hits: AtomicU64::new(0),
        })
    }

    /// Experts held in VRAM.
    pub fn resident(&self) -> usize {
        self.resident.len()
    }

    /// Whether expert `id` of `layer` is in VRAM.
    pub fn holds(&self, layer: usize, id: u32) -> bool {
        self.resident.contains_key(&(layer, id))
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

/// The rows of the runs `idx` computed by `below`: every run's tokens as one batch of one expert
/// per row with gate weight 1 (`0 + 1 * y` is `y`, up to the sign of a zero, which the sum cannot
/// see).
fn rows_below(
    below: &dyn ExpertExecutor,
    b: &ExpertBatch<'_>,
    runs: &[(u32, Vec<usize>)],
    idx: &[usize],
    hidden: usize,
) -> Result<Vec<Vec<f32>>, ExpertError> {
    let mut x = Vec::new();
    let mut ids = Vec::new();
    for &i in idx {
        x.extend(gather(b, &runs[i].1, hidden));
        ids.extend(std::iter::repeat_n(runs[i].0, runs[i].1.len()));
    }
    let n = ids.len();
    let y = below.run(ExpertBatch {
        step: b.step,
        layer: b.layer,
        x: &x,
        n_tokens: n,
        ids: &ids,
        weights: &vec![1.0f32; n],
        top_k: 1,
    })?;
    let mut at = 0;
    Ok(idx
        .iter()
        .map(|&i| {
            let len = runs[i].1.len() * hidden;
            let r = y[at..at + len].to_vec();
            at += len;
            r
        })
        .collect())
}

impl ExpertExecutor for VramExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        let h = self.hidden;
        batch.check(h)?;
        let runs = plan_runs(&batch);
        let (on_gpu, below): (Vec<usize>, Vec<usize>) =
            (0..runs.len()).partition(|&i| self.holds(batch.layer, runs[i].0));
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); runs.len()];
        let xs: Vec<Vec<f32>> = on_gpu
            .iter()
            .map(|&i| gather(&batch, &runs[i].1, h))
            .collect();
        let jobs: Vec<Job<'_>> = on_gpu
            .iter()
            .zip(&xs)
            .map(|(&i, x)| Job {
                expert: &self.resident[&(batch.layer, runs[i].0)],
                x,
                rows: runs[i].1.len(),
            })
            .collect();
        let (gpu_rows, cpu_rows) = std::thread::scope(|s| {
            let gpu = (!jobs.is_empty()).then(|| s.spawn(|| self.gpu.run(&jobs)));
            let cpu = if below.is_empty() {
                Ok(Vec::new())
            } else {
                rows_below(&*self.below, &batch, &runs, &below, h)
            };
            let gpu = match gpu {
                Some(t) => t.join().unwrap_or_else(|_| {
                    Err(GpuError::Device("the GPU submission panicked".into()))
                }),
                None => Ok(Vec::new()),
            };
            (gpu, cpu)
        });
        let gpu_rows = gpu_rows.map_err(|e| ExpertError::Internal(e.to_string()))?;
        self.vram_hits.fetch_add(
            on_gpu.iter().map(|&i| runs[i].1.len() as u64).sum(),
            Ordering::Relaxed,
        );
        for (&i, r) in on_gpu.iter().zip(gpu_rows) {
            outs[i] = r;
        }
        for (&i, r) in below.iter().zip(cpu_rows?) {
            outs[i] = r;
        }
        Ok(combine(&batch, h, &runs, &outs))
    }

    fn lookahead(&self) -> Option<LookaheadPolicy> {
        self.below.lookahead()
    }

    fn prefetch(&self, layer: usize, ids: &[u32], sure: usize) {
        // only what the GPU does not hold is read from below
        let (mut keep, mut sure_left) = (Vec::with_capacity(ids.len()), 0);
        for (k, &id) in ids.iter().enumerate() {
            if !self.holds(layer, id) {
                keep.push(id);
                if k < sure {
                    sure_left += 1;
                }
            }
        }
        if !keep.is_empty() {
            self.below.prefetch(layer, &keep, sure_left);
        }
    }

    fn prefetch_early(&self, layer: usize, ids: &[u32]) {
        let keep: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| !self.holds(layer, id))
            .collect();
        if !keep.is_empty() {
            self.below.prefetch_early(layer, &keep);
        }
    }

    fn step_end(&self) {
        self.below.step_end()
    }

    fn stats(&self) -> Option<ExpertStats> {
        let mut s = self.below.stats().unwrap_or_default();
        s.vram_hits = self.vram_hits.load(Ordering::Relaxed);
        s.vram_bytes = self.bytes;
        s.vram_experts = self.resident.len() as u64;
        Some(s)
    }
}
