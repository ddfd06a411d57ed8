/* The EROFS layer writer: a flattened tree in, a deterministic image out.
 *
 * The caller (layerfs/writer.py) flattens a layerfs.tree.Tree into four arrays
 * plus one byte blob holding every name, symlink target, xattr name/value and
 * source path.  Inode 0 is the root.  A directory's children are the dirents
 * [dirent_first, dirent_first + dirent_count); a hardlink is two dirents naming
 * the same inode index.  The writer validates everything, sorts, lays out the
 * whole image, then streams file data from the sources (memory does not grow
 * with file size).  See csrc/include/erofs_fs.h for the format.
 */
#ifndef LFS_WRITER_H
#define LFS_WRITER_H

#include <stddef.h>
#include <stdint.h>

#include "lfs_error.h"

#define LFS_WR_SPARSE 0x1u  /* regular file: data placed by extents, rest holes (no
			     * extents: all hole, and no source is read) */
#define LFS_WR_SRC_ID 0x2u  /* regular file: the source must still be the file scanned
			     * (src_dev/src_ino/src_size/src_mtime_*), else refused */

/* Largest regular file size (bytes) the writer accepts: 2^62.  The kernel derives
 * i_blocks as round_up(i_size, block size) >> 9 in a signed loff_t
 * (fs/erofs/inode.c), which wraps negative for sizes within a block of 2^63. */
#define LFS_WR_MAX_FILE_SIZE (1ull << 62)
/* Largest metadata area (superblock, inodes, inline data, chunk maps) in bytes: it
 * is held in memory while the image is written. */
#define LFS_WR_MAX_META (1ull << 30)
/* A sparse file's best layout (chunk map plus the chunks that hold data, each
 * stored whole: EROFS has no partial chunks) may cost at most this many times its
 * real data bytes plus LFS_WR_SPARSE_SLACK; tiny extents far apart are refused. */
#define LFS_WR_SPARSE_FACTOR 4
#define LFS_WR_SPARSE_SLACK (64ull << 20)

struct lfs_wr_inode {
	int64_t  mtime_sec;     /* seconds since the Unix epoch, may be negative */
	uint64_t size;          /* regular file bytes; symlink: ignored (str_len) */
	uint64_t src_offset;    /* regular file, not sparse: offset of byte 0 in source */
	uint64_t str_off;       /* blob offset: symlink target, or regular file source path */
	uint32_t str_len;
	uint32_t mode;          /* full st_mode */
	uint32_t uid;
	uint32_t gid;
	uint32_t mtime_nsec;    /* 0..999999999 */
	uint32_t rdev_major;    /* char/block devices; <= 4095 */
	uint32_t rdev_minor;    /* <= 0xFFFFF */
	uint32_t flags;         /* LFS_WR_* */
	uint32_t dirent_first;  /* directories: children */
	uint32_t dirent_count;
	uint32_t xattr_first;
	uint32_t xattr_count;
	uint32_t extent_first;  /* LFS_WR_SPARSE: extents */
	uint32_t extent_count;
	uint32_t parent;        /* for messages: a directory holding it (root: 0) */
	uint32_t name_dirent;   /* for messages: a dirent naming it (root: UINT32_MAX) */
	uint64_t src_dev;       /* LFS_WR_SRC_ID: st_dev of the source file as scanned */
	uint64_t src_ino;       /* st_ino */
	uint64_t src_size;      /* st_size (of the source file, e.g. the whole tar) */
	int64_t  src_mtime_sec; /* st_mtim */
	uint32_t src_mtime_nsec;
	uint32_t reserved;      /* 0 */
};

struct lfs_wr_dirent {
	uint64_t name_off;      /* blob offset of the name */
	uint32_t name_len;      /* 1..255, no '/' or NUL, not "." or ".." */
	uint32_t inode;         /* index into the inode array */
};

struct lfs_wr_xattr {
	uint64_t name_off;      /* blob offset of the full name ("security.capability") */
	uint64_t value_off;
	uint32_t name_len;
	uint32_t value_len;     /* <= 65535 */
};

struct lfs_wr_extent {
	uint64_t file_off;      /* where the bytes go in the file */
	uint64_t len;           /* > 0; extents sorted, not overlapping, inside size */
	uint64_t src_off;       /* where they are in the source file */
};

struct lfs_wr_input {
	const struct lfs_wr_inode *inodes;
	const struct lfs_wr_dirent *dirents;
	const struct lfs_wr_xattr *xattrs;
	const struct lfs_wr_extent *extents;
	const uint8_t *blob;
	uint64_t blob_len;
	uint32_t ninodes;
	uint32_t ndirents;
	uint32_t nxattrs;
	uint32_t nextents;
};

#define LFS_WR_OPT_EPOCH 0x1u   /* epoch_sec/epoch_nsec given; else most common mtime */
#define LFS_WR_OPT_CLAMP 0x2u   /* mtimes later than clamp_* are clamped to it */
#define LFS_WR_OPT_UUID  0x4u   /* uuid given; else derived from the metadata bytes */
#define LFS_WR_OPT_WRITEBACK 0x8u /* start writeback as the image is written (the
				   * caller will fsync it: less is left to wait for) */
#define LFS_WR_OPT_ONE_THREAD 0x10u /* no writer thread: pwrite() in the caller's */

struct lfs_wr_options {
	uint64_t chunk_align;   /* bytes, power of two >= block size, or 0: files at least
				 * this big start at an image offset multiple of it */
	int64_t  epoch_sec;
	int64_t  clamp_sec;
	uint32_t epoch_nsec;
	uint32_t clamp_nsec;
	uint32_t block_size;    /* 4096 */
	uint32_t flags;         /* LFS_WR_OPT_* */
	uint8_t  uuid[16];
	uint8_t  volume_name[16]; /* NUL-padded, at most 15 bytes used */
};

struct lfs_wr_stats {
	uint64_t size;          /* image bytes */
	uint64_t inodes;
	uint64_t files;         /* regular files */
	uint64_t data_bytes;    /* sum of regular file sizes */
	uint64_t meta_bytes;    /* superblock + inodes + inline data, block-rounded */
	uint64_t blocks;
	int64_t  epoch_sec;     /* the epoch chosen */
	uint8_t  uuid[16];      /* the uuid written */
};

/* Write the image for `in` to `fd` (a seekable file, truncated; written from offset
 * 0).  Returns 0, or -1 with EINVAL for refused input (message names the entry) or
 * another errno for I/O errors (message names the file). */
int lfs_writer_write(const struct lfs_wr_input *in, const struct lfs_wr_options *opts,
		     int fd, struct lfs_wr_stats *stats, struct lfs_error *err);

/* crc32c (Castagnoli) without pre/post inversion: the kernel's crc32c(seed, ...). */
uint32_t lfs_crc32c(uint32_t seed, const void *data, size_t len);

#endif
