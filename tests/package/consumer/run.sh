#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, builds tests/package/consumer against it with
# find_package(HyperParallel), and runs the result under hp-run.
set -euo pipefail
build_dir=$1
source_dir=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
cmake -S "$source_dir" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$scratch/prefix;${CMAKE_PREFIX_PATH:-}" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$scratch/build" >/dev/null
"$scratch/prefix/bin/hp-run" -n 1 --timeout 60 -- "$scratch/build/consumer"
