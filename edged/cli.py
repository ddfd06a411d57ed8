"""The ``edged`` command: ``serve | ps | run | exec | rm | images | node | cluster``.

Human tables by default, ``--json`` for machines. ``run`` and ``exec`` stream the command's
output and exit with its status (128+N if killed by signal N, 124 on timeout, like
``timeout(1)``). The client commands use only :mod:`edged.client` (HTTP on the socket).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from edged.client import ExecResult, Sandbox, SandboxError
from edged.client._http import Transport, path_for
from edged.tabular import table as _table


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _age(t: float) -> str:
    s = max(0, int(time.time() - t))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def exit_status(r: ExecResult) -> int:
    """The shell-style status of a result: the exit code, 128+signal, 124 on timeout."""
    if r.reason == "exited" and r.exit_code is not None:
        return r.exit_code
    if r.reason == "timeout":
        return 124
    if r.signal:
        return 128 + r.signal
    return 125


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def cmd_ps(a: argparse.Namespace) -> int:
    labels = dict(x.split("=", 1) for x in a.label or [])
    boxes = Sandbox.list(labels=labels, socket=a.socket)
    if a.json:
        _print_json([b.info for b in boxes])
        return 0
    rows = [[b.id, b.info["state"], b.info.get("image") or f"{len(b.info['layers'])} layers",
             f"{b.info['resources']['cpus']:g}", _bytes(b.info["resources"]["memory_bytes"]),
             _age(b.info["created_at"]),
             ",".join(f"{k}={v}" for k, v in sorted(b.info["labels"].items()))] for b in boxes]
    print(_table(rows, ["ID", "STATE", "IMAGE", "CPUS", "MEMORY", "AGE", "LABELS"]))
    return 0


def _stream_exec(sbx: Sandbox, argv: Sequence[str], a: argparse.Namespace) -> int:
    def out(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    def err(s: str) -> None:
        sys.stderr.write(s)
        sys.stderr.flush()

    env = dict(x.split("=", 1) for x in a.env or [])
    quiet = a.json
    r = sbx.exec(list(argv), timeout=a.timeout, env=env, cwd=a.cwd,
                 on_stdout=None if quiet else out, on_stderr=None if quiet else err)
    if a.json:
        _print_json({"sandbox": sbx.id, "exit_code": r.exit_code, "reason": r.reason,
                     "signal": r.signal, "duration_s": r.duration, "stdout": r.stdout,
                     "stderr": r.stderr})
    elif r.reason not in ("exited", "signalled"):
        print(f"edged: {r.reason} after {r.duration:.2f}s", file=sys.stderr)
    return exit_status(r)


def cmd_run(a: argparse.Namespace) -> int:
    if not a.cmd:
        raise SystemExit("edged run: give a command after --")
    if bool(a.image) == bool(a.layer):
        raise SystemExit("edged run: give --image NAME or --layer DIGEST (one or more)")
    labels = dict(x.split("=", 1) for x in a.label or [])
    sbx = Sandbox.create(image=a.image, layers=a.layer or None, id=a.id, cpus=a.cpus,
                         memory_bytes=a.memory, labels=labels, timeout=a.ttl, socket=a.socket)
    try:
        return _stream_exec(sbx, a.cmd, a)
    finally:
        if a.rm:
            sbx.kill()
        elif not a.json:
            print(f"edged: sandbox {sbx.id} left running (edged rm {sbx.id})", file=sys.stderr)


def cmd_exec(a: argparse.Namespace) -> int:
    if not a.cmd:
        raise SystemExit("edged exec: give a command after --")
    return _stream_exec(Sandbox.connect(a.id, socket=a.socket), a.cmd, a)


def cmd_rm(a: argparse.Namespace) -> int:
    status = 0
    for sid in a.ids:
        try:
            Sandbox.connect(sid, socket=a.socket).kill()
            if not a.json:
                print(sid)
        except SandboxError as e:
            print(f"edged rm {sid}: {e} ({e.code})", file=sys.stderr)
            status = 1
    return status


def cmd_images(a: argparse.Namespace) -> int:
    t = Transport(a.socket)
    if a.add:
        name, layers = a.add[0], a.add[1:]
        if not layers:
            raise SystemExit("edged images --add NAME:TAG DIGEST...: give at least one layer")
        img = t.json("POST", path_for("images"), {"name": name, "layers": layers})
        _print_json(img) if a.json else print(img["name"])
        return 0
    if a.delete:
        img = t.json("DELETE", path_for("images", a.delete))
        _print_json(img) if a.json else print(img["name"])
        return 0
    images = t.json("GET", path_for("images"))["images"]
    if a.json:
        _print_json(images)
        return 0
    rows = [[i["name"], str(len(i["layers"])), " ".join(d[7:19] for d in i["layers"]),
             _age(i["created_at"])] for i in images]
    print(_table(rows, ["NAME", "LAYERS", "DIGESTS", "AGE"]))
    return 0


def cmd_node(a: argparse.Namespace) -> int:
    info = Transport(a.socket).json("GET", path_for("node"))
    if a.json:
        _print_json(info)
        return 0
    c, u = info["capacity"], info["allocated"]
    rows = [
        ["cpus", f"{u['cpus']:g}", f"{c['cpus']:g} × {c['cpu_overcommit']:g}"],
        ["memory", _bytes(u["memory_bytes"]),
         f"{_bytes(c['memory_bytes'])} × {c['memory_overcommit']:g}"],
        ["sandboxes", str(u["sandboxes"]), str(c["max_sandboxes"])],
        ["layers mounted", str(len(info["layers"])), ""],
    ]
    print(_table(rows, ["RESOURCE", "ALLOCATED", "CAPACITY"]))
    print("backend:", info["backend"])
    for k, v in sorted(info["features"].items()):
        print(f"  {k}: {v}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from edged import config as config_mod
    from edged.daemon import run
    from edged.errors import EdgedError

    try:
        cfg = config_mod.from_args(a)
    except EdgedError as e:
        print(f"edged serve: {e}", file=sys.stderr)
        return 2
    return run(cfg)


def cmd_rollout(a: argparse.Namespace) -> int:
    from edged.rollout import main as rollout_main

    return rollout_main(list(a.args))


def cmd_suite(a: argparse.Namespace) -> int:
    from edged.suite import main as suite_main

    return suite_main(list(a.args))


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``edged``."""
    p = argparse.ArgumentParser(prog="edged", description="Node runtime for agent sandboxes")
    sub = p.add_subparsers(dest="command", required=True)

    def client(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--socket", help="daemon socket (default $EDGED_SOCKET or "
                                         "/run/edged/edged.sock)")
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        return sp

    from edged import config as config_mod

    sp = sub.add_parser("serve", help="run the daemon")
    config_mod.add_flags(sp)
    sp.set_defaults(fn=cmd_serve)

    sp = client("ps", "list sandboxes")
    sp.add_argument("--label", action="append", help="k=v filter (repeatable)")
    sp.set_defaults(fn=cmd_ps)

    for name in ("run", "exec"):
        sp = client(name, "create a sandbox and run a command" if name == "run"
                    else "run a command in a sandbox")
        if name == "run":
            sp.add_argument("--image", help="name:tag")
            sp.add_argument("--layer", action="append", help="layer digest, bottom first")
            sp.add_argument("--rm", action="store_true", help="remove the sandbox afterwards")
            sp.add_argument("--id")
            sp.add_argument("--cpus", type=float)
            sp.add_argument("--memory", type=int, help="bytes")
            sp.add_argument("--ttl", type=float, help="seconds")
            sp.add_argument("--label", action="append", help="k=v (repeatable)")
        else:
            sp.add_argument("id")
        sp.add_argument("--timeout", type=float, help="seconds before the command is killed")
        sp.add_argument("--env", action="append", help="K=V (repeatable)")
        sp.add_argument("--cwd")
        sp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
        sp.set_defaults(fn=cmd_run if name == "run" else cmd_exec)

    sp = client("rm", "destroy sandboxes")
    sp.add_argument("ids", nargs="+")
    sp.set_defaults(fn=cmd_rm)

    sp = client("images", "list, add or delete images")
    sp.add_argument("--add", nargs="+", metavar="ARG", help="NAME:TAG DIGEST... (bottom first)")
    sp.add_argument("--delete", metavar="NAME:TAG")
    sp.set_defaults(fn=cmd_images)

    sp = client("node", "capacity, allocations and features of this node")
    sp.set_defaults(fn=cmd_node)

    sp = sub.add_parser("suite", add_help=False,
                        help="a project's test suite in N sandboxes (layers built from PyPI)")
    sp.add_argument("args", nargs=argparse.REMAINDER)
    sp.set_defaults(fn=cmd_suite)
    from edged.cluster.join import add_parser as add_cluster

    add_cluster(sub)

    sp = sub.add_parser("rollout", add_help=False,
                        help="the main job: an RL rollout (tasks on real projects, "
                             "scripted agents, one that cheats, a trusted grader)")
    sp.add_argument("args", nargs=argparse.REMAINDER)
    sp.set_defaults(fn=cmd_rollout)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``edged``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["rollout"]:  # its own parser: argparse cannot pass options through
        from edged.rollout import main as rollout_main

        return rollout_main(args[1:])
    if args[:1] == ["suite"]:
        from edged.suite import main as suite_main

        return suite_main(args[1:])
    a = parser().parse_args(args)
    if getattr(a, "cmd", None) and a.cmd[0] == "--":
        a.cmd = a.cmd[1:]
    try:
        return int(a.fn(a))
    except SandboxError as e:
        print(f"edged {a.command}: {e} ({e.code})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
