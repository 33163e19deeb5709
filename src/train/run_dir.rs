//! A run directory's life: a readable default name and a `latest` link, the
//! refusal to start a new run where another one lives, `run.json` (what the
//! run is and which invocations trained it) and `metrics.jsonl` cut back to
//! the checkpoint a run resumes from, so no step is ever logged twice.

use super::task::TaskKind;
use super::TrainConfig;
use crate::checkpoint::state;
use crate::comm::CommStats;
use crate::error::{Error, Result};
use crate::metrics::tensorboard::EventWriter;
use crate::metrics::{timestamp, unix_now, LineWriter, StepRecord, MIB};
use crate::model::files::{MODEL_FILES, WEIGHTS_FILE};
use crate::model::{ModelConfig, Precision};
use crate::parallel::ParallelConfig;
use crate::store::{json_checksum, stage, Staged};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

/// `run.json`: the run's model and the configuration a resume continues
/// with, and every invocation that trained it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// What the run trains (absent in records before BERT runs had one: lm).
    #[serde(default)]
    pub task: TaskKind,
    pub model: ModelConfig,
    pub train: TrainConfig,
    /// The layout of the newest invocation.
    pub parallel: ParallelConfig,
    pub dataset: String,
    pub device: String,
    /// The peak FLOP/s the run's MFU is stated against: all its ranks'
    /// together (before 2026-12-07, one rank's: a share of the process's
    /// for thread ranks, one process's or GPU's under mpirun or NCCL).
    pub peak_flops: f64,
    #[serde(default)]
    pub segments: Vec<Segment>,
}

/// One invocation of `train` on a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Segment {
    /// The step it started from (0 for the first).
    pub from_step: usize,
    /// The step it was to end at.
    pub to_step: usize,
    pub parallel: ParallelConfig,
    pub device: String,
    /// Seconds since the Unix epoch when it started.
    pub started_unix: u64,
    /// [`settings_checksum`] of what it trained with (absent in records
    /// written before segments kept it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<String>,
}

/// A checksum of the settings that decide what a run computes: its
/// configuration less what only changes what is shown (messages, log
/// cadence, the peak MFU divides by, TensorBoard files) and where it is
/// (its folder, however spelled or moved), and its matmuls' precision.
/// The layout (strategy, ranks, tp, pp, recomputation, offload), the
/// device and the CPU's matmul library are left out: each computes the
/// same run to float tolerance, as resuming into another
/// layout does (`tests/strategies.rs`, `tests/checkpoints.rs`); bf16
/// rounds every matmul's operands, another run. A field added to
/// [`TrainConfig`] must serialise to nothing at its default (or be left out
/// here), or every recorded run's checksum changes and none resumes.
pub fn settings_checksum(t: &TrainConfig, par: &ParallelConfig) -> String {
    json_checksum(&settings(t, par))
}

/// The settings [`settings_checksum`] counts, as JSON.
pub fn settings(t: &TrainConfig, par: &ParallelConfig) -> serde_json::Value {
    let here = TrainConfig {
        out_dir: PathBuf::new(),
        ..t.clone()
    };
    counted(&here, par)
}

/// Whether `sum`, a segment's checksum, is that of the settings `t`,
/// `par`: as [`settings_checksum`] counts them, or as records before
/// 2026-12-07 did, the run's folder among them (as `t` spells it: a
/// segment of an older record that spelled it otherwise does not match).
pub fn trained_with(sum: &str, t: &TrainConfig, par: &ParallelConfig) -> bool {
    sum == settings_checksum(t, par) || sum == counted_checksum(t, par)
}

/// [`settings_checksum`] of `t` with its folder as it is.
fn counted_checksum(t: &TrainConfig, par: &ParallelConfig) -> String {
    json_checksum(&counted(t, par))
}

/// [`settings`] of `t` with its folder as it is.
fn counted(t: &TrainConfig, par: &ParallelConfig) -> serde_json::Value {
    let mut v = serde_json::to_value(TrainConfig {
        verbose: false,
        log_every: 0,
        peak_flops: None,
        tensorboard: None,
        ..t.clone()
    })
    .expect("a training config serialises");
    // over the duration's first spelling (`{"Steps": N}`), so the checksums
    // of runs recorded before it was lowercased still compare equal
    if let Some(d) = v.get_mut("duration").and_then(|d| d.as_object_mut()) {
        *d = std::mem::take(d)
            .into_iter()
            .map(|(k, x)| (k[..1].to_uppercase() + &k[1..], x))
            .collect();
    }
    // fp32 adds nothing, so the checksums of runs recorded before
    // precision counted still compare equal
    if par.precision != Precision::Fp32 {
        v["precision"] = serde_json::to_value(par.precision).expect("a precision serialises");
    }
    v
}

pub const RUN_FILE: &str = "run.json";
pub const METRICS_FILE: &str = "metrics.jsonl";
pub const METRICS_CSV: &str = "metrics.csv";
/// The link beside default-named runs to the newest one.
pub const LATEST: &str = "latest";

