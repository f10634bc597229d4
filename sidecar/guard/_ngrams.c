/* The injection classifier's hashed character n-grams (sidecar/guard/lexical.py), compiled; and
   the table lookups of the words filter's fold and squeeze (normalize._by_table and squeezed:
   fold_by_table and squeeze_by_table below), which the filter and the n-grams of a non-ASCII
   prompt go through; and the ranges where the personal-data detectors' patterns run
   (pii.Candidates: runs below).

   The same features and score as lexical.py's numpy code, which stays the reference: the same
   points (the folded text, runs of whitespace as one space, a long text cut to its two ends, a
   space at each end), the same buckets (polynomial hash wrapping at 2**64, tagged with the
   order, mixed, top bits), the same sums in the same order (numpy's pairwise sum for the whole
   text, a running sum for the stretches), so the score is equal bit for bit: numpy's pairwise
   sum is scalar C in every CPU dispatch target, so the same on any CPU, but numpy promises no
   order, and tests/unit/guard/test_guard_compiled.py checks it on the installed version. One
   pass over the points where numpy makes a dozen, each with its own temporary array.

   score(weights, text) and buckets(text) take the raw text when it is ASCII, else
   normalize.fold(text): the ASCII part of the fold (control characters other than tab, line
   feed and carriage return dropped, A-Z lowered) is done here, and changes nothing in a text
   already folded. Work is bounded by MAX_CHARS whatever the input: one read of the text to
   count, one to copy at most MAX_CHARS points, then fixed-size arrays. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DIM_BITS 18
#define DIM ((Py_ssize_t)1 << DIM_BITS)
#define MAX_CHARS 8192
#define WINDOW 200
#define MIN_ORDER 3
#define MAX_ORDER 5
#define N_ORDERS (MAX_ORDER - MIN_ORDER + 1)
_Static_assert(N_ORDERS == 3, "ORDERS below lists three orders");
/* A space, the text's first MAX_CHARS / 2 points, a space, its last MAX_CHARS / 2, a space. */
#define MAX_POINTS (MAX_CHARS + 3)
#define PRIME 0x100000001B3ULL
#define MIX 0x9E3779B97F4A7C15ULL
#define PAIRWISE_BLOCK 128

/* The ASCII part of the fold, by table: the point after it, DROP when the fold drops it (control
   characters other than tab, line feed and carriage return), with SPACE set on whitespace
   (str.split's, the same for every code point under 128). */
#define DROP 0xFFFFFFFFu
#define SPACE 0x80000000u     /* above every code point */
static uint32_t ascii_table[128];

static void fill_ascii_table(void)
{
    for (uint32_t c = 0; c < 128; c++) {
        uint32_t folded = c >= 'A' && c <= 'Z' ? c + 32 : c;
        if ((c < 32 && c != '\t' && c != '\n' && c != '\r') || c == 127)
            folded = DROP;
        else if (Py_UNICODE_ISSPACE(c))
            folded |= SPACE;
        ascii_table[c] = folded;
    }
}

static inline uint32_t fold_point(uint32_t c)
{
    if (c < 128)
        return ascii_table[c];
    return Py_UNICODE_ISSPACE(c) ? SPACE : c;
}

/* The points of the text into out[MAX_POINTS] (their count): " ".join(folded.split()), cut to
   its first and last MAX_CHARS / 2 characters with a space between when longer than MAX_CHARS,
   a space at each end. A text of at most MAX_CHARS code points is read once; a longer one
   twice, first to count. */
