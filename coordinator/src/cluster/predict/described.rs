//! A cluster described by its machines (`charm plan --cluster MACHINES.json`), read and
//! checked, and turned into the model's view of it ([`Setup`]).

use serde::{Deserialize, Serialize};

use super::model::{
    ModelCost, Node, NodeGpu, Setup, EXPERT_EFFICIENCY, GIB, GPU_EFFICIENCY, GPU_HEADROOM_GIB,
    GPU_SUBMIT_S, PCIE_BYTES_S,
};
use crate::model::engine::DenseDevice;

/// A machine of a described cluster (all speeds the user's own figures or guesses).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    pub name: String,
    /// RAM of the machine, GiB.
    pub ram_gib: f64,
    /// Memory read bandwidth, GB/s.
    pub mem_gb_s: f64,
    /// Sequential read speed of the disk holding the model, GB/s.
    #[serde(default = "default_disk")]
    pub disk_gb_s: f64,
    /// Link to the coordinator's switch, Gbit/s, and the round trip to the coordinator, ms.
    #[serde(default = "default_link")]
    pub link_gbit_s: f64,
    #[serde(default = "default_rtt")]
    pub rtt_ms: f64,
    /// Expert rows per second measured on it (a worker's hello, `charm cluster status`):
    /// overrides the estimate from memory bandwidth.
    #[serde(default)]
    pub expert_rows_s: Option<f64>,
    /// Its GPU, for the VRAM tier (`--vram`): the experts placed on it fill VRAM first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<MachineGpu>,
}

/// A described machine's GPU (`"gpu": {"vram_gib": 24, "mem_gb_s": 900}`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MachineGpu {
    /// Memory of the card, GiB: experts get it less [`GPU_HEADROOM_GIB`].
    pub vram_gib: f64,
    /// Its memory read bandwidth, GB/s (the kernels are taken to read at `gpu_efficiency` of it).
    pub mem_gb_s: f64,
    /// Its link to the host, GB/s (default [`PCIE_BYTES_S`]): the coordinator's rows cross it
    /// when the dense pass runs on the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_gb_s: Option<f64>,
}

fn default_disk() -> f64 {
    3.0
}
fn default_link() -> f64 {
    10.0
}
fn default_rtt() -> f64 {
    0.1
}
fn default_overhead() -> f64 {
    0.1
}
fn default_dense_eff() -> f64 {
    0.8
}
fn default_expert_eff() -> f64 {
    EXPERT_EFFICIENCY
}
fn default_reserve() -> f64 {
    4.0
}
fn default_gpu_eff() -> f64 {
    GPU_EFFICIENCY
}

/// A cluster described by its machines: the first runs the coordinator (dense skeleton, KV
/// cache) and, with more than one machine, every machine runs a worker (the coordinator's with
/// the RAM the coordinator leaves), reached over loopback on the first.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Described {
    pub machines: Vec<Machine>,
    /// Software cost per request beyond the network round trip (QUIC, framing, thread
    /// hand-offs), ms: measured 0.15 ms on loopback (docs/benchmarks.md, pinned).
    #[serde(default = "default_overhead")]
    pub request_overhead_ms: f64,
    /// Share of the memory bandwidth the kernels read weights at: dense (int8) and experts
    /// (default [`EXPERT_EFFICIENCY`], measured).
    #[serde(default = "default_dense_eff")]
    pub dense_efficiency: f64,
    #[serde(default = "default_expert_eff")]
    pub expert_efficiency: f64,
    /// Share of a machine's GPU memory bandwidth the GPU's expert kernels read weights at
    /// (default [`GPU_EFFICIENCY`], assumed: not measured on a real GPU yet).
    #[serde(default = "default_gpu_eff")]
    pub gpu_efficiency: f64,
    /// GiB of each machine left to the system and charm's own buffers.
    #[serde(default = "default_reserve")]
    pub reserve_gib: f64,
}

/// Whether `text` is a described cluster (a `machines` list) rather than a cluster file.
pub fn is_described(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .is_some_and(|v| v.get("machines").is_some())
}

/// Most machines a described cluster may name.
const MAX_MACHINES: usize = 1024;

