//! The cluster's runtime, driven by the thread that waits for the workers.
//!
//! A layer request is a few packets each way. On a multi-threaded runtime each one crosses
//! threads twice on this side alone: the forward thread hands the request to a runtime thread,
//! which sends it, and that thread hands the answer back. Each hand-off wakes a sleeping thread,
//! tens of microseconds on a VM, more when the woken thread must wait for a core (on loopback a
//! bare QUIC echo between two multi-threaded runtimes takes three times as long as between two
//! single-threaded ones driven by the threads that wait).
//!
//! So the runtime here is single-threaded, and the thread that computes a step drives it
//! itself ([`Drive::block_on`]): `RemoteExperts::start` sends a layer's requests and its wait
//! blocks on the answers inside the runtime, where the packets are read, decrypted and combined
//! on the same thread.
//! While no step is running (an idle server, the gaps between requests), a thread of its own
//! drives it, for heartbeats, redials and shard fetches. A thread that starts expert work
//! claims the runtime; the idle driver gives it up at once and takes it back once no claimant
//! has used it for [`IDLE_AFTER`], so a claimant that stops calling never starves the
//! heartbeats for longer than that (a step's compute between two layers, at most).

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long the runtime stays with the threads that compute after their last wait before the
/// idle driver takes it back.
pub(super) const IDLE_AFTER: Duration = Duration::from_millis(20);

#[derive(Debug)]
struct State {
    /// A computing thread has the runtime (the idle driver has given it up).
    claimed: bool,
    /// Threads inside [`Drive::block_on`] now.
    busy: usize,
    /// When the last of them left.
    last: Instant,
    shutdown: bool,
}

/// A single-threaded runtime shared by the threads that compute steps and an idle driver.
#[derive(Debug)]
pub(super) struct Drive {
    rt: tokio::runtime::Runtime,
    state: Mutex<State>,
    /// Wakes the idle driver's thread, waiting while the runtime is claimed, when it must end.
    changed: Condvar,
    /// Ends the idle driver's hold on the runtime (it waits for this inside the runtime).
    claim: tokio::sync::Notify,
}

impl Drive {
    /// A runtime and its idle driver thread; the caller may use [`Drive::block_on`] at once.
    pub(super) fn start() -> Result<(Arc<Self>, std::thread::JoinHandle<()>), String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cluster runtime: {e}"))?;
        let d = Arc::new(Self {
            rt,
            state: Mutex::new(State {
                claimed: false,
                busy: 0,
                last: Instant::now(),
                shutdown: false,
            }),
            changed: Condvar::new(),
            claim: tokio::sync::Notify::new(),
        });
        let idle = d.clone();
        let thread = std::thread::Builder::new()
            .name("charm-cluster".into())
            .spawn(move || idle.idle_driver())
            .map_err(|e| format!("cluster runtime thread: {e}"))?;
        Ok((d, thread))
    }

    pub(super) fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.handle()
    }

    /// Runs `f` to completion on this thread, driving the runtime meanwhile (once the idle
    /// driver has let it go; until then `f` is polled here and the runtime's tasks run there).
    pub(super) fn block_on<F: Future>(&self, f: F) -> F::Output {
        let notify = {
            let mut s = self.state.lock().expect("drive lock");
            s.busy += 1;
            !std::mem::replace(&mut s.claimed, true)
        };
        if notify {
            self.claim.notify_one();
        }
        // (also when `f` panics: the idle driver must not wait for a claimant that is gone)
        struct Leave<'a>(&'a Mutex<State>);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
                s.busy -= 1;
                s.last = Instant::now();
            }
        }
        let _leave = Leave(&self.state);
        self.rt.block_on(f)
    }

    /// Stops the idle driver (for good) and waits for it.
    pub(super) fn stop(&self, thread: std::thread::JoinHandle<()>) {
        {
            let mut s = self.state.lock().expect("drive lock");
            s.shutdown = true;
            s.claimed = true;
        }
        self.claim.notify_one();
        self.changed.notify_all();
        let _ = thread.join();
    }

    /// Whether the idle driver must let the runtime go.
    fn yielding(&self) -> bool {
        let s = self.state.lock().expect("drive lock");
        s.claimed || s.shutdown
    }

    /// The idle driver: holds the runtime while nobody claims it, gives it up when a thread
    /// does, and takes it back once the claimants have been away for [`IDLE_AFTER`].
    fn idle_driver(&self) {
        loop {
            self.rt.block_on(async {
                loop {
                    // (a claim between the look and the wait leaves a permit: no wake is lost)
                    if self.yielding() {
                        return;
                    }
                    self.claim.notified().await;
                }
            });
            let mut s = self.state.lock().expect("drive lock");
            loop {
                if s.shutdown {
                    return;
                }
                if !s.claimed {
                    break;
                }
                let idle = s.last.elapsed();
                if s.busy == 0 && idle >= IDLE_AFTER {
                    s.claimed = false;
                    break;
                }
                let nap = IDLE_AFTER
                    .saturating_sub(idle)
                    .max(Duration::from_millis(1));
                s = self.changed.wait_timeout(s, nap).expect("drive lock").0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_run_for_a_claimant_and_for_the_idle_driver() {
        let (d, thread) = Drive::start().unwrap();
        // driven here: a spawned task and a timer complete inside the claimant's wait
        let h = d.handle().spawn(async { 7 });
        assert_eq!(d.block_on(h).unwrap(), 7);
        // nobody waits: after IDLE_AFTER the idle driver runs what is spawned
        let (tx, rx) = std::sync::mpsc::channel();
        d.handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the idle driver ran the task");
        // and gives the runtime back when claimed again
        assert_eq!(d.block_on(async { 3 }), 3);
        d.stop(thread);
    }

    #[test]
    fn a_claimant_that_panics_leaves_the_runtime_to_the_idle_driver() {
        let (d, thread) = Drive::start().unwrap();
        let d2 = d.clone();
        let failed = std::thread::spawn(move || {
            d2.block_on(async {
                panic!("the claimant fails");
            })
        })
        .join();
        assert!(failed.is_err());
        let (tx, rx) = std::sync::mpsc::channel();
        d.handle().spawn(async move { tx.send(()).unwrap() });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the idle driver took the runtime back");
        d.stop(thread);
    }

    #[test]
    fn concurrent_claimants_each_get_their_answer() {
        let (d, thread) = Drive::start().unwrap();
        let ts: Vec<_> = (0..4)
            .map(|i| {
                let d = d.clone();
                std::thread::spawn(move || {
                    (0..50)
                        .map(|j| {
                            d.block_on(async move {
                                tokio::task::yield_now().await;
                                i * 100 + j
                            })
                        })
                        .sum::<usize>()
                })
            })
            .collect();
        for (i, t) in ts.into_iter().enumerate() {
            assert_eq!(
                t.join().unwrap(),
                (0..50).map(|j| i * 100 + j).sum::<usize>()
            );
        }
        d.stop(thread);
    }
}
