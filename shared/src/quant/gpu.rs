//! The GPU twin of the int8-activation expert path: the WGSL source (`softfloat.wgsl`, whose
//! integer-only IEEE steps mirror [`crate::softfloat`], then `expert.wgsl`, whose kernels mirror
//! [`super::scalar`]) and the layout of what the host hands it. No device here: opening one,
//! buffers and dispatch live with the worker's VRAM tier.

use super::{QMatrix, QuantKind};
use crate::linear::{Linear, SwiGlu};

/// The expert kernels' WGSL: the soft-float functions, then the kernels that use them.
pub const EXPERT_SHADER: &str =
    concat!(include_str!("softfloat.wgsl"), include_str!("expert.wgsl"));

/// The dense skeleton's kernels' WGSL: the soft-float functions, then `dense.wgsl`.
pub const DENSE_SHADER: &str = concat!(include_str!("softfloat.wgsl"), include_str!("dense.wgsl"));

/// Invocations per workgroup of every kernel in [`EXPERT_SHADER`].
pub const WORKGROUP: u32 = 64;

/// The combine step of `matvec` as the shader writes it, and a deliberately wrong one (the
/// device's own `fma`, which WGSL lets round as it likes): a self-check must refuse a kernel
/// built with [`perturbed_shader`].
const COMBINE: &str = "acc = sf_fma(s, sf_from_i32(isum), acc);";
const NATIVE_COMBINE: &str =
    "acc = bitcast<u32>(fma(bitcast<f32>(s), f32(isum), bitcast<f32>(acc)));";

/// [`EXPERT_SHADER`] with the combine done by the device's float unit instead of exact integer
/// steps: for tests that the device self-check notices a kernel that rounds differently.
pub fn perturbed_shader() -> String {
    assert!(
        EXPERT_SHADER.contains(COMBINE),
        "the shader's combine moved"
    );
    EXPERT_SHADER.replace(COMBINE, NATIVE_COMBINE)
}

/// The dense kernels' fixed tree of 8 lane sums as the shader writes it, and a wrong order (the
/// lanes summed one after another).
const TREE: &str = "return sf_add(sf_add(sf_add(a[0], a[4]), sf_add(a[1], a[5])), sf_add(sf_add(a[2], a[6]), sf_add(a[3], a[7])));";
const WRONG_TREE: &str = "return sf_add(sf_add(sf_add(sf_add(sf_add(sf_add(sf_add(a[0], a[1]), a[2]), a[3]), a[4]), a[5]), a[6]), a[7]);";

/// [`DENSE_SHADER`] with its lane sums in another order: for tests that a model's dense check
/// notices kernels that round differently.
pub fn perturbed_dense_shader() -> String {
    assert!(DENSE_SHADER.contains(TREE), "the dense shader's tree moved");
    DENSE_SHADER.replace(TREE, WRONG_TREE)
}

/// A dispatch's uniform block (`Params` in `expert.wgsl`): 16 words.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelParams {
    pub rows: u32,
    pub cols: u32,
    pub group: u32,
    /// 1 for int4 weights, 0 for int8.
    pub int4: u32,
    /// Input rows (tokens), or elements for `swiglu`.
    pub n: u32,
    /// Nibble block of the int4 activation order ([`nibble_block`]).
    pub nb: u32,
    pub w_data: u32,
    pub w_scales: u32,
    pub in0: u32,
    pub in1: u32,
    pub in2: u32,
    pub out0: u32,
    pub out1: u32,
    pub out2: u32,
}

/// Bytes of [`KernelParams`] as the shader reads it.
pub const PARAMS_BYTES: usize = 64;

impl KernelParams {
    /// The uniform block's bytes (little-endian words in declaration order, two words of
    /// padding).
    pub fn to_bytes(&self) -> [u8; PARAMS_BYTES] {
        let w = [
            self.rows,
            self.cols,
            self.group,
            self.int4,
            self.n,
            self.nb,
            self.w_data,
            self.w_scales,
            self.in0,
            self.in1,
            self.in2,
            self.out0,
            self.out1,
            self.out2,
            0,
            0,
        ];
        let mut b = [0u8; PARAMS_BYTES];
        for (o, v) in b.chunks_exact_mut(4).zip(w) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// The nibble block of int4 activations in groups of `group` (see `QuantizedActs`).
pub fn nibble_block(group: usize) -> usize {
    super::matmul::nibble_block(group)
}

/// Why an expert cannot run on the GPU path.
pub fn unsupported(e: &SwiGlu) -> Option<String> {
    for (name, l) in [("gate", &e.gate), ("up", &e.up), ("down", &e.down)] {
        let Linear::Quant(q) = l else {
            return Some(format!("its {name} projection is f32, not int8/int4"));
        };
        if !q.integer_path() {
            return Some(format!(
                "its {name} projection is {} with group {} (the GPU takes int8/int4 in groups of a multiple of 32)",
                q.kind.name(),
                q.group
            ));
        }
    }
    None
}

/// One matrix of an expert in the words the shader reads: packed codes row after row (the
/// container's layout), then the scales `[rows, groups]`.
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixWords {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    pub int4: bool,
    /// Words of codes, then of scales, from the start of the expert's buffer.
    pub data: usize,
    pub scales: usize,
}

/// An expert laid out for the GPU: gate, up and down ([`MatrixWords`] each) in one byte buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertWords {
    pub gate: MatrixWords,
    pub up: MatrixWords,
    pub down: MatrixWords,
    pub bytes: Vec<u8>,
}

impl ExpertWords {
    /// `e`'s three matrices, or why they cannot go to the GPU ([`unsupported`]).
    pub fn new(e: &SwiGlu) -> Result<Self, String> {
        if let Some(why) = unsupported(e) {
            return Err(why);
        }
        let mut bytes = Vec::new();
        let mut put = |l: &Linear| {
            let Linear::Quant(q) = l else {
                unreachable!("checked above")
            };
            let q: std::borrow::Cow<'_, QMatrix> = q.to_row_major();
            let data = bytes.len() / 4;
            bytes.extend_from_slice(&q.data);
            let scales = bytes.len() / 4;
            bytes.extend(q.scales.iter().flat_map(|s| s.to_le_bytes()));
            MatrixWords {
                rows: q.rows,
                cols: q.cols,
                group: q.group,
                int4: q.kind == QuantKind::Int4,
                data,
                scales,
            }
        };
        let (gate, up, down) = (put(&e.gate), put(&e.up), put(&e.down));
        Ok(Self {
            gate,
            up,
            down,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_sixteen_little_endian_words() {
        let p = KernelParams {
            rows: 1,
            out2: 7,
            ..Default::default()
        };
        let b = p.to_bytes();
        assert_eq!(&b[..4], &1u32.to_le_bytes());
        assert_eq!(&b[52..56], &7u32.to_le_bytes());
        assert_eq!(&b[56..], &[0; 8]);
    }

    #[test]
    fn the_perturbed_shader_differs_only_in_its_combine() {
        let p = perturbed_shader();
        assert_ne!(p, EXPERT_SHADER);
        assert_eq!(p.replace(NATIVE_COMBINE, COMBINE), EXPERT_SHADER);
    }
}
