/* The control protocol between edged and sbx-init.
 *
 * Transport: one byte stream, whatever carries it (control.c).  A container's
 * sbx-init inherits a listening unix socket (bound by the spawner at a
 * host-only path, /run/edged/sandboxes/<id>/ctl.sock, mode 0700 directory) and
 * serves one client at a time; a new connection replaces the old one, which is
 * how a restarted daemon re-acquires a live sandbox.  The socket is
 * close-on-exec in sbx-init and its path does not exist inside the sandbox, so
 * workload processes cannot reach it.  A guest's sbx-init speaks it over a
 * virtio-serial port or a vsock connection; `sbx-init -c` over any connected
 * fd or pipe pair.
 *
 * Framing: every message is a 16-byte header followed by `len` payload bytes.
 * All integers are little-endian.  Strings in payloads are NUL-terminated.
 * Python mirror: edged/sbxinit/protocol.py (keep both in step).
 *
 * An exec belongs to the connection that started it: if that connection goes
 * away, sbx-init kills the exec's whole process tree (no END is sent); so are its
 * file transfers forgotten (a put's temporary file removed).
 *
 * Output: every byte an exec's main process wrote before it ended comes
 * before its END, however long sbx-init was kept from running (it shares the
 * sandbox's CPU quota); output of background processes still holding the
 * pipes is sent for a short grace after that, then the exec ends.  An exec
 * whose program never started (fork failed: EAGAIN at the pids limit; its
 * process died before execve: ECHILD; the program could not be run: its
 * errno) is answered with SBX_ERROR, never with STARTED.  One whose timeout
 * passed, or that was killed (SBX_KILL, SBX_KILL_ALL), before its program
 * started is not a failure to start: STARTED, then END with that reason.
 *
 * Validation: a frame with an unknown type, a wrong payload size, bad strings
 * or an unknown exec id is answered with SBX_ERROR (exec_id echoed) and
 * ignored.  A header announcing more than SBX_MAX_PAYLOAD bytes cannot be
 * skipped safely, so sbx-init answers SBX_ERROR and closes the connection.
 * Nothing a client sends can make sbx-init exit.
 */
#ifndef SBX_PROTOCOL_H
#define SBX_PROTOCOL_H

#include <stdint.h>

#define SBX_PROTO_VERSION 1u

#define SBX_MAX_PAYLOAD   (1u << 20)  /* any frame */
#define SBX_MAX_DATA      (64u << 10) /* one STDIN / STDOUT / STDERR chunk */
#define SBX_MAX_STRINGS   8192u       /* argc + envc */
#define SBX_MAX_EXECS     256u        /* execs alive at once per sandbox */
#define SBX_WINDOW        (256u << 10) /* initial output credit per exec, bytes */
#define SBX_MAX_ERROR_MSG 512u

struct sbx_hdr {
	uint32_t len;     /* payload bytes after this header, <= SBX_MAX_PAYLOAD */
	uint16_t type;    /* enum sbx_type */
	uint16_t flags;   /* 0 (reserved) */
	uint32_t exec_id; /* client-chosen, nonzero for exec messages; 0 otherwise */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_hdr) == 16, "sbx_hdr is 16 bytes");

