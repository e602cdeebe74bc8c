//! The VRAM tier: the routed experts that fit a VRAM budget run on the GPU; the rest go to the
//! executor below it (experts in RAM, streamed from disk). A layer whose experts sit partly in
//! VRAM and partly below runs both at once: the GPU's part is submitted from a thread of its own
//! while the CPU computes its part, and the ascending-order combine ([`combine`]) sees the same
//! per-expert rows wherever each expert ran, so the sum has the same bits.
//!
//! While decoding, experts that turn hot move up: every [`SWAP_EVERY`] steps the most used
//! experts below take free VRAM, or the place of the least used resident ones when they were used
//! clearly more often ([`SwapPolicy`]); use counts halve every [`DECAY_EVERY`] steps, so the tier
//! follows what the model routes to now (colibrì swaps hot RAM experts into VRAM every 16 tokens).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use charm_shared::expert::{
    combine, gather, plan_runs, run_rows, ExpertBatch, ExpertError, ExpertExecutor, ExpertStats,
    LookaheadPolicy,
};
use charm_shared::linear::SwiGlu;

use charm_shared::quant::gpu::ExpertWords;

use super::{Gpu, GpuError, GpuExpert, Job};

/// Steps between two looks at which experts should move into VRAM.
pub const SWAP_EVERY: u64 = 16;
/// Steps between two halvings of the use counts.
pub const DECAY_EVERY: u64 = 64;

/// How many experts may move into VRAM at each look, and by how much an expert below must be
/// used more than a resident one to take its place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SwapPolicy {
    /// Experts uploaded at most per look (each is read from below and copied to the device on the
    /// forward pass's thread).
    pub max_moves: usize,
    /// A candidate replaces a resident expert when its uses exceed `ratio` times the resident's
    /// plus one.
    pub ratio: f64,
}

impl Default for SwapPolicy {
    fn default() -> Self {
        Self {
            max_moves: 4,
            ratio: 2.0,
        }
    }
}

/// Uses per `(layer, expert)`.
type Uses = HashMap<(usize, u32), f64>;

/// One device's outputs: its index and each of its jobs' rows.
type DeviceRows = (usize, Vec<Vec<f32>>);

/// Reads an expert's weights (to upload it).
pub type LoadExpert = dyn Fn(usize, u32) -> Result<SwiGlu, String> + Send + Sync;

/// Routed experts in VRAM (of one or several devices) over an executor for the rest.
pub struct VramExperts {
    gpus: Vec<Arc<Gpu>>,
    below: Arc<dyn ExpertExecutor>,
    hidden: usize,
    /// Per expert in VRAM: its device and its buffers.
    resident: RwLock<HashMap<(usize, u32), (usize, GpuExpert)>>,
    /// VRAM given to experts on each device: the budget, and what the resident ones hold.
    budget: Vec<u64>,
    bytes: Vec<AtomicU64>,
    load: Box<LoadExpert>,
    policy: SwapPolicy,
    /// Uses per expert (halved every [`DECAY_EVERY`] steps), and the step count.
    uses: Mutex<(Uses, u64)>,
    /// Experts whose formats the kernels do not take (never candidates).
    unfit: Mutex<std::collections::HashSet<(usize, u32)>>,
    /// Expert uses computed on the GPU, and experts moved into VRAM while running.
    vram_hits: AtomicU64,
    swaps: AtomicU64,
}

impl std::fmt::Debug for VramExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VramExperts({:?}, {} experts, {} bytes)",
            self.gpus,
            self.resident(),
            self.bytes()
        )
    }
}

impl VramExperts {
    /// Uploads experts in `order` (hottest first) while they fit the devices' budgets (`gpus`
    /// with `budget[i]` bytes of VRAM each; each expert to the device with the most room left),
    /// each read with `load` (kept for moves while running); `below` runs the rest. An expert
    /// whose formats the GPU does not take stays below.
    pub fn new(
        gpus: Vec<(Arc<Gpu>, u64)>,
        below: Arc<dyn ExpertExecutor>,
        hidden: usize,
        order: impl IntoIterator<Item = (usize, u32)>,
        load: Box<LoadExpert>,
        policy: SwapPolicy,
    ) -> Result<Self, GpuError> {
        let t = Self {
            budget: gpus.iter().map(|g| g.1).collect(),
            bytes: gpus.iter().map(|_| AtomicU64::new(0)).collect(),
            gpus: gpus.into_iter().map(|g| g.0).collect(),
            below,
            hidden,
            resident: RwLock::new(HashMap::new()),
            load,
            policy,
            uses: Mutex::new((HashMap::new(), 0)),
            unfit: Mutex::new(Default::default()),
            vram_hits: AtomicU64::new(0),
            swaps: AtomicU64::new(0),
        };
        for key in order {
            match t.upload(key)? {
                Upload::Done | Upload::Stays => {}
                Upload::NoRoom => break,
            }
        }
        Ok(t)
    }

