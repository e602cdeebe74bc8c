//! The HTTP gateway: an OpenAI- and Anthropic-compatible server on the coordinator (`charm serve`).
//!
//! - `GET /health` (no key needed), `GET /v1/models`, `POST /v1/completions`,
//!   `POST /v1/chat/completions` (the model's chat template, see [`crate::decode::template`]),
//!   `POST /v1/messages` (Anthropic's API) and `POST /v1/messages/count_tokens`,
//!   `POST /tokenize` and `POST /detokenize` (llama-server's and vLLM's) and `GET /tokenizer_info`
//!   (vLLM's), streaming as server-sent events (OpenAI's with a final
//!   usage chunk, Anthropic's event sequence), `GET /metrics` (Prometheus text), `GET /v1/status`
//!   and `GET /v1/status/events` (the server's state as JSON, once and once a second: [`status`]),
//!   and at `GET /` a chat page and dashboard over them ([`page`]).
//! - A bearer key (compared in constant time) when one is configured; binding beyond loopback
//!   without one is refused. Bodies are limited in size; a prompt that does not fit the context
//!   is a 400 naming both numbers; fields charm does not support are a 400 naming them; errors
//!   come in OpenAI's error shape.
//! - Continuous batching ([`scheduler`]): up to `max_active` generations run together, one
//!   forward step serving them all, joining and leaving at every step; more wait in a bounded
//!   queue (full: 429 with `Retry-After`). A client that goes away cancels its generation.
//! - Finished sequences' KV is kept for requests that start with the same tokens: in RAM within a
//!   byte budget, and, with a KV directory, in a crash-safe log on disk ([`kvlog`]) that a
//!   restarted server reads back.
//!
//! # Layout
//! Handlers are thin: `openai` and `anthropic` translate their API's JSON into one internal
//! request (`request`: prompt ids, settings, how the answer is taken apart) and the scheduler's
//! events back into their shapes. `settings` checks the shared sampling fields, `auth` the key,
//! `error` shapes refusals, `metrics` renders `/metrics`, `sse` frames streams. The
//! [`scheduler`] has no HTTP in it.

mod anthropic;
mod auth;
mod error;
pub mod kvlog;
pub mod listen;
mod metrics;
mod openai;
mod page;
mod request;
pub mod scheduler;
mod settings;
mod sse;
mod status;
mod structured;
mod tokens;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value as Json};

use self::error::{error, ApiError};
pub use self::listen::ConnectionLimits;
use self::scheduler::{Metrics, Schedule, Scheduler};
use crate::decode::grammar::Grammars;
use crate::decode::speculative::DraftOptions;
use crate::decode::template::ChatTemplate;
use crate::decode::tokenizer::TextTokenizer;
use crate::model::engine::Engine;
use crate::serve::kvlog::KvLog;

/// How the gateway serves.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// The model's name in the API.
    pub model_name: String,
    /// Other names requests may give the model by (its directory's name).
    pub model_aliases: Vec<String>,
    /// Required bearer key, if any.
    pub api_key: Option<String>,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Requests waiting beyond the running one before new ones get 429.
    pub queue: usize,
    /// Tokens of context a request may use (prompt plus completion).
    pub context: usize,
    /// Generations running at once (batched: one forward step serves them all).
    pub max_active: usize,
    /// Tokens one forward step takes at most (decode tokens, then prompt chunks).
    pub batch_tokens: usize,
    /// Bytes of finished sequences' KV kept for requests that start with the same tokens.
    pub prefix_cache_bytes: usize,
    /// Tokens that end a generation (the model's end-of-sequence ids and those of its
    /// `generation_config.json`; see [`stop_token_ids`]); empty: the model config's.
    pub stop_ids: Vec<u32>,
    /// Conversation KV persisted on disk, if wanted.
    pub kv_log: Option<KvLogOptions>,
    /// Speculative decoding of every generation (`max == 0`: off).
    pub draft: DraftOptions,
    /// Tokens a grammar forces are verified as drafts (structured output).
    pub forced_drafts: bool,
    /// Read deadlines and the cap on open connections.
    pub connections: ConnectionLimits,
    /// The model's tokenizer configuration, answered by `GET /tokenizer_info` as vLLM answers
    /// it (so clients such as lm-evaluation-harness need no local tokenizer); see
    /// [`tokenizer_config`]. `Null`: only what the server knows (the end-of-sequence token).
    pub tokenizer_config: Json,
}

