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

use crate::kernels::{par_row_blocks, par_rows, Matrix};

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

/// The path every kernel uses: [`Isa::detect`], unless `CHARM_ISA=scalar` forces the reference
/// path (for comparisons). Read once.
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
    /// How [`crate::kernels::Linear::matmul`] multiplies activations with this matrix: a load
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
        let b = &self.data[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let ng = self.groups();
        (0..self.cols)
            .map(|i| {
                let g = r * ng + i / self.group;
                match self.kind {
                    QuantKind::Bf16 => {
                        crate::dtype::bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]))
                    }
                    QuantKind::Int8 => self.scales[g] * (b[i] as i8) as f32,
                    QuantKind::Int4 => {
                        self.scales[g] * (((b[i / 2] >> (4 * (i % 2))) & 15) as i32 - 8) as f32
                    }
                    QuantKind::Int2 => {
                        self.scales[g] * ((b[i / 4] >> (2 * (i % 4))) & 3) as f32 + self.mins[g]
                    }
                }
            })
            .collect()
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

    /// `y[t, o] = sum_i x[t, i] * W[o, i]` for `n` tokens on `isa`; `x` is `[n, cols]`.
    pub fn matmul(&self, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        self.matmul_with(x, n, isa, Activations::F32)
    }

    /// [`QMatrix::matmul`] with an explicit activation mode.
    pub fn matmul_with(&self, x: &[f32], n: usize, isa: Isa, act: Activations) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "matmul input is not [n, cols]");
        if self.layout != Layout::RowMajor && !(act == Activations::Int8 && isa == Isa::Avx512Vnni)
        {
            // the lane layout has kernels on the VNNI integer path only
            return self.to_row_major().matmul_with(x, n, isa, act);
        }
        if act == Activations::Int8 && self.integer_path() {
            return self.matmul_int8(x, n, isa);
        }
        let ng = self.groups();
        // Per-token group sums of x, for the affine int2 offset term.
        let xsum: Vec<f32> = if self.kind == QuantKind::Int2 {
            x.chunks(self.group).map(lane_sum_scalar).collect()
        } else {
            Vec::new()
        };
        let rb = self.row_bytes();
        let cols = self.cols;
        // Several tokens: decode each row's codes once, then one pass per token over them. The
        // arithmetic is the same as decoding on the fly, so results do not depend on `n`.
        let scratch = || {
            if n > 1 {
                vec![0.0f32; cols]
            } else {
                Vec::new()
            }
        };
        let (data, scales, mins): (&[u8], &[f32], &[f32]) = (&self.data, &self.scales, &self.mins);
        #[cfg(target_arch = "x86_64")]
        if n == 1 && self.kind != QuantKind::Bf16 && matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
            // One token: 4 rows at a time with independent accumulator chains (each row's
            // arithmetic is the one-row kernel's), the next block's weights prefetched. (bf16 rows
            // are cheap to decode and twice as long: one row at a time streams them faster.)
            return par_row_blocks(self.rows, 1, 4, rb, |r0, out| {
                let k = out.len();
                let full = k - k % 4;
                for i in (0..full).step_by(4) {
                    let r = r0 + i;
                    let ahead =
                        &data[((r + 4) * rb).min(data.len())..((r + 8) * rb).min(data.len())];
                    // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma.
                    let v = unsafe {
                        avx2::rows_dot::<4>(
                            self.kind,
                            self.group,
                            std::array::from_fn(|j| &data[(r + j) * rb..(r + j + 1) * rb]),
                            std::array::from_fn(|j| part(scales, r + j, ng)),
                            std::array::from_fn(|j| part(mins, r + j, ng)),
                            x,
                            &xsum,
                            ahead,
                        )
                    };
                    out[i..i + 4].copy_from_slice(&v);
                }
                for i in full..k {
                    let r = r0 + i;
                    out[i] = row_dot(
                        self.kind,
                        self.group,
                        Codes::Packed(&data[r * rb..(r + 1) * rb]),
                        part(scales, r, ng),
                        part(mins, r, ng),
                        x,
                        &xsum,
                        isa,
                    );
                }
            });
        }
        par_rows(self.rows, n, rb, scratch, |codes, r, out| {
            let row = &data[r * rb..(r + 1) * rb];
            let (sc, mn) = (part(scales, r, ng), part(mins, r, ng));
            let xs_of = |t: usize| {
                if xsum.is_empty() {
                    &[][..]
                } else {
                    &xsum[t * ng..(t + 1) * ng]
                }
            };
            if n == 1 {
                out[0] = row_dot(
                    self.kind,
                    self.group,
                    Codes::Packed(row),
                    sc,
                    mn,
                    x,
                    xs_of(0),
                    isa,
                );
            } else {
                decode_row(self.kind, row, codes, isa);
                // the tokens left to the one-token kernel
                #[allow(unused_mut)]
                let mut start = 0;
                #[cfg(target_arch = "x86_64")]
                if matches!(isa, Isa::Avx2 | Isa::Avx512Vnni) {
                    // 4 tokens at a time over the decoded codes, chains interleaved; per token
                    // the one-token arithmetic
                    start = n - n % 4;
                    for t0 in (0..start).step_by(4) {
                        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma.
                        let v = unsafe {
                            avx2::codes_dot::<4>(
                                self.kind,
                                self.group,
                                codes,
                                sc,
                                mn,
                                std::array::from_fn(|i| &x[(t0 + i) * cols..(t0 + i + 1) * cols]),
                                std::array::from_fn(|i| xs_of(t0 + i)),
                            )
                        };
                        out[t0..t0 + 4].copy_from_slice(&v);
                    }
                }
                for (t, v) in out.iter_mut().enumerate().skip(start) {
                    let xt = &x[t * cols..(t + 1) * cols];
                    *v = row_dot(
                        self.kind,
                        self.group,
                        Codes::Decoded(codes),
                        sc,
                        mn,
                        xt,
                        xs_of(t),
                        isa,
                    );
                }
            }
        })
    }
}

impl QMatrix {
    /// The integer path: activations quantized per group, exact i32 dot products per group, then
    /// `acc = fma(scale_w[g] * scale_x[g], isum[g], acc)` in group order, one accumulator per row
    /// and token (the same on every ISA, for any number of rows and tokens computed together).
    fn matmul_int8(&self, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        let (cols, group, ng) = (self.cols, self.group, self.groups());
        let int4 = self.kind == QuantKind::Int4;
        let qx: Vec<QuantizedActs> = (0..n)
            .map(|t| QuantizedActs::new(&x[t * cols..(t + 1) * cols], group, int4, isa))
            .collect();
        let rb = self.row_bytes();
        // plain slices once (the weights may live in a shared I/O buffer behind a handle)
        let (data, scales): (&[u8], &[f32]) = (&self.data, &self.scales);
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Lanes16 {
            // 16 rows at a time straight from the lane layout, any number of tokens
            return par_row_blocks(self.rows, n, 16, rb, |r0, out| {
                for (i, o) in out.chunks_exact_mut(16 * n).enumerate() {
                    let r = r0 + 16 * i;
                    // SAFETY: a `Lanes16` matrix reaches here only with `Isa::Avx512Vnni`, which
                    // is only constructed after checking avx512f/bw/vnni and avx2.
                    unsafe {
                        avx512::lanes16_dot_i8(
                            self.kind,
                            group,
                            &data[r * rb..(r + 16) * rb],
                            &scales[r * ng..(r + 16) * ng],
                            &qx,
                            o,
                        )
                    };
                }
            });
        }
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx512Vnni && group.is_multiple_of(64) && n >= LANE_ROWS_MIN_TOKENS {
            // Many tokens: 16 rows at a time, one row per lane (weights transposed once per block).
            return par_row_blocks(self.rows, n, 16, rb, |r0, out| {
                let k = out.len() / n;
                let mut scratch = avx512::LaneScratch::default();
                for i in (0..k).step_by(16) {
                    let nr = 16.min(k - i);
                    let r = r0 + i;
                    // the next block's weights, prefetched while this one is transposed
                    let ahead = &data
                        [((r + nr) * rb).min(data.len())..((r + nr + 16) * rb).min(data.len())];
                    // SAFETY: `Isa::Avx512Vnni` is only constructed after checking
                    // avx512f/bw/vnni and avx2.
                    unsafe {
                        avx512::rows16_dot_i8(
                            self.kind,
                            group,
                            &data[r * rb..(r + nr) * rb],
                            &scales[r * ng..(r + nr) * ng],
                            &qx,
                            &mut scratch,
                            &mut out[i * n..(i + nr) * n],
                            ahead,
                        )
                    };
                }
            });
        }
        let row = |r: usize| &data[r * rb..(r + 1) * rb];
        let sc = |r: usize| &scales[r * ng..(r + 1) * ng];
        // Computes rows `r0..r0 + R` (`k0` within this chunk) against tokens `t0..t0 + T`.
        let block = |out: &mut [f32], k0: usize, r0: usize, t0: usize, r_t: (usize, usize)| {
            macro_rules! run {
                ($r:literal, $t:literal) => {{
                    // the weights of the block after this one
                    let from = ((r0 + $r) * rb).min(data.len());
                    let to = ((r0 + 2 * $r) * rb).min(data.len());
                    let ahead = &data[from..to];
                    let res = block_dot_i8::<$r, $t>(
                        self.kind,
                        group,
                        std::array::from_fn(|i| row(r0 + i)),
                        std::array::from_fn(|i| sc(r0 + i)),
                        std::array::from_fn(|i| &qx[t0 + i]),
                        ahead,
                        isa,
                    );
                    for (i, rr) in res.iter().enumerate() {
                        out[(k0 + i) * n + t0..][..$t].copy_from_slice(rr);
                    }
                }};
            }
            match r_t {
                (1, 4) => run!(1, 4),
                (4, 1) => run!(4, 1),
                _ => run!(1, 1),
            }
        };
        par_row_blocks(self.rows, n, ROW_BLOCK, rb, |r0, out| {
            let k = out.len() / n;
            // Tiles of 4 tokens a row at a time; the remaining tokens 4 rows at a time.
            let full = n - n % 4;
            for i in 0..k {
                for t0 in (0..full).step_by(4) {
                    block(out, i, r0 + i, t0, (1, 4));
                }
            }
            for t0 in full..n {
                let mut i = 0;
                while i < k {
                    let r = if k - i >= 4 { 4 } else { 1 };
                    block(out, i, r0 + i, t0, (r, 1));
                    i += r;
                }
            }
        })
    }
}