    /// Reads expert `key` from below and puts it in VRAM if it fits the budget's free room.
    fn upload(&self, key: (usize, u32)) -> Result<Upload, GpuError> {
        match self.prepare(key) {
            Some(words) => self.place(key, &words),
            None => Ok(Upload::Stays),
        }
    }

    /// Expert `key` read from below and laid out for the GPU, or `None` where it stays below:
    /// formats the kernels do not take (remembered, never a candidate again) or weights that
    /// cannot be read now (as one a worker has not fetched yet: it may move up later).
    fn prepare(&self, key: (usize, u32)) -> Option<ExpertWords> {
        let e = (self.load)(key.0, key.1).ok()?;
        let words = ExpertWords::new(&e).ok();
        if words.is_none() {
            self.unfit.lock().expect("unfit set").insert(key);
        }
        words
    }

    /// Puts `words` (expert `key`) on the device with the most room left, if it fits there.
    fn place(&self, key: (usize, u32), words: &ExpertWords) -> Result<Upload, GpuError> {
        let need = words.bytes.len() as u64;
        let room = |d: usize| self.budget[d].saturating_sub(self.bytes[d].load(Ordering::Relaxed));
        let Some(d) = (0..self.gpus.len()).max_by_key(|&d| (room(d), std::cmp::Reverse(d))) else {
            return Ok(Upload::NoRoom);
        };
        if room(d) < need {
            return Ok(Upload::NoRoom);
        }
        let g = self.gpus[d].upload_words(words)?;
        self.bytes[d].fetch_add(g.bytes(), Ordering::Relaxed);
        self.resident
            .write()
            .expect("resident experts")
            .insert(key, (d, g));
        Ok(Upload::Done)
    }

    /// Takes expert `key` out of VRAM.
    fn evict(&self, key: (usize, u32)) {
        if let Some((d, g)) = self
            .resident
            .write()
            .expect("resident experts")
            .remove(&key)
        {
            self.bytes[d].fetch_sub(g.bytes(), Ordering::Relaxed);
        }
    }

