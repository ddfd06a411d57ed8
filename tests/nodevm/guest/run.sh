#!/bin/bash
# The node VM's run (on the payload disk, made from the checkout for every run; started by
# nodevm.service after boot): record what this node is, install edged from its wheel the
# way README "Install as software" says, enable and start edged.service, run the selected
# tests, write everything to the results disk and power off. Lines starting "nodevm:" on
# the console are what the host (tests/nodevm/driver.py) waits for.
set -u
P=/mnt/payload
R=/var/tmp/nodevm-results
RESULTS_DEV=/dev/disk/by-id/virtio-results
mkdir -p "$R"
say() { echo "nodevm: $*"; }
# Bounds for an emulated node (tests/timing.py, layerfs.lazy.client.START_WAIT_S): only
# bounds, every wait still ends as soon as what it waits for is there.
TIME_SCALE=6
# (pytest-timeout's 600 s a test, pyproject.toml, scaled as well: the fork-bomb test's own
# bound is 600 s scaled, and its 160 attempts took past 600 s in the whole run at 02:0x)
LAZY_START_WAIT_S=120
# edged.sbxinit.client.END_GRACE_S: an exec's end may come this long after its timeout
# before the daemon ends it (a throttled sbx-init in an emulated guest drains slowly)
EXEC_END_GRACE_S=120
# A quarter of the rounds of repetition-heavy tests (tests/timing.py REPEATS): here they are
# for this kernel's code paths; how often a race shows is measured on the host.
REPEATS=0.25
finish() {
  # Whatever happened: the results out, then power off (the host waits for QEMU to end).
  say "collecting results"
  journalctl -b --no-pager -o short-monotonic > "$R/journal.txt" 2>&1
  journalctl -b --no-pager -u edged > "$R/edged.journal.txt" 2>&1
  dmesg > "$R/dmesg.txt" 2>&1
  cp /proc/loadavg "$R/loadavg.txt"
  # where the memory is (a global OOM's report leaves vmalloc, per-cpu memory and zram out)
  { echo "## meminfo"; cat /proc/meminfo; echo "## cgroup.stat"; cat /sys/fs/cgroup/cgroup.stat
    echo "## zram mm_stat"; grep -H . /sys/block/zram*/mm_stat /sys/block/zram*/disksize
    echo "## vmalloc by caller (KiB)"
    awk '{ s[$3] += $2 } END { for (c in s) printf "%d %s\n", s[c] / 1024, c }' \
      /proc/vmallocinfo | sort -rn | head -20
  } > "$R/memory.txt" 2>&1
  echo "${1:-0}" > "$R/run-status"
  tar -C "$R" -cf "$RESULTS_DEV" . && sync
  say "done $1"
  systemctl --no-block poweroff
  exit 0
}
say "started $(uname -r) $(cut -d' ' -f1 /proc/uptime)s after boot"

# ---- what this node is --------------------------------------------------------------
{
  echo "kernel=$(uname -r)"
  echo "cgroup_fs=$(stat -fc %T /sys/fs/cgroup)"
  echo "cgroup_controllers=$(cat /sys/fs/cgroup/cgroup.controllers 2>/dev/null)"
  echo "apparmor_enabled=$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)"
  echo "apparmor_mode=$(cat /sys/module/apparmor/parameters/mode 2>/dev/null)"
  echo "lsm=$(cat /sys/kernel/security/lsm 2>/dev/null)"
  echo "apparmor_profiles=$(wc -l < /sys/kernel/security/apparmor/profiles 2>/dev/null)"
  echo "nproc=$(nproc)"
  echo "memory_kib=$(awk '/MemTotal/ {print $2}' /proc/meminfo)"
  echo "systemd=$(systemctl --version | head -1)"
} > "$R/node.txt"
cat "$R/node.txt"
# What this kernel's AppArmor mediates (the parser downgrades rules it cannot enforce).
for f in $(find /sys/kernel/security/apparmor/features -type f | sort); do
  echo "$f: $(tr '\n' ' ' < "$f")"
done > "$R/apparmor-features.txt" 2>&1

