//! Routed experts on other machines: an [`ExpertExecutor`] that sends each MoE layer's expert
//! work to the cluster's workers over QUIC with mutual TLS and combines their answers exactly as
//! single-box mode does.
//!
//! - **Requests.** Per layer and step, one request per worker carries the rows of every token
//!   routed to the experts asked of it (the union over the step's tokens, each token's row once);
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
use std::time::{Duration, Instant};

use charm_shared::config::{MlpKind, ModelSpec};
use charm_shared::expert::{
    combine, gather, plan_runs, ExpertBatch, ExpertError, ExpertExecutor, ExpertStats,
    LookaheadPolicy, PendingExperts,
};
use charm_shared::wire::{
    encode, ComputeRequest, ComputeResult, Hello, Message, Run, PROTOCOL_VERSION,
};
use charm_worker::server::{read_frame, transport, write_frame};
use charm_worker::tls::Identity;
use serde::Serialize;

use crate::cluster::{Capacity, ClusterOptions, Placement, WorkerAddr};

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
    /// The group its int8 activation codes come in (0: it takes f32).
    pub act_group: u32,
    pub requests: u64,
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

#[derive(Debug)]
struct Worker {
    addr: WorkerAddr,
    conn: Mutex<Option<quinn::Connection>>,
    hello: Mutex<Option<Hello>>,
    error: Mutex<Option<String>>,
    /// The last request it refused, and why.
    refusal: Mutex<Option<String>>,
    requests: AtomicU64,
    failures: AtomicU64,
    joins: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    rtt_us: AtomicU64,
    compute_us: AtomicU64,
    ping_us: AtomicU64,
    /// Requests whose activations went as int8 codes.
    coded: AtomicU64,
    /// Expert records (whole) and bytes sent to it for its shard.
    shard_records: AtomicU64,
    shard_bytes: AtomicU64,
}

impl Worker {
    fn conn(&self) -> Option<quinn::Connection> {
        let g = self.conn.lock().expect("worker lock");
        g.as_ref().filter(|c| c.close_reason().is_none()).cloned()
    }
    fn lost(&self, why: String) {
        if let Some(c) = self.conn.lock().expect("worker lock").take() {
            c.close(0u32.into(), b"lost");
        }
        *self.error.lock().expect("worker lock") = Some(why);
    }
}

/// The container whose records fetching workers ask for.
#[derive(Debug)]
struct Source {
    dir: std::path::PathBuf,
    layers: Vec<charm_shared::container::ExpertLayer>,
}

#[derive(Debug)]
struct Shared {
    opts: ClusterOptions,
    hello: Hello,
    endpoint: quinn::Endpoint,
    rt: tokio::runtime::Handle,
    source: Option<Source>,
    workers: Vec<Worker>,
    layers: Vec<(usize, usize)>,
    /// Uses per `(layer, expert)`: the routing history's, then the ones seen here.
    heat: Mutex<HashMap<(usize, u32), u64>>,
    placement: RwLock<Arc<Placement>>,
    /// Placements computed (the first, then one per change).
    placements: AtomicU64,
}

impl Shared {
    fn replace(&self) {
        let caps: Vec<Option<Capacity>> = self
            .workers
            .iter()
            .map(|w| {
                w.hello
                    .lock()
                    .expect("worker lock")
                    .as_ref()
                    .map(|h| Capacity {
                        ram_bytes: h.ram_bytes,
                        rate: h.expert_rate,
                        // a worker that fetches its shard can be given any expert
                        holds: if h.fetches && self.source.is_some() {
                            self.layers
                                .iter()
                                .map(|&(l, n)| (l, (0..n as u32).collect()))
                                .collect()
                        } else {
                            h.experts
                                .iter()
                                .map(|l| (l.layer as usize, l.ids.clone()))
                                .collect()
                        },
                    })
            })
            .collect();
        let p = {
            let heat = self.heat.lock().expect("heat lock");
            let heat = |l: usize, e: u32| heat.get(&(l, e)).copied().unwrap_or(0);
            Placement::compute(
                &self.layers,
                &caps,
                &heat,
                self.opts.replicas,
                self.opts.hot_share,
            )
        };
        {
            let mut cur = self.placement.write().expect("placement lock");
            if **cur == p && self.placements.load(Ordering::Relaxed) > 0 {
                return;
            }
            *cur = Arc::new(p);
        }
        self.placements.fetch_add(1, Ordering::Relaxed);
        for i in 0..self.workers.len() {
            self.assign(i);
        }
    }

