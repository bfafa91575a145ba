"""``python -m cukern check --gpu``: does this GPU and driver run cukern right?

Runs the quick GPU tests of the checkout's ``tests/`` folder (``-m "gpu and not
slow"``; every family's tests compare each kernel with its float64 reference at
several shapes) through ``pytest.main``, with a recorder set in
:func:`cukern.testing.set_recorder`, so that every ``assert_close`` and ``nmse``
a test makes is logged against the test that made it. The table then has one
row per test function (``--verbose``: per parametrised case) with its cases
passed/failed/skipped and its worst comparison: the error and the bound at the
element where ``|out - ref| / (atol + rtol*|ref|)`` is largest (a ratio <= 1
passes), or the largest NMSE. A test that compares through something else
(``cupy.testing``, a plain ``assert``) still counts as passed or failed, with
no error column.

Works for whatever test files exist: it knows nothing of the families.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["Case", "Collector", "group", "format_table", "run", "run_pytest"]


@dataclass
class Case:
    """One test case (a pytest node) and the comparisons it made."""
    nodeid: str
    outcome: str = "not run"  # passed / failed / skipped / error
    worst_ratio: float = -1.0  # max over the case's assert_close calls of err / bound (-1: none made)
    worst_err: float | None = None
    worst_bound: float | None = None
    worst_name: str = ""
    max_nmse: float | None = None
    n_checks: int = 0
    failed_checks: int = 0

    def record(self, name: str, kind: str, error: float, bound: float | None, passed: bool) -> None:
        self.n_checks += 1
        self.failed_checks += not passed
        if kind == "nmse":
            self.max_nmse = error if self.max_nmse is None or not error <= self.max_nmse else self.max_nmse
            return
        ratio = error / bound if bound else (0.0 if error == 0 else math.inf)
        if math.isnan(error):
            ratio = math.inf
        if ratio > self.worst_ratio:
            self.worst_ratio, self.worst_err, self.worst_bound, self.worst_name = ratio, error, bound, name


class Collector:
    """A pytest plugin: attributes every recorded comparison to the running test."""

    def __init__(self):
        self.cases: dict[str, Case] = {}
        self._current: Case | None = None

    def record(self, name, kind, error, bound, passed) -> None:
        if self._current is not None:
            self._current.record(name, kind, error, bound, passed)

    def _case(self, nodeid: str) -> Case:
        return self.cases.setdefault(nodeid, Case(nodeid))

    # pytest hooks (pytest finds them by name on a plugin object)
    def pytest_runtest_setup(self, item):
        self._current = self._case(item.nodeid)

    def pytest_runtest_teardown(self, item):
        self._current = None

    def pytest_runtest_logreport(self, report):
        case = self._case(report.nodeid)
        if report.when == "call":
            case.outcome = report.outcome
        elif report.failed:  # a setup or teardown error
            case.outcome = "error"
        elif report.skipped and case.outcome == "not run":
            case.outcome = "skipped"


@dataclass
class Group:
    """The cases of one test function (or one case, ungrouped)."""
    name: str
    cases: list[Case] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.cases)

    @property
    def ok(self) -> bool:
        return not any(c.outcome in ("failed", "error") for c in self.cases)

    @property
    def worst(self) -> Case | None:
        made = [c for c in self.cases if c.worst_ratio >= 0]
        return max(made, key=lambda c: c.worst_ratio) if made else None

    @property
    def max_nmse(self) -> float | None:
        v = [c.max_nmse for c in self.cases if c.max_nmse is not None]
        return max(v) if v else None


def group(cases, by_function: bool = True) -> list[Group]:
    """Cases grouped by test function (``file::test`` without the ``[params]``), in run order."""
    groups: dict[str, Group] = {}
    for c in cases:
        key = re.sub(r"\[.*\]$", "", c.nodeid) if by_function else c.nodeid
        groups.setdefault(key, Group(key)).cases.append(c)
    return list(groups.values())


def format_table(groups: list[Group]) -> str:
    """One row per group: cases passed/failed/skipped, comparisons made, the worst error and
    its bound (ratio err/bound; <= 1 passes), the largest NMSE, and ok/FAIL."""
    width = max([len(g.name) for g in groups] + [30])
    head = (f"{'test':<{width}} {'pass':>5} {'fail':>5} {'skip':>5} {'checks':>7} {'worst err':>10} "
            f"{'bound':>10} {'err/bound':>9} {'max nmse':>9}  status")
    lines = [head, "-" * len(head)]
    for g in groups:
        w = g.worst
        err = f"{w.worst_err:.2e}" if w else "-"
        bound = f"{w.worst_bound:.2e}" if w and w.worst_bound is not None else "-"
        ratio = f"{w.worst_ratio:.3f}" if w else "-"
        nm = f"{g.max_nmse:.1e}" if g.max_nmse is not None else "-"
        fail = g.count("failed") + g.count("error")
        checks = sum(c.n_checks for c in g.cases)
        status = "ok" if g.ok else "FAIL"
        if g.ok and g.count("passed") == 0:
            status = "skipped"
        lines.append(f"{g.name:<{width}} {g.count('passed'):>5} {fail:>5} {g.count('skipped'):>5} {checks:>7} "
                     f"{err:>10} {bound:>10} {ratio:>9} {nm:>9}  {status}")
    n_fail = sum(not g.ok for g in groups)
    n_cases = sum(len(g.cases) for g in groups)
    worst = max((g.worst for g in groups if g.worst), key=lambda c: c.worst_ratio, default=None)
    tail = f"; worst err/bound {worst.worst_ratio:.3f} ({worst.nodeid})" if worst else ""
    lines.append(f"\n{len(groups)} tests, {n_cases} cases, {n_fail} failing{tail}")
    return "\n".join(lines)


def run(tests=None, *, keyword: str | None = None, by_function: bool = True, extra_args=()) -> int:
    """Run the quick GPU tests with the recorder on; print pytest's own line per failure and
    the table. Returns pytest's exit code (0: every selected test passed)."""
    import pytest

    from cukern.workbench import checkout_root, interruptible, no_gpu_reason

    reason = no_gpu_reason()
    if reason:
        print(f"check --gpu: {reason}; nothing was run (the CPU compile check is `python -m cukern check`)")
        return 1
    root = checkout_root("tests")
    paths = [str(p) for p in (tests or [root / "tests"])]
    args = ["-q", "-m", "gpu and not slow", "--tb=short", "-p", "no:cacheprovider", "--rootdir", str(root),
            *(["-k", keyword] if keyword else []), *extra_args, *paths]
    with interruptible():  # a time limit's SIGTERM stops pytest cleanly: the table shows what ran
        code, collector = run_pytest(args)
    print()
    cases = [c for c in collector.cases.values() if c.outcome != "not run"]
    if not cases:
        print(f"check --gpu: no GPU test was selected in {', '.join(paths)}")
        return int(code) or 1
    print(format_table(group(cases, by_function)))
    if code == pytest.ExitCode.INTERRUPTED:
        print("interrupted: the table holds the tests that ran before")
    return int(code)


def run_pytest(args) -> tuple[int, Collector]:
    """``pytest.main(args)`` with a :class:`Collector` plugged in and the recorder on."""
    import pytest

    from cukern import testing
    collector = Collector()
    previous = testing.set_recorder(collector.record)
    try:
        code = pytest.main(list(args), plugins=[collector])
    finally:
        testing.set_recorder(previous)
    return int(code), collector
