/* A row's table in `SeqTable`: looking rows up, filling a new one, its slots. */
#include "_rows.h"

/* lookup_rows(row_of, seqs, out) -> looked up
 *
 * The rows of `seqs` (a list or tuple) in `row_of` (a dict: sequence -> row), into out[:n].
 * Returns len(seqs) when every sequence is found and none repeats, else the index of the first
 * sequence that is missing or repeated (the caller names it). */
PyObject *lookup_rows(PyObject *Py_UNUSED(self), PyObject *const *args,
                             Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL, *seqs = NULL;
    uint8_t *seen = NULL;
    Py_ssize_t n_out;
    if (!expect_args("lookup_rows", nargs, 3)) return NULL;
    if (!PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "lookup_rows: row_of must be a dict");
        return NULL;
    }
    if (!(seqs = PySequence_Fast(args[1], "lookup_rows: seqs must be a sequence"))) return NULL;
    int64_t *out = I64(args[2], 1, "out", &n_out);
    if (out == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seqs), looked = 0;
    CHECK(n_out >= n, "out holds %zd rows for %zd sequences", n_out, n);
    int64_t most = -1;
    /* find each row */
    for (; looked < n; looked++) {
        PyObject *row = PyDict_GetItemWithError(args[0], PySequence_Fast_GET_ITEM(seqs, looked));
        if (row == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
        out[looked] = PyLong_AsLongLong(row);
        if (out[looked] == -1 && PyErr_Occurred()) goto done;
        CHECK(out[looked] >= 0, "row %lld out of range", (long long)out[looked]);
        if (out[looked] > most) most = out[looked];
    }
    /* the first repeat among those found */
    if (looked && !(seen = PyMem_Calloc((size_t)most + 1, 1))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < looked; i++) {
        if (seen[out[i]]++) {
            looked = i;
            break;
        }
    }
    result = PyLong_FromSsize_t(looked);
done:
    PyMem_Free(seen);
    Py_XDECREF(seqs);
    give_back(&b);
    return result;
}

/* fill_row(row, table, tokens, committed, tail, region, region_size, num_tokens, num_blocks,
 *          start, capacity, data, committed_counts, partial) -> None
 *
 * A new sequence's row (`BlockPool.allocate`), which has no region yet: the region of
 * region_size entries at `region` (taken by the caller; 0, 0 for none), its table there (an
 * int64 array of ceil(tokens / block_size) blocks), its token count, its committed blocks, and
 * the ids of its partial last block (tail: tokens % block_size of them, or None when
 * unknown). */
PyObject *fill_row(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL;
    Tables t;
    Py_ssize_t row, n, num_tokens, committed, region, size, n_tail = 0, n_committed, n_partial;
    if (!expect_args("fill_row", nargs, 14)) return NULL;
    if (!get_size(args[0], 0, "row", &row) || !get_size(args[2], 0, "tokens", &num_tokens) ||
        !get_size(args[3], 0, "committed", &committed) ||
        !get_size(args[5], 0, "region", &region) || !get_size(args[6], 0, "region_size", &size))
        return NULL;
    const int64_t *table = I64(args[1], 0, "table", &n);
    if (table == NULL) goto done;
    const int64_t *tail = args[4] == Py_None ? NULL : I64(args[4], 0, "tail", &n_tail);
    if ((args[4] != Py_None && tail == NULL) || !borrow_tables(&b, args + 7, 1, &t)) goto done;
    int64_t *counts = I64(args[12], 1, "committed_counts", &n_committed);
    int64_t *partial = counts ? I64(args[13], 1, "partial", &n_partial) : NULL;
    if (partial == NULL) goto done;
    /* check: the row and its new region, the counts, the tail's length */
    CHECK(row < t.num_rows && n_committed == t.num_rows && t.capacity[row] == 0,
          "row %zd out of range or holding a region", row);
    Py_ssize_t bs = n_partial / t.num_rows;
    CHECK(n_partial == t.num_rows * bs && bs > 0, "partial has %zd ids", n_partial);
    CHECK(n <= size && region + size <= t.num_entries, "a table of %zd entries in a region of "
          "%zd at %zd (of %zd)", n, size, region, t.num_entries);
    CHECK(n == (num_tokens + bs - 1) / bs && committed <= num_tokens / bs,
          "row %zd: %zd tokens, %zd committed in %zd blocks", row, num_tokens, committed, n);
    CHECK(tail == NULL || n_tail == num_tokens % bs, "%zd tail ids for %zd tokens", n_tail,
          num_tokens);
    /* fill */
    t.start[row] = region;
    t.capacity[row] = size;
    memcpy(t.data + region, table, n * sizeof(int64_t));
    t.num_tokens[row] = num_tokens;
    t.num_blocks[row] = n;
    counts[row] = committed;
    if (tail) memcpy(partial + row * bs, tail, n_tail * sizeof(int64_t));
    result = Py_NewRef(Py_None);
done:
    give_back(&b);
    return result;
}

/* table_slots(table, num_tokens, block_size) -> list
 *
 * The slots of a table's first num_tokens tokens: block * block_size + offset, in order. */
PyObject *table_slots(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL;
    Py_ssize_t n, num_tokens, bs;
    if (!expect_args("table_slots", nargs, 3)) return NULL;
    const int64_t *table = I64(args[0], 0, "table", &n);
    if (table == NULL || !get_size(args[1], 0, "num_tokens", &num_tokens) ||
        !get_size(args[2], 1, "block_size", &bs))
        goto done;
    CHECK(num_tokens <= n * bs, "%zd tokens in a table of %zd blocks", num_tokens, n);
    PyObject *slots = PyList_New(num_tokens);
    if (slots == NULL) goto done;
    for (Py_ssize_t block = 0, i = 0; i < num_tokens; block++) {  /* no division per slot */
        for (Py_ssize_t offset = 0; offset < bs && i < num_tokens; offset++, i++) {
            PyObject *slot = PyLong_FromLongLong(table[block] * bs + offset);
            if (slot == NULL) {
                Py_DECREF(slots);
                goto done;
            }
            PyList_SET_ITEM(slots, i, slot);
        }
    }
    result = slots;
done:
    give_back(&b);
    return result;
}
