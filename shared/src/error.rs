//! Errors raised while reading configs and checkpoints.
//!
//! Every variant names the file (and tensor, where there is one) so a user can tell which download
//! is damaged. These are all "bad input" errors: retrying will not help, fixing the files will.

use std::path::PathBuf;

/// Loading a model directory failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be opened, mapped or read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The safetensors header (or its framing) is malformed.
    #[error("{path}: malformed safetensors header: {reason}")]
    Header { path: PathBuf, reason: String },
    /// One tensor's header entry is inconsistent with the file.
    #[error("{path}: tensor `{tensor}`: {reason}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    /// The same tensor name appears in two shards.
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    /// A tensor the architecture needs is absent from every shard.
    #[error("{dir}: missing tensor `{tensor}`")]
    MissingTensor { dir: PathBuf, tensor: String },
    /// A tensor exists but its shape differs from what config.json implies.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, config.json implies {want:?}")]
    Shape {
        path: PathBuf,
        tensor: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    /// A weight holds NaN or infinity.
    #[error("{path}: tensor `{tensor}` holds a non-finite value at element {index}")]
    NonFinite {
        path: PathBuf,
        tensor: String,
        index: usize,
    },
    /// config.json is missing, unreadable or describes an impossible model.
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    /// The directory holds no weights.
    #[error("{dir}: no *.safetensors files found")]
    NoWeights { dir: PathBuf },
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
    pub fn config(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Config {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