/// Elements per nibble block of int4 weights on the integer path: 64 where the group allows
/// (one 32-byte load of packed weights), else 32.
fn nibble_block(group: usize) -> usize {
    if group.is_multiple_of(64) {
        64
    } else {
        32
    }
}

/// One token's activations quantized to int8 per group. For int4 weights each nibble block (see
/// [`nibble_block`]) is stored in nibble order, its even elements then its odd ones, so that the
/// packed bytes' low nibbles meet the first half and their high nibbles the second.
struct QuantizedActs {
    q: Vec<i8>,
    scale: Vec<f32>,
    /// Per group: the sum of its int8 activations, for the offset correction of kernels that
    /// feed weights as unsigned bytes (`q + 8` for int4, `w + 128` for int8).
    gsum: Vec<i32>,
}

impl QuantizedActs {
    fn new(x: &[f32], group: usize, nibble_order: bool, isa: Isa) -> Self {
        let mut q = vec![0i8; x.len()];
        let mut scale = Vec::with_capacity(x.len() / group);
        let nb = nibble_block(group);
        let mut codes = vec![0i8; group];
        for (g, xs) in x.chunks(group).enumerate() {
            let d = quantize_group(xs, &mut codes, isa);
            scale.push(d);
            let qg = &mut q[g * group..(g + 1) * group];
            if nibble_order {
                for (dst, src) in qg.chunks_exact_mut(nb).zip(codes.chunks_exact(nb)) {
                    for (i, pair) in src.chunks_exact(2).enumerate() {
                        dst[i] = pair[0];
                        dst[nb / 2 + i] = pair[1];
                    }
                }
            } else {
                qg.copy_from_slice(&codes);
            }
        }
        let gsum = q
            .chunks_exact(group)
            .map(|c| c.iter().map(|&v| v as i32).sum())
            .collect();
        Self { q, scale, gsum }
    }
}

/// Quantizes one group of activations to int8 codes (scale `amax / 127`, round half away from
/// zero, clamp to +-127, NaN to 0) and returns the scale. Every ISA gives the same codes.
fn quantize_group(xs: &[f32], out: &mut [i8], isa: Isa) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 and fma (implied by
        // Avx512Vnni).
        Isa::Avx2 | Isa::Avx512Vnni if xs.len().is_multiple_of(8) => unsafe {
            avx2::quantize_group(xs, out)
        },
        _ => scalar::quantize_group(xs, out),
    }
}

/// Whether a `[rows, _]` matrix of `kind` in groups of `group` has a [`Layout::Lanes16`] form:
/// int8 or int4, groups a multiple of 64, rows a multiple of 16.
pub fn lanes_fit(kind: QuantKind, rows: usize, group: usize) -> bool {
    matches!(kind, QuantKind::Int8 | QuantKind::Int4)
        && group >= 64
        && group.is_multiple_of(64)
        && rows > 0
        && rows.is_multiple_of(16)
}

/// Rearranges row-major packed weights of `kind` (`cols` per row, in groups of `group`) into
/// [`Layout::Lanes16`] in place; `scratch` is reused between calls. Scales go through the same
/// call as bytes: `lanes_in_place(QuantKind::Int8, 4 * groups, 4, bytes, ..)` (one 4-byte scale
/// per "group" of 4 bytes). Within each block of 16 rows this is the transpose of a
/// `[16, dwords per row]` array of dwords.
pub fn lanes_in_place(
    kind: QuantKind,
    cols: usize,
    group: usize,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) {
    let rb = cols * kind.bits() / 8;
    debug_assert!(group.is_multiple_of(4) && rb.is_multiple_of(4));
    transpose_blocks(data, rb / 4, true, scratch);
}

/// For each block of 16 rows of `rd` dwords in `data`: the `[16, rd]` to `[rd, 16]` transpose of
/// [`lanes_in_place`] (`to_lanes`), or back.
fn transpose_blocks(data: &mut [u8], rd: usize, to_lanes: bool, scratch: &mut Vec<u8>) {
    let simd = to_lanes && Isa::detect() == Isa::Avx512Vnni;
    for blk in data.chunks_exact_mut(64 * rd) {
        scratch.clear();
        scratch.extend_from_slice(blk);
        // columns done 16 at a time by the SIMD transpose, the rest here
        let d0 = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512Vnni` is only detected with avx512f/bw/vnni and avx2.
            true => unsafe { avx512::transpose_dwords(scratch, blk, rd) },
            _ => 0,
        };
        for d in d0..rd {
            for r in 0..16 {
                let (rows, lanes) = (4 * (r * rd + d), 4 * (d * 16 + r));
                let (from, to) = if to_lanes {
                    (rows, lanes)
                } else {
                    (lanes, rows)
                };
                blk[to..to + 4].copy_from_slice(&scratch[from..from + 4]);
            }
        }
    }
}

/// Where dword `d` of group `g` of row `r` sits in [`Layout::Lanes16`] (`dpg` dwords per group,
/// `ng` groups per row); with `dpg = 1`, where scale `(r, g)` sits.
#[inline]
fn lanes_index(r: usize, g: usize, d: usize, ng: usize, dpg: usize) -> usize {
    (((r / 16) * ng + g) * dpg + d) * 16 + r % 16
}

/// Rows per block of the integer path's parallel split (its row kernels take 1 or 4 rows).
const ROW_BLOCK: usize = 4;

/// From this many tokens the VNNI integer path computes 16 rows at a time, one per lane.
#[cfg(target_arch = "x86_64")]
const LANE_ROWS_MIN_TOKENS: usize = 4;

/// `R` rows against `T` tokens' int8 activations (`R * T` is 1 or 4): per row, token and group an
/// exact i32 dot product of the packed weights (int8, or int4 nibbles stored as `q + 8`) with the
/// activations in matching order, then `acc = fma(scale_w[g] * scale_x[g], isum, acc)` in group
/// order, so each result is the same whatever `R` and `T` are: several rows and tokens only share
/// loads, unpacking, the reduction and the loop, and keep independent accumulator chains.
/// `ahead` (the weights computed next, possibly empty) is prefetched into cache along the way: the
/// rows' interleaved reads hide the order from the hardware prefetchers.
#[allow(clippy::too_many_arguments)]
#[inline]
fn block_dot_i8<const R: usize, const T: usize>(
    kind: QuantKind,
    group: usize,
    rows: [&[u8]; R],
    sc: [&[f32]; R],
    a: [&QuantizedActs; T],
    ahead: &[u8],
    isa: Isa,
) -> [[f32; T]; R] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512Vnni` is only constructed after checking avx512f/bw/vnni and avx2.
        Isa::Avx512Vnni if group.is_multiple_of(64) => unsafe {
            avx512::block_dot_i8(kind, group, rows, sc, a, ahead)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed after checking avx2 (implied by Avx512Vnni).
        Isa::Avx2 | Isa::Avx512Vnni => unsafe {
            avx2::block_dot_i8(
                kind,
                group,
                rows,
                sc,
                a.map(|x| &x.q[..]),
                a.map(|x| &x.scale[..]),
                ahead,
            )
        },
        _ => std::array::from_fn(|r| {
            a.map(|x| scalar::row_dot_i8(kind, group, rows[r], sc[r], &x.q, &x.scale))
        }),
    }
}

/// Spreads prefetches of a byte range over the `steps` steps of a loop.
struct Prefetch {
    ptr: *const u8,
    len: usize,
    per_step: usize,
}

impl Prefetch {
    const LINE: usize = 64;

    fn new(range: &[u8], steps: usize) -> Self {
        Self {
            ptr: range.as_ptr(),
            len: range.len(),
            per_step: range.len().div_ceil(steps.max(1)),
        }
    }

    /// Prefetches step `i`'s share of the range into all cache levels.
    #[inline(always)]
    fn step(&self, i: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let end = ((i + 1) * self.per_step).min(self.len);
            let mut o = i * self.per_step;
            while o < end {
                // SAFETY: `o < len`, inside the range; prefetching never faults.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        self.ptr.add(o) as *const i8,
                    )
                };
                o += Self::LINE;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = i;
    }
}

