/* The EROFS layer writer (see lfs_writer.h for the contract, erofs_fs.h for the
 * format).
 *
 * Three passes over a flattened tree:
 *   1. validate and sort (names memcmp-sorted incl. "." and "..", xattrs by name),
 *      breadth-first inode order from the root, nlink from the dirents;
 *   2. lay out everything: inodes from byte 1152 (root nid 36), inline tails where
 *      they fit in one block, then data blocks (small files packed in inode order,
 *      files of at least chunk_align bytes each at a chunk_align boundary);
 *   3. stream data from the sources through a few buffers that a second thread
 *      writes (big files go kernel to kernel, copied by that thread too), then
 *      encode the metadata (held in memory: it is small next to the data) and
 *      write it at offset 0.
 * Every byte of the output is a function of the input: padding is zero, the
 * epoch is the most common mtime, the uuid a hash of the metadata, and each write
 * carries its own offset, so the order the threads run in changes nothing.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "erofs_fs.h"
#include "lfs_cleanup.h"
#include "lfs_error.h"
#include "lfs_writer.h"

/* Output goes through WR_SLOTS buffers of WR_BUF_SIZE: the building thread reads
 * source bytes into one while a second thread pwrite()s the filled ones, so reading
 * and writing (each one copy through the page cache) run on two cores.  The slots
 * are small enough (1 MiB in all) to stay in the CPU cache between the two copies;
 * with 1 MiB slots the second copy came from memory and the pipeline was no faster
 * than one thread.  Each slot carries its own offset, so the image bytes do not
 * depend on when the writer thread runs. */
#define WR_BUF_SIZE (128u << 10)
#define WR_SLOTS 8
/* With LFS_WR_OPT_WRITEBACK, writeback of the image is started every this many bytes,
 * so the caller's fsync finds little left to write. */
#define WR_WRITEBACK_STEP (16ull << 20)
#define WR_DIRECT_MIN (64u << 10) /* copy_file_range(2) from this size up */
#define WR_SYMLINK_MAX 4095  /* PATH_MAX - 1: what readlink(2) can return */


struct wr_ent {                 /* one directory entry, "." and ".." included */
	const uint8_t *name;
	uint32_t len;
	uint32_t inode;
};

struct wr_node {
	uint64_t nid;
	uint64_t size;          /* i_size */
	uint64_t blkaddr;       /* first data block */
	uint64_t nblocks;       /* blocks in the data area */
	uint64_t meta_off;      /* byte offset of the inode */
	uint64_t inline_len;    /* bytes after inode + xattrs: tail or chunk map */
	uint64_t nchunks;
	int64_t mtime_sec;
	uint32_t mtime_nsec;
	uint32_t nlink;
	uint32_t ent_first;     /* directories: entries in wr->ents */
	uint32_t ent_count;
	uint32_t xattr_isize;
	uint32_t parent;        /* directories: the one directory holding it */
	uint8_t extended;
	uint8_t layout;
	uint8_t chunkbits;
	uint8_t big;
	uint8_t reached;
};

struct wr {
	const struct lfs_wr_input *in;
	const struct lfs_wr_options *opt;
	struct lfs_error *err;
	struct wr_node *nodes;
	struct wr_ent *ents;
	uint32_t *order;        /* inode indices in nid order (breadth-first) */
	uint32_t *xorder;       /* xattr indices, each inode's range sorted by name */
	uint32_t blksz;
	uint32_t blkbits;
	int64_t epoch_sec;
	uint32_t epoch_nsec;
	uint64_t meta_end;
	uint64_t data_start;    /* block */
	uint64_t total_blocks;
	bool chunked;
	bool no_cfr;            /* copy_file_range(2) refused once: use the buffer */
	int fd;
	uint8_t *buf;           /* output buffer: bytes for [buf_off, buf_off + buf_len) */
	size_t buf_len;
	uint64_t buf_off;
	struct wr_pipe *pipe;   /* the writer thread, or NULL: pwrite() here */
	uint8_t *own_buf;       /* the buffer when there is no writer thread */
	uint8_t *meta;          /* blocks [0, data_start) of the image (mmap'd) */
	uint64_t meta_len;
	uint8_t *scratch;       /* a directory's content */
	size_t scratch_cap;
};

/* ---- messages ---------------------------------------------------------- */

static bool blob_ok(const struct wr *w, uint64_t off, uint64_t len)
{
	return off <= w->in->blob_len && len <= w->in->blob_len - off;
}

/* "/a/b/c" for inode `ino`, from the parent/name hints given by the caller. */
static const char *wr_path(const struct wr *w, uint32_t ino, char *out, size_t size)
{
	const struct lfs_wr_input *in = w->in;
	uint32_t comps[64];
	int n = 0;
	size_t pos = 0;

	while (ino < in->ninodes && ino != 0 && n < 64) {
		uint32_t d = in->inodes[ino].name_dirent;

		if (d >= in->ndirents || !blob_ok(w, in->dirents[d].name_off, in->dirents[d].name_len))
			break;
		comps[n++] = d;
		ino = in->inodes[ino].parent;
	}
	out[0] = '\0';
	if (n == 64)
		pos += snprintf(out, size, "...");
	for (int i = n - 1; i >= 0 && pos < size; i--) {
		const struct lfs_wr_dirent *de = &in->dirents[comps[i]];
		int len = de->name_len > 255 ? 255 : (int)de->name_len;

		pos += snprintf(out + pos, size - pos, "/%.*s", len,
				(const char *)in->blob + de->name_off);
	}
	if (n == 0)
		snprintf(out, size, "/");
	return out;
}

__attribute__((format(printf, 4, 5)))
static int wr_fail(struct wr *w, uint32_t ino, int code, const char *fmt, ...)
{
	char path[1024];
	char msg[LFS_ERROR_MSG_MAX];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return lfs_error_set(w->err, code, "entry %s (inode %u): %s",
			     wr_path(w, ino, path, sizeof(path)), ino, msg);
}

/* ---- validation and sorting ------------------------------------------- */

static bool mode_ok(uint32_t mode)
{
	switch (mode & S_IFMT) {
	case S_IFREG: case S_IFDIR: case S_IFLNK: case S_IFCHR:
	case S_IFBLK: case S_IFIFO: case S_IFSOCK:
		return (mode & ~(uint32_t)(S_IFMT | 07777)) == 0;
	default:
		return false;
	}
}

static uint8_t file_type(uint32_t mode)
{
	switch (mode & S_IFMT) {
	case S_IFREG: return EROFS_FT_REG_FILE;
	case S_IFDIR: return EROFS_FT_DIR;
	case S_IFLNK: return EROFS_FT_SYMLINK;
	case S_IFCHR: return EROFS_FT_CHRDEV;
	case S_IFBLK: return EROFS_FT_BLKDEV;
	case S_IFIFO: return EROFS_FT_FIFO;
	case S_IFSOCK: return EROFS_FT_SOCK;
	}
	return EROFS_FT_UNKNOWN;
}

/* Prefix index and suffix of a full xattr name; -1 for a name EROFS cannot hold
 * without the long-prefix feature (the kernel hides index 0 names). */
static int xattr_split(const uint8_t *name, uint32_t len, uint32_t *suffix_off)
{
	static const struct { const char *p; int index; bool whole; } tab[] = {
		{ "system.posix_acl_access", EROFS_XATTR_INDEX_POSIX_ACL_ACCESS, true },
		{ "system.posix_acl_default", EROFS_XATTR_INDEX_POSIX_ACL_DEFAULT, true },
		{ "user.", EROFS_XATTR_INDEX_USER, false },
		{ "trusted.", EROFS_XATTR_INDEX_TRUSTED, false },
		{ "security.", EROFS_XATTR_INDEX_SECURITY, false },
	};

	for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++) {
		uint32_t plen = (uint32_t)strlen(tab[i].p);

		if (len < plen || memcmp(name, tab[i].p, plen) != 0)
			continue;
		if (tab[i].whole ? len != plen : len == plen)
			continue;
		*suffix_off = plen;
		return tab[i].index;
	}
	return -1;
}

static int name_cmp(const uint8_t *a, uint32_t alen, const uint8_t *b, uint32_t blen)
{
	int c = memcmp(a, b, alen < blen ? alen : blen);

	if (c)
		return c;
	return alen < blen ? -1 : alen > blen;
}

static int ent_cmp(const void *pa, const void *pb)
{
	const struct wr_ent *a = pa, *b = pb;

	return name_cmp(a->name, a->len, b->name, b->len);
}

