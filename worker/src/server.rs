//! The expert worker's QUIC server and the framing both cluster sides use.
//!
//! Every connection is mutual TLS ([`crate::tls`]). Its first stream carries the handshake: the
//! coordinator's [`Hello`], then this worker's, or [`Message::Refused`] naming what differs
//! (protocol version, model). Every later stream carries requests, each answered on it in order
//! before the next is read, until the peer finishes the stream: a coordinator keeps one stream
//! open per worker for its compute requests (opening none per request, and so no stream credit
//! to send back) and opens more only for requests that overlap, heartbeats and fetches, which
//! then run concurrently. A malformed frame ends only its own stream.
//!
//! A [`ComputeRequest`] is served with the worker's [`ExpertExecutor`] as one batch of one
//! expert per row and gate weight 1, which returns each row's unweighted expert output exactly
//! (`0 + 1 * y` is `y`, up to the sign of a zero, which the coordinator's sum cannot see).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use charm_shared::expert::{ErrorClass, ExpertBatch, ExpertError, ExpertExecutor};
use charm_shared::wire::{
    decode_payload, encode_payload, frame_len, receive, ComputeRequest, ComputeResult,
    FailureClass, Hello, Limits, Message, Payload, Received, WireError, LEN_BYTES, MAX_CHUNK,
    MAX_FRAME, PROTOCOL_VERSION,
};

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("stream: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("stream: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream: {0}")]
    Closed(#[from] quinn::ClosedStream),
}

/// Reads one frame and decodes it (length checked before anything is allocated); returns the
/// message and the frame's size in bytes. For a stream that carries one frame: its end is
/// consumed when it came with the frame.
pub async fn read_frame(recv: &mut quinn::RecvStream) -> Result<(Message, usize), FrameError> {
    let m = read_message(recv).await?;
    read_fin(recv);
    Ok(m)
}

/// Reads the next frame of a stream that carries several: an error where the stream ends first.
pub async fn read_message(recv: &mut quinn::RecvStream) -> Result<(Message, usize), FrameError> {
    read_next(recv).await?.ok_or_else(ended)
}

/// A stream that ended where a frame was due.
fn ended() -> FrameError {
    FrameError::Read(quinn::ReadExactError::FinishedEarly(0))
}

/// Reads the next frame of a stream that carries several, or `None` where the stream ends
/// before one starts.
pub async fn read_next(
    recv: &mut quinn::RecvStream,
) -> Result<Option<(Message, usize)>, FrameError> {
    let Some(payload) = read_payload(recv).await? else {
        return Ok(None);
    };
    let n = LEN_BYTES + payload.len();
    Ok(Some((decode_payload(&payload)?, n)))
}

/// [`read_message`] (and for a stream that carries one frame, `last`, [`read_frame`]), a
/// computed result read in place ([`Received`]); returns the frame's size in bytes too.
pub async fn read_received(
    recv: &mut quinn::RecvStream,
    last: bool,
) -> Result<(Received, usize), FrameError> {
    let payload = read_payload(recv).await?.ok_or_else(ended)?;
    if last {
        read_fin(recv);
    }
    let n = LEN_BYTES + payload.len();
    Ok((receive(payload)?, n))
}

/// The next frame's payload of a stream that carries several (its length checked before
/// anything is allocated), or `None` where the stream ends before one starts.
async fn read_payload(recv: &mut quinn::RecvStream) -> Result<Option<Payload>, FrameError> {
    let mut prefix = [0u8; LEN_BYTES];
    match recv.read_exact(&mut prefix).await {
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        r => r?,
    }
    let n = frame_len(prefix)?;
    // the stream's received pieces copied once into an aligned buffer, which rkyv reads in
    // place
    let mut payload = Payload::with_capacity(n);
    while payload.len() < n {
        match recv
            .read_chunk(n - payload.len(), true)
            .await
            .map_err(quinn::ReadExactError::ReadError)?
        {
            Some(c) => payload.extend_from_slice(&c.bytes),
            None => return Err(quinn::ReadExactError::FinishedEarly(payload.len()).into()),
        }
    }
    Ok(Some(payload))
}

/// Consumes the end of `recv` when it has already arrived (the peer finishes each stream right
/// after its one frame, so the FIN comes with the last bytes), without waiting for it. A stream
/// dropped before its end is read is stopped with a STOP_SENDING frame: an extra packet, sent
/// on the request's critical path.
fn read_fin(recv: &mut quinn::RecvStream) {
    use std::future::Future;
    let mut probe = [0u8; 1];
    let read = std::pin::pin!(recv.read(&mut probe));
    let _ = read.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
}

/// Ack-eliciting packets a peer of a cluster connection may receive before it must send an
/// ACK at once (QUIC's ACK-frequency extension; the default, 1, acknowledges every second
/// packet). A decode-sized message of up to this many packets is then acknowledged by the next
/// message the other way (or after [`ACK_DELAY`]) instead of by an ACK-only packet sent on the
/// receiver's critical path before it reads. Kept under half the initial congestion window (10
/// packets), which request-and-answer traffic seldom grows: a sender must never wait for
/// acknowledgements the receiver is holding back.
const ACK_EVERY: u32 = 4;

/// The longest a peer may hold back an acknowledgement (QUIC's default is 25 ms).
const ACK_DELAY: Duration = Duration::from_millis(1);

/// QUIC transport settings of cluster connections: keep-alives every `heartbeat`, a connection
/// given up after 4 heartbeats (at least 2 s) of silence, flow-control windows sized for a
/// prefill step's activations, at most 32 streams open at once per peer (and no one-way ones),
/// acknowledgements delayed ([`ACK_EVERY`], [`ACK_DELAY`]).
pub fn transport(heartbeat: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let idle = (heartbeat * 4).max(Duration::from_secs(2));
    t.keep_alive_interval(Some(heartbeat));
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).expect("idle timeout fits"),
    ));
    // a peer gets few streams at once: each may hold a frame of up to MAX_FRAME in memory
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(32));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(0));
    t.stream_receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32 / 2));
    t.receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32));
    t.send_window(MAX_FRAME as u64);
    let mut ack = quinn::AckFrequencyConfig::default();
    ack.ack_eliciting_threshold(quinn::VarInt::from_u32(ACK_EVERY))
        .max_ack_delay(Some(ACK_DELAY));
    t.ack_frequency_config(Some(ack));
    t
}

