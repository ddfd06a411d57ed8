"""Container sandboxes: namespaces + id-mapped overlay rootfs made by the C spawner
(``csrc/spawner``), run by sbx-init (``csrc/sbx-init``) as PID 1, limited by cgroups."""

from edged.backends.container.backend import ContainerBackend

__all__ = ["ContainerBackend"]
