//! Generation with the KV cache under tensor parallelism follows the
//! single-rank model token for token (greedy).

#[cfg(feature = "mpi")]
#[path = "support/scratch.rs"]
mod scratch;
#[cfg(feature = "mpi")]
use scratch::scratch;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::WeightFormat;
use distgpt::model::gpt2::kv::{DecodeWeights, Decoder};
use distgpt::model::{Engine, Gpt2, GptConfig, TpPlace};
use distgpt::parallel::launch;
use distgpt::{
    model::gpt2::generate::{decode, evaluate_decoded, generate},
    sample::SampleConfig,
};
use std::time::Duration;

#[test]
fn tensor_parallel_greedy_generation_matches_one_rank() {
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = 60;
    let mut model = Gpt2::new(Cpu::new(), cfg.clone()).unwrap();
    model.init_weights(4).unwrap();
    // every prompt's first three positions go in one prefill, on both ranks
    let prompts = vec![vec![3, 1, 4, 1, 5], vec![9, 2, 6, 5]];
    let sc = SampleConfig {
        max_new_tokens: 20,
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let want = generate(&model, &prompts, &sc, None, |_, _| {}).unwrap();
    let got = launch::run_local(2, 2, Duration::from_secs(30), |comm| {
        let place = TpPlace {
            rank: comm.rank(),
            size: comm.size(),
        };
        let mut part = Gpt2::with_engine(Engine::new(Cpu::new(), cfg.clone(), place, false)?)?;
        part.load_full(&model.params_host()?)?;
        let weights = DecodeWeights::new(
            part.backend(),
            &cfg,
            place,
            part.params.s(),
            WeightFormat::F32,
        )?;
        let mut dec = Decoder::new(Cpu::new(), cfg.clone(), place, prompts.len(), 25)?;
        decode(
            &mut dec,
            &weights,
            &prompts,
            25,
            &sc,
            None,
            Some(comm.as_ref()),
            |_, _| {},
        )
    })
    .unwrap();
    assert_eq!(got[0], want);
    assert_eq!(got[1], want);
}

/// The whole model on one rank.
const WHOLE: TpPlace = TpPlace { rank: 0, size: 1 };

/// The whole model's weights packed for decoding as `format`.
fn packed(model: &Gpt2<Cpu>, format: WeightFormat) -> DecodeWeights<'_, Cpu> {
    DecodeWeights::new(
        model.backend(),
        &model.config,
        WHOLE,
        model.params.s(),
        format,
    )
    .unwrap()
}

/// Logits of every position of `seq` fed one token at a time.
fn decoded_logits(model: &Gpt2<Cpu>, seq: &[u32], format: WeightFormat) -> Vec<Vec<f32>> {
    let weights = packed(model, format);
    let mut dec = Decoder::new(Cpu::new(), model.config.clone(), WHOLE, 1, seq.len()).unwrap();
    seq.iter()
        .enumerate()
        .map(|(pos, &t)| {
            dec.step(&weights, &[t], pos, None, true).unwrap();
            dec.logits(0).unwrap()
        })
        .collect()
}

/// A tiny random model (vocabulary 60) and a 24-token sequence to decode.
fn tiny_model_and_sequence() -> (Gpt2<Cpu>, Vec<u32>) {
    let mut cfg = GptConfig::preset("tiny").unwrap();
    cfg.vocab_size = 60;
    let mut model = Gpt2::new(Cpu::new(), cfg).unwrap();
    model.init_weights(7).unwrap();
    (model, (0..24).map(|i| (i * 7 % 60) as u32).collect())
}

/// Every row's logits at every position of a 5-row batch decoded in a
/// pool of `threads` threads (the CPU decodes a small model's rows in one
/// part a thread).
fn batch_logits(model: &Gpt2<Cpu>, format: WeightFormat, threads: usize) -> Vec<Vec<f32>> {
    let rows: Vec<Vec<u32>> = (0..5u32)
        .map(|r| (0..12).map(|i| (i * 7 + r * 11) % 60).collect())
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let weights = packed(model, format);
        let mut dec = Decoder::new(Cpu::new(), model.config.clone(), WHOLE, 5, 12).unwrap();
        let mut out = Vec::new();
        for pos in 0..12 {
            let column: Vec<u32> = rows.iter().map(|r| r[pos]).collect();
            dec.step(&weights, &column, pos, None, true).unwrap();
            out.extend((0..5).map(|r| dec.logits(r).unwrap()));
        }
        out
    })
}

#[test]
fn a_batch_decoded_in_parts_gives_the_logits_of_one_part() {
    let (model, _) = tiny_model_and_sequence();
    for format in [WeightFormat::F32, WeightFormat::Int8] {
        // three parts (rows 0, 1-2, 3-4) against one
        let (parts, whole) = (
            batch_logits(&model, format, 3),
            batch_logits(&model, format, 1),
        );
        assert_eq!(parts.len(), whole.len());
        // the same arithmetic per row, but for the fp32 kernel's order of
        // sums, which follows the rows a product has
        for (i, (p, w)) in parts.iter().zip(&whole).enumerate() {
            let worst = p
                .iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                worst < 1e-5,
                "{format:?}: position {} row {}: {worst}",
                i / 5,
                i % 5
            );
        }
    }
}

