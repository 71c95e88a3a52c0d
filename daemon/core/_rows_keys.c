/* Content keys (`PrefixCache`, `ContentKeys`): the key lists' helpers, keying blocks
 * pending, and hashing chains of blocks. */
#include "_rows.h"

/* A block id from a list item, checked against the pool's `num_blocks`; -1 with an error. */
Py_ssize_t block_id(PyObject *item, Py_ssize_t num_blocks) {
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
int all_in_range(PyObject *blocks, Py_ssize_t num_blocks) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++)
        if (block_id(PyList_GET_ITEM(blocks, i), num_blocks) < 0) return 0;
    return 1;
}

int get_keys(PyObject *key_of, PyObject *parent_of, PyObject *committed, Keys *k) {
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
int drop_key(Keys *k, PyObject *item, Py_ssize_t block, PyObject *dropped) {
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

/* set_keys(blocks, keys, parents, tokens, key_of, parent_of, committed, tokens_of) -> None
 *
 * `PrefixCache.key_blocks`'s loop: block blocks[i] (an int64 array) gets key keys[i], parent
 * parents[i] and ids tokens[i] (tokens: [n, block_size], into tokens_of: [blocks,
 * block_size]). Every block must be unkeyed (checked before any is keyed). */
PyObject *set_keys(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
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
 * little-endian on the machines pagedkv runs on); `parent` is bytes. When `digest` is this
 * module's sha256 it runs here on the two pieces: no input bytes, no call through Python. A
 * new reference. */
static PyObject *link_key(PyObject *digest, PyObject *parent, const int64_t *ids,
                          Py_ssize_t bs) {
    Py_ssize_t plen = PyBytes_GET_SIZE(parent), width = bs * (Py_ssize_t)sizeof(int64_t);
    if (PyCFunction_Check(digest) && sha256_native() &&
        PyCFunction_GET_FUNCTION(digest) == (PyCFunction)(void (*)(void))sha256) {
        Sha256 s;
        uint8_t out[32];
        sha256_init(&s);
        sha256_update(&s, PyBytes_AS_STRING(parent), (size_t)plen);
        sha256_update(&s, ids, (size_t)width);
        sha256_final(&s, out);
        return PyBytes_FromStringAndSize((const char *)out, 32);
    }
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
PyObject *chain_keys(PyObject *Py_UNUSED(self), PyObject *const *args,
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
PyObject *seal_blocks(PyObject *Py_UNUSED(self), PyObject *const *args,
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
