// SPDX-License-Identifier: GPL-2.0
/* egress.bpf.c: the per-sandbox egress allowlist, enforced in the kernel.
 *
 * Programs (one object, loaded once per daemon, attached with
 * BPF_F_ALLOW_MULTI to the cgroup v2 directory beneath which networked
 * sandboxes live; the layouts and the threat model are in egress.h):
 *   cgroup/connect4, connect6   TCP and connected UDP: refuse (EPERM) a
 *                               destination no rule allows; send port 53 to
 *                               edged's resolver and 443/80 of names the
 *                               SNI/Host proxy checks to that proxy
 *   cgroup/sendmsg4, sendmsg6   the same for each unconnected UDP datagram
 *   cgroup/recvmsg4, recvmsg6   a redirected DNS reply shows the address the
 *                               workload asked (resolvers check it)
 *   cgroup_skb/egress           backstop: every packet a socket of the
 *                               sandbox sends, against the current policy
 *                               (what the hooks above did not see: a socket
 *                               connected under an earlier policy); a bare
 *                               TCP reset always passes (a cut connection's
 *                               peer must hear of it)
 *
 * Order of checks, the same everywhere: loopback (the sandbox's own
 * namespace) passes; DNS goes to the resolver; the resolver and proxy
 * addresses pass; a platform deny refuses (it always wins: no sandbox rule
 * can open a metadata address, a private range or the node); then a static
 * rule (CIDR, port or any port) or an address learned from a DNS answer
 * whose TTL has not passed allows.  Anything else is refused and reported
 * on the "events" ring buffer (rate-limited per sandbox).
 *
 * Only UAPI context structs (struct bpf_sock_addr, struct __sk_buff) are
 * read, whose layout the kernel keeps stable, so the object needs no CO-RE
 * relocations; libbpf loads it from its BTF (maps defined with __uint/__type).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "egress.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRESS_MAX_SANDBOXES);
	__type(key, __u64);
	__type(value, struct egress_sbx);
} sandboxes SEC(".maps");

/* source address -> netns cookie, for the skb backstop (no netns cookie
 * there): the workload cannot change its address (no CAP_NET_ADMIN over a
 * namespace owned by the initial user namespace) */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRESS_MAX_SANDBOXES);
	__type(key, __u32);
	__type(value, __u64);
} addrs4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRESS_MAX_SANDBOXES);
	__type(key, __u8[16]);
	__type(value, __u64);
} addrs6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, EGRESS_MAX_CIDRS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_cidr4_key);
	__type(value, struct egress_allow);
} cidr4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, EGRESS_MAX_CIDRS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_cidr6_key);
	__type(value, struct egress_allow);
} cidr6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRESS_MAX_LEARNED);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_learned4_key);
	__type(value, struct egress_allow);
} learned4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRESS_MAX_LEARNED);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_learned6_key);
	__type(value, struct egress_allow);
} learned6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, EGRESS_MAX_DENY);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_deny4_key);
	__type(value, __u8);
} deny4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, EGRESS_MAX_DENY);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_deny6_key);
	__type(value, __u8);
} deny6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, EGRESS_MAX_SANDBOXES);
	__type(key, __u32);
	__type(value, struct egress_rate);
} ratelimit SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct egress_sock);
} socks SEC(".maps");

#define TCP IPPROTO_TCP
#define UDP IPPROTO_UDP
#define DNS_PORT bpf_htons(53)
#define TLS_PORT bpf_htons(443)
#define HTTP_PORT bpf_htons(80)

static __always_inline int loopback4(__u32 addr)
{
	return (bpf_ntohl(addr) >> 24) == 127;
}

static __always_inline int loopback6(const __u32 a[4])
{
	return a[0] == 0 && a[1] == 0 && a[2] == 0 && a[3] == bpf_htonl(1);
}

static __always_inline int mapped4(const __u32 a[4])
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline int same6(const __u32 a[4], const __u32 b[4])
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* Whether port is one the sandbox's resolver address serves: DNS, the proxies. */
static __always_inline int resolver_port(const struct egress_sbx *s, __u16 port)
{
	return port == s->dns_port || (port && port == s->proxy_tls) ||
	       (port && port == s->proxy_http);
}

