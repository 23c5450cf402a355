"""Tensor-parallel plans (``base_model_tp_plan``): which modules transformers shards, and how, under
``from_pretrained(path, tp_plan="auto")``.

Every projection is sharded by heads, as transformers' Llama plan does: the ones reading the replicated hidden state
are ``"colwise"`` (each rank computes its own heads), the output projection is ``"rowwise"`` (each rank's partial sum,
all-reduced). Per-head norms whose weight all heads share are ``"replicated_with_grad_allreduce"`` (Qwen3's
``q_norm``). The MLP is Llama's; the input embeddings are vocabulary-parallel (the rule transformers adds to Llama's
``embed_tokens``) and the LM head is Llama's ``"colwise_gather_output"``.

Tensors indexed by head that are not a ``Linear``'s weight use our styles (``modeling/tensor_parallel.py``):
``"selective_rope_heads"`` (short convolutions over q/k/v channels, Gated DeltaNet's ``A_log`` / ``dt_bias``: sharded
on their first dim, computed on local tensors), ``"selective_rope_low_rank_heads"`` (GLA's low-rank forget gate, an
``nn.Sequential`` whose children transformers' plans cannot name apart) and ``"selective_rope_phase"`` (the Selective
RoPE module as one unit: its per-head parameters sharded, the replicated mixer input read for every head's phase, the
module told which heads are its own).

The plans are built from the config (a model lists exactly the modules it has, so transformers warns about no rule that
matches nothing) and per part: one function per mixer kind, the MLP and the rotary module, each returning entries under
a prefix. Their ``config`` is whatever the mixer is built from: it reads the same fields (``position_embedding``, and
``use_short_conv``, ``use_gate``, ``use_output_gate``, ``use_forget_gate``, ``qk_norm``, ... as each mixer has them).
A model stacking several mixers (the hybrid) composes the entries of its layers' mixers (``merge_plans``): transformers
matches every layer number as ``*``, so the two mixer kinds under ``layers.*.attn`` share one rule per name, and the
rules they both have agree (``q_proj`` colwise, ``o_proj`` rowwise, ``rotary`` ...); a rule only one kind has matches
nothing in the other's layers. Likewise dense MLPs and sparse MoE blocks (``sparse_moe_plan``) under ``layers.*.mlp``.
"""

from __future__ import annotations

HEADS = "selective_rope_heads"  # first dim sharded by heads, computed on local tensors (modeling/tensor_parallel.py)
LOW_RANK_HEADS = "selective_rope_low_rank_heads"  # Sequential(Linear(D, r) replicated, Linear(r, heads) sharded)
PHASE = "selective_rope_phase"  # the Selective RoPE module (its per-head parameters sharded, input replicated)

# The decoder layers, as the base model names them.
LAYERS = "layers.*"


def mlp_plan(prefix: str = f"{LAYERS}.mlp") -> dict[str, str]:
    """The SwiGLU MLP, as Llama's."""
    return {f"{prefix}.gate_proj": "colwise", f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}


def rotary_plan(config, prefix: str) -> dict[str, str]:
    """The Selective RoPE module ``prefix`` (``....rotary``), one unit: its per-head parameters follow the heads, the
    others (the temperature, the first maps of a low-rank gate and of the dense projection) stay whole. RoPE and NoPE
    have no parameters to split."""
    return {prefix: PHASE} if config.position_embedding == "selective_rope" else {}


def _short_convolutions(config, prefix: str) -> dict[str, str]:
    if not config.use_short_conv:
        return {}
    return {f"{prefix}.{name}_conv1d": HEADS for name in ("q", "k", "v")}


