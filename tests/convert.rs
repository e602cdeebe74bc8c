//! `charm convert` end to end: every fixture converts and runs; bf16 containers reproduce the
//! reference exactly; a conversion killed mid-write and rerun is byte-identical to an
//! uninterrupted one; damaged containers are refused.

use std::path::Path;
use std::process::Command;

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{Sampler, SamplingParams};
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{ForwardOptions, Model};

mod common;
use common::{convert, fixture, logits, max_abs_diff, oracle_f32, oracle_ids, scratch, FIXTURES};

/// With every weight stored as bf16, a container of a bf16 checkpoint holds exactly the
/// checkpoint's values: logits match the reference as tightly as the direct path and greedy
/// decoding is token-exact.
#[test]
fn bf16_containers_reproduce_the_reference() {
    for f in [
        "glm5-tiny",
        "glm5-tiny-grouped",
        "deepseek3-tiny",
        "qwen3moe-tiny",
    ] {
        let out = scratch(&format!("bf16-{f}"));
        let (ok, err) = convert(
            &fixture(f),
            &out,
            &[
                "--experts",
                "bf16",
                "--dense",
                "bf16",
                "--embedding",
                "bf16",
                "--mtp",
                "bf16",
            ],
            None,
        );
        assert!(ok, "{f}: {err}");
        let m = Model::load(&out).unwrap();
        let t = oracle_ids(f, "tf_input_ids");
        let got = logits(&m, &t);
        let d = max_abs_diff(&got, &oracle_f32(f, "tf_logits"));
        assert!(d < 5e-5, "{f}: bf16 container logits differ by {d}");
        let want_ids = oracle_ids(f, "greedy_ids");
        let g = generate(
            &m,
            &oracle_ids(f, "greedy_prompt"),
            want_ids.len(),
            &mut Sampler::new(SamplingParams::default()),
            &[],
            ForwardOptions::default(),
        )
        .unwrap();
        assert_eq!(g.ids, want_ids, "{f}");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// Every fixture (the FP8 one included) converts with the default policy and generates through
/// the CLI.
#[test]
fn default_policy_converts_and_generates_on_every_fixture() {
    for f in FIXTURES {
        let out = scratch(&format!("def-{f}"));
        let (ok, err) = convert(&fixture(f), &out, &[], None);
        assert!(ok, "{f}: {err}");
        let o = Command::new(env!("CARGO_BIN_EXE_charm"))
            .args([
                "generate",
                "--model",
                out.to_str().unwrap(),
                "--ids",
                "5,17,3",
                "--max-tokens",
                "6",
                "--temperature",
                "0",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["ids"].as_array().unwrap().len(), 6, "{f}");
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("charm.json")).unwrap())
                .unwrap();
        assert_eq!(manifest["format"], "charm-container");
        assert_eq!(manifest["policy"]["experts"], "int4");
        std::fs::remove_dir_all(&out).unwrap();
    }
}

fn files(d: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Killed mid-write (the process aborts without cleanup, as under `kill -9`) at several points,
/// then rerun: the result is byte-identical to an uninterrupted conversion.
#[test]
fn resume_after_crash_is_byte_identical() {
    for f in ["glm5-tiny", "glm5-small-fp8"] {
        let clean = scratch(&format!("clean-{f}"));
        assert!(convert(&fixture(f), &clean, &[], None).0);
        let want = files(&clean);
        let total: u64 = want
            .iter()
            .filter(|(n, _)| n.ends_with(".bin"))
            .map(|(_, b)| b.len() as u64)
            .sum();
        for frac in [0.05, 0.4, 0.9] {
            let out = scratch(&format!("crash-{f}"));
            let at = (total as f64 * frac) as u64;
            let (ok, _) = convert(&fixture(f), &out, &[], Some(at));
            assert!(!ok, "{f}: the conversion should have died at byte {at}");
            assert!(!out.join("charm.json").exists());
            let (ok, err) = convert(&fixture(f), &out, &[], None);
            assert!(ok, "{f}: {err}");
            assert_eq!(
                files(&out),
                want,
                "{f}: resumed output differs (crash at {at} of {total})"
            );
            std::fs::remove_dir_all(&out).unwrap();
        }
        std::fs::remove_dir_all(&clean).unwrap();
    }
}

#[test]
fn damaged_or_foreign_containers_are_refused() {
    let out = scratch("damage");
    assert!(convert(&fixture("glm5-tiny"), &out, &[], None).0);
    // a flipped byte in an expert record
    let p = out.join("experts-002.bin");
    let mut b = std::fs::read(&p).unwrap();
    b[100] ^= 0x40;
    std::fs::write(&p, &b).unwrap();
    let e = Model::load(&out).unwrap_err().to_string();
    assert!(e.contains("experts-002.bin") && e.contains("CRC"), "{e}");
    b[100] ^= 0x40;
    std::fs::write(&p, &b).unwrap();
    Model::load(&out).unwrap();
    // a flipped byte in a dense tensor
    let p = out.join("dense.bin");
    let mut d = std::fs::read(&p).unwrap();
    d[200] ^= 1;
    std::fs::write(&p, &d).unwrap();
    let e = Model::load(&out).unwrap_err().to_string();
    assert!(e.contains("dense.bin") && e.contains("CRC"), "{e}");
    d[200] ^= 1;
    std::fs::write(&p, &d).unwrap();
    // a truncated expert file
    let p = out.join("experts-003.bin");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    let e = Model::load(&out).unwrap_err().to_string();
    assert!(e.contains("experts-003.bin"), "{e}");
    std::fs::write(&p, &b).unwrap();
    // a newer format version
    let mp = out.join("charm.json");
    let text = std::fs::read_to_string(&mp).unwrap();
    std::fs::write(&mp, text.replace("\"version\": 1", "\"version\": 99")).unwrap();
    let e = Model::load(&out).unwrap_err().to_string();
    assert!(e.contains("version 99"), "{e}");
    std::fs::write(&mp, &text).unwrap();
    // converting into it again with other settings is refused; with the same settings it is a no-op
    let (ok, err) = convert(&fixture("glm5-tiny"), &out, &["--experts", "int8"], None);
    assert!(!ok && err.contains("other settings"), "{err}");
    let before = files(&out);
    assert!(convert(&fixture("glm5-tiny"), &out, &[], None).0);
    assert_eq!(files(&out), before);
    std::fs::remove_dir_all(&out).unwrap();
    // a non-empty directory that is not a conversion is left alone
    let junk = scratch("junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("notes.txt"), "mine").unwrap();
    let (ok, err) = convert(&fixture("glm5-tiny"), &junk, &[], None);
    assert!(!ok && err.contains("not empty"), "{err}");
    std::fs::remove_dir_all(&junk).unwrap();
}

#[test]
fn bad_convert_options_are_refused() {
    for args in [["--experts", "int3"], ["--dense", "f32"], ["--group", "12"]] {
        let out = scratch("badopt");
        let (ok, err) = convert(&fixture("glm5-tiny"), &out, &args, None);
        assert!(!ok && err.contains("error"), "{args:?}: {err}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Batch invariance end to end: a quantized container's logits are bit-identical whether the
/// sequence runs in one pass or token by token through the cache (every kernel reduces each row
/// in a fixed order, whatever the batch).
#[test]
fn one_pass_and_token_by_token_logits_are_bit_identical() {
    for f in ["glm5-tiny", "qwen3moe-tiny", "deepseek3-tiny"] {
        let out = scratch(&format!("inv-{f}"));
        assert!(convert(&fixture(f), &out, &[], None).0);
        let m = Model::load(&out).unwrap();
        let t = oracle_ids(f, "tf_input_ids");
        let one = logits(&m, &t);
        let mut c = KvCache::new(&m.spec);
        let mut step = Vec::new();
        for k in 0..t.len() {
            let n = m
                .forward(&t[k..k + 1], &mut c, ForwardOptions::default(), None)
                .unwrap();
            step.extend(m.logits(&n, 1).unwrap());
        }
        assert!(
            one == step,
            "{f}: logits depend on how the sequence was batched"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
