//! `--device cuda` where it cannot run: without the `cuda` feature it says to
//! rebuild with it; with the feature on a machine without a GPU (CI here) it
//! names what is missing. Either way one clean line and a failing exit, never
//! a panic. On a machine with a GPU set DISTGPT_HAVE_CUDA=1 to skip the
//! no-GPU expectations.

#[allow(dead_code)] // only the binary's path
#[path = "support/scratch.rs"]
mod scratch;

use std::process::{Command, Output};

fn distgpt(args: &[&str]) -> Output {
    Command::new(scratch::distgpt_bin())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn device_cuda_without_a_usable_gpu_is_one_clean_error() {
    if std::env::var("DISTGPT_HAVE_CUDA").as_deref() == Ok("1") {
        return;
    }
    let out = distgpt(&["eval", "--device", "cuda", "no-such-model"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.starts_with("error: device: "), "{err}");
    if cfg!(feature = "cuda") {
        // No driver, no NVRTC/cuBLAS, or no GPU: whichever it is, named.
        assert!(
            err.contains("CUDA") || err.contains("libnvrtc") || err.contains("libcublas"),
            "{err}"
        );
    } else {
        assert!(err.contains("--features cuda"), "{err}");
    }
}

#[test]
fn devices_lists_cuda_or_says_it_is_not_built_in() {
    let out = distgpt(&["devices"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cuda: Vec<&str> = text.lines().filter(|l| l.starts_with("cuda")).collect();
    assert!(!cuda.is_empty(), "{text}");
    if !cfg!(feature = "cuda") {
        assert_eq!(
            cuda,
            ["cuda: not built in (rebuild with `--features cuda`)"]
        );
        return;
    }
    // Which files the loader gave: none without a driver, every library
    // (CUDA 13's where they stand in) on a machine with a GPU.
    let libs = cuda
        .iter()
        .find_map(|l| l.strip_prefix("cuda libraries loaded: "))
        .unwrap_or_else(|| panic!("no line of loaded libraries: {text}"));
    if std::env::var("DISTGPT_HAVE_CUDA").as_deref() == Ok("1") {
        for lib in [
            "/libcuda.so",
            "/libnvrtc.so",
            "/libcublas.so",
            "/libcublasLt.so",
        ] {
            assert!(libs.contains(lib), "{lib} not among the loaded: {libs}");
        }
    }
}

/// A DISTGPT_ATTENTION that is neither "flash" nor "gemm" is named before
/// the GPU is looked for, so it shows on any machine.
#[cfg(feature = "cuda")]
#[test]
fn an_unknown_attention_path_is_named() {
    let out = Command::new(scratch::distgpt_bin())
        .env("DISTGPT_ATTENTION", "fast")
        .args(["eval", "--device", "cuda", "no-such-model"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("DISTGPT_ATTENTION=\"fast\""), "{err}");
}
