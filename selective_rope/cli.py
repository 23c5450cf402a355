"""The ``selective-rope`` command (also ``python -m selective_rope``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .conversion.cli import add_convert_parser, run_convert
from .families import FAMILY_NAMES, get_family

# The full CPU benchmark scripts (bench_<family>_cpu.py) live in the source repository, not in the installed package.
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selective-rope",
                                     description="Selective RoPE models for Hugging Face Transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a tiny model on CPU, save, reload and generate",
                               description="Train a tiny selective-rope model (SelectiveRopeGLA by default) on a "
                               "synthetic task (continuing arithmetic progressions), save it, reload it with "
                               "AutoModelForCausalLM and generate.")
    demo.add_argument("--family", choices=FAMILY_NAMES, default="gla", help="model family (default gla)")
    demo.add_argument("--output-dir", default="demo_output", help="where the trained model is saved")
    demo.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    demo.add_argument("--max-steps", type=int, default=2000, help="upper bound on training steps")
    demo.add_argument("--seed", type=int, default=0)
    add_convert_parser(commands)
    add_generate_parser(commands)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.seconds <= 0 or args.max_steps <= 0:
            raise SystemExit("selective-rope demo: --seconds and --max-steps must be positive")
        from .demo import run_demo

        run_demo(args.output_dir, args.seconds, args.max_steps, args.seed, args.family)
    if args.command == "convert":
        return run_convert(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        return run_bench(args)
    return 0


# -- selective-rope generate -----------------------------------------------------------------------------------------

GENERATE_DESCRIPTION = """\
Generate from a saved model directory (written by save_pretrained or selective-rope convert/demo).

