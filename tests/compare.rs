//! `compare` end to end on a small matrix: every strategy follows `single`,
//! each cell keeps its repeats, and the report directory holds the tables
//! (summary first) and every figure file; a stopped matrix writes a partial report.

#[path = "support/scratch.rs"]
mod scratch;
use scratch::scratch;

use distgpt::compare::{self, CompareSpec, Comparison, Layout};
use distgpt::data::{Dataset, TokenizerKind};
use distgpt::model::GptConfig;
use distgpt::parallel::StrategyKind;
use distgpt::train::Duration;
use indicatif::{MultiProgress, ProgressDrawTarget};

#[test]
fn compare_writes_the_report_and_strategies_match_single() {
    let mut ds = Dataset::load(None, TokenizerKind::Char).unwrap();
    ds.train = ds.train.head(4096);
    let mut model = GptConfig::preset("tiny").unwrap();
    model.vocab_size = ds.tokenizer.vocab_size();
    let dir = tempfile_dir("compare");
    let spec = CompareSpec {
        models: vec![("tiny".into(), model.into())],
        layouts: vec![
            Layout::Single,
            Layout::Ddp,
            Layout::Fsdp,
            Layout::Tp,
            Layout::Mesh,
            Layout::Pp,
            Layout::Gpipe,
        ],
        world_sizes: vec![2],
        batch_sizes: vec![4, 8],
        seq_len: 32,
        grad_accum: 2,
        duration: Duration::Epochs(2.0),
        lr: 3e-3,
        seed: 5,
        eval_batches: 2,
        out_dir: dir.clone(),
        threads: 2,
        predict: false,
        repeats: 2,
        announce_estimate: false,
    };
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
    let done = compare::run(&spec, &ds, &multi).unwrap();
    assert!(!done.stopped);
    let results = &done.results;
    // single, ddp, fsdp, tp, pp and gpipe at batches 4 and 8; mesh needs 4
    // ranks and is skipped
    assert_eq!(results.len(), 12);
    for r in results {
        assert_eq!(r.repeats.len(), 2, "{}: every repeat is kept", r.label);
        let t = r.tokens_per_s_spread();
        assert!(t.min <= t.median && t.median <= t.max);
        assert_eq!(r.step_ms, r.step_ms_spread().median);
        let dev = r
            .max_loss_deviation_from_single
            .expect("a single run at the same batch");
        assert!(
            dev <= 1e-4,
            "{} batch {}: loss deviates {dev:e} from single",
            r.label,
            r.batch
        );
        assert_eq!(r.per_epoch.len(), 2, "{}: two epochs", r.label);
        assert!(r.tokens_per_s > 0.0 && r.max_peak().total > 0);
        // a rank's share of the throughput, and an epoch at the step's
        // pace: the steps over the epochs they read
        let per_rank = r.tokens_per_s / r.world_size as f64;
        assert!((r.tokens_per_s_per_rank - per_rank).abs() <= 1e-9 * per_rank);
        let epoch_s = r.step_ms / 1e3 * r.steps as f64 / r.epochs;
        assert!(
            (r.time_per_epoch_s - epoch_s).abs() <= 1e-9 * epoch_s,
            "{}: {} s an epoch, {epoch_s} by its steps",
            r.label,
            r.time_per_epoch_s
        );
        // a pipeline's last step is timed on both ranks: 2 micro-batches
        // forward and backward each, and its bubble measured
        let piped = r.pipeline.stages > 1;
        assert_eq!(r.timelines.len(), if piped { 2 } else { 0 }, "{}", r.label);
        assert!(r.timelines.iter().all(|t| t.len() == 4), "{}", r.label);
        assert_eq!(r.bubble.is_some(), piped, "{}", r.label);
        if let (Some(b), Some(f)) = (r.bubble, r.bubble_formula) {
            assert!((0.0..1.0).contains(&b), "{}: bubble {b}", r.label);
            assert!(
                (f - 1.0 / 3.0).abs() < 1e-12,
                "p 2, m 2: (p - 1)/(m + p - 1)"
            );
        }
        if r.strategy == StrategyKind::Fsdp {
            let single = results
                .iter()
                .find(|s| s.strategy == StrategyKind::Single && s.batch == r.batch)
                .unwrap();
            assert!(
                r.max_peak().optimizer * 2 <= single.max_peak().optimizer + 64,
                "fsdp halves the optimizer state"
            );
        }
    }
    compare::report::write(&spec, &done, "distgpt compare (test)").unwrap();
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + results.len());
    // each row says which cell it is: ddp, pp and gpipe are all ddp x2
    let mut lines = csv.lines().map(|l| l.split(',').collect::<Vec<_>>());
    let header = lines.next().unwrap();
    let column = |name| header.iter().position(|h| *h == name).unwrap();
    let (layout, batch) = (column("layout"), column("batch"));
    let mut keys: Vec<(String, String)> = lines
        .map(|row| (row[layout].to_string(), row[batch].to_string()))
        .collect();
    assert!(keys.iter().any(|(l, _)| l.contains("gpipe")), "{keys:?}");
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), results.len(), "{csv}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.starts_with("# distgpt compare\n\n## Summary\n\n- **Fastest:** tiny "),
        "the summary comes first: {md}"
    );
    for line in [
        "- **Smallest peak memory per rank:** tiny ",
        "- **Equivalence:** ",
        "- **Noise:** the repeats of a cell spread by ",
    ] {
        assert!(md.contains(line), "summary has {line:?}: {md}");
    }
    assert!(
        !md.contains("GiB") && !md.contains("Partial"),
        "MiB only, complete: {md}"
    );
    assert!(md.contains("| tiny | fsdp x2 | 8 |"), "{md}");
    for stem in [
        "throughput_vs_batch",
        "step_time_vs_batch",
        "memory_vs_batch",
        "time_per_epoch",
        "memory_per_epoch",
        "grad_norm_per_epoch",
        "loss_curves",
    ] {
        let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{stem}.png is a PNG");
        let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("fsdp x2"),
            "{stem}.svg has its legend"
        );
        assert!(
            md.contains(&format!("({stem}.png)")),
            "report embeds {stem}.png"
        );
    }
    for schedule in ["1f1b", "gpipe"] {
        let stem = format!("timeline-tiny-ddp-x2-{schedule}-b8");
        let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{stem}.png is a PNG");
        let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
        assert!(
            svg.contains("rank 1 (stage 1)") && svg.contains("backward"),
            "{stem}.svg"
        );
        assert!(
            md.contains(&format!("({stem}.png)")),
            "report embeds {stem}.png"
        );
    }
    // a matrix stopped after its first cell reports that cell and says so
    let partial = Comparison {
        results: results[..1].to_vec(),
        calibrations: Vec::new(),
        planned_cells: done.planned_cells,
        stopped: true,
    };
    compare::report::write(&spec, &partial, "distgpt compare (test)").unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.starts_with(&format!(
            "# distgpt compare\n\n## Summary\n\n- **Partial report:** stopped by a signal after 1 of {} cells",
            done.planned_cells
        )),
        "{md}"
    );
    std::fs::remove_dir_all(dir).ok();
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let d = scratch(name);
    std::fs::create_dir_all(&d).unwrap();
    d
}
