"""seccomp profiles: load and validate ``profiles/seccomp/*.json``, compile to a BPF program.

Profile format (JSON)::

    {"comment": str, "schema": 1, "defaultAction": "allow", "denyErrno": "EPERM",
     "rules": [{"names": [syscall, ...], "action": "deny"|"errno"|"allow"|"log"|"kill",
                "errno": "ENOSYS" (action errno only),
                "args": [{"index": 0..5, "op": "eq"|"masked_eq", "value": int|"0x..",
                          "mask": int|"0x.." (masked_eq), "label": str}],
                "comment": str (required: why the rule exists)}]}

``deny`` is carried out by the deny mode chosen at compile time: ``notify``
(``SECCOMP_RET_USER_NOTIF``: a listener records the attempt in the ledger and answers EPERM; if
the listener is gone the kernel answers ENOSYS, still a denial) or ``errno`` (``SECCOMP_RET_ERRNO``
with ``denyErrno``; observable only in the kernel's seccomp audit log). Argument conditions are
AND-ed and always compared on the low 32 bits (see csrc/include/lfs_seccomp.h).

The compiled program is the raw ``struct sock_filter`` array (8 bytes per instruction) for
x86_64; the spawner installs it with seccomp(2) just before exec (csrc/include/lfs_confine.h).
"""

from __future__ import annotations

import errno as _errno
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.native import ffi, lib, new_error, raise_error
from edged.security.profile import ProfileError, profile_path, profile_problem

_ACTIONS = {"allow": 0, "deny": 1, "errno": 2, "log": 3, "kill": 4}
DENY_MODES = {"notify": 0, "errno": 1}
_OPS = {"eq": 0, "masked_eq": 1}


@dataclass(frozen=True)
class ArgCond:
    """One condition: ``(arg[index] & mask & 0xffffffff) == value``."""

    index: int
    mask: int
    value: int
    label: str


@dataclass(frozen=True)
class Rule:
    """One syscall's rule, flattened from a profile entry (one per name)."""

    name: str
    action: str
    errno: int
    args: tuple[ArgCond, ...]
    comment: str


@dataclass(frozen=True)
class SeccompProfile:
    """A validated seccomp profile. ``digest``: sha256 of the canonical JSON (cache key)."""

    name: str
    default_action: str
    deny_errno: int
    rules: tuple[Rule, ...]
    digest: str

    def denied_syscalls(self) -> set[str]:
        """Names with at least one ``deny`` rule (conditional or not)."""
        return {r.name for r in self.rules if r.action == "deny"}

    def compile(self, deny_mode: str = "notify") -> bytes:
        """The BPF program for this profile (cached per profile digest and mode).

        Raises :class:`ProfileError` (a ``ValueError``) for an unknown mode or a rule
        libseccomp refuses."""
        if deny_mode not in DENY_MODES:
            raise ProfileError(f"seccomp deny mode {deny_mode!r}: not one of {sorted(DENY_MODES)}")
        return _compile_cached(self, deny_mode)


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool):
        raise ProfileError(f"{where}: {v!r} is not an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            pass
    raise ProfileError(f"{where}: {v!r} is not an integer")


def _errno_value(v: Any, where: str) -> int:
    if isinstance(v, str) and isinstance(getattr(_errno, v, None), int) and v.startswith("E"):
        return int(getattr(_errno, v))
    n = _int(v, where)
    if not 0 < n < 4096:
        raise ProfileError(f"{where}: errno {n} out of range")
    return n


def _resolve(name: str) -> int:
    return int(lib.lfs_seccomp_resolve(name.encode(), new_error()))


def parse(doc: Any, name: str = "<profile>") -> SeccompProfile:
    """Validate a decoded profile document and return it.

    Raises :class:`ProfileError` naming the first problem: unknown key, missing comment, a
    syscall this architecture lacks, a bad action, errno, index or value."""
    if not isinstance(doc, dict):
        raise ProfileError(f"seccomp profile {name}: not a JSON object")
    unknown = set(doc) - {"comment", "schema", "defaultAction", "denyErrno", "rules"}
    if unknown:
        raise ProfileError(f"seccomp profile {name}: unknown keys {sorted(unknown)}")
    if doc.get("schema") != 1:
        raise ProfileError(f"seccomp profile {name}: schema must be 1")
    default = doc.get("defaultAction")
    if default not in ("allow", "deny", "log", "kill"):
        raise ProfileError(f"seccomp profile {name}: defaultAction {default!r} is not valid")
    deny_errno = _errno_value(doc.get("denyErrno", "EPERM"), f"seccomp profile {name}: denyErrno")
    rules_doc = doc.get("rules")
    if not isinstance(rules_doc, list):
        raise ProfileError(f"seccomp profile {name}: rules must be a list")
    rules: list[Rule] = []
    for i, r in enumerate(rules_doc):
        where = f"seccomp profile {name}: rule {i}"
        if not isinstance(r, dict):
            raise ProfileError(f"{where}: not an object")
        unknown = set(r) - {"names", "action", "errno", "args", "comment"}
        if unknown:
            raise ProfileError(f"{where}: unknown keys {sorted(unknown)}")
        comment = r.get("comment")
        if not isinstance(comment, str) or len(comment.strip()) < 10:
            raise ProfileError(f"{where}: every rule needs a comment saying why")
        action = r.get("action")
        if action not in _ACTIONS:
            raise ProfileError(f"{where}: action {action!r} is not one of {sorted(_ACTIONS)}")
        err = 0
        if action == "errno":
            err = _errno_value(r.get("errno"), f"{where}: errno")
        elif "errno" in r:
            raise ProfileError(f"{where}: errno is only for action 'errno'")
        conds: list[ArgCond] = []
        args = r.get("args", [])
        if not isinstance(args, list) or len(args) > 6:
            raise ProfileError(f"{where}: args must be a list of at most 6 conditions")
        for j, a in enumerate(args):
            aw = f"{where} arg {j}"
            if not isinstance(a, dict) or set(a) - {"index", "op", "value", "mask", "label"}:
                raise ProfileError(f"{aw}: bad condition {a!r}")
            index = _int(a.get("index"), f"{aw} index")
            if not 0 <= index <= 5:
                raise ProfileError(f"{aw}: index {index} not in 0..5")
            op = a.get("op", "eq")
            if op not in _OPS:
                raise ProfileError(f"{aw}: op {op!r} is not one of {sorted(_OPS)}")
            mask = _int(a["mask"], f"{aw} mask") if op == "masked_eq" else 0xFFFFFFFF
            if op == "eq" and "mask" in a:
                raise ProfileError(f"{aw}: mask is only for op 'masked_eq'")
            value = _int(a.get("value"), f"{aw} value")
            if not 0 <= mask <= 0xFFFFFFFF or not 0 <= value <= 0xFFFFFFFF or value & ~mask:
                raise ProfileError(
                    f"{aw}: value {value:#x} / mask {mask:#x} must be 32-bit, value within mask"
                )
            conds.append(ArgCond(index, mask, value, str(a.get("label", ""))))
        names = r.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ProfileError(f"{where}: names must be a non-empty list of syscall names")
        for n in names:
            if _resolve(n) < 0:
                raise ProfileError(f"{where}: syscall {n!r} does not exist on this architecture")
            rules.append(Rule(n, action, err, tuple(conds), comment))
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return SeccompProfile(
        name=name,
        default_action=default,
        deny_errno=deny_errno,
        rules=tuple(rules),
        digest=hashlib.sha256(canon).hexdigest(),
    )


def load(name: str = "default") -> SeccompProfile:
    """Load and validate the profile ``profiles/seccomp/<name>.json`` (or a path).

    Raises :class:`ProfileError` for a missing, unparsable or invalid profile."""
    path = profile_path("seccomp", name, ".json")
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"seccomp profile {name!r}: {profile_problem(e)}") from e
    return parse(doc, name)


