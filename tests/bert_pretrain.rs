//! BERT pretraining that feeds fine-tuning, through the command line:
//! continued masked-LM pretraining of a BERT folder on its own WordPiece
//! vocabulary, whose run, checkpoints and exports each carry the vocabulary
//! and tokenizer files, and each of which `--task classify` fine-tunes,
//! `eval` scores as a masked LM and `export` writes whole; a resumed run
//! equal to an uninterrupted one. And what a masked LM was silently wrong
//! about: a checkpoint scored as a GPT-2, a character model scored on
//! another text's characters, a batch with nothing masked, a classifier's
//! checkpoint exported without its vocabulary, BERT errors that spoke of
//! language models.

#[path = "support/bert.rs"]
mod bert;

#[path = "support/cli.rs"]
mod cli;

use bert::tiny_bert_and_labelled_set;
use cli::{distgpt, scratch, succeeded};
use std::path::{Path, PathBuf};

/// A small text in the tiny model's vocabulary (letters; the digits are
/// [UNK]), long enough for a validation split of a few windows.
fn text(dir: &Path) -> PathBuf {
    let words = [
        "good", "day", "sir", "buy", "cheap", "pills", "now", "fine", "tea",
    ];
    let body: Vec<String> = (0..400)
        .map(|i| words[(i * 7 + i / 9) % words.len()].to_string())
        .collect();
    let path = dir.join("text.txt");
    std::fs::write(&path, body.join(" ")).unwrap();
    path
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `train --task mlm` of `init` on `data` for `steps` into `out`, with a
/// checkpoint and an evaluation every 2 steps.
fn pretrain(
    init: &Path,
    data: &Path,
    out: &Path,
    steps: &str,
    extra: &[&str],
) -> std::process::Output {
    pretrain_as("mlm", init, data, out, steps, extra)
}

/// [`pretrain`] as `task` (mlm, or pretrain: with next-sentence prediction).
fn pretrain_as(
    task: &str,
    init: &Path,
    data: &Path,
    out: &Path,
    steps: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec![
        "train",
        "--task",
        task,
        "--init-from",
        init.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        steps,
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--lr",
        "1e-3",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    distgpt(&args)
}

/// `train --task classify` of `init` on the labelled set `set` for `steps`
/// (4 x 16 tokens a batch) into `out`, with extra flags.
fn fine_tune(
    init: &Path,
    set: &Path,
    out: &Path,
    steps: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec![
        "train",
        "--task",
        "classify",
        "--init-from",
        init.to_str().unwrap(),
        "--data",
        set.to_str().unwrap(),
        "--steps",
        steps,
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    distgpt(&args)
}

/// The losses a run recorded, step by step.
fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((j["step"].as_u64()?, j["loss"].as_f64()?))
        })
        .collect()
}

/// The `masked-token loss X` an `eval` printed.
fn masked_loss(out: &std::process::Output) -> f64 {
    figure(&stdout(out), "masked-token loss ")
}

