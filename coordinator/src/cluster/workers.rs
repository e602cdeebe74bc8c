//! The workers as the coordinator keeps them: each one's connection, handshake answer and
//! counters; the placement recomputed when one joins; the shard records a fetching worker asks
//! for.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use charm_shared::wire::{Hello, Message};
use charm_worker::server::{read_frame, write_frame};

use crate::cluster::{Capacity, ClusterOptions, Placement, WorkerAddr};

#[derive(Debug)]
pub(super) struct Worker {
    pub(super) addr: WorkerAddr,
    pub(super) conn: Mutex<Option<quinn::Connection>>,
    pub(super) hello: Mutex<Option<Hello>>,
    pub(super) error: Mutex<Option<String>>,
    /// The last request it refused, and why.
    pub(super) refusal: Mutex<Option<String>>,
    pub(super) requests: AtomicU64,
    pub(super) failures: AtomicU64,
    pub(super) joins: AtomicU64,
    pub(super) sent: AtomicU64,
    pub(super) received: AtomicU64,
    /// Sums over its answered requests, nanoseconds.
    pub(super) rtt_ns: AtomicU64,
    pub(super) compute_ns: AtomicU64,
    /// Its last answered requests' times.
    pub(super) recent: Mutex<std::collections::VecDeque<RequestTime>>,
    pub(super) ping_us: AtomicU64,
    /// Requests whose activations went as int8 codes.
    pub(super) coded: AtomicU64,
    /// Expert records (whole) and bytes sent to it for its shard.
    pub(super) shard_records: AtomicU64,
    pub(super) shard_bytes: AtomicU64,
    /// The stream kept open to it for compute requests ([`Lane`]).
    pub(super) lane: Mutex<Lane>,
    /// Streams opened for compute requests.
    pub(super) streams: AtomicU64,
    /// Which experts of its hello it holds in VRAM, from its last heartbeat.
    pub(super) vram: Mutex<Vec<u64>>,
}

/// Answered requests whose times a worker keeps ([`crate::cluster::remote::RemoteExperts::recent`]).
pub(super) const RECENT: usize = 8192;

/// One answered compute request's times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTime {
    /// Its number among the worker's requests (from 1, as `WorkerStatus::requests` counts).
    pub seq: u64,
    /// The layer it computed.
    pub layer: u32,
    /// From encoding the request to its answer read and checked, nanoseconds.
    pub rtt_ns: u64,
    /// The worker's compute, as it reports, nanoseconds.
    pub compute_ns: u64,
}

impl Worker {
    /// Keeps a heartbeat's VRAM bits, cut to the experts its hello lists (a longer answer
    /// cannot name more).
    pub(super) fn set_vram(&self, mut bits: Vec<u64>) {
        let n: usize = self
            .hello
            .lock()
            .expect("worker lock")
            .as_ref()
            .map_or(0, |h| h.experts.iter().map(|l| l.ids.len()).sum());
        bits.truncate(n.div_ceil(64));
        *self.vram.lock().expect("worker lock") = bits;
    }

    /// The experts it holds in VRAM, `(layer, id)` ascending.
    pub(super) fn vram_held(&self) -> Vec<(usize, u32)> {
        let bits = self.vram.lock().expect("worker lock").clone();
        let hello = self.hello.lock().expect("worker lock");
        let Some(h) = hello.as_ref() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut j = 0usize;
        for l in &h.experts {
            for &id in &l.ids {
                if bits.get(j / 64).is_some_and(|w| (w >> (j % 64)) & 1 == 1) {
                    out.push((l.layer as usize, id));
                }
                j += 1;
            }
        }
        out.sort_unstable();
        out
    }

    /// Notes an answered request's times.
    pub(super) fn answered(&self, seq: u64, layer: u32, rtt_ns: u64, compute_ns: u64) {
        self.rtt_ns.fetch_add(rtt_ns, Ordering::Relaxed);
        self.compute_ns.fetch_add(compute_ns, Ordering::Relaxed);
        let mut r = self.recent.lock().expect("worker lock");
        if r.len() == RECENT {
            r.pop_front();
        }
        r.push_back(RequestTime {
            seq,
            layer,
            rtt_ns,
            compute_ns,
        });
    }
}

/// Which stream a compute request goes on.
pub(super) enum LaneUse {
    /// The worker's lane, open.
    Kept(quinn::SendStream, quinn::RecvStream),
    /// The lane, to be opened (and kept).
    Opening,
    /// One of its own (the lane is busy), finished after the request.
    Own,
}

