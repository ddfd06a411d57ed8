/* An exec's child, between fork (or the spare's wake-up) and execve.
 *
 * Confinement is applied to EACH exec's child just before execve, never to
 * sbx-init itself: Landlock first (a fresh domain per exec, so the workload's
 * domain cannot signal, ptrace or reach the abstract sockets of sbx-init or of
 * a later grader exec), then seccomp with a notification listener.  The child
 * hands the listener to sbx-init over its error socket; sbx-init answers each
 * denied syscall with EPERM at once (the workload never waits on the daemon)
 * and reports it to the client as an SBX_EVENT (exec.c).
 *
 * Whatever fails here is told to sbx-init as one message on the error socket
 * (an errno value and "call `argument`: reason") and ends the child with 127.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <termios.h>
#include <unistd.h>

#include "lfs_confine.h"
#include "sbx-init.h"

extern char **environ;

void child_fail(int fd, int code, const char *what, const char *arg)
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
static void confine_child(const struct sbx_policy *pol, int errpipe_w)
{
	struct lfs_error err = {0};
	int l;

	if (pol->aa_profile) {
		/* the AppArmor onexec protocol: the profile applies from the execve on */
		char cmd[128];
		int n = snprintf(cmd, sizeof(cmd), "exec %s", pol->aa_profile);
		int fd = open("/proc/self/attr/apparmor/exec", O_WRONLY | O_CLOEXEC);

		if (fd < 0)
			fd = open("/proc/self/attr/exec", O_WRONLY | O_CLOEXEC);
		if (fd < 0 || n <= 0 || n >= (int)sizeof(cmd) || write(fd, cmd, (size_t)n) != n)
			child_fail(errpipe_w, errno ? errno : EINVAL, "apparmor change_onexec",
				   pol->aa_profile);
		close(fd);
	}
	if (pol->ll_ruleset >= 0 && lfs_landlock_enforce(pol->ll_ruleset, pol->ll_flags, &err) < 0)
		child_fail(errpipe_w, err.code, "confine", err.msg);
	if (!pol->sc_prog)
		return;
	l = lfs_seccomp_install(pol->sc_prog, pol->sc_len, 1, 0, &err);
	if (l < 0)
		child_fail(errpipe_w, err.code, "confine", err.msg);
	if (send_listener(errpipe_w, l) < 0)
		child_fail(errpipe_w, errno, "confine", "pass the seccomp listener");
	close(l);
}

void child_run(const struct sbx_policy *pol, struct child_args *a)
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
	if (a->req->flags & SBX_EXEC_GRADER) {
		struct sbx_fail f;

		if (grader_view(pol, a->req->uid, a->req->gid, &f) < 0)
			child_fail(a->errpipe_w, f.code, f.what, f.arg);
	}
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
	confine_child(pol, a->errpipe_w);
	environ = a->envp;
	/* "reached execve": an EOF without it is a child that died before (a
	 * spare killed with the workload, say), never a program that ran */
	if (write(a->errpipe_w, "X", 1) != 1)
		child_fail(a->errpipe_w, errno, "report the start", "");
	execvp(a->argv[0], a->argv);
	child_fail(a->errpipe_w, errno, "exec", a->argv[0]);
}

/* Split `n` NUL-terminated strings from p[0..len); NULL if malformed. */
char **split_strings(char *p, size_t len, uint32_t n, char **out)
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

/* argv and env of a checked EXEC payload as NULL-terminated arrays inside
 * strs (strs[0] is the cwd). */
void exec_arrays(const struct sbx_exec *req, char **strs, char ***argv, char ***envp)
{
	*argv = &strs[1];
	memmove(&strs[2 + req->argc], &strs[1 + req->argc], req->envc * sizeof(char *));
	strs[1 + req->argc] = NULL;
	*envp = &strs[2 + req->argc];
	(*envp)[req->envc] = NULL;
}
