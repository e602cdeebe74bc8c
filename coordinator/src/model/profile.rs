//! Where a forward step's time goes, by phase: off unless a benchmark turns it on
//! ([`enable`]), then each phase of [`crate::model::forward`] adds its wall time to a counter
//! (one relaxed atomic load per phase when off). A phase timed inside another (the attention's
//! projections inside [`Phase::Attention`]) counts for itself only: the outer phase keeps its
//! own time less the inner ones', so a step's phases add up to its time, less what falls
//! between them.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The phases of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Embedding rows and rotary tables.
    Embed,
    /// A layer's attention outside the phases below: the input norm, rotary embeddings, the
    /// latent norm, cache appends.
    Attention,
    /// The attention's input projections (queries, keys and values, or the MLA latents).
    Projections,
    /// The DSA indexer: its keys, scores and top-k selection.
    Indexer,
    /// Attention over the cache: scores, softmax, weighted values (with MLA's `kv_b`
    /// absorption).
    Attend,
    /// The attention's output projection.
    OutProjection,
    /// Router lookahead predictions (a streaming store's prefetch).
    Lookahead,
    /// The post-attention norm and the router (logits, choice).
    Route,
    /// A dense layer's MLP, or a shared expert computed apart from the routed experts (an
    /// in-process expert store computes it beside them, in [`Phase::Routed`]).
    Shared,
    /// Waiting for the routed experts' sum (their compute, here or on workers; in process with
    /// the shared expert beside them).
    Routed,
    /// The residual additions.
    Residual,
    /// The final norm.
    FinalNorm,
    /// The head (logits).
    Head,
}

const PHASES: [Phase; 13] = [
    Phase::Embed,
    Phase::Attention,
    Phase::Projections,
    Phase::Indexer,
    Phase::Attend,
    Phase::OutProjection,
    Phase::Lookahead,
    Phase::Route,
    Phase::Shared,
    Phase::Routed,
    Phase::Residual,
    Phase::FinalNorm,
    Phase::Head,
];

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; PHASES.len()] = [const { AtomicU64::new(0) }; PHASES.len()];

thread_local! {
    /// Nanoseconds of the phases timed inside the one running on this thread.
    static INNER: Cell<u64> = const { Cell::new(0) };
}

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
    let outer = INNER.with(|c| c.replace(0));
    let t = Instant::now();
    let r = f();
    let all = t.elapsed().as_nanos() as u64;
    let inner = INNER.with(|c| c.replace(outer + all));
    let i = PHASES.iter().position(|&p| p == phase).unwrap_or(0);
    NANOS[i].fetch_add(all.saturating_sub(inner), Ordering::Relaxed);
    r
}
