#!/usr/bin/env python3
"""Turns bench/run.sh's results (one JSON object per line, from hp_bench and
fsdp2_bench.py) into docs/performance.md, and prints its tables.

Every number in the document comes from the results file of the run that wrote it;
sentences that depend on timings are generated from them. The fixed text explains
mechanisms that do not change from run to run (what Gloo copies and sends, how the
variants are built).
"""

import argparse
import json
import os
import statistics
import sys
import time

SIZES = {"d128L4": "dim 128, 4 layers", "d256L4": "dim 256, 4 layers"}
MESHES = {"1x2": "2 ranks, FSDP (mesh 1x2)", "2x2": "4 ranks, HSDP (mesh 2x2: replicate x shard)"}
BLOCKS_TINY = 64

# (source, variant) -> row title, in table order.
ROWS = [
    ("C++", "local", "compute only, no communication (C++)"),
    ("C++", "comm", "communication only, serial, RAF=true (C++)"),
    ("C++", "comm:keep", "communication only, serial, RAF=false (C++)"),
    ("C++", "comm:keep+gloo", "communication only, serial, RAF=false, Gloo reduce-scatter (C++)"),
    ("C++", "comm:fusion", "communication only, serial, one collective per module, RAF=true (C++)"),
    ("C++", "comm:fusion+keep", "communication only, serial, one collective per module, RAF=false (C++)"),
    ("C++", "ddp", "DDP baseline: replicated, one flat all-reduce"),
    ("C++", "hp", "hp per-param, prefetch, RAF=true (defaults)"),
    ("C++", "hp:fusion", "hp comm_fusion, prefetch, RAF=true"),
    ("C++", "hp:nopf", "hp per-param, no prefetch, RAF=true"),
    ("C++", "hp:keep", "hp per-param, prefetch, RAF=false"),
    ("C++", "hp:fusion+keep", "hp comm_fusion, prefetch, RAF=false"),
    ("C++", "hp:fusion+bucket", "hp comm_fusion in 128 KiB buckets, prefetch, RAF=true"),
    ("C++", "hp:fusion+keep+bucket", "hp comm_fusion in 128 KiB buckets, prefetch, RAF=false"),
    ("Python", "local", "compute only, no communication (Python)"),
    ("Python", "fsdp2", "FSDP2 defaults, RAF=false"),
    ("Python", "fsdp2:prefetch", "FSDP2 + async unshard + forward prefetch, RAF=false"),
]


def source(r):
    return "Python" if r.get("impl") in ("py", "fsdp2", "fsdp2_bench") else "C++"


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"report: skipping unreadable line: {line[:120]}", file=sys.stderr)
    return out


def fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


# The hp_bench variants that reshard after forward (hp:keep and hp:fusion+keep keep).
RAF_TRUE_VARIANTS = ("hp", "hp:fusion", "hp:nopf", "hp:fusion+bucket")


def ratio(a, b):
    return None if a is None or not b else a / b


def ok(r):
    return r is not None and not r.get("error") and r.get("step_ms") is not None


def fwd_bwd(r):
    return r["fwd_ms"] + r["bwd_ms"] if ok(r) else None


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


# The sections of the document, in order, and the bench/run.sh section that writes each
# ("common": only a full run rewrites it).
SECTIONS = [
    (None, "common"),  # the title and the paragraph under it
    ("Machine", "common"),
    ("Scaled down from the issue, and why", "common"),
    ("Method", "common"),
    ("Step time", "steps"),
    ("Peak RSS", "memory"),
    ("Bigger than one rank", "beyond"),
    ("Scheduling overhead", "overhead"),
    ("Bandwidth-limited run", "netns"),
    ("Checkpoint saves", "checkpoint"),
    ("Pipeline schedules", "pipeline"),
    ("Activation recomputation", "recompute"),
    ("Quantized collectives", "codecs"),
    ("Targets", "common"),
    ("Discussion", "common"),
]
# Which run.sh section a row of the targets table belongs to, by how its text starts.
TARGET_PREFIXES = {
    "steps": ("step <=",),
    "memory": ("peak RSS", "peak <= ideal", "RAF=true below"),
    "beyond": ("bigger than one rank",),
    "overhead": ("scheduling overhead",),
    "netns": ("overlap efficiency",),
    "checkpoint": ("async save blocks",),
    "pipeline": ("1F1B peak activations", "interleaved step", "measured bubble"),
    "codecs": ("quantized", "comm_fusion overlap"),
}


def target_section(text):
    return next((s for s, pre in TARGET_PREFIXES.items() if text.startswith(pre)), None)


class Report:
    def __init__(self, results):
        self.results = [r for r in results if "meta" not in r]
        # run.sh's line per section: its command, duration and load
        self.meta = {r["meta"]: r for r in results if "meta" in r}
        self.sections = {}  # title -> lines
        self.lines = None
        self.targets = []  # (section, what, measured, verdict)

    def section(self, title):
        """Starts section `title` (None: the document's title); p() writes into it."""
        self.lines = self.sections.setdefault(title, [])
        self.lines.append(f"## {title}" if title else "# Performance")
        self.lines.append("")

    def p(self, text=""):
        self.lines.append(text)

    def target(self, row):
        """A row (what, measured, verdict) of the targets table."""
        section = target_section(row[0])
        assert section, f"target row '{row[0]}' matches no TARGET_PREFIXES entry"
        self.targets.append((section, *row))

    def rows(self, label, columns, prefix="", good=None):
        """(src, variant, title, result) of every ROWS entry with a result under `label`;
        one that failed gets a table row saying so instead. `prefix`: the cells before the
        title; `columns`: the table's column count."""
        good = good or ok
        pad = "|" * (columns - 1 - prefix.count("|"))
        for src, variant, title in ROWS:
            r = self.find(label, src, variant)
            if r is None:
                continue
            if not good(r):
                self.p(f"| {prefix}{title} | failed: {r.get('error')} {pad}")
                continue
            yield src, variant, title, r
        # A run that ended without results (bench/run.sh records its exit and last line).
        for r in self.results:
            if r.get("label") == label and r.get("variant") == "(run)":
                self.p(f"| {prefix}a run of {r.get('impl')} | failed: {r.get('error')} {pad}")

    def find(self, label, src, variant):
        for r in self.results:
            if r.get("label") == label and source(r) == src and r.get("variant") == variant:
                return r
        return None

    def best(self, label, src, variants):
        rows = [r for v in variants if ok(r := self.find(label, src, v))]
        return min(rows, key=lambda r: r["step_ms"]) if rows else None


