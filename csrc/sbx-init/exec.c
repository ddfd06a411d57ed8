/* An exec's life: SBX_EXEC starts it (a child forked, or the spare woken),
 * its output is read with per-exec flow control (SBX_CREDIT) and a node-wide
 * high-water mark on the outgoing queue, its stdin is buffered, its denied
 * syscalls are answered and reported, and SBX_END goes out exactly once, after
 * all of its output, when its main process has been reaped and its pipes are
 * closed (or a short grace has passed: background processes may hold them;
 * what the main process itself wrote is read first, see held). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "lfs_confine.h"
#include "sbx-init.h"

/* Denied syscalls sent to the daemon one by one: at most EV_RATE per second after a
 * burst of EV_BURST, per sandbox (half the 200 a second the daemon's ledger keeps, which
 * leaves room for its other events).  A workload
 * that loops on a denied syscall costs the daemon nothing beyond that: the rest are only
 * counted here (and reported as `dropped`), their syscalls denied all the same. */
#define EV_RATE 100u
#define EV_BURST 100u
#define EV_INTERVAL_NS (1000000000ull / EV_RATE)

static void exec_reset(struct exec *e)
{
	memset(e, 0, sizeof(*e));
	e->out_fd = e->err_fd = e->in_fd = e->errpipe = e->notif = -1;
}

void exec_init_slots(struct sbx *s)
{
	for (unsigned i = 0; i < SBX_MAX_EXECS; i++)
		exec_reset(&s->execs[i]);
}

static struct exec *find_exec(struct sbx *s, uint32_t id)
{
	unsigned i;

	if (!id)
		return NULL;
	for (i = 0; i < SBX_MAX_EXECS; i++)
		if (s->execs[i].used && s->execs[i].id == id && !s->execs[i].orphan)
			return &s->execs[i];
	return NULL;
}

static int slot_of(struct sbx *s, struct exec *e)
{
	return (int)(e - s->execs);
}

unsigned exec_count(const struct sbx *s)
{
	unsigned i, n = 0;

	for (i = 0; i < SBX_MAX_EXECS; i++)
		n += s->execs[i].used && !s->execs[i].orphan;
	return n;
}

static void exec_close_io(struct sbx *s, struct exec *e)
{
	if (e->pty && e->in_fd == e->out_fd)
		e->in_fd = -1;
	ep_close(s, &e->out_fd);
	ep_close(s, &e->err_fd);
	ep_close(s, &e->in_fd);
	ep_close(s, &e->errpipe);
	ep_close(s, &e->notif);
	buf_free(&e->in);
}

static void exec_free(struct sbx *s, struct exec *e)
{
	exec_close_io(s, e);
	cg_release(&s->cg, e->cg);
	exec_reset(e);
}

/* The fields of /proc/<pid>/stat after the command name (proc_pid_stat(5): the name may
 * hold any byte but the last ")"), read into buf; NULL if the process is gone. */
static const char *proc_stat(long pid, char *buf, size_t size)
{
	char path[64], *rp;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return NULL;
	n = read(fd, buf, size - 1);
	close(fd);
	if (n <= 0)
		return NULL;
	buf[n] = 0;
	rp = strrchr(buf, ')');
	return rp && rp[1] ? rp + 2 : NULL;
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
		char stat[512];
		long pid = strtol(d->d_name, NULL, 10);
		const char *f = pid > 1 ? proc_stat(pid, stat, sizeof(stat)) : NULL;
		int pgrp, session;

		if (f && sscanf(f, "%*c %*d %d %d", &pgrp, &session) == 2 && session == sid)
			kill((pid_t)pid, SIGKILL);
	}
	closedir(dir);
}

static void kill_tree(struct sbx *s, struct exec *e)
{
	if (!e->reaped && e->pid > 0) {
		kill(-e->pid, SIGKILL);
		kill(e->pid, SIGKILL);
	}
	if (cg_kill(&s->cg, e->cg) == 0)
		return;
	if (e->pid > 0)
		sweep_session(e->pid);
}

/* A guest's upper disk, full at this exec's end: only the guest sees it (what
 * its page cache holds is not yet in the host's file). */
