/* Compiled inner loops of the read path: one call per batch, no Python per row.
 *
 * gather_rows(dst, src, starts, row_bytes) copies, for every i, the bytes
 * src[starts[i] : starts[i] + row_bytes] to dst[i * row_bytes : (i + 1) * row_bytes].
 * Every start is checked against src before anything is copied, and again on
 * the read the copy uses; the copy runs without the GIL. All three buffers
 * must be contiguous; starts holds int64.
 *
 * gather_rows_at(dst, src, addresses, chunks, local, lowest, row_bytes[, stride])
 * does the same for the rows local[i] of chunks chunks[i]: row j of chunk c
 * starts at byte addresses[c] - lowest + j * stride of src (stride: row_bytes
 * unless given; 8 with rows of 16 reads offset pairs). The starts are
 * computed, checked and used in one loop without the GIL (no index arrays in
 * between). An address of 0 marks a chunk never added (RuntimeError); a bad
 * chunk, record or start raises IndexError. Rows are checked and copied a
 * block at a time, so rows before a bad one may have been copied already.
 *
 * gather_ranges(dst, src, starts, lengths) appends, for every i, the bytes
 * src[starts[i] : starts[i] + lengths[i]] to dst (variable-length records:
 * strings, ragged values) and returns the bytes written. Each (start, length)
 * is checked on the read the copy uses, without the GIL.
 *
 * ranges_at(starts, lengths, offsets, src, pairs, rows, limits, data, chunks,
 * local, lowest, item) locates variable-length records in one loop: the offset
 * pair of record local[i] of chunk chunks[i] (at pairs[c] - lowest +
 * local[i] * 8, local[i] < rows[c]) must satisfy 0 <= a <= b <= limits[c]; it
 * gives the range [data[c] - lowest + a * item, + (b - a) * item) of src
 * (starts, lengths) and the running count of values (offsets). Returns
 * (total bytes, first record whose offsets are out of bounds or -1); any other
 * bad chunk, record or range raises as gather_rows_at does.
 *
 * split_bytes(data, offsets) returns the list of bytes objects
 * data[offsets[i] : offsets[i + 1]] (strings as Python objects, when asked for).
 *
 * blocks_verified(chunks, starts, ends, base, size, slot, bits) returns whether
 * every checksum block holding a byte of the ranges [starts[i], ends[i]) of
 * chunks[i] has its bit set: block j of chunk c (bytes base[c] + j * size[c]
 * onwards) is bit slot[c] + j of bits (LSB first). Empty ranges hold no block.
 * Any index out of range answers False (the numpy path then decides, and
 * raises); yogastore.read.verified.verify_blocks is its definition.
 *
 * hash_blocks(out, views, which, starts, ends) writes, for every i, the XXH3-64
 * digest of views[which[i]][starts[i]:ends[i]] to out[i] (uint64): the checksum
 * blocks a batch reads, hashed in one call. Every range is checked against its
 * view before any is hashed; the hashing runs without the GIL. The digest is
 * xxhash's own (third_party/xxhash, the library python-xxhash wraps), so it equals
 * xxhash.xxh3_64_intdigest of the same bytes.
 *
 * join_into(dst, pieces) copies the buffers of pieces one after another to the
 * start of dst and returns the bytes written (a chunk laid out by the cache
 * build). Their total is checked against dst first; the copy runs without the
 * GIL, so the build's next records are read meanwhile.
 *
 * feistel(out, values, keys, high_bits, low_bits, wide, n) evaluates the keyed
 * permutation of yogastore.read.order.FeistelPermutation (same rounds, same words,
 * same cycle walking) on int64 values in [0, n), writing int64 images to out.
 *
 * gather_rows, gather_ranges, ranges_at and hash_blocks read memory maps of store files. A
 * file cut short under a map turns a read of its lost pages into SIGBUS, which
 * would kill the process; while these loops run, a SIGBUS in their thread ends
 * the loop instead and the call raises MappedFault (an OSError), so the caller
 * can name the file. Any other SIGBUS goes to the handler installed before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

/* gather_rows reads rows in random order (small rows: offsets, labels): the
 * start of the row PREFETCH_AHEAD places on is requested while the current one
 * is copied, so several cache misses are outstanding at once (random 16-byte
 * rows of a 200 MB map: about 2.5x faster). Prefetching never faults; it is
 * only issued for starts inside the source. gather_ranges requests the first
 * two cache lines of the range RANGE_PREFETCH_AHEAD places on (random strings
 * of 50-500 bytes of a 1.2 GB map: about 1.2x faster). */
#define PREFETCH_AHEAD 12
#define RANGE_PREFETCH_AHEAD 8

/* SIGBUS guard: the jump target of the guarded loop running in this thread, or
 * NULL. The handler jumps there; outside a guarded loop it hands the signal to
 * the handler installed before (by default: the process dies, as without it). */
static _Thread_local sigjmp_buf *bus_target;
static struct sigaction previous_bus;
static PyObject *MappedFault;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *target = bus_target;
    /* Only a fault of this thread's own access (si_code > 0, e.g. BUS_ADRERR)
     * ends the copy; a SIGBUS sent by kill() (si_code <= 0) is not a fault of
     * the copy and goes on as without the guard. */
    if (target != NULL && info != NULL && info->si_code > 0) {
        bus_target = NULL;
        siglongjmp(*target, 1);
    }
    if (previous_bus.sa_flags & SA_SIGINFO) {
        previous_bus.sa_sigaction(sig, info, context);
        return;
    }
    if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(sig);
        return;
    }
    /* Default action: restore it; a fault then recurs on return and ends the
     * process, a signal sent by another process is sent again. */
    sigaction(SIGBUS, &previous_bus, NULL);
    if (info == NULL || info->si_code <= 0) {
        raise(sig);
    }
}