#[test]
fn bf16_decoding_stays_within_bf16_rounding_of_fp32() {
    let (mut model, seq) = tiny_model_and_sequence();
    let cfg = model.config.clone();
    let full = decoded_logits(&model, &seq, WeightFormat::F32);
    let half = decoded_logits(&model, &seq, WeightFormat::Bf16);
    // The fp32 decoder is the training forward's arithmetic.
    model.forward(&seq, None, 1, seq.len()).unwrap();
    let mut worst_fp32 = 0.0f32;
    let mut worst_bf16 = 0.0f32;
    let mut spread = 0.0f32;
    for (pos, (f, h)) in full.iter().zip(&half).enumerate() {
        let reference = &model.logits(0, pos).unwrap()[..cfg.vocab_size];
        for ((&r, &f), &h) in reference.iter().zip(f).zip(h) {
            worst_fp32 = worst_fp32.max((f - r).abs());
            worst_bf16 = worst_bf16.max((h - f).abs());
            spread = spread.max(r.abs());
        }
    }
    assert!(
        worst_fp32 < 1e-4,
        "fp32 decoding drifts from the forward: {worst_fp32}"
    );
    assert!(
        worst_bf16 > 0.0,
        "bf16 weights changed nothing: the path is not in use"
    );
    assert!(
        worst_bf16 < 0.01 * spread,
        "bf16 decoding is off by {worst_bf16} (logits up to {spread})"
    );
}

#[test]
fn int8_decoding_stays_within_quantization_error_of_fp32() {
    let (model, seq) = tiny_model_and_sequence();
    let full = decoded_logits(&model, &seq, WeightFormat::F32);
    let int8 = decoded_logits(&model, &seq, WeightFormat::Int8);
    let (mut worst, mut spread, mut err2, mut sum2) = (0.0f32, 0.0f32, 0.0f64, 0.0f64);
    for (f, q) in full.iter().zip(&int8) {
        for (&f, &q) in f.iter().zip(q) {
            worst = worst.max((q - f).abs());
            spread = spread.max(f.abs());
            err2 += ((q - f) as f64).powi(2);
            sum2 += (f as f64).powi(2);
        }
    }
    assert!(
        worst > 0.0,
        "int8 weights changed nothing: the path is not in use"
    );
    let rel = (err2 / sum2).sqrt();
    assert!(
        rel < 0.05,
        "int8 logits are {:.1}% off fp32's (RMS)",
        100.0 * rel
    );
    assert!(
        worst < 0.1 * spread,
        "int8 decoding is off by {worst} (logits up to {spread})"
    );
}

#[test]
fn decoded_evaluation_matches_the_forward_and_int8_agrees_with_fp32() {
    let (mut model, seq) = tiny_model_and_sequence();
    let (rows, t) = (2, 12);
    let inputs: Vec<u32> = seq[..rows * t].to_vec();
    let targets: Vec<u32> = seq[1..]
        .iter()
        .chain(&seq[..1])
        .take(rows * t)
        .copied()
        .collect();
    let batch = || [(inputs.clone(), targets.clone())];
    let same = evaluate_decoded(&model, WeightFormat::F32, batch(), rows, t).unwrap();
    assert_eq!(same.loss, same.loss_f32);
    assert_eq!((same.top1_agreement, same.tokens), (1.0, rows * t));
    let forward = model
        .forward(&inputs, Some(&targets), rows, t)
        .unwrap()
        .unwrap() as f64;
    assert!(
        (same.loss - forward).abs() < 1e-4,
        "decoded {} vs forward {forward}",
        same.loss
    );
    let int8 = evaluate_decoded(&model, WeightFormat::Int8, batch(), rows, t).unwrap();
    assert_eq!(int8.loss_f32, same.loss_f32);
    assert!(int8.loss != int8.loss_f32, "int8 weights in use");
    assert!((int8.loss / int8.loss_f32 - 1.0).abs() < 0.02, "{int8:?}");
    let short = evaluate_decoded(
        &model,
        WeightFormat::F32,
        [(vec![1, 2], vec![2, 3])],
        rows,
        t,
    );
    assert!(short.unwrap_err().to_string().contains("were expected"));
}

/// Tensor-parallel generation across Open MPI processes prints what one
/// process prints (same seed; rank 0 samples and broadcasts).
#[cfg(feature = "mpi")]
#[test]
fn tensor_parallel_generation_over_mpi_matches_one_process() {
    use std::process::Command;
    let run = scratch("mpi-generate");
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let trained = Command::new(bin)
        .args([
            "train",
            "--model",
            "tiny",
            "--steps",
            "30",
            "--batch-size",
            "4",
        ])
        .args(["--seq-len", "32", "--eval-every", "0", "--out"])
        .arg(&run)
        .output()
        .unwrap();
    assert!(trained.status.success(), "{trained:?}");
    let sample = [
        "--prompt",
        "ROMEO:",
        "--tokens",
        "40",
        "--temperature",
        "1",
        "--seed",
        "7",
    ];
    let one = Command::new(bin)
        .args(["generate"])
        .arg(&run)
        .args(sample)
        .output()
        .unwrap();
    let two = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", bin])
        .args(["generate", "--comm", "mpi", "--tp", "2"])
        .arg(&run)
        .args(sample)
        .output()
        .unwrap();
    assert!(
        one.status.success() && two.status.success(),
        "{one:?}\n{two:?}"
    );
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let new: std::collections::BTreeSet<char> = text(&one)["ROMEO:".len()..].chars().collect();
    assert!(new.len() >= 3, "a degenerate sample proves little: {one:?}");
    assert_eq!(text(&one), text(&two));
    assert!(
        String::from_utf8_lossy(&two.stderr).contains("tp 2"),
        "{two:?}"
    );
    std::fs::remove_dir_all(&run).ok();
}
