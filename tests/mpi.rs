//! Strategies over Open MPI match single-rank training. Run under mpirun
//! (`.ci/run` does): every process runs this test; the world size comes from
//! mpirun's -np, and rank 0 compares against a single-rank run of its own.
//! Built without `--features mpi`, the binary holds one ignored test that
//! says so, so `cargo test` shows these tests as not run.

#[cfg(feature = "mpi")]
mod common;

#[cfg(not(feature = "mpi"))]
#[test]
#[ignore = "built without --features mpi: the MPI tests run under mpirun (.ci/run)"]
fn mpi_tests_need_the_mpi_feature_and_mpirun() {
    panic!("rebuild with --features mpi and run this binary under mpirun -np N ... --ignored");
}

#[cfg(feature = "mpi")]
mod under_mpi {
    use super::common;
    use distgpt::backend::cpu::Cpu;
    use distgpt::comm::local;
    use distgpt::comm::mpi::MpiComm;
    use distgpt::comm::Comm;
    use distgpt::data::{Dataset, TokenizerKind};
    use distgpt::parallel::{ParallelConfig, StrategyKind};
    use distgpt::train::lm::LmTask;
    use distgpt::train::{train_rank, TrainSummary};
    use std::time::Duration as Wait;

    fn run(
        ds: &Dataset,
        comm: &dyn Comm,
        par: ParallelConfig,
        grad_accum: usize,
    ) -> Option<TrainSummary> {
        let tag = format!(
            "{:?}-{}-{}-{grad_accum}-{}-pp{}{}",
            par.strategy,
            par.world_size,
            par.tp,
            par.recompute,
            par.pipeline.stages,
            par.pipeline.to_string().replace(' ', "-")
        );
        // four blocks: an interleaved pipeline of two stages runs two chunks each
        let model = distgpt::model::GptConfig {
            n_layer: 4,
            ..common::tiny_model(ds)
        };
        train_rank(
            Cpu::new(),
            &LmTask {
                model: model.into(),
                data: ds,
            },
            &common::five_steps(&format!("mpi-{tag}"), grad_accum),
            par,
            comm,
        )
        .unwrap_or_else(|e| panic!("{tag}: {e}"))
    }

    /// Each element type under its MPI datatype: integers beyond f32's
    /// precision and UTF-8 bytes arrive exactly. (Part of the one test below:
    /// MPI is initialised once per process.)
    fn typed_collectives_are_exact(c: &dyn Comm) {
        const BIG: u64 = 123_456_789_012;
        let (r, n) = (c.rank(), c.size());
        let triangle = (n * (n - 1) / 2) as u64;
        let mut sum = [BIG + r as u64];
        c.all_reduce(&mut sum).unwrap();
        assert_eq!(sum[0], BIG * n as u64 + triangle, "u64 all_reduce");
        let mut all = vec![0u64; n];
        c.all_gather(&[BIG + r as u64], &mut all).unwrap();
        let want: Vec<u64> = (0..n as u64).map(|q| BIG + q).collect();
        assert_eq!(all, want, "u64 all_gather");
        let text = "/tmp/läufe/модель 模型 🚀";
        let mut bytes = if r == 0 {
            text.as_bytes().to_vec()
        } else {
            vec![0u8; text.len()]
        };
        c.broadcast(&mut bytes, 0).unwrap();
        assert_eq!(bytes, text.as_bytes(), "u8 broadcast");
        let input: Vec<i64> = (0..n as i64).map(|i| -i - r as i64).collect();
        let mut mine = [0i64];
        c.reduce_scatter(&input, &mut mine).unwrap();
        assert_eq!(
            mine[0],
            -((n * r) as i64) - triangle as i64,
            "i64 reduce_scatter"
        );
        let mut half = [0.5 * r as f64];
        c.all_reduce(&mut half).unwrap();
        assert_eq!(half[0], 0.5 * triangle as f64, "f64 all_reduce");
        let mut ones = [1u8];
        c.all_reduce(&mut ones).unwrap();
        assert_eq!(ones[0], n as u8, "u8 all_reduce");
        let sent = c.stats().p2p_bytes;
        c.send(&[u32::MAX - r as u32], (r + 1) % n).unwrap();
        let mut got = [0u32];
        c.recv(&mut got, (r + n - 1) % n).unwrap();
        assert_eq!(got[0], u32::MAX - ((r + n - 1) % n) as u32, "u32 send/recv");
        let mut pair = [0u64; 2];
        let (to, from) = ((r + 1) % n, (r + n - 1) % n);
        c.send_recv(&[r as u64; 2], to, &mut pair, from).unwrap();
        assert_eq!(pair, [from as u64; 2], "u64 send_recv");
        // a rank counts what it sends (4 + 16 bytes), as thread ranks do
        assert_eq!(c.stats().p2p_bytes - sent, 20, "p2p bytes sent");
        // any serde value, as JSON of another length on each rank
        let value = |r: usize| (format!("{text}{}", "ü".repeat(r)), 0.1 + 0.2 * r as f64);
        assert_eq!(c.agree(value(r)).unwrap(), value(0), "agree");
        let want: Vec<_> = (0..n).map(value).collect();
        assert_eq!(c.gather(&value(r)).unwrap(), want, "gather");
    }