static void check_upper(struct sbx *s, struct exec *e)
{
	struct statfs st;
	int full;

	if (s->pol.upper_fd < 0 || fstatfs(s->pol.upper_fd, &st) < 0)
		return;
	full = st.f_bavail == 0 || (st.f_files > 0 && st.f_ffree == 0);
	if (full && !s->pol.upper_full && ctl_connected(s)) {
		struct sbx_event ev = {.kind = SBX_EV_DISK_FULL,
				       .args = {(uint64_t)st.f_blocks * (uint64_t)st.f_bsize}};

		ctl_send(s, SBX_EVENT, e->id, &ev, sizeof(ev), NULL, 0);
	}
	s->pol.upper_full = full;
}

static void exec_finish(struct sbx *s, struct exec *e)
{
	struct sbx_end end = {.exit_code = -1};
	uint64_t peak = (uint64_t)e->ru.ru_maxrss * 1024u;
	/* The sandbox's OOM killer struck while this exec ran and its main
	 * process died of SIGKILL (or was a shell whose child did: 128 + 9).
	 * Counted per sandbox, see cgroup.c: an exec ending so while another
	 * exec of the sandbox was the one OOM-killed is reported oom too. */
	int killed = (WIFSIGNALED(e->status) && WTERMSIG(e->status) == SIGKILL) ||
		     (WIFEXITED(e->status) && WEXITSTATUS(e->status) == 128 + SIGKILL);
	int oom = killed && cg_oom_kills(&s->cg) > e->oom_base;

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
	if (e->ev_dropped && ctl_connected(s)) {
		/* the denials not reported one by one, before the exec's end */
		struct sbx_event ev = {.kind = SBX_EV_DROPPED, .dropped = e->ev_dropped};

		ctl_send(s, SBX_EVENT, e->id, &ev, sizeof(ev), NULL, 0);
		e->ev_dropped = 0;
	}
	check_upper(s, e);
	ctl_send(s, SBX_END, e->id, &end, sizeof(end), NULL, 0);
	exec_free(s, e);
	s->interest_dirty = 1;
	/* The next exec's spare, now that this exec's cgroups are gone: while the
	 * spare moves into its own it holds the cgroup mutex for a grace period,
	 * which would stall the rmdir above.  END goes out first. */
	ctl_flush(s);
	spare_note_use(s, now_ns());
	spare_make(s);
}

static ssize_t read_output(struct sbx *s, struct exec *e, int which);

/* Read what the output fds held when the main process was reaped, as far as
 * flow control lets us now. */
static void drain_held(struct sbx *s, struct exec *e)
{
	int k;

	for (k = 0; k < 2; k++)
		while (e->held[k] && read_output(s, e, k ? K_ERR : K_OUT) > 0)
			;
}

static void maybe_finish(struct sbx *s, struct exec *e, uint64_t now)
{
	if (!e->used || !e->reaped)
		return;
	if (e->failed || e->orphan) {
		exec_free(s, e);
		return;
	}
	if (!e->started)
		return; /* the error pipe tells first */
	if (e->out_fd >= 0 || e->err_fd >= 0) {
		if (now < e->drain_deadline)
			return;
		/* Background processes may hold the pipes open for ever: after a
		 * short grace, end once everything the main process wrote is read.
		 * The grace is wall time and sbx-init runs in the sandbox's CPU
		 * quota: throttled, it may not have read a byte of it yet. */
		drain_held(s, e);
		if (e->held[0] || e->held[1]) {
			e->drain_deadline = now + DRAIN_NS; /* held back by flow control */
			return;
		}
	}
	exec_finish(s, e);
}

/* The client that started them is gone: kill every exec's tree (no END). */
void exec_orphan_all(struct sbx *s)
{
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &s->execs[i];

		if (!e->used || e->orphan)
			continue;
		e->orphan = 1;
		kill_tree(s, e);
		exec_close_io(s, e);
		maybe_finish(s, e, now_ns());
	}
}