#[test]
fn mlm_pretraining_feeds_fine_tuning_evaluation_and_export() {
    let dir = scratch("pretrain-feeds");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, set) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let run = dir.join("mlm");
    succeeded(pretrain(&model, &data, &run, "4", &[]));
    let vocab = std::fs::read_to_string(model.join("vocab.txt")).unwrap();
    let lines = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    };
    let want: Vec<String> = vocab.lines().map(String::from).collect();
    let ckpt = run.join("checkpoints/step_00000002");
    // the run and every checkpoint keep the vocabulary
    for d in [&run, &ckpt, &run.join("checkpoints/step_00000004")] {
        assert_eq!(lines(&d.join("vocab.txt")), want, "{}", d.display());
    }
    for f in ["tokenizer_config.json", "special_tokens_map.json"] {
        assert!(run.join(f).exists(), "{f}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "BertForMaskedLM");
    assert_eq!(config["pad_token_id"], 0);

    // eval scores the run and its checkpoint as masked LMs, with the run's
    // own masks: the figures it recorded at those steps
    let recorded: Vec<(u64, f64)> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((j["step"].as_u64()?, j["val_loss"].as_f64()?))
        })
        .collect();
    let val_at = |step| recorded.iter().find(|(s, _)| *s == step).unwrap().1;
    let eval = |what: &Path| {
        succeeded(distgpt(&[
            "eval",
            what.to_str().unwrap(),
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--batches",
            "2",
        ]))
    };
    assert!((masked_loss(&eval(&run)) - val_at(4)).abs() < 1e-3);
    assert!((masked_loss(&eval(&ckpt)) - val_at(2)).abs() < 1e-3);

    // an export of a checkpoint is a whole folder transformers reads
    let exported = dir.join("exported");
    succeeded(distgpt(&[
        "export",
        ckpt.to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ]));
    assert_eq!(lines(&exported.join("vocab.txt")), want);
    assert!(exported.join("tokenizer_config.json").exists());

    // fine-tuning starts from the run, its checkpoint and the export
    for (tag, from) in [("run", &run), ("ckpt", &ckpt), ("export", &exported)] {
        let out = dir.join(format!("cls-{tag}"));
        succeeded(fine_tune(from, &set, &out, "2", &[]));
        assert_eq!(lines(&out.join("vocab.txt")), want, "{tag}");
    }
}

#[test]
fn a_classifier_starts_from_the_pretrained_encoder_not_the_original() {
    use distgpt::model::bert::{hf, layout::layout, BertHead};
    use distgpt::train::classify::pretrained_bert;
    let dir = scratch("pretrain-encoder");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, _) = tiny_bert_and_labelled_set(&dir);
    let run = dir.join("mlm");
    succeeded(pretrain(&model, &text(&dir), &run, "2", &[]));
    let head = BertHead::Classify { labels: 2 };
    let (cfg, from_run, ..) = pretrained_bert(&run, head, 7, "classify").unwrap();
    let (_, trained) = hf::load_folder(&run, None, 0).unwrap();
    let (mlm_cfg, _) = hf::load_folder(&run, None, 0).unwrap();
    let (_, original, ..) = pretrained_bert(&model, head, 7, "classify").unwrap();
    let (lay, mlm_lay) = (layout(&cfg, 1), layout(&mlm_cfg, 1));
    for name in [
        "bert.embeddings.word_embeddings.weight",
        "bert.encoder.layer.1.output.dense.weight",
    ] {
        let r = lay.tensor(name).unwrap().range();
        let m = mlm_lay.tensor(name).unwrap().range();
        assert_eq!(&from_run[r.clone()], &trained[m], "{name}");
        assert_ne!(
            &from_run[r.clone()],
            &original[r],
            "{name} is the original's"
        );
    }
    // from a checkpoint, the same weights as from the folder written at the end
    let ckpt = run.join("checkpoints/step_00000002");
    let (_, from_ckpt, ..) = pretrained_bert(&ckpt, head, 7, "classify").unwrap();
    assert_eq!(from_ckpt, from_run);
}

#[test]
fn a_resumed_wordpiece_pretraining_equals_an_uninterrupted_one() {
    let dir = scratch("pretrain-resume");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, _) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let whole = dir.join("whole");
    succeeded(pretrain(&model, &data, &whole, "4", &[]));
    // stopped after 2 of its 4 steps (exit 75), then resumed
    let parts = dir.join("parts");
    let stopped = pretrain(&model, &data, &parts, "4", &["--stop-after", "2"]);
    assert_eq!(stopped.status.code(), Some(75), "{}", stderr(&stopped));
    succeeded(distgpt(&[
        "train",
        "--resume",
        parts.to_str().unwrap(),
        "--quiet",
    ]));
    assert_eq!(losses(&parts), losses(&whole));
    // a vocabulary swapped under the run is refused, not used
    let ckpt = parts.join("checkpoints/step_00000004/vocab.txt");
    let swapped = std::fs::read_to_string(&ckpt)
        .unwrap()
        .replace("##z", "##zz");
    std::fs::write(&ckpt, swapped).unwrap();
    let out = distgpt(&[
        "train",
        "--resume",
        parts.to_str().unwrap(),
        "--steps",
        "6",
        "--quiet",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not the WordPiece vocabulary"),
        "{}",
        stderr(&out)
    );
}

