/* attack: the red-team workload.  Built static by tests/security/conftest.py and
 * run inside a real sandbox.  Each attempt prints one line "LABEL RESULT", where
 * RESULT is "SUCCEEDED" when the attack worked (a test failure) or the errno
 * name it failed with.  Commands:
 *
 *   protect PATH        change a protected file every way a process can
 *   ioctl SRC DST       extent-moving ioctls from SRC (protected) into DST (ours),
 *                       each also with the high 32 bits of the request set
 *   ctl                 reach sbx-init (PID 1): /proc/1/{mem,fd}, ptrace,
 *                       process_vm_writev, signals, inherited fds, abstract sockets
 *   ports               reach a microVM guest's control port, consoles and disks
 *                       (by name, and by nodes made from sysfs's numbers) and
 *                       write a forged frame into whatever opens
 *   host                host-level syscalls (mount, modules, kexec, keys, bpf, ...)
 *   userns DIR          make a user+mount namespace, then remount DIR read-write,
 *                       unmount it and write into it
 *   mem                 allocate and touch memory until killed
 *   fds                 open files until refused
 *   inotify [hold]      inotify instances until refused (then keep them)
 *   forkbomb            a fork bomb that outlives its exec (see do_forkbomb)
 *   forkchurn           a fork bomb that keeps the pids limit nearly full
 *   denyflood N         call a denied syscall (umount2) N times; prints how many
 *                       failed with EPERM
 *
 * It refuses to run anywhere but inside a sandbox (inside_sandbox): as root on
 * a host, forkbomb, mem or fds would take the machine down.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *label, long rc)
{
	printf("%s %s\n", label, rc >= 0 ? "SUCCEEDED" : strerrorname_np(errno));
	fflush(stdout);
}

static int do_protect(const char *p)
{
	int fd;
	char dir[4096];
	char *slash;

	fd = open(p, O_WRONLY);
	report("open_write", fd);
	if (fd >= 0)
		close(fd);
	fd = open(p, O_WRONLY | O_TRUNC);
	report("open_trunc", fd);
	report("truncate", truncate(p, 0));
	fd = open("/tmp/evil", O_WRONLY | O_CREAT | O_TRUNC, 0755);
	if (fd >= 0) {
		(void)!write(fd, "#!/bin/sh\necho pwned\n", 21);
		close(fd);
	}
	report("rename_over", rename("/tmp/evil", p));
	report("unlink", unlink(p));
	report("chmod", chmod(p, 04777));
	report("bind_over", mount("/tmp/evil", p, NULL, MS_BIND, NULL));
	snprintf(dir, sizeof(dir), "%s", p);
	slash = strrchr(dir, '/');
	if (slash && slash != dir)
		*slash = 0;
	report("remount_rw", mount(NULL, dir, NULL, MS_REMOUNT | MS_BIND, NULL));
	report("umount", umount2(dir, MNT_DETACH));
	report("unshare_userns", unshare(CLONE_NEWUSER | CLONE_NEWNS));
	return 0;
}

struct swapext { /* struct xfs_swapext (xfs_fs.h) */
	int64_t sx_version, sx_fdtarget, sx_fdtmp;
	int64_t sx_offset, sx_length;
	int64_t sx_pad[16];
	char sx_stat[144]; /* struct xfs_bstat */
};

