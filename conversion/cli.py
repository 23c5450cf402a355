"""``selective-rope convert SOURCE OUTPUT``: the command-line face of :func:`selective_rope.conversion.convert`."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import fields

from ..configuration.position_embedding import PHASE_CONV_TYPES, PHASE_GATE_TYPES, PHASE_PROJECTIONS
from .convert import DTYPES, SUPPORTED_SOURCES, ConversionError, convert, parse_size
from .retrofit import RetrofitOptions

DESCRIPTION = f"""\
Retrofit Selective RoPE onto an existing checkpoint and write a loadable save_pretrained directory (weights, config,
modeling code for trust_remote_code, tokenizer files, model card).

Sources (model_type): {", ".join(SUPPORTED_SOURCES)}.
  transformers llama/mistral/qwen2/qwen3 (RoPE types default, linear, llama3, yarn) -> SelectiveRopeFoXForCausalLM
  transformers qwen3_5 (text, or the language model of a vision-language     -> SelectiveRopeHybridForCausalLM
    checkpoint: vision tower and mtp.* not carried), qwen3_5_moe, qwen3_next
  flash-linear-attention gla/gated_deltanet/forgetting_transformer (NoPE)      -> our GLA / Gated DeltaNet / FoX
  ours with position_embedding "rope" or "nope"                                -> the same family, Selective RoPE
  the paper's own code, gla/gated_deltanet/transformer (config.json with a     -> our GLA / Gated DeltaNet / FoX
    position_embedding dict): Selective RoPE ported as it is (retrofit options do not apply), RoPE/NoPE retrofitted

The new parameters start so that the converted model computes exactly what the source computes; the command checks
this on a probe batch (max logit difference, fp32) and fails, leaving nothing behind, if it does not.

OUTPUT must lie apart from SOURCE (not SOURCE, inside it or containing it). Everything is written to a staging folder
beside OUTPUT that is renamed to OUTPUT at the very end, never over an existing OUTPUT unless --overwrite (which swaps
old and new in one step, and only replaces a folder this tool could have written: a config.json with a model_type
and model files, no subfolders). A failure, Ctrl-C or SIGTERM removes the staging folder; after a SIGKILL the next
run for the same OUTPUT removes it (and says so).
"""


def add_parser(commands) -> argparse.ArgumentParser:
    defaults = RetrofitOptions()  # the options' defaults are written once, in RetrofitOptions
    parser = commands.add_parser("convert", help="retrofit Selective RoPE onto a RoPE or NoPE checkpoint",
                                 description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a save_pretrained directory (or a Hub id when the network allows)")
    parser.add_argument("output", help="the directory to create (apart from SOURCE)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT if it exists and is a model folder (a config.json with a model_type, "
                        "model files only, no subfolders)")
    parts = parser.add_argument_group("Selective RoPE parts")
    parts.add_argument("--no-selective", dest="selective", action="store_false",
                       help="keep the source's position embedding (a plain port into our classes)")
    parts.add_argument("--no-phase-gate", dest="phase_gate", action="store_false", help="no sigmoid phase gate")
    parts.add_argument("--phase-gate-type", choices=PHASE_GATE_TYPES, default=defaults.phase_gate_type)
    parts.add_argument("--phase-gate-rank", type=_positive_int, default=defaults.phase_gate_rank,
                       help="inner width of the low_rank and channel gates")
    parts.add_argument("--phase-proj", choices=PHASE_PROJECTIONS, default=defaults.phase_proj,
                       help="phase projection type")
    parts.add_argument("--phase-proj-rank", type=_positive_int, default=defaults.phase_proj_rank,
                       help="rank per key head (low_rank) or in total (dense_low_rank)")
    parts.add_argument("--phase-conv-type", choices=PHASE_CONV_TYPES, default=defaults.phase_conv_type,
                       help="learned taps, or the fixed first difference a_t - a_{t-1}")
    parts.add_argument("--phase-conv-size", type=_non_negative_int, default=defaults.phase_conv_size,
                       help="width of the learned convolution; 0 disables it")
    parts.add_argument("--no-forget-gate", dest="forget_gate", action="store_false",
                       help="Llama-family and Qwen3.5 / Qwen3-Next sources: no FoX forget gate in the attention "
                       "layers (plain softmax attention; a plain port has none)")
    parts.add_argument("--forget-gate-bias", type=_finite_float, default=defaults.forget_gate_bias,
                       help=f"starting bias of the added forget gate (default {defaults.forget_gate_bias:g}: log f ~ "
                       f"{-math.log1p(math.exp(-defaults.forget_gate_bias)):.0e} per token)")
    parts.add_argument("--seed", type=int, default=defaults.seed,
                       help="seed of the random starting factors and the probe")
    out = parser.add_argument_group("output")
    out.add_argument("--dtype", choices=DTYPES, default=None,
                     help="dtype of the converted weights (default: as the source; Selective RoPE stays float32)")
    out.add_argument("--max-shard-size", type=_shard_size, default="5GB",
                     help="largest safetensors shard (default 5GB)")
    out.add_argument("--base-model", default=None,
                     help="the source's Hub id for the model card's base_model (default: the Hub id converted from; "
                     "a local source gets none)")
    out.add_argument("--license", default=None,
                     help="the model card's license (default: the source's, from the license: of its README.md or "
                     "its config.json; required when neither names one)")
    out.add_argument("--tolerance", type=_non_negative_float, default=1e-4,
                     help="largest probe logit difference (default 1e-4)")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def _shard_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number")
    return value


def _non_negative_float(text: str) -> float:
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises ``KeyboardInterrupt``, so that the same clean-up runs."""

    signum = signal.SIGTERM


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:  # "[Errno 28] ..." says less than the file and the reason
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error)


def run(args: argparse.Namespace) -> int:
    try:
        with _sigterm_as_interrupt():
            options = RetrofitOptions(**{option.name: getattr(args, option.name) for option in fields(RetrofitOptions)})
            report = convert(args.source, args.output, options, dtype=args.dtype, max_shard_size=args.max_shard_size,
                             overwrite=args.overwrite, tolerance=args.tolerance, base_model=args.base_model,
                             license=args.license, progress=args.progress)
    except (ValueError, OSError, ConversionError) as error:
        raise SystemExit(f"selective-rope convert: {_describe(error)}") from None
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: convert() has removed its partial output
        received = getattr(interrupt, "signum", signal.SIGINT)
        # A signal during publishing is held until OUTPUT holds the new model (output.signals_deferred).
        done = (f"{args.output} holds the converted model" if getattr(interrupt, "published", False)
                else "the partial output was removed")
        print(f"selective-rope convert: interrupted by {received.name}; {done}", file=sys.stderr, flush=True)
        raise SystemExit(128 + received) from None  # the shell's status for a process ended by that signal
    print(f"converted {report.source} ({report.description}) -> {report.output}")
    print(f"  {report.source_tensors} source tensors used once each; {len(report.new_tensors)} new tensors; "
          f"{report.shards} shard(s)")
    print(f"  probe: max |logit difference| = {report.max_logit_difference:.3e} against the {report.reference}")
    base_model = report.base_model or "none (a local source; --base-model names its Hub id)"
    print(f"  model card: license {report.license['license']}, base_model {base_model}")
    return 0
