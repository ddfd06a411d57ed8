/* The lazy layer file server (see lfs_lazy.h for the design). */
#define FUSE_USE_VERSION 312

#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <fuse_lowlevel.h>

#include "lfs_cleanup.h"
#include "lfs_error.h"
#include "lfs_lazy.h"

/* FUSE_NOTIFY_RESEND (protocol 7.40, Linux 6.9): requeue every request that was read
 * from the connection but not answered.  Debian 12's linux/fuse.h is protocol 7.38. */
#ifndef FUSE_NOTIFY_RESEND
#define FUSE_NOTIFY_RESEND 7
#endif

/* Files are immutable (a layer is named by the hash of its bytes): cache forever. */
#define LAZY_TIMEOUT 86400.0
#define LAZY_ROOT_MODE (S_IFDIR | 0555)
#define LAZY_FILE_MODE (S_IFREG | 0444)
#define LAZY_READAHEAD (1 << 20)
#define LAZY_MAX_READ (1 << 20)  /* the mount's max_read (lfs_lazy_mount) */
#define LAZY_SEQ_TICKS 32 /* reads (node-wide) since the previous chunk was read */

/* A READ waiting for a chunk.  It re-runs from the start when the chunk arrives (it may
 * then park on its next missing chunk). */
struct lazy_wait {
	fuse_req_t req;
	uint64_t off;
	size_t size;
	int waited;              /* parked at least once (a miss, not a hit) */
	int pinned;              /* holds a reader count on each chunk it covers */
	uint64_t parked;         /* CLOCK_MONOTONIC ns when it first parked */
	struct lazy_wait *next;
};

struct lazy_chunk {
	uint8_t state;           /* enum lfs_lazy_chunk_state */
	uint8_t touched;         /* in the access trace */
	uint32_t readers;        /* reads of its bytes right now (eviction waits for 0) */
	uint64_t atime;          /* lz->tick at the last read */
	struct lazy_wait *waiters;
};

struct lazy_layer {
	char name[80];
	uint64_t size;
	uint32_t chunk_size;
	uint32_t nchunks;
	int removed;
	int fd;                  /* the layer's sparse cache file, read-write */
	pthread_mutex_t lock;    /* chunk states, waiters, trace */
	struct lazy_chunk *chunks;
	uint32_t *trace;         /* chunk indexes, first-touch order */
	uint32_t ntrace;
	_Atomic uint32_t active; /* READ handlers using this struct right now */
	_Atomic uint64_t ra_end; /* end of the cache file range last advised WILLNEED */
	struct lfs_lazy_stats st;
};

struct lazy_fetch {
	uint32_t slot;
	uint32_t index;
};

/* A FIFO of chunks for the Python side. */
struct lazy_queue {
	struct lazy_fetch *q;
	size_t head, len, cap;
};

enum { LAZY_Q_DEMAND, LAZY_Q_SPECULATIVE, LAZY_NQUEUES };

struct lfs_lazy {
	struct fuse_session *se;
	int fuse_fd;
	int resumed;
	int efd;
	pthread_t loop;
	int started;             /* the FUSE loop thread runs */
	_Atomic(struct lazy_layer *) layers[LFS_LAZY_MAX_LAYERS];
	_Atomic uint64_t tick;

	/* Slot reuse.  The kernel may reuse nothing of an inode until it has FORGOTTEN it
	 * (its lookup count back to 0, include/uapi/linux/fuse.h FUSE_FORGET): a removed
	 * layer's slot is taken again only then, with a new generation, and once no READ
	 * handler still uses the old struct, which is freed.  FUSE handlers hold
	 * slots_lock shared while they use a layer pointer they have not counted in
	 * `active`; reclaiming a slot holds it exclusively.  A slot whose lookups were
	 * counted by an earlier server (a resumed connection) is pinned: never reused. */
	pthread_rwlock_t slots_lock;
	_Atomic uint64_t nlookup[LFS_LAZY_MAX_LAYERS];
	uint64_t generation[LFS_LAZY_MAX_LAYERS];
	uint8_t pinned[LFS_LAZY_MAX_LAYERS];

	pthread_mutex_t qlock;   /* the fetch queues */
	struct lazy_queue queues[LAZY_NQUEUES]; /* popped in this order */
	_Atomic uint32_t speculate; /* chunks fetched ahead of a sequential miss */
	unsigned max_threads;
	_Atomic int stopped;     /* the FUSE loop ended (connection gone) */
};

static uint64_t lazy_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Count the time a read that waited spent parked (it is being answered now). */
static void lazy_waited(struct lazy_layer *l, const struct lazy_wait *w)
{
	if (w->waited)
		__atomic_add_fetch(&l->st.wait_ns, lazy_now_ns() - w->parked, __ATOMIC_RELAXED);
}

static struct lazy_layer *lazy_layer(struct lfs_lazy *lz, fuse_ino_t ino)
{
	struct lazy_layer *l;

	if (ino < 2 || ino - 2 >= LFS_LAZY_MAX_LAYERS)
		return NULL;
	l = atomic_load(&lz->layers[ino - 2]);
	return l && !l->removed ? l : NULL;
}

static struct lazy_layer *lazy_slot(struct lfs_lazy *lz, uint32_t slot)
{
	return slot < LFS_LAZY_MAX_LAYERS ? lazy_layer(lz, (fuse_ino_t)slot + 2) : NULL;
}

static void lazy_stat(struct lfs_lazy *lz, fuse_ino_t ino, struct stat *st)
{
	struct lazy_layer *l;

	memset(st, 0, sizeof(*st));
	st->st_ino = ino;
	if (ino == FUSE_ROOT_ID) {
		st->st_mode = LAZY_ROOT_MODE;
		st->st_nlink = 2;
		return;
	}
	l = lazy_layer(lz, ino);
	st->st_mode = LAZY_FILE_MODE;
	st->st_nlink = 1;
	st->st_size = (off_t)l->size;
	st->st_blksize = 4096;
	st->st_blocks = (blkcnt_t)((l->size + 511) / 512);
}

/* Queue a chunk for the Python side on queue `which`; called with the layer lock held.
 * Returns -1 if the queue cannot grow (ENOMEM). */
