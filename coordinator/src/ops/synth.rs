//! Deterministic synthetic charm containers with GLM-5.2's real layer shapes, for measuring the
//! streaming store on models larger than RAM without downloading one. Weights are random (the
//! output is not language) but every byte path is the real one: quantized records, checksums,
//! the dense skeleton, routers whose correction bias skews expert popularity like real traffic.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use charm_shared::arch::names;
use charm_shared::config::ModelSpec;
use charm_shared::container::{
    DenseTensor, ExpertLayer, Manifest, Part, Policy, StoreFormat, FORMAT, MANIFEST, RECORD_ALIGN,
    VERSION,
};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::ops::convert::{choose, role, Cursor, Role};

/// GLM-5.2's config (the real one, without weights).
const GLM52_CONFIG: &str = include_str!("../../../tests/data/glm-5.2-config.json");

/// What to synthesize.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// `"glm-5.2"` (real shapes) or `"tiny"` (test-sized, same structure).
    pub preset: String,
    /// MoE decoder layers.
    pub moe_layers: usize,
    /// Dense decoder layers before them.
    pub dense_layers: usize,
    /// Vocabulary size (`None`: the preset's).
    pub vocab: Option<usize>,
    /// Zipf exponent of expert popularity (0: uniform).
    pub skew: f64,
    pub experts: StoreFormat,
    pub seed: u64,
    /// Overrides of the preset: hidden size, routed-expert width, experts per layer, experts
    /// per token.
    pub hidden: Option<usize>,
    pub moe_intermediate: Option<usize>,
    pub n_experts: Option<usize>,
    pub top_k: Option<usize>,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            preset: "glm-5.2".into(),
            moe_layers: 4,
            dense_layers: 1,
            vocab: None,
            skew: 1.0,
            experts: StoreFormat::Int4,
            seed: 1,
            hidden: None,
            moe_intermediate: None,
            n_experts: None,
            top_k: None,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub dense_bytes: u64,
    pub expert_bytes: u64,
    pub record_bytes: u64,
    pub experts: usize,
}

