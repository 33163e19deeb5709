//! Training-state checkpoints, sharded: every rank writes the parameters
//! and AdamW moments it owns (`rank_R.safetensors`, with its whole-layout
//! segments and checksum in `rank_R.json`), rank 0 writes `index.json`
//! (step, loader position, world size, strategy, files). A checkpoint is
//! written into `step_N.tmp/` and renamed to `step_N/` only when complete,
//! so a crash mid-write never touches the last good one. Loading gathers
//! every file into whole-layout buffers, so any strategy and world size can
//! resume from any other. The index carries its own checksum and every
//! segment is checked against the layout, so an edited or crafted index is
//! refused instead of resuming a step never trained; a checkpoint holding a
//! non-finite value is never published.

use crate::backend::cpu::blas::{self, MatmulChoice};
use crate::comm::Comm;
use crate::data::{LoaderPosition, TokenizerSpec};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::parallel::OwnedState;
use crate::store::{
    checksum, json_checksum, stored_checksum, write_atomic, write_json, write_safetensors, Data,
};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Directory of checkpoints inside a run directory.
pub const DIR: &str = "checkpoints";
const INDEX: &str = "index.json";
const TENSORS: [&str; 3] = ["params", "m", "v"];
/// Version 2 added the index checksum, the tokenizer and the data fingerprint.
const FORMAT: u32 = 2;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Index {
    pub format: u32,
    /// [`json_checksum`] of the index with this field empty (checked by
    /// [`stored_checksum`] against the file as stored).
    pub checksum: String,
    /// Optimizer steps completed.
    pub step: usize,
    pub adam_step: u32,
    pub loader: LoaderPosition,
    pub world_size: usize,
    pub strategy: String,
    pub tp: usize,
    /// Floats in the whole-model layout.
    pub params_total: usize,
    pub model: ModelConfig,
    pub tokenizer: TokenizerSpec,
    /// A classifier's label names, in id order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// [`crate::data::Dataset::fingerprint`] of the data trained on.
    pub data: String,
    pub files: Vec<RankFile>,
    /// The CPU's matmul library per class of product when it was written
    /// (`backend::cpu::blas`): a resume runs on the same, so it continues
    /// bit for bit even if `distgpt devices --measure` chose another since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_matmul: Option<MatmulChoice>,
}

impl Index {
    /// The checksum this index should carry.
    pub fn compute_checksum(&self) -> String {
        json_checksum(&Index {
            checksum: String::new(),
            ..self.clone()
        })
    }

