//! The prediction model: a token's (or a speculative step's) time through the dense pass and
//! the MoE layers, from uniform draws of the routed experts (its assumptions are stated in
//! `predict/mod.rs`).

use serde::Serialize;

use crate::cluster::{place_layer, spread};
use crate::ops::plan::Plan;

/// What a model costs per token, as the predictor needs it (from `charm plan`'s memory plan).
#[derive(Debug, Clone, Serialize)]
pub struct ModelCost {
    pub moe_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// One routed expert of a main layer in RAM.
    pub expert_bytes: u64,
    /// Every main layer's routed experts.
    pub experts_total_bytes: u64,
    /// What the coordinator must hold before any expert: dense skeleton, KV cache, buffers.
    pub coordinator_resident_bytes: u64,
    /// Weight bytes one token reads on the coordinator (dense layers, attention, shared experts,
    /// head), and of it the shared expert of one MoE layer.
    pub dense_read_bytes: u64,
    pub shared_read_bytes: u64,
    /// Weight bytes one draft of the MTP layer reads (its dense part and `top_k` experts).
    pub mtp_read_bytes: u64,
    /// Bytes of one token's activation row out, and of one expert output row back.
    pub row_out_bytes: f64,
    pub row_back_bytes: f64,
    /// The dense skeleton and the KV cache of the planned context in memory (what a GPU running
    /// the dense pass must hold), bytes.
    pub dense_bytes: u64,
    pub kv_bytes: u64,
    /// Of the dense skeleton, what stays in the coordinator's RAM when the dense pass runs on
    /// its GPU (the embedding table; the rest's CPU copies are freed).
    pub embed_bytes: u64,
    /// Bytes a token moves between the coordinator's GPU and its CPU when the dense pass runs
    /// there (each MoE layer's normed row and router logits up, the experts' sum down), and the
    /// submissions that wait for them.
    pub pcie_bytes: f64,
    pub gpu_round_trips: usize,
    /// Read-backs a decoded token adds to the dense pass on a GPU when its executor wants the
    /// router's lookahead (one machine whose RAM does not hold every expert): one per MoE layer,
    /// two per dense layer (its guesses at the next MoE layer before and after attention).
    pub lookahead_round_trips: usize,
}

impl ModelCost {
    /// `bytes` as a share of the dense pass's weight bytes.
    pub fn dense_share(&self, bytes: u64) -> f64 {
        bytes as f64 / self.dense_read_bytes.max(1) as f64
    }

    /// From the memory plan of the model; `coded_group`: activations go out as int8 codes with
    /// a scale per group of this many (0: as f32).
    pub fn from_plan(p: &Plan, hidden: usize, coded_group: usize) -> Self {
        let moe = p.moe_layers.max(1) as u64;
        // every main MoE layer stores its experts alike (the MTP layer's may differ)
        let expert = p.active_expert_bytes_per_token / (p.top_k.max(1) as u64 * moe);
        let h = hidden as f64;
        Self {
            moe_layers: p.moe_layers,
            n_experts: p.experts_per_layer,
            top_k: p.top_k,
            expert_bytes: expert,
            experts_total_bytes: expert * p.experts_per_layer as u64 * p.moe_layers as u64,
            coordinator_resident_bytes: p.resident_bytes,
            dense_read_bytes: p.dense_read_bytes_per_token,
            shared_read_bytes: p.shared_read_bytes_per_layer,
            mtp_read_bytes: p.mtp_read_bytes_per_draft,
            row_out_bytes: if coded_group > 0 {
                h * (1.0 + 4.0 / coded_group as f64)
            } else {
                4.0 * h
            },
            row_back_bytes: 4.0 * h,
            dense_bytes: p.dense_bytes,
            kv_bytes: p.kv_bytes,
            embed_bytes: p.embed_bytes,
            pcie_bytes: p.moe_layers as f64 * (2.0 * h + p.experts_per_layer as f64) * 4.0,
            gpu_round_trips: p.moe_layers + 1,
            lookahead_round_trips: p.moe_layers + 2 * p.dense_layers,
        }
    }
}

/// PCIe bytes per second between a described GPU and its host unless the machine says
/// (`"pcie_gb_s"`): a PCIe 3.0 x16 link's practical rate (assumed).
pub const PCIE_BYTES_S: f64 = 12e9;

/// VRAM of a described machine's GPU kept from experts (the driver's context, the kernels'
/// scratch buffers, a display), GiB.
pub const GPU_HEADROOM_GIB: f64 = 1.0;

/// Share of a machine's memory bandwidth its CPU reads routed experts at (the default of a
/// described cluster's `expert_efficiency`): one MoE layer at GLM-5.2's shapes, one token, int8
/// activations, as the expert store runs it (`cargo bench --bench kernels -- --experts --glm52
/// --tokens 1 --top K`, K of 1, 2, 3 and 8, on AVX-512 VNNI and AVX2): the medians of 24 runs
/// read int4 experts at 97% of the memory probe and int8 at 93%, and this lies below both
/// (docs/benchmarks.md).
pub const EXPERT_EFFICIENCY: f64 = 0.9;

