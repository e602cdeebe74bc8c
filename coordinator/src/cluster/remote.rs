//! Routed experts on other machines: an [`ExpertExecutor`] that sends each MoE layer's expert
//! work to the cluster's workers over QUIC with mutual TLS and combines their answers exactly as
//! single-box mode does.
//!
//! - **Requests.** Per layer and step, one request per worker carries the rows of every token
//!   routed to the experts asked of it (the union over the step's tokens, each token's row once);
//!   a long prefill's goes as several requests of consecutive tokens, one after another, each
//!   request and answer within [`crate::cluster::ClusterOptions::request_bytes`] (the wire
//!   refuses frames over 64 MiB: a 3,000-token prompt of GLM-5.2 is 74 MB of activations);
//!   they are in flight while the caller computes its shared expert
//!   ([`ExpertExecutor::start`]) and while this machine computes the experts no worker takes.
//! - **Exactness.** Workers return unweighted per-expert outputs, added here in ascending expert
//!   order ([`combine`]) as single-box does, so logits are bit-identical whatever the placement.
//! - **Placement** ([`crate::cluster::Placement`]): by each worker's RAM and the routing
//!   history; a replicated expert goes to the holder with the fewest rows in the step so far.
//!   It is recomputed whenever a worker joins or comes back with other holdings.
//! - **Faults.** Every request has a deadline. A worker that fails, answers malformed or misses
//!   the deadline is dropped from use; its runs go to another live holder, else to this
//!   machine's own executor (which holds or streams every expert), so the step finishes with the
//!   same result. Heartbeats find lost workers between requests and dial them again; one that
//!   answers the handshake again is used from the next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use charm_shared::config::{MlpKind, ModelSpec};
use charm_shared::expert::{
    plan_runs, ExpertBatch, ExpertError, ExpertExecutor, ExpertStats, LookaheadPolicy,
    PendingExperts,
};
use charm_shared::wire::Hello;
use charm_worker::server::transport;
use charm_worker::tls::Identity;
use serde::Serialize;

use super::drive::Drive;
use super::inner::Inner;
use super::layer::{serve, OwnedBatch};
use super::link::{handshake, keep};
pub use super::workers::RequestTime;
use super::workers::{Shared, Source, Worker};
use crate::cluster::{ClusterOptions, Placement};

pub use crate::cluster::model_fingerprint;

/// The MoE layers of `spec` (decoder layers, then MTP layers) with their routed-expert counts.
pub fn moe_layers(spec: &ModelSpec) -> Vec<(usize, usize)> {
    let n = spec.router.as_ref().map_or(0, |r| r.n_experts);
    (0..spec.layers.len() + spec.mtp_layers)
        .filter(|&l| l >= spec.layers.len() || spec.layers[l].mlp == MlpKind::Moe)
        .map(|l| (l, n))
        .collect()
}

/// One worker's health and traffic, for `charm cluster status` and run statistics.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerStatus {
    pub name: String,
    pub addr: String,
    pub connected: bool,
    /// Why it is not connected, when it is not.
    pub error: Option<String>,
    /// The last request it could not serve, and why.
    pub refusal: Option<String>,
    /// Experts placed on it (all layers).
    pub experts: usize,
    /// RAM it gives experts, bytes (from its handshake).
    pub ram_bytes: u64,
    /// Free disk where its model lives, bytes (from its handshake).
    pub disk_free_bytes: u64,
    /// Expert rows per second it measured at start.
    pub expert_rate: f64,
    /// VRAM it gives experts on its GPU, bytes, and the adapter (from its handshake).
    pub vram_bytes: u64,
    pub gpu: String,
    /// The group its int8 activation codes come in (0: it takes f32).
    pub act_group: u32,
    pub requests: u64,
    /// Streams opened for them: one kept open carries them one after another, so more than one
    /// per connection means requests overlapped or one failed.
    pub compute_streams: u64,
    /// Of them, requests whose activations went as int8 codes.
    pub coded_requests: u64,
    pub failures: u64,
    /// Handshakes completed (more than one: it was lost and rejoined).
    pub joins: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Mean round trip of its answered requests, and the part of it the worker spent
    /// computing (as it reports), milliseconds.
    pub mean_rtt_ms: f64,
    pub mean_compute_ms: f64,
    /// Last heartbeat round trip, milliseconds.
    pub ping_ms: Option<f64>,
    /// Whether it fetches its shard from this coordinator, and the records and bytes sent it.
    pub fetches: bool,
    pub shard_records_sent: u64,
    pub shard_bytes_sent: u64,
}

