//! The charm container: a converted model directory, self-describing and built for streaming.
//! The byte layout is documented in `docs/container.md`.
//!
//! - `charm.json`: the manifest (format name and version, every tensor's storage format named
//!   explicitly, where its bytes are, a CRC-32 per tensor and per routed expert).
//! - `dense.bin`: every tensor except routed experts, each part 64-byte aligned.
//! - `experts-LLL.bin`: the routed experts of decoder layer `LLL`, one record per expert. A record
//!   holds the expert's gate, up and down weights with their scales, contiguous, and is padded to a
//!   multiple of 4096 bytes, so one aligned read fetches one expert.
//! - `config.json`: the source model's config, unchanged.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::LoadError;
use crate::kernels::Matrix;
use crate::linear::Linear;
use crate::quant::{Layout, QMatrix, QuantKind, SharedBytes, WeightBytes, WeightFloats};

/// Format name in the manifest.
pub const FORMAT: &str = "charm-container";
/// Current format version; readers refuse others.
pub const VERSION: u32 = 1;
/// Manifest file name.
pub const MANIFEST: &str = "charm.json";
/// Alignment of each expert record (and record size granularity).
pub const RECORD_ALIGN: usize = 4096;
/// Alignment of each tensor part in `dense.bin`.
pub const PART_ALIGN: usize = 64;

// Record and part alignment, checked at compile time: records are whole pages (one aligned
// read each), parts inside a record stay 64-byte aligned from the record's start, and scales
// (f32) are aligned wherever a part starts.
const _: () = assert!(RECORD_ALIGN.is_power_of_two() && RECORD_ALIGN >= 4096);
const _: () = assert!(PART_ALIGN.is_power_of_two() && RECORD_ALIGN.is_multiple_of(PART_ALIGN));
const _: () = assert!(PART_ALIGN.is_multiple_of(crate::quant::SCALE_BYTES));

/// A tensor's storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum StoreFormat {
    F32,
    Bf16,
    Int8,
    Int4,
    Int2,
}

impl StoreFormat {
    pub fn quant(self) -> Option<QuantKind> {
        match self {
            Self::F32 => None,
            Self::Bf16 => Some(QuantKind::Bf16),
            Self::Int8 => Some(QuantKind::Int8),
            Self::Int4 => Some(QuantKind::Int4),
            Self::Int2 => Some(QuantKind::Int2),
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "f32" => Self::F32,
            "bf16" => Self::Bf16,
            "int8" => Self::Int8,
            "int4" => Self::Int4,
            "int2" => Self::Int2,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
            Self::Int2 => "int2",
        }
    }
}

/// Where one tensor's bytes are: `data`, and for grouped formats `scales` (and `mins` for int2),
/// as `[offset, length]` byte ranges (in `dense.bin`, or relative to an expert record's start).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    pub format: StoreFormat,
    pub shape: Vec<usize>,
    /// Weights per scale along a row; `cols` for per-row scales; absent for f32 and bf16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    pub data: [u64; 2],
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mins: Option<[u64; 2]>,
}

impl Part {
    /// Byte length of each region for a `[rows, cols]` (or `[n]`) tensor in `format`.
    /// `None` when the shape is too large to address (a damaged manifest).
    pub fn sizes(format: StoreFormat, shape: &[usize], group: usize) -> Option<(u64, u64, u64)> {
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))?;
        if n > (1u64 << 48) {
            return None;
        }
        let cols = *shape.last().unwrap_or(&1) as u64;
        let rows = n.checked_div(cols).unwrap_or(0);
        let groups = rows * cols.checked_div(group as u64).unwrap_or(0);
        Some(match format {
            StoreFormat::F32 => (4 * n, 0, 0),
            StoreFormat::Bf16 => (2 * n, 0, 0),
            StoreFormat::Int8 => (n, 4 * groups, 0),
            StoreFormat::Int4 => (n / 2, 4 * groups, 0),
            StoreFormat::Int2 => (n / 4, 4 * groups, 4 * groups),
        })
    }
}

