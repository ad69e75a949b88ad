/* Batched decode attention read straight from the paged KV pool: one new query token per
 * sequence, every key of its context visible, sequences of different lengths in one call, no
 * gather copy of K/V (see paged_decode.py for the Python side and the shapes).
 *
 * Pool of one layer, K and V each: [capacity, page_size, kv_heads, head_dim] contiguous, fp32
 * or bf16; token p of sequence s sits in page table[s][p / page_size], slot p % page_size.
 * q, out: [num_seqs, heads, head_dim] fp32 contiguous; query head h reads K/V head
 * h / (heads / kv_heads) (grouped heads as they are, never repeated).
 *
 * Several query rows per sequence (a speculative verify's rows: `rows` R, the same for every
 * sequence of a call) share one read of its pages: q, out are then [num_seqs, kv_heads, R,
 * group, head_dim], a sequence's rows the extra query heads of each K/V head's group (R x
 * group of them, scored against each K row at once), and row r sees positions 0 .. ctx - R + r
 * (its causal rule): the keys past a query's last position score -inf, which only touches the
 * chunk(s) holding the last R - 1 positions; a chunk where a query sees no key gives it max
 * -inf, sum 0, nothing to the merge. R = 1 is the plain decode step.
 *
 * A sequence's context is cut into chunks of whole pages, so that a few long sequences (batch
 * 1) keep every thread busy as well as many; a task is one (sequence, chunk), its K/V heads in
 * turn (the chunk's pages read front to back, each K/V row once for all the query heads of its
 * group): scores against every key of the chunk (one K read), their max, exp and sum, then the
 * weighted V sum (one V read), unnormalized, into a part per (chunk, query head); the thread
 * that ends a sequence's last chunk merges its parts by their maxima (log-sum-exp) and divides
 * by the sum. Decode attention reads ~all of the KV once per step, so it is bound by memory:
 * the vector builds ask for the next page's K rows and the chunk's V rows (prefetch to L2)
 * while the present K rows are scored.
 *
 * Three builds of the chunk kernel, chosen at run time by the CPU: AVX-512 (a 64-wide head in
 * four zmm registers, four keys scored per reduction, the V sum of up to 6 query heads in one
 * pass), AVX2+FMA (the V sum 16 columns per pass, the chunk's V rows read again from L1/L2),
 * and a portable one (its inner loops compiled for AVX-512, AVX2 and a baseline by gcc
 * target_clones). bf16 rows are widened exactly by a 16-bit shift. The vector builds take
 * head_dim % 16 == 0, head_dim <= 256 and at most 12 queries (heads x rows) per K/V head;
 * other shapes run the portable one. use_isa() caps the choice so that tests run every build
 * on one machine. The GIL is released; tasks are split over `threads` OpenMP threads (dynamic,
 * one at a time).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64 /* query heads x rows per K/V head */
#define FAST_GROUP 12 /* queries (heads x rows) per K/V head the vector builds hold */
#define FAST_DIM 256  /* longest head the vector builds take */
/* the chunk length chosen when the caller leaves it (chunk_pages 0): whole pages, at most
 * CHUNK_TOKENS tokens (a chunk's V rows of one head stay in L2 until its V pass, its scores in
 * L1) and at least TASKS_PER_THREAD tasks per thread where the pages allow */
#ifndef CHUNK_TOKENS
#define CHUNK_TOKENS 256
#endif
#define TASKS_PER_THREAD 8

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#else
#define HAVE_X86 0
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL
#endif

typedef struct {
    float *out;
    const float *q;
    const char *k, *v;           /* pool bases, bytes */
    const int64_t *tables;       /* flat page ids of every sequence */
    const int64_t *table_starts; /* [num_seqs] offset of sequence s's table in `tables` */
    const int64_t *ctx_lens;     /* [num_seqs] */
    int64_t num_seqs, heads, kv_heads, dim, page; /* heads: query heads x rows */
    int64_t rows;                                 /* query rows per sequence (R) */
    int bf16;
    float scale;
    int failed;
} Job;

/* one chunk's result for the G query heads of one K/V head: o [G, dim] the unnormalized sum of
 * e^(score - max) * v, max [G] and sum [G] of e^(score - max) */
