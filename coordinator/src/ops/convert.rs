//! `charm convert`: a Hugging Face checkpoint (bf16 / f16 / f32 / FP8) into a charm container
//! (see [`charm_shared::container`] and `docs/container.md`).
//!
//! Memory stays bounded: tensors are read from the memory-mapped shards a block of rows (or one
//! expert) at a time and written with positioned writes. The work is split into units (one file
//! per expert layer, then `dense.bin`); each unit is written to `NAME.partial`, synced, its
//! checksums saved beside it, then renamed into place. A rerun after a crash (even `kill -9`)
//! keeps finished units and redoes the rest; the output is byte-identical to an uninterrupted run
//! because every byte is a deterministic function of the input and the policy.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use charm_shared::arch::names::{self, Kind};
use charm_shared::checkpoint::Checkpoint;
use charm_shared::config::{MlpKind, ModelSpec};
use charm_shared::container::{
    effective_group, encode, DenseTensor, ExpertLayer, Manifest, Part, Policy, Regions,
    StoreFormat, FORMAT, MANIFEST, PART_ALIGN, RECORD_ALIGN, VERSION,
};
use charm_shared::kernels::Matrix;
use charm_shared::quant::QMatrix;
use charm_shared::LoadError;

use crate::model::read_expert;

/// Conversion failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Plan(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What a tensor is, which decides its storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Norms, router weights and bias, indexer head weights, biases: always f32.
    KeepF32,
    Dense,
    /// Embedding tables and output heads.
    Embedding,
    Mtp,
}

pub(crate) fn role(name: &str, n_layers: usize) -> Role {
    let c = names::classify(name, n_layers);
    match c.kind {
        Kind::Exact => Role::KeepF32,
        Kind::Embedding | Kind::Head => Role::Embedding,
        _ if c.mtp => Role::Mtp,
        _ => Role::Dense,
    }
}

/// Lays parts out one after another, each aligned.
pub(crate) struct Cursor(pub(crate) u64);

impl Cursor {
    pub(crate) fn take(&mut self, len: u64) -> [u64; 2] {
        let o = self.0.div_ceil(PART_ALIGN as u64) * PART_ALIGN as u64;
        self.0 = o + len;
        [o, len]
    }
    pub(crate) fn part(&mut self, format: StoreFormat, shape: Vec<usize>, group: usize) -> Part {
        let (d, s, m) =
            Part::sizes(format, &shape, group).expect("checkpoint shapes were validated at open");
        let grouped = !matches!(format, StoreFormat::F32 | StoreFormat::Bf16);
        Part {
            format,
            group: grouped.then_some(group),
            data: self.take(d),
            scales: grouped.then(|| self.take(s)),
            mins: (format == StoreFormat::Int2).then(|| self.take(m)),
            shape,
        }
    }
}

/// Format and group for a `[rows, cols]` weight asked to be `want`: grouped formats fall back to
/// bf16 (never lower precision) when no group tiles the row.
pub(crate) fn choose(want: StoreFormat, cols: usize, group: usize) -> (StoreFormat, usize) {
    if !cols.is_multiple_of(8) {
        return (StoreFormat::F32, cols); // widths the kernels cannot walk 8 at a time stay exact
    }
    match want {
        StoreFormat::F32 | StoreFormat::Bf16 => (want, cols),
        _ => match effective_group(cols, group) {
            Some(g) => (want, g),
            None => (StoreFormat::Bf16, cols),
        },
    }
}

/// A container's full layout, decided from the checkpoint's headers before any byte is written
/// (what `charm plan` reports for a checkpoint directory).
#[derive(Debug, Clone)]
pub struct ContainerLayout {
    /// Dense tensors and where each lies in the dense file.
    pub dense: Vec<(String, Part)>,
    /// Length of the dense file.
    pub dense_bytes: u64,
    /// Routed-expert layers (their checksums are known only once written).
    pub experts: Vec<ExpertLayer>,
}

