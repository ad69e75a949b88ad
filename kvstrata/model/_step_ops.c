/* The small per-row ops of a decode step, each one pass in native code where torch spends more
 * on dispatch and temporaries than on the arithmetic (see step_ops.py for the Python side).
 *
 * - rms_norm: optional residual add (s = x + r, stored), then y = w * s / sqrt(mean(s^2) + eps)
 *   over rows of `hidden`, the mean in fp32. fp32: y = (s * inv) * w, as transformers and
 *   torch's rms_norm. bf16: s rounded to bf16 (as torch's bf16 add), y = bf16(w * bf16(s * inv)),
 *   as transformers (normalised in fp32, rounded, then the bf16 weight applied).
 * - rope_write: a fused q|k|v projection [T, heads + 2 kv_heads, dim] -> rotated q [T, heads,
 *   dim], rotated k and v written to the flat pool [slots, kv_heads, dim] at slots[t]
 *   (rotate-half layout: x * cos + rotate_half(x) * sin, each product and the sum rounded to the
 *   model dtype as torch's ops round them; the pool may hold another dtype: rounded to it).
 * - argmax: the first index of the largest value of each fp32 row, NaN counting as largest (the
 *   first NaN), as torch.argmax.
 *
 * Loops are plain C compiled for AVX-512, AVX2 and a baseline (gcc target_clones, picked at load);
 * reductions are `omp simd` (fp32 sums in lanes: order differs from torch's by rounding only).
 * One thread: a step's rows are a few KB. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL
#endif

typedef union {
    uint32_t u;
    float f;
} Bits; /* a float's bits (a union, not memcpy: loops over it vectorize) */

static inline float bf16_to_f32(uint16_t b) {
    Bits v = {.u = (uint32_t)b << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u = ((Bits){.f = f}).u;
    uint32_t nan = (uint32_t)((u >> 16) | 0x40), even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : even); /* NaN stays NaN (quiet) */
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* element i of a row in `bf16` or fp32 storage, as fp32 */
static inline float get(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* ---- rms_norm ---------------------------------------------------------------------------- */

/* one fp32 row: s = x (+ r) stored to `sum` (if r), y = (s * inv) * w */
KERNEL static void norm_row_f32(float *y, float *sum, const float *x, const float *r,
                                const float *w, int64_t n, float eps) {
    float acc = 0.0f;
    if (r) {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) {
            float s = x[i] + r[i];
            sum[i] = s;
            acc += s * s;
        }
        x = sum;
    } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++)
            acc += x[i] * x[i];
    }
    float inv = 1.0f / sqrtf(acc / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        y[i] = (x[i] * inv) * w[i];
}

/* one bf16 row, fp32 inside: s = bf16(x + r) stored (if r), y = bf16(w * bf16(s * inv)) */
KERNEL static void norm_row_bf16(uint16_t *y, uint16_t *sum, const uint16_t *x, const uint16_t *r,
                                 const uint16_t *w, int64_t n, float eps) {
    float acc = 0.0f;
    if (r) {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) {
            uint16_t b = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(r[i]));
            float s = bf16_to_f32(b);
            sum[i] = b;
            acc += s * s;
        }
        x = sum;
    } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) {
            float s = bf16_to_f32(x[i]);
            acc += s * s;
        }
    }
    float inv = 1.0f / sqrtf(acc / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        y[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * inv));
}

