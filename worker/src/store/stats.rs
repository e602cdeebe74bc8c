//! The I/O timeline the store records when asked (`charm generate --io-trace`).

use super::*;

/// One interval of the I/O timeline, in seconds since the store opened: a disk read of one
/// expert record (`read`, by a reader thread), the forward pass waiting for missing experts
/// (`wait`), or one layer's expert step from call to return (`experts`). Outside `wait` the
/// forward pass computes; `benches/io_phases.py` splits the disk's rate by that.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IoEvent {
    pub kind: &'static str,
    pub layer: usize,
    /// The expert read (`read` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert: Option<u32>,
    pub start_s: f64,
    pub end_s: f64,
    pub bytes: u64,
}

/// The I/O timeline being recorded, when asked for.
#[derive(Debug)]
pub(super) struct Timeline {
    pub(super) t0: Instant,
    pub(super) events: Mutex<Vec<IoEvent>>,
}

impl Timeline {
    pub(super) fn add(
        t: &Option<Timeline>,
        kind: &'static str,
        key: Key,
        expert: bool,
        start: Instant,
        bytes: u64,
    ) {
        if let Some(t) = t {
            let ev = IoEvent {
                kind,
                layer: key.0,
                expert: expert.then_some(key.1),
                start_s: start.saturating_duration_since(t.t0).as_secs_f64(),
                end_s: t.t0.elapsed().as_secs_f64(),
                bytes,
            };
            t.events.lock().unwrap_or_else(|p| p.into_inner()).push(ev);
        }
    }
}
