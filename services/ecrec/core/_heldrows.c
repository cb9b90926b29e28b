/* A parity server's version-ordered apply of xor deltas, rows held for a predecessor kept in flat arrays
 * (ecrec.core.heldrows; the numpy path in ecrec.core.ordered_xor and the torch path in ecrec.core.txn are
 * the references it is tested against).
 *
 * Why C: with several workers on hot rows half the delivered batches have rows ahead of a predecessor. In
 * numpy every batch, every held batch cut and every retry costs a dozen calls of ~1-5 us each at a batch's
 * ~30-100 rows, and that per-call cost — not the rows — was what grew a stage by 40% from one worker to
 * four (docs/benchmarks.md, "The held path in C"). Here one call takes a batch: rows next in their version order are xored
 * in, rows further ahead are copied into the held arrays, and each applied row releases the held rows of
 * its own (record, member) key that are now next, repeatedly.
 *
 * Plain CPython with the buffer protocol (numpy arrays and torch tensors' numpy views): no numpy headers.
 * The caller (Python) owns every array; it makes room in the held arrays before the call (capacity >= held
 * rows + the batch's rows), and every index is checked here before anything is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int taken;
} arg_t;

static int take(PyObject *obj, arg_t *a, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) {
        return -1;
    }
    a->taken = 1;
    if (a->view.itemsize != itemsize || a->view.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes expected, got %zd", name, itemsize,
                     a->view.itemsize);
        return -1;
    }
    return 0;
}

static void release(arg_t *args, int n) {
    for (int i = 0; i < n; i++) {
        if (args[i].taken) {
            PyBuffer_Release(&args[i].view);
        }
    }
}

/* The held arrays, a row of which is (key, index, version, part, delta[W]). */
typedef struct {
    int64_t *key, *index, *version, *part;
    int32_t *delta;
    Py_ssize_t count, capacity;
} held_t;

typedef struct {
    int32_t *bits; /* the parity records' bits, [P, W] */
    int64_t *pver; /* [P * k]: the member version each record reflects */
    int32_t *marks; /* [P * k]: held rows per key */
    Py_ssize_t width;
    Py_ssize_t released, dropped;
} records_t;

static inline void xor_row(int32_t *dst, const int32_t *src, Py_ssize_t width) {
    for (Py_ssize_t j = 0; j < width; j++) {
        dst[j] ^= src[j];
    }
}

static void drop_at(held_t *h, records_t *r, Py_ssize_t j) {
    Py_ssize_t last = h->count - 1;
    r->marks[h->key[j]]--;
    if (j != last) { /* the order of held rows means nothing: the last one takes the gap */
        h->key[j] = h->key[last];
        h->index[j] = h->index[last];
        h->version[j] = h->version[last];
        h->part[j] = h->part[last];
        memcpy(h->delta + j * r->width, h->delta + last * r->width, r->width * sizeof(int32_t));
    }
    h->count = last;
}

/* Key `key` just advanced: apply its held rows that are next now, again and again; rows it already reflects
 * (a duplicate delivery held twice) leave too. */
static void release_key(held_t *h, records_t *r, int64_t key) {
    int progress = 1;
    while (progress && r->marks[key] > 0) {
        progress = 0;
        for (Py_ssize_t j = 0; j < h->count; j++) {
            if (h->key[j] != key) {
                continue;
            }
            int64_t step = h->version[j] - r->pver[key];
            if (step == 1) {
                xor_row(r->bits + h->index[j] * r->width, h->delta + j * r->width, r->width);
                r->pver[key] = h->version[j];
                r->released++;
                progress = 1;
            } else if (step < 1) {
                r->dropped++;
            } else {
                continue;
            }
            drop_at(h, r, j);
            j--;
        }
    }
}

