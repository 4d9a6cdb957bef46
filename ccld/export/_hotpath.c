/* ccld/export/_hotpath.c: the export's per-row loops in C, an optional accelerator of `ccld export`.
 *
 * What it mirrors, row for row: colblocks._colls, _starts and _ends (a column block's enters, starts
 * and ends) and the per-rank loop of collectives.Collectives.flush_group with ProtoSink.rank's packet
 * encoding. Those Python functions stay the reference and the fallback (no compiler, or
 * CCLD_PURE_PYTHON=1): this file touches the same state (the model's dicts, Proc and Track objects)
 * with the same effects in the same order and writes the same bytes; tests export stores both ways
 * and compare the traces byte for byte.
 * What it leaves to Python: every rare case. A row loop stops at a row it does not take (a number
 * outside int64, a sum that overflows) and returns its index; the caller finishes the block from
 * there with the Python loop. Per rank, anything but the common slice (an error, an unfinished
 * collective, a timestamp whose varint is not 9 bytes, a sink other than ProtoSink) calls the sink's
 * Python method; new processes, lanes, track declarations, GPU joins and group completion call the
 * model's Python methods.
 * Times: Unix ns, int64, as in the Python (timestamps 2^56..2^63 are 9-byte varints).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_enter, *s_new_proc, *s_max_ts, *s_evict_open, *s_expected, *s_flush_group, *s_popitem,
    *s_proc_track, *s_pick, *s_declare, *s_group, *s_gp, *s_rank, *s_started, *s_buf, *s_flush, *s_stats,
    *s_bad_events, *i_two;

/* -- slots: Proc, Track and Lanes are __slots__ classes. PyObject_GetAttr costs ~30 ns and a rank
 * takes ~15, so bind() finds each slot's offset from its member descriptor once and get()/set() read
 * and write it directly; an object of another type (or a slot that is not a plain object slot) goes
 * through GetAttr/SetAttr. */

typedef struct {
    PyTypeObject *type;  /* NULL: not bound, always GetAttr */
    Py_ssize_t off;
    PyObject *name;
} Slot;

static Slot sl_skip, sl_gpu, sl_job, sl_track, sl_calls, sl_worker, sl_tracks, sl_last_ts, sl_declared, sl_out;

static PyObject *get(PyObject *o, Slot *s)
{
    if (Py_TYPE(o) == s->type) {
        PyObject *v = *(PyObject **)((char *)o + s->off);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(o, s->name);  /* also raises AttributeError for an unset slot */
}

static int set(PyObject *o, Slot *s, PyObject *v)
{
    if (Py_TYPE(o) == s->type) {
        PyObject **at = (PyObject **)((char *)o + s->off), *old = *at;
        Py_INCREF(v);
        *at = v;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(o, s->name, v);
}

static int bind_slot(Slot *s, PyObject *type)
{
    PyObject *d = PyObject_GetAttr(type, s->name);
    if (d == NULL)
        return -1;
    if (PyType_Check(type) && Py_TYPE(d) == &PyMemberDescr_Type &&
        ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX &&
        ((PyMemberDescrObject *)d)->d_common.d_type == (PyTypeObject *)type) {
        Py_XSETREF(s->type, (PyTypeObject *)type);
        Py_INCREF(type);
        s->off = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    Py_DECREF(d);
    return 0;
}

/* bind(Proc, Track, Lanes): the slots this module reads (accel.py calls it once). */
static PyObject *hp_bind(PyObject *self, PyObject *args)
{
    PyObject *proc, *track, *lanes;
    if (!PyArg_ParseTuple(args, "OOO", &proc, &track, &lanes))
        return NULL;
    if (bind_slot(&sl_skip, proc) < 0 || bind_slot(&sl_gpu, proc) < 0 ||
        bind_slot(&sl_job, proc) < 0 || bind_slot(&sl_track, proc) < 0 ||
        bind_slot(&sl_calls, proc) < 0 || bind_slot(&sl_worker, proc) < 0 ||
        bind_slot(&sl_tracks, lanes) < 0 || bind_slot(&sl_last_ts, track) < 0 ||
        bind_slot(&sl_declared, track) < 0 || bind_slot(&sl_out, track) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* -- small helpers */

/* x as int64; 0 when it is not an int or does not fit (no error left set). */
static int i64(PyObject *x, long long *out)
{
    int overflow;
    if (!PyLong_Check(x))
        return 0;
    *out = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* a OP b for ints (Py_LT, Py_LE, Py_NE, Py_GT) in C when both are exact ints within int64, else as
 * Python compares them; -1 on error. A few a row: RichCompare's dispatch was ~7% of the export. */
static int cmp(PyObject *a, PyObject *b, int op)
{
    long long x, y;
    if (a == b && op == Py_NE)
        return 0;
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b) || !i64(a, &x) || !i64(b, &y))
        return PyObject_RichCompareBool(a, b, op);
    switch (op) {
    case Py_LT: return x < y;
    case Py_LE: return x <= y;
    case Py_NE: return x != y;
    case Py_GT: return x > y;
    default: return PyObject_RichCompareBool(a, b, op);
    }
}

/* Whether a call got `want` arguments; a TypeError naming `fn` when not. */
static int nargs(const char *fn, Py_ssize_t na, Py_ssize_t want)
{
    if (na == want)
        return 1;
    PyErr_Format(PyExc_TypeError, "%s: %zd arguments", fn, want);
    return 0;
}

/* The n ints of tuple t as int64s (a loop's start, end, bound and max_ts); 0 when it is not that. */
static int int64s(PyObject *t, long long *out, Py_ssize_t n)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n)
        return 0;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!i64(PyTuple_GET_ITEM(t, k), &out[k]))
            return 0;
    return 1;
}

/* Row i of a column: a list, or one shared value for every row. */
static inline PyObject *cell(PyObject *col, Py_ssize_t i)
{
    return PyList_CheckExact(col) ? PyList_GET_ITEM(col, i) : col;
}

/* Truth of slot s of o; -1 on error. */
static int attr_true(PyObject *o, Slot *s)
{
    PyObject *v = get(o, s);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Whether slot s of o is not None; -1 on error. */
static int attr_set(PyObject *o, Slot *s)
{
    PyObject *v = get(o, s);
    if (v == NULL)
        return -1;
    int r = v != Py_None;
    Py_DECREF(v);
    return r;
}

static int set_max_ts(PyObject *m, long long max_ts)
{
    PyObject *v = PyLong_FromLongLong(max_ts);
    if (v == NULL)
        return -1;
    int r = PyObject_SetAttr(m, s_max_ts, v);
    Py_DECREF(v);
    return r;
}

/* procs[pid], made with m.new_proc(node, pid, rank) when missing: a new reference, NULL on error. */
static PyObject *proc_of(PyObject *m, PyObject *procs, PyObject *node, PyObject *pid, PyObject *rank)
{
    PyObject *p = PyDict_GetItemWithError(procs, pid);
    if (p != NULL) {
        Py_INCREF(p);
        return p;
    }
    if (PyErr_Occurred())
        return NULL;
    if (rank == NULL)
        Py_RETURN_NONE;
    return PyObject_CallMethodObjArgs(m, s_new_proc, node, pid, rank, NULL);
}

/* open_.pop(key, None) as a new reference (NULL and no error when absent). */
static PyObject *dict_pop(PyObject *d, PyObject *key)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *v = NULL;
    if (PyDict_Pop(d, key, &v) < 0)
        return NULL;
    return v;
#elif PY_VERSION_HEX >= 0x03090000
    PyObject *v = _PyDict_Pop(d, key, Py_None);  /* one lookup (the key's tuple hash is not cached) */
    if (v == Py_None) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
#else
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL)
        return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(d, key) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
#endif
}

