//! Figures the tool prints against answers worked out here by hand from
//! the architecture and the published formulas, never from distgpt's own
//! functions, so a wrong term that every path shares still fails: FLOPs a
//! token and MFU (PaLM's count, as llm.c and nanoGPT take it) through
//! `bench --json` and the kernels' own counts, `plan`'s compute term, and
//! each strategy's communication volume (the ZeRO and Megatron-LM papers'
//! ring volumes) against `plan` and against what thread ranks send; the
//! model states and volumes `metrics.jsonl` records (ZeRO's 16 Psi, sharded);
//! `eval`'s pretraining and `--weights` figures on models whose answer is
//! known (and PyTorch's loss); `bench`'s peak RSS against the OS's count.

#[allow(dead_code)] // of the shared helpers, only the small BERT and scratch are used here
mod common;

use distgpt::backend::cpu::Cpu;
use distgpt::model::{GptConfig, ModelConfig};
use distgpt::parallel::pipeline::Pass;
use distgpt::parallel::{launch, ParallelConfig, Schedule, Span, StrategyKind};
use distgpt::plan::{self, Device, Network, Precision, Workload};
use distgpt::train::bench::{bench_rank, BenchSpec};
use std::process::Command;
use std::time::Duration;

/// `distgpt` with `args`, which must succeed: its standard output.
fn stdout_of(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");
    String::from_utf8(out.stdout).unwrap()
}

/// `distgpt` with `args`, its JSON line.
fn json_of(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&stdout_of(args)).unwrap()
}

/// One timed step of `bench --json` at batch 2 against a stated peak of
/// 1 TFLOP/s (no peak measured).
fn bench(model: &[&str], seq: usize, extra: &[&str]) -> serde_json::Value {
    let seq = seq.to_string();
    let mut args = vec!["bench", "--json", "--steps", "1", "--warmup", "0"];
    args.extend(["--batch-size", "2", "--seq-len", &seq, "--peak-tflops", "1"]);
    args.extend(model);
    args.extend(extra);
    json_of(&args)
}

fn close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-9 * want.abs(),
        "{what}: {got} printed, {want} by hand"
    );
}

/// A shape, as the presets and flags state it.
struct Shape {
    layers: f64,
    width: f64,
    /// The feed-forward's hidden width.
    hidden: f64,
    /// The vocabulary's rows: llm.c pads GPT-2's, distgpt pads both
    /// families' to a multiple of 64.
    vocab_rows: f64,
}

/// `tiny`: 2 blocks of 2 heads, 32 wide, 65 characters (128 rows).
const TINY: Shape = Shape {
    layers: 2.0,
    width: 32.0,
    hidden: 128.0,
    vocab_rows: 128.0,
};

/// `bert-tiny`: 2 blocks of 2 heads, 128 wide, F 512, a 2-way classifier.
const BERT_TINY: Shape = Shape {
    layers: 2.0,
    width: 128.0,
    hidden: 512.0,
    vocab_rows: 30_528.0,
};

/// The matmul weights a token of bert-tiny's classifier meets at t
/// positions (BERT's count has no biases or layer norms): query, key,
/// value and output (4C^2) and the feed-forward (2CF) of each block but
/// the last, whose query, key and value run on every row (the first row
/// attends to them all) and output and feed-forward on the first row
/// alone, as the pooler (C x C) and classifier (C x 2) do.
fn bert_tiny_classifier_weights(t: f64) -> f64 {
    let (l, c, f) = (BERT_TINY.layers, BERT_TINY.width, BERT_TINY.hidden);
    let last = 3.0 * c * c + (c * c + 2.0 * c * f) / t;
    (l - 1.0) * (4.0 * c * c + 2.0 * c * f) + last + (c * c + 2.0 * c) / t
}

/// GPT-2's parameters a token meets: per block ln_1 (2C), c_attn (C x 3C
/// and 3C), attn.c_proj (C x C and C), ln_2 (2C), mlp.c_fc (C x 4C and
/// 4C), mlp.c_proj (4C x C and C); ln_f (2C); the token embedding once,
/// as the tied LM head. The position embedding is a lookup, not counted.
fn gpt2_params_met(s: &Shape) -> f64 {
    let c = s.width;
    let block = 2.0 * c
        + (3.0 * c * c + 3.0 * c)
        + (c * c + c)
        + 2.0 * c
        + (c * s.hidden + s.hidden)
        + (s.hidden * c + c);
    s.layers * block + 2.0 * c + s.vocab_rows * c
}

/// Training FLOPs a token at sequence length t by PaLM's appendix B (llm.c's
/// and nanoGPT's `estimate_mfu`): 6N (2 a multiply-add forward, 4
/// backward) plus 12 L H Q T for the attention scores and their use
/// (QK^T and AV, H Q = C, without causal savings).
fn palm_flops(params_met: f64, s: &Shape, t: f64) -> f64 {
    6.0 * params_met + 12.0 * s.layers * s.width * t
}

/// GPT-2 small at 1,024 tokens: the published 124,439,808 parameters
/// (Hugging Face's count, vocabulary 50,257) padded to 50,304 rows as
/// llm.c and nanoGPT pad them, less the 1,024 x 768 position embedding:
/// 123,689,472 met a token, 855,383,040 FLOPs.
#[test]
fn gpt2_small_costs_palms_flops_a_token() {
    let (c, t) = (768.0, 1024.0);
    let met = 124_439_808.0 + 47.0 * c - 1024.0 * c;
    let gpt2 = Shape {
        layers: 12.0,
        width: c,
        hidden: 4.0 * c,
        vocab_rows: 50_304.0,
    };
    assert_eq!(
        gpt2_params_met(&gpt2),
        met,
        "the hand count of the parameters"
    );
    let want = palm_flops(met, &gpt2, t);
    assert_eq!(want, 855_383_040.0);
    let model: ModelConfig = GptConfig::preset("gpt2").unwrap().into();
    close(model.flops_per_token(1024), want, "gpt2's FLOPs a token");
}

/// `bench --json`'s FLOPs a token and MFU for GPT-2 (`tiny`) and each BERT
/// head, against PaLM's count written out for the shape: the figure
/// printed, and the MFU it gives at the printed tokens/s and peak.
#[test]
fn bench_prints_palms_flops_and_the_mfu_they_give_for_every_family() {
    let check = |row: &serde_json::Value, want: f64, what: &str| {
        close(row["flops_per_token"].as_f64().unwrap(), want, what);
        let ms = row["ms_per_step"].as_f64().unwrap();
        let tokens = row["batch"].as_f64().unwrap() * row["seq"].as_f64().unwrap();
        let tokens_per_s = row["tokens_per_s"].as_f64().unwrap();
        close(
            tokens_per_s,
            tokens / (ms / 1e3),
            &format!("{what}: tokens/s"),
        );
        let peak = row["peak_gflops"].as_f64().unwrap() * 1e9;
        assert_eq!(peak, 1e12, "{what}: the stated peak");
        close(
            row["mfu"].as_f64().unwrap(),
            want * tokens_per_s / peak,
            &format!("{what}: MFU"),
        );
    };
    let t = 32.0;
    let row = bench(&["--model", "tiny"], 32, &[]);
    check(
        &row,
        palm_flops(gpt2_params_met(&TINY), &TINY, t),
        "gpt2 tiny",
    );
    // a step of 2 micro-batches trains on 2 x 2 x 32 tokens in its ms
    let row = bench(&["--model", "tiny"], 32, &["--grad-accum", "2"]);
    let ms = row["ms_per_step"].as_f64().unwrap();
    close(
        row["tokens_per_s"].as_f64().unwrap(),
        (2 * 2 * 32) as f64 / (ms / 1e3),
        "gpt2 tiny --grad-accum 2: tokens/s",
    );

    // BERT counts its matmul weights alone (no biases or layer norms):
    // per block query, key, value and output (4C^2) and the feed-forward
    // (2CF), and attention's 12 L T C.
    let small = ["--n-layer", "1", "--n-head", "2", "--n-embd", "64"];
    let bert = Shape {
        layers: 1.0,
        width: 64.0,
        hidden: 256.0,
        // --vocab-size 1000, padded to 1,024 rows
        vocab_rows: 1024.0,
    };
    let (c, f, t) = (bert.width, bert.hidden, 16.0);
    let blocks = bert.layers * (4.0 * c * c + 2.0 * c * f);
    // the masked-LM head (transform C x C, decoder C x V tied) runs on the
    // 15% of positions BERT masks
    let mlm = 0.15 * (c * c + c * bert.vocab_rows);
    // the pooler (C x C) and next-sentence classifier (C x 2) on one row
    // of each sequence
    let nsp = (c * c + c * 2.0) / t;
    for (preset, head, what) in [
        ("bert-minilm-mlm", mlm, "bert mlm"),
        ("bert-base-pretrain", mlm + nsp, "bert pretrain"),
    ] {
        let mut model = vec!["--model", preset, "--vocab-size", "1000"];
        model.extend(small);
        let row = bench(&model, 16, &[]);
        check(&row, palm_flops(blocks + head, &bert, t), what);
    }

    let row = bench(&["--model", "bert-tiny"], 16, &[]);
    let want = palm_flops(bert_tiny_classifier_weights(t), &BERT_TINY, t);
    check(&row, want, "bert classify");
}

