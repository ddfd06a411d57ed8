/* sbx-init: PID 1 of a sandbox.
 *
 * Reaps every process that ends up parented to it, and runs commands for edged
 * over the control socket described in protocol.h.  One thread, one epoll loop;
 * every fd non-blocking so that no peer (client or workload) can stall it.
 *
 * Usage: sbx-init -l LISTEN_FD [-f FREEZER_CG_FD -m MEMORY_CG_FD | -u V2_CG_FD]
 *                 [-L LANDLOCK_FD] [-S SECCOMP_FD] [-U SCRATCH_FD] [-A PROFILE]
 *                 [-P PRISTINE_FD -G PATH[:PATH...]]
 *   LISTEN_FD      a bound unix stream socket (sbx-init calls listen(), so that
 *                  SO_PEERCRED on a client's connection names sbx-init);
 *   *_CG_FD        directories of the sandbox's cgroups, delegated to the
 *                  sandbox root, under which each exec gets its own cgroup so
 *                  that a timeout or kill takes its whole tree, daemonized
 *                  grandchildren included.
 *   LANDLOCK_FD    a file holding a Landlock ruleset blob (lfs_confine.h),
 *                  read and resolved once at start-up, while the rootfs is
 *                  still exactly what the layers hold;
 *   SECCOMP_FD     a file holding a classic-BPF seccomp program whose denials
 *                  are user notifications;
 *   PROFILE        an AppArmor profile (loaded by the daemon) each exec changes
 *                  to at execve (aa_change_onexec), on kernels with AppArmor;
 *   SCRATCH_FD     the sandbox's scratch directory (upper/ and work/ of the
 *                  overlay): only kept open, so the daemon can inspect the
 *                  upper through /proc/<pid>/fd before a grader exec.
 *   PRISTINE_FD    a detached read-only mount of the lowers alone (what the
 *                  layers hold, nothing the workload wrote), and the PATHs
 *                  a grader exec (SBX_EXEC_GRADER) sees from it: its child
 *                  makes a mount namespace of its own and mounts clones of
 *                  that tree over them, so a sitecustomize.py or .pth file in
 *                  /etc or /usr, or a changed grader tool, never reaches the
 *                  grader.  For this sbx-init holds CAP_SYS_ADMIN in the
 *                  sandbox's user namespace (never in the bounding set; its
 *                  inheritable set is emptied at start, so no exec gets it).
 * Every inherited fd is made close-on-exec at start-up: no workload process
 * inherits the control channel or a cgroup directory.
 *
 * Confinement is applied to EACH exec's child just before execve, never to
 * sbx-init itself: Landlock first (a fresh domain per exec, so the workload's
 * domain cannot signal, ptrace or reach the abstract sockets of sbx-init or of
 * a later grader exec), then seccomp with a notification listener.  The child
 * hands the listener to sbx-init over its error socket; sbx-init answers each
 * denied syscall with EPERM at once (the workload never waits on the daemon)
 * and reports it to the client as an SBX_EVENT.
 *
 * With per-exec cgroups, the next exec's child is forked ahead (the "spare")
 * and moves itself into that exec's cgroups while sbx-init goes on: moving a
 * process between cgroups takes the kernel's cgroup_threadgroup_rwsem for
 * writing, which waits for an RCU grace period when no move happened lately
 * (milliseconds; tens on a loaded host), and an exec would otherwise wait for
 * it each time.  The spare keeps no fd but its own and waits for the exec's
 * request and fds; like sbx-init it is not dumpable and outside every
 * workload's Landlock domain (no signals or ptrace from the workload).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "lfs_confine.h"
#include "protocol.h"

#define DRAIN_NS      (20 * 1000000ull) /* output grace after the main process ends */
#define OUTQ_HIGH     (1u << 20)        /* stop reading pipes above this much unsent */
#define STDIN_MAX     (4u << 20)        /* stdin bytes buffered per exec */
#define MAX_PENDING_RM 1024
#define SPARE_MAX_MSG (128u << 10)      /* larger exec requests fork as they come */
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

enum kind { K_LISTEN = 1, K_SIG, K_CLIENT, K_OUT, K_ERR, K_IN, K_ERRPIPE, K_NOTIF };

struct buf {
	uint8_t *p;
	size_t off, len, cap; /* unsent data is p[off..len) */
};

struct exec {
	int used;
	uint32_t id;
	pid_t pid;
	int out_fd, err_fd, in_fd, errpipe;
	int notif;        /* seccomp listener of the exec's filter, -1 if none */
	uint32_t ev_dropped; /* its denials not sent since the last one sent */
	int pty;          /* out_fd is the pty master; stdin goes there too */
	int started, failed, reaped, orphan;
	int status;
	struct rusage ru;
	uint64_t t0, t_end, deadline, drain_deadline;
	uint64_t limit, total;
	int64_t window;
	uint32_t reason;  /* forced end reason (timeout, output limit, killed), else 0 */
	int stdin_wanted, stdin_eof;
	struct buf in;
	char cg[24];      /* per-exec cgroup name, "" if none */
};

static int ep = -1, listen_fd = -1, sig_fd = -1, client_fd = -1;
static int cg_mode = SBX_CGROUP_NONE;
static int cg_freezer = -1, cg_memory = -1, cg_v2 = -1;
static struct exec execs[SBX_MAX_EXECS];
static struct buf outq;
static uint8_t inbuf[sizeof(struct sbx_hdr) + SBX_MAX_PAYLOAD];
static size_t inlen;
static int interest_dirty;
static uint64_t cg_counter;
static char pending_rm[MAX_PENDING_RM][24];
static int n_pending_rm;
static int ll_ruleset = -1;     /* prepared Landlock ruleset, -1: none */
static uint32_t ll_flags;
static uint8_t *sc_prog;        /* seccomp program, NULL: none */
static size_t sc_len;
static uint64_t ev_tat;         /* GCRA theoretical arrival time of the next event, ns */

/* Denied syscalls sent to the daemon one by one: at most EV_RATE per second after a
 * burst of EV_BURST, per sandbox (half the 200 a second the daemon's ledger keeps, which
 * leaves room for its other events).  A workload
 * that loops on a denied syscall costs the daemon nothing beyond that: the rest are only
 * counted here (and reported as `dropped`), their syscalls denied all the same. */
#define EV_RATE 100u
#define EV_BURST 100u
#define EV_INTERVAL_NS (1000000000ull / EV_RATE)
static const char *aa_profile;  /* AppArmor profile for execs, NULL: none */
static int pristine_fd = -1;    /* the lowers-only tree for grader views, -1: none */
static const char *grader_paths; /* ':'-separated paths a grader view replaces */

/* The child forked ahead of the next exec (see the top comment); pid 0: none. */
static struct {
	pid_t pid;
	int sock;     /* the request goes here */
	char cg[24];  /* the cgroups it moved into */
} spare = {0, -1, ""};

/* What the spare receives: this, the EXEC payload, and the fds in fdmask
 * order (stdin read end, stdout and stderr write ends, error socket). */
struct spare_hdr {
	uint32_t fdmask;
	char pty_name[64]; /* "" if no pty */
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void logmsg(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	(void)!write(2, line, (size_t)n);
}

static int buf_reserve(struct buf *b, size_t more)
{
	size_t need, cap;
	uint8_t *p;

	if (b->off && b->off == b->len)
		b->off = b->len = 0;
	need = b->len + more;
	if (need <= b->cap)
		return 0;
	if (b->off) { /* compact before growing */
		memmove(b->p, b->p + b->off, b->len - b->off);
		b->len -= b->off;
		b->off = 0;
		if (b->len + more <= b->cap)
			return 0;
		need = b->len + more;
	}
	cap = b->cap ? b->cap : 4096;
	while (cap < need)
		cap *= 2;
	p = realloc(b->p, cap);
	if (!p)
		return -1;
	b->p = p;
	b->cap = cap;
	return 0;
}

static void buf_free(struct buf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

static uint64_t tag(int kind, int slot)
{
	return ((uint64_t)slot << 8) | (uint64_t)kind;
}

static void ep_add(int fd, int kind, int slot, uint32_t events)
{
	struct epoll_event ev = {.events = events, .data.u64 = tag(kind, slot)};

	if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0)
		logmsg("sbx-init: epoll add: %s", strerror(errno));
}

/* Interest 0 removes the fd: EPOLLHUP/EPOLLERR are reported even for an empty
 * mask, which would spin the loop while flow control holds a pipe back. */
static void ep_set(int fd, int kind, int slot, uint32_t events)
{
	struct epoll_event ev = {.events = events, .data.u64 = tag(kind, slot)};

	if (!events) {
		epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
		return;
	}
	if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev) < 0 && errno == ENOENT)
		epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

