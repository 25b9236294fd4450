#!/usr/bin/env bash
# The sanitizer job (docs/building.md, "Sanitizers"): builds the library and the tests
# labelled `sanitize` with AddressSanitizer and UndefinedBehaviorSanitizer in their own
# build directory and runs them. Any report fails the test it happens in.
# Usage: scripts/sanitize.sh [extra ctest arguments]   (BUILD_ASAN=DIR, JOBS=N)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_ASAN:-build-asan}
jobs=${JOBS:-$(nproc)}
run=scripts/in_env.sh
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

# -O1: fast enough to build and to run; -g1: line numbers in the reports; asserts stay on.
$run cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DHP_SANITIZE=address,undefined \
  -DHP_BUILD_EXAMPLES=OFF -DHP_BUILD_TRAINER=OFF -DHP_BUILD_BENCH=OFF "${launcher[@]}"
$run cmake --build "$build" -j "$jobs" --target sanitize_tests

# Inherited by every rank the tests launch (the harness and hp-run pass the environment on).
# LibTorch is not instrumented and needs no suppressions: LeakSanitizer finds nothing of its
# own. The tests see no GPU (CUDA_VISIBLE_DEVICES is empty), so CUDA's fixed mappings
# (protect_shadow_gap=0 on a GPU) do not arise.
export ASAN_OPTIONS="detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:detect_leaks=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
# Not the killed-save tests: 230 of the 1,100 test-seconds (they kill savers mid-write;
# the other checkpoint tests run the same saving code).
$run ctest --test-dir "$build" -L sanitize -E '^ShardedCheckpoint\.Killed' --output-on-failure \
  -j "$jobs" --timeout 300 "$@"
