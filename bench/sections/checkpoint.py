"""Checkpoint saves (bench/run.sh section checkpoint): how long a save blocks training,
synchronous against async with each staging (fork, copy), on 4 ranks."""

import os
import statistics

from reporting.formatting import fmt, ms_list, ratio

TITLE = "Checkpoint saves"
TARGETS = ("async save blocks",)

# The async stagings of hp_bench --checkpoint, in table order (the default last).
ASYNC_STAGINGS = ("fork", "copy")


def write(rep, args):
    runs = rep.runs("checkpoint/")
    if not runs:
        return
    rep.section(TITLE)
    r = next((r for r in runs if not r.get("error") and r.get("variant") == "checkpoint"), None)
    if r is None:
        rep.p(f"The run failed: {runs[0].get('error')} (see `build/bench/results/log.txt`).")
        rep.p()
        return
    stagings = [(s, r["async"][s]) for s in ASYNC_STAGINGS if s in r.get("async", {})]
    setup_text(rep, r)
    protocol_text(rep, r)
    table(rep, r, stagings)
    per_save_text(rep, r, stagings)
    if not (r.get("sync_blocked_ms") and r.get("step_ms")):
        return
    rep.p(
        f"The synchronous save writes {fmt(r['checkpoint_mib'] / (r['sync_blocked_ms'] / 1000), 0)}"
        f" MiB/s over all ranks (flushed to disk), about {fmt(mib_per_rank(r), 0)} MiB per rank."
    )
    rep.p()
    costs = {}
    for name, a in stagings:
        if not a.get("blocked_ms"):
            continue
        text = fork_text(r, a) if name == "fork" else copy_text(r, a)
        during, costs[name] = during_write_text(r, name, r["saves"])
        rep.p(text + during)
        rep.p()
    if costs:
        costs_text(rep, r, costs)
    targets(rep, r, stagings)


def setup_text(rep, r):
    m, n = r["model"], r["world"]
    rep.p(
        f"How long a training step is blocked by a checkpoint save, synchronous "
        f"(`hp::save_sharded_checkpoint`) against background (`hp::AsyncCheckpointSaver`, "
        f"both stagings): the Peak RSS section's model (dim {m['dim']}, "
        f"**{m['layers']} blocks**, {r['params'] / 1e6:.1f} M parameters, {m['batch']} "
        f"sequence of {m['seq']} tokens per rank) fully_shard-ed on **{n} ranks** (mesh "
        f"{r['mesh']}, deferred init), AdamW. A checkpoint holds the parameters and both AdamW "
        f"moments: **{fmt(r['checkpoint_mib'], 0)} MiB** on disk, each rank writing its "
        "quarter (`hp_bench --checkpoint`, into the build directory, one checkpoint at a time, "
        "removed after each save). " + rep.made_by("checkpoint")
    )
    rep.p()


