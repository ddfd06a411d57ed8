#!/bin/sh
# Run inside the node VM's base image while mmdebstrap builds it (a customize hook, in the
# chroot, with the host's network): what a node's administrator does once before installing
# edged. The requirements (edged's dependencies and the test tools, read from pyproject.toml
# by tests/nodevm/image.py, downloaded as wheels on the host into /tmp/nodevm-wheels) go
# into the virtualenv that edged's wheel is later installed into, since the guest has no
# network.
set -eux
echo nodevm > /etc/hostname
printf '127.0.0.1 localhost\n127.0.1.1 nodevm\n::1 localhost ip6-localhost\n' > /etc/hosts
printf '/dev/vda / ext4 rw,relatime,errors=remount-ro 0 1\n' > /etc/fstab
# Production nodes: cgroup v2 unified (systemd's default since 247, said on the kernel
# command line too), AppArmor (the kernel's default LSM here; apparmor.service loads profiles).
systemctl enable nodevm.service
# Quiet, quick boots: no login prompt on the console the tests' progress is written to, no
# periodic jobs during a run.
systemctl mask serial-getty@ttyS0.service getty@tty1.service apt-daily.timer \
  apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer man-db.timer 2>/dev/null || true
# The journal on disk (kept with the results when a run goes wrong), bounded.
mkdir -p /etc/systemd/journald.conf.d
printf '[Journal]\nStorage=persistent\nSystemMaxUse=200M\n' \
  > /etc/systemd/journald.conf.d/nodevm.conf
python3 -m venv /opt/edged
/opt/edged/bin/pip install -q --no-cache-dir --no-index --find-links /tmp/nodevm-wheels \
  -r /tmp/nodevm-wheels/requirements.txt
rm -rf /tmp/nodevm-wheels
