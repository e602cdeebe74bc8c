//! Speculative decoding: a few tokens are drafted cheaply, then the main model verifies the
//! token it already chose and the drafts in one forward step, and keeps the longest run of
//! drafts that equal what it samples itself, plus its own next token.
//!
//! The output is exactly plain decoding's. Every kernel computes a row the same way whatever else
//! is in the step, so the logits at each position are bit-identical to a one-token step's; the
//! sampler's randomness is keyed by position ([`Sampler::sample_at`]), so the token sampled at a
//! position does not depend on how many were drafted; a draft is kept only when it equals that
//! token. After a rejection the main model's KV cache and the MTP layer's are cut back to the
//! accepted length ([`KvCache::truncate`]: no copy).
//!
//! Draft sources:
//! - [`MtpDrafter`]: the model's own MTP layer, chained for more than one token (its output state
//!   feeds the next draft where the main model's would go, as vLLM does with one MTP layer).
//! - [`lookup_drafts`]: prompt lookup, the tokens that followed the latest earlier occurrence of
//!   the context's longest recurring suffix: for models without MTP, and beside the MTP layer
//!   ([`SecondSource`]) where the text repeats itself.
//!
//! [`Adaptive`] picks how many to draft from the measured acceptance and the measured time of
//! each step size, including none.

use std::borrow::Cow;

use crate::decode::sampling::{argmax, Sampler};
use crate::model::cache::KvCache;
use crate::model::forward::{ForwardError, ForwardOptions};
use crate::model::Model;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The MTP layer where the model has one, with prompt lookup beside it
    /// ([`SecondSource`]); prompt lookup otherwise.
    Auto,
    Mtp,
    Lookup,
}

impl DraftSource {
    /// The name used on the command line and in statistics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Mtp => "mtp",
            Self::Lookup => "lookup",
        }
    }

    /// The source for `model`: [`Self::Auto`] resolved; an error for MTP on a model without it.
    pub fn resolve(self, model: &Model) -> Result<Self, ForwardError> {
        match (self, model.mtp.is_some()) {
            (Self::Auto, true) | (Self::Mtp, true) => Ok(Self::Mtp),
            (Self::Mtp, false) => Err(ForwardError::NoMtp),
            _ => Ok(Self::Lookup),
        }
    }
}

impl std::str::FromStr for DraftSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "mtp" => Ok(Self::Mtp),
            "lookup" => Ok(Self::Lookup),
            _ => Err(format!("unknown draft source `{s}` (auto, mtp or lookup)")),
        }
    }
}

/// How a generation drafts.
#[derive(Debug, Clone, Copy)]
pub struct DraftOptions {
    /// Most tokens drafted per step (0: no speculation).
    pub max: usize,
    pub source: DraftSource,
    /// Choose the number per step from measured acceptance and step times (else always `max`).
    pub adaptive: bool,
}

impl Default for DraftOptions {
    fn default() -> Self {
        Self {
            max: 0,
            source: DraftSource::Auto,
            adaptive: true,
        }
    }
}

/// What speculation did in a generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SpecStats {
    /// The source used (`mtp` or `lookup`).
    pub source: &'static str,
    /// Verify steps run (forward steps after the prefill).
    pub steps: usize,
    /// Tokens drafted, and of them accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Of those, drafted and accepted from prompt lookup.
    pub lookup_drafted: usize,
    pub lookup_accepted: usize,
    /// Steps per number of drafts (index: drafts in the step).
    pub steps_by_drafts: Vec<usize>,
}

