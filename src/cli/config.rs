//! `distgpt train --config FILE`: a run's settings from a file. A TOML file
//! sets train's flags by name (`batch-size = 16` or `batch_size = 16`, at
//! the top or in tables named as the help groups, `[optimisation]`); a
//! run's `run.json` sets everything that run was trained with, so
//! `--config RUN/run.json` repeats it. Flags on the command line win over
//! the file.

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory};
use distgpt::train::run_dir::{trained_with, RunRecord, Segment};
use distgpt::train::{Duration, TaskKind};
use std::ffi::OsString;
use std::path::Path;
use toml::Value;

/// The most bytes a config file may have (a run.json of a long run is far smaller).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A config file's text, refused past [`MAX_CONFIG_BYTES`] (`/dev/zero`
/// or a wrong path must not read without end).
fn read_bounded(file: &Path) -> Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(file)
        .with_context(|| format!("reading the config file {}", file.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading the config file {}", file.display()))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        bail!(
            "the config file {} is larger than {} MiB: not a settings file",
            file.display(),
            MAX_CONFIG_BYTES >> 20
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", file.display()))
}

/// The flag name of a key: `batch-size` and `batch_size` are `batch_size`.
fn arg_id(key: &str) -> String {
    key.replace('-', "_")
}

/// A TOML file's settings in file order, tables flattened one level.
fn toml_entries(file: &Path, text: &str) -> Result<Vec<(String, Value)>> {
    let table: toml::Table =
        toml::from_str(text).with_context(|| format!("{} is not valid TOML", file.display()))?;
    let mut out = Vec::new();
    for (key, value) in table {
        match value {
            Value::Table(inner) => {
                for (k, v) in inner {
                    if v.is_table() {
                        bail!(
                            "{}: [{key}.{k}] nests too deep: a table holds flags, e.g. [{key}] {k} = ...",
                            file.display()
                        );
                    }
                    out.push((k, v));
                }
            }
            v => out.push((key, v)),
        }
    }
    Ok(out)
}

/// Flags a language model started with `--init-from` takes from the folder
/// it starts from: never written for such a run, and a file's dropped when
/// `--init-from` is given on the command line.
pub(super) const FIXED_BY_INIT: [&str; 6] = [
    "model",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "tokenizer",
];

/// A value's spelling on the command line.
pub(super) fn name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .expect("every value has a name")
        .get_name()
        .into()
}

/// A run.json's record (`text`), its paths resolved against its folder
/// after `check` has read it as written (its settings' checksums count
/// the paths as the run recorded them).
fn read_run_json(
    file: &Path,
    text: &str,
    check: impl FnOnce(&RunRecord) -> Result<()>,
) -> Result<RunRecord> {
    let mut record: RunRecord = serde_json::from_str(text).with_context(|| {
        format!(
            "{} is not a run.json written by `distgpt train`",
            file.display()
        )
    })?;
    check(&record)?;
    record.resolve_paths(run_folder(file));
    Ok(record)
}

/// Refuses a record (`file`) whose earlier invocations trained with other
/// settings than its newest, which it holds: `--config` cannot repeat it.
fn repeatable(file: &Path, record: &RunRecord) -> Result<()> {
    let newest = |s: &Segment| {
        (s.settings.as_ref()).is_some_and(|sum| trained_with(sum, &record.train, &record.parallel))
    };
    let Some(w) = record.segments.windows(2).rfind(|w| !newest(&w[0])) else {
        return Ok(());
    };
    let (was, now) = (w[0].parallel.precision, w[1].parallel.precision);
    let what = match was == now {
        true => String::new(),
        false => format!(" (--precision {} after {})", name(now), name(was)),
    };
    bail!(
        "{}: the run was resumed at step {} with other settings than its earlier steps trained with{what} (or by a distgpt that did not record them, or run.json was edited), and run.json keeps only the newest: --config cannot repeat that run; continue it with `distgpt train --resume DIR`, or put the settings to repeat in a TOML file",
        file.display(),
        w[1].from_step
    )
}