/// A tensor in `dense.bin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DenseTensor {
    #[serde(flatten)]
    pub part: Part,
    /// CRC-32 over data, scales and mins, in that order.
    pub crc32: u32,
}

/// The routed experts of one decoder layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertLayer {
    pub layer: usize,
    pub file: String,
    pub count: usize,
    /// Bytes per record, a multiple of [`RECORD_ALIGN`].
    pub record_bytes: u64,
    pub gate: Part,
    pub up: Part,
    pub down: Part,
    /// CRC-32 of each record's first `payload_bytes` bytes.
    pub crc32: Vec<u32>,
    pub payload_bytes: u64,
}

/// The storage policy a container was made with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub experts: StoreFormat,
    pub dense: StoreFormat,
    pub embedding: StoreFormat,
    pub mtp: StoreFormat,
    /// Requested group size (a tensor whose width it does not divide uses the largest multiple of
    /// 8 below it that does; each tensor's `group` is recorded).
    pub group: usize,
}

impl Default for Policy {
    /// `charm convert`'s defaults: int4 routed experts, int8 for the rest, groups of 64.
    fn default() -> Self {
        Self {
            experts: StoreFormat::Int4,
            dense: StoreFormat::Int8,
            embedding: StoreFormat::Int8,
            mtp: StoreFormat::Int8,
            group: 64,
        }
    }
}

/// `charm.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub model_type: String,
    pub policy: Policy,
    pub dense_file: String,
    pub tensors: BTreeMap<String, DenseTensor>,
    pub experts: Vec<ExpertLayer>,
}

/// The group actually used for a row of `cols` weights when `requested` is asked for: the largest
/// multiple of 8 that is `<= requested` and divides `cols`; `None` if there is none.
pub fn effective_group(cols: usize, requested: usize) -> Option<usize> {
    let mut g = requested.min(cols) / 8 * 8;
    while g >= 8 {
        if cols.is_multiple_of(g) {
            return Some(g);
        }
        g -= 8;
    }
    None
}

/// The bytes of a stored tensor's three regions: data, scales, mins.
pub type Regions = (Vec<u8>, Vec<u8>, Vec<u8>);