def protocol_text(rep, r):
    """How the saves are made and timed, and what each column counts."""
    rep.p(
        f"After {r['warmup']} warm-up step(s) and {r['plain_steps']} steps without saving, "
        f"each kind saves {r['saves']} + 1 times, each save after a training step and a barrier; "
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
    rep.p()


def table(rep, r, stagings):
    rep.p(
        "| async staging | step ms, no save | sync save blocks ms | async `save()` blocks ms "
        "| async write ms, training alongside | async write ms, alone | step ms during write "
        "| async / sync blocked |"
    )
    rep.p("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, a in stagings:
        share = ratio(a["blocked_ms"], r["sync_blocked_ms"])
        rep.p(
            f"| `{name}`{' (default)' if name == 'copy' else ''} | {fmt(r['step_ms'])} | "
            f"**{fmt(r['sync_blocked_ms'])}** ({fmt(r['sync_blocked_rank0_ms'])}) | "
            f"**{fmt(a['blocked_ms'])}** ({fmt(a['blocked_rank0_ms'])}) | "
            f"{fmt(a['write_ms'])} | {fmt(a['alone_ms'])} | "
            f"{fmt(a['during_write_step_ms'])} | **{fmt(share, 3)}** |"
        )
    rep.p()


def mib_per_rank(r):
    return r["checkpoint_mib"] / r["world"]


def per_save_text(rep, r, stagings):
    """Every save's times, the first (which sets up what later saves reuse) apart."""
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
    rep.p(
        text + ". The first async save of a saver also makes the writer's process group "
        "(and, `copy`, allocates the staging memory, which later saves reuse). Steps "
        f"without saving took {fmt(min(steps), 0)}–{fmt(max(steps), 0)} ms."
    )
    rep.p()


def fork_text(r, a):
    """What a `fork` save costs: the fork itself, then the copy-on-write page faults."""
    page_kib = r.get("page_kib", 4)
    # The baseline: the same window of a copy save (no copy-on-write), scaled to the
    # steps it held; the mean step's count without it (raised by the first steps'
    # first-touch faults).
    copy = r["async"].get("copy")
    if copy and copy.get("during_write_steps"):
        base = copy["write_faults"] * a["during_write_steps"] / copy["during_write_steps"]
        base_text = "in the same window of a `copy` save (no copy-on-write)"
    else:
        base = r["step_faults"] * a["during_write_steps"] / r["saves"]
        base_text = "for as many steps without a write"
    extra_faults = max(a["write_faults"] - base, 0)
    return (
        f"**`fork`**: `save()` forks a process of {fmt(a['rss_mib'], 0)} MiB RSS (the "
        f"slowest rank's, just before the save) in {fmt(a['blocked_ms'])} ms. From "
        f"`save()` to the end of its write the training process took "
        f"{fmt(a['write_faults'], 0)} minor page faults per save (slowest rank), "
        f"against {fmt(base, 0)} {base_text}; the {fmt(extra_faults, 0)} more are the "
        f"copy-on-write copies (about {fmt(extra_faults * page_kib / 1024, 0)} MiB "
        f"per rank if each copies one {fmt(page_kib, 0)} KiB page: any page training "
        f"writes to counts, not only those of the {fmt(mib_per_rank(r), 0)} MiB of pieces). "
        "These copies and the writer process's work (serializing, CRC, writing and "
        "flushing the file, on the same cores) land on the steps during the write, "
        "not in `save()`. "
    )


def copy_text(r, a):
    """What a `copy` save costs: copying the pieces into staging memory."""
    return (
        f"**`copy`**: `save()` copies about {fmt(mib_per_rank(r), 0)} MiB per rank into "
        "staging memory, at "
        f"{fmt(r['checkpoint_mib'] / (a['blocked_ms'] / 1000), 0)} MiB/s over all "
        f"ranks ({r['world']} ranks copying at once on {os.cpu_count()} cores). The "
        "ratio of its blocked time to the synchronous one is the ratio of these rates: "
        "the faster the disk takes the checkpoint, the higher it is. "
    )


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


def costs_text(rep, r, costs):
    """What an async save of each staging costs training in total, against a synchronous one."""
    rep.p(
        "What an async save costs training in total per save (`save()` plus the slowdown "
        "of the steps during its write): "
        + "; ".join(
            f"`{name}` about {fmt(c, 0)} ms"
            if c is not None
            else f"`{name}` only its "
            f"`save()`, {fmt(r['async'][name]['blocked_ms'], 0)} ms (no slowdown measured)"
            for name, c in costs.items()
        )
        + f"; a synchronous save {fmt(r['sync_blocked_ms'], 0)} ms."
    )
    rep.p()


def targets(rep, r, stagings):
    """The default staging against the 10% bound; fork's share for information."""
    for name, a in stagings:
        share = ratio(a["blocked_ms"], r["sync_blocked_ms"])
        if share is None:
            continue
        measured = f"{fmt(a['blocked_ms'])} vs {fmt(r['sync_blocked_ms'])} ms = {share * 100:.1f}%"
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
