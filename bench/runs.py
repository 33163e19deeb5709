#!/usr/bin/env python3
"""`distgpt bench` run several times, each figure the median run: the part
of the PyTorch comparisons (pytorch_reference.py, pytorch_bert_reference.py)
that needs no PyTorch, and on its own where there is none
(scripts/gpu_check.sh step 4 without PyTorch, and its dry run).

    python3 bench/runs.py --repeat 3 --precision fp32,bf16 -- \
        target/release/distgpt bench --device cuda --model gpt2 --batch-size 8 --seq-len 1024

runs the command (`--precision P --json` added) 3 times a precision, each
a process of its own, and prints one line a precision: the median run's
ms/step and tokens/s, and every run's ms/step. Exit status 1 when a run
failed (the other precisions still run).
"""
import argparse
import json
import subprocess
import sys


def median_row(rows):
    """The median run by ms/step (of an even count, the faster of the two
    middle ones), with every run's ms/step in `runs_ms`."""
    ordered = sorted(rows, key=lambda r: r["ms_per_step"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["runs_ms"] = [r["ms_per_step"] for r in rows]
    return row


def distgpt_rows(cmd, precisions, repeat):
    """`cmd` (a `distgpt ... bench ...` command line) `repeat` times for
    each precision: (the median row of each precision that ran, a message
    for each that failed). A row's impl is `distgpt`, `distgpt bf16`."""
    rows, failures = [], []
    for p in precisions:
        runs = []
        for _ in range(repeat):
            full = [*cmd, "--precision", p, "--json"]
            run = subprocess.run(full, capture_output=True, text=True)
            if run.returncode != 0:
                failures.append(f"distgpt bench failed ({' '.join(full)}):\n{run.stderr.strip()}")
                break
            runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
        else:
            row = median_row(runs)
            row["impl"] = "distgpt" if p == "fp32" else f"distgpt {p}"
            rows.append(row)
    return rows, failures


def line(r, shape, where, peak=None):
    """A row as the comparisons print it: ms/step, tokens/s, MFU against
    `peak` FLOP/s where given, and each run where there were several."""
    mfu = f", MFU {100 * r['flops_per_token'] * r['tokens_per_s'] / peak:.1f}%" if peak else ""
    mem = r.get("memory", {}).get("peak_total_bytes")
    mem = f", peak {mem / 2**20:.0f} MiB (accounted)" if mem else ""
    runs = r.get("runs_ms", [])
    runs = (f" (median of {len(runs)}: {' / '.join(f'{x:.1f}' for x in runs)} ms)"
            if len(runs) > 1 else "")
    return (f"{r['impl']:<28} {shape} {where}: {r['ms_per_step']:.1f} ms/step,"
            f" {r['tokens_per_s']:.0f} tokens/s{mfu}{mem}{runs}")


def ratio_lines(ours, theirs, source=""):
    """Each distgpt row against each other row, by tokens/s."""
    tail = f" ({source})" if source else ""
    return [f"ratio {o['impl']} / {t['impl']}: {o['tokens_per_s'] / t['tokens_per_s']:.2f}x{tail}"
            for o in ours for t in theirs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs a precision (each a process)")
    ap.add_argument("--precision", default="fp32", help="comma-separated: fp32, bf16")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="peak MFU is stated against (default: the one distgpt states)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- DISTGPT bench ARGS...")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd or args.repeat < 1:
        ap.error("give the command after --, and --repeat 1 or more")
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    rows, failures = distgpt_rows(cmd, precisions, args.repeat)
    for f in failures:
        print(f, flush=True)
    for r in rows:
        peak = args.peak_tflops * 1e12 or r["peak_gflops"] * 1e9
        where = (cmd[cmd.index("--device") + 1] if "--device" in cmd[:-1]
                 else f"{r['threads']} threads")
        print(line(r, f"{r['model']} {r['batch']}x{r['seq']}", where, peak), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