static PyObject *apply(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *o[12];
    Py_ssize_t count, width, k, part;
    if (!PyArg_ParseTuple(args, "OOOnnOOOOOOOOOnn", &o[0], &o[1], &o[2], &width, &k, &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &count, &part)) {
        return NULL;
    }
    arg_t a[12];
    memset(a, 0, sizeof(a));
    static const char *names[12] = {"bits", "pver", "marks", "index", "slot", "version", "delta",
                                    "held key", "held index", "held version", "held part", "held delta"};
    static const Py_ssize_t sizes[12] = {4, 8, 4, 8, 8, 8, 4, 8, 8, 8, 8, 4};
    static const int writable[12] = {1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1};
    PyObject *result = NULL;
    for (int i = 0; i < 12; i++) {
        if (take(o[i], &a[i], sizes[i], writable[i], names[i]) < 0) {
            goto done;
        }
    }
    if (width <= 0 || k <= 0) {
        PyErr_SetString(PyExc_ValueError, "width, k: at least one 32-bit word per record, one member per stripe");
        goto done;
    }
    Py_ssize_t records = a[0].view.len / 4 / width, keys = a[1].view.len / 8;
    Py_ssize_t n = a[3].view.len / 8, capacity = a[7].view.len / 8;
    if (a[0].view.len / 4 != records * width || keys != records * k || a[2].view.len / 4 != keys ||
        a[4].view.len / 8 != n ||
        a[5].view.len / 8 != n || a[6].view.len / 4 != n * width) {
        PyErr_SetString(PyExc_ValueError, "bits, pver, marks and the batch's arrays disagree in size");
        goto done;
    }
    if (a[8].view.len / 8 != capacity || a[9].view.len / 8 != capacity || a[10].view.len / 8 != capacity ||
        a[11].view.len / 4 != capacity * width) {
        PyErr_SetString(PyExc_ValueError, "the held arrays disagree in size");
        goto done;
    }
    if (count < 0 || count + n > capacity) {
        PyErr_Format(PyExc_ValueError, "held arrays: room for %zd rows, %zd held + %zd arriving", capacity,
                     count, n);
        goto done;
    }
    const int64_t *index = a[3].view.buf, *slot = a[4].view.buf, *version = a[5].view.buf;
    const int32_t *delta = a[6].view.buf;
    for (Py_ssize_t i = 0; i < n; i++) { /* every index checked before anything is written */
        if (index[i] < 0 || index[i] >= records || slot[i] < 0 || slot[i] >= k) {
            PyErr_Format(PyExc_ValueError, "row %zd: record %lld or slot %lld out of range", i,
                         (long long)index[i], (long long)slot[i]);
            goto done;
        }
    }
    records_t r = {a[0].view.buf, a[1].view.buf, a[2].view.buf, width, 0, 0};
    held_t h = {a[7].view.buf, a[8].view.buf, a[9].view.buf, a[10].view.buf, a[11].view.buf, count, capacity};
    Py_ssize_t applied = 0, ahead = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t key = index[i] * k + slot[i], step = version[i] - r.pver[key];
        if (step == 1) {
            xor_row(r.bits + index[i] * width, delta + i * width, width);
            r.pver[key] = version[i];
            applied++;
            if (r.marks[key] > 0) {
                release_key(&h, &r, key);
            }
        } else if (step > 1) {
            Py_ssize_t j = h.count++;
            h.key[j] = key;
            h.index[j] = index[i];
            h.version[j] = version[i];
            h.part[j] = part;
            memcpy(h.delta + j * width, delta + i * width, width * sizeof(int32_t));
            r.marks[key]++;
            ahead++;
        }
    }
    result = Py_BuildValue("nnnnn", h.count, applied, ahead, r.released, r.dropped);
done:
    release(a, 12);
    return result;
}

static PyMethodDef methods[] = {
    {"apply", apply, METH_VARARGS,
     "apply(bits, pver, marks, width, k, index, slot, version, delta, held_key, held_index, held_version, "
     "held_part, held_delta, held_count, part) -> (held_count, applied, ahead, released, dropped)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_heldrows", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__heldrows(void) { return PyModule_Create(&module); }
