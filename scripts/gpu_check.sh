#!/usr/bin/env bash
# Everything about the cuda backend that needs an NVIDIA GPU, on a machine
# that has one (CI here has none: it only compiles, lints and NVRTC-checks).
#
#   1. every device kernel on cuda against its CPU twin (the unit tests of
#      backend::gpu, which run on each runtime present);
#   2. a whole training step, every strategy on thread ranks sharing the GPU,
#      greedy generation and `train --device cuda`, against the CPU
#      (tests/gpu.rs), and `--device cuda` finding the GPU (tests/cuda_cli.rs);
#   3. every data-parallel strategy over NCCL (`--comm nccl` under mpirun, one
#      process per GPU; a single GPU still runs NCCL with one rank) following
#      single-GPU training's losses;
#   4. GPT-2 124M at T = 1024 side by side with PyTorch on the same GPU
#      (eager fp32, eager with bf16 autocast, torch.compile with bf16), MFU
#      against 989 TFLOP/s (H100 SXM dense bf16);
#   5. what CPU offload costs there (--offload optimizer, overlapped: the
#      gradient down on the copy stream during the backward and the copies
#      beside the host's update; serial; and fsdp's --offload params).
#
# Results go to $1 (default target/gpu-check): paste them into BENCHMARKS.md.
# CUDA's libraries come from the system or from pip wheels in
# DISTGPT_GPU_VENV (default ~/.cache/distgpt-gpu-venv, made when missing).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/target/gpu-check}"
venv="${DISTGPT_GPU_VENV:-$HOME/.cache/distgpt-gpu-venv}"
mkdir -p "$out"
cd "$root"

if ! nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi failed: $out/nvidia-smi.txt)" >&2
    exit 2
fi
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "== $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"

echo "== Python with PyTorch and CUDA's wheels (NVRTC, cuBLAS, NCCL) in $venv"
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check torch \
    nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12 nvidia-nccl-cu12 ||
    echo "gpu_check: pip could not install everything; going on with what is there"
# distgpt looks for the wheels' libraries in the active environment.
export VIRTUAL_ENV="$venv"

features=cuda
if command -v mpirun >/dev/null && dpkg -s libopenmpi-dev >/dev/null 2>&1; then
    features=cuda,mpi
fi
echo "== build (--features $features)"
cargo build --release --features "$features"
bin="$root/target/release/distgpt"
"$bin" devices | tee "$out/devices.txt"

echo "== 1. every kernel on cuda against the CPU"
DISTGPT_REQUIRE_CUDA=1 cargo test --features "$features" --lib backend:: 2>&1 |
    tee "$out/kernels.txt"

echo "== 2. a training step, every strategy, generation and train --device cuda against the CPU"
DISTGPT_REQUIRE_CUDA=1 DISTGPT_HAVE_CUDA=1 \
    cargo test --features "$features" --test gpu --test cuda_cli 2>&1 | tee "$out/backend.txt"

echo "== 3. every data-parallel strategy over NCCL against single-GPU training"
if [[ "$features" != *mpi* ]]; then
    echo "skipped: no Open MPI (apt-get install libopenmpi-dev openmpi-bin libclang-dev)" |
        tee "$out/nccl.txt"
else
    np=1
    for n in 2 4 8; do
        if ((n <= gpus)); then np=$n; fi
    done
    as_root=()
    if [[ $EUID -eq 0 ]]; then as_root=(--allow-run-as-root); fi
    common=(train --device cuda --model tiny --steps 20 --batch-size 8 --eval-every 0
        --sample-tokens 0 --quiet --overwrite)
    "$bin" "${common[@]}" --out "$out/runs/single" >/dev/null
    : >"$out/nccl.txt"
    failed=()
    for s in ddp zero1 zero2 fsdp; do
        if ! mpirun "${as_root[@]}" -np "$np" "$bin" "${common[@]}" --comm nccl \
            --strategy "$s" --world-size "$np" --out "$out/runs/$s" >"$out/runs/$s.log" 2>&1; then
            echo "$s over NCCL: the run failed ($out/runs/$s.log)" | tee -a "$out/nccl.txt"
            failed+=("$s")
            continue
        fi
        "$venv/bin/python" - "$out/runs/single" "$out/runs/$s" "$s" "$np" <<'EOF' | tee -a "$out/nccl.txt" || failed+=("$s")
import json, sys
def losses(run):
    rows = (json.loads(l) for l in open(f"{run}/metrics.jsonl"))
    return [r["loss"] for r in rows if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
err = max((abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)), default=float("inf"))
ok = len(a) == len(b) == 20 and err <= 1e-4
print(f"{sys.argv[3]} over NCCL on {sys.argv[4]} GPU(s): {len(b)} steps, "
      f"largest relative loss difference to single {err:.2e}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
EOF
    done
    if ((${#failed[@]})); then
        echo "gpu_check: over NCCL, ${failed[*]} failed (see $out/nccl.txt); going on to the benchmark" >&2
        nccl_failed=1
    fi
fi

echo "== 4. GPT-2 124M, T = 1024, against PyTorch on this GPU"
"$venv/bin/python" bench/pytorch_reference.py --device cuda --model gpt2 --batch-size 8 \
    --seq-len 1024 --steps 10 --warmup 3 --peak-tflops 989 \
    --torch-variants eager,eager-bf16,compile-bf16 --distgpt "$bin" 2>&1 | tee "$out/bench.txt"

echo "== 5. CPU offload: GPT-2 124M on this GPU without it, with it, with the copies serial"
# (tests/gpu.rs in step 2 already checked it against the run without offload,
# its resume and its memory on this GPU; this is what it costs)
: >"$out/offload.txt"
for o in none optimizer "optimizer --offload-serial"; do
    # shellcheck disable=SC2086
    "$bin" bench --device cuda --model gpt2 --batch-size 8 --seq-len 1024 --steps 10 \
        --warmup 3 --peak-tflops 989 --offload $o 2>&1 | tee -a "$out/offload.txt"
done
# shellcheck disable=SC2086
"$bin" bench --device cuda --model gpt2 --strategy fsdp --world-size "$gpus" --batch-size 8 \
    --seq-len 1024 --steps 10 --warmup 3 --peak-tflops 989 --offload params 2>&1 |
    tee -a "$out/offload.txt"

echo "== done: results in $out"
exit "${nccl_failed:-0}"
