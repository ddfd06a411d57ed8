/* The directory scanner (see lfs_scan.h for the contract).
 *
 * One pass, breadth-first: a directory is opened, its names read and sorted, each
 * name lstat'ed relative to the directory fd and turned into a writer inode, and
 * its subdirectories queued.  Everything goes into growing arrays that become the
 * struct lfs_wr_input handed to lfs_writer_write() as is.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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

struct sc_vec {
	void *p;
	size_t n, cap;
};

struct sc_dir {                 /* a directory waiting to be read */
	uint32_t inode;
	uint32_t path_len;
	uint64_t path_off;      /* in scan->paths */
	uint64_t dev, ino;      /* as its parent's lstat saw it */
};

struct lfs_scan {
	struct lfs_wr_input in;
	struct sc_vec inodes, dirents, xattrs, extents, blob;
	struct sc_vec paths;    /* directory paths, for opening and child paths */
	struct sc_vec dirs;     /* struct sc_dir queue, breadth-first */
	uint64_t *links;        /* open addressing: (dev, ino) -> inode + 1 */
	size_t links_cap, links_n;
	char *xnames;           /* llistxattr buffer */
	uint8_t *xvalue;        /* lgetxattr buffer */
	struct lfs_error *err;
};

static int sc_reserve(struct lfs_scan *s, struct sc_vec *v, size_t elem, size_t more)
{
	size_t cap = v->cap ? v->cap : 64;
	void *p;

	if (v->n + more <= v->cap)
		return 0;
	while (cap < v->n + more)
		cap *= 2;
	p = realloc(v->p, cap * elem);
	if (!p)
		return lfs_error_set(s->err, ENOMEM, "scan: out of memory (%zu entries)", cap);
	v->p = p;
	v->cap = cap;
	return 0;
}

/* Append `len` bytes to the blob; returns their offset, or UINT64_MAX. */
static uint64_t sc_blob(struct lfs_scan *s, const void *data, size_t len)
{
	uint64_t at = s->blob.n;

	if (sc_reserve(s, &s->blob, 1, len) < 0)
		return UINT64_MAX;
	memcpy((uint8_t *)s->blob.p + at, data, len);
	s->blob.n += len;
	return at;
}

static struct lfs_wr_inode *sc_inode(const struct lfs_scan *s, uint32_t i)
{
	return (struct lfs_wr_inode *)s->inodes.p + i;
}

/* ---- hardlinks ------------------------------------------------------------ */

static size_t sc_link_slot(const struct lfs_scan *s, uint64_t dev, uint64_t ino)
{
	uint64_t h = (dev * 0x9E3779B97F4A7C15ull) ^ (ino * 0xC2B2AE3D27D4EB4Full);

	return (size_t)(h ^ (h >> 29)) & (s->links_cap - 1);
}

/* The inode of (dev, ino) seen before, or UINT32_MAX. */
static uint32_t sc_link_find(const struct lfs_scan *s, uint64_t dev, uint64_t ino)
{
	if (!s->links_cap)
		return UINT32_MAX;
	for (size_t k = sc_link_slot(s, dev, ino);; k = (k + 1) & (s->links_cap - 1)) {
		uint64_t v = s->links[k];

		if (!v)
			return UINT32_MAX;
		if (sc_inode(s, (uint32_t)(v - 1))->src_dev == dev &&
		    sc_inode(s, (uint32_t)(v - 1))->src_ino == ino)
			return (uint32_t)(v - 1);
	}
}