/// The coordinator's executor when it has no expert files: every expert must come from a
/// worker.
#[derive(Debug, Default)]
pub struct NoLocalExperts;

impl ExpertExecutor for NoLocalExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        Err(ExpertError::Unavailable {
            layer: batch.layer,
            expert: batch.ids.first().copied().unwrap_or(0),
            why: "no live worker answered for it and this coordinator has no expert files".into(),
        })
    }

    fn holds_experts(&self) -> bool {
        false
    }
}

/// Routed experts computed by the cluster's workers, with this machine's executor behind them.
#[derive(Debug)]
pub struct RemoteExperts {
    pub(super) drive: Arc<Drive>,
    /// The runtime's idle driver, stopped on drop.
    idle: Option<std::thread::JoinHandle<()>>,
    pub(super) inner: Arc<Inner>,
}

impl Drop for RemoteExperts {
    fn drop(&mut self) {
        if let Some(t) = self.idle.take() {
            self.drive.stop(t);
        }
    }
}

impl RemoteExperts {
    /// Dials every worker of `opts` (at once) and handshakes. Workers that cannot be reached
    /// or refuse are named in the returned warnings and dialled again every heartbeat; `local`
    /// computes what no worker answers. `model` is the fingerprint the workers must share,
    /// `activations` the mode they must compute in (`None`: any, for a probe that sends no
    /// expert work), `heat` the routing history's uses per `(layer, expert)`.
    pub fn connect(
        opts: &ClusterOptions,
        model: &str,
        activations: Option<&str>,
        spec: &ModelSpec,
        heat: HashMap<(usize, u32), u64>,
        local: Arc<dyn ExpertExecutor>,
        container: Option<&std::path::Path>,
    ) -> Result<(Self, Vec<String>), String> {
        let source = match container {
            Some(dir) => Some(Source {
                dir: dir.to_path_buf(),
                layers: charm_shared::container::Container::open(dir)
                    .map_err(|e| e.to_string())?
                    .expert_layers()
                    .cloned()
                    .collect(),
            }),
            None => None,
        };
        opts.check()?;
        let identity = Identity::load(&opts.certs, &opts.node).map_err(|e| e.to_string())?;
        let mut client = identity.client_config().map_err(|e| e.to_string())?;
        client.transport_config(Arc::new(transport(opts.heartbeat)));
        let (drive, idle) = Drive::start()?;
        let endpoint = drive.block_on(async {
            let mut ep = match loopback_only(&opts.workers) {
                // workers all on this machine: nothing beyond loopback may reach the endpoint
                Some(ip) => quinn::Endpoint::client((ip, 0).into()),
                None => quinn::Endpoint::client((std::net::Ipv6Addr::UNSPECIFIED, 0).into())
                    .or_else(|_| {
                        quinn::Endpoint::client((std::net::Ipv4Addr::UNSPECIFIED, 0).into())
                    }),
            }
            .map_err(|e| format!("QUIC endpoint: {e}"))?;
            ep.set_default_client_config(client);
            Ok::<_, String>(ep)
        })?;
        let shared = Arc::new(Shared {
            hello: Hello::holding_nothing(
                &opts.node,
                model,
                activations.map(String::from).into_iter().collect(),
            ),
            endpoint,
            rt: drive.handle().clone(),
            source,
            workers: opts
                .workers
                .iter()
                .map(|a| Worker {
                    addr: a.clone(),
                    conn: Mutex::new(None),
                    hello: Mutex::new(None),
                    error: Mutex::new(Some("not dialled yet".into())),
                    refusal: Mutex::new(None),
                    requests: AtomicU64::new(0),
                    failures: AtomicU64::new(0),
                    joins: AtomicU64::new(0),
                    sent: AtomicU64::new(0),
                    received: AtomicU64::new(0),
                    rtt_ns: AtomicU64::new(0),
                    compute_ns: AtomicU64::new(0),
                    recent: Mutex::new(Default::default()),
                    coded: AtomicU64::new(0),
                    shard_records: AtomicU64::new(0),
                    shard_bytes: AtomicU64::new(0),
                    ping_us: AtomicU64::new(0),
                    lane: Mutex::new(Default::default()),
                    streams: AtomicU64::new(0),
                    vram: Default::default(),
                })
                .collect(),
            layers: moe_layers(spec),
            heat: Mutex::new(heat),
            placement: RwLock::new(Arc::new(Placement::default())),
            placements: AtomicU64::new(0),
            opts: opts.clone(),
        });
        // first contact with every worker, concurrently
        let results = drive.block_on(async {
            let tasks: Vec<_> = (0..shared.workers.len())
                .map(|i| {
                    let s = shared.clone();
                    tokio::spawn(async move {
                        let w = &s.workers[i];
                        let r = handshake(&s.endpoint, &w.addr, &s.hello, s.handshake_limit())
                            .await
                            .and_then(|(c, h)| s.join(i, c, h));
                        if let Err(e) = &r {
                            *w.error.lock().expect("worker lock") = Some(e.clone());
                        }
                        r
                    })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap_or_else(|e| Err(e.to_string())));
            }
            out
        });
        let mut warnings = Vec::new();
        for (w, r) in shared.workers.iter().zip(&results) {
            if let Err(e) = r {
                warnings.push(format!(
                    "worker {} at {}: {e} (dialled again every heartbeat)",
                    w.addr.name, w.addr.addr
                ));
            }
        }
        if results.iter().all(|r| r.is_err()) {
            warnings.push(
                "no worker reachable: routed experts run on this machine, where it has them".into(),
            );
        }
        shared.replace();
        for i in 0..shared.workers.len() {
            drive.handle().spawn(keep(shared.clone(), i));
        }
        let inner = Arc::new(Inner {
            shared,
            mtp_here: local.holds_experts(),
            local,
            main_layers: spec.layers.len(),
            hidden: spec.hidden_size,
            next_id: AtomicU64::new(1),
            fallbacks: AtomicU64::new(0),
            steps: AtomicU64::new(0),
        });
        Ok((
            Self {
                drive,
                idle: Some(idle),
                inner,
            },
            warnings,
        ))
    }

