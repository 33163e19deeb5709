//! `distgpt prune` on a small model: each level prunes exactly its fraction
//! of every block weight matrix (or of all of them, globally) and nothing
//! else, fine-tuning keeps the pruned weights at zero, the report has a row
//! per level (with int8 beside fp32 when asked), row pruning writes a
//! smaller model that `bench --model` takes, `--sweep` times both methods,
//! and a bad schedule is refused.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::gpt2::BlockParam;
use distgpt::model::{Gpt2, GptConfig, ParamLayout};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::{load_model, save_model};

/// A model folder of the tiny preset with random weights.
fn model_dir(tag: &str) -> (PathBuf, GptConfig) {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = ds.tokenizer.vocab_size();
    let mut m = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
    m.init_weights(3).unwrap();
    let dir = scratch(&format!("prune-{tag}"));
    save_model(&m, ds.tokenizer.spec(), &dir).unwrap();
    (dir, cfg)
}

fn prune(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .arg("prune")
        .arg(model)
        .arg("--out")
        .arg(out)
        .args([
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--eval-batches",
            "2",
        ])
        .args(extra)
        .output()
        .unwrap()
}

fn params(dir: &Path) -> (Vec<f32>, Gpt2<Cpu>) {
    let (m, _) = load_model(Cpu::new(), dir).unwrap();
    (m.params_host().unwrap(), m)
}

/// The ranges prune's magnitude method may zero, named here apart from the
/// family's rule: every block's qkv, attention projection, MLP and MLP
/// projection weights.
fn prunable(layout: &ParamLayout, n_layer: usize) -> Vec<Range<usize>> {
    let matrices = [
        BlockParam::QkvW,
        BlockParam::AttnProjW,
        BlockParam::FcW,
        BlockParam::FcProjW,
    ];
    (0..n_layer)
        .flat_map(|l| matrices.map(|p| layout.block_param(l, p)))
        .collect()
}

fn zeros(x: &[f32]) -> usize {
    x.iter().filter(|&&v| v == 0.0).count()
}

