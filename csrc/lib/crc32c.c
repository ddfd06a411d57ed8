/* crc32c (Castagnoli, reflected polynomial 0x82F63B78), as the kernel's
 * crc32c(seed, data, len): no inversion on the way in or out.  EROFS stores
 * crc32c(~0, superblock block) (fs/erofs/super.c erofs_superblock_csum_verify). */
#include <stddef.h>
#include <stdint.h>

#include "lfs_writer.h"

static uint32_t crc32c_table[256];

__attribute__((constructor)) static void crc32c_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;

		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
		crc32c_table[i] = c;
	}
}

uint32_t lfs_crc32c(uint32_t seed, const void *data, size_t len)
{
	const uint8_t *p = data;
	uint32_t crc = seed;

	while (len--)
		crc = crc32c_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
	return crc;
}
