"""bench/run.sh's results (one JSON object per line) and the report being written from
them: its sections' lines, its target rows and the lookups every section uses."""

import json
import sys

# (source, variant) -> row title, in table order.
ROWS = [
    ("C++", "local", "compute only, no communication (C++)"),
    ("C++", "comm", "communication only, serial, RAF=true (C++)"),
    ("C++", "comm:keep", "communication only, serial, RAF=false (C++)"),
    ("C++", "comm:keep+gloo", "communication only, serial, RAF=false, Gloo reduce-scatter (C++)"),
    ("C++", "comm:fusion", "communication only, serial, one collective per module, RAF=true (C++)"),
    (
        "C++",
        "comm:fusion+keep",
        "communication only, serial, one collective per module, RAF=false (C++)",
    ),
    ("C++", "ddp", "DDP baseline: replicated, one flat all-reduce"),
    ("C++", "hp", "hp per-param, prefetch, RAF=true (defaults)"),
    ("C++", "hp:fusion", "hp comm_fusion, prefetch, RAF=true"),
    ("C++", "hp:nopf", "hp per-param, no prefetch, RAF=true"),
    ("C++", "hp:keep", "hp per-param, prefetch, RAF=false"),
    ("C++", "hp:fusion+keep", "hp comm_fusion, prefetch, RAF=false"),
    ("C++", "hp:fusion+bucket", "hp comm_fusion in 128 KiB buckets, prefetch, RAF=true"),
    ("C++", "hp:fusion+keep+bucket", "hp comm_fusion in 128 KiB buckets, prefetch, RAF=false"),
    ("C++", "hp:fusedopt", "hp per-param, prefetch, RAF=true, hp::FusedAdamW"),
    ("Python", "local", "compute only, no communication (Python)"),
    ("Python", "fsdp2", "FSDP2 defaults, RAF=false"),
    ("Python", "fsdp2:prefetch", "FSDP2 + async unshard + forward prefetch, RAF=false"),
    ("Python", "hyperparallel", "hyperparallel.fully_shard per parameter, RAF=false"),
    ("Python", "hyperparallel:raf", "hyperparallel.fully_shard per parameter, RAF=true"),
    (
        "Python",
        "hyperparallel:fusion",
        "hyperparallel.fully_shard defaults (comm_fusion), RAF=false",
    ),
    (
        "Python",
        "hyperparallel:int8",
        "hyperparallel.fully_shard per parameter, int8 codecs, RAF=false",
    ),
    (
        "Python",
        "hyperparallel:fusion+int8",
        "hyperparallel.fully_shard, comm_fusion, int8 codecs, RAF=false",
    ),
]


def source(r):
    return "Python" if r.get("impl") in ("py", "fsdp2", "fsdp2_bench", "hyperparallel") else "C++"


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


def ok(r):
    return r is not None and not r.get("error") and r.get("step_ms") is not None


def fwd_bwd(r):
    return r["fwd_ms"] + r["bwd_ms"] if ok(r) else None


class Report:
    def __init__(self, results, target_section):
        self.results = [r for r in results if "meta" not in r]
        # run.sh's line per section: its command, duration and load
        self.meta = {r["meta"]: r for r in results if "meta" in r}
        self.sections = {}  # title -> lines
        self.lines = None
        self.targets = []  # (section, what, measured, verdict)
        self.target_section = target_section  # a target row's text -> its run.sh section

    def section(self, title):
        """Starts section `title` (None: the document's title); p() writes into it."""
        self.lines = self.sections.setdefault(title, [])
        self.lines.append(f"## {title}" if title else "# Performance")
        self.lines.append("")

    def p(self, text=""):
        self.lines.append(text)

    def target(self, row):
        """A row (what, measured, verdict) of the targets table."""
        section = self.target_section(row[0])
        assert section, f"target row '{row[0]}' matches no section's TARGETS"
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
        for r in self.run_failures(label):
            self.p(f"| {prefix}a run of {r.get('impl')} | failed: {r.get('error')} {pad}")

    def run_failures(self, label):
        """The runs under `label` that ended without results (bench/run.sh records their
        exit and last line)."""
        return [r for r in self.results if r.get("label") == label and r.get("variant") == "(run)"]

    def runs(self, prefix):
        """The results whose label starts with `prefix`: one run.sh section's."""
        return [r for r in self.results if r.get("label", "").startswith(prefix)]

    def has(self, label):
        return any(r.get("label") == label for r in self.results)

    def find(self, label, src, variant):
        for r in self.results:
            if r.get("label") == label and source(r) == src and r.get("variant") == variant:
                return r
        return None

    def best(self, label, src, variants):
        rows = [r for v in variants if ok(r := self.find(label, src, v))]
        return min(rows, key=lambda r: r["step_ms"]) if rows else None

    def failed(self, runs):
        """A paragraph for each of `runs` that failed."""
        for r in runs:
            if r.get("error"):
                self.p(f"`{r['label']}` failed: {r['error']} (see `build/bench/results/log.txt`).")
                self.p()

    def made_by(self, section):
        """A sentence naming the command, duration and load of a run.sh section."""
        meta = self.meta.get(section)
        if not meta:
            return ""
        sec = meta["seconds"]
        return (
            f"Made by `{meta['command']}` ({sec // 60} min {sec % 60} s; load average "
            f"{meta['load_before']} before, {meta['load_after']} after)."
        )
