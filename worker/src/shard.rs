//! A worker's shard of a container it did not have whole: the expert records it holds, and the
//! ones it fetches from the coordinator over the cluster connection.
//!
//! The worker starts from a directory holding only the model's `config.json` and the container
//! manifest (`charm.json`): the expert files are made at their full length (sparse) and the
//! dense file empty, since a worker never reads dense weights. Each fetched record is checked
//! against the manifest's CRC-32, written in place, flushed to disk, and only then named in the
//! journal `shard.log` (one `LAYER EXPERT` line each, flushed), so a worker killed mid-transfer
//! restarts knowing exactly which records it has; a torn last line is ignored. Records the
//! journal does not name are never computed with: such a request is answered "unavailable"
//! and the coordinator serves it elsewhere. (The store checks every record's CRC again when it
//! first reads it.)

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use charm_shared::container::{Container, ExpertLayer, Manifest, MANIFEST};

/// The journal of fetched records.
pub const JOURNAL: &str = "shard.log";

/// Why a shard could not be prepared or a record kept.
pub type ShardError = crate::FileError;

use crate::io_at as io;

/// The records a worker holds of its container, and the journal of those it fetched.
#[derive(Debug)]
pub struct Shard {
    dir: PathBuf,
    layers: Vec<ExpertLayer>,
    present: Mutex<BTreeSet<(usize, u32)>>,
    journal: Mutex<File>,
}

impl Shard {
    /// Prepares `dir` (a container manifest, with or without its data files) for fetching: makes
    /// missing or short expert files at their length and a missing dense file empty, and reads
    /// the journal. Without a journal, the records of expert files that were already whole count
    /// as held (a copied container), the others as missing.
    pub fn open(dir: &Path) -> Result<Self, ShardError> {
        let mp = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&mp).map_err(io(&mp))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| ShardError::Invalid(format!("{}: {e}", mp.display())))?;
        let safe = |f: &str| !f.contains('/') && !f.contains('\\') && !f.starts_with('.');
        if !safe(&m.dense_file) || m.experts.iter().any(|e| !safe(&e.file)) {
            return Err(ShardError::Invalid(format!(
                "{}: a data file name points outside the directory",
                mp.display()
            )));
        }
        let jp = dir.join(JOURNAL);
        let fresh = !jp.exists();
        let mut present = BTreeSet::new();
        for l in &m.experts {
            let p = dir.join(&l.file);
            let want = l
                .record_bytes
                .checked_mul(l.count as u64)
                .ok_or_else(|| ShardError::Invalid(format!("layer {}: size overflows", l.layer)))?;
            let f = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&p)
                .map_err(io(&p))?;
            let len = f.metadata().map_err(io(&p))?.len();
            if len >= want {
                if fresh {
                    present.extend((0..l.count as u32).map(|e| (l.layer, e)));
                }
            } else {
                f.set_len(want).map_err(io(&p))?;
            }
        }
        let dp = dir.join(&m.dense_file);
        if !dp.exists() {
            File::create(&dp).map_err(io(&dp))?;
        }
        if !fresh {
            let text = std::fs::read(&jp).map_err(io(&jp))?;
            // whole lines only: a line cut by a kill is not a record
            let whole = text
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(&text[..0], |i| &text[..=i]);
            for line in String::from_utf8_lossy(whole).lines() {
                let mut it = line.split_whitespace().map(str::parse::<u64>);
                if let (Some(Ok(l)), Some(Ok(e)), None) = (it.next(), it.next(), it.next()) {
                    if m.experts
                        .iter()
                        .any(|x| x.layer as u64 == l && e < x.count as u64)
                    {
                        present.insert((l as usize, e as u32));
                    }
                }
            }
        }
        let mut journal = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&jp)
            .map_err(io(&jp))?;
        if fresh {
            for (l, e) in &present {
                writeln!(journal, "{l} {e}").map_err(io(&jp))?;
            }
            journal.sync_all().map_err(io(&jp))?;
        }
        Ok(Self {
            dir: dir.into(),
            layers: m.experts,
            present: Mutex::new(present),
            journal: Mutex::new(journal),
        })
    }

    /// Whether record `expert` of `layer` is on disk.
    pub fn has(&self, layer: usize, expert: u32) -> bool {
        self.present
            .lock()
            .expect("shard lock")
            .contains(&(layer, expert))
    }

    /// Records held.
    pub fn held(&self) -> usize {
        self.present.lock().expect("shard lock").len()
    }

    /// The layout of `layer`'s records.
    pub fn layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.layers.iter().find(|l| l.layer == layer)
    }

    /// Of `(layer, expert)` pairs, those not on disk.
    pub fn missing(&self, wanted: &[(usize, u32)]) -> Vec<(usize, u32)> {
        let p = self.present.lock().expect("shard lock");
        wanted
            .iter()
            .filter(|k| !p.contains(k) && self.layer(k.0).is_some_and(|l| (k.1 as usize) < l.count))
            .copied()
            .collect()
    }

    /// Keeps a fetched record: checked against its CRC-32, written in place and flushed, then
    /// journaled and flushed.
    pub fn store(&self, layer: usize, expert: u32, record: &[u8]) -> Result<(), ShardError> {
        let l = self
            .layer(layer)
            .ok_or_else(|| ShardError::Invalid(format!("layer {layer} has no experts")))?;
        let p = self.dir.join(&l.file);
        charm_shared::container::check_expert(l, expert as usize, record, &p)
            .map_err(|e| ShardError::Invalid(e.to_string()))?;
        if record.len() as u64 != l.record_bytes {
            return Err(ShardError::Invalid(format!(
                "layer {layer} expert {expert}: {} bytes for a {}-byte record",
                record.len(),
                l.record_bytes
            )));
        }
        let f = OpenOptions::new().write(true).open(&p).map_err(io(&p))?;
        f.write_all_at(record, expert as u64 * l.record_bytes)
            .map_err(io(&p))?;
        f.sync_data().map_err(io(&p))?;
        let jp = self.dir.join(JOURNAL);
        let mut j = self.journal.lock().expect("shard lock");
        writeln!(j, "{layer} {expert}").map_err(io(&jp))?;
        j.sync_data().map_err(io(&jp))?;
        self.present
            .lock()
            .expect("shard lock")
            .insert((layer, expert));
        Ok(())
    }

    /// The container in the shard's directory (its data files exist once [`Self::open`] ran).
    pub fn container(&self) -> Result<Container, ShardError> {
        Container::open(&self.dir).map_err(|e| ShardError::Invalid(e.to_string()))
    }
}
