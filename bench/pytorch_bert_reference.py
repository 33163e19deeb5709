#!/usr/bin/env python3
"""The same BERT training step in PyTorch eager (transformers'
BertForSequenceClassification or BertForMaskedLM, its BertConfig built here
with random weights: no download; dropout off as distgpt has none), side by
side with `distgpt bench`: random tokens, full-length sequences, AdamW, the
given batch, sequence length and threads. Prints ms/step and tokens/s of
each, distgpt's ratio to each PyTorch row, and MFU against the peak
(--peak-tflops, else the one distgpt states) with the FLOPs per token
`distgpt bench --json` states. --torch-variants picks PyTorch's rows:
eager, compile (torch.compile, inductor; compiled in the warmup steps),
and either in bf16 autocast (eager-bf16, compile-bf16); --compile is
--torch-variants compile. With --device cuda both run on the GPU.
--distgpt-precision fp32,bf16 runs distgpt in each; --repeat N makes every
figure a median of N runs (N distgpt processes, N windows of --steps
timed steps of each PyTorch row). A distgpt run that fails is named,
PyTorch's rows still come, and the exit status is 1. Without `transformers`
(a GPU machine with no network) the classifier is the same BERT written
here in plain PyTorch (post-LN blocks, erf GELU, the pooler; SDPA
attention), its rows named so.

    python bench/pytorch_bert_reference.py --model bert-minilm --batch-size 32 \
        --seq-len 128 --threads 2 --distgpt target/release/distgpt
    python bench/pytorch_bert_reference.py --device cuda --model bert-minilm \
        --batch-size 32 --seq-len 128 --torch-variants eager,eager-bf16 \
        --distgpt-precision fp32,bf16 --repeat 3 --distgpt target/release/distgpt
"""
import argparse
import os
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification
except ImportError:
    BertConfig = None

from runs import distgpt_rows, line, median_row, ratio_lines

PRESETS = {  # layers, heads, width, intermediate, head (as distgpt's presets)
    "bert-minilm": (6, 12, 384, 1536, "classify"),
    "bert-minilm-mlm": (6, 12, 384, 1536, "mlm"),
    "bert-base": (12, 12, 768, 3072, "classify"),
    "bert-base-mlm": (12, 12, 768, 3072, "mlm"),
    "bert-tiny": (2, 2, 128, 512, "classify"),
}