impl SpecStats {
    /// Accepted drafts over drafted ones.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// Longest suffix prompt lookup matches, in tokens.
const MAX_NGRAM: usize = 4;

/// Prompt lookup: up to `k` tokens that followed the latest earlier occurrence of the longest
/// suffix of `context` (at most [`MAX_NGRAM`] tokens) that occurred before. Empty when no suffix
/// recurs.
pub fn lookup_drafts(context: &[u32], k: usize) -> Vec<u32> {
    lookup_match(context, k).1
}

/// [`lookup_drafts`] with the length of the suffix matched (0 where none recurs).
fn lookup_match(context: &[u32], k: usize) -> (usize, Vec<u32>) {
    let n = context.len();
    if k == 0 || n < 2 {
        return (0, Vec::new());
    }
    for g in (1..=MAX_NGRAM.min(n - 1)).rev() {
        let suffix = &context[n - g..];
        // the latest start before the suffix itself
        for s in (0..n - g).rev() {
            if &context[s..s + g] == suffix {
                let from = s + g;
                return (g, context[from..(from + k).min(n)].to_vec());
            }
        }
    }
    (0, Vec::new())
}

/// The MTP layer as a drafter for one sequence, with its own KV cache. Slot `j` of the MTP cache
/// takes the token at position `j + 1` and the main model's final-normed state at position `j`;
/// slots whose inputs are known are queued and run together when drafts are next wanted.
#[derive(Debug, Clone)]
pub struct MtpDrafter {
    cache: KvCache,
    /// Queued slots: tokens and the main model's states `[n, hidden]`.
    tokens: Vec<u32>,
    hidden: Vec<f32>,
}

impl MtpDrafter {
    pub fn new(model: &Model) -> Self {
        Self {
            cache: KvCache::with_layers(&model.spec, 1),
            tokens: Vec::new(),
            hidden: Vec::new(),
        }
    }

    /// Most slots kept queued while no drafts are asked for; past it the MTP layer starts again
    /// from the latest [`Self::RESTART`] slots.
    pub const MAX_QUEUE: usize = 64;
    /// Slots a restart keeps.
    pub const RESTART: usize = 16;

    /// Queues slots: `tokens[i]` follows the position whose main-model state is row `i` of
    /// `hidden`. A queue past [`Self::MAX_QUEUE`] (drafting paused for a while) is cut to its last
    /// [`Self::RESTART`] slots and the MTP layer's cache emptied: its attention then sees a
    /// shorter context, which costs only acceptance (rotary positions are relative), and catching
    /// up costs no more than that window.
    pub fn push(&mut self, tokens: &[u32], hidden: &[f32]) {
        self.tokens.extend_from_slice(tokens);
        self.hidden.extend_from_slice(hidden);
        if self.tokens.len() > Self::MAX_QUEUE {
            let h = self.hidden.len() / self.tokens.len();
            let cut = self.tokens.len() - Self::RESTART;
            self.tokens.drain(..cut);
            self.hidden.drain(..cut * h);
            self.cache.truncate(0);
        }
    }