    /// Tells worker `i`, if it fetches its shard, which experts are placed on it.
    fn assign(&self, i: usize) {
        let w = &self.workers[i];
        let fetches = w
            .hello
            .lock()
            .expect("worker lock")
            .as_ref()
            .is_some_and(|h| h.fetches);
        let (Some(conn), true) = (w.conn(), fetches && self.source.is_some()) else {
            return;
        };
        let experts = self
            .placement
            .read()
            .expect("placement lock")
            .assigned(i)
            .into_iter()
            .map(|(l, ids)| charm_shared::wire::LayerExperts {
                layer: l as u32,
                ids,
            })
            .collect();
        self.rt.spawn(async move {
            if let Ok((mut send, mut recv)) = conn.open_bi().await {
                if write_frame(&mut send, &Message::Assign { experts })
                    .await
                    .is_ok()
                {
                    let _ = read_frame(&mut recv).await;
                }
            }
        });
    }

    /// Answers the fetches worker `i` sends on `conn` with records of this coordinator's
    /// container, until the connection closes.
    async fn answer_fetches(self: Arc<Self>, i: usize, conn: quinn::Connection) {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let s = self.clone();
            tokio::spawn(async move {
                let reply = match read_frame(&mut recv).await {
                    Ok((
                        Message::Fetch {
                            layer,
                            expert,
                            offset,
                            len,
                        },
                        _,
                    )) => {
                        let s2 = s.clone();
                        tokio::task::spawn_blocking(move || s2.chunk(i, layer, expert, offset, len))
                            .await
                            .unwrap_or_else(|e| fetch_failed(e.to_string()))
                    }
                    Ok(_) => fetch_failed("a worker may only fetch".into()),
                    Err(e) => fetch_failed(e.to_string()),
                };
                let _ = write_frame(&mut send, &reply).await;
            });
        }
    }

    /// The bytes of one fetch, or why not.
    fn chunk(&self, i: usize, layer: u32, expert: u32, offset: u64, len: u32) -> Message {
        let Some(src) = &self.source else {
            return fetch_failed("this coordinator has no container to send records from".into());
        };
        let Some(l) = src.layers.iter().find(|l| l.layer == layer as usize) else {
            return fetch_failed(format!("layer {layer} has no experts"));
        };
        let end = offset.checked_add(len as u64);
        if expert as usize >= l.count
            || len as usize > charm_shared::wire::MAX_CHUNK
            || end.is_none_or(|e| e > l.record_bytes)
        {
            return fetch_failed(format!(
                "layer {layer} expert {expert}: bytes {offset}+{len} are outside its record"
            ));
        }
        let p = src.dir.join(&l.file);
        let read = std::fs::File::open(&p)
            .map_err(|e| e.to_string())
            .and_then(|f| {
                charm_shared::container::read_at(
                    &f,
                    &p,
                    expert as u64 * l.record_bytes + offset,
                    len as usize,
                )
                .map_err(|e| e.to_string())
            });
        match read {
            Ok(data) => {
                let w = &self.workers[i];
                w.shard_bytes.fetch_add(len as u64, Ordering::Relaxed);
                if end == Some(l.record_bytes) {
                    w.shard_records.fetch_add(1, Ordering::Relaxed);
                }
                Message::Chunk {
                    layer,
                    expert,
                    offset,
                    data,
                }
            }
            Err(e) => fetch_failed(e),
        }
    }

    /// Takes a connection whose handshake answered `h`, if the worker can serve this model.
    fn join(self: &Arc<Self>, i: usize, conn: quinn::Connection, h: Hello) -> Result<(), String> {
        let w = &self.workers[i];
        let mine = self.hello.activations.first();
        if mine.is_some_and(|m| !h.activations.contains(m)) {
            conn.close(0u32.into(), b"activation mode");
            return Err(format!(
                "computes in {}, this coordinator in {}",
                h.activations.join(", "),
                self.hello.activations.join(", ")
            ));
        }
        if h.node != w.addr.name {
            conn.close(0u32.into(), b"name");
            return Err(format!("calls itself {}", h.node));
        }
        let fetches = h.fetches;
        let changed = {
            let mut g = w.hello.lock().expect("worker lock");
            let changed = g.as_ref() != Some(&h);
            *g = Some(h);
            changed
        };
        *w.conn.lock().expect("worker lock") = Some(conn.clone());
        *w.error.lock().expect("worker lock") = None;
        w.joins.fetch_add(1, Ordering::Relaxed);
        if fetches {
            self.rt.spawn(self.clone().answer_fetches(i, conn));
        }
        if changed {
            self.replace();
        }
        // (again, if the placement changed: its assignment may not have)
        self.assign(i);
        Ok(())
    }

    fn handshake_limit(&self) -> Duration {
        self.opts.deadline.min(Duration::from_secs(10))
    }
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
}

