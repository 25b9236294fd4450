"""The machine the benchmarks ran on: cores, memory, and the torch build's BLAS speed."""

import os
import time


def machine():
    info = {"cores": os.cpu_count(), "cpu": "?", "mem_gib": None}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(
                (l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?"
            )
        with open("/proc/meminfo") as f:
            info["mem_gib"] = int(f.readline().split()[1]) / 2**20
    except OSError:
        pass
    try:
        import torch

        torch.set_num_threads(1)
        info["torch"] = torch.__version__
        words = torch.__config__.show().replace(",", " ").split()
        info["blas"] = next((w.split("=")[1] for w in words if w.startswith("BLAS_INFO=")), "?")
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        for _ in range(3):
            a @ b
        k, t0 = 20, time.perf_counter()
        for _ in range(k):
            a @ b
        info["gflops"] = 2 * 256**3 * k / (time.perf_counter() - t0) / 1e9
    except Exception as e:  # noqa: BLE001 -- the report is still useful without it
        info["torch"] = f"unavailable ({e})"
    return info
