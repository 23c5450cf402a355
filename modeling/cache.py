"""The decoding cache: one :class:`SelectiveRopeCacheLayer` per model layer, inside a transformers ``Cache``.

A layer holds named tensors whose first dimension is the batch: the recurrent state, short-convolution histories and
the Selective RoPE state (``rotary.phase``, ``rotary.phase_conv``). Beam search, ``num_return_sequences`` and batch
selection act on every tensor alike, so a new family only chooses names. Entries a mixer grew with
``LayerState.extend`` (FoX's keys, values, log forget gates) are per-token histories ``(B, T_seen, ...)``, appended to
by :func:`append_tokens`: ``crop`` shortens them. Any other entry is a running state (a recurrence, a convolution
history, a phase) that cannot be rolled back, so ``crop`` refuses layers that hold one.

Every forward that keeps its state mutates the cache: it replaces entries, appends to histories in place, and may
overwrite a running state's tensor with the next value (the compiled CPU rotary step does, ``overwrite_state``).
Branch from a ``copy.deepcopy`` of a cache; clone a tensor read from it that must outlive the next call.

:class:`SelectiveRopeStaticCache` (``generate(..., cache_implementation="static")``) holds the same names in tensors
allocated once, at the prefill, and written in place afterwards: running states by the decoding kernels (see
``LayerState.in_place``) or else copied into their tensors,
per-token histories are written at the cache's position into buffers of ``max_cache_len`` tokens whose unwritten slots
a mixer masks (``LayerState.fixed_length``). Every tensor keeps its address across steps, which is what
``torch.compile`` (and CUDA graphs) need; design notes in docs/compiled_decoding.md.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def append_tokens(cached: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """``cat([cached, new], dim=1)`` for a per-token history, without copying the whole history every step.

    When not recording gradients, the history ``(B, T, ...)`` is kept as the front of a buffer ``(B, capacity, ...)``
    (grown by doubling): ``new`` is written in place after it and the longer front is returned, so decoding copies
    O(1) tokens per step instead of O(T). The room is read from the strides, not from ``Tensor._base``, which
    ``torch.inference_mode`` does not keep. A cached tensor without room (fresh from beam reordering or
    ``batch_select_indices``) is copied into a new buffer once; ``crop`` slices the front, and the freed slots are
    then overwritten. Like every cache update this mutates the cache: branch from a ``copy.deepcopy`` of it.

    The buffer keeps the time axis next to the last dim in memory (``_buffer``): keys and values ``(B, T, H, D)``
    are stored head by head, so attention reads each head's ``(T, D)`` keys as one dense matrix (a decoding step's
    matrix products over a time-major cache took ~2x as long at 4k tokens).
    """
    if cached is None:
        return new
    batch, length, *inner = cached.shape
    extra = new.shape[1]
    # Training through a cache: keep autograd's view of every tensor intact. Under torch.compile: the buffer's
    # storage introspection breaks the graph (and recompiles per dtype and rank), while a concatenation traces.
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return torch.cat([cached, new], dim=1)
    room = _room(cached) if batch else 0
    if room >= length + extra:
        buffer = cached.as_strided((batch, room, *inner), cached.stride())
    else:
        buffer = _buffer(cached, max(2 * (length + extra), 64))
        buffer[:, :length].copy_(cached)
    buffer[:, length:length + extra].copy_(new)
    return buffer[:, :length + extra]


def _buffer(like: torch.Tensor, capacity: int) -> torch.Tensor:
    """An empty ``(B, capacity, *inner)`` buffer like ``like``, laid out in memory as ``(B, *inner[:-1], capacity,
    inner[-1])``: each token's last dim stays contiguous and, for ``(B, T, H, D)``, each head's rows follow each other
    in time."""
    batch, _, *inner = like.shape
    if not inner:
        return like.new_empty(batch, capacity)
    return like.new_empty(batch, *inner[:-1], capacity, inner[-1]).movedim(-2, 1)


def _room(cached: torch.Tensor) -> int:
    """The time capacity of the buffer whose front ``cached`` is (its own length if it is not such a front)."""
    batch, length, *inner = cached.shape
    token = math.prod(inner)
    if token == 0 or cached.storage_offset() or cached.stride(0) % token:
        return length
    capacity = cached.stride(0) // token  # the batch stride of a buffer is capacity * token
    if capacity < length or cached.stride() != _buffer_strides(cached.shape, capacity):
        return length
    fits = cached.untyped_storage().nbytes() >= batch * capacity * token * cached.element_size()
    return capacity if fits else length


def _buffer_strides(shape: torch.Size, capacity: int) -> tuple[int, ...]:
    """The strides of ``_buffer(tensor of this shape, capacity)`` (and of its fronts)."""
    batch, _, *inner = shape
    layout = (batch, *inner[:-1], capacity, *inner[-1:])  # time just before the last dim, or last when there is none
    strides = [0] * len(layout)
    step = 1
    for dim in reversed(range(len(layout))):
        strides[dim] = step
        step *= layout[dim]
    time_dim = len(layout) - (2 if inner else 1)
    return (strides[0], strides[time_dim], *strides[1:time_dim], *strides[time_dim + 1:])


class SelectiveRopeCacheLayer(CacheLayerMixin):
    is_compileable = False
    fixed_length = False  # per-token histories are exactly the tokens seen (a static layer's are max-length buffers)
    is_sliding = False
    supports_early_init = False  # shapes are only known to the mixer, on its first call

    def __init__(self):
        super().__init__()
        self.states: dict[str, torch.Tensor] = {}
        self.token_states: frozenset[str] = frozenset()
        self.seen_tokens = 0

    def __repr__(self):
        shapes = {name: tuple(t.shape) for name, t in self.states.items()}
        return f"{self.__class__.__name__}(seen_tokens={self.seen_tokens}, states={shapes})"

    # -- what the model uses ----------------------------------------------------------------------------------------
    def commit(self, states: dict[str, torch.Tensor], num_new_tokens: int, token_states=()) -> None:
        """Store the states a mixer left after a forward over ``num_new_tokens`` columns (padding included);
        ``token_states`` names the per-token histories among them (see ``LayerState``)."""
        self.states.update(states)
        self.token_states = frozenset(token_states)
        self.seen_tokens += num_new_tokens
        self.is_initialized = True

    def extend(self, name: str, cached: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """The per-token history ``name`` (``cached``, before this call) followed by ``tokens``: ``append_tokens``."""
        return append_tokens(cached, tokens)

    # -- the transformers cache-layer interface -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("selective-rope layers keep named states, written by the model (`commit`), not "
                                  "key/value pairs (`update`)")

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # get_max_length's name (abstract) before transformers 5.13
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        self.states.clear()
        self.seen_tokens = 0
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("selective-rope caches cannot be offloaded")

    def prefetch(self):
        raise NotImplementedError("selective-rope caches cannot be offloaded")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers 5 convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.states:
            return
        running = sorted(set(self.states) - self.token_states)
        if running:
            raise NotImplementedError(f"this cache holds running states that cannot be rolled back "
                                      f"({', '.join(running)}): crop needs a model whose whole state is per-token "
                                      "(FoX with RoPE or NoPE and no key/value shift)")
        removed = min(-tokens_to_remove, self.seen_tokens)
        self._map(lambda t: t[:, : t.shape[1] - removed])
        self.seen_tokens -= removed

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def _map(self, fn) -> None:
        self.states = {name: fn(t) for name, t in self.states.items()}


class SelectiveRopeStaticCacheLayer(SelectiveRopeCacheLayer):
    """A layer whose tensors are allocated once, at the first forward (the prefill: shapes are only known to the
    mixer), and then only written in place, so that a compiled decoding step sees the same tensors every step.

    Running states are written into their tensors by the decoding kernels (``LayerState.in_place``), or else copied
    there at ``commit``; per-token histories are buffers ``(B, max_cache_len,
    ...)`` written at ``position`` (a tensor: a compiled step reads it without a host synchronisation and without
    recompiling as it grows). Unwritten slots hold zeros, so a mixer must mask them (FoX keeps a ``valid`` history
    for that). A step past ``max_cache_len`` is refused (an assertion on ``position``, made on the device), and so is
    a prefill of more rows than ``max_batch_size``.
    """

    is_compileable = True
    fixed_length = True

    def __init__(self, max_cache_len: int, max_batch_size: int | None = None):
        super().__init__()
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive int or None, got {max_batch_size!r}")
        self.max_cache_len, self.max_batch_size = max_cache_len, max_batch_size
        self.position = torch.zeros((), dtype=torch.long)  # tokens written so far (padding included)

    def __repr__(self):
        shapes = {name: tuple(t.shape) for name, t in self.states.items()}
        return f"{self.__class__.__name__}(max_cache_len={self.max_cache_len}, states={shapes})"

    def commit(self, states: dict[str, torch.Tensor], num_new_tokens: int, token_states=()) -> None:
        """Copy the running states into the layer's tensors (allocated here at the first call), but for those a
        kernel wrote there already (handed back as the layer's own tensors); the per-token histories were written
        by ``extend`` already."""
        first = not self.is_initialized
        for name, tensor in states.items():
            if name in token_states:
                continue
            target = self.states.get(name)
            if target is None:
                if not first:
                    raise RuntimeError(f"the static cache has no tensor for the state {name!r}, which first appeared "
                                       "after the prefill: a static cache cannot allocate state while decoding")
                self._check_batch(tensor.shape[0])
                self.states[name] = self._own(tensor.clone(memory_format=torch.contiguous_format))
            elif target is not tensor:  # (else a kernel wrote into it already)
                target.copy_(tensor)
        self.token_states = frozenset(token_states)
        self.position.add_(num_new_tokens)
        self.is_initialized = True

    def extend(self, name: str, cached: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
        """Write ``tokens`` ``(B, T, ...)`` at ``position`` into the buffer ``name`` (allocated at the prefill) and
        return the history the mixer attends over: at the prefill the ``T`` tokens themselves; for one token per row
        the whole buffer ``(B, max_cache_len, ...)``, whose slots after this token are unwritten (masked by the
        mixer); for several tokens after the prefill, the written front (eager only: its length is read from the
        device)."""
        batch, length = tokens.shape[:2]
        buffer = self.states.get(name)
        if buffer is None:
            if self.is_initialized:
                raise RuntimeError(f"the static cache has no buffer for the history {name!r}, which first appeared "
                                   "after the prefill: a static cache cannot allocate state while decoding")
            self._check_batch(batch)
            if length > self.max_cache_len:
                raise ValueError(f"the prompt has {length} tokens but the static cache holds at most "
                                 f"{self.max_cache_len} (max_cache_len)")
            buffer = tokens.new_zeros(batch, self.max_cache_len, *tokens.shape[2:])
            buffer[:, :length].copy_(tokens)
            self.states[name] = self._own(buffer)
            return tokens
        end = self.position + length
        torch._assert_async(end <= self.max_cache_len, f"the static cache is full: it holds {self.max_cache_len} "
                            "tokens (max_cache_len) and cannot take more; build it with a larger max_cache_len")
        buffer.index_copy_(1, torch.arange(length, device=buffer.device) + self.position, tokens.to(buffer.dtype))
        if length == 1:
            return buffer
        if torch.compiler.is_compiling():
            raise RuntimeError("a compiled forward with a static cache takes one token per row after the prefill; "
                               f"got {length}")
        return buffer[:, :int(end)]

    def _check_batch(self, batch: int) -> None:
        if self.max_batch_size is not None and batch > self.max_batch_size:
            raise ValueError(f"the input has {batch} sequences but the static cache was built for at most "
                             f"{self.max_batch_size} (max_batch_size)")

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the layer keeps for good: its address is fixed for compiled steps and CUDA graphs."""
        if self.position.device != tensor.device:
            self.position = self.position.to(tensor.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(tensor)
            torch._dynamo.mark_static_address(self.position)
        return tensor

    def get_seq_length(self) -> int:
        # The tokens written (a host read of the device counter; a compiled step does not ask).
        return int(self.position)

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def reset(self) -> None:
        """Forget the sequences, keeping the tensors (and their addresses): the next forward is a prefill again."""
        for tensor in self.states.values():
            tensor.zero_()
        self.position.zero_()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a static selective-rope cache cannot be cropped")

    def _map(self, fn) -> None:
        raise NotImplementedError("a static selective-rope cache keeps its batch: beam search, num_return_sequences "
                                  "and batch selection need the dynamic cache (SelectiveRopeCache)")


class SelectiveRopeCache(Cache):
    """Cache for every selective-rope family. Created by the model's ``forward`` when ``use_cache`` is set and none
    is given (``generate`` relies on that), or up front: ``SelectiveRopeCache(model.config)``."""

    def __init__(self, config):
        super().__init__(layers=[SelectiveRopeCacheLayer() for _ in range(config.num_hidden_layers)])
        self.model_type = config.model_type  # a family's states mean nothing to another's model: refused there

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    @property
    def is_initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)


class SelectiveRopeStaticCache(SelectiveRopeCache):
    """The cache of a compiled decoding step: every layer's tensors allocated once (at the prefill), for up to
    ``max_cache_len`` tokens (prompt included) and ``max_batch_size`` sequences, then written in place (see
    :class:`SelectiveRopeStaticCacheLayer`). ``generate(..., cache_implementation="static")`` builds one."""

    def __init__(self, config, max_cache_len: int, max_batch_size: int | None = None):
        Cache.__init__(self, layers=[SelectiveRopeStaticCacheLayer(max_cache_len, max_batch_size)
                                     for _ in range(config.num_hidden_layers)])
        self.model_type = config.model_type

    @property
    def max_cache_len(self) -> int:
        return self.layers[0].max_cache_len

    @property
    def max_batch_size(self) -> int | None:
        return self.layers[0].max_batch_size