/// `runs/<model>-<YYYYMMDD-HHMMSS>`, with a suffix if that exists already.
/// The directory is reserved by creating it (two runs started in the same
/// second get two directories), except on an MPI process other than rank 0,
/// which takes rank 0's name later and must leave no directory of its own.
pub fn default_run_dir(model: &str) -> PathBuf {
    let base = format!("{model}-{}", timestamp(unix_now()));
    reserve(Path::new("runs"), &base, lead_process())
}

/// Whether this process leads its job: any process outside mpirun, rank 0
/// under it (Open MPI, MPICH or PMIx). The lead alone creates and locks run
/// directories and says what a command is starting.
pub fn lead_process() -> bool {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok())
        .is_none_or(|r| r.trim() == "0")
}

/// `root/base`, or `root/base-N` for the first N free; created when
/// `create` (so no other process takes it), else only looked for.
fn reserve(root: &Path, base: &str, create: bool) -> PathBuf {
    let _ = std::fs::create_dir_all(root);
    let mut n = 1;
    loop {
        let dir = match n {
            1 => root.join(base),
            _ => root.join(format!("{base}-{n}")),
        };
        let free = match create {
            true => match std::fs::create_dir(&dir) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
                // any other failure is the run's to report when it writes there
                _ => true,
            },
            false => !dir.exists(),
        };
        if free {
            return dir;
        }
        n += 1;
    }
}

/// The file in a run directory whose advisory lock a training process holds
/// for the run's life; it names the holder's pid.
pub const LOCK_FILE: &str = ".lock";

/// A held lock on a run directory (released when the last of its handles
/// is dropped or the process ends); an MPI job's other processes hold
/// none, rank 0's covers the job.
pub struct RunLock {
    _file: Option<Arc<std::fs::File>>,
}

/// Locks this process took to hand over (canonical paths): a resume's,
/// held from its first read of the run, which the run's outputs take over
/// with the next [`lock`] of the folder.
static HANDED: Mutex<Vec<(PathBuf, Weak<std::fs::File>)>> = Mutex::new(Vec::new());

/// Takes `dir`'s lock (creating the directory), or refuses naming the
/// process that holds it: two jobs never write one run. Under mpirun only
/// rank 0's process locks (the job's other processes would find it held).
/// A lock this process took to hand over ([`lock_to_hand_over`]) is
/// shared, once; any other it holds refuses as another process's would.
pub fn lock(dir: &Path) -> Result<RunLock> {
    take_lock(dir, false)
}

/// [`lock`], to be handed over: the next `lock` of `dir` in this process
/// shares it, so the folder is never unlocked in between.
pub fn lock_to_hand_over(dir: &Path) -> Result<RunLock> {
    take_lock(dir, true)
}

fn take_lock(dir: &Path, hand_over: bool) -> Result<RunLock> {
    use std::io::{Read, Seek, Write};
    if !lead_process() {
        return Ok(RunLock { _file: None });
    }
    if dir.exists() && !dir.is_dir() {
        return Err(Error::Input(format!(
            "{} is a file: a run's --out is a folder",
            dir.display()
        )));
    }
    // `RUN/checkpoints/step_N`'s run, given from inside the run, is ""
    let here = match dir.as_os_str().is_empty() {
        true => Path::new("."),
        false => dir,
    };
    std::fs::create_dir_all(here).map_err(|e| Error::io(here, e))?;
    let canonical = here.canonicalize().map_err(|e| Error::io(here, e))?;
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    handed.retain(|(_, f)| f.strong_count() > 0);
    if let Some(i) = handed.iter().position(|(d, _)| *d == canonical) {
        if let Some(file) = handed.swap_remove(i).1.upgrade() {
            return Ok(RunLock { _file: Some(file) });
        }
    }
    let path = here.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {
            let me = std::process::id().to_string();
            file.set_len(0)
                .and_then(|()| file.rewind())
                .and_then(|()| file.write_all(me.as_bytes()))
                .map_err(|e| Error::io(&path, e))?;
            let file = Arc::new(file);
            if hand_over {
                handed.push((canonical, Arc::downgrade(&file)));
            }
            Ok(RunLock { _file: Some(file) })
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            // A holder writes its pid just after it locks: read again
            // for a moment while the file is still empty.
            let mut holder = String::new();
            for _ in 0..20 {
                let _ = file
                    .rewind()
                    .and_then(|()| file.read_to_string(&mut holder));
                if !holder.trim().is_empty() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let (pid, stop) = match holder.trim() {
                "" => (
                    String::new(),
                    "Ctrl-C or SIGTERM checkpoints it".to_string(),
                ),
                pid => (
                    format!(" (pid {pid})"),
                    format!("Ctrl-C or `kill -TERM {pid}` checkpoints it"),
                ),
            };
            Err(Error::Input(format!(
                "{} is in use: another distgpt process{pid} is training this run; wait for it to finish or stop it ({stop}) before resuming",
                dir.display()
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(Error::io(&path, e)),
    }
}

/// Points `<parent>/latest` at `dir` (replacing the link atomically).
fn link_latest(dir: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Ok(());
    };
    let link = parent.join(LATEST);
    let tmp = parent.join(format!(".{LATEST}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    #[cfg(unix)]
    std::os::unix::fs::symlink(name, &tmp).map_err(|e| Error::io(&tmp, e))?;
    #[cfg(not(unix))]
    std::fs::write(&tmp, name.to_string_lossy().as_bytes()).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &link).map_err(|e| Error::io(&link, e))
}

/// Whether `a` and `b` name one folder.
fn same_dir(a: &Path, b: &Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b)
}

/// Whether `dir` holds a distgpt run (what `--overwrite` may empty): a
/// `run.json` that is a run's record (its model, training and layout), not
/// only a name other tools use too (`checkpoints/`, `metrics.jsonl`).
pub fn holds_a_run(dir: &Path) -> bool {
    let Ok(text) = crate::store::read_text(&dir.join(RUN_FILE)) else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| {
        ["model", "train", "parallel"]
            .iter()
            .all(|k| v.get(k).is_some_and(serde_json::Value::is_object))
    })
}

/// Whether `path` is TensorBoard's: an event file, or a folder of only
/// those (a run's `--tensorboard`, inside its folder or the folder itself).
fn is_tensorboards(path: &Path) -> bool {
    let event = |p: &Path| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("events.out.tfevents."))
    };
    match std::fs::read_dir(path) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .all(|e| event(&e.path()) && !e.path().is_dir()),
        Err(_) => event(path),
    }
}

