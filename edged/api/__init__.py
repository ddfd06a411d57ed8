"""The HTTP API (``/v1``): routes, request validation, one error body shape, the OpenAPI spec
(``openapi.json`` next to this file)."""

from edged.api.app import MANAGER, make_app

__all__ = ["MANAGER", "make_app"]
