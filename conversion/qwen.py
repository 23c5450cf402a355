"""Qwen3.5 (dense and MoE, text or the language model of the vision-language checkpoints) and Qwen3-Next checkpoints
as :class:`SelectiveRopeHybridForCausalLM`.

Our hybrid runs their layers with the families' own mixers (SPEC §0): their gated attention is SelectiveRopeFoX
without forget gate (q/k norms zero-centred, the output gate carried in ``q_proj``, partial RoPE with the source's own
inverse frequencies), their Gated DeltaNet is ours after a weight remap (:func:`hybrid_recipes`): the fused input
projections split into q/k/v/gate/β/decay projections, the one convolution over q|k|v into three. Block, final and q/k
norms are zero-centred in both and carried as they are. Qwen3.5's interleaved mRoPE is plain RoPE for text positions
(every section reads the same position), which is all a text model sees.

The source's own code is the probe's reference (:func:`load_source_model`): transformers binds
flash-linear-attention's Triton kernels for these models when fla is installed, and they fail on CPU tensors, so the
reference is built from a copy of transformers' modeling module executed with fla (and causal-conv1d) hidden.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..configuration.hybrid import SelectiveRopeHybridConfig
from ..configuration.position_embedding import token_ids_in_vocabulary

# model_type -> (transformers' model package, causal-LM class, rotary class); "..._text" are the text configs of the
# vision-language checkpoints (what a Qwen3.5 ...ForCausalLM saves), the plain names the whole checkpoints.
QWEN_HYBRID_SOURCES = {
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextRotaryEmbedding"),
    "qwen3_5": ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextRotaryEmbedding"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextRotaryEmbedding"),
}
QWEN_HYBRID_TYPES = tuple(QWEN_HYBRID_SOURCES)
# What a vision-language checkpoint carries besides its language model (not converted: a text model results).
NOT_CARRIED = re.compile(r"^(mtp\.|model\.visual\.|visual\.)")
NOT_CARRIED_NOTE = ("The source's vision tower and multi-token-prediction (`mtp.*`) weights are not carried over: "
                    "the converted model is its language model (text in, text out).")


@contextlib.contextmanager
def _without_fla() -> Iterator[None]:
    """While building a module: ``import fla`` / ``import causal_conv1d`` fail and transformers reports them missing,
    so transformers' modeling code binds its PyTorch paths (5.24: ``use_kernel_func_from_hub_with_fallback`` falls
    back when the import fails; older releases test ``is_flash_linear_attention_available()``)."""
    from transformers.utils import import_utils

    hidden = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
    checks = {name: getattr(import_utils, name) for name in
              ("is_flash_linear_attention_available", "is_causal_conv1d_available") if hasattr(import_utils, name)}
    try:
        for name in hidden:
            sys.modules[name] = None  # `import name` raises ImportError
        for name in checks:
            setattr(import_utils, name, lambda: False)
        yield
    finally:
        for name, module in hidden.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name, check in checks.items():
            setattr(import_utils, name, check)


def torch_only_modeling(package: str):
    """A private copy of ``transformers.models.<package>.modeling_<package>`` whose ops are all PyTorch (never
    flash-linear-attention's Triton kernels), whatever is installed and whether or not transformers' own copy was
    imported (and bound to fla) already. Not entered in ``sys.modules``."""
    name = f"transformers.models.{package}.modeling_{package}"
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ValueError(f"the installed transformers has no {package} model (transformers.models.{package})")
    module = importlib.util.module_from_spec(spec)
    original = sys.modules.get(name)
    try:  # under its own name while it runs: transformers' decorators look their module up there
        sys.modules[name] = module
        with _without_fla():
            spec.loader.exec_module(module)
    finally:
        if original is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = original
    return module


@dataclass
class QwenSource:
    """A Qwen3.5 / Qwen3-Next source: its text config and where its language model's tensors live."""

    model_type: str
    text: PreTrainedConfig  # the language model's config
    prefix: str  # "model." or "model.language_model."
    tie_word_embeddings: bool

    @property
    def modeling(self) -> tuple[str, str, str]:
        return QWEN_HYBRID_SOURCES[self.model_type]


def read_qwen_source(config: PreTrainedConfig) -> QwenSource:
    """``config`` (``AutoConfig`` of the source directory) as a :class:`QwenSource`; ``ValueError`` naming what is
    not supported (RoPE types other than the default, other layer types)."""
    text = config.get_text_config() if hasattr(config, "text_config") else config
    nested = text is not config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"unsupported RoPE type {rope_type!r} in the {config.model_type} source; supported: "
                         "'default'")
    unknown = set(text.layer_types) - {"linear_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)} in the {config.model_type} source")
    tied = getattr(config, "tie_word_embeddings", False) if nested else text.tie_word_embeddings
    return QwenSource(config.model_type, text, "model.language_model." if nested else "model.", bool(tied))


