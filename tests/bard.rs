//! The trained demo model, `models/charm-bard-moe`: charm reproduces what transformers computed
//! for it (`reference.safetensors`, `reference.json`, written by tools/train_demo_model.py).

use std::path::{Path, PathBuf};

use charm_coordinator::decode::generate::generate;
use charm_coordinator::decode::sampling::{argmax, Sampler, SamplingParams};
use charm_coordinator::model::cache::KvCache;
use charm_coordinator::ops::evaluate::evaluate;
use charm_coordinator::{ForwardOptions, MlaMode, Model};
use charm_shared::dtype::to_f32;
use charm_shared::safetensors::SafetensorsFile;

mod common;
use common::max_abs_diff;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe")
}

struct Reference(SafetensorsFile);

impl Reference {
    fn open() -> Self {
        Reference(SafetensorsFile::open(&dir().join("reference.safetensors")).unwrap())
    }
    fn f32(&self, n: &str) -> Vec<f32> {
        to_f32(self.0.header.tensors[n].dtype, self.0.bytes(n).unwrap()).unwrap()
    }
    fn ids(&self, n: &str) -> Vec<u32> {
        self.0
            .bytes(n)
            .unwrap()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

/// The held-out token ids transformers' perplexity was measured on.
fn heldout_ids() -> Vec<u32> {
    common::tensor_ints(&dir().join("heldout.safetensors"), "ids")
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

#[test]
fn teacher_forced_logits_and_mtp_match_transformers() {
    let m = Model::load(&dir()).unwrap();
    let r = Reference::open();
    let ids = r.ids("tf_input_ids");
    let v = m.spec.vocab_size;
    let want = r.f32("tf_logits");
    let margins = r.f32("tf_margin");
    for mode in [MlaMode::Absorbed, MlaMode::Naive] {
        let mut c = KvCache::new(&m.spec);
        let normed = m
            .forward(&ids, &mut c, ForwardOptions { mla: mode }, None)
            .unwrap();
        let got = m.logits(&normed, ids.len()).unwrap();
        let d = max_abs_diff(&got, &want);
        eprintln!("{mode:?}: max logit diff {d:e}");
        assert!(d < 2e-4, "{mode:?}: logits differ by {d}");
        for t in 0..ids.len() {
            if margins[t] > 1e-3 {
                assert_eq!(
                    argmax(&got[t * v..(t + 1) * v]),
                    argmax(&want[t * v..(t + 1) * v]),
                    "position {t}"
                );
            }
        }
        if mode == MlaMode::Absorbed {
            let h = m.spec.hidden_size;
            let mut mc = KvCache::with_layers(&m.spec, 1);
            let draft = m
                .mtp_forward(&ids[1..], &normed[..(ids.len() - 1) * h], &mut mc)
                .unwrap();
            let d = max_abs_diff(&draft, &r.f32("mtp_logits"));
            eprintln!("mtp: max logit diff {d:e}");
            assert!(d < 2e-4, "MTP logits differ by {d}");
        }
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    let m = Model::load(&dir()).unwrap();
    let r = Reference::open();
    let want = r.ids("greedy_ids");
    let g = generate(
        &m,
        &r.ids("greedy_prompt"),
        want.len(),
        &mut Sampler::new(SamplingParams::default()),
        &[],
        ForwardOptions::default(),
    )
    .unwrap();
    assert_eq!(g.ids, want);
}

#[test]
fn heldout_perplexity_matches_transformers() {
    let m = Model::load(&dir()).unwrap();
    let ids = heldout_ids();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap())
            .unwrap();
    let want = reference["heldout_ppl"].as_f64().unwrap();
    let windows = reference["heldout_windows"].as_u64().unwrap() as usize;
    // A few windows keep the default suite fast; the full figure is in docs/quality.md.
    let e = evaluate(&m, &ids, 256, windows).unwrap();
    assert_eq!(e.windows, windows);
    let rel = (e.perplexity - want).abs() / want;
    eprintln!(
        "held-out perplexity: charm {:.5}, transformers {want:.5}",
        e.perplexity
    );
    assert!(
        rel < 1e-4,
        "perplexity {} vs transformers {want}",
        e.perplexity
    );
}

/// Real-text quality guards at the levels measured in docs/quality.md: the default int4 container
/// stays within 1% of the bf16 model's held-out perplexity (measured +0.06% over 64 windows), the
/// MTP head's greedy draft acceptance stays near the measured 60%, and routing stays balanced
/// (normalised entropy of expert popularity).
#[test]
fn quantized_demo_model_holds_its_quality_on_heldout_text() {
    let ids = heldout_ids();
    let bf16 = evaluate(&Model::load(&dir()).unwrap(), &ids, 256, 8).unwrap();
    let out = common::scratch("bard-int4");
    let (ok, err) = common::convert(&dir(), &out, &[], None);
    assert!(ok, "{err}");
    let q = evaluate(&Model::load(&out).unwrap(), &ids, 256, 8).unwrap();
    eprintln!(
        "perplexity bf16 {:.3}, int4/int8 {:.3}; MTP acceptance {:?}",
        bf16.perplexity, q.perplexity, bf16.mtp_acceptance
    );
    assert!(
        q.perplexity / bf16.perplexity < 1.01,
        "int4 container perplexity {} vs bf16 {}",
        q.perplexity,
        bf16.perplexity
    );
    assert!(
        bf16.mtp_acceptance.unwrap() > 0.55 && q.mtp_acceptance.unwrap() > 0.5,
        "{:?} {:?}",
        bf16.mtp_acceptance,
        q.mtp_acceptance
    );
    assert!(
        bf16.routing_entropy.iter().all(|&e| e > 0.95),
        "{:?}",
        bf16.routing_entropy
    ); // 0.969..0.986 over these 8 windows
    std::fs::remove_dir_all(&out).unwrap();
}
