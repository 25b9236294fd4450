"""Runs PyTorch's own FSDP2 tests against torch's fully_shard or hyperparallel's, on CPU.

    run_suite.py --impl {torch,hyperparallel} --tests-dir DIR [--fetch] [--files f1.py ...]
                 [-k PATTERN ...] [--timeout-per-file S] [--timeout-per-test S]

The tests (pytorch's test/distributed/_composable/fsdp/test_fully_shard_*.py) are not part
of this repository: --fetch downloads them into DIR from GitHub for the tag of the installed
torch; without it, DIR must already hold them. Each file runs in its own process group under
a deadline (redirect.py does the redirection), so a hang or crash costs one file, not the
run. Prints a markdown table per file and a summary; exits 1 if any test failed.
"""

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REDIRECT = HERE / "redirect.py"
RAW_URL = "https://raw.githubusercontent.com/pytorch/pytorch/{ref}/test/distributed/_composable/fsdp/{name}"

# pytorch's FSDP2 test files (a file a tag lacks is reported and left out).
DEFAULT_FILES = [
    "test_fully_shard_autograd.py",
    "test_fully_shard_clip_grad_norm_.py",
    "test_fully_shard_comm.py",
    "test_fully_shard_frozen.py",
    "test_fully_shard_grad_scaler.py",
    "test_fully_shard_ignore_params.py",
    "test_fully_shard_init.py",
    "test_fully_shard_memory.py",
    "test_fully_shard_mixed_precision.py",
    "test_fully_shard_overlap.py",
    "test_fully_shard_state.py",
    "test_fully_shard_state_dict.py",
    "test_fully_shard_training.py",
]

# Errors that show a test reaching into FSDP2's implementation rather than its API.
_INTERNALS = re.compile(
    r"FSDP2InternalsUsed"
    r"|has no attribute '_[A-Za-z]\w*'"  # a private attribute of FSDP2's module or state
    r"|'function' object has no attribute 'state'"  # fully_shard.state(): FSDPState
    r"|FSDPParamGroup|FSDPParam\b|FSDPState\b|_fsdp_param_group|_get_fsdp_state"
)
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Failure|Interrupt|Used)\b(?::.*)?$"
)
# MultiProcessTestCase's wrapper around a rank's error: the rank's own error follows it.
_RANK_WRAPPER = re.compile(r"^RuntimeError: Process \d+ exited with error code")
# A rank that died outside the test body: its error is only in the file's log.
_RANK_EXIT = re.compile(r"^Expected exit code (-?\d+) but got (-?\d+)")


@dataclass
class Outcome:
    test: str
    status: str  # pass, fail, skip, n/a, timeout, crash
    detail: str = ""


def key_line(text: str) -> str:
    """The line that names the error: the rank's own one when a rank's error was wrapped."""
    lines = text.splitlines()
    for line in lines:
        exited = _RANK_EXIT.match(line)
        if exited:
            return f"rank 0 exited with code {exited.group(2)} (its error is in the log)"
    wrapped = next((i for i, line in enumerate(lines) if _RANK_WRAPPER.match(line)), None)
    if wrapped is not None:
        inner = [line for line in lines[wrapped + 1 :] if _EXCEPTION_LINE.match(line)]
        inner = [line for line in inner if not _RANK_WRAPPER.match(line)]
        if inner:
            return inner[0]
    errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
    if errors:
        return errors[-1]
    return next((line.strip() for line in lines if line.strip()), "")


def torch_ref() -> str:
    import torch

    return "v" + torch.__version__.split("+")[0]


def _download(name: str, ref: str, tests_dir: Path) -> bool:
    url = RAW_URL.format(ref=ref, name=name)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            (tests_dir / name).write_bytes(response.read())
        return True
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return False
        raise


def fetch(files: list[str], ref: str, tests_dir: Path) -> list[str]:
    """Downloads the files and the sibling modules they import; returns those that exist."""
    tests_dir.mkdir(parents=True, exist_ok=True)
    present = []
    for name in files:
        try:
            if not _download(name, ref, tests_dir):
                print(f"{name}: not in pytorch {ref}, left out", file=sys.stderr)
                continue
            # Helpers next to the tests (e.g. _test_fully_shard_common.py) are plain imports.
            source = (tests_dir / name).read_text()
            for module in re.findall(r"^(?:from|import) (\w+)", source, re.MULTILINE):
                local = tests_dir / f"{module}.py"
                if not local.exists() and importlib.util.find_spec(module) is None:
                    _download(local.name, ref, tests_dir)
        except (urllib.error.URLError, OSError) as error:
            sys.exit(
                f"cannot download {name} for pytorch {ref} ({error}); put the files in "
                f"{tests_dir} by hand and run without --fetch"
            )
        present.append(name)
    return present


