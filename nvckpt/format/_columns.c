/* The index of a state of very many tensors, read straight from its msgpack bytes into columns.
 *
 * The compiled twin of the parts of nvckpt/format/bulk.py, entry.py and tree.py that walk an index
 * one entry at a time: the byte ranges of the top-level map's values and of the "tensors" array's
 * entries, the entries as a writer makes them as columns (data tensors of any number of chunks, views,
 * derived tensors, their optional keys: SPEC 8.3-8.5), the tree's tensor paths (SPEC 14.1), and the name
 * checks between them.  A state of a million small tensors opens in about a second here, against 20 s
 * one Python step per entry; a training state (bf16 weights derived from fp32 masters, optimizer step
 * counters stored once) at about the same cost an entry, against 20-35 us an entry one by one.
 *
 * It decides only what is plainly fine.  Anything unusual (an entry unlike a writer's, a tree value
 * other than containers, scalars, tuples and tensor references, bytes msgpack would refuse) is left to
 * the Python path, which says what is wrong with the same message as always: a function returns None
 * for "decode this the plain way", and marks an entry "not in the columns" for "check this one alone".  msgpack-python has no API that decodes into columns without a Python object per value
 * (what costs the time and memory), hence this small scanner of the msgpack subset an index uses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define MAX_DEPTH 512         /* deeper than this: the plain decoding (and its nesting error) */
#define MAX_TREE_DEPTH 64     /* SPEC 16; constants.MAX_TREE_DEPTH */
#define MAX_RANK 64           /* constants.MAX_RANK */
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

/* A zeroed hash table of n u64 slots.  Its inserts are random reads of memory: a large one is asked to
 * be laid on huge pages (one TLB entry per 2 MiB, where 4 KiB pages cost a page walk per insert: 2-3x the
 * time of a million inserts). */
