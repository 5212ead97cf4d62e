/* Paged decode attention on the CPU: one query per sequence, read from the paged KV cache in place.
 *
 * Chapter 6's algorithm, written for a CPU core instead of a GPU program. A task is one (sequence, K/V head)
 * pair: it holds the query rows of that K/V head's group, walks the sequence's block table one block at a time
 * (prefetching the next block while it uses this one), and folds each block into a running (max, sum, weighted
 * values) per query head with the online softmax. Every key and value is read once, from where it lies, and
 * only up to the sequence's own length. OpenMP deals the tasks over the cores (torch's OpenMP runtime: the
 * library binds to the one torch loaded). Measured on a 2-core AMD EPYC: tasks of one K/V head ran faster than
 * tasks of all a sequence's heads, and the C library's expf, called once per score, cost more than the rest.
 *
 * Layouts (fp32, contiguous): q, out (B, Hq, D); key_cache, value_cache (num_blocks, block_size, Hkv, D);
 * block_tables (B, max_blocks) int64; seq_lens (B,) int64. Query head h reads K/V head h / (Hq / Hkv).
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 64 /* query heads per K/V head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64
#define CACHE_LINE_FLOATS 16

/* e^x for x <= 0 in single precision (about 2 ulp), written so that a loop over it vectorises: x = n·ln 2 + r with
 * |r| <= ln 2 / 2, e^r by its degree-6 Taylor polynomial, 2^n by building the float's exponent bits. The C
 * library's expf is exact but opaque to the vectoriser, and one call per score was the kernel's largest cost. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* below this e^x is under float's smallest normal: ~0 (and -inf becomes ~0) */
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* ln 2 in two parts, for an exact subtraction */
    float poly = 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    union { float f; int32_t i; } two_n = {.i = ((int32_t)n + 127) << 23};
    return poly * two_n.f;
}

static void prefetch_block(const float *first, int64_t tokens, int64_t token_stride, int64_t floats) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t f = 0; f < floats; f += CACHE_LINE_FLOATS) __builtin_prefetch(first + t * token_stride + f);
}

/* One task: sequence b, K/V head h and its group of query heads. Inlined with head_dim a constant (64, 128)
 * where it can be, so the loops over it unroll and a head's running sums stay in registers. */
static inline __attribute__((always_inline)) void attend_task(
    const float *q, const float *key_cache, const float *value_cache, const int64_t *table, int64_t len, float *out,
    int64_t b, int64_t h, int64_t group, int64_t num_q_heads, int64_t num_kv_heads,
    const int64_t head_dim, int64_t block_size, float scale) {
    const int64_t token_stride = num_kv_heads * head_dim; /* floats from one slot of a block to the next */
    float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK_SIZE];
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + (b * num_q_heads + h * group + j) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) {
            qs[j][d] = qj[d] * scale;
            acc[j][d] = 0.0f;
        }
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t i = 0; i * block_size < len; i++) {
        const int64_t n = len - i * block_size < block_size ? len - i * block_size : block_size;
        const int64_t base = table[i] * block_size * token_stride + h * head_dim;
        const float *keys = key_cache + base, *values = value_cache + base;
        if ((i + 1) * block_size < len) { /* the next block, while this one is used */
            const int64_t next = table[i + 1] * block_size * token_stride + h * head_dim;
            prefetch_block(key_cache + next, block_size, token_stride, head_dim);
            prefetch_block(value_cache + next, block_size, token_stride, head_dim);
        }
        for (int64_t t = 0; t < n; t++) { /* scores of this block's tokens, for every query head */
            const float *k = keys + t * token_stride;
            for (int64_t j = 0; j < group; j++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qs[j][d] * k[d];
                s[j][t] = dot;
            }
        }
        for (int64_t j = 0; j < group; j++) { /* online softmax, then this block's values into the sums */
            float block_max = m[j];
            for (int64_t t = 0; t < n; t++) block_max = s[j][t] > block_max ? s[j][t] : block_max;
            const float correction = exp_nonpositive(m[j] - block_max); /* ~0 on the first block (m = -inf) */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                s[j][t] = exp_nonpositive(s[j][t] - block_max);
                sum += s[j][t];
            }
            l[j] = l[j] * correction + sum;
            m[j] = block_max;
            float a[MAX_HEAD_DIM]; /* registers, when head_dim is a constant */
            for (int64_t d = 0; d < head_dim; d++) a[d] = acc[j][d] * correction;
            for (int64_t t = 0; t < n; t++) {
                const float p = s[j][t];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * values[t * token_stride + d];
            }
            for (int64_t d = 0; d < head_dim; d++) acc[j][d] = a[d];
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *oj = out + (b * num_q_heads + h * group + j) * head_dim;
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) oj[d] = acc[j][d] * inv;
    }
}

void paged_decode_attention(const float *q, const float *key_cache, const float *value_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t num_seqs,
                            int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t max_blocks, float scale) {
    const int64_t group = num_q_heads / num_kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t *table = block_tables + b * max_blocks;
            if (head_dim == 64)
                attend_task(q, key_cache, value_cache, table, seq_lens[b], out, b, h, group, num_q_heads, num_kv_heads,
                            64, block_size, scale);
            else if (head_dim == 128)
                attend_task(q, key_cache, value_cache, table, seq_lens[b], out, b, h, group, num_q_heads, num_kv_heads,
                            128, block_size, scale);
            else
                attend_task(q, key_cache, value_cache, table, seq_lens[b], out, b, h, group, num_q_heads, num_kv_heads,
                            head_dim, block_size, scale);
        }
    }
}