    /// Moves the most used experts below into VRAM: into free room, or in place of resident
    /// experts used clearly less ([`SwapPolicy`]). Each candidate is read from below once;
    /// failures leave the tier as it was (the experts stay where they are and compute there).
    fn rebalance(&self, uses: &Uses) {
        let unfit = self.unfit.lock().expect("unfit set").clone();
        let (mut below, mut resident): (Vec<_>, Vec<_>) = {
            let r = self.resident.read().expect("resident experts");
            let below = uses
                .iter()
                .filter(|(k, _)| !r.contains_key(k) && !unfit.contains(k))
                .map(|(&k, &n)| (k, n))
                .collect();
            let resident = r
                .keys()
                .map(|k| (*k, uses.get(k).copied().unwrap_or(0.0)))
                .collect();
            (below, resident)
        };
        // most used first below; least used first in VRAM (ties by key, so runs repeat)
        below.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        resident.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let mut cold = resident.into_iter();
        for (key, n) in below.into_iter().take(self.policy.max_moves) {
            let Some(words) = self.prepare(key) else {
                continue;
            };
            match self.place(key, &words) {
                Ok(Upload::Done) => {
                    self.swaps.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok(_) => {}
                Err(_) => return,
            }
            // no room: replace the coldest resident expert if this one is clearly hotter
            let Some((victim, m)) = cold.next() else {
                return;
            };
            if n <= self.policy.ratio * m + 1.0 {
                return;
            }
            self.evict(victim);
            if let Ok(Upload::Done) = self.place(key, &words) {
                self.swaps.fetch_add(1, Ordering::Relaxed);
            } else {
                // (the victim goes back where it was if this one could not go up)
                let _ = self.upload(victim);
                return;
            }
        }
    }

    /// Bytes of VRAM the resident experts hold (all devices).
    pub fn bytes(&self) -> u64 {
        self.bytes.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// Experts held in VRAM.
    pub fn resident(&self) -> usize {
        self.resident.read().expect("resident experts").len()
    }

    /// Whether expert `id` of `layer` is in VRAM.
    pub fn holds(&self, layer: usize, id: u32) -> bool {
        self.resident
            .read()
            .expect("resident experts")
            .contains_key(&(layer, id))
    }

    /// The experts in VRAM, `(layer, id)`.
    pub fn held(&self) -> Vec<(usize, u32)> {
        let mut v: Vec<_> = self
            .resident
            .read()
            .expect("resident experts")
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    /// The devices.
    pub fn gpus(&self) -> &[Arc<Gpu>] {
        &self.gpus
    }
}

/// What [`VramExperts::upload`] did.
enum Upload {
    Done,
    /// It stays below ([`VramExperts::prepare`]).
    Stays,
    /// Not within the budget's free room.
    NoRoom,
}

impl ExpertExecutor for VramExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        let h = self.hidden;
        batch.check(h)?;
        let runs = plan_runs(&batch);
        {
            let mut u = self.uses.lock().expect("expert uses");
            for (id, slots) in &runs {
                *u.0.entry((batch.layer, *id)).or_default() += slots.len() as f64;
            }
        }
        let resident = self.resident.read().expect("resident experts");
        let (on_gpu, below): (Vec<usize>, Vec<usize>) =
            (0..runs.len()).partition(|&i| resident.contains_key(&(batch.layer, runs[i].0)));
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); runs.len()];
        let xs: Vec<Vec<f32>> = on_gpu
            .iter()
            .map(|&i| gather(&batch, &runs[i].1, h))
            .collect();
        // per device: the runs it holds and their jobs
        let mut per: Vec<(Vec<usize>, Vec<Job<'_>>)> =
            (0..self.gpus.len()).map(|_| Default::default()).collect();
        for (&i, x) in on_gpu.iter().zip(&xs) {
            let (d, expert) = &resident[&(batch.layer, runs[i].0)];
            per[*d].0.push(i);
            per[*d].1.push(Job {
                expert,
                x,
                rows: runs[i].1.len(),
            });
        }
        let (gpu_rows, cpu_rows) = std::thread::scope(|s| {
            // each device's submission from a thread of its own, the CPU's part on this one
            let started: Vec<_> = per
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.1.is_empty())
                .map(|(d, p)| (d, s.spawn(move || self.gpus[d].run(&p.1))))
                .collect();
            let cpu = if below.is_empty() {
                Ok(Vec::new())
            } else {
                run_rows(&*self.below, &batch, &runs, &below, h)
            };
            let gpu: Result<Vec<DeviceRows>, GpuError> = started
                .into_iter()
                .map(|(d, t)| {
                    t.join()
                        .unwrap_or_else(|_| {
                            Err(GpuError::Device("the GPU submission panicked".into()))
                        })
                        .map(|r| (d, r))
                })
                .collect();
            (gpu, cpu)
        });
        let gpu_rows = gpu_rows.map_err(|e| ExpertError::Internal(e.to_string()))?;
        self.vram_hits.fetch_add(
            on_gpu.iter().map(|&i| runs[i].1.len() as u64).sum(),
            Ordering::Relaxed,
        );
        for (d, rows) in gpu_rows {
            for (&i, r) in per[d].0.iter().zip(rows) {
                outs[i] = r;
            }
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
        self.below.step_end();
        let uses = {
            let mut u = self.uses.lock().expect("expert uses");
            u.1 += 1;
            let step = u.1;
            if step.is_multiple_of(DECAY_EVERY) {
                u.0.values_mut().for_each(|v| *v *= 0.5);
            }
            if !step.is_multiple_of(SWAP_EVERY) {
                return;
            }
            u.0.clone()
        };
        self.rebalance(&uses);
    }

    fn stats(&self) -> Option<ExpertStats> {
        let mut s = self.below.stats().unwrap_or_default();
        s.vram_hits = self.vram_hits.load(Ordering::Relaxed);
        s.vram_swaps = self.swaps.load(Ordering::Relaxed);
        s.vram_bytes = self.bytes();
        s.vram_experts = self.resident() as u64;
        Some(s)
    }
}
