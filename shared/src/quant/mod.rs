//! Quantized weight matrices (int8, int4, int2 with per-group scales; bf16) and their matmul
//! kernels, with the instruction set chosen at run time.
//!
//! Formats, per row of `cols` weights split into groups of `group` (a multiple of 8 dividing
//! `cols`; `group == cols` is per-row):
//! - `Int8`: one `i8` per weight, `w = scale[g] * q`, symmetric (`q` in -127..=127).
//! - `Int4`: two weights per byte (even index in the low nibble), stored as `q + 8`,
//!   `w = scale[g] * q`, symmetric (`q` in -7..=7).
//! - `Int2`: four weights per byte (index `4j + k` in bits `2k..2k+2`), `w = scale[g] * q + min[g]`,
//!   affine (`q` in 0..=3).
//! - `Bf16`: the top 16 bits of an f32 (round to nearest even), exact for bf16 checkpoints.
//!
//! Quantization: symmetric `scale = amax / qmax` (127 or 7, in f32), `q = round(w / scale)`;
//! int2 `scale = (max - min) / 3` and `q = round((w - min) / scale)` (`w - min` in f32). Quotients
//! are taken in f64 so the rounding is exact (bf16 weights often sit exactly halfway between two
//! levels, where an f32 quotient would round the tie either way); ties go away from zero.
//!
//! Every kernel reduces a row in a fixed order (per group: 8 lanes of fused multiply-adds over the
//! group; each lane accumulates `scale * partial`; a fixed tree over the 8 lanes at the end), so one
//! row's result is bit-identical whatever the batch size or thread count, and each SIMD path is
//! bit-identical to its scalar twin. [`Activations::Int8`] adds an integer path (exact i32 group
//! sums, then the same float steps on every ISA).

use crate::kernels::{par_lane_blocks, par_row_blocks, par_rows, Matrix};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
/// The GPU twin of the int8-activation path: its WGSL and buffer layout.
pub mod gpu;
mod lanes;
mod matmul;
/// The reference kernels.
pub mod scalar;
#[cfg(test)]
pub(crate) mod tests;

pub use lanes::{lanes_fit, lanes_in_place, lanes_wanted};
use lanes::{lanes_index, transpose_blocks};
use matmul::*;

/// A weight storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantKind {
    Bf16,
    Int8,
    Int4,
    Int2,
}

impl QuantKind {
    /// Bits per weight, scales excluded.
    pub const fn bits(self) -> usize {
        match self {
            Self::Bf16 => 16,
            Self::Int8 => 8,
            Self::Int4 => 4,
            Self::Int2 => 2,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
            Self::Int2 => "int2",
        }
    }
}

/// Bytes of one per-group scale (or int2 offset) on disk and in memory: f32.
pub const SCALE_BYTES: usize = 4;
/// Rows interleaved per block of [`Layout::Lanes16`].
pub const LANE_ROWS: usize = 16;
/// How far ahead the AVX-512 [`Layout::Lanes16`] kernel prefetches a block's weights, in spans
/// of 64 columns (16 rows x 64 codes: 1 KiB of int8, 512 bytes of int4, so 4-8 KiB): the
/// hardware prefetchers stop at 4 KiB page boundaries, and while a step of several tokens
/// computes, the next lines would otherwise arrive late. One span's lines are prefetched as each
/// span is read, whatever the group size: a matrix with one scale per row (a head stored like an
/// embedding table) streams like one of 64-wide groups.
#[cfg(target_arch = "x86_64")]
const PREFETCH_SPANS: usize = 8;
/// How many groups ahead the AVX2 [`Layout::Lanes16`] kernel prefetches a block's weights, a
/// group at a time (the same lines as [`PREFETCH_SPANS`] with 64-wide groups; with wider ones it
/// runs further ahead, in bursts). Span by span, as the AVX-512 kernel does, read int4 at 4-6
/// tokens in cache at 44-49 against 52-53 GB/s x tokens on Zen 4's AVX2 path, though that
/// loop's rate there also moves with where its code is placed (docs/benchmarks.md, design
/// notes); not timed on an AVX2-only CPU.
#[cfg(target_arch = "x86_64")]
const PREFETCH_GROUPS: usize = 8;

