//! The expert worker's QUIC server: the accept loop, each connection's handshake and its
//! request streams.
//!
//! Every connection is mutual TLS ([`crate::tls`]). Its first stream carries the handshake: the
//! coordinator's [`Hello`](charm_shared::wire::Hello), then this worker's, or [`Message::Refused`] naming what differs
//! (protocol version, model). Every later stream carries requests, each answered on it in order
//! before the next is read, until the peer finishes the stream: a coordinator keeps one stream
//! open per worker for its compute requests (opening none per request, and so no stream credit
//! to send back) and opens more only for requests that overlap, heartbeats and fetches, which
//! then run concurrently. A malformed frame ends only its own stream.
//!
//! The rooms: `frame` reads and writes frames on QUIC streams (the framing both cluster sides
//! use); `answer` is what a request gets ([`Service`]); `fetch` fetches a worker's shard from its
//! coordinator; `warm` keeps the network thread polling between answers ([`Warm`]).

mod answer;
mod fetch;
mod frame;
mod warm;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use charm_shared::wire::{FailureClass, Message};

pub use answer::{failure_class, Service};
pub use frame::{
    read_frame, read_message, read_next, read_received, transport, write_frame, write_message,
    write_payload, FrameError,
};
pub use warm::{Warm, WORKER_SPIN_US};

use answer::reply;
use fetch::fetch_shard;

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

#[cfg(test)]
mod tests;
