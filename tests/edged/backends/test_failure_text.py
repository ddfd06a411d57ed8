"""A failed sandbox's cause in words (edged.backends.base.failure_text): the record's error."""

from __future__ import annotations

from edged.backends.base import failure_text


def test_failure_text_says_what_is_known() -> None:
    assert failure_text({"what": "sbx-init ended", "signal": 9}) == "sbx-init ended (signal 9)"
    assert failure_text({"what": "sbx-init ended", "exit_status": 1, "oom_kill": True,
                         "log": "x"}) == "sbx-init ended (exit status 1, out of memory)"
    assert failure_text({"what": "sbx-init ended", "oom_kill": False}) == (
        "sbx-init ended (status unknown)")
    assert failure_text({"what": "its layers were lost", "layers": ["sha256:a", "sha256:b"]}
                        ) == "its layers were lost (layers sha256:a, sha256:b)"
    assert failure_text({}) == "the sandbox died (status unknown)"
