//! What a request gets: the handshake's verdict, a compute request checked and run on the
//! worker's executor, heartbeats and assignments.
//!
//! A [`ComputeRequest`] is served with the worker's [`ExpertExecutor`] as one batch of one
//! expert per row and gate weight 1, which returns each row's unweighted expert output exactly
//! (`0 + 1 * y` is `y`, up to the sign of a zero, which the coordinator's sum cannot see).

use std::sync::Arc;

use charm_shared::expert::{ErrorClass, ExpertBatch, ExpertError, ExpertExecutor};
use charm_shared::wire::{
    ComputeRequest, ComputeResult, FailureClass, Hello, Limits, Message, PROTOCOL_VERSION,
};

use super::warm::Warm;

/// What a worker serves.
#[derive(Debug)]
pub struct Service {
    /// Computes the experts this worker holds.
    pub executor: Arc<dyn ExpertExecutor>,
    /// This worker's identity, model and holdings, sent in the handshake.
    pub hello: Hello,
    /// Shapes requests are checked against.
    pub limits: Limits,
    /// The shard this worker fetches from the coordinator, when it started without every
    /// expert record (see [`crate::shard`]).
    pub shard: Option<Arc<crate::shard::Shard>>,
    /// Keeps this worker's network thread polling for a while after each answer; `None`: it
    /// sleeps as soon as it is idle.
    pub warm: Option<Arc<Warm>>,
    /// The VRAM tier in front of `executor`, when experts run on a GPU: heartbeats say which.
    pub vram: Option<Arc<crate::gpu::tier::VramExperts>>,
}

impl Service {
    /// Which experts of its hello this worker holds in VRAM (see [`Message::Pong`]).
    pub fn vram_bits(&self) -> Vec<u64> {
        let Some(v) = &self.vram else {
            return Vec::new();
        };
        let held = v.held();
        let total: usize = self.hello.experts.iter().map(|l| l.ids.len()).sum();
        let mut bits = vec![0u64; total.div_ceil(64)];
        let mut j = 0;
        for l in &self.hello.experts {
            for &id in &l.ids {
                if held.binary_search(&(l.layer as usize, id)).is_ok() {
                    bits[j / 64] |= 1 << (j % 64);
                }
                j += 1;
            }
        }
        bits
    }

    /// The hello this worker answers with now (a fetching worker's holdings grow).
    pub fn hello_now(&self) -> Hello {
        let mut h = self.hello.clone();
        if let Some(s) = &self.shard {
            h.fetches = true;
            for l in &mut h.experts {
                l.ids.retain(|&e| s.has(l.layer as usize, e));
            }
        }
        h
    }

    /// Why a peer's hello is refused, if it is.
    pub fn refusal(&self, peer: &Hello) -> Option<String> {
        if peer.version != PROTOCOL_VERSION {
            return Some(format!(
                "protocol version {} (this worker speaks {PROTOCOL_VERSION})",
                peer.version
            ));
        }
        if peer.model != self.hello.model {
            return Some(format!(
                "model {} (this worker serves {})",
                peer.model, self.hello.model
            ));
        }
        None
    }

    /// Serves one compute request, then parks the compute helpers: the next request is a round
    /// trip away, and they would spin on cores the network stack (or, on one machine, the
    /// coordinator) needs meanwhile.
    fn answer(&self, req: &ComputeRequest) -> Message {
        let answer = self.compute(req);
        charm_shared::par::rest();
        answer
    }

