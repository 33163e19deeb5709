//! Each command's help, led by an example of it (every one parses), and
//! the checks that every flag and command has a help line.

use super::Cli;
use clap::CommandFactory;

/// Each command's example, which its help leads with ("" for the top
/// level); every one parses (`every_command_leads_its_help_with_an_example_that_parses`).
const EXAMPLES: [(&str, &str); 18] = [
    ("", "distgpt train\n  distgpt generate runs/latest --prompt ROMEO. --tokens 200\n  distgpt bench --model gpt2 --strategy fsdp --world-size 2\n  distgpt plan --model gpt2-xl --world-size 64 --device h100"),
    ("train", "distgpt train --model gpt2 --data input.txt --strategy zero2 --world-size 4 --steps 2000"),
    ("generate", "distgpt generate runs/latest --prompt ROMEO. --tokens 200"),
    ("data", "distgpt data prepare --input input.txt --tokenizer gpt2 --out data/mine"),
    ("data prepare", "distgpt data prepare --input input.txt --tokenizer gpt2 --out data/mine"),
    ("data prepare-spam", "distgpt data prepare-spam --input spam-assassin/package --out data/spam"),
    ("data prepare-dialogue", "distgpt data prepare-dialogue --input chitchat_dataset --out data/chitchat"),
    ("bench", "distgpt bench --model gpt2 --strategy fsdp --world-size 2 --steps 5"),
    ("compare", "distgpt compare --strategies single,ddp,fsdp --world-sizes 2 --steps 200 --out runs/compare"),
    ("plan", "distgpt plan --model gpt2-xl --world-size 64 --device h100"),
    ("export", "distgpt export runs/latest --out hf/mine"),
    ("quantize", "distgpt quantize runs/latest --out models/int8"),
    ("prune", "distgpt prune runs/latest --sparsity 0.5 --finetune-steps 200 --out models/pruned"),
    ("eval", "distgpt eval runs/latest"),
    ("checkpoint", "distgpt checkpoint consolidate runs/latest/checkpoints/step_00000200 --out models/a"),
    ("checkpoint consolidate", "distgpt checkpoint consolidate runs/latest/checkpoints/step_00000200 --out models/a"),
    ("plot", "distgpt plot runs/a runs/b --out plots/ab"),
    ("devices", "distgpt devices"),
];

/// The command line's parser, each command's help led by its example.
pub(super) fn command() -> clap::Command {
    let mut cli = Cli::command();
    for (path, example) in EXAMPLES {
        let lead = format!(
            "Example{}:\n  {example}",
            if path.is_empty() { "s" } else { "" }
        );
        let mut names = path.split_whitespace();
        cli = match (names.next(), names.next()) {
            (None, _) => cli.before_help(lead),
            (Some(c), None) => cli.mut_subcommand(c, |c| c.before_help(lead)),
            (Some(c), Some(sub)) => {
                cli.mut_subcommand(c, |c| c.mut_subcommand(sub, |s| s.before_help(lead)))
            }
        };
    }
    cli.mut_subcommand("train", task_defaults)
}

