#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): one command for a machine with a CUDA GPU.
#
#   benchmarks/gpu_check.sh --fetch-wheels   # here, with network: the missing packages into .whl/
#   benchmarks/gpu_check.sh                  # there, in the repo root, on the image's python3
#
# Phases, each under its own time limit (9 minutes in all), each logged:
#   1. the machine: nvidia-smi, torch and its CUDA
#   2. benchmarks/gpu_check.py: CUDA against CPU outputs, CUDA graphs on and off (fp32 and bf16), for a
#      dense model, an MoE model, HiSparse and the in-process decode role; host syncs per decode step
#   3. the GPU-relevant tests with KVLIFE_TEST_DEVICE=cuda, then 4. the whole suite the same way
#   5. benchmarks/bench_engine.py and 6. benchmarks/bench_hisparse.py with --device cuda --quick
# Writes under $OUT (the device tool's folder) or bench-results/gpu_check: summary.md (every phase, its
# status and time, the check's table, the benchmarks' tables), gpu_check.json, engine.json,
# hisparse.json and logs.txt (every phase's output): five files.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${KVLIFE_GPU_CHECK_DEVICE:-cuda}

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    grep -v '^#' benchmarks/gpu_wheels.txt | while read -r spec; do
        [ -z "$spec" ] && continue
        $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec" || echo "FAILED: $spec"
    done
    ls .whl
    exit 0
fi

OUT_DIR=${OUT:-bench-results/gpu_check}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
LOGS="$OUT_DIR/logs.txt"
: > "$LOGS"
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >> "$LOGS" 2>&1 || echo "wheel install failed (see logs.txt)"
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 KVLIFE_TEST_DEVICE=$DEVICE TOKENIZERS_PARALLELISM=false
# NOTE: only the plugins the suite uses, whatever else the image installed
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PYTEST=($PY -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p anyio.pytest_plugin
        -p _hypothesis_pytestplugin)

started=$(date +%s)
{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "| phase | exit status | seconds | limit |"
    echo "|---|---|---|---|"
} > "$SUMMARY"
phase() {  # phase NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)" | tee -a "$LOGS"
    local t0=$(date +%s)
    timeout --signal=KILL "$limit" "$@" >> "$LOGS" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - t0 ))
    echo "| $name | $rc$([ $rc -eq 137 ] && echo ' (time limit)') | $took | $limit |" >> "$SUMMARY"
    echo "== $name: exit $rc in $took s" | tee -a "$LOGS"
}

phase machine 30 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
phase check 120 $PY benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT_DIR"
phase gpu-tests 80 "${PYTEST[@]}" tests/test_runner.py tests/test_sampling_batch.py tests/test_cuda_paths.py \
    tests/test_hisparse_batched.py tests/test_hisparse_attention.py tests/test_tiny_model.py tests/test_disaggregation.py \
    tests/test_meta_device.py
# NOTE: -v, so a suite stopped at its limit still shows each test's result in logs.txt
phase suite 200 "${PYTEST[@]}" -v --tb=short --maxfail=20 tests
phase bench-engine 50 $PY benchmarks/bench_engine.py --device "$DEVICE" --quick --out "$OUT_DIR/engine.json"
phase bench-hisparse 40 $PY benchmarks/bench_hisparse.py --device "$DEVICE" --quick --out "$OUT_DIR/hisparse.json"

{
    echo
    echo "Total $(( $(date +%s) - started )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)."
    echo
    [ -f "$OUT_DIR/gpu_check.md" ] && cat "$OUT_DIR/gpu_check.md" && rm -f "$OUT_DIR/gpu_check.md"
    echo
    echo '## Test results'
    echo '```'
    grep -E '( passed| failed| error).* in [0-9.]+s' "$LOGS" || true
    echo "suite: $(grep -c ' PASSED' "$LOGS") passed, $(grep -c ' FAILED' "$LOGS") failed, $(grep -c ' ERROR' "$LOGS") errors"
    grep -E '^(FAILED|ERROR) ' "$LOGS" | head -30 || true
    echo '```'
    echo
    echo '## Benchmarks (as printed)'
    echo '```'
    awk '/^== bench-engine \(/,/^== bench-hisparse:/' "$LOGS" | grep -v '^==' | head -60
    echo '```'
} >> "$SUMMARY"
cat "$SUMMARY"
