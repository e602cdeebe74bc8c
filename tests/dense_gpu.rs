//! The dense skeleton on the GPU (`--dense-device gpu`) against the CPU, bit for bit: logits of
//! prefill, cached decode and batched sequences at different depths on the GQA oracle fixture,
//! with f32 weights and activations and with a container on the integer path (int8
//! activations), with routed experts on the CPU and in VRAM; a KV cache written by one device
//! resumed on the other; the CLI's tokens; models the GPU path does not take yet refused by
//! `gpu` and left on the CPU by `auto`; the router lookahead's predictions, equal to the CPU
//! pass's. On a machine without a Vulkan or Metal adapter these tests
//! say so and pass, unless `CHARM_REQUIRE_GPU=1` (CI, on Mesa's lavapipe) makes that a failure.

mod common;

use std::sync::{Arc, Mutex};

use charm_coordinator::model::cache::KvCache;
use charm_coordinator::model::engine::DenseDevice;
use charm_coordinator::model::forward::Step;
use charm_coordinator::{
    Engine, EngineOptions, ForwardOptions, HistoryPolicy, MlaMode, Model, Trace,
};
use charm_shared::expert::{ExpertBatch, ExpertError, ExpertExecutor, LookaheadPolicy};
use charm_shared::quant::Activations;
use charm_worker::gpu::Gpu;
use common::{fixture, oracle_ids, scratch};

const GQA: &str = "qwen3moe-tiny";

fn device() -> Option<Arc<Gpu>> {
    match Gpu::open(None) {
        Ok(g) => Some(Arc::new(g)),
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

/// Panics naming the first value whose bits differ.
fn same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!(
            "{what}: value {i} differs: {} (GPU) against {} (CPU)",
            a[i], b[i]
        );
    }
}

/// Logits of `tokens` after what `cache` holds.
fn step(m: &Model, tokens: &[u32], cache: &mut KvCache) -> Vec<f32> {
    step_with(m, tokens, cache, ForwardOptions::default())
}

fn step_with(m: &Model, tokens: &[u32], cache: &mut KvCache, opts: ForwardOptions) -> Vec<f32> {
    let h = m.forward(tokens, cache, opts, None).unwrap();
    m.logits(&h, tokens.len()).unwrap()
}

/// Prefill, then cached decode one token at a time, then two sequences at different depths in
/// one batch: the GPU model `g` against the CPU model `c`, every logit's bits.
fn compare(c: &Model, g: &Model, ids: &[u32], what: &str) {
    compare_with(c, g, ids, ForwardOptions::default(), what)
}

fn compare_with(c: &Model, g: &Model, ids: &[u32], opts: ForwardOptions, what: &str) {
    let (mut cc, mut gc) = (KvCache::new(&c.spec), KvCache::new(&g.spec));
    let split = ids.len() / 2;
    same(
        &step_with(g, &ids[..split], &mut gc, opts),
        &step_with(c, &ids[..split], &mut cc, opts),
        &format!("{what}: prefill of {split}"),
    );
    for (i, t) in ids[split..].iter().enumerate() {
        same(
            &step_with(g, &[*t], &mut gc, opts),
            &step_with(c, &[*t], &mut cc, opts),
            &format!("{what}: cached decode at {}", split + i),
        );
    }
    // the caches themselves (the GPU's entries come back to the CPU's copy)
    for (l, (a, b)) in gc.layers.iter().zip(&cc.layers).enumerate() {
        same(&a.kv, &b.kv, &format!("{what}: KV of layer {l}"));
        same(
            &a.index_keys,
            &b.index_keys,
            &format!("{what}: indexer keys of layer {l}"),
        );
    }
    // a batch: one sequence deep in its cache, one fresh prompt of three tokens
    let run = |m: &Model| {
        let mut deep = KvCache::new(&m.spec);
        step_with(m, &ids[..ids.len() - 1], &mut deep, opts);
        let mut fresh = KvCache::new(&m.spec);
        let last = [ids[ids.len() - 1]];
        let mut steps = [
            Step {
                tokens: &last,
                cache: &mut deep,
            },
            Step {
                tokens: &ids[..3],
                cache: &mut fresh,
            },
        ];
        let h = m.forward_batch(&mut steps, opts, None).unwrap();
        m.logits(&h, 4).unwrap()
    };
    same(
        &run(g),
        &run(c),
        &format!("{what}: a batch of two sequences"),
    );
}