/// The entries of `dir` no run writes before its first checkpoint is
/// complete (its record, logs, lock, classifier summary and checkpoints
/// folder, the model files but their weights, each also as a `.tmp` that a
/// kill left, its TensorBoard event files, in the folder or one of their
/// own, and its `--tensorboard` folder `tensorboard`), sorted: none where a
/// new run may take the run's place without `--overwrite`.
fn foreign_entries(dir: &Path, tensorboard: Option<&Path>) -> Result<Vec<String>> {
    let ours = [
        RUN_FILE,
        METRICS_FILE,
        METRICS_CSV,
        LOCK_FILE,
        state::DIR,
        super::classify::SUMMARY_FILE,
        "vocab.txt",
        "tokenizer_config.json",
    ];
    let mut foreign = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let written = name.strip_suffix(".tmp").unwrap_or(&name);
        let events = tensorboard.is_some_and(|t| same_dir(t, &path)) || is_tensorboards(&path);
        if !ours.contains(&written) && !MODEL_FILES.contains(&written) && !events {
            foreign.push(name.into_owned());
        }
    }
    foreign.sort();
    Ok(foreign)
}

/// Whether the run in `dir` has no complete checkpoint, none set aside and
/// no model weights: nothing a new run in its place would lose.
pub fn holds_nothing_to_keep(dir: &Path) -> Result<bool> {
    Ok(state::list(dir)?.is_empty()
        && !dir.join(state::DIR).join("superseded").exists()
        && !dir.join(WEIGHTS_FILE).exists())
}

/// Refuses `dir` as a new run's `--out` where it holds `entries` but no
/// run: nothing there is a run's to empty.
fn refuse_files_of_no_run(dir: &Path, entries: &[PathBuf]) -> Result<()> {
    match entries.is_empty() || holds_a_run(dir) {
        true => Ok(()),
        false => Err(Error::Input(format!(
            "{} is not empty and holds no run: --overwrite only empties run directories; choose a new --out",
            dir.display()
        ))),
    }
}

/// The entries of `dir` but the lock file (none where it is absent).
fn entries_but_the_lock(dir: &Path) -> Result<Vec<PathBuf>> {
    match std::fs::read_dir(dir) {
        Ok(e) => Ok(e
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().is_none_or(|n| n != LOCK_FILE))
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io(dir, e)),
    }
}

/// Makes `dir` ready for a new run: it must be absent or empty, unless
/// `cfg.overwrite` and it holds a run (and none of the run's inputs), which
/// is then emptied.
fn prepare_new(dir: &Path, cfg: &TrainConfig) -> Result<()> {
    let overwrite = cfg.overwrite;
    let entries = entries_but_the_lock(dir)?;
    // a run stopped before its first checkpoint was complete has nothing
    // to resume or keep: a new run takes its place
    let stopped = !overwrite && holds_a_run(dir) && holds_nothing_to_keep(dir)?;
    let foreign = match stopped {
        true => foreign_entries(dir, cfg.tensorboard.as_deref())?,
        false => Vec::new(),
    };
    if let Some(first) = foreign.first() {
        return Err(Error::Input(format!(
            "{} holds a run stopped before its first checkpoint, and {} no run writes ({first}{}): \
             choose a new --out, or pass --overwrite to empty it",
            dir.display(),
            crate::metrics::count(foreign.len(), "item"),
            if foreign.len() > 1 { ", ..." } else { "" }
        )));
    }
    if stopped {
        crate::errln!(
            "{} holds a run stopped before its first checkpoint was complete (nothing to resume, no model files): starting a new run in its place",
            dir.display()
        );
    }
    if !entries.is_empty() {
        if !overwrite && !stopped && holds_a_run(dir) {
            return Err(Error::Input(format!(
                "{} is not empty (it holds a run): continue that run with `--resume {0}`, choose a new --out, or pass --overwrite to empty it first",
                dir.display(),
            )));
        }
        refuse_files_of_no_run(dir, &entries)?;
        let inside = |p: &&PathBuf| match (p.canonicalize(), dir.canonicalize()) {
            (Ok(p), Ok(d)) => p.starts_with(d),
            _ => false,
        };
        let inputs = [("--data", &cfg.data), ("--init-from", &cfg.init_from)];
        if let Some((flag, p)) = inputs
            .iter()
            .find_map(|(f, p)| Some((f, p.as_ref().filter(inside)?)))
        {
            return Err(Error::Input(format!(
                "{flag} {} is inside {}, which --overwrite would empty: move it out first, or choose a new --out",
                p.display(),
                dir.display()
            )));
        }
        for p in entries {
            let removed = if p.is_dir() && !p.is_symlink() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            removed.map_err(|e| Error::io(&p, e))?;
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))
}

