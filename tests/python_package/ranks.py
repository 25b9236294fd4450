"""Runs a test body on several ranks: processes on Gloo, rendezvous through a file, each
with a deadline (a rank that hangs or dies fails the test instead of blocking it)."""

import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 300


def _rank_main(rank, world_size, init_file, body, args, errors):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            body(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def run_ranks(world_size, body, *args):
    """body(rank, world_size, *args) on each rank; raises with the first failure's traceback."""
    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "rendezvous")
        processes = [
            context.Process(target=_rank_main, args=(r, world_size, init_file, body, args, errors))
            for r in range(world_size)
        ]
        for p in processes:
            p.start()
        for p in processes:
            p.join(DEADLINE_S)
        hung = [r for r, p in enumerate(processes) if p.is_alive()]
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, trace = sorted(failures)[0]
        raise AssertionError(f"rank {rank} failed:\n{trace}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {DEADLINE_S} s")
    codes = [p.exitcode for p in processes]
    if any(codes):
        raise AssertionError(f"ranks exited with {codes}")