enum sbx_type {
	/* client -> sbx-init */
	SBX_HELLO = 1,      /* no payload; answered with SBX_HELLO_OK.  flags
			     * SBX_HELLO_NEW_CLIENT: this is another client than the one
			     * before on the same stream (a restored microVM's new daemon):
			     * the previous one's execs and transfers go, as if it had
			     * disconnected, before the answer */
	SBX_EXEC = 2,       /* struct sbx_exec + strings; answered with STARTED or ERROR */
	SBX_STDIN = 3,      /* 1..SBX_MAX_DATA bytes for the exec's stdin */
	SBX_STDIN_EOF = 4,  /* no payload: close the exec's stdin */
	SBX_SIGNAL = 5,     /* struct sbx_signal: signal the exec's main process */
	SBX_RESIZE = 6,     /* struct sbx_resize: pty window size */
	SBX_KILL = 7,       /* no payload: kill the exec's whole tree (END reason KILLED) */
	SBX_CREDIT = 8,     /* struct sbx_credit: client consumed this many output bytes */
	/* What a guest needs without host-side access to the sandbox (files.c, exec.c);
	 * exec_id is then a request id of the client's, nonzero, unique among its
	 * running requests; every request ends with SBX_DONE or SBX_ERROR. */
	SBX_KILL_ALL = 9,    /* no payload: SIGKILL every process of the sandbox but
			      * sbx-init, until none is left (running execs end KILLED) */
	SBX_FILE_PUT = 10,   /* struct sbx_file + path: a file to write, then FILE_DATA
			      * frames, then FILE_END; it appears (renamed into place) only
			      * whole, owned uid:gid with `mode` */
	SBX_FILE_DATA = 11,  /* 1..SBX_MAX_DATA bytes of a transfer, either way */
	SBX_FILE_END = 12,   /* no payload: the put's data is complete */
	SBX_FILE_GET = 13,   /* struct sbx_file (only flags: 0) + path: the file comes back
			      * as FILE_DATA frames under a credit window, then DONE */
	SBX_FILE_CREDIT = 14, /* struct sbx_credit: client consumed this much of a get */
	SBX_FILE_ABORT = 15, /* no payload: forget the transfer (a put leaves nothing); no
			      * answer */
	SBX_QUIESCE = 16,    /* no payload: answered with SBX_DONE (count 0) after every frame
			      * queued before it; after that sbx-init sends nothing (execs run
			      * on, their output waits in its queue and the pipes) until the
			      * client's next frame (HELLO), or a new client.  How a microVM is
			      * paused with its execs: the host takes everything in flight,
			      * saves the VM in that quiet state and ends its VMM; the restored
			      * guest's sbx-init resumes with the same connection and speaks
			      * again when the host does (guest.h) */

	/* sbx-init -> client */
	SBX_HELLO_OK = 0x81, /* struct sbx_hello */
	SBX_STARTED = 0x82,  /* struct sbx_started: the exec's program is running */
	SBX_STDOUT = 0x83,   /* output bytes (pty execs: the terminal's output) */
	SBX_STDERR = 0x84,   /* output bytes */
	SBX_END = 0x85,      /* struct sbx_end: exactly one per started exec, after all output */
	SBX_ERROR = 0x86,    /* struct sbx_error + message bytes (<= SBX_MAX_ERROR_MSG) */
	SBX_EVENT = 0x87,    /* struct sbx_event: a security event of the exec (exec_id) */
	SBX_DONE = 0x88,     /* struct sbx_done: a KILL_ALL, FILE_PUT or FILE_GET is over */
};

#define SBX_MAX_FILES 16u     /* transfers at once */
#define SBX_MAX_PATH  4096u   /* a transfer's path, NUL included */

/* SBX_FILE_PUT / SBX_FILE_GET payload: this struct, then the absolute path,
 * NUL-terminated, resolved inside the sandbox's root (never through a /proc
 * magic link; a put's target directory on the root's own filesystem). */
struct sbx_file {
	uint32_t mode;  /* put: permission bits (<= 07777) */
	uint32_t uid;   /* put: owner, inside the sandbox's user namespace */
	uint32_t gid;
	uint32_t flags; /* 0 (reserved) */
};
_Static_assert(sizeof(struct sbx_file) == 16, "sbx_file is 16 bytes");

struct sbx_done {
	uint64_t count;    /* KILL_ALL: processes killed; FILE_*: bytes written or sent */
	uint64_t reserved;
};
_Static_assert(sizeof(struct sbx_done) == 16, "sbx_done is 16 bytes");

/* SBX_HELLO header flags */
#define SBX_HELLO_NEW_CLIENT 0x1u

/* SBX_EXEC flags */
#define SBX_EXEC_STDIN 0x1u /* stdin is a pipe fed by SBX_STDIN; otherwise /dev/null */
#define SBX_EXEC_PTY   0x2u /* run on a new pseudo-terminal (stdin/stdout/stderr) */
#define SBX_EXEC_GRADER 0x4u /* a grader's view: the -G paths as the layers hold them */

/* SBX_EXEC payload: this struct, then `1 + argc + envc` NUL-terminated strings:
 * cwd, argv[0..argc), env[0..envc) ("KEY=VALUE").  The exec's environment is
 * that env over a login shell's defaults (PATH, HOME, USER, LOGNAME, SHELL from
 * the uid's /etc/passwd entry, LANG, LC_ALL, TERM on a pty: the list is in
 * child.c); a variable the env gives is never changed.  argv[0] is looked up
 * in that PATH when it has no '/'. */
