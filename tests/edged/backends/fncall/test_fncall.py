"""FnCall end to end through the daemon's ``POST /v1/fncalls``: verdicts, compile once and
run many, files in and out, clean scratch between calls, leftovers, bad input,
backpressure. A real daemon, real pool sandboxes (root, mounts)."""

from __future__ import annotations

import base64
import concurrent.futures
import time

import pytest

pytestmark = [pytest.mark.root, pytest.mark.mount]

ADD = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<\"\\n\";}\n"


def test_python_accepted_with_stdin_and_figures(fn_node) -> None:
    r = fn_node.run({"language": "python", "source":
                     "import sys\nprint(sys.stdin.read().strip()[::-1])", "stdin": "abc\n"})
    assert (r["status"], r["exit_code"], r["stdout"], r["stderr"]) == ("Accepted", 0, "cba\n", "")
    assert 0 < r["cpu_s"] < 5 and 0 < r["wall_s"] < 10 and r["memory_bytes"] > 1 << 20


@pytest.mark.parametrize("source, status, field, value", [
    ("import sys; sys.exit(3)", "Nonzero Exit Status", "exit_code", 3),
    ("raise ValueError('boom')", "Nonzero Exit Status", "exit_code", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "Signalled", "signal", 11),
    ("while True: pass", "Time Limit Exceeded", "exit_code", None),
    ("import time; time.sleep(30)", "Time Limit Exceeded", "exit_code", None),
    ("print('x' * 3000, end='')", "Output Limit Exceeded", "stdout_truncated", True),
    ("b = bytearray(400 << 20); print(len(b))", "Memory Limit Exceeded", "exit_code", None),
    ("import ctypes, sys; sys.exit(ctypes.CDLL(None).syscall(250, 0, 0, 0, 0, 0) < 0)",
     "Dangerous Syscall", "exit_code", 1),  # keyctl: denied (EPERM), then it fails
])
def test_verdicts(fn_node, source, status, field, value) -> None:
    r = fn_node.run({"language": "python", "source": source,
                     "limits": {"cpu_s": 1, "wall_s": 2, "output_bytes": 1000}})
    assert r["status"] == status, r
    assert r[field] == value, r
    if status == "Output Limit Exceeded":
        assert r["stdout"] == "x" * 1000
    if "boom" in source:
        assert "ValueError: boom" in r["stderr"] and "fncall" not in r["stderr"]


def test_cpp_compile_once_run_many(fn_node) -> None:
    cases = [{"stdin": f"{i} {i * 10}"} for i in range(20)]
    rep = fn_node.call({"language": "cpp", "source": ADD, "cases": cases, "keep": True})
    assert rep["compile"]["status"] == "Accepted"
    assert [r["stdout"] for r in rep["results"]] == [f"{i * 11}\n" for i in range(20)]
    assert all(r["status"] == "Accepted" for r in rep["results"])
    art = rep["artifact"]
    assert art["id"].startswith("art-") and 0 < art["ttl_s"] <= 300
    again = fn_node.call({"artifact": art["id"], "cases": [{"stdin": "2 3"}, {"stdin": "x"}]})
    assert again["compile"] is None
    assert [r["stdout"] for r in again["results"]] == ["5\n", "0\n"]
    status, body, _ = fn_node.request("POST", "/v1/fncalls", {"artifact": "art-nope"})
    assert status == 404 and body["error"]["code"] == "not_found"


def test_c_and_compile_error(fn_node) -> None:
    r = fn_node.run({"language": "c", "source":
                     "#include <stdio.h>\n#include <math.h>\nint main(){printf(\"%.1f\\n\","
                     " sqrt(2.0)*sqrt(2.0));return 0;}"})
    assert (r["status"], r["stdout"]) == ("Accepted", "2.0\n")
    rep = fn_node.call({"language": "cpp", "source": "int main() { return x; }"})
    assert rep["compile"]["status"] == "Nonzero Exit Status"
    assert "error" in rep["compile"]["stderr"] and rep["results"] == []


def test_bash_argv_files_in_and_out(fn_node) -> None:
    data = bytes(range(256)) * 10
    r = fn_node.run({"language": "bash",
                     "source": "cat in/data.bin | wc -c; mkdir -p out; echo made > out/x.txt;"
                               " cp in/data.bin copy.bin",
                     "files": {"in/data.bin": base64.b64encode(data).decode()},
                     "fetch": ["out/x.txt", "copy.bin", "missing", "../../etc/passwd"]})
    assert r["status"] == "Accepted" and r["stdout"] == "2560\n", r
    assert base64.b64decode(r["files"]["out/x.txt"]) == b"made\n"
    assert base64.b64decode(r["files"]["copy.bin"]) == data
    assert set(r["files"]) == {"out/x.txt", "copy.bin"}  # absent, outside: not there
    r = fn_node.run({"argv": ["/bin/true"]})
    assert (r["status"], r["exit_code"]) == ("Accepted", 0)
    r = fn_node.run({"argv": ["/bin/sh", "-c", "exit 7"]})
    assert (r["status"], r["exit_code"]) == ("Nonzero Exit Status", 7)


