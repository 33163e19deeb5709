//! Every strategy follows `single`: same seed, same global batch, five
//! optimizer steps; per-step losses within 1e-5 and final parameters
//! (consolidated from shards) within 1e-4 of the largest parameter.

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::train::{train, TrainSummary};
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
        recompute,
    )
}

fn run_model(
    model: distgpt::model::GptConfig,
    strategy: StrategyKind,
    world_size: usize,
    tp: usize,
    grad_accum: usize,
    recompute: bool,
) -> TrainSummary {
    let ds = dataset();
    let tag = format!(
        "{strategy:?}-{world_size}-{tp}-{grad_accum}-{recompute}-h{}",
        model.n_head
    );
    let cfg = common::five_steps(&tag, grad_accum);
    let par = ParallelConfig {
        strategy,
        world_size,
        tp,
        recompute,
    };
    train(Cpu::new, model, ds, &cfg, par, 2, Wait::from_secs(60))
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
    let reference = run_model(model.clone(), StrategyKind::Single, 1, 1, 1, false);
    common::assert_follows(
        &reference,
        &run_model(model.clone(), StrategyKind::Tp, 4, 1, 1, false),
        "tp on 4 ranks",
    );
    common::assert_follows(
        &reference,
        &run_model(model, StrategyKind::Ddp, 4, 4, 1, false),
        "ddp x tp 1 x 4",
    );
}
