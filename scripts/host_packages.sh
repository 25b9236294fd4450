#!/usr/bin/env bash
# Installs the Debian packages a native build needs besides LibTorch (idempotent: only
# what is missing, and nothing at all when everything is there). Hosts without apt, or
# users without root, get the list to install themselves; CMake then names what it lacks.
set -euo pipefail

PACKAGES=(g++ cmake make ninja-build libgtest-dev nlohmann-json3-dev zlib1g-dev libzip-dev libcli11-dev
          libtomlplusplus-dev
          python3-venv iproute2 procps)

command -v dpkg-query >/dev/null || exit 0
installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null |
            awk '/install ok installed/ {print $1}' || true)
missing=()
for package in "${PACKAGES[@]}"; do
  grep -qx "$package" <<<"$installed" || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "host_packages: missing ${missing[*]}; install them (apt-get install ${missing[*]})" >&2
  exit 0
fi
echo "host_packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
