//! `charm doctor`: is this model runnable on this machine? Each check has a stable id, a status
//! and a message; the model is runnable when no check failed (warnings allowed).

use std::path::Path;

use charm_shared::config::ModelSpec;
use charm_shared::container::{Container, MANIFEST};
use charm_worker::history::History;
use charm_worker::io::{random_reads, transparent_huge_pages, Pages, RecordFile};
use serde::Serialize;

use crate::ops::plan::{meminfo, plan_container, PlanInput};

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    Skip,
}

/// One check.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Stable identifier (`model.config`, `model.container`, `model.files`, `model.checksums`,
    /// `ram.budget`, `ram.system`, `fs.o_direct`, `disk.read_speed`, `cpu.isa`, `history`, `gpu`).
    pub id: &'static str,
    pub status: Status,
    pub message: String,
    /// Measured or planned figures, where the check has them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Value>,
}

/// All checks and the verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model: String,
    pub runnable: bool,
    pub checks: Vec<Check>,
}

/// `mem.huge_pages`: record buffers are 2 MiB transparent huge pages when the kernel allows; in
/// 4 KiB pages `O_DIRECT` reads were measured 2.1-2.3x slower on a VM (`charm iobench
/// --small-pages`). `deep` measures both here, reading `refs` (the expert files and lengths).
fn huge_pages_check(
    refs: &[(&RecordFile, u64)],
    block: usize,
    readers: usize,
    deep: bool,
) -> Check {
    let mode = transparent_huge_pages();
    let mut c = match mode.as_deref() {
        None => check(
            "mem.huge_pages",
            Status::Skip,
            "transparent huge page mode unknown (not Linux, or no THP support)",
        ),
        Some("never") => check(
            "mem.huge_pages",
            Status::Warn,
            "transparent huge pages are off: record buffers get 4 KiB pages, into which O_DIRECT \
             reads can run several times slower (`echo madvise | sudo tee \
             /sys/kernel/mm/transparent_hugepage/enabled`)",
        ),
        Some(m) => check(
            "mem.huge_pages",
            Status::Ok,
            format!("transparent huge pages: {m}; record buffers ask for 2 MiB pages"),
        ),
    };
    if deep && !refs.is_empty() && block > 0 {
        let r = [Pages::Huge, Pages::Small]
            .map(|p| random_reads(refs, block, readers, (256 << 20, 2.0), 13, p));
        if let [Ok(h), Ok(s)] = &r {
            c.message += &format!(
                "; reads into huge pages {:.2} GB/s, into 4 KiB pages {:.2} GB/s",
                h.bytes_per_s() / 1e9,
                s.bytes_per_s() / 1e9
            );
            c.data = Some(serde_json::json!({
                "mode": mode,
                "huge_pages_bytes_per_s": h.bytes_per_s(),
                "small_pages_bytes_per_s": s.bytes_per_s(),
            }));
        }
    }
    c
}

