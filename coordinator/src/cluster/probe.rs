//! Measuring a live cluster for the predictor ([`super::predict`]): the coordinator's dense pass
//! (this machine running the model's own dense skeleton, expert outputs left at zero) and, per
//! worker, what a layer request costs, with real requests through the same client the forward
//! pass uses: its fixed part, its part per byte, and the worker's compute per expert.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use charm_shared::config::ModelSpec;
use charm_shared::container::Container;
use charm_shared::expert::{ExpertBatch, ExpertError, ExpertExecutor, PendingExperts};
use charm_shared::quant::Activations;
use charm_shared::LoadError;

use super::predict::{predict, ModelCost, Node, Prediction, Setup};
use super::remote::{moe_layers, RemoteExperts};
use crate::decode::sampling::{Sampler, SamplingParams};
use crate::model::cache::KvCache;
use crate::model::{open_container, open_source, Model};
use crate::ops::plan::Plan;
use crate::ForwardOptions;

/// Routed experts that contribute nothing, answered at once or, like a worker, from another
/// thread `delay` after the layer asked (the forward thread computes its shared expert and then
/// waits as it does for a real round trip).
#[derive(Debug)]
struct ZeroExperts {
    hidden: usize,
    /// How long a wait polls before it sleeps, as the cluster's waits do.
    spin: Duration,
    delay_ns: AtomicU64,
    jobs: Mutex<mpsc::Sender<Job>>,
}

type Job = (
    Instant,
    usize,
    mpsc::SyncSender<Result<Vec<f32>, ExpertError>>,
);

impl ZeroExperts {
    fn new(hidden: usize, spin: Duration) -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::spawn(move || {
            while let Ok((due, n, reply)) = rx.recv() {
                sleep_until(due);
                let _ = reply.send(Ok(vec![0.0; n]));
            }
        });
        Arc::new(Self {
            hidden,
            spin,
            delay_ns: AtomicU64::new(0),
            jobs: Mutex::new(tx),
        })
    }
}

impl ExpertExecutor for ZeroExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.start(batch).wait()
    }

    fn start(&self, batch: ExpertBatch<'_>) -> PendingExperts {
        let n = batch.n_tokens * self.hidden;
        let d = self.delay_ns.load(Ordering::Relaxed);
        if d == 0 {
            return PendingExperts::ready(Ok(vec![0.0; n]));
        }
        let (tx, pending) = super::polled_channel(self.spin);
        let due = Instant::now() + Duration::from_nanos(d);
        let sent = self.jobs.lock().expect("jobs lock").send((due, n, tx));
        match sent {
            Ok(()) => pending,
            Err(_) => PendingExperts::ready(Ok(vec![0.0; n])),
        }
    }
}

