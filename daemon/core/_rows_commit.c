/* Commits: the full blocks past each row's committed ones (`SeqTable`), and their keys made
 * matchable (`PrefixCache`). */
#include "_rows.h"

/* commit_runs(rows, counts, num_tokens, num_blocks, start, capacity, data, committed,
 *             block_size) -> (rows, committed before, blocks) as lists
 *
 * Row rows[i] commits its first counts[i] tokens (counts None: all it holds); the full blocks
 * among them past its committed ones are listed in order, rows in order, and its committed
 * count is raised. Returns the rows that changed with their old counts (the undo) and the
 * blocks. */
PyObject *commit_runs(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL, *changed = NULL, *before = NULL, *blocks = NULL;
    Tables t;
    Py_ssize_t n, n_counts = 0, n_committed;
    BlockSize bs;
    if (!expect_args("commit_runs", nargs, 9)) return NULL;
    const int64_t *rows = I64(args[0], 0, "rows", &n);
    if (rows == NULL) goto done;
    const int64_t *counts = args[1] == Py_None ? NULL : I64(args[1], 0, "counts", &n_counts);
    if ((args[1] != Py_None && counts == NULL) || !borrow_tables(&b, args + 2, 0, &t))
        goto done;
    int64_t *committed = I64(args[7], 1, "committed", &n_committed);
    if (committed == NULL || !get_block_size(args[8], &bs)) goto done;
    CHECK(n_committed == t.num_rows, "committed has %zd rows, num_tokens %zd", n_committed,
          t.num_rows);
    CHECK(counts == NULL || n_counts == n, "%zd counts for %zd rows", n_counts, n);
    if (!(changed = PyList_New(0)) || !(before = PyList_New(0)) || !(blocks = PyList_New(0)))
        goto done;

    /* gather: every block to commit, with its index checked (nothing written yet) */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        CHECK(row >= 0 && row < t.num_rows, "row %lld out of range", (long long)row);
        int64_t held = t.num_tokens[row], upto = counts ? counts[i] : held;
        CHECK(upto >= 0 && upto <= held, "row %lld: %lld tokens to commit of %lld",
              (long long)row, (long long)upto, (long long)held);
        upto = block_of(bs, upto);
        if (upto <= committed[row]) continue;
        CHECK(upto <= t.num_blocks[row] && entry_at(&t, row, committed[row]) >= 0 &&
              entry_at(&t, row, upto - 1) >= 0, "row %lld: table entry outside the store",
              (long long)row);
        for (int64_t logical = committed[row]; logical < upto; logical++) {
            PyObject *block = PyLong_FromLongLong(t.data[t.start[row] + logical]);
            if (block == NULL || PyList_Append(blocks, block) < 0) {
                Py_XDECREF(block);
                goto done;
            }
            Py_DECREF(block);
        }
        PyObject *r = PyLong_FromLongLong(row), *c = PyLong_FromLongLong(committed[row]);
        int failed = !r || !c || PyList_Append(changed, r) < 0 || PyList_Append(before, c) < 0;
        Py_XDECREF(r);
        Py_XDECREF(c);
        if (failed) goto done;
    }
    /* raise the committed counts of the rows that changed */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t held = t.num_tokens[rows[i]], upto = block_of(bs, counts ? counts[i] : held);
        if (upto > committed[rows[i]]) committed[rows[i]] = upto;
    }
    result = PyTuple_Pack(3, changed, before, blocks);
done:
    Py_XDECREF(changed);
    Py_XDECREF(before);
    Py_XDECREF(blocks);
    give_back(&b);
    return result;
}

/* claim_keys(blocks, key_of, parent_of, committed, block_of) -> (added, dropped)
 *
 * `PrefixCache.commit`'s loop: each keyed, uncommitted block of `blocks` (a list) claims its
 * key in block_of; the first claim wins and the block is committed (added), a later block with
 * the same key loses its key (dropped: (block, key, parent)). */
PyObject *claim_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Keys k;
    PyObject *added = NULL, *dropped = NULL, *result = NULL;
    if (!expect_args("claim_keys", nargs, 5) || !get_keys(args[1], args[2], args[3], &k))
        return NULL;
    PyObject *blocks = args[0], *block_of = args[4];
    if (!PyList_CheckExact(blocks) || !PyDict_CheckExact(block_of)) {
        PyErr_SetString(PyExc_TypeError, "claim_keys: blocks a list, block_of a dict");
        return NULL;
    }
    if (!all_in_range(blocks, k.num_blocks)) return NULL;
    if (!(added = PyList_New(0)) || !(dropped = PyList_New(0))) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *item = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = PyLong_AsSsize_t(item);
        PyObject *key = PyList_GET_ITEM(k.key_of, block);
        if (key == Py_None || k.committed[block]) continue;
        PyObject *holder = PyDict_SetDefault(block_of, key, item);  /* borrowed */
        if (holder == NULL) goto done;
        if (holder == item || PyLong_AsSsize_t(holder) == block) {
            k.committed[block] = 1;
            if (PyList_Append(added, item) < 0) goto done;
        } else if (!drop_key(&k, item, block, dropped)) {  /* committed first elsewhere */
            goto done;
        }
    }
    result = PyTuple_Pack(2, added, dropped);
done:
    Py_XDECREF(added);
    Py_XDECREF(dropped);
    return result;
}
