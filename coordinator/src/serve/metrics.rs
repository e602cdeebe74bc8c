//! `GET /metrics`: the scheduler's counters and the workers' round trips as Prometheus text.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};

use super::auth::authorized;
use super::error::ApiError;
use super::Shared;

pub(super) async fn prometheus(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let m = s.scheduler.metrics();
    let l = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let mut t = String::new();
    let mut put = |name: &str, kind: &str, help: &str, v: String| {
        t += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n");
    };
    let secs = |x: &AtomicU64| format!("{:.6}", l(x) as f64 / 1e6);
    let hits = l(&m.expert_hits) as f64;
    let uses = hits + l(&m.expert_misses) as f64;
    let rows: [(&str, &str, &str, String); 23] = [
        (
            "charm_draft_tokens_total",
            "counter",
            "Tokens drafted by speculative decoding.",
            l(&m.drafted).to_string(),
        ),
        (
            "charm_draft_accepted_tokens_total",
            "counter",
            "Drafted tokens the model accepted.",
            l(&m.accepted).to_string(),
        ),
        (
            "charm_prefix_tokens_reused_total",
            "counter",
            "Prompt tokens whose KV came from the prefix cache.",
            l(&m.reused).to_string(),
        ),
        (
            "charm_grammar_masks_total",
            "counter",
            "Grammar masks computed (structured output), one per constrained token position.",
            l(&m.masks).to_string(),
        ),
        (
            "charm_grammar_mask_seconds_total",
            "counter",
            "Seconds spent computing grammar masks.",
            secs(&m.mask_us),
        ),
        (
            "charm_forced_tokens_total",
            "counter",
            "Tokens a grammar forced, fed as drafts.",
            l(&m.forced).to_string(),
        ),
        (
            "charm_forced_accepted_tokens_total",
            "counter",
            "Forced tokens the model accepted.",
            l(&m.forced_accepted).to_string(),
        ),
        (
            "charm_connections_refused_total",
            "counter",
            "Connections closed on arrival: the cap on open connections was reached.",
            l(&m.connections_refused).to_string(),
        ),
        (
            "charm_kv_log_bytes",
            "gauge",
            "Bytes of conversation KV persisted on disk.",
            l(&m.kv_log_bytes).to_string(),
        ),
        (
            "charm_requests_total",
            "counter",
            "Generation requests accepted.",
            l(&m.requests).to_string(),
        ),
        (
            "charm_requests_cancelled_total",
            "counter",
            "Generations stopped because their client went away (closed the connection).",
            l(&m.cancelled).to_string(),
        ),
        (
            "charm_requests_rejected_total",
            "counter",
            "Requests refused with 429 (queue full).",
            l(&m.rejected).to_string(),
        ),
        (
            "charm_generated_tokens_total",
            "counter",
            "Tokens generated.",
            l(&m.tokens).to_string(),
        ),
        (
            "charm_queue_depth",
            "gauge",
            "Requests waiting.",
            l(&m.queued).to_string(),
        ),
        (
            "charm_batch_size",
            "gauge",
            "Sequences in the last forward step.",
            l(&m.active).to_string(),
        ),
        (
            "charm_batch_size_peak",
            "gauge",
            "The most sequences in one forward step so far.",
            l(&m.active_peak).to_string(),
        ),
        (
            "charm_batch_tokens",
            "gauge",
            "Tokens (rows) of the last forward step.",
            l(&m.batch_rows).to_string(),
        ),
        (
            "charm_forward_steps_total",
            "counter",
            "Forward steps run.",
            l(&m.steps).to_string(),
        ),
        (
            "charm_forward_tokens_total",
            "counter",
            "Tokens (rows) the forward steps took, prompt chunks included.",
            l(&m.rows).to_string(),
        ),
        (
            "charm_expert_hit_rate",
            "gauge",
            "Routed-expert uses served from memory without waiting, since start (1 when none ran).",
            format!("{:.6}", hit_rate(hits, uses)),
        ),
        (
            "charm_time_to_first_token_seconds_sum",
            "counter",
            "Time from arrival to the first token, summed.",
            secs(&m.ttft_us),
        ),
        (
            "charm_time_to_first_token_seconds_count",
            "counter",
            "Requests with a first token.",
            l(&m.ttft_n).to_string(),
        ),
        (
            "charm_decode_seconds_total",
            "counter",
            "Seconds spent decoding after the first token.",
            secs(&m.decode_us),
        ),
    ];
    for (name, kind, help, v) in rows {
        put(name, kind, help, v);
    }
    if let Some(r) = &s.remote {
        for w in r.status() {
            t += &format!(
                "charm_worker_round_trip_ms{{worker=\"{}\"}} {:.3}\ncharm_worker_up{{worker=\"{}\"}} {}\n",
                w.name,
                w.mean_rtt_ms,
                w.name,
                u8::from(w.connected)
            );
        }
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], t).into_response())
}

/// Share of routed-expert uses served from memory; 1 when none ran (nothing waited).
pub(super) fn hit_rate(hits: f64, uses: f64) -> f64 {
    if uses > 0.0 {
        hits / uses
    } else {
        1.0
    }
}