static int lazy_enqueue(struct lfs_lazy *lz, int which, uint32_t slot, uint32_t index)
{
	struct lazy_queue *q = &lz->queues[which];
	uint64_t one = 1;

	pthread_mutex_lock(&lz->qlock);
	if (q->len == q->cap) {
		size_t ncap = q->cap ? q->cap * 2 : 64;
		struct lazy_fetch *nq = malloc(ncap * sizeof(*nq));

		if (!nq) {
			pthread_mutex_unlock(&lz->qlock);
			return -1;
		}
		for (size_t i = 0; i < q->len; i++)
			nq[i] = q->q[(q->head + i) % q->cap];
		free(q->q);
		q->q = nq;
		q->head = 0;
		q->cap = ncap;
	}
	q->q[(q->head + q->len) % q->cap] = (struct lazy_fetch){ slot, index };
	q->len++;
	pthread_mutex_unlock(&lz->qlock);
	/* A full eventfd counter (2^64-2) cannot happen: Python drains it. */
	if (write(lz->efd, &one, sizeof(one)) < 0) {
		/* EAGAIN only; the reader is already woken. */
	}
	return 0;
}

/* A reader just missed chunk `index` (queued on demand).  If the chunk before it is
 * present or being fetched, the reader is likely going through the file in order (the
 * kernel reads a file's pages in order, and EROFS lays files out contiguously): claim
 * the next lz->speculate chunks and queue them on the speculative queue, which the
 * Python side serves after on-demand fetches.  Called with the layer lock held; a
 * chunk that cannot be queued is left missing. */
static void lazy_speculate(struct lfs_lazy *lz, uint32_t slot, struct lazy_layer *l,
			   uint32_t index)
{
	uint32_t n = atomic_load_explicit(&lz->speculate, memory_order_relaxed);

	if (n == 0 || index == 0 || l->chunks[index - 1].state == LFS_LAZY_MISSING)
		return;
	for (uint32_t j = index + 1; j <= index + n && j < l->nchunks; j++) {
		struct lazy_chunk *c = &l->chunks[j];

		if (c->state != LFS_LAZY_MISSING)
			continue;
		if (lazy_enqueue(lz, LAZY_Q_SPECULATIVE, slot, j) < 0)
			return;
		c->state = LFS_LAZY_FETCHING;
		l->st.inflight++;
		l->st.speculative++;
	}
}

/* Each thread's reply buffer, kept for its life: libfuse's own path (fuse_reply_data from
 * an fd) mallocs one per reply, and at 256 KiB that is an mmap whose pages fault in and
 * are zeroed every time (glibc's mmap threshold), which halved warm sequential reads. */
struct lazy_buf {
	size_t cap;
	uint8_t data[];
};

static pthread_key_t lazy_buf_key;
static pthread_once_t lazy_buf_once = PTHREAD_ONCE_INIT;

static void lazy_buf_key_init(void)
{
	(void)pthread_key_create(&lazy_buf_key, free);
}

static uint8_t *lazy_thread_buf(size_t n)
{
	struct lazy_buf *b;

	pthread_once(&lazy_buf_once, lazy_buf_key_init);
	b = pthread_getspecific(lazy_buf_key);
	if (!b || b->cap < n) {
		size_t cap = n > LAZY_MAX_READ ? n : LAZY_MAX_READ;
		struct lazy_buf *nb = malloc(sizeof(*nb) + cap);

		if (!nb)
			return NULL;
		free(b);
		nb->cap = cap;
		if (pthread_setspecific(lazy_buf_key, nb) != 0) {
			free(nb);
			return NULL;
		}
		b = nb;
	}
	return b->data;
}

/* Answer `req` with `len` bytes of `fd` at `off` (fewer at its end).  Returns 0, or a
 * positive errno (nothing was sent). */
static int lazy_pread_reply(fuse_req_t req, int fd, uint64_t off, size_t len)
{
	uint8_t *buf = lazy_thread_buf(len);
	size_t got = 0;

	if (!buf)
		return ENOMEM;
	while (got < len) {
		ssize_t k = pread(fd, buf + got, len - got, (off_t)(off + got));

		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			return errno;
		if (k == 0)
			break;
		got += (size_t)k;
	}
	return -fuse_reply_buf(req, (const char *)buf, got);
}

/* Advise the cache file's readahead for a sequential reader entering offset `enter`:
 * the window [enter, enter + LAZY_READAHEAD) at the start of a run, then the next
 * window once the reader is within half a window of the advised end.  Only new pages
 * are advised: WILLNEED walks every page of its range even when all are cached
 * (~0.5 us each), which at one 1 MiB call per 256 KiB chunk halved warm sequential
 * throughput.  `ra_end` is a hint shared by the FUSE threads; a race costs one extra
 * or one missed call. */
static void lazy_readahead(struct lazy_layer *l, uint64_t enter)
{
	uint64_t done = atomic_load_explicit(&l->ra_end, memory_order_relaxed), from;

	if (done <= enter || done > enter + LAZY_READAHEAD)
		from = enter; /* a new run (or one far behind the advised end) */
	else if (done - enter <= LAZY_READAHEAD / 2)
		from = done;
	else
		return; /* well ahead already */
	atomic_store_explicit(&l->ra_end, from + LAZY_READAHEAD, memory_order_relaxed);
	posix_fadvise(l->fd, (off_t)from, LAZY_READAHEAD, POSIX_FADV_WILLNEED);
}

/* A parked read pins the chunks it covers (a reader count each), so that eviction
 * cannot take the ones already present while it waits for the others: a read spanning
 * more chunks than the cache limit allows would otherwise refetch for ever.  Called with
 * the layer lock held. */
static void lazy_pin(struct lazy_layer *l, struct lazy_wait *w, int pin)
{
	uint64_t end;
	uint32_t first, last;

	if (!!w->pinned == !!pin || w->off >= l->size || w->size == 0)
		return;
	end = w->off + w->size < l->size ? w->off + w->size : l->size;
	first = (uint32_t)(w->off / l->chunk_size);
	last = (uint32_t)((end - 1) / l->chunk_size);
	for (uint32_t i = first; i <= last; i++) {
		if (pin)
			l->chunks[i].readers++;
		else
			l->chunks[i].readers--;
	}
	w->pinned = pin;
}

/* Answer `w` if every chunk it covers is present, else queue each missing one (once)
 * and park `w` on the first one not present.  Takes ownership of `w`. */
static void lazy_serve(struct lfs_lazy *lz, uint32_t slot, struct lazy_layer *l,
		       struct lazy_wait *w)
{
	uint64_t end, off = w->off;
	uint32_t first, last, i, park = UINT32_MAX, queued = UINT32_MAX;
	uint64_t now, enter;
	int rc, seq;

