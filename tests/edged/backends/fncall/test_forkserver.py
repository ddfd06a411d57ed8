"""What a call's child inherits from the warm interpreter (the zygote) and what it must not
(the list is :mod:`edged.backends.fncall.server`'s docstring): each item held by a call
that looks for it."""

from __future__ import annotations

import json
import signal

import pytest

pytestmark = [pytest.mark.root, pytest.mark.mount]

PROBE = r"""
import json, os, sys, random, signal, resource
st = open('/proc/self/status').read()
field = lambda k: [l.split(':', 1)[1].split() for l in st.splitlines() if l.startswith(k + ':')][0]
fds = sorted(int(n) for n in os.listdir('/proc/self/fd'))
try:
    os.kill(os.getppid(), 0)
    signal_parent = 'allowed'
except PermissionError:
    signal_parent = 'denied'
print(json.dumps({
    'preloaded': sorted(m for m in ('json', 'collections', 'heapq') if m in sys.modules),
    'fds': fds, 'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),
    'cap_eff': field('CapEff')[0], 'cap_prm': field('CapPrm')[0],
    'env': sorted(os.environ), 'random': random.random(),
    'sigint': str(signal.getsignal(signal.SIGINT)),
    'sigpipe': str(signal.getsignal(signal.SIGPIPE)),
    'sigterm': str(signal.getsignal(signal.SIGTERM)),
    'core': resource.getrlimit(resource.RLIMIT_CORE), 'argv0': sys.argv[0], 'name': __name__,
    'path0': sys.path[0], 'cwd': os.getcwd(), 'signal_parent': signal_parent,
}))
"""


def _probe(fn_node) -> dict:
    r = fn_node.run({"language": "python", "source": PROBE, "env": {"MINE": "1"}})
    assert r["status"] == "Accepted", r
    return json.loads(r["stdout"])


def test_inherits_the_preloaded_modules(fn_node) -> None:
    assert _probe(fn_node)["preloaded"] == ["collections", "heapq", "json"]


def test_no_descriptor_but_its_own_stdio(fn_node) -> None:
    # 0-2 and the descriptor listdir itself holds open
    assert len(_probe(fn_node)["fds"]) == 4 and _probe(fn_node)["fds"][:3] == [0, 1, 2]


def test_no_privilege_and_cannot_signal_the_server(fn_node) -> None:
    p = _probe(fn_node)
    assert (p["uid"], p["gid"], p["groups"]) == (65534, 65534, [])
    assert int(p["cap_eff"], 16) == 0 and int(p["cap_prm"], 16) == 0
    assert p["signal_parent"] == "denied"


def test_environment_is_only_what_the_request_names(fn_node) -> None:
    assert _probe(fn_node)["env"] == ["HOME", "LANG", "LC_ALL", "MINE", "PATH"]


def test_random_state_is_not_shared(fn_node) -> None:
    assert len({_probe(fn_node)["random"] for _ in range(6)}) == 6


def test_signals_and_limits_as_an_interpreter_start_sets_them(fn_node) -> None:
    p = _probe(fn_node)
    assert "default_int_handler" in p["sigint"] and p["sigpipe"] in ("1", "Handlers.SIG_IGN")
    assert p["sigterm"] in ("0", "Handlers.SIG_DFL") and p["core"] == [0, 0]
    assert (p["name"], p["cwd"], p["path0"]) == ("__main__", "/tmp/work", "/tmp/work")
    assert p["argv0"] == "/tmp/work/main.py"


