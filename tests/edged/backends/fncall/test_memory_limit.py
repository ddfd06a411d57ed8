"""A run past its own memory limit (``limits.memory_bytes``, its RLIMIT_AS) is Memory Limit
Exceeded in every language, as go-judge reports it, not the runtime error the failed
allocation makes; a run under it, or failing for another reason, keeps its verdict.
A real daemon, real pool sandboxes (root, mounts)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.mount]

LIMITS = {"cpu_s": 5, "wall_s": 10, "memory_bytes": 64 << 20}

OVER = {
    "python": "b = bytearray(200 << 20)\nprint(len(b))\n",
    "cpp": "#include <vector>\n#include <cstdio>\nint main(){std::vector<char> v(200 << 20, 1);"
           " std::printf(\"%d\\n\", v[7]);}\n",
    "c": "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\nint main(void){"
         "char *p = malloc(200 << 20); if (!p) { perror(\"malloc\"); return 1; }"
         " memset(p, 1, 200 << 20); printf(\"%d\\n\", p[7]); return 0; }\n",
}
UNDER = {
    "python": "b = bytearray(8 << 20)\nprint(len(b))\n",
    "cpp": "#include <vector>\n#include <cstdio>\nint main(){std::vector<char> v(8 << 20, 1);"
           " std::printf(\"%d\\n\", v[7]);}\n",
    "c": "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\nint main(void){"
         "char *p = malloc(8 << 20); if (!p) return 1; memset(p, 1, 8 << 20);"
         " printf(\"%d\\n\", p[7]); return 0; }\n",
}


@pytest.mark.parametrize("language", sorted(OVER))
def test_past_the_memory_limit_is_memory_limit_exceeded(fn_node, language) -> None:
    r = fn_node.run({"language": language, "source": OVER[language], "limits": LIMITS})
    assert r["status"] == "Memory Limit Exceeded", r
    assert r["stdout"] == "", r


@pytest.mark.parametrize("language", sorted(UNDER))
def test_under_the_memory_limit_is_accepted(fn_node, language) -> None:
    r = fn_node.run({"language": language, "source": UNDER[language], "limits": LIMITS})
    assert r["status"] == "Accepted", r
    assert r["stdout"].strip() in ("8388608", "1"), r


def test_other_failures_keep_their_verdict_under_a_memory_limit(fn_node) -> None:
    r = fn_node.run({"language": "python", "source": "raise ValueError('no')",
                     "limits": LIMITS})
    assert (r["status"], r["exit_code"]) == ("Nonzero Exit Status", 1), r
    r = fn_node.run({"language": "python", "source": "print('MemoryError')", "limits": LIMITS})
    assert r["status"] == "Accepted", r  # the words on stdout of a run that succeeded
