/* Confinement applied to a workload process just before exec: Landlock,
 * capabilities, no_new_privs, seccomp (in that order), plus the seccomp
 * user-notification listener calls used to record denials.
 *
 * Self-contained on purpose (libc + kernel uapi only, no libseccomp): the
 * static sbx-init and the spawner compile this file with lfs_error.c.  The
 * policies themselves are prepared by the daemon (edged/security/): a compiled
 * seccomp program (lfs_seccomp.h) and a serialised Landlock ruleset (the blob
 * format below).
 *
 * Facts: include/uapi/linux/landlock.h and include/uapi/linux/seccomp.h of
 * Linux 6.18; Documentation/userspace-api/landlock.rst (ABI versions).
 */
#ifndef LFS_CONFINE_H
#define LFS_CONFINE_H

#include <stddef.h>
#include <stdint.h>

#include "lfs_error.h"

/* ---- Landlock ruleset blob (produced by edged/security/landlock.py) ----
 *
 * Little-endian.  A header, then `nrules` rules, each a fixed part followed by
 * `path_len` path bytes (no NUL) padded with zeros to a multiple of 8.
 */
#define LFS_LL_MAGIC 0x4c4c464cu /* "LFLL" */
#define LFS_LL_VERSION 1u
#define LFS_LL_MAX_RULES 4096u
#define LFS_LL_MAX_PATH 4095u
#define LFS_LL_MAX_BLOB (1u << 22)

struct lfs_ll_hdr {
	uint32_t magic;          /* LFS_LL_MAGIC */
	uint16_t version;        /* LFS_LL_VERSION */
	uint16_t nrules;         /* <= LFS_LL_MAX_RULES */
	uint64_t handled_fs;     /* LANDLOCK_ACCESS_FS_* handled (denied unless a rule grants) */
	uint64_t handled_net;    /* LANDLOCK_ACCESS_NET_* handled */
	uint64_t scoped;         /* LANDLOCK_SCOPE_* */
	uint32_t restrict_flags; /* landlock_restrict_self() flags (ABI 7: logging) */
	uint32_t reserved;       /* 0 */
};
_Static_assert(sizeof(struct lfs_ll_hdr) == 40, "lfs_ll_hdr is 40 bytes");

#define LFS_LL_RULE_PATH 1u /* LANDLOCK_RULE_PATH_BENEATH */
#define LFS_LL_RULE_PORT 2u /* LANDLOCK_RULE_NET_PORT */

#define LFS_LL_OPTIONAL 0x1u /* a path that does not exist is skipped, not an error */

struct lfs_ll_rule {
	uint16_t type;     /* LFS_LL_RULE_* */
	uint16_t path_len; /* PATH: 1..LFS_LL_MAX_PATH bytes follow; PORT: 0 */
	uint32_t flags;    /* LFS_LL_OPTIONAL */
	uint64_t access;   /* allowed rights (subset of handled_fs / handled_net) */
	uint64_t port;     /* PORT: TCP port 0..65535 */
};
_Static_assert(sizeof(struct lfs_ll_rule) == 24, "lfs_ll_rule is 24 bytes");

/* Landlock rights by ABI (uapi landlock.h). */
#define LFS_LL_FS_EXECUTE (1ULL << 0)
#define LFS_LL_FS_WRITE_FILE (1ULL << 1)
#define LFS_LL_FS_READ_FILE (1ULL << 2)
#define LFS_LL_FS_READ_DIR (1ULL << 3)
#define LFS_LL_FS_TRUNCATE (1ULL << 14)   /* ABI 3 */
#define LFS_LL_FS_IOCTL_DEV (1ULL << 15)  /* ABI 5 */
#define LFS_LL_FS_ABI1 ((1ULL << 13) - 1) /* EXECUTE .. MAKE_SYM */
#define LFS_LL_FS_ABI2 ((1ULL << 14) - 1) /* + REFER */
#define LFS_LL_FS_ABI3 ((1ULL << 15) - 1) /* + TRUNCATE */
#define LFS_LL_FS_ABI5 ((1ULL << 16) - 1) /* + IOCTL_DEV */
#define LFS_LL_NET_ABI4 0x3ULL            /* BIND_TCP, CONNECT_TCP */
#define LFS_LL_SCOPE_ABI6 0x3ULL          /* ABSTRACT_UNIX_SOCKET, SIGNAL */
#define LFS_LL_RESTRICT_ABI7 0x7u         /* LOG_SAME_EXEC_OFF, LOG_NEW_EXEC_ON, LOG_SUBDOMAINS_OFF */
/* Rights that apply to a file (not only to directories). */
#define LFS_LL_FS_FILE_RIGHTS \
	(LFS_LL_FS_EXECUTE | LFS_LL_FS_WRITE_FILE | LFS_LL_FS_READ_FILE | LFS_LL_FS_TRUNCATE | \
	 LFS_LL_FS_IOCTL_DEV)

