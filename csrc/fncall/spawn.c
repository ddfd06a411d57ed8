/* fncall-spawn: the call spawner of one FnCall pool sandbox. Runs INSIDE a sandbox only.
 *
 * Started once per pool sandbox by the call server's io process
 * (edged/backends/fncall/server.py), after its guard passed, as
 *     fncall-spawn --host-pidns pid:[N]
 * with a SOCK_SEQPACKET socket on fd 3. For each call that runs a program (not Python: that
 * stays on the warm interpreter's fork server) it receives one job, starts the program with
 * vfork() -- the child shares this small process's memory until its execve, so no page
 * table is copied and no copy-on-write fault is taken, which is what a fork of the Python
 * zygote cost -- waits for it (its wall-time limit through a pidfd and poll), and answers.
 *
 * The guard: it refuses (exit status 3, nothing done) unless PID 1 is sbx-init, it is not
 * PID 1 itself, and its pid namespace is neither the kernel's initial one
 * (PROC_PID_INIT_INO, include/linux/proc_ns.h) nor the daemon's (--host-pidns).
 * It signals nothing but its own child, through that child's pidfd.
 *
 * Job (one datagram): NUL-terminated fields, each a one-letter key then its value:
 *   u<uid> g<gid> w<wall seconds> c<cpu seconds> f<RLIMIT_FSIZE bytes> m<RLIMIT_AS bytes>
 *   i<stdin path> o<stdout path> e<stderr path> d<working directory>
 *   a<argv item> (one or more, in order) E<NAME=value> (zero or more)
 * 0 for w/c/f/m means "no limit". Unknown keys, a missing field or a datagram not ending in
 * NUL is bad input: answered {"error": "..."} and the spawner goes on.
 * Answer (one datagram, JSON): {"exit_code": N|null, "signal": N|null, "timed_out": bool,
 *   "cpu_s": s, "wall_s": s, "rss_bytes": N} or {"error": "..."}.
 *
 * The child, between vfork and execve (only system calls; the parent is suspended):
 * setsid; stdin/stdout/stderr from the job's files on 0, 1, 2 and every other descriptor
 * closed; the working directory; RLIMIT_CORE 0 and the job's RLIMIT_FSIZE, RLIMIT_CPU
 * (soft ceil(c), hard +1), RLIMIT_AS; oom_score_adj 1000 where it may be written (the
 * call, never a server, is what the OOM killer takes; the fncall task profile's Landlock
 * rules deny it today, as they do to the zygote's child); no supplementary groups, the job's gid and uid (real, effective,
 * saved: no capabilities left); execve through the job's PATH as execvp does. A failure
 * there is written to stderr and the child exits 127.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define REFUSED 3
#define PROC_PID_INIT_INO 0xEFFFFFFCu
#define CHAN 3
#define MAX_JOB (1 << 18)
#define MAX_ITEMS 4096

struct job {
    long uid, gid;
    double wall_s, cpu_s;
    long long fsize, as_bytes;
    const char *in, *out, *err, *cwd;
    char *argv[MAX_ITEMS + 1];
    char *envp[MAX_ITEMS + 1];
    int argc, envc;
    const char *path;  /* the job's PATH, or the default */
};

static char buf[MAX_JOB + 1];

static int guard(const char *host_pidns, char *why, size_t n)
{
    char comm[64] = {0};
    int fd = open("/proc/1/comm", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, n, "cannot read /proc/1/comm: %s", strerror(errno));
        return -1;
    }
    ssize_t got = read(fd, comm, sizeof comm - 1);
    close(fd);
    if (got > 0 && comm[got - 1] == '\n')
        comm[got - 1] = 0;
    if (got <= 0 || strcmp(comm, "sbx-init") != 0) {
        snprintf(why, n, "PID 1 is '%s', not sbx-init", got > 0 ? comm : "?");
        return -1;
    }
    if (getpid() == 1) {
        snprintf(why, n, "this process is PID 1");
        return -1;
    }
    char ns[64] = {0}, init[64];
    if (readlink("/proc/self/ns/pid", ns, sizeof ns - 1) < 0) {
        snprintf(why, n, "cannot read /proc/self/ns/pid: %s", strerror(errno));
        return -1;
    }
    snprintf(init, sizeof init, "pid:[%u]", PROC_PID_INIT_INO);
    if (strcmp(ns, init) == 0) {
        snprintf(why, n, "it runs in the initial pid namespace (%s)", ns);
        return -1;
    }
    if (!host_pidns || !*host_pidns) {
        snprintf(why, n, "the daemon's pid namespace was not given (--host-pidns)");
        return -1;
    }
    if (strcmp(ns, host_pidns) == 0) {
        snprintf(why, n, "it runs in the daemon's pid namespace (%s)", ns);
        return -1;
    }
    return 0;
}

