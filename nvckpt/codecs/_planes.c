/* Byte planes of a chunk, cut apart and put back in one pass with the GIL released.
 *
 * The compiled twin of planes.split / planes.join (SPEC 11.5 byteshuffle, 11.9 signshift): the
 * numpy version needs ~20 GIL-held calls per 1 MiB chunk and several passes over it; this one is a
 * single loop per chunk that the compiler vectorizes (2.5-3.5x the speed on one core, and the
 * engine's threads no longer queue for the GIL between passes).  Both write the same bytes; the
 * tests compare them.  Bytes are addressed one by one, so any alignment and byte order work.
 *
 * signshift, with h the top byte of an element and l the byte below it:
 *   h' = (h << 1 | l >> 7) & 0xFF,  l' = (h & 0x80) | (l & 0x7F)
 * and back  h = (l' & 0x80) | (h' >> 1),  l = (h' << 7 | l' & 0x7F) & 0xFF.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The top byte h and the byte below it l of one element, shifted (*hs, *ls), and back. */
static inline void shift_up(uint8_t h, uint8_t l, uint8_t *hs, uint8_t *ls)
{
    *hs = (uint8_t)((h << 1) | (l >> 7));
    *ls = (uint8_t)((h & 0x80) | (l & 0x7F));
}

static inline void shift_down(uint8_t hs, uint8_t ls, uint8_t *h, uint8_t *l)
{
    *h = (uint8_t)((ls & 0x80) | (hs >> 1));
    *l = (uint8_t)((hs << 7) | (ls & 0x7F));
}

static void split_planes(const uint8_t *restrict raw, uint8_t *restrict planes, size_t m, int k, int shift)
{
    if (k == 2) {
        uint8_t *restrict p0 = planes, *restrict p1 = planes + m;
        if (shift)
            for (size_t i = 0; i < m; i++)
                shift_up(raw[2 * i + 1], raw[2 * i], &p1[i], &p0[i]);
        else
            for (size_t i = 0; i < m; i++) {
                p0[i] = raw[2 * i];
                p1[i] = raw[2 * i + 1];
            }
        return;
    }
    if (k == 4) {
        uint8_t *restrict p0 = planes, *restrict p1 = planes + m, *restrict p2 = planes + 2 * m,
                *restrict p3 = planes + 3 * m;
        if (shift)
            for (size_t i = 0; i < m; i++) {
                p0[i] = raw[4 * i];
                p1[i] = raw[4 * i + 1];
                shift_up(raw[4 * i + 3], raw[4 * i + 2], &p3[i], &p2[i]);
            }
        else
            for (size_t i = 0; i < m; i++) {
                p0[i] = raw[4 * i];
                p1[i] = raw[4 * i + 1];
                p2[i] = raw[4 * i + 2];
                p3[i] = raw[4 * i + 3];
            }
        return;
    }
    for (size_t i = 0; i < m; i++)
        for (int j = 0; j < k; j++)
            planes[(size_t)j * m + i] = raw[i * (size_t)k + j];
    if (shift) {
        uint8_t *restrict hi = planes + (size_t)(k - 1) * m, *restrict lo = planes + (size_t)(k - 2) * m;
        for (size_t i = 0; i < m; i++)
            shift_up(hi[i], lo[i], &hi[i], &lo[i]);
    }
}

static void join_planes(const uint8_t *restrict planes, uint8_t *restrict raw, size_t m, int k, int shift)
{
    if (k == 2) {
        const uint8_t *restrict p0 = planes, *restrict p1 = planes + m;
        if (shift)
            for (size_t i = 0; i < m; i++)
                shift_down(p1[i], p0[i], &raw[2 * i + 1], &raw[2 * i]);
        else
            for (size_t i = 0; i < m; i++) {
                raw[2 * i] = p0[i];
                raw[2 * i + 1] = p1[i];
            }
        return;
    }
    if (k == 4) {
        const uint8_t *restrict p0 = planes, *restrict p1 = planes + m, *restrict p2 = planes + 2 * m,
                      *restrict p3 = planes + 3 * m;
        if (shift)
            for (size_t i = 0; i < m; i++) {
                raw[4 * i] = p0[i];
                raw[4 * i + 1] = p1[i];
                shift_down(p3[i], p2[i], &raw[4 * i + 3], &raw[4 * i + 2]);
            }
        else
            for (size_t i = 0; i < m; i++) {
                raw[4 * i] = p0[i];
                raw[4 * i + 1] = p1[i];
                raw[4 * i + 2] = p2[i];
                raw[4 * i + 3] = p3[i];
            }
        return;
    }
    for (size_t i = 0; i < m; i++)
        for (int j = 0; j < k; j++)
            raw[i * (size_t)k + j] = planes[(size_t)j * m + i];
    if (shift)
        for (size_t i = 0; i < m; i++) {
            uint8_t *e = raw + i * (size_t)k;
            shift_down(e[k - 1], e[k - 2], &e[k - 1], &e[k - 2]);
        }
}

