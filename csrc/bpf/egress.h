/* egress.h: the maps shared by the egress programs (egress.bpf.c) and the
 * daemon (edged/net/bpf.py packs the same layouts with struct; keep both in
 * step: the sizes are checked at compile time here and at import there).
 *
 * Threat model: the workload of a networked sandbox is an adversary that
 * wants to reach hosts its policy does not allow (port scans for mirrors,
 * a module proxy that fetches code, DNS exfiltration).  The programs are
 * attached (BPF_F_ALLOW_MULTI) to one cgroup v2 directory beneath which
 * every networked sandbox's processes live; a sandbox is told apart by its
 * network namespace (bpf_get_netns_cookie), which the daemon made, which
 * is owned by the initial user namespace (the workload holds no capability
 * over it: it can neither change its address nor leave it), and whose
 * cookie the kernel never reuses.  A socket in a namespace the daemon did
 * not register (a "none" sandbox on a pure cgroup v2 host, or one the
 * workload made with unshare: it has only a loopback) may reach loopback
 * only: the programs fail closed.
 *
 * Byte order: addresses and ports as the kernel hands them to the programs
 * (network order); ids, flags and times in host order.
 */
#ifndef EDGED_EGRESS_H
#define EDGED_EGRESS_H

#include <linux/types.h>

#define EGRESS_MAX_SANDBOXES 65536
#define EGRESS_MAX_CIDRS 262144	  /* static rules of every sandbox, per family */
#define EGRESS_MAX_LEARNED 262144 /* addresses learned from DNS answers, per family */
#define EGRESS_MAX_DENY 4096	  /* platform denies, per family */

/* Denial events per sandbox: a token bucket refilled at RATE a second up to
 * BURST (half the ledger's per-sandbox rate, like sbx-init's seccomp
 * denials); the rest are counted and reported as dropped_before. */
#define EGRESS_EVENT_RATE 100
#define EGRESS_EVENT_BURST 100

/* egress_sbx.flags */
#define EGRESS_F_ENFORCE (1u << 0) /* the sandbox has a policy (off: loopback only) */
#define EGRESS_F_DNS6 (1u << 1)	   /* dns6 is set: redirect IPv6 DNS there */

/* Value of map "sandboxes", key: __u64 netns cookie.  48 bytes. */
struct egress_sbx {
	__u32 id;	    /*  0: sandbox index: the first key field of the rule maps */
	__u32 flags;	    /*  4: EGRESS_F_* */
	__u32 gen;	    /*  8: policy generation: bumped at each policy change */
	__u32 dns4;	    /* 12: resolver IPv4 address that port-53 traffic goes to */
	__u16 dns_port;	    /* 16: resolver port */
	__u16 proxy_tls;    /* 18: SNI proxy port for port-443 domain traffic (0: none) */
	__u16 proxy_http;   /* 20: Host proxy port for port-80 domain traffic (0: none) */
	__u16 reserved0;    /* 22 */
	__u32 reserved1;    /* 24 */
	__u32 reserved2;    /* 28 */
	__u8 dns6[16];	    /* 32: resolver IPv6 address (EGRESS_F_DNS6) */
};

/* Key of "cidr4" (LPM trie): a static rule of one sandbox.  prefixlen counts
 * the bits of id, port, proto and pad (64) plus the address prefix. */
struct egress_cidr4_key {
	__u32 prefixlen; /*  0 */
	__u32 id;	 /*  4: sandbox index (host order: matched whole) */
	__u16 port;	 /*  8: destination port; 0 = any port */
	__u8 proto;	 /* 10: IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad;	 /* 11: 0 */
	__u32 addr;	 /* 12 */
};

struct egress_cidr6_key {
	__u32 prefixlen; /*  0: 64 + address prefix */
	__u32 id;	 /*  4 */
	__u16 port;	 /*  8 */
	__u8 proto;	 /* 10 */
	__u8 pad;	 /* 11 */
	__u8 addr[16];	 /* 12 */
};

/* Key of "learned4"/"learned6" (hash): an address a DNS answer of the
 * sandbox's resolver gave for a name the policy allows. */
