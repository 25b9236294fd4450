"""The parts of the document above the measured sections, which only a full run rewrites:
the title and how the document is made, the machine, the scaled-down models, the method."""

from reporting.formatting import fmt
from reporting.machine import machine

TITLES = (None, "Machine", "Scaled down from the issue, and why", "Method")


def write(rep, args):
    header(rep, args)
    machine_section(rep, args)
    scaled_down(rep, args)
    method(rep, args)


def header(rep, args):
    p = rep.p
    rep.section(None)
    p(
        "Written by `make bench`, which runs `scripts/in_env.sh bench/run.sh build`: every "
        "benchmark below, then `bench/report.py`, which rewrites this file from the results "
        "(`build/bench/results/SECTION.jsonl`; all output in `log.txt`). Re-running it "
        "replaces every number here. "
        f"This run took {args.seconds // 60} min {args.seconds % 60} s; the transformer "
        f"runs time {args.steps} steps per variant after {args.warmup} warm-up step(s). "
        "`bench/run.sh BUILD --only SECTIONS` (steps, memory, beyond, overhead, netns, "
        "checkpoint, pipeline, recompute, codecs) "
        "reruns some of them and rewrites only their sections and target rows; a section "
        "made that way names the command that made it."
    )
    p()


def machine_section(rep, args):
    p, m = rep.p, machine()
    rep.section("Machine")
    mem = f", {m['mem_gib']:.0f} GiB RAM" if m["mem_gib"] else ""
    p(
        f"- **{m['cores']} cores** ({m['cpu']}){mem}. All ranks are processes on this "
        "machine; they talk through **Gloo over loopback** (TCP through the kernel), "
        "except in the bandwidth-limited run."
    )
    torch_version = m.get("torch", "?")
    origin = (
        "from Debian 13 (the build root)"
        if "debian" in torch_version
        else "from PyPI (the project venv; the C++ side builds against the same wheel)"
    )
    blas = m.get("blas", "?")
    blas_note = " (Debian's reference BLAS, no OpenBLAS or MKL)" if blas == "generic" else ""
    p(
        f"- PyTorch / LibTorch {torch_version} {origin}. Its BLAS is `{blas}`{blas_note}: a "
        f"256x256 fp32 matmul runs at **{fmt(m.get('gflops'))} GFLOP/s** on one thread."
    )
    p(
        "- Every rank calls `at::set_num_threads(1)` (`torch.set_num_threads(1)` in "
        "Python). 2 ranks fill the 2 cores; **4 ranks oversubscribe them 2x**, before "
        "Gloo's worker threads (2 per process group) and the kernel's TCP work are counted. "
        "Compute and communication compete for the same cores: communication costs CPU "
        "time here, and overlapping it can only hide the time spent *waiting*."
    )
    p(
        f"- The machine is shared with other jobs: load average {args.load_before} before "
        f"this run and {args.load_after} after it (1, 5, 15 min). The step-time columns "
        "show the median and, in parentheses, the 25th–75th percentile over the timed "
        "steps, as a measure of that noise."
    )
    p()


def scaled_down(rep, args):
    p = rep.p
    rep.section("Scaled down from the issue, and why")
    p(
        "The issue asks for d=512/L=8 and d=1024/L=8. With 2 cores for "
        "up to 4 ranks, one step of d=512/L=8 takes seconds per variant, and the whole "
        "suite (8 C++ and 3 Python variants x 2 meshes x 2 sizes, plus memory, overhead "
        "and bandwidth-limited runs) has to finish within 15 minutes. Used here: "
        "**d=128/L=4** (1.19 M parameters) and **d=256/L=4** (4.48 M), SwiGLU ffn = 4 x "
        "dim, 4 heads, vocabulary 1024, **sequence 64, 1 sequence per rank** (the global "
        f"batch grows with the ranks), AdamW, {args.steps} timed steps. The same model "
        "exists in C++ (`models/transformer.h`) and in Python (`bench/fsdp2_bench.py`: the "
        "same layers, shapes and initialisation)."
    )
    p()


