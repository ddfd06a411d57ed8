/* The control channel to edged (protocol.h): one client at a time, framed
 * messages both ways, an outgoing queue the loop flushes as the client takes
 * it.  Nothing a client sends can make sbx-init exit or block: a header
 * announcing too much is answered with SBX_ERROR and the connection dropped;
 * what a frame means is for the on_frame callback (main.c) to judge.
 *
 * The transport is pluggable: any byte stream, one fd both ways (a unix or
 * vsock connection, a virtio-serial port) or a pair (pipes).  Where clients
 * come from is the transport's open():
 *   listen   -l FD: a listening socket (unix, vsock); each accepted connection
 *            replaces the client (how a restarted daemon re-acquires a live
 *            sandbox);
 *   stream   -c FD or -c RFD:WFD: one client, given at start; once it is gone
 *            there is none (a pipe pair, a socketpair);
 * and a transport of its own may be set up by other start-up code (a guest's
 * port, which is re-opened while the host side is away: retry_ms). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sbx-init.h"

/* Queue one frame: header, then a[0..alen) and b[0..blen) as its payload.
 * Without a client, nothing (the exec's fate does not depend on being heard). */
void ctl_send(struct sbx *s, uint16_t type, uint32_t exec_id, const void *a, size_t alen,
	      const void *b, size_t blen)
{
	struct sbx_hdr h = {.len = (uint32_t)(alen + blen), .type = type, .exec_id = exec_id};
	struct sbx_buf *q = &s->ctl.outq;

	if (s->ctl.rfd < 0 || s->ctl.broken)
		return;
	if (buf_reserve(q, sizeof(h) + alen + blen) < 0) {
		/* Never a stream with a hole in it: the client sees the connection
		 * go (its execs end as killed), not output missing before an END.
		 * Dropped from the loop (ctl_drop_if_broken): callers go on with
		 * their exec. */
		logmsg("sbx-init: out of memory queueing a frame; dropping the client");
		s->ctl.broken = 1;
		return;
	}
	memcpy(q->p + q->len, &h, sizeof(h));
	q->len += sizeof(h);
	if (alen)
		memcpy(q->p + q->len, a, alen);
	q->len += alen;
	if (blen)
		memcpy(q->p + q->len, b, blen);
	q->len += blen;
}

void ctl_error(struct sbx *s, uint32_t exec_id, int code, const char *fmt, ...)
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
	ctl_send(s, SBX_ERROR, exec_id, &e, sizeof(e), msg, (size_t)n);
}

size_t ctl_pending(const struct sbx *s)
{
	return s->ctl.outq.len - s->ctl.outq.off;
}

/* What may be written now: all that is queued, or while quiesced what was
 * queued before the SBX_DONE that answered SBX_QUIESCE, that DONE included. */
static size_t ctl_writable(const struct sbx *s)
{
	size_t n = ctl_pending(s);

	return s->ctl.quiesced && s->ctl.hold_left < n ? s->ctl.hold_left : n;
}

void ctl_quiesce(struct sbx *s, uint32_t id)
{
	struct sbx_done done = {0};

	ctl_send(s, SBX_DONE, id, &done, sizeof(done), NULL, 0);
	s->ctl.quiesced = 1;
	s->ctl.hold_left = ctl_pending(s);
	s->interest_dirty = 1;
}

int ctl_connected(const struct sbx *s)
{
	return s->ctl.rfd >= 0;
}

/* The client is gone: every exec it started is killed (protocol.h). */
static void drop_client(struct sbx *s)
{
	struct sbx_ctl *c = &s->ctl;

	if (c->wfd != c->rfd)
		ep_close(s, &c->wfd);
	c->wfd = -1;
	ep_close(s, &c->rfd);
	c->outq.off = c->outq.len = 0;
	c->inlen = 0;
	c->broken = 0;
	c->quiesced = 0;
	c->on_drop(s);
}

void ctl_drop_if_broken(struct sbx *s)
{
	if (s->ctl.rfd >= 0 && s->ctl.broken)
		drop_client(s);
}

