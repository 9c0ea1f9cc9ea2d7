/* The hot loops of slotroute.store, each in one pass of C, the CPU capturer's
 * snapshot (narrow_step).
 *
 * store_rows: check a step's slots and expert ids, then copy its rows into the slot
 * buffer and stamp their slots (store.py, NOTE 1), in row order, so that a repeated
 * slot keeps its last row. Long runs of consecutive slots are written with
 * non-temporal stores: routing is read back when its request finishes, not now, so
 * the copy skips reading the destination lines into cache.
 *
 * gather_blocks: copy a request's tokens out of its blocks, checking as it goes that
 * every slot was written since its block was last invalidated (by one flag for a
 * block store_rows saw completed, else by its slots' stamps); the next blocks'
 * heads are prefetched while one is copied.
 *
 * store_rows and gather_blocks check what depends on the values (slot and block ranges, expert ids, written
 * state) and return a status instead of raising: store.py builds the error message
 * with numpy. store_rows takes the step's arrays as they come and checks their
 * layout too (C-contiguous, dtypes, shapes), so that a decode step costs one call;
 * store.py converts anything else first. store_rows writes nothing unless every
 * check passed, so a call that fails changes nothing. store.py's numpy path states
 * the same contract in plain numpy; it is the reference these loops are tested
 * against.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Checks of ids over many rows are vectorised for AVX2 where the compiler and the C
 * library can pick a version at load time, plain SSE2 elsewhere. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Statuses: store.py's STATUSES names every one, in this order (a test compares them). */
enum { OK = 0, OUT_OF_RANGE = 1, BAD_ID = 2, MISSING = 3, NOT_INT = 4, LAYOUT = 5, NOT_COVERED = 6 };

/* Runs of at least this many bytes go through non-temporal stores. */
#define STREAM_FROM (64 << 10)
/* Scattered rows are prefetched for writing ROWS_AHEAD rows ahead. While a gather
 * copies one block, it prefetches into L2 the block as many places on as make up
 * GATHER_AHEAD bytes (at least the next), the first BLOCK_PREFETCH_BYTES of it, all
 * of that block's stamps and its invalidation stamp. The head of a block is enough
 * to start the hardware prefetcher on the rest of it, and a small head leaves the
 * core's few miss buffers to more blocks at once. Both sizes were chosen from
 * variants timed against each other in the same rounds on two machines. */
#define ROWS_AHEAD 4
#define GATHER_AHEAD (12 << 10)
#define BLOCK_PREFETCH_BYTES (1 << 10)
/* The GIL is released around copies of at least this many bytes. */
#define RELEASE_FROM (256 << 10)

/* Expert ids as store_batch accepts them. Loads through these types may be unaligned
 * (a step decoded from the wire views its payload at any offset). */
typedef uint8_t u8;
typedef uint16_t u16u __attribute__((aligned(1)));
typedef uint32_t u32u __attribute__((aligned(1)));
typedef uint64_t u64u __attribute__((aligned(1)));
typedef int64_t i64u __attribute__((aligned(1))); /* slots, also read from the wire */

/* The largest id in n items, read unsigned: a negative id reads larger than any
 * valid one, so one comparison checks both ends. */
#define MAX_OF(NAME, T, R)                                 \
    VECTOR_CLONES static R NAME(const T *p, Py_ssize_t n)  \
    {                                                      \
        R m = 0;                                           \
        for (Py_ssize_t i = 0; i < n; i++)                 \
            m = p[i] > m ? p[i] : m;                       \
        return m;                                          \
    }
MAX_OF(max_u8, u8, uint8_t)
MAX_OF(max_u16, u16u, uint16_t)
MAX_OF(max_u32, u32u, uint32_t)
MAX_OF(max_u64, u64u, uint64_t)

static uint64_t max_id(const char *p, Py_ssize_t n, int itemsize)
{
    switch (itemsize) {
    case 1: return max_u8((const u8 *)p, n);
    case 2: return max_u16((const u16u *)p, n);
    case 4: return max_u32((const u32u *)p, n);
    default: return max_u64((const u64u *)p, n);
    }
}

