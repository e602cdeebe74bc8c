//! The tiered expert store of single-box mode: routed experts stay on disk in a charm container
//! and stream through a RAM cache bounded in bytes.
//!
//! - **Reads**: a bounded pool of reader threads fetches whole expert records (one aligned read
//!   per expert, `O_DIRECT` where the filesystem allows) from three queues: demand (a layer waiting
//!   now), lookahead (experts a layer is predicted to use, see [`ExpertExecutor::prefetch`]) and
//!   warm-up (the pinned set).
//! - **Overlap**: a layer's resident experts compute while its missing ones load, and each missing
//!   expert computes as soon as it arrives.
//! - **Replacement**: the victim is the least-frequently used unpinned expert (frequency decays
//!   over steps and starts from the routing history's rate), least recently used among equals; a
//!   newcomer used less often than the victim is not admitted (it serves its step and is
//!   dropped), so a working set larger than the cache does not flush the experts that keep
//!   hitting.
//! - **Pinning**: the most-used experts of the persisted routing history (see [`crate::history`]),
//!   up to a share of the cache, are loaded at start and never evicted; the set is re-derived at
//!   step boundaries as usage accrues.
//! - **Memory**: cache bytes never exceed `capacity`; on top of it at most `readers` experts in
//!   flight (the record each reader is reading and decoding in place, held until there is room)
//!   and as many experts admitted for one step or staged read-aheads.
//!   [`StreamingExperts::io_bytes`] states that bound for the caller's budget.
//!
//! Every expert computes with the same kernels and the per-token sum keeps ascending expert order,
//! so results are bit-identical to [`crate::RamExperts`] whatever the cache size.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use charm_shared::container::{
    check_expert, decode_expert_shared, expert_to_lanes, Container, ExpertLayer,
};
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::lanes_wanted;
use charm_shared::quant::{Activations, SharedBytes};
use serde::Serialize;

use crate::history::History;
use crate::io::{AlignedBuf, RecordFile, DIRECT_ALIGN};
use charm_shared::expert::{
    combine, gather, plan_runs, ExpertBatch, ExpertError, ExpertExecutor, ExpertStats,
    LookaheadPolicy, PendingExperts,
};
mod policy;
mod readers;
mod stats;

use policy::Queue;
pub use policy::LOOKAHEAD;
use readers::BufferPool;
pub use stats::IoEvent;
use stats::Timeline;

/// How the store runs.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// RAM for cached experts, in bytes.
    pub cache_bytes: u64,
    /// Reader threads (queue depth towards the disk).
    pub readers: usize,
    /// Try `O_DIRECT` reads.
    pub direct: bool,
    /// Share of the cache given to the pinned hot set.
    pub pin_fraction: f64,
    /// Where the routing history lives; `None`: none kept.
    pub history: Option<PathBuf>,
    /// Re-derive the pinned set every this many steps (0: never after start).
    pub repin_every: u64,
    /// Halve usage frequencies every this many steps.
    pub decay_every: u64,
    /// Experts each token chooses (0: unknown; then the history does not seed frequencies).
    pub top_k: usize,
    /// Weight of the routing history in the usage frequencies: each expert starts as if this
    /// many steps had used it at its historical rate (0: start from zero).
    pub prior_steps: f64,
    /// Record an I/O timeline (see [`StreamingExperts::io_trace`]).
    pub trace: bool,
    /// How activations meet the experts' weights (decides their in-memory layout too).
    pub activations: Activations,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            cache_bytes: 0,
            readers: 4,
            direct: true,
            pin_fraction: 0.5,
            history: None,
            repin_every: 64,
            decay_every: 256,
            top_k: 0,
            prior_steps: 32.0,
            trace: false,
            activations: Activations::F32,
        }
    }
}

type Key = (usize, u32);

#[derive(Debug)]
struct Entry {
    w: Arc<SwiGlu>,
    bytes: u64,
    last: u64,
    in_use: u32,
    /// Not admitted: dropped as soon as its users release it.
    transient: bool,
    /// A step has used it (an expert read ahead and evicted unused was a wasted read).
    used: bool,
}