/// `gpu`: the adapters for `--vram` (name and driver as they report them, features, the
/// self-check's verdict). None usable is a note, not a failure: the experts run on the CPU.
fn gpu_check() -> Check {
    let adapters = charm_worker::gpu::report();
    let usable: Vec<_> = adapters.iter().filter(|a| a.verdict == "exact").collect();
    let list = adapters
        .iter()
        .map(|a| {
            let free = a.free_bytes.map_or(String::new(), |b| {
                format!(", {:.1} GiB free", b as f64 / (1u64 << 30) as f64)
            });
            format!(
                "{}: {} ({}, {}{free}): {}",
                a.id, a.name, a.backend, a.driver, a.verdict
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let mut c = match (adapters.is_empty(), usable.is_empty()) {
        (true, _) => check(
            "gpu",
            Status::Skip,
            "no GPU adapter (Vulkan or Metal): routed experts run on the CPU",
        ),
        (false, true) => check(
            "gpu",
            Status::Warn,
            format!("no adapter passes the self-check, --vram runs on the CPU: {list}"),
        ),
        (false, false) => check("gpu", Status::Ok, format!("--vram can use {list}")),
    };
    c.data = serde_json::to_value(&adapters).ok();
    c
}

fn check(id: &'static str, status: Status, message: impl Into<String>) -> Check {
    Check {
        id,
        status,
        message: message.into(),
        data: None,
    }
}

/// Runs the checks on `dir` with the planning `input`. `deep` verifies every checksum (reads
/// the whole model).
pub fn doctor(dir: &Path, input: &PlanInput, deep: bool, direct: bool) -> Report {
    let mut checks = Vec::new();
    let report = |mut checks: Vec<Check>| {
        checks.push(gpu_check());
        Report {
            model: dir.display().to_string(),
            runnable: !checks.iter().any(|c: &Check| c.status == Status::Fail),
            checks,
        }
    };
    let spec = match ModelSpec::from_dir(dir) {
        Ok(s) => {
            checks.push(check(
                "model.config",
                Status::Ok,
                format!(
                    "{}: {} layers, hidden {}",
                    s.arch.model_type(),
                    s.layers.len(),
                    s.hidden_size
                ),
            ));
            s
        }
        Err(e) => {
            checks.push(check("model.config", Status::Fail, e.to_string()));
            return report(checks);
        }
    };
    if !Container::is_container(dir) {
        // A Hugging Face (or colibrì) directory runs too, with every weight in RAM as f32.
        let ck = charm_shared::checkpoint::Checkpoint::open(dir);
        match ck {
            Ok(ck) => {
                checks.push(check(
                    "model.container",
                    Status::Warn,
                    format!("no {MANIFEST}: a checkpoint directory runs with every weight in RAM as f32, nothing streamed; `charm convert --model {} --out DIR` makes a container that streams experts from disk", dir.display()),
                ));
                let params: u64 = ck
                    .names()
                    .filter_map(|n| ck.info(n))
                    .map(|(t, _)| t.shape.iter().map(|&d| d as u64).product::<u64>())
                    .sum();
                let need = 4 * params;
                let budget = input.ram.or_else(|| meminfo().map(|m| m.available));
                checks.push(match budget {
                    Some(b) if need > b => check(
                        "ram.budget",
                        Status::Fail,
                        format!(
                            "its weights need {} as f32, more than the {} available; convert it to a container",
                            crate::ops::plan::human(need),
                            crate::ops::plan::human(b)
                        ),
                    ),
                    Some(b) => check(
                        "ram.budget",
                        Status::Ok,
                        format!(
                            "its weights need {} as f32 of {} available",
                            crate::ops::plan::human(need),
                            crate::ops::plan::human(b)
                        ),
                    ),
                    None => check("ram.budget", Status::Skip, "available memory unknown"),
                });
            }
            Err(e) => checks.push(check(
                "model.container",
                Status::Fail,
                format!("neither a charm container ({MANIFEST}) nor a loadable checkpoint: {e}"),
            )),
        }
        return report(checks);
    }
    let c = match Container::open(dir) {
        Ok(c) => {
            checks.push(check(
                "model.container",
                Status::Ok,
                format!(
                    "charm container v{}, experts {}, dense {}",
                    c.manifest.version,
                    c.manifest.policy.experts.name(),
                    c.manifest.policy.dense.name()
                ),
            ));
            c
        }
        Err(e) => {
            checks.push(check("model.container", Status::Fail, e.to_string()));
            return report(checks);
        }
    };
    // files and headers: every dense tensor decodes its header fields, every expert file is as
    // long as its records (checked at open), and the layers the config names have experts
    let moe: Vec<usize> = spec
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.mlp == charm_shared::config::MlpKind::Moe)
        .map(|(i, _)| i)
        .collect();
    let missing: Vec<usize> = moe
        .iter()
        .copied()
        .filter(|l| c.expert_layer(*l).is_none())
        .collect();
    if missing.is_empty() {
        checks.push(check(
            "model.files",
            Status::Ok,
            format!(
                "dense.bin {} bytes, {} expert files",
                c.dense_bytes(),
                c.expert_layers().count()
            ),
        ));
    } else {
        checks.push(check(
            "model.files",
            Status::Fail,
            format!("no experts for MoE layers {missing:?}"),
        ));
    }
    if deep {
        let t0 = std::time::Instant::now();
        let mut bad = Vec::new();
        let mut bytes = 0u64;
        for name in c.manifest.tensors.keys() {
            let shape = c.manifest.tensors[name].part.shape.clone();
            if let Err(e) = c.linear(name, &shape) {
                bad.push(e.to_string());
            }
        }
        for l in c.expert_layers() {
            for e in 0..l.count {
                bytes += l.payload_bytes;
                if let Err(err) = c.expert(l.layer, e) {
                    bad.push(err.to_string());
                }
            }
        }
        bytes += c.dense_bytes();
        checks.push(if bad.is_empty() {
            check(
                "model.checksums",
                Status::Ok,
                format!(
                    "every tensor and expert record matches its CRC-32 ({:.2} GB in {:.1}s)",
                    bytes as f64 / 1e9,
                    t0.elapsed().as_secs_f64()
                ),
            )
        } else {
            check(
                "model.checksums",
                Status::Fail,
                format!(
                    "{} damaged: {}",
                    bad.len(),
                    bad[..bad.len().min(3)].join("; ")
                ),
            )
        });
    } else {
        checks.push(check(
            "model.checksums",
            Status::Skip,
            "not verified (run with --deep to read every byte)",
        ));
    }
    // RAM
    match plan_container(dir, &spec, &c, input) {
        Ok(p) => {
            let mut ch = if !p.fits {
                check("ram.budget", Status::Fail, p.refusal())
            } else if !p.all_resident && p.cache_experts_per_layer < 2.0 * p.top_k as f64 {
                check(
                    "ram.budget",
                    Status::Warn,
                    format!(
                        "runs, but the expert cache holds {:.1} experts per layer (fewer than two tokens' worth): most experts come from disk",
                        p.cache_experts_per_layer
                    ),
                )
            } else {
                check(
                    "ram.budget",
                    Status::Ok,
                    format!(
                        "{:.2} GiB budget ({}): {:.1} experts cached per layer{}",
                        p.budget_bytes as f64 / (1u64 << 30) as f64,
                        p.budget_source,
                        p.cache_experts_per_layer,
                        if p.all_resident {
                            ", every expert resident"
                        } else {
                            ""
                        }
                    ),
                )
            };
            ch.data = serde_json::to_value(&p).ok();
            checks.push(ch);
        }
        Err(e) => checks.push(check("ram.budget", Status::Fail, e.to_string())),
    }
    // filesystem and disk
    let files: Vec<(RecordFile, u64)> = c
        .expert_layers()
        .filter_map(|l| {
            let f = RecordFile::open(&dir.join(&l.file), direct).ok()?;
            Some((f, l.record_bytes * l.count as u64))
        })
        .collect();
    match files.first() {
        None => checks.push(check("fs.o_direct", Status::Skip, "no expert files")),
        Some((f, _)) if f.direct => checks.push(check(
            "fs.o_direct",
            Status::Ok,
            "expert files open with O_DIRECT (reads bypass the page cache)",
        )),
        Some((f, _)) => checks.push(check(
            "fs.o_direct",
            Status::Warn,
            format!(
                "buffered reads: {}; the page cache then competes with the expert cache for RAM",
                f.fallback_reason.clone().unwrap_or_default()
            ),
        )),
    }
    let block = c
        .expert_layers()
        .map(|l| l.payload_bytes as usize)
        .max()
        .unwrap_or(0);
    let refs: Vec<(&RecordFile, u64)> = files.iter().map(|(f, n)| (f, *n)).collect();
    if !refs.is_empty() && block > 0 {
        let secs = if deep { 5.0 } else { 1.0 };
        match random_reads(
            &refs,
            block,
            input.readers,
            (512 << 20, secs),
            7,
            Pages::Huge,
        ) {
            Ok(r) => {
                let gbs = r.bytes_per_s() / 1e9;
                let mut ch = check(
                    "disk.read_speed",
                    if gbs < 0.2 { Status::Warn } else { Status::Ok },
                    format!(
                        "{:.2} GB/s reading random expert records ({} reads of {}, {} threads, {})",
                        gbs,
                        r.reads,
                        crate::ops::plan::human(block as u64),
                        r.threads,
                        if r.direct {
                            "O_DIRECT"
                        } else {
                            "buffered: may be served from the page cache"
                        }
                    ),
                );
                ch.data = serde_json::to_value(r).ok();
                checks.push(ch);
            }
            Err(e) => checks.push(check("disk.read_speed", Status::Fail, e.to_string())),
        }
    }
    checks.push(huge_pages_check(&refs, block, input.readers, deep));
    checks.push(check(
        "cpu.isa",
        Status::Ok,
        format!("kernels: {:?}", charm_shared::quant::active_isa()),
    ));
    if let Some(p) = &input.history {
        checks.push(match History::load_for(p, &c) {
            Ok(Some(h)) => check(
                "history",
                Status::Ok,
                format!("{}: {} steps of routing history", p.display(), h.steps),
            ),
            Ok(None) => check(
                "history",
                Status::Ok,
                format!("{}: none yet (written after the first run)", p.display()),
            ),
            Err(e) => check("history", Status::Fail, e.to_string()),
        });
    }
    if let Some(m) = meminfo() {
        checks.push(Check {
            id: "ram.system",
            status: Status::Ok,
            message: format!(
                "{:.2} GiB available of {:.2} GiB",
                m.available as f64 / (1u64 << 30) as f64,
                m.total as f64 / (1u64 << 30) as f64
            ),
            data: serde_json::to_value(m).ok(),
        });
    }
    report(checks)
}

impl Report {
    pub fn render(&self) -> String {
        let mut s = String::new();
        for c in &self.checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
            };
            s += &format!("[{tag}] {:<16} {}\n", c.id, c.message);
        }
        s += if self.runnable {
            "runnable\n"
        } else {
            "not runnable\n"
        };
        s
    }
}