/// The kernels' own products, counted by `bench --profile` from the shapes
/// each matmul and attention call ran on, a token: GPT-2's matmul weights
/// (the hand count without its bias and layer-norm vectors: 12 C^2 a
/// block and the LM head's V x C) 6 times each, and attention's 12 L T C;
/// bert-tiny's classifier, whose count has no vectors.
#[test]
fn the_kernels_products_add_up_to_the_hand_count() {
    let kernel_flops = |row: &serde_json::Value| -> f64 {
        let kernels = row["profile"]["kernels"].as_array().expect("a profile");
        let flops: f64 = kernels
            .iter()
            .filter_map(|k| Some(k["gflops"].as_f64()? * k["ms_per_step"].as_f64()? * 1e6))
            .sum();
        flops / (row["batch"].as_f64().unwrap() * row["seq"].as_f64().unwrap())
    };
    let t = 32.0;
    let c = TINY.width;
    let matmuls = TINY.layers * (3.0 * c * c + c * c + 2.0 * c * TINY.hidden) + TINY.vocab_rows * c;
    let row = bench(&["--model", "tiny"], 32, &["--profile"]);
    close(
        kernel_flops(&row),
        palm_flops(matmuls, &TINY, t),
        "gpt2 tiny's kernels",
    );

    // and one product the count leaves out as a lookup: the token types'
    // one-hot rows times their embeddings (2 x C), forward and the
    // weight's gradient (the one-hot input has none)
    let (c, t) = (BERT_TINY.width, 16.0);
    let types = 2.0 * 2.0 * c + 2.0 * 2.0 * c;
    let row = bench(&["--model", "bert-tiny"], 16, &["--profile"]);
    let want = palm_flops(bert_tiny_classifier_weights(t), &BERT_TINY, t) + types;
    close(kernel_flops(&row), want, "bert classify's kernels");
}

/// `plan --json`'s compute term for `tiny` on a stated device (100
/// TFLOP/s at 50%): each data-parallel rank's share of the batch at PaLM's
/// count, and under tensor parallelism the blocks split over the group
/// and the LM head (6 V C) not.
#[test]
fn plan_prices_compute_at_palms_flops() {
    let device = [
        "--device",
        "custom",
        "--peak-tflops",
        "100",
        "--efficiency",
        "0.5",
        "--memory-gb",
        "80",
        "--memory-bandwidth-gbs",
        "2000",
        "--intra-gbs",
        "400",
        "--inter-gbs",
        "50",
    ];
    let mut args = vec!["plan", "--json", "--all", "--model", "tiny"];
    args.extend([
        "--world-size",
        "1,2",
        "--batch-size",
        "8",
        "--seq-len",
        "32",
    ]);
    args.extend(device);
    let j = json_of(&args);
    let (b, t) = (8.0, 32.0);
    let flops = palm_flops(gpt2_params_met(&TINY), &TINY, t);
    let head = 6.0 * TINY.vocab_rows * TINY.width;
    let mut checked = 0;
    for p in j["plans"].as_array().unwrap() {
        for pred in p["predictions"].as_array().unwrap() {
            let par = &pred["parallel"];
            let world = par["world_size"].as_f64().unwrap();
            let tp = par["tp"].as_f64().unwrap();
            if par["pipeline"]["stages"] != 1 || par["recompute"] == true {
                continue;
            }
            let dp = world / tp;
            let a_token = (flops - head) / tp + head;
            let want = b / dp * t * a_token / (100e12 * 0.5);
            let got = pred["time"]["compute_s"].as_f64().unwrap();
            close(got, want, &format!("compute of {par}"));
            checked += 1;
        }
    }
    // single; ddp, zero1, zero2, fsdp and tp on 2
    assert_eq!(checked, 6, "{j}");
}

/// The workload of `cfg` at `b` x `t` with `acc` micro-batches, and the
/// H100 (fp32, half its peak) and its network that `plan` prices it on.
fn priced_on_h100(
    cfg: &ModelConfig,
    b: usize,
    t: usize,
    acc: usize,
) -> (Workload, Device, Network) {
    let w = Workload {
        model: cfg.clone(),
        batch: b,
        seq_len: t,
        grad_accum: acc,
        cpu_threads: None,
    };
    let device = Device::datasheet("h100", Precision::Fp32, 0.5).unwrap();
    (w, device, Network::datasheet("h100").unwrap())
}

/// The bytes the busiest of `par`'s thread ranks sends in a step of `spec`.
fn busiest_rank_sends(cfg: &ModelConfig, par: ParallelConfig, spec: BenchSpec) -> f64 {
    let ranks = launch::run_local(par.world_size, 2, Duration::from_secs(120), |comm| {
        bench_rank(Cpu::new(), cfg, par, spec, comm.as_ref())
    })
    .unwrap();
    ranks[0]
        .iter()
        .map(|r| r.comm_bytes_per_step)
        .fold(0.0, f64::max)
}

/// A 4-block GPT-2, 64 wide with 4 heads over 65 characters (210,304
/// fp32 parameters), at 2 micro-batches of 8 x 32.
fn four_block_gpt2() -> (ModelConfig, (usize, usize, usize)) {
    let cfg = GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 64,
        block_size: 32,
        vocab_size: 65,
        blocks: Vec::new(),
    };
    (cfg.into(), (8, 32, 2))
}

/// bench's collectives a step are its timed steps' alone: after a warm-up
/// step, each of two timed steps of ddp x2 (`distgpt bench`) sends the
/// ring all-reduce of the gradient, 2 (n - 1) / n of its 4 bytes a
/// parameter, as one step alone does (not the warm-up's bytes too, nor the
/// last step's over two); plus the step's few scalars (its loss), under
/// 256 bytes, as in `each_strategys_volume_is_the_papers_and_what_thread_ranks_send`.
#[test]
fn bench_counts_the_collectives_of_its_timed_steps_alone() {
    let want = 2.0 * 0.5 * 4.0 * TINY_PARAMS;
    for (steps, warmup) in [("1", "0"), ("2", "1")] {
        let mut args = vec!["bench", "--json", "--steps", steps, "--warmup", warmup];
        args.extend(["--batch-size", "2", "--seq-len", "32", "--peak-tflops", "1"]);
        args.extend(["--model", "tiny", "--strategy", "ddp", "--world-size", "2"]);
        let j = json_of(&args);
        for r in j["ranks"].as_array().unwrap() {
            let got = r["comm_bytes_per_step"].as_f64().unwrap();
            assert!(
                (want..want + 256.0).contains(&got),
                "{warmup} warm-up, {steps} timed: {got} bytes a step, {want} by hand"
            );
        }
    }
}

/// One timed step of `acc` micro-batches of `b` x `t`, quietly.
fn one_step(b: usize, t: usize, acc: usize) -> BenchSpec {
    BenchSpec {
        batch: b,
        grad_accum: acc,
        seq_len: t,
        warmup: 0,
        steps: 1,
        show: false,
        profile: false,
    }
}