static int xattr_cmp(const void *pa, const void *pb, void *ctx)
{
	const struct wr *w = ctx;
	const struct lfs_wr_xattr *a = &w->in->xattrs[*(const uint32_t *)pa];
	const struct lfs_wr_xattr *b = &w->in->xattrs[*(const uint32_t *)pb];

	return name_cmp(w->in->blob + a->name_off, a->name_len,
			w->in->blob + b->name_off, b->name_len);
}

/* A regular file with bytes to copy: not empty, and not a sparse file that is all
 * hole (no extents: a preallocated file; its chunks are all holes). */
static bool file_reads_source(const struct lfs_wr_inode *ino)
{
	return ino->size && (!(ino->flags & LFS_WR_SPARSE) || ino->extent_count);
}

static int validate_inode(struct wr *w, uint32_t i)
{
	const struct lfs_wr_input *in = w->in;
	const struct lfs_wr_inode *ino = &in->inodes[i];
	uint32_t type = ino->mode & S_IFMT;

	if (!mode_ok(ino->mode))
		return wr_fail(w, i, EINVAL, "bad mode 0%o", ino->mode);
	if (ino->mtime_nsec >= 1000000000u)
		return wr_fail(w, i, EINVAL, "mtime nanoseconds %u out of range", ino->mtime_nsec);
	if ((uint64_t)ino->xattr_first + ino->xattr_count > in->nxattrs)
		return wr_fail(w, i, EINVAL, "xattr range out of bounds");
	if (type == S_IFDIR) {
		if ((uint64_t)ino->dirent_first + ino->dirent_count > in->ndirents)
			return wr_fail(w, i, EINVAL, "dirent range out of bounds");
	} else if (ino->dirent_count) {
		return wr_fail(w, i, EINVAL, "a non-directory has children");
	}
	if (type == S_IFREG) {
		if (ino->size > LFS_WR_MAX_FILE_SIZE)
			return wr_fail(w, i, EINVAL, "size %llu too large (maximum %llu)",
				       (unsigned long long)ino->size, LFS_WR_MAX_FILE_SIZE);
		if (file_reads_source(ino) && (!ino->str_len || ino->str_len > PATH_MAX ||
				  !blob_ok(w, ino->str_off, ino->str_len) ||
				  memchr(in->blob + ino->str_off, 0, ino->str_len)))
			return wr_fail(w, i, EINVAL, "missing or bad data source path");
		if (ino->flags & LFS_WR_SPARSE) {
			uint64_t end = 0;

			if ((uint64_t)ino->extent_first + ino->extent_count > in->nextents)
				return wr_fail(w, i, EINVAL, "extent range out of bounds");
			for (uint32_t k = 0; k < ino->extent_count; k++) {
				const struct lfs_wr_extent *e = &in->extents[ino->extent_first + k];

				if (!e->len || e->file_off < end || e->len > ino->size ||
				    e->file_off > ino->size - e->len ||
				    e->src_off > (uint64_t)INT64_MAX - e->len)
					return wr_fail(w, i, EINVAL,
						       "extent %u (offset %llu, length %llu) is empty, "
						       "unsorted, overlapping or outside the file", k,
						       (unsigned long long)e->file_off,
						       (unsigned long long)e->len);
				end = e->file_off + e->len;
			}
		} else if (ino->src_offset > (uint64_t)INT64_MAX - ino->size) {
			return wr_fail(w, i, EINVAL, "source offset overflows");
		}
	} else if (type == S_IFLNK) {
		if (!ino->str_len || ino->str_len > WR_SYMLINK_MAX ||
		    !blob_ok(w, ino->str_off, ino->str_len))
			return wr_fail(w, i, EINVAL, "symlink target length %u not in 1..%d",
				       ino->str_len, WR_SYMLINK_MAX);
		if (memchr(in->blob + ino->str_off, 0, ino->str_len))
			return wr_fail(w, i, EINVAL, "symlink target contains NUL");
	} else if (type == S_IFCHR || type == S_IFBLK) {
		/* new_encode_dev(): 12-bit major, 20-bit minor (include/linux/kdev_t.h) */
		if (ino->rdev_major > 0xFFF || ino->rdev_minor > 0xFFFFF)
			return wr_fail(w, i, EINVAL, "device %u:%u out of range",
				       ino->rdev_major, ino->rdev_minor);
	}
	return 0;
}

/* Sort an inode's xattrs and size its xattr ibody. */
static int prepare_xattrs(struct wr *w, uint32_t i)
{
	const struct lfs_wr_input *in = w->in;
	const struct lfs_wr_inode *ino = &in->inodes[i];
	uint32_t *xs = w->xorder + ino->xattr_first;
	uint64_t isize = sizeof(struct erofs_xattr_ibody_header);

	if (!ino->xattr_count)
		return 0;
	for (uint32_t k = 0; k < ino->xattr_count; k++) {
		const struct lfs_wr_xattr *x = &in->xattrs[ino->xattr_first + k];
		uint32_t soff;
		int idx;

		if (!blob_ok(w, x->name_off, x->name_len) || !blob_ok(w, x->value_off, x->value_len))
			return wr_fail(w, i, EINVAL, "xattr %u out of bounds", k);
		idx = xattr_split(in->blob + x->name_off, x->name_len, &soff);
		if (idx < 0 || memchr(in->blob + x->name_off, 0, x->name_len))
			return wr_fail(w, i, EINVAL, "xattr name `%.*s` is not user.*, trusted.*, "
				       "security.* or a POSIX ACL", (int)(x->name_len > 255 ? 255 :
								     x->name_len),
				       (const char *)in->blob + x->name_off);
		if (x->name_len - soff > 255 || x->value_len > 65535)
			return wr_fail(w, i, EINVAL, "xattr `%.*s`: name or value too long",
				       (int)(x->name_len > 255 ? 255 : x->name_len),
				       (const char *)in->blob + x->name_off);
		isize += (sizeof(struct erofs_xattr_entry) + (x->name_len - soff) + x->value_len +
			  EROFS_XATTR_ALIGN - 1) & ~(uint64_t)(EROFS_XATTR_ALIGN - 1);
		xs[k] = ino->xattr_first + k;
	}
	qsort_r(xs, ino->xattr_count, sizeof(*xs), xattr_cmp, w);
	for (uint32_t k = 1; k < ino->xattr_count; k++)
		if (xattr_cmp(&xs[k - 1], &xs[k], w) == 0)
			return wr_fail(w, i, EINVAL, "duplicate xattr");
	/* i_xattr_icount is 16 bits: isize = 12 + 4 * (icount - 1) */
	if ((isize - 12) / 4 + 1 > 0xFFFF)
		return wr_fail(w, i, EINVAL, "xattrs too large (%llu bytes)",
			       (unsigned long long)isize);
	w->nodes[i].xattr_isize = (uint32_t)isize;
	return 0;
}

