"""``selective-rope convert SOURCE OUTPUT``: the command-line face of :func:`selective_rope.conversion.convert`."""

from __future__ import annotations

import argparse

from ..configuration.position_embedding import PHASE_GATE_TYPES, PHASE_PROJECTIONS
from .convert import DTYPES, SUPPORTED_SOURCES, ConversionError, convert
from .retrofit import RetrofitOptions

DESCRIPTION = f"""\
Retrofit Selective RoPE onto an existing checkpoint and write a loadable save_pretrained directory (weights, config,
modeling code for trust_remote_code, tokenizer files, model card).

Sources (model_type): {", ".join(SUPPORTED_SOURCES)}.
  transformers llama/mistral/qwen2/qwen3 (RoPE types default, linear, llama3, yarn) -> SelectiveRopeFoXForCausalLM
  flash-linear-attention gla/gated_deltanet/forgetting_transformer (NoPE)      -> our GLA / Gated DeltaNet / FoX
  ours with position_embedding "rope" or "nope"                                -> the same family, Selective RoPE

The new parameters start so that the converted model computes exactly what the source computes; the command checks
this on a probe batch (max logit difference, fp32) and fails, leaving nothing behind, if it does not.
"""


def add_convert_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("convert", help="retrofit Selective RoPE onto a RoPE or NoPE checkpoint",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a save_pretrained directory (or a Hub id when the network allows)")
    parser.add_argument("output", help="the directory to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parts = parser.add_argument_group("Selective RoPE parts")
    parts.add_argument("--no-selective", dest="selective", action="store_false",
                       help="keep the source's position embedding (a plain port into our classes)")
    parts.add_argument("--no-phase-gate", dest="phase_gate", action="store_false", help="no sigmoid phase gate")
    parts.add_argument("--phase-gate-type", choices=PHASE_GATE_TYPES, default="head")
    parts.add_argument("--phase-proj", choices=PHASE_PROJECTIONS, default="low_rank", help="phase projection type")
    parts.add_argument("--phase-proj-rank", type=_positive_int, default=32)
    parts.add_argument("--phase-conv-size", type=_non_negative_int, default=4, help="0 disables the convolution")
    parts.add_argument("--no-forget-gate", dest="forget_gate", action="store_false",
                       help="Llama-family sources: no FoX forget gate (plain softmax attention)")
    parts.add_argument("--forget-gate-bias", type=float, default=16.0,
                       help="starting bias of the added forget gate (default 16: log f ~ -1e-7 per token)")
    parts.add_argument("--seed", type=int, default=0, help="seed of the random starting factors and the probe")
    out = parser.add_argument_group("output")
    out.add_argument("--dtype", choices=DTYPES, default=None,
                     help="dtype of the converted weights (default: as the source; Selective RoPE stays float32)")
    out.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    out.add_argument("--base-model", default=None,
                     help="the source's Hub id for the model card's base_model (default: the Hub id converted from; "
                     "a local source gets none)")
    out.add_argument("--license", default=None,
                     help="the model card's license (default: the source's, from the license: of its README.md or "
                     "its config.json; required when neither names one)")
    out.add_argument("--tolerance", type=float, default=1e-4, help="largest probe logit difference (default 1e-4)")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def run_convert(args: argparse.Namespace) -> int:
    options = RetrofitOptions(selective=args.selective, phase_gate=args.phase_gate,
                              phase_gate_type=args.phase_gate_type, phase_proj=args.phase_proj,
                              phase_proj_rank=args.phase_proj_rank, phase_conv_size=args.phase_conv_size,
                              forget_gate=args.forget_gate, forget_gate_bias=args.forget_gate_bias, seed=args.seed)
    try:
        report = convert(args.source, args.output, options, dtype=args.dtype, max_shard_size=args.max_shard_size,
                         overwrite=args.overwrite, tolerance=args.tolerance, base_model=args.base_model,
                         license=args.license, progress=args.progress)
    except (ValueError, FileExistsError, FileNotFoundError, ConversionError) as error:
        raise SystemExit(f"selective-rope convert: {error}") from None
    print(f"converted {report.source} ({report.description}) -> {report.output}")
    print(f"  {report.source_tensors} source tensors used once each; {len(report.new_tensors)} new tensors; "
          f"{report.shards} shard(s)")
    print(f"  probe: max |logit difference| = {report.max_logit_difference:.3e} against the {report.reference}")
    base_model = report.base_model or "none (a local source; --base-model names its Hub id)"
    print(f"  model card: license {report.license['license']}, base_model {base_model}")
    return 0