def gla_mixer_plan(config, prefix: str = f"{LAYERS}.attn") -> dict[str, str]:
    """GLA: q (query heads), k, v and the forget gate ``gk`` (key/value heads), output gate, output projection."""
    plan = {f"{prefix}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan |= _short_convolutions(config, prefix)
    # The low-rank forget gate: its first layer replicated, its second one giving each head its gates.
    plan[f"{prefix}.gk_proj"] = LOW_RANK_HEADS
    if config.use_output_gate:
        plan[f"{prefix}.g_proj"] = "colwise"
    plan[f"{prefix}.g_norm"] = "replicated_with_grad_allreduce"
    plan[f"{prefix}.o_proj"] = "rowwise"
    return plan | rotary_plan(config, f"{prefix}.rotary")


def gated_deltanet_mixer_plan(config, prefix: str = f"{LAYERS}.attn") -> dict[str, str]:
    """Gated DeltaNet: q, k (query/key heads), v, β, the decay and the output gate (value heads, grouped behind their
    query/key head, so that a rank holds whole groups), output projection."""
    plan = {f"{prefix}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj")}
    plan |= _short_convolutions(config, prefix)
    plan[f"{prefix}.A_log"] = HEADS
    plan[f"{prefix}.dt_bias"] = HEADS
    if config.use_gate:
        plan[f"{prefix}.g_proj"] = "colwise"
    plan[f"{prefix}.o_norm"] = "replicated_with_grad_allreduce"
    plan[f"{prefix}.o_proj"] = "rowwise"
    return plan | rotary_plan(config, f"{prefix}.rotary")


def attention_mixer_plan(config, prefix: str = f"{LAYERS}.attn") -> dict[str, str]:
    """FoX (softmax attention with a forget gate, a superset of Llama's): q, k, v, o as Llama's; the forget gate per
    query head, the key/value shifts per key/value head; the per-head norms (weights shared by the heads) replicated."""
    plan = {f"{prefix}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan[f"{prefix}.o_proj"] = "rowwise"
    if config.use_forget_gate:
        plan[f"{prefix}.f_proj"] = "colwise"
    if config.use_k_shift:
        plan[f"{prefix}.k_shift_proj"] = "colwise"
    if config.use_v_shift:
        plan[f"{prefix}.v_shift_proj"] = "colwise"
    if config.qk_norm:
        plan[f"{prefix}.q_norm"] = "replicated_with_grad_allreduce"
        plan[f"{prefix}.k_norm"] = "replicated_with_grad_allreduce"
    if config.use_output_norm:
        plan[f"{prefix}.o_norm"] = "replicated_with_grad_allreduce"
    if config.use_output_gate and not config.output_gate_in_q_proj:
        plan[f"{prefix}.g_proj"] = "colwise"
    # A gate carried in q_proj is packed per head ([query | gate] rows of each head, viewed (B, T, H, 2 * head_dim)):
    # a colwise split of its rows gives each rank whole heads with their gates.
    return plan | rotary_plan(config, f"{prefix}.rotary")


def sparse_moe_plan(prefix: str = f"{LAYERS}.mlp") -> dict[str, str]:
    """The sparse MoE block, as transformers' Qwen3-Next plan: every expert split along its intermediate dim (the
    stacked ``gate_up_proj`` ``(E, 2I, D)`` packed colwise, each rank taking its share of the gate rows and of the up
    rows; ``down_proj`` ``(E, D, I)`` rowwise), the experts module ``moe_tp_experts`` (the routing weights' gradient and
    the partial outputs summed over the ranks), the shared expert as Llama's MLP. The router (``gate``) and the shared
    expert's gate stay whole: each rank routes the replicated input alike."""
    return {f"{prefix}.experts.gate_up_proj": "packed_colwise", f"{prefix}.experts.down_proj": "rowwise",
            f"{prefix}.experts": "moe_tp_experts", **mlp_plan(f"{prefix}.shared_expert")}


def merge_plans(*plans: dict[str, str]) -> dict[str, str]:
    """The union of several plans whose rules name modules by pattern (transformers matches every layer number as
    ``*``, so two kinds of layers share their rules): a name two plans give different styles is refused."""
    merged: dict[str, str] = {}
    for plan in plans:
        for name, style in plan.items():
            if merged.setdefault(name, style) != style:
                raise ValueError(f"tensor-parallel rule {name!r} is {merged[name]!r} for one kind of layer and "
                                 f"{style!r} for another: transformers cannot tell the layers apart")
    return merged


def base_model_plan(mixer_plans: dict[str, str], mlp_plans: dict[str, str] | None = None) -> dict[str, str]:
    """A base model's plan: vocabulary-parallel input embeddings, the mixers' entries, the MLP (``mlp_plans``;
    default: the dense MLP of every layer)."""
    return {"embeddings": "embedding_rowwise", **mixer_plans, **(mlp_plan() if mlp_plans is None else mlp_plans)}


# Pipeline parallelism (transformers' `base_model_pp_plan`) does not apply: our base model's layers take the decoding
# state and the padding layout of the whole call, not `(hidden_states, attention_mask)` alone.
