//! Damaged checkpoints, configs and requests give a clear error naming the file and tensor:
//! never a panic. Each case starts from a real fixture copied to a temporary directory.

use std::path::{Path, PathBuf};

use charm_coordinator::model::cache::KvCache;
use charm_coordinator::{ForwardError, ForwardOptions, Model};
use charm_shared::LoadError;
use serde_json::Value;

mod common;
use common::fixture;

/// A scratch copy of a fixture (config.json + model.safetensors) that deletes itself.
struct Scratch(PathBuf);

impl Scratch {
    fn of(name: &str, tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("charm-bad-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture(name).join(f), d.join(f)).unwrap();
        }
        Scratch(d)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
    fn load(&self) -> Result<Model, LoadError> {
        Model::load(&self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file split into its JSON header and data area, for surgery.
struct St {
    header: serde_json::Map<String, Value>,
    data: Vec<u8>,
}

impl St {
    fn read(p: &Path) -> Self {
        let b = std::fs::read(p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        St {
            header: header.as_object().unwrap().clone(),
            data: b[8 + n..].to_vec(),
        }
    }
    fn write(&self, p: &Path) {
        let h = serde_json::to_vec(&Value::Object(self.header.clone())).unwrap();
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(&h);
        b.extend_from_slice(&self.data);
        std::fs::write(p, b).unwrap();
    }
    fn offsets(&self, t: &str) -> (usize, usize) {
        let o = self.header[t]["data_offsets"].as_array().unwrap();
        (
            o[0].as_u64().unwrap() as usize,
            o[1].as_u64().unwrap() as usize,
        )
    }
}

fn err_text(r: Result<Model, LoadError>) -> String {
    match r {
        Ok(_) => panic!("a damaged model loaded"),
        Err(e) => e.to_string(),
    }
}

const T: &str = "model.layers.1.self_attn.o_proj.weight";

#[test]
fn truncated_file() {
    let s = Scratch::of("glm5-tiny", "trunc");
    let p = s.path("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = err_text(s.load());
    assert!(
        e.contains("model.safetensors") && e.contains("outside") && e.contains("tensor `"),
        "{e}"
    );
}

#[test]
fn file_shorter_than_length_prefix() {
    let s = Scratch::of("glm5-tiny", "short");
    std::fs::write(s.path("model.safetensors"), [1u8, 2, 3]).unwrap();
    let e = err_text(s.load());
    assert!(
        e.contains("model.safetensors") && e.contains("too short"),
        "{e}"
    );
}

#[test]
fn header_length_past_end() {
    let s = Scratch::of("glm5-tiny", "hdrlen");
    let p = s.path("model.safetensors");
    let mut b = std::fs::read(&p).unwrap();
    let len = b.len() as u64;
    b[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&p, b).unwrap();
    let e = err_text(s.load());
    assert!(
        e.contains("model.safetensors") && e.contains("past the end"),
        "{e}"
    );
}

#[test]
fn offsets_outside_the_file() {
    let s = Scratch::of("glm5-tiny", "outside");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    let n = st.data.len();
    st.header.get_mut(T).unwrap()["data_offsets"] = serde_json::json!([n + 8, n + 8 + 64 * 64 * 2]);
    st.write(&p);
    let e = err_text(s.load());
    assert!(e.contains(T) && e.contains("outside"), "{e}");
}

#[test]
fn overlapping_offsets() {
    let s = Scratch::of("glm5-tiny", "overlap");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    let (b, _) = st.offsets(T);
    let other = "model.layers.2.self_attn.o_proj.weight";
    st.header.get_mut(other).unwrap()["data_offsets"] =
        serde_json::json!([b + 2, b + 2 + 64 * 64 * 2]);
    st.write(&p);
    let e = err_text(s.load());
    assert!(e.contains("overlap") && e.contains("o_proj"), "{e}");
}

#[test]
fn shape_times_dtype_differs_from_byte_count() {
    let s = Scratch::of("glm5-tiny", "bytes");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    st.header.get_mut(T).unwrap()["dtype"] = Value::from("F32");
    st.write(&p);
    let e = err_text(s.load());
    assert!(e.contains(T) && e.contains("!="), "{e}");
}

#[test]
fn wrong_shape_for_config() {
    let s = Scratch::of("glm5-tiny", "shape");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    st.header.get_mut(T).unwrap()["shape"] = serde_json::json!([32, 128]);
    st.write(&p);
    let e = err_text(s.load());
    assert!(
        e.contains(T) && e.contains("[32, 128]") && e.contains("[64, 64]"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_across_shards() {
    let s = Scratch::of("glm5-tiny", "dup");
    let p = s.path("model.safetensors");
    let st = St::read(&p);
    let (b, e) = st.offsets(T);
    let mut extra = St {
        header: serde_json::Map::new(),
        data: st.data[b..e].to_vec(),
    };
    let mut entry = st.header[T].clone();
    entry["data_offsets"] = serde_json::json!([0, e - b]);
    extra.header.insert(T.to_string(), entry);
    std::fs::rename(&p, s.path("model-00001-of-00002.safetensors")).unwrap();
    extra.write(&s.path("model-00002-of-00002.safetensors"));
    let e = err_text(s.load());
    assert!(
        e.contains(T) && e.contains("model-00002-of-00002.safetensors") && e.contains("both"),
        "{e}"
    );
}

#[test]
fn missing_tensor() {
    let s = Scratch::of("glm5-tiny", "missing");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    st.header.remove(T);
    st.write(&p);
    let e = err_text(s.load());
    assert!(e.contains("missing tensor") && e.contains(T), "{e}");
}

#[test]
fn unknown_model_type() {
    let s = Scratch::of("glm5-tiny", "mtype");
    let p = s.path("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c["model_type"] = Value::from("llama_moe_9000");
    std::fs::write(&p, c.to_string()).unwrap();
    let e = err_text(s.load());
    assert!(
        e.contains("config.json") && e.contains("unknown model_type `llama_moe_9000`"),
        "{e}"
    );
}

#[test]
fn absurd_dimensions() {
    for (key, val, needle) in [
        ("hidden_size", serde_json::json!(1u64 << 40), "hidden_size"),
        ("hidden_size", serde_json::json!(0), "hidden_size"),
        (
            "num_hidden_layers",
            serde_json::json!(1_000_000),
            "num_hidden_layers",
        ),
        (
            "num_experts_per_tok",
            serde_json::json!(99),
            "num_experts_per_tok",
        ),
        ("n_group", serde_json::json!(3), "n_group"),
        ("vocab_size", serde_json::json!(-5), "vocab_size"),
        ("kv_lora_rank", serde_json::json!("wide"), "kv_lora_rank"),
    ] {
        let s = Scratch::of("glm5-tiny", "absurd");
        let p = s.path("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        c[key] = val.clone();
        if key == "num_hidden_layers" {
            c.as_object_mut().unwrap().remove("mlp_layer_types");
            c.as_object_mut().unwrap().remove("indexer_types");
        }
        std::fs::write(&p, c.to_string()).unwrap();
        let e = err_text(s.load());
        assert!(
            e.contains("config.json") && e.contains(needle),
            "{key}={val}: {e}"
        );
    }
}

#[test]
fn malformed_config_json() {
    let s = Scratch::of("glm5-tiny", "cfgjson");
    std::fs::write(s.path("config.json"), "{ not json").unwrap();
    let e = err_text(s.load());
    assert!(
        e.contains("config.json") && e.contains("invalid JSON"),
        "{e}"
    );
    std::fs::remove_file(s.path("config.json")).unwrap();
    let e = err_text(s.load());
    assert!(e.contains("config.json"), "{e}");
}

/// Writes one bf16 element of tensor `t`.
fn poke_bf16(st: &mut St, t: &str, elem: usize, bits: u16) {
    let (b, _) = st.offsets(t);
    st.data[b + 2 * elem..b + 2 * elem + 2].copy_from_slice(&bits.to_le_bytes());
}

#[test]
fn non_finite_weight() {
    let s = Scratch::of("glm5-tiny", "nan");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    poke_bf16(&mut st, T, 17, 0x7fc0); // NaN
    st.write(&p);
    let e = err_text(s.load());
    assert!(
        e.contains(T) && e.contains("non-finite") && e.contains("17"),
        "{e}"
    );
}

#[test]
fn non_finite_fp8_weight() {
    let s = Scratch::of("glm5-small-fp8", "nan8");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    let t = "model.layers.1.self_attn.o_proj.weight";
    let (b, _) = st.offsets(t);
    st.data[b + 3] = 0x7f; // e4m3fn NaN
    st.write(&p);
    let e = err_text(s.load());
    assert!(e.contains(t) && e.contains("non-finite"), "{e}");
}

#[test]
fn non_finite_logits() {
    let s = Scratch::of("glm5-tiny", "inf");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    for i in 0..64 {
        poke_bf16(&mut st, "lm_head.weight", 7 * 64 + i, 0x7f7f); // ~3.4e38, finite
    }
    st.write(&p);
    let m = s.load().unwrap();
    let mut c = KvCache::new(&m.spec);
    let n = m
        .forward(&[1, 2, 3], &mut c, ForwardOptions::default(), None)
        .unwrap();
    match m.logits(&n, 3) {
        Err(ForwardError::NonFinite { what }) => assert!(what.contains("logits")),
        other => panic!("expected a non-finite error, got {other:?}"),
    }
}

#[test]
fn token_id_outside_vocab() {
    let m = Model::load(&fixture("glm5-tiny")).unwrap();
    let mut c = KvCache::new(&m.spec);
    match m.forward(&[5, 512, 3], &mut c, ForwardOptions::default(), None) {
        Err(ForwardError::TokenOutOfRange {
            id: 512,
            pos: 1,
            vocab: 512,
        }) => {}
        other => panic!("expected an out-of-vocabulary error, got {other:?}"),
    }
}

#[test]
fn fp8_weight_without_scales() {
    let s = Scratch::of("glm5-small-fp8", "noscale");
    let p = s.path("model.safetensors");
    let mut st = St::read(&p);
    st.header
        .remove("model.layers.1.self_attn.o_proj.weight_scale_inv");
    st.write(&p);
    let e = err_text(s.load());
    assert!(
        e.contains("o_proj.weight") && e.contains("block scales"),
        "{e}"
    );
}

#[test]
fn empty_directory() {
    let d = std::env::temp_dir().join(format!("charm-bad-empty-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(
        fixture("glm5-tiny").join("config.json"),
        d.join("config.json"),
    )
    .unwrap();
    let e = err_text(Model::load(&d));
    assert!(e.contains("no *.safetensors"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}