static uint64_t *table_new(size_t n)
{
    size_t bytes = n * sizeof(uint64_t);
    if (bytes < (4u << 20))
        return calloc(n, sizeof(uint64_t));
    void *p = NULL;
    if (posix_memalign(&p, 2u << 20, bytes))
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    memset(p, 0, bytes);
    return p;
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

/* FNV-1a, its bits mixed (murmur3's finalizer): the tables below take the low bits. */
static uint64_t hash_bytes(const uint8_t *p, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ (h >> 33);
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

/* An output column written in place: a bytes object of a bounded size, cut to its length at the end
 * (the pages never written are never touched: no copy, no memory beyond what it holds). */
typedef struct {
    PyObject *obj;
    char *p;
    size_t len, cap;
} Col;

static int col_open(Col *c, size_t cap)
{
    c->obj = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(cap ? cap : 1));
    c->p = c->obj ? PyBytes_AS_STRING(c->obj) : NULL;
    c->len = 0;
    c->cap = cap;
    return c->obj ? 0 : -1;
}

static inline void col_put(Col *c, const void *src, size_t n)
{
    memcpy(c->p + c->len, src, n); /* (caps are bounds: see entries) */
    c->len += n;
}

/* col_put where the cap is an estimate: grown as needed (-1 with a Python error). */
static int col_add(Col *c, const void *src, size_t n)
{
    if (c->len + n > c->cap) {
        size_t cap = c->cap * 2 > c->len + n ? c->cap * 2 : c->len + n;
        if (_PyBytes_Resize(&c->obj, (Py_ssize_t)cap) < 0)
            return -1;
        c->p = PyBytes_AS_STRING(c->obj);
        c->cap = cap;
    }
    col_put(c, src, n);
    return 0;
}

/* The column's bytes object, cut to its length (the column gives it up). */
static PyObject *col_take(Col *c)
{
    if (_PyBytes_Resize(&c->obj, (Py_ssize_t)c->len) < 0)
        return NULL;
    PyObject *out = c->obj;
    c->obj = NULL;
    return out;
}

#define MAX_NAME_BYTES 4096           /* constants.MAX_NAME_BYTES */
#define MAX_TENSORS (1u << 24)        /* constants.MAX_TENSORS */
#define MAX_TENSOR_BYTES (1ull << 62) /* constants.MAX_TENSOR_BYTES */

/* An entry's kind (the "kind" column): DERIVED + j for a tensor derived by the j-th known function. */
enum { DATA = 0, VIEW = 1, DERIVED = 2 };

/* The columns of entries(): one value per entry (BOUNDS: one more), per row (an entry read here), per chunk
 * (OFF .. CHECK, the rows' chunks in order) or per view row (VIEW_*). */
enum { BOUNDS, IN_COLUMNS, DTYPE, SHAPE, HAS_SUM, SUM, NAME_ENDS, NAMES, KIND, INTERNAL, REF, NCHUNKS,
       OFF, STORED, RAW, CODEC, CHECK, VIEW_OFFSET, VIEW_STRIDE, VIEW_END, NCOLS };

typedef struct {
    int dtype, rank, kind, internal, has_sum, view_rank;
    uint64_t dims[MAX_RANK];
    const uint8_t *name;
    size_t name_len;
    uint64_t sum;
    uint64_t ref;      /* a view's base, a derived tensor's source */
    uint64_t nchunks;  /* a data entry's chunks: the last nchunks rows of the chunk columns */
    uint64_t view_offset, view_end, strides[MAX_RANK];
} Entry;

static int key_is(const uint8_t *k, size_t n, const char *want)
{
    return n == strlen(want) && !memcmp(k, want, n);
}

/* The next object is the str ``want``. */
static int next_key(Rd *r, const char *want)
{
    const uint8_t *k;
    size_t n;
    return read_str(r, &k, &n) == 0 && key_is(k, n, want);
}

/* A chunk table (SPEC 8.4), each chunk's own checks made (all but those against the codec table and the
 * index offset, which the caller has, and against the entry's dtype and shape, read maybe later), its
 * chunks added to the chunk columns: 0, -1 for anything else, -2 with a Python error. */
static int read_chunks(Rd *r, Entry *e, Col *cols)
{
    uint64_t n;
    if (read_array(r, &n) < 0 || n > (uint64_t)(r->end - r->p) || n > UINT32_MAX)
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t five, c[5];
        if (read_array(r, &five) < 0 || five != 5)
            return -1;
        for (int j = 0; j < 5; j++)
            if (read_uint(r, &c[j]) < 0)
                return -1;
        if (c[0] < LOWEST_OFFSET || c[1] < 1 || c[1] > MAX_CHUNK_LENGTH || c[2] < 1 || c[2] > MAX_CHUNK_LENGTH
            || c[3] > 0xffff)
            return -1;
        uint16_t codec = (uint16_t)c[3];
        if (col_add(&cols[OFF], &c[0], 8) < 0 || col_add(&cols[STORED], &c[1], 8) < 0
            || col_add(&cols[RAW], &c[2], 8) < 0 || col_add(&cols[CODEC], &codec, 2) < 0
            || col_add(&cols[CHECK], &c[4], 8) < 0)
            return -2;
    }
    e->nchunks = n;
    return 0;
}

/* A view map (SPEC 8.5) as the writer lays it out, {"base", "offset", "stride"} in that order: any other
 * (another order, another key) is left to parse_entry, whose dict keeps the order it was given. */
static int read_view(Rd *r, Entry *e)
{
    uint64_t n;
    if (r->p >= r->end || *r->p != 0x83)
        return -1;
    r->p++;
    if (!next_key(r, "base") || read_uint(r, &e->ref) < 0 || e->ref > MAX_TENSORS)
        return -1;
    if (!next_key(r, "offset") || read_uint(r, &e->view_offset) < 0 || e->view_offset > MAX_TENSOR_BYTES)
        return -1;
    if (!next_key(r, "stride") || read_array(r, &n) < 0 || n > MAX_RANK)
        return -1;
    e->view_rank = (int)n;
    for (int j = 0; j < e->view_rank; j++)
        if (read_uint(r, &e->strides[j]) < 0 || e->strides[j] > MAX_TENSOR_BYTES)
            return -1;
    e->kind = VIEW;
    return 0;
}

/* A derived map (SPEC 8.5) as the writer lays it out, {"function", "source"}, of a known function. */
static int read_derived(Rd *r, Entry *e, const DtypeInfo *fns, int nfns)
{
    const uint8_t *f;
    size_t fn;
    if (r->p >= r->end || *r->p != 0x82)
        return -1;
    r->p++;
    if (!next_key(r, "function") || read_str(r, &f, &fn) < 0)
        return -1;
    e->kind = -1;
    for (int j = 0; j < nfns; j++)
        if (fns[j].len == fn && !memcmp(fns[j].name, f, fn))
            e->kind = DERIVED + j;
    if (e->kind < 0 || !next_key(r, "source") || read_uint(r, &e->ref) < 0 || e->ref > MAX_TENSORS)
        return -1;
    return 0;
}

