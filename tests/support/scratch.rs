//! Where the tests write: a folder of this test process's own under Cargo's
//! folder for test files (`target/tmp`), not the system's temporary one.
//! The first time a process asks, the folders of test processes that have
//! ended are removed, so runs do not pile up (the last run's stay to be
//! looked at).

use std::path::{Path, PathBuf};
use std::sync::Once;

/// An absent `name` in this process's folder (which exists).
pub fn scratch(name: &str) -> PathBuf {
    static SWEEP: Once = Once::new();
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
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
