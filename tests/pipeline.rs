//! Pipeline parallelism follows `single` with the same accumulation: the
//! micro-batches a pipeline streams are `single`'s accumulation steps, so
//! every layout of {gpipe, 1f1b} x {pp 2, 4} x {dp 1, 2} x {tp 1, 2}, with
//! recomputation, matches over five steps (losses within 1e-5, gradient
//! norms within 1e-5 of single's, parameters within 1e-4 of the largest),
//! and so does every cell of the grid {ddp, zero1, zero2, fsdp} x {pp 1, 2,
//! 4} x {tp 1, 2}, and interleaved 1F1B (two chunks a rank) with each of
//! them; with clipping off too, where only the reported norm can show a
//! norm counted wrongly. BERT too, both heads (its masked-LM decoder is
//! tied to the word embeddings across the first and last stage).

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::parallel::{ParallelConfig, Pipeline, Schedule, StrategyKind};
use distgpt::train::{train_lm, TrainConfig, TrainSummary};
use std::sync::OnceLock;
use std::time::Duration as Wait;

const ACCUM: usize = 4;

fn dataset() -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| Dataset::load(None, TokenizerKind::Char).unwrap())
}

/// The tiny preset with four blocks (so four stages have one each).
fn model() -> GptConfig {
    GptConfig {
        n_layer: 4,
        ..common::tiny_model(dataset())
    }
}

fn run(par: ParallelConfig) -> TrainSummary {
    run_clipped(par, TrainConfig::default().grad_clip)
}

/// A run clipping the gradient's global norm at `grad_clip` (0: off).
fn run_clipped(par: ParallelConfig, grad_clip: f32) -> TrainSummary {
    let tag = format!(
        "pp-{}-{}-{:?}-{}-{}-{}-clip{grad_clip}",
        par.pipeline.stages,
        par.world_size,
        par.strategy,
        par.tp,
        par.pipeline.to_string().replace(' ', "-"),
        par.recompute
    );
    let cfg = TrainConfig {
        grad_clip,
        ..common::five_steps(&tag, ACCUM)
    };
    train_lm(
        Cpu::new,
        model(),
        dataset(),
        &cfg,
        par,
        2,
        Wait::from_secs(120),
    )
    .unwrap_or_else(|e| panic!("{tag}: {e}"))
}

/// `single`'s run, shared by the tests.
fn single() -> &'static TrainSummary {
    static SINGLE: OnceLock<TrainSummary> = OnceLock::new();
    SINGLE.get_or_init(|| {
        run(layout(
            StrategyKind::Single,
            (1, 1, 1),
            Schedule::default(),
            false,
        ))
    })
}

fn layout(
    strategy: StrategyKind,
    (dp, pp, tp): (usize, usize, usize),
    schedule: Schedule,
    recompute: bool,
) -> ParallelConfig {
    ParallelConfig {
        strategy,
        world_size: dp * pp * tp,
        tp,
        recompute,
        precision: Default::default(),
        pipeline: Pipeline::new(pp, schedule, 2),
        offload: Default::default(),
        offload_serial: false,
    }
}

#[test]
fn every_pipeline_layout_follows_single_with_the_same_accumulation() {
    let single = single();
    use StrategyKind::*;
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for (strategy, dp, pp, tp) in [
            (Ddp, 1, 2, 1),
            (Ddp, 1, 4, 1),
            (Ddp, 2, 2, 1),
            (Tp, 1, 2, 2),
            (Ddp, 2, 2, 2),
        ] {
            let what = format!("{schedule} pp {pp} x dp {dp} x tp {tp}");
            let got = run(layout(strategy, (dp, pp, tp), schedule, false));
            common::assert_follows(single, &got, &what);
        }
    }
    let got = run(layout(Ddp, (1, 2, 1), Schedule::OneFOneB, true));
    common::assert_follows(single, &got, "1f1b pp 2 with recomputation");
}

#[test]
fn every_data_parallel_strategy_composes_with_pipelines_and_tensor_parallelism() {
    let single = single();
    use StrategyKind::*;
    for strategy in [Zero1, Zero2, Fsdp] {
        for (dp, pp, tp) in [(2, 1, 2), (2, 2, 1), (2, 2, 2)] {
            let what = format!("{strategy} pp {pp} x dp {dp} x tp {tp}");
            let got = run(layout(strategy, (dp, pp, tp), Schedule::OneFOneB, false));
            common::assert_follows(single, &got, &what);
        }
    }
    for (strategy, dp, pp, tp, schedule, recompute) in [
        (Fsdp, 2, 4, 1, Schedule::OneFOneB, false),
        (Zero2, 3, 2, 1, Schedule::GPipe, false),
        (Fsdp, 2, 2, 2, Schedule::GPipe, true),
        (Zero1, 2, 2, 1, Schedule::OneFOneB, true),
    ] {
        let what =
            format!("{strategy} {schedule} pp {pp} x dp {dp} x tp {tp}, recompute {recompute}");
        let got = run(layout(strategy, (dp, pp, tp), schedule, recompute));
        common::assert_follows(single, &got, &what);
    }
}

