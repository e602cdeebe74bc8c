//! One worker's QUIC connection: the handshake, heartbeats and redials, and one compute request
//! with its deadline and checked answer.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use charm_shared::wire::{
    encode_payload, ComputeRequest, Hello, Message, Received, ResultView, PROTOCOL_VERSION,
};
use charm_worker::server::{read_frame, read_received, write_frame, write_payload};

use super::workers::{LaneUse, Shared, Worker};
use crate::cluster::WorkerAddr;

/// Keeps worker `i` in use: pings it while connected, dials it again while not.
pub(super) async fn keep(s: Arc<Shared>, i: usize) {
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
                    Ok(Ok(vram)) => {
                        w.ping_us
                            .store(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                        w.set_vram(vram);
                    }
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

/// Pings a worker; its answer says which of its experts it holds in VRAM (see
/// [`Message::Pong`]).
pub(super) async fn ping(c: quinn::Connection, seq: u64) -> Result<Vec<u64>, String> {
    let (mut send, mut recv) = c.open_bi().await.map_err(|e| e.to_string())?;
    write_frame(&mut send, &Message::Ping { seq })
        .await
        .map_err(|e| e.to_string())?;
    match read_frame(&mut recv).await.map_err(|e| e.to_string())?.0 {
        Message::Pong { seq: s, vram } if s == seq => Ok(vram),
        _ => Err("answered a ping with something else".into()),
    }
}

pub(super) async fn handshake(
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
pub(super) enum Answer {
    Done(ResultView),
    /// The worker is fine but could not serve it.
    Refused(String),
    /// The connection or the answer is broken: the worker is dropped from use.
    Broken(String),
}

/// A layer's first requests on their way, shared by them: when its last holder lets go (the
/// last of them is written, or given up), the thread that started the layer may go back to
/// computing.
pub(super) struct Sent(Option<tokio::sync::oneshot::Sender<()>>);

impl Sent {
    pub(super) fn new(done: tokio::sync::oneshot::Sender<()>) -> Arc<Self> {
        Arc::new(Self(Some(done)))
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Sends one request on its own stream and waits for its checked result; its share of `sent`
/// is let go once the request is written.
pub(super) async fn request(
    w: &Worker,
    conn: quinn::Connection,
    req: ComputeRequest,
    limit: Duration,
    mut sent: Option<Arc<Sent>>,
) -> Answer {
    let t = Instant::now();
    // encoded in place (the activations are not copied), kept to check the answer against
    let m = Message::Compute(req);
    let payload = encode_payload(&m);
    let Message::Compute(req) = m else {
        unreachable!("built above")
    };
    let req = &req;
    let lane = w.take_lane(&conn);
    let own = matches!(lane, LaneUse::Own);
    let go = async {
        let payload = payload.map_err(|e| e.to_string())?;
        let (mut send, mut recv) = match lane {
            LaneUse::Kept(send, recv) => (send, recv),
            LaneUse::Opening | LaneUse::Own => {
                w.streams.fetch_add(1, Ordering::Relaxed);
                conn.open_bi().await.map_err(|e| e.to_string())?
            }
        };
        let n = write_payload(&mut send, payload)
            .await
            .map_err(|e| e.to_string())?;
        if own {
            send.finish().map_err(|e| e.to_string())?;
        }
        drop(sent.take());
        w.sent.fetch_add(n as u64, Ordering::Relaxed);
        // a result's outputs stay in the frame they came in, to be added from there
        let (m, n) = read_received(&mut recv, own)
            .await
            .map_err(|e| e.to_string())?;
        w.received.fetch_add(n as u64, Ordering::Relaxed);
        // (a worker ends a stream whose frame it could not read, after saying why)
        if !own && matches!(m, Received::Computed(_)) {
            w.keep_lane(&conn, send, recv);
        }
        Ok::<_, String>(m)
    };
    let seq = w.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if req.group > 0 {
        w.coded.fetch_add(1, Ordering::Relaxed);
    }
    let got = tokio::time::timeout(limit, go).await;
    if !own && !matches!(got, Ok(Ok(Received::Computed(_)))) {
        w.end_lane();
    }
    let a = match got {
        Err(_) => Answer::Broken(format!("no answer within {limit:?}")),
        Ok(Err(e)) => Answer::Broken(e),
        Ok(Ok(Received::Computed(r))) => match r.check(req) {
            Ok(()) => Answer::Done(r),
            Err(e) => Answer::Broken(format!("malformed result: {e}")),
        },
        Ok(Ok(Received::Other(Message::Failed { class, message, .. }))) => {
            Answer::Refused(format!("{class:?}: {message}"))
        }
        Ok(Ok(_)) => Answer::Broken("answered with something else".into()),
    };
    match &a {
        Answer::Done(r) => {
            w.answered(seq, req.layer, t.elapsed().as_nanos() as u64, r.compute_ns);
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