impl Shared {
    /// Who expert `expert` of `layer` is placed on and what became of them, for an error.
    fn holders_of(&self, layer: usize, expert: u32) -> String {
        let p = self.placement.read().expect("placement lock").clone();
        let mut who: Vec<usize> = p.holders(layer, expert).to_vec();
        let placed = !who.is_empty();
        if !placed {
            who = (0..self.workers.len()).collect();
        }
        let names: Vec<String> = who
            .iter()
            .map(|&i| {
                let w = &self.workers[i];
                match (w.conn(), w.error.lock().expect("worker lock").clone()) {
                    (Some(_), _) => format!("{} (up)", w.addr.name),
                    (None, Some(e)) => format!("{} (down: {e})", w.addr.name),
                    (None, None) => format!("{} (down)", w.addr.name),
                }
            })
            .collect();
        if placed {
            format!("placed on {}", names.join(", "))
        } else if names.is_empty() {
            "the cluster lists no workers".into()
        } else {
            format!("placed on no worker yet; workers: {}", names.join(", "))
        }
    }
}

fn fetch_failed(message: String) -> Message {
    Message::Failed {
        id: 0,
        class: charm_shared::wire::FailureClass::BadRequest,
        message,
    }
}

/// Routed experts computed by the cluster's workers, with this machine's executor behind them.
#[derive(Debug)]
pub struct RemoteExperts {
    rt: tokio::runtime::Runtime,
    inner: Arc<Inner>,
}