/// Bytes a rank sends a step, by the papers' ring volumes for a 4-block
/// GPT-2 (64 wide, 65 characters: 210,304 fp32 parameters) at 2
/// micro-batches of 8 x 32: ddp's all-reduce 2(n-1)/n P; ZeRO-1's
/// reduce-scatter of the gradient and all-gather of the parameters,
/// (n-1)/n P each; ZeRO-2's reduce-scatter each micro-batch; FSDP's two
/// all-gathers (forward, backward) and a reduce-scatter each micro-batch
/// (ZeRO-3's 3x); Megatron-LM's 4 all-reduces a layer and micro-batch of
/// the (b s, h) activations (f and g, forward and backward); a pipeline's
/// activation sent forward and its gradient sent back across each stage
/// boundary a micro-batch. Two terms come from the tied embedding (the
/// LM head reads the token embedding): under ZeRO-2 and FSDP the head's
/// backward reduce-scatters the embeddings unit with its share, and the
/// embeddings' own backward again; in a pipeline the first and last
/// stages all-reduce its gradient. `plan` prices these; what thread ranks
/// send in a real step is checked against them too (besides the step's
/// scalars: the loss and the gradient's norm, under 256 bytes). FSDP
/// gathers less than ZeRO-3's two a micro-batch, as written out below.
#[test]
fn each_strategys_volume_is_the_papers_and_what_thread_ranks_send() {
    let (cfg, (b, t, acc)) = four_block_gpt2();
    let (w, device, net) = priced_on_h100(&cfg, b, t, acc);
    let (l, c) = (4.0, 64.0);
    // in fp32 bytes: the embeddings unit (token embedding of 128 rows,
    // position embedding of 32), each block, the head (ln_f)
    let embeddings = 4.0 * (128.0 * c + 32.0 * c);
    let block = 4.0 * (12.0 * c * c + 13.0 * c);
    let head = 4.0 * 2.0 * c;
    let p = embeddings + l * block + head;
    assert_eq!(p, 4.0 * 210_304.0);
    let stream = (b * t) as f64 * c * 4.0;
    let spec = one_step(b, t, acc);
    let a = acc as f64;
    let (mut checked, mut wrong) = (Vec::new(), Vec::new());
    for world in [2, 4] {
        let n = world as f64;
        let ring = (n - 1.0) / n;
        for par in plan::layouts(&w, world, false) {
            let r = par.resolved();
            let (tp, pp) = (r.tp, r.pipeline.stages);
            // (the plan's, the run's)
            let want = if par.dp() == world {
                // FSDP keeps the tied embeddings in a buffer of their own
                // (gathered once a step) and gathers the rest into one
                // shared buffer, each block forward and backward and the
                // head forward (it stays there for its backward), but block
                // 0, which stays from one micro-batch's backward to the
                // next's forward: less than ZeRO-3's 2 x acc gathers
                let gathered = embeddings + a * (2.0 * l * block + head) - (a - 1.0) * block;
                match r.strategy {
                    StrategyKind::Ddp => 2.0 * ring * p,
                    StrategyKind::Zero1 => ring * p + ring * p,
                    StrategyKind::Zero2 => a * ring * (p + embeddings) + ring * p,
                    StrategyKind::Fsdp => ring * gathered + a * ring * (p + embeddings),
                    s => panic!("{s} over {world} data-parallel ranks"),
                }
            } else if tp == world {
                a * 4.0 * l * 2.0 * ring * stream
            } else if pp == world {
                // each of a rank's chunks sends forward but from the last
                // stage and backward but from the first; the ranks of those
                // two all-reduce the embeddings' gradient between them
                let v = r.pipeline.virtual_stages;
                let last = pp * v - 1;
                (0..pp)
                    .map(|s| {
                        let sends: usize = (0..v)
                            .map(|k| k * pp + s)
                            .map(|stage| usize::from(stage != last) + usize::from(stage != 0))
                            .sum();
                        let tie = if s == 0 || s == pp - 1 {
                            embeddings
                        } else {
                            0.0
                        };
                        a * sends as f64 * stream + tie
                    })
                    .fold(0.0, f64::max)
            } else if tp == 1 && pp == 2 {
                // pp 2 x dp 2 (4 blocks, 2 a stage): the first stage holds
                // the embeddings, the last the head and a copy of the
                // embeddings for it; each sends one way a micro-batch a
                // chunk (its half-batch's activation or gradient) but for
                // the second chunk's two sends when interleaved, and the two
                // all-reduce the tie (their shard of it where sharded). No
                // rank holds the tie and its reader, so nothing is reduced
                // twice. Under fsdp, 1f1b runs the first stage F0 F1 B0 B1
                // and the last F0 B0 F1 B1 through one shared gather
                // buffer (the copy has its own), gathering the embeddings
                // 4 times and the blocks 7 (of 8) on the first; the copy
                // once, the blocks 7 times and the head twice on the last.
                let v = r.pipeline.virtual_stages as f64;
                let ring = 0.5;
                let sends = a * (2.0 * v - 1.0) * stream / 2.0;
                let stage = embeddings + 2.0 * block;
                let ranks = [
                    (stage, 4.0 * embeddings),
                    (stage + head, embeddings + 2.0 * head),
                ];
                match (r.strategy, r.pipeline.schedule) {
                    // checked against what the ranks send alone
                    (StrategyKind::Fsdp, s) if s != Schedule::OneFOneB => f64::NAN,
                    (strategy, _) => ranks
                        .map(|(q, gathers)| match strategy {
                            StrategyKind::Ddp => 2.0 * ring * q + sends + embeddings,
                            StrategyKind::Zero1 => 2.0 * ring * q + sends + embeddings / 2.0,
                            StrategyKind::Zero2 => ring * (a + 1.0) * q + sends + embeddings / 2.0,
                            StrategyKind::Fsdp => {
                                let gathered = gathers + 7.0 * block;
                                ring * (gathered + a * q) + sends + embeddings / 2.0
                            }
                            s => panic!("{s} over pp 2 x dp 2"),
                        })
                        .into_iter()
                        .fold(0.0, f64::max),
                }
            } else {
                continue;
            };
            let predicted = plan::predict(&w, par, &device, &net, Precision::Fp32);
            let sent = busiest_rank_sends(&cfg, par, spec);
            let planned = predicted.time.comm_bytes;
            let want = if want.is_nan() { planned } else { want };
            if (planned - want).abs() > 1e-9 * want || !(want..want + 256.0).contains(&sent) {
                wrong.push(format!(
                    "{}: planned {planned} and the busiest rank sent {sent}, {want} by hand",
                    par.layout_name()
                ));
            }
            checked.push(par.layout_name());
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // on 2: ddp, zero1, zero2, fsdp, tp, three pipelines; on 4: those
    // but interleaved (4 blocks in 4 stages have no second chunk), and
    // each of the four strategies over pp 2 x dp 2 with each of the three
    assert_eq!(checked.len(), 27, "{checked:?}");
}

/// Megatron-LM's all-reduces for a BERT classifier over tp 2, whose last
/// block runs on one row a sequence after its attention: there the
/// attention output's and feed-forward's forward all-reduces (and their
/// second run under recomputation) and the feed-forward's input-gradient
/// all-reduce carry b rows, not b s; only the query, key and value's
/// input gradient carries every row. `plan`'s figure and what the two
/// thread ranks send against it (besides the step's scalars).
#[test]
fn a_classifiers_last_block_reduces_one_row_a_sequence_under_tp() {
    use distgpt::model::bert::BertHead;
    let (l, c) = (2.0, 64.0);
    let cfg = common::small_bert(BertHead::Classify { labels: 3 });
    let (b, t, acc) = (8usize, 32usize, 2usize);
    let (w, device, net) = priced_on_h100(&cfg, b, t, acc);
    let spec = one_step(b, t, acc);
    let (every_row, one_row) = ((b * t) as f64 * c * 4.0, b as f64 * c * 4.0);
    // a ring all-reduce over 2 ranks sends 2 (2 - 1) / 2 of the buffer
    let mut checked = 0;
    let layouts = [false, true].map(|recompute| plan::layouts(&w, 2, recompute));
    for par in layouts.into_iter().flatten() {
        if par.resolved().tp != 2 {
            continue;
        }
        let (per_layer, last_one_row) = match par.recompute {
            true => (6.0, 5.0),
            false => (4.0, 3.0),
        };
        let a_micro_batch = (l - 1.0) * per_layer * every_row + every_row + last_one_row * one_row;
        let want = acc as f64 * a_micro_batch;
        let planned = plan::predict(&w, par, &device, &net, Precision::Fp32)
            .time
            .comm_bytes;
        close(planned, want, &par.layout_name());
        let sent = busiest_rank_sends(&cfg, par, spec);
        assert!(
            (want..want + 256.0).contains(&sent),
            "{}: the busiest rank sent {sent}, {want} by hand",
            par.layout_name()
        );
        checked += 1;
    }
    assert_eq!(checked, 2, "tp x2, with and without recomputation");
}

/// `plan`'s update and offload terms for the 4-block GPT-2 of the volumes'
/// test (210,304 fp32 parameters) over 2 data-parallel ranks on an H100,
/// against AdamW's traffic counted by hand: the update reads each
/// parameter it owns, its gradient and both moments and writes the
/// parameter and the moments, 7 x 4 = 28 bytes, at the HBM3's 3.35 TB/s;
/// offloaded (ZeRO-Offload), the gradient goes down and the parameter
/// comes back over PCIe (4 + 4 bytes, 50 GB/s), the host keeps an fp32
/// copy of the parameter, the gradient and both moments (4 + 4 + 8) and
/// runs the 28 bytes at its 50 GB/s; fsdp's `--offload params` sends its
/// shard up for each gather instead (a forward and a backward each
/// micro-batch). With `--offload-serial` the copies and the host's update
/// add up. A rank's tokens a second are its step's tokens over the sum of
/// compute, communication and update.
#[test]
fn plan_prices_the_update_and_offload_as_adamw_moves_its_bytes() {
    use distgpt::parallel::Offload;
    let (cfg, (b, t, acc)) = four_block_gpt2();
    let (w, device, net) = priced_on_h100(&cfg, b, t, acc);
    let p = 210_304.0;
    let (hbm, pcie, host) = (3.35e12, 50e9, 50e9);
    let mut checked = Vec::new();
    for par in plan::layouts(&w, 2, false) {
        if par.dp() != 2 {
            continue;
        }
        // every unit of this model has an even length: a shard is half
        let owned = match par.strategy {
            StrategyKind::Ddp => p,
            _ => p / 2.0,
        };
        let mut variants = vec![par];
        variants.extend(plan::offloaded(&par).into_iter().map(|o| ParallelConfig {
            offload_serial: true,
            ..o
        }));
        for v in variants {
            let got = plan::predict(&w, v, &device, &net, Precision::Fp32);
            let name = format!("{} offload {:?}", v.layout_name(), v.offload);
            let update_host = owned * 28.0 / host;
            let (optimizer_s, pcie_bytes) = match v.offload {
                Offload::None => (owned * 28.0 / hbm, 0.0),
                Offload::Optimizer => ((owned * 8.0) / pcie + update_host, owned * 8.0),
                Offload::Params => {
                    let moved = owned * 4.0 + acc as f64 * 2.0 * owned * 4.0;
                    (moved / pcie + update_host, moved)
                }
            };
            close(
                got.time.optimizer_s,
                optimizer_s,
                &format!("{name}: optimizer_s"),
            );
            close(
                got.time.pcie_bytes,
                pcie_bytes,
                &format!("{name}: pcie_bytes"),
            );
            let h = &got.memory.host;
            let on_host = match v.offload {
                Offload::None => [0.0; 3],
                _ => [4.0 * owned, 4.0 * owned, 8.0 * owned],
            };
            for (what, got, want) in [
                ("params", h.params, on_host[0]),
                ("grads", h.grads, on_host[1]),
                ("optimizer", h.optimizer, on_host[2]),
            ] {
                assert!(
                    (got - want).abs() <= 1e-9 * want,
                    "{name}: host {what} {got}, {want} by hand"
                );
            }
            let step = got.time.compute_s + got.time.comm_s + got.time.optimizer_s;
            close(
                got.tokens_per_s,
                (b * t * acc) as f64 / step,
                &format!("{name}: tokens/s"),
            );
            checked.push(name);
        }
    }
    // ddp, zero1, zero2 (each also offloaded) and fsdp (also its params)
    assert_eq!(checked.len(), 9, "{checked:?}");
}

/// `plan --json` on a 6.66-billion-parameter GPT-2 (32 blocks 4,096 wide,
/// 51,200 words, 1,024 positions: 12 L C^2 + 13 L C + (V + T) C + 2 C =
/// 6,658,072,576 parameters) over 64 H100s of 80 GB in mixed precision:
/// data parallelism's model states are the ZeRO paper's 16 bytes a
/// parameter (106.5 GB), which do not fit; a layout fits when its rank's
/// bytes do; the recommendation is the fastest layout that fits; each
/// plan is priced at the `--efficiency` asked for, which scales its
/// compute time.
#[test]
fn plan_fits_what_the_memory_holds_and_recommends_the_fastest_that_fits() {
    let psi = 12.0 * 32.0 * 4096.0f64.powi(2)
        + 13.0 * 32.0 * 4096.0
        + (51_200.0 + 1_024.0) * 4096.0
        + 2.0 * 4096.0;
    assert_eq!(psi, 6_658_072_576.0);
    let args = |efficiency: &str| {
        let mut a = vec!["plan", "--json", "--model", "gpt2", "--device", "h100"];
        a.extend([
            "--precision",
            "mixed",
            "--n-layer",
            "32",
            "--n-embd",
            "4096",
        ]);
        a.extend([
            "--n-head",
            "32",
            "--block-size",
            "1024",
            "--vocab-size",
            "51200",
        ]);
        a.extend([
            "--world-size",
            "64",
            "--batch-size",
            "64",
            "--efficiency",
            efficiency,
        ]);
        json_of(&a)
    };
    let (j, slower) = (args("0.4"), args("0.2"));
    let plan = &j["plans"][0];
    assert_eq!(plan["efficiency"], 0.4);
    assert_eq!(slower["plans"][0]["efficiency"], 0.2);
    let f = |p: &serde_json::Value, k: &str| p[k].as_f64().unwrap();
    // every layout priced, then each offloaded
    let rows_of = |j: &serde_json::Value| {
        let plan = &j["plans"][0];
        let mut rows = plan["predictions"].as_array().unwrap().clone();
        rows.extend(plan["offloaded"].as_array().unwrap().iter().cloned());
        rows
    };
    let (rows, mut fastest, mut ddp_seen) = (rows_of(&j), None::<(f64, String)>, false);
    for (p, q) in rows.iter().zip(rows_of(&slower)) {
        let name = format!("{}", p["parallel"]);
        let m = &p["memory"];
        let device_bytes: f64 = [
            "params",
            "grads",
            "optimizer",
            "activations",
            "gathered",
            "other",
        ]
        .iter()
        .map(|k| f(m, k))
        .sum();
        assert_eq!(
            p["fits"].as_bool().unwrap(),
            device_bytes <= 80e9,
            "{name}: {device_bytes} bytes"
        );
        let states = f(m, "params") + f(m, "grads") + f(m, "optimizer");
        let par = &p["parallel"];
        if par["strategy"] == "ddp"
            && par["tp"] == 1
            && par["pipeline"]["stages"] == 1
            && par["offload"].is_null()
        {
            close(states, 16.0 * psi, &format!("{name}: model states"));
            assert!(!p["fits"].as_bool().unwrap(), "{name} fits");
            ddp_seen = true;
        }
        let time = &p["time"];
        let step = f(time, "compute_s") + f(time, "comm_s") + f(time, "optimizer_s");
        close(
            f(p, "tokens_per_s"),
            64.0 * 1024.0 / step,
            &format!("{name}: tokens/s"),
        );
        close(
            f(&q["time"], "compute_s"),
            2.0 * f(time, "compute_s"),
            &format!("{name}: compute at half the efficiency"),
        );
        if p["fits"].as_bool().unwrap() && fastest.as_ref().is_none_or(|(s, _)| step < *s) {
            let r: distgpt::parallel::ParallelConfig =
                serde_json::from_value(p["parallel"].clone()).unwrap();
            fastest = Some((step, r.layout_name()));
        }
    }
    assert!(ddp_seen, "no ddp x64 among {} layouts", rows.len());
    let (_, best) = fastest.expect("a layout that fits");
    assert_eq!(plan["recommended"], best.as_str());
}

/// The number after `label` in `text` (a `%` or `,` ends it).
fn figure_after(text: &str, label: &str) -> f64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in: {text}"));
    text[at + label.len()..]
        .split(|c: char| c.is_whitespace() || c == '%' || c == ',' || c == '(')
        .find(|s| !s.is_empty())
        .unwrap()
        .parse()
        .unwrap_or_else(|e| panic!("{label:?} in {text}: {e}"))
}

/// A copy of model folder `from` in `to`, each tensor of its
/// `model.safetensors` (fp32) as `set(name, elements)` says where it says.
fn folder_with(
    from: &std::path::Path,
    to: &std::path::Path,
    set: impl Fn(&str, usize) -> Option<Vec<f32>>,
) {
    use safetensors::tensor::{Dtype, SafeTensors, TensorView};
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(from).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() && f.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(from.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let data = match set(&name, v.shape().iter().product()) {
                Some(x) => x.iter().flat_map(|x| x.to_le_bytes()).collect(),
                None => v.data().to_vec(),
            };
            (name, v.shape().to_vec(), data)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, data)| {
        let view = TensorView::new(Dtype::F32, shape.clone(), data).unwrap();
        (name.clone(), view)
    });
    let out = safetensors::serialize(views, &None).unwrap();
    std::fs::write(to.join("model.safetensors"), out).unwrap();
}

