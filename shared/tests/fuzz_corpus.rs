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
/// their checks, `checkfail*` decode and fail them, `bad*` are refused; none may panic, and the
/// coordinator's in-place read ([`charm_shared::wire::receive`]) agrees with the decoder.
#[test]
fn replay_wire_message_corpus() {
    use charm_shared::wire::{decode, receive, Limits, Message, Payload, Received};
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
        // the coordinator's in-place read accepts and refuses the same payloads, and reads the
        // same message
        let mut aligned = Payload::with_capacity(bytes.len());
        aligned.extend_from_slice(&bytes);
        match (receive(aligned), &r) {
            (Ok(Received::Computed(v)), Ok(Message::Computed(m))) => {
                assert_eq!(
                    (v.id, v.compute_ns, v.out()),
                    (m.id, m.compute_ns, &m.out[..])
                )
            }
            (Ok(Received::Other(o)), Ok(m)) => assert_eq!(&o, m, "{name}"),
            (Err(_), Err(_)) => {}
            (got, want) => panic!("{name}: received {got:?}, decoded {want:?}"),
        }
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

/// The wire corpus's seeds are today's encodings of the messages below (run with
/// `CHARM_WRITE_CORPUS=1` after changing a message type to write them anew: an archive's layout
/// follows every type in the message enum).
#[test]
fn the_wire_seeds_are_current() {
    use charm_shared::wire::{
        encode, ComputeRequest, ComputeResult, FailureClass, Hello, LayerExperts, Message, Run,
        LEN_BYTES, PROTOCOL_VERSION,
    };
    let compute = |runs: Vec<(u32, Vec<u32>)>| {
        Message::Compute(ComputeRequest {
            id: 7,
            step: 3,
            layer: 2,
            hidden: 8,
            activations: "f32".into(),
            x: (0..24).map(|i| i as f32 * 0.5 - 1.0).collect(),
            group: 0,
            codes: vec![],
            amax: vec![],
            runs: runs
                .into_iter()
                .map(|(expert, rows)| Run { expert, rows })
                .collect(),
        })
    };
    let payload = |m: &Message| encode(m).unwrap().split_off(LEN_BYTES);
    let valid = payload(&compute(vec![(1, vec![0, 2]), (9, vec![1])]));
    let mut damaged = valid.clone();
    let n = damaged.len();
    // the root (at the end of an archive) overwritten: offsets point outside the buffer
    for b in &mut damaged[n - 48..] {
        *b = 0xff;
    }
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("valid-compute", valid.clone()),
        (
            "valid-computed",
            payload(&Message::Computed(ComputeResult {
                id: 7,
                compute_ns: 850_000,
                out: [vec![1.5; 16], vec![-0.25; 8]].concat(),
            })),
        ),
        (
            "valid-failed",
            payload(&Message::Failed {
                id: 7,
                class: FailureClass::Unavailable,
                message: "layer 2 expert 9 unavailable: read error".into(),
            }),
        ),
        (
            "valid-hello",
            payload(&Message::Hello(Hello {
                version: PROTOCOL_VERSION,
                node: "w1".into(),
                model: "1c2d3e4f-20480".into(),
                activations: vec!["f32".into(), "int8".into()],
                experts: vec![LayerExperts {
                    layer: 1,
                    ids: (0..16).collect(),
                }],
                ram_bytes: 48 << 30,
                disk_free_bytes: 900 << 30,
                expert_rate: 12500.0,
                fetches: true,
                act_group: 64,
                vram_bytes: 20 << 30,
                gpu: "NVIDIA GeForce RTX 3090".into(),
            })),
        ),
        (
            "valid-refused",
            payload(&Message::Refused {
                reason: "protocol version 2 (this worker speaks 1)".into(),
            }),
        ),
        ("valid-ping", payload(&Message::Ping { seq: 9 })),
        (
            "valid-fetch",
            payload(&Message::Fetch {
                layer: 1,
                expert: 5,
                offset: 0,
                len: 1 << 20,
            }),
        ),
        (
            "valid-chunk",
            payload(&Message::Chunk {
                layer: 1,
                expert: 5,
                offset: 0,
                data: (0..64).collect(),
            }),
        ),
        (
            "valid-assign",
            payload(&Message::Assign {
                experts: vec![LayerExperts {
                    layer: 1,
                    ids: vec![0, 5, 9],
                }],
            }),
        ),
        (
            "valid-pong",
            payload(&Message::Pong {
                seq: 9,
                vram: vec![0b1011],
            }),
        ),
        (
            "checkfail-order",
            payload(&compute(vec![(3, vec![0]), (2, vec![1])])),
        ),
        ("checkfail-rows", payload(&compute(vec![(3, vec![3])]))),
        ("bad-empty", vec![]),
        ("bad-text", b"{\"Compute\": {\"id\": 1}}".to_vec()),
        ("bad-truncated", valid[..valid.len() / 2].to_vec()),
        ("bad-root-damaged", damaged),
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/wire_message");
    for (name, bytes) in seeds {
        let p = dir.join(name);
        if std::env::var_os("CHARM_WRITE_CORPUS").is_some() {
            std::fs::write(&p, &bytes).unwrap();
        }
        assert_eq!(
            std::fs::read(&p).unwrap(),
            bytes,
            "{name} is stale: see the doc comment"
        );
    }
}
