//! `charm serve` as a child process on loopback.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The demo model shipped in the repository.
pub fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe")
}

/// A running `charm serve`, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Drop for Server {
    /// SIGTERM first, as a service manager stops it (`charm demo --serve` then removes its
    /// cluster keys from the temporary directory); a server still up after 5 s is killed.
    fn drop(&mut self) {
        // SAFETY: kill(2) with our own child's pid and a signal number.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub fn start(extra: &[&str]) -> Self {
        Self::start_model(&demo(), extra)
    }

    pub fn start_model(model: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_charm"))
            .args(["serve", "--model"])
            .arg(model)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
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
            .unwrap_or_else(|| panic!("server did not start: {line}"))
            .to_string();
        Self { child, addr }
    }

    /// `charm demo --serve` on a free port (its two loopback workers die with it), and what it
    /// printed up to its `curl` line, the last.
    pub fn demo() -> (Self, Vec<String>) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_charm"))
            .args(["demo", "--serve", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut said = Vec::new();
        let mut addr = None;
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line.unwrap();
            if let Some(rest) = line.strip_prefix("serving the OpenAI-compatible API on http://") {
                addr = rest.split(' ').next().map(String::from);
            }
            let last = line.starts_with("curl ");
            said.push(line);
            if last {
                break;
            }
        }
        let server = Self {
            child,
            addr: addr.unwrap_or_default(),
        };
        assert!(
            !server.addr.is_empty(),
            "charm demo --serve did not serve: {said:?}"
        );
        (server, said)
    }
}

/// Completions of a few prompts sent at once (so the gateway batches them), greedy and seeded.
pub fn batched_completions(addr: &str) -> Vec<String> {
    let prompts = [
        "Once upon a time",
        "The king said",
        "In the forest",
        "A ghost",
    ];
    let bodies: Vec<serde_json::Value> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            serde_json::json!({
                "prompt": p,
                "max_tokens": 24,
                "temperature": if i % 2 == 0 { 0.0 } else { 0.9 },
                "seed": 11 + i,
            })
        })
        .collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || crate::common::http::post(addr, "/v1/completions", b)))
            .collect();
        hs.into_iter()
            .map(|h| {
                let r = h.join().unwrap();
                assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                r.json()["choices"][0]["text"].as_str().unwrap().to_string()
            })
            .collect()
    })
}
