/* sbx-init's internals, shared by its subsystems (one file each):
 *
 *   main.c       start-up (options, policies, capabilities), the epoll loop, what
 *                each frame type means
 *   io.c         buffers, epoll registrations, logging, the clock
 *   control.c    the control channel (protocol.h): framing, the outgoing queue, transports
 *   exec.c       an exec's life: start, output and stdin with flow control, end;
 *                killing every process of the sandbox (SBX_KILL_ALL)
 *   files.c      file transfers in and out of the sandbox (SBX_FILE_*)
 *   child.c      what an exec's child does between fork and execve, confinement included
 *   grader.c     a grader exec's view of the layers (SBX_EXEC_GRADER)
 *   spare.c      the child forked ahead of the next exec
 *   cgroup.c     per-exec cgroups, over one of:
 *   cgroup-v1.c  a freezer (+ memory) hierarchy, or
 *   cgroup-v2.c  the unified hierarchy
 *
 * All of sbx-init's state is one `struct sbx`, made by main() and handed to
 * every function that needs it; the only other static data are buffers too
 * large for a stack.
 */
#ifndef SBX_INIT_H
#define SBX_INIT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/types.h>

#include "protocol.h"

#define DRAIN_NS       (20 * 1000000ull) /* output grace after the main process ends */
#define PTY_SLACK      (1u << 20)        /* bound on a pty's output still in flight (held) */
#define OUTQ_HIGH      (1u << 20)        /* stop reading pipes above this much unsent */
#define STDIN_MAX      (4u << 20)        /* stdin bytes buffered per exec */
#define MAX_PENDING_RM 1024
#define CG_NAME_MAX    24
#define SBX_MAX_LOWERS 64                /* layers of a grader view */

/* What an epoll event is about: the kind in the low byte, the exec's slot above. */
enum sbx_kind {
	K_LISTEN = 1, K_SIG, K_CLIENT, K_CLIENT_OUT, K_OUT, K_ERR, K_IN, K_ERRPIPE, K_NOTIF
};

struct sbx_buf {
	uint8_t *p;
	size_t off, len, cap; /* unsent data is p[off..len) */
};

/* One exec, from SBX_EXEC to SBX_END (a slot of sbx.execs). */
struct exec {
	int used;
	uint32_t id;
	pid_t pid;
	int out_fd, err_fd, in_fd, errpipe;
	int notif;           /* seccomp listener of the exec's filter, -1 if none */
	uint32_t ev_dropped; /* its denials not sent since the last one sent */
	int pty;             /* out_fd is the pty master; stdin goes there too */
	int started, failed, reaped, orphan;
	int execd;           /* the child reached execve ('X' on the error socket) */
	/* Output bytes still owed from the main process: what each of out_fd and
	 * err_fd held when it was reaped (everything it wrote is in the pipe by
	 * then), counted down as read.  A read finding nothing (EAGAIN) clears
	 * it: a pipe is FIFO, and on a pty master n_tty_read flushes the flip
	 * buffers before it answers EAGAIN. */
	uint64_t held[2];
	int status;
	struct rusage ru;
	uint64_t t0, t_end, deadline, drain_deadline;
	uint64_t limit, total;
	int64_t window;
	uint32_t reason;     /* forced end reason (timeout, output limit, killed), else 0 */
	int stdin_wanted, stdin_eof;
	struct sbx_buf in;
	char cg[CG_NAME_MAX]; /* per-exec cgroup name, "" if none */
	uint64_t oom_base;    /* the sandbox's OOM kills when it started */
};

struct sbx_cg;

/* One cgroup hierarchy's way of doing the per-exec cgroup's work. */
struct cg_ops {
	/* Make cgroup `name`; fill join[] with fds (close-on-exec) of the files a
	 * process writes "0" into to join it.  -1 with errno set and `*what`
	 * naming the call that failed. */
	int (*make)(struct sbx_cg *cg, const char *name, int join[2], const char **what);
	/* Remove it; -1 if it still exists (busy). */
	int (*remove)(struct sbx_cg *cg, const char *name);
	/* Kill every process in it; -1 if that could not be done. */
	int (*kill)(struct sbx_cg *cg, const char *name);
	/* OOM kills in the sandbox's memory cgroup so far. */
	uint64_t (*oom_kills)(struct sbx_cg *cg);
};

