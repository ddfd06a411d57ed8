/* sbx-init's guest mode: the boot of a microVM guest (see guest.h for the two
 * steps and the threat model).  Everything here runs once, before sbx-init's
 * event loop, as PID 1 of the guest with every capability; failures are fatal
 * (reported on the control port when it is open, then the guest powers off,
 * which the host sees as the VMM exiting). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "guest.h"
#include "sbx-init.h"

#ifndef SYS_finit_module
#define SYS_finit_module 313
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 1u
#endif

#define RUN "/run/sbx"
#define WAIT_PORT_MS 10000
#define WAIT_DISKS_MS 10000

static int port = -1;
static char steps[256]; /* "name=us " per step of step 2: the boot-done message */
static size_t steps_len;
static uint64_t step_t;
static uint64_t boot_t0;
static char port_dev[64]; /* /dev/vportNpM of SBX_GUEST_PORT */
/* The initramfs's /dev (devtmpfs), kept for reopening the port once the
 * sandbox's root, whose /dev has no such node, is ours (a host that left and
 * came back: a restarted daemon).  O_PATH, close-on-exec, held by PID 1 only. */
static int dev_dir = -1;
/* What step 1 prepared in the template, so that a clone does not do it again
 * (under TCG every guest instruction a clone runs for the first time is
 * translated afresh by its own QEMU: what a clone does not run costs nothing).
 * The disks (found by serial and flushed), the workload's cgroup, and the
 * sandbox's /proc, /sys and /dev, mounted outside the root and moved in. */
static int late_modules;  /* modules.late is not empty: step 2 binds and finds the disks */
static int n_disk_lowers = -1; /* layer disks found in step 1 (-1: step 2 finds them) */
static char disk_lowers[SBX_GUEST_MAX_LAYERS][32], disk_upper[32];
static int cg_fd = -1;

