/* A grader exec's view (SBX_EXEC_GRADER).  The spawner gives sbx-init the
 * sandbox's layers as detached, id-mapped, read-only mounts (-P) and the paths
 * a grader sees from them (-G).  The grader's child makes a mount namespace of
 * its own, a read-only overlay of the layers alone (what they hold, nothing the
 * workload wrote) and mounts clones of that tree over the paths, so a
 * sitecustomize.py or .pth file in /etc or /usr, or a changed grader tool,
 * never reaches the grader.  The overlay lives only as long as the grader's
 * mount namespace: a sandbox whose grader never runs holds no superblock for
 * it (each superblock on the host grows every memory cgroup's shrinker
 * tables, see cgroup.c).  For this sbx-init holds CAP_SYS_ADMIN in the
 * sandbox's user namespace (never in the bounding set; its inheritable set is
 * emptied at start, so no exec gets it). */
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

#include "lfs_cleanup.h"
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
#ifndef SYS_fsopen
#define SYS_fsopen 430
#define SYS_fsconfig 431
#define SYS_fsmount 432
#endif
#define FSOPEN_CLOEXEC_ 0x1
#define FSCONFIG_SET_STRING_ 1
#define FSCONFIG_SET_FD_ 5
#define FSCONFIG_CMD_CREATE_ 6
#define FSMOUNT_CLOEXEC_ 0x1
#define MOUNT_ATTR_RDONLY_ 0x1
#define MOUNT_ATTR_NOSUID_ 0x2
#define MOUNT_ATTR_NODEV_ 0x4

/* A read-only overlay of the layers alone (top first to lowerdir+), with the
 * scratch dir's empty/ at the bottom: overlayfs wants two lowers at least
 * without an upper.  Returns a detached mount fd, -1 with *f set. */