static void close_fd(int *fd)
{
	if (*fd >= 0) {
		epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
		close(*fd);
		*fd = -1;
	}
}

static void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* ---- outgoing frames --------------------------------------------------- */

static void flush_client(void);
static void spare_make(void);

static void send_frame(uint16_t type, uint32_t exec_id, const void *a, size_t alen,
		       const void *b, size_t blen)
{
	struct sbx_hdr h = {.len = (uint32_t)(alen + blen), .type = type, .exec_id = exec_id};

	if (client_fd < 0)
		return;
	if (buf_reserve(&outq, sizeof(h) + alen + blen) < 0) {
		logmsg("sbx-init: out of memory queueing a frame; dropping the client");
		return;
	}
	memcpy(outq.p + outq.len, &h, sizeof(h));
	outq.len += sizeof(h);
	if (alen)
		memcpy(outq.p + outq.len, a, alen);
	outq.len += alen;
	if (blen)
		memcpy(outq.p + outq.len, b, blen);
	outq.len += blen;
}

static void send_error(uint32_t exec_id, int code, const char *fmt, ...)
{
	struct sbx_error e = {.code = code};
	char msg[SBX_MAX_ERROR_MSG];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0)
		n = 0;
	if (n >= (int)sizeof(msg))
		n = sizeof(msg) - 1;
	send_frame(SBX_ERROR, exec_id, &e, sizeof(e), msg, (size_t)n);
}

static size_t outq_pending(void)
{
	return outq.len - outq.off;
}

/* ---- cgroups ----------------------------------------------------------- */

static int cg_write(int dirfd, const char *cg, const char *file, const char *val)
{
	char path[64];
	int fd, rc = 0;

	snprintf(path, sizeof(path), "%s/%s", cg, file);
	fd = openat(dirfd, path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	if (write(fd, val, strlen(val)) < 0)
		rc = -1;
	close(fd);
	return rc;
}

static ssize_t cg_read(int dirfd, const char *cg, const char *file, char *out, size_t size)
{
	char path[64];
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "%s/%s", cg, file);
	fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, out, size - 1);
	close(fd);
	if (n < 0)
		return -1;
	out[n] = 0;
	return n;
}