/// Share of a GPU's memory bandwidth its expert kernels are assumed to read weights at (the
/// default of a described cluster's `gpu_efficiency`). A guess, not a measurement: the WGSL
/// kernels (`charm_worker::gpu`) are tested bit for bit against the CPU's, but no run on a real
/// GPU has timed them yet.
pub const GPU_EFFICIENCY: f64 = 0.5;

/// Fixed seconds a layer pays on a node whose GPU computes any of its experts: one submission,
/// its inputs written and its outputs mapped back (assumed, not measured; a discrete GPU's
/// submit-and-read-back round trip through the driver is typically tens of microseconds to a
/// few hundred).
pub const GPU_SUBMIT_S: f64 = 1e-4;

/// Bytes of a GiB.
pub(super) const GIB: f64 = (1u64 << 30) as f64;

/// A node's GPU, as the predictor sees it: the experts placed on the node fill its VRAM first.
#[derive(Debug, Clone, Serialize)]
pub struct NodeGpu {
    /// VRAM given to experts, bytes (the card's less [`GPU_HEADROOM_GIB`]).
    pub vram_bytes: u64,
    /// Seconds to compute one expert for one token with the expert in VRAM.
    pub expert_s: f64,
    /// Fixed seconds per layer the GPU computes anything in ([`GPU_SUBMIT_S`]).
    pub submit_s: f64,
}

/// A machine that computes experts, as the predictor sees it.
#[derive(Debug, Clone, Serialize)]
pub struct Node {
    pub name: String,
    /// Its weight in placement: the share of each layer's experts placed on it without
    /// replicas.
    pub share: f64,
    /// RAM it gives experts (0: unknown, taken as holding all placed on it).
    pub ram_bytes: u64,
    /// Seconds to compute one expert for one token with the expert in RAM.
    pub expert_s: f64,
    /// Seconds to read one expert from its disk.
    pub disk_s: f64,
    /// Fixed seconds per request: the round trip and the software on both ends (the mean of
    /// `latency_samples_s` where the probe measured them: each layer then draws one, so the
    /// slowest of several workers' answers counts their spread, not only their means).
    pub latency_s: f64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub latency_samples_s: Vec<f64>,
    /// Link bytes per second (infinite: no link).
    pub bytes_s: f64,
    /// Runs in the coordinator's process (single box): no request, nothing overlaps it.
    pub in_process: bool,
    /// Its GPU, where routed experts run from VRAM (none: experts run on its CPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<NodeGpu>,
}

/// Everything the prediction is made from.
#[derive(Debug, Clone, Serialize)]
pub struct Setup {
    /// `"probed"` (live workers) or `"described"` (a machines file).
    pub source: String,
    /// Where the coordinator's dense pass runs: `"cpu"` or `"gpu"` (`--dense-device`).
    pub dense_device: String,
    /// The coordinator's dense pass for one token, and what each further token of a
    /// speculative step adds to it.
    pub dense_s: f64,
    pub dense_extra_s: f64,
    /// The shared expert of one MoE layer (overlaps the wait for the workers).
    pub shared_s: f64,
    /// One draft of the MTP layer on the coordinator.
    pub mtp_s: f64,
    /// The coordinator's own link, bytes per second: every worker's traffic crosses it
    /// (infinite: not a limit, or measured into each worker's figures by the probe).
    pub coordinator_bytes_s: f64,
    pub nodes: Vec<Node>,
    /// Copies of each of the hottest `hot_share` of a layer's experts, on different nodes
    /// (the cluster's `replicas`; 1: one copy of each), and that share.
    pub replicas: usize,
    pub hot_share: f64,
}

/// The time of one token (or one speculative step), split by what it is spent on; milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Budget {
    pub dense_ms: f64,
    /// MTP drafts (speculative steps only).
    pub drafts_ms: f64,
    /// Summed over MoE layers, of the worker each layer waits for: fixed request cost, bytes at
    /// line rate, experts from RAM, experts from disk.
    pub round_trips_ms: f64,
    pub transfer_ms: f64,
    pub expert_compute_ms: f64,
    pub expert_disk_ms: f64,
    /// Of `expert_compute_ms`, what the GPU adds: the time a layer's experts in VRAM (and the
    /// submission) take beyond the CPU's part of the layer on the same node, which runs at the
    /// same time. 0 while the CPU's part is the longer; not a further term of `total_ms`.
    pub expert_vram_ms: f64,
    /// The part of the wait the shared expert's compute hides (subtracted).
    pub overlap_ms: f64,
    pub total_ms: f64,
}

