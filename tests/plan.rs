//! `plan`'s memory model against what the strategies allocate: every
//! strategy and mesh on 1, 2 and 4 thread ranks, for GPT-2 and both BERT
//! heads, predicted per-rank peak within 10% of the measured one, and each
//! pipeline stage's. (Step times are compared by
//! `distgpt compare`, not asserted in tests.)

#[allow(dead_code)] // of the shared helpers, only the small BERT is for plan
mod common;

use common::small_bert;
use distgpt::backend::cpu::Cpu;
use distgpt::model::bert::BertHead;
use distgpt::model::{GptConfig, ModelConfig, Precision as EnginePrecision};
use distgpt::parallel::{launch, Grid, ParallelConfig, StrategyKind};
use distgpt::plan::{self, Device, Network, Precision, Workload};
use distgpt::train::bench::{bench_rank, BenchSpec};
use std::time::Duration;

fn model() -> GptConfig {
    GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 65,
        blocks: Vec::new(),
    }
}

#[test]
fn predicted_peak_memory_is_within_10_percent_of_measured() {
    let models = [
        model().into(),
        small_bert(BertHead::Mlm),
        small_bert(BertHead::Classify { labels: 3 }),
    ];
    for cfg in &models {
        check_memory(cfg);
        check_bf16_scratch(cfg);
    }
}

/// A batch of 8 x 32 of `cfg`, planned for and measured by one step. Memory
/// does not depend on speeds: any device will do.
fn setup(cfg: &ModelConfig) -> (Workload, Device, Network, BenchSpec) {
    let (batch, seq_len) = (8, 32);
    let w = Workload {
        model: cfg.clone(),
        batch,
        seq_len,
        grad_accum: 1,
        cpu_threads: Some(2),
    };
    let spec = BenchSpec {
        batch,
        grad_accum: 1,
        seq_len,
        warmup: 0,
        steps: 1,
        show: false,
        profile: false,
    };
    (
        w,
        Device::datasheet("h100", Precision::Fp32, 0.5).unwrap(),
        Network::datasheet("h100").unwrap(),
        spec,
    )
}

fn check_memory(cfg: &ModelConfig) {
    let (w, device, net, spec) = setup(cfg);
    let mut checked = 0;
    for world in [1, 2, 4] {
        for recompute in [false, true] {
            for par in plan::layouts(&w, world, recompute) {
                let predicted = plan::predict(&w, par, &device, &net, Precision::Fp32);
                let ranks = launch::run_local(world, 2, Duration::from_secs(60), |c| {
                    bench_rank(Cpu::new(), cfg, par, spec, c.as_ref())
                })
                .unwrap();
                for (r, got) in ranks[0].iter().enumerate() {
                    if world == 1 {
                        // a batch in parts (2 threads): the parts' gradient
                        // scratch, to the byte
                        let want = plan::memory_plan(&w, par, Precision::Fp32).grads;
                        assert_eq!(want, got.peak.grads as f64, "{cfg}: single's gradients");
                    }
                    let measured = got.peak.total as f64;
                    // a pipeline's ranks hold different stages; the plan's
                    // memory is the fullest stage's
                    let stage = Grid::of(&par).coords(r).stage;
                    let want = plan::stage_memory_plan(&w, par, Precision::Fp32, stage).total();
                    assert!(want <= predicted.memory.total());
                    let off = (want - measured).abs() / measured;
                    assert!(
                        off <= 0.10,
                        "{cfg}: {} rank {r}: predicted {want:.0} bytes, measured {measured:.0} ({:.1}% off)",
                        par.layout_name(),
                        100.0 * off
                    );
                }
                checked += 1;
            }
        }
    }
    // world 1: single; 2: four data-parallel strategies, tp, a pipeline;
    // 4: those, four over tp 2, four over pp 2, tp 2 x pp 2, and a pipeline
    // of 4 where the model has 4 blocks; each pipeline also as zb-h1
    // without recomputation where the model is GPT-2
    let four_stages = usize::from(cfg.n_layer() >= 4);
    let zb = usize::from(cfg.splits_backward()) * (1 + 5 + four_stages);
    assert_eq!(
        checked,
        2 * (1 + 6 + 14 + four_stages) + zb,
        "{cfg}: every layout was checked"
    );
}