static int prepare_tree(struct wr *w)
{
	const struct lfs_wr_input *in = w->in;
	uint64_t nents = in->ndirents;
	uint32_t head = 0, tail = 0;

	if (!in->ninodes || (in->inodes[0].mode & S_IFMT) != S_IFDIR)
		return lfs_error_set(w->err, EINVAL, "the root (inode 0) must be a directory");
	for (uint32_t i = 0; i < in->ninodes; i++) {
		if (validate_inode(w, i) < 0 || prepare_xattrs(w, i) < 0)
			return -1;
		w->nodes[i].parent = UINT32_MAX;
		if ((in->inodes[i].mode & S_IFMT) == S_IFDIR)
			nents += 2;
	}
	w->nodes[0].parent = 0;
	if (nents > UINT32_MAX)
		return lfs_error_set(w->err, EINVAL, "too many directory entries");
	w->ents = calloc(nents ? nents : 1, sizeof(*w->ents));
	if (!w->ents)
		return lfs_error_set(w->err, ENOMEM, "directory entries");

	/* Directories have exactly one parent: no directory hardlinks, no cycles. */
	for (uint32_t i = 0; i < in->ninodes; i++) {
		const struct lfs_wr_inode *ino = &in->inodes[i];

		for (uint32_t k = 0; k < ino->dirent_count; k++) {
			const struct lfs_wr_dirent *de = &in->dirents[ino->dirent_first + k];
			const uint8_t *name = in->blob + de->name_off;

			if (!blob_ok(w, de->name_off, de->name_len) || !de->name_len ||
			    de->name_len > EROFS_NAME_LEN)
				return wr_fail(w, i, EINVAL, "child %u: name length %u not in 1..255",
					       k, de->name_len);
			if (memchr(name, '/', de->name_len) || memchr(name, 0, de->name_len) ||
			    (de->name_len == 1 && name[0] == '.') ||
			    (de->name_len == 2 && name[0] == '.' && name[1] == '.'))
				return wr_fail(w, i, EINVAL, "child name `%.*s` contains '/' or NUL "
					       "or is a dot entry", (int)de->name_len,
					       (const char *)name);
			if (de->inode >= in->ninodes || de->inode == 0)
				return wr_fail(w, i, EINVAL, "child `%.*s` names bad inode %u",
					       (int)de->name_len, (const char *)name, de->inode);
			if ((in->inodes[de->inode].mode & S_IFMT) == S_IFDIR) {
				if (w->nodes[de->inode].parent != UINT32_MAX)
					return wr_fail(w, de->inode, EINVAL,
						       "directory linked more than once");
				w->nodes[de->inode].parent = i;
			}
		}
	}

	/* Sorted entries per directory, "." and ".." included (lookup bisects them). */
	nents = 0;
	for (uint32_t i = 0; i < in->ninodes; i++) {
		const struct lfs_wr_inode *ino = &in->inodes[i];
		struct wr_node *n = &w->nodes[i];
		struct wr_ent *e;

		if ((ino->mode & S_IFMT) != S_IFDIR)
			continue;
		n->ent_first = (uint32_t)nents;
		n->ent_count = ino->dirent_count + 2;
		e = w->ents + nents;
		e[0] = (struct wr_ent){ (const uint8_t *)".", 1, i };
		e[1] = (struct wr_ent){ (const uint8_t *)"..", 2, n->parent == UINT32_MAX ? i : n->parent };
		for (uint32_t k = 0; k < ino->dirent_count; k++) {
			const struct lfs_wr_dirent *de = &in->dirents[ino->dirent_first + k];

			e[k + 2] = (struct wr_ent){ in->blob + de->name_off, de->name_len, de->inode };
		}
		qsort(e, n->ent_count, sizeof(*e), ent_cmp);
		for (uint32_t k = 1; k < n->ent_count; k++)
			if (ent_cmp(&e[k - 1], &e[k]) == 0)
				return wr_fail(w, i, EINVAL, "duplicate child name `%.*s`",
					       (int)e[k].len, (const char *)e[k].name);
		nents += n->ent_count;
	}

	/* Breadth-first from the root: the nid order; nlink from the references. */
	w->order[tail++] = 0;
	w->nodes[0].reached = 1;
	while (head < tail) {
		uint32_t d = w->order[head++];
		struct wr_node *n = &w->nodes[d];

		if ((in->inodes[d].mode & S_IFMT) != S_IFDIR)
			continue;
		n->nlink = 2;
		for (uint32_t k = 0; k < n->ent_count; k++) {
			const struct wr_ent *e = &w->ents[n->ent_first + k];
			struct wr_node *c = &w->nodes[e->inode];

			if (e->name[0] == '.' && (e->len == 1 || (e->len == 2 && e->name[1] == '.')))
				continue;
			if ((in->inodes[e->inode].mode & S_IFMT) == S_IFDIR) {
				n->nlink++;
			} else {
				c->nlink++;
			}
			if (!c->reached) {
				c->reached = 1;
				w->order[tail++] = e->inode;
			}
		}
	}
	if (tail != in->ninodes) {
		for (uint32_t i = 0; i < in->ninodes; i++)
			if (!w->nodes[i].reached)
				return wr_fail(w, i, EINVAL, "not reachable from the root");
	}
	return 0;
}

/* ---- layout ------------------------------------------------------------ */

static int cmp_time(const void *pa, const void *pb)
{
	const struct wr_node *a = *(struct wr_node *const *)pa, *b = *(struct wr_node *const *)pb;

	if (a->mtime_sec != b->mtime_sec)
		return a->mtime_sec < b->mtime_sec ? -1 : 1;
	return a->mtime_nsec < b->mtime_nsec ? -1 : a->mtime_nsec > b->mtime_nsec;
}

/* Clamp mtimes, then pick the epoch: compact inodes carry no mtime of their own
 * (their i_mtime stays 0, which old and new kernels read alike as the sb epoch),
 * so the most common mtime lets the most inodes be compact. */
static int choose_epoch(struct wr *w)
{
	const struct lfs_wr_options *o = w->opt;
	uint32_t n = w->in->ninodes, m = 0, best = 0;
	cleanup_free struct wr_node **v = calloc(n, sizeof(*v));

	if (!v)
		return lfs_error_set(w->err, ENOMEM, "epoch");
	for (uint32_t i = 0; i < n; i++) {
		struct wr_node *nd = &w->nodes[i];

		nd->mtime_sec = w->in->inodes[i].mtime_sec;
		nd->mtime_nsec = w->in->inodes[i].mtime_nsec;
		if ((o->flags & LFS_WR_OPT_CLAMP) &&
		    (nd->mtime_sec > o->clamp_sec ||
		     (nd->mtime_sec == o->clamp_sec && nd->mtime_nsec > o->clamp_nsec))) {
			nd->mtime_sec = o->clamp_sec;
			nd->mtime_nsec = o->clamp_nsec;
		}
		if (nd->mtime_sec >= 0)
			v[m++] = nd;
	}
	w->epoch_sec = 0;
	w->epoch_nsec = 0;
	if (o->flags & LFS_WR_OPT_EPOCH) {
		w->epoch_sec = o->epoch_sec;
		w->epoch_nsec = o->epoch_nsec;
		return 0;
	}
	qsort(v, m, sizeof(*v), cmp_time);
	for (uint32_t i = 0, run = 0; i < m; i++) {
		run = (i && cmp_time(&v[i - 1], &v[i]) == 0) ? run + 1 : 1;
		if (run > best) {
			best = run;
			w->epoch_sec = v[i]->mtime_sec;
			w->epoch_nsec = v[i]->mtime_nsec;
		}
	}
	return 0;
}

static uint64_t dir_size(const struct wr *w, const struct wr_node *n)
{
	uint64_t size = 0;
	uint32_t used = 0;

	for (uint32_t k = 0; k < n->ent_count; k++) {
		uint32_t need = sizeof(struct erofs_dirent) + w->ents[n->ent_first + k].len;

		if (used + need > w->blksz) {
			size += w->blksz;
			used = 0;
		}
		used += need;
	}
	return size + used;
}

/* Stored bytes of a sparse file laid out in chunks of 2^bits: every chunk that holds
 * any extent byte is stored whole (the last one up to the file end, block-rounded),
 * plus the map of 4-byte entries.  O(extents), in 128 bits so no size overflows. */
static unsigned __int128 sparse_cost(const struct wr *w, uint32_t i, unsigned bits,
				     uint64_t *stored_blocks)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	const struct lfs_wr_extent *ext = w->in->extents + ino->extent_first;
	uint64_t size = ino->size, blksz = w->blksz, cs = 1ull << bits;
	uint64_t nchunks = (size >> bits) + ((size & (cs - 1)) != 0);
	uint64_t last = UINT64_MAX, count = 0, tail_blocks = cs / blksz;
	bool has_tail = false;

	for (uint32_t k = 0; k < ino->extent_count; k++) {
		uint64_t a = ext[k].file_off >> bits;
		uint64_t b = (ext[k].file_off + ext[k].len - 1) >> bits;

		if (last != UINT64_MAX && a <= last)
			a = last + 1;
		if (a <= b) {
			count += b - a + 1;
			if (b == nchunks - 1)
				has_tail = true;
			last = b;
		}
	}
	if (has_tail)       /* the last chunk ends at the file end */
		tail_blocks = (size - ((nchunks - 1) << bits) + blksz - 1) / blksz;
	*stored_blocks = count ? (count - 1) * (cs / blksz) + tail_blocks : 0;
	return (unsigned __int128)nchunks * EROFS_BLOCK_MAP_ENTRY_SIZE +
		(unsigned __int128)*stored_blocks * blksz;
}

/* A sparse file: pick the chunk size minimising map + stored bytes, or a flat
 * layout if that is no bigger (then holes would not save anything).  Refuses a file
 * whose best layout costs more than LFS_WR_SPARSE_FACTOR x data + SLACK. */