#define POINTS_OF(NAME, TYPE)                                                                   \
    static Py_ssize_t NAME(const TYPE *data, Py_ssize_t n, uint32_t *out)                       \
    {                                                                                           \
        Py_ssize_t length = n; /* the joined text's length, or a bound on it */                 \
        int gap = 0;                                                                            \
        if (n > MAX_CHARS) {                                                                    \
            length = 0;                                                                         \
            for (Py_ssize_t i = 0; i < n; i++) {                                                \
                uint32_t c = fold_point(data[i]);                                               \
                if (c == DROP)                                                                  \
                    continue;                                                                   \
                if (c & SPACE) {                                                                \
                    gap = length > 0;                                                           \
                } else {                                                                        \
                    length += gap + 1;                                                          \
                    gap = 0;                                                                    \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        const int cut = length > MAX_CHARS;                                                     \
        const Py_ssize_t head = cut ? MAX_CHARS / 2 : length;                                   \
        const Py_ssize_t tail = cut ? length - MAX_CHARS / 2 : length;                          \
        Py_ssize_t k = 0, at = 0; /* at: the position in the joined text */                     \
        out[k++] = ' ';                                                                         \
        gap = 0;                                                                                \
        for (Py_ssize_t i = 0; i < n; i++) {                                                    \
            uint32_t c = fold_point(data[i]);                                                   \
            if (c == DROP)                                                                      \
                continue;                                                                       \
            if (c & SPACE) {                                                                    \
                gap = at > 0;                                                                   \
                continue;                                                                       \
            }                                                                                   \
            for (int step = gap; step >= 0; step--) { /* the space between words, then c */     \
                if (at < head || at >= tail)                                                    \
                    out[k++] = step ? ' ' : c;                                                  \
                if (++at == head && cut)                                                        \
                    out[k++] = ' ';                                                             \
            }                                                                                   \
            gap = 0;                                                                            \
        }                                                                                       \
        out[k++] = ' ';                                                                         \
        return k;                                                                               \
    }

POINTS_OF(points_of_1, Py_UCS1)
POINTS_OF(points_of_2, Py_UCS2)
POINTS_OF(points_of_4, Py_UCS4)

static Py_ssize_t points_of(PyObject *text, uint32_t *out)
{
    const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        return points_of_1(PyUnicode_1BYTE_DATA(text), n, out);
    case PyUnicode_2BYTE_KIND:
        return points_of_2(PyUnicode_2BYTE_DATA(text), n, out);
    default:
        return points_of_4(PyUnicode_4BYTE_DATA(text), n, out);
    }
}

static inline uint64_t bucket(uint64_t hash, int order)
{
    return ((hash ^ (uint64_t)order) * MIX) >> (64 - DIM_BITS);
}

/* The buckets of every order's n-grams, order by order (lexical._hashed's layout). */
static Py_ssize_t buckets_of(const uint32_t *p, Py_ssize_t size, int64_t *out)
{
    Py_ssize_t at = 0;
    for (int order = MIN_ORDER; order <= MAX_ORDER; order++) {
        for (Py_ssize_t i = 0; i + order <= size; i++) {
            uint64_t hash = p[i];
            for (int j = 1; j < order; j++)
                hash = hash * PRIME + p[i + j];
            out[at++] = (int64_t)bucket(hash, order);
        }
    }
    return at;
}

/* numpy's sum of a float64 array: pairwise, eight accumulators in blocks of up to 128. */
static double pairwise_sum(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double sum = -0.0;
        for (Py_ssize_t i = 0; i < n; i++)
            sum += a[i];
        return sum;
    }
    if (n <= PAIRWISE_BLOCK) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            sum += a[i];
        return sum;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

/* lexical.grams_in: how many n-grams of a text of `size` points start in [start, end). */
static Py_ssize_t grams_in(Py_ssize_t start, Py_ssize_t end, Py_ssize_t size)
{
    Py_ssize_t count = 0;
    for (int order = MIN_ORDER; order <= MAX_ORDER; order++) {
        Py_ssize_t last = size - order + 1 < end ? size - order + 1 : end;
        if (last > start)
            count += last - start;
    }
    return count;
}

/* lexical.windowed for these orders, over the points' n-grams. */
#if defined(__GNUC__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)(address))
#endif

static double score_of(const float *weights, const uint32_t *p, Py_ssize_t size, double *total, double *sums,
                       uint32_t *at)
{
    if (size < MIN_ORDER)
        return 0.0;
    /* Every n-gram's bucket first, each weight asked for as it is known: the table (1 MiB) is
       mostly out of the caches when a request comes, and the reads then overlap. */
    Py_ssize_t grams = 0;
    for (Py_ssize_t i = 0; i < size; i++) {
        uint64_t hash = p[i];
        for (int order = 2; order <= MAX_ORDER && i + order <= size; order++) {
            hash = hash * PRIME + p[i + order - 1];
            if (order >= MIN_ORDER) {
                uint32_t b = (uint32_t)bucket(hash, order);
                at[i * N_ORDERS + order - MIN_ORDER] = b;
                PREFETCH(weights + b);
                grams++;
            }
        }
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        /* total[i]: the weights of the n-grams starting at i, the orders added in turn. */
        double t = 0.0;
        for (int order = MIN_ORDER; order <= MAX_ORDER && i + order <= size; order++)
            t += (double)weights[at[i * N_ORDERS + order - MIN_ORDER]];
        total[i] = t;
    }
    double best = (0.0 + pairwise_sum(total, size)) / sqrt((double)grams);
    if (size > WINDOW) {
        sums[0] = 0.0;
        for (Py_ssize_t i = 0; i < size; i++)
            sums[i + 1] = sums[i] + total[i];
        const Py_ssize_t stretches = size - WINDOW + 1;
        Py_ssize_t full = size - MAX_ORDER + 1 - WINDOW + 1;      /* stretches holding every order's n-grams */
        if (full < 0)
            full = 0;
        if (full) {
            double top = sums[WINDOW] - sums[0];
            for (Py_ssize_t j = 1; j < full; j++) {
                double value = sums[j + WINDOW] - sums[j];
                if (value > top)
                    top = value;
            }
            double value = top / sqrt((double)(N_ORDERS * WINDOW));
            if (value > best)
                best = value;
        }
        for (Py_ssize_t j = full; j < stretches; j++) {
            Py_ssize_t count = grams_in(j, j + WINDOW, size);
            double value = (sums[j + WINDOW] - sums[j]) / sqrt((double)(count > 1 ? count : 1));
            if (value > best)
                best = value;
        }
    }
    return best;
}

static int text_arg(PyObject *text)
{
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "text must be a str");
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* A str made by the legacy API (PyUnicode_FromUnicode(NULL, n)) has no length or kind until
       it is readied: read as it is, it would be an empty text. Every str is ready from 3.12. */
    if (PyUnicode_READY(text) < 0)
        return -1;
#endif
    return 0;
}

/* A table argument: `count` C-contiguous items of `itemsize` bytes (of `format` when not NULL);
   else released, with ValueError set, so that no lookup reads past it. */
static int table_arg(PyObject *table, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, const char *format)
{
    if (PyObject_GetBuffer(table, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len != itemsize * count
        || (format != NULL && (view->format == NULL || strcmp(view->format, format) != 0))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "a table of %zd items of %zd bytes%s%s is needed", count, itemsize,
                     format != NULL ? ", format " : "", format != NULL ? format : "");
        return -1;
    }
    return 0;
}

static PyObject *py_score(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "score(weights, text)");
        return NULL;
    }
    if (text_arg(args[1]) < 0)
        return NULL;
    Py_buffer view;
    if (table_arg(args[0], &view, 4, DIM, "f") < 0)
        return NULL;
    uint32_t *points = PyMem_Malloc(MAX_POINTS * sizeof(uint32_t));
    double *work = PyMem_Malloc((2 * MAX_POINTS + 1) * sizeof(double));
    uint32_t *at = PyMem_Malloc(N_ORDERS * MAX_POINTS * sizeof(uint32_t));
    if (points == NULL || work == NULL || at == NULL) {
        PyMem_Free(points);
        PyMem_Free(work);
        PyMem_Free(at);
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_ssize_t size = points_of(args[1], points);
    double best = score_of((const float *)view.buf, points, size, work, work + MAX_POINTS, at);
    PyMem_Free(points);
    PyMem_Free(work);
    PyMem_Free(at);
    PyBuffer_Release(&view);
    return PyFloat_FromDouble(best);
}

