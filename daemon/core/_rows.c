/* The block pool's per-row loops (daemon/core/), compiled: what a decode step, a commit and a
 * free do for each row or block. The Python side keeps every decision that is not per row
 * (fit checks, taking blocks, the undo journal, hashing) and calls one function per step:
 *
 *   lookup_rows  the rows of a batch's sequences, none repeated                    (seq_table)
 *   pop_free     take the oldest free blocks                                (physical_blocks)
 *   fill_row     a new sequence's table, counts and partial ids                (seq_table)
 *   plan_step    where each row's next token lands; which rows need a new block   (appender)
 *   apply_step   write the new entries, the lengths, the token ids; rows that sealed a block
 *   commit_runs  which rows have full blocks to commit, and those blocks          (seq_table)
 *   claim_keys   make pending keys matchable                                    (prefix_cache)
 *   set_keys     key just-filled blocks pending
 *   chain_keys   the content keys of a prompt's full blocks                    (content_keys)
 *   seal_blocks  hash the blocks a decode step filled and key them pending
 *   release_keys blocks whose last reference went: park committed, drop pending keys
 *   release_refs a table's references dropped, deepest first                (physical_blocks)
 *   link_tail    append blocks at the LRU's tail                                         (lru)
 *   table_slots  the slots of a table's first n tokens                            (block_pool)
 *
 * Arrays come in through the buffer protocol: int64 (or bool) and C-contiguous, checked here,
 * borrowed for the call only (the core reallocates its arrays when tables grow). Every index
 * read from an array is checked against the array it indexes before anything is written: an
 * inconsistent pool raises IndexError instead of writing out of bounds, and changes nothing.
 * Plain C against Python.h (no numpy headers): it builds with gcc alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ------------------------------------------------------------------ borrowed arrays */

/* Most buffers one call borrows (apply_step: 11). */
#define MAX_VIEWS 16

/* The buffers a call holds, released together on every exit. */
typedef struct {
    Py_buffer views[MAX_VIEWS];
    int n;
} Borrowed;

static void give_back(Borrowed *b) {
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
static void *borrow(Borrowed *b, PyObject *obj, char kind, int writable, const char *name,
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

#define I64(obj, writable, name, len) ((int64_t *)borrow(&b, (obj), 'q', (writable), (name), (len)))

/* An index check: `cond` false raises IndexError and leaves the call (nothing written yet). */
#define CHECK(cond, ...)                                          \
    do {                                                          \
        if (!(cond)) {                                            \
            PyErr_Format(PyExc_IndexError, __VA_ARGS__);          \
            goto done;                                            \
        }                                                         \
    } while (0)

static int expect_args(const char *fn, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs == want) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
    return 0;
}

/* A block size, a count or a sentinel: an int >= `least`. */
static int get_size(PyObject *obj, Py_ssize_t least, const char *name, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) return 0;
    if (*out < least) {
        PyErr_Format(PyExc_ValueError, "%s must be >= %zd, got %zd", name, least, *out);
        return 0;
    }
    return 1;
}

/* A block size, with its log2 when it is a power of two: a row's block and offset are then a
 * shift and a mask. A 64-bit division costs ~15 cycles, and a step divides once per row in
 * each of its loops. */
typedef struct {
    int64_t size;
    int shift;  /* log2(size), or -1 */
} BlockSize;

static int get_block_size(PyObject *obj, BlockSize *b) {
    Py_ssize_t size;
    if (!get_size(obj, 1, "block_size", &size)) return 0;
    b->size = size;
    b->shift = (size & (size - 1)) == 0 ? __builtin_ctzll((unsigned long long)size) : -1;
    return 1;
}

/* x / size and x % size, for x >= 0. */
static inline int64_t block_of(BlockSize b, int64_t x) {
    return b.shift >= 0 ? x >> b.shift : x / b.size;
}
static inline int64_t offset_of(BlockSize b, int64_t x) {
    return b.shift >= 0 ? x & (b.size - 1) : x % b.size;
}

