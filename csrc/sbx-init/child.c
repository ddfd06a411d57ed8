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
 *
 * The environment an exec starts with is what a login shell would give
 * (login(1), su -l), under whatever the request's env sets (edged merges the
 * sandbox's env and the exec's into it: those win, in that order).  The one
 * place these defaults are (documented in protocol.h, the API spec and the
 * README):
 *   PATH           /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
 *   HOME           the uid's home in the sandbox's /etc/passwd, else /root for
 *                  uid 0, else / (login(1)'s DEFAULT_HOME fallback)
 *   USER, LOGNAME  the uid's name there, else "root" for uid 0, else the uid
 *   SHELL          the uid's shell there, else /bin/sh
 *   LANG           C.UTF-8
 *   LC_ALL         C.UTF-8, unless the env sets LANG or an LC_* (it would win
 *                  over them)
 *   TERM           xterm-256color, on a pseudo-terminal only
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
#include <sys/stat.h>
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

/* AppArmor, Landlock, then seccomp: the last steps before execve (the filter
 * would otherwise also judge our own set-up calls).  A grader exec gets the
 * grader's AppArmor profile. */
static void confine_child(const struct sbx_policy *pol, int grader, int errpipe_w)
{
	struct lfs_error err = {0};
	const char *aa = grader && pol->aa_grader ? pol->aa_grader : pol->aa_profile;
	int l;

	if (aa) {
		/* the AppArmor onexec protocol: the profile applies from the execve on */
		char cmd[128];
		int n = snprintf(cmd, sizeof(cmd), "exec %s", aa);
		int fd = open("/proc/self/attr/apparmor/exec", O_WRONLY | O_CLOEXEC);

		if (fd < 0)
			fd = open("/proc/self/attr/exec", O_WRONLY | O_CLOEXEC);
		if (fd < 0 || n <= 0 || n >= (int)sizeof(cmd) || write(fd, cmd, (size_t)n) != n)
			child_fail(errpipe_w, errno ? errno : EINVAL, "apparmor change_onexec", aa);
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

#define LOGIN_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define PASSWD_MAX (1u << 20) /* bytes of /etc/passwd looked through */

struct passwd_entry {
	char name[256], home[1024], shell[1024];
};

/* Field `i` (0-based) of a passwd line, copied into out[size]; 0 if absent or too long. */
static int passwd_field(const char *line, const char *end, int i, char *out, size_t size)
{
	const char *p = line, *q;

	while (i-- > 0) {
		p = memchr(p, ':', (size_t)(end - p));
		if (!p++)
			return 0;
	}
	q = memchr(p, ':', (size_t)(end - p));
	if (!q)
		q = end;
	if ((size_t)(q - p) >= size)
		return 0;
	memcpy(out, p, (size_t)(q - p));
	out[q - p] = 0;
	return 1;
}

/* The entry of `uid` in the sandbox's /etc/passwd; 0 if none.  The workload
 * owns that file: it is read only if it is a regular file (a FIFO would hang
 * the exec), and only so far. */
static int passwd_lookup(uint32_t uid, struct passwd_entry *pw)
{
	static char buf[PASSWD_MAX];
	struct stat st;
	size_t len = 0;
	char *line, *end;
	int fd = open("/etc/passwd", O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);

	if (fd < 0)
		return 0;
	if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode))
		while (len < sizeof(buf)) {
			ssize_t n = read(fd, buf + len, sizeof(buf) - len);

			if (n <= 0)
				break;
			len += (size_t)n;
		}
	close(fd);
	for (line = buf; line < buf + len; line = end + 1) {
		char id[16], *stop;

		end = memchr(line, '\n', (size_t)(buf + len - line));
		if (!end)
			end = buf + len;
		if (!passwd_field(line, end, 2, id, sizeof(id)) || !id[0] ||
		    strtoul(id, &stop, 10) != uid || *stop)
			continue;
		if (passwd_field(line, end, 0, pw->name, sizeof(pw->name)) &&
		    passwd_field(line, end, 5, pw->home, sizeof(pw->home)) &&
		    passwd_field(line, end, 6, pw->shell, sizeof(pw->shell)))
			return 1;
	}
	return 0;
}

static int env_has(char **env, const char *name)
{
	size_t n = strlen(name);

	for (; *env; env++)
		if (!strncmp(*env, name, n) && (*env)[n] == '=')
			return 1;
	return 0;
}

static int env_has_locale(char **env)
{
	for (; *env; env++)
		if (!strncmp(*env, "LANG=", 5) || !strncmp(*env, "LC_", 3))
			return 1;
	return 0;
}

/* The request's env with the login defaults (top of this file) under it. */
static char **login_env(const struct child_args *a)
{
	static char *out[SBX_MAX_STRINGS + 16];
	static char made[8][1100];
	static struct passwd_entry pw;
	char uidname[16];
	const char *name, *home, *shell;
	int n = 0, m = 0, found = passwd_lookup(a->req->uid, &pw);
	char **e;

	snprintf(uidname, sizeof(uidname), "%u", a->req->uid);
	name = found && pw.name[0] ? pw.name : a->req->uid == 0 ? "root" : uidname;
	home = found && pw.home[0] ? pw.home : a->req->uid == 0 ? "/root" : "/";
	shell = found && pw.shell[0] ? pw.shell : "/bin/sh";
	for (e = a->envp; *e; e++)
		out[n++] = *e;
#define DEFAULT(var, val)                                                    \
	do {                                                                 \
		if (!env_has(a->envp, var)) {                                \
			snprintf(made[m], sizeof(made[m]), "%s=%s", var, val); \
			out[n++] = made[m++];                                \
		}                                                            \
	} while (0)
	DEFAULT("PATH", LOGIN_PATH);
	DEFAULT("HOME", home);
	DEFAULT("USER", name);
	DEFAULT("LOGNAME", name);
	DEFAULT("SHELL", shell);
	if (!env_has_locale(a->envp))
		DEFAULT("LC_ALL", "C.UTF-8");
	DEFAULT("LANG", "C.UTF-8");
	if (a->pty_name)
		DEFAULT("TERM", "xterm-256color");
#undef DEFAULT
	out[n] = NULL;
	return out;
}

void child_run(const struct sbx_policy *pol, struct child_args *a)
{
	char **envp;
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
	/* as sandbox root, in a grader's view of /etc when it has one */
	envp = login_env(a);
	if (pol->restrict_caps) {
		/* In a container the spawner restricted sbx-init itself; a guest's
		 * sbx-init keeps every capability (mounts for grader views, the
		 * cgroup tree), so each exec drops to the set here. */
		struct lfs_error err = {0};

		if (lfs_caps_restrict(pol->caps, &err) < 0)
			child_fail(a->errpipe_w, err.code, "capabilities", err.msg);
	}
	if (setgroups(0, NULL) < 0 && errno != EPERM)
		child_fail(a->errpipe_w, errno, "setgroups", "");
	if (setresgid(a->req->gid, a->req->gid, a->req->gid) < 0)
		child_fail(a->errpipe_w, errno, "setgid", "gid");
	if (setresuid(a->req->uid, a->req->uid, a->req->uid) < 0)
		child_fail(a->errpipe_w, errno, "setuid", "uid");
	if (chdir(a->cwd) < 0)
		child_fail(a->errpipe_w, errno, "chdir", a->cwd);
	confine_child(pol, (a->req->flags & SBX_EXEC_GRADER) != 0, a->errpipe_w);
	environ = envp;
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
