"""Our Triton kernels compiled for a Hopper GPU without one: registers, spills and stack of every kernel variant the
wrappers launch, read from ptxas (the compiler's resource report; device METHOD: read what costs no device time).

Triton compiles for any target given its name, down to machine code with the ``ptxas`` its wheel carries, so a CPU
machine can check what the interpreter cannot: that each kernel compiles for a GPU at all (Triton's type rules, e.g.
a loop-carried variable keeping its dtype, are enforced only there: see test_the_op_widens_a_float32_initial_phase),
and how many registers it needs (255 per thread with spills leaves a multiprocessor two programs of 4 warps, too few
loads in flight for a memory-bound kernel).

The launches are the real ones: the wrappers (prefill forward and backward, decode step, decode phase inputs) run on
CPU tensors with the kernels replaced by recorders, so every argument, dtype and constexpr is what a GPU call with
the same shapes would pass, with the chunk plan of a 132-multiprocessor GPU; each is compiled as Triton's launcher
would compile it on the GPU (``jit_inputs``: unit strides become constants, aligned pointers and integers divisible
by 16 are marked so). Shapes: ``bench_rotary_gpu.py``'s (bf16, 16 heads of 128, R = 64), B=1, T=2048 (several
chunks a row) and B=40, T=64 (one), with an initial phase in float64 or float32 (as ``torch.library.opcheck``
passes it), and two packed sequences rotating half the head; the phase increments' kernels at those shapes, and
their backward also at the 370M FoX's and GLA's (``bench_models_gpu.py``), with and without the gate.

Usage (not under ``TRITON_INTERPRET=1``: the kernels must be Triton's compiled functions)::

    python benchmarks/triton_resources.py                   # the configuration the code uses
    python benchmarks/triton_resources.py --sweep           # and other tile sizes / warps for the prefill kernels
    python benchmarks/triton_resources.py --json out.json   # also as JSON

Exit status 1 if a kernel fails to compile (the error is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ARCH = "sm_90a"  # what Triton targets for compute capability 9.0 (H100, H200)
# (BLOCK_T, BLOCK_R, warps, pipeline stages of the tile loop): every tile shape unpipelined, and the two fastest of
# run 4 pipelined
SWEEP = ([(block_t, block_r, warps, 1) for block_t in (16, 32) for block_r in (32, 64) for warps in (4, 8)]
         + [(32, 32, 4, 2), (32, 32, 4, 3), (32, 64, 4, 2)])


def record_launches(config: dict | None = None) -> list[tuple[str, object, tuple, dict]]:
    """(kernel name, kernel, args, kwargs) of every launch of one prefill forward + backward, one decode step and
    one decode phase-input call, with ``config`` (BLOCK_T, BLOCK_R, num_warps, NUM_STAGES) replacing the prefill's
    tiles."""
    from selective_rope.kernels import phase_triton, rotary_triton

    launches = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.kernel, args, kwargs))

    kernels = [name for name in vars(rotary_triton) if name.endswith("_kernel")]
    saved = {name: getattr(rotary_triton, name) for name in (*kernels, "_config", "_chunk_tiles", "_multiprocessors")}
    phase_kernels = {name: kernel for name, kernel in vars(phase_triton).items() if name.endswith("_kernel")}
    try:
        for name in kernels:
            setattr(rotary_triton, name, Recorder(name, saved[name]))
        for name, kernel in phase_kernels.items():
            setattr(phase_triton, name, Recorder(name, kernel))
        if config is not None:
            rotary_triton._config = lambda pairs, passes: {**saved["_config"](pairs, passes), **config}
        # chunks planned as on an H100 / H200 (132 multiprocessors), so the chunked scan's kernels launch too
        rotary_triton._chunk_tiles = lambda *args: saved["_chunk_tiles"](*args[:-1], torch.device("cuda", 0))
        rotary_triton._multiprocessors = lambda index: 132
        run_every_wrapper(rotary_triton)
    finally:
        for name, value in saved.items():
            setattr(rotary_triton, name, value)
        for name, kernel in phase_kernels.items():
            setattr(phase_triton, name, kernel)
    return launches


def run_every_wrapper(rotary_triton) -> None:
    heads, head_dim, pairs, batch, seq_len, hidden = 16, 128, 64, 1, 2048, 1024
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    q, k = randn(batch, seq_len, heads, head_dim, dtype=torch.bfloat16), randn(batch, seq_len, heads, head_dim,
                                                                                dtype=torch.bfloat16)
    increment, temperature = randn(batch, seq_len, heads, pairs).abs(), randn(pairs).abs()
    phase = randn(batch, heads, pairs, dtype=torch.float64)
    rotary_triton._rotary_forward_impl(q, k, increment, temperature, phase, None)
    # a float32 initial phase, as torch.library.opcheck passes it, in both plans: several chunks a row (the scan's
    # first pass reads it) and one (the kernel's carry is the initial phase itself: 40 rows x 16 heads fill the GPU)
    rotary_triton._rotary_forward_impl(q, k, increment, temperature, phase.float(), None)
    rows = (randn(40, 64, heads, head_dim, dtype=torch.bfloat16), randn(40, 64, heads, head_dim, dtype=torch.bfloat16),
            randn(40, 64, heads, pairs).abs(), temperature, randn(40, heads, pairs))
    rotary_triton._rotary_forward_impl(*rows, None)
    torch.ops.selective_rope.rotary_backward(*rows[:2], *rows[:2], None, *rows[2:], None, True)
    torch.ops.selective_rope.rotary_backward(q, k, q, k, phase, increment, temperature, phase, None, True)
    offsets = torch.tensor([0, 700, seq_len], dtype=torch.int32)  # two packed sequences, partial rotation
    half = increment[..., :pairs // 2].contiguous()
    rotary_triton._rotary_forward_impl(q, k, half, temperature[:pairs // 2], None, offsets)
    torch.ops.selective_rope.rotary_backward(q, k, q, k, None, half, temperature[:pairs // 2], None, offsets, False)
    decode = dict(q=randn(2, heads, head_dim, dtype=torch.bfloat16), k=randn(2, heads, head_dim, dtype=torch.bfloat16),
                  projection=randn(2, heads, pairs, dtype=torch.float64), temperature=temperature,
                  phase=randn(2, heads, pairs, dtype=torch.float64),
                  conv_state=randn(2, 3, heads * pairs, dtype=torch.float64), conv_weight=randn(heads * pairs, 4),
                  bias=randn(heads, pairs), gate_logits=randn(2, heads, 1, dtype=torch.float64),
                  valid=torch.tensor([True, False]))
    rotary_triton._rotary_decode_impl(*decode.values(), True)
    chunk = hidden // heads
    steps = {name: decode[name] for name in ("q", "k", "temperature", "phase", "conv_state", "conv_weight", "bias",
                                             "valid")}
    rotary_triton.selective_rotary_decode_from_input_triton(
        x=randn(2, hidden, dtype=torch.bfloat16), down=randn(heads, 32, chunk), up=randn(heads, pairs, 32),
        gate_weight=randn(heads, hidden), gate_bias=randn(heads), conv_activation="silu", **steps)
    # the phase increments (kernels/phase_triton.py): padded rows, and packed sequences after a cached history,
    # without gate or bias; the backward alike, with bf16 x
    from selective_rope.kernels.phase_triton import phase_increment_backward_triton, phase_increment_triton

    phase = dict(down=randn(heads, 32, chunk), up=randn(heads, pairs, 32), conv_weight=randn(heads * pairs, 4))
    padded = dict(conv_activation="silu", bias=randn(heads, pairs), gate_weight=randn(heads, hidden),
                  gate_bias=randn(heads), lengths=torch.tensor([64, 9]))
    packed = dict(cu_seqlens=offsets, conv_state=randn(2, 3, heads * pairs, dtype=torch.float64))
    phase_increment_triton(randn(2, 64, hidden), **phase, **padded)
    phase_increment_triton(randn(1, seq_len, hidden), **phase, **packed)
    phase_increment_backward_triton(randn(2, 64, heads, pairs), randn(2, 64, hidden, dtype=torch.bfloat16), **phase,
                                    **padded)
    phase_increment_backward_triton(randn(1, seq_len, heads, pairs), randn(1, seq_len, hidden), **phase, **packed)
    # the backward at the 370M models' shapes (bench_models_gpu.py, the default phase path: rank 32, per-head gate,
    # 4 taps), with and without the gate: FoX (16 key heads, Dc = 64, R = 32) and GLA (4 key heads, Dc = 256, R = 64)
    # and the fused op's backward there (kernels/rotary_fused_triton.py: several chunks a sequence at B=4, T=512, so
    # the phase backward also adds the later chunks' sums the rotary walk leaves to it)
    from selective_rope.kernels.rotary_fused_triton import _backward_impl, _forward_impl

    for key_heads, pairs_370m in ((16, 32), (4, 64)):
        chunk_370m = hidden // key_heads
        weights = dict(down=randn(key_heads, 32, chunk_370m), up=randn(key_heads, pairs_370m, 32),
                       conv_weight=randn(key_heads * pairs_370m, 4))
        grad, x = randn(4, 512, key_heads, pairs_370m), randn(4, 512, hidden, dtype=torch.bfloat16)
        gated = dict(gate_weight=randn(key_heads, hidden), gate_bias=randn(key_heads))
        phase_increment_backward_triton(grad, x, **weights, **gated)
        phase_increment_backward_triton(grad, x, **weights)
        q_370m = randn(4, 512, key_heads, 2 * pairs_370m, dtype=torch.bfloat16)
        fused = (q_370m, q_370m, x, weights["down"], weights["up"], weights["conv_weight"], None, gated["gate_weight"],
                 gated["gate_bias"], randn(pairs_370m).abs(), None, None, None, None, False)
        *_, increment_370m, totals_370m = _forward_impl(*fused)
        _backward_impl(*fused[:10], *fused[11:14], increment_370m, totals_370m, q_370m, q_370m, None, False, True)
    # the fused op from the input: the phase kernel writing the scan's chunk totals after an initial phase, then pass 2
    # from them; padded rows of one chunk, a packed row of several; and their backward
    gate = dict(bias=randn(heads, pairs), gate_weight=randn(heads, hidden), gate_bias=randn(heads))
    cases = [(*rows[:2], randn(40, 64, hidden), phase["down"], phase["up"], phase["conv_weight"], gate["bias"],
              gate["gate_weight"], gate["gate_bias"], temperature, randn(40, heads, pairs, dtype=torch.float64),
              randn(40, 3, heads * pairs, dtype=torch.float64), torch.full((40,), 50), None, True),
             (q, k, randn(1, seq_len, hidden), phase["down"], phase["up"], phase["conv_weight"], None, None, None,
              temperature, None, None, None, offsets, False),
             (q, k, randn(1, seq_len, hidden), phase["down"], phase["up"], phase["conv_weight"], gate["bias"],
              gate["gate_weight"], gate["gate_bias"], temperature, None, None, None, offsets, True)]
    for case in cases:
        q_in, k_in, *_, silu = case
        _, _, _, _, increment, totals = _forward_impl(*case)
        _backward_impl(*case[:10], *case[11:14], increment, totals, q_in, k_in, None, silu, True)


def jit_inputs(kernel, args: tuple, kwargs: dict, backend) -> tuple[dict, dict, dict, object]:
    """What Triton's launcher would compile for one recorded launch on a GPU: (signature, constexprs, attributes,
    options), made by Triton's own binder. It specialises as a GPU launch does: an integer equal to 1 (a unit
    stride) becomes a constant, and integers divisible by 16 and 16-byte-aligned pointers are marked so
    (``tt.divisibility``). Without that the compiler does not know which dim is contiguous: it then lays the tiles
    out along time, with unvectorised loads and twice the registers of what runs (255 against 122 for the forward
    with Triton 3.6, 28 Nov 2026)."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, types, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return types, constexprs, attrs, options


