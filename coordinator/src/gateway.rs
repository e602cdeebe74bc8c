//! The HTTP gateway: an OpenAI-compatible server on the coordinator (`charm serve`).
//!
//! - `GET /health` (no key needed), `GET /v1/models`, `POST /v1/completions`,
//!   `POST /v1/chat/completions` (the model's chat template, see [`crate::chat`]),
//!   `POST /v1/messages` (Anthropic's API), streaming as server-sent events (OpenAI's with a final
//!   usage chunk, Anthropic's event sequence), `GET /metrics` (Prometheus text).
//! - A bearer key (compared in constant time) when one is configured; binding beyond loopback
//!   without one is refused. Bodies are limited in size; a prompt that does not fit the context
//!   is a 400 naming both numbers; fields charm does not support are a 400 naming them; errors
//!   come in OpenAI's error shape.
//! - Continuous batching: up to `max_active` generations run together, one forward step serving
//!   them all (decode tokens and prompt chunks, each layer's routed experts run once for the
//!   batch), joining and leaving at every step; more wait in a bounded queue (full: 429 with
//!   `Retry-After`). A client that goes away cancels its generation and frees its KV cache.
//! - Finished sequences' KV is kept for requests that start with the same tokens: in RAM within a
//!   byte budget, and, with a KV directory, in a crash-safe log on disk ([`crate::kvlog`]) that a
//!   restarted server reads back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value as Json};
use tokio::sync::mpsc;

use crate::cache::KvCache;
use crate::chat::{drop_null_keys, tool_arguments, ChatInput, ChatTemplate};
use crate::engine::Engine;
use crate::forward::ForwardOptions;
use crate::kvlog::KvLog;
use crate::sampling::{logprobs, Penalties, Sampler, SamplingParams};
use crate::tokenizer::{TextStream, TextTokenizer};

/// How the gateway serves.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// The model's name in the API.
    pub model_name: String,
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

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            model_name: "charm".into(),
            api_key: None,
            max_body_bytes: 4 << 20,
            queue: 16,
            context: 4096,
            max_active: 4,
            batch_tokens: 512,
            prefix_cache_bytes: 256 << 20,
            stop_ids: vec![],
            kv_log: None,
        }
    }
}

/// A generated token, its log probability, and the most likely alternatives with theirs.
type TokenLogprob = (u32, f32, Vec<(u32, f32)>);

/// What a generation sends back as it runs.
#[derive(Debug)]
enum Event {
    Text(String),
    /// The log probabilities of the tokens behind the next `Text` (streams that asked for them).
    Logprobs(Vec<TokenLogprob>),
    Done {
        finish: &'static str,
        /// The stop string that ended it, if one did.
        matched: Option<String>,
        /// Per generated token, when asked: the token, its log probability and the most likely
        /// alternatives with theirs (of the model's distribution, before penalties and
        /// temperature).
        logprobs: Vec<TokenLogprob>,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// One queued generation.
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    params: SamplingParams,
    penalties: Penalties,
    /// Log probabilities to report: of the chosen token and this many alternatives.
    logprobs: Option<usize>,
    stop: Vec<String>,
    /// Go on past the end-of-sequence tokens.
    ignore_eos: bool,
    tx: mpsc::UnboundedSender<Event>,
    queued: Instant,
}

#[derive(Debug, Default)]
struct Metrics {
    requests: AtomicU64,
    rejected: AtomicU64,
    tokens: AtomicU64,
    queued: AtomicU64,
    /// Sequences in the last forward step, and the most there were in one.
    active: AtomicU64,
    active_peak: AtomicU64,
    /// Rows (tokens) of the last forward step; steps run and rows they took, in all.
    batch_rows: AtomicU64,
    steps: AtomicU64,
    rows: AtomicU64,
    /// Bytes of the conversation KV log on disk.
    kv_log_bytes: AtomicU64,
    /// The expert executor's counters: uses served from memory, and those that waited.
    expert_hits: AtomicU64,
    expert_misses: AtomicU64,
    ttft_us: AtomicU64,
    ttft_n: AtomicU64,
    /// Prompt tokens whose KV came from the prefix cache instead of a prefill.
    reused: AtomicU64,
    decode_us: AtomicU64,
}

struct Shared {
    opts: GatewayOptions,
    jobs: std::sync::mpsc::SyncSender<Job>,
    tok: Arc<TextTokenizer>,
    template: Option<ChatTemplate>,
    metrics: Arc<Metrics>,
    remote: Option<Arc<crate::remote::RemoteExperts>>,
    started: u64,
    next_id: AtomicU64,
}

/// An error answered in OpenAI's shape.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    /// In Anthropic's shape instead.
    anthropic: bool,
}

impl ApiError {
    fn anthropic(mut self) -> Self {
        self.anthropic = true;
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        tracing::info!(status = self.status.as_u16(), kind = self.kind, message = %self.message, "request refused");
        let body = if self.anthropic {
            let kind = if self.kind == "server_error" {
                "api_error"
            } else {
                self.kind
            };
            json!({"type": "error", "error": {"type": kind, "message": self.message}})
        } else {
            json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}})
        };
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        r
    }
}

fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status,
        kind,
        message: message.into(),
        anthropic: false,
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Constant-time comparison of a presented key with the configured one.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

fn authorized(s: &Shared, h: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.opts.api_key else {
        return Ok(());
    };
    // `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`
    let given = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
        .unwrap_or("");
    if same_key(given.as_bytes(), key.as_bytes()) {
        Ok(())
    } else {
        Err(error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key (Authorization: Bearer KEY)",
        ))
    }
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
    let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(opts.queue);
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
    {
        let (tok, metrics) = (tok.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("charm-generate".into())
            .spawn(move || {
                let lim = Schedule {
                    max_active,
                    batch_tokens,
                    prefix_bytes,
                    stop_ids,
                };
                let store = kv_log.map(|log| KvStore::start(log, metrics.clone()));
                rayon::scope(|_| run_jobs(&engine, &tok, rx, &metrics, &lim, store))
            })
            .map_err(|e| e.to_string())?;
    }
    let max_body = opts.max_body_bytes;
    let s = Arc::new(Shared {
        opts,
        jobs,
        tok,
        template,
        metrics,
        remote,
        started: now(),
        next_id: AtomicU64::new(1),
    });
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found_error", "no such route") })
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .with_state(s);
    let l = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("--listen {listen}: {e}"))?;
    ready(l.local_addr().map_err(|e| e.to_string())?);
    axum::serve(l, app).await.map_err(|e| e.to_string())
}

