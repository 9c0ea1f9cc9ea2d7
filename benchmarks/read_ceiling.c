/* How fast one core reads a request's blocks scattered over a pool, against the same
 * bytes read in order: the ceiling of a `get` over shuffled blocks relative to a
 * memcpy, before any copying or checking.
 *
 *     cc -O2 -mavx2 -o /tmp/read_ceiling benchmarks/read_ceiling.c
 *     /tmp/read_ceiling [POOL_MIB] [BLOCK_BYTES ...]
 *
 * POOL_MIB defaults to 64 (use twice the last-level cache where that is larger, as
 * `slotroute bench` does); BLOCK_BYTES default to the bench presets' blocks of 16
 * tokens (gpt-oss-120b, qwen3-30b-a3b, deepseek-v3, kimi-k2). Each case is the best
 * of 30 passes over requests of 2048 blocks covering the whole pool; the "head
 * prefetched" column also prefetches the first KiB of the block 8 places on, as get
 * prefetches the heads of the blocks ahead.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define REQUEST_BLOCKS 2048
#define PASSES 30
#define AHEAD 8
#define AHEAD_BYTES 1024

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Read every byte of [p, p + n) (n a multiple of 32) into an accumulator. */
static __m256i read_block(const char *p, size_t n, __m256i acc)
{
    for (size_t o = 0; o < n; o += 32)
        acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + o)));
    return acc;
}

enum { IN_ORDER, SCATTERED, SCATTERED_AHEAD };

/* Seconds per request: the best pass over the pool's requests. */
static double time_reads(const char *pool, const uint32_t *order, size_t requests, size_t block, int how,
                         __m256i *acc)
{
    double best = 1e9;
    for (int pass = 0; pass < PASSES; pass++) {
        const double start = now();
        for (size_t r = 0; r < requests; r++) {
            const uint32_t *ids = order + r * REQUEST_BLOCKS;
            for (size_t i = 0; i < REQUEST_BLOCKS; i++) {
                const size_t b = how == IN_ORDER ? r * REQUEST_BLOCKS + i : ids[i];
                if (how == SCATTERED_AHEAD && i + AHEAD < REQUEST_BLOCKS) {
                    const char *next = pool + (size_t)ids[i + AHEAD] * block;
                    for (size_t o = 0; o < AHEAD_BYTES && o < block; o += 64)
                        __builtin_prefetch(next + o, 0, 2);
                }
                *acc = read_block(pool + b * block, block, *acc);
            }
        }
        const double t = (now() - start) / requests;
        best = t < best ? t : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    const size_t pool_bytes = (argc > 1 ? strtoul(argv[1], NULL, 10) : 64) << 20;
    static const size_t presets[] = {2304, 6144, 7808, 15616};
    const int given = argc > 2 ? argc - 2 : 4;
    char *pool = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (pool == MAP_FAILED)
        return 1;
    madvise(pool, pool_bytes, MADV_HUGEPAGE); /* as numpy advises for the store's buffer */
    memset(pool, 1, pool_bytes);
    __m256i acc = _mm256_setzero_si256();
    printf("| block bytes | in order, GB/s | scattered, GB/s | scattered, head prefetched, GB/s | best scattered / in order |\n");
    printf("|---:|---:|---:|---:|---:|\n");
    for (int k = 0; k < given; k++) {
        const size_t block = (argc > 2 ? strtoul(argv[2 + k], NULL, 10) : presets[k]) / 32 * 32;
        const size_t blocks = pool_bytes / block, requests = blocks / REQUEST_BLOCKS;
        if (block == 0 || requests == 0)
            continue;
        uint32_t *order = malloc(blocks * sizeof *order);
        for (size_t i = 0; i < blocks; i++)
            order[i] = (uint32_t)i;
        srand(1);
        for (size_t i = blocks - 1; i > 0; i--) {
            const size_t j = (size_t)rand() % (i + 1);
            const uint32_t t = order[i];
            order[i] = order[j], order[j] = t;
        }
        const double bytes = (double)REQUEST_BLOCKS * block;
        const double seq = time_reads(pool, order, requests, block, IN_ORDER, &acc);
        const double scattered = time_reads(pool, order, requests, block, SCATTERED, &acc);
        const double ahead = time_reads(pool, order, requests, block, SCATTERED_AHEAD, &acc);
        const double best = scattered < ahead ? scattered : ahead;
        printf("| %zu | %.1f | %.1f | %.1f | %.2fx |\n", block, bytes / seq / 1e9, bytes / scattered / 1e9,
               bytes / ahead / 1e9, seq / best);
        free(order);
    }
    long long sums[4];
    _mm256_storeu_si256((__m256i *)sums, acc);
    return sums[0] == 42; /* keeps the reads */
}
