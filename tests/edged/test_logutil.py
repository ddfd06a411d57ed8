"""The rate limit for repeated log lines."""

from __future__ import annotations

import logging

import pytest

from edged.logutil import RateLimitFilter


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr("edged.logutil.time.monotonic", c)
    return c


def _record(msg: str, *args: object, exc: type[BaseException] | None = None,
            name: str = "edged.x", level: int = logging.WARNING) -> logging.LogRecord:
    exc_info = (exc, exc(), None) if exc is not None else None
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)


def test_burst_then_counted_then_reported(clock: _Clock) -> None:
    f = RateLimitFilter(period_s=10.0, burst=3)
    passed = [f.filter(_record("accept: %s", i)) for i in range(100)]
    assert passed == [True] * 3 + [False] * 97  # arguments differ: one kind of line
    clock.t += 10.0
    r = _record("accept: %s", "again")
    assert f.filter(r) and r.suppressed == 97  # type: ignore[attr-defined]
    r2 = _record("accept: %s", "more")
    assert f.filter(r2) and not hasattr(r2, "suppressed")


def test_kinds_are_apart(clock: _Clock) -> None:
    f = RateLimitFilter(period_s=10.0, burst=1)
    assert f.filter(_record("a %s", 1))
    assert not f.filter(_record("a %s", 2))
    assert f.filter(_record("b %s", 1))  # another template
    assert f.filter(_record("a %s", 1, level=logging.ERROR))  # another level
    assert f.filter(_record("a %s", 1, name="asyncio"))  # another logger
    assert f.filter(_record("a %s", 1, exc=OSError))  # another exception type
    assert not f.filter(_record("a %s", 1, exc=OSError))


def test_bounded_number_of_kinds(clock: _Clock) -> None:
    f = RateLimitFilter(period_s=10.0, burst=1, max_kinds=8)
    for i in range(1000):
        f.filter(_record(f"formatted in: {i}"))  # an f-string makes a kind per line
    assert len(f._windows) == 8


def test_on_a_handler_it_throttles_every_logger(clock: _Clock) -> None:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    h = Keep()
    h.addFilter(RateLimitFilter(period_s=10.0, burst=2))
    lg = logging.getLogger("edged.test_logutil")
    lg.addHandler(h)
    lg.propagate = False
    try:
        for _ in range(50):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                lg.exception("socket.accept() out of system resource")
    finally:
        lg.removeHandler(h)
    assert len(seen) == 2


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RateLimitFilter(period_s=0)
    with pytest.raises(ValueError):
        RateLimitFilter(burst=0)


def test_below_min_level_everything_passes(clock: _Clock) -> None:
    f = RateLimitFilter(period_s=10.0, burst=1)
    assert all(f.filter(_record("sandbox created", level=logging.INFO)) for _ in range(50))
    assert f.filter(_record("x", level=logging.WARNING))
    assert not f.filter(_record("x", level=logging.WARNING))