typedef struct {
    float *o, *max, *sum;
} Part;

/* attention of sequence s's query group of K/V head kvh over positions [p0, p1) (p0 a page
 * start); scores: [group, p1 - p0] scratch, row: [dim] scratch */
typedef void (*ChunkFn)(const Job *j, int64_t s, int64_t kvh, int64_t p0, int64_t p1,
                        float *scores, float *row, Part part);

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* one K or V row [dim] as fp32 into dst */
KERNEL static void load_row(float *dst, const char *src, int64_t dim, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < dim; i++)
            dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)dim * 4);
    }
}

/* 16 partial sums so the compiler keeps them in one vector register */
KERNEL static float dot(const float *a, const float *b, int64_t dim) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16)
        for (int j = 0; j < 16; j++)
            acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < dim; i++)
        s += a[i] * b[i];
    for (int j = 0; j < 16; j++)
        s += acc[j];
    return s;
}

KERNEL static void axpy(float *y, float a, const float *x, int64_t dim) {
    for (int64_t i = 0; i < dim; i++)
        y[i] += a * x[i];
}

KERNEL static float exp_shift(float *s, int64_t n, float max) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}

/* the verify's causal rule on a chunk's scores [G, p1 - p0] (G = rows x group queries, row
 * major): query g, row g / group of its sequence's R, sees positions < ctx - R + 1 + row; the
 * keys past that score -inf and its max [G] is taken again over the rest (-inf where none is
 * left). Only a chunk holding one of the last R - 1 positions has anything to mask. */
static void mask_rows(const Job *j, int64_t s, int64_t p0, int64_t p1, int64_t G, float *scores,
                      float *max) {
    int64_t n = p1 - p0, group = G / j->rows, seen = j->ctx_lens[s] - j->rows + 1; /* row 0 */
    for (int64_t g = 0; g < G && seen + g / group < p1; g++) {
        int64_t keep = seen + g / group - p0; /* scores kept: [0, keep) */
        float *x = scores + g * n, m = -INFINITY;
        keep = keep > 0 ? keep : 0;
        for (int64_t i = 0; i < keep; i++)
            m = x[i] > m ? x[i] : m;
        for (int64_t i = keep; i < n; i++)
            x[i] = -INFINITY;
        max[g] = m;
    }
}

/* the shift of a query's scores before their exp: its max, 0 where every key is masked (max
 * -inf: e^(-inf - 0) = 0, a sum of 0, where -inf - -inf would be NaN) */
static inline float shift_of(float max) { return max > -INFINITY ? max : 0.0f; }

static const char *row_at(const Job *j, const char *pool, const int64_t *table, int64_t p,
                          int64_t kvh) {
    int64_t elem = j->bf16 ? 2 : 4;
    int64_t slot = table[p / j->page] * j->page + p % j->page;
    return pool + ((slot * j->kv_heads + kvh) * j->dim) * elem;
}

/* the portable chunk kernel (any shape) */
static void chunk_portable(const Job *j, int64_t s, int64_t kvh, int64_t p0, int64_t p1,
                           float *scores, float *row, Part part) {
    int64_t group = j->heads / j->kv_heads, n = p1 - p0, dim = j->dim;
    const int64_t *table = j->tables + j->table_starts[s];
    const float *q = j->q + (s * j->heads + kvh * group) * dim; /* [group, dim] */
    for (int64_t g = 0; g < group; g++)
        part.max[g] = -INFINITY;
    for (int64_t p = p0; p < p1; p++) {
        load_row(row, row_at(j, j->k, table, p, kvh), dim, j->bf16);
        for (int64_t g = 0; g < group; g++) {
            float x = dot(q + g * dim, row, dim) * j->scale;
            scores[g * n + p - p0] = x;
            part.max[g] = x > part.max[g] ? x : part.max[g];
        }
    }
    if (j->rows > 1 && p1 > j->ctx_lens[s] - j->rows + 1)
        mask_rows(j, s, p0, p1, group, scores, part.max);
    for (int64_t g = 0; g < group; g++) {
        part.sum[g] = exp_shift(scores + g * n, n, shift_of(part.max[g]));
        memset(part.o + g * dim, 0, (size_t)dim * 4);
    }
    for (int64_t p = p0; p < p1; p++) {
        load_row(row, row_at(j, j->v, table, p, kvh), dim, j->bf16);
        for (int64_t g = 0; g < group; g++)
            axpy(part.o + g * dim, scores[g * n + p - p0], row, dim);
    }
}

