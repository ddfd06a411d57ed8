"""Languages as data: how a FnCall source becomes a run (file name, compile step, run step).

Each :class:`Language` is one row of :data:`LANGUAGES`; nothing else in the backend knows a
language by name. Commands run in the call's working directory (``/tmp/work`` of a pool
sandbox), where the source was written as ``source``; a compile step's ``outputs`` (file
names or ``*``-patterns of the top of that directory) are what it produced and what a kept
compile result (:mod:`edged.backends.fncall.artifacts`) holds, copied into the working
directory of every run. ``python`` needs no program of its own: the call server's zygote
forks a child of its warm, pre-imported interpreter for it
(:mod:`edged.backends.fncall.server`). ``requires``: the program a pool's image must have
for the language to be offered there (``GET /v1/fncalls/languages`` lists those).

The compile and run steps follow what SandboxFusion runs for the same language name
(``g++ -std=c++17``, ``/bin/bash main.sh``, ``javac``/``java -cp . -ea Main``...), with
``-O2`` added for C and C++ as judges compile; ``c`` is ours (SandboxFusion has none).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    """One language. ``compile``/``run``: argv, or None (no compile step; ``run`` None:
    the call server's Python). ``outputs``: what a compile leaves that a run needs.
    ``env``: variables every step gets (over the call's defaults)."""

    name: str
    source: str
    run: tuple[str, ...] | None
    requires: str
    compile: tuple[str, ...] | None = None
    outputs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def compiled(self) -> bool:
        """Whether it has a compile step."""
        return self.compile is not None


LANGUAGES: dict[str, Language] = {lang.name: lang for lang in (
    Language("python", "main.py", None, "/usr/bin/python3"),
    Language("cpp", "main.cpp", ("./main",), "/usr/bin/g++",
             compile=("g++", "-std=c++17", "-O2", "-pipe", "-o", "main", "main.cpp",
                      "-lpthread"),
             outputs=("main",)),
    Language("c", "main.c", ("./main",), "/usr/bin/gcc",
             compile=("gcc", "-std=c11", "-O2", "-pipe", "-o", "main", "main.c", "-lm"),
             outputs=("main",)),
    Language("bash", "main.sh", ("/bin/bash", "main.sh"), "/usr/bin/bash"),
    Language("nodejs", "main.js", ("node", "main.js"), "/usr/bin/node"),
    Language("java", "Main.java", ("java", "-cp", ".", "-ea", "Main"), "/usr/bin/javac",
             compile=("javac", "Main.java"), outputs=("*.class",)),
    Language("go", "main.go", ("./main",), "/usr/bin/go",
             compile=("go", "build", "-o", "main", "main.go"), outputs=("main",),
             env=(("GOCACHE", "/tmp/.gocache"), ("GO111MODULE", "off"))),
    Language("rust", "main.rs", ("./main",), "/usr/bin/rustc",
             compile=("rustc", "-O", "-o", "main", "main.rs"), outputs=("main",)),
)}

#: Names SandboxFusion accepts for the same languages.
ALIASES = {"python3": "python", "c++": "cpp", "js": "nodejs", "sh": "bash"}


def lookup(name: str) -> Language | None:
    """The language called ``name`` (or one of its :data:`ALIASES`), None if unknown."""
    return LANGUAGES.get(ALIASES.get(name, name))



__all__ = ["ALIASES", "LANGUAGES", "Language", "lookup"]
