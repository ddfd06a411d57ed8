"""Per-sandbox networks: a network namespace and veth pair per networked sandbox, addresses
from a pool, NAT to the uplink; egress policy (rules, service presets, platform denies)
enforced by cgroup BPF programs (``csrc/bpf/egress.bpf.c``) whose maps this package writes;
and the node's DNS resolver, which answers only the names a sandbox's policy allows and
teaches the programs the addresses it answered. Sandboxes with ``network: "none"`` get none
of it (an empty namespace with a loopback, made by the spawner)."""
