"""The sections of docs/performance.md. Each bench/run.sh section has a module of its
name here, next to the others that measure: it writes its part of the document (text and
tables) and its rows of the targets table. A measured section's module has TITLE (its ##
heading), TARGETS (how the texts of its target rows start, so that a partial run can tell
its rows from the others') and write(rep, args). introduction and conclusion write the
parts that only a full run rewrites."""

from sections import (
    beyond,
    checkpoint,
    codecs,
    conclusion,
    introduction,
    memory,
    netns,
    overhead,
    pipeline,
    python,
    recompute,
    steps,
)

# The run.sh sections, in the order of the document.
MEASURED = (
    steps,
    memory,
    beyond,
    overhead,
    netns,
    checkpoint,
    pipeline,
    recompute,
    codecs,
    python,
)


def run_sh_section(module):
    """The bench/run.sh section a module writes: its name."""
    return module.__name__.rpartition(".")[2]


# The sections of the document, in order, and the bench/run.sh section that writes each
# ("common": only a full run rewrites it).
SECTIONS = (
    [(title, "common") for title in introduction.TITLES]
    + [(module.TITLE, run_sh_section(module)) for module in MEASURED]
    + [(title, "common") for title in conclusion.TITLES]
)
# Which run.sh section a row of the targets table belongs to, by how its text starts.
TARGET_PREFIXES = {run_sh_section(module): module.TARGETS for module in MEASURED if module.TARGETS}


def target_section(text):
    return next((s for s, pre in TARGET_PREFIXES.items() if text.startswith(pre)), None)
