/* Per-exec cgroups on the unified (v2) hierarchy: one cgroup without
 * controllers (the sandbox's cgroup enables none in cgroup.subtree_control, so
 * no memory cgroup is made per exec), killed through cgroup.kill.  OOM kills
 * are the sandbox's (its memory.events). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sbx-init.h"

static int v2_make(struct sbx_cg *cg, const char *name, int join[2], const char **what)
{
	char path[64];

	if (mkdirat(cg->v2, name, 0755) < 0) {
		*what = "mkdir";
		return -1;
	}
	snprintf(path, sizeof(path), "%s/cgroup.procs", name);
	join[0] = openat(cg->v2, path, O_WRONLY | O_CLOEXEC);
	if (join[0] < 0) {
		*what = "open cgroup.procs";
		return -1;
	}
	return 0;
}

static int v2_remove(struct sbx_cg *cg, const char *name)
{
	return unlinkat(cg->v2, name, AT_REMOVEDIR) < 0 && errno != ENOENT ? -1 : 0;
}

static int v2_kill(struct sbx_cg *cg, const char *name)
{
	return cg_write(cg->v2, name, "cgroup.kill", "1");
}

static uint64_t v2_oom_kills(struct sbx_cg *cg)
{
	return cg_key(cg->v2, ".", "memory.events", "oom_kill");
}

const struct cg_ops cg_v2_ops = {
	.make = v2_make,
	.remove = v2_remove,
	.kill = v2_kill,
	.oom_kills = v2_oom_kills,
};
