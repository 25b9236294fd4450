#!/usr/bin/env python3
"""Reads a HyperParallel sharded checkpoint (hp::save_sharded_checkpoint) in Python.

    sharded_checkpoint.py DIR                      list its tensors
    sharded_checkpoint.py DIR --out FILE.pt        write them, whole, with torch.save
    sharded_checkpoint.py DIR --prefix model/ ...  only the model (names without prefix)

As a module: load(DIR, prefix="") returns {name: whole tensor}. The pieces are read with
the `safetensors` package, placed by index.json and checked against their CRC-32.
"""
import argparse
import contextlib
import json
import os
import sys
import zlib

import torch
from safetensors import safe_open


def load(directory, prefix=""):
    if not os.path.exists(os.path.join(directory, "COMPLETE")):
        raise ValueError(f"{directory} is not a complete sharded checkpoint (no COMPLETE marker)")
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    tensors = {}
    with contextlib.ExitStack() as stack:
        files = {}
        for name, entry in index["tensors"].items():
            if not name.startswith(prefix):
                continue
            whole = None
            for piece in entry["pieces"]:
                if piece["file"] not in files:
                    path = os.path.join(directory, piece["file"])
                    files[piece["file"]] = stack.enter_context(safe_open(path, framework="pt"))
                data = files[piece["file"]].get_tensor(name)
                crc = zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes())
                if f"{crc:08x}" != piece["crc32"]:
                    raise ValueError(f"tensor '{name}' in {piece['file']} is damaged (CRC-32)")
                if whole is None:
                    whole = torch.empty(entry["shape"], dtype=data.dtype)
                region = tuple(slice(o, o + n) for o, n in zip(piece["offsets"], piece["shape"]))
                whole[region] = data
            tensors[name[len(prefix):]] = whole
    return tensors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--prefix", default="", help="only names starting with it (dropped)")
    parser.add_argument("--out", help="torch.save the whole tensors into this file")
    args = parser.parse_args()
    try:
        tensors = load(args.dir, args.prefix)
    except (OSError, ValueError) as error:
        sys.exit(f"sharded_checkpoint.py: {error}")
    if args.out:
        torch.save(tensors, args.out)
    else:
        for name, tensor in tensors.items():
            print(f"{name}\t{str(tensor.dtype).removeprefix('torch.')}\t{list(tensor.shape)}")


if __name__ == "__main__":
    main()
