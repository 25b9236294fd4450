"""The accuracy part of the codecs section: the demo's job trained with each codec and
seed, its final validation loss against full precision's, and the first seed's curves."""

import json
import os
import statistics

from reporting.formatting import fmt
from reporting.loss_curves import loss_curves_svg

CODECS = [
    ("none", "fp32"),
    ("int8", "int8 + int8"),
    ("int8-ef", "int8 + int8, error feedback"),
    ("fp8", "fp8 + fp8"),
    ("fp8-int8", "fp8 weights + int8 gradients"),
]


def read_metrics(path):
    records = []
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    return records


class Accuracy:
    """The accuracy runs' outcomes: final validation loss per codec and seed, the first
    seed's curves, each codec's run times, and the runs that failed."""

    def __init__(self, runs):
        self.seeds = sorted({r.get("seed", 0) for r in runs})
        self.final, self.curves, self.seconds = {}, {}, {}  # final[codec][seed]
        self.failures = []
        for r in runs:
            codec, seed = r["variant"], r.get("seed", 0)
            records = read_metrics(r["metrics"])
            validation = [m["validation_loss"] for m in records if "validation_loss" in m]
            if r.get("error") or not validation:
                self.failures.append(
                    f"{codec} seed {seed}: {r.get('error') or 'no metrics in ' + r['metrics']}"
                )
                continue
            self.final.setdefault(codec, {})[seed] = validation[-1]
            self.seconds.setdefault(codec, []).append(r.get("seconds", 0))
            if seed == self.seeds[0]:
                self.curves[codec] = records
        self.present = [(codec, title) for codec, title in CODECS if self.final.get(codec)]
        self.full = self.final.get("none", {})


def write(rep, args, runs):
    """Final validation loss of each codec and seed, its mean over the seeds against full
    precision's, and the first seed's curves."""
    if not runs:
        return
    acc = Accuracy(runs)
    method_text(rep, acc)
    seeds_table(rep, acc)
    relative, spread = means_table(rep, acc)
    if len(acc.full) > 1:
        low, high = min(acc.full.values()), max(acc.full.values())
        rep.p(
            f"Full precision alone ends between {fmt(low, 4)} and {fmt(high, 4)} over these seeds "
            f"({fmt(100 * (high / low - 1), 2)}% apart): one run's difference to another is mostly "
            "the seed's, and only a mean over seeds says what a codec costs."
        )
        rep.p()
    if acc.failures:
        rep.p("Failed: " + "; ".join(acc.failures) + ".")
        rep.p()
    svg = os.path.join(os.path.dirname(args.out), "codecs_loss.svg")
    named = [(title, acc.curves[codec]) for codec, title in CODECS if codec in acc.curves]
    if loss_curves_svg(named, svg):
        rep.p(
            f"![training and validation loss with full-precision and quantized collectives, seed {acc.seeds[0]}](codecs_loss.svg)"
        )
        rep.p()
    targets(rep, acc, relative, spread)


def method_text(rep, acc):
    rep.p(
        "**Accuracy.** The demo's job (`make demo`'s corpus and defaults: 500 steps) on 4 "
        "ranks with a 1x4 mesh, so that every collective is quantized "
        "(`train_decoder --mesh 1x4 --seed S --eval-batches 100000 [--ag-codec C "
        "--rs-codec C [--error-feedback]]`), "
        f"once per seed ({', '.join(str(s) for s in acc.seeds)}; `BENCH_ACCURACY_SEEDS`). The seed "
        "draws the initial weights and the order of the batches; every run validates on the "
        "whole validation split, and all runs read one copy of the corpus (the repository's "
        "own text, so the losses move from one commit to the next). Each cell is the "
        "final validation loss and, in parentheses, its difference to the full-precision run "
        "of the same seed:"
    )
    rep.p()


def seeds_table(rep, acc):
    rep.p("| seed | " + " | ".join(title for _, title in acc.present) + " |")
    rep.p("|---:|" + "---:|" * len(acc.present))
    for s in acc.seeds:
        cells = []
        for codec, _ in acc.present:
            loss = acc.final[codec].get(s)
            if loss is None:
                cells.append("–")
            elif codec == "none" or s not in acc.full:
                cells.append(fmt(loss, 4))
            else:
                cells.append(f"{fmt(loss, 4)} ({100 * (loss / acc.full[s] - 1):+.2f}%)")
        rep.p(f"| {s} | " + " | ".join(cells) + " |")
    rep.p()


def means_table(rep, acc):
    """Each codec's mean over the seeds and its per-seed differences; returns the mean's
    relative difference to full precision's and the standard error of the differences,
    per codec."""
    p, seeds, full = rep.p, acc.seeds, acc.full
    p(
        "Over the seeds: the mean final loss against full precision's, and the per-seed "
        "differences (mean ± standard error; a codec's cost is resolved to about twice the "
        "standard error):"
    )
    p()
    p(
        "| collectives | mean loss | mean / full precision | per-seed difference | seeds worse | run s |"
    )
    p("|---|---:|---:|---:|---:|---:|")
    full_mean = sum(full.values()) / len(full) if len(full) == len(seeds) else None
    relative, spread = {}, {}
    for codec, title in acc.present:
        losses = acc.final[codec]
        mean = sum(losses.values()) / len(losses) if len(losses) == len(seeds) else None
        if mean is not None and full_mean is not None:
            relative[codec] = mean / full_mean - 1
        paired = [losses[s] / full[s] - 1 for s in seeds if s in losses and s in full]
        difference = worse = "–"
        if codec != "none" and len(paired) > 1:
            spread[codec] = statistics.stdev(paired) / len(paired) ** 0.5
            difference = f"{100 * statistics.mean(paired):+.2f}% ± {100 * spread[codec]:.2f}%"
            worse = f"{sum(d > 0 for d in paired)} of {len(paired)}"
        seconds = acc.seconds[codec]
        p(
            f"| {title} | **{fmt(mean, 4)}** | "
            f"{fmt(mean / full_mean if mean and full_mean else None, 4)} | {difference} | "
            f"{worse} | {fmt(sum(seconds) / len(seconds), 0)} |"
        )
    p()
    return relative, spread


def targets(rep, acc, relative, spread):
    """Each codec's mean validation loss within 1% of full precision's."""
    for codec in ("int8", "int8-ef", "fp8", "fp8-int8"):
        if codec in relative:
            rel = relative[codec]
            verdict = (
                "met"
                if abs(rel) <= 0.01
                else ("outside 1%, but lower (better) than full precision" if rel < 0 else "missed")
            )
            error = f" (± {fmt(100 * spread[codec], 2)}%)" if codec in spread else ""
            rep.target(
                (
                    f"quantized: {codec} validation loss within 1% of full precision, "
                    f"mean of {len(acc.seeds)} seeds",
                    f"{'+' if rel >= 0 else ''}{fmt(100 * rel, 2)}%{error}",
                    verdict,
                )
            )