	if (off >= l->size || w->size == 0) {
		fuse_reply_buf(w->req, NULL, 0);
		free(w);
		return;
	}
	end = off + w->size;
	if (end > l->size)
		end = l->size;
	first = (uint32_t)(off / l->chunk_size);
	last = (uint32_t)((end - 1) / l->chunk_size);

	now = atomic_fetch_add(&lz->tick, 1) + 1;
	pthread_mutex_lock(&l->lock);
	lazy_pin(l, w, 0); /* re-run from the start */
	if (l->removed) {
		/* Removed since this read looked it up: queue nothing for it (the removal
		 * has dropped its queued fetches and answered its parked reads). */
		pthread_mutex_unlock(&l->lock);
		__atomic_add_fetch(&l->st.errors, 1, __ATOMIC_RELAXED);
		fuse_reply_err(w->req, EIO);
		free(w);
		return;
	}
	/* Every missing chunk the read covers is queued now, not one after the other as
	 * the read is re-run; the read parks on the first one not present. */
	for (i = first; i <= last; i++) {
		struct lazy_chunk *c = &l->chunks[i];

		if (!c->touched) {
			c->touched = 1;
			l->trace[l->ntrace++] = i;
			l->st.touched = l->ntrace;
		}
		if (c->state == LFS_LAZY_PRESENT)
			continue;
		if (c->state == LFS_LAZY_MISSING) {
			if (lazy_enqueue(lz, LAZY_Q_DEMAND, slot, i) < 0) {
				if (park != UINT32_MAX)
					break; /* park on what is already queued */
				pthread_mutex_unlock(&l->lock);
				__atomic_add_fetch(&l->st.errors, 1, __ATOMIC_RELAXED);
				fuse_reply_err(w->req, ENOMEM);
				free(w);
				return;
			}
			c->state = LFS_LAZY_FETCHING;
			l->st.fetches++;
			l->st.inflight++;
			queued = i;
		}
		if (park == UINT32_MAX)
			park = i;
	}
	if (queued != UINT32_MAX)
		lazy_speculate(lz, slot, l, queued);
	if (park != UINT32_MAX) {
		struct lazy_chunk *c = &l->chunks[park];

		if (!w->waited) {
			l->st.misses++;
			w->parked = lazy_now_ns();
		}
		w->waited = 1;
		lazy_pin(l, w, 1);
		w->next = c->waiters;
		c->waiters = w;
		pthread_mutex_unlock(&l->lock);
		return;
	}
	/* A sequential reader enters a chunk by a read that crosses into it, or that
	 * starts it just after the chunk before was read: have the cache file read ahead
	 * (LAZY_READAHEAD bytes), so the next requests, which several FUSE threads issue
	 * out of order, find the page cache filled instead of each waiting for the disk.
	 * A random reader rarely does either and gets no readahead it did not ask for. */
	enter = (uint64_t)last * l->chunk_size;
	seq = enter > off || (enter == off && last > 0 &&
			      now - l->chunks[last - 1].atime <= LAZY_SEQ_TICKS);
	for (i = first; i <= last; i++) {
		l->chunks[i].readers++;
		l->chunks[i].atime = now;
	}
	if (!w->waited)
		l->st.hits++;
	pthread_mutex_unlock(&l->lock);
	lazy_waited(l, w);
	if (seq)
		lazy_readahead(l, enter);

	/* Present chunks sit at their own offset in the layer's cache file, so the read
	 * is one pread there, whatever chunks it spans, into this thread's buffer. */
	rc = lazy_pread_reply(w->req, l->fd, off, (size_t)(end - off));
	if (rc == 0) {
		__atomic_add_fetch(&l->st.read_bytes, end - off, __ATOMIC_RELAXED);
		w->req = NULL;
	}
	pthread_mutex_lock(&l->lock);
	for (i = first; i <= last; i++)
		l->chunks[i].readers--;
	pthread_mutex_unlock(&l->lock);
	if (w->req) {
		/* The cache file could not be read or the reply not be written: tell the
		 * reader rather than leave it waiting. */
		__atomic_add_fetch(&l->st.errors, 1, __ATOMIC_RELAXED);
		fuse_reply_err(w->req, rc > 0 ? rc : EIO);
	}
	free(w);
}

static void lazy_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	/* Never passthrough, never splice: the kernel refuses to stack EROFS on a
	 * passthrough file, and our replies are small preads. */
	conn->want &= ~(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
	conn->want |= FUSE_CAP_ASYNC_READ;
}

static void lazy_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);
	struct fuse_entry_param e;

	if (parent != FUSE_ROOT_ID) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	pthread_rwlock_rdlock(&lz->slots_lock);
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++) {
		struct lazy_layer *l = lazy_slot(lz, s);

		if (l && strcmp(l->name, name) == 0) {
			memset(&e, 0, sizeof(e));
			e.ino = (fuse_ino_t)s + 2;
			e.generation = lz->generation[s];
			e.attr_timeout = LAZY_TIMEOUT;
			e.entry_timeout = LAZY_TIMEOUT;
			lazy_stat(lz, e.ino, &e.attr);
			/* Counted before the reply: a FORGET may follow it at once. */
			atomic_fetch_add(&lz->nlookup[s], 1);
			pthread_rwlock_unlock(&lz->slots_lock);
			if (fuse_reply_entry(req, &e) != 0)
				atomic_fetch_sub(&lz->nlookup[s], 1); /* the kernel holds none */
			return;
		}
	}
	pthread_rwlock_unlock(&lz->slots_lock);
	fuse_reply_err(req, ENOENT);
}

/* The kernel dropped `n` lookups of inode `ino` (saturating: a resumed server never saw
 * the lookups of its predecessor; those slots are pinned until the kernel forgets them). */
static void lazy_forget_one(struct lfs_lazy *lz, fuse_ino_t ino, uint64_t n)
{
	uint64_t cur, next;

	if (ino < 2 || ino - 2 >= LFS_LAZY_MAX_LAYERS)
		return;
	cur = atomic_load(&lz->nlookup[ino - 2]);
	do {
		next = cur > n ? cur - n : 0;
	} while (!atomic_compare_exchange_weak(&lz->nlookup[ino - 2], &cur, next));
	/* The kernel sends its whole count when it evicts an inode (fuse_evict_inode): a
	 * slot pinned for lookups counted by a dead predecessor is safe again after it, and
	 * later lookups are counted here. */
	if (__atomic_load_n(&lz->pinned[ino - 2], __ATOMIC_RELAXED)) {
		pthread_rwlock_wrlock(&lz->slots_lock);
		lz->pinned[ino - 2] = 0;
		pthread_rwlock_unlock(&lz->slots_lock);
	}
}

