/* The index of a state of very many tensors, read straight from its msgpack bytes into columns.
 *
 * The compiled twin of the parts of nvckpt/format/bulk.py, entry.py and tree.py that walk an index
 * one entry at a time: the byte ranges of the top-level map's values and of the "tensors" array's
 * entries, the plain data entries of one chunk as columns (SPEC 8.3, 8.4), the tree's tensor paths
 * (SPEC 14.1), and the name checks between them.  A state of a million small tensors opens in well
 * under a second here, against 20 s one Python step per entry.
 *
 * It decides only what is plainly fine.  Anything unusual (an entry that is not a plain one, a tree
 * value other than containers, scalars, tuples and tensor references, bytes msgpack would refuse)
 * is left to the Python path, which says what is wrong with the same message as always: a function
 * returns None for "decode this the plain way", and marks an entry "not plain" for "check this one
 * alone".  msgpack-python has no API that decodes into columns without a Python object per value
 * (what costs the time and memory), hence this small scanner of the msgpack subset an index uses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 512         /* deeper than this: the plain decoding (and its nesting error) */
#define MAX_TREE_DEPTH 64     /* SPEC 16; constants.MAX_TREE_DEPTH */
#define MAX_RANK 64           /* constants.MAX_RANK */
#define PLAIN_NAME_BYTES 1024 /* constants.MAX_NAME_BYTES // 4, the plain entries' bound */
#define LOWEST_OFFSET 72      /* constants.PREAMBLE_SIZE + FRAME_HEADER_SIZE */
#define MAX_CHUNK_LENGTH (16u << 20)

typedef struct {
    const uint8_t *p, *end;
} Rd;

static inline uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* The size of an object's header and what it holds: *items (array items; 2 per map pair) or
 * *payload (str, bin, ext bytes after the header, ext type byte included), or -1 if malformed. */
static int head(Rd *r, uint64_t *items, uint64_t *payload)
{
    if (r->p >= r->end)
        return -1;
    uint8_t t = *r->p;
    size_t left = (size_t)(r->end - r->p);
    *items = 0;
    *payload = 0;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3)
        return 1;
    if (t <= 0x8f) {
        *items = 2u * (t & 0x0f);
        return 1;
    }
    if (t <= 0x9f) {
        *items = t & 0x0f;
        return 1;
    }
    if (t <= 0xbf) {
        *payload = t & 0x1f;
        return 1;
    }
    int n;
    switch (t) {
    case 0xc4: case 0xd9: n = 1; break;
    case 0xc5: case 0xda: n = 2; break;
    case 0xc6: case 0xdb: n = 4; break;
    case 0xc7: n = 1; break;
    case 0xc8: n = 2; break;
    case 0xc9: n = 4; break;
    case 0xca: *payload = 4; return 1;
    case 0xcb: *payload = 8; return 1;
    case 0xcc: case 0xd0: *payload = 1; return 1;
    case 0xcd: case 0xd1: *payload = 2; return 1;
    case 0xce: case 0xd2: *payload = 4; return 1;
    case 0xcf: case 0xd3: *payload = 8; return 1;
    case 0xd4: *payload = 2; return 1;
    case 0xd5: *payload = 3; return 1;
    case 0xd6: *payload = 5; return 1;
    case 0xd7: *payload = 9; return 1;
    case 0xd8: *payload = 17; return 1;
    case 0xdc: case 0xde:
        if (left < 3)
            return -1;
        *items = be(r->p + 1, 2) * (t == 0xde ? 2 : 1);
        return 3;
    case 0xdd: case 0xdf:
        if (left < 5)
            return -1;
        *items = be(r->p + 1, 4) * (t == 0xdf ? 2 : 1);
        return 5;
    default:
        return -1; /* 0xc1, never used */
    }
    if (left < (size_t)1 + n)
        return -1;
    *payload = be(r->p + 1, n) + (t >= 0xc7 && t <= 0xc9 ? 1 : 0);
    return 1 + n;
}

/* Skip one object (any nesting up to MAX_DEPTH); 0, or -1 where the bytes are not that. */
static int skip(Rd *r)
{
    uint64_t stack[MAX_DEPTH];
    int depth = 0;
    uint64_t want = 1;
    for (;;) {
        while (want == 0) {
            if (depth == 0)
                return 0;
            want = stack[--depth];
        }
        want--;
        uint64_t items, payload;
        int h = head(r, &items, &payload);
        if (h < 0 || payload > (uint64_t)(r->end - r->p) - h)
            return -1;
        r->p += h + payload;
        if (items) {
            if (items > (uint64_t)(r->end - r->p) || depth == MAX_DEPTH)
                return -1;
            stack[depth++] = want;
            want = items;
        }
    }
}