void exec_start(struct sbx *s, uint32_t id, uint8_t *payload, uint32_t len)
{
	struct sbx_exec req;
	struct child_args a;
	static char *strs[SBX_MAX_STRINGS + 3];
	char **argv, **envp;
	struct exec *e = NULL;
	int out[2] = {-1, -1}, err[2] = {-1, -1}, in[2] = {-1, -1}, ep_[2] = {-1, -1};
	const char *what = "";
	char pty_name[64];
	unsigned i;
	pid_t pid;

	if (len < sizeof(req))
		return ctl_error(s, id, EINVAL, "exec: payload of %u bytes is too short", len);
	memcpy(&req, payload, sizeof(req));
	if (!id)
		return ctl_error(s, id, EINVAL, "exec: exec_id 0 is reserved");
	if (find_exec(s, id))
		return ctl_error(s, id, EEXIST, "exec: id %u is in use", id);
	if (req.argc < 1 || req.argc > SBX_MAX_STRINGS || req.envc > SBX_MAX_STRINGS ||
	    req.argc + req.envc > SBX_MAX_STRINGS)
		return ctl_error(s, id, EINVAL, "exec: argc %u / envc %u out of range", req.argc,
				 req.envc);
	if (req.flags & ~(SBX_EXEC_STDIN | SBX_EXEC_PTY | SBX_EXEC_GRADER))
		return ctl_error(s, id, EINVAL, "exec: unknown flags %#x", req.flags);
	if (!split_strings((char *)payload + sizeof(req), len - sizeof(req),
			   1 + req.argc + req.envc, strs))
		return ctl_error(s, id, EINVAL, "exec: strings do not match argc/envc");
	if (!strs[1][0])
		return ctl_error(s, id, EINVAL, "exec: argv[0] is empty");
	for (i = 0; i < SBX_MAX_EXECS; i++)
		if (!s->execs[i].used) {
			e = &s->execs[i];
			break;
		}
	if (!e)
		return ctl_error(s, id, EAGAIN, "exec: %u execs already running", SBX_MAX_EXECS);
	exec_arrays(&req, strs, &argv, &envp);

	exec_reset(e);
	memset(&a, 0, sizeof(a));
	a.in_r = a.out_w = a.err_w = -1;
	a.req = &req;
	a.cwd = strs[0];
	a.argv = argv;
	a.envp = envp;
	/* SOCK_SEQPACKET, not a pipe: it also carries the seccomp listener */
	what = "socketpair";
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ep_) < 0)
		goto sys_fail;
	if (req.flags & SBX_EXEC_PTY) {
		struct winsize ws = {.ws_row = req.rows ? req.rows : 24,
				     .ws_col = req.cols ? req.cols : 80};
		int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC), rc = 0;

		what = "posix_openpt";
		if (m >= 0) {
			what = "grantpt";
			rc = grantpt(m);
		}
		if (m >= 0 && rc == 0) {
			what = "unlockpt";
			rc = unlockpt(m);
		}
		if (m >= 0 && rc == 0) {
			what = "ptsname_r";
			rc = ptsname_r(m, pty_name, sizeof(pty_name));
			if (rc > 0)
				errno = rc;
		}
		if (m >= 0 && rc == 0) {
			what = "ioctl(TIOCSWINSZ)";
			rc = ioctl(m, TIOCSWINSZ, &ws);
		}
		if (m < 0 || rc != 0) {
			if (m >= 0) {
				int saved = errno;

				close(m);
				errno = saved;
			}
			goto sys_fail;
		}
		e->pty = 1;
		e->out_fd = m;
		a.pty_name = pty_name;
	} else {
		what = "pipe2";
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
	e->oom_base = cg_oom_kills(&s->cg);
	spare_note_use(s, e->t0);
	pid = spare_take(s, e, &a, payload, len);
	if (pid < 0) {
		cg_make(&s->cg, e->cg, a.join);
		pid = cg_fork(&s->cg, e->cg, a.join);
		if (pid == 0)
			child_run(&s->pol, &a);
	}
	if (pid < 0) {
		int saved = errno;

		for (i = 0; i < 2; i++)
			if (a.join[i] >= 0)
				close(a.join[i]);
		errno = saved;
		what = "fork";
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
	ep_add(s, e->errpipe, K_ERRPIPE, slot_of(s, e), EPOLLIN);
	if (e->out_fd >= 0)
		set_nonblock(e->out_fd);
	if (e->err_fd >= 0)
		set_nonblock(e->err_fd);
	if (e->in_fd >= 0 && !e->pty)
		set_nonblock(e->in_fd);
	s->interest_dirty = 1;
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
		cg_release(&s->cg, e->cg);
		exec_reset(e);
		ctl_error(s, id, saved, "exec: %s: %s", what, strerror(saved));
	}
}

