//! The safetensors format: header parsing (untrusted bytes), memory-mapped files and a small writer.
//!
//! Layout: an 8-byte little-endian header length `N`, `N` bytes of JSON mapping tensor names to
//! `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data area that follows the
//! header), then the data. The parser is our own rather than the `safetensors` crate's because every
//! failure must name the file and the tensor, and because it is fuzzed as charm's first line of
//! defence against damaged downloads (`fuzz/fuzz_targets/safetensors_header.rs`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::LoadError;

/// Largest header we accept. Real checkpoints have headers of a few hundred KiB.
pub const MAX_HEADER_BYTES: u64 = 100 << 20;
/// The length prefix before the JSON header: a little-endian u64.
pub const HEADER_PREFIX: usize = 8;
const _: () = assert!(std::mem::size_of::<u64>() == HEADER_PREFIX);
/// Largest rank we accept for one tensor.
pub const MAX_RANK: usize = 8;

/// One tensor's entry in a safetensors header, validated against the file size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range inside the data area (after the header).
    pub begin: usize,
    pub end: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed, validated header.
#[derive(Debug, Clone, Default)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Offset of the data area from the start of the file (8 + header length).
    pub data_start: usize,
}

/// Why a header was refused; [`parse_header`] callers attach the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Framing or JSON problem.
    Header(String),
    /// A problem with one tensor's entry.
    Tensor { tensor: String, reason: String },
}

impl HeaderError {
    /// Attaches the file path.
    pub fn at(self, path: &Path) -> LoadError {
        match self {
            Self::Header(reason) => LoadError::Header {
                path: path.to_path_buf(),
                reason,
            },
            Self::Tensor { tensor, reason } => LoadError::Tensor {
                path: path.to_path_buf(),
                tensor,
                reason,
            },
        }
    }
}

fn tensor_err(tensor: &str, reason: impl Into<String>) -> HeaderError {
    HeaderError::Tensor {
        tensor: tensor.to_string(),
        reason: reason.into(),
    }
}

