//! `train --tensorboard DIR`: standard event files whose scalars are the
//! run's step records (read back with our reader, every frame's CRC
//! checked), the configuration as text, a resume marked so TensorBoard drops
//! the abandoned steps, for the language-model and classifier tasks.

#[path = "support/bert.rs"]
mod bert;

#[path = "support/tfevents.rs"]
mod tfevents;

use distgpt::metrics::tensorboard::EventWriter;
use std::collections::BTreeMap;
#[path = "support/cli.rs"]
mod cli;

use cli::{distgpt, scratch, succeeded};
use std::path::{Path, PathBuf};
use tfevents::{event_files, read_events, Event, Value};

fn fresh(tag: &str) -> PathBuf {
    scratch(&format!("tb-{tag}"))
}

/// Every scalar of the event files in `dir`, by tag, as (step, value).
fn scalars(events: &[Event]) -> BTreeMap<String, Vec<(i64, f32)>> {
    let mut out: BTreeMap<String, Vec<(i64, f32)>> = BTreeMap::new();
    for e in events {
        for (tag, v) in &e.values {
            if let Value::Scalar(x) = v {
                out.entry(tag.clone()).or_default().push((e.step, *x));
            }
        }
    }
    out
}

/// The run's `metrics.jsonl` field `key` by step.
fn logged(run: &Path, key: &str) -> Vec<(i64, f32)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_i64()?, r[key].as_f64()? as f32)))
        .collect()
}