/// One node's traffic per token.
#[derive(Debug, Clone, Serialize)]
pub struct LinkUse {
    pub name: String,
    /// Share of each layer's experts placed on it, replicas counted.
    pub held_share: f64,
    pub experts_per_layer: f64,
    /// Share of the experts placed on it its RAM holds (those in its VRAM not counted).
    pub resident_share: f64,
    /// Share of the experts placed on it its VRAM holds (0 without a GPU), their bytes, and the
    /// share of its expert reads (distinct experts a step computes) served from VRAM.
    pub vram_share: f64,
    pub vram_bytes: u64,
    pub vram_read_share: f64,
    pub bytes_per_token: f64,
    /// Those bytes at the link's rate, milliseconds (0 without a link).
    pub line_ms_per_token: f64,
    /// Layers that wait for this node, of all MoE layers a token passes.
    pub critical_share: f64,
}

/// Speed with speculative decoding at a stated acceptance.
#[derive(Debug, Clone, Serialize)]
pub struct Speculative {
    pub draft: usize,
    pub acceptance: f64,
    pub tokens_per_step: f64,
    pub step: Budget,
    pub tok_s: f64,
}

/// The prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub setup: Setup,
    pub token: Budget,
    pub tok_s: f64,
    pub links: Vec<LinkUse>,
    /// Share of a token's expert reads, over all nodes, served from VRAM (0 without GPUs).
    pub vram_read_share: f64,
    /// What most of a token's time goes to, in words.
    pub bottleneck: String,
    pub speculative: Option<Speculative>,
    /// The largest share of each layer's experts two copies of which (or `replicas`, if more)
    /// the nodes' RAM and VRAM hold ([`replica_room`]; 0 with one node).
    pub replica_room: f64,
}

/// Layer draws averaged per prediction.
const DRAWS: usize = 4096;

/// SplitMix64: the draws are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize
    }
}

/// `k` distinct experts of `n`, uniformly (Floyd's algorithm).
fn draw(rng: &mut Rng, n: usize, k: usize, out: &mut Vec<usize>) {
    out.clear();
    for j in n - k..n {
        let t = rng.below(j + 1);
        out.push(if out.contains(&t) { j } else { t });
    }
}

/// A layer's holders as the coordinator places them: by share, the `hot` hottest (under
/// uniform routing any set: the lowest ids) with `replicas` holders.
fn placed(nodes: &[Node], n: usize, replicas: usize, hot: usize) -> Vec<Vec<usize>> {
    let weight: Vec<f64> = match nodes.iter().any(|x| x.share > 0.0) {
        true => nodes.iter().map(|x| x.share).collect(),
        false => vec![1.0; nodes.len()],
    };
    let order: Vec<u32> = (0..n as u32).collect();
    place_layer(&order, &weight, replicas.max(1), hot, |_, _| true)
}

/// The largest share of each layer's experts that can have `copies` holders (the hottest
/// first, as placed) while every node's RAM and VRAM still hold all the experts placed on it:
/// the `--hot-share` that replicates without reading from disk (0 where even single copies do
/// not fit, or one node holds them all).
pub fn replica_room(setup: &Setup, m: &ModelCost, copies: usize) -> f64 {
    let nodes = &setup.nodes;
    let n = m.n_experts;
    if nodes.len() < 2 || n == 0 {
        return 0.0;
    }
    let fits = |hot: usize| {
        let mut count = vec![0usize; nodes.len()];
        for w in placed(nodes, n, copies, hot).into_iter().flatten() {
            count[w] += 1;
        }
        nodes.iter().zip(count).all(|(x, c)| {
            let room = x.ram_bytes + x.gpu.as_ref().map_or(0, |g| g.vram_bytes);
            x.ram_bytes == 0 || c as f64 / n as f64 * m.experts_total_bytes as f64 <= room as f64
        })
    };
    match (0..=n).take_while(|&hot| fits(hot)).last() {
        Some(hot) => hot as f64 / n as f64,
        None => 0.0,
    }
}

impl Node {
    /// Shares of the experts placed on it (`held`, of each layer's, replicas counted) that its
    /// VRAM and its RAM hold, VRAM filled first (the rest is read from its disk).
    fn tiers(&self, m: &ModelCost, held: f64) -> (f64, f64) {
        let placed = held * m.experts_total_bytes as f64;
        if placed <= 0.0 {
            return (0.0, 1.0);
        }
        let vram = self
            .gpu
            .as_ref()
            .map_or(0.0, |g| (g.vram_bytes as f64 / placed).min(1.0));
        let ram = if self.ram_bytes == 0 {
            1.0 - vram
        } else {
            (self.ram_bytes as f64 / placed).min(1.0 - vram)
        };
        (vram, ram)
    }
}