/// Where and how much conversation KV is persisted.
#[derive(Debug, Clone)]
pub struct KvLogOptions {
    pub dir: std::path::PathBuf,
    /// Bytes the log may hold before it is compacted to the most recent sequences.
    pub budget: u64,
    /// What the KV was computed by (model files and activation mode): a log of anything else is
    /// refused.
    pub fingerprint: String,
}

/// The ids that end a generation for the model in `dir`: `config.json`'s end-of-sequence ids
/// and `generation_config.json`'s `eos_token_id` (a number or a list), where it has one.
pub fn stop_token_ids(dir: &std::path::Path, spec: &charm_shared::config::ModelSpec) -> Vec<u32> {
    let mut ids = spec.eos_token_ids.clone();
    let g = std::fs::read_to_string(dir.join("generation_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Json>(&t).ok());
    if let Some(g) = g {
        let more: Vec<u32> = match &g["eos_token_id"] {
            Json::Number(n) => n.as_u64().into_iter().map(|x| x as u32).collect(),
            Json::Array(a) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => vec![],
        };
        for t in more {
            if !ids.contains(&t) {
                ids.push(t);
            }
        }
    }
    ids
}

impl GatewayOptions {
    /// Whether `name` names the served model.
    pub fn serves(&self, name: &str) -> bool {
        name == self.model_name || self.model_aliases.iter().any(|a| a == name)
    }
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            model_name: "charm".into(),
            model_aliases: vec![],
            api_key: None,
            max_body_bytes: 4 << 20,
            queue: 256,
            context: 4096,
            max_active: 4,
            batch_tokens: 512,
            prefix_cache_bytes: 256 << 20,
            stop_ids: vec![],
            kv_log: None,
            draft: DraftOptions::default(),
            forced_drafts: true,
            connections: ConnectionLimits::default(),
            tokenizer_config: Json::Null,
        }
    }
}

/// The tokenizer configuration of the model in `dir` as `GET /tokenizer_info` gives it:
/// `tokenizer_config.json` (as transformers' `init_kwargs` hold it: added tokens written as
/// their text), with the chat template the server renders (`chat_template.jinja` where there is
/// one). `Null` when there is neither.
pub fn tokenizer_config(dir: &std::path::Path) -> Json {
    let mut c = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Json>(&t).ok())
        .filter(Json::is_object)
        .unwrap_or(Json::Null);
    if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        if c.is_null() {
            c = json!({});
        }
        c["chat_template"] = json!(t);
    }
    if let Some(o) = c.as_object_mut() {
        for v in o.values_mut() {
            // `{"content": "<s>", "__type": "AddedToken", ...}`: its text
            if let Some(t) = v.get("content").and_then(Json::as_str) {
                *v = json!(t);
            }
        }
    }
    c
}

