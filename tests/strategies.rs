//! Every strategy follows `single`: same seed, same global batch, five
//! optimizer steps; per-step losses within 1e-5, per-step gradient norms
//! within 1e-5 of single's and final parameters (consolidated from shards)
//! within 1e-4 of the largest parameter. The same under `--precision bf16`,
//! against single in bf16.

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::Precision;
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::train::{train_lm, TrainSummary};
use std::sync::OnceLock;
use std::time::Duration as Wait;

fn dataset() -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| Dataset::load(None, TokenizerKind::Char).unwrap())
}

fn run(
    strategy: StrategyKind,
    world_size: usize,
    tp: usize,
    grad_accum: usize,
    recompute: bool,
) -> TrainSummary {
    run_model(
        common::tiny_model(dataset()),
        strategy,
        world_size,
        tp,
        grad_accum,
        (recompute, Precision::Fp32),
    )
}

fn run_model(
    model: distgpt::model::GptConfig,
    strategy: StrategyKind,
    world_size: usize,
    tp: usize,
    grad_accum: usize,
    (recompute, precision): (bool, Precision),
) -> TrainSummary {
    run_on(
        model,
        (strategy, world_size, tp),
        grad_accum,
        (recompute, precision),
        2,
    )
}

/// As [`run_model`], on `threads` threads.
fn run_on(
    model: distgpt::model::GptConfig,
    (strategy, world_size, tp): (StrategyKind, usize, usize),
    grad_accum: usize,
    (recompute, precision): (bool, Precision),
    threads: usize,
) -> TrainSummary {
    let ds = dataset();
    let tag = format!(
        "{strategy:?}-{world_size}-{tp}-{grad_accum}-{recompute}-{precision:?}-h{}-t{threads}",
        model.n_head
    );
    let cfg = common::five_steps(&tag, grad_accum);
    let par = ParallelConfig {
        strategy,
        world_size,
        tp,
        recompute,
        precision,
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    train_lm(Cpu::new, model, ds, &cfg, par, threads, Wait::from_secs(60))
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
}

fn single(grad_accum: usize, recompute: bool) -> &'static TrainSummary {
    static PLAIN: OnceLock<TrainSummary> = OnceLock::new();
    static ACCUM: OnceLock<TrainSummary> = OnceLock::new();
    match (grad_accum, recompute) {
        (1, false) => PLAIN.get_or_init(|| run(StrategyKind::Single, 1, 1, 1, false)),
        (2, false) => ACCUM.get_or_init(|| run(StrategyKind::Single, 1, 1, 2, false)),
        _ => unreachable!("recomputation is compared against the plain single run"),
    }
}

fn check(strategy: StrategyKind, worlds: &[usize]) {
    for &w in worlds {
        let what = format!("{strategy:?} on {w} ranks");
        common::assert_follows(single(1, false), &run(strategy, w, 1, 1, false), &what);
    }
    common::assert_follows(
        single(2, false),
        &run(strategy, 2, 1, 2, false),
        &format!("{strategy:?} with accumulation"),
    );
    common::assert_follows(
        single(1, false),
        &run(strategy, 2, 1, 1, true),
        &format!("{strategy:?} with recomputation"),
    );
}

/// A rank on two threads runs its batch in two parts, a thread each
/// (`model::parts`); on one thread, whole: the two follow each other.
#[test]
fn single_on_one_thread_matches_single_in_parts_on_two() {
    let one = run_on(
        common::tiny_model(dataset()),
        (StrategyKind::Single, 1, 1),
        1,
        (false, Precision::Fp32),
        1,
    );
    common::assert_follows(single(1, false), &one, "single on one thread");
}

#[test]
fn ddp_matches_single_over_five_steps() {
    check(StrategyKind::Ddp, &[2, 3, 4]);
}

#[test]
fn zero1_matches_single_over_five_steps() {
    check(StrategyKind::Zero1, &[2, 3, 4]);
}

#[test]
fn zero2_matches_single_over_five_steps() {
    check(StrategyKind::Zero2, &[2, 3, 4]);
}

