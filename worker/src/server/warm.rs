//! Polling between answers: the worker's network thread kept awake while requests come.

use std::sync::Arc;
use std::time::Duration;

/// Keeps the network thread polling its sockets for `spin` after each answer, so that the next
/// request of a decode (one per MoE layer, a dense pass apart) is read by a thread that is
/// already running rather than by one woken for it: waking a thread costs 10-30 us on a virtual
/// machine when its core sleeps, and a cross-core interrupt and a context switch when it does
/// not, paid by every round trip. A task on the worker's runtime yields in a loop until `spin`
/// has passed since the last answer (to the runtime, which then polls the sockets without
/// blocking in them, and now and then the core to any other thread that wants it); then it
/// waits for the next answer. The price is a core kept busy while requests come, which costs
/// power and takes time from other processes on the machine: `charm worker --spin-us 0` turns
/// it off, and workers started on loopback beside their coordinator have it off.
#[derive(Debug)]
pub struct Warm {
    base: std::time::Instant,
    /// Nanoseconds from `base` to the last answer.
    last: std::sync::atomic::AtomicU64,
    spin: Duration,
    answered: tokio::sync::Notify,
}

/// Polls of the sockets (a microsecond or two each) between two offers of the core to other
/// threads while a worker polls: often enough that a thread sharing the core waits a few tens of
/// microseconds at most, seldom enough that the offers (a system call each) add little to a
/// request's wait on a core of its own.
const YIELD_CORE_EVERY: u32 = 8;

/// How long a worker keeps its core awake after an answer by default, microseconds.
pub const WORKER_SPIN_US: u64 = 1000;

impl Warm {
    /// `None` when `spin` is zero. [`super::serve`] runs its polling task.
    pub fn new(spin: Duration) -> Option<Arc<Self>> {
        (!spin.is_zero()).then(|| {
            Arc::new(Self {
                base: std::time::Instant::now(),
                last: std::sync::atomic::AtomicU64::new(0),
                spin,
                answered: tokio::sync::Notify::new(),
            })
        })
    }

    /// Whether the last answer went out less than `spin` ago.
    fn warm(&self) -> bool {
        let since = (self.base.elapsed().as_nanos() as u64)
            .saturating_sub(self.last.load(std::sync::atomic::Ordering::Relaxed));
        since < self.spin.as_nanos() as u64
    }

    /// The polling task ([`super::serve`] runs it on the worker's runtime): after each answer, yields
    /// (so the runtime thread polls its sockets without blocking) until `spin` has passed since
    /// the last one.
    pub async fn poll(self: Arc<Self>) {
        loop {
            self.answered.notified().await;
            let mut polls = 0u32;
            while self.warm() {
                // now and then the core, to any other thread that wants it (on a machine shared
                // with other work, a coordinator among them); each time the runtime, which polls
                // the sockets
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(YIELD_CORE_EVERY) {
                    std::thread::yield_now();
                }
                tokio::task::yield_now().await;
            }
        }
    }

    /// An answer went out: poll from now.
    pub fn answered(&self) {
        self.last.store(
            self.base.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        self.answered.notify_one();
    }
}
