/* Paged decode attention on the CPU: one query per sequence, read from the paged KV cache in place.
 *
 * Chapter 6's kernel, written for a CPU core instead of a GPU program. A task is one sequence and a range of its
 * K/V heads (all of them when there are enough sequences to keep every core busy, one otherwise). It walks the
 * sequence's block table twice: once over the keys, writing every score, and once over the values, adding
 * them up weighted by the softmax. Between the two passes each query head's scores are a row of at most
 * max_model_len floats in the core's own cache, so the softmax is exact and done once (max, exp, sum), where
 * chapter 6's online softmax rescales its running sums after every block: a GPU program cannot hold a long
 * row of scores, a CPU core can. vLLM's `paged_attention_v1` for the CPU (`csrc/cpu/attention.cpp`) makes the
 * same choice.
 *
 * Every key and value is read once, from where it lies, and only up to the sequence's own length. The hardware
 * prefetcher stops at every jump from one block to the next, so the kernel asks for the slot AHEAD positions on
 * while it works on the current one, into the L2 cache: asking for whole blocks at once, or into the L1, filled
 * the core's few outstanding-miss slots and stalled it. The arithmetic is written on vectors of LANES floats
 * (GCC's vector extensions: one AVX-512 register, two AVX2 ones). Pass 1 takes 16 positions of a row at a time:
 * each dot product is head_dim / LANES multiply-adds into a vector of partial sums, and the 16 vectors are added
 * up together (`fold16`, 15 two-vector shuffles where a tree per position takes 4 each). Pass 2 loads each value
 * once for the query rows that read its head (a GQA group, a verify's tokens), their running sums in registers.
 * The softmax's exponentials run LANES at a time. OpenMP deals the tasks over the cores (torch's OpenMP runtime:
 * the library binds to the one torch loaded).
 *
 * Measured on a 2-core AMD EPYC (2026-11-24), SmolLM2's heads, shuffled block tables, a cache larger than the L3,
 * medians of 5 paired runs, against the version before (blocks prefetched two ahead into the L1, scalar sums and
 * exponentials): 64 sequences of 200 tokens took 0.85 instead of 1.23 ms per layer at block size 128 and 1.08
 * instead of 1.96 at block size 16; 32 of 37-300 tokens 0.40 instead of 0.62; one of 1,000 tokens 0.12 instead of
 * 0.23. The first case reads the cache at 23 GB/s, where a plain sum over the same blocks streams at 28.
 * Pass 1 then walked the block position by position, all rows at each; it now walks it row by row (each row's
 * scores written in order, the block's keys kept in the L1), which a verify's extra rows need.
 *
 * A speculative verify brings num_queries tokens per sequence (1 + k, the same for every sequence of a call): they
 * are more query rows of the same task, so the context is still read once; the causal mask is a shorter row of
 * scores for each earlier token (token r of Q sees the first seq_len - (Q - 1 - r) positions).
 *
 * A sliding window (window > 0; 0: none) masks the front of each row too: a query token sees only the last `window`
 * positions up to its own (Hugging Face's rule, transformers 5.23.0 `masking_utils.py`). The positions before them
 * are still scored, and given weight 0 by the softmax: every token stays in the cache, and reading a row from its
 * start keeps one walk over the blocks for every row.
 *
 * The cache may be fp32 or bf16 (`paged_decode_attention_bf16`, whose queries are bf16 too): a bf16 value is the
 * upper half of the fp32 one, so widening it is a shift, done as the vector is loaded. On a CPU with AVX512-BF16
 * (and head_dim a multiple of 32) pass 1 widens nothing: vdpbf16ps multiplies the query's and the key's bf16 pairs
 * (the products are exact in fp32) and adds them in fp32. The softmax and pass 2 stay fp32; the output is rounded
 * to bf16 as it is written.
 * Same machine, 2026-11-28, bf16, 64 sequences of 270 tokens, block 128: 0.75 ms per layer before these three
 * changes (a tree of shuffles per score, the widening in pass 1, each value widened again for every row of its
 * group), 0.55 after, 24 GB/s; with every K/V already in the cache the kernel's arithmetic alone takes about 0.26.
 *
 * Layouts (contiguous): q and out (B, num_queries, Hq, D) in the cache's dtype; key_cache,
 * value_cache (num_blocks, block_size, Hkv, D) fp32 or bf16; block_tables (B, max_blocks) int64; seq_lens (B,)
 * int64, each the length the sequence's last query token sees; window: positions each query sees (0: all).
 * Query head h reads K/V head h / (Hq / Hkv).
 * D is a multiple of LANES, at most MAX_HEAD_DIM.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 256
#define LANES 16            /* floats per vector */
#define CACHE_LINE_FLOATS 16
#define AHEAD 16            /* positions: how far ahead of the one being read the prefetch runs */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vfloat_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

