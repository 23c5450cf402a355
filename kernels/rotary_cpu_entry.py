"""The compiled CPU rotary kernel's call as one CPython function (an extension module built from ``ENTRY_SOURCE``).

Why. Inside a model, a decoding step's rotary call spent ~20 of its ~30 µs per layer in the Python around the C
kernel (``RotaryPlan.try_call`` and the module's plan checks: a few hundred bytecodes, each slowed by the caches the
layer's weights evicted), which kept GLA and Gated DeltaNet decoding at ~1.09× NoPE's time per token (issue 21,
docs/cpu_performance.md, "Sixth round"). The same checks, allocations and call written in C take ~4 % off a GLA
step at hidden 256 (~1.05× NoPE).

What. ``call(spec, x, q, k, state, lengths, overwrite_state)`` is ``kernels/rotary.py``'s ``cpu_kernel_call``
for the common case: it checks what the Python path checks (no autograd or tracing, no global or phase-module hooks,
the planned modules, parameters and storages unchanged, plain CPU tensors of the planned shapes and dtypes, a float64
state, int64 lengths), allocates the outputs, calls the kernel through its address (the ctypes library's, so both
paths run the same machine code) and returns ``(q, k, state)``. For anything else it returns ``None`` and the
Python path takes the call (and converts, plans again, raises the precise error or runs PyTorch): the entry adds no
behaviour, so its results are the Python path's bit for bit (tests: ``tests/kernels/test_rotary_cpu_entry.py``).

Where. It needs Python's C headers (``sysconfig``'s include directory with ``Python.h``; the ``python3-dev``
package of a system Python), a Python with a GIL, and the compiler the kernel uses. Without them the kernel is called
through ``ctypes`` as before, ~4 % slower per decoding step, without a warning (nothing else changes); a failed build
warns once. It is built on first use into the kernel's cache (``rotary_cpu.cache_dir``), by
``rotary_cpu.compile_cached``: the same atomic, never-remove-what-it-did-not-create rules.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import sysconfig
import threading
import warnings
from pathlib import Path

import torch

from .rotary_cpu import RotaryPlan, cache_dir, compile_cached, find_compiler, load_kernel

MODULE_NAME = "_selective_rope_entry"  # PyInit_ in ENTRY_SOURCE

ENTRY_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*kernel_fn)(const void *parameters, const int64_t *call);

enum { F32 = 0, F64 = 1, BF16 = 2 };

/* Set once by init(): torch's objects and interned names. */
static PyObject *tensor_type, *float32, *float64, *bfloat16, *int64, *strided, *empty, *is_grad_enabled, *is_tracing,
    *get_num_threads, *hooks_module;
static PyObject *s_shape, *s_dtype, *s_is_cpu, *s_layout, *s_is_neg, *s_stride, *s_data_ptr, *s_forward_hooks,
    *s_forward_pre_hooks, *s_global_forward_hooks, *s_global_forward_pre_hooks, *s_phase, *s_phase_conv, *s_cpu,
    *empty_kwnames;
static long long step_calls, prefill_calls;  /* calls served, single-token and longer (read by tests) */

/* What a call needs of one tensor. */
typedef struct {
    int64_t pointer, ndim, shape[4], stride[4];
    PyObject *dtype;  /* borrowed: dtypes are singletons */
} Meta;

/* 1 if the Python object is true, 0 if false, -1 on error. */
static int truth(PyObject *callable) {
    PyObject *value = PyObject_CallNoArgs(callable);
    if (!value) return -1;
    int result = PyObject_IsTrue(value);
    Py_DECREF(value);
    return result;
}

static int int64_item(PyObject *tuple, Py_ssize_t i, int64_t *out) {
    *out = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int read_ints(PyObject *tuple, int64_t *out, Py_ssize_t max, int64_t *count) {
    if (!tuple || !PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > max) return -1;
    *count = PyTuple_GET_SIZE(tuple);
    for (Py_ssize_t i = 0; i < *count; i++)
        if (int64_item(tuple, i, &out[i])) return -1;
    return 0;
}

static int64_t data_ptr(PyObject *tensor) {
    PyObject *value = PyObject_CallMethodNoArgs(tensor, s_data_ptr);
    if (!value) return -1;
    int64_t pointer = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return pointer;
}

/* A plain CPU tensor's pointer, shape, strides and dtype: 0, or -1 where it is anything else (as
   rotary_cpu.readable: a subclass, another device, a layout without strides, a lazily negated view, no memory; or
   more than 4 dims, an error). The callers accept real dtypes only: no conjugation bit. */
static int meta(PyObject *tensor, Meta *m) {
    if (Py_TYPE(tensor) != (PyTypeObject *)tensor_type) return -1;
    PyObject *is_cpu = PyObject_GetAttr(tensor, s_is_cpu);
    if (!is_cpu) return -1;
    int cpu = is_cpu == Py_True;
    Py_DECREF(is_cpu);
    PyObject *layout = cpu ? PyObject_GetAttr(tensor, s_layout) : NULL;
    if (!layout) return -1;
    int plain = layout == strided;
    Py_DECREF(layout);
    PyObject *is_neg = plain ? PyObject_CallMethodNoArgs(tensor, s_is_neg) : NULL;
    if (!is_neg) return -1;
    plain = is_neg == Py_False;
    Py_DECREF(is_neg);
    PyObject *dtype = plain ? PyObject_GetAttr(tensor, s_dtype) : NULL;
    if (!dtype) return -1;
    m->dtype = dtype;
    Py_DECREF(dtype);
    PyObject *shape = PyObject_GetAttr(tensor, s_shape);
    int status = read_ints(shape, m->shape, 4, &m->ndim);
    Py_XDECREF(shape);
    if (status) return -1;
    PyObject *stride = PyObject_CallMethodNoArgs(tensor, s_stride);
    int64_t count = -1;
    status = read_ints(stride, m->stride, 4, &count);
    Py_XDECREF(stride);
    if (status || count != m->ndim) return -1;
    m->pointer = data_ptr(tensor);
    return m->pointer == 0 || (m->pointer == -1 && PyErr_Occurred()) ? -1 : 0;  /* 0: no memory (a zero tensor) */
}

static int has_shape(const Meta *m, int64_t ndim, const int64_t *shape) {
    if (m->ndim != ndim) return 0;
    for (int64_t i = 0; i < ndim; i++)
        if (m->shape[i] != shape[i]) return 0;
    return 1;
}

/* torch's default-format contiguity: an empty tensor is contiguous, dims of size 1 may have any stride. */
static int contiguous(const Meta *m) {
    for (int64_t i = 0; i < m->ndim; i++)
        if (m->shape[i] == 0) return 1;
    int64_t expected = 1;
    for (int64_t i = m->ndim - 1; i >= 0; i--) {
        if (m->shape[i] == 1) continue;
        if (m->stride[i] != expected) return 0;
        expected *= m->shape[i];
    }
    return 1;
}

static int dtype_code(PyObject *dtype) {
    return dtype == float32 ? F32 : dtype == float64 ? F64 : dtype == bfloat16 ? BF16 : -1;
}

/* torch.empty(shape, dtype=dtype) and its pointer. */
static PyObject *new_tensor(int64_t ndim, const int64_t *shape, PyObject *dtype, int64_t *pointer) {
    PyObject *size = PyTuple_New(ndim);
    if (!size) return NULL;
    for (int64_t i = 0; i < ndim; i++) {
        PyObject *item = PyLong_FromLongLong(shape[i]);
        if (!item) { Py_DECREF(size); return NULL; }
        PyTuple_SET_ITEM(size, i, item);
    }
    PyObject *args[3] = {size, dtype, s_cpu};  /* the device named: a default device set by the user is not ours */
    PyObject *tensor = PyObject_Vectorcall(empty, args, 1, empty_kwnames);
    Py_DECREF(size);
    if (tensor && (*pointer = data_ptr(tensor)) == -1 && PyErr_Occurred()) Py_CLEAR(tensor);
    return tensor;
}

static int is_tuple_of(PyObject *tuple, Py_ssize_t size) {
    return PyTuple_CheckExact(tuple) && (size < 0 || PyTuple_GET_SIZE(tuple) == size);
}

/* 1 if the object's hook dict `name` is empty, 0 if not, -1 on error. */
static int no_hooks(PyObject *owner, PyObject *name) {
    PyObject *hooks = PyObject_GetAttr(owner, name);
    if (!hooks) return -1;
    Py_ssize_t size = PyObject_Length(hooks);
    Py_DECREF(hooks);
    return size < 0 ? -1 : size == 0;
}

/* Whether the plan still describes the module (rotary.CachedPlan.valid and plan_if_unhooked, RotaryPlan.current, and no
   global module hooks, as the Python path checks): 1 yes, 0 no, -1 an error (a malformed spec included). */
static int plan_holds(PyObject *tensors, PyObject *pointers, PyObject *bindings, PyObject *counts,
                      PyObject *modules) {
    if (!is_tuple_of(tensors, -1) || !is_tuple_of(pointers, PyTuple_GET_SIZE(tensors)) || !is_tuple_of(bindings, -1)
        || !is_tuple_of(counts, -1) || !is_tuple_of(modules, -1)) {
        PyErr_SetString(PyExc_TypeError, "malformed rotary entry spec");
        return -1;
    }
    int status;
    if ((status = no_hooks(hooks_module, s_global_forward_hooks)) != 1) return status;
    if ((status = no_hooks(hooks_module, s_global_forward_pre_hooks)) != 1) return status;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bindings); i++) {
        PyObject *binding = PyTuple_GET_ITEM(bindings, i);  /* (container, key, item) */
        if (!is_tuple_of(binding, 3) || !PyDict_Check(PyTuple_GET_ITEM(binding, 0))) {
            PyErr_SetString(PyExc_TypeError, "malformed rotary entry spec");
            return -1;
        }
        PyObject *item = PyDict_GetItemWithError(PyTuple_GET_ITEM(binding, 0), PyTuple_GET_ITEM(binding, 1));
        if (item != PyTuple_GET_ITEM(binding, 2)) return PyErr_Occurred() ? -1 : 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(counts); i++) {
        PyObject *pair = PyTuple_GET_ITEM(counts, i);  /* (container, number of entries) */
        int64_t count;
        if (!is_tuple_of(pair, 2) || !PyDict_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "malformed rotary entry spec");
            return -1;
        }
        if (int64_item(pair, 1, &count)) return -1;
        if (PyDict_Size(PyTuple_GET_ITEM(pair, 0)) != count) return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(modules); i++) {
        if ((status = no_hooks(PyTuple_GET_ITEM(modules, i), s_forward_hooks)) != 1) return status;
        if ((status = no_hooks(PyTuple_GET_ITEM(modules, i), s_forward_pre_hooks)) != 1) return status;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
        int64_t pointer = data_ptr(PyTuple_GET_ITEM(tensors, i)), planned;
        if ((pointer == -1 && PyErr_Occurred()) || int64_item(pointers, i, &planned)) return -1;
        if (pointer != planned) return 0;
    }
    return 1;
}

/* The spec (built by entry_for): kernel address, parameters address, Hq, Hk, D, R, hidden, K-1,
   has_conv, parameter tensors, their pointers, bindings, counts, phase modules, and the plan (kept alive). */
enum { SPEC_KERNEL, SPEC_PARAMETERS, SPEC_SIZES, SPEC_HAS_CONV = SPEC_SIZES + 6, SPEC_TENSORS, SPEC_POINTERS,
       SPEC_BINDINGS, SPEC_COUNTS, SPEC_MODULES, SPEC_PLAN, SPEC_LENGTH };

/* A call the checks accepted: what the kernel gets. */
typedef struct {
    int64_t kernel, parameters, hq, hk, d, r, hidden, past, has_conv, batch, seq_len;
    int x_code, qk_code;
    Meta x, q, k, phase, history, lengths;
    PyObject *phase_tensor, *history_tensor, *lengths_tensor;  /* borrowed; NULL: none */
} Call;

/* The checks: 0 if the call is the entry's to make, -1 if not (the Python path then takes it; a Python error met
   on the way is left set, and the caller clears it). */
static int check(PyObject *spec, PyObject *x, PyObject *q, PyObject *k, PyObject *state, PyObject *lengths,
                 Call *c) {
    int64_t sizes[6];
    if (int64_item(spec, SPEC_KERNEL, &c->kernel) || int64_item(spec, SPEC_PARAMETERS, &c->parameters) ||
        int64_item(spec, SPEC_HAS_CONV, &c->has_conv))
        return -1;
    for (int i = 0; i < 6; i++)
        if (int64_item(spec, SPEC_SIZES + i, &sizes[i])) return -1;
    c->hq = sizes[0], c->hk = sizes[1], c->d = sizes[2], c->r = sizes[3], c->hidden = sizes[4], c->past = sizes[5];
    if (truth(is_grad_enabled) != 0 || truth(is_tracing) != 0) return -1;  /* autograd and tracers: the torch path */
    if (plan_holds(PyTuple_GET_ITEM(spec, SPEC_TENSORS), PyTuple_GET_ITEM(spec, SPEC_POINTERS),
                   PyTuple_GET_ITEM(spec, SPEC_BINDINGS), PyTuple_GET_ITEM(spec, SPEC_COUNTS),
                   PyTuple_GET_ITEM(spec, SPEC_MODULES)) != 1)
        return -1;
    if (meta(x, &c->x) || meta(q, &c->q) || meta(k, &c->k)) return -1;
    c->batch = c->q.shape[0], c->seq_len = c->q.shape[1];
    c->x_code = dtype_code(c->x.dtype), c->qk_code = dtype_code(c->q.dtype);
    const int64_t q_shape[4] = {c->batch, c->seq_len, c->hq, c->d}, k_shape[4] = {c->batch, c->seq_len, c->hk, c->d},
                  x_shape[3] = {c->batch, c->seq_len, c->hidden};
    if (c->x_code < 0 || c->qk_code < 0 || c->k.dtype != c->q.dtype || !has_shape(&c->q, 4, q_shape) ||
        !has_shape(&c->k, 4, k_shape) || !has_shape(&c->x, 3, x_shape) || c->seq_len == 0 || c->x.stride[2] != 1 ||
        c->q.stride[3] != 1 || c->k.stride[3] != 1)
        return -1;
    PyObject *phase = NULL, *history = NULL;
    if (state != Py_None) {
        if (!PyDict_CheckExact(state)) return -1;
        phase = PyDict_GetItemWithError(state, s_phase);
        history = c->has_conv && !PyErr_Occurred() ? PyDict_GetItemWithError(state, s_phase_conv) : NULL;
        if (PyErr_Occurred()) return -1;
    }
    c->phase_tensor = phase == Py_None ? NULL : phase;
    c->history_tensor = history == Py_None ? NULL : history;
    c->lengths_tensor = lengths == Py_None ? NULL : lengths;
    const int64_t phase_shape[3] = {c->batch, c->hk, c->r}, history_shape[3] = {c->batch, c->past, c->hk * c->r};
    if (c->phase_tensor && (meta(c->phase_tensor, &c->phase) || c->phase.dtype != float64 ||
                            !has_shape(&c->phase, 3, phase_shape)))
        return -1;
    if (c->history_tensor && (meta(c->history_tensor, &c->history) || c->history.dtype != float64 ||
                              !has_shape(&c->history, 3, history_shape) || !contiguous(&c->history)))
        return -1;
    if (c->lengths_tensor && (meta(c->lengths_tensor, &c->lengths) || c->lengths.dtype != int64 ||
                              !has_shape(&c->lengths, 1, &c->batch) || !contiguous(&c->lengths)))
        return -1;
    return 0;
}

/* The accepted call: new outputs (the state overwritten where asked and possible), the kernel, the result. */
static PyObject *run(const Call *c, int overwrite) {
    PyObject *q_out = NULL, *k_out = NULL, *new_phase = NULL, *new_history = NULL, *new_state = NULL;
    int64_t q_out_pointer = 0, k_out_pointer = 0, new_phase_pointer = 0, new_history_pointer = 0, threads = 1;
    const int64_t q_shape[4] = {c->batch, c->seq_len, c->hq, c->d}, k_shape[4] = {c->batch, c->seq_len, c->hk, c->d},
                  phase_shape[3] = {c->batch, c->hk, c->r}, history_shape[3] = {c->batch, c->past, c->hk * c->r};
    if (!(q_out = new_tensor(4, q_shape, c->q.dtype, &q_out_pointer))) goto fail;
    if (!(k_out = new_tensor(4, k_shape, c->q.dtype, &k_out_pointer))) goto fail;
    if (overwrite && c->phase_tensor && contiguous(&c->phase)) {  /* the kernel reads a row's old state first */
        new_phase = Py_NewRef(c->phase_tensor);
        new_phase_pointer = c->phase.pointer;
    } else if (!(new_phase = new_tensor(3, phase_shape, float64, &new_phase_pointer))) goto fail;
    if (c->has_conv && overwrite && c->history_tensor) {
        new_history = Py_NewRef(c->history_tensor);
        new_history_pointer = c->history.pointer;
    } else if (c->has_conv && !(new_history = new_tensor(3, history_shape, float64, &new_history_pointer))) goto fail;
    if (c->seq_len > 1) {
        PyObject *value = PyObject_CallNoArgs(get_num_threads);
        if (!value) goto fail;
        threads = PyLong_AsLongLong(value);
        Py_DECREF(value);
        if (threads == -1 && PyErr_Occurred()) goto fail;
    }
    const int64_t call[26] = {  /* the order selective_rope_rotary reads */
        c->batch, c->seq_len, c->x.pointer, c->x_code, c->x.stride[0], c->x.stride[1], c->q.pointer, c->k.pointer,
        c->qk_code, c->q.stride[0], c->q.stride[1], c->q.stride[2], c->k.stride[0], c->k.stride[1], c->k.stride[2],
        q_out_pointer, k_out_pointer, c->phase_tensor ? c->phase.pointer : 0, c->phase_tensor ? c->phase.stride[0] : 0,
        c->phase_tensor ? c->phase.stride[1] : 0, c->phase_tensor ? c->phase.stride[2] : 0, new_phase_pointer,
        c->history_tensor ? c->history.pointer : 0, new_history_pointer,
        c->lengths_tensor ? c->lengths.pointer : 0, threads};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = ((kernel_fn)(intptr_t)c->kernel)((const void *)(intptr_t)c->parameters, call);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_SetString(PyExc_MemoryError, "the compiled CPU rotary kernel could not allocate its scratch memory");
        goto fail;
    }
    if (!(new_state = PyDict_New()) || PyDict_SetItem(new_state, s_phase, new_phase) ||
        (new_history && PyDict_SetItem(new_state, s_phase_conv, new_history)))
        goto fail;
    if (c->seq_len == 1) step_calls++; else prefill_calls++;
    PyObject *result = PyTuple_Pack(3, q_out, k_out, new_state);
    Py_DECREF(q_out); Py_DECREF(k_out); Py_DECREF(new_phase); Py_XDECREF(new_history); Py_DECREF(new_state);
    return result;
fail:
    Py_XDECREF(q_out); Py_XDECREF(k_out); Py_XDECREF(new_phase); Py_XDECREF(new_history); Py_XDECREF(new_state);
    return NULL;
}

/* call(spec, x, q, k, state, lengths, overwrite_state) -> (q, k, state), or None where the Python path must run. */
static PyObject *entry_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != SPEC_LENGTH) {
        PyErr_SetString(PyExc_TypeError, "call(spec, x, q, k, state, lengths, overwrite_state) with an entry_spec");
        return NULL;
    }
    int overwrite = PyObject_IsTrue(args[6]);
    if (overwrite < 0) return NULL;
    Call c;
    if (check(args[0], args[1], args[2], args[3], args[4], args[5], &c)) {
        PyErr_Clear();  /* the Python path meets the same error, or declines, or converts */
        Py_RETURN_NONE;
    }
    return run(&c, overwrite);
}

/* init(torch.Tensor, float32, float64, bfloat16, int64, torch.strided, torch.empty, torch.is_grad_enabled,
   torch._C._is_tracing, torch.get_num_threads, torch.nn.modules.module) */
static PyObject *entry_init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyObject **slots[] = {&tensor_type, &float32, &float64, &bfloat16, &int64, &strided, &empty, &is_grad_enabled,
                          &is_tracing, &get_num_threads, &hooks_module};
    if (nargs != (Py_ssize_t)(sizeof slots / sizeof *slots)) {
        PyErr_SetString(PyExc_TypeError, "init: wrong number of arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) Py_XSETREF(*slots[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

static PyObject *entry_counts(PyObject *self, PyObject *unused) {
    (void)self; (void)unused;
    return Py_BuildValue("(LL)", step_calls, prefill_calls);
}

static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))entry_call, METH_FASTCALL, "the rotary module's inference call"},
    {"init", (PyCFunction)(void (*)(void))entry_init, METH_FASTCALL, "torch's objects the calls use"},
    {"counts", entry_counts, METH_NOARGS, "(single-token calls, longer calls) served"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, "_selective_rope_entry", NULL, -1, methods, NULL, NULL,
                                        NULL, NULL};

PyMODINIT_FUNC PyInit__selective_rope_entry(void) {
    PyObject **names[] = {&s_shape, &s_dtype, &s_is_cpu, &s_layout, &s_is_neg, &s_stride, &s_data_ptr, &s_forward_hooks,
                          &s_forward_pre_hooks, &s_global_forward_hooks, &s_global_forward_pre_hooks, &s_phase,
                          &s_phase_conv, &s_cpu};
    const char *texts[] = {"shape", "dtype", "is_cpu", "layout", "is_neg", "stride", "data_ptr", "_forward_hooks",
                           "_forward_pre_hooks", "_global_forward_hooks", "_global_forward_pre_hooks", "phase",
                           "phase_conv", "cpu"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!(*names[i] = PyUnicode_InternFromString(texts[i]))) return NULL;
    if (!(empty_kwnames = Py_BuildValue("(ss)", "dtype", "device"))) return NULL;
    return PyModule_Create(&definition);
}
"""

