"""A raw HTTP client for the daemon's socket that checks every response against
edged/api/openapi.json: the operation exists, its status is declared, and JSON/NDJSON bodies
validate against the declared schema."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
from referencing import Registry, Resource

import edged.api
from edged.client._http import UnixConnection

# The spec of the edged under test (a checkout's, or an installed wheel's package data).
SPEC_PATH = Path(edged.api.__file__).resolve().parent / "openapi.json"
SPEC: dict[str, Any] = json.loads(SPEC_PATH.read_text())
_REGISTRY = Registry().with_resource("urn:edged", Resource.from_contents(
    {**SPEC, "$schema": "https://json-schema.org/draft/2020-12/schema"}))


def _template_re(t: str) -> re.Pattern[str]:
    parts = re.split(r"(\{[^}]+\})", t)
    rx = "".join(
        (".+" if p == "{ref}" else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts
    )
    return re.compile(rx + "$")


_TEMPLATES = sorted(((_template_re(t), t) for t in SPEC["paths"]), key=lambda x: -len(x[1]))
COVERED: set[tuple[str, str, int]] = set()


def operation(method: str, path: str) -> tuple[str, dict[str, Any]]:
    for rx, t in _TEMPLATES:
        if rx.match(path):
            op = SPEC["paths"][t].get(method.lower())
            assert op is not None, f"{method} {t} is not in openapi.json"
            return t, op
    raise AssertionError(f"{method} {path}: no path in openapi.json")


def validate(instance: Any, schema: dict[str, Any]) -> None:
    schema = json.loads(json.dumps(schema).replace('"#/components', '"urn:edged#/components'))
    jsonschema.Draft202012Validator(schema, registry=_REGISTRY).validate(instance)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    lines: list[dict[str, Any]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


class Api:
    def __init__(self, sock: str) -> None:
        self.sock = sock

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                check: bool = True) -> Reply:
        conn = UnixConnection(self.sock, 60)
        headers = {}
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        content = resp.read()
        conn.close()
        r = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, content)
        ctype = r.headers.get("content-type", "")
        if "ndjson" in ctype:
            r.lines = [json.loads(x) for x in content.splitlines() if x.strip()]
        if check:
            self.check(method, path, r)
        return r

    def check(self, method: str, path: str, r: Reply) -> None:
        t, op = operation(method, urlsplit(path).path)
        declared = op["responses"].get(str(r.status))
        assert declared is not None, f"{method} {t}: status {r.status} not declared: {r.body!r}"
        COVERED.add((method.upper(), t, r.status))
        if "$ref" in declared:
            declared = SPEC["components"]["responses"][declared["$ref"].rsplit("/", 1)[1]]
        content = declared.get("content", {})
        ctype = r.headers.get("content-type", "").split(";")[0]
        assert ctype in content, f"{method} {t} {r.status}: content type {ctype!r} undeclared"
        schema = content[ctype].get("schema")
        if schema is None:
            return
        if ctype == "application/json":
            validate(json.loads(r.body), schema)
        elif ctype == "application/x-ndjson":
            for line in r.lines:
                validate(line, schema)

    def get(self, path: str, **kw: Any) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return self.request("POST", path, {} if body is None else body, **kw)

    def put(self, path: str, raw: bytes, **kw: Any) -> Reply:
        return self.request("PUT", path, raw=raw, **kw)

    def delete(self, path: str, **kw: Any) -> Reply:
        return self.request("DELETE", path, **kw)