void exec_on_errpipe(struct sbx *s, struct exec *e)
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
			ep_add(s, fd, K_NOTIF, slot_of(s, e), EPOLLIN);
		} else {
			close(fd);
		}
		return; /* the exec's start or failure follows */
	}
	if (n == 1 && msg[0] == 'X') {
		e->execd = 1;
		return; /* EOF follows at execve (close-on-exec), or the failure */
	}
	ep_close(s, &e->errpipe);
	if (n <= 0 && !e->execd && e->reason) {
		/* Its timeout passed (or a KILL / KILL_ALL came) before the program
		 * started: under CPU pressure the child may not reach execve within
		 * a short timeout.  That is the exec's end, for the reason that
		 * killed it, not a failure to start: STARTED, then END. */
		e->execd = 1;
	}
	if (n <= 0 && !e->execd) {
		e->failed = 1;
		kill_tree(s, e);
		ctl_error(s, e->id, ECHILD, "exec: its process ended before it could start the "
			  "program (killed, or out of memory)");
		exec_close_io(s, e);
		maybe_finish(s, e, now_ns());
		return;
	}
	if (n <= 0) {
		struct sbx_started st = {.pid = (uint32_t)e->pid};

		e->started = 1;
		ctl_send(s, SBX_STARTED, e->id, &st, sizeof(st), NULL, 0);
		s->interest_dirty = 1;
		maybe_finish(s, e, now_ns());
		return;
	}
	e->failed = 1;
	{
		int32_t code = EIO;

		if (n >= 4)
			memcpy(&code, msg, 4);
		ctl_error(s, e->id, code, "%.*s", n > 4 ? (int)(n - 4) : 0, (char *)msg + 4);
	}
	exec_close_io(s, e);
	maybe_finish(s, e, now_ns());
}

/* GCRA: whether one more event may go out at `now` (and count it if so). */
static int ev_admit(struct sbx *s, uint64_t now)
{
	uint64_t tat = s->ev_tat > now ? s->ev_tat : now;

	if (tat - now > (uint64_t)(EV_BURST - 1) * EV_INTERVAL_NS)
		return 0;
	s->ev_tat = tat + EV_INTERVAL_NS;
	return 1;
}

/* A denied syscall of the exec's tree: fail it with EPERM at once, then report
 * it.  A workload can raise these in a loop; events beyond what the client
 * takes are dropped and counted (the syscall is denied all the same). */
void exec_on_notif(struct sbx *s, struct exec *e, uint32_t events)
{
	struct lfs_seccomp_event sev;
	struct lfs_error err = {0};
	struct sbx_event ev;
	char path[48];
	int i, fd;

	if (!(events & EPOLLIN)) {
		/* EPOLLHUP: no process uses the filter any more */
		ep_close(s, &e->notif);
		return;
	}
	if (lfs_seccomp_notif_recv(e->notif, &sev, &err) < 0) {
		if (err.code != ENOENT && err.code != EAGAIN && err.code != EINTR)
			ep_close(s, &e->notif);
		return;
	}
	if (!ctl_connected(s) || ctl_pending(s) >= OUTQ_HIGH || !ev_admit(s, now_ns())) {
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
	ctl_send(s, SBX_EVENT, e->id, &ev, sizeof(ev), NULL, 0);
}

static void close_output(struct sbx *s, struct exec *e, int k)
{
	if (!k && e->pty && e->in_fd == e->out_fd)
		e->in_fd = -1;
	ep_close(s, k ? &e->err_fd : &e->out_fd);
	e->held[k] = 0;
}

/* One read of an exec's stdout (K_OUT) or stderr (K_ERR) into frames.
 * Returns the bytes read; 0 once the fd is closed (EOF, or the output limit);
 * -1 if there is nothing to read now or flow control holds it back. */
static ssize_t read_output(struct sbx *s, struct exec *e, int which)
{
	int k = which == K_ERR, *fd = k ? &e->err_fd : &e->out_fd;
	uint8_t data[SBX_MAX_DATA];
	size_t want = sizeof(data);
	ssize_t n;

	if (*fd < 0)
		return 0;
	if (e->window <= 0 || ctl_pending(s) >= OUTQ_HIGH) {
		s->interest_dirty = 1;
		return -1;
	}
	if ((uint64_t)e->window < want)
		want = (size_t)e->window;
	do
		n = read(*fd, data, want);
	while (n < 0 && errno == EINTR);
	if (n < 0 && errno == EAGAIN) {
		e->held[k] = 0; /* all the main process wrote has been read */
		return -1;
	}
	if (n <= 0) { /* EOF; EIO on a pty master once the slave side is gone */
		close_output(s, e, k);
		return 0;
	}
	e->held[k] -= (uint64_t)n < e->held[k] ? (uint64_t)n : e->held[k];
	if (e->limit && e->total + (uint64_t)n > e->limit) {
		n = (ssize_t)(e->limit - e->total);
		if (n > 0)
			ctl_send(s, which == K_OUT ? SBX_STDOUT : SBX_STDERR, e->id, data, (size_t)n,
				 NULL, 0);
		e->total = e->limit;
		if (!e->reason)
			e->reason = SBX_OUTPUT_LIMIT;
		kill_tree(s, e);
		close_output(s, e, 0);
		close_output(s, e, 1);
		return 0;
	}
	e->total += (uint64_t)n;
	e->window -= n;
	ctl_send(s, which == K_OUT ? SBX_STDOUT : SBX_STDERR, e->id, data, (size_t)n, NULL, 0);
	if (e->window <= 0)
		s->interest_dirty = 1;
	return n;
}

void exec_on_output(struct sbx *s, struct exec *e, int which)
{
	if (read_output(s, e, which) == 0)
		maybe_finish(s, e, now_ns());
}

void exec_on_stdin_writable(struct sbx *s, struct exec *e)
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
				ep_close(s, &e->in_fd);
			s->interest_dirty = 1;
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
			ep_close(s, &e->in_fd);
		}
	}
	s->interest_dirty = 1;
}

