"""The converter: sources reproduced exactly, every source tensor used once, learnable afterwards, nothing left behind
on bad input."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from selective_rope import SelectiveRopeFoXForCausalLM
from selective_rope.cli import main as cli_main
from selective_rope.conversion import ConversionError, RetrofitOptions, convert
from selective_rope.conversion.convert import config_with, resolve_source
from selective_rope.conversion.retrofit import LN2

from families import FAMILIES

SHAPE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, pad_token_id=0, max_position_embeddings=256)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict()),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(attention_bias=True)),
}
# The license each tiny source's model card declares (as its real counterparts do): the converted card carries it.
LICENSES = {"llama": "llama3.2", "mistral": "apache-2.0", "qwen2": "apache-2.0", "qwen3": "apache-2.0"}
ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def llama_source(directory: Path, architecture: str, rope: str = "default", seed: int = 0, **config):
    """A tiny random Llama-family checkpoint with biases and norm weights that matter, and a model card naming its
    license."""
    config_class, model_class, extra = ARCHITECTURES[architecture]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **extra, **config}, rope_parameters=dict(ROPE_TYPES[rope]))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    (directory / "README.md").write_text(f"---\nlicense: {LICENSES[architecture]}\n---\n\n# A tiny {architecture}\n")
    return model


def tree(root: Path) -> dict[str, str]:
    """Everything under ``root``: relative path -> content hash, "dir", "special" or the symlink's target."""
    listing = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            listing[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            listing[name] = "dir"
        elif not path.is_file():  # a FIFO: reading it would wait for a writer
            listing[name] = "special"
        else:
            listing[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return listing


def earlier_model(folder: Path) -> None:
    """An earlier model in ``folder``, which --overwrite may replace: a config.json with a model_type, weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_text("the previous model")


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".replaced-" in p.name)


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_llama_family_is_reproduced(architecture, rope, tmp_path):
    source = llama_source(tmp_path / "source", architecture, rope)
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4 and report.reference == "source model"

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(converted, SelectiveRopeFoXForCausalLM)
    assert converted.config.position_embedding == "selective_rope" and converted.config.use_forget_gate
    ids = torch.randint(3, 61, (2, 40), generator=torch.Generator().manual_seed(1))  # longer than the probe
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)
    expected = source.generate(ids[:, :9], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(converted.generate(ids[:, :9], max_new_tokens=8, do_sample=False, pad_token_id=0), expected)


def test_token_ids_outside_the_vocabulary_become_none(tmp_path):
    """A source storing -1 for "no padding token" (transformers only warns) converts; our config, which refuses -1,
    gets None there, and ids that are rows are kept."""
    llama_source(tmp_path / "source", "llama", bos_token_id=1)
    path = tmp_path / "source" / "config.json"  # written by hand: transformers 5.10 refuses to save a -1
    path.write_text(json.dumps({**json.loads(path.read_text()), "pad_token_id": -1, "eos_token_id": [2, 99]}))
    assert AutoConfig.from_pretrained(tmp_path / "source").pad_token_id == -1
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (None, 1, [2])


def test_starting_values_are_exact_identities():
    assert torch.tensor(LN2, dtype=torch.float32).exp().item() == 2.0
    assert torch.sigmoid(torch.zeros(())).item() == 0.5


@pytest.mark.parametrize("options", [
    RetrofitOptions(phase_gate=False),
    RetrofitOptions(phase_gate_type="low_rank", phase_proj="full_rank", phase_conv_size=0),
    RetrofitOptions(phase_gate_type="channel", phase_proj="scalar", forget_gate=False),
    RetrofitOptions(selective=False),
], ids=["no-gate", "full-rank", "scalar", "plain"])
def test_retrofit_options_stay_exact(options, tmp_path):
    llama_source(tmp_path / "source", "qwen2")
    report = convert(tmp_path / "source", tmp_path / "out", options, progress=False)
    assert report.max_logit_difference <= 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["position_embedding"] == ("selective_rope" if options.selective else "rope")
    assert config["use_forget_gate"] == options.forget_gate
    if options.selective:
        assert config["phase_gate"] == options.phase_gate and config["phase_proj"] == options.phase_proj


def test_converted_directory_is_complete(tmp_path):
    llama_source(tmp_path / "source", "llama", "yarn")
    tokenizer = _tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "source")
    convert(tmp_path / "source", tmp_path / "out", base_model="someone/tiny-llama", progress=False)
    out = tmp_path / "out"

    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_fox.SelectiveRopeFoXForCausalLM"
    assert config["architectures"] == ["SelectiveRopeFoXForCausalLM"]
    assert (out / "modeling_fox.py").exists() and (out / "generation_config.json").exists()
    card = (out / "README.md").read_text()
    assert "base_model: someone/tiny-llama" in card and "base_model_relation: finetune" in card
    assert "library_name: transformers" in card and "yarn" in card and "folded" in card
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded("a b c")["input_ids"] == tokenizer("a b c")["input_ids"]
    assert leftovers(tmp_path) == []


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_fine_tuning_moves_the_selective_parameters(tmp_path):
    llama_source(tmp_path / "source", "llama")
    convert(tmp_path / "source", tmp_path / "out", progress=False)
    model = SelectiveRopeFoXForCausalLM.from_pretrained(tmp_path / "out").train()
    rotary = model.model.layers[0].attn.rotary
    assert torch.count_nonzero(rotary.phase_proj.up) == 0
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "rotary" in name or "f_proj" in name}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 61, (4, 24), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = {name for name, p in model.named_parameters() if name in before and not torch.equal(p, before[name])}
    for layer in range(2):
        for part in ("phase_proj.up", "phase_gate_proj.weight", "phase_bias"):
            assert f"model.layers.{layer}.attn.rotary.{part}" in moved, part
        assert f"model.layers.{layer}.attn.f_proj.bias" in moved
    assert torch.count_nonzero(rotary.phase_proj.up) > 0


def test_sharded_bfloat16_output(tmp_path):
    source = llama_source(tmp_path / "source", "mistral")
    report = convert(tmp_path / "source", tmp_path / "out", dtype="bfloat16", max_shard_size="20KB",
                     progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert report.shards == len(files) > 1 and all((out / f).exists() for f in files)
    for file in files:  # streamed: no shard beyond the limit unless it holds a single larger tensor
        with safe_open(out / file, "pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name, tensor in tensors.items():
            assert tensor.dtype == (torch.float32 if ".rotary." in name else torch.bfloat16), name
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 20_000
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = source.to(torch.bfloat16).float().eval()
    ids = torch.randint(3, 61, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------- flash-linear-attention


def _fla_source(directory: Path, kind: str):
    from fla.models import (
        ForgettingTransformerConfig,
        ForgettingTransformerForCausalLM,
        GatedDeltaNetConfig,
        GatedDeltaNetForCausalLM,
        GLAConfig,
        GLAForCausalLM,
    )

    common = dict(vocab_size=61, hidden_size=64, num_hidden_layers=2, hidden_ratio=2)
    config, model_class = {
        "gla": (GLAConfig(**common, num_heads=4, num_kv_heads=2, use_short_conv=True, conv_size=3), GLAForCausalLM),
        "gated_deltanet": (GatedDeltaNetConfig(**common, num_heads=4, head_dim=16, num_v_heads=8, expand_v=1.0),
                           GatedDeltaNetForCausalLM),
        "forgetting_transformer": (ForgettingTransformerConfig(**common, num_heads=4, num_kv_heads=2, qkv_bias=True,
                                                               use_output_gate=True), ForgettingTransformerForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # fla initialises norms to ones and biases to zeros: make them matter
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(directory)
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


@pytest.mark.parametrize("kind", ["gla", "gated_deltanet", "forgetting_transformer"])
def test_fla_checkpoints_use_every_tensor_once_and_equal_their_nope_twin(kind, tmp_path):
    source = _fla_source(tmp_path / "source", kind)
    report = convert(tmp_path / "source", tmp_path / "out", license="mit", progress=False)
    assert report.reference.startswith("NoPE twin") and report.max_logit_difference <= 1e-4
    assert report.source_tensors == len(source)

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    state = converted.state_dict()
    renamed = {name.replace("g_norm_swish_gate", "g_norm"): tensor for name, tensor in source.items()}
    for name, tensor in renamed.items():  # each source tensor lands unchanged under its name
        assert torch.equal(state[name], tensor), name
    assert set(state) - set(renamed) == {name for name in state if ".rotary." in name}

    family = {"gla": "gla", "gated_deltanet": "gated_deltanet", "forgetting_transformer": "fox"}[kind]
    twin = FAMILIES[family].lm_class(config_with(converted.config, position_embedding="nope")).eval()
    twin.load_state_dict(renamed)
    ids = torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, twin(ids).logits, atol=1e-5, rtol=0)


def test_fla_options_without_counterpart_are_refused(tmp_path):
    _fla_source(tmp_path / "source", "forgetting_transformer")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["qk_norm"] = True
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="qk_norm=True"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------------- our own


@pytest.mark.parametrize("position_embedding", ["rope", "nope"])
@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_own_rope_and_nope_checkpoints_become_selective(family_name, position_embedding, tmp_path):
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    config = family.config_class(**{**family.tiny, "position_embedding": position_embedding})
    source = family.lm_class(config).eval()
    source.save_pretrained(tmp_path / "source", model_card=True)  # our card: license apache-2.0
    report = convert(tmp_path / "source", tmp_path / "out", RetrofitOptions(phase_gate_type="channel"),
                     progress=False)
    assert report.license == {"license": "apache-2.0"} and report.base_model is None
    assert report.max_logit_difference <= 1e-4
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.position_embedding == "selective_rope"
    assert converted.config.phase_bias is (position_embedding == "rope")
    ids = torch.randint(3, 61, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 64},
], ids=["dynamic", "longrope"])
def test_unsupported_rope_types_leave_nothing(rope, tmp_path):
    LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope)).save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match=rf"unsupported RoPE type '{rope['rope_type']}'.*'default', 'linear', "
                                         r"'llama3', 'yarn'"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_unsupported_architecture_leaves_nothing(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=61)).save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match=r"unsupported source architecture 'gpt2'; supported: \['llama'"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    with pytest.raises(SystemExit, match="selective-rope convert: unsupported source architecture 'gpt2'"):
        cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_existing_output_needs_overwrite(tmp_path):
    llama_source(tmp_path / "source", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    # --overwrite replaces a model folder only: a folder of other files is someone's (`--overwrite .`, say)
    with pytest.raises(ValueError, match=r"is not a model folder \(no config.json\): --overwrite would delete "
                                         "keep.txt; it only replaces"):
        convert(tmp_path / "source", tmp_path / "out", overwrite=True, progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"] and leftovers(tmp_path) == []
    (tmp_path / "out" / "keep.txt").unlink()
    earlier_model(tmp_path / "out")
    convert(tmp_path / "source", tmp_path / "out", overwrite=True, progress=False)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != b"the previous model"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "selective_rope_fox"
    assert leftovers(tmp_path) == []


def test_a_failed_probe_leaves_nothing_and_keeps_the_old_output(tmp_path):
    llama_source(tmp_path / "source", "llama")
    earlier_model(tmp_path / "out")  # which --overwrite may replace
    before = tree(tmp_path / "out")
    failing = RetrofitOptions(forget_gate_bias=0.0)  # forgets half of everything per token: the probe fails
    with pytest.raises(ConversionError, match="does not reproduce the source"):
        convert(tmp_path / "source", tmp_path / "out", failing, overwrite=True, progress=False)
    assert tree(tmp_path / "out") == before
    assert leftovers(tmp_path) == []


def test_a_missing_source_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    llama_source(tmp_path / "source", "llama")
    path = tmp_path / "source" / "model.safetensors"
    with safe_open(path, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys() if "layers.1.mlp.up_proj" not in name}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 2 tensors.*layers\.1\.mlp\.up_proj\.weight.*up_proj\.bias"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert leftovers(tmp_path) == []


def test_cli_converts_and_reports(tmp_path, capsys):
    llama_source(tmp_path / "source", "qwen3", "llama3")
    assert cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--no-phase-gate",
                     "--phase-proj-rank", "4", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "probe: max |logit difference|" in printed and "source tensors used once each" in printed
    difference = float(printed.split("= ")[-1].split()[0])
    assert math.isfinite(difference) and difference <= 1e-4
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["phase_gate"] is False and config["phase_proj_rank"] == 4
    for bad, message in [(["--phase-proj-rank", "0"], "must be >= 1"), (["--dtype", "int8"], "invalid choice")]:
        with pytest.raises(SystemExit):
            cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "other"), *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a directory"):
        cli_main(["convert", str(tmp_path / "nowhere" / "x"), str(tmp_path / "other")])


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_a_hub_source_is_downloaded_and_named_as_base_model(tmp_path, monkeypatch, weights):
    from huggingface_hub import HfApi

    from loopback_hub import LoopbackHub

    source = llama_source(tmp_path / "source", "qwen2")
    if weights == "bin":
        _as_bin(tmp_path / "source")
    with LoopbackHub() as hub:
        hub.patch_endpoint(monkeypatch, cache_dir=tmp_path / "hf_cache")
        api = HfApi()
        api.create_repo("user/tiny-qwen2")
        api.upload_folder(folder_path=tmp_path / "source", repo_id="user/tiny-qwen2")
        report = convert("user/tiny-qwen2", tmp_path / "out", progress=False)
        # The snapshot lives in the Hugging Face cache (its files are links into blobs/): OUTPUT must stay clear of it.
        snapshot = resolve_source("user/tiny-qwen2")[0]
        cached = tree(tmp_path / "hf_cache")
        for output, relation in [(tmp_path / "hf_cache", "contains the source"), (snapshot / "x", "lies inside"),
                                 (snapshot.parent.parent / "blobs", "contains")]:
            with pytest.raises(ValueError, match=f"OUTPUT {re.escape(str(output))} {relation}"):
                convert("user/tiny-qwen2", output, overwrite=True, progress=False)
        assert tree(tmp_path / "hf_cache") == cached
        assert not hub.unhandled, hub.unhandled
    assert report.source == "user/tiny-qwen2" and report.max_logit_difference <= 1e-4
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: user/tiny-qwen2" in card and "license: apache-2.0" in card  # the source card's license
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, 61, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_a_saved_copy_of_tied_embeddings_is_accepted_and_a_different_one_refused(tmp_path):
    from safetensors.torch import save_file

    source = llama_source(tmp_path / "source", "mistral")  # tie_word_embeddings=True
    path = tmp_path / "source" / "model.safetensors"
    with safe_open(path, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, path,
              metadata={"format": "pt"})
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4 and report.source_tensors == len(tensors)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, 61, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)

    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="different lm_head.weight"):
        convert(tmp_path / "source", tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------- model card: license, base_model


def _card(directory: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(directory / "README.md")


def test_the_card_carries_the_source_license_and_no_local_base_model(tmp_path):
    llama_source(tmp_path / "my-llama", "llama")  # README.md: license llama3.2
    report = convert(tmp_path / "my-llama", tmp_path / "out", progress=False)
    card = _card(tmp_path / "out")
    assert card.data.license == "llama3.2" and report.license == {"license": "llama3.2"}
    assert card.data.base_model is None and report.base_model is None
    assert "base_model" not in card.content.split("---")[1]  # a folder's name is not a Hub id
    assert "from `my-llama`" in card.text  # the provenance still says what it was made from

    # a license the Hub has no identifier for travels with its name and link; --base-model names the Hub id
    (tmp_path / "my-llama" / "README.md").write_text(
        "---\nlicense: other\nlicense_name: tiny-license\nlicense_link: https://example.com/LICENSE\n---\n")
    convert(tmp_path / "my-llama", tmp_path / "other", base_model="someone/tiny-llama", progress=False)
    card = _card(tmp_path / "other")
    assert (card.data.license, card.data.license_name, card.data.license_link) == (
        "other", "tiny-license", "https://example.com/LICENSE")
    assert card.data.base_model == "someone/tiny-llama" and card.data.base_model_relation == "finetune"


def test_a_license_in_the_config_is_used_and_license_overrides(tmp_path):
    llama_source(tmp_path / "source", "qwen2")
    (tmp_path / "source" / "README.md").unlink()
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    (tmp_path / "source" / "config.json").write_text(json.dumps({**config, "license": "qwen"}))
    convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert _card(tmp_path / "out").data.license == "qwen"
    convert(tmp_path / "source", tmp_path / "mine", license="apache-2.0", progress=False)
    assert _card(tmp_path / "mine").data.license == "apache-2.0"


def test_an_unknown_license_is_refused_before_anything_is_written(tmp_path):
    llama_source(tmp_path / "source", "mistral")
    (tmp_path / "source" / "README.md").write_text("# A model card without a YAML header\n")
    with pytest.raises(ValueError, match=r"the source's license is unknown .* pass --license"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    with pytest.raises(SystemExit, match=r"^selective-rope convert: the source's license is unknown [^\n]*$"):
        cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--no-progress"])
    (tmp_path / "source" / "README.md").write_text("---\nlicense: [unclosed\n---\n")
    with pytest.raises(ValueError, match=r"YAML header does not parse \(expected [^\n]*pass --license$"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--license", "apache-2.0",
                     "--no-progress"]) == 0
    assert _card(tmp_path / "out").data.license == "apache-2.0"


@pytest.mark.parametrize("argument, value, message", [
    ("base_model", "/home/me/llama", r"--base-model '/home/me/llama': not a Hub repository id"),
    ("base_model", "a/b/c", r"--base-model 'a/b/c': not a Hub repository id"),
    ("license", "apache 2.0", r"--license 'apache 2.0': expected a license identifier"),
    ("license", "", r"--license '': expected a license identifier"),
])
def test_bad_card_metadata_is_refused(tmp_path, argument, value, message):
    llama_source(tmp_path / "source", "llama")
    with pytest.raises(ValueError, match=message):
        convert(tmp_path / "source", tmp_path / "out", progress=False, **{argument: value})
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------------- sliding windows


def _window_warnings(caplog) -> int:
    return sum("sliding window of" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("architecture, window_config", [
    ("mistral", dict(sliding_window=24)),  # every layer slides
    ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),  # layer 1 of 2 slides
])
def test_a_sliding_window_is_dropped_with_one_warning(tmp_path, caplog, architecture, window_config):
    """Mistral's and Qwen2's windows alike: converted with one warning; the two agree up to the window, not beyond."""
    source = llama_source(tmp_path / "source", architecture, **window_config)
    caplog.clear()
    convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert _window_warnings(caplog) == 1
    assert "sliding window of 24 tokens" in (tmp_path / "out" / "README.md").read_text()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, 61, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, actual = source(ids).logits, converted(ids).logits
    torch.testing.assert_close(actual[:, :24], expected[:, :24], atol=1e-4, rtol=0)
    assert (actual[:, 24:] - expected[:, 24:]).abs().max() > 1e-3  # beyond the window FoX sees more


def test_a_window_as_long_as_the_context_needs_no_warning(tmp_path, caplog):
    llama_source(tmp_path / "source", "qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=0)
    caplog.clear()
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4 and _window_warnings(caplog) == 0


# ------------------------------------------------------------------------------------------------ PyTorch .bin sources


def _as_bin(directory: Path, shards: int = 1, extra: dict | None = None) -> dict[str, torch.Tensor]:
    """Re-save ``directory``'s weights as PyTorch .bin files (``shards`` > 1: with a weight map), as transformers did
    before safetensors; ``extra`` tensors are added (old checkpoints' buffers)."""
    path = directory / "model.safetensors"
    with safe_open(path, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    path.unlink()
    tensors.update(extra or {})
    names = sorted(tensors)
    if shards == 1:
        torch.save(tensors, directory / "pytorch_model.bin")
        return tensors
    weight_map = {}
    for index in range(shards):
        file = f"pytorch_model-{index + 1:05d}-of-{shards:05d}.bin"
        part = names[index::shards]
        torch.save({name: tensors[name] for name in part}, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_sources_convert_like_safetensors(tmp_path, shards):
    source = llama_source(tmp_path / "source", "qwen3")
    # transformers < 4.31 saved each layer's RoPE frequencies: ignored, as transformers ignores them
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}
    tensors = _as_bin(tmp_path / "source", shards, extra=inv_freq)
    report = convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert report.max_logit_difference <= 1e-4 and report.source_tensors == len(tensors) - len(inv_freq)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(3, 61, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


class _NotATensor:  # a pickled object that weights_only=True refuses to build
    pass


def test_a_bin_that_is_not_only_tensors_is_refused_unrun(tmp_path):
    llama_source(tmp_path / "source", "llama")
    tensors = _as_bin(tmp_path / "source")
    torch.save({**tensors, "payload": _NotATensor()}, tmp_path / "source" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"cannot read .*pytorch_model\.bin safely \(torch\.load with "
                                         r"weights_only=True\).*re-save the source with safetensors"):
        convert(tmp_path / "source", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