#[test]
fn interleaved_pipelines_follow_single_in_every_cell() {
    let single = single();
    use StrategyKind::*;
    for (strategy, dp, tp, recompute) in [
        (Ddp, 1, 1, false),
        (Ddp, 2, 1, false),
        (Tp, 1, 2, false),
        (Zero1, 2, 1, false),
        (Zero2, 2, 1, true),
        (Fsdp, 2, 1, false),
        (Fsdp, 2, 2, true),
    ] {
        let what =
            format!("interleaved pp 2 x dp {dp} x tp {tp}, {strategy}, recompute {recompute}");
        let got = run(layout(
            strategy,
            (dp, 2, tp),
            Schedule::Interleaved,
            recompute,
        ));
        common::assert_follows(single, &got, &what);
    }
}

#[test]
fn zero_bubble_pipelines_follow_single_in_every_cell() {
    let single = single();
    use StrategyKind::*;
    for (strategy, dp, pp, tp) in [
        (Ddp, 1, 2, 1),
        (Ddp, 1, 4, 1),
        (Ddp, 2, 2, 1),
        (Tp, 1, 2, 2),
        (Zero1, 2, 2, 1),
        (Zero2, 2, 2, 1),
        (Fsdp, 2, 2, 1),
        (Fsdp, 2, 2, 2),
    ] {
        let what = format!("zb-h1 pp {pp} x dp {dp} x tp {tp}, {strategy}");
        let got = run(layout(strategy, (dp, pp, tp), Schedule::ZbH1, false));
        common::assert_follows(single, &got, &what);
    }
}

/// With clipping off a wrong global norm moves no loss and no parameter,
/// so only the reported norm can show it: every layout's norm, a pipeline's
/// summed over its stages with the tied `wte` copy counted once, is single's.
#[test]
fn every_layout_reports_singles_gradient_norm_with_clipping_off() {
    use Schedule::*;
    use StrategyKind::*;
    let unclipped =
        |strategy, mesh, schedule| run_clipped(layout(strategy, mesh, schedule, false), 0.0);
    let single = unclipped(Single, (1, 1, 1), OneFOneB);
    for (strategy, (dp, pp, tp), schedule) in [
        (Ddp, (2, 1, 1), OneFOneB),
        (Zero1, (2, 1, 1), OneFOneB),
        (Zero2, (2, 1, 1), OneFOneB),
        (Fsdp, (2, 1, 1), OneFOneB),
        (Tp, (1, 1, 2), OneFOneB),
        (Ddp, (1, 2, 1), GPipe),
        (Ddp, (1, 2, 1), OneFOneB),
        (Ddp, (1, 2, 1), Interleaved),
        (Ddp, (1, 2, 1), ZbH1),
        (Zero1, (2, 2, 1), OneFOneB),
        (Fsdp, (2, 2, 2), OneFOneB),
    ] {
        let what = format!("{strategy} {schedule} pp {pp} x dp {dp} x tp {tp}, clipping off");
        common::assert_follows(&single, &unclipped(strategy, (dp, pp, tp), schedule), &what);
    }
}

#[test]
fn impossible_pipelines_are_refused_in_words() {
    let model: distgpt::model::ModelConfig = model().into();
    let said = |par: ParallelConfig| par.validate(&model, 12).unwrap_err().to_string();
    let l = |s, dp, pp, tp| layout(s, (dp, pp, tp), Schedule::OneFOneB, false);
    assert!(said(l(StrategyKind::Ddp, 1, 5, 1)).contains("more stages than the model's 4 blocks"));
    let mut odd = l(StrategyKind::Ddp, 1, 2, 1);
    odd.world_size = 3;
    assert!(said(odd)
        .contains("not divisible by the tensor-parallel size 1 times the pipeline stages 2"));
    let inter = |pp, v| ParallelConfig {
        pipeline: Pipeline::new(pp, Schedule::Interleaved, v),
        ..l(StrategyKind::Ddp, 1, pp, 1)
    };
    assert!(said(inter(2, 3)).contains("6 chunks, more than the model's 4 blocks"));
    assert!(said(inter(1, 2)).contains("needs --pp 2 or more"));
    assert!(said(inter(2, 1)).contains("needs 2 or more chunks a rank"));
    let mut stray = l(StrategyKind::Ddp, 1, 2, 1);
    stray.pipeline.virtual_stages = 2;
    assert!(said(stray).contains("for --schedule interleaved, not 1f1b"));
    let zb = |pp, recompute| ParallelConfig {
        pipeline: Pipeline::new(pp, Schedule::ZbH1, 1),
        ..layout(StrategyKind::Ddp, (1, pp, 1), Schedule::ZbH1, recompute)
    };
    assert!(said(zb(2, true)).contains("fp32 without --recompute"));
    assert!(said(zb(1, false)).contains("zb-h1 schedule needs --pp 2 or more"));
    // micro-batches go round in groups of pp
    let cfg = common::five_steps("pp-interleaved-3", 3);
    let err = train_lm(
        Cpu::new,
        self::model(),
        dataset(),
        &cfg,
        inter(2, 2),
        2,
        Wait::from_secs(120),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("make --grad-accum a multiple of 2"),
        "{err}"
    );
}