/// --precision bf16 on the CPU keeps one rounded copy, the weights' (2
/// bytes a parameter beside the fp32 ones the units read), rounds the
/// other matmul operands as it multiplies, and holds the activations
/// autocast holds in bf16 so: it plans and measures fp32's bytes plus the
/// copy, less half of those activations, on every rank (each runs blocks,
/// whose activations outweigh the copy here). (On a GPU too: tests/gpu.rs.)
fn check_bf16_scratch(cfg: &ModelConfig) {
    let (w, _, _, spec) = setup(cfg);
    for world in [1, 2] {
        // zb-h1 runs in fp32 only
        let fp32_only = distgpt::parallel::Schedule::ZbH1;
        for par in plan::layouts(&w, world, false) {
            if par.pipeline.schedule == fp32_only {
                continue;
            }
            let [fp32, bf16] = [EnginePrecision::Fp32, EnginePrecision::Bf16].map(|precision| {
                let par = ParallelConfig { precision, ..par };
                // rank 0's: the first stage's plan
                let predicted = plan::stage_memory_plan(&w, par, Precision::Fp32, 0);
                let ranks = launch::run_local(world, 2, Duration::from_secs(60), |c| {
                    bench_rank(Cpu::new(), cfg, par, spec, c.as_ref())
                })
                .unwrap();
                (predicted.total(), ranks[0][0].peak.total as f64)
            });
            let (want, got) = (bf16.0 - fp32.0, bf16.1 - fp32.1);
            // every rank runs blocks, whose MLP activations are bf16
            assert!(
                want == got && want < 0.0,
                "{} in bf16: predicted {want:.0} more bytes than fp32, measured {got:.0} more",
                par.layout_name()
            );
        }
    }
}

/// Each pipeline stage's peak memory is its plan's: the stage's units and a
/// tied unit's copy, shared over its replicas as ddp, zero1, zero2 or fsdp
/// share them, and its schedule's micro-batches in flight (1f1b p - s,
/// gpipe m), each sized for the stage's units. Sharded data parallelism
/// over a tensor-parallel mesh runs as one stage and is planned so too.
#[test]
fn every_pipeline_stage_peaks_where_plan_says() {
    use distgpt::parallel::{Pipeline, Schedule};
    let models: [ModelConfig; 2] = [model().into(), small_bert(BertHead::Mlm)];
    for cfg in &models {
        let (w, _, _, spec) = setup(cfg);
        let (w, spec) = (
            Workload { grad_accum: 4, ..w },
            BenchSpec {
                grad_accum: 4,
                ..spec
            },
        );
        let schedules = [
            Schedule::GPipe,
            Schedule::OneFOneB,
            Schedule::Interleaved,
            Schedule::ZbH1,
        ];
        // zb-h1 runs without recomputation
        let runs = schedules
            .into_iter()
            .flat_map(|s| [(s, false), (s, true)])
            .filter(|&(s, recompute)| !(recompute && s == Schedule::ZbH1));
        for (schedule, recompute) in runs {
            for (strategy, world, tp, stages) in [
                (StrategyKind::Ddp, 2, 1, 2),
                (StrategyKind::Ddp, 4, 1, 2),
                (StrategyKind::Ddp, 4, 1, 4),
                (StrategyKind::Tp, 4, 2, 2),
                (StrategyKind::Zero1, 4, 1, 2),
                (StrategyKind::Zero2, 4, 1, 2),
                (StrategyKind::Fsdp, 4, 1, 2),
                (StrategyKind::Fsdp, 4, 2, 1),
                (StrategyKind::Zero2, 4, 2, 1),
                (StrategyKind::Zero1, 8, 2, 2),
            ] {
                let par = ParallelConfig {
                    strategy,
                    world_size: world,
                    tp,
                    recompute,
                    precision: Default::default(),
                    pipeline: Pipeline::new(stages, schedule, 2),
                    offload: Default::default(),
                    offload_serial: false,
                };
                let v = par.pipeline.virtual_stages;
                let gpt = cfg.splits_backward();
                if stages * v > cfg.n_layer()
                    || (stages == 1 && schedule != Schedule::OneFOneB)
                    || (schedule == Schedule::ZbH1 && !gpt)
                {
                    continue;
                }
                let ranks = launch::run_local(world, 2, Duration::from_secs(60), |c| {
                    bench_rank(Cpu::new(), cfg, par, spec, c.as_ref())
                })
                .unwrap();
                for (r, got) in ranks[0].iter().enumerate() {
                    let stage = Grid::of(&par).coords(r).stage;
                    let want = plan::stage_memory_plan(&w, par, Precision::Fp32, stage).total();
                    let measured = got.peak.total as f64;
                    let off = (want - measured).abs() / measured;
                    assert!(
                        off <= 0.10,
                        "{cfg}: {schedule} pp {stages} x{world} tp {tp} recompute {recompute}, rank {r} \
                         (stage {stage}): predicted {want:.0} bytes, measured {measured:.0} ({:.1}% off)",
                        100.0 * off
                    );
                }
            }
        }
    }
}