static int install_bus_guard(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    /* NODEFER: the jump out leaves SIGBUS unblocked without saving the mask. */
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    return sigaction(SIGBUS, &action, &previous_bus);
}

/* Calls step(state) and returns 0, or returns 1 if a SIGBUS in this thread cut
 * it short. The caller has released the GIL. */
static int run_guarded(void (*step)(void *), void *state) {
    sigjmp_buf target;
    if (sigsetjmp(target, 0) != 0) {
        return 1; /* the handler cleared bus_target */
    }
    bus_target = &target;
    step(state);
    bus_target = NULL;
    return 0;
}

static void set_mapped_fault(const char *what) {
    PyErr_Format(MappedFault,
                 "%s: the mapped source bytes could not be read (SIGBUS: the file under the "
                 "map was cut short)",
                 what);
}

/* Copies row bytes from in + pos[i] to out + i * row for every i < n; returns the
 * first i whose start lies outside [0, last] (its start in *bad_start), or -1. */
static inline __attribute__((always_inline)) Py_ssize_t
copy_rows_loop(char *out, const char *in, const int64_t *pos, Py_ssize_t n, Py_ssize_t row,
               int64_t last, int64_t *bad_start) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s;
        memcpy(&s, pos + i, sizeof s);
        /* Checked again on the read that is used: another thread may have
         * written starts since the check before it. */
        if (s < 0 || s > last) {
            *bad_start = s;
            return i;
        }
        if (i + PREFETCH_AHEAD < n) {
            int64_t p;
            memcpy(&p, pos + i + PREFETCH_AHEAD, sizeof p);
            if (p >= 0 && p <= last) {
                __builtin_prefetch(in + p, 0, 0);
            }
        }
        memcpy(out + i * row, in + s, (size_t)row);
    }
    return -1;
}

/* Rows of 8 and 16 bytes (labels, offsets) get a copy of constant size, which
 * the compiler inlines; other sizes call memcpy. */
static Py_ssize_t
copy_rows_any(char *out, const char *in, const int64_t *pos, Py_ssize_t n, Py_ssize_t row,
              int64_t last, int64_t *bad_start) {
    if (row == 8) {
        return copy_rows_loop(out, in, pos, n, 8, last, bad_start);
    }
    if (row == 16) {
        return copy_rows_loop(out, in, pos, n, 16, last, bad_start);
    }
    return copy_rows_loop(out, in, pos, n, row, last, bad_start);
}

struct rows_call {
    char *out;
    const char *in;
    const int64_t *pos;
    Py_ssize_t n, row;
    int64_t last, bad_start;
    Py_ssize_t bad;
};

static void rows_step(void *state) {
    struct rows_call *c = state;
    c->bad = copy_rows_any(c->out, c->in, c->pos, c->n, c->row, c->last, &c->bad_start);
}

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
        Py_ssize_t bad = -1;
        int64_t bad_start = 0;
        struct rows_call call = {out, in, pos, n, row, last, 0, -1};
        int faulted;
        Py_BEGIN_ALLOW_THREADS
        faulted = run_guarded(rows_step, &call);
        Py_END_ALLOW_THREADS
        bad = call.bad;
        bad_start = call.bad_start;
        if (faulted) {
            set_mapped_fault("gather_rows");
            goto done;
        }
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError,
                         "row %zd starts at byte %lld, outside the %zd-byte source",
                         bad, (long long)bad_start, src.len);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&starts);
    return result;
}

/* gather_rows_at: the rows of records local[i] of chunks chunks[i], row j of
 * chunk c starting at byte addresses[c] - lowest + j * stride of src (an
 * address of 0: never added).
 * Returns the first i whose chunk, address or start is bad (its reason in
 * *why: 1 chunk out of range, 2 chunk not added, 3 start outside src, 4 a
 * negative or overflowing record number; the offending value in *bad_value),
 * or -1. Every value is read once, then
 * checked and used, so a concurrent writer cannot move a copy outside src. */
struct rows_at_call {
    char *out;
    const char *in;
    const int64_t *addresses, *chunks, *local;
    Py_ssize_t n, num_chunks, row, stride;
    int64_t lowest, last, bad_value;
    Py_ssize_t bad;
    int why;
};

/* The address of chunk chunks[i] in addresses (num_chunks of them), or 0 with
 * the reason in *why (1 chunk out of range, 2 chunk never added: address 0) and
 * the chunk in *value. The chunk is read once, into *chunk_out. */
static inline int64_t chunk_address(const int64_t *chunks, const int64_t *addresses,
                                    Py_ssize_t num_chunks, Py_ssize_t i, int64_t *chunk_out,
                                    int *why, int64_t *value) {
    int64_t chunk, address;
    memcpy(&chunk, chunks + i, sizeof chunk);
    if (chunk < 0 || chunk >= (int64_t)num_chunks) {
        *why = 1;
        *value = chunk;
        return 0;
    }
    memcpy(&address, addresses + chunk, sizeof address);
    if (address == 0) {
        *why = 2;
        *value = chunk;
        return 0;
    }
    *chunk_out = chunk;
    return address;
}

static inline int64_t row_start_at(const struct rows_at_call *c, Py_ssize_t i, int *why,
                                   int64_t *value) {
    int64_t chunk, local;
    int64_t address = chunk_address(c->chunks, c->addresses, c->num_chunks, i, &chunk, why, value);
    if (address == 0) {
        return -1;
    }
    memcpy(&local, c->local + i, sizeof local);
    int64_t offset, start;
    int64_t base;
    if (local < 0 || __builtin_sub_overflow(address, c->lowest, &base) ||
        __builtin_mul_overflow(local, (int64_t)c->stride, &offset) ||
        __builtin_add_overflow(base, offset, &start)) {
        *why = 4;
        *value = local;
        return -1;
    }
    if (start < 0 || start > c->last) {
        *why = 3;
        *value = start;
        return -1;
    }
    return start;
}

