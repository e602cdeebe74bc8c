//! A job of the scheduler, the events it sends back, and its place in the queue.

use std::time::Instant;

use tokio::sync::mpsc;

use crate::decode::grammar::Constraint;
use crate::decode::sampling::{Penalties, SamplingParams};

/// A generated token, its log probability, and the most likely alternatives with theirs.
pub type TokenLogprob = (u32, f32, Vec<(u32, f32)>);

/// What a generation sends back as it runs.
#[derive(Debug)]
pub enum Event {
    Text(String),
    /// The log probabilities of the tokens behind the next `Text` (streams that asked for them).
    Logprobs(Vec<TokenLogprob>),
    /// The prompt's log probabilities (jobs that asked, [`Job::prompt_logprobs`]), once the
    /// prompt is read and before any text: one entry per prompt token after the first, each
    /// from the model's distribution at the position before it.
    Prompt(Vec<TokenLogprob>),
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
        /// Speculative decoding: tokens drafted, and of them accepted.
        drafted: usize,
        accepted: usize,
    },
    Failed(String),
}

/// One generation asked of the scheduler, whichever API it came through.
#[derive(Debug, Clone, Default)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub penalties: Penalties,
    /// Log probabilities to report: of the chosen token and this many alternatives.
    pub logprobs: Option<usize>,
    pub stop: Vec<String>,
    /// Go on past the end-of-sequence tokens.
    pub ignore_eos: bool,
    /// The log probabilities of the prompt's tokens, each with this many alternatives
    /// ([`Event::Prompt`]). The prompt is then computed in full (no reused prefix KV).
    pub prompt_logprobs: Option<usize>,
    /// The grammar every choice's answer follows (constrained decoding), if any.
    pub constraint: Option<Constraint>,
    /// Choices sampled from one prefill (0 or 1: one). Choice `i` samples with `seed + i`
    /// and forks the prompt's KV when the prompt is read (a copy of the cache: its bytes per
    /// token times the prompt's tokens, per extra choice).
    pub n: usize,
}

/// A job in the queue: where its events go and when it came.
#[derive(Debug)]
pub(super) struct Queued {
    pub(super) job: Job,
    pub(super) tx: mpsc::UnboundedSender<Event>,
    /// Where the events of choices 1.. go (forked from this sequence when its prompt is read).
    pub(super) forks: Vec<mpsc::UnboundedSender<Event>>,
    pub(super) queued: Instant,
}

impl Queued {
    /// Whether every client of the job went away.
    pub(super) fn gone(&self) -> bool {
        self.tx.is_closed() && self.forks.iter().all(|f| f.is_closed())
    }
}

impl std::ops::Deref for Queued {
    type Target = Job;
    fn deref(&self) -> &Job {
        &self.job
    }
}
