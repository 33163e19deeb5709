#!/usr/bin/env python3
"""distgpt against PyTorch eager on one workload, in alternated pairs: pair i
runs `distgpt bench --json` then the PyTorch reference for even i, the
reverse for odd i, each a fresh process, so drift in the machine's load
falls on both. Prints every run's tokens/s, each side's median, the
median of the pairs' ratios (and the ratio of the medians), and MFU of both against distgpt's best-matmul and
hardware peaks (`distgpt devices` says what they are), as a BENCHMARKS.md
table row.

    python bench/pairs.py --distgpt target/release/distgpt --pairs 5 \
        --workload shakespeare-char-single
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name: (distgpt bench arguments, reference script, its arguments)
WORKLOADS = {
    "shakespeare-char-single": (
        "--model shakespeare-char --batch-size 16",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16"),
    "shakespeare-char-single-compile": (
        "--model shakespeare-char --batch-size 16",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16 --torch-variants compile"),
    "shakespeare-char-ddp2": (
        "--model shakespeare-char --batch-size 16 --strategy ddp --world-size 2",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16 --strategy ddp --world-size 2"),
    "shakespeare-char-fsdp2": (
        "--model shakespeare-char --batch-size 16 --strategy fsdp --world-size 2",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16 --strategy fsdp --world-size 2"),
    "bert-minilm-classify": (
        "--model bert-minilm --batch-size 32 --seq-len 128",
        "pytorch_bert_reference.py", "--model bert-minilm --batch-size 32 --seq-len 128"),
    "bert-minilm-classify-compile": (
        "--model bert-minilm --batch-size 32 --seq-len 128",
        "pytorch_bert_reference.py", "--model bert-minilm --batch-size 32 --seq-len 128 --compile"),
    "bert-minilm-mlm": (
        "--model bert-minilm-mlm --batch-size 32 --seq-len 128",
        "pytorch_bert_reference.py", "--model bert-minilm-mlm --batch-size 32 --seq-len 128"),
    "shakespeare-char-single-bf16": (
        "--model shakespeare-char --batch-size 16 --precision bf16",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16 --torch-variants eager-bf16"),
    "gpt2-4x128": (
        "--model gpt2 --batch-size 4 --seq-len 128",
        "pytorch_reference.py", "--model gpt2 --batch-size 4 --seq-len 128"),
    # bf16: distgpt's --precision bf16 against PyTorch's bf16 autocast
    "shakespeare-char-single-compile-bf16": (
        "--model shakespeare-char --batch-size 16 --precision bf16",
        "pytorch_reference.py", "--model shakespeare-char --batch-size 16 --torch-variants compile-bf16"),
    "bert-minilm-classify-bf16": (
        "--model bert-minilm --batch-size 32 --seq-len 128 --precision bf16",
        "pytorch_bert_reference.py", "--model bert-minilm --batch-size 32 --seq-len 128 --torch-variants eager-bf16"),
    "bert-minilm-classify-compile-bf16": (
        "--model bert-minilm --batch-size 32 --seq-len 128 --precision bf16",
        "pytorch_bert_reference.py", "--model bert-minilm --batch-size 32 --seq-len 128 --torch-variants compile-bf16"),
    "gpt2-4x128-bf16": (
        "--model gpt2 --batch-size 4 --seq-len 128 --precision bf16",
        "pytorch_reference.py", "--model gpt2 --batch-size 4 --seq-len 128 --torch-variants eager-bf16"),
}


def run_distgpt(args, extra):
    cmd = [args.distgpt, "--threads", str(args.threads), "bench", *extra.split(),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_torch(args, script, extra):
    # torch.compile compiles in its first step and may recompile in its
    # second: those stay out of the timed steps
    warmup = max(args.warmup, 2) if "compile" in extra else args.warmup
    cmd = [sys.executable, str(HERE / script), *extra.split(), "--threads", str(args.threads),
           "--steps", str(args.steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    found = re.findall(r"([0-9.]+) tokens/s", out)
    if not found:
        sys.exit(f"no tokens/s in the reference's output:\n{out}")
    return float(found[-1]), out.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--distgpt", required=True)
    ap.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    ours_args, script, theirs_args = WORKLOADS[args.workload]
    ours, theirs, last = [], [], None
    for i in range(args.pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            if side == 0:
                last = run_distgpt(args, ours_args)
                ours.append(last["tokens_per_s"])
                print(f"pair {i + 1} distgpt {ours[-1]:.0f} tokens/s ({last.get('matmul')})", flush=True)
            else:
                tps, line = run_torch(args, script, theirs_args)
                theirs.append(tps)
                print(f"pair {i + 1} pytorch {tps:.0f} tokens/s ({line})", flush=True)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    # a pair's two runs share the machine's load of the moment: the median
    # of the pairs' ratios is the figure drift moves least
    ratios = [o / t for o, t in zip(ours, theirs)]
    pair_ratio = statistics.median(ratios)
    fpt = last["flops_per_token"]
    mfu = lambda tps, peak: f"{100 * tps * fpt / peak:.1f}%" if peak else "-"
    peak = last["peak_gflops"] * 1e9
    hw = (last.get("hardware_peak_gflops") or 0) * 1e9
    print(f"distgpt median {mo:.0f} tokens/s ({min(ours):.0f}-{max(ours):.0f}), "
          f"PyTorch median {mt:.0f} ({min(theirs):.0f}-{max(theirs):.0f}), ratio of medians {mo / mt:.2f}x, "
          f"pairs' ratios {', '.join(f'{r:.2f}' for r in ratios)} (median {pair_ratio:.2f}x)")
    print(f"| {args.workload} | {mo:,.0f} ({min(ours):,.0f}-{max(ours):,.0f}) | "
          f"{mt:,.0f} ({min(theirs):,.0f}-{max(theirs):,.0f}) | **{pair_ratio:.2f}x** ({mo / mt:.2f}x) | "
          f"{mfu(mo, hw)} / {mfu(mt, hw)} | {mfu(mo, peak)} / {mfu(mt, peak)} | {last.get('matmul')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