static PyObject *py_buckets(PyObject *module, PyObject *text)
{
    (void)module;
    if (text_arg(text) < 0)
        return NULL;
    uint32_t *points = PyMem_Malloc(MAX_POINTS * sizeof(uint32_t));
    if (points == NULL)
        return PyErr_NoMemory();
    Py_ssize_t size = points_of(text, points);
    Py_ssize_t count = 0;
    for (int order = MIN_ORDER; order <= MAX_ORDER; order++)
        count += size >= order ? size - order + 1 : 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int64_t));
    if (out != NULL)
        buckets_of(points, size, (int64_t *)PyBytes_AS_STRING(out));
    PyMem_Free(points);
    return out;
}

/* normalize._by_table's lookups in one pass: the kinds of the text's characters or-ed together
   (BEYOND_BMP for a character past the Basic Multilingual Plane, where the tables end); where
   none has a kind in `stop`, the text with each character replaced by single[] (the text
   itself when none has `changes`); else the or-ed kinds, for normalize.py to go on from. */
#define BEYOND_BMP 0x100

static PyObject *py_fold_by_table(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5 || text_arg(args[0]) < 0 || !PyLong_Check(args[3]) || !PyLong_Check(args[4])) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "fold_by_table(text, kinds, single, stop, changes)");
        return NULL;
    }
    PyObject *text = args[0];
    const long stop = PyLong_AsLong(args[3]), changes = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer kinds, single;
    if (table_arg(args[1], &kinds, 1, 0x10000, NULL) < 0)
        return NULL;
    if (table_arg(args[2], &single, 4, 0x10000, NULL) < 0) {
        PyBuffer_Release(&kinds);
        return NULL;
    }
    PyObject *out = NULL;
    const uint8_t *kind_of = kinds.buf;
    const uint32_t *single_of = single.buf;
    const int unit = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    long seen = 0;
    Py_UCS4 top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(unit, data, i);
        if (c >= 0x10000) {
            out = PyLong_FromLong(seen | BEYOND_BMP);
            goto done;
        }
        seen |= kind_of[c];
        if (single_of[c] > top)
            top = single_of[c];
    }
    if (seen & stop) {
        out = PyLong_FromLong(seen);
    } else if (!(seen & changes)) {
        Py_INCREF(text);
        out = text;
    } else {
        if (top > 0x10FFFF) {
            PyErr_SetString(PyExc_ValueError, "single maps to a value past the last code point");
            goto done;
        }
        out = PyUnicode_New(n, top);
        if (out == NULL)
            goto done;
        const int out_unit = PyUnicode_KIND(out);
        void *out_data = PyUnicode_DATA(out);
        for (Py_ssize_t i = 0; i < n; i++)
            PyUnicode_WRITE(out_unit, out_data, i, single_of[PyUnicode_READ(unit, data, i)]);
    }