/// Runs queued generations with continuous batching: every step admits what waits (while
/// there is room), drops the sequences whose client went away (their KV goes with them), then
/// runs one forward step for all the others together: each decoding sequence's next token and,
/// within the step's token budget, chunks of the prompts still prefilling. Each sequence keeps its
/// own KV cache and sampler; the kernels compute a row the same way whatever else is batched
/// with it, so a sequence's tokens are the ones it gets running alone.
fn run_jobs(
    e: &Engine,
    tok: &TextTokenizer,
    rx: std::sync::mpsc::Receiver<Job>,
    metrics: &Metrics,
    lim: &Schedule,
    store: Option<KvStore>,
) {
    let max_active = lim.max_active;
    let mut active: Vec<Sequence> = Vec::new();
    let mut prefixes = PrefixCache::new(lim.prefix_bytes);
    loop {
        // admit: block only when nothing runs
        while active.len() < max_active {
            let job = if active.is_empty() {
                match rx.recv() {
                    Ok(j) => j,
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(_) => break,
                }
            };
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
            if let Some(st) = &store {
                // sequences the writer has made durable: their RAM entries now name their
                // records, so a conversation's next turn is logged as an extension of them
                while let Ok((tokens, seq)) = st.done.try_recv() {
                    prefixes.logged(&tokens, seq);
                }
            }
            let mut seq = Sequence::new(e, tok, job);
            if let Some((c, origin)) = prefixes.take(&seq.job.prompt, store.as_ref()) {
                metrics.reused.fetch_add(c.len() as u64, Ordering::Relaxed);
                seq.reused = c.len();
                seq.cache = c;
                seq.origin = origin;
            }
            active.push(seq);
        }
        active.retain(|s| {
            let gone = s.job.tx.is_closed();
            if gone {
                tracing::info!(
                    completion_tokens = s.ids.len(),
                    "client went away: generation cancelled"
                );
            }
            !gone
        });
        if active.is_empty() {
            continue;
        }
        let take = step_rows(&active, lim.batch_tokens);
        let done = batched_step(e, tok, &lim.stop_ids, &mut active, &take, metrics);
        let mut i = 0;
        active.retain_mut(|seq| {
            let r = &done[i];
            i += 1;
            match r {
                Ok(true) => true,
                Ok(false) => {
                    if seq.finished {
                        // what the cache holds: the prompt, then the tokens fed back
                        let mut tokens = seq.job.prompt.clone();
                        tokens.extend_from_slice(&seq.ids);
                        tokens.truncate(seq.cache.len());
                        if let Some(st) = store.as_ref().filter(|_| tokens.len() >= MIN_PREFIX) {
                            st.write(seq.origin, tokens.clone(), seq.cache.clone());
                        }
                        prefixes.put(
                            tokens,
                            std::mem::replace(&mut seq.cache, KvCache::new(&e.model.spec)),
                            None,
                        );
                    }
                    false
                }
                Err(m) => {
                    let _ = seq.job.tx.send(Event::Failed(m.clone()));
                    false
                }
            }
        });
        if let Some(st) = e.stats() {
            metrics.expert_hits.store(st.hits, Ordering::Relaxed);
            metrics.expert_misses.store(st.misses, Ordering::Relaxed);
        }
    }
}

/// How many tokens each sequence feeds this step: one for each decoding sequence, then, in
/// arrival order, as much of each unfinished prompt as the step's budget of `batch_tokens`
/// rows leaves (a long prompt is prefilled in chunks, between other sequences' tokens).
fn step_rows(active: &[Sequence], batch_tokens: usize) -> Vec<usize> {
    let mut budget = batch_tokens.max(1);
    let mut take = vec![0; active.len()];
    for (t, s) in take.iter_mut().zip(active) {
        if s.next.is_some() {
            *t = 1;
            budget = budget.saturating_sub(1);
        }
    }
    for (t, s) in take.iter_mut().zip(active) {
        if s.next.is_none() {
            *t = (s.job.prompt.len() - s.cache.len()).min(budget);
            budget -= *t;
        }
    }
    take
}

/// One forward step of every sequence with rows this step (`take`), then the head on the rows
/// that end a sequence's input and each of those sequences' next token. Per sequence: whether it
/// goes on (see [`Sequence::advance`]). A failed step fails the sequences that were in it (their
/// caches may hold part of it).
fn batched_step(
    e: &Engine,
    tok: &TextTokenizer,
    stop_ids: &[u32],
    active: &mut [Sequence],
    take: &[usize],
    metrics: &Metrics,
) -> Vec<Result<bool, String>> {
    let m = &e.model;
    let h = m.spec.hidden_size;
    let mut steps = Vec::new();
    for (s, &k) in active.iter_mut().zip(take) {
        if k == 0 {
            continue;
        }
        let tokens: &[u32] = match &s.next {
            Some(t) => std::slice::from_ref(t),
            None => &s.job.prompt[s.cache.len()..s.cache.len() + k],
        };
        steps.push(crate::forward::Step {
            tokens,
            cache: &mut s.cache,
        });
    }
    let rows: usize = take.iter().sum();
    metrics.active.store(steps.len() as u64, Ordering::Relaxed);
    metrics
        .active_peak
        .fetch_max(steps.len() as u64, Ordering::Relaxed);
    metrics.batch_rows.store(rows as u64, Ordering::Relaxed);
    metrics.steps.fetch_add(1, Ordering::Relaxed);
    metrics.rows.fetch_add(rows as u64, Ordering::Relaxed);
    let normed = m.forward_batch(&mut steps, ForwardOptions::default(), None);
    drop(steps);
    // a failure fails every sequence that was in the step; the others go on
    let failed = |err: crate::forward::ForwardError| -> Vec<Result<bool, String>> {
        let msg = err.to_string();
        tracing::warn!(error = %msg, sequences = take.iter().filter(|&&k| k > 0).count(), "forward step failed");
        take.iter()
            .map(|&k| if k > 0 { Err(msg.clone()) } else { Ok(true) })
            .collect()
    };
    let normed = match normed {
        Ok(x) => x,
        Err(err) => return failed(err),
    };
    // the last row of each sequence whose input is all in: its next token comes from it
    let (mut last, mut at) = (Vec::new(), 0);
    let mut wants = vec![false; active.len()];
    for (i, (s, &k)) in active.iter().zip(take).enumerate() {
        at += k;
        if k > 0 && s.cache.len() >= s.job.prompt.len() {
            last.extend_from_slice(&normed[(at - 1) * h..at * h]);
            wants[i] = true;
        }
    }
    let n_last = last.len() / h;
    let logits = match m.logits(&last, n_last) {
        Ok(l) => l,
        Err(err) => return failed(err),
    };
    let v = m.spec.vocab_size;
    let mut rows_of = logits.chunks_exact(v);
    active
        .iter_mut()
        .zip(wants)
        .map(|(s, want)| match want {
            true => {
                let l = rows_of
                    .next()
                    .expect("one logits row per sequence")
                    .to_vec();
                s.advance(l, tok, metrics, stop_ids)
            }
            false => Ok(!s.job.tx.is_closed()),
        })
        .collect()
}
/// How the generator thread runs sequences.
struct Schedule {
    max_active: usize,
    /// Rows (tokens) one forward step takes at most: every decoding sequence's next token, then
    /// prompt chunks.
    batch_tokens: usize,
    prefix_bytes: usize,
    stop_ids: Vec<u32>,
}

/// One generation in progress.
struct Sequence<'t> {
    job: Job,
    cache: KvCache,
    sampler: Sampler,
    /// The token chosen and not yet fed back (none before the prefill).
    next: Option<u32>,
    ids: Vec<u32>,
    /// The completion decoded as its tokens come, and how many of its bytes were sent.
    stream: TextStream<'t>,
    text: String,
    sent: usize,
    lps: Vec<TokenLogprob>,
    started: Option<Instant>,
    /// Ended normally (not cancelled): its KV may serve a later request's prefix.
    finished: bool,
    /// Entries of `lps` already sent with a piece of text.
    lp_sent: usize,
    /// The persisted sequence its cache started from, and how many of its tokens.
    origin: Option<(u64, usize)>,
    /// Prompt tokens whose KV was reused instead of computed.
    reused: usize,
}

