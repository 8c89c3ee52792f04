/* Derived-tensor checks on host memory, one pass each with the GIL released.
 *
 * rne_differs(source, candidate): does the bf16 candidate differ anywhere from bf16_rne of the float32
 * source (SPEC 14.2: round to nearest even; a NaN keeps its upper half with the quiet bit set)?  The
 * torch version of the same test (plan/derived.py) makes a rounded copy, a comparison, a NaN mask and
 * a reduction: five passes and four temporaries per pair.  differ(a, b): do two byte buffers differ?
 * Both read elements in the machine's byte order, as the tensors hold them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 4096 /* elements per check of the accumulated difference: the loop within it vectorizes */

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
            uint32_t hi = u >> 16;
            /* no overflow: the largest non-NaN word is 0xFF800000 (-inf) */
            uint32_t rounded = (u + 0x7FFFu + (hi & 1u)) >> 16;
            uint32_t r = (u & 0x7FFFFFFFu) > 0x7F800000u ? (hi | 0x0040u) : rounded;
            diff |= (r ^ c) & 0xFFFFu;
        }
        if (diff)
            return 1;
    }
    return 0;
}

static int get(PyObject *args, Py_buffer *a, Py_buffer *b)
{
    if (!PyArg_ParseTuple(args, "y*y*", a, b))
        return -1;
    if (!PyBuffer_IsContiguous(a, 'C') || !PyBuffer_IsContiguous(b, 'C')) {
        PyBuffer_Release(a);
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "buffers must be contiguous");
        return -1;
    }
    return 0;
}

static PyObject *rne_differs(PyObject *self, PyObject *args)
{
    Py_buffer src, cand;
    if (get(args, &src, &cand) < 0)
        return NULL;
    PyObject *result = NULL;
    if (src.len % 4 || cand.len * 2 != src.len)
        PyErr_Format(PyExc_ValueError, "a source of %zd bytes (float32) and a candidate of %zd bytes (bfloat16) "
                     "do not hold the same number of elements", src.len, cand.len);
    else {
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
    if (get(args, &a, &b) < 0)
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

static PyMethodDef methods[] = {
    {"rne_differs", rne_differs, METH_VARARGS,
     "rne_differs(source, candidate): True when the bfloat16 words of candidate differ anywhere from "
     "bf16_rne of the float32 words of source"},
    {"differ", differ, METH_VARARGS, "differ(a, b): True when the two buffers differ (in length or in a byte)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_derived", NULL, -1, methods};

PyMODINIT_FUNC PyInit__derived(void) { return PyModule_Create(&module); }
