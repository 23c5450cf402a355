"""The facts a GPU result needs beside it (scripts/gpu_check.sh): library versions, the device, and the measured
copy bandwidth, the ceiling against which the op's achieved bandwidth is read."""

import torch
import transformers
import triton

import selective_rope

try:
    import fla

    fla_version = fla.__version__
except ImportError:
    fla_version = None

print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
      transformers.__version__, "fla", fla_version, "selective_rope", selective_rope.__file__)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))

# A large device-to-device copy, counting bytes read plus bytes written.
source = torch.empty(2**31, dtype=torch.uint8, device="cuda")
target = torch.empty_like(source)
for _ in range(3):
    target.copy_(source)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    start.record()
    target.copy_(source)
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
print(f"copy bandwidth (read + write, 2 GiB, median of 10): {2 * source.numel() / sorted(times)[5] / 1e9:.0f} GB/s")