/// `train`'s flags whose default a task sets otherwise, each help line
/// followed by those tasks' own (from the task table, so it cannot drift).
fn task_defaults(train: clap::Command) -> clap::Command {
    use distgpt::train::spec::{TaskDefaults, TASKS};
    type Of = fn(&TaskDefaults) -> Option<String>;
    let flags: [(&str, Of); 4] = [
        ("lr", |d| d.lr.map(|x| x.to_string())),
        ("beta2", |d| d.beta2.map(|x| x.to_string())),
        ("weight_decay", |d| d.weight_decay.map(|x| x.to_string())),
        ("eval_every", |d| d.eval_every.map(|x| x.to_string())),
    ];
    flags.into_iter().fold(train, |train, (id, of)| {
        let tasks: Vec<String> = TASKS
            .iter()
            .filter_map(|t| of(&t.defaults).map(|v| format!("--task {}: {v}", t.kind)))
            .collect();
        if tasks.is_empty() {
            return train;
        }
        train.mut_arg(id, |a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            a.help(format!(
                "{} ({})",
                help.trim_end_matches('.'),
                tasks.join("; ")
            ))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Command, StrategyKind};
    use clap::Parser;

    /// `train --help` says each task's own defaults, as the task table
    /// sets them (it said only the language model's: `--lr` 0.003 where a
    /// classifier trains at 5e-5).
    #[test]
    fn train_help_says_each_tasks_defaults() {
        let mut cli = command();
        let help = cli
            .find_subcommand_mut("train")
            .unwrap()
            .render_long_help()
            .to_string();
        let line = |flag: &str| {
            let at = help.find(&format!("--{flag} <")).unwrap();
            help[at..].lines().nth(1).unwrap().to_string()
        };
        for t in &distgpt::train::spec::TASKS {
            if let Some(lr) = t.defaults.lr {
                let said = format!("--task {}: {lr}", t.kind);
                assert!(line("lr").contains(&said), "{said} not in {}", line("lr"));
            }
        }
        assert!(
            line("beta2").contains("--task classify: 0.999"),
            "{}",
            line("beta2")
        );
    }

    /// Every visible flag and command without a help line, as "command --flag".
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for a in cmd.get_arguments() {
            let builtin = ["help", "version"].contains(&a.get_id().as_str());
            if !a.is_hide_set() && !builtin && a.get_help().is_none() {
                out.push(format!("{path} --{}", a.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            let name = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() && sub.get_name() != "help" {
                out.push(name.clone());
            }
            undocumented(sub, &name, out);
        }
    }

    /// Every command's help (and the top level's) starts with an example,
    /// and every example is a command line that parses.
    #[test]
    fn every_command_leads_its_help_with_an_example_that_parses() {
        fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                let name = format!("{path} {}", sub.get_name()).trim().to_string();
                let help = sub.clone().render_help().to_string();
                out.push((name.clone(), help));
                walk(sub, &name, out);
            }
        }
        let mut cli = command();
        let mut helps = vec![(String::new(), cli.render_help().to_string())];
        walk(&cli, "", &mut helps);
        for (path, help) in &helps {
            assert!(
                help.starts_with("Example"),
                "`distgpt {path} --help`:\n{help}"
            );
        }
        assert_eq!(helps.len(), EXAMPLES.len(), "a command without an example");
        for (path, example) in EXAMPLES {
            for line in example.lines() {
                let argv = line.split_whitespace();
                let parsed = command().try_get_matches_from(argv);
                assert!(parsed.is_ok(), "{path}: {line}: {:?}", parsed.err());
                let words: Vec<&str> = line.split_whitespace().collect();
                assert!(
                    path.is_empty() || words[1..].join(" ").starts_with(path),
                    "{line}"
                );
            }
        }
    }

    #[test]
    fn every_flag_and_command_has_a_help_line() {
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "distgpt", &mut missing);
        assert!(missing.is_empty(), "no help line: {missing:?}");
    }

    #[test]
    fn test_only_flags_are_hidden_and_zero3_is_fsdp() {
        let help = Cli::command()
            .find_subcommand_mut("train")
            .expect("train")
            .render_long_help()
            .to_string();
        assert!(!help.contains("--fail-rank") && !help.contains("--fail-step"));
        for heading in [
            "Model",
            "Data",
            "Optimisation",
            "Parallelism",
            "Checkpoints",
            "Output",
        ] {
            assert!(help.contains(&format!("{heading}:")), "no {heading} group");
        }
        let cli = Cli::try_parse_from(["distgpt", "train", "--strategy", "zero3"]).expect("zero3");
        let Command::Train(a) = cli.command else {
            panic!("not train")
        };
        assert_eq!(a.parallel.strategy, StrategyKind::Fsdp);
        assert_eq!(StrategyKind::Fsdp.to_string(), "fsdp");
    }
}
