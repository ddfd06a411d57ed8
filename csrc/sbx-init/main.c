/* sbx-init: PID 1 of a sandbox.
 *
 * Reaps every process that ends up parented to it, and runs commands for edged
 * over the control socket described in protocol.h.  One thread, one epoll loop;
 * every fd non-blocking so that no peer (client or workload) can stall it.
 * Its parts are listed in sbx-init.h.
 *
 * Usage: sbx-init -g | (-l LISTEN_FD | -c FD[:WFD])
 *                 [-f FREEZER_CG_FD -m MEMORY_CG_FD | -u V2_CG_FD]
 *                 [-L LANDLOCK_FD] [-S SECCOMP_FD] [-U SCRATCH_FD] [-A PROFILE]
 *                 [-P LOWER_FD[:LOWER_FD...] -G PATH[:PATH...]] [-I SPARE_IDLE_MS]
 *   LISTEN_FD      a bound unix (or vsock) stream socket (sbx-init calls
 *                  listen(), so that SO_PEERCRED on a client's connection names
 *                  sbx-init); each connection replaces the last;
 *   FD[:WFD]       one client for good: a connected socket, a port, or the read
 *                  and write ends of two pipes (control.c);
 *   -g             PID 1 of a microVM guest (guest.c): boots the sandbox from
 *                  the disks and policies the host sends on the control port,
 *                  then serves on that port (re-opened while the host side is
 *                  away), every other option coming from there;
 *   *_CG_FD        directories of the sandbox's cgroups, delegated to the
 *                  sandbox root, under which each exec gets its own cgroup so
 *                  that a timeout or kill takes its whole tree, daemonized
 *                  grandchildren included (cgroup.c).
 *   LANDLOCK_FD    a file holding a Landlock ruleset blob (lfs_confine.h),
 *                  read and resolved once at start-up, while the rootfs is
 *                  still exactly what the layers hold;
 *   SECCOMP_FD     a file holding a classic-BPF seccomp program whose denials
 *                  are user notifications;
 *   PROFILE        AppArmor profiles (loaded by the daemon), WORKLOAD[,GRADER]:
 *                  each exec changes to WORKLOAD at execve (aa_change_onexec), a
 *                  grader exec to GRADER (WORKLOAD when none is given), on
 *                  kernels with AppArmor;
 *   SCRATCH_FD     the sandbox's scratch directory (upper/ and work/ of the
 *                  overlay, dev/ and shm/, empty/): kept open, so the daemon
 *                  can inspect the upper through /proc/<pid>/fd before a
 *                  grader exec, and for the bottom of grader views;
 *   LOWER_FD...    the layers, detached read-only mounts, bottom first, and
 *                  the PATHs a grader exec (SBX_EXEC_GRADER) sees from an
 *                  overlay of them alone (grader.c);
 *   SPARE_IDLE_MS  the child forked ahead of the next exec is dropped when no
 *                  exec has started or ended this long (spare.c; default 0:
 *                  kept for good).
 * Every inherited fd is made close-on-exec at start-up: no workload process
 * inherits the control channel or a cgroup directory.  How each exec is
 * confined is in child.c; the child forked ahead of the next exec in spare.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "guest.h"
#include "lfs_confine.h"
#include "sbx-init.h"

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
static int load_policies(struct sbx_policy *pol, int ll_fd, int sc_fd)
{
	struct lfs_error err = {0};

	if (ll_fd >= 0) {
		size_t len;
		uint8_t *blob = slurp(ll_fd, LFS_LL_MAX_BLOB, &len);

		if (!blob) {
			logmsg("sbx-init: read the Landlock ruleset: %s", strerror(errno));
			return -1;
		}
		pol->ll_ruleset = lfs_landlock_prepare(blob, len, &err);
		pol->ll_flags = lfs_landlock_flags(blob, len);
		free(blob);
		close(ll_fd);
		if (pol->ll_ruleset < 0) {
			logmsg("sbx-init: Landlock: %s", err.msg);
			return -1;
		}
	}
	if (sc_fd >= 0) {
		pol->sc_prog = slurp(sc_fd, 4096 * 8, &pol->sc_len);
		close(sc_fd);
		if (!pol->sc_prog) {
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

	if (syscall(SYS_capget, &hdr, data) < 0) {
		logmsg("sbx-init: drop inheritable capabilities: capget: %s", strerror(errno));
		return -1;
	}
	data[0].inheritable = data[1].inheritable = 0;
	if (syscall(SYS_capset, &hdr, data) < 0) {
		logmsg("sbx-init: drop inheritable capabilities: capset: %s", strerror(errno));
		return -1;
	}
	return 0;
}

/* -P: the layers of grader views, as fds, bottom first. */
static int parse_lowers(const char *arg, struct sbx_policy *pol)
{
	char buf[SBX_MAX_LOWERS * 12], *p, *save = NULL;

	if (strlen(arg) >= sizeof(buf))
		return -1;
	strcpy(buf, arg);
	for (p = strtok_r(buf, ":", &save); p; p = strtok_r(NULL, ":", &save)) {
		if (pol->n_lowers == SBX_MAX_LOWERS)
			return -1;
		pol->lowers[pol->n_lowers++] = parse_fd(p);
	}
	return pol->n_lowers ? 0 : -1;
}

