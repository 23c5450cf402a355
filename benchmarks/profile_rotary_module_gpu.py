"""Where one training step of a Selective RoPE layer spends its GPU time: the phase path (``phase_increment``: the
float64 chunk normalisation, projection, convolution, bias and gate) against the rotary op, for one attention layer
of the 370M models of ``bench_models_gpu.py``.

The first 370M run (benchmarks/results/gpu/2026-11-27-h200, run 3) measured Selective RoPE FoX at 0.66x NoPE's
training tokens/s and +12.9 GiB of peak memory: ~5 ms and ~540 MB of saved tensors per layer and step. This script
splits that per layer, under the benchmark's bf16 autocast with float32 weights, batch ``--batch`` x ``--seq-len``:

- ``phase path``: ``phase_increment`` forward + backward (its increment's gradient given);
- ``rotary op``: ``selective_rotary`` forward + backward on a fixed increment;
- ``module``: the whole ``SelectiveRotaryEmbedding`` forward + backward (RoPE's module beside it);
- forward only, no autograd: the phase path's PyTorch ops against ``kernels/phase_triton.py``'s one launch (issue
  46's first block of the phase path in Triton: the same increments);
each as GPU time (CUDA events around calls run back to back), host time per call, and the memory its forward keeps
for the backward; then torch.profiler's table of the module's forward + backward sorted by GPU time.

Usage::

    python benchmarks/profile_rotary_module_gpu.py                       # FoX's layer, 4 x 4096 tokens
    python benchmarks/profile_rotary_module_gpu.py --family gla
    TRITON_INTERPRET=1 python benchmarks/profile_rotary_module_gpu.py --device cpu --seq-len 32 --repeats 2  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_models_gpu import MODEL_CONFIGS
from profile_rotary_gpu import device_us, host_times, profile_table

from selective_rope.families import FAMILIES
from selective_rope.kernels.phase_triton import phase_increment_triton
from selective_rope.kernels.rotary import selective_rotary
from selective_rope.modeling.rotary import SelectiveRotaryEmbedding


def attention_shape(family: str) -> tuple[int, int, int]:
    """(query heads, key heads, head size) that the family's 370M layer gives its rotary module: read off q and k in
    one forward of a one-layer model on the CPU (two tokens)."""
    config = FAMILIES[family].config_class(**{**MODEL_CONFIGS[family], "num_hidden_layers": 1})
    model = FAMILIES[family].lm_class(config)
    module = next(m for m in model.modules() if isinstance(m, SelectiveRotaryEmbedding))
    seen = {}
    hook = module.register_forward_pre_hook(lambda _, args: seen.update(q=args[1].shape, k=args[2].shape))
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long))
    hook.remove()
    return seen["q"][2], seen["k"][2], seen["q"][3]


def build(family: str, position_embedding: str, device: str) -> SelectiveRotaryEmbedding:
    torch.manual_seed(0)
    config = FAMILIES[family].config_class(**{**MODEL_CONFIGS[family], "num_hidden_layers": 1},
                                           position_embedding=position_embedding)
    return SelectiveRotaryEmbedding(config, *attention_shape(family)).to(device)


def measure(fn, repeats: int, device: str) -> dict:
    """GPU time (events around back-to-back calls), host time per call, and what a forward keeps for its backward
    (``fn(keep=True)`` returns the outputs; their graph is alive while they are)."""
    host, _ = host_times(fn, repeats, device)
    result = {"host_us": 1e6 * statistics.median(host)}
    if device == "cuda":
        result["gpu_us"] = device_us(fn, repeats)
        before = torch.cuda.memory_allocated()
        kept = fn(keep=True)
        torch.cuda.synchronize()
        result["saved_mib"] = (torch.cuda.memory_allocated() - before) / 2**20
        del kept
    return result


def calls(family: str, batch: int, seq_len: int, device: str) -> dict:
    selective, rope = build(family, "selective_rope", device), build(family, "rope", device)
    heads, key_heads, head_dim = attention_shape(family)
    hidden = MODEL_CONFIGS[family]["hidden_size"]
    generator = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator, dtype=torch.bfloat16).requires_grad_()

    x, q, k = randn(batch, seq_len, hidden), randn(batch, seq_len, heads, head_dim), randn(batch, seq_len, key_heads,
                                                                                             head_dim)
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    backend = "triton"  # on the CPU (smoke run), the same kernels under the interpreter
    increment = (0.1 * torch.rand(batch, seq_len, key_heads, selective.rotary_pairs, device=device)).requires_grad_()
    grad_increment = torch.randn_like(increment)

    def autocast():
        return torch.autocast(device, dtype=torch.bfloat16)

    def phase_path(keep=False):
        with autocast():
            out, _ = selective.phase_increment(x, None, None, None)
        if keep:
            return out
        weights = [w for w in selective.parameters() if w.requires_grad]
        torch.autograd.grad(out, [x, *weights], grad_increment, allow_unused=True)

    def rotary_op(keep=False):
        with autocast():
            out_q, out_k, _ = selective_rotary(q, k, increment, selective.temperature, None, backend=backend)
        if keep:
            return out_q, out_k
        torch.autograd.grad((out_q, out_k), (q, k, increment), (grad_q, grad_k))

    def module(rotary, keep=False):
        with autocast():
            out_q, out_k, _ = rotary(x, q, k, None, None, None, backend=backend)
        if keep:
            return out_q, out_k
        torch.autograd.grad((out_q, out_k), (x, q, k), (grad_q, grad_k), allow_unused=True)

    @torch.no_grad()
    def phase_path_forward(keep=False):
        with autocast():
            out, _ = selective.phase_increment(x, None, None, None)
        return out if keep else None

    @torch.no_grad()
    def phase_kernel_forward(keep=False):
        conv, gate, proj = selective.phase_conv, selective.phase_gate_proj, selective.phase_proj
        out, _ = phase_increment_triton(x, proj.down, proj.up, conv.taps(x.device), conv.activation,
                                        selective.phase_bias, gate.weight, gate.bias)
        return out if keep else None

    return {"phase path": phase_path, "rotary op": rotary_op,
            "module (Selective RoPE)": lambda keep=False: module(selective, keep),
            "module (RoPE)": lambda keep=False: module(rope, keep),
            "phase path, forward": phase_path_forward, "phase kernel, forward": phase_kernel_forward}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=list(MODEL_CONFIGS), default="fox")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=25, help="rows of the profiler table")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_rotary_module_gpu.py: no CUDA device (--device cpu with TRITON_INTERPRET=1 for a smoke run)")

    fns = calls(args.family, args.batch, args.seq_len, args.device)
    heads, key_heads, head_dim = attention_shape(args.family)
    print(f"Selective RoPE module of one {args.family} 370M layer ({heads} query / {key_heads} key heads of "
          f"{head_dim}), {args.batch} x {args.seq_len} tokens, bf16 autocast, forward + backward; "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}; medians")
    for name, fn in fns.items():
        row = measure(fn, args.repeats, args.device)
        print(f"  {name:24s} " + "  ".join(f"{key.rsplit('_', 1)[0]} {value:9.1f} {key.rsplit('_', 1)[1]}"
                                           for key, value in row.items()), flush=True)

    sort_by = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(f"\nmodule (Selective RoPE), forward + backward: 3 calls, by {sort_by}")
    print(profile_table(fns["module (Selective RoPE)"], 3, args.device, sort_by, args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