impl<'t> Sequence<'t> {
    fn new(e: &Engine, tok: &'t TextTokenizer, job: Job) -> Self {
        let spec = &e.model.spec;
        let mut cache = KvCache::new(spec);
        cache.reserve(job.prompt.len() + job.max_tokens, spec);
        Self {
            sampler: Sampler::new(job.params),
            job,
            cache,
            next: None,
            ids: Vec::new(),
            stream: tok.stream(),
            text: String::new(),
            sent: 0,
            lps: Vec::new(),
            started: None,
            finished: false,
            lp_sent: 0,
            origin: None,
            reused: 0,
        }
    }

    /// Penalties, then the sampler; the log probabilities of the model's distribution when
    /// asked.
    fn pick(&mut self, mut logits: Vec<f32>) -> u32 {
        let raw = self.job.logprobs.map(|_| logits.clone());
        self.job
            .penalties
            .apply(&mut logits, &self.job.prompt, &self.ids);
        let t = self.sampler.sample(&logits);
        if let (Some(top), Some(raw)) = (self.job.logprobs, raw) {
            let (lp, alt) = logprobs(&raw, t, top);
            self.lps.push((t, lp, alt));
        }
        t
    }

    /// Takes the logits after the sequence's last input (its whole prompt, or the token it fed
    /// back): picks the next token and sends text as it becomes final (whole UTF-8 characters,
    /// held back while it could still start a stop string). `Ok(false)` when the sequence is
    /// done or its client went away (its KV cache goes with it).
    fn advance(
        &mut self,
        logits: Vec<f32>,
        tok: &TextTokenizer,
        metrics: &Metrics,
        stop_ids: &[u32],
    ) -> Result<bool, String> {
        if self.next.is_none() {
            metrics.ttft_us.fetch_add(
                self.job.queued.elapsed().as_micros() as u64,
                Ordering::Relaxed,
            );
            metrics.ttft_n.fetch_add(1, Ordering::Relaxed);
            self.started = Some(Instant::now());
        }
        let next = self.pick(logits);
        self.next = Some(next);
        if !self.job.ignore_eos && stop_ids.contains(&next) {
            return self.finish(tok, "stop", None, metrics);
        }
        self.ids.push(next);
        metrics.tokens.fetch_add(1, Ordering::Relaxed);
        let hold = self.job.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        // only whole characters arrive from the stream decoder
        let piece = self.stream.push(next).map_err(|e| e.to_string())?;
        self.text.push_str(&piece);
        let found = find_stop(&self.text, self.sent.saturating_sub(hold), &self.job.stop);
        if let Some((at, which)) = found {
            if at > self.sent {
                let piece = self.text[self.sent..at].to_string();
                self.send_text(piece);
            }
            self.sent = self.text.len();
            let matched = Some(self.job.stop[which].clone());
            return self.finish(tok, "stop", matched, metrics);
        }
        let mut end = self.text.len().saturating_sub(hold.saturating_sub(1));
        while end > self.sent && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end > self.sent {
            let piece = self.text[self.sent..end].to_string();
            if !self.send_text(piece) {
                return Ok(false);
            }
            self.sent = end;
        } else if self.job.tx.is_closed() {
            return Ok(false);
        }
        if self.ids.len() >= self.job.max_tokens {
            return self.finish(tok, "length", None, metrics);
        }
        Ok(true)
    }

    /// Sends a piece of text, after the log probabilities of the tokens not yet covered when
    /// the request asked for them; false when the client went away.
    fn send_text(&mut self, piece: String) -> bool {
        if self.job.logprobs.is_some() && self.lp_sent < self.lps.len() {
            let new = self.lps[self.lp_sent..].to_vec();
            self.lp_sent = self.lps.len();
            let _ = self.job.tx.send(Event::Logprobs(new));
        }
        self.job.tx.send(Event::Text(piece)).is_ok()
    }

    /// Sends the rest of the text and the end of the generation.
    fn finish(
        &mut self,
        tok: &TextTokenizer,
        finish: &'static str,
        matched: Option<String>,
        metrics: &Metrics,
    ) -> Result<bool, String> {
        if let Some(t) = self.started {
            let secs = t.elapsed().as_secs_f64();
            metrics
                .decode_us
                .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
            tracing::info!(
                prompt_tokens = self.job.prompt.len(),
                reused_tokens = self.reused,
                completion_tokens = self.ids.len(),
                finish,
                ttft_ms = (t - self.job.queued).as_secs_f64() * 1e3,
                decode_tok_s = self.ids.len().saturating_sub(1) as f64 / secs.max(1e-9),
                "generation done"
            );
        }
        if matched.is_none() {
            let text = tok.decode(&self.ids).map_err(|e| e.to_string())?;
            // (a token ended by the end-of-sequence id is not part of the completion)
            self.lps.truncate(self.ids.len());
            if text.len() > self.sent {
                self.send_text(text[self.sent..].to_string());
            }
        }
        self.lps.truncate(self.ids.len());
        let _ = self.job.tx.send(Event::Done {
            finish,
            matched,
            logprobs: std::mem::take(&mut self.lps),
            prompt_tokens: self.job.prompt.len(),
            completion_tokens: self.ids.len(),
        });
        self.finished = true;
        Ok(false)
    }
}

/// Splits a chat answer into its reasoning and its content: text before `</think>` is
/// reasoning when the turn opened thinking (or the answer opens it with `<think>`), the rest is
/// content (one newline after the closing tag dropped). Tags split across pieces are held
/// until they are whole.
#[derive(Debug)]
struct Reasoning {
    /// Inside the reasoning part.
    inside: bool,
    /// Nothing has been emitted yet (the answer may still open with `<think>`).
    fresh: bool,
    /// Text held back: it may be the start of a tag.
    held: String,
    /// A newline right after `</think>` is still to be dropped.
    after_close: bool,
}

impl Reasoning {
    const OPEN: &'static str = "<think>";
    const CLOSE: &'static str = "</think>";

    fn new(thinking: bool) -> Self {
        Self {
            inside: thinking,
            fresh: true,
            held: String::new(),
            after_close: false,
        }
    }

    /// (reasoning, content) of the next piece of text.
    fn push(&mut self, text: &str) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        self.held.push_str(text);
        loop {
            if self.fresh && !self.inside {
                let t = self.held.trim_start();
                if t.starts_with(Self::OPEN) {
                    let at = self.held.find(Self::OPEN).unwrap_or(0) + Self::OPEN.len();
                    self.held.drain(..at);
                    self.inside = true;
                } else if Self::OPEN.starts_with(t) && !t.is_empty() {
                    return (r, c); // maybe the opening tag: wait
                }
            }
            if self.inside {
                if let Some(i) = self.held.find(Self::CLOSE) {
                    r.push_str(&self.held[..i]);
                    self.held.drain(..i + Self::CLOSE.len());
                    self.inside = false;
                    self.after_close = true;
                    self.fresh = false;
                    continue;
                }
            }
            if self.after_close && !self.held.is_empty() {
                if self.held.starts_with('\n') {
                    self.held.remove(0);
                }
                self.after_close = false;
            }
            // keep back what could begin the closing tag
            let keep = if self.inside {
                (1..Self::CLOSE.len())
                    .rev()
                    .find(|&k| self.held.ends_with(&Self::CLOSE[..k]))
                    .unwrap_or(0)
            } else {
                0
            };
            let mut cut = self.held.len() - keep;
            while !self.held.is_char_boundary(cut) {
                cut -= 1;
            }
            let out: String = self.held.drain(..cut).collect();
            if !out.is_empty() {
                self.fresh = false;
            }
            if self.inside {
                r += &out;
            } else {
                c += &out;
            }
            return (r, c);
        }
    }

    /// Whatever is still held, at the end of the answer.
    fn end(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        if self.inside {
            (rest, String::new())
        } else {
            (String::new(), rest)
        }
    }
}

