#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lfs_cleanup.h"
#include "lfs_confine.h"

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif
#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#define __NR_landlock_add_rule 445
#define __NR_landlock_restrict_self 446
#endif

/* Our own copies of the Landlock uapi structs: Debian 12's headers predate
 * handled_access_net (ABI 4) and scoped (ABI 6). */
struct ll_ruleset_attr {
	uint64_t handled_access_fs;
	uint64_t handled_access_net;
	uint64_t scoped;
};

struct ll_path_beneath_attr {
	uint64_t allowed_access;
	int32_t parent_fd;
} __attribute__((packed));

struct ll_net_port_attr {
	uint64_t allowed_access;
	uint64_t port;
};

int lfs_landlock_abi(void)
{
	long abi = syscall(__NR_landlock_create_ruleset, NULL, 0, 1U /* _VERSION */);

	return abi < 0 ? 0 : (int)abi;
}

static uint64_t fs_mask(int abi)
{
	if (abi >= 5)
		return LFS_LL_FS_ABI5;
	if (abi >= 3)
		return LFS_LL_FS_ABI3;
	if (abi == 2)
		return LFS_LL_FS_ABI2;
	return abi == 1 ? LFS_LL_FS_ABI1 : 0;
}

static size_t rule_size(const struct lfs_ll_rule *r)
{
	return sizeof(*r) + (((size_t)r->path_len + 7) & ~(size_t)7);
}

int lfs_landlock_check(const void *blob, size_t len, struct lfs_error *err)
{
	const uint8_t *p = blob;
	struct lfs_ll_hdr h;
	size_t off = sizeof(h);

	if (!blob || len < sizeof(h) || len > LFS_LL_MAX_BLOB)
		return lfs_error_set(err, EINVAL, "landlock blob: size %zu out of range", len);
	memcpy(&h, p, sizeof(h));
	if (h.magic != LFS_LL_MAGIC || h.version != LFS_LL_VERSION || h.reserved)
		return lfs_error_set(err, EINVAL, "landlock blob: bad magic, version or reserved");
	if (h.nrules > LFS_LL_MAX_RULES)
		return lfs_error_set(err, EINVAL, "landlock blob: %u rules (max %u)", h.nrules,
				     LFS_LL_MAX_RULES);
	if ((h.handled_fs & ~LFS_LL_FS_ABI5) || (h.handled_net & ~LFS_LL_NET_ABI4) ||
	    (h.scoped & ~LFS_LL_SCOPE_ABI6) || (h.restrict_flags & ~LFS_LL_RESTRICT_ABI7))
		return lfs_error_set(err, EINVAL, "landlock blob: unknown rights or flags");
	for (unsigned i = 0; i < h.nrules; i++) {
		struct lfs_ll_rule r;

		if (len - off < sizeof(r))
			return lfs_error_set(err, EINVAL, "landlock blob: rule %u truncated", i);
		memcpy(&r, p + off, sizeof(r));
		if (r.flags & ~LFS_LL_OPTIONAL)
			return lfs_error_set(err, EINVAL, "landlock rule %u: unknown flags", i);
		if (r.type == LFS_LL_RULE_PATH) {
			const char *path = (const char *)p + off + sizeof(r);

			if (r.path_len == 0 || r.path_len > LFS_LL_MAX_PATH ||
			    len - off < rule_size(&r))
				return lfs_error_set(err, EINVAL, "landlock rule %u: bad path length",
						     i);
			if (path[0] != '/' || memchr(path, 0, r.path_len))
				return lfs_error_set(err, EINVAL,
						     "landlock rule %u: path not absolute or has NUL", i);
			if (r.access & ~h.handled_fs)
				return lfs_error_set(err, EINVAL,
						     "landlock rule %u (%.*s): access not handled", i,
						     (int)r.path_len, path);
		} else if (r.type == LFS_LL_RULE_PORT) {
			if (r.path_len || r.port > 65535 || (r.access & ~h.handled_net))
				return lfs_error_set(err, EINVAL, "landlock rule %u: bad port rule", i);
		} else {
			return lfs_error_set(err, EINVAL, "landlock rule %u: unknown type %u", i,
					     r.type);
		}
		off += rule_size(&r);
	}
	if (off != len)
		return lfs_error_set(err, EINVAL, "landlock blob: %zu trailing bytes", len - off);
	return 0;
}