#[test]
fn a_language_model_run_and_its_resume_write_event_files_of_its_step_records() {
    let dir = fresh("lm");
    let (run, tb) = (dir.join("run"), dir.join("tb"));
    let (run_s, tb_s) = (run.to_str().unwrap(), tb.to_str().unwrap());
    let common = ["--quiet", "--peak-tflops", "0.1"];
    let mut args = vec!["train", "--model", "tiny", "--batch-size", "4"];
    args.extend_from_slice(&["--seq-len", "16", "--steps", "6", "--eval-every", "3"]);
    args.extend_from_slice(&["--checkpoint-every", "3", "--sample-tokens", "0"]);
    args.extend_from_slice(&["--out", run_s, "--tensorboard", tb_s]);
    args.extend_from_slice(&common);
    succeeded(distgpt(&args));

    let files = event_files(&tb).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = read_events(&files[0]).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(
        !events.iter().any(|e| e.session_start),
        "a new run's file starts no session (a resume's does)"
    );
    let config = events
        .iter()
        .flat_map(|e| &e.values)
        .find_map(|(tag, v)| match (tag.as_str(), v) {
            ("config", Value::Text(t)) => Some(t.clone()),
            _ => None,
        })
        .expect("the configuration as text");
    assert!(
        config.contains("\"model\"") && config.contains("\"lr\""),
        "{config}"
    );
    let s = scalars(&events);
    assert_eq!(s["train/loss"], logged(&run, "loss"), "every step's loss");
    assert_eq!(s["train/lr"], logged(&run, "lr"));
    assert_eq!(s["train/grad_norm"], logged(&run, "grad_norm"));
    assert_eq!(s["perf/tokens_per_s"], logged(&run, "tokens_per_s"));
    assert_eq!(s["perf/mfu"], logged(&run, "mfu"));
    let val = logged(&run, "val_loss");
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [3, 6]);
    assert_eq!(s["val/loss"], val);
    let peak_mib: Vec<(i64, f32)> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|r| {
            let bytes = r["memory"]["peak_total_bytes"].as_f64().unwrap();
            (
                r["step"].as_i64().unwrap(),
                (bytes / (1 << 20) as f64) as f32,
            )
        })
        .collect();
    assert!(peak_mib.iter().all(|&(_, m)| m > 0.0), "{peak_mib:?}");
    assert_eq!(
        s["memory/peak_total_mib"], peak_mib,
        "the peak in MiB of 2^20 bytes"
    );

    // a resume from step 3 to 8: a second file that starts a session at 4,
    // so TensorBoard drops the first file's steps 4 to 6
    let ckpt = run.join("checkpoints");
    let step3 = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("step_00000003"))
        .unwrap_or_else(|| panic!("no step-3 checkpoint in {}", ckpt.display()));
    let mut args = vec!["train", "--resume", step3.to_str().unwrap(), "--steps", "8"];
    args.extend_from_slice(&common);
    succeeded(distgpt(&args));
    let files = event_files(&tb).unwrap();
    assert_eq!(
        files.len(),
        2,
        "the resume writes a file of its own: {files:?}"
    );
    let resumed = read_events(&files[1]).unwrap();
    assert!(
        resumed.iter().any(|e| e.session_start && e.step == 4),
        "a session start at the first step after the resumed one"
    );
    let steps: Vec<i64> = scalars(&resumed)["train/loss"]
        .iter()
        .map(|v| v.0)
        .collect();
    assert_eq!(steps, [4, 5, 6, 7, 8]);
    assert_eq!(
        scalars(&resumed)["train/loss"],
        logged(&run, "loss")[3..].to_vec(),
        "the resumed steps as logged"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_classifier_run_writes_its_validation_accuracy_and_f1() {
    let dir = fresh("classify");
    let (model, data) = bert::tiny_bert_and_labelled_set(&dir);
    let (run, tb) = (dir.join("run"), dir.join("tb"));
    succeeded(distgpt(&[
        "train",
        "--task",
        "classify",
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--seq-len",
        "12",
        "--quiet",
        "--peak-tflops",
        "0.1",
        "--out",
        run.to_str().unwrap(),
        "--tensorboard",
        tb.to_str().unwrap(),
    ]));
    let events = read_events(&event_files(&tb).unwrap()[0]).unwrap();
    let s = scalars(&events);
    for key in ["accuracy", "f1", "loss"] {
        let tag = format!("val/{key}");
        assert_eq!(s[&tag], logged(&run, &format!("val_{key}")), "{tag}");
        assert!(!s[&tag].is_empty(), "{tag}");
    }
    assert_eq!(s["train/loss"], logged(&run, "loss"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An event directory that cannot be made is refused before the run writes
/// anything: a new run's directory stays empty (the same `--out` works
/// next), and a resume leaves `run.json` as it was (a plain resume works next).
#[test]
fn an_event_directory_that_cannot_be_made_leaves_the_run_as_it_was() {
    let dir = fresh("unmakeable");
    std::fs::create_dir_all(&dir).unwrap();
    let (run, file) = (dir.join("run"), dir.join("a-file"));
    std::fs::write(&file, "not a directory").unwrap();
    let beneath = file.join("tb");
    let (run_s, file_s, beneath_s) = (
        run.to_str().unwrap(),
        file.to_str().unwrap(),
        beneath.to_str().unwrap(),
    );
    let mut args = vec!["train", "--model", "tiny", "--batch-size", "2"];
    args.extend_from_slice(&["--seq-len", "8", "--steps", "2", "--sample-tokens", "0"]);
    args.extend_from_slice(&["--quiet", "--peak-tflops", "0.1", "--out", run_s]);

    let refused = distgpt(&[&args[..], &["--tensorboard", file_s]].concat());
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains(&format!("--tensorboard {file_s} is a file")),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&run)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter().all(|n| n.to_string_lossy().starts_with('.')),
        "nothing of the run is written: {left:?}"
    );
    succeeded(distgpt(&args));

    let record = std::fs::read(run.join("run.json")).unwrap();
    let metrics = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let resume = ["train", "--resume", run_s, "--steps", "4", "--quiet"];
    let refused = distgpt(&[&resume[..], &["--tensorboard", beneath_s]].concat());
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains(&format!(
            "--tensorboard {beneath_s}: cannot make the directory"
        )),
        "{err}"
    );
    assert_eq!(
        std::fs::read(run.join("run.json")).unwrap(),
        record,
        "run.json as it was"
    );
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), metrics);
    succeeded(distgpt(&resume));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn events_read_back_as_written_and_a_flipped_byte_is_caught() {
    let dir = fresh("round-trip").join("events");
    let mut w = EventWriter::create(&dir).unwrap();
    w.text(0, "config", "`lr = 3e-3`").unwrap();
    w.scalars(5, &[("train/loss", 2.5), ("lr", 1e-3)]).unwrap();
    w.session_start(7).unwrap();
    w.flush().unwrap();
    let path = w.path().to_path_buf();
    let events = read_events(&path).unwrap();
    assert_eq!(events.len(), 4);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert_eq!(
        events[1].values,
        vec![("config".into(), Value::Text("`lr = 3e-3`".into()))]
    );
    assert_eq!(events[2].step, 5);
    assert_eq!(
        events[2].values,
        vec![
            ("train/loss".into(), Value::Scalar(2.5)),
            ("lr".into(), Value::Scalar(1e-3))
        ]
    );
    assert!(events[3].session_start && events[3].step == 7);
    // stamped with the wall clock
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(events.iter().all(|e| (now - e.wall_time).abs() < 600.0));
    assert_eq!(event_files(&dir).unwrap(), vec![path.clone()]);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 6;
    bytes[at] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let err = read_events(&path).unwrap_err();
    assert!(err.contains("data CRC mismatch"), "{err}");
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

/// Events written by TensorBoard's own writer (its RecordWriter and protos;
/// scripts/make_reference_runs.py --only tensorboard), which the library's
/// writer matches byte for byte (its unit test), read back.
#[test]
fn tensorboards_own_events_read_back() {
    let dir = fresh("golden");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("events.out.tfevents.1700000000.golden");
    std::fs::write(
        &path,
        include_bytes!("fixtures/tensorboard/golden.tfevents"),
    )
    .unwrap();
    let events = read_events(&path).unwrap();
    assert_eq!(events.len(), 4);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert_eq!(
        events[1].values,
        vec![
            ("train/loss".into(), Value::Scalar(2.5)),
            ("train/lr".into(), Value::Scalar(1e-3))
        ]
    );
    // longer than 127 bytes, as the step is past 127: their varints take
    // more than one byte
    let soliloquy = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles";
    assert_eq!(
        events[2].values,
        vec![("sample".into(), Value::Text(soliloquy.into()))]
    );
    assert_eq!(events[2].step, 70_000);
    assert!(events[3].session_start && events[3].step == 4);
    std::fs::remove_dir_all(&dir).unwrap();
}
