//! `GET /v1/status`: one JSON document of what the server is doing (the dashboard's data, and a
//! script's), and `GET /v1/status/events`, the same document as server-sent events once a
//! second. Both need the API key like the API.
//!
//! The document: `model` (name, architecture, layers, experts), `uptime_seconds`, `server`
//! (requests, queue, batch, tokens, cancellations, time to first token, KV log), `speculative`
//! (drafted and accepted tokens), `structured` (grammar masks and forced tokens), `experts`
//! (uses served from RAM or VRAM, disk reads, cache size, the VRAM tier's experts and moves), `throughput` (the last minute, a sample a
//! second: tokens and disk bytes per second), `workers` and `cluster` (empty and `null` on one
//! box), and `heat` (unless `?heat=false`): per MoE layer, the router's picks of each expert
//! since start and where each expert lives (indices into `heat.locations`, preferred first);
//! `mtp` marks the layer of the multi-token-prediction head, which routes only when drafting.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value as Json};

use super::auth::authorized;
use super::error::ApiError;
use super::Shared;
use crate::cluster::remote::WorkerStatus;
use crate::model::usage::ExpertUse;
use charm_shared::expert::{ExpertExecutor, ExpertStats};
use charm_worker::gpu::tier::VramExperts;
use charm_worker::store::StreamingExperts;

/// Samples kept: a minute at one a second.
const SAMPLES: usize = 60;

/// What the status reads beyond the scheduler's counters: the model's shape, its experts and
/// where they live, and a minute of throughput samples.
pub(super) struct Sources {
    pub(super) arch: String,
    /// Where the dense skeleton runs: `{"device": "cpu"}` or the GPU and the VRAM it holds.
    pub(super) dense: serde_json::Value,
    pub(super) layers: usize,
    /// MoE layer indices (the MTP layer's included), and experts per layer and per token.
    pub(super) moe_layers: Vec<usize>,
    pub(super) n_experts: usize,
    pub(super) top_k: usize,
    pub(super) expert_use: Arc<ExpertUse>,
    pub(super) executor: Arc<dyn ExpertExecutor>,
    /// The streaming store (this machine's experts on disk), if there is one.
    pub(super) store: Option<Arc<StreamingExperts>>,
    /// The VRAM tier (this machine's experts on a GPU), if there is one.
    pub(super) vram: Option<Arc<VramExperts>>,
    /// RAM the plan gave the expert cache, bytes.
    pub(super) cache_bytes: Option<u64>,
    samples: Mutex<VecDeque<Sample>>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources").field("arch", &self.arch).finish()
    }
}

/// Counters at one moment.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    unix: u64,
    tokens: u64,
    bytes_read: u64,
}

impl Sources {
    pub(super) fn new(engine: &crate::model::engine::Engine) -> Self {
        use crate::model::FfnWeights;
        let m = &engine.model;
        let mut moe_layers: Vec<usize> = m
            .layers
            .iter()
            .filter(|l| matches!(l.ffn, FfnWeights::Moe { .. }))
            .map(|l| l.index)
            .collect();
        if let Some(mtp) = &m.mtp {
            if matches!(mtp.layer.ffn, FfnWeights::Moe { .. }) {
                moe_layers.push(mtp.layer.index);
            }
        }
        let router = m.spec.router.as_ref();
        Self {
            arch: format!("{:?}", m.spec.arch),
            dense: m.dense_status(),
            layers: m.spec.layers.len(),
            moe_layers,
            n_experts: router.map_or(0, |r| r.n_experts),
            top_k: router.map_or(0, |r| r.top_k),
            expert_use: m.expert_use.clone(),
            executor: m.experts.clone(),
            store: engine.store.clone(),
            vram: engine.vram.clone(),
            cache_bytes: engine.plan.as_ref().map(|p| p.cache_bytes),
            samples: Mutex::new(VecDeque::with_capacity(SAMPLES + 1)),
        }
    }

    fn stats(&self) -> ExpertStats {
        self.executor.stats().unwrap_or_default()
    }

    /// Takes a sample of the counters (once a second, from [`sample_every_second`]).
    fn sample(&self, tokens: &AtomicU64) {
        let s = Sample {
            at: Instant::now(),
            unix: super::now(),
            tokens: tokens.load(Ordering::Relaxed),
            bytes_read: self.stats().bytes_read,
        };
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back(s);
        while q.len() > SAMPLES + 1 {
            q.pop_front();
        }
    }