/// The coordinator's dense pass measured on this machine, as it runs between waits for the
/// workers: seconds per decoded token after a prompt of `position` tokens, and what each
/// further token of a `1 + draft`-token step adds. Loads the dense skeleton of `dir` (a
/// container or checkpoint), not its experts.
///
/// Each MoE layer's experts answer from another thread after a fixed delay (longer than the
/// shared expert), so the pass pays what waiting costs it (the compute helpers parked and woken,
/// the thread hand-off); the delay less the shared expert's share of the dense time (the part of
/// the wait it hides; `shared_share`: its bytes over the dense pass's) comes off again. Waits
/// poll for `spin` before they sleep, as the cluster's do.
pub fn dense_speed(
    dir: &Path,
    act: Activations,
    draft: usize,
    position: usize,
    shared_share: f64,
    spin: Duration,
    gpu: bool,
) -> Result<(f64, f64), String> {
    let err = |e: LoadError| e.to_string();
    let (model, zero) = if Container::is_container(dir) {
        let (spec, c) = open_container(dir).map_err(err)?;
        let zero = ZeroExperts::new(spec.hidden_size, spin);
        (
            Model::build(spec, &c, Some(zero.clone()), act).map_err(err)?,
            zero,
        )
    } else {
        let (spec, src) = open_source(dir).map_err(err)?;
        let zero = ZeroExperts::new(spec.hidden_size, spin);
        (
            Model::build(spec, &*src, Some(zero.clone()), act).map_err(err)?,
            zero,
        )
    };
    let mut model = model;
    if gpu {
        let device = charm_worker::gpu::Gpu::open(None).map_err(|e| e.to_string())?;
        model
            .attach_dense_gpu(std::sync::Arc::new(device))
            .map_err(|e| e.to_string())?;
    }
    let spec = &model.spec;
    let moe = moe_layers(spec)
        .iter()
        .filter(|l| l.0 < spec.layers.len())
        .count();
    let vocab = spec.vocab_size as u32;
    let tok = |i: usize| (i as u32 * 37 + 11) % vocab.max(2);
    let (warm, steps, wide) = (4, 32, 8);
    let mut cache = KvCache::new(spec);
    let prompt: Vec<u32> = (0..position.max(1)).map(tok).collect();
    cache.reserve(
        prompt.len() + 2 * (warm + steps) + wide * (draft + 1) + 8,
        spec,
    );
    let h = spec.hidden_size;
    let sampler = Mutex::new(Sampler::new(SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 1,
        ..Default::default()
    }));
    let fwd = |ids: &[u32], cache: &mut KvCache| -> Result<(), String> {
        let normed = model
            .forward(ids, cache, ForwardOptions::default(), None)
            .map_err(|e| e.to_string())?;
        let rows = ids.len();
        // a step's logits: every row of a speculative step is checked against its token,
        // sampled (temperature 1)
        let logits = model
            .logits(&normed[..rows * h], rows)
            .map_err(|e| e.to_string())?;
        let v = logits.len() / rows;
        for r in 0..rows {
            sampler
                .lock()
                .expect("sampler")
                .sample(&logits[r * v..(r + 1) * v]);
        }
        Ok(())
    };
    fwd(&prompt, &mut cache)?;
    let time = |n: usize, width: usize, cache: &mut KvCache| -> Result<f64, String> {
        let t = Instant::now();
        for i in 0..n {
            let ids: Vec<u32> = (0..width).map(|j| tok(100 + i * width + j)).collect();
            fwd(&ids, cache)?;
        }
        Ok(t.elapsed().as_secs_f64() / n as f64)
    };
    time(warm, 1, &mut cache)?;
    let plain = time(steps, 1, &mut cache)?;
    let extra = if draft > 0 {
        let step = time(wide, draft + 1, &mut cache)?;
        ((step - plain) / draft as f64).max(0.0)
    } else {
        0.0
    };
    if moe == 0 {
        return Ok((plain, extra));
    }
    let shared = plain * shared_share;
    let delay = (2.0 * shared).max(300e-6);
    zero.delay_ns.store((delay * 1e9) as u64, Ordering::Relaxed);
    time(warm, 1, &mut cache)?;
    let waiting = time(steps, 1, &mut cache)?;
    zero.delay_ns.store(0, Ordering::Relaxed);
    let dense = (waiting - moe as f64 * (delay - shared)).max(plain);
    Ok((dense, extra))
}

/// Requests of each size timed per worker.
const REPS: usize = 40;

