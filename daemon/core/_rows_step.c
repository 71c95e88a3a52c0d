/* The decode step, one token per row (`Appender`): the plan, which changes nothing, then
 * the apply. */
#include "_rows.h"

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
PyObject *plan_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
PyObject *apply_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