@functools.lru_cache(maxsize=64)
def _compile_cached(profile: SeccompProfile, deny_mode: str) -> bytes:
    rules = ffi.new("struct lfs_scmp_rule[]", max(1, len(profile.rules)))
    keep = []
    for i, r in enumerate(profile.rules):
        cname = ffi.new("char[]", r.name.encode())
        keep.append(cname)
        rules[i].name = cname
        rules[i].action = _ACTIONS[r.action]
        rules[i].errno_ret = r.errno
        rules[i].nargs = len(r.args)
        for j, a in enumerate(r.args):
            rules[i].args[j].index = a.index
            rules[i].args[j].op = _OPS["masked_eq"]
            rules[i].args[j].mask = a.mask
            rules[i].args[j].value = a.value
    out = ffi.new("uint8_t **")
    out_len = ffi.new("size_t *")
    err = new_error()
    rc = lib.lfs_seccomp_compile(
        rules,
        len(profile.rules),
        _ACTIONS[profile.default_action],
        DENY_MODES[deny_mode],
        profile.deny_errno,
        out,
        out_len,
        err,
    )
    if rc < 0:
        if int(err.code) == _errno.EINVAL:
            raise ProfileError(
                f"seccomp profile {profile.name}: " + ffi.string(err.msg).decode("utf-8", "replace")
            )
        raise_error(err, f"compile seccomp profile {profile.name}")
    prog = ffi.gc(out[0], lib.lfs_seccomp_free)  # the C buffer goes with its owner
    return bytes(ffi.buffer(prog, out_len[0]))


def syscall_name(nr: int) -> str:
    """Name of x86_64 syscall number ``nr`` (``"syscall_<nr>"`` if unknown). Built once from
    the names the default profile's architecture resolves (via libseccomp)."""
    return _syscall_names().get(nr, f"syscall_{nr}")


@functools.cache
def _syscall_names() -> dict[int, str]:
    import re

    names: dict[int, str] = {}
    try:
        text = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h").read_text()
        for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", text):
            names[int(m.group(2))] = m.group(1)
    except OSError:
        pass
    for p in (load().rules if (profile_path("seccomp", "default", ".json")).exists() else ()):
        names.setdefault(_resolve(p.name), p.name)
    return names
