/* Free blocks (`PhysicalBlocks`, `PrefixCache.release`, `LruList`): taking them, dropping
 * references, parking or unkeying the blocks that lost their last, linking them into the LRU. */
#include "_rows.h"

/* pop_free(free, out, ref) -> count
 *
 * Take the oldest free blocks (a deque of ids) into out, as many as both hold, each given
 * refcount 1 (free blocks have refcount 0: checked; on a bad one every block popped goes back
 * and IndexError is raised). Returns how many it took. */
PyObject *pop_free(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL, *popleft = NULL;
    Py_ssize_t n_out, n_ref, count = 0;
    if (!expect_args("pop_free", nargs, 3)) return NULL;
    int64_t *out = I64(args[1], 1, "out", &n_out);
    int64_t *ref = out ? I64(args[2], 1, "ref", &n_ref) : NULL;
    Py_ssize_t available = ref ? PyObject_Length(args[0]) : -1;
    if (available < 0 || !(popleft = PyObject_GetAttrString(args[0], "popleft"))) goto done;
    Py_ssize_t want = available < n_out ? available : n_out;
    for (; count < want; count++) {
        PyObject *item = PyObject_CallNoArgs(popleft);
        if (item == NULL) break;
        out[count] = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (out[count] == -1 && PyErr_Occurred()) break;
        if (out[count] < 0 || out[count] >= n_ref || ref[out[count]] != 0) {
            PyErr_Format(PyExc_IndexError, "free block %lld out of range or referenced",
                         (long long)out[count]);
            count++;  /* popped: goes back with the others */
            break;
        }
    }
    if (count < want) {  /* put back what was popped, in order, then raise */
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        for (Py_ssize_t i = count - 1; i >= 0; i--) {
            PyObject *back = PyObject_CallMethod(args[0], "appendleft", "L", (long long)out[i]);
            Py_XDECREF(back);
        }
        PyErr_Restore(type, value, trace);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) ref[out[i]] = 1;
    result = PyLong_FromSsize_t(count);
done:
    Py_XDECREF(popleft);
    give_back(&b);
    return result;
}

/* release_keys(blocks, key_of, parent_of, committed) -> (parked, freed, dropped)
 *
 * `PrefixCache.release`'s loop over blocks (a list) whose refcount reached 0: committed ones
 * are parked (cached), the others freed, losing their pending key if any (dropped). */
PyObject *release_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Keys k;
    PyObject *parked = NULL, *freed = NULL, *dropped = NULL, *result = NULL;
    if (!expect_args("release_keys", nargs, 4) || !get_keys(args[1], args[2], args[3], &k))
        return NULL;
    PyObject *blocks = args[0];
    if (!PyList_CheckExact(blocks)) {
        PyErr_SetString(PyExc_TypeError, "release_keys: blocks must be a list");
        return NULL;
    }
    if (!all_in_range(blocks, k.num_blocks)) return NULL;
    if (!(parked = PyList_New(0)) || !(freed = PyList_New(0)) || !(dropped = PyList_New(0)))
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *item = PyList_GET_ITEM(blocks, i);
        Py_ssize_t block = PyLong_AsSsize_t(item);
        if (k.committed[block]) {
            if (PyList_Append(parked, item) < 0) goto done;
            continue;
        }
        if (PyList_GET_ITEM(k.key_of, block) != Py_None && !drop_key(&k, item, block, dropped))
            goto done;
        if (PyList_Append(freed, item) < 0) goto done;
    }
    result = PyTuple_Pack(3, parked, freed, dropped);
done:
    Py_XDECREF(parked);
    Py_XDECREF(freed);
    Py_XDECREF(dropped);
    return result;
}

/* release_refs(table, ref) -> list
 *
 * A table's references go: each of its blocks (distinct) loses one, deepest first; returns
 * the blocks no table references any more, deepest first. */
PyObject *release_refs(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL, *unheld = NULL;
    Py_ssize_t n, n_ref;
    if (!expect_args("release_refs", nargs, 2)) return NULL;
    const int64_t *table = I64(args[0], 0, "table", &n);
    int64_t *ref = table ? I64(args[1], 1, "ref", &n_ref) : NULL;
    if (ref == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        CHECK(table[i] >= 0 && table[i] < n_ref && ref[table[i]] > 0,
              "block %lld out of range or unreferenced", (long long)table[i]);
    if (!(unheld = PyList_New(0))) goto done;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (--ref[table[i]]) continue;
        PyObject *block = PyLong_FromLongLong(table[i]);
        if (block == NULL || PyList_Append(unheld, block) < 0) {
            Py_XDECREF(block);
            goto done;
        }
        Py_DECREF(block);
    }
    result = Py_NewRef(unheld);
done:
    Py_XDECREF(unheld);
    give_back(&b);
    return result;
}

/* link_tail(prev, next, blocks) -> None
 *
 * `LruList.extend`'s loop: append blocks (a list, none of them linked, none twice) at the tail
 * of the list threaded through prev/next (int64 arrays; -1: not linked; the last index is
 * the sentinel, head and tail). Checked first: each block is marked -2 while checked, and the
 * marks are undone if one is bad. */
PyObject *link_tail(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL;
    Py_ssize_t n_prev, n_next, checked = 0;
    if (!expect_args("link_tail", nargs, 3)) return NULL;
    int64_t *prev = I64(args[0], 1, "prev", &n_prev);
    int64_t *next = prev ? I64(args[1], 1, "next", &n_next) : NULL;
    if (next == NULL) goto done;
    PyObject *blocks = args[2];
    if (!PyList_CheckExact(blocks) || n_prev != n_next || n_prev < 1) {
        PyErr_SetString(PyExc_TypeError, "link_tail: blocks a list, prev and next alike");
        goto done;
    }
    Py_ssize_t sentinel = n_prev - 1, n = PyList_GET_SIZE(blocks);
    for (; checked < n; checked++) {  /* check and mark */
        Py_ssize_t block = block_id(PyList_GET_ITEM(blocks, checked), sentinel);
        if (block < 0) break;
        if (prev[block] != -1) {
            PyErr_Format(PyExc_IndexError, "block %zd is already in the LRU", block);
            break;
        }
        prev[block] = -2;
    }
    if (checked < n) {  /* unmark what was marked: nothing changed */
        for (Py_ssize_t i = 0; i < checked; i++)
            prev[PyLong_AsSsize_t(PyList_GET_ITEM(blocks, i))] = -1;
        goto done;
    }
    int64_t last = prev[sentinel];  /* link each after the last */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t block = PyLong_AsSsize_t(PyList_GET_ITEM(blocks, i));
        next[last] = block;
        prev[block] = last;
        last = block;
    }
    next[last] = sentinel;
    prev[sentinel] = last;
    result = Py_NewRef(Py_None);
done:
    give_back(&b);
    return result;
}