/* The row arrays and the table store of `SeqTable`, borrowed together (arguments
 * num_tokens, num_blocks, start, capacity, data, in that order). */
typedef struct {
    int64_t *num_tokens, *num_blocks, *start, *capacity, *data;
    Py_ssize_t num_rows, num_entries;  /* rows of the row arrays; entries of data */
} Tables;

static int borrow_tables(Borrowed *bp, PyObject *const *args, int writable, Tables *t) {
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

/* Position in `data` of entry `logical` of `row`, or -1 where it lies outside. */
static Py_ssize_t entry_at(const Tables *t, int64_t row, int64_t logical) {
    int64_t pos = t->start[row] + logical;
    return logical >= 0 && pos >= 0 && pos < t->num_entries ? (Py_ssize_t)pos : -1;
}

/* ------------------------------------------------------------------ rows */

/* lookup_rows(row_of, seqs, out) -> looked up
 *
 * The rows of `seqs` (a list or tuple) in `row_of` (a dict: sequence -> row), into out[:n].
 * Returns len(seqs) when every sequence is found and none repeats, else the index of the first
 * sequence that is missing or repeated (the caller names it). */
static PyObject *lookup_rows(PyObject *Py_UNUSED(self), PyObject *const *args,
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

/* ------------------------------------------------------------------ free blocks */

/* pop_free(free, out, ref) -> count
 *
 * Take the oldest free blocks (a deque of ids) into out, as many as both hold, each given
 * refcount 1 (free blocks have refcount 0: checked; on a bad one every block popped goes back
 * and IndexError is raised). Returns how many it took. */
static PyObject *pop_free(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* fill_row(row, table, tokens, committed, tail, region, region_size, num_tokens, num_blocks,
 *          start, capacity, data, committed_counts, partial) -> None
 *
 * A new sequence's row (`BlockPool.allocate`), which has no region yet: the region of
 * region_size entries at `region` (taken by the caller; 0, 0 for none), its table there (an
 * int64 array of ceil(tokens / block_size) blocks), its token count, its committed blocks, and
 * the ids of its partial last block (tail: tokens % block_size of them, or None when
 * unknown). */
static PyObject *fill_row(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------ decode step */

/* plan_step(rows, num_tokens, num_blocks, start, capacity, data, ref, block_size,
 *           written, grow, logical) -> (grows, shorts, firsts) | None
 *
 * Where the next token of each row (rows: [n]) lands, changing no pool state. A row whose
 * last block has room writes there; a row at a block's edge writes into its reserved next
 * entry when its table has one, else needs a new block: its index goes to grow[:grows] and
 * its new entry's logical index to logical[:grows]. written[i] gets the block row i writes
 * into (-1 for a new block). shorts: growing rows whose table region is full (the caller
 * moves them first); firsts: growing rows that were empty. With `ref` given (shared partial
 * blocks exist), None when a row's last block has room but is shared: the row needs a copy,
 * which the general append makes. */
static PyObject *plan_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL;
    Tables t;
    Py_ssize_t n, n_ref = 0, n_written, n_grow, n_logical;
    BlockSize bs;
    if (!expect_args("plan_step", nargs, 11)) return NULL;
    const int64_t *rows = I64(args[0], 0, "rows", &n);
    if (rows == NULL || !borrow_tables(&b, args + 1, 0, &t)) goto done;
    const int64_t *ref = args[6] == Py_None ? NULL : I64(args[6], 0, "ref", &n_ref);
    if ((args[6] != Py_None && ref == NULL) || !get_block_size(args[7], &bs))
        goto done;
    int64_t *written = I64(args[8], 1, "written", &n_written);
    int64_t *grow = written ? I64(args[9], 1, "grow", &n_grow) : NULL;
    int64_t *logical = grow ? I64(args[10], 1, "logical", &n_logical) : NULL;
    if (logical == NULL) goto done;
    CHECK(n_written >= n && n_grow >= n && n_logical >= n, "output arrays shorter than rows");

    Py_ssize_t grows = 0, shorts = 0, firsts = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        CHECK(row >= 0 && row < t.num_rows, "row %lld out of range", (long long)row);
        int64_t old = t.num_tokens[row], next = block_of(bs, old);
        CHECK(old >= 0, "row %lld holds %lld tokens", (long long)row, (long long)old);
        int64_t offset = offset_of(bs, old);
        if (offset == 0 && t.num_blocks[row] <= next) {  /* at a block's edge: a new block */
            written[i] = -1;
            grow[grows] = i;
            logical[grows++] = next;
            shorts += next >= t.capacity[row];
            firsts += next == 0;
            continue;
        }
        /* its last block has room, or its next entry is reserved */
        Py_ssize_t pos = entry_at(&t, row, offset == 0 ? next : block_of(bs, old - 1));
        CHECK(pos >= 0, "row %lld: table entry outside the store", (long long)row);
        written[i] = t.data[pos];
        if (ref != NULL && offset != 0) {
            CHECK(written[i] >= 0 && written[i] < n_ref, "block %lld out of range",
                  (long long)written[i]);
            if (ref[written[i]] > 1) {  /* a shared partial block: copy-on-write */
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
    }
    result = Py_BuildValue("(nnn)", grows, shorts, firsts);
done:
    give_back(&b);
    return result;
}

/* apply_step(rows, written, grow, taken, tokens, num_tokens, num_blocks, start, capacity,
 *            data, partial, chain_ok, block_size, keep_ids, slots, new_tokens, sealed)
 *   -> sealed count
 *
 * The decode step as `plan_step` planned it, one token per row: growing row grow[j] gets
 * block taken[j] as its next entry (its region has room: the caller moved it); every row's
 * token count goes up by one; slots[i] = block * block_size + offset and new_tokens[i] = the
 * new count. Token ids (tokens: [n], or None): None breaks the rows' chains (chain_ok = 0);
 * with keep_ids, each id goes into its row's partial block, and rows whose chain is whole and
 * whose block the token filled go to sealed[:count] (the caller keys those blocks). */
static PyObject *apply_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL;
    Tables t;
    Py_ssize_t n, n_written, n_grow, n_taken, n_tokens = 0, n_partial, n_ok, n_slots, n_new,
        n_sealed;
    BlockSize bs;
    if (!expect_args("apply_step", nargs, 17)) return NULL;
    const int64_t *rows = I64(args[0], 0, "rows", &n);
    int64_t *written = rows ? I64(args[1], 1, "written", &n_written) : NULL;
    const int64_t *grow = written ? I64(args[2], 0, "grow", &n_grow) : NULL;
    const int64_t *taken = grow ? I64(args[3], 0, "taken", &n_taken) : NULL;
    if (taken == NULL) goto done;
    const int64_t *tokens = args[4] == Py_None ? NULL : I64(args[4], 0, "tokens", &n_tokens);
    if ((args[4] != Py_None && tokens == NULL) || !borrow_tables(&b, args + 5, 1, &t))
        goto done;
    int64_t *partial = I64(args[10], 1, "partial", &n_partial);
    uint8_t *chain_ok = partial ? borrow(&b, args[11], '?', 1, "chain_ok", &n_ok) : NULL;
    if (chain_ok == NULL || !get_block_size(args[12], &bs)) goto done;
    int keep_ids = PyObject_IsTrue(args[13]);
    int64_t *slots = keep_ids >= 0 ? I64(args[14], 1, "slots", &n_slots) : NULL;
    int64_t *new_tokens = slots ? I64(args[15], 1, "new_tokens", &n_new) : NULL;
    int64_t *sealed = new_tokens ? I64(args[16], 1, "sealed", &n_sealed) : NULL;
    if (sealed == NULL) goto done;

    /* check every index first: nothing is written unless all are in range */
    CHECK(n_written >= n && n_slots >= n && n_new >= n && n_sealed >= n,
          "output arrays shorter than rows");
    CHECK(n_taken == n_grow && n_grow <= n, "%zd blocks taken for %zd growing rows", n_taken,
          n_grow);
    CHECK(tokens == NULL || n_tokens == n, "%zd token ids for %zd rows", n_tokens, n);
    CHECK(n_partial == t.num_rows * bs.size && n_ok == t.num_rows,
          "partial/chain_ok rows differ");
    for (Py_ssize_t i = 0; i < n; i++)
        CHECK(rows[i] >= 0 && rows[i] < t.num_rows && t.num_tokens[rows[i]] >= 0,
              "row %lld out of range", (long long)rows[i]);
    for (Py_ssize_t j = 0; j < n_grow; j++) {
        CHECK(grow[j] >= 0 && grow[j] < n, "grow index %lld out of range", (long long)grow[j]);
        int64_t row = rows[grow[j]], next = block_of(bs, t.num_tokens[row]);
        CHECK(next < t.capacity[row] && entry_at(&t, row, next) >= 0,
              "row %lld: no room for entry %lld", (long long)row, (long long)next);
    }

    /* the new entries: each growing row's next logical block */
    for (Py_ssize_t j = 0; j < n_grow; j++) {
        Py_ssize_t i = grow[j];
        int64_t row = rows[i], next = block_of(bs, t.num_tokens[row]);
        t.data[t.start[row] + next] = written[i] = taken[j];
        t.num_blocks[row] = next + 1;
    }
    /* one token each: its slot, the new count, its id in the partial block */
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i], old = t.num_tokens[row], offset = offset_of(bs, old);
        slots[i] = written[i] * bs.size + offset;
        new_tokens[i] = t.num_tokens[row] = old + 1;
        if (tokens == NULL) {
            chain_ok[row] = 0;
        } else if (keep_ids) {
            partial[row * bs.size + offset] = tokens[i];
            if (offset == bs.size - 1 && chain_ok[row]) sealed[count++] = i;
        }
    }
    result = PyLong_FromSsize_t(count);
done:
    give_back(&b);
    return result;
}

/* ------------------------------------------------------------------ commits */

/* commit_runs(rows, counts, num_tokens, num_blocks, start, capacity, data, committed,
 *             block_size) -> (rows, committed before, blocks) as lists
 *
 * Row rows[i] commits its first counts[i] tokens (counts None: all it holds); the full blocks
 * among them past its committed ones are listed in order, rows in order, and its committed
 * count is raised. Returns the rows that changed with their old counts (the undo) and the
 * blocks. */
static PyObject *commit_runs(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------ keys */

/* A block id from a list item, checked against the pool's `num_blocks`; -1 with an error. */
static Py_ssize_t block_id(PyObject *item, Py_ssize_t num_blocks) {
    Py_ssize_t block = PyLong_AsSsize_t(item);
    if (block == -1 && PyErr_Occurred()) return -1;
    if (block < 0 || block >= num_blocks) {
        PyErr_Format(PyExc_IndexError, "block %zd out of range", block);
        return -1;
    }
    return block;
}

/* Whether every item of the list `blocks` is a block id below num_blocks (checked before a
 * loop changes anything); 0 with an error otherwise. */
static int all_in_range(PyObject *blocks, Py_ssize_t num_blocks) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++)
        if (block_id(PyList_GET_ITEM(blocks, i), num_blocks) < 0) return 0;
    return 1;
}