/* Starts are computed and checked a block at a time into a buffer on the stack,
 * then that block is copied by the row loop of gather_rows (which checks each
 * start again on its read; the buffer is this thread's own). */
#define ROWS_AT_BLOCK 512

static void rows_at_step(void *state) {
    struct rows_at_call *c = state;
    int64_t starts[ROWS_AT_BLOCK];
    c->bad = -1;
    for (Py_ssize_t base = 0; base < c->n; base += ROWS_AT_BLOCK) {
        Py_ssize_t m = c->n - base < ROWS_AT_BLOCK ? c->n - base : ROWS_AT_BLOCK;
        for (Py_ssize_t j = 0; j < m; j++) {
            int why = 0;
            int64_t value = 0;
            int64_t s = row_start_at(c, base + j, &why, &value);
            if (s < 0) {
                c->bad = base + j;
                c->why = why;
                c->bad_value = value;
                return;
            }
            starts[j] = s;
        }
        int64_t bad_start = 0;
        Py_ssize_t bad = copy_rows_any(c->out + base * c->row, c->in, starts, m, c->row, c->last,
                                       &bad_start);
        if (bad >= 0) { /* not reached: the starts were checked above */
            c->bad = base + bad;
            c->why = 3;
            c->bad_value = bad_start;
            return;
        }
    }
}

static PyObject *gather_rows_at(PyObject *module, PyObject *args) {
    Py_buffer dst, src, addresses, chunks, local;
    long long lowest;
    Py_ssize_t row, stride = PY_SSIZE_T_MIN; /* not given: row_bytes */
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*Ln|n", &dst, &src, &addresses, &chunks, &local,
                          &lowest, &row, &stride)) {
        return NULL;
    }
    if (stride == PY_SSIZE_T_MIN) {
        stride = row;
    }
    Py_ssize_t n = local.len / (Py_ssize_t)sizeof(int64_t);
    if (row < 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes must be >= 0, got %zd", row);
        goto done;
    }
    if (stride < 0) {
        PyErr_Format(PyExc_ValueError, "stride must be >= 0, got %zd", stride);
        goto done;
    }
    if (addresses.len % (Py_ssize_t)sizeof(int64_t) != 0 ||
        chunks.len % (Py_ssize_t)sizeof(int64_t) != 0 ||
        local.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "addresses, chunks and local must be buffers of int64");
        goto done;
    }
    if (chunks.len != local.len) {
        PyErr_Format(PyExc_ValueError, "chunks holds %zd values, local %zd",
                     chunks.len / (Py_ssize_t)sizeof(int64_t), n);
        goto done;
    }
    if (row != 0 && n > dst.len / row) {
        PyErr_Format(PyExc_ValueError, "destination holds %zd bytes, %zd rows of %zd need more",
                     dst.len, n, row);
        goto done;
    }
    if (row == 0) { /* nothing to copy */
        result = Py_NewRef(Py_None);
        goto done;
    }
    {
        struct rows_at_call call = {(char *)dst.buf,
                                    (const char *)src.buf,
                                    (const int64_t *)addresses.buf,
                                    (const int64_t *)chunks.buf,
                                    (const int64_t *)local.buf,
                                    n,
                                    addresses.len / (Py_ssize_t)sizeof(int64_t),
                                    row,
                                    stride,
                                    (int64_t)lowest,
                                    (int64_t)src.len - (int64_t)row,
                                    0,
                                    -1,
                                    0};
        int faulted;
        Py_BEGIN_ALLOW_THREADS
        faulted = run_guarded(rows_at_step, &call);
        Py_END_ALLOW_THREADS
        if (faulted) {
            set_mapped_fault("gather_rows_at");
            goto done;
        }
        if (call.bad >= 0) {
            if (call.why == 1) {
                PyErr_Format(PyExc_IndexError, "row %zd names chunk %lld of %zd", call.bad,
                             (long long)call.bad_value, call.num_chunks);
            } else if (call.why == 2) {
                PyErr_Format(PyExc_RuntimeError, "row %zd names chunk %lld, which was never added",
                             call.bad, (long long)call.bad_value);
            } else if (call.why == 4) {
                PyErr_Format(PyExc_IndexError,
                             "row %zd is record %lld of its chunk, outside the %zd-byte source",
                             call.bad, (long long)call.bad_value, src.len);
            } else {
                PyErr_Format(PyExc_IndexError,
                             "row %zd starts at byte %lld, outside the %zd-byte source", call.bad,
                             (long long)call.bad_value, src.len);
            }
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&addresses);
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&local);
    return result;
}

/* ranges_at: for record local[i] of chunk c = chunks[i], the pair of int64
 * offsets (a, b) at byte pairs[c] - lowest + local[i] * 8 of src, with local[i]
 * < rows[c] and 0 <= a <= b <= limits[c], gives the byte range
 * [data[c] - lowest + a * item, + (b - a) * item) of src; starts[i] and
 * lengths[i] receive it (start 0 for an empty range), offsets[i + 1] =
 * offsets[i] + b - a (offsets[0] = 0). Returns the first i that is bad (its
 * reason in *why: 1 chunk out of range, 2 chunk not added, 3 pair or range
 * outside src, 4 a bad record number, 5 offsets out of bounds), or -1, and the
 * bytes of all ranges in *total. Every value is read once, then checked and
 * used. */
struct var_call {
    int64_t *starts, *lengths, *offsets;
    const char *in;
    const int64_t *pairs, *rows, *limits, *data, *chunks, *local;
    Py_ssize_t n, num_chunks;
    int64_t lowest, src_len, item, total, bad_value;
    Py_ssize_t bad;
    int why;
};