/// Parses and validates the header of a safetensors file of `file_len` bytes whose first bytes are
/// `prefix` (it must hold at least the whole header). Checks: framing, JSON, dtypes, shapes
/// (element count x dtype size == byte count, no overflow), offsets inside the data area, no two
/// tensors overlapping.
pub fn parse_header(prefix: &[u8], file_len: u64) -> Result<Header, HeaderError> {
    if file_len < HEADER_PREFIX as u64 || prefix.len() < HEADER_PREFIX {
        return Err(HeaderError::Header(format!(
            "file is {file_len} bytes, too short for the 8-byte header length"
        )));
    }
    let n = u64::from_le_bytes(prefix[..HEADER_PREFIX].try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(HeaderError::Header(format!(
            "header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    if n > file_len - 8 {
        return Err(HeaderError::Header(format!(
            "header length {n} runs past the end of the {file_len}-byte file"
        )));
    }
    let n = n as usize;
    if prefix.len() < 8 + n {
        return Err(HeaderError::Header("header truncated".into()));
    }
    let json: serde_json::Value = serde_json::from_slice(&prefix[8..8 + n])
        .map_err(|e| HeaderError::Header(format!("header is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| HeaderError::Header("header JSON is not an object".into()))?;
    let data_len = file_len - 8 - n as u64;
    let mut header = Header {
        data_start: 8 + n,
        ..Header::default()
    };
    for (name, entry) in obj {
        if name == "__metadata__" {
            let m = entry
                .as_object()
                .ok_or_else(|| HeaderError::Header("__metadata__ is not an object".into()))?;
            for (k, v) in m {
                let v = v.as_str().ok_or_else(|| {
                    HeaderError::Header(format!("__metadata__ value `{k}` is not a string"))
                })?;
                header.metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        let e = entry
            .as_object()
            .ok_or_else(|| tensor_err(name, "entry is not an object"))?;
        let dtype_s = e
            .get("dtype")
            .and_then(|v| v.as_str())
            .ok_or_else(|| tensor_err(name, "missing string `dtype`"))?;
        let dtype = DType::parse(dtype_s)
            .ok_or_else(|| tensor_err(name, format!("unknown dtype `{dtype_s}`")))?;
        let shape_v = e
            .get("shape")
            .and_then(|v| v.as_array())
            .ok_or_else(|| tensor_err(name, "missing array `shape`"))?;
        if shape_v.len() > MAX_RANK {
            return Err(tensor_err(
                name,
                format!("rank {} exceeds {MAX_RANK}", shape_v.len()),
            ));
        }
        let mut shape = Vec::with_capacity(shape_v.len());
        for d in shape_v {
            let d = d
                .as_u64()
                .ok_or_else(|| tensor_err(name, "shape holds a non-integer"))?;
            shape.push(
                usize::try_from(d).map_err(|_| tensor_err(name, "dimension overflows usize"))?,
            );
        }
        let offs = e
            .get("data_offsets")
            .and_then(|v| v.as_array())
            .filter(|a| a.len() == 2)
            .ok_or_else(|| tensor_err(name, "missing `data_offsets` [begin, end]"))?;
        let (begin, end) = match (offs[0].as_u64(), offs[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => return Err(tensor_err(name, "data_offsets are not integers")),
        };
        if begin > end {
            return Err(tensor_err(
                name,
                format!("data_offsets [{begin}, {end}] are reversed"),
            ));
        }
        if end > data_len {
            return Err(tensor_err(
                name,
                format!(
                    "data_offsets [{begin}, {end}] lie outside the {data_len}-byte data area (file truncated?)"
                ),
            ));
        }
        let bytes = shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| tensor_err(name, "shape x dtype size overflows"))?;
        if bytes != end - begin {
            return Err(tensor_err(
                name,
                format!(
                    "shape {shape:?} x {} ({} bytes) != {} bytes in data_offsets",
                    dtype.name(),
                    bytes,
                    end - begin
                ),
            ));
        }
        header.tensors.insert(
            name.clone(),
            TensorInfo {
                dtype,
                shape,
                begin: begin as usize,
                end: end as usize,
            },
        );
    }
    // No two tensors may share bytes.
    let mut ranges: Vec<(&String, &TensorInfo)> = header
        .tensors
        .iter()
        .filter(|(_, t)| t.end > t.begin)
        .collect();
    ranges.sort_by_key(|(_, t)| (t.begin, t.end));
    for w in ranges.windows(2) {
        if w[1].1.begin < w[0].1.end {
            return Err(tensor_err(
                w[1].0,
                format!(
                    "data_offsets [{}, {}] overlap tensor `{}` [{}, {}]",
                    w[1].1.begin, w[1].1.end, w[0].0, w[0].1.begin, w[0].1.end
                ),
            ));
        }
    }
    Ok(header)
}

/// A memory-mapped safetensors file. Tensor bytes are only touched when asked for.
#[derive(Debug)]
pub struct SafetensorsFile {
    pub path: PathBuf,
    pub header: Header,
    map: Arc<memmap2::Mmap>,
}

impl SafetensorsFile {
    /// Maps `path` and validates its header.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let file = File::open(path).map_err(|e| LoadError::io(path, e))?;
        let len = file.metadata().map_err(|e| LoadError::io(path, e))?.len();
        if len < 8 {
            return Err(HeaderError::Header(format!(
                "file is {len} bytes, too short for the 8-byte header length"
            ))
            .at(path));
        }
        // SAFETY: the mapping is read-only; charm never writes to checkpoint files. A concurrent
        // truncation by another process would fault, as with any mmap-based loader (this is the
        // documented contract of memmap2::Mmap).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let header = parse_header(&map, len).map_err(|e| e.at(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            header,
            map: Arc::new(map),
        })
    }

    /// The raw bytes of tensor `name` (validated to lie inside the file at open).
    /// Integer tensor `name` as i64 (I64, I32, I16, I8, U32, U16, U8; U64 values must fit).
    /// An error names what is wrong: absent, not an integer dtype, or out of range.
    pub fn ints(&self, name: &str) -> Result<Vec<i64>, String> {
        use crate::dtype::DType;
        let t = self
            .header
            .tensors
            .get(name)
            .ok_or_else(|| format!("no tensor `{name}`"))?;
        let b = self.bytes(name).expect("listed");
        fn le<const N: usize>(b: &[u8], f: fn([u8; N]) -> i64) -> Vec<i64> {
            b.chunks_exact(N)
                .map(|c| f(c.try_into().expect("chunk of N")))
                .collect()
        }
        Ok(match t.dtype {
            DType::I64 => le(b, i64::from_le_bytes),
            DType::I32 => le(b, |c| i32::from_le_bytes(c) as i64),
            DType::I16 => le(b, |c| i16::from_le_bytes(c) as i64),
            DType::I8 => le(b, |c: [u8; 1]| c[0] as i8 as i64),
            DType::U32 => le(b, |c| u32::from_le_bytes(c) as i64),
            DType::U16 => le(b, |c| u16::from_le_bytes(c) as i64),
            DType::U8 => le(b, |c: [u8; 1]| c[0] as i64),
            DType::U64 => b
                .chunks_exact(8)
                .map(|c| {
                    i64::try_from(u64::from_le_bytes(c.try_into().expect("8")))
                        .map_err(|_| format!("`{name}` holds a value beyond i64"))
                })
                .collect::<Result<_, _>>()?,
            d => return Err(format!("`{name}` is {}, not an integer tensor", d.name())),
        })
    }

    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let t = self.header.tensors.get(name)?;
        let s = self.header.data_start;
        Some(&self.map[s + t.begin..s + t.end])
    }
}

/// Writes f32 tensors as a safetensors file (used by `charm logits`).
pub fn write_f32(path: &Path, tensors: &[(&str, Vec<usize>, &[f32])]) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let n: usize = shape.iter().product();
        assert_eq!(n, data.len(), "tensor {name}: shape does not match data");
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + 4 * n]}),
        );
        offset += 4 * n;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::io::BufWriter::new(File::create(&tmp)?);
        f.write_all(&(h.len() as u64).to_le_bytes())?;
        f.write_all(&h)?;
        for (_, _, data) in tensors {
            for v in data.iter() {
                f.write_all(&v.to_le_bytes())?;
            }
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    fn parse(b: &[u8]) -> Result<Header, HeaderError> {
        parse_header(b, b.len() as u64)
    }

    #[test]
    fn accepts_valid() {
        let b = file(
            r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}"#,
            16,
        );
        let h = parse(&b).unwrap();
        assert_eq!(h.tensors["a"].shape, vec![2, 3]);
        assert_eq!(h.tensors["b"].numel(), 1);
        assert_eq!(h.metadata["format"], "pt");
    }

    #[test]
    fn refuses_header_past_end() {
        let mut b = file(r#"{}"#, 0);
        b[..8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(matches!(parse(&b), Err(HeaderError::Header(r)) if r.contains("past the end")));
    }

    #[test]
    fn refuses_offsets_outside() {
        let b = file(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            8,
        );
        assert!(
            matches!(parse(&b), Err(HeaderError::Tensor{tensor, reason}) if tensor == "a" && reason.contains("outside"))
        );
    }

    #[test]
    fn refuses_overlap() {
        let b = file(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            12,
        );
        assert!(
            matches!(parse(&b), Err(HeaderError::Tensor{reason, ..}) if reason.contains("overlap"))
        );
    }

    #[test]
    fn refuses_shape_bytes_mismatch() {
        let b = file(
            r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(matches!(parse(&b), Err(HeaderError::Tensor{reason, ..}) if reason.contains("!=")));
    }

    #[test]
    fn refuses_overflowing_shape() {
        let b = file(
            r#"{"a":{"dtype":"F32","shape":[18446744073709551615,4],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(parse(&b).is_err());
    }

    #[test]
    fn refuses_short_and_garbage() {
        assert!(parse(&[1, 2, 3]).is_err());
        let b = file("not json", 0);
        assert!(matches!(parse(&b), Err(HeaderError::Header(r)) if r.contains("JSON")));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn never_panics_on_mutated_valid(pos in 8usize..120, byte in proptest::prelude::any::<u8>(), cut in 0usize..140) {
            let mut b = file(
                r#"{"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}"#,
                16,
            );
            let p = pos.min(b.len() - 1);
            b[p] = byte;
            b.truncate(cut.max(1).min(b.len()));
            if let Ok(h) = parse(&b) {
                for t in h.tensors.values() {
                    proptest::prop_assert!(t.end as u64 <= b.len() as u64 - h.data_start as u64);
                }
            }
        }
    }

    #[test]
    fn ints_decode_integer_dtypes_and_refuse_others() {
        let mut b = file(
            r#"{"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[2],"data_offsets":[8,10]},"c":{"dtype":"F64","shape":[1],"data_offsets":[16,24]}}"#,
            24,
        );
        let d = b.len() - 24;
        b[d..d + 4].copy_from_slice(&(-3i32).to_le_bytes());
        b[d + 4..d + 8].copy_from_slice(&7i32.to_le_bytes());
        b[d + 8] = 200;
        let p = std::env::temp_dir().join(format!("charm-ints-{}.safetensors", std::process::id()));
        std::fs::write(&p, &b).unwrap();
        let f = SafetensorsFile::open(&p).unwrap();
        assert_eq!(f.ints("a").unwrap(), vec![-3, 7]);
        assert_eq!(f.ints("b").unwrap(), vec![200, 0]);
        assert!(f.ints("c").unwrap_err().contains("not an integer"));
        assert!(f.ints("zz").unwrap_err().contains("no tensor"));
        std::fs::remove_file(&p).unwrap();
    }
}
