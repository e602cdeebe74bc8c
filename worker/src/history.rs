//! The routing-usage history: how often each routed expert was chosen, per model, kept across runs
//! so the store can pin the hot set from the first token. Written atomically (temporary file,
//! fsync, rename), so a crash leaves the old history or the new one, never a torn file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use charm_shared::container::Container;
use serde::{Deserialize, Serialize};

/// Format name written in the file.
const FORMAT: &str = "charm-routing-history";

/// Per-layer expert usage counts of one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    format: String,
    /// Identity of the model the counts belong to (see [`model_id`]).
    pub model_id: String,
    /// Forward steps counted.
    pub steps: u64,
    /// Decoder layer -> times each expert was chosen.
    pub counts: BTreeMap<usize, Vec<u64>>,
}

/// Why a history could not be used.
#[derive(Debug)]
pub enum HistoryError {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Invalid {
        path: PathBuf,
        reason: String,
    },
    OtherModel {
        path: PathBuf,
        found: String,
        want: String,
    },
}

impl HistoryError {
    /// The history file.
    pub fn path(&self) -> &Path {
        match self {
            Self::Io { path, .. } | Self::Invalid { path, .. } | Self::OtherModel { path, .. } => {
                path
            }
        }
    }

    /// What is wrong, without the file name (for callers that name the file themselves).
    pub fn reason(&self) -> String {
        match self {
            Self::Io { source, .. } => source.to_string(),
            Self::Invalid { reason, .. } => format!(
                "not a routing history: {reason}; delete it or pass another --history path"
            ),
            Self::OtherModel { found, want, .. } => format!(
                "routing history of another model ({found}; this model is {want}); delete it or pass another --history path"
            ),
        }
    }
}

impl std::fmt::Display for HistoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path().display(), self.reason())
    }
}

impl std::error::Error for HistoryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// A model's identity for histories: CRC-32 and length of its manifest bytes (a container's
/// `charm.json` names every tensor with its checksum, so two different models never share it).
pub fn model_id(manifest: &[u8]) -> String {
    format!("{:08x}-{}", crc32fast::hash(manifest), manifest.len())
}

/// [`model_id`] of the container in `dir`.
pub fn container_model_id(dir: &Path) -> std::io::Result<String> {
    std::fs::read(dir.join(charm_shared::container::MANIFEST)).map(|m| model_id(&m))
}

/// The id and expert-layer shape (layer -> experts) a history of container `c` must match.
fn identity(c: &Container) -> Result<(String, BTreeMap<usize, usize>), HistoryError> {
    let id = container_model_id(&c.dir).map_err(|source| HistoryError::Io {
        path: c.dir.join(charm_shared::container::MANIFEST),
        source,
    })?;
    Ok((id, c.expert_layers().map(|l| (l.layer, l.count)).collect()))
}

impl History {
    /// Loads `path` for container `c` (see [`Self::load`]).
    pub fn load_for(path: &Path, c: &Container) -> Result<Option<Self>, HistoryError> {
        let (id, shape) = identity(c)?;
        Self::load(path, &id, &shape)
    }

    /// [`Self::load_for`], or an empty history of `c` when `path` is `None` or absent.
    pub fn load_or_new(path: Option<&Path>, c: &Container) -> Result<Self, HistoryError> {
        let (id, shape) = identity(c)?;
        Ok(match path {
            Some(p) => Self::load(p, &id, &shape)?,
            None => None,
        }
        .unwrap_or_else(|| Self::new(&id, shape)))
    }

    /// An empty history for `model_id`, with `experts` counters for each listed layer.
    pub fn new(model_id: &str, layers: impl IntoIterator<Item = (usize, usize)>) -> Self {
        Self {
            format: FORMAT.into(),
            model_id: model_id.into(),
            steps: 0,
            counts: layers.into_iter().map(|(l, n)| (l, vec![0; n])).collect(),
        }
    }

