"""Tensor parallelism: ``from_pretrained(path, tp_plan="auto")`` under torchrun, two CPU processes over gloo.

The test saves one tiny checkpoint per family, computes what one process gives (logits, a training step's loss and
gradients, a cached greedy ``generate`` of a left-padded batch), and launches this file once as the worker script
(``python -m torch.distributed.run --nproc_per_node 2 tests/integration/test_tensor_parallel.py DIR``). Each rank
loads every family split by heads, computes the same things, saves the split model, and tries a checkpoint whose heads
two ranks cannot split; the test then compares, and reloads each saved model in this process.

The families' options differ so that every per-head part of Selective RoPE is split at least once: GQA (GLA, FoX),
grouped value heads (Gated DeltaNet), the phase bias, the head and low-rank gates, the per-head and the dense low-rank
projections, the learned and the difference convolutions, a trainable temperature, short convolutions, the FoX "Pro"
options, and the hybrid's two layer kinds with an MoE block (experts split along their intermediate dim).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: families.py

from selective_rope.modeling.tensor_parallel import check_tensor_parallel, tensor_parallel_supported  # noqa: E402

from families import FAMILIES, OPTION_VARIANTS  # noqa: E402

needs_dtensor_api = pytest.mark.skipif(
    not tensor_parallel_supported(),
    reason="tensor parallelism of these models needs transformers' DTensor API (transformers.distributed, 5.16 on), "
           "which this transformers lacks (5.15 and older, e.g. the 5.10.1 floor, shard with local tensors)")

# A vocabulary two ranks split evenly (transformers 5.16 requires it of a gathered colwise LM head; 5.24 does not).
OPTIONS = {
    "gla": dict(vocab_size=64, phase_gate_type="low_rank", phase_bias=True, temperature_trainable=True),
    "gated_deltanet": {**OPTION_VARIANTS["official"], "vocab_size": 64, "phase_gate_type": "channel"},
    "fox": dict(vocab_size=64, phase_bias=True),
    # a Gated DeltaNet layer with a dense MLP, then a gated attention layer with a sparse MoE block (tests/families.py)
    "hybrid": dict(vocab_size=64, phase_bias=True),
}
# FoX with one key/value head: two ranks cannot split it.
UNSPLITTABLE = dict(num_key_value_heads=1)
NEW_TOKENS = 4
# The hybrid's other layouts: one layer kind only, every MLP sparse, none sparse, FoX's forget gate.
HYBRID_LAYOUTS = [dict(layer_types=["linear_attention"] * 2), dict(layer_types=["full_attention"] * 2),
                  dict(decoder_sparse_step=1), dict(num_experts=0), dict(use_forget_gate=True)]


def first_layer_phase_heads(config) -> int:
    """The key heads of layer 0's Selective RoPE (the hybrid's layers take theirs from their layer type's config)."""
    if hasattr(config, "layer_config"):
        config = config.layer_config(config.layer_types[0])
    return config.num_phase_heads


