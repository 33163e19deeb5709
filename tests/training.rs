//! Training end to end on the embedded corpus, and weights that survive a
//! save/load round trip.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::{AdamWConfig, GptConfig};
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::train::{train_lm, Duration, TrainConfig};
use std::time::Duration as Wait;

#[path = "support/gpt2_files.rs"]
mod gpt2_files;
use gpt2_files::load_model;

fn tiny_config(out: &std::path::Path, steps: usize) -> TrainConfig {
    TrainConfig {
        batch_size: 16,
        duration: Duration::Steps(steps),
        lr: 1e-2,
        min_lr: 1e-3,
        warmup_steps: 10,
        adamw: AdamWConfig {
            beta2: 0.99,
            ..AdamWConfig::default()
        },
        eval_batches: 4,
        sample_tokens: 40,
        seed: 3,
        out_dir: out.to_path_buf(),
        peak_flops: Some(1e11),
        ..TrainConfig::default()
    }
}

fn single() -> ParallelConfig {
    ParallelConfig {
        strategy: StrategyKind::Single,
        world_size: 1,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    scratch(&format!("test-{name}"))
}

#[test]
fn tiny_model_learns_shakespeare() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = ds.tokenizer.vocab_size();
    let out = tmp("learn");
    let s = train_lm(
        Cpu::new,
        cfg,
        &ds,
        &tiny_config(&out, 300),
        single(),
        2,
        Wait::from_secs(60),
    )
    .unwrap();
    // ln(84) = 4.43 at the start; character statistics alone take it far below.
    assert!(s.first_loss > 4.0, "first loss {}", s.first_loss);
    assert!(s.final_loss < 2.8, "final train loss {}", s.final_loss);
    assert!(s.val_loss < 2.9, "val loss {}", s.val_loss);
    assert_eq!(s.sample.chars().count(), 40);
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 300);
    let last: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
    for key in [
        "loss",
        "val_loss",
        "grad_norm",
        "lr",
        "ms",
        "tokens_per_s",
        "mfu",
    ] {
        assert!(last[key].is_number(), "metrics lack {key}: {last}");
    }
    assert!(
        last["memory"]["peak_bytes"]["activations"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn saved_weights_reload_to_identical_logits() {
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = ds.tokenizer.vocab_size();
    let out = tmp("reload");
    train_lm(
        Cpu::new,
        cfg,
        &ds,
        &tiny_config(&out, 3),
        single(),
        2,
        Wait::from_secs(60),
    )
    .unwrap();
    let (mut a, meta) = load_model(Cpu::new(), &out).unwrap();
    let (mut b, _) = load_model(Cpu::new(), &out).unwrap();
    assert_eq!(meta.tokenizer, ds.tokenizer.spec());
    let tokens: Vec<u32> = ds.tokenizer.encode("ROMEO. But soft").unwrap();
    a.forward(&tokens, None, 1, tokens.len()).unwrap();
    b.forward(&tokens, None, 1, tokens.len()).unwrap();
    assert_eq!(
        a.logits(0, tokens.len() - 1).unwrap(),
        b.logits(0, tokens.len() - 1).unwrap()
    );
    assert!(a.params_host().unwrap().iter().any(|&x| x != 0.0));
}
