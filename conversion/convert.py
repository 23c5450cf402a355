"""The converter: a source checkpoint in, a loadable selective-rope directory out (SPEC §7).

    plan      read the source config, choose the target config and the name/tensor mapping (refuses here, before
              anything is written, what it cannot convert)
    write     stream tensors shard by shard from the source's safetensors files (or, for a source that has none, its
              PyTorch ``.bin`` files, read memory-mapped with ``weights_only=True``) into the target's: one output
              shard in memory at a time, never two copies of the model
    probe     run a probe batch through the source (or, where its code cannot run here, its twin: our family with
              the source's position embedding, or the official Selective RoPE math on the source's own tensors) and
              the converted model, one after the other; fail unless the logits agree
    publish   config, code, tokenizer files and model card next to the weights, all in a staging directory that
              is renamed to the output only when everything succeeded, never over anything unless asked
              (:mod:`.output`: the source is never touched, a failure, SIGINT or SIGTERM leaves nothing behind)
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.modeling_utils import load_state_dict
from transformers.utils import logging

from selective_rope.families import FAMILIES

from ..modeling.hub import auto_map
from ..modeling.model_card import render_model_card, template_texts
from ..modeling.remote_code import write_code_bundle
from ..modeling.rotary import SelectiveRotaryEmbedding
from .fla import FLA_MODEL_TYPES, fla_config, fla_key
from .llama import (
    LLAMA_FAMILY,
    fold_attention_scaling,
    fox_config_from_llama,
    fox_key_from_llama,
    llama_rope,
    sliding_window,
)
from .official import (
    OFFICIAL_MODEL_TYPES,
    install_official_rotaries,
    is_official,
    official_config,
    official_key,
    official_tensor,
    position_type,
    rope_frequencies,
)
from .official import notes as official_notes
from .output import (
    TOKENIZER_FILES,
    refuse_overlap,
    refuse_replacing,
    refuse_special_file,
    refuse_special_files,
    remove_stale_partials,
    staged_output,
)
from .qwen import (
    NOT_CARRIED,
    NOT_CARRIED_NOTE,
    QWEN_HYBRID_TYPES,
    Recipe,
    hybrid_config_from_qwen,
    hybrid_recipes,
    load_source_model,
    read_qwen_source,
    source_inverse_frequencies,
    torch_only_modeling,
)
from .retrofit import RetrofitOptions, starting_parameters
from .source_card import check_base_model, check_license, source_license

logger = logging.get_logger(__name__)

# Our causal-LM classes by model_type (each knows its config class).
OUR_FAMILIES = {family.model_type: family.lm_class for family in FAMILIES.values()}
OUR_MODEL_TYPES = tuple(OUR_FAMILIES)
# The paper's own checkpoints reuse fla's model types; their config.json has a `position_embedding` dict.
SUPPORTED_SOURCES = [*LLAMA_FAMILY, *QWEN_HYBRID_TYPES, *FLA_MODEL_TYPES, *OUR_MODEL_TYPES,
                     *(f"{kind} (the paper's code)" for kind in OFFICIAL_MODEL_TYPES)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(RuntimeError):
    """The converted model does not reproduce its source (nothing was written)."""


@dataclass
class SourcePlan:
    """What a source becomes: our config and class, and how its tensors map onto ours."""

    description: str
    config: object
    model_class: type
    rotates: bool  # RoPE source (True) or NoPE (False)
    rename: Callable[[str], str]
    transform: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor
    # Replaces the configured schedule (a source's inverse frequencies): of every rotary module, or of those a dict
    # names (rotary module name -> temperature).
    temperature: torch.Tensor | dict[str, torch.Tensor] | None = None
    load_reference: Callable[[], nn.Module] | None = None  # the source model, when its code runs here
    # Otherwise the probe's reference is a twin (see `_twin_reference`): our family with the source's position
    # embedding ("nope" or "rope"), or with `install_rotaries` putting the source's own rotary math in place.
    twin_position: str = "nope"
    install_rotaries: Callable[[nn.Module, dict[str, torch.Tensor]], None] | None = None
    ported: bool = False  # the source's own Selective RoPE is carried over (nothing retrofitted)
    notes: list[str] = field(default_factory=list)  # for the model card
    weight_note: str = " (unchanged)"  # for the model card: how the source's weights were carried over
    ignored: Callable[[str], bool] = lambda name: False  # source tensors the target recomputes (not carried over)
    source_keys: list[str] = field(default_factory=list)
    # Sources whose tensors do not map one to one onto ours (split or stacked): our name -> Recipe, from the source's
    # tensor names (those not `ignored`); refuses names with no place. Otherwise `rename` and `transform` apply.
    recipes: Callable[[list[str]], dict[str, Recipe]] | None = None


@dataclass
class ConversionReport:
    output: Path
    source: str
    description: str
    reference: str  # what the probe compared against
    max_logit_difference: float
    source_tensors: int
    new_tensors: list[str]
    shards: int
    base_model: str | None = None  # the card's base_model: a Hub id, never a local folder's name
    license: dict[str, str] = field(default_factory=dict)  # the card's license fields (license, license_name, ...)


# ---------------------------------------------------------------------------------------------------------- plan


def config_with(config, **changes):
    """A copy of ``config`` (validated anew) with ``changes``; the saved-code bookkeeping is left behind."""
    fields = {k: v for k, v in config.to_dict().items() if k not in ("auto_map", "architectures")}
    return type(config).from_dict({**fields, **changes})


def plan_conversion(source_dir: Path, options: RetrofitOptions) -> SourcePlan:
    """The conversion of the checkpoint in ``source_dir``; ``ValueError`` naming what is supported otherwise."""
    raw = _read_json(source_dir / "config.json")
    model_type = raw.get("model_type")
    if model_type in LLAMA_FAMILY:
        source = AutoConfig.from_pretrained(source_dir)
        inverse_frequencies, attention_scaling = llama_rope(source)
        config = fox_config_from_llama(source, use_forget_gate=options.forget_gate,
                                       **options.config_overrides(source_rotates=True))
        rope_type = (source.rope_parameters or {}).get("rope_type", "default")
        window_note = ""
        if (window := sliding_window(source)) is not None:
            window_note = (f"; its sliding window of {window[0]} tokens ({window[1]} of {source.num_hidden_layers} "
                           "layers) is dropped: FoX attends to the whole context, so the two agree on sequences of up "
                           f"to {window[0]} tokens")
            logger.warning(f"the source attends within a sliding window of {window[0]} tokens in {window[1]} of "
                           f"{source.num_hidden_layers} layers; FoX attends to the whole context, so the converted "
                           f"model reproduces the source on sequences of up to {window[0]} tokens only")
        return SourcePlan(
            description=f"transformers {model_type} (RoPE type {rope_type!r})",
            config=config, model_class=FAMILIES["fox"].lm_class, rotates=True,
            rename=fox_key_from_llama,
            transform=lambda name, tensor: fold_attention_scaling(name, tensor, attention_scaling, config),
            temperature=inverse_frequencies,
            load_reference=lambda: AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32),
            # Checkpoints saved by transformers < 4.31 carry each layer's RoPE frequencies; transformers ignores
            # them when loading (they follow from the config), and so do we: `temperature` holds them.
            ignored=lambda name: name.endswith(".rotary_emb.inv_freq"),
            weight_note=f" (the rotation's frequencies τ are the source's own {rope_type} inverse frequencies"
                        + (f"; its attention factor {attention_scaling:.6g} is folded into the q/k "
                           f"{'norms' if config.qk_norm else 'projections'}" if attention_scaling != 1.0 else "")
                        + window_note + ")",
        )
    if model_type in QWEN_HYBRID_TYPES:
        return _qwen_plan(source_dir, options)
    if is_official(raw):  # before fla's: the same model types
        return _official_plan(raw, options)
    if model_type in FLA_MODEL_TYPES:
        config = fla_config(raw, **options.config_overrides(source_rotates=False))
        return SourcePlan(
            description=f"flash-linear-attention {model_type} (NoPE)",
            config=config, model_class=OUR_FAMILIES[config.model_type], rotates=False,
            rename=lambda name: fla_key(model_type, name),
        )
    if model_type in OUR_MODEL_TYPES:
        lm_class = OUR_FAMILIES[model_type]
        source = lm_class.config_class.from_pretrained(source_dir)
        if source.position_embedding == "selective_rope":
            raise ValueError("the source already uses Selective RoPE; convert `rope` or `nope` checkpoints")
        rotates = source.position_embedding == "rope"
        config = config_with(source, **options.config_overrides(source_rotates=rotates))
        return SourcePlan(
            description=f"selective-rope {model_type} (position_embedding={source.position_embedding!r})",
            config=config, model_class=lm_class, rotates=rotates, rename=lambda name: name,
            load_reference=lambda: lm_class.from_pretrained(source_dir, dtype=torch.float32),
        )
    raise ValueError(f"unsupported source architecture {model_type!r}; supported: {SUPPORTED_SOURCES}")


def _qwen_plan(source_dir: Path, options: RetrofitOptions) -> SourcePlan:
    """A Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint (:mod:`.qwen`): the attention layers rotate (RoPE, retrofitted
    from the source's own frequencies), the Gated DeltaNet layers do not (NoPE, retrofitted from zero phase)."""
    source = read_qwen_source(AutoConfig.from_pretrained(source_dir))
    modeling = torch_only_modeling(source.modeling[0])
    inverse_frequencies = source_inverse_frequencies(source, modeling)
    config = hybrid_config_from_qwen(source, inverse_frequencies,
                                     attention=options.config_overrides(source_rotates=True),
                                     linear=options.config_overrides(source_rotates=False))
    config.use_forget_gate = options.selective and options.forget_gate
    nested = source.prefix != "model."
    notes = [NOT_CARRIED_NOTE] if nested else []
    if nested:
        logger.warning(NOT_CARRIED_NOTE)

    def reference() -> nn.Module:
        with ExitStack() as stack:
            tensors = open_source_tensors(source_dir, stack)
            return load_source_model(source, {name: tensors.get(name) for name in tensors.keys()
                                              if not NOT_CARRIED.match(name)})

    temperature = {f"model.layers.{i}.attn.rotary": inverse_frequencies
                   for i, kind in enumerate(config.layer_types) if kind == "full_attention"}
    return SourcePlan(
        description=f"transformers {source.model_type} ({config.layer_types.count('linear_attention')} Gated "
                    f"DeltaNet and {config.layer_types.count('full_attention')} attention layers"
                    + (f", {config.num_experts} experts" if config.num_experts else "") + ")",
        config=config, model_class=FAMILIES["hybrid"].lm_class, rotates=True, rename=lambda name: name,
        temperature=temperature, load_reference=reference, notes=notes,
        ignored=lambda name: bool(NOT_CARRIED.match(name)),
        recipes=lambda names: hybrid_recipes(source, config, names),
        weight_note=" (Gated DeltaNet's fused projections and convolution split per q, k, v, gate, β and decay; "
                    "the attention layers' frequencies τ are the source's own inverse frequencies)",
    )


RETROFIT_PARTS = ("phase_gate", "phase_gate_type", "phase_gate_rank", "phase_proj", "phase_proj_rank",
                  "phase_conv_type", "phase_conv_size")


def _official_plan(raw: dict, options: RetrofitOptions) -> SourcePlan:
    """A checkpoint of the paper's own code (:mod:`.official`): Selective RoPE sources ported as they are, RoPE and
    NoPE sources retrofitted."""
    model_type, kind = raw["model_type"], position_type(raw)
    if kind == "selective_rope":
        defaults = RetrofitOptions()
        changed = [name for name in RETROFIT_PARTS if getattr(options, name) != getattr(defaults, name)]
        if changed:
            raise ValueError(f"the source already has Selective RoPE, which is carried over as it is: the retrofit "
                             f"options {', '.join(changed)} do not apply")
        config = official_config(raw)
    else:
        config = official_config(raw, **options.config_overrides(source_rotates=kind == "rope"))
    rotary_dim = int(config.rotary_head_dim * config.partial_rotary_factor)
    temperature = None
    if kind == "rope":  # the source's own frequencies, as fla computes them
        temperature = rope_frequencies(raw["position_embedding"].get("theta", 500000), config.rotary_head_dim)
    ported = kind == "selective_rope"
    return SourcePlan(
        description=f"the paper's official {model_type} with "
                    + {"selective_rope": "Selective RoPE", "rope": "RoPE", "nope": "NoPE"}[kind],
        config=config, model_class=OUR_FAMILIES[config.model_type], rotates=kind == "rope",
        rename=lambda name: official_key(model_type, name),
        transform=lambda name, tensor: official_tensor(name, tensor, rotary_dim // 2),
        temperature=temperature,
        twin_position="official" if ported else kind,
        install_rotaries=(lambda model, tensors: install_official_rotaries(model, raw["position_embedding"], tensors))
        if ported else None,
        ported=ported,
        notes=official_notes(raw),
        weight_note=" and its own Selective RoPE, tensor for tensor" if ported else " (unchanged)",
    )


# --------------------------------------------------------------------------------------------------------- write


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError: their messages do not name the file
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} holds a JSON {type(content).__name__}, not an object of config fields")
    return content


def _open_safetensors(path: Path):
    """``safe_open(path)``, its failures naming the file (safetensors' own messages do not)."""
    try:
        return safe_open(path, "pt")
    except SafetensorError as error:
        raise ValueError(f"{path} is not a valid safetensors file (truncated or corrupt?): {error}") from None
    except OSError as error:
        raise type(error)(f"cannot read {path}: {error}") from None


def _sharded_files(index: Path) -> dict[str, Path]:
    """``{tensor name: shard file}`` from a sharded checkpoint's ``*.index.json``."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    files = {name: index.parent / file for name, file in weight_map.items()}
    for file in set(files.values()):  # (those beside the index were checked with the folder)
        refuse_special_file(file)
    return files


class SafetensorsSource:
    """The tensors of a ``save_pretrained`` directory, opened lazily (memory-mapped, one tensor at a time)."""

    def __init__(self, directory: Path, stack: ExitStack):
        index = directory / "model.safetensors.index.json"
        if index.exists():
            self.files = _sharded_files(index)
        else:
            with _open_safetensors(directory / "model.safetensors") as handle:
                self.files = dict.fromkeys(handle.keys(), directory / "model.safetensors")
        self._stack, self._handles = stack, {}

    def keys(self) -> list[str]:
        return sorted(self.files)

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(_open_safetensors(path))
        try:
            return self._handles[path].get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"{path}: cannot read tensor {name!r} (corrupt file?): {error}") from None


class TorchBinSource:
    """The tensors of a directory saved as PyTorch ``.bin`` files (``pytorch_model.bin`` or its shards), for sources
    that transformers loads but that have no safetensors. Read with transformers' ``load_state_dict``:
    ``weights_only=True`` (a pickle that holds anything but tensors is refused, never run) and memory-mapped, so a
    shard's tensors are paged in as they are used."""

    def __init__(self, directory: Path):
        index = directory / "pytorch_model.bin.index.json"
        self._shards: dict[Path, dict[str, torch.Tensor]] = {}  # loaded files (memory-mapped)
        if index.exists():
            self.files = _sharded_files(index)
        else:
            path = directory / "pytorch_model.bin"
            self._shards[path] = self._load(path)
            self.files = dict.fromkeys(self._shards[path], path)

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor]:
        try:
            return load_state_dict(str(path), weights_only=True)
        except Exception as error:  # torch raises UnpicklingError / RuntimeError; the message names the object
            raise ValueError(f"cannot read {path} safely (torch.load with weights_only=True): "
                             f"{str(error).splitlines()[0]}; re-save the source with safetensors") from None

    def keys(self) -> list[str]:
        return sorted(self.files)

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self._shards:
            self._shards[path] = self._load(path)
        return self._shards[path][name]


