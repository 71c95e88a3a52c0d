/* The block pool's per-row loops (daemon/core/), compiled: what a decode step, a commit and a
 * free do for each row or block, one extension (`pagedkv.daemon.core._rows`) in one file per
 * concept. The Python side keeps every decision that is not per row (fit checks, the undo
 * journal, hashing's choice of digest) and calls one function per step:
 *
 *   _rows_tables.c  a row's table                                                (seq_table)
 *     lookup_rows  the rows of a batch's sequences, none repeated
 *     fill_row     a new sequence's table, counts and partial ids
 *     table_slots  the slots of a table's first n tokens                         (block_pool)
 *   _rows_step.c    the decode step                                               (appender)
 *     plan_step    where each row's next token lands; which rows need a new block
 *     apply_step   write the new entries, the lengths, the token ids; rows that sealed a block
 *   _rows_commit.c  commits
 *     commit_runs  which rows have full blocks to commit, and those blocks        (seq_table)
 *     claim_keys   make pending keys matchable                                 (prefix_cache)
 *   _rows_keys.c    content keys                                    (prefix_cache, content_keys)
 *     set_keys     key just-filled blocks pending
 *     chain_keys   the content keys of a prompt's full blocks
 *     seal_blocks  hash the blocks a decode step filled and key them pending
 *   _rows_free.c    free blocks                                           (physical_blocks, lru)
 *     pop_free     take the oldest free blocks
 *     release_refs a table's references dropped, deepest first
 *     release_keys blocks whose last reference went: park committed, drop pending keys
 *     link_tail    append blocks at the LRU's tail
 *   _rows_sha256.c  SHA-256 on the CPU's SHA extensions, for the keys      (content_keys)
 *     sha256       a digest, as hashlib's (where the CPU has them: SHA256_NATIVE)
 *   _rows_arrays.c  borrowing arrays and reading arguments (this header's helpers)
 *   _rows_module.c  the module table
 *
 * Arrays come in through the buffer protocol: int64 (or bool) and C-contiguous, checked here,
 * borrowed for the call only (the core reallocates its arrays when tables grow). Every index
 * read from an array is checked against the array it indexes before anything is written: an
 * inconsistent pool raises IndexError instead of writing out of bounds, and changes nothing.
 * Plain C against Python.h (no numpy headers): it builds with gcc alone. Built with hidden
 * visibility (setup.py): only PyInit__rows leaves the shared object.
 */
#ifndef PAGEDKV_ROWS_H
#define PAGEDKV_ROWS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ borrowed arrays */

/* Most buffers one call borrows (apply_step: 11). */
#define MAX_VIEWS 16

/* The buffers a call holds, released together on every exit. */
typedef struct {
    Py_buffer views[MAX_VIEWS];
    int n;
} Borrowed;

void give_back(Borrowed *b);
void *borrow(Borrowed *b, PyObject *obj, char kind, int writable, const char *name,
             Py_ssize_t *len);

/* borrow() an int64 array into the calling function's `Borrowed b`. */
#define I64(obj, writable, name, len) ((int64_t *)borrow(&b, (obj), 'q', (writable), (name), (len)))

/* An index check: `cond` false raises IndexError and leaves the call (nothing written yet). */
#define CHECK(cond, ...)                                          \
    do {                                                          \
        if (!(cond)) {                                            \
            PyErr_Format(PyExc_IndexError, __VA_ARGS__);          \
            goto done;                                            \
        }                                                         \
    } while (0)

int expect_args(const char *fn, Py_ssize_t nargs, Py_ssize_t want);
int get_size(PyObject *obj, Py_ssize_t least, const char *name, Py_ssize_t *out);

/* A block size, with its log2 when it is a power of two: a row's block and offset are then a
 * shift and a mask. A 64-bit division costs ~15 cycles, and a step divides once per row in
 * each of its loops. */
typedef struct {
    int64_t size;
    int shift;  /* log2(size), or -1 */
} BlockSize;

int get_block_size(PyObject *obj, BlockSize *b);

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

int borrow_tables(Borrowed *bp, PyObject *const *args, int writable, Tables *t);

/* Position in `data` of entry `logical` of `row`, or -1 where it lies outside. */
static inline Py_ssize_t entry_at(const Tables *t, int64_t row, int64_t logical) {
    int64_t pos = t->start[row] + logical;
    return logical >= 0 && pos >= 0 && pos < t->num_entries ? (Py_ssize_t)pos : -1;
}

/* ------------------------------------------------------------------ key lists (_rows_keys.c) */

/* The key lists and committed flags of `PrefixCache`, checked to cover the same blocks. */
typedef struct {
    PyObject *key_of, *parent_of;  /* lists: block -> key / parent key, or None */
    char *committed;               /* bytearray: block -> 1 while its key is committed */
    Py_ssize_t num_blocks;
} Keys;

int get_keys(PyObject *key_of, PyObject *parent_of, PyObject *committed, Keys *k);
Py_ssize_t block_id(PyObject *item, Py_ssize_t num_blocks);
int all_in_range(PyObject *blocks, Py_ssize_t num_blocks);
int drop_key(Keys *k, PyObject *item, Py_ssize_t block, PyObject *dropped);

/* ------------------------------------------------------------------ SHA-256 (_rows_sha256.c) */

/* A SHA-256 in progress: the state, the pending partial block, the bytes hashed so far. */
typedef struct {
    uint32_t state[8];
    uint8_t pending[64];
    size_t used;     /* bytes of `pending` filled */
    uint64_t bytes;  /* bytes given so far */
} Sha256;

int sha256_native(void);  /* only then may the others run */
void sha256_init(Sha256 *s);
void sha256_update(Sha256 *s, const void *data, size_t n);
void sha256_final(Sha256 *s, uint8_t out[32]);

/* ------------------------------------------------------------------ the module's functions */

#define ROWS_FUNCTION(name) \
    PyObject *name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
ROWS_FUNCTION(lookup_rows);
ROWS_FUNCTION(pop_free);
ROWS_FUNCTION(fill_row);
ROWS_FUNCTION(plan_step);
ROWS_FUNCTION(apply_step);
ROWS_FUNCTION(commit_runs);
ROWS_FUNCTION(claim_keys);
ROWS_FUNCTION(set_keys);
ROWS_FUNCTION(chain_keys);
ROWS_FUNCTION(seal_blocks);
ROWS_FUNCTION(release_keys);
ROWS_FUNCTION(release_refs);
ROWS_FUNCTION(link_tail);
ROWS_FUNCTION(table_slots);
ROWS_FUNCTION(sha256);

#endif