static int add_path_rule(int ruleset, const char *path, uint64_t access, uint32_t flags,
			 struct lfs_error *err)
{
	/* O_NOFOLLOW: a symlink the workload planted must not redirect a grant onto
	 * a protected tree. */
	cleanup_close int fd = open(path, O_PATH | O_CLOEXEC | O_NOFOLLOW);
	struct ll_path_beneath_attr a;
	struct stat st;

	if (fd < 0) {
		if (errno == ENOENT && (flags & LFS_LL_OPTIONAL))
			return 0;
		return lfs_error_set(err, errno, "open `%s`: %s", path, strerror(errno));
	}
	if (fstat(fd, &st) < 0)
		return lfs_error_set(err, errno, "stat `%s`: %s", path, strerror(errno));
	if (S_ISLNK(st.st_mode)) {
		if (flags & LFS_LL_OPTIONAL)
			return 0;
		return lfs_error_set(err, ELOOP, "landlock rule `%s`: is a symlink", path);
	}
	if (!S_ISDIR(st.st_mode))
		access &= LFS_LL_FS_FILE_RIGHTS;
	if (!access)
		return 0;
	a.allowed_access = access;
	a.parent_fd = fd;
	if (syscall(__NR_landlock_add_rule, ruleset, LFS_LL_RULE_PATH, &a, 0) < 0)
		return lfs_error_set(err, errno, "landlock_add_rule `%s`: %s", path,
				     strerror(errno));
	return 0;
}

int lfs_landlock_prepare(const void *blob, size_t len, struct lfs_error *err)
{
	const uint8_t *p = blob;
	struct lfs_ll_hdr h;
	struct ll_ruleset_attr attr;
	cleanup_close int ruleset = -1;
	size_t attr_size, off = sizeof(h);
	char path[LFS_LL_MAX_PATH + 1];
	int abi;

	if (lfs_landlock_check(blob, len, err) < 0)
		return -1;
	abi = lfs_landlock_abi();
	if (abi <= 0)
		return lfs_error_set(err, EOPNOTSUPP, "landlock is not available in this kernel");
	memcpy(&h, p, sizeof(h));
	attr.handled_access_fs = h.handled_fs & fs_mask(abi);
	attr.handled_access_net = abi >= 4 ? h.handled_net : 0;
	attr.scoped = abi >= 6 ? h.scoped : 0;
	attr_size = abi >= 6 ? 24 : abi >= 4 ? 16 : 8;
	ruleset = (int)syscall(__NR_landlock_create_ruleset, &attr, attr_size, 0);
	if (ruleset < 0)
		return lfs_error_set(err, errno, "landlock_create_ruleset: %s", strerror(errno));

	for (unsigned i = 0; i < h.nrules; i++) {
		struct lfs_ll_rule r;

		memcpy(&r, p + off, sizeof(r));
		if (r.type == LFS_LL_RULE_PATH) {
			memcpy(path, p + off + sizeof(r), r.path_len);
			path[r.path_len] = '\0';
			if (add_path_rule(ruleset, path, r.access & attr.handled_access_fs, r.flags,
					  err) < 0)
				return -1;
		} else if (attr.handled_access_net && (r.access & attr.handled_access_net)) {
			struct ll_net_port_attr a = {
				.allowed_access = r.access & attr.handled_access_net,
				.port = r.port,
			};

			if (syscall(__NR_landlock_add_rule, ruleset, LFS_LL_RULE_PORT, &a, 0) < 0)
				return lfs_error_set(err, errno, "landlock_add_rule port %llu: %s",
						     (unsigned long long)r.port, strerror(errno));
		}
		off += rule_size(&r);
	}
	return steal_fd(&ruleset);
}

int lfs_landlock_enforce(int ruleset, uint32_t restrict_flags, struct lfs_error *err)
{
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		return lfs_error_set(err, errno, "prctl(NO_NEW_PRIVS): %s", strerror(errno));
	if (syscall(__NR_landlock_restrict_self, ruleset,
		    lfs_landlock_abi() >= 7 ? restrict_flags : 0) < 0)
		return lfs_error_set(err, errno, "landlock_restrict_self: %s", strerror(errno));
	return 0;
}

uint32_t lfs_landlock_flags(const void *blob, size_t len)
{
	struct lfs_ll_hdr h;

	if (len < sizeof(h))
		return 0;
	memcpy(&h, blob, sizeof(h));
	return h.restrict_flags;
}