/* -- rows of column blocks (colblocks.py) */

/* all_ints(column): every value an int, not a bool (an int subclass), as colblocks._column decides. */
static PyObject *hp_all_ints(PyObject *self, PyObject *c)
{
    if (!PyList_Check(c)) {
        PyErr_SetString(PyExc_TypeError, "all_ints: a list expected");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(c); i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(c, i)))
            Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* A row's time (+ off) and process, as the three loops start each row: 1 take it (*t, *p set), 0 skip
 * it (a process not traced, or unknown to _starts), 2 stop here (Python takes the rest), -1 error.
 * ranks NULL: an unknown pid is not made (p is None). */
static int row_head(PyObject *m, PyObject *procs, PyObject *node, PyObject *pids, PyObject *ranks,
                    PyObject *tss, Py_ssize_t i, long long off, PyObject **last_pid, PyObject **p, long long *t)
{
    PyObject *pid = cell(pids, i);
    long long ts;
    if (!i64(cell(tss, i), &ts) || __builtin_add_overflow(ts, off, t))
        return 2;
    if (*last_pid == NULL || cmp(pid, *last_pid, Py_NE) == 1) {
        Py_XSETREF(*p, proc_of(m, procs, node, pid, ranks == NULL ? NULL : cell(ranks, i)));
        if (*p == NULL)
            return -1;
        *last_pid = pid;
    }
    if (*p == Py_None)
        return 0;
    int skip = attr_true(*p, &sl_skip);
    return skip < 0 ? -1 : !skip;
}

/* _colls: enter rows [start, n). Returns (index stopped at, duplicate enters, max_ts). */
static PyObject *hp_colls(PyObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (!nargs("colls", na, 15))
        return NULL;
    PyObject *m = a[0], *colls = a[1], *procs = a[2], *open_ = a[3], *node = a[4];
    PyObject *seqs = a[5], *pids = a[6], *ranks = a[7], *tss = a[8], *tids = a[9];
    PyObject *args = a[10], *comm = a[11], *op = a[12];
    long long off, bounds[4];  /* start, n, MAX_OPEN, max_ts */
    if (!i64(a[13], &off) || !int64s(a[14], bounds, 4))
        return Py_BuildValue("(nnO)", (Py_ssize_t)0, (Py_ssize_t)0, Py_None);
    long long start = bounds[0], n = bounds[1], max_open = bounds[2], max_ts = bounds[3];
    PyObject *last_pid = NULL, *p = NULL;
    Py_ssize_t i = start, dups = 0;
    for (; i < n; i++) {
        PyObject *seq = cell(seqs, i);
        long long t;
        int take = row_head(m, procs, node, pids, ranks, tss, i, off, &last_pid, &p, &t);
        if (take == 2)
            break;
        if (take < 0)
            goto error;
        if (!take)
            continue;
        PyObject *o = PyList_New(4);
        if (o == NULL)
            goto error;
        PyObject *tv = PyLong_FromLongLong(t);
        if (tv == NULL) {
            Py_DECREF(o);
            goto error;
        }
        PyList_SET_ITEM(o, 0, tv);
        Py_INCREF(args);
        PyList_SET_ITEM(o, 1, args);
        PyList_SET_ITEM(o, 2, PyLong_FromLong(0));
        Py_INCREF(Py_None);
        PyList_SET_ITEM(o, 3, Py_None);
        PyObject *key = PyTuple_Pack(3, p, comm, seq);
        if (key == NULL) {
            Py_DECREF(o);
            goto error;
        }
        PyObject *got = PyDict_SetDefault(open_, key, o);
        Py_DECREF(key);
        if (got == NULL) {
            Py_DECREF(o);
            goto error;
        }
        if (got != o) {
            Py_DECREF(o);
            dups++;
            continue;
        }
        int has_gpu = attr_set(p, &sl_gpu);
        if (has_gpu < 0) {
            Py_DECREF(o);
            goto error;
        }
        if (has_gpu) {  /* o[3] = p.gpu.enter(ts, comm, seq, op, tid) */
            PyObject *g = get(p, &sl_gpu), *ke = NULL;
            if (g != NULL) {
                ke = PyObject_CallMethodObjArgs(g, s_enter, cell(tss, i), comm, seq, op, cell(tids, i), NULL);
                Py_DECREF(g);
            }
            if (ke == NULL) {
                Py_DECREF(o);
                goto error;
            }
            PyList_SetItem(o, 3, ke);
        }
        Py_DECREF(o);  /* open_ holds it */
        if (t > max_ts)
            max_ts = t;
        if (PyDict_GET_SIZE(open_) > max_open) {
            PyObject *mt = PyLong_FromLongLong(max_ts), *r = NULL;
            if (mt != NULL && PyObject_SetAttr(m, s_max_ts, mt) == 0)
                r = PyObject_CallMethodObjArgs(colls, s_evict_open, mt, NULL);
            Py_XDECREF(mt);
            if (r == NULL)
                goto error;
            Py_DECREF(r);
        }
    }
    Py_XDECREF(p);
    return Py_BuildValue("(nnL)", i, dups, max_ts);
error:
    Py_XDECREF(p);
    return NULL;
}

