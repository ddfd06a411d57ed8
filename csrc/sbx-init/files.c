/* File transfers over the control channel (SBX_FILE_PUT / SBX_FILE_GET): what a
 * guest's client needs without host-side access to the sandbox's filesystem (a
 * container's daemon reads and writes through /proc/<pid>/root instead).
 *
 * Paths resolve inside sbx-init's root (the sandbox's "/") with openat2(2)'s
 * RESOLVE_IN_ROOT, so neither ".." nor a symlink the workload planted leads out,
 * and RESOLVE_NO_MAGICLINKS, so no /proc/<pid>/fd link does either.  A put
 * writes a temporary file in the target's directory (which must be on the
 * root's own filesystem: RESOLVE_NO_XDEV keeps writes out of /proc, /sys, /dev
 * and the read-only bind mounts of protected paths), sets its owner and mode,
 * and renames it over the target at FILE_END: a failed or abandoned put leaves
 * nothing, and a symlink at the target is replaced, never followed.  A get
 * sends a regular file back under a credit window (SBX_FILE_CREDIT), read only
 * while the outgoing queue is below its high-water mark. */
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sbx-init.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

static int openat2_in_root(int dirfd, const char *path, int flags, uint64_t resolve)
{
	struct open_how how = {.flags = (uint64_t)flags | O_CLOEXEC, .resolve = resolve};

	return (int)syscall(SYS_openat2, dirfd, path, &how, sizeof(how));
}

static struct xfer *find_xfer(struct sbx *s, uint32_t id)
{
	for (unsigned i = 0; i < SBX_MAX_FILES; i++)
		if (s->xfers[i].used && s->xfers[i].id == id)
			return &s->xfers[i];
	return NULL;
}

static void xfer_free(struct xfer *x)
{
	if (x->tmp[0] && x->dirfd >= 0)
		unlinkat(x->dirfd, x->tmp, 0);
	if (x->fd >= 0)
		close(x->fd);
	if (x->dirfd >= 0)
		close(x->dirfd);
	memset(x, 0, sizeof(*x));
	x->fd = x->dirfd = -1;
}

/* Fail transfer `x` with the call that failed (errno), and forget it. */
static void xfer_fail(struct sbx *s, struct xfer *x, const char *what)
{
	int code = errno ? errno : EIO;

	ctl_error(s, x->id, code, "file `%s`: %s: %s", x->path, what, strerror(code));
	xfer_free(x);
}

void files_init(struct sbx *s)
{
	for (unsigned i = 0; i < SBX_MAX_FILES; i++) {
		memset(&s->xfers[i], 0, sizeof(s->xfers[i]));
		s->xfers[i].fd = s->xfers[i].dirfd = -1;
	}
}

/* The client went away: abandoned puts leave nothing behind. */
void files_drop_all(struct sbx *s)
{
	for (unsigned i = 0; i < SBX_MAX_FILES; i++)
		if (s->xfers[i].used)
			xfer_free(&s->xfers[i]);
}

int files_active(const struct sbx *s)
{
	for (unsigned i = 0; i < SBX_MAX_FILES; i++)
		if (s->xfers[i].used && s->xfers[i].get && s->xfers[i].window > 0)
			return 1;
	return 0;
}

/* A new transfer from a PUT or GET payload; NULL (answered) if refused. */
static struct xfer *xfer_new(struct sbx *s, uint32_t id, const uint8_t *p, uint32_t len,
			     struct sbx_file *f)
{
	struct xfer *x = NULL;
	const char *path = (const char *)p + sizeof(*f);
	size_t plen = len - sizeof(*f);

	if (len < sizeof(*f) + 2 || plen > SBX_MAX_PATH || path[plen - 1] != 0 ||
	    strlen(path) != plen - 1 || path[0] != '/') {
		ctl_error(s, id, EINVAL, "file: the path must be absolute, NUL-terminated, at "
			  "most %u bytes", SBX_MAX_PATH);
		return NULL;
	}
	memcpy(f, p, sizeof(*f));
	if (f->flags || f->mode > 07777) {
		ctl_error(s, id, EINVAL, "file `%s`: flags %#x / mode %#o out of range", path,
			  f->flags, f->mode);
		return NULL;
	}
	if (!id || find_xfer(s, id)) {
		ctl_error(s, id, EEXIST, "file `%s`: request id %u is 0 or in use", path, id);
		return NULL;
	}
	for (unsigned i = 0; i < SBX_MAX_FILES && !x; i++)
		if (!s->xfers[i].used)
			x = &s->xfers[i];
	if (!x) {
		ctl_error(s, id, EAGAIN, "file `%s`: %u transfers already", path, SBX_MAX_FILES);
		return NULL;
	}
	x->used = 1;
	x->id = id;
	snprintf(x->path, sizeof(x->path), "%s", path);
	return x;
}