def test_nothing_of_one_call_is_seen_by_the_next(fn_node) -> None:
    """Each call writes what it can where it can; no later call (over every pool sandbox,
    several rounds) sees any of it, and nothing outside /tmp and /dev/shm can be written."""
    probe = ("import os, glob\n"
             "seen = sorted(glob.glob('/tmp/**', recursive=True) + glob.glob('/dev/shm/*'))\n"
             "print([p for p in seen if 'mark' in p])\n"
             "open('/tmp/mark-%d' % os.getpid(), 'w').write('x')\n"
             "open('/dev/shm/mark-%d' % os.getpid(), 'w').write('x')\n"
             "os.makedirs('/tmp/work/mark-dir/sub')\n"
             "bad = []\n"
             "for p in ('/var/tmp/mark', '/etc/mark', '/root/mark', '/usr/mark', '/mark',\n"
             "          '/run/lock/mark', '/home/mark'):\n"
             "    try:\n"
             "        open(p, 'w'); bad.append(p)\n"
             "    except OSError:\n"
             "        pass\n"
             "print(bad)\n")
    for _ in range(6):
        r = fn_node.run({"language": "python", "source": probe})
        assert r["stdout"] == "[]\n[]\n", r


def test_leftover_processes_replace_the_sandbox(fn_node) -> None:
    """A call that leaves a daemon behind: the call's verdict is its own; its pool sandbox
    is removed (everything in it killed through its cgroups) and replaced; the next calls
    never see the daemon."""
    be = fn_node.backend()
    pool = be.pools["default"]
    before = pool.stats.get("replaced_leftovers", 0)
    r = fn_node.run({"language": "bash", "source": "(setsid sleep 1000 &) ; echo started"})
    assert (r["status"], r["stdout"]) == ("Accepted", "started\n")
    deadline = time.monotonic() + 30
    while pool.stats.get("replaced_leftovers", 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats["replaced_leftovers"] == before + 1
    for _ in range(4):
        r = fn_node.run({"language": "bash", "source": "ps -eo user,comm | grep -c sleep"})
        assert r["stdout"] == "0\n", r


def test_fork_bomb_and_disk_fill_leave_nothing(fn_node) -> None:
    r = fn_node.run({"language": "bash", "source": "f(){ f | f & }; f; sleep 1",
                     "limits": {"cpu_s": 2, "wall_s": 3}})
    assert r["status"] in ("Accepted", "Time Limit Exceeded", "Nonzero Exit Status",
                           "Signalled"), r
    r = fn_node.run({"language": "bash", "source": "yes > /tmp/fill; df -k /tmp | tail -1",
                     "limits": {"file_bytes": 1 << 30, "wall_s": 20, "cpu_s": 10}})
    assert r["status"] in ("Nonzero Exit Status", "Accepted"), r
    for _ in range(4):
        r = fn_node.run({"language": "bash", "source": "ls /tmp/fill 2>/dev/null | wc -l;"
                         " ps -e | wc -l"})
        lines = r["stdout"].split()
        assert lines[0] == "0" and int(lines[1]) < 12, r


@pytest.mark.parametrize("body, field", [
    ({"language": "cobol", "source": "x"}, "cobol"),
    ({"language": "python"}, "exactly one"),
    ({"source": "x"}, "language"),
    ({"argv": []}, "argv"),
    ({"language": "python", "source": "x", "files": {"a": "%%%"}}, "base64"),
    ({"language": "python", "source": "x", "files": {"../a": "eA=="}}, "../a"),
    ({"language": "python", "source": "x", "limits": {"cpu_s": -1}}, "cpu_s"),
    ({"language": "python", "source": "x", "limits": {"nope": 1}}, "nope"),
    ({"language": "python", "source": "x", "cases": []}, "cases"),
    ({"language": "python", "source": "x", "stdin": "a", "cases": [{}]}, "stdin or cases"),
    ({"language": "python", "source": "x", "bogus": 1}, "bogus"),
])
def test_bad_input_is_a_clear_400(fn_node, body, field) -> None:
    status, rep, _ = fn_node.request("POST", "/v1/fncalls", body)
    assert status == 400, rep
    assert field in rep["error"]["message"]


def test_languages_listed(fn_node) -> None:
    status, langs, _ = fn_node.request("GET", "/v1/fncalls/languages")
    assert status == 200
    assert {k for k, v in langs.items() if v["available"]} >= {"python", "cpp", "c", "bash"}
    assert langs["java"]["available"] is False  # the image has no javac


def test_backpressure_is_a_503_with_retry_after(fn_node_factory) -> None:
    node = fn_node_factory(fncall_pool=1, fncall_queue=1, fncall_listen="", api_keys_file="")
    node.run({"argv": ["/bin/true"]})  # its one sandbox is up
    slow = {"language": "python", "source": "import time; time.sleep(1.5)"}
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda _: node.request("POST", "/v1/fncalls", slow), range(6)))
    codes = sorted(s for s, _, _ in got)
    assert codes.count(200) >= 2 and 503 in codes, codes
    refused = next(g for g in got if g[0] == 503)
    assert refused[1]["error"]["code"] == "capacity_exhausted"
    assert int(refused[2]["Retry-After"]) >= 1


