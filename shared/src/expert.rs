//! The routed-expert seam: what the MoE layer asks of whoever holds its experts.
//!
//! The forward pass routes each token (pure maths in [`crate::routing`]) and hands the layer's
//! tokens, expert ids and gate weights to an [`ExpertExecutor`]; it gets back the weighted sum.
//! Where the experts live (in RAM, streamed from disk, on other machines) is invisible to it.
//!
//! Contract of every executor: for each token the `top_k` contributions are added in ascending
//! expert-id order ([`combine`]), each expert computing with the same kernels whatever else is in
//! the batch, so the result does not depend on batch composition or on where each expert ran.
//! [`plan_runs`], [`gather`], [`run_rows`] and [`combine`] are public so an executor that fans a
//! batch out over several holders can keep that order.

use serde::Serialize;

use crate::linear::SwiGlu;

/// What the caller of an executor can do about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The request itself is wrong (shapes, ids, layers): retrying anywhere fails the same way.
    BadRequest,
    /// The expert could not be produced here (I/O error, damaged record, dead holder): another
    /// holder of the same expert may succeed.
    Unavailable,
    /// A fault of the executor itself (bad setup): give up and report.
    Internal,
}

/// Why an expert call failed, grouped by [`ErrorClass`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
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
    /// An expert could not be produced (read error, damaged record, unreachable holder).
    #[error("layer {layer} expert {expert} unavailable: {why}")]
    Unavailable {
        layer: usize,
        expert: u32,
        why: String,
    },
    /// The executor itself failed (setup, bookkeeping).
    #[error("expert executor: {0}")]
    Internal(String),
}

impl ExpertError {
    /// What the caller can do about it.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::NoSuchLayer { .. } | Self::NoSuchExpert { .. } | Self::Shape(_) => {
                ErrorClass::BadRequest
            }
            Self::Unavailable { .. } => ErrorClass::Unavailable,
            Self::Internal(_) => ErrorClass::Internal,
        }
    }
}

/// One routed-expert computation request for a batch of tokens of one MoE layer.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBatch<'a> {
    /// Forward step this request belongs to (the same for every layer of one step): with the
    /// layer, it names the request, so a retried request can be recognized as the same one.
    pub step: u64,
    /// MoE layer index (decoder layer number).
    pub layer: usize,
    /// `[n_tokens, hidden]` post-attention-norm activations, f32: the kernels quantize them per
    /// weight group themselves in int8-activation mode, with the same codes on every machine.
    pub x: &'a [f32],
    pub n_tokens: usize,
    /// `[n_tokens, top_k]` expert ids.
    pub ids: &'a [u32],
    /// `[n_tokens, top_k]` gate weights.
    pub weights: &'a [f32],
    pub top_k: usize,
}

impl ExpertBatch<'_> {
    /// Checks that the slices have the lengths `n_tokens`, `top_k` and `hidden` say.
    pub fn check(&self, hidden: usize) -> Result<(), ExpertError> {
        let n = self.n_tokens;
        let slots = n.checked_mul(self.top_k);
        if n.checked_mul(hidden) != Some(self.x.len())
            || slots != Some(self.ids.len())
            || slots != Some(self.weights.len())
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

/// How an executor that streams experts wants to hear about predictions (see
/// [`ExpertExecutor::lookahead`]); the numbers are the store's disk tuning, not the model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookaheadPolicy {
    /// Of a token's `k` predictions (best first), how many are read as soon as there is room:
    /// `ceil(k * sure_num / sure_den)`; the rest only while the disk idles.
    pub sure_num: usize,
    pub sure_den: usize,
    /// Steps of more tokens than this make no early guesses at the next MoE layer.
    pub early_max_tokens: usize,
    /// Early guesses keep a token's first `max(1, k / early_rank_div)` choices.
    pub early_rank_div: usize,
}

impl LookaheadPolicy {
    /// Predictions of a token's `k` read as soon as there is room.
    pub fn sure_ranks(&self, k: usize) -> usize {
        (self.sure_num * k).div_ceil(self.sure_den.max(1))
    }
    /// Ranks of a token's `k` choices kept as an early guess.
    pub fn early_ranks(&self, k: usize) -> usize {
        (k / self.early_rank_div.max(1)).max(1)
    }
}