struct egress_learned4_key {
	__u32 id;    /* 0 */
	__u16 port;  /* 4: 0 = any port */
	__u8 proto;  /* 6 */
	__u8 pad;    /* 7 */
	__u32 addr;  /* 8 */
};

struct egress_learned6_key {
	__u32 id;      /*  0 */
	__u16 port;    /*  4 */
	__u8 proto;    /*  6 */
	__u8 pad;      /*  7 */
	__u8 addr[16]; /*  8 */
};

/* egress_allow.flags */
#define EGRESS_A_PROXY (1u << 0) /* send 443/80 through the SNI/Host proxy */

/* Value of "cidr4/6" and "learned4/6".  16 bytes. */
struct egress_allow {
	__u64 expires; /* 0: bpf_ktime_get_ns() (CLOCK_MONOTONIC) after which a new
			*    connect is refused; 0 = never (static rules) */
	__u32 flags;   /* 8: EGRESS_A_* */
	__u32 pad;     /* 12 */
};

/* Keys of "deny4"/"deny6" (LPM trie, value __u8 1): platform denies, the
 * same for every sandbox, checked before any allow. */
struct egress_deny4_key {
	__u32 prefixlen;
	__u32 addr;
};

struct egress_deny6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* Value of "ratelimit" (array indexed by sandbox id).  24 bytes. */
struct egress_rate {
	__u64 last;    /* 0: time of the last refill, ns */
	__u32 tokens;  /* 8 */
	__u32 dropped; /* 12: events not sent since the last one */
	__u64 denied;  /* 16: denials in all */
};

/* egress_event.hook */
#define EGRESS_HOOK_CONNECT 1
#define EGRESS_HOOK_SENDMSG 2
#define EGRESS_HOOK_SKB 3

/* egress_event.why */
#define EGRESS_WHY_NOT_ALLOWED 1 /* no rule allows the address and port */
#define EGRESS_WHY_PLATFORM 2	 /* a platform deny matched */
#define EGRESS_WHY_EXPIRED 3	 /* learned from DNS, but its TTL has passed */
#define EGRESS_WHY_UNKNOWN 4	 /* a network namespace with no policy */

/* A denial, on the ring buffer "events".  40 bytes. */
struct egress_event {
	__u64 netns;	     /*  0: netns cookie */
	__u32 id;	     /*  8: sandbox index (0 with EGRESS_WHY_UNKNOWN) */
	__u32 dropped;	     /* 12: denials not reported since the previous event */
	__u8 family;	     /* 16: 4 or 6 */
	__u8 proto;	     /* 17 */
	__u8 hook;	     /* 18: EGRESS_HOOK_* */
	__u8 why;	     /* 19: EGRESS_WHY_* */
	__u16 port;	     /* 20: destination port (network order) */
	__u16 pad;	     /* 22 */
	__u8 addr[16];	     /* 24: destination (IPv4 in the first 4 bytes) */
};

/* Value of "socks" (socket storage): what the connect hook decided for a
 * socket, so that the skb backstop lets its packets pass without a lookup
 * while the policy generation is unchanged, and what the DNS redirect
 * replaced (for the reply's source address).  32 bytes. */
struct egress_sock {
	__u32 gen;	 /*  0: policy generation the decision was made under + 1 (0: none) */
	__u16 port;	 /*  4: destination the decision was for */
	__u16 dns_port;	 /*  6: original DNS server port (0: not redirected) */
	__u8 addr[16];	 /*  8 */
	__u32 dns_addr4; /* 24: original DNS server (IPv4) */
	__u32 pad;	 /* 28 */
};

#define EGRESS_STATIC_ASSERT(c, m) _Static_assert(c, m)
EGRESS_STATIC_ASSERT(sizeof(struct egress_sbx) == 48, "egress_sbx is 48 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_cidr4_key) == 16, "cidr4 key is 16 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_cidr6_key) == 28, "cidr6 key is 28 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_learned4_key) == 12, "learned4 key is 12 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_learned6_key) == 24, "learned6 key is 24 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_allow) == 16, "egress_allow is 16 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_rate) == 24, "egress_rate is 24 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_event) == 40, "egress_event is 40 bytes");
EGRESS_STATIC_ASSERT(sizeof(struct egress_sock) == 32, "egress_sock is 32 bytes");

#endif
