//! Command-line manners: output that ends with a newline, no empty frames.

use std::process::Command;

fn distgpt(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn generate_ends_its_output_with_a_newline_and_no_sample_means_no_frame() {
    let dir = std::env::temp_dir().join(format!("distgpt-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.to_str().unwrap();
    let train = distgpt(&[
        "train",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--quiet",
        "--peak-gflops",
        "100",
        "--sample-tokens",
        "0",
        "--out",
        out,
    ]);
    assert!(
        train.status.success(),
        "{}",
        String::from_utf8_lossy(&train.stderr)
    );
    let text = String::from_utf8_lossy(&train.stdout);
    assert!(!text.contains("--- sample ---"), "{text}");

    let gen = distgpt(&["generate", "--run", out, "--tokens", "5", "--prompt", "A"]);
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    let text = String::from_utf8_lossy(&gen.stdout);
    assert!(text.starts_with('A') && text.ends_with('\n'), "{text:?}");
}