#if HAVE_X86
#include "_vec_exp.h" /* exp8 / exp16: e^x of scores less their max */

/* a row's cache lines towards L2 (hint T1): the next page's K rows and the chunk's V rows are
 * on their way while the present K rows are scored */
static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch(row + b, _MM_HINT_T1);
}

AVX2 static inline __m256 kv8(const char *row, int64_t i, int bf16) {
    if (bf16) { /* exact widening of 8 bf16 values */
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}


/* s[i] = e^(s[i] - max), returns the sum */
AVX2 static float exp_shift_avx2(float *s, int64_t n, float max) {
    __m256 m = _mm256_set1_ps(max), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    return sum;
}

/* the chunk kernel for G query heads per K/V head (a constant, so every running sum stays in
 * a register), BF16 a constant too: pages walked in order (no division per key), K/V rows read
 * in place; the V sum runs over 16 columns of the head at a time (G x 2 sums in registers; past
 * G 7 some live in L1, still well ahead of the portable kernel),
 * the chunk's V rows coming back from L1/L2 for the later columns.
 * dim % 16 == 0, dim <= FAST_DIM */
#define TASK2(NAME, G, BF16)                                                                    \
    AVX2 static void NAME(const Job *j, int64_t s, int64_t kvh, int64_t p0, int64_t p1,         \
                          float *scores, float *unused, Part part) {                            \
        int64_t n = p1 - p0, dim = j->dim, page = j->page;                                      \
        int64_t elem = BF16 ? 2 : 4, stride = j->kv_heads * dim * elem, bytes = dim * elem;     \
        const int64_t *table = j->tables + j->table_starts[s];                                  \
        const float *q = j->q + (s * j->heads + kvh * G) * dim; /* [G, dim] */                  \
        float max[G];                                                                           \
        (void)unused;                                                                           \
        for (int g = 0; g < G; g++)                                                             \
            max[g] = -INFINITY;                                                                 \
        for (int64_t pp = p0; pp < p1; pp += page) {                                            \
            int64_t at = (table[pp / page] * page * j->kv_heads + kvh) * dim * elem;            \
            const char *row = j->k + at, *vrow = j->v + at, *next = NULL;                       \
            if (pp + page < j->ctx_lens[s]) /* the next page, in this chunk or the next */      \
                next = j->k + (table[pp / page + 1] * page * j->kv_heads + kvh) * dim * elem;   \
            int64_t m = p1 - pp < page ? p1 - pp : page;                                        \
            for (int64_t o = 0; o < m; o++, row += stride, vrow += stride) {                    \
                if (next)                                                                       \
                    prefetch_row(next + o * stride, bytes);                                     \
                prefetch_row(vrow, bytes);                                                      \
                __m256 acc[G];                                                                  \
                for (int g = 0; g < G; g++)                                                     \
                    acc[g] = _mm256_setzero_ps();                                               \
                for (int64_t i = 0; i < dim; i += 8) {                                          \
                    __m256 kv = kv8(row, i, BF16);                                              \
                    for (int g = 0; g < G; g++)                                                 \
                        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + i), kv, acc[g]); \
                }                                                                               \
                for (int g = 0; g < G; g++) {                                                   \
                    float x = hsum(acc[g]) * j->scale;                                          \
                    scores[g * n + pp - p0 + o] = x;                                            \
                    max[g] = x > max[g] ? x : max[g];                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        if (j->rows > 1 && p1 > j->ctx_lens[s] - j->rows + 1)                                   \
            mask_rows(j, s, p0, p1, G, scores, max);                                            \
        for (int g = 0; g < G; g++) {                                                           \
            part.max[g] = max[g];                                                               \
            part.sum[g] = exp_shift_avx2(scores + g * n, n, shift_of(max[g]));                  \
        }                                                                                       \
        for (int64_t c = 0; c < dim; c += 16) {                                                 \
            __m256 lo[G], hi[G];                                                                \
            for (int g = 0; g < G; g++)                                                         \
                lo[g] = hi[g] = _mm256_setzero_ps();                                            \
            for (int64_t pp = p0; pp < p1; pp += page) {                                        \
                const char *row =                                                               \
                    j->v + (table[pp / page] * page * j->kv_heads + kvh) * dim * elem;          \
                int64_t m = p1 - pp < page ? p1 - pp : page;                                    \
                for (int64_t o = 0; o < m; o++, row += stride) {                                \
                    __m256 a = kv8(row, c, BF16), b = kv8(row, c + 8, BF16);                    \
                    for (int g = 0; g < G; g++) {                                               \
                        __m256 w = _mm256_broadcast_ss(scores + g * n + pp - p0 + o);           \
                        lo[g] = _mm256_fmadd_ps(w, a, lo[g]);                                   \
                        hi[g] = _mm256_fmadd_ps(w, b, hi[g]);                                   \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int g = 0; g < G; g++) {                                                       \
                _mm256_storeu_ps(part.o + g * dim + c, lo[g]);                                  \
                _mm256_storeu_ps(part.o + g * dim + c + 8, hi[g]);                              \
            }                                                                                   \
        }                                                                                       \
    }

AVX512 static inline __m512 kv16(const char *row, int64_t i, int bf16) {
    if (bf16) { /* exact widening of 16 bf16 values */
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}


/* s[i] = e^(s[i] - max), returns the sum; the tail under a mask */
AVX512 static float exp_shift_avx512(float *s, int64_t n, float max) {
    __m512 m = _mm512_set1_ps(max), acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), m));
        _mm512_mask_storeu_ps(s + i, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(acc);
}

/* the sums of a0 .. a3, in lanes 0 .. 3: pairs interleaved and added within each 128-bit lane,
 * then the four lanes added (a few shuffles for four sums, where one sum alone takes as many) */
AVX512 static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 x = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xee));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* scores of TK keys (1 or 4) from `row` on (their V rows and the next page's K rows asked for
 * on the way), G query heads each; in TASK512's scope */
#define SCORE512(G, BF16, TK)                                                                   \
    do {                                                                                        \
        __m512 acc[TK][G];                                                                      \
        for (int t = 0; t < TK; t++) {                                                          \
            if (next)                                                                           \
                prefetch_row(next + (o + t) * stride, bytes);                                   \
            prefetch_row(vrow + t * stride, bytes);                                             \
            for (int g = 0; g < G; g++)                                                         \
                acc[t][g] = _mm512_setzero_ps();                                                \
        }                                                                                       \
        for (int64_t i = 0; i < dim; i += 16)                                                   \
            for (int t = 0; t < TK; t++) {                                                      \
                __m512 kv = kv16(row + t * stride, i, BF16);                                    \
                for (int g = 0; g < G; g++)                                                     \
                    acc[t][g] =                                                                 \
                        _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + i), kv, acc[t][g]);       \
            }                                                                                   \
        for (int g = 0; g < G; g++) {                                                           \
            float *at = scores + g * n + pp - p0 + o;                                           \
            if (TK == 4) {                                                                      \
                __m128 x = _mm_mul_ps(                                                          \
                    reduce4(acc[0][g], acc[TK / 4][g], acc[2 * TK / 4][g], acc[3 * TK / 4][g]), \
                    scale4);                                                                    \
                _mm_storeu_ps(at, x);                                                           \
                max4[g] = _mm_max_ps(max4[g], x);                                               \
            } else {                                                                            \
                float x = _mm512_reduce_add_ps(acc[0][g]) * j->scale;                           \
                *at = x;                                                                        \
                max[g] = x > max[g] ? x : max[g];                                               \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* zmm registers per query head in the V pass: G x W sums and W rows stay in registers */
#define W512(G) ((G) <= 6 ? 4 : 2)

/* the AVX-512 chunk kernel, as TASK2 with 16-wide vectors: a 64-wide head is four zmm
 * registers, scored in one pass, and summed in one V pass for up to 6 query heads (wider heads
 * or larger groups take 64 or 32 columns per V pass) */
#define TASK512(NAME, G, BF16)                                                                  \
    AVX512 static void NAME(const Job *j, int64_t s, int64_t kvh, int64_t p0, int64_t p1,       \
                            float *scores, float *unused, Part part) {                          \
        int64_t n = p1 - p0, dim = j->dim, page = j->page;                                      \
        int64_t elem = BF16 ? 2 : 4, stride = j->kv_heads * dim * elem, bytes = dim * elem;     \
        const int64_t *table = j->tables + j->table_starts[s];                                  \
        const float *q = j->q + (s * j->heads + kvh * G) * dim; /* [G, dim] */                  \
        float max[G];                                                                           \
        __m128 max4[G], scale4 = _mm_set1_ps(j->scale);                                         \
        (void)unused;                                                                           \
        for (int g = 0; g < G; g++) {                                                           \
            max[g] = -INFINITY;                                                                 \
            max4[g] = _mm_set1_ps(-INFINITY);                                                   \
        }                                                                                       \
        for (int64_t pp = p0; pp < p1; pp += page) {                                            \
            int64_t at = (table[pp / page] * page * j->kv_heads + kvh) * dim * elem;            \
            const char *row = j->k + at, *vrow = j->v + at, *next = NULL;                       \
            if (pp + page < j->ctx_lens[s]) /* the next page, in this chunk or the next */      \
                next = j->k + (table[pp / page + 1] * page * j->kv_heads + kvh) * dim * elem;   \
            int64_t m = p1 - pp < page ? p1 - pp : page;                                        \
            int64_t o = 0;                                                                      \
            if (G <= 6) /* four keys at a time: one reduction of their sums for four scores */  \
                for (; o + 4 <= m; o += 4, row += 4 * stride, vrow += 4 * stride)               \
                    SCORE512(G, BF16, 4);                                                       \
            for (; o < m; o++, row += stride, vrow += stride)                                   \
                SCORE512(G, BF16, 1);                                                           \
        }                                                                                       \
        for (int g = 0; g < G; g++) {                                                           \
            __m128 v = _mm_max_ps(max4[g], _mm_movehl_ps(max4[g], max4[g]));                    \
            v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));                                         \
            max[g] = _mm_cvtss_f32(v) > max[g] ? _mm_cvtss_f32(v) : max[g];                     \
        }                                                                                       \
        if (j->rows > 1 && p1 > j->ctx_lens[s] - j->rows + 1)                                   \
            mask_rows(j, s, p0, p1, G, scores, max);                                            \
        for (int g = 0; g < G; g++) {                                                           \
            part.max[g] = max[g];                                                               \
            part.sum[g] = exp_shift_avx512(scores + g * n, n, shift_of(max[g]));                \
        }                                                                                       \
        enum { W = W512(G) };                                                                   \
        for (int64_t c = 0; c < dim; c += 16 * W) {                                             \
            int64_t cols = (dim - c) / 16 < W ? (dim - c) / 16 : W; /* zmm this pass */        \
            __m512 acc[G][W];                                                                   \
            for (int g = 0; g < G; g++)                                                         \
                for (int w = 0; w < W; w++)                                                     \
                    acc[g][w] = _mm512_setzero_ps();                                            \
            for (int64_t pp = p0; pp < p1; pp += page) {                                        \
                const char *row =                                                               \
                    j->v + (table[pp / page] * page * j->kv_heads + kvh) * dim * elem;          \
                int64_t m = p1 - pp < page ? p1 - pp : page;                                    \
                for (int64_t o = 0; o < m; o++, row += stride) {                                \
                    __m512 a[W];                                                                \
                    for (int w = 0; w < W; w++)                                                 \
                        a[w] = w < cols ? kv16(row, c + 16 * w, BF16) : _mm512_setzero_ps();    \
                    for (int g = 0; g < G; g++) {                                               \
                        __m512 x = _mm512_set1_ps(scores[g * n + pp - p0 + o]);                 \
                        for (int w = 0; w < W; w++)                                             \
                            acc[g][w] = _mm512_fmadd_ps(x, a[w], acc[g][w]);                    \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int g = 0; g < G; g++)                                                         \
                for (int w = 0; w < cols; w++)                                                  \
                    _mm512_storeu_ps(part.o + g * dim + c + 16 * w, acc[g][w]);                 \
        }                                                                                       \
    }

#define TASKS_OF(G)                                                                             \
    TASK2(avx2_f32_##G, G, 0)                                                                   \
    TASK2(avx2_bf16_##G, G, 1)                                                                  \
    TASK512(avx512_f32_##G, G, 0)                                                               \
    TASK512(avx512_bf16_##G, G, 1)
TASKS_OF(1)
TASKS_OF(2)
TASKS_OF(3)
TASKS_OF(4)
TASKS_OF(5)
TASKS_OF(6)
TASKS_OF(7)
TASKS_OF(8)
TASKS_OF(9)
TASKS_OF(10)
TASKS_OF(11)
TASKS_OF(12)

/* [bf16][query heads per K/V head - 1] */
#define GROUPS(P)                                                                              \
    {P##_1, P##_2, P##_3, P##_4, P##_5, P##_6, P##_7, P##_8, P##_9, P##_10, P##_11, P##_12}
static const ChunkFn AVX2_TASKS[2][FAST_GROUP] = {GROUPS(avx2_f32), GROUPS(avx2_bf16)};
static const ChunkFn AVX512_TASKS[2][FAST_GROUP] = {GROUPS(avx512_f32), GROUPS(avx512_bf16)};
#endif

enum { ISA_PORTABLE, ISA_AVX2, ISA_AVX512 };
static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512"};
static int isa_cap = ISA_AVX512; /* lowered by use_isa(): tests run every build on one CPU */

static int cpu_isa(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return ISA_PORTABLE;
    return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
#else
    return ISA_PORTABLE;
#endif
}

static int chosen_isa(void) {
    int cpu = cpu_isa();
    return cpu < isa_cap ? cpu : isa_cap;
}

/* the build the chunk kernel runs for `queries` per K/V head (heads x rows) of width dim: the
 * chosen one where the vector builds take the shape, else portable */
static int build_for(int64_t queries, int64_t dim) {
    int isa = chosen_isa();
    return dim % 16 || dim > FAST_DIM || queries > FAST_GROUP ? ISA_PORTABLE : isa;
}

/* the chunk kernel for this job's shape on the chosen build */
static ChunkFn chunk_fn(const Job *j) {
    int64_t group = j->heads / j->kv_heads;
    int isa = build_for(group, j->dim);
    if (isa == ISA_PORTABLE)
        return chunk_portable;
#if HAVE_X86
    return (isa == ISA_AVX512 ? AVX512_TASKS : AVX2_TASKS)[j->bf16 != 0][group - 1];
#else
    return chunk_portable;
#endif
}

/* chunk length in tokens: chunk_pages pages, or where that is 0 the longest (at most
 * CHUNK_TOKENS, at least a page) that still gives every thread TASKS_PER_THREAD tasks */
static int64_t chunk_len(const Job *j, int64_t chunk_pages, int threads) {
    if (chunk_pages > 0)
        return chunk_pages * j->page;
    int64_t pages = 0, most = CHUNK_TOKENS / j->page;
    for (int64_t s = 0; s < j->num_seqs; s++)
        pages += (j->ctx_lens[s] + j->page - 1) / j->page;
    int64_t n = pages / ((int64_t)TASKS_PER_THREAD * threads);
    n = n < most ? n : most;
    return (n < 1 ? 1 : n) * j->page;
}

/* out[s, h] from its chunks' parts: each chunk's sums scaled by e^(its max - the max of all),
 * divided by the total sum */
static void merge(const Job *j, int64_t s, int64_t h, int64_t first, int64_t last,
                  const float *po, const float *pm, const float *pl) {
    int64_t dim = j->dim, heads = j->heads;
    float *out = j->out + (s * heads + h) * dim, max = -INFINITY, sum = 0.0f;
    for (int64_t c = first; c < last; c++)
        max = pm[c * heads + h] > max ? pm[c * heads + h] : max;
    memset(out, 0, (size_t)dim * 4);
    if (max == -INFINITY) /* no key seen (a padded row before its context): zeros */
        return;
    for (int64_t c = first; c < last; c++) {
        float w = expf(pm[c * heads + h] - max);
        const float *o = po + (c * heads + h) * dim;
        sum += w * pl[c * heads + h];
        for (int64_t i = 0; i < dim; i++)
            out[i] += w * o[i];
    }
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t i = 0; i < dim; i++)
        out[i] *= inv;
}

/* the (sequence, chunk) tasks: chunk c of every sequence is task first[s] + c; the owner of
 * each task in seq_of; left [num_seqs] the chunks of each sequence not yet done (the thread
 * that ends the last one merges the sequence: no barrier between tasks and merges); parts
 * [tasks, heads, dim] and [tasks, heads] twice */
typedef struct {
    int64_t chunk, tasks;
    int64_t *first, *seq_of, *left;
    float *po, *pm, *pl;
} Plan;

static int plan(const Job *j, int64_t chunk, Plan *p) {
    p->chunk = chunk;
    p->first = malloc(sizeof(int64_t) * (size_t)(j->num_seqs + 1));
    if (!p->first)
        return 0;
    p->first[0] = 0;
    for (int64_t s = 0; s < j->num_seqs; s++)
        p->first[s + 1] = p->first[s] + (j->ctx_lens[s] + chunk - 1) / chunk;
    p->tasks = p->first[j->num_seqs];
    size_t t = (size_t)(p->tasks > 0 ? p->tasks : 1), h = (size_t)j->heads;
    p->seq_of = malloc(sizeof(int64_t) * t);
    p->left = malloc(sizeof(int64_t) * (size_t)(j->num_seqs + 1));
    p->po = malloc(sizeof(float) * t * h * (size_t)j->dim);
    p->pm = malloc(sizeof(float) * t * h);
    p->pl = malloc(sizeof(float) * t * h);
    if (!p->seq_of || !p->left || !p->po || !p->pm || !p->pl)
        return 0;
    for (int64_t s = 0; s < j->num_seqs; s++) {
        p->left[s] = p->first[s + 1] - p->first[s];
        if (!p->left[s]) /* no context, no task: zeros */
            memset(j->out + s * j->heads * j->dim, 0, sizeof(float) * (size_t)(j->heads * j->dim));
    }
    for (int64_t s = 0; s < j->num_seqs; s++)
        for (int64_t t2 = p->first[s]; t2 < p->first[s + 1]; t2++)
            p->seq_of[t2] = s;
    return 1;
}

static void unplan(Plan *p) {
    free(p->first);
    free(p->seq_of);
    free(p->left);
    free(p->po);
    free(p->pm);
    free(p->pl);
}

/* one task: chunk t of its sequence, every K/V head in turn (the chunk's pages front to back);
 * the sequence's merge after its last chunk (release/acquire: the other chunks' parts seen) */
static void run_task(const Job *j, Plan *p, ChunkFn fn, int64_t t, float *scratch) {
    int64_t s = p->seq_of[t], group = j->heads / j->kv_heads;
    int64_t p0 = (t - p->first[s]) * p->chunk, p1 = p0 + p->chunk;
    p1 = p1 < j->ctx_lens[s] ? p1 : j->ctx_lens[s];
    for (int64_t kvh = 0; kvh < j->kv_heads; kvh++) {
        int64_t h = t * j->heads + kvh * group;
        Part part = {p->po + h * j->dim, p->pm + h, p->pl + h};
        fn(j, s, kvh, p0, p1, scratch, scratch + group * p->chunk, part);
    }
    if (__atomic_sub_fetch(&p->left[s], 1, __ATOMIC_ACQ_REL) == 0)
        for (int64_t h = 0; h < j->heads; h++)
            merge(j, s, h, p->first[s], p->first[s + 1], p->po, p->pm, p->pl);
}

/* every task, split over OpenMP threads (torch's own
 * pool: this module is loaded after torch and shares its libgomp by soname, so no second set
 * of threads spins beside torch's); each thread has its own score scratch */
static void run_all(Job *j, int64_t chunk_pages, int threads) {
    Plan p = {0};
    int64_t group = j->heads / j->kv_heads;
    if (!plan(j, chunk_len(j, chunk_pages, threads), &p)) {
        j->failed = 1;
        unplan(&p);
        return;
    }
    ChunkFn fn = chunk_fn(j);
    int n = p.tasks < threads ? (int)(p.tasks < 1 ? 1 : p.tasks) : threads;
#pragma omp parallel num_threads(n)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(group * p.chunk + j->dim));
        if (!scratch)
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < p.tasks; t++)
            if (scratch)
                run_task(j, &p, fn, t, scratch);
        free(scratch);
    }
    unplan(&p);
}

/* decode(out, q, k_pool, v_pool, tables, table_starts, ctx_lens: data pointers as ints,
 *        num_seqs, heads, kv_heads, head_dim, page_size, bf16, scale, threads, chunk_pages,
 *        rows) -> None; chunk_pages 0: chosen here (see chunk_len); rows: query rows per
 * sequence (1: a decode step), ctx_lens the last row's */
static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long out, q, k, v, tables, starts, ctx;
    long long num_seqs, heads, kv_heads, dim, page, chunk_pages, rows;
    int bf16, threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLpfiLL", &out, &q, &k, &v, &tables, &starts, &ctx,
                          &num_seqs, &heads, &kv_heads, &dim, &page, &bf16, &scale, &threads,
                          &chunk_pages, &rows))
        return NULL;
    if (num_seqs < 0 || heads <= 0 || kv_heads <= 0 || dim <= 0 || page <= 0 ||
        chunk_pages < 0 || rows <= 0 || heads % kv_heads ||
        heads / kv_heads * rows > MAX_GROUP) {
        PyErr_Format(PyExc_ValueError,
                     "paged decode: bad shape (seqs %lld, rows %lld, heads %lld, kv_heads %lld, "
                     "dim %lld, page %lld, chunk pages %lld; heads must be a multiple of "
                     "kv_heads, at most %d per group and row)",
                     num_seqs, rows, heads, kv_heads, dim, page, chunk_pages, MAX_GROUP);
        return NULL;
    }
    Job job = {(float *)out, (const float *)q, (const char *)k, (const char *)v,
               (const int64_t *)tables, (const int64_t *)starts, (const int64_t *)ctx,
               num_seqs, heads * rows, kv_heads, dim, page, rows, bf16, scale, 0};
    Py_BEGIN_ALLOW_THREADS;
    run_all(&job, chunk_pages, threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS;
    if (job.failed) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_RETURN_NONE;
}

/* which build of the chunk kernel runs (for reports): "avx512", "avx2" or "portable" */
static PyObject *isa(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(ISA_NAMES[chosen_isa()]);
}

/* build_for(queries, head_dim) -> "avx512", "avx2" or "portable": the build that runs this many
 * queries (heads x rows) per K/V head (a sequence's rows shared where its vector build holds
 * them; the portable build is slower than one row at a time in a vector build) */
static PyObject *build_for_py(PyObject *self, PyObject *args) {
    long long queries, dim;
    if (!PyArg_ParseTuple(args, "LL", &queries, &dim))
        return NULL;
    return PyUnicode_FromString(ISA_NAMES[build_for(queries, dim)]);
}

/* use_isa(name or None) -> None: run at most that build ("avx512", "avx2", "portable"), or
 * (None) the best this CPU has; a build the CPU lacks is a ValueError */
static PyObject *use_isa(PyObject *self, PyObject *arg) {
    if (arg == Py_None) {
        isa_cap = ISA_AVX512;
        Py_RETURN_NONE;
    }
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    for (int i = 0; name && i <= ISA_AVX512; i++)
        if (!strcmp(name, ISA_NAMES[i])) {
            if (i > cpu_isa()) {
                PyErr_Format(PyExc_ValueError, "paged decode: this CPU has no %s", name);
                return NULL;
            }
            isa_cap = i;
            Py_RETURN_NONE;
        }
    PyErr_SetString(PyExc_ValueError, "paged decode: use_isa takes avx512, avx2, portable or None");
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Batched paged decode attention (see the module doc)."},
    {"isa", isa, METH_NOARGS, "The instruction set the chunk kernel runs with."},
    {"build_for", build_for_py, METH_VARARGS, "The build run for (queries per K/V head, dim)."},
    {"use_isa", use_isa, METH_O, "Cap the build the chunk kernel runs with (None: the CPU's)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_decode(void) { return PyModule_Create(&module); }
