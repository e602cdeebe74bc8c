//! One generation in progress: its cache and sampler, the text sent so far, stop strings.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::job::{Event, Queued, TokenLogprob};
use super::metrics::Metrics;
use crate::decode::grammar::Constraint;
use crate::decode::sampling::{logprobs, Sampler};
use crate::decode::speculative::{verify, Adaptive, DraftOptions, Drafter};
use crate::decode::tokenizer::{TextStream, TextTokenizer};
use crate::model::cache::KvCache;
use crate::model::engine::Engine;

/// Most forced tokens fed as drafts in one step.
const MAX_FORCED: usize = 16;

/// One generation in progress.
pub(super) struct Sequence<'t> {
    pub(super) job: Queued,
    pub(super) cache: KvCache,
    pub(super) sampler: Sampler,
    /// The token chosen and not yet fed back (none before the prefill).
    pub(super) next: Option<u32>,
    pub(super) ids: Vec<u32>,
    /// The completion decoded as its tokens come, and how many of its bytes were sent.
    pub(super) stream: TextStream<'t>,
    pub(super) text: String,
    pub(super) sent: usize,
    pub(super) lps: Vec<TokenLogprob>,
    pub(super) started: Option<Instant>,
    /// Ended normally (not cancelled): its KV may serve a later request's prefix.
    pub(super) finished: bool,
    /// Entries of `lps` already sent with a piece of text.
    pub(super) lp_sent: usize,
    /// The persisted sequence its cache started from, and how many of its tokens.
    pub(super) origin: Option<(u64, usize)>,
    /// Prompt tokens whose KV was reused instead of computed.
    pub(super) reused: usize,
    /// Speculative decoding, when on: the drafter, the rule that sizes its drafts, the drafts of
    /// this step (fed after `next`), and the tokens drafted and accepted so far.
    pub(super) drafter: Option<(Drafter, Adaptive)>,
    pub(super) feed: Vec<u32>,
    pub(super) drafted: usize,
    pub(super) accepted: usize,
    /// The grammar the answer follows, if any; and whether this step's drafts are the tokens it
    /// forces (not the drafter's).
    pub(super) constraint: Option<Constraint>,
    pub(super) forced: bool,
}

impl<'t> Sequence<'t> {
    pub(super) fn new(
        e: &Engine,
        tok: &'t TextTokenizer,
        mut job: Queued,
        draft: DraftOptions,
    ) -> Self {
        let constraint = job.job.constraint.take();
        let spec = &e.model.spec;
        let mut cache = KvCache::new(spec);
        cache.reserve(job.prompt.len() + job.max_tokens + draft.max, spec);
        let drafter = (draft.max > 0)
            .then(|| Drafter::new(&e.model, draft.source).ok())
            .flatten()
            .map(|d| (d, Adaptive::new(draft.max, draft.adaptive)));
        Self::start(tok, job, cache, drafter, constraint)
    }

