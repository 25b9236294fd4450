#!/usr/bin/env bash
# The GPU check: runs what needs a GPU, on a machine with one or more CUDA GPUs and a
# CUDA build of PyTorch >= 2.6 in python3, without network. It builds natively against
# that torch into BUILD_DIR (default build-gpu/) with every core, only the targets it runs.
# The Debian packages the build needs besides torch travel with the tree: fetch them
# where there is network first (scripts/offline_packages.sh fetch -> .offline/debs); they
# are unpacked into BUILD_DIR, never into /.
#
# Everything up to the build runs without a GPU. One GPU is enough for everything here: one-rank groups get a real one-rank NCCL group
# (HP_ONE_RANK_GROUPS_COMMUNICATE=1), so the lanes, held memory, coalesced and fused
# collectives and the all-reduce lane all run. Multi-rank NCCL needs a GPU per rank
# (docs/gpu.md). Prints each step's time. A check that fails is reported and the others
# still run (the machine is rare); the script then ends with "gpu_check: FAIL" and the
# list, exit 1, or with "gpu_check: PASS". Failures to build stop it at once.
#   scripts/gpu_check.sh [--quick] [BUILD_DIR]     --quick: the second run (no trainer, no
#                                                  benchmark, no trace)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = --quick ] && { quick=1; shift; }
build=${1:-build-gpu}
began=$(date +%s)
step() { echo "== $* ($(($(date +%s) - began)) s)"; }
fail() { echo "gpu_check: FAIL: $*" >&2; exit 1; }
failures=()
failed() { echo "gpu_check: FAILED: $*" >&2; failures+=("$*"); }

step "torch"
torch_prefix=$(python3 - <<'PY'
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f"gpu_check: python3 has no torch ({e}); install a CUDA build of PyTorch >= 2.6")
major, minor = (int(v) for v in torch.__version__.split(".")[:2])
print(f"torch {torch.__version__} from {torch.__file__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}, "
      f"{torch.cuda.device_count()} device(s)", file=sys.stderr)
if (major, minor) < (2, 6):
    sys.exit(f"gpu_check: torch {torch.__version__} is older than 2.6, which HyperParallel needs")
if torch.version.cuda is None:
    sys.exit(f"gpu_check: python3's torch {torch.__version__} is not a CUDA build")
print(torch.utils.cmake_prefix_path)
PY
) || exit 1

step "packages"
prefixes=$torch_prefix
if [ -d .offline/debs ]; then
  offline=$(scripts/offline_packages.sh unpack .offline/debs "$build/offline") ||
    fail "could not unpack .offline/debs"
  prefixes="$prefixes;$offline"
  echo "unpacked $(ls .offline/debs | wc -l) packages into $build/offline"
else
  echo "no .offline/debs: CMake looks for GoogleTest, nlohmann-json, libzip, CLI11 and toml++ on the system"
fi

step "build ($(nproc) jobs)"
# TorchConfig needs nvcc to find the CUDA toolkit.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefixes" \
  -DPython3_EXECUTABLE="$(command -v python3)" >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; fail "cmake could not configure (above)"; }
grep -E "Torch|NCCL|HP_" "$build.configure.log" || true
cmake --build "$build" -j "$(nproc)" --target test_cuda test_activation_swap_cuda stream_check \
  hp-run train_decoder hp_bench

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ||
  fail "no GPU here (nvidia-smi failed); everything from here on needs one"
python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' ||
  fail "python3's torch sees no GPU"

export HP_ONE_RANK_GROUPS_COMMUNICATE=1
hp_run=("$build/hp-run" -n 1 --timeout 300 --)

step "fully_shard on one GPU against the plain model there (tests/fsdp/test_cuda.cpp)"
for communicate in 0 1; do
  out=$(mktemp)
  HP_ONE_RANK_GROUPS_COMMUNICATE=$communicate "$build/tests/test_cuda" | tee "$out" ||
    failed "test_cuda with HP_ONE_RANK_GROUPS_COMMUNICATE=$communicate"
  grep -q "SKIPPED" "$out" && failed "the CUDA tests were skipped: this process sees no CUDA device"
  grep -q "PASSED" "$out" || failed "test_cuda passed nothing"
done

step "activation swap on one GPU: pinned host memory, side-stream copies (tests/activation_swap/test_activation_swap_cuda.cpp)"
out=$(mktemp)
"$build/tests/test_activation_swap_cuda" | tee "$out" || failed "test_activation_swap_cuda"
grep -q "SKIPPED" "$out" && failed "the activation swap CUDA tests were skipped: no CUDA device"
grep -q "PASSED" "$out" || failed "test_activation_swap_cuda passed nothing"

# Each variant's printed losses, gradient norms and checksum must be bitwise equal across
# the modes: the communication streams as they are, with delays injected on the lanes and
# before compute's events, with every kernel synchronous, with no lanes at all, and with
# one-rank groups not communicating (no collectives: the shortcuts). --probe runs a block
# on its own right after a slow optimizer step.
step "stream check: every mode bitwise equal"
modes=("" "HP_DEBUG_STREAMS=delay" "CUDA_LAUNCH_BLOCKING=1" "HP_DEBUG_STREAMS=serial"
       "HP_ONE_RANK_GROUPS_COMMUNICATE=0")
