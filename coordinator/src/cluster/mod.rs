//! The cluster as the coordinator sees it: the cluster file (where the workers are, how long to
//! wait for them, how many copies of the hot experts to keep) and the placement of routed experts
//! on workers by capacity and heat. The sockets are in the submodules: [`remote`] is the expert
//! executor that sends expert work to the workers; `workers`, `link` and `layer` keep the
//! workers, talk to one, and serve one MoE layer across them; [`plan`] is what `charm plan
//! --cluster` shows of the workers, [`predict`] the decode speed it predicts from the workers as
//! [`probe`] measures them or from a described set of machines.
//!
//! A cluster file is JSON:
//!
//! ```json
//! {
//!   "certs": ".",
//!   "node": "coordinator",
//!   "workers": ["w1@192.168.1.11:7070", "w2@192.168.1.12:7070"],
//!   "deadline_ms": 30000,
//!   "heartbeat_ms": 1000,
//!   "replicas": 2,
//!   "hot_share": 0.25,
//!   "rebalance_steps": 256,
//!   "spin_us": 2000
//! }
//! ```
//!
//! `certs` (relative to the file) is the directory `charm cluster init` wrote: the cluster
//! authority and the node certificates. Only `workers` is required. A directory given where a
//! cluster file is expected means its `cluster.json`, with the directory as `certs`.

mod drive;
mod inner;
mod layer;
mod link;
pub mod plan;
pub mod predict;
pub mod probe;
pub mod remote;
mod workers;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// File name of the cluster file inside a cluster directory.
pub const CLUSTER_FILE: &str = "cluster.json";

/// A worker as the coordinator dials it: `NAME@HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerAddr {
    /// Node name: the worker's certificate must carry it.
    pub name: String,
    pub addr: SocketAddr,
}

impl std::str::FromStr for WorkerAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, addr) = s
            .split_once('@')
            .ok_or_else(|| format!("worker `{s}`: write NAME@HOST:PORT"))?;
        if !charm_worker::tls::valid_node_name(name) {
            return Err(format!(
                "worker `{s}`: node name `{name}` (1-63 letters, digits, `-` or `.`)"
            ));
        }
        let addr = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(|e| format!("worker `{s}`: {e}"))?
            .next()
            .ok_or_else(|| format!("worker `{s}`: no address"))?;
        Ok(Self {
            name: name.into(),
            addr,
        })
    }
}

/// How to reach and use the cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterOptions {
    /// The directory holding the cluster authority and node certificates.
    pub certs: PathBuf,
    /// This node's name there.
    pub node: String,
    pub workers: Vec<WorkerAddr>,
    /// How long one layer's request may take before its experts go elsewhere.
    pub deadline: Duration,
    /// How often an idle worker is pinged, and a lost one dialled again.
    pub heartbeat: Duration,
    /// Copies of each hot expert (on different workers).
    pub replicas: usize,
    /// Share of each layer's experts, hottest first, that gets `replicas` copies.
    pub hot_share: f64,
    /// Forward steps between placements recomputed from the routing seen so far (0: only when
    /// a worker joins). Experts that move are read from the new holder's disk, or fetched, on
    /// first use; nothing stops.
    pub rebalance_steps: u64,
    /// How long the forward thread polls for a layer's answers before it sleeps: a round trip
    /// is usually shorter, and a sleeping thread on an idle core wakes 10-30 us late on a
    /// virtual machine, every layer (zero: sleep at once).
    pub spin: Duration,
    /// The most bytes one compute request and its answer may carry each: a layer's work for a
    /// worker is sent as requests of consecutive tokens, one after another, each within it
    /// (default [`REQUEST_BYTES`]; a decode step's is one request).
    pub request_bytes: usize,
}

/// Default [`ClusterOptions::hot_share`]: a quarter of each layer's experts get the copies.
pub const HOT_SHARE: f64 = 0.25;