static inline int64_t pair_start(const struct var_call *c, Py_ssize_t i, int64_t *chunk_out,
                                 int *why, int64_t *value) {
    int64_t chunk, local, rows, base, start;
    int64_t address = chunk_address(c->chunks, c->pairs, c->num_chunks, i, &chunk, why, value);
    if (address == 0) {
        return -1;
    }
    memcpy(&local, c->local + i, sizeof local);
    memcpy(&rows, c->rows + chunk, sizeof rows);
    if (local < 0 || local >= rows || __builtin_sub_overflow(address, c->lowest, &base) ||
        local > INT64_MAX / 8 || __builtin_add_overflow(base, local * 8, &start)) {
        *why = 4;
        *value = local;
        return -1;
    }
    if (start < 0 || start > c->src_len - 16) {
        *why = 3;
        *value = start;
        return -1;
    }
    *chunk_out = chunk;
    return start;
}

static void var_step(void *state) {
    struct var_call *c = state;
    int64_t total = 0, count = 0;
    c->bad = -1;
    c->offsets[0] = 0;
    for (Py_ssize_t i = 0; i < c->n; i++) {
        if (i + PREFETCH_AHEAD < c->n) {
            int64_t chunk, local, address;
            memcpy(&chunk, c->chunks + i + PREFETCH_AHEAD, sizeof chunk);
            memcpy(&local, c->local + i + PREFETCH_AHEAD, sizeof local);
            if (chunk >= 0 && chunk < (int64_t)c->num_chunks) {
                memcpy(&address, c->pairs + chunk, sizeof address);
                int64_t p;
                if (address != 0 && local >= 0 && local <= c->src_len &&
                    !__builtin_sub_overflow(address, c->lowest, &p) && p >= 0 &&
                    p <= c->src_len - 16 - local * 8) {
                    p += local * 8;
                    __builtin_prefetch(c->in + p, 0, 0);
                }
            }
        }
        int why = 0;
        int64_t value = 0, chunk = 0;
        int64_t at = pair_start(c, i, &chunk, &why, &value);
        if (at < 0) {
            c->bad = i;
            c->why = why;
            c->bad_value = value;
            break;
        }
        int64_t a, b, limit, data, span, length, start = 0;
        memcpy(&a, c->in + at, sizeof a);
        memcpy(&b, c->in + at + 8, sizeof b);
        memcpy(&limit, c->limits + chunk, sizeof limit);
        if (a < 0 || b < a || b > limit) {
            c->bad = i;
            c->why = 5;
            c->bad_value = a < 0 || b < a ? a : b;
            break;
        }
        memcpy(&data, c->data + chunk, sizeof data);
        if (__builtin_mul_overflow(b - a, c->item, &length)) {
            c->bad = i;
            c->why = 5;
            c->bad_value = b;
            break;
        }
        /* An empty range is copied from start 0: the data of a chunk without
         * values may lie outside src. */
        if (length > 0 && (__builtin_mul_overflow(a, c->item, &span) ||
                           __builtin_sub_overflow(data, c->lowest, &start) ||
                           __builtin_add_overflow(start, span, &start) || start < 0 ||
                           length > c->src_len - start)) {
            c->bad = i;
            c->why = 3;
            c->bad_value = start;
            break;
        }
        c->starts[i] = start;
        c->lengths[i] = length;
        count += b - a;
        c->offsets[i + 1] = count;
        total += length;
    }
    c->total = total;
}

static PyObject *ranges_at(PyObject *module, PyObject *args) {
    Py_buffer starts, lengths, offsets, src, pairs, rows, limits, data, chunks, local;
    long long lowest;
    Py_ssize_t item;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*w*w*y*y*y*y*y*y*y*Ln", &starts, &lengths, &offsets, &src,
                          &pairs, &rows, &limits, &data, &chunks, &local, &lowest, &item)) {
        return NULL;
    }
    const Py_ssize_t w = (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t n = local.len / w;
    const Py_ssize_t num_chunks = pairs.len / w;
    if (local.len % w != 0 || chunks.len != local.len || starts.len != local.len ||
        lengths.len != local.len || offsets.len != local.len + w || pairs.len % w != 0 ||
        rows.len != pairs.len || limits.len != pairs.len || data.len != pairs.len) {
        PyErr_SetString(PyExc_ValueError,
                        "ranges_at: starts, lengths, chunks and local must be int64 buffers of n "
                        "values, offsets of n + 1, pairs, rows, limits and data of one per chunk");
        goto done;
    }
    if (item < 0) {
        PyErr_Format(PyExc_ValueError, "item must be >= 0, got %zd", item);
        goto done;
    }
    {
        struct var_call call = {(int64_t *)starts.buf, (int64_t *)lengths.buf,
                                (int64_t *)offsets.buf, (const char *)src.buf,
                                (const int64_t *)pairs.buf, (const int64_t *)rows.buf,
                                (const int64_t *)limits.buf, (const int64_t *)data.buf,
                                (const int64_t *)chunks.buf, (const int64_t *)local.buf,
                                n, num_chunks, (int64_t)lowest, (int64_t)src.len, (int64_t)item,
                                0, 0, -1, 0};
        int faulted;
        Py_BEGIN_ALLOW_THREADS
        faulted = run_guarded(var_step, &call);
        Py_END_ALLOW_THREADS
        if (faulted) {
            set_mapped_fault("ranges_at");
            goto done;
        }
        if (call.bad >= 0 && call.why != 5) {
            if (call.why == 1) {
                PyErr_Format(PyExc_IndexError, "record %zd names chunk %lld of %zd", call.bad,
                             (long long)call.bad_value, num_chunks);
            } else if (call.why == 2) {
                PyErr_Format(PyExc_RuntimeError,
                             "record %zd names chunk %lld, which was never added", call.bad,
                             (long long)call.bad_value);
            } else if (call.why == 4) {
                PyErr_Format(PyExc_IndexError, "record %zd is record %lld of its chunk, beyond it",
                             call.bad, (long long)call.bad_value);
            } else {
                PyErr_Format(PyExc_IndexError,
                             "record %zd reads byte %lld, outside the %zd-byte source", call.bad,
                             (long long)call.bad_value, src.len);
            }
            goto done;
        }
        result = Py_BuildValue("Ln", (long long)call.total, call.bad);
    }
done:
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&src);
    PyBuffer_Release(&pairs);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&limits);
    PyBuffer_Release(&data);
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&local);
    return result;
}

