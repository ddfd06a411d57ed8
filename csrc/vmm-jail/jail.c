/* edged-vmm-jail: start a microVM's VMM (QEMU) jailed on the host.
 *
 *   edged-vmm-jail [--join FILE]... [--uid UID --gid GID [--group GID]...]
 *                  [--netns] [--root DIR [--dev NODE]...] -- PROGRAM [ARG]...
 *
 * In order, as root, single-threaded:
 *   --join FILE   write "0" to each cgroup file (a v1 `tasks` or a v2
 *                 `cgroup.procs`): the VMM's cgroups, joined before it exists,
 *                 so that every page and CPU-second it uses from its first
 *                 instruction is charged there (a single-threaded process moving
 *                 itself through v1's `tasks` skips cgroup_threadgroup_rwsem);
 *   --netns       a new network namespace, and a new IPC namespace: a VMM of a
 *                 guest without a network has no socket to reach anything with
 *                 (loopback stays down);
 *   --root DIR    a mount namespace whose root is a fresh tmpfs mounted on DIR
 *                 (an empty directory) holding read-only binds of /usr (the
 *                 program, its libraries and firmware: Debian's / is merged-usr,
 *                 /bin, /lib... are symlinks into it, recreated here),
 *                 /etc/ld.so.cache, a /proc of its own processes only
 *                 (hidepid=invisible,subset=pid: /proc/self/fd is how QEMU
 *                 reaches the files it was handed), and a /dev with null, zero,
 *                 urandom and each --dev NODE (/dev/kvm); pivot_root into it.  The
 *                 VMM then sees no file of the host's but those: its disks,
 *                 sockets and logs are fds it inherited;
 *   --uid/--gid   drop to that user and group (and only the --group
 *                 supplementary groups), with no_new_privs.
 * then execve(PROGRAM) (a path as the jail sees it).  A failure exits 127
 * with a message on stderr before PROGRAM runs.
 *
 * Threat model: the guest may take over its VMM.  Then it holds an
 * unprivileged uid of its own (edged's uid-slot grid: no other process of the
 * host runs as it), QEMU's own seccomp filter (-sandbox on: no exec, no
 * set*id), no network, no host files, and its cgroup's limits.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lfs_cleanup.h"

#define MAX_LIST 16

static void __attribute__((noreturn, format(printf, 1, 2))) die(const char *fmt, ...)
{
	int code = errno;
	va_list ap;

	fputs("edged-vmm-jail: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, ": %s\n", strerror(code));
	_exit(127);
}

static void write_file(const char *path, const char *val)
{
	cleanup_close int fd = open(path, O_WRONLY | O_CLOEXEC);

	if (fd < 0)
		die("open `%s`", path);
	if (write(fd, val, strlen(val)) < 0)
		die("write `%s` to `%s`", val, path);
}

static long parse_id(const char *s, const char *what)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || v < 0 || v > UINT_MAX - 1) {
		errno = EINVAL;
		die("%s `%s`", what, s);
	}
	return v;
}

static void mount_or_die(const char *src, const char *dst, const char *type,
			 unsigned long flags, const char *data)
{
	if (mount(src, dst, type, flags, data) < 0)
		die("mount %s `%s` on `%s`", type ? type : "bind", src ? src : "", dst);
}

/* A bind of the host's `src` at `dst` (made: a directory or an empty file,
 * like its source), read-only if `ro`. */
static void bind(const char *src, const char *dst, int ro)
{
	struct stat st;

	if (stat(src, &st) < 0)
		die("stat `%s`", src);
	if (S_ISDIR(st.st_mode)) {
		if (mkdir(dst, 0755) < 0 && errno != EEXIST)
			die("mkdir `%s`", dst);
	} else {
		cleanup_close int fd = open(dst, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);

		if (fd < 0)
			die("create `%s`", dst);
	}
	mount_or_die(src, dst, NULL, MS_BIND | MS_REC, NULL);
	mount_or_die(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | (ro ? MS_RDONLY : 0),
		     NULL);
}