static void on_sigchld(struct sbx *s)
{
	struct signalfd_siginfo si;

	while (read(s->sig_fd, &si, sizeof(si)) == sizeof(si))
		;
	exec_reap(s);
}

/* What each frame means: HELLO is answered here, the rest are an exec's or a
 * transfer's. */
static void on_frame(struct sbx *s, const struct sbx_hdr *h, uint8_t *p)
{
	if (h->type == SBX_HELLO) {
		struct sbx_hello hello = {.version = SBX_PROTO_VERSION,
					  .cgroup_mode = (uint32_t)s->cg.mode};

		if (h->flags & SBX_HELLO_NEW_CLIENT)
			s->ctl.on_drop(s);
		hello.execs = exec_count(s);
		ctl_send(s, SBX_HELLO_OK, 0, &hello, sizeof(hello), NULL, 0);
		return;
	}
	if (h->type == SBX_EXEC) {
		exec_start(s, h->exec_id, p, h->len);
		return;
	}
	if (h->type == SBX_KILL_ALL) {
		if (h->len || !h->exec_id)
			return ctl_error(s, h->exec_id, EINVAL, "kill all: a payload, or id 0");
		return exec_kill_all(s, h->exec_id);
	}
	if (h->type == SBX_QUIESCE) {
		if (h->len || !h->exec_id)
			return ctl_error(s, h->exec_id, EINVAL, "quiesce: a payload, or id 0");
		return ctl_quiesce(s, h->exec_id);
	}
	if (h->type >= SBX_FILE_PUT && h->type <= SBX_FILE_ABORT)
		return files_message(s, h, p);
	if (h->type < SBX_STDIN || h->type > SBX_CREDIT)
		return ctl_error(s, h->exec_id, EINVAL, "unknown message type %u", h->type);
	exec_message(s, h, p);
}

/* "FD" or "RFD:WFD" */
static int parse_stream(const char *arg, int *rfd, int *wfd)
{
	char buf[32];
	char *colon;

	snprintf(buf, sizeof(buf), "%s", arg);
	colon = strchr(buf, ':');
	if (colon)
		*colon = 0;
	*rfd = parse_fd(buf);
	*wfd = colon ? parse_fd(colon + 1) : *rfd;
	return *rfd < 0 || *wfd < 0 ? -1 : 0;
}

/* The client is gone: so are its execs (killed) and its transfers. */
static void on_drop(struct sbx *s)
{
	exec_orphan_all(s);
	files_drop_all(s);
}

static void update_interest(struct sbx *s)
{
	exec_update_interest(s);
	ctl_update_interest(s);
	s->interest_dirty = 0;
}

