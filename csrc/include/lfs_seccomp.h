/* seccomp: compile a profile to a classic-BPF program (libseccomp).
 *
 * The Python side (edged/security/seccomp.py) loads and validates the profile
 * JSON (profiles/seccomp/NAME.json) and hands the flattened rules here; the result
 * is the raw `struct sock_filter` array the spawner/sbx-init installs with
 * seccomp(2) just before exec (lfs_confine.h).  Compiled once per profile and
 * deny mode, then cached by the daemon.
 *
 * Every argument comparison is made on the low 32 bits only: the syscalls we
 * compare (ioctl cmd, socket family/type, kill pid, clone/unshare flags) take
 * 32-bit ints in the kernel, which ignores the upper half of the register, so a
 * 64-bit compare is bypassed by setting high bits (seen on this kernel).
 */
#ifndef LFS_SECCOMP_H
#define LFS_SECCOMP_H

#include <stddef.h>
#include <stdint.h>

#include "lfs_error.h"

/* What a rule (or the default) does. */
enum lfs_scmp_action {
	LFS_SCMP_ALLOW = 0,
	LFS_SCMP_DENY = 1,  /* the profile's deny mode (below): recorded denial */
	LFS_SCMP_ERRNO = 2, /* fail with rule->errno_ret, silently (compatibility) */
	LFS_SCMP_LOG = 3,   /* allow, but the kernel logs it */
	LFS_SCMP_KILL = 4,  /* kill the whole process */
};

/* How LFS_SCMP_DENY is carried out. */
enum lfs_scmp_deny_mode {
	LFS_SCMP_DENY_NOTIFY = 0, /* SECCOMP_RET_USER_NOTIF: a listener records and answers EPERM */
	LFS_SCMP_DENY_ERRNO = 1,  /* SECCOMP_RET_ERRNO(deny_errno) + kernel log of the denial */
};

#define LFS_SCMP_MAX_ARGS 6

/* arg->op */
enum lfs_scmp_op {
	LFS_SCMP_EQ = 0,     /* (arg & mask & 0xffffffff) == value */
	LFS_SCMP_MASKED = 1, /* same as EQ; kept distinct for clarity in the profile */
};

struct lfs_scmp_arg {
	uint32_t index; /* 0..5 */
	uint32_t op;    /* enum lfs_scmp_op */
	uint64_t mask;  /* bits compared (always further limited to the low 32) */
	uint64_t value;
};

struct lfs_scmp_rule {
	const char *name;   /* syscall name, resolved for the native arch */
	uint32_t action;    /* enum lfs_scmp_action */
	int32_t errno_ret;  /* for LFS_SCMP_ERRNO */
	uint32_t nargs;     /* conditions, all must hold (AND) */
	struct lfs_scmp_arg args[LFS_SCMP_MAX_ARGS];
};

/* Syscall number of `name` on the native architecture; -1 with ENOENT if the
 * architecture has no such syscall. */
int lfs_seccomp_resolve(const char *name, struct lfs_error *err);

/* Compile `rules` over `default_action` into a BPF program for the native
 * architecture (other architectures and x32 get the deny action).  On success
 * *out is a malloc'd array of `struct sock_filter` of *out_len bytes (free with
 * lfs_seccomp_free).  EINVAL names the offending rule. */
int lfs_seccomp_compile(const struct lfs_scmp_rule *rules, size_t nrules,
			uint32_t default_action, uint32_t deny_mode, int32_t deny_errno,
			uint8_t **out, size_t *out_len, struct lfs_error *err);

void lfs_seccomp_free(uint8_t *buf);

#endif