/// The figure after `label ` in `text`.
fn figure(text: &str, label: &str) -> f64 {
    let at = text
        .find(label)
        .unwrap_or_else(|| panic!("no {label:?} in: {text}"));
    text[at + label.len()..]
        .split(|c: char| c.is_whitespace() || c == '%' || c == ',')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// BERT's pretraining with next-sentence prediction (`--task pretrain`):
/// the run and its checkpoints are `BertForPreTraining` folders with the
/// vocabulary; `eval` of the run, and of an exported checkpoint, gives the
/// loss (masked-LM plus next-sentence) and the next-sentence accuracy the
/// run recorded at that step; the run fine-tunes; a resumed run equals an
/// uninterrupted one; characters (no `[CLS]` or `[SEP]`) are refused.
#[test]
fn next_sentence_pretraining_evaluates_as_recorded_resumes_and_feeds_fine_tuning() {
    let dir = scratch("pretrain-nsp");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, set) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let run = dir.join("nsp");
    succeeded(pretrain_as("pretrain", &model, &data, &run, "4", &[]));
    let config = |d: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(config(&run)["architectures"][0], "BertForPreTraining");
    assert!(run.join("vocab.txt").exists());
    let recorded: Vec<(u64, f64, f64)> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let j: serde_json::Value = serde_json::from_str(l).ok()?;
            let acc = j["val_accuracy"].as_f64()?;
            Some((j["step"].as_u64()?, j["val_loss"].as_f64()?, acc))
        })
        .collect();
    assert_eq!(recorded.iter().map(|r| r.0).collect::<Vec<_>>(), [2, 4]);
    let eval = |what: &Path, step: u64| {
        let mut args = vec![
            "eval",
            what.to_str().unwrap(),
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--batches",
            "2",
        ];
        if !what.starts_with(&run) {
            args.extend(["--data", data.to_str().unwrap()]);
        }
        let text = stdout(&succeeded(distgpt(&args)));
        let (_, loss, acc) = recorded.iter().find(|r| r.0 == step).unwrap();
        let got = figure(&text, "masked-LM + next-sentence loss ");
        assert!(
            (got - loss).abs() < 1e-3,
            "{text}: loss {got} vs {loss} recorded"
        );
        let got = figure(&text, "next-sentence accuracy ");
        assert!(
            (got - 100.0 * acc).abs() < 1e-6,
            "{text}: accuracy {got}% vs {acc}"
        );
    };
    eval(&run, 4);
    let exported = dir.join("exported");
    succeeded(distgpt(&[
        "export",
        run.join("checkpoints/step_00000002").to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ]));
    assert_eq!(config(&exported)["architectures"][0], "BertForPreTraining");
    eval(&exported, 2);
    succeeded(fine_tune(&run, &set, &dir.join("cls"), "2", &[]));
    // stopped after 2 of its 4 steps (exit 75), then resumed
    let parts = dir.join("parts");
    let stopped = pretrain_as(
        "pretrain",
        &model,
        &data,
        &parts,
        "4",
        &["--stop-after", "2"],
    );
    assert_eq!(stopped.status.code(), Some(75), "{}", stderr(&stopped));
    succeeded(distgpt(&[
        "train",
        "--resume",
        parts.to_str().unwrap(),
        "--quiet",
    ]));
    assert_eq!(losses(&parts), losses(&run));
    // sentence pairs need [CLS] and [SEP]: a text's characters have neither
    let out = distgpt(&[
        "train",
        "--task",
        "pretrain",
        "--model",
        "bert-tiny",
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "1",
        "--out",
        dir.join("chars").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--task pretrain makes sentence pairs as [CLS] A [SEP] B [SEP]"),
        "{}",
        stderr(&out)
    );
}

