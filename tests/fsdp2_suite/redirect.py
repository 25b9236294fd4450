"""Runs PyTorch's own FSDP2 tests against hyperparallel (the "outside judge").

    HP_FSDP2_SUITE_IMPL=hyperparallel python redirect.py test_fully_shard_init [-k PATTERN]

Importing this module, before any test module is imported:

* with HP_FSDP2_SUITE_IMPL=hyperparallel, rebinds ``fully_shard``, ``FSDPModule``,
  ``UnshardHandle`` and ``register_fsdp_forward_method`` to hyperparallel's in every torch
  module the tests (and their harness, common_fsdp) import them from; with =torch, leaves
  torch's own, so both implementations run the same files the same way;
* rebinds ``FSDPTest._run`` to ``FSDPTestMixin._run``: torch 2.15's FSDPTest._run exits
  "Need at least N accelerator devices" when there are fewer accelerators than ranks, also
  on CPU, while the mixin's only checks that off CPU, so the tests run on Gloo;
* with hyperparallel, makes common_fsdp's ``patch_*`` helpers raise FSDP2InternalsUsed:
  they swap FSDP2's private Python collectives and methods, which hyperparallel never calls;
* puts a small ``expecttest`` stand-in in place when the package is missing (torch's
  wheel needs it for common_utils but does not depend on it).

Run as a script, it runs the named test modules with unittest; spawned ranks
(MultiProcessTestCase uses "spawn") re-import this file as ``__mp_main__``, so they get the
same redirection before they unpickle the test class. With HP_FSDP2_SUITE_RESULTS set, each
test's start and outcome go to that file as JSON lines, so that a runner can tell what
happened even when the process hangs or dies.
"""

import importlib
import json
import os
import sys
import textwrap
import traceback
import types
import unittest

IMPL_ENV = "HP_FSDP2_SUITE_IMPL"
RESULTS_ENV = "HP_FSDP2_SUITE_RESULTS"

# Where torch defines or re-exports the names the tests import.
_FSDP2_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
_FSDP2_NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method")


def _install_expecttest_stand_in() -> None:
    try:
        import expecttest  # noqa: F401
    except ImportError:
        pass
    else:
        return

    class TestCase(unittest.TestCase):
        def assertExpectedInline(self, actual, expect, skip=0):
            # expecttest compares against the literal with its first newline and indent gone.
            if expect.startswith("\n"):
                expect = expect[1:]
            self.assertMultiLineEqual(textwrap.dedent(expect), actual)

        def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):
            with self.assertRaises(exc_type) as caught:
                callable(*args, **kwargs)
            self.assertExpectedInline(str(caught.exception), expect)

    stand_in = types.ModuleType("expecttest")
    stand_in.ACCEPT = False
    stand_in.TestCase = TestCase
    sys.modules["expecttest"] = stand_in


def _redirect_fully_shard(impl: str) -> None:
    if impl == "torch":
        return
    if impl != "hyperparallel":
        raise SystemExit(f"{IMPL_ENV} must be 'torch' or 'hyperparallel', got {impl!r}")
    import hyperparallel

    for module_name in _FSDP2_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # a path this torch no longer has
        for name in _FSDP2_NAMES:
            if hasattr(module, name):
                setattr(module, name, getattr(hyperparallel, name))


class FSDP2InternalsUsed(Exception):
    """The test reaches into FSDP2's implementation, which hyperparallel does not have."""


def _refuse_internal_patches(common_fsdp) -> None:
    # common_fsdp's patch_* swap FSDP2's private collectives and FSDPParamGroup methods (or
    # the dist.* functions FSDP2 calls from Python); hyperparallel's core never calls them,
    # so a test under such a patch would check nothing: it fails at once, and says why.
    def refusing(name):
        def patch(*args, **kwargs):
            raise FSDP2InternalsUsed(f"common_fsdp.{name} patches FSDP2's Python internals")

        return patch

    for name in dir(common_fsdp):
        if name.startswith("patch_"):
            setattr(common_fsdp, name, refusing(name))


def _run_fsdp_tests_on_cpu(impl: str) -> None:
    from torch.testing._internal import common_fsdp

    # The classmethod itself, not FSDPTestMixin._run (that one is bound to the mixin).
    common_fsdp.FSDPTest._run = vars(common_fsdp.FSDPTestMixin)["_run"]
    if impl == "hyperparallel":
        _refuse_internal_patches(common_fsdp)


def install() -> None:
    _install_expecttest_stand_in()
    impl = os.environ.get(IMPL_ENV, "torch")
    # Before common_fsdp: it imports fully_shard at its top.
    _redirect_fully_shard(impl)
    _run_fsdp_tests_on_cpu(impl)


install()


class _RecordingResult(unittest.TextTestResult):
    """Writes each test's start and outcome as a JSON line, flushed at once."""

    def __init__(self, stream, descriptions, verbosity, *, durations=None):
        super().__init__(stream, descriptions, verbosity)
        path = os.environ.get(RESULTS_ENV)
        self._records = open(path, "a", encoding="utf-8") if path else None

    def _record(self, test, status, detail=""):
        if self._records is not None:
            entry = {"test": test.id(), "status": status, "detail": detail}
            self._records.write(json.dumps(entry) + "\n")
            self._records.flush()

    def _error_text(self, err):
        return "".join(traceback.format_exception(*err))

    def startTest(self, test):
        super().startTest(test)
        self._record(test, "started")

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", self._error_text(err))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._error_text(err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._record(test, "fail" if failed else "error", self._error_text(err))


if __name__ == "__main__":
    # argv: the test modules (their folder on sys.path) and unittest's options, e.g. -k.
    unittest.main(
        module=None,
        argv=[sys.argv[0], "-v", *sys.argv[1:]],
        testRunner=unittest.TextTestRunner(resultclass=_RecordingResult, verbosity=2),
    )