/* Send an IPv6 call to the sandbox's IPv6 resolver address, at port. */
static __always_inline void to_resolver6(struct bpf_sock_addr *ctx, const struct egress_sbx *s,
					 __u16 port)
{
	__u32 d[4];

	__builtin_memcpy(d, s->dns6, 16);
	ctx->user_ip6[0] = d[0];
	ctx->user_ip6[1] = d[1];
	ctx->user_ip6[2] = d[2];
	ctx->user_ip6[3] = d[3];
	ctx->user_port = port;
}

/* Whether a is the sandbox's IPv6 resolver address (where it has one). */
static __always_inline int resolver6(const struct egress_sbx *s, const __u32 a[4])
{
	__u32 d[4];

	if (!(s->flags & EGRESS_F_DNS6))
		return 0;
	__builtin_memcpy(d, s->dns6, 16);
	return same6(a, d);
}

/* Report a denial, at most EGRESS_EVENT_RATE a second per sandbox. */
static __always_inline void report(__u64 netns, __u32 id, __u8 family, __u8 proto, __u8 hook,
				   __u8 why, __u16 port, const __u32 addr[4])
{
	struct egress_rate *r = bpf_map_lookup_elem(&ratelimit, &id);
	struct egress_event *ev;
	__u64 now = bpf_ktime_get_ns();
	__u32 dropped = 0;

	if (r) {
		__u64 add = (now - r->last) * EGRESS_EVENT_RATE / 1000000000ull;

		__sync_fetch_and_add(&r->denied, 1);
		if (add) {
			__u64 t = r->tokens + add;

			r->tokens = t > EGRESS_EVENT_BURST ? EGRESS_EVENT_BURST : (__u32)t;
			r->last = now;
		}
		if (r->tokens == 0) {
			__sync_fetch_and_add(&r->dropped, 1);
			return;
		}
		r->tokens--;
		dropped = r->dropped;
	}
	ev = bpf_ringbuf_reserve(&events, sizeof(*ev), 0);
	if (!ev) {
		if (r)
			__sync_fetch_and_add(&r->dropped, 1);
		return;
	}
	if (r && dropped)
		__sync_fetch_and_sub(&r->dropped, dropped);
	ev->netns = netns;
	ev->id = id;
	ev->dropped = dropped;
	ev->family = family;
	ev->proto = proto;
	ev->hook = hook;
	ev->why = why;
	ev->port = port;
	ev->pad = 0;
	__builtin_memcpy(ev->addr, addr, 16);
	bpf_ringbuf_submit(ev, 0);
}

/* 1 when the learned entry a (none: 0) allows, its allow flags in *flags; an
 * expired one sets *why.  skb: the backstop, where a learned address counts
 * whatever its TTL. */
static __always_inline int learned_allows(const struct egress_allow *a, int skb, __u64 now,
					  __u32 *flags, int *why)
{
	if (!a)
		return 0;
	if (skb || !a->expires || a->expires > now) {
		*flags = a->flags;
		return 1;
	}
	*why = EGRESS_WHY_EXPIRED;
	return 0;
}

/* 0 when a rule allows (addr, port, proto) for the sandbox (its allow flags
 * in *flags), else an EGRESS_WHY_*.  skb: the backstop, where a learned
 * address counts whatever its TTL (a connection made while it was valid
 * goes on). */
static __always_inline int check4(const struct egress_sbx *s, __u32 addr, __u16 port, __u8 proto,
				  __u32 *flags, int skb)
{
	struct egress_deny4_key dk = {.prefixlen = 32, .addr = addr};
	struct egress_cidr4_key ck = {
		.prefixlen = 96, .id = s->id, .port = port, .proto = proto, .pad = 0, .addr = addr};
	struct egress_learned4_key lk = {
		.id = s->id, .port = port, .proto = proto, .pad = 0, .addr = addr};
	struct egress_allow *a;
	__u64 now = bpf_ktime_get_ns();
	int why = EGRESS_WHY_NOT_ALLOWED;

	if (bpf_map_lookup_elem(&deny4, &dk))
		return EGRESS_WHY_PLATFORM;
	a = bpf_map_lookup_elem(&cidr4, &ck);
	if (!a) {
		ck.port = 0;
		a = bpf_map_lookup_elem(&cidr4, &ck);
	}
	if (a) {
		*flags = a->flags;
		return 0;
	}
	if (learned_allows(bpf_map_lookup_elem(&learned4, &lk), skb, now, flags, &why))
		return 0;
	lk.port = 0;
	if (learned_allows(bpf_map_lookup_elem(&learned4, &lk), skb, now, flags, &why))
		return 0;
	return why;
}