static int do_ioctl(const char *src, const char *dst)
{
	int s = open(src, O_RDONLY), d = open(dst, O_RDWR);
	struct file_clone_range fcr = {.src_fd = s, .src_length = 0};
	struct {
		struct file_dedupe_range r;
		struct file_dedupe_range_info i;
	} dd;
	struct swapext sx;
	struct {
		const char *label;
		unsigned long cmd;
		void *arg;
		int on_src;
	} reqs[] = {
		{"FICLONE", FICLONE, (void *)(long)s, 0},
		{"FICLONERANGE", FICLONERANGE, &fcr, 0},
		{"FIDEDUPERANGE", FIDEDUPERANGE, &dd, 1},
		{"XFS_IOC_SWAPEXT", 0xc0c0586dUL, &sx, 1},
	};
	char label[64];

	if (s < 0 || d < 0) {
		perror("open");
		return 1;
	}
	memset(&dd, 0, sizeof(dd));
	dd.r.src_length = 4096;
	dd.r.dest_count = 1;
	dd.i.dest_fd = d;
	memset(&sx, 0, sizeof(sx));
	sx.sx_fdtarget = s;
	sx.sx_fdtmp = d;
	sx.sx_length = 4096;
	for (unsigned i = 0; i < sizeof(reqs) / sizeof(reqs[0]); i++) {
		int fd = reqs[i].on_src ? s : d;

		report(reqs[i].label, syscall(SYS_ioctl, fd, reqs[i].cmd, reqs[i].arg));
		snprintf(label, sizeof(label), "%s_highbits", reqs[i].label);
		report(label, syscall(SYS_ioctl, fd, reqs[i].cmd | 0xdead00000000UL, reqs[i].arg));
	}
	return 0;
}

static int do_ctl(void)
{
	char buf[64] = "garbage", path[64];
	struct iovec local = {.iov_base = buf, .iov_len = 8}, remote = {.iov_base = (void *)0x400000, .iov_len = 8};
	int fd, n;
	DIR *d;
	FILE *f;
	char line[512];

	fd = open("/proc/1/mem", O_RDWR);
	report("proc1_mem", fd);
	/* listing /proc/1/fd shows fd numbers only (the dir belongs to sandbox
	 * root); opening any of them needs ptrace rights over PID 1 */
	d = opendir("/proc/1/fd");
	printf("info_proc1_fd_list %s\n", d ? "listed" : strerrorname_np(errno));
	if (d)
		closedir(d);
	for (n = 0; n < 16; n++) {
		snprintf(path, sizeof(path), "/proc/1/fd/%d", n);
		fd = open(path, O_RDWR);
		if (fd >= 0 || errno != ENOENT) {
			char label[32];

			snprintf(label, sizeof(label), "proc1_fd_%d", n);
			report(label, fd);
		}
	}
	report("ptrace_attach", ptrace(PTRACE_ATTACH, 1, 0, 0));
	report("ptrace_seize", ptrace(PTRACE_SEIZE, 1, 0, 0));
	report("process_vm_writev", process_vm_writev(1, &local, 1, &remote, 1, 0));
	report("kill_TERM", kill(1, SIGTERM));
	report("kill_KILL", kill(1, SIGKILL));
	report("kill_STOP", kill(1, SIGSTOP));
	report("tgkill", syscall(SYS_tgkill, 1, 1, SIGKILL));
	report("pidfd_open", syscall(SYS_pidfd_open, 1, 0));
	/* a /proc/<pid> directory fd is a pidfd too, and open(2) is not filtered: only
	 * Landlock's signal scoping stands here */
	fd = open("/proc/1", O_RDONLY | O_DIRECTORY);
	report("procfd_signal", fd < 0 ? -1 : syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0));
	if (fd >= 0)
		close(fd);
	for (n = 3; n < 1024; n++)
		if (fcntl(n, F_GETFD) >= 0)
			printf("inherited_fd_%d SUCCEEDED\n", n);
	/* every unix socket the sandbox can see: connect and send garbage */
	f = fopen("/proc/net/unix", "r");
	while (f && fgets(line, sizeof(line), f)) {
		char *p = strrchr(line, ' ');
		struct sockaddr_un sa = {.sun_family = AF_UNIX};
		socklen_t len;
		int s;

		if (!p || (p[1] != '@' && p[1] != '/'))
			continue;
		p[strcspn(p, "\n")] = 0;
		p++;
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", p);
		len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(p));
		if (p[0] == '@')
			sa.sun_path[0] = 0;
		s = socket(AF_UNIX, SOCK_STREAM, 0);
		if (connect(s, (struct sockaddr *)&sa, len) == 0) {
			static char junk[1 << 16];

			memset(junk, 0xff, sizeof(junk));
			printf("unix_connect_%s SUCCEEDED\n", p);
			(void)!write(s, junk, sizeof(junk));
		}
		close(s);
	}
	if (f)
		fclose(f);
	fflush(stdout);
	return 0;
}