/* The key lists and committed flags of `PrefixCache`, checked to cover the same blocks. */
typedef struct {
    PyObject *key_of, *parent_of;  /* lists: block -> key / parent key, or None */
    char *committed;               /* bytearray: block -> 1 while its key is committed */
    Py_ssize_t num_blocks;
} Keys;

static int get_keys(PyObject *key_of, PyObject *parent_of, PyObject *committed, Keys *k) {
    if (!PyList_CheckExact(key_of) || !PyList_CheckExact(parent_of) ||
        !PyByteArray_CheckExact(committed)) {
        PyErr_SetString(PyExc_TypeError, "key_of, parent_of: lists; committed: a bytearray");
        return 0;
    }
    k->num_blocks = PyList_GET_SIZE(key_of);
    if (PyList_GET_SIZE(parent_of) != k->num_blocks ||
        PyByteArray_GET_SIZE(committed) != k->num_blocks) {
        PyErr_SetString(PyExc_ValueError, "key_of, parent_of and committed differ in length");
        return 0;
    }
    k->key_of = key_of;
    k->parent_of = parent_of;
    k->committed = PyByteArray_AS_STRING(committed);
    return 1;
}

/* Drop block's key and parent (a pending key), appending (block, key, parent) to `dropped`. */
static int drop_key(Keys *k, PyObject *item, Py_ssize_t block, PyObject *dropped) {
    PyObject *key = PyList_GET_ITEM(k->key_of, block);
    PyObject *parent = PyList_GET_ITEM(k->parent_of, block);
    PyObject *entry = PyTuple_Pack(3, item, key, parent);
    if (entry == NULL || PyList_Append(dropped, entry) < 0) {
        Py_XDECREF(entry);
        return 0;
    }
    Py_DECREF(entry);
    PyList_SetItem(k->key_of, block, Py_NewRef(Py_None));
    PyList_SetItem(k->parent_of, block, Py_NewRef(Py_None));
    return 1;
}