    /// Slots run so far.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether no slot has run yet.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// Up to `k` drafts after the queued slots (which must end at the main model's newest
    /// position): the queued slots run together, then each further draft takes the previous
    /// draft and the MTP layer's own state. The chained slots are cut from the cache again.
    pub fn propose(&mut self, model: &Model, k: usize) -> Result<Vec<u32>, ForwardError> {
        if k == 0 || self.tokens.is_empty() {
            return Ok(Vec::new());
        }
        let (h, v) = (model.spec.hidden_size, model.spec.vocab_size);
        let (logits, hid) =
            model.mtp_forward_hidden(&self.tokens, &self.hidden, &mut self.cache)?;
        let n = self.tokens.len();
        self.tokens.clear();
        self.hidden.clear();
        let keep = self.cache.len();
        let mut d = argmax(&logits[(n - 1) * v..]) as u32;
        let mut state = hid[(n - 1) * h..].to_vec();
        let mut drafts = vec![d];
        while drafts.len() < k {
            let (l, s) = model.mtp_forward_hidden(&[d], &state, &mut self.cache)?;
            d = argmax(&l) as u32;
            state = s;
            drafts.push(d);
        }
        self.cache.truncate(keep);
        // the first slot stays run; its inputs must not be queued again
        Ok(drafts)
    }
}

/// Chooses how many tokens to draft: the number that maximises expected tokens per second, from
/// the acceptance seen so far (each draft taken as accepted with the same probability, given the
/// ones before it were) and the measured time of a step with that many drafts. Plain steps are
/// measured first ([`Self::WARMUP`]), then steps with the most drafts ([`Self::DRAFT_WARMUP`]);
/// sizes not measured are estimated on the line between those. The runner-up is tried again
/// after [`Self::REVISIT`] steps, then after twice as many each time the choice stays (back to
/// the start when it changes), since costs and acceptance drift. Drafting is chosen only when it promises [`Self::MARGIN`] times the plain
/// rate: where the two are close, timing noise would otherwise pick drafting as often as not, and
/// a wrong pick costs more than a right one gains. A step time more than half again the mean
/// so far counts as half again the mean (a page fault or a descheduled thread, not the cost of
/// the step). Once drafting has lost for [`Self::GIVE_UP`] steps in a row it stops for the
/// sequence ([`Self::stopped`]): keeping a drafter in step costs something even when it drafts
/// nothing.
#[derive(Debug, Clone)]
pub struct Adaptive {
    max: usize,
    adaptive: bool,
    accepted: f64,
    rejected: f64,
    /// Mean seconds of a step with `i` drafts (decayed), and the steps measured.
    time: Vec<Option<f64>>,
    count: Vec<u32>,
    steps: u64,
    /// The step of the next try of the runner-up, the wait after it, and the last choice.
    revisit_at: u64,
    wait: u64,
    last: usize,
    /// Steps in a row whose best choice was no drafts.
    plain_run: u64,
}

impl Adaptive {
    /// Try the runner-up after this many steps at first.
    pub const REVISIT: u64 = 32;
    /// Stop drafting after this many steps in a row where no drafts was best.
    pub const GIVE_UP: u64 = 128;
    /// Drafting must promise this many times the plain step's tokens per second.
    pub const MARGIN: f64 = 1.05;
    /// Plain steps measured before drafting is tried; the first steps of each size count by
    /// their fastest (a sequence's first steps of a kind pay one-time costs: allocations, page
    /// faults, cold caches, the MTP layer catching up on the prompt).
    pub const WARMUP: u32 = 4;
    /// Steps with the most drafts measured before the rule chooses (fewer than plain: where
    /// drafting does not pay, each costs up to a few plain steps).
    pub const DRAFT_WARMUP: u32 = 2;

    pub fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max,
            adaptive,
            accepted: 0.0,
            rejected: 0.0,
            time: vec![None; max + 1],
            count: vec![0; max + 1],
            steps: 0,
            revisit_at: Self::REVISIT,
            wait: Self::REVISIT,
            last: max,
            plain_run: 0,
        }
    }

    /// Whether drafting has stopped for good (no drafts was best for [`Self::GIVE_UP`] steps).
    pub fn stopped(&self) -> bool {
        self.adaptive && self.plain_run >= Self::GIVE_UP
    }

    /// The estimated chance that a draft is accepted (after the ones before it were).
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)
    }

    /// The time of a step with `k` drafts: measured, or on the line from the plain step to the
    /// largest measured one.
    fn estimate(&self, k: usize) -> Option<f64> {
        if let Some(t) = self.time[k] {
            return Some(t);
        }
        let t0 = self.time[0]?;
        let (j, tj) = (1..=self.max)
            .rev()
            .find_map(|j| self.time[j].map(|t| (j, t)))?;
        Some(t0 + (tj - t0) * k as f64 / j as f64)
    }

    /// Drafts to ask for in the next step.
    pub fn choose(&mut self) -> usize {
        if !self.adaptive || self.max == 0 {
            return self.max;
        }
        if self.stopped() {
            return 0;
        }
        if self.count[0] < Self::WARMUP {
            return 0;
        }
        if self.count[self.max] < Self::DRAFT_WARMUP {
            return self.max;
        }
        let a = self.acceptance();
        let rate = |k: usize| {
            let tokens: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
            tokens / self.estimate(k).unwrap_or(f64::INFINITY).max(1e-12)
        };
        let mut order: Vec<usize> = (0..=self.max).collect();
        // fastest first; among equals the fewer drafts; plain first unless beaten by the margin
        order.sort_by(|&x, &y| rate(y).total_cmp(&rate(x)).then(x.cmp(&y)));
        if rate(order[0]) < Self::MARGIN * rate(0) {
            let plain = order.iter().position(|&k| k == 0).expect("0 is a choice");
            order[..=plain].rotate_right(1);
        }
        let best = order[0];
        self.plain_run = if best == 0 { self.plain_run + 1 } else { 0 };
        if best != self.last {
            self.last = best;
            self.wait = Self::REVISIT;
            self.revisit_at = self.steps + self.wait;
        }
        if self.steps >= self.revisit_at {
            self.wait *= 2;
            self.revisit_at = self.steps + self.wait;
            return order[1];
        }
        best
    }

    /// Notes a step with `drafted` drafts of which `accepted` were kept, that took `seconds`.
    pub fn record(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        self.steps += 1;
        self.accepted += accepted as f64;
        if accepted < drafted {
            self.rejected += 1.0;
        }
        let k = drafted.min(self.max);
        self.count[k] += 1;
        self.time[k] = Some(match self.time[k] {
            Some(m) if self.count[k] <= Self::WARMUP => m.min(seconds),
            Some(m) => 0.8 * m + 0.2 * seconds.min(1.5 * m),
            None => seconds,
        });
    }
}

