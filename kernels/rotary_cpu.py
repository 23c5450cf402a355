"""Selective RoPE's rotary module for inference on the CPU (prefills and decoding steps) as one C function.

Why C. A decoding step of Selective RoPE is ~60 PyTorch ops per layer and token on vectors of a few dozen numbers
(normalise, two projections, convolution, bias, gate, angles, cos/sin, rotation), and RoPE's ~30. Each op costs its
dispatch, not its arithmetic, and inside a model every layer streams its weights through the caches between two such
steps, which makes each dispatch several times slower than in a loop (docs/cpu_performance.md). Measured on the
issue-21 benchmark model (one thread, 256 cached tokens), these ops made Selective RoPE FoX decode at 1.39× Llama's
time per token and the plain RoPE port at 1.13×; with the rotation removed, 1.05× and 0.99×. A prefill of thousands
of tokens is the other way round: ~15 float64 passes over ``(T, Hk, R)`` tensors and float64 ``bmm`` with small inner
sizes (43–54 ms per layer at 8k tokens, GLA benchmark shape, one thread); one pass over the tokens, eight at a time
in vector registers, takes ~14 ms (~9.5 ms on two threads, against ~35 ms). Fewer PyTorch ops, NumPy and
``torch.compile`` (a 26 s compile per shape) did not close these gaps.

How. The C source below (``C_SOURCE``, a string so that it travels with a saved model's remote code, which carries
only ``.py`` files) is compiled on first use by the system's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``; ~1.5 s, once) into a shared library cached under ``$SELECTIVE_ROPE_CACHE`` (default
``~/.cache/selective_rope``), named by a hash of the source and the compiler, and called through ``ctypes``, or
where Python's C headers exist through a small CPython extension that makes the same call (``rotary_cpu_entry``). On
x86-64 with glibc the hot functions are built for AVX-512, AVX2 and the baseline, chosen when the library loads.
A row of at least 256 real tokens is split between ``torch.get_num_threads()`` threads (at least 128 tokens each;
see ``row_threaded``), and a batch of rows shorter than 1024 tokens (512 tokens or more in all) is shared out between
them, one row per thread, with the same results bit for bit. They are torch's own OpenMP threads: the library is built
with ``-fopenmp`` and its libgomp resolves to the copy torch has loaded (a compiler without OpenMP gives a library
that runs on one thread). Like torch's own parallel ops, they do not survive ``fork``: a child forked after the
parent used them hangs in its first parallel region (GNU OpenMP; tested on torch ops alone too) unless it calls
``torch.set_num_threads(1)`` first, as DataLoader workers do; then it runs on one thread. No compiler, a failed
build or an unwritable cache leave the PyTorch path in charge, with one warning (``SELECTIVE_ROPE_CPU_KERNEL=0``
turns the kernel off without one). It serves the ``"auto"`` backend (the default) without autograd
(``torch.no_grad``, ``torch.inference_mode``: generation, evaluation) and, with autograd, training: the same forward
keeps its float32 increments (``selective_rope_rotary_train``) for a C backward (``selective_rope_rotary_backward``),
which ``rotary_cpu_train`` wraps as an autograd Function; ``backend="torch"`` asked for by name runs PyTorch, the
reference. Writing the cache never touches a file it did not create: the library is built
under a fresh temporary name and renamed into place (atomic; two processes building at once each rename a complete
file).

Math: exactly ``SelectiveRotaryEmbedding``'s (``modeling/rotary.py``), in the same precisions: the phase path in
float64 from the parameters' values, the increment rounded once to float32, the phase summed in float64, each angle
reduced modulo 2π in float64 (in turns, as ``rotary_torch.rotary_angles``), cos/sin and the rotation in float32
(compiled with ``-ffp-contract=off``: no fused multiply-adds, so the rotation rounds as PyTorch's does). q, k and
the mixer input may be float32, float64 or bfloat16, the parameters float32 or float64. Float64 sums run in another
order than PyTorch's (``bmm``, ``norm``, ``cumsum``) and cos/sin are our own polynomials (the C library's would not
vectorise), so results agree with the torch path to rounding (float32 q and k to ~1e-6; tests:
``tests/kernels/test_rotary_cpu.py``). Among themselves the compiled calls agree exactly: a prefill is the decoding
step's code run over the tokens in order, so a sequence split into any pieces, down to one token per call, gives
bit-identical q, k and state, on any number of threads.
"""

from __future__ import annotations

import array
import ctypes
import functools
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

/* Tokens computed together (one row's consecutive tokens): one vector of float64 per value. */
#define LANES 8
typedef double lanes_t __attribute__((vector_size(LANES * sizeof(double))));
typedef uint64_t bits_t __attribute__((vector_size(LANES * sizeof(uint64_t))));
typedef float floats_t __attribute__((vector_size(LANES * sizeof(float))));

/* The hot loops are compiled for AVX-512, AVX2 and the baseline, picked at load time by the CPU (x86-64 with glibc;
   elsewhere the baseline only). Every version computes the same numbers: vector lanes round as scalars do, and
   -ffp-contract=off rules out fused multiply-adds. */
#if defined(__x86_64__) && defined(__GLIBC__) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

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

static inline double sigmoid(double z) { return 1.0 / (1.0 + exp(-z)); }
static inline double silu(double z) { return z / (1.0 + exp(-z)); }

/* One group of ROWS sums for matvec: row q starts at element ROW(q) of w, INPUT is x[j] or its lane 0. */
#define ROWS 8  /* rows at a time: each input is loaded once for ROWS independent sums */
#define GROUP_SUMS(SUM, INPUT, ROW)                                                                             \
    if (wd == F32)                                                                                             \
        for (int64_t j = 0; j < in; j++)                                                                       \
            for (int q = 0; q < ROWS; q++) SUM[q] += (double)((const float *)w)[ROW(q) + j] * INPUT;          \
    else                                                                                                       \
        for (int64_t j = 0; j < in; j++)                                                                       \
            for (int q = 0; q < ROWS; q++) SUM[q] += ((const double *)w)[ROW(q) + j] * INPUT;
#define EVERY_ROW(q) (first + (q) * in)  /* a whole group */
#define LAST_ROWS(q) (first + ((q) < live ? (q) : live - 1) * in)  /* a last group of fewer rows: the last repeated */

/* y[o] = w[o] . x (+ b[o]) for the first n lanes (the others are 0 or unused): x (in, LANES), y (out, LANES), the
   rows of w (out, in) from element `offset`. One token (n == 1) reads x1 instead, its `in` values in a row (see
   `single`). Each lane's sum runs over the inputs in order, so a token gets the same numbers whichever tokens share
   its call (a decoding step and a prefill agree exactly). */
__attribute__((always_inline)) static inline void matvec_rows(const void *w, int wd, int64_t offset,
                                                              const lanes_t *x, const double *x1, int64_t in,
                                                              int64_t out, const void *b, lanes_t *y, int64_t n) {
    for (int64_t o = 0; o < out; o += ROWS) {
        const int64_t live = out - o < ROWS ? out - o : ROWS, first = offset + o * in;
        if (n == 1) {  /* one token (a decoding step): the same sums in scalars, without seven idle lanes */
            double sum[ROWS] = {0};
            if (live == ROWS) { GROUP_SUMS(sum, x1[j], EVERY_ROW) } else { GROUP_SUMS(sum, x1[j], LAST_ROWS) }
            for (int q = 0; q < live; q++) {
                const lanes_t lanes = {b ? sum[q] + load(b, wd, o + q) : sum[q]};
                y[o + q] = lanes;
            }
        } else {
            lanes_t sum[ROWS] = {{0}};
            if (live == ROWS) { GROUP_SUMS(sum, x[j], EVERY_ROW) } else { GROUP_SUMS(sum, x[j], LAST_ROWS) }
            for (int q = 0; q < live; q++) y[o + q] = b ? sum[q] + load(b, wd, o + q) : sum[q];
        }
    }
}

HOT static void matvec(const void *w, int wd, int64_t offset, const lanes_t *x, const double *x1, int64_t in,
                       int64_t out, const void *b, lanes_t *y, int64_t n) {
    matvec_rows(w, wd, offset, x, x1, in, out, b, y, n);
}

/* sin and cos of float32 angles (|angle| <= 2π), in float64 and rounded to float32 (within rounding of the exact
   values; the C library's sinf/cosf would not vectorise). x = n π/2 + r with |r| <= π/4, polynomials of fdlibm's
   __kernel_sin/__kernel_cos on r, and the quadrant n mod 4 swaps and negates them. */
__attribute__((always_inline)) static inline void sincos_lanes(const float *angle, float *sin_out,
                                                             float *cos_out) {
    const double ROUNDER = 6755399441055744.0;  /* 1.5 * 2^52: adding it rounds to an integer, kept in the low bits */
    floats_t angles;
    memcpy(&angles, angle, sizeof angles);
    const lanes_t x = __builtin_convertvector(angles, lanes_t);
    const lanes_t shifted = x * 0.63661977236758134308 + ROUNDER;
    const lanes_t n = shifted - ROUNDER;
    const bits_t quadrant = (bits_t)shifted;  /* n mod 4 in the low two bits (two's complement) */
    const lanes_t r = (x - n * 1.57079632679489655800) - n * 6.12323399573676603587e-17;
    const lanes_t z = r * r;
    const lanes_t s = r + r * z * (-1.66666666666666324348e-01 + z * (8.33333333332248946124e-03 + z *
                      (-1.98412698298579493134e-04 + z * (2.75573137070700676789e-06 + z *
                      (-2.50507602534068634195e-08 + z * 1.58969099521155010221e-10)))));
    const lanes_t c = 1.0 - 0.5 * z + z * z * (4.16666666666666019037e-02 + z * (-1.38888888888741095749e-03 + z *
                      (2.48015872894767294178e-05 + z * (-2.75573143513906633035e-07 + z *
                      (2.08757232129817482790e-09 + z * -1.13596475577881948265e-11)))));
    const bits_t odd = (bits_t){0} - (quadrant & 1);  /* all ones where n is odd: sin and cos swap */
    const bits_t sin_bits = (((bits_t)s & ~odd) | ((bits_t)c & odd)) ^ ((quadrant & 2) << 62);
    const bits_t cos_bits = (((bits_t)c & ~odd) | ((bits_t)s & odd)) ^ (((quadrant + 1) & 2) << 62);
    const floats_t sin_floats = __builtin_convertvector((lanes_t)sin_bits, floats_t);
    const floats_t cos_floats = __builtin_convertvector((lanes_t)cos_bits, floats_t);
    memcpy(sin_out, &sin_floats, sizeof sin_floats);
    memcpy(cos_out, &cos_floats, sizeof cos_floats);
}

/* What a layer's call reads that does not change between calls: sizes, options and the parameters (the Python
   wrapper's RotaryPlan fills it once; field order and types must match its _Parameters). */
typedef struct {
    int64_t num_query_heads, num_key_heads, head_dim, rotary_pairs, chunk_dim;
    int64_t param_dtype, projection, proj_rank, convolution, conv_size, conv_silu, gate_layers, gate_rank, gate_width;
    const void *temperature, *proj_a, *proj_b, *conv_taps, *bias, *gate_w1, *gate_b1, *gate_w2, *gate_b2;
} Parameters;

/* The phase path's values a training forward keeps for its backward, which then need not compute them again
   (~a quarter of its time at hidden 256): float64, each one plane over the call's tokens (token b * seq_len + t),
   one after another in this order in one block of selective_rope_saved_per_token(p) * B * T values. Per token: the
   normalisation's denominators (Hk), the low-rank projection's rank values (Hk * rank per head, rank dense; none for
   the other projections), the projection's output before the convolution (Hk*R), the gate after its sigmoid (gate
   width) and the two-layer gate's rank values (gate rank). Exactly the forward's numbers. */
typedef struct {
    double *den, *low, *a, *g, *glow;
    int64_t seq_len;
} Saved;

static int64_t saved_lows(const Parameters *p) {
    return p->projection == PROJ_LOW_RANK ? p->num_key_heads * p->proj_rank
           : p->projection == PROJ_DENSE_LOW_RANK ? p->proj_rank : 0;
}

int64_t selective_rope_saved_per_token(const Parameters *p) {  /* (the Python wrapper sizes the block by it) */
    if (p->projection == PROJ_ONE) return 0;  /* RoPE: no phase path */
    return p->num_key_heads + saved_lows(p) + p->num_key_heads * p->rotary_pairs + p->gate_width + p->gate_rank;
}

/* The planes of a block of saved values for `batch` rows of `seq_len` tokens (all NULL for a NULL block). */
static Saved saved_planes(const Parameters *p, double *block, int64_t batch, int64_t seq_len) {
    if (!block) return (Saved){0};
    const int64_t tokens = batch * seq_len;
    Saved s = {block, NULL, NULL, NULL, NULL, seq_len};
    s.low = s.den + tokens * p->num_key_heads;
    s.a = s.low + tokens * saved_lows(p);
    s.g = s.a + tokens * p->num_key_heads * p->rotary_pairs;
    s.glow = s.g + tokens * p->gate_width;
    return s;
}

/* Lanes [0, n) of `count` vectors, token l's into plane + (token + l) * stride (+ offset). */
static void save_lanes(double *plane, int64_t token, int64_t stride, int64_t offset, const lanes_t *values,
                       int64_t count, int64_t n) {
    for (int64_t l = 0; l < n; l++)
        for (int64_t i = 0; i < count; i++) plane[(token + l) * stride + offset + i] = values[i][l];
}