/* rms_norm(y, x, r, sum, w, rows, hidden, eps, bf16): pointers as ints (r, sum 0 = no add) */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long y, x, r, sum, w;
    long long rows, n;
    float eps;
    int bf16;
    if (!PyArg_ParseTuple(args, "KKKKKLLfp", &y, &x, &r, &sum, &w, &rows, &n, &eps, &bf16))
        return NULL;
    if (rows < 0 || n < 1 || (r != 0) != (sum != 0)) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad shape or residual");
        return NULL;
    }
    int64_t es = bf16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS;
    for (int64_t i = 0; i < rows; i++) {
        int64_t at = i * n * es;
        char *sp = sum ? (char *)sum + at : NULL;
        const char *rp = r ? (const char *)r + at : NULL;
        if (bf16)
            norm_row_bf16((uint16_t *)((char *)y + at), (uint16_t *)sp,
                          (const uint16_t *)((const char *)x + at), (const uint16_t *)rp,
                          (const uint16_t *)w, n, eps);
        else
            norm_row_f32((float *)((char *)y + at), (float *)sp, (const float *)((const char *)x + at),
                         (const float *)rp, (const float *)w, n, eps);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* ---- rope_write -------------------------------------------------------------------------- */

typedef struct {
    const void *qkv;           /* [T, heads + 2 kv_heads, dim] model dtype */
    const void *cos, *sin;     /* [T, dim] model dtype */
    void *q;                   /* [T, heads, dim] model dtype */
    void *k, *v;               /* flat pool [slots, kv_heads, dim] pool dtype */
    const int64_t *slots;      /* [T] */
    int64_t t, heads, kv_heads, dim;
    int bf16, pool_bf16;
} Rope;

#define MAX_DIM 512 /* longest head rope_write takes */

/* n values from element `at` of p (bf16 or fp32 storage) widened into f */
static inline void load_row(float *f, const void *p, int64_t at, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(f, (const float *)p + at, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t *h = (const uint16_t *)p + at;
    for (int64_t i = 0; i < n; i++)
        f[i] = bf16_to_f32(h[i]);
}

static inline void store_row(void *p, int64_t at, const float *f, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)p + at, f, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = (uint16_t *)p + at;
    for (int64_t i = 0; i < n; i++)
        h[i] = f32_to_bf16(f[i]);
}

/* one head x [dim] rotated: y_i = x_i * c_i + rot_i * s_i, rot = [-x_hi | x_lo]; in bf16 each
 * product and the sum rounded, as torch's bf16 mul and add round them */
KERNEL static void rotate(float *restrict y, const float *restrict x, const float *restrict c,
                          const float *restrict s, int64_t d, int bf16) {
    int64_t half = d / 2;
    if (!bf16) {
        for (int64_t i = 0; i < half; i++) {
            y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
            y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        return;
    }
    for (int64_t i = 0; i < half; i++) {
        y[i] = round_bf16(round_bf16(x[i] * c[i]) + round_bf16(-x[i + half] * s[i]));
        y[i + half] =
            round_bf16(round_bf16(x[i + half] * c[i + half]) + round_bf16(x[i] * s[i + half]));
    }
}

KERNEL static void rope_run(const Rope *j) {
    int64_t d = j->dim, width = (j->heads + 2 * j->kv_heads) * d;
    float c[MAX_DIM], s[MAX_DIM], x[MAX_DIM], y[MAX_DIM];
    for (int64_t t = 0; t < j->t; t++) {
        int64_t row = t * width, slot = j->slots[t] * j->kv_heads * d;
        load_row(c, j->cos, t * d, d, j->bf16);
        load_row(s, j->sin, t * d, d, j->bf16);
        for (int64_t h = 0; h < j->heads + j->kv_heads; h++) { /* q heads, then k heads */
            load_row(x, j->qkv, row + h * d, d, j->bf16);
            rotate(y, x, c, s, d, j->bf16);
            if (h < j->heads)
                store_row(j->q, (t * j->heads + h) * d, y, d, j->bf16);
            else
                store_row(j->k, slot + (h - j->heads) * d, y, d, j->pool_bf16);
        }
        for (int64_t h = 0; h < j->kv_heads; h++) {
            load_row(x, j->qkv, row + (j->heads + j->kv_heads + h) * d, d, j->bf16);
            store_row(j->v, slot + h * d, x, d, j->pool_bf16);
        }
    }
}

/* rope_write(qkv, cos, sin, q, k, v, slots, t, heads, kv_heads, dim, bf16, pool_bf16) */
static PyObject *rope_write(PyObject *self, PyObject *args) {
    unsigned long long qkv, cos, sin, q, k, v, slots;
    long long t, heads, kv_heads, dim;
    int bf16, pool_bf16;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLpp", &qkv, &cos, &sin, &q, &k, &v, &slots, &t, &heads,
                          &kv_heads, &dim, &bf16, &pool_bf16))
        return NULL;
    if (t < 0 || heads < 1 || kv_heads < 1 || dim < 2 || dim % 2 || dim > MAX_DIM) {
        PyErr_SetString(PyExc_ValueError, "rope_write: bad shape");
        return NULL;
    }
    Rope job = {(const void *)qkv, (const void *)cos, (const void *)sin, (void *)q, (void *)k,
                (void *)v, (const int64_t *)slots, t, heads, kv_heads, dim, bf16, pool_bf16};
    Py_BEGIN_ALLOW_THREADS;
    rope_run(&job);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* ---- argmax ------------------------------------------------------------------------------ */

#define SCAN 64 /* values per block of the search for the first maximum */

/* first index of the largest value of x[0..n), the first NaN if there is one */
KERNEL static int64_t argmax_row(const float *x, int64_t n) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= x[i] != x[i];
    }
    for (int64_t b = 0; b < n; b += SCAN) { /* blocks tested whole, the hit found in one */
        int64_t e = b + SCAN < n ? b + SCAN : n;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = b; i < e; i++)
            hit |= nan ? x[i] != x[i] : x[i] == m;
        if (!hit)
            continue;
        for (int64_t i = b; i < e; i++)
            if (nan ? x[i] != x[i] : x[i] == m)
                return i;
    }
    return 0; /* n == 0 never reaches here (the caller refuses it) */
}

/* argmax(x, n) -> int: x an fp32 row of n values (pointer as an int) */
static PyObject *argmax(PyObject *self, PyObject *args) {
    unsigned long long x;
    long long n;
    if (!PyArg_ParseTuple(args, "KL", &x, &n))
        return NULL;
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "argmax: empty row");
        return NULL;
    }
    int64_t at;
    Py_BEGIN_ALLOW_THREADS;
    at = argmax_row((const float *)x, n);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLongLong(at);
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "Residual add and RMS norm of rows (see the module doc)."},
    {"rope_write", rope_write, METH_VARARGS, "Rotary q/k and the K/V pool write of one step."},
    {"argmax", argmax, METH_VARARGS, "First index of an fp32 row's maximum (NaN largest)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_step_ops", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__step_ops(void) { return PyModule_Create(&module); }
