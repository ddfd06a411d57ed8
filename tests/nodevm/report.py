"""What a node VM run found: the tests' outcomes (pytest's JUnit XML from the guest), which
skips are allowed on such a node, and the last line ``scripts/node-vm.sh`` prints.

A skip is allowed only where the node cannot have what the test needs and that is stated
here, with why (:data:`ALLOWED_SKIPS`); any other skip means a test that should run on a
production-like node did not, and the run fails as if it had.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: What starts each streamed line (:mod:`tests.nodevm.stream`).
STREAM_PREFIX = "nodevm-case:"
#: the memory line after each test (tests.nodevm.stream.memory_line)
MEM_PREFIX = "nodevm-mem:"

#: (test id pattern, skip reason pattern, why that skip is right on the node VM). The test id
#: is ``file::name`` as pytest prints it (class names folded in), matched with re.search.
ALLOWED_SKIPS: tuple[tuple[str, str, str], ...] = (
    (r"tests/security/test_network_scope\.py::", r"Landlock ABI >= 4",
     "Landlock TCP rules are ABI 4 (Linux 6.7); the 6.1 kernel has ABI 2. A task profile "
     "with tcp_bind/tcp_connect is refused at create there (see the README)."),
    (r"tests/edged/security/test_landlock\.py::", r"Landlock ABI >= 6",
     "Landlock scopes (signals, abstract sockets) are ABI 6 (Linux 6.12); on 6.1 AppArmor "
     "keeps workload processes from signalling sbx-init (tests/security/test_apparmor.py)."),
    (r"tests/edged/backends/container/test_container\.py::", r"idle cpu parent is v1's",
     "a cgroup v1 detail; the node VM is cgroup v2"),
)


@dataclass(frozen=True)
class Case:
    """One test case: ``nodeid`` (``path::name``), ``outcome`` (``passed``, ``failed``,
    ``error`` or ``skipped``), ``message`` (the failure's or skip's text), ``seconds``."""

    nodeid: str
    outcome: str
    message: str = ""
    seconds: float = 0.0


@dataclass
class Outcome:
    """The counts and the cases behind them. ``failed`` counts failures and errors;
    ``bad_skips``: skipped cases no entry of :data:`ALLOWED_SKIPS` covers."""

    cases: list[Case] = field(default_factory=list)
    #: Tests that started and never ended (a run cut short; only from :func:`parse_stream`).
    unfinished: list[str] = field(default_factory=list)
    #: True when the cases come from the streamed lines, not the session's JUnit XML.
    partial: bool = False

    @property
    def passed(self) -> int:
        return sum(c.outcome == "passed" for c in self.cases)

    @property
    def failed(self) -> int:
        return sum(c.outcome in ("failed", "error") for c in self.cases)

    @property
    def skipped(self) -> int:
        return sum(c.outcome == "skipped" for c in self.cases)

    def bad_skips(self, allowed: Iterable[tuple[str, str, str]] = ALLOWED_SKIPS) -> list[Case]:
        rules = list(allowed)
        return [c for c in self.cases if c.outcome == "skipped" and not any(
            re.search(tid, c.nodeid) and re.search(why, c.message) for tid, why, _ in rules)]


def _nodeid(tc: ET.Element) -> str:
    """``tests/x/test_y.py::Class::name`` from a testcase's ``classname`` (dotted module and
    class) and ``name``."""
    parts = (tc.get("classname") or "").split(".")
    # the module path ends at the first part starting "test_" (files), classes follow
    cut = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(parts[: cut + 1]) + ".py"
    return "::".join([path, *parts[cut + 1:], tc.get("name") or "?"])


def parse_junit(path: Path) -> Outcome:
    """The cases of a pytest ``--junitxml`` file. Raises ValueError for a file that is not
    JUnit XML (not XML at all, e.g. cut short, or another root), OSError if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:  # a SyntaxError, not a ValueError
        raise ValueError(f"{path}: not XML: {e}") from e
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path}: not JUnit XML (root <{root.tag}>)")
    out = Outcome()
    for tc in root.iter("testcase"):
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                msg = el.get("message") or (el.text or "")
                break
        out.cases.append(Case(_nodeid(tc), outcome, msg.strip(), float(tc.get("time") or 0)))
    return out