    /// Refuses an index whose numbers could not have been written by
    /// [`save`]: the segments must tile the model's layout exactly once.
    /// Its checksum is checked before it is parsed ([`read_index`]).
    fn validate(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "checkpoint format {} (this distgpt reads format {FORMAT})",
                self.format
            ));
        }
        self.model.validate().map_err(|e| e.to_string())?;
        let total = self.model.num_params();
        if self.params_total != total {
            return Err(format!(
                "params_total {} but its model has {total} parameters",
                self.params_total
            ));
        }
        if self.adam_step as usize != self.step {
            return Err(format!(
                "optimizer step {} differs from step {}",
                self.adam_step, self.step
            ));
        }
        let mut all = Vec::new();
        for f in &self.files {
            let plain = f.file.starts_with("rank_")
                && f.file.ends_with(".safetensors")
                && !f.file.contains(['/', '\\']);
            if !plain {
                return Err(format!("file name '{}' is not a rank file", f.file));
            }
            let mut floats = 0usize;
            for &(at, len) in &f.segments {
                if at.checked_add(len).is_none_or(|end| end > total) || len == 0 {
                    return Err(format!(
                        "{}: segment {at}+{len} lies outside the model's {total} parameters",
                        f.file
                    ));
                }
                floats += len;
                all.push((at, len, &f.file));
            }
            if floats != f.floats {
                return Err(format!(
                    "{}: segments hold {floats} floats, the file {}",
                    f.file, f.floats
                ));
            }
        }
        all.sort();
        let mut next = 0;
        for &(at, len, file) in &all {
            if at != next {
                return Err(if at < next {
                    format!("{file}: segment {at}+{len} overlaps another segment")
                } else {
                    format!("parameters {next}..{at} are in no file")
                });
            }
            next = at + len;
        }
        if next != total {
            return Err(format!("parameters {next}..{total} are in no file"));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RankFile {
    pub file: String,
    /// (offset in the whole layout, length) of each run, in file order.
    pub segments: Vec<(usize, usize)>,
    pub floats: usize,
    /// FNV-1a 64 of the file's bytes, hex.
    pub checksum: String,
}

fn io<T>(path: &Path, r: std::io::Result<T>) -> Result<T> {
    r.map_err(|e| Error::io(path, e))
}

/// What a save records besides the tensors.
pub struct SaveInfo<'a> {
    pub step: usize,
    pub adam_step: u32,
    pub loader: LoaderPosition,
    pub strategy: &'a str,
    pub tp: usize,
    pub params_total: usize,
    pub model: &'a ModelConfig,
    pub tokenizer: &'a TokenizerSpec,
    /// A classifier's label names (none for other tasks).
    pub labels: &'a [String],
    pub data: &'a str,
    /// Complete checkpoints to keep; older ones are removed.
    pub keep: usize,
    /// A file rank 0 writes into the checkpoint beside the index (name,
    /// contents): what a task needs to continue besides the tensors.
    pub extra: Option<(&'a str, String)>,
}

/// Collective: writes this rank's part and, on rank 0, the index; returns
/// the published checkpoint directory.
pub fn save(
    run_dir: &Path,
    info: &SaveInfo,
    owned: &OwnedState,
    world: &dyn Comm,
) -> Result<PathBuf> {
    let root = run_dir.join(DIR);
    let name = format!("step_{:08}", info.step);
    let (tmp, done) = (root.join(format!("{name}.tmp")), root.join(&name));
    let rank = world.rank();
    if rank == 0 {
        if tmp.exists() {
            io(&tmp, std::fs::remove_dir_all(&tmp))?;
        }
        io(&tmp, std::fs::create_dir_all(&tmp))?;
    }
    let saved = write_and_publish(&root, &tmp, &done, info, owned, world);
    if saved.is_err() && rank == 0 {
        // a failed write (a full disk) leaves no part of it filling the disk
        let _ = std::fs::remove_dir_all(&tmp);
    }
    saved.map(|()| done)
}

/// [`save`] once rank 0 has made `tmp`: every rank's part written into it,
/// then published as `done` by rank 0 where every value is finite.
fn write_and_publish(
    root: &Path,
    tmp: &Path,
    done: &Path,
    info: &SaveInfo,
    owned: &OwnedState,
    world: &dyn Comm,
) -> Result<()> {
    let rank = world.rank();
    // Checks and writes can take longer than --comm-timeout (a large model,
    // a slow disk): waiting for them is not a sign of a dead rank.
    world.barrier_after_io()?;
    let finite = |x: &[f32]| x.iter().all(|v| v.is_finite());
    let ok = finite(&owned.params) && finite(&owned.m) && finite(&owned.v);
    if ok && !owned.segments.is_empty() {
        write_part(tmp, rank, owned)?;
    }
    world.barrier_after_io()?;
    // Every rank is here now, so this is quick: a non-finite value anywhere
    // and nothing is published.
    let mut bad = [u32::from(!ok)];
    world.all_reduce(&mut bad)?;
    if bad[0] != 0 {
        return Err(Error::Diverged(format!(
            "the state after step {} holds non-finite values; no checkpoint was written",
            info.step
        )));
    }
    if rank == 0 {
        publish(root, tmp, done, info, world.size())?;
    }
    world.barrier_after_io()
}

/// This rank's part of the state: its params and moments as one
/// safetensors file, and what they hold (`rank_R.json`).
fn write_part(tmp: &Path, rank: usize, owned: &OwnedState) -> Result<()> {
    let n = owned.params.len();
    let tensors: Vec<_> = TENSORS
        .iter()
        .zip([&owned.params, &owned.m, &owned.v])
        .map(|(t, x)| (t.to_string(), Dtype::F32, vec![n], Data::F32(x)))
        .collect();
    let file = format!("rank_{rank}.safetensors");
    let sum = write_safetensors(&tmp.join(&file), &tensors)?;
    let meta = RankFile {
        file,
        segments: owned.segments.clone(),
        floats: n,
        checksum: sum,
    };
    write_atomic(
        &tmp.join(format!("rank_{rank}.json")),
        serde_json::to_string(&meta).expect("json").as_bytes(),
    )
}

/// Rank 0, every part written: the index over the ranks' parts, then
/// `tmp` renamed to `done` in `root`, and the oldest checkpoints past
/// `keep` pruned.
fn publish(root: &Path, tmp: &Path, done: &Path, info: &SaveInfo, world_size: usize) -> Result<()> {
    let mut files = Vec::new();
    for r in 0..world_size {
        let p = tmp.join(format!("rank_{r}.json"));
        if p.exists() {
            let text = io(&p, std::fs::read_to_string(&p))?;
            files.push(
                serde_json::from_str(&text).map_err(|e| Error::checkpoint(&p, e.to_string()))?,
            );
        }
    }
    let mut index = Index {
        format: FORMAT,
        checksum: String::new(),
        step: info.step,
        adam_step: info.adam_step,
        loader: info.loader,
        world_size,
        strategy: info.strategy.to_string(),
        tp: info.tp,
        params_total: info.params_total,
        model: info.model.clone(),
        tokenizer: info.tokenizer.clone(),
        labels: info.labels.to_vec(),
        data: info.data.to_string(),
        files,
        cpu_matmul: Some(blas::choice()),
    };
    index.checksum = index.compute_checksum();
    if let Some((name, text)) = &info.extra {
        write_atomic(&tmp.join(name), text.as_bytes())?;
    }
    write_json(&tmp.join(INDEX), &index)?;
    if done.exists() {
        io(done, std::fs::remove_dir_all(done))?;
    }
    io(done, std::fs::rename(tmp, done))?;
    io(root, std::fs::File::open(root).and_then(|d| d.sync_all()))?;
    prune(root, info.keep)
}

/// Complete checkpoints (`step_N/` with an index), oldest first.
pub fn list(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let dirs = step_dirs(run_dir)?;
    Ok(dirs
        .into_iter()
        .filter(|p| p.join(INDEX).exists())
        .collect())
}

/// The checkpoint folders of the run in `run_dir` past `step` that lack
/// their index (a damaged checkpoint: one being written is `step_N.tmp`),
/// by step.
pub fn damaged_after(run_dir: &Path, step: usize) -> Vec<PathBuf> {
    let dirs = step_dirs(run_dir).unwrap_or_default();
    let past = |p: &PathBuf| step_of(p).is_some_and(|s| s > step) && !p.join(INDEX).exists();
    dirs.into_iter().filter(past).collect()
}

/// Every `step_N` folder of the run in `run_dir`, complete or not (none
/// being written: those are `step_N.tmp`), by step: past 10^8 the eight
/// digits grow a ninth, which sorts first as text.
fn step_dirs(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let root = run_dir.join(DIR);
    if !root.exists() {
        return Ok(Vec::new());
    }
    let mut dirs: Vec<PathBuf> = io(&root, std::fs::read_dir(&root))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step_"))
                && p.extension().is_none()
        })
        .collect();
    dirs.sort_by_key(|p| (step_of(p), p.clone()));
    Ok(dirs)
}