done:
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&single);
    return out;
}

/* normalize.squeezed's lookups in one pass: the characters of a folded text that kept[] keeps,
   and each one's offset in the text (native int64 bytes); None for a text with a character
   past the Basic Multilingual Plane, where the table ends. */
static PyObject *py_squeeze_by_table(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "squeeze_by_table(text, kept)");
        return NULL;
    }
    if (text_arg(args[0]) < 0)
        return NULL;
    PyObject *text = args[0];
    Py_buffer kept;
    if (table_arg(args[1], &kept, 1, 0x10000, NULL) < 0)
        return NULL;
    PyObject *out = NULL, *squeezed = NULL, *offsets = NULL;
    const uint8_t *keep = kept.buf;
    const int unit = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    const Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    Py_ssize_t count = 0;
    Py_UCS4 top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(unit, data, i);
        if (c >= 0x10000) {
            Py_INCREF(Py_None);
            out = Py_None;
            goto done;
        }
        if (keep[c]) {
            count++;
            if (c > top)
                top = c;
        }
    }
    squeezed = PyUnicode_New(count, top);
    offsets = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int64_t));
    if (squeezed == NULL || offsets == NULL)
        goto done;
    const int out_unit = PyUnicode_KIND(squeezed);
    void *out_data = PyUnicode_DATA(squeezed);
    int64_t *where = (int64_t *)PyBytes_AS_STRING(offsets);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n && k < count; i++) {
        Py_UCS4 c = PyUnicode_READ(unit, data, i);
        if (keep[c]) {
            PyUnicode_WRITE(out_unit, out_data, k, c);
            where[k++] = i;
        }
    }
    out = PyTuple_Pack(2, squeezed, offsets);