struct sbx_cg {
	int mode;                    /* enum sbx_cgroup_mode */
	const struct cg_ops *ops;    /* NULL with SBX_CGROUP_NONE */
	int freezer, memory, v2;     /* the delegated directories (-1: none) */
	uint64_t counter;            /* names e1, e2, ... */
	char pending_rm[MAX_PENDING_RM][CG_NAME_MAX]; /* still busy when their exec ended */
	int n_pending_rm;
	int clone_into;              /* v2: 1 clone3 into the cgroup works, -1 refused, 0 untried */
};

/* How each exec is confined (child.c, grader.c): read at start-up. */
struct sbx_policy {
	int ll_ruleset;           /* prepared Landlock ruleset, -1: none */
	uint32_t ll_flags;
	uint8_t *sc_prog;         /* seccomp program, NULL: none */
	size_t sc_len;
	const char *aa_profile;   /* AppArmor profile for execs, NULL: none */
	const char *aa_grader;    /* ... for grader execs (SBX_EXEC_GRADER) */
	int lowers[SBX_MAX_LOWERS]; /* the layers for grader views (detached, bottom first) */
	int n_lowers;             /* 0: no grader views in this sandbox */
	int scratch_fd;           /* the scratch dir (upper/, work/, empty/), -1: none */
	int upper_fd;             /* a guest: its upper disk's root, statfs'd at each exec's
				   * end (SBX_EV_DISK_FULL), -1: none (a container's is the
				   * host's to watch) */
	int upper_full;           /* upper_fd was full at the last exec's end */
	const char *grader_paths; /* ':'-separated paths a grader view replaces */
	int restrict_caps;        /* each exec drops to `caps` (a guest: guest.c) */
	uint64_t caps;
};

/* The child forked ahead of the next exec (spare.c); pid 0: none. */
struct sbx_spare {
	pid_t pid;
	int sock;              /* the request goes here */
	char cg[CG_NAME_MAX];  /* the cgroups it moved into */
	uint64_t idle_ns;      /* -I: dropped when no exec started or ended this long; 0: kept */
	uint64_t last_use;     /* when an exec last started or ended (or sbx-init started) */
};

struct sbx;

/* The control channel (control.c) over a pluggable transport. */
struct sbx_ctl {
	int rfd, wfd;     /* the client: read here, write there (often one fd); -1: none */
	/* The transport: a new client, if it has one now (-1 if not).  Asked when
	 * listen_fd is readable, and every retry_ms while there is no client. */
	int (*open)(struct sbx_ctl *c, int *rfd, int *wfd);
	int listen_fd;    /* -1: none */
	int retry_ms;     /* -1: never */
	/* What the frames mean (main.c), and what a lost client means. */
	void (*on_frame)(struct sbx *s, const struct sbx_hdr *h, uint8_t *payload);
	void (*on_drop)(struct sbx *s);
	struct sbx_buf outq;
	int broken;       /* a frame could not be queued: the client is dropped */
	/* SBX_QUIESCE: nothing beyond the first `hold_left` bytes of outq is
	 * written until the client's next frame */
	int quiesced;
	size_t hold_left;
	uint8_t inbuf[sizeof(struct sbx_hdr) + SBX_MAX_PAYLOAD];
	size_t inlen;
};

/* Why a step failed: an errno value, the step and what it was about. */
struct sbx_fail {
	int code;
	const char *what, *arg;
};

static inline int sbx_fail(struct sbx_fail *f, int code, const char *what, const char *arg)
{
	f->code = code;
	f->what = what;
	f->arg = arg;
	return -1;
}

/* A file transfer (files.c): a put being written, or a get being sent. */
struct xfer {
	int used, get;
	uint32_t id;
	int fd;             /* put: the temporary file; get: the file */
	int dirfd;          /* put: the target's directory */
	uint64_t bytes;
	int64_t window;     /* get: bytes it may send before more credit */
	uint32_t mode, uid, gid;
	char path[SBX_MAX_PATH];
	char name[256];     /* put: the target's name in dirfd */
	char tmp[64];       /* put: the temporary file's name in dirfd, "" once renamed */
};

struct sbx {
	int ep;              /* the epoll instance */
	int sig_fd;          /* SIGCHLD */
	int interest_dirty;  /* epoll interests to recompute (update_interest) */
	uint64_t ev_tat;     /* GCRA theoretical arrival time of the next event, ns */
	struct sbx_ctl ctl;
	struct sbx_cg cg;
	struct sbx_policy pol;
	struct sbx_spare spare;
	struct exec execs[SBX_MAX_EXECS];
	int root_fd;         /* "/" as the sandbox sees it: file transfers resolve in it */
	struct xfer xfers[SBX_MAX_FILES];
};