#[derive(Debug)]
struct State {
    entries: HashMap<Key, Entry>,
    bytes: u64,
    demand: VecDeque<Key>,
    lookahead: VecDeque<Key>,
    warm: VecDeque<Key>,
    /// Early guesses, read only while no other read is in flight.
    early: VecDeque<Key>,
    /// Keys read as early guesses, until their layer runs (for `early_used`).
    early_read: HashSet<Key>,
    /// Bytes of records being read now, and since when some read has been.
    inflight: u64,
    busy_since: Option<Instant>,
    /// Keys in a queue or being read.
    pending: HashSet<Key>,
    /// Reservations by waiting runs, handed to the entry when it arrives.
    wanted: HashMap<Key, u32>,
    failed: HashMap<Key, String>,
    freq: HashMap<Key, f64>,
    pinned: HashSet<Key>,
    history: History,
    predicted: HashMap<usize, HashSet<u32>>,
    stats: ExpertStats,
    tick: u64,
    step: u64,
    shutdown: bool,
}

#[derive(Debug)]
struct LayerSrc {
    meta: ExpertLayer,
    file: RecordFile,
    /// Records whose CRC-32 was checked in this process: a re-read of a verified record skips
    /// the check (the bytes were good when first read; the drive's own ECC guards re-reads).
    verified: Vec<std::sync::atomic::AtomicBool>,
}

#[derive(Debug)]
struct Inner {
    hidden: usize,
    inter: usize,
    layers: BTreeMap<usize, LayerSrc>,
    /// Cache bytes allowed (grown once at most, when the dense weights leave RAM:
    /// [`StreamingExperts::grow_cache`]).
    capacity: std::sync::atomic::AtomicU64,
    overflow: u64,
    opts: StoreOptions,
    /// Decoded bytes of one expert (all layers share the shape).
    expert_bytes: u64,
    /// All experts' in-memory bytes.
    total_bytes: u64,
    state: Mutex<State>,
    cv: Condvar,
    pool: Arc<BufferPool>,
    timeline: Option<Timeline>,
}

/// Routed experts streamed from a container through a bounded RAM cache.
#[derive(Debug)]
pub struct StreamingExperts {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

/// In-memory bytes of one expert of `l` (what the cache holds per expert): its record buffer,
/// whose weights and scales are used in place, plus f32 copies of weights stored as f32 or as
/// bf16 with a width not a multiple of 8 (the kernels' layout for those).
pub fn expert_ram_bytes(l: &ExpertLayer) -> u64 {
    use charm_shared::container::StoreFormat;
    record_bytes(l)
        + [&l.gate, &l.up, &l.down]
            .iter()
            .map(|p| match p.format {
                StoreFormat::F32 => p.data[1],
                StoreFormat::Bf16 if p.shape.last().is_none_or(|c| c % 8 != 0) => 2 * p.data[1],
                _ => 0,
            })
            .sum::<u64>()
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StreamingExperts {
    /// Opens the expert files of `c` for a model of width `hidden` and expert width `inter`.
    /// Fails when a file cannot be opened or the history belongs to another model. A cache of
    /// zero bytes works: every expert then streams through the I/O working set.
    pub fn open(
        c: &Container,
        hidden: usize,
        inter: usize,
        opts: StoreOptions,
    ) -> Result<Self, ExpertError> {
        let io =
            |p: &Path, e: std::io::Error| ExpertError::Internal(format!("{}: {e}", p.display()));
        let mut layers = BTreeMap::new();
        for l in c.expert_layers() {
            let p = c.dir.join(&l.file);
            let file = RecordFile::open(&p, opts.direct).map_err(|e| io(&p, e))?;
            layers.insert(
                l.layer,
                LayerSrc {
                    meta: l.clone(),
                    file,
                    verified: (0..l.count)
                        .map(|_| std::sync::atomic::AtomicBool::new(false))
                        .collect(),
                },
            );
        }
        let expert_bytes = layers
            .values()
            .map(|l| expert_ram_bytes(&l.meta))
            .max()
            .unwrap_or(0);
        let readers = opts.readers.max(1);
        let history = History::load_or_new(opts.history.as_deref(), c)
            .map_err(|e| ExpertError::Internal(e.to_string()))?;
        let direct = layers.values().all(|l| l.file.direct);
        let total_bytes = layers
            .values()
            .map(|l| l.meta.count as u64 * expert_ram_bytes(&l.meta))
            .sum();
        let inner = Arc::new(Inner {
            hidden,
            inter,
            layers,
            capacity: opts.cache_bytes.into(),
            overflow: readers as u64 * expert_bytes,
            expert_bytes,
            total_bytes,
            state: Mutex::new(State {
                entries: HashMap::new(),
                bytes: 0,
                demand: VecDeque::new(),
                lookahead: VecDeque::new(),
                early: VecDeque::new(),
                early_read: HashSet::new(),
                inflight: 0,
                busy_since: None,
                warm: VecDeque::new(),
                pending: HashSet::new(),
                wanted: HashMap::new(),
                failed: HashMap::new(),
                freq: HashMap::new(),
                pinned: HashSet::new(),
                history,
                predicted: HashMap::new(),
                stats: ExpertStats {
                    cache_capacity_bytes: opts.cache_bytes,
                    direct_io: direct,
                    ..Default::default()
                },
                tick: 0,
                step: 0,
                shutdown: false,
            }),
            cv: Condvar::new(),
            pool: Arc::default(),
            timeline: opts.trace.then(|| Timeline {
                t0: Instant::now(),
                events: Mutex::new(Vec::new()),
            }),
            opts,
        });
        // the cache's buffers, mapped and faulted in at start
        inner.add_buffers(inner.cache_experts(inner.capacity()));
        {
            let mut st = lock(&inner.state);
            inner.seed_frequencies(&mut st);
            inner.repin(&mut st);
        }
        let threads = (0..readers)
            .map(|i| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("charm-reader-{i}"))
                    .spawn(move || inner.reader())
                    .expect("spawn reader thread")
            })
            .collect();
        Ok(Self { inner, threads })
    }