/// transformers' own `BertForPreTraining` (tests/fixtures/bert_tiny/pretrain,
/// made by scripts/make_bert_fixture.py; 99 ids) with its two heads set so
/// that what they say is known whatever the encoder computes: the masked-LM
/// transform's LayerNorm gain and bias 0 (its output is 0, so a masked
/// position's logits are the decoder's bias, 0 too: uniform over the 99
/// ids) and the next-sentence classifier's weight 0 and bias (0, `beta`)
/// (every pair's logits (0, beta)). Tensors named as transformers names
/// them, with a vocabulary of letters and their continuations.
fn pretraining_folder_with_known_heads(dir: &std::path::Path, beta: f32) -> std::path::PathBuf {
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bert_tiny/pretrain");
    let model = dir.join(format!("pretrain-beta{beta}"));
    folder_with(&fixture, &model, |name, n| match name {
        "cls.predictions.transform.LayerNorm.weight"
        | "cls.predictions.transform.LayerNorm.bias"
        | "cls.predictions.bias"
        | "cls.seq_relationship.weight" => Some(vec![0.0; n]),
        "cls.seq_relationship.bias" => Some(vec![0.0, beta]),
        _ => None,
    });
    // the fixture's folder holds its reference beside the model
    let _ = std::fs::remove_file(model.join("reference.safetensors"));
    let mut vocab: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .map(String::from)
        .to_vec();
    vocab.extend(('a'..='z').map(|c| c.to_string()));
    vocab.extend(('a'..='z').map(|c| format!("##{c}")));
    vocab.extend((0..99 - vocab.len()).map(|i| format!("w{i}")));
    std::fs::write(model.join("vocab.txt"), vocab.join("\n")).unwrap();
    model
}

