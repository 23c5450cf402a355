"""What the base model accepts, checked once at its entry.

Every input is validated here, with a one-line ``ValueError`` naming the argument, before any layer runs: token ids
or embeddings, the padding mask, the cache, and the markers of packed sequences. The packing conventions in use
(ours and transformers') all become one validated ``cu_seqlens`` here, so the layers see a single form:

- ``cu_seqlens``: flash-linear-attention's offsets ``[0, l_1, l_1 + l_2, ..., total]``;
- ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (+ ``max_length_q`` / ``max_length_k``): transformers' flash-attention
  keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``); q and k must be the same offsets;
- ``position_ids`` restarting at 0 at each sequence start (``DataCollatorWithFlattening``'s default output);
- ``seq_idx``: the sequence index of each token (``DataCollatorWithFlattening(return_seq_idx=True)``).

Values are checked in eager calls only (the prefill of ``generate`` among them). Under ``torch.compile`` the checks
that read values (token ids in the vocabulary, a mask of 0 and 1) are skipped: each is a host synchronisation, which a
compiled decoding step (CUDA graphs) must not make; shapes and dtypes are still checked there.

Positions are otherwise implicit in these models (Selective RoPE's phase and RoPE count the real tokens of each row),
so ``position_ids`` that do not mark packed sequences must be those positions; anything else is refused rather than
silently ignored. The same goes for keyword arguments: those transformers passes (``generate``, ``Trainer``, PEFT) are
accepted, any other name is a ``TypeError``.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from .cache import SelectiveRopeCache
from .layout import check_offsets, is_integer

# Keyword arguments transformers' callers may pass that need nothing from us, or only a value we support.
IGNORED_KWARGS = {
    "num_items_in_batch": "the loss normaliser from Trainer (used by the causal-LM head's loss)",
    "cache_position": "legacy positions of the new tokens in the cache (the cache counts them itself)",
}
SUPPORTED_FLAGS = {  # name -> (accepted values, why others are refused)
    "output_router_logits": ((None, False), "these models have no mixture-of-experts router"),
    "is_causal": ((None, True), "these models are causal only"),
}
IGNORE_INDEX = -100  # the label the loss skips (transformers' loss functions' ignore_index)
PACKING_KWARGS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# transformers 5.24 renamed the cache, as the argument of forward and as the field of its outputs, from
# `past_key_values` to `cache` (the old name is deprecated until 5.40). The models take either name (generate passes
# the installed version's) and return the cache under the installed version's field name.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def one_cache(past_key_values, cache):
    """The cache passed as ``past_key_values`` (transformers < 5.24) or as ``cache`` (5.24 on), not both."""
    if past_key_values is not None and cache is not None:
        raise ValueError("pass the cache once, as `cache` or as `past_key_values` (its name before transformers "
                         "5.24), not both")
    return past_key_values if cache is None else cache


def returned_cache(outputs):
    """The cache a forward returned: ``outputs.cache`` from transformers 5.24 on, ``outputs.past_key_values`` before."""
    return getattr(outputs, CACHE_FIELD)


def check_kwargs(kwargs: dict, owner: str) -> dict:
    """Split ``forward``'s ``**kwargs``: returns the packing markers; refuses unknown names and unsupported flags."""
    unknown = sorted(set(kwargs) - set(IGNORED_KWARGS) - set(SUPPORTED_FLAGS) - set(PACKING_KWARGS))
    if unknown:
        accepted = sorted([*IGNORED_KWARGS, *SUPPORTED_FLAGS, *PACKING_KWARGS])
        raise TypeError(f"{owner}.forward() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"besides its named parameters it accepts {', '.join(accepted)}")
    for name, (accepted, why) in SUPPORTED_FLAGS.items():
        if name in kwargs and kwargs[name] not in accepted:
            raise ValueError(f"`{name}`={kwargs[name]!r} is not supported: {why}")
    return {name: kwargs[name] for name in PACKING_KWARGS if kwargs.get(name) is not None}


def check_tokens(input_ids, inputs_embeds, vocab_size: int, hidden_size: int) -> tuple[int, int]:
    """``(B, T)`` of ``input_ids`` ``(B, T)`` (integer, within the vocabulary) or ``inputs_embeds`` ``(B, T, D)``."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        _require_tensor("input_ids", input_ids, "an int64 or int32 tensor of shape (B, T)")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):  # what nn.Embedding takes
            raise ValueError(f"input_ids must be an int64 or int32 tensor of shape (B, T); got {input_ids.dtype} of "
                             f"shape {tuple(input_ids.shape)}")
        _require_nonempty("input_ids", input_ids.shape[:2])
        if torch.compiler.is_compiling():  # values: checked in eager calls only (module docstring)
            return tuple(input_ids.shape)
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input_ids must be token ids in [0, {vocab_size}) (vocab_size); got values in "
                             f"[{low}, {high}]")
        return tuple(input_ids.shape)
    _require_tensor("inputs_embeds", inputs_embeds, f"a float tensor of shape (B, T, {hidden_size})")
    if inputs_embeds.dim() != 3 or not inputs_embeds.is_floating_point() or inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(f"inputs_embeds must be a float tensor of shape (B, T, {hidden_size}) (hidden_size); got "
                         f"{inputs_embeds.dtype} of shape {tuple(inputs_embeds.shape)}")
    _require_nonempty("inputs_embeds", inputs_embeds.shape[:2])
    return tuple(inputs_embeds.shape[:2])


def check_labels(labels, input_ids, inputs_embeds, vocab_size: int, name: str = "labels"):
    """``labels`` as the loss takes them (int64), or None: an int64 or int32 tensor of the ``(B, T)`` of ``input_ids``
    / ``inputs_embeds``, holding -100 (ignored) or token ids in ``[0, vocab_size)``. ``name``: the argument's name
    in errors (``labels``, or ``shift_labels``, which are checked the same way).

    Checked before the forward runs: a (B, T, 1) or flattened tensor would give a NaN or shifted loss silently, and
    other shapes or ids fail only after the whole forward, in ``cross_entropy``, without naming ``labels``."""
    if labels is None:
        return None
    tokens = input_ids if input_ids is not None else inputs_embeds
    # The grid is only known from a token input that is a tensor; a malformed one is refused by check_tokens.
    grid = tuple(tokens.shape[:2]) if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else None
    expected = f"an int64 or int32 tensor of shape {grid or '(B, T)'} (the batch and length of the tokens)"
    _require_tensor(name, labels, expected)
    if labels.dtype not in (torch.int64, torch.int32) or labels.dim() != 2 or grid not in (None, labels.shape):
        raise ValueError(f"{name} must be {expected}; got {labels.dtype} of shape {tuple(labels.shape)}")
    # Values: in eager calls only (module docstring); an empty input is refused by check_tokens, naming it.
    if labels.numel() and not torch.compiler.is_compiling():
        ignored = labels == IGNORE_INDEX  # left out of the range (all ignored: an empty range, which passes)
        limits = torch.iinfo(labels.dtype)
        extremes = torch.stack([labels.masked_fill(ignored, limits.max).min(),
                                labels.masked_fill(ignored, limits.min).max()])
        low, high = extremes.tolist()  # one sync, as for input_ids
        if low < 0 or high >= vocab_size:
            raise ValueError(f"{name} must be {IGNORE_INDEX} (ignored) or token ids in [0, {vocab_size}) "
                             f"(vocab_size); got values other than {IGNORE_INDEX} in [{low}, {high}]")
    return labels.long()


def check_cache(cache, num_layers: int, model_type: str) -> None:
    """``cache`` (or ``past_key_values``): None or a :class:`SelectiveRopeCache` built for this model type, with one
    layer per model layer."""
    if cache is None:
        return
    if not isinstance(cache, SelectiveRopeCache):
        raise TypeError(f"the cache (cache / past_key_values) must be a SelectiveRopeCache (these models carry "
                        f"recurrent state), got {type(cache).__name__}")
    built_for = getattr(cache, "model_type", model_type)  # (a cache pickled before it recorded one: not checked)
    if built_for != model_type:
        raise ValueError(f"the cache (cache / past_key_values) holds the states of a {built_for} model, not of this "
                         f"{model_type} model: build it with SelectiveRopeCache(model.config)")
    if len(cache.layers) != num_layers:
        raise ValueError(f"the cache (cache / past_key_values) has {len(cache.layers)} layers but the model has "
                         f"{num_layers}: build it with SelectiveRopeCache(model.config)")


def padding_mask(attention_mask, batch: int, seq_len: int, past_len: int) -> torch.Tensor | None:
    """The bool ``(B, T_past + T)`` or ``(B, T)`` padding mask (True = real token) from ``attention_mask``, or None.
    ``past_len`` None (a compiled step with a static cache, which does not read its length): any width from ``T``.

    Accepts bool, integer or float tensors holding only 0 (padding) and 1 (real token), as transformers' models do.
    An additive mask (0 = keep, -inf = pad) would read inverted, so values other than 0 and 1 are refused, and so is
    a float mask of zeros only (an additive mask keeping everything looks exactly like that).
    """
    if attention_mask is None:
        return None
    _require_tensor("attention_mask", attention_mask, "a tensor of shape (B, T) or (B, T_past + T)")
    if past_len is None:
        allowed, fits = f"at least T={seq_len} (this call's tokens come last)", attention_mask.shape[-1] >= seq_len
    else:
        allowed = (f"T={seq_len} (this call's tokens)" if past_len == 0 else
                   f"T={seq_len} (this call's tokens) or T_past + T = {past_len + seq_len} (with the {past_len} "
                   "tokens already in the cache)")
        fits = attention_mask.shape[-1] in (seq_len, past_len + seq_len)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or not fits:
        raise ValueError(f"attention_mask must be a 2-D padding mask of shape (B={batch}, L) with L = {allowed}; got "
                         f"shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_complex():
        raise ValueError(f"attention_mask must be bool or hold 0 and 1; got {attention_mask.dtype}")
    if torch.compiler.is_compiling():  # values: checked in eager calls only (module docstring)
        return attention_mask.bool()
    binary = (attention_mask == 0) | (attention_mask == 1)
    if not bool(binary.all()):
        example = attention_mask[~binary].flatten()[0].item()
        raise ValueError(f"attention_mask must hold 1 for real tokens and 0 for padding (or be bool); got the value "
                         f"{example!r}. An additive mask (0 = keep, -inf = pad) is not accepted: pass `mask == 0`")
    if attention_mask.is_floating_point() and not bool(attention_mask.any()):
        raise ValueError("attention_mask is a float tensor of zeros only: ambiguous between an additive mask that "
                         "keeps every token and a padding mask where every token is padding; pass a bool or 0/1 "
                         "integer mask (1 = real token), or no mask")
    return attention_mask.bool()


def packed_offsets(cu_seqlens, position_ids, markers: dict, batch: int, seq_len: int, mask: torch.Tensor | None,
                   past_len: int) -> torch.Tensor | None:
    """One validated ``cu_seqlens`` (int32) from every packing marker given, or None.

    Markers that are given must agree. ``position_ids`` that mark no packing must be the implicit positions, which
    say one sequence per row: given with another marker, that marker must say so too (``cu_seqlens`` ``[0, T]``).
    """
    candidates = {}
    if cu_seqlens is not None:
        candidates["cu_seqlens"] = check_offsets("cu_seqlens", cu_seqlens, seq_len)
    if "cu_seq_lens_q" in markers or "cu_seq_lens_k" in markers:
        candidates["cu_seq_lens_q"] = _flash_offsets(markers, seq_len)
    if "seq_idx" in markers:
        candidates["seq_idx"] = _offsets_from_seq_idx(markers["seq_idx"], seq_len)
    if position_ids is not None:
        if past_len is None:
            raise ValueError("position_ids are not accepted by a compiled step with a static cache (positions are "
                             "implicit in these models): leave them out")
        offsets = _offsets_from_positions(position_ids, batch, seq_len, mask, past_len)
        if offsets is None and candidates:  # the implicit positions say one sequence: so must every packing marker
            offsets = _boundaries(position_ids.new_empty(0), seq_len, position_ids.device)  # [0, T]
        if offsets is not None:
            candidates["position_ids"] = offsets
    if not candidates:
        return None
    (first_name, offsets), *others = candidates.items()
    for name, other in others:
        # Every candidate starts at 0 and ends at T: two of length 2 agree without a look at the values (no sync).
        if other.shape != offsets.shape or (len(offsets) > 2 and not bool((other.to(offsets.device) == offsets).all())):
            raise ValueError(f"{first_name} {offsets.tolist()} and {name} (as offsets {other.tolist()}) mark "
                             "different packed sequences")
    if batch != 1:
        raise ValueError(f"packed sequences ({first_name}) need a batch of 1, got {batch}")
    if mask is not None and not bool(mask.all()):
        raise ValueError(f"pass either packed sequences ({first_name}) or padding (an attention_mask with zeros), "
                         "not both")
    return offsets.to(torch.int32)


def _flash_offsets(markers: dict, seq_len: int) -> torch.Tensor:
    """transformers' flash-attention packing: ``cu_seq_lens_q == cu_seq_lens_k`` (self-attention), max lengths."""
    if "cu_seq_lens_q" not in markers or "cu_seq_lens_k" not in markers:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k go together (transformers' flash-attention packing)")
    q = check_offsets("cu_seq_lens_q", markers["cu_seq_lens_q"], seq_len)
    k = check_offsets("cu_seq_lens_k", markers["cu_seq_lens_k"], seq_len)
    if q.shape != k.shape or not bool((q == k.to(q.device)).all()):
        raise ValueError(f"cu_seq_lens_q {q.tolist()} and cu_seq_lens_k {k.tolist()} differ: these causal models "
                         "pack self-attention sequences only")
    longest = int(q.diff().max())
    for name in ("max_length_q", "max_length_k"):
        value = markers.get(name)
        if value is not None and int(value) != longest:
            raise ValueError(f"{name}={value} but the longest packed sequence in cu_seq_lens_q has {longest} tokens")
    return q


def _offsets_from_seq_idx(seq_idx, seq_len: int) -> torch.Tensor:
    """``seq_idx`` ``(1, T)``: 0, 0, 1, 1, 1, 2, ... (each sequence's index on its tokens)."""
    _require_tensor("seq_idx", seq_idx, f"an integer tensor of shape (1, {seq_len})")
    if seq_idx.shape != (1, seq_len) or not is_integer(seq_idx):
        raise ValueError(f"seq_idx must be an integer tensor of shape (1, {seq_len}); got {seq_idx.dtype} of shape "
                         f"{tuple(seq_idx.shape)}")
    index = seq_idx[0].long()
    steps = index.diff()
    if int(index[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
        raise ValueError("seq_idx must number the packed sequences 0, 1, 2, ... in order, each on its own tokens")
    starts = torch.nonzero(steps, as_tuple=True)[0] + 1
    return _boundaries(starts, seq_len, index.device)


def _offsets_from_positions(position_ids, batch: int, seq_len: int, mask: torch.Tensor | None,
                            past_len: int) -> torch.Tensor | None:
    """Packed-sequence offsets if ``position_ids`` restart at 0 (batch 1, nothing cached, no padding); None if they
    are the implicit positions; otherwise an error."""
    _require_tensor("position_ids", position_ids, f"an integer tensor of shape (B, {seq_len})")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len \
            or not is_integer(position_ids):
        raise ValueError(f"position_ids must be an integer tensor of shape ({batch}, {seq_len}) or (1, {seq_len}); "
                         f"got {position_ids.dtype} of shape {tuple(position_ids.shape)}")
    positions = position_ids.long().expand(batch, seq_len)
    valid = torch.ones(batch, seq_len, dtype=torch.bool, device=positions.device) if mask is None \
        else mask[:, -seq_len:].to(positions.device)
    # The positions these models count: real tokens before this call, then this call's real tokens in order.
    if mask is not None and mask.shape[1] > seq_len:
        before = mask[:, :-seq_len].sum(dim=1).to(positions.device)
    else:
        before = torch.full((batch,), past_len, device=positions.device)
    implicit = before[:, None] + valid.long().cumsum(dim=1) - 1
    if bool(((positions == implicit) | ~valid).all()):
        return None
    if batch == 1 and past_len == 0 and bool(valid.all()):
        row = positions[0]
        restarts = row.diff() != 1
        if int(row[0]) == 0 and bool((row[1:][restarts] == 0).all()):
            starts = torch.nonzero(restarts, as_tuple=True)[0] + 1
            return _boundaries(starts, seq_len, row.device)
    raise ValueError("position_ids must either mark packed sequences (a batch of 1, nothing cached, no padding, "
                     "positions restarting at 0 at each sequence start, as DataCollatorWithFlattening gives) or be "
                     "the positions these models count themselves (each row's real tokens numbered from 0, "
                     "continuing the cache); other positions are not supported (Selective RoPE's phase and RoPE "
                     "count tokens), so leave position_ids out")


def _boundaries(starts: torch.Tensor, seq_len: int, device) -> torch.Tensor:
    ends = torch.tensor([0, seq_len], device=device)
    return torch.cat([ends[:1], starts.to(device), ends[1:]])


def _require_tensor(name: str, value, expected: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be {expected}; got {type(value).__name__}")


def _require_nonempty(name: str, grid) -> None:
    if grid[0] == 0 or grid[1] == 0:
        raise ValueError(f"{name} has shape {tuple(grid)}: need a batch of at least 1 and at least one token")
