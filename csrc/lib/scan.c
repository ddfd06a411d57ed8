/* The directory scanner (see lfs_scan.h for the contract).
 *
 * Breadth-first, on two threads where there are two cores: each takes the next
 * directory from a shared queue, opens it, reads and sorts its names, lstat()s each
 * name relative to the directory fd, turns it into a writer inode in its own
 * arrays (a "part") and queues its subdirectories.  An inode, dirent or the like is
 * referred to by its part and its index there (SC_REF); when both threads are done,
 * the parts are joined into the one struct lfs_wr_input the writer takes.  Which
 * thread read which directory changes the order of the input, never the image: the
 * writer sorts names and numbers inodes breadth-first itself.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "lfs_cleanup.h"
#include "lfs_scan.h"

#define SC_XATTR_LIST_MAX (64u << 10)   /* XATTR_LIST_MAX, linux/limits.h */
#define SC_XATTR_SIZE_MAX (64u << 10)   /* XATTR_SIZE_MAX */
#define SC_SYMLINK_MAX 4095             /* PATH_MAX - 1 */
#define SC_PARTS 2
#define SC_REF(part, i) (((uint32_t)(part) << 31) | (uint32_t)(i))
#define SC_REF_PART(r) ((r) >> 31)
#define SC_REF_INDEX(r) ((r) & 0x7FFFFFFFu)
#define SC_MAX_INDEX 0x7FFFFFFEu

struct sc_vec {
	void *p;
	size_t n, cap;
};

struct sc_dir {                 /* a directory waiting to be read, then its result */
	uint32_t inode;         /* SC_REF */
	uint32_t path_len;
	uint64_t path_off;      /* in scan->paths */
	uint64_t dev, ino;      /* as its parent's lstat saw it */
	uint32_t dirent_first;  /* set by the part that read it */
	uint32_t dirent_count;
	uint32_t part;
};

struct sc_link {                /* a non-directory with st_nlink > 1 seen before */
	uint64_t dev, ino;
	uint32_t inode;         /* SC_REF; 0 in an empty slot (the root is a directory) */
};

struct sc_part {                /* one thread's output */
	struct lfs_scan *scan;
	uint32_t id;
	struct sc_vec inodes, dirents, xattrs, extents, blob;
	char *xnames;           /* llistxattr buffer */
	uint8_t *xvalue;        /* lgetxattr buffer */
	struct lfs_error err;
};

struct lfs_scan {
	struct lfs_wr_input in;
	struct sc_vec inodes, dirents, xattrs, extents, blob;   /* joined */
	pthread_mutex_t mu;     /* the queue, the paths and the hardlink table */
	pthread_cond_t cv;
	struct sc_vec dirs;     /* struct sc_dir, breadth-first */
	struct sc_vec paths;    /* directory paths, for opening and child paths */
	size_t next;            /* dirs[next] is the next to read */
	int busy;               /* threads reading a directory */
	bool failed;
	struct sc_link *links;  /* open addressing on (dev, ino) */
	size_t links_cap, links_n;
	struct sc_part part[SC_PARTS];
	struct lfs_error *err;  /* the first failure, copied from its part */
};

static int sc_reserve(struct lfs_error *err, struct sc_vec *v, size_t elem, size_t more)
{
	size_t cap = v->cap ? v->cap : 64;
	void *p;

	if (v->n + more <= v->cap)
		return 0;
	while (cap < v->n + more)
		cap *= 2;
	p = realloc(v->p, cap * elem);
	if (!p)
		return lfs_error_set(err, ENOMEM, "scan: out of memory (%zu entries)", cap);
	v->p = p;
	v->cap = cap;
	return 0;
}

/* Append `len` bytes to the part's blob; returns their offset, or UINT64_MAX. */
static uint64_t sc_blob(struct sc_part *t, const void *data, size_t len)
{
	uint64_t at = t->blob.n;

	if (sc_reserve(&t->err, &t->blob, 1, len) < 0)
		return UINT64_MAX;
	memcpy((uint8_t *)t->blob.p + at, data, len);
	t->blob.n += len;
	return at;
}