static inline uint64_t add_sat(uint64_t a, uint64_t b)
{
    uint64_t s;
    return __builtin_add_overflow(a, b, &s) ? UINT64_MAX : s;
}

static inline uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t s;
    return __builtin_mul_overflow(a, b, &s) ? UINT64_MAX : s;
}

/* One tensor entry that passes every check of entry.parse_entry (SPEC 8.3-8.5) but those against the codec
 * table, the index offset and other entries, which the caller makes a column at a time: {name, dtype,
 * shape, one of chunks, view, derived[, checksum][, internal]}, its keys in any order, a dtype and a derived
 * function this reader knows, every value of its plain msgpack type.  0, -1 for anything else (parse_entry
 * checks it and says what is wrong), -2 with a Python error.  Its chunks are added to the chunk columns
 * (the caller takes them back on -1).  In C because a Python step per entry (decoding it into a dict,
 * then parse_entry) is what cost 20-35 us an entry: a training state's entries are mostly not plain ones. */
static int column_entry(Rd *r, const DtypeInfo *dts, int ndts, const DtypeInfo *fns, int nfns, Entry *e,
                        Col *cols)
{
    if (r->p >= r->end || *r->p < 0x84 || *r->p > 0x86)
        return -1;
    int pairs = *r->p & 0x0f;
    r->p++;
    int seen = 0;
    e->has_sum = e->internal = 0;
    e->nchunks = e->ref = 0;
    for (int i = 0; i < pairs; i++) {
        const uint8_t *k;
        size_t kn;
        if (read_str(r, &k, &kn) < 0)
            return -1;
        int bit, rc = 0;
        if (key_is(k, kn, "name")) {
            bit = 1;
            if (read_str(r, &e->name, &e->name_len) < 0 || e->name_len > MAX_NAME_BYTES
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
                if (read_uint(r, &e->dims[j]) < 0)
                    return -1;
        } else if (key_is(k, kn, "chunks")) {
            bit = 8;
            e->kind = DATA;
            rc = read_chunks(r, e, cols);
        } else if (key_is(k, kn, "view")) {
            bit = 16;
            rc = read_view(r, e);
        } else if (key_is(k, kn, "derived")) {
            bit = 32;
            rc = read_derived(r, e, fns, nfns);
        } else if (key_is(k, kn, "checksum")) {
            bit = 64;
            if (read_uint(r, &e->sum) < 0)
                return -1;
            e->has_sum = 1;
        } else if (key_is(k, kn, "internal")) {
            bit = 128;
            if (r->p >= r->end || (*r->p != 0xc2 && *r->p != 0xc3))
                return -1;
            e->internal = *r->p++ == 0xc3;
        } else
            return -1;
        if (rc < 0)
            return rc;
        if (seen & bit)
            return -1;
        seen |= bit;
    }
    int kinds = seen & (8 | 16 | 32);
    if ((seen & 7) != 7 || (kinds != 8 && kinds != 16 && kinds != 32))
        return -1;
    /* span (SPEC 8.3): the non-zero dims times the item size, at most MAX_TENSOR_BYTES (checked as it grows) */
    uint64_t itemsize = (uint64_t)dts[e->dtype].itemsize, span = itemsize;
    int empty = 0;
    for (int j = 0; j < e->rank; j++) {
        if (!e->dims[j])
            empty = 1;
        else if (e->dims[j] > MAX_TENSOR_BYTES / span)
            return -1;
        else
            span *= e->dims[j];
    }
    uint64_t nbytes = empty ? 0 : span;
    if (e->kind == DATA) {
        /* the raw lengths add up to nbytes (none for an empty tensor), each a multiple of the item size */
        const uint64_t *raw = (const uint64_t *)(cols[RAW].p + cols[RAW].len) - e->nchunks;
        uint64_t total = 0;
        for (uint64_t i = 0; i < e->nchunks; i++) {
            if (raw[i] % itemsize)
                return -1;
            total += raw[i]; /* (each at most 2^24, at most 2^32 of them) */
        }
        if (total != nbytes)
            return -1;
    } else if (e->kind == VIEW) {
        /* one stride a dimension; view_end: one past the last element it addresses (0 for none), saturated */
        if (e->view_rank != e->rank)
            return -1;
        uint64_t last = e->view_offset;
        for (int j = 0; j < e->rank; j++)
            last = add_sat(last, mul_sat(e->dims[j] ? e->dims[j] - 1 : 0, e->strides[j]));
        e->view_end = empty ? 0 : add_sat(last, 1);
    }
    return 0;
}

#define MIN_ENTRY 33 /* bytes of the shortest entry read here: a row per this many bytes at most */

/* entries(data, dtypes, functions): the "tensors" array's byte bounds (u64, one more than entries), and of
 * each entry column_entry takes (in_columns: u8 1) a row of the other columns, in order: name (UTF-8 in
 * names, ending at name_ends, u64), dtype (u8, its place in dtypes), shape (u32, its place in shapes, a
 * list of tuples), has_sum (u8), sum (u64), kind (u8: 0 data, 1 view, 2 + its place in functions for a
 * derived tensor), internal (u8), ref (u32: a view's base, a derived tensor's source), nchunks (u32); the
 * data rows' chunks one after another: offset, stored, raw, checksum (u64), codec (u16); and of each view
 * row: view_offset (u64), view_stride (u32, its place in shapes), view_end (u64: one past the last element
 * of its base it addresses, 0 for none, 2^64-1 beyond).  None where the bytes are not an array of at most
 * MAX_TENSORS msgpack values filling data. */
static PyObject *entries(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *dtype_list, *function_list;
    if (!PyArg_ParseTuple(args, "y*O!O!", &view, &PyTuple_Type, &dtype_list, &PyTuple_Type, &function_list))
        return NULL;
    PyObject *out = NULL;
    int ndts = (int)PyTuple_GET_SIZE(dtype_list), nfns = (int)PyTuple_GET_SIZE(function_list);
    DtypeInfo *dts = calloc(ndts + nfns + 1, sizeof(DtypeInfo)), *fns = dts + ndts;
    static const char *keys[NCOLS] = {"bounds", "in_columns", "dtype", "shape", "has_sum", "sum", "name_ends",
                                      "names", "kind", "internal", "ref", "nchunks", "offset", "stored", "raw",
                                      "codec", "checksum", "view_offset", "view_stride", "view_end"};
    static const int width[NCOLS] = {8, 1, 1, 4, 1, 8, 8, 0, 1, 1, 4, 4, 8, 8, 8, 2, 8, 8, 4, 8};
    Col cols[NCOLS] = {{0}};
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
        if (dts[j].itemsize < 1) {
            PyErr_SetString(PyExc_ValueError, "entries: an item size is at least 1");
            goto done;
        }
        dts[j].len = (size_t)len;
    }
    for (int j = 0; j < nfns; j++) {
        Py_ssize_t len;
        fns[j].name = (const uint8_t *)PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(function_list, j), &len);
        if (!fns[j].name)
            goto done;
        fns[j].len = (size_t)len;
    }
    if (DERIVED + nfns > 255) {
        PyErr_SetString(PyExc_ValueError, "entries: too many functions");
        goto done;
    }
    const uint8_t *base = view.buf;
    Rd r = {base, base + view.len};
    uint64_t n;
    if (read_array(&r, &n) < 0 || n > (uint64_t)(r.end - r.p) || n > MAX_TENSORS)
        goto plain;
    size_t rows = (size_t)view.len / MIN_ENTRY + 1;
    if (rows > n)
        rows = (size_t)n;
    for (int c = 0; c < NCOLS; c++) {
        /* caps: bounds (the row columns' are put without checks), estimates (the chunk and view columns') */
        size_t cap = c == BOUNDS ? 8 * ((size_t)n + 1) : c == IN_COLUMNS ? (size_t)n : c == NAMES ? (size_t)view.len
                   : c >= VIEW_OFFSET ? 0 : width[c] * rows;
        if (col_open(&cols[c], cap) < 0)
            goto done;
    }
    uint64_t names_end = 0;
    uint8_t one = 1, nil = 0;
    Entry e;
    for (uint64_t i = 0; i <= n; i++) {
        uint64_t at = (uint64_t)(r.p - base);
        col_put(&cols[BOUNDS], &at, 8);
        if (i == n)
            break;
        Rd probe = r;
        size_t chunks = cols[OFF].len / 8;
        int rc = cols[DTYPE].len < rows ? column_entry(&probe, dts, ndts, fns, nfns, &e, cols) : -1;
        if (rc == -2)
            goto done;
        if (rc == 0) {
            int64_t sid = shape_id(&shapes, e.dims, e.rank);
            int64_t stride_id = e.kind == VIEW ? shape_id(&shapes, e.strides, e.rank) : 0;
            if (sid < 0 || stride_id < 0) {
                PyErr_NoMemory();
                goto done;
            }
            uint8_t dt = (uint8_t)e.dtype, has = (uint8_t)e.has_sum, kind = (uint8_t)e.kind;
            uint8_t internal = (uint8_t)e.internal;
            uint32_t sid32 = (uint32_t)sid, ref = (uint32_t)e.ref, nchunks = (uint32_t)e.nchunks;
            uint64_t sum = e.has_sum ? e.sum : 0;
            names_end += e.name_len;
            col_put(&cols[IN_COLUMNS], &one, 1);
            col_put(&cols[DTYPE], &dt, 1);
            col_put(&cols[SHAPE], &sid32, 4);
            col_put(&cols[HAS_SUM], &has, 1);
            col_put(&cols[SUM], &sum, 8);
            col_put(&cols[NAMES], e.name, e.name_len);
            col_put(&cols[NAME_ENDS], &names_end, 8);
            col_put(&cols[KIND], &kind, 1);
            col_put(&cols[INTERNAL], &internal, 1);
            col_put(&cols[REF], &ref, 4);
            col_put(&cols[NCHUNKS], &nchunks, 4);
            if (e.kind == VIEW) {
                uint32_t stride32 = (uint32_t)stride_id;
                if (col_add(&cols[VIEW_OFFSET], &e.view_offset, 8) < 0 || col_add(&cols[VIEW_STRIDE], &stride32, 4) < 0
                    || col_add(&cols[VIEW_END], &e.view_end, 8) < 0)
                    goto done;
            }
            r = probe;
        } else {
            for (int c = OFF; c <= CHECK; c++) /* (its chunks, if it had any, go back) */
                cols[c].len = chunks * (size_t)width[c];
            if (skip(&r) < 0)
                goto plain;
            col_put(&cols[IN_COLUMNS], &nil, 1);
        }
    }
    if (r.p != r.end)
        goto plain;
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
        PyList_SET_ITEM(shape_list, (Py_ssize_t)id, t);
        for (int j = 0; j < rank; j++) {
            PyObject *v = PyLong_FromUnsignedLongLong(d[j]);
            if (!v) {
                Py_DECREF(shape_list);
                goto done;
            }
            PyTuple_SET_ITEM(t, j, v);
        }
    }
    out = PyDict_New();
    if (!out || PyDict_SetItemString(out, "shapes", shape_list) < 0) {
        Py_DECREF(shape_list);
        Py_CLEAR(out);
        goto done;
    }
    Py_DECREF(shape_list);
    for (int c = 0; c < NCOLS; c++) {
        if (_PyBytes_Resize(&cols[c].obj, (Py_ssize_t)cols[c].len) < 0
            || PyDict_SetItemString(out, keys[c], cols[c].obj) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    goto done;
plain:
    out = Py_NewRef(Py_None);
done:
    for (int c = 0; c < NCOLS; c++)
        Py_XDECREF(cols[c].obj);
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
    uint64_t *slots; /* the hash's top 32 bits, entry + 1; or 0 (a name is compared only on equal tags) */
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
    uint64_t h = hash_bytes(s, n, 0xcbf29ce484222325ull), tag = h & 0xffffffff00000000ull;
    size_t j = h & t->mask;
    while (t->slots[j]) {
        if ((t->slots[j] & 0xffffffff00000000ull) == tag) {
            size_t len, i = (t->slots[j] & 0xffffffffu) - 1;
            const uint8_t *name = name_at(t, i, &len);
            if (len == n && !memcmp(name, s, n))
                return (int64_t)i;
        }
        j = (j + 1) & t->mask;
    }
    if (add >= 0)
        t->slots[j] = tag | ((uint64_t)add + 1);
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
    t->slots = table_new(size);
    if (!t->slots) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Add names 0..n-1 to an opened table: the first that an earlier one has (it stops there), or -1. */
static int64_t names_fill(Names *t, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const uint8_t *s = name_at(t, i, &len);
        if (names_find(t, s, len, (int64_t)i) >= 0)
            return (int64_t)i;
    }
    return -1;
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

/* names_table(blob, ends, n, keep): (the first of names 0..n-1 that an earlier one has, or -1; with keep,
 * the hash table of them for path_index, else None). */
static PyObject *names_table(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends;
    Py_ssize_t n;
    int keep;
    if (!PyArg_ParseTuple(args, "y*y*np", &blob, &ends, &n, &keep))
        return NULL;
    PyObject *out = NULL;
    Names t = {0};
    if (n < 0 || check_ends(&blob, &ends, n) < 0 || names_open(&t, &blob, &ends, (size_t)n) < 0)
        goto done;
    int64_t dup;
    Py_BEGIN_ALLOW_THREADS
    dup = names_fill(&t, (size_t)n);
    Py_END_ALLOW_THREADS
    if (keep)
        out = Py_BuildValue("(Ly#)", (long long)dup, (const char *)t.slots,
                            (Py_ssize_t)((t.mask + 1) * sizeof(uint64_t)));
    else
        out = Py_BuildValue("(LO)", (long long)dup, Py_None);
done:
    free(t.slots);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    return out;
}

/* name_owner_mismatch(blob, ends, n, path_blob, path_ends, tids): the place of the first path (of
 * tree_paths') that is the name of an entry other than its tensor (entry names unique), or -1.  A path
 * that is its own tensor's name (what a writer makes) is settled by one comparison; the names' hash is
 * built only for any other. */
static PyObject *name_owner_mismatch(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends, pblob, pends, tids;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*y*ny*y*y*", &blob, &ends, &n, &pblob, &pends, &tids))
        return NULL;
    PyObject *out = NULL;
    Names t = {0};
    int hashed = 0;
    Py_ssize_t npaths = pends.len / 8;
    if (n < 0 || check_ends(&blob, &ends, n) < 0 || check_ends(&pblob, &pends, npaths) < 0)
        goto done;
    if (tids.len != npaths * 4) {
        PyErr_SetString(PyExc_ValueError, "one tensor id a path");
        goto done;
    }
    t.blob = blob.buf;
    t.ends = ends.buf;
    Names paths = {pblob.buf, pends.buf, NULL, 0};
    const uint32_t *tid = tids.buf;
    int64_t found = -1;
    for (Py_ssize_t i = 0; i < npaths && found < 0; i++) {
        size_t len, own_len;
        const uint8_t *s = name_at(&paths, (size_t)i, &len);
        if (tid[i] < (uint64_t)n) {
            const uint8_t *own = name_at(&t, tid[i], &own_len);
            if (own_len == len && !memcmp(own, s, len))
                continue;
        }
        if (!hashed) {
            if (names_open(&t, &blob, &ends, (size_t)n) < 0)
                goto done;
            names_fill(&t, (size_t)n); /* (all different: names_table found none twice) */
            hashed = 1;
        }
        int64_t owner = names_find(&t, s, len, -1);
        if (owner >= 0 && owner != (int64_t)tid[i])
            found = i;
    }
    out = PyLong_FromLongLong(found);
done:
    free(t.slots);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&pblob);
    PyBuffer_Release(&pends);
    PyBuffer_Release(&tids);
    return out;
}

/* ---- tree_paths --------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *base;
    Buf path;          /* the current path's bytes */
    Col blob, ends, tids; /* each tensor path's bytes, where it ends (u64), its tensor (u32) */
    uint64_t max_tid, refs;
    int plain;         /* set: leave this tree to the plain decoding */
} Walk;