done:
    Py_XDECREF(squeezed);
    Py_XDECREF(offsets);
    PyBuffer_Release(&kept);
    return out;
}

/* pii.Candidates' ranges in one pass over a text's character classes (one byte each, bits as
   pii.py sets them), for each spec (member, counted, least, also, also_least, after): the
   maximal runs of characters with a bit of `member`, of which at least `least` have a bit of
   `counted` and at least `also_least` a bit of `also`; each run's end put `after` characters
   further (the pattern's lookahead reads them; at most the text's end), and runs that then
   touch merged. A list of (start, end) per spec. tests/unit/guard/test_guard_compiled.py checks
   it against its definition in Python. */
#define MAX_SPECS 8

typedef struct {
    uint8_t member, counted, also, key;
    Py_ssize_t least, also_least, after;
    Py_ssize_t read;                    /* characters before it belong to runs read */
    Py_ssize_t last_start, last_end;    /* the range not yet appended; -1: none */
    PyObject *out;
} RunSpec;

static int spec_arg(PyObject *item, RunSpec *spec)
{
    long numbers[6];
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
        PyErr_SetString(PyExc_TypeError, "runs: each spec is (member, counted, least, also, also_least, after)");
        return -1;
    }
    for (int k = 0; k < 6; k++) {
        numbers[k] = PyLong_AsLong(PyTuple_GET_ITEM(item, k));
        if (numbers[k] == -1 && PyErr_Occurred())
            return -1;
        if (numbers[k] < 0 || ((k == 0 || k == 1 || k == 3) && numbers[k] > 255)) {
            PyErr_SetString(PyExc_ValueError, "runs: masks are bytes and counts are not negative");
            return -1;
        }
    }
    spec->member = (uint8_t)numbers[0];
    spec->counted = (uint8_t)numbers[1];
    spec->least = numbers[2];
    spec->also = (uint8_t)numbers[3];
    spec->also_least = numbers[4];
    spec->after = numbers[5];
    /* A run that can count holds a character of `key`: the pass skips to the next one (the
       digits of a text, few in prose), then reads the run around it, back to its start. */
    spec->key = spec->least > 0 ? spec->counted : spec->also_least > 0 ? spec->also : spec->member;
    spec->read = 0;
    spec->last_start = spec->last_end = -1;
    spec->out = PyList_New(0);
    return spec->out == NULL ? -1 : 0;
}

static int flush_range(RunSpec *spec)
{
    if (spec->last_start < 0)
        return 0;
    PyObject *range = Py_BuildValue("(nn)", spec->last_start, spec->last_end);
    int failed = range == NULL || PyList_Append(spec->out, range) < 0;
    Py_XDECREF(range);
    return failed ? -1 : 0;
}

