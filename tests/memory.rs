//! Per-rank model-state memory follows the ZeRO paper (fp32, AdamW, K = 8):
//! ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, fsdp 16Ψ/N + the gathered
//! units (embeddings, a block, the final norm), measured as peak params +
//! grads + optimizer bytes after a step; and what each strategy sends.

use distgpt::backend::cpu::Cpu;
use distgpt::backend::MemoryReport;
use distgpt::comm::CommStats;
use distgpt::data::Batch;
use distgpt::model::gpt2::init_full;
use distgpt::model::{AdamWConfig, GptConfig, ParamLayout};
use distgpt::parallel::{self, launch, ParallelConfig, StepConfig, StrategyKind};
use std::time::Duration;

fn model() -> GptConfig {
    GptConfig {
        n_layer: 6,
        n_head: 2,
        n_embd: 64,
        block_size: 32,
        vocab_size: 65,
        blocks: Vec::new(),
    }
}

/// Every rank's peak memory and communication after one step of `strategy` on `n` thread ranks.
fn one_step(strategy: StrategyKind, n: usize) -> Vec<(MemoryReport, CommStats)> {
    let cfg = model();
    let (b, t) = (4, 16);
    let init = init_full(&cfg, 1);
    let par = ParallelConfig {
        strategy,
        world_size: n,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    launch::run_local(n, 2, Duration::from_secs(60), |world| {
        let mut s = parallel::build(
            Cpu::new(),
            cfg.clone(),
            par,
            world.as_ref(),
            AdamWConfig::default(),
            b,
            t,
        )?;
        s.load_full(&init).unwrap();
        assert_eq!(s.comm_stats().total_bytes(), 0, "loading sends nothing");
        let ids: Vec<u32> = (0..b * t).map(|i| (i % 60) as u32).collect();
        s.step(
            &[Batch::lm(ids.clone(), ids)],
            StepConfig {
                lr: 1e-3,
                grad_clip: 1.0,
            },
        )?;
        Ok((s.memory(), s.comm_stats()))
    })
    .unwrap()
}

/// Peak params + grads + optimizer bytes of every rank after one step.
fn measured(strategy: StrategyKind, n: usize) -> Vec<u64> {
    one_step(strategy, n)
        .into_iter()
        .map(|(m, _)| {
            let p = m.peak_bytes;
            p.params + p.grads + p.optimizer
        })
        .collect()
}

/// Rank 0's communication in one step.
fn one_step_comm(strategy: StrategyKind, n: usize) -> CommStats {
    one_step(strategy, n).swap_remove(0).1
}

#[test]
fn model_state_memory_matches_zero_formulas() {
    let cfg = model();
    let psi = ParamLayout::new(&cfg).total() as f64;
    for n in [2usize, 4] {
        let nf = n as f64;
        let padded = padded_units(&cfg, n);
        // fsdp's gather buffers: the tied embeddings, and the largest other unit (a block)
        let gathered = 4.0 * (padded[0] + padded[1]) as f64;
        let cases = [
            (StrategyKind::Ddp, 16.0 * psi),
            (StrategyKind::Zero1, 8.0 * psi + 8.0 * psi / nf),
            (StrategyKind::Zero2, 4.0 * psi + 12.0 * psi / nf),
            (StrategyKind::Fsdp, 16.0 * psi / nf + gathered),
        ];
        for (strategy, want) in cases {
            for (rank, got) in measured(strategy, n).into_iter().enumerate() {
                let rel = (got as f64 - want).abs() / want;
                assert!(
                    rel <= 0.05,
                    "{strategy:?} N={n} rank {rank}: {got} bytes vs formula {want:.0} ({:.1}% off)",
                    100.0 * rel
                );
            }
        }
    }
}

/// Each unit's length padded to a multiple of `n`, as a sharded strategy holds it.
fn padded_units(cfg: &GptConfig, n: usize) -> Vec<usize> {
    let units = ParamLayout::new(cfg).units;
    units
        .iter()
        .map(|u| u.range.len().div_ceil(n) * n)
        .collect()
}

fn bytes_sent(strategy: StrategyKind, n: usize) -> u64 {
    one_step_comm(strategy, n).total_bytes()
}

#[test]
fn fsdp_gathers_the_tied_embedding_once_per_forward() {
    let cfg = model();
    for n in [2usize, 4] {
        let padded = padded_units(&cfg, n);
        let (emb, head) = (0, cfg.n_layer + 1);
        let blocks: usize = padded[1..=cfg.n_layer].iter().sum();
        // forward: embeddings, every block, the final norm; backward: every block again
        let elems = padded[emb] + 2 * blocks + padded[head];
        let ring = |bytes: usize| (bytes as u64) * (n as u64 - 1) / n as u64;
        let got = one_step_comm(StrategyKind::Fsdp, n).all_gather_bytes;
        assert_eq!(
            got,
            ring(4 * elems),
            "N={n}: all-gathered bytes in one step"
        );
    }
}

#[test]
fn zero1_sends_what_ddp_sends_not_half_as_much_again() {
    for n in [2usize, 4] {
        let (ddp, zero1) = (
            bytes_sent(StrategyKind::Ddp, n),
            bytes_sent(StrategyKind::Zero1, n),
        );
        // ddp all-reduces the gradients (2Ψ); zero1 reduce-scatters them and
        // all-gathers the parameters (Ψ + Ψ, plus padding and a scalar).
        assert!(
            zero1 as f64 <= 1.02 * ddp as f64,
            "N={n}: zero1 sends {zero1} bytes a step, ddp {ddp}"
        );
    }
}

/// zero1's and zero2's update works in scratch the rank holds from its
/// first step on: nothing of category "other" is allocated for the update
/// and freed after it (that cost zero1 a third of its update time). A
/// replicated update takes none, fsdp's (on its own shard) none beyond
/// its gradient scratch: zero2 holds one parameter shard (half its
/// optimizer's bytes) more than fsdp.
#[test]
fn the_sharded_update_allocates_nothing_a_step() {
    for strategy in [StrategyKind::Zero1, StrategyKind::Zero2] {
        for (r, (m, _)) in one_step(strategy, 2).into_iter().enumerate() {
            let (now, peak) = (m.current_bytes.other, m.peak_bytes.other);
            assert!(peak > 0, "{strategy:?} rank {r}: no scratch counted");
            assert_eq!(
                now, peak,
                "{strategy:?} rank {r}: {peak} bytes at the peak, {now} held after the step"
            );
        }
    }
    for (r, (m, _)) in one_step(StrategyKind::Ddp, 2).into_iter().enumerate() {
        assert_eq!(m.peak_bytes.other, 0, "ddp rank {r}");
    }
    let zero2 = one_step(StrategyKind::Zero2, 2);
    let fsdp = one_step(StrategyKind::Fsdp, 2);
    for (r, ((z, _), (f, _))) in zero2.iter().zip(&fsdp).enumerate() {
        let extra = z.peak_bytes.other - f.peak_bytes.other;
        assert_eq!(
            extra,
            z.peak_bytes.optimizer / 2,
            "rank {r}: zero2's other over fsdp's"
        );
    }
}
