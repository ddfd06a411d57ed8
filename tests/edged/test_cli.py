"""The edged CLI (client commands) against a real daemon over the test-double backend."""

from __future__ import annotations

import json

import pytest

from edged.cli import main
from tests.edged.fakes import digest


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_propagates_exit_code(node, capsys) -> None:
    rc, out, err = run(capsys, "run", "--socket", node.socket, "--layer", digest(1), "--rm",
                       "--", "sh", "-c", "echo hi; echo warn >&2; exit 3")
    assert (rc, out) == (3, "hi\n") and "warn" in err
    assert node.server.manager.find() == []
    rc, _, _ = run(capsys, "run", "--socket", node.socket, "--layer", digest(1), "--rm",
                   "--timeout", "0.2", "--", "sleep", "10")
    assert rc == 124
    rc, _, _ = run(capsys, "run", "--socket", node.socket, "--layer", digest(1), "--rm",
                   "--", "sh", "-c", "kill -KILL $$")
    assert rc == 128 + 9


def test_ps_exec_rm_images_node(node, capsys) -> None:
    rc, _, _ = run(capsys, "images", "--socket", node.socket, "--add", "py:3", digest(1),
                   digest(2))
    assert rc == 0
    rc, out, _ = run(capsys, "images", "--socket", node.socket)
    assert out.splitlines()[0].split() == ["NAME", "LAYERS", "DIGESTS", "AGE"]
    assert out.splitlines()[1].split()[:2] == ["py:3", "2"]
    rc, _, err = run(capsys, "run", "--socket", node.socket, "--image", "py:3", "--id", "c1",
                     "--label", "k=v", "--", "true")
    assert rc == 0 and "left running" in err
    rc, out, _ = run(capsys, "ps", "--socket", node.socket)
    assert out.splitlines()[1].split()[:3] == ["c1", "running", "py:3"]
    rc, out, _ = run(capsys, "ps", "--socket", node.socket, "--json", "--label", "k=v")
    assert [s["id"] for s in json.loads(out)] == ["c1"]
    rc, out, _ = run(capsys, "exec", "--socket", node.socket, "--json", "c1", "--", "echo", "x")
    assert rc == 0 and json.loads(out)["stdout"] == "x\n"
    rc, out, _ = run(capsys, "node", "--socket", node.socket, "--json")
    assert json.loads(out)["allocated"]["sandboxes"] == 1
    rc, out, _ = run(capsys, "node", "--socket", node.socket)
    assert "cpus" in out and "backend: container" in out
    rc, out, _ = run(capsys, "rm", "--socket", node.socket, "c1")
    assert (rc, out) == (0, "c1\n")
    rc, _, err = run(capsys, "rm", "--socket", node.socket, "c1")
    assert rc == 1 and "not_found" in err
    rc, _, err = run(capsys, "exec", "--socket", node.socket, "c1", "--", "true")
    assert rc == 1 and "no such sandbox" in err


def test_run_needs_one_source(node, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--socket", node.socket, "--", "true"])
    rc, _, err = run(capsys, "run", "--socket", node.socket, "--layer", "bad", "--", "true")
    assert rc == 1 and "bad_request" in err