void ctl_on_readable(struct sbx *s)
{
	struct sbx_ctl *c = &s->ctl;

	for (;;) {
		size_t off = 0;
		ssize_t n = read(c->rfd, c->inbuf + c->inlen, sizeof(c->inbuf) - c->inlen);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			drop_client(s);
			return;
		}
		c->inlen += (size_t)n;
		while (c->inlen - off >= sizeof(struct sbx_hdr)) {
			struct sbx_hdr h;

			memcpy(&h, c->inbuf + off, sizeof(h));
			if (h.len > SBX_MAX_PAYLOAD) {
				ctl_error(s, h.exec_id, EMSGSIZE, "frame of %u bytes exceeds %u",
					  h.len, SBX_MAX_PAYLOAD);
				ctl_flush(s);
				drop_client(s);
				return;
			}
			if (c->inlen - off < sizeof(h) + h.len)
				break;
			if (c->quiesced) { /* the client speaks again: so do we */
				c->quiesced = 0;
				s->interest_dirty = 1;
			}
			c->on_frame(s, &h, c->inbuf + off + sizeof(h));
			off += sizeof(h) + h.len;
			if (c->rfd < 0)
				return;
		}
		memmove(c->inbuf, c->inbuf + off, c->inlen - off);
		c->inlen -= off;
	}
}

void ctl_flush(struct sbx *s)
{
	struct sbx_buf *q = &s->ctl.outq;

	/* write(2), not send(2): the client may be a pipe or a port (SIGPIPE is
	 * ignored: a closed peer is EPIPE) */
	while (s->ctl.wfd >= 0 && ctl_writable(s)) {
		ssize_t n = write(s->ctl.wfd, q->p + q->off, ctl_writable(s));

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		if (n < 0) {
			drop_client(s);
			return;
		}
		q->off += (size_t)n;
		if (s->ctl.quiesced)
			s->ctl.hold_left -= (size_t)n;
	}
	if (q->off == q->len) {
		q->off = q->len = 0;
		if (q->cap > (1u << 20)) { /* give memory back after a burst */
			free(q->p);
			memset(q, 0, sizeof(*q));
		}
	}
	s->interest_dirty = 1;
}

/* Take a client from the transport, if it has one for us now. */
void ctl_open(struct sbx *s)
{
	struct sbx_ctl *c = &s->ctl;
	int rfd = -1, wfd = -1;

	if (!c->open || c->open(c, &rfd, &wfd) < 0)
		return;
	if (c->rfd >= 0)
		drop_client(s); /* a restarted daemon takes over */
	c->rfd = rfd;
	c->wfd = wfd;
	set_nonblock(rfd);
	if (wfd != rfd)
		set_nonblock(wfd);
	s->interest_dirty = 1;
}

void ctl_update_interest(struct sbx *s)
{
	struct sbx_ctl *c = &s->ctl;
	uint32_t out = ctl_writable(s) ? EPOLLOUT : 0;

	if (c->rfd < 0)
		return;
	if (c->wfd == c->rfd) {
		ep_set(s, c->rfd, K_CLIENT, 0, EPOLLIN | out);
		return;
	}
	ep_set(s, c->rfd, K_CLIENT, 0, EPOLLIN);
	ep_set(s, c->wfd, K_CLIENT_OUT, 0, out);
}

/* ---- transports ---------------------------------------------------------- */

static int listen_open(struct sbx_ctl *c, int *rfd, int *wfd)
{
	int fd = accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0)
		return -1;
	*rfd = *wfd = fd;
	return 0;
}

/* A listening socket: sbx-init calls listen() (again), which makes it the
 * SO_PEERCRED peer of a unix client.  Returns -1 with errno set. */
int ctl_transport_listen(struct sbx *s, int fd)
{
	if (listen(fd, 8) < 0)
		return -1;
	set_nonblock(fd);
	s->ctl.listen_fd = fd;
	s->ctl.open = listen_open;
	ep_add(s, fd, K_LISTEN, 0, EPOLLIN);
	return 0;
}

/* One client for sbx-init's life, reading rfd and writing wfd (the same fd
 * for a socket or a port). */
void ctl_transport_stream(struct sbx *s, int rfd, int wfd)
{
	s->ctl.open = NULL;
	s->ctl.rfd = rfd;
	s->ctl.wfd = wfd;
	set_nonblock(rfd);
	if (wfd != rfd)
		set_nonblock(wfd);
	s->interest_dirty = 1;
}
