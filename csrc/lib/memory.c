#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "lfs_memory.h"

#ifndef SYS_process_madvise
#define SYS_process_madvise 440
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#define BATCH 1024 /* UIO_MAXIOV */

static int wanted(const char *perms, unsigned long inode, const char *path)
{
	if (path[0] == '[' && path[1] == 'v') /* [vsyscall] [vvar] [vvar_vclock] [vdso] */
		return 0;
	if (perms[3] != 'p') /* shared: page cache or shmem someone else maps too */
		return 0;
	return inode == 0 || perms[1] == 'w';
}

/* Advise iov[0..n); ranges the kernel refuses are skipped one by one. */
static int advise_batch(int pidfd, struct iovec *iov, size_t n, int advice,
			struct lfs_advise_stats *st, struct lfs_error *err)
{
	size_t i = 0;

	while (i < n) {
		long r = syscall(SYS_process_madvise, pidfd, &iov[i], n - i, advice, 0);
		size_t done;

		if (r < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			if (errno == ESRCH)
				return 1; /* gone */
			if (errno == EINVAL || errno == ENOMEM || errno == EFAULT) {
				/* the first range is one the kernel will not take, or was
				 * unmapped since the maps were read */
				st->skipped++;
				i++;
				continue;
			}
			return lfs_error_set(err, errno, "process_madvise(%d): %s", advice,
					     strerror(errno));
		}
		st->bytes += (uint64_t)r;
		done = (size_t)r;
		/* a short count stops inside the range the kernel refused next */
		while (i < n && done >= iov[i].iov_len) {
			done -= iov[i].iov_len;
			st->ranges++;
			i++;
		}
		if (i < n) {
			st->skipped++;
			i++;
		}
	}
	return 0;
}

int lfs_process_advise(int pidfd, int pid, int advice, struct lfs_advise_stats *st,
		       struct lfs_error *err)
{
	static __thread struct iovec iov[BATCH];
	char path[64], line[4096 + 256];
	size_t n = 0;
	FILE *f;
	int rc = 0;

	memset(st, 0, sizeof(*st));
	if (advice != LFS_MADV_PAGEOUT && advice != LFS_MADV_COLD && advice != LFS_MADV_WILLNEED)
		return lfs_error_set(err, EINVAL, "advice %d: not PAGEOUT, COLD or WILLNEED", advice);
	snprintf(path, sizeof(path), "/proc/%d/maps", pid);
	f = fopen(path, "re");
	if (!f) {
		if (errno == ENOENT || errno == ESRCH)
			return 0;
		return lfs_error_set(err, errno, "open `%s`: %s", path, strerror(errno));
	}
	/* A pid reused between the pidfd and this open would show another
	 * process's maps, so before each batch is advised the pidfd's process must
	 * still be alive, after the lines of the batch were read (a pid is not
	 * reused before its process is reaped). */
	while (fgets(line, sizeof(line), f)) {
		unsigned long start, end, inode;
		char perms[8] = "", name[4096] = "";
		int len = 0;

		if (sscanf(line, "%lx-%lx %7s %*s %*s %lu %n", &start, &end, perms, &inode, &len) < 4)
			continue;
		sscanf(line + len, "%4095s", name);
		if (strlen(perms) < 4 || !wanted(perms, inode, name))
			continue;
		if (n == BATCH) {
			if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) < 0)
				goto out; /* gone: nothing to advise */
			rc = advise_batch(pidfd, iov, n, advice, st, err);
			if (rc != 0)
				goto out;
			n = 0;
		}
		iov[n].iov_base = (void *)start;
		iov[n].iov_len = end - start;
		n++;
	}
	if (n && syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) == 0)
		rc = advise_batch(pidfd, iov, n, advice, st, err);
out:
	fclose(f);
	return rc < 0 ? -1 : 0;
}