# ---- what a node's administrator prepares ----------------------------------------------
# zram for edged's swap (edged/node/swap.py hot-adds devices of its own; num_devices=0: no
# zram0), as /etc/modules-load.d would on a node; loop and erofs load on demand.
modprobe zram num_devices=0 || say "no zram module"
# IPv6 forwarding for the sandboxes' networks: before Linux 6.17 there is no per-interface
# switch (force_forwarding), only the host's own, which a router node turns on (edged never
# does: README "The node VM"; this guest has no uplink whose router advertisements it
# would then ignore).
sysctl -qw net.ipv6.conf.all.forwarding=1 || say "cannot turn IPv6 forwarding on"

# ---- install edged as a user would ----------------------------------------------------
# (The virtualenv /opt/edged already holds edged's dependencies: the guest has no network.)
t0=$(date +%s)
set -o pipefail
if ! /opt/edged/bin/pip install --no-index "$P"/dist/edged-*.whl > "$R/install.txt" 2>&1; then
  say "pip install of the wheel failed"; cat "$R/install.txt"; finish 2
fi
getent group edged > /dev/null || groupadd --system edged
install -m 0644 /opt/edged/lib/python3*/site-packages/edged/_systemd/edged.service \
  /etc/systemd/system/edged.service
# This node is emulated (TCG on a shared host: several times slower than a real one): the
# lazy layer server's start gets longer than its 20 s default, here and in the tests.
mkdir -p /etc/systemd/system/edged.service.d
printf '[Service]\nEnvironment=LAYERFS_LAZY_START_WAIT_S=%s\n' "$LAZY_START_WAIT_S" \
  > /etc/systemd/system/edged.service.d/nodevm.conf
systemctl daemon-reload
if ! systemctl enable --now edged >> "$R/install.txt" 2>&1; then
  say "systemctl enable --now edged failed"; finish 3
fi
for _ in $(seq 1 300); do
  [ -S /run/edged/edged.sock ] && break
  sleep 0.2
done
systemctl status --no-pager edged > "$R/edged.status.txt" 2>&1 || true
if ! /opt/edged/bin/edged node --json > "$R/edged-node.json" 2>> "$R/install.txt"; then
  say "edged.service does not answer on /run/edged/edged.sock"; finish 4
fi
say "installed and started edged.service in $(( $(date +%s) - t0 )) s"

# ---- the tests ------------------------------------------------------------------------
rm -rf /root/suite && cp -a "$P/suite" /root/suite
mkdir -p /var/cache/edged-test
cp "$P"/cache/*.tar /var/cache/edged-test/ 2>/dev/null || true
cd /root/suite
mapfile -t SELECTION < "$P/selection"   # one argument a line
say "pytest ${SELECTION[*]}"
t0=$(date +%s)
# The edged under test is the wheel's (site-packages of /opt/edged), not a checkout: the
# suite directory holds only tests/ and pyproject.toml (pytest's configuration).
# Each test's start and outcome is streamed as it happens (tests/nodevm/stream.py) to the
# serial console, which the host keeps as the run goes, and to the results: a run cut short
# still says what passed, failed and was running.
NODEVM_GUEST=1 EDGED_TEST_TIME_SCALE=$TIME_SCALE LAYERFS_LAZY_START_WAIT_S=$LAZY_START_WAIT_S \
  EDGED_EXEC_END_GRACE_S=$EXEC_END_GRACE_S EDGED_TEST_REPEATS=$REPEATS NODEVM_STREAM="/dev/ttyS0:$R/stream.txt" \
  /opt/edged/bin/python -m pytest -p no:cacheprovider -p tests.nodevm.stream \
  -o console_output_style=count --timeout=$((600 * TIME_SCALE)) \
  --junitxml="$R/junit.xml" "${SELECTION[@]}" 2>&1 | tee "$R/pytest.txt"
rc=${PIPESTATUS[0]}
say "pytest exit $rc after $(( $(date +%s) - t0 )) s"
echo "$rc" > "$R/pytest-status"

# ---- the daemon ends cleanly, leaving nothing -----------------------------------------
systemctl stop edged
systemctl show edged -p Result -p ExecMainStatus > "$R/edged.stop.txt" 2>&1
{
  echo "## mounts"; grep -E 'erofs|overlay|fuse' /proc/mounts
  echo "## loop devices"; losetup -a
  echo "## processes"; pgrep -af 'sbx-init|edged|layerfs|qemu'
  echo "## cgroups under edged.service"; find /sys/fs/cgroup/system.slice/edged.service -mindepth 1 -type d 2>/dev/null
} > "$R/leftovers.txt" 2>&1
finish 0
