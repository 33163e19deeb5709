//! Every command README.md and docs/*.md show still parses: each one's
//! subcommand, flags and values as written (`--help` appended, so nothing
//! trains), and the `plan` examples on datasheet devices run whole, as they
//! are quick. Five sequences run for real in order on tiny settings: the
//! README's tour, docs/checkpoints.md's resume, docs/usage.md's config files
//! and examples, docs/compression.md's pruning. Every other command (the
//! strategies, pipelines, offload, `compare`, BERT, the GPU and MPI lines,
//! the command list) is only parsed.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;
use std::process::Command;

/// Where a command is shown: a file (`README.md`, `docs/plan.md`) and its line.
#[derive(Clone, Debug, PartialEq)]
struct At {
    file: String,
    line: usize,
}

impl std::fmt::Display for At {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} line {}", self.file, self.line)
    }
}

impl At {
    /// A folder name for what the command writes.
    fn folder(&self) -> String {
        let stem = self.file.trim_end_matches(".md").replace('/', "-");
        format!("{stem}-{}", self.line)
    }
}

/// README.md, then docs/*.md in name order.
fn doc_files() -> Vec<String> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut docs: Vec<String> = std::fs::read_dir(format!("{root}/docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    std::iter::once("README.md".to_string())
        .chain(docs)
        .collect()
}

/// The distgpt command lines of README.md and docs/*.md.
fn doc_commands() -> Vec<(At, Vec<String>)> {
    doc_files()
        .into_iter()
        .flat_map(|file| commands_in(&file))
        .collect()
}

/// A file's distgpt command lines: indented code, continuation lines
/// joined, comments dropped, as the arguments after `distgpt`.
fn commands_in(file: &str) -> Vec<(At, Vec<String>)> {
    let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(path).unwrap();
    let at = |line| At {
        file: file.to_string(),
        line,
    };
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        let Some(code) = line.strip_prefix("    ") else {
            pending = None;
            continue;
        };
        let (at_line, joined) = match pending.take() {
            Some((at_line, head)) => (at_line, format!("{head} {}", code.trim())),
            None => (n + 1, code.trim().to_string()),
        };
        if let Some(head) = joined.strip_suffix('\\') {
            pending = Some((at_line, head.trim_end().to_string()));
            continue;
        }
        let command = joined.split(" #").next().unwrap_or("").trim();
        let args = match (
            command.split_once("cargo run --release -- "),
            command.split_once("distgpt "),
        ) {
            (Some((_, rest)), _) => rest,
            (None, Some((before, rest))) if !before.contains(' ') || before.contains("mpirun") => {
                rest
            }
            _ => continue,
        };
        out.push((at(at_line), words(args)));
    }
    out
}

/// Shell words: double quotes kept together; a placeholder's alternatives
/// (`char|gpt2`) as the first; optional parts (`[RUN...]`) dropped.
fn words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    out.push(std::mem::take(&mut word));
                }
            }
            _ => word.push(c),
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    // an optional part, `[--input FILE]`, is left out
    let mut optional = false;
    out.retain(|w| {
        let skip = optional || w.starts_with('[');
        optional = skip && !w.ends_with(']');
        !skip
    });
    out.into_iter()
        .map(|w| match w.starts_with('-') {
            true => w,
            false => w.split('|').next().unwrap_or("").to_string(),
        })
        .collect()
}

