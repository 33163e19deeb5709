//! Command-line manners: output that ends with a newline, no empty frames,
//! checkpoints read like models, errors said once and in words, log lines
//! and a CSV when there is no terminal.

#[path = "support/bert.rs"]
mod bert;

#[path = "support/cli.rs"]
mod cli;

#[path = "support/profile.rs"]
mod profile;

use bert::tiny_bert_and_labelled_set;
use cli::{distgpt, scratch, succeeded};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// An absent run directory for this test.
fn run_dir(tag: &str) -> PathBuf {
    scratch(&format!("cli-{tag}"))
}

/// `distgpt train` of the tiny model on 4 x 16 tokens into `out`, with
/// extra flags, which must succeed.
fn train_tiny(out: &str, extra: &[&str]) -> Output {
    succeeded(train_tiny_output(out, extra))
}

/// [`train_tiny`]'s command, succeeding or not.
fn train_tiny_output(out: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--peak-tflops",
        "0.1",
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    distgpt(&args)
}

#[test]
fn generate_ends_its_output_with_a_newline_and_no_sample_means_no_frame() {
    let dir = run_dir("newline");
    let out = dir.to_str().unwrap();
    let train = train_tiny(out, &["--steps", "2", "--quiet", "--sample-tokens", "0"]);
    let text = String::from_utf8_lossy(&train.stdout);
    assert!(!text.contains("--- sample ---"), "{text}");

    let gen = succeeded(distgpt(&[
        "generate", out, "--tokens", "5", "--prompt", "A",
    ]));
    let text = String::from_utf8_lossy(&gen.stdout);
    assert!(text.starts_with('A') && text.ends_with('\n'), "{text:?}");
    // the report times the first token apart from the rest
    let said = String::from_utf8_lossy(&gen.stderr);
    assert!(
        said.contains("[5 tokens in ") && said.contains(", the first after "),
        "{said}"
    );
}