def _unquote_id(word: str) -> str:
    """The test id a streamed line holds (``%20`` and ``%25`` back to space and ``%``)."""
    return word.replace("%20", " ").replace("%25", "%")


def parse_stream(lines: Iterable[str], prefix: str = STREAM_PREFIX) -> Outcome:
    """The cases streamed by :mod:`tests.nodevm.stream` (console or file lines; other lines
    and any text before ``prefix`` on a line, such as the kernel's timestamp, are ignored),
    and the tests that started without an outcome (:attr:`Outcome.unfinished`: the one
    running when the run was cut short). A test id seen twice keeps its last outcome."""
    done: dict[str, Case] = {}
    started: list[str] = []
    for line in lines:
        at = line.find(prefix)
        if at < 0:
            continue
        fields = line[at + len(prefix):].strip().split(" ", 3)
        if len(fields) == 2 and fields[0] == "start":
            started.append(_unquote_id(fields[1]))
            continue
        if len(fields) < 3 or fields[0] not in ("passed", "failed", "error", "skipped"):
            continue
        try:
            seconds = float(fields[1])
        except ValueError:
            continue
        nodeid = _unquote_id(fields[2])
        done[nodeid] = Case(nodeid, fields[0], fields[3].strip() if len(fields) > 3 else "",
                            seconds)
    return Outcome(list(done.values()), [n for n in dict.fromkeys(started) if n not in done],
                   partial=True)


def read_facts(path: Path) -> dict[str, str]:
    """The guest's ``key=value`` lines (``node.txt``)."""
    facts = {}
    for line in path.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep:
            facts[k.strip()] = v.strip()
    return facts


def summary_line(facts: Mapping[str, str], outcome: Outcome | None) -> str:
    """``node-vm: kernel K, cgroup v2, apparmor enforce, N passed, M failed, S skipped``: the
    kernel release, the cgroup hierarchy (``cgroup2fs`` on /sys/fs/cgroup is v2, ``tmpfs``
    is v1 or hybrid), AppArmor's state (its module's ``enabled`` and ``mode`` parameters),
    the counts (all 0 when no results came back); a run cut short says so at the end."""
    kernel = facts.get("kernel") or "unknown"
    cg = {"cgroup2fs": "v2", "tmpfs": "v1/hybrid"}.get(facts.get("cgroup_fs", ""), "unknown")
    enabled = facts.get("apparmor_enabled") == "Y"
    aa = (facts.get("apparmor_mode") or "enabled") if enabled else "off"
    o = outcome or Outcome()
    return (f"node-vm: kernel {kernel}, cgroup {cg}, apparmor {aa}, {o.passed} passed, "
            f"{o.failed} failed, {o.skipped} skipped"
            + (" (cut short: outcomes as streamed)" if o.partial else ""))


def verdict(facts: Mapping[str, str], outcome: Outcome | None,
            allowed: Iterable[tuple[str, str, str]] = ALLOWED_SKIPS) -> list[str]:
    """Why the run is not green (empty: it is): no results, nothing ran, failures, skips of
    tests that should run here, or a node that is not what the run is for (cgroup v2 and
    AppArmor enforcing)."""
    why = []
    if outcome is None:
        return ["no test results came back from the guest"]
    if outcome.partial:
        why.append("the test run did not finish (outcomes as streamed; still running: "
                   + (", ".join(outcome.unfinished) or "none") + ")")
    if not outcome.cases:
        why.append("no test ran")
    if outcome.failed:
        why.append(f"{outcome.failed} failed")
    bad = outcome.bad_skips(allowed)
    if bad:
        why.append(f"{len(bad)} skipped that should run on this node: "
                   + "; ".join(f"{c.nodeid} ({c.message[:120]})" for c in bad[:10]))
    if facts.get("cgroup_fs") != "cgroup2fs":
        why.append(f"the guest's cgroups are not v2 ({facts.get('cgroup_fs')})")
    if facts.get("apparmor_enabled") != "Y" or facts.get("apparmor_mode", "enforce") != "enforce":
        why.append("AppArmor is not enforcing in the guest")
    return why