/* Value of "key N" in a flat-keyed cgroup file, or 0. */
static uint64_t cg_key(int dirfd, const char *cg, const char *file, const char *key)
{
	char text[1024], *p;
	size_t klen = strlen(key);

	if (cg_read(dirfd, cg, file, text, sizeof(text)) < 0)
		return 0;
	for (p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (!strncmp(p, key, klen) && p[klen] == ' ')
			return strtoull(p + klen + 1, NULL, 10);
	return 0;
}

static uint64_t cg_u64(int dirfd, const char *cg, const char *file)
{
	char text[64];

	if (cg_read(dirfd, cg, file, text, sizeof(text)) < 0)
		return 0;
	return strtoull(text, NULL, 10);
}

/* Make the exec's cgroups; returns fds (close-on-exec) of the files the child
 * writes "0" into to join them, or -1 entries. */
static int cg_make(struct exec *e, int join[2])
{
	join[0] = join[1] = -1;
	e->cg[0] = 0;
	if (cg_mode == SBX_CGROUP_NONE)
		return 0;
	snprintf(e->cg, sizeof(e->cg), "e%llu", (unsigned long long)++cg_counter);
	if (cg_mode == SBX_CGROUP_V1) {
		char path[64];

		if (mkdirat(cg_freezer, e->cg, 0755) < 0)
			goto fail;
		/* "tasks", not "cgroup.procs": the child is single-threaded and moves
		 * itself ("0"), which the kernel does without write-locking the
		 * global cgroup_threadgroup_rwsem, i.e. without waiting for an RCU
		 * grace period (milliseconds when no move happened lately). */
		snprintf(path, sizeof(path), "%s/tasks", e->cg);
		join[0] = openat(cg_freezer, path, O_WRONLY | O_CLOEXEC);
		if (cg_memory >= 0 && mkdirat(cg_memory, e->cg, 0755) == 0)
			join[1] = openat(cg_memory, path, O_WRONLY | O_CLOEXEC);
		if (join[0] < 0)
			goto fail;
		return 0;
	}
	if (mkdirat(cg_v2, e->cg, 0755) < 0)
		goto fail;
	{
		char path[64];

		snprintf(path, sizeof(path), "%s/cgroup.procs", e->cg);
		join[0] = openat(cg_v2, path, O_WRONLY | O_CLOEXEC);
		if (join[0] < 0)
			goto fail;
	}
	return 0;
fail:
	{
		int saved = errno;

		logmsg("sbx-init: cgroup %s: %s (tree kill falls back to the session sweep)",
		       e->cg, strerror(saved));
		if (join[1] >= 0)
			close(join[1]);
		join[1] = -1;
		if (cg_mode == SBX_CGROUP_V1) {
			unlinkat(cg_freezer, e->cg, AT_REMOVEDIR);
			if (cg_memory >= 0)
				unlinkat(cg_memory, e->cg, AT_REMOVEDIR);
		} else {
			unlinkat(cg_v2, e->cg, AT_REMOVEDIR);
		}
		e->cg[0] = 0;
	}
	return 0;
}

static int cg_remove_name(const char *cg)
{
	int rc = 0;

	if (cg_mode == SBX_CGROUP_V1) {
		if (unlinkat(cg_freezer, cg, AT_REMOVEDIR) < 0 && errno != ENOENT)
			rc = -1;
		if (cg_memory >= 0 && unlinkat(cg_memory, cg, AT_REMOVEDIR) < 0 && errno != ENOENT)
			rc = -1;
	} else if (cg_mode == SBX_CGROUP_V2) {
		if (unlinkat(cg_v2, cg, AT_REMOVEDIR) < 0 && errno != ENOENT)
			rc = -1;
	}
	return rc;
}

/* An exec's cgroup may still hold background processes when the exec ends;
 * remove it once they are gone. */
static void cg_release(struct exec *e)
{
	if (!e->cg[0])
		return;
	if (cg_remove_name(e->cg) < 0 && n_pending_rm < MAX_PENDING_RM)
		memcpy(pending_rm[n_pending_rm++], e->cg, sizeof(e->cg));
	e->cg[0] = 0;
}

static void cg_retry_pending(void)
{
	int i = 0;

	while (i < n_pending_rm) {
		if (cg_remove_name(pending_rm[i]) == 0) {
			memcpy(pending_rm[i], pending_rm[--n_pending_rm], sizeof(pending_rm[0]));
			continue;
		}
		i++;
	}
}

static void kill_pids_in(int dirfd, const char *cg)
{
	char text[8192], *p, *end;

	if (cg_read(dirfd, cg, "cgroup.procs", text, sizeof(text)) < 0)
		return;
	for (p = text; *p; p = end) {
		long pid = strtol(p, &end, 10);

		if (end == p)
			break;
		if (pid > 1)
			kill((pid_t)pid, SIGKILL);
		while (*end == '\n')
			end++;
	}
}

/* Without cgroups: kill every process whose session is the exec's (setsid in
 * the child makes the main pid the session id; a daemon that called setsid
 * again escapes this, which is why cgroups are preferred). */
static void sweep_session(pid_t sid)
{
	struct dirent *d;
	DIR *dir = opendir("/proc");

	if (!dir)
		return;
	while ((d = readdir(dir))) {
		char path[64], stat[512], *rp;
		long pid = strtol(d->d_name, NULL, 10);
		int fd, pgrp, session;
		ssize_t n;

		if (pid <= 1)
			continue;
		snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		n = read(fd, stat, sizeof(stat) - 1);
		close(fd);
		if (n <= 0)
			continue;
		stat[n] = 0;
		rp = strrchr(stat, ')');
		if (rp && sscanf(rp + 2, "%*c %*d %d %d", &pgrp, &session) == 2 && session == sid)
			kill((pid_t)pid, SIGKILL);
	}
	closedir(dir);
}

static void kill_tree(struct exec *e)
{
	if (!e->reaped && e->pid > 0) {
		kill(-e->pid, SIGKILL);
		kill(e->pid, SIGKILL);
	}
	if (e->cg[0] && cg_mode == SBX_CGROUP_V2) {
		if (cg_write(cg_v2, e->cg, "cgroup.kill", "1") == 0)
			return;
	}
	if (e->cg[0] && cg_mode == SBX_CGROUP_V1) {
		char state[32] = "";
		int i;

		/* Freeze first so that nothing forks while the list is read. */
		cg_write(cg_freezer, e->cg, "freezer.state", "FROZEN");
		for (i = 0; i < 200; i++) {
			if (cg_read(cg_freezer, e->cg, "freezer.state", state, sizeof(state)) < 0 ||
			    !strncmp(state, "FROZEN", 6))
				break;
			usleep(500);
		}
		kill_pids_in(cg_freezer, e->cg);
		cg_write(cg_freezer, e->cg, "freezer.state", "THAWED");
		return;
	}
	if (e->pid > 0)
		sweep_session(e->pid);
}

/* ---- execs ------------------------------------------------------------- */

static struct exec *find_exec(uint32_t id)
{
	unsigned i;

	if (!id)
		return NULL;
	for (i = 0; i < SBX_MAX_EXECS; i++)
		if (execs[i].used && execs[i].id == id && !execs[i].orphan)
			return &execs[i];
	return NULL;
}

static int slot_of(struct exec *e)
{
	return (int)(e - execs);
}

static void exec_close_io(struct exec *e)
{
	if (e->pty && e->in_fd == e->out_fd)
		e->in_fd = -1;
	close_fd(&e->out_fd);
	close_fd(&e->err_fd);
	close_fd(&e->in_fd);
	close_fd(&e->errpipe);
	close_fd(&e->notif);
	buf_free(&e->in);
}

static void exec_free(struct exec *e)
{
	exec_close_io(e);
	cg_release(e);
	memset(e, 0, sizeof(*e));
	e->out_fd = e->err_fd = e->in_fd = e->errpipe = e->notif = -1;
}

static void exec_finish(struct exec *e)
{
	struct sbx_end end = {.exit_code = -1};
	uint64_t peak = 0;
	int oom = 0;

	if (e->cg[0] && cg_mode == SBX_CGROUP_V1 && cg_memory >= 0) {
		oom = cg_key(cg_memory, e->cg, "memory.oom_control", "oom_kill") > 0;
		peak = cg_u64(cg_memory, e->cg, "memory.max_usage_in_bytes");
	} else if (e->cg[0] && cg_mode == SBX_CGROUP_V2) {
		oom = cg_key(cg_v2, e->cg, "memory.events", "oom_kill") > 0;
		peak = cg_u64(cg_v2, e->cg, "memory.peak");
	}
	if (!peak)
		peak = (uint64_t)e->ru.ru_maxrss * 1024u;
	if (WIFEXITED(e->status))
		end.exit_code = WEXITSTATUS(e->status);
	else if (WIFSIGNALED(e->status))
		end.signal = WTERMSIG(e->status);
	if (e->reason)
		end.reason = e->reason;
	else if (oom)
		end.reason = SBX_OOM;
	else
		end.reason = WIFEXITED(e->status) ? SBX_EXITED : SBX_SIGNALLED;
	end.duration_ns = e->t_end - e->t0;
	end.peak_memory = peak;
	if (e->ev_dropped && client_fd >= 0) {
		/* the denials not reported one by one, before the exec's end */
		struct sbx_event ev = {.kind = SBX_EV_DROPPED, .dropped = e->ev_dropped};

		send_frame(SBX_EVENT, e->id, &ev, sizeof(ev), NULL, 0);
		e->ev_dropped = 0;
	}
	send_frame(SBX_END, e->id, &end, sizeof(end), NULL, 0);
	exec_free(e);
	interest_dirty = 1;
	/* The next exec's spare, now that this exec's cgroups are gone: while the
	 * spare moves into its own it holds the cgroup mutex for a grace period,
	 * which would stall the rmdir above.  END goes out first. */
	flush_client();
	spare_make();
}

static void maybe_finish(struct exec *e, uint64_t now)
{
	if (!e->used || !e->reaped)
		return;
	if (e->failed || e->orphan) {
		exec_free(e);
		return;
	}
	if (!e->started)
		return; /* the error pipe tells first */
	if (e->out_fd < 0 && e->err_fd < 0) {
		exec_finish(e);
		return;
	}
	if (now >= e->drain_deadline) {
		/* Background processes may hold the pipes open for ever: after a
		 * short grace, end once nothing is held back by flow control. */
		if (e->window > 0 && outq_pending() < OUTQ_HIGH)
			exec_finish(e);
		else
			e->drain_deadline = now + DRAIN_NS;
	}
}

struct child_args {
	const struct sbx_exec *req;
	const char *cwd;
	char **argv, **envp;
	int in_r, out_w, err_w, errpipe_w, join[2];
	const char *pty_name;
};

static void child_fail(int fd, int code, const char *what, const char *arg)
{
	char msg[304];
	int n = snprintf(msg + 4, sizeof(msg) - 4, "%s `%s`: %s", what, arg, strerror(code));
	int32_t c = code;

	if (n < 0)
		n = 0;
	if (n >= (int)sizeof(msg) - 4)
		n = sizeof(msg) - 5;
	/* one message on the SOCK_SEQPACKET error socket */
	memcpy(msg, &c, sizeof(c));
	(void)!write(fd, msg, (size_t)n + 4);
	_exit(127);
}

extern char **environ;

/* Pass the seccomp listener to sbx-init as one 'L' message with the fd. */
static int send_listener(int sock, int fd)
{
	char byte = 'L';
	struct iovec iov = {.iov_base = &byte, .iov_len = 1};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} c;
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf,
			   .msg_controllen = sizeof(c.buf)};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);

	memset(c.buf, 0, sizeof(c.buf));
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	return sendmsg(sock, &m, MSG_NOSIGNAL) == 1 ? 0 : -1;
}

/* Landlock, then seccomp: the last steps before execve (the filter would
 * otherwise also judge our own set-up calls). */
static void confine_child(int errpipe_w)
{
	struct lfs_error err = {0};
	int l;

	if (aa_profile) {
		/* the AppArmor onexec protocol: the profile applies from the execve on */
		char cmd[128];
		int n = snprintf(cmd, sizeof(cmd), "exec %s", aa_profile);
		int fd = open("/proc/self/attr/apparmor/exec", O_WRONLY | O_CLOEXEC);

		if (fd < 0)
			fd = open("/proc/self/attr/exec", O_WRONLY | O_CLOEXEC);
		if (fd < 0 || n <= 0 || n >= (int)sizeof(cmd) || write(fd, cmd, (size_t)n) != n)
			child_fail(errpipe_w, errno ? errno : EINVAL, "apparmor change_onexec",
				   aa_profile);
		close(fd);
	}
	if (ll_ruleset >= 0 && lfs_landlock_enforce(ll_ruleset, ll_flags, &err) < 0)
		child_fail(errpipe_w, err.code, "confine", err.msg);
	if (!sc_prog)
		return;
	l = lfs_seccomp_install(sc_prog, sc_len, 1, 0, &err);
	if (l < 0)
		child_fail(errpipe_w, err.code, "confine", err.msg);
	if (send_listener(errpipe_w, l) < 0)
		child_fail(errpipe_w, errno, "confine", "pass the seccomp listener");
	close(l);
}

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
static int same_link(const char *path)
{
	char a[PATH_MAX], b[PATH_MAX];
	ssize_t na = readlinkat(pristine_fd, path + 1, a, sizeof(a));
	ssize_t nb = readlink(path, b, sizeof(b));

	return na >= 0 && na == nb && !memcmp(a, b, (size_t)na);
}

