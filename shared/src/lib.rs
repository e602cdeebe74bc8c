//! Code shared by charm's coordinator and workers. No sockets, no clocks.
//!
//! # Layout
//! - [`config`]: the architecture-independent [`config::ModelSpec`]; [`arch`] builds it from each
//!   architecture's `config.json`.
//! - [`arch::names`]: the tensor-name table every loader, converter and accounting shares.
//! - [`safetensors`]: header parser (untrusted bytes), memory-mapped files, a writer.
//! - [`colibri`]: directories made by colibrì's converter (`out-*.safetensors`, `.qs` scales).
//! - [`checkpoint`]: a Hugging Face model directory (shards, index, FP8 block scales).
//! - [`container`]: the converted charm container (manifest, dense file, expert records).
//! - [`aligned`]: a growable f32 buffer on a 64-byte boundary (the KV cache's storage).
//! - [`dtype`]: storage dtypes and exact conversion to f32.
//! - [`kernels`]: f32 matmul, norms, activations.
//! - [`linear`]: a linear layer (f32 or quantized weight) and the SwiGLU block.
//! - [`par`]: the forward pass's fork-join pool (helpers spin between loops).
//! - [`quant`]: int8 / int4 / int2 / bf16 weight formats, the lane layout, and their kernels (one
//!   module per ISA, chosen at run time, each bit-identical to the scalar twin).
//! - [`routing`]: pure MoE routing maths.
//! - [`softfloat`]: IEEE f32 arithmetic in integers (the GPU's scalar twin) and charm's own SiLU.
//! - [`expert`]: the routed-expert seam: [`expert::ExpertExecutor`], its batch, errors and
//!   statistics, and the grouping and ascending-order combine every executor shares.
//! - [`wire`]: the cluster's typed messages, their framing and the checks they pass on receipt.
//! - [`error`]: load errors that name the file and tensor.

pub mod aligned;
pub mod arch;
pub mod checkpoint;
pub mod colibri;
pub mod config;
pub mod container;
pub mod dtype;
pub mod error;
pub mod expert;
pub mod kernels;
pub mod linear;
pub mod par;
pub mod quant;
pub mod routing;
pub mod safetensors;
pub mod softfloat;
pub mod wire;

pub use error::LoadError;