The prompt is text (--prompt, needs a tokenizer saved in the directory) or token ids (--ids "5 12 19", works with or
without a tokenizer); with neither, generation starts from the model's BOS token. The continuation is streamed as it
is generated: as text when the directory has a tokenizer (transformers' TextStreamer; the prompt is echoed first;
special tokens such as <s> are not shown), otherwise, or with --print-ids, as the new token ids separated by spaces.
Greedy by default; --do-sample samples (--temperature, --top-k, --top-p, --seed); --num-beams > 1 runs beam search
and prints the result at the end.
"""


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def _token_ids(text: str) -> list[int]:
    items = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of non-negative token ids (e.g. \"5 12 19\")")
    return [int(item) for item in items]


def add_generate_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("generate", help="generate from a saved model directory (streams the output)",
                                 description=GENERATE_DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="a directory written by save_pretrained")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in the directory)")
    prompt.add_argument("--ids", type=_token_ids, help='prompt token ids, e.g. "5 12 19" or 5,12,19')
    parser.add_argument("--max-new-tokens", type=_positive(int), default=32, help="tokens to generate (default 32)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=_positive(float), default=None, help="sampling temperature")
    parser.add_argument("--top-k", type=_positive(int), default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=_positive(float), default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--num-beams", type=_positive(int), default=1, help="beam search width (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling)")
    parser.add_argument("--print-ids", action="store_true", help="print token ids even when there is a tokenizer")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights dtype (default float32; the Selective RoPE module keeps its own precision)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    return parser


def _fail(command: str, message: str) -> SystemExit:
    return SystemExit(f"selective-rope {command}: {message}")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _device(command: str, requested: str | None):
    import torch

    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise _fail(command, f"invalid --device {requested!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _fail(command, f"--device {requested}: CUDA is not available on this machine")
    return device


def run_generate(args: argparse.Namespace) -> int:
    directory = Path(args.model_dir)
    if not directory.is_dir():
        raise _fail("generate", f"no model directory at {directory} (pass a directory written by save_pretrained)")
    if not (directory / "config.json").exists():
        raise _fail("generate", f"{directory} has no config.json: not a saved model directory")
    if args.top_p is not None and args.top_p > 1:
        raise _fail("generate", f"--top-p must be in (0, 1], got {args.top_p}")
    sampling = {name: value for name, value in (("temperature", args.temperature), ("top_k", args.top_k),
                                                 ("top_p", args.top_p)) if value is not None}
    if sampling and not args.do_sample:
        raise _fail("generate", "--temperature, --top-k and --top-p need --do-sample")
    tokenizer_present = _has_tokenizer(directory)
    if args.prompt is not None and not tokenizer_present:
        raise _fail("generate", f"{directory} has no tokenizer: pass the prompt as token ids with --ids")
    device = _device("generate", args.device)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype)).to(device).eval()
    except (OSError, ValueError, KeyError) as error:
        raise _fail("generate", f"cannot load a model from {directory}: {error}") from None
    tokenizer = None
    if tokenizer_present:
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as error:
            raise _fail("generate", f"cannot load the tokenizer in {directory}: {error}") from None

    config = model.config
    if args.prompt is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if ids.numel() == 0:
            raise _fail("generate", f"the tokenizer turned {args.prompt!r} into no tokens")
    elif args.ids is not None:
        bad = [i for i in args.ids if i >= config.vocab_size]
        if bad:
            raise _fail("generate", f"token ids {bad} are outside the vocabulary (size {config.vocab_size})")
        ids = torch.tensor([args.ids])
    elif config.bos_token_id is not None:
        ids = torch.tensor([[config.bos_token_id]])
    else:
        raise _fail("generate", "the model has no BOS token: pass --prompt or --ids")

    if args.seed is not None:
        torch.manual_seed(args.seed)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, num_beams=args.num_beams, **sampling)
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    if pad is not None:
        kwargs["pad_token_id"] = pad if isinstance(pad, int) else pad[0]
    as_text = tokenizer is not None and not args.print_ids
    # Text is shown without special tokens (the prompt's <s>, a closing </s>); --print-ids shows every id.
    if args.num_beams == 1:  # transformers streams greedy and sampled decoding, not beam search
        kwargs["streamer"] = TextStreamer(tokenizer, skip_special_tokens=True) if as_text else _IdStreamer()
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), **kwargs)
    if args.num_beams > 1:
        new = out[0, ids.shape[1]:].tolist()
        print(tokenizer.decode(out[0], skip_special_tokens=True) if as_text else " ".join(map(str, new)), flush=True)
    return 0


class _IdStreamer:
    """Prints the generated token ids (not the prompt) as they come (transformers' streamer protocol)."""

    def __init__(self):
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first puts the prompt
            self.prompt_seen = True
            return
        print(" ".join(str(token) for token in value.reshape(-1).tolist()), end=" ", flush=True)

    def end(self) -> None:
        print(flush=True)


# -- selective-rope bench --------------------------------------------------------------------------------------------

BENCH_DESCRIPTION = """\
A quick benchmark of randomly initialised models of each family, in float32 under torch.inference_mode (training:
forward + backward): prefill throughput (tokens/s), cached decoding latency (ms/token after a prefill of --seq-len
tokens) and training throughput (tokens/s). Medians over --repeats timed runs after one warm-up run; the machine
(device, threads, torch version) and its load average are printed with the numbers, since other processes on the
machine change them a lot. For careful numbers (interleaved variants, contention detection, JSON with provenance)
use --full, which runs the family's script from the source repository's benchmarks/ folder
(benchmarks/bench_<family>_cpu.py; their --help describes them).
"""


BENCH_DEFAULTS = dict(hidden_size=256, layers=4, seq_len=512, decode_tokens=32, repeats=3)
BENCH_QUICK = dict(hidden_size=64, layers=2, seq_len=64, decode_tokens=8, repeats=1)


def add_bench_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("bench", help="benchmark prefill, decoding and training speed of each family",
                                 description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=(*FAMILY_NAMES, "all"), default="all", help="model family (default all)")
    parser.add_argument("--hidden-size", type=_positive(int), default=None, help="model width (default 256)")
    parser.add_argument("--layers", type=_positive(int), default=None, help="number of blocks (default 4)")
    parser.add_argument("--vocab-size", type=_positive(int), default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--position-embedding", choices=("selective_rope", "rope", "nope"), default="selective_rope")
    parser.add_argument("--batch", type=_positive(int), default=1, help="batch size (default 1)")
    parser.add_argument("--seq-len", type=_positive(int), default=None, help="prompt / training length (default 512)")
    parser.add_argument("--decode-tokens", type=_positive(int), default=None,
                        help="tokens decoded one at a time after the prefill (default 32)")
    parser.add_argument("--repeats", type=_positive(int), default=None, help="timed runs per measurement (default 3)")
    parser.add_argument("--no-train", dest="train", action="store_false", help="skip the training measurement")
    parser.add_argument("--threads", type=_positive(int), default=None, help="torch intra-op threads")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON to this path")
    parser.add_argument("--full", action="store_true",
                        help="run benchmarks/bench_<family>_cpu.py from the source repository instead")
    parser.add_argument("--quick", action="store_true",
                        help="with --full: the scripts' short smoke run; otherwise the defaults become a tiny model "
                        "and short inputs (hidden size 64, 2 layers, 64 tokens, 8 decoded, 1 run)")
    parser.add_argument("--compare", action="store_true",
                        help="with --full: only the scripts' interleaved comparisons (--compare-only): FoX against "
                        "transformers' Llama (a random Llama converted as a plain port and as Selective RoPE FoX), "
                        "GLA and Gated DeltaNet with Selective RoPE against NoPE; decode and prefill ratios")
    return parser


def _bench_config(family: str, hidden: int, layers: int, vocab: int, position_embedding: str):
    heads = max(1, hidden // 64)
    if hidden % heads or (hidden // heads) % 2:
        raise _fail("bench", f"--hidden-size {hidden} must split into {heads} heads of an even size")
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, intermediate_size=32 * -(-8 * hidden // 96), position_embedding=position_embedding)
    spec = get_family(family)
    return spec.config_class(**common, **spec.head_layout(hidden, heads))


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench_family(family: str, args: argparse.Namespace, device) -> dict:
    import torch

    lm_class = get_family(family).lm_class
    torch.manual_seed(0)
    config = _bench_config(family, args.hidden_size, args.layers, args.vocab_size, args.position_embedding)
    model = lm_class(config).to(device).eval()
    ids = torch.randint(3, args.vocab_size, (args.batch, args.seq_len), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def prefill():
        with torch.inference_mode():
            model(ids, use_cache=False)
        sync()

    def decode():  # seconds per decoded token, after a cached prefill (not timed)
        with torch.inference_mode():
            out = model(ids, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(args.decode_tokens):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            sync()
            return (time.perf_counter() - start) / args.decode_tokens

    def train_step():
        model.train()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()
        sync()

    tokens = args.batch * args.seq_len
    result = {"family": family, "parameters": model.num_parameters(), "config": config.to_diff_dict(),
              "prefill_tokens_per_s": tokens / _median_seconds(prefill, args.repeats)}
    decode()  # warm-up
    result["decode_ms_per_token"] = 1e3 * statistics.median(decode() for _ in range(args.repeats))
    if args.train:
        result["train_tokens_per_s"] = tokens / _median_seconds(train_step, args.repeats)
    return result


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def _run_full_benchmarks(families: list[str], quick: bool, compare: bool = False) -> int:
    scripts = [BENCHMARKS_DIR / f"bench_{family}_cpu.py" for family in families]
    missing = [str(script) for script in scripts if not script.exists()]
    if missing:
        raise _fail("bench", f"--full needs the source repository's benchmark scripts, not found: {', '.join(missing)} "
                    "(they are not part of the installed package; run without --full for the built-in benchmark)")
    for script in scripts:
        flags = [*(["--quick"] if quick else []), *(["--compare-only"] if compare else [])]
        command = [sys.executable, str(script), *flags]
        print("$ " + " ".join(command), flush=True)
        code = subprocess.run(command, cwd=BENCHMARKS_DIR.parent).returncode
        if code:
            raise _fail("bench", f"{script.name} exited with status {code}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    families = list(FAMILY_NAMES) if args.family == "all" else [args.family]
    if args.compare and not args.full:
        raise _fail("bench", "--compare runs the source repository's benchmark scripts: use it with --full")
    if args.full:
        return _run_full_benchmarks(families, args.quick, args.compare)
    defaults = BENCH_QUICK if args.quick else BENCH_DEFAULTS
    for name, value in defaults.items():  # sizes not given on the command line
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = _device("bench", args.device)

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine = {"device": str(device), "cpu": _cpu_name(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "load_before": _load()}
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    print(f"device {machine['device']} ({machine.get('gpu', machine['cpu'])}), {machine['threads']} threads, "
          f"torch {machine['torch']}, float32; load average {machine['load_before']}", flush=True)
    print(f"batch {args.batch} x {args.seq_len} tokens, {args.decode_tokens} decoded tokens, median of "
          f"{args.repeats} runs, position_embedding={args.position_embedding}", flush=True)
    header = f"{'family':<15} {'params':>10} {'prefill tok/s':>14} {'decode ms/tok':>14} {'train tok/s':>12}"
    print(header, flush=True)
    results = []
    for family in families:
        row = _bench_family(family, args, device)
        results.append(row)
        train = f"{row['train_tokens_per_s']:12.0f}" if "train_tokens_per_s" in row else f"{'-':>12}"
        print(f"{family:<15} {row['parameters']:>10,} {row['prefill_tokens_per_s']:14.0f} "
              f"{row['decode_ms_per_token']:14.2f} {train}", flush=True)
    machine["load_after"] = _load()
    print(f"load average after: {machine['load_after']}", flush=True)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"}
        args.output.write_text(json.dumps({"machine": machine, "settings": settings, "results": results}, indent=2))
        print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