/* Appends in[pos[i] : pos[i] + len[i]] to out for every i < n, each range
 * checked on the read the copy uses; returns the first bad i (its range in
 * *bad_start, *bad_len) or -1, and the bytes written in *total. */
static Py_ssize_t
copy_ranges_loop(char *out, const char *in, const int64_t *pos, const int64_t *len, Py_ssize_t n,
                 int64_t src_len, int64_t dst_len, int64_t *bad_start, int64_t *bad_len,
                 int64_t *total_out) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s, k;
        /* Read once, then checked and used: a concurrent writer of starts or
         * lengths cannot move the copy outside src or dst. */
        memcpy(&s, pos + i, sizeof s);
        memcpy(&k, len + i, sizeof k);
        if (s < 0 || k < 0 || s > src_len || k > src_len - s || k > dst_len - total) {
            *bad_start = s;
            *bad_len = k;
            *total_out = total;
            return i;
        }
        if (i + RANGE_PREFETCH_AHEAD < n) {
            int64_t p;
            memcpy(&p, pos + i + RANGE_PREFETCH_AHEAD, sizeof p);
            if (p >= 0 && p < src_len) {
                __builtin_prefetch(in + p, 0, 0);
                if (p + 64 < src_len) {
                    __builtin_prefetch(in + p + 64, 0, 0);
                }
            }
        }
        memcpy(out + total, in + s, (size_t)k);
        total += k;
    }
    *total_out = total;
    return -1;
}

struct ranges_call {
    char *out;
    const char *in;
    const int64_t *pos, *len;
    Py_ssize_t n;
    int64_t src_len, dst_len, bad_start, bad_len, total;
    Py_ssize_t bad;
};

static void ranges_step(void *state) {
    struct ranges_call *c = state;
    c->bad = copy_ranges_loop(c->out, c->in, c->pos, c->len, c->n, c->src_len, c->dst_len,
                              &c->bad_start, &c->bad_len, &c->total);
}

static PyObject *gather_ranges(PyObject *module, PyObject *args) {
    Py_buffer dst, src, starts, lengths;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*y*y*", &dst, &src, &starts, &lengths)) {
        return NULL;
    }
    if (starts.len % (Py_ssize_t)sizeof(int64_t) != 0 || starts.len != lengths.len) {
        PyErr_SetString(PyExc_ValueError, "starts and lengths must be int64 buffers of one size");
        goto done;
    }
    {
        const Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
        const int64_t *pos = (const int64_t *)starts.buf, *len = (const int64_t *)lengths.buf;
        const int64_t src_len = (int64_t)src.len, dst_len = (int64_t)dst.len;
        char *out = (char *)dst.buf;
        const char *in = (const char *)src.buf;
        Py_ssize_t bad = -1;
        int64_t bad_start = 0, bad_len = 0, total = 0;
        struct ranges_call call = {out, in, pos, len, n, src_len, dst_len, 0, 0, 0, -1};
        int faulted;
        Py_BEGIN_ALLOW_THREADS
        faulted = run_guarded(ranges_step, &call);
        Py_END_ALLOW_THREADS
        bad = call.bad;
        bad_start = call.bad_start;
        bad_len = call.bad_len;
        total = call.total;
        if (faulted) {
            set_mapped_fault("gather_ranges");
            goto done;
        }
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError,
                         "range %zd (start %lld, length %lld) lies outside the %zd-byte source "
                         "or overflows the %zd-byte destination",
                         bad, (long long)bad_start, (long long)bad_len, src.len, dst.len);
            goto done;
        }
        result = PyLong_FromLongLong((long long)total);
    }
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&lengths);
    return result;
}

static PyObject *split_bytes(PyObject *module, PyObject *args) {
    Py_buffer data, offsets;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*y*", &data, &offsets)) {
        return NULL;
    }
    if (offsets.len % (Py_ssize_t)sizeof(int64_t) != 0 || offsets.len == 0) {
        PyErr_SetString(PyExc_ValueError, "offsets must be a non-empty int64 buffer");
        goto done;
    }
    {
        const Py_ssize_t n = offsets.len / (Py_ssize_t)sizeof(int64_t) - 1;
        const int64_t *off = (const int64_t *)offsets.buf;
        const char *in = (const char *)data.buf;
        PyObject *list = PyList_New(n);
        if (list == NULL) {
            goto done;
        }
        int64_t a;
        memcpy(&a, off, sizeof a);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t b;
            memcpy(&b, off + i + 1, sizeof b);
            if (a < 0 || b < a || b > (int64_t)data.len) {
                PyErr_Format(PyExc_IndexError,
                             "string %zd spans bytes [%lld, %lld) outside the %zd-byte buffer", i,
                             (long long)a, (long long)b, data.len);
                Py_DECREF(list);
                goto done;
            }
            PyObject *item = PyBytes_FromStringAndSize(in + a, (Py_ssize_t)(b - a));
            if (item == NULL) {
                Py_DECREF(list);
                goto done;
            }
            PyList_SET_ITEM(list, i, item);
            a = b;
        }
        result = list;
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&offsets);
    return result;
}

/* Keyed Feistel encryption of a block of values, in place; T is uint32_t or
 * uint64_t (the word). Rounds run outside the loop over values, so the loop
 * body has no dependence between values and the compiler vectorizes it. */