/* A call's tensors: x (B, T, hidden), q (B, T, Hq, D), k (B, T, Hk, D) by strides, the outputs contiguous. */
typedef struct {
    const void *x, *q, *k;
    int64_t x_dtype, qk_dtype, x_stride_b, x_stride_t, q_stride_b, q_stride_t, q_stride_h, k_stride_b, k_stride_t,
        k_stride_h;
    void *q_out, *k_out;
    const double *phase;  /* (B, Hk, R) by strides, or NULL (zeros) */
    int64_t phase_stride_b, phase_stride_h, phase_stride_r;
    double *new_phase;  /* (B, Hk, R) */
    const double *conv_state;  /* (B, K-1, Hk*R), or NULL (zeros) */
    double *new_conv_state;  /* (B, K-1, Hk*R), or NULL without convolution */
    const int64_t *lengths;  /* (B,): tokens t >= lengths[b] are pads; NULL: none */
    float *inc_out;  /* (B, T, Hk*R): the increments c_t, kept for a training backward; NULL: not kept */
    Saved saved;  /* the phase path's values, kept for a training backward; den NULL: not kept */
} Tensors;

/* Scratch memory of one thread, in lanes (float64 vectors), doubles and floats. */
typedef struct {
    lanes_t *u, *c, *low, *gate;  /* (Hk*Dc), (Hk*R), (max(rank, gate rank)), (gate width) lanes */
    double *conv_windows;  /* (Hk*R, K-1+LANES) */
    double *turns, *exp_bias, *conv_taps;  /* τ_i / 2π (R); exp(b) (Hk*R); the taps (Hk*R, K), float64 */
    double *theta, *history;  /* (LANES, Hk*R) phases; (K-1, Hk*R) a convolution history */
    double *u1, *low1;  /* a single token's u (Hk*Dc) and low ((max(rank, gate rank))) in a row */
    float *angle, *cos, *sin, *block;  /* (LANES, Hk*R): angles, their cos and sin; one block's increments */
} Scratch;

/* Lane 0 of `count` vectors as `count` values in a row (into `out`) for a single token's matvec, which then reads
   1/LANES of the memory (a decoding step at hidden 1024 reads its normalised input 4 times per head: 256 KB as
   lanes); NULL for several tokens, which read the lanes. */
static const double *single(const lanes_t *lanes, int64_t count, double *out, int64_t n) {
    if (n != 1) return NULL;
    for (int64_t i = 0; i < count; i++) out[i] = lanes[i][0];
    return out;
}

/* c_t for up to LANES consecutive tokens of one row (rounded to float32, 0 for pads), from x; advances the
   convolution history `window` ((K-1) values per channel, oldest first, in place). */
HOT static void increments(const Parameters *p, const Tensors *a, const Scratch *s, int64_t b, int64_t t0, int64_t n,
                       int64_t valid, double *history, int save) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, dc = p->chunk_dim, channels = hk * r;
    const Saved *kept = save && a->saved.den ? &a->saved : NULL;  /* where this block's values are kept, if they are */
    const int64_t token = b * a->saved.seq_len + t0, lows = saved_lows(p);
    const int wd = (int)p->param_dtype;
    lanes_t *u = s->u, *c = s->c, *low = s->low, *gate = s->gate;
    double *u1 = s->u1;  /* a single token's normalised input, in a row */
    lanes_t keep = {0};
    for (int64_t l = 0; l < valid; l++) keep[l] = 1.0;
    if (p->projection == PROJ_ONE) {  /* RoPE: c = 1 for a real token */
        for (int64_t i = 0; i < channels; i++) c[i] = keep;
        return;
    }
    /* u_h = x_h / max(|x_h|, 1e-12) (F.normalize), one lane per token; each norm summed in order */
    if (n == 1) {  /* a decoding step: into u1, in scalars (every reader of u takes u1 instead then) */
        const int64_t row = b * a->x_stride_b + t0 * a->x_stride_t;
        for (int64_t h = 0; h < hk; h++) {
            double norm = 0.0;
            for (int64_t j = h * dc; j < (h + 1) * dc; j++) {
                u1[j] = load(a->x, (int)a->x_dtype, row + j);
                norm += u1[j] * u1[j];
            }
            const double denominator = sqrt(norm) > 1e-12 ? sqrt(norm) : 1e-12;
            for (int64_t j = h * dc; j < (h + 1) * dc; j++) u1[j] /= denominator;
            if (kept) kept->den[token * hk + h] = denominator;
        }
    } else {
        for (int64_t l = 0; l < LANES; l++) {  /* unused lanes 0 */
            const int64_t row = b * a->x_stride_b + (t0 + l) * a->x_stride_t;
            if (l >= n)
                for (int64_t j = 0; j < hk * dc; j++) u[j][l] = 0.0;
            else if (a->x_dtype == F32)
                for (int64_t j = 0; j < hk * dc; j++) u[j][l] = ((const float *)a->x)[row + j];
            else
                for (int64_t j = 0; j < hk * dc; j++) u[j][l] = load(a->x, (int)a->x_dtype, row + j);
        }
        for (int64_t h = 0; h < hk; h++) {
            lanes_t norm = {0}, denominator;
            for (int64_t j = h * dc; j < (h + 1) * dc; j++) norm += u[j] * u[j];
            for (int64_t l = 0; l < LANES; l++) denominator[l] = sqrt(norm[l]) > 1e-12 ? sqrt(norm[l]) : 1e-12;
            for (int64_t j = h * dc; j < (h + 1) * dc; j++) u[j] /= denominator;
            if (kept) save_lanes(kept->den, token, hk, h, &denominator, 1, n);
        }
    }
    if (p->projection == PROJ_LOW_RANK) {  /* per head: up_h (R, rank) @ down_h (rank, Dc) @ u_h */
        for (int64_t h = 0; h < hk; h++) {
            matvec(p->proj_a, wd, h * p->proj_rank * dc, u + h * dc, u1 + h * dc, dc, p->proj_rank, NULL, low, n);
            if (kept) save_lanes(kept->low, token, lows, h * p->proj_rank, low, p->proj_rank, n);
            matvec(p->proj_b, wd, h * r * p->proj_rank, low, single(low, p->proj_rank, s->low1, n), p->proj_rank, r,
                   NULL, c + h * r, n);
        }
    } else if (p->projection == PROJ_DENSE_LOW_RANK) {  /* up (Hk*R, rank) @ down (rank, Hk*Dc) @ u */
        matvec(p->proj_a, wd, 0, u, u1, hk * dc, p->proj_rank, NULL, low, n);
        if (kept) save_lanes(kept->low, token, lows, 0, low, p->proj_rank, n);
        matvec(p->proj_b, wd, 0, low, single(low, p->proj_rank, s->low1, n), p->proj_rank, channels, NULL, c, n);
    } else if (p->projection == PROJ_FULL_RANK) {  /* per row: scale * (w . u_h) / max(|w|, 1e-12) */
        for (int64_t h = 0; h < hk; h++) {
            matvec(p->proj_a, wd, h * r * dc, u + h * dc, u1 + h * dc, dc, r, NULL, c + h * r, n);
            for (int64_t i = 0; i < r; i++) {
                double norm = 0.0;
                for (int64_t j = 0; j < dc; j++) {
                    const double w = load(p->proj_a, wd, (h * r + i) * dc + j);
                    norm += w * w;
                }
                norm = sqrt(norm);
                c[h * r + i] = load(p->proj_b, wd, h * r + i) * c[h * r + i] / (norm > 1e-12 ? norm : 1e-12);
            }
        }
    } else {  /* scalar: one value per head, shared by every frequency */
        for (int64_t h = 0; h < hk; h++) {
            matvec(p->proj_a, wd, h * dc, u + h * dc, u1 + h * dc, dc, 1, NULL, low, n);
            for (int64_t i = 0; i < r; i++) c[h * r + i] = low[0];
        }
    }
    for (int64_t i = 0; i < channels; i++) c[i] *= keep;  /* pads never enter the history */
    if (kept) save_lanes(kept->a, token, channels, 0, c, channels, n);
    if (p->convolution != CONV_NONE) {  /* causal, over the history then these tokens, oldest first */
        const int64_t size = p->conv_size, past = size - 1;
        const int64_t span = past + LANES;
        /* Each channel's window (the history, then these tokens), all written before any is read: a vector load
           from an offset into a vector just stored would wait for the store to reach the cache. */
        for (int64_t i = 0; i < channels; i++) {
            for (int64_t j = 0; j < past; j++) s->conv_windows[i * span + j] = history[j * channels + i];
            memcpy(s->conv_windows + i * span + past, &c[i], sizeof c[i]);
        }
        for (int64_t i = 0; i < channels; i++) {
            const double *window = s->conv_windows + i * span;
            lanes_t y = {0};
            for (int64_t j = 0; j < size; j++) {  /* lane l reads window[l + j] */
                lanes_t shifted;
                memcpy(&shifted, window + j, sizeof shifted);
                y += shifted * s->conv_taps[i * size + j];
            }
            if (p->conv_silu)
                for (int64_t l = 0; l < n; l++) y[l] = silu(y[l]);
            c[i] = y;
            for (int64_t j = 0; j < past; j++) history[j * channels + i] = window[valid + j];  /* pads keep it */
        }
    }
    if (p->bias)
        for (int64_t i = 0; i < channels; i++) c[i] += s->exp_bias[i];
    if (p->gate_layers > 0) {
        if (p->gate_layers == 1) {
            matvec(p->gate_w1, wd, 0, u, u1, hk * dc, p->gate_width, p->gate_b1, gate, n);
        } else {
            matvec(p->gate_w1, wd, 0, u, u1, hk * dc, p->gate_rank, NULL, low, n);
            if (kept) save_lanes(kept->glow, token, p->gate_rank, 0, low, p->gate_rank, n);
            matvec(p->gate_w2, wd, 0, low, single(low, p->gate_rank, s->low1, n), p->gate_rank, p->gate_width,
                   p->gate_b2, gate, n);
        }
        const int64_t per_gate = p->gate_width == hk ? r : 1;  /* one gate per head, or per channel */
        for (int64_t g = 0; g < p->gate_width; g++)
            for (int64_t l = 0; l < n; l++) gate[g][l] = sigmoid(gate[g][l]);
        if (kept) save_lanes(kept->g, token, p->gate_width, 0, gate, p->gate_width, n);
        for (int64_t g = 0; g < p->gate_width; g++)  /* (by gate: an integer division per channel was 7 % of this) */
            for (int64_t i = g * per_gate; i < (g + 1) * per_gate; i++) c[i] *= gate[g];
    }
    for (int64_t i = 0; i < channels; i++)  /* rounded once */
        for (int64_t l = 0; l < LANES; l++) c[i][l] = (double)(float)(c[i][l] * keep[l]);
}

/* The angles τ_i θ_t (reduced mod 2π in float64, in turns, as rotary_torch.rotary_angles), their cos and sin, for
   the phases of n tokens (theta: (n, Hk*R)). */
HOT static void cos_sin(const double *theta, const double *turns, int64_t n, int64_t r, int64_t channels,
                        float *angle, float *cos_out, float *sin_out) {
    for (int64_t row = 0; row < n * channels; row += r)  /* each token's heads */
        for (int64_t i = 0; i < r; i++) {
            const double t = theta[row + i] * turns[i];
            angle[row + i] = (float)(t - trunc(t)) * (float)TWO_PI;
        }
    for (int64_t i = 0; i < n * channels; i += LANES)  /* the arrays hold LANES * channels floats */
        sincos_lanes(angle + i, sin_out + i, cos_out + i);
}

/* One head of one token: the GPT-NeoX halves of the first 2R dims rotated in float32, the rest passed through. */
HOT static void rotate_head(const void *src, void *dst, int dtype, int64_t r, int64_t head_dim, const float *cos,
                            const float *sin) {
    if (dtype == F32) {
        const float *x = src;
        float *y = dst;
        for (int64_t i = 0; i < r; i++) {
            y[i] = x[i] * cos[i] - x[r + i] * sin[i];
            y[r + i] = x[i] * sin[i] + x[r + i] * cos[i];
        }
        for (int64_t i = 2 * r; i < head_dim; i++) y[i] = x[i];
        return;
    }
    for (int64_t i = 0; i < r; i++) {
        const float x1 = (float)load(src, dtype, i), x2 = (float)load(src, dtype, r + i);
        store(dst, dtype, i, x1 * cos[i] - x2 * sin[i]);
        store(dst, dtype, r + i, x1 * sin[i] + x2 * cos[i]);
    }
    for (int64_t i = 2 * r; i < head_dim; i++) store(dst, dtype, i, (float)load(src, dtype, i));
}

/* float64 copies of float32 parameters, in one block returned for the caller to free (NULL if there is no memory),
   and `wide` pointing at them. In a long call the products then read every weight as a float64 operand, where they
   would otherwise widen each weight again for every 8 tokens (the numbers are the same: a float32 widens exactly). */