    /// A sequence of `job` that has generated nothing yet, from `cache`.
    fn start(
        tok: &'t TextTokenizer,
        job: Queued,
        cache: KvCache,
        drafter: Option<(Drafter, Adaptive)>,
        constraint: Option<Constraint>,
    ) -> Self {
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
            drafter,
            feed: Vec::new(),
            drafted: 0,
            accepted: 0,
            constraint,
            forced: false,
        }
    }

    /// The tokens this step feeds when decoding: the chosen token, then the drafts: the tokens
    /// the grammar forces after it when there are some (and `forced_drafts`), else the drafter's.
    pub(super) fn draft(
        &mut self,
        e: &Engine,
        forced_drafts: bool,
        metrics: &Metrics,
    ) -> Result<(), String> {
        let Some(next) = self.next else {
            return Ok(());
        };
        self.feed.clear();
        self.feed.push(next);
        self.forced = false;
        // (a token drafted past the last one wanted could not be kept)
        let left = self.job.max_tokens.saturating_sub(self.ids.len() + 1);
        if let Some(c) = self.constraint.as_mut().filter(|_| forced_drafts) {
            let mut f = c.forced();
            f.truncate(left.min(MAX_FORCED));
            if !f.is_empty() {
                metrics.forced.fetch_add(f.len() as u64, Ordering::Relaxed);
                self.feed.extend_from_slice(&f);
                self.forced = true;
                return Ok(());
            }
        }
        let Some((d, rule)) = &mut self.drafter else {
            return Ok(());
        };
        let want = rule.choose().min(left);
        if want == 0 {
            return Ok(());
        }
        // (only prompt lookup reads the context)
        let mut context = Vec::new();
        if d.reads_context() {
            context.reserve(self.job.prompt.len() + self.ids.len());
            context.extend_from_slice(&self.job.prompt);
            context.extend_from_slice(&self.ids);
        }
        let drafts = d
            .propose(&e.model, &context, want)
            .map_err(|e| e.to_string())?;
        self.feed.extend_from_slice(&drafts);
        Ok(())
    }

    /// Starts the grammar masks of this step's rows beside the forward step
    /// ([`Constraint::prepare`]): a decoding sequence's, after the token it feeds and after
    /// each of its drafts.
    pub(super) fn prepare_mask(&mut self) {
        if let (Some(_), Some(c)) = (self.next, self.constraint.as_mut()) {
            c.prepare(&self.feed[1..]);
        }
    }

    /// Choice `index` of the job, forked from this sequence once its prompt is read: the same
    /// KV (copied) and drafter, the sampler seeded with `seed + index`, its events on `tx`.
    pub(super) fn fork(
        &self,
        tok: &'t TextTokenizer,
        tx: tokio::sync::mpsc::UnboundedSender<Event>,
        index: u64,
    ) -> Self {
        let mut job = self.job.job.clone();
        job.params.seed = job.params.seed.wrapping_add(index);
        let queued = Queued {
            job,
            tx,
            forks: Vec::new(),
            queued: self.job.queued,
        };
        let mut f = Self::start(
            tok,
            queued,
            self.cache.clone(),
            self.drafter.clone(),
            self.constraint.clone(),
        );
        (f.origin, f.reused) = (self.origin, self.reused);
        f
    }

    /// Takes the logits of prompt rows `from..` (`[n, vocab]`): the log probability of the prompt
    /// token after each row. Once the last prompt token has its entry, sends them all
    /// ([`Event::Prompt`]) to this sequence and to the choices it will fork.
    pub(super) fn prompt_rows(&mut self, logits: &[f32], vocab: usize, from: usize) {
        let Some(top) = self.job.prompt_logprobs else {
            return;
        };
        let p = &self.job.prompt;
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            if let Some(&t) = p.get(from + r + 1) {
                let (lp, alt) = logprobs(row, t, top);
                self.lps.push((t, lp, alt));
            }
        }
        if self.lps.len() + 1 >= p.len() {
            let all = std::mem::take(&mut self.lps);
            for f in &self.job.forks {
                let _ = f.send(Event::Prompt(all.clone()));
            }
            let _ = self.job.tx.send(Event::Prompt(all));
        }
    }

    /// Hands the drafter the main model's states of prompt rows `from..from + n` (`[n, hidden]`),
    /// each with the prompt token after it; the last prompt position waits for the chosen token.
    pub(super) fn prompt_states(&mut self, from: usize, states: &[f32], h: usize) {
        let Some((d, _)) = &mut self.drafter else {
            return;
        };
        let p = &self.job.prompt;
        let n = states.len() / h;
        let whole = n.min((p.len() - 1).saturating_sub(from));
        d.push(&p[from + 1..from + 1 + whole], &states[..whole * h]);
    }

    /// Verifies this step's drafts against the logits of its rows (`[feed.len(), vocab]`, raw):
    /// keeps the drafts the sampler takes, then its own token; emits them as [`Self::advance`]
    /// does; hands the drafter the kept rows' states. Returns whether the sequence goes on, and
    /// the rows to keep in the cache.
    pub(super) fn advance_drafted(
        &mut self,
        logits: &[f32],
        states: &[f32],
        vocab: usize,
        tok: &TextTokenizer,
        metrics: &Metrics,
        stop_ids: &[u32],
        seconds: f64,
    ) -> Result<(bool, usize), String> {
        let drafts = self.feed[1..].to_vec();
        let (job, ids) = (&self.job, &self.ids);
        let mut constraint = self.constraint.as_mut();
        let mut failed = None;
        // the kept tokens after which the grammar was complete, if it was before the last
        let mut complete_at = None;
        let got = verify(&self.sampler, self.sampler.drawn(), &drafts, |i, kept| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            if !job.penalties.active() && constraint.is_none() {
                return Cow::Borrowed(row);
            }
            let mut l = row.to_vec();
            if job.penalties.active() {
                let history: Vec<u32> = ids.iter().chain(kept).copied().collect();
                job.penalties.apply(&mut l, &job.prompt, &history);
            }
            if let Some(c) = constraint.as_deref_mut() {
                // the grammar's state after the drafts kept so far
                let r = match i {
                    0 => Ok(()),
                    _ => c.accept(kept[i - 1]),
                };
                if c.finished() {
                    complete_at.get_or_insert(i);
                }
                if let Err(e) = r.and_then(|_| c.apply(&mut l)) {
                    failed.get_or_insert(e);
                }
            }
            Cow::Owned(l)
        });
        if let Some(c) = self.constraint.as_mut() {
            // (the masks and their time reach the metrics through `Constraint::take_busy`)
            if complete_at.is_none() {
                c.accept(got.next)?;
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let kept = got.accepted.len();
        self.sampler.advance(1 + kept as u64);
        if self.forced {
            metrics
                .forced_accepted
                .fetch_add(kept as u64, Ordering::Relaxed);
        } else {
            self.drafted += drafts.len();
            self.accepted += kept;
            metrics
                .drafted
                .fetch_add(drafts.len() as u64, Ordering::Relaxed);
            metrics.accepted.fetch_add(kept as u64, Ordering::Relaxed);
        }
        let forced = self.forced;
        if let Some((d, rule)) = &mut self.drafter {
            let mut after = got.accepted.clone();
            after.push(got.next);
            d.push(
                &after,
                &states[..(1 + kept) * (states.len() / self.feed.len())],
            );
            if !forced {
                rule.record(drafts.len(), kept, seconds);
                d.verified(drafts.len(), kept);
            }
            if rule.stopped() {
                // drafting never paid here: no drafter to keep in step either
                self.drafter = None;
            }
        }
        let mut tokens: Vec<u32> = got.accepted.iter().copied().chain([got.next]).collect();
        if let Some(i) = complete_at {
            // nothing may follow a complete grammar
            tokens.truncate(i);
        }
        for (i, &t) in tokens.iter().enumerate() {
            if let Some(top) = self.job.logprobs {
                let (lp, alt) = logprobs(&logits[i * vocab..(i + 1) * vocab], t, top);
                self.lps.push((t, lp, alt));
            }
            if !self.emit(t, tok, metrics, stop_ids)? {
                return Ok((false, 1 + kept));
            }
        }
        Ok((self.grammar_done(tok, metrics)?, 1 + kept))
    }

    /// Penalties, then the sampler; the log probabilities of the model's distribution when
    /// asked.
    pub(super) fn pick(&mut self, mut logits: Vec<f32>) -> Result<u32, String> {
        let raw = self.job.logprobs.map(|_| logits.clone());
        self.job
            .penalties
            .apply(&mut logits, &self.job.prompt, &self.ids);
        if let Some(c) = &mut self.constraint {
            c.apply(&mut logits)?;
        }
        let t = self.sampler.sample(&logits);
        if let Some(c) = &mut self.constraint {
            c.accept(t)?;
        }
        if let (Some(top), Some(raw)) = (self.job.logprobs, raw) {
            let (lp, alt) = logprobs(&raw, t, top);
            self.lps.push((t, lp, alt));
        }
        Ok(t)
    }

    /// Takes the logits after the sequence's last input (its whole prompt, or the token it fed
    /// back): picks the next token and sends text as it becomes final (whole UTF-8 characters,
    /// held back while it could still start a stop string). `Ok(false)` when the sequence is
    /// done or its client went away (its KV cache goes with it).
    pub(super) fn advance(
        &mut self,
        logits: Vec<f32>,
        last_state: Option<&[f32]>,
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
            if self.job.max_tokens == 0 {
                // only the prompt was wanted (its log probabilities)
                return self.finish(tok, "length", None, metrics);
            }
        }
        let next = self.pick(logits)?;
        if let Some((d, _)) = &mut self.drafter {
            // the prompt's last position, with the token now chosen after it
            if let Some(last) = last_state {
                d.push(&[next], last);
            }
        }
        if !self.emit(next, tok, metrics, stop_ids)? {
            return Ok(false);
        }
        self.grammar_done(tok, metrics)
    }

    /// Ends the sequence when its grammar is complete (nothing may follow); else it goes on.
    fn grammar_done(&mut self, tok: &TextTokenizer, metrics: &Metrics) -> Result<bool, String> {
        if self.constraint.as_ref().is_some_and(|c| c.finished()) {
            return self.finish(tok, "stop", None, metrics);
        }
        Ok(true)
    }

    /// Takes `next` as the sequence's next token: sends text as it becomes final (whole UTF-8
    /// characters, held back while it could still start a stop string). `Ok(false)` when the
    /// sequence is done or its client went away.
    fn emit(
        &mut self,
        next: u32,
        tok: &TextTokenizer,
        metrics: &Metrics,
        stop_ids: &[u32],
    ) -> Result<bool, String> {
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
            // (drafts stop short of max_tokens: this is the step's last token, and a grammar's
            // state is the one after it)
            let complete = self.constraint.as_ref().is_some_and(|c| c.finished());
            let why = if complete { "stop" } else { "length" };
            return self.finish(tok, why, None, metrics);
        }
        Ok(true)
    }

    /// Sends a piece of text, after the log probabilities of the tokens not yet covered when
    /// the request asked for them; false when the client went away.
    pub(super) fn send_text(&mut self, piece: String) -> bool {
        if self.job.logprobs.is_some() && self.lp_sent < self.lps.len() {
            let new = self.lps[self.lp_sent..].to_vec();
            self.lp_sent = self.lps.len();
            let _ = self.job.tx.send(Event::Logprobs(new));
        }
        self.job.tx.send(Event::Text(piece)).is_ok()
    }

    /// Sends the rest of the text and the end of the generation.
    pub(super) fn finish(
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
            drafted: self.drafted,
            accepted: self.accepted,
        });
        self.finished = true;
        Ok(false)
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