/// `eval` of a pretraining model (masked LM + next sentence) whose heads
/// say known things: the loss is ln 99 (uniform over the vocabulary at
/// every masked position) plus the next-sentence mean, ln 2 where the
/// classifier's logits are (0, 0). With logits (0, b) for every pair the
/// next-sentence loss is (1 - q) ln(1 + e^b) + q ln(1 + e^-b), q the
/// share of pairs whose label is 1 (B not A's continuation), so q is read
/// from the printed loss; every pair is predicted 1 for b > 0, so the
/// accuracy is q and the F1 (scikit-learn's for two labels: of label 1,
/// 2 tp / (2 tp + fp + fn), tp = q n, fp = (1 - q) n, fn = 0) 2q / (1 + q);
/// for b < 0 every pair is predicted 0: accuracy 1 - q and F1 0 (no true
/// positive). The pairs are the same in each (the seed fixes them).
#[test]
fn pretrainings_eval_scores_known_heads_as_their_definitions_say() {
    let dir = common::scratch("pretrain-known-heads");
    std::fs::create_dir_all(&dir).unwrap();
    let words = [
        "good", "day", "sir", "buy", "cheap", "pills", "now", "fine", "tea",
    ];
    let body: Vec<&str> = (0..2000)
        .map(|i| words[(i * 7 + i / 9) % words.len()])
        .collect();
    let text = dir.join("text.txt");
    std::fs::write(&text, body.join(" ")).unwrap();
    let eval = |beta: f32| -> String {
        let model = pretraining_folder_with_known_heads(&dir, beta);
        let args = [
            "eval",
            model.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--batches",
            "8",
        ];
        stdout_of(&args)
    };
    // printed to 4 places (the loss, F1) and 2 of a percent (accuracy)
    let near = |got: f64, want: f64, places: f64, what: &str, text: &str| {
        assert!(
            (got - want).abs() <= 0.5 * 10f64.powf(-places) + 1e-6,
            "{what}: {got} printed, {want} by hand, in: {text}"
        );
    };
    let mlm = 99f64.ln();
    let loss = "masked-LM + next-sentence loss ";
    let text0 = eval(0.0);
    near(
        figure_after(&text0, loss),
        mlm + 2f64.ln(),
        4.0,
        "loss at (0, 0)",
        &text0,
    );
    // "(32 sequences of 16 tokens)"
    let n: usize = text0
        .rsplit_once('(')
        .and_then(|(_, r)| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of pairs in: {text0}"));
    assert_eq!(n, 4 * 8, "4 x 8 pairs scored: {text0}");

    let b = 2.0f64;
    let softplus = |x: f64| (1.0 + x.exp()).ln();
    let text_pos = eval(b as f32);
    let nsp = figure_after(&text_pos, loss) - mlm;
    // (1 - q) softplus(b) + q softplus(-b), and softplus(b) - softplus(-b) = b
    let q = (softplus(b) - nsp) / b;
    let ones = (q * n as f64).round();
    assert!(
        (q * n as f64 - ones).abs() < 0.05 && ones > 0.0 && ones < n as f64,
        "q = {q} of {n} pairs from the loss, in: {text_pos}"
    );
    let q = ones / n as f64;
    near(
        figure_after(&text_pos, "next-sentence accuracy ") / 100.0,
        q,
        4.0,
        "accuracy, every pair predicted 1",
        &text_pos,
    );
    near(
        figure_after(&text_pos, "F1 "),
        2.0 * q / (1.0 + q),
        4.0,
        "F1, every pair predicted 1",
        &text_pos,
    );

    let text_neg = eval(-b as f32);
    let want = mlm + (1.0 - q) * softplus(-b) + q * softplus(b);
    near(
        figure_after(&text_neg, loss),
        want,
        4.0,
        "loss at (0, -b)",
        &text_neg,
    );
    near(
        figure_after(&text_neg, "next-sentence accuracy ") / 100.0,
        1.0 - q,
        4.0,
        "accuracy, every pair predicted 0",
        &text_neg,
    );
    assert_eq!(
        figure_after(&text_neg, "F1 "),
        0.0,
        "no true positive: {text_neg}"
    );
}

/// `tiny`'s fp32 parameters as a run trains it on the embedded corpus (65
/// characters, 128 rows) at its block size of 64: the token and position
/// embeddings (128 + 64 rows of 32), each block's 12 C^2 + 13 C (c_attn C x
/// 3C and 3C, attn.c_proj C x C and C, mlp C x 4C, 4C, 4C x C, C, two
/// norms 2C each), ln_f's 2C.
const TINY_PARAMS: f64 = (128.0 + 64.0) * 32.0 + 2.0 * (12.0 * 32.0 * 32.0 + 13.0 * 32.0) + 64.0;

/// `metrics.jsonl` of a `train` of `tiny` for 2 steps of 4 x 16 under
/// `strategy` on `world` thread ranks, evaluated on 2 batches at the end.
fn metrics_of_train(strategy: &str, world: usize) -> Vec<serde_json::Value> {
    let out = common::scratch(&format!("metrics-{strategy}-{world}"));
    let world = world.to_string();
    let args = [
        "train",
        "--model",
        "tiny",
        "--strategy",
        strategy,
        "--world-size",
        &world,
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--eval-every",
        "0",
        "--eval-batches",
        "2",
        "--out",
        out.to_str().unwrap(),
    ];
    stdout_of(&args);
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Each step's `memory` (rank 0's counters), `rank_peak_bytes` (each rank's
/// [params, grads, optimizer, activations, other, total]) and `comm` (rank
/// 0's bytes so far) in `metrics.jsonl`, against the ZeRO paper's model
/// states in fp32 with AdamW's two moments (4 + 4 + 8 bytes a parameter,
/// the sharded ones over N) and the rings' volumes a step, for Psi =
/// `TINY_PARAMS` by hand: ddp all-reduces the gradient, 2 (N-1)/N 4 Psi;
/// ZeRO-1 and -2 reduce-scatter it and all-gather the parameters, (N-1)/N
/// 4 Psi each, ZeRO-2 reduce-scattering the tied embeddings unit a second
/// time (the head's backward); FSDP gathers the embeddings unit once, each
/// block forward and backward and ln_f, and holds the embeddings and one
/// block gathered beside its shard; its evaluation at the last step
/// gathers the embeddings once and each block and ln_f a batch. Besides:
/// the scalars (the loss, the gradient's norm, the evaluation's sums,
/// under 256 bytes a step) in the all-reduces.
/// Activations and scratch have no outside count; the total is the peak
/// of the sum, so at most the categories' peaks added.
#[test]
fn metrics_record_the_zero_papers_model_states_and_the_rings_volumes() {
    let psi = TINY_PARAMS;
    assert_eq!(psi, 31_616.0, "tiny's parameters by hand");
    let (c, l) = (32.0, 2.0);
    let embeddings = 4.0 * (128.0 + 64.0) * c;
    let block = 4.0 * (12.0 * c * c + 13.0 * c);
    let ln_f = 4.0 * 2.0 * c;
    let p = 4.0 * psi;
    let as_u64 = |v: &serde_json::Value| v.as_u64().unwrap() as f64;
    for world in [2usize, 4] {
        let n = world as f64;
        let ring = (n - 1.0) / n;
        // [params, grads, optimizer] a rank; all-reduce, reduce-scatter and
        // all-gather bytes a step
        let cases = [
            ("ddp", [p, p, 2.0 * p], [2.0 * ring * p, 0.0, 0.0]),
            ("zero1", [p, p, 2.0 * p / n], [0.0, ring * p, ring * p]),
            (
                "zero2",
                [p, p / n, 2.0 * p / n],
                [0.0, ring * (p + embeddings), ring * p],
            ),
            (
                "fsdp",
                [p / n + embeddings + block, p / n, 2.0 * p / n],
                [
                    0.0,
                    ring * (p + embeddings),
                    ring * (embeddings + 2.0 * l * block + ln_f),
                ],
            ),
        ];
        for (strategy, states, volumes) in cases {
            let what = format!("{strategy} x{world}");
            let records = metrics_of_train(strategy, world);
            assert_eq!(records.len(), 2, "{what}: a record a step");
            for r in &records {
                let step = r["step"].as_u64().unwrap() as f64;
                let rows = r["rank_peak_bytes"].as_array().unwrap();
                assert_eq!(rows.len(), world, "{what}: a row a rank");
                for (rank, row) in rows.iter().enumerate() {
                    let row: Vec<f64> = row.as_array().unwrap().iter().map(as_u64).collect();
                    assert_eq!(
                        row[..3],
                        states,
                        "{what} step {step} rank {rank}: params, grads, optimizer"
                    );
                    let parts: f64 = row[..5].iter().sum();
                    assert!(
                        row[5] <= parts && row[5] >= row[..3].iter().sum::<f64>(),
                        "{what} step {step} rank {rank}: total {} of {row:?}",
                        row[5]
                    );
                }
                let m = &r["memory"];
                let peak = &m["peak_bytes"];
                let mine = ["params", "grads", "optimizer"].map(|k| as_u64(&peak[k]));
                assert_eq!(mine, states, "{what} step {step}: rank 0's memory");
                assert_eq!(as_u64(&m["peak_total_bytes"]), as_u64(&rows[0][5]));
                let comm = &r["comm"];
                let sent = [
                    "all_reduce_bytes",
                    "reduce_scatter_bytes",
                    "all_gather_bytes",
                ]
                .map(|k| as_u64(&comm[k]));
                let mut want = volumes.map(|v| step * v);
                if strategy == "fsdp" && r["val_loss"].is_number() {
                    want[2] += ring * (embeddings + 2.0 * (l * block + ln_f));
                }
                for (k, (got, want)) in sent.iter().zip(want).enumerate() {
                    // the scalars go in the all-reduces
                    let scalars = if k == 0 { 256.0 * step } else { 0.0 };
                    assert!(
                        (want..=want + scalars).contains(got),
                        "{what} step {step}: {comm} sent, {volumes:?} a step by hand"
                    );
                }
                assert_eq!(
                    as_u64(&comm["p2p_bytes"]) + as_u64(&comm["broadcast_bytes"]),
                    0.0
                );
            }
        }
    }
}

/// `bench --json` as a child whose resources the OS reports when it is
/// reaped: its JSON line and the OS's count of its peak resident set
/// (`wait4`'s `ru_maxrss`, KiB on Linux), in bytes.
fn bench_with_the_os_peak(args: &[&str]) -> (serde_json::Value, u64) {
    use std::io::Read;
    // reaped below by wait4 (Child::wait would consume its resource usage)
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_distgpt"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 writes it and the status, for
    // the child this process spawned and has not reaped
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{args:?} exited with {status}"
    );
    (
        serde_json::from_str(&out).unwrap(),
        usage.ru_maxrss as u64 * 1024,
    )
}

/// `bench --json`'s resident memory against the OS's own count: the peak
/// printed (read from /proc as the bench ends) is the peak the kernel
/// reports for the process once it has exited, to the pages its exit may
/// touch (under 2 MiB); it holds the start and every rank's counted peak
/// (a model of 6.3 M parameters: 16 bytes each in model states over two
/// ranks). The times have no outside count: they are checked against
/// their definitions, parts of the step: a single rank spends none in
/// collectives, and a rank's collectives and update together take no
/// longer than its step.
#[test]
fn bench_prints_the_peak_resident_set_the_os_counts_and_times_within_the_step() {
    let mut args = vec!["bench", "--json", "--steps", "2", "--warmup", "1"];
    args.extend(["--batch-size", "2", "--seq-len", "32", "--peak-tflops", "1"]);
    args.extend(["--model", "tiny", "--n-embd", "512", "--n-head", "2"]);
    let (single, _) = bench_with_the_os_peak(&args);
    let rank = &single["ranks"][0];
    assert_eq!(rank["comm_seconds_per_step"], 0.0, "{single}");
    assert_eq!(rank["comm_bytes_per_step"], 0.0, "{single}");
    args.extend(["--strategy", "ddp", "--world-size", "2"]);
    let (j, os_peak) = bench_with_the_os_peak(&args);
    let bytes = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("{j}"));
    let printed = bytes(&j["peak_rss_bytes"]);
    let start = bytes(&j["rss_start_bytes"]);
    let mib = 1024 * 1024;
    assert!(
        printed <= os_peak && os_peak - printed < 2 * mib,
        "peak RSS {printed} printed, {os_peak} by the OS"
    );
    let ranks = j["ranks"].as_array().unwrap();
    let counted: u64 = ranks.iter().map(|r| bytes(&r["peak_bytes"]["total"])).sum();
    assert!(
        counted > 2 * 16 * 6_000_000 && start + counted <= printed,
        "start {start} and the ranks' {counted} counted, {printed} peak"
    );
    let step_s = j["ms_per_step"].as_f64().unwrap() / 1e3;
    for r in ranks {
        let comm = r["comm_seconds_per_step"].as_f64().unwrap();
        let update = r["update_seconds_per_step"].as_f64().unwrap();
        assert!(
            comm > 0.0 && update > 0.0 && comm + update <= step_s,
            "a rank's collectives {comm} s and update {update} s in a step of {step_s} s"
        );
    }
}