/// A finished sequence for the KV log: the logged sequence it extends, its tokens, its KV.
type ToLog = (Option<(u64, usize)>, Vec<u32>, KvCache);

/// The conversation KV log behind a writer thread: finished sequences are appended (and made
/// durable) off the generation loop, so a long conversation's write holds no other generation
/// back; the loop hears back which record each became.
struct KvStore {
    log: Arc<std::sync::Mutex<KvLog>>,
    tx: std::sync::mpsc::Sender<ToLog>,
    /// (tokens, record) of each sequence written.
    done: std::sync::mpsc::Receiver<(Vec<u32>, u64)>,
}

impl KvStore {
    fn start(log: KvLog, metrics: Arc<Metrics>) -> Self {
        let log = Arc::new(std::sync::Mutex::new(log));
        let (tx, rx) = std::sync::mpsc::channel::<ToLog>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let writer = log.clone();
        let spawned = std::thread::Builder::new()
            .name("charm-kv-log".into())
            .spawn(move || {
                for (origin, tokens, cache) in rx {
                    let mut log = writer.lock().unwrap_or_else(|p| p.into_inner());
                    match log.append(origin, &tokens, &cache) {
                        Ok(seq) => {
                            metrics.kv_log_bytes.store(log.bytes(), Ordering::Relaxed);
                            drop(log);
                            let _ = done_tx.send((tokens, seq));
                        }
                        Err(err) => tracing::warn!(%err, "conversation KV not persisted"),
                    }
                }
            });
        if let Err(err) = spawned {
            tracing::warn!(%err, "no KV log writer: conversations are not persisted");
        }
        Self { log, tx, done }
    }

    fn write(&self, origin: Option<(u64, usize)>, tokens: Vec<u32>, cache: KvCache) {
        let _ = self.tx.send((origin, tokens, cache));
    }
}

/// Shortest shared prefix worth reusing (tokens).
const MIN_PREFIX: usize = 16;

/// The KV caches of finished sequences, kept within a byte budget (least recently used go
/// first), for requests whose prompt starts with the same tokens: a conversation's next turn, a
/// shared system prompt. A reused prefix computes nothing again and gives the same result, since
/// every kernel gives a token's values whatever else it is batched with. Behind it, the KV log
/// on disk when there is one.
struct PrefixCache {
    budget: usize,
    /// (tokens the cache holds, the cache, its record in the KV log), most recently used last.
    entries: Vec<(Vec<u32>, KvCache, Option<u64>)>,
}

impl PrefixCache {
    fn new(budget: usize) -> Self {
        Self {
            budget,
            entries: Vec::new(),
        }
    }

    /// The cache of the longest stored prefix `prompt` shares (at least [`MIN_PREFIX`] tokens,
    /// at most all but its last token, which must be computed for its logits), cut to that
    /// prefix, from RAM or else from the log; with the logged sequence it came from.
    fn take(
        &mut self,
        prompt: &[u32],
        store: Option<&KvStore>,
    ) -> Option<(KvCache, Option<(u64, usize)>)> {
        // the log while the writer is not appending to it (the newest sequences are in RAM)
        let guard = store.and_then(|s| s.log.try_lock().ok());
        let log = guard.as_deref();
        let most = prompt.len().saturating_sub(1);
        let common = |t: &[u32]| t.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let ram = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (t, _, _))| (i, common(t).min(most)))
            .max_by_key(|&(i, n)| (n, i));
        let disk = log
            .and_then(|l| l.best(prompt))
            .map(|(s, n)| (s, n.min(most)));
        let ram_n = ram.map_or(0, |r| r.1);
        if let Some((seq, n)) = disk.filter(|&(_, n)| n > ram_n && n >= MIN_PREFIX) {
            match log.map(|l| l.load(seq)) {
                Some(Ok(mut c)) => {
                    c.truncate(n);
                    return Some((c, Some((seq, n))));
                }
                Some(Err(err)) => tracing::warn!(%err, "stored conversation KV not read"),
                None => {}
            }
        }
        let (i, n) = ram?;
        if n < MIN_PREFIX {
            return None;
        }
        let (tokens, cache, disk) = self.entries.remove(i);
        let mut reused = cache.clone();
        reused.truncate(n);
        // the entry stays for others, now the most recently used
        self.entries.push((tokens, cache, disk));
        Some((reused, disk.map(|s| (s, n))))
    }

    /// Notes that the entry holding exactly `tokens` is now record `seq` of the log.
    fn logged(&mut self, tokens: &[u32], seq: u64) {
        for e in self.entries.iter_mut().filter(|e| e.0 == tokens) {
            e.2 = Some(seq);
        }
    }

    /// Keeps `cache` (holding `tokens`, logged as `disk`), dropping the least recently used past
    /// the budget.
    fn put(&mut self, tokens: Vec<u32>, cache: KvCache, disk: Option<u64>) {
        if cache.bytes() > self.budget || tokens.len() < MIN_PREFIX {
            return;
        }
        // a stored sequence this one extends is redundant
        self.entries
            .retain(|(t, _, _)| !(t.len() <= tokens.len() && tokens[..t.len()] == t[..]));
        self.entries.push((tokens, cache, disk));
        while self
            .entries
            .iter()
            .map(|(_, c, _)| c.bytes())
            .sum::<usize>()
            > self.budget
        {
            self.entries.remove(0);
        }
    }
}

/// Where the first of `stops` starts in `text` and which one it is, searching from byte `from`
/// (moved back to a character boundary).
fn find_stop(text: &str, from: usize, stops: &[String]) -> Option<(usize, usize)> {
    let mut from = from.min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stops
        .iter()
        .enumerate()
        .filter_map(|(k, s)| text[from..].find(s.as_str()).map(|i| (from + i, k)))
        .min()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
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

async fn metrics_text(State(s): State<Arc<Shared>>, h: HeaderMap) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let m = &s.metrics;
    let l = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let mut t = String::new();
    let mut put = |name: &str, kind: &str, help: &str, v: String| {
        t += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n");
    };
    let secs = |x: &AtomicU64| format!("{:.6}", l(x) as f64 / 1e6);
    let hits = l(&m.expert_hits) as f64;
    let uses = hits + l(&m.expert_misses) as f64;
    let rows: [(&str, &str, &str, String); 15] = [
        (
            "charm_prefix_tokens_reused_total",
            "counter",
            "Prompt tokens whose KV came from the prefix cache.",
            l(&m.reused).to_string(),
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
            format!("{:.6}", if uses > 0.0 { hits / uses } else { 1.0 }),
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

async fn models(State(s): State<Arc<Shared>>, h: HeaderMap) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{"id": s.opts.model_name, "object": "model", "created": s.started, "owned_by": "charm"}],
    }))
    .into_response())
}

/// The sampling and length settings every generation endpoint shares, validated.
struct Settings {
    params: SamplingParams,
    penalties: Penalties,
    logprobs: Option<usize>,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    stream: bool,
    /// Generate past the end-of-sequence tokens (vLLM's and llama.cpp's `ignore_eos`).
    ignore_eos: bool,
}