#[test]
fn the_gqa_fixture_gives_the_cpu_bits_with_the_dense_skeleton_on_the_gpu() {
    let Some(gpu) = device() else { return };
    let dir = fixture(GQA);
    let cpu = Model::load(&dir).unwrap();
    let mut on_gpu = Model::load(&dir).unwrap();
    let bytes = on_gpu.attach_dense_gpu(gpu).unwrap();
    assert!(bytes > 0);
    let ids = oracle_ids(GQA, "tf_input_ids");
    compare(&cpu, &on_gpu, &ids, GQA);
}

#[test]
fn every_oracle_fixture_in_every_attention_mode_gives_the_cpu_bits() {
    let Some(gpu) = device() else { return };
    for name in common::FIXTURES {
        let dir = fixture(name);
        let cpu = Model::load(&dir).unwrap();
        let mut g = Model::load(&dir).unwrap();
        g.attach_dense_gpu(gpu.clone()).unwrap();
        let ids = oracle_ids(name, "tf_input_ids");
        for mla in [MlaMode::Naive, MlaMode::Absorbed, MlaMode::AbsorbedSplit] {
            let opts = ForwardOptions { mla };
            compare_with(&cpu, &g, &ids, opts, &format!("{name} {mla:?}"));
            // the traced picks: routers and DSA selections
            let (mut tc, mut tg) = (Trace::default(), Trace::default());
            cpu.forward(&ids, &mut KvCache::new(&cpu.spec), opts, Some(&mut tc))
                .unwrap();
            g.forward(&ids, &mut KvCache::new(&g.spec), opts, Some(&mut tg))
                .unwrap();
            assert_eq!(tg.dsa, tc.dsa, "{name} {mla:?}: DSA selections");
            assert_eq!(tg.router.len(), tc.router.len());
            for (a, b) in tg.router.iter().zip(&tc.router) {
                for ((ia, wa), (ib, wb)) in a.iter().zip(b) {
                    assert_eq!(ia, ib, "{name}: routed experts");
                    same(wa, wb, &format!("{name}: gate weights"));
                }
            }
            for (l, (a, b)) in tg.layer_out.iter().zip(&tc.layer_out).enumerate() {
                same(a, b, &format!("{name} {mla:?}: layer {l} output"));
            }
        }
        // the MTP head: draft logits and states of a chain of drafts after a prompt
        if cpu.mtp.is_some() {
            let run = |m: &Model| {
                let mut main = KvCache::new(&m.spec);
                let normed = m
                    .forward(&ids, &mut main, ForwardOptions::default(), None)
                    .unwrap();
                let h = m.spec.hidden_size;
                let mut cache = KvCache::with_layers(&m.spec, 1);
                let (mut out, mut state) = (Vec::new(), Vec::new());
                // the prompt's states with the next tokens, then two chained drafts
                let (l, hid) = m
                    .mtp_forward_hidden(&ids[1..], &normed[..(ids.len() - 1) * h], &mut cache)
                    .unwrap();
                out.extend(l);
                state.extend(hid);
                for t in [5u32, 9] {
                    let last = state[state.len() - h..].to_vec();
                    let (l, hid) = m.mtp_forward_hidden(&[t], &last, &mut cache).unwrap();
                    out.extend(l);
                    state.extend(hid);
                }
                (out, state)
            };
            let (gl, gs) = run(&g);
            let (cl, cs) = run(&cpu);
            same(&gl, &cl, &format!("{name}: MTP draft logits"));
            same(&gs, &cs, &format!("{name}: MTP states"));
        }
    }
}