static void lazy_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
	lazy_forget_one(fuse_req_userdata(req), ino, nlookup);
	fuse_reply_none(req);
}

static void lazy_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);

	for (size_t i = 0; i < count; i++)
		lazy_forget_one(lz, (fuse_ino_t)forgets[i].ino, forgets[i].nlookup);
	fuse_reply_none(req);
}

static void lazy_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);
	struct stat st;

	(void)fi;
	pthread_rwlock_rdlock(&lz->slots_lock);
	if (ino != FUSE_ROOT_ID && !lazy_layer(lz, ino)) {
		pthread_rwlock_unlock(&lz->slots_lock);
		fuse_reply_err(req, ENOENT);
		return;
	}
	lazy_stat(lz, ino, &st);
	pthread_rwlock_unlock(&lz->slots_lock);
	fuse_reply_attr(req, &st, LAZY_TIMEOUT);
}

static void lazy_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);

	if (ino == FUSE_ROOT_ID) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	pthread_rwlock_rdlock(&lz->slots_lock);
	if (!lazy_layer(lz, ino)) {
		pthread_rwlock_unlock(&lz->slots_lock);
		fuse_reply_err(req, ENOENT);
		return;
	}
	pthread_rwlock_unlock(&lz->slots_lock);
	if ((fi->flags & O_ACCMODE) != O_RDONLY) {
		fuse_reply_err(req, EROFS);
		return;
	}
	fi->keep_cache = 1;
	fi->fh = 0; /* not used: a restarted server must understand old handles */
	fuse_reply_open(req, fi);
}

static void lazy_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		      struct fuse_file_info *fi)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);
	struct lazy_layer *l;
	struct lazy_wait *w;

	(void)fi;
	pthread_rwlock_rdlock(&lz->slots_lock);
	l = lazy_layer(lz, ino);
	if (l)
		atomic_fetch_add(&l->active, 1);
	pthread_rwlock_unlock(&lz->slots_lock);
	if (!l) {
		fuse_reply_err(req, EIO);
		return;
	}
	w = malloc(sizeof(*w));
	if (!w) {
		fuse_reply_err(req, ENOMEM);
	} else {
		*w = (struct lazy_wait){ .req = req, .off = (uint64_t)off, .size = size };
		__atomic_add_fetch(&l->st.reads, 1, __ATOMIC_RELAXED);
		lazy_serve(lz, (uint32_t)(ino - 2), l, w);
	}
	atomic_fetch_sub(&l->active, 1);
}

static void lazy_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
			 struct fuse_file_info *fi)
{
	struct lfs_lazy *lz = fuse_req_userdata(req);
	char *buf;
	size_t used = 0;
	struct stat st;

	(void)fi;
	if (ino != FUSE_ROOT_ID) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	buf = malloc(size);
	if (!buf) {
		fuse_reply_err(req, ENOMEM);
		return;
	}
	/* Offsets: 1 ".", 2 "..", slot + 3 for each layer (stable across changes). */
	memset(&st, 0, sizeof(st));
	pthread_rwlock_rdlock(&lz->slots_lock);
	for (off_t pos = off; pos < (off_t)LFS_LAZY_MAX_LAYERS + 2; pos++) {
		const char *name;
		size_t need;

		if (pos == 0 || pos == 1) {
			name = pos == 0 ? "." : "..";
			st.st_ino = FUSE_ROOT_ID;
			st.st_mode = S_IFDIR;
		} else {
			struct lazy_layer *l = lazy_slot(lz, (uint32_t)(pos - 2));

			if (!l)
				continue;
			name = l->name;
			st.st_ino = (ino_t)pos;
			st.st_mode = S_IFREG;
		}
		need = fuse_add_direntry(req, buf + used, size - used, name, &st, pos + 1);
		if (need > size - used)
			break;
		used += need;
	}
	pthread_rwlock_unlock(&lz->slots_lock);
	fuse_reply_buf(req, buf, used);
	free(buf);
}

static void lazy_statfs(fuse_req_t req, fuse_ino_t ino)
{
	struct statvfs sv;

	(void)ino;
	memset(&sv, 0, sizeof(sv));
	sv.f_bsize = 4096;
	sv.f_frsize = 4096;
	sv.f_namemax = 255;
	fuse_reply_statfs(req, &sv);
}

static const struct fuse_lowlevel_ops lazy_ops = {
	.init = lazy_init,
	.lookup = lazy_lookup,
	.forget = lazy_forget,
	.forget_multi = lazy_forget_multi,
	.getattr = lazy_getattr,
	.open = lazy_open,
	.read = lazy_read,
	.readdir = lazy_readdir,
	.statfs = lazy_statfs,
};

/* The kernel sends FUSE_INIT once per connection, and libfuse answers EIO to every
 * request until its session has seen one.  A server taking over a live connection
 * feeds its session this INIT; the reply goes to a request id the kernel never issued
 * and is dropped by it (ENOENT, which libfuse does not report). */
static void lazy_replay_init(struct lfs_lazy *lz)
{
	struct {
		struct fuse_in_header h;
		struct fuse_init_in in;
	} msg;
	struct fuse_buf fb;

	memset(&msg, 0, sizeof(msg));
	msg.h.len = sizeof(msg);
	msg.h.opcode = FUSE_INIT;
	msg.h.unique = 1ULL << 62;
	msg.in.major = FUSE_KERNEL_VERSION;
	msg.in.minor = FUSE_KERNEL_MINOR_VERSION;
	msg.in.max_readahead = 128 << 10;
	msg.in.flags = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_INIT_EXT |
		       FUSE_PARALLEL_DIROPS;
	memset(&fb, 0, sizeof(fb));
	fb.mem = &msg;
	fb.size = sizeof(msg);
	fuse_session_process_buf(lz->se, &fb);
}

static int lazy_notify_resend(struct lfs_lazy *lz)
{
	struct fuse_out_header h = {
		.len = sizeof(h), .error = FUSE_NOTIFY_RESEND, .unique = 0,
	};

	/* EINVAL here means a kernel older than 6.9: the dead server's requests then stay
	 * unanswered until their readers are interrupted; later reads work either way. */
	return write(lz->fuse_fd, &h, sizeof(h)) == (ssize_t)sizeof(h) ? 0 : -errno;
}

static void lazy_free_layer(struct lazy_layer *l);