/// Refuses storage formats and group sizes `convert` cannot write.
pub fn check_policy(policy: &Policy) -> Result<(), ConvertError> {
    if policy.experts == StoreFormat::F32
        || policy.dense == StoreFormat::F32
        || policy.embedding == StoreFormat::F32
        || policy.mtp == StoreFormat::F32
    {
        return Err(ConvertError::Plan(
            "f32 storage is only used for norms and routers; pick bf16 or a quantized format"
                .into(),
        ));
    }
    if policy.group == 0 || !policy.group.is_multiple_of(8) {
        return Err(ConvertError::Plan(format!(
            "--group {}: must be a positive multiple of 8",
            policy.group
        )));
    }
    Ok(())
}

/// The layout `convert` would give `ck` (a checkpoint of `spec`) under `policy`; reads only the
/// checkpoint's headers.
pub fn layout(
    spec: &ModelSpec,
    ck: &Checkpoint,
    policy: &Policy,
) -> Result<ContainerLayout, ConvertError> {
    check_policy(policy)?;
    let n = spec.layers.len();
    let mut tensors = Vec::new();
    for name in ck.names() {
        if names::classify(name, n).kind == Kind::Routed || name.ends_with("_scale_inv") {
            continue;
        }
        let (info, _) = ck.info(name).expect("listed");
        if !info.dtype.is_float() {
            return Err(ConvertError::Plan(format!(
                "tensor `{name}` has non-float dtype {}",
                info.dtype.name()
            )));
        }
        tensors.push((name.to_string(), info.shape.clone()));
    }
    let has = |t: &str| ck.has(t);
    let mtp = names::has_mtp(spec, has) && names::Layer::new(n).expert_layout(has).is_some();
    layout_of(spec, tensors, mtp, policy)
}

/// The layout a checkpoint of `spec` would get under `policy`, from `config.json` alone: the
/// tensors the architecture names (an MTP layer's where the config announces one, with its own
/// copies of the embedding and head, as DeepSeek-V3 and GLM checkpoints ship it).
pub fn layout_from_spec(
    spec: &ModelSpec,
    policy: &Policy,
) -> Result<ContainerLayout, ConvertError> {
    check_policy(policy)?;
    let n = spec.layers.len();
    let mut tensors = names::dense_tensors(spec);
    let mtp = spec.mtp_layers > 0 && spec.router.is_some();
    if mtp {
        let m = names::Layer::new(n);
        let h = spec.hidden_size;
        tensors.extend(names::layer_tensors(
            spec,
            n,
            MlpKind::Moe,
            spec.dsa.is_some(),
        ));
        tensors.extend([
            (m.mtp_enorm(), vec![h]),
            (m.mtp_hnorm(), vec![h]),
            (m.mtp_eh_proj(), vec![h, 2 * h]),
            (m.mtp_head_norm(), vec![h]),
            (m.mtp_embed(), vec![spec.vocab_size, h]),
            (m.mtp_head(), vec![spec.vocab_size, h]),
        ]);
    }
    layout_of(spec, tensors, mtp, policy)
}