#[test]
fn a_cache_written_on_one_device_continues_on_the_other() {
    let Some(gpu) = device() else { return };
    let dir = fixture(GQA);
    let cpu = Model::load(&dir).unwrap();
    let mut g = Model::load(&dir).unwrap();
    g.attach_dense_gpu(gpu).unwrap();
    let ids = oracle_ids(GQA, "tf_input_ids");
    let (head, tail) = ids.split_at(ids.len() - 2);
    let mut reference = KvCache::new(&cpu.spec);
    step(&cpu, head, &mut reference);
    let want = step(&cpu, tail, &mut reference);
    // written on the GPU, resumed on the CPU
    let mut c = KvCache::new(&g.spec);
    step(&g, head, &mut c);
    same(
        &step(&cpu, tail, &mut c),
        &want,
        "GPU cache resumed on the CPU",
    );
    // written on the CPU (a clone carries no VRAM copy), resumed on the GPU
    let mut c = KvCache::new(&cpu.spec);
    step(&cpu, head, &mut c);
    same(
        &step(&g, tail, &mut c.clone()),
        &want,
        "CPU cache resumed on the GPU",
    );
    // cut back on the GPU (a rejected draft) and continued: the VRAM copy follows the cut
    let mut c = KvCache::new(&g.spec);
    step(&g, &ids, &mut c);
    c.truncate(head.len());
    same(
        &step(&g, tail, &mut c),
        &want,
        "GPU cache truncated and continued",
    );
}

/// A container with int4 experts and int8 dense weights, loaded with int8 activations: the
/// dense matrices on the integer path.
/// A prediction handed to the executor: (early guess, layer, ids, how many are sure).
type Prediction = (bool, usize, Vec<u32>, usize);

/// The real executor, with every prediction the forward pass hands it recorded: as a streaming
/// store that wants them (`lookahead` answers a policy), whatever `inner` is.
#[derive(Debug)]
struct Predictions {
    inner: Arc<dyn ExpertExecutor>,
    seen: Mutex<Vec<Prediction>>,
}

impl ExpertExecutor for Predictions {
    fn run(&self, batch: ExpertBatch<'_>) -> Result<Vec<f32>, ExpertError> {
        self.inner.run(batch)
    }
    fn lookahead(&self) -> Option<LookaheadPolicy> {
        Some(LookaheadPolicy {
            sure_num: 5,
            sure_den: 8,
            early_max_tokens: 4,
            early_rank_div: 4,
        })
    }
    fn prefetch(&self, layer: usize, ids: &[u32], sure: usize) {
        let mut s = self.seen.lock().unwrap();
        s.push((false, layer, ids.to_vec(), sure));
    }
    fn prefetch_early(&self, layer: usize, ids: &[u32]) {
        let mut s = self.seen.lock().unwrap();
        s.push((true, layer, ids.to_vec(), 0));
    }
}