/* The jail's filesystem (see the header) on `root`, then pivot_root. */
static void make_root(const char *root, char *const *devs, int ndevs)
{
	static const char *const links[][2] = {
		{"usr/bin", "bin"}, {"usr/sbin", "sbin"}, {"usr/lib", "lib"},
		{"usr/lib64", "lib64"},
	};
	static const char *const nodes[] = {"/dev/null", "/dev/zero", "/dev/urandom"};
	char path[PATH_MAX];
	size_t i;
	int k;

	if (unshare(CLONE_NEWNS) < 0)
		die("unshare(CLONE_NEWNS)");
	/* nothing we mount propagates back to the host */
	mount_or_die(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
	mount_or_die("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k");
	if (chdir(root) < 0)
		die("chdir `%s`", root);
	for (i = 0; i < sizeof(links) / sizeof(links[0]); i++)
		if (symlink(links[i][0], links[i][1]) < 0)
			die("symlink `%s`", links[i][1]);
	bind("/usr", "usr", 1);
	if (mkdir("etc", 0755) < 0)
		die("mkdir `etc`");
	if (access("/etc/ld.so.cache", F_OK) == 0)
		bind("/etc/ld.so.cache", "etc/ld.so.cache", 1);
	if (mkdir("proc", 0555) < 0)
		die("mkdir `proc`");
	mount_or_die("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
		     "hidepid=invisible,subset=pid");
	if (mkdir("dev", 0755) < 0)
		die("mkdir `dev`");
	mount_or_die("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=16k");
	for (i = 0; i < sizeof(nodes) / sizeof(nodes[0]); i++)
		bind(nodes[i], nodes[i] + 1, 0); /* a device node's own mode decides */
	for (k = 0; k < ndevs; k++) {
		if (strncmp(devs[k], "/dev/", 5) || strchr(devs[k] + 5, '/')) {
			errno = EINVAL;
			die("--dev `%s`: a node directly in /dev", devs[k]);
		}
		snprintf(path, sizeof(path), "dev/%s", devs[k] + 5);
		bind(devs[k], path, 0);
	}
	if (mount(NULL, ".", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
		  NULL) < 0)
		die("remount the jail's root read-only");
	/* pivot_root(".", "."): the old root stacks under the new one and is
	 * detached at once (pivot_root(2), NOTES) */
	if (syscall(SYS_pivot_root, ".", ".") < 0)
		die("pivot_root into `%s`", root);
	if (umount2(".", MNT_DETACH) < 0)
		die("detach the host's root");
	if (chdir("/") < 0)
		die("chdir `/`");
}

int main(int argc, char **argv)
{
	char *joins[MAX_LIST], *devs[MAX_LIST];
	gid_t groups[MAX_LIST];
	int njoins = 0, ndevs = 0, ngroups = 0, netns = 0, i;
	long uid = -1, gid = -1;
	const char *root = NULL;

	for (i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--")) {
			i++;
			break;
		}
		if (!strcmp(a, "--netns")) {
			netns = 1;
			continue;
		}
		if (!v) {
			errno = EINVAL;
			die("%s: wants a value", a);
		}
		i++;
		if (!strcmp(a, "--join") && njoins < MAX_LIST)
			joins[njoins++] = argv[i];
		else if (!strcmp(a, "--dev") && ndevs < MAX_LIST)
			devs[ndevs++] = argv[i];
		else if (!strcmp(a, "--group") && ngroups < MAX_LIST)
			groups[ngroups++] = (gid_t)parse_id(v, "--group");
		else if (!strcmp(a, "--uid"))
			uid = parse_id(v, "--uid");
		else if (!strcmp(a, "--gid"))
			gid = parse_id(v, "--gid");
		else if (!strcmp(a, "--root"))
			root = v;
		else {
			errno = EINVAL;
			die("unknown or repeated too often: %s", a);
		}
	}
	if (i >= argc || (uid < 0) != (gid < 0)) {
		errno = EINVAL;
		die("usage: edged-vmm-jail [--join FILE]... [--uid UID --gid GID [--group GID]...] "
		    "[--netns] [--root DIR [--dev NODE]...] -- PROGRAM [ARG]...");
	}
	for (int k = 0; k < njoins; k++)
		write_file(joins[k], "0");
	if (netns && unshare(CLONE_NEWNET | CLONE_NEWIPC) < 0)
		die("unshare(CLONE_NEWNET | CLONE_NEWIPC)");
	if (root)
		make_root(root, devs, ndevs);
	if (uid >= 0) {
		if (setgroups((size_t)ngroups, groups) < 0)
			die("setgroups");
		if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0)
			die("setresgid %ld", gid);
		if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0)
			die("setresuid %ld", uid);
	}
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die("no_new_privs");
	execv(argv[i], argv + i);
	die("execv `%s`", argv[i]);
}
