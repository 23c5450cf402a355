"""Serving throughput on the CPU: 16 concurrent requests through vLLM (the selective_rope.serving plugin) against one
batched ``generate()`` of the same 16 prompts, per family, side by side in one run. Run it in the vLLM environment
(``bash scripts/vllm_env.sh``); it reports, it has no target.

Each family: a small random float32 model (hidden 256, 4 layers, vocabulary 1024; FoX with head dim 64, which vLLM's
CPU attention takes), 16 prompts of 64 tokens, 32 greedy new tokens each (EOS ignored). vLLM gets all 16 requests at
once (``LLM.generate``, in-process engine, eager); ``generate()`` gets them as one batch of 16. After one warm-up run
each, ``--rounds`` timed runs alternate between the two; requests/s and generated tokens/s are the medians.

Usage::

    .venv-vllm/bin/python benchmarks/bench_vllm_cpu.py            # -> benchmarks/results/vllm_cpu.json
    .venv-vllm/bin/python benchmarks/bench_vllm_cpu.py --quick    # smoke run (tiny models, 1 round)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402

import selective_rope  # noqa: E402

from harness.machine import device_info, load_average, source_provenance  # noqa: E402
from harness.report import log, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "vllm_cpu.json"
SOURCES = ["benchmarks/bench_vllm_cpu.py", "serving/models.py", "serving/states.py", "modeling/base.py"]
SHARED = dict(vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_hidden_layers=4)
FAMILIES = {
    "gla": (selective_rope.SelectiveRopeGLAForCausalLM, dict(hidden_size=256, num_heads=4, use_short_conv=True)),
    "gated_deltanet": (selective_rope.SelectiveRopeGatedDeltaNetForCausalLM,
                       dict(hidden_size=256, num_heads=4, head_dim=64, expand_v=1.0, use_short_conv=True)),
    "fox": (selective_rope.SelectiveRopeFoXForCausalLM,
            dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64)),
}
PLANS = {
    "quick": dict(requests=16, prompt_tokens=16, new_tokens=4, rounds=1, width=64),
    "full": dict(requests=16, prompt_tokens=64, new_tokens=32, rounds=3, width=256),
}


def build(family: str, width: int, directory: Path) -> torch.nn.Module:
    lm_class, options = FAMILIES[family]
    options = {**options, "hidden_size": width}
    torch.manual_seed(0)
    model = lm_class(lm_class.config_class(**SHARED, **options)).eval()
    model.save_pretrained(directory)
    return model


def time_vllm(llm, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def time_generate(model, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def rates(seconds: list[float], plan: dict) -> dict:
    median = statistics.median(seconds)
    return {"seconds": [round(s, 3) for s in seconds], "median_s": round(median, 3),
            "requests_per_s": round(plan["requests"] / median, 2),
            "tokens_per_s": round(plan["requests"] * plan["new_tokens"] / median, 1)}


def bench_family(family: str, plan: dict, directory: Path) -> dict:
    from vllm import LLM

    model = build(family, plan["width"], directory)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, SHARED["vocab_size"], (plan["requests"], plan["prompt_tokens"]),
                            generator=generator).tolist()
    llm = LLM(model=str(directory), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=plan["prompt_tokens"] + plan["new_tokens"] + 8, max_num_seqs=plan["requests"], seed=0)
    time_vllm(llm, prompts[:2], 2)  # warm-up
    time_generate(model, prompts[:2], 2)
    timings = {"vllm": [], "generate": []}
    load_before = load_average()  # other processes change CPU timings a lot: recorded with them
    for _ in range(plan["rounds"]):
        seconds, served = time_vllm(llm, prompts, plan["new_tokens"])
        timings["vllm"].append(seconds)
        seconds, generated = time_generate(model, prompts, plan["new_tokens"])
        timings["generate"].append(seconds)
    record = {name: rates(seconds, plan) for name, seconds in timings.items()}
    record["same_tokens"] = served == generated
    record["load_average_before_after"] = [load_before, load_average()]
    record["vllm_over_generate_tokens_per_s"] = round(record["vllm"]["tokens_per_s"]
                                                      / record["generate"]["tokens_per_s"], 2)
    log(f"{family:15s} vLLM {record['vllm']['requests_per_s']:7.2f} req/s {record['vllm']['tokens_per_s']:8.1f} tok/s"
        f" | generate() {record['generate']['requests_per_s']:7.2f} req/s {record['generate']['tokens_per_s']:8.1f}"
        f" tok/s | same tokens: {record['same_tokens']}")
    del llm
    gc.collect()
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, one round (a smoke run)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--output", type=Path, default=None, help=f"default: {DEFAULT_OUTPUT} (--quick: none)")
    args = parser.parse_args(argv)
    import transformers
    import vllm

    plan = PLANS["quick" if args.quick else "full"]
    results = {"benchmark": "vllm_cpu", "mode": "quick" if args.quick else "full",
               "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
               "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                            "transformers": transformers.__version__, "selective_rope": selective_rope.__version__},
               "device": device_info(torch.get_num_threads()), "source": source_provenance(ROOT, SOURCES),
               "plan": plan, "families": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for family in args.families:
            results["families"][family] = bench_family(family, plan, Path(scratch) / family)
    output = args.output or (None if args.quick else DEFAULT_OUTPUT)
    if output is not None:
        write_results(output, results)


if __name__ == "__main__":
    main()
