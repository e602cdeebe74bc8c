//! Helpers shared by the benchmark harnesses: their command line, test data, a median.
// (each benchmark compiles its own copy and uses part of it)
#![allow(dead_code)]

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

    /// Whether flag `k` is given.
    pub fn has(&self, k: &str) -> bool {
        self.0.iter().any(|a| a == k)
    }

    /// The value after flag `k` parsed, or `default` when the flag is absent.
    pub fn parsed<T: std::str::FromStr>(&self, k: &str, default: T) -> T {
        self.get(k).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{k}: cannot read `{v}`"))
        })
    }
}

/// `n` deterministic values in [-0.5, 0.5) (xorshift from `seed`).
pub fn noise(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