static void dispatch(struct sbx *s, const struct epoll_event *ev)
{
	int kind = (int)(ev->data.u64 & 0xff);
	struct exec *e = &s->execs[(ev->data.u64 >> 8) % SBX_MAX_EXECS];

	switch (kind) {
	case K_LISTEN: ctl_open(s); break;
	case K_SIG: on_sigchld(s); break;
	case K_CLIENT:
		if (!ctl_connected(s))
			break;
		if (ev->events & (EPOLLIN | EPOLLHUP | EPOLLERR))
			ctl_on_readable(s);
		if (ctl_connected(s) && (ev->events & EPOLLOUT))
			ctl_flush(s);
		break;
	case K_CLIENT_OUT: /* a write end of its own (pipes); EPOLLERR: the reader left */
		if (ctl_connected(s))
			ctl_flush(s);
		break;
	case K_ERRPIPE:
		if (e->used && e->errpipe >= 0)
			exec_on_errpipe(s, e);
		break;
	case K_NOTIF:
		if (e->used && e->notif >= 0)
			exec_on_notif(s, e, ev->events);
		break;
	case K_OUT:
		if (!e->used || e->out_fd < 0)
			break;
		if (e->pty && (ev->events & EPOLLOUT) && e->in_fd >= 0)
			exec_on_stdin_writable(s, e);
		if (e->out_fd >= 0 && (ev->events & (EPOLLIN | EPOLLHUP | EPOLLERR)))
			exec_on_output(s, e, K_OUT);
		break;
	case K_ERR:
		if (e->used && e->err_fd >= 0)
			exec_on_output(s, e, K_ERR);
		break;
	case K_IN:
		if (e->used && e->in_fd >= 0)
			exec_on_stdin_writable(s, e);
		break;
	}
}

static int guest_port_open(struct sbx_ctl *c, int *rfd, int *wfd)
{
	int fd = sbx_guest_reconnect();

	(void)c;
	if (fd < 0)
		return -1;
	*rfd = *wfd = fd;
	return 0;
}