def ptxas_report(cubin_ptx: str) -> dict:
    """Registers, spill bytes and stack frame from ``ptxas -v`` (Triton's newest bundled ptxas)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(cubin_ptx)
        result = subprocess.run([str(ptxas), f"-arch={ARCH}", "-v", str(source), "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    numbers = {key: int(match.group(1)) if (match := re.search(pattern, result.stderr)) else 0
               for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill st"),
                                    ("spill_loads", r"(\d+) bytes spill lo"), ("stack", r"(\d+) bytes stack frame"))}
    return numbers


def compile_report(launches) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    rows, seen = [], set()
    for name, kernel, args, kwargs in launches:
        types, constexprs, attrs, options = jit_inputs(kernel, args, kwargs, backend)
        key = (name, tuple(types.items()), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
               repr(options))
        if key in seen:
            continue
        seen.add(key)
        names = {(index,): param.name for index, param in enumerate(kernel.params)}
        row = {"kernel": name, "num_warps": options.num_warps, "num_stages": options.num_stages,
               "constexprs": {names[path]: value for path, value in constexprs.items()
                              if kernel.params[path[0]].is_constexpr and value is not None},
               # arguments the launcher makes constants (integers equal to 1: the unit strides)
               "specialised_to_1": [names[path] for path in constexprs if not kernel.params[path[0]].is_constexpr]}
        try:
            compiled = triton.compile(ASTSource(kernel, types, constexprs, attrs), target=target,
                                      options=options.__dict__)
            row.update(ptxas_report(compiled.asm["ptx"]))
        except Exception as error:  # noqa: BLE001 - reported, and the exit status says it
            row["error"] = f"{type(error).__name__}: {str(error)[-2000:]}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also other prefill tiles and warps")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("triton_resources.py: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")

    configs = [None] + ([{"BLOCK_T": t, "BLOCK_R": r, "num_warps": w, "NUM_STAGES": s} for t, r, w, s in SWEEP]
                        if args.sweep else [])
    rows = []
    for config in configs:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # Triton's knob warnings
            report = compile_report(record_launches(config))
        for row in report:
            row["config"] = "code" if config is None else config
        rows += [row for row in report if config is None or row["kernel"] in (
            "_selective_rotary_fwd_kernel", "_selective_rotary_bwd_kernel")]
    print(f"Triton kernels compiled for {ARCH} (registers per thread of 255; spills and stack in bytes)")
    for row in rows:
        shown = {k: v for k, v in row["constexprs"].items()
                 if k.startswith(("BLOCK", "HAS", "CONV", "IS_", "WALK", "LATER"))}
        where = "code" if row["config"] == "code" else "sweep"
        if "error" in row:
            print(f"  {where:5s} {row['kernel']:32s} warps {row['num_warps']} {shown}: FAILED {row['error']}")
        else:
            print(f"  {where:5s} {row['kernel']:32s} warps {row['num_warps']} regs {row['registers']:3d} spills "
                  f"{row['spill_stores']}/{row['spill_loads']} stack {row['stack']:4d}  {shown}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
