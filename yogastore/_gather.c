/* Row gather for fixed-shape columns: one call per batch, no Python per row.
 *
 * gather_rows(dst, src, starts, row_bytes) copies, for every i, the bytes
 * src[starts[i] : starts[i] + row_bytes] to dst[i * row_bytes : (i + 1) * row_bytes].
 * Every start is checked against src before anything is copied; the copy runs
 * without the GIL. All three buffers must be contiguous; starts holds int64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *gather_rows(PyObject *module, PyObject *args) {
    Py_buffer dst, src, starts;
    Py_ssize_t row;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*y*n", &dst, &src, &starts, &row)) {
        return NULL;
    }
    if (row < 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes must be >= 0, got %zd", row);
        goto done;
    }
    if (starts.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "starts must be a buffer of int64");
        goto done;
    }
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    if (row != 0 && n > dst.len / row) {
        PyErr_Format(PyExc_ValueError, "destination holds %zd bytes, %zd rows of %zd need more",
                     dst.len, n, row);
        goto done;
    }
    const int64_t *pos = (const int64_t *)starts.buf;
    const int64_t last = (int64_t)src.len - (int64_t)row;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s;
        memcpy(&s, pos + i, sizeof s);
        if (s < 0 || s > last) {
            PyErr_Format(PyExc_IndexError,
                         "row %zd starts at byte %lld, outside the %zd-byte source",
                         i, (long long)s, src.len);
            goto done;
        }
    }
    {
        char *out = (char *)dst.buf;
        const char *in = (const char *)src.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s;
            memcpy(&s, pos + i, sizeof s);
            memcpy(out + i * row, in + s, (size_t)row);
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&starts);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(dst, src, starts, row_bytes): copy rows src[starts[i]:+row_bytes] "
     "into dst, in order. Bounds are checked first; the copy releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "yogastore._gather",
    "Row gather for fixed-shape columns (see yogastore.format.FixedRows).", -1, methods,
};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module_def); }
