"""Bandwidth-limited run (bench/run.sh section netns): 2 ranks in network namespaces whose
link is shaped to a fixed rate, so that communication waits on the link and overlap can
show; each variant's overlap efficiency against the serial communication of its messages."""

import os

from reporting.formatting import at_least, fmt, step_cell
from reporting.results import fwd_bwd, ok

TITLE = "Bandwidth-limited run"
TARGETS = ("overlap efficiency",)

LABEL = "netns/d128L8/1x2"


def overlap_efficiency(t_comm, t_compute, t):
    """(T_comm + T_compute - T) / min(T_comm, T_compute): 1 when the shorter of the two is
    hidden completely, 0 when they ran one after the other."""
    return (t_comm + t_compute - t) / min(t_comm, t_compute)


def write(rep, args):
    if not rep.has(LABEL):
        return
    rep.section(TITLE)
    method(rep, args)
    effs = table(rep)
    phases(rep)
    if os.path.exists(os.path.join(os.path.dirname(args.out), "timeline_bandwidth_limited.svg")):
        rep.p(
            "The last timed step of `hp comm_fusion` on rank 1, recorded with `hp_bench "
            "--trace` (pale: a collective in flight, dark: the main thread waiting for it):"
        )
        rep.p()
        rep.p("![timeline of the bandwidth-limited run](timeline_bandwidth_limited.svg)")
        rep.p()
    for src, variant, eff in effs:
        if src == "C++":
            rep.target(
                (
                    f"overlap efficiency >= 0.8, bandwidth-limited, `{variant}`",
                    fmt(eff, 2),
                    at_least(eff, 0.8),
                )
            )


def method(rep, args):
    rep.p(
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
    rep.p()


def table(rep):
    """The table of every variant; returns (source, variant, overlap efficiency) of those
    that have one."""
    rep.p(
        "| variant | fwd ms | bwd ms | step ms (p25–p75) | CPU ms | exposed comm ms | overlap efficiency |"
    )
    rep.p("|---|---:|---:|---:|---:|---:|---:|")
    comm_gloo = rep.find(LABEL, "C++", "comm:keep+gloo")
    # Each variant against the serial communication of its own messages.
    comm_of = {
        (False, False): rep.find(LABEL, "C++", "comm"),
        (True, False): rep.find(LABEL, "C++", "comm:keep"),
        (False, True): rep.find(LABEL, "C++", "comm:fusion"),
        (True, True): rep.find(LABEL, "C++", "comm:fusion+keep"),
    }
    effs = []
    for src, variant, title, r in rep.rows(LABEL, columns=7):
        t_comp = fwd_bwd(rep.find(LABEL, src, "local"))
        if src == "Python":
            t_comm = fwd_bwd(comm_gloo)
        else:
            one_per_module = "fusion" in variant and "bucket" not in variant
            t_comm = fwd_bwd(comm_of[("keep" in variant, one_per_module)])
        exposed = eff = None
        if not variant.startswith(("local", "comm")) and t_comp:
            exposed = fwd_bwd(r) - t_comp
            if variant != "ddp" and t_comm:
                eff = overlap_efficiency(t_comm, t_comp, fwd_bwd(r))
                effs.append((src, variant, eff))
        rep.p(
            f"| {title} | {fmt(r['fwd_ms'])} | {fmt(r['bwd_ms'])} | {step_cell(r)} | "
            f"{fmt(r.get('cpu_ms'))} | {fmt(exposed)} | {fmt(eff, 2)} |"
        )
    rep.p()
    return effs


def phases(rep):
    """Compute against communication per phase, and the CPU that communication takes."""
    comm, hl = rep.find(LABEL, "C++", "comm"), rep.find(LABEL, "C++", "local")
    if not (ok(comm) and ok(hl)):
        return
    rep.p(
        f"Per phase: forward compute {fmt(hl['fwd_ms'])} ms vs forward communication "
        f"{fmt(comm['fwd_ms'])} ms; backward compute {fmt(hl['bwd_ms'])} ms vs backward "
        f"communication {fmt(comm['bwd_ms'])} ms (RAF=true). Communication alone keeps "
        f"the CPU busy for {fmt(comm.get('cpu_ms'))} ms of its {fmt(comm['step_ms'])} ms "
        "step: that part is work on the cores that compute, which overlap cannot hide."
    )
    rep.p()
