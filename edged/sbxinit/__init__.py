"""sbx-init, PID 1 of every sandbox whatever its backend: the control protocol
(:mod:`.protocol`, mirrored from ``csrc/sbx-init/protocol.h``), a client over any byte
stream (:mod:`.client`) and the security events it reports (:mod:`.events`)."""

from edged.sbxinit.client import Hello, SbxClient, SbxExec, connect_unix, open_fds

__all__ = ["Hello", "SbxClient", "SbxExec", "connect_unix", "open_fds"]