static int sc_link_add(struct lfs_scan *s, uint32_t inode)
{
	const struct lfs_wr_inode *n;

	if (2 * (s->links_n + 1) > s->links_cap) {
		size_t old = s->links_cap, cap = old ? 2 * old : 1024;
		uint64_t *prev = s->links;

		s->links = calloc(cap, sizeof(*s->links));
		if (!s->links) {
			s->links = prev;
			return lfs_error_set(s->err, ENOMEM, "scan: out of memory (hardlinks)");
		}
		s->links_cap = cap;
		for (size_t k = 0; k < old; k++) {
			if (prev[k]) {
				n = sc_inode(s, (uint32_t)(prev[k] - 1));
				size_t j = sc_link_slot(s, n->src_dev, n->src_ino);

				while (s->links[j])
					j = (j + 1) & (cap - 1);
				s->links[j] = prev[k];
			}
		}
		free(prev);
	}
	n = sc_inode(s, inode);
	size_t k = sc_link_slot(s, n->src_dev, n->src_ino);

	while (s->links[k])
		k = (k + 1) & (s->links_cap - 1);
	s->links[k] = (uint64_t)inode + 1;
	s->links_n++;
	return 0;
}

/* ---- one entry ------------------------------------------------------------ */

static int sc_xattrs(struct lfs_scan *s, uint32_t i, const char *path)
{
	ssize_t len = llistxattr(path, s->xnames, SC_XATTR_LIST_MAX);
	struct lfs_wr_inode *n;

	if (len < 0) {
		if (errno == ENOTSUP || errno == ENODATA)
			return 0;
		return lfs_error_set(s->err, errno, "llistxattr `%s`: %s", path, strerror(errno));
	}
	sc_inode(s, i)->xattr_first = (uint32_t)s->xattrs.n;
	for (ssize_t at = 0; at < len;) {
		const char *name = s->xnames + at;
		size_t nlen = strnlen(name, (size_t)(len - at));
		ssize_t vlen = lgetxattr(path, name, s->xvalue, SC_XATTR_SIZE_MAX);
		struct lfs_wr_xattr *x;

		at += (ssize_t)nlen + 1;
		if (vlen < 0) {
			if (errno == ENODATA)   /* removed between list and get */
				continue;
			return lfs_error_set(s->err, errno, "lgetxattr `%s` %s: %s", path, name,
					     strerror(errno));
		}
		if (sc_reserve(s, &s->xattrs, sizeof(*x), 1) < 0)
			return -1;
		x = (struct lfs_wr_xattr *)s->xattrs.p + s->xattrs.n;
		x->name_len = (uint32_t)nlen;
		x->value_len = (uint32_t)vlen;
		x->name_off = sc_blob(s, name, nlen);
		x->value_off = sc_blob(s, s->xvalue, (size_t)vlen);
		if (x->name_off == UINT64_MAX || x->value_off == UINT64_MAX)
			return -1;
		s->xattrs.n++;
	}
	n = sc_inode(s, i);
	n->xattr_count = (uint32_t)(s->xattrs.n - n->xattr_first);
	return 0;
}

/* Data extents of a file that may have holes (fewer blocks than its size).  No
 * LFS_WR_SPARSE when it turns out to be one extent (inline or compressed data). */
static int sc_extents(struct lfs_scan *s, uint32_t i, const char *path, const struct stat *st)
{
	uint64_t size = (uint64_t)st->st_size, pos = 0, first = s->extents.n;
	struct stat fst;
	/* O_NONBLOCK: a FIFO swapped in must not block the open. */
	cleanup_close int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC |
				    O_NOCTTY);
	struct lfs_wr_inode *n;

	if (fd < 0)
		return lfs_error_set(s->err, errno, "open `%s`: %s", path, strerror(errno));
	if (fstat(fd, &fst) < 0 || fst.st_dev != st->st_dev || fst.st_ino != st->st_ino)
		return lfs_error_set(s->err, EINVAL, "`%s` changed during the scan", path);
	while (pos < size) {
		off_t a = lseek(fd, (off_t)pos, SEEK_DATA), b;
		struct lfs_wr_extent *e;

		if (a < 0) {
			if (errno == ENXIO)     /* a hole from pos to the end */
				break;
			return lfs_error_set(s->err, errno, "lseek `%s`: %s", path, strerror(errno));
		}
		if ((uint64_t)a >= size)
			break;
		b = lseek(fd, a, SEEK_HOLE);
		if (b < 0)
			return lfs_error_set(s->err, errno, "lseek `%s`: %s", path, strerror(errno));
		if ((uint64_t)b > size)
			b = (off_t)size;
		if (sc_reserve(s, &s->extents, sizeof(*e), 1) < 0)
			return -1;
		e = (struct lfs_wr_extent *)s->extents.p + s->extents.n++;
		*e = (struct lfs_wr_extent){ (uint64_t)a, (uint64_t)(b - a), (uint64_t)a };
		pos = (uint64_t)b;
	}
	n = sc_inode(s, i);
	if (s->extents.n - first == 1) {
		const struct lfs_wr_extent *e = (struct lfs_wr_extent *)s->extents.p + first;

		if (e->file_off == 0 && e->len == size) {
			s->extents.n = first;   /* all data: a plain file */
			return 0;
		}
	}
	n->flags |= LFS_WR_SPARSE;
	n->extent_first = (uint32_t)first;
	n->extent_count = (uint32_t)(s->extents.n - first);
	return 0;
}

