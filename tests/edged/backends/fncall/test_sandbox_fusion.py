"""The ``sandbox-fusion`` client from PyPI, unchanged, against our ``/run_code`` listener:
every language shipped, with the verdicts SandboxFusion gives (accepted, wrong exit, time
limit, memory limit, output limit, compile error, runtime error, files in and out), and API
keys (the client sends no headers of its own: the key goes in its endpoint URL, which
``requests`` sends as HTTP Basic auth)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

from tests.edged.backends.fncall.conftest import KEY

sandbox_fusion = pytest.importorskip("sandbox_fusion", reason="needs the sandbox-fusion client "
                                     "(pip install sandbox-fusion: the test extra)")
from sandbox_fusion import RunCodeRequest, RunStatus, run_code  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.mount]


def _endpoint(node, key: str = KEY) -> str:
    return f"http://key:{key}@127.0.0.1:{node.port}"


def _run(node, **kw):
    return run_code(RunCodeRequest(**kw), endpoint=_endpoint(node), max_attempts=1,
                    client_timeout=60)


@pytest.mark.parametrize("language, code, out", [
    ("python", "print(input()[::-1])", "cba\n"),
    ("cpp", "#include <iostream>\n#include <string>\nint main(){std::string s;std::cin>>s;"
            "std::cout<<std::string(s.rbegin(),s.rend())<<std::endl;}", "cba\n"),
    ("bash", "read x; echo $x | rev", "cba\n"),
])
def test_accepted_every_language(fn_node, language, code, out) -> None:
    r = _run(fn_node, language=language, code=code, stdin="abc\n")
    assert r.status == RunStatus.Success, r
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == out and r.run_result.execution_time > 0
    assert (r.compile_result is not None) == (language == "cpp")


@pytest.mark.parametrize("language, code", [
    ("python", "import sys; print('out'); sys.exit(2)"),
    ("cpp", "#include <cstdio>\nint main(){puts(\"out\");return 2;}"),
    ("bash", "echo out; exit 2"),
])
def test_wrong_exit(fn_node, language, code) -> None:
    r = _run(fn_node, language=language, code=code)
    assert r.status == RunStatus.Failed
    assert (r.run_result.status, r.run_result.return_code, r.run_result.stdout) == \
        ("Finished", 2, "out\n")


def test_runtime_error_and_signal(fn_node) -> None:
    r = _run(fn_node, language="python", code="1/0")
    assert r.status == RunStatus.Failed and r.run_result.return_code == 1
    assert "ZeroDivisionError" in r.run_result.stderr
    r = _run(fn_node, language="cpp", code="int main(){int *p=nullptr; return *p;}")
    assert r.status == RunStatus.Failed and r.run_result.return_code == -11  # SIGSEGV


@pytest.mark.parametrize("language, code", [
    ("python", "while True: pass"),
    ("cpp", "int main(){volatile long i=0; for(;;) i++;}"),
    ("bash", "while :; do :; done"),
])
def test_time_limit(fn_node, language, code) -> None:
    r = _run(fn_node, language=language, code=code, run_timeout=1)
    assert r.status == RunStatus.Failed
    assert r.run_result.status == "TimeLimitExceeded" and r.run_result.return_code is None


def test_memory_limit(fn_node) -> None:
    """Past the pool sandbox's memory: killed by its OOM killer (SIGKILL), as a memory
    cgroup kills in SandboxFusion."""
    r = _run(fn_node, language="python", code="b = bytearray(400 << 20)\nprint(len(b))")
    assert r.status == RunStatus.Failed
    assert r.run_result.status == "Finished" and r.run_result.return_code == -9


def test_memory_limit_mb_is_an_address_space_limit(fn_node) -> None:
    """``memory_limit_MB`` (the server's field; this client version does not send it): as
    SandboxFusion applies it, an address-space rlimit: MemoryError, exit status 1."""
    body = {"language": "python", "code": "b = bytearray(200 << 20)", "memory_limit_MB": 64}
    status, rep = _post(fn_node, body)
    assert status == 200 and rep["status"] == "Failed", rep
    assert rep["run_result"]["return_code"] == 1 and "MemoryError" in rep["run_result"]["stderr"]


def test_output_limit(fn_node) -> None:
    """Outputs are cut at 1 MiB each, as SandboxFusion reads them (no failure of its own
    there); a file past the largest a run may write stops the program (EFBIG)."""
    r = _run(fn_node, language="python", code="import sys\nsys.stdout.write('x' * (3 << 20))")
    assert r.status == RunStatus.Success
    assert r.run_result.stdout == "x" * (1 << 20)
    r = _run(fn_node, language="python", code="open('big', 'wb').write(b'x' * (40 << 20))")
    assert r.status == RunStatus.Failed and "File too large" in r.run_result.stderr


def test_compile_error(fn_node) -> None:
    r = _run(fn_node, language="cpp", code="int main() { return undeclared; }")
    assert r.status == RunStatus.Failed
    assert r.run_result is None
    assert r.compile_result.status == "Finished" and r.compile_result.return_code != 0
    assert "undeclared" in r.compile_result.stderr


def test_files_in_and_out(fn_node) -> None:
    r = _run(fn_node, language="python",
             code="d = open('data/in.txt').read()\nopen('out.txt', 'w').write(d.upper())",
             files={"data/in.txt": base64.b64encode(b"hello").decode(), "skip": None},
             fetch_files=["out.txt", "nothere.txt"])
    assert r.status == RunStatus.Success, r
    assert base64.b64decode(r.files["out.txt"]) == b"HELLO"
    assert "nothere.txt" not in r.files


def _post(node, body, key: str | None = KEY, header: str = "X-API-Key"):
    req = urllib.request.Request(f"http://127.0.0.1:{node.port}/run_code",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    if key is not None:
        req.add_header(header, key if header != "Authorization" else f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_c_and_headers_for_the_key(fn_node) -> None:
    """``c`` is ours (the client's language list lacks it); X-API-Key and Bearer work too."""
    body = {"language": "c", "code": "#include <stdio.h>\nint main(){puts(\"c!\");}"}
    for header in ("X-API-Key", "Authorization"):
        status, rep = _post(fn_node, body, header=header)
        assert status == 200 and rep["status"] == "Success", rep
        assert rep["run_result"]["stdout"] == "c!\n"


def test_api_key_required(fn_node) -> None:
    body = {"language": "python", "code": "print(1)"}
    assert _post(fn_node, body, key=None)[0] == 401
    assert _post(fn_node, body, key="wrong-key-0123456789")[0] == 401
    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(language="python", code="print(1)"),
                 endpoint=_endpoint(fn_node, "not-the-key-000000"), max_attempts=1)


def test_bad_body_is_a_422(fn_node) -> None:
    status, rep = _post(fn_node, {"language": "python"})
    assert status == 422 and "code" in rep["detail"][0]["msg"]
    status, rep = _post(fn_node, {"language": "cobol", "code": "x"})
    assert status == 422 and "cobol" in rep["detail"][0]["msg"]
