"""What the hybrid adds to the shared model suite (tests/modeling/test_models.py runs it too): per-layer mixers and
position settings, the zero-centred norm, the sparse MoE block, router logits and the load-balancing loss."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from selective_rope import SelectiveRopeHybridConfig, SelectiveRopeHybridForCausalLM
from selective_rope.modeling.fox import ForgettingAttention
from selective_rope.modeling.gated_deltanet import GatedDeltaNet
from selective_rope.modeling.hybrid import SparseMoeBlock
from selective_rope.modeling.layers import GatedMLP, ZeroCentredRMSNorm
from selective_rope.modeling.tensor_parallel import tensor_parallel_supported

from families import FAMILIES

HYBRID = FAMILIES["hybrid"]


def build(**overrides) -> SelectiveRopeHybridForCausalLM:
    torch.manual_seed(0)
    return SelectiveRopeHybridForCausalLM(SelectiveRopeHybridConfig(**{**HYBRID.tiny, **overrides})).eval()


def test_layers_follow_layer_types_with_their_own_position_settings():
    model = build(layer_types=["full_attention", "linear_attention"], decoder_sparse_step=1, mlp_only_layers=[1])
    first, second = model.model.layers
    assert isinstance(first.attn, ForgettingAttention) and isinstance(second.attn, GatedDeltaNet)
    assert isinstance(first.mlp, SparseMoeBlock) and isinstance(second.mlp, GatedMLP)
    # the attention layer rotates half of each 16-wide head (its own setting), the Gated DeltaNet layer all 8 dims
    assert first.attn.rotary.rotary_dim == 8 and second.attn.rotary.rotary_dim == 8
    assert first.attn.q_proj.out_features == 2 * 4 * 16  # the query and the output gate per head
    assert first.attn.g_proj is None and first.attn.f_proj is None
    norms = [m for m in model.modules() if isinstance(m, ZeroCentredRMSNorm)]
    assert len(norms) == 2 * 2 + 2 + 1  # block norms, the attention's q/k norms, the final norm
    assert all(torch.equal(norm.weight, torch.zeros_like(norm.weight)) for norm in norms)


def test_zero_centred_norm_scales_by_one_plus_weight():
    norm = ZeroCentredRMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["linear_attention"]), "one entry per layer"),
    (dict(layer_types=["linear_attention", "sliding_attention"]), "sliding_attention"),
    (dict(layer_type_position_embedding={"mamba": {}}), "keys must be layer types"),
    (dict(layer_type_position_embedding={"full_attention": {"hidden_size": 8}}), "Selective RoPE fields"),
    (dict(layer_type_position_embedding={"full_attention": {"partial_rotary_factor": 0.3}}),
     "full_attention layers' config is invalid: `partial_rotary_factor`"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers"),
])
def test_invalid_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SelectiveRopeHybridConfig(**{**HYBRID.tiny, **overrides})


def test_router_aux_loss_is_transformers_and_joins_the_loss():
    model = build(router_aux_loss_coef=0.5)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = model(ids, labels=ids)
    out = model(ids, labels=ids, output_router_logits=True)
    assert plain.aux_loss is None and len(out.router_logits) == 1
    assert out.router_logits[0].shape == (2 * 9, 4)
    expected = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(out.aux_loss, expected)
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * expected)


def test_router_logits_leave_padding_out():
    model = build()
    ids = torch.randint(3, 61, (1, 7), generator=torch.Generator().manual_seed(1))
    alone = model(ids, output_router_logits=True)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    out = model(padded, attention_mask=mask, output_router_logits=True)
    torch.testing.assert_close(out.router_logits[0], alone.router_logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[:, 3:], alone.logits, atol=1e-5, rtol=1e-5)


def test_experts_receive_gradients_and_gradient_checkpointing_matches():
    model = build()
    model.train()
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids, output_router_logits=True).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    moe = model.model.layers[1].mlp
    assert moe.experts.gate_up_proj.grad.abs().sum() > 0 and moe.gate.weight.grad.abs().sum() > 0
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(ids, labels=ids, output_router_logits=True).loss.backward()
    for name, grad in grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5)


def test_attention_weights_come_from_the_attention_layers_only():
    # the Gated DeltaNet layer has no weights: one (B, H, T, T) tensor, the full_attention layer's, from the keyword
    # or from the config, on the base model and the LM (as transformers' Qwen3-Next)
    model = build(layer_types=["linear_attention", "full_attention"])
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        asked = model(ids, output_attentions=True).attentions
        base = model.model(ids, output_attentions=True).attentions
        model.config.output_attentions = True
        from_config = model(ids).attentions
    assert len(asked) == 1 and asked[0].shape == (2, 4, 6, 6)
    torch.testing.assert_close(asked[0].sum(-1), torch.ones(2, 4, 6))  # softmax rows
    assert torch.equal(asked[0].triu(1), torch.zeros_like(asked[0]))  # causal
    torch.testing.assert_close(base[0], asked[0])
    torch.testing.assert_close(from_config[0], asked[0])


@pytest.mark.skipif(not tensor_parallel_supported(), reason="tensor parallelism of these models needs transformers' "
                    "DTensor API (transformers.distributed, 5.16 on), which this transformers lacks (e.g. the 5.10.1 "
                    "floor)")
def test_a_tied_head_is_sharded_with_the_embeddings():
    # a head sharded over a replicated embedding would gather tp x vocab logits
    model = build(tie_word_embeddings=True)
    assert "lm_head" in model.tp_plan and "model.embeddings" in model.tp_plan