/* A grader exec's own view: a private mount namespace in which each of the
 * grader paths is what the layers hold.  A path the layers lack but the
 * workload made is hidden under an empty read-only tmpfs; one the workload
 * replaced or removed fails the exec (fail closed: nothing to mount on, or
 * not the same kind of file).  HOME (/root) is a fresh empty tmpfs. */
static void grader_view(int errpipe_w, uint32_t uid, uint32_t gid)
{
	static char paths[128 << 10];
	char *p, *save = NULL, opts[96];
	struct stat want, have;

	if (pristine_fd < 0)
		child_fail(errpipe_w, ENOTSUP, "grader view", "no pristine tree in this sandbox");
	if (unshare(CLONE_NEWNS) < 0)
		child_fail(errpipe_w, errno, "grader view", "unshare the mount namespace");
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		child_fail(errpipe_w, errno, "grader view", "make / private");
	snprintf(paths, sizeof(paths), "%s", grader_paths ? grader_paths : "");
	for (p = strtok_r(paths, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
		int t;

		if (p[0] != '/' || !p[1])
			continue;
		if (fstatat(pristine_fd, p + 1, &want, AT_SYMLINK_NOFOLLOW) < 0) {
			if (errno != ENOENT && errno != ENOTDIR)
				child_fail(errpipe_w, errno, "grader view: stat in the layers", p);
			if (lstat(p, &have) < 0)
				continue; /* in neither */
			if (!S_ISDIR(have.st_mode))
				child_fail(errpipe_w, EEXIST, "grader view: not in the layers", p);
			if (mount("tmpfs", p, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV,
				  "size=4k,mode=0755") < 0)
				child_fail(errpipe_w, errno, "grader view: hide", p);
			continue;
		}
		if (S_ISLNK(want.st_mode)) {
			/* merged /usr: the target is a grader path of its own */
			if (!same_link(p))
				child_fail(errpipe_w, ELOOP, "grader view: link changed", p);
			continue;
		}
		if (lstat(p, &have) < 0 || S_ISLNK(have.st_mode) ||
		    S_ISDIR(have.st_mode) != S_ISDIR(want.st_mode))
			child_fail(errpipe_w, ENOTDIR, "grader view: replaced or removed", p);
		t = (int)syscall(SYS_open_tree, pristine_fd, p + 1,
				 OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE | AT_SYMLINK_NOFOLLOW);
		if (t < 0)
			child_fail(errpipe_w, errno, "grader view: clone", p);
		if (syscall(SYS_move_mount, t, "", AT_FDCWD, p, MOVE_MOUNT_F_EMPTY_PATH) < 0)
			child_fail(errpipe_w, errno, "grader view: mount over", p);
		close(t);
	}
	if (lstat("/root", &have) == 0 && S_ISDIR(have.st_mode)) {
		snprintf(opts, sizeof(opts), "size=64m,mode=0700,uid=%u,gid=%u", uid, gid);
		if (mount("tmpfs", "/root", "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0)
			child_fail(errpipe_w, errno, "grader view: fresh HOME", "/root");
	}
}

static void child(struct child_args *a)
{
	sigset_t none;
	int i;

	sigemptyset(&none);
	for (i = 1; i < NSIG; i++)
		signal(i, SIG_DFL);
	sigprocmask(SIG_SETMASK, &none, NULL);
	for (i = 0; i < 2; i++)
		if (a->join[i] >= 0 && write(a->join[i], "0", 1) < 0)
			child_fail(a->errpipe_w, errno, "join cgroup", "cgroup.procs");
	if (setsid() < 0)
		child_fail(a->errpipe_w, errno, "setsid", "");
	if (a->req->flags & SBX_EXEC_GRADER)
		grader_view(a->errpipe_w, a->req->uid, a->req->gid);
	if (a->pty_name) {
		int s = open(a->pty_name, O_RDWR);

		if (s < 0)
			child_fail(a->errpipe_w, errno, "open", a->pty_name);
		if (ioctl(s, TIOCSCTTY, 0) < 0)
			child_fail(a->errpipe_w, errno, "TIOCSCTTY", a->pty_name);
		dup2(s, 0);
		dup2(s, 1);
		dup2(s, 2);
		if (s > 2)
			close(s);
	} else {
		int in = a->in_r;

		if (in < 0)
			in = open("/dev/null", O_RDONLY | O_CLOEXEC); /* dup2 makes 0 inheritable */
		if (in < 0)
			child_fail(a->errpipe_w, errno, "open", "/dev/null");
		if (dup2(in, 0) < 0 || dup2(a->out_w, 1) < 0 || dup2(a->err_w, 2) < 0)
			child_fail(a->errpipe_w, errno, "dup2", "stdio");
	}
	if (setgroups(0, NULL) < 0 && errno != EPERM)
		child_fail(a->errpipe_w, errno, "setgroups", "");
	if (setresgid(a->req->gid, a->req->gid, a->req->gid) < 0)
		child_fail(a->errpipe_w, errno, "setgid", "gid");
	if (setresuid(a->req->uid, a->req->uid, a->req->uid) < 0)
		child_fail(a->errpipe_w, errno, "setuid", "uid");
	if (chdir(a->cwd) < 0)
		child_fail(a->errpipe_w, errno, "chdir", a->cwd);
	confine_child(a->errpipe_w);
	environ = a->envp;
	execvp(a->argv[0], a->argv);
	child_fail(a->errpipe_w, errno, "exec", a->argv[0]);
}

static char **split_strings(char *p, size_t len, uint32_t n, char **out);

/* argv and env of a checked EXEC payload as NULL-terminated arrays inside
 * strs (strs[0] is the cwd). */
static void exec_arrays(const struct sbx_exec *req, char **strs, char ***argv, char ***envp)
{
	*argv = &strs[1];
	memmove(&strs[2 + req->argc], &strs[1 + req->argc], req->envc * sizeof(char *));
	strs[1 + req->argc] = NULL;
	*envp = &strs[2 + req->argc];
	(*envp)[req->envc] = NULL;
}

static int cmp_int(const void *a, const void *b)
{
	return *(const int *)a - *(const int *)b;
}

static void spare_main(int sock, const int join[2])
{
	static uint8_t msg[SPARE_MAX_MSG];
	static char *strs[SBX_MAX_STRINGS + 3];
	struct spare_hdr h;
	struct sbx_exec req;
	struct child_args a;
	struct iovec iov[2] = {{.iov_base = &h, .iov_len = sizeof(h)},
			       {.iov_base = msg, .iov_len = sizeof(msg)}};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(4 * sizeof(int))];
	} c;
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = c.buf,
			   .msg_controllen = sizeof(c.buf)};
	struct cmsghdr *cm;
	int keep[8] = {0, 1, 2, sock}, nk = 4, fds[4] = {-1, -1, -1, -1}, got[4], i, n = 0;
	ssize_t r;

	/* Nothing of sbx-init's but what an exec needs: a copy of a running
	 * exec's stdin write end, say, would keep that exec from seeing EOF. */
	for (i = 0; i < 2; i++)
		if (join[i] >= 0)
			keep[nk++] = join[i];
	if (ll_ruleset >= 0)
		keep[nk++] = ll_ruleset;
	if (pristine_fd >= 0)
		keep[nk++] = pristine_fd;
	qsort(keep, (size_t)nk, sizeof(int), cmp_int);
	for (i = 0, n = 0; i < nk; i++) {
		if (keep[i] > n)
			syscall(SYS_close_range, (unsigned)n, (unsigned)keep[i] - 1, 0u);
		n = keep[i] + 1;
	}
	syscall(SYS_close_range, (unsigned)n, ~0u, 0u);
	for (i = 0; i < 2; i++)
		if (join[i] >= 0 && write(join[i], "0", 1) < 0)
			_exit(1); /* sbx-init drops this spare and forks for the exec */
	for (i = 0; i < 2; i++)
		if (join[i] >= 0)
			close(join[i]);
	do
		r = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
	while (r < 0 && errno == EINTR);
	if (r < (ssize_t)(sizeof(h) + sizeof(req)) || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
		_exit(0); /* sbx-init dropped the spare */
	cm = CMSG_FIRSTHDR(&m);
	n = 0;
	if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
		n = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
	if (n > 4 || n != __builtin_popcount(h.fdmask) || (h.fdmask >> 4))
		_exit(1);
	if (n)
		memcpy(got, CMSG_DATA(cm), (size_t)n * sizeof(int));
	for (i = 0, n = 0; i < 4; i++)
		if (h.fdmask & (1u << i))
			fds[i] = got[n++];
	close(sock);
	r -= (ssize_t)sizeof(h);
	memcpy(&req, msg, sizeof(req));
	if (!split_strings((char *)msg + sizeof(req), (size_t)r - sizeof(req),
			   1 + req.argc + req.envc, strs))
		_exit(1); /* checked by sbx-init: cannot happen */
	memset(&a, 0, sizeof(a));
	a.req = &req;
	a.cwd = strs[0];
	exec_arrays(&req, strs, &a.argv, &a.envp);
	a.in_r = fds[0];
	a.out_w = fds[1];
	a.err_w = fds[2];
	a.errpipe_w = fds[3];
	a.join[0] = a.join[1] = -1;
	h.pty_name[sizeof(h.pty_name) - 1] = 0;
	a.pty_name = h.pty_name[0] ? h.pty_name : NULL;
	child(&a);
}


/* Fork the next exec's child ahead, if there is none and execs get cgroups. */
static void spare_make(void)
{
	struct exec tmp;
	int join[2], sv[2] = {-1, -1}, i;
	pid_t pid = -1;

	if (spare.pid > 0 || cg_mode == SBX_CGROUP_NONE)
		return;
	memset(&tmp, 0, sizeof(tmp));
	cg_make(&tmp, join);
	if (!tmp.cg[0])
		return;
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0) {
		pid = fork();
		if (pid == 0) {
			close(sv[0]);
			spare_main(sv[1], join);
		}
		close(sv[1]);
	}
	for (i = 0; i < 2; i++)
		if (join[i] >= 0)
			close(join[i]);
	if (pid < 0) {
		if (sv[0] >= 0)
			close(sv[0]);
		cg_release(&tmp);
		return;
	}
	spare.pid = pid;
	spare.sock = sv[0];
	memcpy(spare.cg, tmp.cg, sizeof(spare.cg));
}

