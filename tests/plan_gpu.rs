//! `charm plan --cluster MACHINES.json` with a `gpu` on a machine: the experts placed there fill
//! VRAM first and run at the GPU's bandwidth; a bad `gpu` is a clear error.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod common;
use common::{charm, check_budget};

/// A scratch directory holding GLM-5.2's `config.json` alone (planned from its shapes).
fn glm52(tag: &str) -> PathBuf {
    let dir = common::scratch(tag);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy("tests/data/glm-5.2-config.json", dir.join("config.json")).unwrap();
    dir
}

/// `n` machines of 128 GiB on 10 GbE; the GPU `gpu` on those `with_gpu` names.
fn machines(dir: &Path, tag: &str, n: usize, gpu: &Value, with_gpu: &[usize]) -> PathBuf {
    let ms: Vec<Value> = (0..n)
        .map(|i| {
            let mut m = json!({"name": format!("m{i}"), "ram_gib": 128, "mem_gb_s": 60,
                               "disk_gb_s": 3, "link_gbit_s": 10, "rtt_ms": 0.1});
            if with_gpu.contains(&i) {
                m["gpu"] = gpu.clone();
            }
            m
        })
        .collect();
    let f = dir.join(format!("{tag}.json"));
    std::fs::write(&f, json!({ "machines": ms }).to_string()).unwrap();
    f
}

/// `charm plan` of the model in `dir` on `cluster` with activations `act` and `extra` flags:
/// success, stdout and stderr.
fn run_plan(dir: &Path, cluster: &Path, act: &str, extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "plan",
        "--model",
        dir.to_str().unwrap(),
        "--cluster",
        cluster.to_str().unwrap(),
        "--activations",
        act,
    ];
    args.extend_from_slice(extra);
    charm(&args)
}

/// `charm plan --json` of the model in `dir` on `cluster`, int4 dense weights.
fn plan(dir: &Path, cluster: &Path, act: &str) -> (Value, String) {
    let (ok, out, err) = run_plan(dir, cluster, act, &["--dense", "int4", "--json"]);
    assert!(ok, "{err}");
    (serde_json::from_str(&out).unwrap(), err)
}

const GIB: f64 = (1u64 << 30) as f64;