/// What the task serving a layer needs.
#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    local: Arc<dyn ExpertExecutor>,
    hidden: usize,
    next_id: AtomicU64,
    fallbacks: AtomicU64,
    steps: AtomicU64,
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
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("charm-cluster")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let endpoint = rt.block_on(async {
            let mut ep = quinn::Endpoint::client((std::net::Ipv6Addr::UNSPECIFIED, 0).into())
                .or_else(|_| quinn::Endpoint::client((std::net::Ipv4Addr::UNSPECIFIED, 0).into()))
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
            rt: rt.handle().clone(),
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
                    rtt_us: AtomicU64::new(0),
                    compute_us: AtomicU64::new(0),
                    coded: AtomicU64::new(0),
                    shard_records: AtomicU64::new(0),
                    shard_bytes: AtomicU64::new(0),
                    ping_us: AtomicU64::new(0),
                })
                .collect(),
            layers: moe_layers(spec),
            heat: Mutex::new(heat),
            placement: RwLock::new(Arc::new(Placement::default())),
            placements: AtomicU64::new(0),
            opts: opts.clone(),
        });
        // first contact with every worker, concurrently
        let results = rt.block_on(async {
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
            rt.spawn(keep(shared.clone(), i));
        }
        let inner = Arc::new(Inner {
            shared,
            local,
            hidden: spec.hidden_size,
            next_id: AtomicU64::new(1),
            fallbacks: AtomicU64::new(0),
            steps: AtomicU64::new(0),
        });
        Ok((Self { rt, inner }, warnings))
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
                    act_group: hello.as_ref().map_or(0, |h| h.act_group),
                    requests,
                    coded_requests: w.coded.load(Ordering::Relaxed),
                    failures: w.failures.load(Ordering::Relaxed),
                    joins: w.joins.load(Ordering::Relaxed),
                    bytes_sent: w.sent.load(Ordering::Relaxed),
                    bytes_received: w.received.load(Ordering::Relaxed),
                    mean_rtt_ms: w.rtt_us.load(Ordering::Relaxed) as f64 / ok.max(1) as f64 / 1e3,
                    mean_compute_ms: w.compute_us.load(Ordering::Relaxed) as f64
                        / ok.max(1) as f64
                        / 1e3,
                    ping_ms: (ping > 0).then(|| ping as f64 / 1e3),
                    fetches: hello.as_ref().is_some_and(|h| h.fetches),
                    shard_records_sent: w.shard_records.load(Ordering::Relaxed),
                    shard_bytes_sent: w.shard_bytes.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// The placement in use.
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

/// Keeps worker `i` in use: pings it while connected, dials it again while not.
async fn keep(s: Arc<Shared>, i: usize) {
    let w = &s.workers[i];
    let mut seq = 0u64;
    loop {
        tokio::time::sleep(s.opts.heartbeat).await;
        match w.conn() {
            Some(c) => {
                seq += 1;
                let t = Instant::now();
                let limit = s.handshake_limit();
                match tokio::time::timeout(limit, ping(c, seq)).await {
                    Ok(Ok(())) => w
                        .ping_us
                        .store(t.elapsed().as_micros() as u64, Ordering::Relaxed),
                    Ok(Err(e)) => w.lost(format!("heartbeat: {e}")),
                    Err(_) => w.lost(format!("no heartbeat answer within {limit:?}")),
                }
            }
            None => {
                let r = handshake(&s.endpoint, &w.addr, &s.hello, s.handshake_limit())
                    .await
                    .and_then(|(c, h)| s.join(i, c, h));
                if let Err(e) = r {
                    *w.error.lock().expect("worker lock") = Some(e);
                }
            }
        }
    }
}

async fn ping(c: quinn::Connection, seq: u64) -> Result<(), String> {
    let (mut send, mut recv) = c.open_bi().await.map_err(|e| e.to_string())?;
    write_frame(&mut send, &Message::Ping { seq })
        .await
        .map_err(|e| e.to_string())?;
    match read_frame(&mut recv).await.map_err(|e| e.to_string())?.0 {
        Message::Pong { seq: s } if s == seq => Ok(()),
        _ => Err("answered a ping with something else".into()),
    }
}

async fn handshake(
    ep: &quinn::Endpoint,
    w: &WorkerAddr,
    hello: &Hello,
    limit: Duration,
) -> Result<(quinn::Connection, Hello), String> {
    let go = async {
        let conn = ep
            .connect(w.addr, &w.name)
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| format!("TLS/QUIC handshake: {e}"))?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        write_frame(&mut send, &Message::Hello(hello.clone()))
            .await
            .map_err(|e| e.to_string())?;
        match read_frame(&mut recv).await.map_err(|e| e.to_string())?.0 {
            Message::Hello(h) if h.version != PROTOCOL_VERSION => Err(format!(
                "speaks protocol version {}, this coordinator {PROTOCOL_VERSION}",
                h.version
            )),
            Message::Hello(h) if h.model != hello.model => Err(format!(
                "serves model {}, this coordinator {}",
                h.model, hello.model
            )),
            Message::Hello(h) => Ok((conn, h)),
            Message::Refused { reason } => Err(format!("refused: {reason}")),
            _ => Err("answered the hello with something else".into()),
        }
    };
    tokio::time::timeout(limit, go)
        .await
        .map_err(|_| format!("no handshake within {limit:?}"))?
}