static struct lfs_wr_inode *sc_inode(const struct sc_part *t, uint32_t i)
{
	return (struct lfs_wr_inode *)t->inodes.p + i;
}

/* ---- hardlinks (under scan->mu) ------------------------------------------- */

static size_t sc_link_slot(size_t cap, uint64_t dev, uint64_t ino)
{
	uint64_t h = (dev * 0x9E3779B97F4A7C15ull) ^ (ino * 0xC2B2AE3D27D4EB4Full);

	return (size_t)(h ^ (h >> 29)) & (cap - 1);
}

/* The inode of (dev, ino) if one was made, else record `fresh` for it; returns the
 * inode, `fresh`, or UINT32_MAX without memory. */
static uint32_t sc_link(struct lfs_scan *s, uint64_t dev, uint64_t ino, uint32_t fresh)
{
	size_t k;

	if (2 * (s->links_n + 1) > s->links_cap) {
		size_t cap = s->links_cap ? 2 * s->links_cap : 1024;
		struct sc_link *t = calloc(cap, sizeof(*t));

		if (!t)
			return UINT32_MAX;
		for (size_t j = 0; j < s->links_cap; j++) {
			if (!s->links[j].inode)
				continue;
			k = sc_link_slot(cap, s->links[j].dev, s->links[j].ino);
			while (t[k].inode)
				k = (k + 1) & (cap - 1);
			t[k] = s->links[j];
		}
		free(s->links);
		s->links = t;
		s->links_cap = cap;
	}
	for (k = sc_link_slot(s->links_cap, dev, ino); s->links[k].inode;
	     k = (k + 1) & (s->links_cap - 1))
		if (s->links[k].dev == dev && s->links[k].ino == ino)
			return s->links[k].inode;
	s->links[k] = (struct sc_link){ dev, ino, fresh };
	s->links_n++;
	return fresh;
}

/* ---- one entry ------------------------------------------------------------ */

static int sc_xattrs(struct sc_part *t, uint32_t i, const char *path)
{
	ssize_t len = llistxattr(path, t->xnames, SC_XATTR_LIST_MAX);
	struct lfs_wr_inode *n;

	if (len < 0) {
		if (errno == ENOTSUP || errno == ENODATA)
			return 0;
		return lfs_error_set(&t->err, errno, "llistxattr `%s`: %s", path, strerror(errno));
	}
	sc_inode(t, i)->xattr_first = (uint32_t)t->xattrs.n;
	for (ssize_t at = 0; at < len;) {
		const char *name = t->xnames + at;
		size_t nlen = strnlen(name, (size_t)(len - at));
		ssize_t vlen = lgetxattr(path, name, t->xvalue, SC_XATTR_SIZE_MAX);
		struct lfs_wr_xattr *x;

		at += (ssize_t)nlen + 1;
		if (vlen < 0) {
			if (errno == ENODATA)   /* removed between list and get */
				continue;
			return lfs_error_set(&t->err, errno, "lgetxattr `%s` %s: %s", path, name,
					     strerror(errno));
		}
		if (sc_reserve(&t->err, &t->xattrs, sizeof(*x), 1) < 0)
			return -1;
		x = (struct lfs_wr_xattr *)t->xattrs.p + t->xattrs.n;
		x->name_len = (uint32_t)nlen;
		x->value_len = (uint32_t)vlen;
		x->name_off = sc_blob(t, name, nlen);
		x->value_off = sc_blob(t, t->xvalue, (size_t)vlen);
		if (x->name_off == UINT64_MAX || x->value_off == UINT64_MAX)
			return -1;
		t->xattrs.n++;
	}
	n = sc_inode(t, i);
	n->xattr_count = (uint32_t)(t->xattrs.n - n->xattr_first);
	return 0;
}