    /// Loads `path` for `model_id`; `Ok(None)` when the file does not exist. Layers or expert
    /// counts that disagree with `layers` are refused as damage.
    pub fn load(
        path: &Path,
        model_id: &str,
        layers: &BTreeMap<usize, usize>,
    ) -> Result<Option<Self>, HistoryError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(HistoryError::Io {
                    path: path.into(),
                    source,
                })
            }
        };
        let invalid = |reason: String| HistoryError::Invalid {
            path: path.into(),
            reason,
        };
        let h: History = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if h.format != FORMAT {
            return Err(invalid(format!("format `{}`", h.format)));
        }
        if h.model_id != model_id {
            return Err(HistoryError::OtherModel {
                path: path.into(),
                found: h.model_id,
                want: model_id.into(),
            });
        }
        // every total the store and the planner take must fit in a u64
        if h.counts
            .values()
            .flatten()
            .try_fold(0u64, |a, &n| a.checked_add(n))
            .is_none()
        {
            return Err(invalid("the counts add up past 2^64".into()));
        }
        for (l, c) in &h.counts {
            if layers.get(l) != Some(&c.len()) {
                return Err(invalid(format!(
                    "layer {l} has {} counters, the model {}",
                    c.len(),
                    layers
                        .get(l)
                        .map_or("has no such expert layer".into(), |n| format!(
                            "has {n} experts"
                        ))
                )));
            }
        }
        Ok(Some(h))
    }

    /// Writes to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<(), HistoryError> {
        let io = |source| HistoryError::Io {
            path: path.into(),
            source,
        };
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(io)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let text = serde_json::to_vec(self).expect("history serializes");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e)
        })
    }

    /// Adds `other`'s counts (same model) to these.
    pub fn add(&mut self, layer: usize, expert: usize, n: u64) {
        if let Some(c) = self.counts.get_mut(&layer).and_then(|c| c.get_mut(expert)) {
            *c = c.saturating_add(n);
        }
    }

    /// The `(layer, expert)` pairs by descending count (ties: lower layer, lower id first),
    /// skipping never-used experts.
    pub fn ranked(&self) -> Vec<(usize, u32, u64)> {
        let mut v: Vec<(usize, u32, u64)> = self
            .counts
            .iter()
            .flat_map(|(&l, c)| {
                c.iter()
                    .enumerate()
                    .filter(|(_, &n)| n > 0)
                    .map(move |(e, &n)| (l, e as u32, n))
            })
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_other_models() {
        let dir = std::env::temp_dir().join(format!("charm-hist-{}", std::process::id()));
        let p = dir.join("h.json");
        let layers: BTreeMap<usize, usize> = [(1, 4), (2, 4)].into();
        assert!(History::load(&p, "m", &layers).unwrap().is_none());
        let mut h = History::new("m", layers.clone());
        h.add(1, 3, 5);
        h.add(2, 0, 2);
        h.add(9, 0, 1); // unknown layer: ignored
        h.steps = 7;
        h.save(&p).unwrap();
        let back = History::load(&p, "m", &layers).unwrap().unwrap();
        assert_eq!(back, h);
        assert_eq!(back.ranked(), vec![(1, 3, 5), (2, 0, 2)]);
        assert!(matches!(
            History::load(&p, "other", &layers),
            Err(HistoryError::OtherModel { .. })
        ));
        let fewer: BTreeMap<usize, usize> = [(1, 4)].into();
        assert!(matches!(
            History::load(&p, "m", &fewer),
            Err(HistoryError::Invalid { .. })
        ));
        std::fs::write(&p, b"{not json").unwrap();
        assert!(matches!(
            History::load(&p, "m", &layers),
            Err(HistoryError::Invalid { .. })
        ));
        // no temporary files left behind
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn damaged_histories_are_errors_never_panics() {
        let dir = std::env::temp_dir().join(format!("charm-hist-fuzz-{}", std::process::id()));
        let p = dir.join("h.json");
        let layers: BTreeMap<usize, usize> = [(1, 4), (2, 4)].into();
        let mut h = History::new("m", layers.clone());
        h.add(1, 2, 9);
        h.save(&p).unwrap();
        let good = std::fs::read(&p).unwrap();
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut refused = 0;
        for _ in 0..400 {
            let mut b = good.clone();
            for _ in 0..1 + next() % 3 {
                let i = (next() % b.len() as u64) as usize;
                match next() % 3 {
                    0 => b[i] = next() as u8,
                    1 => b.truncate(i),
                    _ => b.insert(i, b"0123456789-,:{}[]\"e"[(next() % 19) as usize]),
                }
                if b.is_empty() {
                    break;
                }
            }
            std::fs::write(&p, &b).unwrap();
            if History::load(&p, "m", &layers).is_err() {
                refused += 1;
            }
        }
        assert!(
            refused > 200,
            "only {refused} of 400 damaged files were refused"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn counts_past_u64_are_refused_and_adding_saturates() {
        let dir = std::env::temp_dir().join(format!("charm-hist-big-{}", std::process::id()));
        let p = dir.join("h.json");
        let layers: BTreeMap<usize, usize> = [(1, 2), (2, 2)].into();
        let mut h = History::new("m", layers.clone());
        h.add(1, 0, u64::MAX);
        h.add(1, 0, 5);
        assert_eq!(h.counts[&1][0], u64::MAX);
        h.save(&p).unwrap();
        assert!(History::load(&p, "m", &layers).unwrap().is_some());
        // one more count anywhere makes the totals overflow
        h.add(2, 1, 1);
        h.save(&p).unwrap();
        let e = History::load(&p, "m", &layers).unwrap_err();
        assert!(e.to_string().contains("2^64"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