/// The layout of `tensors` (non-routed, with their shapes) and the routed experts of `spec`'s
/// MoE layers (and of the MTP layer when `mtp`) under `policy`.
fn layout_of(
    spec: &ModelSpec,
    tensors: Vec<(String, Vec<usize>)>,
    mtp: bool,
    policy: &Policy,
) -> Result<ContainerLayout, ConvertError> {
    let n = spec.layers.len();
    let mut c = Cursor(0);
    let mut dense = Vec::new();
    for (name, shape) in tensors {
        let name = name.as_str();
        let r = role(name, n);
        let part = match (shape.len(), r) {
            (1, _) | (_, Role::KeepF32) => c.part(StoreFormat::F32, shape, 0),
            (2, _) => {
                let want = match r {
                    Role::Dense => policy.dense,
                    Role::Embedding => policy.embedding,
                    Role::Mtp => policy.mtp,
                    Role::KeepF32 => unreachable!(),
                };
                // Embedding tables are per-row so one row decodes alone.
                let g = if r == Role::Embedding && want != StoreFormat::Int2 {
                    shape[1]
                } else {
                    policy.group
                };
                let (f, g) = choose(want, shape[1], g);
                c.part(f, shape, g)
            }
            _ => {
                return Err(ConvertError::Plan(format!(
                    "tensor `{name}` has unsupported rank {}",
                    shape.len()
                )))
            }
        };
        dense.push((name.to_string(), part));
    }
    let mut experts = Vec::new();
    let (h, i) = (spec.hidden_size, spec.moe_intermediate_size);
    let mut moe: Vec<(usize, StoreFormat)> = spec
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| l.mlp == MlpKind::Moe)
        .map(|(k, _)| (k, policy.experts))
        .collect();
    if mtp {
        moe.push((n, policy.mtp));
    }
    for (layer, want) in moe {
        let r = spec.router.as_ref().expect("MoE model has a router");
        let mut rc = Cursor(0);
        let (gf, gg) = choose(want, h, policy.group);
        let (df, dg) = choose(want, i, policy.group);
        let gate = rc.part(gf, vec![i, h], gg);
        let up = rc.part(gf, vec![i, h], gg);
        let down = rc.part(df, vec![h, i], dg);
        let payload = rc.0;
        experts.push(ExpertLayer {
            layer,
            file: format!("experts-{layer:03}.bin"),
            count: r.n_experts,
            record_bytes: payload.div_ceil(RECORD_ALIGN as u64) * RECORD_ALIGN as u64,
            gate,
            up,
            down,
            crc32: Vec::new(),
            payload_bytes: payload,
        });
    }
    Ok(ContainerLayout {
        dense,
        dense_bytes: c.0,
        experts,
    })
}

/// Counts bytes written and (for crash tests) dies on purpose after a budget.
struct Writer<'a> {
    done: u64,
    total: u64,
    abort_after: Option<u64>,
    progress: &'a mut dyn FnMut(u64, u64, &str),
}

impl Writer<'_> {
    fn write(
        &mut self,
        f: &File,
        path: &Path,
        off: u64,
        bytes: &[u8],
        what: &str,
    ) -> Result<(), ConvertError> {
        if let Some(limit) = self.abort_after {
            if self.done + bytes.len() as u64 > limit {
                // Simulated crash: write part of the bytes, then die without cleanup.
                let k = (limit - self.done.min(limit)) as usize;
                let _ = f.write_all_at(&bytes[..k.min(bytes.len())], off);
                std::process::abort();
            }
        }
        f.write_all_at(bytes, off).map_err(io(path))?;
        self.done += bytes.len() as u64;
        (self.progress)(self.done, self.total, what);
        Ok(())
    }
}

fn quantize(m: &Matrix, part: &Part) -> Result<Regions, ConvertError> {
    match part.format.quant() {
        None => Ok((
            m.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Vec::new(),
            Vec::new(),
        )),
        Some(k) => {
            let q = QMatrix::quantize(m, k, part.group.unwrap_or(m.cols))
                .map_err(|e| ConvertError::Plan(e.to_string()))?;
            Ok(encode(&q))
        }
    }
}

/// A unit finished: its checksums, saved beside it so a rerun need not reread it.
fn finish_unit(
    tmp: &Path,
    dst: &Path,
    file: File,
    sums: &serde_json::Value,
) -> Result<(), ConvertError> {
    file.sync_all().map_err(io(tmp))?;
    let side = sidecar(dst);
    let st = side.with_extension("partial");
    std::fs::write(&st, sums.to_string()).map_err(io(&st))?;
    File::open(&st)
        .and_then(|f| f.sync_all())
        .map_err(io(&st))?;
    std::fs::rename(&st, &side).map_err(io(&side))?;
    std::fs::rename(tmp, dst).map_err(io(dst))?;
    Ok(())
}

fn sidecar(dst: &Path) -> PathBuf {
    let mut s = dst.as_os_str().to_owned();
    s.push(".crc.json");
    PathBuf::from(s)
}

/// Reads the checksums of a finished unit, or `None` if it must be (re)made.
fn finished(dst: &Path, size: u64) -> Option<serde_json::Value> {
    let len = std::fs::metadata(dst).ok()?.len();
    if len != size {
        return None;
    }
    serde_json::from_str(&std::fs::read_to_string(sidecar(dst)).ok()?).ok()
}

