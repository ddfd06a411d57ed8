/* Memory advice over another process's mappings, for the node's reclaim: page
 * an idle sandbox's cold pages out to swap, and read them back ahead of use
 * when it wakes (process_madvise(2), Linux >= 5.10; MADV_PAGEOUT/MADV_COLD on
 * another process since 5.10, MADV_WILLNEED since 5.10 too).
 *
 * Which mappings: those whose pages are the process's own and would have to be
 * written to swap: anonymous ones (heap, stacks, anonymous mmap) and private
 * writable file mappings (.data/.bss after copy-on-write).  Read-only and
 * executable file mappings are left alone: their pages are the page cache of
 * the sandbox's layers, shared by every sandbox of the image, and the kernel
 * skips shared pages anyway.  [vsyscall], [vvar] and [vdso] are skipped (no
 * LRU pages; the kernel refuses them with EINVAL).
 *
 * Facts: mm/madvise.c of Linux 6.18 (process_madvise: vectors of at most
 * UIO_MAXIOV, returns bytes advised before the first failing range; MADV_PAGEOUT
 * refuses VM_LOCKED/VM_PFNMAP/hugetlb ranges with EINVAL and skips pages mapped
 * by more than one process), Documentation/admin-guide/mm/concepts.rst.
 */
#ifndef LFS_MEMORY_H
#define LFS_MEMORY_H

#include <stdint.h>

#include "lfs_error.h"

#define LFS_MADV_WILLNEED 3  /* read swapped pages back (swap readahead) */
#define LFS_MADV_COLD 20     /* deactivate: first to go under pressure */
#define LFS_MADV_PAGEOUT 21  /* reclaim now: anonymous pages to swap */

struct lfs_advise_stats {
	uint64_t ranges;  /* mappings advised */
	uint64_t bytes;   /* bytes of them the kernel took the advice for */
	uint64_t skipped; /* mappings the kernel refused (locked, PFN-mapped, ...) */
};

/* Give `advice` for every private mapping (see above) of process `pid`, whose
 * pidfd (pidfd_open(2)) is `pidfd`: the pid names the /proc/<pid>/maps to read,
 * the pidfd pins the process, so that a pid reused meanwhile is never advised
 * (the maps are checked to belong to the pidfd's live process).  Returns 0 and
 * fills `st`; a process that is gone is not an error (st stays zero).  Errors:
 * -1 with err set (EPERM: needs CAP_SYS_NICE and ptrace read access; EINVAL:
 * advice not allowed remotely). */
int lfs_process_advise(int pidfd, int pid, int advice, struct lfs_advise_stats *st,
		       struct lfs_error *err);

#endif
