/* The lazy layer file server: one FUSE mount exposing each registered layer as a
 * read-only regular file `<hex digest>.erofs` of the layer's exact size.
 *
 * The kernel mounts EROFS file-backed on those files, so reads arrive here as page-cache
 * misses.  Each layer has one sparse cache file of its size, a chunk at its own offset
 * in it, so a read whose chunks are all present is answered entirely in C by one pread
 * at the same offset.  A read that needs a missing chunk is parked on that chunk (no
 * thread blocks); the chunk is queued ONCE for the Python side, which is woken through
 * an eventfd, fetches and verifies the chunk and calls lfs_lazy_chunk_write() (or
 * lfs_lazy_chunk_failed()), which writes it at its offset and answers every parked read.
 *
 * Restart: the /dev/fuse connection is held open by a supervisor process; a new server
 * process takes the same fd (libfuse accepts the mountpoint "/dev/fd/N"), replays a
 * synthetic FUSE_INIT into its session (the kernel sends INIT only once per connection)
 * and asks the kernel to requeue the requests the dead server had read but not answered
 * (FUSE_NOTIFY_RESEND, Linux 6.9+, include/uapi/linux/fuse.h).  Inode numbers are
 * `slot + 2`, with slots persisted by the caller, so the kernel's cached nodeids stay
 * valid across the restart; file handles are not used for the same reason.
 */
#ifndef LFS_LAZY_H
#define LFS_LAZY_H

#include <stdint.h>

#include "lfs_error.h"

#define LFS_LAZY_MAX_LAYERS 16384 /* slots; inode = slot + 2 */

enum lfs_lazy_chunk_state {
	LFS_LAZY_MISSING = 0,  /* not cached, nobody fetching */
	LFS_LAZY_FETCHING = 1, /* queued or being fetched; reads park on it */
	LFS_LAZY_PRESENT = 2,  /* durable in the layer's cache file */
};

/* Counters of one layer since it was registered (monotonic, read without locks). */
struct lfs_lazy_stats {
	uint64_t reads;          /* FUSE READ requests */
	uint64_t read_bytes;     /* bytes answered */
	uint64_t hits;           /* reads answered at once from the cache */
	uint64_t misses;         /* reads that had to wait for at least one chunk */
	uint64_t fetches;        /* chunks queued for the Python side */
	uint64_t ready;          /* chunks that became present */
	uint64_t failed;         /* fetches reported failed (waiters got an error) */
	uint64_t errors;         /* reads answered with an error */
	uint32_t present;        /* chunks present now */
	uint32_t inflight;       /* chunks FETCHING now */
	uint32_t nchunks;        /* chunks of the layer */
	uint32_t touched;        /* distinct chunks read since the trace was last reset */
	uint64_t speculative;    /* chunks queued ahead of a sequential reader */
	uint64_t wait_ns;        /* time reads spent parked on chunks, summed */
};

struct lfs_lazy;

/* A server on the FUSE connection `fuse_fd` (an open /dev/fuse fd already mounted).
 * `resumed`: the connection was initialised by an earlier server (see restart above).
 * Returns NULL with err set on failure. */
struct lfs_lazy *lfs_lazy_new(int fuse_fd, int resumed, struct lfs_error *err);

/* eventfd that becomes readable when chunks are queued for fetching (and once when the
 * FUSE loop ends). */
/* Free a server that has stopped (lfs_lazy_stopped) or never started: its FUSE loop
 * joined, every layer, queued fetch and parked read gone (the reads answered EIO), its
 * copy of the fuse fd closed.  -EBUSY, nothing freed, while its loop still serves. */
int lfs_lazy_free(struct lfs_lazy *lz);
int lfs_lazy_event_fd(struct lfs_lazy *lz);

/* 1 once the FUSE loop has ended (the connection was unmounted or aborted). */
int lfs_lazy_stopped(struct lfs_lazy *lz);

/* A slot for a new layer (the lowest free one), or -1 if all are taken.  A removed
 * layer's slot is free again once the kernel has forgotten its inode (after its file is
 * closed everywhere; removal invalidates the kernel's dentry) and no READ handler uses
 * it; its inode number then comes back with a new generation. */
int lfs_lazy_take_slot(struct lfs_lazy *lz);

/* Slots by state: registered layers, removed ones the kernel (or a READ) still holds,
 * removed ones ready for reuse, and pinned ones without a registered layer (see
 * lfs_lazy_pin_slot). */
struct lfs_lazy_slots {
	uint32_t live;
	uint32_t held;
	uint32_t reusable;
	uint32_t pinned;
};
void lfs_lazy_slot_counts(struct lfs_lazy *lz, struct lfs_lazy_slots *out);

/* Do not reuse `slot` in this server until the kernel FORGETs its inode: its lookups
 * were counted by an earlier server (a resumed connection).  Returns -1 for a slot out
 * of range. */
int lfs_lazy_pin_slot(struct lfs_lazy *lz, uint32_t slot);

/* Unpin every pinned slot whose inode the kernel does not have (it forgot it before the
 * restart, or never looked it up): asked with FUSE_NOTIFY_INVAL_INODE, which answers
 * ENOENT for an inode the kernel does not hold.  Call after lfs_lazy_start(), not from a
 * FUSE handler.  Returns how many were unpinned. */