#if defined(__SSE2__)
/* Copy n bytes with non-temporal stores: the destination lines go to memory without
 * being read into cache first. The caller issues the store fence. */
static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst) & 15, i = 0;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#define STREAMS 1
#else
#define stream_copy memcpy
#define STREAMS 0
#endif

static void store_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* One row of ids converted from the input dtype to the storage dtype (ids checked). */
#define CONVERT(NAME, TI, TO)                                        \
    static void NAME(char *dst, const char *src, Py_ssize_t n)       \
    {                                                                \
        const TI *s = (const TI *)src;                               \
        TO *d = (TO *)dst;                                           \
        for (Py_ssize_t i = 0; i < n; i++)                           \
            d[i] = (TO)s[i];                                         \
    }
CONVERT(u16_to_u8, u16u, uint8_t)
CONVERT(u32_to_u8, u32u, uint8_t)
CONVERT(u64_to_u8, u64u, uint8_t)
CONVERT(u8_to_u16, u8, u16u)
CONVERT(u32_to_u16, u32u, u16u)
CONVERT(u64_to_u16, u64u, u16u)

typedef void (*convert_fn)(char *, const char *, Py_ssize_t);

static convert_fn converter(int in_size, int out_size)
{
    if (out_size == 1)
        return in_size == 2 ? u16_to_u8 : in_size == 4 ? u32_to_u8 : u64_to_u8;
    return in_size == 1 ? u8_to_u16 : in_size == 4 ? u32_to_u16 : u64_to_u16;
}

/* Prefetch every cache line holding a byte of [p, p + n): for writing into L1 (a
 * scattered row about to be written), or for reading into L2 (a block and its
 * stamps about to be read). Rows and blocks need not start on a line. */
static const char *line_of(const void *p)
{
    return (const char *)((uintptr_t)p & ~(uintptr_t)63);
}

static void prefetch_for_write(const void *p, Py_ssize_t n)
{
    for (const char *q = line_of(p), *end = (const char *)p + n; q < end; q += 64)
        __builtin_prefetch(q, 1, 3);
}

static void prefetch_to_l2(const void *p, Py_ssize_t n)
{
    for (const char *q = line_of(p), *end = (const char *)p + n; q < end; q += 64)
        __builtin_prefetch(q, 0, 2);
}

/* The written state of a store (store.py, NOTES 1 and 2): a stamp per slot, the
 * last stamp handed out before each block's invalidation, and a flag per block set
 * once each of its slots has been written since. */
typedef struct {
    int64_t *stamps;
    const int64_t *invalidated;
    uint8_t *full;
    Py_ssize_t block_size;
} Written;

/* Flag the blocks that a run of rows just stamped over slots first..last completes:
 * each block it covers to the block's last slot, the first one only if its slots
 * before the run are written already. A block completed in another order stays
 * unflagged, and get checks its stamps instead. */
static void flag_full_blocks(const Written *w, int64_t first, int64_t last)
{
    const int64_t size = w->block_size;
    for (int64_t b = first / size; (b + 1) * size - 1 <= last; b++) {
        int full = 1;
        if (b == first / size)
            for (int64_t slot = b * size; slot < first && full; slot++)
                full = w->stamps[slot] > w->invalidated[b];
        if (full)
            w->full[b] = 1;
    }
}