/* A new inode for the entry at `path` (lstat `st`), reached as dirent `dirent` of
 * directory inode `parent`. */
static int sc_entry(struct lfs_scan *s, const char *path, size_t path_len, const struct stat *st,
		    int dfd, const char *name, uint32_t parent, uint32_t dirent)
{
	uint32_t i = (uint32_t)s->inodes.n;
	struct lfs_wr_inode *n;

	if (s->inodes.n >= UINT32_MAX - 1)
		return lfs_error_set(s->err, EINVAL, "scan: too many entries");
	if (sc_reserve(s, &s->inodes, sizeof(*n), 1) < 0)
		return -1;
	s->inodes.n++;
	n = sc_inode(s, i);
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
	if (sc_xattrs(s, i, path) < 0)
		return -1;
	n = sc_inode(s, i);
	if (S_ISREG(st->st_mode)) {
		n->size = (uint64_t)st->st_size;
		n->flags = LFS_WR_SRC_ID;
		n->src_size = (uint64_t)st->st_size;
		n->src_mtime_sec = st->st_mtim.tv_sec;
		n->src_mtime_nsec = (uint32_t)st->st_mtim.tv_nsec;
		n->str_len = (uint32_t)path_len;
		n->str_off = sc_blob(s, path, path_len);
		if (n->str_off == UINT64_MAX)
			return -1;
		/* Fewer allocated bytes than the size means holes (or inline or compressed
		 * storage; then SEEK_DATA reports one extent). */
		if (st->st_size && (uint64_t)st->st_blocks * 512 < (uint64_t)st->st_size &&
		    sc_extents(s, i, path, st) < 0)
			return -1;
	} else if (S_ISLNK(st->st_mode)) {
		char target[SC_SYMLINK_MAX + 2];
		ssize_t r = readlinkat(dfd, name, target, sizeof(target));

		if (r < 0)
			return lfs_error_set(s->err, errno, "readlink `%s`: %s", path, strerror(errno));
		if (r > SC_SYMLINK_MAX)
			return lfs_error_set(s->err, EINVAL, "symlink `%s`: target longer than %d "
					     "bytes", path, SC_SYMLINK_MAX);
		n->size = (uint64_t)r;
		n->str_len = (uint32_t)r;
		n->str_off = sc_blob(s, target, (size_t)r);
		if (n->str_off == UINT64_MAX)
			return -1;
	} else if (S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode)) {
		n->rdev_major = major(st->st_rdev);
		n->rdev_minor = minor(st->st_rdev);
	}
	/* src_dev/src_ino key the hardlinks of every kind (the writer reads them only
	 * with LFS_WR_SRC_ID, set for regular files). */
	if (!S_ISDIR(st->st_mode) && st->st_nlink > 1 && sc_link_add(s, i) < 0)
		return -1;
	if (S_ISDIR(st->st_mode) && dirent != UINT32_MAX) {  /* the root is queued already */
		struct sc_dir *d;

		if (sc_reserve(s, &s->dirs, sizeof(*d), 1) < 0)
			return -1;
		d = (struct sc_dir *)s->dirs.p + s->dirs.n;
		*d = (struct sc_dir){ .inode = i, .path_len = (uint32_t)path_len,
				      .path_off = s->paths.n, .dev = st->st_dev,
				      .ino = st->st_ino };
		if (sc_reserve(s, &s->paths, 1, path_len) < 0)
			return -1;
		memcpy((char *)s->paths.p + s->paths.n, path, path_len);
		s->paths.n += path_len;
		s->dirs.n++;
	}
	return 0;
}