def source_inverse_frequencies(source: QwenSource, modeling) -> torch.Tensor:
    """The attention layers' RoPE inverse frequencies (float32), as the source's own rotary module computes them."""
    rotary = getattr(modeling, source.modeling[2])(source.text)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ValueError(f"unsupported RoPE attention scaling {scaling} in the {source.model_type} source")
    return rotary.inv_freq.float()


def hybrid_config_from_qwen(source: QwenSource, inverse_frequencies: torch.Tensor,
                            attention: dict, linear: dict) -> SelectiveRopeHybridConfig:
    """The hybrid config reproducing ``source``; ``attention`` / ``linear``: the Selective RoPE fields of the two
    layer types (the converter's retrofit options)."""
    text = source.text
    sparse = getattr(text, "num_experts", 0) or 0
    moe = {}
    if sparse:
        moe = dict(num_experts=sparse, num_experts_per_tok=text.num_experts_per_tok,
                   moe_intermediate_size=text.moe_intermediate_size,
                   shared_expert_intermediate_size=text.shared_expert_intermediate_size,
                   # Qwen3.5-MoE renormalises the chosen weights always and has MoE blocks in every layer.
                   norm_topk_prob=getattr(text, "norm_topk_prob", None) is not False,
                   decoder_sparse_step=getattr(text, "decoder_sparse_step", None) or 1,
                   mlp_only_layers=list(getattr(text, "mlp_only_layers", None) or []),
                   router_aux_loss_coef=getattr(text, "router_aux_loss_coef", 0.001))
    intermediate = getattr(text, "intermediate_size", None) or text.moe_intermediate_size
    rotary_pairs = inverse_frequencies.numel()
    rope_theta = float(text.rope_parameters["rope_theta"])
    return SelectiveRopeHybridConfig(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=text.num_hidden_layers,
        layer_types=list(text.layer_types), intermediate_size=intermediate, hidden_act=text.hidden_act,
        rms_norm_eps=text.rms_norm_eps, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim,
        attention_bias=getattr(text, "attention_bias", False), use_forget_gate=False,
        linear_num_key_heads=text.linear_num_key_heads, linear_num_value_heads=text.linear_num_value_heads,
        linear_key_head_dim=text.linear_key_head_dim, linear_value_head_dim=text.linear_value_head_dim,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim, **moe,
        layer_type_position_embedding={
            # The checkpoint's temperature holds the source's own frequencies (the schedule names their base).
            "full_attention": {**attention, "temperature_type": "rope", "temperature_theta": rope_theta,
                               "partial_rotary_factor": 2 * rotary_pairs / text.head_dim},
            "linear_attention": linear,
        },
        initializer_range=text.initializer_range, tie_word_embeddings=source.tie_word_embeddings,
        **token_ids_in_vocabulary({name: getattr(text, name, None) for name in
                                   ("pad_token_id", "bos_token_id", "eos_token_id")}, text.vocab_size),
    )


# -- tensors ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """How one of our tensors is made: ``build`` of the source tensors named ``sources``, in that order."""

    sources: tuple[str, ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor]


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _rows(start: int, stop: int, shape: tuple[int, ...] | None = None):
    """The rows ``[start, stop)`` of a tensor, after viewing it as ``shape`` (then flattening the first two dims)."""
    def build(tensors: list[torch.Tensor]) -> torch.Tensor:
        tensor = tensors[0] if shape is None else tensors[0].view(*shape)
        part = tensor[start:stop] if shape is None else tensor[:, start:stop]
        return part if shape is None else part.reshape(-1, *tensor.shape[2:])
    return build


