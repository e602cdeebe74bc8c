//! The `charm` binary as users and outside checks call it (contract spellings), plus sharded
//! checkpoint layouts.

use std::path::{Path, PathBuf};

use charm_shared::safetensors::SafetensorsFile;
use serde_json::Value;

mod common;
use common::{charm, fixture, tensor_f32 as tensor, tensor_ints as ints, FIXTURES};

/// A fresh, existing scratch directory.
fn scratch(tag: &str) -> PathBuf {
    let d = common::scratch(tag);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn csv(v: &[i64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn logits_command_writes_the_reference_logits() {
    let d = scratch("logits");
    for f in FIXTURES {
        let oracle = fixture(f).join("oracle.safetensors");
        let ids = ints(&oracle, "tf_input_ids");
        let out = d.join(format!("{f}.safetensors"));
        let (ok, _, err) = charm(&[
            "logits",
            "--model",
            fixture(f).to_str().unwrap(),
            "--ids",
            &csv(&ids),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{f}: {err}");
        let (shape, got) = tensor(&out, "logits");
        let (wshape, want) = tensor(&oracle, "tf_logits");
        assert_eq!(shape, wshape);
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff < 5e-5, "{f}: logits differ by {diff}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn zero_compute_threads_is_a_usage_error() {
    let model = fixture("glm5-tiny");
    for cmd in ["generate", "logits"] {
        let (ok, _, err) = charm(&[
            cmd,
            "--model",
            model.to_str().unwrap(),
            "--ids",
            "1,2",
            "--threads",
            "0",
        ]);
        assert!(!ok, "{cmd}: --threads 0 was accepted");
        assert!(err.contains("--threads"), "{cmd}: {err}");
    }
}

#[test]
fn generate_command_prints_the_reference_greedy_ids() {
    for f in FIXTURES {
        let oracle = fixture(f).join("oracle.safetensors");
        let prompt = ints(&oracle, "greedy_prompt");
        let want = ints(&oracle, "greedy_ids");
        let n = want.len().to_string();
        // cold, and after two untimed prefills of the prompt (`--warmup`), on one, two and
        // three compute threads (`--threads`): the same ids
        for (warmup, threads) in [(0, 1), (2, 2), (0, 3)] {
            let (ok, out, err) = charm(&[
                "generate",
                "--model",
                fixture(f).to_str().unwrap(),
                "--ids",
                &csv(&prompt),
                "--max-tokens",
                &n,
                "--temperature",
                "0",
                "--json",
                "--warmup",
                &warmup.to_string(),
                "--threads",
                &threads.to_string(),
            ]);
            assert!(ok, "{f}: {err}");
            let v: Value = serde_json::from_str(out.trim())
                .unwrap_or_else(|e| panic!("{f}: not one JSON object ({e}): {out}"));
            let ids: Vec<i64> = v["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect();
            assert_eq!(ids, want, "{f} warmup {warmup} threads {threads}");
            assert_eq!(v["warmup"], warmup, "{f}");
            assert_eq!(v["threads"], threads, "{f}");
            for k in [
                "prefill_seconds",
                "decode_seconds",
                "prefill_tok_s",
                "decode_tok_s",
            ] {
                assert!(
                    v[k].as_f64().is_some_and(|x| x >= 0.0),
                    "{f}: field {k} in {out}"
                );
            }
        }
    }
}

#[test]
fn info_command_accounts_for_every_parameter() {
    let (ok, out, err) = charm(&[
        "info",
        "--model",
        fixture("glm5-tiny").to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["architecture"], "glm_moe_dsa");
    let f = SafetensorsFile::open(&fixture("glm5-tiny").join("model.safetensors")).unwrap();
    let total: u64 = f.header.tensors.values().map(|t| t.numel() as u64).sum();
    assert_eq!(v["total_params"].as_u64().unwrap(), total);
    // 3 MoE layers x 16 experts x 3 x 64 x 32 routed parameters
    assert_eq!(
        v["params"]["routed_experts"].as_u64().unwrap(),
        3 * 16 * 3 * 64 * 32
    );
    assert!(v["params"]["mtp"].as_u64().unwrap() > 0);
    assert!(v["bytes_per_dtype"]["BF16"].as_u64().unwrap() > 0);

    // The released GLM-5.2 shape, from config.json alone: ~744B parameters, ~40B active.
    let d = scratch("info");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/glm-5.2-config.json"),
        d.join("config.json"),
    )
    .unwrap();
    let (ok, out, err) = charm(&["info", "--model", d.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let main = v["total_params"].as_u64().unwrap() - v["params"]["mtp"].as_u64().unwrap();
    assert!((740e9..748e9).contains(&(main as f64)), "{main}");
    let active = v["active_params_per_token"].as_u64().unwrap() as f64;
    assert!((38e9..42e9).contains(&active), "{active}");
    // MLA caches 576 floats per layer; each `full` DSA layer adds its 128-float indexer key.
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    let full = cfg["indexer_types"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| *t == "full")
        .count() as u64;
    assert_eq!(
        v["kv_cache_bytes_per_token_f32"].as_u64().unwrap(),
        4 * (78 * 576 + full * 128)
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_usage_gives_an_error_not_a_panic() {
    let m = fixture("glm5-tiny");
    let m = m.to_str().unwrap();
    for args in [
        vec!["generate", "--model", "/nonexistent/model", "--ids", "1,2"],
        vec!["generate", "--model", m, "--ids", "1,x"],
        vec!["generate", "--model", m, "--ids", ""],
        vec!["generate", "--model", m, "--ids", "1,99999"],
        vec![
            "generate",
            "--model",
            m,
            "--ids",
            "1",
            "--temperature",
            "-1",
        ],
        vec![
            "logits",
            "--model",
            m,
            "--ids",
            "4",
            "--out",
            "/nonexistent/dir/x.safetensors",
        ],
        vec!["info", "--model", "/nonexistent/model"],
    ] {
        let (ok, _, err) = charm(&args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains("error"), "{args:?}: {err}");
    }
}

/// Splits glm5-tiny into two shards (with and without an index): identical logits.
#[test]
fn sharded_checkpoints_load_like_one_file() {
    let src = fixture("glm5-tiny");
    let f = SafetensorsFile::open(&src.join("model.safetensors")).unwrap();
    let names: Vec<&String> = f.header.tensors.keys().collect();
    let (a, b) = names.split_at(names.len() / 2);
    let write = |path: &Path, part: &[&String]| {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for n in part {
            let t = &f.header.tensors[n.as_str()];
            let bytes = f.bytes(n).unwrap();
            header.insert(n.to_string(), serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [data.len(), data.len() + bytes.len()]}));
            data.extend_from_slice(bytes);
        }
        let h = serde_json::to_vec(&Value::Object(header)).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(data);
        std::fs::write(path, out).unwrap();
    };
    let ids = "5,17,3,9,200,41";
    // outputs go to a scratch directory: never into the committed fixture
    let outs = scratch("shard-logits");
    let run = |dir: &Path| {
        let out = outs.join(format!(
            "{}.safetensors",
            dir.file_name().unwrap().to_str().unwrap()
        ));
        let (ok, _, err) = charm(&[
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            ids,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(ok, "{}: {err}", dir.display());
        tensor(&out, "logits").1
    };
    let reference = run(&src);
    for with_index in [false, true] {
        let d = scratch(if with_index { "shard-idx" } else { "shard" });
        std::fs::copy(src.join("config.json"), d.join("config.json")).unwrap();
        write(&d.join("model-00001-of-00002.safetensors"), a);
        write(&d.join("model-00002-of-00002.safetensors"), b);
        if with_index {
            let mut map = serde_json::Map::new();
            for n in a {
                map.insert(n.to_string(), "model-00001-of-00002.safetensors".into());
            }
            for n in b {
                map.insert(n.to_string(), "model-00002-of-00002.safetensors".into());
            }
            std::fs::write(
                d.join("model.safetensors.index.json"),
                serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
            )
            .unwrap();
            // a stray file beside an indexed checkpoint is ignored
            std::fs::write(d.join("stray.safetensors"), b"garbage").unwrap();
        }
        assert_eq!(run(&d), reference, "with_index={with_index}");
        std::fs::remove_dir_all(&d).unwrap();
    }
    std::fs::remove_dir_all(&outs).unwrap();
}