static void file_put(struct sbx *s, uint32_t id, const uint8_t *p, uint32_t len)
{
	struct sbx_file f;
	struct xfer *x = xfer_new(s, id, p, len, &f);
	char dir[SBX_MAX_PATH];
	char *slash;

	if (!x)
		return;
	snprintf(dir, sizeof(dir), "%s", x->path);
	slash = strrchr(dir, '/');
	snprintf(x->name, sizeof(x->name), "%s", slash + 1);
	if (!x->name[0] || !strcmp(x->name, ".") || !strcmp(x->name, "..")) {
		errno = EISDIR;
		return xfer_fail(s, x, "not a file name");
	}
	if (slash == dir)
		slash[1] = 0; /* "/" */
	else
		*slash = 0;
	x->dirfd = openat2_in_root(s->root_fd, dir + 1 /* relative to the root */,
				   O_PATH | O_DIRECTORY,
				   RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV);
	if (x->dirfd < 0 && dir[1] == 0)
		x->dirfd = fcntl(s->root_fd, F_DUPFD_CLOEXEC, 3);
	if (x->dirfd < 0)
		return xfer_fail(s, x, "open its directory (openat2)");
	snprintf(x->tmp, sizeof(x->tmp), ".sbx-put-%u-%ld", id, (long)getpid());
	x->fd = openat(x->dirfd, x->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
		       0600);
	if (x->fd < 0) {
		x->tmp[0] = 0;
		return xfer_fail(s, x, "create the temporary file (openat)");
	}
	x->mode = f.mode;
	x->uid = f.uid;
	x->gid = f.gid;
}

static void file_put_data(struct sbx *s, struct xfer *x, const uint8_t *p, uint32_t len)
{
	size_t off = 0;

	while (off < len) {
		ssize_t n = write(x->fd, p + off, len - off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return xfer_fail(s, x, "write");
		off += (size_t)n;
	}
	x->bytes += len;
}

static void file_put_end(struct sbx *s, struct xfer *x)
{
	struct sbx_done done = {.count = x->bytes};

	if (fchown(x->fd, x->uid, x->gid) < 0)
		return xfer_fail(s, x, "fchown");
	if (fchmod(x->fd, x->mode) < 0)
		return xfer_fail(s, x, "fchmod");
	if (close(x->fd) < 0) {
		x->fd = -1;
		return xfer_fail(s, x, "close");
	}
	x->fd = -1;
	if (renameat(x->dirfd, x->tmp, x->dirfd, x->name) < 0)
		return xfer_fail(s, x, "rename into place");
	x->tmp[0] = 0;
	ctl_send(s, SBX_DONE, x->id, &done, sizeof(done), NULL, 0);
	xfer_free(x);
}

static void file_get(struct sbx *s, uint32_t id, const uint8_t *p, uint32_t len)
{
	struct sbx_file f;
	struct xfer *x = xfer_new(s, id, p, len, &f);
	struct stat st;

	if (!x)
		return;
	x->fd = openat2_in_root(s->root_fd, x->path + 1, O_RDONLY | O_NOCTTY | O_NONBLOCK,
				RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS);
	if (x->fd < 0)
		return xfer_fail(s, x, "open (openat2)");
	if (fstat(x->fd, &st) < 0)
		return xfer_fail(s, x, "fstat");
	if (!S_ISREG(st.st_mode)) {
		errno = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
		return xfer_fail(s, x, "not a regular file");
	}
	x->get = 1;
	x->window = SBX_WINDOW;
}

/* Send what the gets may send now: while each has credit and the queue room. */
void files_pump(struct sbx *s)
{
	uint8_t data[SBX_MAX_DATA];

	for (unsigned i = 0; i < SBX_MAX_FILES; i++) {
		struct xfer *x = &s->xfers[i];

		while (x->used && x->get && x->window > 0 && ctl_pending(s) < OUTQ_HIGH) {
			size_t want = x->window < (int64_t)sizeof(data) ? (size_t)x->window
								       : sizeof(data);
			ssize_t n = read(x->fd, data, want);

			if (n < 0 && errno == EINTR)
				continue;
			if (n < 0) {
				xfer_fail(s, x, "read");
				break;
			}
			if (n == 0) {
				struct sbx_done done = {.count = x->bytes};

				ctl_send(s, SBX_DONE, x->id, &done, sizeof(done), NULL, 0);
				xfer_free(x);
				break;
			}
			ctl_send(s, SBX_FILE_DATA, x->id, data, (size_t)n, NULL, 0);
			x->bytes += (uint64_t)n;
			x->window -= n;
		}
	}
}

/* SBX_FILE_PUT .. SBX_FILE_ABORT (checked by the caller). */
void files_message(struct sbx *s, const struct sbx_hdr *h, const uint8_t *p)
{
	struct xfer *x;

	if (h->type == SBX_FILE_PUT)
		return file_put(s, h->exec_id, p, h->len);
	if (h->type == SBX_FILE_GET)
		return file_get(s, h->exec_id, p, h->len);
	x = find_xfer(s, h->exec_id);
	if (!x && (h->type == SBX_FILE_CREDIT || h->type == SBX_FILE_ABORT))
		return; /* raced with the transfer's end */
	if (!x)
		return ctl_error(s, h->exec_id, ESRCH, "no transfer %u", h->exec_id);
	switch (h->type) {
	case SBX_FILE_ABORT:
		xfer_free(x);
		return;
	case SBX_FILE_DATA:
		if (x->get || !h->len || h->len > SBX_MAX_DATA)
			return ctl_error(s, h->exec_id, EINVAL, "file data: %u bytes for a %s",
					 h->len, x->get ? "get" : "put");
		return file_put_data(s, x, p, h->len);
	case SBX_FILE_END:
		if (x->get || h->len)
			return ctl_error(s, h->exec_id, EINVAL, "file end: not a put, or a payload");
		return file_put_end(s, x);
	case SBX_FILE_CREDIT: {
		struct sbx_credit c;

		if (!x->get || h->len != sizeof(c))
			return ctl_error(s, h->exec_id, EINVAL, "file credit: bad payload size %u",
					 h->len);
		memcpy(&c, p, sizeof(c));
		if (x->window < (int64_t)64 << 20)
			x->window += c.bytes;
		return;
	}
	}
}