/* f(src, dst, k, signshift): the first len(src) bytes of dst are written from src. */
static PyObject *run(PyObject *args, int joining)
{
    Py_buffer src, dst;
    int k, shift;
    if (!PyArg_ParseTuple(args, "y*w*ip", &src, &dst, &k, &shift))
        return NULL;
    PyObject *result = NULL;
    size_t n = (size_t)src.len;
    if (k < 1 || k > 255)
        PyErr_Format(PyExc_ValueError, "elementsize %d is out of range 1..255", k);
    else if (shift && k < 2)
        PyErr_SetString(PyExc_ValueError, "signshift needs elements of at least 2 bytes");
    else if (n % (size_t)k)
        PyErr_Format(PyExc_ValueError, "%zu bytes is not a multiple of elementsize %d", n, k);
    else if ((size_t)dst.len < n)
        PyErr_Format(PyExc_ValueError, "the destination holds %zd bytes, fewer than %zu", dst.len, n);
    else if (!PyBuffer_IsContiguous(&src, 'C') || !PyBuffer_IsContiguous(&dst, 'C'))
        PyErr_SetString(PyExc_ValueError, "buffers must be contiguous");
    else {
        const uint8_t *s = src.buf;
        uint8_t *d = dst.buf;
        if ((s < d + n && d < s + n) && n)
            PyErr_SetString(PyExc_ValueError, "source and destination overlap");
        else {
            Py_BEGIN_ALLOW_THREADS
            if (k == 1)
                memcpy(d, s, n);
            else if (joining)
                join_planes(s, d, n / (size_t)k, k, shift);
            else
                split_planes(s, d, n / (size_t)k, k, shift);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* repeats(buf): how many bytes equal the byte before them.  One pass, GIL released: the writer asks it of
 * every low byte plane to see runs (zero low bytes of fp32 weights that came from a shorter type) that only
 * matches can code. */
static PyObject *repeats(PyObject *self, PyObject *args)
{
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src))  /* y* takes C-contiguous buffers only */
        return NULL;
    const uint8_t *p = src.buf;
    size_t n = (size_t)src.len, count = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t i = 1;
    /* blocks of 255 x 32 bytes counted in byte lanes, which the compiler vectorizes (a byte lane
     * cannot overflow in 255 steps), then the rest one by one */
    while (i + 255 * 32 <= n) {
        uint8_t lanes[32] = {0};
        for (int j = 0; j < 255; j++, i += 32)
            for (int l = 0; l < 32; l++)
                lanes[l] += p[i + l] == p[i + l - 1];
        for (int l = 0; l < 32; l++)
            count += lanes[l];
    }
    for (; i < n; i++)
        count += p[i] == p[i - 1];
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return PyLong_FromSize_t(count);
}

/* zstd_frames(buf, max_window): the zstd frames of buf (RFC 8878 section 3.1), walked header by header
 * (skippable frames stepped over): how many zstd frames it holds, or ValueError where buf is not whole frames
 * or a frame's Window_Size is above max_window (SPEC 11.4).  What libzstd's ZSTD_findFrameCompressedSize and
 * ZSTD_getFrameHeader tell, in one call that keeps the GIL (a few header reads per 1 MiB chunk): through
 * cffi those were four calls per chunk that each let the GIL go, and each time it had to be taken back from
 * the other decode thread. */
static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static PyObject *zstd_frames(PyObject *self, PyObject *args)
{
    Py_buffer src;
    unsigned long long max_window;
    if (!PyArg_ParseTuple(args, "y*K", &src, &max_window))
        return NULL;
    const uint8_t *b = src.buf;
    size_t n = (size_t)src.len, pos = 0, frames = 0;
    const char *why = NULL;
    unsigned long long window = 0;
    while (pos < n && !why) {
        size_t left = n - pos;
        const uint8_t *f = b + pos;
        if (left < 4) { why = "a frame cut short"; break; }
        uint32_t magic = (uint32_t)le(f, 4);
        if ((magic & 0xFFFFFFF0u) == 0x184D2A50u) {  /* skippable frame: magic, 4-byte size, data */
            if (left < 8) { why = "a skippable frame cut short"; break; }
            uint64_t size = 8 + le(f + 4, 4);
            if (size > left) { why = "a skippable frame cut short"; break; }
            pos += (size_t)size;
            continue;
        }
        if (magic != 0xFD2FB528u) { why = "not a zstd frame (unknown magic number)"; break; }
        if (left < 5) { why = "a frame header cut short"; break; }
        uint8_t fhd = f[4];
        int fcs_flag = fhd >> 6, single = (fhd >> 5) & 1, checksum = (fhd >> 2) & 1, dict_flag = fhd & 3;
        if (fhd & 0x08) { why = "a frame header with its reserved bit set"; break; }
        static const int dict_bytes[4] = {0, 1, 2, 4}, fcs_bytes[4] = {0, 2, 4, 8};
        int fcs_len = fcs_flag == 0 && single ? 1 : fcs_bytes[fcs_flag];
        size_t header = 5 + (single ? 0 : 1) + (size_t)dict_bytes[dict_flag] + (size_t)fcs_len;
        if (left < header) { why = "a frame header cut short"; break; }
        if (single) {
            uint64_t fcs = le(f + header - fcs_len, fcs_len);
            window = (unsigned long long)(fcs_len == 2 ? fcs + 256 : fcs);
        } else {
            uint8_t wd = f[5];
            /* a window log above 31 is a header libzstd rejects (ZSTD_WINDOWLOG_MAX on 64-bit): an error, as there */
            if (10 + (wd >> 3) > 31) { why = "a frame header whose window log is above 31"; break; }
            unsigned long long base = 1ULL << (10 + (wd >> 3));
            window = base + (base / 8) * (wd & 7);
        }
        size_t at = pos + header;
        for (;;) {  /* blocks: a 3-byte header (last, type, size), then the block's bytes (1 for RLE) */
            if (n - at < 3) { why = "a block header cut short"; break; }
            uint32_t bh = (uint32_t)le(b + at, 3);
            int last = bh & 1, type = (bh >> 1) & 3;
            size_t size = type == 1 ? 1 : (size_t)(bh >> 3);
            if (type == 3) { why = "a block of the reserved type"; break; }
            if (n - at - 3 < size) { why = "a block cut short"; break; }
            at += 3 + size;
            if (last)
                break;
        }
        if (why)
            break;
        if (checksum) {
            if (n - at < 4) { why = "a frame checksum cut short"; break; }
            at += 4;
        }
        if (window > max_window) {  /* after the frame's walk, as libzstd's order: a frame cut short is that */
            PyBuffer_Release(&src);
            return PyErr_Format(PyExc_ValueError, "zstd frame needs a window of %llu bytes, more than the limit of "
                                "%llu (SPEC 11.4)", window, max_window);
        }
        frames++;
        pos = at;
    }
    PyBuffer_Release(&src);
    if (why)
        return PyErr_Format(PyExc_ValueError, "zstd: no whole frame at byte %zu: %s", pos, why);
    if (!frames)
        return PyErr_Format(PyExc_ValueError, "zstd: the chunk holds no zstd frame");
    return PyLong_FromSize_t(frames);
}

static PyObject *split(PyObject *self, PyObject *args) { return run(args, 0); }
static PyObject *join(PyObject *self, PyObject *args) { return run(args, 1); }

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(raw, planes, k, signshift): the byte planes of raw (elements of k bytes) into planes"},
    {"join", join, METH_VARARGS, "join(planes, raw, k, signshift): the inverse of split"},
    {"repeats", repeats, METH_VARARGS, "repeats(buf): how many bytes of buf equal the byte before them"},
    {"zstd_frames", zstd_frames, METH_VARARGS,
     "zstd_frames(buf, max_window): how many zstd frames buf holds; ValueError unless it is whole frames of "
     "windows up to max_window"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
