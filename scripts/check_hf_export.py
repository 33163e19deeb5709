#!/usr/bin/env python3
"""Round trip of distgpt's Hugging Face export (run by hand; needs torch + transformers).

    cargo test --test hf_export write_export_fixture -- --ignored
    python scripts/check_hf_export.py

Loads tests/fixtures/hf_export (written by `distgpt`'s exporter) with
GPT2LMHeadModel.from_pretrained, runs the tokens the Rust test uses, and writes
their logits to tests/fixtures/hf_export/transformers_logits.safetensors, which
tests/hf_export.rs compares with distgpt's own.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from safetensors.torch import save_file
from transformers import GPT2LMHeadModel

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf_export")


def main() -> int:
    model = GPT2LMHeadModel.from_pretrained(DIR).float().eval()
    tokens = torch.tensor([[(i * 7) % 40 for i in range(16)]])
    with torch.no_grad():
        logits = model(tokens).logits[0].contiguous()
    save_file({"tokens": tokens.to(torch.int32), "logits": logits}, os.path.join(DIR, "transformers_logits.safetensors"))
    print(f"transformers {model.config.n_layer} layers: logits {tuple(logits.shape)}, |max| {logits.abs().max():.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
