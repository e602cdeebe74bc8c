//! Command-line helpers shared by the benchmark harnesses.

use std::path::PathBuf;

/// The harness's arguments (after `cargo bench --bench NAME --`).
pub struct Args(Vec<String>);

impl Args {
    pub fn from_env() -> Self {
        Self(std::env::args().skip(1).collect())
    }

    /// The value after flag `k`, if given.
    pub fn get(&self, k: &str) -> Option<String> {
        self.0
            .iter()
            .position(|a| a == k)
            .and_then(|i| self.0.get(i + 1))
            .cloned()
    }

    /// `--model`, or the demo model.
    pub fn model(&self) -> PathBuf {
        self.get("--model").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/charm-bard-moe")
        })
    }

    /// A comma-separated list of counts (`default` when the flag is absent).
    // (each benchmark compiles its own copy; not all of them take a list)
    #[allow(dead_code)]
    pub fn counts(&self, k: &str, default: &str) -> Vec<usize> {
        self.get(k)
            .unwrap_or_else(|| default.into())
            .split(',')
            .map(|s| {
                s.parse()
                    .unwrap_or_else(|_| panic!("{k}: a list of counts"))
            })
            .collect()
    }
}
