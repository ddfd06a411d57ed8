"""Images (``name:tag`` → layer digests, bottom first) and the node's layer mounts."""

from edged.images.mounts import LayerMounts
from edged.images.registry import ImageRegistry, check_digest, check_ref

__all__ = ["ImageRegistry", "LayerMounts", "check_digest", "check_ref"]
