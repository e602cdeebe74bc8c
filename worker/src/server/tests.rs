//! The server end to end: a worker served on a loopback port, asked over QUIC.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use charm_shared::linear::SwiGlu;
use charm_shared::wire::{
    encode, ComputeRequest, FailureClass, Hello, LayerExperts, Limits, Message, Run, LEN_BYTES,
    MAX_FRAME, PROTOCOL_VERSION,
};

use super::*;
use crate::tls::{init_cluster, Identity};
use crate::RamExperts;

const H: usize = 8;

fn expert(seed: f32) -> SwiGlu {
    crate::tests::expert(seed, H, 4)
}

fn hello(node: &str, version: u32, model: &str) -> Hello {
    Hello {
        version,
        ..Hello::holding_nothing(node, model, vec!["f32".into()])
    }
}

fn certs(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("charm-srv-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    init_cluster(&d, &["coordinator".into(), "w1".into()]).unwrap();
    d
}

async fn dial(dir: &Path, addr: SocketAddr) -> Result<quinn::Connection, String> {
    let id = Identity::load(dir, "coordinator").unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(id.client_config().unwrap());
    let c = ep.connect(addr, "w1").map_err(|e| e.to_string())?;
    tokio::time::timeout(Duration::from_secs(10), c)
        .await
        .map_err(|_| "timeout".to_string())?
        .map_err(|e| e.to_string())
}

/// Serves `svc` as worker w1 of the cluster in `dir` on a loopback port (a task of the
/// calling runtime); its address.
fn serving(dir: &Path, svc: Arc<Service>) -> SocketAddr {
    let ep = listen(
        "127.0.0.1:0".parse().unwrap(),
        &Identity::load(dir, "w1").unwrap(),
    )
    .unwrap();
    let addr = ep.local_addr().unwrap();
    tokio::spawn(serve(ep, svc));
    addr
}

/// Sends raw `bytes` on a new stream and reads the answer.
async fn exchange(c: &quinn::Connection, bytes: &[u8]) -> Message {
    let (mut s, mut r) = c.open_bi().await.unwrap();
    s.write_all(bytes).await.unwrap();
    s.finish().unwrap();
    read_frame(&mut r).await.unwrap().0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_refuses_what_it_must_and_keeps_serving() {
    let dir = certs("main");
    let store = Arc::new(RamExperts {
        hidden: H,
        layers: vec![Some((0..4).map(|e| expert(e as f32)).collect())],
    });
    let svc = Arc::new(Service {
        executor: store.clone(),
        hello: Hello {
            experts: vec![LayerExperts {
                layer: 0,
                ids: vec![0, 1, 2, 3],
            }],
            ..hello("w1", PROTOCOL_VERSION, "m1")
        },
        limits: Limits {
            hidden: H,
            n_experts: 4,
            max_tokens: 16,
        },
        shard: None,
        warm: Warm::new(Duration::from_millis(1)),
        vram: None,
    });
    let addr = serving(&dir, svc);

    // plaintext garbage at the port: ignored
    let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    u.send_to(b"GET / HTTP/1.0\r\n\r\n", addr).unwrap();
    u.send_to(&[0xff; 1200], addr).unwrap();

    // wrong protocol version, another model: refused, naming what differs
    for (h, why) in [
        (
            hello("coordinator", PROTOCOL_VERSION + 1, "m1"),
            "protocol version",
        ),
        (hello("coordinator", PROTOCOL_VERSION, "m2"), "model m2"),
    ] {
        let c = dial(&dir, addr).await.unwrap();
        match exchange(&c, &encode(&Message::Hello(h)).unwrap()).await {
            Message::Refused { reason } => assert!(reason.contains(why), "{reason}"),
            m => panic!("{m:?}"),
        }
    }

    // a certificate from another cluster's authority (trusting this one's, so it is the
    // worker that must refuse it), and a client of another cluster: the TLS handshake fails
    let other = certs("other");
    let mixed = other.join("mixed");
    std::fs::create_dir(&mixed).unwrap();
    std::fs::copy(dir.join("ca.pem"), mixed.join("ca.pem")).unwrap();
    for f in ["coordinator.pem", "coordinator.key"] {
        std::fs::copy(other.join(f), mixed.join(f)).unwrap();
    }
    for d in [&mixed, &other] {
        let refused = match dial(d, addr).await {
            Err(_) => true,
            // TLS 1.3: the client may finish before the server's verdict arrives
            Ok(c) => match c.open_bi().await {
                Err(_) => true,
                Ok((mut s, mut r)) => {
                    let ping = encode(&Message::Ping { seq: 1 }).unwrap();
                    let _ = s.write_all(&ping).await;
                    let _ = s.finish();
                    read_frame(&mut r).await.is_err()
                }
            },
        };
        assert!(
            refused,
            "a node of another cluster was served ({})",
            d.display()
        );
    }

    let c = dial(&dir, addr).await.unwrap();
    match exchange(
        &c,
        &encode(&Message::Hello(hello(
            "coordinator",
            PROTOCOL_VERSION,
            "m1",
        )))
        .unwrap(),
    )
    .await
    {
        Message::Hello(h) => assert_eq!(h.node, "w1"),
        m => panic!("{m:?}"),
    }
    let req = |experts: &[u32]| ComputeRequest {
        id: 5,
        step: 1,
        layer: 0,
        hidden: H as u32,
        activations: "f32".into(),
        x: (0..2 * H).map(|k| (k as f32 * 0.3).cos()).collect(),
        group: 0,
        codes: vec![],
        amax: vec![],
        runs: experts
            .iter()
            .map(|&e| Run {
                expert: e,
                rows: vec![1, 0],
            })
            .collect(),
    };
    let bad = |m: Message, why: &str| match m {
        Message::Failed { class, message, .. } => {
            assert_eq!(class, FailureClass::BadRequest, "{message}");
            assert!(message.contains(why), "{message} (wanted {why})");
        }
        m => panic!("{m:?}"),
    };
    // malformed, truncated, oversized, out of range: refused on their own streams
    let mut junk = encode(&Message::Compute(req(&[1]))).unwrap();
    for b in junk.iter_mut().skip(LEN_BYTES + 8) {
        *b ^= 0x5a;
    }
    bad(exchange(&c, &junk).await, "malformed");
    let ok = encode(&Message::Compute(req(&[1]))).unwrap();
    bad(exchange(&c, &ok[..ok.len() - 3]).await, "stream");
    bad(
        exchange(&c, &((MAX_FRAME + 1) as u32).to_le_bytes()).await,
        "exceeds",
    );
    bad(
        exchange(&c, &encode(&Message::Compute(req(&[9]))).unwrap()).await,
        "expert 9",
    );
    let mut wide = req(&[1]);
    wide.hidden = 4;
    bad(
        exchange(&c, &encode(&Message::Compute(wide)).unwrap()).await,
        "hidden 4",
    );
    // the same connection still computes, exactly as the store does
    let r = req(&[1, 3]);
    match exchange(&c, &encode(&Message::Compute(r.clone())).unwrap()).await {
        Message::Computed(res) => {
            res.check(&r).unwrap();
            let mut at = 0;
            for run in &r.runs {
                let e = &store.layers[0].as_ref().unwrap()[run.expert as usize];
                let xs: Vec<f32> = run
                    .rows
                    .iter()
                    .flat_map(|&row| r.x[row as usize * H..(row as usize + 1) * H].to_vec())
                    .collect();
                let n = run.rows.len() * H;
                assert_eq!(e.forward(&xs, run.rows.len()), res.out[at..at + n]);
                at += n;
            }
            assert_eq!(at, res.out.len());
        }
        m => panic!("{m:?}"),
    }
    match exchange(&c, &encode(&Message::Ping { seq: 4 }).unwrap()).await {
        Message::Pong { seq, .. } => assert_eq!(seq, 4),
        m => panic!("{m:?}"),
    }
    // one stream carries requests one after another, each answered in order, also when the
    // next is written before the last is answered
    let (mut s, mut rx) = c.open_bi().await.unwrap();
    let asks: Vec<ComputeRequest> = [&[1u32, 3][..], &[0], &[2, 3]]
        .iter()
        .enumerate()
        .map(|(i, e)| ComputeRequest {
            id: 10 + i as u64,
            ..req(e)
        })
        .collect();
    let answered = |m: Option<(Message, usize)>, r: &ComputeRequest| match m {
        Some((Message::Computed(res), _)) => res.check(r).unwrap(),
        m => panic!("{m:?}"),
    };
    s.write_all(&encode(&Message::Compute(asks[0].clone())).unwrap())
        .await
        .unwrap();
    answered(read_next(&mut rx).await.unwrap(), &asks[0]);
    for r in &asks[1..] {
        s.write_all(&encode(&Message::Compute(r.clone())).unwrap())
            .await
            .unwrap();
    }
    for r in &asks[1..] {
        answered(read_next(&mut rx).await.unwrap(), r);
    }
    // a frame it cannot read is answered with why, and ends that stream (only)
    s.write_all(&((MAX_FRAME + 1) as u32).to_le_bytes())
        .await
        .unwrap();
    bad(read_next(&mut rx).await.unwrap().unwrap().0, "exceeds");
    assert!(read_next(&mut rx).await.unwrap().is_none());
    match exchange(&c, &encode(&Message::Ping { seq: 5 }).unwrap()).await {
        Message::Pong { seq, .. } => assert_eq!(seq, 5),
        m => panic!("{m:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&other).unwrap();
}

/// A request and its answer cost their own packets and nothing more on either side's
/// critical path: each stream is read to its end (a stream dropped before its FIN is read
/// is stopped with a STOP_SENDING packet), and an answer of a few packets is acknowledged by
/// the next request rather than by ACK-only packets sent before it is read.
#[tokio::test]
async fn a_request_costs_no_packets_beyond_its_own() {
    const WIDE: usize = 256;
    let dir = certs("packets");
    let store = Arc::new(RamExperts {
        hidden: WIDE,
        layers: vec![Some(
            (0..2)
                .map(|e| crate::tests::expert(e as f32, WIDE, 4))
                .collect(),
        )],
    });
    let svc = Arc::new(Service {
        executor: store,
        hello: Hello {
            experts: vec![LayerExperts {
                layer: 0,
                ids: vec![0, 1],
            }],
            ..hello("w1", PROTOCOL_VERSION, "m1")
        },
        limits: Limits {
            hidden: WIDE,
            n_experts: 2,
            max_tokens: 16,
        },
        shard: None,
        warm: None,
        vram: None,
    });
    let addr = serving(&dir, svc);
    let id = Identity::load(&dir, "coordinator").unwrap();
    let mut cfg = id.client_config().unwrap();
    cfg.transport_config(Arc::new(transport(Duration::from_secs(1))));
    let mut client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    client.set_default_client_config(cfg);
    let c = client.connect(addr, "w1").unwrap().await.unwrap();
    let hi = Message::Hello(hello("coordinator", PROTOCOL_VERSION, "m1"));
    assert!(matches!(
        exchange(&c, &encode(&hi).unwrap()).await,
        Message::Hello(_)
    ));
    // about 3 KB each way: three packets
    let req = ComputeRequest {
        id: 1,
        step: 1,
        layer: 0,
        hidden: WIDE as u32,
        activations: "f32".into(),
        x: (0..3 * WIDE).map(|k| (k as f32 * 0.1).sin()).collect(),
        group: 0,
        codes: vec![],
        amax: vec![],
        runs: vec![Run {
            expert: 1,
            rows: vec![0, 1, 2],
        }],
    };
    let frame = encode(&Message::Compute(req.clone())).unwrap();
    let before = c.stats();
    let n = 40;
    for _ in 0..n {
        match exchange(&c, &frame).await {
            Message::Computed(r) => r.check(&req).unwrap(),
            m => panic!("{m:?}"),
        }
    }
    let after = c.stats();
    // one send call per request (its packets go together), not one more for ACKs: with
    // QUIC's default of an ACK every second packet this side makes about two per request
    let sends = after.udp_tx.ios - before.udp_tx.ios;
    assert!(sends <= n + n / 4, "{sends} send calls for {n} requests");
    assert_eq!(after.frame_tx.stop_sending, 0, "this side stopped streams");
    assert_eq!(after.frame_rx.stop_sending, 0, "the worker stopped streams");
    // on one stream kept open: the same, and the worker sends no credit for new streams
    // (a stream a request opens is one more for it to allow, which it says every few
    // requests in a packet of its own)
    assert!(after.frame_rx.max_streams_bidi > before.frame_rx.max_streams_bidi);
    let (mut s, mut rx) = c.open_bi().await.unwrap();
    for _ in 0..n {
        s.write_all(&frame).await.unwrap();
        match read_next(&mut rx).await.unwrap() {
            Some((Message::Computed(r), _)) => r.check(&req).unwrap(),
            m => panic!("{m:?}"),
        }
    }
    let kept = c.stats();
    let sends = kept.udp_tx.ios - after.udp_tx.ios;
    assert!(sends <= n + n / 4, "{sends} send calls for {n} requests");
    assert_eq!(
        kept.frame_rx.max_streams_bidi, after.frame_rx.max_streams_bidi,
        "stream credit for requests on one stream"
    );
    assert_eq!(kept.frame_rx.stop_sending, 0, "the worker stopped streams");
    std::fs::remove_dir_all(&dir).unwrap();
}