/// Under --recompute a pipeline stage keeps, for each micro-batch in
/// flight, only its blocks' inputs and its tokens and targets: GPipe holds
/// every micro-batch, so 4 more of them raise stage 0's measured
/// activation peak by 4 x rows x (2 + l C) x 4 bytes, l its blocks,
/// counted by hand. Without recomputation each holds its blocks' whole
/// activations besides.
#[test]
fn a_recomputing_stage_holds_only_its_blocks_inputs_per_micro_batch() {
    use distgpt::model::Span;
    use distgpt::parallel::{Pipeline, Schedule};
    let cfg: ModelConfig = model().into();
    let (w, _, _, spec) = setup(&cfg);
    let par = |recompute| ParallelConfig {
        strategy: StrategyKind::Ddp,
        world_size: 2,
        tp: 1,
        recompute,
        precision: Default::default(),
        pipeline: Pipeline::new(2, Schedule::GPipe, 1),
        offload: Default::default(),
        offload_serial: false,
    };
    let stage0 = |recompute, m| {
        let spec = BenchSpec {
            grad_accum: m,
            ..spec
        };
        let ranks = launch::run_local(2, 2, Duration::from_secs(60), |c| {
            bench_rank(Cpu::new(), &cfg, par(recompute), spec, c.as_ref())
        })
        .unwrap();
        assert_eq!(Grid::of(&par(recompute)).coords(0).stage, 0);
        ranks[0][0].peak.activations as usize
    };
    let layout = cfg.layout(1);
    let units = par(true).pipeline.partition(&layout)[0].clone();
    let l = Span::of_units(units, cfg.n_layer()).blocks.len();
    let (rows, c) = (w.batch * w.seq_len, cfg.n_embd());
    let kept = 4 * rows * (2 + l * c) * 4;
    assert_eq!(stage0(true, 8) - stage0(true, 4), kept);
    assert!(stage0(false, 8) - stage0(false, 4) > 2 * kept);
}