/// Writes one frame and finishes the stream's sending side.
pub async fn write_frame(send: &mut quinn::SendStream, m: &Message) -> Result<(), FrameError> {
    write_message(send, m).await?;
    send.finish()?;
    Ok(())
}

/// Writes one frame of a stream that carries several.
pub async fn write_message(send: &mut quinn::SendStream, m: &Message) -> Result<(), FrameError> {
    write_payload(send, encode_payload(m)?).await?;
    Ok(())
}

/// Writes a frame of `payload` ([`encode_payload`]): its length, then the payload handed to the
/// stream as it is, not copied into the stream's buffer. Returns the frame's size in bytes.
pub async fn write_payload(
    send: &mut quinn::SendStream,
    payload: Payload,
) -> Result<usize, FrameError> {
    let n = payload.len();
    if n > MAX_FRAME {
        return Err(WireError::TooLarge(n).into());
    }
    let prefix = bytes::Bytes::copy_from_slice(&(n as u32).to_le_bytes());
    send.write_all_chunks(&mut [prefix, bytes::Bytes::from_owner(payload)])
        .await?;
    Ok(LEN_BYTES + n)
}

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

/// Keeps the network thread polling its sockets for `spin` after each answer, so that the next
/// request of a decode (one per MoE layer, a dense pass apart) is read by a thread that is
/// already running rather than by one woken for it: waking a thread costs 10-30 us on a virtual
/// machine when its core sleeps, and a cross-core interrupt and a context switch when it does
/// not, paid by every round trip. A task on the worker's runtime yields in a loop until `spin`
/// has passed since the last answer (to the runtime, which then polls the sockets without
/// blocking in them, and now and then the core to any other thread that wants it); then it
/// waits for the next answer. The price is a core kept busy while requests come, which costs
/// power and takes time from other processes on the machine: `charm worker --spin-us 0` turns
/// it off, and workers started on loopback beside their coordinator have it off.
#[derive(Debug)]
pub struct Warm {
    base: std::time::Instant,
    /// Nanoseconds from `base` to the last answer.
    last: std::sync::atomic::AtomicU64,
    spin: Duration,
    answered: tokio::sync::Notify,
}

/// Polls of the sockets (a microsecond or two each) between two offers of the core to other
/// threads while a worker polls: often enough that a thread sharing the core waits a few tens of
/// microseconds at most, seldom enough that the offers (a system call each) add little to a
/// request's wait on a core of its own.
const YIELD_CORE_EVERY: u32 = 8;