static int plan_sparse(struct wr *w, uint32_t i)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	const struct lfs_wr_extent *ext = w->in->extents + ino->extent_first;
	struct wr_node *n = &w->nodes[i];
	uint64_t size = ino->size, blksz = w->blksz, data = 0, best_blocks = 0;
	unsigned __int128 best = (size + blksz - 1) / blksz * blksz, bound;
	unsigned best_bits = 0;

	for (uint32_t k = 0; k < ino->extent_count; k++)
		data += ext[k].len;     /* extents do not overlap and lie inside size */
	for (unsigned bits = w->blkbits; bits <= w->blkbits + EROFS_CHUNK_FORMAT_BLKBITS_MASK &&
	     bits < 63; bits++) {
		uint64_t blocks;
		unsigned __int128 cost = sparse_cost(w, i, bits, &blocks);

		if (cost < best) {
			best = cost;
			best_bits = bits;
			best_blocks = blocks;
		}
		if ((1ull << bits) >= size)
			break;
	}
	bound = (unsigned __int128)data * LFS_WR_SPARSE_FACTOR + LFS_WR_SPARSE_SLACK;
	if (best > bound)
		return wr_fail(w, i, EINVAL, "sparse file of %llu bytes with %llu data bytes in "
			       "%u extents: its smallest EROFS layout needs %llu bytes, more than "
			       "%d x data + %llu MiB (extents too small and far apart)",
			       (unsigned long long)size, (unsigned long long)data,
			       ino->extent_count,
			       best > UINT64_MAX ? ~0ull : (unsigned long long)best,
			       LFS_WR_SPARSE_FACTOR, LFS_WR_SPARSE_SLACK >> 20);
	if (!best_bits)
		return 0;
	n->layout = EROFS_INODE_CHUNK_BASED;
	n->chunkbits = (uint8_t)best_bits;
	n->nchunks = (size + (1ull << best_bits) - 1) >> best_bits;
	n->inline_len = n->nchunks * EROFS_BLOCK_MAP_ENTRY_SIZE;
	n->nblocks = best_blocks;
	return 0;
}

static int layout(struct wr *w)
{
	const struct lfs_wr_input *in = w->in;
	uint64_t pos = EROFS_SUPER_OFFSET + sizeof(struct erofs_super_block);
	uint64_t blksz = w->blksz, cur, align_blocks;

	for (uint32_t o = 0; o < in->ninodes; o++) {
		uint32_t i = w->order[o];
		const struct lfs_wr_inode *ino = &in->inodes[i];
		struct wr_node *n = &w->nodes[i];
		uint32_t type = ino->mode & S_IFMT;
		uint64_t base, start = pos, tail = 0;

		switch (type) {
		case S_IFREG:
			n->size = ino->size;
			break;
		case S_IFLNK:
			n->size = ino->str_len;
			break;
		case S_IFDIR:
			n->size = dir_size(w, n);
			break;
		default:
			n->size = 0;
		}
		n->extended = !(ino->uid <= 0xFFFF && ino->gid <= 0xFFFF && n->nlink <= 0xFFFF &&
				n->size <= UINT32_MAX && n->mtime_sec == w->epoch_sec &&
				n->mtime_nsec == w->epoch_nsec);
		base = (n->extended ? sizeof(struct erofs_inode_extended)
			: sizeof(struct erofs_inode_compact)) + n->xattr_isize;
		n->layout = EROFS_INODE_FLAT_PLAIN;
		if (type == S_IFREG && (ino->flags & LFS_WR_SPARSE) && plan_sparse(w, i) < 0)
			return -1;
		if (n->layout == EROFS_INODE_CHUNK_BASED) {
			w->chunked = true;
		} else if (type == S_IFREG || type == S_IFLNK || type == S_IFDIR) {
			n->nblocks = n->size / blksz;
			tail = n->size % blksz;
		}
		if (tail) {
			/* The inline tail must not cross a block (erofs_map_blocks:
			 * "inline data cross block boundary").  Pad in front of the inode
			 * when that wastes less than giving the tail its own block. */
			uint64_t padded = (pos + blksz - 1) / blksz * blksz;

			if ((pos + base) % blksz + tail <= blksz) {
				n->layout = EROFS_INODE_FLAT_INLINE;
			} else if (base + tail <= blksz && padded - pos <= blksz - tail) {
				n->layout = EROFS_INODE_FLAT_INLINE;
				start = padded;
			} else {
				n->nblocks++;
			}
			if (n->layout == EROFS_INODE_FLAT_INLINE)
				n->inline_len = tail;
		}
		n->meta_off = start;
		n->nid = start >> EROFS_ISLOTBITS;
		pos = (start + base + n->inline_len + EROFS_ISLOT - 1) & ~(uint64_t)(EROFS_ISLOT - 1);
		if (pos > LFS_WR_MAX_META)
			return wr_fail(w, i, EINVAL, "metadata area exceeds %llu MiB (too many "
				       "inodes, xattrs or chunk map entries)", LFS_WR_MAX_META >> 20);
		if (type == S_IFREG && n->nblocks && w->opt->chunk_align &&
		    n->size >= w->opt->chunk_align)
			n->big = 1;
	}
	if (w->nodes[0].nid > 0xFFFF)
		return lfs_error_set(w->err, EINVAL, "root nid does not fit 16 bits");
	w->meta_end = pos;
	w->data_start = (pos + blksz - 1) / blksz;

	/* Data: small files packed in nid order, then each big file on a boundary so
	 * the same file in two layers fills identical store chunks. */
	cur = w->data_start;
	align_blocks = w->opt->chunk_align ? w->opt->chunk_align / blksz : 1;
	for (int pass = 0; pass < 2; pass++) {
		for (uint32_t o = 0; o < in->ninodes; o++) {
			struct wr_node *n = &w->nodes[w->order[o]];

			if (!n->nblocks || n->big != pass)
				continue;
			if (pass)
				cur = (cur + align_blocks - 1) / align_blocks * align_blocks;
			n->blkaddr = cur;
			cur += n->nblocks;
			if (cur > UINT32_MAX)
				return lfs_error_set(w->err, EFBIG,
						     "image exceeds 2^32 blocks of %llu bytes",
						     (unsigned long long)blksz);
		}
	}
	/* An image without data blocks (all data inline) ends with its metadata.  If that
	 * ends on a block boundary, the last inode can end at the image end (when it has
	 * no xattrs and nothing inline), and fsck.erofs then reads past the end and calls
	 * the image corrupt: erofs_verify_xattr() (fsck/main.c, erofs-utils 1.5 to now)
	 * reads the 12-byte xattr ibody header of every inode, even one whose
	 * i_xattr_icount is 0.  The kernel reads nothing there.  One zero block (a hole)
	 * after the metadata satisfies both. */
	if (cur == w->data_start && w->meta_end == w->data_start * blksz)
		cur++;
	w->total_blocks = cur;
	return 0;
}

/* ---- output ------------------------------------------------------------ */

/* Byte offset of what follows the inode and its xattrs: inline tail or chunk map. */
static uint64_t inline_off(const struct wr_node *n)
{
	return n->meta_off + (n->extended ? sizeof(struct erofs_inode_extended)
			      : sizeof(struct erofs_inode_compact)) + n->xattr_isize;
}

/* The queue between the building thread and the writer thread.  A slot holds either
 * bytes to pwrite() (src_fd -1) or a copy job: `len` bytes of the open source src_fd
 * (a dup the writer thread closes) from src_off, copied with copy_file_range(2), so
 * that big files (most of the bytes) are copied by the writer thread and the two
 * threads share the work; both writes to the image then come from one thread. */
struct wr_pipe {
	pthread_t thread;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	uint8_t *slot[WR_SLOTS];
	uint64_t off[WR_SLOTS];
	uint64_t len[WR_SLOTS];
	int src_fd[WR_SLOTS];
	uint64_t src_off[WR_SLOTS];
	const uint8_t *mem[WR_SLOTS];   /* or bytes to write from here (the metadata) */
	uint32_t inode[WR_SLOTS];
	uint64_t head, tail;    /* slots [tail, head) are queued; slot head is the builder's */
	bool stop;
	bool no_cfr;            /* copy_file_range(2) refused once: copy through the slot */
	int fd;
	bool writeback;
	uint64_t wb_done, wb_end;       /* writeback started below wb_done */
	int code;               /* the first failure: errno, offset, inode of a copy job */
	uint64_t code_off;
	uint32_t code_inode;    /* UINT32_MAX: writing the image */
	bool code_eof;          /* the source ended early */
};

/* pwrite all of buf at off; 0 or an errno. */
static int pwrite_all(int fd, const uint8_t *buf, size_t len, uint64_t off, uint64_t *at)
{
	size_t done = 0;

	while (done < len) {
		ssize_t r = pwrite(fd, buf + done, len - done, (off_t)(off + done));

		if (r < 0) {
			if (errno == EINTR)
				continue;
			*at = off + done;
			return errno;
		}
		done += (size_t)r;
	}
	return 0;
}

static bool cfr_refused(int e)
{
	/* EXDEV, EINVAL on odd filesystems, ENOSYS, EOPNOTSUPP, EBADF (some FUSE): the
	 * buffer does it instead. */
	return e == EXDEV || e == EINVAL || e == ENOSYS || e == EOPNOTSUPP || e == EBADF;
}

