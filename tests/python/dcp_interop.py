#!/usr/bin/env python3
"""The PyTorch side of the checkpoint interoperability test (tests/checkpoint/dcp_interop.sh):
PyTorch's Distributed Checkpoint (DCP) reading hp::save_sharded_checkpoint's directories,
and writing the directories hp::load_sharded_checkpoint reads.

    dcp_interop.py read DIR
        Loads the checkpoint tests/checkpoint/dcp_interop.cpp exported into
        models/transformer.py's Transformer with dcp.load and HuggingFaceStorageReader: a
        plain model in one process, an FSDP2 model (fully_shard on every layer and the root)
        under a launcher with WORLD_SIZE > 1. Every model tensor must be bitwise equal to
        what tools/sharded_checkpoint.py assembles from the files (with their CRCs checked),
        and the loss of the stored batch "extra/tokens" within 1e-6 of "extra/loss".

    dcp_interop.py stale FILE COPY
        Writes COPY: FILE's tensors zeroed, with FILE's metadata (the pieces at the same
        offsets), as a file left from an earlier save would hold other values.

    dcp_interop.py write DIR --mode sharded|consolidated
        Trains the Transformer two steps from a fixed seed, then saves it with dcp.save and
        HuggingFaceStorageWriter: "sharded" from an FSDP2 model (save_distributed, one file
        per rank); "consolidated" whole tensors in two files and model.safetensors.index.json,
        from an FSDP2 model (enable_consolidation) or, in one process, a plain one. Rank 0
        also writes DIR-reference.pt (torch.save): the whole tensors, "extra/tokens" and
        "extra/loss", for the C++ side to compare against.

Both sides build the same configuration (CONFIG here, kConfig in dcp_interop.cpp); a batch
is int64 tokens [B, T + 1], its loss the mean next-token cross-entropy of the logits of
tokens[:, :-1] against tokens[:, 1:]. Exits 77 (the test skips) when this torch has no
HuggingFaceStorageReader (an older one) or the safetensors package is missing.
"""

import argparse
import os
import sys
import warnings

try:
    import safetensors  # noqa: F401 -- HuggingFaceStorageReader reads with it
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError as error:
    print(f"dcp_interop.py: skipped, {error}")
    sys.exit(77)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(SOURCE_DIR, "models"))
sys.path.insert(0, os.path.join(SOURCE_DIR, "tools"))
import sharded_checkpoint  # noqa: E402
from transformer import Transformer  # noqa: E402

# DCP warns on every call without a process group; in one process that is what is meant.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

CONFIG = dict(vocab=64, dim=32, heads=4, layers=2, ffn=64, max_seq=16)
BATCH = 4
LOSS_TOLERANCE = 1e-6