/* A map's key, for the check that none is there twice: a str by its bytes (at base + a, b long), an int
 * by its value (a) and sign (b). */
typedef struct {
    uint64_t h, a;
    uint32_t b, kind;
} Key;

static int walk(Walk *w, Rd *r, int depth);

static int walk_items(Walk *w, Rd *r, uint64_t n, int depth)
{
    size_t keep = w->path.len;
    char seg[24];
    for (uint64_t i = 0; i < n; i++) {
        /* segments are joined by "/": below the root one comes first, an empty key's path included */
        int len = snprintf(seg, sizeof seg, "%s%llu", depth > 1 ? "/" : "", (unsigned long long)i);
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

static int key_eq(const uint8_t *base, const Key *x, const Key *y)
{
    if (x->kind != y->kind || x->b != y->b)
        return 0;
    return x->kind ? x->a == y->a : !memcmp(base + x->a, base + y->a, x->b);
}

static int walk_map(Walk *w, Rd *r, uint64_t n, int depth)
{
    size_t keep = w->path.len;
    size_t size = 16;
    while (size < 2 * n + 2)
        size *= 2;
    Key *keys = malloc(n ? n * sizeof(Key) : 1);
    uint64_t *slots = NULL; /* hash tag, key + 1 (as Names); made once the keys are read */
    int rc = -1;
    if (!keys) {
        PyErr_NoMemory();
        goto done;
    }
    int kinds = 0;
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
            if (read_str(r, &seg, &seglen) < 0 || seglen > UINT32_MAX || !utf8_ok(seg, seglen)) {
                w->plain = 1;
                rc = 0;
                goto done;
            }
            k->kind = 0;
            k->a = (uint64_t)(seg - w->base);
            k->b = (uint32_t)seglen;
            k->h = hash_bytes(seg, seglen, 3);
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
            k->a = v;
            k->b = (uint32_t)neg;
            uint8_t form[9] = {(uint8_t)neg};
            memcpy(form + 1, &v, 8);
            k->h = hash_bytes(form, 9, 7);
            int len = snprintf(num, sizeof num, "%s%llu", neg ? "-" : "", (unsigned long long)v);
            seg = (const uint8_t *)num;
            seglen = (size_t)len;
        }
        /* A map of str and int keys may give one path twice (1 and "1"): the Python way keeps the first
         * path or refuses the name.  Otherwise a tree's paths differ (escaping is one-to-one). */
        kinds |= 1 << k->kind;
        if (kinds == 3) {
            w->plain = 1;
            rc = 0;
            goto done;
        }
        /* the segment, escaped as tree.escape does (RFC 6901) */
        w->path.len = keep;
        if (depth > 1 && buf_put(&w->path, "/", 1) < 0)
            goto nomem;
        if (!memchr(seg, '~', seglen) && !memchr(seg, '/', seglen)) {
            if (buf_put(&w->path, seg, seglen) < 0)
                goto nomem;
        } else
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
    /* No key twice (the plain decoding says which): checked once the map is read, in one tight loop, whose
     * random reads of the table overlap (3-4x quicker than one between the reads of each pair). */
    slots = table_new(size);
    if (!slots)
        goto nomem;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t h = keys[i].h, tag = h & 0xffffffff00000000ull;
        size_t j = h & (size - 1);
        while (slots[j]) {
            if ((slots[j] & 0xffffffff00000000ull) == tag && key_eq(w->base, &keys[(slots[j] & 0xffffffffu) - 1], &keys[i])) {
                w->plain = 1;
                rc = 0;
                goto done;
            }
            j = (j + 1) & (size - 1);
        }
        slots[j] = tag | (i + 1);
    }
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
            uint32_t tid32 = (uint32_t)tid;
            uint64_t end = w->blob.len + w->path.len;
            if (col_add(&w->blob, w->path.data, w->path.len) < 0 || col_add(&w->ends, &end, 8) < 0
                || col_add(&w->tids, &tid32, 4) < 0)
                return -1;
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

/* tree_paths(data): the tensor paths (SPEC 14.1, tree.leaf_paths' order and escaping, all different) of a
 * tree made only of maps with str or int keys (not both in one map: their paths could meet), arrays,
 * tuples, scalars and tensor references, as (blob, ends, tids, max tensor id): their UTF-8 in one blob,
 * ending at ends (u64), their tensors (u32).  Such a tree tree.unpackb decodes without an error, and
 * check_tree's checks hold but the tensor count's.  None for any other tree, or one with no reference. */
static PyObject *tree_paths(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Walk w = {0};
    w.base = view.buf;
    PyObject *out = NULL;
    Rd r = {view.buf, (const uint8_t *)view.buf + view.len};
    /* A reference takes 6 bytes (fixext 4): room for len / 6 of them, and their paths as long as the tree,
     * is only reserved (pages never written are never touched) */
    if (col_open(&w.blob, (size_t)view.len) < 0 || col_open(&w.ends, (size_t)view.len / 6 * 8 + 8) < 0
        || col_open(&w.tids, (size_t)view.len / 6 * 4 + 4) < 0)
        goto done;
    if (walk(&w, &r, 1) < 0)
        goto done;
    if (w.plain || r.p != r.end || w.refs == 0 || w.refs > UINT32_MAX - 1) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *blob = col_take(&w.blob), *ends = blob ? col_take(&w.ends) : NULL, *tids = ends ? col_take(&w.tids) : NULL;
    if (tids)
        out = Py_BuildValue("(NNNK)", blob, ends, tids, (unsigned long long)w.max_tid);
    else {
        Py_XDECREF(blob);
        Py_XDECREF(ends);
    }
done:
    free(w.path.data);
    Py_XDECREF(w.blob.obj);
    Py_XDECREF(w.ends.obj);
    Py_XDECREF(w.tids.obj);
    PyBuffer_Release(&view);
    return out;
}

/* path_index(blob, ends, slots, key): the place of ``key`` (a str) among names (names_table's slots), or -1. */
static PyObject *path_index(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends, slots;
    PyObject *key;
    if (!PyArg_ParseTuple(args, "y*y*y*U", &blob, &ends, &slots, &key))
        return NULL;
    PyObject *out = NULL;
    size_t size = (size_t)slots.len / sizeof(uint64_t);
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(key, &len);
    if (!s) {
        PyErr_Clear(); /* (a str no UTF-8 spells, such as a lone surrogate, names no path) */
        out = PyLong_FromLong(-1);
    } else if (size < 2 || (size & (size - 1))) {
        PyErr_SetString(PyExc_ValueError, "slots is not a hash table of tree_paths");
    } else {
        Names t = {blob.buf, ends.buf, slots.buf, size - 1};
        out = PyLong_FromLongLong(names_find(&t, (const uint8_t *)s, (size_t)len, -1));
    }
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&slots);
    return out;
}

