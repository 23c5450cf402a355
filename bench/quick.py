"""The quick measurement of ``selective-rope bench``: a randomly initialised model of a family, in float32 under
``torch.inference_mode`` (training: forward + backward): prefill throughput, cached decoding latency and training
throughput, medians of a few timed runs after one warm-up. Configs come from the family registry."""

from __future__ import annotations

import argparse
import statistics
import time

from ..arguments import fail
from ..families import get_family


def bench_config(family: str, hidden: int, layers: int, vocab: int, position_embedding: str):
    heads = max(1, hidden // 64)
    if hidden % heads or (hidden // heads) % 2:
        raise fail("bench", f"--hidden-size {hidden} must split into {heads} heads of an even size")
    common = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, intermediate_size=32 * -(-8 * hidden // 96), position_embedding=position_embedding)
    spec = get_family(family)
    return spec.config_class(**common, **spec.head_layout(hidden, heads))


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_family(family: str, args: argparse.Namespace, device) -> dict:
    import torch

    from ..modeling import CACHE_FIELD, returned_cache

    lm_class = get_family(family).lm_class
    torch.manual_seed(0)
    config = bench_config(family, args.hidden_size, args.layers, args.vocab_size, args.position_embedding)
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
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(args.decode_tokens):
                out = model(token, **{CACHE_FIELD: cache}, use_cache=True)
                cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
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
              "prefill_tokens_per_s": tokens / median_seconds(prefill, args.repeats)}
    decode()  # warm-up
    result["decode_ms_per_token"] = 1e3 * statistics.median(decode() for _ in range(args.repeats))
    if args.train:
        result["train_tokens_per_s"] = tokens / median_seconds(train_step, args.repeats)
    return result
