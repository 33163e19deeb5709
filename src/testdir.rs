//! Unit tests' folders under the system's temporary one, each removed when
//! its guard is dropped: at the end of the test, passed or failed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// An empty folder `distgpt-NAME-PID-N` (N counts this process's, so tests
/// running side by side never share one), removed on drop.
pub(crate) struct TestDir(PathBuf);

impl TestDir {
    pub(crate) fn new(name: &str) -> Self {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("distgpt-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `path` made a named pipe (a FIFO) no one writes: opening it to read
/// blocks for ever.
pub(crate) fn make_fifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a mode
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "mkfifo {}",
        path.display()
    );
}

/// `read` on a thread of its own, waited for 20 s: a read that blocks on a
/// pipe fails the test instead of hanging it.
pub(crate) fn within_20_s<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(read()));
    (rx.recv_timeout(std::time::Duration::from_secs(20))).expect("the read hung on a pipe")
}