void exec_update_interest(struct sbx *s)
{
	int high = ctl_pending(s) >= OUTQ_HIGH;
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &s->execs[i];
		uint32_t rd;

		if (!e->used)
			continue;
		rd = (e->started && e->window > 0 && !high) ? EPOLLIN : 0;
		if (e->pty && e->out_fd >= 0) {
			uint32_t wr = (e->in.len > e->in.off) ? EPOLLOUT : 0;

			ep_set(s, e->out_fd, K_OUT, (int)i, rd | wr);
			continue;
		}
		if (e->out_fd >= 0)
			ep_set(s, e->out_fd, K_OUT, (int)i, rd);
		if (e->err_fd >= 0)
			ep_set(s, e->err_fd, K_ERR, (int)i, rd);
		if (e->in_fd >= 0)
			ep_set(s, e->in_fd, K_IN, (int)i, (e->in.len > e->in.off) ? EPOLLOUT : 0);
	}
}

/* The messages about a running exec: SBX_STDIN .. SBX_CREDIT (checked by the caller). */
void exec_message(struct sbx *s, const struct sbx_hdr *h, const uint8_t *p)
{
	struct exec *e = find_exec(s, h->exec_id);

	if (!e && (h->type == SBX_CREDIT || h->type == SBX_STDIN || h->type == SBX_STDIN_EOF))
		return; /* raced with the exec's end: nothing to do */
	if (!e)
		return ctl_error(s, h->exec_id, ESRCH, "no exec %u", h->exec_id);
	switch (h->type) {
	case SBX_STDIN:
		if (!h->len || h->len > SBX_MAX_DATA)
			return ctl_error(s, h->exec_id, EINVAL, "stdin: %u bytes out of range",
					 h->len);
		if (!e->stdin_wanted || e->in_fd < 0 || e->stdin_eof)
			return; /* the process is gone or closed its stdin: drop, like a pipe */
		if (e->in.len - e->in.off + h->len > STDIN_MAX)
			return ctl_error(s, h->exec_id, ENOBUFS,
					 "stdin: more than %u bytes pending", STDIN_MAX);
		if (buf_reserve(&e->in, h->len) < 0)
			return ctl_error(s, h->exec_id, ENOMEM, "stdin: out of memory");
		memcpy(e->in.p + e->in.len, p, h->len);
		e->in.len += h->len;
		s->interest_dirty = 1;
		return;
	case SBX_STDIN_EOF:
		if (h->len)
			return ctl_error(s, h->exec_id, EINVAL, "stdin_eof: unexpected payload");
		if (e->in_fd < 0 || !e->stdin_wanted)
			return;
		e->stdin_eof = 1;
		if (e->in.len == e->in.off)
			exec_on_stdin_writable(s, e);
		return;
	case SBX_SIGNAL: {
		struct sbx_signal sg;

		if (h->len != sizeof(sg))
			return ctl_error(s, h->exec_id, EINVAL, "signal: bad payload size %u",
					 h->len);
		memcpy(&sg, p, sizeof(sg));
		if (sg.sig < 1 || sg.sig > 64)
			return ctl_error(s, h->exec_id, EINVAL, "signal: %d out of range", sg.sig);
		if (!e->reaped && kill(-e->pid, sg.sig) < 0)
			kill(e->pid, sg.sig);
		return;
	}
	case SBX_RESIZE: {
		struct sbx_resize r;
		struct winsize ws = {0};

		if (h->len != sizeof(r))
			return ctl_error(s, h->exec_id, EINVAL, "resize: bad payload size %u",
					 h->len);
		memcpy(&r, p, sizeof(r));
		if (!e->pty || e->out_fd < 0)
			return ctl_error(s, h->exec_id, ENOTTY, "resize: exec %u has no pty",
					 h->exec_id);
		ws.ws_row = r.rows;
		ws.ws_col = r.cols;
		if (ioctl(e->out_fd, TIOCSWINSZ, &ws) < 0)
			return ctl_error(s, h->exec_id, errno, "resize: ioctl(TIOCSWINSZ): %s",
					 strerror(errno));
		return;
	}
	case SBX_KILL:
		if (h->len)
			return ctl_error(s, h->exec_id, EINVAL, "kill: unexpected payload");
		if (!e->reason)
			e->reason = SBX_KILLED;
		kill_tree(s, e);
		return;
	case SBX_CREDIT: {
		struct sbx_credit c;

		if (h->len != sizeof(c))
			return ctl_error(s, h->exec_id, EINVAL, "credit: bad payload size %u",
					 h->len);
		memcpy(&c, p, sizeof(c));
		if (e->window < (int64_t)64 << 20)
			e->window += c.bytes;
		s->interest_dirty = 1;
		return;
	}
	}
}

