//! The cache policy: which expert to evict, what to admit, which experts stay pinned, and how
//! router predictions become queued read-aheads.

use super::*;

/// How the store takes router predictions (its disk tuning).
///
/// Of a token's `k` lookahead predictions (its router's choices on the layer's input, best
/// first) the first 5/8 are read as soon as there is room, the rest only while the disk idles. On
/// the synthetic GLM-5.2 model (top-8) ranks 1-4 were right 95-100% of the time, rank 5 83%, ranks
/// 6-8 62-68%: read eagerly, those made over half of the wasted bytes whenever an expert cache left
/// the disk time (1.3 of 7.0 GB with a 4 GiB budget; 0.6 reading only the first 5 eagerly).
///
/// Early guesses at the next MoE layer keep a quarter of each token's choices (the lower ranks,
/// mostly wrong guesses with an expert cache, only added wasted reads) and are made only for
/// steps of at most 4 tokens: a prefill's own lookahead already covers most of what it reads, and
/// guessing there was measured to slow it (8% with a 4 GiB expert cache, five alternating runs).
pub const LOOKAHEAD: LookaheadPolicy = LookaheadPolicy {
    sure_num: 5,
    sure_den: 8,
    early_max_tokens: 4,
    early_rank_div: 4,
};

impl Inner {
    pub(super) fn score(st: &State, k: &Key) -> f64 {
        st.freq.get(k).copied().unwrap_or(0.0)
    }

    /// Whether cached expert `k` may be evicted now: admitted (not a staged read-ahead), not
    /// pinned, not in use by a step.
    pub(super) fn evictable(st: &State, k: &Key, e: &Entry) -> bool {
        e.in_use == 0 && !e.transient && !st.pinned.contains(k)
    }

    /// The entry to evict: with `staged_first`, a staged read-ahead (oldest first); otherwise,
    /// or when there is none, the cached expert of lowest (frequency, last use).
    pub(super) fn victim(st: &State, staged_first: bool) -> Option<Key> {
        if staged_first {
            let staged = st
                .entries
                .iter()
                .filter(|(_, e)| e.transient && e.in_use == 0)
                .min_by_key(|(_, e)| e.last)
                .map(|(k, _)| *k);
            if staged.is_some() {
                return staged;
            }
        }
        st.entries
            .iter()
            .filter(|(k, e)| Self::evictable(st, k, e))
            .min_by(|(ka, a), (kb, b)| {
                Self::score(st, ka)
                    .total_cmp(&Self::score(st, kb))
                    .then(a.last.cmp(&b.last))
            })
            .map(|(k, _)| *k)
    }

    pub(super) fn evict(&self, st: &mut State, k: Key) {
        if let Some(e) = st.entries.remove(&k) {
            st.bytes -= e.bytes;
            st.stats.evictions += 1;
            if !e.used {
                self.wasted(st, k);
            }
        }
    }

    pub(super) fn wasted(&self, st: &mut State, k: Key) {
        st.stats.wasted_reads += 1;
        st.stats.wasted_bytes += self.layers.get(&k.0).map_or(0, |l| l.meta.payload_bytes);
    }