/* Run the copy job of slot k; 0 or an errno (with *at, and *eof for a short source). */
static int pipe_copy(struct wr_pipe *p, uint32_t k, uint64_t *at, bool *eof)
{
	loff_t src = (loff_t)p->src_off[k], dst = (loff_t)p->off[k];
	uint64_t len = p->len[k];

	while (len && !p->no_cfr) {
		ssize_t r = copy_file_range(p->src_fd[k], &src, p->fd, &dst, len, 0);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			if (dst == (loff_t)p->off[k] && cfr_refused(errno)) {
				p->no_cfr = true;
				break;
			}
			*at = (uint64_t)dst;
			return errno;
		}
		if (r == 0) {
			*at = (uint64_t)src;
			*eof = true;
			return EIO;
		}
		len -= (uint64_t)r;
	}
	while (len) {   /* through this slot's buffer */
		size_t piece = len > WR_BUF_SIZE ? WR_BUF_SIZE : (size_t)len;
		ssize_t r = pread(p->src_fd[k], p->slot[k], piece, src);
		int code;

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			*at = (uint64_t)src;
			*eof = r == 0;
			return r == 0 ? EIO : errno;
		}
		code = pwrite_all(p->fd, p->slot[k], (size_t)r, (uint64_t)dst, at);
		if (code)
			return code;
		src += r;
		dst += r;
		len -= (uint64_t)r;
	}
	return 0;
}

static void *pipe_main(void *arg)
{
	struct wr_pipe *p = arg;

	pthread_mutex_lock(&p->mu);
	for (;;) {
		uint32_t k;
		uint64_t at = 0;
		bool failed, eof, job;
		int code;

		while (p->tail == p->head && !p->stop)
			pthread_cond_wait(&p->cv, &p->mu);
		if (p->tail == p->head)
			break;
		k = (uint32_t)(p->tail % WR_SLOTS);
		failed = p->code != 0;  /* after a failure the rest is only drained */
		pthread_mutex_unlock(&p->mu);
		eof = false;
		job = p->src_fd[k] >= 0;
		if (failed)
			code = 0;
		else if (job)
			code = pipe_copy(p, k, &at, &eof);
		else
			code = pwrite_all(p->fd, p->mem[k] ? p->mem[k] : p->slot[k], p->len[k],
					  p->off[k], &at);
		if (job) {
			close(p->src_fd[k]);
			p->src_fd[k] = -1;
		}
		if (!code && p->writeback) {
			if (p->off[k] + p->len[k] > p->wb_end)
				p->wb_end = p->off[k] + p->len[k];
			if (p->wb_end - p->wb_done >= WR_WRITEBACK_STEP) {
				/* A hint: errors show at the caller's fsync. */
				(void)sync_file_range(p->fd, (off64_t)p->wb_done,
						      (off64_t)(p->wb_end - p->wb_done),
						      SYNC_FILE_RANGE_WRITE);
				p->wb_done = p->wb_end;
			}
		}
		pthread_mutex_lock(&p->mu);
		if (code && !p->code) {
			p->code = code;
			p->code_off = at;
			p->code_inode = job ? p->inode[k] : UINT32_MAX;
			p->code_eof = eof;
		}
		p->tail++;
		pthread_cond_broadcast(&p->cv);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

static int pipe_error(struct wr *w, struct wr_pipe *p)
{
	const struct lfs_wr_inode *ino;

	if (p->code_inode == UINT32_MAX)
		return lfs_error_set(w->err, p->code, "write image at offset %llu: %s",
				     (unsigned long long)p->code_off, strerror(p->code));
	ino = &w->in->inodes[p->code_inode];
	if (p->code_eof)
		return wr_fail(w, p->code_inode, EIO, "source `%.*s` ended early at offset "
			       "%llu (changed while building?)", (int)ino->str_len,
			       (const char *)w->in->blob + ino->str_off,
			       (unsigned long long)p->code_off);
	return wr_fail(w, p->code_inode, p->code, "copy `%.*s` into the image: %s",
		       (int)ino->str_len, (const char *)w->in->blob + ino->str_off,
		       strerror(p->code));
}

/* Start the writer thread; without one (no memory, no thread) the builder writes. */
static void pipe_start(struct wr *w)
{
	struct wr_pipe *p = calloc(1, sizeof(*p));
	sigset_t all, old;
	bool started;

	if (!p)
		return;
	for (int k = 0; k < WR_SLOTS; k++) {
		p->src_fd[k] = -1;
		p->slot[k] = malloc(WR_BUF_SIZE);
		if (!p->slot[k])
			goto fail;
	}
	p->fd = w->fd;
	p->writeback = w->opt->flags & LFS_WR_OPT_WRITEBACK;
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->cv, NULL);
	/* The thread blocks every signal, so the caller's threads get them as they would
	 * without it (a SIGINT for Python's main thread is not taken by this one). */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	started = pthread_create(&p->thread, NULL, pipe_main, p) == 0;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (!started) {
		pthread_mutex_destroy(&p->mu);
		pthread_cond_destroy(&p->cv);
		goto fail;
	}
	w->pipe = p;
	w->buf = p->slot[0];
	return;
fail:
	for (int k = 0; k < WR_SLOTS; k++)
		free(p->slot[k]);
	free(p);
}

/* Wait for the queued slots to be written and end the thread; 0, or -1 with the
 * first write error (recorded in w->err only with `report`). */
static int pipe_finish(struct wr *w, bool report)
{
	struct wr_pipe *p = w->pipe;
	int r = 0;

	if (!p)
		return 0;
	pthread_mutex_lock(&p->mu);
	p->stop = true;
	pthread_cond_broadcast(&p->cv);
	pthread_mutex_unlock(&p->mu);
	pthread_join(p->thread, NULL);
	if (p->code)
		r = report ? pipe_error(w, p) : -1;
	pthread_mutex_destroy(&p->mu);
	pthread_cond_destroy(&p->cv);
	for (int k = 0; k < WR_SLOTS; k++)
		free(p->slot[k]);
	free(p);
	w->pipe = NULL;
	w->buf = NULL;
	return r;
}

/* Queue the builder's slot (its buffer; or a copy job when src_fd >= 0; or `len`
 * bytes at `mem`, which must live until pipe_finish) and wait for a free one, which
 * becomes the builder's buffer. */
static int pipe_push(struct wr *w, uint64_t off, uint64_t len, int src_fd, uint64_t src_off,
		     uint32_t inode, const uint8_t *mem)
{
	struct wr_pipe *p = w->pipe;
	uint32_t k = (uint32_t)(p->head % WR_SLOTS);
	int code;

	pthread_mutex_lock(&p->mu);
	p->off[k] = off;
	p->len[k] = len;
	p->src_fd[k] = src_fd;
	p->src_off[k] = src_off;
	p->inode[k] = inode;
	p->mem[k] = mem;
	p->head++;
	pthread_cond_broadcast(&p->cv);
	while (p->head - p->tail >= WR_SLOTS && !p->code)
		pthread_cond_wait(&p->cv, &p->mu);
	code = p->code;
	pthread_mutex_unlock(&p->mu);
	if (code)
		return pipe_error(w, p);
	w->buf = p->slot[p->head % WR_SLOTS];
	return 0;
}

/* Hand the filled buffer to the writer thread (or write it here) and start an empty
 * one after it. */
static int out_flush(struct wr *w)
{
	struct wr_pipe *p = w->pipe;
	uint64_t at = 0;
	int code = 0;

	if (!w->buf_len)
		return 0;
	if (p) {
		if (pipe_push(w, w->buf_off, w->buf_len, -1, 0, 0, NULL) < 0)
			return -1;
	} else {
		code = pwrite_all(w->fd, w->buf, w->buf_len, w->buf_off, &at);
		if (code)
			return lfs_error_set(w->err, code, "write image at offset %llu: %s",
					     (unsigned long long)at, strerror(code));
	}
	w->buf_off += w->buf_len;
	w->buf_len = 0;
	return 0;
}

/* Write `n` bytes of `src` (alive until pipe_finish) at `off`, not through a buffer. */
static int out_direct(struct wr *w, uint64_t off, const uint8_t *src, uint64_t n)
{
	uint64_t at = 0;
	int code;

	if (out_flush(w) < 0)
		return -1;
	if (w->pipe)
		return pipe_push(w, off, n, -1, 0, 0, src);
	code = pwrite_all(w->fd, src, n, off, &at);
	if (code)
		return lfs_error_set(w->err, code, "write image at offset %llu: %s",
				     (unsigned long long)at, strerror(code));
	return 0;
}

/* Room for `n` (<= WR_BUF_SIZE) bytes at image offset `off`; gaps stay holes. */
static uint8_t *out_reserve(struct wr *w, uint64_t off, size_t n)
{
	if (w->buf_off + w->buf_len != off || w->buf_len + n > WR_BUF_SIZE) {
		if (out_flush(w) < 0)
			return NULL;
		w->buf_off = off;
	}
	return w->buf + w->buf_len;
}

static int out_zero(struct wr *w, uint64_t off, size_t n)
{
	uint8_t *p = out_reserve(w, off, n);

	if (!p)
		return -1;
	memset(p, 0, n);
	w->buf_len += n;
	return 0;
}

static int out_bytes(struct wr *w, uint64_t off, const uint8_t *src, uint64_t n)
{
	while (n) {
		size_t piece = n > WR_BUF_SIZE ? WR_BUF_SIZE : (size_t)n;
		uint8_t *p = out_reserve(w, off, piece);

		if (!p)
			return -1;
		memcpy(p, src, piece);
		w->buf_len += piece;
		off += piece;
		src += piece;
		n -= piece;
	}
	return 0;
}

static int read_exact(struct wr *w, uint32_t i, int fd, const char *path, uint8_t *dst,
		      uint64_t len, uint64_t src_off)
{
	while (len) {
		ssize_t r = pread(fd, dst, len > (1u << 30) ? (1u << 30) : len, (off_t)src_off);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			return wr_fail(w, i, errno, "read `%s`: %s", path, strerror(errno));
		}
		if (r == 0)
			return wr_fail(w, i, EIO, "source `%s` ended early at offset %llu "
				       "(changed while building?)", path,
				       (unsigned long long)src_off);
		dst += r;
		len -= (uint64_t)r;
		src_off += (uint64_t)r;
	}
	return 0;
}