/* A (p, comm, seq) key to look up (never to store): `scratch` is reused while nothing else holds it,
 * saving a tuple's allocation a row (CPython up to 3.13 does not cache a tuple's hash; later ones get
 * a new tuple each time). A new reference. */
static PyObject *lookup_key(PyObject **scratch, PyObject *p, PyObject *comm, PyObject *seq)
{
#if PY_VERSION_HEX < 0x030E0000
    PyObject *k = *scratch;
    if (k == NULL) {
        k = *scratch = PyTuple_Pack(3, p, comm, seq);
        Py_XINCREF(k);
        return k;
    }
    if (Py_REFCNT(k) == 1) {
        PyObject *v[3] = {p, comm, seq};
        for (int i = 0; i < 3; i++) {
            PyObject *old = PyTuple_GET_ITEM(k, i);
            Py_INCREF(v[i]);
            PyTuple_SET_ITEM(k, i, v[i]);
            Py_DECREF(old);
        }
        Py_INCREF(k);
        return k;
    }
#endif
    return PyTuple_Pack(3, p, comm, seq);
}

/* _starts: start rows [start, n). Returns (index stopped at, starts without an enter). */
static PyObject *hp_starts(PyObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (!nargs("starts", na, 9))
        return NULL;
    PyObject *procs = a[0], *open_ = a[1], *seqs = a[2], *pids = a[3], *tss = a[4], *comm = a[5];
    long long off, start, n;
    if (!i64(a[6], &off) || !i64(a[7], &start) || !i64(a[8], &n))
        return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    PyObject *last_pid = NULL, *p = NULL, *scratch = NULL;
    Py_ssize_t i = start, missing = 0;
    for (; i < n; i++) {
        PyObject *seq = cell(seqs, i);
        long long t;
        int take = row_head(NULL, procs, NULL, pids, NULL, tss, i, off, &last_pid, &p, &t);
        if (take == 2)
            break;
        if (take < 0)
            goto error;
        if (!take)
            continue;
        PyObject *key = lookup_key(&scratch, p, comm, seq);
        if (key == NULL)
            goto error;
        PyObject *o = PyDict_GetItemWithError(open_, key);
        Py_DECREF(key);
        if (o == NULL) {
            if (PyErr_Occurred())
                goto error;
            missing++;
            continue;
        }
        PyObject *tv = PyLong_FromLongLong(t);  /* o[2] = ts + off */
        if (tv == NULL)
            goto error;
        if (PyList_CheckExact(o) && PyList_GET_SIZE(o) > 2) {
            PyList_SetItem(o, 2, tv);
        } else {
            int r = PyObject_SetItem(o, i_two, tv);
            Py_DECREF(tv);
            if (r < 0)
                goto error;
        }
    }
    Py_XDECREF(p);
    Py_XDECREF(scratch);
    return Py_BuildValue("(nn)", i, missing);
error:
    Py_XDECREF(p);
    Py_XDECREF(scratch);
    return NULL;
}

/* _ends: end rows [start, n), each filed in its (comm, seq) group, a group flushed (Python's
 * colls.flush_group) when its last expected rank ends. Returns (index stopped at, ends without an
 * enter, max_ts, the key of the group the rows stopped in: None when none is open). A run of rows of
 * one seq is one group, keyed by its first row's seq: the Python loop that takes over goes on with that
 * key rather than begin a new run (its seq may be == but not the same, True for 1, and flush_group
 * writes it). */