/// A character-level masked LM of the embedded corpus's first part.
fn char_mlm(dir: &Path) -> (PathBuf, PathBuf) {
    let data = dir.join("chars.txt");
    let text: String = distgpt::data::SHAKESPEARE.chars().take(6000).collect();
    std::fs::write(&data, text).unwrap();
    let run = dir.join("chars");
    succeeded(distgpt(&[
        "train",
        "--task",
        "mlm",
        "--model",
        "bert-tiny",
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--quiet",
        "--out",
        run.to_str().unwrap(),
    ]));
    (run, data)
}

#[test]
fn eval_of_a_masked_lm_checkpoint_is_its_masked_token_loss_never_a_gpt2_s() {
    let dir = scratch("pretrain-eval-ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    let (run, _) = char_mlm(&dir);
    let ckpt = run.join("checkpoints/step_00000002");
    let out = succeeded(distgpt(&[
        "eval",
        ckpt.to_str().unwrap(),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--batches",
        "2",
    ]));
    assert!(!stdout(&out).contains("perplexity"), "{}", stdout(&out));
    let recorded = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let at2 = recorded
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|j| j["step"] == 2 && j["val_loss"].is_number())
        .unwrap()["val_loss"]
        .as_f64()
        .unwrap();
    assert!(
        (masked_loss(&out) - at2).abs() < 1e-3,
        "{} vs {at2}",
        stdout(&out)
    );
}

#[test]
fn a_character_masked_lm_is_scored_only_on_its_own_characters() {
    let dir = scratch("pretrain-eval-chars");
    std::fs::create_dir_all(&dir).unwrap();
    let (run, data) = char_mlm(&dir);
    // as many distinct characters, one of them new: refused, naming it
    let text = std::fs::read_to_string(&data).unwrap();
    let gone = text.chars().find(|c| c.is_ascii_lowercase()).unwrap();
    let other = dir.join("other.txt");
    std::fs::write(&other, text.replace(gone, "\u{e9}")).unwrap();
    let out = distgpt(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        other.to_str().unwrap(),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("'\u{e9}'"), "{}", stderr(&out));
    // its own text is scored with the recorded characters
    succeeded(distgpt(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch-size",
        "2",
        "--seq-len",
        "16",
    ]));
}

#[test]
fn a_masked_lm_batch_always_has_something_to_predict() {
    let dir = scratch("pretrain-nan");
    std::fs::create_dir_all(&dir).unwrap();
    let (run, data) = char_mlm(&dir);
    // one sequence of 8: nothing masked in a third of such batches before
    let out = succeeded(distgpt(&[
        "eval",
        run.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch-size",
        "1",
        "--seq-len",
        "8",
        "--batches",
        "0",
    ]));
    assert!(masked_loss(&out).is_finite(), "{}", stdout(&out));
}