int lfs_lazy_unpin_forgotten(struct lfs_lazy *lz);

/* Register layer `name` (the file name, e.g. "<hex>.erofs") in `slot` (from
 * lfs_lazy_take_slot(), or restored by the caller), cached in the file `data_path`
 * (created, or sized to `size`, if needed); every chunk starts missing. */
int lfs_lazy_add_layer(struct lfs_lazy *lz, uint32_t slot, const char *name, uint64_t size,
		       uint32_t chunk_size, const char *data_path, struct lfs_error *err);

/* Forget the layer in `slot`: later lookups fail with ENOENT, reads with EIO, its
 * queued fetches are dropped and the kernel is told to drop its dentry. */
int lfs_lazy_remove_layer(struct lfs_lazy *lz, uint32_t slot, struct lfs_error *err);

/* Start the multi-threaded FUSE loop (at most `max_threads` workers) in the background. */
int lfs_lazy_start(struct lfs_lazy *lz, unsigned max_threads, struct lfs_error *err);

/* Pop one queued chunk, on-demand ones first: sets *slot and *index and returns 1 for a
 * chunk a read waits for, 2 for a speculative one (no read asked for it yet); 0 when
 * both queues are empty.  Either way the chunk is FETCHING and the caller owns its fetch. */
int lfs_lazy_next_fetch(struct lfs_lazy *lz, uint32_t *slot, uint32_t *index);

/* When a read misses chunk i while chunk i-1 is present or being fetched, also claim and
 * queue (speculatively) chunks i+1 .. i+`chunks` that are missing; 0 turns it off (the
 * default).  Each costs its bytes whether or not a read comes for it. */
void lfs_lazy_set_speculate(struct lfs_lazy *lz, uint32_t chunks);

/* MISSING -> FETCHING for a prefetch: returns 1 if the caller now owns the fetch, 0 if
 * the chunk is present or already being fetched, -1 for a bad slot or index. */
int lfs_lazy_chunk_claim(struct lfs_lazy *lz, uint32_t slot, uint32_t index);

/* Chunk `index` of `slot` is already durable in the layer's cache file (restored from
 * the persisted bitmap): mark it present and answer every read parked on it. */
int lfs_lazy_chunk_ready(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 struct lfs_error *err);

/* Write the verified bytes of chunk `index` (exactly its length) at its offset in the
 * layer's cache file, then mark it present and answer every read parked on it.  An
 * all-zero chunk becomes a hole.  The bytes are not yet durable: see
 * lfs_lazy_layer_sync().  On failure (ENOSPC, EIO) the chunk is not marked and its
 * readers stay parked: the caller retries or calls lfs_lazy_chunk_failed(). */
int lfs_lazy_chunk_write(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 const void *data, size_t len, struct lfs_error *err);

/* fdatasync the layer's cache file.  To persist the present bitmap: take it
 * (lfs_lazy_present_bitmap), call this, then write it; every chunk it names was then
 * written before the flush. */
int lfs_lazy_layer_sync(struct lfs_lazy *lz, uint32_t slot, struct lfs_error *err);

int lfs_lazy_chunk_failed(struct lfs_lazy *lz, uint32_t slot, uint32_t index, int errnum);

/* Mark a present chunk missing (cache eviction; its bytes stay until
 * lfs_lazy_chunk_punch()): returns 1 if done, 0 if not present or being read right now,
 * -1 for a bad slot or index. */
int lfs_lazy_chunk_evict(struct lfs_lazy *lz, uint32_t slot, uint32_t index);

/* After lfs_lazy_chunk_evict() and after the bitmap without the chunk is persisted:
 * give its bytes back to the file system (fallocate PUNCH_HOLE).  EBUSY if the chunk
 * became present again meanwhile. */
int lfs_lazy_chunk_punch(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			 struct lfs_error *err);

/* Bit i of `out` (LSB first) = chunk i present; `nbytes` >= (nchunks + 7) / 8.
 * Returns nchunks, or -1 for an empty slot or a short buffer. */
int lfs_lazy_present_bitmap(struct lfs_lazy *lz, uint32_t slot, uint8_t *out, size_t nbytes);

/* State (enum lfs_lazy_chunk_state) and last-access tick of one chunk; -1 if bad. */
int lfs_lazy_chunk_info(struct lfs_lazy *lz, uint32_t slot, uint32_t index,
			uint64_t *atime);

/* Counters of one layer; -1 if the slot is empty. */
int lfs_lazy_layer_stats(struct lfs_lazy *lz, uint32_t slot, struct lfs_lazy_stats *out);

/* Chunks in first-touch order since the last reset (the access trace); copies at most
 * `max` indexes, returns how many there are.  `reset` clears the trace afterwards. */
int lfs_lazy_trace(struct lfs_lazy *lz, uint32_t slot, uint32_t *out, uint32_t max,
		   int reset);

/* Open /dev/fuse and mount it read-only on `mountpoint` (fstype fuse.layerfs, allow_other,
 * default_permissions). Returns the fd, which keeps the connection alive. */
int lfs_lazy_mount(const char *mountpoint, struct lfs_error *err);

/* umount2(`mountpoint`, MNT_DETACH if `detach`). */
int lfs_lazy_umount(const char *mountpoint, int detach, struct lfs_error *err);

#endif