/* Every parameter tensor of `p`: its field (NULL inside where the options have none) and its number of elements. */
#define PARAMETER_BLOCKS 9
typedef struct { const void **field; int64_t count; } Block;
static void parameter_blocks(Parameters *p, Block blocks[PARAMETER_BLOCKS]) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, dc = p->chunk_dim, channels = hk * r;
    const int64_t rank = p->proj_rank, hidden = hk * dc, width = p->gate_width, kind = p->projection;
    const int two_layers = p->gate_layers == 2;
    const Block all[PARAMETER_BLOCKS] = {
        {&p->temperature, r},
        {&p->proj_a, kind == PROJ_LOW_RANK ? hk * rank * dc : kind == PROJ_DENSE_LOW_RANK ? rank * hidden
                     : kind == PROJ_FULL_RANK ? channels * dc : kind == PROJ_SCALAR ? hk * dc : 0},
        {&p->proj_b, kind == PROJ_LOW_RANK || kind == PROJ_DENSE_LOW_RANK ? channels * rank
                     : kind == PROJ_FULL_RANK ? channels : 0},
        {&p->conv_taps, p->convolution == CONV_LEARNED ? channels * p->conv_size : 0},
        {&p->bias, channels},
        {&p->gate_w1, (two_layers ? p->gate_rank : width) * hidden},
        {&p->gate_b1, two_layers ? 0 : width},
        {&p->gate_w2, two_layers ? width * p->gate_rank : 0},
        {&p->gate_b2, two_layers ? width : 0},
    };
    memcpy(blocks, all, sizeof all);
}

static double *widen_parameters(const Parameters *p, Parameters *wide) {
    Block parts[PARAMETER_BLOCKS];
    const int count = PARAMETER_BLOCKS;
    *wide = *p;
    parameter_blocks(wide, parts);
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += *parts[i].field ? parts[i].count : 0;
    double *block = malloc(sizeof(double) * (size_t)(total > 0 ? total : 1)), *next = block;
    if (!block) return NULL;
    for (int i = 0; i < count; i++) {
        if (!*parts[i].field) continue;
        for (int64_t j = 0; j < parts[i].count; j++) next[j] = ((const float *)*parts[i].field)[j];
        *parts[i].field = next;
        next += parts[i].count;
    }
    wide->param_dtype = F64;
    return block;
}

/* Asks for every parameter all at once: a hint, with no effect on any result. A decoding
   step reads each weight once, right after the rest of its layer streamed its own weights through the caches;
   requested together, their loads overlap instead of waiting one after another (measured in a GLA model's decoding
   steps: the projection's ~10-16k cycles per call went to ~6-8k). */
static void prefetch_weights(const Parameters *p) {
#if defined(__GNUC__)
    Parameters copy = *p;  /* parameter_blocks hands out its fields */
    Block blocks[PARAMETER_BLOCKS];
    parameter_blocks(&copy, blocks);
    const int64_t size = p->param_dtype == F64 ? 8 : 4;
    for (int i = 0; i < PARAMETER_BLOCKS; i++)
        if (*blocks[i].field)
            for (int64_t offset = 0; offset < blocks[i].count * size; offset += 64)
                __builtin_prefetch((const char *)*blocks[i].field + offset);
#else
    (void)p;
#endif
}

/* One thread's scratch memory (Scratch), allocated in three blocks; 0, or 1 if there is no memory. */
static int scratch_alloc(const Parameters *p, Scratch *s) {
    const int64_t r = p->rotary_pairs, channels = p->num_key_heads * r, past = p->conv_size - 1;
    const int64_t hidden = p->num_key_heads * p->chunk_dim;
    int64_t inner = p->proj_rank > p->gate_rank ? p->proj_rank : p->gate_rank;
    inner = inner > 1 ? inner : 1;
    const int64_t n_lanes = hidden + channels + inner + (p->gate_width > 0 ? p->gate_width : 1);
    const int64_t n_doubles = channels * (past + LANES) + r + channels + channels * p->conv_size + channels * LANES
                              + past * channels + hidden + inner;
    lanes_t *lanes = aligned_alloc(sizeof(lanes_t), sizeof(lanes_t) * (size_t)n_lanes);
    double *doubles = malloc(sizeof(double) * (size_t)n_doubles);
    float *floats = malloc(sizeof(float) * 4 * (size_t)(LANES * channels));
    if (!lanes || !doubles || !floats) { free(lanes); free(doubles); free(floats); return 1; }
    *s = (Scratch){lanes, lanes + hidden, lanes + hidden + channels, lanes + hidden + channels + inner, doubles};
    s->turns = s->conv_windows + channels * (past + LANES);
    s->exp_bias = s->turns + r;
    s->conv_taps = s->exp_bias + channels;
    s->theta = s->conv_taps + channels * p->conv_size;
    s->history = s->theta + channels * LANES;
    s->u1 = s->history + past * channels;
    s->low1 = s->u1 + hidden;
    s->angle = floats;
    s->cos = floats + LANES * channels;
    s->sin = floats + 2 * LANES * channels;
    s->block = floats + 3 * LANES * channels;
    const int wd = (int)p->param_dtype;
    for (int64_t i = 0; i < r; i++) s->turns[i] = load(p->temperature, wd, i) / TWO_PI;
    if (p->bias)
        for (int64_t i = 0; i < channels; i++) s->exp_bias[i] = exp(load(p->bias, wd, i));
    for (int64_t i = 0; i < channels * p->conv_size; i++)  /* the difference: (-1, 1) */
        s->conv_taps[i] = p->convolution == CONV_LEARNED ? load(p->conv_taps, wd, i) : i % 2 ? 1.0 : -1.0;
    return 0;
}

static void scratch_free(Scratch *s) {
    free(s->u);
    free(s->conv_windows);
    free(s->angle);
}

/* c_t of row b's tokens [start, stop), into inc ((stop - start) * Hk*R floats: c_t is rounded to float32, so this
   is exact), NULL to drop them; the convolution history advanced in place. */
HOT static void row_increments(const Parameters *p, const Tensors *a, const Scratch *s, int64_t b, int64_t start,
                               int64_t stop, int64_t length, double *history, float *inc) {
    const int64_t channels = p->num_key_heads * p->rotary_pairs;
    for (int64_t t0 = start; t0 < stop; t0 += LANES) {
        const int64_t n = stop - t0 < LANES ? stop - t0 : LANES;
        const int64_t valid = length <= t0 ? 0 : length - t0 < n ? length - t0 : n;
        increments(p, a, s, b, t0, n, valid, history, inc != NULL);
        if (inc)
            for (int64_t l = 0; l < n; l++)
                for (int64_t i = 0; i < channels; i++) inc[(t0 - start + l) * channels + i] = (float)s->c[i][l];
    }
}

/* Row b's tokens [start, stop): θ_t = θ_{t-1} + c_t summed in float64 token by token from `phase` (advanced in
   place), c_t from inc ((stop - start) * Hk*R), and q, k rotated. */
HOT static void row_rotate(const Parameters *p, const Tensors *a, const Scratch *s, int64_t b, int64_t seq_len,
                           int64_t start, int64_t stop, double *phase, const float *inc) {
    const int64_t hq = p->num_query_heads, hk = p->num_key_heads, head_dim = p->head_dim, r = p->rotary_pairs;
    const int64_t channels = hk * r, groups = hq / hk;
    const int64_t qk_size = a->qk_dtype == F64 ? 8 : a->qk_dtype == F32 ? 4 : 2;
    for (int64_t t0 = start; t0 < stop; t0 += LANES) {
        const int64_t n = stop - t0 < LANES ? stop - t0 : LANES;
        for (int64_t l = 0; l < n; l++)
            for (int64_t i = 0; i < channels; i++)
                s->theta[l * channels + i] = phase[i] = (double)inc[(t0 - start + l) * channels + i] + phase[i];
        cos_sin(s->theta, s->turns, n, r, channels, s->angle, s->cos, s->sin);
        for (int64_t l = 0; l < n; l++) {
            const int64_t t = t0 + l;
            for (int64_t head = 0; head < hq + hk; head++) {  /* query heads, then key heads */
                const int is_query = head < hq;
                const int64_t key_head = is_query ? head / groups : head - hq;
                const char *src = is_query ? (const char *)a->q + qk_size * (b * a->q_stride_b + t * a->q_stride_t
                                                                             + head * a->q_stride_h)
                                           : (const char *)a->k + qk_size * (b * a->k_stride_b + t * a->k_stride_t
                                                                             + key_head * a->k_stride_h);
                char *dst = is_query ? (char *)a->q_out + qk_size * ((b * seq_len + t) * hq + head) * head_dim
                                     : (char *)a->k_out + qk_size * ((b * seq_len + t) * hk + key_head) * head_dim;
                const int64_t at = l * channels + key_head * r;
                rotate_head(src, dst, (int)a->qk_dtype, r, head_dim, s->cos + at, s->sin + at);
            }
        }
    }
}

/* A long row split between threads: each computes the increments of its tokens (after the K-1 tokens before them,
   to fill its convolution history), the phase at each part's start is summed token by token on one thread, then each
   rotates its tokens. Every number is the one the single-threaded loop computes. */
#define MAX_THREADS 64
/* A part has at least this many tokens: ~0.25 ms of work a layer at hidden 256 against a few microseconds to wake
   the threads. (At 512, rows of 256-1023 tokens ran on one thread while torch's ops around them used every thread:
   FoX's module took 1.0 ms at 512 tokens on two threads where split it takes 0.56, docs/cpu_performance.md.) */
#define MIN_TOKENS_PER_THREAD 128
/* A batch of rows shorter than this (SHARED_ROWS_BELOW / 2 tokens or more in all) is shared out between the threads,
   each row whole: no part recomputes the K-1 tokens before it, no phase is summed twice. */
#define SHARED_ROWS_BELOW 1024
typedef struct {
    const Parameters *p;
    const Tensors *a;
    Scratch s;
    int64_t b, seq_len, length, warm_from, start, stop;
    float *inc;  /* the row's increments, (T, Hk*R) */
    double *phase;  /* (Hk*R): the phase before `start`, then advanced */
} Part;

static void part_increments(Part *w) {
    const int64_t channels = w->p->num_key_heads * w->p->rotary_pairs;
    row_increments(w->p, w->a, &w->s, w->b, w->warm_from, w->start, w->length, w->s.history, NULL);
    row_increments(w->p, w->a, &w->s, w->b, w->start, w->stop, w->length, w->s.history, w->inc + w->start * channels);
}

static void part_rotate(Part *w) {
    const int64_t channels = w->p->num_key_heads * w->p->rotary_pairs;
    row_rotate(w->p, w->a, &w->s, w->b, w->seq_len, w->start, w->stop, w->phase, w->inc + w->start * channels);
}

/* task on every part, one part per thread of OpenMP's pool. The library links libgomp, which resolves to the copy
   torch has loaded, so these are torch's own intra-op threads: just after a torch op they are still spinning, ready,
   where threads of our own had to compete with them for the cores (measured in a GLA forward at 2k tokens on 2
   cores: 13 ms of rotary modules with POSIX threads, 4 ms with these, 7 ms on one thread). */
static void run_parts(Part *parts, int count, void (*task)(Part *)) {
#pragma omp parallel for num_threads(count) schedule(static, 1)
    for (int i = 0; i < count; i++) task(&parts[i]);
}

/* Row b on `count` threads (see Part); `history` (K-1, Hk*R) and `phase` (Hk*R) hold the row's state in and out,
   `inc` room for (T, Hk*R) floats. Returns 1 if scratch memory could not be had. */
static int row_threaded(const Parameters *p, const Tensors *a, int64_t b, int64_t seq_len, int64_t length, int count,
                        double *history, double *phase, float *inc) {
    const int64_t channels = p->num_key_heads * p->rotary_pairs, past = p->conv_size - 1;
    Part parts[MAX_THREADS];
    double *starts = malloc(sizeof(double) * (size_t)(count * channels));
    int ready = 0, failed = !starts;
    for (; ready < count && !failed; ready++) failed = scratch_alloc(p, &parts[ready].s);
    if (failed) {
        for (int i = 0; i < ready - 1; i++) scratch_free(&parts[i].s);
        free(starts);
        return 1;
    }
    for (int i = 0; i < count; i++) {  /* parts of the real tokens; the last also takes the pads after them */
        Part *w = &parts[i];
        w->p = p, w->a = a, w->b = b, w->seq_len = seq_len, w->length = length, w->inc = inc;
        w->start = length * i / count;
        w->stop = i + 1 < count ? length * (i + 1) / count : seq_len;
        w->warm_from = w->start - past > 0 ? w->start - past : 0;
        for (int64_t j = 0; j < past * channels; j++) w->s.history[j] = w->warm_from == 0 ? history[j] : 0.0;
        w->phase = starts + i * channels;
    }
    run_parts(parts, count, part_increments);
    if (a->inc_out) memcpy(a->inc_out + b * seq_len * channels, inc, sizeof(float) * (size_t)(seq_len * channels));
    for (int64_t j = 0; j < past * channels; j++) history[j] = parts[count - 1].s.history[j];
    for (int i = 0; i < count; i++) {  /* each part's first phase, summed in order */
        memcpy(parts[i].phase, phase, sizeof(double) * (size_t)channels);
        for (int64_t t = parts[i].start; t < parts[i].stop; t++)
            for (int64_t j = 0; j < channels; j++) phase[j] = (double)inc[t * channels + j] + phase[j];
    }
    run_parts(parts, count, part_rotate);
    for (int i = 0; i < count; i++) scratch_free(&parts[i].s);
    free(starts);
    return 0;
}

/* The rotary module on B rows of T tokens: each row's tokens in order, LANES at a time (a decoding step is T = 1),
   a long row on up to `threads` threads. Returns 0, or 1 if scratch memory could not be had. */