#[test]
fn a_gpu_holds_experts_in_vram_and_decodes_faster() {
    let dir = glm52("plan-gpu");
    let gpu = json!({"vram_gib": 24, "mem_gb_s": 900});
    for n in [1, 2] {
        let (plain, _) = plan(
            &dir,
            &machines(&dir, &format!("cpu-{n}"), n, &gpu, &[]),
            "int8",
        );
        let (with, _) = plan(
            &dir,
            &machines(&dir, &format!("gpu-{n}"), n, &gpu, &[n - 1]),
            "int8",
        );
        let (p, g) = (&plain["prediction"], &with["prediction"]);
        check_budget(&p["token"]);
        check_budget(&g["token"]);
        assert!(
            g["tok_s"].as_f64().unwrap() > p["tok_s"].as_f64().unwrap(),
            "{n} machines: {g} vs {p}"
        );
        // the memory plan is the coordinator's machine's: its byte fields are as they were
        for k in [
            "dense_bytes",
            "kv_bytes",
            "resident_bytes",
            "experts_total_bytes",
        ] {
            assert_eq!(plain[k], with[k], "{k}");
        }
        let node = &g["setup"]["nodes"][n - 1]["gpu"];
        assert_eq!(node["vram_bytes"].as_f64(), Some(23.0 * GIB), "{node}");
        let l = &g["links"][n - 1];
        let vram = l["vram_bytes"].as_f64().unwrap();
        assert!(vram > 20.0 * GIB && vram <= 23.0 * GIB, "{l}");
        let share = l["vram_read_share"].as_f64().unwrap();
        assert!(share > 0.0 && share < 1.0, "{l}");
        assert!(g["vram_read_share"].as_f64().unwrap() > 0.0, "{g}");
        assert_eq!(p["links"][n - 1]["vram_bytes"], 0, "{p}");
        assert_eq!(p["vram_read_share"].as_f64(), Some(0.0));
        assert!(p["setup"]["nodes"][n - 1].get("gpu").is_none());
    }
    // the text names what VRAM holds
    let f = machines(&dir, "text", 1, &gpu, &[0]);
    let (ok, text, err) = run_plan(&dir, &f, "int8", &[]);
    assert!(
        ok && text.contains("in its VRAM = 23.00 GiB"),
        "{text}{err}"
    );

    // a card no larger than the headroom holds nothing: the same prediction
    let (plain, _) = plan(&dir, &machines(&dir, "cpu-1", 1, &gpu, &[]), "int8");
    let small = json!({"vram_gib": 1, "mem_gb_s": 900});
    let (none, _) = plan(&dir, &machines(&dir, "small", 1, &small, &[0]), "int8");
    assert_eq!(
        none["prediction"]["tok_s"], plain["prediction"]["tok_s"],
        "{none}"
    );
    assert_eq!(none["prediction"]["links"][0]["vram_bytes"], 0);

    // f32 activations: the VRAM tier does not run, the prediction says so and leaves it out
    let (f32_gpu, err) = plan(&dir, &machines(&dir, "gpu-1", 1, &gpu, &[0]), "f32");
    let (f32_plain, _) = plan(&dir, &machines(&dir, "cpu-1", 1, &gpu, &[]), "f32");
    assert!(err.contains("warning") && err.contains("m0"), "{err}");
    assert_eq!(
        f32_gpu["prediction"]["tok_s"],
        f32_plain["prediction"]["tok_s"]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_gpu_is_a_clear_error() {
    let dir = glm52("plan-gpu-bad");
    for (gpu, says) in [
        (
            json!({"vram_gib": -24, "mem_gb_s": 900}),
            "must be positive",
        ),
        (json!({"vram_gib": 24, "mem_gb_s": 0}), "must be positive"),
        (json!({"vram_gib": 24}), "missing field `mem_gb_s`"),
        (
            json!({"vram_gib": 24, "mem_gb_s": 900, "cores": 10496}),
            "unknown field `cores`",
        ),
        (json!("24 GB"), "invalid type"),
    ] {
        let f = machines(&dir, "bad", 2, &gpu, &[1]);
        let (ok, _, err) = run_plan(&dir, &f, "int8", &[]);
        assert!(
            !ok && err.contains("machine `m1`") && err.contains(says),
            "{gpu}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_example_machines_file_plans_with_its_gpu() {
    let dir = glm52("plan-gpu-example");
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/machines.json");
    let text = std::fs::read_to_string(&f).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let with_gpu: Vec<usize> = v["machines"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("gpu").is_some())
        .map(|(i, _)| i)
        .collect();
    assert!(!with_gpu.is_empty(), "{text}");
    let (p, _) = plan(&dir, &f, "int8");
    let pr = &p["prediction"];
    check_budget(&pr["token"]);
    for i in with_gpu {
        assert!(pr["links"][i]["vram_bytes"].as_u64().unwrap() > 0, "{pr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_single_box_plan_with_the_dense_pass_on_the_gpu_gives_its_room_to_the_expert_cache() {
    let dir = glm52("plan-dense-gpu-box");
    let plan = |dense: &str| -> Value {
        let args = ["--activations", "int8", "--dense", "int4", "--ram", "120"];
        common::plan_json(&dir, &[&args[..], &["--dense-device", dense]].concat())
    };
    let (cpu, gpu) = (plan("cpu"), plan("gpu"));
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(gpu["dense_on_gpu"], true);
    // the dense weights load into RAM first: the floor is the same
    assert_eq!(n(&gpu, "resident_bytes"), n(&cpu, "resident_bytes"));
    assert_eq!(
        n(&gpu, "cache_bytes") - n(&cpu, "cache_bytes"),
        n(&cpu, "dense_bytes") - n(&cpu, "embed_bytes")
    );
    assert!(n(&gpu, "expected_cold_bytes_per_token") < n(&cpu, "expected_cold_bytes_per_token"));
    std::fs::remove_dir_all(&dir).ok();
}
