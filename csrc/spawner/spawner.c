/* edged-spawner: make one container sandbox and exec sbx-init as its PID 1.
 *
 * Started by the daemon with posix_spawn (vfork semantics: the Python daemon
 * is never forked); exits as soon as sbx-init runs, leaving sbx-init parented
 * to the host's init, so that a sandbox outlives a daemon restart.
 *
 * Usage:
 *   edged-spawner --status-fd N --root DIR --ctl SOCKET --log FILE --init SBX_INIT
 *                 --uid-base N --id-count N --hostname NAME --disk-bytes N
 *                 --lower DIR [--lower DIR...]          (bottom first)
 *                 [--join CGROUP_DIR...]                 (cgroups to enter)
 *                 [--cg-freezer DIR --cg-memory DIR | --cg-v2 DIR]  (for sbx-init)
 *                 [--upper-dir DIR]      (host dir for upper/ and work/ instead of a tmpfs)
 *                 [--protect PATH...]    (sandbox paths made read-only mounts)
 *                 [--pristine PATH...]   (sandbox paths a grader exec sees as the
 *                                         layers have them: see "grader view" below)
 *                 [--sysfs 1]            (a sysfs of the sandbox's netns on /sys;
 *                                         without it /sys is an empty directory)
 *                 [--caps MASK]          (capabilities kept, bit n = capability n)
 *                 [--netns-fd N]         (join this network namespace instead of
 *                                         making one: see "networked sandboxes")
 *                 [--landlock FILE] [--seccomp FILE] [--apparmor PROFILE]
 *                                        (policies sbx-init applies per exec)
 *                 [--spare-idle-ms N]    (sbx-init drops the child it forks ahead
 *                                         of the next exec after N ms without an
 *                                         exec; 0 or none: it keeps it)
 * Writes one line to the status fd: "ok PID" (host pid of sbx-init) or
 * "error ERRNO MESSAGE", and exits 0 or 1.
 *
 * Pool mode, to take process start-up and namespace creation off a create's
 * critical path:
 *   edged-spawner --pool 1 --status-fd N --uid-base N --id-count N [--join DIR...]
 * does steps 2, 3 and 1 (into the --join cgroups: the daemon renames them to
 * the sandbox's later) at once, writes "ready" to the status fd, then reads
 * the options above (NUL-separated, same --uid-base and --id-count, no
 * --join) from stdin up to EOF and carries on with step 4.  EOF without options
 * (the daemon closing its pool) kills the half-made child and exits 0.
 *
 * Order of work, and why:
 *  2. clone3 the child into new user, mount, pid, net, ipc and uts
 *     namespaces.  It waits (and exits if this process dies first) for one
 *     setup message: these options and the fds it needs, as it may
 *     be made before the sandbox it will become is known.
 *  3. Write its uid/gid maps: sandbox 0..count-1 = host base..base+count-1, so
 *     sandbox root is an unprivileged host uid.
 *  1. Enter the sandbox's cgroups, so that everything after is accounted:
 *     this process before step 2 (the child is born in them), or, pooled,
 *     this process and the child right after step 3.  The child makes its
 *     cgroup namespace only once it is in them (unshare after the setup
 *     message), so that the namespace is rooted at the sandbox's cgroups,
 *     not at the daemon's.
 *  4. Here, as host root, build the rootfs as detached mounts (nothing ever
 *     appears in the host's mount table, and a crash leaves nothing behind):
 *     each lower cloned with open_tree and id-mapped through the child's user
 *     namespace (host uid 0 files appear owned by sandbox root; needs
 *     CAP_SYS_ADMIN in the initial namespace, hence here and not in the
 *     child), a per-sandbox tmpfs of --disk-bytes holding upper and work, and
 *     an overlay over them configured by fd (lowerdir+, Linux >= 6.13).  The
 *     overlay's mount fd goes to the child over a socketpair, with clones of
 *     the tmpfs's dev/ and shm/ directories and, for a grader view, the lowers.
 *  5. The child attaches it (sent with the setup message), mounts /proc, /dev
 *     (and /sys with --sysfs), sets the hostname,
 *     brings loopback up, pivots into it and execs sbx-init from an fd opened
 *     on the host.  Confinement (seccomp, Landlock, capability drop,
 *     no_new_privs) belongs between pivot_root and the exec: see the
 *     "confinement" comment in child_main.
 *
 * Protected paths are read-only bind mounts made by sandbox root before it
 * drops CAP_SYS_ADMIN (with the rest of the capabilities not in --caps, from
 * the bounding set too).  Without CAP_SYS_ADMIN in the sandbox's user
 * namespace the workload cannot remount or unmount them; a user namespace it
 * might create gets a copy of the mount table in which the kernel locks them
 * (read-only and not unmountable: MNT_LOCK_READONLY / MNT_LOCKED).  Landlock,
 * applied by sbx-init to each exec, denies the same writes independently.
 *
 * Networked sandboxes (--netns-fd): the daemon makes the network namespace
 * (veth, addresses, routes) and hands it over as an open fd; this process
 * joins it before the clone, which then leaves out CLONE_NEWNET.  The
 * namespace stays owned by the initial user namespace, so the sandbox's root,
 * root only in its own user namespace, holds no capability over it: it
 * cannot change its address or routes, or open raw sockets, whatever
 * capabilities a task profile keeps.  (In pool mode the option comes with
 * --pool: the namespace is chosen when the spawner is started.)
 *
 * Grader view (--pristine): the workload may write much that a grader runs
 * (/etc/python3.11/sitecustomize.py, a .pth file, a grader tool it can
 * reach), and listing such paths one by one never ends.  So sbx-init keeps
 * the id-mapped lowers as detached mounts that no workload process can reach
 * (fds of its own; before 6.15 attached beneath /proc instead, see
 * reclone_lowers), and for a grader exec its child makes a mount namespace
 * of its own, a read-only overlay of the lowers alone (no upper: what the
 * layers hold, nothing the workload wrote) and mounts clones of that tree
 * over each --pristine path.  sbx-init keeps CAP_SYS_ADMIN in the sandbox's
 * user namespace for this (permitted and effective, never in the bounding
 * set, dropped from its inheritable set at start, so no exec gets it).
 *
 * Kernel objects per sandbox are a density budget: every memory cgroup on the
 * host gets shrinker tables sized by the number of superblocks on the host
 * (mm/shrinker.c: 1 KiB per 64 per NUMA node), so each superblock a sandbox
 * holds costs a little in every memory cgroup, and the host's cost grows as
 * N squared.  Hence one tmpfs per sandbox for the upper, /dev and /dev/shm
 * (directories of it, bound), no sysfs unless the task profile asks for one,
 * and the grader's overlay only while a grader exec runs (it dies with that
 * exec's mount namespace).  What is left: the overlay, the tmpfs, proc,
 * devpts and the IPC namespace's mqueue.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/mount.h>
#include <linux/sched.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_LOWERS 64
#define MAX_JOIN 16
#define MAX_PROTECT 256
#define MAX_ARGS (2 * (MAX_LOWERS + MAX_JOIN + MAX_PROTECT + 32))
#define MAX_SETUP (128 << 10) /* bytes of options in the setup message */
#define SANDBOX_NOFILE 4096 /* sbx-init needs ~6 per exec, at most 256 execs */

#include "lfs_cleanup.h"
#include "lfs_confine.h"
#include "lfs_error.h"

struct opts {
	int status_fd, pool, joined, netns_fd;
	const char *root, *ctl, *log, *init, *hostname;
	unsigned long uid_base, id_count;
	unsigned long long disk_bytes;
	const char *lowers[MAX_LOWERS];
	int n_lowers;
	const char *join[MAX_JOIN];
	int n_join;
	const char *cg_freezer, *cg_memory, *cg_v2;
	const char *upper_dir, *landlock, *seccomp, *apparmor, *spare_idle_ms;
	const char *protect[MAX_PROTECT];
	int n_protect;
	const char *pristine[MAX_PROTECT];
	int n_pristine;
	int has_caps, sysfs;
	unsigned long long caps;
};

