//! `charm serve` under concurrent streams: aggregate decode tokens per second and time to first
//! token with 1, 4, 8 and 16 streams at once, and a cached-prefix request's time to first token
//! next to a cold one's.
//!
//! ```sh
//! cargo bench --bench gateway -- [--model DIR] [--tokens 64] [--streams 1,4,8,16] [--parallel 16]
//!     [--activations f32|int8] [--ram GB] [--prompt-ids N [--vocab V]] [--url http://HOST:PORT]
//! ```
//!
//! `--prompt-ids N`: prompts of N token ids, greedy, `ignore_eos` (the same work on any
//! server); `--url`: drive a server already running (e.g. llama.cpp's `llama-server`) instead
//! of starting `charm serve`.
//!
//! `--ram` below the model's size streams its routed experts from disk through the cache.
//!
//! Each stream is a real HTTP connection asking for `--tokens` tokens (sampled, seeded: every
//! run decodes the same tokens), all sent at once.

mod common;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
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
    let (mut usage, mut chunks) = (None, 0);
    let mut line = String::new();
    while r.read_line(&mut line).unwrap_or(0) > 0 {
        if let Some(d) = line.trim().strip_prefix("data: ") {
            if d != "[DONE]" {
                let v: serde_json::Value = serde_json::from_str(d).unwrap();
                if v["choices"][0]["text"].is_string() {
                    // (a server that sends no usage sends a chunk per token)
                    chunks += 1;
                    first.get_or_insert(t.elapsed().as_secs_f64());
                }
                if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                    usage = Some(n);
                }
            }
        }
        line.clear();
    }
    let _ = r.read_to_end(&mut Vec::new());
    (
        first.unwrap_or(0.0),
        t.elapsed().as_secs_f64(),
        usage.unwrap_or(chunks),
    )
}

fn main() {
    let args = common::Args::from_env();
    let arg = |k: &str| args.get(k);
    let model = args.model();
    let tokens: usize = arg("--tokens").map_or(64, |t| t.parse().unwrap());
    let streams = args.counts("--streams", "1,4,8,16");
    let parallel = arg("--parallel").unwrap_or_else(|| "16".into());
    let activations = arg("--activations").unwrap_or_else(|| "f32".into());
    // prompts of token ids, greedy, past end-of-sequence tokens: the same work on any server
    let ids: Option<usize> = arg("--prompt-ids").map(|n| n.parse().unwrap());
    let vocab: u64 = arg("--vocab").map_or(2048, |n| n.parse().unwrap());
    let mut extra = vec![];
    if let Some(r) = arg("--ram") {
        extra = vec!["--ram".to_string(), r];
    }
    let (mut child, addr) = match arg("--url") {
        Some(u) => {
            println!("server {u}, {tokens} tokens per stream");
            (
                None,
                u.trim_start_matches("http://")
                    .trim_end_matches('/')
                    .to_string(),
            )
        }
        None => {
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
                "charm serve --model {}, {tokens} tokens per stream, --parallel {parallel}, activations {activations}{}, ISA {:?}, {} cores",
                model.display(),
                extra.join(" ").replace("--ram", ", --ram"),
                charm_shared::quant::active_isa(),
                std::thread::available_parallelism().map_or(1, |n| n.get())
            );
            (Some(child), addr)
        }
    };
    let prompt_ids = |i: usize, n: usize| -> Vec<u64> {
        (0..n as u64)
            .map(|k| (k * 37 + i as u64 * 101 + 11) % (vocab - 2) + 2)
            .collect()
    };
    let body = |i: usize| {
        match ids {
        Some(n) => serde_json::json!({"prompt": prompt_ids(i, n), "max_tokens": tokens, "temperature": 0, "ignore_eos": true, "stream": true}),
        None => serde_json::json!({"prompt": format!("ROMEO. {i}"), "max_tokens": tokens, "temperature": 0.8, "seed": i, "stream": true}),
    }
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
    let (cold, warm, what) = match ids {
        Some(_) => {
            let prefix = prompt_ids(999, 256);
            let ask = |tail: u64| {
                let mut p = prefix.clone();
                p.push(tail);
                serde_json::json!({"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": true, "stream": true})
                    .to_string()
            };
            (
                stream(&addr, &ask(3)).0,
                stream(&addr, &ask(4)).0,
                "257-token prompt".to_string(),
            )
        }
        None => {
            let prefix = "ROMEO. ".repeat(120);
            let ask = |tail: &str| {
                serde_json::json!({"prompt": format!("{prefix}{tail}"), "max_tokens": 4, "temperature": 0, "stream": true})
                    .to_string()
            };
            (
                stream(&addr, &ask("JULIET.")).0,
                stream(&addr, &ask("NURSE.")).0,
                format!("{}-char prompt", prefix.len() + 7),
            )
        }
    };
    println!(
        "time to first token, {what}: cold {:.1} ms, cached prefix {:.1} ms ({:.0}%)",
        cold * 1e3,
        warm * 1e3,
        100.0 * warm / cold
    );
    if let Some(c) = child.as_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}
