//! `distgpt bench --profile`'s figures against what the model does: the
//! kernels' calls by the model's shape, and their FLOPs adding up to the
//! model FLOPs MFU counts.

use std::process::Command;

/// `distgpt bench --model tiny --profile --json` with `extra` (one timed
/// step), its JSON row.
pub fn profiled_tiny_bench(bin: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let out = Command::new(bin)
        .args([
            "bench",
            "--model",
            "tiny",
            "--batch-size",
            "8",
            "--seq-len",
            "32",
        ])
        .args(["--steps", "2", "--warmup", "1", "--profile", "--json"])
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{extra:?}: {err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The profile of a step of `tiny` (2 blocks, GPT-2) in `pp` stages, of a
/// process holding `held` of the world's ranks (1 for thread ranks, 1 /
/// world under mpirun): each micro-batch's kernels counted once a part (a
/// rank's calls are the process's over its ranks: a stage runs 1/pp of
/// them), the products' and attention's FLOPs the process's share of the
/// model's (MFU also counts the layernorms' and biases' vectors: 2.4%
/// more for `tiny`), the times adding up to the step.
pub fn assert_profile_counts_tiny(row: &serde_json::Value, pp: f64, held: f64, what: &str) {
    let p = &row["profile"];
    let kernels = p["kernels"].as_array().expect("a profile");
    let grad_accum = row["grad_accum"].as_f64().unwrap();
    let a_rank = row["parts"].as_f64().unwrap() * grad_accum / pp;
    let calls = |name: &str| {
        let k = kernels.iter().find(|k| k["kernel"] == name);
        k.and_then(|k| k["calls_per_step"].as_f64()).unwrap_or(0.0)
    };
    // 2 blocks of qkv, projection, fc, fc projection, then the LM head
    for (name, per_part) in [
        ("matmul_forward", 9.0),
        ("matmul_backward", 9.0),
        ("attention_forward", 2.0),
        ("attention_backward", 2.0),
        ("layernorm_forward", 5.0),
        ("encoder_forward", 1.0),
        ("crossentropy_forward", 1.0),
    ] {
        assert_eq!(calls(name), per_part * a_rank, "{what}: {name} in {p}");
    }
    let flops: f64 = kernels
        .iter()
        .filter_map(|k| Some(k["gflops"].as_f64()? * 1e9 * k["ms_per_step"].as_f64()? / 1e3))
        .sum();
    let tokens = row["batch"].as_f64().unwrap() * row["seq"].as_f64().unwrap() * grad_accum;
    let model = row["flops_per_token"].as_f64().unwrap() * tokens * held;
    let ratio = flops / model;
    assert!(
        (0.97..=0.99).contains(&ratio),
        "{what}: {flops} of {model} FLOPs"
    );
    let shares: f64 = kernels.iter().map(|k| k["share"].as_f64().unwrap()).sum();
    let outside = p["outside_share"].as_f64().unwrap();
    assert!((shares + outside - 1.0).abs() < 1e-9, "{what}: {p}");
    // (a tiny model's ddp step can be mostly its all-reduce: no floor on
    // the kernels' share beyond their being counted)
    assert!(shares > 0.0 && outside > -1e-9, "{what}: {p}");
}
