#!/usr/bin/env bash
# Runs COMMAND once per SETTING (environment assignments, "" for none) and fails unless
# every run printed exactly what the first one did; each run must print something.
#   same_output.sh SETTING... -- COMMAND [ARGS...]
set -uo pipefail
settings=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do settings+=("$1"); shift; done
shift || { echo "same_output: usage: SETTING... -- COMMAND" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in "${!settings[@]}"; do
  # shellcheck disable=SC2086  # a setting is a list of NAME=VALUE words
  if ! env ${settings[$i]} "$@" >"$out/$i" 2>"$out/$i.err"; then
    echo "same_output: failed with '${settings[$i]}':" >&2
    cat "$out/$i.err" "$out/$i" >&2
    exit 1
  fi
  [ -s "$out/$i" ] || { echo "same_output: no output with '${settings[$i]}'" >&2; exit 1; }
  if [ "$i" -gt 0 ] && ! cmp -s "$out/0" "$out/$i"; then
    echo "same_output: '${settings[$i]}' differs from '${settings[0]}':" >&2
    diff "$out/0" "$out/$i" | head -20 >&2
    exit 1
  fi
  [ "$i" -gt 0 ] && echo "same_output: '${settings[$i]}' printed what '${settings[0]}' did"
done
tail -1 "$out/0"