/// The folder of a run's `run.json`.
fn run_folder(file: &Path) -> &Path {
    file.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// A run repeated from its run.json (`file`) on the data that file names
/// must train on the data the run trained on: the run's newest
/// checkpoint's fingerprint is compared with the data at `path`, as a
/// resume compares it (`trained_on` answers whether a recorded fingerprint
/// is of that data, and gives the data's own). Other data given on the
/// command line, or a run with no checkpoint, is not compared.
pub fn check_recorded_data(
    file: &Path,
    path: Option<&Path>,
    trained_on: impl FnOnce(&str) -> (bool, String),
) -> Result<()> {
    if file.extension().is_none_or(|e| e != "json") {
        return Ok(());
    }
    let record = read_run_json(file, &read_bounded(file)?, |_| Ok(()))?;
    let recorded = record
        .train
        .data
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p));
    if recorded.as_deref() != path {
        return Ok(());
    }
    let Ok(ckpt) = distgpt::checkpoint::state::latest(run_folder(file)) else {
        return Ok(());
    };
    let index = distgpt::checkpoint::state::read_index(&ckpt)?;
    let (same, data) = trained_on(&index.data);
    if !same {
        bail!(
            "{}: the run trained on other data than {} holds now (fingerprint {} in {}, {data} now): pass the run's data with --data, or train on this data with a TOML config",
            file.display(),
            path.map_or("the embedded text".into(), |p| p.display().to_string()),
            index.data,
            ckpt.display()
        );
    }
    Ok(())
}