/// f32 -> bf16 bits, round to nearest even.
pub fn bf16_round(v: f32) -> u16 {
    let b = v.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    (r >> 16) as u16
}

/// Sum of 8 lanes in the fixed tree every kernel uses.
#[inline]
fn tree(l: &[f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

fn lane_sum_scalar(x: &[f32]) -> f32 {
    let mut l = [0.0f32; 8];
    for c in x.chunks_exact(8) {
        for k in 0..8 {
            l[k] += c[k];
        }
    }
    tree(&l)
}

/// Row `r`'s `ng` per-group values (scales or offsets), or nothing for a format without them.
fn part(v: &[f32], r: usize, ng: usize) -> &[f32] {
    if v.is_empty() {
        v
    } else {
        &v[r * ng..(r + 1) * ng]
    }
}

/// The offset of the unsigned bytes the VNNI kernels feed `vpdpbusd` as weights: int4 nibbles are
/// stored as `q + 8`, int8 weights go in as `w + 128`; `offset * sum(activations)` is subtracted.
fn unsigned_offset(kind: QuantKind) -> i32 {
    if kind == QuantKind::Int8 {
        128
    } else {
        8
    }
}

/// Where a row's integer codes come from: its packed bytes, or already decoded to f32.
#[derive(Clone, Copy)]
enum Codes<'a> {
    Packed(&'a [u8]),
    Decoded(&'a [f32]),
}

/// One row times one token, dispatched on `isa`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn row_dot(
    kind: QuantKind,
    group: usize,
    codes: Codes<'_>,
    sc: &[f32],
    mn: &[f32],
    x: &[f32],
    xs: &[f32],
    isa: Isa,
) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only constructed by `detect()` after checking avx2 and fma.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::row_dot(kind, group, codes, sc, mn, x, xs) },
        _ => scalar::row_dot(kind, group, codes, sc, mn, x, xs),
    }
}

/// Decodes a packed row's codes (integer levels, or bf16 values) into f32.
fn decode_row(kind: QuantKind, row: &[u8], out: &mut [f32], isa: Isa) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 | Isa::Avx512Vnni => unsafe { avx2::decode_row(kind, row, out) },
        _ => {
            for i in (0..out.len()).step_by(8) {
                out[i..i + 8].copy_from_slice(&scalar::codes8(kind, row, i));
            }
        }
    }
}

/// The reference kernels.
pub mod scalar {
    use super::{tree, Codes, QuantKind};