/// What an executor did since it started. Stores without a disk leave the read counters at zero.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ExpertStats {
    /// Expert uses served from RAM.
    pub hits: u64,
    /// Expert uses that waited for (or found in flight) a disk read.
    pub misses: u64,
    /// Expert records read from disk and their bytes.
    pub reads: u64,
    pub bytes_read: u64,
    /// Seconds reader threads spent in reads (summed over readers).
    pub read_seconds: f64,
    /// Seconds the forward pass waited for experts to arrive.
    pub wait_seconds: f64,
    /// Seconds spent computing experts.
    pub compute_seconds: f64,
    pub evictions: u64,
    /// Experts used once and not admitted to the cache (admission control).
    pub not_admitted: u64,
    /// Reads whose expert was never used (read ahead, then dropped or evicted), and their bytes:
    /// `bytes_read - wasted_bytes` is what the disk delivered to the computation.
    pub wasted_reads: u64,
    pub wasted_bytes: u64,
    /// Misses whose read-ahead had already arrived when the layer ran (no wait).
    pub read_ahead_in_time: u64,
    /// Lookahead: experts predicted for a layer before it ran, reads started for them, and how many
    /// of the experts the layer then used had been predicted (recall = hits / used).
    pub lookahead_reads: u64,
    pub lookahead_used: u64,
    pub lookahead_predicted_used: u64,
    /// Early guesses (see [`ExpertExecutor::prefetch_early`]) read while the disk was otherwise
    /// idle, and how many of them the layer then used.
    pub early_reads: u64,
    pub early_used: u64,
    /// Seconds with at least one read in flight (the disk busy, as far as this process goes).
    pub disk_busy_seconds: f64,
    pub cache_capacity_bytes: u64,
    pub cache_bytes: u64,
    pub cache_peak_bytes: u64,
    pub pinned: u64,
    pub direct_io: bool,
    /// Expert uses computed on the GPU from the VRAM tier (not counted in `hits` or `misses`),
    /// and experts moved into VRAM while running.
    pub vram_hits: u64,
    pub vram_swaps: u64,
    /// Experts held in VRAM and their bytes.
    pub vram_experts: u64,
    pub vram_bytes: u64,
}

impl ExpertStats {
    /// Share of expert uses served from RAM.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
    /// Share of used experts the lookahead had predicted.
    pub fn lookahead_recall(&self) -> Option<f64> {
        (self.lookahead_used > 0)
            .then(|| self.lookahead_predicted_used as f64 / self.lookahead_used as f64)
    }
    /// Counters accrued since `earlier` (gauges keep their current value).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            reads: self.reads - earlier.reads,
            bytes_read: self.bytes_read - earlier.bytes_read,
            read_seconds: self.read_seconds - earlier.read_seconds,
            wait_seconds: self.wait_seconds - earlier.wait_seconds,
            compute_seconds: self.compute_seconds - earlier.compute_seconds,
            evictions: self.evictions - earlier.evictions,
            not_admitted: self.not_admitted - earlier.not_admitted,
            wasted_reads: self.wasted_reads - earlier.wasted_reads,
            wasted_bytes: self.wasted_bytes - earlier.wasted_bytes,
            read_ahead_in_time: self.read_ahead_in_time - earlier.read_ahead_in_time,
            lookahead_reads: self.lookahead_reads - earlier.lookahead_reads,
            lookahead_used: self.lookahead_used - earlier.lookahead_used,
            lookahead_predicted_used: self.lookahead_predicted_used
                - earlier.lookahead_predicted_used,
            early_reads: self.early_reads - earlier.early_reads,
            early_used: self.early_used - earlier.early_used,
            disk_busy_seconds: self.disk_busy_seconds - earlier.disk_busy_seconds,
            vram_hits: self.vram_hits - earlier.vram_hits,
            vram_swaps: self.vram_swaps - earlier.vram_swaps,
            ..self.clone()
        }
    }
}

/// A layer's expert work started with [`ExpertExecutor::start`], collected with
/// [`PendingExperts::wait`].
#[derive(Debug)]
pub struct PendingExperts(Pending);

#[derive(Debug)]
enum Pending {
    Ready(Result<Vec<f32>, ExpertError>),
    /// Work whose wait is a call (it drives the I/O the answer comes by on the waiting thread).
    Deferred(Deferred),
    Running(
        std::sync::mpsc::Receiver<Result<Vec<f32>, ExpertError>>,
        Option<Spin>,
    ),
}

/// While it answers true, a wait polls for its result (yielding the core to any thread that
/// wants it) instead of sleeping at once.
struct Spin(Box<dyn FnMut() -> bool + Send>);