/// Serializes a quantized matrix into its three regions.
pub fn encode(q: &QMatrix) -> Regions {
    let f = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    (q.data.to_vec(), f(&q.scales), f(&q.mins))
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// An opened container. Data files are read with positioned reads (no memory mapping), so the
/// only weight bytes held in memory are the ones a caller decodes and keeps.
#[derive(Debug)]
pub struct Container {
    pub dir: PathBuf,
    pub manifest: Manifest,
    dense: File,
    dense_len: u64,
    /// Per expert layer: its index in the manifest and its file (`None`: opened without
    /// expert files, see [`Container::open_dense_only`]).
    experts: BTreeMap<usize, (usize, Option<File>)>,
}

fn open_file(path: &Path) -> Result<(File, u64), LoadError> {
    let f = File::open(path).map_err(|e| LoadError::io(path, e))?;
    let len = f.metadata().map_err(|e| LoadError::io(path, e))?.len();
    Ok((f, len))
}

/// Reads `len` bytes at `offset` of `f`.
pub fn read_at(f: &File, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>, LoadError> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .map_err(|e| LoadError::io(path, e))?;
    Ok(buf)
}

fn range(
    r: [u64; 2],
    len: usize,
    path: &Path,
    what: &str,
) -> Result<std::ops::Range<usize>, LoadError> {
    let (o, l) = (r[0], r[1]);
    match o.checked_add(l) {
        Some(end) if end <= len as u64 => Ok(o as usize..end as usize),
        _ => Err(LoadError::Tensor {
            path: path.to_path_buf(),
            tensor: what.to_string(),
            reason: format!("byte range [{o}, +{l}] lies outside the {len}-byte file"),
        }),
    }
}

/// Decodes expert `e`'s record `rec` (at least `payload_bytes` long) of layer `l` as
/// (gate, up, down), checking its CRC-32 first when `verify` is set.
pub fn decode_expert(
    l: &ExpertLayer,
    e: usize,
    rec: &[u8],
    path: &Path,
    verify: bool,
) -> Result<(Linear, Linear, Linear), LoadError> {
    if verify {
        check_expert(l, e, rec, path)?;
    }
    decode_expert_in(l, e, rec, path, None, [false; 3])
}

/// Checks expert `e`'s record `rec` of layer `l` against its CRC-32.
pub fn check_expert(l: &ExpertLayer, e: usize, rec: &[u8], path: &Path) -> Result<(), LoadError> {
    let payload = rec.get(..l.payload_bytes as usize);
    match (l.crc32.get(e), payload) {
        (Some(c), Some(p)) if crc32fast::hash(p) == *c => Ok(()),
        _ => Err(LoadError::Tensor {
            path: path.to_path_buf(),
            tensor: format!("layer {} expert {e}", l.layer),
            reason: "CRC-32 mismatch: the expert record is damaged".into(),
        }),
    }
}

/// Rearranges the int8/int4 weights of an expert record of layer `l` (and their scales) into
/// [`Layout::Lanes16`] in place, for each part where that layout fits, and says which of (gate,
/// up, down) it rearranged: [`decode_expert_shared`] takes that answer. Parts whose regions do not
/// lie in `rec` or disagree with their shape are left alone (decoding reports them). `scratch` is
/// reused between calls.
pub fn expert_to_lanes(l: &ExpertLayer, rec: &mut [u8], scratch: &mut Vec<u8>) -> [bool; 3] {
    [&l.gate, &l.up, &l.down].map(|part| part_to_lanes(part, rec, scratch))
}

/// Rearranges `part`'s weights and scales, whose regions lie in `rec`, into [`Layout::Lanes16`]
/// in place where that layout fits; says whether it did.
fn part_to_lanes(part: &Part, rec: &mut [u8], scratch: &mut Vec<u8>) -> bool {
    let Some((kind, rows, cols, group)) = lanes_part(part) else {
        return false;
    };
    let region = |r: Option<[u64; 2]>, want: Option<usize>| {
        let [o, n] = r?;
        let (o, n) = (usize::try_from(o).ok()?, usize::try_from(n).ok()?);
        (n == want? && o.checked_add(n)? <= rec.len()).then(|| o..o + n)
    };
    let data_len = rows.checked_mul(cols / 8 * kind.bits());
    let scales_len = rows.checked_mul(cols / group * 4);
    let (Some(d), Some(sc)) = (
        region(Some(part.data), data_len),
        region(part.scales, scales_len),
    ) else {
        return false;
    };
    crate::quant::lanes_in_place(kind, cols, group, &mut rec[d], scratch);
    crate::quant::lanes_in_place(
        QuantKind::Int8,
        4 * (cols / group),
        4,
        &mut rec[sc],
        scratch,
    );
    true
}

/// `(kind, rows, cols, group)` of a part that has a [`Layout::Lanes16`] form.
fn lanes_part(part: &Part) -> Option<(QuantKind, usize, usize, usize)> {
    let kind = part.format.quant()?;
    let [rows, cols] = part.shape[..] else {
        return None;
    };
    let group = part.group.unwrap_or(cols);
    (crate::quant::lanes_fit(kind, rows, group)
        && cols.is_multiple_of(group)
        && part.mins.is_none())
    .then_some((kind, rows, cols, group))
}

/// [`decode_expert`] keeping the quantized weight bytes in `rec` itself (no copy): the expert
/// holds the buffer until it is dropped. `lanes`: what [`expert_to_lanes`] rearranged (it runs
/// after the CRC-32 check, so `verify` must then be off), or all `false`.
pub fn decode_expert_shared(
    l: &ExpertLayer,
    e: usize,
    rec: &SharedBytes,
    path: &Path,
    verify: bool,
    lanes: [bool; 3],
) -> Result<(Linear, Linear, Linear), LoadError> {
    let bytes = (**rec).as_ref();
    if verify {
        check_expert(l, e, bytes, path)?;
    }
    decode_expert_in(l, e, bytes, path, Some(rec), lanes)
}

fn decode_expert_in(
    l: &ExpertLayer,
    e: usize,
    rec: &[u8],
    path: &Path,
    shared: Option<&SharedBytes>,
    lanes: [bool; 3],
) -> Result<(Linear, Linear, Linear), LoadError> {
    let name = format!("layer {} expert {e}", l.layer);
    if e >= l.crc32.len() || rec.len() < l.payload_bytes as usize {
        return Err(LoadError::Tensor {
            path: path.to_path_buf(),
            tensor: name,
            reason: "no such expert record".into(),
        });
    }
    let part = |p: &Part, lanes: bool| -> Result<Linear, LoadError> {
        let mut w = Container::decode(p, rec, path, &name, shared)?;
        match &mut w {
            Linear::Quant(q) if lanes => q.layout = Layout::Lanes16,
            _ if lanes => {
                return Err(LoadError::Tensor {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    reason: "a rearranged part did not decode as quantized weights".into(),
                })
            }
            _ => {}
        }
        Ok(w)
    };
    Ok((
        part(&l.gate, lanes[0])?,
        part(&l.up, lanes[1])?,
        part(&l.down, lanes[2])?,
    ))
}

impl Container {
    /// Whether `dir` holds a container.
    pub fn is_container(dir: &Path) -> bool {
        dir.join(MANIFEST).is_file()
    }

    /// Opens and validates the manifest and maps the data files (no weight bytes are read).
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        Self::open_with(dir, true)
    }

    /// [`Container::open`] without the expert files (which need not exist): for a cluster
    /// coordinator whose routed experts all live on workers. Reading an expert fails.
    pub fn open_dense_only(dir: &Path) -> Result<Self, LoadError> {
        Self::open_with(dir, false)
    }

    /// Whether every expert file the manifest of `dir` names exists (false when the manifest
    /// cannot be read).
    pub fn has_expert_files(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join(MANIFEST))
            .ok()
            .and_then(|t| serde_json::from_str::<Manifest>(&t).ok())
            .is_some_and(|m| m.experts.iter().all(|l| dir.join(&l.file).is_file()))
    }

    fn open_with(dir: &Path, with_experts: bool) -> Result<Self, LoadError> {
        let mp = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&mp).map_err(|e| LoadError::io(&mp, e))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| LoadError::config(&mp, format!("invalid manifest: {e}")))?;
        if manifest.format != FORMAT {
            return Err(LoadError::config(
                &mp,
                format!("format `{}` is not `{FORMAT}`", manifest.format),
            ));
        }
        if manifest.version != VERSION {
            return Err(LoadError::config(
                &mp,
                format!("container version {} is not supported (this charm reads version {VERSION}); reconvert the model", manifest.version),
            ));
        }
        let safe = |f: &str| !f.contains('/') && !f.contains('\\') && !f.starts_with('.');
        if !safe(&manifest.dense_file) || manifest.experts.iter().any(|e| !safe(&e.file)) {
            return Err(LoadError::config(
                &mp,
                "a data file name points outside the directory",
            ));
        }
        let (dense, dense_len) = open_file(&dir.join(&manifest.dense_file))?;
        let mut experts = BTreeMap::new();
        for (i, l) in manifest.experts.iter().enumerate() {
            let p = dir.join(&l.file);
            if !with_experts {
                if l.crc32.len() != l.count {
                    return Err(LoadError::Tensor {
                        path: p,
                        tensor: format!("experts of layer {}", l.layer),
                        reason: "record layout disagrees with the manifest".into(),
                    });
                }
                experts.insert(l.layer, (i, None));
                continue;
            }
            let (m, len) = open_file(&p)?;
            if l.record_bytes % RECORD_ALIGN as u64 != 0
                || l.record_bytes
                    .checked_mul(l.count as u64)
                    .is_none_or(|n| len < n)
                || l.crc32.len() != l.count
                || l.payload_bytes > l.record_bytes
            {
                return Err(LoadError::Tensor {
                    path: p,
                    tensor: format!("experts of layer {}", l.layer),
                    reason: "record layout disagrees with the file".into(),
                });
            }
            experts.insert(l.layer, (i, Some(m)));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            dense,
            dense_len,
            experts,
        })
    }

    fn dense_path(&self) -> PathBuf {
        self.dir.join(&self.manifest.dense_file)
    }

    fn tensor(&self, name: &str) -> Result<&DenseTensor, LoadError> {
        self.manifest
            .tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })
    }

    /// Decodes a part whose regions lie in `bytes` (after checking they do). With `shared` (the
    /// buffer `bytes` is), quantized weight bytes stay in it instead of being copied.
    fn decode(
        part: &Part,
        bytes: &[u8],
        path: &Path,
        name: &str,
        shared: Option<&SharedBytes>,
    ) -> Result<Linear, LoadError> {
        let bad = |reason: String| LoadError::Tensor {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason,
        };
        let (rows, cols) = match part.shape.as_slice() {
            [r, c] => (*r, *c),
            [n] => (1, *n),
            s => return Err(bad(format!("unsupported shape {s:?}"))),
        };
        let group = part.group.unwrap_or(cols);
        let (dl, sl, ml) = Part::sizes(part.format, &part.shape, group)
            .ok_or_else(|| bad(format!("shape {:?} is too large", part.shape)))?;
        if part.data[1] != dl
            || part.scales.map_or(0, |s| s[1]) != sl
            || part.mins.map_or(0, |m| m[1]) != ml
        {
            return Err(bad("region sizes disagree with shape and format".into()));
        }
        let data_range = range(part.data, bytes.len(), path, name)?;
        let data = &bytes[data_range.clone()];
        if part.format == StoreFormat::F32 {
            let v = floats(data);
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(LoadError::NonFinite {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    index: i,
                });
            }
            return Ok(Linear::F32(Matrix::new(rows, cols, v)));
        }
        let kind = part.format.quant().expect("quantized format");
        if kind == QuantKind::Bf16 && !cols.is_multiple_of(8) {
            // The SIMD kernels walk rows 8 values at a time: odd widths run as exact f32.
            let v = data
                .chunks_exact(2)
                .map(|c| crate::dtype::bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect();
            return Ok(Linear::F32(Matrix::new(rows, cols, v)));
        }
        if kind != QuantKind::Bf16
            && (group == 0 || !group.is_multiple_of(8) || !cols.is_multiple_of(group))
        {
            return Err(bad(format!("group {group} does not tile {cols} columns")));
        }
        // Scales (and int2 offsets) are viewed in place in a shared record when aligned, else
        // decoded into a copy.
        let region = |r: Option<[u64; 2]>| -> Result<WeightFloats, LoadError> {
            let Some(r) = r else {
                return Ok(WeightFloats::default());
            };
            let rr = range(r, bytes.len(), path, name)?;
            Ok(shared
                .and_then(|b| WeightFloats::shared(b.clone(), rr.clone()))
                .unwrap_or_else(|| floats(&bytes[rr]).into()))
        };
        let scales = region(part.scales)?;
        let mins = region(part.mins)?;
        if let Some(i) = scales
            .iter()
            .chain(mins.iter())
            .position(|x| !x.is_finite())
        {
            return Err(bad(format!("non-finite scale at {i}")));
        }
        Ok(Linear::Quant(QMatrix {
            rows,
            cols,
            kind,
            group: if kind == QuantKind::Bf16 { cols } else { group },
            data: match shared {
                Some(b) => WeightBytes::shared(b.clone(), data_range)
                    .ok_or_else(|| bad("the shared record is shorter than its parts".into()))?,
                None => data.to_vec().into(),
            },
            scales,
            mins,
            layout: Layout::RowMajor,
            act: crate::quant::Activations::F32,
        }))
    }

    /// Whether tensor `name` exists.
    pub fn has(&self, name: &str) -> bool {
        self.manifest.tensors.contains_key(name)
    }

    /// Tensor `name` in its stored format, its CRC-32 verified and its shape checked.
    pub fn linear(&self, name: &str, want: &[usize]) -> Result<Linear, LoadError> {
        self.linear_as(name, want, false)
    }

    /// [`Self::linear`], rearranged into [`Layout::Lanes16`] where `lanes` asks and the layout
    /// fits. The tensor is read once and its weights stay in that buffer (rearranged in place),
    /// so loading takes the tensor's size once, not twice.
    pub fn linear_as(&self, name: &str, want: &[usize], lanes: bool) -> Result<Linear, LoadError> {
        let t = self.tensor(name)?;
        let path = self.dense_path();
        if t.part.shape != want {
            return Err(LoadError::Shape {
                path,
                tensor: name.to_string(),
                got: t.part.shape.clone(),
                want: want.to_vec(),
            });
        }
        // One read covering the tensor's regions, which are then addressed relative to its start.
        let regions: Vec<[u64; 2]> = [Some(t.part.data), t.part.scales, t.part.mins]
            .into_iter()
            .flatten()
            .collect();
        let mut lo = u64::MAX;
        let mut hi = 0u64;
        for r in &regions {
            let span = range(*r, self.dense_len as usize, &path, name)?;
            lo = lo.min(span.start as u64);
            hi = hi.max(span.end as u64);
        }
        let mut bytes = read_at(&self.dense, &path, lo, (hi - lo) as usize)?;
        let rebase = |r: [u64; 2]| [r[0] - lo, r[1]];
        let mut h = crc32fast::Hasher::new();
        for r in &regions {
            h.update(&bytes[range(rebase(*r), bytes.len(), &path, name)?]);
        }
        if h.finalize() != t.crc32 {
            return Err(LoadError::Tensor {
                path,
                tensor: name.to_string(),
                reason: "CRC-32 mismatch: the file is damaged".into(),
            });
        }
        let part = Part {
            data: rebase(t.part.data),
            scales: t.part.scales.map(rebase),
            mins: t.part.mins.map(rebase),
            ..t.part.clone()
        };
        let lanes = lanes && part_to_lanes(&part, &mut bytes, &mut Vec::new());
        let buf: SharedBytes = std::sync::Arc::new(bytes);
        let mut w = Self::decode(&part, (*buf).as_ref(), &path, name, Some(&buf))?;
        if let Linear::Quant(q) = &mut w {
            if lanes {
                q.layout = Layout::Lanes16;
            }
        }
        Ok(w)
    }

    /// Expert `e` of decoder layer `layer` as (gate, up, down), its record's CRC-32 verified.
    pub fn expert(&self, layer: usize, e: usize) -> Result<(Linear, Linear, Linear), LoadError> {
        let (i, m) = self
            .experts
            .get(&layer)
            .ok_or_else(|| LoadError::MissingTensor {
                dir: self.dir.clone(),
                tensor: format!("experts of layer {layer}"),
            })?;
        let l = &self.manifest.experts[*i];
        let path = self.dir.join(&l.file);
        if e >= l.count {
            return Err(LoadError::MissingTensor {
                dir: self.dir.clone(),
                tensor: format!("layer {layer} expert {e}"),
            });
        }
        let Some(m) = m else {
            return Err(LoadError::config(
                &path,
                "this container was opened without its expert files",
            ));
        };
        let rec = read_at(m, &path, e as u64 * l.record_bytes, l.record_bytes as usize)?;
        decode_expert(l, e, &rec, &path, true)
    }

    /// The expert layer record of decoder layer `layer`.
    pub fn expert_layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.experts
            .get(&layer)
            .map(|(i, _)| &self.manifest.experts[*i])
    }

    /// Bytes of `dense.bin` (the dense skeleton as stored).
    pub fn dense_bytes(&self) -> u64 {
        self.dense_len
    }

    /// The expert layers held.
    pub fn expert_layers(&self) -> impl Iterator<Item = &ExpertLayer> {
        self.manifest.experts.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Matrix;
    use crate::quant::tests::data;

    /// An int4 expert record (gate and up `[32, 128]`, down `[128, 64]`, groups of 64) and its
    /// layer description.
    fn record() -> (ExpertLayer, Vec<u8>, [QMatrix; 3]) {
        let mut rec = Vec::new();
        let mut part = |q: &QMatrix| {
            let (d, s, _) = encode(q);
            let at = rec.len() as u64;
            rec.extend_from_slice(&d);
            rec.extend_from_slice(&s);
            Part {
                format: StoreFormat::Int4,
                shape: vec![q.rows, q.cols],
                group: Some(q.group),
                data: [at, d.len() as u64],
                scales: Some([at + d.len() as u64, s.len() as u64]),
                mins: None,
            }
        };
        let q = |r: usize, c: usize, seed: u64| {
            QMatrix::quantize(&Matrix::new(r, c, data(seed, r * c)), QuantKind::Int4, 64).unwrap()
        };
        let qs = [q(32, 128, 1), q(32, 128, 2), q(128, 64, 3)];
        let (gate, up, down) = (part(&qs[0]), part(&qs[1]), part(&qs[2]));
        let l = ExpertLayer {
            layer: 1,
            file: "experts-001.bin".into(),
            count: 1,
            record_bytes: rec.len().next_multiple_of(RECORD_ALIGN) as u64,
            gate,
            up,
            down,
            crc32: vec![crc32fast::hash(&rec)],
            payload_bytes: rec.len() as u64,
        };
        (l, rec, qs)
    }

    #[test]
    fn experts_rearranged_in_place_decode_to_the_same_weights() {
        let (l, mut rec, qs) = record();
        let path = Path::new("experts-001.bin");
        check_expert(&l, 0, &rec, path).unwrap();
        let lanes = expert_to_lanes(&l, &mut rec, &mut Vec::new());
        assert_eq!(lanes, [true; 3]);
        assert!(check_expert(&l, 0, &rec, path).is_err(), "the bytes moved");
        let shared: SharedBytes = std::sync::Arc::new(rec);
        let (g, u, d) = decode_expert_shared(&l, 0, &shared, path, false, lanes).unwrap();
        for (w, q) in [g, u, d].iter().zip(&qs) {
            let Linear::Quant(w) = w else {
                panic!("quantized")
            };
            assert_eq!(w.layout, Layout::Lanes16);
            assert!(*w.to_row_major() == *q);
        }
    }

    #[test]
    fn damaged_part_descriptions_never_panic_the_rearrangement() {
        let (l, rec, _) = record();
        let mut s = 0x9e37_79b9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        let picks = [0, 1, 16, 63, 64, 128, 4096, u32::MAX as u64, u64::MAX];
        for _ in 0..2000 {
            let mut l = l.clone();
            let p = match next() % 3 {
                0 => &mut l.gate,
                1 => &mut l.up,
                _ => &mut l.down,
            };
            let v = picks[next() as usize % picks.len()];
            match next() % 7 {
                0 => p.shape[0] = v as usize,
                1 => p.shape[1] = v as usize,
                2 => p.group = Some(v as usize),
                3 => p.data[0] = v,
                4 => p.data[1] = v,
                5 => p.scales = Some([v, p.scales.unwrap()[1]]),
                _ => p.scales = Some([p.scales.unwrap()[0], v]),
            }
            let mut r = rec.clone();
            let lanes = expert_to_lanes(&l, &mut r, &mut Vec::new());
            let shared: SharedBytes = std::sync::Arc::new(r);
            // an error or weights, never a panic
            let _ = decode_expert_shared(&l, 0, &shared, Path::new("x"), false, lanes);
        }
    }
}