def method(rep, args):
    p = rep.p
    rep.section("Method")
    p(
        "- **Variants side by side.** One process per rank builds every variant of a run "
        "(each with its own model and optimizer, the same initial weights) and steps them "
        "in rotation: step 1 runs A, B, C, ..., step 2 runs B, C, ..., A, so slow phases of "
        "the machine hit all variants alike. The C++ variants run in `bench/hp_bench`, "
        "the Python ones in `bench/fsdp2_bench.py`, one program after the other."
    )
    p(
        "- **Timing.** A barrier before every step; forward (+ loss), backward and optimizer "
        "step are timed on every rank and the slowest rank counts. Backward includes "
        "everything up to usable gradients: fully_shard's end-of-backward waits, DDP's "
        "all-reduce, FSDP2's reductions."
    )
    if args.malloc:
        allocator(rep, args)
    p(
        "- **Exposed communication** = (forward + backward) of a variant minus that of the "
        "compute-only variant of the same program and run (same model and batch, no "
        "communication, same contention). It can come out slightly negative in noise."
    )
    p(
        "- **Copied MB** (C++ only): bytes written by `aten::copy_` and `aten::cat` in one "
        "extra untimed step (a global RecordFunction callback), per rank: main thread "
        "(model, autograd, fully_shard, and c10d work that completes on the waiting "
        "thread) + other threads (Gloo's workers). Copies inside the kernel's TCP stack "
        "are not counted."
    )
    p(
        "- **Peak RSS** comes from separate runs with one variant per process (VmHWM in "
        "`/proc/self/status`), because a process holding several variants has one "
        "high-water mark for all of them."
    )
    p(
        "- **FSDP2 on CPU** needs two shims (top of `fsdp2_bench.py`): `torch.cpu.Stream` "
        "has no `record_event` / `wait_event` (an always-complete event and a no-op wait "
        "are exact on CPU), and FSDP2 uses `ReduceOp.AVG` for fp32 gradients, which Gloo "
        "rejects in all-reduce (HSDP fails) and silently runs as SUM in reduce-scatter; "
        "the shim switches FSDP2 to its own pre/post-divide path (SUM collectives + "
        "divisions, as HyperParallel does). Without streams FSDP2's unshards are "
        "synchronous on CPU (`unshard_async_op=False`), and its reduce-scatters and "
        "all-reduces always are; `FSDP2 + async unshard + forward prefetch` adds FSDP2's "
        "own CPU-friendly recipe (`_set_unshard_async_op(True)`, each block prefetching "
        "the next in forward). Python's TCPStore runs with `USE_LIBUV=0`."
    )
    p()


def allocator(rep, args):
    """The timed and the peak-RSS runs' glibc settings, and why."""
    rep.p(
        f"- **Allocator.** Timed runs (C++ and Python alike) set `GLIBC_TUNABLES={args.malloc}`: "
        "glibc then keeps freed memory in the process instead of handing every block of "
        "128 KiB or more back to the kernel and faulting it in, zeroed, at the next "
        "allocation. In a separate check (1 rank, d=256, 15 steps, compute only) a step "
        "took 411-431 ms in the C++ program and 392-404 ms in the Python one with "
        "glibc's defaults, and 353-355 / 346-347 ms with this setting: the default "
        "costs both, and the C++ side more; PyTorch's "
        "CPU performance guides address the same effect with jemalloc or tcmalloc. The "
        f"peak-RSS runs set `GLIBC_TUNABLES={args.memory_malloc}` instead: every block of "
        "128 KiB or more is mapped on allocation and unmapped on free, so the high-water "
        "mark follows the live tensors rather than what glibc's heap retains (with the "
        "default, adaptive threshold the comm_fusion run peaked 20 MiB higher than the "
        "per-parameter one, with this setting 6 MiB: its fused all-gather buffer next to "
        "the copies made from it)."
    )
