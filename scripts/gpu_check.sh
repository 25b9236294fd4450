#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, builds natively against an installed CUDA
# LibTorch (scripts/in_env.sh: CMAKE_PREFIX_PATH, the system, python3's torch) into
# build-gpu/ and runs what needs a GPU. One GPU is enough; NCCL needs a GPU per rank, so
# multi-rank NCCL stays untested on one (docs/gpu.md). Prints each step's time; exits
# nonzero at the first failure. Usage: scripts/gpu_check.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
run=scripts/in_env.sh
began=$(date +%s)
step() { echo "== $* ($(($(date +%s) - began)) s)"; }

step "GPU"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
  echo "gpu_check: no GPU here (nvidia-smi failed); this check needs one" >&2
  exit 1
fi

step "build (native, $(nproc) jobs)"
$run cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
$run cmake --build "$build" -j "$(nproc)"
$run python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
      "devices", torch.cuda.device_count())' || true

step "fully_shard on one GPU against the CPU reference (tests/fsdp/test_cuda.cpp)"
out=$(mktemp)
$run ctest --test-dir "$build" -R '^Cuda\.' --output-on-failure --no-tests=error -V | tee "$out"
if grep -q "SKIPPED" "$out"; then
  echo "gpu_check: the CUDA tests were skipped: this process sees no CUDA device" >&2
  exit 1
fi

step "single-process tests on the GPU machine's build"
$run ctest --test-dir "$build" -L unit --output-on-failure -j "$(nproc)"

step "trainer on one GPU rank, 500 steps (fully_shard moves the CPU-built model to cuda:0)"
$run "$build/hp-run" -n 1 --timeout 300 -- "$build/examples/train_decoder" \
  --mesh 1x1 --data README.md --data docs --log-every 100 --out "$build/gpu_demo"

# Streams that race show as a run that differs from the same run with every kernel
# synchronous. Large parameters make the lanes' copies and the holds' reuse of memory real.
step "stream-race stress: 150 steps of a 1024-wide model, bitwise equal to CUDA_LAUNCH_BLOCKING=1"
stress() {
  $run "$build/hp-run" -n 1 --timeout 300 -- "$build/examples/train_decoder" \
    --mesh 1x1 --data README.md --data docs --dim 1024 --layers 4 --heads 8 --steps 150 \
    --mp "$1" --log-every 10 --out "$build/gpu_stress_$1_$2" | grep -oE 'step +[0-9]+/[0-9]+  loss [0-9.]+  grad norm +[0-9.]+'
}
for mp in none bf16; do
  stress "$mp" async >"$build/stress_async_$mp.txt"
  CUDA_LAUNCH_BLOCKING=1 stress "$mp" blocking >"$build/stress_blocking_$mp.txt"
  if ! cmp -s "$build/stress_async_$mp.txt" "$build/stress_blocking_$mp.txt"; then
    echo "gpu_check: --mp $mp differs from the CUDA_LAUNCH_BLOCKING=1 run (a stream race):" >&2
    diff "$build/stress_async_$mp.txt" "$build/stress_blocking_$mp.txt" >&2 || true
    exit 1
  fi
  [ -s "$build/stress_async_$mp.txt" ] || { echo "gpu_check: no step lines" >&2; exit 1; }
done

# The same model, batches and timing loop in both programs (bench/), one after the other:
# step time of fully_shard and of FSDP2 at world size 1, each against its own program's
# unwrapped model.
step "step time at world size 1: unwrapped vs fully_shard (hp_bench) and vs FSDP2 (fsdp2_bench.py)"
shape=(--dim 1024 --layers 8 --heads 8 --seq 512 --batch 8 --steps 20 --warmup 3)
{
  $run "$build/hp-run" -n 1 --timeout 300 -- "$build/bench/hp_bench" --no-copy-count \
    --variants local,hp,hp:fusion,hp:keep "${shape[@]}"
  $run "$build/hp-run" -n 1 --timeout 300 -- python3 bench/fsdp2_bench.py --device cuda \
    --variants local,fsdp2 "${shape[@]}"
} | grep '^RESULT ' | sed 's/^RESULT //' >"$build/step_time.jsonl"
$run python3 - "$build/step_time.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
local = {r["impl"]: r["step_ms"] for r in rows if r["variant"] == "local"}
for r in rows:
    base = local["cpp" if r["impl"] in ("hp", "cpp") else "py"]
    print(f'{r["impl"]:6} {r["variant"]:10} fwd {r["fwd_ms"]:8.2f}  bwd {r["bwd_ms"]:8.2f}  '
          f'opt {r["opt_ms"]:7.2f}  step {r["step_ms"]:8.2f} ms  vs unwrapped {r["step_ms"] / base:.2f}')
PY
[ "$(wc -l <"$build/step_time.jsonl")" -eq 6 ] || { echo "gpu_check: a benchmark variant is missing" >&2; exit 1; }

step "trace of one step on the GPU (CUDA-event times)"
$run "$build/hp-run" -n 1 --timeout 300 -- "$build/examples/train_decoder" \
  --mesh 1x1 --data README.md --data docs --steps 5 --trace "$build/gpu_trace" \
  --out "$build/gpu_trace_run" >/dev/null
ls -l "$build/gpu_trace"

step "done"