/// What one request to one worker came back with.
enum Answer {
    Done(ComputeResult),
    /// The worker is fine but could not serve it.
    Refused(String),
    /// The connection or the answer is broken: the worker is dropped from use.
    Broken(String),
}

/// Sends one request on its own stream and waits for its checked result.
async fn request(
    w: &Worker,
    conn: quinn::Connection,
    req: ComputeRequest,
    limit: Duration,
) -> Answer {
    let t = Instant::now();
    // encoded in place (the activations are not copied), kept to check the answer against
    let m = Message::Compute(req);
    let frame = encode(&m);
    let Message::Compute(req) = m else {
        unreachable!("built above")
    };
    let req = &req;
    let go = async {
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let frame = frame.map_err(|e| e.to_string())?;
        send.write_all(&frame).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        w.sent.fetch_add(frame.len() as u64, Ordering::Relaxed);
        let (m, n) = read_frame(&mut recv).await.map_err(|e| e.to_string())?;
        w.received.fetch_add(n as u64, Ordering::Relaxed);
        Ok::<_, String>(m)
    };
    w.requests.fetch_add(1, Ordering::Relaxed);
    if req.group > 0 {
        w.coded.fetch_add(1, Ordering::Relaxed);
    }
    let a = match tokio::time::timeout(limit, go).await {
        Err(_) => Answer::Broken(format!("no answer within {limit:?}")),
        Ok(Err(e)) => Answer::Broken(e),
        Ok(Ok(Message::Computed(r))) => match r.check(req) {
            Ok(()) => Answer::Done(r),
            Err(e) => Answer::Broken(format!("malformed result: {e}")),
        },
        Ok(Ok(Message::Failed { class, message, .. })) => {
            Answer::Refused(format!("{class:?}: {message}"))
        }
        Ok(Ok(_)) => Answer::Broken("answered with something else".into()),
    };
    match &a {
        Answer::Done(r) => {
            w.rtt_us
                .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            w.compute_us.fetch_add(r.compute_us, Ordering::Relaxed);
        }
        Answer::Refused(why) => {
            w.failures.fetch_add(1, Ordering::Relaxed);
            *w.refusal.lock().expect("worker lock") = Some(why.clone());
        }
        Answer::Broken(why) => {
            w.failures.fetch_add(1, Ordering::Relaxed);
            w.lost(why.clone());
        }
    }
    a
}

/// A layer's batch with owned buffers, for the task that serves it.
struct OwnedBatch {
    step: u64,
    layer: usize,
    x: Vec<f32>,
    n_tokens: usize,
    ids: Vec<u32>,
    weights: Vec<f32>,
    top_k: usize,
}

impl OwnedBatch {
    fn new(b: &ExpertBatch<'_>) -> Self {
        Self {
            step: b.step,
            layer: b.layer,
            x: b.x.to_vec(),
            n_tokens: b.n_tokens,
            ids: b.ids.to_vec(),
            weights: b.weights.to_vec(),
            top_k: b.top_k,
        }
    }
    fn batch(&self) -> ExpertBatch<'_> {
        ExpertBatch {
            step: self.step,
            layer: self.layer,
            x: &self.x,
            n_tokens: self.n_tokens,
            ids: &self.ids,
            weights: &self.weights,
            top_k: self.top_k,
        }
    }
}

/// Per worker, the runs (indices into the layer's runs) it is asked for.
type Assignment = Vec<(usize, Vec<usize>)>;

/// Spreads `todo` runs over live holders (least rows first), skipping `avoid`; the rest is
/// returned for local compute.
fn assign(
    p: &Placement,
    live: &[bool],
    avoid: &[usize],
    b: &ExpertBatch<'_>,
    runs: &[(u32, Vec<usize>)],
    todo: &[usize],
) -> (Assignment, Vec<usize>) {
    let mut load = vec![0usize; live.len()];
    let mut out: Assignment = Vec::new();
    let mut local = Vec::new();
    for &r in todo {
        let (id, slots) = &runs[r];
        let best = p
            .holders(b.layer, *id)
            .iter()
            .copied()
            .filter(|&w| live[w] && !avoid.contains(&w))
            .min_by_key(|&w| (load[w], w));
        match best {
            Some(w) => {
                load[w] += slots.len();
                match out.iter_mut().find(|(x, _)| *x == w) {
                    Some((_, v)) => v.push(r),
                    None => out.push((w, vec![r])),
                }
            }
            None => local.push(r),
        }
    }
    (out, local)
}

