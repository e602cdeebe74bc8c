//! The VRAM tier against the CPU, bit for bit: the expert kernels over shapes, formats and edge
//! values; logits and tokens of every oracle fixture and the demo model with every expert in
//! VRAM and with a third of them (layers split between the GPU and the CPU); the self-check
//! refusing a kernel that rounds differently; a missing adapter. On a machine without a Vulkan or
//! Metal adapter these tests say so and pass, unless `CHARM_REQUIRE_GPU=1` (CI, on Mesa's
//! lavapipe) makes that a failure.

mod common;

use std::path::{Path, PathBuf};

use charm_shared::kernels::Matrix;
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::{Activations, QMatrix, QuantKind};
use charm_worker::gpu::{Gpu, GpuError, Job, Matvec};
use common::{charm, charm_env, convert, fixture, json, oracle_ids, scratch, FIXTURES};

/// The device the tests use, or `None` (with a note) where this machine has none.
fn device() -> Option<Gpu> {
    device_with(Matvec::from_env())
}

/// [`device`] with the matrix kernel `matvec`.
fn device_with(matvec: Option<Matvec>) -> Option<Gpu> {
    match Gpu::open_with(None, matvec) {
        Ok(g) => Some(g),
        Err(e) => {
            assert!(
                std::env::var("CHARM_REQUIRE_GPU").as_deref() != Ok("1"),
                "CHARM_REQUIRE_GPU=1 but no GPU opened: {e}"
            );
            eprintln!("no GPU here ({e}): skipped");
            None
        }
    }
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        })
        .collect()
}

fn expert(kind: QuantKind, group: usize, hidden: usize, inter: usize, seed: u64) -> SwiGlu {
    let q = |rows, cols, s| {
        let m = Matrix::new(rows, cols, values(rows * cols, s, 0.3));
        Linear::Quant(QMatrix::quantize(&m, kind, group).unwrap()).prepared(Activations::Int8)
    };
    SwiGlu {
        gate: q(inter, hidden, seed),
        up: q(inter, hidden, seed + 1),
        down: q(hidden, inter, seed + 2),
    }
}

/// The bits of each value, every NaN as one (CPUs disagree on a NaN's sign and payload; see
/// `charm_worker::gpu::same_bits`).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter()
        .map(|x| if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() })
        .collect()
}

#[test]
fn expert_kernels_match_the_cpu_bit_for_bit_at_every_row_count() {
    // both matrix kernels; the tiled one's tiles are 64 rows of 32 words: rows and row lengths
    // that fill none, one and parts of several, and groups that span tiles
    for matvec in [Matvec::Tiled, Matvec::Lanes] {
        let Some(gpu) = device_with(Some(matvec)) else {
            return;
        };
        expert_kernels_match_the_cpu(&gpu);
    }
}

fn expert_kernels_match_the_cpu(gpu: &Gpu) {
    let shapes = [
        (QuantKind::Int4, 64, 128, 64),
        (QuantKind::Int4, 32, 96, 64),
        (QuantKind::Int4, 128, 256, 128),
        (QuantKind::Int4, 32, 352, 96),
        (QuantKind::Int8, 32, 64, 96),
        (QuantKind::Int8, 64, 128, 64),
        (QuantKind::Int8, 32, 160, 96),
        (QuantKind::Int8, 256, 512, 256),
    ];
    let matvec = gpu.matvec_kernel;
    for (si, &(kind, group, hidden, inter)) in shapes.iter().enumerate() {
        let e = expert(kind, group, hidden, inter, 10 * si as u64);
        let on_gpu = gpu.upload(&e).unwrap();
        for rows in [1, 2, 3, 4, 8, 9] {
            let mut x = values(rows * hidden, 100 + rows as u64, 6.0);
            // edge rows: zeros, tiny (subnormal scale products), huge (overflow in the gate)
            if rows >= 3 {
                x[..hidden].fill(0.0);
                x[hidden..2 * hidden].iter_mut().for_each(|v| *v *= 1e-38);
                x[2 * hidden..3 * hidden]
                    .iter_mut()
                    .for_each(|v| *v *= 1e30);
            }
            let got = gpu
                .run(&[Job {
                    expert: &on_gpu,
                    x: &x,
                    rows,
                }])
                .unwrap()
                .remove(0);
            let want = e.forward(&x, rows);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{matvec:?}: {kind:?} group {group} {hidden}x{inter}, {rows} rows"
            );
            // and each row alone gives the same bits as in the batch
            if rows > 1 {
                let one = gpu
                    .run(&[Job {
                        expert: &on_gpu,
                        x: &x[hidden..2 * hidden],
                        rows: 1,
                    }])
                    .unwrap()
                    .remove(0);
                assert_eq!(bits(&one), bits(&want[hidden..2 * hidden]));
            }
        }
    }
}

