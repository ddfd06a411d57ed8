"""layerfs: content-addressed EROFS layers for sandbox root filesystems.

Builds deterministic EROFS images from directories, tar streams and OCI image layouts
(:mod:`layerfs.build`), keeps them as zstd-compressed, deduplicated chunks
(:mod:`layerfs.store`), and serves them to the kernel. Knows nothing of the daemon.
"""

from layerfs.errors import LayerfsError

__all__ = ["LayerfsError"]
__version__ = "0.1.0"
