/* Borrowing arrays and reading a call's arguments: the helpers every function of _rows uses
 * (declared in _rows.h). */
#include "_rows.h"

/* Release every buffer the call borrowed (on each of its exits). */
void give_back(Borrowed *b) {
    for (int i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    b->n = 0;
}

/* Whether a buffer format names `kind` ('q' int64, '?' bool) in native order. */
static int format_is(const char *format, char kind) {
    if (format == NULL) return 0;
    if (*format == '@' || *format == '=' || *format == '<') format++;
    if (kind == 'q') return (format[0] == 'q' || format[0] == 'l') && format[1] == '\0';
    return format[0] == kind && format[1] == '\0';
}

/* Borrow `obj` as a C-contiguous array of `itemsize`-byte items of `kind`; NULL with
 * TypeError naming `name` otherwise. `len` gets the item count (all dimensions). */
void *borrow(Borrowed *b, PyObject *obj, char kind, int writable, const char *name,
             Py_ssize_t *len) {
    if (b->n == MAX_VIEWS) {
        PyErr_Format(PyExc_SystemError, "%s: more than %d arrays in one call", name, MAX_VIEWS);
        return NULL;
    }
    Py_buffer *view = &b->views[b->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    Py_ssize_t itemsize = kind == 'q' ? 8 : 1;
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s %s array", name,
                     writable ? " writable" : "", kind == 'q' ? "int64" : "bool");
        return NULL;
    }
    b->n++;
    if (view->itemsize != itemsize || !format_is(view->format, kind)) {
        PyErr_Format(PyExc_TypeError, "%s must be a %s array, got format %s", name,
                     kind == 'q' ? "int64" : "bool", view->format ? view->format : "?");
        return NULL;
    }
    *len = view->len / itemsize;
    return view->buf;
}


int expect_args(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
    return 0;
}

/* A block size, a count or a sentinel: an int >= `least`. */
int get_size(PyObject *obj, Py_ssize_t least, const char *name, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) return 0;
    if (*out < least) {
        PyErr_Format(PyExc_ValueError, "%s must be >= %zd, got %zd", name, least, *out);
        return 0;
    }
    return 1;
}


int get_block_size(PyObject *obj, BlockSize *b) {
    Py_ssize_t size;
    if (!get_size(obj, 1, "block_size", &size)) return 0;
    b->size = size;
    b->shift = (size & (size - 1)) == 0 ? __builtin_ctzll((unsigned long long)size) : -1;
    return 1;
}


int borrow_tables(Borrowed *bp, PyObject *const *args, int writable, Tables *t) {
    Py_ssize_t lens[4];
    const char *names[4] = {"num_tokens", "num_blocks", "start", "capacity"};
    int64_t **arrays[4] = {&t->num_tokens, &t->num_blocks, &t->start, &t->capacity};
    for (int i = 0; i < 4; i++) {
        *arrays[i] = borrow(bp, args[i], 'q', writable, names[i], &lens[i]);
        if (*arrays[i] == NULL) return 0;
        if (lens[i] != lens[0]) {
            PyErr_Format(PyExc_ValueError, "%s has %zd rows, num_tokens %zd", names[i],
                         lens[i], lens[0]);
            return 0;
        }
    }
    t->num_rows = lens[0];
    t->data = borrow(bp, args[4], 'q', writable, "data", &t->num_entries);
    return t->data != NULL;
}