static __always_inline int check6(const struct egress_sbx *s, const __u32 addr[4], __u16 port,
				  __u8 proto, __u32 *flags, int skb)
{
	struct egress_deny6_key dk = {.prefixlen = 128};
	struct egress_cidr6_key ck = {
		.prefixlen = 192, .id = s->id, .port = port, .proto = proto, .pad = 0};
	struct egress_learned6_key lk = {.id = s->id, .port = port, .proto = proto, .pad = 0};
	struct egress_allow *a;
	__u64 now = bpf_ktime_get_ns();
	int why = EGRESS_WHY_NOT_ALLOWED;

	__builtin_memcpy(dk.addr, addr, 16);
	__builtin_memcpy(ck.addr, addr, 16);
	__builtin_memcpy(lk.addr, addr, 16);
	if (bpf_map_lookup_elem(&deny6, &dk))
		return EGRESS_WHY_PLATFORM;
	a = bpf_map_lookup_elem(&cidr6, &ck);
	if (!a) {
		ck.port = 0;
		a = bpf_map_lookup_elem(&cidr6, &ck);
	}
	if (a) {
		*flags = a->flags;
		return 0;
	}
	if (learned_allows(bpf_map_lookup_elem(&learned6, &lk), skb, now, flags, &why))
		return 0;
	lk.port = 0;
	if (learned_allows(bpf_map_lookup_elem(&learned6, &lk), skb, now, flags, &why))
		return 0;
	return why;
}

/* Remember, for the skb backstop, that this socket was allowed to reach
 * (addr, port) under the sandbox's current policy generation. */
static __always_inline void mark(struct bpf_sock_addr *ctx, const struct egress_sbx *s,
				 const __u32 addr[4], __u16 port)
{
	struct bpf_sock *sk = ctx->sk;
	struct egress_sock *m;

	if (!sk)
		return;
	m = bpf_sk_storage_get(&socks, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!m)
		return;
	m->gen = s->gen + 1;
	m->port = port;
	__builtin_memcpy(m->addr, addr, 16);
}

/* Send DNS to the resolver, keeping what the workload asked for the reply. */
static __always_inline void dns_redirect4(struct bpf_sock_addr *ctx, const struct egress_sbx *s,
					  __u32 addr, __u16 port)
{
	struct egress_sock *m = 0;

	if (ctx->sk)
		m = bpf_sk_storage_get(&socks, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (m) {
		m->dns_addr4 = addr;
		m->dns_port = port;
	}
	ctx->user_ip4 = s->dns4;
	ctx->user_port = s->dns_port;
}

/* The common IPv4 decision (also for IPv4-mapped addresses of an IPv6
 * socket, which the kernel then connects as IPv4 without running the
 * connect4 hook).  Returns 1 to let the call go on, 0 to refuse it. */
static __always_inline int decide4(struct bpf_sock_addr *ctx, __u32 addr, __u8 hook, int v6)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct egress_sbx *s = bpf_map_lookup_elem(&sandboxes, &netns);
	__u16 port = (__u16)ctx->user_port;
	__u8 proto = (__u8)ctx->protocol;
	__u32 a[4] = {addr, 0, 0, 0};
	__u32 flags = 0;
	int why;

	if (proto != TCP && proto != UDP)
		return loopback4(addr);
	if (!s || !(s->flags & EGRESS_F_ENFORCE)) {
		if (loopback4(addr))
			return 1;
		report(netns, s ? s->id : 0, 4, proto, hook, EGRESS_WHY_UNKNOWN, port, a);
		return 0;
	}
	if (port == DNS_PORT && !(addr == s->dns4 && port == s->dns_port)) {
		if (v6) { /* an IPv4-mapped resolver address for an IPv6 socket */
			ctx->user_ip6[3] = s->dns4;
			ctx->user_port = s->dns_port;
		} else {
			dns_redirect4(ctx, s, addr, port);
		}
		return 1;
	}
	if (loopback4(addr))
		return 1;
	if (addr == s->dns4 && resolver_port(s, port))
		return 1;
	why = check4(s, addr, port, proto, &flags, 0);
	if (why) {
		report(netns, s->id, 4, proto, hook, (__u8)why, port, a);
		return 0;
	}
	if (proto == TCP && (flags & EGRESS_A_PROXY)) {
		__u16 to = port == TLS_PORT ? s->proxy_tls : port == HTTP_PORT ? s->proxy_http : 0;

		if (to) {
			if (v6) /* ::ffff:resolver: the mapped prefix stays */
				ctx->user_ip6[3] = s->dns4;
			else
				ctx->user_ip4 = s->dns4;
			ctx->user_port = to;
			return 1;
		}
	}
	if (hook == EGRESS_HOOK_CONNECT)
		mark(ctx, s, a, port);
	return 1;
}

