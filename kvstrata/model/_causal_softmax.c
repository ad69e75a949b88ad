/* Unnormalised causal softmax of one block of attention scores, in place (see
 * dense_attention.py for the Python side).
 *
 * s: [rows, cols] fp32 contiguous, rows = tokens * group: row r is query head r % group of the
 * block's token j = r / group, and that token sees columns 0 .. cols - tokens + j (the block's
 * tokens are the last `tokens` positions the columns reach). Each row becomes
 * e^(s - max) over its visible columns and 0 beyond them; sums[r] gets the row's sum, by which
 * the caller divides the row's P V product (one pass fewer over the scores than a softmax).
 *
 * e^x by range reduction and a degree-6 polynomial (relative error ~1e-7), 16 lanes with
 * AVX-512F, 8 with AVX2+FMA, chosen at run time; expf elsewhere. Rows are split over
 * `threads` OpenMP threads (torch's own pool: loaded after torch, this module shares its
 * libgomp). The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
#else
#define HAVE_X86 0
#endif

typedef float (*RowFn)(float *s, int64_t n, int64_t cols); /* returns the row's sum */

/* portable: max, e^(x - max) by expf, zeros beyond n */
static float row_portable(float *s, int64_t n, int64_t cols) {
    float max = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++)
        max = s[i] > max ? s[i] : max;
    for (int64_t i = 0; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    for (int64_t i = n; i < cols; i++)
        s[i] = 0.0f;
    return sum;
}

#if HAVE_X86
#include "_vec_exp.h" /* exp8 / exp16: e^x of scores less their row max */


AVX512 static float row_avx512(float *s, int64_t n, int64_t cols) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        m = _mm512_max_ps(m, _mm512_loadu_ps(s + i));
    if (i < n)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, (__mmask16)((1u << (n - i)) - 1), s + i));
    __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m)), acc = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), max));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) { /* the row's last visible columns (masked: nothing read or written past n) */
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), max)));
        _mm512_mask_storeu_ps(s + i, k, e);
        acc = _mm512_add_ps(acc, e);
    }
    for (int64_t z = n; z < cols; z++)
        s[z] = 0.0f;
    return _mm512_reduce_add_ps(acc);
}


AVX2 static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static float row_avx2(float *s, int64_t n, int64_t cols) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    float lanes[8], max = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++)
        max = lanes[l] > max ? lanes[l] : max;
    for (; i < n; i++)
        max = s[i] > max ? s[i] : max;
    __m256 mv = _mm256_set1_ps(max), acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; i < n; i++) {
        s[i] = expf(s[i] - max);
        sum += s[i];
    }
    for (int64_t z = n; z < cols; z++)
        s[z] = 0.0f;
    return sum;
}
#endif

static int force_portable = 0; /* tests run the portable loop on an AVX machine too */

static const char *isa_name(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (!force_portable && __builtin_cpu_supports("avx512f"))
        return "avx512";
    if (!force_portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return "avx2";
#endif
    return "portable";
}

static RowFn row_fn(void) {
    const char *name = isa_name();
#if HAVE_X86
    if (name[3] == '5')
        return row_avx512;
    if (name[3] == '2')
        return row_avx2;
#endif
    (void)name;
    return row_portable;
}

/* exp_rows(s, sums: data pointers as ints, rows, cols, tokens, threads) -> None */
static PyObject *exp_rows(PyObject *self, PyObject *args) {
    unsigned long long sp, sums_p;
    long long rows, cols, tokens;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLLi", &sp, &sums_p, &rows, &cols, &tokens, &threads))
        return NULL;
    if (rows < 0 || tokens <= 0 || rows % tokens || tokens > cols) {
        PyErr_Format(PyExc_ValueError,
                     "causal softmax: bad shape (rows %lld, cols %lld, tokens %lld: rows must "
                     "be a multiple of tokens, tokens <= cols)",
                     rows, cols, tokens);
        return NULL;
    }
    float *s = (float *)sp, *sums = (float *)sums_p;
    int64_t group = rows / tokens;
    RowFn fn = row_fn();
    int n = threads < 1 ? 1 : threads;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for num_threads(n) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        sums[r] = fn(s + r * cols, cols - tokens + r / group + 1, cols);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(isa_name()); }

static PyObject *use_portable(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag))
        return NULL;
    force_portable = flag;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"exp_rows", exp_rows, METH_VARARGS, "Unnormalised causal softmax in place (module doc)."},
    {"isa", isa, METH_NOARGS, "The instruction set the row loop runs with."},
    {"use_portable", use_portable, METH_VARARGS, "Run the portable loop (True) or choose."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_causal_softmax", NULL, -1, methods};

PyMODINIT_FUNC PyInit__causal_softmax(void) { return PyModule_Create(&module); }
