//! Running the `distgpt` binary from a test: what the command-line tests share.

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

#[path = "scratch.rs"]
mod scratch;
pub use scratch::scratch;
