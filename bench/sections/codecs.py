"""Quantized collectives (bench/run.sh section codecs): bytes sent and step time of int8
and fp8 all-gathers and reduce-scatters against full precision, on loopback, on the
bandwidth-limited link and on two "nodes" with the secondary partition; their accuracy is
in codecs_accuracy."""

from reporting.formatting import at_least, at_most, fmt, ratio, step_cell
from reporting.results import fwd_bwd, ok
from sections import codecs_accuracy
from sections.netns import overlap_efficiency

TITLE = "Quantized collectives"
TARGETS = ("quantized", "comm_fusion overlap")

LOOPBACK, NETNS = "codecs/loopback/d128L8/1x2", "codecs/netns/d128L8/1x2"
NODES = "codecs/nodes/d128L8/1x4"

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
    (
        "hp:fusion+bucket+int8ag+int8rs",
        "comm:int8ag+int8rs",
        "int8 + int8, comm_fusion in 128 KiB buckets",
    ),
]
NODE_ROWS = [
    ("hp", "full precision, reshard_after_forward = true"),
    ("hp:raf2", "full precision, secondary partition (reshard_after_forward = 2)"),
    ("hp:int8ag+int8rs", "int8 + int8"),
    ("hp:int8ag+int8rs+raf2", "int8 + int8, secondary partition"),
]
# The quantized variants the targets judge, each with its full-precision peer and name.
QUANTIZED = (
    ("hp:int8ag+int8rs", "hp", "per parameter"),
    ("hp:fusion+int8ag+int8rs", "hp:fusion", "comm_fusion"),
)


def zero3_bytes(r):
    """fp32 ZeRO-3's bytes sent per rank and step: two all-gathers and one reduce-scatter
    of every parameter, (n - 1) / n of each."""
    n = r["world"]
    return 3 * r["params"] * 4 * (n - 1) / n


def write(rep, args):
    runs = rep.runs("codecs/")
    if not runs:
        return
    rep.section(TITLE)
    p = rep.p
    base = rep.find(LOOPBACK, "C++", "hp")
    p(
        "`hp::CommPolicy` (api.md, `policy.h`): the weight all-gathers and gradient "
        "reduce-scatters move int8 or fp8 blocks of 256 values with one fp32 scale each "
        "instead of fp32 values; the optimizer still steps the fp32 shards. The model of the "
        f"bandwidth-limited run (dim 128, 8 layers, 4 sequences of 64 tokens per rank; "
        f"{fmt(base['params'] / 1e6, 2) if ok(base) else '?'} M parameters), 2 ranks, "
        f"{args.netns_steps} timed steps. Bytes are what each rank sent in a step, counted by "
        "`hp::wire_bytes()` (as ring and pairwise algorithms move them), against fp32 ZeRO-3's "
        "3 x parameters x 4 bytes x (n-1)/n. " + rep.made_by("codecs")
    )
    p()
    p("**Loopback** (CPU-bound: Gloo's copies run on the cores that compute):")
    p()
    codec_table(rep, LOOPBACK)
    fsdp2 = rep.find(NETNS, "Python", "fsdp2")
    if rep.has(NETNS):
        p(f"**Bandwidth-limited** ({args.rate} per rank, the netns section's set-up):")
        p()
        codec_table(rep, NETNS, fsdp2 if ok(fsdp2) else None)
    else:
        p("The bandwidth-limited part did not run (BENCH_NETNS=0 or no network namespaces).")
        p()
    codec_overlap(rep, NETNS)
    if rep.has(NODES):
        nodes(rep, args)
    when_to_turn_on(rep)
    targets(rep, fsdp2)
    codecs_accuracy.write(rep, args, [r for r in runs if r.get("label") == "codecs/accuracy"])


def codec_table(rep, label, fsdp2=None, rows=CODEC_ROWS):
    """Bytes and step time of `rows` under `label`, with FSDP2's step for reference."""
    find = rep.find
    base = find(label, "C++", "hp")
    failed_cells = " | | | |" + (" |" if fsdp2 else "")

    def vs_full_precision(r):
        return fmt(ratio(r["step_ms"], base["step_ms"]) if ok(base) else None, 2)

    rep.p(
        "| variant | KiB sent per step and rank | / fp32 ZeRO-3 | step ms (p25–p75) | / full precision |"
        + (" / FSDP2 |" if fsdp2 else "")
    )
    rep.p("|---|---:|---:|---:|---:|" + ("---:|" if fsdp2 else ""))
    for variant, title in rows:
        r = find(label, "C++", variant)
        if r is None:
            continue
        if not ok(r):
            rep.p(f"| {title} | failed: {r.get('error')}{failed_cells}")
            continue
        kib = r["wire_bytes_per_step"] / 1024
        row = (
            f"| {title} | {fmt(kib, 0)} | {fmt(r['wire_bytes_per_step'] / zero3_bytes(r), 3)} | "
            f"{step_cell(r)} | {vs_full_precision(r)} |"
        )
        if fsdp2:
            row += f" {fmt(ratio(r['step_ms'], fsdp2['step_ms']), 2)} |"
        rep.p(row)
    if fsdp2:
        rep.p(
            f"| FSDP2 defaults (Python, for reference) | – | – | {step_cell(fsdp2)} | "
            f"{vs_full_precision(fsdp2)} | 1.00 |"
        )
    for r in rep.run_failures(label):
        rep.p(f"| a run of {r.get('impl')} | failed: {r.get('error')}{failed_cells}")
    rep.p()