/// The per-step logs of a run: `metrics.jsonl` and `metrics.csv`, and
/// TensorBoard event files where asked. `metrics.jsonl` is the run's
/// record; the others are auxiliary: one that fails is warned about once
/// and no longer written, so it never costs a step.
pub struct StepLogs {
    jsonl: LineWriter,
    csv: Option<LineWriter>,
    tensorboard: Option<EventWriter>,
    /// Rank 0's communication in the invocations before this one (a
    /// resumed run's last kept record's), which each record's adds on to.
    comm_before: CommStats,
    /// Held while the logs are open: the run's life.
    _lock: RunLock,
}

impl StepLogs {
    /// Writes `record` to every log, its communication counted from the
    /// run's first step; an error only when `metrics.jsonl` could not take
    /// it (the run should then stop with a checkpoint).
    pub fn write(&mut self, record: &StepRecord) -> Result<()> {
        let mut record = record.clone();
        record.comm.add(&self.comm_before);
        let record = &record;
        if let Some(csv) = &mut self.csv {
            if let Err(e) = csv.csv(record) {
                crate::errln!("warning: {e}; metrics.csv is no longer written (metrics.jsonl is)");
                self.csv = None;
            }
        }
        if let Some(tb) = &mut self.tensorboard {
            let written = tb
                .scalars(record.step, &tensorboard_scalars(record))
                .and_then(|()| tb.flush());
            if let Err(e) = written {
                crate::errln!("warning: {e}; TensorBoard events are no longer written (metrics.jsonl has every step)");
                self.tensorboard = None;
            }
        }
        self.jsonl.json(record)
    }
}

/// A step record's figures as TensorBoard scalars (validation ones on the
/// steps that have them).
fn tensorboard_scalars(r: &StepRecord) -> Vec<(&'static str, f64)> {
    let mut out = vec![
        ("train/loss", r.loss as f64),
        ("train/grad_norm", r.grad_norm as f64),
        ("train/lr", r.lr as f64),
        ("perf/tokens_per_s", r.tokens_per_s),
        ("perf/mfu", r.mfu),
        ("perf/step_ms", r.ms),
        (
            "memory/peak_total_mib",
            r.memory.peak_total_bytes as f64 / MIB,
        ),
        (
            "memory/params_mib",
            r.memory.current_bytes.params as f64 / MIB,
        ),
        (
            "memory/activations_peak_mib",
            r.memory.peak_bytes.activations as f64 / MIB,
        ),
    ];
    let val = [
        ("val/loss", r.val_loss.map(f64::from)),
        ("val/accuracy", r.val_accuracy),
        ("val/f1", r.val_f1),
    ];
    out.extend(val.into_iter().filter_map(|(k, v)| Some((k, v?))));
    out
}