/* Data extents of a file that may have holes (fewer blocks than its size).  No
 * LFS_WR_SPARSE when it turns out to be one extent (inline or compressed data). */
static int sc_extents(struct sc_part *t, uint32_t i, const char *path, const struct stat *st)
{
	uint64_t size = (uint64_t)st->st_size, pos = 0, first = t->extents.n;
	struct stat fst;
	/* O_NONBLOCK: a FIFO swapped in must not block the open. */
	cleanup_close int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC |
				    O_NOCTTY);
	struct lfs_wr_inode *n;

	if (fd < 0)
		return lfs_error_set(&t->err, errno, "open `%s`: %s", path, strerror(errno));
	if (fstat(fd, &fst) < 0 || fst.st_dev != st->st_dev || fst.st_ino != st->st_ino)
		return lfs_error_set(&t->err, EINVAL, "`%s` changed during the scan", path);
	while (pos < size) {
		off_t a = lseek(fd, (off_t)pos, SEEK_DATA), b;
		struct lfs_wr_extent *e;

		if (a < 0) {
			if (errno == ENXIO)     /* a hole from pos to the end */
				break;
			return lfs_error_set(&t->err, errno, "lseek `%s`: %s", path,
					     strerror(errno));
		}
		if ((uint64_t)a >= size)
			break;
		b = lseek(fd, a, SEEK_HOLE);
		if (b < 0)
			return lfs_error_set(&t->err, errno, "lseek `%s`: %s", path,
					     strerror(errno));
		if ((uint64_t)b > size)
			b = (off_t)size;
		if (sc_reserve(&t->err, &t->extents, sizeof(*e), 1) < 0)
			return -1;
		e = (struct lfs_wr_extent *)t->extents.p + t->extents.n++;
		*e = (struct lfs_wr_extent){ (uint64_t)a, (uint64_t)(b - a), (uint64_t)a };
		pos = (uint64_t)b;
	}
	n = sc_inode(t, i);
	if (t->extents.n - first == 1) {
		const struct lfs_wr_extent *e = (struct lfs_wr_extent *)t->extents.p + first;

		if (e->file_off == 0 && e->len == size) {
			t->extents.n = first;   /* all data: a plain file */
			return 0;
		}
	}
	n->flags |= LFS_WR_SPARSE;
	n->extent_first = (uint32_t)first;
	n->extent_count = (uint32_t)(t->extents.n - first);
	return 0;
}

/* Queue a directory to be read (its inode `ref`, path and identity). */
static int sc_queue(struct sc_part *t, uint32_t ref, const char *path, size_t path_len,
		    const struct stat *st)
{
	struct lfs_scan *s = t->scan;
	struct sc_dir *d;
	int r = -1;

	pthread_mutex_lock(&s->mu);
	if (sc_reserve(&t->err, &s->dirs, sizeof(*d), 1) < 0 ||
	    sc_reserve(&t->err, &s->paths, 1, path_len) < 0)
		goto out;
	d = (struct sc_dir *)s->dirs.p + s->dirs.n++;
	*d = (struct sc_dir){ .inode = ref, .path_len = (uint32_t)path_len,
			      .path_off = s->paths.n, .dev = st->st_dev, .ino = st->st_ino };
	memcpy((char *)s->paths.p + s->paths.n, path, path_len);
	s->paths.n += path_len;
	pthread_cond_broadcast(&s->cv);
	r = 0;
out:
	pthread_mutex_unlock(&s->mu);
	return r;
}

/* A new inode in part t for the entry at `path` (lstat `st`), reached as dirent
 * `dirent` (SC_REF, UINT32_MAX for the root) of directory `parent` (SC_REF). */