/* At the main process's reaping: what its output fds hold is all it wrote
 * (a write to a pipe is complete when it returns).  A pty's output may still
 * be in the tty layer's flip buffers, which FIONREAD does not count: bounded
 * by PTY_SLACK, and in practice ended by the first EAGAIN (see held). */
static void note_held(struct exec *e)
{
	int k;

	for (k = 0; k < 2; k++) {
		int fd = k ? e->err_fd : e->out_fd, n = 0;

		e->held[k] = 0;
		if (fd < 0)
			continue;
		if (ioctl(fd, FIONREAD, &n) < 0 || n < 0)
			n = PTY_SLACK;
		e->held[k] = (uint64_t)n + (e->pty ? PTY_SLACK : 0);
	}
}

/* The tasks of /proc but us and kernel threads: *alive (not yet zombies) and
 * *zombies (dead, not yet reaped: a zombie still holds its pid, and its charge in
 * the pids cgroup, until its parent, or we, reap it). */
static void count_tasks(uint64_t *alive, uint64_t *zombies)
{
	struct dirent *d;
	DIR *dir = opendir("/proc");

	*alive = *zombies = 0;
	if (!dir)
		return;
	while ((d = readdir(dir))) {
		char stat[512], state;
		long pid = strtol(d->d_name, NULL, 10);
		const char *f = pid > 0 && pid != getpid() ? proc_stat(pid, stat, sizeof(stat))
							    : NULL;
		unsigned flags;

		/* state, ppid, pgrp, session, tty_nr, tpgid, flags */
		if (!f || sscanf(f, "%c %*d %*d %*d %*d %*d %u", &state, &flags) != 2)
			continue;
		if (flags & 0x00200000u /* PF_KTHREAD */)
			continue;
		if (state == 'Z' || state == 'X')
			(*zombies)++;
		else
			(*alive)++;
	}
	closedir(dir);
}

/* Reap every child that has ended (each one's exec, the spare, an orphan). */
void exec_reap(struct sbx *s)
{
	struct rusage ru;
	int status;
	pid_t pid;

	while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0)
		exec_on_reaped(s, pid, status, &ru);
	if (s->cg.n_pending_rm)
		cg_retry_pending(&s->cg);
}

/* How long SBX_KILL_ALL waits for the killed tasks to be gone. */
#define KILL_ALL_NS (10ull * 1000000000ull)

/* SBX_KILL_ALL: every process of the sandbox but sbx-init; running execs end KILLED.
 * DONE is sent once they are gone, reaped included (or after KILL_ALL_NS): a
 * zombie holds its place in the pids limit, and an exec started right after
 * the DONE would otherwise have its fork refused (seen at load 70-100). */
