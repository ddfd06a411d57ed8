/* The spare: with per-exec cgroups, the next exec's child is forked ahead and
 * moves itself into that exec's cgroups while sbx-init goes on.  Moving a
 * process between cgroups takes the kernel's cgroup_threadgroup_rwsem for
 * writing, which waits for an RCU grace period when no move happened lately
 * (milliseconds; tens on a loaded host), and an exec would otherwise wait for
 * it each time.  The spare keeps no fd but its own and waits for the exec's
 * request and fds; like sbx-init it is not dumpable and outside every
 * workload's Landlock domain (no signals or ptrace from the workload).
 *
 * An idle sandbox does not keep one (-I MS): when no exec has started or
 * ended for MS, the spare is killed and its cgroup removed.  It is host
 * kernel memory that no limit holds (its task, kernel stack, page tables and
 * exec cgroup: ~75 KiB on Linux 6.18, the README's Density section), paid by
 * every idle sandbox on the node.  The next exec then forks its child itself,
 * as it does when the spare is busy, and the spare comes back at that exec's
 * end.  The one timer this sets fires once per idle spell: after it, an idle
 * sandbox never runs. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sbx-init.h"

#define SPARE_MAX_MSG (128u << 10) /* larger exec requests fork as they come */
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

/* What the spare receives: this, the EXEC payload, and the fds in fdmask
 * order (stdin read end, stdout and stderr write ends, error socket). */
struct spare_hdr {
	uint32_t fdmask;
	char pty_name[64]; /* "" if no pty */
};

static int cmp_int(const void *a, const void *b)
{
	return *(const int *)a - *(const int *)b;
}

static void spare_main(const struct sbx_policy *pol, int sock, const int join[2])
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
	int keep[8 + SBX_MAX_LOWERS] = {0, 1, 2, sock}, nk = 4, fds[4] = {-1, -1, -1, -1}, got[4];
	int i, n = 0;
	ssize_t r;

	/* Nothing of sbx-init's but what an exec needs: a copy of a running
	 * exec's stdin write end, say, would keep that exec from seeing EOF. */
	for (i = 0; i < 2; i++)
		if (join[i] >= 0)
			keep[nk++] = join[i];
	if (pol->ll_ruleset >= 0)
		keep[nk++] = pol->ll_ruleset;
	for (i = 0; i < pol->n_lowers; i++) /* a grader view is made from these */
		keep[nk++] = pol->lowers[i];
	if (pol->n_lowers && pol->scratch_fd >= 0)
		keep[nk++] = pol->scratch_fd;
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
	child_run(pol, &a);
}

/* Fork the next exec's child ahead, if there is none and execs get cgroups. */
void spare_make(struct sbx *s)
{
	char cg[CG_NAME_MAX];
	int join[2], sv[2] = {-1, -1}, i;
	pid_t pid = -1;

	if (s->spare.pid > 0 || s->cg.mode == SBX_CGROUP_NONE)
		return;
	cg_make(&s->cg, cg, join);
	if (!cg[0])
		return;
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0) {
		pid = cg_fork(&s->cg, cg, join);
		if (pid == 0) {
			close(sv[0]);
			spare_main(&s->pol, sv[1], join);
		}
		close(sv[1]);
	}
	for (i = 0; i < 2; i++)
		if (join[i] >= 0)
			close(join[i]);
	if (pid < 0) {
		if (sv[0] >= 0)
			close(sv[0]);
		cg_release(&s->cg, cg);
		return;
	}
	s->spare.pid = pid;
	s->spare.sock = sv[0];
	memcpy(s->spare.cg, cg, sizeof(s->spare.cg));
}

/* An exec started or ended at `now`: the spare is in use. */
void spare_note_use(struct sbx *s, uint64_t now)
{
	s->spare.last_use = now;
}

/* epoll_wait's timeout for the idle spare's drop: ms until it is due, or -1
 * (no spare, or spares are kept). */
int spare_next_timeout_ms(const struct sbx *s, uint64_t now)
{
	uint64_t due;

	if (s->spare.pid <= 0 || !s->spare.idle_ns)
		return -1;
	due = s->spare.last_use + s->spare.idle_ns;
	if (due <= now)
		return 0;
	due = (due - now + 999999) / 1000000;
	return due > INT_MAX ? INT_MAX : (int)due;
}

/* Drop the spare if no exec has started or ended for -I's time.  Killed, not
 * told: a spare whose pages reclaim put in swap need not fault them back in
 * to exit.  Its cgroup goes once it is reaped (cg_retry_pending). */
void spare_check_idle(struct sbx *s, uint64_t now)
{
	if (spare_next_timeout_ms(s, now) == 0)
		spare_drop(s, 1);
}

/* The spare is gone or of no use: let it go; its cgroups are removed once it
 * has left them. */
void spare_drop(struct sbx *s, int kill_it)
{
	if (s->spare.pid <= 0)
		return;
	if (kill_it)
		kill(s->spare.pid, SIGKILL);
	ep_close(s, &s->spare.sock);
	cg_release(&s->cg, s->spare.cg);
	s->spare.pid = 0;
	s->spare.cg[0] = 0;
}

/* Hand the exec `a` (request `payload`) to the spare; returns its pid, or -1
 * (no spare, or it could not take it: fork then). */
pid_t spare_take(struct sbx *s, struct exec *e, const struct child_args *a,
		 const uint8_t *payload, uint32_t len)
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
	pid_t pid = s->spare.pid;

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
	if (sendmsg(s->spare.sock, &m, MSG_NOSIGNAL | MSG_DONTWAIT) !=
	    (ssize_t)(sizeof(h) + len)) {
		spare_drop(s, 1);
		return -1;
	}
	memcpy(e->cg, s->spare.cg, sizeof(e->cg));
	ep_close(s, &s->spare.sock);
	s->spare.pid = 0;
	s->spare.cg[0] = 0;
	return pid;
}