/* Write the rows of a checked step. */
static void write_rows(char *buffer, const Written *w, const char *data, const i64u *slots,
                       Py_ssize_t n, Py_ssize_t items, int in_size, int out_size,
                       long long first_stamp)
{
    int64_t *stamps = w->stamps;
    const Py_ssize_t in_row = items * in_size, out_row = items * out_size;
    convert_fn convert = in_size == out_size ? NULL : converter(in_size, out_size);
    int streamed = 0;
    Py_ssize_t i = 0;
    while (i < n) {
        if (slots[i] < 0) { /* padding */
            i++;
            continue;
        }
        Py_ssize_t j = i + 1; /* rows i..j-1 hold consecutive slots */
        while (j < n && slots[j] == slots[j - 1] + 1)
            j++;
        if (j == i + 1 && i + ROWS_AHEAD < n && slots[i + ROWS_AHEAD] >= 0) {
            prefetch_for_write(buffer + slots[i + ROWS_AHEAD] * out_row, out_row);
            __builtin_prefetch(stamps + slots[i + ROWS_AHEAD], 1, 0);
        }
        char *dst = buffer + slots[i] * out_row;
        if (convert == NULL) {
            const size_t bytes = (size_t)((j - i) * in_row);
            if (STREAMS && bytes >= STREAM_FROM) {
                stream_copy(dst, data + i * in_row, bytes);
                streamed = 1;
            } else {
                memcpy(dst, data + i * in_row, bytes);
            }
        } else {
            convert(dst, data + i * in_row, (j - i) * items);
        }
        for (Py_ssize_t r = i; r < j; r++)
            stamps[slots[r]] = first_stamp + r;
        flag_full_blocks(w, slots[i], slots[j - 1]);
        i = j;
    }
    if (streamed)
        store_fence();
}

/* Check a step of n rows of `items` ids, then write it (store_rows). */
static int store_checked(Py_buffer *buffer, const Written *w, Py_ssize_t num_slots, Py_buffer *data,
                         const i64u *s, Py_ssize_t n, Py_ssize_t items, int in_size, int out_size,
                         unsigned long long limit, long long first_stamp)
{
    int status = OK, padded = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        padded |= s[i] < 0;
        if (s[i] >= num_slots)
            return OUT_OF_RANGE;
    }
    PyThreadState *save = data->len >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
    if (limit) {
        if (!padded) {
            status = max_id(data->buf, n * items, in_size) >= limit ? BAD_ID : OK;
        } else {
            for (Py_ssize_t i = 0; i < n && status == OK; i++)
                if (s[i] >= 0 && max_id((const char *)data->buf + i * items * in_size, items, in_size) >= limit)
                    status = BAD_ID;
        }
    }
    if (status == OK)
        write_rows(buffer->buf, w, data->buf, s, n, items, in_size, out_size, first_stamp);
    if (save != NULL)
        PyEval_RestoreThread(save);
    return status;
}

/* Size of an id of this buffer format, negative for signed, 0 for any other:
 * the dtypes store_batch accepts, in native byte order. */
static int id_size(const char *format)
{
    if (format == NULL)
        return 0;
    if (*format == '@' || *format == '=')
        format++;
    if (format[1] != '\0')
        return 0;
    switch (*format) {
    case 'B': return 1;
    case 'H': return 2;
    case 'i': return sizeof(int) == 4 ? -4 : 0;
    case 'l': return sizeof(long) == 8 ? -8 : 0;
    case 'q': return -8;
    default: return 0;
    }
}

/* A C-contiguous buffer of obj with its format and shape, or 0 with no error set. */
static int layout_of(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0)
        return 1;
    PyErr_Clear();
    return 0;
}

/* The store's arrays, as store_rows and gather_blocks take them: the slot buffer
 * (with its format) and the written state. Returns 0 with all four views held, or
 * -1 with none held and an error set. */
static int get_store(PyObject *const *args, int writable, Py_buffer views[4])
{
    const int flags[4] = {PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0), writable ? PyBUF_WRITABLE : 0, 0,
                          writable ? PyBUF_WRITABLE : 0};
    for (int got = 0; got < 4; got++)
        if (PyObject_GetBuffer(args[got], &views[got], flags[got] | PyBUF_C_CONTIGUOUS) < 0) {
            while (got > 0)
                PyBuffer_Release(&views[--got]);
            return -1;
        }
    return 0;
}

static void release_store(Py_buffer views[4])
{
    for (int i = 0; i < 4; i++)
        PyBuffer_Release(&views[i]);
}

