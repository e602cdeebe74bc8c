//! Decode speed of a model on a cluster, predicted (`charm plan --cluster`): from the live
//! workers, probed ([`super::probe`]), or from a described set of machines, so a user can plan
//! before buying hardware or downloading weights.
//!
//! A token (batch 1) pays the coordinator's dense pass, then for each MoE layer the slowest
//! worker its experts are on: that worker's fixed cost per request (round trip and software),
//! the bytes both ways at its link's rate (and all workers' bytes of the layer at the coordinator's
//! link's rate, which every one of them crosses), and its experts (read from RAM, or from its disk for the
//! share its expert RAM does not hold). The coordinator computes the layer's shared expert while
//! it waits, so that much of the wait is hidden. Routing is taken as uniform (each token's
//! `top_k` experts drawn without replacement); the expected slowest worker per layer is averaged
//! over a fixed sample of draws, so uneven draws count, not just the mean. With speculative
//! decoding a step verifies `draft + 1` tokens at once: one dense pass, the MTP layer once per
//! draft, the union of the tokens' experts, one round trip per layer; acceptance per draft is
//! taken as independent, giving `(1 - a^(d+1)) / (1 - a)` tokens per step.
//!
//! A node with a GPU (the VRAM tier, `--vram`) holds the first of the experts placed on it in
//! VRAM, then in RAM, then on disk; under uniform routing which experts are "hottest" does not
//! matter, only how many each tier holds. A layer's experts in VRAM run on the GPU while the
//! CPU computes the rest (as `charm_worker::gpu::tier` does), so the node's expert time for the
//! layer is the longer of the two. The GPU's figures are assumptions ([`GPU_EFFICIENCY`],
//! [`GPU_SUBMIT_S`]): its kernels are checked bit for bit against the CPU's but have not been
//! timed on real hardware.
//!
//! With the dense pass on the coordinator's GPU (`--dense-device gpu`, or `auto` where the
//! skeleton and the KV cache fit its VRAM) it reads the skeleton at the GPU's bandwidth times
//! `gpu_efficiency`, and a token adds one submission per MoE layer ([`GPU_SUBMIT_S`] each;
//! DSA's top-k runs on the device) and the rows over PCIe ([`PCIE_BYTES_S`] unless the machine's `gpu`
//! gives `pcie_gb_s`); the shared expert runs there while the routed experts compute, the MTP
//! drafts run there too, and the coordinator's VRAM beyond the skeleton and the KV cache holds
//! experts.
//!
//! The rooms: `model` is the prediction (what it is made from, the draws, the budget of a
//! token), `described` reads a described cluster's machines into the model's view of them, and
//! `render` prints a prediction as text (`--json` prints its fields as they are).

mod described;
mod model;
mod render;

pub use described::{is_described, Described, Machine, MachineGpu};
pub use model::{
    predict, tokens_per_step, Budget, LinkUse, ModelCost, Node, NodeGpu, Prediction, Setup,
    Speculative, GPU_EFFICIENCY, GPU_HEADROOM_GIB, GPU_SUBMIT_S, PCIE_BYTES_S,
};
