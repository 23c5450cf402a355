"""Selective RoPE's single-token decoding step as one small C function, for the CPU.

Why C. A decoding step of Selective RoPE is ~60 PyTorch ops per layer and token on vectors of a few dozen numbers
(normalise, two projections, convolution, bias, gate, angles, cos/sin, rotation), and RoPE's ~30. Each op costs its
dispatch, not its arithmetic, and inside a model every layer streams its weights through the caches between two such
steps, which makes each dispatch several times slower than in a loop (docs/cpu_performance.md). Measured on the
issue-21 benchmark model (one thread, 256 cached tokens), these ops made Selective RoPE FoX decode at 1.39× Llama's
time per token and the plain RoPE port at 1.13×; with the rotation removed, 1.05× and 0.99×. Fewer PyTorch ops,
NumPy and ``torch.compile`` (a 26 s compile per shape) did not close that gap; one compiled call does.

How. The C source below (``C_SOURCE``, a string so that it travels with a saved model's remote code, which carries
only ``.py`` files) is compiled on first use by the system's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``; 0.2–0.4 s, once) into a shared library cached under ``$SELECTIVE_ROPE_CACHE`` (default
``~/.cache/selective_rope``), named by a hash of the source and the compiler, and called through ``ctypes``. No
compiler, a failed build or an unwritable cache leave the PyTorch step in charge, with one warning
(``SELECTIVE_ROPE_CPU_KERNEL=0`` turns the kernel off without one). It serves the ``"auto"`` backend (the default);
``backend="torch"`` asked for by name stays pure PyTorch, the reference. Writing the cache never touches a file it did
not create: the library is built under a fresh temporary name and renamed into place (atomic; two processes
building at once each rename a complete file).

Math: exactly ``SelectiveRotaryEmbedding``'s single-token torch step (``modeling/rotary.py``), in the same
precisions: the phase path in float64 from the parameters' values, the increment rounded once to float32, the phase
summed in float64, each angle reduced modulo 2π in float64 (in turns, as ``rotary_torch.rotary_angles``), cos/sin
and the rotation in float32 (compiled with ``-ffp-contract=off``: no fused multiply-adds, so the rotation rounds as
PyTorch's does). q, k and the mixer input may be float32, float64 or bfloat16, the parameters float32 or float64.
Float64 sums run in a different order than PyTorch's (``bmm``, ``norm``), so results agree to rounding, which the
float32 increment absorbs almost always (tests: ``tests/kernels/test_rotary_cpu.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

ENV_SWITCH = "SELECTIVE_ROPE_CPU_KERNEL"  # "0" turns the C step off
CACHE_ENV = "SELECTIVE_ROPE_CACHE"

# dtype codes shared with the C source
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
PROJECTIONS = {None: 0, "low_rank": 1, "full_rank": 2, "scalar": 3, "dense_low_rank": 4}  # None: RoPE (increment 1)
CONVOLUTIONS = {None: 0, "learned": 1, "difference": 2}

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, F64 = 1, BF16 = 2 };
enum { PROJ_ONE = 0, PROJ_LOW_RANK = 1, PROJ_FULL_RANK = 2, PROJ_SCALAR = 3, PROJ_DENSE_LOW_RANK = 4 };
enum { CONV_NONE = 0, CONV_LEARNED = 1, CONV_DIFFERENCE = 2 };

static const double TWO_PI = 6.283185307179586;

static inline double load(const void *p, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)p)[i];
    if (dtype == F64) return ((const double *)p)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;  /* bfloat16: the high half of a float32 */
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void store(void *p, int dtype, int64_t i, float v) {
    if (dtype == F32) { ((float *)p)[i] = v; return; }
    if (dtype == F64) { ((double *)p)[i] = v; return; }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { ((uint16_t *)p)[i] = (uint16_t)((bits >> 16) | 0x40u); return; }
    bits += 0x7fffu + ((bits >> 16) & 1u);  /* round to nearest even, as c10::BFloat16 */
    ((uint16_t *)p)[i] = (uint16_t)(bits >> 16);
}

/* sum_i w[i] * x[i] in float64 over weights of dtype wd, in four running sums: one sum would wait on each addition's
   latency (4 cycles), and the order of a float64 sum is not PyTorch's anyway (its bmm blocks its own way). */
static double dot(const void *w, int wd, const double *x, int64_t n) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = 0;
    if (wd == F32) {
        const float *v = w;
        for (; i + 4 <= n; i += 4) {
            s0 += v[i] * x[i]; s1 += v[i + 1] * x[i + 1]; s2 += v[i + 2] * x[i + 2]; s3 += v[i + 3] * x[i + 3];
        }
    } else {
        const double *v = w;
        for (; i + 4 <= n; i += 4) {
            s0 += v[i] * x[i]; s1 += v[i + 1] * x[i + 1]; s2 += v[i + 2] * x[i + 2]; s3 += v[i + 3] * x[i + 3];
        }
    }
    for (; i < n; i++) s0 += load(w, wd, i) * x[i];
    return (s0 + s1) + (s2 + s3);
}

/* y[o] = w[o] . x (+ b[o]) for the rows of w (out, in) starting at element `offset`. */
static void matvec(const void *w, int wd, int64_t offset, const double *x, int64_t in, int64_t out,
                   const void *b, double *y) {
    const size_t element = wd == F32 ? sizeof(float) : sizeof(double);
    for (int64_t o = 0; o < out; o++) {
        const double acc = dot((const char *)w + (size_t)(offset + o * in) * element, wd, x, in);
        y[o] = b ? acc + load(b, wd, o) : acc;
    }
}

static inline double sigmoid(double z) { return 1.0 / (1.0 + exp(-z)); }
static inline double silu(double z) { return z / (1.0 + exp(-z)); }

/* P(u) for one row: c (Hk*R) from the normalised input u (Hk*Dc); scratch holds max(rank, 1) doubles. */
static void project(int kind, const void *pa, const void *pb, int wd, int64_t rank, int64_t hk, int64_t dc,
                    int64_t r, const double *u, double *scratch, double *c) {
    if (kind == PROJ_LOW_RANK) {  /* per head: up_h (R, rank) @ down_h (rank, Dc) @ u_h */
        for (int64_t h = 0; h < hk; h++) {
            matvec(pa, wd, h * rank * dc, u + h * dc, dc, rank, NULL, scratch);
            matvec(pb, wd, h * r * rank, scratch, rank, r, NULL, c + h * r);
        }
    } else if (kind == PROJ_DENSE_LOW_RANK) {  /* up (Hk*R, rank) @ down (rank, Hk*Dc) @ u */
        matvec(pa, wd, 0, u, hk * dc, rank, NULL, scratch);
        matvec(pb, wd, 0, scratch, rank, hk * r, NULL, c);
    } else if (kind == PROJ_FULL_RANK) {  /* per head and frequency: scale * (w / max(|w|, 1e-12)) . u_h */
        for (int64_t h = 0; h < hk; h++) {
            for (int64_t i = 0; i < r; i++) {
                const int64_t row = (h * r + i) * dc;
                double norm = 0.0, dot = 0.0;
                for (int64_t j = 0; j < dc; j++) {
                    const double w = load(pa, wd, row + j);
                    norm += w * w;
                    dot += w * u[h * dc + j];
                }
                norm = sqrt(norm);
                c[h * r + i] = load(pb, wd, h * r + i) * dot / (norm > 1e-12 ? norm : 1e-12);
            }
        }
    } else if (kind == PROJ_SCALAR) {  /* one value per head, shared by every frequency */
        for (int64_t h = 0; h < hk; h++) {
            matvec(pa, wd, h * dc, u + h * dc, dc, 1, NULL, scratch);
            for (int64_t i = 0; i < r; i++) c[h * r + i] = scratch[0];
        }
    }
}

/* What a layer's step reads that does not change between steps: sizes, options and the parameters (the Python
   wrapper's DecodeStepPlan fills it once; field order and types must match its _Parameters). */
typedef struct {
    int64_t num_query_heads, num_key_heads, head_dim, rotary_pairs, chunk_dim;
    int64_t param_dtype, projection, proj_rank, convolution, conv_size, conv_silu, gate_layers, gate_rank, gate_width;
    const void *temperature, *proj_a, *proj_b, *conv_taps, *bias, *gate_w1, *gate_b1, *gate_w2, *gate_b2;
} StepParameters;

int selective_rope_decode_step(
    const StepParameters *p, int64_t batch, const void *x, int64_t x_dtype, int64_t x_stride,
    const void *q, const void *k, int64_t qk_dtype, int64_t q_stride_b, int64_t q_stride_h, int64_t k_stride_b,
    int64_t k_stride_h, void *q_out, void *k_out, const double *phase, int64_t phase_stride_b,
    int64_t phase_stride_h, int64_t phase_stride_r, double *new_phase, const double *conv_state,
    double *new_conv_state, const uint8_t *valid) {
    const int64_t num_query_heads = p->num_query_heads, num_key_heads = p->num_key_heads, head_dim = p->head_dim;
    const int64_t rotary_pairs = p->rotary_pairs, chunk_dim = p->chunk_dim, proj_rank = p->proj_rank;
    const int64_t projection = p->projection, convolution = p->convolution, conv_size = p->conv_size;
    const int64_t gate_rank = p->gate_rank, gate_width = p->gate_width;
    const int param_dtype = (int)p->param_dtype, conv_silu = (int)p->conv_silu, gate_layers = (int)p->gate_layers;
    const void *temperature = p->temperature, *conv_taps = p->conv_taps, *bias = p->bias;
    const int64_t hk = num_key_heads, r = rotary_pairs, dc = chunk_dim, hidden = hk * dc, channels = hk * r;
    const int64_t groups = num_query_heads / num_key_heads, history = conv_size - 1;
    int64_t scratch_len = proj_rank > 1 ? proj_rank : 1;
    if (gate_rank > scratch_len) scratch_len = gate_rank;
    double *work = malloc(sizeof(double) * (size_t)(hidden + channels + gate_width + scratch_len));
    if (!work) return 1;
    double *u = work, *c = u + hidden, *gate = c + channels, *scratch = gate + gate_width;
    float *cos_sin = malloc(sizeof(float) * 2 * (size_t)channels);
    if (!cos_sin) { free(work); return 1; }

    for (int64_t b = 0; b < batch; b++) {
        const double keep = (valid && !valid[b]) ? 0.0 : 1.0;  /* 0 for a pad token */
        if (projection == PROJ_ONE) {  /* RoPE: c = 1 for a real token */
            for (int64_t i = 0; i < channels; i++) c[i] = keep;
        } else {
            for (int64_t h = 0; h < hk; h++) {  /* u_h = x_h / max(|x_h|, 1e-12) (F.normalize) */
                double norm = 0.0;
                for (int64_t j = 0; j < dc; j++) {
                    const double v = load(x, (int)x_dtype, b * x_stride + h * dc + j);
                    u[h * dc + j] = v;
                    norm += v * v;
                }
                norm = sqrt(norm);
                const double denominator = norm > 1e-12 ? norm : 1e-12;
                for (int64_t j = 0; j < dc; j++) u[h * dc + j] /= denominator;
            }
            project((int)projection, p->proj_a, p->proj_b, param_dtype, proj_rank, hk, dc, r, u, scratch, c);
            for (int64_t i = 0; i < channels; i++) c[i] *= keep;  /* pads never enter the history */
            if (convolution != CONV_NONE) {
                const double *old = conv_state ? conv_state + b * history * channels : NULL;
                double *out = new_conv_state + b * history * channels;
                for (int64_t i = 0; i < channels; i++) {
                    double y = 0.0;  /* the window oldest first, as causal_conv1d sums it */
                    for (int64_t j = 0; j < history; j++) {
                        const double tap = convolution == CONV_DIFFERENCE ? -1.0 : load(conv_taps, param_dtype,
                                                                                       i * conv_size + j);
                        y += (old ? old[j * channels + i] : 0.0) * tap;
                    }
                    const double last = convolution == CONV_DIFFERENCE ? 1.0 : load(conv_taps, param_dtype,
                                                                                   i * conv_size + history);
                    y += c[i] * last;
                    for (int64_t j = 0; j < history; j++) {  /* a pad keeps the history it had */
                        const double previous = old ? old[j * channels + i] : 0.0;
                        const double shifted = j + 1 < history ? (old ? old[(j + 1) * channels + i] : 0.0) : c[i];
                        out[j * channels + i] = keep != 0.0 ? shifted : previous;
                    }
                    c[i] = conv_silu ? silu(y) : y;
                }
            }
            if (bias)
                for (int64_t i = 0; i < channels; i++) c[i] += exp(load(bias, param_dtype, i));
            if (gate_layers > 0) {
                if (gate_layers == 1) {
                    matvec(p->gate_w1, param_dtype, 0, u, hidden, gate_width, p->gate_b1, gate);
                } else {
                    matvec(p->gate_w1, param_dtype, 0, u, hidden, gate_rank, p->gate_b1, scratch);
                    matvec(p->gate_w2, param_dtype, 0, scratch, gate_rank, gate_width, p->gate_b2, gate);
                }
                const int64_t per_head = gate_width == hk ? r : 1;  /* one gate per head, or per channel */
                for (int64_t i = 0; i < channels; i++) c[i] *= sigmoid(gate[i / per_head]);
            }
            for (int64_t i = 0; i < channels; i++) c[i] = (double)(float)(c[i] * keep);  /* rounded once */
        }
        for (int64_t h = 0; h < hk; h++) {
            for (int64_t i = 0; i < r; i++) {
                const int64_t at = b * channels + h * r + i;
                const int64_t cached = b * phase_stride_b + h * phase_stride_h + i * phase_stride_r;
                const double previous = phase ? phase[cached] : 0.0;
                const double theta = c[h * r + i] + previous;
                new_phase[at] = theta;
                const double t = theta * (load(temperature, param_dtype, i) / TWO_PI);
                const float angle = (float)(t - trunc(t)) * (float)TWO_PI;
                cos_sin[2 * (h * r + i)] = cosf(angle);
                cos_sin[2 * (h * r + i) + 1] = sinf(angle);
            }
        }
        for (int64_t head = 0; head < num_query_heads + hk; head++) {  /* query heads, then key heads */
            const int is_query = head < num_query_heads;
            const int64_t key_head = is_query ? head / groups : head - num_query_heads;
            const void *src = is_query ? q : k;
            void *dst = is_query ? q_out : k_out;
            const int64_t in = is_query ? b * q_stride_b + head * q_stride_h : b * k_stride_b + key_head * k_stride_h;
            const int64_t out = (is_query ? b * num_query_heads + head : b * hk + key_head) * head_dim;
            for (int64_t i = 0; i < r; i++) {
                const float x1 = (float)load(src, (int)qk_dtype, in + i);
                const float x2 = (float)load(src, (int)qk_dtype, in + r + i);
                const float cs = cos_sin[2 * (key_head * r + i)], sn = cos_sin[2 * (key_head * r + i) + 1];
                store(dst, (int)qk_dtype, out + i, x1 * cs - x2 * sn);
                store(dst, (int)qk_dtype, out + r + i, x1 * sn + x2 * cs);
            }
            for (int64_t i = 2 * r; i < head_dim; i++)  /* the rest passes through (in float32, as the torch step) */
                store(dst, (int)qk_dtype, out + i, (float)load(src, (int)qk_dtype, in + i));
        }
    }
    free(cos_sin);
    free(work);
    return 0;
}
"""