/// Rank 0 only: readies `dir` for an invocation training steps
/// `start..to_step` (a new run's empty directory, or a resumed run's with
/// newer checkpoints set aside and the logs cut back to `start`), points
/// `latest` at it when asked, writes `run.json` and opens the step logs.
/// Every output is checked, and every file written in full (TensorBoard's
/// first events, the logs cut back, `run.json`), before anything of the run
/// changes, so a refused or failed invocation (a full disk) leaves a
/// resumed run's record as it was and a new run's directory empty.
pub fn open(
    dir: &Path,
    record: RunRecord,
    start: usize,
    to_step: usize,
    cfg: &TrainConfig,
    verbose: bool,
) -> Result<StepLogs> {
    // a folder of other files is refused before the lock is written into it
    if start == 0 && dir.is_dir() {
        refuse_files_of_no_run(dir, &entries_but_the_lock(dir)?)?;
    }
    // first, so a second process neither empties nor cuts back a live run
    let lock = lock(dir)?;
    if let Some(tb) = &cfg.tensorboard {
        if holds_a_run(tb) && !same_dir(tb, dir) {
            return Err(Error::Input(format!(
                "--tensorboard {} holds another training run: choose a folder of its own",
                tb.display()
            )));
        }
        EventWriter::check_dir(tb)?;
    }
    // a resume's logs read before anything moves: one it cannot cut back stops here
    let logs = match start {
        0 => prepare_new(dir, cfg).map(|()| Default::default()),
        _ => cut_metrics(dir, start),
    }?;
    let config = next_record(dir, record, start, to_step)?;
    let mut tensorboard = match &cfg.tensorboard {
        Some(tb) => Some(EventWriter::create(tb)?),
        None => None,
    };
    let opened = (|| {
        if let Some(w) = &mut tensorboard {
            if start > 0 {
                // TensorBoard drops the earlier files' steps after `start`
                w.session_start(start + 1)?;
            }
            w.text(start, "config", &format!("```json\n{config}\n```"))?;
            w.flush()?;
        }
        let mut staged = Vec::new();
        for (path, text) in logs.into_iter().flatten() {
            staged.push(stage(&path, |f| f.write_all(text.as_bytes()))?);
        }
        staged.push(stage(&dir.join(RUN_FILE), |f| {
            f.write_all(config.as_bytes())
        })?);
        if start > 0 {
            // Checkpoints of a branch abandoned by resuming from an older
            // one must not count as newer than this branch's own.
            let moved = state::supersede_after(dir, start)?;
            if verbose && !moved.is_empty() {
                crate::errln!(
                    "moved {} newer checkpoint(s) to {}",
                    moved.len(),
                    dir.join(state::DIR).join("superseded").display()
                );
            }
        }
        staged.into_iter().try_for_each(Staged::commit)?;
        resumed_logs(dir, start, cfg)
    })();
    match opened {
        Ok((jsonl, csv, comm_before)) => Ok(StepLogs {
            jsonl,
            csv: Some(csv),
            tensorboard,
            comm_before,
            _lock: lock,
        }),
        Err(e) => {
            // what this invocation began: its event file, a new run's files
            let began = tensorboard.iter().map(|w| w.path().to_path_buf());
            let new = [METRICS_FILE, METRICS_CSV, RUN_FILE].map(|f| dir.join(f));
            for path in began.chain(new.into_iter().filter(|_| start == 0)) {
                let _ = std::fs::remove_file(path);
            }
            // and a new run's event folder inside it, where nothing else is
            if let Some(tb) = cfg
                .tensorboard
                .as_ref()
                .filter(|tb| start == 0 && tb.starts_with(dir))
            {
                let _ = std::fs::remove_dir(tb);
            }
            Err(e)
        }
    }
}

/// The step logs opened for an invocation from `start`, once its record is
/// written, with the communication before it: a resumed run's logs kept
/// to `start` (a gap in them named), its earlier model's files removed.
fn resumed_logs(
    dir: &Path,
    start: usize,
    cfg: &TrainConfig,
) -> Result<(LineWriter, LineWriter, CommStats)> {
    let kept = match start {
        0 => Vec::new(),
        _ => read_metrics(dir).unwrap_or_default(),
    };
    if let Some(gap) = missing_steps(&kept, start) {
        crate::errln!(
            "warning: {} holds no record of step(s) {gap} before the checkpoint at step {start}: the run's log has a gap there",
            dir.join(METRICS_FILE).display()
        );
    }
    let comm_before = kept.last().map(|r| r.comm.clone()).unwrap_or_default();
    let jsonl = LineWriter::open(&dir.join(METRICS_FILE), start > 0, None)?;
    let header = Some(LineWriter::CSV_HEADER);
    let csv = LineWriter::open(&dir.join(METRICS_CSV), start > 0, header)?;
    if start > 0 {
        // an earlier model's files would be read for this run's (by eval,
        // export, --init-from) were it killed before writing its own: the
        // newest checkpoint stands for the model until then
        for file in MODEL_FILES {
            let path = dir.join(file);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::io(&path, e))
                }
                _ => {}
            }
        }
    }
    if cfg.link_latest {
        // A convenience: failing to point it (say `latest` is a real
        // directory) must not stop the run.
        if let Err(e) = link_latest(dir) {
            crate::errln!("warning: could not point the latest link at the run: {e}");
        }
    }
    Ok((jsonl, csv, comm_before))
}