def _child_env(impl: str, results: Path, tests_dir: Path, args) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(tests_dir)]
    if args.package_dir.is_dir():
        paths.insert(0, str(args.package_dir))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["HP_FSDP2_SUITE_IMPL"] = impl
    env["HP_FSDP2_SUITE_RESULTS"] = str(results)
    # A hung collective fails its test after this long instead of eating the file's deadline.
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(args.timeout_per_test))
    # Up to 8 ranks share a few cores: one thread each keeps them from thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_file(name: str, args, log_dir: Path) -> tuple[list[Outcome], str]:
    """Runs one test file; returns its outcomes and how the process ended."""
    module = name.removesuffix(".py")
    with tempfile.TemporaryDirectory() as scratch:
        results = Path(scratch) / "results.jsonl"
        command = [sys.executable, str(REDIRECT), module]
        for pattern in args.k or ():
            command += ["-k", pattern]
        log_path = log_dir / f"{args.impl}-{module}.log"
        with open(log_path, "w") as log:
            # Its own session: on the deadline the whole group goes, spawned ranks included.
            process = subprocess.Popen(
                command,
                cwd=args.tests_dir,
                env=_child_env(args.impl, results, args.tests_dir, args),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            started = time.monotonic()
            try:
                process.wait(timeout=args.timeout_per_file)
                ended = f"exit {process.returncode}"
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                ended = f"killed after {args.timeout_per_file} s"
            ended += f", {time.monotonic() - started:.0f} s, log {log_path}"
        records = results.read_text().splitlines() if results.exists() else []
    unfinished = "timeout" if "killed" in ended else "crash"
    records = [json.loads(r) for r in records]
    return _outcomes(records, unfinished, args.impl == "hyperparallel"), ended


def _outcomes(records: list[dict], unfinished: str, judge_internals: bool) -> list[Outcome]:
    """One outcome per test from its records; with judge_internals, a failure that shows
    FSDP2's internals (in the error or the failing code) counts as not applicable."""
    by_test: dict[str, Outcome] = {}
    for record in records:
        test, status, detail = record["test"], record["status"], record["detail"]
        if status == "started":
            by_test[test] = Outcome(test, unfinished)
            continue
        current = by_test[test]
        if current.status == "fail":
            continue  # a later subtest's failure or the test's end: keep the first failure
        if status in ("fail", "error"):
            line = key_line(detail)
            status = "n/a" if judge_internals and _INTERNALS.search(detail) else "fail"
            by_test[test] = Outcome(test, status, line)
        elif current.status != "n/a":
            by_test[test] = Outcome(test, status, detail)
    return list(by_test.values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def print_file_table(name: str, outcomes: list[Outcome], ended: str) -> None:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip", "n/a")}
    unfinished = sum(o.status in ("timeout", "crash") for o in outcomes)
    print(f"\n### {name}\n")
    print(
        f"{counts['pass']} passed, {counts['fail'] + unfinished} failed, {counts['skip']} "
        f"skipped, {counts['n/a']} not applicable (uses FSDP2 internals); process: {ended}\n"
    )
    print("| test | result | first line of the error / skip reason |")
    print("| --- | --- | --- |")
    for o in outcomes:
        short = ".".join(o.test.split(".")[-2:])  # Class.test_name
        print(f"| {short} | {o.status} | {_cell(o.detail)} |")
    if not outcomes:
        print(f"| (no test ran) | crash | see the log: {ended} |")


def print_summary(impl: str, per_file: dict[str, list[Outcome]]) -> None:
    print(f"\n### Summary ({impl})\n")
    print("| file | passed | failed | skipped | not applicable |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, outcomes in per_file.items():
        if not outcomes:
            print(f"| {name} | 0 | (no test ran: see its log) | 0 | 0 |")
            continue
        failed = sum(o.status in ("fail", "timeout", "crash") for o in outcomes)
        passed, skipped, not_applicable = (
            sum(o.status == s for o in outcomes) for s in ("pass", "skip", "n/a")
        )
        print(f"| {name} | {passed} | {failed} | {skipped} | {not_applicable} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("torch", "hyperparallel"), required=True)
    parser.add_argument("--tests-dir", type=Path, required=True)
    parser.add_argument("--fetch", action="store_true", help="download the files first")
    parser.add_argument("--ref", default=None, help="pytorch git ref (default: v<torch version>)")
    parser.add_argument("--files", nargs="+", help="test files (default: all in --tests-dir)")
    parser.add_argument("-k", action="append", help="unittest -k pattern (repeatable)")
    parser.add_argument("--timeout-per-file", type=float, default=600)
    parser.add_argument("--timeout-per-test", type=int, default=120)
    parser.add_argument(
        "--package-dir",
        type=Path,
        default=REPO / "build" / "python" / "package",
        help="folder holding the built hyperparallel package",
    )
    args = parser.parse_args()
    args.tests_dir = args.tests_dir.resolve()

    files = args.files
    if args.fetch:
        files = fetch(files or DEFAULT_FILES, args.ref or torch_ref(), args.tests_dir)
    elif not files:
        files = sorted(p.name for p in args.tests_dir.glob("test_fully_shard_*.py"))
    missing = [f for f in files if not (args.tests_dir / f).is_file()]
    if missing or not files:
        sys.exit(f"not in {args.tests_dir}: {' '.join(missing) or 'any test file'} (use --fetch)")

    log_dir = args.tests_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    per_file = {}
    for name in files:
        outcomes, ended = run_file(name, args, log_dir)
        print_file_table(name, outcomes, ended)
        per_file[name] = outcomes
        sys.stdout.flush()
    print_summary(args.impl, per_file)
    failed = any(
        not outcomes or any(o.status in ("fail", "timeout", "crash") for o in outcomes)
        for outcomes in per_file.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