_FLAGS = ["-O2", "-shared", "-fPIC", "-std=c11"]
if sys.platform == "darwin":  # an extension's Python symbols resolve against the interpreter that loads it
    _FLAGS += ["-undefined", "dynamic_lookup"]

_lock = threading.Lock()
_entry = None  # the extension's `call`, False once it cannot be had, None before the first try
_extension = None  # the loaded extension module (its `counts`)


def python_include() -> Path | None:
    """The directory holding ``Python.h`` for this interpreter, or ``None`` (no development headers installed, or a
    free-threaded build: the entry relies on the GIL, and importing it there would turn the GIL back on)."""
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    include = sysconfig.get_paths().get("include")
    return Path(include) if include and (Path(include) / "Python.h").is_file() else None


def build_entry(directory: Path, compiler: list[str] | str, include: Path) -> Path:
    """Compile ``ENTRY_SOURCE`` against the headers in ``include`` into ``directory`` (reused when built before) and
    return the extension's path; raises as ``rotary_cpu.build``."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"  # with the interpreter's ABI tag: a file per Python
    return compile_cached(directory, compiler, ENTRY_SOURCE, "entry", suffix,
                          [*_FLAGS, f"-I{include}"], [[]], [])


def load_entry():
    """The extension's ``call`` function, building it on first use; ``None`` where it cannot be had (no compiled
    kernel, no Python headers, a failed build: one warning for a failed build only)."""
    global _entry, _extension
    if _entry is not None:
        return _entry or None
    with _lock:
        if _entry is None:
            _entry = False
            include, compiler = python_include(), find_compiler()
            if include is not None and compiler is not None and load_kernel() is not None:
                try:
                    path = build_entry(cache_dir(), compiler, include)
                    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
                    module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                    module.init(torch.Tensor, torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                torch.strided, torch.empty, torch.is_grad_enabled, torch._C._is_tracing,
                                torch.get_num_threads, torch.nn.modules.module)
                    _entry, _extension = module.call, module
                except (OSError, RuntimeError, ImportError, AttributeError) as error:
                    warnings.warn(f"Selective RoPE's CPython entry to its compiled CPU kernel is unavailable, so "
                                  f"the kernel is called through ctypes (~4 % slower per decoding step) ({error}).",
                                  RuntimeWarning, stacklevel=2)
    return _entry or None


def entry_for(plan: RotaryPlan, bindings: tuple, counts: tuple, modules: tuple) -> tuple | None:
    """``(call, spec)`` for ``plan``: ``call(spec, x, q, k, state, lengths, overwrite_state)`` serves the module's
    calls; ``None`` without the entry. ``bindings`` ``((container, key, item), ...)``, ``counts`` ``((container,
    len), ...)`` and ``modules`` (the phase modules, whose hooks are checked) as ``rotary.CachedPlan`` keeps them."""
    call, kernel = load_entry(), load_kernel()
    if call is None or kernel is None:
        return None
    address = ctypes.cast(kernel, ctypes.c_void_p).value
    spec = (address, ctypes.addressof(plan.parameters), *plan.sizes, int(plan.has_conv), plan.tensors, plan.pointers,
            tuple(bindings), tuple(counts), tuple(modules), (plan, kernel))  # the last keeps both alive
    return call, spec


def served() -> tuple[int, int]:
    """``(single-token calls, longer calls)`` the entry has served in this process (for tests)."""
    return _extension.counts() if _extension is not None else (0, 0)
