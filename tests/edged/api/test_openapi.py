"""The spec in the repo and the server's routes agree, both ways."""

from __future__ import annotations

import jsonschema

from edged.api.app import ROUTES
from tests.edged.api.speccheck import SPEC

METHODS = {"get", "post", "put", "delete", "patch"}


def test_every_route_is_in_the_spec_and_back() -> None:
    served = {(m.lower(), p) for m, p, _ in ROUTES}
    spec = {(m, p) for p, item in SPEC["paths"].items() for m in item if m in METHODS}
    assert served == spec


def test_every_operation_declares_errors_with_the_one_shape() -> None:
    for path, item in SPEC["paths"].items():
        for m, op in item.items():
            if m not in METHODS:
                continue
            assert op.get("operationId"), (m, path)
            for status, resp in op["responses"].items():
                if int(status) >= 400:
                    ref = resp.get("$ref") or resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith(("/Error", "/responses/Error")), (m, path, status)
    create = SPEC["paths"]["/v1/sandboxes"]["post"]["responses"]["503"]
    assert "Retry-After" in create["headers"]


def test_spec_is_valid_json_schema() -> None:
    for schema in SPEC["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