#[test]
fn every_level_prunes_its_fraction_and_fine_tuning_keeps_the_zeros() {
    let (dir, cfg) = model_dir("levels");
    let (before, m) = params(&dir);
    let ranges = prunable(&m.core.layout, cfg.n_layer);
    let out = dir.join("pruned");
    let run = prune(
        &dir,
        &out,
        &["--sparsity", "0.3,0.6", "--finetune-steps", "5"],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (after, _) = params(&out);
    let mut in_ranges = vec![false; after.len()];
    for r in &ranges {
        let want = (0.6 * r.len() as f64).round() as usize;
        assert_eq!(zeros(&after[r.clone()]), want, "zeros in {r:?}");
        in_ranges[r.clone()].iter_mut().for_each(|f| *f = true);
    }
    let outside = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .zip(&in_ranges)
            .filter(|(_, &f)| !f)
            .map(|(v, _)| *v)
            .collect()
    };
    assert_ne!(
        outside(&after),
        outside(&before),
        "fine-tuning changed nothing"
    );
    let csv = std::fs::read_to_string(out.join("prune.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 4, "{csv}");
    let fields: Vec<&str> = rows[3].split(',').collect();
    assert_eq!(fields[0], "magnitude", "{csv}");
    let last: Vec<f64> = fields[1..6].iter().map(|x| x.parse().unwrap()).collect();
    assert_eq!(last[0], 0.6, "{csv}");
    assert!((last[1] - 0.6).abs() < 1e-3, "{csv}");
    assert_eq!(
        last[2],
        cfg.num_params() as f64,
        "magnitude keeps the shapes"
    );
    assert!(last[3..].iter().all(|l| l.is_finite() && *l > 0.0), "{csv}");
    assert!(
        fields[6..].iter().all(|f| f.is_empty()),
        "no int8 or timing unasked: {csv}"
    );
    for f in ["prune.json", "prune_val_loss.png", "prune_val_loss.svg"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    // Without fine-tuning nothing outside the weight matrices moves.
    let out0 = dir.join("pruned-only");
    let run = prune(&dir, &out0, &["--sparsity", "0.6"]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (only, _) = params(&out0);
    assert_eq!(
        outside(&only),
        outside(&before),
        "pruning reached past the weight matrices"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn global_scope_prunes_the_fraction_of_all_matrices_together() {
    let (dir, cfg) = model_dir("global");
    let out = dir.join("pruned");
    let run = prune(
        &dir,
        &out,
        &["--sparsity", "0.5", "--scope", "global", "--int8"],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // --int8: each row's int8 loss beside its fp32 one, within int8's error.
    let csv = std::fs::read_to_string(out.join("prune.csv")).unwrap();
    for row in csv.lines().skip(1) {
        let f: Vec<f64> = row
            .split(',')
            .skip(1)
            .take(6)
            .map(|x| x.parse().unwrap())
            .collect();
        assert!((f[5] / f[4] - 1.0).abs() < 0.05, "{csv}");
    }
    let (after, m) = params(&out);
    let ranges = prunable(&m.core.layout, cfg.n_layer);
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    let z: usize = ranges.iter().map(|r| zeros(&after[r.clone()])).sum();
    assert_eq!(z, (0.5 * total as f64).round() as usize);
    // One threshold: the matrices end up unevenly pruned (init scales differ).
    let fractions: Vec<f64> = ranges
        .iter()
        .map(|r| zeros(&after[r.clone()]) as f64 / r.len() as f64)
        .collect();
    assert!(
        fractions.iter().any(|&f| (f - 0.5).abs() > 0.01),
        "{fractions:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rows_pruning_saves_a_smaller_model_and_the_sweep_times_both_methods() {
    let (dir, cfg) = model_dir("sweep");
    let out = dir.join("sweep");
    let run = prune(
        &dir,
        &out,
        &[
            "--sweep",
            "--sparsity",
            "0.5",
            "--finetune-steps",
            "2",
            "--int8",
            "--time-steps",
            "1",
            "--time-tokens",
            "4",
        ],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // rows: each block keeps one of its two heads and half its MLP units
    let (_, small) = params(&out.join("rows"));
    let widths: Vec<(usize, usize)> = small
        .config
        .blocks
        .iter()
        .map(|b| (b.heads, b.hidden))
        .collect();
    assert_eq!(widths, vec![(1, 2 * cfg.n_embd); cfg.n_layer]);
    assert!(small.config.num_params() < cfg.num_params());
    let (_, magnitude) = params(&out.join("magnitude"));
    assert_eq!(magnitude.config, cfg);
    let csv = std::fs::read_to_string(out.join("prune.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 4, "dense and 50% for each method: {csv}");
    for (row, method) in rows.iter().zip(["magnitude", "magnitude", "rows", "rows"]) {
        assert_eq!(row[0], method, "{csv}");
        let nums: Vec<f64> = row[1..].iter().map(|x| x.parse().unwrap()).collect();
        assert!(nums[3..].iter().all(|x| x.is_finite() && *x > 0.0), "{csv}");
    }
    assert_eq!(rows[3][3], small.config.num_params().to_string(), "{csv}");
    assert!(
        (rows[3][2].parse::<f64>().unwrap() - 0.5).abs() < 1e-9,
        "{csv}"
    );
    for f in ["prune_val_loss", "prune_step_time", "prune_token_time"] {
        assert!(out.join(format!("{f}.svg")).is_file(), "{f}");
    }
    // the report names each run's method, and no one method for the sweep
    // (its config said "rows", the last method the loop set)
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("prune.json")).unwrap()).unwrap();
    assert!(report["config"]["method"].is_null(), "{report}");
    let methods: Vec<&str> = (report["runs"].as_array().unwrap().iter())
        .map(|r| r["method"].as_str().unwrap())
        .collect();
    assert_eq!(methods, ["magnitude", "rows"]);
    // bench takes the pruned folder's shape, and refuses to reshape it
    let bench = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .args(["bench", "--model"])
            .arg(out.join("rows"))
            .args([
                "--steps",
                "1",
                "--warmup",
                "0",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let run = bench(&["--strategy", "fsdp", "--world-size", "2"]);
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let params = format!("({} params)", small.config.num_params());
    assert!(text.contains(&params), "{params} in {text}");
    let run = bench(&["--n-layer", "3"]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && err.contains("not the model read from"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_schedule_that_does_not_increase_is_refused_in_words() {
    let (dir, _) = model_dir("bad");
    let run = prune(&dir, &dir.join("pruned"), &["--sparsity", "0.5,0.3"]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(
        err.contains("must increase") && !err.contains("panicked"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
