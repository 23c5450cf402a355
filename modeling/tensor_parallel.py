"""Tensor parallelism (``from_pretrained(path, tp_plan="auto")`` under ``torchrun``): the parallel styles our plans
name besides transformers' own (``configuration/tensor_parallel.py``), and the check a model runs before it is split.

transformers (5.16 on: ``transformers.distributed``) shards the weights its plan names as DTensors and runs its
``colwise`` / ``rowwise`` linear layers on them; everything else in a model computes on plain tensors. Our tensors
indexed by head that are not a ``Linear``'s weight are sharded on their first dim and their module's forward runs on
the local shards, so a module sees this rank's heads only and derives every head count from its tensors' shapes:

- ``"selective_rope_heads"``: short convolutions over q/k/v channels, Gated DeltaNet's ``A_log`` / ``dt_bias``;
- ``"selective_rope_low_rank_heads"``: an ``nn.Sequential`` of a replicated low-rank map and a per-head one (GLA's
  forget gate; transformers' plans cannot name a Sequential's children apart);
- ``"selective_rope_phase"``: the Selective RoPE module as one unit. Its input ``x`` is replicated while its outputs
  (rotated q and k, phases) are this rank's heads, so the gradient each rank sends back to ``x`` is its heads' share
  and is all-reduced (Megatron's ``f``, as ``colwise`` does for its input); so is the gradient of the parameters every
  head shares (the temperature, the first maps of a low-rank gate or of the dense projection). The module learns which
  heads are its own (``head_shard``: rank and number of ranks): its per-head projection reads their input chunks.
"""

from __future__ import annotations

import contextlib

import torch

# The DTensor tensor-parallel API (transformers.distributed, from 5.16 on); 5.15 and older shard with local tensors.
try:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
except ImportError:
    ALL_PARALLEL_STYLES = TensorParallelLayer = None

HEADS, LOW_RANK_HEADS, PHASE = "selective_rope_heads", "selective_rope_low_rank_heads", "selective_rope_phase"


def tensor_parallel_supported() -> bool:
    """Whether this transformers shards models with DTensors (``transformers.distributed``), which our styles need."""
    return TensorParallelLayer is not None and torch.distributed.is_available()


if tensor_parallel_supported():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    class _AllReduceGradient(torch.autograd.Function):
        """Identity forward; the gradient is summed over the tensor-parallel group."""

        @staticmethod
        def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    @contextlib.contextmanager
    def _local_parameters(module: torch.nn.Module, group):
        """For the duration of a forward: every DTensor parameter of ``module`` and its children as its local shard
        (differentiable: gradients reach the DTensor), and every other (replicated) one behind an all-reduce of its
        gradient, since this rank computes only its heads' share of it. Restored afterwards."""
        swapped = []
        grad = torch.is_grad_enabled()
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if isinstance(param, DTensor):
                    owner._parameters[name] = param.to_local()
                elif param is not None and grad and param.requires_grad:
                    owner._parameters[name] = _AllReduceGradient.apply(param, group)
                else:
                    continue
                swapped.append((owner, name, param))
        try:
            yield
        finally:
            for owner, name, param in swapped:
                owner._parameters[name] = param

    def _shard(module: torch.nn.Module, name: str, mesh) -> None:
        """Parameter ``name`` of ``module`` as a DTensor placeholder sharded on its first dim (the loader then reads
        this rank's rows)."""
        meta = module._parameters[name]
        if meta.shape[0] % mesh.size():
            raise ValueError(f"{type(module).__name__}.{name} has {meta.shape[0]} heads or channels along its first "
                             f"dim, which {mesh.size()} tensor-parallel ranks cannot split evenly")
        module._parameters[name] = torch.nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                                      requires_grad=meta.requires_grad)

    def _gradient_all_reduced(x: torch.Tensor, group) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _AllReduceGradient.apply(x, group)
        return x

    class HeadShardedParallel(TensorParallelLayer):
        """Parameters sharded on their first dim (the heads, or channels grouped by head), computed on local shards:
        short convolutions over q/k/v channels, Gated DeltaNet's ``A_log`` / ``dt_bias``."""

        def shard_param(self, module, param, mesh):
            if module._parameters.get(param) is not None:
                _shard(module, param, mesh)

        def install_forward(self, module, mesh):
            original_forward, group = module.forward, mesh.get_group()

            def forward(*args, **kwargs):
                with _local_parameters(module, group):
                    return original_forward(*args, **kwargs)

            module.forward = forward
            return module

    class LowRankHeadsParallel(TensorParallelLayer):
        """``nn.Sequential(Linear(D, r), Linear(r, heads * ...))`` (GLA's low-rank forget gate): the first layer
        replicated, the second sharded by heads as a ``colwise`` layer (its input's gradient all-reduced)."""

        def install_forward(self, module, mesh):
            down, up = module
            group = mesh.get_group()
            for name in [n for n, p in up.named_parameters(recurse=False)]:
                _shard(up, name, mesh)

            def forward(x):
                low = _gradient_all_reduced(down(x), group)  # (..., r), replicated
                with _local_parameters(up, group):
                    return up(low)  # (..., this rank's heads)

            module.forward = forward
            return module

    class SelectiveRotaryParallel(TensorParallelLayer):
        """The Selective RoPE module: the parameters it names per head (``per_head_parameters``) sharded on their
        first dim, the others replicated with their gradients all-reduced, and its input ``x`` (replicated, read for
        every head's phase) with its gradient all-reduced. The module is told its shard (``head_shard``)."""

        def install_forward(self, module, mesh):
            group = mesh.get_group()
            for name in module.per_head_parameters():
                owner_name, _, param = name.rpartition(".")
                _shard(module.get_submodule(owner_name), param, mesh)
            module.head_shard = (mesh.get_local_rank(), mesh.size())
            original_forward = module.forward

            def forward(x, *args, **kwargs):
                x = _gradient_all_reduced(x, group)
                with _local_parameters(module, group):
                    return original_forward(x, *args, **kwargs)

            module.forward = forward
            return module

    def register_parallel_styles() -> None:
        """Make our styles known to transformers (done when the modeling code is imported)."""
        styles = ((HEADS, HeadShardedParallel()), (LOW_RANK_HEADS, LowRankHeadsParallel()),
                  (PHASE, SelectiveRotaryParallel()))
        for name, style in styles:
            if name not in ALL_PARALLEL_STYLES:
                ALL_PARALLEL_STYLES.register(name, style)
else:
    def register_parallel_styles() -> None:
        pass


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter transformers sharded (a DTensor; differentiable), else ``tensor`` itself: for
    a parameter a module's own code reads outside a sharded module's forward."""
    if tensor_parallel_supported() and isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def check_tensor_parallel(config, tp_size: int) -> None:
    """Refuse, with a one-line ``ValueError``, a config that ``tp_size`` ranks cannot split by heads (before any
    weight is loaded)."""
    if tp_size <= 1:
        return
    for field, heads in config.tensor_parallel_heads.items():
        if heads % tp_size:
            raise ValueError(f"`{field}`={heads} cannot be split across tp_size={tp_size} tensor-parallel ranks: "
                             f"each rank must hold whole heads (use a tp_size dividing {heads})")


register_parallel_styles()
