//! `charm worker` processes and a cluster authority for the tests that run clusters on loopback.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::{charm, scratch};

/// A running `charm worker`, killed when dropped.
pub struct Worker {
    pub child: Child,
    pub port: u16,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Worker {
    /// Starts `charm worker` for `model` as node `node` of the cluster in `certs` on `port`
    /// (0: any), and waits until it listens.
    pub fn start(model: &Path, certs: &Path, node: &str, port: u16, extra: &[&str]) -> Self {
        Self::start_env(model, certs, node, port, extra, &[])
    }

    /// [`Worker::start`] with extra environment variables.
    pub fn start_env(
        model: &Path,
        certs: &Path,
        node: &str,
        port: u16,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut c = Command::new(env!("CARGO_BIN_EXE_charm"));
        c.envs(env.iter().copied());
        c.args([
            "worker",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--model",
        ])
        .arg(model)
        .args(["--node", node, "--cluster"])
        .arg(certs)
        .args(["--history", "none"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let Some(port) = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
        else {
            let _ = child.kill();
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("worker {node} did not start: {line} {err}");
        };
        Self { child, port }
    }

    pub fn addr(&self, node: &str) -> String {
        format!("{node}@127.0.0.1:{}", self.port)
    }
}

/// A cluster authority with certificates for the coordinator and workers w1..w3.
pub fn certs(tag: &str) -> PathBuf {
    let d = scratch(tag);
    let (ok, _, err) = charm(&[
        "cluster",
        "init",
        "--out",
        d.to_str().unwrap(),
        "--nodes",
        "w1,w2,w3",
    ]);
    assert!(ok, "{err}");
    d
}

/// `--workers` for `ws` (worker, node name).
pub fn workers_arg(ws: &[(&Worker, &str)]) -> String {
    ws.iter()
        .map(|(w, n)| w.addr(n))
        .collect::<Vec<_>>()
        .join(",")
}
