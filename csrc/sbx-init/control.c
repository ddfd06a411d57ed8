/* The control channel to edged (protocol.h): one client at a time over an
 * inherited listening unix socket, framed messages both ways, an outgoing
 * queue the loop flushes as the socket takes it.  Nothing a client sends can
 * make sbx-init exit or block: a bad frame is answered with SBX_ERROR, a
 * header announcing too much is answered and the connection dropped. */
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

	if (s->ctl.client_fd < 0)
		return;
	if (buf_reserve(q, sizeof(h) + alen + blen) < 0) {
		logmsg("sbx-init: out of memory queueing a frame; dropping the client");
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

int ctl_connected(const struct sbx *s)
{
	return s->ctl.client_fd >= 0;
}

/* The client is gone: every exec it started is killed (protocol.h). */
static void drop_client(struct sbx *s)
{
	ep_close(s, &s->ctl.client_fd);
	s->ctl.outq.off = s->ctl.outq.len = 0;
	s->ctl.inlen = 0;
	exec_orphan_all(s);
}

static void handle_frame(struct sbx *s, const struct sbx_hdr *h, uint8_t *p)
{
	if (h->type == SBX_HELLO) {
		struct sbx_hello hello = {.version = SBX_PROTO_VERSION,
					  .cgroup_mode = (uint32_t)s->cg.mode,
					  .execs = exec_count(s)};

		ctl_send(s, SBX_HELLO_OK, 0, &hello, sizeof(hello), NULL, 0);
		return;
	}
	if (h->type == SBX_EXEC) {
		exec_start(s, h->exec_id, p, h->len);
		return;
	}
	if (h->type < SBX_STDIN || h->type > SBX_CREDIT)
		return ctl_error(s, h->exec_id, EINVAL, "unknown message type %u", h->type);
	exec_message(s, h, p);
}

void ctl_on_readable(struct sbx *s)
{
	struct sbx_ctl *c = &s->ctl;

	for (;;) {
		size_t off = 0;
		ssize_t n = read(c->client_fd, c->inbuf + c->inlen, sizeof(c->inbuf) - c->inlen);

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
			handle_frame(s, &h, c->inbuf + off + sizeof(h));
			off += sizeof(h) + h.len;
			if (c->client_fd < 0)
				return;
		}
		memmove(c->inbuf, c->inbuf + off, c->inlen - off);
		c->inlen -= off;
	}
}

void ctl_flush(struct sbx *s)
{
	struct sbx_buf *q = &s->ctl.outq;

	while (s->ctl.client_fd >= 0 && ctl_pending(s)) {
		ssize_t n = send(s->ctl.client_fd, q->p + q->off, ctl_pending(s), MSG_NOSIGNAL);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		if (n < 0) {
			drop_client(s);
			return;
		}
		q->off += (size_t)n;
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

void ctl_on_accept(struct sbx *s)
{
	int fd = accept4(s->ctl.listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0)
		return;
	if (s->ctl.client_fd >= 0)
		drop_client(s); /* a restarted daemon takes over */
	s->ctl.client_fd = fd;
	ep_add(s, s->ctl.client_fd, K_CLIENT, 0, EPOLLIN);
}

void ctl_update_interest(struct sbx *s)
{
	if (s->ctl.client_fd >= 0)
		ep_set(s, s->ctl.client_fd, K_CLIENT, 0,
		       EPOLLIN | (ctl_pending(s) ? EPOLLOUT : 0));
}