/* The spare is gone or of no use: let it go; its cgroups are removed once it
 * has left them. */
static void spare_drop(int kill_it)
{
	struct exec tmp;

	if (spare.pid <= 0)
		return;
	if (kill_it)
		kill(spare.pid, SIGKILL);
	close_fd(&spare.sock);
	memset(&tmp, 0, sizeof(tmp));
	memcpy(tmp.cg, spare.cg, sizeof(tmp.cg));
	cg_release(&tmp);
	spare.pid = 0;
	spare.cg[0] = 0;
}

/* Hand the exec `a` (request `payload`) to the spare; returns its pid, or -1
 * (no spare, or it could not take it: fork then). */
static pid_t spare_take(struct exec *e, const struct child_args *a, const uint8_t *payload,
			uint32_t len)
{
	struct spare_hdr h;
	struct iovec iov[2] = {{.iov_base = &h, .iov_len = sizeof(h)},
			       {.iov_base = (void *)payload, .iov_len = len}};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(4 * sizeof(int))];
	} c;
	struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = c.buf};
	struct cmsghdr *cm;
	int src[4] = {a->in_r, a->out_w, a->err_w, a->errpipe_w}, fds[4], i, n = 0;
	pid_t pid = spare.pid;

	if (pid <= 0 || sizeof(h) + len > SPARE_MAX_MSG)
		return -1;
	memset(&h, 0, sizeof(h));
	for (i = 0; i < 4; i++)
		if (src[i] >= 0) {
			h.fdmask |= 1u << i;
			fds[n++] = src[i];
		}
	if (a->pty_name)
		snprintf(h.pty_name, sizeof(h.pty_name), "%s", a->pty_name);
	memset(c.buf, 0, sizeof(c.buf));
	m.msg_controllen = CMSG_SPACE((size_t)n * sizeof(int));
	cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN((size_t)n * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, (size_t)n * sizeof(int));
	if (sendmsg(spare.sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)(sizeof(h) + len)) {
		spare_drop(1);
		return -1;
	}
	memcpy(e->cg, spare.cg, sizeof(e->cg));
	close_fd(&spare.sock);
	spare.pid = 0;
	spare.cg[0] = 0;
	return pid;
}

/* Split `n` NUL-terminated strings from p[0..len); NULL if malformed. */
static char **split_strings(char *p, size_t len, uint32_t n, char **out)
{
	uint32_t i;
	char *end = p + len;

	for (i = 0; i < n; i++) {
		char *z = memchr(p, 0, (size_t)(end - p));

		if (!z)
			return NULL;
		out[i] = p;
		p = z + 1;
	}
	return p == end ? out : NULL;
}

static void handle_exec(uint32_t id, uint8_t *payload, uint32_t len)
{
	struct sbx_exec req;
	struct child_args a;
	static char *strs[SBX_MAX_STRINGS + 3];
	char **argv, **envp;
	struct exec *e = NULL;
	int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, ep_[2] = {-1, -1};
	char pty_name[64];
	unsigned i;
	pid_t pid;

	if (len < sizeof(req))
		return send_error(id, EINVAL, "exec: payload of %u bytes is too short", len);
	memcpy(&req, payload, sizeof(req));
	if (!id)
		return send_error(id, EINVAL, "exec: exec_id 0 is reserved");
	if (find_exec(id))
		return send_error(id, EEXIST, "exec: id %u is in use", id);
	if (req.argc < 1 || req.argc > SBX_MAX_STRINGS || req.envc > SBX_MAX_STRINGS ||
	    req.argc + req.envc > SBX_MAX_STRINGS)
		return send_error(id, EINVAL, "exec: argc %u / envc %u out of range", req.argc,
				  req.envc);
	if (req.flags & ~(SBX_EXEC_STDIN | SBX_EXEC_PTY | SBX_EXEC_GRADER))
		return send_error(id, EINVAL, "exec: unknown flags %#x", req.flags);
	if (!split_strings((char *)payload + sizeof(req), len - sizeof(req), 1 + req.argc + req.envc,
			   strs))
		return send_error(id, EINVAL, "exec: strings do not match argc/envc");
	if (!strs[1][0])
		return send_error(id, EINVAL, "exec: argv[0] is empty");
	for (i = 0; i < SBX_MAX_EXECS; i++)
		if (!execs[i].used) {
			e = &execs[i];
			break;
		}
	if (!e)
		return send_error(id, EAGAIN, "exec: %u execs already running", SBX_MAX_EXECS);
	exec_arrays(&req, strs, &argv, &envp);

	memset(e, 0, sizeof(*e));
	e->out_fd = e->err_fd = e->in_fd = e->errpipe = e->notif = -1;
	memset(&a, 0, sizeof(a));
	a.in_r = a.out_w = a.err_w = -1;
	a.req = &req;
	a.cwd = strs[0];
	a.argv = argv;
	a.envp = envp;
	/* SOCK_SEQPACKET, not a pipe: it also carries the seccomp listener */
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ep_) < 0)
		goto sys_fail;
	if (req.flags & SBX_EXEC_PTY) {
		struct winsize ws = {.ws_row = req.rows ? req.rows : 24, .ws_col = req.cols ? req.cols : 80};
		int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);

		if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0 ||
		    ptsname_r(m, pty_name, sizeof(pty_name)) != 0) {
			if (m >= 0)
				close(m);
			goto sys_fail;
		}
		ioctl(m, TIOCSWINSZ, &ws);
		e->pty = 1;
		e->out_fd = m;
		a.pty_name = pty_name;
	} else {
		if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)
			goto sys_fail;
		if ((req.flags & SBX_EXEC_STDIN) && pipe2(in, O_CLOEXEC) < 0)
			goto sys_fail;
		a.out_w = out[1];
		a.err_w = err[1];
		a.in_r = in[0];
	}
	a.errpipe_w = ep_[1];
	a.join[0] = a.join[1] = -1;
	e->used = 1;
	e->id = id;
	e->t0 = now_ns();
	pid = spare_take(e, &a, payload, len);
	if (pid < 0) {
		cg_make(e, a.join);
		pid = fork();
		if (pid == 0)
			child(&a);
	}
	if (pid < 0) {
		int saved = errno;

		for (i = 0; i < 2; i++)
			if (a.join[i] >= 0)
				close(a.join[i]);
		errno = saved;
		goto sys_fail;
	}
	for (i = 0; i < 2; i++)
		if (a.join[i] >= 0)
			close(a.join[i]);
	e->pid = pid;
	close(ep_[1]);
	e->errpipe = ep_[0];
	if (!e->pty) {
		close(out[1]);
		close(err[1]);
		e->out_fd = out[0];
		e->err_fd = err[0];
		if (in[0] >= 0) {
			close(in[0]);
			e->in_fd = in[1];
		}
	} else if (req.flags & SBX_EXEC_STDIN) {
		e->in_fd = e->out_fd;
	}
	e->stdin_wanted = !!(req.flags & SBX_EXEC_STDIN);
	e->limit = req.output_limit;
	e->window = SBX_WINDOW;
	if (req.timeout_ms)
		/* saturating: a huge timeout must not wrap to a deadline in the past */
		e->deadline = req.timeout_ms > (UINT64_MAX - e->t0) / 1000000ull
				      ? UINT64_MAX
				      : e->t0 + req.timeout_ms * 1000000ull;
	set_nonblock(e->errpipe);
	ep_add(e->errpipe, K_ERRPIPE, slot_of(e), EPOLLIN);
	if (e->out_fd >= 0)
		set_nonblock(e->out_fd);
	if (e->err_fd >= 0)
		set_nonblock(e->err_fd);
	if (e->in_fd >= 0 && !e->pty)
		set_nonblock(e->in_fd);
	interest_dirty = 1;
	return;