/* claim_keys(blocks, key_of, parent_of, committed, block_of) -> (added, dropped)
 *
 * `PrefixCache.commit`'s loop: each keyed, uncommitted block of `blocks` (a list) claims its
 * key in block_of; the first claim wins and the block is committed (added), a later block with
 * the same key loses its key (dropped: (block, key, parent)). */
static PyObject *claim_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* set_keys(blocks, keys, parents, tokens, key_of, parent_of, committed, tokens_of) -> None
 *
 * `PrefixCache.key_blocks`'s loop: block blocks[i] (an int64 array) gets key keys[i], parent
 * parents[i] and ids tokens[i] (tokens: [n, block_size], into tokens_of: [blocks,
 * block_size]). Every block must be unkeyed (checked before any is keyed). */
static PyObject *set_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    Keys k;
    PyObject *result = NULL;
    Py_ssize_t n, n_tokens, n_tokens_of;
    if (!expect_args("set_keys", nargs, 8) || !get_keys(args[4], args[5], args[6], &k))
        return NULL;
    const int64_t *blocks = I64(args[0], 0, "blocks", &n);
    const int64_t *tokens = blocks ? I64(args[3], 0, "tokens", &n_tokens) : NULL;
    int64_t *tokens_of = tokens ? I64(args[7], 1, "tokens_of", &n_tokens_of) : NULL;
    if (tokens_of == NULL) goto done;
    PyObject *keys = args[1], *parents = args[2];
    if (!PyList_CheckExact(keys) || !PyList_CheckExact(parents) ||
        PyList_GET_SIZE(keys) != n || PyList_GET_SIZE(parents) != n) {
        PyErr_Format(PyExc_ValueError, "set_keys: %zd blocks need lists of %zd keys and parents",
                     n, n);
        goto done;
    }
    Py_ssize_t bs = n_tokens_of / k.num_blocks;
    CHECK(n_tokens_of == k.num_blocks * bs && n_tokens == n * bs, "set_keys: shapes disagree");
    for (Py_ssize_t i = 0; i < n; i++) {
        CHECK(blocks[i] >= 0 && blocks[i] < k.num_blocks, "block %lld out of range",
              (long long)blocks[i]);
        CHECK(PyList_GET_ITEM(k.key_of, blocks[i]) == Py_None, "block %lld already has a key",
              (long long)blocks[i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SetItem(k.key_of, blocks[i], Py_NewRef(PyList_GET_ITEM(keys, i)));
        PyList_SetItem(k.parent_of, blocks[i], Py_NewRef(PyList_GET_ITEM(parents, i)));
        memcpy(tokens_of + blocks[i] * bs, tokens + i * bs, bs * sizeof(int64_t));
    }
    result = Py_NewRef(Py_None);
done:
    give_back(&b);
    return result;
}

/* The content key of a block: digest(parent || ids), the ids as native int64 (`ContentKeys`:
 * little-endian on the machines pagedkv runs on); `parent` is bytes. A new reference. */
static PyObject *link_key(PyObject *digest, PyObject *parent, const int64_t *ids,
                          Py_ssize_t bs) {
    Py_ssize_t plen = PyBytes_GET_SIZE(parent), width = bs * (Py_ssize_t)sizeof(int64_t);
    PyObject *data = PyBytes_FromStringAndSize(NULL, plen + width);
    if (data == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(data), PyBytes_AS_STRING(parent), plen);
    memcpy(PyBytes_AS_STRING(data) + plen, ids, width);
    PyObject *key = PyObject_CallOneArg(digest, data);
    Py_DECREF(data);
    if (key != NULL && !PyBytes_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "the digest must return bytes");
        Py_CLEAR(key);
    }
    return key;
}