def codec_overlap(rep, label):
    """Overlap efficiency of the bandwidth-limited codec runs (as in the netns section), each
    against the communication-only run of its own bytes, with a target for comm_fusion."""
    t_comp = fwd_bwd(rep.find(label, "C++", "local"))
    rows = []
    for variant, comm_variant, title in CODEC_OVERLAP_ROWS:
        r, comm = rep.find(label, "C++", variant), rep.find(label, "C++", comm_variant)
        t_comm = fwd_bwd(comm)
        if not (ok(r) and t_comp and t_comm):
            continue
        rows.append(
            (variant, title, t_comm, fwd_bwd(r), overlap_efficiency(t_comm, t_comp, fwd_bwd(r)))
        )
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
            rep.target(
                (
                    f"comm_fusion overlap efficiency >= 0.85, bandwidth-limited, {what}",
                    fmt(eff, 2),
                    at_least(eff, 0.85),
                )
            )
    p()
    message_sizes(rep, label)


def message_sizes(rep, label):
    """The same bytes as one message per parameter and as one per module."""
    per_param, per_module = rep.find(label, "C++", "comm"), rep.find(label, "C++", "comm:fusion")
    if ok(per_param) and ok(per_module):
        rep.p(
            f"In full precision the same bytes take {fmt(fwd_bwd(per_param))} ms as one message "
            f"per parameter and {fmt(fwd_bwd(per_module))} ms as one per module: on this link a "
            "module's whole message runs below the link's rate, and comm_fusion's step is bound "
            "by that, not by waiting on compute. Buckets (`comm_fusion_bucket_bytes`) send "
            "parameter-sized messages again."
        )
        rep.p()


def nodes(rep, args):
    """The secondary partition on two bandwidth-limited "nodes" of two ranks."""
    local = rep.find(NODES, "C++", "local")
    rep.p(
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
    rep.p()
    codec_table(rep, NODES, rows=NODE_ROWS)


def when_to_turn_on(rep):
    """int8's gain where the link bounds the step, against its cost on loopback."""
    speedups = []
    for variant, full, _ in QUANTIZED:
        lq, lf = rep.find(LOOPBACK, "C++", variant), rep.find(LOOPBACK, "C++", full)
        nq, nf = rep.find(NETNS, "C++", variant), rep.find(NETNS, "C++", full)
        if all(ok(r) for r in (lq, lf, nq, nf)):
            speedups.append((full, lq["step_ms"] / lf["step_ms"], nf["step_ms"] / nq["step_ms"]))
    if not speedups:
        return

    def mode(full):
        return "fused" if "fusion" in full else "per parameter"

    rep.p(
        "**When to turn them on.** Where the link bounds the step, the bytes are the cost: "
        + "; ".join(
            f"{mode(full)}, int8 weights and "
            f"gradients make the bandwidth-limited step {fmt(gain, 2)}x faster"
            for full, _, gain in speedups
        )
        + ". On loopback, where communication is memcpy on the cores that compute, the "
        "codecs trade copies for quantizing on the same cores: "
        + "; ".join(f"{mode(full)} step x {fmt(cost, 2)}" for full, cost, _ in speedups)
        + " (per parameter, quantized parameters also travel one collective per module "
        "instead of one per parameter). Turn them on when a step in full precision takes "
        "well over its compute alone (multi-node jobs, commodity networks); on one machine "
        "what they save is small, and what they cost in accuracy is measured below."
    )
    rep.p()


def targets(rep, fsdp2):
    """int8's bytes, its step cost on loopback, its step on the link against full precision
    and against FSDP2."""
    int8 = rep.find(LOOPBACK, "C++", "hp:int8ag+int8rs")
    if ok(int8):
        share = int8["wire_bytes_per_step"] / zero3_bytes(int8)
        rep.target(
            (
                "quantized: int8 AG + RS bytes per step <= 0.3x fp32 ZeRO-3",
                fmt(share, 3),
                at_most(share, 0.3, 3),
            )
        )
    for variant, full, name in QUANTIZED:
        quantized, plain = rep.find(LOOPBACK, "C++", variant), rep.find(LOOPBACK, "C++", full)
        if ok(quantized) and ok(plain):
            cost = quantized["step_ms"] / plain["step_ms"] - 1
            rep.target(
                (
                    f"quantized: loopback step cost of int8 AG + RS <= 10%, {name}",
                    f"{fmt(100 * cost, 1)}%",
                    "met" if cost <= 0.10 else f"missed by {fmt(100 * (cost - 0.10), 1)} points",
                )
            )
    for variant, full, name in QUANTIZED:
        n_int8, n_base = rep.find(NETNS, "C++", variant), rep.find(NETNS, "C++", full)
        if ok(n_int8) and ok(n_base):
            q = n_int8["step_ms"] / n_base["step_ms"]
            rep.target(
                (
                    f"quantized: bandwidth-limited int8 step <= 0.4x full precision, {name}",
                    fmt(q, 2),
                    at_most(q, 0.4),
                )
            )
        if ok(n_int8) and ok(fsdp2):
            q = n_int8["step_ms"] / fsdp2["step_ms"]
            rep.target(
                (
                    f"quantized: bandwidth-limited int8 step <= 0.3x FSDP2, {name}",
                    fmt(q, 2),
                    at_most(q, 0.3),
                )
            )
