"""MicroVM sandboxes: the same EROFS layers as read-only virtio-blk disks, overlayfs inside
the guest, sbx-init as the guest's PID 1 over virtio-serial, created by cloning a booted
template (:mod:`.template`) behind a VMM interface (:mod:`.vmm`; QEMU in :mod:`.qemu`)."""