impl Described {
    /// Parses and checks a described cluster.
    pub fn parse(text: &str) -> Result<Self, String> {
        // each machine alone first, so that an error in one names it
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if let Some(ms) = v.get("machines").and_then(|m| m.as_array()) {
            for (i, m) in ms.iter().enumerate() {
                if let Err(e) = Machine::deserialize(m) {
                    return Err(match m.get("name").and_then(|n| n.as_str()) {
                        Some(n) => format!("machine `{n}`: {e}"),
                        None => format!("machine {} of `machines`: {e}", i + 1),
                    });
                }
            }
        }
        let d: Described = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if d.machines.is_empty() {
            return Err("`machines` is empty: name at least the coordinator's".into());
        }
        if d.machines.len() > MAX_MACHINES {
            return Err(format!(
                "{} machines: at most {MAX_MACHINES} are planned",
                d.machines.len()
            ));
        }
        let pos = |v: f64| v.is_finite() && v > 0.0;
        for m in &d.machines {
            if !(pos(m.ram_gib) && pos(m.mem_gb_s) && pos(m.disk_gb_s) && pos(m.link_gbit_s)) {
                return Err(format!(
                    "machine `{}`: ram_gib, mem_gb_s, disk_gb_s and link_gbit_s must be positive",
                    m.name
                ));
            }
            if !(m.rtt_ms.is_finite() && m.rtt_ms >= 0.0)
                || m.expert_rows_s.is_some_and(|r| !pos(r))
            {
                return Err(format!(
                    "machine `{}`: rtt_ms must be 0 or more, expert_rows_s positive",
                    m.name
                ));
            }
            if m.gpu.as_ref().is_some_and(|g| {
                !(pos(g.vram_gib) && pos(g.mem_gb_s) && g.pcie_gb_s.is_none_or(pos))
            }) {
                return Err(format!(
                    "machine `{}`: gpu.vram_gib, gpu.mem_gb_s and gpu.pcie_gb_s must be positive",
                    m.name
                ));
            }
        }
        for (v, what) in [
            (d.dense_efficiency, "dense_efficiency"),
            (d.expert_efficiency, "expert_efficiency"),
            (d.gpu_efficiency, "gpu_efficiency"),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(format!("{what} must be in (0, 1]"));
            }
        }
        if !(d.request_overhead_ms >= 0.0 && d.reserve_gib >= 0.0) {
            return Err("request_overhead_ms and reserve_gib must be 0 or more".into());
        }
        Ok(d)
    }

    /// The predictor's view: placement by capacity (expert RAM and VRAM times speed, as
    /// [`crate::cluster::Placement`] places), the coordinator's share of its machine subtracted; the
    /// experts placed on a machine fill its VRAM first. The speed is the CPU's: a live worker
    /// measures the rate its hello reports through its VRAM tier, so a live placement may give
    /// a GPU machine more than this (not modelled).
    pub fn setup(&self, m: &ModelCost) -> Setup {
        self.setup_with(m, DenseDevice::Cpu, true)
            .expect("a dense pass on the CPU always has a setup")
    }

    /// [`Self::setup`] with the dense pass where `dense` says: on the coordinator's GPU
    /// (`gpu`; `auto` where the skeleton and the KV cache fit its VRAM), at its bandwidth times
    /// `gpu_efficiency`, plus per token the submissions that wait for the rows
    /// ([`ModelCost::gpu_round_trips`] x [`GPU_SUBMIT_S`]) and the rows over PCIe; the card's
    /// VRAM beyond them holds experts; the MTP drafts run there too. An
    /// error when `gpu` is asked for and the coordinator has no GPU or it cannot hold them.
    /// `experts_in_vram`: whether the GPUs hold routed experts (the VRAM tier takes int8/int4
    /// experts with int8 activations only).
    pub fn setup_with(
        &self,
        m: &ModelCost,
        dense: DenseDevice,
        experts_in_vram: bool,
    ) -> Result<Setup, String> {
        let c = &self.machines[0];
        let cpu_bps = c.mem_gb_s * 1e9 * self.dense_efficiency;
        let dense_bps = cpu_bps;
        let need = m.dense_bytes + m.kv_bytes + (GPU_HEADROOM_GIB * GIB) as u64;
        let on_gpu = match (dense, &c.gpu) {
            (DenseDevice::Cpu, _) => None,
            (DenseDevice::Gpu, None) => {
                return Err(format!(
                    "--dense-device gpu: the coordinator's machine `{}` has no `gpu`",
                    c.name
                ))
            }
            (DenseDevice::Gpu, Some(g)) if ((g.vram_gib * GIB) as u64) < need => {
                return Err(format!(
                    "--dense-device gpu: the dense skeleton and the KV cache ({:.2} GiB with {} GiB of headroom) do not fit the {} GiB of `{}`'s GPU",
                    need as f64 / GIB,
                    GPU_HEADROOM_GIB,
                    g.vram_gib,
                    c.name
                ))
            }
            (_, Some(g)) if ((g.vram_gib * GIB) as u64) >= need => Some(g),
            _ => None,
        };
        let reserve = (self.reserve_gib * GIB) as u64;
        let ram = |x: &Machine| (x.ram_gib * GIB) as u64;
        let expert_s = |x: &Machine| match x.expert_rows_s {
            Some(r) => 1.0 / r,
            None => m.expert_bytes as f64 / (x.mem_gb_s * 1e9 * self.expert_efficiency),
        };
        let disk_s = |x: &Machine| m.expert_bytes as f64 / (x.disk_gb_s * 1e9);
        // (the dense skeleton stays on the CPU: the whole card less headroom holds experts)
        let gpu = |x: &Machine| {
            if !experts_in_vram {
                return None;
            }
            // the coordinator's card holds the dense skeleton and the KV cache first
            let taken = if std::ptr::eq(x, c) && on_gpu.is_some() {
                (m.dense_bytes + m.kv_bytes) as f64
            } else {
                0.0
            };
            x.gpu.as_ref().map(|g| NodeGpu {
                vram_bytes: ((g.vram_gib - GPU_HEADROOM_GIB).max(0.0) * GIB - taken).max(0.0)
                    as u64,
                expert_s: m.expert_bytes as f64 / (g.mem_gb_s * 1e9 * self.gpu_efficiency),
                submit_s: GPU_SUBMIT_S,
            })
        };
        let overhead = self.request_overhead_ms / 1e3;
        let mut nodes: Vec<Node> = Vec::new();
        // the dense weights' CPU copies are freed once the GPU holds them (the embedding stays)
        let resident = match on_gpu {
            Some(_) => m
                .coordinator_resident_bytes
                .saturating_sub(m.dense_bytes.saturating_sub(m.embed_bytes)),
            None => m.coordinator_resident_bytes,
        };
        let coordinator_left = ram(c).saturating_sub(resident + reserve);
        if self.machines.len() == 1 {
            nodes.push(Node {
                name: c.name.clone(),
                share: 1.0,
                ram_bytes: coordinator_left.max(1),
                expert_s: expert_s(c),
                disk_s: disk_s(c),
                latency_s: 0.0,
                latency_samples_s: vec![],
                bytes_s: f64::INFINITY,
                in_process: true,
                gpu: gpu(c),
            });
        } else {
            for (i, x) in self.machines.iter().enumerate() {
                let (ram_bytes, latency_s, bytes_s) = if i == 0 {
                    // a worker beside the coordinator, over loopback
                    (coordinator_left.max(1), overhead, f64::INFINITY)
                } else {
                    (
                        ram(x).saturating_sub(reserve).max(1),
                        overhead + x.rtt_ms / 1e3,
                        x.link_gbit_s * 1e9 / 8.0,
                    )
                };
                nodes.push(Node {
                    name: x.name.clone(),
                    share: 0.0,
                    ram_bytes,
                    expert_s: expert_s(x),
                    disk_s: disk_s(x),
                    latency_s,
                    latency_samples_s: vec![],
                    bytes_s,
                    in_process: false,
                    gpu: gpu(x),
                });
            }
            // (a worker's hello counts its VRAM with its RAM for placement)
            let cap: Vec<f64> = nodes
                .iter()
                .map(|x| {
                    let vram = x.gpu.as_ref().map_or(0, |g| g.vram_bytes);
                    (x.ram_bytes + vram) as f64 / x.expert_s
                })
                .collect();
            let total: f64 = cap.iter().sum();
            for (x, c) in nodes.iter_mut().zip(cap) {
                x.share = c / total;
            }
        }
        let (dense_s, shared_s, mtp_s) = match on_gpu {
            Some(g) => {
                let bps = g.mem_gb_s * 1e9 * self.gpu_efficiency;
                let pcie = g.pcie_gb_s.map_or(PCIE_BYTES_S, |p| p * 1e9);
                let per_layer = m.pcie_bytes / m.gpu_round_trips.max(1) as f64 / pcie;
                // one machine streaming experts its RAM does not hold: the router's lookahead
                // comes back from the GPU before each layer's attention (a draft's one layer too)
                let lookahead = self.machines.len() == 1
                    && (nodes[0].ram_bytes as f64) < m.experts_total_bytes as f64;
                let (ahead, ahead_draft) = if lookahead {
                    (m.lookahead_round_trips as f64, 1.0)
                } else {
                    (0.0, 0.0)
                };
                (
                    m.dense_read_bytes as f64 / bps
                        + (m.gpu_round_trips as f64 + ahead) * GPU_SUBMIT_S
                        + m.pcie_bytes / pcie,
                    // the shared expert runs on the GPU while the routed experts compute
                    m.shared_read_bytes as f64 / bps,
                    // a draft: the MTP layer and its head, one MoE layer's round trip
                    m.mtp_read_bytes as f64 / bps + (2.0 + ahead_draft) * GPU_SUBMIT_S + per_layer,
                )
            }
            None => (
                m.dense_read_bytes as f64 / dense_bps,
                m.shared_read_bytes as f64 / dense_bps,
                m.mtp_read_bytes as f64 / cpu_bps,
            ),
        };
        Ok(Setup {
            source: "described".into(),
            dense_device: if on_gpu.is_some() { "gpu" } else { "cpu" }.into(),
            dense_s,
            dense_extra_s: 0.0,
            shared_s,
            mtp_s,
            coordinator_bytes_s: c.link_gbit_s * 1e9 / 8.0,
            nodes,
            replicas: 1,
            hot_share: 0.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::predict;
    use super::super::model::tests::model;
    use super::*;

    #[test]
    fn the_dense_pass_on_the_coordinators_gpu() {
        // the test model: 2 GB of dense reads, 2 GB skeleton and 0.1 GB of KV, 10 MoE layers
        let m = model();
        let text = |vram: f64| {
            format!(
                r#"{{"machines": [
                    {{"name": "c", "ram_gib": 64, "mem_gb_s": 50, "gpu": {{"vram_gib": {vram}, "mem_gb_s": 1000, "pcie_gb_s": 10}}}},
                    {{"name": "w", "ram_gib": 64, "mem_gb_s": 50}}]}}"#
            )
        };
        let d = Described::parse(&text(8.0)).unwrap();
        let cpu = d.setup_with(&m, DenseDevice::Cpu, true).unwrap();
        let gpu = d.setup_with(&m, DenseDevice::Gpu, true).unwrap();
        assert_eq!(
            (cpu.dense_device.as_str(), gpu.dense_device.as_str()),
            ("cpu", "gpu")
        );
        assert!((cpu.dense_s - 2e9 / (50e9 * 0.8)).abs() < 1e-9);
        // VRAM bandwidth times its efficiency, a submission per round trip, the rows over PCIe
        let want = 2e9 / (1000e9 * GPU_EFFICIENCY) + 11.0 * GPU_SUBMIT_S + m.pcie_bytes / 10e9;
        assert!((gpu.dense_s - want).abs() < 1e-9, "{} {want}", gpu.dense_s);
        assert!(gpu.shared_s > 0.0 && gpu.shared_s < cpu.shared_s);
        assert!(gpu.mtp_s < cpu.mtp_s);
        // the coordinator's card holds the skeleton and the KV cache before experts
        let vram = |s: &Setup| s.nodes[0].gpu.as_ref().unwrap().vram_bytes;
        assert_eq!(vram(&cpu) - vram(&gpu), m.dense_bytes + m.kv_bytes);
        assert!(predict(gpu.clone(), &m, 0, 0.0).tok_s > predict(cpu, &m, 0, 0.0).tok_s);
        // too small a card: `gpu` says why, `auto` stays on the CPU; no GPU at all likewise
        let small = Described::parse(&text(2.5)).unwrap();
        let e = small.setup_with(&m, DenseDevice::Gpu, true).unwrap_err();
        assert!(e.contains("do not fit"), "{e}");
        assert_eq!(
            small
                .setup_with(&m, DenseDevice::Auto, true)
                .unwrap()
                .dense_device,
            "cpu"
        );
        assert_eq!(
            d.setup_with(&m, DenseDevice::Auto, true)
                .unwrap()
                .dense_device,
            "gpu"
        );
        let none = Described::parse(&text(8.0).replace(
            r#", "gpu": {"vram_gib": 8, "mem_gb_s": 1000, "pcie_gb_s": 10}"#,
            "",
        ))
        .unwrap();
        assert!(none.machines[0].gpu.is_none());
        let e = none.setup_with(&m, DenseDevice::Gpu, true).unwrap_err();
        assert!(e.contains("has no `gpu`"), "{e}");
        // f32 activations: the card runs the dense pass but holds no experts
        let no_experts = d.setup_with(&m, DenseDevice::Gpu, false).unwrap();
        assert!(no_experts.nodes[0].gpu.is_none() && no_experts.dense_device == "gpu");
        // one machine: its store reads experts ahead when its RAM does not hold them all, and
        // each layer's lookahead comes back from the GPU first (the test model's experts are
        // 0.64 GB: 64 GiB holds them, 0.5 GiB does not; the dense weights' CPU copies are
        // freed)
        let one = |ram: f64| {
            Described::parse(&format!(
                r#"{{"machines": [{{"name": "c", "ram_gib": {ram}, "mem_gb_s": 50,
                    "gpu": {{"vram_gib": 8, "mem_gb_s": 1000, "pcie_gb_s": 10}}}}],
                    "reserve_gib": 0}}"#
            ))
            .unwrap()
            .setup_with(&m, DenseDevice::Gpu, true)
            .unwrap()
        };
        let (fits, streams) = (one(64.0), one(0.5));
        assert!((streams.dense_s - fits.dense_s - 12.0 * GPU_SUBMIT_S).abs() < 1e-9);
        assert!((streams.mtp_s - fits.mtp_s - GPU_SUBMIT_S).abs() < 1e-9);
        // the coordinator's RAM for experts: the dense weights' room, but for the embedding,
        // once the GPU holds them
        let left = |s: &Setup| s.nodes[0].ram_bytes;
        let on_cpu = Described::parse(&text(8.0))
            .unwrap()
            .setup_with(&m, DenseDevice::Cpu, true)
            .unwrap();
        assert_eq!(
            left(&gpu) - left(&on_cpu),
            m.coordinator_resident_bytes
                .min(m.dense_bytes - m.embed_bytes)
        );
    }

    #[test]
    fn described_clusters() {
        let m = model();
        assert!(Described::parse(r#"{"machines": []}"#).is_err());
        assert!(
            Described::parse(r#"{"machines": [{"name": "a", "ram_gib": 0, "mem_gb_s": 1}]}"#)
                .is_err()
        );
        assert!(Described::parse(
            r#"{"machines": [{"name": "a", "ram_gib": 8, "mem_gb_s": 1, "bogus": 1}]}"#
        )
        .is_err());
        assert!(is_described(r#"{"machines": []}"#) && !is_described(r#"{"workers": []}"#));
        let many: Vec<String> = (0..=MAX_MACHINES)
            .map(|i| format!(r#"{{"name": "m{i}", "ram_gib": 8, "mem_gb_s": 1}}"#))
            .collect();
        let e = Described::parse(&format!(r#"{{"machines": [{}]}}"#, many.join(","))).unwrap_err();
        assert!(e.contains("at most"), "{e}");
        let one =
            Described::parse(r#"{"machines": [{"name": "a", "ram_gib": 64, "mem_gb_s": 50}]}"#)
                .unwrap();
        let s = one.setup(&m);
        assert_eq!(s.nodes.len(), 1);
        assert!(s.nodes[0].in_process);
        let p = predict(s, &m, 0, 0.0);
        assert_eq!(p.token.round_trips_ms, 0.0);
        assert_eq!(p.links[0].bytes_per_token, 0.0);
        let two = Described::parse(
            r#"{"machines": [{"name": "a", "ram_gib": 64, "mem_gb_s": 50},
                             {"name": "b", "ram_gib": 64, "mem_gb_s": 50, "link_gbit_s": 1, "rtt_ms": 0.2}]}"#,
        )
        .unwrap();
        let s = two.setup(&m);
        // the coordinator's machine keeps less RAM for experts, so a smaller share
        assert!(s.nodes[0].share < s.nodes[1].share);
        assert!((s.nodes[1].latency_s - 3e-4).abs() < 1e-12);
        assert_eq!(s.nodes[1].bytes_s, 1.25e8);
        let p = predict(s, &m, 0, 0.0);
        assert!(p.token.round_trips_ms > 0.0 && p.links[1].line_ms_per_token > 0.0);
    }

    #[test]
    fn described_gpus() {
        let mut m = model();
        // (the shared expert's compute would hide these small experts' time)
        m.shared_read_bytes = 0;
        // `gpu` on the second machine
        let text = |gpu: &str| {
            format!(
                r#"{{"machines": [{{"name": "a", "ram_gib": 2, "mem_gb_s": 50}},
                                  {{"name": "b", "ram_gib": 1.5, "mem_gb_s": 50, "link_gbit_s": 10{gpu}}}],
                    "reserve_gib": 0.5}}"#
            )
        };
        let plain = Described::parse(&text("")).unwrap();
        let with =
            Described::parse(&text(r#", "gpu": {"vram_gib": 1.25, "mem_gb_s": 900}"#)).unwrap();
        let g = with.machines[1].gpu.as_ref().unwrap();
        assert_eq!((g.vram_gib, g.mem_gb_s), (1.25, 900.0));
        assert_eq!(with.gpu_efficiency, GPU_EFFICIENCY);
        let s = with.setup(&m);
        let ng = s.nodes[1].gpu.as_ref().unwrap();
        assert_eq!(ng.vram_bytes, (0.25 * GIB) as u64);
        assert!((ng.expert_s - 1e6 / (900e9 * GPU_EFFICIENCY)).abs() < 1e-15);
        assert!(s.nodes[0].gpu.is_none());
        let (a, b) = (predict(plain.setup(&m), &m, 0, 0.0), predict(s, &m, 0, 0.0));
        assert!(
            b.links[1].vram_bytes > 0 && b.links[1].vram_read_share > 0.0,
            "{b:?}"
        );
        assert_eq!(a.links[1].vram_bytes, 0);
        assert!(b.tok_s > a.tok_s, "{} vs {}", b.tok_s, a.tok_s);
        // a card no larger than the headroom holds nothing: the same prediction
        let tiny = Described::parse(&text(r#", "gpu": {"vram_gib": 1, "mem_gb_s": 900}"#)).unwrap();
        let c = predict(tiny.setup(&m), &m, 0, 0.0);
        assert_eq!(c.tok_s, a.tok_s);
        assert_eq!(c.links[1].vram_bytes, 0);
        // bad GPUs: errors naming the machine
        for (gpu, says) in [
            (
                r#", "gpu": {"vram_gib": -24, "mem_gb_s": 900}"#,
                "must be positive",
            ),
            (
                r#", "gpu": {"vram_gib": 24, "mem_gb_s": 0}"#,
                "must be positive",
            ),
            (r#", "gpu": {"vram_gib": 24}"#, "missing field `mem_gb_s`"),
            (
                r#", "gpu": {"vram_gib": 24, "mem_gb_s": 900, "tflops": 1}"#,
                "unknown field `tflops`",
            ),
            (r#", "gpu": 24"#, "invalid type"),
        ] {
            let e = Described::parse(&text(gpu)).unwrap_err();
            assert!(e.contains("machine `b`") && e.contains(says), "{gpu}: {e}");
        }
        let e = Described::parse(&text("").replace(r#""name": "b", "#, "")).unwrap_err();
        assert!(e.contains("machine 2 of `machines`"), "{e}");
        let e =
            Described::parse(&text("").replace("}]", r#"}], "gpu_efficiency": 2"#)).unwrap_err();
        assert!(e.contains("gpu_efficiency"), "{e}");
    }
}
