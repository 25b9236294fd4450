"""The Python package (bench/run.sh section python): hyperparallel.fully_shard against
FSDP2 on the same Python model (bench/fsdp2_bench.py), step time, peak memory, overhead
per module and the int8 codecs on the bandwidth-limited link."""

from reporting.formatting import fmt, ratio, step_cell
from reporting.results import ok

TITLE = "Python: hyperparallel.fully_shard against FSDP2"
TARGETS = ("python:",)

BLOCKS_TINY = 64


def write(rep, args):
    if not rep.runs("python/"):
        return
    rep.section(TITLE)
    rep.p(
        "The Python package (`import hyperparallel`, [python.md](python.md)) and torch's FSDP2 "
        "on one Python model (`bench/fsdp2_bench.py`: models/transformer.py, AdamW), the "
        "same calls with the import changed; each program alternates its variants step by "
        "step, so both see the same machine. Step times are the slowest rank's medians."
    )
    rep.p()
    steps(rep)
    memory(rep)
    overhead(rep)
    link(rep, args)


def steps(rep):
    rep.p("| ranks | variant | fwd ms | bwd ms | opt ms | step ms (p25–p75) |")
    rep.p("|---:|---|---:|---:|---:|---:|")
    for n in (2, 4):
        for _, _, title, r in rep.rows(f"python/d256L4/1x{n}", columns=6, prefix=f"{n} | "):
            rep.p(
                f"| {n} | {title} | {fmt(r['fwd_ms'], 2)} | {fmt(r['bwd_ms'], 2)} | "
                f"{fmt(r['opt_ms'], 2)} | {step_cell(r)} |"
            )
    rep.p()
    for n in (2, 4):
        label = f"python/d256L4/1x{n}"
        ours = rep.best(
            label, "Python", ["hyperparallel", "hyperparallel:raf", "hyperparallel:fusion"]
        )
        theirs = rep.find(label, "Python", "fsdp2")
        if ours and ok(theirs):
            r = ratio(ours["step_ms"], theirs["step_ms"])
            rep.target(
                (
                    f"python: step <= 0.7x FSDP2's, d256L4, {n} ranks",
                    f"`{ours['variant']}` {fmt(ours['step_ms'], 1)} ms vs "
                    f"{fmt(theirs['step_ms'], 1)} ms = {fmt(r, 2)}",
                    "met" if r is not None and r <= 0.7 else f"missed ({fmt(r, 2)} > 0.70)",
                )
            )


def peak(r):
    return max(r["peak_rss_mib"]) if r and not r.get("error") and r.get("peak_rss_mib") else None


def memory(rep):
    label = "python/memory/d512L16/1x4"
    ours = rep.find(label, "Python", "hyperparallel")
    theirs = rep.find(label, "Python", "fsdp2")
    if ours is None and theirs is None:
        return
    rep.p(
        "Peak RSS on 4 ranks (the memory section's d=512, 16-block model, built eagerly on "
        "each rank, one variant per process; the largest rank's VmHWM): "
        f"hyperparallel {fmt(peak(ours), 0)} MiB, FSDP2 {fmt(peak(theirs), 0)} MiB."
    )
    rep.p()
    r = ratio(peak(ours), peak(theirs))
    if r is not None:
        rep.target(
            (
                "python: peak RSS <= FSDP2's, 4 ranks",
                f"{fmt(peak(ours), 0)} vs {fmt(peak(theirs), 0)} MiB = {fmt(r, 2)}",
                "met" if r <= 1.0 else f"missed ({fmt(r, 2)} > 1.00)",
            )
        )


def overhead(rep):
    label = "python/tiny/1x2"
    local = rep.find(label, "Python", "local")
    ours = rep.best(label, "Python", ["hyperparallel", "hyperparallel:fusion"])
    theirs = rep.find(label, "Python", "fsdp2")
    if not (ok(local) and ok(ours) and ok(theirs)):
        for r in rep.run_failures(label):
            rep.p(f"The overhead run failed: {r.get('error')}")
        return
    ours_us = (ours["step_ms"] - local["step_ms"]) * 1000 / BLOCKS_TINY
    theirs_us = (theirs["step_ms"] - local["step_ms"]) * 1000 / BLOCKS_TINY
    rep.p(
        f"Overhead per module on 2 ranks ({BLOCKS_TINY} blocks of `Linear(8, 8)`, the "
        "overhead section's model; step minus the compute-only step, per block): "
        f"`{ours['variant']}` {fmt(ours_us, 0)} µs, FSDP2 {fmt(theirs_us, 0)} µs."
    )
    rep.p()
    r = ratio(ours_us, theirs_us)
    rep.target(
        (
            "python: overhead per module <= 1/3 of FSDP2's, 2 ranks",
            f"{fmt(ours_us, 0)} µs vs {fmt(theirs_us, 0)} µs = {fmt(r, 2)}",
            "met" if r is not None and r <= 1 / 3 else f"missed ({fmt(r, 2)} > 0.33)",
        )
    )


def link(rep, args):
    label = "python/netns/d128L8/1x2"
    ours = rep.best(label, "Python", ["hyperparallel:int8", "hyperparallel:fusion+int8"])
    plain = rep.best(label, "Python", ["hyperparallel", "hyperparallel:fusion"])
    theirs = rep.find(label, "Python", "fsdp2")
    if not (ok(ours) and ok(theirs)):
        for r in rep.run_failures(label):
            rep.p(f"The bandwidth-limited run failed: {r.get('error')}")
        return
    rep.p(
        f"On the bandwidth-limited link ({args.rate} per rank, the netns section's d128L8 "
        f"model, 2 ranks): FSDP2 {fmt(theirs['step_ms'], 0)} ms, "
        f"`{plain['variant'] if ok(plain) else 'hyperparallel'}` "
        f"{fmt(plain['step_ms'], 0) if ok(plain) else 'failed'} ms, with int8 all-gather and "
        f"reduce-scatter (error feedback, `{ours['variant']}`) {fmt(ours['step_ms'], 0)} ms "
        "per step."
    )
    rep.p()
    r = ratio(ours["step_ms"], theirs["step_ms"])
    rep.target(
        (
            "python: int8 codecs on the bandwidth-limited link <= 0.3x FSDP2's step",
            f"`{ours['variant']}` {fmt(ours['step_ms'], 0)} ms vs {fmt(theirs['step_ms'], 0)} "
            f"ms = {fmt(r, 2)}",
            "met" if r is not None and r <= 0.3 else f"missed ({fmt(r, 2)} > 0.30)",
        )
    )