    /// Reference twin of [`super::quantize_group`].
    pub(super) fn quantize_group(xs: &[f32], out: &mut [i8]) -> f32 {
        let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (o, v) in out.iter_mut().zip(xs) {
            *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
        d
    }

    /// Decodes 8 weights starting at element `i` of a packed row into integer codes as f32.
    #[inline]
    pub(super) fn codes8(kind: QuantKind, row: &[u8], i: usize) -> [f32; 8] {
        let mut c = [0.0f32; 8];
        for k in 0..8 {
            let j = i + k;
            c[k] = match kind {
                QuantKind::Bf16 => {
                    crate::dtype::bf16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]]))
                }
                QuantKind::Int8 => (row[j] as i8) as f32,
                QuantKind::Int4 => (((row[j / 2] >> (4 * (j % 2))) & 15) as i32 - 8) as f32,
                QuantKind::Int2 => ((row[j / 4] >> (2 * (j % 4))) & 3) as f32,
            };
        }
        c
    }

    /// Reference twin of the integer path (see [`super::block_dot_i8`]): per group the exact i32
    /// dot product, then `acc = fma(scale_w[g] * scale_x[g], isum, acc)` in group order.
    pub(super) fn row_dot_i8(
        kind: QuantKind,
        group: usize,
        row: &[u8],
        sc: &[f32],
        aq: &[i8],
        ascale: &[f32],
    ) -> f32 {
        let gb = group * kind.bits() / 8;
        // int4: nibble blocks (low nibbles meet the block's first half, high nibbles the second)
        let nb = super::nibble_block(group);
        let mut acc = 0.0f32;
        for g in 0..aq.len() / group {
            let (w, a) = (&row[g * gb..(g + 1) * gb], &aq[g * group..(g + 1) * group]);
            let mut isum = 0i32;
            for (j, &x) in a.iter().enumerate() {
                let wv = match kind {
                    QuantKind::Int8 => (w[j] as i8) as i32,
                    _ => {
                        let (c, i) = (j / nb, j % nb);
                        let b = w[c * nb / 2 + i % (nb / 2)];
                        (if i < nb / 2 { b & 15 } else { b >> 4 }) as i32 - 8
                    }
                };
                isum += wv * x as i32;
            }
            acc = (sc[g] * ascale[g]).mul_add(isum as f32, acc);
        }
        acc
    }

    /// `sum_g (scale[g] * sum_{i in g} q_i x_i + min[g] * xsum[g])`, or the plain dot for bf16.
    ///
    /// Order: per group, 8 lane partials over the group (fused multiply-adds); each lane then
    /// accumulates `scale[g] * partial` (bf16: the partial itself); the 8 accumulators are summed
    /// in the fixed tree; int2's `min[g] * xsum[g]` terms are summed separately, in group order,
    /// and added last.
    pub(super) fn row_dot(
        kind: QuantKind,
        group: usize,
        codes: Codes<'_>,
        sc: &[f32],
        mn: &[f32],
        x: &[f32],
        xs: &[f32],
    ) -> f32 {
        let mut acc = [0.0f32; 8];
        let mut offs = 0.0f32;
        for g in 0..x.len() / group {
            let mut l = [0.0f32; 8];
            for i in (g * group..(g + 1) * group).step_by(8) {
                let c = match codes {
                    Codes::Packed(row) => codes8(kind, row, i),
                    Codes::Decoded(d) => d[i..i + 8].try_into().expect("8 codes"),
                };
                for k in 0..8 {
                    l[k] = c[k].mul_add(x[i + k], l[k]);
                }
            }
            let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
            for k in 0..8 {
                acc[k] = s.mul_add(l[k], acc[k]);
            }
            if kind == QuantKind::Int2 {
                offs = mn[g].mul_add(xs[g], offs);
            }
        }
        tree(&acc) + offs
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Codes, QuantKind};

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn hsum_tree(v: __m256) -> f32 {
        // lanes (0+4, 1+5, 2+6, 3+7), then ((a+b) + (c+d)): the scalar tree's order.
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let mut a = [0.0f32; 4];
        // SAFETY: `a` has room for 4 floats.
        unsafe { _mm_storeu_ps(a.as_mut_ptr(), s) };
        (a[0] + a[1]) + (a[2] + a[3])
    }

    /// AVX2 twin of [`super::scalar::quantize_group`] for lengths that are multiples of 8: the
    /// same maximum (NaN ignored), the same scale and reciprocal, and round half away from zero
    /// as `trunc(y) + (|y - trunc(y)| >= 0.5 ? sign(y) : 0)` (the difference is exact).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn quantize_group(xs: &[f32], out: &mut [i8]) -> f32 {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
        let mut m = _mm256_setzero_ps();
        for c in xs.chunks_exact(8) {
            // SAFETY: `c` holds 8 floats.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            // max_ps returns its second operand when either is NaN: NaNs are skipped
            m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` has room for 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        let amax = lanes.iter().fold(0.0f32, |a, v| a.max(*v));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let sign = _mm256_set1_ps(-0.0);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        for (c, o) in xs.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
            // SAFETY: `c` holds 8 floats.
            let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, inv);
            let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            let f = _mm256_and_ps(_mm256_sub_ps(y, t), abs_mask);
            let away = _mm256_and_ps(_mm256_cmp_ps(f, half, _CMP_GE_OQ), one);
            let r = _mm256_add_ps(t, _mm256_or_ps(away, _mm256_and_ps(y, sign)));
            let r = _mm256_and_ps(r, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
            let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            let mut v = [0i32; 8];
            // SAFETY: `v` has room for 8 i32.
            unsafe { _mm256_storeu_si256(v.as_mut_ptr() as *mut __m256i, _mm256_cvtps_epi32(r)) };
            for (a, b) in o.iter_mut().zip(v) {
                *a = b as i8;
            }
        }
        d
    }

    /// 8 codes starting at element `i`, as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn codes8(kind: QuantKind, row: &[u8], i: usize) -> __m256 {
        match kind {
            QuantKind::Bf16 => {
                let b = &row[2 * i..2 * i + 16];
                // SAFETY: `b` holds 16 bytes.
                let h = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            }
            QuantKind::Int8 => {
                let b = &row[i..i + 8];
                // SAFETY: `b` holds 8 bytes.
                let h = unsafe { _mm_loadl_epi64(b.as_ptr() as *const __m128i) };
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h))
            }
            QuantKind::Int4 => {
                let w = u32::from_le_bytes(row[i / 2..i / 2 + 4].try_into().expect("4 bytes"));
                let v = _mm256_set1_epi32(w as i32);
                let sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
                let c = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(15));
                _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8)))
            }
            QuantKind::Int2 => {
                let w = u16::from_le_bytes([row[i / 4], row[i / 4 + 1]]);
                let v = _mm256_set1_epi32(w as i32);
                let sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
                let c = _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32(3));
                _mm256_cvtepi32_ps(c)
            }
        }
    }

    /// i8 x i8 products of 32 pairs, summed in i32 lanes: `maddubs` on `aw = |w|` and the
    /// activations with `w`'s signs.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot32_abs(aw: __m256i, w: __m256i, a: __m256i) -> __m256i {
        let sa = _mm256_sign_epi8(a, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1))
    }

    /// The four sums `[sum(a), sum(b), sum(c), sum(d)]` of 8-lane i32 vectors (exact).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn reduce4(v: [__m256i; 4]) -> __m128i {
        let ab = _mm256_hadd_epi32(v[0], v[1]);
        let cd = _mm256_hadd_epi32(v[2], v[3]);
        let abcd = _mm256_hadd_epi32(ab, cd);
        _mm_add_epi32(
            _mm256_castsi256_si128(abcd),
            _mm256_extracti128_si256(abcd, 1),
        )
    }

    /// The float step of the integer path for the `R * T <= 4` (row, token) pairs of a block, pair
    /// `p = r * T + t` in lane `p`: `acc = fma(sc[r][g] * ascale[t][g], isum, acc)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn fma_step<const R: usize, const T: usize>(
        acc: __m128,
        isum: __m128i,
        sc: [&[f32]; R],
        ascale: [&[f32]; T],
        g: usize,
    ) -> __m128 {
        let mut p = [0.0f32; 4];
        for r in 0..R {
            for t in 0..T {
                p[r * T + t] = sc[r][g] * ascale[t][g];
            }
        }
        // SAFETY: `p` holds 4 floats.
        let pv = unsafe { _mm_loadu_ps(p.as_ptr()) };
        _mm_fmadd_ps(pv, _mm_cvtepi32_ps(isum), acc)
    }

    /// Unpacks `acc` (pair `r * T + t` in lane `r * T + t`) into `[rows][tokens]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn unpack<const R: usize, const T: usize>(acc: __m128) -> [[f32; T]; R] {
        let mut v = [0.0f32; 4];
        // SAFETY: `v` has room for 4 floats.
        unsafe { _mm_storeu_ps(v.as_mut_ptr(), acc) };
        std::array::from_fn(|r| std::array::from_fn(|t| v[r * T + t]))
    }

    /// AVX2 twin of [`super::scalar::row_dot_i8`] for `R` rows and `T` tokens, `R * T` being 1 or
    /// 4 (see [`super::block_dot_i8`]): the same exact integer sums and fused float steps, so the
    /// same results.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn block_dot_i8<const R: usize, const T: usize>(
        kind: QuantKind,
        group: usize,
        rows: [&[u8]; R],
        sc: [&[f32]; R],
        aq: [&[i8]; T],
        ascale: [&[f32]; T],
        ahead: &[u8],
    ) -> [[f32; T]; R] {
        assert!(R * T <= 4);
        let gb = group * kind.bits() / 8;
        let ng = aq[0].len() / group;
        let pf = super::Prefetch::new(ahead, ng);
        for r in 0..R {
            assert!(rows[r].len() >= ng * gb && sc[r].len() >= ng);
        }
        for t in 0..T {
            assert!(aq[t].len() >= ng * group && ascale[t].len() >= ng);
        }
        let (wp, ap) = (rows.map(|r| r.as_ptr()), aq.map(|a| a.as_ptr()));
        // SAFETY (every load below): weight offsets stay below `ng * gb` and activation offsets
        // below `ng * group`, the lengths asserted above.
        let ld = |p: *const u8| unsafe { _mm256_loadu_si256(p as *const __m256i) };
        let lda =
            |t: usize, i: usize| unsafe { _mm256_loadu_si256(ap[t].add(i) as *const __m256i) };
        let eight = _mm256_set1_epi8(8);
        let m = _mm256_set1_epi8(15);
        let mut acc = _mm_setzero_ps();
        for g in 0..ng {
            pf.step(g);
            let (wo, base) = (g * gb, g * group);
            let mut s = [[_mm256_setzero_si256(); T]; R];
            match kind {
                QuantKind::Int8 => {
                    for c in 0..group / 32 {
                        let av: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 32 * c));
                        for r in 0..R {
                            // SAFETY: see above.
                            let wv = ld(unsafe { wp[r].add(wo + 32 * c) });
                            let aw = _mm256_sign_epi8(wv, wv);
                            for t in 0..T {
                                s[r][t] = _mm256_add_epi32(s[r][t], dot32_abs(aw, wv, av[t]));
                            }
                        }
                    }
                }
                _ if group.is_multiple_of(64) => {
                    // 64-element nibble blocks: 32 packed bytes, low nibbles meet the first 32
                    // activations, high nibbles the next 32.
                    for c in 0..group / 64 {
                        let a0: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 64 * c));
                        let a1: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 64 * c + 32));
                        for r in 0..R {
                            // SAFETY: see above.
                            let v = ld(unsafe { wp[r].add(wo + 32 * c) });
                            let lo = _mm256_sub_epi8(_mm256_and_si256(v, m), eight);
                            let hi = _mm256_sub_epi8(
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), m),
                                eight,
                            );
                            let (alo, ahi) = (_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(hi, hi));
                            for t in 0..T {
                                let d = _mm256_add_epi32(
                                    dot32_abs(alo, lo, a0[t]),
                                    dot32_abs(ahi, hi, a1[t]),
                                );
                                s[r][t] = _mm256_add_epi32(s[r][t], d);
                            }
                        }
                    }
                }
                _ => {
                    let m = _mm_set1_epi8(15);
                    for c in 0..group / 32 {
                        let av: [__m256i; T] = std::array::from_fn(|t| lda(t, base + 32 * c));
                        for r in 0..R {
                            // SAFETY: see above (16 bytes).
                            let v = unsafe {
                                _mm_loadu_si128(wp[r].add(wo + 16 * c) as *const __m128i)
                            };
                            let lo = _mm_and_si128(v, m);
                            let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
                            let wv = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
                            let aw = _mm256_sign_epi8(wv, wv);
                            for t in 0..T {
                                s[r][t] = _mm256_add_epi32(s[r][t], dot32_abs(aw, wv, av[t]));
                            }
                        }
                    }
                }
            }
            let mut v = [_mm256_setzero_si256(); 4];
            for r in 0..R {
                for t in 0..T {
                    v[r * T + t] = s[r][t];
                }
            }
            acc = fma_step(acc, reduce4(v), sc, ascale, g);
        }
        unpack(acc)
    }

    /// Decodes a packed row into f32 codes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn decode_row(kind: QuantKind, row: &[u8], out: &mut [f32]) {
        for i in (0..out.len()).step_by(8) {
            let o = &mut out[i..i + 8];
            // SAFETY: `o` holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), codes8(kind, row, i)) };
        }
    }

    /// [`row_dot`] of `R` packed rows against one token, their accumulator chains interleaved (each
    /// row's arithmetic is exactly `row_dot`'s); `ahead` is prefetched along the way.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn rows_dot<const R: usize>(
        kind: QuantKind,
        group: usize,
        rows: [&[u8]; R],
        sc: [&[f32]; R],
        mn: [&[f32]; R],
        x: &[f32],
        xs: &[f32],
        ahead: &[u8],
    ) -> [f32; R] {
        let ng = x.len() / group;
        let pf = super::Prefetch::new(ahead, ng);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut offs = [0.0f32; R];
        for g in 0..ng {
            pf.step(g);
            let mut l = [_mm256_setzero_ps(); R];
            for i in (g * group..(g + 1) * group).step_by(8) {
                let xv = &x[i..i + 8];
                // SAFETY: `xv` holds 8 floats.
                let xv = unsafe { _mm256_loadu_ps(xv.as_ptr()) };
                for r in 0..R {
                    l[r] = _mm256_fmadd_ps(codes8(kind, rows[r], i), xv, l[r]);
                }
            }
            for r in 0..R {
                let s = if kind == QuantKind::Bf16 {
                    1.0
                } else {
                    sc[r][g]
                };
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), l[r], acc[r]);
                if kind == QuantKind::Int2 {
                    offs[r] = mn[r][g].mul_add(xs[g], offs[r]);
                }
            }
        }
        std::array::from_fn(|r| hsum_tree(acc[r]) + offs[r])
    }

    /// [`row_dot`] over a row's decoded codes for `T` tokens, their accumulator chains interleaved
    /// (each token's arithmetic is exactly `row_dot`'s).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn codes_dot<const T: usize>(
        kind: QuantKind,
        group: usize,
        codes: &[f32],
        sc: &[f32],
        mn: &[f32],
        x: [&[f32]; T],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let ng = codes.len() / group;
        for xt in x {
            assert_eq!(xt.len(), codes.len());
        }
        let mut acc = [_mm256_setzero_ps(); T];
        let mut offs = [0.0f32; T];
        for g in 0..ng {
            let mut l = [_mm256_setzero_ps(); T];
            for i in (g * group..(g + 1) * group).step_by(8) {
                // SAFETY: `i + 8 <= codes.len()`, the length of every `x[t]` too (asserted).
                let c = unsafe { _mm256_loadu_ps(codes.as_ptr().add(i)) };
                for t in 0..T {
                    // SAFETY: as above.
                    let xv = unsafe { _mm256_loadu_ps(x[t].as_ptr().add(i)) };
                    l[t] = _mm256_fmadd_ps(c, xv, l[t]);
                }
            }
            let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(s), l[t], acc[t]);
                if kind == QuantKind::Int2 {
                    offs[t] = mn[g].mul_add(xs[t][g], offs[t]);
                }
            }
        }
        std::array::from_fn(|t| hsum_tree(acc[t]) + offs[t])
    }

    /// AVX2 twin of [`super::scalar::row_dot`]: the same lanes, order and fused multiply-adds, so
    /// the results are bit-identical.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn row_dot(
        kind: QuantKind,
        group: usize,
        codes: Codes<'_>,
        sc: &[f32],
        mn: &[f32],
        x: &[f32],
        xs: &[f32],
    ) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut offs = 0.0f32;
        for g in 0..x.len() / group {
            let mut l = _mm256_setzero_ps();
            for i in (g * group..(g + 1) * group).step_by(8) {
                let xv = &x[i..i + 8];
                // SAFETY: `xv` holds 8 floats.
                let xv = unsafe { _mm256_loadu_ps(xv.as_ptr()) };
                let c = match codes {
                    Codes::Packed(row) => codes8(kind, row, i),
                    // SAFETY: `d` holds the row's `cols` codes and `i + 8 <= cols`.
                    Codes::Decoded(d) => unsafe { _mm256_loadu_ps(d[i..i + 8].as_ptr()) },
                };
                l = _mm256_fmadd_ps(c, xv, l);
            }
            let s = if kind == QuantKind::Bf16 { 1.0 } else { sc[g] };
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s), l, acc);
            if kind == QuantKind::Int2 {
                offs = mn[g].mul_add(xs[g], offs);
            }
        }
        hsum_tree(acc) + offs
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{QuantKind, QuantizedActs};

    /// VNNI twin of [`super::scalar::row_dot_i8`] for `R` rows and `T` tokens, `R * T` being 1
    /// or 4 (see [`super::block_dot_i8`]), for groups that are multiples of 64. `vpdpbusd`
    /// multiplies unsigned bytes by signed ones, so the weights go in unsigned (int4: the stored
    /// nibbles `q + 8`; int8: `w + 128`) and `8 *` (`128 *`) the group's activation sum is
    /// subtracted: the integer sums are exact, the float steps the scalar twin's, and so are the
    /// results.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) fn block_dot_i8<const R: usize, const T: usize>(
        kind: QuantKind,
        group: usize,
        rows: [&[u8]; R],
        sc: [&[f32]; R],
        a: [&QuantizedActs; T],
        ahead: &[u8],
    ) -> [[f32; T]; R] {
        assert!(R * T <= 4);
        let gb = group * kind.bits() / 8;
        let ng = a[0].q.len() / group;
        let pf = super::Prefetch::new(ahead, ng);
        for r in 0..R {
            assert!(rows[r].len() >= ng * gb && sc[r].len() >= ng);
        }
        for x in a {
            assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.gsum.len() >= ng);
        }
        let (wp, ap) = (rows.map(|r| r.as_ptr()), a.map(|x| x.q.as_ptr()));
        // SAFETY (every load below): weight offsets stay below `ng * gb` and activation offsets
        // below `ng * group`, the lengths asserted above.
        let lda = |t: usize, i: usize| unsafe { _mm512_loadu_si512(ap[t].add(i) as *const _) };
        let bias = super::unsigned_offset(kind);
        let m = _mm256_set1_epi8(15);
        let flip = _mm512_set1_epi8(-128);
        let fold = |v: __m512i| {
            _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))
        };
        let ascale = a.map(|x| &x.scale[..]);
        let mut acc = _mm_setzero_ps();
        for g in 0..ng {
            pf.step(g);
            let (wo, base) = (g * gb, g * group);
            let mut s = [[_mm512_setzero_si512(); T]; R];
            for c in 0..group / 64 {
                let av: [__m512i; T] = std::array::from_fn(|t| lda(t, base + 64 * c));
                for r in 0..R {
                    let w = match kind {
                        // SAFETY: see above (64 bytes).
                        QuantKind::Int8 => _mm512_xor_si512(
                            unsafe { _mm512_loadu_si512(wp[r].add(wo + 64 * c) as *const _) },
                            flip,
                        ),
                        _ => {
                            // SAFETY: see above (32 bytes).
                            let v = unsafe {
                                _mm256_loadu_si256(wp[r].add(wo + 32 * c) as *const __m256i)
                            };
                            // 64-element nibble block: low nibbles meet activations 0..32, high
                            // nibbles 32..64, so the halves go in as they are.
                            let lo = _mm256_and_si256(v, m);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                        }
                    };
                    for t in 0..T {
                        s[r][t] = _mm512_dpbusd_epi32(s[r][t], w, av[t]);
                    }
                }
            }
            let mut v = [_mm256_setzero_si256(); 4];
            let mut corr = [0i32; 4];
            for r in 0..R {
                for t in 0..T {
                    v[r * T + t] = fold(s[r][t]);
                    corr[r * T + t] = bias * a[t].gsum[g];
                }
            }
            // SAFETY: `corr` holds 4 i32.
            let cv = unsafe { _mm_loadu_si128(corr.as_ptr() as *const __m128i) };
            let isum = _mm_sub_epi32(super::avx2::reduce4(v), cv);
            acc = super::avx2::fma_step(acc, isum, sc, ascale, g);
        }
        super::avx2::unpack(acc)
    }

    /// `out[r][t] = w[r] . dword k`, i.e. the 16x16 transpose of 16 rows of 16 dwords.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    fn transpose16(u: [__m512i; 16]) -> [__m512i; 16] {
        // rows (2i, 2i+1) interleaved by dword, then rows 4i..4i+4 by dword pairs: q[4i + m] has,
        // in each 128-bit lane L, dword 4L + m of rows 4i..4i+4
        let t: [__m512i; 16] = std::array::from_fn(|j| {
            let (a, b) = (u[j & !1], u[j | 1]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        let q: [__m512i; 16] = std::array::from_fn(|j| {
            let (i, m) = (j / 4, j % 4);
            let (a, b) = (t[4 * i + m / 2], t[4 * i + 2 + m / 2]);
            if m % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        let mut out = [_mm512_setzero_si512(); 16];
        for m in 0..4 {
            let v = _mm512_shuffle_i32x4::<0x88>(q[m], q[4 + m]);
            let v2 = _mm512_shuffle_i32x4::<0xdd>(q[m], q[4 + m]);
            let w = _mm512_shuffle_i32x4::<0x88>(q[8 + m], q[12 + m]);
            let w2 = _mm512_shuffle_i32x4::<0xdd>(q[8 + m], q[12 + m]);
            out[m] = _mm512_shuffle_i32x4::<0x88>(v, w);
            out[8 + m] = _mm512_shuffle_i32x4::<0xdd>(v, w);
            out[4 + m] = _mm512_shuffle_i32x4::<0x88>(v2, w2);
            out[12 + m] = _mm512_shuffle_i32x4::<0xdd>(v2, w2);
        }
        out
    }

    /// `dst[d][r] = src[r][d]` for the dwords of 16 rows of `rd` dwords each (`src`, `dst`:
    /// `64 * rd` bytes), 16 columns at a time; returns how many columns it did (the rest, fewer
    /// than 16, is the caller's).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) fn transpose_dwords(src: &[u8], dst: &mut [u8], rd: usize) -> usize {
        assert!(src.len() == 64 * rd && dst.len() == 64 * rd);
        let full = rd - rd % 16;
        for d0 in (0..full).step_by(16) {
            // SAFETY: row `r`'s dwords `d0..d0 + 16` end at `4 * (r * rd + d0 + 16) <= 64 * rd`.
            let u: [__m512i; 16] = std::array::from_fn(|r| unsafe {
                _mm512_loadu_si512(src.as_ptr().add(4 * (r * rd + d0)) as *const _)
            });
            for (k, v) in transpose16(u).iter().enumerate() {
                // SAFETY: `64 * (d0 + k) + 64 <= 64 * rd`.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(64 * (d0 + k)) as *mut _, *v) };
            }
        }
        full
    }

    /// Buffers [`rows16_dot_i8`] reuses from block to block: the transposed weights and the
    /// rows' scales by group (16 lanes).
    #[derive(Default)]
    pub(super) struct LaneScratch {
        w: Vec<__m512i>,
        sc: Vec<[f32; 16]>,
    }

    /// Up to 16 consecutive rows (`rows`, `sc`: theirs, row-major) against every token in
    /// `acts`, one row per lane: the rows' unsigned weight bytes are transposed once into
    /// `scratch` (with the scales) so that each `vpdpbusd` takes 4 weights of 16 rows and 4
    /// activations broadcast, and the float step runs once per group for all 16 rows. Per row the same exact integer sums
    /// and float steps as [`super::scalar::row_dot_i8`]. `out` is `[rows, tokens]`; `ahead` (the
    /// next block's weights) is prefetched during the transpose.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) fn rows16_dot_i8(
        kind: QuantKind,
        group: usize,
        rows: &[u8],
        sc: &[f32],
        acts: &[QuantizedActs],
        scratch: &mut LaneScratch,
        out: &mut [f32],
        ahead: &[u8],
    ) {
        let n = acts.len();
        let gb = group * kind.bits() / 8;
        let ng = acts[0].q.len() / group;
        let rb = ng * gb;
        let nr = rows.len() / rb;
        assert!((1..=16).contains(&nr) && rows.len() == nr * rb);
        assert!(sc.len() == nr * ng && out.len() == nr * n);
        for x in acts {
            assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.gsum.len() >= ng);
        }
        let kq = group / 4; // dwords per group
        let m = _mm256_set1_epi8(15);
        let flip = _mm512_set1_epi8(-128);
        let LaneScratch {
            w: scratch,
            sc: sct,
        } = scratch;
        scratch.clear();
        scratch.resize(ng * kq, _mm512_setzero_si512());
        let pf = super::Prefetch::new(ahead, ng);
        for g in 0..ng {
            pf.step(g);
            for c in 0..group / 64 {
                let mut u = [_mm512_setzero_si512(); 16];
                for (r, ur) in u.iter_mut().enumerate().take(nr) {
                    let p = &rows[r * rb + g * gb..r * rb + (g + 1) * gb];
                    *ur = match kind {
                        QuantKind::Int8 => {
                            let b = &p[64 * c..64 * c + 64];
                            // SAFETY: `b` holds 64 bytes.
                            _mm512_xor_si512(
                                unsafe { _mm512_loadu_si512(b.as_ptr() as *const _) },
                                flip,
                            )
                        }
                        _ => {
                            let b = &p[32 * c..32 * c + 32];
                            // SAFETY: `b` holds 32 bytes.
                            let v = unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) };
                            let lo = _mm256_and_si256(v, m);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
                        }
                    };
                }
                let t = transpose16(u);
                scratch[g * kq + 16 * c..g * kq + 16 * c + 16].copy_from_slice(&t);
            }
        }
        sct.clear();
        sct.resize(ng, [0.0; 16]);
        for r in 0..nr {
            for g in 0..ng {
                sct[g][r] = sc[r * ng + g];
            }
        }
        let bias = super::unsigned_offset(kind);
        // tokens in pairs: each weight vector loaded from the scratch serves two tokens
        token_pairs(n, nr, out, |t, pair| {
            if pair {
                lanes_dot::<2>(group, ng, bias, scratch, sct, [&acts[t], &acts[t + 1]])
            } else {
                let [a] = lanes_dot::<1>(group, ng, bias, scratch, sct, [&acts[t]]);
                [a, _mm512_setzero_ps()]
            }
        });
    }

    /// Runs `f` over the tokens in pairs (`f(t, true)`: tokens `t` and `t + 1`; `f(t, false)`:
    /// the last, lone token) and stores the first `nr` lanes of each result in `out`
    /// (`[rows, n]`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    fn token_pairs(
        n: usize,
        nr: usize,
        out: &mut [f32],
        mut f: impl FnMut(usize, bool) -> [__m512; 2],
    ) {
        let mut t = 0;
        while t < n {
            let res = f(t, t + 1 < n);
            for (i, v) in res.iter().enumerate().take((n - t).min(2)) {
                let mut lanes = [0.0f32; 16];
                // SAFETY: `lanes` has room for 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
                for (r, l) in lanes.iter().enumerate().take(nr) {
                    out[r * n + t + i] = *l;
                }
            }
            t += 2;
        }
    }

    /// 16 rows stored in [`super::Layout::Lanes16`] (`blk`, `sc`: one block's weights and
    /// scales) against every token in `acts`, one row per lane, tokens in pairs: the arithmetic
    /// of [`rows16_dot_i8`] (and so of [`super::scalar::row_dot_i8`]) without its transpose.
    /// `out` is `[16, tokens]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) fn lanes16_dot_i8(
        kind: QuantKind,
        group: usize,
        blk: &[u8],
        sc: &[f32],
        acts: &[QuantizedActs],
        out: &mut [f32],
    ) {
        let n = acts.len();
        let ng = acts[0].q.len() / group;
        assert!(blk.len() == 16 * ng * group * kind.bits() / 8 && sc.len() == 16 * ng);
        assert!(out.len() == 16 * n && group.is_multiple_of(64));
        for x in acts {
            assert!(x.q.len() >= ng * group && x.scale.len() >= ng && x.gsum.len() >= ng);
        }
        token_pairs(n, 16, out, |t, pair| {
            if pair {
                packed_dot::<2>(kind, group, ng, blk, sc, [&acts[t], &acts[t + 1]])
            } else {
                let [a] = packed_dot::<1>(kind, group, ng, blk, sc, [&acts[t]]);
                [a, _mm512_setzero_ps()]
            }
        });
    }

    /// The per-token loop of [`lanes16_dot_i8`] for `P` tokens sharing each weight load (the
    /// callers check the lengths).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    fn packed_dot<const P: usize>(
        kind: QuantKind,
        group: usize,
        ng: usize,
        blk: &[u8],
        sc: &[f32],
        acts: [&QuantizedActs; P],
    ) -> [__m512; P] {
        let gb = group * kind.bits() / 8;
        let bias = super::unsigned_offset(kind);
        let qp = acts.map(|x| x.q.as_ptr());
        let (m, flip) = (_mm512_set1_epi8(15), _mm512_set1_epi8(-128));
        let mut acc = [_mm512_setzero_ps(); P];
        for g in 0..ng {
            // SAFETY (loads below): dword `d < gb / 4` of group `g` lies at `16 * (g * gb + 4 *
            // d)` in `blk`, which holds `16 * ng * gb` bytes; activation offsets stay below
            // `(g + 1) * group <= ng * group`.
            let w = unsafe { blk.as_ptr().add(16 * g * gb) };
            let ld = |d: usize| unsafe { _mm512_loadu_si512(w.add(64 * d) as *const _) };
            let bc = |t: usize, i: usize| unsafe {
                _mm512_set1_epi32((qp[t].add(g * group + i) as *const i32).read_unaligned())
            };
            let mut s0 = [_mm512_setzero_si512(); P];
            let mut s1 = [_mm512_setzero_si512(); P];
            if kind == QuantKind::Int8 {
                for d in (0..gb / 4).step_by(2) {
                    let (w0, w1) = (
                        _mm512_xor_si512(ld(d), flip),
                        _mm512_xor_si512(ld(d + 1), flip),
                    );
                    for t in 0..P {
                        s0[t] = _mm512_dpbusd_epi32(s0[t], w0, bc(t, 4 * d));
                        s1[t] = _mm512_dpbusd_epi32(s1[t], w1, bc(t, 4 * d + 4));
                    }
                }
            } else {
                // int4: dword j of a 32-byte nibble block holds elements 4j.. (low nibbles, the
                // block's first half of activations) and 32 + 4j.. (high nibbles)
                for c in 0..group / 64 {
                    for j in 0..8 {
                        let p = ld(8 * c + j);
                        let lo = _mm512_and_si512(p, m);
                        let hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m);
                        for t in 0..P {
                            s0[t] = _mm512_dpbusd_epi32(s0[t], lo, bc(t, 64 * c + 4 * j));
                            s1[t] = _mm512_dpbusd_epi32(s1[t], hi, bc(t, 64 * c + 32 + 4 * j));
                        }
                    }
                }
            }
            // SAFETY: `sc` holds `16 * ng` floats.
            let sw = unsafe { _mm512_loadu_ps(sc.as_ptr().add(16 * g)) };
            for t in 0..P {
                let sum = _mm512_add_epi32(s0[t], s1[t]);
                let isum = _mm512_sub_epi32(sum, _mm512_set1_epi32(bias * acts[t].gsum[g]));
                let scale = _mm512_mul_ps(sw, _mm512_set1_ps(acts[t].scale[g]));
                acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[t]);
            }
        }
        acc
    }

    /// The per-token loop of [`rows16_dot_i8`] for `P` tokens sharing each weight load: per
    /// group, the exact integer sums of 16 rows (two chains per token), the activation-sum
    /// correction, then `acc = fma(scale_w * scale_x, isum, acc)` per lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    fn lanes_dot<const P: usize>(
        group: usize,
        ng: usize,
        bias: i32,
        wt: &[__m512i],
        sct: &[[f32; 16]],
        acts: [&QuantizedActs; P],
    ) -> [__m512; P] {
        let kq = group / 4;
        assert!(wt.len() >= ng * kq && sct.len() >= ng && kq.is_multiple_of(2));
        let qp = acts.map(|x| x.q.as_ptr());
        let mut acc = [_mm512_setzero_ps(); P];
        for g in 0..ng {
            let w = &wt[g * kq..(g + 1) * kq];
            // SAFETY: `g * group + 4 * k + 4 <= ng * group` for `k < kq` (the callers assert the
            // activations' lengths).
            let bc = |t: usize, k: usize| unsafe {
                _mm512_set1_epi32((qp[t].add(g * group + 4 * k) as *const i32).read_unaligned())
            };
            let mut s0 = [_mm512_setzero_si512(); P];
            let mut s1 = [_mm512_setzero_si512(); P];
            for (j, w2) in w.chunks_exact(2).enumerate() {
                for t in 0..P {
                    s0[t] = _mm512_dpbusd_epi32(s0[t], w2[0], bc(t, 2 * j));
                    s1[t] = _mm512_dpbusd_epi32(s1[t], w2[1], bc(t, 2 * j + 1));
                }
            }
            // SAFETY: `sct[g]` holds 16 floats.
            let sw = unsafe { _mm512_loadu_ps(sct[g].as_ptr()) };
            for t in 0..P {
                let sum = _mm512_add_epi32(s0[t], s1[t]);
                let isum = _mm512_sub_epi32(sum, _mm512_set1_epi32(bias * acts[t].gsum[g]));
                let scale = _mm512_mul_ps(sw, _mm512_set1_ps(acts[t].scale[g]));
                acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[t]);
            }
        }
        acc
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic test values in [-1, 1).
    pub(crate) fn data(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }

    const KINDS: [QuantKind; 4] = [
        QuantKind::Bf16,
        QuantKind::Int8,
        QuantKind::Int4,
        QuantKind::Int2,
    ];
    /// Shapes with odd row counts, per-row and per-group scales, and odd token counts.
    const SHAPES: [(usize, usize, usize, usize); 4] = [
        (1, 8, 8, 1),
        (7, 64, 64, 3),
        (33, 192, 64, 5),
        (129, 320, 32, 2),
    ];

    fn reference(q: &QMatrix, x: &[f32], n: usize) -> Vec<f64> {
        let d = q.dequantize();
        (0..n)
            .flat_map(|t| (0..q.rows).map(move |o| (t, o)))
            .map(|(t, o)| {
                (0..q.cols)
                    .map(|i| d.row(o)[i] as f64 * x[t * q.cols + i] as f64)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn every_isa_matches_dequantized_f32() {
        for kind in KINDS {
            for (r, c, g, n) in SHAPES {
                let q =
                    QMatrix::quantize(&Matrix::new(r, c, data(r as u64, r * c)), kind, g).unwrap();
                let x = data(c as u64 + 1, n * c);
                let want = reference(&q, &x, n);
                for isa in Isa::available() {
                    let y = q.matmul(&x, n, isa);
                    for (a, b) in y.iter().zip(&want) {
                        assert!(
                            (*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()),
                            "{kind:?} {r}x{c} g{g} {isa:?}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_is_bit_identical_to_scalar_twin() {
        for kind in KINDS {
            for (r, c, g, n) in SHAPES {
                let q = QMatrix::quantize(&Matrix::new(r, c, data(3 + r as u64, r * c)), kind, g)
                    .unwrap();
                let x = data(7, n * c);
                let s = q.matmul(&x, n, Isa::Scalar);
                for isa in Isa::available() {
                    let v = q.matmul(&x, n, isa);
                    assert_eq!(
                        v, s,
                        "{kind:?} {r}x{c} g{g} {isa:?}: SIMD differs from its scalar twin"
                    );
                }
            }
        }
    }

    #[test]
    fn batch_and_thread_invariant_bitwise() {
        for kind in KINDS {
            let (r, c, g) = (67, 256, 64);
            let q = QMatrix::quantize(&Matrix::new(r, c, data(11, r * c)), kind, g).unwrap();
            let n = 9;
            let x = data(12, n * c);
            for isa in Isa::available() {
                let all = q.matmul(&x, n, isa);
                let one_thread = rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .unwrap();
                let serial = one_thread.install(|| q.matmul(&x, n, isa));
                assert_eq!(all, serial, "{kind:?} {isa:?}: thread count changed bits");
                for t in 0..n {
                    let one = q.matmul(&x[t * c..(t + 1) * c], 1, isa);
                    assert_eq!(
                        one,
                        all[t * r..(t + 1) * r].to_vec(),
                        "{kind:?} {isa:?} token {t}"
                    );
                }
            }
        }
    }

    #[test]
    fn int8_activation_path_is_bit_identical_across_isas_and_batches() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            for (r, c, g) in [(7, 64, 64), (33, 192, 32), (65, 256, 64), (17, 256, 128)] {
                let q = QMatrix::quantize(&Matrix::new(r, c, data(r as u64 + 40, r * c)), kind, g)
                    .unwrap();
                assert!(q.integer_path());
                // 11 tokens: two full tiles of the multi-token kernel and a remainder
                let n = 11;
                let x = data(41, n * c);
                let s = q.matmul_with(&x, n, Isa::Scalar, Activations::Int8);
                for isa in Isa::available() {
                    let v = q.matmul_with(&x, n, isa, Activations::Int8);
                    assert_eq!(v, s, "{kind:?} {r}x{c} {isa:?}");
                    for t in 0..n {
                        assert_eq!(
                            q.matmul_with(&x[t * c..(t + 1) * c], 1, isa, Activations::Int8),
                            v[t * r..(t + 1) * r].to_vec(),
                            "{kind:?} {r}x{c} {isa:?} token {t}"
                        );
                    }
                    for k in [2, 3, 4, 7] {
                        assert_eq!(
                            q.matmul_with(&x[..k * c], k, isa, Activations::Int8),
                            v[..k * r].to_vec(),
                            "{kind:?} {r}x{c} {isa:?}: first {k} tokens"
                        );
                    }
                }
                // Close to the f32-activation product: the only extra error is activation rounding.
                let f = q.matmul(&x, n, Isa::Scalar);
                let d = q.dequantize();
                for (i, (a, b)) in s.iter().zip(&f).enumerate() {
                    let (t, o) = (i / r, i % r);
                    let bound: f32 = (0..c).map(|j| d.row(o)[j].abs()).sum::<f32>()
                        * x[t * c..(t + 1) * c]
                            .iter()
                            .fold(0.0f32, |m, v| m.max(v.abs()))
                        / 254.0;
                    assert!(
                        (a - b).abs() <= bound + 1e-5,
                        "{kind:?}: {a} vs {b} (bound {bound})"
                    );
                }
            }
        }
    }

    #[test]
    fn lane_layout_is_a_lossless_permutation_with_bit_identical_products() {
        for kind in [QuantKind::Int8, QuantKind::Int4] {
            // 1, 3 and 6 blocks of 16 rows; groups of 64 and 128; a row of 3 groups
            for (r, c, g) in [(16, 64, 64), (48, 192, 64), (96, 256, 128)] {
                let q = QMatrix::quantize(&Matrix::new(r, c, data(r as u64 + 7, r * c)), kind, g)
                    .unwrap();
                let l = q.to_lanes().expect("lane layout applies");
                assert_eq!(l.layout, Layout::Lanes16);
                assert!(l.to_lanes().is_none(), "already in lanes");
                assert_ne!(&l.data[..], &q.data[..], "the bytes move");
                assert!(*l.to_row_major() == q, "{kind:?} {r}x{c}: round trip");
                for row in [0, 1, 15, r - 1] {
                    assert_eq!(l.dequantize_row(row), q.dequantize_row(row));
                }
                assert_eq!(l.dequantize(), q.dequantize());
                // 1 to 9 tokens (pairs and a lone token), on 1 and 2 threads, against the scalar
                // twin on the row-major matrix, bit for bit; every other path converts back
                let x = data(9, 9 * c);
                for threads in [1, 2] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    for n in [1, 2, 3, 4, 9] {
                        let x = &x[..n * c];
                        let want = q.matmul_with(x, n, Isa::Scalar, Activations::Int8);
                        for isa in Isa::available() {
                            for act in [Activations::Int8, Activations::F32] {
                                let got = pool.install(|| l.matmul_with(x, n, isa, act));
                                let row_major = q.matmul_with(x, n, isa, act);
                                assert_eq!(
                                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                    row_major.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                    "{kind:?} {r}x{c} g{g} {isa:?} {act:?} n={n} {threads}t"
                                );
                                if act == Activations::Int8 {
                                    assert_eq!(got, want, "{kind:?} {isa:?} n={n}: scalar twin");
                                }
                            }
                        }
                    }
                }
            }
        }
        // what does not tile into 16-row blocks of 64-wide groups stays row-major
        let m = Matrix::new(17, 64, data(3, 17 * 64));
        assert!(QMatrix::quantize(&m, QuantKind::Int8, 64)
            .unwrap()
            .to_lanes()
            .is_none());
        let m = Matrix::new(16, 64, data(3, 16 * 64));
        assert!(QMatrix::quantize(&m, QuantKind::Int8, 32)
            .unwrap()
            .to_lanes()
            .is_none());
        assert!(QMatrix::quantize(&m, QuantKind::Int2, 64)
            .unwrap()
            .to_lanes()
            .is_none());
        assert!(QMatrix::quantize(&m, QuantKind::Bf16, 64)
            .unwrap()
            .to_lanes()
            .is_none());
    }

    #[test]
    fn activation_quantization_is_identical_on_every_isa() {
        // amax 127 makes the scale 1, so the exact halves and their neighbours are hit
        let mut edge = vec![
            127.0,
            2.5,
            -2.5,
            0.5,
            -0.5,
            0.49999997,
            -0.49999997,
            1.5000001,
            -126.5,
            0.0,
            -0.0,
            f32::NAN,
            126.49999,
            -127.0,
            3.4999998,
            64.5,
        ];
        edge.extend(data(5, 48).iter().map(|v| v * 300.0));
        let inf = [[f32::INFINITY].as_slice(), &data(6, 63)].concat();
        let groups = [edge, data(7, 64), vec![0.0; 32], inf, vec![f32::NAN; 8]];
        for xs in groups {
            let mut want = vec![0i8; xs.len()];
            let d = scalar::quantize_group(&xs, &mut want);
            for isa in Isa::available() {
                let mut got = vec![0i8; xs.len()];
                let e = quantize_group(&xs, &mut got, isa);
                assert_eq!((e.to_bits(), &got), (d.to_bits(), &want), "{isa:?}");
            }
        }
        let mut codes = [0i8; 4];
        scalar::quantize_group(&[127.0, 2.5, -0.5, 0.49999997], &mut codes);
        assert_eq!(codes, [127, 3, -1, 0], "round half away from zero");
    }

    #[test]
    fn quantization_error_is_bounded_by_half_a_step() {
        let (r, c, g) = (5, 128, 64);
        let m = Matrix::new(r, c, data(99, r * c));
        for kind in [QuantKind::Int8, QuantKind::Int4, QuantKind::Int2] {
            let q = QMatrix::quantize(&m, kind, g).unwrap();
            let d = q.dequantize();
            for row in 0..r {
                for i in 0..c {
                    let step = q.scales[row * (c / g) + i / g];
                    let e = (d.row(row)[i] - m.row(row)[i]).abs();
                    assert!(
                        e <= 0.5 * step + 1e-6,
                        "{kind:?}: error {e} > half step {step}"
                    );
                }
            }
        }
        let q = QMatrix::quantize(&m, QuantKind::Bf16, c).unwrap();
        for (a, b) in q.dequantize().data.iter().zip(&m.data) {
            assert!((a - b).abs() <= b.abs() / 256.0);
        }
    }

    #[test]
    fn refuses_bad_groups_and_non_finite() {
        let m = Matrix::new(2, 64, vec![0.5; 128]);
        assert!(matches!(
            QMatrix::quantize(&m, QuantKind::Int4, 12),
            Err(QuantError::Group { .. })
        ));
        assert!(matches!(
            QMatrix::quantize(&m, QuantKind::Int4, 0),
            Err(QuantError::Group { .. })
        ));
        assert!(matches!(
            QMatrix::quantize(&m, QuantKind::Int4, 128),
            Err(QuantError::Group { .. })
        ));
        let mut bad = m.clone();
        bad.data[70] = f32::NAN;
        assert_eq!(
            QMatrix::quantize(&bad, QuantKind::Int8, 64),
            Err(QuantError::NonFinite { index: 70 })
        );
        // all-zero groups quantize to zeros, not NaN
        let z = QMatrix::quantize(&Matrix::new(1, 64, vec![0.0; 64]), QuantKind::Int2, 64).unwrap();
        assert!(z
            .matmul(&[1.0; 64], 1, Isa::detect())
            .iter()
            .all(|v| *v == 0.0));
    }
}
