//! What the equivalence tests (threads and MPI) share: the tiny model, the
//! five-step run every strategy must follow, and the comparison with `single`.

use distgpt::data::Dataset;
use distgpt::model::GptConfig;
use distgpt::train::{Duration, TrainConfig, TrainSummary};

/// The tiny preset with the dataset's vocabulary.
pub fn tiny_model(ds: &Dataset) -> GptConfig {
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    model
}

/// An absent directory under the system's temporary one (a new run refuses a
/// non-empty `--out`, and a pid can come back from an earlier test run).
fn fresh_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Five optimizer steps at global batch 12 x 32.
pub fn five_steps(tag: &str, grad_accum: usize) -> TrainConfig {
    TrainConfig {
        batch_size: 12,
        seq_len: 32,
        grad_accum,
        duration: Duration::Steps(5),
        lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 2,
        seed: 11,
        out_dir: fresh_dir(&format!("distgpt-eq-{tag}-{}", std::process::id())),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    }
}

/// Per-step losses and the final validation loss (the strategy's own
/// `eval_loss`) within 1e-5; final parameters within 1e-4 of the largest parameter.
pub fn assert_follows(reference: &TrainSummary, got: &TrainSummary, what: &str) {
    assert_follows_within(reference, got, what, (1e-5, 1e-4));
}

/// As [`assert_follows`] with tolerances (loss, parameters relative to the
/// largest parameter).
pub fn assert_follows_within(
    reference: &TrainSummary,
    got: &TrainSummary,
    what: &str,
    (loss_tol, param_tol): (f32, f32),
) {
    assert_eq!(got.losses.len(), reference.losses.len());
    assert!(
        (got.val_loss - reference.val_loss).abs() <= loss_tol,
        "{what}: validation loss {} vs single {}",
        got.val_loss,
        reference.val_loss
    );
    for (step, (a, b)) in got.losses.iter().zip(&reference.losses).enumerate() {
        assert!(
            (a - b).abs() <= loss_tol,
            "{what}: step {step} loss {a} vs single {b}"
        );
    }
    let scale = reference.params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = got
        .params
        .iter()
        .zip(&reference.params)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= param_tol * scale,
        "{what}: final parameters differ by {err} (largest parameter {scale})"
    );
}