/* Rows [first, stop) in order, each row's tokens LANES at a time, a long row on up to `threads` threads (`inc`: room
   for a row's increments, NULL if no row is split). Returns 0, or 1 if scratch memory could not be had. */
static int rows(const Parameters *p, const Tensors *a, Scratch *s, int64_t first, int64_t stop, int64_t seq_len,
                int64_t threads, float *inc) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, channels = hk * r, past = p->conv_size - 1;
    int status = 0;
    for (int64_t b = first; b < stop && status == 0; b++) {
        const int64_t length = a->lengths ? (a->lengths[b] < seq_len ? a->lengths[b] : seq_len) : seq_len;
        double *history = a->new_conv_state ? a->new_conv_state + b * past * channels : s->history;
        for (int64_t i = 0; i < past * channels; i++)
            history[i] = a->conv_state ? a->conv_state[b * past * channels + i] : 0.0;
        double *phase = a->new_phase + b * channels;  /* the running phase, θ_0 first */
        for (int64_t h = 0; h < hk; h++)
            for (int64_t i = 0; i < r; i++)
                phase[h * r + i] = a->phase ? a->phase[b * a->phase_stride_b + h * a->phase_stride_h
                                                       + i * a->phase_stride_r] : 0.0;
        int64_t count = length / MIN_TOKENS_PER_THREAD;
        count = count < threads ? count : threads;
        count = count < MAX_THREADS ? count : MAX_THREADS;
        if (count > 1 && inc) {
            status = row_threaded(p, a, b, seq_len, length, (int)count, history, phase, inc);
            continue;
        }
        for (int64_t t0 = 0; t0 < seq_len; t0 += LANES) {
            const int64_t end = seq_len - t0 < LANES ? seq_len : t0 + LANES;
            row_increments(p, a, s, b, t0, end, length, history, s->block);
            if (a->inc_out)
                memcpy(a->inc_out + (b * seq_len + t0) * channels, s->block,
                       sizeof(float) * (size_t)((end - t0) * channels));
            row_rotate(p, a, s, b, seq_len, t0, end, phase, s->block);
        }
    }
    return status;
}

/* The rotary module on B rows of T tokens: each row's tokens in order, LANES at a time (a decoding step is T = 1); a
   long row is split between up to `threads` threads, many short rows (a training batch, a batched prefill) are
   shared out between them, each row on one thread. Either way every number is the one a single thread computes.
   Returns 0, or 1 if scratch memory could not be had. */
HOT static int rotary(const Parameters *given, const Tensors *a, int64_t batch, int64_t seq_len, int64_t threads) {
    Parameters wide;
    double *widened = NULL;
    if (given->param_dtype == F32 && batch * seq_len >= 4 * LANES) {
        widened = widen_parameters(given, &wide);
        if (!widened) return 1;
    }
    const Parameters *p = widened ? &wide : given;
    if (seq_len == 1 && p->projection != PROJ_ONE) prefetch_weights(p);  /* a decoding step */
    const int64_t channels = p->num_key_heads * p->rotary_pairs;
#ifndef _OPENMP
    threads = 1;  /* built without OpenMP: splitting a row would only add work */
#endif
    int status = 0;
    if (threads > 1 && batch > 1 && seq_len < SHARED_ROWS_BELOW && batch * seq_len >= SHARED_ROWS_BELOW / 2) {
        const int count = (int)(threads < batch ? (threads < MAX_THREADS ? threads : MAX_THREADS) : batch);
#pragma omp parallel for num_threads(count) schedule(static, 1) reduction(| : status)
        for (int i = 0; i < count; i++) {
            Scratch own;
            if (scratch_alloc(p, &own)) { status = 1; continue; }
            status |= rows(p, a, &own, batch * i / count, batch * (i + 1) / count, seq_len, 1, NULL);
            scratch_free(&own);
        }
        free(widened);
        return status;
    }
    Scratch s;
    float *inc = threads > 1 && seq_len >= 2 * MIN_TOKENS_PER_THREAD
                 ? malloc(sizeof(float) * (size_t)(seq_len * channels)) : NULL;
    if (scratch_alloc(p, &s)) { free(widened); free(inc); return 1; }
    status = rows(p, a, &s, 0, batch, seq_len, threads, inc);
    scratch_free(&s);
    free(inc);
    free(widened);
    return status;
}

/* The entry point. The call's sizes, pointers and strides come as one array of int64 (pointers as integers), in
   this order: B, T; x, its dtype and strides (B, T); q, k, their dtype, q's strides (B, T, H), k's; q_out, k_out;
   phase and its strides (B, H, R); new_phase, conv_state, new_conv_state, lengths (0 for NULL); threads. ctypes
   passes one pointer in ~0.8 us where 26 arguments took ~3 us, per layer and decoding step. */
int selective_rope_rotary(const Parameters *p, const int64_t *call) {
#define POINTER(i) ((void *)(intptr_t)call[i])
    const Tensors tensors = {POINTER(2), POINTER(6), POINTER(7), call[3], call[8], call[4], call[5], call[9], call[10],
                             call[11], call[12], call[13], call[14], POINTER(15), POINTER(16), POINTER(17), call[18],
                             call[19], call[20], POINTER(21), POINTER(22), POINTER(23), POINTER(24), NULL, {0}};
#undef POINTER
    return rotary(p, &tensors, call[0], call[1], call[25]);
}

/* A training forward: selective_rope_rotary's call, which also keeps the increments in `inc` ((B, T, Hk*R) float32,
   exactly the ones the phase summed) and the phase path's values in `saved` (see Saved; NULL for RoPE) for
   selective_rope_rotary_backward. */
int selective_rope_rotary_train(const Parameters *p, const int64_t *call, float *inc, double *saved) {
#define POINTER(i) ((void *)(intptr_t)call[i])
    const Tensors tensors = {POINTER(2), POINTER(6), POINTER(7), call[3], call[8], call[4], call[5], call[9], call[10],
                             call[11], call[12], call[13], call[14], POINTER(15), POINTER(16), POINTER(17), call[18],
                             call[19], call[20], POINTER(21), POINTER(22), POINTER(23), POINTER(24), inc,
                             saved_planes(p, saved, call[0], call[1])};
#undef POINTER
    return rotary(p, &tensors, call[0], call[1], call[25]);
}
/* ---- Training: the backward of the forward above (selective_rope_rotary_train). ---- */

/* The backward's float64 sums may use fused multiply-adds (GCC: on CPUs with them, i.e. the AVX-512 version;
   the forward above stays without, its numbers are fixed): ~15 % of the backward's time at hidden 256. Its
   gradients then differ in the last bits between CPUs with and without them, not between threads or runs. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif

/*
   Per row, in three steps: (1) the phase path's values: those the forward kept (Saved), u = x / |x| from its
   denominators, the convolution's output from its kept inputs, and the phase summed from its increments (so every
   angle, cos and sin is the one the forward used); (2) backwards over the tokens, the rotation's gradient
   (dq, dk and d angle), d θ = τ d angle and its reverse cumulative sum, d c_t; (3) d c_t back through the gate, bias,
   activation, convolution, projection and normalisation to dx, then the weights' gradients as sums over the row's
   tokens (each gradient row held in registers while the tokens stream past). Everything in float64. The rows are
   split into a fixed number of parts (not one per thread), each summing its own gradients, added in part order: the
   results do not depend on the number of threads. */

/* One call's tensors (the Python wrapper's int64 array, see selective_rope_rotary_backward). */
typedef struct {
    const void *x, *q, *k;  /* the forward's inputs, by strides as in Tensors */
    int64_t x_dtype, qk_dtype, x_stride_b, x_stride_t, q_stride_b, q_stride_t, q_stride_h, k_stride_b, k_stride_t,
        k_stride_h;
    const void *grad_q, *grad_k;  /* d rotated q (B, T, Hq, D), k (B, T, Hk, D): by strides below, q's dtype */
    const float *inc;  /* (B, T, Hk*R) the forward's increments */
    const double *phase;  /* θ_0 (B, Hk, R) by strides, or NULL (zeros) */
    int64_t phase_stride_b, phase_stride_h, phase_stride_r;
    const double *grad_final;  /* d final phase (B, Hk*R) contiguous, or NULL (none) */
    const int64_t *lengths;  /* (B,) or NULL */
    void *dx, *dq, *dk;  /* contiguous, x's and q's dtypes */
    double *d_phase;  /* d θ_0 (B, Hk*R), or NULL (not asked for) */
    double *d_params;  /* every parameter's gradient, one after another in parameter_blocks' order */
    Saved saved;  /* what the forward kept (planes NULL for RoPE) */
    /* grad_q's and grad_k's strides (B, T, H): they come as the attention's backward left them, often (B, H, T, D)
       transposed; read where they are, they need no copy */
    int64_t grad_q_stride_b, grad_q_stride_t, grad_q_stride_h, grad_k_stride_b, grad_k_stride_t, grad_k_stride_h;
} Backward;

/* The weights as the backward reads them, float64: the projection's (heads, outs, ins) matrices (low rank: down
   and up per head; dense: one head; full rank: scale · w / |w|, one matrix per head; scalar: (Hk, 1, Dc)) and the
   gate's, transposed, so that a product over a token's outputs is a sum of rows (vectorised, no horizontal sums). */
typedef struct {
    int64_t heads, ins, lows, outs;  /* low rank: down (heads, lows, ins), up (heads, outs, lows); else proj (heads,
                                        outs, ins) with lows = 0 */
    double *down_t, *up_t, *gate1_t, *gate2_t, *proj_norm;  /* proj_norm: full rank's |w| (clamped) */
    double *turns, *exp_bias, *taps;  /* τ / 2π (R); exp(b) (Hk*R); the taps, transposed: (K, Hk*R) */
} Weights;

__attribute__((always_inline)) static inline double dot(const double *a, const double *b, int64_t n) {
    lanes_t sum = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        lanes_t x, y;
        memcpy(&x, a + j, sizeof x);
        memcpy(&y, b + j, sizeof y);
        sum += x * y;
    }
    double total = 0.0;
    for (int l = 0; l < LANES; l++) total += sum[l];
    for (; j < n; j++) total += a[j] * b[j];
    return total;
}

/* dot and row_sum are inlined into their HOT callers, so each of the callers' versions vectorises them for its
   CPU. */
/* ROWS_SUM rows of a weight's gradient, sharing their inputs: acc[q * n + :n] += Σ_t alpha[t * alpha_stride + q]
   x[t * x_stride + :n] over `count` tokens. Sixteen numbers of each row at a time are held in registers while the
   tokens stream past, each token's inputs loaded once for all the rows. */
#define ROWS_SUM 4
__attribute__((always_inline)) static inline void rows_sum(double *acc, const double *alpha, int64_t alpha_stride,
                                                           const double *x, int64_t x_stride, int64_t count,
                                                           int64_t n) {
    int64_t j = 0;
    for (; j + 2 * LANES <= n; j += 2 * LANES) {
        lanes_t s0[ROWS_SUM], s1[ROWS_SUM], v0, v1;
        for (int q = 0; q < ROWS_SUM; q++) {
            memcpy(&s0[q], acc + q * n + j, sizeof v0);
            memcpy(&s1[q], acc + q * n + j + LANES, sizeof v1);
        }
        for (int64_t t = 0; t < count; t++) {
            memcpy(&v0, x + t * x_stride + j, sizeof v0);
            memcpy(&v1, x + t * x_stride + j + LANES, sizeof v1);
            for (int q = 0; q < ROWS_SUM; q++) {
                const double al = alpha[t * alpha_stride + q];
                s0[q] += al * v0;
                s1[q] += al * v1;
            }
        }
        for (int q = 0; q < ROWS_SUM; q++) {
            memcpy(acc + q * n + j, &s0[q], sizeof v0);
            memcpy(acc + q * n + j + LANES, &s1[q], sizeof v1);
        }
    }
    for (; j < n; j++)
        for (int q = 0; q < ROWS_SUM; q++) {
            double sum = acc[q * n + j];
            for (int64_t t = 0; t < count; t++) sum += alpha[t * alpha_stride + q] * x[t * x_stride + j];
            acc[q * n + j] = sum;
        }
}

/* The same for a gradient of `rows` rows (n numbers each), ROWS_SUM rows at a time, the last ones one by one. */
__attribute__((always_inline)) static inline void matrix_sum(double *acc, int64_t rows, int64_t n, const double *alpha,
                                                             int64_t alpha_stride, const double *x, int64_t x_stride,
                                                             int64_t count) {
    int64_t q = 0;
    for (; q + ROWS_SUM <= rows; q += ROWS_SUM) rows_sum(acc + q * n, alpha + q, alpha_stride, x, x_stride, count, n);
    for (; q < rows; q++)
        for (int64_t t = 0; t < count; t++) {
            const double al = alpha[t * alpha_stride + q];
            for (int64_t j = 0; j < n; j++) acc[q * n + j] += al * x[t * x_stride + j];
        }
}

static double *transposed(const double *w, int64_t heads, int64_t rows, int64_t cols, double *out) {
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) out[(h * cols + j) * rows + i] = w[(h * rows + i) * cols + j];
    return out;
}

