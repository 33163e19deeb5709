#!/usr/bin/env python3
"""The same BERT training step in PyTorch eager (transformers'
BertForSequenceClassification or BertForMaskedLM, random weights, dropout
off as distgpt has none), side by side with `distgpt bench`: random tokens,
full-length sequences, AdamW, the given batch, sequence length and threads.
Prints tokens/s of both, their ratio, and MFU for both against the peak
and FLOPs per token `distgpt bench --json` states. With --compile the
model runs under torch.compile (inductor; compiled in the warmup steps).

    python bench/pytorch_bert_reference.py --model bert-minilm --batch-size 32 \
        --seq-len 128 --threads 2 --distgpt target/release/distgpt
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

PRESETS = {  # layers, heads, width, intermediate, head (as distgpt's presets)
    "bert-minilm": (6, 12, 384, 1536, "classify"),
    "bert-minilm-mlm": (6, 12, 384, 1536, "mlm"),
    "bert-base": (12, 12, 768, 3072, "classify"),
    "bert-base-mlm": (12, 12, 768, 3072, "mlm"),
    "bert-tiny": (2, 2, 128, 512, "classify"),
}


def torch_bench(args) -> float:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers, heads, width, inner, head = PRESETS[args.model]
    cfg = BertConfig(vocab_size=30522, hidden_size=width, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=inner, max_position_embeddings=512,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
                     attn_implementation=args.attn)
    model = (BertForMaskedLM(cfg) if head == "mlm" else BertForSequenceClassification(cfg)).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95))
    run = torch.compile(model) if args.compile else model
    b, t = args.batch_size, args.seq_len
    best = []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (b, t))
        if head == "mlm":
            labels = torch.randint(0, cfg.vocab_size, (b, t))
            labels[torch.rand(b, t) >= 0.15] = -100
        else:
            labels = torch.randint(0, 2, (b,))
        t0 = time.perf_counter()
        loss = run(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            best.append(time.perf_counter() - t0)
    return b * t / (sum(best) / len(best))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-minilm", choices=sorted(PRESETS))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="transformers' attention implementation")
    ap.add_argument("--compile", action="store_true", help="run PyTorch's model under torch.compile")
    ap.add_argument("--distgpt", help="path of the distgpt binary to run side by side")
    args = ap.parse_args()
    ours = None
    if args.distgpt:
        cmd = [args.distgpt, "--threads", str(args.threads), "bench", "--model", args.model,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        ours = json.loads(out.strip().splitlines()[-1])
    tps = torch_bench(args)
    mode = "compile" if args.compile else "eager"
    line = f"pytorch {torch.__version__} {mode} ({args.attn}) {args.model} batch {args.batch_size} x {args.seq_len}, {args.threads} threads: {tps:.0f} tokens/s"
    if ours:
        peak, fpt = ours["peak_gflops"] * 1e9, ours["flops_per_token"]
        print(f"distgpt: {ours['tokens_per_s']:.0f} tokens/s, MFU {100 * ours['mfu']:.1f}% of {peak / 1e9:.0f} GFLOP/s")
        line += f", MFU {100 * tps * fpt / peak:.1f}%"
        print(line)
        print(f"ratio distgpt / pytorch: {ours['tokens_per_s'] / tps:.2f}x")
    else:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