fn prune(root: &Path, keep: usize) -> Result<()> {
    let all = list(root.parent().expect("checkpoints live in a run directory"))?;
    for old in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        io(old, std::fs::remove_dir_all(old))?;
    }
    // the writes a kill cut short (`step_N.tmp`): none is in progress once
    // a checkpoint is published, and one of a step never saved again (a
    // stop's) would hold its space for good
    for entry in io(root, std::fs::read_dir(root))?.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("step_") && name.ends_with(".tmp") {
            let path = entry.path();
            io(&path, std::fs::remove_dir_all(&path))?;
        }
    }
    Ok(())
}

/// The step a checkpoint directory (`step_N`) holds.
pub fn step_of(dir: &Path) -> Option<usize> {
    dir.file_name()?
        .to_str()?
        .strip_prefix("step_")?
        .parse()
        .ok()
}

/// The run's complete checkpoint of step `step`.
pub fn at_step(run_dir: &Path, step: usize) -> Result<PathBuf> {
    let all = list(run_dir)?;
    all.iter()
        .find(|d| step_of(d) == Some(step))
        .cloned()
        .ok_or_else(|| {
            let have: Vec<String> = all
                .iter()
                .filter_map(|d| step_of(d).map(|s| s.to_string()))
                .collect();
            Error::Input(format!(
                "{}: no complete checkpoint of step {step} (there are: {})",
                run_dir.display(),
                if have.is_empty() {
                    "none".to_string()
                } else {
                    have.join(", ")
                }
            ))
        })
}

/// Moves the run's checkpoints of steps after `step` to
/// `checkpoints/superseded/`, so that a run resumed from an older
/// checkpoint keeps its own as the newest; returns where they went.
pub fn supersede_after(run_dir: &Path, step: usize) -> Result<Vec<PathBuf>> {
    let aside = run_dir.join(DIR).join("superseded");
    let mut moved = Vec::new();
    for dir in list(run_dir)?
        .into_iter()
        .filter(|d| step_of(d).is_some_and(|s| s > step))
    {
        io(&aside, std::fs::create_dir_all(&aside))?;
        let mut to = aside.join(dir.file_name().expect("step_N"));
        let mut n = 1;
        while to.exists() {
            n += 1;
            to = aside.join(format!(
                "{}-{n}",
                dir.file_name().expect("step_N").to_string_lossy()
            ));
        }
        io(&dir, std::fs::rename(&dir, &to))?;
        moved.push(to);
    }
    Ok(moved)
}

/// The newest complete checkpoint of a run, or a checkpoint directory itself.
pub fn latest(path: &Path) -> Result<PathBuf> {
    super::existing_dir(path)?;
    if path.join(INDEX).exists() {
        return Ok(path.to_path_buf());
    }
    list(path)?.pop().ok_or_else(|| {
        Error::Input(format!(
            "{} holds no complete checkpoint ({DIR}/step_N with its {INDEX})",
            path.display()
        ))
    })
}