/// Per connected worker with experts placed on it: the predictor's view from real requests.
/// All workers are asked at once, as a decode step's MoE layer asks them: requests of one token
/// and of 8 tokens, each to the worker's share of `top_k` experts of one MoE layer drawn afresh
/// from the experts only it holds (as routing does, so its caches are not warmer than in use),
/// with this machine's compute threads busy for `gap_s` before each (the dense work between two
/// MoE layers, which competes for the cores and lets the workers go idle as in use). A worker's
/// time for a request is its round trip plus what this thread waited beyond the slowest round
/// trip (the hand-offs to and from the client); its own compute (it reports it) comes off, and
/// the rest against the bytes moved gives the fixed cost and the link's rate. `disk_s`: seconds
/// to read one expert from a worker's disk (not probed).
pub fn probe_workers(r: &RemoteExperts, spec: &ModelSpec, disk_s: f64, gap_s: f64) -> Vec<Node> {
    struct Target {
        /// The worker's index.
        i: usize,
        share: f64,
        /// Experts per token.
        k: usize,
        layer: usize,
        /// Experts of `layer` only this worker holds.
        pool: Vec<u32>,
        rng: u64,
    }
    let p = r.placement();
    let status = r.status();
    let h = spec.hidden_size;
    let top_k = spec.router.as_ref().map_or(0, |r| r.top_k);
    let layers: Vec<(usize, usize)> = moe_layers(spec)
        .into_iter()
        .filter(|l| l.0 < spec.layers.len())
        .collect();
    let total: usize = (0..status.len()).map(|i| p.count(i)).sum();
    let mut targets = Vec::new();
    for (i, w) in status.iter().enumerate() {
        if !w.connected || p.count(i) == 0 || top_k == 0 {
            continue;
        }
        let share = p.count(i) as f64 / total.max(1) as f64;
        let want = ((top_k as f64 * share).round() as usize).clamp(1, top_k);
        // the layer with the most experts held by this worker alone
        let pick = layers
            .iter()
            .map(|&(l, n)| {
                let ids: Vec<u32> = (0..n as u32).filter(|&e| p.holders(l, e) == [i]).collect();
                (l, ids)
            })
            .max_by_key(|(_, ids)| ids.len());
        let Some((layer, pool)) = pick.filter(|(_, ids)| !ids.is_empty()) else {
            continue;
        };
        targets.push(Target {
            i,
            share,
            k: want.min(pool.len()),
            layer,
            pool,
            rng: 0x9E37_79B9_7F4A_7C15u64 ^ i as u64,
        });
    }
    // (round trip, compute) summed over a worker's answered requests, milliseconds
    let sums = |w: &super::remote::WorkerStatus| {
        let ok = w.requests.saturating_sub(w.failures) as f64;
        (w.mean_rtt_ms * ok, w.mean_compute_ms * ok)
    };
    let mut step = 1u64 << 40;
    // per target: each request's time (s), mean compute (s) and bytes per request
    let mut measure = |tokens: usize| -> Option<Vec<(Vec<f64>, f64, f64)>> {
        let x: Vec<f32> = (0..tokens * h).map(|j| ((j as f32) * 0.37).sin()).collect();
        let first = r.status();
        let mut walls = vec![Vec::with_capacity(REPS); targets.len()];
        for rep in 0..REPS + 4 {
            let batches: Vec<(Vec<u32>, Vec<f32>)> = targets
                .iter_mut()
                .map(|t| {
                    // each token's experts drawn from the pool, ascending and distinct
                    let mut all = Vec::with_capacity(tokens * t.k);
                    for _ in 0..tokens {
                        let mut ids: Vec<u32> = Vec::with_capacity(t.k);
                        while ids.len() < t.k {
                            t.rng ^= t.rng << 13;
                            t.rng ^= t.rng >> 7;
                            t.rng ^= t.rng << 17;
                            let e = t.pool[(t.rng % t.pool.len() as u64) as usize];
                            if !ids.contains(&e) {
                                ids.push(e);
                            }
                        }
                        ids.sort_unstable();
                        all.extend(ids);
                    }
                    (all, vec![1.0 / t.k as f32; tokens * t.k])
                })
                .collect();
            busy(gap_s);
            step += 1;
            let before = r.status();
            let t0 = Instant::now();
            let pending: Vec<_> = targets
                .iter()
                .zip(&batches)
                .map(|(t, (ids, wts))| {
                    r.start(ExpertBatch {
                        step,
                        layer: t.layer,
                        x: &x,
                        n_tokens: tokens,
                        ids,
                        weights: wts,
                        top_k: t.k,
                    })
                })
                .collect();
            for w in pending {
                w.wait().ok()?;
            }
            let wall = t0.elapsed().as_secs_f64();
            let after = r.status();
            if rep >= 4 {
                let rtts: Vec<f64> = targets
                    .iter()
                    .map(|t| (sums(&after[t.i]).0 - sums(&before[t.i]).0) / 1e3)
                    .collect();
                let beyond = (wall - rtts.iter().copied().fold(0.0, f64::max)).max(0.0);
                for (w, rtt) in walls.iter_mut().zip(rtts) {
                    w.push(rtt + beyond);
                }
            }
        }
        let last = r.status();
        Some(
            targets
                .iter()
                .zip(walls)
                .map(|(t, w)| {
                    let (a, b) = (&first[t.i], &last[t.i]);
                    let n = (b.requests - a.requests).max(1) as f64;
                    let compute = (sums(b).1 - sums(a).1) / n / 1e3;
                    let bytes = (b.bytes_sent + b.bytes_received - a.bytes_sent - a.bytes_received)
                        as f64
                        / n;
                    (w, compute, bytes)
                })
                .collect(),
        )
    };
    let (Some(one), Some(eight)) = (measure(1), measure(8)) else {
        return Vec::new();
    };
    let mean = |w: &[f64]| w.iter().sum::<f64>() / w.len().max(1) as f64;
    targets
        .iter()
        .zip(one.into_iter().zip(eight))
        .map(
            |(t, ((walls1, compute1, bytes1), (walls8, compute8, bytes8)))| {
                let (wall1, wall8) = (mean(&walls1), mean(&walls8));
                let (rest1, rest8) = (wall1 - compute1, wall8 - compute8);
                let per_byte = if bytes8 > bytes1 {
                    ((rest8 - rest1) / (bytes8 - bytes1)).max(0.0)
                } else {
                    0.0
                };
                let fixed = |wall: f64| (wall - compute1 - per_byte * bytes1).max(0.0);
                Node {
                    name: status[t.i].name.clone(),
                    share: t.share,
                    // the memory its experts compute from: RAM and VRAM
                    ram_bytes: status[t.i].ram_bytes + status[t.i].vram_bytes,
                    expert_s: compute1 / t.k as f64,
                    disk_s,
                    latency_s: fixed(wall1),
                    latency_samples_s: walls1.iter().map(|&w| fixed(w)).collect(),
                    bytes_s: if per_byte > 0.0 {
                        1.0 / per_byte
                    } else {
                        f64::INFINITY
                    },
                    in_process: false,
                    // (a GPU worker's probed compute ran through its VRAM tier; its VRAM is
                    // not split out here)
                    gpu: None,
                }
            },
        )
        .collect()
}