/* Weights for p (float64 parameters), in one block returned for the caller to free (NULL without memory). */
static double *backward_weights(const Parameters *p, Weights *w) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, dc = p->chunk_dim, hidden = hk * dc, channels = hk * r;
    const int64_t kind = p->projection, rank = p->proj_rank, width = p->gate_width, grank = p->gate_rank;
    *w = (Weights){0};
    if (kind == PROJ_LOW_RANK) *w = (Weights){hk, dc, rank, r};
    if (kind == PROJ_DENSE_LOW_RANK) *w = (Weights){1, hidden, rank, channels};
    if (kind == PROJ_FULL_RANK) *w = (Weights){hk, dc, 0, r};
    if (kind == PROJ_SCALAR) *w = (Weights){hk, dc, 0, 1};
    const int64_t proj = w->heads * (w->lows ? w->lows * w->ins + w->outs * w->lows : w->outs * w->ins);
    const int64_t gate = (p->gate_layers == 1 ? width * hidden : grank * hidden + width * grank);
    double *block = malloc(sizeof(double) * (size_t)(2 * proj + gate + channels + r + channels + channels * p->conv_size
                                                     + 1));
    if (!block) return NULL;
    double *next = block;
    if (w->lows) {  /* low rank, one head or each head */
        w->down_t = transposed(p->proj_a, w->heads, w->lows, w->ins, next), next += w->heads * w->lows * w->ins;
        w->up_t = transposed(p->proj_b, w->heads, w->outs, w->lows, next), next += w->heads * w->outs * w->lows;
    } else if (kind != PROJ_ONE) {  /* one matrix per head (full rank: weight-normalised) */
        double *weight = next;
        next += w->heads * w->outs * w->ins;
        w->proj_norm = next, next += w->heads * w->outs;
        for (int64_t o = 0; o < w->heads * w->outs; o++) {
            const double *row = (const double *)p->proj_a + o * w->ins;
            double norm = 0.0;
            for (int64_t j = 0; j < w->ins; j++) norm += row[j] * row[j];
            norm = sqrt(norm);
            w->proj_norm[o] = norm > 1e-12 ? norm : 1e-12;
            const double factor = kind == PROJ_FULL_RANK ? ((const double *)p->proj_b)[o] / w->proj_norm[o] : 1.0;
            for (int64_t j = 0; j < w->ins; j++) weight[o * w->ins + j] = factor * row[j];
        }
        w->down_t = transposed(weight, w->heads, w->outs, w->ins, next), next += w->heads * w->outs * w->ins;
    }
    if (p->gate_layers == 1) {
        w->gate1_t = transposed(p->gate_w1, 1, width, hidden, next), next += width * hidden;
    } else if (p->gate_layers == 2) {
        w->gate1_t = transposed(p->gate_w1, 1, grank, hidden, next), next += grank * hidden;
        w->gate2_t = transposed(p->gate_w2, 1, width, grank, next), next += width * grank;
    }
    w->turns = next, next += r;
    w->exp_bias = next, next += channels;
    w->taps = next;
    for (int64_t i = 0; i < r; i++) w->turns[i] = ((const double *)p->temperature)[i] / TWO_PI;
    for (int64_t i = 0; p->bias && i < channels; i++) w->exp_bias[i] = exp(((const double *)p->bias)[i]);
    for (int64_t i = 0; i < channels; i++)  /* the difference: (-1, 1) */
        for (int64_t j = 0; j < p->conv_size; j++)
            w->taps[j * channels + i] = p->convolution == CONV_LEARNED
                                        ? ((const double *)p->conv_taps)[i * p->conv_size + j] : j % 2 ? 1.0 : -1.0;
    return block;
}

/* One part's memory: the row's values (T tokens) and the part's parameter gradients. */
typedef struct {
    const double *den, *low, *a, *g, *glow;  /* (T, ...) each: the row's saved values (Saved), read only */
    double *u, *y, *theta, *dy, *da, *dg, *dlow, *dglow;  /* (T, ...) each */
    double *dcos, *dsin, *running;  /* one token's: (Hk*R) x 2; a running sum (Hk*R) */
    double *d_taps;  /* the part's gradient of the taps, transposed as Weights' (K, Hk*R) */
    double *grads;  /* (parameter count, then full rank's gradient of its effective weight) */
    float *angle, *cos, *sin;  /* (LANES, Hk*R) */
    float *pair;  /* (2 R): one head's products for d cos and d sin (rotate_head_backward) */
    lanes_t *lanes;  /* a block's values, token by lane: (2 hidden + low size + Hk*R + gate width + gate rank) */
} RowMemory;

static int64_t parameter_count(const Parameters *p) {
    Parameters copy = *p;
    Block blocks[PARAMETER_BLOCKS];
    parameter_blocks(&copy, blocks);
    int64_t total = 0;
    for (int i = 0; i < PARAMETER_BLOCKS; i++) total += *blocks[i].field ? blocks[i].count : 0;
    return total;
}

/* The gradient block's length: every parameter's, then (full rank) the effective weight's (Hk*R, Dc). */
static int64_t gradient_count(const Parameters *p) {
    const int64_t extra = p->projection == PROJ_FULL_RANK ? p->num_key_heads * p->rotary_pairs * p->chunk_dim : 0;
    return parameter_count(p) + extra;
}

/* Where each parameter's gradient starts in a gradient block (NULL: no such parameter). */
static void gradient_fields(const Parameters *p, double *grads, double *at[PARAMETER_BLOCKS]) {
    Parameters copy = *p;
    Block blocks[PARAMETER_BLOCKS];
    parameter_blocks(&copy, blocks);
    for (int i = 0; i < PARAMETER_BLOCKS; i++) {
        at[i] = *blocks[i].field ? grads : NULL;
        grads += *blocks[i].field ? blocks[i].count : 0;
    }
}

static void row_memory_free(RowMemory *m) {
    free(m->u);
    free(m->angle);
    free(m->lanes);
}

static int row_memory_alloc(const Parameters *p, const Weights *w, int64_t seq_len, RowMemory *m) {
    const int64_t hk = p->num_key_heads, channels = hk * p->rotary_pairs, hidden = hk * p->chunk_dim;
    const int64_t lows = w->heads * (w->lows ? w->lows : w->outs), width = p->gate_width, grank = p->gate_rank;
    const int64_t per_token = hidden + lows + 4 * channels + width + grank;
    const int64_t total = seq_len * per_token + (3 + p->conv_size) * channels + gradient_count(p);
    m->u = calloc((size_t)total, sizeof(double));
    m->angle = malloc(sizeof(float) * (size_t)(3 * LANES * channels + 2 * p->rotary_pairs));
    m->lanes = aligned_alloc(sizeof(lanes_t), sizeof(lanes_t) * (size_t)(2 * hidden + lows + channels + width + grank));
    if (!m->u || !m->angle || !m->lanes) { row_memory_free(m); return 1; }
    double *next = m->u + seq_len * hidden;
#define TAKE(field, size) m->field = next, next += (size)
    TAKE(y, seq_len * channels); TAKE(theta, seq_len * channels); TAKE(dy, seq_len * channels);
    TAKE(da, seq_len * channels); TAKE(dg, seq_len * width); TAKE(dlow, seq_len * lows);
    TAKE(dglow, seq_len * grank); TAKE(dcos, channels); TAKE(dsin, channels);
    TAKE(running, channels); TAKE(d_taps, p->conv_size * channels);
    TAKE(grads, gradient_count(p));
#undef TAKE
    m->cos = m->angle + LANES * channels;
    m->sin = m->cos + LANES * channels;
    m->pair = m->sin + LANES * channels;
    return 0;
}

/* Step 1's u_t = x_t / |x_t| per head for row b's real tokens, from the forward's own denominators (its u to
   rounding: times the reciprocal, one division per head rather than one per value). */
HOT static void row_normalised_inputs(const Parameters *p, const Backward *a, RowMemory *m, int64_t b,
                                      int64_t length) {
    const int64_t hk = p->num_key_heads, dc = p->chunk_dim, hidden = hk * dc;
    for (int64_t t = 0; t < length; t++) {
        const int64_t row = b * a->x_stride_b + t * a->x_stride_t;
        double *u = m->u + t * hidden;
        for (int64_t h = 0; h < hk; h++) {
            const double inverse = 1.0 / m->den[t * hk + h];
            const int64_t first = h * dc, stop = (h + 1) * dc;
            if (a->x_dtype == F32)
                for (int64_t j = first; j < stop; j++) u[j] = ((const float *)a->x)[row + j] * inverse;
            else
                for (int64_t j = first; j < stop; j++) u[j] = load(a->x, (int)a->x_dtype, row + j) * inverse;
        }
    }
}

/* matvec in this section: the same sums, fused (see above). */
HOT static void matvec_fused(const void *w, int wd, int64_t offset, const lanes_t *x, const double *x1, int64_t in,
                             int64_t out, const void *b, lanes_t *y, int64_t n) {
    matvec_rows(w, wd, offset, x, x1, in, out, b, y, n);
}

/* Step 3's input gradients for the tokens [t0, t0 + n) of row b, LANES at a time: d low (and the gate's d low) into
   the row buffers, du through the projection and the gate, and dx through the normalisation. */
HOT static void block_input_gradients(const Parameters *p, const Weights *w, const Backward *a, RowMemory *m,
                                      const double *da, int64_t b, int64_t seq_len, int64_t t0, int64_t n) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, dc = p->chunk_dim, hidden = hk * dc;
    const int64_t channels = hk * r, lows = w->heads * (w->lows ? w->lows : w->outs);
    const int64_t width = p->gate_width, grank = p->gate_rank;
    lanes_t *du = m->lanes, *dlow = du + hidden, *d_a = dlow + lows, *dz = d_a + channels, *dglow = dz + width;
    lanes_t *part = dglow + grank;  /* (hidden) */
    for (int64_t l = 0; l < LANES; l++) {
        const int64_t t = t0 + l;
        for (int64_t i = 0; i < channels; i++) d_a[i][l] = l < n ? da[t * channels + i] : 0.0;
        for (int64_t o = 0; o < width; o++) dz[o][l] = l < n ? m->dg[t * width + o] : 0.0;
    }
    if (w->lows) {  /* d low = up^T d a, du = down^T d low */
        for (int64_t h = 0; h < w->heads; h++) {
            matvec_fused(w->up_t, F64, h * w->lows * w->outs, d_a + h * w->outs, NULL, w->outs, w->lows, NULL,
                         dlow + h * w->lows, LANES);
            matvec_fused(w->down_t, F64, h * w->ins * w->lows, dlow + h * w->lows, NULL, w->lows, w->ins, NULL,
                         du + h * w->ins, LANES);
        }
    } else if (p->projection != PROJ_ONE) {  /* full rank and scalar: d (w·u) in dlow, du = W^T d (w·u) */
        for (int64_t i = 0; i < lows; i++) dlow[i] = (lanes_t){0};
        for (int64_t i = 0; i < channels; i++) dlow[p->projection == PROJ_SCALAR ? i / r : i] += d_a[i];
        for (int64_t h = 0; h < w->heads; h++)
            matvec_fused(w->down_t, F64, h * w->ins * w->outs, dlow + h * w->outs, NULL, w->outs, w->ins, NULL,
                         du + h * w->ins, LANES);
    }
    if (p->gate_layers == 1) {
        matvec_fused(w->gate1_t, F64, 0, dz, NULL, width, hidden, NULL, part, LANES);
    } else if (p->gate_layers == 2) {
        matvec_fused(w->gate2_t, F64, 0, dz, NULL, width, grank, NULL, dglow, LANES);
        matvec_fused(w->gate1_t, F64, 0, dglow, NULL, grank, hidden, NULL, part, LANES);
    }
    if (p->gate_layers > 0)
        for (int64_t j = 0; j < hidden; j++) du[j] += part[j];
    /* dx = (du - u (u . du)) / |x|, or du / 1e-12 under the clamp: by lanes (each token's sums in the same order as
       one token at a time), u taken back into lanes from the row buffer (into `part`, added to du already) */
    lanes_t *u = part, *den = d_a;  /* d_a is read already: one denominator per head */
    for (int64_t l = 0; l < LANES; l++) {
        for (int64_t j = 0; j < hidden; j++) u[j][l] = l < n ? m->u[(t0 + l) * hidden + j] : 0.0;
        for (int64_t h = 0; h < hk; h++) den[h][l] = l < n ? m->den[(t0 + l) * hk + h] : 1.0;
    }
    for (int64_t h = 0; h < hk; h++) {
        lanes_t along = {0};
        for (int64_t j = h * dc; j < (h + 1) * dc; j++) along += u[j] * du[j];
        for (int64_t l = 0; l < LANES; l++) along[l] = den[h][l] > 1e-12 ? along[l] : 0.0;
        const lanes_t inverse = 1.0 / den[h];  /* (one division, not dc: divisions were a quarter of this function) */
        for (int64_t j = h * dc; j < (h + 1) * dc; j++) du[j] = (du[j] - u[j] * along) * inverse;
    }
    const int xd = (int)a->x_dtype;
    for (int64_t l = 0; l < n; l++) {
        const int64_t t = t0 + l;
        for (int64_t i = 0; i < lows; i++) m->dlow[t * lows + i] = dlow[i][l];
        for (int64_t q = 0; q < grank; q++) m->dglow[t * grank + q] = dglow[q][l];
        for (int64_t j = 0; j < hidden; j++) store(a->dx, xd, (b * seq_len + t) * hidden + j, (float)du[j][l]);
    }
}