/// The drafter of one sequence.
#[derive(Debug, Clone)]
pub enum Drafter {
    /// The MTP layer; with [`DraftSource::Auto`] prompt lookup as a second source.
    Mtp(MtpDrafter, Option<SecondSource>),
    Lookup,
}

/// Prompt lookup beside the MTP layer: where the context's last [`SecondSource::MIN_MATCH`] or
/// more tokens occurred before (a quote, code being edited, a repeated list), the tokens that
/// followed them are drafted instead of the MTP layer's, for nothing, as long as they have been
/// accepted at least as often per draft as the MTP layer's.
#[derive(Debug, Clone, Default)]
pub struct SecondSource {
    /// Drafts proposed and accepted, per source: the MTP layer's, then prompt lookup's.
    mtp: (u64, u64),
    lookup: (u64, u64),
    /// Whether the outstanding proposal came from prompt lookup.
    last_lookup: bool,
}

impl SecondSource {
    /// Shortest recurring suffix, in tokens, whose continuation is drafted.
    pub const MIN_MATCH: usize = 3;

    /// Acceptance per draft, with one accepted and one rejected draft assumed.
    fn rate((drafted, accepted): (u64, u64)) -> f64 {
        (accepted + 1) as f64 / (drafted + 2) as f64
    }

    /// Whether prompt lookup's acceptance keeps up with the MTP layer's (else only the MTP
    /// layer drafts, and the context need not be gathered).
    pub fn in_favour(&self) -> bool {
        Self::rate(self.lookup) >= Self::rate(self.mtp)
    }

    /// Prompt lookup's drafts for this step, where its suffix match is long enough and it is
    /// [`Self::in_favour`]; `None`: the MTP layer drafts.
    pub fn propose(&mut self, context: &[u32], k: usize) -> Option<Vec<u32>> {
        self.last_lookup = false;
        if k == 0 || !self.in_favour() {
            return None;
        }
        let (matched, drafts) = lookup_match(context, k);
        if matched < Self::MIN_MATCH || drafts.is_empty() {
            return None;
        }
        self.last_lookup = true;
        Some(drafts)
    }

    /// Notes how many of the latest proposal's `drafted` drafts were accepted.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        let c = if self.last_lookup {
            &mut self.lookup
        } else {
            &mut self.mtp
        };
        c.0 += drafted as u64;
        c.1 += accepted as u64;
    }
}