static int write_file(const char *path, const char *text, struct lfs_error *e)
{
	cleanup_close int fd = open(path, O_WRONLY | O_CLOEXEC);

	if (fd < 0)
		return lfs_error_set(e, errno, "open `%s`", path);
	if (write(fd, text, strlen(text)) != (ssize_t)strlen(text))
		return lfs_error_set(e, errno, "write `%s`", path);
	return 0;
}

/* The kernel explains fsconfig failures in the fs context's log. */
static int fs_fail(struct lfs_error *e, int fsfd, int code, const char *what)
{
	char log[256];
	ssize_t n = read(fsfd, log, sizeof(log) - 1);

	if (n > 0) {
		log[n] = 0;
		if (log[n - 1] == '\n')
			log[n - 1] = 0;
		return lfs_error_set(e, code, "%s: %s (%s)", what, strerror(code), log);
	}
	return lfs_error_set(e, code, "%s: %s", what, strerror(code));
}

/* The setup message: a u32 mask of which of the SETUP_* fds follow (in that
 * order, as SCM_RIGHTS), with SETUP_F_STAGED, then the lowers for the grader
 * view, if any (bottom first), then the options, NUL-separated. */
enum { SETUP_ROOT, SETUP_SCRATCH, SETUP_LISTEN, SETUP_INIT, SETUP_LOG, SETUP_CG_A, SETUP_CG_B,
       SETUP_LL, SETUP_SC, SETUP_DEV, SETUP_SHM, SETUP_SYSFS, SETUP_NFDS };
#define SETUP_MAX_FDS (SETUP_NFDS + MAX_LOWERS)
/* the rootfs was staged (staged_rootfs): this kernel takes no layer from a
 * detached mount, so the grader view's layers are attached (reclone_lowers) */
#define SETUP_F_STAGED (1u << 31)

static int send_setup(int sock, const char *args, size_t len, const int fds[SETUP_NFDS],
		      const int *lowers, int n_lowers, uint32_t flags)
{
	uint32_t mask = flags & SETUP_F_STAGED;
	struct iovec iov[2] = {{.iov_base = &mask, .iov_len = sizeof(mask)},
			       {.iov_base = (void *)args, .iov_len = len}};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * SETUP_MAX_FDS)];
	} c;
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = c.buf};
	struct cmsghdr *cm;
	int i, n = 0, sent[SETUP_MAX_FDS];

	for (i = 0; i < SETUP_NFDS; i++)
		if (fds[i] >= 0) {
			mask |= 1u << i;
			sent[n++] = fds[i];
		}
	for (i = 0; i < n_lowers && i < MAX_LOWERS; i++)
		sent[n++] = lowers[i];
	memset(c.buf, 0, sizeof(c.buf));
	m.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
	cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
	memcpy(CMSG_DATA(cm), sent, sizeof(int) * (size_t)n);
	return sendmsg(sock, &m, MSG_NOSIGNAL) == (ssize_t)(sizeof(mask) + len) ? 0 : -1;
}

/* Receive the setup message into args (NUL-terminated), fds (-1: absent),
 * lowers (*n_lowers of them) and *flags (SETUP_F_*).  Returns the length of
 * the options, -1 on error (errno set). */
static ssize_t recv_setup(int sock, char *args, size_t cap, int fds[SETUP_NFDS],
			  int lowers[MAX_LOWERS], int *n_lowers, uint32_t *flags)
{
	uint32_t mask = 0;
	struct iovec iov[2] = {{.iov_base = &mask, .iov_len = sizeof(mask)},
			       {.iov_base = args, .iov_len = cap - 1}};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * SETUP_MAX_FDS)];
	} c;
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = c.buf,
			   .msg_controllen = sizeof(c.buf)};
	struct cmsghdr *cm;
	int i, n = 0, total, fixed, got[SETUP_MAX_FDS];
	ssize_t r;

	for (i = 0; i < SETUP_NFDS; i++)
		fds[i] = -1;
	*n_lowers = 0;
	r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
	if (r < 0)
		return -1;
	cm = CMSG_FIRSTHDR(&m);
	if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
		n = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
	if (n > SETUP_MAX_FDS)
		n = SETUP_MAX_FDS;
	if (n)
		memcpy(got, CMSG_DATA(cm), sizeof(int) * (size_t)n);
	total = n;
	*flags = mask & SETUP_F_STAGED;
	mask &= ~SETUP_F_STAGED;
	fixed = r < (ssize_t)sizeof(mask) ? total + 1 : __builtin_popcount(mask);
	if (r < (ssize_t)sizeof(mask) || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
	    fixed > total || total - fixed > MAX_LOWERS || mask >> SETUP_NFDS) {
		for (i = 0; i < total; i++)
			close(got[i]);
		errno = EPROTO;
		return -1;
	}
	for (i = 0, n = 0; i < SETUP_NFDS; i++)
		if (mask & (1u << i))
			fds[i] = got[n++];
	for (i = fixed; i < total; i++)
		lowers[(*n_lowers)++] = got[i];
	r -= (ssize_t)sizeof(mask);
	args[r] = 0;
	return r;
}

/* Split NUL-separated options into argv[1..]; returns argc, or -1 if more
 * than MAX_ARGS. */
static int split_args(char *args, size_t len, char **argv)
{
	int argc = 1;
	size_t i = 0;

	argv[0] = "edged-spawner";
	while (i < len) {
		if (argc == MAX_ARGS)
			return -1;
		argv[argc++] = args + i;
		i += strlen(args + i) + 1;
	}
	argv[argc] = NULL;
	return argc;
}

static int parse_args(int argc, char **argv, struct opts *o, struct lfs_error *e);

/* ---- the child: runs inside the new namespaces ------------------------- */

struct child_fds {
	int sync;        /* socketpair end */
	int listen;      /* control socket, bound */
	int init_exe;    /* sbx-init binary */
	int log;         /* sbx-init's stderr */
	int cg_a, cg_b;  /* cgroup dirs for sbx-init, or -1 */
	int ll, sc;      /* policy files for sbx-init, or -1 */
	int scratch;     /* the scratch dir (upper/, work/) */
	int rootmnt;     /* the detached overlay */
	int dev, shm;    /* the scratch tmpfs's dev/ and shm/, detached */
	int lowers[MAX_LOWERS]; /* the lowers for grader views (bottom first) */
	int n_lowers;
	int sysfs;       /* a detached sysfs (joined network namespace), or -1 */
	uint32_t flags;  /* SETUP_F_* */
};

static int bind_dev(const char *name, struct lfs_error *e)
{
	char host[64], target[64];
	cleanup_close int fd = -1;

	snprintf(host, sizeof(host), "/dev/%s", name);
	snprintf(target, sizeof(target), "dev/%s", name);
	fd = open(target, O_CREAT | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0666);
	if (fd < 0)
		return lfs_error_set(e, errno, "create `%s`", target);
	if (mount(host, target, NULL, MS_BIND, NULL) < 0)
		return lfs_error_set(e, errno, "bind `%s` on `%s`", host, target);
	return 0;
}

static int ensure_dir(const char *path, mode_t mode, struct lfs_error *e)
{
	struct stat st;

	if (lstat(path, &st) == 0) {
		if (S_ISDIR(st.st_mode))
			return 0;
		return lfs_error_set(e, ENOTDIR, "rootfs `/%s` is not a directory", path);
	}
	if (mkdir(path, mode) < 0 && errno != EEXIST)
		return lfs_error_set(e, errno, "mkdir `/%s`", path);
	if (mode & 07000)
		chmod(path, mode);
	return 0;
}

/* /dev and /dev/shm are directories of the sandbox's scratch tmpfs (made and
 * cloned by the parent: `dev`, `shm`), so they share its size limit and cost
 * no superblock of their own. */