static int sc_entry(struct sc_part *t, const char *path, size_t path_len, const struct stat *st,
		    int dfd, const char *name, uint32_t parent, uint32_t dirent)
{
	uint32_t i = (uint32_t)t->inodes.n;
	struct lfs_wr_inode *n;

	if (i > SC_MAX_INDEX)
		return lfs_error_set(&t->err, EINVAL, "scan: too many entries");
	if (sc_reserve(&t->err, &t->inodes, sizeof(*n), 1) < 0)
		return -1;
	t->inodes.n++;
	n = sc_inode(t, i);
	*n = (struct lfs_wr_inode){
		.mtime_sec = st->st_mtim.tv_sec,
		.mtime_nsec = (uint32_t)st->st_mtim.tv_nsec,
		.mode = st->st_mode,
		.uid = st->st_uid,
		.gid = st->st_gid,
		.parent = parent,
		.name_dirent = dirent,
		.src_dev = st->st_dev,
		.src_ino = st->st_ino,
	};
	if (sc_xattrs(t, i, path) < 0)
		return -1;
	n = sc_inode(t, i);
	if (S_ISREG(st->st_mode)) {
		n->size = (uint64_t)st->st_size;
		n->flags = LFS_WR_SRC_ID;
		n->src_size = (uint64_t)st->st_size;
		n->src_mtime_sec = st->st_mtim.tv_sec;
		n->src_mtime_nsec = (uint32_t)st->st_mtim.tv_nsec;
		n->str_len = (uint32_t)path_len;
		n->str_off = sc_blob(t, path, path_len);
		if (n->str_off == UINT64_MAX)
			return -1;
		/* Fewer allocated bytes than the size means holes (or inline or compressed
		 * storage; then SEEK_DATA reports one extent). */
		if (st->st_size && (uint64_t)st->st_blocks * 512 < (uint64_t)st->st_size &&
		    sc_extents(t, i, path, st) < 0)
			return -1;
	} else if (S_ISLNK(st->st_mode)) {
		char target[SC_SYMLINK_MAX + 2];
		ssize_t r = readlinkat(dfd, name, target, sizeof(target));

		if (r < 0)
			return lfs_error_set(&t->err, errno, "readlink `%s`: %s", path,
					     strerror(errno));
		if (r > SC_SYMLINK_MAX)
			return lfs_error_set(&t->err, EINVAL, "symlink `%s`: target longer than %d "
					     "bytes", path, SC_SYMLINK_MAX);
		n->size = (uint64_t)r;
		n->str_len = (uint32_t)r;
		n->str_off = sc_blob(t, target, (size_t)r);
		if (n->str_off == UINT64_MAX)
			return -1;
	} else if (S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode)) {
		n->rdev_major = major(st->st_rdev);
		n->rdev_minor = minor(st->st_rdev);
	}
	if (S_ISDIR(st->st_mode) && dirent != UINT32_MAX)  /* the root is queued already */
		return sc_queue(t, SC_REF(t->id, i), path, path_len, st);
	return 0;
}

/* ---- directories ---------------------------------------------------------- */

static int sc_name_cmp(const void *pa, const void *pb)
{
	const char *a = *(const char *const *)pa, *b = *(const char *const *)pb;

	return strcmp(a, b);    /* names hold no NUL: memcmp order */
}

/* Read directory `d` (its path in `path`, PATH_MAX + 1 bytes) into part t; the first
 * dirent and the count go into *first and *count.  The root (`root`) makes its own
 * inode first. */
