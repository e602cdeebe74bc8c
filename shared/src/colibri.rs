//! Reading model directories made by colibrì's converter (`out-*.safetensors`), so users who hold
//! that download need not convert again.
//!
//! Layout, as colibrì's `convert_fp8_to_int4.py` writes it: each quantized weight `NAME` is a flat
//! `U8` tensor of packed codes plus a flat `F32` tensor `NAME.qs` of scales; everything else
//! (norms, routers, correction biases) is stored as usual. colibrì's engine tells the formats
//! apart by byte counts, so this reader does too, against the `[rows, cols]` that config.json
//! implies, and accepts only unambiguous matches:
//!
//! | codes bytes | scales | format | value |
//! |---|---|---|---|
//! | `rows * cols` | `rows` | int8 per row | `s * q`, `q` the byte as i8 |
//! | `rows * ceil(cols / 2)` | `rows` | int4 per row | `s * (nibble - 8)`, even element in the low nibble |
//! | `rows * ceil(cols / 2)` | `rows * ceil(cols / g)` | int4, groups of `g` | as above, scale per group |
//! | `rows * ceil(cols / 4)` | `rows` | int2 per row | `s * (c - 2)`, element `4j + k` in bits `2k..2k+2` |
//!
//! Anything else (int3, the E8 lattice format whose `.qs` is a single tag, NVFP4, odd widths) is
//! refused with a message naming the tensor.

use crate::checkpoint::Checkpoint;
use crate::dtype::DType;
use crate::error::LoadError;
use crate::kernels::Matrix;
use crate::linear::Linear;
use crate::quant::{Layout, QMatrix, QuantKind};

/// Whether `dir` looks like a colibrì conversion (an `out-*.safetensors` shard).
pub fn is_colibri(dir: &std::path::Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok()).any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("out-") && n.ends_with(".safetensors")
        })
    })
}

fn flat<'a>(ck: &'a Checkpoint, name: &str, dtype: DType) -> Result<Option<&'a [u8]>, LoadError> {
    let Some((info, path)) = ck.info(name) else {
        return Ok(None);
    };
    if info.dtype != dtype {
        return Err(LoadError::Tensor {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!(
                "colibrì layout expects {}, found {}",
                dtype.name(),
                info.dtype.name()
            ),
        });
    }
    let shard = ck
        .shards
        .iter()
        .find(|s| s.path == path)
        .expect("listed shard");
    Ok(shard.bytes(name))
}

/// Decodes weight `name` of shape `[rows, cols]`: quantized when `NAME.qs` exists, else read as a
/// plain float tensor.
pub fn linear(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
    let qs_name = format!("{name}.qs");
    let Some(qs) = flat(ck, &qs_name, DType::F32)? else {
        return Ok(Linear::F32(Matrix::new(
            rows,
            cols,
            ck.f32(name, &[rows, cols])?,
        )));
    };
    let path = ck.info(&qs_name).expect("present").1.to_path_buf();
    let bad = |reason: String| LoadError::Tensor {
        path: path.clone(),
        tensor: name.to_string(),
        reason,
    };
    let codes = flat(ck, name, DType::U8)?
        .ok_or_else(|| bad("scales `.qs` without packed codes".into()))?;
    let scales: Vec<f32> = qs
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
        return Err(bad(format!("non-finite scale at {i}")));
    }
    let (l, q) = (codes.len(), scales.len());
    let (kind, group) = if l == rows * cols && q == rows {
        (QuantKind::Int8, cols)
    } else if l == rows * cols.div_ceil(2) {
        if q == rows {
            (QuantKind::Int4, cols)
        } else {
            let g = [16usize, 32, 64, 128, 256]
                .into_iter()
                .find(|g| q == rows * cols.div_ceil(*g) && cols.is_multiple_of(*g))
                .ok_or_else(|| bad(format!("unsupported colibrì format: int4 codes with {q} scales for [{rows}, {cols}] (no group size fits; a single scale is the E8 lattice format's tag)")))?;
            (QuantKind::Int4, g)
        }
    } else if l == rows * cols.div_ceil(4) && q == rows {
        (QuantKind::Int2, cols)
    } else {
        return Err(bad(format!(
            "unsupported colibrì format: {l} code bytes and {q} scales for [{rows}, {cols}] (charm reads int8, int4 and int4-grouped, int2; not int3, E8 or NVFP4)"
        )));
    };
    let packed_row = cols * kind.bits() / 8;
    if !cols.is_multiple_of(8) || packed_row * rows != l {
        return Err(bad(format!("width {cols} is not a multiple of 8")));
    }
    let ng = cols / group;
    let (scales, mins) = match kind {
        // colibrì's int2 is symmetric, codes 0..=3 meaning -2..=1: an affine level set with
        // min = -2 s.
        QuantKind::Int2 => (scales.clone(), scales.iter().map(|s| -2.0 * s).collect()),
        _ => (scales, Vec::new()),
    };
    debug_assert_eq!(scales.len(), rows * ng);
    Ok(Linear::Quant(QMatrix {
        rows,
        cols,
        kind,
        group,
        data: codes.to_vec().into(),
        scales: scales.into(),
        mins: mins.into(),
        layout: Layout::RowMajor,
        act: crate::quant::Activations::F32,
    }))
}