static int make_dev(int dev, int shm, struct lfs_error *e)
{
	static const char *const nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
	static const char *const links[][2] = {
		{"pts/ptmx", "dev/ptmx"},     {"/proc/self/fd", "dev/fd"},
		{"/proc/self/fd/0", "dev/stdin"}, {"/proc/self/fd/1", "dev/stdout"},
		{"/proc/self/fd/2", "dev/stderr"},
	};
	size_t i;

	if (move_mount(dev, "", AT_FDCWD, "dev", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "mount `/dev`");
	for (i = 0; i < sizeof(nodes) / sizeof(nodes[0]); i++)
		if (bind_dev(nodes[i], e) < 0)
			return -1;
	if (mkdir("dev/pts", 0755) < 0 || mkdir("dev/shm", 01777) < 0)
		return lfs_error_set(e, errno, "mkdir in `/dev`");
	if (mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
		  "newinstance,ptmxmode=0666,mode=0620") < 0)
		return lfs_error_set(e, errno, "mount devpts on `/dev/pts`");
	if (move_mount(shm, "", AT_FDCWD, "dev/shm", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "mount `/dev/shm`");
	for (i = 0; i < sizeof(links) / sizeof(links[0]); i++)
		if (symlink(links[i][0], links[i][1]) < 0)
			return lfs_error_set(e, errno, "symlink `%s`", links[i][1]);
	return 0;
}

static int loopback_up(struct lfs_error *e)
{
	struct ifreq ifr;
	cleanup_close int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);

	if (s < 0)
		return lfs_error_set(e, errno, "socket for `lo`");
	memset(&ifr, 0, sizeof(ifr));
	strcpy(ifr.ifr_name, "lo");
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		return lfs_error_set(e, errno, "SIOCGIFFLAGS `lo`");
	/* A network namespace the daemon made (--netns-fd) has it up already,
	 * and belongs to the initial user namespace: sandbox root may not touch
	 * its interfaces at all. */
	if (ifr.ifr_flags & IFF_UP)
		return 0;
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		return lfs_error_set(e, errno, "SIOCSIFFLAGS `lo`");
	return 0;
}

/* Make each protected path a read-only (recursive) bind mount of itself.  Runs
 * after pivot_root, so a symlink in the image resolves inside the sandbox.  A
 * path that is itself a symlink (merged-/usr /bin) is left to Landlock: its
 * target is protected when listed too. */
static int protect_paths(const struct opts *o, struct lfs_error *e)
{
	struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID |
					      MOUNT_ATTR_NODEV};
	int i;

	for (i = 0; i < o->n_protect; i++) {
		const char *p = o->protect[i];
		cleanup_close int t = -1;
		struct stat st;

		if (fstatat(AT_FDCWD, p, &st, AT_SYMLINK_NOFOLLOW) < 0) {
			if (errno == ENOENT || errno == ENOTDIR)
				continue;
			return lfs_error_set(e, errno, "protect `%s`", p);
		}
		if (S_ISLNK(st.st_mode))
			continue;
		t = open_tree(AT_FDCWD, p, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE |
					      AT_SYMLINK_NOFOLLOW);
		if (t < 0)
			return lfs_error_set(e, errno, "protect `%s`: open_tree", p);
		if (mount_setattr(t, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof(attr)) < 0)
			return lfs_error_set(e, errno, "protect `%s`: read-only", p);
		if (move_mount(t, "", AT_FDCWD, p, MOVE_MOUNT_F_EMPTY_PATH) < 0)
			return lfs_error_set(e, errno, "protect `%s`: attach", p);
	}
	return 0;
}

/* The lowers sbx-init keeps for grader views, and the scratch mount whose
 * empty/ is their bottom layer, must be detached mounts whose (anonymous)
 * mount namespace belongs to the sandbox's user namespace: overlayfs clones
 * its layers (clone_private_mount), which needs CAP_SYS_ADMIN over the
 * namespace of a detached layer, and the parent's mounts belong to the host's.
 * So each is attached here for an instant, on /proc before proc is mounted
 * there (inside this private mount namespace, nothing else sees it), cloned
 * again from there by this child, and detached. */