    /// Gives the cache `bytes` more room (the dense weights' CPU copies freed once a GPU holds
    /// them): the buffers for the experts it adds are mapped now, and the pinned set is chosen
    /// again for the larger cache.
    pub fn grow_cache(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        let old = inner
            .capacity
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        st.stats.cache_capacity_bytes = old + bytes;
        inner.add_buffers(inner.cache_experts(old + bytes) - inner.cache_experts(old));
        inner.repin(&mut st);
        drop(st);
        inner.cv.notify_all();
        if inner.capacity() >= inner.total_bytes {
            // every expert fits now: read them all, as a store that held them from the start
            self.warm_all();
        }
    }

    /// Why reads are buffered, per file, where `O_DIRECT` could not be used.
    pub fn io_fallbacks(&self) -> Vec<(PathBuf, String)> {
        self.inner
            .layers
            .values()
            .filter_map(|l| {
                l.file
                    .fallback_reason
                    .clone()
                    .filter(|_| self.inner.opts.direct)
                    .map(|r| (l.file.path.clone(), r))
            })
            .collect()
    }

    /// The experts in the RAM cache now, `(layer, expert)`, sorted (those held only for the step
    /// that uses them are not counted).
    pub fn cached(&self) -> Vec<(usize, u32)> {
        let mut k: Vec<(usize, u32)> = lock(&self.inner.state)
            .entries
            .iter()
            .filter(|(_, e)| !e.transient)
            .map(|(k, _)| *k)
            .collect();
        k.sort_unstable();
        k
    }

    /// Memory on top of the cache capacity the store may use at most: per reader the record it
    /// reads and decodes in place (held until there is room), one expert admitted for a single
    /// step or staged as a read-ahead, and one more expert's worth of margin.
    pub fn io_bytes(&self) -> u64 {
        io_bytes(
            &self
                .inner
                .layers
                .values()
                .map(|l| &l.meta)
                .collect::<Vec<_>>(),
            self.inner.opts.readers,
        )
    }

    /// The I/O timeline recorded since the store opened (empty unless
    /// [`StoreOptions::trace`]).
    pub fn io_trace(&self) -> Vec<IoEvent> {
        self.inner.timeline.as_ref().map_or_else(Vec::new, |t| {
            t.events.lock().unwrap_or_else(|p| p.into_inner()).clone()
        })
    }

    /// Writes the routing history (when one is kept).
    pub fn save_history(&self) -> Result<(), ExpertError> {
        let Some(p) = &self.inner.opts.history else {
            return Ok(());
        };
        let h = lock(&self.inner.state).history.clone();
        h.save(p).map_err(|e| ExpertError::Internal(e.to_string()))
    }

    /// Queues reads of every expert (for a cache that holds them all).
    pub fn warm_all(&self) {
        let mut st = lock(&self.inner.state);
        let keys: Vec<Key> = self
            .inner
            .layers
            .iter()
            .flat_map(|(&l, s)| (0..s.meta.count as u32).map(move |e| (l, e)))
            .collect();
        for k in keys {
            Inner::enqueue(&mut st, k, Queue::Warm);
        }
        drop(st);
        self.inner.cv.notify_all();
    }