static __always_inline int decide6(struct bpf_sock_addr *ctx, __u8 hook)
{
	__u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
	__u64 netns;
	struct egress_sbx *s;
	__u16 port = (__u16)ctx->user_port;
	__u8 proto = (__u8)ctx->protocol;
	__u32 flags = 0;
	int why;

	if (mapped4(a))
		return decide4(ctx, a[3], hook, 1);
	if (proto != TCP && proto != UDP)
		return loopback6(a);
	netns = bpf_get_netns_cookie(ctx);
	s = bpf_map_lookup_elem(&sandboxes, &netns);
	if (!s || !(s->flags & EGRESS_F_ENFORCE)) {
		if (loopback6(a))
			return 1;
		report(netns, s ? s->id : 0, 6, proto, hook, EGRESS_WHY_UNKNOWN, port, a);
		return 0;
	}
	if (port == DNS_PORT) {
		if (s->flags & EGRESS_F_DNS6) {
			if (resolver6(s, a) && port == s->dns_port)
				return 1;
			/* No source rewrite on the reply for IPv6: glibc and dnspython
			 * accept a reply on a connected socket; an unconnected one sees
			 * the resolver's address (documented). */
			to_resolver6(ctx, s, s->dns_port);
			return 1;
		}
		report(netns, s->id, 6, proto, hook, EGRESS_WHY_NOT_ALLOWED, port, a);
		return 0;
	}
	if (loopback6(a))
		return 1;
	if (resolver6(s, a) && resolver_port(s, port))
		return 1;
	why = check6(s, a, port, proto, &flags, 0);
	if (why) {
		report(netns, s->id, 6, proto, hook, (__u8)why, port, a);
		return 0;
	}
	if (proto == TCP && (flags & EGRESS_A_PROXY) && (s->flags & EGRESS_F_DNS6)) {
		__u16 to = port == TLS_PORT ? s->proxy_tls : port == HTTP_PORT ? s->proxy_http : 0;

		if (to) {
			to_resolver6(ctx, s, to);
			return 1;
		}
	}
	if (hook == EGRESS_HOOK_CONNECT)
		mark(ctx, s, a, port);
	return 1;
}

SEC("cgroup/connect4")
int egress_connect4(struct bpf_sock_addr *ctx)
{
	return decide4(ctx, ctx->user_ip4, EGRESS_HOOK_CONNECT, 0);
}

SEC("cgroup/sendmsg4")
int egress_sendmsg4(struct bpf_sock_addr *ctx)
{
	return decide4(ctx, ctx->user_ip4, EGRESS_HOOK_SENDMSG, 0);
}

SEC("cgroup/connect6")
int egress_connect6(struct bpf_sock_addr *ctx)
{
	return decide6(ctx, EGRESS_HOOK_CONNECT);
}

SEC("cgroup/sendmsg6")
int egress_sendmsg6(struct bpf_sock_addr *ctx)
{
	return decide6(ctx, EGRESS_HOOK_SENDMSG);
}

/* A reply from the resolver to a redirected query: show the server asked. */
SEC("cgroup/recvmsg4")
int egress_recvmsg4(struct bpf_sock_addr *ctx)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct egress_sbx *s = bpf_map_lookup_elem(&sandboxes, &netns);
	struct egress_sock *m;

	if (!s || !ctx->sk || ctx->user_ip4 != s->dns4 || (__u16)ctx->user_port != s->dns_port)
		return 1;
	m = bpf_sk_storage_get(&socks, ctx->sk, 0, 0);
	if (m && m->dns_port) {
		ctx->user_ip4 = m->dns_addr4;
		ctx->user_port = m->dns_port;
	}
	return 1;
}

