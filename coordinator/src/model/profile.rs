//! Where a forward step's time goes, by phase: off unless a benchmark turns it on
//! ([`enable`]), then each phase of [`crate::model::forward`] adds its wall time to a counter
//! (one relaxed atomic load per phase when off). Phases nest nowhere: a step's phases add up to
//! its time, less what falls between them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The phases of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Embedding rows and rotary tables.
    Embed,
    /// A layer's input norm, projections, attention over the cache and output projection.
    Attention,
    /// Router lookahead predictions (a streaming store's prefetch).
    Lookahead,
    /// The post-attention norm and the router (logits, choice).
    Route,
    /// The shared expert, or a dense layer's MLP.
    Shared,
    /// Waiting for the routed experts' sum (their compute, here or on workers).
    Routed,
    /// The residual additions.
    Residual,
    /// The final norm.
    FinalNorm,
    /// The head (logits).
    Head,
}

const PHASES: [Phase; 9] = [
    Phase::Embed,
    Phase::Attention,
    Phase::Lookahead,
    Phase::Route,
    Phase::Shared,
    Phase::Routed,
    Phase::Residual,
    Phase::FinalNorm,
    Phase::Head,
];

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];

/// Turns the counters on or off (they keep their sums).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// The sums since the last call, seconds per phase, and resets them.
pub fn take() -> Vec<(Phase, f64)> {
    PHASES
        .iter()
        .zip(&NANOS)
        .map(|(&p, n)| (p, n.swap(0, Ordering::Relaxed) as f64 / 1e9))
        .collect()
}

/// Runs `f`, adding its time to `phase` when the counters are on.
#[inline]
pub fn timed<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let t = Instant::now();
    let r = f();
    let i = PHASES.iter().position(|&p| p == phase).unwrap_or(0);
    NANOS[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    r
}