#[test]
fn the_router_lookahead_predicts_what_the_cpu_pass_predicts_with_the_dense_skeleton_on_the_gpu() {
    if device().is_none() {
        return;
    }
    // a dense first layer (early guesses at the next MoE layer, up to four rows), then MoE
    // layers; MLA, and DSA
    for name in ["deepseek3-tiny", "glm5-tiny"] {
        let ids = oracle_ids(name, "tf_input_ids");
        let run = |dense| {
            let mut e = Engine::load(
                &fixture(name),
                &EngineOptions {
                    dense_device: dense,
                    ..Default::default()
                },
            )
            .unwrap();
            let rec = Arc::new(Predictions {
                inner: e.model.experts.clone(),
                seen: Mutex::new(Vec::new()),
            });
            e.model.experts = rec.clone();
            let m = &e.model;
            assert_eq!(m.dense_gpu.is_some(), dense == DenseDevice::Gpu);
            // prefills of 3 and of 13 rows (no early guess past four), then decode
            let mut cache = KvCache::new(&m.spec);
            let mut logits = step(m, &ids[..3], &mut cache);
            logits.extend(step(m, &ids[3..16], &mut cache));
            for t in &ids[16..20] {
                logits.extend(step(m, &[*t], &mut cache));
            }
            let seen = std::mem::take(&mut *rec.seen.lock().unwrap());
            (logits, seen)
        };
        let (cl, cs) = run(DenseDevice::Cpu);
        let (gl, gs) = run(DenseDevice::Gpu);
        same(&gl, &cl, name);
        assert!(
            cs.iter().any(|p| p.0) && cs.iter().any(|p| !p.0),
            "{name}: {cs:?}"
        );
        assert_eq!(
            gs, cs,
            "{name}: the GPU pass's predictions against the CPU pass's"
        );
    }
    // and a streaming store wanting them gets them: as many of the experts used had a
    // prediction, and as many were predicted, as on the CPU
    let name = "deepseek3-tiny";
    let dir = scratch("dense-gpu-stream");
    let (ok, err) = common::convert(&fixture(name), &dir, &["--experts", "int8"], None);
    assert!(ok, "{err}");
    let ids = oracle_ids(name, "tf_input_ids");
    let ctx = ids.len() + 8;
    let opts = |ram: u64, dense| EngineOptions {
        ram: Some(ram),
        context: ctx,
        batch_tokens: Some(ctx),
        history: HistoryPolicy::Off,
        dense_device: dense,
        ..Default::default()
    };
    let plan = Engine::load(&dir, &opts(1 << 40, DenseDevice::Cpu))
        .unwrap()
        .plan
        .expect("a container is planned");
    let ram = plan.resident_bytes + 2 * plan.expert_layers as u64 * plan.expert_bytes;
    let run = |dense| {
        let e = Engine::load(&dir, &opts(ram, dense)).unwrap();
        let m = &e.model;
        let mut cache = KvCache::new(&m.spec);
        let mut logits = step(m, &ids[..8], &mut cache);
        for t in &ids[8..] {
            logits.extend(step(m, &[*t], &mut cache));
        }
        (logits, m.experts.stats().expect("a streaming store"))
    };
    let (cl, cs) = run(DenseDevice::Cpu);
    let (gl, gs) = run(DenseDevice::Gpu);
    same(&gl, &cl, "streaming");
    assert!(gs.lookahead_used > 0, "{gs:?}");
    assert_eq!(
        (gs.lookahead_used, gs.lookahead_predicted_used),
        (cs.lookahead_used, cs.lookahead_predicted_used),
        "GPU {gs:?} against CPU {cs:?}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_dense_weights_leave_ram_once_the_gpu_holds_them() {
    if device().is_none() {
        return;
    }
    let name = "glm5-tiny";
    let dir = scratch("dense-gpu-release");
    let (ok, err) = common::convert(&fixture(name), &dir, &["--experts", "int8"], None);
    assert!(ok, "{err}");
    let ids = oracle_ids(name, "tf_input_ids");
    let opts = |ram: Option<u64>, dense| EngineOptions {
        ram,
        context: ids.len(),
        batch_tokens: Some(ids.len()),
        history: HistoryPolicy::Off,
        dense_device: dense,
        ..Default::default()
    };
    let probe = Engine::load(&dir, &opts(Some(1 << 40), DenseDevice::Cpu)).unwrap();
    let plan = probe.plan.clone().expect("a container is planned");
    let want = logits(&probe.model, &ids);
    drop(probe);
    // one expert per layer: the dense weights' room is more than the cache had
    let ram = plan.resident_bytes + plan.expert_layers as u64 * plan.expert_bytes;
    let mut e = Engine::load(&dir, &opts(Some(ram), DenseDevice::Gpu)).unwrap();
    assert!(e.model.cpu_dense_released);
    let cap = e.stats().unwrap().cache_capacity_bytes;
    let grown = cap - e.plan.as_ref().unwrap().cache_bytes;
    if e.model.dense_gpu.as_ref().unwrap().dedicated_memory() {
        assert!(
            grown > plan.dense_bytes / 2 && grown < plan.dense_bytes,
            "the cache grew by {grown} bytes of a {}-byte skeleton (the embedding stays)",
            plan.dense_bytes
        );
    } else {
        // the device's buffers are the host's RAM (lavapipe): they take the copies' room
        assert_eq!(grown, 0);
    }
    same(&logits(&e.model, &ids), &want, "released CPU copies");
    // a CPU pass without them is an error, not a panic
    e.model.dense_gpu = None;
    let err = e
        .model
        .forward(
            &ids[..2],
            &mut KvCache::new(&e.model.spec),
            ForwardOptions::default(),
            None,
        )
        .unwrap_err();
    assert!(err.to_string().contains("GPU only"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Logits of a prefill of `ids`.
fn logits(m: &Model, ids: &[u32]) -> Vec<f32> {
    step(m, ids, &mut KvCache::new(&m.spec))
}

fn int8_container() -> std::path::PathBuf {
    let out = scratch("dense-gpu-int8");
    let (ok, err) = common::convert(
        &fixture(GQA),
        &out,
        &["--experts", "int4", "--dense", "int8"],
        None,
    );
    assert!(ok, "convert: {err}");
    out
}

#[test]
fn the_integer_path_and_experts_in_vram_keep_the_cpu_bits() {
    if device().is_none() {
        return;
    }
    let dir = int8_container();
    let load = |dense, vram| {
        Engine::load(
            &dir,
            &EngineOptions {
                activations: Activations::Int8,
                dense_device: dense,
                vram,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let cpu = load(DenseDevice::Cpu, None);
    let ids = oracle_ids(GQA, "tf_input_ids");
    for vram in [
        None,
        Some(charm_coordinator::model::engine::VramBudget::Bytes(1 << 30)),
    ] {
        let g = load(DenseDevice::Gpu, vram);
        assert!(g.model.dense_gpu.is_some());
        compare(
            &cpu.model,
            &g.model,
            &ids,
            &format!("int8 container, vram {vram:?}"),
        );
        std::mem::drop(g);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn both_matrix_kernels_give_the_cpu_tokens_on_the_integer_path() {
    if device().is_none() {
        return;
    }
    // int8 dense weights and int4 experts with int8 activations: every dense matrix and every
    // expert in VRAM through `matvec_tiled` (a GPU's kernel) and `matvec` (a CPU device's)
    let dir = int8_container();
    let ids: Vec<String> = oracle_ids(GQA, "tf_input_ids")
        .iter()
        .map(|i| i.to_string())
        .collect();
    let prompt = ids.join(",");
    let run = |args: &[&str], env: &[(&str, String)]| {
        let args = [&["--activations", "int8"][..], args].concat();
        let (ok, v, err) = common::generate_run(&dir, &prompt, 8, &args, env);
        assert!(ok, "{args:?} {env:?}: {err}");
        v["ids"].clone()
    };
    let cpu = run(&["--dense-device", "cpu"], &[]);
    for kernel in ["tiled", "lanes"] {
        let env = [("CHARM_GPU_MATVEC", kernel.to_string())];
        let gpu = run(&["--dense-device", "gpu", "--vram", "1"], &env);
        assert_eq!(gpu, cpu, "{kernel}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_cli_generates_the_cpu_tokens_and_refuses_a_device_that_fails_its_self_check() {
    if device().is_none() {
        return;
    }
    let gqa = fixture(GQA);
    let ids = oracle_ids(GQA, "tf_input_ids");
    let prompt: Vec<String> = ids[..4].iter().map(|i| i.to_string()).collect();
    let prompt = prompt.join(",");
    let gen = |dense: &str| {
        let (ok, v, err) = common::generate_run(&gqa, &prompt, 6, &["--dense-device", dense], &[]);
        assert!(ok, "generate --dense-device {dense}: {err}");
        let want = if dense == "cpu" { "cpu" } else { "gpu" };
        if dense != "auto" {
            assert_eq!(v["stats"]["dense"]["device"], want, "{v}");
        }
        v["ids"].clone()
    };
    assert_eq!(gen("gpu"), gen("cpu"));
    assert_eq!(gen("auto"), gen("cpu"));
    // a device that fails its self-check: `gpu` refuses to start, `auto` runs on the CPU
    let perturb = [("CHARM_GPU_TEST_PERTURB", "1".to_string())];
    let (ok, _, err) = common::generate_run(&gqa, &prompt, 2, &["--dense-device", "gpu"], &perturb);
    assert!(
        !ok && err.contains("--dense-device gpu") && err.contains("refused"),
        "{err}"
    );
    let (ok, v, err) =
        common::generate_run(&gqa, &prompt, 6, &["--dense-device", "auto"], &perturb);
    assert!(ok, "auto with a refused device: {err}");
    assert_eq!(v["stats"]["dense"]["device"], "cpu", "{v}");
    assert!(
        err.contains("--dense-device auto"),
        "no note of where it ran: {err}"
    );
    assert_eq!(v["ids"], gen("cpu"));
}

#[test]
fn prompts_too_long_for_one_arena_run_in_several_passes_with_the_same_tokens() {
    if device().is_none() {
        return;
    }
    // a small arena (tests only) splits a prompt into passes of a few rows; on the demo model
    // the MTP layer's pass over the prompt's states too, whose drafts then match the CPU's
    let small = [("CHARM_GPU_TEST_ARENA_WORDS", "5000".to_string())];
    let glm: Vec<String> = oracle_ids("glm5-tiny", "tf_input_ids")
        .iter()
        .map(|i| i.to_string())
        .collect();
    let demo: Vec<String> = (1..=24).map(|i| (i * 37 % 500).to_string()).collect();
    let cases = [
        (fixture("glm5-tiny"), glm.join(","), &[][..]),
        (
            common::server::demo(),
            demo.join(","),
            &["--draft", "3"][..],
        ),
    ];
    for (model, prompt, extra) in &cases {
        let run = |dense: &str, env: &[(&str, String)]| {
            let args = [extra, &["--dense-device", dense][..]].concat();
            let (ok, v, err) = common::generate_run(model, prompt, 12, &args, env);
            assert!(ok, "{args:?}: {err}");
            (v["ids"].clone(), v["speculation"].clone())
        };
        assert_eq!(
            run("gpu", &small),
            run("cpu", &[]),
            "{} {extra:?}",
            model.display()
        );
    }
}

/// `charm generate` of `tokens` tokens with `extra` flags: the ids.
fn ids(model: &std::path::Path, prompt: &str, tokens: usize, extra: &[&str]) -> serde_json::Value {
    let (ok, v, err) = common::generate_run(model, prompt, tokens, extra, &[]);
    assert!(ok, "generate {extra:?}: {err}");
    v["ids"].clone()
}

#[test]
fn the_demo_model_samples_and_drafts_the_same_tokens_with_the_dense_skeleton_on_the_gpu() {
    if device().is_none() {
        return;
    }
    let demo = common::server::demo();
    let prompt = "1,2,3,4,5,6,7,8";
    for extra in [
        &[][..],
        &["--temperature", "0.8", "--seed", "7"][..],
        &["--draft", "3"][..],
    ] {
        let cpu = ids(&demo, prompt, 48, extra);
        let gpu = ids(
            &demo,
            prompt,
            48,
            &[extra, &["--dense-device", "gpu"]].concat(),
        );
        assert_eq!(gpu, cpu, "demo {extra:?}");
    }
}

#[test]
fn the_gateway_batches_the_same_answers_with_the_dense_skeleton_on_the_gpu() {
    if device().is_none() {
        return;
    }
    let demo = common::server::demo();
    let base = ["--history", "none"];
    let cpu = {
        let s = common::server::Server::start_model(&demo, &base);
        common::server::batched_completions(&s.addr)
    };
    let s = common::server::Server::start_model(
        &demo,
        &[&base[..], &["--dense-device", "gpu"]].concat(),
    );
    assert_eq!(common::server::batched_completions(&s.addr), cpu);
}

#[test]
fn a_coordinator_with_the_dense_skeleton_on_the_gpu_and_two_workers_gives_the_single_box_bits() {
    use common::cluster::{certs, workers_arg, Worker};
    if device().is_none() {
        return;
    }
    let c = scratch("dense-gpu-cluster-model");
    let (ok, err) = common::convert(&fixture("deepseek3-tiny"), &c, &["--experts", "int4"], None);
    assert!(ok, "convert: {err}");
    let dir = certs("dense-gpu-certs");
    let act = ["--activations", "int8"];
    let w1 = Worker::start(&c, &dir, "w1", 0, &act);
    let w2 = Worker::start(&c, &dir, "w2", 0, &act);
    let prompt = "5,17,29,3,11,42,7,8";
    let single = ids(&c, prompt, 16, &act);
    let workers = workers_arg(&[(&w1, "w1"), (&w2, "w2")]);
    let cluster = [
        &act[..],
        &[
            "--cluster",
            dir.to_str().unwrap(),
            "--workers",
            &workers,
            "--dense-device",
            "gpu",
        ],
    ]
    .concat();
    assert_eq!(
        ids(&c, prompt, 16, &cluster),
        single,
        "GPU coordinator + two workers"
    );
    drop((w1, w2));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&c);
}
