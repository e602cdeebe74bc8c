//! A prediction as text, the table `charm plan --cluster` prints.

use super::model::{Prediction, GIB};

impl Prediction {
    /// The prediction as text.
    pub fn render(&self) -> String {
        let t = &self.token;
        let mut s = format!("speed ({}):\n", self.setup.source);
        if self.setup.replicas > 1 && self.setup.hot_share > 0.0 {
            s += &format!(
                "  placement: {} copies of the hottest {:.0}% of each layer's experts, each run to its least loaded holder\n",
                self.setup.replicas,
                100.0 * self.setup.hot_share
            );
        }
        for (l, n) in self.links.iter().zip(&self.setup.nodes) {
            let vram = match n.gpu {
                Some(_) => format!(
                    ", {:.0}% in its VRAM = {:.2} GiB serving {:.0}% of its expert reads",
                    100.0 * l.vram_share,
                    l.vram_bytes as f64 / GIB,
                    100.0 * l.vram_read_share
                ),
                None => String::new(),
            };
            s += &format!(
                "  {:<12} {:>5.1}% of experts ({:>4.0}% in its RAM{vram}), {:.2} experts per layer, {}\n",
                l.name,
                100.0 * l.held_share,
                100.0 * l.resident_share,
                l.experts_per_layer,
                if n.in_process {
                    "in the coordinator's process".to_string()
                } else {
                    format!(
                        "{:.1} KB per token = {:.2} ms at line rate, {:.3} ms per request (round trip and software), waited for on {:.0}% of layers",
                        l.bytes_per_token / 1e3,
                        l.line_ms_per_token,
                        n.latency_s * 1e3,
                        100.0 * l.critical_share
                    )
                }
            );
        }
        let compute = if self.setup.nodes.iter().any(|n| n.gpu.is_some()) {
            format!(
                "{:.2} ms (RAM and VRAM, {:.2} ms of it the GPU's beyond the CPU's; {:.0}% of expert reads from VRAM)",
                t.expert_compute_ms,
                t.expert_vram_ms,
                100.0 * self.vram_read_share
            )
        } else {
            format!("{:.2} ms (RAM)", t.expert_compute_ms)
        };
        s += &format!(
            "  per token: dense {:.2} ms{} + round trips {:.2} ms + transfer {:.2} ms + experts {compute} + {:.2} ms (disk) - {:.2} ms hidden behind the shared expert = {:.2} ms\n",
            t.dense_ms,
            if self.setup.dense_device == "gpu" {
                " (on the coordinator's GPU)"
            } else {
                ""
            },
            t.round_trips_ms,
            t.transfer_ms,
            t.expert_disk_ms,
            t.overlap_ms,
            t.total_ms
        );
        s += &format!(
            "  predicted {:.2} tok/s; bottleneck: {}\n",
            self.tok_s, self.bottleneck
        );
        if let Some(sp) = &self.speculative {
            s += &format!(
                "  with --draft {} at {:.0}% acceptance per draft: {:.2} tokens per step of {:.2} ms (drafts {:.2} ms) = {:.2} tok/s\n",
                sp.draft,
                100.0 * sp.acceptance,
                sp.tokens_per_step,
                sp.step.total_ms,
                sp.step.drafts_ms,
                sp.tok_s
            );
        }
        if self.setup.nodes.len() > 1 {
            let copies = self.setup.replicas.max(2);
            // (rounded down: the flag as printed keeps every expert in RAM or VRAM)
            let share = (self.replica_room * 100.0).floor() / 100.0;
            s += &match share > 0.0 {
                true => format!(
                    "  room for replicas: {copies} copies of the hottest {:.0}% of each layer's experts fit in the machines' RAM and VRAM (--replicas {copies} --hot-share {share:.2})\n",
                    100.0 * share
                ),
                false => format!(
                    "  room for replicas: none; {copies} copies of even 1% of each layer's experts would be read from disk\n"
                ),
            };
        }
        s
    }
}