/* strings(blob, ends, lo, hi): names lo..hi-1 of a blob as a list of str. */
static PyObject *strings(PyObject *self, PyObject *args)
{
    Py_buffer blob, ends;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "y*y*nn", &blob, &ends, &lo, &hi))
        return NULL;
    PyObject *out = NULL;
    const uint64_t *e = ends.buf;
    Py_ssize_t n = ends.len / 8;
    if (lo < 0 || hi > n || lo > hi) {
        PyErr_SetString(PyExc_IndexError, "strings: range out of the names");
        goto done;
    }
    out = PyList_New(hi - lo);
    for (Py_ssize_t i = lo; out && i < hi; i++) {
        uint64_t a = i ? e[i - 1] : 0, b = e[i];
        if (b < a || b > (uint64_t)blob.len) {
            PyErr_SetString(PyExc_ValueError, "strings: ends do not fit the blob");
            Py_CLEAR(out);
            break;
        }
        PyObject *str = PyUnicode_DecodeUTF8((const char *)blob.buf + a, (Py_ssize_t)(b - a), "surrogatepass");
        if (!str)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i - lo, str);
    }
done:
    PyBuffer_Release(&blob);
    PyBuffer_Release(&ends);
    return out;
}

static PyMethodDef methods[] = {
    {"map_spans", map_spans, METH_O,
     "map_spans(data) -> [(key start, key end, value start, value end)] of a msgpack map filling data, or None"},
    {"entries", entries, METH_VARARGS,
     "entries(data, dtypes, functions) -> dict of columns of a tensors array (the entries it reads), or None"},
    {"tree_paths", tree_paths, METH_O, "tree_paths(data) -> (blob, ends, tids, max tensor id) or None"},
    {"path_index", path_index, METH_VARARGS, "path_index(blob, ends, slots, key) -> place of key, or -1"},
    {"strings", strings, METH_VARARGS, "strings(blob, ends, lo, hi) -> names lo..hi-1 as a list of str"},
    {"names_table", names_table, METH_VARARGS,
     "names_table(blob, ends, n, keep) -> (first of names 0..n-1 an earlier one has or -1, hash table or None)"},
    {"name_owner_mismatch", name_owner_mismatch, METH_VARARGS,
     "name_owner_mismatch(blob, ends, n, path_blob, path_ends, tids) -> the first path naming another entry, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_columns",
                                    "The index of a state of very many tensors, read into columns.", -1, methods};

PyMODINIT_FUNC PyInit__columns(void)
{
    return PyModule_Create(&module);
}