/* The written state held in views[1..3]: stamps (int64 per slot), invalidated_at
 * (int64 per block) and full (uint8 per block). */
static Written written_of(Py_buffer views[4])
{
    const Py_ssize_t num_blocks = views[2].len / 8;
    Written w = {views[1].buf, views[2].buf, views[3].buf, num_blocks ? views[1].len / 8 / num_blocks : 1};
    return w;
}

PyDoc_STRVAR(store_rows_doc,
"store_rows(buffer, stamps, invalidated_at, full, data, slots, num_layers, top_k,\n"
"           num_experts, first_stamp) -> int\n\n"
"Row i of data, shape (N, num_layers, top_k), into slot slots[i] of buffer (the\n"
"store's rows, uint8 or uint16 by its item size), stamped first_stamp + i; slots\n"
"< 0 are skipped. A block of len(stamps) // len(invalidated_at) slots whose last\n"
"slot a row writes, and whose every slot is then stamped after invalidated_at[block],\n"
"gets full[block] = 1. Returns 5 (nothing done) unless data is C-contiguous uint8,\n"
"uint16, int32 or int64 of that shape and slots C-contiguous int64 of shape (N,);\n"
"then checks before writing: 1 if a slot is >= len(stamps), 2 if an id of a row\n"
"written is outside [0, num_experts); 0 once written.");

static PyObject *store_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "store_rows takes 10 arguments");
        return NULL;
    }
    const Py_ssize_t layers = PyLong_AsSsize_t(args[6]), top_k = PyLong_AsSsize_t(args[7]);
    const unsigned long long num_experts = PyLong_AsUnsignedLongLong(args[8]);
    const long long first_stamp = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer store[4], data, slots;
    if (get_store(args, 1, store) < 0)
        return NULL;
    const Written w = written_of(store);
    int status = LAYOUT;
    if (layout_of(args[4], &data)) {
        if (layout_of(args[5], &slots)) {
            const int in = id_size(data.format), out = id_size(store[0].format);
            const Py_ssize_t n = data.ndim == 3 ? data.shape[0] : -1;
            if (in != 0 && out > 0 && data.ndim == 3 && data.shape[1] == layers && data.shape[2] == top_k
                && id_size(slots.format) == -8 && slots.ndim == 1 && slots.shape[0] == n) {
                /* Unsigned ids need a check only if their dtype holds values >= num_experts. */
                const int size = in < 0 ? -in : in;
                const unsigned long long limit =
                    in < 0 || num_experts <= (1ULL << (8 * size)) - 1 ? num_experts : 0;
                status = store_checked(&store[0], &w, store[1].len / 8, &data, slots.buf, n, layers * top_k,
                                       size, out, limit, first_stamp);
            }
            PyBuffer_Release(&slots);
        }
        PyBuffer_Release(&data);
    }
    release_store(store);
    return PyLong_FromLong(status);
}

/* Block ids from a list of ints, or from a buffer of int64. */
typedef struct {
    PyObject *list;
    const int64_t *ids;
} Blocks;

static inline int64_t block_at(const Blocks *b, Py_ssize_t i)
{
    return b->list ? (int64_t)PyLong_AsLongLong(PyList_GET_ITEM(b->list, i)) : b->ids[i];
}

PyDoc_STRVAR(gather_blocks_doc,
"gather_blocks(buffer, stamps, invalidated_at, full, out, blocks, start, stop,\n"
"              stream_from) -> int\n\n"
"Tokens start..stop-1 of the blocks' concatenation into out, from the store's\n"
"arrays as store_rows takes them (len(invalidated_at) blocks); an out of\n"
"stream_from bytes or more is written with non-temporal stores. blocks is a list,\n"
"or an int64 buffer. Returns 5 if start..stop is not a range of tokens or out is\n"
"not (stop - start) rows of the buffer, 6 if the blocks do not cover stop tokens,\n"
"4 if a list item is not an int, 1 if a block id is out of range, 3 if a token's\n"
"slot was not written since its block's invalidation (out then holds garbage),\n"
"else 0.");