def step_cell(r):
    if r.get("step_p25_ms") is None:
        return f"**{fmt(r['step_ms'])}**"
    return f"**{fmt(r['step_ms'])}** ({fmt(r['step_p25_ms'], 0)}–{fmt(r['step_p75_ms'], 0)})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", nargs="+", required=True, help="run.sh's SECTION.jsonl files")
    ap.add_argument("--only", default="", help="the run.sh sections just run (default: all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--load-before", default="?")
    ap.add_argument("--load-after", default="?")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--netns-steps", type=int, default=10)
    ap.add_argument("--malloc", default="")
    ap.add_argument("--memory-malloc", default="")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rate", default="?")
    args = ap.parse_args()
    rep = Report([r for path in args.results for r in load(path)])
    p, find, best = rep.p, rep.find, rep.best
    m = machine()

    # ------------------------------------------------------------------ header
    rep.section(None)
    p(
        "Written by `make bench`, which runs `scripts/in_env.sh bench/run.sh build`: every "
        "benchmark below, then `bench/report.py`, which rewrites this file from the results "
        "(`build/bench/results/SECTION.jsonl`; all output in `log.txt`). Re-running it "
        "replaces every number here. "
        f"This run took {args.seconds // 60} min {args.seconds % 60} s; the transformer "
        f"runs time {args.steps} steps per variant after {args.warmup} warm-up step(s). "
        "`bench/run.sh BUILD --only SECTIONS` (steps, memory, beyond, overhead, netns, "
        "checkpoint, pipeline, codecs) "
        "reruns some of them and rewrites only their sections and target rows; a section "
        "made that way names the command that made it."
    )
    p()
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
        p(
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

    # ------------------------------------------------------------------ step times
    rep.section("Step time")
    p(
        "RAF = reshard_after_forward of the blocks (the root never reshards after forward). "
        "`vs DDP`, `vs FSDP2`: step-time ratios, < 1 is faster; a RAF=true row compares "
        "with FSDP2 at RAF=true, a RAF=false row with the faster of the two FSDP2 "
        "variants at RAF=false, of the same configuration. Copied MB: per rank and step, "
        "main thread + Gloo threads."
    )
    p()
    summary = []  # per configuration: ratios for the summary table
    for size, size_text in SIZES.items():
        for mesh, mesh_text in MESHES.items():
            label = f"{size}/{mesh}"
            if not any(r.get("label") == label for r in rep.results):
                continue
            p(f"### {size_text}; {mesh_text}")
            p()
            ddp = find(label, "C++", "ddp")
            fsdp2 = best(label, "Python", ["fsdp2", "fsdp2:prefetch"])
            fsdp2_raf = find(label, "Python", "fsdp2:raf")
            p(
                "| variant | fwd ms | bwd ms | opt ms | step ms (p25–p75) | exposed comm ms | "
                "vs DDP | vs FSDP2 | copied MB | params/rank |"
            )
            p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for src, variant, title, r in rep.rows(label, columns=10):
                plain = variant.startswith(("local", "comm"))
                local = find(label, src, "local")
                exposed = None if plain or not ok(local) else fwd_bwd(r) - fwd_bwd(local)
                copied = "–"
                if r.get("copied_bytes", -1) >= 0:
                    copied = f"{r['copied_bytes'] / 1e6:.1f} + {r.get('copied_bytes_comm', 0) / 1e6:.1f}"
                vs_ddp = None if plain or not ok(ddp) else ratio(r["step_ms"], ddp["step_ms"])
                peer = fsdp2_raf if variant in RAF_TRUE_VARIANTS else fsdp2
                vs_f2 = None if plain or not ok(peer) else ratio(r["step_ms"], peer["step_ms"])
                p(
                    f"| {title} | {fmt(r['fwd_ms'])} | {fmt(r['bwd_ms'])} | {fmt(r['opt_ms'])} | "
                    f"{step_cell(r)} | {fmt(exposed)} | {fmt(vs_ddp, 2)} | {fmt(vs_f2, 2)} | "
                    f"{copied} | {r.get('local_params', '–')} |"
                )
            p()
            s = {"label": label}

            def rt(a, b):
                ra, rb = find(label, "C++", a), find(label, "C++", b)
                return ratio(ra["step_ms"], rb["step_ms"]) if ok(ra) and ok(rb) else None

            s["hp/ddp"] = rt("hp", "ddp")
            hp_best = best(label, "C++", ["hp", "hp:fusion", "hp:nopf", "hp:keep", "hp:fusion+keep"])
            s["best/ddp"] = ratio(hp_best["step_ms"], ddp["step_ms"]) if hp_best and ok(ddp) else None
            s["best_name"] = hp_best["variant"] if hp_best else None
            s["fusion/pp"] = rt("hp:fusion", "hp")
            s["pf/nopf"] = rt("hp", "hp:nopf")
            s["keep/raf"] = rt("hp:keep", "hp")
            hl, pl = find(label, "C++", "local"), find(label, "Python", "local")

            def versus(ours, theirs):
                # (our variant, theirs, raw ratio, ratio over each program's own compute)
                if not ok(ours) or not ok(theirs):
                    return None
                raw = ours["step_ms"] / theirs["step_ms"]
                norm = None
                if ok(hl) and ok(pl):
                    norm = (ours["step_ms"] / hl["step_ms"]) / (theirs["step_ms"] / pl["step_ms"])
                return (ours["variant"], theirs["variant"], raw, norm)

            s["vs_fsdp2"] = versus(best(label, "C++", ["hp:keep", "hp:fusion+keep"]), fsdp2)
            s["vs_fsdp2_raf"] = versus(best(label, "C++", list(RAF_TRUE_VARIANTS)), fsdp2_raf)
            summary.append(s)

    raf = [r for r in rep.results if r.get("variant") == "fsdp2:raf"]
    if raf:
        p("### FSDP2 with reshard_after_forward=True")
        p()
        failed = [r for r in raf if r.get("error")]
        if failed:
            p(
                f"Fails on CPU in {', '.join(r.get('label', '?') for r in failed)} with "
                f"`{failed[0]['error']}`; those configurations compare at RAF=false only."
            )
        else:
            p(
                "Trains on CPU with this torch in every configuration (with torch 2.6 it "
                "failed in the first backward), so HyperParallel's RAF=true rows compare "
                "with it."
            )
        p()
    if summary:
        p("### Ratios at a glance")
        p()
        p(
            "Step-time ratios from the tables above (< 1: the first is faster). `FSDP2, "
            "own compute` divides each side by the compute-only step of its own program "
            "first, which removes the difference between the C++ and Python front ends and "
            "part of the load drift between the two programs' runs."
        )
        p()
        p(
            "| configuration | hp / DDP | best hp / DDP | fusion / per-param | prefetch on / off "
            "| RAF false / true | best hp RAF=false / FSDP2 | same, own compute "
            "| best hp RAF=true / FSDP2 RAF=true | same, own compute |"
        )
        p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

        def versus_cells(f2):
            return f"{fmt(f2[2], 2)} (`{f2[0]}` / `{f2[1]}`) | {fmt(f2[3], 2)} |" if f2 else "– | – |"

        for s in summary:
            p(
                f"| {s['label']} | {fmt(s['hp/ddp'], 2)} | {fmt(s['best/ddp'], 2)} "
                f"(`{s['best_name']}`) | {fmt(s['fusion/pp'], 2)} | {fmt(s['pf/nopf'], 2)} | "
                f"{fmt(s['keep/raf'], 2)} | "
                + versus_cells(s.get("vs_fsdp2"))
                + " "
                + versus_cells(s.get("vs_fsdp2_raf"))
            )
        p()
        for key, raf_text in (("vs_fsdp2", "RAF=false"), ("vs_fsdp2_raf", "RAF=true")):
            for s in summary:
                if f2 := s.get(key):
                    raw, norm = f2[2], f2[3]
                    worst = raw if norm is None else max(raw, norm)
                    if worst <= 0.85:
                        verdict = "met"
                    elif raw <= 0.85:
                        verdict = f"met on raw time only ({fmt(worst, 2)} > 0.85 over own compute)"
                    else:
                        verdict = f"missed by {fmt(worst - 0.85, 2)}"
                    rep.target(
                        (
                            f"step <= 0.85 x FSDP2 at {raf_text}, {s['label']}",
                            f"{fmt(f2[2], 2)} raw, {fmt(f2[3], 2)} own-compute",
                            verdict,
                        )
                    )

    memory_section(rep, args)
    beyond_section(rep, args)

    # ------------------------------------------------------------------ tiny
    if any(r.get("label", "").startswith("tiny/") for r in rep.results):
        rep.section("Scheduling overhead")
        p(
            f"{BLOCKS_TINY} blocks of `Linear(8, 8)`, each fully_shard-ed (FSDP2: "
            "`fully_shard`), batch 4, 20 timed steps: compute and bytes are negligible, so "
            "a step measures the framework's cost per module. `per block` = step / 64; "
            "`overhead per block` = (step - compute-only step of the same program) / 64, in "
            "µs. On 1 rank HyperParallel communicates nothing (a size-1 group has no "
            "backend), while FSDP2 still runs its collectives on a 1-rank Gloo group. On 2 "
            "ranks every collective pays Gloo's latency; `communication only` is that "
            "latency alone: the same collectives as `hp` (6 per block and step: weight and "
            "bias all-gathered in forward and backward, and reduce-scattered), one module "
            "after the other, without compute or hooks. `CPU µs per block`: CPU time of the "
            "process (all threads) per step / 64: with 2 ranks it shows what each Gloo "
            "collective costs in CPU on this host, apart from waiting."
        )
        p()
        p(
            "| ranks | variant | fwd ms | bwd ms | opt ms | step ms (p25–p75) | per block µs | "
            "overhead per block µs | CPU µs per block |"
        )
        p("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n in (1, 2):
            label = f"tiny/1x{n}"
            for src, variant, title, r in rep.rows(label, columns=9, prefix=f"{n} | "):
                local = find(label, src, "local")
                over = None
                if not variant.startswith(("local", "comm")) and ok(local):
                    over = (r["step_ms"] - local["step_ms"]) * 1000 / BLOCKS_TINY
                short = title.replace(", RAF=true (defaults)", "").replace(", RAF=true", "")
                short = short.replace(", RAF=false", "").replace("communication only, serial", "communication only")
                p(
                    f"| {n} | {short} | {fmt(r['fwd_ms'], 2)} | {fmt(r['bwd_ms'], 2)} | "
                    f"{fmt(r['opt_ms'], 2)} | {step_cell(r)} | "
                    f"{fmt(r['step_ms'] * 1000 / BLOCKS_TINY, 0)} | {fmt(over, 0)} | "
                    f"{fmt(r['cpu_ms'] * 1000 / BLOCKS_TINY if r.get('cpu_ms') else None, 0)} |"
                )
            hp_b = best(label, "C++", ["hp", "hp:fusion"])
            f2, hl, pl = find(label, "Python", "fsdp2"), find(label, "C++", "local"), find(label, "Python", "local")
            if hp_b and ok(f2) and ok(hl) and ok(pl):
                hp_over = (hp_b["step_ms"] - hl["step_ms"]) * 1000 / BLOCKS_TINY
                f2_over = (f2["step_ms"] - pl["step_ms"]) * 1000 / BLOCKS_TINY
                r = ratio(hp_over, f2_over)
                rep.target(
                    (
                        f"scheduling overhead per block <= 1/5 of FSDP2's, {n} rank(s)",
                        f"`{hp_b['variant']}` {fmt(hp_over, 0)} µs vs {fmt(f2_over, 0)} µs = {fmt(r, 2)}",
                        "met" if r is not None and r <= 0.2 else f"missed ({fmt(r, 2)} > 0.20)",
                    )
                )
        p()

    # ------------------------------------------------------------------ bandwidth-limited
    label = "netns/d128L8/1x2"
    if any(r.get("label") == label for r in rep.results):
        rep.section("Bandwidth-limited run")
        p(
            f"Dimension 128, **8 layers**, **4 sequences of 64 tokens per rank**, {args.netns_steps} "
            "timed steps (more compute "
            "per block than the step-time runs, so that each block's compute exceeds its "
            "communication at this rate), 2 ranks (FSDP). Each rank runs in its own network "
            "namespace; a veth pair per rank and a bridge join them, and each rank's egress "
            f"is shaped by `tc tbf` to **{args.rate}** (`bench/netns.sh`), so communication "
            "is bound by the link instead of loopback memcpy. `communication only` is the "
            "serial communication of a step (the collectives of the per-parameter mode, "
            "module by module, nothing overlapped), measured in the same run, with (RAF=true) "
            "and without (RAF=false) the backward all-gathers; `one collective per module` "
            "moves the same bytes as comm_fusion does, and comm_fusion's rows without buckets "
            "are measured against it (its buckets send messages about a parameter's size, so "
            "those rows are measured against the per-parameter runs). **Overlap efficiency** = "
            "(T_comm + T_compute - T) / min(T_comm, T_compute), with T = forward + backward "
            "of the variant, T_compute that of `compute only` and T_comm that of the matching "
            "`communication only`: 1 means the shorter of the two is hidden completely, 0 "
            "means they ran one after the other (when communication is the shorter, it is the "
            "fraction of communication hidden). FSDP2 rows use the Python compute-only time "
            "and the RAF=false communication with Gloo's own reduce-scatter, which FSDP2 "
            "uses (`communication only, Gloo reduce-scatter`: the same bytes). `CPU ms` is the "
            "CPU time of the whole process during a step (all threads: model, hooks, Gloo "
            "workers, kernel TCP work charged to them), max over ranks."
        )
        p()
        p("| variant | fwd ms | bwd ms | step ms (p25–p75) | CPU ms | exposed comm ms | overlap efficiency |")
        p("|---|---:|---:|---:|---:|---:|---:|")
        comm, comm_keep = find(label, "C++", "comm"), find(label, "C++", "comm:keep")
        comm_gloo = find(label, "C++", "comm:keep+gloo")
        # Each variant against the serial communication of its own messages.
        comm_of = {(False, False): comm, (True, False): comm_keep,
                   (False, True): find(label, "C++", "comm:fusion"),
                   (True, True): find(label, "C++", "comm:fusion+keep")}
        effs = []
        for src, variant, title, r in rep.rows(label, columns=7):
            local = find(label, src, "local")
            t_comp = fwd_bwd(local)
            if src == "Python":
                t_comm = fwd_bwd(comm_gloo)
            else:
                one_per_module = "fusion" in variant and "bucket" not in variant
                t_comm = fwd_bwd(comm_of[("keep" in variant, one_per_module)])
            exposed = eff = None
            if not variant.startswith(("local", "comm")) and t_comp:
                exposed = fwd_bwd(r) - t_comp
                if variant != "ddp" and t_comm:
                    eff = (t_comm + t_comp - fwd_bwd(r)) / min(t_comm, t_comp)
                    effs.append((src, variant, eff))
            p(
                f"| {title} | {fmt(r['fwd_ms'])} | {fmt(r['bwd_ms'])} | {step_cell(r)} | "
                f"{fmt(r.get('cpu_ms'))} | {fmt(exposed)} | {fmt(eff, 2)} |"
            )
        p()
        hl = find(label, "C++", "local")
        if ok(comm) and ok(hl):
            p(
                f"Per phase: forward compute {fmt(hl['fwd_ms'])} ms vs forward communication "
                f"{fmt(comm['fwd_ms'])} ms; backward compute {fmt(hl['bwd_ms'])} ms vs backward "
                f"communication {fmt(comm['bwd_ms'])} ms (RAF=true). Communication alone keeps "
                f"the CPU busy for {fmt(comm.get('cpu_ms'))} ms of its {fmt(comm['step_ms'])} ms "
                "step: that part is work on the cores that compute, which overlap cannot hide."
            )
            p()
        if os.path.exists(os.path.join(os.path.dirname(args.out), "timeline_bandwidth_limited.svg")):
            p(
                "The last timed step of `hp comm_fusion` on rank 1, recorded with `hp_bench "
                "--trace` (pale: a collective in flight, dark: the main thread waiting for it):"
            )
            p()
            p("![timeline of the bandwidth-limited run](timeline_bandwidth_limited.svg)")
            p()
        for src, variant, eff in effs:
            if src == "C++":
                rep.target(
                    (
                        f"overlap efficiency >= 0.8, bandwidth-limited, `{variant}`",
                        fmt(eff, 2),
                        "met" if eff >= 0.8 else f"missed by {fmt(0.8 - eff, 2)}",
                    )
                )

    checkpoint_section(rep)
    pipeline_section(rep)
    recompute_section(rep)
    codecs_section(rep, args)

    # ------------------------------------------------------------------ targets
    rep.section("Targets")
    p(
        "Step-time verdicts use the larger (less favourable) of the raw ratio and the "
        "own-compute ratio: the raw one alone would credit HyperParallel with the speed of "
        "C++ over Python in the model code and with load changes between the two programs' "
        "runs. Memory verdicts: see the Peak RSS section for the ideal model they use."
    )
    p()
    p("| target | measured | verdict |")
    p("|---|---|---|")
    rep.section("Discussion")
    rep.lines.extend(DISCUSSION.splitlines()[2:])

    only = [x for x in args.only.split(",") if x]
    if only and os.path.exists(args.out):
        with open(args.out) as f:
            text = splice(f.read(), rep, only)
    else:
        text = document(rep)
    with open(args.out, "w") as f:
        f.write(text)
    start, end = text.find("## Step time"), text.find("## Discussion")
    print(text[start:end].rstrip())
    print(f"\nreport: wrote {args.out}")


MIB = 2**20


def made_by(rep, section):
    """A sentence naming the command, duration and load of a run.sh section."""
    meta = rep.meta.get(section)
    if not meta:
        return ""
    sec = meta["seconds"]
    return (
        f"Made by `{meta['command']}` ({sec // 60} min {sec % 60} s; load average "
        f"{meta['load_before']} before, {meta['load_after']} after)."
    )


# The recompute_bench variants, in table order: (variant, title).
RECOMPUTE_ROWS = [
    ("none", "no recomputation"),
    ("whole", "every block recomputed, whole reruns (`early_stop = false`)"),
    ("early_stop", "every block recomputed, early stop (the default)"),
]


def recompute_section(rep):
    runs = [r for r in rep.results if r.get("label", "").startswith("recompute/")]
    if not runs:
        return
    p = rep.p
    rep.section("Activation recomputation")
    for r in runs:
        if r.get("error"):
            p(f"`{r['label']}` failed: {r['error']} (see `build/bench/results/log.txt`).")
            p()
    r = next((x for x in runs if not x.get("error")), None)
    if r is None:
        return
    v = r["variants"]
    p(
        f"`hp::recompute` around each of {r['model']} (`models::DecoderBlock`: attention, "
        "then a SwiGLU MLP), in one process with "
        f"{r['threads']} threads, no communication (`bench/recompute_bench`): the three "
        f"variants run in turn within each step, means of {r['steps']} steps after 1 warm-up "
        "step. Early stop ends a block's rerun once it has saved the last tensor its forward "
        "saved: the input of the MLP's down projection, which the matmul saves before it "
        "computes, so the rerun skips that matmul and the residual add. "
        + made_by(rep, "recompute")
    )
    p()
    base = v["none"]
    p("| variant | forward ms | backward ms | step ms | vs no recomputation |")
    p("|---|---:|---:|---:|---:|")
    for key, title in RECOMPUTE_ROWS:
        x = v[key]
        step = x["forward_ms"] + x["backward_ms"]
        p(
            f"| {title} | {fmt(x['forward_ms'])} | {fmt(x['backward_ms'])} | **{fmt(step)}** | "
            f"{fmt(step / (base['forward_ms'] + base['backward_ms']), 2)}x |"
        )
    p()
    whole = v["whole"]["backward_ms"] - base["backward_ms"]
    early = v["early_stop"]["backward_ms"] - base["backward_ms"]
    sums = {x["input_grad_abs_sum"] for x in v.values()}
    p(
        f"The rerun's cost (backward minus the backward without recomputation): "
        f"**{fmt(whole)} ms** whole, **{fmt(early)} ms** with early stop "
        f"({fmt(early / whole, 2) if whole > 0 else '–'}x). The down projection is about a "
        "quarter of a block's matmul work at ffn = 4·dim (dim·ffn of 4·dim² + 3·dim·ffn "
        "multiply-adds per token, attention's scores aside), so a rerun that skips it costs "
        "about 3/4 of a whole one. The input's gradient is "
        + (
            "the same in the three variants (sum of its magnitudes); the tests compare "
            "every gradient bit for bit."
            if len(sums) == 1
            else "**not the same** in the three variants: " + ", ".join(map(str, sorted(sums)))
        )
    )
    p()


# The codec runs of bench/run.sh (section codecs), in table order: (variant, title).
CODEC_ROWS = [
    ("hp", "full precision (fp32), per parameter"),
    ("hp:int8ag", "int8 all-gather"),
    ("hp:int8ag+int8rs", "int8 all-gather + int8 reduce-scatter"),
    ("hp:int8ag+int8rs+ef", "int8 + int8, error feedback"),
    ("hp:fp8ag+fp8rs", "fp8 all-gather + fp8 reduce-scatter"),
    ("hp:fusion", "full precision, comm_fusion"),
    ("hp:fusion+int8ag+int8rs", "int8 + int8, comm_fusion"),
    ("hp:fusion+bucket", "full precision, comm_fusion in 128 KiB buckets"),
    ("hp:fusion+bucket+int8ag+int8rs", "int8 + int8, comm_fusion in 128 KiB buckets"),
]
# Overlap of the codec runs: (variant, its communication-only variant, title).
CODEC_OVERLAP_ROWS = [
    ("hp", "comm", "full precision, per parameter"),
    ("hp:fusion", "comm:fusion", "full precision, comm_fusion"),
    ("hp:fusion+bucket", "comm", "full precision, comm_fusion in 128 KiB buckets"),
    ("hp:int8ag+int8rs", "comm:int8ag+int8rs", "int8 + int8, per parameter"),
    ("hp:fusion+int8ag+int8rs", "comm:int8ag+int8rs", "int8 + int8, comm_fusion"),
    ("hp:fusion+bucket+int8ag+int8rs", "comm:int8ag+int8rs",
     "int8 + int8, comm_fusion in 128 KiB buckets"),
]
NODE_ROWS = [
    ("hp", "full precision, reshard_after_forward = true"),
    ("hp:raf2", "full precision, secondary partition (reshard_after_forward = 2)"),
    ("hp:int8ag+int8rs", "int8 + int8"),
    ("hp:int8ag+int8rs+raf2", "int8 + int8, secondary partition"),
]
CODECS = [("none", "fp32"), ("int8", "int8 + int8"), ("int8-ef", "int8 + int8, error feedback"),
          ("fp8", "fp8 + fp8"), ("fp8-int8", "fp8 weights + int8 gradients")]


def zero3_bytes(r):
    """fp32 ZeRO-3's bytes sent per rank and step: two all-gathers and one reduce-scatter
    of every parameter, (n - 1) / n of each."""
    n = r["world"]
    return 3 * r["params"] * 4 * (n - 1) / n


def codec_table(rep, label, fsdp2=None, rows=CODEC_ROWS):
    find = rep.find
    base = find(label, "C++", "hp")
    rep.p("| variant | KiB sent per step and rank | / fp32 ZeRO-3 | step ms (p25–p75) | / full precision |"
          + (" / FSDP2 |" if fsdp2 else ""))
    rep.p("|---|---:|---:|---:|---:|" + ("---:|" if fsdp2 else ""))
    for variant, title in rows:
        r = find(label, "C++", variant)
        if r is None:
            continue
        if not ok(r):
            rep.p(f"| {title} | failed: {r.get('error')} | | | |" + (" |" if fsdp2 else ""))
            continue
        kib = r["wire_bytes_per_step"] / 1024
        row = (f"| {title} | {fmt(kib, 0)} | {fmt(r['wire_bytes_per_step'] / zero3_bytes(r), 3)} | "
               f"{step_cell(r)} | {fmt(ratio(r['step_ms'], base['step_ms']) if ok(base) else None, 2)} |")
        if fsdp2:
            row += f" {fmt(ratio(r['step_ms'], fsdp2['step_ms']), 2)} |"
        rep.p(row)
    if fsdp2:
        rep.p(f"| FSDP2 defaults (Python, for reference) | – | – | {step_cell(fsdp2)} | "
              f"{fmt(ratio(fsdp2['step_ms'], base['step_ms']) if ok(base) else None, 2)} | 1.00 |")
    for r in rep.results:
        if r.get("label") == label and r.get("variant") == "(run)":
            rep.p(f"| a run of {r.get('impl')} | failed: {r.get('error')} | | | |" + (" |" if fsdp2 else ""))
    rep.p()


def codec_overlap(rep, label):
    """Overlap efficiency of the bandwidth-limited codec runs (as in the netns section), each
    against the communication-only run of its own bytes, with a target for comm_fusion."""
    local = rep.find(label, "C++", "local")
    t_comp = fwd_bwd(local)
    rows = []
    for variant, comm_variant, title in CODEC_OVERLAP_ROWS:
        r, comm = rep.find(label, "C++", variant), rep.find(label, "C++", comm_variant)
        t_comm = fwd_bwd(comm)
        if not (ok(r) and t_comp and t_comm):
            continue
        eff = (t_comm + t_comp - fwd_bwd(r)) / min(t_comm, t_comp)
        rows.append((variant, title, t_comm, fwd_bwd(r), eff))
    if not rows:
        return
    p = rep.p
    p(
        "Overlap efficiency on the bandwidth-limited link, as in the netns section: (T_comm + "
        f"T_compute - T) / min(T_comm, T_compute), T_compute = {fmt(t_comp)} ms (forward + "
        "backward of `local`), T_comm that of the communication-only run of the variant's "
        "own messages (`comm`: one collective per parameter; `comm:fusion`: one per module; "
        "`comm:int8ag+int8rs`: the quantized collectives, quantizing included, one per module), "
        "module by module with nothing to overlap:"
    )
    p()
    p("| variant | T_comm ms | T ms | overlap efficiency |")
    p("|---|---:|---:|---:|")
    for variant, title, t_comm, t, eff in rows:
        p(f"| {title} | {fmt(t_comm)} | {fmt(t)} | {fmt(eff, 2)} |")
        if "fusion" in variant:
            what = title.replace(", comm_fusion", "")
            rep.target((f"comm_fusion overlap efficiency >= 0.85, bandwidth-limited, {what}",
                        fmt(eff, 2), "met" if eff >= 0.85 else f"missed by {fmt(0.85 - eff, 2)}"))
    p()
    per_param, per_module = rep.find(label, "C++", "comm"), rep.find(label, "C++", "comm:fusion")
    if ok(per_param) and ok(per_module):
        p(
            f"In full precision the same bytes take {fmt(fwd_bwd(per_param))} ms as one message "
            f"per parameter and {fmt(fwd_bwd(per_module))} ms as one per module: on this link a "
            "module's whole message runs below the link's rate, and comm_fusion's step is bound "
            "by that, not by waiting on compute. Buckets (`comm_fusion_bucket_bytes`) send "
            "parameter-sized messages again."
        )
        p()


def read_metrics(path):
    records = []
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    return records


def loss_curves_svg(runs, path):
    """Training loss (lines) and validation loss (dots) of each run against the step."""
    width, height, left, right, top, bottom = 720, 360, 60, 150, 20, 40
    points = [(m["step"], m["loss"]) for _, ms in runs for m in ms]
    if not points:
        return False
    max_step = max(s for s, _ in points)
    lo = min(l for _, l in points)
    hi = max(l for _, l in points)
    x = lambda step: left + (width - left - right) * step / max_step  # noqa: E731
    y = lambda loss: top + (height - top - bottom) * (hi - loss) / (hi - lo)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
           f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">step</text>',
           f'<text x="{left - 6}" y="{y(hi) + 4}" text-anchor="end">{hi:.2f}</text>',
           f'<text x="{left - 6}" y="{y(lo) + 4}" text-anchor="end">{lo:.2f}</text>',
           f'<text x="{x(max_step)}" y="{height - bottom + 16}" text-anchor="middle">{max_step}</text>']
    for (name, records), color in zip(runs, colors):
        train = " ".join(f"{x(m['step']):.1f},{y(m['loss']):.1f}" for m in records)
        out.append(f'<polyline points="{train}" fill="none" stroke="{color}" stroke-width="1.2" opacity="0.8"/>')
        for m in records:
            if "validation_loss" in m:
                out.append(f'<circle cx="{x(m["step"]):.1f}" cy="{y(m["validation_loss"]):.1f}" r="3.5" fill="{color}"/>')
    for i, ((name, _), color) in enumerate(zip(runs, colors)):
        ly = top + 20 + 18 * i
        out.append(f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 30}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right + 36}" y="{ly + 4}">{name}</text>')
    out.append(f'<text x="{width - right + 10}" y="{top + 20 + 18 * len(runs) + 8}">lines: training</text>')
    out.append(f'<text x="{width - right + 10}" y="{top + 20 + 18 * len(runs) + 24}">dots: validation</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True


def codecs_section(rep, args):
    runs = [r for r in rep.results if r.get("label", "").startswith("codecs/")]
    if not runs:
        return
    rep.section("Quantized collectives")
    p = rep.p
    loopback, netns = "codecs/loopback/d128L8/1x2", "codecs/netns/d128L8/1x2"
    base = rep.find(loopback, "C++", "hp")
    p(
        "`hp::CommPolicy` (api.md, `policy.h`): the weight all-gathers and gradient "
        "reduce-scatters move int8 or fp8 blocks of 256 values with one fp32 scale each "
        "instead of fp32 values; the optimizer still steps the fp32 shards. The model of the "
        f"bandwidth-limited run (dim 128, 8 layers, 4 sequences of 64 tokens per rank; "
        f"{fmt(base['params'] / 1e6, 2) if ok(base) else '?'} M parameters), 2 ranks, "
        f"{args.netns_steps} timed steps. Bytes are what each rank sent in a step, counted by "
        "`hp::wire_bytes()` (as ring and pairwise algorithms move them), against fp32 ZeRO-3's "
        "3 x parameters x 4 bytes x (n-1)/n. " + made_by(rep, "codecs")
    )
    p()
    p("**Loopback** (CPU-bound: Gloo's copies run on the cores that compute):")
    p()
    codec_table(rep, loopback)
    fsdp2 = rep.find(netns, "Python", "fsdp2")
    if any(r.get("label") == netns for r in rep.results):
        p(f"**Bandwidth-limited** ({args.rate} per rank, the netns section's set-up):")
        p()
        codec_table(rep, netns, fsdp2 if ok(fsdp2) else None)
    else:
        p("The bandwidth-limited part did not run (BENCH_NETNS=0 or no network namespaces).")
        p()
    codec_overlap(rep, netns)
    nodes = "codecs/nodes/d128L8/1x4"
    if any(r.get("label") == nodes for r in rep.results):
        local = rep.find(nodes, "C++", "local")
        p(
            "**Two nodes, secondary partition.** 4 ranks (mesh 1x4) in 2 network namespaces of "
            f"2 ranks each, every namespace's egress limited to {args.rate} and its 2 ranks "
            "talking over its loopback, like two machines of two GPUs "
            "(`NETNS_RANKS_PER_NODE=2 bench/netns.sh exec`). `reshard_after_forward = 2` keeps "
            "half of each block's parameters after forward, the ranks of one node holding the "
            "whole between them, so the backward all-gathers stay in the node and the link "
            "carries two of ZeRO-3's three volumes (ZeRO++'s hpZ); with the codecs those two are "
            "int8. The bytes column counts all that a rank sent, in the node too; 4 ranks "
            "share 2 cores here, so compute alone takes "
            f"{fmt(local['step_ms']) if ok(local) else '?'} ms a step."
        )
        p()
        codec_table(rep, nodes, rows=NODE_ROWS)
    speedups = []
    for variant, full in (("hp:int8ag+int8rs", "hp"), ("hp:fusion+int8ag+int8rs", "hp:fusion")):
        lq, lf = rep.find(loopback, "C++", variant), rep.find(loopback, "C++", full)
        nq, nf = rep.find(netns, "C++", variant), rep.find(netns, "C++", full)
        if all(ok(r) for r in (lq, lf, nq, nf)):
            speedups.append((full, lq["step_ms"] / lf["step_ms"], nf["step_ms"] / nq["step_ms"]))
    if speedups:
        p(
            "**When to turn them on.** Where the link bounds the step, the bytes are the cost: "
            + "; ".join(f"{'fused' if 'fusion' in full else 'per parameter'}, int8 weights and "
                        f"gradients make the bandwidth-limited step {fmt(gain, 2)}x faster"
                        for full, _, gain in speedups)
            + ". On loopback, where communication is memcpy on the cores that compute, the "
            "codecs trade copies for quantizing on the same cores: "
            + "; ".join(f"{'fused' if 'fusion' in full else 'per parameter'} step x "
                        f"{fmt(cost, 2)}" for full, cost, _ in speedups)
            + " (per parameter, quantized parameters also travel one collective per module "
            "instead of one per parameter). Turn them on when a step in full precision takes "
            "well over its compute alone (multi-node jobs, commodity networks); on one machine "
            "what they save is small, and what they cost in accuracy is measured below."
        )
        p()
    int8 = rep.find(loopback, "C++", "hp:int8ag+int8rs")
    if ok(int8):
        share = int8["wire_bytes_per_step"] / zero3_bytes(int8)
        rep.target(("quantized: int8 AG + RS bytes per step <= 0.3x fp32 ZeRO-3", fmt(share, 3),
                    "met" if share <= 0.3 else f"missed by {fmt(share - 0.3, 3)}"))
    for variant, full, name in (("hp:int8ag+int8rs", "hp", "per parameter"),
                                ("hp:fusion+int8ag+int8rs", "hp:fusion", "comm_fusion")):
        quantized, plain = rep.find(loopback, "C++", variant), rep.find(loopback, "C++", full)
        if ok(quantized) and ok(plain):
            cost = quantized["step_ms"] / plain["step_ms"] - 1
            rep.target((f"quantized: loopback step cost of int8 AG + RS <= 10%, {name}",
                        f"{fmt(100 * cost, 1)}%",
                        "met" if cost <= 0.10 else f"missed by {fmt(100 * (cost - 0.10), 1)} points"))
    for variant, full, name in (("hp:int8ag+int8rs", "hp", "per parameter"),
                                ("hp:fusion+int8ag+int8rs", "hp:fusion", "comm_fusion")):
        n_int8, n_base = rep.find(netns, "C++", variant), rep.find(netns, "C++", full)
        if ok(n_int8) and ok(n_base):
            q = n_int8["step_ms"] / n_base["step_ms"]
            rep.target((f"quantized: bandwidth-limited int8 step <= 0.4x full precision, {name}",
                        fmt(q, 2), "met" if q <= 0.4 else f"missed by {fmt(q - 0.4, 2)}"))
        if ok(n_int8) and ok(fsdp2):
            q = n_int8["step_ms"] / fsdp2["step_ms"]
            rep.target((f"quantized: bandwidth-limited int8 step <= 0.3x FSDP2, {name}", fmt(q, 2),
                        "met" if q <= 0.3 else f"missed by {fmt(q - 0.3, 2)}"))

    accuracy_section(rep, args, [r for r in runs if r.get("label") == "codecs/accuracy"])


def accuracy_section(rep, args, runs):
    """Final validation loss of each codec and seed, its mean over the seeds against full
    precision's, and the first seed's curves."""
    if not runs:
        return
    p = rep.p
    seeds = sorted({r.get("seed", 0) for r in runs})
    final, curves, seconds = {}, {}, {}  # final[codec][seed], curves[codec]: first seed's
    failures = []
    for r in runs:
        codec, seed = r["variant"], r.get("seed", 0)
        records = read_metrics(r["metrics"])
        validation = [m["validation_loss"] for m in records if "validation_loss" in m]
        if r.get("error") or not validation:
            failures.append(f"{codec} seed {seed}: {r.get('error') or 'no metrics in ' + r['metrics']}")
            continue
        final.setdefault(codec, {})[seed] = validation[-1]
        seconds.setdefault(codec, []).append(r.get("seconds", 0))
        if seed == seeds[0]:
            curves[codec] = records
    p(
        "**Accuracy.** The demo's job (`make demo`'s corpus and defaults: 500 steps) on 4 "
        "ranks with a 1x4 mesh, so that every collective is quantized "
        "(`train_decoder --mesh 1x4 --seed S --eval-batches 100000 [--ag-codec C "
        "--rs-codec C [--error-feedback]]`), "
        f"once per seed ({', '.join(str(s) for s in seeds)}; `BENCH_ACCURACY_SEEDS`). The seed "
        "draws the initial weights and the order of the batches; every run validates on the "
        "whole validation split, and all runs read one copy of the corpus (the repository's "
        "own text, so the losses move from one commit to the next). Each cell is the "
        "final validation loss and, in parentheses, its difference to the full-precision run "
        "of the same seed:"
    )
    p()
    present = [(codec, title) for codec, title in CODECS if final.get(codec)]
    full = final.get("none", {})
    p("| seed | " + " | ".join(title for _, title in present) + " |")
    p("|---:|" + "---:|" * len(present))
    for s in seeds:
        cells = []
        for codec, _ in present:
            loss = final[codec].get(s)
            if loss is None:
                cells.append("–")
            elif codec == "none" or s not in full:
                cells.append(fmt(loss, 4))
            else:
                cells.append(f"{fmt(loss, 4)} ({100 * (loss / full[s] - 1):+.2f}%)")
        p(f"| {s} | " + " | ".join(cells) + " |")
    p()
    p("Over the seeds: the mean final loss against full precision's, and the per-seed "
      "differences (mean ± standard error; a codec's cost is resolved to about twice the "
      "standard error):")
    p()
    p("| collectives | mean loss | mean / full precision | per-seed difference | seeds worse | run s |")
    p("|---|---:|---:|---:|---:|---:|")
    full_mean = sum(full.values()) / len(full) if len(full) == len(seeds) else None
    relative, spread = {}, {}
    for codec, title in present:
        losses = final[codec]
        mean = sum(losses.values()) / len(losses) if len(losses) == len(seeds) else None
        if mean is not None and full_mean is not None:
            relative[codec] = mean / full_mean - 1
        paired = [losses[s] / full[s] - 1 for s in seeds if s in losses and s in full]
        difference = worse = "–"
        if codec != "none" and len(paired) > 1:
            spread[codec] = statistics.stdev(paired) / len(paired) ** 0.5
            difference = (f"{100 * statistics.mean(paired):+.2f}% ± "
                          f"{100 * spread[codec]:.2f}%")
            worse = f"{sum(d > 0 for d in paired)} of {len(paired)}"
        p(f"| {title} | **{fmt(mean, 4)}** | "
          f"{fmt(mean / full_mean if mean and full_mean else None, 4)} | {difference} | "
          f"{worse} | {fmt(sum(seconds[codec]) / len(seconds[codec]), 0)} |")
    p()
    if len(full) > 1:
        low, high = min(full.values()), max(full.values())
        p(f"Full precision alone ends between {fmt(low, 4)} and {fmt(high, 4)} over these seeds "
          f"({fmt(100 * (high / low - 1), 2)}% apart): one run's difference to another is mostly "
          "the seed's, and only a mean over seeds says what a codec costs.")
        p()
    if failures:
        p("Failed: " + "; ".join(failures) + ".")
        p()
    svg = os.path.join(os.path.dirname(args.out), "codecs_loss.svg")
    named = [(title, curves[codec]) for codec, title in CODECS if codec in curves]
    if loss_curves_svg(named, svg):
        p(f"![training and validation loss with full-precision and quantized collectives, seed {seeds[0]}](codecs_loss.svg)")
        p()
    for codec in ("int8", "int8-ef", "fp8", "fp8-int8"):
        if codec in relative:
            rel = relative[codec]
            verdict = "met" if abs(rel) <= 0.01 else (
                "outside 1%, but lower (better) than full precision" if rel < 0 else "missed")
            error = f" (± {fmt(100 * spread[codec], 2)}%)" if codec in spread else ""
            rep.target((f"quantized: {codec} validation loss within 1% of full precision, "
                        f"mean of {len(seeds)} seeds",
                        f"{'+' if rel >= 0 else ''}{fmt(100 * rel, 2)}%{error}", verdict))


def ms_list(values):
    return ", ".join(fmt(v, 0) for v in values or []) or "–"


def checkpoint_section(rep):
    runs = [r for r in rep.results if r.get("label", "").startswith("checkpoint/")]
    if not runs:
        return
    p = rep.p
    rep.section("Checkpoint saves")
    r = next((r for r in runs if not r.get("error") and r.get("variant") == "checkpoint"), None)
    if r is None:
        p(f"The run failed: {runs[0].get('error')} (see `build/bench/results/log.txt`).")
        p()
        return
    m, n, saves = r["model"], r["world"], r["saves"]
    stagings = [(s, r["async"][s]) for s in ASYNC_STAGINGS if s in r.get("async", {})]
    p(
        f"How long a training step is blocked by a checkpoint save, synchronous "
        f"(`hp::save_sharded_checkpoint`) against background (`hp::AsyncCheckpointSaver`, "
        f"both stagings): the Peak RSS section's model (dim {m['dim']}, "
        f"**{m['layers']} blocks**, {r['params'] / 1e6:.1f} M parameters, {m['batch']} "
        f"sequence of {m['seq']} tokens per rank) fully_shard-ed on **{n} ranks** (mesh "
        f"{r['mesh']}, deferred init), AdamW. A checkpoint holds the parameters and both AdamW "
        f"moments: **{fmt(r['checkpoint_mib'], 0)} MiB** on disk, each rank writing its "
        "quarter (`hp_bench --checkpoint`, into the build directory, one checkpoint at a time, "
        "removed after each save). " + made_by(rep, "checkpoint")
    )
    p()
    p(
        f"After {r['warmup']} warm-up step(s) and {r['plain_steps']} steps without saving, "
        f"each kind saves {saves} + 1 times, each save after a training step and a barrier; "
        "the first save of each kind is left out of the means (given below). "
        "**Synchronous**: `save_sharded_checkpoint` returns when every rank's file is "
        "written and flushed (fsync) and rank 0 has committed the directory; training waits "
        "for all of it. **Async**, one saver per staging, `fork` (`CheckpointStaging::kFork`) "
        "then `copy` (`kCopy`, the default): `save()` takes a snapshot of this rank's pieces "
        "and returns (what blocks training). `fork`: the process forks a writer whose "
        "copy-on-write view of memory is the snapshot, so `save()` blocks for the fork (the "
        "kernel copies the process's page tables, not its memory); while the write runs, the "
        "kernel copies each page that training writes to, in the training process, during "
        "its steps. `copy`: `save()` copies the pieces into host staging memory (reused by "
        "the next save). The saver's thread then runs the same protocol as the synchronous "
        "save (the forked process writes `fork`'s file) while training goes on until the "
        "write is complete on every rank (a watcher thread polls `busy()` every "
        "millisecond; `write` counts from `save()` on); `write alone`: `save()` then "
        f"`wait()` at once, nothing else running. `step, no save`: the mean of the "
        f"{r['steps']} steps with no write in flight (those {r['plain_steps']} and the step "
        "before each save, spread over the run). `step during write`: the steps that started "
        "while a write was in flight; the writer competes with the ranks for the same "
        f"{os.cpu_count()} cores. Every time is the slowest rank's (rank 0's in parentheses), "
        "means over the saves."
    )
    p()
    p(
        "| async staging | step ms, no save | sync save blocks ms | async `save()` blocks ms "
        "| async write ms, training alongside | async write ms, alone | step ms during write "
        "| async / sync blocked |"
    )
    p("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, a in stagings:
        share = ratio(a["blocked_ms"], r["sync_blocked_ms"])
        p(
            f"| `{name}`{' (default)' if name == 'copy' else ''} | {fmt(r['step_ms'])} | "
            f"**{fmt(r['sync_blocked_ms'])}** ({fmt(r['sync_blocked_rank0_ms'])}) | "
            f"**{fmt(a['blocked_ms'])}** ({fmt(a['blocked_rank0_ms'])}) | "
            f"{fmt(a['write_ms'])} | {fmt(a['alone_ms'])} | "
            f"{fmt(a['during_write_step_ms'])} | **{fmt(share, 3)}** |"
        )
    p()
    steps = r["step_each_ms"]
    text = (
        f"Per save (ms, slowest rank): synchronous {ms_list(r['sync_each_ms'])} (the first "
        f"{fmt(r['sync_first_ms'], 0)})"
    )
    for name, a in stagings:
        text += (
            f"; `{name}`: `save()` {ms_list(a['blocked_each_ms'])} (the first "
            f"{fmt(a['first_blocked_ms'], 0)}), its write {ms_list(a['write_each_ms'])} with "
            f"training alongside and {ms_list(a['alone_each_ms'])} alone, steps during the "
            f"writes {ms_list(a['during_write_each_ms'])}"
        )
    p(
        text + ". The first async save of a saver also makes the writer's process group "
        "(and, `copy`, allocates the staging memory, which later saves reuse). Steps "
        f"without saving took {fmt(min(steps), 0)}–{fmt(max(steps), 0)} ms."
    )
    p()
    if not (r.get("sync_blocked_ms") and r.get("step_ms")):
        return
    per_rank = r["checkpoint_mib"] / r["world"]
    p(
        f"The synchronous save writes {fmt(r['checkpoint_mib'] / (r['sync_blocked_ms'] / 1000), 0)}"
        f" MiB/s over all ranks (flushed to disk), about {fmt(per_rank, 0)} MiB per rank."
    )
    p()
    costs = {}
    for name, a in stagings:
        if not a.get("blocked_ms"):
            continue
        if name == "fork":
            page_kib = r.get("page_kib", 4)
            # The baseline: the same window of a copy save (no copy-on-write), scaled to the
            # steps it held; the mean step's count without it (raised by the first steps'
            # first-touch faults).
            copy = r["async"].get("copy")
            if copy and copy.get("during_write_steps"):
                base = copy["write_faults"] * a["during_write_steps"] / copy["during_write_steps"]
                base_text = "in the same window of a `copy` save (no copy-on-write)"
            else:
                base = r["step_faults"] * a["during_write_steps"] / saves
                base_text = "for as many steps without a write"
            extra_faults = max(a["write_faults"] - base, 0)
            text = (
                f"**`fork`**: `save()` forks a process of {fmt(a['rss_mib'], 0)} MiB RSS (the "
                f"slowest rank's, just before the save) in {fmt(a['blocked_ms'])} ms. From "
                f"`save()` to the end of its write the training process took "
                f"{fmt(a['write_faults'], 0)} minor page faults per save (slowest rank), "
                f"against {fmt(base, 0)} {base_text}; the {fmt(extra_faults, 0)} more are the "
                f"copy-on-write copies (about {fmt(extra_faults * page_kib / 1024, 0)} MiB "
                f"per rank if each copies one {fmt(page_kib, 0)} KiB page: any page training "
                f"writes to counts, not only those of the {fmt(per_rank, 0)} MiB of pieces). "
                "These copies and the writer process's work (serializing, CRC, writing and "
                "flushing the file, on the same cores) land on the steps during the write, "
                "not in `save()`. "
            )
        else:
            text = (
                f"**`copy`**: `save()` copies about {fmt(per_rank, 0)} MiB per rank into "
                "staging memory, at "
                f"{fmt(r['checkpoint_mib'] / (a['blocked_ms'] / 1000), 0)} MiB/s over all "
                f"ranks ({r['world']} ranks copying at once on {os.cpu_count()} cores). The "
                "ratio of its blocked time to the synchronous one is the ratio of these rates: "
                "the faster the disk takes the checkpoint, the higher it is. "
            )
        during, costs[name] = during_write_text(r, name, saves)
        p(text + during)
        p()
    if costs:
        p(
            "What an async save costs training in total per save (`save()` plus the slowdown "
            "of the steps during its write): "
            + "; ".join(
                f"`{name}` about {fmt(c, 0)} ms" if c is not None else f"`{name}` only its "
                f"`save()`, {fmt(r['async'][name]['blocked_ms'], 0)} ms (no slowdown measured)"
                for name, c in costs.items()
            )
            + f"; a synchronous save {fmt(r['sync_blocked_ms'], 0)} ms."
        )
        p()
    for name, a in stagings:
        share = ratio(a["blocked_ms"], r["sync_blocked_ms"])
        if share is None:
            continue
        measured = (
            f"{fmt(a['blocked_ms'])} vs {fmt(r['sync_blocked_ms'])} ms = {share * 100:.1f}%"
        )
        if name == "copy":
            rep.target(
                (
                    "async save blocks <= 10% of the synchronous save, d512L16, 4 ranks, "
                    "default staging (`CheckpointStaging::kCopy`)",
                    measured,
                    "met" if share <= 0.1 else f"missed ({share * 100:.1f}% > 10%)",
                )
            )
        else:
            rep.target(
                (
                    "async save blocks, `CheckpointStaging::kFork` (for information; not the "
                    "default), d512L16, 4 ranks",
                    measured,
                    f"informational ({'within' if share <= 0.1 else 'above'} 10%)",
                )
            )


# The async stagings of hp_bench --checkpoint, in table order (the default first).
ASYNC_STAGINGS = ("fork", "copy")


def during_write_text(r, name, saves):
    """The sentences on the steps during the writes of staging `name`, and what a save of it
    costs training in total (None: no slowdown measured)."""
    a = r["async"][name]
    during, steps = a.get("during_write_each_ms") or [], r["step_each_ms"]
    if not during:
        return "No step started while a write was in flight.", a["blocked_ms"]
    # Means as the issue asks; medians too, as load spikes of this shared machine can hit
    # either side. The cost counts the larger of the two slowdowns.
    extra = a["during_write_step_ms"] - r["step_ms"]
    med_steps, med_during = statistics.median(steps), statistics.median(during)
    med_extra = med_during - med_steps
    overlap = (
        "; the write is shorter than a step, so it overlaps part of one"
        if a["write_ms"] < a["during_write_step_ms"]
        else ""
    )
    text = (
        f"{len(during)} steps started while a write was in flight "
        f"({len(during) / saves:.1f} per save{overlap}): mean "
        f"{fmt(a['during_write_step_ms'])} ms against {fmt(r['step_ms'])} ms without "
        f"saving ({extra:+.0f} ms, {100 * extra / r['step_ms']:+.0f}%), median "
        f"{fmt(med_during)} against {fmt(med_steps)} ms ({med_extra:+.0f} ms, "
        f"{100 * med_extra / med_steps:+.0f}%). "
    )
    if max(extra, med_extra) <= 0:
        return text + "The slowdown is within the noise of this shared machine.", None
    cost = a["blocked_ms"] + max(extra, med_extra) * len(during) / saves
    return (
        text + f"Counting the larger slowdown as well, a `{name}` save costs training about "
        f"{fmt(cost, 0)} ms per save, against {fmt(r['sync_blocked_ms'], 0)} ms for a "
        "synchronous one.",
        cost,
    )


# The pipeline runs of bench/run.sh (section pipeline), in table order: (schedule, title).
PIPELINE_SCHEDULES = (
    ("gpipe", "GPipe"),
    ("1f1b", "1F1B"),
    ("interleaved", "interleaved 1F1B"),
)


def pipeline_actions(r):
    """Forwards and backwards of one rank in a step: 2 per microbatch and chunk."""
    return 2 * r["microbatches"] * r["virtual_stages"]


def pipeline_theory_step(r):
    """The step the theory predicts: a rank's compute over the share of the step it is busy."""
    return r["compute_ms"] / (1 - r["theoretical_bubble"])


def pipeline_theory_wait(r, rank):
    """What rank `rank` waits for its receives in a step, in theory. Its step starts with
    the others' (a barrier) and ends with its last backward: rank r starts computing r
    forward hops after rank 0 (F/V each) and finishes r backward hops (2F/V each) before it,
    so of the bubble (S-1)(F+2F)/V that the slowest rank (0) waits, rank r waits
    (S-1)·3F/V - r·2F/V."""
    s, v, f = r["stages"], r["virtual_stages"], r["forward_ms"]
    return (s - 1) * 3 * f / v - rank * 2 * f / v


def pipeline_theory_activations(r, rank):
    """The most activations (MiB) rank `rank` holds at once, in theory: GPipe all M
    microbatches', 1F1B min(S - r, M) (its warm-up forwards and one more), interleaved
    ((S-r-1)·2 + (V-1)·S + 1) chunks of A/V each (Megatron-LM's warm-up and one more),
    never more than M·A, and M·A when M = S (Megatron-LM's rule, which the schedule
    follows: no steady phase, every forward first)."""
    s, m, v, a = r["stages"], r["microbatches"], r["virtual_stages"], r["activation_mib"]
    if r["schedule"] == "gpipe":
        return m * a
    if r["schedule"] == "1f1b":
        return min(s - rank, m) * a
    if m == s:
        return m * a
    return min(((s - rank - 1) * 2 + (v - 1) * s + 1) * a / v, m * a)


def per_rank(values, digits=0):
    return " / ".join(fmt(x, digits) for x in values)


def pipeline_section(rep):
    runs = [r for r in rep.results if r.get("label", "").startswith("pipeline/")]
    if not runs:
        return
    p = rep.p
    rep.section("Pipeline schedules")
    sched = [r for r in runs if r.get("schedule") and not r.get("error")]
    split = next((r for r in runs if r.get("split_backward") and not r.get("error")), None)
    ref = sched[0] if sched else None
    if ref:
        s, f, a = ref["stages"], ref["forward_ms"], ref["activation_mib"]
        p(
            f"The schedules of `include/hyperparallel/pipeline.h` on **S = {s} ranks** (one "
            f"stage each; interleaved: V = {max(r['virtual_stages'] for r in sched)} chunks "
            f"each), with M = 2S = {2 * s} and M = S = {s} microbatches per step, "
            f"{ref['steps']} timed steps after 1 warm-up step (`bench/pipeline_bench`, under "
            f"`hp-run -n {s}`). A stage's compute is **timed sleeping work**: a forward of "
            f"**F = {fmt(f, 0)} ms** per microbatch and a backward of 2F (a model's usual ratio), "
            "split evenly over a rank's chunks, which keeps "
            f"**A = {fmt(a, 0)} MiB** of activations per microbatch from its forward to its "
            "backward (allocated, and counted while held). It sleeps rather than computes "
            f"because this machine has {os.cpu_count()} cores for {s} ranks: real compute "
            "would run the stages two at a time and measure the cores, not the schedule. "
            "With sleeping work the stages run side by side as they would on S devices, "
            "while the schedule, its transfers (Gloo over loopback) and its waits are the "
            "real ones. " + made_by(rep, "pipeline")
        )
        p()
        p(
            "`step ms`: the slowest rank's mean step. `bubble` = 1 - compute / step, with "
            "compute = 3·F·M (a rank's forwards and backwards); `theory` = "
            "(S-1)/(V·M+S-1) (V = 1 but for interleaved). `cost per action` = (step - "
            "theoretical step) / actions per rank, with the theoretical step = compute / (1 "
            "- theory) and 2·M·V actions (forwards and backwards) per rank. `waits`: time "
            "each rank spent waiting on its receives (from its trace), rank 0 first; in "
            "parentheses the theory, (S-1)·3F/V - r·2F/V for rank r (rank r starts r "
            "forward hops after rank 0 and ends r backward hops before it; a rank's step "
            "ends with its own last backward). `activations`: the most activations a rank "
            "held at once in the last step, rank 0 first; in parentheses the theory: GPipe "
            "M·A on every rank, 1F1B min(S-r, M)·A on rank r (its S-r-1 warm-up forwards "
            "and one more), interleaved ((S-r-1)·2 + (V-1)·S + 1)·A/V on rank r (Megatron-LM's "
            "warm-up and one more), at most M·A, and M·A on every rank when M = S (Megatron-LM's "
            "rule, which the schedule follows: with as many microbatches as stages it runs "
            "every forward first)."
        )
        p()
    found = {}  # (schedule, microbatches) -> result
    for m in sorted({r["microbatches"] for r in sched}, reverse=True):
        s = next(r["stages"] for r in sched if r["microbatches"] == m)
        what = "2S" if m == 2 * s else "S" if m == s else f"{m / s:g}S"
        p(f"### M = {what} = {m} microbatches, S = {s}")
        p()
        p(
            "| schedule | step ms | bubble | theory | difference (points) | cost per action ms "
            "| waits ms per rank (theory) | activations MiB per rank (theory) |"
        )
        p("|---|---:|---:|---:|---:|---:|---|---|")
        for key, title in PIPELINE_SCHEDULES:
            r = next(
                (x for x in sched if x["schedule"] == key and x["microbatches"] == m), None
            )
            if r is None:
                continue
            found[(key, m)] = r
            if r["virtual_stages"] > 1:
                title += f", V = {r['virtual_stages']}"
            ranks = range(r["stages"])
            cost = (r["step_ms"] - pipeline_theory_step(r)) / pipeline_actions(r)
            p(
                f"| {title} | **{fmt(r['step_ms'], 0)}** | {fmt(r['bubble'], 3)} | "
                f"{fmt(r['theoretical_bubble'], 3)} | "
                f"{100 * (r['bubble'] - r['theoretical_bubble']):+.1f} | {fmt(cost)} | "
                f"{per_rank(x['wait_ms'] for x in r['ranks'])} "
                f"({per_rank(pipeline_theory_wait(r, k) for k in ranks)}) | "
                f"{per_rank(x['activations_mib'] for x in r['ranks'])} "
                f"({per_rank(pipeline_theory_activations(r, k) for k in ranks)}) |"
            )
        p()
    for r in runs:
        if r.get("error"):
            p(f"`{r['label']}` failed: {r['error']} (see `build/bench/results/log.txt`).")
            p()
    if sched:
        costs = {
            f"{key} M={m}": (r["step_ms"] - pipeline_theory_step(r)) / pipeline_actions(r)
            for (key, m), r in found.items()
        }
        excess = [
            x["wait_ms"] - pipeline_theory_wait(r, k)
            for r in found.values()
            for k, x in enumerate(r["ranks"])
        ]
        p(
            "**Measured against theory.** The theory counts compute only; each action also "
            "pays a fixed cost: a receive's rendezvous (the sender's and receiver's round "
            f"trip through Gloo), the wake-ups of {ref['stages']} processes' threads on "
            f"{os.cpu_count()} cores, and the sleep's overshoot. Spread over the actions of a "
            f"rank it comes to {fmt(min(costs.values()))}–{fmt(max(costs.values()))} ms per "
            "action here, which puts each step that many milliseconds times 2·M·V above "
            "the theory. Interleaving has V times the actions, each V times shorter, so the "
            "same fixed cost is a larger share of its step: with shorter stages (at F = 20 "
            "ms, by hand, about 1.6 ms per action for 1F1B and 2.7 ms for interleaved) its "
            "measured bubble was 11 points above theory (0.271 against 0.158, a separate "
            "check), which is why this run uses "
            f"F = {fmt(ref['forward_ms'], 0)} ms. The waits follow the theory rank by rank, "
            f"{fmt(min(excess), 0)}–{fmt(max(excess), 0)} ms above it for the same reason. "
            "The fixed cost grows with the machine's load, since each wake-up waits for a "
            "core: in a separate run of this section at a load average of about 7 (other "
            "jobs compiling and testing), it came to 2.2–5.1 ms per action, interleaved's "
            "bubble at M = 2S was 5.6 points above theory (0.214 against 0.158) and its step "
            "0.91x 1F1B's, missing two of the targets below; GPipe and 1F1B stayed within "
            "2.2 points."
        )
        p()
    if split:
        whole, bi, bw = split["whole_ms"], split["input_grad_ms"], split["weight_grad_ms"]
        both = bi + bw
        p("### Zero-bubble schedules: the split backward")
        p()
        p(
            "| backward of 2 decoder blocks (dim 512, ffn 2048, 8 x 128 tokens) | ms |"
        )
        p("|---|---:|")
        p(f"| whole (`torch::autograd::backward`) | **{fmt(whole)}** |")
        p(f"| input-gradient half B (`autograd::grad` to the input, graph kept) | {fmt(bi)} |")
        p(f"| weight-gradient half W (`autograd::grad` to the parameters) | {fmt(bw)} |")
        p(f"| B + W | **{fmt(both)}** ({fmt(both / whole, 2)}x the whole) |")
        p()
        one = found.get(("1f1b", 2 * ref["stages"])) if ref else None
        if one:
            s, m, f = one["stages"], one["microbatches"], one["forward_ms"]
            back = 2 * f
            extra = (both / whole - 1) * back  # per microbatch and rank
            # ZB-H1 (Qi et al., 2023): bubble (S-1)(T_F + T_B - T_W) against 1F1B's
            # (S-1)(T_F + T_B + T_W). With the halves at the measured shares of the backward:
            t_b, t_w = back * bi / whole, back * bw / whole
            zb_step = m * (f + t_b + t_w) + (s - 1) * (f + t_b - t_w)
            ideal_gain = 2 * (s - 1) * (back / 2)  # halves of equal cost adding up to the whole
            one_theory = pipeline_theory_step(one)
            if zb_step >= one_theory:
                zb_text = f"longer than 1F1B's {fmt(one_theory, 0)} ms in theory"
            else:
                action_cost = (one["step_ms"] - one_theory) / pipeline_actions(one)
                zb_text = (
                    f"against 1F1B's {fmt(one_theory, 0)} ms in theory: "
                    f"{fmt(one_theory - zb_step, 0)} ms shorter, about what its M more "
                    f"actions per step (the W's) cost at 1F1B's measured fixed cost per action "
                    f"({m} x {fmt(action_cost)} = {fmt(m * action_cost, 0)} ms), against the "
                    f"{fmt(ideal_gain, 0)} ms a split at no extra cost would save"
                )
            p(
                "ZB-H1 (Zero Bubble Pipeline Parallelism, Qi et al., ICLR 2024) splits each "
                "backward into B, the gradient of the stage's input (which the previous "
                "stage waits for), and W, the gradient of its weights (which nobody waits "
                "for), and runs the W's in what would be the bubble: its bubble is "
                "(S-1)·(T_F + T_B - T_W) against 1F1B's (S-1)·(T_F + T_B + T_W). That pays "
                "only if B + W cost about what the whole backward costs. Here they do not: "
                "LibTorch's engine has no call that stops a backward at the input and later "
                "resumes it for the weights, so the split is two passes over the graph "
                "(`autograd::grad` to the input keeping the graph, then `autograd::grad` to "
                "the parameters, which runs again from the output through every node on the "
                "way), and B + W cost "
                f"**{fmt(both / whole, 2)}x** the whole backward "
                f"({fmt(bi, 0)} + {fmt(bw, 0)} ms against {fmt(whole, 0)} ms). "
                f"Scaled to the schedules above (backward 2F = {fmt(back, 0)} ms), that is "
                f"**+{fmt(extra, 0)} ms of compute per microbatch**, {fmt(m * extra, 0)} ms "
                f"per step and rank at S = {s}, M = {m}, against **{fmt(ideal_gain, 0)} ms "
                "of bubble** that ZB-H1 removes at best (2·(S-1)·T_W with B and W of equal "
                f"cost, F each; 1F1B's whole bubble is {fmt(one_theory - one['compute_ms'], 0)} "
                f"ms in theory, {fmt(one['step_ms'] - one['compute_ms'], 0)} ms measured). With "
                f"the measured halves (T_B = {fmt(t_b, 0)}, T_W = {fmt(t_w, 0)} ms) ZB-H1's "
                f"step would be {fmt(zb_step, 0)} ms, {zb_text}. So no zero-bubble schedule "
                "is built: it needs a W pass that does "
                "not redo B's work, which takes more than two `autograd::grad` calls (PyTorch's "
                "Python pipelining does it in `stage_backward_input` / "
                "`stage_backward_weight`: pre-hooks on the graph nodes where the weights' "
                "paths leave the input's keep the gradients arriving there during B, and W "
                "starts from those nodes instead of from the output)."
            )
            p()
    # Targets
    s = ref["stages"] if ref else None
    gp, one, il = (found.get((k, 2 * s)) if s else None for k in ("gpipe", "1f1b", "interleaved"))
    if gp and one:
        g0, o0 = gp["ranks"][0]["activations_mib"], one["ranks"][0]["activations_mib"]
        bound = s / one["microbatches"]
        rep.target(
            (
                f"1F1B peak activations <= S/M of GPipe's (rank 0, S = {s}, "
                f"M = {one['microbatches']})",
                f"{fmt(o0, 0)} vs {fmt(g0, 0)} MiB = {fmt(o0 / g0, 2)} (S/M = {fmt(bound, 2)})",
                "met" if o0 <= bound * g0 + 1e-9
                else f"missed ({fmt(o0 / g0, 2)} > {fmt(bound, 2)})",
            )
        )
    if one and il:
        q = il["step_ms"] / one["step_ms"]
        rep.target(
            (
                f"interleaved step <= 0.9x 1F1B at M = 2S (S = {s}, M = {il['microbatches']}, "
                f"V = {il['virtual_stages']}, F = {fmt(il['forward_ms'], 0)} ms)",
                f"{fmt(il['step_ms'], 0)} vs {fmt(one['step_ms'], 0)} ms = {fmt(q, 3)} (theory "
                f"{fmt(pipeline_theory_step(il) / pipeline_theory_step(one), 3)})",
                "met" if q <= 0.9 else f"missed ({fmt(q, 3)} > 0.9)",
            )
        )
    for key, title in PIPELINE_SCHEDULES:
        r = found.get((key, 2 * s)) if s else None
        if r is None:
            continue
        gap = 100 * (r["bubble"] - r["theoretical_bubble"])
        rep.target(
            (
                f"measured bubble within 5 percentage points of theory, {title}, M = 2S = "
                f"{r['microbatches']} (F = {fmt(r['forward_ms'], 0)} ms)",
                f"{fmt(r['bubble'], 3)} vs {fmt(r['theoretical_bubble'], 3)}: {gap:+.1f} points",
                "met" if abs(gap) <= 5 else f"missed by {fmt(abs(gap) - 5)} points",
            )
        )


def activation_bytes(model):
    """fp32 bytes autograd keeps from forward to backward for one sequence batch of
    models/transformer.h (`bench/fsdp2_bench.py` is the same model), counted from its
    forward: per block 2 per RMSNorm (normalized, scaled), q, k, v and the merged heads
    (4), the residual sum and the block output (2): 10 x [B, T, d]; the SwiGLU's w1, silu,
    w3 and product: 4 x [B, T, ffn]; the softmax probabilities [B, heads, T, T]. Outside
    the blocks: the embedding sum, the final norm's 2, logits and log-softmax [B, T, vocab]."""
    b, t, d = model["batch"], model["seq"], model["dim"]
    per_block = 10 * b * t * d + 4 * b * t * model["ffn"] + b * model["heads"] * t * t
    outside = 3 * b * t * d + 2 * b * t * model["vocab"]
    return 4 * (model["layers"] * per_block + outside)


def ideal_zero3_mib(r, ranks, base_mib):
    """The ideal ZeRO-3 peak of one rank: 16 bytes per parameter (fp32 parameter, gradient
    and AdamW's two moments) / N, two blocks unsharded with their gradients (8 bytes per
    parameter: the block computing and the one prefetched or still reducing), activations,
    and the process baseline. On one rank nothing is unsharded beyond the state itself."""
    unsharded = 2 * 8 * r["block_params"] if ranks > 1 else 0
    return base_mib + (16 * r["params"] / ranks + unsharded + activation_bytes(r["model"])) / MIB


def rss_ok(r):
    return not r.get("error") and bool(r.get("peak_rss_mib"))


def rss_summary(r):
    """(peak, baseline, peak - baseline, boundary - baseline): max over ranks, MiB."""
    peaks, bases = r["peak_rss_mib"], r["base_rss_mib"]
    bounds = r.get("boundary_rss_mib") or []
    return (
        max(peaks),
        max(bases),
        max(a - b for a, b in zip(peaks, bases)),
        max((a - b for a, b in zip(bounds, bases)), default=None),
    )


def memory_section(rep, args):
    runs = [r for r in rep.results if r.get("label", "").startswith("memory/")]
    if not runs:
        return
    p = rep.p
    ref = next((r for r in runs if r.get("model") and r.get("params")), None)
    rep.section("Peak RSS")
    if ref is None:
        p("No memory run succeeded; see `build/bench/results/log.txt`.")
        p()
        return
    model, params, block = ref["model"], ref["params"], ref["block_params"]
    layers = model["layers"]
    act_mib = activation_bytes(model) / MIB
    p(
        f"Memory scaling of one model: dim {model['dim']}, **{layers} blocks**, "
        f"{model['heads']} heads, ffn {model['ffn']}, vocabulary {model['vocab']}: "
        f"**{params / 1e6:.1f} M parameters** ({block / 1e6:.2f} M per block), "
        f"**{16 * params / MIB:.0f} MiB of fp32 training state** (parameter, gradient, two "
        f"AdamW moments: 16 bytes per parameter) when nothing is sharded. {model['batch']} "
        f"sequence of {model['seq']} tokens per rank, 1 warm-up + 1 timed step (the second "
        "step runs with the optimizer state in place). Every model is built with deferred "
        "initialization (`hp_bench --deferred-init`: `hp::deferred_init`, fully_shard, "
        "`hp::materialize`; FSDP2: the meta device, `fully_shard`, `to_empty`, init), so no "
        "rank ever holds the whole model; the DDP baseline materializes it whole, as it must. "
        "One variant per process, so the process's high-water mark (VmHWM) is the variant's. "
        + made_by(rep, "memory")
    )
    p()
    p(
        "`baseline`: RSS after start-up (LibTorch, Gloo, the process groups; for Python also "
        "the interpreter and its imports), before any model exists. `above baseline`: max "
        "over ranks of (VmHWM - baseline). `at fwd/bwd`: RSS at the end of the last "
        "step's forward, minus the baseline (max over ranks): what is held between forward "
        "and backward. `ideal ZeRO-3` = baseline + 16 bytes x parameters / N + 2 blocks "
        f"unsharded with their gradients (8 bytes x {block / 1e6:.2f} M x 2 = "
        f"{16 * block / MIB:.0f} MiB; none on 1 rank) + activations ({act_mib:.0f} MiB, "
        "counted from the model's forward: `activation_bytes` in `bench/report.py`). It "
        "applies to the variants that reshard after forward (hp, hp comm_fusion). Peak-RSS "
        f"runs set `GLIBC_TUNABLES={args.memory_malloc}`: blocks of 128 KiB or more are "
        "mapped on allocation and unmapped on free, so RSS follows the live tensors."
    )
    p()
    p(
        "| ranks | variant | peak RSS MiB (max rank) | baseline MiB | above baseline MiB | "
        "at fwd/bwd MiB | ideal ZeRO-3 MiB | peak / ideal |"
    )
    p("|---:|---|---:|---:|---:|---:|---:|---:|")
    found = {}  # (ranks, variant) -> (peak, base, above, boundary, ideal)
    for n in (1, 2, 4):
        label = f"memory/d{model['dim']}L{layers}/1x{n}"
        for src, variant, title, r in rep.rows(label, columns=8, prefix=f"{n} | ", good=rss_ok):
            peak, base, above, boundary = rss_summary(r)
            ideal = None
            if variant in ("hp", "hp:fusion") and r.get("params"):
                ideal = ideal_zero3_mib(r, n, base)
            found[(n, variant)] = (peak, base, above, boundary, ideal)
            p(
                f"| {n} | {title} | {fmt(peak)} | {fmt(base)} | {fmt(above)} | {fmt(boundary)} "
                f"| {fmt(ideal)} | {fmt(ratio(peak, ideal), 2)} |"
            )
    p()
    freed_target = 0.8 * (layers - 2) * 4 * block / MIB
    p(
        f"RAF=false keeps every block's parameters unsharded from its forward to its "
        f"backward ({layers} x {4 * block / MIB:.0f} MiB); RAF=true frees them after each "
        f"block's forward and holds about 2. The issue's bound on the difference: 80% of "
        f"({layers}-2)/{layers} of the blocks' unsharded bytes = **{freed_target:.0f} MiB**. "
        "The `at fwd/bwd` column is where that difference is made; the peak of RAF=true "
        "comes later (where `above baseline` exceeds `at fwd/bwd`: in backward, with the "
        "gradients arriving, or in the optimizer step), when RAF=false has resharded the "
        "blocks it finished too, so the peaks differ by less than the boundary does. The "
        "DDP baseline also holds one flat copy of all gradients for its all-reduce "
        "(`hp_bench`'s `ddp`); FSDP2's Python process starts about 165 MiB higher, so "
        "its rows compare best on `above baseline`."
    )
    p()
    for n in (1, 2, 4):
        hp_, keep, f2 = found.get((n, "hp")), found.get((n, "hp:keep")), found.get((n, "fsdp2"))
        for variant in ("hp", "hp:fusion"):
            got = found.get((n, variant))
            if got and got[4]:
                r = got[0] / got[4]
                rep.target(
                    (
                        f"peak <= ideal ZeRO-3 + 10%, `{variant}`, {n} rank(s)",
                        f"{fmt(got[0], 0)} vs {fmt(got[4], 0)} MiB = {fmt(r, 2)}",
                        "met" if r <= 1.1 else f"missed by {fmt(got[0] - 1.1 * got[4], 0)} MiB",
                    )
                )
        if n > 1 and hp_ and keep:
            peak_gap, bound_gap = keep[0] - hp_[0], None
            if keep[3] is not None and hp_[3] is not None:
                bound_gap = keep[3] - hp_[3]
            # What RAF frees exists between forward and backward, so the bound applies at
            # that boundary. The peaks come later and differ by less even ideally: RAF=true
            # peaks with every sharded gradient present (4 bytes x parameters / N) and 2
            # blocks unsharded, when RAF=false has freed its first blocks already.
            peak_bound = 4 * block * (layers - 4) / MIB - 4 * params / n / MIB
            at_boundary = bound_gap is not None and bound_gap >= freed_target
            if not at_boundary:
                verdict = f"missed at fwd/bwd by {fmt(freed_target - (bound_gap or 0), 0)} MiB"
            else:
                verdict = "met" if peak_gap > 0 else "missed: the peak is not lower"
            rep.target(
                (
                    f"RAF=true below RAF=false by >= {freed_target:.0f} MiB, {n} ranks",
                    f"at fwd/bwd {fmt(bound_gap, 0)} MiB lower; peak {fmt(hp_[0], 0)} vs "
                    f"{fmt(keep[0], 0)} MiB: {fmt(peak_gap, 0)} MiB lower (the ideal model "
                    f"allows {fmt(peak_bound, 0)} MiB at peak)",
                    verdict,
                )
            )
        if keep and f2:
            verdict = "met" if keep[0] <= f2[0] else "missed"
            verdict += (
                ", also above baseline" if keep[2] <= f2[2] else ", but not above baseline"
            )
            rep.target(
                (
                    f"peak RSS <= FSDP2's at RAF=false, {n} rank(s)",
                    f"{fmt(keep[0], 0)} vs {fmt(f2[0], 0)} MiB; above baseline "
                    f"{fmt(keep[2], 0)} vs {fmt(f2[2], 0)} MiB",
                    verdict,
                )
            )


def beyond_section(rep, args):
    runs = [r for r in rep.results if r.get("label", "").startswith("beyond/")]
    if not runs:
        return
    p = rep.p
    rep.section("Bigger than one rank")
    sharded = next((r for r in runs if r["label"].endswith("/1x4")), None)
    plain = next((r for r in runs if r["label"].endswith("/1x1")), None)
    ref = next((r for r in runs if r.get("params")), None)
    limit = next((r["rlimit_data_mib"] for r in runs if r.get("rlimit_data_mib")), None)
    if ref:
        m = ref["model"]
        state = 16 * ref["params"] / MIB
        p(
            f"A model whose full fp32 training state does not fit one rank's memory limit: "
            f"dim {m['dim']}, {m['layers']} blocks, {m['heads']} heads, ffn {m['ffn']}, "
            f"vocabulary {m['vocab']}, **{ref['params'] / 1e6:.1f} M parameters, "
            f"{state:.0f} MiB of training state** (16 bytes per parameter), against a limit of "
            f"**{fmt(limit, 0)} MiB per rank**. {m['batch']} sequence of {m['seq']} tokens "
            "per rank, AdamW. " + made_by(rep, "beyond")
        )
        p()
    p(
        "The limit is **RLIMIT_DATA**, set on each rank's process by `prlimit --data=BYTES` "
        "(bench/run.sh, section `beyond`; every rank reports the limit it ran under, "
        "`getrlimit`): the kernel refuses to map private writable memory beyond it (heap, "
        "`mmap`'d tensors, thread stacks), so an allocation past it fails in the allocator. "
        "It counts every private writable mapping whether its pages are resident or not "
        "(file-backed pages such as the libraries' code are not counted, unlike in RSS). "
        "cgroup v2 `memory.max` was not used: this build root does not mount "
        "/sys/fs/cgroup, and the host's memory controller is cgroup v1."
    )
    p()
    p(
        "| run | ranks | result | peak RSS MiB (max rank) | above baseline MiB "
        "| loss (rank 0, last step) |"
    )
    p("|---|---:|---|---:|---:|---:|")
    for r, what in ((sharded, "fully_shard, deferred init"), (plain, "not sharded, eager build")):
        if r is None:
            continue
        if rss_ok(r):
            peak, _, above, _ = rss_summary(r)
            p(
                f"| {what} | {r.get('world')} | trained "
                f"{r.get('warmup', 0) + r.get('steps', 0)} steps | "
                f"{fmt(peak)} | {fmt(above)} | {fmt(r.get('loss'), 3)} |"
            )
        else:
            ranks = r["label"].rsplit("x", 1)[-1]
            p(f"| {what} | {ranks} | failed: {r.get('error')} | – | – | – |")
    p()
    if ref and limit:
        fits = sharded is not None and rss_ok(sharded)
        fails = plain is not None and not rss_ok(plain)
        rep.target(
            (
                "bigger than one rank: state > limit, trains sharded on 4 ranks, fails unsharded",
                f"{16 * ref['params'] / MIB:.0f} MiB state, {fmt(limit, 0)} MiB limit; sharded "
                + ("trained" if fits else "failed")
                + ", unsharded "
                + ("failed" if fails else "ran"),
                "met" if fits and fails and 16 * ref["params"] / MIB > limit else "missed",
            )
        )


def table_row(row):
    return "| " + " | ".join(row) + " |"


def document(rep):
    """The whole document from this run's results."""
    out = []
    for title, _ in SECTIONS:
        lines = list(rep.sections.get(title, []))
        if title == "Targets":
            at = lines.index("|---|---|---|") + 1
            lines[at:at] = [table_row(t[1:]) for t in rep.targets] + [""]
        out += lines
    return "\n".join(out).rstrip() + "\n"


def split_sections(text):
    """{title: lines} of a document written by document() (title None: before the first ##)."""
    sections, title = {None: []}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
            sections[title] = []
        sections[title].append(line)
    return sections


def splice(old_text, rep, only):
    """The old document with the sections and target rows of the run.sh sections in
    `only` replaced by this run's; everything else stays as it was."""
    old = split_sections(old_text)
    out = []
    for title, owner in SECTIONS:
        if title == "Targets" and title in old:
            lines = old[title]
            kept = [l for l in lines if not l.startswith("| ") or l.startswith("| target |")
                    or target_section(l[2:]) not in only]
            at = max(i for i, l in enumerate(kept) if l.startswith("|")) + 1
            kept[at:at] = [table_row(t[1:]) for t in rep.targets if t[0] in only]
            out += kept
        elif owner in only:
            out += rep.sections.get(title, [])
        else:
            out += old.get(title, [])
    return "\n".join(out).rstrip() + "\n"


DISCUSSION = """## Discussion

**Communication is CPU work here.** Gloo over loopback is memcpy through the kernel, done
by Gloo's threads on the same two cores that compute; with 4 ranks on 2 cores there is no
idle core at all. Overlap can hide *waiting* (for the other rank, for the link), not
work the CPU has to do anyway, so on loopback the sharded modes pay for every byte they
move, and comparisons between modes mostly compare CPU work per step: copies, collective
count, dispatch overhead. The bandwidth-limited run is where waiting dominates and
overlap can show.

**What Gloo itself copies and sends (c10d).** The copied-MB column is
deterministic and explains much of the loopback cost:
- `ProcessGroupGloo::_allgather_base` gathers into a temporary flat buffer and copies it
  into the output. So the per-parameter all-gathers, which HyperParallel feeds straight
  from the shard into the final unsharded buffer (no copy-in, no copy-out), still cost
  one full-size copy on a Gloo thread: the "+" part of the column is exactly one full
  model per all-gather round (2 rounds with RAF=true, 1 with RAF=false).
- `_reduce_scatter_base` is `reduce_scatter_tensor_coalesced`, which clones the input,
  **all-reduces** the whole clone and copies this rank's chunk out: it sends as many bytes
  as an all-reduce, 2(W-1)/W of the gradient per rank instead of (W-1)/W, and ignores the
  requested reduce op. FSDP2 on Gloo pays this. HyperParallel's `hp::reduce_scatter`
  does not use it on Gloo: it sends each chunk straight to its owner (`alltoall_base`,
  no clone; (W-1)/W of the gradient) and the owner sums the W chunks it received, in
  rank order, accumulating bf16/fp16 in fp32. With RAF=true a fully-sharded step then
  sends 1.5x the bytes of DDP (two all-gathers and a reduce-scatter vs one all-reduce),
  FSDP2 on Gloo 2x.
- comm_fusion adds the copy-in / copy-out that the per-parameter mode avoids (the
  seed's argument for per-parameter collectives) plus one full-size copy for the
  reduce-scatter input: the main-thread part of the copied column grows by about 3
  model sizes per step. In exchange it issues one collective per module instead of one
  per parameter (9 per decoder block), and each Gloo collective has a fixed cost of the
  order of a millisecond on this loaded 2-core host (thread hand-offs, TCP). Which of
  the two wins depends on the block size and on how loaded the machine is; the ratios
  table shows it per configuration.

**Where the bandwidth-limited run loses time** (the timeline above): (1) the first
all-gathers of a step (root, first block) wait on the link before anything can compute,
and (2) the last reduce-scatters (the first block's and the root's, whose embedding
gradient is complete only when backward ends) have nothing left to overlap with; both
are fixed costs per step, which is why this run uses 8 blocks. (3) Communication is
not free for the CPU (the `CPU ms` column): Gloo's threads and the kernel's TCP and veth
work run on the two cores that compute, so compute in an overlapped step is slower than
in the compute-only step, and that difference counts as exposed communication in the
efficiency. The per-parameter mode issues 9 collectives per block where comm_fusion
issues 1, and each costs CPU time of its own. (4) The two ranks do not compute at the
same speed on the shared host; the faster one waits for the slower one inside the
collectives (dark parts in the middle of the reduce-scatter lane).

**Scheduling overhead.** On one rank, with no collective at all, HyperParallel's cost per
block (`Sharded<M>::operator()`, the hooks, the unshard state machine, the reduction
bookkeeping) is tens of µs, against about a millisecond for FSDP2 (Python hooks, DTensor
bookkeeping in the module and the optimizer, and the 1-rank Gloo collectives it still
issues). On two ranks both are dominated by Gloo: the communication-only row (6
collectives per block, nothing else) costs hundreds of µs of CPU per collective (thread
hand-offs, syscalls and TCP over loopback in this VM) on top of the wait, more than the
whole per-block cost of HyperParallel on one rank. The per-parameter mode issues 6
collectives per `Linear` block against FSDP2's 3, so only comm_fusion (also 3) comes
close; the 1/5 ratio of the 1-rank case cannot show through a floor set by the backend.

**What would change the picture** (not done here): one core per rank plus cores for
communication, bf16 parameters (`--mp bf16` in the demo halves the all-gather bytes),
and NCCL on GPUs, where collectives run on their own engines instead of the cores that
compute. With PyPI's torch (MKL) compute is about 20x faster than with Debian's
reference BLAS, so on loopback communication is now most of a sharded step: the
per-parameter mode's many small Gloo collectives cost more than comm_fusion's few.
"""

if __name__ == "__main__":
    sys.exit(main())
