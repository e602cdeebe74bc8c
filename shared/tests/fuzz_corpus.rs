//! Replays the safetensors-header fuzz corpus (`fuzz/corpus/safetensors_header`) through the
//! parser: seeds named `valid*` must parse, every other seed must be refused, none may panic.

use charm_shared::safetensors::parse_header;

#[test]
fn replay_safetensors_header_corpus() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/safetensors_header");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let bytes = std::fs::read(&p).unwrap();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let r = parse_header(&bytes, bytes.len() as u64);
        if name.starts_with("valid") || name.starts_with("empty") {
            let h = r.unwrap_or_else(|e| panic!("{name}: {e:?}"));
            for t in h.tensors.values() {
                assert!(t.end <= bytes.len() - h.data_start, "{name}");
            }
        } else {
            assert!(r.is_err(), "{name} parsed");
        }
        seen += 1;
    }
    assert!(seen >= 10, "corpus has {seen} seeds");
}

/// Replays the wire-message corpus (`fuzz/corpus/wire_message`): `valid*` seeds decode and pass
/// their checks, `checkfail*` decode and fail them, `bad*` are refused; none may panic.
#[test]
fn replay_wire_message_corpus() {
    use charm_shared::wire::{decode, Limits, Message};
    let limits = Limits {
        hidden: 8,
        n_experts: 16,
        max_tokens: 64,
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/wire_message");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let bytes = std::fs::read(&p).unwrap();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let r = decode(&bytes);
        let checked = |m: &Message| match m {
            Message::Compute(c) => c.check(&limits).is_ok(),
            _ => true,
        };
        if name.starts_with("valid") {
            let m = r.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(checked(&m), "{name} failed its checks");
        } else if name.starts_with("checkfail") {
            let m = r.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!checked(&m), "{name} passed its checks");
        } else {
            assert!(r.is_err(), "{name} decoded");
        }
        seen += 1;
    }
    assert!(seen >= 10, "corpus has {seen} seeds");
}
