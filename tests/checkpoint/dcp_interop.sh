#!/usr/bin/env bash
# Sharded checkpoints and PyTorch's Distributed Checkpoint (DCP) read each other:
#  1. C++ (fully_shard on 2 ranks) saves a checkpoint with hp::save_sharded_checkpoint;
#  2. DCP's HuggingFaceStorageReader loads it into a plain PyTorch model, then into an
#     FSDP2 model on 2 ranks: every tensor bitwise, the loss C++ stored within 1e-6;
#  3. DCP's HuggingFaceStorageWriter saves a PyTorch model sharded (FSDP2, 2 ranks) and
#     consolidated (FSDP2 on 2 ranks, and a plain model in one process);
#  4. hp::load_sharded_checkpoint loads each into the C++ model on 1, 2 and 3 ranks, and
#     on 1 rank hp::convert_to_full_checkpoint writes each as a torch.save file;
#  5. files left from another save beside DCP's: a consolidated directory reads only the
#     files its weight map names (and refuses a map naming a missing file); a sharded one
#     refuses a second copy of a piece, since neither copy has a checksum.
# Usage: dcp_interop.sh HP_RUN DCP_INTEROP SOURCE_DIR (python3 is the one on PATH).
# Exits 77 (skipped) where python3's torch has no HuggingFaceStorageReader.
set -euo pipefail
hp_run=$1 program=$2 source_dir=$3
python_side=$source_dir/tests/python/dcp_interop.py
work=$(mktemp -d "${TMPDIR:-/tmp}/hp_dcp_interop.XXXXXX")
trap 'rm -rf "$work"' EXIT
export PYTHONFAULTHANDLER=1  # a Python rank that aborts prints where it was

step() {
  echo "=== $*"
  "$@"
}
on_ranks() {  # on_ranks N CMD...: CMD on N ranks
  local ranks=$1
  shift
  step "$hp_run" -n "$ranks" --timeout 120 -- "$@"
}

on_ranks 2 "$program" export "$work/from_cpp"
step python3 "$python_side" read "$work/from_cpp"  # set -e passes its 77 (skip) on
on_ranks 2 python3 "$python_side" read "$work/from_cpp"

on_ranks 2 python3 "$python_side" write "$work/sharded" --mode sharded
on_ranks 2 python3 "$python_side" write "$work/consolidated" --mode consolidated
step python3 "$python_side" write "$work/consolidated_one_process" --mode consolidated
for ranks in 1 2 3; do
  on_ranks "$ranks" "$program" import "$work/sharded" "$work/consolidated" \
    "$work/consolidated_one_process"
done
# A file left from another save, zeroed, named to sort first (the order files are read).
stale_copy() {  # stale_copy DIR COPY_DIR: COPY_DIR is DIR plus a stale copy of its first file
  cp -r "$1" "$2"
  cp "$1-reference.pt" "$2-reference.pt"
  local first
  first=$(cd "$2" && ls -- *.safetensors | head -n 1)
  step python3 "$python_side" stale "$2/$first" "$2/0-stale.safetensors"
}
stale_copy "$work/consolidated" "$work/consolidated_stale"
on_ranks 2 "$program" import "$work/consolidated_stale"
stale_copy "$work/sharded" "$work/sharded_stale"
on_ranks 2 "$program" refuse "$work/sharded_stale" "neither has a checksum"
cp -r "$work/consolidated" "$work/consolidated_missing"
rm "$(ls "$work"/consolidated_missing/*.safetensors | tail -n 1)"
on_ranks 1 "$program" refuse "$work/consolidated_missing" "which is missing"
echo "dcp_interop: passed"
