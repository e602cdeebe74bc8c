//! The soak: `charm serve` across three `charm worker` processes answering four concurrent
//! streamed chat requests at a time, while a random worker is killed with SIGKILL and restarted
//! every few seconds. Every request must complete with the single-box greedy answer.
//!
//! Not part of the default suite (it runs for minutes):
//!
//! ```sh
//! CHARM_SOAK_SECONDS=600 cargo test --release --test soak -- --ignored --nocapture
//! ```
//!
//! It prints the counts: requests, kills, failovers (requests a worker failed and another holder
//! or the coordinator answered), expert runs computed on the coordinator, rejoins.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::{certs, workers_arg, Worker};
use common::http::post;
use common::server::{demo, Server};
use serde_json::{json, Value};

const PROMPTS: [&str; 6] = [
    "Speak, Romeo.",
    "What news from Verona?",
    "Tell me of the king.",
    "Who knocks at the gate?",
    "Sing a song of the sea.",
    "Where is my lord?",
];

/// The content of a streamed greedy answer to `prompt`, or why there is none.
fn ask(addr: &str, prompt: &str, max_tokens: u32) -> Result<String, String> {
    let body = json!({"messages": [{"role": "user", "content": prompt}],
                      "max_tokens": max_tokens, "temperature": 0, "stream": true});
    let r = post(addr, "/v1/chat/completions", &body);
    if r.status != 200 {
        return Err(format!(
            "status {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        ));
    }
    let text = String::from_utf8_lossy(&r.body).into_owned();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    if events.last() != Some(&"[DONE]") {
        return Err(format!("stream did not finish: {text}"));
    }
    let mut out = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).map_err(|e| e.to_string())?;
        if let Some(err) = v.get("error") {
            return Err(format!("error event: {err}"));
        }
        out += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
    }
    Ok(out)
}

/// A small deterministic generator for the kill schedule.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
#[ignore = "runs for minutes: CHARM_SOAK_SECONDS=600 cargo test --release --test soak -- --ignored"]
fn four_streams_through_three_workers_survive_random_kills() {
    let seconds: u64 = std::env::var("CHARM_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let max_tokens = 48;
    // the single-box answers
    let single = Server::start(&[]);
    let want: Vec<String> = PROMPTS
        .iter()
        .map(|p| ask(&single.addr, p, max_tokens).unwrap())
        .collect();
    drop(single);

    let dir = certs("soak");
    let cfg = json!({"workers": [], "heartbeat_ms": 500, "deadline_ms": 2000, "replicas": 2});
    std::fs::write(dir.join("cluster.json"), cfg.to_string()).unwrap();
    let model = demo();
    let names = ["w1", "w2", "w3"];
    let first: Vec<Worker> = names
        .iter()
        .map(|n| Worker::start(&model, &dir, n, 0, &[]))
        .collect();
    let list = workers_arg(&[(&first[0], "w1"), (&first[1], "w2"), (&first[2], "w3")]);
    let ports: Vec<u16> = first.iter().map(|w| w.port).collect();
    let mut workers: Vec<Option<Worker>> = first.into_iter().map(Some).collect();
    let srv = Server::start(&[
        "--cluster",
        dir.to_str().unwrap(),
        "--workers",
        &list,
        "--parallel",
        "4",
    ]);

    let end = Instant::now() + Duration::from_secs(seconds);
    let (requests, failed, changed) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let problems: Arc<Mutex<Vec<String>>> = Arc::default();
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (addr, want) = (srv.addr.clone(), want.clone());
            let (requests, failed, changed, problems) = (
                requests.clone(),
                failed.clone(),
                changed.clone(),
                problems.clone(),
            );
            std::thread::spawn(move || {
                let mut i = c;
                while Instant::now() < end {
                    let p = i % PROMPTS.len();
                    i += 1;
                    requests.fetch_add(1, Ordering::Relaxed);
                    match ask(&addr, PROMPTS[p], max_tokens) {
                        Ok(got) if got == want[p] => {}
                        Ok(got) => {
                            changed.fetch_add(1, Ordering::Relaxed);
                            problems
                                .lock()
                                .unwrap()
                                .push(format!("prompt {p}: {got:?} instead of {:?}", want[p]));
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            problems.lock().unwrap().push(format!("prompt {p}: {e}"));
                        }
                    }
                }
            })
        })
        .collect();

    // the killer: every 2-6 s a random worker is killed, and started again 0.5-2.5 s later
    let mut rng = Lcg(0x5eed);
    let mut kills = 0u64;
    while Instant::now() + Duration::from_secs(3) < end {
        std::thread::sleep(Duration::from_millis(2000 + rng.below(4000)));
        let w = rng.below(3) as usize;
        // (a worker is SIGKILLed and reaped when dropped)
        workers[w] = None;
        kills += 1;
        std::thread::sleep(Duration::from_millis(500 + rng.below(2000)));
        workers[w] = Some(Worker::start(&model, &dir, names[w], ports[w], &[]));
    }
    for c in clients {
        c.join().unwrap();
    }
    let status = common::http::http(&srv.addr, "GET", "/v1/status?heat=false", &[], b"").json();
    let ws = status["workers"].as_array().unwrap();
    let failovers: u64 = ws.iter().map(|w| w["failures"].as_u64().unwrap()).sum();
    let rejoins: u64 = ws
        .iter()
        .map(|w| w["joins"].as_u64().unwrap().saturating_sub(1))
        .sum();
    let local = status["cluster"]["local_runs"].as_u64().unwrap();
    println!(
        "soak {seconds} s: {} requests, {} failed, {} changed; {kills} kills, {failovers} failed worker requests answered elsewhere, {local} expert runs computed on the coordinator, {rejoins} rejoins",
        requests.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        changed.load(Ordering::Relaxed),
    );
    let problems = problems.lock().unwrap();
    assert!(
        problems.is_empty(),
        "{} problems, first: {:?}",
        problems.len(),
        &problems[..problems.len().min(3)]
    );
    assert!(kills > 0 && requests.load(Ordering::Relaxed) > 0);
}
