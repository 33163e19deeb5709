#!/usr/bin/env bash
# Run the OpenCL kernel tests (src/backend/opencl/) at tiny sizes on
# Oclgrind, the OpenCL simulator, loaded as the only ICD, with API checks,
# data-race and uninitialized-value detection. Fails if a test fails or if
# Oclgrind reported anything (out-of-bounds access, race, uninitialized
# read, API misuse, divergence, fatal error): each test's Oclgrind log must
# be empty.
#   OCLGRIND_ICD  the ICD library (default /usr/lib/oclgrind/liboclgrind-rt-icd.so,
#                 from Debian's oclgrind package)
#   any arguments filter the test names (substring), e.g. layernorm
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
icd="${OCLGRIND_ICD:-/usr/lib/oclgrind/liboclgrind-rt-icd.so}"
if [[ ! -f "$icd" ]]; then
    echo "oclgrind-check: $icd not found: install oclgrind (or set OCLGRIND_ICD)" >&2
    exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/vendors"
echo "$icd" >"$work/vendors/oclgrind.icd"

cd "$root"
bin="$(cargo test --lib --no-run --message-format=json 2>/dev/null |
    grep '"test":true' | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -n1)"
if [[ -z "$bin" ]]; then
    echo "oclgrind-check: could not build the test binary (run cargo test --lib --no-run)" >&2
    exit 2
fi

mapfile -t tests < <("$bin" --list --format terse 'backend::gpu::' |
    sed -n 's/: test$//p' | grep -F -- "${1:-}")
if [[ ${#tests[@]} -eq 0 ]]; then
    echo "oclgrind-check: no tests matched" >&2
    exit 2
fi

uninit=()
if [[ "${DISTGPT_OCLGRIND_UNINITIALIZED:-}" == 1 ]]; then
    uninit=(OCLGRIND_UNINITIALIZED=1 OCLGRIND_BUILD_OPTIONS=-cl-opt-disable)
fi

failed=0
# One process per test: a fresh Oclgrind context each, and a report names its test.
for t in "${tests[@]}"; do
    status=0
    env -u OCL_ICD_FILENAMES OCL_ICD_VENDORS="$work/vendors" \
        DISTGPT_OCL_TINY=1 DISTGPT_REQUIRE_OPENCL=1 \
        OCLGRIND_CHECK_API=1 OCLGRIND_DATA_RACES=1 "${uninit[@]}" \
        OCLGRIND_LOG="$work/log" \
        "$bin" --exact "$t" --test-threads 1 --nocapture >"$work/out" 2>&1 || status=$?
    if [[ $status -ne 0 ]]; then
        echo "FAIL $t (test failed, status $status):"
        cat "$work/out"
        failed=1
    elif ! grep -q "OpenCL tests on Oclgrind" "$work/out" && grep -q "OpenCL tests on" "$work/out"; then
        echo "FAIL $t: ran on another device:"
        grep "OpenCL tests on" "$work/out"
        failed=1
    fi
    if [[ -s "$work/log" ]]; then
        echo "FAIL $t (Oclgrind reports):"
        cat "$work/log"
        failed=1
    elif [[ $status -eq 0 ]]; then
        echo "ok   $t"
    fi
    rm -f "$work/log"
done

if [[ $failed -ne 0 ]]; then
    echo "oclgrind-check: FAILED" >&2
    exit 1
fi
echo "oclgrind-check: ${#tests[@]} tests clean under Oclgrind"
