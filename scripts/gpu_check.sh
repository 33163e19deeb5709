#!/usr/bin/env bash
# Everything about the cuda backend that needs an NVIDIA GPU, on a machine
# that has one (CI here has none: it only compiles, lints and NVRTC-checks).
#
#   1. every device kernel on cuda against its CPU twin (the unit tests of
#      backend::gpu, which run on each runtime present);
#   2. a whole training step, every strategy on thread ranks sharing the GPU,
#      greedy generation and `train --device cuda`, against the CPU
#      (tests/gpu.rs), and `--device cuda` finding the GPU (tests/cuda_cli.rs);
#   3. every data-parallel strategy over NCCL (`--comm nccl`: under mpirun,
#      one process per GPU, where Open MPI is there; else thread ranks of one
#      process, one per GPU) following single-GPU training's losses;
#   4. GPT-2 124M at T = 1024 side by side with PyTorch on the same GPU
#      (eager fp32, eager with bf16 autocast, torch.compile with bf16), MFU
#      against 989 TFLOP/s (H100 SXM dense bf16);
#   5. what CPU offload costs there (--offload optimizer, overlapped: the
#      gradient down on the copy stream during the backward and the copies
#      beside the host's update; serial; and fsdp's --offload params).
#
#   scripts/gpu_check.sh [OUT]          build here, then check (OUT defaults
#                                       to target/gpu-check)
#   scripts/gpu_check.sh --pack DIR     only build: the release binary and the
#                                       test binaries, stripped, into DIR
#                                       (DISTGPT_GPU_FEATURES=cuda: no Open
#                                       MPI needed where they run)
#   DISTGPT_GPU_PREBUILT=DIR scripts/gpu_check.sh [OUT]
#                                       check with DIR's binaries, for a GPU
#                                       machine with no Rust or no network
#
# A failing step is reported and the next one still runs; the exit status is
# 1 if any step failed. DISTGPT_GPU_STEP_TIMEOUT=S stops each step after S
# seconds. Results go to OUT: paste them into BENCHMARKS.md. CUDA's libraries
# come from the system or from pip wheels in DISTGPT_GPU_VENV (default
# ~/.cache/distgpt-gpu-venv, made when missing and the network allows), or
# from the python3 that already has PyTorch for CUDA. distgpt binds CUDA
# 12's API; where only CUDA 13's NVRTC and cuBLAS are installed, they stand
# in (their calls distgpt makes are unchanged) and the log says so.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# DISTGPT_GPU_FEATURES overrides (`cuda` packs binaries that need no libmpi).
features=cuda
if command -v mpirun >/dev/null && dpkg -s libopenmpi-dev >/dev/null 2>&1; then
    features=cuda,mpi
fi
features="${DISTGPT_GPU_FEATURES:-$features}"

if [[ "${1:-}" == "--pack" ]]; then
    dir="${2:?usage: scripts/gpu_check.sh --pack DIR}"
    set -e
    mkdir -p "$dir"
    cargo build --release --features "$features"
    # The test binaries' names, from cargo's own report of what it built.
    cargo test --release --features "$features" --no-run --lib --test gpu --test cuda_cli \
        --message-format json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"][0]
        print(("lib" if kind == "lib" else m["target"]["name"]) + " " + m["executable"])
' | while read -r name exe; do
        strip -o "$dir/$name" "$exe"
    done
    strip -o "$dir/distgpt" target/release/distgpt
    echo "$features" >"$dir/features"
    echo "$root" >"$dir/built-in"
    ls -l "$dir"
    exit 0
fi

out="${1:-$root/target/gpu-check}"
venv="${DISTGPT_GPU_VENV:-$HOME/.cache/distgpt-gpu-venv}"
prebuilt="${DISTGPT_GPU_PREBUILT:-}"
mkdir -p "$out"
failed=()