/* The Landlock ABI version of the running kernel, or 0 when Landlock is absent
 * or disabled. */
int lfs_landlock_abi(void);

/* Check a blob without applying it; 0 or -1 (EINVAL naming the bad part). */
int lfs_landlock_check(const void *blob, size_t len, struct lfs_error *err);

/* Restrict the calling thread (and its future children) with the ruleset in
 * `blob`.  Rights the kernel's ABI lacks are dropped (best effort, as the
 * Landlock documentation advises); EOPNOTSUPP when Landlock is absent.  Sets
 * no_new_privs (landlock_restrict_self requires it without CAP_SYS_ADMIN). */
int lfs_landlock_apply(const void *blob, size_t len, struct lfs_error *err);

/* The two halves of lfs_landlock_apply, for a process that applies one ruleset
 * to many children (sbx-init): prepare resolves the paths once, in the caller's
 * mount namespace, and returns the ruleset fd (close-on-exec); enforce
 * restricts the calling thread with it (and sets no_new_privs).  Paths are
 * resolved when prepared, so a later rename or symlink by a workload cannot move
 * a grant. */
int lfs_landlock_prepare(const void *blob, size_t len, struct lfs_error *err);
int lfs_landlock_enforce(int ruleset, uint32_t restrict_flags, struct lfs_error *err);

/* The landlock_restrict_self() flags a (checked) blob asks for. */
uint32_t lfs_landlock_flags(const void *blob, size_t len);

/* ---- capabilities ---- */

/* Keep only the capabilities in the bit mask `keep` (bit n = capability n):
 * bounding set, ambient set cleared, then permitted/effective/inheritable =
 * keep & what we have.  Then no_new_privs, so no setuid/file-capability exec
 * can raise them again. */
int lfs_caps_restrict(uint64_t keep, struct lfs_error *err);

/* As lfs_caps_restrict, but the capabilities in `held` also stay permitted,
 * effective and inheritable (not in the bounding set): the next exec, as root,
 * still gets them (pI & fI), and nothing exec'd after that can, once the new
 * program drops them from its inheritable set.  For sbx-init, which needs
 * CAP_SYS_ADMIN in the sandbox's user namespace to give grader execs their
 * own mount namespace. */
int lfs_caps_restrict_held(uint64_t keep, uint64_t held, struct lfs_error *err);

/* ---- seccomp ---- */

/* Install the classic-BPF program `prog` (`len` bytes of struct sock_filter)
 * on the calling thread.  `listener`: ask for a user-notification listener
 * (needed when the program uses SECCOMP_RET_USER_NOTIF); returns its fd (give
 * it to the recorder, close it here), else 0.  `log`: SECCOMP_FILTER_FLAG_LOG.
 * Requires no_new_privs or CAP_SYS_ADMIN. */
int lfs_seccomp_install(const void *prog, size_t len, int listener, int log,
			struct lfs_error *err);

/* One denied syscall, as received by the listener. */
struct lfs_seccomp_event {
	uint64_t id;      /* notification cookie */
	uint32_t pid;     /* thread id in the listener's pid namespace (0 if not visible) */
	int32_t nr;       /* syscall number */
	uint32_t arch;    /* AUDIT_ARCH_* */
	uint32_t reserved;
	uint64_t ip;      /* instruction pointer */
	uint64_t args[6];
};

/* Receive one notification (blocks unless the fd is polled readable first).
 * 0 on success; -1 with ENOENT when the target died before it could be read. */
int lfs_seccomp_notif_recv(int listener, struct lfs_seccomp_event *ev, struct lfs_error *err);

/* Answer notification `id`: the syscall fails with `errno_val`.  ENOENT when the
 * target is gone (killed meanwhile), which callers may ignore. */
int lfs_seccomp_notif_deny(int listener, uint64_t id, int errno_val, struct lfs_error *err);

#endif