static int reclone(int *fd, const char *what, struct lfs_error *e)
{
	int t;

	if (move_mount(*fd, "", AT_FDCWD, "proc", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "grader view: attach %s", what);
	t = open_tree(AT_FDCWD, "proc", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
	if (t < 0)
		return lfs_error_set(e, errno, "grader view: clone %s", what);
	if (umount2("proc", MNT_DETACH) < 0) {
		close(t);
		return lfs_error_set(e, errno, "grader view: detach %s", what);
	}
	close(*fd);
	*fd = t;
	return 0;
}

/* Private first: a clone of a shared mount (a systemd host's are) is in its
 * peer group, and proc mounted on top of it would appear on the host's
 * directory too (and keep a layer there from being unmounted). */
static int attach_under_proc(int fd, const char *what, struct lfs_error *e)
{
	struct mount_attr attr = {.propagation = MS_PRIVATE};

	if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) < 0)
		return lfs_error_set(e, errno, "grader view: make %s private", what);
	if (move_mount(fd, "", AT_FDCWD, "proc", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "grader view: attach %s under /proc", what);
	return 0;
}

static int reclone_lowers(struct child_fds *f, struct lfs_error *e)
{
	int i;

	if (!f->n_lowers)
		return 0;
	if (f->flags & SETUP_F_STAGED) {
		/* Before 6.15 (the 6.1 LTS; where the rootfs was staged, or
		 * EDGED_SPAWNER_STAGED=1 forced it) overlayfs takes no layer from
		 * a detached mount (clone_private_mount wants it in the caller's
		 * namespace, and a detached mount attaches only once), so no grader
		 * view could be made from detached lowers.  There the scratch
		 * mount and the lowers stay attached in the sandbox's namespace,
		 * stacked on /proc before proc is mounted over them: no path
		 * reaches them (only sbx-init's fds do), the workload cannot
		 * unmount proc (no CAP_SYS_ADMIN; a user namespace it makes gets the
		 * tree locked), and a grader's child makes its overlay from the
		 * fds' paths (grader.c). */
		if (attach_under_proc(f->scratch, "the scratch dir", e) < 0)
			return -1;
		for (i = 0; i < f->n_lowers; i++)
			if (attach_under_proc(f->lowers[i], "a lower", e) < 0)
				return -1;
		return 0;
	}
	if (reclone(&f->scratch, "the scratch dir", e) < 0)
		return -1;
	for (i = 0; i < f->n_lowers; i++)
		if (reclone(&f->lowers[i], "a lower", e) < 0)
			return -1;
	return 0;
}

static int child_setup(const struct opts *o, struct child_fds *f, struct lfs_error *e)
{
	cleanup_close int rootmnt = f->rootmnt;

	f->rootmnt = -1;
	if (rootmnt < 0 || f->scratch < 0 || f->listen < 0 || f->init_exe < 0 || f->log < 0 ||
	    f->dev < 0 || f->shm < 0)
		return lfs_error_set(e, EPROTO, "setup message without the rootfs, scratch, socket or log");
	/* Moved into the sandbox's cgroups by the parent before the setup
	 * message: the cgroup namespace is rooted there. */
	if (unshare(CLONE_NEWCGROUP) < 0)
		return lfs_error_set(e, errno, "unshare the cgroup namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		return lfs_error_set(e, errno, "make `/` private");
	/* Attached on top of this namespace's "/", not on --root: this child runs
	 * as the sandbox's host uid, which cannot search the 0700 state dir.  The
	 * old root underneath is detached after pivot_root all the same. */
	if (move_mount(rootmnt, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "attach the rootfs");
	if (fchdir(rootmnt) < 0)
		return lfs_error_set(e, errno, "chdir into the rootfs");
	/* The maps are written now: become root of the new user namespace. */
	if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
		return lfs_error_set(e, errno, "setresuid(0) in the user namespace");
	if (setgroups(0, NULL) < 0)
		return lfs_error_set(e, errno, "setgroups");
	if (ensure_dir("proc", 0555, e) || ensure_dir("dev", 0755, e) || ensure_dir("sys", 0555, e) ||
	    ensure_dir("tmp", 01777, e))
		return -1;
	if (reclone_lowers(f, e) < 0)
		return -1;
	if (mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		return lfs_error_set(e, errno, "mount proc on `/proc`");
	if (make_dev(f->dev, f->shm, e) < 0)
		return -1;
	if (f->sysfs >= 0) {
		cleanup_close int sysfs = f->sysfs;

		f->sysfs = -1;
		if (move_mount(sysfs, "", AT_FDCWD, "sys", MOVE_MOUNT_F_EMPTY_PATH) < 0)
			return lfs_error_set(e, errno, "attach sysfs on `/sys`");
	} else if (o->sysfs &&
		   mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
			 NULL) < 0)
		return lfs_error_set(e, errno, "mount sysfs on `/sys`");
	if (sethostname(o->hostname, strlen(o->hostname)) < 0)
		return lfs_error_set(e, errno, "sethostname `%s`", o->hostname);
	if (loopback_up(e) < 0)
		return -1;
	/* pivot_root(".", ".") stacks the old root under the new one; detaching
	 * it leaves no path to the host's filesystem. */
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		return lfs_error_set(e, errno, "pivot_root into `%s`", o->root);
	if (umount2(".", MNT_DETACH) < 0)
		return lfs_error_set(e, errno, "detach the old root");
	if (chdir("/") < 0)
		return lfs_error_set(e, errno, "chdir `/`");
	return protect_paths(o, e);
}

/* Put `fd` at number `to` (without close-on-exec). */
static int place_fd(int fd, int to)
{
	if (fd == to)
		return fcntl(fd, F_SETFD, 0);
	return dup3(fd, to, 0) < 0 ? -1 : 0;
}

static void child_main(int sync)
{
	static char args[MAX_SETUP];
	static char *oargv[MAX_ARGS + 1];
	static struct opts opts;
	const struct opts *o = &opts;
	struct child_fds fds, *f = &fds;
	struct lfs_error e = {0};
	char *argv[24];
	char *envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", NULL};
	int argc = 0, hi = 100, nul, got[SETUP_NFDS], oargc;
	ssize_t len;

	f->sync = sync;
	len = recv_setup(sync, args, sizeof(args), got, f->lowers, &f->n_lowers, &f->flags);
	if (len < 0)
		_exit(1); /* the spawner went away before the sandbox was known */
	f->rootmnt = got[SETUP_ROOT];
	f->scratch = got[SETUP_SCRATCH];
	f->listen = got[SETUP_LISTEN];
	f->init_exe = got[SETUP_INIT];
	f->log = got[SETUP_LOG];
	f->cg_a = got[SETUP_CG_A];
	f->cg_b = got[SETUP_CG_B];
	f->ll = got[SETUP_LL];
	f->sc = got[SETUP_SC];
	f->dev = got[SETUP_DEV];
	f->shm = got[SETUP_SHM];
	f->sysfs = got[SETUP_SYSFS];
	oargc = split_args(args, (size_t)len, oargv);
	if (oargc < 0) {
		lfs_error_set(&e, E2BIG, "too many options");
		goto out;
	}
	if (parse_args(oargc, oargv, &opts, &e) < 0 || child_setup(o, f, &e) < 0)
		goto out;
	/* Capabilities and no_new_privs here, for sbx-init and all it starts.
	 * Landlock and seccomp are sbx-init's to apply, to each exec: sbx-init
	 * must stay outside the workload's Landlock domain so that the domain's
	 * signal and abstract-socket scoping protects it. */
	/* Open files per process: with the pids limit this bounds the share of the
	 * host's fs.file-max one sandbox can take (each struct file is also charged
	 * to its memory cgroup).  Lowering the hard limit needs no privilege, and
	 * without CAP_SYS_RESOURCE the sandbox cannot raise it again. */
	{
		struct rlimit rl = {.rlim_cur = SANDBOX_NOFILE, .rlim_max = SANDBOX_NOFILE};

		if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
			lfs_error_set(&e, errno, "setrlimit(RLIMIT_NOFILE, %d)", SANDBOX_NOFILE);
			goto out;
		}
	}
	if (o->has_caps) {
		/* CAP_SYS_ADMIN is sbx-init's own when it makes grader views */
		uint64_t held = f->n_lowers ? 1ULL << CAP_SYS_ADMIN : 0;

		if (lfs_caps_restrict_held(o->caps, held & ~o->caps, &e) < 0)
			goto out;
	}

	/* Move the fds sbx-init keeps to 3..6 (via high numbers, so no dup
	 * clobbers another) and close everything else.  The sync socket stays
	 * open, close-on-exec: the spawner sees the exec happen as EOF. */
	{
		int *src[8 + MAX_LOWERS] = {&f->listen, &f->cg_a, &f->cg_b, &f->ll, &f->sc,
					    &f->scratch, &f->init_exe};
		int i, n = 0, nsrc = 7, sync_hi;

		close(f->dev);
		close(f->shm);
		for (i = 0; i < f->n_lowers; i++)
			src[nsrc++] = &f->lowers[i];
		sync_hi = fcntl(f->sync, F_DUPFD_CLOEXEC, 200);

		if (sync_hi < 0)
			_exit(1);
		f->sync = sync_hi;
		for (i = 0; i < nsrc; i++) {
			if (*src[i] < 0)
				continue;
			*src[i] = fcntl(*src[i], F_DUPFD_CLOEXEC, hi++);
			if (*src[i] < 0) {
				lfs_error_set(&e, errno, "dup");
				goto out;
			}
		}
		/* stdio before the placing: the log's number may be one of 3..3+n,
		 * which the placing reuses (sbx-init's stderr was then a directory) */
		nul = open("/dev/null", O_RDWR | O_CLOEXEC);
		if (nul < 0 || dup3(nul, 0, 0) < 0 || dup3(nul, 1, 0) < 0 || dup3(f->log, 2, 0) < 0) {
			lfs_error_set(&e, errno, "stdio for sbx-init");
			goto out;
		}
		for (i = 0; i < nsrc; i++) {
			if (*src[i] < 0)
				continue;
			if (place_fd(*src[i], 3 + n) < 0) {
				lfs_error_set(&e, errno, "dup");
				goto out;
			}
			*src[i] = 3 + n++;
		}
		fcntl(f->init_exe, F_SETFD, FD_CLOEXEC);
		syscall(SYS_close_range, (unsigned)(3 + n), (unsigned)(sync_hi - 1), 0u);
		syscall(SYS_close_range, (unsigned)(sync_hi + 1), ~0u, 0u);
	}
	{
		static char lfd[16], afd[16], bfd[16], llfd[16], scfd[16], upfd[16];
		static char prfd[MAX_LOWERS * 12];
		static char gpaths[MAX_SETUP];

		argv[argc++] = "sbx-init";
		snprintf(lfd, sizeof(lfd), "%d", f->listen);
		argv[argc++] = "-l";
		argv[argc++] = lfd;
		if (o->cg_v2) {
			snprintf(afd, sizeof(afd), "%d", f->cg_a);
			argv[argc++] = "-u";
			argv[argc++] = afd;
		} else if (o->cg_freezer) {
			snprintf(afd, sizeof(afd), "%d", f->cg_a);
			argv[argc++] = "-f";
			argv[argc++] = afd;
			if (f->cg_b >= 0) {
				snprintf(bfd, sizeof(bfd), "%d", f->cg_b);
				argv[argc++] = "-m";
				argv[argc++] = bfd;
			}
		}
		if (f->ll >= 0) {
			snprintf(llfd, sizeof(llfd), "%d", f->ll);
			argv[argc++] = "-L";
			argv[argc++] = llfd;
		}
		if (f->sc >= 0) {
			snprintf(scfd, sizeof(scfd), "%d", f->sc);
			argv[argc++] = "-S";
			argv[argc++] = scfd;
		}
		if (o->apparmor) {
			argv[argc++] = "-A";
			argv[argc++] = (char *)o->apparmor;
		}
		if (o->spare_idle_ms) {
			argv[argc++] = "-I";
			argv[argc++] = (char *)o->spare_idle_ms;
		}
		if (f->n_lowers && o->n_pristine) {
			size_t off = 0;
			int i;

			for (i = 0; i < f->n_lowers; i++)
				off += (size_t)snprintf(prfd + off, sizeof(prfd) - off, "%s%d",
							i ? ":" : "", f->lowers[i]);
			off = 0;
			argv[argc++] = "-P";
			argv[argc++] = prfd;
			for (i = 0; i < o->n_pristine; i++)
				off += (size_t)snprintf(gpaths + off, sizeof(gpaths) - off, "%s%s",
							i ? ":" : "", o->pristine[i]);
			argv[argc++] = "-G";
			argv[argc++] = gpaths;
		}
		snprintf(upfd, sizeof(upfd), "%d", f->scratch);
		argv[argc++] = "-U";
		argv[argc++] = upfd;
		argv[argc] = NULL;
	}
	syscall(SYS_execveat, f->init_exe, "", argv, envp, AT_EMPTY_PATH);
	lfs_error_set(&e, errno, "exec sbx-init");
out:
	{
		char line[600];
		int n = snprintf(line, sizeof(line), "%d %s", e.code, e.msg);

		(void)!write(f->sync, line, (size_t)(n > 0 ? n : 0));
	}
	_exit(1);
}

/* ---- the parent: host root ------------------------------------------- */

static int write_maps(pid_t pid, const struct opts *o, struct lfs_error *e)
{
	char path[64], map[64];

	snprintf(map, sizeof(map), "0 %lu %lu\n", o->uid_base, o->id_count);
	snprintf(path, sizeof(path), "/proc/%d/uid_map", pid);
	if (write_file(path, map, e) < 0)
		return -1;
	snprintf(path, sizeof(path), "/proc/%d/gid_map", pid);
	return write_file(path, map, e);
}

/* An id-mapped, read-only, detached clone of one lower layer. */
static int idmapped_lower(const char *path, int userns, struct lfs_error *e)
{
	struct mount_attr attr = {
		.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV,
		.userns_fd = (uint64_t)userns,
	};
	int fd = open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);

	if (fd < 0)
		return lfs_error_set(e, errno, "open_tree lower `%s`", path);
	if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) < 0) {
		int saved = errno;

		close(fd);
		return lfs_error_set(e, saved, "id-map lower `%s` (filesystem without idmapped mounts?)", path);
	}
	return fd;
}