/// Expected time of one step of `tokens` tokens through the MoE layers, and each node's traffic.
fn layers(setup: &Setup, m: &ModelCost, tokens: usize) -> (Budget, Vec<LinkUse>) {
    let nodes = &setup.nodes;
    let mut b = Budget::default();
    let hot = (setup.hot_share * m.n_experts as f64).round() as usize;
    let holders = placed(nodes, m.n_experts, setup.replicas, hot);
    // per expert and holder, its place among the experts that node holds (ascending ids)
    let mut count = vec![0usize; nodes.len()];
    let place: Vec<Vec<usize>> = holders
        .iter()
        .map(|hs| {
            hs.iter()
                .map(|&w| {
                    count[w] += 1;
                    count[w] - 1
                })
                .collect()
        })
        .collect();
    let held: Vec<f64> = count
        .iter()
        .map(|&c| c as f64 / m.n_experts.max(1) as f64)
        .collect();
    let tiers: Vec<(f64, f64)> = nodes
        .iter()
        .zip(&held)
        .map(|(x, &h)| x.tiers(m, h))
        .collect();
    let mut links: Vec<LinkUse> = nodes
        .iter()
        .zip(&tiers)
        .zip(&held)
        .map(|((x, &(vram, ram)), &h)| LinkUse {
            name: x.name.clone(),
            held_share: h,
            experts_per_layer: 0.0,
            resident_share: ram,
            vram_share: vram,
            vram_bytes: (vram * h * m.experts_total_bytes as f64) as u64,
            vram_read_share: 0.0,
            bytes_per_token: 0.0,
            line_ms_per_token: 0.0,
            critical_share: 0.0,
        })
        .collect();
    if m.moe_layers == 0 || m.top_k == 0 || nodes.is_empty() {
        return (b, links);
    }
    // of the experts not in VRAM, the share its RAM holds
    let hit: Vec<f64> = tiers
        .iter()
        .map(|&(v, r)| {
            if v < 1.0 {
                (r / (1.0 - v)).min(1.0)
            } else {
                1.0
            }
        })
        .collect();
    // how many of the experts a node holds its VRAM holds (the first: under uniform routing
    // any will do), fractional: a layer holds the whole part and, with the fraction's
    // probability, one more
    let in_vram: Vec<f64> = tiers
        .iter()
        .zip(&count)
        .map(|(&(v, _), &n)| v * n as f64)
        .collect();
    // each node's time for a row, relative to the mean, as the coordinator weighs its holders
    let mean_s = nodes.iter().map(|x| x.expert_s).sum::<f64>() / nodes.len() as f64;
    let cost: Vec<f64> = nodes
        .iter()
        .map(|x| match x.expert_s > 0.0 && mean_s > 0.0 {
            true => x.expert_s / mean_s,
            false => 1.0,
        })
        .collect();
    // (its own sequence, so that the experts drawn are the same with and without GPUs)
    let mut vram_rng = Rng(0x5EED_5EED);
    let mut vram_k = vec![0usize; nodes.len()];
    let mut rng = Rng(0x5EED);
    let mut picks = Vec::new();
    let mut step: Vec<usize> = Vec::new(); // the step's picks, token after token
    let mut runs: Vec<usize> = Vec::new(); // its distinct experts
    let mut run_rows = vec![0usize; m.n_experts];
    let mut chosen = vec![usize::MAX; m.n_experts];
    let (mut toks, mut rows, mut distinct, mut on_gpu) = (
        vec![0usize; nodes.len()],
        vec![0usize; nodes.len()],
        vec![0usize; nodes.len()],
        vec![0usize; nodes.len()],
    );
    let mut vram_reads = vec![0.0f64; nodes.len()];
    let mut touched = vec![false; nodes.len()];
    let mut sum = [0.0f64; 6]; // latency, transfer, compute, disk, overlap, the GPU's beyond the CPU's
    for _ in 0..DRAWS {
        toks.iter_mut().for_each(|t| *t = 0);
        rows.iter_mut().for_each(|r| *r = 0);
        distinct.iter_mut().for_each(|d| *d = 0);
        on_gpu.iter_mut().for_each(|d| *d = 0);
        for (k, &v) in vram_k.iter_mut().zip(&in_vram) {
            let whole = v.floor();
            let frac = v - whole;
            *k = whole as usize + (frac > 0.0 && vram_rng.unit() < frac) as usize;
        }
        step.clear();
        runs.clear();
        for _ in 0..tokens {
            draw(&mut rng, m.n_experts, m.top_k.min(m.n_experts), &mut picks);
            for &e in &picks {
                if run_rows[e] == 0 {
                    runs.push(e);
                }
                run_rows[e] += 1;
            }
            step.extend_from_slice(&picks);
        }
        // each run to a holder as the coordinator assigns them (runs ascending by expert)
        runs.sort_unstable();
        let asked: Vec<(&[usize], usize)> = runs
            .iter()
            .map(|&e| (holders[e].as_slice(), run_rows[e]))
            .collect();
        for (&e, w) in runs.iter().zip(spread(&cost, &asked)) {
            let Some(w) = w else { continue };
            chosen[e] = w;
            rows[w] += run_rows[e];
            distinct[w] += 1;
            let at = holders[e].iter().position(|&x| x == w).expect("a holder");
            on_gpu[w] += (place[e][at] < vram_k[w]) as usize;
        }
        for picks in step.chunks(m.top_k.min(m.n_experts).max(1)) {
            touched.iter_mut().for_each(|t| *t = false);
            for &e in picks {
                if chosen[e] != usize::MAX {
                    touched[chosen[e]] = true;
                }
            }
            for (w, t) in touched.iter().enumerate() {
                toks[w] += *t as usize;
            }
        }
        for &e in &runs {
            run_rows[e] = 0;
            chosen[e] = usize::MAX;
        }
        // each node's parts; the remote ones run in parallel, in-process ones after them
        let mut worst: Option<(f64, [f64; 4], f64, usize)> = None;
        let mut local = [0.0f64; 4];
        let mut local_beyond = 0.0;
        let mut through = 0.0; // bytes over the coordinator's link
        for (w, x) in nodes.iter().enumerate() {
            if distinct[w] == 0 {
                continue;
            }
            let u = distinct[w] as f64;
            let bytes = toks[w] as f64 * m.row_out_bytes + rows[w] as f64 * m.row_back_bytes;
            links[w].experts_per_layer += u;
            vram_reads[w] += on_gpu[w] as f64;
            links[w].bytes_per_token += if x.in_process { 0.0 } else { bytes };
            // the CPU's part (experts from RAM, or read from disk first) and the GPU's, at once
            let cpu = (distinct[w] - on_gpu[w]) as f64;
            let disk = cpu * (1.0 - hit[w]) * (x.disk_s - x.expert_s).max(0.0);
            let gpu = match (&x.gpu, on_gpu[w]) {
                (Some(g), n) if n > 0 => g.submit_s + n as f64 * g.expert_s,
                _ => 0.0,
            };
            let beyond = (gpu - cpu * x.expert_s - disk).max(0.0);
            let compute = cpu * x.expert_s + beyond;
            if x.in_process {
                local[2] += compute;
                local[3] += disk;
                local_beyond += beyond;
                continue;
            }
            let transfer = if x.bytes_s.is_finite() {
                through += bytes;
                bytes / x.bytes_s
            } else {
                0.0
            };
            let latency = match x.latency_samples_s.len() {
                0 => x.latency_s,
                n => x.latency_samples_s[rng.below(n)],
            };
            let parts = [latency, transfer, compute, disk];
            let t: f64 = parts.iter().sum();
            if worst.is_none_or(|(wt, _, _, _)| t > wt) {
                worst = Some((t, parts, beyond, w));
            }
        }
        // the layer's bytes all cross the coordinator's link: the last answer waits for them
        if let Some((t, parts, _, _)) = &mut worst {
            let shared_link = through / setup.coordinator_bytes_s;
            if shared_link > parts[1] {
                *t += shared_link - parts[1];
                parts[1] = shared_link;
            }
        }
        if let Some((t, parts, beyond, w)) = worst {
            for i in 0..4 {
                sum[i] += parts[i];
            }
            sum[4] += setup.shared_s.min(t);
            sum[5] += beyond;
            links[w].critical_share += 1.0;
        }
        for i in 0..4 {
            sum[i] += local[i];
        }
        sum[5] += local_beyond;
    }
    let per = m.moe_layers as f64 / DRAWS as f64 * 1e3;
    b.round_trips_ms = sum[0] * per;
    b.transfer_ms = sum[1] * per;
    b.expert_compute_ms = sum[2] * per;
    b.expert_disk_ms = sum[3] * per;
    b.overlap_ms = sum[4] * per;
    b.expert_vram_ms = sum[5] * per;
    for ((l, x), v) in links.iter_mut().zip(nodes).zip(vram_reads) {
        l.vram_read_share = if l.experts_per_layer > 0.0 {
            v / l.experts_per_layer
        } else {
            0.0
        };
        l.experts_per_layer /= DRAWS as f64;
        l.bytes_per_token *= m.moe_layers as f64 / DRAWS as f64 / tokens as f64;
        l.line_ms_per_token = if x.bytes_s.is_finite() && !x.in_process {
            l.bytes_per_token / x.bytes_s * 1e3
        } else {
            0.0
        };
        l.critical_share /= DRAWS as f64;
    }
    (b, links)
}