#[test]
fn fsdp_matches_single_over_five_steps() {
    check(StrategyKind::Fsdp, &[2, 3, 4]);
}

#[test]
fn recomputation_alone_matches_single() {
    common::assert_follows(
        single(1, false),
        &run(StrategyKind::Single, 1, 1, 1, true),
        "single with recomputation",
    );
}

#[test]
fn tensor_parallel_matches_single_over_five_steps() {
    common::assert_follows(
        single(1, false),
        &run(StrategyKind::Tp, 2, 1, 1, false),
        "tp on 2 ranks",
    );
    common::assert_follows(
        single(2, false),
        &run(StrategyKind::Tp, 2, 1, 2, false),
        "tp with accumulation",
    );
    common::assert_follows(
        single(1, false),
        &run(StrategyKind::Tp, 2, 1, 1, true),
        "tp with recomputation",
    );
}

#[test]
fn dp_by_tp_mesh_matches_single_over_five_steps() {
    common::assert_follows(
        single(1, false),
        &run(StrategyKind::Ddp, 4, 2, 1, false),
        "ddp x tp 2 x 2",
    );
}

#[test]
fn tensor_parallel_on_four_ranks_matches_single() {
    // The tiny preset with 4 heads of 8, so that tp can split it 4 ways.
    let mut model = common::tiny_model(dataset());
    model.n_head = 4;
    let fp32 = (false, Precision::Fp32);
    let reference = run_model(model.clone(), StrategyKind::Single, 1, 1, 1, fp32);
    common::assert_follows(
        &reference,
        &run_model(model.clone(), StrategyKind::Tp, 4, 1, 1, fp32),
        "tp on 4 ranks",
    );
    common::assert_follows(
        &reference,
        &run_model(model, StrategyKind::Ddp, 4, 4, 1, fp32),
        "ddp x tp 1 x 4",
    );
}

#[test]
fn bf16_moves_training_within_bf16_rounding_and_every_strategy_follows_single_in_bf16() {
    let bf16 = |strategy, world, tp, accum, recompute| {
        let model = common::tiny_model(dataset());
        run_model(
            model,
            strategy,
            world,
            tp,
            accum,
            (recompute, Precision::Bf16),
        )
    };
    let reference = bf16(StrategyKind::Single, 1, 1, 1, false);
    let fp32 = single(1, false);
    let rel: Vec<f32> = reference
        .losses
        .iter()
        .zip(&fp32.losses)
        .map(|(a, b)| (a - b).abs() / b.abs())
        .collect();
    // bf16 operands change the arithmetic (the switch acts) but stay within
    // bf16's 2^-8 relative precision of fp32 over five steps.
    assert!(
        rel.iter().any(|&r| r > 0.0),
        "bf16 gave fp32's losses exactly"
    );
    assert!(
        rel.iter().all(|&r| r < 4e-3),
        "bf16 vs fp32 relative loss gaps {rel:?}"
    );
    // the gradient norms tell fp32 from bf16 (common::BF16_TOL)
    let gap = reference
        .history
        .iter()
        .zip(&fp32.history)
        .fold(0.0f32, |m, (a, b)| {
            m.max(((a.grad_norm - b.grad_norm) / a.grad_norm).abs())
        });
    assert!(
        gap > 4.0 * common::BF16_TOL.grad_norm,
        "fp32's gradient norms are only {gap} of bf16's away: the tolerance cannot tell them \
         apart"
    );
    for (strategy, world, tp) in [
        (StrategyKind::Ddp, 2, 1),
        (StrategyKind::Zero1, 2, 1),
        (StrategyKind::Zero2, 3, 1),
        (StrategyKind::Fsdp, 2, 1),
        (StrategyKind::Tp, 2, 1),
        (StrategyKind::Ddp, 4, 2),
    ] {
        let what = format!("{strategy:?} on {world} ranks (tp {tp}) in bf16");
        common::assert_follows_within(
            &reference,
            &bf16(strategy, world, tp, 1, false),
            &what,
            common::BF16_TOL,
        );
    }
    common::assert_follows_within(
        &reference,
        &bf16(StrategyKind::Fsdp, 2, 1, 1, true),
        "fsdp with recomputation in bf16",
        common::BF16_TOL,
    );
}

