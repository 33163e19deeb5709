//! A run ready to launch ([`Prepared`]), and a recorded run resumed: the
//! run directory and checkpoint that `--resume` names found, the run's
//! record read back, and the settings a resume may change taken from the
//! command line's.

use super::run_dir::{self, RunRecord, RUN_FILE};
use super::{TaskData, TrainConfig};
use crate::backend::cpu::Cpu;
use crate::checkpoint::state;
use crate::error::{Error, Result};
use crate::parallel::{Offload, ParallelConfig, StrategyKind};
use std::path::{Path, PathBuf};

/// A run ready to launch: its task's data, configuration and layout.
pub struct Prepared {
    pub data: TaskData,
    pub cfg: TrainConfig,
    pub par: ParallelConfig,
    /// A resumed run's lock, held from the resume's first read of the run
    /// until the run's outputs take it over (none for a new run).
    pub lock: Option<run_dir::RunLock>,
}

impl Prepared {
    /// Optimizer steps it trains in all.
    pub fn total_steps(&self) -> Result<usize> {
        let cfg = &self.cfg;
        let stream = self.data.with_task::<Cpu, _>(|task| -> Result<usize> {
            Ok(task.train_stream(cfg)?.batches_per_epoch())
        })?;
        Ok(cfg.duration.steps(stream, cfg.grad_accum))
    }
}

/// The newest checkpoint of the run in `dir`, or why there is none.
fn latest_of_run(dir: &Path) -> Result<PathBuf> {
    state::latest(dir).map_err(|e| match run_dir::holds_nothing_to_keep(dir) {
        Ok(true) if dir.join(RUN_FILE).exists() => Error::checkpoint(dir, format!("no complete checkpoint to resume from: the run was stopped before its first was written; start it again in its place with `distgpt train --config {} --out {}`", dir.join(RUN_FILE).display(), dir.display())),
        _ => e,
    })
}

/// A recorded run found to continue from one of its checkpoints.
pub struct Resumption {
    pub dir: PathBuf,
    pub ckpt: PathBuf,
    pub index: state::Index,
    pub record: RunRecord,
    /// The run's lock, held since before its checkpoints were read.
    lock: Option<run_dir::RunLock>,
}

/// The run `path` names: a checkpoint directory (RUN/checkpoints/step_N),
/// or a run directory's newest checkpoint (that of `from_step` when given).
/// Refuses a run another process is training before any of its files is
/// read (its checkpoints change under a reader), and holds it locked from
/// then on.
pub fn find(path: &Path, from_step: Option<usize>) -> Result<Resumption> {
    let in_checkpoint = path.join("index.json").exists();
    let set_aside = path.parent().and_then(Path::file_name) == Some("superseded".as_ref());
    if in_checkpoint && set_aside {
        return Err(Error::Input(format!(
            "{} was set aside when its run resumed from an earlier step, and cannot be resumed in place: `distgpt checkpoint consolidate {0} --out DIR` recovers its weights",
            path.display()
        )));
    }
    let dir = match in_checkpoint {
        true => {
            let lives = || Error::Input("a checkpoint directory lives in RUN/checkpoints/".into());
            let run = path.parent().and_then(Path::parent).ok_or_else(lives)?;
            // `checkpoints/step_N` given from inside the run
            match run.as_os_str().is_empty() {
                true => Path::new("."),
                false => run,
            }
        }
        false => path,
    };
    // a folder that is not there is said to be missing below, not made;
    // one that holds no run is said to below, and left without a lock file
    let is_run = dir.join(RUN_FILE).is_file() || dir.join(state::DIR).is_dir();
    let lock = is_run
        .then(|| run_dir::lock_to_hand_over(dir))
        .transpose()?;
    let ckpt = match (in_checkpoint, from_step) {
        (true, _) => path.to_path_buf(),
        (false, Some(n)) => state::at_step(path, n)?,
        (false, None) => {
            let ckpt = latest_of_run(path)?;
            let step = state::step_of(&ckpt).unwrap_or(0);
            if let Some(newest) = state::damaged_after(path, step).last() {
                crate::errln!(
                    "warning: {} has no index.json (damaged): resuming from {}, whose later steps are trained again",
                    newest.display(),
                    ckpt.display()
                );
            }
            ckpt
        }
    };
    let dir = dir.to_path_buf();
    let index = state::read_index(&ckpt)?;
    if !dir.join(RUN_FILE).exists() {
        let reason = format!("has checkpoints but no {RUN_FILE}: it was written by a distgpt whose BERT runs kept no run record, and cannot be resumed; `distgpt checkpoint consolidate {}` recovers its weights", dir.display());
        return Err(Error::checkpoint(dir, reason));
    }
    let record = run_dir::read_record_to_resume(&dir)?;
    Ok(Resumption {
        dir,
        ckpt,
        index,
        record,
        lock,
    })
}

