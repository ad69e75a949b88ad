/* y = x @ W^T (+ bias) for a few rows of x (a decode step's tokens), W read once from memory.
 *
 * x [M, K] fp32 or bf16, W [N, K] fp32 or bf16 (row-major, as nn.Linear keeps it), bias [N]
 * fp32 or none, y [M, N] fp32 or bf16 (rounded to nearest even from the fp32 sum). Sums are
 * fp32 whatever the storage dtype; bf16 values widen to fp32 exactly.
 *
 * At small M the product is bound by reading W (each weight is used M times), so the loop
 * streams W once, front to back: each row of W meets up to 8 rows of x in one pass (x stays in
 * the L1/L2 cache). Blocks are split over OpenMP threads; loaded after torch, this module shares
 * torch's OpenMP runtime (one libgomp by soname), so its threads are torch's own pool and no
 * second set of threads spins beside it. An AVX-512 build of the inner loop (two rows of W per
 * pass, 16 lanes) is chosen at run time where the CPU has it, else an AVX2+FMA one, else a
 * portable one. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define ROWS 16 /* rows of W per block (one OpenMP work item) */
#define MAX_TILE 8 /* rows of x per pass over a row of W */

typedef struct {
    float *y32;         /* fp32 output, or NULL */
    uint16_t *y16;      /* bf16 output, or NULL */
    const float *x;     /* [M, K] fp32 (bf16 input widened first) */
    const char *w;      /* [N, K] */
    const float *bias;  /* [N] or NULL */
    int64_t m, n, k;
    int w_bf16;
} Job;

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN (quiet) */
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float weight_at(const Job *j, int64_t row, int64_t col) {
    if (j->w_bf16)
        return bf16_to_f32(((const uint16_t *)j->w)[row * j->k + col]);
    return ((const float *)j->w)[row * j->k + col];
}

static inline void store(const Job *j, int64_t row, int64_t col, float v) {
    if (j->bias)
        v += j->bias[col];
    if (j->y16)
        j->y16[row * j->n + col] = f32_to_bf16(v);
    else
        j->y32[row * j->n + col] = v;
}

/* rows n0 .. n0+rows-1 of W against every row of x, plain C */
static void block_portable(const Job *j, int64_t n0, int64_t rows) {
    for (int64_t r = 0; r < j->m; r++) {
        const float *x = j->x + r * j->k;
        for (int64_t c = n0; c < n0 + rows; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < j->k; i++)
                acc += x[i] * weight_at(j, c, i);
            store(j, r, c, acc);
        }
    }
}

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline __m256 load_f32(const void *w, int64_t i) {
    return _mm256_loadu_ps((const float *)w + i);
}

AVX2 static inline __m256 load_bf16(const void *w, int64_t i) { /* exact widening */
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* row c of W against MB rows of x from row r: MB running vector sums, each W vector loaded
 * once and used MB times, so W is read front to back (one sequential stream per thread); the
 * columns past the last multiple of 8 are summed plainly */
#define TILE(NAME, LOAD, MB)                                                                    \
    AVX2 static void NAME(const Job *j, int64_t c, int64_t r) {                                 \
        __m256 a[MB];                                                                           \
        int64_t k = j->k, i = 0;                                                                \
        const char *w = j->w + c * k * (j->w_bf16 ? 2 : 4);                                     \
        const float *x = j->x + r * k;                                                          \
        for (int t = 0; t < MB; t++)                                                            \
            a[t] = _mm256_setzero_ps();                                                         \
        for (; i + 8 <= k; i += 8) {                                                            \
            __m256 wv = LOAD(w, i);                                                             \
            for (int t = 0; t < MB; t++)                                                        \
                a[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * k + i), a[t]);              \
        }                                                                                       \
        for (int t = 0; t < MB; t++) {                                                          \
            float s = hsum(a[t]);                                                               \
            for (int64_t q = i; q < k; q++)                                                     \
                s += x[t * k + q] * weight_at(j, c, q);                                         \
            store(j, r + t, c, s);                                                              \
        }                                                                                       \
    }