/// How long a worker keeps its core awake after an answer by default, microseconds.
pub const WORKER_SPIN_US: u64 = 1000;

impl Warm {
    /// `None` when `spin` is zero. [`serve`] runs its polling task.
    pub fn new(spin: Duration) -> Option<Arc<Self>> {
        (!spin.is_zero()).then(|| {
            Arc::new(Self {
                base: std::time::Instant::now(),
                last: std::sync::atomic::AtomicU64::new(0),
                spin,
                answered: tokio::sync::Notify::new(),
            })
        })
    }

    /// Whether the last answer went out less than `spin` ago.
    fn warm(&self) -> bool {
        let since = (self.base.elapsed().as_nanos() as u64)
            .saturating_sub(self.last.load(std::sync::atomic::Ordering::Relaxed));
        since < self.spin.as_nanos() as u64
    }

    /// The polling task ([`serve`] runs it on the worker's runtime): after each answer, yields
    /// (so the runtime thread polls its sockets without blocking) until `spin` has passed since
    /// the last one.
    pub async fn poll(self: Arc<Self>) {
        loop {
            self.answered.notified().await;
            let mut polls = 0u32;
            while self.warm() {
                // now and then the core, to any other thread that wants it (on a machine shared
                // with other work, a coordinator among them); each time the runtime, which polls
                // the sockets
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(YIELD_CORE_EVERY) {
                    std::thread::yield_now();
                }
                tokio::task::yield_now().await;
            }
        }
    }