    /// Every configured worker's health and traffic.
    pub fn status(&self) -> Vec<WorkerStatus> {
        let p = self.placement();
        self.inner
            .shared
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let requests = w.requests.load(Ordering::Relaxed);
                let ok = requests.saturating_sub(w.failures.load(Ordering::Relaxed));
                let hello = w.hello.lock().expect("worker lock");
                let conn = w.conn();
                let ping = w.ping_us.load(Ordering::Relaxed);
                WorkerStatus {
                    name: w.addr.name.clone(),
                    addr: w.addr.addr.to_string(),
                    connected: conn.is_some(),
                    error: if conn.is_some() {
                        None
                    } else {
                        w.error.lock().expect("worker lock").clone()
                    },
                    refusal: w.refusal.lock().expect("worker lock").clone(),
                    experts: p.count(i),
                    ram_bytes: hello.as_ref().map_or(0, |h| h.ram_bytes),
                    disk_free_bytes: hello.as_ref().map_or(0, |h| h.disk_free_bytes),
                    expert_rate: hello.as_ref().map_or(0.0, |h| h.expert_rate),
                    vram_bytes: hello.as_ref().map_or(0, |h| h.vram_bytes),
                    gpu: hello.as_ref().map_or(String::new(), |h| h.gpu.clone()),
                    act_group: hello.as_ref().map_or(0, |h| h.act_group),
                    requests,
                    compute_streams: w.streams.load(Ordering::Relaxed),
                    coded_requests: w.coded.load(Ordering::Relaxed),
                    failures: w.failures.load(Ordering::Relaxed),
                    joins: w.joins.load(Ordering::Relaxed),
                    bytes_sent: w.sent.load(Ordering::Relaxed),
                    bytes_received: w.received.load(Ordering::Relaxed),
                    mean_rtt_ms: w.rtt_ns.load(Ordering::Relaxed) as f64 / ok.max(1) as f64 / 1e6,
                    mean_compute_ms: w.compute_ns.load(Ordering::Relaxed) as f64
                        / ok.max(1) as f64
                        / 1e6,
                    ping_ms: (ping > 0).then(|| ping as f64 / 1e3),
                    fetches: hello.as_ref().is_some_and(|h| h.fetches),
                    shard_records_sent: w.shard_records.load(Ordering::Relaxed),
                    shard_bytes_sent: w.shard_bytes.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Worker `i`'s last answered requests' times (up to 8,192), oldest first.
    pub fn recent(&self, i: usize) -> Vec<RequestTime> {
        self.inner.shared.workers.get(i).map_or(Vec::new(), |w| {
            w.recent
                .lock()
                .expect("worker lock")
                .iter()
                .copied()
                .collect()
        })
    }

    /// The placement in use.
    /// Per worker (in the cluster's order), the experts it holds in VRAM by its last heartbeat.
    pub fn vram_held(&self) -> Vec<Vec<(usize, u32)>> {
        self.inner
            .shared
            .workers
            .iter()
            .map(|w| w.vram_held())
            .collect()
    }

    pub fn placement(&self) -> Arc<Placement> {
        self.inner
            .shared
            .placement
            .read()
            .expect("placement lock")
            .clone()
    }

    /// Names of the workers connected now.
    pub fn connected(&self) -> Vec<String> {
        self.inner
            .shared
            .workers
            .iter()
            .filter(|w| w.conn().is_some())
            .map(|w| w.addr.name.clone())
            .collect()
    }

    /// Expert runs computed on this machine because no live worker held them or one failed.
    pub fn fallbacks(&self) -> u64 {
        self.inner.fallbacks.load(Ordering::Relaxed)
    }

    /// Placements computed so far: the first, then one per change (a worker joined with new
    /// holdings, or the routing seen moved the hot set).
    pub fn placements(&self) -> u64 {
        self.inner.shared.placements.load(Ordering::Relaxed)
    }

    /// Bytes of requests and results moved so far.
    pub fn wire_bytes(&self) -> u64 {
        self.inner
            .shared
            .workers
            .iter()
            .map(|w| w.sent.load(Ordering::Relaxed) + w.received.load(Ordering::Relaxed))
            .sum()
    }
}

/// A layer's combined answer, received on the waiting thread: polled for `spin` (the runtime's
/// I/O looked at without sleeping), then asleep until it comes.
async fn answer(
    mut rx: tokio::sync::oneshot::Receiver<Result<Vec<f32>, ExpertError>>,
    spin: std::time::Duration,
) -> Result<Vec<f32>, ExpertError> {
    let lost = || ExpertError::Internal("expert work ended without a result".into());
    let until = std::time::Instant::now() + spin;
    while std::time::Instant::now() < until {
        match rx.try_recv() {
            Ok(r) => return r,
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => tokio::task::yield_now().await,
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => return Err(lost()),
        }
    }
    rx.await.unwrap_or_else(|_| Err(lost()))
}

impl ExpertExecutor for RemoteExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.start(batch).wait()
    }

