#!/usr/bin/env python3
"""The GPU's time a kernel, from an Nsight Systems trace of `distgpt bench`:
runs `nsys stats --report cuda_gpu_kern_sum --format csv` on the report and
prints every kernel's time a step (the trace's total over the steps it
holds: warm-up and timed steps, the model's set-up kernels included), its
share, its launches a step and its mean, the largest first, and the GPU's
kernel time a step in all. The kernels are the device's own (cuBLAS's,
flash.cu's, each conversion), where `bench --profile` times distgpt's calls,
each ended by a wait; the sum beside the step's wall time says how much of
the step the GPU spent idle (launch gaps, host waits).

    python bench/kernel_times.py NSYS REPORT.nsys-rep STEPS [--top N]
"""
import argparse
import csv
import io
import subprocess
import sys


def column(header, start):
    for i, h in enumerate(header):
        if h.strip().startswith(start):
            return i
    raise SystemExit(f"no column {start!r} in nsys's kernel summary: {header}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("nsys")
    ap.add_argument("report")
    ap.add_argument("steps", type=int, help="the steps the trace holds (warm-up and timed)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    out = subprocess.run([args.nsys, "stats", "--report", "cuda_gpu_kern_sum", "--format", "csv",
                          "--output", "-", args.report], check=True, capture_output=True, text=True).stdout
    lines = out.splitlines()
    # nsys says what it is doing before the table: the table starts at its header
    at = next((i for i, l in enumerate(lines) if "Total Time" in l and "Name" in l), None)
    if at is None:
        sys.exit(f"no kernel summary in nsys's output:\n{out}")
    rows = list(csv.reader(io.StringIO("\n".join(lines[at:]))))
    header, rows = rows[0], [r for r in rows[1:] if r]
    total, calls, name = (column(header, s) for s in ("Total Time", "Instances", "Name"))
    kernels = sorted(((float(r[total]) / 1e6 / args.steps, int(r[calls]) / args.steps, r[name])
                      for r in rows), reverse=True)
    busy = sum(k[0] for k in kernels)
    launches = sum(k[1] for k in kernels)
    print(f"gpu kernels (nsys): {busy:.2f} ms a step in {launches:.0f} launches of "
          f"{len(kernels)} kernels ({args.steps} steps traced)")
    for ms, n, k in kernels[:args.top]:
        label = k if len(k) <= 70 else k[:67] + "..."
        print(f"  {label:<70} {ms:9.3f} ms {100 * ms / busy:5.1f}% {n:8.1f} calls {1e3 * ms / n:9.1f} us")
    rest = kernels[args.top:]
    if rest:
        print(f"  ({len(rest)} more kernels: {sum(k[0] for k in rest):.3f} ms a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
