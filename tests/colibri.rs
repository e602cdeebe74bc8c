//! Loading directories in colibrì's converter layout (`out-*.safetensors`, packed `U8` codes with
//! `.qs` scales). The fixture is written here from glm5-tiny following that layout (int8 per row,
//! int4 per row, int4 in groups, int2 per row, round-half-even as numpy's `rint`), then compared
//! with the same rounded values run through the f32 path.

use std::path::Path;

use charm_coordinator::model::cache::KvCache;
use charm_coordinator::ops::quality::compare;
use charm_coordinator::{ForwardError, ForwardOptions, Model};
use charm_shared::checkpoint::Checkpoint;
use serde_json::{json, Value};

mod common;
use common::{fixture, write_safetensors};

#[derive(Clone, Copy, Debug)]
enum Fmt {
    Int8,
    Int4,
    Int4G(usize),
    Int2,
}

/// Round half to even, like numpy's `rint`.
fn rint(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

/// Packs `[rows, cols]` weights the colibrì way; returns (codes, scales, dequantized values).
fn pack(w: &[f32], rows: usize, cols: usize, f: Fmt) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let (mut codes, mut scales, mut deq) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        let g = match f {
            Fmt::Int4G(g) => g,
            _ => cols,
        };
        let (qmin, qmax) = match f {
            Fmt::Int8 => (-128.0, 127.0),
            Fmt::Int4 | Fmt::Int4G(_) => (-8.0, 7.0),
            Fmt::Int2 => (-2.0, 1.0),
        };
        let mut q = Vec::with_capacity(cols);
        for grp in row.chunks(g) {
            let amax = grp.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let s = (amax / qmax as f32).max(1e-8);
            scales.push(s);
            for &v in grp {
                let c = rint(v as f64 / s as f64).clamp(qmin, qmax);
                q.push(c as i32);
                deq.push(s * c as f32);
            }
        }
        match f {
            Fmt::Int8 => codes.extend(q.iter().map(|&c| c as i8 as u8)),
            Fmt::Int4 | Fmt::Int4G(_) => codes.extend(
                q.chunks(2)
                    .map(|p| ((p[0] + 8) as u8) | (((p[1] + 8) as u8) << 4)),
            ),
            Fmt::Int2 => codes.extend(q.chunks(4).map(|p| {
                p.iter()
                    .enumerate()
                    .fold(0u8, |b, (k, &c)| b | (((c + 2) as u8) << (2 * k)))
            })),
        }
    }
    (codes, scales, deq)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes glm5-tiny in colibrì's layout (optionally with the indexer, as its `--indexer` mode
/// adds) and, beside it, an f32 checkpoint holding exactly the values the codes decode to.
fn make(dir: &Path, sim: &Path, with_indexer: bool) {
    let ck = Checkpoint::open(&fixture("glm5-tiny")).unwrap();
    let (mut out, mut reference) = (Vec::new(), Vec::new());
    for name in ck.names() {
        let (info, _) = ck.info(name).unwrap();
        let shape = info.shape.clone();
        let mtp = name.starts_with("model.layers.4.");
        if mtp || (!with_indexer && name.contains(".indexer.")) {
            continue; // colibrì's converter skips the MTP layer and, by default, the DSA indexer
        }
        if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            // per-expert tensors, int4 per row (gate, up) and int2 (down)
            let (e, r, c) = (shape[0], shape[1], shape[2]);
            let w = ck.f32(name, &shape).unwrap();
            let base = name
                .trim_end_matches("gate_up_proj")
                .trim_end_matches("down_proj");
            for x in 0..e {
                let m = &w[x * r * c..(x + 1) * r * c];
                let parts: Vec<(&str, &[f32], usize, Fmt)> = if name.ends_with("gate_up_proj") {
                    vec![
                        ("gate_proj", &m[..r / 2 * c], r / 2, Fmt::Int4),
                        ("up_proj", &m[r / 2 * c..], r / 2, Fmt::Int4),
                    ]
                } else {
                    vec![("down_proj", m, r, Fmt::Int2)]
                };
                for (proj, wm, rows, f) in parts {
                    let n = format!("{base}{x}.{proj}.weight");
                    let (codes, scales, deq) = pack(wm, rows, c, f);
                    out.push((n.clone(), "U8", vec![codes.len()], codes));
                    out.push((
                        format!("{n}.qs"),
                        "F32",
                        vec![scales.len()],
                        f32_bytes(&scales),
                    ));
                    reference.push((n, "F32", vec![rows, c], f32_bytes(&deq)));
                }
            }
            continue;
        }
        let keep = shape.len() == 1
            || name.ends_with("mlp.gate.weight")
            || name.ends_with("weights_proj.weight");
        let w = ck.f32(name, &shape).unwrap();
        if keep {
            out.push((name.to_string(), "F32", shape.clone(), f32_bytes(&w)));
            reference.push((name.to_string(), "F32", shape, f32_bytes(&w)));
            continue;
        }
        let (r, c) = (shape[0], shape[1]);
        let f = if name.contains("embed") || name.contains("lm_head") || name.contains(".indexer.")
        {
            Fmt::Int8
        } else if name.contains("o_proj") || name.contains("q_a_proj") {
            Fmt::Int4G(32)
        } else {
            Fmt::Int8
        };
        let (codes, scales, deq) = pack(&w, r, c, f);
        out.push((name.to_string(), "U8", vec![codes.len()], codes));
        out.push((
            format!("{name}.qs"),
            "F32",
            vec![scales.len()],
            f32_bytes(&scales),
        ));
        reference.push((name.to_string(), "F32", shape, f32_bytes(&deq)));
    }
    for (d, tensors) in [(dir, &out), (sim, &reference)] {
        std::fs::create_dir_all(d).unwrap();
        let mut cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture("glm5-tiny").join("config.json")).unwrap(),
        )
        .unwrap();
        cfg["num_nextn_predict_layers"] = json!(0);
        std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
        let (a, b) = tensors.split_at(tensors.len() / 2);
        let names = if d == dir {
            ["out-00001.safetensors", "out-00002.safetensors"]
        } else {
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ]
        };
        write_safetensors(&d.join(names[0]), a);
        write_safetensors(&d.join(names[1]), b);
    }
}