/* File bytes [off, off + len) into dst; holes of a sparse file read as zeros. */
static int read_file(struct wr *w, uint32_t i, int fd, const char *path, uint8_t *dst,
		     uint64_t off, uint64_t len)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	const struct lfs_wr_extent *ext;
	uint32_t lo = 0, hi;

	if (!(ino->flags & LFS_WR_SPARSE))
		return read_exact(w, i, fd, path, dst, len, ino->src_offset + off);
	memset(dst, 0, len);
	ext = w->in->extents + ino->extent_first;
	hi = ino->extent_count;
	while (lo < hi) {       /* first extent ending after off */
		uint32_t mid = lo + (hi - lo) / 2;

		if (ext[mid].file_off + ext[mid].len <= off)
			lo = mid + 1;
		else
			hi = mid;
	}
	for (uint32_t k = lo; k < ino->extent_count && ext[k].file_off < off + len; k++) {
		uint64_t a = ext[k].file_off > off ? ext[k].file_off : off;
		uint64_t b = ext[k].file_off + ext[k].len < off + len ? ext[k].file_off + ext[k].len
			: off + len;

		if (read_exact(w, i, fd, path, dst + (a - off), b - a,
			       ext[k].src_off + (a - ext[k].file_off)) < 0)
			return -1;
	}
	return 0;
}

/* Large contiguous ranges go kernel to kernel (no copy through our buffer); any
 * refusal (EXDEV, EINVAL on odd filesystems, ENOSYS) falls back to the buffer.
 * Returns 1 if done, 0 to fall back, -1 on error. */
static int copy_direct(struct wr *w, uint32_t i, int fd, const char *path, uint64_t at,
		       uint64_t off, uint64_t len)
{
	loff_t src = (loff_t)(w->in->inodes[i].src_offset + off), dst = (loff_t)at;

	if (w->no_cfr || len < WR_DIRECT_MIN || (w->in->inodes[i].flags & LFS_WR_SPARSE))
		return 0;
	if (out_flush(w) < 0)
		return -1;
	if (w->pipe) {  /* a copy job for the writer thread, on its own fd */
		int dfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);

		if (dfd < 0)
			return 0;
		if (pipe_push(w, at, len, dfd, (uint64_t)src, i, NULL) < 0)
			return -1;
		w->buf_off = at + len;
		return 1;
	}
	while (len) {
		ssize_t r = copy_file_range(fd, &src, w->fd, &dst, len, 0);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			if (dst == (loff_t)at && cfr_refused(errno)) {
				w->no_cfr = true;
				return 0;
			}
			return wr_fail(w, i, errno, "copy `%s` into the image: %s", path,
				       strerror(errno));
		}
		if (r == 0)
			return wr_fail(w, i, EIO, "source `%s` ended early at offset %lld "
				       "(changed while building?)", path, (long long)src);
		len -= (uint64_t)r;
	}
	w->buf_off = (uint64_t)dst;
	return 1;
}

/* Copy file bytes [off, off + len) to image offset `at`, then zero-pad to a block. */
static int copy_range(struct wr *w, uint32_t i, int fd, const char *path, uint64_t at,
		      uint64_t off, uint64_t len)
{
	uint64_t pad = (w->blksz - len % w->blksz) % w->blksz;
	int r = copy_direct(w, i, fd, path, at, off, len);

	if (r < 0)
		return -1;
	if (r > 0) {
		at += len;
		len = 0;
	}

	while (len) {
		size_t piece = len > WR_BUF_SIZE ? WR_BUF_SIZE : (size_t)len;
		uint8_t *p = out_reserve(w, at, piece);

		if (!p || read_file(w, i, fd, path, p, off, piece) < 0)
			return -1;
		w->buf_len += piece;
		at += piece;
		off += piece;
		len -= piece;
	}
	return pad ? out_zero(w, at, pad) : 0;
}

/* Call fn(w, i, chunk index, rank among stored chunks, ctx) for each stored chunk. */
static int for_each_chunk(struct wr *w, uint32_t i,
			  int (*fn)(struct wr *, uint32_t, uint64_t, uint64_t, void *), void *ctx)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	const struct lfs_wr_extent *ext = w->in->extents + ino->extent_first;
	unsigned bits = w->nodes[i].chunkbits;
	uint64_t last = UINT64_MAX, rank = 0;

	for (uint32_t k = 0; k < ino->extent_count; k++) {
		uint64_t a = ext[k].file_off >> bits;
		uint64_t b = (ext[k].file_off + ext[k].len - 1) >> bits;

		if (last != UINT64_MAX && a <= last)
			a = last + 1;
		for (; a <= b; a++)
			if (fn(w, i, a, rank++, ctx) < 0)
				return -1;
		if (last == UINT64_MAX || b > last)
			last = b;
	}
	return 0;
}

struct chunk_copy { int fd; const char *path; };

static int chunk_copy_fn(struct wr *w, uint32_t i, uint64_t chunk, uint64_t rank, void *ctx)
{
	const struct chunk_copy *cc = ctx;
	struct wr_node *n = &w->nodes[i];
	uint64_t cs = 1ull << n->chunkbits, off = chunk << n->chunkbits;
	uint64_t len = n->size - off < cs ? n->size - off : cs;

	return copy_range(w, i, cc->fd, cc->path, n->blkaddr * w->blksz + rank * cs, off, len);
}

static int chunk_map_fn(struct wr *w, uint32_t i, uint64_t chunk, uint64_t rank, void *ctx)
{
	struct wr_node *n = &w->nodes[i];
	uint32_t *map = ctx;

	map[chunk] = htole32((uint32_t)(n->blkaddr + (rank << (n->chunkbits - w->blkbits))));
	return 0;
}

/* Open a regular file's source for reading.  Sources were scanned earlier (a
 * directory walk, a tar file) and may have been replaced since: a symlink must not
 * be followed (it could point at a secret), a device or FIFO must not be read (random
 * bytes, or a read that never returns), and with LFS_WR_SRC_ID the file must still be
 * the one scanned (same device, inode, size and mtime), so a file that grew or was
 * swapped is refused rather than silently truncated or mixed. */
static int open_source(struct wr *w, uint32_t i, const char *path)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	struct stat st;
	int fd;

	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
	if (fd < 0) {
		int e = errno;

		if (e == ELOOP)
			return wr_fail(w, i, EINVAL, "source `%s` is now a symlink (changed "
				       "since it was scanned?)", path);
		return wr_fail(w, i, e, "open `%s`: %s", path, strerror(e));
	}
	if (fstat(fd, &st) < 0) {
		int e = errno;

		close(fd);
		return wr_fail(w, i, e, "fstat `%s`: %s", path, strerror(e));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return wr_fail(w, i, EINVAL, "source `%s` is not a regular file (mode 0%o; "
			       "changed since it was scanned?)", path, (unsigned)st.st_mode);
	}
	if ((ino->flags & LFS_WR_SRC_ID) &&
	    ((uint64_t)st.st_dev != ino->src_dev || (uint64_t)st.st_ino != ino->src_ino ||
	     (uint64_t)st.st_size != ino->src_size ||
	     (int64_t)st.st_mtim.tv_sec != ino->src_mtime_sec ||
	     (uint32_t)st.st_mtim.tv_nsec != ino->src_mtime_nsec)) {
		close(fd);
		return wr_fail(w, i, EINVAL, "source `%s` changed since it was scanned (now "
			       "%llu bytes, inode %llu; was %llu bytes, inode %llu)", path,
			       (unsigned long long)st.st_size, (unsigned long long)st.st_ino,
			       (unsigned long long)ino->src_size,
			       (unsigned long long)ino->src_ino);
	}
	/* O_NONBLOCK only guarded the open; regular files ignore it, but drop it.  F_SETFL
	 * changes only O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME and O_NONBLOCK, none of
	 * which the open asked for but O_NONBLOCK: 0 clears it without an F_GETFL. */
	(void)fcntl(fd, F_SETFL, 0);
	return fd;
}