sys_fail:
	{
		int saved = errno;

		for (i = 0; i < 2; i++) {
			if (out[i] >= 0)
				close(out[i]);
			if (err[i] >= 0)
				close(err[i]);
			if (in[i] >= 0)
				close(in[i]);
			if (ep_[i] >= 0)
				close(ep_[i]);
		}
		if (e->pty && e->out_fd >= 0)
			close(e->out_fd);
		cg_release(e);
		memset(e, 0, sizeof(*e));
		e->out_fd = e->err_fd = e->in_fd = e->errpipe = e->notif = -1;
		send_error(id, saved, "exec: %s", strerror(saved));
	}
}

static void on_errpipe(struct exec *e)
{
	uint8_t msg[400];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} c;
	struct iovec iov = {.iov_base = msg, .iov_len = sizeof(msg)};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf,
			   .msg_controllen = sizeof(c.buf)};
	struct cmsghdr *cm;
	int fd = -1;
	ssize_t n = recvmsg(e->errpipe, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);

	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	cm = n > 0 ? CMSG_FIRSTHDR(&m) : NULL;
	if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
	    cm->cmsg_len == CMSG_LEN(sizeof(int)))
		memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	if (fd >= 0) {
		if (n == 1 && msg[0] == 'L' && e->notif < 0) {
			e->notif = fd;
			set_nonblock(fd);
			ep_add(fd, K_NOTIF, slot_of(e), EPOLLIN);
		} else {
			close(fd);
		}
		return; /* the exec's start or failure follows */
	}
	close_fd(&e->errpipe);
	if (n <= 0) {
		struct sbx_started st = {.pid = (uint32_t)e->pid};

		e->started = 1;
		send_frame(SBX_STARTED, e->id, &st, sizeof(st), NULL, 0);
		interest_dirty = 1;
		maybe_finish(e, now_ns());
		return;
	}
	e->failed = 1;
	{
		int32_t code = EIO;

		if (n >= 4)
			memcpy(&code, msg, 4);
		send_error(e->id, code, "%.*s", n > 4 ? (int)(n - 4) : 0, (char *)msg + 4);
	}
	exec_close_io(e);
	maybe_finish(e, now_ns());
}

/* GCRA: whether one more event may go out at `now` (and count it if so). */
static int ev_admit(uint64_t now)
{
	uint64_t tat = ev_tat > now ? ev_tat : now;

	if (tat - now > (uint64_t)(EV_BURST - 1) * EV_INTERVAL_NS)
		return 0;
	ev_tat = tat + EV_INTERVAL_NS;
	return 1;
}

/* A denied syscall of the exec's tree: fail it with EPERM at once, then report
 * it.  A workload can raise these in a loop; events beyond what the client
 * takes are dropped and counted (the syscall is denied all the same). */
static void on_notif(struct exec *e, uint32_t events)
{
	struct lfs_seccomp_event sev;
	struct lfs_error err = {0};
	struct sbx_event ev;
	char path[48];
	int i, fd;

	if (!(events & EPOLLIN)) {
		/* EPOLLHUP: no process uses the filter any more */
		close_fd(&e->notif);
		return;
	}
	if (lfs_seccomp_notif_recv(e->notif, &sev, &err) < 0) {
		if (err.code != ENOENT && err.code != EAGAIN && err.code != EINTR)
			close_fd(&e->notif);
		return;
	}
	if (client_fd < 0 || outq_pending() >= OUTQ_HIGH || !ev_admit(now_ns())) {
		lfs_seccomp_notif_deny(e->notif, sev.id, EPERM, &err);
		e->ev_dropped++;
		return;
	}
	memset(&ev, 0, sizeof(ev));
	ev.kind = SBX_EV_SECCOMP;
	ev.pid = sev.pid;
	ev.nr = sev.nr;
	ev.arch = sev.arch;
	ev.ip = sev.ip;
	for (i = 0; i < 6; i++)
		ev.args[i] = sev.args[i];
	/* read before answering: until then the pid cannot be reused */
	snprintf(path, sizeof(path), "/proc/%u/comm", sev.pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, ev.comm, sizeof(ev.comm) - 1);

		if (n > 0 && ev.comm[n - 1] == '\n')
			ev.comm[n - 1] = 0;
		close(fd);
	}
	lfs_seccomp_notif_deny(e->notif, sev.id, EPERM, &err);
	ev.dropped = e->ev_dropped;
	e->ev_dropped = 0;
	send_frame(SBX_EVENT, e->id, &ev, sizeof(ev), NULL, 0);
}

static void on_output(struct exec *e, int which)
{
	int *fd = which == K_OUT ? &e->out_fd : &e->err_fd;
	uint8_t data[SBX_MAX_DATA];
	size_t want = sizeof(data);
	ssize_t n;

	if (e->window <= 0 || outq_pending() >= OUTQ_HIGH) {
		interest_dirty = 1;
		return;
	}
	if ((uint64_t)e->window < want)
		want = (size_t)e->window;
	n = read(*fd, data, want);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) { /* EOF; EIO on a pty master once the slave side is gone */
		if (e->pty && e->in_fd == e->out_fd)
			e->in_fd = -1;
		close_fd(fd);
		maybe_finish(e, now_ns());
		return;
	}
	if (e->limit && e->total + (uint64_t)n > e->limit) {
		n = (ssize_t)(e->limit - e->total);
		if (n > 0)
			send_frame(which == K_OUT ? SBX_STDOUT : SBX_STDERR, e->id, data, (size_t)n,
				   NULL, 0);
		e->total = e->limit;
		if (!e->reason)
			e->reason = SBX_OUTPUT_LIMIT;
		kill_tree(e);
		if (e->pty && e->in_fd == e->out_fd)
			e->in_fd = -1;
		close_fd(&e->out_fd);
		close_fd(&e->err_fd);
		maybe_finish(e, now_ns());
		return;
	}
	e->total += (uint64_t)n;
	e->window -= n;
	send_frame(which == K_OUT ? SBX_STDOUT : SBX_STDERR, e->id, data, (size_t)n, NULL, 0);
	if (e->window <= 0)
		interest_dirty = 1;
}

static void on_stdin_writable(struct exec *e)
{
	while (e->in.len > e->in.off) {
		ssize_t n = write(e->in_fd, e->in.p + e->in.off, e->in.len - e->in.off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n < 0) { /* EPIPE: the process closed its stdin */
			buf_free(&e->in);
			if (!e->pty)
				close_fd(&e->in_fd);
			interest_dirty = 1;
			return;
		}
		e->in.off += (size_t)n;
	}
	e->in.off = e->in.len = 0;
	if (e->stdin_eof) {
		if (e->pty) {
			char eof = 4; /* VEOF in canonical mode */

			(void)!write(e->in_fd, &eof, 1);
			e->stdin_eof = 0;
		} else {
			close_fd(&e->in_fd);
		}
	}
	interest_dirty = 1;
}

