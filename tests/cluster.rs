//! The expert-parallel cluster with real processes on loopback: `charm worker` processes over
//! QUIC with mutual TLS, the coordinator as the `charm` CLI or in this process (for the kill and
//! rejoin test, which needs to act between tokens).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use charm_coordinator::cluster::remote::moe_layers;
use charm_coordinator::cluster::{ClusterOptions, WorkerAddr};
use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, HistoryPolicy};
use common::cluster::*;
use common::*;
use serde_json::Value;

fn json(s: &str) -> Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// `charm logits` (with `extra` arguments) of `ids` on `model`: the output file's bytes and
/// stderr.
fn logits_bytes(model: &Path, ids: &str, out: &Path, extra: &[&str]) -> (Vec<u8>, String) {
    let mut a = vec![
        "logits",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        ids,
        "--out",
        out.to_str().unwrap(),
        "--history",
        "none",
    ];
    a.extend_from_slice(extra);
    let (ok, _, err) = charm(&a);
    assert!(ok, "{a:?}: {err}");
    (std::fs::read(out).unwrap(), err)
}

/// `charm generate --json` (greedy, 12 tokens, with `extra` arguments): the JSON and stderr.
fn generate_json(model: &Path, ids: &str, extra: &[&str]) -> (Value, String) {
    let (ok, v, err) = generate_run(model, ids, 12, extra, &[]);
    assert!(ok, "{extra:?}: {err}");
    (v, err)
}

