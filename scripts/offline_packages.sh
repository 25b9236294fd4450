#!/usr/bin/env bash
# The Debian packages a native build needs besides LibTorch and the compilers, for a
# machine that cannot fetch them (the GPU machine: no network, no root needed).
#   scripts/offline_packages.sh fetch [DIR]          here, with network: the .debs into DIR
#   scripts/offline_packages.sh unpack DIR PREFIX    there: each .deb into PREFIX (never /)
# unpack prints the CMake prefix to search (PREFIX/usr). The packages are Debian 12's;
# their libraries need only glibc >= 2.36 and the system's libssl3 and libbz2.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The headers and CMake packages of host_packages.sh's libraries, with the shared
# libraries the -dev packages link against.
PACKAGES=(libgtest-dev googletest libgmock-dev nlohmann-json3-dev zlib1g-dev zlib1g libzip-dev
          libzip4 libcli11-dev libtomlplusplus-dev libtomlplusplus3)

case ${1:-} in
  fetch)
    dir=${2:-$(dirname "$here")/.offline/debs}
    mkdir -p "$dir"
    # apt-get download writes to the current directory, as the invoking user.
    (cd "$dir" && apt-get download "${PACKAGES[@]}")
    echo "offline_packages: $(ls "$dir" | wc -l) packages in $dir"
    ;;
  unpack)
    dir=$2 prefix=$3
    [ -d "$dir" ] || { echo "offline_packages: no $dir (run 'fetch' where there is network)" >&2; exit 1; }
    mkdir -p "$prefix"
    prefix=$(cd "$prefix" && pwd)
    for deb in "$dir"/*.deb; do
      if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$deb" "$prefix"
      else  # a .deb is an ar archive; Debian 12's hold data.tar.xz
        ar p "$deb" data.tar.xz | tar -xJ -C "$prefix"
      fi
    done
    # Links to /usr/lib/...: into the prefix, where the files now are.
    find "$prefix" -type l | while read -r link; do
      target=$(readlink "$link")
      if [[ $target = /* ]]; then ln -sfn "$prefix$target" "$link"; fi
    done
    echo "$prefix/usr"
    ;;
  *)
    echo "usage: $0 fetch [DIR] | unpack DIR PREFIX" >&2
    exit 2
    ;;
esac
