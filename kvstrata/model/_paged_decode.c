/* Batched decode attention read straight from the paged KV pool: one new query token per
 * sequence, every key of its context visible, sequences of different lengths in one call, no
 * gather copy of K/V (see paged_decode.py for the Python side and the shapes).
 *
 * Pool of one layer, K and V each: [capacity, page_size, kv_heads, head_dim] contiguous, fp32
 * or bf16; token p of sequence s sits in page table[s][p / page_size], slot p % page_size.
 * q, out: [num_seqs, heads, head_dim] fp32 contiguous; query head h reads K/V head
 * h / (heads / kv_heads) (grouped heads as they are, never repeated).
 *
 * Per (sequence, K/V head) task: scores of the head's query group against every key (one K
 * read), max, exp and sum, then the weighted V sum (one V read). Where the CPU has AVX2+FMA (and
 * head_dim % 16 == 0, head_dim <= 256, at most 8 query heads per K/V head) an AVX2 build of the
 * task runs: pages walked in order, rows read in place, a vector exp; else a portable one
 * (its inner loops compiled for AVX-512, AVX2 and a baseline, picked at load by gcc
 * target_clones). The GIL is released; tasks are split over `threads` OpenMP threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64 /* query heads per K/V head */
#define FAST_GROUP 8  /* query heads per K/V head the AVX2 path keeps in registers */
#define FAST_DIM 256  /* longest head the AVX2 path takes */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
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
    int64_t num_seqs, heads, kv_heads, dim, page;
    int bf16;
    float scale;
    int failed;
} Job;

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

static const char *row_at(const Job *j, const char *pool, const int64_t *table, int64_t p,
                          int64_t kvh) {
    int64_t elem = j->bf16 ? 2 : 4;
    int64_t slot = table[p / j->page] * j->page + p % j->page;
    return pool + ((slot * j->kv_heads + kvh) * j->dim) * elem;
}

/* attention of sequence s's query group of K/V head kvh; scores: [group, ctx] scratch */
static void run_task(const Job *j, int64_t s, int64_t kvh, float *scores, float *row) {
    int64_t group = j->heads / j->kv_heads, ctx = j->ctx_lens[s], dim = j->dim;
    const int64_t *table = j->tables + j->table_starts[s];
    const float *q = j->q + (s * j->heads + kvh * group) * dim; /* [group, dim] */
    float *out = j->out + (s * j->heads + kvh * group) * dim;
    float max[MAX_GROUP];
    for (int64_t g = 0; g < group; g++)
        max[g] = -INFINITY;
    for (int64_t p = 0; p < ctx; p++) {
        load_row(row, row_at(j, j->k, table, p, kvh), dim, j->bf16);
        for (int64_t g = 0; g < group; g++) {
            float x = dot(q + g * dim, row, dim) * j->scale;
            scores[g * ctx + p] = x;
            max[g] = x > max[g] ? x : max[g];
        }
    }
    float inv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        inv[g] = 1.0f / exp_shift(scores + g * ctx, ctx, max[g]);
        memset(out + g * dim, 0, (size_t)dim * 4);
    }
    for (int64_t p = 0; p < ctx; p++) {
        load_row(row, row_at(j, j->v, table, p, kvh), dim, j->bf16);
        for (int64_t g = 0; g < group; g++)
            axpy(out + g * dim, scores[g * ctx + p], row, dim);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < dim; i++)
            out[g * dim + i] *= inv[g];
}

#if HAVE_X86
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

/* e^x for x <= 0 (scores less their max): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in
 * [-ln2/2, ln2/2], p of degree 6 (relative error ~1e-7); below -87 the result is 0 */
AVX2 static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
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

/* the same task as run_task for G query heads per K/V head (a constant, so every running sum
 * stays in a register), BF16 a constant too: pages walked in order (no division per key), K/V
 * rows read in place; the V sum runs over 16 columns of the head at a time (G x 2 sums in
 * registers), the task's V rows coming back from L1/L2 for the later columns.
 * dim % 16 == 0, dim <= FAST_DIM */
