"""The document from the sections' lines: whole, or, for a partial run (bench/run.sh
--only), the old document with only the rerun sections and target rows replaced."""

from reporting.formatting import table_row
from sections import SECTIONS


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
            kept = [
                l
                for l in lines
                if not l.startswith("| ")
                or l.startswith("| target |")
                or rep.target_section(l[2:]) not in only
            ]
            at = max(i for i, l in enumerate(kept) if l.startswith("|")) + 1
            kept[at:at] = [table_row(t[1:]) for t in rep.targets if t[0] in only]
            out += kept
        elif owner in only:
            out += rep.sections.get(title, [])
        else:
            out += old.get(title, [])
    return "\n".join(out).rstrip() + "\n"
