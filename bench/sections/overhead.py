"""Scheduling overhead (bench/run.sh section overhead): 64 tiny blocks, so that a step
measures the framework's cost per module, HyperParallel against FSDP2 on 1 and 2 ranks."""

from reporting.formatting import fmt, ratio, step_cell
from reporting.results import ok

TITLE = "Scheduling overhead"
TARGETS = ("scheduling overhead",)

BLOCKS_TINY = 64


def write(rep, args):
    if not rep.runs("tiny/"):
        return
    rep.section(TITLE)
    rep.p(
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
    rep.p()
    rep.p(
        "| ranks | variant | fwd ms | bwd ms | opt ms | step ms (p25–p75) | per block µs | "
        "overhead per block µs | CPU µs per block |"
    )
    rep.p("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in (1, 2):
        rows(rep, n)
        target(rep, n)
    rep.p()


def per_block_us(ms):
    return ms * 1000 / BLOCKS_TINY


def rows(rep, n):
    label = f"tiny/1x{n}"
    for src, variant, title, r in rep.rows(label, columns=9, prefix=f"{n} | "):
        local = rep.find(label, src, "local")
        over = None
        if not variant.startswith(("local", "comm")) and ok(local):
            over = per_block_us(r["step_ms"] - local["step_ms"])
        short = title.replace(", RAF=true (defaults)", "").replace(", RAF=true", "")
        short = short.replace(", RAF=false", "").replace(
            "communication only, serial", "communication only"
        )
        rep.p(
            f"| {n} | {short} | {fmt(r['fwd_ms'], 2)} | {fmt(r['bwd_ms'], 2)} | "
            f"{fmt(r['opt_ms'], 2)} | {step_cell(r)} | "
            f"{fmt(per_block_us(r['step_ms']), 0)} | {fmt(over, 0)} | "
            f"{fmt(per_block_us(r['cpu_ms']) if r.get('cpu_ms') else None, 0)} |"
        )


def target(rep, n):
    """The better hp variant's overhead per block against FSDP2's, each over its own
    program's compute-only step."""
    label = f"tiny/1x{n}"
    hp_b = rep.best(label, "C++", ["hp", "hp:fusion"])
    f2 = rep.find(label, "Python", "fsdp2")
    hl, pl = rep.find(label, "C++", "local"), rep.find(label, "Python", "local")
    if not (hp_b and ok(f2) and ok(hl) and ok(pl)):
        return
    hp_over = per_block_us(hp_b["step_ms"] - hl["step_ms"])
    f2_over = per_block_us(f2["step_ms"] - pl["step_ms"])
    r = ratio(hp_over, f2_over)
    rep.target(
        (
            f"scheduling overhead per block <= 1/5 of FSDP2's, {n} rank(s)",
            f"`{hp_b['variant']}` {fmt(hp_over, 0)} µs vs {fmt(f2_over, 0)} µs = {fmt(r, 2)}",
            "met" if r is not None and r <= 0.2 else f"missed ({fmt(r, 2)} > 0.20)",
        )
    )