/// Everything a run was trained with, as train's flags.
fn record_entries(r: &RunRecord) -> Vec<(String, Value)> {
    let t = &r.train;
    // a string past TOML's integers (2^63 - 1), as the seed
    let int =
        |v: usize| i64::try_from(v).map_or_else(|_| Value::String(v.to_string()), Value::Integer);
    let float = |v: f64| Value::Float(v);
    let mut out = vec![("task", Value::String(r.task.to_string()))];
    let m = &r.model;
    match r.task {
        // a language model's shape over the default preset
        TaskKind::Lm => out.extend([
            ("n_layer", int(m.n_layer())),
            ("n_head", int(m.n_head())),
            ("n_embd", int(m.n_embd())),
            ("block_size", int(m.block_size())),
        ]),
        // a masked LM's shape over a BERT preset (its positions are --seq-len)
        TaskKind::Mlm | TaskKind::Pretrain => out.extend([
            ("model", Value::String("bert-tiny".into())),
            ("n_layer", int(m.n_layer())),
            ("n_head", int(m.n_head())),
            ("n_embd", int(m.n_embd())),
        ]),
        // a classifier's shape is its --init-from folder's
        TaskKind::Classify => {}
    }
    out.extend(vec![
        ("tokenizer", Value::String(name(t.tokenizer))),
        ("batch_size", int(t.batch_size)),
        ("seq_len", int(t.seq_len)),
        ("grad_accum", int(t.grad_accum)),
        ("lr", float(t.lr.into())),
        ("min_lr", float(t.min_lr.into())),
        ("warmup", int(t.warmup_steps)),
        ("weight_decay", float(t.adamw.weight_decay.into())),
        ("beta1", float(t.adamw.beta1.into())),
        ("beta2", float(t.adamw.beta2.into())),
        ("grad_clip", float(t.grad_clip.into())),
        ("eval_every", int(t.eval_every)),
        ("eval_batches", int(t.eval_batches)),
        ("sample_every", int(t.sample_every)),
        ("log_every", int(t.log_every)),
        ("sample_tokens", int(t.sample_tokens)),
        // a string: TOML integers stop at 2^63 - 1, seeds go to 2^64 - 1
        ("seed", Value::String(t.seed.to_string())),
        ("checkpoint_every", int(t.checkpoint_every)),
        ("keep_checkpoints", int(t.keep_checkpoints)),
        ("strategy", Value::String(r.parallel.strategy.to_string())),
        ("world_size", int(r.parallel.world_size)),
        ("tp", int(r.parallel.tp)),
        ("pp", int(r.parallel.pipeline.stages)),
        (
            "schedule",
            Value::String(r.parallel.pipeline.schedule.to_string()),
        ),
        ("virtual_stages", int(r.parallel.pipeline.virtual_stages)),
        ("recompute", Value::Boolean(r.parallel.recompute)),
        ("precision", Value::String(name(r.parallel.precision))),
        ("offload", Value::String(r.parallel.offload.to_string())),
        ("offload_serial", Value::Boolean(r.parallel.offload_serial)),
        ("quiet", Value::Boolean(!t.verbose)),
    ]);
    out.push(match t.duration {
        Duration::Steps(n) => ("steps", int(n)),
        Duration::Epochs(e) => ("epochs", float(e)),
    });
    let path = |p: &Path| Value::String(p.to_string_lossy().into_owned());
    if let Some(d) = &t.data {
        out.push(("data", path(d)));
    }
    if let Some(d) = &t.init_from {
        out.push(("init_from", path(d)));
    }
    if let Some(n) = t.train_examples {
        out.push(("train_examples", int(n)));
    }
    if let Some(p) = t.peak_flops {
        out.push(("peak_tflops", float(p / 1e12)));
    }
    let task = r.task.spec();
    let from_folder: &[&str] = match t.init_from {
        Some(_) => &FIXED_BY_INIT,
        None => &[],
    };
    out.into_iter()
        .filter(|(k, _)| task.has(k) && !from_folder.contains(k))
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// The command-line arguments `file` stands for, leaving out the flags
/// given on the command line (`given`, by id) and those that conflict with
/// them (`--epochs` given drops the file's `steps`, `--init-from` its model
/// shape and tokenizer).
pub fn file_args(file: &Path, train: &clap::Command, given: &[String]) -> Result<Vec<OsString>> {
    let text = read_bounded(file)?;
    let entries = if file.extension().is_some_and(|e| e == "json") {
        // run.json holds the newest invocation's settings: a run resumed
        // with others cannot be repeated from them (a resume takes the
        // newest, as --resume alone does)
        let repeats = !given.iter().any(|g| g == "resume");
        let record = read_run_json(file, &text, |record| match repeats {
            true => repeatable(file, record),
            false => Ok(()),
        })?;
        record_entries(&record)
    } else {
        toml_entries(file, &text)?
    };
    let is_given = |id: &str| given.iter().any(|g| g == id);
    let mut args = Vec::new();
    // the flags set so far: (id, the key that set it)
    let mut taken: Vec<(String, String)> = Vec::new();
    for (key, value) in entries {
        let wanted = arg_id(&key);
        // a flag by its name, or an old spelling kept as a hidden alias
        // (`peak-gflops`); never a hidden testing aid
        let Some(arg) = train
            .get_arguments()
            .filter(|a| a.get_long().is_some() && a.get_id() != "config")
            .filter(|a| !a.is_hide_set() || a.get_id().as_str().starts_with("old_"))
            .find(|a| {
                a.get_id() == wanted.as_str() || a.get_long().is_some_and(|l| arg_id(l) == wanted)
            })
        else {
            bail!(
                "{}: unknown setting `{key}` (the keys are train's flags, see `distgpt train --help`)",
                file.display()
            );
        };
        let id = arg.get_id().to_string();
        if taken.iter().any(|(t, _)| *t == id) {
            bail!("{}: `{key}` is set twice", file.display());
        }
        let conflicts = conflicts_of(train, arg);
        if let Some((_, other)) = taken.iter().find(|(t, _)| conflicts.contains(t)) {
            bail!(
                "{}: `{key}` and `{other}` cannot both be set",
                file.display()
            );
        }
        taken.push((id.clone(), key.clone()));
        let flag = format!("--{}", arg.get_long().expect("a long flag"));
        let is_switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
        // the file's value in words, checked whether or not the command
        // line overrides it
        let value = match (value, is_switch) {
            (Value::Boolean(on), true) => on.then_some(flag),
            (v, true) => bail!(
                "{}: `{key}` is a switch: true or false (got {})",
                file.display(),
                v.type_str()
            ),
            // `--flag=value`: a value such as -5 stays the flag's (and an
            // error names the flag), never a flag of its own
            (Value::String(s), false) => Some(format!("{flag}={s}")),
            (Value::Integer(i), false) => Some(format!("{flag}={i}")),
            (Value::Float(f), false) => Some(format!("{flag}={f}")),
            (v, false) => bail!(
                "{}: `{key}` takes one value, a string or a number (got {})",
                file.display(),
                v.type_str()
            ),
        };
        let from_folder = is_given("init_from") && FIXED_BY_INIT.contains(&id.as_str());
        if is_given(&id) || conflicts.iter().any(|c| is_given(c)) || from_folder {
            continue;
        }
        args.extend(value.map(Into::into));
    }
    Ok(args)
}

/// The ids of the flags `arg` cannot be given with, whichever of the two
/// declares the conflict (`--steps` declares it with `--epochs`).
fn conflicts_of(train: &clap::Command, arg: &clap::Arg) -> Vec<String> {
    let mut out: Vec<String> = train
        .get_arg_conflicts_with(arg)
        .iter()
        .map(|a| a.get_id().to_string())
        .collect();
    for other in train.get_arguments() {
        let declared = train.get_arg_conflicts_with(other);
        if declared.iter().any(|a| a.get_id() == arg.get_id()) {
            out.push(other.get_id().to_string());
        }
    }
    out
}

/// The command line parsed again with `train --config FILE`'s settings
/// inserted after `train`, less those the command line gives itself.
pub(super) fn with_config_file(file: &Path, given: &[String]) -> Result<ArgMatches> {
    let mut cli = super::Cli::command();
    cli.build();
    let train = cli.find_subcommand("train").expect("a train command");
    let settings = file_args(file, train, given)?;
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let at = 1
        + argv
            .iter()
            .skip(1)
            .position(|a| a == "train")
            .expect("parsed as train")
        + 1;
    argv.splice(at..at, settings);
    super::Cli::command()
        .try_get_matches_from(argv)
        .map_err(|e| {
            // clap's message up to its usage: the arguments it names
            // (those a setting needs) stand on the lines after the first
            let text = e.to_string();
            let said: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .map(str::trim)
                .collect();
            anyhow::anyhow!(
                "{} (a setting from {})",
                said.join(" ").trim_start_matches("error: "),
                file.display()
            )
        })
}

/// The ids of the flags given on the command line (not defaults).
pub(super) fn given_flags(m: &ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(ValueSource::CommandLine))
        .map(|id| id.as_str().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    fn train() -> clap::Command {
        let mut cli = super::super::Cli::command();
        cli.build();
        cli.find_subcommand("train").expect("train").clone()
    }

    fn args_of(toml: &str, given: &[&str]) -> Result<Vec<String>> {
        let dir = crate::testdir::TestDir::new("config");
        let file = dir.path().join("flags.toml");
        std::fs::write(&file, toml).unwrap();
        let given: Vec<String> = given.iter().map(|g| g.to_string()).collect();
        Ok(file_args(&file, &train(), &given)?
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect())
    }

    #[test]
    fn keys_are_flags_in_tables_or_not_and_the_command_line_wins() {
        let args = args_of(
            "model = \"tiny\"\n[optimisation]\nlr = 0.001\nsteps = 40\n[parallelism]\nrecompute = true\nworld-size = 2\n",
            &["world_size", "epochs"],
        )
        .unwrap();
        assert_eq!(args, ["--model=tiny", "--lr=0.001", "--recompute"]);
    }

    #[test]
    fn the_command_line_replaces_the_files_whole_group_of_exclusive_settings() {
        // the conflict is declared on --steps, and holds from either side
        let args = args_of("epochs = 2.0\nlr = 0.01\n", &["steps"]).unwrap();
        assert_eq!(args, ["--lr=0.01"]);
        let args = args_of("steps = 4\n", &["epochs"]).unwrap();
        assert!(args.is_empty(), "{args:?}");
        let args = args_of("peak-tflops = 0.5\n", &["old_peak_gflops"]).unwrap();
        assert!(args.is_empty(), "{args:?}");
        // an old spelling works in a file as on the command line
        let args = args_of("peak-gflops = 500\n", &[]).unwrap();
        assert_eq!(args, ["--peak-gflops=500"]);
        let args = args_of("peak_gflops = 500\n", &["peak_tflops"]).unwrap();
        assert!(args.is_empty(), "{args:?}");
    }

    #[test]
    fn mistakes_in_the_file_are_named() {
        let e = |t: &str| args_of(t, &[]).unwrap_err().to_string();
        assert!(e("bach-size = 4\n").contains("unknown setting `bach-size`"));
        assert!(e("fail-rank = 1\n").contains("unknown setting"));
        assert!(e("recompute = 1\n").contains("is a switch"));
        assert!(e("lr = [1, 2]\n").contains("takes one value"));
        assert!(e("steps = 4\nepochs = 1.0\n").contains("cannot both be set"));
        assert!(e("lr = 1\n[optimisation]\nlr = 2\n").contains("set twice"));
        assert!(e("lr = \n").contains("is not valid TOML"));
    }

    #[test]
    fn the_shipped_configs_parse_as_train_flags() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut seen = 0;
        for f in std::fs::read_dir(&dir).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|e| e == "toml") {
                let args = file_args(&f, &train(), &[]).unwrap();
                let argv = ["distgpt".into(), "train".into()].into_iter().chain(args);
                let cli = super::super::Cli::try_parse_from(argv)
                    .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
                let super::super::Command::Train(a) = cli.command else {
                    panic!("not train")
                };
                a.model.resolve_family(None).unwrap();
                seen += 1;
            }
        }
        assert!(seen >= 2, "configs/ holds the seed experiments");
    }
}