struct lfs_lazy *lfs_lazy_new(int fuse_fd, int resumed, struct lfs_error *err)
{
	char mnt[32];
	char *argv[] = { "layerfs-lazy", NULL };
	struct fuse_args args = FUSE_ARGS_INIT(1, argv);
	struct lfs_lazy *lz;
	cleanup_close int session_fd = -1;

	if (fcntl(fuse_fd, F_GETFD) < 0) {
		lfs_error_set(err, errno, "fuse fd %d: %s", fuse_fd, strerror(errno));
		return NULL;
	}
	lz = calloc(1, sizeof(*lz));
	if (!lz) {
		lfs_error_set(err, ENOMEM, "allocating the lazy server");
		return NULL;
	}
	pthread_mutex_init(&lz->qlock, NULL);
	pthread_rwlock_init(&lz->slots_lock, NULL);
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++)
		lz->generation[s] = 1;
	lz->fuse_fd = fuse_fd;
	lz->resumed = resumed;
	lz->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (lz->efd < 0) {
		lfs_error_set(err, errno, "eventfd: %s", strerror(errno));
		goto fail;
	}
	lz->se = fuse_session_new(&args, &lazy_ops, sizeof(lazy_ops), lz);
	if (!lz->se) {
		lfs_error_set(err, EIO, "fuse_session_new failed");
		goto fail;
	}
	/* The session gets a copy of the fd (fuse_session_destroy closes it); the
	 * caller's stays the caller's. */
	session_fd = fcntl(fuse_fd, F_DUPFD_CLOEXEC, 3);
	if (session_fd < 0) {
		lfs_error_set(err, errno, "dup fuse fd %d: %s", fuse_fd, strerror(errno));
		goto fail;
	}
	snprintf(mnt, sizeof(mnt), "/dev/fd/%d", session_fd);
	if (fuse_session_mount(lz->se, mnt) != 0) {
		lfs_error_set(err, EIO, "fuse_session_mount `%s` failed", mnt);
		goto fail;
	}
	steal_fd(&session_fd); /* the session's now */
	return lz;
fail:
	if (lz->se)
		fuse_session_destroy(lz->se);
	if (lz->efd >= 0)
		close(lz->efd);
	pthread_rwlock_destroy(&lz->slots_lock);
	pthread_mutex_destroy(&lz->qlock);
	free(lz);
	return NULL;
}

int lfs_lazy_free(struct lfs_lazy *lz)
{
	if (!lz)
		return 0;
	if (lz->started) {
		/* Its threads use it for as long as the FUSE loop runs (until the
		 * connection ends): only a stopped server can go. */
		if (!atomic_load(&lz->stopped))
			return -EBUSY;
		pthread_join(lz->loop, NULL);
	}
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++) {
		struct lazy_layer *l = atomic_load(&lz->layers[s]);

		if (!l)
			continue;
		for (uint32_t i = 0; i < l->nchunks; i++) {
			struct lazy_wait *w = l->chunks[i].waiters;

			while (w) { /* the connection is gone: replying frees the request */
				struct lazy_wait *next = w->next;

				fuse_reply_err(w->req, EIO);
				free(w);
				w = next;
			}
		}
		lazy_free_layer(l);
	}
	for (int q = 0; q < LAZY_NQUEUES; q++)
		free(lz->queues[q].q);
	fuse_session_destroy(lz->se);
	close(lz->efd);
	pthread_rwlock_destroy(&lz->slots_lock);
	pthread_mutex_destroy(&lz->qlock);
	free(lz);
	return 0;
}

int lfs_lazy_event_fd(struct lfs_lazy *lz)
{
	return lz->efd;
}

int lfs_lazy_stopped(struct lfs_lazy *lz)
{
	return atomic_load(&lz->stopped);
}

int lfs_lazy_add_layer(struct lfs_lazy *lz, uint32_t slot, const char *name, uint64_t size,
		       uint32_t chunk_size, const char *data_path, struct lfs_error *err)
{
	struct lazy_layer *l;
	struct stat st;
	uint64_t n;
	cleanup_close int fd = -1;

	if (slot >= LFS_LAZY_MAX_LAYERS)
		return lfs_error_set(err, EINVAL, "layer slot %u out of range (max %u)", slot,
				     LFS_LAZY_MAX_LAYERS - 1);
	if (!name || !*name || strlen(name) >= sizeof(l->name) || strchr(name, '/'))
		return lfs_error_set(err, EINVAL, "layer name `%s` is not a file name",
				     name ? name : "");
	if (chunk_size < 4096 || (chunk_size & (chunk_size - 1)))
		return lfs_error_set(err, EINVAL, "layer `%s`: chunk size %u is not a power of "
				     "two >= 4096", name, chunk_size);
	n = (size + chunk_size - 1) / chunk_size;
	if (n > UINT32_MAX / 2)
		return lfs_error_set(err, EINVAL, "layer `%s`: too many chunks", name);
	if (atomic_load(&lz->layers[slot]))
		return lfs_error_set(err, EEXIST, "layer slot %u is taken", slot);
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++) {
		struct lazy_layer *o = lazy_slot(lz, s);

		if (o && strcmp(o->name, name) == 0)
			return lfs_error_set(err, EEXIST, "layer `%s` is already in slot %u",
					     name, s);
	}
	fd = open(data_path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return lfs_error_set(err, errno, "layer `%s`: open `%s`: %s", name, data_path,
				     strerror(errno));
	/* The file has the layer's size from the start; chunks not yet written are holes. */
	if (fstat(fd, &st) < 0 || ((uint64_t)st.st_size != size && ftruncate(fd, (off_t)size) < 0)) {
		return lfs_error_set(err, errno, "layer `%s`: sizing `%s`: %s", name, data_path,
				     strerror(errno));
	}
	l = calloc(1, sizeof(*l));
	if (!l)
		return lfs_error_set(err, ENOMEM, "layer `%s`: allocating", name);
	l->chunks = calloc(n ? n : 1, sizeof(*l->chunks));
	l->trace = calloc(n ? n : 1, sizeof(*l->trace));
	if (!l->chunks || !l->trace) {
		free(l->chunks);
		free(l->trace);
		free(l);
		return lfs_error_set(err, ENOMEM, "layer `%s`: allocating %lu chunk states",
				     name, (unsigned long)n);
	}
	l->fd = steal_fd(&fd);
	snprintf(l->name, sizeof(l->name), "%s", name);
	l->size = size;
	l->chunk_size = chunk_size;
	l->nchunks = (uint32_t)n;
	l->st.nchunks = (uint32_t)n;
	pthread_mutex_init(&l->lock, NULL);
	atomic_store(&lz->layers[slot], l);
	return 0;
}

