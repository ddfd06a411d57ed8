/* Error reporting shared by every module of the C core.
 *
 * A fallible function takes `struct lfs_error *err` last and returns 0 (or a
 * non-negative result) on success and -1 on failure, with err->code set to an
 * errno value and err->msg to a human message.  Callers add context on the way
 * up with lfs_error_prefix().  The Python side turns this into an exception in
 * one place (layerfs/native.py).
 */
#ifndef LFS_ERROR_H
#define LFS_ERROR_H

#include <stddef.h>

#define LFS_ERROR_MSG_MAX 512

struct lfs_error {
	int code;                    /* errno value, 0 when no error */
	char msg[LFS_ERROR_MSG_MAX]; /* NUL-terminated human message */
};

/* Record an error (errno value `code`, EIO when 0; printf-style message); returns -1. */
int lfs_error_set(struct lfs_error *err, int code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Prepend "context: " to an already recorded message; returns -1. */
int lfs_error_prefix(struct lfs_error *err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#endif
