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
    let params = read_weights(&model.config.clone().into(), &file, None, None).unwrap();
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

/// The hub's `gpt2` and `GPT2Model.save_pretrained` name the tensors as
/// the base model does, without `transformer.` (`wte.weight`,
/// `h.0.attn.c_attn.weight`, `ln_f.bias`), beside each block's causal mask
/// buffer (`h.0.attn.bias`, [1, 1, T, T]): such a folder reads as the same
/// weights through the loader every command uses.
#[test]
fn a_base_models_file_without_the_prefix_reads_as_the_same_weights() {
    use distgpt::store::{write_safetensors, Data};
    use safetensors::tensor::{Dtype, SafeTensors};
    let prefixed = fixture_dir().join("model.safetensors");
    let want = read_weights(&hf_config().into(), &prefixed, None, None).unwrap();
    let bytes = std::fs::read(&prefixed).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = hf_config().block_size;
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        let short = name.strip_prefix("transformer.").unwrap_or(&name);
        if let Some(block) = short.strip_suffix(".attn.c_attn.bias") {
            let mask: Vec<u8> = (0..t * t)
                .flat_map(|i| f32::from(u8::from(i % t <= i / t)).to_le_bytes())
                .collect();
            let at = format!("{block}.attn.bias");
            tensors.push((at, Dtype::F32, vec![1, 1, t, t], Data::Bytes(mask)));
        }
        let data = Data::Bytes(view.data().to_vec());
        tensors.push((short.to_string(), view.dtype(), view.shape().to_vec(), data));
    }
    assert!(tensors.iter().any(|(n, ..)| n == "wte.weight"));
    let dir = std::env::temp_dir().join(format!("distgpt-hf-base-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    // the fixture's config, with a character vocabulary of its 100 tokens
    let text = std::fs::read_to_string(fixture_dir().join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    let chars: String = (0..100u32)
        .map(|i| char::from_u32(0x100 + i).unwrap())
        .collect();
    config["distgpt_tokenizer"] = serde_json::json!({"kind": "char", "chars": chars});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (_, got) = distgpt::checkpoint::read_model(&dir).unwrap();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the prefix-less file read other weights");
    // a block past the config's two, named as the base model names it, is
    // the config and the weights disagreeing, as with the prefix
    let extra = (
        "h.2.ln_1.weight".to_string(),
        Dtype::F32,
        vec![32],
        Data::Bytes(vec![0; 128]),
    );
    tensors.push(extra);
    write_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
    let refused = distgpt::checkpoint::read_model(&dir).map(drop).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        refused.to_string().contains("'h.2.ln_1.weight'"),
        "{refused}"
    );
}