# Runs a step's command under the step timeout, if one is set.
step() {
    if [[ -n "${DISTGPT_GPU_STEP_TIMEOUT:-}" ]]; then
        timeout "$DISTGPT_GPU_STEP_TIMEOUT" "$@"
    else
        "$@"
    fi
}

if ! nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi failed: $out/nvidia-smi.txt)" >&2
    exit 2
fi
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "== $gpus GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"

if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    py=python3
    echo "== Python with PyTorch for CUDA: $(command -v python3) (torch $(python3 -c 'import torch; print(torch.__version__)'))"
else
    echo "== Python with PyTorch and CUDA's wheels (NVRTC, cuBLAS, NCCL) in $venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check torch \
        nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12 nvidia-nccl-cu12 ||
        echo "gpu_check: pip could not install everything; going on with what is there"
    py="$venv/bin/python"
fi
# distgpt looks for the wheels' libraries in the active environment.
VIRTUAL_ENV="$("$py" -c 'import sys; print(sys.prefix)')"
export VIRTUAL_ENV

# CUDA 13 standing in for 12: cudarc opens `libNAME.so` before `.so.12`, so
# a folder of such links, first on the loader's path, hands it CUDA 13's.
shim="$out/cuda13-shim"
rm -rf "$shim"
for lib in nvrtc cublasLt cublas; do
    if ldconfig -p | grep -q "lib$lib\.so\.12 " ||
        find /usr/local/cuda*/lib64 "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/lib \
            -maxdepth 1 -name "lib$lib.so.12*" 2>/dev/null | grep -q .; then
        continue
    fi
    found=$( (ldconfig -p | awk -v n="lib$lib.so.13" '$1 == n { print $NF }'
        find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib \
            "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/lib \
            -maxdepth 1 -name "lib$lib.so.13" 2>/dev/null) | head -n 1)
    if [[ -n "$found" ]]; then
        mkdir -p "$shim"
        ln -sf "$found" "$shim/lib$lib.so"
        # Its own folder too: NVRTC opens its builtins beside the link's path.
        shim_dirs="${shim_dirs:-$shim}:$(dirname "$found")"
        echo "== no lib$lib.so.12 here: CUDA 13's $found stands in"
    fi
done
if [[ -n "${shim_dirs:-}" ]]; then
    export LD_LIBRARY_PATH="$shim_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [[ -n "$prebuilt" ]]; then
    features=$(cat "$prebuilt/features")
    echo "== binaries built elsewhere, from $prebuilt (--features $features)"
    # The test binaries read the repository, and run the CLI, at the paths
    # cargo built them in: a link there, where that path is free.
    built=$(cat "$prebuilt/built-in")
    if [[ "$built" != "$root" && ! -e "$built" ]]; then
        mkdir -p "$(dirname "$built")" && ln -s "$root" "$built"
    fi
    mkdir -p target/release
    cp "$prebuilt/distgpt" target/release/distgpt
else
    echo "== build (--features $features)"
    cargo build --release --features "$features" || exit 1
fi
# tests NAME: the command running one test binary (lib, gpu, cuda_cli), in cmd.
tests() {
    if [[ -n "$prebuilt" ]]; then
        cmd=("$prebuilt/$1")
    elif [[ $1 == lib ]]; then
        cmd=(cargo test --release --features "$features" --lib --)
    else
        cmd=(cargo test --release --features "$features" --test "$1" --)
    fi
}
bin="$root/target/release/distgpt"
"$bin" devices | tee "$out/devices.txt"

echo "== 1. every kernel on cuda against the CPU"
tests lib
DISTGPT_REQUIRE_CUDA=1 step "${cmd[@]}" backend:: 2>&1 | tee "$out/kernels.txt" ||
    failed+=("1 (kernels)")

echo "== 2. a training step, every strategy, generation and train --device cuda against the CPU"
for t in gpu cuda_cli; do
    tests "$t"
    DISTGPT_REQUIRE_CUDA=1 DISTGPT_HAVE_CUDA=1 step "${cmd[@]}" 2>&1 |
        tee -a "$out/backend.txt" || failed+=("2 ($t)")
done

echo "== 3. every data-parallel strategy over NCCL against single-GPU training"
np=1
for n in 2 4 8; do
    if ((n <= gpus)); then np=$n; fi
done
launch=()
if [[ "$features" == *mpi* ]]; then
    launch=(mpirun -np "$np")
    if [[ $EUID -eq 0 ]]; then launch+=(--allow-run-as-root); fi
    how="$np process(es) under mpirun"
else
    how="$np thread rank(s) of one process (no Open MPI)"
fi
common=(train --device cuda --model tiny --steps 20 --batch-size 8 --eval-every 0
    --sample-tokens 0 --quiet --overwrite)
mkdir -p "$out/runs"
: >"$out/nccl.txt"
if ! step "$bin" "${common[@]}" --out "$out/runs/single" >"$out/runs/single.log" 2>&1; then
    echo "single on cuda: the run failed ($out/runs/single.log)" | tee -a "$out/nccl.txt"
    failed+=("3 (single)")
else
    for s in ddp zero1 zero2 fsdp; do
        if ! step "${launch[@]}" "$bin" "${common[@]}" --comm nccl --strategy "$s" \
            --world-size "$np" --out "$out/runs/$s" >"$out/runs/$s.log" 2>&1; then
            echo "$s over NCCL: the run failed ($out/runs/$s.log)" | tee -a "$out/nccl.txt"
            tail -n 5 "$out/runs/$s.log"
            failed+=("3 ($s)")
            continue
        fi
        "$py" - "$out/runs/single" "$out/runs/$s" "$s" "$how" <<'EOF' | tee -a "$out/nccl.txt" || failed+=("3 ($s)")
import json, sys
def losses(run):
    rows = (json.loads(l) for l in open(f"{run}/metrics.jsonl"))
    return [r["loss"] for r in rows if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
err = max((abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)), default=float("inf"))
ok = len(a) == len(b) == 20 and err <= 1e-4
print(f"{sys.argv[3]} over NCCL on {sys.argv[4]}: {len(b)} steps, "
      f"largest relative loss difference to single {err:.2e}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
EOF
    done
fi

echo "== 4. GPT-2 124M, T = 1024, against PyTorch on this GPU"
step "$py" bench/pytorch_reference.py --device cuda --model gpt2 --batch-size 8 \
    --seq-len 1024 --steps 10 --warmup 3 --peak-tflops 989 \
    --torch-variants eager,eager-bf16,compile-bf16 --distgpt "$bin" 2>&1 |
    tee "$out/bench.txt" || failed+=("4 (bench)")

echo "== 5. CPU offload: GPT-2 124M on this GPU without it, with it, with the copies serial"
# (tests/gpu.rs in step 2 already checked it against the run without offload,
# its resume and its memory on this GPU; this is what it costs)
: >"$out/offload.txt"
for o in none optimizer "optimizer --offload-serial"; do
    # shellcheck disable=SC2086
    step "$bin" bench --device cuda --model gpt2 --batch-size 8 --seq-len 1024 --steps 10 \
        --warmup 3 --peak-tflops 989 --offload $o 2>&1 | tee -a "$out/offload.txt" ||
        failed+=("5 (--offload $o)")
done
step "$bin" bench --device cuda --model gpt2 --strategy fsdp --world-size "$gpus" --batch-size 8 \
    --seq-len 1024 --steps 10 --warmup 3 --peak-tflops 989 --offload params 2>&1 |
    tee -a "$out/offload.txt" || failed+=("5 (fsdp --offload params)")

if ((${#failed[@]})); then
    echo "== done, with failures in step ${failed[*]}: results in $out" >&2
    exit 1
fi
echo "== done: results in $out"