/// The call a [`Pending::Deferred`] wait makes.
struct Deferred(Box<dyn FnOnce() -> Result<Vec<f32>, ExpertError> + Send>);

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deferred")
    }
}

impl std::fmt::Debug for Spin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spin")
    }
}

impl PendingExperts {
    /// Work already done.
    pub fn ready(r: Result<Vec<f32>, ExpertError>) -> Self {
        Self(Pending::Ready(r))
    }
    /// Work that another thread finishes by sending its result on the paired sender.
    pub fn channel() -> (
        std::sync::mpsc::SyncSender<Result<Vec<f32>, ExpertError>>,
        Self,
    ) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        (tx, Self(Pending::Running(rx, None)))
    }
    /// [`PendingExperts::channel`] whose [`wait`](Self::wait) polls while `keep_polling`
    /// answers true before it sleeps: for answers due within a round trip, where a sleeping
    /// thread (and an idle core put to sleep) would add its wake-up to every wait.
    pub fn channel_polled(
        keep_polling: impl FnMut() -> bool + Send + 'static,
    ) -> (
        std::sync::mpsc::SyncSender<Result<Vec<f32>, ExpertError>>,
        Self,
    ) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let spin = Spin(Box::new(keep_polling));
        (tx, Self(Pending::Running(rx, Some(spin))))
    }
    /// Work whose [`wait`](Self::wait) is `finish` on the waiting thread: for answers that
    /// thread receives itself (it drives the runtime their packets arrive on), so that no other
    /// thread has to wake it.
    pub fn deferred(
        finish: impl FnOnce() -> Result<Vec<f32>, ExpertError> + Send + 'static,
    ) -> Self {
        Self(Pending::Deferred(Deferred(Box::new(finish))))
    }
    /// Blocks until the work is done: `[n_tokens, hidden]`, the weighted sum of routed experts.
    pub fn wait(self) -> Result<Vec<f32>, ExpertError> {
        match self.0 {
            Pending::Ready(r) => r,
            Pending::Deferred(Deferred(finish)) => {
                // the helpers must not spin on the cores the round trip needs
                crate::par::rest();
                finish()
            }
            Pending::Running(rx, spin) => {
                if let Ok(r) = rx.try_recv() {
                    return r;
                }
                // waiting on another thread (a round trip, a disk read): the compute helpers
                // should not spin on the cores it needs
                crate::par::rest();
                if let Some(Spin(mut keep)) = spin {
                    while keep() {
                        match rx.try_recv() {
                            Ok(r) => return r,
                            Err(std::sync::mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
                        }
                    }
                }
                rx.recv().unwrap_or_else(|_| {
                    Err(ExpertError::Internal(
                        "expert work ended without a result".into(),
                    ))
                })
            }
        }
    }
}

/// The routed-expert boundary: returns `[n_tokens, hidden]` with
/// `out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, contributions added in ascending
/// expert-id order (see the module docs).
pub trait ExpertExecutor: Send + Sync + std::fmt::Debug {
    /// Runs a layer's experts and returns the weighted sum.
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError>;

    /// Starts a layer's expert work and returns at once where the executor can (experts on
    /// other machines); the caller computes its own part (the shared expert) meanwhile and then
    /// waits. Executors computing in this process run the work here: the caller's threads would
    /// be the ones computing either way.
    fn start(&self, batch: ExpertBatch<'_>) -> PendingExperts {
        PendingExperts::ready(self.run(batch))
    }

    /// [`Self::start`] with the caller's own part of the layer (`local`: the shared expert),
    /// returned beside the pending experts. An executor computing its experts in this process may
    /// run `local` as one more item of the same parallel loop (one loop per layer instead of two,
    /// the shared expert whole on one thread while the other threads take experts); by default
    /// the experts start, then `local` runs. `local`'s result is the same either way.
    fn start_beside(
        &self,
        batch: ExpertBatch<'_>,
        local: &(dyn Fn() -> Vec<f32> + Sync),
    ) -> (PendingExperts, Vec<f32>) {
        let pending = self.start(batch);
        (pending, local())
    }

    /// Whether and how the executor wants predictions of the experts a layer will use
    /// ([`Self::prefetch`], [`Self::prefetch_early`]); `None` (executors holding every expert in
    /// RAM) spares the caller computing them.
    fn lookahead(&self) -> Option<LookaheadPolicy> {
        None
    }

    /// MoE layer `layer` will probably use experts `ids`, most likely first: start reading them
    /// in that order, the first `sure` as soon as there is room, the less sure rest only while
    /// the disk would otherwise be idle.
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