    /// Serves one compute request.
    pub fn compute(&self, req: &ComputeRequest) -> Message {
        let failed = |class, message: String| Message::Failed {
            id: req.id,
            class,
            message,
        };
        if let Err(e) = req.check(&self.limits) {
            return failed(FailureClass::BadRequest, e.to_string());
        }
        if let Some(s) = &self.shard {
            if let Some(r) = req
                .runs
                .iter()
                .find(|r| !s.has(req.layer as usize, r.expert))
            {
                return failed(
                    FailureClass::Unavailable,
                    format!("layer {} expert {}: not fetched yet", req.layer, r.expert),
                );
            }
        }
        if !self.hello.activations.contains(&req.activations) {
            return failed(
                FailureClass::BadRequest,
                format!(
                    "activation mode {} (this worker computes in {})",
                    req.activations,
                    self.hello.activations.join(", ")
                ),
            );
        }
        if req.group > 0 && req.group != self.hello.act_group {
            return failed(
                FailureClass::BadRequest,
                format!(
                    "activation codes in groups of {} (this worker takes {})",
                    req.group, self.hello.act_group
                ),
            );
        }
        let h = req.hidden as usize;
        let xs = req.activations_f32();
        let rows: usize = req.runs.iter().map(|r| r.rows.len()).sum();
        let mut x = Vec::with_capacity(rows * h);
        let mut ids = Vec::with_capacity(rows);
        for r in &req.runs {
            for &row in &r.rows {
                let row = row as usize;
                x.extend_from_slice(&xs[row * h..(row + 1) * h]);
                ids.push(r.expert);
            }
        }
        let weights = vec![1.0f32; rows];
        let t = std::time::Instant::now();
        let batch = ExpertBatch {
            step: req.step,
            layer: req.layer as usize,
            x: &x,
            n_tokens: rows,
            ids: &ids,
            weights: &weights,
            top_k: 1,
        };
        match self.executor.run(batch) {
            // the rows were gathered run after run: the output is the runs' outputs in order
            Ok(out) => Message::Computed(ComputeResult {
                id: req.id,
                compute_ns: t.elapsed().as_nanos() as u64,
                out,
            }),
            Err(e) => failed(failure_class(&e), e.to_string()),
        }
    }
}

/// The wire class of an expert error.
pub fn failure_class(e: &ExpertError) -> FailureClass {
    match e.class() {
        ErrorClass::BadRequest => FailureClass::BadRequest,
        ErrorClass::Unavailable => FailureClass::Unavailable,
        ErrorClass::Internal => FailureClass::Internal,
    }
}

/// Rows up to which a compute request runs on the connection's runtime thread rather than on
/// the blocking pool: a decode step's rows for one worker (its share of top-k experts times a
/// few tokens), whose compute is shorter than the two thread hand-offs it would otherwise pay.
/// Larger requests (prefill, wide batches) go to the blocking pool, so that heartbeats and
/// other streams are served meanwhile.
const INLINE_ROWS: usize = 64;

fn inline(req: &ComputeRequest) -> bool {
    req.runs.iter().map(|r| r.rows.len()).sum::<usize>() <= INLINE_ROWS
}

/// The answer to one request.
pub(super) async fn reply(
    m: Message,
    svc: &Arc<Service>,
    assigned: &tokio::sync::watch::Sender<Vec<(usize, u32)>>,
) -> Message {
    match m {
        Message::Assign { experts } => {
            let list = experts
                .iter()
                .flat_map(|l| l.ids.iter().map(move |&e| (l.layer as usize, e)))
                .collect();
            let _ = assigned.send(list);
            Message::Pong {
                seq: 0,
                vram: Vec::new(),
            }
        }
        // a decode-sized request is computed on this task's thread: the hand-off to the
        // blocking pool and back would cost more than the work
        Message::Compute(req) if inline(&req) => svc.answer(&req),
        Message::Compute(req) => {
            let svc2 = svc.clone();
            tokio::task::spawn_blocking(move || svc2.answer(&req))
                .await
                .unwrap_or_else(|e| Message::Failed {
                    id: 0,
                    class: FailureClass::Internal,
                    message: format!("compute task: {e}"),
                })
        }
        Message::Ping { seq } => Message::Pong {
            seq,
            vram: svc.vram_bits(),
        },
        _ => Message::Failed {
            id: 0,
            class: FailureClass::BadRequest,
            message: "unexpected message".into(),
        },
    }
}
