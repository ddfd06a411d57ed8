/* sbx-init's small helpers: the clock, logging, growable buffers, epoll. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "sbx-init.h"

uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One line on stderr (the sandbox's log file, opened by the spawner). */
void logmsg(const char *fmt, ...)
{
	char line[512];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	if (n > (int)sizeof(line) - 2)
		n = sizeof(line) - 2;
	line[n++] = '\n';
	(void)!write(2, line, (size_t)n);
}

/* Room for `more` bytes at b->p + b->len; -1 when out of memory. */
int buf_reserve(struct sbx_buf *b, size_t more)
{
	size_t need, cap;
	uint8_t *p;

	if (b->off && b->off == b->len)
		b->off = b->len = 0;
	need = b->len + more;
	if (need <= b->cap)
		return 0;
	if (b->off) { /* compact before growing */
		memmove(b->p, b->p + b->off, b->len - b->off);
		b->len -= b->off;
		b->off = 0;
		if (b->len + more <= b->cap)
			return 0;
		need = b->len + more;
	}
	cap = b->cap ? b->cap : 4096;
	while (cap < need)
		cap *= 2;
	p = realloc(b->p, cap);
	if (!p)
		return -1;
	b->p = p;
	b->cap = cap;
	return 0;
}

void buf_free(struct sbx_buf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

static uint64_t tag(int kind, int slot)
{
	return ((uint64_t)slot << 8) | (uint64_t)kind;
}

void ep_add(struct sbx *s, int fd, int kind, int slot, uint32_t events)
{
	struct epoll_event ev = {.events = events, .data.u64 = tag(kind, slot)};

	if (epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &ev) < 0)
		logmsg("sbx-init: epoll_ctl add: %s", strerror(errno));
}

/* Interest 0 removes the fd: EPOLLHUP/EPOLLERR are reported even for an empty
 * mask, which would spin the loop while flow control holds a pipe back. */
void ep_set(struct sbx *s, int fd, int kind, int slot, uint32_t events)
{
	struct epoll_event ev = {.events = events, .data.u64 = tag(kind, slot)};

	if (!events) {
		epoll_ctl(s->ep, EPOLL_CTL_DEL, fd, NULL);
		return;
	}
	if (epoll_ctl(s->ep, EPOLL_CTL_MOD, fd, &ev) < 0 && errno == ENOENT)
		epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &ev);
}

/* Close *fd (and forget it in epoll); *fd becomes -1. */
void ep_close(struct sbx *s, int *fd)
{
	if (*fd >= 0) {
		epoll_ctl(s->ep, EPOLL_CTL_DEL, *fd, NULL);
		close(*fd);
		*fd = -1;
	}
}

void set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl >= 0)
		fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}