/* Open the device node of "maj:min" (a sysfs dev file's text) made at path;
 * on success write a forged frame into it (an exec request's shape). */
static void forge(const char *label, const char *path, const char *majmin)
{
	static const char frame[] = "\x20\x00\x00\x00\x01\x00EXEC /bin/sh -c reboot";
	unsigned maj, min;
	int fd;

	if (sscanf(majmin, "%u:%u", &maj, &min) != 2)
		return;
	unlink(path);
	if (mknod(path, S_IFCHR | 0600, makedev(maj, min)) < 0 && errno != EEXIST) {
		char l[128];

		snprintf(l, sizeof(l), "mknod_%.100s", label);
		report(l, -1);
		return;
	}
	fd = open(path, O_RDWR | O_NONBLOCK);
	report(label, fd < 0 ? -1 : write(fd, frame, sizeof(frame)));
	if (fd >= 0)
		close(fd);
	unlink(path);
}

/* Reach the guest's control port (sbx-init's virtio-serial channel), the
 * consoles and the disks: by their /dev names, and by nodes made from what
 * sysfs says their numbers are.  Each open that works writes a forged frame. */
static int do_ports(void)
{
	static const char *const classes[] = {"/sys/class/virtio-ports", "/sys/class/tty",
					      "/sys/block"};
	static const char *const names[] = {"/dev/vport0p1", "/dev/vport1p1", "/dev/vport2p1",
					    "/dev/hvc0", "/dev/ttyS0", "/dev/console",
					    "/dev/vda", "/dev/vdb", "/dev/mem", "/dev/port"};
	char path[512], majmin[64], label[128];
	size_t i;

	for (i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		int fd = open(names[i], O_RDWR | O_NONBLOCK);

		snprintf(label, sizeof(label), "open_%s", names[i] + 5);
		report(label, fd < 0 ? -1 : write(fd, "forged", 6));
		if (fd >= 0)
			close(fd);
	}
	for (i = 0; i < sizeof(classes) / sizeof(classes[0]); i++) {
		DIR *d = opendir(classes[i]);
		struct dirent *de;

		printf("info_%s %s\n", strrchr(classes[i], '/') + 1,
		       d ? "listed" : strerrorname_np(errno));
		while (d && (de = readdir(d))) {
			FILE *f;

			if (de->d_name[0] == '.' || (i == 1 && strncmp(de->d_name, "hvc", 3) &&
						     strncmp(de->d_name, "ttyS", 4) &&
						     strcmp(de->d_name, "console")))
				continue;
			snprintf(path, sizeof(path), "%s/%s/dev", classes[i], de->d_name);
			f = fopen(path, "r");
			if (!f)
				continue;
			if (fgets(majmin, sizeof(majmin), f)) {
				snprintf(label, sizeof(label), "node_%.100s", de->d_name);
				snprintf(path, sizeof(path), "/tmp/.forge-%.100s", de->d_name);
				forge(label, path, majmin);
			}
			fclose(f);
		}
		if (d)
			closedir(d);
	}
	fflush(stdout);
	return 0;
}