#[test]
fn a_classifier_checkpoint_exports_and_evaluates_as_a_classifier() {
    let dir = scratch("pretrain-cls-ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, set) = tiny_bert_and_labelled_set(&dir);
    let run = dir.join("cls");
    succeeded(fine_tune(&model, &set, &run, "2", &[]));
    let ckpt = run.join("checkpoints/step_00000002");
    let exported = dir.join("exported");
    succeeded(distgpt(&[
        "export",
        ckpt.to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ]));
    assert!(exported.join("vocab.txt").exists());
    // eval without a labelled set scores the one its run recorded; a
    // folder with no run record says what a classifier needs
    succeeded(distgpt(&["eval", ckpt.to_str().unwrap()]));
    let out = distgpt(&["eval", exported.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("is a BERT classifier without a run record naming its data: give --data"),
        "{err}"
    );
    assert!(!err.contains("language model"), "{err}");
    // and with one, the checkpoint scores as the folder written at the end
    let score = |what: &Path| {
        let out = succeeded(distgpt(&[
            "eval",
            what.to_str().unwrap(),
            "--data",
            set.to_str().unwrap(),
            "--seq-len",
            "16",
        ]));
        stdout(&out).split(": ").nth(1).unwrap().to_string()
    };
    assert_eq!(score(&ckpt), score(&run));
}

#[test]
fn a_wordpiece_vocabulary_learned_from_a_text_pretrains_from_scratch() {
    let dir = scratch("pretrain-learned");
    std::fs::create_dir_all(&dir).unwrap();
    let (_, set) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let shards = dir.join("shards");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let prepare = |extra: &[&str]| {
        let mut args = vec![
            "data".to_string(),
            "prepare".into(),
            "--input".into(),
            s(&data),
        ];
        args.extend(["--out".into(), s(&shards)]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        distgpt(&args)
    };
    let out = prepare(&["--tokenizer", "char", "--vocab-size", "40"]);
    assert!(
        stderr(&out).contains("--vocab-size is for --tokenizer wordpiece"),
        "{}",
        stderr(&out)
    );
    succeeded(prepare(&["--tokenizer", "wordpiece", "--vocab-size", "45"]));
    let vocab = std::fs::read_to_string(shards.join("vocab.txt")).unwrap();
    assert_eq!(vocab.lines().count(), 45);
    assert!(
        vocab.starts_with("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n"),
        "{vocab}"
    );
    // a BERT from scratch on them keeps that vocabulary
    let run = dir.join("mlm");
    succeeded(distgpt(&[
        "train",
        "--task",
        "mlm",
        "--model",
        "bert-tiny",
        "--data",
        &s(&shards),
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--quiet",
        "--out",
        &s(&run),
    ]));
    assert_eq!(
        std::fs::read_to_string(run.join("vocab.txt")).unwrap(),
        vocab
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 45);
    // which fine-tunes
    succeeded(fine_tune(&run, &set, &dir.join("cls"), "1", &[]));
    // a causal language model is refused those shards, in words
    let out = distgpt(&[
        "train",
        "--data",
        &s(&shards),
        "--steps",
        "1",
        "--out",
        &s(&dir.join("lm")),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("WordPiece vocabulary, which BERT's --task mlm reads"),
        "{}",
        stderr(&out)
    );
}

/// A labelled set of sentence pairs: each prompt with its own reply
/// (label 1) or another prompt's (label 0).
fn pair_set(dir: &Path) -> PathBuf {
    let prompts = [
        "good day sir",
        "buy cheap pills",
        "fine tea now",
        "day now sir",
        "cheap tea",
    ];
    let replies = [
        "good day to you",
        "no pills thanks",
        "tea is fine",
        "now is good",
        "buy it",
    ];
    let set = dir.join("pairs");
    std::fs::create_dir_all(&set).unwrap();
    let line = |i: usize| {
        let p = i % prompts.len();
        let (label, r) = match i % 2 {
            0 => (1, p),
            _ => (0, (p + 2) % replies.len()),
        };
        format!(
            "{{\"label\":{label},\"text\":\"{}\",\"text_pair\":\"{}\"}}\n",
            prompts[p], replies[r]
        )
    };
    for (split, n) in [("train", 16), ("val", 6), ("test", 6)] {
        let lines: String = (0..n).map(line).collect();
        std::fs::write(set.join(format!("{split}.jsonl")), lines).unwrap();
    }
    std::fs::write(set.join("labels.json"), r#"["other","reply"]"#).unwrap();
    set
}

#[test]
fn pairs_fine_tune_alike_on_every_layout_resume_and_evaluate() {
    let dir = scratch("pretrain-pairs");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, _) = tiny_bert_and_labelled_set(&dir);
    let set = pair_set(&dir);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let fine_tune =
        |out: &Path, steps: &str, extra: &[&str]| fine_tune(&model, &set, out, steps, extra);
    let single = dir.join("single");
    succeeded(fine_tune(&single, "4", &[]));
    let want = losses(&single);
    assert_eq!(want.len(), 4);
    for layout in [["--strategy", "ddp"], ["--strategy", "fsdp"]] {
        let out = dir.join(layout[1]);
        succeeded(fine_tune(
            &out,
            "4",
            &[layout[0], layout[1], "--world-size", "2"],
        ));
        for ((s1, a), (s2, b)) in want.iter().zip(losses(&out)) {
            assert_eq!(*s1, s2);
            assert!(
                (a - b).abs() <= 1e-5 * a.abs().max(1.0),
                "{}: step {s1}: {a} vs {b}",
                layout[1]
            );
        }
    }
    // stopped after 2 of its 4 steps (exit 75), then resumed, it ends as
    // the uninterrupted run did
    let parts = dir.join("parts");
    let stopped = fine_tune(&parts, "4", &["--stop-after", "2"]);
    assert_eq!(stopped.status.code(), Some(75), "{}", stderr(&stopped));
    succeeded(distgpt(&["train", "--resume", &s(&parts), "--quiet"]));
    assert_eq!(losses(&parts), want);
    // eval scores the pairs' test split
    let out = succeeded(distgpt(&[
        "eval",
        &s(&single),
        "--data",
        &s(&set),
        "--seq-len",
        "16",
    ]));
    assert!(stdout(&out).contains("accuracy"), "{}", stdout(&out));
}

/// A BERT folder's shape is its config.json's: `--model`, `--n-layer` and
/// `--block-size` beside `--init-from` are refused on every BERT task, as
/// beside a GPT-2's (they were dropped without a word: the folder's model
/// trained). From scratch, `--block-size` gives the encoder its positions
/// (the sequence length's were taken), a longer `--seq-len` is refused,
/// and pretraining on characters is refused before any note about them.
#[test]
fn a_berts_positions_are_its_folders_or_as_block_size_gives_them() {
    let dir = scratch("bert-shape-flags");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, set) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    for flag in [
        &["--model", "bert-tiny"][..],
        &["--n-layer", "1"],
        &["--block-size", "64"],
    ] {
        for (task, input) in [("mlm", &data), ("pretrain", &data), ("classify", &set)] {
            let out = dir.join(format!("{task}{}", flag[0]));
            let (model, input, out_s) = (s(&model), s(input), s(&out));
            let mut args = vec![
                "train",
                "--task",
                task,
                "--init-from",
                &model,
                "--data",
                &input,
            ];
            args.extend_from_slice(&[
                "--steps",
                "1",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--quiet",
                "--out",
                &out_s,
            ]);
            args.extend_from_slice(flag);
            let o = distgpt(&args);
            let want = format!("{} cannot be given with --init-from", flag[0]);
            assert!(
                !o.status.success() && stderr(&o).contains(&want),
                "{task} {flag:?}: {}",
                stderr(&o)
            );
            assert!(!out.exists(), "{task} {flag:?}: a run folder");
        }
    }
    let scratch_run = |name: &str, extra: &[&str]| {
        let out = s(&dir.join(name));
        let data = s(&data);
        let mut args = vec![
            "train",
            "--task",
            "mlm",
            "--model",
            "bert-tiny",
            "--data",
            &data,
        ];
        args.extend_from_slice(&[
            "--steps",
            "1",
            "--batch-size",
            "2",
            "--quiet",
            "--out",
            &out,
        ]);
        args.extend_from_slice(extra);
        distgpt(&args)
    };
    let positions = |name: &str| -> u64 {
        let text = std::fs::read_to_string(dir.join(name).join("config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&text).unwrap();
        config["max_position_embeddings"].as_u64().unwrap()
    };
    succeeded(scratch_run(
        "b64",
        &["--block-size", "64", "--seq-len", "16"],
    ));
    assert_eq!(positions("b64"), 64, "--block-size 64");
    // a sequence as long as the positions, the length --block-size gives
    succeeded(scratch_run("b16", &["--block-size", "16"]));
    assert_eq!(positions("b16"), 16, "--block-size 16");
    succeeded(scratch_run("s16", &["--seq-len", "16"]));
    assert_eq!(
        positions("s16"),
        16,
        "the sequence length's, without --block-size"
    );
    let o = scratch_run("b16s32", &["--block-size", "16", "--seq-len", "32"]);
    let want = "--seq-len 32 must be between 1 and the model's block size 16";
    assert!(
        !o.status.success() && stderr(&o).contains(want),
        "{}",
        stderr(&o)
    );
    let data_s = s(&data);
    let args = [
        "train",
        "--task",
        "pretrain",
        "--model",
        "bert-tiny",
        "--data",
        &data_s,
        "--steps",
        "1",
    ];
    let o = distgpt(&args);
    assert!(
        !o.status.success() && stderr(&o).contains("[CLS] A [SEP] B [SEP]"),
        "{}",
        stderr(&o)
    );
    assert!(
        !stderr(&o).contains("note:"),
        "a note before the refusal: {}",
        stderr(&o)
    );
}

/// `eval` scores the model a folder holds, or refuses: a file without its
/// config's head (a masked LM's weights under a classifier's config.json,
/// a classifier's under a masked LM's) was scored with a head drawn from
/// the seed, as if trained. And `eval RUN` of a masked LM started from a
/// folder scores at the run's own sequence length, not the folder's
/// positions (it asked for windows of 24 + 1 here, more than the text's
/// validation split holds).
#[test]
fn eval_refuses_a_head_never_trained_and_scores_a_run_at_its_length() {
    let dir = scratch("eval-untrained-head");
    std::fs::create_dir_all(&dir).unwrap();
    let (model, set) = tiny_bert_and_labelled_set(&dir);
    let data = text(&dir);
    let run = dir.join("mlm");
    succeeded(pretrain(&model, &data, &run, "2", &[]));
    let o = succeeded(distgpt(&["eval", run.to_str().unwrap()]));
    assert!(stdout(&o).contains("of 16 tokens"), "{}", stdout(&o));
    // a folder of `from`'s weights whose config.json says `architecture`
    let relabel = |from: &Path, name: &str, architecture: &str| -> PathBuf {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["config.json", "model.safetensors", "vocab.txt"] {
            std::fs::copy(from.join(f), to.join(f)).unwrap();
        }
        let text = std::fs::read_to_string(to.join("config.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
        config["architectures"] = serde_json::json!([architecture]);
        // as a folder saved by hand carries no checksum of distgpt's
        config
            .as_object_mut()
            .unwrap()
            .remove("distgpt_weights_checksum");
        config["id2label"] = serde_json::json!({"0": "ham", "1": "spam"});
        config["label2id"] = serde_json::json!({"ham": 0, "spam": 1});
        std::fs::write(to.join("config.json"), config.to_string()).unwrap();
        to
    };
    let never = "its head was never trained";
    let as_classifier = relabel(&run, "as-classifier", "BertForSequenceClassification");
    let args = [
        "eval",
        as_classifier.to_str().unwrap(),
        "--data",
        set.to_str().unwrap(),
    ];
    let o = distgpt(&args);
    assert!(
        !o.status.success() && stderr(&o).contains(never),
        "{}",
        stderr(&o)
    );
    let as_mlm = relabel(&model, "as-mlm", "BertForMaskedLM");
    let args = [
        "eval",
        as_mlm.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    let o = distgpt(&[&args[..], &["--seq-len", "16"]].concat());
    assert!(
        !o.status.success() && stderr(&o).contains(never),
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("cls.predictions"), "{}", stderr(&o));
    // a fine-tuned classifier's file without its pooler: the classifier
    // reads the pooler's output, so it is the head's too
    let tuned = dir.join("tuned");
    succeeded(fine_tune(&model, &set, &tuned, "1", &[]));
    let bytes = std::fs::read(tuned.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| !name.contains("pooler"))
        .collect();
    assert!(kept.len() < st.len(), "the classifier has a pooler");
    let no_pooler = relabel(&tuned, "no-pooler", "BertForSequenceClassification");
    let file = no_pooler.join("model.safetensors");
    safetensors::serialize_to_file(kept, &None, &file).unwrap();
    let args = [
        "eval",
        no_pooler.to_str().unwrap(),
        "--data",
        set.to_str().unwrap(),
    ];
    let o = distgpt(&args);
    assert!(
        !o.status.success() && stderr(&o).contains("bert.pooler"),
        "{}",
        stderr(&o)
    );
}