/// A worker's compute requests go one at a time on one stream kept open: a request then opens
/// no stream, so neither side does a stream's setup and teardown and the worker sends no credit
/// for new streams (a packet of its own every few requests, on the request's way). A request
/// that finds the stream in use by another goes on a stream of its own.
#[derive(Debug, Default)]
pub(super) enum Lane {
    /// None open yet (or the last one broke).
    #[default]
    None,
    /// A request has it.
    Busy,
    /// Open on the connection with this `stable_id`, free.
    Free(usize, quinn::SendStream, quinn::RecvStream),
}

impl Worker {
    pub(super) fn conn(&self) -> Option<quinn::Connection> {
        let g = self.conn.lock().expect("worker lock");
        g.as_ref().filter(|c| c.close_reason().is_none()).cloned()
    }
    /// The stream a compute request on `conn` goes on; the worker's lane is busy until
    /// [`Worker::keep_lane`] or [`Worker::end_lane`].
    pub(super) fn take_lane(&self, conn: &quinn::Connection) -> LaneUse {
        let mut l = self.lane.lock().expect("worker lock");
        match std::mem::replace(&mut *l, Lane::Busy) {
            Lane::Free(id, send, recv) if id == conn.stable_id() => LaneUse::Kept(send, recv),
            Lane::Busy => LaneUse::Own,
            // none yet, or one of a connection since lost
            _ => LaneUse::Opening,
        }
    }
    /// A request on the lane has its answer: the stream is free for the next.
    pub(super) fn keep_lane(
        &self,
        conn: &quinn::Connection,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    ) {
        *self.lane.lock().expect("worker lock") = Lane::Free(conn.stable_id(), send, recv);
    }
    /// A request on the lane failed: the next opens another.
    pub(super) fn end_lane(&self) {
        *self.lane.lock().expect("worker lock") = Lane::None;
    }
    pub(super) fn lost(&self, why: String) {
        if let Some(c) = self.conn.lock().expect("worker lock").take() {
            c.close(0u32.into(), b"lost");
        }
        *self.error.lock().expect("worker lock") = Some(why);
    }
}

/// The container whose records fetching workers ask for.
#[derive(Debug)]
pub(super) struct Source {
    pub(super) dir: std::path::PathBuf,
    pub(super) layers: Vec<charm_shared::container::ExpertLayer>,
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) opts: ClusterOptions,
    pub(super) hello: Hello,
    pub(super) endpoint: quinn::Endpoint,
    pub(super) rt: tokio::runtime::Handle,
    pub(super) source: Option<Source>,
    pub(super) workers: Vec<Worker>,
    pub(super) layers: Vec<(usize, usize)>,
    /// Uses per `(layer, expert)`: the routing history's, then the ones seen here.
    pub(super) heat: Mutex<HashMap<(usize, u32), u64>>,
    pub(super) placement: RwLock<Arc<Placement>>,
    /// Placements computed (the first, then one per change).
    pub(super) placements: AtomicU64,
}

impl Shared {
    pub(super) fn replace(&self) {
        let caps: Vec<Option<Capacity>> = self
            .workers
            .iter()
            .map(|w| {
                w.hello
                    .lock()
                    .expect("worker lock")
                    .as_ref()
                    .map(|h| Capacity {
                        // the memory its experts compute from: RAM and VRAM
                        ram_bytes: h.ram_bytes + h.vram_bytes,
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
    pub(super) fn assign(&self, i: usize) {
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
    pub(super) async fn answer_fetches(self: Arc<Self>, i: usize, conn: quinn::Connection) {
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
    pub(super) fn chunk(
        &self,
        i: usize,
        layer: u32,
        expert: u32,
        offset: u64,
        len: u32,
    ) -> Message {
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
    pub(super) fn join(
        self: &Arc<Self>,
        i: usize,
        conn: quinn::Connection,
        h: Hello,
    ) -> Result<(), String> {
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

    pub(super) fn handshake_limit(&self) -> Duration {
        self.opts.deadline.min(Duration::from_secs(10))
    }
}

impl Shared {
    /// Who expert `expert` of `layer` is placed on and what became of them, for an error.
    pub(super) fn holders_of(&self, layer: usize, expert: u32) -> String {
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

pub(super) fn fetch_failed(message: String) -> Message {
    Message::Failed {
        id: 0,
        class: charm_shared::wire::FailureClass::BadRequest,
        message,
    }
}
