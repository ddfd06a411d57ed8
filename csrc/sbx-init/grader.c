/* A grader exec's view (SBX_EXEC_GRADER).  The spawner gives sbx-init a
 * detached read-only mount of the lowers alone (-P: what the layers hold,
 * nothing the workload wrote) and the paths a grader sees from it (-G).  The
 * grader's child makes a mount namespace of its own and mounts clones of that
 * tree over them, so a sitecustomize.py or .pth file in /etc or /usr, or a
 * changed grader tool, never reaches the grader.  For this sbx-init holds
 * CAP_SYS_ADMIN in the sandbox's user namespace (never in the bounding set;
 * its inheritable set is emptied at start, so no exec gets it). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sbx-init.h"

#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#endif

/* Does `path` name the same symlink in the pristine tree and in our view? */
static int same_link(int pristine_fd, const char *path)
{
	char a[PATH_MAX], b[PATH_MAX];
	ssize_t na = readlinkat(pristine_fd, path + 1, a, sizeof(a));
	ssize_t nb = readlink(path, b, sizeof(b));

	return na >= 0 && na == nb && !memcmp(a, b, (size_t)na);
}

/* A private mount namespace in which each of the grader paths is what the
 * layers hold.  A path the layers lack but the workload made is hidden under
 * an empty read-only tmpfs; one the workload replaced or removed fails the
 * exec (fail closed: nothing to mount on, or not the same kind of file).  HOME
 * (/root) is a fresh empty tmpfs.  -1 with *f saying what failed. */
int grader_view(const struct sbx_policy *pol, uint32_t uid, uint32_t gid, struct sbx_fail *f)
{
	static char paths[128 << 10];
	char *p, *save = NULL, opts[96];
	struct stat want, have;
	int pristine_fd = pol->pristine_fd;

	if (pristine_fd < 0)
		return sbx_fail(f, ENOTSUP, "grader view", "no pristine tree in this sandbox");
	if (unshare(CLONE_NEWNS) < 0)
		return sbx_fail(f, errno, "grader view", "unshare the mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		return sbx_fail(f, errno, "grader view", "make / private");
	snprintf(paths, sizeof(paths), "%s", pol->grader_paths ? pol->grader_paths : "");
	for (p = strtok_r(paths, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
		int t;

		if (p[0] != '/' || !p[1])
			continue;
		if (fstatat(pristine_fd, p + 1, &want, AT_SYMLINK_NOFOLLOW) < 0) {
			if (errno != ENOENT && errno != ENOTDIR)
				return sbx_fail(f, errno, "grader view: stat in the layers", p);
			if (lstat(p, &have) < 0)
				continue; /* in neither */
			if (!S_ISDIR(have.st_mode))
				return sbx_fail(f, EEXIST, "grader view: not in the layers", p);
			if (mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV,
				  "size=4k,mode=0755") < 0)
				return sbx_fail(f, errno, "grader view: hide", p);
			continue;
		}
		if (S_ISLNK(want.st_mode)) {
			/* merged /usr: the target is a grader path of its own */
			if (!same_link(pristine_fd, p))
				return sbx_fail(f, ELOOP, "grader view: link changed", p);
			continue;
		}
		if (lstat(p, &have) < 0 || S_ISLNK(have.st_mode) ||
		    S_ISDIR(have.st_mode) != S_ISDIR(want.st_mode))
			return sbx_fail(f, ENOTDIR, "grader view: replaced or removed", p);
		t = (int)syscall(SYS_open_tree, pristine_fd, p + 1,
				 OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE | AT_SYMLINK_NOFOLLOW);
		if (t < 0)
			return sbx_fail(f, errno, "grader view: clone", p);
		if (syscall(SYS_move_mount, t, "", AT_FDCWD, p, MOVE_MOUNT_F_EMPTY_PATH) < 0)
			return sbx_fail(f, errno, "grader view: mount over", p);
		close(t);
	}
	if (lstat("/root", &have) == 0 && S_ISDIR(have.st_mode)) {
		snprintf(opts, sizeof(opts), "size=64m,mode=0700,uid=%u,gid=%u", uid, gid);
		if (mount("tmpfs", "/root", "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
			return sbx_fail(f, errno, "grader view: fresh HOME", "/root");
	}
	return 0;
}