    /// Blocks until the warm-up reads (pinned set, or everything) are done; a record that
    /// failed to load (I/O error, damaged checksum) is reported here, before the first token.
    pub fn wait_warm(&self) -> Result<(), ExpertError> {
        let mut st = lock(&self.inner.state);
        while !st.warm.is_empty() || !st.pending.is_empty() {
            st = self.inner.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        let mut failed: Vec<(&Key, &String)> = st.failed.iter().collect();
        failed.sort();
        match failed.first() {
            Some((&(layer, expert), why)) => Err(ExpertError::Unavailable {
                layer,
                expert,
                why: (*why).clone(),
            }),
            None => Ok(()),
        }
    }
}

/// [`StreamingExperts::io_bytes`] for expert layers `layers` read by `readers` threads.
pub fn io_bytes(layers: &[&ExpertLayer], readers: usize) -> u64 {
    let rec = layers.iter().map(|l| record_bytes(l)).max().unwrap_or(0);
    let dec = layers
        .iter()
        .map(|l| expert_ram_bytes(l))
        .max()
        .unwrap_or(0);
    readers.max(1) as u64 * (rec + 2 * dec)
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        lock(&self.inner.state).shutdown = true;
        self.inner.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Bytes of one record of `l` as read with `O_DIRECT`: its payload rounded up to the alignment.
pub(super) fn record_bytes(l: &ExpertLayer) -> u64 {
    l.payload_bytes.div_ceil(DIRECT_ALIGN as u64) * DIRECT_ALIGN as u64
}

impl Inner {
    /// Cache bytes allowed now.
    fn capacity(&self) -> u64 {
        self.capacity.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Experts a cache of `capacity` bytes holds (at most every expert).
    fn cache_experts(&self, capacity: u64) -> u64 {
        let all = self.layers.values().map(|l| l.meta.count as u64).sum();
        capacity
            .checked_div(self.expert_bytes)
            .unwrap_or(0)
            .min(all)
    }

    /// Maps and faults in `n` more cache buffers, each the largest record, into the pool: the
    /// budget is taken when it is given (as the plan said), and no step later pays for
    /// first-touch page faults. They are parts of one mapping, so that small experts sit on huge
    /// pages too.
    fn add_buffers(&self, n: u64) {
        let rec = self
            .layers
            .values()
            .map(|l| record_bytes(&l.meta))
            .max()
            .unwrap_or(0);
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        free.extend(AlignedBuf::populated_many(n as usize, rec as usize));
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(st).unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    /// Whether a reader may be waiting for what the caller changed: a queued key to take, or a
    /// read (still `pending` until admitted) waiting for room. Only then is waking the readers
    /// worth a futex call: with every expert cached nothing is pending, and a wake per layer
    /// costs a few percent of a decoded token.
    fn readers_have_work(&self) -> bool {
        !(self.pending.is_empty()
            && self.demand.is_empty()
            && self.lookahead.is_empty()
            && self.warm.is_empty()
            && self.early.is_empty())
    }
}

impl StreamingExperts {
    fn layer(&self, layer: usize) -> Result<&LayerSrc, ExpertError> {
        self.inner
            .layers
            .get(&layer)
            .ok_or(ExpertError::NoSuchLayer { layer })
    }
}

impl StreamingExperts {
    /// Runs `items` (run index, expert) in parallel (as `map_blocks` spreads them) into `outs`,
    /// then releases them; returns the seconds spent. `local` (the caller's shared expert, see
    /// [`ExpertExecutor::start_beside`]) runs as the loop's first item, its result into its slot
    /// (and its time into the seconds: the loop's are one wall time).
    fn compute(
        &self,
        batch: &ExpertBatch<'_>,
        runs: &[(u32, Vec<usize>)],
        items: Vec<(usize, Arc<SwiGlu>)>,
        outs: &mut [Option<Vec<f32>>],
        local: Option<(&LocalPart<'_>, &mut Option<Vec<f32>>)>,
    ) -> f64 {
        let inner = &*self.inner;
        let t0 = Instant::now();
        let first = usize::from(local.is_some());
        let (local_f, local_out) = match local {
            Some((f, out)) => (Some(f), Some(out)),
            None => (None, None),
        };
        let splits = items.iter().all(|(_, w)| w.splits());
        let mut ys: Vec<(usize, Vec<f32>)> =
            charm_shared::linear::map_blocks(first + items.len(), splits, |k| match (k, local_f) {
                (0, Some(f)) => (usize::MAX, f()),
                _ => {
                    let (i, w) = &items[k - first];
                    let slots = &runs[*i].1;
                    (
                        *i,
                        w.forward(&gather(batch, slots, inner.hidden), slots.len()),
                    )
                }
            });
        if let Some(out) = local_out {
            *out = Some(ys.remove(0).1);
        }
        let secs = t0.elapsed().as_secs_f64();
        drop(items);
        let mut st = lock(&inner.state);
        for (i, y) in ys {
            inner.release(&mut st, (batch.layer, runs[i].0));
            outs[i] = Some(y);
        }
        // the released experts may make room for a queued read
        let wake = st.readers_have_work();
        drop(st);
        if wake {
            inner.cv.notify_all();
        }
        secs
    }
}

/// The caller's own part of a layer run beside its experts ([`ExpertExecutor::start_beside`]).
type LocalPart<'a> = dyn Fn() -> Vec<f32> + Sync + 'a;

impl StreamingExperts {
    /// [`ExpertExecutor::run`], with `local` (see [`ExpertExecutor::start_beside`]) run beside
    /// the resident experts into `local_y` when there are any.
    fn run_beside(
        &self,
        batch: ExpertBatch<'_>,
        local: Option<&LocalPart<'_>>,
        local_y: &mut Option<Vec<f32>>,
    ) -> Result<Vec<f32>, ExpertError> {
        let inner = &*self.inner;
        let called = Instant::now();
        let hidden = inner.hidden;
        batch.check(hidden)?;
        let layer = batch.layer;
        let count = self.layer(layer)?.meta.count;
        if let Some(&bad) = batch.ids.iter().find(|&&e| e as usize >= count) {
            return Err(ExpertError::NoSuchExpert {
                layer,
                expert: bad,
                count,
            });
        }
        let runs = plan_runs(&batch);
        // Classify under the lock: reserve resident experts, queue the missing ones.
        let mut hits = Vec::new();
        let mut missing: Vec<usize> = Vec::new();
        let wake = {
            let mut st = lock(&inner.state);
            if let Some(pred) = st.predicted.remove(&layer) {
                st.stats.lookahead_used += runs.len() as u64;
                st.stats.lookahead_predicted_used +=
                    runs.iter().filter(|(id, _)| pred.contains(id)).count() as u64;
            }
            st.tick += 1;
            let tick = st.tick;
            for (i, (id, slots)) in runs.iter().enumerate() {
                let k = (layer, *id);
                if st.early_read.remove(&k) {
                    st.stats.early_used += 1;
                }
                *st.freq.entry(k).or_insert(0.0) += 1.0;
                st.history.add(layer, *id as usize, slots.len() as u64);
                if let Some(e) = st.entries.get_mut(&k) {
                    e.in_use += 1;
                    e.used = true;
                    e.last = tick;
                    hits.push((i, e.w.clone()));
                    if e.transient {
                        // a read-ahead staged for this step: from disk, but already here
                        st.stats.misses += 1;
                        st.stats.read_ahead_in_time += 1;
                    } else {
                        st.stats.hits += 1;
                    }
                } else {
                    st.stats.misses += 1;
                    *st.wanted.entry(k).or_insert(0) += 1;
                    if !Inner::enqueue(&mut st, k, Queue::Demand) {
                        // already coming (a read-ahead, warm-up or early guess still queued):
                        // move it to the front
                        let st = &mut *st;
                        for q in [&mut st.lookahead, &mut st.warm, &mut st.early] {
                            if let Some(p) = q.iter().position(|q| *q == k) {
                                q.remove(p);
                                st.demand.push_front(k);
                                break;
                            }
                        }
                    }
                    missing.push(i);
                }
            }
            // Staged read-aheads of this or earlier layers that this step did not use.
            let stale: Vec<Key> = st
                .entries
                .iter()
                .filter(|(k, e)| k.0 <= layer && e.transient && e.in_use == 0)
                .map(|(k, _)| *k)
                .collect();
            for k in stale {
                if let Some(e) = st.entries.remove(&k) {
                    st.bytes -= e.bytes;
                    inner.wasted(&mut st, k);
                }
            }
            // Read-aheads for this or earlier layers that nobody waits for.
            let stale: Vec<Key> = st
                .lookahead
                .iter()
                .copied()
                .filter(|k| k.0 <= layer)
                .collect();
            st.lookahead.retain(|k| k.0 > layer);
            for k in stale {
                st.pending.remove(&k);
            }
            Inner::drop_early(&mut st, |k| k.0 <= layer);
            st.early_read.retain(|k| k.0 > layer);
            st.readers_have_work()
        };
        if wake {
            inner.cv.notify_all();
        }

        let mut outs: Vec<Option<Vec<f32>>> = vec![None; runs.len()];
        // the caller's shared expert beside the resident experts (alone, with every thread, when
        // none is resident)
        let beside = local
            .filter(|_| !hits.is_empty())
            .map(|f| (f, &mut *local_y));
        let mut compute_s = self.compute(&batch, &runs, hits, &mut outs, beside);

        // Compute missing experts as they arrive.
        let mut wait_s = 0.0;
        let mut error = None;
        while !missing.is_empty() {
            let mut ready = Vec::new();
            {
                let mut st = lock(&inner.state);
                loop {
                    let mut k = 0;
                    while k < missing.len() {
                        let key = (layer, runs[missing[k]].0);
                        if let Some(e) = st.failed.remove(&key) {
                            error.get_or_insert((key, e));
                            // not taken: drop the reservation of a later arrival
                            missing.swap_remove(k);
                        } else if let Some(e) = st.entries.get_mut(&key) {
                            e.used = true;
                            ready.push((missing[k], e.w.clone()));
                            missing.swap_remove(k);
                        } else if !st.pending.contains(&key) {
                            // dropped from the queues (cannot happen for demand); re-queue
                            Inner::enqueue(&mut st, key, Queue::Demand);
                            k += 1;
                        } else {
                            k += 1;
                        }
                    }
                    if !ready.is_empty() || missing.is_empty() {
                        break;
                    }
                    let w0 = Instant::now();
                    st = inner.wait(st);
                    wait_s += w0.elapsed().as_secs_f64();
                    Timeline::add(&inner.timeline, "wait", (layer, 0), false, w0, 0);
                }
            }
            compute_s += self.compute(&batch, &runs, ready, &mut outs, None);
        }
        {
            let mut st = lock(&inner.state);
            st.stats.wait_seconds += wait_s;
            st.stats.compute_seconds += compute_s;
        }
        Timeline::add(&inner.timeline, "experts", (layer, 0), false, called, 0);
        if let Some(((layer, expert), why)) = error {
            return Err(ExpertError::Unavailable { layer, expert, why });
        }
        let outs: Vec<Vec<f32>> = outs
            .into_iter()
            .map(|o| o.expect("every expert ran"))
            .collect();
        Ok(combine(&batch, hidden, &runs, &outs))
    }
}

impl ExpertExecutor for StreamingExperts {
    fn lookahead(&self) -> Option<LookaheadPolicy> {
        // Nothing to read ahead when the cache holds every expert.
        (self.inner.capacity() < self.inner.total_bytes).then_some(LOOKAHEAD)
    }

    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.run_beside(batch, None, &mut None)
    }

    fn start_beside(
        &self,
        batch: ExpertBatch<'_>,
        local: &(dyn Fn() -> Vec<f32> + Sync),
    ) -> (PendingExperts, Vec<f32>) {
        let mut y = None;
        let r = self.run_beside(batch, Some(local), &mut y);
        // not run beside (no resident expert, or an error first): on its own
        let y = y.unwrap_or_else(local);
        (PendingExperts::ready(r), y)
    }

    fn prefetch(&self, layer: usize, ids: &[u32], sure: usize) {
        let mut st = lock(&self.inner.state);
        self.inner.lookahead(&mut st, layer, ids, sure);
        drop(st);
        self.inner.cv.notify_all();
    }

    fn prefetch_early(&self, layer: usize, ids: &[u32]) {
        let mut st = lock(&self.inner.state);
        self.inner.early(&mut st, layer, ids);
        drop(st);
        self.inner.cv.notify_all();
    }

    fn step_end(&self) {
        let inner = &*self.inner;
        let mut st = lock(&inner.state);
        st.step += 1;
        st.history.steps += 1;
        let step = st.step;
        if inner.opts.decay_every > 0 && step.is_multiple_of(inner.opts.decay_every) {
            for v in st.freq.values_mut() {
                *v *= 0.5;
            }
        }
        if inner.opts.repin_every > 0 && step.is_multiple_of(inner.opts.repin_every) {
            inner.repin(&mut st);
        }
    }

    fn stats(&self) -> Option<ExpertStats> {
        let st = lock(&self.inner.state);
        let mut s = st.stats.clone();
        s.cache_bytes = st.bytes;
        Some(s)
    }
}
