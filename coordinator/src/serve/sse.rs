//! Server-sent events: a generation's events framed as a byte stream.

use axum::body::Bytes;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

/// A `text/event-stream` response: `prefix`, then `frame(event)` for each event (a
/// generation's [`super::scheduler::Event`]s, those of several choices, status documents) until
/// one says it is the last. Dropping the stream (the client went away) drops the receiver, which
/// stops whatever sends on it.
pub(super) fn sse<E: Send + 'static>(
    rx: mpsc::UnboundedReceiver<E>,
    prefix: String,
    frame: impl FnMut(E) -> (String, bool) + Send + 'static,
) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(events(rx, prefix, frame)),
    )
        .into_response()
}

fn events<E: Send + 'static>(
    mut rx: mpsc::UnboundedReceiver<E>,
    prefix: String,
    mut frame: impl FnMut(E) -> (String, bool) + Send + 'static,
) -> impl futures_core::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    let (tx, out) = mpsc::channel::<Result<Bytes, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        if !prefix.is_empty() && tx.send(Ok(Bytes::from(prefix))).await.is_err() {
            return;
        }
        while let Some(ev) = rx.recv().await {
            let (text, last) = frame(ev);
            // (nothing to say yet: no empty chunk on the wire)
            if !text.is_empty() && tx.send(Ok(Bytes::from(text))).await.is_err() || last {
                return;
            }
        }
    });
    ReceiverStream(out)
}

/// A tokio receiver as a stream.
struct ReceiverStream<T>(mpsc::Receiver<T>);

impl<T> futures_core::Stream for ReceiverStream<T> {
    type Item = T;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<T>> {
        self.0.poll_recv(cx)
    }
}
