//! charm's coordinator: the dense forward pass, decoding, the cluster client and the HTTP server.
//!
//! # Layout
//! - [`model`]: the dense skeleton's weights, the forward pass (MLA / GQA attention, DSA
//!   selection, MoE, the MTP head), the KV cache, rotary embeddings, and the [`Engine`] that
//!   loads a model directory with its expert executor.
//! - [`decode`]: the generation loop, sampling, the tokenizer, chat templates, tool calls and the
//!   reasoning split.
//! - [`cluster`]: the cluster file, the placement of routed experts on workers, and the remote
//!   expert executor that sends expert work to them over QUIC.
//! - [`serve`]: the OpenAI- and Anthropic-compatible HTTP server of `charm serve`, its batch
//!   scheduler, the prefix cache and the conversation KV log.
//! - [`ops`]: convert, synth, doctor, plan, info, evaluate, quality.
//!
//! # How a request flows
//! An HTTP request ([`serve`]) is turned into one internal generation request, queued, and taken
//! by the scheduler, which runs one batched forward step ([`model::forward`]) for every running
//! sequence. Each MoE layer hands its routed experts to an
//! [`charm_shared::expert::ExpertExecutor`]: the local expert store (RAM, or streamed from disk,
//! in `charm-worker`) or the cluster's workers over QUIC ([`cluster::remote`]), whose kernels live
//! in `charm-shared`. The logits are sampled ([`decode::sampling`]) and the text goes back to
//! the client as it comes. `docs/architecture.md` follows the path file by file.

pub mod cluster;
pub mod decode;
pub mod model;
pub mod ops;
pub mod serve;

pub use model::cache::KvCache;
pub use model::engine::tune_allocator;
pub use model::engine::{Engine, EngineOptions, HistoryPolicy};
pub use model::forward::{ForwardError, ForwardOptions, MlaMode, Step, Trace};
pub use model::Model;