    /// Per second of the last minute: tokens generated and bytes read from disk.
    fn throughput(&self) -> Vec<Json> {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        q.iter()
            .zip(q.iter().skip(1))
            .map(|(a, b)| {
                let dt = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
                json!({
                    "t": b.unix,
                    "tokens_per_second": b.tokens.saturating_sub(a.tokens) as f64 / dt,
                    "disk_bytes_per_second": b.bytes_read.saturating_sub(a.bytes_read) as f64 / dt,
                })
            })
            .collect()
    }
}

/// Samples the counters once a second for as long as the server runs.
pub(super) async fn sample_every_second(s: std::sync::Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(s) = s.upgrade() else { return };
        s.status.sample(&s.scheduler.metrics().tokens);
    }
}

/// A location's index in the heat map and the experts `(layer, id)` it holds.
type VramHeld = (usize, Vec<(usize, u32)>);

/// Where each expert of the MoE layers lives: the locations' names, and per layer and expert
/// the indices of its holders, preferred first.
fn locations(s: &Shared, workers: &[WorkerStatus]) -> (Vec<String>, Vec<Vec<Vec<usize>>>) {
    let src = &s.status;
    let mut names = vec!["coordinator RAM".to_string()];
    let disk = src.store.as_ref().map(|st| {
        names.push("coordinator disk".into());
        st.cached()
    });
    let vram = src.vram.as_ref().map(|v| {
        names.push("coordinator VRAM".into());
        (names.len() - 1, v.held())
    });
    // on this machine: in VRAM when the GPU holds it, else in RAM, unless a streaming store has
    // it only on disk
    let here = |layer: usize, e: u32| -> usize {
        if let Some((at, held)) = &vram {
            if held.binary_search(&(layer, e)).is_ok() {
                return *at;
            }
        }
        match &disk {
            Some(cached) if cached.binary_search(&(layer, e)).is_err() => 1,
            _ => 0,
        }
    };
    let placement = s.remote.as_ref().map(|r| {
        let first = names.len();
        names.extend(workers.iter().map(|w| w.name.clone()));
        (first, r.placement())
    });
    // a worker with a GPU: a location of its own for the experts it holds in VRAM
    // per worker: its VRAM location's index and the experts there
    let worker_vram: Vec<Option<VramHeld>> = match &s.remote {
        Some(r) => r
            .vram_held()
            .into_iter()
            .zip(workers)
            .map(|(held, w)| {
                (w.vram_bytes > 0).then(|| {
                    names.push(format!("{} VRAM", w.name));
                    (names.len() - 1, held)
                })
            })
            .collect(),
        None => Vec::new(),
    };
    let on_worker = |w: usize, layer: usize, e: u32| -> Option<usize> {
        let (at, held) = worker_vram.get(w)?.as_ref()?;
        held.binary_search(&(layer, e)).is_ok().then_some(*at)
    };
    let per_layer = src
        .moe_layers
        .iter()
        .map(|&l| {
            (0..src.n_experts as u32)
                .map(|e| {
                    let held = placement.as_ref().map_or(&[][..], |(_, p)| p.holders(l, e));
                    match &placement {
                        Some((first, _)) if !held.is_empty() => held
                            .iter()
                            .map(|&w| on_worker(w, l, e).unwrap_or(first + w))
                            .collect(),
                        _ => vec![here(l, e)],
                    }
                })
                .collect()
        })
        .collect();
    (names, per_layer)
}