// The byte layouts the kernels and the container rely on, checked at compile time.
const _: () = assert!(std::mem::size_of::<f32>() == SCALE_BYTES);
// A Lanes16 load: one dword of each of the block's rows fills one 512-bit register.
const _: () = assert!(LANE_ROWS * 4 == 64);
// A 64-weight group: int8 codes fill one 512-bit load, int4 codes one 256-bit load (the
// integer path's nibble block), int2 codes one 128-bit load.
const _: () = assert!(QuantKind::Int8.bits() * 64 / 8 == 64);
const _: () = assert!(QuantKind::Int4.bits() * 64 / 8 == 32);
const _: () = assert!(QuantKind::Int2.bits() * 64 / 8 == 16);
// bf16 keeps the top half of an f32.
const _: () = assert!(QuantKind::Bf16.bits() * 2 == 8 * std::mem::size_of::<f32>());

/// The instruction-set path a kernel runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA (x86_64).
    Avx2,
    /// AVX-512 BW + VNNI on top of AVX2 (x86_64): the int8-activation integer path uses
    /// `vpdpbusd` on 64-weight groups; everything else runs the AVX2 kernels.
    Avx512Vnni,
}

impl Isa {
    /// The best path this CPU supports, detected at run time.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                {
                    return Self::Avx512Vnni;
                }
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// Every path this CPU can run (scalar first).
    pub fn available() -> Vec<Self> {
        let mut v = vec![Self::Scalar];
        match Self::detect() {
            Self::Avx2 => v.push(Self::Avx2),
            Self::Avx512Vnni => v.extend([Self::Avx2, Self::Avx512Vnni]),
            Self::Scalar => {}
        }
        v
    }
}

/// Quantizes one group of activations to int8 codes the way the integer path does (scale
/// `amax / 127`; every ISA gives these codes) and returns the scale.
pub fn quantize_activation_group(xs: &[f32], out: &mut [i8]) -> f32 {
    scalar::quantize_group(xs, out)
}

/// The path every kernel uses: [`Isa::detect`], unless `CHARM_ISA=scalar` forces the reference
/// path or `CHARM_ISA=avx2` the AVX2 path on a CPU that also has AVX-512 (for comparisons). Read
/// once.
pub fn active_isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| match std::env::var("CHARM_ISA").as_deref() {
        Ok("scalar") => Isa::Scalar,
        Ok("avx2") if Isa::available().contains(&Isa::Avx2) => Isa::Avx2,
        _ => Isa::detect(),
    })
}

/// How activations meet quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// f32 activations times decoded weights: the exact product of the stored weights.
    #[default]
    F32,
    /// Activations quantized to int8 per weight group (scale `amax / 127`, round to nearest), then
    /// integer dot products for int8 and int4 weights whose group is a multiple of 32 (faster;
    /// adds the activation rounding, measured in `docs/quality.md`). Other formats keep f32.
    Int8,
}

/// Why a matrix cannot be quantized as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("group size {group} must be a positive multiple of 8 dividing the {cols} columns")]
    Group { group: usize, cols: usize },
    #[error("weight at element {index} is not finite")]
    NonFinite { index: usize },
}

/// A byte buffer that can be shared: what [`WeightBytes`] and [`WeightFloats`] borrow from (an
/// expert record read from disk, decoded in place).
pub type SharedBytes = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Element types a shared byte buffer can be viewed as: every bit pattern is a valid value.
pub trait Plain: Copy + PartialEq + Send + Sync + 'static {}
impl Plain for u8 {}
impl Plain for f32 {}

/// Packed weights or their scales: owned, or a range of a shared buffer, so a weight read from
/// disk is used where it landed instead of being copied.
#[derive(Clone)]
pub struct SharedSlice<T: Plain>(SliceRepr<T>);

/// Packed weight bytes.
pub type WeightBytes = SharedSlice<u8>;
/// Per-group scales (or offsets).
pub type WeightFloats = SharedSlice<f32>;

#[derive(Clone)]
enum SliceRepr<T> {
    Owned(Vec<T>),
    /// Byte range of the buffer, aligned for `T` and a multiple of its size.
    Shared(SharedBytes, std::ops::Range<usize>),
}