static PyObject *hp_ends(PyObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (!nargs("ends", na, 17))
        return NULL;
    PyObject *m = a[0], *colls = a[1], *procs = a[2], *open_ = a[3], *groups = a[4], *expected = a[5];
    PyObject *comm_job = a[6], *node = a[7], *seqs = a[8], *pids = a[9], *ranks = a[10], *tss = a[11];
    PyObject *comm = a[12], *ok = a[13], *error = a[14];
    long long off, bounds[4];  /* start, n, MAX_GROUPS, max_ts */
    if (!i64(a[15], &off) || !int64s(a[16], bounds, 4))
        return Py_BuildValue("(nnOO)", (Py_ssize_t)0, (Py_ssize_t)0, Py_None, Py_None);
    long long start = bounds[0], n = bounds[1], max_groups = bounds[2], max_ts = bounds[3];
    PyObject *last_pid = NULL, *p = NULL, *cur = NULL, *gk = NULL, *items = NULL, *scratch = NULL;
    long long want = 0;
    Py_ssize_t i = start, missing = 0;
    for (; i < n; i++) {
        PyObject *seq = cell(seqs, i);
        long long t, b;
        int take = row_head(m, procs, node, pids, ranks, tss, i, off, &last_pid, &p, &t);
        if (take == 2)
            break;
        if (take < 0)
            goto error;
        if (!take)
            continue;
        if (t > max_ts)
            max_ts = t;
        PyObject *key = lookup_key(&scratch, p, comm, seq);
        if (key == NULL)
            goto error;
        PyObject *o = dict_pop(open_, key);
        Py_DECREF(key);
        if (o == NULL) {
            if (PyErr_Occurred())
                goto error;
            missing++;
            continue;
        }
        PyObject *bo = PySequence_GetItem(o, 0), *eo;
        if (bo == NULL) {
            Py_DECREF(o);
            goto error;
        }
        if (i64(bo, &b)) {
            if (t < b) {
                eo = bo;  /* a wall-clock step between enter and end; never draw a negative slice */
                Py_INCREF(eo);
            } else {
                eo = PyLong_FromLongLong(t);
            }
        } else {
            eo = PyLong_FromLongLong(t);
            int lt = eo == NULL ? -1 : PyObject_RichCompareBool(eo, bo, Py_LT);
            if (lt < 0) {
                Py_XDECREF(eo);
                eo = NULL;
            } else if (lt) {
                Py_SETREF(eo, bo);
                Py_INCREF(bo);
            }
        }
        if (eo == NULL) {
            Py_DECREF(bo);
            Py_DECREF(o);
            goto error;
        }
        if (cur == NULL || cmp(seq, cur, Py_NE) == 1) {
            Py_XSETREF(gk, PyTuple_Pack(2, comm, seq));
            if (gk == NULL)
                goto error_o;
            PyObject *g = PyDict_GetItemWithError(groups, gk);  /* an OrderedDict: read as a dict */
            if (g == NULL) {
                if (PyErr_Occurred())
                    goto error_o;
                g = Py_BuildValue("[LN]", max_ts, PyList_New(0));  /* [max_ts when filed, items] */
                if (g == NULL || PyObject_SetItem(groups, gk, g) < 0) {
                    Py_XDECREF(g);
                    goto error_o;
                }
                Py_DECREF(g);  /* groups holds it */
                int known = PyDict_Contains(comm_job, comm);
                if (known < 0)
                    goto error_o;
                if (!known) {
                    PyObject *job = get(p, &sl_job);
                    int r = job == NULL ? -1 : PyObject_IsTrue(job);
                    if (r > 0)
                        r = PyDict_SetItem(comm_job, comm, job);
                    Py_XDECREF(job);
                    if (r < 0)
                        goto error_o;
                }
            }
            Py_XSETREF(items, PySequence_GetItem(g, 1));
            if (items == NULL)
                goto error_o;
            PyObject *w = PyDict_GetItemWithError(expected, comm);
            if (w != NULL) {
                Py_INCREF(w);
            } else {
                if (PyErr_Occurred())
                    goto error_o;
                if (set_max_ts(m, max_ts) < 0)
                    goto error_o;
                w = PyObject_CallMethodObjArgs(colls, s_expected, comm, NULL);
                if (w == NULL)
                    goto error_o;
            }
            /* Past int64 (a damaged store's group_size or world_size, up to 2^64-1): no group is that
             * big, so it never completes, as in Python's len(items) >= want; a count below int64 always
             * does. */
            int over = 0, is_int = PyLong_Check(w);
            if (is_int) {
                want = PyLong_AsLongLongAndOverflow(w, &over);  /* cannot fail on an int */
                if (over)
                    want = over > 0 ? LLONG_MAX : LLONG_MIN;
            }
            Py_DECREF(w);
            if (!is_int) {
                PyErr_SetString(PyExc_TypeError, "expected ranks: not an int");
                goto error_o;
            }
            Py_XSETREF(cur, seq);
            Py_INCREF(seq);
        }
        PyObject *it = PyTuple_Pack(7, bo, eo, p, o, ok, error, Py_False);
        Py_DECREF(bo);
        Py_DECREF(eo);
        Py_DECREF(o);
        if (it == NULL || PyList_Append(items, it) < 0) {
            Py_XDECREF(it);
            goto error;
        }
        Py_DECREF(it);
        PyObject *r = NULL;
        if (want && PyList_GET_SIZE(items) >= want) {
            if (set_max_ts(m, max_ts) < 0 || PyObject_DelItem(groups, gk) < 0)
                goto error;
            r = PyObject_CallMethodObjArgs(colls, s_flush_group, gk, items, Py_True, NULL);
        } else if (PyObject_Size(groups) > max_groups) {
            if (set_max_ts(m, max_ts) < 0)
                goto error;
            PyObject *kw = Py_BuildValue("{s:O}", "last", Py_False), *pop = PyObject_GetAttr(groups, s_popitem);
            PyObject *none = PyTuple_New(0);
            PyObject *kv = kw && pop && none ? PyObject_Call(pop, none, kw) : NULL;
            Py_XDECREF(kw);
            Py_XDECREF(pop);
            Py_XDECREF(none);
            if (kv == NULL)
                goto error;
            /* k, old = kv, as Python unpacks it (any pair; anything else raises, never NULL unset) */
            PyObject *pair = PySequence_Fast(kv, "a waiting group is not a (key, group) pair");
            Py_DECREF(kv);
            if (pair == NULL)
                goto error;
            PyObject *old = NULL;
            if (PySequence_Fast_GET_SIZE(pair) != 2)
                PyErr_SetString(PyExc_ValueError, "a waiting group is not a (key, group) pair");
            else
                old = PySequence_GetItem(PySequence_Fast_GET_ITEM(pair, 1), 1);
            if (old != NULL)
                r = PyObject_CallMethodObjArgs(colls, s_flush_group, PySequence_Fast_GET_ITEM(pair, 0), old, Py_False,
                                               NULL);
            Py_XDECREF(old);
            Py_DECREF(pair);
        } else {
            continue;
        }
        if (r == NULL)
            goto error;
        Py_DECREF(r);
        Py_CLEAR(cur);
        continue;
error_o:
        Py_DECREF(bo);
        Py_DECREF(eo);
        Py_DECREF(o);
        goto error;
    }
    PyObject *ret = Py_BuildValue("(nnLO)", i, missing, max_ts, cur != NULL ? gk : Py_None);  /* before gk goes */
    Py_XDECREF(p);
    Py_XDECREF(scratch);
    Py_XDECREF(cur);
    Py_XDECREF(gk);
    Py_XDECREF(items);
    return ret;
error:
    Py_XDECREF(p);
    Py_XDECREF(scratch);
    Py_XDECREF(cur);
    Py_XDECREF(gk);
    Py_XDECREF(items);
    return NULL;
}

