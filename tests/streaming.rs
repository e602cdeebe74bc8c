//! Single-box streaming: routed experts read from a container on disk through a bounded RAM
//! cache give bit-identical results at every budget, the process stays within its budget, and
//! `charm plan` / `charm doctor` / the routing history behave as documented.

mod common;

use std::path::Path;

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::ops::plan::Plan;
use charm_coordinator::{Engine, EngineOptions, ForwardOptions, HistoryPolicy, Model};
use common::*;
use serde_json::Value;

const GIB: f64 = (1u64 << 30) as f64;

/// Streaming options for `ram` bytes (None: MemAvailable), planning `ctx` tokens.
fn stream(ram: Option<u64>, ctx: usize) -> EngineOptions {
    EngineOptions {
        ram,
        context: ctx,
        batch_tokens: Some(ctx),
        history: HistoryPolicy::Off,
        ..Default::default()
    }
}

/// [`Engine::load`] of a container: the engine and its plan.
fn load_streaming(dir: &Path, o: &EngineOptions) -> (Engine, Plan) {
    let e = Engine::load(dir, o).unwrap();
    let p = e.plan.clone().expect("a container is planned");
    (e, p)
}

fn greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let sp = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        ..Default::default()
    };
    generate(
        m,
        prompt,
        n,
        &mut Sampler::new(sp),
        &[],
        ForwardOptions::default(),
    )
    .unwrap()
    .ids
}