int lfs_landlock_apply(const void *blob, size_t len, struct lfs_error *err)
{
	cleanup_close int ruleset = lfs_landlock_prepare(blob, len, err);

	if (ruleset < 0)
		return -1;
	return lfs_landlock_enforce(ruleset, lfs_landlock_flags(blob, len), err);
}

int lfs_caps_restrict(uint64_t keep, struct lfs_error *err)
{
	return lfs_caps_restrict_held(keep, 0, err);
}

int lfs_caps_restrict_held(uint64_t keep, uint64_t held, struct lfs_error *err)
{
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2];

	/* `held` into the inheritable set while the bounding set still has it:
	 * capset refuses inheritable capabilities outside the bounding set. */
	if (held) {
		if (syscall(SYS_capget, &hdr, data) < 0)
			return lfs_error_set(err, errno, "capget: %s", strerror(errno));
		for (int i = 0; i < 2; i++)
			data[i].inheritable |= (uint32_t)(held >> (32 * i)) & data[i].permitted;
		if (syscall(SYS_capset, &hdr, data) < 0)
			return lfs_error_set(err, errno, "capset (inheritable): %s", strerror(errno));
	}
	/* Bounding set first: it caps what any later exec can gain. */
	for (int cap = 0; cap < 64; cap++) {
		if (keep & (1ULL << cap))
			continue;
		if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
			if (errno == EINVAL)
				break; /* past the kernel's last capability */
			return lfs_error_set(err, errno, "drop capability %d from bounding set: %s",
					     cap, strerror(errno));
		}
	}
	if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
		return lfs_error_set(err, errno, "clear ambient capabilities: %s", strerror(errno));
	if (syscall(SYS_capget, &hdr, data) < 0)
		return lfs_error_set(err, errno, "capget: %s", strerror(errno));
	for (int i = 0; i < 2; i++) {
		uint32_t k = (uint32_t)((keep | held) >> (32 * i));

		data[i].effective &= k;
		data[i].permitted &= k;
		data[i].inheritable &= k;
	}
	if (syscall(SYS_capset, &hdr, data) < 0)
		return lfs_error_set(err, errno, "capset: %s", strerror(errno));
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		return lfs_error_set(err, errno, "prctl(NO_NEW_PRIVS): %s", strerror(errno));
	return 0;
}

int lfs_seccomp_install(const void *prog, size_t len, int listener, int log,
			struct lfs_error *err)
{
	struct sock_fprog fprog;
	unsigned int flags = 0;
	long rc;

	if (!prog || len == 0 || len % sizeof(struct sock_filter) ||
	    len / sizeof(struct sock_filter) > BPF_MAXINSNS)
		return lfs_error_set(err, EINVAL, "seccomp program: bad length %zu", len);
	fprog.len = (unsigned short)(len / sizeof(struct sock_filter));
	fprog.filter = (struct sock_filter *)prog;
	if (listener)
		flags |= SECCOMP_FILTER_FLAG_NEW_LISTENER;
	if (log)
		flags |= SECCOMP_FILTER_FLAG_LOG;
	rc = syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, flags, &fprog);
	if (rc < 0)
		return lfs_error_set(err, errno, "seccomp(SET_MODE_FILTER): %s", strerror(errno));
	return listener ? (int)rc : 0;
}

int lfs_seccomp_notif_recv(int listener, struct lfs_seccomp_event *ev, struct lfs_error *err)
{
	struct seccomp_notif n;

	memset(&n, 0, sizeof(n)); /* the kernel refuses a non-zeroed buffer */
	if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &n) < 0)
		return lfs_error_set(err, errno, "seccomp notification receive: %s",
				     strerror(errno));
	memset(ev, 0, sizeof(*ev));
	ev->id = n.id;
	ev->pid = n.pid;
	ev->nr = n.data.nr;
	ev->arch = n.data.arch;
	ev->ip = n.data.instruction_pointer;
	for (int i = 0; i < 6; i++)
		ev->args[i] = n.data.args[i];
	return 0;
}

int lfs_seccomp_notif_deny(int listener, uint64_t id, int errno_val, struct lfs_error *err)
{
	struct seccomp_notif_resp r;

	if (errno_val <= 0 || errno_val > 4095)
		return lfs_error_set(err, EINVAL, "deny errno %d out of range", errno_val);
	memset(&r, 0, sizeof(r));
	r.id = id;
	r.error = -errno_val;
	if (ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &r) < 0)
		return lfs_error_set(err, errno, "seccomp notification answer: %s", strerror(errno));
	return 0;
}
