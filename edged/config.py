"""Daemon configuration: one TOML file, defaults that work on a fresh machine, every knob also a
command-line flag (``edged serve --help``).

File: ``/etc/edged/edged.toml`` if it exists, or the path given by ``--config`` /
``EDGED_CONFIG``. Keys are the field names of :class:`Config` (flat, no tables). Units: seconds,
bytes, cores. Unknown keys are an error (a typo must not silently change nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edged.errors import BadRequest

DEFAULT_CONFIG_PATH = "/etc/edged/edged.toml"
DEFAULT_SOCKET = "/run/edged/edged.sock"


def mem_total() -> int:
    """MemTotal of the host in bytes (1 GiB if unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


@dataclass
class Config:
    """Every knob of the daemon, with its default."""

    socket: str = DEFAULT_SOCKET
    socket_group: str = "edged"  # group allowed to connect (mode 0660); skipped if absent
    state_dir: str = "/var/lib/edged"  # sandbox records, image registry, layer cache
    runtime_dir: str = "/run/edged"  # layer mountpoints; gone after a reboot
    # The layerfs store holding layers by digest; "" = layerfs's default ($LAYERFS_STORE or
    # /var/lib/edged/layers).
    store_dir: str = ""
    # Where layers come from: a chunk server (http://HOST:PORT, unix:/PATH) or a shared
    # directory holding a layerfs store (file:/PATH); "" = the local store above. Either
    # way layers are loaded lazily, chunk by chunk, through the node's cache.
    layers_remote: str = ""
    layers_cache_bytes: int = 0  # size limit of the node's layer cache; 0 = none
    layers_fetch_timeout_s: float = 30.0  # a read of an unreachable chunk fails (EIO) after
    layers_check_interval_s: float = 1.0  # how often the layer service is checked (and brought
    # back: restarts back off up to 30 s)
    backend: str = "container"  # the backend of a create that names none
    # Backends to run side by side (comma-separated names; "" = only `backend`); a create
    # picks one with "backend", GET /v1/node lists them.
    backends: str = ""
    # Capacity: 0 means "what this machine has" (cores, MemTotal).
    cpus: float = 0.0
    memory_bytes: int = 0
    # Caps on the sum of *limits* (capacity × ratio; 0 = none). Admission is on measured use
    # (edged.node.admission): ~90% of sandboxes use <=5% of the CPU they request (DSec) and
    # idle memory goes to compressed swap, so sums of limits say little about what fits.
    cpu_overcommit: float = 0.0
    memory_overcommit: float = 0.0
    max_sandboxes: int = 4096
    retry_after_s: float = 1.0
    # Memory kept for the host: admission refuses a create that would leave less available,
    # and the sandboxes' parent cgroup is capped at MemTotal less this (or at the capacity,
    # if lower). 0 = auto (max(1 GiB, 5% of MemTotal)).
    memory_reserve_bytes: int = 0
    memory_pressure_limit: float = 10.0  # refuse creates above this memory PSI full avg10 (%)
    cpu_pressure_limit: float = 0.0  # refuse creates above this CPU PSI some avg10 (%); 0=off
    admission_window_s: float = 10.0  # a new sandbox's request is set aside this long
    # Idle detection and cold-page reclaim (edged.node.reclaim)
    reclaim: bool = True
    idle_after_s: float = 30.0  # no exec, no request and < idle_cpu of a core this long
    idle_cpu: float = 0.01
    reclaim_interval_s: float = 2.0
    reclaim_rate_bytes: int = 512 << 20  # bytes of idle sandboxes reclaimed per second, at most
    reclaim_psi_target: float = 1.0  # memory stall (%) above which reclaim slows down
    pause_reclaim: bool = True  # a pause also pages the sandbox out
    default_auto_pause_after_s: float = 0.0  # pause a sandbox idle this long (0 = never)
    # Swap for reclaimed pages (edged.node.swap): "auto" (the host's swap, else a zram device
    # of edged's own), "zram" (ours anyway) or "off"
    swap: str = "auto"
    # uncompressed size of our zram device; 0 = its RAM limit x 3 (the compression expected)
    zram_bytes: int = 0
    # RAM it may take (compressed pages + slot table); 0 = 3/4 of capacity
    zram_mem_limit_bytes: int = 0
    zram_algorithm: str = "lzo-rle"
    # Swap files on disk (in the state dir) behind the zram device, added a step at a time as
    # swap fills, removed at stop: what does not fit in RAM even compressed (idle sandboxes
    # with big heaps) goes there.
    swap_files: bool = True
    swap_file_bytes: int = 0  # most bytes of swap files in all; 0 = 2 × capacity
    # free space kept on the state dir's filesystem; 0 = 10% of its size
    swap_disk_reserve_bytes: int = 0
    sandbox_swap_share: float = 1.0  # cgroup v2: swap a sandbox may hold / its memory limit
    default_ttl_s: float = 3600.0  # 0 = no TTL
    default_idle_timeout_s: float = 0.0  # 0 = none
    reaper_interval_s: float = 1.0
    on_shutdown: str = "stop"  # "stop": destroy every sandbox; "keep": leave them for re-adoption
    on_start: str = "adopt"  # "adopt" live sandboxes found on start, or "destroy" them
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    # Container spawners started ahead of demand (namespaces made, waiting for a sandbox):
    # takes process start-up and namespace creation off a create's latency; 0 = none.
    spawner_pool: int = 2
    # A container sandbox's sbx-init drops the exec child it forks ahead of the next exec
    # (host kernel memory no limit holds) once no exec started or ended this long; 0 = keep.
    spare_idle_s: float = 10.0
    # A layer stays mounted this long after its last sandbox is gone (seconds), so that the
    # next create finds it mounted and its page cache warm; 0 = unmount at once.
    layer_linger_s: float = 30.0
    # How long a sandbox's security events are kept after it is gone (seconds).
    events_retention_s: float = 24 * 3600.0
    # The E2B-compatible listener (edged.compat.e2b): HOST:PORT on TCP, "" = off. It needs
    # api_keys_file (no key, no listener).
    e2b_listen: str = ""
    # Keys of the TCP listeners (edged.security.apikeys: "KEY" or "NAME KEY" lines, mode
    # o-r); a TCP listener does not start without one.
    api_keys_file: str = ""
    # FnCall (edged.backends.fncall): stateless calls served from a pool of warm container
    # sandboxes of one image; on when the image or its layers are given.
    fncall_image: str = ""  # a registered name:tag
    fncall_layers: str = ""  # or its layers: comma-separated digests, bottom first
    fncall_listen: str = ""  # HOST:PORT of the SandboxFusion /run_code listener; "" = off
    fncall_pool: int = 4  # warm sandboxes, each serving one call at a time
    fncall_recycle_after: int = 1000  # calls before a pool sandbox is replaced by a fresh one
    fncall_queue: int = 256  # calls waiting for a pool sandbox; beyond that 503 Retry-After
    fncall_cpus: float = 1.0  # limits of each pool sandbox (and so of each call)
    fncall_memory_bytes: int = 512 << 20
    # The writable layer is a tmpfs charged to the sandbox's memory: keep it well below the
    # memory limit, or a call that fills the disk leaves the call server no memory.
    fncall_disk_bytes: int = 128 << 20
    fncall_pids: int = 128
    # Python modules the warm interpreter of each pool sandbox imports before its first call
    fncall_preload: str = "sys,os,math,re,json,collections,itertools,functools,heapq,bisect"
    fncall_keep_s: float = 300.0  # how long a kept compile result lives at most
    fncall_keep_bytes: int = 256 << 20  # all kept compile results together, at most
    # Networked sandboxes (edged.net): the IPv4 address pool ("" = no networked sandboxes),
    # the IPv6 one ("" = IPv4 only), the network profile (services, platform denies,
    # resolver settings: profiles/network/<name>.toml, or a path), the resolver's port on
    # the gateway address, its upstream servers ("" = the host's resolv.conf; comma
    # separated), NAT to the uplink (nftables), namespaces prepared ahead of demand, and the
    # host interface name prefix ("" = derived from state_dir); the SNI/Host proxy for
    # names on ports 443/80 and its ports on the gateway address.
    network_pool: str = "10.213.0.0/16"
    network_pool6: str = "fd8e:dbe7:ed9e:1::/64"
    network_profile: str = "default"
    network_dns_port: int = 53
    network_dns_upstreams: str = ""
    network_nat: bool = True
    network_uplink: str = ""
    network_prepare_ahead: int = 1
    network_prefix: str = ""
    network_proxy: bool = True
    network_proxy_tls_port: int = 443
    network_proxy_http_port: int = 80
    # MicroVMs: the accelerator ("auto": KVM if a guest boots on it within a bound, else
    # TCG; "tcg"; "kvm") and TCG's translation cache per VM (MiB; 0 = QEMU's default);
    # clones started ahead per machine of the last creates (0: no pool).
    microvm_accel: str = "auto"
    microvm_tb_size_mib: int = 32
    microvm_pool: int = 2

    def capacity_cpus(self) -> float:
        """CPU capacity in cores (configured, else the CPUs this process may run on)."""
        return self.cpus or float(len(os.sched_getaffinity(0)))

    def capacity_memory(self) -> int:
        """Memory capacity in bytes (configured, else MemTotal)."""
        return self.memory_bytes or mem_total()

    def memory_reserve(self) -> int:
        """Bytes of the host's memory kept for the host (configured, else max(1 GiB, 5% of
        MemTotal))."""
        return self.memory_reserve_bytes or max(1 << 30, mem_total() // 20)

    def validate(self) -> None:
        """Raise :class:`BadRequest` naming the first invalid knob."""
        if self.swap not in ("auto", "zram", "off"):
            raise BadRequest(f"config swap: {self.swap!r} is not 'auto', 'zram' or 'off'")
        if self.on_shutdown not in ("stop", "keep"):
            raise BadRequest(f"config on_shutdown: {self.on_shutdown!r} is not 'stop' or 'keep'")
        if self.e2b_listen and not self.api_keys_file:
            raise BadRequest("config e2b_listen: needs api_keys_file (no key, no listener)")
        if self.microvm_accel not in ("auto", "tcg", "kvm"):
            raise BadRequest(f"config microvm_accel: {self.microvm_accel!r} is not 'auto', "
                             f"'tcg' or 'kvm'")
        if self.on_start not in ("adopt", "destroy"):
            raise BadRequest(f"config on_start: {self.on_start!r} is not 'adopt' or 'destroy'")
        for name in ("reaper_interval_s", "layers_fetch_timeout_s", "reclaim_interval_s",
                     "admission_window_s", "layers_check_interval_s"):
            if getattr(self, name) <= 0:
                raise BadRequest(f"config {name}: must be > 0")
        for name in ("cpus", "memory_bytes", "default_ttl_s", "default_idle_timeout_s",
                     "events_retention_s", "layers_cache_bytes", "spawner_pool", "spare_idle_s",
                     "layer_linger_s", "cpu_overcommit", "memory_overcommit",
                     "memory_reserve_bytes", "memory_pressure_limit", "cpu_pressure_limit",
                     "idle_after_s", "idle_cpu", "reclaim_rate_bytes", "reclaim_psi_target",
                     "default_auto_pause_after_s", "zram_bytes", "zram_mem_limit_bytes",
                     "swap_file_bytes", "swap_disk_reserve_bytes", "sandbox_swap_share",
                     "fncall_recycle_after", "fncall_queue", "fncall_keep_s", "fncall_keep_bytes",
                     "network_prepare_ahead", "microvm_tb_size_mib", "microvm_pool"):
            if getattr(self, name) < 0:
                raise BadRequest(f"config {name}: must be >= 0")
        for name in ("fncall_pool", "fncall_cpus", "fncall_memory_bytes", "fncall_disk_bytes",
                     "fncall_pids"):
            if getattr(self, name) <= 0:
                raise BadRequest(f"config {name}: must be > 0")
        if self.fncall_disk_bytes > self.fncall_memory_bytes // 2:
            raise BadRequest("config fncall_disk_bytes: at most half of fncall_memory_bytes "
                             "(a pool sandbox's writable layer is in its memory)")
        if self.fncall_image and self.fncall_layers:
            raise BadRequest("config fncall_image, fncall_layers: give one, not both")
        if self.fncall_listen and not (self.fncall_image or self.fncall_layers):
            raise BadRequest("config fncall_listen: needs fncall_image or fncall_layers")
        if self.fncall_listen and not self.api_keys_file:
            raise BadRequest("config fncall_listen: a TCP listener needs api_keys_file (no "
                             "key, no listener)")
        for name in ("network_dns_port", "network_proxy_tls_port", "network_proxy_http_port"):
            if not 1 <= getattr(self, name) <= 65535:
                raise BadRequest(f"config {name}: must be a port, 1..65535")
        if self.network_proxy and self.network_proxy_tls_port == self.network_proxy_http_port:
            raise BadRequest("config network_proxy_tls_port: must differ from "
                             "network_proxy_http_port")


_FIELDS = {f.name: f for f in dataclasses.fields(Config) }


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a :class:`Config` from defaults, then the TOML file at ``path`` (or
    ``EDGED_CONFIG``, or :data:`DEFAULT_CONFIG_PATH` if it exists), then ``overrides`` (flags;
    None values ignored), then ``EDGED_SOCKET`` for the socket unless a flag set it.

    Raises :class:`BadRequest` for an unreadable file, an unknown key or a wrongly typed value.
    """
    explicit = path or os.environ.get("EDGED_CONFIG")
    chosen = explicit or (DEFAULT_CONFIG_PATH if Path(DEFAULT_CONFIG_PATH).exists() else None)
    values: dict[str, Any] = {}
    if chosen:
        try:
            with open(chosen, "rb") as fp:
                values = tomllib.load(fp)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise BadRequest(f"config {chosen}: {e}") from e
    env_socket = os.environ.get("EDGED_SOCKET")
    if env_socket:
        values["socket"] = env_socket
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
    cfg = Config()
    for k, v in values.items():
        if k not in _FIELDS:
            raise BadRequest(f"config {chosen or '<flags>'}: unknown key {k!r}")
        default = getattr(cfg, k)
        if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if type(v) is not type(default):
            raise BadRequest(
                f"config key {k!r}: expected {type(default).__name__}, got {type(v).__name__}"
            )
        setattr(cfg, k, v)
    cfg.validate()
    return cfg


#: One line per knob for ``edged serve --help``.
_HELP = {
    "socket": "Unix socket the API listens on (also $EDGED_SOCKET)",
    "socket_group": "group allowed to connect (socket mode 0660); skipped if it does not exist",
    "state_dir": "sandbox records, image registry, layer cache, security events, daemon lock; "
                 "a second daemon needs its own",
    "runtime_dir": "layer mountpoints and the daemon's pid file (flock); a second daemon "
                   "needs its own",
    "store_dir": "the layerfs store holding layers by digest ('' = layerfs's default)",
    "layers_remote": "where layers come from: http://HOST:PORT, unix:/PATH or file:/PATH "
                     "('' = the local store)",
    "layers_cache_bytes": "size limit of the node's layer cache in bytes (0 = none)",
    "layers_fetch_timeout_s": "seconds before a read of an unreachable chunk fails (EIO)",
    "layers_check_interval_s": "seconds between checks of the layer service, which is "
                               "restarted when it does not answer (backing off up to 30 s)",
    "backend": "the backend of a create that names none (container, microvm)",
    "backends": "backends run side by side, comma-separated ('' = only --backend)",
    "cpus": "CPU capacity in cores (0 = the CPUs this process may use)",
    "memory_bytes": "memory capacity in bytes (0 = MemTotal)",
    "cpu_overcommit": "sum of CPU limits admitted up to capacity times this (0 = no cap)",
    "memory_overcommit": "sum of memory limits admitted up to capacity times this (0 = no cap)",
    "memory_reserve_bytes": "memory kept for the host (0 = max(1 GiB, 5%% of MemTotal))",
    "memory_pressure_limit": "refuse creates above this memory PSI full avg10, percent",
    "cpu_pressure_limit": "refuse creates above this CPU PSI some avg10, percent (0 = off)",
    "admission_window_s": "seconds a new sandbox's memory request is set aside",
    "reclaim": "reclaim the cold pages of idle sandboxes into swap",
    "idle_after_s": "seconds without exec, request or CPU before a sandbox is idle",
    "idle_cpu": "share of a core below which a sandbox counts as idle",
    "reclaim_interval_s": "seconds between reclaim passes",
    "reclaim_rate_bytes": "bytes of idle sandboxes reclaimed per second at most",
    "reclaim_psi_target": "memory stall percent above which reclaim slows down",
    "pause_reclaim": "a pause also pages the sandbox out to swap",
    "default_auto_pause_after_s": "pause sandboxes idle this long (0 = never); per create too",
    "swap": "'auto': the host's swap, else a zram device of ours; 'zram'; 'off'",
    "zram_bytes": "uncompressed size of our zram device (0 = its RAM limit x 3)",
    "zram_mem_limit_bytes": "RAM our zram device may take, slot table included "
                            "(0 = 3/4 of capacity, at most of MemTotal less the reserve)",
    "zram_algorithm": "zram compression (one the kernel offers: lzo-rle, lz4, ...)",
    "swap_files": "add swap files on disk behind the zram device as swap fills",
    "swap_file_bytes": "most bytes of those swap files in all (0 = 2 x capacity)",
    "swap_disk_reserve_bytes": "free space swap files leave on their filesystem "
                               "(0 = 10%% of its size)",
    "sandbox_swap_share": "cgroup v2: swap a sandbox may hold, share of its memory limit",
    "max_sandboxes": "sandboxes at most at once",
    "retry_after_s": "Retry-After seconds of a capacity_exhausted refusal",
    "default_ttl_s": "a sandbox's TTL when the create names none, seconds (0 = none)",
    "default_idle_timeout_s": "a sandbox's idle timeout when the create names none (0 = none)",
    "reaper_interval_s": "seconds between passes that stop expired sandboxes",
    "on_shutdown": "'stop': destroy every sandbox at shutdown; 'keep': leave them running",
    "on_start": "'adopt' the live sandboxes found at start, or 'destroy' them",
    "shutdown_timeout_s": "the whole shutdown ends within this (requests get half of it); "
                          "destroys still under way then get up to 45 s more",
    "log_level": "debug, info, warning or error",
    "spawner_pool": "container spawners started ahead of demand (0 = none)",
    "spare_idle_s": "seconds without an exec before a container sandbox drops the exec "
                    "child it keeps forked ahead (0 = keep it)",
    "layer_linger_s": "seconds a layer stays mounted after its last sandbox (0 = unmount)",
    "events_retention_s": "seconds a sandbox's security events are kept after it is gone",
    "e2b_listen": "HOST:PORT of the E2B-compatible listener ('' = off; needs api_keys_file)",
    "api_keys_file": "keys of the TCP listeners ('KEY' or 'NAME KEY' lines, mode o-r)",
    "fncall_image": "FnCall: the image (name:tag) of the pool sandboxes; turns FnCall on",
    "fncall_layers": "FnCall: or its layers, comma-separated digests, bottom first",
    "fncall_listen": "FnCall: HOST:PORT of the SandboxFusion /run_code listener ('' = off)",
    "fncall_pool": "FnCall: warm sandboxes in the pool",
    "fncall_recycle_after": "FnCall: calls before a pool sandbox is replaced (0 = never)",
    "fncall_queue": "FnCall: calls that may wait for a pool sandbox (beyond: 503)",
    "fncall_cpus": "FnCall: CPU quota of each pool sandbox, cores",
    "fncall_memory_bytes": "FnCall: memory limit of each pool sandbox (a call's at most)",
    "fncall_disk_bytes": "FnCall: size of each pool sandbox's writable layer",
    "fncall_pids": "FnCall: tasks limit of each pool sandbox",
    "fncall_preload": "FnCall: Python modules the warm interpreter imports, comma-separated",
    "fncall_keep_s": "FnCall: seconds a kept compile result lives at most",
    "fncall_keep_bytes": "FnCall: bytes of all kept compile results together, at most",
    "network_pool": "IPv4 pool of networked sandboxes ('' = none)",
    "network_pool6": "IPv6 pool of networked sandboxes ('' = IPv4 only)",
    "network_profile": "network profile: services, platform denies, resolver (profiles/network)",
    "network_dns_port": "port of edged's resolver on the gateway address",
    "network_dns_upstreams": "upstream DNS servers, comma separated ('' = /etc/resolv.conf)",
    "network_nat": "masquerade networked sandboxes' traffic to the uplink (nftables)",
    "network_uplink": "uplink interface whose forwarding GET /v1/node reports ('' = all)",
    "network_prepare_ahead": "network namespaces made ahead of demand",
    "network_prefix": "host interface name prefix, <= 6 characters ('' = from state_dir)",
    "network_proxy": "check the SNI/Host of sandboxes' connections to names on 443/80",
    "network_proxy_tls_port": "the SNI proxy's port on the gateway address",
    "network_proxy_http_port": "the Host proxy's port on the gateway address",
    "microvm_accel": "microVM accelerator: 'auto' (KVM if a guest boots on it), 'tcg', 'kvm'",
    "microvm_tb_size_mib": "TCG translation cache per microVM, MiB (0 = QEMU's default)",
    "microvm_pool": "microVM clones started ahead per machine of the last creates (0 = none)",
}


def _boolean(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--knob-name`` flag per :class:`Config` field to ``parser`` (default None, so
    an absent flag leaves the file's value)."""
    parser.add_argument("--config", help=f"TOML config file (default {DEFAULT_CONFIG_PATH})")
    for name in _FIELDS:
        default = getattr(Config(), name)
        kind: Any = _boolean if isinstance(default, bool) else type(default)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=None,
            help=f"{_HELP[name]} (default {default!r})" if name in _HELP
            else f"(default {default!r})",
        )


def from_args(ns: argparse.Namespace) -> Config:
    """The :class:`Config` for parsed flags (see :func:`add_flags`)."""
    overrides = {name: getattr(ns, name, None) for name in _FIELDS}
    return load(getattr(ns, "config", None), overrides)