static int do_host(void)
{
	struct perf_event_attr pe;
	char zero[128] = {0};
	int fd;

	report("mount_tmpfs", mount("tmpfs", "/tmp", "tmpfs", 0, NULL));
	fd = open("/proc/sysrq-trigger", O_WRONLY);
	report("sysrq_open", fd);
	if (fd >= 0)
		report("sysrq_write", write(fd, "h", 1));
	report("init_module", syscall(SYS_init_module, zero, sizeof(zero), ""));
	fd = open("/bin/busybox", O_RDONLY);
	report("finit_module", syscall(SYS_finit_module, fd, "", 0));
	report("kexec_load", syscall(SYS_kexec_load, 0, 0, NULL, 0));
	report("kexec_file_load", syscall(SYS_kexec_file_load, fd, -1, 0, "", 2));
	report("keyctl", syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3, 0));
	report("add_key", syscall(SYS_add_key, "user", "k", "v", 1, -3));
	report("bpf", syscall(SYS_bpf, 0 /* MAP_CREATE */, zero, 72));
	memset(&pe, 0, sizeof(pe));
	pe.size = sizeof(pe);
	pe.type = PERF_TYPE_SOFTWARE;
	pe.config = PERF_COUNT_SW_CPU_CLOCK;
	report("perf_event_open", syscall(SYS_perf_event_open, &pe, 0, -1, -1, 0));
	report("userfaultfd", syscall(SYS_userfaultfd, 0));
	report("raw_packet", socket(AF_PACKET, SOCK_RAW, 0));
	report("raw_inet", socket(AF_INET, SOCK_RAW, 1));
	report("raw_inet_cloexec", socket(AF_INET, SOCK_RAW | SOCK_CLOEXEC, 1));
	report("sethostname", sethostname("pwned", 5));
	report("setns", syscall(SYS_setns, 0, 0));
	report("open_by_handle_at", syscall(SYS_open_by_handle_at, AT_FDCWD, zero, 0));
	report("swapon", syscall(SYS_swapon, "/tmp", 0));
	return 0;
}

static int do_userns(const char *dir)
{
	char p[4096];
	int fd;

	if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) {
		report("unshare", -1);
		return 1;
	}
	report("unshare", 0);
	report("ns_remount_rw", mount(NULL, dir, NULL, MS_REMOUNT | MS_BIND, NULL));
	report("ns_umount", umount2(dir, MNT_DETACH));
	snprintf(p, sizeof(p), "%s/x", dir);
	fd = open(p, O_WRONLY | O_CREAT, 0644);
	report("ns_write", fd);
	return 0;
}

static int do_mem(void)
{
	for (;;) {
		char *p = malloc(1 << 20);

		if (!p)
			return 3;
		memset(p, 1, 1 << 20);
	}
}

static int do_fds(void)
{
	long n = 0;

	while (open("/dev/null", O_RDONLY) >= 0)
		n++;
	printf("fds %ld %s\n", n, strerrorname_np(errno));
	return 0;
}

static int do_inotify(int hold)
{
	long n = 0;

	while (inotify_init1(IN_CLOEXEC) >= 0)
		n++;
	printf("inotify_instances %ld %s\n", n, strerrorname_np(errno));
	fflush(stdout);
	if (hold)
		pause();
	return 0;
}

/* Leave the exec: a new session, stdio on /dev/null; 0 in the child, 1 in the
 * parent (which should return at once). */
static int daemonize(void)
{
	int fd;

	if (fork() != 0)
		return 1;
	setsid();
	fd = open("/dev/null", O_RDWR);
	dup2(fd, 0);
	dup2(fd, 1);
	dup2(fd, 2);
	return 0;
}

/* A fork bomb that outlives its exec and never lets go: the first child leaves
 * the exec's session, then every process forks forever, retrying a refused fork
 * (at the pids limit) after 1 ms instead of exiting, so a freed pid is taken
 * again at once. */
static int do_forkbomb(void)
{
	if (daemonize())
		return 0;
	for (;;)
		if (fork() < 0)
			usleep(1000);
}

/* A fork bomb that churns: its children live a few ms, so the pids limit is
 * full nearly always but a pid frees now and then (what a shell's fork bomb
 * does as its processes fail and exit); the failed forks spin the CPU. */