static PyObject *gather_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "gather_blocks takes 9 arguments");
        return NULL;
    }
    const Py_ssize_t start = PyLong_AsSsize_t(args[6]), stop = PyLong_AsSsize_t(args[7]);
    const Py_ssize_t stream_from = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer store[4], out, ids = {0};
    if (get_store(args, 0, store) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[4], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        release_store(store);
        return NULL;
    }
    PyObject *block_obj = args[5];
    Blocks blocks = {NULL, NULL};
    Py_ssize_t count;
    int status = OK;
    if (PyList_CheckExact(block_obj)) {
        blocks.list = block_obj;
        count = PyList_GET_SIZE(block_obj);
        for (Py_ssize_t i = 0; i < count; i++)
            if (!PyLong_CheckExact(PyList_GET_ITEM(block_obj, i))) {
                status = NOT_INT;
                break;
            }
    } else if (PyObject_GetBuffer(block_obj, &ids, PyBUF_C_CONTIGUOUS) == 0) {
        blocks.ids = ids.buf;
        count = ids.len / 8;
    } else {
        PyBuffer_Release(&out);
        release_store(store);
        return NULL;
    }
    const Written w = written_of(store);
    const Py_ssize_t block_size = w.block_size, num_blocks = store[2].len / 8;
    const Py_ssize_t num_slots = num_blocks * block_size;
    const Py_ssize_t row = num_slots ? store[0].len / num_slots : 0;
    Py_ssize_t first = 0, last = 0;
    /* Every length the loops below rely on, checked against the arrays themselves. */
    if (start < 0 || stop < start || num_slots == 0 || store[0].len != num_slots * row ||
        store[1].len != num_slots * 8 || store[3].len != num_blocks || out.len != (stop - start) * row) {
        if (status == OK)
            status = LAYOUT;
    } else {
        first = start / block_size;
        last = (stop + block_size - 1) / block_size;
        if (last > count && status == OK)
            status = NOT_COVERED;
    }
    for (Py_ssize_t i = 0; i < count && status == OK; i++) {
        int64_t b = block_at(&blocks, i);
        if (b == -1 && PyErr_Occurred()) { /* an int beyond int64 */
            PyErr_Clear();
            status = OUT_OF_RANGE;
        } else if (b < 0 || b >= num_blocks) {
            status = OUT_OF_RANGE;
        }
    }
    /* Block ids are read now, with the GIL held. */
    int64_t *used = NULL;
    if (status == OK && last > first) {
        used = PyMem_Malloc((size_t)(last - first) * sizeof(int64_t));
        if (used == NULL) {
            status = -1;
            PyErr_NoMemory();
        } else {
            for (Py_ssize_t i = first; i < last; i++)
                used[i - first] = block_at(&blocks, i);
        }
    }
    if (status == OK && used != NULL) {
        const char *src = store[0].buf;
        char *dst = out.buf;
        const Py_ssize_t block_bytes = block_size * row;
        /* block_bytes is 0 for an empty range (no row to copy) */
        const Py_ssize_t ahead =
            block_bytes == 0 || block_bytes >= GATHER_AHEAD ? 1 : (GATHER_AHEAD + block_bytes - 1) / block_bytes;
        const Py_ssize_t prefetch_bytes = block_bytes < BLOCK_PREFETCH_BYTES ? block_bytes : BLOCK_PREFETCH_BYTES;
        const int stream = STREAMS && out.len >= stream_from;
        PyThreadState *save = out.len >= RELEASE_FROM ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t i = first; i < last && status == OK; i++) {
            const int64_t b = used[i - first];
            if (i + ahead < last) {
                const int64_t next = used[i + ahead - first];
                prefetch_to_l2(src + next * block_bytes, prefetch_bytes);
                if (!w.full[next]) {
                    prefetch_to_l2(w.stamps + next * block_size, block_size * (Py_ssize_t)sizeof(int64_t));
                    __builtin_prefetch(w.invalidated + next, 0, 2);
                }
            }
            const Py_ssize_t lo = i == first ? start - first * block_size : 0;
            const Py_ssize_t hi = i == last - 1 ? stop - i * block_size : block_size;
            if (!w.full[b]) {
                const int64_t *stamp = w.stamps + b * block_size, since = w.invalidated[b];
                for (Py_ssize_t t = lo; t < hi; t++)
                    if (stamp[t] <= since)
                        status = MISSING;
            }
            const char *from = src + b * block_bytes + lo * row;
            const size_t n = (size_t)((hi - lo) * row);
            if (stream)
                stream_copy(dst, from, n);
            else
                memcpy(dst, from, n);
            dst += n;
        }
        if (stream)
            store_fence();
        if (save != NULL)
            PyEval_RestoreThread(save);
    }
    PyMem_Free(used);
    if (ids.obj != NULL)
        PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    release_store(store);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* A step's int32 ids narrowed to the storage dtype; returns the largest, read
 * unsigned (as max_id), so that one pass both checks and writes them. */