void exec_kill_all(struct sbx *s, uint32_t id)
{
	struct sbx_done done = {0};
	uint64_t deadline = now_ns() + KILL_ALL_NS, alive, zombies;
	unsigned i, pass;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &s->execs[i];

		if (e->used && !e->reaped && !e->orphan && !e->reason)
			e->reason = SBX_KILLED;
	}
	if (getpid() != 1) {
		/* Not a pid namespace's init (run by hand, or by tests): kill(-1) would
		 * reach the host's processes.  Each exec's tree instead. */
		for (i = 0; i < SBX_MAX_EXECS; i++) {
			struct exec *e = &s->execs[i];

			if (e->used && !e->orphan) {
				kill_tree(s, e);
				done.count++;
			}
		}
		ctl_send(s, SBX_DONE, id, &done, sizeof(done), NULL, 0);
		return;
	}
	/* kill(-1) signals every process of the namespace but the caller, walking the
	 * task list under its lock, so that none forks in between (a task with SIGKILL
	 * pending forks no more); repeated while /proc lists one that is still dying.
	 * Then every zombie is reaped: ours here, the others' once their parents are
	 * gone (they are then ours: we are the namespace's reaper). */
	for (pass = 0;; pass++) {
		exec_reap(s);
		count_tasks(&alive, &zombies);
		if (!pass)
			done.count = alive;
		if (!alive && !zombies)
			break;
		if (now_ns() >= deadline) {
			logmsg("sbx-init: kill all: %llu alive and %llu zombies left after %llu s",
			       (unsigned long long)alive, (unsigned long long)zombies,
			       KILL_ALL_NS / 1000000000ull);
			break;
		}
		if (alive && kill(-1, SIGKILL) < 0 && errno != ESRCH)
			logmsg("sbx-init: kill all: %s", strerror(errno));
		usleep(pass < 20 ? 500 : 5000);
	}
	ctl_send(s, SBX_DONE, id, &done, sizeof(done), NULL, 0);
}

/* A child ended: the spare, an exec's main process, or one of the orphans
 * that sbx-init, as PID 1, reaps. */
void exec_on_reaped(struct sbx *s, pid_t pid, int status, const struct rusage *ru)
{
	uint64_t now = now_ns();
	unsigned i;

	if (pid == s->spare.pid) {
		spare_drop(s, 0);
		return;
	}
	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &s->execs[i];

		if (!e->used || e->pid != pid || e->reaped)
			continue;
		e->reaped = 1;
		e->status = status;
		e->ru = *ru;
		e->t_end = now;
		e->drain_deadline = now + DRAIN_NS;
		note_held(e);
		maybe_finish(s, e, now);
		break;
	}
}

void exec_check_deadlines(struct sbx *s, uint64_t now)
{
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		struct exec *e = &s->execs[i];

		if (!e->used)
			continue;
		if (e->deadline && now >= e->deadline && !e->reaped) {
			if (!e->reason)
				e->reason = SBX_TIMEOUT;
			e->deadline = 0;
			kill_tree(s, e);
		}
		if (e->reaped)
			maybe_finish(s, e, now);
	}
}

/* epoll_wait's timeout: the next deadline or drain, or -1 (none).  An exec
 * cgroup still busy when its exec ended (a background process in it) is no
 * reason to wake: it can only empty when its last process exits, and that
 * process's exit is a SIGCHLD here (sbx-init is the parent of every exec's
 * child and the reaper of every orphan: no process of the sandbox can leave
 * its exec cgroup), which retries the removal (on_sigchld), as does any other
 * wake (the main loop).  An idle sandbox
 * must not run at all: each wake costs CPU times the sandboxes on the node,
 * and faults back in pages its reclaim put in swap. */
int exec_next_timeout_ms(const struct sbx *s, uint64_t now)
{
	uint64_t next = UINT64_MAX;
	unsigned i;

	for (i = 0; i < SBX_MAX_EXECS; i++) {
		const struct exec *e = &s->execs[i];

		if (!e->used)
			continue;
		if (e->deadline && !e->reaped && e->deadline < next)
			next = e->deadline;
		if (e->reaped && e->started && e->drain_deadline < next)
			next = e->drain_deadline;
	}
	if (next == UINT64_MAX)
		return -1;
	if (next <= now)
		return 0;
	next = (next - now + 999999) / 1000000;
	return next > INT_MAX ? INT_MAX : (int)next;
}
