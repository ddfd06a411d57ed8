"""The node VM: a production-like node (Debian 12 with systemd, so cgroup v2 unified; the
6.1 LTS cloud kernel with AppArmor enforcing) booted under QEMU, in which edged is installed
from its wheel and a selection of the test suite runs (``scripts/node-vm.sh``)."""