/// A checkpoint gathered into whole-layout buffers.
pub struct Loaded {
    pub index: Index,
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// Reads and verifies a checkpoint's index (not its tensor files).
pub fn read_index(dir: &Path) -> Result<Index> {
    let index_path = dir.join(INDEX);
    let text = crate::store::read_text(&index_path)?;
    let bad = |reason: String| Error::checkpoint(&index_path, reason);
    let (sum, recorded) = stored_checksum(&text).map_err(|e| bad(format!("invalid index: {e}")))?;
    if sum != recorded {
        return Err(bad(format!(
            "index checksum {sum} does not match the recorded {recorded}: the index was edited or corrupted"
        )));
    }
    let index: Index =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid index: {e}")))?;
    index.validate().map_err(bad)?;
    match step_of(dir) {
        Some(named) if named != index.step => Err(bad(format!(
            "it holds step {}, not the step {named} its folder is named for: a checkpoint renamed, or copied from elsewhere",
            index.step
        ))),
        _ => Ok(index),
    }
}

/// Reads and verifies every file of a checkpoint directory.
pub fn load(dir: &Path) -> Result<Loaded> {
    let index = read_index(dir)?;
    let total = index.params_total;
    // The files must hold what the index promises before anything that size
    // is allocated (the segments tile the layout, so this bounds it by the disk).
    for f in &index.files {
        let path = dir.join(&f.file);
        crate::store::regular_file(&path)?;
        let bytes = io(&path, std::fs::metadata(&path))?.len();
        if bytes < 4 * f.floats as u64 {
            let floats = f.floats;
            return Err(Error::checkpoint(path, format!("{bytes} bytes cannot hold the {floats} floats the index lists: the file is truncated")));
        }
    }
    let mut bufs = [
        vec![0.0f32; total],
        vec![0.0f32; total],
        vec![0.0f32; total],
    ];
    for f in &index.files {
        let path = dir.join(&f.file);
        let bad = |reason: String| Error::checkpoint(&path, reason);
        let bytes = io(&path, std::fs::read(&path))?;
        let sum = checksum(&bytes);
        if sum != f.checksum {
            return Err(bad(format!(
                "checksum {sum} does not match the index's {}: the file is truncated or corrupted",
                f.checksum
            )));
        }
        let st = crate::store::read_safetensors(&bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        for (name, buf) in TENSORS.iter().zip(bufs.iter_mut()) {
            let view = st
                .tensor(name)
                .map_err(|_| bad(format!("missing tensor '{name}'")))?;
            if view.dtype() != Dtype::F32 {
                return Err(bad(format!(
                    "tensor '{name}' has dtype {:?}, expected F32",
                    view.dtype()
                )));
            }
            if view.shape() != [f.floats] {
                return Err(bad(format!(
                    "tensor '{name}' has shape {:?}, expected [{}]",
                    view.shape(),
                    f.floats
                )));
            }
            let mut vals = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")));
            for &(at, len) in &f.segments {
                buf[at..at + len]
                    .iter_mut()
                    .zip(vals.by_ref())
                    .for_each(|(d, x)| *d = x);
            }
        }
    }
    let [params, m, v] = bufs;
    for (name, buf) in TENSORS.iter().zip([&params, &m, &v]) {
        if let Some(i) = buf.iter().position(|x| !x.is_finite()) {
            return Err(Error::checkpoint(
                dir,
                format!("'{name}' holds {} at parameter {i}", buf[i]),
            ));
        }
    }
    Ok(Loaded {
        index,
        params,
        m,
        v,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_step_directories_are_checkpoints() {
        let run = crate::testdir::TestDir::new("list");
        let root = run.path().join(DIR);
        let make = |name: &str, index: bool| {
            std::fs::create_dir_all(root.join(name)).unwrap();
            if index {
                std::fs::write(root.join(name).join(INDEX), "{}").unwrap();
            }
        };
        assert!(
            list(run.path()).unwrap().is_empty(),
            "no checkpoints folder"
        );
        make("step_00000020", true);
        make("step_00000010", true);
        // a write cut short (no index), a folder of another name with one,
        // and a step still being written under its temporary name
        make("step_00000030", false);
        make("notes", true);
        make("step_00000040.tmp", true);
        let names = || -> Vec<String> {
            list(run.path())
                .unwrap()
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(names(), ["step_00000010", "step_00000020"]);
        // by step, past the eight digits a name has up to step 10^8 - 1
        // (as text "step_1..." sorts before "step_9...")
        make("step_100000000", true);
        make("step_99999999", true);
        let all = names();
        assert_eq!(all[2..], ["step_99999999", "step_100000000"]);
    }
}
