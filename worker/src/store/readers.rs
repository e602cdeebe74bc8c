//! The reader threads: take the most urgent queued expert, read its record into a pooled
//! aligned buffer, check and decode it in place, and admit it.

use super::*;

/// Aligned record buffers recycled between loads. Buffers are only allocated when none is
/// free, so the pool never holds more than the most records alive at once.
#[derive(Debug, Default)]
pub(super) struct BufferPool {
    pub(super) free: Mutex<Vec<AlignedBuf>>,
}

impl BufferPool {
    pub(super) fn take(&self, len: usize) -> AlignedBuf {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        match free.iter().position(|b| b.len() >= len) {
            Some(i) => free.swap_remove(i),
            None => AlignedBuf::new(len),
        }
    }
}

/// A pooled buffer shared by the weights decoded from it; back to the pool on drop.
#[derive(Debug)]
struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<BufferPool>,
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.as_slice())
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(b);
        }
    }
}

impl Inner {
    /// Reader thread: takes keys by priority, reads and decodes them, and admits them.
    pub(super) fn reader(&self) {
        let mut scratch = Vec::new();
        loop {
            let key = {
                let mut st = lock(&self.state);
                loop {
                    if st.shutdown {
                        return;
                    }
                    // A read-ahead starts only when what is cached, staged and being read
                    // leaves room for it, counting the cached experts admission would displace
                    // for it (not pinned, not in use, used no more often than it): read with no
                    // room, it would be dropped unused.
                    let room = |st: &State, k: &Key| {
                        let limit = self.capacity() + self.overflow;
                        let need = st.bytes + st.inflight + self.layers[&k.0].meta.payload_bytes;
                        need <= limit || {
                            let score = Self::score(st, k);
                            let displaceable: u64 = st
                                .entries
                                .iter()
                                .filter(|(c, e)| {
                                    Self::evictable(st, c, e) && Self::score(st, c) <= score
                                })
                                .map(|(_, e)| e.bytes)
                                .sum();
                            need <= limit + displaceable
                        }
                    };
                    let k = st.demand.pop_front().or_else(|| {
                        if st.lookahead.front().is_some_and(|k| room(&st, k)) {
                            st.lookahead.pop_front()
                        } else {
                            None
                        }
                    });
                    let k = k.or_else(|| st.warm.pop_front()).or_else(|| {
                        // an early guess only keeps an otherwise idle disk busy
                        if st.inflight == 0 && st.early.front().is_some_and(|k| room(&st, k)) {
                            let k = st.early.pop_front()?;
                            st.stats.early_reads += 1;
                            st.early_read.insert(k);
                            Some(k)
                        } else {
                            None
                        }
                    });
                    if let Some(k) = k {
                        if st.inflight == 0 {
                            st.busy_since = Some(Instant::now());
                        }
                        st.inflight += self.layers[&k.0].meta.payload_bytes;
                        break k;
                    }
                    st = self.wait(st);
                }
            };
            let src = &self.layers[&key.0];
            let len = src.meta.payload_bytes as usize;
            let need = super::record_bytes(&src.meta) as usize;
            // The record is read into a recycled buffer and decoded in place: the expert's
            // weights stay in it, and it returns to the pool when the expert is dropped.
            let mut b = self.pool.take(need);
            let t0 = Instant::now();
            let read = src
                .file
                .read_exact_at(&mut b, key.1 as u64 * src.meta.record_bytes, len);
            let read_s = t0.elapsed().as_secs_f64();
            Timeline::add(&self.timeline, "read", key, true, t0, len as u64);
            let seen = &src.verified[key.1 as usize];
            let verify = !seen.load(std::sync::atomic::Ordering::Relaxed);
            // The CRC is checked on the bytes as stored, then the weights are rearranged in
            // place into the layout the kernels read fastest (when they have one).
            let lanes = lanes_wanted(self.opts.activations);
            let res = read
                .map_err(|e| format!("{}: {e}", src.file.path.display()))
                .and_then(|()| {
                    if verify {
                        check_expert(&src.meta, key.1 as usize, b.as_slice(), &src.file.path)
                            .map_err(|e| e.to_string())?;
                        seen.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(if lanes {
                        expert_to_lanes(&src.meta, b.as_mut_slice(), &mut scratch)
                    } else {
                        [false; 3]
                    })
                });
            let rec: SharedBytes = Arc::new(PooledBuf {
                buf: Some(b),
                pool: self.pool.clone(),
            });
            let res = res
                .and_then(|lanes| {
                    decode_expert_shared(
                        &src.meta,
                        key.1 as usize,
                        &rec,
                        &src.file.path,
                        false,
                        lanes,
                    )
                    .map_err(|e| e.to_string())
                })
                .and_then(|(gate, up, down)| self.check_shapes(key, gate, up, down));
            let mut st = lock(&self.state);
            st.stats.reads += 1;
            st.stats.bytes_read += len as u64;
            st.stats.read_seconds += read_s;
            st.inflight -= len as u64;
            if st.inflight == 0 {
                if let Some(t) = st.busy_since.take() {
                    st.stats.disk_busy_seconds += t.elapsed().as_secs_f64();
                }
            }
            match res {
                Ok(w) => st = self.admit(st, key, w),
                Err(e) => {
                    st.wanted.remove(&key);
                    st.failed.insert(key, e);
                }
            }
            st.pending.remove(&key);
            drop(st);
            self.cv.notify_all();
        }
    }

    pub(super) fn check_shapes(
        &self,
        key: Key,
        gate: Linear,
        up: Linear,
        down: Linear,
    ) -> Result<SwiGlu, String> {
        let (h, i) = (self.hidden, self.inter);
        for (w, r, c) in [(&gate, i, h), (&up, i, h), (&down, h, i)] {
            if (w.rows(), w.cols()) != (r, c) {
                return Err(format!(
                    "layer {} expert {}: a weight is {}x{}, the model wants {r}x{c}",
                    key.0,
                    key.1,
                    w.rows(),
                    w.cols()
                ));
            }
        }
        let act = self.opts.activations;
        Ok(SwiGlu {
            gate: gate.with_activations(act),
            up: up.with_activations(act),
            down: down.with_activations(act),
        })
    }
}