static int parse_num(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || v < 0)
        return -1;
    *out = v;
    return 0;
}

/* Parses buf[0..len) into j; NULL, or what is wrong. */
static const char *parse(char *b, size_t len, struct job *j)
{
    memset(j, 0, sizeof *j);
    j->uid = j->gid = -1;
    j->path = "/usr/local/bin:/usr/bin:/bin";
    if (len == 0 || b[len - 1] != 0)
        return "a job must end in a NUL byte";
    for (char *p = b; p < b + len; p += strlen(p) + 1) {
        char key = *p;
        char *v = p + (key ? 1 : 0);
        double d;
        switch (key) {
        case 'u': case 'g': case 'w': case 'c': case 'f': case 'm':
            if (parse_num(v, &d) < 0)
                return "a number field is not a non-negative number";
            if (key == 'u') j->uid = (long)d;
            else if (key == 'g') j->gid = (long)d;
            else if (key == 'w') j->wall_s = d;
            else if (key == 'c') j->cpu_s = d;
            else if (key == 'f') j->fsize = (long long)d;
            else j->as_bytes = (long long)d;
            break;
        case 'i': j->in = v; break;
        case 'o': j->out = v; break;
        case 'e': j->err = v; break;
        case 'd': j->cwd = v; break;
        case 'a':
            if (j->argc >= MAX_ITEMS)
                return "too many argv items";
            j->argv[j->argc++] = v;
            break;
        case 'E':
            if (j->envc >= MAX_ITEMS)
                return "too many env items";
            if (!strchr(v, '='))
                return "an env item has no '='";
            if (strncmp(v, "PATH=", 5) == 0)
                j->path = v + 5;
            j->envp[j->envc++] = v;
            break;
        default:
            return "unknown field";
        }
    }
    if (j->uid < 0 || j->gid < 0 || !j->in || !j->out || !j->err || !j->cwd || !j->argc)
        return "a field is missing (u, g, i, o, e, d, a)";
    if (j->uid == 0 || j->gid == 0)
        return "a call never runs as root";
    return NULL;
}

static void say(const char *what, int err)
{
    /* in the child: stderr is the call's stderr file */
    const char *pre = "fncall: cannot start the call: ";
    const char *msg = strerror(err);
    (void)!write(2, pre, strlen(pre));
    (void)!write(2, what, strlen(what));
    (void)!write(2, ": ", 2);
    (void)!write(2, msg, strlen(msg));
    (void)!write(2, "\n", 1);
}

static int limit(int res, rlim_t soft, rlim_t hard)
{
    struct rlimit r = {soft, hard};
    return setrlimit(res, &r);
}

/* The child after vfork: system calls only, then execve or _exit(127). */
static void child(const struct job *j)
{
    const char *step = "setsid";
    if (setsid() < 0)
        goto fail;
    int fds[3];
    step = "open stdin";
    if ((fds[0] = open(j->in, O_RDONLY)) < 0)
        goto fail;
    step = "open stdout";
    if ((fds[1] = open(j->out, O_WRONLY | O_CREAT | O_TRUNC, 0600)) < 0)
        goto fail;
    step = "open stderr";
    if ((fds[2] = open(j->err, O_WRONLY | O_CREAT | O_TRUNC, 0600)) < 0)
        goto fail;
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], 100 + i) < 0)  /* out of the way of 0-2 first */
            goto fail;
    for (int i = 0; i < 3; i++)
        if (dup2(100 + i, i) < 0)
            goto fail;
    step = "close_range";
    if (syscall(SYS_close_range, 3u, ~0u, 0u) < 0)
        goto fail;
    step = "chdir";
    if (chdir(j->cwd) < 0)
        goto fail;
    step = "setrlimit";
    if (limit(RLIMIT_CORE, 0, 0) < 0)
        goto fail;
    if (j->fsize && limit(RLIMIT_FSIZE, (rlim_t)j->fsize, (rlim_t)j->fsize) < 0)
        goto fail;
    if (j->cpu_s > 0) {
        rlim_t soft = (rlim_t)(j->cpu_s + 0.999);
        if (soft < 1)
            soft = 1;
        if (limit(RLIMIT_CPU, soft, soft + 1) < 0)
            goto fail;
    }
    if (j->as_bytes && limit(RLIMIT_AS, (rlim_t)j->as_bytes, (rlim_t)j->as_bytes) < 0)
        goto fail;
    int oom = open("/proc/self/oom_score_adj", O_WRONLY);
    if (oom >= 0) {
        (void)!write(oom, "1000", 4);
        close(oom);
    }
    step = "drop privileges";
    if (syscall(SYS_setgroups, 0, NULL) < 0 ||
        syscall(SYS_setresgid, j->gid, j->gid, j->gid) < 0 ||
        syscall(SYS_setresuid, j->uid, j->uid, j->uid) < 0)
        goto fail;
    step = j->argv[0];
    if (strchr(j->argv[0], '/')) {
        execve(j->argv[0], j->argv, j->envp);
        goto fail;
    }
    /* execvp's search, through the job's PATH (not this process's environment) */
    int seen_eacces = 0;
    const char *p = j->path;
    char full[4096];
    for (;;) {
        const char *colon = strchr(p, ':');
        size_t dl = colon ? (size_t)(colon - p) : strlen(p);
        size_t nl = strlen(j->argv[0]);
        if (dl + 1 + nl < sizeof full) {
            if (dl == 0) {
                memcpy(full, j->argv[0], nl + 1);
            } else {
                memcpy(full, p, dl);
                full[dl] = '/';
                memcpy(full + dl + 1, j->argv[0], nl + 1);
            }
            execve(full, j->argv, j->envp);
            if (errno == EACCES)
                seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR)
                goto fail;
        }
        if (!colon)
            break;
        p = colon + 1;
    }
    errno = seen_eacces ? EACCES : ENOENT;