static int sc_read_dir(struct sc_part *t, const struct sc_dir *d, char *path, bool root,
		       uint32_t *first, uint32_t *count)
{
	struct lfs_scan *s = t->scan;
	struct stat st;
	struct dirent *de;
	cleanup_free char **names = NULL;
	cleanup_free char *pool = NULL;
	size_t nnames = 0, pool_len = 0, pool_cap = 0, base;
	int fd, r = -1;
	DIR *dir;

	path[d->path_len] = '\0';
	fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		int e = errno;

		if (root && (e == ENOTDIR || e == ELOOP))
			return lfs_error_set(&t->err, ENOTDIR, "%s: not a directory", path);
		return lfs_error_set(&t->err, e == ELOOP || e == ENOTDIR ? EINVAL : e,
				     "open directory `%s`: %s%s", path, strerror(e),
				     e == ELOOP || e == ENOTDIR ? " (changed during the scan?)" : "");
	}
	if (fstat(fd, &st) < 0) {
		r = lfs_error_set(&t->err, errno, "fstat `%s`: %s", path, strerror(errno));
		close(fd);
		return r;
	}
	if (root) {
		/* The root itself: its lstat is this fstat (O_NOFOLLOW refused a symlink).
		 * Inode 0 of part 0, so the joined input starts with it. */
		if (sc_entry(t, path, d->path_len, &st, AT_FDCWD, path, 0, UINT32_MAX) < 0) {
			close(fd);
			return -1;
		}
	} else if ((uint64_t)st.st_dev != d->dev || (uint64_t)st.st_ino != d->ino) {
		close(fd);
		return lfs_error_set(&t->err, EINVAL, "directory `%s` changed during the scan",
				     path);
	}
	dir = fdopendir(fd);
	if (!dir) {
		r = lfs_error_set(&t->err, errno, "opendir `%s`: %s", path, strerror(errno));
		close(fd);
		return r;
	}
	/* Names into one pool first (readdir's buffer is reused), then sorted. */
	errno = 0;
	while ((de = readdir(dir)) != NULL) {
		size_t len = strlen(de->d_name) + 1;

		if (de->d_name[0] == '.' && (len == 2 || (len == 3 && de->d_name[1] == '.')))
			continue;
		if (pool_len + len > pool_cap) {
			size_t cap = pool_cap ? 2 * pool_cap : 4096;
			char *p;

			while (cap < pool_len + len)
				cap *= 2;
			p = realloc(pool, cap);
			if (!p)
				goto nomem;
			pool = p;
			pool_cap = cap;
		}
		memcpy(pool + pool_len, de->d_name, len);
		pool_len += len;
		nnames++;
		errno = 0;
	}
	if (errno) {
		r = lfs_error_set(&t->err, errno, "readdir `%s`: %s", path, strerror(errno));
		goto out;
	}
	names = malloc((nnames ? nnames : 1) * sizeof(*names));
	if (!names)
		goto nomem;
	for (size_t k = 0, at = 0; k < nnames; k++) {
		names[k] = pool + at;
		at += strlen(pool + at) + 1;
	}
	qsort(names, nnames, sizeof(*names), sc_name_cmp);

	/* Children's paths: this one, a '/' (none after a root of "/"), the name. */
	base = d->path_len == 1 && path[0] == '/' ? 1 : d->path_len + 1;
	path[base - 1] = '/';
	*first = (uint32_t)t->dirents.n;
	for (size_t k = 0; k < nnames; k++) {
		size_t nlen = strlen(names[k]);
		struct lfs_wr_dirent *e;
		struct stat cst;
		uint32_t child = UINT32_MAX, dirent = (uint32_t)t->dirents.n;

		if (dirent > SC_MAX_INDEX) {
			r = lfs_error_set(&t->err, EINVAL, "scan: too many entries");
			goto out;
		}
		if (base + nlen > PATH_MAX) {
			r = lfs_error_set(&t->err, ENAMETOOLONG, "`%.*s%s`: path longer than %d "
					  "bytes", (int)base, path, names[k], PATH_MAX);
			goto out;
		}
		memcpy(path + base, names[k], nlen + 1);
		if (fstatat(dirfd(dir), names[k], &cst, AT_SYMLINK_NOFOLLOW) < 0) {
			r = lfs_error_set(&t->err, errno, "lstat `%s`: %s", path, strerror(errno));
			goto out;
		}
		if (!S_ISDIR(cst.st_mode) && cst.st_nlink > 1) {
			/* A hardlink: the first thread to see it makes the inode. */
			uint32_t fresh = SC_REF(t->id, t->inodes.n);

			pthread_mutex_lock(&s->mu);
			child = sc_link(s, cst.st_dev, cst.st_ino, fresh);
			pthread_mutex_unlock(&s->mu);
			if (child == UINT32_MAX)
				goto nomem;
			if (child != fresh)
				goto named;
		}
		child = SC_REF(t->id, t->inodes.n);
		if (sc_entry(t, path, base + nlen, &cst, dirfd(dir), names[k], d->inode,
			     SC_REF(t->id, dirent)) < 0)
			goto out;
named:
		if (sc_reserve(&t->err, &t->dirents, sizeof(*e), 1) < 0)
			goto out;
		e = (struct lfs_wr_dirent *)t->dirents.p + t->dirents.n++;
		e->inode = child;
		e->name_len = (uint32_t)nlen;
		e->name_off = sc_blob(t, names[k], nlen);
		if (e->name_off == UINT64_MAX)
			goto out;
	}
	*count = (uint32_t)(t->dirents.n - *first);
	r = 0;
	goto out;