    /// Whether this executor holds (or streams) expert weights itself; false for a stand-in that
    /// only refuses (a coordinator whose routed experts all live on workers).
    fn holds_experts(&self) -> bool {
        true
    }

    /// Counters since start, for executors that keep them.
    fn stats(&self) -> Option<ExpertStats> {
        None
    }
}

/// Slots (`t * top_k + j`) grouped by expert id, ascending: each expert runs once per batch
/// (batch-union) on the tokens that chose it.
pub fn plan_runs(batch: &ExpertBatch<'_>) -> Vec<(u32, Vec<usize>)> {
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
pub fn gather(batch: &ExpertBatch<'_>, slots: &[usize], hidden: usize) -> Vec<f32> {
    let mut xs = Vec::with_capacity(slots.len() * hidden);
    for &s in slots {
        let t = s / batch.top_k;
        xs.extend_from_slice(&batch.x[t * hidden..(t + 1) * hidden]);
    }
    xs
}

/// The weighted per-token sum of expert outputs `outs[r]` (rows in `runs[r]`'s slot order),
/// added in ascending expert order.
pub fn combine<O: AsRef<[f32]>>(
    batch: &ExpertBatch<'_>,
    hidden: usize,
    runs: &[(u32, Vec<usize>)],
    outs: &[O],
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
            for (a, b) in o
                .iter_mut()
                .zip(&outs[r].as_ref()[row * hidden..(row + 1) * hidden])
            {
                *a += w * b;
            }
        }
    }
    out
}

/// The unweighted outputs of runs `idx` of `runs` (from [`plan_runs`]), each `[its slots,
/// hidden]`, computed by `executor` in one call: every run's tokens as a batch of one expert per
/// row with gate weight 1 (`0 + 1 * y` is `y`, up to the sign of a zero, which [`combine`]'s sum
/// cannot see). For executors that compute part of a layer's runs for another that combines them.
pub fn run_rows(
    executor: &dyn ExpertExecutor,
    batch: &ExpertBatch<'_>,
    runs: &[(u32, Vec<usize>)],
    idx: &[usize],
    hidden: usize,
) -> Result<Vec<Vec<f32>>, ExpertError> {
    let mut x = Vec::new();
    let mut ids = Vec::new();
    for &i in idx {
        x.extend(gather(batch, &runs[i].1, hidden));
        ids.extend(std::iter::repeat_n(runs[i].0, runs[i].1.len()));
    }
    let n = ids.len();
    let y = executor.run(ExpertBatch {
        step: batch.step,
        layer: batch.layer,
        x: &x,
        n_tokens: n,
        ids: &ids,
        weights: &vec![1.0f32; n],
        top_k: 1,
    })?;
    let mut rows = y.chunks_exact(hidden);
    Ok(idx
        .iter()
        .map(|&i| {
            rows.by_ref()
                .take(runs[i].1.len())
                .flatten()
                .copied()
                .collect()
        })
        .collect())
}

