#!/usr/bin/env bash
# Runs a command where LibTorch >= 2.6 is available, choosing in this order:
#  1. an installed LibTorch: CMAKE_PREFIX_PATH, the system's CMake packages, python3's torch;
#  2. the project venv (scripts/setup_venv.sh, created here the first time): the PyTorch
#     pinned in scripts/requirements.txt, PyPI's CUDA build, built against natively;
#  3. where PyPI cannot be reached, the Debian 13 build root (scripts/buildroot.sh, LibTorch 2.6).
# HP_NATIVE=1 allows only 1 and 2, HP_NATIVE=0 only 3. Natively, the Debian packages the
# build needs besides LibTorch are installed first (scripts/host_packages.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${HP_VENV:-$(dirname "$here")/.venv}

# Prints DIR if DIR (a CMake prefix) holds Torch >= 2.6.
torch_prefix_ok() {
  local version
  for version in "$1"/Torch/TorchConfigVersion.cmake "$1"/share/cmake/Torch/TorchConfigVersion.cmake; do
    [ -f "$version" ] || continue
    grep -Eq 'PACKAGE_VERSION "2\.([6-9]|[1-9][0-9])|PACKAGE_VERSION "[3-9]\.' "$version" &&
      { echo "$1"; return 0; }
  done
  return 1
}

# The CMake prefix of python $1's torch, found without importing it (that takes seconds).
python_torch_prefix() {
  local package
  package=$("$1" -c 'import importlib.util as u; s = u.find_spec("torch"); print(s.submodule_search_locations[0])' \
            2>/dev/null) || return 1
  torch_prefix_ok "$package/share/cmake"
}

installed_torch_prefix() {
  local prefix cmake_prefixes=${CMAKE_PREFIX_PATH:-}
  for prefix in ${cmake_prefixes//:/ } /usr/lib/*-linux-gnu/cmake /usr/local/lib/cmake; do
    torch_prefix_ok "$prefix" && return 0
  done
  command -v python3 >/dev/null && python_torch_prefix python3
}

run_native() {  # run_native PREFIX CMD...
  local prefix=$1
  shift
  export CMAKE_PREFIX_PATH="$prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  exec "$@"
}

mode=${HP_NATIVE:-auto}
[ "$mode" = 0 ] && exec "$here/buildroot.sh" run "$@"
"$here/host_packages.sh"
if prefix=$(installed_torch_prefix); then run_native "$prefix" "$@"; fi
if "$here/setup_venv.sh" && prefix=$(python_torch_prefix "$venv/bin/python3"); then
  # The venv's python3 runs the Python tools and the tests that read files from Python.
  export VIRTUAL_ENV=$venv PATH="$venv/bin:$PATH"
  run_native "$prefix" "$@"
fi
if [ "$mode" = 1 ]; then
  echo "in_env: HP_NATIVE=1 but there is no LibTorch >= 2.6 and the venv could not be made" >&2
  exit 1
fi
echo "in_env: PyPI out of reach; falling back to the Debian 13 build root (LibTorch 2.6)" >&2
exec "$here/buildroot.sh" run "$@"
