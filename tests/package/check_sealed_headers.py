#!/usr/bin/env python3
"""The public headers (include/hyperparallel/ outside detail/) are sealed: they include
nothing from src/, no public or protected declaration in them (function signature,
constructor, member, using alias, free function) names a detail:: type, and what they put
in namespace detail is forward declarations only (definitions belong in detail/, whose
headers exist for the templates that need them). Private members, friend declarations and
the bodies of inline functions may use detail:: (that is what detail/ is for). Prints each
breach; exit 1 if there is one. Usage: check_sealed_headers.py SOURCE_DIR"""

import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
FORWARD_DECLARATION = re.compile(r"^(template\s*<.*>\s*)?(class|struct)\s+\w+$", re.S)
ACCESS = {"public", "protected", "private"}


def into_src(root: pathlib.Path, header: pathlib.Path, target: str) -> bool:
    """Whether `target`, as a header includes it, reaches into src/ (or out of include/)."""
    parts = pathlib.PurePosixPath(target).parts
    if ".." in parts or (parts and parts[0] == "src"):
        return True
    return (header.parent / target).resolve().is_relative_to((root / "src").resolve())


def code_only(text: str) -> str:
    """`text` with comments, literals and preprocessor lines blanked (newlines kept, so line
    numbers stay right)."""
    blank = lambda match: re.sub(r"[^\n]", " ", match.group(0))
    pattern = re.compile(
        r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|'
        r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*",
        re.S | re.M,
    )
    return pattern.sub(blank, text)


def without_template_head(declaration: str) -> str:
    """`declaration` without a leading template <...> (angle brackets balanced)."""
    if not declaration.startswith("template"):
        return declaration
    depth = 0
    for i, char in enumerate(declaration):
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
            if depth == 0:
                return declaration[i + 1 :].strip()
    return declaration


class Scope:
    def __init__(self, kind: str, exposed: bool, in_detail: bool, access: str = "public"):
        self.kind = kind  # "namespace", "class" or "body" (function bodies, enums, initializers)
        self.exposed = exposed  # whether users reach what is declared here
        self.in_detail = in_detail
        self.access = access

    def shows(self) -> bool:
        """Whether users see what is declared here at this point."""
        return self.exposed and (self.kind == "namespace" or self.access != "private")


def breaches(header: pathlib.Path, code: str) -> list:
    """The declarations of `code` that expose detail:: or define into namespace detail."""
    found = []
    scopes = [Scope("namespace", exposed=True, in_detail=False)]
    statement, start = "", 0
    parens = 0

    def check(text: str, line: int, opens_braces: bool) -> None:
        declaration = " ".join(text.split())
        scope = scopes[-1]
        if not declaration or scope.kind == "body" or declaration.startswith("friend "):
            return
        if scope.shows() and re.search(r"\bdetail::", declaration):
            found.append(
                f"{header}:{line}: names a detail:: type in a public declaration: {declaration}"
            )
        forward = not opens_braces and FORWARD_DECLARATION.match(declaration)
        if (
            scope.in_detail
            and scope.kind == "namespace"
            and not forward
            and not declaration.startswith("namespace")
        ):
            found.append(
                f"{header}:{line}: defines in namespace detail outside "
                f"include/hyperparallel/detail/: {declaration}"
            )

    for i, char in enumerate(code):
        if not statement.strip() and not char.isspace():
            start = code.count("\n", 0, i) + 1
        if char in "([":
            parens += 1
        elif char in ")]":
            parens -= 1
        if parens > 0 and char in "{}":  # a default argument's braces: part of the statement
            statement += char
        elif char == "{":
            check(statement, start, opens_braces=True)
            head = without_template_head(" ".join(statement.split()))
            scope = scopes[-1]
            visible = scope.shows()
            namespace = re.match(r"^(inline\s+)?namespace\b\s*([\w:]*)", head)
            if scope.kind == "body":
                scopes.append(Scope("body", False, scope.in_detail))
            elif namespace:
                in_detail = scope.in_detail or "detail" in namespace.group(2).split("::")
                scopes.append(Scope("namespace", visible and not in_detail, in_detail))
            elif re.match(r"^extern\s*$", head):
                scopes.append(Scope("namespace", visible, scope.in_detail))
            elif re.match(r"^(class|struct|union)\b", head):
                access = "private" if head.startswith("class") else "public"
                scopes.append(Scope("class", visible, False, access))
            else:
                scopes.append(Scope("body", False, scope.in_detail))
            statement = ""
        elif char == "}":
            if len(scopes) > 1:
                scopes.pop()
            statement = ""
        elif char == ";" and parens == 0:
            check(statement, start, opens_braces=False)
            statement = ""
        elif (
            char == ":"
            and scopes[-1].kind == "class"
            and statement.strip() in ACCESS
            and code[i + 1 : i + 2] != ":"
        ):
            scopes[-1].access = statement.strip()
            statement = ""
        else:
            statement += char
    return found


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    public_dir = root / "include" / "hyperparallel"
    problems = []
    for header in sorted(public_dir.rglob("*.h")):
        name = header.relative_to(root)
        text = header.read_text()
        for target in INCLUDE.findall(text):
            if into_src(root, header, target):
                problems.append(f"{name}: includes {target}, a file of the library's sources")
        if header.relative_to(public_dir).parts[0] != "detail":
            problems += breaches(name, code_only(text))
    for problem in problems:
        print(problem)
    print(f"{len(problems)} breach(es) of the sealed public headers")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
