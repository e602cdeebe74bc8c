//! The batch scheduler of `charm serve`, apart from HTTP: generations queue here, and one thread
//! runs them with continuous batching. Every forward step serves every running sequence (decode
//! tokens, then prompt chunks within the step's token budget); sequences join and leave at every
//! step, each with its own KV cache and sampler. Finished sequences' KV serves later prompts that
//! start with the same tokens (`prefix`), in RAM and, with a KV log, on disk (`kv_store`).

mod job;
mod kv_store;
mod metrics;
mod prefix;
mod sequence;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use self::job::Queued;
pub use self::job::{Event, Job, TokenLogprob};
use self::kv_store::KvStore;
pub use self::metrics::Metrics;
use self::prefix::{PrefixCache, MIN_PREFIX};
use self::sequence::Sequence;
use crate::decode::speculative::{DraftOptions, Drafter};
use crate::decode::tokenizer::TextTokenizer;
use crate::model::cache::KvCache;
use crate::model::engine::Engine;
use crate::model::forward::ForwardOptions;
use crate::serve::kvlog::KvLog;

/// How the generator thread runs sequences.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Sequences running at once.
    pub max_active: usize,
    /// Rows (tokens) one forward step takes at most: every decoding sequence's next token, then
    /// prompt chunks.
    pub batch_tokens: usize,
    /// Bytes of finished sequences' KV kept for later prompts that start with the same tokens.
    pub prefix_bytes: usize,
    /// Tokens that end a generation.
    pub stop_ids: Vec<u32>,
    /// Speculative decoding of each sequence (`max == 0`: off).
    pub draft: DraftOptions,
    /// Tokens a grammar forces are verified as drafts (in the step of the token before them).
    pub forced_drafts: bool,
}

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue is full: try again shortly.
    Full,
    /// The generator thread is gone.
    Stopped,
}

/// The generator thread and its queue.
#[derive(Debug)]
pub struct Scheduler {
    /// Requests waiting: each the jobs of one request (one per prompt), taking one place of the
    /// queue however many it has; they are admitted one sequence at a time.
    jobs: std::sync::mpsc::SyncSender<Vec<Queued>>,
    metrics: Arc<Metrics>,
}

impl Scheduler {
    /// Starts the generator thread for `engine`, with a queue of `queue` jobs beyond the running
    /// ones; `kv_log`, when given, persists finished sequences and serves their prefixes.
    pub fn start(
        engine: Engine,
        tok: Arc<TextTokenizer>,
        schedule: Schedule,
        queue: usize,
        kv_log: Option<KvLog>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let (jobs, rx) = std::sync::mpsc::sync_channel::<Vec<Queued>>(queue);
        let m = metrics.clone();
        std::thread::Builder::new()
            .name("charm-generate".into())
            .spawn(move || {
                let store = kv_log.map(|log| KvStore::start(log, m.clone()));
                rayon::scope(|_| run_jobs(&engine, &tok, rx, &m, &schedule, store))
            })
            .map_err(|e| e.to_string())?;
        Ok(Self { jobs, metrics })
    }

    /// Queues `job` (one choice: `job.n` is read as 1); its events come on the returned
    /// receiver. Dropping the receiver cancels the generation.
    pub fn submit(&self, mut job: Job) -> Result<mpsc::UnboundedReceiver<Event>, Refused> {
        job.n = 1;
        let mut rx = self.submit_choices(job)?;
        Ok(rx.remove(0))
    }

    /// Queues `job` with its `n` choices; the events of choice `i` come on receiver `i`.
    /// Dropping a receiver cancels that choice.
    pub fn submit_choices(&self, job: Job) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, Refused> {
        Ok(self.submit_all(vec![job])?.remove(0))
    }

    /// Queues the jobs of one request (a list of prompts) together, in one place of the queue:
    /// each runs as its own sequence, batched with the others as room comes (not one after
    /// another). The receivers of job `p`'s choices come at `p`, as [`Self::submit_choices`]
    /// gives them. All are queued or none (`jobs` empty: none, and no error).
    pub fn submit_all(
        &self,
        jobs: Vec<Job>,
    ) -> Result<Vec<Vec<mpsc::UnboundedReceiver<Event>>>, Refused> {
        if jobs.is_empty() {
            return Ok(vec![]);
        }
        let now = Instant::now();
        let (mut all, mut queued) = (Vec::new(), Vec::new());
        for job in jobs {
            let (mut txs, rxs): (Vec<_>, Vec<_>) =
                (0..job.n.max(1)).map(|_| mpsc::unbounded_channel()).unzip();
            let tx = txs.remove(0);
            queued.push(Queued {
                job,
                tx,
                forks: txs,
                queued: now,
            });
            all.push(rxs);
        }
        let m = &self.metrics;
        let k = queued.len() as u64;
        m.queued.fetch_add(k, Ordering::Relaxed);
        if let Err(e) = self.jobs.try_send(queued) {
            m.queued.fetch_sub(k, Ordering::Relaxed);
            m.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(match e {
                std::sync::mpsc::TrySendError::Full(_) => Refused::Full,
                std::sync::mpsc::TrySendError::Disconnected(_) => Refused::Stopped,
            });
        }
        m.requests.fetch_add(1, Ordering::Relaxed);
        Ok(all)
    }