/* A detached clone of directory `name` of the scratch mount `scratch`, with
 * mount attributes `attr_set`. */
static int scratch_clone(int scratch, const char *name, uint64_t attr_set, struct lfs_error *e)
{
	struct mount_attr attr = {.attr_set = attr_set};
	int fd = open_tree(scratch, name, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);

	if (fd < 0)
		return lfs_error_set(e, errno, "clone scratch `%s`", name);
	if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) < 0) {
		int saved = errno;

		close(fd);
		return lfs_error_set(e, saved, "mount attributes of scratch `%s`", name);
	}
	return fd;
}

#define DEV_ATTRS (MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NODEV)
#define SHM_ATTRS (MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
#define STAGE "/tmp"

static int staged_wanted(void)
{
	const char *v = getenv("EDGED_SPAWNER_STAGED");

	return v && strcmp(v, "1") == 0;
}

/* Replace *fd, a mount attached at `path`, by a detached clone of it. */
static int detach_clone(int *fd, const char *path, struct lfs_error *e)
{
	int t = open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);

	if (t < 0)
		return lfs_error_set(e, errno, "staged rootfs: clone `%s`", path);
	close(*fd);
	*fd = t;
	return 0;
}

/* A detached mount tree's propagation made private (all of it). */
static int make_private(int fd, struct lfs_error *e)
{
	struct mount_attr attr = {.propagation = MS_PRIVATE};

	if (mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof(attr)) < 0)
		return lfs_error_set(e, errno, "staged rootfs: make a detached mount private");
	return 0;
}

/* The rootfs overlay for kernels before 6.15 (returned; build_rootfs's
 * detached-mount way needs open_tree to clone from a detached mount, 6.15, and
 * overlayfs's "lowerdir+" taking an fd, 6.8; the 6.1 LTS has neither): in a
 * mount namespace of this process's own ("/" made private, so nothing reaches
 * the host's), the scratch and each id-mapped lower are attached beneath a
 * tmpfs on STAGE, the overlay made from their paths (overlayfs clones its
 * layers, which must be in the caller's namespace), and detached clones of the
 * scratch, its dev/ and shm/ and of each lower taken from there to replace
 * *scratch and lowers[] as build_rootfs hands them on; then the staging is
 * detached.  This process only reports and exits afterwards. */
static int staged_rootfs(int n_lowers, int lowers[], int *scratch, int *dev, int *shm,
			 struct lfs_error *e)
{
	char lowerdir[MAX_LOWERS * 16], path[32];
	cleanup_close int ovl = -1;
	size_t len = 0;
	int i, mnt;