#define BLOCK 256
#define FEISTEL_ENCRYPT(T, WORD, MUL1, MUL2)                                         \
    static void encrypt_##WORD(T *v, Py_ssize_t len, const T *keys, Py_ssize_t rounds, \
                               int high, int low) {                                  \
        T a[BLOCK], b[BLOCK];                                                        \
        T *left = a, *right = b;                                                     \
        int left_bits = high, right_bits = low;                                      \
        const T mask = ((T)1 << right_bits) - 1;                                     \
        for (Py_ssize_t i = 0; i < len; i++) {                                       \
            left[i] = v[i] >> right_bits;                                            \
            right[i] = v[i] & mask;                                                  \
        }                                                                            \
        for (Py_ssize_t r = 0; r < rounds; r++) {                                    \
            const T key = keys[r];                                                   \
            const int shift = WORD - left_bits;                                      \
            for (Py_ssize_t i = 0; i < len; i++) {                                   \
                T tmp = (T)(right[i] * (T)(MUL1)) ^ key;                             \
                tmp ^= tmp >> (WORD / 2);                                            \
                tmp = (T)(tmp * (T)(MUL2));                                          \
                left[i] ^= tmp >> shift;                                             \
            }                                                                        \
            T *swap = left;                                                          \
            left = right;                                                            \
            right = swap;                                                            \
            int bits = left_bits;                                                    \
            left_bits = right_bits;                                                  \
            right_bits = bits;                                                       \
        }                                                                            \
        for (Py_ssize_t i = 0; i < len; i++) {                                       \
            v[i] = (T)(left[i] << right_bits) | right[i];                            \
        }                                                                            \
    }

FEISTEL_ENCRYPT(uint32_t, 32, 0x9E3779B1u, 0x85EBCA6Bu)
FEISTEL_ENCRYPT(uint64_t, 64, 0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull)

/* Per block of BLOCK values: read each input exactly once (range-checked on
 * that read), encrypt, walk the cycles of the ones still outside [0, n) on the
 * local copy, then store. out is never read, so neither a concurrent writer
 * of values/out nor an unaligned out can break termination or alignment. */
#define PERMUTE(T, WORD, KEYS)                                                       \
    do {                                                                             \
        T buf[BLOCK], walk[BLOCK];                                                   \
        int pend[BLOCK];                                                             \
        for (Py_ssize_t start = 0; start < count && bad < 0; start += BLOCK) {       \
            int len = (int)(count - start < BLOCK ? count - start : BLOCK);          \
            for (int i = 0; i < len; i++) {                                          \
                int64_t v;                                                           \
                memcpy(&v, in + start + i, sizeof v);                                \
                if (v < 0 || v >= n) {                                               \
                    bad = start + i;                                                 \
                    bad_value = v;                                                   \
                    break;                                                           \
                }                                                                    \
                buf[i] = (T)v;                                                       \
            }                                                                        \
            if (bad >= 0) {                                                          \
                break;                                                               \
            }                                                                        \
            encrypt_##WORD(buf, len, KEYS, rounds, high, low);                       \
            for (;;) {                                                               \
                int m = 0;                                                           \
                for (int i = 0; i < len; i++) {                                      \
                    pend[m] = i;                                                     \
                    m += (uint64_t)buf[i] >= limit;                                  \
                }                                                                    \
                if (m == 0) {                                                        \
                    break;                                                           \
                }                                                                    \
                for (int j = 0; j < m; j++) {                                        \
                    walk[j] = buf[pend[j]];                                          \
                }                                                                    \
                encrypt_##WORD(walk, m, KEYS, rounds, high, low);                    \
                for (int j = 0; j < m; j++) {                                        \
                    buf[pend[j]] = walk[j];                                          \
                }                                                                    \
            }                                                                        \
            for (int i = 0; i < len; i++) {                                          \
                int64_t v = (int64_t)buf[i];                                         \
                memcpy(dst + 8 * (start + i), &v, sizeof v);                         \
            }                                                                        \
        }                                                                            \
    } while (0)

static PyObject *feistel(PyObject *module, PyObject *args) {
    Py_buffer out, values, keys;
    int high, low, wide;
    long long n;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*y*y*iipL", &out, &values, &keys, &high, &low, &wide, &n)) {
        return NULL;
    }
    /* No sum before both are bounded (signed overflow); the parameters must be
     * the ones FeistelPermutation derives from n, else the walk may not end. */
    int bits = (high >= 1 && low >= 1 && high <= 32 && low <= 32) ? high + low : 0;
    if (bits < 2 || bits > 63 || (bits > 32) != (wide != 0) || high != bits / 2 || n < 2 ||
        (bits < 63 && n > (1LL << bits)) || (bits > 2 && n <= (1LL << (bits - 1)))) {
        PyErr_Format(PyExc_ValueError, "bad permutation parameters: bits %d+%d, wide %d, n %lld",
                     high, low, wide, n);
        goto done;
    }
    if (values.len % 8 != 0 || out.len != values.len || keys.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "values and out must be int64 buffers of equal size, keys uint64");
        goto done;
    }
    {
        const char *o = out.buf, *v = values.buf;
        if (o != v && o < v + values.len && v < o + out.len) {
            PyErr_SetString(PyExc_ValueError,
                            "out overlaps values (only out is values is allowed)");
            goto done;
        }
    }
    Py_ssize_t count = values.len / 8, rounds = keys.len / 8;
    if (rounds < 1 || rounds > 64) {
        PyErr_Format(PyExc_ValueError, "between 1 and 64 round keys needed, got %zd", rounds);
        goto done;
    }
    {
        const int64_t *in = (const int64_t *)values.buf; /* read with memcpy only */
        unsigned char *dst = (unsigned char *)out.buf;
        const unsigned char *kbytes = (const unsigned char *)keys.buf;
        const uint64_t limit = (uint64_t)n;
        Py_ssize_t bad = -1;
        int64_t bad_value = 0;
        Py_BEGIN_ALLOW_THREADS
        if (wide) {
            uint64_t k64[64];
            memcpy(k64, kbytes, (size_t)rounds * 8);
            PERMUTE(uint64_t, 64, k64);
        } else {
            uint32_t k32[64];
            for (Py_ssize_t r = 0; r < rounds; r++) {
                uint64_t k;
                memcpy(&k, kbytes + 8 * r, sizeof k);
                k32[r] = (uint32_t)k;
            }
            PERMUTE(uint32_t, 32, k32);
        }
        Py_END_ALLOW_THREADS
        if (bad >= 0) {
            PyErr_Format(PyExc_ValueError, "value %lld at %zd is outside [0, %lld)",
                         (long long)bad_value, bad, n);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&values);
    PyBuffer_Release(&keys);
    return result;
}