/* Drop the queued fetches of `slot` (its layer is going away). */
static void lazy_unqueue(struct lfs_lazy *lz, uint32_t slot)
{
	pthread_mutex_lock(&lz->qlock);
	for (int k = 0; k < LAZY_NQUEUES; k++) {
		struct lazy_queue *q = &lz->queues[k];
		size_t kept = 0;

		for (size_t i = 0; i < q->len; i++) {
			struct lazy_fetch f = q->q[(q->head + i) % q->cap];

			if (f.slot != slot)
				q->q[(q->head + kept++) % q->cap] = f;
		}
		q->len = kept;
	}
	pthread_mutex_unlock(&lz->qlock);
}

int lfs_lazy_remove_layer(struct lfs_lazy *lz, uint32_t slot, struct lfs_error *err)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	uint32_t busy = 0;
	char name[sizeof(l->name)];

	if (!l)
		return lfs_error_set(err, ENOENT, "no layer in slot %u", slot);
	pthread_mutex_lock(&l->lock);
	l->removed = 1;
	for (uint32_t i = 0; i < l->nchunks; i++) {
		struct lazy_chunk *c = &l->chunks[i];
		struct lazy_wait *w = c->waiters;

		c->waiters = NULL;
		while (w) {
			struct lazy_wait *next = w->next;

			lazy_pin(l, w, 0);
			fuse_reply_err(w->req, EIO);
			free(w);
			w = next;
		}
	}
	for (uint32_t i = 0; i < l->nchunks; i++) {
		busy += l->chunks[i].readers;
		l->chunks[i].state = LFS_LAZY_MISSING;
	}
	/* A read still answering from the file keeps it open (one fd, until exit). */
	if (!busy && l->fd >= 0) {
		close(l->fd);
		l->fd = -1;
	}
	memcpy(name, l->name, sizeof(name));
	pthread_mutex_unlock(&l->lock);
	/* After `removed` is set: lazy_serve queues nothing for the layer any more. */
	lazy_unqueue(lz, slot);
	/* Tell the kernel the file is deleted (its dentry dropped, its link count 0), so
	 * that it evicts and FORGETs the inode once nothing has it open: only then can the
	 * slot be reused (lfs_lazy_take_slot).  A merely invalidated dentry would leave a
	 * linked inode in the inode cache until memory pressure.  Not from a FUSE handler
	 * (libfuse: that may deadlock); ENOENT means the kernel had no dentry cached. */
	if (lz->started)
		fuse_lowlevel_notify_delete(lz->se, FUSE_ROOT_ID, (fuse_ino_t)slot + 2, name,
					    strlen(name));
	/* The struct stays allocated until its slot is reclaimed (a READ handler may still
	 * use it). */
	return 0;
}

/* Free a removed layer's struct; called with slots_lock held exclusively. */
static void lazy_free_layer(struct lazy_layer *l)
{
	if (l->fd >= 0)
		close(l->fd);
	pthread_mutex_destroy(&l->lock);
	free(l->chunks);
	free(l->trace);
	free(l);
}

int lfs_lazy_take_slot(struct lfs_lazy *lz)
{
	int got = -1;

	pthread_rwlock_wrlock(&lz->slots_lock);
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS && got < 0; s++) {
		struct lazy_layer *l = atomic_load(&lz->layers[s]);

		if (lz->pinned[s])
			continue;
		if (!l) {
			got = (int)s;
		} else if (l->removed && atomic_load(&lz->nlookup[s]) == 0 &&
			   atomic_load(&l->active) == 0) {
			atomic_store(&lz->layers[s], NULL);
			lazy_free_layer(l);
			lz->generation[s]++;
			got = (int)s;
		}
	}
	pthread_rwlock_unlock(&lz->slots_lock);
	return got;
}

void lfs_lazy_slot_counts(struct lfs_lazy *lz, struct lfs_lazy_slots *out)
{
	memset(out, 0, sizeof(*out));
	pthread_rwlock_rdlock(&lz->slots_lock);
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++) {
		struct lazy_layer *l = atomic_load(&lz->layers[s]);

		if (l && !l->removed)
			out->live++;
		else if (lz->pinned[s])
			out->pinned++;
		else if (!l)
			continue;
		else if (atomic_load(&lz->nlookup[s]) || atomic_load(&l->active))
			out->held++;
		else
			out->reusable++;
	}
	pthread_rwlock_unlock(&lz->slots_lock);
}

int lfs_lazy_unpin_forgotten(struct lfs_lazy *lz)
{
	int n = 0;

	if (!lz->started)
		return 0;
	for (uint32_t s = 0; s < LFS_LAZY_MAX_LAYERS; s++) {
		if (!__atomic_load_n(&lz->pinned[s], __ATOMIC_RELAXED))
			continue;
		/* Attributes only (offset < 0): no page is touched, so no page lock is
		 * waited on.  ENOENT: the kernel has no inode with this number. */
		if (fuse_lowlevel_notify_inval_inode(lz->se, (fuse_ino_t)s + 2, -1, 0) ==
		    -ENOENT) {
			pthread_rwlock_wrlock(&lz->slots_lock);
			lz->pinned[s] = 0;
			pthread_rwlock_unlock(&lz->slots_lock);
			n++;
		}
	}
	return n;
}

int lfs_lazy_pin_slot(struct lfs_lazy *lz, uint32_t slot)
{
	if (slot >= LFS_LAZY_MAX_LAYERS)
		return -1;
	lz->pinned[slot] = 1;
	return 0;
}

static void *lazy_loop(void *arg)
{
	struct lfs_lazy *lz = arg;
	struct fuse_loop_config *cfg = fuse_loop_cfg_create();

	if (cfg) {
		fuse_loop_cfg_set_max_threads(cfg, lz->max_threads);
		fuse_loop_cfg_set_idle_threads(cfg, lz->max_threads);
		fuse_loop_cfg_set_clone_fd(cfg, 0);
	}
	/* clone_fd stays off: requests read through a cloned fd are aborted when that fd
	 * closes, while requests read through the shared fd survive our death and can be
	 * requeued for the next server. */
	fuse_session_loop_mt(lz->se, cfg);
	if (cfg)
		fuse_loop_cfg_destroy(cfg);
	atomic_store(&lz->stopped, 1);
	if (write(lz->efd, &(uint64_t){ 1 }, sizeof(uint64_t)) < 0) {
		/* EAGAIN only: the Python side is woken anyway. */
	}
	return NULL;
}