#[test]
fn several_experts_in_one_submission_keep_their_own_rows() {
    let Some(gpu) = device() else { return };
    let (hidden, inter) = (128, 64);
    let es: Vec<SwiGlu> = (0..3)
        .map(|i| expert(QuantKind::Int4, 64, hidden, inter, 50 + i))
        .collect();
    let up: Vec<_> = es.iter().map(|e| gpu.upload(e).unwrap()).collect();
    let xs: Vec<Vec<f32>> = (0..3)
        .map(|i| values((i + 1) * hidden, 70 + i as u64, 3.0))
        .collect();
    let jobs: Vec<Job<'_>> = (0..3)
        .map(|i| Job {
            expert: &up[i],
            x: &xs[i],
            rows: i + 1,
        })
        .collect();
    let got = gpu.run(&jobs).unwrap();
    for i in 0..3 {
        assert_eq!(bits(&got[i]), bits(&es[i].forward(&xs[i], i + 1)));
    }
}

#[test]
fn experts_the_kernels_do_not_take_are_refused_by_name() {
    let Some(gpu) = device() else { return };
    let e = expert(QuantKind::Int4, 64, 128, 64, 1);
    let bf16 = SwiGlu {
        gate: Linear::F32(e.gate.to_f32()),
        ..e
    };
    match gpu.upload(&bf16) {
        Err(GpuError::Format(why)) => assert!(why.contains("gate"), "{why}"),
        other => panic!("expected a format refusal, got {other:?}"),
    }
}

/// [`int4_container`] of `src` where a GPU opens (`None`, with a note, where none does).
fn gpu_container(tag: &str, src: &Path) -> Option<PathBuf> {
    device()?;
    Some(int4_container(tag, src))
}

/// `NAME` converted with int4 routed experts (the rest as the converter's defaults).
fn int4_container(name: &str, src: &Path) -> PathBuf {
    let out = scratch(&format!("gpu-{name}"));
    let (ok, err) = convert(src, &out, &["--experts", "int4"], None);
    assert!(ok, "convert {name}: {err}");
    out
}

/// A logits file's values as bits (every NaN as one).
fn read(p: &Path) -> Vec<u32> {
    let (_, v) = common::tensor_f32(p, "logits");
    bits(&v)
}

/// Panics naming the first differing value, not printing both tensors.
fn same(a: &[u32], b: &[u32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        panic!(
            "{what}: value {i} differs: {} against {}",
            f32::from_bits(a[i]),
            f32::from_bits(b[i])
        );
    }
}

/// One `charm generate --json` run of `tokens` tokens with activations `act` and `extra` flags
/// and environment: whether it succeeded, its JSON, its stderr.
fn run(
    model: &Path,
    ids: &str,
    tokens: usize,
    act: &str,
    extra: &[&str],
    env: &[(&str, String)],
) -> (bool, serde_json::Value, String) {
    let args = [&["--activations", act][..], extra].concat();
    common::generate_run(model, ids, tokens, &args, env)
}

/// The generated ids of a [`run`]'s JSON.
fn ids_of(v: &serde_json::Value) -> Vec<u64> {
    v["ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no ids: {v}"))
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect()
}

/// `charm generate --json` on `model` with `extra` flags: the ids and the expert statistics.
fn generate(model: &Path, ids: &str, extra: &[&str]) -> (Vec<u64>, serde_json::Value) {
    generate_n(model, ids, 8, extra)
}

/// [`generate`] of `tokens` tokens.
fn generate_n(
    model: &Path,
    ids: &str,
    tokens: usize,
    extra: &[&str],
) -> (Vec<u64>, serde_json::Value) {
    let (ok, v, err) = run(model, ids, tokens, "int8", extra, &[]);
    assert!(ok, "generate {extra:?}: {err}");
    (ids_of(&v), v["stats"]["experts"].clone())
}