class PlainBert(nn.Module):
    """BertForSequenceClassification's classifier in plain PyTorch, for a
    machine without `transformers`: the same parameters and products."""

    def __init__(self, layers, heads, width, inner, vocab=30522, positions=512, labels=2):
        super().__init__()
        self.heads = heads
        self.word, self.pos, self.kind = nn.Embedding(vocab, width), nn.Embedding(positions, width), nn.Embedding(2, width)
        self.ln_emb = nn.LayerNorm(width, eps=1e-12)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(width, 3 * width), "out": nn.Linear(width, width), "ln_1": nn.LayerNorm(width, eps=1e-12),
            "fc": nn.Linear(width, inner), "proj": nn.Linear(inner, width), "ln_2": nn.LayerNorm(width, eps=1e-12),
        }) for _ in range(layers))
        self.pooler, self.classifier = nn.Linear(width, width), nn.Linear(width, labels)

    def forward(self, input_ids, labels):
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device)
        x = self.ln_emb(self.word(input_ids) + self.pos(pos) + self.kind(torch.zeros_like(input_ids)))
        for blk in self.blocks:
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in blk["qkv"](x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
            x = blk["ln_1"](x + blk["out"](y))
            x = blk["ln_2"](x + blk["proj"](F.gelu(blk["fc"](x))))
        logits = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return type("Output", (), {"loss": F.cross_entropy(logits.float(), labels)})


def torch_bench(args, variant="eager") -> dict:
    """One PyTorch row: the median of --repeat windows of --steps steps."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    layers, heads, width, inner, head = PRESETS[args.model]
    vocab = 30522
    if BertConfig is None:  # no transformers here
        if head == "mlm":
            sys.exit(f"{args.model}: the masked-LM head needs transformers, which is not installed")
        model, impl = PlainBert(layers, heads, width, inner, vocab).to(dev).train(), "plain torch BERT"
    else:
        cfg = BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=inner, max_position_embeddings=512,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
                         attn_implementation=args.attn)
        model = (BertForMaskedLM(cfg) if head == "mlm" else BertForSequenceClassification(cfg)).to(dev).train()
        impl = args.attn
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.95))
    run = torch.compile(model) if variant.startswith("compile") else model
    bf16 = variant.endswith("-bf16")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    b, t = args.batch_size, args.seq_len
    times = []
    for i in range(args.warmup + args.steps * args.repeat):
        ids = torch.randint(0, vocab, (b, t), device=dev)
        if head == "mlm":
            labels = torch.randint(0, vocab, (b, t), device=dev)
            labels[torch.rand(b, t, device=dev) >= 0.15] = -100
        else:
            labels = torch.randint(0, 2, (b,), device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = run(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    means = [sum(w) / len(w) for w in (times[i:i + args.steps] for i in range(0, len(times), args.steps))]
    name = f"pytorch {torch.__version__} {variant} ({impl})"
    return median_row([{"impl": name, "ms_per_step": m * 1e3, "tokens_per_s": b * t / m} for m in means])


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
    ap.add_argument("--compile", action="store_true", help="--torch-variants compile")
    ap.add_argument("--torch-variants", default="",
                    help="PyTorch rows, comma-separated: eager, compile, eager-bf16, compile-bf16 (default eager)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both train")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="peak MFU is stated against (default: the one distgpt states)")
    ap.add_argument("--distgpt-precision", default="fp32",
                    help="distgpt's rows, comma-separated `bench --precision`s: fp32, bf16")
    ap.add_argument("--repeat", type=int, default=1, help="each figure the median of this many runs")
    ap.add_argument("--distgpt", help="path of the distgpt binary to run side by side")
    args = ap.parse_args()
    variants = [v.strip() for v in (args.torch_variants or ("compile" if args.compile else "eager")).split(",")
                if v.strip()]
    for v in variants:
        if v not in ("eager", "compile", "eager-bf16", "compile-bf16"):
            ap.error(f"unknown --torch-variants entry {v!r}")
    if args.repeat < 1:
        ap.error("--repeat is 1 or more")
    rows, failures = [], []
    if args.distgpt:
        cmd = [args.distgpt, "--threads", str(args.threads), "bench", "--model", args.model,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
        if args.peak_tflops:
            cmd += ["--peak-tflops", str(args.peak_tflops)]
        precisions = [p.strip() for p in args.distgpt_precision.split(",") if p.strip()]
        rows, failures = distgpt_rows(cmd, precisions, args.repeat)
        # PyTorch's rows still come: they are the baseline to mend against
        for f in failures:
            print(f, flush=True)
    ours = len(rows)
    # MFU with distgpt's FLOPs a token (BERT's count is distgpt's), against
    # the stated peak or the one distgpt states
    fpt = rows[0]["flops_per_token"] if rows else None
    peak = args.peak_tflops * 1e12 or (rows[0]["peak_gflops"] * 1e9 if rows else None)
    where = f"{args.threads} threads" if args.device == "cpu" else args.device
    shape = f"{args.model} {args.batch_size}x{args.seq_len}"
    for r in rows:
        print(line(r, shape, where, peak), flush=True)
    for v in variants:
        r = torch_bench(args, v)
        rows.append(r)
        if fpt:
            r["flops_per_token"] = fpt
        print(line(r, shape, where, peak if fpt else None), flush=True)
    if ours:
        source = (f"stated peak {args.peak_tflops:g} TFLOP/s" if args.peak_tflops
                  else f"peak {peak / 1e9:.0f} GFLOP/s: distgpt's")
        for r in ratio_lines(rows[:ours], rows[ours:], source):
            print(r)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