/// `eval --weights`' figures: "val loss X with F weights, Y with fp32
/// (+Z%); next-token top-1 agrees with fp32 at A% of N positions".
struct DecodedFigures {
    loss: f64,
    loss_f32: f64,
    change_percent: f64,
    agreement: f64,
    positions: f64,
}

fn eval_weights(folder: &std::path::Path, text: &std::path::Path, weights: &str) -> DecodedFigures {
    let args = [
        "eval",
        folder.to_str().unwrap(),
        "--weights",
        weights,
        "--data",
        text.to_str().unwrap(),
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--batches",
        "2",
    ];
    let line = stdout_of(&args);
    DecodedFigures {
        loss: figure_after(&line, "val loss "),
        loss_f32: figure_after(&line, "weights, "),
        change_percent: figure_after(&line, "fp32 ("),
        agreement: figure_after(&line, "agrees with fp32 at ") / 100.0,
        positions: figure_after(&line, "% of "),
    }
}

/// `eval --weights bf16` and `int8` of PyTorch's reference GPT-2 run
/// (tests/fixtures/reference_runs/lm, scripts/make_reference_runs.py) on
/// its validation split, 2 batches of 4 x 16: the fp32 loss beside the
/// other weights' is PyTorch's; the change is the two losses' ratio less
/// one; the agreement is a count of the 2 x 4 x 16 = 128 positions (the
/// share printed, to 0.005%, times 128 an integer). And the same model
/// with ln_f's gain and bias 0: the head sees 0, so every logit is 0 in
/// any format, every position's loss ln V (V the 57 characters of the
/// text, counted here, not the 64 rows the vocabulary is padded to) and
/// every position agrees.
#[test]
fn eval_weights_gives_pytorchs_fp32_loss_and_agreement_over_every_position() {
    let reference =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference_runs/lm");
    let text = reference.join("text.txt");
    // PyTorch's val_loss in reference.safetensors
    let bytes = std::fs::read(reference.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let val = st.tensor("val_loss").unwrap();
    let pytorch = f32::from_le_bytes(val.data()[..4].try_into().unwrap()) as f64;
    let positions = 2.0 * 4.0 * 16.0;
    let within = |got: f64, want: f64, half_unit: f64, what: &str| {
        assert!(
            (got - want).abs() <= half_unit + 1e-6,
            "{what}: {got} printed, {want} by hand"
        );
    };
    for weights in ["bf16", "int8"] {
        let e = eval_weights(&reference.join("final"), &text, weights);
        within(
            e.loss_f32,
            pytorch,
            5e-5,
            &format!("{weights}: the fp32 loss"),
        );
        within(
            e.change_percent,
            100.0 * (e.loss / e.loss_f32 - 1.0),
            5e-3 + 100.0 * 1e-4 / e.loss_f32,
            &format!("{weights}: the change"),
        );
        assert_eq!(e.positions, positions, "{weights}: positions");
        let agreeing = e.agreement * positions;
        assert!(
            (agreeing - agreeing.round()).abs() <= 5e-5 * positions
                && (0.9..=1.0).contains(&e.agreement),
            "{weights}: {} of {positions} positions agree",
            agreeing
        );
    }

    let chars = std::fs::read_to_string(&text).unwrap();
    let v = chars
        .chars()
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    assert_eq!(v, 57, "the text's characters");
    let blind = common::scratch("lm-blind-head");
    folder_with(&reference.join("final"), &blind, |name, n| {
        name.starts_with("transformer.ln_f.").then(|| vec![0.0; n])
    });
    for weights in ["bf16", "int8"] {
        let e = eval_weights(&blind, &text, weights);
        let uniform = (v as f64).ln();
        within(
            e.loss,
            uniform,
            5e-5,
            &format!("{weights}: uniform logits' loss"),
        );
        within(e.loss_f32, uniform, 5e-5, "fp32: uniform logits' loss");
        assert_eq!(
            (e.agreement, e.positions),
            (1.0, positions),
            "{weights}: all agree"
        );
    }
}

/// `bench --json`'s rates and peaks on two data-parallel thread ranks of
/// `tiny`, with no peak stated: each MFU is PaLM's FLOPs a token by hand x
/// the printed tokens/s over its peak (the matmul probe's, whose FLOPs
/// `blas::tests::the_large_probe_counts_an_mlp_layers_three_products`
/// counts by hand, and the hardware's); a rank's tokens/s is the step's
/// tokens over its time, shared by the two; each rank's model states are
/// ZeRO's. Then `--profile` over three steps against a stated 1 TFLOP/s:
/// a kernel's share of the peak is its GFLOP/s over 1,000, and the
/// kernels' shares and the time outside them make up the step.
#[test]
fn bench_prints_its_peaks_rates_and_shares_as_their_definitions_say() {
    let field = |row: &serde_json::Value, k: &str| {
        row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"))
    };
    let mut args = vec!["bench", "--json", "--steps", "1", "--warmup", "0"];
    args.extend(["--batch-size", "2", "--seq-len", "32", "--model", "tiny"]);
    args.extend(["--strategy", "ddp", "--world-size", "2"]);
    let row = json_of(&args);
    let flops = palm_flops(gpt2_params_met(&TINY), &TINY, 32.0);
    let tokens_per_s = field(&row, "tokens_per_s");
    close(
        tokens_per_s,
        2.0 * 32.0 / (field(&row, "ms_per_step") / 1e3),
        "tokens/s",
    );
    close(
        field(&row, "tokens_per_s_per_rank"),
        tokens_per_s / 2.0,
        "tokens/s a rank",
    );
    // each replica's model states: ZeRO's (4 + 4 + 8) Psi in fp32
    for rank in row["ranks"].as_array().unwrap() {
        let peak = &rank["peak_bytes"];
        let states = [4.0, 4.0, 8.0].map(|k| k * TINY_PARAMS);
        let got = ["params", "grads", "optimizer"].map(|k| field(peak, k));
        assert_eq!(got, states, "a ddp rank's peak model states");
    }
    let matmul = field(&row, "matmul_peak_gflops") * 1e9;
    close(
        field(&row, "mfu_matmul"),
        flops * tokens_per_s / matmul,
        "MFU against the matmul probe",
    );
    if cfg!(target_arch = "x86_64") {
        let hardware = field(&row, "hardware_peak_gflops") * 1e9;
        close(
            field(&row, "mfu_hardware"),
            flops * tokens_per_s / hardware,
            "MFU against the hardware",
        );
    }

    // three timed steps: the profile's step is its window over them
    let mut args = vec![
        "bench",
        "--json",
        "--steps",
        "3",
        "--warmup",
        "0",
        "--profile",
    ];
    args.extend(["--batch-size", "2", "--seq-len", "32", "--peak-tflops", "1"]);
    let row = json_of(&[&args[..], &["--model", "tiny"]].concat());
    let profile = &row["profile"];
    let kernels = profile["kernels"].as_array().expect("a profile");
    let mut shares = field(profile, "outside_share");
    let mut ms = field(profile, "outside_ms_per_step");
    for k in kernels {
        shares += field(k, "share");
        ms += field(k, "ms_per_step");
        if let Some(gflops) = k["gflops"].as_f64() {
            close(
                field(k, "of_peak"),
                gflops / 1000.0,
                "a kernel's share of the peak",
            );
        }
    }
    assert!((shares - 1.0).abs() < 1e-9, "the shares add up to {shares}");
    // the kernels and the time outside them make up a step of the window:
    // about the step the bench timed (the window adds its barriers and
    // batches), not the whole window
    let step = ms / field(&row, "ms_per_step");
    assert!(
        (0.5..2.0).contains(&step),
        "a profiled step is {step} timed steps"
    );
    for k in kernels {
        close(
            field(k, "share"),
            field(k, "ms_per_step") / ms,
            "a kernel's share",
        );
    }
    assert!(kernels.iter().any(|k| k["gflops"].is_number()));
}

/// A pipeline's measured bubble, against its definition over the spans
/// each rank ran (a forward and a backward a micro-batch: 2m spans): the
/// share of the stages' time between the first span's start and the last
/// one's end in which they ran none.
#[test]
fn a_pipelines_bubble_is_the_idle_share_of_the_ranks_spans() {
    let cfg: ModelConfig = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 32,
        vocab_size: 65,
        blocks: Vec::new(),
    }
    .into();
    let (b, t, m) = (4usize, 32usize, 4usize);
    let (w, _, _) = priced_on_h100(&cfg, b, t, m);
    let par = plan::layouts(&w, 2, false)
        .into_iter()
        .find(|p| p.pipeline.stages == 2 && p.pipeline.schedule == Schedule::OneFOneB)
        .expect("pp 2 1f1b");
    let ranks = launch::run_local(2, 1, Duration::from_secs(120), |comm| {
        // a step before the timed one: the stages end it apart
        let spec = BenchSpec {
            warmup: 1,
            ..one_step(b, t, m)
        };
        bench_rank(Cpu::new(), &cfg, par, spec, comm.as_ref())
    })
    .unwrap();
    // every rank's figures, as rank 0 gathered them
    let ranks = &ranks[0];
    let spans: Vec<_> = ranks.iter().flat_map(|r| r.timeline.iter()).collect();
    for r in ranks {
        assert_eq!(
            r.timeline.len(),
            2 * m,
            "a forward and a backward a micro-batch"
        );
    }
    // one clock for both stages: the second's forward of a micro-batch
    // starts after the first's has ended (each rank's clock began with its
    // own step, and a late one drew it before its input; 50 us of slack for
    // the barrier's exit)
    let forward = |r: usize, i: usize| {
        let of = |s: &&Span| s.pass == Pass::Forward && s.micro_batch == i;
        *ranks[r]
            .timeline
            .iter()
            .find(of)
            .expect("a forward a micro-batch")
    };
    for i in 0..m {
        let (a, b) = (forward(0, i), forward(1, i));
        assert!(
            b.start >= a.end - 50e-6,
            "micro-batch {i}: {a:?} then {b:?}"
        );
    }
    let start = spans.iter().map(|s| s.start).fold(f64::INFINITY, f64::min);
    let end = spans.iter().map(|s| s.end).fold(0.0, f64::max);
    let busy: f64 = spans.iter().map(|s| s.end - s.start).sum();
    let idle = 1.0 - busy / (2.0 * (end - start));
    for r in ranks {
        let bubble = r.bubble.expect("a pipeline's bubble");
        assert!(
            (bubble - idle).abs() < 1e-9 && bubble > 0.0 && bubble < 1.0,
            "bubble {bubble} printed, {idle} from the spans"
        );
    }
}

