//! Where the tests write: a folder of this test process's own under Cargo's
//! folder for test files (`target/tmp`), not the system's temporary one.
//! The first time a process asks, the folders of test processes that have
//! ended are removed, so runs do not pile up (the last run's stay to be
//! looked at).
//!
//! Cargo compiles the repository's and the CLI's paths into a test binary.
//! One packed and run on another machine (`scripts/gpu_check.sh --pack`) is
//! told them instead: DISTGPT_TEST_ROOT names the repository's copy there
//! (read, and written under its `target/tmp`), DISTGPT_TEST_BIN the
//! `distgpt` binary.

use std::path::{Path, PathBuf};
use std::sync::Once;

/// The repository: DISTGPT_TEST_ROOT, else where Cargo built this test.
#[allow(dead_code)] // not every includer reads the repository's files
pub fn repo() -> PathBuf {
    std::env::var_os("DISTGPT_TEST_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// The `distgpt` binary: DISTGPT_TEST_BIN, else the one Cargo built.
#[allow(dead_code)] // not every includer runs the CLI
pub fn distgpt_bin() -> PathBuf {
    std::env::var_os("DISTGPT_TEST_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_distgpt")))
}

/// An absent `name` in this process's folder (which exists).
pub fn scratch(name: &str) -> PathBuf {
    static SWEEP: Once = Once::new();
    let base = match std::env::var_os("DISTGPT_TEST_ROOT") {
        Some(root) => PathBuf::from(root).join("target/tmp"),
        None => PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
    };
    let base = base.as_path();
    SWEEP.call_once(|| sweep(base));
    let root = base.join(format!("distgpt-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let d = root.join(name);
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_file(&d);
    d
}

/// Removes the `distgpt-PID` folders of processes that are no longer
/// running (where /proc says which are).
fn sweep(base: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    for entry in std::fs::read_dir(base).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix("distgpt-"));
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
