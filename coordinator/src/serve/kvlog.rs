//! Conversation KV on disk: an append-only log of finished sequences' KV caches, so a restarted
//! server continues a conversation (or reuses a system prompt) without prefilling it again.
//!
//! `kv.log` is a header (magic, the model's fingerprint and cache shape, CRC-32) and records,
//! each framed as `magic u32 | payload length u64 | CRC-32 u32 | payload`, written and then made
//! durable (`fdatasync`) before they count. A record extends an earlier one (a conversation's
//! next turn stores only its new tokens' KV) or stands alone. Opening the log checks every
//! record; the first one that is incomplete or fails its checksum (a write cut short by a crash
//! or a full disk) and everything after it is cut off, and the count of bytes cut is reported.
//! Past its byte budget the log is compacted: the most recent sequences are rewritten whole into
//! a new file that replaces the old one atomically (rename), the rest are dropped.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use charm_shared::config::{IndexerKind, ModelSpec};

use crate::model::cache::KvCache;

const FILE_MAGIC: &[u8; 8] = b"CHARMKV1";
const RECORD_MAGIC: u32 = 0x5256_4b43; // "CKVR"
const FRAME: u64 = 4 + 8 + 4;
/// No record is larger than this (a sanity bound on a damaged length field).
const MAX_RECORD: u64 = 1 << 40;
const NONE: u64 = u64::MAX;

/// Floats per token of each layer's KV and indexer keys: what a record's payload holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Shape {
    kv: Vec<usize>,
    index: Vec<usize>,
}

impl Shape {
    fn of(spec: &ModelSpec) -> Self {
        let c = KvCache::new(spec);
        let idx = spec.dsa.as_ref().map_or(0, |d| d.head_dim);
        Self {
            kv: c.layers.iter().map(|l| l.width).collect(),
            index: spec
                .layers
                .iter()
                .map(|l| {
                    if l.indexer == Some(IndexerKind::Full) {
                        idx
                    } else {
                        0
                    }
                })
                .collect(),
        }
    }
    fn floats_per_token(&self) -> usize {
        self.kv.iter().sum::<usize>() + self.index.iter().sum::<usize>()
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    fingerprint: String,
    shape: Shape,
}

/// One stored sequence.
#[derive(Debug, Clone)]
struct Rec {
    /// Where its payload starts, and its length.
    at: u64,
    len: u64,
    /// The record it extends (by sequence number) and how many of that one's tokens it keeps.
    parent: Option<(u64, usize)>,
    /// All its tokens (the parent's kept ones, then its own).
    tokens: Vec<u32>,
}

/// What opening a log found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Sequences recovered.
    pub records: usize,
    /// Bytes cut off the end (a torn or damaged tail); 0 when the log was whole.
    pub cut_bytes: u64,
}

/// The conversation KV log of one model (see the module docs).
#[derive(Debug)]
pub struct KvLog {
    path: PathBuf,
    file: File,
    /// Bytes of whole, checked records (the file's length).
    end: u64,
    budget: u64,
    shape: Shape,
    fingerprint: String,
    /// By sequence number, in the order written.
    recs: Vec<(u64, Rec)>,
    by_seq: HashMap<u64, usize>,
    next_seq: u64,
}