def inputs(vocab_size: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generate gets it
    return ids, mask


def measure(model) -> dict:
    """What the test compares: logits, the loss and gradients of one training step (every gradient as a whole
    tensor), a cached greedy generate (tokens and per-step logits) and the shapes of the cache's first layer. With MoE
    layers, also the experts each token is routed to, and the training loss includes the load-balancing loss."""
    from torch.distributed.tensor import DTensor

    full = (lambda t: t.full_tensor()) if torch.distributed.is_initialized() else (lambda t: t)
    ids, mask = inputs(model.config.vocab_size)
    moe = dict(output_router_logits=True) if getattr(model.config, "num_experts", 0) else {}
    model.eval()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True, **moe)
        logits = out.logits
        router_logits = getattr(out, "router_logits", None) or ()  # (N, E) per MoE layer
        routing = [torch.topk(layer, model.config.num_experts_per_tok).indices for layer in router_logits]
        cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        cache_shapes = {name: list(t.shape) for name, t in cache.layers[0].states.items()}
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    model.train()
    model.zero_grad()
    loss = model(ids, attention_mask=mask, labels=ids, **moe).loss
    loss.backward()
    grads = {name: (full(p.grad) if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits, "loss": loss.detach(), "grads": grads, "tokens": generated.sequences,
            "step_logits": torch.stack(generated.logits), "cache_shapes": cache_shapes, "routing": routing}


def worker(root: Path) -> None:
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401  (registers the families and our parallel styles)

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    report = {}
    for name in OPTIONS:
        model = AutoModelForCausalLM.from_pretrained(root / name, tp_plan="auto")
        results = measure(model)
        model.save_pretrained(root / f"{name}_saved_from_tp")
        torch.save(results, root / f"{name}_rank{rank}.pt")
        report[name] = {"q_proj": [list(layer.attn.q_proj.weight.to_local().shape) for layer in model.model.layers],
                        "experts": {f"{i}.mlp.experts.{key}": list(getattr(layer.mlp.experts, key).to_local().shape)
                                    for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")
                                    for key in ("gate_up_proj", "down_proj")}}
    try:
        AutoModelForCausalLM.from_pretrained(root / "unsplittable", tp_plan="auto")
        report["unsplittable"] = "loaded"
    except ValueError as error:
        report["unsplittable"] = str(error)
    (root / f"rank{rank}.json").write_text(json.dumps(report))


@needs_dtensor_api
def test_two_process_tensor_parallel_equals_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    references = {}
    for name, options in OPTIONS.items():
        family = FAMILIES[name]
        torch.manual_seed(0)
        model = family.lm_class(family.config_class(**{**family.tiny, **options}))
        model.save_pretrained(tmp_path / name)
        references[name] = measure(model)
    fox = FAMILIES["fox"]
    fox.lm_class(fox.config_class(**{**fox.tiny, **OPTIONS["fox"], **UNSPLITTABLE})).save_pretrained(
        tmp_path / "unsplittable")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert "num_key_value_heads" in report["unsplittable"] and "tp_size=2" in report["unsplittable"], report
    for name, reference in references.items():
        family = FAMILIES[name]
        heads = family.config_class(**{**family.tiny, **OPTIONS[name]})
        if name == "hybrid":  # both layer kinds and an MoE block are split
            assert set(heads.layer_types) == {"linear_attention", "full_attention"}, heads.layer_types
            assert reports[0][name]["experts"], reports[0][name]
        for rank in (0, 1):
            split = torch.load(tmp_path / f"{name}_rank{rank}.pt")
            # each rank holds half of every layer's query heads
            for i, shape in enumerate(reports[rank][name]["q_proj"]):
                assert shape[0] * 2 == reference["grads"][f"model.layers.{i}.attn.q_proj.weight"].shape[0], name
            # MoE experts: each rank holds half of every expert's intermediate dim (gate_up_proj (E, 2I, D) on dim 1,
            # down_proj (E, D, I) on dim 2)
            for key, shape in reports[rank][name]["experts"].items():
                whole = list(reference["grads"][f"model.layers.{key}"].shape)
                dim = 1 if key.endswith("gate_up_proj") else 2
                assert shape[dim] * 2 == whole[dim] and shape[:dim] == whole[:dim], (name, key, shape, whole)
            torch.testing.assert_close(split["logits"], reference["logits"], atol=1e-5, rtol=0, msg=name)
            torch.testing.assert_close(split["loss"], reference["loss"], atol=1e-6, rtol=0, msg=name)
            assert split["grads"].keys() == reference["grads"].keys(), name
            # float32 sums in another order (each rank sums its heads, then the ranks' shares are added): within
            # 2e-5 of each gradient's largest entry (measured: at most 9e-6 of it)
            for key, grad in reference["grads"].items():
                difference = (split["grads"][key] - grad).abs().max().item()
                assert difference <= 2e-5 * max(1.0, grad.abs().max().item()), (name, key, difference)
            assert len(split["routing"]) == len(reference["routing"]), name
            for chosen, one_process in zip(split["routing"], reference["routing"]):  # each token's experts (N, k)
                assert torch.equal(chosen, one_process), name
            assert torch.equal(split["tokens"], reference["tokens"]), name
            torch.testing.assert_close(split["step_logits"], reference["step_logits"], atol=1e-5, rtol=0, msg=name)
            # the cache holds this rank's heads: half of one process's along the head dim of the phase
            phase, one_process = split["cache_shapes"]["rotary.phase"], reference["cache_shapes"]["rotary.phase"]
            assert phase[1] * 2 == one_process[1] == first_layer_phase_heads(heads), (name, phase, one_process)
        # the model saved from the split one is whole again, and loads in one process as it was
        original = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_saved_from_tp")
        assert original.state_dict().keys() == saved.state_dict().keys()
        for key, tensor in original.state_dict().items():
            assert torch.equal(saved.state_dict()[key], tensor), f"{name}: {key}"


def all_configs():
    """Every family with its tiny config, its variants, the options the 2-process test uses, and RoPE / NoPE."""
    for name, family in FAMILIES.items():
        options = [{}, OPTIONS[name], *family.variants.values(), dict(position_embedding="rope"),
                   dict(position_embedding="nope"), dict(phase_gate=False, phase_conv_size=0),
                   dict(phase_proj="full_rank", phase_conv_type="difference"), dict(phase_proj="scalar"),
                   OPTION_VARIANTS["official"], dict(temperature_trainable=True)]
        options += HYBRID_LAYOUTS if name == "hybrid" else []
        for option in options:
            yield name, family, family.config_class(**{**family.tiny, **option})


def test_plans_name_what_the_model_has():
    """Every rule of a plan names a module or parameter of the model, as transformers matches them (layer numbers
    as ``*``): the plans are built from the config, so no rule is left unapplied (transformers warns about those)."""
    for name, family, config in all_configs():
        model = family.lm_class(config)
        names = {re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), n)
                 for n, _ in (*model.model.named_modules(), *model.model.named_parameters())}
        unmatched = set(config.base_model_tp_plan) - names
        assert not unmatched, (name, config.to_diff_dict(), unmatched)
        assert type(model)._tp_plan == {"lm_head": "colwise_gather_output"}  # as Llama's