fn try_logits(m: &Model, ids: &[u32]) -> Result<Vec<f32>, ForwardError> {
    let mut c = KvCache::new(&m.spec);
    let n = m.forward(ids, &mut c, ForwardOptions::default(), None)?;
    m.logits(&n, ids.len())
}

#[test]
fn colibri_layout_loads_and_decodes_exactly() {
    let root = std::env::temp_dir().join(format!("charm-colibri-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let ids: Vec<u32> = vec![
        5, 17, 3, 99, 250, 7, 42, 11, 300, 64, 128, 9, 400, 2, 77, 31,
    ];
    for with_indexer in [false, true] {
        let (dir, sim) = (
            root.join(format!("c{with_indexer}")),
            root.join(format!("s{with_indexer}")),
        );
        make(&dir, &sim, with_indexer);
        let m = Model::load(&dir).unwrap();
        let s = Model::load(&sim).unwrap();
        let v = m.spec.vocab_size;
        let n = if with_indexer { ids.len() } else { 8 }; // glm5-tiny: index_topk 8
        let a = compare(
            &try_logits(&m, &ids[..n]).unwrap(),
            &try_logits(&s, &ids[..n]).unwrap(),
            v,
        );
        assert!(
            a.top1 == 1.0 && a.mean_kl < 1e-9,
            "with_indexer={with_indexer}: {a:?}"
        );
        if !with_indexer {
            assert_eq!(m.dense_attention_limit, Some(8));
            match try_logits(&m, &ids[..9]) {
                Err(ForwardError::NoIndexer {
                    limit: 8,
                    requested: 9,
                }) => {}
                other => panic!("expected the no-indexer refusal, got {other:?}"),
            }
        } else {
            assert_eq!(m.dense_attention_limit, None);
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn unsupported_colibri_formats_are_refused() {
    let root = std::env::temp_dir().join(format!("charm-colibri-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (dir, sim) = (root.join("c"), root.join("s"));
    make(&dir, &sim, false);
    // Replace one tensor's scales with a single E8-style tag.
    let name = "model.layers.1.self_attn.o_proj.weight";
    for f in ["out-00001.safetensors", "out-00002.safetensors"] {
        let p = dir.join(f);
        let file = charm_shared::safetensors::SafetensorsFile::open(&p).unwrap();
        if !file.header.tensors.contains_key(&format!("{name}.qs")) {
            continue;
        }
        let mut tensors = Vec::new();
        for (n, t) in &file.header.tensors {
            let mut bytes = file.bytes(n).unwrap().to_vec();
            let mut shape = t.shape.clone();
            if n == &format!("{name}.qs") {
                bytes = 6.0f32.to_le_bytes().to_vec();
                shape = vec![1];
            }
            tensors.push((n.clone(), t.dtype.name(), shape, bytes));
        }
        drop(file);
        write_safetensors(&p, &tensors);
    }
    let e = Model::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains(name) && e.contains("unsupported colibrì format"),
        "{e}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