static PyObject *py_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) > MAX_SPECS) {
        PyErr_SetString(PyExc_TypeError, "runs(classes, specs): specs a tuple of at most 8 specs");
        return NULL;
    }
    RunSpec specs[MAX_SPECS];
    const Py_ssize_t count_specs = PyTuple_GET_SIZE(args[1]);
    Py_ssize_t made = 0;
    PyObject *result = NULL;
    Py_buffer view;
    view.obj = NULL;
    uint8_t any_key = 0;
    for (; made < count_specs; made++) {
        if (spec_arg(PyTuple_GET_ITEM(args[1], made), &specs[made]) < 0)
            goto done;
        any_key |= specs[made].key;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0) {
        view.obj = NULL;
        goto done;
    }
    if (view.itemsize != 1) {
        PyErr_SetString(PyExc_ValueError, "runs: classes are one byte a character");
        goto done;
    }
    const uint8_t *classes = view.buf;
    const Py_ssize_t n = view.len;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t c = classes[i];
        if (!(c & any_key))
            continue;
        for (Py_ssize_t k = 0; k < count_specs; k++) {
            RunSpec *spec = &specs[k];
            if (i < spec->read || !(c & spec->key) || !(c & spec->member))
                continue;
            Py_ssize_t start = i, end = i, count = 0, also_count = 0;
            while (start > spec->read && (classes[start - 1] & spec->member))
                start--;
            for (end = start; end < n && (classes[end] & spec->member); end++) {
                count += (classes[end] & spec->counted) != 0;
                also_count += (classes[end] & spec->also) != 0;
            }
            spec->read = end;
            if (count < spec->least || also_count < spec->also_least)
                continue;
            const Py_ssize_t until = spec->after < n - end ? end + spec->after : n;
            if (spec->last_start >= 0 && start <= spec->last_end) {
                spec->last_end = until;
                continue;
            }
            if (flush_range(spec) < 0)
                goto done;
            spec->last_start = start;
            spec->last_end = until;
        }
    }
    result = PyList_New(count_specs);
    for (Py_ssize_t k = 0; result != NULL && k < count_specs; k++) {
        if (flush_range(&specs[k]) < 0) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, k, specs[k].out);
        specs[k].out = NULL;
    }
done:
    for (Py_ssize_t k = 0; k < made; k++)
        Py_XDECREF(specs[k].out);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"score", (PyCFunction)(void (*)(void))py_score, METH_FASTCALL,
     "score(weights, text): lexical.score; text is the raw text when ASCII, else its fold."},
    {"buckets", py_buckets, METH_O,
     "buckets(text): lexical.buckets as native int64 bytes, order by order; text as for score."},
    {"fold_by_table", (PyCFunction)(void (*)(void))py_fold_by_table, METH_FASTCALL,
     "fold_by_table(text, kinds, single, stop, changes): normalize._by_table's lookups (see there)."},
    {"squeeze_by_table", (PyCFunction)(void (*)(void))py_squeeze_by_table, METH_FASTCALL,
     "squeeze_by_table(text, kept): normalize.squeezed's lookups (see there)."},
    {"runs", (PyCFunction)(void (*)(void))py_runs, METH_FASTCALL,
     "runs(classes, specs): pii.Candidates' ranges, a list per spec (see there)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_ngrams", "Compiled n-gram features of sidecar/guard/lexical.py.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ngrams(void)
{
    fill_ascii_table();
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    /* lexical.py uses this module only where its own definition says the same. */
    if (PyModule_AddIntConstant(module, "DIM_BITS", DIM_BITS) < 0
        || PyModule_AddIntConstant(module, "MAX_CHARS", MAX_CHARS) < 0
        || PyModule_AddIntConstant(module, "WINDOW", WINDOW) < 0
        || PyModule_AddIntConstant(module, "BEYOND_BMP", BEYOND_BMP) < 0
        || PyModule_AddObject(module, "ORDERS", Py_BuildValue("(iii)", MIN_ORDER, MIN_ORDER + 1, MAX_ORDER)) < 0
        || PyModule_AddObject(module, "PRIME", PyLong_FromUnsignedLongLong(PRIME)) < 0
        || PyModule_AddObject(module, "MIX", PyLong_FromUnsignedLongLong(MIX)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