/// Default [`ClusterOptions::request_bytes`]: half the wire's frame limit, which leaves room for
/// the archive's own bytes (GLM-5.2, 6144 wide with 8 experts a token: up to 151 tokens a
/// request).
pub const REQUEST_BYTES: usize = charm_shared::wire::MAX_FRAME / 2;

impl ClusterOptions {
    /// Options with the defaults for everything but the certificates, node and workers.
    pub fn new(certs: PathBuf, node: &str, workers: Vec<WorkerAddr>) -> Self {
        Self {
            certs,
            node: node.into(),
            workers,
            deadline: Duration::from_secs(30),
            heartbeat: Duration::from_secs(1),
            replicas: 1,
            hot_share: HOT_SHARE,
            rebalance_steps: 256,
            spin: COORDINATOR_SPIN,
            request_bytes: REQUEST_BYTES,
        }
    }

    /// Reads a cluster file, or the `cluster.json` of a cluster directory (a directory without
    /// one lists no workers).
    pub fn load(path: &Path) -> Result<Self, String> {
        let (file, base) = if path.is_dir() {
            (path.join(CLUSTER_FILE), path.to_path_buf())
        } else {
            (
                path.to_path_buf(),
                path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            )
        };
        if path.is_dir() && !file.exists() {
            return Ok(Self::new(base, "coordinator", vec![]));
        }
        let text =
            std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        Self::parse(&text, &base).map_err(|e| format!("{}: {e}", file.display()))
    }

    /// Parses cluster-file text; relative paths are taken from `base`.
    pub fn parse(text: &str, base: &Path) -> Result<Self, String> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            certs: Option<PathBuf>,
            node: Option<String>,
            workers: Vec<String>,
            deadline_ms: Option<u64>,
            heartbeat_ms: Option<u64>,
            replicas: Option<usize>,
            hot_share: Option<f64>,
            rebalance_steps: Option<u64>,
            spin_us: Option<u64>,
        }
        let f: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let workers = f
            .workers
            .iter()
            .map(|w| w.parse())
            .collect::<Result<Vec<WorkerAddr>, _>>()?;
        let mut o = Self::new(
            base.join(f.certs.unwrap_or_else(|| ".".into())),
            f.node.as_deref().unwrap_or("coordinator"),
            workers,
        );
        if let Some(d) = f.deadline_ms {
            o.deadline = Duration::from_millis(d);
        }
        if let Some(h) = f.heartbeat_ms {
            o.heartbeat = Duration::from_millis(h);
        }
        o.replicas = f.replicas.unwrap_or(o.replicas);
        o.hot_share = f.hot_share.unwrap_or(o.hot_share);
        o.rebalance_steps = f.rebalance_steps.unwrap_or(o.rebalance_steps);
        if let Some(us) = f.spin_us {
            o.spin = Duration::from_micros(us);
        }
        o.check()?;
        Ok(o)
    }

    /// Refuses values that cannot work.
    pub fn check(&self) -> Result<(), String> {
        if !charm_worker::tls::valid_node_name(&self.node) {
            return Err(format!("node name `{}`", self.node));
        }
        if self.deadline.is_zero() || self.heartbeat.is_zero() {
            return Err("deadline_ms and heartbeat_ms must be positive".into());
        }
        if self.replicas == 0 {
            return Err("replicas must be at least 1".into());
        }
        if self.request_bytes == 0 || self.request_bytes > REQUEST_BYTES {
            return Err(format!(
                "request_bytes {} (1 to {REQUEST_BYTES})",
                self.request_bytes
            ));
        }
        if !(0.0..=1.0).contains(&self.hot_share) {
            return Err(format!("hot_share {} (0 to 1)", self.hot_share));
        }
        let mut names: Vec<&str> = self.workers.iter().map(|w| w.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("worker {} listed twice", w[0]));
        }
        if names.contains(&self.node.as_str()) {
            return Err(format!(
                "worker {} has this coordinator's node name",
                self.node
            ));
        }
        Ok(())
    }
}

