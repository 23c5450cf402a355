"""Tile sizes and warps of the Triton Selective RoPE prefill kernels, timed on a GPU: which configuration
``rotary_triton._config`` should hold.

Run 4 on an H200 (``benchmarks/results/gpu/2026-11-27-h200``) chose the code's 32 tokens x 32 pairs with 4 warps;
the spill-free 16 x 32 with 8 warps, picked before from ``benchmarks/triton_resources.py``'s register report, was
slower in every shape, as were all 8-warp configurations. This script measures the code's configuration and each
of ``SWEEP`` (tile shapes and warps; the tile loop software-pipelined in 2-3 stages), forward and forward + backward,
with ``triton.testing.do_bench`` medians (launches pipelined, as in a training step), on bf16 q and k (16 heads of
128, R = 64).

Usage::

    python benchmarks/sweep_rotary_gpu.py                          # B=1 x T=32k and B=8 x T=8k
    python benchmarks/sweep_rotary_gpu.py --shapes 4x4096 --json sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton_resources import SWEEP

HEADS, HEAD_DIM, PAIRS = 16, 128, 64


def timings(batch: int, seq_len: int) -> dict:
    import triton

    from selective_rope.kernels.rotary_triton import selective_rotary_triton

    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)).requires_grad_()

    q, k = (randn(batch, seq_len, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    increment = randn(batch, seq_len, HEADS, PAIRS, scale=0.5)
    temperature = 500000.0 ** (-torch.arange(PAIRS, device="cuda") / PAIRS)
    grads = [torch.randn_like(q), torch.randn_like(k)]

    def forward():
        with torch.no_grad():
            selective_rotary_triton(q, k, increment, temperature)

    def forward_backward():
        out_q, out_k, _ = selective_rotary_triton(q, k, increment, temperature)
        torch.autograd.grad((out_q, out_k), (q, k, increment), grads)

    moved = batch * seq_len * (2 * HEADS * HEAD_DIM * 2 * 2 + HEADS * PAIRS * 4)  # q, k read and written; increments
    result = {}
    for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        result[f"{name}_us"] = round(ms * 1e3, 1)
    result["forward_gbps"] = round(moved / (result["forward_us"] * 1e3), 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x32768", "8x8192"], help="BxT (default 1x32768 8x8192)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_rotary_gpu.py: needs a CUDA GPU")
    from selective_rope.kernels import rotary_triton

    base = rotary_triton._config
    code = base(PAIRS, HEAD_DIM - 2 * PAIRS)
    configs = [None] + [{"BLOCK_T": t, "BLOCK_R": r, "num_warps": w, "NUM_STAGES": s} for t, r, w, s in SWEEP]
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    rows = []
    print(f"{torch.cuda.get_device_name(0)}: prefill kernels, do_bench medians (us), bf16, H={HEADS}, D={HEAD_DIM}, "
          f"R={PAIRS}; the code's configuration: BLOCK_T={code['BLOCK_T']} BLOCK_R={code['BLOCK_R']} "
          f"warps={code['num_warps']} stages={code['NUM_STAGES']}")
    for config in configs:
        rotary_triton._config = base if config is None else (lambda r, p, c=config: {**base(r, p), **c})
        label = "code" if config is None else "T{BLOCK_T:<3d} R{BLOCK_R:<3d} w{num_warps} s{NUM_STAGES}".format(
            **config)
        try:
            measured = {f"{b}x{t}": timings(b, t) for b, t in shapes}
        except Exception as error:  # noqa: BLE001 - a configuration that fails is reported, the others still run
            print(f"  {label:17s} failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        finally:
            rotary_triton._config = base
        rows.append({"config": config or "code", **measured})
        print(f"  {label:17s} " + " | ".join(
            f"{shape}: fwd {m['forward_us']:8.1f} ({m['forward_gbps']:6.0f} GB/s) "
            f"fwd+bwd {m['forward_backward_us']:8.1f}" for shape, m in measured.items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