/// `from` into `into` when `given`.
fn take<T: Clone>(given: bool, into: &mut T, from: &T) {
    if given {
        *into = from.clone();
    }
}

/// The settings of `f` a resume may change into `c`, where `set`.
fn take_settings(c: &mut TrainConfig, f: &TrainConfig, set: impl Fn(&str) -> bool) {
    take(set("steps") || set("epochs"), &mut c.duration, &f.duration);
    take(set("lr"), &mut c.lr, &f.lr);
    take(set("lr") || set("min_lr"), &mut c.min_lr, &f.min_lr);
    take(set("grad_clip"), &mut c.grad_clip, &f.grad_clip);
    take(set("eval_every"), &mut c.eval_every, &f.eval_every);
    take(set("eval_batches"), &mut c.eval_batches, &f.eval_batches);
    take(set("sample_every"), &mut c.sample_every, &f.sample_every);
    take(set("log_every"), &mut c.log_every, &f.log_every);
    take(set("sample_tokens"), &mut c.sample_tokens, &f.sample_tokens);
    let every = set("checkpoint_every");
    take(every, &mut c.checkpoint_every, &f.checkpoint_every);
    let keep = set("keep_checkpoints");
    take(keep, &mut c.keep_checkpoints, &f.keep_checkpoints);
    take(set("tensorboard"), &mut c.tensorboard, &f.tensorboard);
    let peak = set("peak_tflops") || set("old_peak_gflops");
    take(peak, &mut c.peak_flops, &f.peak_flops);
    c.verbose = f.verbose;
}

/// The layout of `m` a resume may change into `p`, where `set`; `step`
/// is the checkpoint's, for the note that the precision changes.
fn take_layout(
    p: &mut ParallelConfig,
    m: &ParallelConfig,
    set: impl Fn(&str) -> bool,
    step: usize,
) {
    take(set("strategy"), &mut p.strategy, &m.strategy);
    take(set("strategy") || set("tp"), &mut p.tp, &m.tp);
    take(set("world_size"), &mut p.world_size, &m.world_size);
    take(set("recompute"), &mut p.recompute, &m.recompute);
    take(set("offload"), &mut p.offload, &m.offload);
    // --offload params is fsdp's parameter shards: a run leaving fsdp keeps
    // its optimizer on the host, as tp follows the strategy
    if p.offload == Offload::Params && p.strategy != StrategyKind::Fsdp && !set("offload") {
        crate::errln!(
            "note: steps 1-{step} kept fsdp's parameter shards on the host (--offload params); \
             under {} the optimizer stays there (--offload optimizer)",
            p.strategy
        );
        p.offload = Offload::Optimizer;
    }
    // the copies' order follows the offload, as tp follows the strategy
    // (no flag clears --offload-serial: `--offload none` must)
    let serial = set("offload") || set("offload_serial");
    take(serial, &mut p.offload_serial, &m.offload_serial);
    if set("precision") && m.precision != p.precision {
        crate::errln!(
            "note: steps 1-{step} trained with --precision {}, the steps from here with {}: run.json records both, and --config cannot repeat the run",
            p.precision,
            m.precision
        );
        p.precision = m.precision;
    }
    take(set("pp"), &mut p.pipeline.stages, &m.pipeline.stages);
    // one stage has no schedule: a pipeline's recorded one (gpipe,
    // interleaved, zb-h1) would refuse it, as tp follows the strategy
    let one_stage = set("pp") && m.pipeline.stages == 1;
    let schedule = set("schedule") || set("virtual_stages") || one_stage;
    let pm = &m.pipeline;
    take(schedule, &mut p.pipeline.schedule, &pm.schedule);
    take(schedule, &mut p.pipeline.virtual_stages, &pm.virtual_stages);
}

