//! `compare` end to end on a small matrix: every strategy follows `single`,
//! and the report directory holds the tables and all twelve figure files.

use distgpt::compare::{self, CompareSpec, Layout};
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
        models: vec![("tiny".into(), model)],
        layouts: vec![
            Layout::Single,
            Layout::Ddp,
            Layout::Fsdp,
            Layout::Tp,
            Layout::Mesh,
        ],
        world_sizes: vec![2],
        batch_sizes: vec![4, 8],
        seq_len: 32,
        duration: Duration::Epochs(2.0),
        lr: 3e-3,
        seed: 5,
        eval_batches: 2,
        out_dir: dir.clone(),
        threads: 2,
        predict: false,
    };
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
    let (results, _) = compare::run(&spec, &ds, &multi).unwrap();
    // single, ddp, fsdp, tp at batches 4 and 8; mesh needs 4 ranks and is skipped
    assert_eq!(results.len(), 8);
    for r in &results {
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
        assert!(r.tokens_per_s > 0.0 && r.max_peak()[5] > 0);
        if r.strategy == StrategyKind::Fsdp {
            let single = results
                .iter()
                .find(|s| s.strategy == StrategyKind::Single && s.batch == r.batch)
                .unwrap();
            assert!(
                r.max_peak()[2] * 2 <= single.max_peak()[2] + 64,
                "fsdp halves the optimizer state"
            );
        }
    }
    compare::report::write(&spec, &results, &[], "distgpt compare (test)").unwrap();
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + results.len());
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("| tiny | fsdp x2 | 8 |"), "{md}");
    for stem in [
        "throughput_vs_batch",
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
    std::fs::remove_dir_all(dir).ok();
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("distgpt-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