#define TILES_OF(T, LOAD)                                                                       \
    TILE(T##1, LOAD, 1)                                                                         \
    TILE(T##2, LOAD, 2)                                                                         \
    TILE(T##3, LOAD, 3)                                                                         \
    TILE(T##4, LOAD, 4)                                                                         \
    TILE(T##5, LOAD, 5)                                                                         \
    TILE(T##6, LOAD, 6)                                                                         \
    TILE(T##7, LOAD, 7)                                                                         \
    TILE(T##8, LOAD, 8)
TILES_OF(f32_, load_f32)
TILES_OF(bf16_, load_bf16)

typedef void (*Tile)(const Job *, int64_t, int64_t);
static const Tile TILES[2][MAX_TILE] = { /* [w_bf16][rows of x - 1] */
    {f32_1, f32_2, f32_3, f32_4, f32_5, f32_6, f32_7, f32_8},
    {bf16_1, bf16_2, bf16_3, bf16_4, bf16_5, bf16_6, bf16_7, bf16_8},
};

/* rows n0 .. n0+rows-1 of W against every row of x, up to 8 rows of x per pass (later passes
 * find the W rows in cache) */
AVX2 static void block_avx2(const Job *j, int64_t n0, int64_t rows) {
    for (int64_t r = 0; r < j->m; r += MAX_TILE) {
        int64_t mb = j->m - r < MAX_TILE ? j->m - r : MAX_TILE;
        for (int64_t c = n0; c < n0 + rows; c++)
            TILES[j->w_bf16][mb - 1](j, c, r);
    }
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* 16 values of a row from element i, the lanes at or past k zero (a masked load) */
AVX512 static inline __m512 load512_f32(const void *w, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

AVX512 static inline __m512 load512_bf16(const void *w, int64_t i, __mmask16 m) { /* exact */
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* NB rows of W from row c against MB rows of x from row r: NB * MB running 16-lane sums, each
 * W vector loaded once and used MB times, each x vector used NB times (two W rows in flight:
 * half the x loads of one); the last partial vector of a row by a masked load */
#define TILE512(NAME, LOAD, NB, MB)                                                             \
    AVX512 static void NAME(const Job *j, int64_t c, int64_t r) {                               \
        __m512 a[NB][MB];                                                                       \
        int64_t k = j->k, es = j->w_bf16 ? 2 : 4;                                               \
        const char *w = j->w + c * k * es;                                                      \
        const float *x = j->x + r * k;                                                          \
        _Pragma("GCC unroll 2") for (int n = 0; n < NB; n++)                                   \
            _Pragma("GCC unroll 8") for (int t = 0; t < MB; t++)                               \
                a[n][t] = _mm512_setzero_ps();                                                  \
        for (int64_t i = 0; i < k; i += 16) {                                                   \
            __mmask16 m = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);  \
            __m512 wv[NB];                                                                      \
            _Pragma("GCC unroll 2") for (int n = 0; n < NB; n++)                               \
                wv[n] = LOAD(w + n * k * es, i, m);                                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < MB; t++) {                             \
                __m512 xv = _mm512_maskz_loadu_ps(m, x + t * k + i);                            \
                _Pragma("GCC unroll 2") for (int n = 0; n < NB; n++)                           \
                    a[n][t] = _mm512_fmadd_ps(wv[n], xv, a[n][t]);                              \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 2") for (int n = 0; n < NB; n++)                                   \
            _Pragma("GCC unroll 8") for (int t = 0; t < MB; t++)                               \
                store(j, r + t, c + n, _mm512_reduce_add_ps(a[n][t]));                          \
    }

#define TILES512_OF(T, LOAD, NB)                                                                \
    TILE512(T##1, LOAD, NB, 1)                                                                  \
    TILE512(T##2, LOAD, NB, 2)                                                                  \
    TILE512(T##3, LOAD, NB, 3)                                                                  \
    TILE512(T##4, LOAD, NB, 4)                                                                  \
    TILE512(T##5, LOAD, NB, 5)                                                                  \
    TILE512(T##6, LOAD, NB, 6)                                                                  \
    TILE512(T##7, LOAD, NB, 7)                                                                  \
    TILE512(T##8, LOAD, NB, 8)
TILES512_OF(f32x1_, load512_f32, 1)
TILES512_OF(f32x2_, load512_f32, 2)
TILES512_OF(bf16x1_, load512_bf16, 1)
TILES512_OF(bf16x2_, load512_bf16, 2)

static const Tile TILES512[2][2][MAX_TILE] = { /* [w_bf16][W rows - 1][rows of x - 1] */
    {{f32x1_1, f32x1_2, f32x1_3, f32x1_4, f32x1_5, f32x1_6, f32x1_7, f32x1_8},
     {f32x2_1, f32x2_2, f32x2_3, f32x2_4, f32x2_5, f32x2_6, f32x2_7, f32x2_8}},
    {{bf16x1_1, bf16x1_2, bf16x1_3, bf16x1_4, bf16x1_5, bf16x1_6, bf16x1_7, bf16x1_8},
     {bf16x2_1, bf16x2_2, bf16x2_3, bf16x2_4, bf16x2_5, bf16x2_6, bf16x2_7, bf16x2_8}},
};

/* as block_avx2, two rows of W at a time (the odd last one alone) */
AVX512 static void block_avx512(const Job *j, int64_t n0, int64_t rows) {
    for (int64_t r = 0; r < j->m; r += MAX_TILE) {
        int64_t mb = j->m - r < MAX_TILE ? j->m - r : MAX_TILE;
        for (int64_t c = n0; c < n0 + rows; c += 2) {
            int64_t nb = n0 + rows - c >= 2 ? 2 : 1;
            TILES512[j->w_bf16][nb - 1][mb - 1](j, c, r);
        }
    }
}
#endif

/* the instruction sets of the inner loop, best last; use_isa caps the choice (tests run each
 * build on one machine) */
enum { PORTABLE, ISA_AVX2, ISA_AVX512 };
static const char *ISA_NAMES[] = {"portable", "avx2", "avx512"};
static int isa_cap = ISA_AVX512;

static int best_isa(void) {
    int best = PORTABLE;
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = ISA_AVX2;
    if (best == ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        best = ISA_AVX512;
#endif
    return best < isa_cap ? best : isa_cap;
}

static void run(const Job *j, int threads) {
    int64_t blocks = (j->n + ROWS - 1) / ROWS;
    int isa = best_isa();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * ROWS, rows = j->n - n0 < ROWS ? j->n - n0 : ROWS;
#if HAVE_X86
        if (isa == ISA_AVX512) {
            block_avx512(j, n0, rows);
            continue;
        }
        if (isa == ISA_AVX2) {
            block_avx2(j, n0, rows);
            continue;
        }
#endif
        block_portable(j, n0, rows);
    }
}

/* matmul(y, x, w, bias, m, n, k, x_bf16, w_bf16, y_bf16, threads): data pointers as ints
 * (bias 0 = none) -> None */
static PyObject *matmul(PyObject *self, PyObject *args) {
    unsigned long long y, x, w, bias;
    long long m, n, k;
    int x_bf16, w_bf16, y_bf16, threads;
    if (!PyArg_ParseTuple(args, "KKKKLLLpppi", &y, &x, &w, &bias, &m, &n, &k, &x_bf16, &w_bf16,
                          &y_bf16, &threads))
        return NULL;
    if (m < 0 || n < 0 || k < 0) {
        PyErr_Format(PyExc_ValueError, "small matmul: bad shape (m %lld, n %lld, k %lld)", m, n,
                     k);
        return NULL;
    }
    float *xf = (float *)x;
    if (x_bf16) { /* widened once: every block reads x */
        xf = malloc(sizeof(float) * (size_t)(m * k) + 1);
        if (!xf)
            return PyErr_NoMemory();
        for (int64_t i = 0; i < m * k; i++)
            xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    Job job = {y_bf16 ? NULL : (float *)y, y_bf16 ? (uint16_t *)y : NULL, xf,
               (const char *)w, bias ? (const float *)bias : NULL, m, n, k, w_bf16};
    Py_BEGIN_ALLOW_THREADS;
    run(&job, threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS;
    if (x_bf16)
        free(xf);
    Py_RETURN_NONE;
}

/* which build of the inner loop runs (for reports): "avx512", "avx2" or "portable" */
static PyObject *isa(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(ISA_NAMES[best_isa()]);
}

/* use_isa(name) -> None: the best build up to `name` ("portable", "avx2", "avx512") from now on */
static PyObject *use_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    for (int i = PORTABLE; i <= ISA_AVX512; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            isa_cap = i;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "use_isa: unknown instruction set %s", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"matmul", matmul, METH_VARARGS, "y = x @ W^T (+ bias) for a few rows (see the module doc)."},
    {"isa", isa, METH_NOARGS, "The instruction set the inner loop runs with."},
    {"use_isa", use_isa, METH_VARARGS, "Cap the inner loop's instruction set (for tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_small_matmul", NULL, -1, methods};

PyMODINIT_FUNC PyInit__small_matmul(void) { return PyModule_Create(&module); }
