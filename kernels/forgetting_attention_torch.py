"""Pure-PyTorch forgetting attention (FoX): the CPU / any-device backend of the FoX attention op.

Layout follows flash-linear-attention (fla): every sequence tensor is ``[B, T, H, D]``.
Forgetting attention is causal softmax attention whose logits carry the log forget gates
accumulated between the key and the query:

    o_i = Σ_{τ <= p_i} softmax_τ(scale q_i·k_τ + Σ_{s=τ+1..p_i} log f_s) v_τ

The queries are the last ``Tq`` positions of the key timeline, ``p_i = Tk - Tq + i``: one call
covers a full forward (``Tq == Tk``), a chunked prefill continuing a cache and single-token
decoding (``Tq == 1``). With ``c`` the cumulative sum of the log forget gates, the bias is
``c_{p_i} - c_τ``. Softmax math is float32 whatever the input dtype; the output comes back in
``q.dtype``.

How it is computed:

* Queries are processed in blocks of ``block_size`` rows, each against the keys up to its last
  position only, so the largest temporaries are a few of one block's ``(B, Hq, rows, keys)``
  float32 tiles, never ``Tq x Tk`` for all heads.
* Inference (no autograd needed):
  - one query per row (decoding): no blocks; one SDPA call with the bias as a (1 x keys) mask per head up to
    ``SDPA_SINGLE_QUERY_KEYS`` keys, grouped heads against their key head in matrix products beyond
    (`_attention_single_query`);
  - on CPU without padding: per query block, PyTorch's CPU flash kernel on the block's causal square (exact bias as
    a small rows x rows mask) and on the keys before it (the bias splits into a row term, which cancels in the
    softmax, and a key term, a 1 x keys mask the kernel broadcasts), merged by log-sum-exp (`_attention_merged`).
    No (rows x Tk) tile is written at all; at 8k tokens (one thread) this took ~1.06x the time of one causal SDPA
    call, the masked blocks below ~1.4-1.6x;
  - otherwise (holes in the key timeline, other devices): each block is one ``scaled_dot_product_attention`` call
    with a float mask holding bias and masking. PyTorch's CPU flash kernel then tiles the keys itself and reads
    grouped key/value heads directly (``enable_gqa``); on other devices SDPA picks a fused kernel.
  Eager calls run these functions directly; the custom op (below) is what torch.compile sees, but for one query,
  whose few plain ops (no blocks) it traces and fuses.
* Autograd: a FlashAttention-style blockwise forward and backward in plain torch ops
  (`_blockwise_forward`, `_blockwise_backward`). The forward saves only its inputs and output; the
  backward recomputes each block's probabilities. Key and value heads are used grouped,
  ``(B * Hk, G * rows, D)`` against ``(B * Hk, keys, D)``, never repeated to the query heads.
  (SDPA cannot serve here: with a mask that needs a gradient it falls back to its math path, which
  repeats k/v to the query heads and keeps every block's probabilities for the backward, i.e. the
  full ``Tq x Tk`` matrix again.)
* Plain causal attention over a whole sequence (no gate, no padding, ``Tq == Tk``) is a single
  ``scaled_dot_product_attention(is_causal=True)``: the flash kernel is memory-bounded in both
  directions and equals Llama's eager attention to float32 rounding.

Both blockwise paths are ``torch.library`` custom ops (``selective_rope::forgetting_attention_inference``,
``forgetting_attention_forward`` with its registered backward ``forgetting_attention_backward``), so
``torch.compile`` calls them as opaque ops with known output shapes instead of tracing the block loop:
traced, its shape-dependent loop and in-place writes into scratch views recompiled for every new key
length during cached decoding, and with dynamic shapes dynamo failed outright (torch 2.13: "sources must
not be empty for symbol ..." while building guards after a graph break in `_write_block_bias`).

Every per-block tile is a view into scratch buffers allocated once per call (`_Scratch`). Fresh
tensors grow by a few keys from one block to the next, so each is slightly larger than the one
just freed, and glibc's allocator kept taking new memory from the OS: a forward + backward at
T = 16384 (B=1, Hq=4) built that way grew the process by 3.6 GiB while ~30 MiB were live. With the
scratch buffers it grows by ~80 MiB, inputs, outputs and gradients included.

Why the bias is accurate at long context: a float32 running sum of the gates reaches -1e4 within
16k tokens, where one ulp is ~1e-3, and ``c_p - c_τ`` of two such values loses those digits even
for neighbouring tokens, exactly where the weights are largest. Here the cumulative sum is
float64 and, per block starting at key position ``a``, the bias is assembled from float32
differences that never cancel:

* keys before the block (``τ < a``): ``(c_{p_i} - c_a) + (c_a - c_τ)``; both terms are <= 0, so
  their float32 sum is accurate to a couple of ulps *of the bias itself*;
* keys inside the block: ``c_{p_i} - c_τ`` directly from float64 (a small ``rows x rows`` tile).

The gradient of the gates goes the same way: ``∂L/∂bias`` is summed into a float64 ``∂L/∂c``
(``+`` at the query's position, ``-`` at the key's), and autograd takes it back through the
float64 cumulative sum.

Masking uses the most negative float32 instead of ``-inf``: a query with no visible key at all
(left padding) then gets a finite uniform softmax instead of NaN, and its output is set to zero
afterwards (so its gradients are zero, not NaN). Where a query has any visible key, masked keys
get a weight of exactly 0, as with ``-inf``.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F

# Float32 elements of one block's (B, Hq, rows, Tk) tile, which sets the default block size (1 Mi elements
# = 4 MiB). Measured on CPU (B=1, Hq=4, D=16, T=1024..16384, forward and forward + backward): 2 and 4 MiB
# tiles were fastest, within ~15% of each other; at T=1024, 8 MiB tiles were up to 1.6x and 16 MiB ones up
# to 5x slower (they no longer stay in the caches).
BLOCK_ELEMENTS = 2**20
MIN_BLOCK_SIZE = 16  # rows; below this the per-block Python overhead dominates

# Query rows per block of the merged path (`_attention_merged`): its only tile is the (rows x rows) diagonal mask.
# Measured on 2 CPU cores at T = 8192 (Hq = 4, D = 64): 256 and 512 rows within ~3% of each other, 64 rows ~10% slower.
MERGED_BLOCK_SIZE = 256
MERGED_OUTER_BLOCKS = 4  # the keys before an outer block of 4 blocks are read by one call for all its rows

# A decoding step (one query per row) with at most this many keys is one scaled_dot_product_attention call, with more
# a few matrix products: measured on the 2-core VM (4 query / 2 key heads, D = 64, two threads, no gate), SDPA took
# 7.8 / 14.0 / 24.2 / 45.6 / 90.0 us at 129 / 513 / 1025 / 2049 / 4097 keys, the products 16.0 / 21.8 / 29.9 / 48.0 /
# 84.7 us (with a gate each ~4-9 us more).
SDPA_SINGLE_QUERY_KEYS = 2048

# The mask value: exp(MASKED - max) is exactly 0 next to any real logit, and a row of only MASKED stays finite.
MASKED = torch.finfo(torch.float32).min

# scaled_dot_product_attention takes grouped key/value heads (enable_gqa) from torch 2.5 on
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor | None = None,
    scale: float | None = None,
    key_valid: torch.Tensor | None = None,
    block_size: int | None = None,
    query_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention with a forget gate (FoX), blockwise and memory-bounded.

    Args:
        q: (B, Tq, Hq, D) queries, the last Tq positions of the key timeline (query i sits at key
            position Tk - Tq + i).
        k: (B, Tk, Hk, D) keys, Hq % Hk == 0 (query head h reads key head h // (Hq // Hk)), Tq <= Tk.
        v: (B, Tk, Hk, Dv) values.
        log_fgate: (B, Tk, Hq) log forget gate (<= 0, finite) at every key position, or None for plain
            causal softmax attention.
        scale: logit scale; defaults to D ** -0.5.
        key_valid: (B, Tk) bool, False marks padding slots of the key timeline (anywhere). Invalid
            keys are never attended and their log forget gate counts as 0. A query at a padding slot
            (the queries are the last Tq slots) gets a zero output, whatever keys it could see.
        query_valid: (B, Tq) bool, which queries are real tokens (zero output elsewhere); by default the last Tq
            columns of ``key_valid``. Given with a single query (Tq = 1), the key timeline may go on past the
            query's slot, as a static cache's fixed-length buffer does, provided ``key_valid`` marks those slots
            invalid: they are then never attended and forget nothing.
        block_size: query rows per block; by default as many as keep one block's (B, Hq, rows, Tk)
            float32 tile within ``BLOCK_ELEMENTS`` (at least ``MIN_BLOCK_SIZE``).

    Returns:
        o: (B, Tq, Hq, Dv) in q.dtype, contiguous. Differentiable (first order) in q, k, v and log_fgate.
    """
    _check_shapes(q, k, v, log_fgate, key_valid, block_size, query_valid)
    B, Tq, Hq, D = q.shape
    Tk, Dv = k.shape[1], v.shape[-1]
    scale = D**-0.5 if scale is None else scale
    out_dtype = q.dtype
    if Tq == 0:
        return q.new_zeros(B, 0, Hq, Dv)

    # (B, T, H, D) -> (B, H, T, D) float32: heads first, the layout both paths want (no cast dispatched for float32:
    # even a no-op one costs ~1 us, three times per layer and token when decoding)
    q, k, v = ((x if x.dtype == torch.float32 else x.float()).transpose(1, 2) for x in (q, k, v))

    if log_fgate is None and key_valid is None and Tq == Tk:
        o = _sdpa(q, k, v, is_causal=True, scale=scale)
        return o.transpose(1, 2).to(out_dtype).contiguous()

    cum = None  # (B, Hq, Tk) float64 cumulative log forget gate
    if log_fgate is not None:
        if key_valid is not None:  # a padding slot forgets nothing: its gate is 1
            log_fgate = log_fgate.masked_fill(~key_valid.unsqueeze(-1), 0.0)
        # float64 where the device has it (MPS does not): see the module docstring for why
        acc_dtype = torch.float32 if log_fgate.device.type == "mps" else torch.float64
        cum = log_fgate.to(acc_dtype).cumsum(1).transpose(1, 2).contiguous()

    if block_size is None:
        block_size = max(MIN_BLOCK_SIZE, BLOCK_ELEMENTS // (B * Hq * Tk))
        if _merges_key_blocks(q, key_valid):  # no (rows x Tk) tile: the block only sizes the diagonal mask
            block_size = max(block_size, MERGED_BLOCK_SIZE)
    block_size = min(block_size, Tq)

    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, cum))
    if needs_grad:
        o = _blockwise_forward_op(q, k, v, cum, key_valid, scale, block_size)  # (B, Hq, Tq, Dv) float32
    elif torch.compiler.is_compiling() and Tq == 1:  # a decoding step: a few plain ops the compiler can fuse
        o = _attention_single_query(q, k, v, cum, key_valid, scale)
    elif torch.compiler.is_compiling():
        o = _attention_inference_op(q, k, v, cum, key_valid, scale, block_size)
    else:  # eager: the same function without the custom op's dispatch (~75 us a call, per layer and token)
        o = _attention_inference(q, k, v, cum, key_valid, scale, block_size)

    if query_valid is None and key_valid is not None:  # the queries are the last Tq slots
        query_valid = key_valid[:, Tk - Tq :]  # (B, Tq)
    if query_valid is not None:  # queries at padding slots output zeros, as on the fla path (see `key_valid`)
        o = o.masked_fill(~query_valid[:, None, :, None], 0.0)
    o = o.transpose(1, 2)  # (B, Tq, Hq, Dv), contiguous as fla returns it
    return (o if out_dtype == torch.float32 else o.to(out_dtype)).contiguous()