/* ---- directories ---------------------------------------------------------- */

static int sc_name_cmp(const void *pa, const void *pb)
{
	const char *a = *(const char *const *)pa, *b = *(const char *const *)pb;

	return strcmp(a, b);    /* names hold no NUL: memcmp order */
}

static int sc_read_dir(struct lfs_scan *s, size_t q)
{
	struct sc_dir d = ((struct sc_dir *)s->dirs.p)[q];
	char path[PATH_MAX + 1];
	struct stat st;
	struct dirent *de;
	cleanup_free char **names = NULL;
	cleanup_free char *pool = NULL;
	size_t nnames = 0, cap_names = 0, pool_len = 0, pool_cap = 0, base;
	int fd, r = -1;
	DIR *dir;

	memcpy(path, (char *)s->paths.p + d.path_off, d.path_len);
	path[d.path_len] = '\0';
	fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		if (q == 0 && (errno == ENOTDIR || errno == ELOOP))
			return lfs_error_set(s->err, ENOTDIR, "%s: not a directory", path);
		return lfs_error_set(s->err, errno == ELOOP || errno == ENOTDIR ? EINVAL : errno,
				     "open directory `%s`: %s%s", path, strerror(errno),
				     errno == ELOOP || errno == ENOTDIR ?
				     " (changed during the scan?)" : "");
	}
	if (fstat(fd, &st) < 0) {
		r = lfs_error_set(s->err, errno, "fstat `%s`: %s", path, strerror(errno));
		close(fd);
		return r;
	}
	if (q == 0) {
		/* The root itself: its lstat is this fstat (O_NOFOLLOW refused a symlink). */
		if (sc_entry(s, path, d.path_len, &st, AT_FDCWD, path, 0, UINT32_MAX) < 0) {
			close(fd);
			return -1;
		}
	} else if ((uint64_t)st.st_dev != d.dev || (uint64_t)st.st_ino != d.ino) {
		close(fd);
		return lfs_error_set(s->err, EINVAL, "directory `%s` changed during the scan", path);
	}
	dir = fdopendir(fd);
	if (!dir) {
		r = lfs_error_set(s->err, errno, "opendir `%s`: %s", path, strerror(errno));
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
		r = lfs_error_set(s->err, errno, "readdir `%s`: %s", path, strerror(errno));
		goto out;
	}
	cap_names = nnames ? nnames : 1;
	names = malloc(cap_names * sizeof(*names));
	if (!names)
		goto nomem;
	for (size_t k = 0, at = 0; k < nnames; k++) {
		names[k] = pool + at;
		at += strlen(pool + at) + 1;
	}
	qsort(names, nnames, sizeof(*names), sc_name_cmp);

	/* Children's paths: this one, a '/' (none after a root of "/"), the name. */
	base = d.path_len == 1 && path[0] == '/' ? 1 : d.path_len + 1;
	path[base - 1] = '/';
	sc_inode(s, d.inode)->dirent_first = (uint32_t)s->dirents.n;
	for (size_t k = 0; k < nnames; k++) {
		size_t nlen = strlen(names[k]);
		struct lfs_wr_dirent *e;
		struct stat cst;
		uint32_t child, dirent = (uint32_t)s->dirents.n;

		if (base + nlen > PATH_MAX) {
			r = lfs_error_set(s->err, ENAMETOOLONG, "`%.*s%s`: path longer than %d "
					  "bytes", (int)base, path, names[k], PATH_MAX);
			goto out;
		}
		memcpy(path + base, names[k], nlen + 1);
		if (fstatat(dirfd(dir), names[k], &cst, AT_SYMLINK_NOFOLLOW) < 0) {
			r = lfs_error_set(s->err, errno, "lstat `%s`: %s", path, strerror(errno));
			goto out;
		}
		child = (!S_ISDIR(cst.st_mode) && cst.st_nlink > 1)
			? sc_link_find(s, cst.st_dev, cst.st_ino) : UINT32_MAX;
		if (child == UINT32_MAX) {
			child = (uint32_t)s->inodes.n;
			if (sc_entry(s, path, base + nlen, &cst, dirfd(dir), names[k],
				     d.inode, dirent) < 0)
				goto out;
		}
		if (sc_reserve(s, &s->dirents, sizeof(*e), 1) < 0)
			goto out;
		e = (struct lfs_wr_dirent *)s->dirents.p + s->dirents.n++;
		e->inode = child;
		e->name_len = (uint32_t)nlen;
		e->name_off = sc_blob(s, names[k], nlen);
		if (e->name_off == UINT64_MAX)
			goto out;
	}
	sc_inode(s, d.inode)->dirent_count =
		(uint32_t)(s->dirents.n - sc_inode(s, d.inode)->dirent_first);
	r = 0;
	goto out;
