//! What the cluster would hold and move for a model (`charm plan --cluster`).

use charm_shared::config::ModelSpec;
use serde::Serialize;

use super::remote::{moe_layers, RemoteExperts};

/// What the cluster would hold and move for a model, from the workers' handshakes: printed by
/// `charm plan --cluster` before the model is loaded.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterPlan {
    pub workers: Vec<NodePlan>,
    /// MoE layers a token passes (MTP layers excluded).
    pub moe_layers: usize,
    /// Experts placed on no connected worker (computed on the coordinator).
    pub unplaced_experts: usize,
    /// Expected bytes per token: activations out (each token's row once per worker its experts
    /// are on) and unweighted expert outputs back (`top_k` rows), over all MoE layers.
    pub request_bytes_per_token: u64,
    pub result_bytes_per_token: u64,
    /// One round of requests (in parallel over workers) per MoE layer.
    pub round_trips_per_token: usize,
}

/// One worker's part in a [`ClusterPlan`].
#[derive(Debug, Clone, Serialize)]
pub struct NodePlan {
    pub name: String,
    pub addr: String,
    pub connected: bool,
    pub error: Option<String>,
    pub experts: usize,
    /// Bytes of the experts placed on it, the RAM and VRAM it gives experts (from its hello),
    /// and whether they hold them all.
    pub bytes: u64,
    pub ram_bytes: u64,
    pub vram_bytes: u64,
    pub all_resident: bool,
}

impl RemoteExperts {
    /// The plan of this cluster for its model, with `expert_bytes` per routed expert in memory.
    pub fn plan(&self, spec: &ModelSpec, expert_bytes: u64) -> ClusterPlan {
        let p = self.placement();
        let st = self.status();
        let layers: Vec<(usize, usize)> = moe_layers(spec)
            .into_iter()
            .filter(|l| l.0 < spec.layers.len())
            .collect();
        let all: usize = self.inner.shared.layers.iter().map(|l| l.1).sum();
        let placed: usize = self
            .inner
            .shared
            .layers
            .iter()
            .map(|&(l, n)| {
                (0..n as u32)
                    .filter(|&e| !p.holders(l, e).is_empty())
                    .count()
            })
            .sum();
        let (h, k) = (
            spec.hidden_size as f64,
            spec.router.as_ref().map_or(0, |r| r.top_k) as f64,
        );
        let total: usize = (0..st.len()).map(|i| p.count(i)).sum();
        // workers a token's top_k experts touch, choices independent with each worker's share
        let touched: f64 = (0..st.len())
            .map(|i| {
                let share = p.count(i) as f64 / total.max(1) as f64;
                1.0 - (1.0 - share).powf(k)
            })
            .sum();
        let remote_share = placed as f64 / all.max(1) as f64;
        let n = layers.len() as f64;
        ClusterPlan {
            workers: st
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let bytes = p.count(i) as u64 * expert_bytes;
                    NodePlan {
                        name: w.name.clone(),
                        addr: w.addr.clone(),
                        connected: w.connected,
                        error: w.error.clone(),
                        experts: p.count(i),
                        bytes,
                        ram_bytes: w.ram_bytes,
                        vram_bytes: w.vram_bytes,
                        all_resident: w.connected
                            && (w.ram_bytes == 0 || w.ram_bytes + w.vram_bytes >= bytes),
                    }
                })
                .collect(),
            moe_layers: layers.len(),
            unplaced_experts: all - placed,
            request_bytes_per_token: (n * touched * h * 4.0) as u64,
            result_bytes_per_token: (n * remote_share * k * h * 4.0) as u64,
            round_trips_per_token: if placed > 0 { layers.len() } else { 0 },
        }
    }
}

impl ClusterPlan {
    /// The plan as text.
    pub fn render(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mut s = String::from("cluster:\n");
        for w in &self.workers {
            if w.connected {
                let vram = if w.vram_bytes > 0 {
                    format!(" and {:.2} GiB expert VRAM", gib(w.vram_bytes))
                } else {
                    String::new()
                };
                s += &format!(
                    "  {:<12} {:<22} {:>6} experts, {:>8.2} GiB placed, {:>8.2} GiB expert RAM{vram}{}\n",
                    w.name,
                    w.addr,
                    w.experts,
                    gib(w.bytes),
                    gib(w.ram_bytes),
                    if w.all_resident {
                        ""
                    } else {
                        " (streams the rest from its disk)"
                    }
                );
            } else {
                s += &format!(
                    "  {:<12} {:<22} unreachable: {}\n",
                    w.name,
                    w.addr,
                    w.error.as_deref().unwrap_or("?")
                );
            }
        }
        if self.unplaced_experts > 0 {
            s += &format!(
                "  {} experts on no reachable worker: computed by the coordinator\n",
                self.unplaced_experts
            );
        }
        s += &format!(
            "  per token: {} round trips (one per MoE layer), {:.1} KB out, {:.1} KB back\n",
            self.round_trips_per_token,
            self.request_bytes_per_token as f64 / 1e3,
            self.result_bytes_per_token as f64 / 1e3
        );
        s
    }
}
