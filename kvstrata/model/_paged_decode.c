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
 * read), max, exp and sum, then the weighted V sum (one V read). The inner loops are compiled
 * for AVX-512, AVX2 and a portable baseline; the loader picks one by the CPU at run time
 * (gcc target_clones). The GIL is released; tasks are split over `threads` pthreads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64
#define MAX_GROUP 64 /* query heads per K/V head */

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
    int64_t next_task; /* shared task counter (atomic) */
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

static void *worker(void *arg) {
    Job *j = (Job *)arg;
    int64_t max_ctx = 0, group = j->heads / j->kv_heads;
    for (int64_t s = 0; s < j->num_seqs; s++)
        max_ctx = j->ctx_lens[s] > max_ctx ? j->ctx_lens[s] : max_ctx;
    float *scores = malloc(sizeof(float) * (size_t)(group * max_ctx + j->dim));
    if (!scores) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    float *row = scores + group * max_ctx;
    int64_t tasks = j->num_seqs * j->kv_heads;
    for (;;) {
        int64_t t = __atomic_fetch_add(&j->next_task, 1, __ATOMIC_RELAXED);
        if (t >= tasks)
            break;
        run_task(j, t / j->kv_heads, t % j->kv_heads, scores, row);
    }
    free(scores);
    return NULL;
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
               num_seqs, heads, kv_heads, dim, page, bf16, scale, 0, 0};
    int64_t tasks = num_seqs * kv_heads;
    int n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    n = tasks < n ? (int)tasks : n;
    Py_BEGIN_ALLOW_THREADS;
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (; started < n - 1; started++)
        if (pthread_create(&ids[started], NULL, worker, &job) != 0)
            break; /* the calling thread still runs every remaining task */
    worker(&job);
    for (int i = 0; i < started; i++)
        pthread_join(ids[i], NULL);
    Py_END_ALLOW_THREADS;
    if (job.failed) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_RETURN_NONE;
}

/* which build of the inner loops the CPU gets (for reports): "avx512f", "avx2" or "portable" */
static PyObject *isa(PyObject *self, PyObject *args) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return PyUnicode_FromString("avx512f");
    if (__builtin_cpu_supports("avx2"))
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
