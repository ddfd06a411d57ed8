/* The directory scanner: a host directory tree read straight into the writer's
 * input (struct lfs_wr_input, lfs_writer.h), so that building a layer from a
 * directory makes no per-entry objects in Python.
 *
 * What it keeps, per entry (lstat(2), never following a symlink): the full st_mode,
 * owner, mtime in ns, every xattr byte-exact (llistxattr/lgetxattr), device numbers,
 * symlink targets, hardlinks (same st_dev/st_ino, not a directory: one inode), the
 * data extents of files with holes (lseek SEEK_DATA/SEEK_HOLE) and, for every
 * regular file, its path and identity (LFS_WR_SRC_ID: the writer refuses a file
 * that changed between the scan and the write).  File bytes are not read.
 *
 * Directories are read breadth-first by two threads (one without a second core),
 * each directory's names sorted (memcmp).  The order of the input depends on which
 * thread read what, the image written from it does not: the writer sorts names and
 * numbers inodes itself.  (A hardlinked file's source path is the name a thread
 * reached first: the same file either way.)  A directory is opened by its path with
 * O_NOFOLLOW and checked to be the one its parent listed (st_dev/st_ino), so a
 * directory swapped for a symlink or for another directory during the scan is an
 * error, not a walk elsewhere.
 */
#ifndef LFS_SCAN_H
#define LFS_SCAN_H

#include <stdint.h>

#include "lfs_error.h"
#include "lfs_writer.h"

struct lfs_scan;

/* Scan the directory `path` (not a symlink to one).  Returns 0 and *out (free it
 * with lfs_scan_free), or -1 with err: ENOTDIR for a root that is no directory,
 * EINVAL for an entry that changed during the scan or cannot be kept (the message
 * names it), another errno for I/O errors (the message names the path and call). */
int lfs_scan_dir(const char *path, struct lfs_scan **out, struct lfs_error *err);

/* The writer input of a scan: valid until lfs_scan_free(). */
const struct lfs_wr_input *lfs_scan_input(const struct lfs_scan *scan);

void lfs_scan_free(struct lfs_scan *scan);

#endif