/// The status document (see the module's docs).
pub(super) fn document(s: &Shared, heat: bool) -> Json {
    let m = s.scheduler.metrics();
    let l = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let src = &s.status;
    // an executor without counters holds every expert in RAM: each pick was a hit
    let st = src.executor.stats().unwrap_or_else(|| {
        let picks = src
            .moe_layers
            .iter()
            .map(|&l| src.expert_use.layer(l).iter().sum::<u64>())
            .sum();
        ExpertStats {
            hits: picks,
            ..Default::default()
        }
    });
    let uses = st.hits + st.misses + st.vram_hits;
    let ratio = |a: u64, b: u64| if b > 0 { a as f64 / b as f64 } else { 0.0 };
    let ttft_n = l(&m.ttft_n);
    // (one status read for the table and the heat map's names: it walks the placement)
    let worker_status = s.remote.as_ref().map_or_else(Vec::new, |r| r.status());
    let workers: Vec<Json> = worker_status
        .iter()
        .map(|w| {
            json!({
                "name": w.name,
                "addr": w.addr,
                "up": w.connected,
                "error": w.error,
                "round_trip_ms": w.mean_rtt_ms,
                "compute_ms": w.mean_compute_ms,
                "heartbeat_ms": w.ping_ms,
                "requests": w.requests,
                "failures": w.failures,
                "joins": w.joins,
                "bytes_sent": w.bytes_sent,
                "bytes_received": w.bytes_received,
                "experts": w.experts,
                "ram_bytes": w.ram_bytes,
                "vram_bytes": w.vram_bytes,
                "gpu": w.gpu,
            })
        })
        .collect();
    let mut doc = json!({
        "model": {
            "name": s.opts.model_name,
            "architecture": src.arch,
            "layers": src.layers,
            "moe_layers": src.moe_layers.iter().filter(|&&l| l < src.layers).count(),
            "mtp_layers": src.moe_layers.iter().filter(|&&l| l >= src.layers).count(),
            "experts_per_layer": src.n_experts,
            "experts_per_token": src.top_k,
            "context": s.opts.context,
            "dense": src.dense,
        },
        "uptime_seconds": super::now().saturating_sub(s.started),
        "server": {
            "requests": l(&m.requests),
            "rejected": l(&m.rejected),
            "cancelled": l(&m.cancelled),
            "queue_depth": l(&m.queued),
            "batch_size": l(&m.active),
            "batch_size_peak": l(&m.active_peak),
            "max_batch": s.opts.max_active,
            "batch_tokens": l(&m.batch_rows),
            "generated_tokens": l(&m.tokens),
            "forward_steps": l(&m.steps),
            "time_to_first_token_ms": if ttft_n > 0 { l(&m.ttft_us) as f64 / 1e3 / ttft_n as f64 } else { 0.0 },
            "prefix_tokens_reused": l(&m.reused),
            "kv_log_bytes": l(&m.kv_log_bytes),
            "connections_refused": l(&m.connections_refused),
        },
        "speculative": {
            "enabled": s.opts.draft.max > 0,
            "drafted": l(&m.drafted),
            "accepted": l(&m.accepted),
            "acceptance": ratio(l(&m.accepted), l(&m.drafted)),
        },
        "structured": {
            "masks": l(&m.masks),
            "forced": l(&m.forced),
            "forced_accepted": l(&m.forced_accepted),
        },
        "experts": {
            "uses": uses,
            "hits": st.hits,
            "hit_rate": super::metrics::hit_rate((st.hits + st.vram_hits) as f64, uses as f64),
            "vram_hits": st.vram_hits,
            "vram_experts": st.vram_experts,
            "vram_bytes": st.vram_bytes,
            "vram_moves": st.vram_swaps,
            "disk_reads": st.reads,
            "disk_bytes_read": st.bytes_read,
            "cache_bytes": src.cache_bytes,
            "streamed": src.store.is_some(),
        },
        "throughput": src.throughput(),
        "workers": workers,
        "cluster": s.remote.as_ref().map(|r| json!({
            "local_runs": r.fallbacks(),
            "placements": r.placements(),
            "wire_bytes": r.wire_bytes(),
        })),
    });
    if heat {
        let (names, holders) = locations(s, &worker_status);
        let layers: Vec<Json> = src
            .moe_layers
            .iter()
            .zip(holders)
            .map(|(&l, w)| {
                json!({"layer": l, "mtp": l >= src.layers, "uses": src.expert_use.layer(l), "where": w})
            })
            .collect();
        doc["heat"] = json!({"locations": names, "layers": layers});
    }
    doc
}

#[derive(Debug, serde::Deserialize)]
pub(super) struct StatusQuery {
    heat: Option<bool>,
}

pub(super) async fn status(
    State(s): State<Arc<Shared>>,
    Query(q): Query<StatusQuery>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    Ok(axum::Json(document(&s, q.heat.unwrap_or(true))).into_response())
}

/// The status document once a second as server-sent events (`event: status`), the first at
/// once; ends when the client goes away.
pub(super) async fn events(
    State(s): State<Arc<Shared>>,
    Query(q): Query<StatusQuery>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let heat = q.heat.unwrap_or(true);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let weak = Arc::downgrade(&s);
    // a document waits for the stream to take it: a client that stops reading gets no more
    // built for it (the stream's own buffer bounds what it holds)
    let waiting = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let taken = waiting.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let Some(s) = weak.upgrade() else { return };
            if tx.is_closed() {
                return;
            }
            if waiting.swap(true, Ordering::AcqRel) {
                continue;
            }
            if tx.send(document(&s, heat)).is_err() {
                return;
            }
        }
    });
    Ok(super::sse::sse(rx, String::new(), move |doc| {
        taken.store(false, Ordering::Release);
        (format!("event: status\ndata: {doc}\n\n"), false)
    }))
}
