#!/usr/bin/env python3
"""Reads a HyperParallel sharded checkpoint (hp::save_sharded_checkpoint) in Python.

    sharded_checkpoint.py DIR                      list its tensors
    sharded_checkpoint.py DIR --out FILE.pt        write them, whole, with torch.save
    sharded_checkpoint.py DIR --model ...          only the model's parameters and buffers
    sharded_checkpoint.py DIR --prefix optim/ ...  only names starting with it (dropped)

As a module: load(DIR, prefix="") and load_model(DIR) return {name: whole tensor}.

PyTorch's Distributed Checkpoint loads a checkpoint's model part directly
(dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(DIR)),
docs/checkpoints.md). This converter is for what DCP does not do: the pieces are read with
the `safetensors` package, placed by index.json and checked against their CRC-32; the
index itself is checked against the CRC-32 in COMPLETE, and its pieces must cover every
tensor exactly once. A damaged checkpoint raises ValueError naming the file.
"""

import argparse
import contextlib
import json
import os
import sys
import zlib

import torch
from safetensors import SafetensorError, safe_open

COMPLETE_RECORD = "index.json crc32 "
# Names of the optimizer's state, the program's extras and the error-feedback residuals;
# the rest are the model's (under "model/" in checkpoints of earlier versions).
NOT_MODEL_PREFIXES = ("optim/", "extra/", "error_feedback/")
EARLIER_MODEL_PREFIX = "model/"


def read_index(directory):
    """index.json, checked against COMPLETE's CRC-32 (absent in older checkpoints)."""
    complete = os.path.join(directory, "COMPLETE")
    if not os.path.exists(complete):
        raise ValueError(f"{directory} is not a complete sharded checkpoint (no COMPLETE marker)")
    with open(complete) as f:
        record = f.readline().rstrip("\n")
    index_path = os.path.join(directory, "index.json")
    with open(index_path, "rb") as f:
        text = f.read()
    if record:
        if not record.startswith(COMPLETE_RECORD):
            raise ValueError(f"{complete} is damaged (it reads {record!r})")
        if f"{zlib.crc32(text):08x}" != record[len(COMPLETE_RECORD) :]:
            raise ValueError(f"{index_path} is damaged (CRC-32)")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{index_path} is malformed: {error}") from None


def check_coverage(name, entry, index_path):
    """The pieces of a tensor lie inside it and cover it exactly once."""
    covered = torch.zeros(entry["shape"], dtype=torch.int32)
    for piece in entry["pieces"]:
        if any(
            o < 0 or o + n > s for o, n, s in zip(piece["offsets"], piece["shape"], entry["shape"])
        ):
            raise ValueError(f"{index_path} is damaged: a piece of '{name}' lies outside it")
        covered[tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["shape"]))] += 1
    if not bool((covered == 1).all()):
        raise ValueError(f"{index_path} is damaged: the pieces of '{name}' do not cover it once")


def load_model(directory):
    """The model's parameters and buffers, by their fully qualified names."""
    tensors = load(directory)
    if any(name.startswith(EARLIER_MODEL_PREFIX) for name in tensors):
        return {
            n[len(EARLIER_MODEL_PREFIX) :]: t
            for n, t in tensors.items()
            if n.startswith(EARLIER_MODEL_PREFIX)
        }
    return {n: t for n, t in tensors.items() if not n.startswith(NOT_MODEL_PREFIXES)}


def load(directory, prefix=""):
    index = read_index(directory)
    tensors = {}
    with contextlib.ExitStack() as stack:
        files = {}
        for name, entry in index["tensors"].items():
            if not name.startswith(prefix):
                continue
            check_coverage(name, entry, os.path.join(directory, "index.json"))
            whole = None
            for piece in entry["pieces"]:
                if piece["file"] not in files:
                    path = os.path.join(directory, piece["file"])
                    try:
                        files[piece["file"]] = stack.enter_context(safe_open(path, framework="pt"))
                    except SafetensorError as error:
                        raise ValueError(
                            f"{path} is not a readable safetensors file: {error}"
                        ) from None
                try:
                    data = files[piece["file"]].get_tensor(name)
                except SafetensorError as error:
                    raise ValueError(
                        f"cannot read '{name}' from {piece['file']}: {error}"
                    ) from None
                crc = zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes())
                if f"{crc:08x}" != piece["crc32"]:
                    raise ValueError(f"tensor '{name}' in {piece['file']} is damaged (CRC-32)")
                if whole is None:
                    whole = torch.empty(entry["shape"], dtype=data.dtype)
                region = tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["shape"]))
                whole[region] = data
            tensors[name[len(prefix) :]] = whole
    return tensors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--prefix", default="", help="only names starting with it (dropped)")
    parser.add_argument("--model", action="store_true", help="only the model's tensors")
    parser.add_argument("--out", help="torch.save the whole tensors into this file")
    args = parser.parse_args()
    try:
        tensors = load_model(args.dir) if args.model else load(args.dir, args.prefix)
    except (OSError, ValueError) as error:
        sys.exit(f"sharded_checkpoint.py: {error}")
    if args.out:
        torch.save(tensors, args.out)
    else:
        for name, tensor in tensors.items():
            print(f"{name}\t{str(tensor.dtype).removeprefix('torch.')}\t{list(tensor.shape)}")


if __name__ == "__main__":
    main()