impl Budget {
    fn close(mut self) -> Self {
        self.total_ms = self.dense_ms
            + self.drafts_ms
            + self.round_trips_ms
            + self.transfer_ms
            + self.expert_compute_ms
            + self.expert_disk_ms
            - self.overlap_ms;
        self
    }
}

/// Tokens a speculative step keeps on average with `draft` drafts each accepted with
/// probability `a` (independently, the chain stopping at the first rejection).
pub fn tokens_per_step(draft: usize, a: f64) -> f64 {
    (0..=draft).map(|i| a.powi(i as i32)).sum()
}

/// Predicts `m` on `setup`, plain and (with `draft` > 0) speculative at `acceptance`.
pub fn predict(setup: Setup, m: &ModelCost, draft: usize, acceptance: f64) -> Prediction {
    let (lb, links) = layers(&setup, m, 1);
    let token = Budget {
        dense_ms: setup.dense_s * 1e3,
        ..lb
    }
    .close();
    let tok_s = 1e3 / token.total_ms.max(1e-9);
    let speculative = (draft > 0).then(|| {
        let (sb, _) = layers(&setup, m, draft + 1);
        let step = Budget {
            dense_ms: (setup.dense_s + draft as f64 * setup.dense_extra_s) * 1e3,
            drafts_ms: draft as f64 * setup.mtp_s * 1e3,
            ..sb
        }
        .close();
        let tps = tokens_per_step(draft, acceptance);
        Speculative {
            draft,
            acceptance,
            tokens_per_step: tps,
            tok_s: tps * 1e3 / step.total_ms.max(1e-9),
            step,
        }
    });
    let bottleneck = bottleneck(&token, &links, setup.dense_device == "gpu");
    let reads: f64 = links.iter().map(|l| l.experts_per_layer).sum();
    let vram_reads: f64 = links
        .iter()
        .map(|l| l.experts_per_layer * l.vram_read_share)
        .sum();
    Prediction {
        replica_room: replica_room(&setup, m, setup.replicas.max(2)),
        setup,
        token,
        tok_s,
        links,
        vram_read_share: if reads > 0.0 { vram_reads / reads } else { 0.0 },
        bottleneck,
        speculative,
    }
}

