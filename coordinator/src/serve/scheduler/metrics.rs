//! The scheduler's counters.

use std::sync::atomic::AtomicU64;

/// Counters the scheduler keeps and `/metrics` reports.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub rejected: AtomicU64,
    /// Generations stopped because their client went away (a closed connection, a stop button).
    pub cancelled: AtomicU64,
    pub tokens: AtomicU64,
    pub queued: AtomicU64,
    /// Sequences in the last forward step, and the most there were in one.
    pub active: AtomicU64,
    pub active_peak: AtomicU64,
    /// Rows (tokens) of the last forward step; steps run and rows they took, in all.
    pub batch_rows: AtomicU64,
    pub steps: AtomicU64,
    pub rows: AtomicU64,
    /// Bytes of the conversation KV log on disk.
    pub kv_log_bytes: AtomicU64,
    /// The expert executor's counters: uses served from memory, and those that waited.
    pub expert_hits: AtomicU64,
    pub expert_misses: AtomicU64,
    pub ttft_us: AtomicU64,
    pub ttft_n: AtomicU64,
    /// Prompt tokens whose KV came from the prefix cache instead of a prefill.
    pub reused: AtomicU64,
    /// Speculative decoding: tokens drafted, and of them accepted.
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    pub decode_us: AtomicU64,
    /// Connections closed on arrival because the cap on open ones was reached.
    pub connections_refused: AtomicU64,
    /// Constrained decoding: grammar masks applied and the microseconds they added to the steps
    /// (computing and applying them, taking tokens); tokens the
    /// grammar forced and fed as drafts, and of them accepted.
    pub masks: AtomicU64,
    pub mask_us: AtomicU64,
    pub forced: AtomicU64,
    pub forced_accepted: AtomicU64,
}