def batch_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def start():
    """(rank, world, mesh): the launcher's ranks joined over Gloo, or one process (mesh None)."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    dist.init_process_group("gloo")
    return dist.get_rank(), world, init_device_mesh("cpu", (world,))


def finish(mesh):
    """Leaves the process group together: no rank closes its Gloo connections while a peer
    is still busy on its side of the last collective."""
    if mesh is not None:
        dist.barrier()
        dist.destroy_process_group()


def shard(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fail(message):
    raise SystemExit(f"dcp_interop.py: FAILED: {message}")


def check_loss(loss, expected, what):
    diff = abs(loss - expected)
    print(f"{what}: loss {loss:.9g}, expected {expected:.9g} (diff {diff:.3g})")
    if not diff <= LOSS_TOLERANCE:
        fail(f"{what}: the loss differs by {diff:.3g} (> {LOSS_TOLERANCE})")


def read(directory):
    rank, world, mesh = start()
    # The independent reading: whole tensors assembled from the pieces, CRCs checked.
    expected = sharded_checkpoint.load_model(directory)
    others = {
        prefix + name: tensor
        for prefix in ("optim/", "extra/")
        for name, tensor in sharded_checkpoint.load(directory, prefix).items()
    }

    torch.manual_seed(99)  # values unlike the checkpoint's, so that loading must change them
    model = Transformer(**CONFIG)
    if mesh is not None:
        shard(model, mesh)
    state = model.state_dict()
    if set(state) != set(expected):
        fail(f"the model's names {sorted(set(state) ^ set(expected))} are on one side only")
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory))
    # Optimizer state and extras load by name too, into tensors of their shape.
    loaded_others = {name: torch.empty_like(tensor) for name, tensor in others.items()}
    dcp.load(loaded_others, storage_reader=HuggingFaceStorageReader(directory))

    what = f"FSDP2 on {world} ranks, rank {rank}" if mesh is not None else "a plain model"
    for name, tensor in state.items():
        got = whole(tensor)
        if got.dtype != expected[name].dtype or not torch.equal(got, expected[name]):
            fail(f"{what}: '{name}' differs from the checkpoint's")
    for name, tensor in others.items():
        if not torch.equal(loaded_others[name], tensor):
            fail(f"{what}: '{name}' differs from the checkpoint's")
    print(f"{what}: {len(state)} model, {len(others)} optimizer and extra tensors bitwise equal")

    with torch.no_grad():
        loss = batch_loss(model, others["extra/tokens"]).item()
    check_loss(loss, others["extra/loss"].item(), what)
    finish(mesh)


def trained_model():
    """The Transformer after two AdamW steps from a fixed seed: the same in every process."""
    torch.manual_seed(1)
    model = Transformer(**CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        generator = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(CONFIG["vocab"], (BATCH, CONFIG["max_seq"] + 1), generator=generator)
        optimizer.zero_grad()
        batch_loss(model, tokens).backward()
        optimizer.step()
    return model


def write(directory, mode):
    rank, world, mesh = start()
    if mode == "sharded" and mesh is None:
        fail("--mode sharded saves an FSDP2 model: run it on several ranks (hp-run -n 2 -- ...)")
    model = trained_model()
    tokens = torch.randint(
        CONFIG["vocab"], (BATCH, CONFIG["max_seq"] + 1), generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        loss = batch_loss(model, tokens)
    reference = {name: t.detach().clone() for name, t in model.state_dict().items()}
    reference.update({"extra/tokens": tokens, "extra/loss": loss})

    if mesh is not None:
        shard(model, mesh)
    if mode == "sharded":
        writer = HuggingFaceStorageWriter(directory, save_distributed=True)
    else:
        # Two files, so that the reader must follow the tensors across them.
        names = list(model.state_dict())
        split = {name: 1 if i < len(names) // 2 else 2 for i, name in enumerate(names)}
        writer = HuggingFaceStorageWriter(
            directory,
            fqn_to_index_mapping=split,
            save_distributed=mesh is not None,
            enable_consolidation=mesh is not None,
        )
    dcp.save(model.state_dict(), storage_writer=writer)
    if rank == 0:
        torch.save(reference, directory.rstrip("/") + "-reference.pt")
        saved = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        print(f"wrote {directory} ({mode}, {world} process(es)): {', '.join(saved)}")
    finish(mesh)


def stale(file, copy):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(file, framework="pt") as saved:
        zeros = {name: torch.zeros_like(saved.get_tensor(name)) for name in saved.keys()}
        save_file(zeros, copy, metadata=saved.metadata())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("read").add_argument("dir")
    writing = commands.add_parser("write")
    writing.add_argument("dir")
    writing.add_argument("--mode", choices=["sharded", "consolidated"], required=True)
    staling = commands.add_parser("stale")
    staling.add_argument("file")
    staling.add_argument("copy")
    args = parser.parse_args()
    if args.command == "read":
        read(args.dir)
    elif args.command == "stale":
        stale(args.file, args.copy)
    else:
        write(args.dir, args.mode)


if __name__ == "__main__":
    main()