fn io(p: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", p.display())
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// A little-endian reader over a payload that says what is missing instead of panicking.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("record shorter than its contents".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

impl KvLog {
    /// Opens (or creates) `dir/kv.log` for the model whose fingerprint and shape are given,
    /// recovering every whole record and cutting a torn tail. A log of another model is refused.
    pub fn open(
        dir: &Path,
        spec: &ModelSpec,
        fingerprint: &str,
        budget: u64,
    ) -> Result<(Self, Recovered), String> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let path = dir.join("kv.log");
        let shape = Shape::of(spec);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        let len = file.metadata().map_err(|e| io(&path, e))?.len();
        let mut log = Self {
            path: path.clone(),
            file,
            end: 0,
            budget,
            shape,
            fingerprint: fingerprint.to_string(),
            recs: Vec::new(),
            by_seq: HashMap::new(),
            next_seq: 0,
        };
        let header_end = match log.read_header(len)? {
            Some(end) => end,
            None => {
                // empty, or a header cut short before any record counted: start afresh
                log.write_header()?;
                return Ok((
                    log,
                    Recovered {
                        records: 0,
                        cut_bytes: len,
                    },
                ));
            }
        };
        log.end = header_end;
        log.scan(len)?;
        let cut = len - log.end;
        if cut > 0 {
            log.file.set_len(log.end).map_err(|e| io(&path, e))?;
            log.file.sync_data().map_err(|e| io(&path, e))?;
        }
        let found = Recovered {
            records: log.recs.len(),
            cut_bytes: cut,
        };
        Ok((log, found))
    }

    /// The header's end, `None` when the file holds no whole header (new or torn at birth).
    fn read_header(&mut self, len: u64) -> Result<Option<u64>, String> {
        let p = self.path.clone();
        if len < 16 {
            return Ok(None);
        }
        let mut head = [0u8; 12];
        self.file.seek(SeekFrom::Start(0)).map_err(|e| io(&p, e))?;
        self.file.read_exact(&mut head).map_err(|e| io(&p, e))?;
        if &head[..8] != FILE_MAGIC {
            return Err(format!(
                "{} is not a charm KV log: move it away or pass another --kv-dir",
                p.display()
            ));
        }
        let n = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as u64;
        if 12 + n + 4 > len {
            return Ok(None);
        }
        let mut body = vec![0u8; n as usize + 4];
        self.file.read_exact(&mut body).map_err(|e| io(&p, e))?;
        let (json, crc) = body.split_at(n as usize);
        if crc32fast::hash(json) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Ok(None);
        }
        let h: Header = serde_json::from_slice(json)
            .map_err(|e| format!("{}: damaged header ({e})", p.display()))?;
        if h.fingerprint != self.fingerprint || h.shape != self.shape {
            return Err(format!(
                "{} holds the conversation KV of another model (or of other --activations): pass another --kv-dir or delete it",
                p.display()
            ));
        }
        Ok(Some(12 + n + 4))
    }

    fn write_header(&mut self) -> Result<(), String> {
        let p = self.path.clone();
        let json = serde_json::to_vec(&Header {
            fingerprint: self.fingerprint.clone(),
            shape: self.shape.clone(),
        })
        .expect("the header serializes");
        let mut b = FILE_MAGIC.to_vec();
        b.extend_from_slice(&(json.len() as u32).to_le_bytes());
        b.extend_from_slice(&json);
        b.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        self.file.set_len(0).map_err(|e| io(&p, e))?;
        self.file.seek(SeekFrom::Start(0)).map_err(|e| io(&p, e))?;
        self.file.write_all(&b).map_err(|e| io(&p, e))?;
        self.file.sync_data().map_err(|e| io(&p, e))?;
        self.end = b.len() as u64;
        Ok(())
    }

    /// Reads records from `self.end` while they are whole and check out.
    fn scan(&mut self, len: u64) -> Result<(), String> {
        let p = self.path.clone();
        let mut at = self.end;
        while at + FRAME <= len {
            let mut frame = [0u8; FRAME as usize];
            self.file.seek(SeekFrom::Start(at)).map_err(|e| io(&p, e))?;
            self.file.read_exact(&mut frame).map_err(|e| io(&p, e))?;
            let magic = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes"));
            let n = u64::from_le_bytes(frame[4..12].try_into().expect("8 bytes"));
            let crc = u32::from_le_bytes(frame[12..16].try_into().expect("4 bytes"));
            if magic != RECORD_MAGIC || n > MAX_RECORD || at + FRAME + n > len {
                break;
            }
            let mut payload = vec![0u8; n as usize];
            self.file.read_exact(&mut payload).map_err(|e| io(&p, e))?;
            if crc32fast::hash(&payload) != crc {
                break;
            }
            match self.index(at + FRAME, &payload) {
                Ok((seq, rec)) => self.push(seq, rec),
                Err(_) => break,
            }
            at += FRAME + n;
        }
        self.end = at;
        Ok(())
    }

    /// The index entry of a checked payload at `at` (its sequence number and tokens).
    fn index(&self, at: u64, payload: &[u8]) -> Result<(u64, Rec), String> {
        let mut c = Cursor(payload);
        let seq = c.u64()?;
        let (parent, parent_len, n_new) = (c.u64()?, c.u64()? as usize, c.u64()? as usize);
        let mut tokens = Vec::new();
        let parent = if parent == NONE {
            None
        } else {
            let r = self
                .by_seq
                .get(&parent)
                .map(|&i| &self.recs[i].1)
                .ok_or("a record extends one the log does not hold")?;
            if parent_len > r.tokens.len() {
                return Err("a record keeps more tokens than its parent has".into());
            }
            tokens.extend_from_slice(&r.tokens[..parent_len]);
            Some((parent, parent_len))
        };
        let raw = c.take(n_new.checked_mul(4).ok_or("token count overflows")?)?;
        tokens.extend(
            raw.chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))),
        );
        let floats = n_new
            .checked_mul(self.shape.floats_per_token())
            .and_then(|f| f.checked_mul(4))
            .ok_or("float count overflows")?;
        if c.0.len() != floats {
            return Err("record size does not match its token count".into());
        }
        Ok((
            seq,
            Rec {
                at,
                len: payload.len() as u64,
                parent,
                tokens,
            },
        ))
    }

    fn push(&mut self, seq: u64, rec: Rec) {
        self.by_seq.insert(seq, self.recs.len());
        self.recs.push((seq, rec));
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// Sequences stored.
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    /// Bytes on disk.
    pub fn bytes(&self) -> u64 {
        self.end
    }

    /// The stored sequence sharing the longest prefix with `prompt`: (its number, tokens shared).
    pub fn best(&self, prompt: &[u32]) -> Option<(u64, usize)> {
        self.recs
            .iter()
            .map(|(s, r)| {
                let n = r
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (*s, n)
            })
            .max_by_key(|&(s, n)| (n, s))
    }

    /// The payload of record `i`, checked again (the disk may have changed under us).
    fn payload(&self, i: usize) -> Result<Vec<u8>, String> {
        let r = &self.recs[i].1;
        let mut f = File::open(&self.path).map_err(|e| io(&self.path, e))?;
        let mut frame = [0u8; FRAME as usize];
        f.seek(SeekFrom::Start(r.at - FRAME))
            .and_then(|_| f.read_exact(&mut frame))
            .map_err(|e| io(&self.path, e))?;
        let mut b = vec![0u8; r.len as usize];
        f.read_exact(&mut b).map_err(|e| io(&self.path, e))?;
        if crc32fast::hash(&b) != u32::from_le_bytes(frame[12..16].try_into().expect("4 bytes")) {
            return Err(format!(
                "{}: a stored record no longer matches its checksum",
                self.path.display()
            ));
        }
        Ok(b)
    }

    /// Stores a finished sequence: `tokens` with their KV in `cache` (which holds exactly those
    /// tokens). `parent` (a stored sequence and how many of its tokens `cache` starts with)
    /// makes the record hold only the rest. Durable when this returns. Returns its number.
    pub fn append(
        &mut self,
        parent: Option<(u64, usize)>,
        tokens: &[u32],
        cache: &KvCache,
    ) -> Result<u64, String> {
        if cache.len() != tokens.len() || cache.layers.len() != self.shape.kv.len() {
            return Err("the cache does not hold those tokens".into());
        }
        // a parent the log still holds, whose kept tokens this sequence starts with
        let parent = parent.filter(|&(p, n)| {
            self.by_seq.get(&p).is_some_and(|&i| {
                let t = &self.recs[i].1.tokens;
                n <= t.len() && n <= tokens.len() && t[..n] == tokens[..n]
            })
        });
        let from = parent.map_or(0, |(_, n)| n);
        let seq = self.next_seq;
        let n_new = tokens.len() - from;
        let mut b = Vec::with_capacity(32 + 4 * n_new * (1 + self.shape.floats_per_token()));
        for v in [seq, parent.map_or(NONE, |p| p.0), from as u64, n_new as u64] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for t in &tokens[from..] {
            b.extend_from_slice(&t.to_le_bytes());
        }
        for (l, layer) in cache.layers.iter().enumerate() {
            let (w, iw) = (self.shape.kv[l], self.shape.index[l]);
            for v in &layer.kv[from * w..] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            for v in &layer.index_keys[from * iw..] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        let mut frame = Vec::with_capacity(FRAME as usize);
        frame.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
        frame.extend_from_slice(&(b.len() as u64).to_le_bytes());
        frame.extend_from_slice(&crc32fast::hash(&b).to_le_bytes());
        let at = self.end;
        let written = self
            .file
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.file.write_all(&frame))
            .and_then(|_| self.file.write_all(&b))
            .and_then(|_| self.file.sync_data());
        if let Err(e) = written {
            // a full disk or an I/O error: take back what part of the record got written
            let _ = self.file.set_len(at);
            return Err(io(&self.path, e));
        }
        self.end = at + FRAME + b.len() as u64;
        let (_, rec) = self.index(at + FRAME, &b)?;
        self.push(seq, rec);
        if self.end > self.budget {
            self.compact()?;
        }
        Ok(seq)
    }

    /// Rewrites the most recent sequences whole, as many as fit in half the budget, into a new
    /// log that replaces this one atomically; the rest are dropped.
    fn compact(&mut self) -> Result<(), String> {
        let per_token = 4 * (1 + self.shape.floats_per_token()) as u64;
        // newest first; a sequence another extends whole is kept through that one
        let mut keep = Vec::new();
        let mut room = self.budget / 2;
        for (i, (_, r)) in self.recs.iter().enumerate().rev() {
            let covered = keep.iter().any(|&j: &usize| {
                let t = &self.recs[j].1.tokens;
                t.len() >= r.tokens.len() && t[..r.tokens.len()] == r.tokens[..]
            });
            let size = FRAME + 32 + per_token * r.tokens.len() as u64;
            if covered || size > room {
                continue;
            }
            room -= size;
            keep.push(i);
        }
        keep.reverse();
        let kept: Vec<(u64, Vec<u32>)> = keep
            .iter()
            .map(|&i| (self.recs[i].0, self.recs[i].1.tokens.clone()))
            .collect();
        let tmp = self.path.with_extension("log.compact");
        let _ = std::fs::remove_file(&tmp);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| io(&tmp, e))?;
        let mut fresh = Self {
            path: tmp.clone(),
            file,
            end: 0,
            budget: u64::MAX,
            shape: self.shape.clone(),
            fingerprint: self.fingerprint.clone(),
            recs: Vec::new(),
            by_seq: HashMap::new(),
            next_seq: 0,
        };
        fresh.write_header()?;
        for (seq, tokens) in &kept {
            let cache = self.load(*seq)?;
            fresh.next_seq = *seq;
            fresh.append(None, tokens, &cache)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(|e| io(&self.path, e))?;
        if let Some(d) = self.path.parent() {
            sync_dir(d);
        }
        fresh.path = self.path.clone();
        fresh.budget = self.budget;
        fresh.next_seq = fresh.next_seq.max(self.next_seq);
        *self = fresh;
        Ok(())
    }

    /// The KV cache of stored sequence `seq` (its parents' rows, then its own), checked against
    /// its checksums again as it is read.
    pub fn load(&self, seq: u64) -> Result<KvCache, String> {
        let mut c = KvCache {
            layers: self
                .shape
                .kv
                .iter()
                .map(|&w| crate::model::cache::LayerCache {
                    width: w,
                    ..Default::default()
                })
                .collect(),
            device: Default::default(),
        };
        self.fill(seq, &mut c)?;
        Ok(c)
    }

    fn fill(&self, seq: u64, cache: &mut KvCache) -> Result<(), String> {
        let &i = self
            .by_seq
            .get(&seq)
            .ok_or_else(|| format!("no stored sequence {seq}"))?;
        let r = &self.recs[i].1;
        if let Some((p, n)) = r.parent {
            self.fill(p, cache)?;
            cache.truncate(n);
        }
        let payload = self.payload(i)?;
        let mut c = Cursor(&payload);
        let _ = (c.u64()?, c.u64()?, c.u64()?);
        let n_new = c.u64()? as usize;
        c.take(4 * n_new)?;
        for (l, layer) in cache.layers.iter_mut().enumerate() {
            for (n, out) in [
                (n_new * self.shape.kv[l], &mut layer.kv),
                (n_new * self.shape.index[l], &mut layer.index_keys),
            ] {
                let b = c.take(4 * n)?;
                out.extend(
                    b.chunks_exact(4)
                        .map(|x| f32::from_le_bytes(x.try_into().expect("4 bytes"))),
                );
            }
        }
        Ok(())
    }
}