/// `plan`'s communication time over pp 2 x dp 2 (the volumes' 4-block
/// GPT-2, 1f1b, on one node of H100s: every ring on NVLink's 450 GB/s
/// with 5 us a hop), by the alpha-beta model of a ring (Patarasuk and
/// Yuan): an all-reduce over n ranks 2(n-1)/n of its bytes at the link's
/// bandwidth and 2(n-1) hops a call, a reduce-scatter or all-gather half
/// that. A replica's gradient all-reduce is one call; a sharded stage
/// reduces and gathers unit by unit, its 3 units of the model's 6 (4
/// blocks, the embeddings and the head), zero2's and fsdp's reduce-scatter
/// one call more a micro-batch for the tie. Each stage sends one
/// activation or gradient a micro-batch (1 hop), and the two stages
/// all-reduce the tied embeddings' gradient (their shard of it where
/// sharded). The busiest stage is priced.
#[test]
fn plan_times_a_pipelines_collectives_by_the_alpha_beta_ring() {
    let (cfg, (b, t, acc)) = four_block_gpt2();
    let (w, device, net) = priced_on_h100(&cfg, b, t, acc);
    let (bw, alpha, a) = (450e9, 5e-6, acc as f64);
    let c = 64.0;
    let embeddings = 4.0 * (128.0 + 32.0) * c;
    let block = 4.0 * (12.0 * c * c + 13.0 * c);
    let head = 4.0 * 2.0 * c;
    // over 2 ranks: an all-reduce sends its bytes once, 2 hops a call; a
    // reduce-scatter or all-gather half, 1 hop a call
    let all_reduce = |bytes: f64, calls: f64| bytes / bw + 2.0 * alpha * calls;
    let gather = |bytes: f64, calls: f64| bytes / 2.0 / bw + alpha * calls;
    let half_batch = (b / 2 * t) as f64 * c * 4.0;
    let mut checked = 0;
    for par in plan::layouts(&w, 4, false) {
        let r = par.resolved();
        let pipe = r.pipeline;
        if r.tp != 1 || pipe.stages != 2 || pipe.schedule != Schedule::OneFOneB {
            continue;
        }
        let sharded = r.strategy != StrategyKind::Ddp;
        let tie = if sharded {
            embeddings / 2.0
        } else {
            embeddings
        };
        let stage = embeddings + 2.0 * block;
        // (the stage's bytes, the elements fsdp gathers: see the volumes' test)
        let ranks = [
            (stage, 4.0 * embeddings),
            (stage + head, embeddings + 2.0 * head),
        ];
        let want = ranks
            .map(|(q, gathered)| {
                let dp = match r.strategy {
                    StrategyKind::Ddp => all_reduce(q, 1.0),
                    StrategyKind::Zero1 => gather(q, 3.0) + gather(q, 3.0),
                    StrategyKind::Zero2 => a * gather(q, 4.0) + gather(q, 3.0),
                    StrategyKind::Fsdp => {
                        gather(gathered + 7.0 * block, 2.0 * 3.0 * a) + a * gather(q, 4.0)
                    }
                    s => panic!("{s}"),
                };
                dp + a * (half_batch / bw + alpha) + all_reduce(tie, 1.0)
            })
            .into_iter()
            .fold(0.0, f64::max);
        let got = plan::predict(&w, par, &device, &net, Precision::Fp32);
        close(got.time.comm_s, want, &par.layout_name());
        checked += 1;
    }
    assert_eq!(checked, 4, "ddp, zero1, zero2 and fsdp");
}