static void update_interest(void)
{
	int high = outq_pending() >= OUTQ_HIGH;
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &execs[i];
		uint32_t rd;

		if (!e->used)
			continue;
		rd = (e->started && e->window > 0 && !high) ? EPOLLIN : 0;
		if (e->pty && e->out_fd >= 0) {
			uint32_t wr = (e->in.len > e->in.off) ? EPOLLOUT : 0;

			ep_set(e->out_fd, K_OUT, (int)i, rd | wr);
			continue;
		}
		if (e->out_fd >= 0)
			ep_set(e->out_fd, K_OUT, (int)i, rd);
		if (e->err_fd >= 0)
			ep_set(e->err_fd, K_ERR, (int)i, rd);
		if (e->in_fd >= 0)
			ep_set(e->in_fd, K_IN, (int)i, (e->in.len > e->in.off) ? EPOLLOUT : 0);
	}
	if (client_fd >= 0)
		ep_set(client_fd, K_CLIENT, 0, EPOLLIN | (outq_pending() ? EPOLLOUT : 0));
	interest_dirty = 0;
}

/* ---- client ------------------------------------------------------------ */

static void drop_client(void)
{
	unsigned i;

	close_fd(&client_fd);
	outq.off = outq.len = 0;
	inlen = 0;
	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used || e->orphan)
			continue;
		e->orphan = 1;
		kill_tree(e);
		exec_close_io(e);
		maybe_finish(e, now_ns());
	}
}

static void handle_frame(const struct sbx_hdr *h, uint8_t *p)
{
	struct exec *e;

	if (h->type == SBX_HELLO) {
		struct sbx_hello hello = {.version = SBX_PROTO_VERSION, .cgroup_mode = (uint32_t)cg_mode};
		unsigned i;

		for (i = 0; i < SBX_MAX_EXECS; i++)
			hello.execs += execs[i].used && !execs[i].orphan;
		send_frame(SBX_HELLO_OK, 0, &hello, sizeof(hello), NULL, 0);
		return;
	}
	if (h->type == SBX_EXEC) {
		handle_exec(h->exec_id, p, h->len);
		return;
	}
	if (h->type < SBX_STDIN || h->type > SBX_CREDIT)
		return send_error(h->exec_id, EINVAL, "unknown message type %u", h->type);
	e = find_exec(h->exec_id);
	if (!e && (h->type == SBX_CREDIT || h->type == SBX_STDIN || h->type == SBX_STDIN_EOF))
		return; /* raced with the exec's end: nothing to do */
	if (!e)
		return send_error(h->exec_id, ESRCH, "no exec %u", h->exec_id);
	switch (h->type) {
	case SBX_STDIN:
		if (!h->len || h->len > SBX_MAX_DATA)
			return send_error(h->exec_id, EINVAL, "stdin: %u bytes out of range", h->len);
		if (!e->stdin_wanted || e->in_fd < 0 || e->stdin_eof)
			return; /* the process is gone or closed its stdin: drop, like a pipe */
		if (e->in.len - e->in.off + h->len > STDIN_MAX)
			return send_error(h->exec_id, ENOBUFS, "stdin: more than %u bytes pending",
					  STDIN_MAX);
		if (buf_reserve(&e->in, h->len) < 0)
			return send_error(h->exec_id, ENOMEM, "stdin: out of memory");
		memcpy(e->in.p + e->in.len, p, h->len);
		e->in.len += h->len;
		interest_dirty = 1;
		return;
	case SBX_STDIN_EOF:
		if (h->len)
			return send_error(h->exec_id, EINVAL, "stdin_eof: unexpected payload");
		if (e->in_fd < 0 || !e->stdin_wanted)
			return;
		e->stdin_eof = 1;
		if (e->in.len == e->in.off)
			on_stdin_writable(e);
		return;
	case SBX_SIGNAL: {
		struct sbx_signal s;

		if (h->len != sizeof(s))
			return send_error(h->exec_id, EINVAL, "signal: bad payload size %u", h->len);
		memcpy(&s, p, sizeof(s));
		if (s.sig < 1 || s.sig > 64)
			return send_error(h->exec_id, EINVAL, "signal: %d out of range", s.sig);
		if (!e->reaped && kill(-e->pid, s.sig) < 0)
			kill(e->pid, s.sig);
		return;
	}
	case SBX_RESIZE: {
		struct sbx_resize r;
		struct winsize ws = {0};

		if (h->len != sizeof(r))
			return send_error(h->exec_id, EINVAL, "resize: bad payload size %u", h->len);
		memcpy(&r, p, sizeof(r));
		if (!e->pty || e->out_fd < 0)
			return send_error(h->exec_id, ENOTTY, "resize: exec %u has no pty", h->exec_id);
		ws.ws_row = r.rows;
		ws.ws_col = r.cols;
		ioctl(e->out_fd, TIOCSWINSZ, &ws);
		return;
	}
	case SBX_KILL:
		if (h->len)
			return send_error(h->exec_id, EINVAL, "kill: unexpected payload");
		if (!e->reason)
			e->reason = SBX_KILLED;
		kill_tree(e);
		return;
	case SBX_CREDIT: {
		struct sbx_credit c;

		if (h->len != sizeof(c))
			return send_error(h->exec_id, EINVAL, "credit: bad payload size %u", h->len);
		memcpy(&c, p, sizeof(c));
		if (e->window < (int64_t)64 << 20)
			e->window += c.bytes;
		interest_dirty = 1;
		return;
	}
	}
}

static void on_client_readable(void)
{
	for (;;) {
		size_t off = 0;
		ssize_t n = read(client_fd, inbuf + inlen, sizeof(inbuf) - inlen);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			drop_client();
			return;
		}
		inlen += (size_t)n;
		while (inlen - off >= sizeof(struct sbx_hdr)) {
			struct sbx_hdr h;

			memcpy(&h, inbuf + off, sizeof(h));
			if (h.len > SBX_MAX_PAYLOAD) {
				send_error(h.exec_id, EMSGSIZE, "frame of %u bytes exceeds %u", h.len,
					   SBX_MAX_PAYLOAD);
				flush_client();
				drop_client();
				return;
			}
			if (inlen - off < sizeof(h) + h.len)
				break;
			handle_frame(&h, inbuf + off + sizeof(h));
			off += sizeof(h) + h.len;
			if (client_fd < 0)
				return;
		}
		memmove(inbuf, inbuf + off, inlen - off);
		inlen -= off;
	}
}

static void flush_client(void)
{
	while (client_fd >= 0 && outq_pending()) {
		ssize_t n = send(client_fd, outq.p + outq.off, outq_pending(), MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		if (n < 0) {
			drop_client();
			return;
		}
		outq.off += (size_t)n;
	}
	if (outq.off == outq.len) {
		outq.off = outq.len = 0;
		if (outq.cap > (1u << 20)) { /* give memory back after a burst */
			free(outq.p);
			memset(&outq, 0, sizeof(outq));
		}
	}
	interest_dirty = 1;
}

static void on_accept(void)
{
	int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0)
		return;
	if (client_fd >= 0)
		drop_client(); /* a restarted daemon takes over */
	client_fd = fd;
	ep_add(client_fd, K_CLIENT, 0, EPOLLIN);
}

static void on_sigchld(void)
{
	struct signalfd_siginfo si;
	struct rusage ru;
	int status;
	pid_t pid;
	uint64_t now = now_ns();

	while (read(sig_fd, &si, sizeof(si)) == sizeof(si))
		;
	while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
		unsigned i;

		if (pid == spare.pid) {
			spare_drop(0);
			continue;
		}
		for (i = 0; i < SBX_MAX_EXECS; i++) {
			struct exec *e = &execs[i];

			if (!e->used || e->pid != pid || e->reaped)
				continue;
			e->reaped = 1;
			e->status = status;
			e->ru = ru;
			e->t_end = now;
			e->drain_deadline = now + DRAIN_NS;
			maybe_finish(e, now);
			break;
		}
	}
	if (n_pending_rm)
		cg_retry_pending();
}

