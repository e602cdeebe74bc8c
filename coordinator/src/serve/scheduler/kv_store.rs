//! The conversation KV log behind its writer thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::metrics::Metrics;
use crate::model::cache::KvCache;
use crate::serve::kvlog::KvLog;

/// A finished sequence for the KV log: the logged sequence it extends, its tokens, its KV.
type ToLog = (Option<(u64, usize)>, Vec<u32>, KvCache);

/// The conversation KV log behind a writer thread: finished sequences are appended (and made
/// durable) off the generation loop, so a long conversation's write holds no other generation
/// back; the loop hears back which record each became.
pub(super) struct KvStore {
    pub(super) log: Arc<std::sync::Mutex<KvLog>>,
    pub(super) tx: std::sync::mpsc::Sender<ToLog>,
    /// (tokens, record) of each sequence written.
    pub(super) done: std::sync::mpsc::Receiver<(Vec<u32>, u64)>,
}

impl KvStore {
    pub(super) fn start(log: KvLog, metrics: Arc<Metrics>) -> Self {
        let log = Arc::new(std::sync::Mutex::new(log));
        let (tx, rx) = std::sync::mpsc::channel::<ToLog>();
        let (done_tx, done) = std::sync::mpsc::channel();
        let writer = log.clone();
        let spawned = std::thread::Builder::new()
            .name("charm-kv-log".into())
            .spawn(move || {
                for (origin, tokens, cache) in rx {
                    let mut log = writer.lock().unwrap_or_else(|p| p.into_inner());
                    match log.append(origin, &tokens, &cache) {
                        Ok(seq) => {
                            metrics.kv_log_bytes.store(log.bytes(), Ordering::Relaxed);
                            drop(log);
                            let _ = done_tx.send((tokens, seq));
                        }
                        Err(err) => tracing::warn!(%err, "conversation KV not persisted"),
                    }
                }
            });
        if let Err(err) = spawned {
            tracing::warn!(%err, "no KV log writer: conversations are not persisted");
        }
        Self { log, tx, done }
    }

    pub(super) fn write(&self, origin: Option<(u64, usize)>, tokens: Vec<u32>, cache: KvCache) {
        let _ = self.tx.send((origin, tokens, cache));
    }
}