impl Drafter {
    /// A drafter of `source` for `model`: the MTP layer where the model has one and `source`
    /// allows it (with prompt lookup beside it for [`DraftSource::Auto`]), else prompt lookup.
    pub fn new(model: &Model, source: DraftSource) -> Result<Self, ForwardError> {
        Ok(match (source, source.resolve(model)?) {
            (DraftSource::Auto, DraftSource::Mtp) => {
                Self::Mtp(MtpDrafter::new(model), Some(SecondSource::default()))
            }
            (_, DraftSource::Mtp) => Self::Mtp(MtpDrafter::new(model), None),
            _ => Self::Lookup,
        })
    }

    pub fn source(&self) -> DraftSource {
        match self {
            Self::Mtp(..) => DraftSource::Mtp,
            Self::Lookup => DraftSource::Lookup,
        }
    }

    /// Whether [`Self::propose`] reads its context this step (prompt lookup may draft).
    pub fn reads_context(&self) -> bool {
        match self {
            Self::Mtp(_, second) => second.as_ref().is_some_and(SecondSource::in_favour),
            Self::Lookup => true,
        }
    }

    /// Whether the latest proposal came from prompt lookup.
    pub fn last_from_lookup(&self) -> bool {
        match self {
            Self::Mtp(_, second) => second.as_ref().is_some_and(|s| s.last_lookup),
            Self::Lookup => true,
        }
    }

    /// Notes new main-model states: `tokens[i]` is the token after the position of row `i`.
    pub fn push(&mut self, tokens: &[u32], hidden: &[f32]) {
        if let Self::Mtp(m, _) = self {
            m.push(tokens, hidden);
        }
    }

    /// Notes how many of the latest proposal's `drafted` drafts were accepted.
    pub fn verified(&mut self, drafted: usize, accepted: usize) {
        if let Self::Mtp(_, Some(s)) = self {
            s.verified(drafted, accepted);
        }
    }

    /// Up to `k` drafts to follow `context` (prompt, completion, and the chosen next token; may
    /// be empty where [`Self::reads_context`] is false).
    pub fn propose(
        &mut self,
        model: &Model,
        context: &[u32],
        k: usize,
    ) -> Result<Vec<u32>, ForwardError> {
        match self {
            Self::Mtp(m, second) => match second.as_mut().and_then(|s| s.propose(context, k)) {
                Some(drafts) => Ok(drafts),
                None => m.propose(model, k),
            },
            Self::Lookup => Ok(lookup_drafts(context, k)),
        }
    }
}

/// What one verify step kept: the accepted drafts, then the model's own next token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub accepted: Vec<u32>,
    pub next: u32,
}

/// Takes the logits of a verify step (`[1 + drafts.len(), vocab]`: after the token already
/// chosen, then after each draft) and keeps the drafts that equal what `sampler` samples at their
/// positions (`index` is the sample index of the first row), then the sample after the last kept
/// one. `pick` gives a row's logits as the sampler should see them (penalties applied given the
/// kept drafts before it).
pub fn verify<'a>(
    sampler: &Sampler,
    index: u64,
    drafts: &[u32],
    mut pick: impl FnMut(usize, &[u32]) -> Cow<'a, [f32]>,
) -> Verified {
    let mut accepted = Vec::new();
    loop {
        let i = accepted.len();
        let row = pick(i, &accepted);
        let y = sampler.sample_at(&row, index + i as u64);
        if i < drafts.len() && drafts[i] == y {
            accepted.push(y);
            continue;
        }
        return Verified { accepted, next: y };
    }
}