/// Checks `body` against the `known` fields and reads the shared settings.
fn settings(body: &Json, known: &[&str]) -> Result<Settings, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(bad("the body must be a JSON object"));
    };
    const UNSUPPORTED: &[(&str, &str)] = &[
        ("tools", "tool calls are not supported yet"),
        ("tool_choice", "tool calls are not supported yet"),
        ("functions", "function calls are not supported yet"),
        ("response_format", "response formats are not supported yet"),
        ("logit_bias", "logit_bias is not supported yet"),
        ("suffix", "suffix is not supported"),
    ];
    for (k, v) in obj {
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(u, _)| u == k) {
            if !v.is_null() {
                return Err(bad(format!("`{k}`: {why}")));
            }
            continue;
        }
        if !known.contains(&k.as_str()) {
            return Err(bad(format!("unknown field `{k}`")));
        }
    }
    let num = |k: &str| -> Result<Option<f64>, ApiError> {
        match obj.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be a number"))),
        }
    };
    let int = |k: &str| -> Result<Option<u64>, ApiError> {
        match obj.get(k) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| bad(format!("`{k}` must be a non-negative integer"))),
        }
    };
    let mut penalties = Penalties::default();
    for (k, slot) in [
        ("presence_penalty", &mut penalties.presence),
        ("frequency_penalty", &mut penalties.frequency),
    ] {
        if let Some(v) = num(k)? {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(format!("`{k}` {v} is outside -2..2")));
            }
            *slot = v as f32;
        }
    }
    if let Some(v) = num("repetition_penalty")? {
        if !(v > 0.0 && v <= 10.0) {
            return Err(bad(format!("`repetition_penalty` {v} is outside (0, 10]")));
        }
        penalties.repetition = v as f32;
    }
    let min_p = num("min_p")?.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(bad(format!("`min_p` {min_p} is outside 0..1")));
    }
    // chat: `logprobs: true` with `top_logprobs: N`; completions: `logprobs: N`
    let logprobs = match obj.get("logprobs") {
        None | Some(Json::Null) | Some(Json::Bool(false)) => None,
        Some(Json::Bool(true)) => Some(int("top_logprobs")?.unwrap_or(0) as usize),
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| bad("`logprobs` must be true/false or a count"))?
                as usize,
        ),
    };
    if logprobs.is_some_and(|n| n > 20) {
        return Err(bad("at most 20 alternatives (`top_logprobs`)"));
    }
    if obj.get("echo").is_some_and(|v| v == &json!(true)) {
        return Err(bad("`echo` is not supported"));
    }
    if int("n")?.is_some_and(|n| n != 1) {
        return Err(bad("`n` must be 1"));
    }
    let temperature = num("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(format!("`temperature` {temperature} is outside 0..2")));
    }
    let top_p = num("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(format!("`top_p` {top_p} is outside (0, 1]")));
    }
    let max_tokens = int("max_completion_tokens")?.or(int("max_tokens")?);
    if max_tokens == Some(0) {
        return Err(bad("`max_tokens` must be at least 1"));
    }
    let stop = match obj.get("stop") {
        None | Some(Json::Null) => vec![],
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("`stop` must be a string or a list of strings"))?,
        Some(_) => return Err(bad("`stop` must be a string or a list of strings")),
    };
    if stop.iter().any(|s| s.is_empty()) || stop.len() > 16 {
        return Err(bad("`stop`: up to 16 non-empty strings"));
    }
    let flag = |k: &str| match obj.get(k) {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{k}` must be true or false"))),
    };
    let (stream, ignore_eos) = (flag("stream")?, flag("ignore_eos")?);
    Ok(Settings {
        params: SamplingParams {
            temperature: temperature as f32,
            top_k: int("top_k")?.unwrap_or(0) as usize,
            top_p: top_p as f32,
            seed: int("seed")?.unwrap_or(0),
            min_p: min_p as f32,
        },
        penalties,
        logprobs,
        max_tokens: max_tokens.map(|n| n as usize),
        stop,
        stream,
        ignore_eos,
    })
}

const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logprobs",
    "top_logprobs",
    "echo",
];

fn parse(body: &Bytes) -> Result<Json, ApiError> {
    serde_json::from_slice(body).map_err(|e| bad(format!("the body is not valid JSON: {e}")))
}

async fn completions(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let body = parse(&body)?;
    let set = settings(&body, &[COMMON, &["prompt"]].concat())?;
    let prompt = match &body["prompt"] {
        Json::String(p) => s.tok.encode(p).map_err(|e| bad(format!("`prompt`: {e}")))?,
        Json::Array(a) if a.iter().all(|v| v.is_u64()) => {
            a.iter().map(|v| v.as_u64().unwrap_or(0) as u32).collect()
        }
        _ => return Err(bad("`prompt` must be a string or a list of token ids")),
    };
    run(s, prompt, set, None).await
}

/// How a chat answer is taken apart.
#[derive(Debug, Clone, Copy)]
struct ChatMode {
    /// The turn opened `<think>`: reasoning comes first.
    thinking: bool,
    /// Tool calls are read back in this format.
    tools: Option<crate::tools::ToolFormat>,
}

/// The message of a whole answer: reasoning apart, tool calls taken out; and whether it
/// called tools.
fn chat_message(
    content: String,
    reasoning: String,
    tools: Option<crate::tools::ToolFormat>,
    id: &str,
) -> (Json, bool) {
    let (content, calls) = match tools {
        Some(f) => f.extract(&content),
        None => (content, vec![]),
    };
    let mut msg = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        msg["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        msg["tool_calls"] = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{id}_{i}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments.to_string()}})
            })
            .collect();
    }
    (msg, !calls.is_empty())
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorized(&s, &h)?;
    let mut parsed = parse(&body)?;
    // tools are the template's business: taken out before the shared checks
    let tools_given = parsed.get("tools").is_some_and(|t| !t.is_null());
    let tool_choice = parsed.get("tool_choice").cloned().unwrap_or(Json::Null);
    if let Some(o) = parsed.as_object_mut() {
        o.remove("tools");
        o.remove("tool_choice");
    }
    let set = settings(
        &parsed,
        &[
            COMMON,
            &["messages", "max_completion_tokens", "chat_template_kwargs"],
        ]
        .concat(),
    )?;
    let Some(t) = &s.template else {
        return Err(bad("this model has no chat template: use /v1/completions"));
    };
    let use_tools = match (&tool_choice, tools_given) {
        (_, false) => false,
        (Json::Null, true) => true,
        (Json::String(c), true) if c == "auto" => true,
        (Json::String(c), true) if c == "none" => false,
        _ => {
            return Err(bad(
                "`tool_choice`: only \"auto\" and \"none\" are supported",
            ))
        }
    };
    if use_tools && t.tool_format.is_none() {
        return Err(bad(
            "this model's chat template does not define tool calls charm can read back",
        ));
    }
    let ok_messages = parsed["messages"].as_array().is_some_and(|m| {
        !m.is_empty()
            && m.iter().all(|x| {
                x["role"].is_string()
                    && (x["content"].is_string()
                        || x["content"].is_array()
                        || x["content"].is_null())
            })
    });
    if !ok_messages {
        return Err(bad(
            "`messages` must be a non-empty list of {role, content} objects",
        ));
    }
    // the template sees the messages in their key order
    let v: minijinja::Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let mut messages = drop_null_keys(&v.get_attr("messages").unwrap_or_default());
    // tool-call arguments in the form the template reads (clients send JSON text)
    match t.tool_format {
        Some(crate::tools::ToolFormat::Glm) => messages = tool_arguments(&messages, true),
        Some(crate::tools::ToolFormat::DeepSeek) => messages = tool_arguments(&messages, false),
        _ => {}
    }
    let tools = if use_tools {
        let t = v.get_attr("tools").unwrap_or_default();
        if t.kind() != minijinja::value::ValueKind::Seq {
            return Err(bad("`tools` must be a list"));
        }
        t
    } else {
        minijinja::Value::from(())
    };
    let kwargs = match v.get_attr("chat_template_kwargs") {
        Ok(k) if !k.is_undefined() && !k.is_none() => k
            .try_iter()
            .map_err(|_| bad("`chat_template_kwargs` must be an object"))?
            .filter_map(|key| {
                let val = k.get_item(&key).ok()?;
                Some((key.as_str()?.to_string(), val))
            })
            .collect(),
        _ => vec![],
    };
    let text = t
        .render(&ChatInput {
            messages,
            tools,
            add_generation_prompt: true,
            bos_token: None,
            eos_token: None,
            kwargs,
        })
        .map_err(|e| bad(e.to_string()))?;
    let prompt = s.tok.encode(&text).map_err(|e| bad(e.to_string()))?;
    // a template that opens the assistant's turn with `<think>` (GLM with thinking on) has the
    // model reason first: that part is returned apart, as `reasoning_content`
    let thinking = text.trim_end().ends_with("<think>");
    let tools = if use_tools { t.tool_format } else { None };
    run(s, prompt, set, Some(ChatMode { thinking, tools })).await
}

/// Checks a prompt against the context and queues its generation; the events come on the
/// returned receiver.
fn submit(
    s: &Shared,
    prompt: Vec<u32>,
    set: &Settings,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let ctx = s.opts.context;
    if prompt.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    if prompt.len() >= ctx {
        return Err(bad(format!(
            "the prompt is {} tokens; the context holds {ctx}",
            prompt.len()
        )));
    }
    let max_tokens = set.max_tokens.unwrap_or(ctx - prompt.len());
    if prompt.len() + max_tokens > ctx {
        return Err(bad(format!(
            "the prompt ({} tokens) plus max_tokens ({max_tokens}) exceeds the context of {ctx} tokens",
            prompt.len()
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        prompt,
        max_tokens,
        params: set.params,
        penalties: set.penalties,
        logprobs: set.logprobs,
        stop: set.stop.clone(),
        ignore_eos: set.ignore_eos,
        tx,
        queued: Instant::now(),
    };
    s.metrics.queued.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = s.jobs.try_send(job) {
        s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        s.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        return Err(match e {
            std::sync::mpsc::TrySendError::Full(_) => error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "too many requests waiting; retry shortly",
            ),
            std::sync::mpsc::TrySendError::Disconnected(_) => error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the generator stopped",
            ),
        });
    }
    s.metrics.requests.fetch_add(1, Ordering::Relaxed);
    Ok(rx)
}

/// Queues a generation and answers with its result or its stream (OpenAI shapes).
async fn run(
    s: Arc<Shared>,
    prompt: Vec<u32>,
    set: Settings,
    mode: Option<ChatMode>,
) -> Result<Response, ApiError> {
    let chat = mode.is_some();
    let tools = mode.and_then(|m| m.tools);
    let mut split = Reasoning::new(mode.is_some_and(|m| m.thinking));
    let mut rx = submit(&s, prompt, &set)?;
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let (created, model) = (now(), s.opts.model_name.clone());
    let usage = |p: usize, c: usize| json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    if !set.stream {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(t) => text += &t,
                Event::Logprobs(_) => {}
                Event::Failed(m) => {
                    return Err(error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m))
                }
                Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    logprobs,
                    ..
                } => {
                    let lp = set
                        .logprobs
                        .map(|_| logprobs_json(&s.tok, &logprobs, chat))
                        .unwrap_or(Json::Null);
                    let choice = if chat {
                        let (r, c) = split.push(&text);
                        let (r2, c2) = split.end();
                        let (msg, called) = chat_message(c + &c2, r + &r2, tools, &id);
                        let finish = if called { "tool_calls" } else { finish };
                        json!({"index": 0, "message": msg, "finish_reason": finish, "logprobs": lp})
                    } else {
                        json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": lp})
                    };
                    return Ok(axum::Json(json!({
                        "id": id,
                        "object": if chat { "chat.completion" } else { "text_completion" },
                        "created": created,
                        "model": model,
                        "choices": [choice],
                        "usage": usage(prompt_tokens, completion_tokens),
                    }))
                    .into_response());
                }
            }
        }
        return Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the generation ended without a result",
        ));
    }
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let stream_id = id.clone();
    let chunk = move |choice: Json, usage_v: Option<Json>| {
        let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage_v {
            c["choices"] = json!([]);
            c["usage"] = u;
        }
        format!("data: {c}\n\n")
    };
    let mut first = chat;
    let mut held_content = String::new();
    let mut pending_lp: Vec<TokenLogprob> = Vec::new();
    let tok = s.tok.clone();
    let stream = sse(rx, String::new(), move |ev| match ev {
        Event::Logprobs(l) => {
            pending_lp = l;
            (String::new(), false)
        }
        Event::Text(t) => {
            let mut lp = if pending_lp.is_empty() {
                Json::Null
            } else {
                logprobs_json(&tok, &std::mem::take(&mut pending_lp), chat)
            };
            if !chat {
                let choice = json!({"index": 0, "text": t, "finish_reason": null, "logprobs": lp});
                return (chunk(choice, None), false);
            }
            let (r, mut c) = split.push(&t);
            if tools.is_some() {
                // tool calls are read from the whole answer: content waits for the end
                held_content += &c;
                c = String::new();
            }
            let mut out = String::new();
            for (field, piece) in [("reasoning_content", r), ("content", c)] {
                if piece.is_empty() {
                    continue;
                }
                let mut d = json!({ field: piece });
                if first {
                    d["role"] = json!("assistant");
                    first = false;
                }
                let mut c = json!({"index": 0, "delta": d, "finish_reason": null});
                if !lp.is_null() {
                    c["logprobs"] = std::mem::take(&mut lp);
                }
                out += &chunk(c, None);
            }
            (out, false)
        }
        Event::Done {
            finish,
            prompt_tokens,
            completion_tokens,
            ..
        } => {
            let mut held = String::new();
            let mut finish = finish;
            if chat {
                let (r, c) = split.end();
                let mut content = c;
                let mut calls = Json::Null;
                if tools.is_some() {
                    let all = std::mem::take(&mut held_content) + &content;
                    let (msg, called) = chat_message(all, String::new(), tools, &stream_id);
                    content = msg["content"].as_str().unwrap_or_default().to_string();
                    if called {
                        finish = "tool_calls";
                        calls = msg["tool_calls"].clone();
                        if let Some(a) = calls.as_array_mut() {
                            for (i, c) in a.iter_mut().enumerate() {
                                c["index"] = json!(i);
                            }
                        }
                    }
                }
                if !calls.is_null() {
                    let d = json!({"tool_calls": calls});
                    held += &chunk(json!({"index": 0, "delta": d, "finish_reason": null}), None);
                }
                for (field, piece) in [("reasoning_content", r), ("content", content)] {
                    if !piece.is_empty() {
                        let d = json!({ field: piece });
                        held +=
                            &chunk(json!({"index": 0, "delta": d, "finish_reason": null}), None);
                    }
                }
            }
            let choice = if chat {
                json!({"index": 0, "delta": {}, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": "", "finish_reason": finish, "logprobs": null})
            };
            let end = held
                + &chunk(choice, None)
                + &chunk(json!(null), Some(usage(prompt_tokens, completion_tokens)))
                + "data: [DONE]\n\n";
            (end, true)
        }
        Event::Failed(m) => {
            let e = json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}});
            (format!("data: {e}\n\n"), true)
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

/// Log probabilities in OpenAI's shapes: chat's `{"content": [{token, logprob, bytes,
/// top_logprobs}]}`, completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.
fn logprobs_json(tok: &TextTokenizer, lps: &[TokenLogprob], chat: bool) -> Json {
    let text = |t: u32| tok.decode(&[t]).unwrap_or_default();
    if chat {
        let entry = |t: u32, lp: f32| {
            let s = text(t);
            json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
        };
        json!({"content": lps.iter().map(|(t, lp, alt)| {
            let mut e = entry(*t, *lp);
            e["top_logprobs"] = alt.iter().map(|(a, l)| entry(*a, *l)).collect();
            e
        }).collect::<Vec<_>>()})
    } else {
        let mut offset = 0;
        let offsets: Vec<usize> = lps
            .iter()
            .map(|(t, _, _)| {
                let o = offset;
                offset += text(*t).len();
                o
            })
            .collect();
        json!({
            "tokens": lps.iter().map(|(t, _, _)| text(*t)).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|(_, lp, _)| *lp).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|(_, _, alt)| {
                alt.iter().map(|(a, l)| (text(*a), json!(l))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }
}

/// A server-sent event stream: `prefix`, then `frame(event)` for each event of a generation
/// until one says it is the last. Dropping the stream (the client went away) drops the receiver,
/// which stops the generation.
fn sse(
    mut rx: mpsc::UnboundedReceiver<Event>,
    prefix: String,
    mut frame: impl FnMut(Event) -> (String, bool) + Send + 'static,
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

/// Anthropic content blocks of a whole answer: its text, then its tool calls as `tool_use`
/// blocks (when `format` reads them); and whether it called tools.
fn anthropic_content(
    text: String,
    format: Option<crate::tools::ToolFormat>,
    id: &str,
) -> (Json, bool) {
    let (text, calls) = match format {
        Some(f) => f.extract(&text),
        None => (text, vec![]),
    };
    let mut blocks = Vec::new();
    if !text.is_empty() || calls.is_empty() {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for (i, c) in calls.iter().enumerate() {
        blocks.push(json!({"type": "tool_use", "id": format!("toolu_{id}_{i}"), "name": c.name, "input": c.arguments}));
    }
    (Json::Array(blocks), !calls.is_empty())
}

/// `POST /v1/messages`: Anthropic's Messages API over the same generator.
async fn messages(
    State(s): State<Arc<Shared>>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let a = |e: ApiError| e.anthropic();
    authorized(&s, &h).map_err(a)?;
    let parsed = parse(&body).map_err(a)?;
    let Some(obj) = parsed.as_object() else {
        return Err(a(bad("the body must be a JSON object")));
    };
    const KNOWN: &[&str] = &[
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "metadata",
        "tools",
        "tool_choice",
    ];
    for k in obj.keys() {
        if k == "thinking" {
            return Err(a(bad(format!("`{k}` is not supported yet"))));
        }
        if !KNOWN.contains(&k.as_str()) {
            return Err(a(bad(format!("unknown field `{k}`"))));
        }
    }
    let Some(max_tokens) = obj
        .get("max_tokens")
        .and_then(|v| v.as_u64())
        .filter(|&n| n > 0)
    else {
        return Err(a(bad("`max_tokens` (a positive integer) is required")));
    };
    // the shared settings, in OpenAI's names
    let mut o = json!({"max_tokens": max_tokens});
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("stop_sequences", "stop"),
    ] {
        if let Some(v) = obj.get(from) {
            o[to] = v.clone();
        }
    }
    let set = settings(&o, COMMON).map_err(a)?;
    if set.params.temperature > 1.0 {
        return Err(a(bad("`temperature` is outside 0..1")));
    }
    let Some(t) = &s.template else {
        return Err(a(bad("this model has no chat template")));
    };
    // Anthropic content: a string or text blocks; the system prompt apart
    let text_of = |v: &Json, what: &str| -> Result<String, ApiError> {
        match v {
            Json::String(t) => Ok(t.clone()),
            Json::Array(blocks) => blocks
                .iter()
                .map(|b| match (b["type"].as_str(), b["text"].as_str()) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err(bad(format!("{what}: only text blocks are supported"))),
                })
                .collect(),
            _ => Err(bad(format!(
                "{what} must be a string or a list of text blocks"
            ))),
        }
    };
    let msg = |role: &str, content: String| {
        minijinja::Value::from_pairs([
            ("role", minijinja::Value::from(role)),
            ("content", minijinja::Value::from(content)),
        ])
    };
    let mut msgs = Vec::new();
    if let Some(sys) = obj.get("system") {
        msgs.push(msg("system", text_of(sys, "`system`").map_err(a)?));
    }
    let Some(list) = obj
        .get("messages")
        .and_then(|m| m.as_array())
        .filter(|m| !m.is_empty())
    else {
        return Err(a(bad("`messages` must be a non-empty list")));
    };
    // the same messages in their key order (tool inputs keep theirs)
    let mv: minijinja::Value = serde_json::from_slice(&body).map_err(|e| a(bad(e.to_string())))?;
    let mlist = mv.get_attr("messages").unwrap_or_default();
    let use_tools = match obj.get("tool_choice").map(|c| c["type"].as_str()) {
        None => obj.get("tools").is_some_and(|t| !t.is_null()),
        Some(Some("auto")) => true,
        Some(Some("none")) => false,
        Some(_) => return Err(a(bad("`tool_choice`: only auto and none are supported"))),
    };
    if use_tools && t.tool_format.is_none() {
        return Err(a(bad(
            "this model's chat template does not define tool calls charm can read back",
        )));
    }
    for (i, m) in list.iter().enumerate() {
        let role = m["role"]
            .as_str()
            .filter(|r| matches!(*r, "user" | "assistant"));
        let Some(role) = role else {
            return Err(a(bad("each message's `role` must be user or assistant")));
        };
        let Json::Array(blocks) = &m["content"] else {
            msgs.push(msg(role, text_of(&m["content"], "`content`").map_err(a)?));
            continue;
        };
        let mblocks = mlist
            .get_item(&minijinja::Value::from(i))
            .and_then(|x| x.get_attr("content"))
            .unwrap_or_default();
        let (mut text, mut calls) = (String::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            match (b["type"].as_str(), role) {
                (Some("text"), _) => text += b["text"].as_str().unwrap_or_default(),
                (Some("tool_use"), "assistant") => {
                    let input = mblocks
                        .get_item(&minijinja::Value::from(j))
                        .and_then(|x| x.get_attr("input"))
                        .unwrap_or_default();
                    let name = b["name"].as_str().unwrap_or_default();
                    calls.push(minijinja::Value::from_pairs([
                        (
                            "id",
                            minijinja::Value::from(b["id"].as_str().unwrap_or_default()),
                        ),
                        ("type", minijinja::Value::from("function")),
                        (
                            "function",
                            minijinja::Value::from_pairs([
                                ("name", minijinja::Value::from(name)),
                                ("arguments", input),
                            ]),
                        ),
                    ]));
                }
                (Some("tool_result"), "user") => {
                    let content = match &b["content"] {
                        Json::Null => String::new(),
                        c => text_of(c, "`tool_result` content").map_err(a)?,
                    };
                    msgs.push(minijinja::Value::from_pairs([
                        ("role", minijinja::Value::from("tool")),
                        (
                            "tool_call_id",
                            minijinja::Value::from(b["tool_use_id"].as_str().unwrap_or_default()),
                        ),
                        ("content", minijinja::Value::from(content)),
                    ]));
                }
                _ => {
                    return Err(a(bad(format!(
                        "`content`: {} blocks are not supported in {role} messages",
                        b["type"].as_str().unwrap_or("untyped")
                    ))))
                }
            }
        }
        if calls.is_empty() {
            if !text.is_empty() || role == "assistant" {
                msgs.push(msg(role, text));
            }
        } else {
            msgs.push(minijinja::Value::from_pairs([
                ("role", minijinja::Value::from(role)),
                ("content", minijinja::Value::from(text)),
                ("tool_calls", minijinja::Value::from(calls)),
            ]));
        }
    }
    // Anthropic's tools in the shape the templates read (OpenAI's)
    let tools = if use_tools {
        let list = mv.get_attr("tools").unwrap_or_default();
        let Ok(items) = list.try_iter() else {
            return Err(a(bad("`tools` must be a list")));
        };
        let converted: Vec<minijinja::Value> = items
            .map(|tool| {
                let get = |k: &str| tool.get_attr(k).unwrap_or_default();
                minijinja::Value::from_pairs([
                    ("type", minijinja::Value::from("function")),
                    (
                        "function",
                        minijinja::Value::from_pairs([
                            ("name", get("name")),
                            ("description", get("description")),
                            ("parameters", get("input_schema")),
                        ]),
                    ),
                ])
            })
            .collect();
        minijinja::Value::from(converted)
    } else {
        minijinja::Value::from(())
    };
    let rendered = t
        .render(&ChatInput {
            messages: minijinja::Value::from(msgs),
            tools,
            add_generation_prompt: true,
            ..Default::default()
        })
        .map_err(|e| a(bad(e.to_string())))?;
    let prompt = s.tok.encode(&rendered).map_err(|e| a(bad(e.to_string())))?;
    let prompt_tokens = prompt.len();
    let mut rx = submit(&s, prompt, &set).map_err(a)?;
    let id = format!("msg_{}", s.next_id.fetch_add(1, Ordering::Relaxed));
    let model = s.opts.model_name.clone();
    let reason = |finish: &str, matched: &Option<String>| match (finish, matched) {
        (_, Some(_)) => "stop_sequence",
        ("length", _) => "max_tokens",
        _ => "end_turn",
    };
    let format = if use_tools { t.tool_format } else { None };
    if !set.stream {
        let mut text = String::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text(t) => text += &t,
                Event::Logprobs(_) => {}
                Event::Failed(m) => {
                    return Err(a(error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        m,
                    )))
                }
                Event::Done {
                    finish,
                    matched,
                    prompt_tokens,
                    completion_tokens,
                    ..
                } => {
                    let (content, called) = anthropic_content(text, format, &id);
                    let stop = if called {
                        "tool_use"
                    } else {
                        reason(finish, &matched)
                    };
                    return Ok(axum::Json(json!({
                        "id": id,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": content,
                        "stop_reason": stop,
                        "stop_sequence": matched,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens},
                    }))
                    .into_response());
                }
            }
        }
        return Err(a(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the generation ended without a result",
        )));
    }
    let ev = |name: &str, data: Json| format!("event: {name}\ndata: {data}\n\n");
    let prefix = ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
    ) + &ev(
        "content_block_start",
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    );
    let mut held = String::new();
    let msg_id = id.clone();
    let stream = sse(rx, prefix, move |e| match e {
        Event::Logprobs(_) => (String::new(), false),
        Event::Text(t) if format.is_some() => {
            // tool calls are read from the whole answer: it waits for the end
            held += &t;
            (String::new(), false)
        }
        Event::Text(t) => (
            ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
            ),
            false,
        ),
        Event::Done {
            finish,
            matched,
            completion_tokens,
            ..
        } => {
            let mut out = String::new();
            let mut stop = reason(finish, &matched);
            let mut blocks = vec![];
            if format.is_some() {
                let (content, called) =
                    anthropic_content(std::mem::take(&mut held), format, &msg_id);
                if called {
                    stop = "tool_use";
                }
                blocks = content.as_array().cloned().unwrap_or_default();
                // the first block is the open text block, if the answer has text
                if let Some(t) = blocks.first().and_then(|b| b["text"].as_str()) {
                    out += &ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
                    );
                }
            }
            out += &ev(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            );
            let uses = blocks.iter().filter(|b| b["type"] == "tool_use");
            for (i, b) in uses.enumerate() {
                let mut start = b.clone();
                start["input"] = json!({});
                out += &ev(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i + 1, "content_block": start}),
                );
                out += &ev(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": i + 1, "delta": {"type": "input_json_delta", "partial_json": b["input"].to_string()}}),
                );
                out += &ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": i + 1}),
                );
            }
            out += &ev(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": matched}, "usage": {"output_tokens": completion_tokens}}),
            );
            out += &ev("message_stop", json!({"type": "message_stop"}));
            (out, true)
        }
        Event::Failed(m) => (
            ev(
                "error",
                json!({"type": "error", "error": {"type": "api_error", "message": m}}),
            ),
            true,
        ),
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::{anthropic_content, Reasoning};
    use crate::tools::ToolFormat;
    use serde_json::json;

    #[test]
    fn anthropic_answers_put_tool_calls_in_tool_use_blocks() {
        let t = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>";
        let (c, called) = anthropic_content(t.into(), Some(ToolFormat::Glm), "m1");
        assert!(called);
        assert_eq!(
            c,
            json!([{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_m1_0", "name": "get_weather", "input": {"city": "Paris"}}])
        );
        let (c, called) = anthropic_content("plain".into(), None, "m2");
        assert!(!called);
        assert_eq!(c, json!([{"type": "text", "text": "plain"}]));
    }

    fn split(thinking: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Reasoning::new(thinking);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let (a, b) = s.push(p);
            r += &a;
            c += &b;
        }
        let (a, b) = s.end();
        (r + &a, c + &b)
    }

    #[test]
    fn reasoning_is_split_from_content_whatever_the_pieces() {
        let whole = "Let me think.</think>\nThe answer is 4.";
        let want = ("Let me think.".to_string(), "The answer is 4.".to_string());
        assert_eq!(split(true, &[whole]), want);
        // every split point, including inside the tag and inside a multi-byte character
        let text = "Héllo, let me see.</think>\nAnswer: é";
        for i in 0..text.len() {
            if !text.is_char_boundary(i) {
                continue;
            }
            let got = split(true, &[&text[..i], &text[i..]]);
            assert_eq!(
                got,
                ("Héllo, let me see.".into(), "Answer: é".into()),
                "split at {i}"
            );
        }
        // the answer opens thinking itself
        assert_eq!(
            split(false, &["<thi", "nk>why</think>so"]),
            ("why".into(), "so".into())
        );
        // no thinking: all content, tags or not
        assert_eq!(
            split(false, &["plain </think> text"]),
            (String::new(), "plain </think> text".into())
        );
        // thinking never closed: all reasoning
        assert_eq!(
            split(true, &["still ", "thinking"]),
            ("still thinking".into(), String::new())
        );
    }
}
