//! The library's error type: each variant names the file, tensor or value at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The OS error is part of the message and not chained as a source, so
    /// that `{:#}` does not print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("bad input: {0}")]
    Input(String),
    #[error("{path}: not a valid token shard: {reason}")]
    Shard { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("device: {0}")]
    Device(String),
    #[error("communication: {0}")]
    Comm(String),
    #[error("training diverged: {0}")]
    Diverged(String),
    #[error("injected fault on rank {rank} at step {step}")]
    Fault { rank: usize, step: usize },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause,
        }
    }

    /// A checkpoint, model file or run record at `path` that cannot be used.
    pub fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