static uint64_t ns_of(clockid_t c)
{
	struct timespec ts;

	clock_gettime(c, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void write_file(const char *path, const char *val);

/* Record the time since the last step under `name` (for the host's figures). */
static void step(const char *name)
{
	uint64_t t = ns_of(CLOCK_MONOTONIC);
	int n = snprintf(steps + steps_len, sizeof(steps) - steps_len, "%s=%llu ", name,
			 (unsigned long long)((t - step_t) / 1000));

	if (n > 0 && (size_t)n < sizeof(steps) - steps_len)
		steps_len += (size_t)n;
	step_t = t;
}

static void sleep_ms(long ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};

	nanosleep(&ts, NULL);
}

static int write_all(int fd, const void *p, size_t n)
{
	const char *c = p;

	while (n) {
		ssize_t w = write(fd, c, n);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

static int read_all(int fd, void *p, size_t n)
{
	char *c = p;

	while (n) {
		ssize_t r = read(fd, c, n);

		if (r < 0 && (errno == EINTR || errno == EAGAIN)) {
			struct pollfd pfd = {.fd = fd, .events = POLLIN};

			poll(&pfd, 1, 100);
			continue;
		}
		if (r == 0) { /* no host connected yet (or it went away): wait for one */
			sleep_ms(2);
			continue;
		}
		if (r < 0)
			return -1;
		c += r;
		n -= (size_t)r;
	}
	return 0;
}

static void send_done(int code, const char *msg, uint64_t t0)
{
	struct sbx_boot_done d = {.magic = "SBXBOOTD", .code = code};
	size_t n = msg ? strlen(msg) : 0;

	if (port < 0)
		return;
	if (n > 512)
		n = 512;
	d.msg_len = (uint32_t)n;
	d.boot_ns = ns_of(CLOCK_MONOTONIC) - t0;
	if (write_all(port, &d, sizeof(d)) == 0 && n)
		write_all(port, msg, n);
}


/* Fatal: say why (console and port), then power off. */
static void __attribute__((noreturn, format(printf, 2, 3))) die(int code, const char *fmt, ...)
{
	char msg[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	dprintf(2, "sbx-init (guest): %s: %s\n", msg, strerror(code));
	{
		char full[600];

		snprintf(full, sizeof(full), "%s: %s", msg, strerror(code));
		send_done(code ? code : EIO, full, boot_t0);
	}
	sync();
	reboot(RB_POWER_OFF);
	_exit(1);
}

static void must_mount(const char *src, const char *dst, const char *type, unsigned long fl,
		       const char *opts)
{
	if (mkdir(dst, 0755) < 0 && errno != EEXIST)
		die(errno, "mkdir `%s`", dst);
	if (mount(src, dst, type, fl, opts) < 0)
		die(errno, "mount %s `%s` on `%s`", type ? type : "bind", src, dst);
}

/* finit_module(2) each path listed in `list` (one per line), in order. */
static void load_modules(const char *list)
{
	char line[256];
	FILE *f = fopen(list, "re");

	if (!f)
		die(errno, "open `%s`", list);
	while (fgets(line, sizeof(line), f)) {
		int fd;

		line[strcspn(line, "\n")] = 0;
		if (!line[0])
			continue;
		fd = open(line, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			die(errno, "open module `%s`", line);
		if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)
			die(errno, "finit_module `%s`", line);
		close(fd);
	}
	fclose(f);
}

/* The first line of sysfs file dir/file (cg_read works on any directory). */
static int read_small(const char *dir, const char *file, char *out, size_t size)
{
	if (cg_read(AT_FDCWD, dir, file, out, size) < 0)
		return -1;
	out[strcspn(out, "\n")] = 0;
	return 0;
}

/* The port named SBX_GUEST_PORT appears asynchronously after virtio_console
 * loads (the host announces port names over the control queue). */
static void find_port(void)
{
	int waited;

	for (waited = 0; waited < WAIT_PORT_MS; waited++) {
		DIR *d = opendir("/sys/class/virtio-ports");
		struct dirent *de;

		while (d && (de = readdir(d))) {
			char dir[64], name[64];

			if (de->d_name[0] == '.')
				continue;
			snprintf(dir, sizeof(dir), "/sys/class/virtio-ports/%.24s", de->d_name);
			if (read_small(dir, "name", name, sizeof(name)) == 0 &&
			    !strcmp(name, SBX_GUEST_PORT)) {
				snprintf(port_dev, sizeof(port_dev), "/dev/%.24s", de->d_name);
				closedir(d);
				for (; waited < WAIT_PORT_MS; waited++) {
					port = open(port_dev, O_RDWR | O_CLOEXEC);
					if (port >= 0) {
						dev_dir = open("/dev", O_PATH | O_DIRECTORY |
								       O_CLOEXEC);
						if (dev_dir < 0)
							die(errno, "open /dev");
						return;
					}
					sleep_ms(1);
				}
				die(errno, "open `%s`", port_dev);
			}
		}
		if (d)
			closedir(d);
		sleep_ms(1);
	}
	die(ENOENT, "no virtio-serial port named %s", SBX_GUEST_PORT);
}

/* The port, opened again after its host left, until a host is there.  Kept
 * open meanwhile: closing it discards what the guest has been given, and a new
 * host's first frames can arrive before its "host connected" message is seen
 * (the two travel on different queues), so a close on POLLHUP lost them. */
static int pending = -1;

int sbx_guest_reconnect(void)
{
	struct pollfd pfd;
	int fd;

	/* port_dev is "/dev/<name>": the node, by name, in the initramfs's /dev */
	if (pending < 0)
		pending = openat(dev_dir, port_dev + 5, O_RDWR | O_CLOEXEC | O_NONBLOCK);
	if (pending < 0)
		return -1;
	/* virtio_console reports POLLHUP while no host is connected */
	pfd.fd = pending;
	pfd.events = POLLIN;
	if (poll(&pfd, 1, 0) < 0 || (pfd.revents & POLLHUP))
		return -1;
	fd = pending;
	pending = -1;
	port = fd; /* where a fatal error is reported from now on */
	return fd;
}

/* /dev/vdX of each disk by its virtio serial: lowers[i] for "sbx-l<i>", upper. */
static void find_disks(uint32_t n, char lowers[][32], char *upper)
{
	uint32_t found = 0;
	int waited, have_upper = 0;

	for (waited = 0; waited < WAIT_DISKS_MS; waited++) {
		DIR *d = opendir("/sys/block");
		struct dirent *de;

		while (d && (de = readdir(d))) {
			char dir[48], serial[32];

			if (strncmp(de->d_name, "vd", 2))
				continue;
			snprintf(dir, sizeof(dir), "/sys/block/%.24s", de->d_name);
			if (read_small(dir, "serial", serial, sizeof(serial)) < 0)
				continue;
			if (!strcmp(serial, SBX_GUEST_SERIAL_UPPER) && !have_upper) {
				snprintf(upper, 32, "/dev/%.24s", de->d_name);
				have_upper = 1;
			} else if (!strncmp(serial, SBX_GUEST_SERIAL_LOWER,
					    strlen(SBX_GUEST_SERIAL_LOWER))) {
				char *end;
				unsigned long i = strtoul(serial + strlen(SBX_GUEST_SERIAL_LOWER), &end, 10);

				if (!*end && i < n && !lowers[i][0]) {
					snprintf(lowers[i], 32, "/dev/%.24s", de->d_name);
					found++;
				}
			}
		}
		if (d)
			closedir(d);
		if (found == n && have_upper) {
			/* devtmpfs makes the nodes a moment after sysfs shows the disks */
			for (; waited < WAIT_DISKS_MS; waited++) {
				uint32_t i, ok = access(upper, F_OK) == 0;

				for (i = 0; ok && i < n; i++)
					ok = access(lowers[i], F_OK) == 0;
				if (ok)
					return;
				sleep_ms(1);
			}
		}
		sleep_ms(1);
	}
	die(ENODEV, "%u of %u layer disks and %s the upper disk", found, n,
	    have_upper ? "" : "not");
}

/* Bind the devices left driverless in the template (those of late
 * modules): ask the virtio bus to probe every device (those already bound
 * are left as they are). */
static void probe_devices(void)
{
	DIR *d = opendir("/sys/bus/virtio/devices");
	struct dirent *de;

	if (!d)
		die(errno, "open `/sys/bus/virtio/devices`");
	while ((de = readdir(d))) {
		if (de->d_name[0] == '.')
			continue;
		write_file("/sys/bus/virtio/drivers_probe", de->d_name);
	}
	closedir(d);
}

static int file_empty(const char *path)
{
	struct stat st;

	return stat(path, &st) < 0 || st.st_size == 0;
}

static void flush_bdev(const char *dev)
{
	int fd = open(dev, O_RDONLY | O_CLOEXEC);

	if (fd < 0 || ioctl(fd, BLKFLSBUF, 0) < 0)
		die(errno, "BLKFLSBUF `%s`", dev);
	close(fd);
}

static int memfd_of(const void *p, size_t n, const char *name)
{
	int fd;

	if (!n)
		return -1;
	fd = (int)syscall(SYS_memfd_create, name, MFD_CLOEXEC);
	if (fd < 0)
		die(errno, "memfd_create %s", name);
	if (write_all(fd, p, n) < 0)
		die(errno, "write %s", name);
	return fd;
}

static void write_file(const char *path, const char *val)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);

	if (fd < 0 || write(fd, val, strlen(val)) < 0)
		die(errno, "write `%s` to `%s`", val, path);
	close(fd);
}

static void make_dev(const char *dir)
{
	static const struct { const char *name; unsigned maj, min; } nodes[] = {
		{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7},
		{"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
	};
	static const char *const links[][2] = {
		{"pts/ptmx", "ptmx"},     {"/proc/self/fd", "fd"},
		{"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"},
		{"/proc/self/fd/2", "stderr"},
	};
	char path[64];
	size_t i;

	/* Only these nodes: no disk, no console, no control port, no /dev/mem. */
	must_mount("tmpfs", dir, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64");
	for (i = 0; i < sizeof(nodes) / sizeof(nodes[0]); i++) {
		snprintf(path, sizeof(path), "%s/%s", dir, nodes[i].name);
		if (mknod(path, S_IFCHR | 0666, makedev(nodes[i].maj, nodes[i].min)) < 0)
			die(errno, "mknod `%s`", path);
	}
	snprintf(path, sizeof(path), "%s/pts", dir);
	must_mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC,
		   "newinstance,ptmxmode=0666,mode=0620");
	snprintf(path, sizeof(path), "%s/shm", dir);
	must_mount("shm", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m");
	chmod(path, 01777);
	for (i = 0; i < sizeof(links) / sizeof(links[0]); i++) {
		snprintf(path, sizeof(path), "%s/%s", dir, links[i][1]);
		if (symlink(links[i][0], path) < 0)
			die(errno, "symlink `%s`", path);
	}
}

/* Read-only binds of the protected paths, after the chroot so that a symlink
 * in the image resolves inside the sandbox.  A path that is itself a symlink
 * (merged /usr) is left to Landlock, as in the container (spawner.c). */
static void protect_paths(char *paths)
{
	char *p, *save = NULL;

	for (p = strtok_r(paths, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
		struct stat st;

		if (p[0] != '/' || lstat(p, &st) < 0 || S_ISLNK(st.st_mode))
			continue;
		if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) < 0 ||
		    mount(NULL, p, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
			  NULL) < 0)
			die(errno, "protect `%s`", p);
	}
}

static void ensure_dir(const char *path, mode_t mode)
{
	struct stat st;

	if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode))
		return;
	if (mkdir(path, mode) < 0)
		die(errno, "mkdir `%s` in the rootfs", path);
	chmod(path, mode);
}

/* The virtio block devices the machine has (virtio device id 2). */
static uint32_t count_virtio_blk(void)
{
	DIR *d = opendir("/sys/bus/virtio/devices");
	struct dirent *de;
	uint32_t n = 0;

	if (!d)
		die(errno, "open `/sys/bus/virtio/devices`");
	while ((de = readdir(d))) {
		char dir[64], id[16];

		if (de->d_name[0] == '.')
			continue;
		snprintf(dir, sizeof(dir), "/sys/bus/virtio/devices/%.24s", de->d_name);
		if (read_small(dir, "device", id, sizeof(id)) == 0 && strtoul(id, NULL, 0) == 2)
			n++;
	}
	closedir(d);
	return n;
}

/* The workload's cgroup: cgroup2 mounted under RUN, outside the sandbox's
 * root, so that no workload process can move itself out or raise a limit
 * (DAC_OVERRIDE would pass the files' modes).  Its limits are the clone's
 * (step 2). */
static void make_cgroup(void)
{
	must_mount("cgroup2", RUN "/cg", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	write_file(RUN "/cg/cgroup.subtree_control", "+memory +pids");
	if (mkdir(RUN "/cg/w", 0755) < 0 && errno != EEXIST)
		die(errno, "mkdir the workload cgroup");
	write_file(RUN "/cg/w/cgroup.subtree_control", "+memory +pids");
	cg_fd = open(RUN "/cg/w", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (cg_fd < 0)
		die(errno, "open the workload cgroup");
}

/* The upper disk, mounted with its upper/, work/ and empty/ (a grader view's
 * bottom layer) and written back: in a template, its disk file is every
 * clone's upper as the guest leaves it here (the host copies it for each
 * clone), so what the guest caches of it is what each clone's file holds.
 * noinit_itable: no ext4lazyinit thread zeroing inode tables behind the first
 * execs (mkfs left them uninitialised, which the group descriptors record, so
 * nothing reads them as inodes). */
static void mount_upper(void)
{
	int fd;

	must_mount(disk_upper, RUN "/u", "ext4", MS_NODEV | MS_NOSUID,
		   "errors=remount-ro,noinit_itable");
	if ((mkdir(RUN "/u/upper", 0755) < 0 && errno != EEXIST) ||
	    (mkdir(RUN "/u/work", 0755) < 0 && errno != EEXIST) ||
	    (mkdir(RUN "/u/empty", 0755) < 0 && errno != EEXIST))
		die(errno, "mkdir upper/, work/, empty/ on the upper disk");
	fd = open(RUN "/u", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0 || syncfs(fd) < 0)
		die(errno, "sync the upper disk");
	close(fd);
}

/* Step 1's share of the sandbox: what does not depend on the clone. */
static void prepare_template(void)
{
	uint32_t i, n;

	if (mkdir(RUN, 0700) < 0 && errno != EEXIST)
		die(errno, "mkdir `%s`", RUN);
	if (!late_modules) {
		/* The template's disks are those of every clone (same devices, same
		 * order; the serials are the clone's too): found here, and what the
		 * kernel's probe read of them (the partition scan) dropped here, so
		 * nothing of a placeholder is cached when a clone mounts its own. */
		n = count_virtio_blk();
		if (n < 2)
			die(ENODEV, "%u virtio disks: want layers and an upper", n);
		find_disks(n - 1, disk_lowers, disk_upper);
		for (i = 0; i < n - 1; i++)
			flush_bdev(disk_lowers[i]);
		flush_bdev(disk_upper);
		n_disk_lowers = (int)(n - 1);
		mount_upper();
	}
	make_cgroup();
	/* The sandbox's /proc, /sys (read-only) and /dev, moved into its root in
	 * step 2 (a mount's place is not part of it: the same as mounting there). */
	must_mount("proc", RUN "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	must_mount("sysfs", RUN "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
		   NULL);
	make_dev(RUN "/dev");
}

/* Step 2: the clone's own sandbox. */
static void boot_sandbox(struct sbx_guest *g, const struct sbx_boot *b, char *payload)
{
	char opts[2048];
	const char *sp = payload + b->landlock_len + b->seccomp_len;
	char *hostname, *protect, *grader;
	size_t off = 0, sl = b->strings_len;
	int i;

	/* the strings: exactly three, NUL-terminated, inside the payload */
	hostname = (char *)sp;
	off = strnlen(hostname, sl) + 1;
	protect = (char *)sp + off;
	off += off <= sl ? strnlen(protect, sl - off) + 1 : 1;
	grader = (char *)sp + off;
	off += off <= sl ? strnlen(grader, sl - off) + 1 : 1;
	if (off > sl || sp[sl - 1])
		die(EINVAL, "boot strings: want hostname, protected and grader paths");
	if (b->realtime_ns) {
		struct timespec ts = {.tv_sec = (time_t)(b->realtime_ns / 1000000000ull),
				      .tv_nsec = (long)(b->realtime_ns % 1000000000ull)};

		if (clock_settime(CLOCK_REALTIME, &ts) < 0)
			die(errno, "set the clock");
	}
	step("record");
	if (n_disk_lowers < 0) { /* a late virtio_blk: the clone binds and finds its disks */
		probe_devices();
		find_disks(b->nlayers, disk_lowers, disk_upper);
		/* The template's kernel probed these disks on its placeholders: drop
		 * what it cached of them (the partition scan read zeros). */
		for (i = 0; i < (int)b->nlayers; i++)
			flush_bdev(disk_lowers[i]);
		flush_bdev(disk_upper);
		n_disk_lowers = (int)b->nlayers;
		mount_upper();
		step("disks");
	}
	/* The layer disks' size stays the placeholder's, larger than any file:
	 * EROFS keeps to the size its superblock records, and no workload process
	 * can reach the raw disks.  (The placeholders carry the clone's serials;
	 * the upper is the template's file, which the clone's is a copy of.) */
	if ((uint32_t)n_disk_lowers != b->nlayers)
		die(EINVAL, "boot record: %u layers for a machine with %d layer disks", b->nlayers,
		    n_disk_lowers);
	for (i = 0; i < (int)b->nlayers; i++) {
		char dst[64];

		snprintf(dst, sizeof(dst), RUN "/l%d", i);
		must_mount(disk_lowers[i], dst, "erofs", MS_RDONLY | MS_NODEV, NULL);
	}
	step("lowers");
	/* overlay's lowerdir lists the top layer first */
	off = (size_t)snprintf(opts, sizeof(opts), "lowerdir=");
	for (i = (int)b->nlayers - 1; i >= 0; i--)
		off += (size_t)snprintf(opts + off, sizeof(opts) - off, RUN "/l%d%s", i, i ? ":" : "");
	snprintf(opts + off, sizeof(opts) - off, ",upperdir=" RUN "/u/upper,workdir=" RUN
		 "/u/work,volatile");
	must_mount("overlay", RUN "/root", "overlay", 0, opts);
	step("overlay");
	/* A grader's view: sbx-init makes an overlay of the layers alone when a
	 * grader exec runs (grader.c), from their mount roots here and the upper
	 * disk's empty/ as its bottom layer; mounted outside the sandbox's root,
	 * so no workload process reaches them. */
	g->n_lowers = 0;
	if (grader[0]) {
		for (i = 0; i < (int)b->nlayers; i++) {
			char dir[64];

			snprintf(dir, sizeof(dir), RUN "/l%d", i);
			g->lowers[i] = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
			if (g->lowers[i] < 0)
				die(errno, "open `%s`", dir);
		}
		g->n_lowers = (int)b->nlayers;
		g->grader_paths = strdup(grader);
	}
	g->scratch_fd = open(RUN "/u", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (g->scratch_fd < 0)
		die(errno, "open the upper disk's root");
	if (b->memory_max) {
		snprintf(opts, sizeof(opts), "%llu", (unsigned long long)b->memory_max);
		write_file(RUN "/cg/w/memory.max", opts);
	}
	if (b->pids_max) {
		snprintf(opts, sizeof(opts), "%u", b->pids_max);
		write_file(RUN "/cg/w/pids.max", opts);
	}
	g->cgroup_fd = cg_fd;
	step("cgroup");
	g->landlock_fd = memfd_of(payload, b->landlock_len, "landlock");
	g->seccomp_fd = memfd_of(payload + b->landlock_len, b->seccomp_len, "seccomp");
	g->caps = b->caps;
	g->flags = b->flags;

	/* The mount points, then step 1's /proc, /sys and /dev moved onto them
	 * (the root's own directories: lstat saw no symlink in their place). */
	ensure_dir(RUN "/root/proc", 0555);
	ensure_dir(RUN "/root/dev", 0755);
	ensure_dir(RUN "/root/sys", 0555);
	ensure_dir(RUN "/root/tmp", 01777);
	if (mount(RUN "/proc", RUN "/root/proc", NULL, MS_MOVE, NULL) < 0 ||
	    mount(RUN "/sys", RUN "/root/sys", NULL, MS_MOVE, NULL) < 0 ||
	    mount(RUN "/dev", RUN "/root/dev", NULL, MS_MOVE, NULL) < 0)
		die(errno, "move /proc, /sys, /dev into the sandbox's root");
	/* switch_root: the initramfs cannot be pivot_root'ed away; move the
	 * overlay onto / and chroot into it.  The initramfs stays underneath,
	 * unreachable from the new root (its pages are the template's, shared). */
	if (chdir(RUN "/root") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 ||
	    chdir("/") < 0)
		die(errno, "switch to the sandbox's root");
	protect_paths(protect);
	if (sethostname(hostname, strlen(hostname)) < 0)
		die(errno, "sethostname `%s`", hostname);
	step("root");
}

void sbx_guest_boot(struct sbx_guest *g)
{
	struct sbx_boot_ready ready = {.magic = "SBXREADY", .version = SBX_GUEST_VERSION};
	struct sbx_boot b;
	char *payload;
	int fl;

	memset(g, 0, sizeof(*g));
	g->port = g->landlock_fd = g->seccomp_fd = g->cgroup_fd = g->scratch_fd = -1;
	/* The guest's PID 1 is named as a container's is (the kernel ran it as
	 * /init): what tests/security/attack.c checks before it runs. */
	prctl(PR_SET_NAME, "sbx-init");
	/* step 1: the template's part */
	must_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	must_mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	must_mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
	load_modules("/etc/sbx/modules.early");
	/* Late modules are loaded now but bind no device: with the bus's
	 * autoprobe off, their devices stay driverless in the template, and a
	 * clone binds its own in step 2 (probe_devices). */
	late_modules = !file_empty("/etc/sbx/modules.late");
	if (late_modules) {
		write_file("/sys/bus/virtio/drivers_autoprobe", "0");
		load_modules("/etc/sbx/modules.late");
	}
	find_port();
	prepare_template();
	ready.boot_ns = ns_of(CLOCK_BOOTTIME);
	if (write_all(port, &ready, sizeof(ready)) < 0)
		die(errno, "write the ready record");
	/* The template is saved while we wait here; each clone resumes here. */
	if (read_all(port, &b, sizeof(b)) < 0)
		die(errno, "read the boot record");
	boot_t0 = step_t = ns_of(CLOCK_MONOTONIC);
	if (memcmp(b.magic, "SBXBOOT1", 8) || b.len > SBX_GUEST_MAX_PAYLOAD || !b.nlayers ||
	    b.nlayers > SBX_GUEST_MAX_LAYERS || !b.strings_len ||
	    (uint64_t)b.landlock_len + b.seccomp_len + b.strings_len != b.len)
		die(EPROTO, "bad boot record");
	payload = malloc(b.len);
	if (!payload || read_all(port, payload, b.len) < 0)
		die(errno ? errno : ENOMEM, "read the boot payload");
	/* step 2 */
	boot_sandbox(g, &b, payload);
	free(payload);
	send_done(0, steps, boot_t0);
	fl = fcntl(port, F_GETFL);
	fcntl(port, F_SETFL, fl | O_NONBLOCK);
	g->port = port;
}