#[test]
fn gpt2_on_8_h100_is_within_2x_of_llm_c() {
    // llm.c: GPT-2 124M, 8 x H100, 524,288 tokens per step in ~140 ms (bf16).
    let w = Workload {
        model: ModelConfig::preset("gpt2").unwrap(),
        batch: 512,
        seq_len: 1024,
        grad_accum: 1,
        cpu_threads: None,
    };
    let device = Device::datasheet("h100", Precision::Mixed, 0.4).unwrap();
    let net = Network::datasheet("h100").unwrap();
    let par = distgpt::parallel::ParallelConfig {
        strategy: distgpt::parallel::StrategyKind::Zero1,
        world_size: 8,
        tp: 1,
        recompute: false,
        precision: Default::default(),
        pipeline: Default::default(),
        offload: Default::default(),
        offload_serial: false,
    };
    let p = plan::predict(&w, par, &device, &net, Precision::Mixed);
    let ms = p.time.step_s() * 1e3;
    assert!(p.fits, "fits in 80 GB: {:.1} GB", p.memory.total() / 1e9);
    assert!(
        (70.0..=280.0).contains(&ms),
        "{ms:.1} ms vs llm.c's ~140 ms"
    );
}

/// 204 blocks of 28,672 (224 heads of 128), a vocabulary of 51,200 and
/// 2,048 positions: 2.014 trillion parameters, past GPT-3's 175B and the
/// 1T configurations trained with Megatron.
fn two_trillion() -> GptConfig {
    GptConfig {
        n_layer: 204,
        n_head: 224,
        n_embd: 28672,
        block_size: 2048,
        vocab_size: 51200,
        blocks: Vec::new(),
    }
}

#[test]
fn a_two_trillion_parameter_model_on_131072_ranks_keeps_zeros_formula() {
    let cfg = two_trillion();
    // counted by hand: a block's 12 C^2 + 13 C (qkv, projection, fc, fc
    // projection and their biases, two layer norms), the token and position
    // embeddings (51,200 is a multiple of 64: no padding), the final norm
    let (c, l) = (28672usize, 204usize);
    let psi = l * (12 * c * c + 13 * c) + 51200 * c + 2048 * c + 2 * c;
    assert_eq!(psi, 2_014_063_435_776);
    let model: ModelConfig = cfg.into();
    assert_eq!(model.num_params(), psi);
    let world = 131072;
    let w = Workload {
        model,
        batch: world,
        seq_len: 2048,
        grad_accum: 1,
        cpu_threads: None,
    };
    let device = Device::datasheet("h100", Precision::Mixed, 0.4).unwrap();
    let net = Network::datasheet("h100").unwrap();
    let wp = plan::plan_world(&w, world, &device, &net, Precision::Mixed, true);
    let fsdp = wp
        .predictions
        .iter()
        .find(|p| {
            p.parallel.strategy == StrategyKind::Fsdp
                && p.parallel.tp == 1
                && p.parallel.pipeline.stages == 1
                && !p.parallel.recompute
        })
        .expect("fsdp over every rank is a layout");
    // ZeRO-3 at mixed precision: (2 + 2 + 12) psi / N bytes of model states
    // a rank, 245.9 MB here; each of the 206 units is padded to a multiple
    // of N, at most one element a rank each
    let want = 16.0 * psi as f64 / world as f64;
    let got = fsdp.memory.persistent_states();
    assert!(
        (got - want).abs() <= 16.0 * (l + 2) as f64,
        "{got} bytes a rank vs ZeRO's {want}"
    );
    // nothing overflowed into nonsense anywhere
    for p in wp.predictions.iter().chain(&wp.offloaded) {
        let (m, t) = (&p.memory, &p.time);
        for x in [
            m.total(),
            m.host.total(),
            t.step_s(),
            t.comm_bytes,
            p.tokens_per_s,
        ] {
            assert!(
                x.is_finite() && x >= 0.0,
                "{}: {x}",
                p.parallel.layout_name()
            );
        }
        assert!(m.total() > 0.0 && t.step_s() > 0.0);
    }
    // every family has a best, and the recommendation is one of them
    let families = wp.families(&w, &device, &net);
    assert_eq!(families.len(), 5, "{families:?}");
    let rec = wp.recommended().expect("a layout fits on 131,072 H100s");
    assert!(rec.fits);
    assert_eq!(
        families.iter().filter(|f| f.why == "recommended").count(),
        1,
        "{families:?}"
    );
}
