/* Per-exec cgroups on a v1 hierarchy: a freezer cgroup, to stop a tree while
 * it is killed (freezer cgroups are cheap: no per-cgroup shrinker tables).
 * OOM kills are read from the sandbox's memory cgroup. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sbx-init.h"

static int v1_make(struct sbx_cg *cg, const char *name, int join[2], const char **what)
{
	char path[64];

	if (mkdirat(cg->freezer, name, 0755) < 0) {
		*what = "mkdir in the freezer hierarchy";
		return -1;
	}
	/* "tasks", not "cgroup.procs": the child is single-threaded and moves
	 * itself ("0"), which the kernel does without write-locking the global
	 * cgroup_threadgroup_rwsem, i.e. without waiting for an RCU grace period
	 * (milliseconds when no move happened lately). */
	snprintf(path, sizeof(path), "%s/tasks", name);
	join[0] = openat(cg->freezer, path, O_WRONLY | O_CLOEXEC);
	if (join[0] < 0) {
		*what = "open freezer tasks";
		return -1;
	}
	return 0;
}

static int v1_remove(struct sbx_cg *cg, const char *name)
{
	int rc = 0;

	if (unlinkat(cg->freezer, name, AT_REMOVEDIR) < 0 && errno != ENOENT)
		rc = -1;
	return rc;
}

static void kill_pids_in(int dirfd, const char *cg)
{
	char text[8192], *p, *end;

	if (cg_read(dirfd, cg, "cgroup.procs", text, sizeof(text)) < 0)
		return;
	for (p = text; *p; p = end) {
		long pid = strtol(p, &end, 10);

		if (end == p)
			break;
		if (pid > 1)
			kill((pid_t)pid, SIGKILL);
		while (*end == '\n')
			end++;
	}
}

/* v1 has no cgroup.kill: freeze first so that nothing forks while the list
 * is read, kill what is listed, thaw (a frozen task does not die). */
static int v1_kill(struct sbx_cg *cg, const char *name)
{
	char state[32] = "";
	int i;

	cg_write(cg->freezer, name, "freezer.state", "FROZEN");
	for (i = 0; i < 200; i++) {
		if (cg_read(cg->freezer, name, "freezer.state", state, sizeof(state)) < 0 ||
		    !strncmp(state, "FROZEN", 6))
			break;
		usleep(500);
	}
	kill_pids_in(cg->freezer, name);
	cg_write(cg->freezer, name, "freezer.state", "THAWED");
	return 0;
}

static uint64_t v1_oom_kills(struct sbx_cg *cg)
{
	return cg->memory < 0 ? 0 : cg_key(cg->memory, ".", "memory.oom_control", "oom_kill");
}

const struct cg_ops cg_v1_ops = {
	.make = v1_make,
	.remove = v1_remove,
	.kill = v1_kill,
	.oom_kills = v1_oom_kills,
};