def _stack_gate_up(tensors: list[torch.Tensor]) -> torch.Tensor:  # [gate_0, up_0, gate_1, up_1, ...] -> (E, 2I, D)
    return torch.stack([torch.cat(tensors[i:i + 2]) for i in range(0, len(tensors), 2)])


def hybrid_recipes(source: QwenSource, config: SelectiveRopeHybridConfig, names: list[str]) -> dict[str, Recipe]:
    """Our tensor name -> :class:`Recipe` for every tensor of the source's language model (``names``: the source's
    tensor names, those not carried over left out); ``ValueError`` for a tensor with no place."""
    recipes: dict[str, Recipe] = {}
    available = set(names)
    used: set[str] = set()

    def add(target: str, sources: list[str], build=_one) -> None:
        missing = [name for name in sources if name not in available]
        if missing:
            raise ValueError(f"the source lacks {missing[:4]} (needed for {target})")
        recipes[target] = Recipe(tuple(sources), build)
        used.update(sources)

    prefix = source.prefix
    add("model.embeddings.weight", [f"{prefix}embed_tokens.weight"])
    add("model.norm.weight", [f"{prefix}norm.weight"])
    if not config.tie_word_embeddings:
        add("lm_head.weight", ["lm_head.weight"])
    elif "lm_head.weight" in available:  # a saved copy of the tied embeddings
        used.add("lm_head.weight")
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    group = config.linear_num_value_heads // config.linear_num_key_heads
    for i, kind in enumerate(config.layer_types):
        src, ours = f"{prefix}layers.{i}.", f"model.layers.{i}."
        add(ours + "attn_norm.weight", [src + "input_layernorm.weight"])
        add(ours + "mlp_norm.weight", [src + "post_attention_layernorm.weight"])
        if kind == "full_attention":
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                for suffix in ("weight", "bias"):
                    if f"{src}self_attn.{name}.{suffix}" in available:
                        add(f"{ours}attn.{name}.{suffix}", [f"{src}self_attn.{name}.{suffix}"])
        else:
            _gated_deltanet_recipes(add, available, src + "linear_attn.", ours + "attn.", key_dim, value_dim,
                                    config.linear_num_key_heads, config.linear_key_head_dim,
                                    config.linear_value_head_dim, group)
        mlp, our_mlp = src + "mlp.", ours + "mlp."
        if config.is_sparse_layer(i):
            add(our_mlp + "gate.weight", [mlp + "gate.weight"])
            if mlp + "experts.gate_up_proj" in available:  # stored stacked, as transformers holds them
                add(our_mlp + "experts.gate_up_proj", [mlp + "experts.gate_up_proj"])
                add(our_mlp + "experts.down_proj", [mlp + "experts.down_proj"])
            else:  # one tensor per expert (the released checkpoints' layout)
                experts = range(config.num_experts)
                add(our_mlp + "experts.gate_up_proj",
                    [f"{mlp}experts.{e}.{part}_proj.weight" for e in experts for part in ("gate", "up")],
                    _stack_gate_up)
                add(our_mlp + "experts.down_proj", [f"{mlp}experts.{e}.down_proj.weight" for e in experts],
                    torch.stack)
            for name in ("gate_proj", "up_proj", "down_proj"):
                add(f"{our_mlp}shared_expert.{name}.weight", [f"{mlp}shared_expert.{name}.weight"])
            add(our_mlp + "shared_expert_gate.weight", [mlp + "shared_expert_gate.weight"])
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                add(f"{our_mlp}{name}.weight", [f"{mlp}{name}.weight"])
    unused = sorted(available - used)
    if unused:
        raise ValueError(f"{len(unused)} source tensors have no place in SelectiveRopeHybridForCausalLM: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return recipes


def _gated_deltanet_recipes(add, available, src: str, ours: str, key_dim: int, value_dim: int, key_heads: int,
                            head_k: int, head_v: int, group: int) -> None:
    """The remap of one Gated DeltaNet layer (SPEC §4's mixer from Qwen3-Next's or Qwen3.5's)."""
    if src + "in_proj_qkvz.weight" in available:
        # Qwen3-Next: rows grouped per key head, [q (Dk), k (Dk), v (G·Dv), z (G·Dv)]; then [b (G), a (G)].
        per_head = 2 * head_k + 2 * group * head_v
        shape = (key_heads, per_head, -1)
        cuts = {"q_proj": (0, head_k), "k_proj": (head_k, 2 * head_k),
                "v_proj": (2 * head_k, 2 * head_k + group * head_v), "g_proj": (2 * head_k + group * head_v, per_head)}
        for name, (start, stop) in cuts.items():
            add(f"{ours}{name}.weight", [src + "in_proj_qkvz.weight"], _rows(start, stop, shape))
        add(ours + "b_proj.weight", [src + "in_proj_ba.weight"], _rows(0, group, (key_heads, 2 * group, -1)))
        add(ours + "a_proj.weight", [src + "in_proj_ba.weight"], _rows(group, 2 * group, (key_heads, 2 * group, -1)))
    else:  # Qwen3.5: [q | k | v] in one projection, the gate, β and decay projections apart
        for name, (start, stop) in {"q_proj": (0, key_dim), "k_proj": (key_dim, 2 * key_dim),
                                    "v_proj": (2 * key_dim, 2 * key_dim + value_dim)}.items():
            add(f"{ours}{name}.weight", [src + "in_proj_qkv.weight"], _rows(start, stop))
        for name, theirs in (("g_proj", "in_proj_z"), ("b_proj", "in_proj_b"), ("a_proj", "in_proj_a")):
            add(f"{ours}{name}.weight", [f"{src}{theirs}.weight"])
    # One convolution over the q | k | v channels (C, 1, K): ours are three.
    for name, (start, stop) in {"q_conv1d": (0, key_dim), "k_conv1d": (key_dim, 2 * key_dim),
                                "v_conv1d": (2 * key_dim, 2 * key_dim + value_dim)}.items():
        add(f"{ours}{name}.weight", [src + "conv1d.weight"], _rows(start, stop))
    add(ours + "A_log", [src + "A_log"])
    add(ours + "dt_bias", [src + "dt_bias"])
    add(ours + "o_norm.weight", [src + "norm.weight"])
    add(ours + "o_proj.weight", [src + "out_proj.weight"])


def load_source_model(source: QwenSource, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The source's language model in float32 (transformers' own code on PyTorch ops: :func:`torch_only_modeling`)
    with ``tensors`` (the source's, those not carried over left out)."""
    package, lm_class, _ = source.modeling
    modeling = torch_only_modeling(package)
    model = getattr(modeling, lm_class)(source.text).float().eval()
    state = {("model." + name.removeprefix(source.prefix) if name.startswith(source.prefix) else name): tensor
             for name, tensor in tensors.items()}
    if source.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(_stacked_experts(state, model), strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and source.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"the source's tensors do not fit its own model: missing {missing[:8]}, unexpected "
                         f"{unexpected[:8]}")
    if source.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _stacked_experts(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked as transformers' model holds them (``mlp.experts.gate_up_proj`` ``(E, 2I, D)``,
    ``down_proj`` ``(E, D, I)``): what transformers' loading does for these checkpoints."""
    wanted = {name for name, _ in model.named_parameters() if name.endswith(("experts.gate_up_proj",
                                                                            "experts.down_proj"))}
    out = dict(state)
    for name in wanted:
        if name in out:
            continue
        stem = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        part = "gate_proj.weight" if name.endswith("gate_up_proj") else "down_proj.weight"
        count = sum(key.startswith(stem) and key.endswith(part) for key in out)
        if name.endswith("gate_up_proj"):
            parts = [out.pop(f"{stem}{e}.{part}_proj.weight") for e in range(count) for part in ("gate", "up")]
            out[name] = _stack_gate_up(parts)
        else:
            out[name] = torch.stack([out.pop(f"{stem}{e}.down_proj.weight") for e in range(count)])
    return out