static void check_deadlines(uint64_t now)
{
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (e->deadline && now >= e->deadline && !e->reaped) {
			if (!e->reason)
				e->reason = SBX_TIMEOUT;
			e->deadline = 0;
			kill_tree(e);
		}
		if (e->reaped)
			maybe_finish(e, now);
	}
}

static int next_timeout_ms(uint64_t now)
{
	uint64_t next = UINT64_MAX;
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &execs[i];

		if (!e->used)
			continue;
		if (e->deadline && !e->reaped && e->deadline < next)
			next = e->deadline;
		if (e->reaped && e->started && e->drain_deadline < next)
			next = e->drain_deadline;
	}
	if (next == UINT64_MAX)
		return n_pending_rm ? 1000 : -1;
	if (next <= now)
		return 0;
	next = (next - now + 999999) / 1000000;
	return next > INT_MAX ? INT_MAX : (int)next;
}

/* Read a whole policy file (at most `max` bytes) into a new buffer. */
static uint8_t *slurp(int fd, size_t max, size_t *len)
{
	struct stat st;
	uint8_t *p;
	size_t off = 0;

	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
	    (size_t)st.st_size > max) {
		errno = EINVAL;
		return NULL;
	}
	p = malloc((size_t)st.st_size);
	if (!p)
		return NULL;
	while (off < (size_t)st.st_size) {
		ssize_t n = pread(fd, p + off, (size_t)st.st_size - off, (off_t)off);

		if (n <= 0) {
			free(p);
			errno = n < 0 ? errno : EIO;
			return NULL;
		}
		off += (size_t)n;
	}
	*len = off;
	return p;
}

/* A sandbox asked to be confined is never started unconfined: any failure
 * here is fatal, and the spawner reports sbx-init's early exit. */
static int load_policies(int ll_fd, int sc_fd)
{
	struct lfs_error err = {0};

	if (ll_fd >= 0) {
		size_t len;
		uint8_t *blob = slurp(ll_fd, LFS_LL_MAX_BLOB, &len);

		if (!blob) {
			logmsg("sbx-init: read the Landlock ruleset: %s", strerror(errno));
			return -1;
		}
		ll_ruleset = lfs_landlock_prepare(blob, len, &err);
		ll_flags = lfs_landlock_flags(blob, len);
		free(blob);
		close(ll_fd);
		if (ll_ruleset < 0) {
			logmsg("sbx-init: Landlock: %s", err.msg);
			return -1;
		}
	}
	if (sc_fd >= 0) {
		sc_prog = slurp(sc_fd, 4096 * 8, &sc_len);
		close(sc_fd);
		if (!sc_prog) {
			logmsg("sbx-init: read the seccomp program: %s", strerror(errno));
			return -1;
		}
	}
	return 0;
}

static int parse_fd(const char *s)
{
	char *end;
	long v = strtol(s, &end, 10);

	if (*end || v < 0 || v > INT_MAX)
		return -1;
	fcntl((int)v, F_SETFD, FD_CLOEXEC);
	return (int)v;
}

/* The spawner left CAP_SYS_ADMIN inheritable so that this program, exec'd as
 * root, got it; nothing exec'd from here may. */
static int drop_inheritable(void)
{
	struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
	struct __user_cap_data_struct data[2];

	if (syscall(SYS_capget, &hdr, data) < 0)
		goto fail;
	data[0].inheritable = data[1].inheritable = 0;
	if (syscall(SYS_capset, &hdr, data) < 0)
		goto fail;
	return 0;
fail:
	logmsg("sbx-init: drop inheritable capabilities: %s", strerror(errno));
	return -1;
}

int main(int argc, char **argv)
{
	struct epoll_event evs[64];
	sigset_t mask;
	unsigned i;
	int opt;

	int ll_fd = -1, sc_fd = -1;

	while ((opt = getopt(argc, argv, "l:f:m:u:L:S:U:A:P:G:")) != -1) {
		switch (opt) {
		case 'l': listen_fd = parse_fd(optarg); break;
		case 'f': cg_freezer = parse_fd(optarg); break;
		case 'm': cg_memory = parse_fd(optarg); break;
		case 'u': cg_v2 = parse_fd(optarg); break;
		case 'L': ll_fd = parse_fd(optarg); break;
		case 'S': sc_fd = parse_fd(optarg); break;
		case 'U': parse_fd(optarg); break; /* kept open, close-on-exec */
		case 'A': aa_profile = optarg; break;
		case 'P': pristine_fd = parse_fd(optarg); break;
		case 'G': grader_paths = optarg; break;
		default:
			logmsg("usage: sbx-init -l LISTEN_FD [-f FREEZER_FD -m MEMORY_FD | -u V2_FD] "
			       "[-L LANDLOCK_FD] [-S SECCOMP_FD] [-U SCRATCH_FD] [-A PROFILE] "
			       "[-P PRISTINE_FD -G PATHS]");
			return 2;
		}
	}
	if (load_policies(ll_fd, sc_fd) < 0)
		return 1;
	if (pristine_fd >= 0 && drop_inheritable() < 0)
		return 1; /* fail closed: an exec could inherit CAP_SYS_ADMIN */
	if (listen_fd < 0) {
		logmsg("sbx-init: -l LISTEN_FD is required");
		return 2;
	}
	if (cg_v2 >= 0)
		cg_mode = SBX_CGROUP_V2;
	else if (cg_freezer >= 0)
		cg_mode = SBX_CGROUP_V1;
	/* Not dumpable: /proc/1/{mem,fd,...} need ptrace rights over a
	 * non-dumpable task, which the workload's capabilities are checked
	 * against (tightened further by the confinement layer). */
	prctl(PR_SET_DUMPABLE, 0);
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	ep = epoll_create1(EPOLL_CLOEXEC);
	if (sig_fd < 0 || ep < 0) {
		logmsg("sbx-init: signalfd/epoll: %s", strerror(errno));
		return 1;
	}
	if (listen(listen_fd, 8) < 0) {
		logmsg("sbx-init: listen: %s", strerror(errno));
		return 1;
	}
	set_nonblock(listen_fd);
	for (i = 0; i < SBX_MAX_EXECS; i++)
		execs[i].out_fd = execs[i].err_fd = execs[i].in_fd = execs[i].errpipe =
			execs[i].notif = -1;
	ep_add(listen_fd, K_LISTEN, 0, EPOLLIN);
	ep_add(sig_fd, K_SIG, 0, EPOLLIN);
	spare_make();
	for (;;) {
		uint64_t now = now_ns();
		int n, k;

		if (interest_dirty)
			update_interest();
		n = epoll_wait(ep, evs, 64, next_timeout_ms(now));
		if (n < 0 && errno != EINTR) {
			logmsg("sbx-init: epoll_wait: %s", strerror(errno));
			sleep(1);
		}
		for (k = 0; k < n; k++) {
			int kind = (int)(evs[k].data.u64 & 0xff);
			struct exec *e = &execs[(evs[k].data.u64 >> 8) % SBX_MAX_EXECS];

			switch (kind) {
			case K_LISTEN: on_accept(); break;
			case K_SIG: on_sigchld(); break;
			case K_CLIENT:
				if (client_fd < 0)
					break;
				if (evs[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR))
					on_client_readable();
				if (client_fd >= 0 && (evs[k].events & EPOLLOUT))
					flush_client();
				break;
			case K_ERRPIPE:
				if (e->used && e->errpipe >= 0)
					on_errpipe(e);
				break;
			case K_NOTIF:
				if (e->used && e->notif >= 0)
					on_notif(e, evs[k].events);
				break;
			case K_OUT:
				if (!e->used || e->out_fd < 0)
					break;
				if (e->pty && (evs[k].events & EPOLLOUT) && e->in_fd >= 0)
					on_stdin_writable(e);
				if (e->out_fd >= 0 && (evs[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
					on_output(e, K_OUT);
				break;
			case K_ERR:
				if (e->used && e->err_fd >= 0)
					on_output(e, K_ERR);
				break;
			case K_IN:
				if (e->used && e->in_fd >= 0)
					on_stdin_writable(e);
				break;
			}
		}
		check_deadlines(now_ns());
		if (outq_pending())
			flush_client();
	}
}