/* -- a collective's ranks (collectives.Collectives.flush_group, ProtoSink.rank) */

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Out;

static int out_room(Out *o, Py_ssize_t more)
{
    if (o->n + more <= o->cap)
        return 0;
    Py_ssize_t cap = (o->cap ? o->cap : 4096);
    while (cap < o->n + more)
        cap *= 2;
    char *p = PyMem_Realloc(o->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->p = p;
    o->cap = cap;
    return 0;
}

static inline void put(Out *o, const char *s, Py_ssize_t n)
{
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

static inline void put_uv(Out *o, unsigned long long v)
{
    while (v >= 0x80) {
        o->p[o->n++] = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    o->p[o->n++] = (char)v;
}

static inline int uv_len(unsigned long long v)
{
    int n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* What is written so far goes to sink.buf as one piece (before anything else may write there). */
static int spill(Out *o, PyObject *sink)
{
    if (o->n == 0)
        return 0;
    PyObject *buf = PyObject_GetAttr(sink, s_buf);
    PyObject *piece = buf == NULL ? NULL : PyBytes_FromStringAndSize(o->p, o->n);
    int r = piece == NULL ? -1 : PyList_Append(buf, piece);
    Py_XDECREF(piece);
    Py_XDECREF(buf);
    o->n = 0;
    return r;
}

/* ranks() leaving with an exception: what its loop did before stays done, as Python's loop has it by
 * then (the caller's input loop may count the exception as one bad event and go on): its packets go to
 * sink.buf and its bad events to m.stats. The exception is kept; a failure here is dropped for it. */
static void keep_done(PyObject *m, PyObject *sink, Out *out, Py_ssize_t bad)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
#endif
    if (spill(out, sink) < 0)
        PyErr_Clear();
    if (bad > 0) {
        PyObject *stats = PyObject_GetAttr(m, s_stats);
        PyObject *was = stats == NULL ? NULL : PyObject_GetItem(stats, s_bad_events);  /* a Counter: 0 if none */
        PyObject *n = was == NULL ? NULL : PyLong_FromSsize_t(bad);
        PyObject *now = n == NULL ? NULL : PyNumber_Add(was, n);
        if (now == NULL || PyObject_SetItem(stats, s_bad_events, now) < 0)
            PyErr_Clear();
        Py_XDECREF(now);
        Py_XDECREF(n);
        Py_XDECREF(was);
        Py_XDECREF(stats);
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(et, ev, tb);
#endif
}

#define HOTPATH_VERSION 2  /* accel.py takes this module only with the interface it was written for */
#ifndef HOTPATH_SOURCE_SHA256
#define HOTPATH_SOURCE_SHA256 ""  /* setup.py defines it: this file's SHA-256, for accel.py's staleness check */
#endif
#define TS9_LO (1LL << 56)  /* timestamps in [2^56, 2^63) have 9-byte varints: ProtoSink.rank's fast path */
#define MAX_EVENT 4064      /* protobuf._MAX_PRE + 64: the event lengths ProtoSink's packet heads cover */
#define FLUSH_PIECES 256   /* pieces in ProtoSink.buf, a group's ranks each (~4 KiB), before a flush */

/* Bytes and length of item k of tuple t, which must be bytes. */
static int tuple_bytes(PyObject *t, Py_ssize_t k, const char **s, Py_ssize_t *n)
{
    PyObject *x = PyTuple_GET_ITEM(t, k);
    if (!PyBytes_Check(x))
        return 0;
    *s = PyBytes_AS_STRING(x);
    *n = PyBytes_GET_SIZE(x);
    return 1;
}

/* One slice as a BEGIN packet and its END packet, ProtoSink.rank's layout: out (the track's
 * ProtoSink.declare pieces), the event's middle (args, flows), the begin and end times. 0: not this
 * shape (the caller writes it through Python). */
static int encode_pair(Out *o, PyObject *out, const char *mid, Py_ssize_t nmid, const char *mid2,
                       Py_ssize_t nmid2, long long b, long long e)
{
    const char *begin, *head_end, *end;
    Py_ssize_t nbegin, nhead_end, nend;
    if (!PyTuple_Check(out) || PyTuple_GET_SIZE(out) != 6 || !tuple_bytes(out, 4, &begin, &nbegin) ||
        !tuple_bytes(out, 3, &head_end, &nhead_end) || !tuple_bytes(out, 1, &end, &nend))
        return 0;
    Py_ssize_t lt = nbegin + nmid + nmid2;
    if (lt >= MAX_EVENT)
        return 0;
    Py_ssize_t plen = 1 + 9 + 1 + uv_len(lt) + lt + 4;
    if (out_room(o, 1 + 2 + plen + nhead_end + 9 + nend) < 0)
        return -1;
    o->p[o->n++] = 0x0a;  /* Trace.packet */
    put_uv(o, plen);
    o->p[o->n++] = 0x40;  /* timestamp */
    put_uv(o, (unsigned long long)b);
    o->p[o->n++] = 0x5a;  /* track_event */
    put_uv(o, lt);
    put(o, begin, nbegin);
    put(o, mid, nmid);
    put(o, mid2, nmid2);
    put(o, head_end, nhead_end);  /* the BEGIN packet's sequence fields, the END packet's head */
    put_uv(o, (unsigned long long)e);
    put(o, end, nend);
    return 1;
}

/* Lanes.pick, inline: the first lane when free at b (its last_ts moved to e), else lanes.pick(b, e)
 * and, for a new lane, m.declare(track). A new reference; NULL on error. */
static PyObject *lane(PyObject *m, PyObject *lanes, PyObject *bo, long long b, int b_ok, PyObject *eo,
                      Out *o, PyObject *sink)
{
    PyObject *tracks = get(lanes, &sl_tracks);
    if (tracks == NULL)
        return NULL;
    if (PyList_Check(tracks) && PyList_GET_SIZE(tracks) > 0) {
        PyObject *t = PyList_GET_ITEM(tracks, 0);
        Py_INCREF(t);
        Py_DECREF(tracks);
        PyObject *lo = get(t, &sl_last_ts);
        long long last;
        int free_ = lo == NULL ? -1 : b_ok && i64(lo, &last) ? last <= b : PyObject_RichCompareBool(lo, bo, Py_LE);
        Py_XDECREF(lo);
        if (free_ > 0 && set(t, &sl_last_ts, eo) == 0)
            return t;
        Py_DECREF(t);
        if (free_ < 0 || PyErr_Occurred())
            return NULL;
    } else {
        Py_DECREF(tracks);
    }
    PyObject *t = PyObject_CallMethodObjArgs(lanes, s_pick, bo, eo, NULL);
    if (t == NULL)
        return NULL;
    int declared = attr_true(t, &sl_declared);
    if (declared == 0) {
        PyObject *r = spill(o, sink) < 0 ? NULL : PyObject_CallMethodObjArgs(m, s_declare, t, NULL);
        if (r == NULL)
            declared = -1;
        Py_XDECREF(r);
    }
    if (declared < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

/* flush_group's per-rank loop over items (in arrival order) and roles. Returns (end, slices written,
 * unfinished ranks, bad events); exceptions in sink_errors count as bad events, as in Python. */
static PyObject *hp_ranks(PyObject *self, PyObject *const *a, Py_ssize_t na)
{
    if (!nargs("ranks", na, 12))
        return NULL;
    PyObject *m = a[0], *sink = a[1], *items = a[3], *roles = a[4], *seq = a[5], *comm = a[6];
    PyObject *fid = a[7], *t_to_o = a[8], *sink_errors = a[9], *new_flow = a[10], *slice_flow = a[11];
    int proto = PyObject_IsTrue(a[2]);  /* sink is a ProtoSink: C encodes its common slices */
    if (proto < 0)
        return NULL;
    /* t_to is compared as an object (cmp): `--to 1e10` is 10^19 ns, past int64, and Python takes it */
    if (!PyList_Check(items) || !PySequence_Check(roles)) {
        PyErr_SetString(PyExc_TypeError, "ranks: items must be a list, roles a sequence");
        return NULL;
    }
    Out out = {NULL, 0, 0};
    PyObject *end = PyLong_FromLong(0), *g = NULL, *gp = NULL, *item = NULL;
    long long end64 = 0;
    int end_small = 1, started = 0;
    Py_ssize_t written = 0, nunf = 0, bad = 0;
    if (end == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        Py_XSETREF(item, PyList_GET_ITEM(items, i));
        Py_INCREF(item);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 7) {
            PyErr_SetString(PyExc_TypeError, "ranks: an item is not a 7-tuple");
            goto error;
        }
        PyObject *bo = PyTuple_GET_ITEM(item, 0), *eo = PyTuple_GET_ITEM(item, 1), *p = PyTuple_GET_ITEM(item, 2);
        PyObject *o = PyTuple_GET_ITEM(item, 3), *ok = PyTuple_GET_ITEM(item, 4), *err = PyTuple_GET_ITEM(item, 5);
        PyObject *unf = PyTuple_GET_ITEM(item, 6);
        PyObject *role = PySequence_GetItem(roles, i);
        if (role == NULL)
            goto error;
        Py_DECREF(role);  /* roles holds it */
        long long b, e;
        int b64 = i64(bo, &b), e64 = i64(eo, &e);
        int gt = e64 && end_small ? e > end64 : PyObject_RichCompareBool(eo, end, Py_GT);
        if (gt < 0)
            goto error;
        if (gt) {
            Py_SETREF(end, eo);
            Py_INCREF(eo);
            end_small = e64;
            end64 = e;
        }
        int u = PyObject_IsTrue(unf);
        if (u < 0)
            goto error;
        nunf += u;
        int has_track = attr_set(p, &sl_track);
        if (has_track < 0)
            goto error;
        if (!has_track) {
            PyObject *r = PyObject_CallMethodObjArgs(m, s_proc_track, p, NULL);
            if (r == NULL)
                goto error;
            Py_DECREF(r);
        }
        PyObject *args = PySequence_GetItem(o, 1);  /* (op, count, dtype, nbytes) */
        if (args == NULL)
            goto error;
        int same = args == g;
        if (!same && g != NULL) {
            same = PyObject_RichCompareBool(args, g, Py_EQ);
            if (same < 0) {
                Py_DECREF(args);
                goto error;
            }
        }
        if (!same) {
            Py_XSETREF(g, args);
            args = NULL;
            PyObject *r = NULL;
            if (spill(&out, sink) < 0)
                goto error;
            if (PyTuple_Check(g) && PyTuple_GET_SIZE(g) == 4)  /* the model makes it so */
                r = PyObject_CallMethodObjArgs(sink, s_group, PyTuple_GET_ITEM(g, 0), seq, comm,
                                               PyTuple_GET_ITEM(g, 1), PyTuple_GET_ITEM(g, 2),
                                               PyTuple_GET_ITEM(g, 3), fid, NULL);
            else
                PyErr_SetString(PyExc_TypeError, "a collective's (op, count, dtype, nbytes) is not a 4-tuple");
            if (r == NULL) {
                if (!PyErr_ExceptionMatches(sink_errors))
                    goto error;
                PyErr_Clear();
                bad++;
                Py_CLEAR(g);
                continue;
            }
            Py_DECREF(r);
            Py_CLEAR(gp);
            if (proto) {
                gp = PyObject_GetAttr(sink, s_gp);
                if (gp == NULL)
                    goto error;
            }
        }
        Py_XDECREF(args);
        PyObject *calls = get(p, &sl_calls);
        PyObject *tc = calls == NULL ? NULL : lane(m, calls, bo, b, b64, eo, &out, sink);
        Py_XDECREF(calls);
        if (tc == NULL)
            goto error;
        /* Zeroed only after lane(), which compares b as bo's value when b64: zeroed before it, a slice
         * ending past int64 found a lane free at 0 instead of at b (Python opens another lane) */
        if (!b64 || !e64)
            b = e = 0;  /* such slices go through Python */
        PyObject *so = PySequence_GetItem(o, 2), *tw = Py_None;  /* the worker's start, or 0 */
        long long s = 0;
        Py_INCREF(tw);
        if (so == NULL) {
            Py_DECREF(tc);
            Py_DECREF(tw);
            goto error;
        }
        int has_start = PyObject_IsTrue(so);
        if (has_start > 0)
            has_start = cmp(so, t_to_o, Py_LE);
        if (has_start > 0) {
            PyObject *clamped = so;
            int lt = cmp(so, bo, Py_LT), gt2 = 0;
            if (lt == 0)
                gt2 = cmp(so, eo, Py_GT);
            if (lt < 0 || gt2 < 0) {
                has_start = -1;
            } else {
                clamped = lt ? bo : gt2 ? eo : so;
                Py_INCREF(clamped);
                Py_SETREF(so, clamped);
                PyObject *worker = get(p, &sl_worker);
                int s64 = i64(so, &s);
                Py_DECREF(tw);
                tw = worker == NULL ? NULL : lane(m, worker, so, s, s64, eo, &out, sink);
                Py_XDECREF(worker);
                if (tw == NULL)
                    has_start = -1;
                if (!s64)
                    s = 0;
            }
        }
        if (has_start < 0) {
            Py_DECREF(tc);
            Py_XDECREF(tw);
            Py_DECREF(so);
            goto error;
        }
        /* the flow to the GPU kernel, and the slices */
        PyObject *ke = PySequence_GetItem(o, 3), *kfid = NULL;
        int rc = -1;
        if (ke != NULL) {
            if (ke == Py_None)
                kfid = PyLong_FromLong(0);
            else
                kfid = PyObject_CallFunctionObjArgs(slice_flow, p, ke, new_flow, NULL);
            Py_DECREF(ke);
        }
        long long kf = 0;
        int fast = kfid != NULL && proto && gp != NULL && i64(kfid, &kf) && kf >= 0 && b >= TS9_LO && e >= TS9_LO &&
            (tw == Py_None || s >= TS9_LO);
        if (fast) {
            int e_true = PyObject_IsTrue(err);
            if (e_true >= 0 && !started) {  /* sink.started: once true (its clock snapshot is written) it stays so */
                PyObject *st = PyObject_GetAttr(sink, s_started);
                started = st == NULL ? -1 : PyObject_IsTrue(st);
                Py_XDECREF(st);
            }
            if (e_true < 0 || started < 0)
                fast = -1;
            else
                fast = !e_true && !u && started;
            if (started < 0)
                started = 0;  /* that failure is this rank's bad event, not the sink's state: kept, the
                               * next rank failed with no exception set (NULL: SystemError) */
        }
        if (fast > 0) {  /* ProtoSink.rank's fast path, in C */
            const char *c, *w;
            Py_ssize_t nc, nw;
            PyObject *flows = PyTuple_Check(gp) && PyTuple_GET_SIZE(gp) == 6 ? PyTuple_GET_ITEM(gp, 5) : NULL;
            PyObject *fl = flows != NULL && PyDict_Check(flows) ? PyDict_GetItemWithError(flows, role) : NULL;
            char mid2[64];
            Py_ssize_t nmid2 = 0;
            if (fl != NULL && PyBytes_Check(fl) && PyBytes_GET_SIZE(fl) <= 48 &&
                tuple_bytes(gp, ok == Py_True ? 0 : 1, &c, &nc) && tuple_bytes(gp, 3, &w, &nw)) {
                memcpy(mid2, PyBytes_AS_STRING(fl), PyBytes_GET_SIZE(fl));
                nmid2 = PyBytes_GET_SIZE(fl);
                if (kf) {  /* flow_ids += the kernel's flow (fixed64) */
                    mid2[nmid2++] = (char)0xf9;
                    mid2[nmid2++] = 0x02;
                    for (int k = 0; k < 8; k++)
                        mid2[nmid2++] = (char)((unsigned long long)kf >> (8 * k));
                }
                PyObject *oc = get(tc, &sl_out), *ow = NULL;
                if (oc != NULL && tw != Py_None)
                    ow = get(tw, &sl_out);
                if (oc == NULL || (tw != Py_None && ow == NULL)) {
                    fast = -1;
                } else {
                    Py_ssize_t mark = out.n;
                    fast = encode_pair(&out, oc, c, nc, mid2, nmid2, b, e);
                    if (fast > 0 && tw != Py_None)
                        fast = encode_pair(&out, ow, w, nw, "", 0, s, e);
                    if (fast == 0)
                        out.n = mark;  /* not this shape after all: Python writes the pair */
                }
                Py_XDECREF(oc);
                Py_XDECREF(ow);
            } else {
                fast = PyErr_Occurred() ? -1 : 0;
            }
        }
        if (fast > 0) {
            written += tw == Py_None ? 1 : 2;
            rc = 0;
        } else if (fast == 0 && kfid != NULL) {
            PyObject *r = spill(&out, sink) < 0 ? NULL :
                PyObject_CallMethodObjArgs(sink, s_rank, tc, tw, bo, so, eo, ok, err, unf, role, kfid, NULL);
            if (r != NULL) {
                Py_DECREF(r);
                written += tw == Py_None ? 1 : 2;
                rc = 0;
            }
        }
        Py_XDECREF(kfid);
        Py_DECREF(tc);
        Py_DECREF(tw);
        Py_DECREF(so);
        if (rc < 0) {
            if (!PyErr_Occurred() || !PyErr_ExceptionMatches(sink_errors))
                goto error;
            PyErr_Clear();
            bad++;
        }
    }
    if (spill(&out, sink) < 0)
        goto error;
    if (proto) {  /* ProtoSink.flush when its buffer holds FLUSH_PIECES of ours (~1 MiB) */
        PyObject *buf = PyObject_GetAttr(sink, s_buf), *r = NULL;
        if (buf == NULL)
            goto error;
        Py_ssize_t nbuf = PyObject_Size(buf);
        Py_DECREF(buf);
        if (nbuf < 0)
            goto error;  /* not left set under the returned value */
        if (nbuf >= FLUSH_PIECES && (r = PyObject_CallMethodObjArgs(sink, s_flush, NULL)) == NULL)
            goto error;
        Py_XDECREF(r);
    }
    PyMem_Free(out.p);
    Py_XDECREF(item);
    Py_XDECREF(g);
    Py_XDECREF(gp);
    return Py_BuildValue("(Nnnn)", end, written, nunf, bad);
error:
    keep_done(m, sink, &out, bad);
    PyMem_Free(out.p);
    Py_XDECREF(item);
    Py_XDECREF(end);
    Py_XDECREF(g);
    Py_XDECREF(gp);
    return NULL;
}

/* comm(sink, out, w, b, e, ranks, first_rank, last_rank, spread_us): ProtoSink.comm's common case (a
 * whole collective on its communicator's track, after its ranks): the slice b..e on the track whose
 * ProtoSink.declare pieces are `out`, with the collective's name/comm/seq pieces `w` and four int
 * args, appended to sink.buf. False (nothing written): not that shape, ProtoSink.comm writes it. */
static PyObject *hp_comm(PyObject *self, PyObject *const *a, Py_ssize_t na)
{
    static const char keys[4][3] = {{0x08, 0x0a, 0x20}, {0x08, 0x0b, 0x20}, {0x08, 0x0c, 0x20},
                                    {0x08, 0x0d, 0x20}};  /* name_iid 10..13 (protobuf._FIXED_KEYS), int_value */
    if (!nargs("comm", na, 9))
        return NULL;
    PyObject *sink = a[0], *out_t = a[1], *w = a[2];
    long long b, e, v[4];
    if (!PyBytes_Check(w) || !i64(a[3], &b) || !i64(a[4], &e) || b < TS9_LO || e < TS9_LO)
        Py_RETURN_FALSE;
    char mid[64];
    Py_ssize_t n = 0;
    for (int k = 0; k < 4; k++) {
        if (!i64(a[5 + k], &v[k]))
            Py_RETURN_FALSE;
        int len = uv_len((unsigned long long)v[k]);  /* negative: 10 bytes, as int64 */
        mid[n++] = 0x22;  /* DebugAnnotation */
        mid[n++] = (char)(3 + len);
        memcpy(mid + n, keys[k], 3);
        n += 3;
        Out tmp = {mid + n, 0, 16};
        put_uv(&tmp, (unsigned long long)v[k]);
        n += len;
    }
    Out o = {NULL, 0, 0};
    int wrote = encode_pair(&o, out_t, PyBytes_AS_STRING(w), PyBytes_GET_SIZE(w), mid, n, b, e);
    if (wrote > 0 && spill(&o, sink) < 0)
        wrote = -1;
    PyMem_Free(o.p);
    if (wrote < 0)
        return NULL;
    return PyBool_FromLong(wrote);
}

static PyMethodDef methods[] = {
    {"colls", (PyCFunction)(void (*)(void))hp_colls, METH_FASTCALL, "colblocks._colls's row loop"},
    {"starts", (PyCFunction)(void (*)(void))hp_starts, METH_FASTCALL, "colblocks._starts's row loop"},
    {"ends", (PyCFunction)(void (*)(void))hp_ends, METH_FASTCALL, "colblocks._ends's row loop"},
    {"ranks", (PyCFunction)(void (*)(void))hp_ranks, METH_FASTCALL, "Collectives.flush_group's rank loop"},
    {"comm", (PyCFunction)(void (*)(void))hp_comm, METH_FASTCALL, "ProtoSink.comm's common case"},
    {"bind", hp_bind, METH_VARARGS, "bind(Proc, Track, Lanes): the slots read directly"},
    {"all_ints", hp_all_ints, METH_O, "every value of a list an int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", "the export's per-row loops in C", -1,
                                    methods};

PyMODINIT_FUNC PyInit__hotpath(void)
{
#define INTERN(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(sl_skip.name, "skip");
    INTERN(sl_gpu.name, "gpu");
    INTERN(s_enter, "enter");
    INTERN(s_new_proc, "new_proc");
    INTERN(s_max_ts, "max_ts");
    INTERN(s_evict_open, "evict_open");
    INTERN(s_expected, "_expected");
    INTERN(s_flush_group, "flush_group");
    INTERN(s_popitem, "popitem");
    INTERN(sl_job.name, "job");
    INTERN(sl_track.name, "track");
    INTERN(s_proc_track, "proc_track");
    INTERN(sl_calls.name, "calls");
    INTERN(sl_worker.name, "worker");
    INTERN(sl_tracks.name, "tracks");
    INTERN(sl_last_ts.name, "last_ts");
    INTERN(s_pick, "pick");
    INTERN(sl_declared.name, "declared");
    INTERN(s_declare, "declare");
    INTERN(s_group, "group");
    INTERN(s_gp, "gp");
    INTERN(s_rank, "rank");
    INTERN(sl_out.name, "out");
    INTERN(s_started, "started");
    INTERN(s_buf, "buf");
    INTERN(s_flush, "flush");
    INTERN(s_stats, "stats");
    INTERN(s_bad_events, "bad_events");
#undef INTERN
    if ((i_two = PyLong_FromLong(2)) == NULL)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && (PyModule_AddIntConstant(mod, "VERSION", HOTPATH_VERSION) < 0 ||
                        PyModule_AddStringConstant(mod, "SOURCE_SHA256", HOTPATH_SOURCE_SHA256) < 0))
        Py_CLEAR(mod);
    return mod;
}