impl Resumption {
    /// The run as recorded, set to continue from the checkpoint, with the
    /// settings a resume may change that `given` names (train's flags as
    /// their `snake_case` ids) taken from `flags` and `layout`, the command
    /// line's. Its own layout unless one is asked for: resuming into the
    /// same layout is bit-exact, into another only within float tolerance.
    pub fn prepare(
        self,
        flags: &TrainConfig,
        layout: ParallelConfig,
        given: &[String],
    ) -> Result<Prepared> {
        let set = |flag: &str| given.iter().any(|g| g == flag);
        // run.json's model is the checkpoint's unless the file was edited
        // (outside its settings' checksum): said before anything is sized by it
        if self.record.model != self.index.model {
            return Err(Error::checkpoint(
                self.dir.join(RUN_FILE),
                format!(
                    "names a model of {}, where its checkpoint holds one of {}: the file was edited",
                    self.record.model, self.index.model
                ),
            ));
        }
        let data = TaskData::from_record(&self.record, &self.index.tokenizer, &self.dir)?;
        let (mut cfg, mut par) = (self.record.train, self.record.parallel);
        take_settings(&mut cfg, flags, set);
        take_layout(&mut par, &layout, set, self.index.step);
        cfg.resume = Some(self.ckpt);
        cfg.out_dir = self.dir;
        Ok(Prepared {
            data,
            cfg,
            par,
            lock: self.lock,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::{Pipeline, Schedule};

    /// A resume onto one stage leaves the pipeline's schedule with its
    /// stages (a gpipe run resumed with `--pp 1` was refused: "--schedule
    /// gpipe ... needs --pp 2 or more"); onto other stages it keeps it.
    #[test]
    fn a_resume_onto_one_stage_leaves_the_schedule_behind() {
        let recorded = ParallelConfig {
            world_size: 2,
            pipeline: Pipeline::new(2, Schedule::GPipe, 1),
            ..ParallelConfig::single()
        };
        let resume = |stages: usize| {
            let line = ParallelConfig {
                pipeline: Pipeline::new(stages, Schedule::OneFOneB, 1),
                ..ParallelConfig::single()
            };
            let mut p = recorded;
            take_layout(&mut p, &line, |f| f == "pp", 3);
            p.pipeline
        };
        assert_eq!(resume(1), Pipeline::new(1, Schedule::OneFOneB, 1));
        assert_eq!(resume(4), Pipeline::new(4, Schedule::GPipe, 1));
    }

    /// A run that offloaded fsdp's parameters, resumed under a strategy
    /// that holds whole parameters, offloads its optimizer (it kept
    /// `params`, and the resume was refused for a flag not given); an
    /// `--offload` given, or fsdp kept, is taken as it is.
    #[test]
    fn leaving_fsdp_a_resume_offloads_the_optimizer_not_the_parameters() {
        let recorded = ParallelConfig {
            strategy: StrategyKind::Fsdp,
            world_size: 2,
            offload: Offload::Params,
            ..ParallelConfig::single()
        };
        let resume = |strategy: StrategyKind, flags: &[&str]| {
            let line = ParallelConfig {
                strategy,
                world_size: 2,
                ..ParallelConfig::single()
            };
            let mut p = recorded;
            take_layout(&mut p, &line, |f| flags.contains(&f), 3);
            p.offload
        };
        assert_eq!(
            resume(StrategyKind::Zero2, &["strategy"]),
            Offload::Optimizer
        );
        assert_eq!(resume(StrategyKind::Fsdp, &["world_size"]), Offload::Params);
        let given = resume(StrategyKind::Zero2, &["strategy", "offload"]);
        assert_eq!(given, Offload::None);
    }
}