static int do_forkchurn(void)
{
	int i;

	if (daemonize())
		return 0;
	for (i = 0; i < 3; i++)
		if (fork() == 0)
			break;
	for (;;) {
		pid_t pid = fork();

		if (pid == 0) {
			usleep(5000);
			_exit(0);
		}
		while (waitpid(-1, NULL, WNOHANG) > 0)
			;
	}
}

/* A flood of denied syscalls: each one is a seccomp user notification. */
static int do_denyflood(const char *count)
{
	long n = strtol(count, NULL, 10), eperm = 0;

	for (long i = 0; i < n; i++)
		if (umount2("/", MNT_DETACH) < 0 && errno == EPERM)
			eperm++;
	printf("denied %ld\n", eperm);
	return 0;
}

/* Whether this runs inside a sandbox: PID 1 of its pid namespace is sbx-init,
 * and that namespace is not the host's (the initial pid namespace has the fixed
 * inode PROC_PID_INIT_INO, 0xEFFFFFFC: include/linux/proc_ns.h). */
static int in_guest(void)
{
	char line[4096] = "";
	int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, line, sizeof(line) - 1) : -1;

	if (fd >= 0)
		close(fd);
	if (n <= 0)
		return 0;
	line[strcspn(line, "\n")] = 0;
	n = (ssize_t)strlen(line);
	return strstr(line, "rdinit=/init ") && n >= 6 && !strcmp(line + n - 6, " -- -g");
}

static int inside_sandbox(void)
{
	char comm[32] = "";
	struct stat st;
	int fd = open("/proc/1/comm", O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, comm, sizeof(comm) - 1) : -1;

	if (fd >= 0)
		close(fd);
	if (n <= 0 || strcmp(comm, "sbx-init\n") != 0)
		return 0;
	if (stat("/proc/self/ns/pid", &st) == 0 && st.st_ino != 0xEFFFFFFCu)
		return 1;
	/* a microVM's guest: sbx-init is PID 1 of the guest kernel itself, which
	 * edged booted with sbx-init's guest mode on its command line */
	return in_guest();
}

int main(int argc, char **argv)
{
	if (!inside_sandbox()) {
		fprintf(stderr, "attack: refusing to run outside a sandbox (PID 1 is not "
				"sbx-init in a pid namespace of its own)\n");
		return 3;
	}
	if (argc == 3 && !strcmp(argv[1], "protect"))
		return do_protect(argv[2]);
	if (argc == 4 && !strcmp(argv[1], "ioctl"))
		return do_ioctl(argv[2], argv[3]);
	if (argc == 2 && !strcmp(argv[1], "ctl"))
		return do_ctl();
	if (argc == 2 && !strcmp(argv[1], "host"))
		return do_host();
	if (argc == 2 && !strcmp(argv[1], "ports"))
		return do_ports();
	if (argc == 3 && !strcmp(argv[1], "userns"))
		return do_userns(argv[2]);
	if (argc == 2 && !strcmp(argv[1], "mem"))
		return do_mem();
	if (argc == 2 && !strcmp(argv[1], "fds"))
		return do_fds();
	if (argc >= 2 && !strcmp(argv[1], "inotify"))
		return do_inotify(argc == 3 && !strcmp(argv[2], "hold"));
	if (argc == 2 && !strcmp(argv[1], "forkbomb"))
		return do_forkbomb();
	if (argc == 2 && !strcmp(argv[1], "forkchurn"))
		return do_forkchurn();
	if (argc == 3 && !strcmp(argv[1], "denyflood"))
		return do_denyflood(argv[2]);
	fprintf(stderr, "usage: attack protect PATH | ioctl SRC DST | ctl | ports | host | mem | fds | inotify"
			" | forkbomb | forkchurn | denyflood N\n");
	return 2;
}