/// Every step record of the run in `dir` (`metrics.jsonl`), in order; a
/// line a crash cut short is skipped.
pub fn read_metrics(dir: &Path) -> Result<Vec<StepRecord>> {
    let text = crate::store::read_text(&dir.join(METRICS_FILE))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Reads `run.json`, its data and init-from paths resolved
/// ([`RunRecord::resolve_paths`]).
pub fn read_record(dir: &Path) -> Result<RunRecord> {
    read_record_checked(dir, false)
}

/// [`read_record`] for a resume, which continues with the settings it
/// holds: refused where they are not those its newest invocation trained
/// with (its segment's [`settings_checksum`]), as when run.json was edited.
pub fn read_record_to_resume(dir: &Path) -> Result<RunRecord> {
    read_record_checked(dir, true)
}

fn read_record_checked(dir: &Path, settings: bool) -> Result<RunRecord> {
    let path = dir.join(RUN_FILE);
    let text = crate::store::read_text(&path)?;
    let bad = |reason: String| Error::checkpoint(&path, reason);
    let mut record: RunRecord =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid run record: {e}")))?;
    let edited = |s: &&Segment| {
        (s.settings.as_ref()).is_some_and(|sum| !trained_with(sum, &record.train, &record.parallel))
    };
    if let Some(s) = record.segments.last().filter(edited).filter(|_| settings) {
        return Err(bad(format!(
            "its settings are not those the run trained with from step {} (their checksum differs: the file was edited); a resume changes only what its flags may (--steps, --lr, --strategy, ...): undo the edit",
            s.from_step
        )));
    }
    record.resolve_paths(dir);
    Ok(record)
}

impl RunRecord {
    /// Resolves the data and init-from paths of a record in `run_dir`.
    /// Runs record them absolute; older records hold them as given,
    /// relative to a directory they do not name, and each is taken where it
    /// exists beside the run or above it, else as given (the current
    /// directory). Whichever file that finds, the data's fingerprint is
    /// still compared with the run's before it trains.
    pub fn resolve_paths(&mut self, run_dir: &Path) {
        let run_dir = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
        for p in [&mut self.train.data, &mut self.train.init_from]
            .into_iter()
            .flatten()
        {
            if p.is_relative() {
                let found = run_dir.ancestors().map(|d| d.join(&p)).find(|c| c.exists());
                if let Some(found) = found {
                    *p = std::fs::canonicalize(&found).unwrap_or(found);
                }
            }
        }
    }
}

/// The text of `run.json` for an invocation starting at `from_step`: a
/// new record, or the existing one with this invocation appended.
fn next_record(
    dir: &Path,
    mut fresh: RunRecord,
    from_step: usize,
    to_step: usize,
) -> Result<String> {
    let mut segments = if from_step > 0 {
        read_record(dir).map(|r| r.segments).unwrap_or_default()
    } else {
        Vec::new()
    };
    segments.retain(|s| s.from_step < from_step);
    if let Some(last) = (segments.last()).filter(|s| summing(&s.device) != summing(&fresh.device)) {
        crate::errln!(
            "note: the steps to {from_step} ran on {}, the steps from here on {}: another device or thread count adds in another order, so the run now follows an uninterrupted one to float tolerance, not bit for bit (resume on {} for that)",
            last.device,
            fresh.device,
            last.device
        );
    }
    segments.push(Segment {
        from_step,
        to_step,
        parallel: fresh.parallel,
        device: fresh.device.clone(),
        started_unix: unix_now(),
        settings: Some(settings_checksum(&fresh.train, &fresh.parallel)),
    });
    fresh.segments = segments;
    Ok(serde_json::to_string_pretty(&fresh).expect("records serialise"))
}

/// A device as a run's sums follow it: its description less what changes
/// from one opening to the next (a GPU's free memory, "..., 80647 of 81559
/// MiB free").
fn summing(device: &str) -> String {
    let free = " MiB free";
    match device
        .find(free)
        .and_then(|end| Some((device[..end].rfind(", ")?, end)))
    {
        Some((start, end)) => format!("{}{}", &device[..start], &device[end + free.len()..]),
        None => device.to_string(),
    }
}

/// The steps 1..=`to` that `records` (in order) lack, as spans ("3-4, 7"),
/// or None where none is missing.
fn missing_steps(records: &[StepRecord], to: usize) -> Option<String> {
    let mut spans: Vec<String> = Vec::new();
    let mut next = 1;
    for step in records.iter().map(|r| r.step).chain([to + 1]) {
        match step.saturating_sub(1) {
            last if last > next => spans.push(format!("{next}-{last}")),
            last if last == next => spans.push(next.to_string()),
            _ => {}
        }
        next = next.max(step + 1);
    }
    (!spans.is_empty()).then(|| spans.join(", "))
}

/// `metrics.jsonl` and `metrics.csv` cut back to the records of steps up
/// to `step` (a resume point), each with its new text where it changes:
/// later records go, and a last line a crash cut short; a file with any
/// other line it cannot read is refused.
fn cut_metrics(dir: &Path, step: usize) -> Result<[Option<(PathBuf, String)>; 2]> {
    let jsonl_step = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["step"].as_u64())
    };
    let jsonl = kept_lines(&dir.join(METRICS_FILE), step, false, jsonl_step)?;
    // A CSV row is complete when it has every column of the file's header
    // (files written before a column was added have fewer).
    let csv = dir.join(METRICS_CSV);
    let header = crate::store::read_text(&csv).unwrap_or_default();
    let columns = header.lines().next().unwrap_or_default().split(',').count();
    let now = LineWriter::CSV_HEADER.split(',').count();
    let csv_step = |line: &str| {
        let fields: Vec<&str> = line.split(',').collect();
        (fields.len() == columns || fields.len() == now)
            .then(|| fields[0].parse().ok())
            .flatten()
    };
    Ok([jsonl, kept_lines(&csv, step, true, csv_step)?])
}