/* What an exec's child needs (child.c). */
struct child_args {
	const struct sbx_exec *req;
	const char *cwd;
	char **argv, **envp;
	int in_r, out_w, err_w, errpipe_w, join[2];
	const char *pty_name;
};

/* io.c */
uint64_t now_ns(void);
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int buf_reserve(struct sbx_buf *b, size_t more);
void buf_free(struct sbx_buf *b);
void ep_add(struct sbx *s, int fd, int kind, int slot, uint32_t events);
void ep_set(struct sbx *s, int fd, int kind, int slot, uint32_t events);
void ep_close(struct sbx *s, int *fd);
void set_nonblock(int fd);

/* control.c */
void ctl_send(struct sbx *s, uint16_t type, uint32_t exec_id, const void *a, size_t alen,
	      const void *b, size_t blen);
void ctl_error(struct sbx *s, uint32_t exec_id, int code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
size_t ctl_pending(const struct sbx *s);
void ctl_quiesce(struct sbx *s, uint32_t id);
int ctl_connected(const struct sbx *s);
void ctl_open(struct sbx *s);
void ctl_on_readable(struct sbx *s);
void ctl_flush(struct sbx *s);
void ctl_drop_if_broken(struct sbx *s);
void ctl_update_interest(struct sbx *s);
int ctl_transport_listen(struct sbx *s, int fd);
void ctl_transport_stream(struct sbx *s, int rfd, int wfd);

/* exec.c */
void exec_init_slots(struct sbx *s);
void exec_start(struct sbx *s, uint32_t id, uint8_t *payload, uint32_t len);
void exec_message(struct sbx *s, const struct sbx_hdr *h, const uint8_t *p);
unsigned exec_count(const struct sbx *s);
void exec_orphan_all(struct sbx *s);
void exec_on_errpipe(struct sbx *s, struct exec *e);
void exec_on_notif(struct sbx *s, struct exec *e, uint32_t events);
void exec_on_output(struct sbx *s, struct exec *e, int which);
void exec_on_stdin_writable(struct sbx *s, struct exec *e);
void exec_on_reaped(struct sbx *s, pid_t pid, int status, const struct rusage *ru);
void exec_check_deadlines(struct sbx *s, uint64_t now);
int exec_next_timeout_ms(const struct sbx *s, uint64_t now);
void exec_update_interest(struct sbx *s);
void exec_kill_all(struct sbx *s, uint32_t id);
void exec_reap(struct sbx *s);

/* files.c */
void files_init(struct sbx *s);
void files_message(struct sbx *s, const struct sbx_hdr *h, const uint8_t *p);
void files_pump(struct sbx *s);
int files_active(const struct sbx *s);
void files_drop_all(struct sbx *s);

/* child.c */
char **split_strings(char *p, size_t len, uint32_t n, char **out);
void exec_arrays(const struct sbx_exec *req, char **strs, char ***argv, char ***envp);
void child_fail(int fd, int code, const char *what, const char *arg) __attribute__((noreturn));
void child_run(const struct sbx_policy *pol, struct child_args *a) __attribute__((noreturn));

/* grader.c */
int grader_view(const struct sbx_policy *pol, uint32_t uid, uint32_t gid, struct sbx_fail *f);

/* spare.c */
void spare_make(struct sbx *s);
void spare_drop(struct sbx *s, int kill_it);
void spare_note_use(struct sbx *s, uint64_t now);
int spare_next_timeout_ms(const struct sbx *s, uint64_t now);
void spare_check_idle(struct sbx *s, uint64_t now);
pid_t spare_take(struct sbx *s, struct exec *e, const struct child_args *a,
		 const uint8_t *payload, uint32_t len);

/* cgroup.c */
void cg_init(struct sbx_cg *cg);
void cg_make(struct sbx_cg *cg, char name[CG_NAME_MAX], int join[2]);
pid_t cg_fork(struct sbx_cg *cg, const char *name, int join[2]);
void cg_release(struct sbx_cg *cg, char name[CG_NAME_MAX]);
void cg_retry_pending(struct sbx_cg *cg);
int cg_kill(struct sbx_cg *cg, const char *name);
uint64_t cg_oom_kills(struct sbx_cg *cg);
int cg_write(int dirfd, const char *cg, const char *file, const char *val);
ssize_t cg_read(int dirfd, const char *cg, const char *file, char *out, size_t size);
uint64_t cg_key(int dirfd, const char *cg, const char *file, const char *key);
extern const struct cg_ops cg_v1_ops, cg_v2_ops;

#endif