SourceTensors = SafetensorsSource | TorchBinSource  # keys() and get(name)


def open_source_tensors(directory: Path, stack: ExitStack) -> SourceTensors:
    """The source's tensors: its safetensors files, else its PyTorch ``.bin`` files (transformers' order)."""
    if (directory / "model.safetensors.index.json").exists() or (directory / "model.safetensors").exists():
        return SafetensorsSource(directory, stack)
    if (directory / "pytorch_model.bin.index.json").exists() or (directory / "pytorch_model.bin").exists():
        return TorchBinSource(directory)
    raise ValueError(f"no weights in {directory}: expected model.safetensors, pytorch_model.bin or their sharded "
                     "index (.index.json)")


def _keeps_float32(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    return any(module in parts for module in getattr(model, "_keep_in_fp32_modules_strict", None) or [])


def _shard_names(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards, current, current_bytes = [], [], 0
    for name, size in sizes:
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return shards + [current] if current else shards


def write_weights(plan: SourcePlan, source: SourceTensors, directory: Path, options: RetrofitOptions,
                  dtype: torch.dtype | None, max_shard_bytes: int, progress: bool) -> tuple[dict, list[str], int]:
    """Write the target's safetensors shards; returns (dtype used, new tensor names, number of shards)."""
    with torch.device("meta"):
        model = plan.model_class(plan.config)
    targets = model.state_dict()
    if plan.config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)  # tied to the embeddings: transformers saves it once

    mapped: dict[str, Recipe] = {}  # target name -> how it is made from source tensors
    unused = []
    for name in ([] if plan.recipes is not None else source.keys()):
        if plan.ignored(name):
            continue
        target = plan.rename(name)
        if target == "lm_head.weight" and plan.config.tie_word_embeddings:
            embeddings = next((n for n in source.keys() if plan.rename(n) == "model.embeddings.weight"), None)
            if embeddings is None or not torch.equal(source.get(name), source.get(embeddings)):
                raise ValueError("the source ties its embeddings but stores a different lm_head.weight")
            continue  # a saved copy of the tied embeddings: used through them
        if target not in targets:
            unused.append(name)
        elif target in mapped:
            raise ValueError(f"source tensors {mapped[target].sources[0]!r} and {name!r} both map onto {target!r}")
        else:
            mapped[target] = Recipe((name,), lambda tensors, target=target: plan.transform(target, tensors[0]))
    if plan.recipes is not None:
        mapped = plan.recipes([name for name in source.keys() if not plan.ignored(name)])
    if unused:
        raise ValueError(f"{len(unused)} source tensors have no place in {plan.model_class.__name__}: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    plan.source_keys = sorted({name for recipe in mapped.values() for name in recipe.sources})
    starting = starting_parameters(model, options, plan.temperature)
    new = [name for name in targets if name not in mapped]
    missing = [name for name in new if name not in starting]
    if missing:
        raise ValueError(f"the source lacks {len(missing)} tensors the model needs: {missing[:8]}")

    first = mapped["model.embeddings.weight"].sources[0] if "model.embeddings.weight" in mapped else plan.source_keys[0]
    out_dtype = dtype or source.get(first).dtype

    def tensor_for(name: str) -> torch.Tensor:
        if name in mapped:
            recipe = mapped[name]
            tensor = recipe.build([source.get(source_name) for source_name in recipe.sources])
        else:
            tensor = starting[name]
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(f"{name}: source shape {tuple(tensor.shape)}, expected {tuple(targets[name].shape)}")
        keep = torch.float32 if _keeps_float32(model, name) else out_dtype
        return tensor.to(keep if tensor.is_floating_point() else tensor.dtype).contiguous()

    def nbytes(name: str) -> int:
        element = 4 if _keeps_float32(model, name) else torch.tensor([], dtype=out_dtype).element_size()
        return targets[name].numel() * element

    shards = _shard_names([(name, nbytes(name)) for name in targets], max_shard_bytes)
    weight_map, total = {}, 0
    bar = tqdm(total=len(targets), desc="Converting tensors", unit="tensor", disable=not progress)
    for index, names in enumerate(shards, start=1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        shard = {}
        for name in names:
            shard[name] = tensor_for(name)
            total += shard[name].numel() * shard[name].element_size()
            weight_map[name] = file
            bar.update()
        _save_shard(shard, directory / file)
        del shard
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dtype, new, len(shards)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, with its I/O failures (full disk, read-only filesystem) raised as the ``OSError`` they are:
    safetensors reports them as its own error, carrying the errno only in the message: "... (os error 28)" in recent
    releases, "IoError(Os { code: 28, kind: StorageFull, ... })" in 0.4."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as error:
        code = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(error))
        if code is None:
            raise
        errno = int(code[1] or code[2])
        raise OSError(errno, os.strerror(errno), str(path)) from error


# --------------------------------------------------------------------------------------------------------- probe


TWIN_NAMES = {"nope": "NoPE twin (the source's own code cannot run here)",
              "rope": "RoPE twin (the source's own code cannot run here)",
              "official": "official Selective RoPE math on the source's own tensors (its code cannot run here)"}


def _twin_reference(plan: SourcePlan, source: SourceTensors) -> nn.Module:
    """Our family carrying the source tensors and computing what the source computes, for sources whose own code
    cannot run here (flash-linear-attention's and the paper's kernels are CUDA-only): with the source's position
    embedding (none, or RoPE with its frequencies), or with ``plan.install_rotaries`` putting the source's own
    Selective RoPE math, on its own rotary tensors, in place of ours."""
    official = plan.twin_position == "official"
    twin = plan.model_class(config_with(plan.config, position_embedding="nope" if official else plan.twin_position))
    state, rotaries = {}, {}
    for name in source.keys():
        if plan.ignored(name):
            continue
        if official and ".rotary." in name:
            rotaries[name] = source.get(name)
        else:
            state[plan.rename(name)] = source.get(name)
    missing, unexpected = twin.load_state_dict(state, strict=False)
    tied = plan.config.tie_word_embeddings
    missing = [name for name in missing if not (name == "lm_head.weight" and tied)
               and not (name.endswith(".rotary.temperature") and plan.twin_position == "rope")]
    if unexpected or missing:
        raise ValueError(f"{plan.twin_position} twin mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if tied:
        twin.tie_weights()
    if plan.twin_position == "rope" and plan.temperature is not None:  # the source's own frequencies
        with torch.no_grad():
            for module in twin.modules():
                if isinstance(module, SelectiveRotaryEmbedding):
                    module.temperature.copy_(plan.temperature)
    if official:
        plan.install_rotaries(twin, rotaries)
    return twin


@torch.no_grad()
def _round_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    for name, parameter in model.named_parameters():
        if not _keeps_float32(model, name):
            parameter.data = parameter.data.to(dtype).to(parameter.dtype)


@torch.no_grad()
def probe_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model = model.float().eval()
    return model(ids).logits.float()


# ------------------------------------------------------------------------------------------------------- convert


def resolve_source(source: str | os.PathLike) -> tuple[Path, str | None]:
    """A local directory, or a Hub id downloaded when the network allows; (directory, Hub id or None if local)."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a save_pretrained directory")
        return path, None
    if path.exists() or str(source).startswith((".", "/", "~")) or str(source).count("/") > 1:
        raise FileNotFoundError(f"source {str(source)!r} is not a directory (nor a Hub id)")
    from huggingface_hub import snapshot_download

    # config, tokenizer files, the card (for its license) and safetensors weights; .bin weights only where the
    # repository has no safetensors (many have both: never download the weights twice)
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "README.md"]
    try:
        directory = Path(snapshot_download(str(source), allow_patterns=patterns))
        if not any(directory.glob("*.safetensors")):
            directory = Path(snapshot_download(str(source), allow_patterns=["pytorch_model*.bin"]))
    except Exception as error:  # the Hub client raises many types; the message says what happened
        raise FileNotFoundError(f"source {str(source)!r} is not a local directory and could not be downloaded "
                                f"from the Hub: {error}") from error
    return directory, str(source)


def parse_size(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``1000`` -> bytes (at least one)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
        if not match:
            raise ValueError(f"max shard size {size!r}: expected bytes or a size such as '5GB' or '500MB'")
        units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        value = int(float(match[1]) * units[match[2]])
    if value < 1:
        raise ValueError(f"max shard size {size!r} is invalid: must be at least 1 byte")
    return value


def convert(
    source: str | os.PathLike,
    output: str | os.PathLike,
    options: RetrofitOptions | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    tolerance: float = 1e-4,
    probe_length: int = 16,
    base_model: str | None = None,
    license: str | None = None,
    progress: bool = True,
) -> ConversionReport:
    """Convert ``source`` into a selective-rope model directory ``output`` and check it reproduces the source.

    Args:
        source: a ``save_pretrained`` directory (or a Hub id when the network allows): transformers Llama, Mistral,
            Qwen2 or Qwen3; flash-linear-attention GLA, Gated DeltaNet or Forgetting Transformer; one of ours with
            ``position_embedding="rope"`` or ``"nope"``; or a checkpoint of the paper's own code (GLA, Gated
            DeltaNet, softmax attention), whose Selective RoPE is ported as it is (:mod:`.official`).
        output: the directory to create, apart from the source (not the source, inside it or containing it, by
            any path); an existing one is refused unless ``overwrite``, and replaced only once the new model is
            complete, and only if this tool could have written it (a ``config.json`` with a ``model_type`` and
            model files, no subfolders: :func:`.output.refuse_replacing`) or it is an empty folder.
        options: which Selective RoPE parts to switch on (:class:`RetrofitOptions`).
        dtype: output dtype for the source's tensors (``"float32"``, ``"bfloat16"``, ``"float16"``; default: as the
            source). Selective RoPE parameters are always float32.
        max_shard_size: largest output shard (``"5GB"``, ``"500MB"``, bytes; at least 1 byte).
        tolerance: the largest probe logit difference accepted (fp32; finite, >= 0).
        base_model: the source's Hub id for the model card's ``base_model`` (default: the Hub id converted from; a
            local source gets none unless given: a folder's name is not a Hub id).
        license: the converted model's license for its card (default: the source's, from the ``license:`` of its
            README.md or its config.json; ``ValueError`` when it names none and this is not given).

    Raises ``ValueError`` (unsupported source or options, a corrupt source file or a FIFO in a source file's place,
    an OUTPUT overlapping the source, an OUTPUT that ``overwrite`` may not replace),
    ``FileExistsError`` (output exists, or appeared while converting), ``FileNotFoundError`` (no source),
    ``OSError`` (OUTPUT cannot be written: full disk, read-only filesystem) and :class:`ConversionError` (the probe
    failed); nothing is left behind and an existing OUTPUT is unchanged. Partial outputs of killed conversions into
    the same OUTPUT are removed first (one logged warning each).
    """
    options = options or RetrofitOptions()
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance={tolerance!r} is invalid: must be a finite number >= 0")
    if not (isinstance(probe_length, int) and probe_length >= 1):
        raise ValueError(f"probe_length={probe_length!r} is invalid: must be an integer >= 1")
    output = Path(output)
    if Path(source).is_dir():  # an OUTPUT overlapping SOURCE is refused as such, not as "already exists"
        refuse_overlap(Path(source), output)
    remove_stale_partials(output)  # of conversions into OUTPUT that were killed; may give back a replaced OUTPUT
    if os.path.lexists(output) and not overwrite:
        raise FileExistsError(f"{output} already exists; pass overwrite=True (--overwrite) to replace it")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    max_shard_bytes = parse_size(max_shard_size)
    if base_model is not None:
        check_base_model(base_model)
    source_dir, hub_id = resolve_source(source)
    refuse_overlap(source_dir, output)  # again for a Hub source: its snapshot lives in the Hugging Face cache
    refuse_special_files(source_dir)  # before anything opens them: a FIFO blocks forever
    if overwrite:
        refuse_replacing(output)  # only a model folder this tool could have written (or an empty one)
    base_model = base_model or hub_id
    source_name = base_model or source_dir.resolve().name
    try:
        plan = plan_conversion(source_dir, options)
    except StrictDataclassError as error:  # transformers' own configs (LlamaConfig, ...) validate: not ValueErrors
        raise ValueError(f"{source_dir / 'config.json'} is invalid: {' '.join(str(error).split())}") from None
    card_license = {"license": check_license(license)} if license is not None else source_license(source_dir)
    if card_license is None:
        raise ValueError(f"the source's license is unknown (no `license:` in {source_dir / 'README.md'} nor in its "
                         "config.json): pass --license (the source's license, e.g. apache-2.0 or llama3.2)")

    with staged_output(output, overwrite) as staging:
        directory = staging.directory
        with ExitStack() as stack:
            tensors = open_source_tensors(source_dir, stack)
            out_dtype, new, shards = write_weights(plan, tensors, directory, options, dtype, max_shard_bytes,
                                                   progress)
            if plan.load_reference is None:
                reference_name = TWIN_NAMES[plan.twin_position]
                reference = _twin_reference(plan, tensors)
            else:
                reference_name, reference = "source model", plan.load_reference()
            if out_dtype != torch.float32:  # compare like with like: the source rounded as it was saved
                _round_parameters(reference, out_dtype)
            ids = torch.randint(0, plan.config.vocab_size, (2, probe_length),
                                generator=torch.Generator().manual_seed(options.seed))
            expected = probe_logits(reference, ids)
            del reference
        _write_metadata(plan, source_dir, directory, out_dtype)
        converted = plan.model_class.from_pretrained(directory, dtype=torch.float32)
        difference = (probe_logits(converted, ids) - expected).abs().max().item()
        del converted
        if not difference <= tolerance:
            raise ConversionError(f"the converted model does not reproduce the source: max |logit difference| = "
                                  f"{difference:.3g} > {tolerance:g} on the probe batch (reference: {reference_name})")
        report = ConversionReport(output, source_name, plan.description, reference_name, difference,
                                  len(plan.source_keys), new, shards, base_model, card_license)
        _write_card(plan, directory, output, report, options)
        staging.publish()
    return report


def _write_metadata(plan: SourcePlan, source_dir: Path, directory: Path, out_dtype: torch.dtype) -> None:
    config = plan.config
    config.architectures = [plan.model_class.__name__]
    config.dtype = out_dtype
    config.auto_map = auto_map(plan.model_class, type(config), plan.model_class.model_class)
    config.save_pretrained(directory)
    write_code_bundle(directory, plan.model_class.__module__,
                      templates={config.model_type: template_texts()[config.model_type]})
    if (source_dir / "generation_config.json").exists():
        shutil.copy2(source_dir / "generation_config.json", directory)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(directory)
    for file in source_dir.iterdir():
        if file.is_file() and TOKENIZER_FILES.match(file.name):
            shutil.copy2(file, directory)


def _write_card(plan: SourcePlan, directory: Path, output: Path, report: ConversionReport,
                options: RetrofitOptions) -> None:
    probe = (f"On a probe batch the converted model reproduced the {report.reference} to a maximum logit difference "
             f"of {report.max_logit_difference:.2e} (fp32).")
    if plan.ported:
        provenance = (f"Converted with `selective-rope convert` from `{report.source}` ({report.description}): the "
                      f"source's weights{plan.weight_note} (settings below). {probe}")
    else:
        parts = "Selective RoPE (" + ", ".join(
            f"{key}={value!r}" for key, value in options.config_overrides(plan.rotates).items()) + ")"
        provenance = (
            f"Converted with `selective-rope convert` from `{report.source}` ({report.description}): the source's "
            f"weights{plan.weight_note}, plus {parts if options.selective else 'no Selective RoPE'} starting as an "
            f"exact {'RoPE' if plan.rotates else 'NoPE'} rotation"
            + (" and a FoX forget gate starting at no forgetting" if getattr(plan.config, "use_forget_gate", False)
               and plan.rotates and options.forget_gate else "")
            + f". {probe} It is meant to be fine-tuned: the Selective RoPE parameters start at an identity and move "
            "with the first gradient steps."
        )
    provenance = " ".join([provenance, *plan.notes])
    card = render_model_card(plan.config, repo_id=output.name, license=report.license["license"],
                             base_model=report.base_model, base_model_relation="finetune", provenance=provenance)
    for name in ("license_name", "license_link"):  # a license the Hub has no identifier for (`license: other`)
        if name in report.license:
            setattr(card.data, name, report.license[name])
    card.save(directory / "README.md")