class _Parameters(ctypes.Structure):
    """``StepParameters`` in ``C_SOURCE``, field for field."""

    _fields_ = ([(name, ctypes.c_int64) for name in (
        "num_query_heads", "num_key_heads", "head_dim", "rotary_pairs", "chunk_dim", "param_dtype", "projection",
        "proj_rank", "convolution", "conv_size", "conv_silu", "gate_layers", "gate_rank", "gate_width")]
        + [(name, ctypes.c_void_p) for name in (
            "temperature", "proj_a", "proj_b", "conv_taps", "bias", "gate_w1", "gate_b1", "gate_w2", "gate_b2")])


_ARGTYPES = ([ctypes.POINTER(_Parameters), ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # x
             + [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2  # q, k, outputs
             + [ctypes.c_void_p] + [ctypes.c_int64] * 3  # phase and its strides
             + [ctypes.c_void_p] * 4)  # new phase, history, new history, valid
_FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-std=c99"]

_lock = threading.Lock()
_step = None  # the loaded C function, False once loading failed, None before the first try


def enabled() -> bool:
    """Whether the C step may run: not switched off by ``SELECTIVE_ROPE_CPU_KERNEL=0`` (read at every call)."""
    value = os.environ.get(ENV_SWITCH)
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where the compiled library is kept: ``$SELECTIVE_ROPE_CACHE``, else ``$XDG_CACHE_HOME/selective_rope``, else
    ``~/.cache/selective_rope``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "selective_rope"


def find_compiler() -> list[str] | None:
    """The compiler command: ``$CC`` if set (split as a shell would, e.g. ``ccache gcc``), else the first of ``cc``,
    ``gcc``, ``clang`` on the ``PATH``; ``None`` if there is none."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    return next(([path] for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def build(directory: Path, compiler: list[str] | str) -> Path:
    """Compile ``C_SOURCE`` with ``compiler`` (a command, e.g. ``find_compiler()``, or one program) into
    ``directory`` (created if missing) and return the library's path; a library built before from the same source,
    compiler and flags is reused. Raises ``OSError`` (e.g. an unwritable directory, no such compiler) or
    ``RuntimeError`` (the compiler failed; its output is in the message)."""
    command = [compiler] if isinstance(compiler, str) else list(compiler)
    key = hashlib.sha256("\0".join([C_SOURCE, *command, *_FLAGS, platform.machine()]).encode()).hexdigest()[:16]
    target = directory / f"rotary_decode_{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Fresh names for this build (mkstemp creates each file, so it is ours), in the cache directory itself so that the
    # final rename is atomic. Only these two files are ever removed, by the process that created them, and the library
    # only while it still has its temporary name.
    fd, source = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".c", dir=directory)
    partial, published = None, False
    try:
        with os.fdopen(fd, "w") as file:
            file.write(C_SOURCE)
        fd, partial = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=directory)
        os.close(fd)
        result = subprocess.run([*command, *_FLAGS, "-o", partial, source, "-lm"], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed with exit code {result.returncode}: "
                               f"{result.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)  # mkstemp made it 0600; a cache shared by several users must be readable
        os.replace(partial, target)
        published = True
    finally:
        if partial is not None and not published:  # (a failing compiler may have removed it already)
            Path(partial).unlink(missing_ok=True)
        Path(source).unlink(missing_ok=True)
    return target


def load_step():
    """The C function, building the library on first use; ``None`` (after one warning) if it cannot be had."""
    global _step
    if _step:
        return _step
    with _lock:
        if _step is None:
            compiler = find_compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C compiler found (set $CC, or install cc, gcc or clang)")
                function = ctypes.CDLL(str(build(cache_dir(), compiler))).selective_rope_decode_step
                function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
                _step = function
            # AttributeError: a library that loads but lacks our function
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
                _step = False
                warnings.warn(f"Selective RoPE's compiled CPU decoding step is unavailable, so decoding runs the "
                              f"slower PyTorch step ({error}). Set {ENV_SWITCH}=0 to silence this.", RuntimeWarning,
                              stacklevel=2)
    return _step or None


def available() -> bool:
    """Whether the C step can run here: enabled, and compiled (the first call builds it, or finds it cached)."""
    return enabled() and load_step() is not None


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class DecodeStepPlan:
    """One layer's compiled CPU decoding step, prepared once from its sizes and parameters, then called per step.

    Preparing validates everything that does not change between steps; a step (``try_step``) checks only its own
    tensors. The plan keeps references to the parameter tensors and reads them in place: it sees in-place updates,
    but a parameter whose storage is replaced (``param.data = ...``, ``module.to(...)``) needs a new plan
    (``current`` tells; ``try_step`` declines). Noticing a parameter or module swapped for another is the caller's
    job.

    Args:
        num_query_heads, num_key_heads, head_dim, hidden_size: ``Hq``, ``Hk``, ``D`` of q and k, and the width of
            the mixer input ``x`` (``Hk * Dc``).
        temperature: ``(R,)``, float32 or float64; every parameter below has its dtype.
        projection: ``None`` for RoPE (the increment is 1), else ``(kind, a, b)``: ``("low_rank", down (Hk, rank,
            Dc), up (Hk, R, rank))``, ``("dense_low_rank", down (rank, Hk*Dc), up (Hk*R, rank))``,
            ``("full_rank", weight (Hk, R, Dc), scale (Hk, R))`` or ``("scalar", weight (Hk, 1, Dc), None)``.
        conv: ``None``, ``("learned", weight (Hk*R, 1, K), activation)`` (the last tap on this token) or
            ``("difference", None, activation)`` (fixed taps ``(-1, 1)``); ``activation`` ``None`` or ``"silu"``.
        bias: ``(Hk, R)`` the raw phase bias ``b`` (``exp(b)`` is added), or ``None``.
        gate: the gate's linear layers ``((weight, bias), ...)``: none, one ``(Hk, Hk*Dc)`` with a bias, or
            ``(rank, Hk*Dc)`` without one and ``(Hk or Hk*R, rank)`` with one.
    """

    def __init__(self, num_query_heads: int, num_key_heads: int, head_dim: int, hidden_size: int,
                 temperature: torch.Tensor, *, projection: tuple | None = None, conv: tuple | None = None,
                 bias: torch.Tensor | None = None, gate: tuple = ()):
        rotary_pairs = temperature.shape[-1]
        heads, chunk_dim = num_key_heads, hidden_size // num_key_heads
        channels = heads * rotary_pairs
        if num_query_heads % heads or hidden_size % heads or 2 * rotary_pairs > head_dim or temperature.dim() != 1:
            raise ValueError(f"Hq={num_query_heads}, Hk={heads}, D={head_dim}, hidden={hidden_size} and "
                             f"R={rotary_pairs} disagree")
        kind, proj_a, proj_b = projection or (None, None, None)
        conv_kind, conv_weight, activation = conv or (None, None, None)
        if kind not in PROJECTIONS or conv_kind not in CONVOLUTIONS:
            raise ValueError(f"unknown projection {kind!r} or convolution {conv_kind!r}")
        if len(gate) > 2 or (len(gate) == 1 and gate[0][1] is None) or (len(gate) == 2 and gate[0][1] is not None):
            raise ValueError("gate: one linear layer with a bias, or two with a bias on the second only")
        if activation not in (None, "silu"):
            raise ValueError(f"unsupported activation {activation!r}; expected None or 'silu'")
        rank = proj_a.shape[-2] if kind in ("low_rank", "dense_low_rank") and proj_a is not None else 0
        conv_size = 2 if conv_kind == "difference" else 1 if conv_weight is None else conv_weight.shape[-1]
        gate_width = gate[-1][0].shape[0] if gate else 0
        gate_rank = gate[0][0].shape[0] if len(gate) == 2 else 0
        expected = {  # every parameter's shape, checked once: the C code trusts them
            "temperature": (temperature, (rotary_pairs,)),
            "projection a": (proj_a, {"low_rank": (heads, rank, chunk_dim), "dense_low_rank": (rank, hidden_size),
                                      "full_rank": (heads, rotary_pairs, chunk_dim),
                                      "scalar": (heads, 1, chunk_dim)}.get(kind)),
            "projection b": (proj_b, {"low_rank": (heads, rotary_pairs, rank), "full_rank": (heads, rotary_pairs),
                                      "dense_low_rank": (channels, rank)}.get(kind)),
            "convolution": (conv_weight, (channels, 1, conv_size) if conv_kind == "learned" else None),
            "bias": (bias, None if bias is None else (heads, rotary_pairs)),
            "gate": (gate[0][0] if gate else None, None if not gate else
                     (gate_width, hidden_size) if len(gate) == 1 else (gate_rank, hidden_size)),
            "gate bias": (gate[-1][1] if gate else None, (gate_width,) if gate else None),
            "gate second": (gate[1][0] if len(gate) == 2 else None,
                            (gate_width, gate_rank) if len(gate) == 2 else None),
        }
        if gate and gate_width not in (heads, channels):
            raise ValueError(f"the gate's width must be Hk ({heads}) or Hk*R ({channels}), not {gate_width}")
        dtype = temperature.dtype
        for name, (tensor, shape) in expected.items():
            if (tensor is None) != (shape is None):
                raise ValueError(f"{name}: {'missing' if tensor is None else 'unexpected'} for these options")
            if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device.type
                                       != "cpu" or not tensor.is_contiguous() or dtype not in (torch.float32,
                                                                                            torch.float64)):
                raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor of shape {shape} (float32 or "
                                 f"float64), got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        self.tensors = tuple(t for t, _ in expected.values() if t is not None)
        self.pointers = tuple(t.data_ptr() for t in self.tensors)
        self.sizes = (num_query_heads, heads, head_dim, rotary_pairs, hidden_size, conv_size - 1)
        (w1, b1), (w2, b2) = (list(gate) + [(None, None)] * 2)[:2]
        self.parameters = _Parameters(
            num_query_heads, heads, head_dim, rotary_pairs, chunk_dim, DTYPE_CODES[dtype], PROJECTIONS[kind], rank,
            CONVOLUTIONS[conv_kind], conv_size, activation == "silu", len(gate), gate_rank, gate_width,
            temperature.data_ptr(), _pointer(proj_a), _pointer(proj_b), _pointer(conv_weight), _pointer(bias),
            _pointer(w1), _pointer(b1), _pointer(w2), _pointer(b2))
        self.parameters_ref = ctypes.byref(self.parameters)
        self.has_conv = conv_kind is not None

    def current(self) -> bool:
        """Whether every parameter tensor still has the storage it had when planned."""
        for tensor, pointer in zip(self.tensors, self.pointers):
            if tensor.data_ptr() != pointer:
                return False
        return True

    def try_step(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, phase: torch.Tensor | None = None,
                 conv_state: torch.Tensor | None = None, valid: torch.Tensor | None = None):
        """One step for every row, or ``None`` where this plan does not take the call (the caller then runs its
        torch step): x, q or k not CPU tensors of a dtype it reads (float32, float64, bfloat16; q and k alike) with a
        contiguous last dim, a parameter's storage replaced since planning (``current``), or no compiled library.

        Args:
            x: ``(B, 1, hidden_size)`` the mixer input (read by Selective RoPE only); q: ``(B, 1, Hq, D)``;
                k: ``(B, 1, Hk, D)``.
            phase: ``(B, Hk, R)`` float64, the cached phase, any strides (e.g. RoPE's count of tokens expanded
                from ``(B, 1, 1)``; ``None``: zeros).
            conv_state: ``(B, K-1, Hk*R)`` float64 contiguous, the convolution's history, oldest first (``None``:
                zeros; ignored without convolution).
            valid: ``(B,)`` bool, False for a pad token (adds 0, keeps the history), or ``None``.

        Returns:
            Rotated q and k (new contiguous tensors, input dtype), the new phase ``(B, Hk, R)`` and the new history
            ``(B, K-1, Hk*R)`` (``None`` without convolution), float64. Raises ``ValueError`` for shapes or states
            that do not fit the plan.
        """
        qk_dtype, x_dtype = DTYPE_CODES.get(q.dtype), DTYPE_CODES.get(x.dtype)
        if (qk_dtype is None or x_dtype is None or k.dtype != q.dtype or not (x.is_cpu and q.is_cpu and k.is_cpu)
                or x.stride(-1) != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or not self.current()):
            return None
        step = load_step()
        if step is None:
            return None
        num_query_heads, num_key_heads, head_dim, rotary_pairs, hidden_size, history = self.sizes
        batch = q.shape[0]
        if (q.shape, k.shape, x.shape) != ((batch, 1, num_query_heads, head_dim),
                                           (batch, 1, num_key_heads, head_dim), (batch, 1, hidden_size)):
            raise ValueError(f"x {tuple(x.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}: this plan takes "
                             f"(B, 1, {hidden_size}), (B, 1, {num_query_heads}, {head_dim}) and "
                             f"(B, 1, {num_key_heads}, {head_dim})")
        conv_state = conv_state if self.has_conv else None
        phase_shape = (batch, num_key_heads, rotary_pairs)
        history_shape = (batch, history, num_key_heads * rotary_pairs)
        if phase is not None and (phase.shape != phase_shape or phase.dtype != torch.float64 or not phase.is_cpu):
            raise ValueError(f"phase must be a CPU float64 tensor of shape {phase_shape}")
        if conv_state is not None and (conv_state.shape != history_shape or conv_state.dtype != torch.float64
                                       or not conv_state.is_contiguous() or not conv_state.is_cpu):
            raise ValueError(f"conv_state must be a contiguous CPU float64 tensor of shape {history_shape}")
        if valid is not None and (valid.shape != (batch,) or valid.dtype != torch.bool or not valid.is_contiguous()):
            raise ValueError(f"valid must be a contiguous bool tensor of shape ({batch},)")

        q_out = torch.empty((batch, 1, num_query_heads, head_dim), dtype=q.dtype)
        k_out = torch.empty((batch, 1, num_key_heads, head_dim), dtype=q.dtype)
        new_phase = torch.empty((batch, num_key_heads, rotary_pairs), dtype=torch.float64)
        new_history = (torch.empty((batch, history, num_key_heads * rotary_pairs), dtype=torch.float64)
                       if self.has_conv else None)
        status = step(self.parameters_ref, batch, x.data_ptr(), x_dtype, x.stride(0), q.data_ptr(), k.data_ptr(),
                      qk_dtype, q.stride(0), q.stride(2), k.stride(0), k.stride(2), q_out.data_ptr(),
                      k_out.data_ptr(), *((None, 0, 0, 0) if phase is None else (phase.data_ptr(), *phase.stride())),
                      new_phase.data_ptr(), _pointer(conv_state),
                      _pointer(new_history), _pointer(valid))
        if status != 0:
            raise MemoryError("the compiled CPU decoding step could not allocate its scratch memory")
        return q_out, k_out, new_phase, new_history