static int pristine_tree(const struct sbx_policy *pol, struct sbx_fail *f)
{
	cleanup_close int empty = -1;
	cleanup_close int ovl = -1;
	int mnt, i, saved;

	if (pol->scratch_fd < 0)
		return sbx_fail(f, ENOENT, "grader view", "no scratch dir for the bottom layer");
	empty = openat(pol->scratch_fd, "empty", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (empty < 0)
		return sbx_fail(f, errno, "grader view", "empty bottom layer");
	ovl = (int)syscall(SYS_fsopen, "overlay", FSOPEN_CLOEXEC_);
	if (ovl < 0)
		return sbx_fail(f, errno, "grader view", "fsopen overlay");
	for (i = pol->n_lowers - 1; i >= 0; i--)
		if (syscall(SYS_fsconfig, ovl, FSCONFIG_SET_FD_, "lowerdir+", NULL, pol->lowers[i]) < 0)
			break;
	if (i >= 0 && i == pol->n_lowers - 1 && (errno == EINVAL || errno == EOPNOTSUPP)) {
		/* no lowerdir+ before Linux 6.8 (a microVM guest's 6.1, or a
		 * container's there, whose lowers the spawner left attached beneath
		 * /proc: reclone_lowers): the same layers by their fds' paths, which
		 * the overlay looks up when it is created, in this process */
		static char dirs[SBX_MAX_LOWERS * 24 + 32];
		size_t off = 0;

		for (i = pol->n_lowers - 1; i >= 0; i--)
			off += (size_t)snprintf(dirs + off, sizeof(dirs) - off, "/proc/self/fd/%d:",
						pol->lowers[i]);
		snprintf(dirs + off, sizeof(dirs) - off, "/proc/self/fd/%d", empty);
		close(ovl); /* a context that refused a parameter is not reused */
		ovl = (int)syscall(SYS_fsopen, "overlay", FSOPEN_CLOEXEC_);
		if (ovl < 0)
			return sbx_fail(f, errno, "grader view", "fsopen overlay");
		if (syscall(SYS_fsconfig, ovl, FSCONFIG_SET_STRING_, "lowerdir", dirs, 0) < 0 ||
		    syscall(SYS_fsconfig, ovl, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) < 0)
			goto fail;
	} else if (i >= 0 ||
		   syscall(SYS_fsconfig, ovl, FSCONFIG_SET_FD_, "lowerdir+", NULL, empty) < 0 ||
		   syscall(SYS_fsconfig, ovl, FSCONFIG_CMD_CREATE_, NULL, NULL, 0) < 0) {
		goto fail;
	}
	mnt = (int)syscall(SYS_fsmount, ovl, FSMOUNT_CLOEXEC_,
			   MOUNT_ATTR_RDONLY_ | MOUNT_ATTR_NODEV_ | MOUNT_ATTR_NOSUID_);
	if (mnt < 0)
		goto fail;
	return mnt;
fail:
	saved = errno;
	{
		/* the kernel explains a refusal in the fs context's log */
		static char log[256];
		ssize_t n = read(ovl, log, sizeof(log) - 1);

		if (n > 0) {
			log[n] = 0;
			if (log[n - 1] == '\n')
				log[n - 1] = 0;
			return sbx_fail(f, saved, "grader view: overlay of the layers", log);
		}
	}
	return sbx_fail(f, saved, "grader view", "overlay of the layers");
}

/* Linux before 6.x (a microVM guest's 6.1) clones no tree out of a detached
 * mount (open_tree: EINVAL): there the pristine tree is attached first, on a
 * tmpfs over /dev/shm in this child's namespace alone, detached again once
 * the grader paths have their clones (which stand on their own). */
static int attach_if_needed(int *pristine_fd, int *attached, struct sbx_fail *f)
{
	int t = (int)syscall(SYS_open_tree, *pristine_fd, "", OPEN_TREE_CLONE | O_CLOEXEC |
			     AT_EMPTY_PATH);

	if (t >= 0) {
		close(t);
		return 0;
	}
	if (errno != EINVAL)
		return sbx_fail(f, errno, "grader view", "clone the layers' tree");
	if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=4k,mode=0700") < 0 ||
	    mkdir("/dev/shm/p", 0700) < 0)
		return sbx_fail(f, errno, "grader view", "a place for the layers' tree");
	*attached = 1;
	if (syscall(SYS_move_mount, *pristine_fd, "", AT_FDCWD, "/dev/shm/p",
		    MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return sbx_fail(f, errno, "grader view", "attach the layers' tree");
	close(*pristine_fd);
	*pristine_fd = open("/dev/shm/p", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (*pristine_fd < 0)
		return sbx_fail(f, errno, "grader view", "open the layers' tree");
	return 0;
}

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
	int pristine_fd, attached = 0;

	if (!pol->n_lowers)
		return sbx_fail(f, ENOTSUP, "grader view", "no layers for it in this sandbox");
	/* Made before this child has a mount namespace of its own: kept open
	 * until it execs (the clones below hold the overlay), and a detached
	 * mount either way; but a layer that is a mount of sbx-init's namespace
	 * (a microVM guest's) is one only there: overlayfs refuses to take a
	 * lower from another namespace ("failed to clone lowerpath"). */
	pristine_fd = pristine_tree(pol, f);
	if (pristine_fd < 0)
		return -1;
	if (unshare(CLONE_NEWNS) < 0)
		return sbx_fail(f, errno, "grader view", "unshare the mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		return sbx_fail(f, errno, "grader view", "make / private");
	if (attach_if_needed(&pristine_fd, &attached, f) < 0)
		return -1;
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
	if (attached && umount2("/dev/shm", MNT_DETACH) < 0)
		return sbx_fail(f, errno, "grader view: detach", "/dev/shm");
	if (lstat("/root", &have) == 0 && S_ISDIR(have.st_mode)) {
		snprintf(opts, sizeof(opts), "size=64m,mode=0700,uid=%u,gid=%u", uid, gid);
		if (mount("tmpfs", "/root", "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
			return sbx_fail(f, errno, "grader view: fresh HOME", "/root");
	}
	return 0;
}
