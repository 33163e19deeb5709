//! Strategies over Open MPI match single-rank training. Run under mpirun
//! (`.ci/run` does): every process runs this test; the world size comes from
//! mpirun's -np, and rank 0 compares against a single-rank run of its own.
#![cfg(feature = "mpi")]

mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::comm::local;
use distgpt::comm::mpi::MpiComm;
use distgpt::comm::Comm;
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::parallel::{ParallelConfig, StrategyKind};
use distgpt::train::{train_rank, TrainSummary};
use std::time::Duration as Wait;

fn run(
    ds: &Dataset,
    comm: &dyn Comm,
    par: ParallelConfig,
    grad_accum: usize,
) -> Option<TrainSummary> {
    let tag = format!(
        "{:?}-{}-{}-{grad_accum}-{}",
        par.strategy, par.world_size, par.tp, par.recompute
    );
    train_rank(
        Cpu::new(),
        common::tiny_model(ds),
        ds,
        &common::five_steps(&format!("mpi-{tag}"), grad_accum),
        par,
        comm,
    )
    .unwrap_or_else(|e| panic!("{tag}: {e}"))
}

#[test]
#[ignore = "needs mpirun: mpirun -np N <this test binary> --ignored"]
fn strategies_over_mpi_match_single() {
    let world = MpiComm::init(Wait::from_secs(120)).unwrap();
    let n = world.size();
    let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    let (_, solo) = local::world(1, Wait::from_secs(60));
    let single = |accum| {
        let par = ParallelConfig {
            strategy: StrategyKind::Single,
            world_size: 1,
            tp: 1,
            recompute: false,
        };
        run(&ds, &solo[0], par, accum).unwrap()
    };
    let (plain, accum) = (single(1), single(2));
    let mut cases = vec![];
    for s in [
        StrategyKind::Ddp,
        StrategyKind::Zero1,
        StrategyKind::Zero2,
        StrategyKind::Fsdp,
    ] {
        cases.push((
            ParallelConfig {
                strategy: s,
                world_size: n,
                tp: 1,
                recompute: false,
            },
            1,
        ));
        cases.push((
            ParallelConfig {
                strategy: s,
                world_size: n,
                tp: 1,
                recompute: true,
            },
            2,
        ));
    }
    if n.is_multiple_of(2) {
        cases.push((
            ParallelConfig {
                strategy: StrategyKind::Tp,
                world_size: n,
                tp: 2,
                recompute: false,
            },
            1,
        ));
    }
    for (par, grad_accum) in cases {
        let Some(got) = run(&ds, &world, par, grad_accum) else {
            continue;
        };
        let want = if grad_accum == 1 { &plain } else { &accum };
        common::assert_follows(want, &got, &format!("{par:?} accum {grad_accum}"));
        println!("mpi {par:?} accum {grad_accum}: matches single");
    }
}
