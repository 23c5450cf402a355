"""SelectiveRopeHybrid: Gated DeltaNet and attention layers stacked by ``config.layer_types`` (Qwen3-Next, Qwen3.5).

Each layer's mixer is a family's own: ``"linear_attention"`` layers run :class:`~.gated_deltanet.GatedDeltaNet`,
``"full_attention"`` layers :class:`~.fox.ForgettingAttention` (forget gate optional, q/k norms zero-centred, the
output gate carried in ``q_proj``), each built from its family's config with its layer type's Selective RoPE fields
(``SelectiveRopeHybridConfig.layer_config``). What the sources add around the mixers is here:

    block     x + mixer(norm(x)), then x + mlp(norm(x))        norms zero-centred: x̂ · (1 + w)
    mlp       SwiGLU, or a sparse MoE block:
              p = softmax(router(x)), top-k of p (renormalised with norm_topk_prob)
              out = Σ_top-k p_e · expert_e(x) + sigmoid(shared_expert_gate(x)) · shared_expert(x)

The decoding cache, padding and packing are the shared model's (:mod:`.base`): each layer keeps its mixer's states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..configuration.hybrid import SelectiveRopeHybridConfig
from .base import SelectiveRopeDecoderBlock, SelectiveRopeForCausalLMBase, SelectiveRopeModelBase
from .cache import SelectiveRopeCache
from .fox import ForgettingAttention
from .gated_deltanet import GatedDeltaNet
from .inputs import CACHE_FIELD, returned_cache
from .layers import MLP_ACTIVATIONS, GatedMLP, ZeroCentredRMSNorm
from .layout import valid_mask

MIXERS = {"linear_attention": GatedDeltaNet, "full_attention": ForgettingAttention}


class TopKRouter(nn.Module):
    """Softmax router: ``(N, D)`` -> logits ``(N, E)``, the top-k weights ``(N, k)`` and their experts ``(N, k)``."""

    def __init__(self, config: SelectiveRopeHybridConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.initializer_range = config.initializer_range

    @torch.no_grad()
    def init_custom_parameters(self) -> None:  # a bare parameter: transformers' initialisation skips it
        init.normal_(self.weight, mean=0.0, std=self.initializer_range)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked (transformers' layout): ``gate_up_proj`` ``(E, 2I, D)`` (gate
    rows, then up rows) and ``down_proj`` ``(E, D, I)``."""

    def __init__(self, config: SelectiveRopeHybridConfig):
        super().__init__()
        experts, hidden, width = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))
        self.act_fn = MLP_ACTIVATIONS[config.hidden_act]
        self.initializer_range = config.initializer_range

    @torch.no_grad()
    def init_custom_parameters(self) -> None:
        init.normal_(self.gate_up_proj, mean=0.0, std=self.initializer_range)
        init.normal_(self.down_proj, mean=0.0, std=self.initializer_range)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, D)``, the chosen ``experts`` and their ``weights`` ``(N, k)`` -> ``(N, D)``: only the tokens
        routed to an expert go through it (eagerly; compiled, every expert runs on every token, weighted by zero where
        not chosen: a loop over the experts a batch chose is data-dependent, and a compiled step is one token)."""
        if torch.compiler.is_compiling():
            routing = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
            routing = routing.scatter_add(1, experts, weights)  # (N, E): each expert's weight, 0 where not chosen
            gate, up = torch.einsum("nd,eid->nei", x, self.gate_up_proj).chunk(2, dim=-1)  # (N, E, I) each
            y = torch.einsum("nei,edi->ned", self.act_fn(gate) * up, self.down_proj)  # (N, E, D)
            return (y * routing[..., None]).sum(dim=1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert (Qwen3-Next's and Qwen3.5-MoE's block)."""

    def __init__(self, config: SelectiveRopeHybridConfig):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                      activation=config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, T, D)`` -> ``(B, T, D)``. With ``valid`` ``(B, T)`` only the real tokens are routed (padding
        gets zeros): the router sees exactly the tokens of the batch, as the load-balancing loss needs."""
        if valid is None or torch.compiler.is_compiling():  # every slot routed (no data-dependent shape), pads zeroed
            out = self._route(x.reshape(-1, x.shape[-1])).view_as(x)
            return out if valid is None else out * valid[..., None]
        return x.new_zeros(x.shape).index_put_((valid,), self._route(x[valid]))

    def _route(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(N, D)`` -> ``(N, D)``: the routed experts plus the gated shared expert."""
        _, weights, experts = self.gate(tokens)
        out = self.experts(tokens, experts, weights)
        return out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)