/* chain_keys(parent, tokens, block_size, digest) -> list
 *
 * `ContentKeys.chain`: the keys of consecutive full blocks (tokens: [n, block_size]) after
 * the block keyed `parent`, each block's parent the key before it. */
static PyObject *chain_keys(PyObject *Py_UNUSED(self), PyObject *const *args,
                            Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    PyObject *result = NULL, *keys = NULL;
    Py_ssize_t n_tokens, bs;
    if (!expect_args("chain_keys", nargs, 4)) return NULL;
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "chain_keys: parent must be bytes");
        return NULL;
    }
    const int64_t *tokens = I64(args[1], 0, "tokens", &n_tokens);
    if (tokens == NULL || !get_size(args[2], 1, "block_size", &bs)) goto done;
    CHECK(n_tokens % bs == 0, "%zd token ids are not whole blocks of %zd", n_tokens, bs);
    if (!(keys = PyList_New(n_tokens / bs))) goto done;
    PyObject *parent = args[0];  /* borrowed: args[0], then the list's */
    for (Py_ssize_t i = 0; i < n_tokens / bs; i++) {
        PyObject *key = link_key(args[3], parent, tokens + i * bs, bs);
        if (key == NULL) goto done;
        PyList_SET_ITEM(keys, i, key);
        parent = key;
    }
    result = Py_NewRef(keys);