/// Returns at `due`, to within a few microseconds: sleeps most of the way and spins the last
/// stretch (a sleep's timer slack is ~50 us).
pub fn sleep_until(due: Instant) {
    loop {
        let now = Instant::now();
        if now >= due {
            return;
        }
        let left = due - now;
        if left > Duration::from_micros(120) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Keeps every compute thread of this process busy for `s` seconds.
fn busy(s: f64) {
    if s <= 0.0 {
        return;
    }
    let until = Instant::now() + Duration::from_secs_f64(s);
    charm_shared::par::for_each(charm_shared::par::threads(), |_| {
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    });
}

/// The predictor's input for a probed cluster: the dense pass as measured (`dense`: per token,
/// per further token of a step), the shared expert and an MTP draft in proportion to their bytes.
fn live_setup(
    dense: (f64, f64),
    m: &ModelCost,
    nodes: Vec<Node>,
    gpu: bool,
    (replicas, hot_share): (usize, f64),
) -> Setup {
    Setup {
        source: "probed".into(),
        dense_device: if gpu { "gpu" } else { "cpu" }.into(),
        dense_s: dense.0,
        dense_extra_s: dense.1,
        shared_s: dense.0 * m.dense_share(m.shared_read_bytes),
        mtp_s: dense.0 * m.dense_share(m.mtp_read_bytes),
        coordinator_bytes_s: f64::INFINITY,
        nodes,
        replicas,
        hot_share,
    }
}

/// The workers' disk read speed a live prediction assumes unless told (not probed), bytes/s.
pub const WORKER_DISK_BYTES_S: f64 = 2e9;

/// What a live prediction is asked for.
#[derive(Debug, Clone, Copy)]
pub struct LiveOptions {
    pub act: Activations,
    /// Drafts per speculative step (0: plain decoding only) and their acceptance.
    pub draft: usize,
    pub acceptance: f64,
    /// Context position the dense pass is timed at.
    pub position: usize,
    /// The workers' disk read speed for experts their RAM does not hold, bytes/s.
    pub worker_disk_bytes_s: f64,
    /// The dense pass on this machine's GPU (`--dense-device gpu`): it is measured there.
    pub dense_gpu: bool,
}

/// `charm plan --cluster`'s prediction for the live cluster `r` serving the model in `dir`
/// (planned as `plan`): this machine's dense pass measured, then each worker probed.
pub fn predict_live(
    dir: &Path,
    r: &RemoteExperts,
    spec: &ModelSpec,
    plan: &Plan,
    o: LiveOptions,
) -> Result<Prediction, String> {
    // requests carry int8 codes when every connected worker takes them in one group
    let groups: Vec<u32> = r
        .status()
        .iter()
        .filter(|w| w.connected)
        .map(|w| w.act_group)
        .collect();
    let group = match o.act {
        Activations::Int8
            if !groups.is_empty() && groups.iter().all(|&g| g > 0 && g == groups[0]) =>
        {
            groups[0] as usize
        }
        _ => 0,
    };
    let m = ModelCost::from_plan(plan, spec.hidden_size, group);
    let dense = dense_speed(
        dir,
        o.act,
        o.draft,
        o.position,
        m.dense_share(m.shared_read_bytes),
        r.inner.shared.opts.spin,
        o.dense_gpu,
    )
    .map_err(|e| format!("measuring the dense pass needs the model's dense weights here: {e}"))?;
    let gap = dense.0 / m.moe_layers.max(1) as f64;
    let disk_s = m.expert_bytes as f64 / o.worker_disk_bytes_s;
    let nodes = probe_workers(r, spec, disk_s, gap);
    if nodes.is_empty() {
        return Err(
            "no worker answered the probe's requests: nothing to predict the cluster's speed from"
                .into(),
        );
    }
    Ok(predict(
        live_setup(
            dense,
            &m,
            nodes,
            o.dense_gpu,
            (r.inner.shared.opts.replicas, r.inner.shared.opts.hot_share),
        ),
        &m,
        o.draft,
        o.acceptance,
    ))
}
