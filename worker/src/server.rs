//! The expert worker's QUIC server and the framing both cluster sides use.
//!
//! Every connection is mutual TLS ([`crate::tls`]). Its first stream carries the handshake: the
//! coordinator's [`Hello`], then this worker's, or [`Message::Refused`] naming what differs
//! (protocol version, model). Every later stream carries one request and its answer, so requests
//! run concurrently and a malformed one costs only its own stream.
//!
//! A [`ComputeRequest`] is served with the worker's [`ExpertExecutor`] as one batch of one
//! expert per row and gate weight 1, which returns each row's unweighted expert output exactly
//! (`0 + 1 * y` is `y`, up to the sign of a zero, which the coordinator's sum cannot see).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use charm_shared::expert::{ErrorClass, ExpertBatch, ExpertError, ExpertExecutor};
use charm_shared::wire::{
    decode, encode, frame_len, ComputeRequest, ComputeResult, FailureClass, Hello, Limits, Message,
    WireError, LEN_BYTES, MAX_FRAME, PROTOCOL_VERSION,
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
/// message and the frame's size in bytes.
pub async fn read_frame(recv: &mut quinn::RecvStream) -> Result<(Message, usize), FrameError> {
    let mut prefix = [0u8; LEN_BYTES];
    recv.read_exact(&mut prefix).await?;
    let n = frame_len(prefix)?;
    let mut payload = vec![0u8; n];
    recv.read_exact(&mut payload).await?;
    Ok((decode(&payload)?, LEN_BYTES + n))
}

/// QUIC transport settings of cluster connections: keep-alives every `heartbeat`, a connection
/// given up after 4 heartbeats (at least 2 s) of silence, flow-control windows sized for a
/// prefill step's activations.
pub fn transport(heartbeat: Duration) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let idle = (heartbeat * 4).max(Duration::from_secs(2));
    t.keep_alive_interval(Some(heartbeat));
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).expect("idle timeout fits"),
    ));
    t.stream_receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32 / 2));
    t.receive_window(quinn::VarInt::from_u32(MAX_FRAME as u32));
    t.send_window(MAX_FRAME as u64);
    t
}

/// Writes one frame and finishes the stream's sending side.
pub async fn write_frame(send: &mut quinn::SendStream, m: &Message) -> Result<(), FrameError> {
    send.write_all(&encode(m)?).await?;
    send.finish()?;
    Ok(())
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
}

impl Service {
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
        let h = req.hidden as usize;
        let rows: usize = req.runs.iter().map(|r| r.rows.len()).sum();
        let mut x = Vec::with_capacity(rows * h);
        let mut ids = Vec::with_capacity(rows);
        for r in &req.runs {
            for &row in &r.rows {
                let row = row as usize;
                x.extend_from_slice(&req.x[row * h..(row + 1) * h]);
                ids.push(r.expert);
            }
        }
        let weights = vec![1.0f32; rows];
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
            Ok(y) => {
                let mut outputs = Vec::with_capacity(req.runs.len());
                let mut at = 0;
                for r in &req.runs {
                    let n = r.rows.len() * h;
                    outputs.push(y[at..at + n].to_vec());
                    at += n;
                }
                Message::Computed(ComputeResult {
                    id: req.id,
                    outputs,
                })
            }
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

/// Accepts connections on `endpoint` until it closes.
pub async fn serve(endpoint: quinn::Endpoint, svc: Arc<Service>) {
    while let Some(incoming) = endpoint.accept().await {
        let svc = svc.clone();
        tokio::spawn(async move {
            // a failed TLS handshake (no certificate from this cluster, plaintext) ends here
            if let Ok(conn) = incoming.await {
                connection(conn, svc).await;
            }
        });
    }
}

async fn connection(conn: quinn::Connection, svc: Arc<Service>) {
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let reply = match read_frame(&mut recv).await.map(|f| f.0) {
        Ok(Message::Hello(peer)) => match svc.refusal(&peer) {
            None => Message::Hello(svc.hello.clone()),
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
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let svc = svc.clone();
        tokio::spawn(async move {
            let reply = match read_frame(&mut recv).await.map(|f| f.0) {
                Ok(Message::Compute(req)) => {
                    let svc2 = svc.clone();
                    tokio::task::spawn_blocking(move || svc2.compute(&req))
                        .await
                        .unwrap_or_else(|e| Message::Failed {
                            id: 0,
                            class: FailureClass::Internal,
                            message: format!("compute task: {e}"),
                        })
                }
                Ok(Message::Ping { seq }) => Message::Pong { seq },
                Ok(_) => Message::Failed {
                    id: 0,
                    class: FailureClass::BadRequest,
                    message: "unexpected message".into(),
                },
                Err(e) => Message::Failed {
                    id: 0,
                    class: FailureClass::BadRequest,
                    message: e.to_string(),
                },
            };
            let _ = write_frame(&mut send, &reply).await;
        });
    }
}
