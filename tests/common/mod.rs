//! Helpers shared by the workspace integration tests (each test file compiles its own copy, so
//! some files use only part of it).
#![allow(dead_code)]

pub mod cluster;
pub mod http;
pub mod server;

use std::path::{Path, PathBuf};
use std::process::Command;

use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{ForwardOptions, Model};
use charm_shared::dtype::to_f32;
use charm_shared::safetensors::SafetensorsFile;

/// Every oracle fixture in `tests/data/oracle`.
pub const FIXTURES: [&str; 5] = [
    "glm5-tiny",
    "glm5-tiny-grouped",
    "glm5-small-fp8",
    "deepseek3-tiny",
    "qwen3moe-tiny",
];

/// `tests/data/oracle/NAME`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/oracle")
        .join(name)
}

/// A fresh (removed, not created) temporary path unique to this test process and `tag`.
pub fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("charm-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Removes a scratch directory when dropped, a failing test's too (`let _gone =
/// RemoveOnDrop(dir.clone())`): for the large ones, which would otherwise fill the disk of the
/// next run.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the `charm` binary; returns (success, stdout, stderr) and fails the test on a panic.
pub fn charm(args: &[&str]) -> (bool, String, String) {
    charm_env(args, &[])
}

/// [`charm`] with extra environment variables.
pub fn charm_env(args: &[&str], env: &[(&str, String)]) -> (bool, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_charm"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(!err.contains("panicked"), "charm {args:?} panicked: {err}");
    (o.status.success(), out, err)
}

/// `charm convert --model SRC --out OUT EXTRA..`, optionally dying after `abort_after` bytes.
pub fn convert(src: &Path, out: &Path, extra: &[&str], abort_after: Option<u64>) -> (bool, String) {
    let mut args = vec![
        "convert",
        "--model",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let env: Vec<(&str, String)> = abort_after
        .map(|n| ("CHARM_CONVERT_ABORT_AFTER_BYTES", n.to_string()))
        .into_iter()
        .collect();
    let (ok, _, err) = charm_env(&args, &env);
    (ok, err)
}

/// A float tensor of a safetensors file, as f32.
pub fn tensor_f32(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(file).unwrap();
    let t = &f.header.tensors[name];
    (
        t.shape.clone(),
        to_f32(t.dtype, f.bytes(name).unwrap()).unwrap(),
    )
}

/// An integer tensor (i64, i32 or u8) of a safetensors file.
pub fn tensor_ints(file: &Path, name: &str) -> Vec<i64> {
    SafetensorsFile::open(file).unwrap().ints(name).unwrap()
}

/// Token ids stored in a fixture's `oracle.safetensors`.
pub fn oracle_ids(fixture_name: &str, tensor: &str) -> Vec<u32> {
    tensor_ints(&fixture(fixture_name).join("oracle.safetensors"), tensor)
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// A float tensor of a fixture's `oracle.safetensors`.
pub fn oracle_f32(fixture_name: &str, tensor: &str) -> Vec<f32> {
    tensor_f32(&fixture(fixture_name).join("oracle.safetensors"), tensor).1
}

/// One teacher-forced pass: `[ids.len(), vocab]` logits.
pub fn logits(m: &Model, ids: &[u32]) -> Vec<f32> {
    let mut c = KvCache::new(&m.spec);
    let n = m
        .forward(ids, &mut c, ForwardOptions::default(), None)
        .unwrap();
    m.logits(&n, ids.len()).unwrap()
}

/// Writes a safetensors file from `(name, dtype, shape, bytes)` entries, in order.
pub fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}));
        data.extend_from_slice(bytes);
    }
    let h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `s` (a command's standard output) as JSON.
pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

/// `charm generate --json` of `tokens` tokens after `ids` on `model` (no routing history) with
/// `extra` flags and environment: whether it succeeded, the JSON of its last line (`null` where it
/// printed none), its stderr.
pub fn generate_run(
    model: &Path,
    ids: &str,
    tokens: usize,
    extra: &[&str],
    env: &[(&str, String)],
) -> (bool, serde_json::Value, String) {
    let tokens = tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        ids,
        "--max-tokens",
        &tokens,
        "--history",
        "none",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = charm_env(&args, env);
    let v = out.lines().last().map_or(serde_json::Value::Null, json);
    (ok, v, err)
}

/// `charm plan --model DIR --json` with `args` after it: the plan, which must succeed.
pub fn plan_json(dir: &Path, args: &[&str]) -> serde_json::Value {
    let all = [
        &["plan", "--model", dir.to_str().unwrap(), "--json"][..],
        args,
    ]
    .concat();
    let (ok, out, err) = charm(&all);
    assert!(ok, "{args:?}: {err}");
    json(&out)
}

/// `charm plan` of `dir` for a context of `ctx` tokens, with a large budget.
pub fn plan(dir: &Path, ctx: usize) -> serde_json::Value {
    let ctx = ctx.to_string();
    plan_json(dir, &["--ram", "64", "--ctx", &ctx, "--history", "none"])
}

/// A predicted time budget adds up: its parts (less what the shared expert hides) are its
/// total; a GPU's part, where there is one, is inside `expert_compute_ms`.
pub fn check_budget(b: &serde_json::Value) {
    let f = |k: &str| b[k].as_f64().unwrap_or_else(|| panic!("{k}: {b}"));
    let sum = f("dense_ms")
        + f("drafts_ms")
        + f("round_trips_ms")
        + f("transfer_ms")
        + f("expert_compute_ms")
        + f("expert_disk_ms")
        - f("overlap_ms");
    assert!(
        f("total_ms") > 0.0 && (sum - f("total_ms")).abs() < 1e-9 * f("total_ms"),
        "{b}"
    );
    if b.get("expert_vram_ms").is_some() {
        assert!(f("expert_vram_ms") >= 0.0 && f("expert_vram_ms") <= f("expert_compute_ms"));
    }
}