/* One float32 head of one token in step 2: d x from d y (the rotation transposed) and the products for d cos and
   d sin, added to dcos and dsin. `pair` is room for 2 R floats. In two loops, each of one width, so that both are
   vectorised (one loop mixing float and double products is left scalar); the same values as one loop. */
__attribute__((always_inline)) static inline void rotate_head_backward(
        const float *restrict x1, const float *restrict x2, const float *restrict g1, const float *restrict g2,
        const float *restrict cos, const float *restrict sin, float *restrict d1, float *restrict d2,
        double *restrict dcos, double *restrict dsin, float *restrict pair, int64_t r) {
    for (int64_t i = 0; i < r; i++) {
        d1[i] = g1[i] * cos[i] + g2[i] * sin[i];
        d2[i] = g2[i] * cos[i] - g1[i] * sin[i];
        pair[i] = g1[i] * x1[i] + g2[i] * x2[i];
        pair[r + i] = g2[i] * x1[i] - g1[i] * x2[i];
    }
    for (int64_t i = 0; i < r; i++) {
        dcos[i] += (double)pair[i];
        dsin[i] += (double)pair[r + i];
    }
}

/* Step 2 for up to LANES tokens [t0, t0 + n) of row b: dq, dk, and d θ_t (into dy) from the rows' gradients. */
HOT static void tokens_rotation_backward(const Parameters *p, const Backward *a, RowMemory *m, const double *turns,
                                         double *d_temperature, int64_t b, int64_t seq_len, int64_t t0, int64_t n) {
    const int64_t hq = p->num_query_heads, hk = p->num_key_heads, head_dim = p->head_dim, r = p->rotary_pairs;
    const int64_t channels = hk * r, groups = hq / hk;
    const int qd = (int)a->qk_dtype;
    cos_sin(m->theta + t0 * channels, turns, n, r, channels, m->angle, m->cos, m->sin);
    for (int64_t l = 0; l < n; l++) {
        const int64_t t = t0 + l;
        for (int64_t i = 0; i < channels; i++) m->dcos[i] = m->dsin[i] = 0.0;
        for (int64_t head = 0; head < hq + hk; head++) {  /* query heads, then key heads */
            const int is_query = head < hq;
            const int64_t key_head = is_query ? head / groups : head - hq;
            const int64_t src = is_query ? b * a->q_stride_b + t * a->q_stride_t + head * a->q_stride_h
                                         : b * a->k_stride_b + t * a->k_stride_t + key_head * a->k_stride_h;
            const int64_t dst = is_query ? ((b * seq_len + t) * hq + head) * head_dim
                                         : ((b * seq_len + t) * hk + key_head) * head_dim;
            const int64_t from = is_query
                                 ? b * a->grad_q_stride_b + t * a->grad_q_stride_t + head * a->grad_q_stride_h
                                 : b * a->grad_k_stride_b + t * a->grad_k_stride_t + key_head * a->grad_k_stride_h;
            const void *x = is_query ? a->q : a->k, *dy = is_query ? a->grad_q : a->grad_k;
            void *dx = is_query ? a->dq : a->dk;
            const float *cos = m->cos + l * channels + key_head * r, *sin = m->sin + l * channels + key_head * r;
            double *dcos = m->dcos + key_head * r, *dsin = m->dsin + key_head * r;
            if (qd == F32) {  /* y1 = x1 cos - x2 sin, y2 = x1 sin + x2 cos, in float32 */
                const float *x1 = (const float *)x + src, *g1 = (const float *)dy + from;
                rotate_head_backward(x1, x1 + r, g1, g1 + r, cos, sin, (float *)dx + dst, (float *)dx + dst + r,
                                     dcos, dsin, m->pair, r);
                for (int64_t i = 2 * r; i < head_dim; i++) ((float *)dx)[dst + i] = g1[i];
                continue;
            }
            for (int64_t i = 0; i < r; i++) {
                const float x1 = (float)load(x, qd, src + i), x2 = (float)load(x, qd, src + r + i);
                const float g1 = (float)load(dy, qd, from + i), g2 = (float)load(dy, qd, from + r + i);
                store(dx, qd, dst + i, g1 * cos[i] + g2 * sin[i]);
                store(dx, qd, dst + r + i, g2 * cos[i] - g1 * sin[i]);
                dcos[i] += (double)(g1 * x1 + g2 * x2);
                dsin[i] += (double)(g2 * x1 - g1 * x2);
            }
            for (int64_t i = 2 * r; i < head_dim; i++) store(dx, qd, dst + i, (float)load(dy, qd, from + i));
        }
        const double *theta = m->theta + t * channels;
        double *d_theta = m->dy + t * channels;
        for (int64_t h = 0; h < hk; h++)
            for (int64_t i = 0; i < r; i++) {  /* angle = 2π frac(θ τ / 2π): d angle / d θ = τ, / d τ = θ */
                const int64_t at = l * channels + h * r + i;
                const double d_angle = (double)m->cos[at] * m->dsin[h * r + i]
                                       - (double)m->sin[at] * m->dcos[h * r + i];
                d_theta[h * r + i] = d_angle * turns[i] * TWO_PI;
                d_temperature[i] += d_angle * theta[h * r + i];
            }
    }
}

/* Row b, all three steps; the parameters' gradients added to m->grads. */
HOT static void row_backward(const Parameters *p, const Weights *w, const Backward *a, RowMemory *m, int64_t b,
                             int64_t seq_len) {
    const int64_t hk = p->num_key_heads, r = p->rotary_pairs, dc = p->chunk_dim, hidden = hk * dc;
    const int64_t channels = hk * r, lows = w->heads * (w->lows ? w->lows : w->outs), size = p->conv_size;
    const int64_t width = p->gate_width, grank = p->gate_rank, per_gate = width == hk ? r : 1;
    const int64_t length = a->lengths ? (a->lengths[b] < seq_len ? a->lengths[b] : seq_len) : seq_len;
    const int selective = p->projection != PROJ_ONE;
    const double *taps = w->taps, *exp_bias = w->exp_bias;
    double *at[PARAMETER_BLOCKS];
    gradient_fields(p, m->grads, at);
    /* step 1 */
    if (selective) {
        const int64_t first = b * seq_len;  /* the row's first token in the saved planes */
        m->den = a->saved.den + first * hk, m->low = a->saved.low + first * saved_lows(p);
        m->a = a->saved.a + first * channels, m->g = a->saved.g + first * width;
        m->glow = a->saved.glow + first * grank;
        row_normalised_inputs(p, a, m, b, length);
    }
    for (int64_t t = 0; selective && t < length; t++) {  /* the convolution's output, pre-activation */
        double *y = m->y + t * channels;
        if (p->convolution == CONV_NONE) {
            memcpy(y, m->a + t * channels, sizeof(double) * (size_t)channels);
            continue;
        }
        /* each y_i summed over the taps in order (from the first within the row: no history in training), LANES
           channels at a time in registers */
        const int64_t first = t - (size - 1) < 0 ? size - 1 - t : 0;
        int64_t i = 0;
        for (; i + LANES <= channels; i += LANES) {
            lanes_t sum = {0}, earlier, tap;
            for (int64_t j = first; j < size; j++) {
                memcpy(&earlier, m->a + (t - (size - 1) + j) * channels + i, sizeof earlier);
                memcpy(&tap, taps + j * channels + i, sizeof tap);
                sum += earlier * tap;
            }
            memcpy(y + i, &sum, sizeof sum);
        }
        for (; i < channels; i++) {
            y[i] = 0.0;
            for (int64_t j = first; j < size; j++)
                y[i] += m->a[(t - (size - 1) + j) * channels + i] * taps[j * channels + i];
        }
    }
    /* θ_t = θ_{t-1} + c_t, as the forward summed it (token by token; the channels innermost) */
    const float *inc = a->inc + b * seq_len * channels;
    for (int64_t i = 0; i < channels; i++)
        m->theta[i] = (double)inc[i] + (a->phase ? a->phase[b * a->phase_stride_b + (i / r) * a->phase_stride_h
                                                            + (i % r) * a->phase_stride_r] : 0.0);
    for (int64_t t = 1; t < seq_len; t++)
        for (int64_t i = 0; i < channels; i++)
            m->theta[t * channels + i] = (double)inc[t * channels + i] + m->theta[(t - 1) * channels + i];
    /* step 2: d θ_t into dy, then its reverse cumulative sum (with the final phase's gradient on the last token),
       token by token, the channels innermost */
    for (int64_t t0 = 0; t0 < seq_len; t0 += LANES)
        tokens_rotation_backward(p, a, m, w->turns, at[0], b, seq_len, t0, seq_len - t0 < LANES ? seq_len - t0 : LANES);
    double *sum = m->running;
    for (int64_t i = 0; i < channels; i++) sum[i] = a->grad_final ? a->grad_final[b * channels + i] : 0.0;
    for (int64_t t = seq_len - 1; t >= 0; t--)
        for (int64_t i = 0; i < channels; i++) m->dy[t * channels + i] = sum[i] += m->dy[t * channels + i];
    for (int64_t i = 0; a->d_phase && i < channels; i++) a->d_phase[b * channels + i] = sum[i];
    if (!selective) return;
    for (int64_t j = length * hidden; j < seq_len * hidden; j++)  /* pads: x does not reach the phase */
        store(a->dx, (int)a->x_dtype, b * seq_len * hidden + j, 0.0f);
    /* step 3: d c_t -> d (activation output + bias), d gate logits (into dg), d convolution output (into dy); each
       loop over the channels of one kind (vectorised), the gate's sum as `dot` sums */
    double *d_bias = at[4], *out = m->running, *slope = m->dcos;  /* (Hk*R) each, free by now */
    for (int64_t t = 0; t < length; t++) {
        double *dy = m->dy + t * channels, *d_gate_logit = m->dg + t * width;
        const double *y = m->y + t * channels, *g = m->g + t * width;
        for (int64_t i = 0; i < channels; i++) out[i] = y[i], slope[i] = 1.0;
        for (int64_t i = 0; p->conv_silu && i < channels; i++) {
            const double s = sigmoid(y[i]);
            out[i] = y[i] * s;
            slope[i] = s * (1.0 + y[i] * (1.0 - s));
        }
        for (int64_t i = 0; p->bias && i < channels; i++) out[i] += exp_bias[i];
        for (int64_t o = 0; o < (width > 0 ? width : 1); o++) {  /* the channels of gate o (all, without a gate) */
            const int64_t first = width > 0 ? o * per_gate : 0, stop = width > 0 ? (o + 1) * per_gate : channels;
            const double gate = width > 0 ? g[o] : 1.0;
            if (width > 0)  /* σ' = σ (1 - σ) */
                d_gate_logit[o] = dot(dy + first, out + first, stop - first) * gate * (1.0 - gate);
            for (int64_t i = first; p->bias && i < stop; i++) d_bias[i] += dy[i] * gate * exp_bias[i];  /* d exp(b) */
            for (int64_t i = first; i < stop; i++) dy[i] = dy[i] * gate * slope[i];
        }
    }
    /* the convolution's backward: d a_s = Σ_j tap_j d y_{s+K-1-j}, d tap_j = Σ_t d y_t a_{t-K+1+j} */
    double *da = m->dy;
    if (p->convolution != CONV_NONE) {
        da = m->da;
        for (int64_t t = 0; t < length; t++) {  /* (over the channels innermost: contiguous, vectorised) */
            double *d_a = da + t * channels;
            for (int64_t i = 0; i < channels; i++) d_a[i] = 0.0;
            for (int64_t j = 0; j < size; j++) {
                const int64_t later = t + size - 1 - j, earlier = t - (size - 1) + j;
                const double *dy_later = m->dy + later * channels, *dy = m->dy + t * channels;
                const double *a_earlier = m->a + earlier * channels;
                const double *tap = taps + j * channels;
                double *d_tap = m->d_taps + j * channels;
                if (later < length)
                    for (int64_t i = 0; i < channels; i++) d_a[i] += tap[i] * dy_later[i];
                if (at[3] && earlier >= 0)
                    for (int64_t i = 0; i < channels; i++) d_tap[i] += dy[i] * a_earlier[i];
            }
        }
    }
    /* the projection's and the gate's input gradients, then the normalisation's: dx */
    for (int64_t t0 = 0; t0 < length; t0 += LANES)
        block_input_gradients(p, w, a, m, da, b, seq_len, t0, length - t0 < LANES ? length - t0 : LANES);
    /* the weights' gradients, summed over the row's tokens */
    if (w->lows) {
        for (int64_t h = 0; h < w->heads; h++) {  /* d down = Σ_t d low_t u_t^T, d up = Σ_t d a_t low_t^T */
            matrix_sum(at[1] + h * w->lows * w->ins, w->lows, w->ins, m->dlow + h * w->lows, lows, m->u + h * w->ins,
                       hidden, length);
            matrix_sum(at[2] + h * w->outs * w->lows, w->outs, w->lows, da + h * w->outs, channels,
                       m->low + h * w->lows, lows, length);
        }
    } else if (p->projection != PROJ_ONE) {  /* full rank: the effective weight's gradient (after the parameters') */
        double *d_weight = p->projection == PROJ_FULL_RANK ? m->grads + parameter_count(p) : at[1];
        for (int64_t h = 0; h < w->heads; h++)
            matrix_sum(d_weight + h * w->outs * w->ins, w->outs, w->ins, m->dlow + h * w->outs, lows,
                       m->u + h * w->ins, hidden, length);
    }
    if (p->gate_layers > 0) {
        double *d_bias_gate = p->gate_layers == 1 ? at[6] : at[8];
        for (int64_t o = 0; o < width; o++)
            for (int64_t t = 0; t < length; t++) d_bias_gate[o] += m->dg[t * width + o];
    }
    if (p->gate_layers == 1) {
        matrix_sum(at[5], width, hidden, m->dg, width, m->u, hidden, length);
    } else if (p->gate_layers == 2) {
        matrix_sum(at[7], width, grank, m->dg, width, m->glow, grank, length);
        matrix_sum(at[5], grank, hidden, m->dglow, grank, m->u, hidden, length);
    }
}

