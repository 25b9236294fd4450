#!/usr/bin/env bash
# Runs a command where LibTorch >= 2.6 is available: natively when this host has it
# (CMAKE_PREFIX_PATH, or an installed Python torch), otherwise inside the Debian 13
# build root (tools/buildroot.sh). HP_NATIVE=1 forces native, HP_NATIVE=0 the root.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

native_torch_prefix() {
  local prefix version cmake_prefixes
  cmake_prefixes=${CMAKE_PREFIX_PATH:-}
  for prefix in ${cmake_prefixes//:/ } /usr/lib/*-linux-gnu/cmake /usr/local/lib/cmake; do
    for version in "$prefix"/Torch/TorchConfigVersion.cmake "$prefix"/share/cmake/Torch/TorchConfigVersion.cmake; do
      [ -f "$version" ] || continue
      grep -Eq 'PACKAGE_VERSION "2\.([6-9]|[1-9][0-9])|PACKAGE_VERSION "[3-9]\.' "$version" &&
        { dirname "$(dirname "$version")"; return 0; }
    done
  done
  python3 - 2>/dev/null <<'PY' || return 1
import torch, sys
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
if (major, minor) < (2, 6):
    sys.exit(1)
print(torch.utils.cmake_prefix_path)
PY
}

case "${HP_NATIVE:-auto}" in
  1) exec "$@" ;;
  0) exec "$here/buildroot.sh" run "$@" ;;
esac
if prefix=$(native_torch_prefix); then
  export CMAKE_PREFIX_PATH="$prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  exec "$@"
fi
exec "$here/buildroot.sh" run "$@"