/// The request for `runs[idx]` of batch `b`: each token's row once, runs ascending by expert;
/// the rows as int8 codes in groups of `codes_group` where that is exact (int8 activations, a
/// worker whose experts all quantize them in such groups), else f32.
fn build_request(
    id: u64,
    b: &ExpertBatch<'_>,
    h: usize,
    activations: &str,
    codes_group: usize,
    runs: &[(u32, Vec<usize>)],
    idx: &[usize],
) -> ComputeRequest {
    let mut row_of: HashMap<usize, u32> = HashMap::new();
    let mut x = Vec::new();
    let mut out = Vec::with_capacity(idx.len());
    for &r in idx {
        let (expert, slots) = &runs[r];
        let rows = slots
            .iter()
            .map(|&s| {
                let t = s / b.top_k;
                *row_of.entry(t).or_insert_with(|| {
                    x.extend_from_slice(&b.x[t * h..(t + 1) * h]);
                    (x.len() / h - 1) as u32
                })
            })
            .collect();
        out.push(Run {
            expert: *expert,
            rows,
        });
    }
    let coded = (activations == "int8" && codes_group > 0 && h.is_multiple_of(codes_group))
        .then(|| charm_shared::wire::ActCodes::encode(&x, codes_group))
        .flatten();
    let (x, group, codes, amax) = match coded {
        Some(c) => (vec![], codes_group as u32, c.codes, c.amax),
        None => (x, 0, vec![], vec![]),
    };
    ComputeRequest {
        id,
        step: b.step,
        layer: b.layer as u32,
        hidden: h as u32,
        activations: activations.to_string(),
        x,
        group,
        codes,
        amax,
        runs: out,
    }
}

/// One run's unweighted outputs from `local`: its rows as a batch of one expert per row with
/// gate weight 1 (`0 + 1 * y` is `y`, up to the sign of a zero, which the sum cannot see).
fn local_rows(
    local: &dyn ExpertExecutor,
    b: &ExpertBatch<'_>,
    run: &(u32, Vec<usize>),
    h: usize,
) -> Result<Vec<f32>, ExpertError> {
    let x = gather(b, &run.1, h);
    let n = run.1.len();
    let ids = vec![run.0; n];
    let weights = vec![1.0f32; n];
    local.run(ExpertBatch {
        step: b.step,
        layer: b.layer,
        x: &x,
        n_tokens: n,
        ids: &ids,
        weights: &weights,
        top_k: 1,
    })
}