nomem:
	r = lfs_error_set(&t->err, ENOMEM, "scan `%s`: out of memory", path);
out:
	closedir(dir);
	return r;
}

/* A thread's loop: read queued directories until none is left and none is being read
 * (which could queue more), or one failed. */
static void *sc_worker(void *arg)
{
	struct sc_part *t = arg;
	struct lfs_scan *s = t->scan;
	char path[PATH_MAX + 1];

	pthread_mutex_lock(&s->mu);
	for (;;) {
		struct sc_dir d;
		size_t q;
		uint32_t first = 0, count = 0;
		int r;

		while (s->next == s->dirs.n && s->busy && !s->failed)
			pthread_cond_wait(&s->cv, &s->mu);
		if (s->failed || s->next == s->dirs.n)
			break;
		q = s->next++;
		s->busy++;
		d = ((struct sc_dir *)s->dirs.p)[q];
		memcpy(path, (char *)s->paths.p + d.path_off, d.path_len);
		pthread_mutex_unlock(&s->mu);
		r = sc_read_dir(t, &d, path, q == 0, &first, &count);
		pthread_mutex_lock(&s->mu);
		if (r < 0) {
			if (!s->failed) {
				s->failed = true;
				*s->err = t->err;
			}
		} else {
			struct sc_dir *done = (struct sc_dir *)s->dirs.p + q;

			done->dirent_first = first;
			done->dirent_count = count;
			done->part = t->id;
		}
		s->busy--;
		pthread_cond_broadcast(&s->cv);
	}
	pthread_cond_broadcast(&s->cv);
	pthread_mutex_unlock(&s->mu);
	return NULL;
}

/* ---- joining the parts ---------------------------------------------------- */

