//! Every command the README shows still parses: each one's subcommand,
//! flags and values as written (`--help` appended, so nothing trains), and
//! the `plan` examples on datasheet devices run whole, as they are quick.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;
use std::process::Command;

/// The README's distgpt command lines: indented code, continuation lines
/// joined, comments dropped, as the arguments after `distgpt`.
fn readme_commands() -> Vec<(usize, Vec<String>)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        let Some(code) = line.strip_prefix("    ") else {
            pending = None;
            continue;
        };
        let (at, joined) = match pending.take() {
            Some((at, head)) => (at, format!("{head} {}", code.trim())),
            None => (n + 1, code.trim().to_string()),
        };
        if let Some(head) = joined.strip_suffix('\\') {
            pending = Some((at, head.trim_end().to_string()));
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
        out.push((at, words(args)));
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
fn every_readme_command_parses_and_its_plans_run() {
    let commands = readme_commands();
    assert!(commands.len() > 40, "found {} commands", commands.len());
    let (mut parsed, mut ran) = (0, 0);
    for (line, args) in commands {
        // a --config file the README names but does not ship is read before parsing
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
        let cwd = scratch(&format!("readme-line-{line}"));
        std::fs::create_dir_all(&cwd).unwrap();
        cmd.current_dir(&cwd);
        if !datasheet {
            cmd.arg("--help");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "README.md line {line}: distgpt {}\n{}",
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
    eprintln!("{parsed} README commands parsed, {ran} plans run");
}