/// Serves one layer: requests to workers, retries on other holders, the rest locally.
async fn serve(
    self_: Arc<Inner>,
    owned: Arc<OwnedBatch>,
    runs: Arc<Vec<(u32, Vec<usize>)>>,
) -> Result<Vec<f32>, ExpertError> {
    let s = &self_.shared;
    let b = owned.batch();
    let h = self_.hidden;
    let p = s.placement.read().expect("placement lock").clone();
    let mut outs: Vec<Option<Vec<f32>>> = vec![None; runs.len()];
    let mut todo: Vec<usize> = (0..runs.len()).collect();
    let mut avoid: Vec<usize> = Vec::new();
    let mut local_jobs = Vec::new();
    // two waves: the preferred holders, then other live holders of what failed
    for _wave in 0..2 {
        let live: Vec<bool> = s.workers.iter().map(|w| w.conn().is_some()).collect();
        let (asked, local) = assign(&p, &live, &avoid, &b, &runs, &todo);
        if !local.is_empty() {
            self_
                .fallbacks
                .fetch_add(local.len() as u64, Ordering::Relaxed);
            let (l, o, r) = (self_.local.clone(), owned.clone(), runs.clone());
            local_jobs.push(tokio::task::spawn_blocking(move || {
                let b = o.batch();
                local
                    .into_iter()
                    .map(|i| Ok((i, local_rows(&*l, &b, &r[i], h)?)))
                    .collect::<Result<Vec<_>, ExpertError>>()
            }));
        }
        todo.clear();
        let mut tasks = Vec::new();
        for (w, idx) in asked {
            let Some(conn) = s.workers[w].conn() else {
                todo.extend(idx);
                continue;
            };
            let codes_group = s.workers[w]
                .hello
                .lock()
                .expect("worker lock")
                .as_ref()
                .map_or(0, |h| h.act_group as usize);
            let req = build_request(
                self_.next_id.fetch_add(1, Ordering::Relaxed),
                &b,
                h,
                s.hello.activations.first().map_or("f32", |a| a.as_str()),
                codes_group,
                &runs,
                &idx,
            );
            let s2 = s.clone();
            tasks.push((
                w,
                idx,
                tokio::spawn(
                    async move { request(&s2.workers[w], conn, req, s2.opts.deadline).await },
                ),
            ));
        }
        for (w, idx, t) in tasks {
            match t.await {
                Ok(Answer::Done(r)) => {
                    for (i, o) in idx.into_iter().zip(r.outputs) {
                        outs[i] = Some(o);
                    }
                }
                Ok(Answer::Refused(_)) | Ok(Answer::Broken(_)) | Err(_) => {
                    avoid.push(w);
                    todo.extend(idx);
                }
            }
        }
        if todo.is_empty() {
            break;
        }
    }
    if !todo.is_empty() {
        // what the second wave could not place either
        self_
            .fallbacks
            .fetch_add(todo.len() as u64, Ordering::Relaxed);
        let (l, o, r) = (self_.local.clone(), owned.clone(), runs.clone());
        let rest = std::mem::take(&mut todo);
        local_jobs.push(tokio::task::spawn_blocking(move || {
            let b = o.batch();
            rest.into_iter()
                .map(|i| Ok((i, local_rows(&*l, &b, &r[i], h)?)))
                .collect::<Result<Vec<_>, ExpertError>>()
        }));
    }
    for j in local_jobs {
        let done = j
            .await
            .map_err(|e| ExpertError::Internal(format!("local expert task: {e}")))?
            .map_err(|e| match e {
                ExpertError::Unavailable { layer, expert, why } => ExpertError::Unavailable {
                    layer,
                    expert,
                    why: format!("{why}; {}", s.holders_of(layer, expert)),
                },
                e => e,
            })?;
        for (i, o) in done {
            outs[i] = Some(o);
        }
    }
    let outs: Vec<Vec<f32>> = outs
        .into_iter()
        .enumerate()
        .map(|(i, o)| {
            o.ok_or_else(|| ExpertError::Unavailable {
                layer: b.layer,
                expert: runs[i].0,
                why: "no holder answered".into(),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(combine(&b, h, &runs, &outs))
}

impl ExpertExecutor for RemoteExperts {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.start(batch).wait()
    }

    fn start(&self, batch: ExpertBatch<'_>) -> PendingExperts {
        if let Err(e) = batch.check(self.inner.hidden) {
            return PendingExperts::ready(Err(e));
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
        let (tx, pending) = PendingExperts::channel();
        self.rt.spawn(async move {
            let _ = tx.send(serve(inner, owned, runs).await);
        });
        pending
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

/// What the cluster would hold and move for a model, from the workers' handshakes: printed by
/// `charm plan --cluster` before the model is loaded.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterPlan {
    pub workers: Vec<NodePlan>,
    /// MoE layers a token passes (MTP layers excluded).
    pub moe_layers: usize,
    /// Experts placed on no connected worker (computed on the coordinator).
    pub unplaced_experts: usize,
    /// Expected bytes per token: activations out (each token's row once per worker its experts
    /// are on) and unweighted expert outputs back (`top_k` rows), over all MoE layers.
    pub request_bytes_per_token: u64,
    pub result_bytes_per_token: u64,
    /// One round of requests (in parallel over workers) per MoE layer.
    pub round_trips_per_token: usize,
}

/// One worker's part in a [`ClusterPlan`].
#[derive(Debug, Clone, Serialize)]
pub struct NodePlan {
    pub name: String,
    pub addr: String,
    pub connected: bool,
    pub error: Option<String>,
    pub experts: usize,
    /// Bytes of the experts placed on it, and whether its expert RAM holds them all.
    pub bytes: u64,
    pub ram_bytes: u64,
    pub all_resident: bool,
}

impl RemoteExperts {
    /// The plan of this cluster for its model, with `expert_bytes` per routed expert in memory.
    pub fn plan(&self, spec: &ModelSpec, expert_bytes: u64) -> ClusterPlan {
        let p = self.placement();
        let st = self.status();
        let layers: Vec<(usize, usize)> = moe_layers(spec)
            .into_iter()
            .filter(|l| l.0 < spec.layers.len())
            .collect();
        let all: usize = self.inner.shared.layers.iter().map(|l| l.1).sum();
        let placed: usize = self
            .inner
            .shared
            .layers
            .iter()
            .map(|&(l, n)| {
                (0..n as u32)
                    .filter(|&e| !p.holders(l, e).is_empty())
                    .count()
            })
            .sum();
        let (h, k) = (
            spec.hidden_size as f64,
            spec.router.as_ref().map_or(0, |r| r.top_k) as f64,
        );
        let total: usize = (0..st.len()).map(|i| p.count(i)).sum();
        // workers a token's top_k experts touch, choices independent with each worker's share
        let touched: f64 = (0..st.len())
            .map(|i| {
                let share = p.count(i) as f64 / total.max(1) as f64;
                1.0 - (1.0 - share).powf(k)
            })
            .sum();
        let remote_share = placed as f64 / all.max(1) as f64;
        let n = layers.len() as f64;
        ClusterPlan {
            workers: st
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let bytes = p.count(i) as u64 * expert_bytes;
                    NodePlan {
                        name: w.name.clone(),
                        addr: w.addr.clone(),
                        connected: w.connected,
                        error: w.error.clone(),
                        experts: p.count(i),
                        bytes,
                        ram_bytes: w.ram_bytes,
                        all_resident: w.connected && (w.ram_bytes == 0 || w.ram_bytes >= bytes),
                    }
                })
                .collect(),
            moe_layers: layers.len(),
            unplaced_experts: all - placed,
            request_bytes_per_token: (n * touched * h * 4.0) as u64,
            result_bytes_per_token: (n * remote_share * k * h * 4.0) as u64,
            round_trips_per_token: if placed > 0 { layers.len() } else { 0 },
        }
    }
}

impl ClusterPlan {
    /// The plan as text.
    pub fn render(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut s = String::from("cluster:\n");
        for w in &self.workers {
            if w.connected {
                s += &format!(
                    "  {:<12} {:<22} {:>6} experts, {:>8.2} GiB placed, {:>8.2} GiB expert RAM{}\n",
                    w.name,
                    w.addr,
                    w.experts,
                    gib(w.bytes),
                    gib(w.ram_bytes),
                    if w.all_resident {
                        ""
                    } else {
                        " (streams the rest from its disk)"
                    }
                );
            } else {
                s += &format!(
                    "  {:<12} {:<22} unreachable: {}\n",
                    w.name,
                    w.addr,
                    w.error.as_deref().unwrap_or("?")
                );
            }
        }
        if self.unplaced_experts > 0 {
            s += &format!(
                "  {} experts on no reachable worker: computed by the coordinator\n",
                self.unplaced_experts
            );
        }
        s += &format!(
            "  per token: {} round trips (one per MoE layer), {:.1} KB out, {:.1} KB back\n",
            self.round_trips_per_token,
            self.request_bytes_per_token as f64 / 1e3,
            self.result_bytes_per_token as f64 / 1e3
        );
        s
    }
}
