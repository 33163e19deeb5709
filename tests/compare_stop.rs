//! A signal before `compare` starts stops it after the first step: the cut
//! run is left out and the matrix reports itself stopped. (Its own test
//! binary: the stop flag is process-wide.)

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::compare::{self, CompareSpec, Layout};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::train::{self, Duration};
use indicatif::{MultiProgress, ProgressDrawTarget};
use std::sync::atomic::Ordering;

#[test]
fn a_stopped_compare_keeps_only_finished_cells() {
    let mut ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    ds.train = ds.train.head(4096);
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    let dir = scratch("compare-stop");
    let spec = CompareSpec {
        models: vec![("tiny".into(), model.into())],
        layouts: vec![Layout::Single, Layout::Ddp],
        world_sizes: vec![2],
        batch_sizes: vec![4],
        seq_len: 32,
        grad_accum: 1,
        duration: Duration::Epochs(2.0),
        lr: 3e-3,
        seed: 5,
        eval_batches: 1,
        out_dir: dir.clone(),
        threads: 2,
        predict: false,
        repeats: 1,
        announce_estimate: false,
    };
    train::INTERRUPTED.store(true, Ordering::SeqCst);
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
    let done = compare::run(&spec, &ds, &multi).unwrap();
    assert!(done.stopped);
    assert_eq!(done.planned_cells, 2);
    assert!(done.results.is_empty(), "the cut first cell is left out");
    compare::report::write(&spec, &done, "distgpt compare (test)").unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("**Partial report:** stopped by a signal after 0 of 2 cells"),
        "{md}"
    );
    std::fs::remove_dir_all(dir).ok();
}