def test_a_previous_calls_data_is_not_in_the_childs_memory(fn_node) -> None:
    """The zygote never reads a call's code, input or output: a secret one call was given
    is nowhere in the next child's memory (all of it is read here, against a control string
    no call was given: each needle itself is in memory once)."""
    secret = "s3cr3t-" + "q" * 20
    fn_node.run({"language": "python", "source": "print(input())", "stdin": secret})
    scan = ("import ctypes\n"
            "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/mem is ours\n"
            "maps = open('/proc/self/maps').read().splitlines()\n"
            "mem = open('/proc/self/mem', 'rb', 0)\n"
            "hit = {'s3cr3t-': 0, 'c0ntr0l': 0}\n"
            "for line in maps:\n"
            "    addr, perms = line.split()[:2]\n"
            "    if 'r' not in perms or '[vsyscall]' in line: continue\n"
            "    lo, hi = (int(x, 16) for x in addr.split('-'))\n"
            "    try:\n"
            "        mem.seek(lo); data = mem.read(hi - lo)\n"
            "    except OSError: continue\n"
            "    for k in hit: hit[k] += data.count(k.encode() + b'q' * 20)\n"
            "print(hit['s3cr3t-'] - hit['c0ntr0l'])  # each needle is in memory once itself\n")
    for _ in range(3):  # over the pool's sandboxes
        r = fn_node.run({"language": "python", "source": scan})
        assert r["stdout"] == "0\n", r


# -- what the zygote does once for every child (server._prepare), held call by call --------

STATE = r"""
import gc, json, sys
before = sorted(m for m in ('threading',) if m in sys.modules)
st = open('/proc/self/status').read()
mask = lambda k: int([l.split()[1] for l in st.splitlines() if l.startswith(k + ':')][0], 16)
print(json.dumps({'threading': before, 'frozen': gc.get_freeze_count(),
                  'gc': gc.isenabled(), 'ign': mask('SigIgn'), 'cgt': mask('SigCgt'),
                  'stdout': [type(sys.stdout).__name__, sys.stdout.encoding,
                             sys.stdout.line_buffering, sys.stdout.seekable()],
                  'stderr': [sys.stderr.errors, sys.stderr.line_buffering]}))
"""


def _state(fn_node) -> dict:
    r = fn_node.run({"language": "python", "source": STATE})
    assert r["status"] == "Accepted", r
    return json.loads(r["stdout"])


def test_the_inherited_objects_are_frozen_and_the_childs_collector_runs(fn_node) -> None:
    """gc.freeze() in the zygote: a child's collections never visit (and write to) the
    inherited objects; the child's own garbage is still collected."""
    p = _state(fn_node)
    assert p["frozen"] > 1000 and p["gc"] is True
    cyc = ("import gc\n"
           "class N:\n"
           "    pass\n"
           "for _ in range(1000):\n"
           "    a = N(); a.me = a\n"
           "del a\n"
           "print(gc.collect() >= 0, len([o for o in gc.get_objects() if type(o) is N]))\n")
    r = fn_node.run({"language": "python", "source": cyc})
    assert r["stdout"] == "True 0\n", r


def test_every_signal_but_an_interpreters_own_is_at_its_default(fn_node) -> None:
    """Only the signals not at their default in the zygote are reset (server._prepare):
    the child sees exactly what an interpreter start sets (SIGPIPE, SIGXFSZ ignored; SIGINT
    caught), nothing the server or sbx-init had (but glibc's two, which no process can
    change through sigaction)."""
    p = _state(fn_node)
    bit = lambda s: 1 << (int(s) - 1)  # noqa: E731
    glibc = bit(32) | bit(33)  # glibc's own (SIGCANCEL, SIGSETXID): sigaction refuses them
    assert p["ign"] & ~glibc == bit(signal.SIGPIPE) | bit(signal.SIGXFSZ), hex(p["ign"])
    assert p["cgt"] == bit(signal.SIGINT), hex(p["cgt"])


def test_no_threading_inherited_but_a_calls_threads_are_joined(fn_node) -> None:
    """The zygote does not import threading (its at-fork hook would run in every child);
    a call that starts a non-daemon thread still has it joined before its exit, as an
    interpreter's exit does."""
    assert _state(fn_node)["threading"] == []
    src = ("import threading, time\n"
           "def late():\n"
           "    time.sleep(0.3); print('late', flush=True)\n"
           "threading.Thread(target=late).start()\n"
           "print('main')\n")
    r = fn_node.run({"language": "python", "source": src})
    assert r["status"] == "Accepted" and r["stdout"] == "main\nlate\n", r


