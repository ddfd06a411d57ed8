/* Resources that clean themselves up, for every C file of the project (the C
 * core, the spawner, sbx-init).
 *
 *   cleanup_free char *p = malloc(n);     freed when p goes out of scope
 *   cleanup_close int fd = open(...);     closed when fd goes out of scope (if >= 0)
 *   return steal_fd(&fd);                 hand the fd on: the cleanup then closes nothing
 *   return steal_pointer(&p);             the same for a pointer
 *
 * After crun's and bubblewrap's helpers of the same names.  The cleanups keep
 * errno: a failure path can clean up and still report the call's errno.
 */
#ifndef LFS_CLEANUP_H
#define LFS_CLEANUP_H

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

static inline void lfs_freep(void *p)
{
	int saved = errno;

	free(*(void **)p);
	errno = saved;
}

static inline void lfs_closep(int *fd)
{
	int saved = errno;

	if (*fd >= 0)
		close(*fd);
	errno = saved;
}

#define cleanup_free __attribute__((cleanup(lfs_freep)))
#define cleanup_close __attribute__((cleanup(lfs_closep)))

/* The fd, leaving -1 behind. */
static inline int steal_fd(int *fd)
{
	int v = *fd;

	*fd = -1;
	return v;
}

/* The pointer, leaving NULL behind. */
static inline void *lfs_steal_pointer(void *pp)
{
	void **p = (void **)pp;
	void *v = *p;

	*p = NULL;
	return v;
}
#define steal_pointer(pp) lfs_steal_pointer(pp)

#endif