    /// The scheduler's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
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
    rx: std::sync::mpsc::Receiver<Vec<Queued>>,
    metrics: &Metrics,
    lim: &Schedule,
    store: Option<KvStore>,
) {
    let max_active = lim.max_active;
    let mut active: Vec<Sequence> = Vec::new();
    let mut prefixes = PrefixCache::new(lim.prefix_bytes);
    // the jobs of requests taken from the queue and not yet admitted, in arrival order
    let mut pending: std::collections::VecDeque<Queued> = std::collections::VecDeque::new();
    loop {
        // admit: block only when nothing runs (the choices of a job count once their prompt
        // is read and they fork)
        while active.len() < max_active {
            let Some(job) = pending.pop_front() else {
                let request = if active.is_empty() {
                    // nothing runs while it waits
                    metrics.active.store(0, Ordering::Relaxed);
                    metrics.batch_rows.store(0, Ordering::Relaxed);
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
                pending.extend(request);
                continue;
            };
            metrics.queued.fetch_sub(1, Ordering::Relaxed);
            if let Some(st) = &store {
                // sequences the writer has made durable: their RAM entries now name their
                // records, so a conversation's next turn is logged as an extension of them
                while let Ok((tokens, seq)) = st.done.try_recv() {
                    prefixes.logged(&tokens, seq);
                }
            }
            let mut seq = Sequence::new(e, tok, job, lim.draft);
            // (prompt log probabilities need every prompt row computed)
            let reusable = seq.job.prompt_logprobs.is_none();
            let reused = reusable
                .then(|| prefixes.take(&seq.job.prompt, store.as_ref()))
                .flatten();
            if let Some((c, origin)) = reused {
                // the MTP layer has no states of a reused prefix: prompt lookup drafts instead
                if let Some((d @ Drafter::Mtp(..), _)) = &mut seq.drafter {
                    *d = Drafter::Lookup;
                }
                metrics.reused.fetch_add(c.len() as u64, Ordering::Relaxed);
                seq.reused = c.len();
                seq.cache = c;
                seq.origin = origin;
            }
            active.push(seq);
        }
        active.retain(|s| {
            let gone = s.job.gone();
            if gone {
                cancelled(metrics, s);
            }
            !gone
        });
        if active.is_empty() {
            continue;
        }
        let t0 = Instant::now();
        let mut failed_drafts = Vec::new();
        for (i, s) in active.iter_mut().enumerate() {
            if let Err(m) = s.draft(e, lim.forced_drafts, metrics) {
                failed_drafts.push((i, m));
            }
        }
        let take = step_rows(&mut active, lim.batch_tokens);
        for s in active.iter_mut() {
            // this step's grammar masks, computed while it runs (decoding sequences only)
            s.prepare_mask();
        }
        let mut done = batched_step(e, tok, &lim.stop_ids, &mut active, &take, metrics, t0);
        for (i, m) in failed_drafts {
            done[i] = Err(m);
        }
        let mut i = 0;
        active.retain_mut(|seq| {
            let r = &done[i];
            i += 1;
            match r {
                Ok(true) => true,
                Ok(false) => {
                    if !seq.finished {
                        // (a sequence ends unfinished only when its client went away)
                        cancelled(metrics, seq);
                    } else {
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

/// Counts and logs a generation stopped because its client went away.
fn cancelled(metrics: &Metrics, seq: &Sequence) {
    metrics.cancelled.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        completion_tokens = seq.ids.len(),
        "client went away: generation cancelled"
    );
}

/// How many tokens each sequence feeds this step: one for each decoding sequence, then its
/// drafts as far as the step's budget of `batch_tokens` rows goes (drafts past it are dropped),
/// then, in arrival order, as much of each unfinished prompt as the budget leaves (a long prompt
/// is prefilled in chunks, between other sequences' tokens).
fn step_rows(active: &mut [Sequence], batch_tokens: usize) -> Vec<usize> {
    let mut budget = batch_tokens.max(1);
    let mut take = vec![0; active.len()];
    for (t, s) in take.iter_mut().zip(active.iter()) {
        if s.next.is_some() {
            *t = 1;
            budget = budget.saturating_sub(1);
        }
    }
    for (t, s) in take.iter_mut().zip(active.iter_mut()) {
        if s.next.is_some() {
            let drafts = (s.feed.len() - 1).min(budget);
            s.feed.truncate(1 + drafts);
            *t += drafts;
            budget -= drafts;
        }
    }
    for (t, s) in take.iter_mut().zip(active.iter()) {
        if s.next.is_none() {
            *t = (s.job.prompt.len() - s.cache.len()).min(budget);
            budget -= *t;
        }
    }
    take
}

/// One forward step of every sequence with rows this step (`take`), then the head on the rows
/// whose logits are wanted: every row of a decoding sequence (its token and its drafts), the last
/// row of a prompt that is all in. Per sequence: whether it goes on (see [`Sequence::advance`]
/// and [`Sequence::advance_drafted`]). A failed step fails the sequences that were in it (their
/// caches may hold part of it). `t0`: when the step began (drafting included), for the draft rule.
fn batched_step<'t>(
    e: &Engine,
    tok: &'t TextTokenizer,
    stop_ids: &[u32],
    active: &mut Vec<Sequence<'t>>,
    take: &[usize],
    metrics: &Metrics,
    t0: Instant,
) -> Vec<Result<bool, String>> {
    let m = &e.model;
    let h = m.spec.hidden_size;
    let mut steps = Vec::new();
    for (s, &k) in active.iter_mut().zip(take) {
        if k == 0 {
            continue;
        }
        let tokens: &[u32] = match &s.next {
            Some(_) => &s.feed[..k],
            None => &s.job.prompt[s.cache.len()..s.cache.len() + k],
        };
        steps.push(crate::model::forward::Step {
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
    let failed = |err: crate::model::forward::ForwardError| -> Vec<Result<bool, String>> {
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
    // the rows whose logits are wanted, per sequence (first row in `normed`, rows)
    let (mut wanted, mut at) = (Vec::new(), 0);
    let mut spans: Vec<Option<(usize, usize)>> = vec![None; active.len()];
    for (i, (s, &k)) in active.iter_mut().zip(take).enumerate() {
        let first = at;
        at += k;
        if k == 0 {
            continue;
        }
        if s.next.is_none() {
            // prompt rows: the drafter's inputs; the last row's logits once the prompt is in,
            // every row's when the prompt's log probabilities are asked for
            let from = s.cache.len() - k;
            s.prompt_states(from, &normed[first * h..at * h], h);
            if s.job.prompt_logprobs.is_some() {
                spans[i] = Some((first, k));
                wanted.extend_from_slice(&normed[first * h..at * h]);
            } else if s.cache.len() >= s.job.prompt.len() {
                spans[i] = Some((at - 1, 1));
                wanted.extend_from_slice(&normed[(at - 1) * h..at * h]);
            }
        } else {
            spans[i] = Some((first, k));
            wanted.extend_from_slice(&normed[first * h..at * h]);
        }
    }
    let logits = match m.logits(&wanted, wanted.len() / h) {
        Ok(l) => l,
        Err(err) => return failed(err),
    };
    let seconds = t0.elapsed().as_secs_f64();
    let v = m.spec.vocab_size;
    let mut row = 0;
    let mut forks = Vec::new();
    let mut done: Vec<Result<bool, String>> = active
        .iter_mut()
        .zip(spans)
        .map(|(s, span)| {
            let Some((first, mut n)) = span else {
                return Ok(!s.job.gone());
            };
            let mut l = &logits[row * v..(row + n) * v];
            let mut states = &normed[first * h..(first + n) * h];
            row += n;
            if s.next.is_none() && s.job.prompt_logprobs.is_some() {
                // every prompt row read this step: the log probability of the token after it
                s.prompt_rows(l, v, s.cache.len() - n);
                if s.cache.len() < s.job.prompt.len() {
                    return Ok(!s.job.gone());
                }
                // the prompt is in: its last row picks the first token
                l = &l[(n - 1) * v..];
                states = &states[(n - 1) * h..];
                n = 1;
            }
            if s.next.is_none() && !s.job.forks.is_empty() {
                // the other choices start from this prompt's KV, each with its own seed
                for (i, tx) in std::mem::take(&mut s.job.forks).into_iter().enumerate() {
                    let mut f = s.fork(tok, tx, 1 + i as u64);
                    let r = f.advance(l.to_vec(), Some(states), tok, metrics, stop_ids);
                    forks.push((f, r));
                }
            }
            match (s.next.is_some(), s.drafter.is_some() || s.feed.len() > 1) {
                (true, true) => {
                    let before = s.cache.len() - n;
                    let r = s.advance_drafted(l, states, v, tok, metrics, stop_ids, seconds);
                    let keep = r.as_ref().map_or(n, |r| r.1);
                    s.cache.truncate(before + keep);
                    r.map(|r| r.0)
                }
                (false, _) if s.drafter.is_some() => {
                    s.advance(l.to_vec(), Some(states), tok, metrics, stop_ids)
                }
                _ => s.advance(l.to_vec(), None, tok, metrics, stop_ids),
            }
        })
        .collect();
    for (f, r) in forks {
        active.push(f);
        done.push(r);
    }
    for c in active.iter_mut().filter_map(|s| s.constraint.as_mut()) {
        let (busy, n) = c.take_busy();
        metrics.masks.fetch_add(n, Ordering::Relaxed);
        metrics
            .mask_us
            .fetch_add(busy.as_micros() as u64, Ordering::Relaxed);
    }
    done
}
