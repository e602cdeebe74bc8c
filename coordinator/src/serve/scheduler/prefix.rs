//! The prefix cache: finished sequences' KV reused by prompts that start with the same tokens.

use super::kv_store::KvStore;
use crate::model::cache::KvCache;

/// Shortest shared prefix worth reusing (tokens).
pub(super) const MIN_PREFIX: usize = 16;

/// The KV caches of finished sequences, kept within a byte budget (least recently used go
/// first), for requests whose prompt starts with the same tokens: a conversation's next turn, a
/// shared system prompt. A reused prefix computes nothing again and gives the same result, since
/// every kernel gives a token's values whatever else it is batched with. Behind it, the KV log
/// on disk when there is one.
pub(super) struct PrefixCache {
    budget: usize,
    /// (tokens the cache holds, the cache, its record in the KV log), most recently used last.
    entries: Vec<(Vec<u32>, KvCache, Option<u64>)>,
}

impl PrefixCache {
    pub(super) fn new(budget: usize) -> Self {
        Self {
            budget,
            entries: Vec::new(),
        }
    }

    /// The cache of the longest stored prefix `prompt` shares (at least [`MIN_PREFIX`] tokens,
    /// at most all but its last token, which must be computed for its logits), cut to that
    /// prefix, from RAM or else from the log; with the logged sequence it came from.
    pub(super) fn take(
        &mut self,
        prompt: &[u32],
        store: Option<&KvStore>,
    ) -> Option<(KvCache, Option<(u64, usize)>)> {
        // the log while the writer is not appending to it (the newest sequences are in RAM)
        let guard = store.and_then(|s| s.log.try_lock().ok());
        let log = guard.as_deref();
        let most = prompt.len().saturating_sub(1);
        let common = |t: &[u32]| t.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let ram = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (t, _, _))| (i, common(t).min(most)))
            .max_by_key(|&(i, n)| (n, i));
        let disk = log
            .and_then(|l| l.best(prompt))
            .map(|(s, n)| (s, n.min(most)));
        let ram_n = ram.map_or(0, |r| r.1);
        if let Some((seq, n)) = disk.filter(|&(_, n)| n > ram_n && n >= MIN_PREFIX) {
            match log.map(|l| l.load(seq)) {
                Some(Ok(mut c)) => {
                    c.truncate(n);
                    return Some((c, Some((seq, n))));
                }
                Some(Err(err)) => tracing::warn!(%err, "stored conversation KV not read"),
                None => {}
            }
        }
        let (i, n) = ram?;
        if n < MIN_PREFIX {
            return None;
        }
        let (tokens, cache, disk) = self.entries.remove(i);
        let mut reused = cache.clone();
        reused.truncate(n);
        // the entry stays for others, now the most recently used
        self.entries.push((tokens, cache, disk));
        Some((reused, disk.map(|s| (s, n))))
    }

    /// Notes that the entry holding exactly `tokens` is now record `seq` of the log.
    pub(super) fn logged(&mut self, tokens: &[u32], seq: u64) {
        for e in self.entries.iter_mut().filter(|e| e.0 == tokens) {
            e.2 = Some(seq);
        }
    }

    /// Keeps `cache` (holding `tokens`, logged as `disk`), dropping the least recently used past
    /// the budget.
    pub(super) fn put(&mut self, tokens: Vec<u32>, cache: KvCache, disk: Option<u64>) {
        if cache.bytes() > self.budget || tokens.len() < MIN_PREFIX {
            return;
        }
        // a stored sequence this one extends is redundant
        self.entries
            .retain(|(t, _, _)| !(t.len() <= tokens.len() && tokens[..t.len()] == t[..]));
        self.entries.push((tokens, cache, disk));
        while self
            .entries
            .iter()
            .map(|(_, c, _)| c.bytes())
            .sum::<usize>()
            > self.budget
        {
            self.entries.remove(0);
        }
    }
}
