//! The forward pass's fork-join pool: one short parallel loop per matmul, attention or expert
//! step, dozens per token.
//!
//! A decoded token runs a hundred or more such loops of a few to a few hundred microseconds
//! each. Rayon puts an idle worker to sleep within tens of microseconds and wakes it with a futex
//! per loop, which on a 2-core VM costs about as much as the loop's work. Here the helper threads
//! spin on a counter between loops and park only after about [`SPIN_ROUNDS`] rounds without one
//! (llama.cpp's thread pool does the same within a graph), so a helper is running when the next
//! loop of the same step starts.
//!
//! - Items are claimed one at a time from a shared counter by the calling thread and the helpers.
//!   Which thread runs an item never changes what the item computes: callers pass items whose
//!   results do not depend on the split.
//! - A loop started from inside an item (nested), from a thread while another thread's loop runs,
//!   or under a one-thread rayon pool (`ThreadPool::install`, how tests pin one thread) runs its
//!   items in order on the calling thread.
//! - A panicking item is finished as a panic of the call, after every other item has run.
//!
//! A task handed over with [`beside`] runs on a helper that has no loop item to run (between
//! the loops of a step, where one thread does the serial work), or on the caller when it asks
//! for the result first: work that must not wait for the step, such as the next token's grammar
//! mask, fills the helpers' idle time instead of a core of its own.
//!
//! Threads: `RAYON_NUM_THREADS` if set, else one per core, or [`set_threads`] before first use.

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Rounds a helper spins (each a `spin_loop` hint and a look at the loop counter) after a loop
/// before it parks: some 100-300 microseconds, longer than the gaps between the loops of one
/// forward step, short against the gaps between steps of an idle server.
const SPIN_ROUNDS: u32 = 1 << 13;

/// One loop: items `0..count` of `f`, claimed through `next`.
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    count: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

