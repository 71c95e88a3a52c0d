/* The module `pagedkv.daemon.core._rows`: its function table (each function in its concept's
 * file, see _rows.h). */
#include "_rows.h"

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
    {"sha256", (PyCFunction)(void (*)(void))sha256, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rows",
    .m_doc = "The block pool's per-row loops, compiled (see _rows.h).", .m_size = -1,
    .m_methods = methods};

/* The module, with SHA256_NATIVE: whether `sha256` runs on this CPU. */
PyMODINIT_FUNC PyInit__rows(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL &&
        PyModule_AddObjectRef(m, "SHA256_NATIVE", sha256_native() ? Py_True : Py_False) < 0)
        Py_CLEAR(m);
    return m;
}
