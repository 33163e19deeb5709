//! Parity with Hugging Face `transformers` GPT-2 on the same weights and
//! tokens (fixture from scripts/make_hf_fixture.py): logits, loss, every
//! parameter gradient, and AdamW steps against torch.optim.AdamW.

mod fixture;

use distgpt::backend::cpu::Cpu;
use distgpt::backend::Device;
use distgpt::model::files::read_weights;
use distgpt::model::{AdamW, AdamWConfig, Gpt2, GptConfig, Segment};
use std::path::PathBuf;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tiny")
}

fn hf_config() -> GptConfig {
    let text = std::fs::read_to_string(fixture_dir().join("config.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let get = |k: &str| j[k].as_u64().unwrap() as usize;
    GptConfig {
        n_layer: get("n_layer"),
        n_head: get("n_head"),
        n_embd: get("n_embd"),
        block_size: get("n_positions"),
        vocab_size: get("vocab_size"),
        blocks: Vec::new(),
    }
}

struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    fn load() -> Self {
        Reference {
            bytes: std::fs::read(fixture_dir().join("reference.safetensors")).unwrap(),
        }
    }

    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        fixture::tensor(&self.bytes, name)
    }

    fn ids(&self, name: &str) -> (usize, usize, Vec<u32>) {
        let (shape, v) = self.tensor(name);
        (
            shape[0],
            shape[1],
            v.into_iter().map(|x| x as u32).collect(),
        )
    }
}

fn loaded_model() -> Gpt2<Cpu> {
    let mut model = Gpt2::new(Cpu::new(), hf_config()).unwrap();
    let file = fixture_dir().join("model.safetensors");
    let params = read_weights(&model.config.clone().into(), &file, None).unwrap();
    model.set_params(&params).unwrap();
    model
}

/// The model's slice for a tensor, with the padded vocabulary rows cut off.
fn real_rows<'a>(model: &Gpt2<Cpu>, buf: &'a [f32], name: &str) -> &'a [f32] {
    let t = model
        .core
        .layout
        .tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap();
    let mut r = t.range();
    if name == "transformer.wte.weight" {
        r.end = r.start + model.config.vocab_size * model.config.n_embd;
    }
    &buf[r]
}

#[test]
fn logits_loss_and_gradients_match_transformers() {
    let reference = Reference::load();
    let mut model = loaded_model();
    let (b, t, tokens) = reference.ids("tokens");
    let (_, _, targets) = reference.ids("targets");
    let loss = model.forward(&tokens, Some(&targets), b, t).unwrap();
    let (_, want_logits) = reference.tensor("logits");
    let v = model.config.vocab_size;
    let mut max_err = 0.0f32;
    for bi in 0..b {
        for ti in 0..t {
            let row = &want_logits[(bi * t + ti) * v..(bi * t + ti + 1) * v];
            for (g, w) in model.logits(bi, ti).unwrap().iter().zip(row) {
                max_err = max_err.max((g - w).abs());
            }
        }
    }
    assert!(max_err <= 1e-4, "logits max abs error {max_err}");
    check_loss_and_gradients(&reference, model, loss.unwrap());
}

/// `--recompute`'s head in chunks of 5 rows (the fixture's batch is
/// more): the forward's loss, each parameter's gradient (dwte summed
/// over the chunks) against `transformers` as the whole head's are; the
/// logits of every row are not held, and reading them says so.
#[test]
fn a_head_in_chunks_of_rows_matches_transformers() {
    let reference = Reference::load();
    let mut model = loaded_model();
    let (b, t, tokens) = reference.ids("tokens");
    assert!(
        b * t > 10,
        "a batch of {b} x {t} makes fewer than three chunks"
    );
    model.engine.recompute = true;
    let budget = 5 * model.config.padded_vocab();
    model.engine.set_logits_budget(budget);
    let (_, _, targets) = reference.ids("targets");
    let loss = model.forward(&tokens, Some(&targets), b, t).unwrap();
    let e = model.logits(0, 0).unwrap_err().to_string();
    assert!(e.contains("holds the logits of 5 at a time"), "{e}");
    check_loss_and_gradients(&reference, model, loss.unwrap());
}

/// The loss of the model's last forward (on the fixture's batch) and the
/// gradients of its backward against the fixture's.
fn check_loss_and_gradients(reference: &Reference, mut model: Gpt2<Cpu>, loss: f32) {
    let want_loss = reference.tensor("loss").1[0];
    assert!(
        (loss - want_loss).abs() <= 1e-5,
        "loss {loss} vs {want_loss}"
    );

    model.zero_grads();
    model.backward(1.0).unwrap();
    let v = model.config.vocab_size;
    let grads = model.backend().to_host(model.grads.s()).unwrap();
    for spec in model.core.layout.tensors.clone() {
        let (_, want) = reference.tensor(&format!("grad.{}", spec.name));
        let got = real_rows(&model, &grads, &spec.name);
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(
            err <= 1e-3 * scale,
            "{}: max error {err} vs max |grad| {scale}",
            spec.name
        );
    }
    let wte = model.core.layout.wte();
    assert!(grads[wte.start + v * model.config.n_embd..wte.end]
        .iter()
        .all(|&g| g == 0.0));
}

#[test]
fn adamw_steps_match_torch_adamw() {
    let reference = Reference::load();
    let mut model = loaded_model();
    let mut grads = vec![0.0; model.core.layout.total()];
    for spec in model.core.layout.tensors.clone() {
        let (_, g) = reference.tensor(&format!("grad.{}", spec.name));
        let r = spec.range();
        grads[r.start..r.start + g.len()].copy_from_slice(&g);
    }
    let be = model.backend().clone();
    be.upload(model.grads.d(), &grads).unwrap();
    let config = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(&be, model.core.layout.total(), config).unwrap();
    for _ in 0..3 {
        opt.update(
            &be,
            model.params.d(),
            model.grads.s(),
            &model.engine.core.layout,
            &Segment::whole(model.engine.core.layout.total()),
            1e-2,
            1.0,
        )
        .unwrap();
    }
    let params = model.params_host().unwrap();
    for spec in &model.core.layout.tensors {
        let (_, want) = reference.tensor(&format!("adamw.{}", spec.name));
        let got = real_rows(&model, &params, &spec.name);
        let err = got
            .iter()
            .zip(&want)
            .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(
            err <= 1e-5,
            "{}: max abs error {err} after 3 AdamW steps",
            spec.name
        );
    }
}
