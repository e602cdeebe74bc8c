//! `charm serve` under concurrent streams: aggregate decode tokens per second and time to first
//! token with 1, 4, 8 and 16 streams at once, and a cached-prefix request's time to first token
//! next to a cold one's.
//!
//! ```sh
//! cargo bench --bench gateway -- [--model DIR] [--tokens 64] [--streams 1,4,8,16] [--parallel 16]
//!     [--activations f32|int8] [--ram GB]
//! ```
//!
//! `--ram` below the model's size streams its routed experts from disk through the cache.
//!
//! Each stream is a real HTTP connection asking for `--tokens` tokens (sampled, seeded: every
//! run decodes the same tokens), all sent at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

/// Streams one completion; returns (seconds to the first text, seconds in all, tokens).
fn stream(addr: &str, body: &str) -> (f64, f64, u64) {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut first = None;
    let mut tokens = 0;
    let mut line = String::new();
    while r.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some(d) = line.trim().strip_prefix("data: ") {
            if d != "[DONE]" {
                let v: serde_json::Value = serde_json::from_str(d).unwrap();
                if v["choices"][0]["text"]
                    .as_str()
                    .is_some_and(|t| !t.is_empty())
                {
                    first.get_or_insert(t.elapsed().as_secs_f64());
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    tokens = n;
                }
            }
        }
        line.clear();
    }
    let _ = r.read_to_end(&mut Vec::new());
    (first.unwrap_or(0.0), t.elapsed().as_secs_f64(), tokens)
}

fn main() {
    let v: Vec<String> = std::env::args().skip(1).collect();
    let arg = |k: &str| {
        v.iter()
            .position(|a| a == k)
            .and_then(|i| v.get(i + 1))
            .cloned()
    };
    let model = arg("--model")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe"));
    let tokens: usize = arg("--tokens").map_or(64, |t| t.parse().unwrap());
    let streams: Vec<usize> = arg("--streams")
        .unwrap_or_else(|| "1,4,8,16".into())
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let parallel = arg("--parallel").unwrap_or_else(|| "16".into());
    let activations = arg("--activations").unwrap_or_else(|| "f32".into());
    let mut extra = vec![];
    if let Some(r) = arg("--ram") {
        extra = vec!["--ram".to_string(), r];
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_charm"))
        .args(["serve", "--model"])
        .arg(&model)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--parallel",
            &parallel,
            "--queue",
            "64",
            "--activations",
            &activations,
        ])
        .args(&extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    println!(
        "model {}, {tokens} tokens per stream, --parallel {parallel}, activations {activations}{}, ISA {:?}, {} cores",
        model.display(),
        extra.join(" ").replace("--ram", ", --ram"),
        charm_shared::quant::active_isa(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let body = |i: usize| {
        serde_json::json!({"prompt": format!("ROMEO. {i}"), "max_tokens": tokens, "temperature": 0.8, "seed": i, "stream": true})
            .to_string()
    };
    stream(&addr, &body(0)); // warm-up
    let mut single = 0.0;
    for &n in &streams {
        let t = Instant::now();
        let runs: Vec<(f64, f64, u64)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    let (a, b) = (addr.clone(), body(i));
                    sc.spawn(move || stream(&a, &b))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let wall = t.elapsed().as_secs_f64();
        let total: u64 = runs.iter().map(|r| r.2).sum();
        let rate = total as f64 / wall;
        if n == 1 {
            single = rate;
        }
        let mut ttft: Vec<f64> = runs.iter().map(|r| r.0 * 1e3).collect();
        ttft.sort_by(f64::total_cmp);
        println!(
            "{n:>2} streams: {rate:7.1} tok/s aggregate ({:.2}x one stream), time to first token median {:.0} ms, max {:.0} ms",
            if single > 0.0 { rate / single } else { 0.0 },
            ttft[ttft.len() / 2],
            ttft[ttft.len() - 1]
        );
    }
    // a long shared prefix: cold, then the same prefix again (reused from the prefix cache)
    let prefix = "ROMEO. ".repeat(120);
    let ask = |tail: &str| {
        serde_json::json!({"prompt": format!("{prefix}{tail}"), "max_tokens": 4, "temperature": 0, "stream": true})
            .to_string()
    };
    let cold = stream(&addr, &ask("JULIET.")).0;
    let warm = stream(&addr, &ask("NURSE.")).0;
    println!(
        "time to first token, {}-char prompt: cold {:.1} ms, cached prefix {:.1} ms ({:.0}%)",
        prefix.len() + 7,
        cold * 1e3,
        warm * 1e3,
        100.0 * warm / cold
    );
    let _ = child.kill();
    let _ = child.wait();
}