    /// An answer went out: poll from now.
    pub fn answered(&self) {
        self.last.store(
            self.base.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        self.answered.notify_one();
    }
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

/// Fetches the records of the experts placed on this worker that its shard lacks, one at a
/// time in chunks, from the coordinator at the other end of `conn`; prints its progress.
async fn fetch_shard(
    conn: quinn::Connection,
    shard: Arc<crate::shard::Shard>,
    node: String,
    mut assigned: tokio::sync::watch::Receiver<Vec<(usize, u32)>>,
) {
    // a test hook: die (as a kill would) after storing this many records
    let abort_after: Option<usize> = std::env::var("CHARM_FETCH_ABORT_AFTER")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut stored = 0usize;
    loop {
        let todo = shard.missing(&assigned.borrow_and_update());
        if todo.is_empty() {
            if assigned.changed().await.is_err() {
                return;
            }
            continue;
        }
        let bytes: u64 = todo
            .iter()
            .filter_map(|k| shard.layer(k.0).map(|l| l.record_bytes))
            .sum();
        eprintln!(
            "{node}: fetching {} expert records ({:.2} GB) of its shard from the coordinator",
            todo.len(),
            bytes as f64 / 1e9
        );
        let mut last = std::time::Instant::now();
        for (i, &(layer, expert)) in todo.iter().enumerate() {
            let rec = match fetch_record(&conn, &shard, layer, expert).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{node}: fetching layer {layer} expert {expert}: {e}");
                    if conn.close_reason().is_some() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            };
            let s2 = shard.clone();
            let kept = tokio::task::spawn_blocking(move || s2.store(layer, expert, &rec)).await;
            match kept {
                Ok(Ok(())) => stored += 1,
                Ok(Err(e)) => {
                    eprintln!("{node}: layer {layer} expert {expert} not kept: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
                Err(e) => {
                    eprintln!("{node}: {e}");
                    return;
                }
            }
            if abort_after.is_some_and(|n| stored >= n) {
                std::process::abort();
            }
            if last.elapsed() > Duration::from_secs(2) || i + 1 == todo.len() {
                eprintln!(
                    "{node}: {}/{} records fetched ({} held)",
                    i + 1,
                    todo.len(),
                    shard.held()
                );
                last = std::time::Instant::now();
            }
        }
    }
}

/// One expert record from the coordinator, in chunks of at most [`MAX_CHUNK`].
async fn fetch_record(
    conn: &quinn::Connection,
    shard: &crate::shard::Shard,
    layer: usize,
    expert: u32,
) -> Result<Vec<u8>, String> {
    let total = shard
        .layer(layer)
        .ok_or_else(|| format!("layer {layer} has no experts"))?
        .record_bytes;
    let mut rec = Vec::with_capacity(total as usize);
    while (rec.len() as u64) < total {
        let offset = rec.len() as u64;
        let len = (total - offset).min(MAX_CHUNK as u64) as u32;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        let ask = Message::Fetch {
            layer: layer as u32,
            expert,
            offset,
            len,
        };
        write_frame(&mut send, &ask)
            .await
            .map_err(|e| e.to_string())?;
        match read_frame(&mut recv).await.map_err(|e| e.to_string())?.0 {
            Message::Chunk {
                layer: l,
                expert: e,
                offset: o,
                data,
            } if l as usize == layer
                && e == expert
                && o == offset
                && data.len() == len as usize =>
            {
                rec.extend_from_slice(&data)
            }
            Message::Failed { message, .. } => return Err(message),
            _ => return Err("the coordinator answered a fetch with something else".into()),
        }
    }
    Ok(rec)
}

/// A QUIC endpoint listening on `addr` with this node's TLS identity. A coordinator that goes
/// silent is given up after 30 s.
pub fn listen(
    addr: SocketAddr,
    identity: &crate::tls::Identity,
) -> Result<quinn::Endpoint, Box<dyn std::error::Error + Send + Sync>> {
    let mut cfg = identity.server_config()?;
    let mut t = transport(Duration::from_secs(5));
    t.max_idle_timeout(Some(quinn::IdleTimeout::from(quinn::VarInt::from_u32(
        30_000,
    ))));
    cfg.transport_config(Arc::new(t));
    Ok(quinn::Endpoint::server(cfg, addr)?)
}

/// Accepts connections on `endpoint` until it closes (and runs `svc`'s polling task until
/// then).
pub async fn serve(endpoint: quinn::Endpoint, svc: Arc<Service>) {
    let poller = svc.warm.as_ref().map(|w| tokio::spawn(w.clone().poll()));
    while let Some(incoming) = endpoint.accept().await {
        let svc = svc.clone();
        tokio::spawn(async move {
            // a failed TLS handshake (no certificate from this cluster, plaintext) ends here
            if let Ok(conn) = incoming.await {
                connection(conn, svc).await;
            }
        });
    }
    if let Some(p) = poller {
        p.abort();
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

async fn connection(conn: quinn::Connection, svc: Arc<Service>) {
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let reply = match read_frame(&mut recv).await.map(|f| f.0) {
        Ok(Message::Hello(peer)) => match svc.refusal(&peer) {
            None => Message::Hello(svc.hello_now()),
            Some(reason) => Message::Refused { reason },
        },
        Ok(_) => Message::Refused {
            reason: "the first message must be a hello".into(),
        },
        Err(e) => Message::Refused {
            reason: e.to_string(),
        },
    };
    let refused = matches!(reply, Message::Refused { .. });
    if write_frame(&mut send, &reply).await.is_err() || refused {
        // let the refusal reach the peer before the connection closes
        let _ = send.stopped().await;
        conn.close(1u32.into(), b"refused");
        return;
    }
    // the experts placed on this worker, for its shard fetcher
    let (assigned_tx, assigned_rx) = tokio::sync::watch::channel(Vec::<(usize, u32)>::new());
    if let Some(shard) = &svc.shard {
        tokio::spawn(fetch_shard(
            conn.clone(),
            shard.clone(),
            svc.hello.node.clone(),
            assigned_rx,
        ));
    }
    let assigned_tx = Arc::new(assigned_tx);
    while let Ok((send, recv)) = conn.accept_bi().await {
        tokio::spawn(requests(send, recv, svc.clone(), assigned_tx.clone()));
    }
}

/// Serves the requests of one stream in order until the peer finishes it (or a frame cannot be
/// read: its answer says why, and the stream ends).
async fn requests(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    svc: Arc<Service>,
    assigned: Arc<tokio::sync::watch::Sender<Vec<(usize, u32)>>>,
) {
    loop {
        let (reply, more) = match read_next(&mut recv).await {
            Ok(None) => break,
            Ok(Some((m, _))) => (reply(m, &svc, &assigned).await, true),
            Err(e) => (
                Message::Failed {
                    id: 0,
                    class: FailureClass::BadRequest,
                    message: e.to_string(),
                },
                false,
            ),
        };
        let written = write_message(&mut send, &reply).await.is_ok();
        if let Some(w) = &svc.warm {
            w.answered();
        }
        if !written || !more {
            break;
        }
    }
    let _ = send.finish();
}

/// The answer to one request.
async fn reply(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::{init_cluster, Identity};
    use crate::RamExperts;
    use charm_shared::linear::SwiGlu;
    use charm_shared::wire::encode;
    use charm_shared::wire::{LayerExperts, Run};

    const H: usize = 8;

    fn expert(seed: f32) -> SwiGlu {
        crate::tests::expert(seed, H, 4)
    }

    fn hello(node: &str, version: u32, model: &str) -> Hello {
        Hello {
            version,
            ..Hello::holding_nothing(node, model, vec!["f32".into()])
        }
    }

    fn certs(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("charm-srv-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        init_cluster(&d, &["coordinator".into(), "w1".into()]).unwrap();
        d
    }

    async fn dial(dir: &Path, addr: SocketAddr) -> Result<quinn::Connection, String> {
        let id = Identity::load(dir, "coordinator").unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(id.client_config().unwrap());
        let c = ep.connect(addr, "w1").map_err(|e| e.to_string())?;
        tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .map_err(|_| "timeout".to_string())?
            .map_err(|e| e.to_string())
    }

    /// Serves `svc` as worker w1 of the cluster in `dir` on a loopback port (a task of the
    /// calling runtime); its address.
    fn serving(dir: &Path, svc: Arc<Service>) -> SocketAddr {
        let ep = listen(
            "127.0.0.1:0".parse().unwrap(),
            &Identity::load(dir, "w1").unwrap(),
        )
        .unwrap();
        let addr = ep.local_addr().unwrap();
        tokio::spawn(serve(ep, svc));
        addr
    }

    /// Sends raw `bytes` on a new stream and reads the answer.
    async fn exchange(c: &quinn::Connection, bytes: &[u8]) -> Message {
        let (mut s, mut r) = c.open_bi().await.unwrap();
        s.write_all(bytes).await.unwrap();
        s.finish().unwrap();
        read_frame(&mut r).await.unwrap().0
    }

    use std::path::Path;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_worker_refuses_what_it_must_and_keeps_serving() {
        let dir = certs("main");
        let store = Arc::new(RamExperts {
            hidden: H,
            layers: vec![Some((0..4).map(|e| expert(e as f32)).collect())],
        });
        let svc = Arc::new(Service {
            executor: store.clone(),
            hello: Hello {
                experts: vec![LayerExperts {
                    layer: 0,
                    ids: vec![0, 1, 2, 3],
                }],
                ..hello("w1", PROTOCOL_VERSION, "m1")
            },
            limits: Limits {
                hidden: H,
                n_experts: 4,
                max_tokens: 16,
            },
            shard: None,
            warm: Warm::new(Duration::from_millis(1)),
            vram: None,
        });
        let addr = serving(&dir, svc);

        // plaintext garbage at the port: ignored
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        u.send_to(b"GET / HTTP/1.0\r\n\r\n", addr).unwrap();
        u.send_to(&[0xff; 1200], addr).unwrap();

        // wrong protocol version, another model: refused, naming what differs
        for (h, why) in [
            (
                hello("coordinator", PROTOCOL_VERSION + 1, "m1"),
                "protocol version",
            ),
            (hello("coordinator", PROTOCOL_VERSION, "m2"), "model m2"),
        ] {
            let c = dial(&dir, addr).await.unwrap();
            match exchange(&c, &encode(&Message::Hello(h)).unwrap()).await {
                Message::Refused { reason } => assert!(reason.contains(why), "{reason}"),
                m => panic!("{m:?}"),
            }
        }

        // a certificate from another cluster's authority (trusting this one's, so it is the
        // worker that must refuse it), and a client of another cluster: the TLS handshake fails
        let other = certs("other");
        let mixed = other.join("mixed");
        std::fs::create_dir(&mixed).unwrap();
        std::fs::copy(dir.join("ca.pem"), mixed.join("ca.pem")).unwrap();
        for f in ["coordinator.pem", "coordinator.key"] {
            std::fs::copy(other.join(f), mixed.join(f)).unwrap();
        }
        for d in [&mixed, &other] {
            let refused = match dial(d, addr).await {
                Err(_) => true,
                // TLS 1.3: the client may finish before the server's verdict arrives
                Ok(c) => match c.open_bi().await {
                    Err(_) => true,
                    Ok((mut s, mut r)) => {
                        let ping = encode(&Message::Ping { seq: 1 }).unwrap();
                        let _ = s.write_all(&ping).await;
                        let _ = s.finish();
                        read_frame(&mut r).await.is_err()
                    }
                },
            };
            assert!(
                refused,
                "a node of another cluster was served ({})",
                d.display()
            );
        }

        let c = dial(&dir, addr).await.unwrap();
        match exchange(
            &c,
            &encode(&Message::Hello(hello(
                "coordinator",
                PROTOCOL_VERSION,
                "m1",
            )))
            .unwrap(),
        )
        .await
        {
            Message::Hello(h) => assert_eq!(h.node, "w1"),
            m => panic!("{m:?}"),
        }
        let req = |experts: &[u32]| ComputeRequest {
            id: 5,
            step: 1,
            layer: 0,
            hidden: H as u32,
            activations: "f32".into(),
            x: (0..2 * H).map(|k| (k as f32 * 0.3).cos()).collect(),
            group: 0,
            codes: vec![],
            amax: vec![],
            runs: experts
                .iter()
                .map(|&e| Run {
                    expert: e,
                    rows: vec![1, 0],
                })
                .collect(),
        };
        let bad = |m: Message, why: &str| match m {
            Message::Failed { class, message, .. } => {
                assert_eq!(class, FailureClass::BadRequest, "{message}");
                assert!(message.contains(why), "{message} (wanted {why})");
            }
            m => panic!("{m:?}"),
        };
        // malformed, truncated, oversized, out of range: refused on their own streams
        let mut junk = encode(&Message::Compute(req(&[1]))).unwrap();
        for b in junk.iter_mut().skip(LEN_BYTES + 8) {
            *b ^= 0x5a;
        }
        bad(exchange(&c, &junk).await, "malformed");
        let ok = encode(&Message::Compute(req(&[1]))).unwrap();
        bad(exchange(&c, &ok[..ok.len() - 3]).await, "stream");
        bad(
            exchange(&c, &((MAX_FRAME + 1) as u32).to_le_bytes()).await,
            "exceeds",
        );
        bad(
            exchange(&c, &encode(&Message::Compute(req(&[9]))).unwrap()).await,
            "expert 9",
        );
        let mut wide = req(&[1]);
        wide.hidden = 4;
        bad(
            exchange(&c, &encode(&Message::Compute(wide)).unwrap()).await,
            "hidden 4",
        );
        // the same connection still computes, exactly as the store does
        let r = req(&[1, 3]);
        match exchange(&c, &encode(&Message::Compute(r.clone())).unwrap()).await {
            Message::Computed(res) => {
                res.check(&r).unwrap();
                let mut at = 0;
                for run in &r.runs {
                    let e = &store.layers[0].as_ref().unwrap()[run.expert as usize];
                    let xs: Vec<f32> = run
                        .rows
                        .iter()
                        .flat_map(|&row| r.x[row as usize * H..(row as usize + 1) * H].to_vec())
                        .collect();
                    let n = run.rows.len() * H;
                    assert_eq!(e.forward(&xs, run.rows.len()), res.out[at..at + n]);
                    at += n;
                }
                assert_eq!(at, res.out.len());
            }
            m => panic!("{m:?}"),
        }
        match exchange(&c, &encode(&Message::Ping { seq: 4 }).unwrap()).await {
            Message::Pong { seq, .. } => assert_eq!(seq, 4),
            m => panic!("{m:?}"),
        }
        // one stream carries requests one after another, each answered in order, also when the
        // next is written before the last is answered
        let (mut s, mut rx) = c.open_bi().await.unwrap();
        let asks: Vec<ComputeRequest> = [&[1u32, 3][..], &[0], &[2, 3]]
            .iter()
            .enumerate()
            .map(|(i, e)| ComputeRequest {
                id: 10 + i as u64,
                ..req(e)
            })
            .collect();
        let answered = |m: Option<(Message, usize)>, r: &ComputeRequest| match m {
            Some((Message::Computed(res), _)) => res.check(r).unwrap(),
            m => panic!("{m:?}"),
        };
        s.write_all(&encode(&Message::Compute(asks[0].clone())).unwrap())
            .await
            .unwrap();
        answered(read_next(&mut rx).await.unwrap(), &asks[0]);
        for r in &asks[1..] {
            s.write_all(&encode(&Message::Compute(r.clone())).unwrap())
                .await
                .unwrap();
        }
        for r in &asks[1..] {
            answered(read_next(&mut rx).await.unwrap(), r);
        }
        // a frame it cannot read is answered with why, and ends that stream (only)
        s.write_all(&((MAX_FRAME + 1) as u32).to_le_bytes())
            .await
            .unwrap();
        bad(read_next(&mut rx).await.unwrap().unwrap().0, "exceeds");
        assert!(read_next(&mut rx).await.unwrap().is_none());
        match exchange(&c, &encode(&Message::Ping { seq: 5 }).unwrap()).await {
            Message::Pong { seq, .. } => assert_eq!(seq, 5),
            m => panic!("{m:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&other).unwrap();
    }

    /// A request and its answer cost their own packets and nothing more on either side's
    /// critical path: each stream is read to its end (a stream dropped before its FIN is read
    /// is stopped with a STOP_SENDING packet), and an answer of a few packets is acknowledged by
    /// the next request rather than by ACK-only packets sent before it is read.
    #[tokio::test]
    async fn a_request_costs_no_packets_beyond_its_own() {
        const WIDE: usize = 256;
        let dir = certs("packets");
        let store = Arc::new(RamExperts {
            hidden: WIDE,
            layers: vec![Some(
                (0..2)
                    .map(|e| crate::tests::expert(e as f32, WIDE, 4))
                    .collect(),
            )],
        });
        let svc = Arc::new(Service {
            executor: store,
            hello: Hello {
                experts: vec![LayerExperts {
                    layer: 0,
                    ids: vec![0, 1],
                }],
                ..hello("w1", PROTOCOL_VERSION, "m1")
            },
            limits: Limits {
                hidden: WIDE,
                n_experts: 2,
                max_tokens: 16,
            },
            shard: None,
            warm: None,
            vram: None,
        });
        let addr = serving(&dir, svc);
        let id = Identity::load(&dir, "coordinator").unwrap();
        let mut cfg = id.client_config().unwrap();
        cfg.transport_config(Arc::new(transport(Duration::from_secs(1))));
        let mut client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        client.set_default_client_config(cfg);
        let c = client.connect(addr, "w1").unwrap().await.unwrap();
        let hi = Message::Hello(hello("coordinator", PROTOCOL_VERSION, "m1"));
        assert!(matches!(
            exchange(&c, &encode(&hi).unwrap()).await,
            Message::Hello(_)
        ));
        // about 3 KB each way: three packets
        let req = ComputeRequest {
            id: 1,
            step: 1,
            layer: 0,
            hidden: WIDE as u32,
            activations: "f32".into(),
            x: (0..3 * WIDE).map(|k| (k as f32 * 0.1).sin()).collect(),
            group: 0,
            codes: vec![],
            amax: vec![],
            runs: vec![Run {
                expert: 1,
                rows: vec![0, 1, 2],
            }],
        };
        let frame = encode(&Message::Compute(req.clone())).unwrap();
        let before = c.stats();
        let n = 40;
        for _ in 0..n {
            match exchange(&c, &frame).await {
                Message::Computed(r) => r.check(&req).unwrap(),
                m => panic!("{m:?}"),
            }
        }
        let after = c.stats();
        // one send call per request (its packets go together), not one more for ACKs: with
        // QUIC's default of an ACK every second packet this side makes about two per request
        let sends = after.udp_tx.ios - before.udp_tx.ios;
        assert!(sends <= n + n / 4, "{sends} send calls for {n} requests");
        assert_eq!(after.frame_tx.stop_sending, 0, "this side stopped streams");
        assert_eq!(after.frame_rx.stop_sending, 0, "the worker stopped streams");
        // on one stream kept open: the same, and the worker sends no credit for new streams
        // (a stream a request opens is one more for it to allow, which it says every few
        // requests in a packet of its own)
        assert!(after.frame_rx.max_streams_bidi > before.frame_rx.max_streams_bidi);
        let (mut s, mut rx) = c.open_bi().await.unwrap();
        for _ in 0..n {
            s.write_all(&frame).await.unwrap();
            match read_next(&mut rx).await.unwrap() {
                Some((Message::Computed(r), _)) => r.check(&req).unwrap(),
                m => panic!("{m:?}"),
            }
        }
        let kept = c.stats();
        let sends = kept.udp_tx.ios - after.udp_tx.ios;
        assert!(sends <= n + n / 4, "{sends} send calls for {n} requests");
        assert_eq!(
            kept.frame_rx.max_streams_bidi, after.frame_rx.max_streams_bidi,
            "stream credit for requests on one stream"
        );
        assert_eq!(kept.frame_rx.stop_sending, 0, "the worker stopped streams");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