impl<T: Plain> Default for SharedSlice<T> {
    fn default() -> Self {
        Self(SliceRepr::Owned(Vec::new()))
    }
}

impl<T: Plain> SharedSlice<T> {
    /// The values stored little-endian in byte range `range` of `buf`; `None` when the range lies
    /// outside it, is misaligned for `T`, or the host is big-endian (then decode a copy).
    pub fn shared(buf: SharedBytes, range: std::ops::Range<usize>) -> Option<Self> {
        let size = std::mem::size_of::<T>();
        let bytes = (*buf).as_ref().get(range.clone())?;
        let ok = cfg!(target_endian = "little")
            && range.len().is_multiple_of(size)
            && (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>());
        ok.then_some(Self(SliceRepr::Shared(buf, range)))
    }
}

impl<T: Plain> std::ops::Deref for SharedSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.0 {
            SliceRepr::Owned(v) => v,
            SliceRepr::Shared(b, r) => {
                let bytes = &(**b).as_ref()[r.clone()];
                // SAFETY: `shared` checked that the range lies in the buffer, is aligned for `T`
                // and a multiple of its size; `T` is `Plain` (any bit pattern is valid); the
                // buffer is immutable and kept alive by the `Arc`.
                unsafe {
                    std::slice::from_raw_parts(
                        bytes.as_ptr().cast::<T>(),
                        bytes.len() / std::mem::size_of::<T>(),
                    )
                }
            }
        }
    }
}

impl<T: Plain> From<Vec<T>> for SharedSlice<T> {
    fn from(v: Vec<T>) -> Self {
        Self(SliceRepr::Owned(v))
    }
}

impl<T: Plain> PartialEq for SharedSlice<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Plain> std::fmt::Debug for SharedSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{} x {}]", self.len(), std::any::type_name::<T>())
    }
}

/// How a [`QMatrix`] keeps its weights and scales in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// Row after row (`row_bytes()` each), scales `[rows, groups]`: the container's layout.
    #[default]
    RowMajor,
    /// Blocks of 16 rows, within a block group after group, within a group the rows' dword `d`
    /// (4 bytes of packed weights) side by side for each `d`: one 64-byte load holds the same 4
    /// (int8) or 8 (int4) weights of 16 rows, one per 32-bit lane. Scales: per block and group
    /// the 16 rows' scales side by side. The same bytes as [`Layout::RowMajor`], permuted (see
    /// [`QMatrix::to_lanes`]); the VNNI kernels then need no transpose, even for one token.
    Lanes16,
}

/// A quantized `[rows, cols]` matrix in `nn.Linear` layout.
#[derive(Clone, PartialEq)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub kind: QuantKind,
    pub group: usize,
    /// Packed weights, `row_bytes()` per row, arranged as `layout` says.
    pub data: WeightBytes,
    /// `[rows, cols / group]` scales (unused for bf16), arranged as `layout` says.
    pub scales: WeightFloats,
    /// `[rows, cols / group]` offsets (int2 only).
    pub mins: WeightFloats,
    pub layout: Layout,
    /// How [`crate::linear::Linear::matmul`] multiplies activations with this matrix: a load
    /// option of the model holding it (two models in one process may differ).
    pub act: Activations,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QMatrix[{}x{} {} g{}]",
            self.rows,
            self.cols,
            self.kind.name(),
            self.group
        )
    }
}

impl QMatrix {
    /// Bytes of packed weights per row.
    pub fn row_bytes(&self) -> usize {
        self.cols * self.kind.bits() / 8
    }

    fn groups(&self) -> usize {
        self.cols / self.group
    }

