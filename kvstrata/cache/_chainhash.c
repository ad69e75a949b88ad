/* The cache's two hot loops, native: chained page keys (commit, storage probes; see keys.py) and the
 * token-index walk (admission's match; see radix.py). Both only read bytes and dicts; all tier
 * state stays in Python.
 *
 * key(page i) = xxh3-128(int32 token bytes of page i, seed = low 64 bits of key(page i-1)), as
 * a 128-bit Python int (high 64 bits << 64 | low 64), the value python-xxhash's
 * xxh3_128_intdigest gives. The data may hold the ids at 2 bytes each (a vocab that fits 16
 * bits: the tree keeps half the bytes); each page is widened to int32 before it is hashed, so
 * a page's key never depends on how its ids were stored. The Python loop cost ~0.35 us a page (a slice, a call, a seed mask,
 * an int); here the hashing runs without the GIL and only the result ints are made under it.
 * xxhash is used header-only (Debian's libxxhash-dev), so nothing is linked at run time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

/* pages hashed before the GIL is worth releasing (a release and reacquire costs ~0.1 us) */
#define RELEASE_GIL_PAGES 64

static PyObject *key_to_int(XXH128_hash_t h) {
    unsigned char le[16];
    for (int b = 0; b < 8; b++) {
        le[b] = (unsigned char)(h.low64 >> (8 * b));
        le[8 + b] = (unsigned char)(h.high64 >> (8 * b));
    }
    /* one int from 16 bytes (3 for hi << 64 | lo); kept by CPython 3.11-3.13 */
    return _PyLong_FromByteArray(le, 16, /*little_endian=*/1, /*is_signed=*/0);
}

static int check_span(Py_ssize_t len, Py_ssize_t page, Py_ssize_t start, Py_ssize_t stop) {
    if (page <= 0) {
        PyErr_Format(PyExc_ValueError, "page_bytes must be positive, got %zd", page);
        return -1;
    }
    if (start < 0 || stop < start || stop > len) {
        PyErr_Format(PyExc_ValueError, "span [%zd, %zd) is outside the %zd data bytes", start,
                     stop, len);
        return -1;
    }
    return 0;
}

/* The key of one page of `tokens` ids stored `width` bytes each (2: unsigned 16-bit, widened
 * into `wide`, room for `tokens` int32; 4: native int32, hashed in place). */
static XXH128_hash_t hash_page(const char *at, Py_ssize_t tokens, int width, uint32_t *wide,
                               unsigned long long seed) {
    if (width == 4)
        return XXH3_128bits_withSeed(at, (size_t)tokens * 4, seed);
    for (Py_ssize_t t = 0; t < tokens; t++) {
        uint16_t id; /* memcpy: the data need not be 2-byte aligned */
        memcpy(&id, at + 2 * t, 2);
        wide[t] = id;
    }
    return XXH3_128bits_withSeed(wide, (size_t)tokens * 4, seed);
}

/* chain_keys(data, page_bytes, key, start, stop, width=4) -> list[int]: the keys of the whole
 * pages in data[start:stop] (ids stored `width` bytes each: 2 or 4), chained after `key` (only
 * its low 64 bits are read). */