struct sbx_exec {
	uint32_t uid;          /* inside the sandbox's user namespace */
	uint32_t gid;
	uint64_t timeout_ms;   /* wall time before the tree is killed; 0: none */
	uint64_t output_limit; /* stdout+stderr bytes before the tree is killed; 0: none */
	uint32_t flags;        /* SBX_EXEC_* */
	uint16_t rows;         /* pty size; 0: 24x80 */
	uint16_t cols;
	uint32_t argc;         /* >= 1 */
	uint32_t envc;
};
_Static_assert(sizeof(struct sbx_exec) == 40, "sbx_exec is 40 bytes");

struct sbx_signal {
	int32_t sig; /* 1..64 */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_signal) == 8, "sbx_signal is 8 bytes");

struct sbx_resize {
	uint16_t rows;
	uint16_t cols;
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_resize) == 8, "sbx_resize is 8 bytes");

struct sbx_credit {
	uint32_t bytes; /* output bytes of this exec the client has consumed */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_credit) == 8, "sbx_credit is 8 bytes");

/* How the exec's tree is confined and killed. */
enum sbx_cgroup_mode {
	SBX_CGROUP_NONE = 0, /* session sweep only */
	SBX_CGROUP_V1 = 1,   /* per-exec freezer (+memory) cgroup: freeze, kill all, thaw */
	SBX_CGROUP_V2 = 2,   /* per-exec cgroup, cgroup.kill */
};

struct sbx_hello {
	uint32_t version;     /* SBX_PROTO_VERSION */
	uint32_t cgroup_mode; /* enum sbx_cgroup_mode */
	uint32_t execs;       /* execs alive now */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_hello) == 16, "sbx_hello is 16 bytes");

struct sbx_started {
	uint32_t pid; /* the exec's main process, in the sandbox's pid namespace */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_started) == 8, "sbx_started is 8 bytes");

enum sbx_reason {
	SBX_EXITED = 1,       /* exit_code set */
	SBX_SIGNALLED = 2,    /* signal set */
	SBX_TIMEOUT = 3,      /* timeout_ms passed; tree killed */
	SBX_OOM = 4,          /* a process of the exec was killed by the OOM killer */
	SBX_OUTPUT_LIMIT = 5, /* output_limit reached; output up to the limit was sent */
	SBX_KILLED = 6,       /* SBX_KILL */
};

struct sbx_end {
	uint32_t reason;      /* enum sbx_reason */
	int32_t exit_code;    /* -1 unless the main process exited */
	int32_t signal;       /* signal that ended the main process, 0 if none */
	uint32_t reserved;
	uint64_t duration_ns; /* from fork to the main process's end */
	uint64_t peak_memory; /* bytes: the exec cgroup's peak, else the main process's max RSS; 0 unknown */
};
_Static_assert(sizeof(struct sbx_end) == 32, "sbx_end is 32 bytes");

struct sbx_error {
	int32_t code; /* errno value */
	uint32_t reserved;
	/* then the message, not NUL-terminated */
};
_Static_assert(sizeof(struct sbx_error) == 8, "sbx_error is 8 bytes");

/* SBX_EVENT kinds */
#define SBX_EV_SECCOMP 1u /* a syscall the seccomp profile denies (failed with EPERM) */
#define SBX_EV_DROPPED 2u /* only `dropped` is set: denials not sent one by one (rate
			   * limit or busy client) since the last event, sent before an
			   * exec's SBX_END */
#define SBX_EV_DISK_FULL 3u /* a guest's upper disk has no free block or inode at an
			     * exec's end (sent once until it has room again; before the
			     * SBX_END): args[0] its size in bytes */

struct sbx_event {
	uint32_t kind;    /* SBX_EV_* */
	uint32_t pid;     /* thread id in the sandbox's pid namespace */
	int32_t nr;       /* syscall number */
	uint32_t arch;    /* AUDIT_ARCH_* */
	uint64_t args[6]; /* syscall arguments */
	uint64_t ip;      /* instruction pointer */
	uint32_t dropped; /* events dropped (client busy or absent) before this one */
	uint32_t reserved;
	char comm[16];    /* the thread's name, NUL-padded */
};
_Static_assert(sizeof(struct sbx_event) == 96, "sbx_event is 96 bytes");

#endif