/* A non-negative int in a uint or positive fixint encoding. */
static int read_uint(Rd *r, uint64_t *v)
{
    if (r->p >= r->end)
        return -1;
    uint8_t t = *r->p;
    if (t <= 0x7f) {
        *v = t;
        r->p++;
        return 0;
    }
    int n = t == 0xcc ? 1 : t == 0xcd ? 2 : t == 0xce ? 4 : t == 0xcf ? 8 : 0;
    if (!n || r->end - r->p < 1 + n)
        return -1;
    *v = be(r->p + 1, n);
    r->p += 1 + n;
    return 0;
}

static int read_str(Rd *r, const uint8_t **s, size_t *len)
{
    if (r->p >= r->end)
        return -1;
    uint8_t t = *r->p;
    int n = (t >= 0xa0 && t <= 0xbf) ? 0 : t == 0xd9 ? 1 : t == 0xda ? 2 : t == 0xdb ? 4 : -1;
    if (n < 0 || r->end - r->p < 1 + n)
        return -1;
    uint64_t l = n ? be(r->p + 1, n) : (uint64_t)(t & 0x1f);
    if (l > (uint64_t)(r->end - r->p) - 1 - n)
        return -1;
    *s = r->p + 1 + n;
    *len = (size_t)l;
    r->p += 1 + n + l;
    return 0;
}

static int read_array(Rd *r, uint64_t *n)
{
    if (r->p >= r->end)
        return -1;
    uint8_t t = *r->p;
    if (t >= 0x90 && t <= 0x9f) {
        *n = t & 0x0f;
        r->p++;
        return 0;
    }
    int w = t == 0xdc ? 2 : t == 0xdd ? 4 : 0;
    if (!w || r->end - r->p < 1 + w)
        return -1;
    *n = be(r->p + 1, w);
    r->p += 1 + w;
    return 0;
}

/* Valid UTF-8 as Python's strict decoder has it: no overlong forms, no surrogates, nothing past U+10FFFF. */
static int utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int k;
        uint8_t lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf)
            k = 1;
        else if (c >= 0xe0 && c <= 0xef) {
            k = 2;
            if (c == 0xe0)
                lo = 0xa0;
            else if (c == 0xed)
                hi = 0x9f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            k = 3;
            if (c == 0xf0)
                lo = 0x90;
            else if (c == 0xf4)
                hi = 0x8f;
        } else
            return 0;
        if (n - i < (size_t)k + 1)
            return 0;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (int j = 2; j <= k; j++)
            if ((s[i + j] & 0xc0) != 0x80)
                return 0;
        i += k + 1;
    }
    return 1;
}

/* ---- a growing byte buffer ---------------------------------------------------------------- */
typedef struct {
    uint8_t *data;
    size_t len, cap;
} Buf;