#[test]
fn oracle_fixtures_are_bit_identical_at_every_expert_budget() {
    for name in FIXTURES {
        let dir = scratch(&format!("stream-{name}"));
        let (ok, err) = convert(&fixture(name), &dir, &["--experts", "int8"], None);
        assert!(ok, "{name}: {err}");
        let ids = oracle_ids(name, "tf_input_ids");
        let ctx = ids.len() + 8;
        // reference: every expert decoded into RAM at load (no store)
        let ram = Model::load(&dir).unwrap();
        let want = logits(&ram, &ids);
        let want_tokens = greedy(&ram, &ids[..4], 8);
        drop(ram);
        // the budget arithmetic: resident part plus k experts per MoE layer
        let (probe, p) = load_streaming(&dir, &stream(Some(1 << 40), ctx));
        assert!(p.all_resident, "{name}");
        drop(probe);
        let layers = p.expert_layers as u64;
        for (label, ram) in [
            ("all resident", None),
            (
                "two experts per layer",
                Some(p.resident_bytes + 2 * layers * p.expert_bytes),
            ),
            ("no expert cache", Some(p.resident_bytes)),
        ] {
            let (e, plan) = load_streaming(&dir, &stream(ram, ctx));
            let m = &e.model;
            if ram.is_some() {
                assert!(!plan.all_resident, "{name} {label}");
                assert!(
                    plan.cache_bytes <= 2 * layers * p.expert_bytes,
                    "{name} {label}"
                );
            }
            let got = logits(m, &ids);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} {label}: logits differ (max diff {})",
                max_abs_diff(&got, &want)
            );
            assert_eq!(greedy(m, &ids[..4], 8), want_tokens, "{name} {label}");
            let s = m.experts.stats().unwrap();
            if label == "no expert cache" {
                assert_eq!(plan.cache_bytes, 0, "{name}");
                assert_eq!(s.hits, 0, "{name} {label}: nothing can be cached");
                assert!(s.reads > 0);
            }
            assert!(
                s.cache_peak_bytes <= plan.cache_bytes + e.store.as_ref().unwrap().io_bytes(),
                "{name} {label}: cache peaked at {} bytes over capacity {} + I/O {}",
                s.cache_peak_bytes,
                plan.cache_bytes,
                e.store.as_ref().unwrap().io_bytes()
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn synth(dir: &Path, extra: &[&str]) {
    let mut a = vec!["synth", "--out", dir.to_str().unwrap(), "--preset", "tiny"];
    a.extend_from_slice(extra);
    let (ok, _, err) = charm(&a);
    assert!(ok, "{err}");
}

/// `charm ARGS [--ram GIB]`.
fn charm_ram(args: &[&str], ram: Option<f64>) -> (bool, String, String) {
    let r = ram.map(|g| format!("{g}"));
    let mut a = args.to_vec();
    if let Some(r) = &r {
        a.extend_from_slice(&["--ram", r]);
    }
    charm(&a)
}

/// `charm logits` of `prompt` on `model` into `out` (no routing history, `--ram` when given,
/// `extra` arguments and `env` variables), returning the file's bytes.
fn logits_file(
    model: &str,
    prompt: &str,
    out: &Path,
    ram: Option<f64>,
    extra: &[&str],
    env: &[(&str, String)],
) -> Vec<u8> {
    let mut args = vec!["logits", "--model", model, "--ids", prompt];
    args.extend_from_slice(&["--out", out.to_str().unwrap(), "--history", "none"]);
    args.extend_from_slice(extra);
    let r = ram.map(|g| g.to_string());
    if let Some(r) = &r {
        args.extend_from_slice(&["--ram", r]);
    }
    let (ok, _, err) = charm_env(&args, env);
    assert!(ok, "{args:?} {env:?}: {err}");
    std::fs::read(out).unwrap()
}

#[test]
fn synthetic_model_streams_within_its_budget_with_identical_output() {
    // 3 MoE layers x 48 experts of 3 MiB (int8, hidden 1024, width 1024): 450 MiB of experts
    let dir = scratch("stream-synth");
    synth(
        &dir,
        &[
            "--layers",
            "3",
            "--hidden",
            "1024",
            "--moe-intermediate",
            "1024",
            "--n-experts",
            "48",
            "--top-k",
            "6",
            "--experts",
            "int8",
        ],
    );
    let d = dir.to_str().unwrap();
    let prompt = "5,17,3,99,100,7,8,9";
    let max = 8;
    let p = plan(&dir, 8 + max);
    let resident = p["resident_bytes"].as_u64().unwrap();
    let expert = p["expert_bytes"].as_u64().unwrap();
    let total = p["experts_total_bytes"].as_u64().unwrap();
    assert!(total > 400 << 20, "{p}");
    let run = |ram: Option<f64>, extra: &[&str]| -> Value {
        let (ok, out, err) = charm_ram(
            &[
                &[
                    "generate",
                    "--model",
                    d,
                    "--ids",
                    prompt,
                    "--max-tokens",
                    "8",
                    "--json",
                    "--history",
                    "none",
                ],
                extra,
            ]
            .concat(),
            ram,
        );
        assert!(ok, "{err}");
        json(&out)
    };
    let all = run(None, &[]);
    assert!(
        all["stats"]["experts"]["hits"].as_u64().unwrap() > 0,
        "{all}"
    );
    assert_eq!(all["stats"]["experts"]["misses"], 0, "{all}");
    // a budget holding two experts per layer: far less than the 450 MiB of experts
    let budget = resident + 2 * 3 * expert;
    let small = run(Some(budget as f64 / GIB), &[]);
    assert_eq!(small["ids"], all["ids"]);
    let s = &small["stats"];
    let peak = s["peak_rss_bytes"].as_u64().unwrap();
    assert!(
        peak <= budget,
        "peak RSS {peak} exceeds the budget {budget}: {small}"
    );
    assert!(
        s["experts"]["bytes_read"].as_u64().unwrap() >= 6 * expert,
        "{small}"
    );
    assert!(s["experts"]["misses"].as_u64().unwrap() > 0);
    let trace = dir.join("io.jsonl");
    let none = run(
        Some(resident as f64 / GIB + 1e-9),
        &["--io-trace", trace.to_str().unwrap()],
    );
    assert_eq!(none["ids"], all["ids"]);
    assert_eq!(none["stats"]["experts"]["hits"], 0, "{none}");
    // with nothing cached the disk idles at the start of each step until the first MoE layer's
    // lookahead: the dense layer's early guesses are read then, and some are used
    let e = &none["stats"]["experts"];
    let (early, early_used) = (
        e["early_reads"].as_u64().unwrap(),
        e["early_used"].as_u64().unwrap(),
    );
    assert!(early > 0 && early_used <= early, "{none}");
    let busy = e["disk_busy_seconds"].as_f64().unwrap();
    let wall = none["prefill_seconds"].as_f64().unwrap() + none["decode_seconds"].as_f64().unwrap();
    assert!(busy > 0.0 && busy <= wall + 0.5, "{none}");
    // the I/O timeline: every read of the run, each layer's expert steps, the waits between
    let events: Vec<Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(json)
        .collect();
    let kind = |k: &str| events.iter().filter(|e| e["kind"] == k).collect::<Vec<_>>();
    let reads = kind("read");
    assert_eq!(reads.len() as u64, e["reads"].as_u64().unwrap(), "{none}");
    assert_eq!(
        reads
            .iter()
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum::<u64>(),
        e["bytes_read"].as_u64().unwrap()
    );
    for r in &reads {
        assert!(r["expert"].as_u64().unwrap() < 48, "{r}");
        assert!(
            r["end_s"].as_f64().unwrap() >= r["start_s"].as_f64().unwrap(),
            "{r}"
        );
    }
    // one expert step per MoE layer per forward step (a prefill and 7 decode steps)
    assert_eq!(kind("experts").len(), 3 * 8, "{events:?}");
    assert!(!kind("wait").is_empty());
    assert!(none["stats"]["peak_rss_bytes"].as_u64().unwrap() <= resident + (1 << 20));
    // logits files are byte-identical across budgets
    let files: Vec<Vec<u8>> = [None, Some(budget as f64 / GIB)]
        .iter()
        .enumerate()
        .map(|(i, ram)| {
            let out = dir.join(format!("logits-{i}.safetensors"));
            logits_file(d, prompt, &out, *ram, &[], &[])
        })
        .collect();
    assert!(files[0] == files[1], "logits differ across budgets");
    // a budget below the resident part is refused with what would fit
    let (ok, _, err) = charm(&[
        "generate",
        "--model",
        d,
        "--ids",
        prompt,
        "--ram",
        "0.01",
        "--history",
        "none",
    ]);
    assert!(!ok);
    assert!(
        err.contains("does not fit") && err.contains("--ram"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn int8_activations_give_identical_logits_on_every_isa_and_budget() {
    // The tiny preset's weights tile into the VNNI lane layout (16-row blocks, groups of 64):
    // there, dense weights are rearranged at load and each expert record right after it is read
    // (all resident, or streamed with no expert cache). The row-major kernels of the other ISA
    // paths must give the same bits.
    let dir = scratch("stream-lanes");
    synth(&dir, &["--layers", "2"]);
    let d = dir.to_str().unwrap();
    let prompt = "5,17,3,99,100,7,8,9,200,31,4";
    let resident = plan(&dir, 11)["resident_bytes"].as_u64().unwrap() as f64 / GIB + 1e-9;
    let mut files = Vec::new();
    for (isa, ram) in [
        ("", None),
        ("", Some(resident)),
        ("avx2", None),
        ("avx2", Some(resident)),
        ("scalar", None),
    ] {
        let out = dir.join(format!("logits-{isa}-{}.safetensors", ram.is_some()));
        let env = [("CHARM_ISA", isa.to_string())];
        let f = logits_file(d, prompt, &out, ram, &["--activations", "int8"], &env);
        files.push((isa, ram, f));
    }
    for (isa, ram, f) in &files[1..] {
        assert!(
            *f == files[0].2,
            "logits differ: CHARM_ISA={isa:?} ram {ram:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A synthetic model of two MoE layers in `dir`, streamed by `readers` reader threads with room
/// for `experts` cached experts; with the index of its first MoE layer.
fn small_store(dir: &Path, experts: u64, readers: usize) -> (Engine, Plan, usize) {
    synth(dir, &["--layers", "2"]);
    let mut o = stream(Some(1 << 40), 8);
    o.readers = readers;
    let (probe, p) = load_streaming(dir, &o);
    drop(probe);
    o.ram = Some(p.resident_bytes + experts * p.expert_bytes + p.expert_bytes / 2);
    let (m, p) = load_streaming(dir, &o);
    assert_eq!(p.cache_experts, experts, "{p:?}");
    let layer = m.model.layers.iter().find(|l| l.index > 0).unwrap().index;
    (m, p, layer)
}

/// One forward step of one token through MoE layer `layer` of streamed model `m`, routed to
/// `ids` with equal weights.
fn one_token_step(m: &Engine, layer: usize, ids: &[u32]) {
    use charm_shared::expert::{ExpertBatch, ExpertExecutor};
    let store = m.store.as_ref().expect("a container streams");
    let x = vec![0.01f32; m.model.spec.hidden_size];
    store
        .run(ExpertBatch {
            step: 0,
            layer,
            x: &x,
            n_tokens: 1,
            ids,
            weights: &vec![1.0 / ids.len() as f32; ids.len()],
            top_k: ids.len(),
        })
        .unwrap();
    store.step_end();
}

/// Polls the store's statistics until `ok` holds (a reader thread works at its own pace: on a
/// loaded machine it may take long), failing after a minute; returns the statistics that held.
fn wait_for_stats(
    store: &charm_worker::StreamingExperts,
    what: &str,
    ok: impl Fn(&charm_shared::expert::ExpertStats) -> bool,
) -> charm_shared::expert::ExpertStats {
    use charm_shared::expert::ExpertExecutor;
    let t = std::time::Instant::now();
    loop {
        let s = store.stats().unwrap();
        if ok(&s) {
            return s;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(60),
            "gave up waiting for {what}: {s:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn a_step_needing_experts_only_guessed_early_does_not_wait_forever() {
    // Early guesses are read only while the disk idles; a step that needs one of them before
    // its layer's own lookahead (any caller of the store may skip that) must still get it.
    let dir = scratch("stream-early");
    // no expert cache: every expert comes from disk
    let (m, _, layer) = small_store(&dir, 0, 4);
    let store = m.store.clone().expect("a container streams");
    let hidden = m.model.spec.hidden_size;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use charm_shared::expert::{ExpertBatch, ExpertExecutor};
        // guesses for every expert: the first few fill the I/O allowance, the rest stay queued
        let all: Vec<u32> = (0..32).collect();
        store.prefetch_early(layer, &all);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let x = vec![0.01f32; hidden];
        let r = store.run(ExpertBatch {
            step: 0,
            layer,
            x: &x,
            n_tokens: 1,
            ids: &[31, 30, 29, 28],
            weights: &[0.25; 4],
            top_k: 4,
        });
        let _ = tx.send(r.map(|y| y.len()));
    });
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the step never finished");
    assert_eq!(got.unwrap(), hidden);
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_read_ahead_that_could_only_displace_hotter_experts_is_not_read() {
    // A full cache of experts every step uses: a guess never used before could not displace
    // them, so past the staging room it stays queued unread (read, it would be dropped: a
    // wasted read) and is read when a step asks for it.
    let dir = scratch("stream-room");
    let (m, _, layer) = small_store(&dir, 4, 1);
    let store = m.store.clone().expect("a container streams");
    let step = |ids: &[u32]| one_token_step(&m, layer, ids);
    for _ in 0..3 {
        step(&[0, 1, 2, 3]);
    }
    use charm_shared::expert::ExpertExecutor;
    let before = store.stats().unwrap();
    store.prefetch(layer, &[10, 11, 12, 13], 4);
    // the staging room's read arrives (however loaded the machine)...
    wait_for_stats(&store, "the read ahead into the staging room", |s| {
        s.reads > before.reads
    });
    // ...and no other guess follows it: the reader has nothing else it would take (this pause
    // gives a wrong store time to show an extra read; a slow machine can only hide one, never
    // fail a correct store)
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mid = store.stats().unwrap();
    assert_eq!(
        mid.reads - before.reads,
        1,
        "only the staging room is read ahead: {mid:?}"
    );
    assert_eq!(mid.wasted_reads, 0, "{mid:?}");
    step(&[10, 11, 12, 13]);
    step(&[0, 1, 2, 3]);
    let after = store.stats().unwrap();
    assert_eq!(
        after.reads - before.reads,
        4,
        "each guess read once: {after:?}"
    );
    assert_eq!(after.wasted_reads, 0, "{after:?}");
    assert_eq!(
        after.hits - mid.hits,
        4,
        "the hot experts stayed: {after:?}"
    );
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn less_sure_lookahead_predictions_wait_for_an_idle_disk() {
    // The first `sure` predictions are lookahead reads; the rest are read only while the disk
    // idles (counted as early guesses), and all of them count for the recall figure.
    let dir = scratch("stream-sure");
    let (m, _, layer) = small_store(&dir, 16, 4);
    let store = m.store.clone().expect("a container streams");
    use charm_shared::expert::{ExpertBatch, ExpertExecutor};
    store.prefetch(layer, &[7, 3, 0, 5, 1, 6], 3);
    // nothing else to read: the disk idles, and the rest follows (six experts, each read once)
    let s = wait_for_stats(&store, "all six predictions read", |s| s.reads >= 6);
    assert_eq!(
        (s.lookahead_reads, s.early_reads, s.reads),
        (3, 3, 6),
        "{s:?}"
    );
    let x = vec![0.01f32; m.model.spec.hidden_size];
    store
        .run(ExpertBatch {
            step: 0,
            layer,
            x: &x,
            n_tokens: 1,
            ids: &[7, 0, 5, 2],
            weights: &[0.25; 4],
            top_k: 4,
        })
        .unwrap();
    let s = store.stats().unwrap();
    assert_eq!(s.lookahead_predicted_used, 3, "{s:?}");
    assert_eq!(s.early_used, 1, "{s:?}");
    assert_eq!((s.hits, s.misses), (3, 1), "{s:?}");
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_routing_history_seeds_usage_frequencies() {
    // With nothing pinned, a cache of 4 holds experts the history says run often; newcomers
    // this run has seen once do not displace them (with frequencies starting at zero they
    // would: equal counts, least recently used first).
    let dir = scratch("stream-seed");
    let hist = dir.with_extension("history.json");
    let (m, p, layer) = small_store(&dir, 4, 4);
    drop(m);
    let mut o = stream(Some(p.budget_bytes), 8);
    o.history = HistoryPolicy::File(hist.clone());
    o.pin_fraction = 0.0;
    let (m, _) = load_streaming(&dir, &o);
    for _ in 0..8 {
        one_token_step(&m, layer, &[0, 1, 2, 3]);
    }
    m.store.as_ref().unwrap().save_history().unwrap();
    drop(m);
    let (m, _) = load_streaming(&dir, &o);
    let store = m.store.clone().unwrap();
    use charm_shared::expert::ExpertExecutor;
    assert_eq!(store.stats().unwrap().pinned, 0);
    one_token_step(&m, layer, &[0, 1, 2, 3]);
    one_token_step(&m, layer, &[8, 9, 10, 11]);
    let before = store.stats().unwrap();
    one_token_step(&m, layer, &[0, 1, 2, 3]);
    let after = store.stats().unwrap();
    assert_eq!(after.hits - before.hits, 4, "{after:?}");
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_file(&hist).unwrap();
}

#[test]
fn iobench_reads_a_scratch_file_beside_a_memory_load() {
    let dir = scratch("iobench");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let args = [
        "iobench",
        "--dir",
        d,
        "--file-gib",
        "0.03",
        "--block-mib",
        "1",
    ];
    let (ok, out, err) = charm(
        &[
            &args[..],
            &["--seconds", "0.3", "--memory-load", "1"],
            &["--json"],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    let v = json(&out);
    for k in [
        "bytes_per_s",
        "reads",
        "threads",
        "direct",
        "memory_load_bytes_per_s",
    ] {
        assert!(v.get(k).is_some(), "{k} missing: {v}");
    }
    assert!(v["reads"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["memory_load_threads"], 1, "{v}");
    assert!(v["memory_load_bytes_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["pages"], "huge", "{v}");
    // the scratch file is removed afterwards
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // reads into 4 KiB pages, for comparison
    let (ok, out, err) =
        charm(&[&args[..], &["--seconds", "0.2", "--small-pages", "--json"]].concat());
    assert!(ok, "{err}");
    let v = json(&out);
    assert_eq!(v["pages"], "small", "{v}");
    assert!(v["reads"].as_u64().unwrap() > 0, "{v}");
    let (ok, _, err) = charm(&[&args[..], &["--memory-load", "65"]].concat());
    assert!(!ok && err.contains("--memory-load"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_plans_as_its_conversion_will() {
    // `charm plan` of a Hugging Face checkpoint (headers only) predicts what the container
    // `charm convert` makes from it with the same formats will plan: every figure equal.
    let plan_of = |dir: &Path, extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            dir.to_str().unwrap(),
            "--ram",
            "0.1035",
            "--ctx",
            "64",
            "--history",
            "none",
            "--json",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = charm(&args);
        assert!(ok, "{out}{err}");
        json(&out)
    };
    for (name, formats) in [
        ("glm5-tiny", &[][..]),
        (
            "qwen3moe-tiny",
            &["--experts", "int2", "--dense", "bf16"][..],
        ),
        (
            "deepseek3-tiny",
            &["--experts", "int8", "--group", "32"][..],
        ),
        // FP8 weights with block scales, which the converter dequantizes
        ("glm5-small-fp8", &[][..]),
    ] {
        let src = fixture(name);
        let out = scratch(&format!("plan-ck-{name}"));
        assert!(convert(&src, &out, formats, None).0, "{name}");
        // and from its config.json alone, as a user plans before downloading the weights
        let cfg = scratch(&format!("plan-cfg-{name}"));
        std::fs::create_dir_all(&cfg).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap())
                .unwrap();
        if name == "deepseek3-tiny" {
            // its config announces an MTP layer the checkpoint does not ship (a config-only
            // plan counts an announced one, as DeepSeek-V3's and GLM's checkpoints carry it)
            config["num_nextn_predict_layers"] = serde_json::json!(0);
        }
        std::fs::write(cfg.join("config.json"), config.to_string()).unwrap();
        let mut a = plan_of(&src, formats);
        let mut b = plan_of(&out, &[]);
        let mut c = plan_of(&cfg, formats);
        assert_eq!(a["source"], "checkpoint");
        assert_eq!(b["source"], "container");
        assert_eq!(c["source"], "config");
        for v in [&mut a, &mut b, &mut c] {
            let o = v.as_object_mut().unwrap();
            o.remove("model");
            o.remove("source");
            o.remove("mem_available_bytes");
        }
        assert_eq!(a, b, "{name} {formats:?}");
        assert_eq!(a, c, "{name} {formats:?} from config.json alone");
        assert!(a["container_bytes"].as_u64().unwrap() > 0);
        std::fs::remove_dir_all(&out).unwrap();
        std::fs::remove_dir_all(&cfg).unwrap();
    }
}

#[test]
fn plan_and_doctor_report_json_with_stable_ids_and_exit_codes() {
    let dir = scratch("stream-doctor");
    synth(&dir, &["--layers", "2"]);
    let d = dir.to_str().unwrap();
    let p = plan(&dir, 4096);
    for k in [
        "budget_bytes",
        "dense_bytes",
        "kv_bytes",
        "resident_bytes",
        "cache_experts",
        "cache_experts_per_layer",
        "expected_cold_bytes_per_token",
        "bottleneck",
        "fits",
    ] {
        assert!(p.get(k).is_some(), "plan lacks {k}: {p}");
    }
    assert_eq!(p["fits"], true);
    assert_eq!(p["all_resident"], true);
    let (ok, out, _) = charm(&["plan", "--model", d, "--ram", "0.01", "--history", "none"]);
    assert!(!ok);
    assert!(out.contains("does not fit"), "{out}");

    let (ok, out, err) = charm(&[
        "doctor",
        "--model",
        d,
        "--json",
        "--deep",
        "--history",
        "none",
    ]);
    assert!(ok, "{out}{err}");
    let r = json(&out);
    assert_eq!(r["runnable"], true);
    let ids: Vec<&str> = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    for id in [
        "model.config",
        "model.container",
        "model.files",
        "model.checksums",
        "ram.budget",
        "fs.o_direct",
        "disk.read_speed",
        "mem.huge_pages",
        "cpu.isa",
    ] {
        assert!(ids.contains(&id), "doctor lacks {id}: {out}");
    }
    // --deep measured reads into huge and into 4 KiB pages (where the mode is known)
    let hp = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "mem.huge_pages")
        .unwrap();
    if hp["status"] != "skip" {
        for k in ["huge_pages_bytes_per_s", "small_pages_bytes_per_s"] {
            assert!(hp["data"][k].as_f64().unwrap() > 0.0, "{hp}");
        }
    }
    let status = |r: &Value, id: &str| -> String {
        r["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .map(|c| c["status"].as_str().unwrap().to_string())
            .unwrap()
    };
    assert_eq!(status(&r, "model.checksums"), "ok");
    // a damaged expert record: --deep finds it, generate refuses it with a clear error
    let f = dir.join("experts-002.bin");
    let manifest = json(&std::fs::read_to_string(dir.join("charm.json")).unwrap());
    let record = manifest["experts"][1]["record_bytes"].as_u64().unwrap() as usize;
    assert_eq!(manifest["experts"][1]["layer"], 2);
    let mut b = std::fs::read(&f).unwrap();
    b[5 * record + 100] ^= 0x40;
    std::fs::write(&f, &b).unwrap();
    let (ok, out, _) = charm(&[
        "doctor",
        "--model",
        d,
        "--json",
        "--deep",
        "--history",
        "none",
    ]);
    assert!(!ok, "{out}");
    assert_eq!(status(&json(&out), "model.checksums"), "fail");
    let (ok, out, _) = charm(&["doctor", "--model", d, "--json", "--history", "none"]);
    assert!(ok, "without --deep checksums are not read: {out}");
    // every expert fits, so all are read at load and the damage is reported before any token
    let (ok, _, err) = charm(&[
        "generate",
        "--model",
        d,
        "--ids",
        "1,2,3",
        "--history",
        "none",
    ]);
    assert!(!ok);
    assert!(
        err.contains("CRC-32") && err.contains("layer 2 expert 5"),
        "{err}"
    );
    // a checkpoint directory runs with everything in RAM: a warning, and a RAM check
    let ck = fixture("glm5-tiny");
    let (ok, out, _) = charm(&["doctor", "--model", ck.to_str().unwrap(), "--json"]);
    assert!(ok, "{out}");
    assert_eq!(status(&json(&out), "model.container"), "warn");
    let (ok, out, _) = charm(&[
        "doctor",
        "--model",
        ck.to_str().unwrap(),
        "--json",
        "--ram",
        "0.0001",
    ]);
    assert!(!ok, "{out}");
    assert_eq!(status(&json(&out), "ram.budget"), "fail");
    // not a model at all, and bad usage
    let missing = dir.join("nope");
    let (ok, out, _) = charm(&["doctor", "--model", missing.to_str().unwrap()]);
    assert!(!ok && out.contains("FAIL"), "{out}");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["doctor", "--bogus"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["doctor", "--model", missing.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn routing_history_pins_experts_and_refuses_another_model() {
    let a = scratch("stream-hist-a");
    let b = scratch("stream-hist-b");
    synth(&a, &["--layers", "2"]);
    synth(&b, &["--layers", "2", "--seed", "2"]);
    let hdir = scratch("stream-hist-h");
    let h = hdir.join("history.json");
    let p = plan(&a, 40);
    let budget = (p["resident_bytes"].as_u64().unwrap() + 8 * p["expert_bytes"].as_u64().unwrap())
        as f64
        / GIB;
    let run = |m: &Path| {
        charm(&[
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--ids",
            "5,6,7,8,9,10,11,12",
            "--max-tokens",
            "32",
            "--json",
            "--ram",
            &format!("{budget}"),
            "--history",
            h.to_str().unwrap(),
        ])
    };
    let (ok, out, err) = run(&a);
    assert!(ok, "{err}");
    let first = json(&out);
    assert_eq!(first["stats"]["experts"]["pinned"], 0, "no history yet");
    let hist = json(&std::fs::read_to_string(&h).unwrap());
    assert_eq!(hist["steps"], 32);
    let (ok, out, err) = run(&a);
    assert!(ok, "{err}");
    let second = json(&out);
    assert!(
        second["stats"]["experts"]["pinned"].as_u64().unwrap() > 0,
        "{second}"
    );
    assert_eq!(second["ids"], first["ids"]);
    assert_eq!(json(&std::fs::read_to_string(&h).unwrap())["steps"], 64);
    // written atomically: only the history file is left
    assert_eq!(std::fs::read_dir(&hdir).unwrap().count(), 1);
    let (ok, _, err) = run(&b);
    assert!(!ok);
    assert!(err.contains("another model"), "{err}");
    for d in [a, b, hdir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn two_activation_modes_in_one_process_match_two_processes() {
    // The activation mode is a load option of each model: an f32 and an int8 model loaded side
    // by side (weights in different layouts where the VNNI path runs) each give the bits the
    // command line gives for its mode in a process of its own.
    use charm_shared::quant::Activations;
    let dir = scratch("two-modes");
    synth(&dir, &["--layers", "2"]);
    let ids = [5u32, 17, 3, 99, 100, 7, 8, 9];
    let load = |activations| {
        Engine::load(
            &dir,
            &EngineOptions {
                activations,
                ..stream(None, 16)
            },
        )
        .unwrap()
    };
    let int8 = load(Activations::Int8);
    let f32 = load(Activations::F32);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let got_int8 = bits(&logits(&int8.model, &ids));
    let got_f32 = bits(&logits(&f32.model, &ids));
    assert_eq!(bits(&logits(&int8.model, &ids)), got_int8);
    assert_ne!(got_int8, got_f32, "the two modes should round differently");
    let list = ids.map(|i| i.to_string()).join(",");
    for (mode, got) in [("int8", &got_int8), ("f32", &got_f32)] {
        let out = dir.join(format!("logits-{mode}.safetensors"));
        let (ok, _, err) = charm(&[
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            &list,
            "--out",
            out.to_str().unwrap(),
            "--activations",
            mode,
            "--mla",
            "absorbed",
            "--history",
            "none",
        ]);
        assert!(ok, "{err}");
        let (_, want) = tensor_f32(&out, "logits");
        assert!(bits(&want) == *got, "{mode}: in-process logits differ");
    }
    drop((int8, f32));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_budget_holds_at_peak_with_glm52_dense_shapes() {
    // GLM-5.2's dense shapes (hidden 6144, a 154880-token vocabulary: embedding and head of 0.9
    // GiB each at int8) with few small experts, so the file stays about 2 GiB. Loading used to
    // hold each dense tensor twice (the read buffer and its copy): the peak then passed the
    // budget by the largest tensor, which the tiny shapes of the other tests cannot show.
    let dir = scratch("stream-glm-dense");
    let _gone = RemoveOnDrop(dir.clone());
    let (ok, _, err) = charm(&[
        "synth",
        "--out",
        dir.to_str().unwrap(),
        "--layers",
        "1",
        "--dense-layers",
        "0",
        "--n-experts",
        "16",
        "--moe-intermediate",
        "256",
        "--top-k",
        "4",
    ]);
    assert!(ok, "{err}");
    let prompt = "5,17,3";
    let p = plan(&dir, 5);
    let resident = p["resident_bytes"].as_u64().unwrap();
    let expert = p["expert_bytes"].as_u64().unwrap();
    // room for four experts: most are streamed
    let ram = format!("{}", (resident + 4 * expert) as f64 / GIB);
    for act in ["f32", "int8"] {
        let (ok, out, err) = charm(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--ids",
            prompt,
            "--max-tokens",
            "2",
            "--ram",
            &ram,
            "--history",
            "none",
            "--activations",
            act,
            "--json",
        ]);
        assert!(ok, "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let s = &v["stats"];
        let (peak, budget) = (
            s["peak_rss_bytes"].as_u64().unwrap(),
            s["budget_bytes"].as_u64().unwrap(),
        );
        assert!(s["experts"]["reads"].as_u64().unwrap() > 0, "{act}: {s}");
        assert!(
            peak <= budget,
            "{act}: peak RSS {:.3} GiB over the budget of {:.3} GiB",
            peak as f64 / GIB,
            budget as f64 / GIB
        );
    }
}

/// A layer's shared part run beside the store's experts (`start_beside`) gives the store's own
/// answer and the part's, bit for bit, whether the experts must be read first (the part then
/// runs on its own) or are resident (one loop for both).
#[test]
fn the_shared_part_beside_the_experts_changes_no_bit() {
    use charm_shared::expert::{ExpertBatch, ExpertExecutor, ExpertStats};
    let dir = scratch("stream-beside");
    let (m, _, layer) = small_store(&dir, 2, 1);
    let store = m.store.as_ref().expect("a container streams");
    let h = m.model.spec.hidden_size;
    let x: Vec<f32> = (0..2 * h)
        .map(|i| ((i * 7) % 13) as f32 / 100.0 - 0.06)
        .collect();
    let local = || x.iter().map(|v| v * 3.0).collect::<Vec<f32>>();
    let stats = || store.stats().expect("a store keeps statistics");
    // then experts the cache does not take in place of the hotter first two: read every time
    for (ids, warms) in [([0u32, 1, 1, 0], true), ([2, 3, 3, 2], false)] {
        let batch = || ExpertBatch {
            step: 0,
            layer,
            x: &x,
            n_tokens: 2,
            ids: &ids,
            weights: &[0.75, 0.25, 0.5, 0.5],
            top_k: 2,
        };
        let beside = |resident: bool| {
            let before: ExpertStats = stats();
            let (pending, y) = store.start_beside(batch(), &local);
            let r = pending.wait().unwrap();
            let d = stats().since(&before);
            let read = if resident { d.misses } else { d.hits };
            assert_eq!(read, 0, "experts {ids:?}, resident {resident}: {d:?}");
            assert_eq!(y, local(), "the shared part with experts {ids:?}");
            store.step_end();
            r
        };
        let cold = beside(false);
        let want = store.run(batch()).unwrap();
        store.step_end();
        assert_eq!(cold, want, "experts {ids:?} read first");
        if warms {
            assert_eq!(beside(true), want, "experts {ids:?} resident");
        }
    }
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_grown_cache_holds_more_experts_and_reads_them_all_once_they_fit() {
    // what a store gets when the dense weights move to a GPU: a cache of 4 experts grows by 4,
    // then by enough for every expert, which are then read without being asked for
    let dir = scratch("stream-grow");
    let (m, p, layer) = small_store(&dir, 4, 2);
    let store = m.store.clone().expect("a container streams");
    use charm_shared::expert::ExpertExecutor;
    assert!(store.lookahead().is_some());
    let cap = |s: &charm_worker::StreamingExperts| s.stats().unwrap().cache_capacity_bytes;
    let before = cap(&store);
    store.grow_cache(4 * p.expert_bytes);
    assert_eq!(cap(&store), before + 4 * p.expert_bytes);
    // eight experts of one layer, used twice: all stay (a cache of 4 would evict)
    let ids: Vec<u32> = (0..8).collect();
    one_token_step(&m, layer, &ids);
    let first = store.stats().unwrap();
    one_token_step(&m, layer, &ids);
    let second = store.stats().unwrap().since(&first);
    assert_eq!((second.hits, second.misses), (8, 0), "{second:?}");
    // room for every expert: no more lookahead, and the rest are read in the background
    store.grow_cache(p.experts_total_bytes);
    assert!(store.lookahead().is_none());
    let total = p.experts_total_bytes / p.expert_bytes;
    let s = wait_for_stats(&store, "every expert read", |s| {
        s.cache_bytes >= total * p.expert_bytes
    });
    assert!(s.cache_bytes <= s.cache_capacity_bytes, "{s:?}");
    drop(m);
    std::fs::remove_dir_all(&dir).unwrap();
}
