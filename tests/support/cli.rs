//! Running the `distgpt` binary from a test: what the command-line tests share.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `distgpt ARGS`, its output whatever its status.
pub fn distgpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .output()
        .unwrap()
}

/// The output, having asserted that the command succeeded.
pub fn succeeded(out: Output) -> Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// An absent directory `distgpt-PREFIX-TAG-PID` under the system's
/// temporary one (a new run refuses a non-empty `--out`).
pub fn fresh_dir(prefix: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("distgpt-{prefix}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