// SAFETY: `f` is `Sync` and outlives every access (the caller waits for all items and for every
// helper to leave the job before returning).
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs items until none are left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= self.count {
                return;
            }
            // SAFETY: see `Job`'s `Sync`.
            let f = unsafe { &*self.f };
            let r = in_item(|| catch_unwind(AssertUnwindSafe(|| f(i))));
            if let Err(p) = r {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Pool {
    /// Helper threads (the caller makes one more).
    helpers: usize,
    /// Bumped when a loop is published.
    epoch: AtomicUsize,
    /// The running loop (null between loops).
    job: AtomicPtr<Job>,
    /// Helpers between looking at `job` and leaving it.
    inside: AtomicUsize,
    /// A loop is running (one caller at a time).
    busy: AtomicBool,
    sleepers: AtomicUsize,
    /// Helpers park now instead of spinning: set by [`rest`], cleared by the next loop.
    resting: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
    /// Tasks handed over with [`beside`], and how many are queued.
    side: Mutex<VecDeque<Arc<dyn SideTask>>>,
    side_queued: AtomicUsize,
}

static THREADS: OnceLock<usize> = OnceLock::new();
static POOL: OnceLock<&'static Pool> = OnceLock::new();

thread_local! {
    static IN_ITEM: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` marked as inside an item (loops it starts run inline), unmarking also on unwind.
fn in_item<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            IN_ITEM.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(IN_ITEM.with(|c| c.replace(true)));
    f()
}

/// Sets the pool's thread count (the caller included) before its first use; `false` if it was
/// already set.
pub fn set_threads(n: usize) -> bool {
    THREADS.set(n.max(1)).is_ok()
}

/// The pool's thread count, the caller included.
pub fn threads() -> usize {
    *THREADS.get_or_init(|| {
        std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    })
}

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let p: &'static Pool = Box::leak(Box::new(Pool {
            helpers: threads() - 1,
            epoch: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            inside: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            resting: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
            side: Mutex::new(VecDeque::new()),
            side_queued: AtomicUsize::new(0),
        }));
        let mut started = 0;
        for i in 0..p.helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("charm-par-{i}"))
                .spawn(move || p.helper());
            started += usize::from(spawned.is_ok());
        }
        if started < p.helpers {
            // fewer threads than asked: the loops still finish (the caller claims every item
            // nobody else takes), only slower
            eprintln!(
                "warning: started {started} of {} compute threads",
                p.helpers
            );
        }
        p
    })
}

impl Pool {
    fn helper(&self) {
        let mut seen = self.epoch.load(SeqCst);
        loop {
            let mut spins = 0;
            while self.epoch.load(SeqCst) == seen {
                if self.side_queued.load(SeqCst) > 0 {
                    self.run_side();
                    continue;
                }
                spins += 1;
                if spins < SPIN_ROUNDS && !self.resting.load(SeqCst) {
                    std::hint::spin_loop();
                    continue;
                }
                let mut g = self.park.lock().unwrap_or_else(|e| e.into_inner());
                self.sleepers.fetch_add(1, SeqCst);
                while self.epoch.load(SeqCst) == seen && self.side_queued.load(SeqCst) == 0 {
                    g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                self.sleepers.fetch_sub(1, SeqCst);
                spins = 0;
            }
            seen = self.epoch.load(SeqCst);
            self.inside.fetch_add(1, SeqCst);
            let j = self.job.load(SeqCst);
            if !j.is_null() {
                // SAFETY: a non-null `job` seen after entering `inside` stays alive until this
                // helper leaves `inside` (the caller nulls `job`, then waits for `inside` to be 0).
                unsafe { &*j }.work();
            }
            self.inside.fetch_sub(1, SeqCst);
        }
    }

    /// Runs the oldest task handed over with [`beside`], if another helper has not taken it.
    fn run_side(&self) {
        let task = self
            .side
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        if let Some(t) = task {
            self.side_queued.fetch_sub(1, SeqCst);
            in_item(|| t.run());
        }
    }

    fn wake_sleepers(&self) {
        if self.sleepers.load(SeqCst) > 0 {
            let _g = self.park.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }
}

/// Runs `f(i)` for every `i < count`, spread over the pool (see the module docs); returns when
/// all have run.
pub fn for_each(count: usize, f: impl Fn(usize) + Sync) {
    let Some(p) = claim(count) else {
        // as on the pool: a panicking item does not stop the others; the first panic is the
        // call's, after all have run
        let mut first = None;
        in_item(|| {
            for i in 0..count {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                    first.get_or_insert(p);
                }
            }
        });
        if let Some(p) = first {
            resume_unwind(p);
        }
        return;
    };
    let f: &(dyn Fn(usize) + Sync) = &f;
    let job = Job {
        // SAFETY: only the lifetime is erased; `job` is unpublished and every helper has left
        // it before this function returns.
        f: unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                f,
            )
        },
        count,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panic: Mutex::new(None),
    };
    p.job.store(&job as *const Job as *mut Job, SeqCst);
    p.resting.store(false, SeqCst);
    p.epoch.fetch_add(1, SeqCst);
    p.wake_sleepers();
    job.work();
    wait_until(|| job.done.load(SeqCst) == count);
    p.job.store(std::ptr::null_mut(), SeqCst);
    wait_until(|| p.inside.load(SeqCst) == 0);
    p.busy.store(false, SeqCst);
    let panic = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(payload) = panic {
        resume_unwind(payload);
    }
}

/// Tells the helpers that no loop comes soon (the caller is about to wait for a network round
/// trip or a disk read): they park now instead of spinning out their rounds, leaving the cores to
/// the threads that do that work (on a machine whose cores a worker process or the network
/// stack shares, a spinning helper delays them). The next loop wakes them as usual. A no-op while
/// another thread's loop runs (a worker computing two requests at once): its next loop is near.
pub fn rest() {
    if let Some(p) = POOL.get().filter(|p| !p.busy.load(SeqCst)) {
        p.resting.store(true, SeqCst);
    }
}

/// A task handed over with [`beside`]: its result once [`Beside::join`] asks for it.
pub struct Beside<T> {
    slot: Arc<Slot<T>>,
}

type SideFn<T> = Box<dyn FnOnce() -> T + Send>;

enum SideState<T> {
    Waiting(SideFn<T>),
    Running,
    Done(std::thread::Result<T>),
    /// Joined or dropped.
    Gone,
}

struct Slot<T> {
    state: Mutex<SideState<T>>,
}

trait SideTask: Send + Sync {
    /// Runs the task unless it has been started, joined or dropped already.
    fn run(&self);
}

impl<T: Send> SideTask for Slot<T> {
    fn run(&self) {
        let f = {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *st, SideState::Running) {
                SideState::Waiting(f) => f,
                other => {
                    *st = other;
                    return;
                }
            }
        };
        let r = catch_unwind(AssertUnwindSafe(f));
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*st, SideState::Running) {
            *st = SideState::Done(r);
        }
    }
}

/// Hands `f` to the pool's helpers: the first that is idle (between the loops of the caller's
/// step, or parked) runs it, marked as inside an item (loops it starts run inline). Where the
/// pool has no helpers, `f` waits for [`Beside::join`], which runs it on the joining thread.
pub fn beside<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Beside<T> {
    let slot = Arc::new(Slot {
        state: Mutex::new(SideState::Waiting(Box::new(f) as SideFn<T>)),
    });
    let p = POOL.get().copied().or_else(|| (threads() > 1).then(pool));
    if let Some(p) = p.filter(|p| p.helpers > 0) {
        p.side
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(slot.clone());
        p.side_queued.fetch_add(1, SeqCst);
        p.wake_sleepers();
    }
    Beside { slot }
}

impl<T> std::fmt::Debug for Beside<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Beside")
    }
}

impl<T: Send> Beside<T> {
    /// The task's result: run here if no helper has started it, else waited for. A panic in the
    /// task is resumed here.
    pub fn join(self) -> T {
        let taken = {
            let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
            match std::mem::replace(&mut *st, SideState::Gone) {
                SideState::Waiting(f) => Some(f),
                other => {
                    *st = other;
                    None
                }
            }
        };
        let r = match taken {
            Some(f) => catch_unwind(AssertUnwindSafe(f)),
            None => {
                // a helper runs it: wait for its result (only this handle takes it from Done)
                let state = || self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
                wait_until(|| matches!(*state(), SideState::Done(_)));
                match std::mem::replace(&mut *state(), SideState::Gone) {
                    SideState::Done(r) => r,
                    _ => unreachable!("waited for Done"),
                }
            }
        };
        r.unwrap_or_else(|p| resume_unwind(p))
    }

    /// Whether a helper has finished the task.
    pub fn is_done(&self) -> bool {
        matches!(
            *self.slot.state.lock().unwrap_or_else(|e| e.into_inner()),
            SideState::Done(_)
        )
    }
}

impl<T> Drop for Beside<T> {
    /// A task nobody started is dropped unrun; one running finishes on its helper, unread.
    fn drop(&mut self) {
        let mut st = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*st, SideState::Running) {
            *st = SideState::Gone;
        }
    }
}

/// The pool, reserved for one loop of `count` items, or `None` where the loop runs inline: one
/// item, a nested loop, one thread (the pool's or the installed rayon pool's), or another
/// caller's loop running.
fn claim(count: usize) -> Option<&'static Pool> {
    if count <= 1
        || IN_ITEM.with(|c| c.get())
        || threads() == 1
        || rayon::current_num_threads() == 1
    {
        return None;
    }
    let p = pool();
    (p.helpers > 0 && p.busy.compare_exchange(false, true, SeqCst, SeqCst).is_ok()).then_some(p)
}

/// Spins until `done()`, yielding the core now and then (a helper holding an item may have been
/// descheduled).
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// A raw pointer the items of one loop share (each touches a disjoint part).
struct Shared<T>(*mut T);
// SAFETY: used only for disjoint chunks of one slice within one `for_each`.
unsafe impl<T: Send> Sync for Shared<T> {}

/// Runs `f(i, chunk)` for every `chunk_len`-long chunk of `data` (the last may be shorter), in
/// parallel as [`for_each`].
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    assert!(chunk_len > 0, "chunks of zero elements");
    let len = data.len();
    let base = Shared(data.as_mut_ptr());
    let base = &base;
    for_each(len.div_ceil(chunk_len), |i| {
        let start = i * chunk_len;
        let end = (start + chunk_len).min(len);
        // SAFETY: chunk `i` is `start..end` of `data`, disjoint from every other item's chunk,
        // and `data` is borrowed mutably for the whole loop.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(i, chunk);
    });
}

/// `(0..count).map(f)` computed in parallel as [`for_each`], in order.
pub fn map<R: Send>(count: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..count).map(|_| None).collect();
    for_each_chunk_mut(&mut out, 1, |i, slot| slot[0] = Some(f(i)));
    out.into_iter()
        .map(|r| r.expect("every item ran"))
        .collect()
}

/// [`map`] for items that start loops of their own, each big enough to spread over every thread
/// (an expert's matmuls): whole items run side by side for as many rounds as fill every thread,
/// then the `count % threads` left over run one after another, each with the whole pool for its
/// own loops. With 3 items on 2 threads, [`map`] takes two items' time; this, one and a half.
/// Results are [`map`]'s: an item's result never depends on where its loops run.
pub fn map_spread<R: Send>(count: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let inline = IN_ITEM.with(|c| c.get()) || threads() == 1 || rayon::current_num_threads() == 1;
    let width = if inline { 1 } else { threads() };
    let whole = count - count % width;
    let mut out = map(whole, &f);
    out.extend((whole..count).map(&f));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_also_nested_and_from_many_threads() {
        let hits: Vec<AtomicUsize> = (0..30).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for t in 0..3 {
                let hits = &hits;
                s.spawn(move || {
                    for _ in 0..200 {
                        for_each(5, |i| {
                            // nested loops run inline and still cover their items
                            for_each(2, |k| {
                                hits[t * 10 + i * 2 + k].fetch_add(1, SeqCst);
                            });
                        });
                    }
                });
            }
        });
        for (i, h) in hits.iter().enumerate() {
            assert_eq!(h.load(SeqCst), 200, "thread {} item {}", i / 10, i % 10);
        }
    }

    #[test]
    fn loops_after_a_rest_run_every_item_once() {
        // (a parked helper that took an item and never ran it, or a loop waiting on helpers
        // that never wake, fails or hangs here; whether a helper ran any item is not checked)
        for round in 0..50 {
            rest();
            if round % 10 == 0 {
                // long enough for a helper to have parked
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let hits: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
            for_each(64, |i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "round {round}");
        }
    }

    #[test]
    fn chunks_and_map_cover_the_input_in_order() {
        let mut v = vec![0usize; 1003];
        for_each_chunk_mut(&mut v, 10, |c, chunk| {
            for (k, x) in chunk.iter_mut().enumerate() {
                *x = c * 10 + k;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| i == x));
        assert_eq!(map(7, |i| i * i), vec![0, 1, 4, 9, 16, 25, 36]);
        assert!(map(0, |i| i).is_empty());
    }

    #[test]
    fn map_spread_is_map_and_runs_the_leftover_items_outside_the_loop() {
        let t = threads();
        for count in 0..3 * t + 2 {
            let inner: Vec<AtomicUsize> = (0..count * 4).map(|_| AtomicUsize::new(0)).collect();
            let got = map_spread(count, |i| {
                for_each(4, |k| {
                    inner[i * 4 + k].fetch_add(1, SeqCst);
                });
                (i * i, IN_ITEM.with(|c| c.get()))
            });
            let squares: Vec<usize> = got.iter().map(|g| g.0).collect();
            assert_eq!(squares, (0..count).map(|i| i * i).collect::<Vec<_>>());
            assert!(inner.iter().all(|h| h.load(SeqCst) == 1), "count {count}");
            // the last `count % t` items ran outside any loop, so their own loops may spread
            for (i, g) in got.iter().enumerate() {
                assert_eq!(!g.1, i >= count - count % t, "count {count}, item {i}");
            }
        }
    }

    #[test]
    fn a_panicking_item_panics_the_call_after_the_others_ran() {
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            for_each(64, |i| {
                ran.fetch_add(1, SeqCst);
                assert!(i != 17, "item 17 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(SeqCst), 64);
        // the same where the loop runs inline (a one-thread rayon pool; also what happens when
        // another thread's loop holds the pool)
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        ran.store(0, SeqCst);
        let r = one.install(|| {
            catch_unwind(AssertUnwindSafe(|| {
                for_each(64, |i| {
                    ran.fetch_add(1, SeqCst);
                    assert!(i != 17, "item 17 fails");
                })
            }))
        });
        assert!(r.is_err());
        assert_eq!(ran.load(SeqCst), 64);
        // the pool still works afterwards
        assert_eq!(map(4, |i| i + 1), vec![1, 2, 3, 4]);
    }

    #[test]
    fn tasks_handed_beside_run_once_and_join_with_their_result() {
        let runs = Arc::new(AtomicUsize::new(0));
        for round in 0..200 {
            let r = runs.clone();
            let t = beside(move || {
                r.fetch_add(1, SeqCst);
                round * 3
            });
            if round % 3 == 0 {
                // a loop of the caller's beside the task
                assert_eq!(map(16, |i| i).len(), 16);
            }
            assert_eq!(t.join(), round * 3);
        }
        assert_eq!(runs.load(SeqCst), 200);
        // a task dropped before a helper started it never runs (the helper finds it gone)
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        let slot = Arc::new(Slot {
            state: Mutex::new(SideState::Waiting(Box::new(move || {
                r.fetch_add(1, SeqCst);
            }) as SideFn<()>)),
        });
        drop(Beside { slot: slot.clone() });
        slot.run();
        assert_eq!(ran.load(SeqCst), 0);
        // a panic in the task is the joiner's
        let t = beside(|| -> usize { panic!("side task fails") });
        assert!(catch_unwind(AssertUnwindSafe(|| t.join())).is_err());
        // and the helpers still take tasks and loops afterwards
        assert_eq!(beside(|| 7).join(), 7);
        if threads() > 1 {
            // with helpers, a task runs without anyone joining it (also after they parked)
            rest();
            std::thread::sleep(std::time::Duration::from_millis(5));
            let t = beside(|| 11);
            let start = std::time::Instant::now();
            while !t.is_done() {
                assert!(start.elapsed().as_secs() < 30, "no helper took the task");
                std::thread::yield_now();
            }
            assert_eq!(t.join(), 11);
        }
        assert_eq!(map(4, |i| i + 1), vec![1, 2, 3, 4]);
    }
}