	if (unshare(CLONE_NEWNS) < 0)
		return lfs_error_set(e, errno, "staged rootfs: unshare the mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		return lfs_error_set(e, errno, "staged rootfs: make `/` private");
	if (mount("edged-stage", STAGE, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0700") < 0)
		return lfs_error_set(e, errno, "staged rootfs: tmpfs on `%s`", STAGE);
	/* The detached clones are no part of the tree made private above: a
	 * clone of a shared mount (a systemd host's scratch filesystem) stays in
	 * its peer group, and so would the dev/ and shm/ clones taken from it,
	 * so the sandbox's mounts on /dev appeared on the host's scratch dir
	 * (its upper then could not be removed, nor the filesystem unmounted). */
	if (make_private(*scratch, e) < 0)
		return -1;
	for (i = 0; i < n_lowers; i++)
		if (make_private(lowers[i], e) < 0)
			return -1;
	if (mkdir(STAGE "/s", 0700) < 0 ||
	    move_mount(*scratch, "", AT_FDCWD, STAGE "/s", MOVE_MOUNT_F_EMPTY_PATH) < 0)
		return lfs_error_set(e, errno, "staged rootfs: attach the scratch dir");
	/* lowerdir lists the top layer first; lowers[] is bottom first */
	lowerdir[0] = 0;
	for (i = n_lowers - 1; i >= 0; i--) {
		snprintf(path, sizeof(path), STAGE "/l%d", i);
		if (mkdir(path, 0700) < 0 ||
		    move_mount(lowers[i], "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0)
			return lfs_error_set(e, errno, "staged rootfs: attach lower %d", i);
		len += (size_t)snprintf(lowerdir + len, sizeof(lowerdir) - len, "%s%s",
					len ? ":" : "", path);
	}
	ovl = fsopen("overlay", FSOPEN_CLOEXEC);
	if (ovl < 0)
		return lfs_error_set(e, errno, "fsopen overlay");
	/* strings: overlayfs before 6.5 takes only legacy mount data */
	if (fsconfig(ovl, FSCONFIG_SET_STRING, "lowerdir", lowerdir, 0) < 0 ||
	    fsconfig(ovl, FSCONFIG_SET_STRING, "upperdir", STAGE "/s/upper", 0) < 0 ||
	    fsconfig(ovl, FSCONFIG_SET_STRING, "workdir", STAGE "/s/work", 0) < 0 ||
	    fsconfig(ovl, FSCONFIG_SET_FLAG, "volatile", NULL, 0) < 0 ||
	    fsconfig(ovl, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
		return fs_fail(e, ovl, errno, "overlay (staged)");
	mnt = fsmount(ovl, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV);
	if (mnt < 0)
		return lfs_error_set(e, errno, "fsmount overlay (staged)");
	*dev = open_tree(AT_FDCWD, STAGE "/s/dev", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
	*shm = open_tree(AT_FDCWD, STAGE "/s/shm", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
	{
		struct mount_attr dattr = {.attr_set = DEV_ATTRS}, sattr = {.attr_set = SHM_ATTRS};

		if (*dev < 0 || *shm < 0 ||
		    mount_setattr(*dev, "", AT_EMPTY_PATH, &dattr, sizeof(dattr)) < 0 ||
		    mount_setattr(*shm, "", AT_EMPTY_PATH, &sattr, sizeof(sattr)) < 0) {
			lfs_error_set(e, errno, "staged rootfs: clone scratch dev/shm");
			goto fail;
		}
	}
	if (detach_clone(scratch, STAGE "/s", e) < 0)
		goto fail;
	for (i = 0; i < n_lowers; i++) {
		snprintf(path, sizeof(path), STAGE "/l%d", i);
		if (detach_clone(&lowers[i], path, e) < 0)
			goto fail;
	}
	if (umount2(STAGE, MNT_DETACH) < 0) {
		lfs_error_set(e, errno, "staged rootfs: detach `%s`", STAGE);
		goto fail;
	}
	return mnt;
fail:
	close(mnt);
	return -1;
}

/* The rootfs overlay (returned), the scratch mount (upper/, work/, dev/,
 * shm/, empty/; in *scratch_out), clones of its dev/ and shm/ (dev_out[2]) and,
 * when a grader view is wanted, the id-mapped lowers (lowers_out, bottom
 * first: the caller closes them). */
static int build_rootfs(const struct opts *o, pid_t child, int *scratch_out, int dev_out[2],
			int *lowers_out, uint32_t *flags_out, struct lfs_error *e)
{
	char path[64], num[32];
	cleanup_close int userns = -1;
	cleanup_close int tmpfs = -1, tmpmnt = -1, upper = -1, work = -1, ovl = -1;
	cleanup_close int dev = -1, shm = -1;
	int lowers[MAX_LOWERS];
	int i, rc = -1, mnt = -1;

	for (i = 0; i < o->n_lowers; i++)
		lowers[i] = -1;
	snprintf(path, sizeof(path), "/proc/%d/ns/user", child);
	userns = open(path, O_RDONLY | O_CLOEXEC);
	if (userns < 0)
		return lfs_error_set(e, errno, "open `%s`", path);
	for (i = 0; i < o->n_lowers; i++) {
		lowers[i] = idmapped_lower(o->lowers[i], userns, e);
		if (lowers[i] < 0)
			goto out;
	}

	if (o->upper_dir) {
		/* a host directory (e.g. on an XFS filesystem of the node's scratch
		 * storage, whose own size limits the upper), as a detached bind
		 * mount of its own, like the tmpfs: the child attaches clones of it */
		tmpmnt = open_tree(AT_FDCWD, o->upper_dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
		if (tmpmnt < 0) {
			lfs_error_set(e, errno, "open upper dir `%s`", o->upper_dir);
			goto out;
		}
	} else {
		tmpfs = fsopen("tmpfs", FSOPEN_CLOEXEC);
		if (tmpfs < 0) {
			lfs_error_set(e, errno, "fsopen tmpfs");
			goto out;
		}
		snprintf(num, sizeof(num), "%llu", o->disk_bytes);
		if (fsconfig(tmpfs, FSCONFIG_SET_STRING, "size", num, 0) < 0 ||
		    fsconfig(tmpfs, FSCONFIG_SET_STRING, "mode", "0755", 0) < 0 ||
		    fsconfig(tmpfs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) {
			fs_fail(e, tmpfs, errno, "scratch tmpfs");
			goto out;
		}
		tmpmnt = fsmount(tmpfs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID);
		if (tmpmnt < 0) {
			lfs_error_set(e, errno, "fsmount scratch tmpfs");
			goto out;
		}
	}
	/* upper's root becomes the sandbox's "/", dev/ and shm/ its /dev and
	 * /dev/shm: owned by sandbox root; empty/ is the bottom layer of grader
	 * views (overlayfs wants two lowers without an upper), which no workload
	 * process can reach (the scratch root is mounted nowhere it can see) */
	if (mkdirat(tmpmnt, "upper", 0755) < 0 || mkdirat(tmpmnt, "work", 0700) < 0 ||
	    mkdirat(tmpmnt, "dev", 0755) < 0 || mkdirat(tmpmnt, "shm", 01777) < 0 ||
	    mkdirat(tmpmnt, "empty", 0555) < 0 ||
	    fchmodat(tmpmnt, "shm", 01777, 0) < 0 ||
	    fchownat(tmpmnt, "upper", (uid_t)o->uid_base, (gid_t)o->uid_base, 0) < 0 ||
	    fchownat(tmpmnt, "dev", (uid_t)o->uid_base, (gid_t)o->uid_base, 0) < 0 ||
	    fchownat(tmpmnt, "shm", (uid_t)o->uid_base, (gid_t)o->uid_base, 0) < 0) {
		lfs_error_set(e, errno, "scratch upper/work/dev/shm");
		goto out;
	}
	/* EDGED_SPAWNER_STAGED=1 takes the staged way on any kernel (its tests) */
	dev = staged_wanted() ? -1 : scratch_clone(tmpmnt, "dev", DEV_ATTRS, e);
	if (dev < 0 && (staged_wanted() || e->code == EINVAL)) {
		/* no clones of detached mounts: before 6.15 */
		memset(e, 0, sizeof(*e));
		mnt = staged_rootfs(o->n_lowers, lowers, &tmpmnt, &dev, &shm, e);
		if (mnt < 0)
			goto out;
		*flags_out |= SETUP_F_STAGED;
		goto done;
	}
	shm = dev < 0 ? -1 : scratch_clone(tmpmnt, "shm", SHM_ATTRS, e);
	if (shm < 0)
		goto out;
	upper = openat(tmpmnt, "upper", O_PATH | O_DIRECTORY | O_CLOEXEC);
	work = openat(tmpmnt, "work", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (upper < 0 || work < 0) {
		lfs_error_set(e, errno, "open scratch upper/work");
		goto out;
	}

	ovl = fsopen("overlay", FSOPEN_CLOEXEC);
	if (ovl < 0) {
		lfs_error_set(e, errno, "fsopen overlay");
		goto out;
	}
	/* lowerdir+ appends below the layers given so far: top first */
	for (i = o->n_lowers - 1; i >= 0; i--)
		if (fsconfig(ovl, FSCONFIG_SET_FD, "lowerdir+", NULL, lowers[i]) < 0) {
			fs_fail(e, ovl, errno, "overlay lowerdir+");
			goto out;
		}
	if (fsconfig(ovl, FSCONFIG_SET_FD, "upperdir", NULL, upper) < 0 ||
	    fsconfig(ovl, FSCONFIG_SET_FD, "workdir", NULL, work) < 0 ||
	    /* the upper dies with the sandbox: no fsync is worth paying for */
	    fsconfig(ovl, FSCONFIG_SET_FLAG, "volatile", NULL, 0) < 0 ||
	    fsconfig(ovl, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) {
		fs_fail(e, ovl, errno, "overlay");
		goto out;
	}
	mnt = fsmount(ovl, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV);
	if (mnt < 0) {
		lfs_error_set(e, errno, "fsmount overlay");
		goto out;
	}
done:
	*scratch_out = steal_fd(&tmpmnt);
	dev_out[0] = steal_fd(&dev);
	dev_out[1] = steal_fd(&shm);
	for (i = 0; i < o->n_lowers; i++)
		lowers_out[i] = lowers[i];
	rc = mnt;
out:
	/* On success the lower clones stay open until this process exits, after
	 * "ok" is reported: the overlay holds clones of its own, and closing
	 * ours dissolves them, which waits for an RCU grace period. */
	for (i = 0; i < o->n_lowers && rc < 0; i++)
		if (lowers[i] >= 0)
			close(lowers[i]);
	return rc;
}

static int open_listen(const char *path, struct lfs_error *e)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd;

	if (strlen(path) >= sizeof(sa.sun_path))
		return lfs_error_set(e, ENAMETOOLONG, "control socket path `%s`", path);
	strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return lfs_error_set(e, errno, "socket");
	if (unlink(path) < 0 && errno != ENOENT) {
		lfs_error_set(e, errno, "unlink `%s`", path);
		close(fd);
		return -1;
	}
	/* listen here too, so the daemon can connect as soon as we report ok;
	 * sbx-init listens again, which makes it the SO_PEERCRED peer */
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || chmod(path, 0600) < 0 ||
	    listen(fd, 8) < 0) {
		lfs_error_set(e, errno, "bind `%s`", path);
		close(fd);
		return -1;
	}
	return fd;
}

/* Enter the sandbox's cgroups: this process (its rootfs work is accounted
 * there too) and the waiting child. */
static int join_cgroups(const struct opts *o, pid_t child, struct lfs_error *e)
{
	char path[4096], pid[32];
	int i;

	snprintf(pid, sizeof(pid), "%d", child);
	for (i = 0; i < o->n_join; i++) {
		/* This single-threaded process moves itself through v1's "tasks":
		 * the kernel then skips write-locking the global
		 * cgroup_threadgroup_rwsem, and its wait for an RCU grace period
		 * (milliseconds when no move happened lately); moving the child
		 * (another process) takes it.  v2 has "cgroup.procs" only. */
		snprintf(path, sizeof(path), "%s/tasks", o->join[i]);
		if (access(path, W_OK) < 0)
			snprintf(path, sizeof(path), "%s/cgroup.procs", o->join[i]);
		if (write_file(path, "0", e) < 0)
			return -1;
		if (child > 0) {
			snprintf(path, sizeof(path), "%s/cgroup.procs", o->join[i]);
			if (write_file(path, pid, e) < 0)
				return -1;
		}
	}
	return 0;
}

/* Set once this process has joined a --netns-fd namespace (pool mode parses
 * the options again after the clone). */
static int netns_joined;

/* sysfs for a sandbox in a joined network namespace: mounting one needs
 * CAP_SYS_ADMIN over the namespace's owner, the initial user namespace, so it
 * is made here, as host root in that namespace (it shows the sandbox's own
 * interfaces), read-only and detached, and the child attaches it. */
static int make_sysfs(struct lfs_error *e)
{
	cleanup_close int fs = fsopen("sysfs", FSOPEN_CLOEXEC);
	int mnt;

	if (fs < 0)
		return lfs_error_set(e, errno, "fsopen sysfs");
	if (fsconfig(fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
		return fs_fail(e, fs, errno, "create sysfs");
	mnt = fsmount(fs, FSMOUNT_CLOEXEC,
		      MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC);
	if (mnt < 0)
		return lfs_error_set(e, errno, "fsmount sysfs");
	return mnt;
}

/* A child in new namespaces with its id maps written, waiting for its setup
 * message on `sync`. */
struct pre {
	pid_t pid;
	int sync;
};

static void pre_kill(struct pre *p)
{
	if (p->pid > 0) {
		kill(p->pid, SIGKILL);
		waitpid(p->pid, NULL, 0);
		p->pid = 0;
	}
	if (p->sync >= 0) {
		close(p->sync);
		p->sync = -1;
	}
}

static int prefork(const struct opts *o, struct pre *p, struct lfs_error *e)
{
	/* CLONE_NEWCGROUP comes later, from the child itself: see child_setup */
	struct clone_args ca = {
		.flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC |
			 CLONE_NEWUTS,
		.exit_signal = SIGCHLD,
	};
	pid_t pid;
	int sv[2];

	p->pid = 0;
	p->sync = -1;
	if (o->netns_fd >= 0) {
		/* as host root, before the euid change below */
		if (setns(o->netns_fd, CLONE_NEWNET) < 0)
			return lfs_error_set(e, errno, "join the network namespace (fd %d)", o->netns_fd);
		close(o->netns_fd);
		ca.flags &= ~(unsigned long long)CLONE_NEWNET;
		netns_joined = 1;
	}
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		return lfs_error_set(e, errno, "socketpair");
	/* The user namespace belongs to the euid that creates it, and per-user
	 * kernel counters (inotify instances and watches, user namespaces, ...)
	 * of everything inside are also charged to that owner in the initial
	 * namespace.  Owned by host root, one sandbox could use up root's share
	 * for the host and every other sandbox; owned by the sandbox's own host
	 * uid, it can only exhaust its own. */
	if (setresuid((uid_t)-1, (uid_t)o->uid_base, (uid_t)-1) < 0) {
		close(sv[0]);
		close(sv[1]);
		return lfs_error_set(e, errno, "seteuid(%lu) to create the user namespace", o->uid_base);
	}
	pid = (pid_t)syscall(SYS_clone3, &ca, sizeof(ca));
	if (pid == 0) {
		/* A pooled child may wait long; it never outlives its spawner
		 * unset up: the spawner holds the only other end of `sync`, so its
		 * death ends the child's wait with EOF. */
		close(sv[0]);
		if (o->status_fd > 2)
			close(o->status_fd);
		child_main(sv[1]);
	}
	close(sv[1]);
	if (pid > 0)
		p->pid = pid;
	p->sync = sv[0];
	if (setresuid((uid_t)-1, 0, (uid_t)-1) < 0) {
		int saved = errno;

		pre_kill(p);
		return lfs_error_set(e, saved, "seteuid(0) after clone3");
	}
	if (pid < 0) {
		pre_kill(p);
		return lfs_error_set(e, errno, "clone3 with new namespaces");
	}
	if (write_maps(pid, o, e) < 0) {
		pre_kill(p);
		return -1;
	}
	return 0;
}

/* Make the sandbox `o` describes out of the waiting child `p`; `args` are the
 * options as NUL-separated strings (the child parses them too). */
static int finish(const struct opts *o, struct pre *p, const char *args, size_t len,
		  pid_t *out_pid, struct lfs_error *e)
{
	cleanup_close int listen_fd = -1, init_exe = -1, log_fd = -1, cg_a = -1, cg_b = -1;
	cleanup_close int rootmnt = -1, scratch = -1, ll = -1, sc = -1, sysfs = -1;
	int devs[2] = {-1, -1}, lowers[MAX_LOWERS];
	uint32_t setup_flags = 0;
	int rc;
	char reply[600];
	ssize_t n;
	int status;

	init_exe = open(o->init, O_RDONLY | O_CLOEXEC);
	if (init_exe < 0)
		return lfs_error_set(e, errno, "open sbx-init `%s`", o->init);
	log_fd = open(o->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (log_fd < 0)
		return lfs_error_set(e, errno, "open `%s`", o->log);
	if (o->cg_v2 || o->cg_freezer) {
		cg_a = open(o->cg_v2 ? o->cg_v2 : o->cg_freezer, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (cg_a < 0)
			return lfs_error_set(e, errno, "open cgroup `%s`", o->cg_v2 ? o->cg_v2 : o->cg_freezer);
	}
	if (o->cg_memory && !o->cg_v2) {
		cg_b = open(o->cg_memory, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (cg_b < 0)
			return lfs_error_set(e, errno, "open cgroup `%s`", o->cg_memory);
	}
	if (o->landlock) {
		ll = open(o->landlock, O_RDONLY | O_CLOEXEC);
		if (ll < 0)
			return lfs_error_set(e, errno, "open Landlock ruleset `%s`", o->landlock);
	}
	if (o->seccomp) {
		sc = open(o->seccomp, O_RDONLY | O_CLOEXEC);
		if (sc < 0)
			return lfs_error_set(e, errno, "open seccomp program `%s`", o->seccomp);
	}
	if (!o->joined && join_cgroups(o, p->pid, e) < 0)
		return -1;
	listen_fd = open_listen(o->ctl, e);
	if (listen_fd < 0)
		return -1;
	rootmnt = build_rootfs(o, p->pid, &scratch, devs, lowers, &setup_flags, e);
	if (rootmnt < 0)
		return -1;
	if (netns_joined && o->sysfs) {
		sysfs = make_sysfs(e);
		if (sysfs < 0)
			return -1;
	}
	{
		int fds[SETUP_NFDS] = {[SETUP_ROOT] = rootmnt, [SETUP_SCRATCH] = scratch,
				       [SETUP_LISTEN] = listen_fd, [SETUP_INIT] = init_exe,
				       [SETUP_LOG] = log_fd, [SETUP_CG_A] = cg_a, [SETUP_CG_B] = cg_b,
				       [SETUP_LL] = ll, [SETUP_SC] = sc, [SETUP_DEV] = devs[0],
				       [SETUP_SHM] = devs[1],
				       [SETUP_SYSFS] = sysfs};

		/* the lowers go along only for a grader view: sbx-init keeps them */
		rc = send_setup(p->sync, args, len, fds, lowers, o->n_pristine ? o->n_lowers : 0,
				setup_flags);
		close(devs[0]);
		close(devs[1]);
		/* the lowers stay open until this process exits (see build_rootfs) */
		if (rc < 0)
			return lfs_error_set(e, errno, "send the rootfs to the child");
	}
	n = read(p->sync, reply, sizeof(reply) - 1);
	if (n > 0) {
		int code = 0, off = 0;

		reply[n] = 0;
		sscanf(reply, "%d %n", &code, &off);
		return lfs_error_set(e, code, "%s", reply + off);
	}
	if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
		p->pid = 0;
		return lfs_error_set(e, ECHILD, "sandbox child died before exec (status %#x)", status);
	}
	*out_pid = p->pid;
	p->pid = 0; /* sbx-init now: not ours to kill */
	return 0;
}

static int parse_args(int argc, char **argv, struct opts *o, struct lfs_error *e)
{
	int i;

	memset(o, 0, sizeof(*o));
	o->status_fd = -1;
	o->netns_fd = -1;
	o->hostname = "sandbox";
	o->id_count = 65536;
	for (i = 1; i < argc; i++) {
		const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!v)
			return lfs_error_set(e, EINVAL, "option `%s` needs a value", k);
		i++;
		if (!strcmp(k, "--status-fd"))
			o->status_fd = atoi(v);
		else if (!strcmp(k, "--pool"))
			o->pool = atoi(v);
		else if (!strcmp(k, "--netns-fd"))
			o->netns_fd = atoi(v);
		else if (!strcmp(k, "--root"))
			o->root = v;
		else if (!strcmp(k, "--ctl"))
			o->ctl = v;
		else if (!strcmp(k, "--log"))
			o->log = v;
		else if (!strcmp(k, "--init"))
			o->init = v;
		else if (!strcmp(k, "--hostname"))
			o->hostname = v;
		else if (!strcmp(k, "--uid-base"))
			o->uid_base = strtoul(v, NULL, 10);
		else if (!strcmp(k, "--id-count"))
			o->id_count = strtoul(v, NULL, 10);
		else if (!strcmp(k, "--disk-bytes"))
			o->disk_bytes = strtoull(v, NULL, 10);
		else if (!strcmp(k, "--lower")) {
			if (o->n_lowers == MAX_LOWERS)
				return lfs_error_set(e, EINVAL, "more than %d lowers", MAX_LOWERS);
			o->lowers[o->n_lowers++] = v;
		} else if (!strcmp(k, "--join")) {
			if (o->n_join == MAX_JOIN)
				return lfs_error_set(e, EINVAL, "more than %d cgroups to join", MAX_JOIN);
			o->join[o->n_join++] = v;
		} else if (!strcmp(k, "--cg-freezer"))
			o->cg_freezer = v;
		else if (!strcmp(k, "--cg-memory"))
			o->cg_memory = v;
		else if (!strcmp(k, "--cg-v2"))
			o->cg_v2 = v;
		else if (!strcmp(k, "--upper-dir"))
			o->upper_dir = v;
		else if (!strcmp(k, "--landlock"))
			o->landlock = v;
		else if (!strcmp(k, "--seccomp"))
			o->seccomp = v;
		else if (!strcmp(k, "--apparmor"))
			o->apparmor = v;
		else if (!strcmp(k, "--spare-idle-ms")) {
			if (!v[0] || strspn(v, "0123456789") != strlen(v) || strlen(v) > 12)
				return lfs_error_set(e, EINVAL, "--spare-idle-ms `%s` is not a number of ms", v);
			o->spare_idle_ms = v;
		}
		else if (!strcmp(k, "--caps")) {
			char *end;

			o->caps = strtoull(v, &end, 0);
			if (*end)
				return lfs_error_set(e, EINVAL, "--caps `%s` is not a number", v);
			o->has_caps = 1;
		} else if (!strcmp(k, "--pristine")) {
			if (o->n_pristine == MAX_PROTECT)
				return lfs_error_set(e, EINVAL, "more than %d grader-view paths", MAX_PROTECT);
			if (v[0] != '/' || strchr(v, ':'))
				return lfs_error_set(e, EINVAL, "grader-view path `%s`: absolute, without ':'", v);
			o->pristine[o->n_pristine++] = v;
		} else if (!strcmp(k, "--sysfs")) {
			o->sysfs = atoi(v) != 0;
		} else if (!strcmp(k, "--protect")) {
			if (o->n_protect == MAX_PROTECT)
				return lfs_error_set(e, EINVAL, "more than %d protected paths", MAX_PROTECT);
			if (v[0] != '/')
				return lfs_error_set(e, EINVAL, "protected path `%s` is not absolute", v);
			o->protect[o->n_protect++] = v;
		}
		else
			return lfs_error_set(e, EINVAL, "unknown option `%s`", k);
	}
	if (!o->uid_base || !o->id_count)
		return lfs_error_set(e, EINVAL, "--uid-base must be a nonzero host uid (sandbox root is not host root)");
	if (o->pool)
		return 0;
	if (!o->root || !o->ctl || !o->log || !o->init || !o->n_lowers)
		return lfs_error_set(e, EINVAL, "--root, --ctl, --log, --init and --lower are required");
	if (!o->disk_bytes)
		return lfs_error_set(e, EINVAL, "--disk-bytes must be positive");
	if (strlen(o->hostname) > 64)
		return lfs_error_set(e, EINVAL, "hostname `%s` is longer than 64 bytes", o->hostname);
	return 0;
}

/* Read `fd` to EOF into buf (at most cap - 1 bytes); returns the length or -1. */
static ssize_t read_all(int fd, char *buf, size_t cap, struct lfs_error *e)
{
	size_t len = 0;

	for (;;) {
		ssize_t n = read(fd, buf + len, cap - 1 - len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return lfs_error_set(e, errno, "read the options from stdin");
		if (n == 0)
			return (ssize_t)len;
		len += (size_t)n;
		if (len == cap - 1)
			return lfs_error_set(e, E2BIG, "options longer than %zu bytes", cap - 2);
	}
}

/* Options after argv[0] as NUL-separated strings, for the child. */
static ssize_t join_args(int argc, char **argv, char *buf, size_t cap, struct lfs_error *e)
{
	size_t len = 0;
	int i;

	for (i = 1; i < argc; i++) {
		size_t n = strlen(argv[i]) + 1;

		if (len + n >= cap)
			return lfs_error_set(e, E2BIG, "options longer than %zu bytes", cap - 1);
		memcpy(buf + len, argv[i], n);
		len += n;
	}
	return (ssize_t)len;
}

int main(int argc, char **argv)
{
	static char args[MAX_SETUP];
	static char *pargv[MAX_ARGS + 1];
	struct lfs_error e = {0};
	struct opts o;
	struct pre p = {.pid = 0, .sync = -1};
	char line[700];
	pid_t pid = 0;
	ssize_t len = -1;
	int n, rc;

	rc = parse_args(argc, argv, &o, &e);
	if (o.status_fd < 0)
		o.status_fd = 2;
	fcntl(o.status_fd, F_SETFD, FD_CLOEXEC);
	if (rc == 0 && o.pool) {
		rc = prefork(&o, &p, &e);
		/* Ahead of demand, the cgroup move and its RCU grace period too */
		if (rc == 0)
			rc = join_cgroups(&o, p.pid, &e);
		if (rc == 0) {
			unsigned long base = o.uid_base, count = o.id_count;
			int status_fd = o.status_fd, pargc;

			(void)!write(o.status_fd, "ready\n", 6);
			len = read_all(0, args, sizeof(args), &e);
			if (len == 0) { /* the pool was closed */
				pre_kill(&p);
				return 0;
			}
			rc = len < 0 ? -1 : 0;
			if (rc == 0) {
				pargc = split_args(args, (size_t)len, pargv);
				rc = pargc < 0 ? lfs_error_set(&e, E2BIG, "too many options")
					       : parse_args(pargc, pargv, &o, &e);
			}
			o.status_fd = status_fd;
			if (rc == 0 && (o.pool || o.uid_base != base || o.id_count != count))
				rc = lfs_error_set(&e, EINVAL, "options for uid base %lu, count %lu given to the "
					  "spawner made for %lu, %lu", o.uid_base, o.id_count, base, count);
		}
	} else if (rc == 0) {
		len = join_args(argc, argv, args, sizeof(args), &e);
		/* the child is then born in the sandbox's cgroups: nothing to move */
		rc = len < 0 ? -1 : join_cgroups(&o, 0, &e);
		o.joined = 1;
		if (rc == 0)
			rc = prefork(&o, &p, &e);
	}
	if (rc == 0)
		rc = finish(&o, &p, args, (size_t)len, &pid, &e);
	pre_kill(&p);
	if (rc == 0)
		n = snprintf(line, sizeof(line), "ok %d\n", pid);
	else
		n = snprintf(line, sizeof(line), "error %d %s\n", e.code, e.msg);
	(void)!write(o.status_fd, line, (size_t)(n > 0 ? n : 0));
	return rc == 0 ? 0 : 1;
}