/* The part's gradient of the learned taps, summed transposed (m->d_taps), into its place among m->grads. */
static void taps_gradient(const Parameters *p, RowMemory *m) {
    double *at[PARAMETER_BLOCKS];
    gradient_fields(p, m->grads, at);
    const int64_t channels = p->num_key_heads * p->rotary_pairs, size = p->conv_size;
    for (int64_t i = 0; at[3] && i < channels; i++)
        for (int64_t j = 0; j < size; j++) at[3][i * size + j] = m->d_taps[j * channels + i];
}

/* Full rank: the gradients of scale and w from the effective weight's, scale · w / max(|w|, 1e-12). */
static void full_rank_gradients(const Parameters *p, const Weights *w, double *grads) {
    double *at[PARAMETER_BLOCKS];
    gradient_fields(p, grads, at);
    const double *d_effective = grads + parameter_count(p), *weight = p->proj_a, *scale = p->proj_b;
    for (int64_t o = 0; o < w->heads * w->outs; o++) {
        const double *row = weight + o * w->ins, *d_row = d_effective + o * w->ins, norm = w->proj_norm[o];
        const double along = dot(row, d_row, w->ins) / norm;  /* d scale = d W_eff · w / |w| */
        at[2][o] = along;
        const double unclamped = norm > 1e-12 ? along / norm : 0.0;  /* d normalize: (g - n (n·g)) / |w| */
        for (int64_t j = 0; j < w->ins; j++) at[1][o * w->ins + j] = scale[o] * (d_row[j] - row[j] * unclamped) / norm;
    }
}

#define BACKWARD_PARTS 16  /* rows are split into at most this many parts, whatever the number of threads */

/* The entry point of the backward. `call` as selective_rope_rotary's for B, T, x, q, k and their strides (entries
   0-14, the same order), then: grad_q, grad_k, inc, phase and its strides (B, H, R), grad_final, lengths, dx, dq, dk,
   d_phase, d_params (0 for NULL), threads, then the forward's saved values (0 for RoPE), grad_q's strides (B, T, H)
   and grad_k's. Returns 0, or 1 without memory. */
int selective_rope_rotary_backward(const Parameters *given, const int64_t *call) {
#define POINTER(i) ((void *)(intptr_t)call[i])
    const Backward a = {POINTER(2), POINTER(6), POINTER(7), call[3], call[8], call[4], call[5], call[9], call[10],
                        call[11], call[12], call[13], call[14], POINTER(15), POINTER(16), POINTER(17), POINTER(18),
                        call[19], call[20], call[21], POINTER(22), POINTER(23), POINTER(24), POINTER(25), POINTER(26),
                        POINTER(27), POINTER(28), saved_planes(given, POINTER(30), call[0], call[1]), call[31],
                        call[32], call[33], call[34], call[35], call[36]};
#undef POINTER
    const int64_t batch = call[0], seq_len = call[1];
    int64_t threads = call[29];
    Parameters wide;
    double *widened = NULL;
    if (given->param_dtype == F32) {
        widened = widen_parameters(given, &wide);
        if (!widened) return 1;
    }
    const Parameters *p = widened ? &wide : given;
    Weights w;
    double *weights = backward_weights(p, &w);
    const int64_t count = gradient_count(p);
    const int parts = batch < BACKWARD_PARTS ? (int)batch : BACKWARD_PARTS;
    double *sums = calloc((size_t)(parts * count > 0 ? parts * count : 1), sizeof(double));
    int failed = !sums || !weights;
#ifndef _OPENMP
    threads = 1;
#endif
    threads = threads < parts ? threads : parts;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static, 1) reduction(| : failed)
    for (int part = 0; part < parts; part++) {
        RowMemory m;
        if (failed || row_memory_alloc(p, &w, seq_len, &m)) { failed = 1; continue; }
        for (int64_t b = batch * part / parts; b < batch * (part + 1) / parts; b++)
            row_backward(p, &w, &a, &m, b, seq_len);
        taps_gradient(p, &m);
        memcpy(sums + part * count, m.grads, sizeof(double) * (size_t)count);
        row_memory_free(&m);
    }
    if (!failed) {
        for (int64_t j = 1; j < parts; j++)  /* the parts' sums, in order */
            for (int64_t i = 0; i < count; i++) sums[i] += sums[j * count + i];
        if (p->projection == PROJ_FULL_RANK) full_rank_gradients(p, &w, sums);
        memcpy(a.d_params, sums, sizeof(double) * (size_t)parameter_count(p));
    }
    free(sums);
    free(weights);
    free(widened);
    return failed;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

"""


class _Parameters(ctypes.Structure):
    """``Parameters`` in ``C_SOURCE``, field for field."""

    _fields_ = ([(name, ctypes.c_int64) for name in (
        "num_query_heads", "num_key_heads", "head_dim", "rotary_pairs", "chunk_dim", "param_dtype", "projection",
        "proj_rank", "convolution", "conv_size", "conv_silu", "gate_layers", "gate_rank", "gate_width")]
        + [(name, ctypes.c_void_p) for name in (
            "temperature", "proj_a", "proj_b", "conv_taps", "bias", "gate_w1", "gate_b1", "gate_w2", "gate_b2")])


_ARGTYPES = [ctypes.POINTER(_Parameters), ctypes.c_void_p]  # the plan's parameters, the call's int64 array
# -O3: the loops over tokens and frequencies are vectorised (-fno-trapping-math lets `trunc` be, and changes no
# value: it only drops floating-point exception flags); -ffp-contract=off: no fused multiply-adds, so every version
# of the code (and PyTorch's rotation) rounds alike.
_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-trapping-math", "-std=c11"]
# Long rows run on torch's OpenMP threads (see run_parts in C_SOURCE); a compiler without OpenMP builds a library
# that runs them on one thread.
_OPENMP_FLAG = "-fopenmp"

_lock = threading.Lock()
_kernel = None  # the loaded C function, False once loading failed, None before the first try
_training = {}  # the training forward and backward of the same library, by name, once it is loaded


def enabled() -> bool:
    """Whether the C kernel may run: not switched off by ``SELECTIVE_ROPE_CPU_KERNEL=0`` (read when the backend is
    resolved: once per model call, ``dispatch.resolve_backend``)."""
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
    compiler and flags is reused. It is built with OpenMP where the compiler has it, else without (one thread).
    Raises ``OSError`` (e.g. an unwritable directory, no such compiler) or ``RuntimeError`` (the compiler failed; its
    output is in the message)."""
    # without OpenMP (e.g. clang lacking libomp) the library runs on one thread
    return compile_cached(directory, compiler, C_SOURCE, "rotary", ".so", _FLAGS, [[_OPENMP_FLAG], []], ["-lm"])


def compile_cached(directory: Path, compiler: list[str] | str, source: str, name: str, suffix: str, flags: list[str],
                   variants: list[list[str]], libraries: list[str]) -> Path:
    """Compile ``source`` into ``directory / f"{name}_{key}{suffix}"`` (``key``: a hash of the source, the compiler
    and ``flags``) unless that file exists, and return its path. ``variants``: extra flags tried in turn (the first
    that compiles wins; ``[[]]``: none). Shared by the kernel (``build``) and its CPython entry
    (``rotary_cpu_entry.build_entry``); raises as ``build`` says."""
    command = [compiler] if isinstance(compiler, str) else list(compiler)
    key = hashlib.sha256("\0".join([source, *command, *flags, platform.machine()]).encode()).hexdigest()[:16]
    target = directory / f"{name}_{key}{suffix}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Fresh names for this build (mkstemp creates each file, so it is ours), in the cache directory itself so that the
    # final rename is atomic. Only these two files are ever removed, by the process that created them, and the library
    # only while it still has its temporary name.
    fd, source_path = tempfile.mkstemp(prefix=f".{name}_{key}.", suffix=".c", dir=directory)
    partial, published = None, False
    try:
        with os.fdopen(fd, "w") as file:
            file.write(source)
        fd, partial = tempfile.mkstemp(prefix=f".{name}_{key}.", suffix=".so", dir=directory)
        os.close(fd)
        for extra in variants:
            result = subprocess.run([*command, *flags, *extra, "-o", partial, source_path, *libraries],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{shlex.join(command)} failed with exit code {result.returncode}: "
                               f"{result.stderr.strip()[-2000:]}")
        os.chmod(partial, 0o755)  # mkstemp made it 0600; a cache shared by several users must be readable
        os.replace(partial, target)
        published = True
    finally:
        if partial is not None and not published:  # (a failing compiler may have removed it already)
            Path(partial).unlink(missing_ok=True)
        Path(source_path).unlink(missing_ok=True)
    return target


def load_kernel():
    """The C function, building the library on first use; ``None`` (after one warning) if it cannot be had."""
    global _kernel
    if _kernel:
        return _kernel
    with _lock:
        if _kernel is None:
            compiler = find_compiler()
            try:
                if compiler is None:
                    raise RuntimeError("no C compiler found (set $CC, or install cc, gcc or clang)")
                library = ctypes.CDLL(str(build(cache_dir(), compiler)))
                function = library.selective_rope_rotary
                function.argtypes, function.restype = _ARGTYPES, ctypes.c_int
                for name, argtypes in (("selective_rope_rotary_train", _ARGTYPES + [ctypes.c_void_p] * 2),
                                       ("selective_rope_rotary_backward", _ARGTYPES)):
                    _training[name] = getattr(library, name)
                    _training[name].argtypes, _training[name].restype = argtypes, ctypes.c_int
                _training["saved_per_token"] = library.selective_rope_saved_per_token
                _training["saved_per_token"].argtypes = [ctypes.POINTER(_Parameters)]
                _training["saved_per_token"].restype = ctypes.c_int64
                _kernel = function
            # AttributeError: a library that loads but lacks our function
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
                _kernel = False
                warnings.warn(f"Selective RoPE's compiled CPU kernel is unavailable, so inference runs the slower "
                              f"PyTorch path ({error}). Set {ENV_SWITCH}=0 to silence this.", RuntimeWarning,
                              stacklevel=2)
    return _kernel or None


def available() -> bool:
    """Whether the C kernel can run here: enabled, and compiled (the first call builds it, or finds it cached)."""
    return enabled() and load_kernel() is not None


