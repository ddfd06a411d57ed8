/* Per-exec cgroups, so that a timeout or a kill takes an exec's whole tree,
 * daemonized grandchildren included.  They are made under the sandbox's cgroups
 * (delegated to the sandbox's root, passed to sbx-init as directory fds) by one
 * of two implementations, cgroup-v1.c or cgroup-v2.c; without either, execs get
 * none and a tree is killed by its session (exec.c).
 *
 * They hold no memory controller: memory is the sandbox's one memory cgroup.
 * Every memory cgroup costs the host shrinker tables sized by the number of
 * superblocks on it (1 KiB per 64, per NUMA node: mm/shrinker.c), and both
 * grow with the number of sandboxes, so a memory cgroup per exec, and one for
 * the spare made ahead of the next exec, made the kernel's cost per sandbox
 * grow with N.  An exec's OOM kills are the sandbox's counted while it ran;
 * its peak memory is its main process's peak RSS (wait4). */
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lfs_cleanup.h"
#include "sbx-init.h"

/* Pick the implementation from the directories given at start-up. */
void cg_init(struct sbx_cg *cg)
{
	cg->mode = SBX_CGROUP_NONE;
	cg->ops = NULL;
	if (cg->v2 >= 0) {
		cg->mode = SBX_CGROUP_V2;
		cg->ops = &cg_v2_ops;
	} else if (cg->freezer >= 0) {
		cg->mode = SBX_CGROUP_V1;
		cg->ops = &cg_v1_ops;
	}
}

/* Make the next exec's cgroup: its name in name[] ("" if none) and in join[]
 * the fds of the files the child writes "0" into to join it (or -1).  A
 * failure is logged and leaves the exec without one. */
void cg_make(struct sbx_cg *cg, char name[CG_NAME_MAX], int join[2])
{
	const char *what = "mkdir";
	int saved;

	join[0] = join[1] = -1;
	name[0] = 0;
	if (!cg->ops)
		return;
	snprintf(name, CG_NAME_MAX, "e%llu", (unsigned long long)++cg->counter);
	if (cg->ops->make(cg, name, join, &what) == 0)
		return;
	saved = errno;
	logmsg("sbx-init: cgroup %s: %s: %s (tree kill falls back to the session sweep)", name,
	       what, strerror(saved));
	for (int i = 0; i < 2; i++)
		if (join[i] >= 0)
			close(join[i]);
	join[0] = join[1] = -1;
	cg->ops->remove(cg, name);
	name[0] = 0;
}

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

/* fork() for an exec's child (or the spare) whose cgroup cg_make made as
 * `name`: on v2 the child is cloned straight into it (clone3 with
 * CLONE_INTO_CGROUP, Linux 5.7), so it has nothing to join (its join[] are
 * closed and set to -1 in the child) and no cgroup move is made at all: a
 * move write-locks the kernel's cgroup_threadgroup_rwsem, which waits for an
 * RCU grace period when none passed lately (v1's single-threaded move through
 * "tasks" skips that lock; v2 has no such path).  Where clone3 or the flag is
 * refused (ENOSYS, EINVAL, E2BIG: an older kernel or a seccomp filter; ENOENT
 * on 6.1 beneath a cgroup namespace), it says so once and forks, the child
 * joining by writing join[] as on v1; EAGAIN and ENOMEM are fork's own.  The
 * child of a raw clone3 must not use libc's cached thread id (raise, pthread):
 * it sets up and execs, as a forked child does. */
pid_t cg_fork(struct sbx_cg *cg, const char *name, int join[2])
{
	if (cg->mode == SBX_CGROUP_V2 && name[0] && cg->clone_into >= 0) {
		int dfd = openat(cg->v2, name, O_PATH | O_DIRECTORY | O_CLOEXEC);

		if (dfd >= 0) {
			struct clone_args args;
			long pid;
			int saved;

			memset(&args, 0, sizeof(args));
			args.flags = CLONE_INTO_CGROUP;
			args.exit_signal = SIGCHLD;
			args.cgroup = (uint64_t)dfd;
			pid = syscall(SYS_clone3, &args, sizeof(args));
			saved = errno;
			close(dfd);
			if (pid == 0) {
				for (int i = 0; i < 2; i++)
					if (join[i] >= 0) {
						close(join[i]);
						join[i] = -1;
					}
				return 0;
			}
			if (pid > 0) {
				if (!cg->clone_into)
					logmsg("sbx-init: execs are cloned into their cgroups "
					       "(CLONE_INTO_CGROUP)");
				cg->clone_into = 1;
				return (pid_t)pid;
			}
			if (saved == EAGAIN || saved == ENOMEM) {
				errno = saved; /* at the pids limit, out of memory: as fork's */
				return -1;
			}
			logmsg("sbx-init: clone3 into a cgroup refused (%s): execs join theirs",
			       strerror(saved));
			cg->clone_into = -1;
		}
	}
	return fork();
}

/* An exec's cgroup may still hold background processes when the exec ends;
 * remove it once they are gone (cg_retry_pending, after each reap). */
void cg_release(struct sbx_cg *cg, char name[CG_NAME_MAX])
{
	if (!name[0])
		return;
	if (cg->ops->remove(cg, name) < 0 && cg->n_pending_rm < MAX_PENDING_RM)
		memcpy(cg->pending_rm[cg->n_pending_rm++], name, CG_NAME_MAX);
	name[0] = 0;
}

void cg_retry_pending(struct sbx_cg *cg)
{
	int i = 0;

	while (i < cg->n_pending_rm) {
		if (cg->ops->remove(cg, cg->pending_rm[i]) == 0) {
			memcpy(cg->pending_rm[i], cg->pending_rm[--cg->n_pending_rm], CG_NAME_MAX);
			continue;
		}
		i++;
	}
}

/* Kill every process of cgroup `name`; -1 if there is none or it failed. */
int cg_kill(struct sbx_cg *cg, const char *name)
{
	if (!name[0] || !cg->ops)
		return -1;
	return cg->ops->kill(cg, name);
}

uint64_t cg_oom_kills(struct sbx_cg *cg)
{
	return cg->ops ? cg->ops->oom_kills(cg) : 0;
}

/* ---- files of a cgroup, relative to a hierarchy's directory fd ---------- */

int cg_write(int dirfd, const char *cg, const char *file, const char *val)
{
	char path[64];
	cleanup_close int fd = -1;

	snprintf(path, sizeof(path), "%s/%s", cg, file);
	fd = openat(dirfd, path, O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, val, strlen(val)) < 0)
		return -1;
	return 0;
}

ssize_t cg_read(int dirfd, const char *cg, const char *file, char *out, size_t size)
{
	char path[64];
	cleanup_close int fd = -1;
	ssize_t n;

	snprintf(path, sizeof(path), "%s/%s", cg, file);
	fd = openat(dirfd, path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, out, size - 1);
	if (n < 0)
		return -1;
	out[n] = 0;
	return n;
}

/* Value of "key N" in a flat-keyed cgroup file, or 0. */
uint64_t cg_key(int dirfd, const char *cg, const char *file, const char *key)
{
	char text[1024], *p;
	size_t klen = strlen(key);

	if (cg_read(dirfd, cg, file, text, sizeof(text)) < 0)
		return 0;
	for (p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
		if (!strncmp(p, key, klen) && p[klen] == ' ')
			return strtoull(p + klen + 1, NULL, 10);
	return 0;
}