/// How long the forward thread polls for a layer's answers by default ([`ClusterOptions::spin`]).
pub const COORDINATOR_SPIN: Duration = Duration::from_millis(2);

/// A wait for answers due within a round trip: polled for `spin` from its first poll, then
/// asleep ([`PendingExperts::channel_polled`]).
pub(crate) fn polled_channel(
    spin: Duration,
) -> (
    std::sync::mpsc::SyncSender<Result<Vec<f32>, charm_shared::expert::ExpertError>>,
    charm_shared::expert::PendingExperts,
) {
    use charm_shared::expert::PendingExperts;
    if spin.is_zero() {
        return PendingExperts::channel();
    }
    let mut since: Option<std::time::Instant> = None;
    PendingExperts::channel_polled(move || {
        since.get_or_insert_with(std::time::Instant::now).elapsed() < spin
    })
}

/// The model fingerprint both sides of a cluster compare: CRC-32 and length of the files that
/// define the model (its config, and the container manifest with its per-expert checksums or the
/// checkpoint's safetensors index and headers).
pub fn model_fingerprint(dir: &Path) -> Result<String, String> {
    use std::io::Read;
    let err = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let mut parts: Vec<(PathBuf, u64)> = vec![(dir.join("config.json"), u64::MAX)];
    let manifest = dir.join(charm_shared::container::MANIFEST);
    if manifest.is_file() {
        parts.push((manifest, u64::MAX));
    } else {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        for s in shards {
            // the length prefix and the JSON header it announces (the tensor index)
            let mut prefix = [0u8; 8];
            std::fs::File::open(&s)
                .and_then(|mut f| f.read_exact(&mut prefix))
                .map_err(|e| err(&s, e))?;
            parts.push((s, 8 + u64::from_le_bytes(prefix).min(1 << 30)));
        }
    }
    let mut h = crc32fast::Hasher::new();
    let mut len = 0u64;
    for (p, limit) in parts {
        let mut buf = Vec::new();
        std::fs::File::open(&p)
            .and_then(|f| f.take(limit).read_to_end(&mut buf))
            .map_err(|e| err(&p, e))?;
        h.update(&buf);
        len += buf.len() as u64;
    }
    Ok(format!("{:08x}-{len}", h.finalize()))
}

/// Worker processes on loopback (`charm worker` children of this process) with certificates
/// in a temporary directory (mode 0700); killed and removed when dropped. They share this
/// machine's cores with the coordinator, so neither side spins while it waits
/// ([`ClusterOptions::spin`], `charm worker --spin-us`) unless `extra` sets the workers'
/// `--spin-us` (and the caller the options' `spin`): each would take a core the others need.
#[derive(Debug)]
pub struct Loopback {
    pub dir: PathBuf,
    children: Vec<std::process::Child>,
    /// `NAME@127.0.0.1:PORT` of each worker.
    pub workers: Vec<WorkerAddr>,
}

