/* The EROFS on-disk format, uncompressed subset: the one header that owns it.
 *
 * Every multi-byte field is little-endian.  Offsets and sizes are checked at
 * compile time.  Sources: linux fs/erofs/erofs_fs.h (6.18), fs/erofs/inode.c,
 * fs/erofs/data.c, fs/erofs/dir.c, fs/erofs/xattr.c, and
 * shared/reference/erofs-format.md (checked against mkfs.erofs 1.5 images).
 */
#ifndef LFS_EROFS_FS_H
#define LFS_EROFS_FS_H

#include <stddef.h>
#include <stdint.h>

#define EROFS_SUPER_MAGIC_V1   0xE0F5E1E2u
#define EROFS_SUPER_OFFSET     1024u      /* byte offset of the superblock */
#define EROFS_ISLOTBITS        5          /* nid = byte address / 32 */
#define EROFS_ISLOT            (1u << EROFS_ISLOTBITS)
#define EROFS_NAME_LEN         255        /* longest directory entry name */
#define EROFS_NULL_ADDR        0xFFFFFFFFu /* "no block": empty file, hole chunk */

/* feature_compat */
#define EROFS_FEATURE_COMPAT_SB_CHKSUM     0x00000001u /* superblock crc32c valid */
#define EROFS_FEATURE_COMPAT_MTIME         0x00000002u /* compact i_mtime is epoch-relative */
/* feature_incompat: a kernel refuses any bit it does not know */
#define EROFS_FEATURE_INCOMPAT_CHUNKED_FILE 0x00000004u /* CHUNK_BASED inodes (5.15+) */

