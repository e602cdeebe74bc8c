//! A Hugging Face model directory as users download it: `config.json` plus one or many
//! `*.safetensors` shards (with or without `model.safetensors.index.json`).
//!
//! Shards are memory-mapped; a tensor's bytes are read only when [`Checkpoint::f32`] asks for it.
//! FP8 e4m3 weights with `weight_scale_inv` block scales (DeepSeek-V3 / GLM-5.2-FP8 layout) are
//! dequantized to f32 here, the one place that knows checkpoint layouts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::dtype::{self, DType};
use crate::error::LoadError;
use crate::safetensors::{SafetensorsFile, TensorInfo};

/// An opened model directory.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<SafetensorsFile>,
    /// Tensor name -> index into `shards`.
    index: BTreeMap<String, usize>,
    /// Edge of the square FP8 scale blocks (`quantization_config.weight_block_size`).
    pub fp8_block: Option<(usize, usize)>,
}

impl Checkpoint {
    /// Opens every shard of `dir`. Shards come from `model.safetensors.index.json` when present,
    /// otherwise from all `*.safetensors` files in the directory (sorted by name).
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| LoadError::config(&index_path, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| LoadError::config(&index_path, "no `weight_map` object"))?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    LoadError::config(
                        &index_path,
                        format!("weight_map[`{tensor}`] is not a string"),
                    )
                })?;
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(LoadError::config(
                        &index_path,
                        format!("weight_map names a file outside the directory: `{f}`"),
                    ));
                }
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
            }
            names.sort();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            // Without an index: `model.safetensors` alone, else the `model-XXXXX-of-YYYYY` shards,
            // else every `*.safetensors` (other files beside a model, such as reference outputs,
            // are not weights).
            let rd = std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))?;
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            let name = |p: &PathBuf| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("")
                    .to_string()
            };
            let shards: Vec<PathBuf> = v
                .iter()
                .filter(|p| {
                    let n = name(p);
                    n.starts_with("model-") && n.contains("-of-")
                })
                .cloned()
                .collect();
            if v.iter().any(|p| name(p) == "model.safetensors") {
                vec![dir.join("model.safetensors")]
            } else if !shards.is_empty() {
                shards
            } else {
                v
            }
        };
        if files.is_empty() {
            return Err(LoadError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index: BTreeMap<String, usize> = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            let shard = SafetensorsFile::open(f)?;
            for name in shard.header.tensors.keys() {
                if let Some(&j) = index.get(name) {
                    return Err(LoadError::DuplicateTensor {
                        tensor: name.clone(),
                        first: files[j].clone(),
                        second: f.clone(),
                    });
                }
                index.insert(name.clone(), i);
            }
            shards.push(shard);
        }
        let fp8_block = read_fp8_block(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            index,
            fp8_block,
        })
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(|s| s.as_str())
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Header entry and shard path of tensor `name`.
    pub fn info(&self, name: &str) -> Option<(&TensorInfo, &Path)> {
        let s = &self.shards[*self.index.get(name)?];
        Some((&s.header.tensors[name], &s.path))
    }

    fn missing(&self, name: &str) -> LoadError {
        LoadError::MissingTensor {
            dir: self.dir.clone(),
            tensor: name.to_string(),
        }
    }

    /// Reads tensor `name` as f32, checking its shape against `want` and that every value is
    /// finite. FP8 tensors are multiplied by their `<name>_scale_inv` block scales.
    pub fn f32(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.f32_rows(name, want, 0, want.first().copied().unwrap_or(1))
    }

    /// Reads slice `index` along the leading dimension of tensor `name` (e.g. one expert of a
    /// fused `[E, R, C]` tensor) as f32, decoding only that slice's bytes.
    pub fn f32_slice(
        &self,
        name: &str,
        want: &[usize],
        index: usize,
    ) -> Result<Vec<f32>, LoadError> {
        self.f32_rows(name, want, index, 1)
    }

    /// Reads `count` slices from `start` along the leading dimension of tensor `name` (rows of a
    /// matrix, experts of a fused tensor) as f32, decoding only those bytes. FP8 block scales and
    /// the finiteness check apply as in [`Checkpoint::f32`].
    pub fn f32_rows(
        &self,
        name: &str,
        want: &[usize],
        start: usize,
        count: usize,
    ) -> Result<Vec<f32>, LoadError> {
        let shard = &self.shards[*self.index.get(name).ok_or_else(|| self.missing(name))?];
        let info = &shard.header.tensors[name];
        let lead = want.first().copied().unwrap_or(1);
        if info.shape != want || start.checked_add(count).is_none_or(|e| e > lead) {
            return Err(LoadError::Shape {
                path: shard.path.clone(),
                tensor: name.to_string(),
                got: info.shape.clone(),
                want: want.to_vec(),
            });
        }
        let per: usize = want.iter().skip(1).product();
        let bytes = shard.bytes(name).expect("indexed tensor exists");
        let es = info.dtype.size();
        let part = &bytes[start * per * es..(start + count) * per * es];
        let mut v = dtype::to_f32(info.dtype, part).ok_or_else(|| LoadError::Tensor {
            path: shard.path.clone(),
            tensor: name.to_string(),
            reason: format!("dtype {} is not a floating-point type", info.dtype.name()),
        })?;
        if matches!(info.dtype, DType::F8E4M3 | DType::F8E5M2) {
            let scale_name = format!("{name}_scale_inv");
            if !self.has(&scale_name) || want.len() < 2 {
                return Err(LoadError::Tensor {
                    path: shard.path.clone(),
                    tensor: name.to_string(),
                    reason: format!("FP8 weight without its block scales `{scale_name}`"),
                });
            }
            let (br, bc) = self.fp8_block.unwrap_or((128, 128));
            let (r, c) = (want[want.len() - 2], want[want.len() - 1]);
            let (rb, cb) = (r.div_ceil(br), c.div_ceil(bc));
            let mut sw = want[..want.len() - 2].to_vec();
            sw.extend([rb, cb]);
            let scales = self.f32(&scale_name, &sw)?;
            let base = start * per;
            for (k, x) in v.iter_mut().enumerate() {
                let g = base + k;
                let (m, y, z) = (g / (r * c), (g / c) % r, g % c);
                *x *= scales[(m * rb + y / br) * cb + z / bc];
            }
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(LoadError::NonFinite {
                path: shard.path.clone(),
                tensor: name.to_string(),
                index: start * per + i,
            });
        }
        Ok(v)
    }

    /// Like [`Checkpoint::f32`] but `None` when the tensor is absent.
    pub fn f32_opt(&self, name: &str, want: &[usize]) -> Result<Option<Vec<f32>>, LoadError> {
        if self.has(name) {
            self.f32(name, want).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Total bytes stored per dtype (for `charm info`).
    pub fn bytes_per_dtype(&self) -> BTreeMap<DType, u64> {
        let mut m = BTreeMap::new();
        for s in &self.shards {
            for t in s.header.tensors.values() {
                *m.entry(t.dtype).or_insert(0) += (t.end - t.begin) as u64;
            }
        }
        m
    }
}

fn read_fp8_block(dir: &Path) -> Result<Option<(usize, usize)>, LoadError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Ok(None);
    };
    let Some(q) = v.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    if method != "fp8" {
        return Err(LoadError::config(
            &path,
            format!("unsupported quantization_config.quant_method `{method}` (charm reads `fp8` block-scaled checkpoints)"),
        ));
    }
    match q.get("weight_block_size").and_then(|b| b.as_array()) {
        Some(b) if b.len() == 2 => {
            let r = b[0].as_u64().filter(|&x| x > 0 && x <= 1 << 20);
            let c = b[1].as_u64().filter(|&x| x > 0 && x <= 1 << 20);
            match (r, c) {
                (Some(r), Some(c)) => Ok(Some((r as usize, c as usize))),
                _ => Err(LoadError::config(&path, "invalid weight_block_size")),
            }
        }
        None => Ok(Some((128, 128))),
        _ => Err(LoadError::config(&path, "invalid weight_block_size")),
    }
}
