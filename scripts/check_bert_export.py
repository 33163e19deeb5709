#!/usr/bin/env python3
"""What transformers makes of distgpt's BERT exports (run by hand; needs
torch + transformers):

    cargo test --test bert_parity write_bert_export_fixture -- --ignored
    python scripts/check_bert_export.py

Each of tests/fixtures/bert_export/{cls,mlm,pretrain} (written by distgpt's
exporter) is loaded with AutoTokenizer and the Auto class of its head
(AutoModelForSequenceClassification, AutoModelForMaskedLM,
AutoModelForPreTraining), which must resolve to the Bert class its
config names. The texts of tests/bert_parity.rs's EXPORT_TEXTS (single
sentences and pairs) are tokenized, padded to the longest, and run; the
ids, token types, attention mask and the logits distgpt's engine gives
(the classifier's, the masked LM's, pretraining's next-sentence head's)
go to transformers.safetensors beside the folder, which
tests/bert_parity.rs compares with distgpt's own.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForMaskedLM, AutoModelForPreTraining,
                          AutoModelForSequenceClassification, AutoTokenizer)

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "bert_export")
TEXTS = [("WIN free money now!!!", None),
         ("Re: meeting at noon", "see you at the cafe"),
         ("Call me", "thanks for the notes, see you tomorrow")]
HEADS = {"cls": (AutoModelForSequenceClassification, "BertForSequenceClassification"),
         "mlm": (AutoModelForMaskedLM, "BertForMaskedLM"),
         "pretrain": (AutoModelForPreTraining, "BertForPreTraining")}


def main() -> int:
    for name, (auto, cls) in HEADS.items():
        folder = os.path.join(DIR, name)
        tok = AutoTokenizer.from_pretrained(folder)
        model = auto.from_pretrained(folder, attn_implementation="eager").float().eval()
        assert type(model).__name__ == cls, f"{name}: {type(model).__name__}, not {cls}"
        rows = [tok(a, b) if b is not None else tok(a) for a, b in TEXTS]
        enc = tok.pad(rows, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model(**enc)
        logits = out.seq_relationship_logits if name == "pretrain" else out.logits
        ref = {
            "input_ids": enc["input_ids"].to(torch.int32).contiguous(),
            "token_type_ids": enc["token_type_ids"].to(torch.int32).contiguous(),
            "attention_mask": enc["attention_mask"].to(torch.int32).contiguous(),
            "logits": logits.contiguous(),
        }
        save_file(ref, os.path.join(folder, "transformers.safetensors"))
        print(f"{name}: {type(tok).__name__}, {cls}, ids {tuple(enc['input_ids'].shape)}, "
              f"logits {tuple(logits.shape)} |max| {logits.abs().max():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