static PyObject *blocks_verified(PyObject *module, PyObject *args) {
    Py_buffer chunks, starts, ends, base, size, slot, bits;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*", &chunks, &starts, &ends, &base, &size, &slot,
                          &bits)) {
        return NULL;
    }
    if (chunks.len % (Py_ssize_t)sizeof(int64_t) != 0 || starts.len != chunks.len ||
        ends.len != chunks.len || base.len % (Py_ssize_t)sizeof(int64_t) != 0 ||
        size.len != base.len || slot.len != base.len) {
        PyErr_SetString(PyExc_ValueError,
                        "chunks, starts, ends (and base, size, slot) must be int64 buffers of "
                        "one size");
        goto done;
    }
    {
        const Py_ssize_t n = chunks.len / (Py_ssize_t)sizeof(int64_t);
        const int64_t num_chunks = (int64_t)(base.len / (Py_ssize_t)sizeof(int64_t));
        const int64_t num_bits = (int64_t)bits.len * 8;
        const int64_t *c = (const int64_t *)chunks.buf, *s = (const int64_t *)starts.buf;
        const int64_t *e = (const int64_t *)ends.buf, *b = (const int64_t *)base.buf;
        const int64_t *z = (const int64_t *)size.buf, *o = (const int64_t *)slot.buf;
        const unsigned char *m = (const unsigned char *)bits.buf;
        int ok = 1;
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            const int64_t k = c[i], lo = s[i], hi = e[i];
            if (hi <= lo) {
                continue;
            }
            if (k < 0 || k >= num_chunks || z[k] <= 0 || o[k] < 0 || lo < b[k]) {
                ok = 0;
                break;
            }
            const int64_t first = o[k] + (lo - b[k]) / z[k];
            const int64_t last = o[k] + (hi - 1 - b[k]) / z[k];
            if (last >= num_bits) {
                ok = 0;
                break;
            }
            for (int64_t j = first; j <= last; j++) {
                if (!(m[j >> 3] & (1u << (j & 7)))) {
                    ok = 0;
                    break;
                }
            }
        }
        result = PyBool_FromLong(ok);
    }
done:
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    PyBuffer_Release(&base);
    PyBuffer_Release(&size);
    PyBuffer_Release(&slot);
    PyBuffer_Release(&bits);
    return result;
}

/* Holds a buffer (with flags) of every item of seq, a PySequence_Fast, in a new array
 * and returns it; NULL when out of memory. *held counts the buffers got: fewer than the
 * items means an exception is set. release_buffers(array, *held) releases and frees,
 * after success and failure alike. */
static Py_buffer *hold_buffers(PyObject *seq, int flags, Py_ssize_t *held) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    *held = 0;
    if (bufs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (; *held < n; (*held)++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, *held), &bufs[*held], flags) < 0) {
            return bufs;  /* an exception is set: the caller releases and frees */
        }
    }
    return bufs;
}

static void release_buffers(Py_buffer *bufs, Py_ssize_t held) {
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&bufs[i]);
    }
    PyMem_Free(bufs);
}

/* digests[i] = XXH3-64 of bufs[w[i]] bytes [s[i], e[i]) for every i < n; returns
 * the first i whose range is out of bounds, or -1. */
static Py_ssize_t
hash_loop(uint64_t *digests, const Py_buffer *bufs, Py_ssize_t nviews, const int64_t *w,
          const int64_t *s, const int64_t *e, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Checked again on the read that is used: another thread may have
         * written the index arrays since the check before the call. */
        const int64_t k = w[i], lo = s[i], hi = e[i];
        if (k < 0 || k >= nviews || lo < 0 || hi < lo || hi > (int64_t)bufs[k].len) {
            return i;
        }
        uint64_t d = XXH3_64bits((const char *)bufs[k].buf + lo, (size_t)(hi - lo));
        memcpy(digests + i, &d, sizeof d);
    }
    return -1;
}

struct hash_call {
    uint64_t *digests;
    const Py_buffer *bufs;
    Py_ssize_t nviews;
    const int64_t *w, *s, *e;
    Py_ssize_t n, bad;
};

static void hash_step(void *state) {
    struct hash_call *c = state;
    c->bad = hash_loop(c->digests, c->bufs, c->nviews, c->w, c->s, c->e, c->n);
}