struct erofs_super_block {
	uint32_t magic;               /* 0: EROFS_SUPER_MAGIC_V1 */
	uint32_t checksum;            /* 4: crc32c of the sb block, this field zeroed */
	uint32_t feature_compat;      /* 8: EROFS_FEATURE_COMPAT_* */
	uint8_t  blkszbits;           /* 12: log2(block size); 12 for 4 KiB */
	uint8_t  sb_extslots;         /* 13: 16-byte extension slots; 0 */
	uint16_t root_nid;            /* 14: nid of the root directory (16 bits w/o 48BIT) */
	uint64_t inos;                /* 16: number of inodes */
	uint64_t epoch;               /* 24: base seconds of compact inode mtimes */
	uint32_t fixed_nsec;          /* 32: nanoseconds of every compact inode mtime */
	uint32_t blocks;              /* 36: blocks of the image */
	uint32_t meta_blkaddr;        /* 40: block of nid 0 */
	uint32_t xattr_blkaddr;       /* 44: block of the shared xattr pool; unused, 0 */
	uint8_t  uuid[16];            /* 48: volume uuid */
	uint8_t  volume_name[16];     /* 64: NUL-terminated within 16 bytes */
	uint32_t feature_incompat;    /* 80: EROFS_FEATURE_INCOMPAT_* */
	uint16_t available_compr_algs;/* 84: 0, uncompressed */
	uint16_t extra_devices;       /* 86: devices besides the primary; 0 */
	uint16_t devt_slotoff;        /* 88: device table at devt_slotoff * 128; 0 */
	uint8_t  dirblkbits;          /* 90: must be 0 */
	uint8_t  xattr_prefix_count;  /* 91: long xattr prefixes; 0 */
	uint32_t xattr_prefix_start;  /* 92: 0 */
	uint64_t packed_nid;          /* 96: 0 */
	uint8_t  xattr_filter_reserved; /* 104: 0 */
	uint8_t  ishare_xattr_prefix_id; /* 105: 0 */
	uint8_t  reserved[2];         /* 106 */
	uint32_t build_time;          /* 108: seconds after epoch; 0 */
	uint64_t rootnid_8b;          /* 112: 48BIT only; 0 */
	uint8_t  reserved2[8];        /* 120 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_super_block) == 128, "erofs_super_block is 128 bytes");
_Static_assert(offsetof(struct erofs_super_block, feature_incompat) == 80, "sb layout");

/* i_format: bit 0 version, bits 1-3 data layout; bit 4 (NLINK_1) is never set here,
 * so i_nb always holds nlink. */
#define EROFS_INODE_LAYOUT_COMPACT   0
#define EROFS_INODE_LAYOUT_EXTENDED  1
#define EROFS_I_DATALAYOUT_BIT       1
#define EROFS_INODE_FLAT_PLAIN       0  /* data in contiguous blocks at startblk */
#define EROFS_INODE_FLAT_INLINE      2  /* full blocks at startblk, tail after the inode */
#define EROFS_INODE_CHUNK_BASED      4  /* per-chunk block map after the inode */

/* i_u for CHUNK_BASED: format low 5 bits = chunkbits - blkszbits; no INDEXES bit
 * means 4-byte block-map entries (startblk, EROFS_NULL_ADDR for a hole). */
#define EROFS_CHUNK_FORMAT_BLKBITS_MASK 0x001F
#define EROFS_BLOCK_MAP_ENTRY_SIZE      4

struct erofs_inode_compact {
	uint16_t i_format;            /* 0: version | layout << 1 */
	uint16_t i_xattr_icount;      /* 2: 0, or (xattr ibody size - 12) / 4 + 1 */
	uint16_t i_mode;              /* 4: st_mode */
	uint16_t i_nlink;             /* 6: i_nb: link count */
	uint32_t i_size;              /* 8: bytes */
	uint32_t i_mtime;             /* 12: seconds after sb epoch; always 0 here */
	uint32_t i_u;                 /* 16: startblk / rdev / chunk format */
	uint32_t i_ino;               /* 20: 32-bit inode number for stat on 32-bit */
	uint16_t i_uid;               /* 24 */
	uint16_t i_gid;               /* 26 */
	uint8_t  i_reserved[4];       /* 28 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_inode_compact) == 32, "compact inode is 32 bytes");

struct erofs_inode_extended {
	uint16_t i_format;            /* 0: version | layout << 1 */
	uint16_t i_xattr_icount;      /* 2 */
	uint16_t i_mode;              /* 4 */
	uint16_t i_nb;                /* 6: 48BIT block high bits; 0 */
	uint64_t i_size;              /* 8: bytes */
	uint32_t i_u;                 /* 16: startblk / rdev / chunk format */
	uint32_t i_ino;               /* 20 */
	uint32_t i_uid;               /* 24 */
	uint32_t i_gid;               /* 28 */
	uint64_t i_mtime;             /* 32: seconds since the Unix epoch (signed) */
	uint32_t i_mtime_nsec;        /* 40 */
	uint32_t i_nlink;             /* 44 */
	uint8_t  i_reserved2[16];     /* 48 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_inode_extended) == 64, "extended inode is 64 bytes");

/* Inline xattrs follow the inode: this header, shared ids (none here), entries. */
struct erofs_xattr_ibody_header {
	uint32_t h_name_filter;       /* 0: bloom filter, only with XATTR_FILTER; 0 */
	uint8_t  h_shared_count;      /* 4: shared xattr ids that follow; 0 */
	uint8_t  h_reserved2[7];      /* 5 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_xattr_ibody_header) == 12, "xattr ibody header is 12 bytes");

#define EROFS_XATTR_INDEX_USER             1
#define EROFS_XATTR_INDEX_POSIX_ACL_ACCESS 2  /* whole name, empty suffix */
#define EROFS_XATTR_INDEX_POSIX_ACL_DEFAULT 3 /* whole name, empty suffix */
#define EROFS_XATTR_INDEX_TRUSTED          4
#define EROFS_XATTR_INDEX_SECURITY         6
#define EROFS_XATTR_ALIGN                  4  /* entries padded to 4 bytes */

struct erofs_xattr_entry {
	uint8_t  e_name_len;          /* 0: suffix length */
	uint8_t  e_name_index;        /* 1: EROFS_XATTR_INDEX_* */
	uint16_t e_value_size;        /* 2 */
	/* followed by the name suffix, then the value, then padding to 4 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_xattr_entry) == 4, "xattr entry header is 4 bytes");

/* Directory blocks: dirents, then their names unterminated, in the same order;
 * entries never cross a block; names memcmp-sorted over the whole directory. */
struct erofs_dirent {
	uint64_t nid;                 /* 0: target inode */
	uint16_t nameoff;             /* 8: name offset in this block */
	uint8_t  file_type;           /* 10: EROFS_FT_* */
	uint8_t  reserved;            /* 11 */
} __attribute__((packed));
_Static_assert(sizeof(struct erofs_dirent) == 12, "dirent is 12 bytes");

enum {
	EROFS_FT_UNKNOWN, EROFS_FT_REG_FILE, EROFS_FT_DIR, EROFS_FT_CHRDEV,
	EROFS_FT_BLKDEV, EROFS_FT_FIFO, EROFS_FT_SOCK, EROFS_FT_SYMLINK,
};

#endif