def test_per_head_phase_parameters_split_with_the_heads():
    """The Selective RoPE parameters tensor parallelism splits are indexed by key head on their first dim; the ones it
    keeps whole are the temperature and the first maps of a low-rank gate and of the dense projection."""
    for name, family, config in all_configs():
        rotary = family.lm_class(config).model.layers[0].attn.rotary
        split = rotary.per_head_parameters()
        for key in split:
            assert rotary.get_parameter(key).shape[0] % first_layer_phase_heads(config) == 0, (name, key)
        whole = {key for key, _ in rotary.named_parameters()} - set(split)
        assert whole <= {"temperature", "phase_gate_proj.0.weight", "phase_proj.down"}, (name, whole)


def test_configs_that_cannot_split_are_refused():
    for family in FAMILIES.values():
        config = family.config_class(**family.tiny)
        check_tensor_parallel(config, 2)  # the tiny configs split in two
        heads = config.tensor_parallel_heads
        field = next(field for field, count in heads.items() if count % 3)  # the first one three ranks cannot split
        with pytest.raises(ValueError, match=rf"^`{field}`={heads[field]} cannot be split across tp_size=3 "):
            check_tensor_parallel(config, 3)


def test_hybrid_plan_and_heads_follow_its_layers():
    """The hybrid's plan and head counts cover the layer kinds and MLP kinds it has; two rules on one name that
    disagree are refused (transformers matches every layer number as ``*``)."""
    from selective_rope.configuration.tensor_parallel import merge_plans

    hybrid = FAMILIES["hybrid"]
    linear_only = hybrid.config_class(**{**hybrid.tiny, **HYBRID_LAYOUTS[0]})
    assert set(linear_only.tensor_parallel_heads) == {"linear_num_key_heads", "linear_num_value_heads"}
    attention_only = hybrid.config_class(**{**hybrid.tiny, **HYBRID_LAYOUTS[1]})
    assert set(attention_only.tensor_parallel_heads) == {"num_attention_heads", "num_key_value_heads"}
    one_linear_key_head = dict(linear_num_key_heads=1)  # only the linear-attention layers cannot split in two
    check_tensor_parallel(hybrid.config_class(**{**hybrid.tiny, **HYBRID_LAYOUTS[1], **one_linear_key_head}), 2)
    with pytest.raises(ValueError, match=r"^`linear_num_key_heads`=1 cannot be split across tp_size=2 "):
        check_tensor_parallel(hybrid.config_class(**{**hybrid.tiny, **one_linear_key_head}), 2)
    plan = hybrid.config_class(**hybrid.tiny).base_model_tp_plan
    assert plan["layers.*.mlp.experts.gate_up_proj"] == "packed_colwise" and "layers.*.mlp.gate" not in plan
    every_mlp_sparse = hybrid.config_class(**{**hybrid.tiny, **HYBRID_LAYOUTS[2]})
    assert "layers.*.mlp.gate_proj" not in every_mlp_sparse.base_model_tp_plan
    with pytest.raises(ValueError, match=r"^tensor-parallel rule 'a' is 'colwise' for one kind .* and 'rowwise' "):
        merge_plans({"a": "colwise"}, {"a": "rowwise"})


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