/// Rows per block when streaming a dense tensor (about 32 Mi floats).
fn block_rows(cols: usize) -> usize {
    ((32usize << 20) / cols.max(1)).max(1)
}

/// What a conversion did.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub bytes_written: u64,
    pub units_reused: usize,
    pub units_written: usize,
    pub output_bytes: u64,
}

/// Converts `src` into a container at `out`. `progress(done, total, what)` is called as bytes are
/// written. `abort_after` (tests only) kills the process mid-write once that many bytes are out.
pub fn convert(
    src: &Path,
    out: &Path,
    policy: &Policy,
    abort_after: Option<u64>,
    progress: &mut dyn FnMut(u64, u64, &str),
) -> Result<ConvertReport, ConvertError> {
    check_policy(policy)?;
    let spec = ModelSpec::from_dir(src)?;
    let ck = Checkpoint::open(src)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    // A directory holding another conversion (other settings or another model) is never mixed in.
    let intent =
        serde_json::json!({"model_type": spec.arch.model_type(), "policy": policy}).to_string();
    let ip = out.join("charm.convert.json");
    let done_policy = std::fs::read_to_string(out.join(MANIFEST))
        .ok()
        .and_then(|t| serde_json::from_str::<Manifest>(&t).ok())
        .map(|m| serde_json::json!({"model_type": m.model_type, "policy": m.policy}).to_string());
    match (std::fs::read_to_string(&ip).ok().or(done_policy), std::fs::read_dir(out).map_err(io(out))?.next().is_some()) {
        (Some(prev), _) if prev != intent => {
            return Err(ConvertError::Plan(format!(
                "{} holds a conversion made with other settings ({prev}); remove it or choose another --out",
                out.display()
            )))
        }
        (None, true) => {
            return Err(ConvertError::Plan(format!("{} is not empty and holds no charm conversion; choose another --out", out.display())))
        }
        _ => std::fs::write(&ip, &intent).map_err(io(&ip))?,
    }
    let mut p = layout(&spec, &ck, policy)?;
    let (h, inter) = (spec.hidden_size, spec.moe_intermediate_size);
    let total = p.dense_bytes
        + p.experts
            .iter()
            .map(|e| e.record_bytes * e.count as u64)
            .sum::<u64>();
    let mut w = Writer {
        done: 0,
        total,
        abort_after,
        progress,
    };
    let (mut reused, mut written) = (0, 0);

    for l in &mut p.experts {
        let dst = out.join(&l.file);
        let size = l.record_bytes * l.count as u64;
        if let Some(v) = finished(&dst, size) {
            l.crc32 = serde_json::from_value(v)
                .map_err(|e| ConvertError::Plan(format!("{}: {e}", sidecar(&dst).display())))?;
            w.done += size;
            reused += 1;
            continue;
        }
        let tmp = dst.with_extension("bin.partial");
        let f = File::create(&tmp).map_err(io(&tmp))?;
        f.set_len(size).map_err(io(&tmp))?;
        let layer = names::Layer::new(l.layer);
        l.crc32.clear();
        for e in 0..l.count {
            let (g, u, d) = read_expert(&ck, &layer, e, l.count, h, inter)?;
            let mut rec = vec![0u8; l.record_bytes as usize];
            for (part, m) in [
                (&l.gate, Matrix::new(inter, h, g)),
                (&l.up, Matrix::new(inter, h, u)),
                (&l.down, Matrix::new(h, inter, d)),
            ] {
                let (dd, ss, mm) = quantize(&m, part)?;
                for (r, b) in [(Some(part.data), dd), (part.scales, ss), (part.mins, mm)] {
                    if let Some(r) = r {
                        rec[r[0] as usize..(r[0] + r[1]) as usize].copy_from_slice(&b);
                    }
                }
            }
            l.crc32
                .push(crc32fast::hash(&rec[..l.payload_bytes as usize]));
            w.write(&f, &tmp, e as u64 * l.record_bytes, &rec, &l.file)?;
        }
        finish_unit(
            &tmp,
            &dst,
            f,
            &serde_json::to_value(&l.crc32).expect("crc list"),
        )?;
        written += 1;
    }

    let dense_file = "dense.bin";
    let dst = out.join(dense_file);
    let mut tensors = BTreeMap::new();
    if let Some(v) = finished(&dst, p.dense_bytes) {
        let sums: BTreeMap<String, u32> = serde_json::from_value(v)
            .map_err(|e| ConvertError::Plan(format!("{}: {e}", sidecar(&dst).display())))?;
        for (name, part) in &p.dense {
            let crc = *sums.get(name).ok_or_else(|| {
                ConvertError::Plan(format!(
                    "{}: no checksum for `{name}`",
                    sidecar(&dst).display()
                ))
            })?;
            tensors.insert(
                name.clone(),
                DenseTensor {
                    part: part.clone(),
                    crc32: crc,
                },
            );
        }
        w.done += p.dense_bytes;
        reused += 1;
    } else {
        let tmp = dst.with_extension("bin.partial");
        let f = File::create(&tmp).map_err(io(&tmp))?;
        f.set_len(p.dense_bytes).map_err(io(&tmp))?;
        let mut sums = BTreeMap::new();
        for (name, part) in &p.dense {
            let (info, _) = ck.info(name).expect("planned from the checkpoint");
            let shape = info.shape.clone();
            let (rows, cols) = if shape.len() == 2 {
                (shape[0], shape[1])
            } else {
                (1, shape[0])
            };
            let mut hs = [
                crc32fast::Hasher::new(),
                crc32fast::Hasher::new(),
                crc32fast::Hasher::new(),
            ];
            let step = block_rows(cols);
            let (mut doff, mut soff, mut moff) = (0u64, 0u64, 0u64);
            let mut r0 = 0;
            while r0 < rows {
                let nr = step.min(rows - r0);
                let v = if shape.len() == 2 {
                    ck.f32_rows(name, &shape, r0, nr)?
                } else {
                    ck.f32(name, &shape)?
                };
                let (dd, ss, mm) = quantize(&Matrix::new(nr, cols, v), part)?;
                for (k, (r, b, off)) in [
                    (Some(part.data), dd, &mut doff),
                    (part.scales, ss, &mut soff),
                    (part.mins, mm, &mut moff),
                ]
                .into_iter()
                .enumerate()
                {
                    if let Some(r) = r {
                        hs[k].update(&b);
                        w.write(&f, &tmp, r[0] + *off, &b, name)?;
                        *off += b.len() as u64;
                    }
                }
                r0 += nr;
            }
            let [mut a, b, c] = hs;
            a.combine(&b);
            a.combine(&c);
            let crc = a.finalize();
            sums.insert(name.clone(), crc);
            tensors.insert(
                name.clone(),
                DenseTensor {
                    part: part.clone(),
                    crc32: crc,
                },
            );
        }
        finish_unit(
            &tmp,
            &dst,
            f,
            &serde_json::to_value(&sums).expect("crc map"),
        )?;
        written += 1;
    }

    for extra in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        let s = src.join(extra);
        if s.is_file() {
            let d = out.join(extra);
            let t = out.join(format!("{extra}.partial"));
            std::fs::copy(&s, &t).map_err(io(&t))?;
            std::fs::rename(&t, &d).map_err(io(&d))?;
        }
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        model_type: spec.arch.model_type().into(),
        policy: policy.clone(),
        dense_file: dense_file.into(),
        tensors,
        experts: p.experts,
    };
    let mp = out.join(MANIFEST);
    let tmp = out.join("charm.json.partial");
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(
        serde_json::to_string_pretty(&manifest)
            .expect("manifest")
            .as_bytes(),
    )
    .map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, &mp).map_err(io(&mp))?;
    for l in &manifest.experts {
        let _ = std::fs::remove_file(sidecar(&out.join(&l.file)));
    }
    let _ = std::fs::remove_file(sidecar(&out.join(dense_file)));
    let _ = std::fs::remove_file(&ip);
    Ok(ConvertReport {
        bytes_written: w.done,
        units_reused: reused,
        units_written: written,
        output_bytes: total,
    })
}