/* The backstop.  Returns 1 to send the packet, 0 to drop it. */
SEC("cgroup_skb/egress")
int egress_skb(struct __sk_buff *skb)
{
	struct egress_sbx *s = 0;
	struct bpf_sock *sk;
	struct egress_sock *m = 0;
	__u64 *netns;
	__u32 a[4] = {0, 0, 0, 0};
	__u32 flags = 0;
	__u16 port = 0;
	__u8 proto, family, tcp[2];
	int why, frag = 0, rst = 0;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0)
			return 0;
		if (loopback4(ip.daddr))
			return 1;
		a[0] = ip.daddr;
		proto = ip.protocol;
		family = 4;
		netns = bpf_map_lookup_elem(&addrs4, &ip.saddr);
		frag = (bpf_ntohs(ip.frag_off) & 0x1fff) != 0;
		if (!frag && (proto == TCP || proto == UDP) &&
		    bpf_skb_load_bytes(skb, ip.ihl * 4 + 2, &port, sizeof(port)) < 0)
			return 0;
		if (!frag && proto == TCP) {
			if (bpf_skb_load_bytes(skb, ip.ihl * 4 + 12, tcp, sizeof(tcp)) < 0)
				return 0;
			rst = (tcp[1] & 0x04) &&
			      bpf_ntohs(ip.tot_len) == ip.ihl * 4 + (tcp[0] >> 4) * 4;
		}
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) < 0)
			return 0;
		__builtin_memcpy(a, &ip6.daddr, 16);
		if (loopback6(a))
			return 1;
		proto = ip6.nexthdr;
		family = 6;
		netns = bpf_map_lookup_elem(&addrs6, &ip6.saddr);
		if ((proto == TCP || proto == UDP) &&
		    bpf_skb_load_bytes(skb, sizeof(ip6) + 2, &port, sizeof(port)) < 0)
			return 0;
		if (proto == TCP) {
			if (bpf_skb_load_bytes(skb, sizeof(ip6) + 12, tcp, sizeof(tcp)) < 0)
				return 0;
			rst = (tcp[1] & 0x04) && bpf_ntohs(ip6.payload_len) == (tcp[0] >> 4) * 4;
		}
	} else {
		return 0;
	}
	if (netns)
		s = bpf_map_lookup_elem(&sandboxes, netns);
	if (!s || !(s->flags & EGRESS_F_ENFORCE)) {
		report(netns ? *netns : 0, s ? s->id : 0, family, proto, EGRESS_HOOK_SKB,
		       EGRESS_WHY_UNKNOWN, port, a);
		return 0;
	}
	if (proto != TCP && proto != UDP) {
		report(*netns, s->id, family, proto, EGRESS_HOOK_SKB, EGRESS_WHY_NOT_ALLOWED, 0, a);
		return 0;
	}
	/* A reset without payload carries nothing out: it is what a connection cut by a
	 * policy change (SOCK_DESTROY) sends its peer, so that the peer lets go at once. */
	if (rst)
		return 1;
	/* the resolver and the proxies */
	if (family == 4 && a[0] == s->dns4 && (frag || resolver_port(s, port)))
		return 1;
	if (family == 6 && resolver6(s, a) && resolver_port(s, port))
		return 1;
	sk = skb->sk;
	if (sk)
		sk = bpf_sk_fullsock(sk);
	if (sk)
		m = bpf_sk_storage_get(&socks, sk, 0, 0);
	/* decided at connect under this policy: no lookup */
	if (m && m->gen == s->gen + 1 && (frag || m->port == port)) {
		__u32 b[4];

		__builtin_memcpy(b, m->addr, 16);
		if (same6(a, b))
			return 1;
	}
	if (frag) /* no ports past the first fragment of an unconnected datagram */
		why = EGRESS_WHY_NOT_ALLOWED;
	else if (family == 4)
		why = check4(s, a[0], port, proto, &flags, 1);
	else
		why = check6(s, a, port, proto, &flags, 1);
	if (why) {
		report(*netns, s->id, family, proto, EGRESS_HOOK_SKB, (__u8)why, port, a);
		return 0;
	}
	/* A connection made under an earlier policy that this one still
	 * allows: decided again, once. */
	if (m && proto == TCP && m->port == port) {
		__u32 b[4];

		__builtin_memcpy(b, m->addr, 16);
		if (same6(a, b))
			m->gen = s->gen + 1;
	}
	return 1;
}
