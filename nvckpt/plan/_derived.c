/* Derived-tensor checks on host memory, one pass each with the GIL released.
 *
 * rne_differs(source, candidate): does the bf16 candidate differ anywhere from bf16_rne of the float32
 * source (SPEC 14.2: round to nearest even; a NaN keeps its upper half with the quiet bit set)?  The
 * torch version of the same test (plan/derived.py) makes a rounded copy, a comparison, a NaN mask and
 * a reduction: five passes and four temporaries per pair.  differ(a, b): do two byte buffers differ?
 * rne(source, out): bf16_rne of the float32 source written into out, the load's computation of a
 * derived tensor in one pass (torch's cast, a NaN mask and its reduction are three, and wake torch's
 * intra-op threads, which then spin on the cores the decoders need).
 * rne_differs_many / differ_many: the same checks of many pairs given by address, in one call.
 * All read and write elements in the machine's byte order, as the tensors hold them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 4096 /* elements per check of the accumulated difference: the loop within it vectorizes */

/* SPEC 14.2's bf16_rne of one float32 word */
static inline uint16_t rne_word(uint32_t u)
{
    /* no overflow: the largest non-NaN word is 0xFF800000 (-inf) */
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? ((u >> 16) | 0x0040u) : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static int rne_differs_impl(const uint8_t *src, const uint8_t *cand, size_t n)
{
    for (size_t start = 0; start < n; start += BLOCK) {
        size_t stop = n - start < BLOCK ? n : start + BLOCK;
        uint32_t diff = 0;
        for (size_t i = start; i < stop; i++) {
            uint32_t u;
            uint16_t c;
            memcpy(&u, src + 4 * i, 4);
            memcpy(&c, cand + 2 * i, 2);
            diff |= (uint32_t)(rne_word(u) ^ c);
        }
        if (diff)
            return 1;
    }
    return 0;
}

static void rne_impl(const uint8_t *src, uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + 4 * i, 4);
        uint16_t r = rne_word(u);
        memcpy(out + 2 * i, &r, 2);
    }
}

/* Two C-contiguous buffers parsed with fmt ("y*y*": both read; "y*w*": the second written); -1 with the
 * error set, and nothing held, where they are not. */
static int get(PyObject *args, const char *fmt, Py_buffer *a, Py_buffer *b)
{
    if (!PyArg_ParseTuple(args, fmt, a, b))
        return -1;
    if (!PyBuffer_IsContiguous(a, 'C') || !PyBuffer_IsContiguous(b, 'C')) {
        PyBuffer_Release(a);
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "buffers must be contiguous");
        return -1;
    }
    return 0;
}

/* Does a float32 source hold as many elements as a bfloat16 buffer (what names it in the error)?  0 with
 * the error set where not. */
static int same_elements(const Py_buffer *src, const Py_buffer *words, const char *what)
{
    if (src->len % 4 == 0 && words->len * 2 == src->len)
        return 1;
    PyErr_Format(PyExc_ValueError, "a source of %zd bytes (float32) and %s of %zd bytes (bfloat16) "
                 "do not hold the same number of elements", src->len, what, words->len);
    return 0;
}

static PyObject *rne_differs(PyObject *self, PyObject *args)
{
    Py_buffer src, cand;
    if (get(args, "y*y*", &src, &cand) < 0)
        return NULL;
    PyObject *result = NULL;
    if (same_elements(&src, &cand, "a candidate")) {
        int d;
        Py_BEGIN_ALLOW_THREADS
        d = rne_differs_impl(src.buf, cand.buf, (size_t)cand.len / 2);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(d);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&cand);
    return result;
}