class SelectiveRopeHybridDecoderBlock(SelectiveRopeDecoderBlock):
    """The shared block (``x + mixer(norm(x))``, ``x + mlp(norm(x))``) with zero-centred norms, the mixer of the
    layer's type and a dense MLP or a sparse MoE block."""

    def __init__(self, config: SelectiveRopeHybridConfig, layer_idx: int, layer_config):
        GradientCheckpointingLayer.__init__(self)
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.attn_norm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = MIXERS[self.layer_type](layer_config, layer_idx)
        self.mlp_norm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = (SparseMoeBlock(config) if config.is_sparse_layer(layer_idx)
                    else GatedMLP(config.hidden_size, config.intermediate_size, activation=config.hidden_act))

    def feed_forward(self, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(self.mlp, SparseMoeBlock):
            return self.mlp(x)
        return self.mlp(x, valid_mask(lengths, x.shape[1]) if lengths is not None else None)  # valid: (B, T)


@contextlib.contextmanager
def recording_router_logits(layers: nn.ModuleList, enabled: bool) -> Iterator[list[torch.Tensor] | None]:
    """Collects each MoE router's logits ``(N, E)`` during a forward (``None`` when not ``enabled``). A forward hook,
    as transformers records router logits; with activation checkpointing the recomputation in the backward runs after
    the hooks are gone."""
    if not enabled:
        yield None
        return
    recorded = []
    hooks = [block.mlp.gate.register_forward_hook(lambda module, inputs, out: recorded.append(out[0]))
             for block in layers if isinstance(block.mlp, SparseMoeBlock)]
    try:
        yield recorded
    finally:
        for hook in hooks:
            hook.remove()


class SelectiveRopeHybridModel(SelectiveRopeModelBase):
    config_class = SelectiveRopeHybridConfig
    _no_split_modules = ["SelectiveRopeHybridDecoderBlock"]
    # Gated DeltaNet's decay parameters stay float32 in bf16/fp16 too, as in that family.
    _keep_in_fp32_modules_strict = ["rotary", "A_log", "dt_bias"]

    def __init__(self, config: SelectiveRopeHybridConfig):
        # Each layer type's family config, built once (decoder_block reads them while the base class builds).
        self._layer_configs = {kind: config.layer_config(kind) for kind in sorted(set(config.layer_types))}
        super().__init__(config)
        self.norm = ZeroCentredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # the final norm, zero-centred

    def decoder_block(self, config: SelectiveRopeHybridConfig, layer_idx: int) -> nn.Module:
        return SelectiveRopeHybridDecoderBlock(config, layer_idx, self._layer_configs[config.layer_types[layer_idx]])

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        cu_seqlens: torch.LongTensor | None = None,
        cache: SelectiveRopeCache | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        """The shared model's ``forward`` (:meth:`SelectiveRopeModelBase.forward`), plus ``output_router_logits``
        (default: the config's): ``router_logits``, one ``(N, num_experts)`` tensor per MoE layer over the real
        tokens (``N = B · T`` in batch order without padding; with padding, the real tokens only, row by row).
        ``attentions`` (``output_attentions``) holds one tensor per ``"full_attention"`` layer only: the Gated
        DeltaNet layers have no attention weights (as in transformers' Qwen3-Next)."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        with recording_router_logits(self.layers, output_router_logits) as recorded:
            outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                      use_cache=use_cache, output_hidden_states=output_hidden_states,
                                      output_attentions=output_attentions, cu_seqlens=cu_seqlens, cache=cache,
                                      **kwargs)
        return MoeModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=tuple(recorded) if recorded is not None else None,
            **{CACHE_FIELD: returned_cache(outputs)},
        )


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """The Switch Transformer load-balancing loss as transformers computes it (``load_balancing_loss_func`` of
    Qwen3-Next, Mixtral): ``num_experts · Σ_e f_e · P_e``, ``f_e`` the share of top-k assignments that go to expert
    ``e`` and ``P_e`` its mean router probability, over every layer's tokens together. The logits hold real tokens
    only (see :class:`SparseMoeBlock`), so no padding mask is needed."""
    logits = torch.cat([layer.float() for layer in router_logits], dim=0)  # (layers · N, E)
    probs = torch.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probs, top_k, dim=-1).indices, num_experts).sum(dim=1)  # (layers · N, E)
    tokens_per_expert = chosen.float().mean(dim=0)
    return num_experts * (tokens_per_expert * probs.mean(dim=0)).sum()


class SelectiveRopeHybridForCausalLM(SelectiveRopeForCausalLMBase):
    config_class = SelectiveRopeHybridConfig
    model_class = SelectiveRopeHybridModel
    _no_split_modules = SelectiveRopeHybridModel._no_split_modules
    _keep_in_fp32_modules_strict = SelectiveRopeHybridModel._keep_in_fp32_modules_strict

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SelectiveRopeCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.LongTensor | None = None,
        cache: SelectiveRopeCache | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """The shared causal LM's ``forward`` (:meth:`SelectiveRopeForCausalLMBase.forward`), plus
        ``output_router_logits`` (default: the config's): returns ``router_logits`` (see the model's ``forward``) and
        ``aux_loss``, the load-balancing loss (:func:`load_balancing_loss`), and with ``labels`` adds
        ``router_aux_loss_coef · aux_loss`` to the loss, as transformers' Qwen3-Next does."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        with recording_router_logits(self.model.layers, output_router_logits) as recorded:
            outputs = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                      past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                      use_cache=use_cache, output_hidden_states=output_hidden_states,
                                      output_attentions=output_attentions, logits_to_keep=logits_to_keep,
                                      cu_seqlens=cu_seqlens, cache=cache, output_router_logits=False, **kwargs)
        loss, aux_loss = outputs.loss, None
        if recorded:  # (a model without MoE layers has no router)
            aux_loss = load_balancing_loss(recorded, self.config.num_experts, self.config.num_experts_per_tok)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=outputs.logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=tuple(recorded) if recorded is not None else None,
            **{CACHE_FIELD: returned_cache(outputs)},
        )