fn splitmix(mut s: u64) -> impl FnMut() -> u64 {
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn seed_of(parts: &[u64]) -> u64 {
    parts.iter().fold(0xC0FF_EE00_D15E_A5E5u64, |a, &p| {
        splitmix(a ^ p.wrapping_mul(0x9E37_79B9_7F4A_7C15))()
    })
}

/// Uniform f32 in [-a, a).
fn uniform(seed: u64, n: usize, a: f32) -> Vec<f32> {
    let mut r = splitmix(seed);
    (0..n)
        .map(|_| ((r() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a)
        .collect()
}

/// The config of the synthetic model.
pub fn config(o: &SynthOptions) -> Result<Value, String> {
    let mut c: Value = serde_json::from_str(GLM52_CONFIG).expect("bundled config parses");
    match o.preset.as_str() {
        "glm-5.2" => {}
        "tiny" => {
            for (k, v) in [
                ("vocab_size", 512),
                ("hidden_size", 128),
                ("intermediate_size", 256),
                ("moe_intermediate_size", 64),
                ("num_attention_heads", 4),
                ("num_key_value_heads", 4),
                ("q_lora_rank", 64),
                ("kv_lora_rank", 32),
                ("qk_nope_head_dim", 16),
                ("qk_rope_head_dim", 16),
                ("qk_head_dim", 32),
                ("v_head_dim", 16),
                ("n_routed_experts", 32),
                ("num_experts_per_tok", 4),
                ("index_n_heads", 2),
                ("index_head_dim", 32),
            ] {
                c[k] = json!(v);
            }
            c["eos_token_id"] = json!([1]);
            c["pad_token_id"] = json!(0);
        }
        "yardstick" => {
            // the shapes of ../shared/bench/make_bench_model.py (with --layers 6 --dense-layers 2)
            for (k, v) in [
                ("vocab_size", 8192),
                ("hidden_size", 1024),
                ("intermediate_size", 4096),
                ("moe_intermediate_size", 512),
                ("num_attention_heads", 16),
                ("num_key_value_heads", 16),
                ("q_lora_rank", 256),
                ("kv_lora_rank", 128),
                ("qk_nope_head_dim", 64),
                ("qk_rope_head_dim", 32),
                ("qk_head_dim", 96),
                ("v_head_dim", 64),
                ("n_routed_experts", 64),
                ("num_experts_per_tok", 8),
                ("index_n_heads", 8),
                ("index_head_dim", 64),
                ("index_topk", 2048),
                ("max_position_embeddings", 4096),
            ] {
                c[k] = json!(v);
            }
            c["eos_token_id"] = json!([1]);
            c["pad_token_id"] = json!(0);
        }
        p => return Err(format!("unknown preset `{p}` (glm-5.2, yardstick or tiny)")),
    }
    if let Some(v) = o.vocab {
        c["vocab_size"] = json!(v);
        c["eos_token_id"] = json!([v.saturating_sub(1)]);
        c["pad_token_id"] = json!(0);
    }
    for (k, v) in [
        ("hidden_size", o.hidden),
        ("moe_intermediate_size", o.moe_intermediate),
        ("n_routed_experts", o.n_experts),
        ("num_experts_per_tok", o.top_k),
    ] {
        if let Some(v) = v {
            if v == 0 || v > 1 << 20 {
                return Err(format!("{k} = {v} is out of range"));
            }
            c[k] = json!(v);
        }
    }
    if o.moe_layers == 0 {
        return Err("--layers must be at least 1".into());
    }
    let n = o.dense_layers + o.moe_layers;
    c["num_hidden_layers"] = json!(n);
    c["first_k_dense_replace"] = json!(o.dense_layers);
    c["mlp_layer_types"] = json!((0..n)
        .map(|i| if i < o.dense_layers {
            "dense"
        } else {
            "sparse"
        })
        .collect::<Vec<_>>());
    // the real indexer pattern: full every 4th layer after the first 3 (the yardstick's:
    // every other layer)
    let yardstick = o.preset == "yardstick";
    c["indexer_types"] = json!((0..n)
        .map(
            |i| if (yardstick && i % 2 == 0) || (!yardstick && (i < 3 || (i - 3) % 4 == 3)) {
                "full"
            } else {
                "shared"
            }
        )
        .collect::<Vec<_>>());
    c["num_nextn_predict_layers"] = json!(0);
    Ok(c)
}

/// Random bytes of a part's regions: weights uniform over the format's codes, scales giving
/// each weight a standard deviation near `1/sqrt(cols)` (`std` for embeddings).
fn fill(part: &Part, seed: u64, std: f32, out: &mut [u8], base: u64) {
    let mut r = splitmix(seed);
    let d = &mut out[(part.data[0] - base) as usize..(part.data[0] - base + part.data[1]) as usize];
    for c in d.chunks_mut(8) {
        let x = r().to_le_bytes();
        c.copy_from_slice(&x[..c.len()]);
    }
    // standard deviation of a uniform code: int8 ~ 73.9, int4 ~ 4.6, int2 ~ 1.1
    let code_std = match part.format {
        StoreFormat::Int8 => 73.9,
        StoreFormat::Int4 => 4.6,
        _ => 1.1,
    };
    let s = std / code_std;
    for (r, v) in [(part.scales, s), (part.mins, -1.5 * s)] {
        if let Some(r) = r {
            let b = &mut out[(r[0] - base) as usize..(r[0] - base + r[1]) as usize];
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Writes the synthetic container to `out` (which must be empty or absent).
pub fn synth(
    out: &Path,
    o: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, String> {
    let cfg = config(o)?;
    let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    if std::fs::read_dir(out)
        .map_err(|e| io(out, e))?
        .next()
        .is_some()
    {
        return Err(format!(
            "{} is not empty; choose another --out",
            out.display()
        ));
    }
    let policy = Policy {
        experts: o.experts,
        dense: StoreFormat::Int8,
        embedding: StoreFormat::Int8,
        mtp: StoreFormat::Int8,
        group: 64,
    };
    let g = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (h, mi, ne) = (
        g("hidden_size"),
        g("moe_intermediate_size"),
        g("n_routed_experts"),
    );
    let n_layers = g("num_hidden_layers");

    // dense skeleton layout
    let mut c = Cursor(0);
    let mut parts = Vec::new();
    let spec = ModelSpec::from_json(&cfg.to_string(), Path::new("config.json"))
        .map_err(|e| format!("synthetic config: {e}"))?;
    for (name, shape) in names::dense_tensors(&spec) {
        let r = role(&name, n_layers);
        let part = if shape.len() == 1 || r == Role::KeepF32 {
            c.part(StoreFormat::F32, shape, 0)
        } else {
            let g = if r == Role::Embedding {
                shape[1]
            } else {
                policy.group
            };
            let (f, g) = choose(StoreFormat::Int8, shape[1], g);
            c.part(f, shape, g)
        };
        parts.push((name, part));
    }
    let dense_bytes = c.0;
    // expert record layout
    let mut rc = Cursor(0);
    let (gf, gg) = choose(o.experts, h, policy.group);
    let (df, dg) = choose(o.experts, mi, policy.group);
    let gate = rc.part(gf, vec![mi, h], gg);
    let up = rc.part(gf, vec![mi, h], gg);
    let down = rc.part(df, vec![h, mi], dg);
    let payload = rc.0;
    let record_bytes = payload.div_ceil(RECORD_ALIGN as u64) * RECORD_ALIGN as u64;
    let moe: Vec<usize> = (o.dense_layers..n_layers).collect();
    let total = dense_bytes + record_bytes * (ne * moe.len()) as u64;
    let mut done = 0u64;

    // dense.bin, tensor by tensor
    let dp = out.join("dense.bin");
    let f = File::create(&dp).map_err(|e| io(&dp, e))?;
    f.set_len(dense_bytes).map_err(|e| io(&dp, e))?;
    let mut tensors = BTreeMap::new();
    for (ti, (name, part)) in parts.iter().enumerate() {
        let lo = part.data[0];
        let hi = [Some(part.data), part.scales, part.mins]
            .into_iter()
            .flatten()
            .map(|r| r[0] + r[1])
            .max()
            .unwrap_or(lo);
        let mut buf = vec![0u8; (hi - lo) as usize];
        let seed = seed_of(&[o.seed, 1, ti as u64]);
        let cols = *part.shape.last().unwrap_or(&1);
        if part.format == StoreFormat::F32 {
            let n = part.data[1] as usize / 4;
            let vals: Vec<f32> = if name.ends_with("e_score_correction_bias") {
                correction_bias(o, seed, n)
            } else if name.ends_with("k_norm.bias") {
                vec![0.0; n]
            } else if part.shape.len() == 1 {
                vec![1.0; n] // norm weights
            } else {
                uniform(seed, n, 3f32.sqrt() / (cols as f32).sqrt())
            };
            for (c, v) in buf.chunks_exact_mut(4).zip(vals) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        } else {
            let std = if name == names::EMBED {
                1.0
            } else {
                1.0 / (cols as f32).sqrt()
            };
            fill(part, seed, std, &mut buf, lo);
        }
        let mut hsh = crc32fast::Hasher::new();
        for r in [Some(part.data), part.scales, part.mins]
            .into_iter()
            .flatten()
        {
            hsh.update(&buf[(r[0] - lo) as usize..(r[0] - lo + r[1]) as usize]);
        }
        f.write_all_at(&buf, lo).map_err(|e| io(&dp, e))?;
        done += buf.len() as u64;
        progress(done, total);
        tensors.insert(
            name.clone(),
            DenseTensor {
                part: part.clone(),
                crc32: hsh.finalize(),
            },
        );
    }
    f.sync_all().map_err(|e| io(&dp, e))?;

    // experts, one file per MoE layer, records made in parallel
    let mut layers = Vec::new();
    for &l in &moe {
        let file = format!("experts-{l:03}.bin");
        let p = out.join(&file);
        let f = File::create(&p).map_err(|e| io(&p, e))?;
        f.set_len(record_bytes * ne as u64).map_err(|e| io(&p, e))?;
        let mut crcs = vec![0u32; ne];
        for chunk in (0..ne).collect::<Vec<_>>().chunks(8) {
            let got: Vec<Result<(usize, u32), String>> = chunk
                .par_iter()
                .map(|&e| {
                    let mut rec = vec![0u8; record_bytes as usize];
                    for (k, (part, cols)) in [(&gate, h), (&up, h), (&down, mi)].iter().enumerate()
                    {
                        let s = seed_of(&[o.seed, 2, l as u64, e as u64, k as u64]);
                        fill(part, s, 1.0 / (*cols as f32).sqrt(), &mut rec, 0);
                    }
                    let crc = crc32fast::hash(&rec[..payload as usize]);
                    f.write_all_at(&rec, e as u64 * record_bytes)
                        .map_err(|err| io(&p, err))?;
                    Ok((e, crc))
                })
                .collect();
            for r in got {
                let (e, crc) = r?;
                crcs[e] = crc;
                done += record_bytes;
            }
            progress(done, total);
        }
        f.sync_all().map_err(|e| io(&p, e))?;
        layers.push(ExpertLayer {
            layer: l,
            file,
            count: ne,
            record_bytes,
            gate: gate.clone(),
            up: up.clone(),
            down: down.clone(),
            crc32: crcs,
            payload_bytes: payload,
        });
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        model_type: "glm_moe_dsa".into(),
        policy,
        dense_file: "dense.bin".into(),
        tensors,
        experts: layers,
    };
    let cp = out.join("config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(&cfg).expect("json"))
        .map_err(|e| io(&cp, e))?;
    // the manifest last: a directory without it is not a container
    let mp = out.join(MANIFEST);
    std::fs::write(&mp, serde_json::to_string(&manifest).expect("json")).map_err(|e| io(&mp, e))?;
    Ok(SynthReport {
        dense_bytes,
        expert_bytes: record_bytes * (ne * moe.len()) as u64,
        record_bytes,
        experts: ne * moe.len(),
    })
}

/// Correction bias making expert popularity Zipf-like: experts in a random order per layer get
/// a bias falling with the log of their rank, `-skew * 0.1 * ln(1 + rank)` (routing scores are
/// sigmoids, about 0.5 +- 0.2 here).
fn correction_bias(o: &SynthOptions, seed: u64, n: usize) -> Vec<f32> {
    let mut r = splitmix(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (r() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut b = vec![0.0f32; n];
    for (rank, &e) in order.iter().enumerate() {
        b[e] = (-o.skew * 0.1 * (1.0 + rank as f64).ln()) as f32;
    }
    b
}
