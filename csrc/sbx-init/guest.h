/* sbx-init's guest mode: PID 1 of a microVM.
 *
 * The kernel runs /init (sbx-init) from the initramfs with `-g`.  Boot, in two
 * steps around the template snapshot:
 *
 *   1. (template boot) mount /proc, /sys, /dev (devtmpfs); load the modules of
 *      /etc/sbx/modules.early with finit_module(2) (virtio_blk probes the
 *      template's disks: placeholders for the layers, the real upper file);
 *      those of modules.late with the virtio bus's autoprobe off (their
 *      devices stay unbound); open the virtio-serial port named
 *      SBX_GUEST_PORT; then as much of the sandbox as does not depend on the
 *      clone: find the disks by their virtio serial numbers (the
 *      placeholders carry the clone's), drop what the probe cached of them
 *      (BLKFLSBUF), mount the ext4 upper disk with its upper/, work/, empty/
 *      and sync it (the host copies this file for each clone: the guest's
 *      cache of it is the clone's file), make the workload's cgroup (cgroup
 *      v2, mounted outside the sandbox's root so no workload process can reach
 *      it), mount /proc, /sys (read-only) and a small /dev with only the
 *      harmless nodes outside the root; send struct sbx_boot_ready; block
 *      reading struct sbx_boot.  The host saves the template while the guest
 *      waits here, so every clone resumes at this read.  Under TCG each clone's
 *      QEMU translates every guest instruction it runs for the first time:
 *      what is done here a clone does not run at all.
 *   2. (each clone) the host sends struct sbx_boot and its payload; the guest
 *      sets its clock, checks the layer count, mounts the EROFS lowers
 *      read-only and the overlay, sets the cgroup's limits, moves /proc,
 *      /sys and /dev into the overlay, binds the protected paths read-only;
 *      moves the overlay onto / and chroots; answers struct sbx_boot_done (its
 *      message, on success, the step times: "name=microseconds ...").  From
 *      then on the same port carries the protocol of protocol.h.  (With late
 *      modules, finding the disks and mounting the upper move to step 2.)
 *
 * Threat model: the workload runs as guest root with the container's
 * capability set (no CAP_SYS_ADMIN, CAP_MKNOD, CAP_SYS_MODULE, CAP_SYS_RAWIO),
 * so it cannot open the control port (no node for it in its /dev, cannot make
 * one, and virtio-serial ports admit one opener: sbx-init), reach the cgroup
 * tree, remount the protected paths, or load modules.  What it can do as root
 * (crash the guest kernel through /proc/sysrq-trigger, fill the guest's RAM or
 * the upper disk) ends at the VM: the host sees a VMM that exited.
 *
 * All integers little-endian.  Python mirror: edged/backends/microvm/boot.py.
 */
#ifndef SBX_GUEST_H
#define SBX_GUEST_H

#include <stdint.h>

#define SBX_GUEST_PORT    "sbx.ctl"    /* virtserialport name= */
#define SBX_GUEST_VERSION 1u
#define SBX_GUEST_MAX_LAYERS 16u
#define SBX_GUEST_MAX_PAYLOAD (1u << 20)
/* virtio-blk serial numbers: "sbx-l0".."sbx-l15" (bottom first), "sbx-upper" */
#define SBX_GUEST_SERIAL_LOWER "sbx-l"
#define SBX_GUEST_SERIAL_UPPER "sbx-upper"

struct sbx_boot_ready {
	char magic[8];    /* "SBXREADY" */
	uint32_t version; /* SBX_GUEST_VERSION */
	uint32_t reserved;
	uint64_t boot_ns; /* CLOCK_BOOTTIME when the guest became ready */
};
_Static_assert(sizeof(struct sbx_boot_ready) == 24, "sbx_boot_ready is 24 bytes");

/* SBX_BOOT flags */
#define SBX_BOOT_CONFINE_CAPS 0x1u /* drop each exec to `caps` (bounding set too) */

struct sbx_boot {
	char magic[8];          /* "SBXBOOT1" */
	uint32_t len;           /* payload bytes after this struct, <= SBX_GUEST_MAX_PAYLOAD */
	uint32_t nlayers;       /* lower disks, 1..SBX_GUEST_MAX_LAYERS */
	uint64_t realtime_ns;   /* the host's CLOCK_REALTIME: a clone has the template's */
	uint64_t memory_max;    /* workload cgroup memory.max, bytes; 0: none */
	uint64_t caps;          /* capabilities every exec keeps (bit n = capability n) */
	uint32_t pids_max;      /* workload cgroup pids.max; 0: none */
	uint32_t flags;         /* SBX_BOOT_* */
	uint32_t landlock_len;  /* payload: Landlock ruleset blob (lfs_confine.h), may be 0 */
	uint32_t seccomp_len;   /* then the seccomp program, may be 0 */
	uint32_t strings_len;   /* then NUL-terminated strings: hostname, protected paths
				 * (':'-separated), grader paths (':'-separated) */
	uint32_t reserved;
};
_Static_assert(sizeof(struct sbx_boot) == 64, "sbx_boot is 64 bytes");

struct sbx_boot_done {
	char magic[8];    /* "SBXBOOTD" */
	int32_t code;     /* 0, or the errno of the failed step */
	uint32_t msg_len; /* then the message (not NUL-terminated), <= 512 bytes */
	uint64_t boot_ns; /* time the guest spent in step 2 */
};
_Static_assert(sizeof(struct sbx_boot_done) == 24, "sbx_boot_done is 24 bytes");

/* What step 2 leaves for sbx-init's main loop. */
struct sbx_guest {
	int port;         /* the control port, connected */
	int landlock_fd;  /* memfd with the ruleset blob, or -1 */
	int seccomp_fd;   /* memfd with the seccomp program, or -1 */
	int cgroup_fd;    /* the workload's cgroup v2 directory */
	int lowers[SBX_GUEST_MAX_LAYERS]; /* the layers' mount roots (grader views) */
	int n_lowers;     /* 0: no grader views */
	int scratch_fd;   /* the upper disk's root (upper/, work/, empty/) */
	char *grader_paths;
	uint64_t caps;
	uint32_t flags;
};

/* Both boot steps; on success the guest's root is the sandbox's rootfs.
 * Never returns on failure: a guest that cannot boot reports on the port
 * (when open) and powers off. */
void sbx_guest_boot(struct sbx_guest *g);

/* Reopen the control port after the host side went away (a daemon restart);
 * returns the fd, or -1 while no host is connected (try again later). */
int sbx_guest_reconnect(void);

#endif
