#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "lfs_error.h"

int lfs_error_set(struct lfs_error *err, int code, const char *fmt, ...)
{
	va_list ap;

	if (!err)
		return -1;
	err->code = code ? code : EIO; /* a failure always carries an errno value */
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return -1;
}

int lfs_error_prefix(struct lfs_error *err, const char *fmt, ...)
{
	char prefix[LFS_ERROR_MSG_MAX];
	char old[LFS_ERROR_MSG_MAX];
	va_list ap;

	if (!err)
		return -1;
	va_start(ap, fmt);
	vsnprintf(prefix, sizeof(prefix), fmt, ap);
	va_end(ap);
	memcpy(old, err->msg, sizeof(old));
	snprintf(err->msg, sizeof(err->msg), "%s: %s", prefix, old);
	return -1;
}