static int write_file(struct wr *w, uint32_t i)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	struct wr_node *n = &w->nodes[i];
	char path[PATH_MAX + 1];
	cleanup_close int fd = -1;
	uint64_t body;

	if (!file_reads_source(ino))
		return 0;
	memcpy(path, w->in->blob + ino->str_off, ino->str_len);
	path[ino->str_len] = '\0';
	fd = open_source(w, i, path);
	if (fd < 0)
		return -1;
	if (n->layout == EROFS_INODE_CHUNK_BASED) {
		struct chunk_copy cc = { fd, path };

		return for_each_chunk(w, i, chunk_copy_fn, &cc);
	}
	body = n->size - n->inline_len;
	if (body && copy_range(w, i, fd, path, n->blkaddr * w->blksz, 0, body) < 0)
		return -1;
	if (n->inline_len)
		return read_file(w, i, fd, path, w->meta + inline_off(n), body, n->inline_len);
	return 0;
}

static int write_dir(struct wr *w, uint32_t d)
{
	struct wr_node *n = &w->nodes[d];
	uint64_t cap = (n->size + w->blksz - 1) / w->blksz * w->blksz;
	uint64_t body = n->size - n->inline_len, blk = 0;
	uint32_t k = 0;

	if (cap > w->scratch_cap) {
		uint8_t *p = realloc(w->scratch, cap);

		if (!p)
			return wr_fail(w, d, ENOMEM, "directory of %llu bytes",
				       (unsigned long long)n->size);
		w->scratch = p;
		w->scratch_cap = cap;
	}
	memset(w->scratch, 0, cap);
	/* Same packing as dir_size(): a block takes entries while they fit. */
	while (k < n->ent_count) {
		uint8_t *b = w->scratch + blk * w->blksz;
		uint32_t first = k, used = 0, nameoff;

		while (k < n->ent_count &&
		       used + sizeof(struct erofs_dirent) + w->ents[n->ent_first + k].len <= w->blksz) {
			used += sizeof(struct erofs_dirent) + w->ents[n->ent_first + k].len;
			k++;
		}
		nameoff = (k - first) * sizeof(struct erofs_dirent);
		for (uint32_t j = first; j < k; j++) {
			const struct wr_ent *e = &w->ents[n->ent_first + j];
			struct erofs_dirent de = {
				.nid = htole64(w->nodes[e->inode].nid),
				.nameoff = htole16((uint16_t)nameoff),
				.file_type = file_type(w->in->inodes[e->inode].mode),
			};

			memcpy(b + (j - first) * sizeof(de), &de, sizeof(de));
			memcpy(b + nameoff, e->name, e->len);
			nameoff += e->len;
		}
		blk++;
	}
	if (n->nblocks && out_bytes(w, n->blkaddr * w->blksz, w->scratch,
				    n->nblocks * w->blksz) < 0)
		return -1;
	if (n->inline_len)
		memcpy(w->meta + inline_off(n), w->scratch + body, n->inline_len);
	return 0;
}

static int write_symlink(struct wr *w, uint32_t i)
{
	const struct lfs_wr_inode *ino = &w->in->inodes[i];
	struct wr_node *n = &w->nodes[i];
	const uint8_t *target = w->in->blob + ino->str_off;

	if (n->inline_len) {
		memcpy(w->meta + inline_off(n), target, n->size);
		return 0;
	}
	if (out_bytes(w, n->blkaddr * w->blksz, target, n->size) < 0)
		return -1;
	return out_zero(w, n->blkaddr * w->blksz + n->size, n->nblocks * w->blksz - n->size);
}

static int write_data(struct wr *w)
{
	const struct lfs_wr_input *in = w->in;

	/* Pass 0 follows the block order of small data; pass 1 the big files. */
	for (int pass = 0; pass < 2; pass++) {
		for (uint32_t o = 0; o < in->ninodes; o++) {
			uint32_t i = w->order[o];
			uint32_t type = in->inodes[i].mode & S_IFMT;
			int r = 0;

			if (w->nodes[i].big != pass)
				continue;
			if (type == S_IFREG)
				r = write_file(w, i);
			else if (type == S_IFDIR)
				r = write_dir(w, i);
			else if (type == S_IFLNK)
				r = write_symlink(w, i);
			if (r < 0)
				return -1;
		}
	}
	return out_flush(w);
}

static void encode_inodes(struct wr *w)
{
	const struct lfs_wr_input *in = w->in;

	for (uint32_t o = 0; o < in->ninodes; o++) {
		uint32_t i = w->order[o];
		const struct lfs_wr_inode *ino = &in->inodes[i];
		struct wr_node *n = &w->nodes[i];
		uint8_t *p = w->meta + n->meta_off;
		uint32_t type = ino->mode & S_IFMT, iu = 0;
		uint16_t icount = n->xattr_isize ? (uint16_t)((n->xattr_isize - 12) / 4 + 1) : 0;
		uint16_t fmt = (uint16_t)((n->extended ? EROFS_INODE_LAYOUT_EXTENDED
					    : EROFS_INODE_LAYOUT_COMPACT) |
					   (n->layout << EROFS_I_DATALAYOUT_BIT));

		if (n->layout == EROFS_INODE_CHUNK_BASED)
			iu = (uint32_t)(n->chunkbits - w->blkbits);
		else if (type == S_IFCHR || type == S_IFBLK)
			/* new_encode_dev(), include/linux/kdev_t.h */
			iu = (ino->rdev_minor & 0xff) | (ino->rdev_major << 8) |
			     ((ino->rdev_minor & ~0xffu) << 12);
		else if (type == S_IFREG || type == S_IFDIR || type == S_IFLNK)
			iu = n->nblocks ? (uint32_t)n->blkaddr : EROFS_NULL_ADDR;

		if (n->extended) {
			struct erofs_inode_extended d = {
				.i_format = htole16(fmt),
				.i_xattr_icount = htole16(icount),
				.i_mode = htole16((uint16_t)ino->mode),
				.i_size = htole64(n->size),
				.i_u = htole32(iu),
				.i_ino = htole32(o + 1),
				.i_uid = htole32(ino->uid),
				.i_gid = htole32(ino->gid),
				.i_mtime = htole64((uint64_t)n->mtime_sec),
				.i_mtime_nsec = htole32(n->mtime_nsec),
				.i_nlink = htole32(n->nlink),
			};
			memcpy(p, &d, sizeof(d));
			p += sizeof(d);
		} else {
			struct erofs_inode_compact d = {
				.i_format = htole16(fmt),
				.i_xattr_icount = htole16(icount),
				.i_mode = htole16((uint16_t)ino->mode),
				.i_nlink = htole16((uint16_t)n->nlink),
				.i_size = htole32((uint32_t)n->size),
				.i_u = htole32(iu),
				.i_ino = htole32(o + 1),
				.i_uid = htole16((uint16_t)ino->uid),
				.i_gid = htole16((uint16_t)ino->gid),
			};
			memcpy(p, &d, sizeof(d));
			p += sizeof(d);
		}
		if (n->xattr_isize) {
			p += sizeof(struct erofs_xattr_ibody_header); /* all zero: no filter, no shared */
			for (uint32_t k = 0; k < ino->xattr_count; k++) {
				const struct lfs_wr_xattr *x = &in->xattrs[w->xorder[ino->xattr_first + k]];
				const uint8_t *name = in->blob + x->name_off;
				uint32_t soff = 0;
				int idx = xattr_split(name, x->name_len, &soff);
				struct erofs_xattr_entry e = {
					.e_name_len = (uint8_t)(x->name_len - soff),
					.e_name_index = (uint8_t)idx,
					.e_value_size = htole16((uint16_t)x->value_len),
				};
				uint32_t len = sizeof(e) + e.e_name_len + x->value_len;

				memcpy(p, &e, sizeof(e));
				memcpy(p + sizeof(e), name + soff, e.e_name_len);
				memcpy(p + sizeof(e) + e.e_name_len, in->blob + x->value_off,
				       x->value_len);
				p += (len + EROFS_XATTR_ALIGN - 1) & ~(uint32_t)(EROFS_XATTR_ALIGN - 1);
			}
		}
		if (n->layout == EROFS_INODE_CHUNK_BASED) {
			uint32_t *map = (uint32_t *)(void *)p;

			for (uint64_t c = 0; c < n->nchunks; c++)
				map[c] = htole32(EROFS_NULL_ADDR);
			for_each_chunk(w, i, chunk_map_fn, map);
		}
	}
}