/// Under bf16 the products read the weights' bf16 copy, which a strategy
/// rounds when the weights change (an update, a load, an fsdp gather):
/// before and after each of three steps and after a load, the loss a strategy evaluates is the loss
/// the model computes from the same fp32 weights when its products round
/// them themselves (no copy), bit for bit. On two ranks the batch's halves
/// are the same rows, so each rank's loss is the reference's on one half.
#[test]
fn the_weights_bf16_copy_follows_every_update() {
    use distgpt::data::Batch;
    use distgpt::model::gpt2::{init_full, Engine};
    use distgpt::model::{AdamWConfig, TpPlace, Whole};
    use distgpt::parallel::{self, launch, Pipeline, StepConfig};
    let cfg = common::tiny_model(dataset());
    let (b, t, v) = (4, 16, cfg.vocab_size);
    let init = init_full(&cfg, 1);
    // `rows` rows, each half the same
    let batch = |seed: usize, rows: usize| {
        let ids = |s: usize| -> Vec<u32> {
            let half: Vec<u32> = (0..rows / 2 * t)
                .map(|i| ((i * 7 + s * 13) % v) as u32)
                .collect();
            [half.clone(), half].concat()
        };
        Batch::lm(ids(seed), ids(seed + 1))
    };
    let two_stages = Pipeline {
        stages: 2,
        ..Default::default()
    };
    for (strategy, world, pipeline) in [
        (StrategyKind::Ddp, 1, Pipeline::default()),
        (StrategyKind::Zero2, 2, Pipeline::default()),
        (StrategyKind::Fsdp, 2, Pipeline::default()),
        (StrategyKind::Ddp, 2, two_stages),
    ] {
        let par = ParallelConfig {
            strategy,
            world_size: world,
            tp: 1,
            recompute: false,
            precision: Precision::Bf16,
            pipeline,
            offload: Default::default(),
            offload_serial: false,
        };
        let runs = launch::run_local(world, 2, Wait::from_secs(60), |comm| {
            let adamw = AdamWConfig::default();
            let mut s = parallel::build(Cpu::new(), cfg.clone(), par, comm.as_ref(), adamw, b, t)?;
            s.load_full(&init)?;
            let mut seen = Vec::new();
            for step in 0..3 {
                seen.push((s.full_params()?, s.eval_loss(&batch(100, b))?));
                let cfg = StepConfig {
                    lr: 1e-2,
                    grad_clip: 1.0,
                };
                s.step(&[batch(step, b)], cfg)?;
            }
            // after the last step, and after a load over rounded weights
            seen.push((s.full_params()?, s.eval_loss(&batch(100, b))?));
            s.load_full(&init)?;
            seen.push((s.full_params()?, s.eval_loss(&batch(100, b))?));
            Ok(seen)
        })
        .unwrap_or_else(|e| panic!("{par:?}: {e}"));
        // each data-parallel rank's rows
        let rows = b / (world / pipeline.stages);
        let eval = batch(100, b).rows(b, 0..rows);
        let when = [
            "before step 1",
            "before step 2",
            "before step 3",
            "after step 3",
            "after a load",
        ];
        assert_eq!(runs[0].len(), when.len());
        for ((params, loss), when) in runs[0].iter().zip(when) {
            let mut engine = Engine::new(Cpu::new(), cfg.clone(), TpPlace::NONE, false).unwrap();
            engine.set_precision(Precision::Bf16);
            let mut m = Whole::with_engine(engine).unwrap();
            m.load_full(params).unwrap();
            let terms = eval.loss_terms();
            let want = m
                .run_forward(&eval, (rows, t), terms, None)
                .unwrap()
                .unwrap();
            assert!(
                loss.to_bits() == want.to_bits(),
                "{strategy:?} x{world}, {} stage(s), {when}: loss {loss} where the weights give {want}",
                pipeline.stages
            );
        }
    }
}