    /// Quantizes `m` (round to nearest, ties away from zero).
    pub fn quantize(m: &Matrix, kind: QuantKind, group: usize) -> Result<Self, QuantError> {
        let (rows, cols) = (m.rows, m.cols);
        if group == 0 || !group.is_multiple_of(8) || !cols.is_multiple_of(group) {
            return Err(QuantError::Group { group, cols });
        }
        if let Some(index) = m.data.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite { index });
        }
        let ng = cols / group;
        let mut q = QMatrix {
            rows,
            cols,
            kind,
            group,
            data: WeightBytes::default(),
            scales: WeightFloats::default(),
            mins: WeightFloats::default(),
            layout: Layout::RowMajor,
            act: Activations::F32,
        };
        let (mut scales, mut mins) = (Vec::new(), Vec::new());
        let mut data: Vec<u8> = Vec::with_capacity(rows * q.row_bytes());
        for r in 0..rows {
            let row = m.row(r);
            if kind == QuantKind::Bf16 {
                for v in row {
                    data.extend_from_slice(&bf16_round(*v).to_le_bytes());
                }
                continue;
            }
            let mut codes: Vec<u8> = Vec::with_capacity(cols);
            for g in 0..ng {
                let w = &row[g * group..(g + 1) * group];
                match kind {
                    QuantKind::Int8 | QuantKind::Int4 => {
                        let qmax = if kind == QuantKind::Int8 { 127.0 } else { 7.0 };
                        let amax = w.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                        let scale = amax / qmax;
                        scales.push(scale);
                        for v in w {
                            let c = if scale > 0.0 {
                                (*v as f64 / scale as f64)
                                    .round()
                                    .clamp(-qmax as f64, qmax as f64)
                                    as i32
                            } else {
                                0
                            };
                            codes.push(if kind == QuantKind::Int8 {
                                c as i8 as u8
                            } else {
                                (c + 8) as u8
                            });
                        }
                    }
                    QuantKind::Int2 => {
                        let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
                        let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let scale = (hi - lo) / 3.0;
                        scales.push(scale);
                        mins.push(lo);
                        for v in w {
                            codes.push(if scale > 0.0 {
                                ((v - lo) as f64 / scale as f64).round().clamp(0.0, 3.0) as u8
                            } else {
                                0
                            });
                        }
                    }
                    QuantKind::Bf16 => unreachable!(),
                }
            }
            match kind {
                QuantKind::Int8 => data.extend_from_slice(&codes),
                QuantKind::Int4 => data.extend(codes.chunks_exact(2).map(|c| c[0] | (c[1] << 4))),
                QuantKind::Int2 => data.extend(
                    codes
                        .chunks_exact(4)
                        .map(|c| c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6)),
                ),
                QuantKind::Bf16 => unreachable!(),
            }
        }
        q.data = data.into();
        q.scales = scales.into();
        q.mins = mins.into();
        Ok(q)
    }

    /// Whether [`QMatrix::to_lanes`] applies (see [`lanes_fit`]) and the matrix is row-major.
    pub fn lanes_apply(&self) -> bool {
        lanes_fit(self.kind, self.rows, self.group) && self.layout == Layout::RowMajor
    }

    /// This matrix in [`Layout::Lanes16`] (the same bytes, permuted), or `None` where that does
    /// not apply (see [`QMatrix::lanes_apply`]). Multiplied with int8 activations on the VNNI
    /// path it gives bit-identical results, faster; any other path converts it back per call.
    pub fn to_lanes(&self) -> Option<QMatrix> {
        self.lanes_apply().then(|| self.relaid(Layout::Lanes16))
    }

    /// This matrix in [`Layout::RowMajor`] (borrowed when it already is).
    pub fn to_row_major(&self) -> std::borrow::Cow<'_, QMatrix> {
        if self.layout == Layout::RowMajor {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(self.relaid(Layout::RowMajor))
    }

    /// A copy of this int8/int4 matrix moved between the two layouts (to `to`, from the other).
    fn relaid(&self, to: Layout) -> QMatrix {
        let to_lanes = to == Layout::Lanes16;
        let mut data = self.data.to_vec();
        let mut scales: Vec<u8> = self.scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut scratch = Vec::new();
        let row_dwords = self.row_bytes() / 4;
        transpose_blocks(&mut data, row_dwords, to_lanes, &mut scratch);
        transpose_blocks(&mut scales, self.groups(), to_lanes, &mut scratch);
        QMatrix {
            data: data.into(),
            scales: scales
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect::<Vec<_>>()
                .into(),
            layout: to,
            ..self.clone_shape()
        }
    }

    /// Shape and format, no weights.
    fn clone_shape(&self) -> QMatrix {
        QMatrix {
            rows: self.rows,
            cols: self.cols,
            kind: self.kind,
            group: self.group,
            data: WeightBytes::default(),
            scales: WeightFloats::default(),
            mins: self.mins.clone(),
            layout: self.layout,
            act: self.act,
        }
    }

    /// Row `r` as f32 (the exact values the kernels multiply by).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        if self.layout != Layout::RowMajor {
            // gather the row's dwords and scales
            let (ng, dpg) = (self.groups(), self.group * self.kind.bits() / 32);
            let mut one = self.clone_shape();
            one.rows = 1;
            one.layout = Layout::RowMajor;
            let mut data = Vec::with_capacity(self.row_bytes());
            let mut scales = Vec::with_capacity(ng);
            for g in 0..ng {
                scales.push(self.scales[lanes_index(r, g, 0, ng, 1)]);
                for d in 0..dpg {
                    let at = 4 * lanes_index(r, g, d, ng, dpg);
                    data.extend_from_slice(&self.data[at..at + 4]);
                }
            }
            one.data = data.into();
            one.scales = scales.into();
            return one.dequantize_row(0);
        }
        let mut out = vec![0.0f32; self.cols];
        self.dequantize_row_into(r, &mut out);
        out
    }

    /// [`Self::dequantize_row`] into `out` (`cols` floats), without allocating for a row-major
    /// matrix: what a kernel that multiplies by f32 rows reads a quantized weight through.
    pub fn dequantize_row_into(&self, r: usize, out: &mut [f32]) {
        self.dequantize_row_on(r, out, active_isa());
    }

    /// [`Self::dequantize_row_into`] on `isa`: the row's codes decoded by the kernels' own
    /// decoder, then each group's `scale * code` (int2: `scale * code + min`; bf16 values as
    /// they are). Every ISA gives the same bits.
    pub(crate) fn dequantize_row_on(&self, r: usize, out: &mut [f32], isa: Isa) {
        assert_eq!(out.len(), self.cols, "dequantized row has the wrong length");
        if self.layout != Layout::RowMajor {
            out.copy_from_slice(&self.dequantize_row(r));
            return;
        }
        let (rb, ng) = (self.row_bytes(), self.groups());
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Avx2 | Isa::Avx512Vnni)
            && matches!(self.kind, QuantKind::Int8 | QuantKind::Int4)
            && self.group.is_multiple_of(8)
        {
            // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma (implied by
            // Avx512Vnni).
            unsafe {
                avx2::dequantize_row(
                    self.kind,
                    self.group,
                    &self.data[r * rb..(r + 1) * rb],
                    &self.scales[r * ng..(r + 1) * ng],
                    out,
                )
            };
            return;
        }
        matmul::decode_row(self.kind, &self.data[r * rb..(r + 1) * rb], out, isa);
        if self.kind == QuantKind::Bf16 {
            return;
        }
        for (g, o) in out.chunks_exact_mut(self.group).enumerate() {
            let sc = self.scales[r * ng + g];
            if self.kind == QuantKind::Int2 {
                let min = self.mins[r * ng + g];
                o.iter_mut().for_each(|v| *v = sc * *v + min);
            } else {
                o.iter_mut().for_each(|v| *v *= sc);
            }
        }
    }

    /// The whole matrix as f32.
    pub fn dequantize(&self) -> Matrix {
        if self.layout != Layout::RowMajor {
            return self.to_row_major().dequantize();
        }
        Matrix::new(
            self.rows,
            self.cols,
            (0..self.rows)
                .flat_map(|r| self.dequantize_row(r))
                .collect(),
        )
    }

    /// Whether [`Activations::Int8`] applies to this matrix.
    pub fn integer_path(&self) -> bool {
        matches!(self.kind, QuantKind::Int8 | QuantKind::Int4) && self.group.is_multiple_of(32)
    }
}

/// f32 -> bf16 bits, round to nearest even.
pub fn bf16_round(v: f32) -> u16 {
    let b = v.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    (r >> 16) as u16
}
