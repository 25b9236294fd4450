#!/usr/bin/env bash
# check_gloo_headers.sh PROBE_OBJECT LIBTORCH_CPU: the vtable of c10d's Gloo store adapter
# has the same size in the probe (compiled against this build's Gloo headers) as in
# LibTorch's library (compiled against the Gloo it was built with).
set -euo pipefail
symbol=_ZTVN4c10d16ProcessGroupGloo9GlooStoreE
ours=$(nm -S --defined-only "$1" | awk -v s=$symbol '$4 == s {print $2}')
theirs=$(nm -DS --defined-only "$2" | awk -v s=$symbol '$4 == s {print $2}')
[ -n "$ours" ] || { echo "no $symbol in $1"; exit 1; }
[ -n "$theirs" ] || { echo "no $symbol in $2"; exit 1; }
if [ "$((16#$ours))" != "$((16#$theirs))" ]; then
  echo "Gloo headers do not match LibTorch: the Gloo store vtable has $((16#$ours)) bytes" \
       "here and $((16#$theirs)) in $2; use the Gloo headers of the commit LibTorch pins" \
       "(third_party/gloo/README.md)"
  exit 1
fi
echo "Gloo store vtable: $((16#$ours)) bytes in both"