#define TASK(NAME, G, BF16)                                                                     \
    AVX2 static void NAME(const Job *j, int64_t s, int64_t kvh, float *scores) {                \
        int64_t ctx = j->ctx_lens[s], dim = j->dim, page = j->page;                             \
        int64_t elem = BF16 ? 2 : 4, stride = j->kv_heads * dim * elem;                         \
        const int64_t *table = j->tables + j->table_starts[s];                                  \
        const float *q = j->q + (s * j->heads + kvh * G) * dim; /* [G, dim] */                  \
        float *out = j->out + (s * j->heads + kvh * G) * dim;                                   \
        float max[G];                                                                           \
        for (int g = 0; g < G; g++)                                                             \
            max[g] = -INFINITY;                                                                 \
        for (int64_t p0 = 0; p0 < ctx; p0 += page) {                                            \
            const char *row = j->k + (table[p0 / page] * page * j->kv_heads + kvh) * dim * elem; \
            int64_t n = ctx - p0 < page ? ctx - p0 : page;                                      \
            for (int64_t o = 0; o < n; o++, row += stride) {                                    \
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
                    scores[g * ctx + p0 + o] = x;                                               \
                    max[g] = x > max[g] ? x : max[g];                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        float inv[G];                                                                           \
        for (int g = 0; g < G; g++)                                                             \
            inv[g] = 1.0f / exp_shift_avx2(scores + g * ctx, ctx, max[g]);                      \
        for (int64_t c = 0; c < dim; c += 16) {                                                 \
            __m256 lo[G], hi[G];                                                                \
            for (int g = 0; g < G; g++)                                                         \
                lo[g] = hi[g] = _mm256_setzero_ps();                                            \
            for (int64_t p0 = 0; p0 < ctx; p0 += page) {                                        \
                const char *row =                                                               \
                    j->v + (table[p0 / page] * page * j->kv_heads + kvh) * dim * elem;          \
                int64_t n = ctx - p0 < page ? ctx - p0 : page;                                  \
                for (int64_t o = 0; o < n; o++, row += stride) {                                \
                    __m256 a = kv8(row, c, BF16), b = kv8(row, c + 8, BF16);                    \
                    for (int g = 0; g < G; g++) {                                               \
                        __m256 w = _mm256_broadcast_ss(scores + g * ctx + p0 + o);              \
                        lo[g] = _mm256_fmadd_ps(w, a, lo[g]);                                   \
                        hi[g] = _mm256_fmadd_ps(w, b, hi[g]);                                   \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int g = 0; g < G; g++) {                                                       \
                __m256 f = _mm256_set1_ps(inv[g]);                                              \
                _mm256_storeu_ps(out + g * dim + c, _mm256_mul_ps(f, lo[g]));                   \
                _mm256_storeu_ps(out + g * dim + c + 8, _mm256_mul_ps(f, hi[g]));               \
            }                                                                                   \
        }                                                                                       \
    }

#define TASKS_OF(G)                                                                             \
    TASK(task_f32_##G, G, 0)                                                                    \
    TASK(task_bf16_##G, G, 1)
TASKS_OF(1)
TASKS_OF(2)
TASKS_OF(3)
TASKS_OF(4)
TASKS_OF(5)
TASKS_OF(6)
TASKS_OF(7)
TASKS_OF(8)

typedef void (*Task)(const Job *, int64_t, int64_t, float *);
static const Task TASKS[2][FAST_GROUP] = { /* [bf16][query heads per K/V head - 1] */
    {task_f32_1, task_f32_2, task_f32_3, task_f32_4, task_f32_5, task_f32_6, task_f32_7,
     task_f32_8},
    {task_bf16_1, task_bf16_2, task_bf16_3, task_bf16_4, task_bf16_5, task_bf16_6, task_bf16_7,
     task_bf16_8},
};
#endif

static int fast_path(const Job *j) {
#if HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && j->dim % 16 == 0 &&
           j->dim <= FAST_DIM && j->heads / j->kv_heads <= FAST_GROUP;
#else
    return 0;
#endif
}

/* every (sequence, K/V head) task, split over OpenMP threads (torch's own pool: this module
 * is loaded after torch and shares its libgomp by soname, so no second set of threads spins
 * beside torch's); each thread has its own score scratch */
static void run_all(Job *j, int threads) {
    int64_t max_ctx = 0, group = j->heads / j->kv_heads, tasks = j->num_seqs * j->kv_heads;
    for (int64_t s = 0; s < j->num_seqs; s++)
        max_ctx = j->ctx_lens[s] > max_ctx ? j->ctx_lens[s] : max_ctx;
    int fast = fast_path(j);
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_ctx + j->dim));
        if (!scores)
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!scores)
                continue;
#if HAVE_X86
            if (fast) {
                TASKS[j->bf16 != 0][group - 1](j, t / j->kv_heads, t % j->kv_heads, scores);
                continue;
            }
#endif
            run_task(j, t / j->kv_heads, t % j->kv_heads, scores, scores + group * max_ctx);
        }
        free(scores);
    }
}

/* decode(out, q, k_pool, v_pool, tables, table_starts, ctx_lens: data pointers as ints,
 *        num_seqs, heads, kv_heads, head_dim, page_size, bf16, scale, threads) -> None */
static PyObject *decode(PyObject *self, PyObject *args) {
    unsigned long long out, q, k, v, tables, starts, ctx;
    long long num_seqs, heads, kv_heads, dim, page;
    int bf16, threads;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLLpfi", &out, &q, &k, &v, &tables, &starts, &ctx,
                          &num_seqs, &heads, &kv_heads, &dim, &page, &bf16, &scale, &threads))
        return NULL;
    if (num_seqs < 0 || heads <= 0 || kv_heads <= 0 || dim <= 0 || page <= 0 ||
        heads % kv_heads || heads / kv_heads > MAX_GROUP) {
        PyErr_Format(PyExc_ValueError,
                     "paged decode: bad shape (seqs %lld, heads %lld, kv_heads %lld, dim %lld, "
                     "page %lld; heads must be a multiple of kv_heads, at most %d per group)",
                     num_seqs, heads, kv_heads, dim, page, MAX_GROUP);
        return NULL;
    }
    Job job = {(float *)out, (const float *)q, (const char *)k, (const char *)v,
               (const int64_t *)tables, (const int64_t *)starts, (const int64_t *)ctx,
               num_seqs, heads, kv_heads, dim, page, bf16, scale, 0};
    int64_t tasks = num_seqs * kv_heads;
    int n = threads < 1 ? 1 : threads;
    n = tasks < n ? (int)(tasks < 1 ? 1 : tasks) : n;
    Py_BEGIN_ALLOW_THREADS;
    run_all(&job, n);
    Py_END_ALLOW_THREADS;
    if (job.failed) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_RETURN_NONE;
}

/* which build of the fast path the CPU gets (for reports): "avx2" or "portable" */
static PyObject *isa(PyObject *self, PyObject *args) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return PyUnicode_FromString("avx2");
#endif
    return PyUnicode_FromString("portable");
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Batched paged decode attention (see the module doc)."},
    {"isa", isa, METH_NOARGS, "The instruction set the inner loops run with."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__paged_decode(void) { return PyModule_Create(&module); }
