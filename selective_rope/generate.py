"""``selective-rope generate MODEL_DIR``: generate from a saved model directory, streaming the output."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .arguments import fail, positive, torch_device

GENERATE_DESCRIPTION = """\
Generate from a saved model directory (written by save_pretrained or selective-rope convert/demo).

The prompt is text (--prompt, needs a tokenizer saved in the directory) or token ids (--ids "5 12 19", works with or
without a tokenizer); with neither, generation starts from the model's BOS token. The continuation is streamed as it
is generated: as text when the directory has a tokenizer (transformers' TextStreamer; the prompt is echoed first;
special tokens such as <s> are not shown), otherwise, or with --print-ids, as the new token ids separated by spaces.
Greedy by default; --do-sample samples (--temperature, --top-k, --top-p, --seed); --num-beams > 1 runs beam search
and prints the result at the end.
"""


def _token_ids(text: str) -> list[int]:
    items = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    if not items or not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of non-negative token ids (e.g. \"5 12 19\")")
    return [int(item) for item in items]


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser("generate", help="generate from a saved model directory (streams the output)",
                                 description=GENERATE_DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="a directory written by save_pretrained")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer in the directory)")
    prompt.add_argument("--ids", type=_token_ids, help='prompt token ids, e.g. "5 12 19" or 5,12,19')
    parser.add_argument("--max-new-tokens", type=positive(int), default=32, help="tokens to generate (default 32)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=positive(float), default=None, help="sampling temperature")
    parser.add_argument("--top-k", type=positive(int), default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--top-p", type=positive(float), default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--num-beams", type=positive(int), default=1, help="beam search width (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling)")
    parser.add_argument("--print-ids", action="store_true", help="print token ids even when there is a tokenizer")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weights dtype (default float32; the Selective RoPE module keeps its own precision)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    return parser


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def run(args: argparse.Namespace) -> int:
    directory = Path(args.model_dir)
    if not directory.is_dir():
        raise fail("generate", f"no model directory at {directory} (pass a directory written by save_pretrained)")
    if not (directory / "config.json").exists():
        raise fail("generate", f"{directory} has no config.json: not a saved model directory")
    if args.top_p is not None and args.top_p > 1:
        raise fail("generate", f"--top-p must be in (0, 1], got {args.top_p}")
    sampling = {name: value for name, value in (("temperature", args.temperature), ("top_k", args.top_k),
                                                 ("top_p", args.top_p)) if value is not None}
    if sampling and not args.do_sample:
        raise fail("generate", "--temperature, --top-k and --top-p need --do-sample")
    tokenizer_present = _has_tokenizer(directory)
    if args.prompt is not None and not tokenizer_present:
        raise fail("generate", f"{directory} has no tokenizer: pass the prompt as token ids with --ids")
    device = torch_device("generate", args.device)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.dtype)).to(device).eval()
    except (OSError, ValueError, KeyError) as error:
        raise fail("generate", f"cannot load a model from {directory}: {error}") from None
    tokenizer = None
    if tokenizer_present:
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError) as error:
            raise fail("generate", f"cannot load the tokenizer in {directory}: {error}") from None

    config = model.config
    if args.prompt is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if ids.numel() == 0:
            raise fail("generate", f"the tokenizer turned {args.prompt!r} into no tokens")
    elif args.ids is not None:
        bad = [i for i in args.ids if i >= config.vocab_size]
        if bad:
            raise fail("generate", f"token ids {bad} are outside the vocabulary (size {config.vocab_size})")
        ids = torch.tensor([args.ids])
    elif config.bos_token_id is not None:
        ids = torch.tensor([[config.bos_token_id]])
    else:
        raise fail("generate", "the model has no BOS token: pass --prompt or --ids")

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
