/* Placeholder: filled in by the change that uses it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_rows", .m_doc = NULL, .m_size = -1};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