/// The predictions of `plan --json --all` for `args`, with the parallel
/// configuration each is of.
fn predictions(args: &[&str]) -> Vec<serde_json::Value> {
    let mut all = vec!["plan", "--json", "--all"];
    all.extend(args);
    let j = json_of(&all);
    let plans = j["plans"].as_array().unwrap();
    plans
        .iter()
        .flat_map(|p| p["predictions"].as_array().unwrap().clone())
        .collect()
}

/// Under tp x pp each stage's rank makes its own blocks' all-reduces. GPT-2
/// small over 4 stages is cut 3 | 4 | 4 | 1 + the head (a block is
/// 7,087,872 parameters and the head with its tied embedding 38,635,008,
/// about 5.45 blocks, so the last stage takes one block): a middle stage's
/// rank sends 4 micro-batches' streams both ways and makes 4 blocks x 4
/// all-reduces of each, at tp 2 a ring sends one stream an all-reduce.
#[test]
fn plan_prices_each_stages_tensor_parallel_all_reduces_by_its_blocks() {
    let preds = predictions(&[
        "--model",
        "gpt2",
        "--device",
        "h100",
        "--world-size",
        "8",
        "--batch-size",
        "8",
        "--grad-accum",
        "4",
        "--precision",
        "fp32",
    ]);
    let stream = 8.0 * 1024.0 * 768.0 * 4.0;
    let (acc, blocks) = (4.0, 4.0);
    let want = acc * 2.0 * stream + acc * blocks * 4.0 * stream;
    let mut checked = 0;
    for pred in &preds {
        let par = &pred["parallel"];
        let pipe = &par["pipeline"];
        if par["tp"] != 2 || pipe["stages"] != 4 || par["recompute"] == true {
            continue;
        }
        if pipe["schedule"] != "1f1b" {
            continue;
        }
        close(
            pred["time"]["comm_bytes"].as_f64().unwrap(),
            want,
            &format!("{par}"),
        );
        checked += 1;
    }
    assert!(checked >= 1, "no tp 2 pp 4 1f1b layout in {preds:?}");
}

/// zb-h1 with one micro-batch over 4 stages runs the forward through the
/// stages, the input halves back and the first stage's weight half: 9 slots
/// of work 3 a stage, where 1f1b's takes 12 (4 forwards, 4 backwards of
/// 2): its compute is 9/12 of 1f1b's (the m >= p formula said 6/12).
#[test]
fn plan_prices_zb_h1_with_fewer_micro_batches_than_stages_by_its_slots() {
    let preds = predictions(&[
        "--model",
        "gpt2",
        "--device",
        "h100",
        "--world-size",
        "4",
        "--batch-size",
        "8",
    ]);
    let compute = |schedule: &str| {
        let pred = preds
            .iter()
            .find(|p| {
                let par = &p["parallel"];
                par["pipeline"]["stages"] == 4
                    && par["pipeline"]["schedule"] == schedule
                    && par["recompute"] == false
                    && par["offload"].is_null()
            })
            .unwrap_or_else(|| panic!("no pp x4 {schedule} in {preds:?}"));
        pred["time"]["compute_s"].as_f64().unwrap()
    };
    close(
        compute("zb-h1") / compute("1f1b"),
        9.0 / 12.0,
        "zb-h1 / 1f1b compute at m = 1",
    );
}

/// A pipeline's step lasts as long as its busiest rank makes it: GPT-2
/// small over 4 stages is cut 3 | 4 | 4 | 1 + the head (the head, with the
/// tied embedding it reads, outweighs five blocks), so under 1f1b the
/// first micro-batch crosses every stage and each of the 7 more adds the
/// last rank's block and head, not a mean stage's quarter of the model:
/// (12 b + h + 7 (b + h)) / (8 (12 b + h)) of a single rank's compute,
/// with b and h a block's and the head's FLOPs a token by PaLM's count.
#[test]
fn plan_prices_a_pipeline_by_its_busiest_rank() {
    let args = [
        "--model",
        "gpt2",
        "--device",
        "h100",
        "--world-size",
        "1,4",
        "--batch-size",
        "8",
        "--grad-accum",
        "8",
        "--precision",
        "fp32",
    ];
    let (preds, again) = (
        predictions(&args),
        predictions(&[&args[..], &["--recompute"]].concat()),
    );
    let compute = |stages: u64, recompute: bool| {
        let preds = if recompute { &again } else { &preds };
        let pred = preds
            .iter()
            .find(|p| {
                let par = &p["parallel"];
                par["pipeline"]["stages"] == stages
                    && par["pipeline"]["schedule"] == "1f1b"
                    && par["tp"] == 1
                    && par["recompute"] == recompute
                    && par["offload"].is_null()
            })
            .unwrap_or_else(|| panic!("no 1f1b over {stages} stages in {preds:?}"));
        pred["time"]["compute_s"].as_f64().unwrap()
    };
    let (c, t, rows) = (768.0, 1024.0, 50_304.0);
    let b = 6.0 * (12.0 * c * c + 13.0 * c) + 12.0 * t * c;
    let h = 6.0 * (2.0 * c + rows * c);
    let within = |got: f64, want: f64, what: &str| {
        // (plan counts the final norm's 12 C FLOPs a token, 2e-5 of the
        // head's, with the blocks)
        let off = (got / want - 1.0).abs();
        assert!(off < 1e-4, "{what}: {got} printed, {want} by hand");
    };
    let want = (12.0 * b + h + 7.0 * (b + h)) / (8.0 * (12.0 * b + h));
    within(
        compute(4, false) / compute(1, false),
        want,
        "pp x4 1f1b over single",
    );
    // --recompute runs each block's forward again (a third of its
    // training), and the head's for every chunk of logits but the kept
    // last: 2^26 floats are 1,334 rows of 50,304, so 8,192 rows are 7
    // chunks and 6 are recomputed
    let want = (4.0 / 3.0 * 12.0 * b + h * (1.0 + 6.0 / 7.0 / 3.0)) / (12.0 * b + h);
    within(
        compute(1, true) / compute(1, false),
        want,
        "single +recompute over single",
    );
}

/// `compare`'s communication a step is a training step's (the ZeRO-3
/// volumes of `metrics_record_the_zero_papers_model_states_and_the_rings_volumes`
/// for fsdp x2 on `tiny`: the gradient's reduce-scatter with the tied
/// embeddings' second, the embeddings, each block twice and ln_f
/// gathered), not the end-of-run evaluation's and the model file's
/// gathers spread over the steps.
#[test]
fn compare_counts_the_collectives_of_training_steps_alone() {
    let out = common::scratch("compare-comm");
    let args = [
        "compare",
        "--models",
        "tiny",
        "--strategies",
        "fsdp",
        "--world-sizes",
        "2",
        "--batch-sizes",
        "4",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--eval-batches",
        "2",
        "--no-predict",
        "--out",
        out.to_str().unwrap(),
    ];
    stdout_of(&args);
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    let column = header.iter().position(|h| *h == "comm_bytes_per_step");
    let got: f64 = row[column.unwrap()].parse().unwrap();
    let c = 32.0;
    let embeddings = 4.0 * (128.0 + 64.0) * c;
    let block = 4.0 * (12.0 * c * c + 13.0 * c);
    let ln_f = 4.0 * 2.0 * c;
    let ring = 0.5;
    let want = ring * (4.0 * TINY_PARAMS + embeddings) + ring * (embeddings + 4.0 * block + ln_f);
    assert!(
        (want..=want + 256.0).contains(&got),
        "{got} bytes a step, {want} by hand:\n{csv}"
    );
}