typedef uint16_t bf16_unaligned __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(2)));

static inline vfloat load(const float *p) { return *(const vfloat_unaligned *)p; }
static inline void store(float *p, vfloat x) { *(vfloat_unaligned *)p = x; }

/* LANES cache entries from element `i` of `cache`, as floats: fp32 as stored, or bf16 widened (its 16 bits become
 * the float's upper half). `bf16` is a constant wherever this is inlined, so the test costs nothing. */
static inline vfloat load_kv(const void *cache, int64_t i, const int bf16) {
    if (!bf16) return load((const float *)cache + i);
#ifdef __AVX512F__ /* one zero-extending load and a shift, where GCC's generic conversion takes six instructions */
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + i));
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
#else
    const vint wide = __builtin_convertvector(*(const bf16_unaligned *)((const uint16_t *)cache + i), vint);
    return (vfloat)(wide << 16);
#endif
}

/* One bf16 value as a float: its 16 bits are the float's upper half. */
static inline float bf16_to_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* A float rounded to the nearest bf16 (ties to even), as torch rounds it; a NaN stays a NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The sum of x's lanes: four shuffle-and-add steps, each folding the upper half of the live lanes onto the lower. */
static inline float lane_sum(vfloat x) {
    x += __builtin_shuffle(x, (vint){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vint){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    x += __builtin_shuffle(x, (vint){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    x += __builtin_shuffle(x, (vint){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return x[0];
}

/* The lane sums of 16 vectors d[0..15], as one vector (lane u: the sum of d[u]'s lanes), in 15 two-vector shuffles
 * and adds where 16 lane_sums take 64: each level adds every pair's lower halves to their upper halves, so a vector
 * holds two half-reduced inputs side by side, then four quarter-reduced ones, and so on, in order. */
static inline vfloat fold16(vfloat *d) {
    static const vint lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vint hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const vint lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const vint hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const vint lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const vint hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const vint lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const vint hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
#define FOLD(i, lo, hi) \
    (__builtin_shuffle(d[2 * (i)], d[2 * (i) + 1], lo) + __builtin_shuffle(d[2 * (i)], d[2 * (i) + 1], hi))
    for (int i = 0; i < 8; i++) d[i] = FOLD(i, lo8, hi8);
    for (int i = 0; i < 4; i++) d[i] = FOLD(i, lo4, hi4);
    for (int i = 0; i < 2; i++) d[i] = FOLD(i, lo2, hi2);
    return FOLD(0, lo1, hi1);
#undef FOLD
}

/* e^x for x <= 0 in single precision (about 2 ulp), lane by lane: x = n·ln 2 + r with |r| <= ln 2 / 2, e^r by its
 * degree-6 Taylor polynomial, 2^n by building the float's exponent bits. */
static inline vfloat exp_nonpositive(vfloat x) {
    const vfloat lowest = (vfloat){0} - 87.0f; /* below this e^x is under float's smallest normal: ~0 */
    const vint low = x < lowest;
    x = (vfloat)(((vint)lowest & low) | ((vint)x & ~low));
    const vfloat round = (vfloat){0} + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const vfloat n = (x * 1.44269504f + round) - round;
    const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts, for an exact subtraction */
    vfloat poly = (vfloat){0} + 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    return poly * (vfloat)((__builtin_convertvector(n, vint) + 127) << 23);
}

/* The element where block `i` of a sequence's table starts in the cache, at the task's first K/V head
 * (`head_offset` elements in). */
static inline int64_t block_at(const int64_t *table, int64_t i, int64_t block_stride, int64_t head_offset) {
    return table[i] * block_stride + head_offset;
}

/* Into the L2: the task's slice (`elements` from `head_offset`) of position p's slot, if p is in the sequence. */
static inline void prefetch_position(const void *cache, const int64_t *table, int64_t p, int64_t len,
                                     int64_t block_size, int64_t block_stride, int64_t token_stride,
                                     int64_t head_offset, int64_t elements, const int bf16) {
    if (p >= len) return;
    const int64_t element_bytes = bf16 ? 2 : 4;
    const int64_t first = block_at(table, p / block_size, block_stride, head_offset) + (p % block_size) * token_stride;
    const char *bytes = (const char *)cache + first * element_bytes;
    for (int64_t f = 0; f < elements * element_bytes; f += CACHE_LINE_FLOATS * sizeof(float))
        __builtin_prefetch(bytes + f, 0, 1);
}

/* How many of block `i`'s slots hold the sequence's tokens: all but in its last block. */
static inline int64_t tokens_in_block(int64_t len, int64_t i, int64_t block_size) {
    return len - i * block_size < block_size ? len - i * block_size : block_size;
}

#ifdef __AVX512BF16__
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* A query row times the key at element k of the cache, as LANES partial sums (lane_sum or fold16 adds them up).
 * With `dp` (a bf16 cache on a CPU with AVX512-BF16, head_dim a multiple of 32) the row's bf16 query `qb` and the
 * key's bf16 values go straight into vdpbf16ps, 32 pairs an instruction: the products are exact in fp32 and the
 * sums fp32, nothing is widened, and the scale is applied to the score instead. Otherwise the row's scaled fp32
 * query `qf` meets the key widened as it loads. */
static inline vfloat dot_key(const float *qf, const uint16_t *qb, const void *key_cache, int64_t k,
                             const int64_t head_dim, const int bf16, const int dp) {
#if HAVE_DPBF16
    if (dp) {
        const uint16_t *key = (const uint16_t *)key_cache + k;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qb),
                                      (__m512bh)_mm512_loadu_si512(key));
        for (int64_t c = 2 * LANES; c < head_dim; c += 2 * LANES)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qb + c), (__m512bh)_mm512_loadu_si512(key + c));
        return (vfloat)dot;
    }
#endif
    (void)qb;
    vfloat dot = load(qf) * load_kv(key_cache, k, bf16);
    for (int64_t c = 1; c < head_dim / LANES; c++)
        dot += load(qf + c * LANES) * load_kv(key_cache, k + c * LANES, bf16);
    return dot;
}

#define MAX_ROWS 4 /* query rows whose running sums pass 2 keeps in registers at once (at head_dim <= 64) */

/* One task: sequence `b`, K/V heads [h_begin, h_end) and their query heads, for each of its num_queries tokens.
 * `scores` holds (rows × len) floats, `acc` (rows × head_dim): the thread's own workspace. Inlined with head_dim a
 * constant (64, 128) where it can be, so the loops over it unroll and a head's running sums stay in registers;
 * and with `bf16` a constant, so each cache type gets its own loads. q is fp32, or bf16 with a bf16 cache. */
static inline __attribute__((always_inline)) void attend_task(
    const void *q, const void *key_cache, const void *value_cache, const int64_t *table, int64_t len, void *out,
    int64_t num_queries, int64_t h_begin, int64_t h_end, int64_t num_q_heads, int64_t num_kv_heads,
    const int64_t head_dim, int64_t block_size, int64_t window, float scale, float *scores, float *qs, float *acc,
    const int bf16) {
    const int64_t group = num_q_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    const int64_t first_q = h_begin * group, task_q = (h_end - h_begin) * group, num_q = num_queries * task_q;
    const int64_t task_floats = (h_end - h_begin) * head_dim, head_offset = h_begin * head_dim;
    const int dp = HAVE_DPBF16 && bf16 && head_dim % (2 * LANES) == 0;
    const float score_scale = dp ? scale : 1.0f; /* without dp the scale is in qs */
    /* Row j is query token j / task_q (of num_queries) and the task's query head j % task_q. */
#define Q_ROW(j) ((((j) / task_q) * num_q_heads + first_q + (j) % task_q) * head_dim)
#define KV_HEAD(j) (((j) % task_q / group) * head_dim)
    if (!dp)
        for (int64_t j = 0; j < num_q; j++)
            for (int64_t d = 0; d < head_dim; d++)
                qs[j * head_dim + d] = scale * (bf16 ? bf16_to_float(((const uint16_t *)q)[Q_ROW(j) + d])
                                                    : ((const float *)q)[Q_ROW(j) + d]);

    /* Pass 1: scores[j * len + position] = q_j · k_position (scaled), a block at a time, row by row, 16 positions
     * at a time (their sums finished together by fold16): each row's scores are written in order, and the
     * block's keys stay in the L1 for the next row. */
    for (int64_t i = 0; i < num_blocks; i++) {
        const int64_t keys = block_at(table, i, block_stride, head_offset);
        const int64_t n = tokens_in_block(len, i, block_size);
        for (int64_t j = 0; j < num_q; j++) {
            const int64_t k = keys + KV_HEAD(j);
            const float *qf = qs + j * head_dim;
            const uint16_t *qb = (const uint16_t *)q + Q_ROW(j); /* read only with dp, where q is bf16 */
            float *s = scores + j * len + i * block_size;
            int64_t t = 0;
            for (; t + LANES <= n; t += LANES) {
                vfloat dots[LANES];
#pragma GCC unroll 16
                for (int64_t u = 0; u < LANES; u++) {
                    if (j == 0) /* the first row's walk over the block brings the slots in for the others */
                        prefetch_position(key_cache, table, i * block_size + t + u + AHEAD, len, block_size,
                                          block_stride, token_stride, head_offset, task_floats, bf16);
                    dots[u] = dot_key(qf, qb, key_cache, k + (t + u) * token_stride, head_dim, bf16, dp);
                }
                store(s + t, fold16(dots) * score_scale);
            }
            for (; t < n; t++) {
                if (j == 0)
                    prefetch_position(key_cache, table, i * block_size + t + AHEAD, len, block_size, block_stride,
                                      token_stride, head_offset, task_floats, bf16);
                s[t] = lane_sum(dot_key(qf, qb, key_cache, k + t * token_stride, head_dim, bf16, dp)) * score_scale;
            }
        }
    }
    for (int64_t p = 0; p < AHEAD; p++) /* the first values, during the softmax */
        prefetch_position(value_cache, table, p, len, block_size, block_stride, token_stride, head_offset, task_floats,
                          bf16);

    /* Softmax numerators in place, and 1 / their sum, per query row: query token r sees the first
     * len - (num_queries - 1 - r) positions (the causal mask), or with a window only the last `window` of them;
     * the positions outside get weight 0. */
    float inv_sums[num_q];
    for (int64_t j = 0; j < num_q; j++) {
        float *s = scores + j * len, max = -INFINITY, sum = 0.0f;
        const int64_t row_len = len - (num_queries - 1 - j / task_q);
        const int64_t row_start = window > 0 && row_len > window ? row_len - window : 0;
        for (int64_t p = 0; p < row_start; p++) s[p] = 0.0f;
        for (int64_t p = row_len; p < len; p++) s[p] = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t p = row_start; p < row_len; p++) max = s[p] > max ? s[p] : max;
        vfloat sums = {0};
        int64_t p = row_start;
        for (; p + LANES <= row_len; p += LANES) {
            const vfloat e = exp_nonpositive(load(s + p) - max);
            store(s + p, e);
            sums += e;
        }
        if (p < row_len) { /* the last, partial vector */
            vfloat x = {0};
            for (int64_t t = 0; t < row_len - p; t++) x[t] = s[p + t] - max;
            const vfloat e = exp_nonpositive(x);
            for (int64_t t = 0; t < row_len - p; t++) {
                s[p + t] = e[t];
                sum += e[t];
            }
        }
        inv_sums[j] = 1.0f / (sum + lane_sum(sums));
    }

    /* Pass 2: acc_j = sum over positions of p_j(position) · v_position. Each value is loaded (and widened) once
     * for up to MAX_ROWS of the rows that read its head (a query group, and a verify's tokens), their running sums
     * held in registers over the block. */
    const int64_t max_rows = head_dim <= 64 ? MAX_ROWS : head_dim <= 128 ? 2 : 1, head_rows = num_queries * group;
    for (int64_t j = 0; j < num_q * head_dim; j++) acc[j] = 0.0f;
    for (int64_t i = 0; i < num_blocks; i++) {
        const int64_t n = tokens_in_block(len, i, block_size);
        for (int64_t h = 0; h < h_end - h_begin; h++) {
            const int64_t v = block_at(table, i, block_stride, head_offset) + h * head_dim;
            for (int64_t r0 = 0; r0 < head_rows; r0 += max_rows) {
                const int64_t m = head_rows - r0 < max_rows ? head_rows - r0 : max_rows;
                const float *p[MAX_ROWS];
                float *a_out[MAX_ROWS];
                vfloat a[MAX_ROWS][MAX_HEAD_DIM / LANES];
                for (int64_t x = 0; x < m; x++) { /* row r of head h: query token r / group, its group's r % group */
                    const int64_t r = r0 + x, j = (r / group) * task_q + h * group + r % group;
                    p[x] = scores + j * len + i * block_size;
                    a_out[x] = acc + j * head_dim;
                    for (int64_t c = 0; c < head_dim / LANES; c++) a[x][c] = load(a_out[x] + c * LANES);
                }
                for (int64_t t = 0; t < n; t++) {
                    if (h == 0 && r0 == 0) /* the first walk over the block brings the slots in for the others */
                        prefetch_position(value_cache, table, i * block_size + t + AHEAD, len, block_size,
                                          block_stride, token_stride, head_offset, task_floats, bf16);
                    vfloat val[MAX_HEAD_DIM / LANES];
                    for (int64_t c = 0; c < head_dim / LANES; c++)
                        val[c] = load_kv(value_cache, v + t * token_stride + c * LANES, bf16);
                    for (int64_t x = 0; x < MAX_ROWS; x++)
                        if (x < m)
                            for (int64_t c = 0; c < head_dim / LANES; c++) a[x][c] += p[x][t] * val[c];
                }
                for (int64_t x = 0; x < m; x++)
                    for (int64_t c = 0; c < head_dim / LANES; c++) store(a_out[x] + c * LANES, a[x][c]);
            }
        }
    }
    for (int64_t j = 0; j < num_q; j++)
        for (int64_t d = 0; d < head_dim; d++) {
            const float o = acc[j * head_dim + d] * inv_sums[j];
            if (bf16)
                ((uint16_t *)out)[Q_ROW(j) + d] = float_to_bf16(o);
            else
                ((float *)out)[Q_ROW(j) + d] = o;
        }
#undef Q_ROW
#undef KV_HEAD
}

/* Every task of a call, dealt over the cores; `bf16` (a constant in each entry point below) says the cache's type. */
static inline __attribute__((always_inline)) void decode(
    const void *q, const void *key_cache, const void *value_cache, const int64_t *block_tables,
    const int64_t *seq_lens, void *out, int64_t num_seqs, int64_t num_queries, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window, float scale,
    const int bf16) {
    /* Whole sequences per task when there are at least two per core; else one K/V head per task. */
    const int64_t heads_per_task = num_seqs >= 2 * omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task, group = num_q_heads / num_kv_heads;
    const int64_t task_q_heads = heads_per_task * group * num_queries; /* rows of one task */
#pragma omp parallel
    {
        float *workspace = malloc(sizeof(float) * task_q_heads * (max_blocks * block_size + 2 * head_dim));
        float *scores = workspace, *qs = scores + task_q_heads * max_blocks * block_size;
        float *acc = qs + task_q_heads * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
            const int64_t b = task / tasks_per_seq, h_begin = (task % tasks_per_seq) * heads_per_task;
            const int64_t h_end = h_begin + heads_per_task, len = seq_lens[b];
            const int64_t *table = block_tables + b * max_blocks;
            const void *qb = (const char *)q + b * num_queries * num_q_heads * head_dim * (bf16 ? 2 : 4);
            void *ob = (char *)out + b * num_queries * num_q_heads * head_dim * (bf16 ? 2 : 4);
            if (head_dim == 64)
                attend_task(qb, key_cache, value_cache, table, len, ob, num_queries, h_begin, h_end, num_q_heads,
                            num_kv_heads, 64, block_size, window, scale, scores, qs, acc, bf16);
            else if (head_dim == 128)
                attend_task(qb, key_cache, value_cache, table, len, ob, num_queries, h_begin, h_end, num_q_heads,
                            num_kv_heads, 128, block_size, window, scale, scores, qs, acc, bf16);
            else
                attend_task(qb, key_cache, value_cache, table, len, ob, num_queries, h_begin, h_end, num_q_heads,
                            num_kv_heads, head_dim, block_size, window, scale, scores, qs, acc, bf16);
        }
        free(workspace);
    }
}

void paged_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                            int64_t num_queries, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t max_blocks, int64_t window, float scale) {
    decode(q, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_queries, num_q_heads, num_kv_heads,
           head_dim, block_size, max_blocks, window, scale, 0);
}

void paged_decode_attention_bf16(const uint16_t *q, const uint16_t *key_cache, const uint16_t *value_cache,
                                 const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int64_t num_seqs,
                                 int64_t num_queries, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, int64_t max_blocks, int64_t window, float scale) {
    decode(q, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_queries, num_q_heads, num_kv_heads,
           head_dim, block_size, max_blocks, window, scale, 1);
}