int main(int argc, char **argv)
{
	static struct sbx sbx;
	struct sbx *s = &sbx;
	struct epoll_event evs[64];
	sigset_t mask;
	int opt, ll_fd = -1, sc_fd = -1, listen_fd = -1, rfd = -1, wfd = -1, guest_mode = 0;
	struct sbx_guest guest;

	s->ep = s->sig_fd = -1;
	s->ctl.rfd = s->ctl.wfd = s->ctl.listen_fd = s->ctl.retry_ms = -1;
	s->ctl.on_frame = on_frame;
	s->ctl.on_drop = on_drop;
	s->cg.freezer = s->cg.memory = s->cg.v2 = -1;
	s->pol.ll_ruleset = s->pol.scratch_fd = s->pol.upper_fd = -1;
	s->spare.sock = -1;
	while ((opt = getopt(argc, argv, "gl:c:f:m:u:L:S:U:A:P:G:I:")) != -1) {
		switch (opt) {
		case 'g': guest_mode = 1; break;
		case 'l': listen_fd = parse_fd(optarg); break;
		case 'c':
			if (parse_stream(optarg, &rfd, &wfd) < 0) {
				logmsg("sbx-init: -c `%s`: FD or RFD:WFD", optarg);
				return 2;
			}
			break;
		case 'f': s->cg.freezer = parse_fd(optarg); break;
		case 'm': s->cg.memory = parse_fd(optarg); break;
		case 'u': s->cg.v2 = parse_fd(optarg); break;
		case 'L': ll_fd = parse_fd(optarg); break;
		case 'S': sc_fd = parse_fd(optarg); break;
		case 'U': s->pol.scratch_fd = parse_fd(optarg); break;
		case 'A': {
			char *comma = strchr(optarg, ',');

			s->pol.aa_profile = optarg;
			s->pol.aa_grader = optarg;
			if (comma) {
				*comma = '\0';
				s->pol.aa_grader = comma + 1;
			}
			break;
		}
		case 'P':
			if (parse_lowers(optarg, &s->pol) < 0) {
				logmsg("sbx-init: -P `%s`: FD[:FD...], at most %d", optarg,
				       SBX_MAX_LOWERS);
				return 2;
			}
			break;
		case 'G': s->pol.grader_paths = optarg; break;
		case 'I': {
			unsigned long long ms = strtoull(optarg, NULL, 10);

			if (!optarg[0] || strspn(optarg, "0123456789") != strlen(optarg) ||
			    strlen(optarg) > 12 || ms > 86400000ull * 365) {
				logmsg("sbx-init: -I `%s`: milliseconds, at most a year", optarg);
				return 2;
			}
			s->spare.idle_ns = ms * 1000000ull;
			break;
		}
		default:
			logmsg("usage: sbx-init -g | (-l LISTEN_FD | -c FD[:WFD]) "
			       "[-f FREEZER_FD -m MEMORY_FD | -u V2_FD] "
			       "[-L LANDLOCK_FD] [-S SECCOMP_FD] [-U SCRATCH_FD] [-A PROFILE] "
			       "[-P LOWER_FD[:LOWER_FD...] -G PATHS] [-I SPARE_IDLE_MS]");
			return 2;
		}
	}
	if (guest_mode) {
		sbx_guest_boot(&guest); /* returns only with the sandbox's rootfs as / */
		ll_fd = guest.landlock_fd;
		sc_fd = guest.seccomp_fd;
		s->cg.v2 = guest.cgroup_fd;
		memcpy(s->pol.lowers, guest.lowers, sizeof(int) * (size_t)guest.n_lowers);
		s->pol.n_lowers = guest.n_lowers;
		s->pol.scratch_fd = s->pol.upper_fd = guest.scratch_fd;
		s->pol.grader_paths = guest.grader_paths;
		s->pol.restrict_caps = !!(guest.flags & SBX_BOOT_CONFINE_CAPS);
		s->pol.caps = guest.caps;
		rfd = wfd = guest.port;
	}
	if (load_policies(&s->pol, ll_fd, sc_fd) < 0)
		return 1;
	if (s->pol.n_lowers && !guest_mode && drop_inheritable() < 0)
		return 1; /* fail closed: an exec could inherit CAP_SYS_ADMIN */
	if ((listen_fd < 0) == (rfd < 0)) {
		logmsg("sbx-init: one of -l LISTEN_FD and -c FD[:WFD] is required");
		return 2;
	}
	cg_init(&s->cg);
	/* Not dumpable: /proc/1/{mem,fd,...} need ptrace rights over a
	 * non-dumpable task, which the workload's capabilities are checked
	 * against (tightened further by the confinement layer). */
	prctl(PR_SET_DUMPABLE, 0);
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	s->sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
	if (s->sig_fd < 0) {
		logmsg("sbx-init: signalfd: %s", strerror(errno));
		return 1;
	}
	s->ep = epoll_create1(EPOLL_CLOEXEC);
	if (s->ep < 0) {
		logmsg("sbx-init: epoll_create1: %s", strerror(errno));
		return 1;
	}
	if (listen_fd >= 0 && ctl_transport_listen(s, listen_fd) < 0) {
		logmsg("sbx-init: listen: %s", strerror(errno));
		return 1;
	}
	if (rfd >= 0)
		ctl_transport_stream(s, rfd, wfd);
	if (guest_mode) {
		/* the host side went away (a daemon restart): poll for its return,
		 * since a disconnected port reports POLLHUP without end */
		s->ctl.open = guest_port_open;
		s->ctl.retry_ms = 20;
	}
	exec_init_slots(s);
	files_init(s);
	s->root_fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (s->root_fd < 0) {
		logmsg("sbx-init: open `/`: %s", strerror(errno));
		return 1;
	}
	ep_add(s, s->sig_fd, K_SIG, 0, EPOLLIN);
	spare_note_use(s, now_ns());
	spare_make(s);
	for (;;) {
		int n, k, timeout, spare_ms;

		if (!ctl_connected(s) && s->ctl.retry_ms >= 0)
			ctl_open(s);
		if (files_active(s) && ctl_pending(s) < OUTQ_HIGH) {
			files_pump(s);
			s->interest_dirty = 1;
		}
		if (s->interest_dirty)
			update_interest(s);
		timeout = exec_next_timeout_ms(s, now_ns());
		spare_ms = spare_next_timeout_ms(s, now_ns());
		if (spare_ms >= 0 && (timeout < 0 || spare_ms < timeout))
			timeout = spare_ms;
		if (files_active(s) && ctl_pending(s) < OUTQ_HIGH)
			timeout = 0; /* a get has more to send */
		if (!ctl_connected(s) && s->ctl.retry_ms >= 0 &&
		    (timeout < 0 || timeout > s->ctl.retry_ms))
			timeout = s->ctl.retry_ms;
		n = epoll_wait(s->ep, evs, 64, timeout);
		if (n < 0 && errno != EINTR) {
			logmsg("sbx-init: epoll_wait: %s", strerror(errno));
			sleep(1);
		}
		for (k = 0; k < n; k++)
			dispatch(s, &evs[k]);
		exec_check_deadlines(s, now_ns());
		spare_check_idle(s, now_ns());
		/* An exec cgroup still busy at its exec's end goes at a child's exit
		 * (on_sigchld); any other wake tries again too, and no timer does:
		 * an idle sandbox never runs. */
		if (s->cg.n_pending_rm)
			cg_retry_pending(&s->cg);
		if (ctl_pending(s))
			ctl_flush(s);
		ctl_drop_if_broken(s);
	}
}