static int buf_put(Buf *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *d = realloc(b->data, cap);
        if (!d)
            return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static PyObject *buf_bytes(Buf *b)
{
    return PyBytes_FromStringAndSize((const char *)b->data, (Py_ssize_t)b->len);
}

/* ---- map_spans ---------------------------------------------------------------------------- */
static PyObject *map_spans(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *base = view.buf;
    Rd r = {base, base + view.len};
    PyObject *out = NULL;
    uint64_t n = 0;
    if (r.p < r.end && *r.p >= 0x80 && *r.p <= 0x8f) {
        n = *r.p & 0x0f;
        r.p++;
    } else if (r.p < r.end && (*r.p == 0xde || *r.p == 0xdf) && r.end - r.p >= (*r.p == 0xde ? 3 : 5)) {
        int w = *r.p == 0xde ? 2 : 4;
        n = be(r.p + 1, w);
        r.p += 1 + w;
    } else
        goto plain;
    if (n > (uint64_t)(r.end - r.p))
        goto plain;
    out = PyList_New(0);
    if (!out)
        goto done;
    for (uint64_t i = 0; i < n; i++) {
        Py_ssize_t k0 = r.p - base;
        if (skip(&r) < 0)
            goto plain;
        Py_ssize_t k1 = r.p - base;
        if (skip(&r) < 0)
            goto plain;
        PyObject *t = Py_BuildValue("(nnnn)", k0, k1, k1, (Py_ssize_t)(r.p - base));
        if (!t || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(t);
    }
    if (r.p != r.end)
        goto plain;
    goto done;
plain:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return out;
}

/* ---- entries ------------------------------------------------------------------------------ */
typedef struct {
    const uint8_t *name;
    size_t len;
    int itemsize;
} DtypeInfo;

/* Distinct shapes, each a run of dims in one buffer, found by an open-addressing hash. */
typedef struct {
    Buf dims;          /* u64 dims of every distinct shape, one after another */
    Buf at;            /* u64 (offset in dims << 8 | rank) of each distinct shape */
    uint32_t *slots;   /* shape id + 1, or 0 */
    size_t nslots, count;
} Shapes;

static uint64_t hash_bytes(const uint8_t *p, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static int shapes_grow(Shapes *s)
{
    size_t nslots = s->nslots ? s->nslots * 2 : 64;
    uint32_t *slots = calloc(nslots, sizeof(uint32_t));
    if (!slots)
        return -1;
    const uint64_t *at = (const uint64_t *)s->at.data;
    for (size_t id = 0; id < s->count; id++) {
        const uint8_t *d = s->dims.data + (at[id] >> 8) * 8;
        uint64_t h = hash_bytes(d, (at[id] & 0xff) * 8, 0xcbf29ce484222325ull ^ (at[id] & 0xff));
        size_t j = h & (nslots - 1);
        while (slots[j])
            j = (j + 1) & (nslots - 1);
        slots[j] = (uint32_t)id + 1;
    }
    free(s->slots);
    s->slots = slots;
    s->nslots = nslots;
    return 0;
}

static int64_t shape_id(Shapes *s, const uint64_t *dims, int rank)
{
    if ((s->count + 1) * 2 > s->nslots && shapes_grow(s) < 0)
        return -1;
    uint64_t h = hash_bytes((const uint8_t *)dims, (size_t)rank * 8, 0xcbf29ce484222325ull ^ (uint64_t)rank);
    size_t j = h & (s->nslots - 1);
    const uint64_t *at = (const uint64_t *)s->at.data;
    while (s->slots[j]) {
        size_t id = s->slots[j] - 1;
        if ((int)(at[id] & 0xff) == rank && !memcmp(s->dims.data + (at[id] >> 8) * 8, dims, (size_t)rank * 8))
            return (int64_t)id;
        j = (j + 1) & (s->nslots - 1);
    }
    uint64_t where = (uint64_t)(s->dims.len / 8) << 8 | (uint64_t)rank;
    if (buf_put(&s->dims, dims, (size_t)rank * 8) < 0 || buf_put(&s->at, &where, 8) < 0)
        return -1;
    s->slots[j] = (uint32_t)s->count + 1;
    return (int64_t)s->count++;
}

typedef struct {
    int dtype;
    int rank;
    uint64_t dims[MAX_RANK];
    const uint8_t *name;
    size_t name_len;
    int has_sum;
    uint64_t sum;
    uint64_t chunk[5];
} Plain;

static int key_is(const uint8_t *k, size_t n, const char *want)
{
    return n == strlen(want) && !memcmp(k, want, n);
}

/* One plain data entry of one chunk ({name, dtype, shape, chunks[, checksum]}, SPEC 8.3/8.4, every
 * check of entry.plain_entries but the codec count and index offset, which the caller has): 0, or -1
 * for anything else. */
static int plain_entry(Rd *r, const DtypeInfo *dts, int ndts, Plain *e)
{
    if (r->p >= r->end || *r->p < 0x84 || *r->p > 0x85)
        return -1;
    int pairs = *r->p & 0x0f;
    r->p++;
    int seen = 0;
    e->has_sum = 0;
    for (int i = 0; i < pairs; i++) {
        const uint8_t *k;
        size_t kn;
        if (read_str(r, &k, &kn) < 0)
            return -1;
        int bit;
        if (key_is(k, kn, "name")) {
            bit = 1;
            if (read_str(r, &e->name, &e->name_len) < 0 || e->name_len > PLAIN_NAME_BYTES
                || !utf8_ok(e->name, e->name_len))
                return -1;
        } else if (key_is(k, kn, "dtype")) {
            bit = 2;
            const uint8_t *d;
            size_t dn;
            if (read_str(r, &d, &dn) < 0)
                return -1;
            e->dtype = -1;
            for (int j = 0; j < ndts; j++)
                if (dts[j].len == dn && !memcmp(dts[j].name, d, dn)) {
                    e->dtype = j;
                    break;
                }
            if (e->dtype < 0)
                return -1;
        } else if (key_is(k, kn, "shape")) {
            bit = 4;
            uint64_t rank;
            if (read_array(r, &rank) < 0 || rank > MAX_RANK)
                return -1;
            e->rank = (int)rank;
            for (int j = 0; j < e->rank; j++)
                if (read_uint(r, &e->dims[j]) < 0 || e->dims[j] < 1)
                    return -1;
        } else if (key_is(k, kn, "chunks")) {
            bit = 8;
            uint64_t n;
            if (read_array(r, &n) < 0 || n != 1 || read_array(r, &n) < 0 || n != 5)
                return -1;
            for (int j = 0; j < 5; j++)
                if (read_uint(r, &e->chunk[j]) < 0)
                    return -1;
        } else if (key_is(k, kn, "checksum")) {
            bit = 16;
            if (read_uint(r, &e->sum) < 0)
                return -1;
            e->has_sum = 1;
        } else
            return -1;
        if (seen & bit)
            return -1;
        seen |= bit;
    }
    if ((seen & 15) != 15)
        return -1;
    uint64_t off = e->chunk[0], stored = e->chunk[1], raw = e->chunk[2], codec = e->chunk[3];
    if (off < LOWEST_OFFSET || stored < 1 || stored > MAX_CHUNK_LENGTH || raw < 1 || raw > MAX_CHUNK_LENGTH
        || codec > 0xffff)
        return -1;
    /* raw is the tensor's bytes: the dims' product times the item size (bounded as it grows) */
    uint64_t bytes = (uint64_t)dts[e->dtype].itemsize;
    for (int j = 0; j < e->rank; j++) {
        if (e->dims[j] > MAX_CHUNK_LENGTH || bytes * e->dims[j] > MAX_CHUNK_LENGTH)
            return -1;
        bytes *= e->dims[j];
    }
    return bytes == raw ? 0 : -1;
}

static PyObject *entries(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *dtype_list;
    if (!PyArg_ParseTuple(args, "y*O!", &view, &PyTuple_Type, &dtype_list))
        return NULL;
    PyObject *out = NULL;
    int ndts = (int)PyTuple_GET_SIZE(dtype_list);
    DtypeInfo *dts = calloc(ndts ? ndts : 1, sizeof(DtypeInfo));
    Buf cols[13] = {{0}};
    enum { BOUNDS, PLAIN, DTYPE, SHAPE, HAS_SUM, SUM, NAME_ENDS, NAMES, OFF, STORED, RAW, CODEC, CHECK };
    Shapes shapes = {{0}};
    if (!dts) {
        PyErr_NoMemory();
        goto done;
    }
    for (int j = 0; j < ndts; j++) {
        Py_ssize_t len;
        PyObject *item = PyTuple_GET_ITEM(dtype_list, j);
        if (!PyArg_ParseTuple(item, "s#i", &dts[j].name, &len, &dts[j].itemsize))
            goto done;
        dts[j].len = (size_t)len;
    }
    const uint8_t *base = view.buf;
    Rd r = {base, base + view.len};
    uint64_t n;
    if (read_array(&r, &n) < 0 || n > (uint64_t)(r.end - r.p))
        goto plain;
    uint64_t names_end = 0, zero = 0;
    uint8_t one = 1, nil = 0;
    Plain e;
    int failed = 0;
    for (uint64_t i = 0; i <= n && !failed; i++) {
        uint64_t at = (uint64_t)(r.p - base);
        failed |= buf_put(&cols[BOUNDS], &at, 8);
        if (i == n)
            break;
        Rd probe = r;
        if (plain_entry(&probe, dts, ndts, &e) == 0) {
            int64_t sid = shape_id(&shapes, e.dims, e.rank);
            uint8_t dt = (uint8_t)e.dtype, has = (uint8_t)e.has_sum;
            uint32_t sid32 = (uint32_t)sid;
            uint16_t codec = (uint16_t)e.chunk[3];
            uint64_t sum = e.has_sum ? e.sum : 0;
            names_end += e.name_len;
            failed |= sid < 0 || buf_put(&cols[PLAIN], &one, 1) || buf_put(&cols[DTYPE], &dt, 1)
                      || buf_put(&cols[SHAPE], &sid32, 4) || buf_put(&cols[HAS_SUM], &has, 1)
                      || buf_put(&cols[SUM], &sum, 8) || buf_put(&cols[NAMES], e.name, e.name_len)
                      || buf_put(&cols[NAME_ENDS], &names_end, 8) || buf_put(&cols[OFF], &e.chunk[0], 8)
                      || buf_put(&cols[STORED], &e.chunk[1], 8) || buf_put(&cols[RAW], &e.chunk[2], 8)
                      || buf_put(&cols[CODEC], &codec, 2) || buf_put(&cols[CHECK], &e.chunk[4], 8);
            r = probe;
        } else {
            if (skip(&r) < 0)
                goto plain;
            uint32_t sid0 = 0;
            uint16_t c0 = 0;
            failed |= buf_put(&cols[PLAIN], &nil, 1) || buf_put(&cols[DTYPE], &nil, 1)
                      || buf_put(&cols[SHAPE], &sid0, 4) || buf_put(&cols[HAS_SUM], &nil, 1)
                      || buf_put(&cols[SUM], &zero, 8) || buf_put(&cols[NAME_ENDS], &names_end, 8)
                      || buf_put(&cols[OFF], &zero, 8) || buf_put(&cols[STORED], &zero, 8)
                      || buf_put(&cols[RAW], &zero, 8) || buf_put(&cols[CODEC], &c0, 2)
                      || buf_put(&cols[CHECK], &zero, 8);
        }
    }
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    if (r.p != r.end)
        goto plain;
    {
        PyObject *shape_list = PyList_New((Py_ssize_t)shapes.count);
        if (!shape_list)
            goto done;
        const uint64_t *at = (const uint64_t *)shapes.at.data;
        for (size_t id = 0; id < shapes.count; id++) {
            int rank = (int)(at[id] & 0xff);
            const uint64_t *d = (const uint64_t *)(shapes.dims.data) + (at[id] >> 8);
            PyObject *t = PyTuple_New(rank);
            if (!t) {
                Py_DECREF(shape_list);
                goto done;
            }
            for (int j = 0; j < rank; j++) {
                PyObject *v = PyLong_FromUnsignedLongLong(d[j]);
                if (!v) {
                    Py_DECREF(t);
                    Py_DECREF(shape_list);
                    goto done;
                }
                PyTuple_SET_ITEM(t, j, v);
            }
            PyList_SET_ITEM(shape_list, (Py_ssize_t)id, t);
        }
        static const char *keys[13] = {"bounds", "plain", "dtype", "shape", "has_sum", "sum", "name_ends",
                                       "names", "offset", "stored", "raw", "codec", "checksum"};
        out = PyDict_New();
        if (!out || PyDict_SetItemString(out, "shapes", shape_list) < 0) {
            Py_DECREF(shape_list);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(shape_list);
        for (int c = 0; c < 13; c++) {
            PyObject *b = buf_bytes(&cols[c]);
            free(cols[c].data);
            cols[c].data = NULL;
            if (!b || PyDict_SetItemString(out, keys[c], b) < 0) {
                Py_XDECREF(b);
                Py_CLEAR(out);
                goto done;
            }
            Py_DECREF(b);
        }
    }
    goto done;
plain:
    out = Py_NewRef(Py_None);
done:
    for (int c = 0; c < 13; c++)
        free(cols[c].data);
    free(shapes.dims.data);
    free(shapes.at.data);
    free(shapes.slots);
    free(dts);
    PyBuffer_Release(&view);
    return out;
}

/* ---- names: an open-addressing hash over a blob of names ------------------------------------ */
typedef struct {
    const uint8_t *blob;
    const uint64_t *ends;
    uint32_t *slots; /* entry + 1, or 0 */
    size_t mask;
} Names;

static inline const uint8_t *name_at(const Names *t, size_t i, size_t *len)
{
    uint64_t lo = i ? t->ends[i - 1] : 0;
    *len = (size_t)(t->ends[i] - lo);
    return t->blob + lo;
}

/* The entry of that name among those added, or -1; with add (and none found): adds entry i. */
static int64_t names_find(Names *t, const uint8_t *s, size_t n, int64_t add)
{
    size_t j = hash_bytes(s, n, 0xcbf29ce484222325ull) & t->mask;
    while (t->slots[j]) {
        size_t len, i = t->slots[j] - 1;
        const uint8_t *name = name_at(t, i, &len);
        if (len == n && !memcmp(name, s, n))
            return (int64_t)i;
        j = (j + 1) & t->mask;
    }
    if (add >= 0)
        t->slots[j] = (uint32_t)add + 1;
    return -1;
}

static int names_open(Names *t, Py_buffer *blob, Py_buffer *ends, size_t n)
{
    size_t size = 64;
    while (size < 2 * n + 2)
        size *= 2;
    t->blob = blob->buf;
    t->ends = ends->buf;
    t->mask = size - 1;
    t->slots = calloc(size, sizeof(uint32_t));
    if (!t->slots) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int check_ends(Py_buffer *blob, Py_buffer *ends, Py_ssize_t n)
{
    const uint64_t *e = ends->buf;
    if (ends->len < n * 8 || n > UINT32_MAX - 1 || (n && e[n - 1] > (uint64_t)blob->len)) {
        PyErr_SetString(PyExc_ValueError, "name ends do not fit the names");
        return -1;
    }
    for (Py_ssize_t i = 1; i < n; i++)
        if (e[i] < e[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "name ends must not decrease");
            return -1;
        }
    return 0;
}

/* first_duplicate(blob, ends, n): the first of names 0..n-1 that an earlier one has, or -1. */
static PyObject *first_duplicate(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*y*n", &blob, &ends, &n))
        return NULL;
    PyObject *out = NULL;
    Names t = {0};
    if (n < 0 || check_ends(&blob, &ends, n) < 0 || names_open(&t, &blob, &ends, (size_t)n) < 0)
        goto done;
    int64_t dup = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && dup < 0; i++) {
        size_t len;
        const uint8_t *s = name_at(&t, (size_t)i, &len);
        if (names_find(&t, s, len, i) >= 0)
            dup = i;
    }
    Py_END_ALLOW_THREADS
    out = PyLong_FromLongLong(dup);
done:
    free(t.slots);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    return out;
}

/* name_owner_mismatch(blob, ends, n, paths): the first path of ``paths`` (str -> tensor id) that is the
 * name of an entry other than its tensor (names unique), or None. */
static PyObject *name_owner_mismatch(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends;
    Py_ssize_t n;
    PyObject *paths;
    if (!PyArg_ParseTuple(args, "y*y*nO!", &blob, &ends, &n, &PyDict_Type, &paths))
        return NULL;
    PyObject *out = NULL;
    Names t = {0};
    if (n < 0 || check_ends(&blob, &ends, n) < 0 || names_open(&t, &blob, &ends, (size_t)n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len;
        const uint8_t *s = name_at(&t, (size_t)i, &len);
        names_find(&t, s, len, i);
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(paths, &pos, &key, &value)) {
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(key, &len);
        if (!s)
            goto done;
        int64_t owner = names_find(&t, (const uint8_t *)s, (size_t)len, -1);
        if (owner < 0)
            continue;
        long long tid = PyLong_AsLongLong(value);
        if (tid == -1 && PyErr_Occurred())
            goto done;
        if (tid != owner) {
            out = Py_NewRef(key);
            goto done;
        }
    }
    out = Py_NewRef(Py_None);
done:
    free(t.slots);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    return out;
}

/* ---- tree_paths --------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *base;
    Buf path;          /* the current path's bytes */
    PyObject *paths;   /* str -> tensor id; NULL: only check the tree */
    uint64_t max_tid, refs;
    int plain;         /* set: leave this tree to the plain decoding */
} Walk;

/* A map's keys, for the check that none is there twice: (kind, bytes) in an open-addressing hash. */
typedef struct {
    const uint8_t *s;
    size_t n;
    int kind; /* 0 str (its bytes), 1 int (8 value bytes and a sign) */
    uint8_t num[9];
} Key;

static int walk(Walk *w, Rd *r, int depth);

static int walk_items(Walk *w, Rd *r, uint64_t n, int depth)
{
    size_t keep = w->path.len;
    char seg[24];
    for (uint64_t i = 0; i < n; i++) {
        int len = snprintf(seg, sizeof seg, "%s%llu", keep ? "/" : "", (unsigned long long)i);
        w->path.len = keep;
        if (buf_put(&w->path, seg, (size_t)len) < 0)
            return -1;
        if (walk(w, r, depth + 1) < 0)
            return -1;
        if (w->plain)
            return 0;
    }
    w->path.len = keep;
    return 0;
}

static uint64_t key_hash(const Key *k)
{
    return k->kind ? hash_bytes(k->num, 9, 7) : hash_bytes(k->s, k->n, 3);
}

static int key_eq(const Key *a, const Key *b)
{
    if (a->kind != b->kind)
        return 0;
    return a->kind ? !memcmp(a->num, b->num, 9) : a->n == b->n && !memcmp(a->s, b->s, a->n);
}

static int walk_map(Walk *w, Rd *r, uint64_t n, int depth)
{
    size_t keep = w->path.len;
    size_t size = 16;
    while (size < 2 * n + 2)
        size *= 2;
    Key *keys = malloc(n ? n * sizeof(Key) : 1);
    uint32_t *slots = calloc(size, sizeof(uint32_t));
    int rc = -1;
    if (!keys || !slots) {
        PyErr_NoMemory();
        goto done;
    }
    for (uint64_t i = 0; i < n; i++) {
        Key *k = &keys[i];
        char num[24];
        const uint8_t *seg;
        size_t seglen;
        if (r->p >= r->end) {
            w->plain = 1;
            rc = 0;
            goto done;
        }
        uint8_t t = *r->p;
        if ((t >= 0xa0 && t <= 0xbf) || t == 0xd9 || t == 0xda || t == 0xdb) {
            if (read_str(r, &k->s, &k->n) < 0 || !utf8_ok(k->s, k->n)) {
                w->plain = 1;
                rc = 0;
                goto done;
            }
            k->kind = 0;
            seg = k->s;
            seglen = k->n;
        } else {
            /* an int key: its decimal form is the segment */
            int neg = 0;
            uint64_t v;
            if (t <= 0x7f || (t >= 0xcc && t <= 0xcf)) {
                if (read_uint(r, &v) < 0) {
                    w->plain = 1;
                    rc = 0;
                    goto done;
                }
            } else if (t >= 0xe0) {
                neg = 1;
                v = (uint64_t)(-(int64_t)(int8_t)t);
                r->p++;
            } else if (t >= 0xd0 && t <= 0xd3) {
                int nb = 1 << (t - 0xd0);
                if (r->end - r->p < 1 + nb) {
                    w->plain = 1;
                    rc = 0;
                    goto done;
                }
                uint64_t u = be(r->p + 1, nb);
                int64_t s = nb == 8 ? (int64_t)u : (int64_t)(u << (64 - 8 * nb)) >> (64 - 8 * nb);
                r->p += 1 + nb;
                neg = s < 0;
                v = neg ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
            } else {
                w->plain = 1; /* any other key type: the plain decoding and check_tree say what */
                rc = 0;
                goto done;
            }
            if (v == 0)
                neg = 0;
            k->kind = 1;
            k->num[0] = (uint8_t)neg;
            memcpy(k->num + 1, &v, 8);
            int len = snprintf(num, sizeof num, "%s%llu", neg ? "-" : "", (unsigned long long)v);
            seg = (const uint8_t *)num;
            seglen = (size_t)len;
        }
        size_t j = key_hash(k) & (size - 1);
        while (slots[j]) {
            if (key_eq(&keys[slots[j] - 1], k)) {
                w->plain = 1; /* a key twice: the plain decoding says which */
                rc = 0;
                goto done;
            }
            j = (j + 1) & (size - 1);
        }
        slots[j] = (uint32_t)i + 1;
        /* the segment, escaped as tree.escape does (RFC 6901) */
        w->path.len = keep;
        if (keep && buf_put(&w->path, "/", 1) < 0)
            goto nomem;
        for (size_t c = 0; c < seglen; c++) {
            const char *x = seg[c] == '~' ? "~0" : seg[c] == '/' ? "~1" : NULL;
            if (x ? buf_put(&w->path, x, 2) : buf_put(&w->path, &seg[c], 1))
                goto nomem;
        }
        if (walk(w, r, depth + 1) < 0)
            goto done;
        if (w->plain) {
            rc = 0;
            goto done;
        }
    }
    w->path.len = keep;
    rc = 0;
    goto done;
nomem:
    PyErr_NoMemory();
done:
    free(keys);
    free(slots);
    return rc;
}

/* One value of the tree at ``depth`` (root 1): -1 with a Python error, else 0 (w->plain set to leave it
 * to the plain decoding). */
static int walk(Walk *w, Rd *r, int depth)
{
    if (r->p >= r->end) {
        w->plain = 1;
        return 0;
    }
    uint8_t t = *r->p;
    if ((t >= 0x80 && t <= 0x9f) || (t >= 0xdc && t <= 0xdf)) {
        uint64_t items, payload;
        int h = head(r, &items, &payload);
        if (h < 0 || depth > MAX_TREE_DEPTH - 1 || items > (uint64_t)(r->end - r->p)) {
            w->plain = 1;
            return 0;
        }
        r->p += h;
        int is_map = t <= 0x8f || t >= 0xde;
        return is_map ? walk_map(w, r, items / 2, depth) : walk_items(w, r, items, depth);
    }
    if (t >= 0xa0 && t <= 0xbf) {
        const uint8_t *s;
        size_t n;
        if (read_str(r, &s, &n) < 0 || !utf8_ok(s, n))
            w->plain = 1;
        return 0;
    }
    if (t == 0xd9 || t == 0xda || t == 0xdb) {
        const uint8_t *s;
        size_t n;
        if (read_str(r, &s, &n) < 0 || !utf8_ok(s, n))
            w->plain = 1;
        return 0;
    }
    if ((t >= 0xc7 && t <= 0xc9) || (t >= 0xd4 && t <= 0xd8)) {
        uint64_t items, payload;
        int h = head(r, &items, &payload);
        if (h < 0 || payload > (uint64_t)(r->end - r->p) - h) {
            w->plain = 1;
            return 0;
        }
        int8_t code = (int8_t)r->p[h];
        const uint8_t *data = r->p + h + 1;
        uint64_t len = payload - 1;
        r->p += h + payload;
        if (code == 1 && len == 4) { /* a tensor reference (SPEC 9) */
            uint64_t tid = (uint64_t)data[0] | (uint64_t)data[1] << 8 | (uint64_t)data[2] << 16
                           | (uint64_t)data[3] << 24;
            if (tid > w->max_tid)
                w->max_tid = tid;
            w->refs++;
            if (!w->paths)
                return 0;
            PyObject *path = PyUnicode_DecodeUTF8((const char *)w->path.data, (Py_ssize_t)w->path.len, "strict");
            PyObject *id = path ? PyLong_FromUnsignedLongLong(tid) : NULL;
            if (!id) {
                Py_XDECREF(path);
                return -1;
            }
            PyObject *had = PyDict_SetDefault(w->paths, path, id);
            int clash = had && PyObject_RichCompareBool(had, id, Py_NE);
            Py_DECREF(path);
            Py_DECREF(id);
            if (!had || clash < 0)
                return -1;
            if (clash)
                w->plain = 1; /* a name for two tensors: the plain checks say so */
            return 0;
        }
        if (code == 2) { /* a tuple: its data is exactly one array (SPEC 9) */
            Rd inner = {data, data + len};
            uint64_t n;
            if (read_array(&inner, &n) < 0 || n > len || depth > MAX_TREE_DEPTH - 1) {
                w->plain = 1;
                return 0;
            }
            if (walk_items(w, &inner, n, depth) < 0)
                return -1;
            if (!w->plain && inner.p != inner.end)
                w->plain = 1;
            return 0;
        }
        w->plain = 1; /* typed values, arrays, paths, unknown types: the plain decoding and checks */
        return 0;
    }
    /* nil, bool, ints, floats, bin */
    Rd probe = *r;
    if (t == 0xc1 || skip(&probe) < 0) {
        w->plain = 1;
        return 0;
    }
    *r = probe;
    return 0;
}

/* tree_paths(data, build): (paths, max tensor id) of a tree made only of maps with str or int keys,
 * arrays, tuples, scalars and tensor references: every path to a tensor (SPEC 14.1, tree.leaf_paths'
 * order, escaping, first path kept) -> its tensor id (without build: None, only the tree checked);
 * None for any other tree, one with no reference, or (with build) one where a path names two tensors. */
static PyObject *tree_paths(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int build;
    if (!PyArg_ParseTuple(args, "y*p", &view, &build))
        return NULL;
    Walk w = {view.buf, {0}, build ? PyDict_New() : NULL, 0, 0, 0};
    PyObject *out = NULL;
    if (build && !w.paths)
        goto done;
    Rd r = {view.buf, (const uint8_t *)view.buf + view.len};
    if (walk(&w, &r, 1) < 0)
        goto done;
    if (w.plain || r.p != r.end || w.refs == 0)
        out = Py_NewRef(Py_None);
    else
        out = Py_BuildValue("(OK)", w.paths ? w.paths : Py_None, (unsigned long long)w.max_tid);
done:
    Py_XDECREF(w.paths);
    free(w.path.data);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"map_spans", map_spans, METH_O,
     "map_spans(data) -> [(key start, key end, value start, value end)] of a msgpack map filling data, or None"},
    {"entries", entries, METH_VARARGS,
     "entries(data, dtypes) -> dict of columns of a tensors array (its plain entries), or None"},
    {"tree_paths", tree_paths, METH_VARARGS, "tree_paths(data, build) -> (paths or None, max tensor id) or None"},
    {"first_duplicate", first_duplicate, METH_VARARGS,
     "first_duplicate(blob, ends, n) -> the first of names 0..n-1 that an earlier one has, or -1"},
    {"name_owner_mismatch", name_owner_mismatch, METH_VARARGS,
     "name_owner_mismatch(blob, ends, n, paths) -> the first path that names another entry, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columns",
                                    "The index of a state of very many tensors, read into columns.", -1, methods};

PyMODINIT_FUNC PyInit__columns(void)
{
    return PyModule_Create(&module);
}