def _pointer(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # exactly these: no subclass


def readable(tensor: torch.Tensor) -> bool:
    """Whether C code may read ``tensor`` through its data pointer and strides as the values it stands for: exactly a
    ``torch.Tensor`` or ``nn.Parameter`` (a subclass may keep its values elsewhere: torchao's quantized weights report
    float32 and their shape but hold int8 data, and their ``data_ptr()`` is 0), strided (not sparse, mkldnn or
    nested), on the CPU (not meta), without a lazy negation bit, and with memory (an efficient zero tensor has none).
    Dtype, shape and strides are the caller's to check (its dtypes are real: no conjugation bit; ~1 us a tensor, a
    decoding step checks six)."""
    return (type(tensor) in PLAIN_TYPES and tensor.layout is torch.strided and tensor.is_cpu and not tensor.is_nested
            and not tensor.is_neg() and tensor.data_ptr() != 0)


class RotaryPlan:
    """One layer's compiled CPU rotary kernel, prepared once from its sizes and parameters, then called per forward
    (a prefill, or a decoding step: the same code, so a prefill and the decoding steps of the same tokens agree
    exactly).

    Preparing validates everything that does not change between calls; a call (``try_call``) checks only its own
    tensors. The plan keeps references to the parameter tensors and reads them in place: it sees in-place updates,
    but a parameter whose storage is replaced (``param.data = ...``, ``module.to(...)``) needs a new plan
    (``current`` tells; ``try_call`` declines). Noticing a parameter or module swapped for another is the caller's
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
            if tensor is not None and (not readable(tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype
                                       or not tensor.is_contiguous() or dtype not in (torch.float32, torch.float64)):
                raise ValueError(f"{name}: expected a plain contiguous CPU {dtype} tensor of shape {shape} (float32 or "
                                 f"float64), got {type(tensor).__name__} {tensor.dtype} {tuple(tensor.shape)} "
                                 f"({tensor.layout}) on {tensor.device}")
        self.tensors = tuple(t for t, _ in expected.values() if t is not None)
        self.pointers = tuple(t.data_ptr() for t in self.tensors)
        # The memory the C code reads stays allocated while planned: a parameter whose storage is replaced
        # (``.data = ...``) keeps its old one alive here, so a new storage can never reuse the planned address and
        # pass ``current`` with other contents.
        self.storages = tuple(t.detach() for t in self.tensors)
        self.sizes = (num_query_heads, heads, head_dim, rotary_pairs, hidden_size, conv_size - 1)
        (w1, b1), (w2, b2) = (list(gate) + [(None, None)] * 2)[:2]
        self.parameters = _Parameters(
            num_query_heads, heads, head_dim, rotary_pairs, chunk_dim, DTYPE_CODES[dtype], PROJECTIONS[kind], rank,
            CONVOLUTIONS[conv_kind], conv_size, activation == "silu", len(gate), gate_rank, gate_width,
            temperature.data_ptr(), _pointer(proj_a), _pointer(proj_b), _pointer(conv_weight), _pointer(bias),
            _pointer(w1), _pointer(b1), _pointer(w2), _pointer(b2))
        self.parameters_ref = ctypes.byref(self.parameters)
        self.has_conv = conv_kind is not None
        # Every parameter in the order of the C code's gradient blocks (``parameter_blocks``; None where absent)
        self.gradient_order = (temperature, proj_a, proj_b, conv_weight, bias, w1, b1, w2, b2)

    def current(self) -> bool:
        """Whether every parameter tensor still has the storage it had when planned."""
        for tensor, pointer in zip(self.tensors, self.pointers):
            if tensor.data_ptr() != pointer:
                return False
        return True

    def try_call(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, phase: torch.Tensor | None = None,
                 conv_state: torch.Tensor | None = None, lengths: torch.Tensor | None = None, *,
                 overwrite_state: bool = False, increments: torch.Tensor | None = None,
                 saved: torch.Tensor | None = None):
        """The rotary module's inference forward for every row, or ``None`` where this plan does not take the call
        (the caller then runs its torch path; see ``takes``) or there are no tokens.

        Args:
            x: ``(B, T, hidden_size)`` the mixer input (read by Selective RoPE only); q: ``(B, T, Hq, D)``;
                k: ``(B, T, Hk, D)``; any strides but a contiguous last dim.
            phase: ``(B, Hk, R)`` float64, the cached phase, any strides (e.g. RoPE's count of tokens expanded
                from ``(B, 1, 1)``; ``None``: zeros).
            conv_state: ``(B, K-1, Hk*R)`` float64 contiguous, the convolution's history, oldest first (``None``:
                zeros; ignored without convolution).
            lengths: ``(B,)`` int64, the number of real tokens of each row (right-padded rows: tokens from
                ``lengths[b]`` on are pads, which add nothing to the phase and leave the history), or ``None``.
            overwrite_state: write the new phase and history into ``phase`` and ``conv_state`` themselves where they
                are contiguous (else into new tensors), for a caller that owns them and keeps only the new state (the
                model's cache). In a decoding step this saves two allocations and frees per layer, measurably (~2 %
                of a GLA step, issue 21).
            increments: a contiguous ``(B, T, Hk*R)`` float32 tensor to receive the increments ``c_t`` the phase
                summed (a training forward keeps them for ``backward``), or ``None``.
            saved: with ``increments``, a contiguous float64 tensor of ``saved_size(B, T)`` elements to receive the
                phase path's values the backward reads (``Saved`` in ``C_SOURCE``).

        Returns:
            Rotated q and k (new contiguous tensors, input dtype), the new phase ``(B, Hk, R)`` and the new history
            ``(B, K-1, Hk*R)`` (``None`` without convolution), float64: new tensors, or ``phase`` and ``conv_state``
            themselves where overwritten. Raises ``ValueError`` for shapes or states that do not fit the plan.
        """
        if not self.takes(x, q, k, phase, conv_state, lengths):
            return None
        kernel = load_kernel() if increments is None else _training["selective_rope_rotary_train"]
        qk_dtype, x_dtype = DTYPE_CODES[q.dtype], DTYPE_CODES[x.dtype]
        x_strides, q_strides, k_strides = x.stride(), q.stride(), k.stride()  # (each call costs: a decoding step)
        num_query_heads, num_key_heads, head_dim, rotary_pairs, hidden_size, history = self.sizes
        batch, seq_len = q.shape[:2]
        if (q.shape, k.shape, x.shape) != ((batch, seq_len, num_query_heads, head_dim),
                                           (batch, seq_len, num_key_heads, head_dim), (batch, seq_len, hidden_size)):
            raise ValueError(f"x {tuple(x.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)}: this plan takes "
                             f"(B, T, {hidden_size}), (B, T, {num_query_heads}, {head_dim}) and "
                             f"(B, T, {num_key_heads}, {head_dim})")
        if seq_len == 0:
            return None
        conv_state = conv_state if self.has_conv else None
        phase_shape = (batch, num_key_heads, rotary_pairs)
        history_shape = (batch, history, num_key_heads * rotary_pairs)
        if phase is not None and (phase.shape != phase_shape or phase.dtype != torch.float64 or not phase.is_cpu):
            raise ValueError(f"phase must be a CPU float64 tensor of shape {phase_shape}")
        if conv_state is not None and (conv_state.shape != history_shape or conv_state.dtype != torch.float64
                                       or not conv_state.is_contiguous() or not conv_state.is_cpu):
            raise ValueError(f"conv_state must be a contiguous CPU float64 tensor of shape {history_shape}")
        if lengths is not None and (lengths.shape != (batch,) or lengths.dtype != torch.int64
                                    or not lengths.is_contiguous() or not lengths.is_cpu):
            raise ValueError(f"lengths must be a contiguous CPU int64 tensor of shape ({batch},)")

        # (device named: a default device set with torch.set_default_device must not place them elsewhere)
        q_out = torch.empty((batch, seq_len, num_query_heads, head_dim), dtype=q.dtype, device="cpu")
        k_out = torch.empty((batch, seq_len, num_key_heads, head_dim), dtype=q.dtype, device="cpu")
        # The C code reads each row's old state before writing its new one, so the two may be the same memory.
        new_phase, new_history = phase, conv_state  # (conv_state is contiguous, checked above)
        if not overwrite_state or phase is None or not phase.is_contiguous():
            new_phase = torch.empty(phase_shape, dtype=torch.float64, device="cpu")
        if self.has_conv and (not overwrite_state or conv_state is None):
            new_history = torch.empty(history_shape, dtype=torch.float64, device="cpu")
        call = array.array("q", (batch, seq_len, x.data_ptr(), x_dtype, *x_strides[:2], q.data_ptr(), k.data_ptr(),
                                 qk_dtype, *q_strides[:3], *k_strides[:3], q_out.data_ptr(), k_out.data_ptr(),
                                 *((0, 0, 0, 0) if phase is None else (phase.data_ptr(), *phase.stride())),
                                 new_phase.data_ptr(), _pointer(conv_state), _pointer(new_history), _pointer(lengths),
                                 torch.get_num_threads() if seq_len > 1 else 1))
        if increments is None:
            status = kernel(self.parameters_ref, call.buffer_info()[0])  # (the C entry point lists the order)
        else:
            if increments.shape != (batch, seq_len, num_key_heads * rotary_pairs) or not increments.is_contiguous():
                raise ValueError(f"increments must be a contiguous ({batch}, {seq_len}, "
                                 f"{num_key_heads * rotary_pairs}) float32 tensor")
            if (saved is None or saved.numel() != self.saved_size(batch, seq_len) or saved.dtype != torch.float64
                    or not saved.is_contiguous()):
                raise ValueError(f"saved must be a contiguous float64 tensor of {self.saved_size(batch, seq_len)} "
                                 "elements")
            status = kernel(self.parameters_ref, call.buffer_info()[0], increments.data_ptr(), _pointer(saved))
        if status != 0:
            raise MemoryError("the compiled CPU rotary kernel could not allocate its scratch memory")
        return q_out, k_out, new_phase, new_history

    def saved_size(self, batch: int, seq_len: int) -> int:
        """How many float64 values a training forward of ``batch`` rows of ``seq_len`` tokens keeps for the backward
        (``try_call``'s ``saved``; 0 for RoPE). Needs the library loaded (``takes`` loads it)."""
        return self._saved_per_token * batch * seq_len

    @functools.cached_property
    def _saved_per_token(self) -> int:
        """The C code's count (``selective_rope_saved_per_token``), asked once: it depends on the options only, and a
        training step asks three times a layer."""
        return _training["saved_per_token"](self.parameters_ref)

    def parameters_at(self, tensors: tuple) -> _Parameters | None:
        """This plan's parameters read from ``tensors`` (in ``gradient_order``) where they are now, or ``None`` where
        one is not what the plan can read: not ``readable``, another shape or dtype, or not contiguous."""
        current = _Parameters.from_buffer_copy(self.parameters)
        for (name, _), planned, tensor in zip(_Parameters._fields_[-len(self.gradient_order):], self.gradient_order,
                                              tensors):
            if planned is None:
                continue
            if (tensor is None or not readable(tensor) or tensor.shape != planned.shape or tensor.dtype != planned.dtype
                    or not tensor.is_contiguous()):
                return None
            setattr(current, name, tensor.data_ptr())
        return current

    def takes(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *states: torch.Tensor | None) -> bool:
        """Whether ``try_call`` takes these tensors (else it returns ``None``): x, q and k plain CPU tensors
        (``readable``) of a dtype it reads (float32, float64, bfloat16; q and k alike) with a contiguous last dim,
        the states and lengths plain (``readable``) or ``None``, every parameter's storage the planned one
        (``current``), and the compiled library loaded."""
        if (DTYPE_CODES.get(q.dtype) is None or DTYPE_CODES.get(x.dtype) is None or k.dtype != q.dtype
                or not (readable(x) and readable(q) and readable(k))):
            return False
        if x.stride()[-1] != 1 or q.stride()[-1] != 1 or k.stride()[-1] != 1 or not self.current():
            return False
        for state in states:  # values the C code cannot read as they are: the torch path
            if state is not None and not readable(state):
                return False
        return load_kernel() is not None

    def backward(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, grad_q: torch.Tensor,
                 grad_k: torch.Tensor, increments: torch.Tensor, saved: torch.Tensor, phase: torch.Tensor | None,
                 grad_final_phase: torch.Tensor | None, lengths: torch.Tensor | None, parameters: tuple, *,
                 phase_grad: bool):
        """The gradients of a training forward (``try_call`` with ``increments``, no convolution state) that took
        x, q, k, ``phase`` and ``lengths`` and kept ``increments`` and ``saved``: from those of the rotated q and k
        (``grad_q``, ``grad_k``: q's dtype, any strides but a contiguous last dim) and of the final phase
        (``(B, Hk, R)`` float64, or ``None``).
        ``parameters``: the parameter tensors the forward read, in ``gradient_order``, read where they are now (a
        sharded model, e.g. FSDP, frees a parameter's memory after the forward and gathers it anew for the backward).

        Returns ``None`` where a parameter is no longer what the plan can read (``readable``, the planned shape and
        dtype, contiguous), else ``dx`` (x's dtype), ``dq``, ``dk`` (q's), ``d phase`` (``(B, Hk, R)`` float64;
        ``None`` unless ``phase_grad``) and the parameters' gradients in float64, one per ``gradient_order`` entry
        (``None`` where absent). Runs on ``torch.get_num_threads()`` threads; the results do not depend on their
        number."""
        current = self.parameters_at(parameters)
        if current is None:
            return None
        num_query_heads, num_key_heads, head_dim, rotary_pairs, hidden_size, _ = self.sizes
        batch, seq_len = q.shape[:2]
        for name, tensor in (("increments", increments), ("saved", saved)):
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if (grad_q.shape, grad_k.shape) != (q.shape, k.shape) or grad_q.stride(-1) != 1 or grad_k.stride(-1) != 1:
            raise ValueError("grad_q and grad_k must have q's and k's shapes and a contiguous last dim")
        if saved.numel() != self.saved_size(batch, seq_len) or saved.dtype != torch.float64:
            raise ValueError(f"saved must hold {self.saved_size(batch, seq_len)} float64 values")
        if grad_final_phase is not None and (grad_final_phase.dtype != torch.float64
                                             or not grad_final_phase.is_contiguous()):
            raise ValueError("grad_final_phase must be a contiguous float64 tensor")
        dx = torch.empty((batch, seq_len, hidden_size), dtype=x.dtype, device="cpu")
        dq, dk = (torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in (q, k))
        d_phase = torch.empty((batch, num_key_heads, rotary_pairs), dtype=torch.float64) if phase_grad else None
        sizes = [0 if t is None else t.numel() for t in self.gradient_order]
        d_params = torch.empty(max(sum(sizes), 1), dtype=torch.float64)
        call = array.array("q", (batch, seq_len, x.data_ptr(), DTYPE_CODES[x.dtype], *x.stride()[:2], q.data_ptr(),
                                 k.data_ptr(), DTYPE_CODES[q.dtype], *q.stride()[:3], *k.stride()[:3],
                                 grad_q.data_ptr(), grad_k.data_ptr(), increments.data_ptr(),
                                 *((0, 0, 0, 0) if phase is None else (phase.data_ptr(), *phase.stride())),
                                 _pointer(grad_final_phase), _pointer(lengths), dx.data_ptr(), dq.data_ptr(),
                                 dk.data_ptr(), _pointer(d_phase), d_params.data_ptr(), torch.get_num_threads(),
                                 _pointer(saved), *grad_q.stride()[:3], *grad_k.stride()[:3]))
        status = _training["selective_rope_rotary_backward"](ctypes.byref(current), call.buffer_info()[0])
        if status != 0:
            raise MemoryError("the compiled CPU rotary backward could not allocate its scratch memory")
        grads, offset = [], 0
        for tensor, size in zip(self.gradient_order, sizes):
            grads.append(None if tensor is None else d_params[offset:offset + size].view(tensor.shape))
            offset += size
        return dx, dq, dk, d_phase, grads