static int sc_join(struct lfs_scan *s)
{
	size_t bi[SC_PARTS], bd[SC_PARTS], bx[SC_PARTS], be[SC_PARTS], bb[SC_PARTS];
	size_t ni = 0, nd = 0, nx = 0, ne = 0, nb = 0;
	struct lfs_wr_inode *ino;
	struct lfs_wr_dirent *den;
	struct lfs_wr_xattr *xat;

	for (int p = 0; p < SC_PARTS; p++) {
		const struct sc_part *t = &s->part[p];

		bi[p] = ni, bd[p] = nd, bx[p] = nx, be[p] = ne, bb[p] = nb;
		ni += t->inodes.n, nd += t->dirents.n, nx += t->xattrs.n, ne += t->extents.n;
		nb += t->blob.n;
	}
	if (ni > UINT32_MAX - 1 || nd > UINT32_MAX - 1 || nx > UINT32_MAX || ne > UINT32_MAX)
		return lfs_error_set(s->err, EINVAL, "scan: too many entries");
	if (sc_reserve(s->err, &s->inodes, sizeof(*ino), ni ? ni : 1) < 0 ||
	    sc_reserve(s->err, &s->dirents, sizeof(*den), nd ? nd : 1) < 0 ||
	    sc_reserve(s->err, &s->xattrs, sizeof(*xat), nx ? nx : 1) < 0 ||
	    sc_reserve(s->err, &s->extents, sizeof(struct lfs_wr_extent), ne ? ne : 1) < 0 ||
	    sc_reserve(s->err, &s->blob, 1, nb ? nb : 1) < 0)
		return -1;
#define GI(r) ((uint32_t)(bi[SC_REF_PART(r)] + SC_REF_INDEX(r)))
#define GD(r) ((uint32_t)(bd[SC_REF_PART(r)] + SC_REF_INDEX(r)))
	ino = s->inodes.p;
	den = s->dirents.p;
	xat = s->xattrs.p;
	for (int p = 0; p < SC_PARTS; p++) {
		const struct sc_part *t = &s->part[p];

		for (size_t i = 0; i < t->inodes.n; i++) {
			struct lfs_wr_inode *n = &ino[bi[p] + i];

			*n = ((struct lfs_wr_inode *)t->inodes.p)[i];
			n->str_off += bb[p];
			n->xattr_first += (uint32_t)bx[p];
			n->extent_first += (uint32_t)be[p];
			n->parent = GI(n->parent);
			if (n->name_dirent != UINT32_MAX)
				n->name_dirent = GD(n->name_dirent);
		}
		for (size_t k = 0; k < t->dirents.n; k++) {
			struct lfs_wr_dirent *e = &den[bd[p] + k];

			*e = ((struct lfs_wr_dirent *)t->dirents.p)[k];
			e->inode = GI(e->inode);
			e->name_off += bb[p];
		}
		for (size_t k = 0; k < t->xattrs.n; k++) {
			struct lfs_wr_xattr *x = &xat[bx[p] + k];

			*x = ((struct lfs_wr_xattr *)t->xattrs.p)[k];
			x->name_off += bb[p];
			x->value_off += bb[p];
		}
		if (t->extents.n)
			memcpy((struct lfs_wr_extent *)s->extents.p + be[p], t->extents.p,
			       t->extents.n * sizeof(struct lfs_wr_extent));
		if (t->blob.n)
			memcpy((uint8_t *)s->blob.p + bb[p], t->blob.p, t->blob.n);
	}
	for (size_t q = 0; q < s->dirs.n; q++) {
		const struct sc_dir *d = (struct sc_dir *)s->dirs.p + q;
		struct lfs_wr_inode *n = &ino[GI(d->inode)];

		n->dirent_first = (uint32_t)(bd[d->part] + d->dirent_first);
		n->dirent_count = d->dirent_count;
	}
#undef GI
#undef GD
	s->in = (struct lfs_wr_input){
		.inodes = s->inodes.p, .dirents = s->dirents.p, .xattrs = s->xattrs.p,
		.extents = s->extents.p, .blob = s->blob.p, .blob_len = nb,
		.ninodes = (uint32_t)ni, .ndirents = (uint32_t)nd,
		.nxattrs = (uint32_t)nx, .nextents = (uint32_t)ne,
	};
	return 0;
}

static void sc_part_free(struct sc_part *t)
{
	free(t->inodes.p);
	free(t->dirents.p);
	free(t->xattrs.p);
	free(t->extents.p);
	free(t->blob.p);
	free(t->xnames);
	free(t->xvalue);
	memset(t, 0, sizeof(*t));
}