/// Runs one verify step for a single sequence: `next` (chosen, not yet fed) and `drafts` through
/// the main model after `cache`; keeps what [`verify`] accepts, cuts the cache back to it, and
/// returns the kept tokens with the final-normed states of the rows that are kept (`[1 + kept,
/// hidden]`: the MTP drafter's next inputs).
pub fn verify_step(
    model: &Model,
    cache: &mut KvCache,
    sampler: &Sampler,
    next: u32,
    drafts: &[u32],
    opts: ForwardOptions,
) -> Result<(Verified, Vec<f32>), ForwardError> {
    let (h, v) = (model.spec.hidden_size, model.spec.vocab_size);
    let before = cache.len();
    let mut rows = Vec::with_capacity(1 + drafts.len());
    rows.push(next);
    rows.extend_from_slice(drafts);
    let normed = model.forward(&rows, cache, opts, None)?;
    let logits = model.logits(&normed, rows.len())?;
    let got = verify(sampler, sampler.drawn(), drafts, |i, _| {
        Cow::Borrowed(&logits[i * v..(i + 1) * v])
    });
    let kept = 1 + got.accepted.len();
    cache.truncate(before + kept);
    Ok((got, normed[..kept * h].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::sampling::SamplingParams;

    #[test]
    fn prompt_lookup_beside_mtp_drafts_long_matches_while_it_keeps_up() {
        let mut s = SecondSource::default();
        // a two-token match (8, 9) is left to the MTP layer, and so is a step without drafts
        assert_eq!(s.propose(&[8, 9, 4, 2, 8, 9], 2), None);
        assert_eq!(s.propose(&[7, 8, 9, 4, 5, 1, 7, 8, 9], 0), None);
        assert!(!s.last_lookup);
        // the last three tokens (7, 8, 9) occurred before, followed by 4, 5
        let c = [7, 8, 9, 4, 5, 1, 7, 8, 9];
        assert_eq!(s.propose(&c, 2), Some(vec![4, 5]));
        s.verified(2, 0);
        // lookup now accepted less often per draft than the MTP layer (no record yet)
        assert_eq!(s.propose(&c, 2), None);
        s.verified(4, 1);
        assert_eq!(s.propose(&c, 2), None);
        s.verified(6, 0);
        // the MTP layer fell behind: lookup drafts again
        assert_eq!(s.propose(&c, 2), Some(vec![4, 5]));
        assert_eq!((s.mtp, s.lookup), ((10, 1), (2, 0)));
    }

    #[test]
    fn lookup_proposes_what_followed_the_longest_recurring_suffix() {
        // "a b c d ... a b c" -> "d ..."
        let c = [1, 2, 3, 4, 5, 9, 1, 2, 3];
        assert_eq!(lookup_drafts(&c, 3), vec![4, 5, 9]);
        // the latest occurrence wins
        let c = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(lookup_drafts(&c, 2), vec![8, 1]);
        // a longer suffix beats a later shorter one
        let c = [5, 1, 2, 3, 6, 2, 3, 7, 1, 2, 3];
        assert_eq!(lookup_drafts(&c, 1), vec![6]);
        // nothing recurs; nothing asked
        assert!(lookup_drafts(&[1, 2, 3], 4).is_empty());
        assert!(lookup_drafts(&[1, 1], 0).is_empty());
        // the drafts stop at the end of the context
        assert_eq!(lookup_drafts(&[4, 4, 4], 5), vec![4]);
    }

    #[test]
    fn verify_keeps_the_drafts_the_sampler_would_take_and_its_own_next() {
        let s = Sampler::new(SamplingParams::default());
        // three positions whose greedy tokens are 2, 0, 1, then 3
        let rows = [
            [0.0, 0.0, 1.0, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [0.0, 1.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 1.0],
        ];
        let pick = |i: usize, _: &[u32]| Cow::Owned(rows[i].to_vec());
        for (drafts, want) in [
            (
                vec![2, 0, 1],
                Verified {
                    accepted: vec![2, 0, 1],
                    next: 3,
                },
            ),
            (
                vec![2, 0, 3],
                Verified {
                    accepted: vec![2, 0],
                    next: 1,
                },
            ),
            (
                vec![1, 0, 1],
                Verified {
                    accepted: vec![],
                    next: 2,
                },
            ),
            (
                vec![],
                Verified {
                    accepted: vec![],
                    next: 2,
                },
            ),
        ] {
            assert_eq!(verify(&s, 0, &drafts, pick), want, "{drafts:?}");
        }
    }

    #[test]
    fn sampled_verification_uses_each_positions_own_number() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: 11,
            ..Default::default()
        };
        let row: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let mut plain = Sampler::new(p);
        let seq: Vec<u32> = (0..6).map(|_| plain.sample(&row)).collect();
        // drafting the plain stream's tokens accepts them all; one wrong draft stops there and
        // the next token is the plain stream's
        let s = Sampler::new(p);
        let got = verify(&s, 0, &seq[..5], |_, _| Cow::Borrowed(&row[..]));
        assert_eq!((got.accepted.as_slice(), got.next), (&seq[..5], seq[5]));
        let mut wrong = seq[..5].to_vec();
        wrong[2] = (wrong[2] + 1) % 50;
        let got = verify(&s, 0, &wrong, |_, _| Cow::Borrowed(&row[..]));
        assert_eq!((got.accepted.as_slice(), got.next), (&seq[..2], seq[2]));
    }

    #[test]
    fn adaptive_drafting_measures_plain_and_most_then_prefers_the_fastest_per_token() {
        let mut a = Adaptive::new(3, true);
        let mut tried = Vec::new();
        for _ in 0..6 {
            let k = a.choose();
            tried.push(k);
            // drafts always accepted; a step costs 1 + 0.1 per draft
            a.record(k, k, 1.0 + 0.1 * k as f64);
        }
        assert_eq!(tried, vec![0, 0, 0, 0, 3, 3]);
        for _ in 0..10 {
            a.record(3, 3, 1.3);
        }
        assert_eq!(a.choose(), 3);
        assert!(!a.stopped());
        // nothing accepted and drafting costs: no drafts, the runner-up tried at longer and
        // longer intervals, then drafting stops
        let mut b = Adaptive::new(3, true);
        for _ in 0..Adaptive::WARMUP {
            b.record(0, 0, 1.0);
            b.record(3, 0, 2.5);
        }
        let mut picks = Vec::new();
        for _ in 0..(2 * Adaptive::GIVE_UP) {
            let k = b.choose();
            picks.push(k);
            b.record(k, 0, 1.0 + 0.5 * k as f64);
        }
        let tries: Vec<usize> = (0..picks.len()).filter(|&i| picks[i] > 0).collect();
        assert!((2..=4).contains(&tries.len()), "{tries:?}");
        assert!(
            tries
                .windows(2)
                .all(|w| w[1] - w[0] >= 2 * Adaptive::REVISIT as usize),
            "{tries:?}"
        );
        assert!(b.stopped());
        assert_eq!(b.choose(), 0);
        // drafting ahead by less than the margin: plain; ahead by more: drafting
        for (ahead, want) in [(1.03, 0), (1.10, 1)] {
            let mut c = Adaptive::new(1, true);
            // the draft always accepted: 1 + acceptance tokens expected from a drafted step
            let tokens = 1.0 + (4.0 + 1.0) / (4.0 + 2.0);
            for _ in 0..Adaptive::WARMUP {
                c.record(0, 0, 1.0);
                c.record(1, 1, tokens / ahead);
            }
            assert_eq!(c.choose(), want, "drafting {ahead}x as fast");
        }
        // the first steps count by their fastest (a slow first step does not make plain look
        // slow); after them one slow sample moves the estimate by at most a tenth
        let mut d = Adaptive::new(1, true);
        d.record(0, 0, 5.0);
        for _ in 1..Adaptive::WARMUP {
            d.record(0, 0, 1.0);
        }
        assert_eq!(d.estimate(0), Some(1.0));
        assert_eq!(d.choose(), 1, "plain measured: drafting is measured");
        d.record(0, 0, 100.0);
        assert!((d.estimate(0).unwrap() - 1.1).abs() < 1e-12);
        // not adaptive: always the most
        assert_eq!(Adaptive::new(4, false).choose(), 4);
    }
}