static PyObject *chain_keys(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t page, start, stop;
    int width = 4;
    PyObject *key;
    if (!PyArg_ParseTuple(args, "y*nOnn|i", &buf, &page, &key, &start, &stop, &width))
        return NULL;
    PyObject *out = NULL;
    XXH128_hash_t *hashes = NULL;
    uint32_t *wide = NULL;
    if (check_span(buf.len, page, start, stop) < 0)
        goto done;
    if ((width != 2 && width != 4) || page % width) {
        PyErr_Format(PyExc_ValueError,
                     "token width must be 2 or 4 and divide page_bytes %zd, got %d", page, width);
        goto done;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLongMask(key);
    if (seed == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    Py_ssize_t n = (stop - start) / page;
    hashes = PyMem_RawMalloc(sizeof(XXH128_hash_t) * (n ? n : 1));
    wide = width == 2 ? PyMem_RawMalloc((size_t)page * 2) : NULL; /* one page as int32 */
    if (hashes == NULL || (width == 2 && wide == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    const char *at = (const char *)buf.buf + start;
    /* the buffer stays exported while the GIL is released (callers pass bytes: immutable) */
    PyThreadState *released = n >= RELEASE_GIL_PAGES ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n; i++, at += page) {
        hashes[i] = hash_page(at, page / width, width, wide, seed);
        seed = hashes[i].low64;
    }
    if (released != NULL)
        PyEval_RestoreThread(released);
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *k = key_to_int(hashes[i]);
        if (k == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, k);
    }
done:
    PyMem_RawFree(hashes);
    PyMem_RawFree(wide);
    PyBuffer_Release(&buf);
    return out;
}

static PyObject *TOKENS, *TINDEX; /* interned attribute names of a radix Node */

/* token_walk(index, data, limit, page) -> (nodes, off, cut): the path a request's token bytes
 * data[:limit] take down a token index (a dict: first page's bytes -> Node; each node's
 * `tokens` are its pages' bytes and `tindex` its children's index or None). nodes: the nodes
 * whose whole edge matched, in order, then the one the request leaves or ends inside, if any;
 * off: bytes matched by the whole edges; cut: whole pages matched inside that last node (0 when
 * every listed node matched whole). Only bytes are compared here; the caller splits, touches
 * and reads tiers (radix.py). */
static PyObject *token_walk(PyObject *self, PyObject *args) {
    PyObject *index;
    Py_buffer buf;
    Py_ssize_t limit, page, off = 0, cut = 0;
    if (!PyArg_ParseTuple(args, "Oy*nn", &index, &buf, &limit, &page))
        return NULL;
    PyObject *nodes = NULL;
    if (check_span(buf.len, page, 0, limit) < 0 || (nodes = PyList_New(0)) == NULL)
        goto done;
    const char *data = buf.buf;
    Py_INCREF(index);
    while (off + page <= limit && PyDict_Check(index) && PyDict_GET_SIZE(index)) {
        PyObject *first = PyBytes_FromStringAndSize(data + off, page);
        if (first == NULL)
            goto fail;
        PyObject *child = PyDict_GetItemWithError(index, first); /* borrowed */
        Py_DECREF(first);
        if (child == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (PyList_Append(nodes, child) < 0)
            goto fail;
        PyObject *edge = PyObject_GetAttr(child, TOKENS);
        if (edge == NULL)
            goto fail;
        if (!PyBytes_Check(edge) || PyBytes_GET_SIZE(edge) % page || !PyBytes_GET_SIZE(edge)) {
            Py_DECREF(edge);
            PyErr_SetString(PyExc_TypeError, "a token-indexed node's tokens are whole pages");
            goto fail;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(edge), most = n < limit - off ? n : limit - off;
        const char *e = PyBytes_AS_STRING(edge);
        if (most < n || memcmp(e + page, data + off + page, (size_t)(most - page)) != 0) {
            cut = 1; /* the first page matched by the lookup */
            while ((cut + 1) * page <= most &&
                   memcmp(e + cut * page, data + off + cut * page, (size_t)page) == 0)
                cut++;
            Py_DECREF(edge); /* cut * page < n: the request ends or turns inside this edge */
            break;
        }
        Py_DECREF(edge);
        off += n;
        Py_SETREF(index, PyObject_GetAttr(child, TINDEX));
        if (index == NULL)
            goto fail;
    }
    Py_XDECREF(index);
    PyBuffer_Release(&buf);
    return Py_BuildValue("(Nnn)", nodes, off, cut);
fail:
    Py_XDECREF(index);
    Py_CLEAR(nodes);
done:
    PyBuffer_Release(&buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(data, page_bytes, key, start, stop, width=4) -> keys of the whole pages in "
     "data[start:stop] (ids of `width` bytes, hashed as int32), chained after key"},
    {"token_walk", token_walk, METH_VARARGS,
     "token_walk(index, data, limit, page) -> (nodes, off, cut): the token-index path of "
     "data[:limit]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chainhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chainhash(void) {
    TOKENS = PyUnicode_InternFromString("tokens");
    TINDEX = PyUnicode_InternFromString("tindex");
    if (TOKENS == NULL || TINDEX == NULL)
        return NULL;
    return PyModule_Create(&module);
}