/// Every listed worker served requests, none failed, and nothing ran on the coordinator.
fn all_served_remotely(v: &Value, n: usize) {
    let c = &v["stats"]["cluster"];
    let ws = c["workers"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(ws.len(), n, "{c}");
    for w in ws {
        assert!(w["requests"].as_u64().unwrap() > 0, "{c}");
        // one after another on one stream kept open
        assert_eq!(w["compute_streams"], 1, "{c}");
        assert_eq!(w["failures"], 0, "{c}");
        assert_eq!(w["connected"], true, "{c}");
    }
    assert_eq!(c["local_runs"], 0, "{c}");
    assert!(c["wire_bytes"].as_u64().unwrap() > 0, "{c}");
}

/// Single-box output and the cluster's, for 2 workers and for 3 with every expert on two of
/// them, in activation mode `act`, workers started with `worker_args`. Returns the workers'
/// status of the last run.
fn compare_on_cluster(
    model: &Path,
    ids: &[u32],
    act: &str,
    tag: &str,
    worker_args: &[&str],
) -> Value {
    let dir = certs(tag);
    let m = ["--activations", act];
    let wargs = [&m[..], worker_args].concat();
    let start = |n| Worker::start(model, &dir, n, 0, &wargs);
    let (w1, w2, w3) = (start("w1"), start("w2"), start("w3"));
    let all: String = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let prompt: String = all.split(',').take(4).collect::<Vec<_>>().join(",");
    let out = dir.join("l.safetensors");
    let (single, _) = logits_bytes(model, &all, &out, &m);
    let (single_gen, _) = generate_json(model, &prompt, &m);

    let cluster = dir.to_str().unwrap();
    let two = workers_arg(&[(&w1, "w1"), (&w2, "w2")]);
    let two_args = [&m[..], &["--cluster", cluster, "--workers", &two]].concat();
    let (bytes, err) = logits_bytes(model, &all, &out, &two_args);
    assert!(
        bytes == single,
        "{tag}: 2-worker logits differ from single-box"
    );
    assert!(!err.contains("warning"), "{err}");
    let (g, _) = generate_json(model, &prompt, &two_args);
    assert_eq!(g["ids"], single_gen["ids"], "{tag}: 2 workers");
    all_served_remotely(&g, 2);

    // three workers, every expert replicated twice (a cluster file with the replica settings)
    let file = dir.join("three.json");
    std::fs::write(
        &file,
        serde_json::json!({
            "workers": [w1.addr("w1"), w2.addr("w2"), w3.addr("w3")],
            "replicas": 2,
            "hot_share": 1.0,
        })
        .to_string(),
    )
    .unwrap();
    let three_args = [&m[..], &["--cluster", file.to_str().unwrap()]].concat();
    let (bytes, _) = logits_bytes(model, &all, &out, &three_args);
    assert!(bytes == single, "{tag}: 3-worker replicated logits differ");
    let (g, _) = generate_json(model, &prompt, &three_args);
    assert_eq!(g["ids"], single_gen["ids"], "{tag}: 3 workers");
    all_served_remotely(&g, 3);
    let placed: u64 = g["stats"]["cluster"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["experts"].as_u64().unwrap())
        .sum();
    let spec = charm_shared::config::ModelSpec::from_dir(model).unwrap();
    let experts: usize = moe_layers(&spec).iter().map(|l| l.1).sum();
    assert_eq!(placed, 2 * experts as u64, "every expert twice");
    drop((w1, w2, w3));
    std::fs::remove_dir_all(&dir).unwrap();
    g["stats"]["cluster"]["workers"].clone()
}

#[test]
fn every_oracle_fixture_gives_single_box_bits_on_two_and_three_workers() {
    for f in FIXTURES {
        let ids = oracle_ids(f, "tf_input_ids");
        for act in ["f32", "int8"] {
            compare_on_cluster(&fixture(f), &ids, act, &format!("cl-{f}-{act}"), &[]);
        }
    }
}

#[test]
fn a_synthetic_glm_container_gives_single_box_bits_on_workers() {
    let dir = synth_tiny("cl-synth");
    let ids: Vec<u32> = vec![5, 17, 3, 99, 100, 7, 8, 9, 1, 2];
    // workers with room for a fraction of the 1 MiB of experts beside their 256 MiB working
    // margin: they stream the rest from the container
    for act in ["f32", "int8"] {
        let ws = compare_on_cluster(
            &dir,
            &ids,
            act,
            &format!("cl-synth-{act}"),
            &["--ram", "0.2503", "--no-direct"],
        );
        for w in ws.as_array().unwrap() {
            let ram = w["ram_bytes"].as_u64().unwrap();
            assert!(ram > 0 && ram < 1 << 20, "{w}");
            // int8 activations travel as their codes (the container's experts are int4)
            let coded = w["coded_requests"].as_u64().unwrap();
            let want = if act == "int8" {
                w["requests"].as_u64().unwrap()
            } else {
                0
            };
            assert_eq!(coded, want, "{w}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn workers_of_another_cluster_or_model_are_refused_and_the_coordinator_carries_on() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-refuse");
    let other = certs("cl-refuse-other");
    let stranger = Worker::start(&model, &other, "w1", 0, &[]);
    let wrong_model = Worker::start(&fixture("deepseek3-tiny"), &dir, "w2", 0, &[]);
    let int8 = Worker::start(&model, &dir, "w3", 0, &["--activations", "int8"]);
    let (single, _) = generate_json(&model, "1,2,3", &[]);
    let list = workers_arg(&[(&stranger, "w1"), (&wrong_model, "w2"), (&int8, "w3")]);
    let (g, err) = generate_json(
        &model,
        "1,2,3",
        &["--cluster", dir.to_str().unwrap(), "--workers", &list],
    );
    assert_eq!(g["ids"], single["ids"]);
    for why in [
        "worker w1",
        "handshake",
        "worker w2",
        "model",
        "worker w3",
        "int8",
        "no worker reachable",
    ] {
        assert!(err.contains(why), "wanted `{why}` in: {err}");
    }
    assert!(g["stats"]["cluster"]["local_runs"].as_u64().unwrap() > 0);
    // a worker without a certificate of its own cannot start
    let (ok, _, err) = charm(&[
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model.to_str().unwrap(),
        "--node",
        "w9",
        "--cluster",
        dir.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("w9"), "{err}");
    drop((stranger, wrong_model, int8));
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}

/// Greedy decoding step by step, calling `between(token index)` before each step.
fn decode(e: &Engine, prompt: &[u32], n: usize, mut between: impl FnMut(usize)) -> Vec<u32> {
    let m = &e.model;
    let h = m.spec.hidden_size;
    let mut cache = KvCache::new(&m.spec);
    let mut s = Sampler::new(SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        ..Default::default()
    });
    let normed = m
        .forward(prompt, &mut cache, ForwardOptions::default(), None)
        .unwrap();
    let mut next = s.sample(&m.logits(&normed[(prompt.len() - 1) * h..], 1).unwrap());
    let mut out = vec![next];
    while out.len() < n {
        between(out.len());
        let normed = m
            .forward(&[next], &mut cache, ForwardOptions::default(), None)
            .unwrap();
        next = s.sample(&m.logits(&normed, 1).unwrap());
        out.push(next);
    }
    out
}

/// Engine options without a routing history (the placement then does not depend on earlier
/// runs).
fn no_history() -> EngineOptions {
    EngineOptions {
        history: HistoryPolicy::Off,
        ..Default::default()
    }
}

/// The first `n` greedy tokens after `prompt` of the model in `model` in one process.
fn single_box(model: &Path, opts: &EngineOptions, prompt: &[u32], n: usize) -> Vec<u32> {
    decode(&Engine::load(model, opts).unwrap(), prompt, n, |_| {})
}

/// The model in `model` loaded with `opts` on cluster `c`.
fn on_cluster(model: &Path, opts: &EngineOptions, c: ClusterOptions) -> Engine {
    Engine::load(
        model,
        &EngineOptions {
            cluster: Some(c),
            ..opts.clone()
        },
    )
    .unwrap()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "gave up waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_worker_killed_mid_generation_changes_no_token_and_rejoins_after_a_restart() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-kill");
    let prompt = oracle_ids("glm5-tiny", "tf_input_ids")[..4].to_vec();
    let opts = no_history();
    let single = Engine::load(&model, &opts).unwrap();
    let want = generate(
        &single.model,
        &prompt,
        24,
        &mut Sampler::new(SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            ..Default::default()
        }),
        &[],
        ForwardOptions::default(),
    )
    .unwrap()
    .ids;
    for replicas in [1, 2] {
        let mut w1 = Worker::start(&model, &dir, "w1", 0, &[]);
        let w2 = Worker::start(&model, &dir, "w2", 0, &[]);
        let port1 = w1.port;
        let mut c = ClusterOptions::new(
            dir.clone(),
            "coordinator",
            vec![
                w1.addr("w1").parse::<WorkerAddr>().unwrap(),
                w2.addr("w2").parse().unwrap(),
            ],
        );
        c.heartbeat = Duration::from_millis(100);
        c.replicas = replicas;
        c.hot_share = 1.0;
        let e = on_cluster(&model, &opts, c);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        let r = e.remote.clone().unwrap();
        let got = decode(&e, &prompt, 24, |t| {
            if t == 6 {
                // SIGKILL: no goodbye on the wire
                w1.child.kill().unwrap();
                w1.child.wait().unwrap();
            }
        });
        assert_eq!(got, want, "replicas {replicas}: tokens changed by the kill");
        let st = r.status();
        assert!(!st[0].connected, "{st:?}");
        assert!(st[1].requests > 0 && st[1].failures == 0, "{st:?}");
        if replicas == 2 {
            // w1's experts all had a copy on w2: nothing ran on the coordinator
            assert_eq!(r.fallbacks(), 0, "{st:?}");
        } else {
            assert!(r.fallbacks() > 0, "{st:?}");
        }
        // restarted on its port, it is dialled again and used from the next step
        let w1b = Worker::start(&model, &dir, "w1", port1, &[]);
        wait_until("w1 rejoins", || r.connected().contains(&"w1".to_string()));
        let before = r.status()[0].requests;
        let again = decode(&e, &prompt, 24, |_| {});
        assert_eq!(again, want);
        let st = r.status();
        assert_eq!(st[0].joins, 2, "{st:?}");
        // the lost connection's stream, then one on the new connection
        assert_eq!(st[0].compute_streams, 2, "{st:?}");
        // each answered request's times, in order, its round trip holding the worker's compute
        let times = r.recent(1);
        assert!(!times.is_empty(), "{st:?}");
        assert!(times.windows(2).all(|p| p[0].seq < p[1].seq), "{times:?}");
        assert!(times
            .iter()
            .all(|t| t.seq <= st[1].requests && t.compute_ns > 0 && t.rtt_ns > t.compute_ns));
        // each names the MoE layer it computed
        let moe: Vec<u32> = moe_layers(&single.model.spec)
            .iter()
            .map(|&(l, _)| l as u32)
            .collect();
        assert!(times.iter().all(|t| moe.contains(&t.layer)), "{times:?}");
        assert!(
            st[0].requests > before,
            "the rejoined worker was not used: {st:?}"
        );
        drop((w1b, w2));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two layers' requests to one worker in flight at once: the second finds the worker's stream
/// busy and goes on one of its own; both answers are those of the same requests sent one at a
/// time.
#[test]
fn overlapping_requests_to_one_worker_take_a_stream_of_their_own() {
    use charm_shared::expert::{ExpertBatch, ExpertExecutor};
    let model = fixture("glm5-tiny");
    let dir = certs("cl-overlap");
    let w1 = Worker::start(&model, &dir, "w1", 0, &[]);
    let c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![w1.addr("w1").parse::<WorkerAddr>().unwrap()],
    );
    let opts = no_history();
    let e = on_cluster(&model, &opts, c);
    let r = e.remote.clone().unwrap();
    let spec = &e.model.spec;
    let (h, k) = (spec.hidden_size, spec.router.as_ref().unwrap().top_k);
    let layer = moe_layers(spec)[0].0;
    let x: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.37).sin()).collect();
    let ids: Vec<u32> = (0..2 * k as u32).collect();
    let weights = vec![0.25f32; 2 * k];
    let batch = |step| ExpertBatch {
        step,
        layer,
        x: &x,
        n_tokens: 2,
        ids: &ids,
        weights: &weights,
        top_k: k,
    };
    let (a, b) = (r.start(batch(1)), r.start(batch(2)));
    let (a, b) = (a.wait().unwrap(), b.wait().unwrap());
    let st = r.status();
    assert_eq!((st[0].requests, st[0].compute_streams), (2, 2), "{st:?}");
    // one at a time afterwards, on the stream kept
    let once = r.run(batch(3)).unwrap();
    assert_eq!(a, once);
    assert_eq!(b, once);
    let st = r.status();
    assert_eq!(
        (st[0].requests, st[0].compute_streams, st[0].failures),
        (3, 2, 0),
        "{st:?}"
    );
    assert_eq!(r.fallbacks(), 0);
    drop(w1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A layer's work for a worker split into requests of two tokens each, as a long prefill at a
/// model's full width is (each request and answer within `request_bytes`): the single-box
/// tokens, every expert answered by the workers, each worker's requests on one stream.
#[test]
fn a_prefill_split_into_requests_of_a_few_tokens_changes_no_token() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-split");
    let prompt: Vec<u32> = oracle_ids("glm5-tiny", "tf_input_ids")
        .into_iter()
        .cycle()
        .take(20)
        .collect();
    let opts = no_history();
    let steps = 6;
    let want = single_box(&model, &opts, &prompt, steps);
    let (w1, w2) = (
        Worker::start(&model, &dir, "w1", 0, &[]),
        Worker::start(&model, &dir, "w2", 0, &[]),
    );
    let spec = charm_shared::config::ModelSpec::from_dir(&model).unwrap();
    let top_k = spec.router.as_ref().unwrap().top_k;
    let mut c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![
            w1.addr("w1").parse::<WorkerAddr>().unwrap(),
            w2.addr("w2").parse().unwrap(),
        ],
    );
    // two tokens' rows out and their results back
    c.request_bytes = 2 * spec.hidden_size * 4 * (1 + top_k);
    let e = on_cluster(&model, &opts, c);
    assert!(e.warnings.is_empty(), "{:?}", e.warnings);
    let r = e.remote.clone().unwrap();
    assert_eq!(decode(&e, &prompt, steps, |_| {}), want);
    assert_eq!(r.fallbacks(), 0);
    let st = r.status();
    let moe = moe_layers(&spec).len() - spec.mtp_layers;
    // unsplit, each worker gets at most one request per MoE layer and step
    let requests: u64 = st.iter().map(|w| w.requests).sum();
    assert!(requests > (2 * moe * steps) as u64, "{st:?}");
    for w in &st {
        assert_eq!((w.failures, w.compute_streams), (0, 1), "{st:?}");
    }
    drop((w1, w2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_demo_runs_a_loopback_cluster_with_single_box_tokens() {
    let (ok, out, err) = charm(&["demo"]);
    assert!(ok, "{err}");
    assert!(!err.contains("warning"), "{err}");
    assert!(out.contains("mode: loopback cluster"), "{out}");
    assert!(
        out.contains("single-box run of the same request: the same tokens"),
        "{out}"
    );
    for w in ["w1", "w2"] {
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{w}: ")))
            .unwrap_or_else(|| panic!("no line for {w}: {out}"));
        let n: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(n > 0, "{line}");
    }
}

#[test]
fn the_deploy_kit_parses_with_charms_loader_and_its_unit_verifies() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let o = ClusterOptions::load(&deploy.join("cluster.json")).unwrap();
    assert_eq!((o.workers.len(), o.replicas), (2, 2));
    assert_eq!(o.certs, Path::new("/etc/charm/cluster"));
    assert_eq!(o.spin, std::time::Duration::from_micros(2000));
    // the compose file's cluster file, with its container host names as addresses
    let compose = std::fs::read_to_string(deploy.join("compose.yaml")).unwrap();
    let inline = compose
        .split("echo '")
        .nth(1)
        .and_then(|s| s.split('\'').next())
        .unwrap();
    let loopback = inline
        .replace("@w1:", "@127.0.0.1:")
        .replace("@w2:", "@127.0.0.1:");
    ClusterOptions::parse(&loopback, Path::new("/cluster")).unwrap();
    // each unit's command line is one charm accepts (it fails on the missing model, not on
    // usage), and the unit verifies where systemd-analyze exists
    let dir = certs("cl-deploy");
    std::fs::write(dir.join("api-key"), "a-key-long-enough-for-charm\n").unwrap();
    std::fs::write(
        dir.join("cluster.json"),
        r#"{"workers": ["w1@127.0.0.1:7070"]}"#,
    )
    .unwrap();
    for (unit_file, instance) in [
        ("charm-worker@.service", "charm-worker@w1.service"),
        ("charm-coordinator.service", "charm-coordinator.service"),
    ] {
        let unit = std::fs::read_to_string(deploy.join(unit_file)).unwrap();
        let exec = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart=/usr/local/bin/charm "))
            .unwrap();
        let args: Vec<String> = exec
            .replace("${CHARM_LISTEN}", "127.0.0.1:0")
            .replace("${CHARM_MODEL}", "/nonexistent-model")
            .replace("${CHARM_RAM_GB}", "2")
            .replace("%i", "w1")
            .replace("%d", dir.to_str().unwrap())
            .split_whitespace()
            .map(String::from)
            .collect();
        let o = Command::new(env!("CARGO_BIN_EXE_charm"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{unit_file}: {err}");
        assert!(err.contains("nonexistent-model"), "{unit_file}: {err}");
        if Command::new("systemd-analyze")
            .arg("--version")
            .output()
            .is_ok()
        {
            let tmp = dir.join("units");
            std::fs::create_dir_all(&tmp).unwrap();
            std::fs::write(
                tmp.join(unit_file),
                unit.replace("/usr/local/bin/charm", env!("CARGO_BIN_EXE_charm")),
            )
            .unwrap();
            let v = Command::new("systemd-analyze")
                .arg("verify")
                .arg(tmp.join(instance))
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&v.stderr);
            assert!(
                v.status.success() && err.trim().is_empty(),
                "{unit_file}: {err}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_described_cluster_is_planned_from_config_json_alone() {
    // GLM-5.2 from its config.json, no weights: one machine streams experts from its disk, four
    // hold them all in RAM between them
    let dir = scratch("cl-described");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy("tests/data/glm-5.2-config.json", dir.join("config.json")).unwrap();
    let machines = |n: usize, link: f64| {
        let ms: Vec<Value> = (0..n)
            .map(|i| {
                serde_json::json!({"name": format!("m{i}"), "ram_gib": 128, "mem_gb_s": 60,
                                   "disk_gb_s": 3, "link_gbit_s": link, "rtt_ms": 0.1})
            })
            .collect();
        let f = dir.join(format!("machines-{n}-{link}.json"));
        std::fs::write(&f, serde_json::json!({ "machines": ms }).to_string()).unwrap();
        f
    };
    let run_with = |f: &Path, extra: &[&str]| {
        let args = ["--cluster", f.to_str().unwrap(), "--activations", "int8"];
        common::plan_json(&dir, &[&args[..], extra].concat())
    };
    let run = |f: &Path| run_with(f, &[]);
    let one = run(&machines(1, 10.0));
    assert_eq!(one["source"], "config");
    let p1 = &one["prediction"];
    assert_eq!(p1["setup"]["source"], "described");
    assert_eq!(p1["setup"]["nodes"][0]["in_process"], true);
    assert_eq!(p1["token"]["round_trips_ms"].as_f64(), Some(0.0));
    assert!(
        p1["token"]["expert_disk_ms"].as_f64().unwrap() > 0.0,
        "{p1}"
    );
    check_budget(&p1["token"]);
    let four = run(&machines(4, 10.0));
    let p4 = &four["prediction"];
    assert_eq!(p4["setup"]["nodes"].as_array().unwrap().len(), 4);
    check_budget(&p4["token"]);
    assert!(p4["tok_s"].as_f64() > p1["tok_s"].as_f64(), "{p4} vs {p1}");
    // the exact scheme's traffic: top_k result rows back per layer, an activation row (int8
    // codes and a scale per 64) out to each machine a token's experts are on
    let spec = charm_shared::config::ModelSpec::from_dir(&dir).unwrap();
    let (h, k) = (
        spec.hidden_size as f64,
        spec.router.as_ref().unwrap().top_k as f64,
    );
    let layers = four["moe_layers"].as_f64().unwrap();
    // a figure of every machine's, summed
    let links = |p: &Value, what: &str| -> f64 {
        p["links"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l[what].as_f64().unwrap())
            .sum()
    };
    let bytes = links(p4, "bytes_per_token");
    let row_out = h * (1.0 + 4.0 / 64.0);
    assert!(
        bytes > layers * (k * 4.0 * h + row_out) && bytes < layers * (k * 4.0 * h + 4.0 * row_out),
        "{bytes}"
    );
    // a slower link costs line-rate time
    let slow = run(&machines(4, 1.0));
    assert!(
        slow["prediction"]["token"]["transfer_ms"].as_f64().unwrap()
            > 5.0 * p4["token"]["transfer_ms"].as_f64().unwrap()
    );
    // replicas: the room RAM leaves for two copies, used, evens the machines' load out; more
    // than fits reads experts from disk
    let room = p4["replica_room"].as_f64().unwrap();
    assert!(room > 0.0 && room < 1.0, "{room}");
    let share = format!("{:.2}", (room * 100.0).floor() / 100.0);
    let rep = run_with(
        &machines(4, 10.0),
        &["--replicas", "2", "--hot-share", &share],
    );
    let pr = &rep["prediction"];
    assert_eq!(pr["setup"]["replicas"], 2);
    assert_eq!(pr["token"]["expert_disk_ms"].as_f64(), Some(0.0), "{pr}");
    let ms = |p: &Value| p["token"]["expert_compute_ms"].as_f64().unwrap();
    assert!(ms(pr) < 0.95 * ms(p4), "{} against {}", ms(pr), ms(p4));
    let held = links(pr, "held_share");
    assert!(
        (held - (1.0 + share.parse::<f64>().unwrap())).abs() < 0.01,
        "{held}"
    );
    let all = run_with(&machines(4, 10.0), &["--replicas", "2", "--hot-share", "1"]);
    assert!(
        all["prediction"]["token"]["expert_disk_ms"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let (ok, _, err) = charm(&[
        "plan",
        "--model",
        dir.to_str().unwrap(),
        "--cluster",
        machines(4, 10.0).to_str().unwrap(),
        "--replicas",
        "2",
        "--hot-share",
        "1.5",
    ]);
    assert!(!ok && err.contains("--hot-share"), "{err}");
    // a bad description: a clear error
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"machines": [{"name": "a", "ram_gib": -1, "mem_gb_s": 60}]}"#,
    )
    .unwrap();
    let (ok, _, err) = charm(&[
        "plan",
        "--model",
        dir.to_str().unwrap(),
        "--cluster",
        bad.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("ram_gib"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_and_status_show_the_cluster_without_loading_the_model() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-plan");
    let (w1, w2) = (
        Worker::start(&model, &dir, "w1", 0, &[]),
        Worker::start(&model, &dir, "w2", 0, &["--activations", "int8"]),
    );
    // a dead address beside them. No short deadline: the handshake limit is min(deadline,
    // 10 s), and a deadline short enough to give up on the dead address soon would also cut a
    // live worker's handshake on a loaded machine; the dead one gives up at the default limit
    // (or QUIC's idle timeout, if sooner) instead.
    let dead = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let file = dir.join("cluster.json");
    std::fs::write(
        &file,
        serde_json::json!({
            "workers": [w1.addr("w1"), w2.addr("w2"), format!("w3@{}", dead.local_addr().unwrap())],
        })
        .to_string(),
    )
    .unwrap();
    drop(dead);
    let m = model.to_str().unwrap();
    let f = file.to_str().unwrap();
    let (ok, out, err) = charm(&["plan", "--model", m, "--cluster", f, "--json", "--no-probe"]);
    assert!(ok, "{err}");
    let v = json(&out);
    assert!(v.get("prediction").is_none(), "{v}");
    let c = &v["cluster"];
    let spec = charm_shared::config::ModelSpec::from_dir(&model).unwrap();
    let layers = moe_layers(&spec);
    let experts: u64 = layers.iter().map(|l| l.1 as u64).sum();
    let ws = c["workers"].as_array().unwrap();
    assert_eq!(ws.len(), 3, "{c}");
    assert!(ws[0]["experts"].as_u64().unwrap() > 0 && ws[1]["experts"].as_u64().unwrap() > 0);
    assert_eq!(
        ws[0]["experts"].as_u64().unwrap() + ws[1]["experts"].as_u64().unwrap(),
        experts,
        "{c}"
    );
    assert_eq!(ws[2]["connected"], false);
    assert_eq!(c["unplaced_experts"], 0, "{c}");
    let dense_moe = layers.iter().filter(|l| l.0 < spec.layers.len()).count();
    assert_eq!(c["round_trips_per_token"], dense_moe as u64, "{c}");
    let back = c["result_bytes_per_token"].as_u64().unwrap();
    let top_k = spec.router.as_ref().unwrap().top_k;
    assert_eq!(
        back,
        (dense_moe * top_k * spec.hidden_size * 4) as u64,
        "{c}"
    );
    let (ok, text, _) = charm(&["plan", "--model", m, "--cluster", f, "--no-probe"]);
    assert!(
        ok && text.contains("cluster:") && text.contains("round trips"),
        "{text}"
    );

    // probed, in f32 (w2 computes in int8 and refuses): this machine's dense pass and w1's
    // requests give the prediction
    let (ok, out, err) = charm(&[
        "plan",
        "--model",
        m,
        "--cluster",
        f,
        "--json",
        "--draft",
        "2",
    ]);
    assert!(ok, "{err}");
    let v = json(&out);
    let pr = &v["prediction"];
    assert_eq!(pr["setup"]["source"], "probed", "{pr}");
    let nodes = pr["setup"]["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1, "{pr}");
    assert_eq!(nodes[0]["name"], "w1");
    assert_eq!(nodes[0]["share"].as_f64(), Some(1.0));
    // (measured times: present and sane, not compared with any figure)
    let latency = nodes[0]["latency_s"].as_f64().unwrap();
    assert!(latency.is_finite() && latency >= 0.0, "{pr}");
    assert!(nodes[0]["expert_s"].as_f64().unwrap() > 0.0, "{pr}");
    assert!(pr["setup"]["dense_s"].as_f64().unwrap() > 0.0);
    check_budget(&pr["token"]);
    let t = pr["token"]["total_ms"].as_f64().unwrap();
    assert!((pr["tok_s"].as_f64().unwrap() - 1e3 / t).abs() < 1e-6 * 1e3 / t);
    let sp = &pr["speculative"];
    assert_eq!(sp["draft"], 2);
    assert!((sp["tokens_per_step"].as_f64().unwrap() - (1.0 + 0.7 + 0.49)).abs() < 1e-9);
    check_budget(&sp["step"]);
    let (ok, text, _) = charm(&["plan", "--model", m, "--cluster", f]);
    assert!(
        ok && text.contains("predicted") && text.contains("bottleneck"),
        "{text}"
    );
    assert!(
        text.contains("w3") && text.contains("unreachable"),
        "{text}"
    );

    let (ok, out, err) = charm(&["cluster", "status", "--model", m, "--cluster", f, "--json"]);
    assert!(ok, "{err}");
    let s = json(&out);
    let ws = s["workers"].as_array().unwrap();
    assert!(
        ws[0]["connected"] == true && ws[1]["connected"] == true,
        "{s}"
    );
    assert!(ws[0]["ping_ms"].as_f64().unwrap() > 0.0, "{s}");
    assert!(ws[0]["expert_rate"].as_f64().unwrap() > 0.0, "{s}");
    assert!(ws[0]["disk_free_bytes"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(ws[2]["connected"], false);
    assert!(
        ws[2]["error"].as_str().unwrap().contains("handshake"),
        "{s}"
    );
    drop((w1, w2));
    // nothing answers: exit 1
    let (ok, _, _) = charm(&["cluster", "status", "--model", m, "--cluster", f]);
    assert!(!ok);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A synthetic GLM-5.2-architecture container (tiny preset, 2 MoE layers) in a fresh directory.
fn synth_tiny(tag: &str) -> PathBuf {
    let d = scratch(tag);
    let (ok, _, err) = charm(&[
        "synth",
        "--out",
        d.to_str().unwrap(),
        "--preset",
        "tiny",
        "--layers",
        "2",
    ]);
    assert!(ok, "{err}");
    d
}

/// A fresh directory holding `files` of `model`.
fn partial_copy(model: &Path, tag: &str, files: &[&str]) -> PathBuf {
    let d = scratch(tag);
    std::fs::create_dir_all(&d).unwrap();
    for f in files {
        std::fs::copy(model.join(f), d.join(f)).unwrap();
    }
    d
}

/// Whole lines of a fetching worker's journal.
fn journal(dir: &Path) -> Vec<(usize, usize)> {
    let text = std::fs::read_to_string(dir.join("shard.log")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (a, b) = l.split_once(' ')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_worker_without_experts_fetches_its_shard_resumes_after_a_kill_and_serves_it() {
    let model = synth_tiny("cl-shard-model");
    // the worker's directory: the config and the manifest, no data files
    let wdir = partial_copy(&model, "cl-shard-worker", &["config.json", "charm.json"]);
    let dir = certs("cl-shard");
    let prompt = [5u32, 17, 3, 99, 100];
    let opts = no_history();
    let want = single_box(&model, &opts, &prompt, 12);

    // killed (abort, as kill -9) once it has stored 5 records
    let mut w = Worker::start_env(
        &wdir,
        &dir,
        "w1",
        0,
        &["--fetch-shard"],
        &[("CHARM_FETCH_ABORT_AFTER", "5")],
    );
    let port = w.port;
    let mut c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![w.addr("w1").parse().unwrap()],
    );
    c.heartbeat = Duration::from_millis(100);
    let e = on_cluster(&model, &opts, c);
    let r = e.remote.clone().unwrap();
    // what the worker lacks runs here meanwhile: the same tokens
    assert_eq!(decode(&e, &prompt, 12, |_| {}), want);
    wait_until("the worker dies mid-transfer", || {
        w.child.try_wait().unwrap().is_some()
    });
    assert_eq!(journal(&wdir).len(), 5);
    let assigned: usize = r.placement().assigned(0).iter().map(|l| l.1.len()).sum();
    assert!(assigned > 5);

    // restarted, it fetches the rest (and nothing twice)
    let _w2 = Worker::start(&wdir, &dir, "w1", port, &["--fetch-shard"]);
    wait_until("the shard is complete", || journal(&wdir).len() == assigned);
    let st = &r.status()[0];
    assert_eq!(st.shard_records_sent, assigned as u64, "{st:?}");
    // every record it holds is the coordinator's, byte for byte
    let c = charm_shared::container::Container::open(&model).unwrap();
    for (layer, expert) in journal(&wdir) {
        let l = c.expert_layers().find(|l| l.layer == layer).unwrap();
        let at = |d: &Path| {
            let b = std::fs::read(d.join(&l.file)).unwrap();
            let o = expert * l.record_bytes as usize;
            b[o..o + l.record_bytes as usize].to_vec()
        };
        assert!(
            at(&model) == at(&wdir),
            "layer {layer} expert {expert} differs"
        );
    }
    // now the worker serves everything: nothing runs here, same tokens
    wait_until("the worker is in use", || r.connected().len() == 1);
    let before = r.fallbacks();
    assert_eq!(decode(&e, &prompt, 12, |_| {}), want);
    assert_eq!(r.fallbacks(), before, "{:?}", r.status());
    drop(e);
    for d in [&model, &wdir, &dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn placement_follows_the_routing_while_serving_without_changing_tokens() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-rebalance");
    let (w1, w2) = (
        Worker::start(&model, &dir, "w1", 0, &[]),
        Worker::start(&model, &dir, "w2", 0, &[]),
    );
    let prompt = oracle_ids("glm5-tiny", "tf_input_ids")[..4].to_vec();
    let opts = no_history();
    let want = single_box(&model, &opts, &prompt, 16);
    let mut c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![
            w1.addr("w1").parse().unwrap(),
            w2.addr("w2").parse().unwrap(),
        ],
    );
    // the hottest eighth of each layer on both workers, placement recomputed every 4 steps
    c.replicas = 2;
    c.hot_share = 0.125;
    c.rebalance_steps = 4;
    let e = on_cluster(&model, &opts, c);
    let r = e.remote.clone().unwrap();
    let (first, n) = (r.placement(), r.placements());
    assert_eq!(decode(&e, &prompt, 16, |_| {}), want);
    assert!(
        r.placements() > n,
        "the routing seen never moved the hot set"
    );
    assert!(*r.placement() != *first);
    assert_eq!(r.fallbacks(), 0);
    drop((w1, w2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_coordinator_without_expert_files_runs_on_its_workers_and_names_what_is_missing() {
    let model = synth_tiny("cl-dense-model");
    // the coordinator's copy: config, manifest and dense skeleton, no expert files
    let coord = partial_copy(
        &model,
        "cl-dense-coord",
        &["config.json", "charm.json", "dense.bin"],
    );
    let dir = certs("cl-dense");
    let (single, _) = generate_json(&model, "5,17,3,99", &[]);
    let (w1, w2) = (
        Worker::start(&model, &dir, "w1", 0, &[]),
        Worker::start(&model, &dir, "w2", 0, &[]),
    );
    let list = workers_arg(&[(&w1, "w1"), (&w2, "w2")]);
    let args = ["--cluster", dir.to_str().unwrap(), "--workers", &list];
    let (g, err) = generate_json(&coord, "5,17,3,99", &args);
    assert_eq!(g["ids"], single["ids"]);
    assert!(err.contains("no expert files"), "{err}");
    all_served_remotely(&g, 2);
    // no worker left: a clear error naming an expert and the missing workers, no hang
    drop((w1, w2));
    let file = dir.join("short.json");
    std::fs::write(
        &file,
        serde_json::json!({ "workers": list.split(',').collect::<Vec<_>>(), "deadline_ms": 1000 })
            .to_string(),
    )
    .unwrap();
    let (ok, _, err) = charm(&[
        "generate",
        "--model",
        coord.to_str().unwrap(),
        "--ids",
        "5,17,3,99",
        "--max-tokens",
        "4",
        "--history",
        "none",
        "--cluster",
        file.to_str().unwrap(),
    ]);
    assert!(!ok);
    for want in ["expert", "unavailable", "w1 (down", "w2 (down"] {
        assert!(err.contains(want), "wanted `{want}` in: {err}");
    }
    for d in [&model, &coord, &dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// A worker that answers the handshake as `w1` of `model` speaking protocol `version` and then
/// answers every compute request with a result of the wrong shape (counted in the returned
/// counter).
fn lying_worker(
    dir: &Path,
    model: &Path,
    version: u32,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
    std::thread::JoinHandle<()>,
) {
    use charm_shared::wire::{ComputeResult, Hello, Message};
    use charm_worker::server::{listen, read_frame, write_frame};
    let id = charm_worker::tls::Identity::load(dir, "w1").unwrap();
    let fingerprint = charm_coordinator::cluster::model_fingerprint(model).unwrap();
    let spec = charm_shared::config::ModelSpec::from_dir(model).unwrap();
    let holds: Vec<charm_shared::wire::LayerExperts> = moe_layers(&spec)
        .iter()
        .map(|&(l, n)| charm_shared::wire::LayerExperts {
            layer: l as u32,
            ids: (0..n as u32).collect(),
        })
        .collect();
    let lies = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let l2 = lies.clone();
    let t = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let ep = listen("127.0.0.1:0".parse().unwrap(), &id).unwrap();
            tx.send(ep.local_addr().unwrap()).unwrap();
            while let Some(inc) = ep.accept().await {
                let Ok(c) = inc.await else { continue };
                let (fp, l3, holds) = (fingerprint.clone(), l2.clone(), holds.clone());
                tokio::spawn(async move {
                    while let Ok((mut s, mut r)) = c.accept_bi().await {
                        let Ok((m, _)) = read_frame(&mut r).await else {
                            continue;
                        };
                        let reply = match m {
                            Message::Hello(_) => Message::Hello(Hello {
                                version,
                                experts: holds.clone(),
                                ..Hello::holding_nothing("w1", &fp, vec!["f32".into()])
                            }),
                            Message::Compute(req) => {
                                l3.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                // one value short
                                let rows: usize = req.runs.iter().map(|r| r.rows.len()).sum();
                                Message::Computed(ComputeResult {
                                    id: req.id,
                                    compute_ns: 0,
                                    out: vec![1e30; rows * req.hidden as usize - 1],
                                })
                            }
                            Message::Ping { seq } => Message::Pong { seq, vram: vec![] },
                            _ => continue,
                        };
                        let _ = write_frame(&mut s, &reply).await;
                    }
                });
            }
        });
    });
    (rx.recv().unwrap(), lies, t)
}

#[test]
fn a_worker_answering_malformed_results_is_dropped_and_changes_no_token() {
    let model = fixture("glm5-tiny");
    let dir = certs("cl-liar");
    let prompt = oracle_ids("glm5-tiny", "tf_input_ids")[..4].to_vec();
    let opts = no_history();
    let want = single_box(&model, &opts, &prompt, 12);
    let (addr, lies, _t) = lying_worker(&dir, &model, charm_shared::wire::PROTOCOL_VERSION);
    let honest = Worker::start(&model, &dir, "w2", 0, &[]);
    let c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![
            WorkerAddr {
                name: "w1".into(),
                addr,
            },
            honest.addr("w2").parse().unwrap(),
        ],
    );
    let e = on_cluster(&model, &opts, c);
    assert!(e.warnings.is_empty(), "{:?}", e.warnings);
    let r = e.remote.clone().unwrap();
    assert_eq!(decode(&e, &prompt, 12, |_| {}), want);
    let st = r.status();
    assert!(
        lies.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "never asked"
    );
    assert!(st[0].failures > 0, "{st:?}");
    assert!(st[1].requests > 0 && st[1].failures == 0, "{st:?}");
    drop(honest);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_worker_speaking_another_protocol_version_is_refused_naming_both_versions() {
    use charm_shared::wire::PROTOCOL_VERSION;
    let model = fixture("glm5-tiny");
    let dir = certs("cl-version");
    let prompt = oracle_ids("glm5-tiny", "tf_input_ids")[..4].to_vec();
    let opts = no_history();
    let want = single_box(&model, &opts, &prompt, 6);
    // a real QUIC + mTLS peer with w1's certificate, for the right model, but another version
    let other = PROTOCOL_VERSION + 1000;
    let (addr, asked, _t) = lying_worker(&dir, &model, other);
    let c = ClusterOptions::new(
        dir.clone(),
        "coordinator",
        vec![WorkerAddr {
            name: "w1".into(),
            addr,
        }],
    );
    let e = on_cluster(&model, &opts, c);
    let r = e.remote.clone().unwrap();
    assert!(r.connected().is_empty(), "{:?}", r.status());
    let st = r.status();
    assert!(!st[0].connected, "{st:?}");
    let why = st[0].error.clone().expect("a refused worker says why");
    // both versions named, as numbers of their own
    let numbers: Vec<&str> = why
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .collect();
    assert!(
        why.contains("protocol version")
            && numbers.contains(&other.to_string().as_str())
            && numbers.contains(&PROTOCOL_VERSION.to_string().as_str()),
        "{why}"
    );
    // the load's warnings name the worker and the same reason
    assert!(
        e.warnings
            .iter()
            .any(|w| w.contains("worker w1") && w.contains(&why)),
        "{:?}",
        e.warnings
    );
    // nothing is sent to it: its experts run here, with the same tokens
    assert_eq!(decode(&e, &prompt, 6, |_| {}), want);
    assert_eq!(asked.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert!(r.fallbacks() > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Speculative decoding across two loopback workers: the same tokens as single-box without
/// drafts (greedy and sampled, MTP and prompt-lookup drafts), every expert served remotely, and
/// the drafts riding in the same per-layer requests (prompt lookup: fewer requests than without
/// drafts).
#[test]
fn drafts_across_two_workers_give_the_single_box_tokens_in_fewer_requests() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe");
    let dir = certs("spec");
    let (w1, w2) = (
        Worker::start(&model, &dir, "w1", 0, &[]),
        Worker::start(&model, &dir, "w2", 0, &[]),
    );
    let two = workers_arg(&[(&w1, "w1"), (&w2, "w2")]);
    let cluster = ["--cluster", dir.to_str().unwrap(), "--workers", &two];
    let ids = "5,17,3,99,250,7,1,42,300,12";
    let run = |extra: &[&str]| {
        let m = model.to_str().unwrap();
        let mut a = vec![
            "generate",
            "--model",
            m,
            "--ids",
            ids,
            "--max-tokens",
            "120",
        ];
        a.extend_from_slice(&["--json", "--history", "none"]);
        a.extend_from_slice(extra);
        let (ok, out, err) = charm(&a);
        assert!(ok, "{a:?}: {err}");
        json(&out)
    };
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "4"],
    ] {
        let single = run(sampling);
        // (drafts are on by default with a cluster)
        let plain = run(&[sampling, &cluster[..], &["--draft", "0"]].concat());
        assert_eq!(plain["ids"], single["ids"]);
        all_served_remotely(&plain, 2);
        let requests = |v: &Value| -> u64 {
            v["stats"]["cluster"]["workers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w["requests"].as_u64().unwrap())
                .sum()
        };
        for source in ["mtp", "lookup"] {
            let d = ["--draft", "3", "--draft-fixed", "--draft-source", source];
            let spec = run(&[sampling, &cluster[..], &d[..]].concat());
            assert_eq!(spec["ids"], single["ids"], "{source} {sampling:?}");
            all_served_remotely(&spec, 2);
            let s = &spec["speculation"];
            assert!(s["drafted"].as_u64().unwrap() > 0, "{s}");
            // prompt lookup adds no expert work: accepted drafts mean fewer layer requests (the
            // MTP layer's own experts are requests too)
            if source == "lookup" && s["accepted"].as_u64().unwrap() > 0 {
                assert!(requests(&spec) < requests(&plain), "{source}: {s}");
            }
        }
    }
    drop((w1, w2));
    std::fs::remove_dir_all(&dir).unwrap();
}