/// The largest part of a token's time, named.
fn bottleneck(t: &Budget, links: &[LinkUse], on_gpu: bool) -> String {
    let critical = links
        .iter()
        .max_by(|a, b| a.critical_share.total_cmp(&b.critical_share))
        .map_or("", |l| l.name.as_str());
    let parts = [
        (
            t.dense_ms,
            if on_gpu {
                "the coordinator's dense pass on its GPU (VRAM bandwidth, PCIe round trips)"
                    .to_string()
            } else {
                "the coordinator's dense pass (memory bandwidth)".to_string()
            },
        ),
        (
            t.round_trips_ms,
            "round trips (latency x MoE layers)".to_string(),
        ),
        (t.transfer_ms, format!("link bandwidth ({critical})")),
        (
            t.expert_compute_ms,
            if t.expert_vram_ms > 0.5 * t.expert_compute_ms {
                format!("expert compute on the GPU ({critical})")
            } else {
                format!("expert compute from RAM ({critical})")
            },
        ),
        (
            t.expert_disk_ms,
            format!("experts read from disk ({critical})"),
        ),
    ];
    let (ms, what) = parts
        .into_iter()
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .expect("parts");
    format!(
        "{what}: {:.0}% of the token",
        100.0 * ms / t.total_ms.max(1e-12)
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::cluster::predict) fn model() -> ModelCost {
        ModelCost {
            moe_layers: 10,
            n_experts: 64,
            top_k: 8,
            expert_bytes: 1_000_000,
            experts_total_bytes: 640_000_000,
            coordinator_resident_bytes: GIB as u64,
            dense_read_bytes: 2_000_000_000,
            shared_read_bytes: 30_000_000,
            mtp_read_bytes: 40_000_000,
            row_out_bytes: 4096.0,
            row_back_bytes: 4096.0,
            dense_bytes: 2_000_000_000,
            kv_bytes: 100_000_000,
            embed_bytes: 200_000_000,
            pcie_bytes: 10.0 * 3.0 * 4096.0,
            gpu_round_trips: 11,
            lookahead_round_trips: 12,
        }
    }

    fn node(name: &str, share: f64, latency_s: f64) -> Node {
        Node {
            name: name.into(),
            share,
            ram_bytes: 0,
            expert_s: 1e-4,
            disk_s: 1e-3,
            latency_s,
            latency_samples_s: vec![],
            bytes_s: 1e9,
            in_process: false,
            gpu: None,
        }
    }

    fn setup(nodes: Vec<Node>) -> Setup {
        Setup {
            source: "test".into(),
            dense_device: "cpu".into(),
            dense_s: 0.01,
            dense_extra_s: 0.0,
            shared_s: 0.0,
            mtp_s: 0.001,
            coordinator_bytes_s: f64::INFINITY,
            nodes,
            replicas: 1,
            hot_share: 0.0,
        }
    }

    #[test]
    fn one_worker_is_exact_arithmetic() {
        // every layer: all 8 experts on the one worker
        let p = predict(setup(vec![node("w", 1.0, 5e-4)]), &model(), 0, 0.0);
        let t = &p.token;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9 * b.max(1.0);
        assert!(close(t.dense_ms, 10.0));
        assert!(close(t.round_trips_ms, 10.0 * 0.5));
        assert!(close(t.transfer_ms, 10.0 * (4096.0 * 9.0) / 1e9 * 1e3));
        assert!(close(t.expert_compute_ms, 10.0 * 8.0 * 0.1));
        assert_eq!(t.expert_disk_ms, 0.0);
        assert!(close(t.total_ms, 10.0 + 5.0 + 0.36864 + 8.0));
        assert!(close(p.tok_s, 1e3 / t.total_ms));
        assert!(close(p.links[0].bytes_per_token, 10.0 * 9.0 * 4096.0));
        assert!(
            p.bottleneck.starts_with("the coordinator's dense pass"),
            "{}",
            p.bottleneck
        );
    }

    #[test]
    fn disk_share_and_overlap() {
        let mut m = model();
        m.experts_total_bytes = 1_000_000_000;
        let mut n = node("w", 1.0, 1e-4);
        n.ram_bytes = 250_000_000; // a quarter resident
        let mut s = setup(vec![n]);
        s.shared_s = 5e-5;
        let t = predict(s, &m, 0, 0.0).token;
        // 8 experts, 3/4 of them read at 1 ms (less the 0.1 ms of compute counted apart)
        assert!((t.expert_disk_ms - 10.0 * 8.0 * 0.75 * 0.9).abs() < 1e-9);
        assert!((t.overlap_ms - 10.0 * 0.05).abs() < 1e-9);
    }

    #[test]
    fn two_workers_wait_for_the_slower_and_touch_both() {
        let m = model();
        let p = predict(
            setup(vec![node("a", 0.5, 1e-3), node("b", 0.5, 2e-3)]),
            &m,
            0,
            0.0,
        );
        // b is slower whenever it is touched (almost always with 8 of 64 experts)
        let touched_b = 1.0
            - (32.0 * 31.0 * 30.0 * 29.0 * 28.0 * 27.0 * 26.0 * 25.0)
                / (64.0 * 63.0 * 62.0 * 61.0 * 60.0 * 59.0 * 58.0 * 57.0);
        assert!(
            (p.links[1].critical_share - touched_b).abs() < 0.01,
            "{:?}",
            p.links
        );
        // experts per layer split about evenly and sum to top_k
        let e: f64 = p.links.iter().map(|l| l.experts_per_layer).sum();
        assert!((e - 8.0).abs() < 1e-9);
        assert!((p.links[0].experts_per_layer - 4.0).abs() < 0.15);
        // more workers cut compute per layer, not the latency floor
        let one = predict(setup(vec![node("w", 1.0, 2e-3)]), &m, 0, 0.0);
        assert!(p.token.expert_compute_ms < one.token.expert_compute_ms);
    }

    #[test]
    fn replicas_even_out_the_busiest_node_and_take_its_ram() {
        let m = model();
        let four = || -> Vec<Node> { (0..4).map(|i| node(&format!("w{i}"), 0.25, 1e-4)).collect() };
        let one = predict(setup(four()), &m, 0, 0.0);
        let mut s = setup(four());
        (s.replicas, s.hot_share) = (2, 0.5);
        let two = predict(s.clone(), &m, 0, 0.0);
        // each node holds 8 of the 32 single experts and 16 of the 64 copies of the other 32
        for l in &two.links {
            assert!((l.held_share - 0.375).abs() < 1e-12, "{l:?}");
        }
        let e: f64 = two.links.iter().map(|l| l.experts_per_layer).sum();
        assert!((e - 8.0).abs() < 1e-9);
        // the layer waits for a less busy node
        let (a, b) = (one.token.expert_compute_ms, two.token.expert_compute_ms);
        assert!(b < 0.9 * a, "{b} against {a} ms");
        assert!(two.tok_s > one.tok_s);
        // RAM for the single copies only: some experts now come from disk
        for n in &mut s.nodes {
            n.ram_bytes = m.experts_total_bytes / 4;
        }
        let short = predict(s, &m, 0, 0.0);
        assert_eq!(one.token.expert_disk_ms, 0.0);
        assert!(short.token.expert_disk_ms > 0.0);
        for l in &short.links {
            assert!((l.resident_share - 2.0 / 3.0).abs() < 1e-12, "{l:?}");
        }
        // room for copies of half of the 64: each node's 16 and 8 replicas, 24 in all
        assert_eq!(short.replica_room, 0.0);
        let mut s = setup(four());
        for n in &mut s.nodes {
            n.ram_bytes = m.experts_total_bytes * 3 / 8;
        }
        assert_eq!(replica_room(&s, &m, 2), 0.5);
        let room = predict(s, &m, 0, 0.0).replica_room;
        assert_eq!(room, 0.5);
        // every expert on both of two nodes, one three times as fast: it takes three of every
        // four runs, so that both finish together
        let mut slow = node("slow", 0.5, 1e-4);
        slow.expert_s = 3e-4;
        let mut s = setup(vec![node("fast", 0.5, 1e-4), slow]);
        (s.replicas, s.hot_share) = (2, 1.0);
        let p = predict(s, &m, 0, 0.0);
        assert!(
            (p.links[0].experts_per_layer - 6.0).abs() < 0.01,
            "{:?}",
            p.links
        );
        // RAM not known: taken as holding everything; one node: nothing to replicate on
        assert_eq!(replica_room(&setup(four()), &m, 2), 1.0);
        assert_eq!(replica_room(&setup(vec![node("w", 1.0, 0.0)]), &m, 2), 0.0);
    }

    #[test]
    fn every_workers_bytes_cross_the_coordinators_link() {
        let m = model();
        let two = || vec![node("a", 0.5, 1e-3), node("b", 0.5, 1e-3)];
        let free = predict(setup(two()), &m, 0, 0.0);
        let mut s = setup(two());
        s.coordinator_bytes_s = 1e7; // far slower than the workers' links
        let slow = predict(s, &m, 0, 0.0);
        let bytes: f64 = slow.links.iter().map(|l| l.bytes_per_token).sum();
        assert!((slow.token.transfer_ms - bytes / 1e7 * 1e3).abs() < 1e-6 * slow.token.transfer_ms);
        assert!(slow.token.transfer_ms > 10.0 * free.token.transfer_ms);
    }

    #[test]
    fn speculation_pays_once_per_step() {
        let m = model();
        let p = predict(setup(vec![node("w", 1.0, 1e-3)]), &m, 3, 0.8);
        let sp = p.speculative.unwrap();
        assert!((sp.tokens_per_step - (1.0 + 0.8 + 0.64 + 0.512)).abs() < 1e-12);
        assert!((sp.step.round_trips_ms - p.token.round_trips_ms).abs() < 1e-9);
        assert!((sp.step.drafts_ms - 3.0).abs() < 1e-9);
        assert!(sp.step.expert_compute_ms > p.token.expert_compute_ms);
        assert!(sp.tok_s > p.tok_s, "{} vs {}", sp.tok_s, p.tok_s);
        assert_eq!(tokens_per_step(0, 0.5), 1.0);
    }

    #[test]
    fn vram_first_then_ram_then_disk() {
        // one in-process node holding all of a layer's experts: a quarter in VRAM, a quarter
        // in RAM, half read from disk
        let mut m = model();
        m.experts_total_bytes = 1_000_000_000;
        let mut n = node("w", 1.0, 0.0);
        n.in_process = true;
        n.bytes_s = f64::INFINITY;
        n.ram_bytes = 250_000_000;
        let gpu = |vram_bytes| NodeGpu {
            vram_bytes,
            expert_s: 1e-6,
            submit_s: 1e-5,
        };
        let cpu_only = predict(setup(vec![n.clone()]), &m, 0, 0.0);
        n.gpu = Some(gpu(250_000_000));
        let p = predict(setup(vec![n.clone()]), &m, 0, 0.0);
        let l = &p.links[0];
        assert!((l.vram_share - 0.25).abs() < 1e-12 && (l.resident_share - 0.25).abs() < 1e-12);
        assert_eq!(l.vram_bytes, 250_000_000);
        // 16 of the 64 experts in VRAM: a quarter of the reads, within the draws' noise
        assert!((l.vram_read_share - 0.25).abs() < 0.01, "{l:?}");
        assert!((p.vram_read_share - l.vram_read_share).abs() < 1e-12);
        // the CPU's part: 6 of 8 experts, two thirds of them from disk; the GPU's (2 experts
        // and a submission, 12 us) hides behind it
        let t = &p.token;
        let cpu = 10.0 * 8.0 * 0.75;
        assert!(
            (t.expert_compute_ms - cpu * 0.1).abs() < 0.01 * cpu * 0.1,
            "{t:?}"
        );
        let disk = cpu * (2.0 / 3.0) * 0.9;
        assert!((t.expert_disk_ms - disk).abs() < 0.01 * disk, "{t:?}");
        assert_eq!(t.expert_vram_ms, 0.0);
        assert!(
            p.tok_s > cpu_only.tok_s,
            "{} vs {}",
            p.tok_s,
            cpu_only.tok_s
        );
        // a GPU that holds nothing changes nothing
        n.gpu = Some(gpu(0));
        let none = predict(setup(vec![n.clone()]), &m, 0, 0.0);
        assert_eq!(none.tok_s, cpu_only.tok_s);
        assert_eq!(none.links[0].vram_read_share, 0.0);
        // every expert in VRAM on a slow GPU: the GPU's time is the layer's
        n.gpu = Some(NodeGpu {
            vram_bytes: u64::MAX,
            expert_s: 1e-3,
            submit_s: 1e-4,
        });
        let slow = predict(setup(vec![n]), &m, 0, 0.0);
        let t = &slow.token;
        assert!(
            (t.expert_compute_ms - 10.0 * (0.1 + 8.0)).abs() < 1e-9,
            "{t:?}"
        );
        assert_eq!(t.expert_compute_ms, t.expert_vram_ms);
        assert_eq!(t.expert_disk_ms, 0.0);
        assert!(
            slow.bottleneck.contains("on the GPU"),
            "{}",
            slow.bottleneck
        );
    }
}