int lfs_lazy_start(struct lfs_lazy *lz, unsigned max_threads, struct lfs_error *err)
{
	int rc;

	lz->max_threads = max_threads ? max_threads : 8;
	if (lz->resumed)
		lazy_replay_init(lz);
	rc = pthread_create(&lz->loop, NULL, lazy_loop, lz);
	if (rc)
		return lfs_error_set(err, rc, "starting the FUSE loop: %s", strerror(rc));
	lz->started = 1;
	if (lz->resumed) {
		rc = lazy_notify_resend(lz);
		if (rc < 0)
			fprintf(stderr, "layerfs-lazy: FUSE_NOTIFY_RESEND: %s (requests of the "
				"previous server are not requeued)\n", strerror(-rc));
	}
	return 0;
}

void lfs_lazy_set_speculate(struct lfs_lazy *lz, uint32_t chunks)
{
	atomic_store(&lz->speculate, chunks);
}

int lfs_lazy_next_fetch(struct lfs_lazy *lz, uint32_t *slot, uint32_t *index)
{
	uint64_t v;
	int got = 0;

	pthread_mutex_lock(&lz->qlock);
	for (int k = 0; k < LAZY_NQUEUES && !got; k++) {
		struct lazy_queue *q = &lz->queues[k];
		struct lazy_fetch f;

		if (!q->len)
			continue;
		f = q->q[q->head];
		q->head = (q->head + 1) % q->cap;
		q->len--;
		*slot = f.slot;
		*index = f.index;
		got = k == LAZY_Q_DEMAND ? 1 : 2;
	}
	pthread_mutex_unlock(&lz->qlock);
	if (!got) {
		if (read(lz->efd, &v, sizeof(v)) < 0) {
			/* EAGAIN: nothing was signalled since the last drain. */
		}
	}
	return got;
}

int lfs_lazy_chunk_claim(struct lfs_lazy *lz, uint32_t slot, uint32_t index)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	int rc = 0;

	if (!l || index >= l->nchunks)
		return -1;
	pthread_mutex_lock(&l->lock);
	if (l->chunks[index].state == LFS_LAZY_MISSING) {
		l->chunks[index].state = LFS_LAZY_FETCHING;
		l->st.inflight++;
		rc = 1;
	}
	pthread_mutex_unlock(&l->lock);
	return rc;
}

/* Take the waiters of a chunk, unpinned; called with the layer lock held. */
static struct lazy_wait *lazy_take_waiters(struct lazy_layer *l, struct lazy_chunk *c)
{
	struct lazy_wait *w = c->waiters, *rev = NULL;

	c->waiters = NULL;
	while (w) { /* oldest first */
		struct lazy_wait *next = w->next;

		lazy_pin(l, w, 0);
		w->next = rev;
		rev = w;
		w = next;
	}
	return rev;
}

/* Mark chunk `index` present and answer the reads parked on it. */
static void lazy_mark_present(struct lfs_lazy *lz, uint32_t slot, struct lazy_layer *l,
			      uint32_t index)
{
	struct lazy_chunk *c;
	struct lazy_wait *w;

	pthread_mutex_lock(&l->lock);
	c = &l->chunks[index];
	if (c->state != LFS_LAZY_PRESENT) {
		/* Just arrived: the most recently used, last in line for eviction (a read
		 * parked on it has not read it yet). */
		c->atime = atomic_fetch_add(&lz->tick, 1) + 1;
		if (c->state == LFS_LAZY_FETCHING)
			l->st.inflight--;
		c->state = LFS_LAZY_PRESENT;
		l->st.present++;
		l->st.ready++;
	}
	w = lazy_take_waiters(l, c);
	pthread_mutex_unlock(&l->lock);
	while (w) {
		struct lazy_wait *next = w->next;

		lazy_serve(lz, slot, l, w);
		w = next;
	}
}

static uint64_t lazy_chunk_len(const struct lazy_layer *l, uint32_t index)
{
	return index + 1 < l->nchunks ? l->chunk_size
				      : l->size - (uint64_t)index * l->chunk_size;
}

int lfs_lazy_chunk_ready(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 struct lfs_error *err)
{
	struct lazy_layer *l = lazy_slot(lz, slot);

	if (!l || index >= l->nchunks)
		return lfs_error_set(err, ENOENT, "no chunk %u in layer slot %u", index, slot);
	lazy_mark_present(lz, slot, l, index);
	return 0;
}

static int lazy_all_zero(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i])
			return 0;
	return 1;
}

int lfs_lazy_chunk_write(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 const void *data, size_t len, struct lfs_error *err)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	uint64_t want, pos;
	size_t done = 0;

	if (!l || index >= l->nchunks)
		return lfs_error_set(err, ENOENT, "no chunk %u in layer slot %u", index, slot);
	want = lazy_chunk_len(l, index);
	if (len != want)
		return lfs_error_set(err, EINVAL, "chunk %u of `%s`: %zu bytes, it has %llu",
				     index, l->name, len, (unsigned long long)want);
	if (lfs_lazy_chunk_info(lz, slot, index, NULL) == LFS_LAZY_PRESENT)
		return 0; /* a racing prefetch got there first; same bytes */
	pos = (uint64_t)index * l->chunk_size;
	/* Runs of zeros (unused image space) stay holes, which read back as zeros. */
	if (lazy_all_zero(data, len)) {
		if (fallocate(l->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)pos,
			      (off_t)len) == 0)
			done = len;
		else if (errno != EOPNOTSUPP) /* no holes here: write the zeros */
			return lfs_error_set(err, errno, "chunk %u of `%s`: punching: %s", index,
					     l->name, strerror(errno));
	}
	while (done < len) {
		ssize_t k = pwrite(l->fd, (const uint8_t *)data + done, len - done,
				   (off_t)(pos + done));

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return lfs_error_set(err, k < 0 ? errno : EIO, "chunk %u of `%s`: writing "
					     "the cache file: %s", index, l->name,
					     strerror(k < 0 ? errno : EIO));
		done += (size_t)k;
	}
	/* Present at once for readers (the bytes are in the page cache).  Not yet durable:
	 * whoever persists the present bitmap takes it, then calls lfs_lazy_layer_sync(),
	 * then writes it, so a bit on disk never names bytes a crash could lose.  An
	 * fdatasync per chunk here would cost each cold read a disk flush (~4 ms). */
	lazy_mark_present(lz, slot, l, index);
	return 0;
}