def forgetting_attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor | None = None,
    scale: float | None = None,
    key_valid: torch.Tensor | None = None,
    layout=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager forgetting attention that also returns its weights (what ``output_attentions=True`` asks for).

    The same inputs, masking and outputs as :func:`forgetting_attention`, computed the textbook way: the whole
    ``(B, Hq, Tq, Tk)`` score matrix plus the forget-gate bias ``c_{p_i} - c_τ`` (from the float64 cumulative sum,
    whose differences are exact to float64 rounding), softmax, then ``P v``. Memory grows as ``Tq x Tk`` per head:
    meant for inspecting weights, not for long sequences. Differentiable.

    ``layout``: an object whose ``to_caller(weights)`` gives the weights in the caller's layout and ``from_caller``
    takes them back exactly (a permutation of real entries; see ``modeling.layout.AttentionLayout``). The weights are
    returned in the caller's layout and the output is computed from that very tensor, so gradients reach it (as
    with transformers' eager attention, whose returned weights are the ones multiplied with the values).

    Returns:
        o: (B, Tq, Hq, Dv) in q.dtype; weights: (B, Hq, Tq, Tk) in q.dtype, each visible query's row summing to 1,
        zero at masked keys (future, padding) and for queries at padding slots.
    """
    _check_shapes(q, k, v, log_fgate, key_valid, None)
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    out_dtype = q.dtype
    # (B, T, H, D) -> (B, H, T, D) float32, key/value heads repeated to the query heads
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(Hq // Hk, dim=1), v.repeat_interleave(Hq // Hk, dim=1)
    scores = scale * (q @ k.transpose(-1, -2))  # (B, Hq, Tq, Tk)
    query_pos = torch.arange(Tk - Tq, Tk, device=q.device)
    visible = torch.arange(Tk, device=q.device) <= query_pos[:, None]  # (Tq, Tk) causal
    if key_valid is not None:
        visible = visible & key_valid[:, None, None, :]  # (B, 1, Tq, Tk)
    if log_fgate is not None:
        if key_valid is not None:  # a padding slot forgets nothing
            log_fgate = log_fgate.masked_fill(~key_valid.unsqueeze(-1), 0.0)
        acc_dtype = torch.float32 if log_fgate.device.type == "mps" else torch.float64
        cum = log_fgate.to(acc_dtype).cumsum(1).transpose(1, 2)  # (B, Hq, Tk)
        scores = scores + (cum[..., Tk - Tq :, None] - cum[..., None, :]).float()  # bias c_p - c_τ
    weights = torch.softmax(scores.masked_fill(~visible, MASKED), dim=-1)
    if key_valid is not None:  # queries at padding slots: zero, as forgetting_attention's outputs
        weights = weights.masked_fill(~key_valid[:, None, Tk - Tq :, None], 0.0)
    weights = weights.to(out_dtype)
    returned = weights if layout is None else layout.to_caller(weights)
    used = weights if layout is None else layout.from_caller(returned)
    o = (used.float() @ v).transpose(1, 2)  # (B, Tq, Hq, Dv)
    return o.to(out_dtype).contiguous(), returned


def _check_shapes(q, k, v, log_fgate, key_valid, block_size, query_valid=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        shapes = ", ".join(str(tuple(x.shape)) for x in (q, k, v))
        raise ValueError(f"q, k, v must be (B, T, H, D), got {shapes}")
    B, Tq, Hq, D = q.shape
    _, Tk, Hk, _ = k.shape
    if k.shape[0] != B or k.shape[-1] != D or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"mismatched q, k, v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    if Tq > Tk:
        raise ValueError(f"more queries ({Tq}) than keys ({Tk}): queries are the last Tq key positions")
    if log_fgate is not None and log_fgate.shape != (B, Tk, Hq):
        raise ValueError(f"log_fgate must be (B, Tk, Hq) = {(B, Tk, Hq)}, got {tuple(log_fgate.shape)}")
    if key_valid is not None and (key_valid.shape != (B, Tk) or key_valid.dtype != torch.bool):
        raise ValueError(f"key_valid must be a bool (B, Tk) = {(B, Tk)} tensor, got {key_valid.dtype} "
                         f"{tuple(key_valid.shape)}")
    if query_valid is not None and (query_valid.shape != (B, Tq) or query_valid.dtype != torch.bool):
        raise ValueError(f"query_valid must be a bool (B, Tq) = {(B, Tq)} tensor, got {query_valid.dtype} "
                         f"{tuple(query_valid.shape)}")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")


def _blocks(Tq: int, Tk: int, block_size: int):
    """Yield (start, stop, first, end) per query block: rows [start, stop) of q, which sit at key positions
    [first, end); the block reads the keys [0, end)."""
    offset = Tk - Tq
    for start in range(0, Tq, block_size):
        stop = min(Tq, start + block_size)
        yield start, stop, offset + start, offset + stop


class _Scratch:
    """Buffers allocated once per call; every block's tiles are views into them (see the module docstring).

    tiles: names of flat float32 buffers of ``tile_elements`` each; `tile` views the front of one as any
    shape. key_part: the key half of the bias, (B, Hq, Tk) with a gate, (B, 1, Tk) with padding only;
    future: (block, block) bool, True above the diagonal (its top-left square serves a shorter last block).
    """

    def __init__(self, ref: torch.Tensor, tiles: tuple[str, ...], tile_elements: int, B: int, Hq: int,
                 Tk: int, block_size: int, gated: bool, padded: bool) -> None:
        self.flat = {name: ref.new_empty(tile_elements) for name in tiles}
        self.key_part = ref.new_empty(B, Hq if gated else 1, Tk) if gated or padded else None
        self.future = torch.ones(block_size, block_size, dtype=torch.bool, device=ref.device).triu(1)

    def tile(self, name: str, *shape: int) -> torch.Tensor:
        return self.flat[name][: math.prod(shape)].view(shape)


def _write_block_bias(
    bias: torch.Tensor,
    scratch: _Scratch,
    cum: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    first: int,
) -> torch.Tensor:
    """Write one query block's additive float32 logit bias, masking included, into ``bias`` and return it.

    bias: (B | 1, Hq | 1, rows, E) target, E = first + rows (the keys up to the block's last query);
    a gate needs (B, Hq, ...), padding (B, ...). cum: (B, Hq, Tk) float64 cumulative log forget gate or
    None; key_valid: (B, Tk) bool or None; first: key position of the block's first query.
    Visible keys (τ <= p_i and valid) get ``c_{p_i} - c_τ`` (0 without a gate), the others ``MASKED``.
    """
    rows = bias.shape[-2]
    end = first + rows
    past, own = bias[..., :first], bias[..., first:]  # keys before the block, the block's own keys

    # keys before the block: (c_p - c_first) + (c_first - c_τ), both <= 0, so no cancellation. Padding
    # is masked in the key half (first values, not rows x first): MASKED + (c_p - c_first) is MASKED.
    if cum is None and key_valid is None:
        past.zero_()
    else:
        key_part = scratch.key_part[..., :first]  # (B, Hq | 1, first)
        if cum is None:
            key_part.zero_()
        else:
            ref = cum[..., first : first + 1]  # c at the block's first query
            torch.sub(ref, cum[..., :first], out=key_part)  # float64 -> float32
        if key_valid is not None:
            key_part.masked_fill_(~key_valid[:, None, :first], MASKED)
        if cum is None:
            past.copy_(key_part.unsqueeze(-2).expand_as(past))
        else:
            query_part = (cum[..., first:end] - ref).float()  # (B, Hq, rows)
            torch.add(query_part.unsqueeze(-1), key_part.unsqueeze(-2), out=past)

    # the block's own keys: c_p - c_τ straight from float64, the future masked
    if cum is None:
        own.zero_()
    else:
        torch.sub(cum[..., first:end, None], cum[..., None, first:end], out=own)
    own.masked_fill_(scratch.future[:rows, :rows], MASKED)
    if key_valid is not None:
        own.masked_fill_(~key_valid[:, None, None, first:end], MASKED)
    return bias


def _attention_inference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cum: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """Blockwise scaled_dot_product_attention (no autograd).

    q: (B, Hq, Tq, D); k: (B, Hk, Tk, D); v: (B, Hk, Tk, Dv), float32; cum: (B, Hq, Tk) float64 or None;
    key_valid: (B, Tk) bool or None. Returns (B, Hq, Tq, Dv) float32.
    """
    B, Hq, Tq, _ = q.shape
    Tk, Dv = k.shape[2], v.shape[-1]
    if Tq == 1:
        return _attention_single_query(q, k, v, cum, key_valid, scale)
    if _merges_key_blocks(q, key_valid):
        return _attention_merged(q, k, v, cum, scale, block_size)
    # without a gate one mask serves every head, and without padding every sequence too
    mask_batch = B if cum is not None or key_valid is not None else 1
    mask_heads = Hq if cum is not None else 1
    scratch = _Scratch(q, ("bias",), mask_batch * mask_heads * block_size * Tk, B, Hq, Tk, block_size,
                       gated=cum is not None, padded=key_valid is not None)
    o = q.new_empty(B, Hq, Tq, Dv)
    for start, stop, first, end in _blocks(Tq, Tk, block_size):
        bias = scratch.tile("bias", mask_batch, mask_heads, stop - start, end)
        _write_block_bias(bias, scratch, cum, key_valid, first)
        q_block, k_block, v_block = q[:, :, start:stop], k[:, :, :end], v[:, :, :end]
        o[:, :, start:stop] = _sdpa(q_block, k_block, v_block, attn_mask=bias, scale=scale)
    return o


def _attention_single_query(q, k, v, cum, key_valid, scale: float) -> torch.Tensor:
    """One query per row (a decoding step), no tiles: up to ``SDPA_SINGLE_QUERY_KEYS`` keys one
    scaled_dot_product_attention call with the bias (and padding) as a (B, Hq, 1, Tk) float mask, beyond that a few
    matrix-vector products.

    Shapes as `_attention_inference` with Tq = 1. The bias of key τ is ``c_T - c_τ`` taken from the float64
    cumulative sum, as in the block that holds the last query on the other paths. The G query heads of one key head
    are one (G, D) matrix against that head's keys (grouped, never repeated).
    """
    B, Hq, _, D = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Tk <= SDPA_SINGLE_QUERY_KEYS:
        mask = None if cum is None else (cum[..., -1:] - cum).float().unsqueeze(2)  # (B, Hq, 1, Tk)
        if key_valid is not None:
            padding = ~key_valid[:, None, None, :]  # (B, 1, 1, Tk)
            mask = (q.new_zeros(B, 1, 1, Tk) if mask is None else mask).masked_fill(padding, MASKED)
        return _sdpa(q, k, v, attn_mask=mask, scale=scale)
    q = q.reshape(B, Hk, Hq // Hk, D)  # (B, Hk, G, D): query head h = hk * G + g
    if cum is None:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (B, Hk, G, Tk)
    else:
        bias = (cum[..., -1:] - cum).float().view(B, Hk, -1, Tk)  # (B, Hk, G, Tk): Σ log f over (τ, T]
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias)
    if key_valid is not None:
        scores.masked_fill_(~key_valid[:, None, None, :], MASKED)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(B, Hq, 1, Dv)  # (B, Hk, G, Dv) -> (B, Hq, 1, Dv)


def _merges_key_blocks(q: torch.Tensor, key_valid: torch.Tensor | None) -> bool:
    """Whether `_attention_merged` serves this call: CPU (it calls the CPU flash kernel, which returns the
    log-sum-exp) and no padding (holes in the key timeline need the full mask tiles)."""
    return key_valid is None and q.device.type == "cpu" and _CPU_FLASH is not None


# The CPU flash-attention kernel behind scaled_dot_product_attention, which also returns the log-sum-exp of each row.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention_merged(q, k, v, cum, scale: float, block_size: int) -> torch.Tensor:
    """Blockwise attention without (rows x Tk) mask tiles, for key timelines without padding (CPU).

    Shapes as `_attention_inference`. Per query block (rows at key positions [a, e)):

    * its own keys [a, e), the causal diagonal square: one flash call with the exact bias ``c_p - c_τ`` (from
      float64) as a (rows x rows) float mask;
    * the keys before it [0, a): the bias ``(c_p - c_a) + (c_a - c_τ)`` is a row term plus a key term. The row term
      is the same for every key of a row, so it cancels in the softmax over these keys, and the key term is a
      (1 x a) mask that the flash kernel broadcasts over the rows (measured: ~5% over no mask, where a full
      (rows x a) mask costs ~20%, plus the time to write it);
    * the two partial results merge by their log-sum-exps, the row term added back to the past keys' one:
      ``o = o_own + sigmoid(lse_past - lse_own) (o_past - o_own)``.

    The keys before a block are read in two parts: those of its outer block (``MERGED_OUTER_BLOCKS`` blocks), per
    block, and those before the outer block by one call for all its rows: the kernel splits fewer query rows into
    its own small tiles then, which made it ~15% faster at 8k tokens (one thread: 1.06x a causal SDPA call instead
    of 1.22x with 256-row calls only).

    Precision is that of the masked path: both bias terms are float32 differences of float64 values that never
    cancel (each is <= 0, see the module docstring). Without a gate there are no masks: the diagonal square is plain
    causal. The flash kernel takes no grouped heads, and the gate differs per query head, so key and value heads are
    expanded to the query heads once per call (O(T) copies; the work is O(T^2)).
    """
    B, Hq, Tq, D = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if Dv != D:  # the kernel wants one head size: zero columns pad q and k (they add nothing to the scores)
        size = max(D, Dv)
        q, k, v = (F.pad(x, (0, size - x.shape[-1])) for x in (q, k, v))
    if Hq != Hk:
        k, v = k.repeat_interleave(Hq // Hk, dim=1), v.repeat_interleave(Hq // Hk, dim=1)  # (B, Hq, Tk, *)
    o = q.new_empty(B, Hq, Tq, Dv)
    outer = block_size * MERGED_OUTER_BLOCKS
    for start, stop, first, _ in _blocks(Tq, Tk, outer):
        q_rows = q[:, :, start:stop]  # (B, Hq, rows, D) at key positions [first, first + rows)
        o_rows, lse_rows = _merged_within(q_rows, k, v, cum, first, block_size, scale)
        if first > 0:  # the keys before the outer block, for all its rows at once
            o_rows, _ = _merge(o_rows, lse_rows, *_past_keys(q_rows, k, v, cum, 0, first, first, scale))
        o[:, :, start:stop] = o_rows[..., :Dv]
    return o


def _merged_within(q_rows, k, v, cum, first: int, block_size: int, scale: float):
    """Rows at key positions [first, first + rows) against the keys [first, first + rows) only, in sub-blocks of
    ``block_size`` rows: each sub-block's causal square (exact bias) merged with the keys between ``first`` and the
    sub-block. Returns (o, lse): (B, Hq, rows, D) and (B, Hq, rows) float32."""
    rows = q_rows.shape[2]
    outs, lses = [], []
    for start in range(0, rows, block_size):
        stop = min(rows, start + block_size)
        a, e = first + start, first + stop  # key positions of the sub-block
        q_block = q_rows[:, :, start:stop]
        o_block, lse_block = _own_square(q_block, k, v, cum, a, e, scale)
        if start > 0:
            o_block, lse_block = _merge(o_block, lse_block, *_past_keys(q_block, k, v, cum, first, a, a, scale))
        outs.append(o_block)
        lses.append(lse_block)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _own_square(q_block, k, v, cum, a: int, e: int, scale: float):
    """Rows at key positions [a, e) against the same keys, causal, with the exact bias ``c_p - c_τ`` (from float64)
    as a (rows x rows) float mask: (o, lse)."""
    if cum is None:
        return _CPU_FLASH(q_block, k[:, :, a:e], v[:, :, a:e], 0.0, True, scale=scale)
    rows = e - a
    own = (cum[..., a:e, None] - cum[..., None, a:e]).float()  # (B, Hq, rows, rows)
    own.masked_fill_(torch.ones(rows, rows, dtype=torch.bool, device=own.device).triu(1), MASKED)
    return _CPU_FLASH(q_block, k[:, :, a:e], v[:, :, a:e], 0.0, False, attn_mask=own, scale=scale)


def _past_keys(q_block, k, v, cum, key_start: int, key_stop: int, a: int, scale: float):
    """Rows from key position ``a`` on against the keys [key_start, key_stop), all before them: (o, lse), the bias
    split as ``(c_p - c_a) + (c_a - c_τ)``, the key term a broadcast (1 x keys) mask and the row term added to lse."""
    k_past, v_past = k[:, :, key_start:key_stop], v[:, :, key_start:key_stop]
    if cum is None:
        return _CPU_FLASH(q_block, k_past, v_past, 0.0, False, scale=scale)
    ref = cum[..., a : a + 1]  # (B, Hq, 1): c_a
    key_term = (ref - cum[..., key_start:key_stop]).float().unsqueeze(-2)  # (B, Hq, 1, keys), <= 0
    o, lse = _CPU_FLASH(q_block, k_past, v_past, 0.0, False, attn_mask=key_term, scale=scale)
    rows = q_block.shape[2]
    return o, lse + (cum[..., a : a + rows] - ref).float()  # the row term c_p - c_a, <= 0


def _merge(o_1, lse_1, o_2, lse_2):
    """Attention over two disjoint key sets merged by their log-sum-exps: (o, lse)."""
    weight = torch.sigmoid(lse_2 - lse_1).unsqueeze(-1)  # (B, Hq, rows, 1): the second set's share
    return torch.lerp(o_1, o_2, weight), torch.logaddexp(lse_1, lse_2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """scaled_dot_product_attention on (B, H, T, D) tensors with Hq a multiple of Hk."""
    Hq, Hk = q.shape[1], k.shape[1]
    if Hq == Hk:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if _SDPA_HAS_GQA:  # reads key/value head h // G for query head h, without copies
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    k, v = k.repeat_interleave(Hq // Hk, dim=1), v.repeat_interleave(Hq // Hk, dim=1)  # torch < 2.5
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _blockwise_forward(q, k, v, cum, key_valid, scale: float, block_size: int) -> torch.Tensor:
    """Blockwise forgetting attention for autograd (FlashAttention-2 style, plain torch).

    Inputs as `_attention_inference`; returns (B, Hq, Tq, Dv) float32. `_blockwise_backward` recomputes each
    block's probabilities from the inputs and this output.
    """
    B, Hq, Tq, _ = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    q = q * scale  # (B, Hq, Tq, D), a new tensor
    k, v = k.reshape(B * Hk, Tk, -1), v.reshape(B * Hk, Tk, Dv)  # grouped heads, see `_block_probs`
    scratch = _Scratch(q, ("scores", "probs"), B * Hq * block_size * Tk, B, Hq, Tk, block_size,
                       gated=cum is not None, padded=key_valid is not None)
    o = q.new_empty(B, Hq, Tq, Dv)
    for start, stop, first, end in _blocks(Tq, Tk, block_size):
        probs = _block_probs(scratch, q, k, cum, key_valid, start, stop, first)  # (B * Hk, G * rows, E)
        o[:, :, start:stop] = torch.bmm(probs, v[:, :end]).view(B, Hq, stop - start, Dv)
    return o


def _blockwise_backward(do, q, k, v, cum, key_valid, o, scale: float, block_size: int):
    """Gradients of `_blockwise_forward`: (dq, dk, dv, dcum), dcum None without a gate.

    Per block, with S = bias + scale q kᵀ, P = softmax(S), O = P v:
        dP = dO vᵀ,   dS = P ∘ (dP - rowsum(dO ∘ O)),
        dq = scale dS k,   dk += scale dSᵀ q,   dv += Pᵀ dO,
        dc[p_i] += Σ_τ dS_iτ,   dc[τ] -= Σ_i dS_iτ     (bias = c_{p_i} - c_τ; masked entries have P = 0).
    Key/value tensors are handled as (B * Hk, T, D): the G query heads of one key head form one
    (G * rows, D) matrix, so the heads are grouped, never repeated.

    P comes from ``torch.softmax`` (recomputed here) rather than ``exp(S - lse)`` with a saved
    log-sum-exp: ``Tensor.exp`` is 10-35x slower on logits far below the row maximum (masked keys,
    strongly forgotten ones: results that underflow to subnormals or 0), which dominated the whole op
    at 4096 tokens; the softmax kernel's exponential does not slow down there.
    """
    B, Hq, Tq, D = q.shape
    Hk, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    BHk, G = B * Hk, Hq // Hk
    q = q * scale
    k, v = k.reshape(BHk, Tk, D), v.reshape(BHk, Tk, Dv)
    scratch = _Scratch(q, ("scores", "probs", "grads"), B * Hq * block_size * Tk, B, Hq, Tk, block_size,
                       gated=cum is not None, padded=key_valid is not None)
    delta = (do * o).sum(-1)  # (B, Hq, Tq): rowsum(P ∘ dP) = rowsum(dO ∘ O)
    dq = q.new_empty(q.shape)  # contiguous, as the op's fake implementation says
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # summed over the blocks
    dcum = None if cum is None else torch.zeros_like(cum)
    col_sums = None if cum is None else q.new_empty(B, Hq, Tk)
    for start, stop, first, end in _blocks(Tq, Tk, block_size):
        rows = stop - start
        probs = _block_probs(scratch, q, k, cum, key_valid, start, stop, first)  # (B * Hk, G * rows, E)
        do_block = _grouped(do, start, stop, BHk)
        d_scores = scratch.tile("grads", BHk, G * rows, end)
        torch.bmm(do_block, v[:, :end].transpose(1, 2), out=d_scores)  # dP
        d_scores.sub_(_grouped(delta.unsqueeze(-1), start, stop, BHk)).mul_(probs)  # dS
        dq[:, :, start:stop] = torch.bmm(d_scores, k[:, :end]).view(B, Hq, rows, D)
        dk[:, :end].baddbmm_(d_scores.transpose(1, 2), _grouped(q, start, stop, BHk))
        dv[:, :end].baddbmm_(probs.transpose(1, 2), do_block)
        if dcum is not None:
            d_bias = d_scores.view(B, Hq, rows, end)
            dcum[..., first:end] += d_bias.sum(-1)
            dcum[..., :end] -= torch.sum(d_bias, dim=-2, out=col_sums[..., :end])
    dq.mul_(scale)
    return dq, dk.view(B, Hk, Tk, D), dv.view(B, Hk, Tk, Dv), dcum


# -- custom ops: what torch.compile sees (see the module docstring) ---------------------------------------------------
# Shapes as `_attention_inference`: q (B, Hq, Tq, D), k (B, Hk, Tk, D), v (B, Hk, Tk, Dv) float32, any strides (the
# caller passes transposed views); cum (B, Hq, Tk) float64 or None; key_valid (B, Tk) bool or None. Outputs are new
# contiguous tensors (no aliasing, as custom ops require), and the fake implementations say so: the compiler checks
# the strides.


def _op_name(name: str) -> str:
    """``selective_rope::<name>`` for the package's module; a name of its own for each flat copy that travels with a
    saved model (remote code, module ``transformers_modules.<...>.kernels_forgetting_attention_torch``): registering
    an op name again silently replaces its implementation for every earlier caller, so two loaded copies (or a copy
    and the package) would otherwise run whichever was loaded last."""
    if __name__.startswith("selective_rope."):
        return f"selective_rope::{name}"
    return f"selective_rope::{name}_{hashlib.sha1(__name__.encode()).hexdigest()[:12]}"


@torch.library.custom_op(_op_name("forgetting_attention_inference"), mutates_args=())
def _attention_inference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cum: torch.Tensor | None,
                            key_valid: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
    return _attention_inference(q, k, v, cum, key_valid, scale, block_size)


@torch.library.custom_op(_op_name("forgetting_attention_forward"), mutates_args=())
def _blockwise_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cum: torch.Tensor | None,
                          key_valid: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
    return _blockwise_forward(q, k, v, cum, key_valid, scale, block_size)


@_attention_inference_op.register_fake
@_blockwise_forward_op.register_fake
def _(q, k, v, cum, key_valid, scale, block_size):
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op(_op_name("forgetting_attention_backward"), mutates_args=())
def _blockwise_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cum: torch.Tensor | None, key_valid: torch.Tensor | None, o: torch.Tensor, scale: float,
                           block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dcum); dcum is an empty tensor without a gate (custom ops return no None)."""
    dq, dk, dv, dcum = _blockwise_backward(do.contiguous(), q, k, v, cum, key_valid, o, scale, block_size)
    return dq, dk, dv, q.new_empty(0, dtype=torch.float64) if dcum is None else dcum.contiguous()


@_blockwise_backward_op.register_fake
def _(do, q, k, v, cum, key_valid, o, scale, block_size):
    dcum = q.new_empty(0 if cum is None else cum.shape, dtype=torch.float64)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dcum


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cum, key_valid, scale, block_size = inputs
    ctx.save_for_backward(q, k, v, cum, key_valid, output)
    ctx.scale, ctx.block_size = scale, block_size


def _backward(ctx, do):
    q, k, v, cum, key_valid, o = ctx.saved_tensors
    dq, dk, dv, dcum = _blockwise_backward_op(do, q, k, v, cum, key_valid, o, ctx.scale, ctx.block_size)
    return dq, dk, dv, None if cum is None else dcum, None, None, None


_blockwise_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _block_probs(
    scratch: _Scratch,
    q: torch.Tensor,
    k: torch.Tensor,
    cum: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    start: int,
    stop: int,
    first: int,
) -> torch.Tensor:
    """P = softmax(bias + q kᵀ) for one query block, on grouped heads, in the "probs" tile.

    q: (B, Hq, Tq, D) already scaled; k: (B * Hk, Tk, D). Returns the (B * Hk, G * rows, E) tile:
    query head h = hk * G + g reads key head hk, so the G query heads of one key head are one matrix.
    """
    B, Hq = q.shape[:2]
    BHk = k.shape[0]
    rows, end = stop - start, first + stop - start
    scores = _write_block_bias(scratch.tile("scores", B, Hq, rows, end), scratch, cum, key_valid, first)
    scores = scores.view(BHk, -1, end)  # (B * Hk, G * rows, E)
    scores.baddbmm_(_grouped(q, start, stop, BHk), k[:, :end].transpose(1, 2))  # bias + q kᵀ, in place
    return torch.softmax(scores, dim=-1, out=scratch.tile("probs", *scores.shape))


def _grouped(x: torch.Tensor, start: int, stop: int, BHk: int) -> torch.Tensor:
    """Rows [start, stop) of a (B, Hq, T, X) tensor as (B * Hk, G * rows, X): query head h = hk * G + g
    becomes rows [g * rows, (g + 1) * rows) of matrix b * Hk + hk (a small copy)."""
    return x[:, :, start:stop].reshape(BHk, -1, x.shape[-1])
