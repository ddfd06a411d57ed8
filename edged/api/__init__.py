"""The HTTP API (``/v1``): routes, request validation, one error body shape, the OpenAPI spec
(``openapi.json`` next to this file)."""

from edged.api.app import make_app
from edged.api.common import MANAGER

__all__ = ["MANAGER", "make_app"]