    fn start(&self, batch: ExpertBatch<'_>) -> PendingExperts {
        if let Err(e) = batch.check(self.inner.hidden) {
            return PendingExperts::ready(Err(e));
        }
        // the MTP layer drafts: its experts run here when this machine has them, so a draft costs
        // no round trip
        if self.inner.mtp_here && batch.layer >= self.inner.main_layers {
            return self.inner.local.start(batch);
        }
        let runs = Arc::new(plan_runs(&batch));
        {
            let mut heat = self.inner.shared.heat.lock().expect("heat lock");
            for (id, slots) in runs.iter() {
                *heat.entry((batch.layer, *id)).or_insert(0) += slots.len() as u64;
            }
        }
        let owned = Arc::new(OwnedBatch::new(&batch));
        let inner = self.inner.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
        // the requests go out from this thread before it computes on (the shared expert); the
        // layer's task is spawned from inside the runtime, so it is queued here without waking
        // the runtime's driver
        self.drive.block_on(async {
            tokio::spawn(async move {
                let _ = tx.send(serve(inner, owned, runs, Some(sent_tx)).await);
            });
            let _ = sent_rx.await;
        });
        let (drive, spin) = (self.drive.clone(), self.inner.shared.opts.spin);
        PendingExperts::deferred(move || drive.block_on(answer(rx, spin)))
    }

    fn lookahead(&self) -> Option<LookaheadPolicy> {
        None
    }

    fn step_end(&self) {
        self.inner.local.step_end();
        let every = self.inner.shared.opts.rebalance_steps;
        let n = self.inner.steps.fetch_add(1, Ordering::Relaxed) + 1;
        if every > 0 && n.is_multiple_of(every) {
            self.inner.shared.replace();
        }
    }

    fn stats(&self) -> Option<ExpertStats> {
        self.inner.local.stats()
    }
}

/// The loopback address to bind the endpoint on when every worker is on loopback of one IP
/// version (`charm demo`'s workers), so the endpoint is not reachable from other machines;
/// `None` when a worker is elsewhere (or there are none).
fn loopback_only(workers: &[crate::cluster::WorkerAddr]) -> Option<std::net::IpAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let first = workers.first()?.addr.ip();
    let same = workers.iter().all(|w| {
        let ip = w.addr.ip();
        ip.is_loopback() && ip.is_ipv4() == first.is_ipv4()
    });
    same.then(|| {
        if first.is_ipv4() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            IpAddr::V6(Ipv6Addr::LOCALHOST)
        }
    })
}