#define NARROW(NAME, TO)                                                                    \
    VECTOR_CLONES static uint32_t NAME(TO *d, const uint32_t *s, Py_ssize_t n)              \
    {                                                                                       \
        uint32_t m = 0;                                                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                                \
            m = s[i] > m ? s[i] : m;                                                        \
            d[i] = (TO)s[i];                                                                \
        }                                                                                   \
        return m;                                                                           \
    }
NARROW(narrow_to_u8, uint8_t)
NARROW(narrow_to_u16, uint16_t)

PyDoc_STRVAR(narrow_step_doc,
"narrow_step(out, ids, slots_out, slots, num_experts) -> int\n\n"
"A CPU snapshot in one pass: the int32 ids into out (uint8 or uint16, as many\n"
"items) and the int64 slots into slots_out (as many). All four C-contiguous.\n"
"Returns the number of ids outside [0, num_experts) (out then holds garbage), or\n"
"-1 (nothing done) if a layout, dtype or size does not match.");

static PyObject *narrow_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "narrow_step takes 5 arguments");
        return NULL;
    }
    const unsigned long long num_experts = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer views[4];
    int got = 0;
    while (got < 4) {
        const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (got % 2 == 0 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(args[got], &views[got], flags) < 0) {
            PyErr_Clear();
            break;
        }
        got++;
    }
    Py_ssize_t result = -1;
    if (got == 4) {
        Py_buffer *out = &views[0], *ids = &views[1], *slots_out = &views[2], *slots = &views[3];
        const int out_size = id_size(out->format);
        const Py_ssize_t n = ids->len / 4;
        if (id_size(ids->format) == -4 && out_size > 0 && out->len == n * out_size
            && id_size(slots->format) == -8 && id_size(slots_out->format) == -8
            && slots_out->len == slots->len && num_experts <= (1ULL << (8 * out_size))) {
            const uint32_t *s = ids->buf, limit = (uint32_t)num_experts;
            const uint32_t largest = out_size == 1 ? narrow_to_u8(out->buf, s, n) : narrow_to_u16(out->buf, s, n);
            result = 0;
            if (largest >= limit) /* count them for the error message */
                for (Py_ssize_t i = 0; i < n; i++)
                    result += s[i] >= limit;
            memcpy(slots_out->buf, slots->buf, (size_t)slots->len);
        }
    }
    while (got > 0)
        PyBuffer_Release(&views[--got]);
    return PyLong_FromSsize_t(result);
}

static PyMethodDef methods[] = {
    {"store_rows", (PyCFunction)(void (*)(void))store_rows, METH_FASTCALL, store_rows_doc},
    {"narrow_step", (PyCFunction)(void (*)(void))narrow_step, METH_FASTCALL, narrow_step_doc},
    {"gather_blocks", (PyCFunction)(void (*)(void))gather_blocks, METH_FASTCALL, gather_blocks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "slotroute._native",
    "The hot loops of slotroute.store in C (see store.py for the contract).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