/// `path` with the lines whose step is at most `step` (and the header line
/// when `header`), where that changes it; refused where a line before its
/// last has no step.
fn kept_lines(
    path: &Path,
    step: usize,
    header: bool,
    step_of: impl Fn(&str) -> Option<u64>,
) -> Result<Option<(PathBuf, String)>> {
    let text = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        _ => crate::store::read_text(path)?,
    };
    let (lines, mut kept) = (text.lines().count(), String::new());
    for (i, line) in text.lines().enumerate() {
        match step_of(line) {
            _ if header && i == 0 => {}
            Some(s) if s as usize > step => continue,
            Some(_) => {}
            // the last line, which a crash may have cut short
            None if i + 1 == lines => continue,
            None => {
                return Err(Error::checkpoint(path, format!("line {} is not a step record, and resuming would drop it: mend or remove it first", i + 1)))
            }
        }
        kept.extend([line, "\n"]);
    }
    Ok((kept != text).then(|| (path.to_path_buf(), kept)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::Duration;

    /// A pipe where a run's record belongs is refused by name, not read:
    /// a resume's logs (cut back to its step), the log `plan
    /// --efficiency-from` reads and the `run.json` that `--overwrite` looks
    /// for (opening one no one writes blocked for ever).
    #[test]
    fn a_pipe_where_a_runs_record_belongs_is_refused_not_read() {
        for file in [METRICS_FILE, METRICS_CSV] {
            let dir = crate::testdir::TestDir::new("fifo-logs");
            crate::store::pipes::make_fifo(&dir.path().join(file));
            let path = dir.path().to_path_buf();
            let e = crate::store::pipes::within_20_s(move || cut_metrics(&path, 3).map(|_| ()));
            let e = e.unwrap_err().to_string();
            assert!(e.contains(&format!("{file} is not a regular file")), "{e}");
        }
        let dir = crate::testdir::TestDir::new("fifo-metrics");
        crate::store::pipes::make_fifo(&dir.path().join(METRICS_FILE));
        let path = dir.path().to_path_buf();
        let e = crate::store::pipes::within_20_s(move || read_metrics(&path).map(|_| ()));
        let e = e.unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl is not a regular file"), "{e}");
        let dir = crate::testdir::TestDir::new("fifo-record");
        crate::store::pipes::make_fifo(&dir.path().join(RUN_FILE));
        let path = dir.path().to_path_buf();
        assert!(!crate::store::pipes::within_20_s(move || holds_a_run(
            &path
        )));
    }

    /// A lock taken to hand over (a resume's) is shared by the next lock
    /// of the run in this process (the run's outputs'), once: a third is
    /// refused as in use. The run stays locked to everyone else until the
    /// last handle goes.
    #[test]
    fn a_resumes_lock_is_handed_over_once_and_held_until_its_last_handle_goes() {
        let dir = crate::testdir::TestDir::new("lock-shared");
        let first = lock_to_hand_over(dir.path()).unwrap();
        let second = lock(dir.path()).unwrap();
        let third = lock(dir.path()).map(|_| ()).unwrap_err().to_string();
        assert!(third.contains("is in use"), "{third}");
        // another open of the lock file: what another process would meet
        let free = || {
            let path = dir.path().join(LOCK_FILE);
            let f = std::fs::File::options().read(true).write(true).open(path);
            f.unwrap().try_lock().is_ok()
        };
        assert!(!free());
        drop(first);
        assert!(!free());
        drop(second);
        assert!(free());
    }

    /// A process that meets the lock between its holder's lock and pid
    /// write (the file still empty) names the holder all the same.
    #[test]
    fn a_lock_met_before_its_holder_wrote_its_pid_names_the_holder() {
        use std::io::Write;
        let dir = crate::testdir::TestDir::new("lock-late-pid");
        let path = dir.path().join(LOCK_FILE);
        let mut holder = std::fs::File::create(&path).unwrap();
        holder.try_lock().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            holder.write_all(b"4242").unwrap();
            holder
        });
        let refused = lock(dir.path()).map(|_| ()).unwrap_err().to_string();
        drop(writer.join());
        assert!(refused.contains("(pid 4242)"), "{refused}");
    }

    /// A resume warns of the records its log lacks before the checkpoint
    /// (a metrics.jsonl cut or emptied by hand resumed without a word).
    #[test]
    fn the_steps_a_resumed_log_lacks_are_named_as_spans() {
        let records = |steps: &[usize]| -> Vec<StepRecord> {
            let at = |step| StepRecord {
                step,
                ..StepRecord::default()
            };
            steps.iter().map(|&s| at(s)).collect()
        };
        assert_eq!(missing_steps(&records(&[1, 2, 3, 4]), 4), None);
        assert_eq!(missing_steps(&records(&[1, 2]), 4).as_deref(), Some("3-4"));
        assert_eq!(missing_steps(&records(&[]), 4).as_deref(), Some("1-4"));
        assert_eq!(missing_steps(&records(&[1, 2, 4]), 4).as_deref(), Some("3"));
        assert_eq!(
            missing_steps(&records(&[2, 5, 6, 9]), 10).as_deref(),
            Some("1, 3-4, 7-8, 10")
        );
    }

    #[test]
    fn an_auxiliary_log_that_fails_is_dropped_and_the_record_is_not() {
        let dir = crate::testdir::TestDir::new("aux-logs");
        let full = Path::new("/dev/full");
        let logs = |jsonl: &Path| StepLogs {
            jsonl: LineWriter::open(jsonl, true, None).unwrap(),
            csv: Some(LineWriter::open(full, true, Some(LineWriter::CSV_HEADER)).unwrap()),
            tensorboard: Some(EventWriter::onto(full).unwrap()),
            comm_before: CommStats::default(),
            _lock: lock(dir.path()).unwrap(),
        };
        let record = |step| StepRecord {
            step,
            ..StepRecord::default()
        };
        let jsonl = dir.path().join(METRICS_FILE);
        let mut l = logs(&jsonl);
        for step in 1..=3 {
            l.write(&record(step))
                .expect("a full disk under an auxiliary log costs nothing");
        }
        assert!(l.csv.is_none() && l.tensorboard.is_none());
        let steps: Vec<usize> = read_metrics(dir.path())
            .unwrap()
            .iter()
            .map(|r| r.step)
            .collect();
        assert_eq!(steps, [1, 2, 3], "every step in the record");
        drop(l);
        let mut l = logs(full);
        assert!(
            l.write(&record(4)).is_err(),
            "the record's own failure is reported"
        );
    }

    #[test]
    fn runs_named_in_the_same_second_get_a_directory_each() {
        let scratch = crate::testdir::TestDir::new("reserve");
        let root = scratch.path().join("runs");
        let dirs: Vec<PathBuf> = (0..3).map(|_| reserve(&root, "tiny-x", true)).collect();
        assert_eq!(
            dirs,
            ["tiny-x", "tiny-x-2", "tiny-x-3"]
                .map(|d| root.join(d))
                .to_vec()
        );
        assert!(dirs.iter().all(|d| d.is_dir()));
        // a rank that only looks takes the next free name and makes nothing
        assert_eq!(reserve(&root, "tiny-x", false), root.join("tiny-x-4"));
        assert!(!root.join("tiny-x-4").exists());
    }

    /// run.json spells durations in lowercase, reads the Rust names older
    /// files have, and a run's settings checksum is what it was when they
    /// were written so, so older runs' segments still compare.
    #[test]
    fn durations_read_both_spellings_and_keep_their_checksums() {
        let cfg = TrainConfig {
            duration: Duration::Steps(5),
            verbose: false,
            log_every: 0,
            ..TrainConfig::default()
        };
        let mut v = serde_json::to_value(&cfg).unwrap();
        assert_eq!(v["duration"], serde_json::json!({"steps": 5}));
        for old in [r#"{"Steps": 5}"#, r#"{"steps": 5}"#] {
            let d: Duration = serde_json::from_str(old).unwrap();
            assert!(matches!(d, Duration::Steps(5)), "{old}");
        }
        // what the first spelling serialised to
        v["duration"] = serde_json::json!({"Steps": 5});
        assert!(trained_with(
            &json_checksum(&v),
            &cfg,
            &ParallelConfig::single()
        ));
        let e: Duration = serde_json::from_str(r#"{"Epochs": 1.5}"#).unwrap();
        assert!(matches!(e, Duration::Epochs(x) if x == 1.5));
    }

    /// A GPU's free memory, which changes between two openings of the
    /// same device, does not make it another device's sums.
    #[test]
    fn a_device_sums_alike_whatever_its_free_memory() {
        let at =
            |free: u32| format!("cuda (NVIDIA H100 80GB HBM3 (sm_90, {free} of 81559 MiB free))");
        assert_eq!(summing(&at(80647)), summing(&at(80611)));
        assert_eq!(summing(&at(80647)), "cuda (NVIDIA H100 80GB HBM3 (sm_90))");
        assert_ne!(summing("cpu (1 thread)"), summing("cpu (2 threads)"));
    }

    /// What decides the numbers moves the checksum (precision among them);
    /// the layout, the outputs and the messages do not.
    #[test]
    fn the_settings_checksum_counts_precision_and_not_the_layout_or_outputs() {
        use crate::parallel::{Offload, StrategyKind};
        let cfg = TrainConfig::default();
        let single = ParallelConfig::single();
        let base = settings_checksum(&cfg, &single);
        let bf16 = ParallelConfig {
            precision: Precision::Bf16,
            ..single
        };
        assert_ne!(settings_checksum(&cfg, &bf16), base);
        let layout = ParallelConfig {
            strategy: StrategyKind::Fsdp,
            world_size: 4,
            recompute: true,
            offload: Offload::Optimizer,
            ..single
        };
        assert_eq!(settings_checksum(&cfg, &layout), base);
        let shown = TrainConfig {
            tensorboard: Some("tb".into()),
            verbose: true,
            log_every: 7,
            peak_flops: Some(1e12),
            ..cfg.clone()
        };
        assert_eq!(settings_checksum(&shown, &single), base);
        let lr = TrainConfig {
            lr: cfg.lr / 2.0,
            ..cfg.clone()
        };
        assert_ne!(settings_checksum(&lr, &single), base);
        // the folder as spelled (`runs/latest`, a trailing /, moved) moves
        // nothing; a record before it did still reads as the same settings
        let moved = TrainConfig {
            out_dir: "elsewhere/run/".into(),
            ..cfg.clone()
        };
        assert_eq!(settings_checksum(&moved, &single), base);
        assert!(trained_with(
            &counted_checksum(&cfg, &single),
            &cfg,
            &single
        ));
        assert!(!trained_with(
            &counted_checksum(&cfg, &single),
            &moved,
            &single
        ));
    }
}