    #[test]
    #[ignore = "needs mpirun: mpirun -np N <this test binary> --ignored"]
    fn strategies_over_mpi_match_single() {
        let world = MpiComm::init(Wait::from_secs(120)).unwrap();
        typed_collectives_are_exact(&world);
        println!("mpi typed collectives: exact");
        let n = world.size();
        let ds = Dataset::load(None, TokenizerKind::Char).unwrap();
        let (_, solo) = local::world(1, Wait::from_secs(60));
        let single = |accum| {
            let par = ParallelConfig {
                strategy: StrategyKind::Single,
                world_size: 1,
                tp: 1,
                recompute: false,
                precision: Default::default(),
                pipeline: Default::default(),
                offload: Default::default(),
                offload_serial: false,
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
                    precision: Default::default(),
                    pipeline: Default::default(),
                    offload: Default::default(),
                    offload_serial: false,
                },
                1,
            ));
            cases.push((
                ParallelConfig {
                    strategy: s,
                    world_size: n,
                    tp: 1,
                    recompute: true,
                    precision: Default::default(),
                    pipeline: Default::default(),
                    offload: Default::default(),
                    offload_serial: false,
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
                    precision: Default::default(),
                    pipeline: Default::default(),
                    offload: Default::default(),
                    offload_serial: false,
                },
                1,
            ));
        }
        // pipelines: 2 stages (MPI_Sendrecv between neighbours), the rest data
        // parallel; at 4 ranks a 2 x 2 pipeline x tensor mesh and every sharded
        // strategy over tensor parallelism, pipelines and both together
        if n.is_multiple_of(2) {
            use distgpt::parallel::{Pipeline, Schedule};
            use StrategyKind::*;
            let (gpipe, one_f, inter) =
                (Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved);
            let zb = Schedule::ZbH1;
            let mut layouts = vec![
                (Ddp, 2, 1, gpipe),
                (Ddp, 2, 1, one_f),
                (Ddp, 2, 1, inter),
                (Ddp, 2, 1, zb),
            ];
            if n == 4 {
                layouts.extend([(Tp, 2, 2, gpipe), (Tp, 2, 2, one_f)]);
                for s in [Zero1, Zero2, Fsdp] {
                    layouts.extend([(s, 1, 2, one_f), (s, 2, 1, one_f), (s, 2, 2, gpipe)]);
                    layouts.extend([(s, 2, 1, inter), (s, 2, 1, zb)]);
                }
            }
            for (strategy, stages, tp, schedule) in layouts {
                cases.push((
                    ParallelConfig {
                        strategy,
                        world_size: n,
                        tp,
                        recompute: false,
                        precision: Default::default(),
                        pipeline: Pipeline::new(stages, schedule, 2),
                        offload: Default::default(),
                        offload_serial: false,
                    },
                    2,
                ));
            }
        }
        for (par, grad_accum) in cases {
            let Some(got) = run(&ds, &world, par, grad_accum) else {
                continue;
            };
            let want = if grad_accum == 1 { &plain } else { &accum };
            common::assert_follows(want, &got, &format!("{par:?} accum {grad_accum}"));
            println!("mpi {par:?} accum {grad_accum}: matches single");
        }
        bert_masked_lm_over_mpi_matches_single(&world, &ds, &solo[0]);
    }

    /// BERT masked-LM pretraining (padding-free character windows, 15% masked)
    /// under mpirun follows a single thread rank: training and validation
    /// losses within 1e-5 for ddp, zero2 and fsdp.
    fn bert_masked_lm_over_mpi_matches_single(world: &dyn Comm, ds: &Dataset, solo: &dyn Comm) {
        use distgpt::model::bert::{BertConfig, BertHead};
        use distgpt::train::mlm::MlmTask;
        use distgpt::train::TrainConfig;
        let dir = |what: &str| std::env::temp_dir().join(format!("distgpt-mpi-mlm-{what}"));
        let shape = BertConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            n_inner: 64,
            block_size: 0,
            type_vocab: 2,
            // the characters + [MASK] and the window length, set by MlmTask::new
            vocab_size: 0,
            layer_norm_eps: 1e-12,
            head: BertHead::Mlm,
        };
        let task = MlmTask::new(&shape, ds, 16);
        let mut cfg = TrainConfig {
            batch_size: 12,
            seq_len: 16,
            duration: distgpt::train::Duration::Steps(5),
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 2,
            grad_clip: 1.0,
            eval_every: 1,
            eval_batches: 2,
            sample_tokens: 0,
            seed: 3,
            // every process runs its own single rank; the strategies' ranks share one run directory
            out_dir: dir(&format!("single-{}-of-{}", world.rank(), world.size())),
            overwrite: true,
            keep_checkpoints: 1,
            ..TrainConfig::default()
        };
        let par = |strategy, world_size| ParallelConfig {
            strategy,
            world_size,
            tp: 1,
            recompute: false,
            precision: Default::default(),
            pipeline: Default::default(),
            offload: Default::default(),
            offload_serial: false,
        };
        let single = train_rank(Cpu::new(), &task, &cfg, par(StrategyKind::Single, 1), solo)
            .unwrap()
            .expect("a single rank is rank 0");
        let _ = std::fs::remove_dir_all(&cfg.out_dir);
        let vals = |s: &TrainSummary| -> Vec<f32> {
            s.history.iter().filter_map(|r| r.val_loss).collect()
        };
        for s in [StrategyKind::Ddp, StrategyKind::Zero2, StrategyKind::Fsdp] {
            cfg.out_dir = dir(&format!("{s}-{}", world.size()));
            let got = train_rank(Cpu::new(), &task, &cfg, par(s, world.size()), world).unwrap();
            let Some(got) = got else { continue };
            // rank 0 returns last: every rank's files are written
            let _ = std::fs::remove_dir_all(&cfg.out_dir);
            let (a, b) = (vals(&single), vals(&got));
            let close = |x: f32, y: f32| (x - y).abs() <= 1e-5;
            assert!(
                a.len() == 5
                    && a.len() == b.len()
                    && close(single.final_loss, got.final_loss)
                    && a.iter().zip(&b).all(|(x, y)| close(*x, *y)),
                "BERT {s} under mpirun: {b:?} / {} vs single {a:?} / {}",
                got.final_loss,
                single.final_loss
            );
            println!("mpi BERT masked LM {s}: matches single");
        }
    }
}