nomem:
	r = lfs_error_set(s->err, ENOMEM, "scan `%s`: out of memory", path);
out:
	closedir(dir);
	return r;
}

int lfs_scan_dir(const char *path, struct lfs_scan **out, struct lfs_error *err)
{
	struct lfs_scan *s = calloc(1, sizeof(*s));
	size_t len = strlen(path);
	struct sc_dir *d;

	*out = NULL;
	if (!s)
		return lfs_error_set(err, ENOMEM, "scan: out of memory");
	s->err = err;
	s->xnames = malloc(SC_XATTR_LIST_MAX);
	s->xvalue = malloc(SC_XATTR_SIZE_MAX);
	if (!s->xnames || !s->xvalue) {
		lfs_scan_free(s);
		return lfs_error_set(err, ENOMEM, "scan: out of memory");
	}
	while (len > 1 && path[len - 1] == '/')
		len--;
	if (len > PATH_MAX) {
		lfs_scan_free(s);
		return lfs_error_set(err, ENAMETOOLONG, "`%s`: path too long", path);
	}
	/* The root is queued with no expected identity; sc_read_dir makes its inode. */
	if (sc_reserve(s, &s->dirs, sizeof(*d), 1) < 0 || sc_reserve(s, &s->paths, 1, len) < 0) {
		lfs_scan_free(s);
		return -1;
	}
	memcpy(s->paths.p, path, len);
	s->paths.n = len;
	d = s->dirs.p;
	*d = (struct sc_dir){ .inode = 0, .path_len = (uint32_t)len, .path_off = 0 };
	s->dirs.n = 1;
	for (size_t q = 0; q < s->dirs.n; q++) {
		if (sc_read_dir(s, q) < 0) {
			lfs_scan_free(s);
			return -1;
		}
	}
	s->in = (struct lfs_wr_input){
		.inodes = s->inodes.p, .dirents = s->dirents.p, .xattrs = s->xattrs.p,
		.extents = s->extents.p, .blob = s->blob.p, .blob_len = s->blob.n,
		.ninodes = (uint32_t)s->inodes.n, .ndirents = (uint32_t)s->dirents.n,
		.nxattrs = (uint32_t)s->xattrs.n, .nextents = (uint32_t)s->extents.n,
	};
	free(s->xnames);
	free(s->xvalue);
	free(s->links);
	free(s->paths.p);
	free(s->dirs.p);
	s->xnames = NULL;
	s->xvalue = NULL;
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
	free(s->inodes.p);
	free(s->dirents.p);
	free(s->xattrs.p);
	free(s->extents.p);
	free(s->blob.p);
	free(s->paths.p);
	free(s->dirs.p);
	free(s->links);
	free(s->xnames);
	free(s->xvalue);
	free(s);
}