int lfs_scan_dir(const char *path, struct lfs_scan **out, struct lfs_error *err)
{
	struct lfs_scan *s = calloc(1, sizeof(*s));
	size_t len = strlen(path);
	int nthreads = sysconf(_SC_NPROCESSORS_ONLN) >= 2 ? SC_PARTS : 1, r = 0;
	pthread_t helper;
	bool helping = false;
	struct sc_dir *d;

	*out = NULL;
	if (!s)
		return lfs_error_set(err, ENOMEM, "scan: out of memory");
	s->err = err;
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->cv, NULL);
	for (int p = 0; p < SC_PARTS; p++) {
		s->part[p].scan = s;
		s->part[p].id = (uint32_t)p;
		s->part[p].xnames = malloc(SC_XATTR_LIST_MAX);
		s->part[p].xvalue = malloc(SC_XATTR_SIZE_MAX);
		if (!s->part[p].xnames || !s->part[p].xvalue) {
			lfs_scan_free(s);
			return lfs_error_set(err, ENOMEM, "scan: out of memory");
		}
	}
	while (len > 1 && path[len - 1] == '/')
		len--;
	if (len > PATH_MAX) {
		lfs_scan_free(s);
		return lfs_error_set(err, ENAMETOOLONG, "`%s`: path too long", path);
	}
	/* The root is queued with no expected identity; its reader makes its inode. */
	if (sc_reserve(err, &s->dirs, sizeof(*d), 1) < 0 || sc_reserve(err, &s->paths, 1, len) < 0) {
		lfs_scan_free(s);
		return -1;
	}
	memcpy(s->paths.p, path, len);
	s->paths.n = len;
	d = s->dirs.p;
	*d = (struct sc_dir){ .inode = SC_REF(0, 0), .path_len = (uint32_t)len };
	s->dirs.n = 1;
	/* The root first, alone, in part 0: it is inode 0 of the joined input.  (Its
	 * subdirectories are queued meanwhile: dirs may move, so work on a copy.) */
	{
		struct sc_dir rootd = *d;
		char rpath[PATH_MAX + 1];
		uint32_t first = 0, count = 0;

		memcpy(rpath, path, len);
		s->next = 1;
		r = sc_read_dir(&s->part[0], &rootd, rpath, true, &first, &count);
		if (r < 0) {
			*err = s->part[0].err;
			lfs_scan_free(s);
			return -1;
		}
		d = s->dirs.p;
		d->dirent_first = first;
		d->dirent_count = count;
	}
	if (nthreads > 1) {
		sigset_t all, old;

		/* The helper blocks every signal: they stay with the caller's threads. */
		sigfillset(&all);
		pthread_sigmask(SIG_SETMASK, &all, &old);
		helping = pthread_create(&helper, NULL, sc_worker, &s->part[1]) == 0;
		pthread_sigmask(SIG_SETMASK, &old, NULL);
	}
	sc_worker(&s->part[0]);
	if (helping)
		pthread_join(helper, NULL);
	if (s->failed || sc_join(s) < 0) {
		lfs_scan_free(s);
		return -1;
	}
	for (int p = 0; p < SC_PARTS; p++)
		sc_part_free(&s->part[p]);
	free(s->links);
	free(s->paths.p);
	free(s->dirs.p);
	s->links = NULL;
	s->paths.p = s->dirs.p = NULL;
	s->err = NULL;
	*out = s;
	return 0;
}

const struct lfs_wr_input *lfs_scan_input(const struct lfs_scan *scan)
{
	return &scan->in;
}

void lfs_scan_free(struct lfs_scan *s)
{
	if (!s)
		return;
	for (int p = 0; p < SC_PARTS; p++)
		sc_part_free(&s->part[p]);
	free(s->inodes.p);
	free(s->dirents.p);
	free(s->xattrs.p);
	free(s->extents.p);
	free(s->blob.p);
	free(s->paths.p);
	free(s->dirs.p);
	free(s->links);
	pthread_mutex_destroy(&s->mu);
	pthread_cond_destroy(&s->cv);
	free(s);
}
