#!/usr/bin/env bash
# Creates the project venv (HP_VENV, default .venv in the checkout) holding the PyTorch
# pinned in scripts/requirements.txt (PyPI's CUDA build) and the Python tools' packages.
# Idempotent: done once, and again only when scripts/requirements.txt changes. Exits
# non-zero, saying why, when the packages cannot be installed (PyPI out of reach).
set -euo pipefail
checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HP_VENV:-$checkout/.venv}
requirements=$checkout/scripts/requirements.txt
stamp=$venv/.hyperparallel-requirements

[ -f "$stamp" ] && cmp -s "$stamp" "$requirements" && exit 0
echo "setup_venv: installing $(grep -E '^torch==' "$requirements") (CUDA build) and the" \
     "tools' packages into $venv (once; about 1-2 minutes and 5.5 GB)" >&2
[ -x "$venv/bin/python3" ] || python3 -m venv "$venv" ||
  { echo "setup_venv: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
rm -f "$stamp"
"$venv/bin/python3" -m pip install --disable-pip-version-check --no-input -q --retries 2 \
  --timeout 30 -r "$requirements" ||
  { echo "setup_venv: pip could not install scripts/requirements.txt into $venv" >&2; exit 1; }
cp "$requirements" "$stamp"
