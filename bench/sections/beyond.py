"""Bigger than one rank (bench/run.sh section beyond): a model whose training state exceeds
one rank's memory limit trains sharded on 4 ranks and fails unsharded."""

from reporting.formatting import MIB, fmt
from sections.memory import rss_ok, rss_summary

TITLE = "Bigger than one rank"
TARGETS = ("bigger than one rank",)


def write(rep, args):
    runs = rep.runs("beyond/")
    if not runs:
        return
    rep.section(TITLE)
    sharded = next((r for r in runs if r["label"].endswith("/1x4")), None)
    plain = next((r for r in runs if r["label"].endswith("/1x1")), None)
    ref = next((r for r in runs if r.get("params")), None)
    limit = next((r["rlimit_data_mib"] for r in runs if r.get("rlimit_data_mib")), None)
    if ref:
        model_text(rep, ref, limit)
    rep.p(
        "The limit is **RLIMIT_DATA**, set on each rank's process by `prlimit --data=BYTES` "
        "(bench/run.sh, section `beyond`; every rank reports the limit it ran under, "
        "`getrlimit`): the kernel refuses to map private writable memory beyond it (heap, "
        "`mmap`'d tensors, thread stacks), so an allocation past it fails in the allocator. "
        "It counts every private writable mapping whether its pages are resident or not "
        "(file-backed pages such as the libraries' code are not counted, unlike in RSS). "
        "cgroup v2 `memory.max` was not used: this build root does not mount "
        "/sys/fs/cgroup, and the host's memory controller is cgroup v1."
    )
    rep.p()
    table(rep, sharded, plain)
    if ref and limit:
        target(rep, sharded, plain, ref, limit)


def model_text(rep, ref, limit):
    m = ref["model"]
    state = 16 * ref["params"] / MIB
    rep.p(
        f"A model whose full fp32 training state does not fit one rank's memory limit: "
        f"dim {m['dim']}, {m['layers']} blocks, {m['heads']} heads, ffn {m['ffn']}, "
        f"vocabulary {m['vocab']}, **{ref['params'] / 1e6:.1f} M parameters, "
        f"{state:.0f} MiB of training state** (16 bytes per parameter), against a limit of "
        f"**{fmt(limit, 0)} MiB per rank**. {m['batch']} sequence of {m['seq']} tokens "
        "per rank, AdamW. " + rep.made_by("beyond")
    )
    rep.p()


def table(rep, sharded, plain):
    rep.p(
        "| run | ranks | result | peak RSS MiB (max rank) | above baseline MiB "
        "| loss (rank 0, last step) |"
    )
    rep.p("|---|---:|---|---:|---:|---:|")
    for r, what in ((sharded, "fully_shard, deferred init"), (plain, "not sharded, eager build")):
        if r is None:
            continue
        if rss_ok(r):
            peak, _, above, _ = rss_summary(r)
            rep.p(
                f"| {what} | {r.get('world')} | trained "
                f"{r.get('warmup', 0) + r.get('steps', 0)} steps | "
                f"{fmt(peak)} | {fmt(above)} | {fmt(r.get('loss'), 3)} |"
            )
        else:
            ranks = r["label"].rsplit("x", 1)[-1]
            rep.p(f"| {what} | {ranks} | failed: {r.get('error')} | – | – | – |")
    rep.p()


def target(rep, sharded, plain, ref, limit):
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