/* splitmix64's finalizer: every input bit reaches every output bit. */
static uint64_t mix64(uint64_t x)
{
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* A deterministic uuid that differs between layers: a hash of the metadata (inodes
 * and inline data: all but the data blocks), 8 bytes at a time in four independent
 * lanes.  (FNV-1a byte by byte took 35 ms of the 20 MB of a Debian rootfs's.) */
static void derive_uuid(const struct wr *w, uint8_t uuid[16])
{
	uint64_t lane[4] = { 0xcbf29ce484222325ull, 0x84222325cbf29ce4ull,
			     0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full };
	uint64_t len = w->data_start * w->blksz, h[2];   /* whole blocks: 32-byte steps */

	for (uint64_t j = 0; j < len; j += 32) {
		for (int k = 0; k < 4; k++) {
			uint64_t v;

			memcpy(&v, w->meta + j + 8 * k, 8);
			lane[k] = (lane[k] ^ le64toh(v)) * 0x100000001b3ull;
			lane[k] ^= lane[k] >> 29;
		}
	}
	h[0] = mix64(lane[0] ^ mix64(lane[1] + w->total_blocks));
	h[1] = mix64(lane[2] ^ mix64(lane[3] + len));
	for (int k = 0; k < 2; k++) {
		h[k] = htole64(h[k]);
		memcpy(uuid + 8 * k, &h[k], 8);
	}
	uuid[6] = (uint8_t)((uuid[6] & 0x0f) | 0x80);  /* RFC 9562 version 8 */
	uuid[8] = (uint8_t)((uuid[8] & 0x3f) | 0x80);  /* variant 10 */
}

static void encode_super(struct wr *w, struct lfs_wr_stats *stats)
{
	struct erofs_super_block sb = {
		.magic = htole32(EROFS_SUPER_MAGIC_V1),
		.feature_compat = htole32(EROFS_FEATURE_COMPAT_SB_CHKSUM |
					  EROFS_FEATURE_COMPAT_MTIME),
		.blkszbits = (uint8_t)w->blkbits,
		.root_nid = htole16((uint16_t)w->nodes[0].nid),
		.inos = htole64(w->in->ninodes),
		.epoch = htole64((uint64_t)w->epoch_sec),
		.fixed_nsec = htole32(w->epoch_nsec),
		.blocks = htole32((uint32_t)w->total_blocks),
		.feature_incompat = htole32(w->chunked ? EROFS_FEATURE_INCOMPAT_CHUNKED_FILE : 0),
	};
	uint32_t crc;

	memcpy(sb.volume_name, w->opt->volume_name, 15);
	if (w->opt->flags & LFS_WR_OPT_UUID)
		memcpy(sb.uuid, w->opt->uuid, 16);
	memcpy(w->meta + EROFS_SUPER_OFFSET, &sb, sizeof(sb));
	if (!(w->opt->flags & LFS_WR_OPT_UUID)) {
		derive_uuid(w, sb.uuid);
		memcpy(w->meta + EROFS_SUPER_OFFSET, &sb, sizeof(sb));
	}
	/* erofs_superblock_csum_verify(): crc32c(~0) of the sb block from byte 1024 */
	crc = lfs_crc32c(~0u, w->meta + EROFS_SUPER_OFFSET, w->blksz - EROFS_SUPER_OFFSET);
	sb.checksum = htole32(crc);
	memcpy(w->meta + EROFS_SUPER_OFFSET, &sb, sizeof(sb));
	memcpy(stats->uuid, sb.uuid, 16);
}

/* Zeroed memory for the metadata, tens of MB for a rootfs (inline tails are most of
 * it): in huge pages where the kernel has them (THP "madvise" mode), so that the preads
 * of inline tails into it do not fault 4 KiB at a time (5,000 faults for a Debian
 * rootfs, 2% of the build). */
static uint8_t *meta_alloc(uint64_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	(void)madvise(p, len, MADV_HUGEPAGE);   /* a hint; EINVAL without THP */
	return p;
}

static int write_all(struct wr *w, struct lfs_wr_stats *stats)
{
	const struct lfs_wr_input *in = w->in;
	struct stat st;
	uint64_t meta_len;

	if (fstat(w->fd, &st) < 0)
		return lfs_error_set(w->err, errno, "fstat output: %s", strerror(errno));
	if (!S_ISREG(st.st_mode))
		return lfs_error_set(w->err, ESPIPE, "output is not a regular file");
	w->nodes = calloc(in->ninodes ? in->ninodes : 1, sizeof(*w->nodes));
	w->order = calloc(in->ninodes ? in->ninodes : 1, sizeof(*w->order));
	w->xorder = calloc(in->nxattrs ? in->nxattrs : 1, sizeof(*w->xorder));
	w->own_buf = w->buf = malloc(WR_BUF_SIZE);
	if (!w->nodes || !w->order || !w->xorder || !w->buf)
		return lfs_error_set(w->err, ENOMEM, "writer state");
	if (prepare_tree(w) < 0 || choose_epoch(w) < 0 || layout(w) < 0)
		return -1;
	meta_len = w->data_start * w->blksz;
	w->meta = meta_alloc(meta_len);
	w->meta_len = meta_len;
	if (!w->meta)
		return lfs_error_set(w->err, ENOMEM, "metadata of %llu bytes",
				     (unsigned long long)meta_len);
	/* Truncate only an output that holds bytes.  ext4 takes a truncate to size 0, even
	 * of an empty file, as a file being replaced (auto_da_alloc, ext4_truncate()) and
	 * starts the writeback of all of it at close (ext4_release_file()): ~100 ms of a
	 * rootfs build's wall time spent submitting I/O that nobody asked for. */
	if (st.st_size && ftruncate(w->fd, 0) < 0)
		return lfs_error_set(w->err, errno, "truncate output: %s", strerror(errno));
	w->buf_off = meta_len;
	if (!(w->opt->flags & LFS_WR_OPT_ONE_THREAD))
		pipe_start(w);
	if (write_data(w) < 0)
		return -1;
	encode_inodes(w);
	encode_super(w, stats);
	if (out_direct(w, 0, w->meta, meta_len) < 0 || out_flush(w) < 0 ||
	    pipe_finish(w, true) < 0)
		return -1;
	if (ftruncate(w->fd, (off_t)(w->total_blocks * w->blksz)) < 0)
		return lfs_error_set(w->err, errno, "size output: %s", strerror(errno));

	stats->size = w->total_blocks * w->blksz;
	stats->blocks = w->total_blocks;
	stats->inodes = in->ninodes;
	stats->meta_bytes = meta_len;
	stats->epoch_sec = w->epoch_sec;
	for (uint32_t i = 0; i < in->ninodes; i++) {
		if ((in->inodes[i].mode & S_IFMT) == S_IFREG) {
			stats->files++;
			stats->data_bytes += in->inodes[i].size;
		}
	}
	return 0;
}

int lfs_writer_write(const struct lfs_wr_input *in, const struct lfs_wr_options *opts,
		     int fd, struct lfs_wr_stats *stats, struct lfs_error *err)
{
	struct wr w = { .in = in, .opt = opts, .err = err, .fd = fd };
	int r;

	memset(stats, 0, sizeof(*stats));
	if (opts->block_size != 4096)
		return lfs_error_set(err, EINVAL, "block size %u: only 4096 is supported",
				     opts->block_size);
	if (opts->chunk_align && (opts->chunk_align < opts->block_size ||
				  (opts->chunk_align & (opts->chunk_align - 1))))
		return lfs_error_set(err, EINVAL, "chunk_align %llu: not a power of two >= "
				     "the block size", (unsigned long long)opts->chunk_align);
	if ((opts->flags & LFS_WR_OPT_EPOCH) &&
	    (opts->epoch_sec < 0 || opts->epoch_nsec >= 1000000000u))
		return lfs_error_set(err, EINVAL, "epoch out of range");
	w.blksz = opts->block_size;
	w.blkbits = 12;
	r = write_all(&w, stats);
	if (w.pipe)
		pipe_finish(&w, false); /* after an error: stop the thread, keep that error */
	free(w.nodes);
	free(w.ents);
	free(w.order);
	free(w.xorder);
	free(w.own_buf);
	if (w.meta)
		munmap(w.meta, w.meta_len);
	free(w.scratch);
	return r;
}
