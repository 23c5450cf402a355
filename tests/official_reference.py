"""The paper's own models (github.com/timurcarstensen/selective-rope: GLA, Gated DeltaNet, softmax attention with its
SelectiveRoPE), written here token by token in float64 from their formulas, and tiny checkpoints in their format.

Independent of the package: the reference the converted models are checked against (the official code needs CUDA).
It computes the intended math, one sequence at a time, so it has none of the official batching defects (phases running
across a padded batch, the decode step's gate order); the converter says so in its card.

Official layout: ``model.embeddings``, ``model.layers.{i}.{attn_norm, attn, mlp_norm, mlp}``, ``model.norm``,
``lm_head``; fla's RMSNorm ``x · rsqrt(mean x² + eps) · w``; fla's GatedMLP ``down(swish(gate x) ⊙ up x)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

DOUBLE = torch.float64

# -- tiny checkpoints in the official format ---------------------------------------------------------------------------

BASE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, intermediate_size=48, hidden_ratio=4,
            hidden_act="swish", norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, initializer_range=0.02, fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True,
            fuse_linear_cross_entropy=False, use_l2warp=False, use_cache=True, max_position_embeddings=2048)
FAMILY_CONFIGS = {
    "gla": dict(model_type="gla", attn_mode="chunk", expand_k=0.5, expand_v=1.0, num_heads=2, num_kv_heads=None,
                feature_map=None, use_short_conv=True, conv_size=3, use_output_gate=True, clamp_min=None,
                elementwise_affine=True, gate_logit_normalizer=16, attn=None, norm_q=False, norm_k=False),
    "gated_deltanet": dict(model_type="gated_deltanet", attn_mode="chunk", expand_v=1.5, use_gate=True,
                           use_short_conv=True, allow_neg_eigval=True, conv_size=3, head_dim=8, num_heads=2,
                           num_v_heads=4, attn=None),
    "transformer": dict(model_type="transformer", num_heads=4, num_kv_heads=None, qkv_bias=True, qk_norm=False,
                        window_size=None, elementwise_affine=True),
}


def official_config(model_type: str, position_embedding: dict, **changes) -> dict:
    return {**BASE, **FAMILY_CONFIGS[model_type], "position_embedding": position_embedding, **changes}


def _heads(config: dict) -> dict:
    """Head counts and sizes as the official layers compute them."""
    hidden, kind = config["hidden_size"], config["model_type"]
    if kind == "gla":
        heads = config["num_heads"]
        kv_heads = config.get("num_kv_heads") or heads
        head_k, head_v = int(hidden * config["expand_k"]) // heads, int(hidden * config["expand_v"]) // heads
        return dict(heads=heads, kv_heads=kv_heads, v_heads=kv_heads, head_k=head_k, head_v=head_v)
    if kind == "gated_deltanet":
        heads, head_k = config["num_heads"], config["head_dim"]
        v_heads = config.get("num_v_heads") or heads
        head_v = int(head_k * config["expand_v"])
        return dict(heads=heads, kv_heads=heads, v_heads=v_heads, head_k=head_k, head_v=head_v)
    heads = config["num_heads"]
    kv_heads = config.get("num_kv_heads") or heads
    return dict(heads=heads, kv_heads=kv_heads, v_heads=kv_heads, head_k=hidden // heads, head_v=hidden // heads)


def rotary_temperature(options: dict, head_k: int) -> torch.Tensor:
    """The official temperature, ``(1, 1, 1, R)`` float32."""
    theta, scale, half = options.get("temp_theta", 500000), options.get("temp_max", 1.0), head_k // 2
    if options.get("temp_type", "rope") == "rfa":
        angles = torch.linspace(0.0, theta * math.pi, half)
        temperature = torch.sqrt((1 - torch.cos(angles)) / (1 + torch.cos(angles)))
        return (scale * temperature / temperature.max()).reshape(1, 1, 1, -1)
    return (scale / theta ** (torch.arange(0, head_k, 2, dtype=torch.float32) / head_k)).reshape(1, 1, 1, -1)


def _rotary_shapes(config: dict, sizes: dict) -> dict[str, tuple]:
    options = config["position_embedding"]
    hidden, heads, half = config["hidden_size"], sizes["heads"], sizes["head_k"] // 2
    shapes = {}
    if options.get("phi_parametrization", "low-rank") == "low-rank":
        rank = options.get("phi_proj_rank", 16)
        shapes.update({"phi_proj.0.weight": (rank, hidden), "phi_proj.1.weight": (heads * half, rank)})
    else:
        shapes.update({"phi_proj.weight": (heads, hidden // heads, half), "phi_proj.scalar": (heads,)})
    if not options.get("skip_conv", False):
        shapes["phi_conv1d.weight"] = (heads * half, 1, options.get("d_conv", 4))
    if options.get("use_bias", False):
        shapes["phi_bias"] = (1, 1, heads, half)
    if options.get("use_gate", False):
        gate, rank = options.get("gate_parametrization", "standard"), options.get("gate_low_rank_dim", 16)
        if gate == "standard":
            shapes.update({"phase_gate_proj.weight": (heads, hidden), "phase_gate_proj.bias": (heads,)})
        else:
            width = heads * (half if gate == "gla" else 1)
            shapes.update({"phase_gate_proj.0.weight": (rank, hidden), "phase_gate_proj.1.weight": (width, rank),
                           "phase_gate_proj.1.bias": (width,)})
    return shapes


def _mixer_shapes(config: dict, sizes: dict) -> dict[str, tuple]:
    hidden, kind = config["hidden_size"], config["model_type"]
    heads, kv_heads, v_heads = sizes["heads"], sizes["kv_heads"], sizes["v_heads"]
    key_dim, kv_key_dim = heads * sizes["head_k"], kv_heads * sizes["head_k"]
    value_dim = v_heads * sizes["head_v"]
    if kind == "gla":
        shapes = {"q_proj.weight": (key_dim, hidden), "k_proj.weight": (kv_key_dim, hidden),
                  "v_proj.weight": (value_dim, hidden), "gk_proj.0.weight": (16, hidden),
                  "gk_proj.1.weight": (kv_key_dim, 16), "gk_proj.1.bias": (kv_key_dim,),
                  "o_proj.weight": (hidden, heads * sizes["head_v"])}
        if config["use_output_gate"]:
            shapes["g_proj.weight"] = (heads * sizes["head_v"], hidden)
        fused = config["use_output_gate"] and config["fuse_norm"] and config["hidden_act"] == "swish"
        shapes[("g_norm_swish_gate" if fused else "g_norm") + ".weight"] = (sizes["head_v"],)
        widths = (key_dim, kv_key_dim, value_dim)
    elif kind == "gated_deltanet":
        shapes = {"q_proj.weight": (key_dim, hidden), "k_proj.weight": (key_dim, hidden),
                  "v_proj.weight": (value_dim, hidden), "a_proj.weight": (v_heads, hidden),
                  "b_proj.weight": (v_heads, hidden), "A_log": (v_heads,), "dt_bias": (v_heads,),
                  "o_norm.weight": (sizes["head_v"],), "o_proj.weight": (hidden, value_dim)}
        if config["use_gate"]:
            shapes["g_proj.weight"] = (value_dim, hidden)
        widths = (key_dim, key_dim, value_dim)
    else:
        shapes = {"q_proj.weight": (hidden, hidden), "k_proj.weight": (kv_key_dim, hidden),
                  "v_proj.weight": (kv_key_dim, hidden), "o_proj.weight": (hidden, hidden)}
        if config["qkv_bias"]:
            shapes.update({"q_proj.bias": (hidden,), "k_proj.bias": (kv_key_dim,), "v_proj.bias": (kv_key_dim,)})
        if config["qk_norm"]:
            shapes.update({"q_norm.weight": (sizes["head_k"],), "k_norm.weight": (sizes["head_k"],)})
        widths = ()
    if config.get("use_short_conv") and widths:
        for name, width in zip(("q_conv1d", "k_conv1d", "v_conv1d"), widths):
            shapes[f"{name}.weight"] = (width, 1, config["conv_size"])
    return shapes


def official_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with the official names and shapes, of sizes that make every part matter."""
    generator = torch.Generator().manual_seed(seed)
    sizes = _heads(config)
    hidden, width = config["hidden_size"], config["intermediate_size"]

    def draw(name: str, shape: tuple) -> torch.Tensor:
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight") or name.endswith("norm_swish_gate.weight") or name.endswith("scalar"):
            return 1 + 0.2 * noise
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1, 16, generator=generator).log()
        if name.endswith("dt_bias") or name.endswith("phi_bias") or name.endswith("bias"):
            return 0.3 * noise
        if name.endswith("temperature"):
            return rotary_temperature(config["position_embedding"], sizes["head_k"])
        if "phi_conv1d" in name:
            return 0.5 * noise
        return 0.3 * noise

    shapes = {"model.embeddings.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({prefix + "attn_norm.weight": (hidden,), prefix + "mlp_norm.weight": (hidden,),
                       prefix + "mlp.gate_proj.weight": (width, hidden), prefix + "mlp.up_proj.weight": (width, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, width)})
        shapes.update({prefix + "attn." + name: shape for name, shape in _mixer_shapes(config, sizes).items()})
        if config["position_embedding"].get("type") == "selective_rope":
            rotary = {**_rotary_shapes(config, sizes), "temperature": (1, 1, 1, sizes["head_k"] // 2)}
            shapes.update({prefix + "attn.rotary." + name: shape for name, shape in rotary.items()})
    return {name: draw(name, shape).contiguous() for name, shape in shapes.items()}


def write_official_checkpoint(directory: Path, config: dict, seed: int = 0, license: str | None = "mit") -> dict:
    """``config.json`` and ``model.safetensors`` as the official code saves them; returns the tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = official_tensors(config, seed)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if license is not None:
        (directory / "README.md").write_text(f"---\nlicense: {license}\n---\n\n# A tiny official checkpoint\n")
    return tensors


# -- the models, token by token ----------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2_norm``."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """``x`` ``(H, 2R)`` rotated in GPT-NeoX halves by ``angle`` ``(H or 1, R)``."""
    half = angle.shape[-1]
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


def causal_conv(signal: torch.Tensor, weight: torch.Tensor, t: int) -> torch.Tensor:
    """Output ``t`` of the causal depthwise convolution of ``signal`` ``(T, C)`` with taps ``weight`` ``(C, 1, K)``
    (the last multiplying token ``t``; zeros before the start)."""
    taps = weight.shape[-1]
    out = torch.zeros(signal.shape[1], dtype=DOUBLE)
    for j in range(taps):
        s = t - (taps - 1) + j
        if s >= 0:
            out = out + weight[:, 0, j] * signal[s]
    return out


class OfficialSelectiveRoPE:
    """The official SelectiveRoPE for one sequence, token by token (``step`` rotates token ``t``'s q and k)."""

    def __init__(self, options: dict, tensors: dict[str, torch.Tensor], heads: int):
        self.options, self.w, self.heads = options, tensors, heads
        self.half = tensors["temperature"].numel()
        self.theta = torch.zeros(heads, self.half, dtype=DOUBLE)
        self.projections: list[torch.Tensor] = []  # a_s for s < t, flattened (H·R,)

    def _project(self, u: torch.Tensor) -> torch.Tensor:
        """``u`` ``(H, D/H)`` -> ``a`` ``(H, R)``."""
        w = self.w
        if self.options.get("phi_parametrization", "low-rank") == "low-rank":
            return (w["phi_proj.1.weight"] @ (w["phi_proj.0.weight"] @ u.reshape(-1))).view(self.heads, self.half)
        a = torch.zeros(self.heads, self.half, dtype=DOUBLE)
        for h in range(self.heads):
            for o in range(self.half):
                column = w["phi_proj.weight"][h, :, o]
                a[h, o] = w["phi_proj.scalar"][h] * (column @ u[h]) / column.norm()
        return a

    def step(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, t: int):
        o, w = self.options, self.w
        u = l2_norm(x.view(self.heads, -1))
        a = self._project(u)
        self.projections.append(a.reshape(-1))
        if o.get("skip_conv", False):
            c = a - (self.projections[-2].view_as(a) if t > 0 else 0)
        else:
            c = causal_conv(torch.stack(self.projections), w["phi_conv1d.weight"], t).view_as(a)
            if o.get("conv_act") is not None:
                c = c * torch.sigmoid(c)
        if o.get("use_bias", False):
            c = c + w["phi_bias"][0, 0].exp()
        if o.get("use_gate", False):
            flat = u.reshape(-1)
            if o.get("gate_parametrization", "standard") == "standard":
                logits = w["phase_gate_proj.weight"] @ flat + w["phase_gate_proj.bias"]
            else:
                logits = w["phase_gate_proj.1.weight"] @ (w["phase_gate_proj.0.weight"] @ flat)
                logits = logits + w["phase_gate_proj.1.bias"]
            c = c * torch.sigmoid(logits).view(self.heads, -1)
        self.theta = self.theta + c
        angle = w["temperature"].reshape(1, -1) * self.theta
        return rotate(q, angle), rotate(k, angle)


class FixedRoPE:
    """flash-linear-attention's RotaryEmbedding (GPT-NeoX halves), as the official ``rope`` layers use it."""

    def __init__(self, theta: float, head_dim: int):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def step(self, x, q, k, t):
        angle = (t * self.inv_freq.double()).view(1, -1)
        return rotate(q, angle), rotate(k, angle)


class NoRotation:
    def step(self, x, q, k, t):
        return q, k


def _rotary(config: dict, tensors: dict, prefix: str, sizes: dict):
    options = config["position_embedding"]
    kind = options.get("type") or "nope"
    if kind == "selective_rope":
        own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
        return OfficialSelectiveRoPE(options, own, sizes["heads"])
    if kind == "rope":
        return FixedRoPE(options.get("theta", 500000), sizes["head_k"])
    return NoRotation()


def _short_convs(config, w, x):
    """q, k, v for every token ``(T, width)``: SiLU of the causal convolutions of the projections, or of the
    projections themselves (Gated DeltaNet without convolutions) / the projections (GLA without them)."""
    q, k, v = (x @ w[f"{name}_proj.weight"].T for name in "qkv")
    if not config.get("use_short_conv"):
        return (F.silu(q), F.silu(k), F.silu(v)) if config["model_type"] == "gated_deltanet" else (q, k, v)
    outputs = []
    for name, signal in zip("qkv", (q, k, v)):
        weight = w[f"{name}_conv1d.weight"]
        outputs.append(F.silu(torch.stack([causal_conv(signal, weight, t) for t in range(len(signal))])))
    return tuple(outputs)


def gla_mixer(config, w, rotary, x, sizes):
    steps, hidden = x.shape
    heads, kv_heads, head_k, head_v = sizes["heads"], sizes["kv_heads"], sizes["head_k"], sizes["head_v"]
    groups = heads // kv_heads
    q, k, v = _short_convs(config, w, x)
    gk = F.logsigmoid(x @ w["gk_proj.0.weight"].T @ w["gk_proj.1.weight"].T + w["gk_proj.1.bias"])
    gk = gk / config["gate_logit_normalizer"]
    if config.get("clamp_min") is not None:
        gk = gk.clamp_min(config["clamp_min"])
    state = torch.zeros(heads, head_k, head_v, dtype=DOUBLE)
    norm = w.get("g_norm_swish_gate.weight", w.get("g_norm.weight"))
    out = []
    for t in range(steps):
        q_t, k_t = rotary.step(x[t], q[t].view(heads, head_k), k[t].view(kv_heads, head_k), t)
        o = torch.zeros(heads, head_v, dtype=DOUBLE)
        for h in range(heads):
            g = h // groups
            decay = gk[t].view(kv_heads, head_k)[g].exp()
            state[h] = decay[:, None] * state[h] + torch.outer(k_t[g], v[t].view(kv_heads, head_v)[g])
            o[h] = state[h].T @ q_t[h] * head_k ** -0.5
        o = rms_norm(o, norm, config["norm_eps"]).reshape(-1)
        if config["use_output_gate"]:
            o = o * F.silu(x[t] @ w["g_proj.weight"].T)
        out.append(o @ w["o_proj.weight"].T)
    return torch.stack(out)


def gated_deltanet_mixer(config, w, rotary, x, sizes):
    steps = x.shape[0]
    heads, v_heads, head_k, head_v = sizes["heads"], sizes["v_heads"], sizes["head_k"], sizes["head_v"]
    groups = v_heads // heads
    q, k, v = _short_convs(config, w, x)
    beta = torch.sigmoid(x @ w["b_proj.weight"].T) * (2.0 if config["allow_neg_eigval"] else 1.0)
    g = -w["A_log"].exp() * F.softplus(x @ w["a_proj.weight"].T + w["dt_bias"])
    state = torch.zeros(v_heads, head_k, head_v, dtype=DOUBLE)
    out = []
    for t in range(steps):
        q_t, k_t = rotary.step(x[t], q[t].view(heads, head_k), k[t].view(heads, head_k), t)
        q_t, k_t = l2_norm(q_t), l2_norm(k_t)  # inside fla's kernel (use_qk_l2norm_in_kernel), after the rotation
        o = torch.zeros(v_heads, head_v, dtype=DOUBLE)
        for j in range(v_heads):
            h = j // groups
            state[j] = state[j] * g[t, j].exp()
            delta = beta[t, j] * (v[t].view(v_heads, head_v)[j] - state[j].T @ k_t[h])
            state[j] = state[j] + torch.outer(k_t[h], delta)
            o[j] = state[j].T @ (q_t[h] * head_k ** -0.5)
        o = rms_norm(o, w["o_norm.weight"], config["norm_eps"])
        if config["use_gate"]:
            o = o * F.silu((x[t] @ w["g_proj.weight"].T).view(v_heads, head_v))
        out.append(o.reshape(-1) @ w["o_proj.weight"].T)
    return torch.stack(out)


def attention_mixer(config, w, rotary, x, sizes):
    steps = x.shape[0]
    heads, kv_heads, head_dim = sizes["heads"], sizes["kv_heads"], sizes["head_k"]
    groups = heads // kv_heads

    def project(name):
        y = x @ w[f"{name}_proj.weight"].T
        return y + w[f"{name}_proj.bias"] if f"{name}_proj.bias" in w else y

    q = project("q").view(steps, heads, head_dim)
    k = project("k").view(steps, kv_heads, head_dim)
    v = project("v").view(steps, kv_heads, head_dim)
    if config["qk_norm"]:  # before the rotation (RoPE / NoPE sources; fla's RMSNorm default eps)
        q, k = rms_norm(q, w["q_norm.weight"], 1e-5), rms_norm(k, w["k_norm.weight"], 1e-5)
    rotated = [rotary.step(x[t], q[t], k[t], t) for t in range(steps)]
    q, k = torch.stack([r[0] for r in rotated]), torch.stack([r[1] for r in rotated])
    out = []
    for t in range(steps):
        o = torch.zeros(heads, head_dim, dtype=DOUBLE)
        for h in range(heads):
            g = h // groups
            scores = torch.stack([q[t, h] @ k[s, g] for s in range(t + 1)]) / math.sqrt(head_dim)
            o[h] = torch.softmax(scores, 0) @ v[: t + 1, g]
        out.append(o.reshape(-1) @ w["o_proj.weight"].T)
    return torch.stack(out)


MIXERS = {"gla": gla_mixer, "gated_deltanet": gated_deltanet_mixer, "transformer": attention_mixer}


@torch.no_grad()
def official_logits(config: dict, tensors: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(T, vocab)`` (float64) of one sequence ``ids`` ``(T,)``."""
    w = {name: t.double() for name, t in tensors.items()}
    sizes = _heads(config)
    eps = config["norm_eps"]
    x = w["model.embeddings.weight"][ids]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        mixer_weights = {name[len(prefix) + 5:]: t for name, t in w.items() if name.startswith(prefix + "attn.")}
        rotary = _rotary(config, w, prefix + "attn.rotary.", sizes)
        normed = rms_norm(x, w[prefix + "attn_norm.weight"], eps)
        x = x + MIXERS[config["model_type"]](config, mixer_weights, rotary, normed, sizes)
        normed = rms_norm(x, w[prefix + "mlp_norm.weight"], eps)
        mlp = F.silu(normed @ w[prefix + "mlp.gate_proj.weight"].T) * (normed @ w[prefix + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[prefix + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embeddings.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