/// `generate`'s rate after the first token counts the tokens decoded after
/// the first step: four prompts of one token each make theirs in one step,
/// which left three tokens "then" at a rate (of no decoding at all).
#[test]
fn generate_rates_the_tokens_after_its_first_step() {
    let dir = run_dir("rate-after-first");
    let out = dir.to_str().unwrap();
    train_tiny(out, &["--steps", "1", "--quiet", "--sample-tokens", "0"]);
    let four = [
        "--prompt", "a", "--prompt", "b", "--prompt", "c", "--prompt", "d",
    ];
    for (tokens, rated) in [("1", false), ("2", true)] {
        let args = [&["generate", out, "--tokens", tokens][..], &four].concat();
        let said = String::from_utf8_lossy(&succeeded(distgpt(&args)).stderr).to_string();
        assert_eq!(
            said.contains("tokens/s"),
            rated,
            "--tokens {tokens}: {said}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--seed` takes any u64: a sample drawn mid-run at the largest seed (the
/// run's seed plus the step, which overflowed: a panic in a debug build).
#[test]
fn the_largest_seed_samples_mid_run() {
    let dir = run_dir("largest-seed");
    let out = dir.to_str().unwrap();
    let seed = u64::MAX.to_string();
    let sampled = [
        "--steps",
        "3",
        "--sample-every",
        "1",
        "--sample-tokens",
        "2",
    ];
    let said = train_tiny(out, &[&sampled[..], &["--seed", &seed]].concat());
    let text = String::from_utf8_lossy(&said.stderr);
    assert!(text.contains("--- sample at step 1 ---"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench --profile` counts each kernel of the step as the model runs it,
/// with the model's FLOPs, its times adding up to the step: a rank in two
/// parts side by side, two thread ranks of ddp, and a pipeline.
#[test]
fn bench_profile_counts_the_models_kernels_and_flops() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_distgpt"));
    for (extra, pp) in [
        (vec![], 1.0),
        (vec!["--strategy", "ddp", "--world-size", "2"], 1.0),
        (
            vec![
                "--strategy",
                "ddp",
                "--pp",
                "2",
                "--world-size",
                "2",
                "--grad-accum",
                "2",
            ],
            2.0,
        ),
    ] {
        let row = profile::profiled_tiny_bench(&bin, &extra);
        if extra.is_empty() {
            assert_eq!(row["parts"].as_u64(), Some(2), "{row}");
        }
        profile::assert_profile_counts_tiny(&row, pp, 1.0, &format!("{extra:?}"));
    }
    let gen = distgpt(&["bench", "--model", "tiny", "--generate", "2", "--profile"]);
    let err = String::from_utf8_lossy(&gen.stderr);
    assert!(
        !gen.status.success() && err.contains("--profile times the kernels of training steps"),
        "{err}"
    );
    let out = succeeded(distgpt(&[
        "bench",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--profile",
    ]));
    // a first line before the work, on stderr (--json's stdout is its row)
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.starts_with("bench: tiny ") && said.contains("1 timed steps"),
        "{said}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("kernels (--profile)")
            && text.contains("matmul_backward")
            && text.contains("outside kernels")
            && text.lines().all(|l| l == l.trim_end()),
        "{text}"
    );
}

/// `bench --generate` with `--prompt-tokens`: the prompts go in before the
/// first new token, which is timed apart; a prompt and its new tokens must
/// fit the block, and the flag needs `--generate`.
#[test]
fn bench_generate_times_the_first_token_after_its_prompts() {
    let bench = succeeded(distgpt(&[
        "bench",
        "--model",
        "tiny",
        "--generate",
        "4",
        "--prompt-tokens",
        "40",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--json",
    ]));
    let row: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    assert_eq!(row["prompt_tokens"].as_u64(), Some(40), "{row}");
    assert_eq!(row["new_tokens"].as_u64(), Some(4), "{row}");
    let (first, all) = (row["first_token_seconds"].as_f64(), row["seconds"].as_f64());
    assert!(
        first.zip(all).is_some_and(|(f, a)| f > 0.0 && f <= a),
        "{row}"
    );
    // tokens a second by their definition: every row's new tokens, 2 rows
    // of 4 asked on the command line, over the run's seconds
    let rate = row["tokens_per_s"].as_f64().unwrap();
    let by_hand = (2 * 4) as f64 / all.unwrap();
    assert!(
        (rate - by_hand).abs() <= 1e-9 * by_hand,
        "tokens/s: {rate} printed, {by_hand} by hand (2 x 4 tokens in {} s)",
        all.unwrap()
    );
    for (args, said) in [
        (
            vec!["--generate", "30", "--prompt-tokens", "40"],
            "--generate 30: a 40-token prompt leaves room for 1 to 25",
        ),
        (
            vec!["--generate", "3", "--prompt-tokens", "0"],
            "--prompt-tokens 0",
        ),
        (vec!["--prompt-tokens", "5"], "give --generate N with it"),
    ] {
        let out = distgpt(&[&["bench", "--model", "tiny"], args.as_slice()].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(said),
            "{args:?}: {err}"
        );
    }
    // a family with no decoder is asked, and says so
    let out = distgpt(&["bench", "--model", "bert-tiny", "--generate", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("bench --generate runs a causal language model's KV-cache decoder: BERT models have none"),
        "{err}"
    );
}

#[test]
fn generate_and_eval_read_a_checkpoint_directory() {
    let dir = run_dir("ckpt");
    let out = dir.to_str().unwrap();
    train_tiny(out, &["--steps", "3", "--quiet", "--checkpoint-every", "1"]);
    let step2 = dir.join("checkpoints/step_00000002");
    let step2 = step2.to_str().unwrap();
    succeeded(distgpt(&[
        "generate", step2, "--tokens", "4", "--prompt", "A",
    ]));
    let eval = succeeded(distgpt(&[
        "eval",
        step2,
        "--batches",
        "2",
        "--seq-len",
        "16",
    ]));
    // without a terminal, a line before the work says what it is
    let said = String::from_utf8_lossy(&eval.stderr);
    assert!(
        said.starts_with("eval: 2 batches of 8 x 16 tokens from "),
        "{said}"
    );
    // Weights without their model.json are a damaged model, not a run
    // without model files: refused by the missing file's name, never read
    // past to a checkpoint.
    std::fs::remove_file(dir.join("model.json")).unwrap();
    let half = distgpt(&["eval", out, "--batches", "2", "--seq-len", "16"]);
    let said = String::from_utf8_lossy(&half.stderr);
    assert!(
        !half.status.success()
            && said.contains("model.safetensors but no model.json")
            && said.contains("train --resume"),
        "{said}"
    );
    // a Hugging Face export cut short holds no checkpoint to resume from
    let export = dir.join("export");
    let export_s = export.to_str().unwrap();
    succeeded(distgpt(&["export", step2, "--out", export_s]));
    std::fs::remove_file(export.join("config.json")).unwrap();
    let half = distgpt(&["eval", export_s, "--batches", "2", "--seq-len", "16"]);
    let said = String::from_utf8_lossy(&half.stderr);
    assert!(
        !half.status.success()
            && said
                .contains("model.safetensors but no model.json (nor a Hugging Face config.json)")
            && said.contains("writes them again, with --overwrite")
            && !said.contains("resume"),
        "{said}"
    );
    // A run without model files (still training, or stopped by SIGKILL): its newest checkpoint.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    succeeded(distgpt(&["eval", out, "--batches", "2", "--seq-len", "16"]));
}

#[test]
fn errors_say_it_once_and_in_words() {
    // a missing run is named as such, once, by every command given one
    // (not as the OS's error about a file inside it)
    for args in [
        &["eval", "/nonexistent-distgpt-run"][..],
        &["generate", "/nonexistent-distgpt-run"],
        &["train", "--resume", "/nonexistent-distgpt-run"],
    ] {
        let missing = distgpt(args);
        let err = String::from_utf8_lossy(&missing.stderr);
        let says = "/nonexistent-distgpt-run: no such directory: give a run directory";
        assert_eq!(err.matches(says).count(), 1, "{args:?}: {err}");
        assert!(!err.contains("model.json"), "{err}");
    }

    // a checkpoint named as it is not is told the names its run has
    let run = run_dir("missing-checkpoint");
    train_tiny(
        run.to_str().unwrap(),
        &["--steps", "4", "--checkpoint-every", "2"],
    );
    let wrong = run.join("checkpoints/step_2");
    let err = distgpt(&["eval", wrong.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&err.stderr);
    assert!(
        err.contains("step_2: no such checkpoint (")
            && err.contains("checkpoints holds step_00000002, step_00000004)"),
        "{err}"
    );

    let empty = cli::scratch("empty.txt");
    std::fs::write(&empty, "\n").unwrap();
    let run = distgpt(&["train", "--data", empty.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && err.contains("is empty"), "{err}");
}

#[test]
fn without_a_terminal_a_log_line_at_the_first_step_then_every_n_and_a_csv() {
    let dir = run_dir("log");
    let train = train_tiny(
        dir.to_str().unwrap(),
        &["--steps", "12", "--log-every", "5", "--eval-every", "0"],
    );
    let err = String::from_utf8_lossy(&train.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("ETA")).collect();
    assert_eq!(lines.len(), 3, "{err}");
    for (line, step) in lines.iter().zip(["1", "5", "10"]) {
        assert!(
            line.starts_with(&format!("step {step:>5}/12: loss ")) && line.contains("tokens/s"),
            "{err}"
        );
    }
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 13, "{csv}");
    assert!(
        csv.starts_with("step,epoch,loss,val_loss,grad_norm,lr"),
        "{csv}"
    );
}

/// Where nothing fits, the advice names only what the command line has
/// not tried already; where no layout can run at all, it says why.
#[test]
fn plan_suggests_recompute_only_without_it() {
    let line = "plan --model gpt2 --device h100 --world-size 1 --memory-gb 1";
    let args: Vec<&str> = line.split(' ').collect();
    let advice = |extra: &[&str]| {
        let out = succeeded(distgpt(&[args.as_slice(), extra].concat()));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let at = text.find("nothing fits in 1 GB").expect(&text);
        text[at..].lines().next().unwrap().to_string()
    };
    assert_eq!(
        advice(&[]),
        "nothing fits in 1 GB, even with offload: try more ranks, --recompute or a smaller batch"
    );
    assert_eq!(
        advice(&["--recompute"]),
        "nothing fits in 1 GB, even with offload: try more ranks or a smaller batch"
    );
    // no layout at all (3 ranks cannot share a batch of 1): not a memory matter
    let line = "plan --model tiny --device h100 --world-size 3 --batch-size 1";
    let out = succeeded(distgpt(&line.split(' ').collect::<Vec<_>>()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(
            "world 3: 0 layouts priced at 40% of the peak: no layout fits the batch of 1 \
             (it must divide by the data-parallel size)"
        ),
        "{text}"
    );
}

#[test]
fn plan_says_why_tp_rows_are_missing_and_what_network_it_assumes() {
    let out = succeeded(distgpt(&[
        "plan",
        "--device",
        "h100",
        "--model",
        "tiny",
        "--n-head",
        "5",
        "--n-embd",
        "80",
        "--world-size",
        "1,2",
        "--all",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("note: tp x2 omitted: 5 heads are not divisible by 2"),
        "{text}"
    );
    // each row's memory adds up to its total (zero1's shard copies were
    // in the total and in no column)
    let mut rows = 0;
    for line in text
        .lines()
        .filter(|l| l.starts_with("zero") || l.starts_with("ddp"))
    {
        let v: Vec<f64> = line
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        // params grads optim states activ other total
        let (parts, total) = (v[0] + v[1] + v[2] + v[4] + v[5], v[6]);
        assert!((parts - total).abs() <= 0.003, "{line}\n{text}");
        rows += 1;
    }
    assert!(rows >= 3, "{text}");
    // without --all, the kind of reason and where to find the rest
    let line = "plan --device h100 --model tiny --n-head 5 --n-embd 80 --world-size 2";
    let out = succeeded(distgpt(&line.split(' ').collect::<Vec<_>>()));
    let brief = String::from_utf8_lossy(&out.stdout);
    assert!(
        brief.contains("layouts left out (tp does not divide the heads; ")
            && brief.contains("); --all lists every layout and why"),
        "{brief}"
    );
    assert!(
        text.contains("network: 8 ranks per node; within a node 450.0 GB/s per rank + 5.0 us"),
        "{text}"
    );
    assert!(
        text.contains("activations: 4 bytes an element, a set for each micro-batch a stage holds")
            && text.contains("every block's kept for the backward"),
        "{text}"
    );
    // a preset's latencies give way to the flags, as its bandwidths do
    let line =
        "plan --device h100 --model tiny --world-size 2 --intra-latency-us 7 --inter-latency-us 30";
    let out = succeeded(distgpt(&line.split(' ').collect::<Vec<_>>()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("450.0 GB/s per rank + 7.0 us"), "{text}");
    assert!(text.contains(" + 30.0 us"), "{text}");
}

#[test]
fn plan_answers_a_trillion_parameters_on_131072_ranks_by_family_and_draws_them() {
    let dir = run_dir("plan-1t");
    let dir_s = dir.to_str().unwrap();
    // 128 blocks of 25,600 (160 heads): 1.008 trillion parameters, refused
    // before as more than 2^36; 131,072 ranks, refused past 4,096
    let line = "plan --model gpt2 --device b200 --precision mixed --n-layer 128 --n-embd 25600 \
                --n-head 160 --block-size 2048 --vocab-size 51200 --world-size 1024,131072 \
                --batch-size 4096 --grad-accum 8 --recompute --plot";
    let mut args: Vec<&str> = line.split_whitespace().collect();
    args.push(dir_s);
    let out = succeeded(distgpt(&args));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("(1.008T params, 128 layers x 25600 wide)"),
        "{text}"
    );
    assert!(
        text.contains("on B200 (2250 TFLOP/s peak, 180 GB)"),
        "{text}"
    );
    for world in [1024, 131072] {
        let at = text
            .find(&format!("world {world}: "))
            .expect("each world answered");
        let block: Vec<&str> = text[at..].lines().take_while(|l| !l.is_empty()).collect();
        // a person's answer: the recommendation first, then at most one
        // row a family (and its header), then what was left out
        assert!(block[0].contains("; recommended: "), "{text}");
        assert!(
            block.len() <= 8,
            "{} lines for world {world}:\n{text}",
            block.len()
        );
        let rows = &block[2..];
        assert_eq!(
            rows.iter().filter(|r| r.ends_with("recommended")).count(),
            1,
            "{text}"
        );
        // a family with no valid layout has no row (pure data parallelism
        // over 131,072 ranks: the batch of 4,096 does not divide)
        let families = [
            "ddp / zero / fsdp",
            "+ tensor parallel",
            "+ pipeline",
            "+ tp + pipeline",
            "+ offload",
        ];
        let family_rows = rows
            .iter()
            .filter(|r| families.iter().any(|f| r.trim_start().starts_with(f)));
        assert!(family_rows.count() >= 4, "{text}");
        // every other family says what loses it the recommendation
        for r in rows
            .iter()
            .filter(|r| r.starts_with("  ") && !r.ends_with("recommended"))
        {
            if r.contains("left out") {
                continue;
            }
            assert!(
                r.contains("slower: ") || r.contains("does not fit in 180 GB"),
                "{r}"
            );
        }
        for ext in ["png", "svg"] {
            let figure = dir.join(format!("plan-world-{world}.{ext}"));
            assert!(
                figure.metadata().map(|m| m.len() > 1000).unwrap_or(false),
                "{}",
                figure.display()
            );
        }
    }
    // --all lists every layout: far more rows
    let mut all = args.clone();
    all.truncate(all.len() - 2);
    all.push("--all");
    let every = succeeded(distgpt(&all));
    let every = String::from_utf8_lossy(&every.stdout);
    assert!(every.lines().count() > 10 * text.lines().count(), "{every}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_prices_a_device_at_the_efficiency_a_run_measured() {
    let out = run_dir("plan-efficiency");
    let out_s = out.to_str().unwrap();
    train_tiny(out_s, &["--steps", "5", "--log-every", "1"]);
    // the median of steps 2 to 5's MFU, the first being warm-up
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut mfu: Vec<f64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["mfu"]
                .as_f64()
                .unwrap()
        })
        .skip(1)
        .collect();
    assert_eq!(mfu.len(), 4);
    mfu.sort_by(f64::total_cmp);
    let median = (mfu[1] + mfu[2]) / 2.0;
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "tiny",
            "--device",
            "h200",
            "--world-size",
            "2",
        ];
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let o = succeeded(plan(&["--efficiency-from", out_s, "--json"]));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let eff = j["plans"][0]["efficiency"].as_f64().unwrap();
    assert!(
        (eff - median).abs() <= 1e-12 * median,
        "{eff} vs the run's median {median}"
    );
    assert_eq!(j["device"]["efficiency"].as_f64().unwrap(), eff);
    // and says which efficiency it used, and where it came from
    let o = succeeded(plan(&["--efficiency-from", out_s]));
    let said = String::from_utf8_lossy(&o.stdout);
    let line = format!(
        "efficiency: {:.1}% of the peak, the median MFU of 4 steps of {out_s} (trained on cpu",
        100.0 * eff
    );
    assert!(said.contains(&line), "{line}\n{said}");
    let o = succeeded(plan(&[]));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("efficiency: 40.0% of the peak, assumed (--efficiency-from RUN"),
        "{said}"
    );
    // the steps priced at it: the compute time scales as 1 / efficiency
    let fixed = succeeded(plan(&["--efficiency", "0.4", "--json"]));
    let k: serde_json::Value = serde_json::from_slice(&fixed.stdout).unwrap();
    let compute = |v: &serde_json::Value| {
        v["plans"][0]["predictions"][0]["time"]["compute_s"]
            .as_f64()
            .unwrap()
    };
    let ratio = compute(&j) / compute(&k);
    assert!(
        (ratio - 0.4 / eff).abs() <= 1e-9 * ratio,
        "{ratio} vs {}",
        0.4 / eff
    );
    // a run with one logged step has no step past the warm-up; a folder
    // that is no run, and both efficiencies at once, are refused
    let short = run_dir("plan-efficiency-short");
    let short_s = short.to_str().unwrap();
    train_tiny(short_s, &["--steps", "1"]);
    for (extra, says) in [
        (
            vec!["--efficiency-from", short_s],
            "logs 1 step: an efficiency needs two or more",
        ),
        (
            vec!["--efficiency-from", "/nonexistent-run"],
            "/nonexistent-run",
        ),
        (
            vec!["--efficiency-from", out_s, "--efficiency", "0.5"],
            "cannot be used with",
        ),
    ] {
        let o = plan(&extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(says),
            "{extra:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&short);
}

#[test]
fn plot_draws_the_curves_of_one_or_several_runs() {
    let a = run_dir("plot-a");
    let b = run_dir("plot-b");
    for dir in [&a, &b] {
        train_tiny(
            dir.to_str().unwrap(),
            &["--steps", "4", "--quiet", "--eval-every", "2"],
        );
    }
    succeeded(distgpt(&["plot", a.to_str().unwrap()]));
    let both = run_dir("plot-both");
    succeeded(distgpt(&[
        "plot",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--out",
        both.to_str().unwrap(),
    ]));
    for out in [a.join("plots"), both.clone()] {
        for stem in ["loss", "val_loss", "grad_norm", "throughput"] {
            for ext in ["png", "svg"] {
                let f = out.join(format!("{stem}.{ext}"));
                let len = std::fs::metadata(&f).map_or(0, |m| m.len());
                assert!(len > 1000, "{} missing or empty", f.display());
            }
        }
    }
    let svg = std::fs::read_to_string(both.join("loss.svg")).unwrap();
    // a long name wraps in the legend, at its dashes
    for name in [&a, &b] {
        let name = name.file_name().unwrap().to_str().unwrap();
        for part in name.split('-') {
            assert!(svg.contains(part), "the legend names {name}");
        }
    }
    let none = distgpt(&["plot", both.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(
        !none.status.success() && err.contains("has no metrics.jsonl"),
        "{err}"
    );
    // one run's own RUN/plots is redrawn; several runs' default ./plots is
    // claimed as --out is (a second comparison replaced the first's
    // figures without a word)
    succeeded(distgpt(&["plot", a.to_str().unwrap()]));
    let cwd = run_dir("plot-cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let in_cwd = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .current_dir(&cwd)
            .args(["plot", a.to_str().unwrap(), b.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    succeeded(in_cwd(&[]));
    assert!(cwd.join("plots/loss.png").is_file());
    let again = in_cwd(&[]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success()
            && err.contains("plots already holds")
            && err.contains("--overwrite"),
        "{err}"
    );
    succeeded(in_cwd(&["--overwrite"]));
}

#[test]
fn a_config_file_sets_flags_the_command_line_overrides_and_run_json_repeats_a_run() {
    let a = run_dir("config-a");
    let b = run_dir("config-b");
    let toml = a.with_extension("toml");
    std::fs::write(
        &toml,
        "model = \"tiny\"\n[data]\nbatch-size = 4\nseq-len = 16\n\
         [optimisation]\nsteps = 50\nlr = 0.002\nseed = 7\n\
         [output]\npeak-tflops = 0.1\nquiet = true\neval-batches = 2\n",
    )
    .unwrap();
    let config = toml.to_str().unwrap();
    succeeded(distgpt(&[
        "train",
        "--config",
        config,
        "--steps",
        "3",
        "--out",
        a.to_str().unwrap(),
    ]));
    let record = |dir: &PathBuf| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.join("run.json")).unwrap();
        let mut r: serde_json::Value = serde_json::from_str(&text).unwrap();
        r["train"]["out_dir"] = serde_json::Value::Null;
        r["segments"] = serde_json::Value::Null;
        r
    };
    let ra = record(&a);
    assert_eq!(ra["train"]["duration"], serde_json::json!({"steps": 3}));
    assert_eq!(ra["train"]["batch_size"], 4);
    assert_eq!(ra["train"]["seed"], 7);
    assert_eq!(ra["model"]["n_layer"], 2, "the tiny preset");

    let replay = a.join("run.json");
    succeeded(distgpt(&[
        "train",
        "--config",
        replay.to_str().unwrap(),
        "--out",
        b.to_str().unwrap(),
    ]));
    assert_eq!(ra, record(&b), "run.json repeats the run's settings");
    let losses = |dir: &PathBuf| -> Vec<f64> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(losses(&a), losses(&b), "and its losses");
    // a run stopped and resumed as it was repeats from run.json; one
    // resumed with another --lr is refused with the step it changed at
    // `replay`'s run stopped after 2 steps and resumed with `resume` flags
    let stopped_and_resumed = |tag: &str, resume: &[&str]| -> PathBuf {
        let dir = run_dir(tag);
        let out = dir.to_str().unwrap();
        let stop = distgpt(&[
            "train",
            "--config",
            replay.to_str().unwrap(),
            "--out",
            out,
            "--stop-after",
            "2",
        ]);
        assert_eq!(stop.status.code(), Some(75));
        let mut args = vec!["train", "--resume", out, "--quiet"];
        args.extend_from_slice(resume);
        succeeded(distgpt(&args));
        dir
    };
    let c = stopped_and_resumed("config-c", &[]);
    let d = run_dir("config-d");
    succeeded(distgpt(&[
        "train",
        "--config",
        c.join("run.json").to_str().unwrap(),
        "--out",
        d.to_str().unwrap(),
    ]));
    assert_eq!(losses(&a), losses(&d), "a run resumed unchanged repeats");
    let e = stopped_and_resumed("config-e", &["--lr", "1e-2"]);
    let refused = distgpt(&["train", "--config", e.join("run.json").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("resumed at step 2 with other settings"),
        "{err}"
    );
    // so is one resumed in bf16: its first steps' matmuls were fp32
    let f = run_dir("config-f");
    let stop = distgpt(&[
        "train",
        "--config",
        replay.to_str().unwrap(),
        "--out",
        f.to_str().unwrap(),
        "--stop-after",
        "2",
    ]);
    assert_eq!(stop.status.code(), Some(75));
    let resumed = distgpt(&[
        "train",
        "--resume",
        f.to_str().unwrap(),
        "--quiet",
        "--precision",
        "bf16",
    ]);
    let note = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        resumed.status.success()
            && note
                .contains("steps 1-2 trained with --precision fp32, the steps from here with bf16"),
        "{note}"
    );
    let refused = distgpt(&["train", "--config", f.join("run.json").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success()
            && err.contains("resumed at step 2 with other settings")
            && err.contains("--precision bf16 after fp32"),
        "{err}"
    );
    // a bf16 run resumed without --precision stays bf16, without a note,
    // and run.json repeats it
    let g = run_dir("config-g");
    let stop = distgpt(&[
        "train",
        "--config",
        replay.to_str().unwrap(),
        "--out",
        g.to_str().unwrap(),
        "--precision",
        "bf16",
        "--stop-after",
        "2",
    ]);
    assert_eq!(stop.status.code(), Some(75));
    let resumed = distgpt(&["train", "--resume", g.to_str().unwrap(), "--quiet"]);
    let note = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        resumed.status.success() && !note.contains("--precision"),
        "{note}"
    );
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(g.join("run.json")).unwrap()).unwrap();
    let precisions: Vec<&serde_json::Value> = record["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| &s["parallel"]["precision"])
        .collect();
    assert_eq!(precisions, [&serde_json::json!("bf16"); 2]);
    assert_eq!(
        record["segments"][0]["settings"],
        record["segments"][1]["settings"]
    );

    std::fs::write(&toml, "steps = 2\nbatch-size = \"four\"\n").unwrap();
    let bad = distgpt(&["train", "--config", config]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("'four'") && err.contains(config),
        "{err}"
    );
}

#[test]
fn quantize_writes_an_int8_model_that_decodes_as_the_original_does_in_int8() {
    let run = run_dir("quantize-run");
    let q = run_dir("quantize-out");
    train_tiny(run.to_str().unwrap(), &["--steps", "3", "--quiet"]);
    succeeded(distgpt(&[
        "quantize",
        run.to_str().unwrap(),
        "--out",
        q.to_str().unwrap(),
    ]));
    let size = |d: &PathBuf| {
        std::fs::metadata(d.join("model.safetensors"))
            .unwrap()
            .len()
    };
    assert!(
        size(&q) * 2 < size(&run),
        "{} vs {} bytes",
        size(&q),
        size(&run)
    );
    let eval = |d: &PathBuf, weights: &str| {
        let out = succeeded(distgpt(&[
            "eval",
            d.to_str().unwrap(),
            "--weights",
            weights,
            "--batches",
            "2",
            "--seq-len",
            "16",
        ]));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        // "...: val loss X with int8 weights, ..."
        text.split("val loss ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string()
    };
    assert_eq!(eval(&q, "int8"), eval(&run, "int8"), "the same int8 codes");
    let gen = |d: &PathBuf| {
        let out = succeeded(distgpt(&[
            "generate",
            d.to_str().unwrap(),
            "--weights",
            "int8",
            "--temperature",
            "0",
            "--tokens",
            "20",
            "--prompt",
            "A",
        ]));
        out.stdout
    };
    assert_eq!(gen(&q), gen(&run));
    // The folder also loads as fp32 (dequantized) for eval and export.
    eval(&q, "f32");
}

/// distgpt trains without dropout: a folder asking for it (all-MiniLM-L6-v2
/// asks 0.1) is told so, and the classifier written says 0 (it said 0.1,
/// which transformers would then train with).
#[test]
fn a_folder_asking_for_dropout_is_told_and_the_export_says_none() {
    let dir = run_dir("dropout");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let config = model.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replace(
        "\"hidden_dropout_prob\": 0.0",
        "\"hidden_dropout_prob\": 0.1",
    );
    std::fs::write(&config, text).unwrap();
    let out = dir.join("out");
    let done = succeeded(distgpt(&[
        "train",
        "--task",
        "classify",
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "12",
        "--out",
        out.to_str().unwrap(),
    ]));
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(
        said.contains("asks for dropout in training (hidden_dropout_prob 0.1)"),
        "{said}"
    );
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    for key in ["hidden_dropout_prob", "attention_probs_dropout_prob"] {
        assert_eq!(written[key], 0.0, "{key}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bert_fine_tuning_writes_a_classifier_that_eval_scores() {
    let dir = run_dir("bert-classify");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let out = dir.join("out");
    let out_s = out.to_str().unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--task",
            "classify",
            "--init-from",
            model,
            "--data",
            data,
        ];
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let done = succeeded(train(&[
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "12",
        "--lr",
        "1e-3",
        "--strategy",
        "zero2",
        "--world-size",
        "2",
        "--out",
        out_s,
    ]));
    let text = String::from_utf8_lossy(&done.stdout).to_string();
    assert!(
        text.contains("test: loss") && text.contains("on 5 examples"),
        "{text}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("classify.json")).unwrap()).unwrap();
    assert_eq!(summary["epochs"].as_array().unwrap().len(), 2);
    // the labelled set the run recorded is scored unless another is given
    let eval = distgpt(&["eval", out_s, "--batch-size", "4", "--seq-len", "12"]);
    let text = String::from_utf8_lossy(&succeeded(eval).stdout).to_string();
    let acc = format!(
        "accuracy {:.2}%",
        100.0 * summary["test"]["accuracy"].as_f64().unwrap()
    );
    assert!(
        text.contains(&acc),
        "eval said {text:?}, training said {acc}"
    );
    // without --seq-len, at the run's own 12 (the model has 24 positions,
    // where this set scores otherwise); another --seq-len names the run's
    let figures =
        |text: &str| text[text.find("loss ").unwrap()..text.find(" (").unwrap()].to_string();
    let eval_at = |extra: &[&str]| {
        let mut args = vec!["eval", out_s, "--data", data, "--batch-size", "4"];
        args.extend_from_slice(extra);
        String::from_utf8_lossy(&succeeded(distgpt(&args)).stdout).to_string()
    };
    let own = eval_at(&[]);
    assert_eq!(figures(&own), figures(&text), "{own}");
    assert!(own.contains("at --seq-len 12)"), "{own}");
    let longer = eval_at(&["--seq-len", "24"]);
    assert_ne!(figures(&longer), figures(&text), "{longer}");
    assert!(
        longer.contains("at --seq-len 24; its run trained and scored at --seq-len 12"),
        "{longer}"
    );
    // export writes the classifier's folder anew, the same weights and vocabulary
    let exported = dir.join("exported");
    succeeded(distgpt(&[
        "export",
        out_s,
        "--out",
        exported.to_str().unwrap(),
    ]));
    for f in ["model.safetensors", "vocab.txt"] {
        assert!(
            std::fs::read(out.join(f)).unwrap() == std::fs::read(exported.join(f)).unwrap(),
            "{f}"
        );
    }
    // the label names go along, for transformers' pipelines (id2label), in
    // the export and in a folder consolidated from a checkpoint
    let consolidated = dir.join("consolidated");
    let newest = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    succeeded(distgpt(&[
        "checkpoint",
        "consolidate",
        newest.to_str().unwrap(),
        "--out",
        consolidated.to_str().unwrap(),
    ]));
    for folder in [&exported, &consolidated] {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            config["id2label"],
            serde_json::json!({"0": "ham", "1": "spam"}),
            "{}",
            folder.display()
        );
        assert_eq!(config["label2id"], serde_json::json!({"ham": 0, "spam": 1}));
    }
    // a set whose names are the other way round is not scored by id
    let swapped = dir.join("swapped");
    std::fs::create_dir_all(&swapped).unwrap();
    for f in ["train.jsonl", "val.jsonl", "test.jsonl"] {
        std::fs::copy(Path::new(data).join(f), swapped.join(f)).unwrap();
    }
    std::fs::write(swapped.join("labels.json"), r#"["spam","ham"]"#).unwrap();
    for model in [out_s, exported.to_str().unwrap()] {
        let said = distgpt(&["eval", model, "--data", swapped.to_str().unwrap()]);
        let said = String::from_utf8_lossy(&said.stderr).to_string();
        assert!(
            said.contains(r#"was trained on the labels ["ham", "spam"]"#)
                && said.contains(r#"names ["spam", "ham"]"#),
            "{said}"
        );
    }
    // Evaluation flags of language models are refused for a classifier.
    let said = String::from_utf8_lossy(
        &distgpt(&["eval", out_s, "--data", data, "--batches", "3"]).stderr,
    )
    .to_string();
    assert!(said.contains("--batches is for language models"), "{said}");
    // Flags only GPT-2 training has are refused, by name.
    let said = String::from_utf8_lossy(&train(&["--sample-every", "5"]).stderr).to_string();
    assert!(
        said.contains("--sample-every is for GPT-2 language models"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_stopped_fine_tuning_run_resumes_to_the_uninterrupted_runs_weights() {
    let dir = run_dir("bert-classify-resume");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let fine_tune = |out: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--task",
            "classify",
            "--init-from",
            model,
            "--data",
            data,
            "--epochs",
            "2",
            "--batch-size",
            "4",
            "--seq-len",
            "12",
            "--lr",
            "1e-3",
            "--world-size",
            "2",
            "--strategy",
            "fsdp",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let resume = |out: &std::path::Path| {
        distgpt(&[
            "train",
            "--task",
            "classify",
            "--resume",
            out.to_str().unwrap(),
            "--world-size",
            "2",
            "--strategy",
            "fsdp",
            "--quiet",
        ])
    };
    let whole = dir.join("whole");
    succeeded(fine_tune(&whole, &[]));
    let summary = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("classify.json")).unwrap()).unwrap()
    };
    let weights = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();
    // 12 examples in batches of 4: 3 steps an epoch. Stopped mid-epoch (step
    // 4) and at an epoch's end (step 3), each resumed to the end.
    for stop in ["4", "3"] {
        let out = dir.join(format!("stop{stop}"));
        let stopped = fine_tune(&out, &["--stop-after", stop]);
        let said = String::from_utf8_lossy(&stopped.stderr).to_string();
        assert_eq!(stopped.status.code(), Some(75), "{said}");
        assert!(
            said.contains(&format!("stopped after step {stop} with a checkpoint")),
            "{said}"
        );
        // a stopped run holds its model as of the stop, as a GPT-2 run does
        let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
        assert!(cfg.contains("distgpt_weights_checksum"), "{cfg}");
        assert!(weights(&whole) != weights(&out));
        succeeded(resume(&out));
        assert!(
            weights(&whole) == weights(&out),
            "stopped after step {stop} and resumed: other weights than the uninterrupted run"
        );
        let (a, b) = (summary(&whole), summary(&out));
        for e in 0..2 {
            assert_eq!(
                a["epochs"][e]["train_loss"], b["epochs"][e]["train_loss"],
                "epoch {e}'s training loss after a stop at {stop}"
            );
            assert_eq!(a["epochs"][e]["val"]["loss"], b["epochs"][e]["val"]["loss"]);
        }
        assert_eq!(a["test"]["loss"], b["test"]["loss"]);
    }
    // a finished run has nothing to resume; the run's settings are fixed
    let said = String::from_utf8_lossy(&resume(&whole).stderr).to_string();
    assert!(said.contains("nothing left to train"), "{said}");
    let mut args = vec!["train", "--task", "classify", "--resume"];
    args.extend([whole.to_str().unwrap(), "--seed", "7"]);
    let said = String::from_utf8_lossy(&distgpt(&args).stderr).to_string();
    assert!(
        said.contains("--seed cannot change when resuming"),
        "{said}"
    );
    // extended and stopped before it scores again: its model changed, so
    // the record of the earlier model is gone, and --resume writes the new one
    let extend = |extra: &[&str]| {
        let mut args = vec!["train", "--task", "classify", "--resume"];
        args.extend([whole.to_str().unwrap(), "--quiet", "--steps", "8"]);
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let stopped = extend(&["--stop-after", "1"]);
    assert_eq!(stopped.status.code(), Some(75), "{stopped:?}");
    assert!(weights(&whole) != weights(&dir.join("stop3")));
    assert!(
        !whole.join("classify.json").exists(),
        "classify.json of 6 steps kept beside the model of 7"
    );
    succeeded(extend(&[]));
    let extended = summary(&whole);
    assert!(extended["test"]["loss"] != summary(&dir.join("stop3"))["test"]["loss"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The language-model matrix takes any causal family's preset and refuses
/// an encoder in words.
#[test]
fn compare_refuses_an_encoder_in_its_language_model_matrix() {
    let dir = run_dir("compare-bert-lm");
    let out = distgpt(&[
        "compare",
        "--models",
        "bert-tiny",
        "--quick",
        "--out",
        dir.join("report").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("bert-tiny is a BERT: compare's language-model matrix trains causal language models"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_runs_a_fine_tuning_matrix_that_follows_single() {
    let dir = run_dir("compare-classify");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let out = dir.join("report");
    let args = |extra: &[&str]| {
        let mut v = vec![
            "compare",
            "--task",
            "classify",
            "--init-from",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ];
        v.extend_from_slice(extra);
        distgpt(&v)
    };
    let done = succeeded(args(&[
        "--strategies",
        "single,ddp,zero2,fsdp,tp",
        "--world-sizes",
        "2",
        "--batch-sizes",
        "4",
        "--epochs",
        "2",
        "--seq-len",
        "12",
        "--lr",
        "1e-3",
        "--out",
        out.to_str().unwrap(),
    ]));
    let text = String::from_utf8_lossy(&done.stdout).to_string();
    assert!(text.contains("val accuracy by epoch"), "{text}");
    // piped, the hidden bars leave a line per run on stderr
    let said = String::from_utf8_lossy(&done.stderr);
    for k in 1..=5 {
        assert!(said.contains(&format!("run {k}/5 ")), "{said}");
    }
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 5, "single, ddp, zero2, fsdp, tp at 2 ranks");
    for r in rows {
        let label = r["label"].as_str().unwrap();
        assert_eq!(r["epochs"].as_array().unwrap().len(), 2, "{label}");
        // 12 training examples in batches of 4, 2 epochs
        assert_eq!(r["losses"].as_array().unwrap().len(), 6, "{label}");
        let dev = r["max_loss_deviation_from_single"].as_f64().unwrap();
        assert!(
            dev <= 1e-5,
            "{label}: training loss strays {dev:e} from single"
        );
        let peaks = r["rank_peak_bytes"].as_array().unwrap();
        assert_eq!(peaks.len(), r["world_size"].as_u64().unwrap() as usize);
        let measured = peaks
            .iter()
            .map(|p| p[5].as_f64().unwrap())
            .fold(0.0, f64::max);
        let predicted = r["predicted_peak_bytes"].as_f64().unwrap();
        assert!(
            (predicted - measured).abs() <= 0.1 * measured,
            "{label}: plan predicted {predicted:.0} bytes per rank, measured {measured:.0}"
        );
    }
    for f in [
        "report.md",
        "accuracy_per_epoch.png",
        "accuracy_per_epoch.svg",
        "loss_curves.png",
    ] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    // Flags of the language-model matrix are refused by name, and a
    // fine-tuning matrix needs its folder.
    let said = String::from_utf8_lossy(&args(&["--models", "tiny"]).stderr).to_string();
    assert!(said.contains("--models is for --task lm"), "{said}");
    let said = String::from_utf8_lossy(
        &distgpt(&[
            "compare",
            "--task",
            "classify",
            "--data",
            data.to_str().unwrap(),
        ])
        .stderr,
    )
    .to_string();
    assert!(said.contains("needs --init-from"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bert_preset_pretrains_as_a_masked_lm_by_default_and_resumes_exactly() {
    let dir = run_dir("mlm");
    let mlm = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--model",
            "bert-tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-every",
            "2",
            "--lr",
            "2e-3",
            "--warmup",
            "1",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    // straight through 4 steps, and stopped after 2 then resumed to 4
    let (whole, half) = (dir.join("whole"), dir.join("half"));
    let (whole_s, half_s) = (whole.to_str().unwrap(), half.to_str().unwrap());
    let done = succeeded(mlm(&["--steps", "4", "--out", whole_s]));
    let text = String::from_utf8_lossy(&done.stdout).to_string();
    assert!(text.contains("masked-token loss"), "{text}");
    let stopped = mlm(&["--steps", "4", "--stop-after", "2", "--out", half_s]);
    assert_eq!(stopped.status.code(), Some(75));
    // a resume takes everything from the run's record
    let resumed = succeeded(distgpt(&["train", "--resume", half_s, "--quiet"]));
    let text = String::from_utf8_lossy(&resumed.stdout).to_string();
    assert!(text.contains("steps 2..4"), "{text}");
    // `eval` of the run scores its masked LM as the run's last evaluation did
    let last: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(whole.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    let eval = succeeded(distgpt(&[
        "eval",
        whole_s,
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--batches",
        "20",
    ]));
    let said = String::from_utf8_lossy(&eval.stdout).to_string();
    let want = format!(
        "masked-token loss {:.4}",
        last["val_loss"].as_f64().unwrap()
    );
    assert!(said.contains(&want), "eval said {said:?}, the run {want}");
    let weights = |d: &std::path::Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&whole) == weights(&half),
        "a resumed masked-LM run ends on the uninterrupted run's weights"
    );
    // the checkpoint consolidates into a Hugging Face folder; generate refuses it by its family
    let folder = dir.join("folder");
    let ckpt = half.join("checkpoints/step_00000004");
    succeeded(distgpt(&[
        "checkpoint",
        "consolidate",
        half.to_str().unwrap(),
        "--out",
        folder.to_str().unwrap(),
    ]));
    assert!(weights(&folder) == weights(&half));
    let said = String::from_utf8_lossy(
        &distgpt(&["generate", ckpt.to_str().unwrap(), "--tokens", "2"]).stderr,
    )
    .to_string();
    assert!(
        said.contains("holds a BERT model") && said.contains("does not generate text"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let said = String::from_utf8_lossy(
        &distgpt(&[
            "train",
            "--model",
            "bert-tiny",
            "--task",
            "lm",
            "--steps",
            "1",
        ])
        .stderr,
    )
    .to_string();
    assert!(said.contains("bert-tiny is a BERT preset"), "{said}");
}

/// The steps of a run's `metrics.jsonl` and `metrics.csv`, in file order.
fn logged_steps(dir: &std::path::Path) -> (Vec<u64>, Vec<u64>) {
    let jsonl = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let csv = std::fs::read_to_string(dir.join("metrics.csv")).unwrap();
    (
        jsonl
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect(),
        csv.lines()
            .skip(1)
            .map(|l| l.split(',').next().unwrap().parse().unwrap())
            .collect(),
    )
}

/// The command a stopped run's last line says continues it, word by word.
fn continue_hint(stderr: &str) -> Vec<String> {
    let hint = stderr
        .split("continue with `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .unwrap_or_else(|| panic!("no `continue with` hint in {stderr}"));
    hint.split(' ').map(String::from).collect()
}

/// Every task (GPT-2 LM, BERT MLM, BERT classifier) is the one run driver's:
/// a run stopped part-way and continued by the command its stop prints
/// (`--resume RUN` and nothing else) ends on the uninterrupted run's weights,
/// byte for byte, in the run's own layout and with its own settings (lr,
/// seed, warmup, betas, batch); its logs hold every step once; a setting the
/// checkpoint fixes is refused on resume.
#[test]
fn every_task_stopped_and_resumed_by_its_hint_ends_on_the_uninterrupted_weights() {
    let dir = run_dir("every-task");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let tasks: [(&str, Vec<&str>, &str); 3] = [
        (
            "lm",
            vec!["--model", "tiny", "--batch-size", "4", "--seq-len", "16"],
            "model.safetensors",
        ),
        (
            "mlm",
            vec![
                "--model",
                "bert-tiny",
                "--batch-size",
                "4",
                "--seq-len",
                "16",
            ],
            "model.safetensors",
        ),
        (
            "classify",
            vec![
                "--init-from",
                model,
                "--data",
                data,
                "--batch-size",
                "4",
                "--seq-len",
                "12",
            ],
            "model.safetensors",
        ),
    ];
    for (task, flags, weights_file) in tasks {
        let run = |out: &std::path::Path, extra: &[&str]| {
            let mut args = vec!["train", "--task", task];
            args.extend(&flags);
            // settings away from every default, so a resume that fell back
            // to a default would train other weights
            args.extend([
                "--steps",
                "6",
                "--lr",
                "3e-3",
                "--seed",
                "11",
                "--warmup",
                "2",
                "--beta2",
                "0.95",
                "--min-lr",
                "1e-4",
                "--eval-every",
                "2",
                "--strategy",
                "fsdp",
                "--world-size",
                "2",
                "--quiet",
            ]);
            args.extend(["--out", out.to_str().unwrap()]);
            args.extend(extra);
            distgpt(&args)
        };
        let whole = dir.join(format!("{task}-whole"));
        succeeded(run(&whole, &[]));
        let part = dir.join(format!("{task}-part"));
        let stopped = run(&part, &["--stop-after", "3"]);
        let said = String::from_utf8_lossy(&stopped.stderr).to_string();
        assert_eq!(stopped.status.code(), Some(75), "{task}: {said}");
        let hint = continue_hint(&said);
        assert_eq!(
            hint[..3],
            ["distgpt", "train", "--resume"],
            "{task}: {said}"
        );
        let refused = distgpt(&["train", "--resume", part.to_str().unwrap(), "--seed", "99"]);
        let why = String::from_utf8_lossy(&refused.stderr).to_string();
        assert!(
            why.contains("--seed cannot change when resuming"),
            "{task}: {why}"
        );
        let hint: Vec<&str> = hint[1..].iter().map(String::as_str).collect();
        let mut again = hint.clone();
        again.push("--quiet");
        succeeded(distgpt(&again));
        let w = |d: &std::path::Path| std::fs::read(d.join(weights_file)).unwrap();
        assert!(
            w(&whole) == w(&part),
            "{task}: stopped at step 3 and resumed by its hint: other weights than the uninterrupted run"
        );
        let (jsonl, csv) = logged_steps(&part);
        assert_eq!(jsonl, (1..=6).collect::<Vec<_>>(), "{task}: metrics.jsonl");
        assert_eq!(csv, jsonl, "{task}: metrics.csv");
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(part.join("run.json")).unwrap()).unwrap();
        assert_eq!(record["task"], task);
        assert_eq!(record["segments"].as_array().unwrap().len(), 2, "{task}");
        assert_eq!(record["parallel"]["strategy"], "fsdp", "{task}");
    }
    // a classifier trains the --steps asked for (12 examples in batches of
    // 4: 3 steps an epoch), logs accuracy and F1, and reports every epoch
    let part = dir.join("classify-part");
    let last: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(part.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();
    assert!(
        last["val_accuracy"].is_number() && last["val_f1"].is_number(),
        "{last}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(part.join("classify.json")).unwrap())
            .unwrap();
    assert_eq!(report["epochs"].as_array().unwrap().len(), 2, "{report}");
    // plot draws the classifier's accuracy per epoch among its figures
    let plots = dir.join("plots");
    succeeded(distgpt(&[
        "plot",
        part.to_str().unwrap(),
        "--out",
        plots.to_str().unwrap(),
    ]));
    assert!(plots.join("accuracy.png").exists(), "no accuracy figure");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A BERT run's model folder is checksummed and checked: a run killed
/// between its model files and its final checkpoint (here: the weights cut
/// short) is repaired by `--resume`; a flipped bit or a NaN is refused on
/// load, never scored.
#[test]
fn bert_model_folders_are_checked_on_load_and_repaired_on_resume() {
    let dir = run_dir("bert-folder-checks");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let (model, data) = (model.to_str().unwrap(), data.to_str().unwrap());
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    succeeded(distgpt(&[
        "train",
        "--task",
        "classify",
        "--init-from",
        model,
        "--data",
        data,
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "12",
        "--quiet",
        "--out",
        out_s,
    ]));
    let weights = out.join("model.safetensors");
    let good = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &good[..good.len() / 2]).unwrap();
    let eval = || {
        distgpt(&[
            "eval",
            out_s,
            "--data",
            data,
            "--batch-size",
            "4",
            "--seq-len",
            "12",
        ])
    };
    let said = String::from_utf8_lossy(&eval().stderr).to_string();
    assert!(said.contains("checksum"), "{said}");
    let repaired = succeeded(distgpt(&["train", "--resume", out_s]));
    let text = String::from_utf8_lossy(&repaired.stdout).to_string();
    assert!(text.contains("rewrote them"), "{text}");
    assert!(
        std::fs::read(&weights).unwrap() == good,
        "repaired from the final checkpoint"
    );
    assert!(out.join("vocab.txt").exists());
    succeeded(eval());
    // a run stopped while it scored its test split (after its final
    // checkpoint and model files) is scored by --resume
    let report = out.join("classify.json");
    let scored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    std::fs::remove_file(&report).unwrap();
    let finished = succeeded(distgpt(&["train", "--resume", out_s]));
    let text = String::from_utf8_lossy(&finished.stdout).to_string();
    assert!(text.contains("scored it"), "{text}");
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(again, scored, "the report the uninterrupted run wrote");
    let said = String::from_utf8_lossy(&distgpt(&["train", "--resume", out_s]).stderr).to_string();
    assert!(said.contains("nothing left to train"), "{said}");
    // one flipped exponent bit in the last float
    let mut flipped = good.clone();
    let at = flipped.len() - 1;
    flipped[at] ^= 0x40;
    std::fs::write(&weights, &flipped).unwrap();
    let said = String::from_utf8_lossy(&eval().stderr).to_string();
    assert!(
        said.contains("checksum") && !said.contains("accuracy"),
        "{said}"
    );
    // a folder from elsewhere (no checksum) holding a NaN
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    config
        .as_object_mut()
        .unwrap()
        .remove("distgpt_weights_checksum")
        .expect("distgpt's folders record the weights' checksum");
    let plain = serde_json::to_string(&config).unwrap();
    std::fs::write(out.join("config.json"), plain).unwrap();
    let mut nan = good.clone();
    let n = nan.len();
    nan[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&weights, &nan).unwrap();
    let said = String::from_utf8_lossy(&eval().stderr).to_string();
    assert!(said.contains("non-finite"), "{said}");
    // a config asking for far more than the file holds is refused before
    // the model is allocated (not an abort)
    config["num_hidden_layers"] = serde_json::json!(200_000);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let said = String::from_utf8_lossy(&eval().stderr).to_string();
    assert!(said.contains("cannot hold"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every command's --seed is a whole number from 0 to 2^64 - 1: a negative
/// or overflowing one is refused by that range, by name, as other numbers
/// are (never "unexpected argument" or a bare parse error); the largest
/// still reads.
#[test]
fn a_seed_out_of_range_is_refused_by_its_range_on_every_command() {
    let dir = run_dir("seeds");
    let missing = dir.join("no-such-run");
    let missing = missing.to_str().unwrap();
    let out = dir.join("out");
    let out = out.to_str().unwrap();
    let commands: [&[&str]; 5] = [
        &["train", "--out", out],
        &["generate", missing],
        &["prune", missing, "--out", out],
        &["compare", "--out", out],
        &["data", "prepare-dialogue", "--input", missing, "--out", out],
    ];
    for command in commands {
        for (seed, says) in [
            ("-1", "-1 is not in 0..=18446744073709551615"),
            (
                "18446744073709551616",
                "18446744073709551616 is not in 0..=18446744073709551615",
            ),
            ("1e3", "1e3 is not a whole number"),
        ] {
            let mut args = command.to_vec();
            args.extend(["--seed", seed]);
            let o = distgpt(&args);
            let said = String::from_utf8_lossy(&o.stderr).to_string();
            assert_eq!(o.status.code(), Some(2), "{args:?}: {said}");
            assert!(
                said.contains(&format!(
                    "invalid value '{seed}' for '--seed <SEED>': {says}"
                )),
                "{args:?}: {said}"
            );
        }
        // the largest seed reads (and --help after it then prints the help)
        let mut args = command.to_vec();
        args.extend(["--seed", "18446744073709551615", "--help"]);
        let o = distgpt(&args);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(!std::path::Path::new(out).exists(), "nothing was written");
}

/// `eval RUN` of a language model scores the data its run trained on, as a
/// masked LM's and a classifier's do: not the embedded corpus (which a
/// character model of another text cannot even read).
#[test]
fn eval_of_a_language_model_reads_the_data_its_run_trained_on() {
    let dir = run_dir("eval-recorded-data");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("cats.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    succeeded(distgpt(&[
        "train",
        "--model",
        "tiny",
        "--data",
        text.to_str().unwrap(),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--quiet",
        "--out",
        run_s,
    ]));
    let own = succeeded(distgpt(&[
        "eval",
        run_s,
        "--batches",
        "2",
        "--seq-len",
        "16",
    ]));
    let given = succeeded(distgpt(&[
        "eval",
        run_s,
        "--batches",
        "2",
        "--seq-len",
        "16",
        "--data",
        text.to_str().unwrap(),
    ]));
    let said = String::from_utf8_lossy(&own.stdout).to_string();
    assert!(said.contains("tokens from cats)"), "{said}");
    assert_eq!(said, String::from_utf8_lossy(&given.stdout));
    // recorded data that is gone is said to be, and --data named
    std::fs::remove_file(&text).unwrap();
    let gone = distgpt(&["eval", run_s, "--batches", "2", "--seq-len", "16"]);
    let said = String::from_utf8_lossy(&gone.stderr).to_string();
    assert!(!gone.status.success());
    assert!(
        said.contains("no longer there") && said.contains("--data"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shard folder without tokenizer.json is read as llm.c's GPT-2 BPE
/// shards, and says so: `data prepare` always writes one, so a folder
/// that lost it (character ids read as GPT-2's) is not trained on
/// without a word.
#[test]
fn shards_without_a_tokenizer_json_are_said_to_be_read_as_gpt2() {
    let dir = run_dir("no-tokenizer-json");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("small.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let shards = dir.join("shards");
    succeeded(distgpt(&[
        "data",
        "prepare",
        "--input",
        text.to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
    ]));
    std::fs::remove_file(shards.join("tokenizer.json")).unwrap();
    let run = dir.join("run");
    let o = succeeded(distgpt(&[
        "train",
        "--model",
        "tiny",
        "--data",
        shards.to_str().unwrap(),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--out",
        run.to_str().unwrap(),
    ]));
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        said.contains("no tokenizer.json") && said.contains("GPT-2 BPE"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// train, eval, data prepare, quantize and bench read a negative number as
/// the flag's value too, refused by its range or its type, never as
/// "unexpected argument '-5'" (plan, generate and prune already did).
#[test]
fn a_negative_number_is_a_value_on_train_eval_prepare_quantize_and_bench() {
    let dir = run_dir("negative-everywhere");
    let missing = dir.join("no-such-run");
    let missing = missing.to_str().unwrap();
    let out = dir.join("out");
    let out = out.to_str().unwrap();
    let commands: [&[&str]; 7] = [
        &["train", "--out", out, "--steps", "-5"],
        &["train", "--out", out, "--batch-size", "-2"],
        &["eval", missing, "--batches", "-1"],
        &["eval", missing, "--seq-len", "-8"],
        &["data", "prepare", "--out", out, "--vocab-size", "-5"],
        &["quantize", missing, "--out", out, "--threads", "-1"],
        &["bench", "--steps", "-3"],
    ];
    for args in commands {
        let o = distgpt(args);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {said}");
        let value = args.last().unwrap();
        assert!(!said.contains("unexpected argument"), "{args:?}: {said}");
        assert!(
            said.contains(&format!("invalid value '{value}'")),
            "{args:?}: {said}"
        );
    }
    assert!(!std::path::Path::new(out).exists(), "nothing was written");
}

/// A negative number is read as the flag's value and refused by its range
/// (never "unexpected argument"), a sparsity as given; an absurd depth is
/// refused by plan at once; a WordPiece vocabulary smaller than asked is
/// said to be.
#[test]
fn negative_numbers_absurd_depths_and_short_vocabularies_are_said_up_front() {
    let dir = run_dir("negative-numbers");
    let refused = |args: &[&str], says: &[&str]| {
        let started = std::time::Instant::now();
        let o = distgpt(args);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "{args:?}");
        assert!(!said.contains("unexpected argument"), "{args:?}: {said}");
        for s in says {
            assert!(said.contains(s), "{args:?}: {said}");
        }
        assert!(started.elapsed().as_secs() < 20, "{args:?}");
    };
    refused(&["plan", "--batch-size", "-4"], &["-4 is not in 1..="]);
    refused(
        &["plan", "--world-size", "1,-2"],
        &["-2 is not in 1..=131072"],
    );
    refused(&["plan", "--n-layer", "-4"], &["-4 is not in"]);
    refused(&["plan", "--n-layer", "100000"], &["at most 1024"]);
    refused(&["generate", "--tokens", "-4"], &["-4 is not in 1..="]);
    refused(&["generate", "--top-k", "-4"], &["-4 is not in 0..="]);
    let missing = dir.join("no-such-run");
    let missing = missing.to_str().unwrap();
    let pruned = dir.join("pruned");
    let pruned = pruned.to_str().unwrap();
    refused(
        &["prune", missing, "--out", pruned, "--sparsity", "-0.1"],
        &["sparsity -0.1 must be above 0"],
    );
    refused(
        &["prune", missing, "--out", pruned, "--finetune-steps", "-4"],
        &["-4 is not in 0..="],
    );
    let text = dir.join("small.txt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&text, "the cat sat on the mat. ".repeat(200)).unwrap();
    let shards = dir.join("shards");
    let prepared = succeeded(distgpt(&[
        "data",
        "prepare",
        "--input",
        text.to_str().unwrap(),
        "--tokenizer",
        "wordpiece",
        "--vocab-size",
        "60000",
        "--out",
        shards.to_str().unwrap(),
    ]));
    let said = String::from_utf8_lossy(&prepared.stderr).to_string();
    assert!(said.contains("fewer than the --vocab-size 60000"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A masked LM on a plain text is character-level and says so; a
/// classifier started from it is refused naming what it was trained on,
/// not with the OS's word for a missing vocab.txt.
#[test]
fn a_character_level_masked_lm_says_so_and_cannot_start_a_classifier() {
    let dir = run_dir("char-mlm");
    let (_, labelled) = tiny_bert_and_labelled_set(&dir);
    let text = dir.join("small.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(400)).unwrap();
    let mlm = dir.join("mlm");
    let trained = succeeded(distgpt(&[
        "train",
        "--task",
        "mlm",
        "--model",
        "bert-tiny",
        "--data",
        text.to_str().unwrap(),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--quiet",
        "--out",
        mlm.to_str().unwrap(),
    ]));
    let said = String::from_utf8_lossy(&trained.stderr).to_string();
    assert!(said.contains("characters are the tokens"), "{said}");
    let refused = distgpt(&[
        "train",
        "--task",
        "classify",
        "--init-from",
        mlm.to_str().unwrap(),
        "--data",
        labelled.to_str().unwrap(),
        "--out",
        dir.join("cls").to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(!refused.status.success());
    assert!(
        said.contains("holds no vocab.txt (it was trained on") && !said.contains("os error"),
        "{said}"
    );
    // prune and a language model from it name the family, not a vocabulary
    let pruned = dir.join("pruned");
    let refused = distgpt(&[
        "prune",
        mlm.to_str().unwrap(),
        "--out",
        pruned.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        said.contains("BERT models mark no weight matrices"),
        "{said}"
    );
    let lm = dir.join("lm");
    let refused = distgpt(&[
        "train",
        "--init-from",
        mlm.to_str().unwrap(),
        "--out",
        lm.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(said.contains("holds a BERT"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad numbers get a clear error naming the flag, never a panic; an
/// output folder over its input is refused.
#[test]
fn bad_numbers_and_outputs_over_inputs_are_refused_by_name() {
    let dir = run_dir("bad-numbers");
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    succeeded(train_tiny(
        out_s,
        &["--steps", "1", "--checkpoint-every", "1"],
    ));
    let ckpt = out.join("checkpoints").join("step_00000001");
    let ckpt = ckpt.to_str().unwrap().to_string();
    let a_file = dir.join("a-file").to_str().unwrap().to_string();
    std::fs::write(&a_file, "not a folder").unwrap();
    for (args, says) in [
        (vec!["eval", out_s, "--batch-size", "0"], "--batch-size"),
        (vec!["eval", out_s, "--seq-len", "0"], "--seq-len"),
        (vec!["bench", "--model", "tiny", "--steps", "0"], "--steps"),
        (
            vec!["bench", "--model", "tiny", "--batch-size", "0"],
            "--batch-size",
        ),
        (vec!["generate", out_s, "--tp", "0"], "--tp"),
        (
            vec!["generate", out_s, "--tokens", "18446744073709551615"],
            "--tokens",
        ),
        (
            vec![
                "train",
                "--model",
                "tiny",
                "--steps",
                "1",
                "--comm-timeout",
                "1e300",
            ],
            "--comm-timeout",
        ),
        (
            vec!["train", "--model", "tiny", "--stop-after", "0"],
            "--stop-after",
        ),
        (
            vec![
                "bench",
                "--model",
                "tiny",
                "--generate",
                "4",
                "--strategy",
                "ddp",
                "--world-size",
                "2",
            ],
            "--generate times one rank's decoding",
        ),
        (vec!["quantize", out_s, "--out", out_s], "is the input"),
        (vec!["prune", out_s, "--out", out_s], "is the input"),
        // an --out that is a file, named as one
        (
            vec!["export", out_s, "--out", &a_file, "--overwrite"],
            "is a file: the output is a model folder",
        ),
        (
            vec!["quantize", out_s, "--out", &a_file],
            "is a file: the output is a model folder",
        ),
        (
            vec!["train", "--model", "tiny", "--steps", "1", "--out", &a_file],
            "is a file: a run's --out is a folder",
        ),
        // a run's model replaced by a checkpoint's, or by a Hugging Face folder
        (
            vec!["export", &ckpt, "--out", out_s],
            "holds a training run",
        ),
        (
            vec!["checkpoint", "consolidate", &ckpt, "--out", out_s],
            "holds a training run",
        ),
        // sizes that would allocate without end, and peaks MFU cannot divide by
        (
            vec!["bench", "--model", "tiny", "--grad-accum", "1000000000000"],
            "--grad-accum",
        ),
        (
            vec!["plan", "--model", "tiny", "--grad-accum", "1000000000000"],
            "--grad-accum",
        ),
        (
            vec![
                "train",
                "--model",
                "tiny",
                "--sample-tokens",
                "1000000000000",
            ],
            "--sample-tokens",
        ),
        (vec!["--threads", "100000", "devices"], "--threads 100000"),
        // epochs past the steps a run takes (cut to 10^9 without a word)
        (
            vec!["train", "--model", "tiny", "--epochs", "1000000"],
            "steps of this data, more than 1000000000",
        ),
        (
            vec!["bench", "--model", "tiny", "--peak-tflops", "0"],
            "--peak-tflops",
        ),
        (
            vec!["train", "--model", "tiny", "--peak-tflops=-1"],
            "--peak-tflops",
        ),
        // a peak past f64 once in FLOP/s (MFU 0% of an infinite peak)
        (
            vec!["bench", "--model", "tiny", "--peak-tflops", "1e300"],
            "1e300 TFLOP/s is inf FLOP/s",
        ),
        (
            vec!["train", "--model", "tiny", "--peak-tflops", "1e-13"],
            "1e-13 TFLOP/s is 1e-1 FLOP/s",
        ),
        // a negative number after a space is the flag's value, not a flag
        (
            vec!["train", "--model", "tiny", "--lr", "-1"],
            "--lr -1 must be a positive number",
        ),
        (
            vec!["train", "--model", "tiny", "--comm-timeout", "1e300"],
            "--comm-timeout 1e300 seconds is more than a duration can hold",
        ),
        (
            vec!["bench", "--model", "tiny", "--peak-gflops", "nan"],
            "--peak-gflops",
        ),
        // the old spelling takes what the new one takes (1e300 was an
        // infinite peak, its run.json then unreadable to --resume)
        (
            vec!["bench", "--model", "tiny", "--peak-gflops", "1e300"],
            "1e300 GFLOP/s is inf FLOP/s",
        ),
        (
            vec!["train", "--model", "tiny", "--peak-gflops", "1e-10"],
            "1e-10 GFLOP/s is 1e-1 FLOP/s",
        ),
        (
            vec![
                "plan",
                "--model",
                "tiny",
                "--device",
                "custom",
                "--intra-latency-us=-5",
            ],
            "--intra-latency-us",
        ),
        // --overwrite would empty the run --from-step means to resume
        (
            vec!["train", "--out", out_s, "--from-step", "1", "--overwrite"],
            "--from-step",
        ),
    ] {
        let o = distgpt(&args);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && said.contains(says) && !said.contains("panicked"),
            "{args:?}: {said}"
        );
    }
    // data too short to evaluate on is refused before --overwrite empties the run
    let six = dir.join("six.txt");
    std::fs::write(&six, "abcabc").unwrap();
    let o = train_tiny_output(
        out_s,
        &[
            "--steps",
            "1",
            "--data",
            six.to_str().unwrap(),
            "--overwrite",
        ],
    );
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success() && said.contains("too short to hold out a validation part"),
        "{said}"
    );
    assert!(out.join("model.safetensors").exists() && out.join("checkpoints").exists());
    // a BERT classifier read at one position; SpamAssassin groups with no messages
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let empty = dir.join("package");
    for g in ["easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2"] {
        std::fs::create_dir_all(empty.join("data").join(g)).unwrap();
    }
    let spam_out = dir.join("spam");
    // a message a group: splits left empty
    let one = dir.join("one-each");
    for g in ["easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2"] {
        let group = one.join("data").join(g);
        std::fs::create_dir_all(&group).unwrap();
        let msg = serde_json::json!({"id": format!("{g}-0"), "text": "Subject: hi\n\nbody"});
        std::fs::write(group.join("0.json"), msg.to_string()).unwrap();
    }
    let letter = dir.join("letter.txt");
    std::fs::write(&letter, "a").unwrap();
    // the fixture is a 3-way classifier: the same examples under 3 label names
    let three = dir.join("three");
    std::fs::create_dir_all(&three).unwrap();
    for split in ["train", "val", "test"] {
        let f = format!("{split}.jsonl");
        std::fs::copy(data.join(&f), three.join(&f)).unwrap();
    }
    std::fs::write(three.join("labels.json"), r#"["a","b","c"]"#).unwrap();
    for (args, says) in [
        (
            vec![
                "eval",
                model.to_str().unwrap(),
                "--data",
                three.to_str().unwrap(),
                "--seq-len",
                "1",
            ],
            "--seq-len 1 must be between 2",
        ),
        (
            vec![
                "data",
                "prepare-spam",
                "--input",
                empty.to_str().unwrap(),
                "--out",
                spam_out.to_str().unwrap(),
            ],
            "holds no messages",
        ),
        (
            vec![
                "data",
                "prepare-spam",
                "--input",
                one.to_str().unwrap(),
                "--out",
                spam_out.to_str().unwrap(),
            ],
            "each split needs at least one",
        ),
        (
            vec![
                "data",
                "prepare",
                "--input",
                letter.to_str().unwrap(),
                "--out",
                spam_out.to_str().unwrap(),
            ],
            "too short to hold out a validation part",
        ),
    ] {
        let o = distgpt(&args);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && said.contains(says) && !said.contains("panicked"),
            "{args:?}: {said}"
        );
    }
    // a classifier of fewer positions than 128 runs at its own by default
    let o = distgpt(&[
        "eval",
        model.to_str().unwrap(),
        "--data",
        three.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{said}");
    // more training examples than the set has
    let (model_s, data_s) = (model.to_str().unwrap(), data.to_str().unwrap());
    let classify = format!("train --task classify --init-from {model_s} --data {data_s}");
    let more = format!("{classify} --train-examples 100000");
    let o = distgpt(&more.split(' ').collect::<Vec<_>>());
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(said.contains("has 12 training examples"), "{said}");
    // a negative count in a config file is the flag's bad value, named
    let neg = dir.join("neg.toml");
    std::fs::write(&neg, "model = \"tiny\"\nsteps = -5\n").unwrap();
    let o = distgpt(&["train", "--config", neg.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(said.contains("invalid value '-5' for '--steps"), "{said}");
    // a config "file" without end is refused, not read
    let o = distgpt(&["train", "--config", "/dev/zero"]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(said.contains("larger than 16 MiB"), "{said}");
    // a seed past 2^63 survives run.json into --config
    let big = dir.join("big-seed");
    succeeded(train_tiny(
        big.to_str().unwrap(),
        &["--steps", "1", "--seed", "18446744073709551615", "--quiet"],
    ));
    let again = dir.join("big-seed-again");
    succeeded(distgpt(&[
        "train",
        "--config",
        big.join("run.json").to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]));
    // a one-position GPT-2 trains and samples (each token from the last one)
    let one = dir.join("block1");
    let done = succeeded(distgpt(&[
        "train",
        "--model",
        "tiny",
        "--block-size",
        "1",
        "--steps",
        "2",
        "--sample-tokens",
        "5",
        "--out",
        one.to_str().unwrap(),
    ]));
    let text = String::from_utf8_lossy(&done.stdout).to_string();
    assert!(text.contains("--- sample ---"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder of shards keeps the tokenizer it was prepared with: `data
/// prepare` does not add shards of another beside them (unless told to
/// delete them first), `train --tokenizer` may not name another, and a run
/// started from a model folder takes its shape and tokenizer from it.
#[test]
fn a_shard_folder_keeps_its_tokenizer_and_init_from_keeps_its_models_shape() {
    let dir = run_dir("shard-tokenizer");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("t.txt");
    std::fs::write(
        &text,
        "To be, or not to be, that is the question. ".repeat(200),
    )
    .unwrap();
    let shards = dir.join("shards");
    let (text_s, shards_s) = (text.to_str().unwrap(), shards.to_str().unwrap());
    let prepare = |extra: &[&str]| {
        let mut args = vec!["data", "prepare", "--input", text_s, "--out", shards_s];
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let refused = |o: Output, says: &str| {
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && said.contains(says) && !said.contains("panicked"),
            "{says}: {said}"
        );
    };
    succeeded(prepare(&[]));
    refused(
        prepare(&["--tokenizer", "gpt2"]),
        "holds an earlier preparation (t_train_000000.bin, t_val_000000.bin, tokenizer.json)",
    );
    succeeded(prepare(&["--tokenizer", "gpt2", "--overwrite"]));
    let bins = std::fs::read_dir(&shards)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "bin")
        })
        .count();
    assert_eq!(bins, 2, "the old shards were deleted, the new ones written");
    let spec = std::fs::read_to_string(shards.join("tokenizer.json")).unwrap();
    assert!(spec.contains("\"gpt2\""), "{spec}");
    refused(
        distgpt(&["data", "prepare", "--input", text_s, "--out", text_s]),
        "is a file",
    );
    let train = |extra: &[&str]| {
        let out = dir.join("run");
        let mut args = vec![
            "train", "--data", shards_s, "--model", "tiny", "--steps", "1",
        ];
        args.extend_from_slice(&["--out", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    refused(
        train(&["--tokenizer", "char"]),
        "holds shards of GPT-2 BPE (its tokenizer.json)",
    );
    // without --tokenizer the shards' own is taken (the default is not asked for)
    let own = dir.join("own-tokenizer");
    succeeded(distgpt(&[
        "train",
        "--data",
        shards_s,
        "--model",
        "tiny",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--quiet",
        "--out",
        own.to_str().unwrap(),
    ]));
    std::fs::remove_file(shards.join("tokenizer.json")).unwrap();
    refused(
        train(&["--tokenizer", "char"]),
        "(no tokenizer.json: GPT-2 BPE tokens, as llm.c writes them)",
    );
    // a model folder's shape and tokenizer are its own
    let run = dir.join("tiny");
    train_tiny(run.to_str().unwrap(), &["--steps", "1", "--quiet"]);
    // shards go in a folder of their own, never among a run's files
    let files = |d: &Path| std::fs::read_dir(d).unwrap().count();
    let before = files(&run);
    for extra in [&[][..], &["--overwrite"]] {
        let mut args = vec!["data", "prepare", "--input", text_s];
        args.extend_from_slice(&["--out", run.to_str().unwrap()]);
        args.extend_from_slice(extra);
        refused(
            distgpt(&args),
            "holds a training run: shards go in a folder of their own",
        );
    }
    assert_eq!(files(&run), before, "the run's folder is as it was");
    // nor among a model's: its vocab.txt and tokenizer.json are the model's
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["model.json", "model.safetensors"] {
        std::fs::copy(run.join(f), model.join(f)).unwrap();
    }
    std::fs::write(model.join("vocab.txt"), "[PAD]\n").unwrap();
    for extra in [&[][..], &["--overwrite"]] {
        let mut args = vec!["data", "prepare", "--input", text_s];
        args.extend_from_slice(&["--out", model.to_str().unwrap()]);
        args.extend_from_slice(extra);
        refused(distgpt(&args), "holds a model (model.json)");
    }
    assert_eq!(files(&model), 3, "the model's folder is as it was");
    for flag in [
        &["--n-layer", "3"][..],
        &["--model", "gpt2"],
        &["--tokenizer", "gpt2"],
    ] {
        let mut args = vec![
            "train",
            "--init-from",
            run.to_str().unwrap(),
            "--steps",
            "1",
        ];
        args.extend_from_slice(flag);
        refused(
            distgpt(&args),
            &format!("{} cannot be given with --init-from", flag[0]),
        );
    }
    // and run.json repeats such a run, as a file's shape gives way to a
    // command line's --init-from
    let tuned = dir.join("tuned");
    let tuned_s = tuned.to_str().unwrap();
    let run_s = run.to_str().unwrap();
    let from = ["train", "--init-from", run_s, "--steps", "1", "--quiet"];
    succeeded(distgpt(&[&from[..], &["--out", tuned_s]].concat()));
    let repeat = |config: PathBuf, extra: &str, out: &str| {
        let out = dir.join(out);
        let line = format!(
            "train --config {} {extra}--out {}",
            config.display(),
            out.display()
        );
        succeeded(distgpt(&line.split(' ').collect::<Vec<_>>()));
    };
    repeat(tuned.join("run.json"), "", "again");
    let from_run = format!("--init-from {run_s} ");
    repeat(run.join("run.json"), &from_run, "again-from");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Hugging Face folder whose config.json disagrees with its weights (a
/// block the config does not have) or with its tokenizer (fewer characters
/// than the vocabulary) is refused by name, not read in part.
#[test]
fn a_hugging_face_folder_that_disagrees_with_itself_is_refused() {
    let dir = run_dir("hf-disagrees");
    let run = dir.join("run");
    train_tiny(run.to_str().unwrap(), &["--steps", "1", "--quiet"]);
    let hf = dir.join("hf");
    succeeded(distgpt(&[
        "export",
        run.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]));
    let config = hf.join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    succeeded(distgpt(&[
        "generate",
        hf.to_str().unwrap(),
        "--tokens",
        "2",
    ]));
    let edited = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut j = original.clone();
        edit(&mut j);
        std::fs::write(&config, serde_json::to_string(&j).unwrap()).unwrap();
        let o = distgpt(&["generate", hf.to_str().unwrap(), "--tokens", "2"]);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && said.contains(says) && !said.contains("panicked"),
            "{says}: {said}"
        );
    };
    edited(
        &|j| j["n_layer"] = serde_json::json!(1),
        "tensor 'transformer.h.1.attn.c_attn.bias' (12 such) has no place in the model its config describes (1 layer)",
    );
    edited(
        &|j| {
            let chars = j["distgpt_tokenizer"]["chars"]
                .as_str()
                .unwrap()
                .to_string();
            j["distgpt_tokenizer"]["chars"] = serde_json::json!(chars[1..]);
        },
        "characters, and vocab_size is",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Under mpirun the command a stop prints is the mpirun command that
/// continues the run (with `--comm mpi` and the run's rank count), and it does.
#[cfg(feature = "mpi")]
#[test]
fn a_run_stopped_under_mpirun_prints_the_mpirun_command_that_continues_it() {
    let dir = run_dir("mpi-hint").join("run");
    let path = dir.to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let mpirun = |args: &[&str]| {
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe"])
            .args(args)
            .output()
            .unwrap()
    };
    let train = "train --comm mpi --strategy ddp --world-size 2 --model tiny --batch-size 4 \
                 --seq-len 16 --steps 6 --quiet --stop-after 3";
    let train: Vec<&str> = train.split_whitespace().collect();
    let stopped = mpirun(&[&["-np", "2", bin][..], &train, &["--out", path]].concat());
    let said = String::from_utf8_lossy(&stopped.stderr).to_string();
    assert!(!stopped.status.success(), "{said}");
    let hint = continue_hint(&said);
    assert_eq!(
        hint,
        ["mpirun", "-np", "2", "distgpt", "train", "--resume", path, "--comm", "mpi"],
        "{said}"
    );
    let mut again: Vec<&str> = hint[1..].iter().map(String::as_str).collect();
    again[2] = bin;
    again.push("--quiet");
    let done = mpirun(&again);
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{said}");
    // the lead process alone says what it resumes
    assert_eq!(said.matches("resuming ").count(), 1, "{said}");
    let (steps, _) = logged_steps(&dir);
    assert_eq!(steps, (1..=6).collect::<Vec<u64>>());
}

/// A `--precision bf16` bench states its MFU against the bf16 peak where
/// its products run on bf16 units (the matmul named "in bf16"; on a CPU
/// with AVX512-BF16 distgpt's kernel, pinned, whatever the kept choice),
/// and an fp32 bench never does; with no bf16 product both are the fp32
/// peak.
#[test]
fn a_bf16_bench_states_its_mfu_against_the_bf16_peak() {
    // mutant-equivalent: src/cli/bench.rs: replace == with != in bench_on
    // (on a CPU with no bf16 product, where a bf16 run's peaks are the fp32
    // run's: nothing tells them apart there; this test catches it where the
    // CPU has AVX512-BF16)
    let row = |precision: &str| -> serde_json::Value {
        let args = "bench --model tiny --batch-size 2 --seq-len 8 --steps 1 --warmup 0 --json";
        let mut args: Vec<&str> = args.split(' ').collect();
        args.extend(["--precision", precision]);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_distgpt"));
        if distgpt::backend::cpu::blas::native_bf16() {
            cmd.env("DISTGPT_MATMUL_BF16", "gemm");
        }
        let out = succeeded(cmd.args(args).output().unwrap());
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (fp32, bf16) = (row("fp32"), row("bf16"));
    let source = |r: &serde_json::Value| r["peak_source"].as_str().unwrap().to_string();
    let peak = |r: &serde_json::Value| r["peak_gflops"].as_f64().unwrap();
    assert!(!source(&fp32).contains("bf16"), "{fp32}");
    match bf16["matmul"].as_str().unwrap().contains("in bf16") {
        // AVX512-BF16's two products a lane: twice the FMA units' peak
        true => assert!(
            source(&bf16).contains("bf16") && (peak(&bf16) - 2.0 * peak(&fp32)).abs() < 1e-6,
            "{bf16}\n{fp32}"
        ),
        false => assert_eq!(peak(&bf16), peak(&fp32), "{bf16}\n{fp32}"),
    }
}

/// A run's matmul peak is the speed of the library its layers run on: with
/// `DISTGPT_MATMUL=gemm` pinned, the gemm crate's timed speed that
/// `devices` lists, whichever library the kept measurement chose.
#[test]
fn a_pinned_library_is_the_matmul_peak_a_bench_states() {
    let pinned = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .env("DISTGPT_MATMUL", "gemm")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&succeeded(out).stdout).to_string()
    };
    let bench = "bench --model tiny --batch-size 2 --seq-len 8 --steps 1 --warmup 0 --json";
    let row: serde_json::Value =
        serde_json::from_str(&pinned(&bench.split(' ').collect::<Vec<_>>())).unwrap();
    let listed = pinned(&["devices"]);
    let gemm: f64 = listed
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("gemm crate layers"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no gemm crate timing in {listed}"));
    let stated = row["matmul_peak_gflops"].as_f64().unwrap();
    assert!(
        (stated - gemm).abs() <= 0.05,
        "{stated} stated, {gemm} timed: {listed}"
    );
}

/// The one `bench --json` row a run printed (rank 0's under mpirun).
#[cfg(feature = "mpi")]
fn bench_row(out: Output) -> serde_json::Value {
    let out = succeeded(out);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let rows: Vec<&str> = said.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(rows.len(), 1, "one row, rank 0's: {said}");
    serde_json::from_str(rows[0]).unwrap()
}

/// Under mpirun each process measures the peaks of its share of the
/// machine (its own threads), and a bench states them times the processes:
/// two processes of a thread each state twice what one process of one
/// thread states, from the same kept measurement.
#[cfg(feature = "mpi")]
#[test]
fn bench_under_mpirun_states_the_peaks_of_every_process() {
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let cache = run_dir("mpi-peaks-cache");
    let bench =
        "--threads 1 bench --model tiny --batch-size 2 --seq-len 8 --steps 1 --warmup 0 --json";
    // the single process first: it measures and keeps the peaks of a thread
    let one = bench_row(
        Command::new(bin)
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(bench.split_whitespace())
            .output()
            .unwrap(),
    );
    let two = bench_row(
        Command::new("mpirun")
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", bin])
            .args(bench.split_whitespace())
            .args(["--comm", "mpi", "--strategy", "ddp", "--world-size", "2"])
            .output()
            .unwrap(),
    );
    for key in ["matmul_peak_gflops", "hardware_peak_gflops", "peak_gflops"] {
        let (a, b) = (one[key].as_f64().unwrap(), two[key].as_f64().unwrap());
        assert!(
            (b - 2.0 * a).abs() <= 1e-9 * a,
            "{key}: {b} under mpirun, {a} alone"
        );
    }
}

/// Processes that share CPUs share their peak: two processes bound to
/// nothing, each with a thread a CPU, state the peak one process of the
/// same threads states for two thread ranks (they stated twice it, and 4
/// processes of 2 threads on 2 CPUs 4 times: MFU 4.7% where thread ranks
/// read 18%).
#[cfg(feature = "mpi")]
#[test]
fn bench_under_mpirun_counts_shared_cpus_once() {
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let cache = run_dir("mpi-shared-cpus-cache");
    let bench = "bench --model tiny --batch-size 2 --seq-len 8 --steps 1 --warmup 0 --json \
                 --strategy ddp --world-size 2";
    let threads = bench_row(
        Command::new(bin)
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(bench.split_whitespace())
            .output()
            .unwrap(),
    );
    let processes = bench_row(
        Command::new("mpirun")
            .env("DISTGPT_CACHE_DIR", &cache)
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
            ])
            .args(["-np", "2", bin])
            .args(bench.split_whitespace())
            .args(["--comm", "mpi"])
            .output()
            .unwrap(),
    );
    for key in ["matmul_peak_gflops", "hardware_peak_gflops", "peak_gflops"] {
        let (a, b) = (
            threads[key].as_f64().unwrap(),
            processes[key].as_f64().unwrap(),
        );
        assert!(
            (b - a).abs() <= 1e-9 * a,
            "{key}: {b} as processes, {a} as thread ranks"
        );
    }
}

/// Under mpirun a rank is a process of its own: `bench --profile` counts
/// that rank's kernels (the model's calls once, not the world's) and states
/// their rate against the process's peak (`--peak-tflops 1`, a process's
/// as the probe measures it: 1,000 GFLOP/s each), where thread ranks share
/// one process's profile and the whole peak (`known_answers`).
#[cfg(feature = "mpi")]
#[test]
fn bench_profile_under_mpirun_counts_a_ranks_kernels_against_its_share_of_the_peak() {
    let bin = env!("CARGO_BIN_EXE_distgpt");
    let bench = "bench --comm mpi --strategy ddp --world-size 2 --model tiny --batch-size 8 \
                 --seq-len 32 --steps 2 --warmup 1 --profile --json --peak-tflops 1";
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", bin])
        .args(bench.split_whitespace())
        .output()
        .unwrap();
    let (said, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}");
    let rows: Vec<serde_json::Value> = said
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "one row, rank 0's: {said}");
    // rank 0's kernels alone: half the batch's FLOPs
    profile::assert_profile_counts_tiny(&rows[0], 1.0, 0.5, "ddp x2 under mpirun");
    let kernels = rows[0]["profile"]["kernels"].as_array().unwrap();
    let mut rated = 0;
    for k in kernels {
        if let Some(gflops) = k["gflops"].as_f64() {
            let of_peak = k["of_peak"].as_f64().unwrap();
            let want = gflops / 1000.0;
            assert!((of_peak - want).abs() <= 1e-9 * want, "{k}");
            rated += 1;
        }
    }
    assert!(rated >= 4, "{kernels:?}");
}

#[test]
fn every_old_spelling_still_works_says_the_new_one_and_stays_out_of_help() {
    let dir = run_dir("old-spellings");
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    let note = |out: &Output, old: &str, new: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        let want = format!("`{old}` is the old spelling of `{new}`");
        assert_eq!(err.matches(&want).count(), 1, "{err}");
    };
    // train --peak-gflops G: --peak-tflops G/1000
    let mut args = vec![
        "train",
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
    ];
    args.extend_from_slice(&["--steps", "2", "--quiet", "--sample-tokens", "0"]);
    args.extend_from_slice(&["--peak-gflops", "250", "--out", run_s]);
    let train = succeeded(distgpt(&args));
    note(&train, "--peak-gflops G", "--peak-tflops G/1000");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("run.json")).unwrap()).unwrap();
    assert_eq!(record["peak_flops"].as_f64(), Some(250e9));

    // generate --run RUN: generate RUN, the same text
    let sample = |args: &[&str]| {
        let mut all = vec!["generate"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--tokens", "8", "--prompt", "A", "--seed", "3"]);
        succeeded(distgpt(&all))
    };
    let old = sample(&["--run", run_s]);
    note(&old, "generate --run RUN", "generate RUN");
    assert_eq!(old.stdout, sample(&[run_s]).stdout);

    // export --run RUN: export RUN
    let hf = dir.join("hf");
    let export = succeeded(distgpt(&[
        "export",
        "--run",
        run_s,
        "--out",
        hf.to_str().unwrap(),
    ]));
    note(&export, "export --run RUN", "export RUN");
    assert!(hf.join("config.json").is_file() && hf.join("model.safetensors").is_file());

    // bench --peak-gflops G
    let mut args = vec![
        "bench",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--seq-len",
        "8",
    ];
    args.extend_from_slice(&[
        "--steps",
        "1",
        "--warmup",
        "0",
        "--json",
        "--peak-gflops",
        "40",
    ]);
    let bench = succeeded(distgpt(&args));
    note(&bench, "--peak-gflops G", "--peak-tflops G/1000");
    let row: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    assert_eq!(row["peak_gflops"].as_f64(), Some(40.0));

    // both spellings at once is refused; the old ones are not in --help
    let both = distgpt(&["generate", run_s, "--run", run_s]);
    assert!(!both.status.success());
    for (cmd, old) in [
        ("generate", "--run"),
        ("export", "--run"),
        ("train", "--peak-gflops"),
        ("bench", "--peak-gflops"),
    ] {
        let help = succeeded(distgpt(&[cmd, "--help"]));
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(
            !text.contains(&format!("{old} ")),
            "{cmd} --help shows {old}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn counts_take_the_noun_their_number_needs() {
    let dir = run_dir("plural");
    let train = train_tiny(
        dir.to_str().unwrap(),
        &["--steps", "1", "--sample-tokens", "0"],
    );
    let err = String::from_utf8_lossy(&train.stderr);
    assert!(err.contains("on 1 rank, tp 1"), "{err}");
    assert!(!err.contains("(s)"), "{err}");
    let mut args = vec![
        "--threads",
        "1",
        "bench",
        "--model",
        "tiny",
        "--batch-size",
        "2",
    ];
    args.extend_from_slice(&["--seq-len", "8", "--steps", "1", "--warmup", "0"]);
    args.extend_from_slice(&["--peak-tflops", "0.1"]);
    let bench = succeeded(distgpt(&args));
    let out = String::from_utf8_lossy(&bench.stdout);
    assert!(out.contains("batch 2 x 8, 1 thread:"), "{out}");
    assert!(!out.contains("(s)"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each `--help` section's flags, by heading.
fn help_sections(command: &str) -> Vec<(String, Vec<String>)> {
    let out = succeeded(distgpt(&[command, "--help"]));
    let mut sections: Vec<(String, Vec<String>)> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(heading) = line
            .strip_suffix(':')
            .filter(|h| !h.starts_with(' ') && h.chars().next().is_some_and(char::is_uppercase))
        {
            sections.push((heading.to_string(), Vec::new()));
        } else if let Some(flag) = line
            .trim_start()
            .split([' ', ','])
            .find(|w| w.starts_with("--"))
            .filter(|_| line.starts_with("  ") && line.trim_start().starts_with('-'))
        {
            if let Some((_, flags)) = sections.last_mut() {
                flags.push(flag.to_string());
            }
        }
    }
    sections
}

/// The shared groups' headings hold their own flags only: a command's own
/// flags after a group (bench's batch and steps, plan's world sizes) are
/// not filed under it.
#[test]
fn help_files_each_flag_under_its_own_heading() {
    let groups: [(&str, &[&str]); 3] = [
        (
            "Model",
            &[
                "--model",
                "--n-layer",
                "--n-head",
                "--n-embd",
                "--block-size",
                "--task",
            ],
        ),
        (
            "Parallelism",
            &[
                "--strategy",
                "--world-size",
                "--tp",
                "--pp",
                "--schedule",
                "--virtual-stages",
                "--recompute",
                "--precision",
                "--offload",
                "--offload-serial",
                "--comm",
                "--comm-timeout",
            ],
        ),
        ("Device", &["--device", "--opencl-device", "--cuda-device"]),
    ];
    for command in ["train", "bench", "plan", "eval", "generate", "prune"] {
        for (heading, flags) in help_sections(command) {
            let Some((_, own)) = groups.iter().find(|(g, _)| *g == heading) else {
                continue;
            };
            for flag in flags {
                assert!(
                    own.contains(&flag.as_str()),
                    "`{command} --help` files {flag} under {heading}"
                );
            }
        }
    }
}

/// A preset no family has is named with every family's presets.
#[test]
fn an_unknown_preset_lists_every_familys() {
    let out = distgpt(&["train", "--model", "gpt3", "--steps", "1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown model preset 'gpt3'"), "{err}");
    assert!(
        err.contains("gpt2-xl") && err.contains("bert-minilm"),
        "{err}"
    );
}

/// `--quiet` prints the summary only: no bar, no log lines, no sample.
#[test]
fn quiet_prints_the_summary_and_no_sample() {
    let dir = run_dir("quiet");
    let out = train_tiny(
        dir.to_str().unwrap(),
        &["--steps", "2", "--sample-tokens", "50", "--quiet"],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("steps 0..2 in"), "{text}");
    assert!(!text.contains("sample"), "{text}");
    let loud = train_tiny(
        run_dir("loud").to_str().unwrap(),
        &["--steps", "2", "--sample-tokens", "50"],
    );
    assert!(String::from_utf8_lossy(&loud.stdout).contains("--- sample ---"));
}

/// An input of the wrong kind is named for what it is, not as a missing file.
#[test]
fn wrong_kind_inputs_say_what_they_are() {
    let dir = run_dir("wrong-kind");
    let (bert, set) = tiny_bert_and_labelled_set(&dir);
    let gpt = dir.join("gpt");
    train_tiny(gpt.to_str().unwrap(), &["--steps", "1", "--quiet"]);
    let text = dir.join("notes.txt");
    std::fs::write(&text, "some text\n").unwrap();
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    let cases: [(Vec<String>, &str); 3] = [
        (
            vec![
                "train".into(),
                "--task".into(),
                "classify".into(),
                "--init-from".into(),
                s(&gpt),
                "--data".into(),
                s(&set),
            ],
            "is a GPT-2 model, and --task classify trains a BERT: give --init-from a Hugging Face BERT folder",
        ),
        (
            vec![
                "train".into(),
                "--task".into(),
                "classify".into(),
                "--init-from".into(),
                s(&bert),
                "--data".into(),
                s(&text),
            ],
            "is a file, not a labelled set",
        ),
        (
            vec!["eval".into(), s(&gpt), "--data".into(), s(&set)],
            "is a labelled set (labels.json, train/val/test.jsonl), which a classifier reads",
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = distgpt(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
}

/// Where a sharded strategy's memory has "other" bytes, bench says what they are.
#[test]
fn bench_says_what_a_sharded_strategys_other_bytes_are() {
    for (strategy, says) in [("zero1", Some("zero1's \"other\" is")), ("ddp", None)] {
        let out = bench_one_step("tiny", strategy, "2", "16", &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        match says {
            Some(s) => assert!(text.contains(s), "{strategy}: {text}"),
            None => assert!(!text.contains("\"other\" is"), "{strategy}: {text}"),
        }
    }
}

/// A run states MFU against the CPU's hardware peak, kept once per machine
/// and thread count: the first run on a machine says that it measures it
/// (never silently), later runs read it.
#[test]
fn the_first_run_says_it_measures_the_peak_and_later_runs_reuse_it() {
    let cache = run_dir("peak-cache");
    let run = |out: &std::path::Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(["--threads", "2", "train", "--model", "tiny", "--steps", "1"])
            .args(["--batch-size", "2", "--seq-len", "16", "--out"])
            .arg(out)
            .output()
            .unwrap();
        let out = succeeded(out);
        (
            String::from_utf8_lossy(&out.stderr).to_string(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let (said, _) = run(&run_dir("peak-first"));
    assert!(said.contains("measuring the peak of"), "{said}");
    let second = run_dir("peak-second");
    let (again, _) = run(&second);
    assert!(!again.contains("measuring"), "{again}");
    // the run's header (on stderr without a terminal) names the peak
    if is_x86_feature_detected!("fma") {
        assert!(again.contains("(hardware: "), "{again}");
        // one MFU: bench and devices state it against the peak train does
        let distgpt_cached = |args: &[&str]| {
            let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
                .env("DISTGPT_CACHE_DIR", &cache)
                .args(["--threads", "2"])
                .args(args)
                .output()
                .unwrap();
            succeeded(out).stdout
        };
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(second.join("run.json")).unwrap())
                .unwrap();
        let trained = record["peak_flops"].as_f64().unwrap() / 1e9;
        // two thread ranks of a process of one thread run on a thread each:
        // two threads, whose peak is the two-thread run's (it was one
        // thread's, the MFU twice too high)
        let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(["--threads", "1", "bench", "--model", "tiny", "--steps", "1"])
            .args(["--strategy", "ddp", "--world-size", "2", "--json"])
            .output()
            .unwrap();
        let ranks: serde_json::Value = serde_json::from_slice(&succeeded(out).stdout).unwrap();
        assert_eq!(ranks["threads"], 2, "{ranks}");
        // a run of thread ranks records the peak its MFU is stated against,
        // all of its ranks' (it recorded a rank's share: half)
        let ddp = run_dir("peak-ddp");
        let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .env("DISTGPT_CACHE_DIR", &cache)
            .args(["--threads", "2", "train", "--model", "tiny", "--steps", "1"])
            .args([
                "--strategy",
                "ddp",
                "--world-size",
                "2",
                "--batch-size",
                "2",
            ])
            .args(["--seq-len", "16", "--out"])
            .arg(&ddp)
            .output()
            .unwrap();
        succeeded(out);
        let record: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(ddp.join("run.json")).unwrap()).unwrap();
        let recorded = record["peak_flops"].as_f64().unwrap() / 1e9;
        assert!(
            (recorded / trained - 1.0).abs() < 1e-9,
            "{recorded} vs {trained}"
        );
        let ranks_peak = ranks["peak_gflops"].as_f64().unwrap();
        assert!(
            (ranks_peak / trained - 1.0).abs() < 1e-9,
            "{ranks_peak} vs {trained}"
        );
        let bench = distgpt_cached(&["bench", "--model", "tiny", "--steps", "1", "--json"]);
        let j: serde_json::Value = serde_json::from_slice(&bench).unwrap();
        let benched = j["peak_gflops"].as_f64().unwrap();
        assert!(
            (benched / trained - 1.0).abs() < 1e-9,
            "{benched} vs {trained}"
        );
        assert_eq!(j["mfu"], j["mfu_hardware"], "{j}");
        assert!(j["matmul_peak_gflops"].as_f64().unwrap() > 0.0, "{j}");
        let devices = String::from_utf8(distgpt_cached(&["devices"])).unwrap();
        assert!(
            devices.contains(&format!(
                "cpu hardware peak (what MFU is stated against): {trained:.0} GFLOP/s"
            )),
            "{devices}"
        );
    }
}

/// bench's counted bytes (every rank of the process) account for the
/// process's resident memory above its start within 10%: ddp's too, whose
/// thread ranks' all-reduce held an uncounted copy of each rank's
/// gradient (15.7% off).
#[test]
fn counted_memory_accounts_for_the_processs_resident_memory() {
    for (strategy, world) in [("single", "1"), ("zero2", "2"), ("ddp", "2")] {
        let out = bench_one_step("shakespeare-char", strategy, world, "256", &["--json"]);
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let (Some(start), Some(peak)) =
            (j["rss_start_bytes"].as_f64(), j["peak_rss_bytes"].as_f64())
        else {
            eprintln!("no /proc/self/status here: nothing to compare");
            return;
        };
        let counted: f64 = j["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_bytes"]["total"].as_f64().unwrap())
            .sum();
        let grew = peak - start;
        let off = (grew - counted).abs() / grew;
        assert!(
            off <= 0.10,
            "{strategy} x{world}: counted {counted:.0} bytes, the process grew {grew:.0} ({:.1}% off)",
            100.0 * off
        );
    }
}

/// A rank on two threads runs its batch in two parts, and bench says so;
/// on one thread, or as one of two thread ranks on two, it does not.
#[test]
fn bench_says_when_a_rank_runs_its_batch_in_parts() {
    for (threads, strategy, world, parts) in [
        ("2", "single", "1", 2),
        ("1", "single", "1", 1),
        ("2", "ddp", "2", 1),
    ] {
        let mut args = vec!["--threads", threads, "bench", "--model", "tiny"];
        args.extend(["--strategy", strategy, "--world-size", world]);
        args.extend(["--batch-size", "4", "--seq-len", "16", "--steps", "1"]);
        args.extend(["--warmup", "0", "--peak-tflops", "0.1"]);
        let text = String::from_utf8_lossy(&succeeded(distgpt(&args)).stdout).to_string();
        let says = text.contains("2 parts a rank");
        assert_eq!(says, parts == 2, "{threads} threads, {strategy}: {text}");
        args.push("--json");
        let j: serde_json::Value =
            serde_json::from_slice(&succeeded(distgpt(&args)).stdout).unwrap();
        assert_eq!(j["parts"], parts, "{threads} threads, {strategy}: {j}");
    }
}

/// One bench step of `model` at batch 4 x `seq`, no warm-up, at a stated peak (no probe).
fn bench_one_step(model: &str, strategy: &str, world: &str, seq: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "bench",
        "--model",
        model,
        "--strategy",
        strategy,
        "--world-size",
        world,
        "--batch-size",
        "4",
        "--seq-len",
        seq,
        "--steps",
        "1",
        "--warmup",
        "0",
        "--peak-tflops",
        "0.1",
    ];
    args.extend_from_slice(extra);
    succeeded(distgpt(&args))
}

/// A second command's output into a folder that holds the first's results
/// is refused by name, not mixed in or replaced, unless `--overwrite`.
#[test]
fn an_output_folder_holding_another_commands_results_is_refused() {
    let dir = run_dir("outputs-held");
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    train_tiny(run_s, &["--steps", "2", "--quiet"]);
    let out = dir.join("out");
    let out_s = out.to_str().unwrap();
    let commands: [&[&str]; 4] = [
        &["quantize", run_s, "--out", out_s],
        &["export", run_s, "--out", out_s],
        &["checkpoint", "consolidate", run_s, "--out", out_s],
        &["plot", run_s, "--out", out_s],
    ];
    succeeded(distgpt(commands[0]));
    for args in commands {
        let o = distgpt(args);
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && said.contains(&format!("--out {out_s} already holds")),
            "{args:?}: {said}"
        );
        succeeded(distgpt(&[args, &["--overwrite"]].concat()));
    }
    // into a run's own folder: named as such
    let o = distgpt(&["quantize", run_s, "--out", run_s]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(said.contains("is the input"), "{said}");
    let plans = dir.join("plans");
    let plan = ["plan", "--model", "tiny", "--world-size", "2", "--plot"];
    succeeded(distgpt(&[&plan[..], &[plans.to_str().unwrap()]].concat()));
    let o = distgpt(&[&plan[..], &[plans.to_str().unwrap()]].concat());
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        said.contains("--plot") && said.contains("already holds"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several prompts each stop at the model's block, and the command says
/// so when that leaves a prompt short of `--tokens` (one prompt slides on).
#[test]
fn prompts_cut_short_by_the_block_are_named() {
    let dir = run_dir("prompts-at-the-block");
    let run = dir.join("run");
    let run_s = run.to_str().unwrap();
    train_tiny(run_s, &["--steps", "1", "--quiet", "--sample-tokens", "0"]);
    let block: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("model.json")).unwrap()).unwrap();
    let block = block["config"]["block_size"].as_u64().unwrap() as usize;
    let tokens = (block + 5).to_string();
    let two = ["generate", run_s, "--prompt", "ab", "--prompt", "c"];
    let o = succeeded(distgpt(&[&two[..], &["--tokens", &tokens]].concat()));
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    for (r, p) in [(0, 2), (1, 1)] {
        let note = format!(
            "prompt {r} stopped at the model's block of {block} positions ({p} prompt + {} new tokens)",
            block - p + 1
        );
        assert!(said.contains(&note), "{said}");
    }
    let o = succeeded(distgpt(&[&two[..], &["--tokens", "3"]].concat()));
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!said.contains("stopped at"), "{said}");
    let o = succeeded(distgpt(&[
        "generate", run_s, "--prompt", "ab", "--tokens", &tokens,
    ]));
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!said.contains("stopped at"), "one prompt slides on: {said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `generate` with no prompt starts a character model whose text had no
/// newline at its first character, as the run's own sample does: it
/// refused the newline it had chosen itself ("character '\\n' ... is not
/// in this model's character vocabulary").
#[test]
fn generate_without_a_prompt_starts_a_vocabulary_without_a_newline() {
    let dir = run_dir("no-newline");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("ab.txt");
    std::fs::write(&text, "ab".repeat(400)).unwrap();
    let out = dir.join("run");
    let out = out.to_str().unwrap();
    train_tiny(out, &["--steps", "1", "--data", text.to_str().unwrap()]);
    let generated = succeeded(distgpt(&["generate", out, "--tokens", "5"]));
    let text = String::from_utf8_lossy(&generated.stdout);
    let text = text.trim_end();
    assert!(
        text.len() >= 5 && text.chars().all(|c| "ab".contains(c)),
        "{text:?}"
    );
}

/// One prompt that meets the end of text is not said to have stopped at
/// the block, though prompt and output fill it: it would have slid on. The
/// model is made to say `<|endoftext|>` whatever it reads (every block's
/// weights 0, so the stream stays 0 and ln_f's bias of ones reaches the
/// head, where only the end of text's row is not 0).
#[test]
fn one_prompt_ended_by_the_end_of_text_is_not_said_to_stop_at_the_block() {
    use distgpt::store::{write_safetensors, Data};
    use safetensors::tensor::Dtype;
    let dir = run_dir("eot-at-the-block");
    std::fs::create_dir_all(&dir).unwrap();
    let (vocab, c, block) = (50257usize, 8usize, 8usize);
    let config = serde_json::json!({
        "model_type": "gpt2", "activation_function": "gelu_new",
        "n_layer": 1, "n_head": 1, "n_embd": c, "n_positions": block, "vocab_size": vocab,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tensor = |name: &str, shape: &[usize], fill: f32| {
        let n: usize = shape.iter().product();
        let bytes = (0..n).flat_map(|_| fill.to_le_bytes()).collect();
        (
            name.to_string(),
            Dtype::F32,
            shape.to_vec(),
            Data::Bytes(bytes),
        )
    };
    let mut wte = vec![0f32; vocab * c];
    wte[(vocab - 1) * c..].fill(10.0);
    let wte_bytes = wte.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut tensors = vec![
        (
            "transformer.wte.weight".to_string(),
            Dtype::F32,
            vec![vocab, c],
            Data::Bytes(wte_bytes),
        ),
        tensor("transformer.wpe.weight", &[block, c], 0.0),
        tensor("transformer.ln_f.weight", &[c], 0.0),
        tensor("transformer.ln_f.bias", &[c], 1.0),
    ];
    for (name, shape) in [
        ("ln_1.weight", vec![c]),
        ("ln_1.bias", vec![c]),
        ("attn.c_attn.weight", vec![c, 3 * c]),
        ("attn.c_attn.bias", vec![3 * c]),
        ("attn.c_proj.weight", vec![c, c]),
        ("attn.c_proj.bias", vec![c]),
        ("ln_2.weight", vec![c]),
        ("ln_2.bias", vec![c]),
        ("mlp.c_fc.weight", vec![c, 4 * c]),
        ("mlp.c_fc.bias", vec![4 * c]),
        ("mlp.c_proj.weight", vec![4 * c, c]),
        ("mlp.c_proj.bias", vec![c]),
    ] {
        tensors.push(tensor(&format!("transformer.h.0.{name}"), &shape, 0.0));
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    // eight tokens, the whole block: "a" then " a" seven times
    let prompt = format!("a{}", " a".repeat(block - 1));
    let o = succeeded(distgpt(&[
        "generate",
        dir.to_str().unwrap(),
        "--prompt",
        &prompt,
        "--tokens",
        "5",
    ]));
    let (out, said) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(
        out.lines().next(),
        Some(prompt.as_str()),
        "nothing generated: {out}"
    );
    assert!(said.contains("[0 tokens in"), "{said}");
    assert!(!said.contains("stopped at"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tensorboard` names one folder wherever the run is resumed from:
/// run.json keeps it absolute, as it keeps --data, so a resume from another
/// directory writes its events beside the first invocation's.
#[test]
fn a_resume_from_elsewhere_writes_tensorboard_events_into_the_same_folder() {
    let dir = run_dir("tensorboard-elsewhere");
    let (a, b) = (dir.join("a"), dir.join("b"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d).unwrap();
    }
    let run = a.join("run");
    let train = |at: &Path, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .current_dir(at)
            .args(args)
            .output()
            .unwrap()
    };
    let tiny = [
        "train",
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
    ];
    let first = [
        "--steps",
        "2",
        "--stop-after",
        "1",
        "--quiet",
        "--tensorboard",
        "tb",
    ];
    let stopped = train(&a, &[&tiny[..], &first, &["--out", "run"]].concat());
    assert_eq!(
        stopped.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&stopped.stderr)
    );
    succeeded(train(
        &b,
        &["train", "--resume", run.to_str().unwrap(), "--quiet"],
    ));
    assert!(
        !b.join("tb").exists(),
        "the resume wrote its events under b/tb"
    );
    let events = std::fs::read_dir(a.join("tb")).unwrap().count();
    assert_eq!(events, 2, "an event file an invocation in a/tb");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `data prepare --input` is a text file: a folder (of shards) is refused,
/// not read with its own tokenizer whatever --tokenizer asks.
#[test]
fn data_prepare_refuses_a_folder_as_its_input() {
    let dir = run_dir("prepare-folder");
    let shards = dir.join("shards");
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question. ".repeat(40),
    )
    .unwrap();
    let (text, shards_s) = (text.to_str().unwrap(), shards.to_str().unwrap());
    succeeded(distgpt(&[
        "data", "prepare", "--input", text, "--out", shards_s,
    ]));
    let again = dir.join("again");
    let said = refused(&[
        "data",
        "prepare",
        "--input",
        shards_s,
        "--out",
        again.to_str().unwrap(),
    ]);
    assert!(
        said.contains(&format!("--input {shards_s} is a folder")),
        "{said}"
    );
    assert!(!again.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The stderr of a command that must fail.
fn refused(args: &[&str]) -> String {
    let o = distgpt(args);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "{args:?} ran: {said}");
    said
}

/// A flag that only means something with another is refused, naming both,
/// when the other is absent or says otherwise.
#[test]
fn flags_that_contradict_each_other_are_refused_naming_both() {
    let dir = run_dir("contradictions");
    let out = dir.to_str().unwrap();
    let train = ["train", "--model", "tiny", "--steps", "1", "--out", out];
    for (extra, says) in [
        (&["--schedule", "gpipe"][..], ["--schedule gpipe", "--pp 2"]),
        (
            &["--offload-serial"],
            ["--offload-serial", "--offload is none"],
        ),
        (
            &["--device", "opencl", "--cuda-device", "3"],
            ["--cuda-device 3", "--device is opencl"],
        ),
        (
            &["--device", "cpu", "--opencl-device", "5"],
            ["--opencl-device 5", "--device is cpu"],
        ),
    ] {
        let said = refused(&[&train[..], extra].concat());
        assert!(says.iter().all(|s| said.contains(s)), "{extra:?}: {said}");
    }
    let said = refused(&["bench", "--model", "tiny", "--weights", "int8"]);
    assert!(
        said.contains("--weights int8") && said.contains("--generate"),
        "{said}"
    );
}

/// A figure `plot` cannot write is named with the OS's reason, as an I/O
/// error (a full disk reads the same), not as bad input in debug words.
#[test]
fn a_figure_that_cannot_be_written_is_named_with_the_reason() {
    let dir = run_dir("plot-unwritable");
    train_tiny(dir.to_str().unwrap(), &["--steps", "2", "--quiet"]);
    let blocked = dir.join("plots").join("loss.png");
    std::fs::create_dir_all(&blocked).unwrap();
    let said = refused(&["plot", dir.to_str().unwrap()]);
    assert!(
        said.contains(&format!(
            "{}: Is a directory (os error 21)",
            blocked.display()
        )) && !said.contains("bad input"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn consolidating_a_folder_without_a_checkpoint_says_there_is_nothing_to_consolidate() {
    let dir = run_dir("consolidate-empty");
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("out");
    let said = refused(&[
        "checkpoint",
        "consolidate",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        said.contains("nothing to consolidate")
            && said.contains(&format!("{} holds no complete checkpoint", dir.display()))
            && !said.contains("resume"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder holding files but no run is not offered `--resume` or
/// `--overwrite`, which would both fail there.
#[test]
fn a_folder_without_a_run_is_not_offered_resume_or_overwrite() {
    let dir = run_dir("not-a-run");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let o = train_tiny_output(dir.to_str().unwrap(), &["--steps", "1"]);
    let said = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success()
            && said.contains("is not empty and holds no run")
            && !said.contains("--resume"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A matrix left empty says why its cells were skipped in the error itself.
#[test]
fn an_empty_compare_matrix_says_why_its_cells_were_skipped() {
    let dir = run_dir("compare-none-left");
    let said = refused(&[
        "compare",
        "--models",
        "tiny",
        "--strategies",
        "tp",
        "--world-sizes",
        "3",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let error = said.lines().find(|l| l.starts_with("error:")).unwrap_or("");
    // the batches skipped for one reason on one line, the reason said once
    assert!(
        error.contains("no valid run in the matrix")
            && error.contains("skipped tiny tp x3 batch 8, 16, 32: n_head (2) is not divisible by the tensor-parallel size 3")
            && error.matches("invalid configuration").count() == 1
            && !error.contains("more"),
        "{said}"
    );
    // the first three cells' reasons, then how many more
    let worlds = [
        "--world-sizes",
        "3,5,7,9",
        "--batch-sizes",
        "8",
        "--out",
        dir.to_str().unwrap(),
    ];
    let said = refused(
        &[
            &["compare", "--models", "tiny", "--strategies", "tp"],
            &worlds[..],
        ]
        .concat(),
    );
    let error = said.lines().find(|l| l.starts_with("error:")).unwrap_or("");
    assert!(
        error.contains("skipped tiny tp x7 batch 8")
            && !error.contains("tp x9")
            && error.ends_with("; and 1 more"),
        "{said}"
    );
    // one rank of a parallel strategy is named as skipped (it said only
    // "no valid run in the matrix")
    let one = ["--world-sizes", "1", "--out", dir.to_str().unwrap()];
    let said = refused(&[&["compare", "--strategies", "fsdp"], &one[..]].concat());
    assert!(
        said.contains("fsdp x1: one rank of a parallel strategy"),
        "{said}"
    );
    // a training setting every run refuses is refused before the matrix is
    // measured or its folder made (it calibrated, announced 36 runs and
    // left an empty folder)
    let fresh = run_dir("compare-lr-0");
    let said = refused(&["compare", "--lr", "0", "--out", fresh.to_str().unwrap()]);
    assert!(
        said.contains("--lr 0 must be a positive number")
            && !said.contains("estimated")
            && !fresh.exists(),
        "{said}"
    );
}

/// A matrix's list that names a value twice is refused: its cells would
/// run twice under one name.
#[test]
fn compare_lists_name_each_value_once() {
    let dir = run_dir("compare-twice");
    let out = dir.to_str().unwrap();
    for (flag, list, value) in [
        ("--strategies", "single,ddp,single", "single"),
        ("--world-sizes", "2,4,2", "2"),
        ("--batch-sizes", "8,8", "8"),
        ("--models", "tiny,tiny", "tiny"),
    ] {
        let said = refused(&["compare", flag, list, "--steps", "1", "--out", out]);
        assert!(
            said.contains(&format!("{flag} names {value} twice")),
            "{flag}: {said}"
        );
    }
    let said = refused(&["compare", "--models", ",", "--steps", "1", "--out", out]);
    assert!(said.contains("--models holds an empty name"), "{said}");
    // --quick sets the sizes and the length: a size or length beside it was
    // silently replaced (60 steps on 2 and 4 ranks for `--steps 2
    // --world-sizes 2`)
    for given in [
        &["--steps", "2"][..],
        &["--epochs", "1"],
        &["--world-sizes", "2"],
        &["--batch-sizes", "8"],
    ] {
        let said = refused(&[&["compare", "--quick", "--out", out][..], given].concat());
        assert!(
            said.contains(&format!("'--quick' cannot be used with '{}", given[0])),
            "{given:?}: {said}"
        );
    }
    assert!(!dir.exists(), "nothing was written");
}

/// A syntax error in a --config file names the file and its line.
#[test]
fn a_config_file_syntax_error_names_the_file_and_line() {
    let file = run_dir("config-syntax").with_extension("toml");
    std::fs::write(&file, "model = \"tiny\"\nmodel = \"gpt2\"\n").unwrap();
    let said = refused(&["train", "--config", file.to_str().unwrap()]);
    assert!(
        said.contains(&format!("{} is not valid TOML", file.display()))
            && said.contains("line 2")
            && said.contains("duplicate key"),
        "{said}"
    );
    let _ = std::fs::remove_file(&file);
}

/// A --config setting that needs another names the one it needs, as the
/// command line does (`from-step` without `resume`: "the following
/// required arguments were not provided" named nothing).
#[test]
fn a_config_setting_that_needs_another_names_it() {
    let file = run_dir("config-needs").with_extension("toml");
    std::fs::write(&file, "model = \"tiny\"\nfrom-step = 3\n").unwrap();
    let said = refused(&["train", "--config", file.to_str().unwrap()]);
    assert!(
        said.contains("were not provided: --resume <RUN_OR_CHECKPOINT> (a setting from"),
        "{said}"
    );
    let _ = std::fs::remove_file(&file);
}

/// `train`'s memory lines show every category the peak counts: zero1's
/// update scratch is "other" (a fifth of rank 0's peak here), and the
/// lines left it out, so their parts fell short of the total.
#[test]
fn trains_memory_lines_show_the_other_category_the_peak_counts() {
    let dir = run_dir("memory-other");
    let out = dir.to_str().unwrap();
    let train = train_tiny(
        out,
        &[
            "--steps",
            "1",
            "--strategy",
            "zero1",
            "--world-size",
            "2",
            "--sample-tokens",
            "0",
        ],
    );
    let text = String::from_utf8_lossy(&train.stdout);
    let jsonl = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let record: serde_json::Value = serde_json::from_str(jsonl.lines().last().unwrap()).unwrap();
    let other = record["memory"]["peak_bytes"]["other"].as_u64().unwrap();
    assert!(other > 0, "{record}");
    let kib = format!("other {:.1} KiB", other as f64 / 1024.0);
    let line = text.lines().find(|l| l.starts_with("peak memory (rank 0)"));
    assert!(line.is_some_and(|l| l.contains(&kib)), "{kib}: {text}");
    for rank in ["rank 0: peak", "rank 1: peak"] {
        let line = text.lines().find(|l| l.starts_with(rank));
        assert!(
            line.is_some_and(|l| l.contains(", other ")),
            "{rank}: {text}"
        );
    }
}

/// `bench`'s counts at the edge of their type, and a batch no machine
/// holds, are refused in words: they panicked on an overflowing sum or
/// aborted in the allocator (76.8 GB for the KV cache).
#[test]
fn bench_refuses_counts_past_their_range_and_a_cache_past_memory() {
    let max = u64::MAX.to_string();
    for (args, says) in [
        (
            &["--generate", &*max][..],
            "--generate 18446744073709551615: a 1-token prompt leaves room for 1 to 64",
        ),
        (&["--warmup", &*max][..], "add up past any count of steps"),
        (
            // flags of training steps, which it runs none of (taken and ignored)
            &["--generate", "5", "--seq-len", "16", "--precision", "bf16"][..],
            "--seq-len, --precision set training steps, which --generate runs none of",
        ),
        (
            &["--generate", "65"][..],
            "a 1-token prompt leaves room for 1 to 64",
        ),
        (
            &["--generate", "5", "--warmup", &*max][..],
            "add up past any count of steps",
        ),
        (
            // 2.6 PB of cache, no machine's memory: 10^12 rows of 2 layers'
            // keys and values, 5 positions (the last new token is never
            // fed) of 32 floats (2,560 bytes a row)
            &["--generate", "5", "--batch-size", "1000000000000"][..],
            "its KV cache needs at least 2328.3 TiB",
        ),
        (
            // a training step past memory, as train refuses it (the kernel's
            // OOM killer ended the process, rc 137)
            &["--batch-size", "100000000", "--seq-len", "16"][..],
            "1 thread rank needs about",
        ),
    ] {
        let line = [&["bench", "--model", "tiny"][..], args].concat();
        let said = refused(&line);
        assert!(
            said.contains(says) && !said.contains("panicked"),
            "{args:?}: {said}"
        );
    }
    // the block is the prompt's and the new tokens' but the last: 64 new
    // tokens after 1, the last drawn from the whole block
    let line = [
        "bench",
        "--model",
        "tiny",
        "--generate",
        "64",
        "--batch-size",
        "1",
    ];
    succeeded(distgpt(
        &[&line[..], &["--steps", "1", "--warmup", "0"]].concat(),
    ));
}

/// A named device's peak and memory bandwidth given on the command line
/// take the datasheet's place, as its memory does (both were accepted and
/// ignored).
#[test]
fn plan_takes_a_named_devices_peak_and_bandwidth_from_the_command_line() {
    let plan = |extra: &[&str]| {
        let line = [&["plan", "--model", "gpt2", "--device", "h100"][..], extra].concat();
        String::from_utf8_lossy(&succeeded(distgpt(&line)).stdout).into_owned()
    };
    let datasheet = plan(&[]);
    assert!(
        datasheet.contains("H100 (495 TFLOP/s peak, 80 GB)"),
        "{datasheet}"
    );
    let peak = plan(&["--peak-tflops", "1"]);
    assert!(peak.contains("H100 (1 TFLOP/s peak, 80 GB)"), "{peak}");
    let slow = plan(&["--memory-bandwidth-gbs", "1"]);
    assert_ne!(slow, datasheet, "--memory-bandwidth-gbs 1 changed nothing");
    // the CPU is priced from what it measures: a stated figure would
    // disagree with the calibration, so it is refused, not half-applied
    for flag in ["--peak-tflops", "--memory-bandwidth-gbs"] {
        let said = refused(&["plan", "--model", "tiny", "--device", "cpu", flag, "100"]);
        assert!(said.contains("--device cpu measures this CPU's"), "{said}");
    }
}

/// A config file's keys are checked as they are written: a value of the
/// wrong type is refused even where the command line sets the flag too
/// (it was skipped unread), a conflict names the keys the file holds (not
/// clap's `old_peak_gflops`), and a run's `run.json` repeats it whatever
/// its counts (one past 2^63 was written as -1 and refused).
#[test]
fn config_files_are_checked_as_written_and_run_json_repeats_any_count() {
    let dir = run_dir("config-checked");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("c.toml");
    let config = |text: &str, extra: &[&str]| {
        std::fs::write(&file, text).unwrap();
        let line = [&["train", "--config", file.to_str().unwrap()][..], extra].concat();
        refused(&line)
    };
    let said = config(
        "model = \"tiny\"\nbatch-size = true\n",
        &["--batch-size", "2"],
    );
    assert!(
        said.contains("`batch-size` takes one value, a string or a number (got boolean)"),
        "{said}"
    );
    let said = config("peak-gflops = 100\npeak-tflops = 0.1\n", &[]);
    assert!(
        said.contains("`peak-tflops` and `peak-gflops` cannot both be set"),
        "{said}"
    );
    let run = dir.join("run");
    let every = usize::MAX.to_string();
    train_tiny(
        run.to_str().unwrap(),
        &[
            "--steps",
            "1",
            "--checkpoint-every",
            &every,
            "--sample-tokens",
            "0",
            "--quiet",
        ],
    );
    let again = dir.join("again");
    let record = run.join("run.json");
    let (record, again_out) = (record.to_str().unwrap(), again.to_str().unwrap());
    succeeded(distgpt(&[
        "train", "--config", record, "--out", again_out, "--quiet",
    ]));
    let recorded = std::fs::read_to_string(again.join("run.json")).unwrap();
    assert!(
        recorded.contains(&format!("\"checkpoint_every\": {every}")),
        "{recorded}"
    );
}

/// A folder of no shards is said to be one without a note about the
/// tokenizer its shards would be read with first, and a weights file that
/// is a folder is called one (it was "4096 bytes cannot hold ...: the file
/// is truncated").
#[test]
fn a_folder_where_shards_or_weights_should_be_is_named_as_such() {
    let dir = run_dir("folders-for-files");
    let run = dir.join("run");
    train_tiny(
        run.to_str().unwrap(),
        &["--steps", "1", "--sample-tokens", "0", "--quiet"],
    );
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let said = refused(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        empty.to_str().unwrap(),
    ]);
    assert!(
        said.contains("no <name>_train") && !said.contains("note:"),
        "{said}"
    );
    let weights = run.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    std::fs::create_dir(&weights).unwrap();
    let said = refused(&["generate", run.to_str().unwrap(), "--tokens", "2"]);
    assert!(
        said.contains("model.safetensors: is a folder, not a weights file"),
        "{said}"
    );
}

/// Fine-tuning from a classifier of other labels (here its two names in the
/// other order, the ids swapped to match) starts with a fresh classifier,
/// saying so: the old head predicted the old ids, so the first validation
/// loss was far above a fresh head's (the reviewer's run: 6.3, accuracy 0%).
/// The same labels keep it, as `from_pretrained` does.
#[test]
fn a_classifier_of_other_labels_is_fine_tuned_from_a_fresh_head() {
    let dir = run_dir("bert-relabelled");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let flipped = dir.join("flipped");
    std::fs::create_dir_all(&flipped).unwrap();
    for split in ["train", "val", "test"] {
        let text = std::fs::read_to_string(data.join(format!("{split}.jsonl"))).unwrap();
        let swapped = text
            .replace("\"label\":0", "\"label\":x")
            .replace("\"label\":1", "\"label\":0");
        let swapped = swapped.replace("\"label\":x", "\"label\":1");
        std::fs::write(flipped.join(format!("{split}.jsonl")), swapped).unwrap();
    }
    std::fs::write(flipped.join("labels.json"), r#"["spam","ham"]"#).unwrap();
    let train = |from: &Path, set: &Path, out: &str, extra: &[&str]| {
        let (from, set, out) = (from.to_str().unwrap(), set.to_str().unwrap(), dir.join(out));
        let args = [
            "train",
            "--task",
            "classify",
            "--init-from",
            from,
            "--data",
            set,
        ];
        let sizes = ["--batch-size", "4", "--seq-len", "12", "--eval-every", "1"];
        let line = [&args[..], &sizes, extra, &["--out", out.to_str().unwrap()]].concat();
        let o = succeeded(distgpt(&line));
        let jsonl = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let first: serde_json::Value = serde_json::from_str(jsonl.lines().next().unwrap()).unwrap();
        (
            first["val_loss"].as_f64().unwrap(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (_, said) = train(&model, &data, "first", &["--epochs", "30", "--lr", "1e-2"]);
    assert!(!said.contains("fresh classifier"), "{said}");
    let first = dir.join("first");
    let (same, said) = train(&first, &data, "same", &["--steps", "1", "--lr", "1e-9"]);
    assert!(!said.contains("fresh classifier"), "{said}");
    let (other, said) = train(&first, &flipped, "other", &["--steps", "1", "--lr", "1e-9"]);
    assert!(
        said.contains(r#"classifies ["ham", "spam"]"#) && said.contains("fresh classifier"),
        "{said}"
    );
    // its resume continues its own head from the checkpoint, with no note
    let other_dir = dir.join("other");
    let resumed = distgpt(&[
        "train",
        "--resume",
        other_dir.to_str().unwrap(),
        "--steps",
        "2",
    ]);
    let said = String::from_utf8_lossy(&succeeded(resumed).stderr).into_owned();
    assert!(!said.contains("fresh classifier"), "{said}");
    // the kept head all but certain of each answer (loss e^-9): under the
    // swapped names it would be as certain of the wrong one (loss about 9);
    // a fresh head's small weights put the loss near ln 2
    assert!(same < 0.01 && other < 2.0, "kept {same}, fresh {other}");
}

/// `--peak-tflops` is the device's peak on `train` and `bench` alike, as
/// `devices` prints it: thread ranks share this CPU's, so two of them run
/// against 100 GFLOP/s in all (train took it per rank: 200 in all, and
/// an MFU half bench's).
#[test]
fn train_and_bench_take_a_stated_peak_as_the_devices() {
    let dir = run_dir("stated-peak");
    let ddp = [
        "--strategy",
        "ddp",
        "--world-size",
        "2",
        "--peak-tflops",
        "0.1",
    ];
    let out = dir.join("run");
    let mut args = vec![
        "train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--batch-size",
        "4",
    ];
    args.extend_from_slice(&["--seq-len", "16", "--out", out.to_str().unwrap()]);
    args.extend_from_slice(&ddp);
    let train = succeeded(distgpt(&args));
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&train.stdout),
        String::from_utf8_lossy(&train.stderr)
    );
    assert!(
        said.contains("peak 100 GFLOP/s in all (--peak-tflops)"),
        "{said}"
    );
    let mut args = vec![
        "bench",
        "--model",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
    ];
    args.extend_from_slice(&["--steps", "1", "--warmup", "0", "--json"]);
    args.extend_from_slice(&ddp);
    let bench = succeeded(distgpt(&args));
    let row: serde_json::Value = String::from_utf8_lossy(&bench.stdout)
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("a JSON row");
    assert_eq!(row["peak_gflops"].as_f64(), Some(100.0), "{row}");
}

/// `compare --task classify` writes the results.csv its help promises: a
/// row a cell, its scores those of results.json.
#[test]
fn a_classifier_comparison_writes_its_csv() {
    let dir = run_dir("compare-classify-csv");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let out = dir.join("report");
    succeeded(distgpt(&[
        "compare",
        "--task",
        "classify",
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--strategies",
        "single,ddp",
        "--world-sizes",
        "2",
        "--batch-sizes",
        "4",
        "--epochs",
        "1",
        "--seq-len",
        "12",
        "--no-predict",
        "--out",
        out.to_str().unwrap(),
    ]));
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let lines: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    let header = &lines[0];
    assert_eq!(lines.len(), 3, "a header and a row a cell: {csv}");
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    for (row, cell) in lines[1..].iter().zip(json.as_array().unwrap()) {
        assert_eq!(row.len(), header.len(), "{csv}");
        assert_eq!(row[col("strategy")], cell["strategy"].as_str().unwrap());
        let acc: f64 = row[col("test_accuracy")].parse().unwrap();
        assert!(
            (acc - cell["test"]["accuracy"].as_f64().unwrap()).abs() < 1e-6,
            "{csv}"
        );
        let val: f64 = row[col("val_accuracy")].parse().unwrap();
        let last = cell["epochs"].as_array().unwrap().last().unwrap();
        assert!(
            (val - last["val"]["accuracy"].as_f64().unwrap()).abs() < 1e-6,
            "{csv}"
        );
    }
}

/// Every command that reads a run shows RUN as required in its usage line
/// (generate and export showed `[RUN]`: the hidden old `--run` may give it).
#[test]
fn a_required_run_is_shown_required() {
    for cmd in [
        &["generate"][..],
        &["export"],
        &["eval"],
        &["quantize"],
        &["prune"],
        &["checkpoint", "consolidate"],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let help = String::from_utf8_lossy(&succeeded(distgpt(&args)).stdout).to_string();
        let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap();
        assert!(
            usage.ends_with("<RUN>") && !usage.contains("[RUN]"),
            "{cmd:?}: {usage}"
        );
    }
}

/// Sizes and figures past what plan can count are refused in words: a
/// step's activations past a 64-bit byte count panicked (or, in a release
/// build, wrapped), and a rate past f64 once scaled read as infinite FLOP/s
/// and "0.0 us a step".
#[test]
fn plan_refuses_sizes_and_figures_past_what_it_can_count() {
    let plan = |extra: &[&str]| {
        let line = [&["plan", "--model", "gpt2", "--device", "h100"][..], extra].concat();
        refused(&line)
    };
    for sizes in [
        &["--batch-size", "88262514902"][..],
        &[
            "--world-size",
            "131072",
            "--batch-size",
            "1099511627776",
            "--grad-accum",
            "65536",
        ],
    ] {
        let said = plan(sizes);
        assert!(
            said.contains("plan prices steps of at most 2^40 tokens"),
            "{sizes:?}: {said}"
        );
    }
    let said = plan(&["--world-size", "8,8"]);
    assert!(said.contains("--world-size names 8 twice"), "{said}");
    for (flag, value, says) in [
        (
            "--peak-tflops",
            "1e308",
            "--peak-tflops 1e308 is inf FLOP/s",
        ),
        (
            "--intra-gbs",
            "1e-300",
            "--intra-gbs 1e-300 is 1e-291 bytes/s",
        ),
        (
            "--host-memory-gb",
            "1e300",
            "--host-memory-gb 1e300 is inf bytes",
        ),
    ] {
        let said = plan(&[flag, value]);
        assert!(said.contains(says), "{flag} {value}: {said}");
    }
}

/// plan's figures below its units' first digit read as numbers, not 0: a
/// model of 31,616 parameters ("0.0M"), an efficiency of 0.2% ("0%"), and
/// communication of 192 us ("0 ms").
#[test]
fn plan_writes_small_figures_as_numbers() {
    let plan = |line: &[&str]| {
        String::from_utf8_lossy(&succeeded(distgpt(&[&["plan"][..], line].concat())).stdout)
            .into_owned()
    };
    let tiny = plan(&[
        "--model",
        "tiny",
        "--device",
        "h100",
        "--world-size",
        "2",
        "--efficiency",
        "0.002",
    ]);
    assert!(tiny.contains("tiny (31.6k params,"), "{tiny}");
    assert!(tiny.contains("priced at 0.2% of the peak"), "{tiny}");
    let custom = plan(&[
        "--device",
        "custom",
        "--peak-tflops",
        "100",
        "--memory-gb",
        "24",
        "--memory-bandwidth-gbs",
        "900",
        "--intra-gbs",
        "64",
        "--inter-gbs",
        "12.5",
        "--world-size",
        "16",
    ]);
    assert!(
        custom.contains("communication: 1.8 MB a rank a step, 192 us"),
        "{custom}"
    );
}

/// A masked LM's run resumes by its own command line with `--resume`
/// added, and by its run.json as `--config` (docs/checkpoints.md): its
/// model records the task's positions (its sequence length) and head, not
/// the preset's, which `--model bert-tiny` repeated must not read as a
/// change ("--model cannot change when resuming" before).
#[test]
fn a_masked_lm_resumes_by_its_own_command_line_and_by_its_run_json() {
    let dir = run_dir("mlm-own-command");
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--task",
            "mlm",
            "--model",
            "bert-tiny",
            "--steps",
            "2",
        ];
        args.extend(["--batch-size", "2", "--seq-len", "32", "--quiet"]);
        args.extend(["--out", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    for (tag, by_config) in [("line", false), ("config", true)] {
        let out = dir.join(tag);
        let stopped = run(&out, &["--stop-after", "1"]);
        assert_eq!(stopped.status.code(), Some(75), "{stopped:?}");
        let resumed = match by_config {
            false => run(&out, &["--resume", out.to_str().unwrap()]),
            true => {
                let record = out.join("run.json");
                let args = ["--config", record.to_str().unwrap(), "--resume"];
                distgpt(&["train", args[0], args[1], args[2], out.to_str().unwrap()])
            }
        };
        let said = String::from_utf8_lossy(&resumed.stderr);
        assert!(resumed.status.success(), "{tag}: {said}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run's `run.json` as `--config` repeats it, and with `--resume`
/// continues it, after resumes that named its folder otherwise (`RUN/`, as
/// tab completion spells it) or changed what a resume may (`--steps`): the
/// folder as spelled was counted among the settings ("resumed at step 2
/// with other settings"), and a resume from run.json was refused for
/// earlier segments' settings it does not use.
#[test]
fn a_resumed_runs_record_repeats_and_resumes_it() {
    let dir = run_dir("record-after-resumes");
    let run = dir.join("r");
    let (run_s, slashed) = (run.to_str().unwrap(), format!("{}/", run.display()));
    let stopped = train_tiny_output(run_s, &["--steps", "4", "--stop-after", "2", "--quiet"]);
    assert_eq!(stopped.status.code(), Some(75), "{stopped:?}");
    succeeded(distgpt(&["train", "--resume", &slashed, "--quiet"]));
    let record = run.join("run.json");
    let record = record.to_str().unwrap();
    let repeat = dir.join("repeat");
    succeeded(distgpt(&[
        "train",
        "--config",
        record,
        "--out",
        repeat.to_str().unwrap(),
    ]));
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&run) == weights(&repeat),
        "the repeat trained otherwise"
    );
    // extended by a resume, stopped, and continued from its record
    let extended = distgpt(&[
        "train",
        "--resume",
        run_s,
        "--steps",
        "6",
        "--stop-after",
        "1",
    ]);
    assert_eq!(extended.status.code(), Some(75), "{extended:?}");
    succeeded(distgpt(&[
        "train", "--config", record, "--resume", run_s, "--quiet",
    ]));
    let (jsonl, _) = logged_steps(&run);
    assert_eq!(jsonl, (1..=6).collect::<Vec<u64>>());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CPU's thread count orders its sums: a stop's hint repeats the
/// `--threads` it was given, and a resume on other threads says it follows
/// the uninterrupted run to float tolerance only (it said nothing, and the
/// hint dropped `--threads`).
#[test]
fn a_resume_on_other_threads_says_it_is_not_bit_for_bit() {
    let dir = run_dir("resume-threads");
    let out = dir.to_str().unwrap();
    let mut args = vec![
        "--threads",
        "1",
        "train",
        "--model",
        "tiny",
        "--batch-size",
        "4",
    ];
    args.extend([
        "--seq-len",
        "16",
        "--steps",
        "3",
        "--stop-after",
        "1",
        "--out",
        out,
    ]);
    let stopped = distgpt(&args);
    let said = String::from_utf8_lossy(&stopped.stderr).to_string();
    assert_eq!(stopped.status.code(), Some(75), "{said}");
    assert_eq!(
        continue_hint(&said)[..4],
        ["distgpt", "--threads", "1", "train"],
        "{said}"
    );
    let resumed = distgpt(&[
        "--threads",
        "2",
        "train",
        "--resume",
        out,
        "--stop-after",
        "1",
    ]);
    let said = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(
        said.contains("ran on cpu (1 thread), the steps from here on cpu (2 threads)")
            && said.contains("not bit for bit"),
        "{said}"
    );
    let resumed = distgpt(&["--threads", "2", "train", "--resume", out]);
    let said = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(
        resumed.status.success() && !said.contains("not bit for bit"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A step of micro-batches is the batch of all their rows: a classifier's
/// 12 examples in micro-batches of 5, 5 and 2 (`--grad-accum 3`, an epoch
/// a step) train as one batch of 15 with 3 filler rows does, as
/// data-parallel ranks do. Each micro-batch's mean was weighed alike, the
/// 2 examples as much as the 5: step 2's loss 0.7378 for 0.7059 (step 1,
/// from weights that score every example alike, could not tell).
#[test]
fn a_step_of_micro_batches_is_the_batch_of_all_their_rows() {
    let dir = run_dir("accum-short");
    let (model, data) = tiny_bert_and_labelled_set(&dir);
    let steps = |tag: &str, batch: &str, accum: &str| {
        let out = dir.join(tag);
        let mut args = vec![
            "train", "--task", "classify", "--steps", "3", "--lr", "3e-2",
        ];
        args.extend([
            "--init-from",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ]);
        args.extend([
            "--batch-size",
            batch,
            "--grad-accum",
            accum,
            "--seq-len",
            "12",
        ]);
        args.extend(["--out", out.to_str().unwrap(), "--quiet"]);
        succeeded(distgpt(&args));
        let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        (log.lines())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<serde_json::Value>>()
    };
    let (whole, parts) = (steps("whole", "15", "1"), steps("parts", "5", "3"));
    assert_eq!((whole.len(), parts.len()), (3, 3));
    for (w, p) in whole.iter().zip(&parts) {
        for key in ["loss", "grad_norm"] {
            let (a, b) = (w[key].as_f64().unwrap(), p[key].as_f64().unwrap());
            let step = &w["step"];
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "step {step} {key}: {a} in one batch, {b} in three"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `run.json` whose model was edited (it is outside the settings'
/// checksum) is refused by name before anything is sized by it: 2^40
/// layers spun for ever in the layout's checks, 100,000 were refused as
/// too large for memory.
#[test]
fn a_run_record_naming_another_model_than_its_checkpoint_is_refused() {
    let dir = run_dir("record-model-edit");
    let out = dir.to_str().unwrap();
    train_tiny(out, &["--steps", "2", "--quiet"]);
    let path = dir.join("run.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for layers in [1u64 << 40, 100_000] {
        record["model"]["n_layer"] = layers.into();
        std::fs::write(&path, record.to_string()).unwrap();
        let said = distgpt(&["train", "--resume", out, "--steps", "4"]);
        let said = String::from_utf8_lossy(&said.stderr).to_string();
        assert!(
            said.contains("run.json: names a model of")
                && said.contains("where its checkpoint holds one of 2 layers"),
            "{layers}: {said}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// mpirun starts a command once a process: `train`, `bench` and
/// `generate` without `--comm mpi`, and the commands without ranks, would
/// run whole in every process, into the same files (two trainings of one
/// run raced for its folder and checkpoints). They are refused before
/// anything is written; one process of mpirun runs as ever.
#[test]
fn a_command_mpirun_would_run_whole_in_every_process_is_refused() {
    let dir = run_dir("mpirun-copies");
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    let as_process = |processes: &str, rank: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_distgpt"))
            .args(args)
            .env("OMPI_COMM_WORLD_SIZE", processes)
            .env("OMPI_COMM_WORLD_RANK", rank)
            .output()
            .unwrap()
    };
    let train = "train --model tiny --steps 1 --batch-size 2 --seq-len 8 --quiet --out";
    let train: Vec<&str> = train.split_whitespace().chain([o]).collect();
    let ranked = "add --comm mpi to make each process one rank, or run it without mpirun";
    let whole = "it runs as one process; run it without mpirun";
    for (args, says) in [
        (train.clone(), ranked),
        (vec!["bench", "--model", "tiny", "--steps", "1"], ranked),
        (vec!["generate", o, "--tokens", "2"], ranked),
        (vec!["eval", o], whole),
        (vec!["plan", "--model", "tiny"], whole),
        (vec!["compare", "--out", o], whole),
    ] {
        for rank in ["0", "1"] {
            let ran = as_process("2", rank, &args);
            let said = String::from_utf8_lossy(&ran.stderr).to_string();
            let command = format!("mpirun started 2 processes of `distgpt {}`", args[0]);
            assert!(
                !ran.status.success() && said.contains(&command) && said.contains(says),
                "{args:?} as process {rank} of 2: {said}"
            );
        }
        assert!(!out.exists(), "{args:?} wrote {o}");
    }
    succeeded(as_process("1", "0", &train));
    assert!(out.join("model.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plan --device cpu --json` states the device each world was priced on:
/// the peak of the CPUs its thread ranks use (world 2 of `--threads 1`
/// runs a thread a rank) and the efficiency its calibration measured (the
/// last world's stood for every plan).
#[test]
fn plan_on_this_cpu_states_each_worlds_device() {
    let args = "--threads 1 plan --device cpu --model tiny --world-size 1,2 --batch-size 4 --json";
    let out = succeeded(distgpt(&args.split_whitespace().collect::<Vec<_>>()));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plans = j["plans"].as_array().unwrap();
    let peak = |p: &serde_json::Value| p["device"]["peak_flops"].as_f64().unwrap();
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(2);
    assert_eq!(peak(&plans[1]), peak(&plans[0]) * cpus as f64, "{j}");
    for p in plans {
        assert_eq!(p["device"]["efficiency"], p["efficiency"], "{p}");
    }
}