static PyObject *hash_blocks(PyObject *module, PyObject *args) {
    Py_buffer out, which, starts, ends;
    PyObject *views, *seq = NULL, *result = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t nviews = 0, held = 0;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*Oy*y*y*", &out, &views, &which, &starts, &ends)) {
        return NULL;
    }
    if (which.len % (Py_ssize_t)sizeof(int64_t) != 0 || starts.len != which.len ||
        ends.len != which.len || out.len != which.len) {
        PyErr_SetString(PyExc_ValueError,
                        "out (uint64), which, starts and ends (int64) must hold one count each");
        goto done;
    }
    seq = PySequence_Fast(views, "views must be a sequence of buffers");
    if (seq == NULL) {
        goto done;
    }
    nviews = PySequence_Fast_GET_SIZE(seq);
    bufs = hold_buffers(seq, PyBUF_SIMPLE, &held);
    if (bufs == NULL || held < nviews) {
        goto done;
    }
    {
        const Py_ssize_t n = which.len / (Py_ssize_t)sizeof(int64_t);
        const int64_t *w = (const int64_t *)which.buf, *s = (const int64_t *)starts.buf;
        const int64_t *e = (const int64_t *)ends.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (w[i] < 0 || w[i] >= nviews || s[i] < 0 || e[i] < s[i] ||
                e[i] > (int64_t)bufs[w[i]].len) {
                PyErr_Format(PyExc_IndexError,
                             "block %zd: bytes [%lld, %lld) of view %lld lie outside it", i,
                             (long long)s[i], (long long)e[i], (long long)w[i]);
                goto done;
            }
        }
        uint64_t *digests = (uint64_t *)out.buf;
        Py_ssize_t bad = -1;
        struct hash_call call = {digests, bufs, nviews, w, s, e, n, -1};
        int faulted;
        Py_BEGIN_ALLOW_THREADS
        faulted = run_guarded(hash_step, &call);
        Py_END_ALLOW_THREADS
        bad = call.bad;
        if (faulted) {
            set_mapped_fault("hash_blocks");
            goto done;
        }
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError, "block %zd changed while it was hashed", bad);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, held);
    Py_XDECREF(seq);
    PyBuffer_Release(&out);
    PyBuffer_Release(&which);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    return result;
}

static PyObject *join_into(PyObject *module, PyObject *args) {
    Py_buffer dst;
    PyObject *pieces, *seq = NULL, *result = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = 0, held = 0, total = 0;

    (void)module;
    if (!PyArg_ParseTuple(args, "w*O", &dst, &pieces)) {
        return NULL;
    }
    seq = PySequence_Fast(pieces, "pieces must be a sequence of buffers");
    if (seq == NULL) {
        goto done;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    bufs = hold_buffers(seq, PyBUF_C_CONTIGUOUS, &held);
    if (bufs == NULL || held < n) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bufs[i].len > dst.len - total) {
            PyErr_Format(PyExc_ValueError,
                         "pieces up to %zd hold more than the %zd bytes of dst", i, dst.len);
            goto done;
        }
        total += bufs[i].len;
    }
    Py_BEGIN_ALLOW_THREADS
    char *at = (char *)dst.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bufs[i].len) {
            memcpy(at, bufs[i].buf, (size_t)bufs[i].len);
        }
        at += bufs[i].len;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total);
done:
    release_buffers(bufs, held);
    Py_XDECREF(seq);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(dst, src, starts, row_bytes): copy rows src[starts[i]:+row_bytes] "
     "into dst, in order. Bounds are checked first; the copy releases the GIL."},
    {"gather_rows_at", gather_rows_at, METH_VARARGS,
     "gather_rows_at(dst, src, addresses, chunks, local, lowest, row_bytes[, stride]): copy "
     "the rows local[i] of chunks[i] (row j of chunk c at src[addresses[c] - lowest + j * "
     "stride:], stride row_bytes by default) into dst, in order; "
     "every chunk, address and start is checked on the read the copy uses (without the GIL)."},
    {"gather_ranges", gather_ranges, METH_VARARGS,
     "gather_ranges(dst, src, starts, lengths) -> int: append src[starts[i]:+lengths[i]] to "
     "dst, in order; every range is checked on the read the copy uses (without the GIL)."},
    {"ranges_at", ranges_at, METH_VARARGS,
     "ranges_at(starts, lengths, offsets, src, pairs, rows, limits, data, chunks, local, "
     "lowest, item) -> (total, bad): the byte ranges of variable-length records from their "
     "offset pairs, each checked (without the GIL); bad is the first record whose offsets "
     "lie outside its chunk's limit, or -1."},
    {"split_bytes", split_bytes, METH_VARARGS,
     "split_bytes(data, offsets) -> list[bytes]: data[offsets[i]:offsets[i + 1]] for each i."},
    {"blocks_verified", blocks_verified, METH_VARARGS,
     "blocks_verified(chunks, starts, ends, base, size, slot, bits) -> bool: whether every "
     "checksum block of the byte ranges has its bit set (yogastore.read.verified)."},
    {"hash_blocks", hash_blocks, METH_VARARGS,
     "hash_blocks(out, views, which, starts, ends): out[i] = XXH3-64 of "
     "views[which[i]][starts[i]:ends[i]] (uint64), every range checked first; hashes "
     "without the GIL."},
    {"join_into", join_into, METH_VARARGS,
     "join_into(dst, pieces) -> int: copy the buffers of pieces one after another to the "
     "start of dst; their total is checked first; copies without the GIL."},
    {"feistel", feistel, METH_VARARGS,
     "feistel(out, values, keys, high_bits, low_bits, wide, n): keyed permutation of "
     "int64 values in [0, n) into out (see yogastore.read.order.FeistelPermutation)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "yogastore._gather",
    "Compiled loops of the read path: row and range gathers (yogastore.format.memory), "
    "the build's chunk copy (yogastore.format.encode), "
    "verified-block lookups and block hashes (yogastore.read.verified) and the shuffled order (yogastore.read.order.FeistelPermutation).", -1, methods,
};

PyMODINIT_FUNC PyInit__gather(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    MappedFault = PyErr_NewExceptionWithDoc(
        "yogastore._gather.MappedFault",
        "A read of mapped source bytes faulted (SIGBUS): the file under the map was cut short.",
        PyExc_OSError, NULL);
    if (MappedFault == NULL || PyModule_AddObjectRef(module, "MappedFault", MappedFault) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    if (install_bus_guard() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