impl Loopback {
    /// Starts `n` workers (`exe worker ...`, the `charm` binary) serving `model` in activation
    /// mode `act` with `extra` arguments. The workers get SIGKILL when the *thread* that calls
    /// this ends (`PR_SET_PDEATHSIG`), so call it from a thread that outlives them (the main
    /// thread), not from a short-lived or pooled one.
    pub fn start(
        exe: &Path,
        model: &Path,
        n: usize,
        act: &str,
        extra: &[&str],
    ) -> Result<Self, String> {
        use std::io::BufRead;
        let dir = std::env::temp_dir().join(format!("charm-loopback-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // the cluster's CA and node keys: readable by this user only while they exist
        {
            use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .and_then(|()| {
                    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                })
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let names: Vec<String> = (1..=n).map(|i| format!("w{i}")).collect();
        let mut all = vec!["coordinator".to_string()];
        all.extend(names.iter().cloned());
        charm_worker::tls::init_cluster(&dir, &all).map_err(|e| e.to_string())?;
        let mut lb = Self {
            dir,
            children: vec![],
            workers: vec![],
        };
        for name in &names {
            let mut cmd = std::process::Command::new(exe);
            // the workers end with this process however it ends (Ctrl-C, a kill): the kernel
            // kills a child whose parent thread died (this one, which lives as long as the run)
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                use std::os::unix::process::CommandExt;
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let mut c = cmd
                .args(["worker", "--listen", "127.0.0.1:0", "--model"])
                .arg(model)
                .args(["--node", name, "--cluster"])
                .arg(&lb.dir)
                .args(["--activations", act, "--history", "none"])
                .args(if extra.contains(&"--spin-us") {
                    &[][..]
                } else {
                    &["--spin-us", "0"][..]
                })
                .args(extra)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::inherit())
                .spawn()
                .map_err(|e| format!("starting {}: {e}", exe.display()))?;
            let mut line = String::new();
            std::io::BufReader::new(c.stdout.take().expect("piped"))
                .read_line(&mut line)
                .map_err(|e| format!("reading worker {name}'s address: {e}"))?;
            lb.children.push(c);
            let addr = line
                .trim()
                .strip_prefix("listening on ")
                .ok_or_else(|| format!("worker {name} did not start"))?;
            lb.workers.push(format!("{name}@{addr}").parse()?);
        }
        Ok(lb)
    }

    /// The workers' process ids.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }

    /// Cluster options for these workers (no spinning: see [`Loopback`]).
    pub fn options(&self) -> ClusterOptions {
        ClusterOptions {
            spin: Duration::ZERO,
            ..ClusterOptions::new(self.dir.clone(), "coordinator", self.workers.clone())
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What placement knows of one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// Bytes of RAM and VRAM it gives experts (0: unknown, counted as the others' mean).
    pub ram_bytes: u64,
    /// Expert rows per second it measured (0: unknown, counted as the others' mean).
    pub rate: f64,
    /// Per MoE layer, the experts it can serve (its files).
    pub holds: Vec<(usize, Vec<u32>)>,
}

impl Capacity {
    fn holds(&self, layer: usize, id: u32) -> bool {
        self.holds
            .iter()
            .find(|(l, _)| *l == layer)
            .is_some_and(|(_, ids)| ids.binary_search(&id).is_ok())
    }
}

/// Which workers hold which routed experts: per `(layer, expert)`, its holders, preferred first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Placement {
    /// Per MoE layer (in `layers` order), per expert, worker indices.
    holders: Vec<Vec<Vec<usize>>>,
    layers: Vec<usize>,
    /// Per worker, the time of a row relative to the cluster's mean (its measured rate's
    /// inverse; 1 where unknown): what [`spread`] weighs each holder's rows by.
    cost: Vec<f64>,
}

impl Placement {
    /// Places the experts of `layers` (`(layer, expert count)`) on `workers` (`None`: not
    /// connected, holds nothing). Each expert goes to the worker holding it with the lowest load
    /// for its share of the cluster (RAM times measured speed, each relative to the mean); the hottest `hot_share` of each layer's experts by
    /// `heat` (uses per expert, per layer; ties and no history: lower id first) get `replicas`
    /// holders on different workers. Deterministic.
    pub fn compute(
        layers: &[(usize, usize)],
        workers: &[Option<Capacity>],
        heat: &dyn Fn(usize, u32) -> u64,
        replicas: usize,
        hot_share: f64,
    ) -> Self {
        // a worker's share: its RAM times its speed, each relative to the cluster's mean
        let mean = |f: &dyn Fn(&Capacity) -> f64| {
            let v: Vec<f64> = workers
                .iter()
                .flatten()
                .map(f)
                .filter(|&x| x > 0.0)
                .collect();
            if v.is_empty() {
                1.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let (ram, rate) = (mean(&|c| c.ram_bytes as f64), mean(&|c| c.rate));
        let or = |x: f64, m: f64| if x > 0.0 { x / m } else { 1.0 };
        let weight: Vec<f64> = workers
            .iter()
            .map(|c| match c {
                Some(c) => or(c.ram_bytes as f64, ram) * or(c.rate, rate),
                None => 0.0,
            })
            .collect();
        let holders = layers
            .iter()
            .map(|&(layer, n)| {
                let mut order: Vec<u32> = (0..n as u32).collect();
                order.sort_by_key(|&e| (std::cmp::Reverse(heat(layer, e)), e));
                let hot = (hot_share * n as f64).round() as usize;
                place_layer(&order, &weight, replicas, hot, |w, e| {
                    workers[w].as_ref().is_some_and(|c| c.holds(layer, e))
                })
            })
            .collect();
        let cost = workers
            .iter()
            .map(|c| match c {
                Some(c) if c.rate > 0.0 => rate / c.rate,
                _ => 1.0,
            })
            .collect();
        Self {
            holders,
            layers: layers.iter().map(|l| l.0).collect(),
            cost,
        }
    }

    /// The workers placed for `expert` of `layer`, preferred first (empty: none).
    pub fn holders(&self, layer: usize, expert: u32) -> &[usize] {
        self.layers
            .iter()
            .position(|&l| l == layer)
            .and_then(|i| self.holders[i].get(expert as usize))
            .map_or(&[], |v| v.as_slice())
    }

    /// Worker `w`'s time for a row, relative to the cluster's mean (1 where not known).
    pub fn cost(&self, w: usize) -> f64 {
        self.cost.get(w).copied().unwrap_or(1.0)
    }

    /// Experts placed on worker `w`, summed over layers.
    pub fn count(&self, w: usize) -> usize {
        self.holders
            .iter()
            .flatten()
            .filter(|h| h.contains(&w))
            .count()
    }

    /// Per MoE layer, the experts placed on worker `w`.
    pub fn assigned(&self, w: usize) -> Vec<(usize, Vec<u32>)> {
        self.layers
            .iter()
            .zip(&self.holders)
            .map(|(&l, per)| {
                let ids = (0..per.len() as u32)
                    .filter(|&e| per[e as usize].contains(&w))
                    .collect();
                (l, ids)
            })
            .collect()
    }
}

/// One layer's holders: per expert id (of `order`'s, hottest first), the workers placed for it.
/// Each goes to the worker that may hold it (`can(w, e)`, weight above 0) with the lowest load
/// for its `weight`; the first `hot` of `order` get `replicas` holders on different workers.
pub(crate) fn place_layer(
    order: &[u32],
    weight: &[f64],
    replicas: usize,
    hot: usize,
    can: impl Fn(usize, u32) -> bool,
) -> Vec<Vec<usize>> {
    let n = order.iter().map(|&e| e as usize + 1).max().unwrap_or(0);
    let mut load = vec![0usize; weight.len()];
    let mut per = vec![Vec::new(); n];
    for (rank, &e) in order.iter().enumerate() {
        let copies = if rank < hot { replicas } else { 1 };
        let mut free: Vec<usize> = (0..weight.len())
            .filter(|&w| weight[w] > 0.0 && can(w, e))
            .collect();
        for _ in 0..copies {
            let Some(pos) = (0..free.len()).min_by(|&a, &b| {
                let (wa, wb) = (free[a], free[b]);
                let la = (load[wa] + 1) as f64 / weight[wa];
                let lb = (load[wb] + 1) as f64 / weight[wb];
                la.total_cmp(&lb).then(wa.cmp(&wb))
            }) else {
                break;
            };
            let w = free.remove(pos);
            load[w] += 1;
            per[e as usize].push(w);
        }
    }
    per
}

/// Chooses one holder for each of a layer's runs, given as `(holders, rows)`: runs with the
/// fewest holders first (they have the least choice), then the larger, each to the holder that
/// would finish it first, its rows so far and the run's weighed by its `cost` per row (ties: the
/// lower index); `None` where a run has no holder. Taking the runs in expert order instead
/// lets an early replicated run fill the worker a later single-holder run must use; this order
/// finds the best assignment on GLM-5.2-shaped draws (checked in the tests).
pub(crate) fn spread(cost: &[f64], runs: &[(&[usize], usize)]) -> Vec<Option<usize>> {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by_key(|&r| (runs[r].0.len(), std::cmp::Reverse(runs[r].1)));
    let mut load = vec![0.0f64; cost.len()];
    let mut out = vec![None; runs.len()];
    for r in order {
        let (holders, rows) = runs[r];
        let done = |w: usize| load[w] + rows as f64 * cost[w];
        if let Some(&w) = holders
            .iter()
            .min_by(|&&a, &&b| done(a).total_cmp(&done(b)).then(a.cmp(&b)))
        {
            load[w] = done(w);
            out[r] = Some(w);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(layers: &[(usize, usize)], ram: u64) -> Capacity {
        Capacity {
            ram_bytes: ram,
            rate: 0.0,
            holds: layers
                .iter()
                .map(|&(l, n)| (l, (0..n as u32).collect()))
                .collect(),
        }
    }

    #[test]
    fn experts_spread_by_capacity_and_hot_ones_are_replicated() {
        let layers = [(1, 16), (2, 16)];
        let w = vec![Some(all(&layers, 3 << 30)), Some(all(&layers, 1 << 30))];
        let p = Placement::compute(&layers, &w, &|_, _| 0, 1, 0.0);
        // 3:1 capacity -> 12 and 4 experts per layer
        assert_eq!((p.count(0), p.count(1)), (24, 8));
        for l in [1, 2] {
            for e in 0..16 {
                assert_eq!(p.holders(l, e).len(), 1);
            }
        }
        // the 4 hottest of layer 1 (by heat) on both workers
        let heat = |l: usize, e: u32| if l == 1 && e >= 12 { 100 + e as u64 } else { 0 };
        let p = Placement::compute(&layers, &w, &heat, 2, 0.25);
        for e in 12..16 {
            assert_eq!(p.holders(1, e).len(), 2, "expert {e}");
        }
        // layer 2's hot set is its lowest ids (no history there)
        for e in 0..4 {
            assert_eq!(p.holders(2, e).len(), 2);
        }
        assert_eq!(p.holders(1, 0).len(), 1);
        assert!(p.holders(3, 0).is_empty());
        // equal RAM, one worker three times as fast: 3:1 again
        let fast = |rate| Capacity {
            rate,
            ..all(&layers, 1 << 30)
        };
        let p = Placement::compute(
            &layers,
            &[Some(fast(3e4)), Some(fast(1e4))],
            &|_, _| 0,
            1,
            0.0,
        );
        assert_eq!((p.count(0), p.count(1)), (24, 8));
        // and a row costs it a third of the other's time: 2/3 and 2 of the mean's
        assert!((p.cost(0) - 2.0 / 3.0).abs() < 1e-12 && (p.cost(1) - 2.0).abs() < 1e-12);
        // more replicas than workers: one copy on each
        let p = Placement::compute(&layers, &w, &|_, _| 0, 5, 1.0);
        assert!((0..16).all(|e| p.holders(1, e).len() == 2));
    }

    #[test]
    fn spread_serves_single_holder_runs_first() {
        // in expert order, run 0 (on 0 or 1) would take worker 0, where run 1 must go too
        let (both, first): (&[usize], &[usize]) = (&[0, 1], &[0]);
        assert_eq!(
            spread(&[1.0; 2], &[(both, 1), (first, 1)]),
            vec![Some(1), Some(0)]
        );
        // the larger run first among equals, ties to the lower index; no holder: none
        assert_eq!(
            spread(&[1.0; 2], &[(both, 1), (both, 3), (&[], 2)]),
            vec![Some(1), Some(0), None]
        );
        // a worker three times as slow takes a run once the other's queue is three runs longer
        let runs = [(both, 1); 5];
        assert_eq!(
            spread(&[1.0, 3.0], &runs),
            vec![Some(0), Some(0), Some(0), Some(1), Some(0)]
        );
    }

    #[test]
    fn spread_matches_the_best_assignment_on_glm52_draws() {
        // 8 of 256 experts a token on 4 equal workers, the hottest quarter on two of them
        let order: Vec<u32> = (0..256).collect();
        let holders = place_layer(&order, &[1.0; 4], 2, 64, |_, _| true);
        assert_eq!(holders.iter().filter(|h| h.len() == 2).count(), 64);
        let mut state = 0x5EEDu64;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let (mut ours, mut best) = (0usize, 0usize);
        for _ in 0..2000 {
            let mut picks: Vec<usize> = Vec::new();
            while picks.len() < 8 {
                let e = (next() % 256) as usize;
                if !picks.contains(&e) {
                    picks.push(e);
                }
            }
            picks.sort_unstable();
            let runs: Vec<(&[usize], usize)> =
                picks.iter().map(|&e| (holders[e].as_slice(), 1)).collect();
            let mut load = [0usize; 4];
            for w in spread(&[1.0; 4], &runs).into_iter().flatten() {
                load[w] += 1;
            }
            ours += load.iter().max().unwrap();
            // every choice of holders
            let mut least = usize::MAX;
            for mask in 0..1usize << 8 {
                let mut load = [0usize; 4];
                for (i, (h, _)) in runs.iter().enumerate() {
                    load[h[((mask >> i) & 1) % h.len()]] += 1;
                }
                least = least.min(*load.iter().max().unwrap());
            }
            best += least;
        }
        assert_eq!(
            ours, best,
            "busiest worker: {ours} against {best} over 2000 draws"
        );
    }

    #[test]
    fn an_absent_worker_or_one_without_the_files_holds_nothing() {
        let layers = [(0, 8)];
        let partial = Capacity {
            ram_bytes: 0,
            rate: 0.0,
            holds: vec![(0, vec![0, 1])],
        };
        let w = vec![None, Some(partial), Some(all(&layers, 0))];
        let p = Placement::compute(&layers, &w, &|_, _| 0, 1, 0.0);
        assert_eq!(p.count(0), 0);
        assert!(p.assigned(1)[0].1.iter().all(|&e| e < 2));
        assert_eq!(p.count(1) + p.count(2), 8);
    }

    #[test]
    fn cluster_files_parse_or_say_what_is_wrong() {
        let o = ClusterOptions::parse(
            r#"{"workers": ["w1@127.0.0.1:7070", "w2@[::1]:7071"], "replicas": 2, "certs": "c"}"#,
            Path::new("/etc/charm"),
        )
        .unwrap();
        assert_eq!(o.workers.len(), 2);
        assert_eq!(o.certs, Path::new("/etc/charm/c"));
        assert_eq!((o.replicas, o.node.as_str()), (2, "coordinator"));
        for (bad, why) in [
            (r#"{"workers": ["127.0.0.1:7070"]}"#, "NAME@HOST:PORT"),
            (
                r#"{"workers": ["a@127.0.0.1:1", "a@127.0.0.1:2"]}"#,
                "twice",
            ),
            (r#"{"workers": [], "replicas": 0}"#, "replicas"),
            (r#"{"workers": [], "colour": 1}"#, "colour"),
            (r#"{"workers": [], "hot_share": 2}"#, "hot_share"),
            (r#"{"workers": ["coordinator@127.0.0.1:1"]}"#, "node name"),
            (r#"{"workers": [], "deadline_ms": 0}"#, "positive"),
        ] {
            let e = ClusterOptions::parse(bad, Path::new(".")).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