done:
    Py_XDECREF(keys);
    give_back(&b);
    return result;
}

/* seal_blocks(rows, blocks, partial, chain_key, digest, key_of, parent_of, committed,
 *             tokens_of) -> None
 *
 * Row rows[i] just filled blocks[i] (an int64 array each): its token ids are partial[row]
 * ([rows, block_size]) and its parent key chain_key[row] (a list of bytes). The block's key
 * is digest(parent || ids) (the Python hash, called here); the block is keyed pending with it
 * (key_of, parent_of), its ids copied to tokens_of[block] ([blocks, block_size]), and the key
 * becomes the row's chain key. Every key is computed before anything changes. */
static PyObject *seal_blocks(PyObject *Py_UNUSED(self), PyObject *const *args,
                             Py_ssize_t nargs) {
    Borrowed b = {.n = 0};
    Keys k;
    PyObject *result = NULL, *keys = NULL;
    Py_ssize_t n, n_blocks, n_partial, n_tokens_of;
    if (!expect_args("seal_blocks", nargs, 9) || !get_keys(args[5], args[6], args[7], &k))
        return NULL;
    PyObject *chain_key = args[3], *digest = args[4];
    if (!PyList_CheckExact(chain_key)) {
        PyErr_SetString(PyExc_TypeError, "seal_blocks: chain_key must be a list");
        return NULL;
    }
    const int64_t *rows = I64(args[0], 0, "rows", &n);
    const int64_t *blocks = rows ? I64(args[1], 0, "blocks", &n_blocks) : NULL;
    const int64_t *partial = blocks ? I64(args[2], 0, "partial", &n_partial) : NULL;
    int64_t *tokens_of = partial ? I64(args[8], 1, "tokens_of", &n_tokens_of) : NULL;
    if (tokens_of == NULL) goto done;
    Py_ssize_t num_rows = PyList_GET_SIZE(chain_key);
    Py_ssize_t bs = num_rows ? n_partial / num_rows : 0;
    CHECK(n_blocks == n && bs > 0 && n_partial == num_rows * bs &&
          n_tokens_of == k.num_blocks * bs, "seal_blocks: shapes disagree");
    for (Py_ssize_t i = 0; i < n; i++) {
        CHECK(rows[i] >= 0 && rows[i] < num_rows, "row %lld out of range", (long long)rows[i]);
        CHECK(blocks[i] >= 0 && blocks[i] < k.num_blocks &&
              PyList_GET_ITEM(k.key_of, blocks[i]) == Py_None,
              "block %lld out of range or already keyed", (long long)blocks[i]);
        CHECK(PyBytes_CheckExact(PyList_GET_ITEM(chain_key, rows[i])),
              "row %lld: chain key is not bytes", (long long)rows[i]);
    }
    /* hash: key = digest(parent || ids), every key before any change */
    if (!(keys = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = link_key(digest, PyList_GET_ITEM(chain_key, rows[i]),
                                 partial + rows[i] * bs, bs);
        if (key == NULL) goto done;
        PyList_SET_ITEM(keys, i, key);
    }
    /* key each block pending, copy its ids, move each row's chain on */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        PyObject *parent = PyList_GET_ITEM(chain_key, rows[i]);
        PyList_SetItem(k.parent_of, blocks[i], Py_NewRef(parent));
        PyList_SetItem(k.key_of, blocks[i], Py_NewRef(key));
        memcpy(tokens_of + blocks[i] * bs, partial + rows[i] * bs, bs * sizeof(int64_t));
        PyList_SetItem(chain_key, rows[i], Py_NewRef(key));
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(keys);
    give_back(&b);
    return result;
}

/* release_keys(blocks, key_of, parent_of, committed) -> (parked, freed, dropped)
 *
 * `PrefixCache.release`'s loop over blocks (a list) whose refcount reached 0: committed ones
 * are parked (cached), the others freed, losing their pending key if any (dropped). */
static PyObject *release_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------ blocks */

/* release_refs(table, ref) -> list
 *
 * A table's references go: each of its blocks (distinct) loses one, deepest first; returns
 * the blocks no table references any more, deepest first. */
static PyObject *release_refs(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *link_tail(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* table_slots(table, num_tokens, block_size) -> list
 *
 * The slots of a table's first num_tokens tokens: block * block_size + offset, in order. */
static PyObject *table_slots(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"lookup_rows", (PyCFunction)(void (*)(void))lookup_rows, METH_FASTCALL, NULL},
    {"pop_free", (PyCFunction)(void (*)(void))pop_free, METH_FASTCALL, NULL},
    {"fill_row", (PyCFunction)(void (*)(void))fill_row, METH_FASTCALL, NULL},
    {"plan_step", (PyCFunction)(void (*)(void))plan_step, METH_FASTCALL, NULL},
    {"apply_step", (PyCFunction)(void (*)(void))apply_step, METH_FASTCALL, NULL},
    {"commit_runs", (PyCFunction)(void (*)(void))commit_runs, METH_FASTCALL, NULL},
    {"claim_keys", (PyCFunction)(void (*)(void))claim_keys, METH_FASTCALL, NULL},
    {"set_keys", (PyCFunction)(void (*)(void))set_keys, METH_FASTCALL, NULL},
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL, NULL},
    {"seal_blocks", (PyCFunction)(void (*)(void))seal_blocks, METH_FASTCALL, NULL},
    {"release_keys", (PyCFunction)(void (*)(void))release_keys, METH_FASTCALL, NULL},
    {"release_refs", (PyCFunction)(void (*)(void))release_refs, METH_FASTCALL, NULL},
    {"link_tail", (PyCFunction)(void (*)(void))link_tail, METH_FASTCALL, NULL},
    {"table_slots", (PyCFunction)(void (*)(void))table_slots, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rows",
    .m_doc = "The block pool's per-row loops, compiled (see _rows.c).", .m_size = -1,
    .m_methods = methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