static PyObject *differ(PyObject *self, PyObject *args)
{
    Py_buffer a, b;
    if (get(args, "y*y*", &a, &b) < 0)
        return NULL;
    int d = 1;
    if (a.len == b.len) {
        Py_BEGIN_ALLOW_THREADS
        d = a.len ? memcmp(a.buf, b.buf, (size_t)a.len) != 0 : 0;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(d);
}

static PyObject *rne(PyObject *self, PyObject *args)
{
    Py_buffer src, out;
    if (get(args, "y*w*", &src, &out) < 0)
        return NULL;
    PyObject *result = NULL;
    if (same_elements(&src, &out, "an output")) {
        Py_BEGIN_ALLOW_THREADS
        rne_impl(src.buf, out.buf, (size_t)out.len / 2);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* The batch forms: pairs given by address, so that thousands of small pairs (a model's biases and norms,
 * an optimizer's step counts) cost one call instead of several torch calls each.  The caller passes the
 * addresses of live, C-contiguous host tensors it holds for the duration of the call. */
static void release_batch(Py_buffer *a, Py_buffer *b, Py_buffer *n, Py_buffer *out)
{
    PyBuffer_Release(a);
    PyBuffer_Release(b);
    PyBuffer_Release(n);
    PyBuffer_Release(out);
}

static int get_batch(PyObject *args, Py_buffer *a, Py_buffer *b, Py_buffer *n, Py_buffer *out)
{
    if (!PyArg_ParseTuple(args, "y*y*y*w*", a, b, n, out))
        return -1;
    Py_ssize_t pairs = n->len / (Py_ssize_t)sizeof(uint64_t);
    if (a->len != n->len || b->len != n->len || n->len % (Py_ssize_t)sizeof(uint64_t) || out->len != pairs
        || !PyBuffer_IsContiguous(a, 'C') || !PyBuffer_IsContiguous(b, 'C') || !PyBuffer_IsContiguous(n, 'C')
        || !PyBuffer_IsContiguous(out, 'C')) {
        release_batch(a, b, n, out);
        PyErr_SetString(PyExc_ValueError, "expected three contiguous arrays of one uint64 per pair and a uint8 "
                        "array of one flag per pair");
        return -1;
    }
    return 0;
}

static int rne_differs_at(uint64_t src, uint64_t cand, uint64_t n)
{
    return rne_differs_impl((const uint8_t *)(uintptr_t)src, (const uint8_t *)(uintptr_t)cand, (size_t)n);
}

static int differ_at(uint64_t a, uint64_t b, uint64_t n)
{
    return n && memcmp((const void *)(uintptr_t)a, (const void *)(uintptr_t)b, (size_t)n) != 0;
}

/* check(a[i], b[i], n[i]) of every pair, a flag each into out, with the GIL released. */
static PyObject *many(PyObject *args, int (*check)(uint64_t, uint64_t, uint64_t))
{
    Py_buffer a, b, n, out;
    if (get_batch(args, &a, &b, &n, &out) < 0)
        return NULL;
    size_t pairs = (size_t)n.len / sizeof(uint64_t);
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < pairs; i++) {
        uint64_t x, y, k;
        memcpy(&x, (const uint8_t *)a.buf + 8 * i, 8);
        memcpy(&y, (const uint8_t *)b.buf + 8 * i, 8);
        memcpy(&k, (const uint8_t *)n.buf + 8 * i, 8);
        ((uint8_t *)out.buf)[i] = (uint8_t)check(x, y, k);
    }
    Py_END_ALLOW_THREADS
    release_batch(&a, &b, &n, &out);
    Py_RETURN_NONE;
}

static PyObject *rne_differs_many(PyObject *self, PyObject *args) { return many(args, rne_differs_at); }

static PyObject *differ_many(PyObject *self, PyObject *args) { return many(args, differ_at); }

static PyMethodDef methods[] = {
    {"rne", rne, METH_VARARGS, "rne(source, out): the bfloat16 words of bf16_rne of the float32 words of source, into out"},
    {"rne_differs", rne_differs, METH_VARARGS,
     "rne_differs(source, candidate): True when the bfloat16 words of candidate differ anywhere from "
     "bf16_rne of the float32 words of source"},
    {"differ", differ, METH_VARARGS, "differ(a, b): True when the two buffers differ (in length or in a byte)"},
    {"rne_differs_many", rne_differs_many, METH_VARARGS,
     "rne_differs_many(sources, candidates, counts, out): rne_differs of each pair given by the addresses of "
     "its float32 source and bfloat16 candidate and its element count (uint64 arrays), a flag per pair into out"},
    {"differ_many", differ_many, METH_VARARGS,
     "differ_many(a, b, nbytes, out): differ of each pair of buffers given by address and length (uint64 "
     "arrays), a flag per pair into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_derived", NULL, -1, methods};

PyMODINIT_FUNC PyInit__derived(void) { return PyModule_Create(&module); }