#[test]
fn every_documented_command_parses_and_its_plans_run() {
    let commands = doc_commands();
    assert!(commands.len() > 40, "found {} commands", commands.len());
    let (mut parsed, mut ran) = (0, 0);
    for (at, args) in commands {
        // a --config file a document names but the repository does not ship is read before parsing
        if let Some(i) = args.iter().position(|a| a == "--config") {
            let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(&args[i + 1]);
            if !file.exists() {
                continue;
            }
        }
        let datasheet = args.first().is_some_and(|a| a == "plan")
            && args
                .windows(2)
                .any(|w| w[0] == "--device" && ["a100", "h100", "custom"].contains(&w[1].as_str()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_distgpt"));
        cmd.args(&args);
        // what a plan writes (--plot plots/plan) goes to a folder of its own
        let cwd = scratch(&format!("readme-{}", at.folder()));
        std::fs::create_dir_all(&cwd).unwrap();
        cmd.current_dir(&cwd);
        if !datasheet {
            cmd.arg("--help");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{at}: distgpt {}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        if datasheet {
            ran += 1;
        } else {
            parsed += 1;
        }
    }
    assert!(ran >= 3, "the plan examples ran ({ran})");
    eprintln!("{parsed} documented commands parsed, {ran} plans run");
}

/// Flags counted in steps: the walk-through divides them by 100.
const STEP_FLAGS: [&str; 7] = [
    "--steps",
    "--checkpoint-every",
    "--stop-after",
    "--from-step",
    "--finetune-steps",
    "--eval-every",
    "--sample-every",
];

/// A documented command on tiny settings: a new run trains the tiny model at 4
/// x 16 tokens (its shape flags replaced), step counts are a hundredth,
/// batches 4 sequences of 16 and evaluations 2 batches.
fn on_tiny_settings(args: &[String]) -> Vec<String> {
    let fresh_run = args[0] == "train" && !args.iter().any(|a| a == "--resume");
    let dropped: &[&str] = match fresh_run {
        true => &[
            "--model",
            "--n-layer",
            "--n-head",
            "--n-embd",
            "--block-size",
            "--batch-size",
            "--seq-len",
        ],
        false => &[],
    };
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if dropped.contains(&a.as_str()) {
            it.next();
            continue;
        }
        out.push(a.clone());
        let value = match a.as_str() {
            f if STEP_FLAGS.contains(&f) => it.next().map(|v| {
                let n: usize = v.parse().expect("a step count");
                (n / 100).max(1).to_string()
            }),
            "--batch-size" => it.next().map(|_| "4".into()),
            "--seq-len" => it.next().map(|_| "16".into()),
            "--eval-batches" => it.next().map(|_| "2".into()),
            _ => None,
        };
        out.extend(value);
    }
    if fresh_run {
        out.extend(["--model", "tiny", "--batch-size", "4", "--seq-len", "16"].map(String::from));
        out.extend(["--block-size", "16", "--sample-tokens", "0"].map(String::from));
    }
    if args[0] == "train" {
        out.push("--quiet".into());
    }
    out
}

/// The documents' sequences run for real, in order, on tiny settings: each
/// block of commands in a folder of its own, so every command meets the
/// files the block's earlier commands made (a resume finds its run, a
/// config file its run.json, two outputs their own folders). Commands that
/// name a placeholder or another machine (DIR, a folder from elsewhere,
/// mpirun) are left out, and counted.
#[test]
fn the_documented_sequences_run_in_order_on_tiny_settings() {
    let commands = doc_commands();
    let mut blocks: Vec<Vec<(At, Vec<String>)>> = Vec::new();
    for (at, args) in commands {
        let next = |b: &Vec<(At, Vec<String>)>| {
            b.last()
                .is_some_and(|(l, _)| l.file == at.file && l.line + 1 == at.line)
        };
        match blocks.last_mut() {
            Some(b) if next(b) => b.push((at, args)),
            _ => blocks.push(vec![(at, args)]),
        }
    }
    let anchors = [
        "--out runs/tour",
        "--resume runs/a --stop-after 500",
        "--config runs/char-config/run.json",
        "generate runs/char-usage",
        "prune runs/char --out pruned ",
    ];
    let placeholder = |a: &String| {
        ["DIR", "FILE", "text.txt", "hf/gpt2-folder", "mpi"].contains(&a.as_str())
            || a.contains("mpirun")
    };
    let (mut ran, mut left_out) = (0, Vec::new());
    for anchor in anchors {
        let block = blocks
            .iter()
            .find(|b| {
                b.iter()
                    .any(|(_, a)| format!("{} ", a.join(" ")).contains(anchor))
            })
            .unwrap_or_else(|| panic!("no block of README.md or docs/ with `{anchor}`"));
        let cwd = scratch(&format!("readme-walk-{}", block[0].0.folder()));
        std::fs::create_dir_all(&cwd).unwrap();
        // the shipped config files, where a clone has them
        let configs = concat!(env!("CARGO_MANIFEST_DIR"), "/configs");
        std::os::unix::fs::symlink(configs, cwd.join("configs")).unwrap();
        for (at, args) in block {
            if args.iter().any(placeholder) {
                left_out.push(at.to_string());
                continue;
            }
            let tiny = on_tiny_settings(args);
            let out = Command::new(env!("CARGO_BIN_EXE_distgpt"))
                .args(&tiny)
                .current_dir(&cwd)
                .output()
                .unwrap();
            // a run stopped by --stop-after exits 75, as one stopped by a signal
            let stopped = tiny.iter().any(|a| a == "--stop-after") && out.status.code() == Some(75);
            assert!(
                out.status.success() || stopped,
                "{at}, after the block's earlier lines: distgpt {}\n{}",
                tiny.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    assert!(ran >= 15, "{ran} commands ran");
    assert!(left_out.len() <= 5, "left out: {left_out:?}");
    eprintln!("{ran} documented commands ran in order; left out {left_out:?}");
}