/// What every handler shares.
struct Shared {
    opts: GatewayOptions,
    scheduler: Scheduler,
    tok: Arc<TextTokenizer>,
    template: Option<ChatTemplate>,
    remote: Option<Arc<crate::cluster::remote::RemoteExperts>>,
    /// The grammar machinery, built on the first constrained request.
    grammars: std::sync::OnceLock<Result<Arc<Grammars>, String>>,
    /// Rows of the model's logits, and the tokens that end a generation.
    vocab: usize,
    stop_ids: Vec<u32>,
    started: u64,
    next_id: AtomicU64,
    /// What `/v1/status` reads beyond the scheduler's counters.
    status: status::Sources,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Serves `engine` on `listen` until the process ends. Refuses a non-loopback address without
/// an API key.
pub async fn serve(
    engine: Engine,
    tok: TextTokenizer,
    template: Option<ChatTemplate>,
    listen: SocketAddr,
    opts: GatewayOptions,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    if !listen.ip().is_loopback() && opts.api_key.is_none() {
        return Err(format!(
            "{listen} is reachable from other machines: give an API key (--api-key-file) or listen on loopback"
        ));
    }
    let max_active = opts.max_active.max(1);
    let batch_tokens = opts.batch_tokens.max(1);
    let prefix_bytes = opts.prefix_cache_bytes;
    let stop_ids = if opts.stop_ids.is_empty() {
        engine.model.spec.eos_token_ids.clone()
    } else {
        opts.stop_ids.clone()
    };
    let metrics = Arc::new(Metrics::default());
    let kv_log = match &opts.kv_log {
        Some(o) => {
            let (log, found) = KvLog::open(&o.dir, &engine.model.spec, &o.fingerprint, o.budget)?;
            tracing::info!(
                dir = %o.dir.display(),
                sequences = found.records,
                bytes = log.bytes(),
                cut_bytes = found.cut_bytes,
                "conversation KV log opened"
            );
            if found.cut_bytes > 0 {
                tracing::warn!(
                    cut_bytes = found.cut_bytes,
                    "the KV log ended in a torn or damaged record (a crash mid-write): cut it off"
                );
            }
            metrics.kv_log_bytes.store(log.bytes(), Ordering::Relaxed);
            Some(log)
        }
        None => None,
    };
    let tok = Arc::new(tok);
    let remote = engine.remote.clone();
    let sources = status::Sources::new(&engine);
    let vocab = engine.model.spec.vocab_size;
    let schedule = Schedule {
        max_active,
        batch_tokens,
        prefix_bytes,
        stop_ids: stop_ids.clone(),
        draft: opts.draft,
        forced_drafts: opts.forced_drafts,
    };
    let scheduler = Scheduler::start(
        engine,
        tok.clone(),
        schedule,
        opts.queue,
        kv_log,
        metrics.clone(),
    )?;
    let max_body = opts.max_body_bytes;
    let limits = opts.connections;
    let s = Arc::new(Shared {
        opts,
        scheduler,
        tok,
        template,
        remote,
        grammars: std::sync::OnceLock::new(),
        vocab,
        stop_ids,
        started: now(),
        next_id: AtomicU64::new(1),
        status: sources,
    });
    tokio::spawn(status::sample_every_second(Arc::downgrade(&s)));
    let app = Router::new()
        .route("/", get(page::index))
        .route("/page/{asset}", get(page::file))
        .route("/v1/status", get(status::status))
        .route("/v1/status/events", get(status::events))
        .route("/health", get(health))
        .route("/metrics", get(metrics::prometheus))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/tokenizer_info", get(tokens::tokenizer_info))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found_error", "no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn(move |req, next| {
            listen::read_body(limits.read_timeout, max_body, req, next)
        }))
        .with_state(s);
    let l = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("--listen {listen}: {e}"))?;
    ready(l.local_addr().map_err(|e| e.to_string())?);
    listen::accept_loop(l, app, limits, metrics).await
}

async fn health(State(s): State<Arc<Shared>>, h: HeaderMap) -> Response {
    // without the key (when there is one) only that the server is up: nothing of the model or
    // the cluster reaches a client that has not authenticated
    if auth::authorized(&s, &h).is_err() {
        return axum::Json(json!({"status": "ok", "ready": true})).into_response();
    }
    let workers = s.remote.as_ref().map(|r| {
        let st = r.status();
        json!({
            "connected": st.iter().filter(|w| w.connected).count(),
            "configured": st.len(),
        })
    });
    axum::Json(json!({
        "status": "ok",
        "model": s.opts.model_name,
        "ready": true,
        "workers": workers,
    }))
    .into_response()
}

/// OpenAI's model object of the served model.
fn model_object(s: &Shared) -> Json {
    json!({"id": s.opts.model_name, "object": "model", "created": s.started, "owned_by": "charm"})
}

async fn models(State(s): State<Arc<Shared>>, h: HeaderMap) -> Result<Response, ApiError> {
    auth::authorized(&s, &h)?;
    Ok(axum::Json(json!({"object": "list", "data": [model_object(&s)]})).into_response())
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): the model object of the served model
/// (by its name or an alias; an id may hold `/`), else a 404 as OpenAI answers it.
async fn model(
    State(s): State<Arc<Shared>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    auth::authorized(&s, &h)?;
    if !s.opts.serves(&id) {
        return Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model `{id}` does not exist: this server serves `{}`",
                s.opts.model_name
            ),
        )
        .code("model_not_found"));
    }
    Ok(axum::Json(model_object(&s)).into_response())
}