def test_the_streams_are_an_interpreters_and_a_calls_own(fn_node) -> None:
    """The text streams a child finds (made once by the zygote over /dev/null) behave as
    an interpreter's over files; what one call left in them (unflushed output, a stream
    reconfigured, stdin half read) is not in the next call's."""
    p = _state(fn_node)
    assert p["stdout"] == ["TextIOWrapper", "utf-8", False, True], p
    assert p["stderr"] == ["backslashreplace", True], p
    dirty = ("import os, sys\n"
             "sys.stdout.reconfigure(line_buffering=True)  # flushes: before the write\n"
             "sys.stdout.write('left in the buffer')\n"
             "sys.stdin.readline()\n"
             "os._exit(0)\n")
    for _ in range(3):  # over the pool's sandboxes
        r = fn_node.run({"language": "python", "source": dirty, "stdin": "a\nb\n"})
        assert r["status"] == "Accepted" and r["stdout"] == "", r
    echo = ("import sys\n"
            "print(sys.stdin.read() + '|' + str(sys.stdout.line_buffering))\n"
            "print('é', file=sys.stderr)\n")
    for _ in range(3):
        r = fn_node.run({"language": "python", "source": echo, "stdin": "x\ny"})
        assert r["stdout"] == "x\ny|False\n" and r["stderr"] == "é\n", r


def test_the_zygote_holds_only_what_a_call_uses(fn_node) -> None:
    """The zygote (every call's fork copies its page tables) is forked before the io
    process imports what only it needs, and the server imports no ``typing``: none of
    them is in a call's child (the preloaded modules are, see above)."""
    src = ("import sys\n"
           "print(sorted(m for m in ('typing', 'shutil', 'bz2', 'lzma', 'fnmatch')"
           " if m in sys.modules))\n")
    for _ in range(2):  # over the pool's sandboxes
        r = fn_node.run({"language": "python", "source": src})
        assert (r["status"], r["stdout"]) == ("Accepted", "[]\n"), r


def test_a_calls_environment_is_its_own_with_the_zygotes_emptied(fn_node) -> None:
    """The zygote empties its environment once; a child sets what its request names and
    nothing of one call's variables is in the next call's (C library's environ too)."""
    src = ("import ctypes, os\n"
           "getenv = ctypes.CDLL(None).getenv\n"
           "getenv.restype = ctypes.c_char_p\n"
           "os.environ['LEFT'] = 'x'\n"
           "print(sorted(os.environ), getenv(b'MINE'), getenv(b'LEFT'))\n")
    for mine in ("1", "2", "3"):
        r = fn_node.run({"language": "python", "source": src, "env": {"MINE": mine}})
        assert r["stdout"] == ("['HOME', 'LANG', 'LC_ALL', 'LEFT', 'MINE', 'PATH'] "
                               f"b'{mine}' b'x'\n"), r


def test_an_environment_and_arguments_past_one_datagram_reach_the_call(fn_node) -> None:
    """A Python call's job for the zygote larger than one datagram (its environment, its
    arguments) goes by a file: the call gets all of it (it used to be an Internal Error)."""
    src = "import os, sys\nprint(len(os.environ['BIG']), len(sys.argv[1]))\n"
    r = fn_node.run({"language": "python", "source": src, "env": {"BIG": "x" * 100_000},
                     "cases": [{"args": ["y" * 70_000]}]})
    assert (r["status"], r["stdout"]) == ("Accepted", "100000 70000\n"), r
    r = fn_node.run({"language": "python", "source": src, "env": {"BIG": "x"},
                     "cases": [{"args": ["y"]}]})
    assert r["stdout"] == "1 1\n", r  # and the next, small one as ever