/// Runs `batch` with `expert(id)` giving each expert's weights: each expert runs once per batch
/// (experts in parallel as [`crate::linear::map_blocks`] spreads them, each with the same
/// arithmetic as alone), then the per-token sum in ascending expert order.
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
    let splits = experts.iter().all(|e| e.splits());
    let ys: Vec<Vec<f32>> = crate::linear::map_blocks(runs.len(), splits, |i| {
        let slots = &runs[i].1;
        experts[i].forward(&gather(&batch, slots, hidden), slots.len())
    });
    Ok(combine(&batch, hidden, &runs, &ys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classed_by_what_the_caller_can_do() {
        assert_eq!(
            ExpertError::NoSuchLayer { layer: 1 }.class(),
            ErrorClass::BadRequest
        );
        assert_eq!(
            ExpertError::Unavailable {
                layer: 1,
                expert: 2,
                why: "read".into()
            }
            .class(),
            ErrorClass::Unavailable
        );
        assert_eq!(
            ExpertError::Internal("x".into()).class(),
            ErrorClass::Internal
        );
    }

    #[test]
    fn pending_work_delivers_its_result_or_says_it_was_lost() {
        let (tx, p) = PendingExperts::channel();
        std::thread::spawn(move || tx.send(Ok(vec![1.0, 2.0])).unwrap());
        assert_eq!(p.wait().unwrap(), vec![1.0, 2.0]);
        let (tx, p) = PendingExperts::channel();
        drop(tx);
        assert_eq!(p.wait().unwrap_err().class(), ErrorClass::Internal);
    }

    #[test]
    fn a_polled_wait_polls_then_sleeps_and_still_gets_its_result() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        // answered while polling
        let polls = Arc::new(AtomicUsize::new(0));
        let (tx, p) = PendingExperts::channel_polled({
            let polls = polls.clone();
            move || polls.fetch_add(1, Ordering::Relaxed) < usize::MAX
        });
        let sender = std::thread::spawn(move || tx.send(Ok(vec![3.0])).unwrap());
        assert_eq!(p.wait().unwrap(), vec![3.0]);
        sender.join().unwrap();
        // polling gives up after three polls and sleeps until the answer comes
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        let counted = Arc::new(AtomicUsize::new(0));
        let (tx, p) = PendingExperts::channel_polled({
            let counted = counted.clone();
            move || {
                let n = counted.fetch_add(1, Ordering::Relaxed) + 1;
                if n == 3 {
                    let _ = gate_tx.send(());
                }
                n <= 3
            }
        });
        let sender = std::thread::spawn(move || {
            gate_rx.recv().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            tx.send(Ok(vec![4.0])).unwrap()
        });
        assert_eq!(p.wait().unwrap(), vec![4.0]);
        sender.join().unwrap();
        // (3 polls, the 4th refused; 3 if the answer came between the third poll and its check)
        assert!((3..=4).contains(&counted.load(Ordering::Relaxed)));
        // a sender gone while polling: the loss is reported, not waited on forever
        let (tx, p) = PendingExperts::channel_polled(|| true);
        drop(tx);
        assert_eq!(p.wait().unwrap_err().class(), ErrorClass::Internal);
    }

    #[test]
    fn experts_spread_over_the_threads_give_the_bits_of_experts_run_alone() {
        use crate::kernels::Matrix;
        use crate::linear::{Linear, SwiGlu};
        use crate::quant::{Activations, QMatrix, QuantKind};
        let noise = crate::kernels::tests::lcg;
        let (hidden, inter) = (2048, 1024);
        let lin = |r: usize, c: usize, seed: u64, int4: bool| {
            let m = Matrix::new(r, c, noise(seed, r * c));
            if int4 {
                let q = QMatrix::quantize(&m, QuantKind::Int4, 64).unwrap();
                Linear::Quant(q).prepared(Activations::Int8)
            } else {
                Linear::F32(m)
            }
        };
        for int4 in [true, false] {
            let experts: Vec<SwiGlu> = (0..3u64)
                .map(|e| SwiGlu {
                    gate: lin(inter, hidden, 3 * e + 1, int4),
                    up: lin(inter, hidden, 3 * e + 2, int4),
                    down: lin(hidden, inter, 3 * e + 3, int4),
                })
                .collect();
            // big enough to spread: the leftover experts' matmuls split over the threads
            assert!(experts.iter().all(|e| e.splits()));
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            for (n, top_k) in [(1, 1), (1, 3), (2, 3), (3, 2)] {
                let x = noise(99, n * hidden);
                let ids: Vec<u32> = (0..n * top_k).map(|i| (i % 3) as u32).collect();
                let weights = noise(7, n * top_k);
                let batch = || ExpertBatch {
                    step: 0,
                    layer: 0,
                    x: &x,
                    n_tokens: n,
                    ids: &ids,
                    weights: &weights,
                    top_k,
                };
                let get = |id: u32| Ok(&experts[id as usize]);
                let spread = run_grouped(hidden, batch(), get).unwrap();
                let alone = one.install(|| run_grouped(hidden, batch(), get)).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&spread), bits(&alone), "int4 {int4}, {n} x {top_k}");
            }
        }
    }

    #[test]
    fn shape_check_refuses_overflowing_counts() {
        let b = ExpertBatch {
            step: 0,
            layer: 0,
            x: &[],
            n_tokens: usize::MAX,
            ids: &[],
            weights: &[],
            top_k: 2,
        };
        assert!(matches!(b.check(4), Err(ExpertError::Shape(_))));
    }

    #[test]
    fn lookahead_policy_rounds_as_documented() {
        let p = LookaheadPolicy {
            sure_num: 5,
            sure_den: 8,
            early_max_tokens: 4,
            early_rank_div: 4,
        };
        assert_eq!(
            [1, 2, 4, 6, 8, 10].map(|k| p.sure_ranks(k)),
            [1, 2, 3, 4, 5, 7]
        );
        assert_eq!([1, 4, 8].map(|k| p.early_ranks(k)), [1, 1, 2]);
    }
}