for variant in "--probe" "--fusion --replicate" "--keep --recompute --mp bf16" "--fusion --mp fp16"; do
  echo "-- stream_check $variant"
  # shellcheck disable=SC2086  # the variant is a list of options
  tests/fsdp/same_output.sh "${modes[@]}" -- "${hp_run[@]}" "$build/tests/stream_check" \
    --width 1024 --steps 20 $variant || failed "stream_check $variant differs between modes (above)"
done

# The codecs quantize and dequantize on the lanes. They quantize only where something
# travels, so these modes all keep one-rank groups communicating.
step "stream check with quantized collectives: every mode bitwise equal"
for variant in "--codec int8 --error-feedback" "--codec fp8 --fusion --error-feedback" \
  "--codec int8 --fusion --mp bf16 --keep --replicate"; do
  echo "-- stream_check $variant"
  # shellcheck disable=SC2086  # the variant is a list of options
  tests/fsdp/same_output.sh "${modes[@]:0:4}" -- "${hp_run[@]}" "$build/tests/stream_check" \
    --width 1024 --steps 20 $variant || failed "stream_check $variant differs between modes (above)"
done

# With every lane and compute event sleeping 20 ms, a forward that only issues work
# returns in well under 20 ms of host time; one that blocked on the device would not.
# In a steady loop the device memory allocated and reserved stay the same.
step "host-blocking and memory probes"
probe="$build/probe.txt"
HP_DEBUG_STREAMS=delay HP_DEBUG_STREAMS_DELAY_US=20000 "${hp_run[@]}" "$build/tests/stream_check" \
  --width 1024 --steps 6 --report >"$probe" 2>&1 || failed "stream_check --report (delay)"
grep -v '^\[rank 0\] step' "$probe"
# (hp-run prefixes each line with "[rank 0] ".)
longest=$(sed -n 's/.*longest host time of a forward after step 2: \([0-9.]*\) ms$/\1/p' "$probe")
[ -n "$longest" ] && python3 -c "import sys; sys.exit(not $longest < 20)" ||
  failed "a forward blocked the host (${longest:-no} ms with 20 ms device sleeps)"
"${hp_run[@]}" "$build/tests/stream_check" --width 1024 --steps 100 --report >"$probe" 2>&1 ||
  failed "stream_check --report"
grep -v '^\[rank 0\] step' "$probe"
if [ "$(grep -c 'memory after step' "$probe")" -ne 2 ]; then
  failed "no memory report"
elif [ "$(grep 'memory after step' "$probe" | sed 's/.*: //' | sort -u | wc -l)" -ne 1 ]; then
  failed "device memory changed between step 10 and step 100"
fi

if [ $quick = 0 ]; then
  step "trainer on one GPU rank, 500 steps"
  "${hp_run[@]}" "$build/trainer/train_decoder" --mesh 1x1 --data README.md --data docs \
    --log-every 100 --out "$build/gpu_demo" --require-learning ||
    failed "the trainer failed or did not learn"

  # The same model, batches and timing loop in both programs, one after the other: step
  # time of fully_shard (without and with its one-rank collectives) and of FSDP2 at
  # world size 1, each against its own program's unwrapped model.
  step "step time at world size 1: unwrapped vs fully_shard (hp_bench) and vs FSDP2 (fsdp2_bench.py)"
  shape=(--dim 1024 --layers 8 --heads 8 --seq 512 --batch 8 --steps 20 --warmup 3)
  {
    HP_ONE_RANK_GROUPS_COMMUNICATE=0 "${hp_run[@]}" "$build/bench/hp_bench" --no-copy-count \
      --variants local,hp,hp:fusion,hp:keep "${shape[@]}"
    # As FSDP2 does at world size 1: the collectives run, on a one-rank NCCL group.
    HP_ONE_RANK_GROUPS_COMMUNICATE=1 "${hp_run[@]}" "$build/bench/hp_bench" --no-copy-count \
      --variants hp,hp:fusion --label one-rank-nccl "${shape[@]}"
    HP_ONE_RANK_GROUPS_COMMUNICATE=0 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 bench/fsdp2_bench.py --device cuda --variants local,fsdp2 "${shape[@]}"
  } | sed -n 's/^\(\[rank 0\] \)\{0,1\}RESULT //p' >"$build/step_time.jsonl"
  python3 - "$build/step_time.jsonl" <<'PY' || failed "the step-time table"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
local = {r["impl"]: r["step_ms"] for r in rows if r["variant"] == "local"}
for r in rows:
    base = local["cpp" if r["impl"] in ("hp", "cpp") else "py"]
    print(f'{r["impl"]:6} {r["variant"]:10} {r["label"]:13} fwd {r["fwd_ms"]:8.2f}  bwd {r["bwd_ms"]:8.2f}  '
          f'opt {r["opt_ms"]:7.2f}  step {r["step_ms"]:8.2f} ms  vs unwrapped {r["step_ms"] / base:.2f}')
PY
  [ "$(wc -l <"$build/step_time.jsonl")" -eq 8 ] || failed "a benchmark variant is missing"

  step "trace of one trainer step on the GPU (CUDA-event times)"
  "${hp_run[@]}" "$build/trainer/train_decoder" --mesh 1x1 --data README.md --data docs \
    --steps 100 --trace "$build/gpu_trace" --out "$build/gpu_trace_run" | tail -1 &&
    ls -l "$build/gpu_trace" || failed "the traced trainer run"
fi

step "done"
if [ ${#failures[@]} -gt 0 ]; then
  echo "gpu_check: FAIL (${#failures[@]}):"
  printf '  %s\n' "${failures[@]}"
  exit 1
fi
echo "gpu_check: PASS"
