//! What the equivalence tests (threads and MPI) share: the tiny model, the
//! five-step run every strategy must follow, and the comparison with
//! `single`; and the small BERT the memory-plan checks run.

use distgpt::data::Dataset;
use distgpt::model::bert::{BertConfig, BertHead};
use distgpt::model::{GptConfig, ModelConfig};
use distgpt::train::{Duration, TrainConfig, TrainSummary};

/// A small BERT with `head`: 4 heads, so tp 2 and 4 split it.
#[allow(dead_code)] // the memory-plan checks use it, not every includer
pub fn small_bert(head: BertHead) -> ModelConfig {
    BertConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        n_inner: 256,
        block_size: 32,
        vocab_size: 200,
        ..BertConfig::mini_lm(head)
    }
    .into()
}

/// The tiny preset with the dataset's vocabulary.
pub fn tiny_model(ds: &Dataset) -> GptConfig {
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    model
}

#[path = "../support/scratch.rs"]
mod scratch;
#[allow(unused_imports)] // not every includer writes files or runs the CLI
pub use scratch::{distgpt_bin, repo, scratch};

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
        out_dir: scratch(&format!("eq-{tag}")),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    }
}

/// How far a run may be from the reference.
#[derive(Clone, Copy, Debug)]
pub struct Tolerances {
    /// Per-step losses, absolute.
    pub loss: f32,
    /// The final validation loss, absolute: after the steps, on parameters
    /// that may differ by `params`.
    pub val_loss: f32,
    /// Per-step global gradient norms, relative to the reference's: checked
    /// on their own because with clipping off a wrong norm (a tied copy
    /// counted twice) moves no loss and no parameter.
    pub grad_norm: f32,
    /// Final parameters, relative to the largest parameter.
    pub params: f32,
}

/// fp32: the layouts' reduction orders move the losses by about 1e-6 and
/// the norms by at most 2e-7 of themselves (threads and OpenCL alike).
pub const FP32_TOL: Tolerances = Tolerances {
    loss: 1e-5,
    val_loss: 1e-5,
    grad_norm: 1e-5,
    params: 1e-4,
};

/// Under bf16 a strategy's fp32 reduction order (1e-7 apart from single's)
/// can move a value across a rounding boundary, a 2^-8 step in that one
/// value, and with the activations held in bf16 (rounded as stored, as
/// autocast holds them) such a step reaches what follows it. Measured over
/// five steps of the tiny GPT-2 (tests/strategies.rs,
/// tests/bf16_products.rs), the worst against single's: losses 2.3e-5 (tp;
/// a bf16 product's own summation order 2.3e-5; the data-parallel ones
/// 5e-7), gradient norms 4.3e-5 of single's, final parameters 1.9e-3 of
/// the largest (Adam's first updates are about lr whatever the gradient's
/// size, so a gradient moved near zero moves its parameter by up to 2 lr),
/// the validation loss 2.6e-5. Before norm, fc and attention outputs were
/// held in bf16 they were 1.2e-5, 2.1e-5, 6.0e-4 and 2.5e-5. The bounds
/// keep about twice the worst. fp32 itself is 1.2e-3 of bf16's gradient
/// norms away (checked in tests/strategies.rs), so a strategy that ignored
/// --precision fails on them; its parameters and losses are no further
/// than these bounds allow (2.1e-3, 5.8e-5), so those two guard a strategy's
/// own errors, not the precision.
#[allow(dead_code)] // the files that train in bf16 use it, not every includer
pub const BF16_TOL: Tolerances = Tolerances {
    loss: 4e-5,
    val_loss: 5e-5,
    grad_norm: 1e-4,
    params: 4e-3,
};

/// Per-step losses, gradient norms and the final validation loss (the
/// strategy's own `eval_loss`), and the final parameters, within
/// [`FP32_TOL`] of the reference.
pub fn assert_follows(reference: &TrainSummary, got: &TrainSummary, what: &str) {
    assert_follows_within(reference, got, what, FP32_TOL);
}

/// As [`assert_follows`] within `tol`.
pub fn assert_follows_within(
    reference: &TrainSummary,
    got: &TrainSummary,
    what: &str,
    tol: Tolerances,
) {
    assert_eq!(got.losses.len(), reference.losses.len());
    assert!(
        (got.val_loss - reference.val_loss).abs() <= tol.val_loss,
        "{what}: validation loss {} vs single {}",
        got.val_loss,
        reference.val_loss
    );
    for (step, (a, b)) in got.losses.iter().zip(&reference.losses).enumerate() {
        assert!(
            (a - b).abs() <= tol.loss,
            "{what}: step {step} loss {a} vs single {b}"
        );
    }
    assert_eq!(got.history.len(), reference.history.len());
    for (step, (a, b)) in got.history.iter().zip(&reference.history).enumerate() {
        let (a, b) = (a.grad_norm, b.grad_norm);
        assert!(
            (a - b).abs() <= tol.grad_norm * b,
            "{what}: step {step} gradient norm {a} vs single {b}"
        );
    }
    let scale = reference.params.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let err = got
        .params
        .iter()
        .zip(&reference.params)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= tol.params * scale,
        "{what}: final parameters differ by {err} (largest parameter {scale})"
    );
}