fail:
    say(step, errno);
    _exit(127);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int answer(const char *text)
{
    return send(CHAN, text, strlen(text), MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static int answer_error(const char *what, int err)
{
    char out[512];
    /* strerror texts and our own messages hold no quote or backslash */
    snprintf(out, sizeof out, "{\"error\": \"fncall-spawn: %s%s%s\"}", what,
             err ? ": " : "", err ? strerror(err) : "");
    return answer(out);
}

static int run(struct job *j)
{
    double t0 = now();
    pid_t pid = vfork();
    if (pid < 0)
        return answer_error("vfork", errno);
    if (pid == 0)
        child(j);  /* never returns */
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int timed_out = 0;
    if (pidfd >= 0 && j->wall_s > 0) {
        double deadline = t0 + j->wall_s;
        for (;;) {
            double left = deadline - now();
            struct pollfd pfd = {pidfd, POLLIN, 0};
            int r = left > 0 ? poll(&pfd, 1, (int)(left * 1000.0) + 1) : 0;
            if (r > 0)
                break;
            if (r < 0 && errno == EINTR)
                continue;
            if (now() >= deadline || r < 0) {
                timed_out = 1;
                /* this call's main process, and nothing else: its own pidfd */
                syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
                break;
            }
        }
    }
    int status;
    struct rusage ru;
    pid_t got;
    while ((got = wait4(pid, &status, 0, &ru)) < 0 && errno == EINTR)
        ;
    if (pidfd >= 0)
        close(pidfd);
    if (got < 0)
        return answer_error("wait4", errno);
    double wall = now() - t0;
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    char out[256], code[16] = "null", sig[16] = "null";
    if (WIFEXITED(status))
        snprintf(code, sizeof code, "%d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(sig, sizeof sig, "%d", WTERMSIG(status));
    snprintf(out, sizeof out,
             "{\"exit_code\": %s, \"signal\": %s, \"timed_out\": %s, \"cpu_s\": %.6f, "
             "\"wall_s\": %.6f, \"rss_bytes\": %ld}",
             code, sig, timed_out ? "true" : "false", cpu, wall, ru.ru_maxrss * 1024L);
    return answer(out);
}

int main(int argc, char **argv)
{
    const char *host_pidns = NULL;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--host-pidns") == 0)
            host_pidns = argv[i + 1];
    char why[256];
    if (guard(host_pidns, why, sizeof why) < 0) {
        fprintf(stderr, "fncall-spawn: refusing to run: %s\n", why);
        return REFUSED;
    }
    /* what the io process's interpreter set (SIGPIPE, SIGXFSZ ignored) is not the call's */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; s++)
        sigaction(s, &dfl, NULL);  /* EINVAL for SIGKILL, SIGSTOP, libc's own: ignored */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (;;) {
        ssize_t n = recv(CHAN, buf, MAX_JOB + 1, MSG_TRUNC);
        if (n == 0)
            return 0;  /* the io process is gone */
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        struct job j;
        const char *bad = n > MAX_JOB ? "a job larger than 256 KiB" : parse(buf, (size_t)n, &j);
        int r = bad ? answer_error(bad, 0) : run(&j);
        if (r < 0)
            return 1;
    }
}
