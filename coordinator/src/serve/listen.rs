//! The accept loop: HTTP/1 connections with read deadlines and a cap on how many are open.
//!
//! A client has `read_timeout` to send a request's headers (an idle keep-alive connection too:
//! hyper's header timer runs while it waits for the next request) and as long again for its
//! body; past either the connection is closed (a body: 408 first). Past `max_connections` open
//! connections a new one is closed at once, so clients that trickle or stall cannot use up the
//! process's file descriptors.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::error::error;
use super::scheduler::Metrics;

/// Deadlines and caps of the accept loop.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Time to send a request's headers (from the connection's start or the previous response),
    /// and again to send its body.
    pub read_timeout: Duration,
    /// Connections open at once; more are closed as they come.
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            read_timeout: Duration::from_secs(30),
            max_connections: 512,
        }
    }
}

/// Serves `app` on `l` until the process ends.
pub(super) async fn accept_loop(
    l: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<Metrics>,
) -> Result<(), String> {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.read_timeout);
    loop {
        let sock = match l.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                // out of descriptors or a connection reset before it was taken: wait a moment
                // rather than spin, then go on
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics.connections_refused.fetch_add(1, Ordering::Relaxed);
            drop(sock);
            continue;
        };
        let _ = sock.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(sock), svc);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
}

/// Middleware: reads the whole request body within `timeout` and `limit` bytes before the
/// handler runs (408 or 413 otherwise, and the connection closes; a `Content-Length` above the
/// limit is a 413 before the body is read).
pub(super) async fn read_body(
    timeout: Duration,
    limit: usize,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let closing = |mut r: Response| {
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        r
    };
    let too_large = || {
        closing(
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the body is larger than {limit} bytes, or was cut off"),
            )
            .into_response(),
        )
    };
    // a body announced larger than the limit (hyper's reading of its `Content-Length`) is
    // refused at once, before any of it is read
    if HttpBody::size_hint(&body).lower() > limit as u64 {
        return too_large();
    }
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(_)) => too_large(),
        Err(_) => closing(
            error(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!("the body did not arrive within {} s", timeout.as_secs_f64()),
            )
            .into_response(),
        ),
    }
}