#[test]
fn every_oracle_fixture_gives_the_cpu_bits_with_experts_in_vram() {
    if device().is_none() {
        return;
    }
    for name in FIXTURES {
        let c = int4_container(name, &fixture(name));
        let ids: Vec<String> = oracle_ids(name, "tf_input_ids")
            .iter()
            .map(|i| i.to_string())
            .collect();
        let ids = ids.join(",");
        let logits = |extra: &[&str], tag: &str| {
            let out = c.join(format!("logits-{tag}.safetensors"));
            let mut args = vec![
                "logits",
                "--model",
                c.to_str().unwrap(),
                "--ids",
                &ids,
                "--activations",
                "int8",
                "--history",
                "none",
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(extra);
            let (ok, _, err) = charm(&args);
            assert!(ok, "{name} logits {extra:?}: {err}");
            read(&out)
        };
        let cpu = logits(&[], "cpu");
        same(
            &logits(&["--vram", "4"], "all"),
            &cpu,
            &format!("{name}: all experts in VRAM"),
        );

        let (cpu_ids, cpu_stats) = generate(&c, &ids, &[]);
        assert_eq!(cpu_stats["vram_hits"], 0);
        let (all_ids, all) = generate(&c, &ids, &["--vram", "4"]);
        assert_eq!(all_ids, cpu_ids, "{name}: greedy tokens, all in VRAM");
        let total = all["vram_bytes"].as_u64().unwrap();
        let experts = all["vram_experts"].as_u64().unwrap();
        assert!(total > 0 && experts > 0, "{name}: {all}");
        assert!(all["vram_hits"].as_u64().unwrap() > 0, "{name}: {all}");
        assert_eq!(
            all["hits"].as_u64().unwrap() + all["misses"].as_u64().unwrap(),
            0
        );

        // a third of the experts: layers split between the GPU and the CPU
        let third = format!("{}", (total / 3) as f64 / (1u64 << 30) as f64);
        same(
            &logits(&["--vram", &third], "third"),
            &cpu,
            &format!("{name}: a third of the experts in VRAM"),
        );
        let (third_ids, part) = generate(&c, &ids, &["--vram", &third]);
        assert_eq!(third_ids, cpu_ids, "{name}: greedy tokens, a third in VRAM");
        let held = part["vram_experts"].as_u64().unwrap();
        assert!(held > 0 && held < experts, "{name}: {part}");
        assert!(part["vram_hits"].as_u64().unwrap() > 0);
        assert!(part["hits"].as_u64().unwrap() + part["misses"].as_u64().unwrap() > 0);
        let _ = std::fs::remove_dir_all(&c);
    }
}

#[test]
fn the_demo_model_samples_and_drafts_the_same_tokens_with_experts_in_vram() {
    let Some(c) = gpu_container("demo", &common::server::demo()) else {
        return;
    };
    let prompt = "1,2,3,4,5,6,7,8";
    let (_, all) = generate(&c, prompt, &["--vram", "4"]);
    let third = format!(
        "{}",
        (all["vram_bytes"].as_u64().unwrap() / 3) as f64 / (1u64 << 30) as f64
    );
    let mut swaps = 0;
    for extra in [
        &[][..],
        &["--temperature", "0.8", "--seed", "7"][..],
        &["--draft", "3"][..],
    ] {
        let (cpu, _) = generate_n(&c, prompt, 48, extra);
        for vram in ["4", third.as_str()] {
            let mut with = extra.to_vec();
            with.extend_from_slice(&["--vram", vram]);
            let (gpu, stats) = generate_n(&c, prompt, 48, &with);
            assert_eq!(gpu, cpu, "demo {with:?}");
            assert!(
                stats["vram_hits"].as_u64().unwrap() > 0,
                "{with:?}: {stats}"
            );
            if vram != "4" {
                swaps += stats["vram_swaps"].as_u64().unwrap();
            }
        }
    }
    // experts that turned hot moved into VRAM while decoding, and the tokens stayed the same
    assert!(swaps > 0, "no expert moved into VRAM");
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn a_device_whose_kernel_rounds_differently_is_refused_and_the_cpu_runs() {
    let name = "glm5-tiny";
    let Some(c) = gpu_container("perturbed", &fixture(name)) else {
        return;
    };
    let ids = "1,2,3,4,5";
    let (cpu, _) = generate(&c, ids, &[]);
    let perturbed = [("CHARM_GPU_TEST_PERTURB", "1".to_string())];
    let (ok, v, err) = run(&c, ids, 8, "int8", &["--vram", "4"], &perturbed);
    assert!(ok, "{err}");
    assert!(
        err.contains("refused: its expert kernel differs from the CPU at output"),
        "{err}"
    );
    assert_eq!(ids_of(&v), cpu);
    assert_eq!(v["stats"]["experts"]["vram_hits"], 0);

    // doctor reports the verdict per adapter
    let (_, out, err) = charm_env(
        &["doctor", "--model", c.to_str().unwrap(), "--json"],
        &perturbed,
    );
    let r = json(&out);
    let gpu = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "gpu")
        .unwrap_or_else(|| panic!("no gpu check: {out} {err}"));
    assert_eq!(gpu["status"], "warn", "{gpu}");
    assert!(gpu["data"][0]["verdict"]
        .as_str()
        .unwrap()
        .contains("refused"));
    let (_, out, _) = charm(&["doctor", "--model", c.to_str().unwrap(), "--json"]);
    let r = json(&out);
    let gpu = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "gpu")
        .unwrap();
    assert_eq!(gpu["status"], "ok", "{gpu}");
    assert!(gpu["data"][0]["name"]
        .as_str()
        .is_some_and(|n| !n.is_empty()));
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn vram_without_a_usable_adapter_or_with_f32_activations_says_so() {
    let c = int4_container("noadapter", &fixture("qwen3moe-tiny"));
    let ids = "1,2,3";
    let (cpu, _) = generate(&c, ids, &[]);
    // an adapter that is not there: one line, and the CPU path
    let (ok, v, err) = run(&c, ids, 8, "int8", &["--vram", "4", "--gpu", "99"], &[]);
    assert!(ok, "{err}");
    assert!(err.contains("no GPU adapter 99"), "{err}");
    assert_eq!(ids_of(&v), cpu);
    assert_eq!(v["stats"]["experts"]["vram_hits"], 0);
    // f32 activations: refused with the flag that fixes it
    let (ok, _, err) = run(&c, ids, 8, "f32", &["--vram", "4"], &[]);
    assert!(!ok);
    assert!(err.contains("--activations int8"), "{err}");
    for bad in ["0", "-1", "x", "autox"] {
        let flag = format!("--vram={bad}");
        let (ok, _, err) = run(&c, ids, 8, "int8", &[&flag], &[]);
        assert!(!ok && err.contains("--vram"), "--vram {bad}: {err}");
    }
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn the_gateway_batches_the_same_answers_with_experts_in_vram() {
    let Some(c) = gpu_container("gateway", &common::server::demo()) else {
        return;
    };
    let base = ["--activations", "int8", "--history", "none"];
    let cpu = {
        let s = common::server::Server::start_model(&c, &base);
        common::server::batched_completions(&s.addr)
    };
    let mut with = base.to_vec();
    with.extend_from_slice(&["--vram", "4"]);
    let s = common::server::Server::start_model(&c, &with);
    assert_eq!(common::server::batched_completions(&s.addr), cpu);
    let st = common::http::http(&s.addr, "GET", "/v1/status", &[], b"").json();
    let x = &st["experts"];
    assert!(x["vram_hits"].as_u64().unwrap() > 0, "{x}");
    assert!(x["vram_experts"].as_u64().unwrap() > 0, "{x}");
    let names = st["heat"]["locations"].as_array().unwrap();
    let at = names
        .iter()
        .position(|n| n == "coordinator VRAM")
        .unwrap_or_else(|| panic!("no VRAM location: {names:?}"));
    let in_vram = st["heat"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l["where"].as_array().unwrap().clone())
        .filter(|w| w[0].as_u64() == Some(at as u64))
        .count();
    assert!(in_vram > 0);
    drop(s);
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn a_cluster_of_a_gpu_worker_and_a_cpu_worker_gives_the_single_box_bits() {
    use common::cluster::{certs, workers_arg, Worker};
    // (the demo model: the gateway below needs its tokenizer)
    let Some(c) = gpu_container("cluster", &common::server::demo()) else {
        return;
    };
    let dir = certs("gpu-certs");
    let act = ["--activations", "int8"];
    let w1 = Worker::start(&c, &dir, "w1", 0, &[&act[..], &["--vram", "4"]].concat());
    let w2 = Worker::start(&c, &dir, "w2", 0, &act);
    let ids = "5,17,29,3,11,42,7,8";
    let (single, _) = generate_n(&c, ids, 24, &[]);
    let cluster_args = [
        "--cluster",
        dir.to_str().unwrap(),
        "--workers",
        &workers_arg(&[(&w1, "w1"), (&w2, "w2")]),
    ];
    let (got, _) = generate_n(&c, ids, 24, &cluster_args);
    assert_eq!(got, single, "GPU worker + CPU worker against single box");
    // the coordinator sees the GPU worker's VRAM and adapter
    let (ok, out, err) = charm(
        &[
            &["cluster", "status", "--model", c.to_str().unwrap()][..],
            &cluster_args,
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let line = out.lines().find(|l| l.contains("w1")).unwrap_or_default();
    assert!(line.contains("GiB expert VRAM on"), "{out}");
    let line = out.lines().find(|l| l.contains("w2")).unwrap_or_default();
    assert!(!line.contains("VRAM"), "{out}");
    // the dashboard's heat map: the GPU worker's VRAM is a location of its own, holding experts
    // (every expert on both workers: lavapipe's measured speed alone would place few on w1)
    let file = dir.join("both.json");
    std::fs::write(
        &file,
        serde_json::json!({
            "workers": [w1.addr("w1"), w2.addr("w2")],
            "replicas": 2,
            "hot_share": 1.0,
        })
        .to_string(),
    )
    .unwrap();
    let serve_args = [
        "--activations",
        "int8",
        "--history",
        "none",
        "--cluster",
        file.to_str().unwrap(),
    ];
    let s = common::server::Server::start_model(&c, &serve_args);
    let t = std::time::Instant::now();
    loop {
        let st = common::http::http(&s.addr, "GET", "/v1/status", &[], b"").json();
        let names = st["heat"]["locations"].as_array().unwrap().clone();
        let at = names.iter().position(|n| n == "w1 VRAM");
        assert!(!names.iter().any(|n| n == "w2 VRAM"), "{names:?}");
        let held = at.map_or(0, |at| {
            st["heat"]["layers"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|l| l["where"].as_array().unwrap().clone())
                .filter(|w| w.as_array().unwrap().contains(&(at as u64).into()))
                .count()
        });
        if held > 0 {
            let w1 = st["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["name"] == "w1")
                .unwrap()
                .clone();
            assert!(w1["vram_bytes"].as_u64().unwrap() > 0, "{w1}");
            assert!(!w1["gpu"].as_str().unwrap().is_empty(), "{w1}");
            break;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "no expert shown in w1's VRAM: {names:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    drop(s);
    drop((w1, w2));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn experts_spread_over_two_devices_and_auto_sized_vram_give_the_cpu_tokens() {
    let name = "deepseek3-tiny";
    let Some(c) = gpu_container("twodev", &fixture(name)) else {
        return;
    };
    let ids = "3,1,4,1,5,9,2,6";
    let (cpu, _) = generate_n(&c, ids, 16, &[]);
    // the first adapter opened twice: two devices, experts spread over both
    let (ok, v, err) = run(&c, ids, 16, "int8", &["--vram", "4", "--gpu", "0,0"], &[]);
    assert!(ok && !err.contains("warning"), "{err}");
    assert_eq!(ids_of(&v), cpu);
    let st = &v["stats"]["experts"];
    assert!(st["vram_hits"].as_u64().unwrap() > 0, "{st}");
    // auto: the device's free memory less a headroom, where the driver says it
    let (ok, v, err) = run(&c, ids, 16, "int8", &["--vram", "auto"], &[]);
    if ok {
        assert_eq!(ids_of(&v), cpu);
        assert!(v["stats"]["experts"]["vram_experts"].as_u64().unwrap() > 0);
    } else {
        assert!(
            err.contains("does not say how much memory is free"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&c);
}
