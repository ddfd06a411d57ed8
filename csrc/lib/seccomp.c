#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "lfs_cleanup.h"
#include "lfs_seccomp.h"

int lfs_seccomp_resolve(const char *name, struct lfs_error *err)
{
	int nr = seccomp_syscall_resolve_name(name);

	/* libseccomp gives pseudo numbers (< 0) to syscalls this arch lacks. */
	if (nr == __NR_SCMP_ERROR || nr < 0)
		return lfs_error_set(err, ENOENT, "syscall `%s` does not exist on this architecture",
				     name);
	return nr;
}

static uint32_t scmp_action(uint32_t action, int32_t errno_ret, uint32_t deny_mode,
			    int32_t deny_errno)
{
	switch (action) {
	case LFS_SCMP_ALLOW:
		return SCMP_ACT_ALLOW;
	case LFS_SCMP_DENY:
		return deny_mode == LFS_SCMP_DENY_NOTIFY ? SCMP_ACT_NOTIFY
							 : SCMP_ACT_ERRNO((uint32_t)deny_errno);
	case LFS_SCMP_ERRNO:
		return SCMP_ACT_ERRNO((uint32_t)errno_ret);
	case LFS_SCMP_LOG:
		return SCMP_ACT_LOG;
	default:
		return SCMP_ACT_KILL_PROCESS;
	}
}

static void release_ctx(scmp_filter_ctx *ctx)
{
	if (*ctx)
		seccomp_release(*ctx);
}

int lfs_seccomp_compile(const struct lfs_scmp_rule *rules, size_t nrules,
			uint32_t default_action, uint32_t deny_mode, int32_t deny_errno,
			uint8_t **out, size_t *out_len, struct lfs_error *err)
{
	__attribute__((cleanup(release_ctx))) scmp_filter_ctx ctx = NULL;
	cleanup_close int fd = -1;
	uint32_t deny = scmp_action(LFS_SCMP_DENY, 0, deny_mode, deny_errno);
	uint32_t def;
	off_t size;
	uint8_t *buf;
	int rc;

	if (default_action > LFS_SCMP_KILL || default_action == LFS_SCMP_ERRNO ||
	    deny_mode > LFS_SCMP_DENY_ERRNO || deny_errno <= 0 || deny_errno > 4095)
		return lfs_error_set(err, EINVAL, "bad default action, deny mode or deny errno");
	def = scmp_action(default_action, 0, deny_mode, deny_errno);
	ctx = seccomp_init(def);
	if (!ctx)
		return lfs_error_set(err, ENOMEM, "seccomp_init");
	/* The spawner sets no_new_privs itself, after dropping capabilities; the
	 * exported program carries no attributes anyway. */
	if ((rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0)) < 0 ||
	    /* A foreign ABI (int 0x80 i386 calls, x32) would dodge every rule below,
	     * which are keyed on native numbers: treat it as a denial. */
	    (rc = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, deny)) < 0 ||
	    /* Binary search over syscall numbers: allowed calls pass in O(log n). */
	    (rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)) < 0)
		return lfs_error_set(err, -rc, "seccomp_attr_set: %s", strerror(-rc));

	for (size_t i = 0; i < nrules; i++) {
		const struct lfs_scmp_rule *r = &rules[i];
		struct scmp_arg_cmp cmp[LFS_SCMP_MAX_ARGS];
		uint32_t act;
		int nr;

		if (!r->name)
			return lfs_error_set(err, EINVAL, "rule %zu: no syscall name", i);
		nr = lfs_seccomp_resolve(r->name, err);
		if (nr < 0)
			return lfs_error_prefix(err, "rule %zu", i);
		if (r->action > LFS_SCMP_KILL || r->nargs > LFS_SCMP_MAX_ARGS)
			return lfs_error_set(err, EINVAL, "rule %zu (%s): bad action or too many args",
					     i, r->name);
		if (r->action == LFS_SCMP_ERRNO && (r->errno_ret <= 0 || r->errno_ret > 4095))
			return lfs_error_set(err, EINVAL, "rule %zu (%s): errno %d out of range", i,
					     r->name, r->errno_ret);
		act = scmp_action(r->action, r->errno_ret, deny_mode, deny_errno);
		if (act == def)
			continue; /* libseccomp refuses rules equal to the default */
		for (uint32_t a = 0; a < r->nargs; a++) {
			if (r->args[a].index >= 6 || r->args[a].op > LFS_SCMP_MASKED)
				return lfs_error_set(err, EINVAL, "rule %zu (%s): bad arg %u", i,
						     r->name, a);
			cmp[a] = (struct scmp_arg_cmp){
				.arg = r->args[a].index,
				.op = SCMP_CMP_MASKED_EQ,
				.datum_a = r->args[a].mask & 0xffffffffULL,
				.datum_b = r->args[a].value & r->args[a].mask & 0xffffffffULL,
			};
		}
		rc = seccomp_rule_add_exact_array(ctx, act, nr, r->nargs, cmp);
		if (rc < 0)
			return lfs_error_set(err, EINVAL, "rule %zu (%s): libseccomp: %s", i,
					     r->name, strerror(-rc));
	}

	fd = memfd_create("lfs-seccomp", MFD_CLOEXEC);
	if (fd < 0)
		return lfs_error_set(err, errno, "memfd_create: %s", strerror(errno));
	rc = seccomp_export_bpf(ctx, fd);
	if (rc < 0)
		return lfs_error_set(err, -rc, "seccomp_export_bpf: %s", strerror(-rc));
	size = lseek(fd, 0, SEEK_END);
	if (size <= 0 || size > (1 << 20))
		return lfs_error_set(err, EIO, "seccomp_export_bpf: odd size %lld", (long long)size);
	buf = malloc((size_t)size);
	if (!buf)
		return lfs_error_set(err, ENOMEM, "malloc");
	if (pread(fd, buf, (size_t)size, 0) != size) {
		int e = errno ? errno : EIO;
		free(buf);
		return lfs_error_set(err, e, "read exported BPF: %s", strerror(e));
	}
	*out = buf;
	*out_len = (size_t)size;
	return 0;
}

void lfs_seccomp_free(uint8_t *buf)
{
	free(buf);
}