    /// Puts a loaded expert in the cache, evicting lower-scored ones; a newcomer that scores
    /// below every evictable entry is kept only for the runs waiting on it.
    pub(super) fn admit<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        key: Key,
        w: SwiGlu,
    ) -> MutexGuard<'a, State> {
        let bytes = expert_ram_bytes(&self.layers[&key.0].meta);
        let pinned = st.pinned.contains(&key);
        let mut transient = false;
        loop {
            if st.shutdown {
                return st;
            }
            if st.bytes + bytes <= self.capacity() {
                break;
            }
            let score = if pinned {
                f64::INFINITY
            } else {
                Self::score(&st, &key)
            };
            let demanded = pinned || st.wanted.get(&key).copied().unwrap_or(0) > 0;
            if let Some(v) = Self::victim(&st, demanded) {
                if st.entries[&v].transient || Self::score(&st, &v) <= score {
                    self.evict(&mut st, v);
                    continue;
                }
            }
            if !demanded {
                // A read-ahead nobody waits for yet, that would displace hotter experts: staged
                // in the I/O allowance until its layer runs (dropped if it is not used then, or
                // when a demanded expert needs the room), or dropped now if there is no room.
                if st.bytes + bytes <= self.capacity() + self.overflow {
                    transient = true;
                    break;
                }
                st.stats.not_admitted += 1;
                self.wasted(&mut st, key);
                return st;
            }
            if st.bytes + bytes <= self.capacity() + self.overflow {
                transient = true;
                st.stats.not_admitted += 1;
                break;
            }
            st = self.wait(st);
        }
        let in_use = st.wanted.remove(&key).unwrap_or(0);
        st.tick += 1;
        let last = st.tick;
        st.bytes += bytes;
        st.stats.cache_peak_bytes = st.stats.cache_peak_bytes.max(st.bytes);
        st.entries.insert(
            key,
            Entry {
                w: Arc::new(w),
                bytes,
                last,
                in_use,
                transient,
                used: in_use > 0,
            },
        );
        st
    }

    pub(super) fn release(&self, st: &mut State, k: Key) {
        if let Some(e) = st.entries.get_mut(&k) {
            e.in_use = e.in_use.saturating_sub(1);
            if e.in_use == 0 && e.transient {
                let b = e.bytes;
                st.entries.remove(&k);
                st.bytes -= b;
            }
        }
    }

    /// Queues read-aheads of experts `ids` of layer `nl`, the first `sure` as lookahead and the
    /// rest as early guesses (read only while the disk idles), and remembers the whole prediction
    /// (for the recall figure).
    pub(super) fn lookahead(&self, st: &mut State, nl: usize, ids: &[u32], sure: usize) {
        // Most likely first: the reads that start before the layer's router has run are its
        // surest predictions, and the ones still queued then are dropped if the router did not
        // choose them (see `run`), unread. The less sure rest would be read, a third of it wasted,
        // whenever an expert cache leaves the disk time: they wait for an idle disk instead.
        let (first, rest) = ids.split_at(sure.min(ids.len()));
        // this prediction supersedes the layer's early guesses not yet being read
        Self::drop_early(st, |k| k.0 == nl);
        if let Some(mut set) = self.queue_in_order(st, nl, first, Queue::Lookahead) {
            set.extend(
                self.queue_in_order(st, nl, rest, Queue::Early)
                    .unwrap_or_default(),
            );
            st.predicted.entry(nl).or_default().extend(set);
        }
    }

    /// Replaces the early guesses for layer `nl` not yet being read by `ids` (most likely
    /// first).
    pub(super) fn early(&self, st: &mut State, nl: usize, ids: &[u32]) {
        Self::drop_early(st, |k| k.0 == nl);
        self.queue_in_order(st, nl, ids, Queue::Early);
    }

    /// Queues reads of layer `nl`'s experts `ids` on `q` in the order given, each once; returns
    /// the valid ids, `None` for a layer the store does not hold.
    pub(super) fn queue_in_order(
        &self,
        st: &mut State,
        nl: usize,
        ids: &[u32],
        q: Queue,
    ) -> Option<HashSet<u32>> {
        let src = self.layers.get(&nl)?;
        let mut set = HashSet::new();
        for &e in ids {
            if (e as usize) < src.meta.count
                && set.insert(e)
                && Self::enqueue(st, (nl, e), q)
                && matches!(q, Queue::Lookahead)
            {
                st.stats.lookahead_reads += 1;
            }
        }
        Some(set)
    }

    /// Removes queued early guesses matching `f`.
    pub(super) fn drop_early(st: &mut State, f: impl Fn(&Key) -> bool) {
        let gone: Vec<Key> = st.early.iter().copied().filter(|k| f(k)).collect();
        st.early.retain(|k| !f(k));
        for k in gone {
            st.pending.remove(&k);
        }
    }

    /// Queues a read of `k` unless it is resident or already coming.
    pub(super) fn enqueue(st: &mut State, k: Key, q: Queue) -> bool {
        if st.entries.contains_key(&k) || st.pending.contains(&k) {
            return false;
        }
        st.pending.insert(k);
        match q {
            Queue::Demand => st.demand.push_back(k),
            Queue::Lookahead => st.lookahead.push_back(k),
            Queue::Warm => st.warm.push_back(k),
            Queue::Early => st.early.push_back(k),
        }
        true
    }

    /// Starts each expert's usage frequency from the routing history (its uses per token there,
    /// times `prior_steps`), so replacement favours the experts that usually run before this run
    /// has seen them; live uses add to it and decay halves it as usual.
    pub(super) fn seed_frequencies(&self, st: &mut State) {
        let (k, prior) = (self.opts.top_k as f64, self.opts.prior_steps);
        if k == 0.0 || prior <= 0.0 {
            return;
        }
        let mut seeds = Vec::new();
        for (&l, c) in &st.history.counts {
            let tokens = c.iter().map(|&n| n as f64).sum::<f64>() / k;
            if !self.layers.contains_key(&l) || tokens <= 0.0 {
                continue;
            }
            seeds.extend(
                c.iter()
                    .enumerate()
                    .filter(|(_, &n)| n > 0)
                    .map(|(e, &n)| ((l, e as u32), prior * (n as f64 / tokens).min(1.0))),
            );
        }
        st.freq.extend(seeds);
    }

    /// Re-derives the pinned set from the history and queues reads of pinned experts not resident.
    pub(super) fn repin(&self, st: &mut State) {
        let budget = (self.capacity() as f64 * self.opts.pin_fraction.clamp(0.0, 1.0)) as u64;
        let n = budget.checked_div(self.expert_bytes).unwrap_or(0) as usize;
        let new: HashSet<Key> = st
            .history
            .ranked()
            .into_iter()
            .take(n)
            .map(|(l, e, _)| (l, e))
            .filter(|k| {
                self.layers
                    .get(&k.0)
                    .is_some_and(|s| (k.1 as usize) < s.meta.count)
            })
            .collect();
        st.pinned = new;
        st.stats.pinned = st.pinned.len() as u64;
        let mut keys: Vec<Key> = st.pinned.iter().copied().collect();
        keys.sort_unstable();
        for k in keys {
            Self::enqueue(st, k, Queue::Warm);
        }
        self.cv.notify_all();
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Queue {
    Demand,
    Lookahead,
    Warm,
    Early,
}