int lfs_lazy_layer_sync(struct lfs_lazy *lz, uint32_t slot, struct lfs_error *err)
{
	struct lazy_layer *l = lazy_slot(lz, slot);

	if (!l)
		return lfs_error_set(err, ENOENT, "no layer in slot %u", slot);
	if (fdatasync(l->fd) < 0)
		return lfs_error_set(err, errno, "layer `%s`: fdatasync of its cache file: %s",
				     l->name, strerror(errno));
	return 0;
}

int lfs_lazy_chunk_failed(struct lfs_lazy *lz, uint32_t slot, uint32_t index, int errnum)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	struct lazy_chunk *c;
	struct lazy_wait *w;
	int n = 0;

	if (!l || index >= l->nchunks)
		return -1;
	pthread_mutex_lock(&l->lock);
	c = &l->chunks[index];
	if (c->state == LFS_LAZY_FETCHING) {
		c->state = LFS_LAZY_MISSING;
		l->st.inflight--;
		l->st.failed++;
	}
	w = lazy_take_waiters(l, c);
	pthread_mutex_unlock(&l->lock);
	while (w) {
		struct lazy_wait *next = w->next;

		lazy_waited(l, w);
		fuse_reply_err(w->req, errnum > 0 ? errnum : EIO);
		__atomic_add_fetch(&l->st.errors, 1, __ATOMIC_RELAXED);
		free(w);
		w = next;
		n++;
	}
	return n;
}

int lfs_lazy_chunk_evict(struct lfs_lazy *lz, uint32_t slot, uint32_t index)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	struct lazy_chunk *c;
	int rc = 0;

	if (!l || index >= l->nchunks)
		return -1;
	pthread_mutex_lock(&l->lock);
	c = &l->chunks[index];
	if (c->state == LFS_LAZY_PRESENT && c->readers == 0) {
		c->state = LFS_LAZY_MISSING;
		l->st.present--;
		rc = 1;
	}
	pthread_mutex_unlock(&l->lock);
	return rc;
}

int lfs_lazy_chunk_punch(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 struct lfs_error *err)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	int rc = 0;

	if (!l || index >= l->nchunks)
		return lfs_error_set(err, ENOENT, "no chunk %u in layer slot %u", index, slot);
	pthread_mutex_lock(&l->lock);
	if (l->chunks[index].state == LFS_LAZY_PRESENT)
		rc = lfs_error_set(err, EBUSY, "chunk %u of `%s` is present", index, l->name);
	else if (fallocate(l->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
			   (off_t)index * l->chunk_size, (off_t)lazy_chunk_len(l, index)) < 0)
		rc = lfs_error_set(err, errno, "chunk %u of `%s`: punching a hole: %s", index,
				   l->name, strerror(errno));
	pthread_mutex_unlock(&l->lock);
	return rc;
}

int lfs_lazy_present_bitmap(struct lfs_lazy *lz, uint32_t slot, uint8_t *out, size_t nbytes)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	uint32_t n;

	if (!l)
		return -1;
	n = l->nchunks;
	if (nbytes < ((size_t)n + 7) / 8)
		return -1;
	memset(out, 0, nbytes);
	pthread_mutex_lock(&l->lock);
	for (uint32_t i = 0; i < n; i++)
		if (l->chunks[i].state == LFS_LAZY_PRESENT)
			out[i / 8] |= (uint8_t)(1u << (i % 8));
	pthread_mutex_unlock(&l->lock);
	return (int)n;
}

int lfs_lazy_chunk_info(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			uint64_t *atime)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	int st;

	if (!l || index >= l->nchunks)
		return -1;
	pthread_mutex_lock(&l->lock);
	st = l->chunks[index].state;
	if (atime)
		*atime = l->chunks[index].atime;
	pthread_mutex_unlock(&l->lock);
	return st;
}

int lfs_lazy_layer_stats(struct lfs_lazy *lz, uint32_t slot, struct lfs_lazy_stats *out)
{
	struct lazy_layer *l = lazy_slot(lz, slot);

	if (!l)
		return -1;
	pthread_mutex_lock(&l->lock);
	*out = l->st;
	out->reads = __atomic_load_n(&l->st.reads, __ATOMIC_RELAXED);
	out->read_bytes = __atomic_load_n(&l->st.read_bytes, __ATOMIC_RELAXED);
	out->errors = __atomic_load_n(&l->st.errors, __ATOMIC_RELAXED);
	out->wait_ns = __atomic_load_n(&l->st.wait_ns, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&l->lock);
	return 0;
}

int lfs_lazy_trace(struct lfs_lazy *lz, uint32_t slot, uint32_t *out, uint32_t max,
		   int reset)
{
	struct lazy_layer *l = lazy_slot(lz, slot);
	uint32_t n;

	if (!l)
		return -1;
	pthread_mutex_lock(&l->lock);
	n = l->ntrace;
	if (out)
		memcpy(out, l->trace, (n < max ? n : max) * sizeof(*out));
	if (reset) {
		for (uint32_t i = 0; i < l->ntrace; i++)
			l->chunks[l->trace[i]].touched = 0;
		l->ntrace = 0;
		l->st.touched = 0;
	}
	pthread_mutex_unlock(&l->lock);
	return (int)n;
}

int lfs_lazy_mount(const char *mountpoint, struct lfs_error *err)
{
	char opts[128];
	cleanup_close int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);

	if (fd < 0)
		return lfs_error_set(err, errno, "open `/dev/fuse`: %s", strerror(errno));
	snprintf(opts, sizeof(opts),
		 "fd=%d,rootmode=%o,user_id=0,group_id=0,allow_other,default_permissions,"
		 "max_read=1048576", fd, LAZY_ROOT_MODE);
	if (mount("layerfs-lazy", mountpoint, "fuse.layerfs",
		  MS_RDONLY | MS_NOSUID | MS_NODEV, opts) < 0)
		return lfs_error_set(err, errno, "mount fuse on `%s`: %s", mountpoint,
				     strerror(errno));
	return steal_fd(&fd);
}

int lfs_lazy_umount(const char *mountpoint, int detach, struct lfs_error *err)
{
	if (umount2(mountpoint, detach ? MNT_DETACH : 0) < 0)
		return lfs_error_set(err, errno, "umount `%s`: %s", mountpoint, strerror(errno));
	return 0;
}
