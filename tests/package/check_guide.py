#!/usr/bin/env python3
"""Every code block of the guides (docs/api.md, docs/python.md) and of README.md is program text that is
built and run: a file the tests build, or an excerpt of one. The line directly above the
block's opening fence names the file:

    <!-- from examples/guide/checkpoint_resume.cpp -->
    ```cpp
    hp::materialize(*model);
    ```

The block's lines must appear in that file in a row, each shifted by the same indentation
(an excerpt of a loop body may be shown unindented). A line `// ...` or `# ...` alone
stands for lines left out: the parts between such lines appear in the file in this
order, each in a row. A whole file is its own excerpt.

Files that may be quoted: examples/ (built with the project, the guide's run as tests
guide.*) and tests/package/consumer/ (the package test builds it). Shell blocks (sh, bash,
console, shell) are exempt: they are commands, not program text.

Prints each block that does not hold; exit 1 if there is one.
Usage: check_guide.py SOURCE_DIR"""

import pathlib
import re
import sys

DOCUMENTS = ["docs/api.md", "docs/python.md", "README.md"]
QUOTABLE = ("examples/", "tests/package/consumer/")
EXEMPT = {"sh", "bash", "console", "shell"}
MARKER = re.compile(r"^<!-- from (\S+) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
ELISION = {"// ...", "# ..."}


def blocks(text):
    """(line number, language, marker line, block lines) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        yield i + 1, opening.group(1), lines[i - 1] if i else "", lines[i + 1 : end]
        i = end + 1


def parts(block):
    """The block split at its elision lines, each part without trailing blank lines."""
    result = [[]]
    for line in block:
        if line.strip() in ELISION:
            result.append([])
        else:
            result[-1].append(line.rstrip())
    return [part for part in result if any(line for line in part)]


def indent(line):
    return line[: len(line) - len(line.lstrip())]


def find(part, file_lines, start):
    """The index after the first place at or after `start` where `part` appears in a row,
    shifted by one indentation; None if nowhere."""
    for first in range(start, len(file_lines) - len(part) + 1):
        head = next(k for k, line in enumerate(part) if line)
        shift = file_lines[first + head]
        if not shift.endswith(part[head]):
            continue
        shift = shift[: len(shift) - len(part[head])]
        if shift.strip():
            continue
        if all(
            (file_lines[first + k] == shift + line) if line else not file_lines[first + k].strip()
            for k, line in enumerate(part)
        ):
            return first + len(part)
    return None


def check_block(root, document, number, language, marker, block):
    where = f"{document}:{number}"
    if language in EXEMPT:
        return None
    match = MARKER.match(marker.strip())
    if not match:
        return f"{where}: a ```{language} block without a <!-- from FILE --> line above it"
    source = match.group(1)
    if not source.startswith(QUOTABLE):
        return f"{where}: quotes {source}, which is not under {' or '.join(QUOTABLE)}"
    path = root / source
    if not path.is_file():
        return f"{where}: quotes {source}, which does not exist"
    file_lines = [line.rstrip() for line in path.read_text().splitlines()]
    position = 0
    for part in parts(block):
        after = find(part, file_lines, position)
        if after is None:
            shown = next(line for line in part if line).strip()
            return f"{where}: the lines from '{shown}' do not appear in a row in {source}" + (
                " after the part before them" if position else ""
            )
        position = after
    return None


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    problems, count = [], 0
    for document in DOCUMENTS:
        for number, language, marker, block in blocks((root / document).read_text()):
            count += 1
            problem = check_block(root, document, number, language, marker, block)
            if problem:
                problems.append(problem)
    for problem in problems:
        print(problem)
    print(
        f"{count} code blocks in {', '.join(DOCUMENTS)}: {len(problems)} not quoted from a built file"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
