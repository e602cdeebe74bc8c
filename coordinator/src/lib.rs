//! charm's coordinator: the dense forward pass, the KV cache, routing and decoding.
//!
//! # Layout
//! - [`engine`]: the one loader: model directory + options -> model, expert executor, plan.
//! - [`model`]: weights of the dense skeleton, loaded from a checkpoint; routed experts are
//!   handed to an [`charm_shared::expert::ExpertExecutor`].
//! - [`evaluate`]: held-out perplexity, MTP draft acceptance, routing skew.
//! - [`forward`]: the forward pass (MLA / GQA attention, DSA selection, MoE), the MTP head, traces.
//! - [`convert`]: Hugging Face checkpoint -> charm container, resumable.
//! - [`cache`]: the per-sequence KV cache (compressed latents for MLA).
//! - [`quality`]: top-1 agreement and KL divergence against reference logits.
//! - [`rope`]: rotary embeddings.
//! - [`sampling`]: greedy and seeded stochastic sampling.
//! - [`tokenizer`]: text <-> ids via `tokenizer.json`.
//! - [`chat`]: chat templates rendered as transformers renders them.
//! - [`gateway`]: the OpenAI-compatible HTTP server of `charm serve`.
//! - [`tools`]: tool calls taken out of generated text.
//! - [`generate`]: prefill + decode loop with timings.
//! - [`info`]: parameter and byte accounting for `charm info`.
//! - [`synth`]: deterministic synthetic containers with GLM-5.2 shapes.
//! - [`doctor`]: readiness checks with stable ids.
//! - [`cluster`]: the cluster file and the placement of routed experts on workers.
//! - [`remote`]: the expert executor that sends routed experts to workers over QUIC.
//! - [`plan`]: single-box memory planning (budget, expert cache size, expected disk traffic).

pub mod cache;
pub mod chat;
pub mod cluster;
pub mod convert;
pub mod doctor;
pub mod engine;
pub mod evaluate;
pub mod forward;
pub mod gateway;
pub mod generate;
pub mod info;
pub mod kvlog;
pub mod model;
pub mod plan;
pub mod quality;
pub mod remote;
pub mod rope;
pub mod sampling;
pub mod synth;
pub mod tokenizer;
pub mod tools;

pub use cache::KvCache;
pub use engine::{Engine, EngineOptions, HistoryPolicy};
pub use forward::{ForwardError, ForwardOptions, MlaMode, Step, Trace};
pub use model::Model;
