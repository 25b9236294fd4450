#!/usr/bin/env python3
"""PyTorch FSDP2 counterpart of bench/hp_bench.cpp: the same models, batches, optimizer
and timing loop, so that step times can be compared line by line.

Run on every rank (torchrun environment), e.g.
    USE_LIBUV=0 hp-run -n 2 -- python3 bench/fsdp2_bench.py --variants local,fsdp2

Variants (alternated step by step in one process, like hp_bench):
    local           the plain model on this rank's batch, no communication
    fsdp2           torch.distributed.fsdp.fully_shard, defaults
    fsdp2:prefetch  + the documented CPU-friendly overlap recipe: async unshard and an
                    explicit forward prefetch of the next block
    fsdp2:raf       reshard_after_forward=True (failed in backward on CPU with torch 2.6)
    hyperparallel   hyperparallel.fully_shard (this project's Python package, on the C++
                    core), the same calls as fsdp2, one collective per parameter; flags as
                    fsdp2's (raf) and int8 (int8 all-gather and reduce-scatter with error
                    feedback), fusion (comm_fusion: one per module, the package's default
                    here), e.g. hyperparallel:raf+int8

--deferred-init builds the model on the meta device, applies fully_shard there, then
allocates only the local shards (to_empty) and initializes them (FSDP2's documented
meta-device recipe; the values differ from an eager build, the sizes do not).

Rank 0 prints one "RESULT {json}" line per variant, with peak RSS and the RSS at the end
of the last step's forward (the forward/backward boundary) of every rank.

--device cuda runs on cuda:LOCAL_RANK with NCCL (hp_bench runs on the GPU by itself when
every rank has one); each phase's time then ends with a device synchronization.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives


# --- CPU shims -------------------------------------------------------------------------
# FSDP2 is written against CUDA streams. torch.cpu.Stream is a stub without
# record_event / wait_event; on CPU every op is already ordered on the calling thread,
# so an event that is always complete and a no-op wait are exact.
def _record_event(self, event=None):
    return torch.cpu.Event()


torch.cpu.Stream.record_event = _record_event
torch.cpu.Stream.wait_event = lambda self, event: None

# For fp32 gradients FSDP2 relies on the backend's ReduceOp.AVG. Gloo rejects AVG in
# all_reduce (HSDP fails) and treats it as SUM in reduce_scatter (gradients come out
# world-size times too large). FSDP2 can use SUM collectives with explicit pre/post
# divisions instead -- as HyperParallel does; same traffic, one or two extra in-place
# divisions, correct averages. Newer torch has a switch for it
# (FSDPModule.set_force_sum_reduction_for_comms, used after fully_shard below); older
# torch (2.6) is patched to take the path it uses for fp16 for every dtype.
_orig_factors = _fsdp_collectives._get_gradient_divide_factors


def _divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype):
    return _orig_factors(reduce_scatter_group, all_reduce_group, torch.float16)


FORCE_SUM_SWITCH = hasattr(torch.distributed.fsdp.FSDPModule, "set_force_sum_reduction_for_comms")
if not FORCE_SUM_SWITCH:
    _fsdp_collectives._get_gradient_divide_factors = _divide_factors


# --- the models -----------------------------------------------------------------------
# models/transformer.h's twin: the same parameter names, operators and initialization.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from transformer import Transformer  # noqa: E402


class Tiny(nn.Module):
    """Many tiny blocks: measures per-block scheduling cost, not compute."""

    def __init__(self, blocks, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def blocks(self):
        return list(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


# --- measurement helpers ------------------------------------------------------------
def vm_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["transformer", "tiny"], default="transformer")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--tiny-blocks", type=int, default=64)
    ap.add_argument("--tiny-width", type=int, default=8)
    ap.add_argument("--mesh", default="", help="RxS; default 1xWORLD (FSDP)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="local,fsdp2")
    ap.add_argument("--label", default="")
    ap.add_argument("--deferred-init", action="store_true", help="meta-device init")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    if args.deferred_init and args.model != "transformer":
        raise SystemExit("--deferred-init needs --model transformer (its init_weights)")

    torch.set_num_threads(1)  # ranks share the machine's cores (as hp_bench)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicate, shard = (1, world)
    if args.mesh:
        replicate, shard = (int(x) for x in args.mesh.split("x"))
    assert replicate * shard == world, f"--mesh {args.mesh} needs {replicate * shard} ranks"
    if replicate == 1:
        mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh(
            device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )

    # The process before any model exists (torch, Gloo, the mesh): peak RSS minus this is
    # what the variant's model, optimizer and steps cost.
    base_rss = vm_kib("VmRSS") / 1024.0

    sizes = {}  # the model's parameter counts, before sharding

    def build(variant):
        torch.manual_seed(0)  # the same initial model for every variant and rank
        with torch.device("meta" if args.deferred_init else "cpu"):
            if args.model == "transformer":
                model = Transformer(
                    args.vocab, args.dim, args.heads, args.layers, 4 * args.dim, args.seq
                )
            else:
                model = Tiny(args.tiny_blocks, args.tiny_width)
        if not args.deferred_init:
            model.to(device)  # before fully_shard, as it is built (no-op on the CPU)
        sizes.setdefault("params", sum(p.numel() for p in model.parameters()))
        sizes.setdefault("block_params", sum(p.numel() for p in model.blocks()[0].parameters()))
        kind, _, flags = variant.partition(":")
        flags = set(filter(None, flags.split("+")))
        if kind == "fsdp2":
            raf = "raf" in flags
            for block in model.blocks():
                fully_shard(block, mesh=mesh, reshard_after_forward=raf)
            fully_shard(model, mesh=mesh, reshard_after_forward=raf)
            if FORCE_SUM_SWITCH:
                for module in model.modules():
                    if isinstance(module, torch.distributed.fsdp.FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)
            if "prefetch" in flags:
                # FSDP2's pre-forward / pre-backward all-gathers are synchronous
                # (async_op=False) and overlap on GPUs only through streams; on CPU
                # overlap needs async unshards plus explicit forward prefetch.
                model._set_unshard_async_op(True)
                blocks = model.blocks()
                for i in range(len(blocks) - 1):
                    blocks[i].set_modules_to_forward_prefetch([blocks[i + 1]])
        elif kind == "hyperparallel":
            import hyperparallel  # noqa: PLC0415 -- only where asked for (PYTHONPATH)

            options = dict(mesh=mesh, reshard_after_forward="raf" in flags)
            if "int8" in flags:
                options.update(
                    all_gather_codec="int8", reduce_scatter_codec="int8", error_feedback=True
                )
            options["comm_fusion"] = "fusion" in flags
            for block in model.blocks():
                hyperparallel.fully_shard(block, **options)
            hyperparallel.fully_shard(model, **options)
        elif kind != "local":
            raise SystemExit(f"unknown variant {variant}")
        if args.deferred_init:
            model.to_empty(device=device)  # sharded: only this rank's shards
            model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return {
            "name": variant,
            "model": model,
            "opt": opt,
            "times": [],
            "error": None,
            "boundary": 0.0,  # RSS at the last step's forward/backward boundary, MiB
        }

    variants = [build(v) for v in args.variants.split(",")]

    def batch(step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        if args.model == "transformer":
            tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
            tokens = tokens.to(device)
            return tokens[:, :-1], tokens[:, 1:]
        return torch.randn(args.batch, args.tiny_width, generator=g).to(device), None

    def now():
        """The time once the device has run what was queued (on the CPU: now)."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def loss_of(model, x, y):
        out = model(x)
        if y is None:
            return out.square().mean()
        return F.cross_entropy(out.reshape(-1, args.vocab), y.reshape(-1))

    for step in range(args.warmup + args.steps):
        x, y = batch(step)
        # Rotate the order so that no variant always runs right after another.
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for v in order:
            if v["error"]:
                continue
            dist.barrier()
            try:
                c0 = time.process_time()  # CPU time of all threads of this process
                t0 = now()
                v["opt"].zero_grad(set_to_none=True)
                loss = loss_of(v["model"], x, y)
                t1 = now()
                if step + 1 == args.warmup + args.steps:
                    v["boundary"] = vm_kib("VmRSS") / 1024.0
                t1b = time.perf_counter()
                loss.backward()
                t2 = now()
                v["opt"].step()
                t3 = now()
                c3 = time.process_time()
            except Exception as e:  # noqa: BLE001 -- reported, not hidden
                v["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            t = [t1 - t0, t2 - t1b, t3 - t2, t3 - t0 - (t1b - t1), c3 - c0]
            t = torch.tensor(t, dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if step >= args.warmup:
                v["times"].append(t.tolist())

    # Per rank: peak, baseline, then each variant's RSS at its forward/backward boundary.
    rss = [vm_kib("VmHWM") / 1024.0, base_rss] + [v["boundary"] for v in variants]
    rss = torch.tensor(rss, dtype=torch.float64, device=device)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        for index, v in enumerate(variants):
            res = {
                "impl": v["name"].split(":")[0] if v["name"] != "local" else "py",
                "variant": v["name"],
                "label": args.label,
                "world": world,
                "mesh": f"{replicate}x{shard}",
                "steps": len(v["times"]),
                "error": v["error"],
                # VmHWM of the whole process: meaningful per variant only when the
                # process ran a single variant.
                "peak_rss_mib": [round(r[0].item(), 1) for r in all_rss],
                "base_rss_mib": [round(r[1].item(), 1) for r in all_rss],
                "boundary_rss_mib": [round(r[2 + index].item(), 1) for r in all_rss],
                "deferred_init": args.deferred_init,
                **sizes,
            }
            if v["times"]:
                cols = list(zip(*v["times"]))
                for key, col in zip(["fwd", "bwd", "opt", "step", "cpu"], cols):
                    res[key + "_ms"] = round(1000 * statistics.median(col), 3)
                if len(cols[3]) >= 2:  # the spread shows how noisy the machine was
                    q = statistics.quantiles(cols[3], n=4, method="inclusive")
                    res["step_p25_ms"] = round(1000 * q[0], 3)
                    res["step_p75_ms"] = round(1000 * q[2], 3)
            print("RESULT " + json.dumps(res), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