def test_a_pool_sandbox_deleted_under_it_is_replaced(fn_node) -> None:
    """Someone deletes the pool's sandboxes through the sandbox API: the next calls are
    served by new ones, never answered with the dead ones' Internal Error."""
    pool = fn_node.backend().pools["default"]
    fn_node.run({"argv": ["/bin/true"]})
    status, listing, _ = fn_node.request("GET", "/v1/sandboxes?label=edged.fncall.pool=default")
    assert status == 200 and listing["sandboxes"]
    for rec in listing["sandboxes"]:
        assert fn_node.request("DELETE", f"/v1/sandboxes/{rec['id']}")[0] == 200
    time.sleep(0.5)  # the servers' ends reach the pool
    for _ in range(4):
        assert fn_node.run({"argv": ["/bin/true"]})["status"] == "Accepted"
    assert pool.stats.get("replaced_died", 0) >= 1


def test_the_wipe_removes_links_not_what_they_point_to(fn_node) -> None:
    """What a call leaves in /tmp and /dev/shm (symlinks to directories and files, one
    dangling, a FIFO, a directory it made unreadable, a deep tree) is gone for the next
    call; what the links pointed to outside the scratch is not touched."""
    plant = ("import os\n"
             "os.symlink('/usr/bin', '/tmp/to-dir')\n"
             "os.symlink('/etc/passwd', '/tmp/work/to-file')\n"
             "os.symlink('/nonexistent', '/dev/shm/dangling')\n"
             "os.mkfifo('/tmp/fifo')\n"
             "os.makedirs('/tmp/locked/inner'); open('/tmp/locked/inner/f', 'w').close()\n"
             "os.chmod('/tmp/locked/inner', 0); os.chmod('/tmp/locked', 0)\n"
             "os.makedirs('/tmp/deep/' + '/'.join(['d'] * 40))\n"
             "print('planted')\n")
    look = ("import os\n"
            "print(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')),\n"
            "      os.path.isdir('/usr/bin'), os.path.isfile('/etc/passwd'))\n")
    for _ in range(2):  # over the pool's sandboxes
        r = fn_node.run({"language": "python", "source": plant})
        assert r["stdout"] == "planted\n", r
    for _ in range(4):
        r = fn_node.run({"language": "python", "source": look})
        assert r["stdout"] == "['work'] ['.fncall'] True True\n", r  # the server's


def test_system_v_ipc_left_replaces_the_sandbox(fn_node) -> None:
    """A call that leaves a System V shared memory segment (it would outlive the call,
    and only its owner may remove it): its pool sandbox is replaced."""
    pool = fn_node.backend().pools["default"]
    before = pool.stats.get("replaced_ipc", 0)
    src = ("import ctypes\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "print(libc.shmget(0, 4096, 0o1600) >= 0)  # IPC_PRIVATE, IPC_CREAT | 0600\n")
    r = fn_node.run({"language": "python", "source": src})
    assert (r["status"], r["stdout"]) == ("Accepted", "True\n"), r
    deadline = time.monotonic() + 30
    while pool.stats.get("replaced_ipc", 0) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats.get("replaced_ipc", 0) == before + 1
    look = "print(open('/proc/sysvipc/shm').read().count(chr(10)))\n"
    for _ in range(3):
        assert fn_node.run({"language": "python", "source": look})["stdout"] == "1\n"
