"""The Selective RoPE module against a deliberately simple per-token reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from selective_rope import SelectiveRopeGLAConfig
from selective_rope.modeling.rotary import PhaseDifference, SelectiveRotaryEmbedding, rotary_temperature

from rotary_reference import HEADS, HIDDEN, OPTION_GRID, ROTATING_GRID, make_rotary, rotate_exactly


@torch.no_grad()
def reference(module, x, q, k, phase0=None, history0=None):
    """Token by token, head by head, pair by pair, in float64, straight from SPEC §3."""
    batch, seq_len, hidden = x.shape
    hk, half, hq = module.num_key_heads, module.rotary_pairs, q.shape[2]
    chunk = hidden // hk
    tau = module.temperature.detach().double()
    q_out, k_out = q.clone(), k.clone()
    phases = torch.zeros(batch, hk, half, dtype=torch.float64)
    for b in range(batch):
        phase = torch.zeros(hk, half, dtype=torch.float64) if phase0 is None else phase0[b].clone()
        conv = module.phase_conv if module.position_embedding == "selective_rope" else None
        if isinstance(conv, PhaseDifference):  # the fixed first difference a_t - a_{t-1}
            ksize, taps = 2, torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(hk, half, 1)
        elif conv is not None:
            ksize, taps = conv.weight.shape[-1], conv.weight.view(hk, half, -1)
        else:
            ksize = 1
        history = [] if history0 is None else [history0[b, j].view(hk, half) for j in range(ksize - 1)]
        history = [torch.zeros(hk, half, dtype=torch.float64)] * (ksize - 1 - len(history)) + history
        for t in range(seq_len):
            if module.position_embedding == "rope":
                c = torch.ones(hk, half, dtype=torch.float64)
            else:
                u = [x[b, t, h * chunk:(h + 1) * chunk] / x[b, t, h * chunk:(h + 1) * chunk].norm() for h in range(hk)]
                a = torch.zeros(hk, half, dtype=torch.float64)
                proj = module.phase_proj
                for h in range(hk):
                    if proj.kind == "low_rank":
                        a[h] = proj.up[h] @ (proj.down[h] @ u[h])
                    elif proj.kind == "full_rank":
                        for i in range(half):
                            a[h, i] = proj.scale[h, i] * (proj.weight[h, i] @ u[h]) / proj.weight[h, i].norm()
                    elif proj.kind == "dense_low_rank":  # one map from every chunk to every head
                        a[h] = (proj.up @ (proj.down @ torch.cat(u))).view(hk, half)[h]
                    else:
                        a[h] = proj.weight[h, 0] @ u[h]
                if conv is not None:
                    window = history[len(history) - (ksize - 1):] + [a] if ksize > 1 else [a]
                    c = sum(taps[..., j] * window[j] for j in range(ksize))
                    if conv.activation == "silu":
                        c = c * torch.sigmoid(c)
                    history.append(a)
                else:
                    c = a
                if module.phase_bias is not None:
                    c = c + module.phase_bias.exp()
                gate = module.phase_gate_proj
                if gate is not None:
                    flat = torch.cat(u)
                    if isinstance(gate, torch.nn.Linear):
                        g = (gate.weight @ flat + gate.bias).view(hk, 1)
                    else:
                        g = (gate[1].weight @ (gate[0].weight @ flat) + gate[1].bias).view(hk, -1)
                    c = c * torch.sigmoid(g)
            phase = phase + c
            for head in range(hq):
                angle = tau * phase[head // (hq // hk)]
                for i in range(half):
                    x1, x2 = q[b, t, head, i], q[b, t, head, i + half]
                    q_out[b, t, head, i] = x1 * math.cos(angle[i]) - x2 * math.sin(angle[i])
                    q_out[b, t, head, i + half] = x1 * math.sin(angle[i]) + x2 * math.cos(angle[i])
            for head in range(hk):
                angle = tau * phase[head]
                for i in range(half):
                    x1, x2 = k[b, t, head, i], k[b, t, head, i + half]
                    k_out[b, t, head, i] = x1 * math.cos(angle[i]) - x2 * math.sin(angle[i])
                    k_out[b, t, head, i + half] = x1 * math.sin(angle[i]) + x2 * math.cos(angle[i])
        phases[b] = phase
    return q_out, k_out, phases




@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("options", OPTION_GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_module_matches_per_token_reference(options, heads):
    module = make_rotary(*heads, **options)
    x = torch.randn(2, 7, HIDDEN, dtype=torch.float64)
    q = torch.randn(2, 7, heads[0], 8, dtype=torch.float64)
    k = torch.randn(2, 7, heads[1], 8, dtype=torch.float64)
    q_rot, k_rot, state = module(x, q, k)
    q_ref, k_ref, phase_ref = reference(module, x, q, k)
    torch.testing.assert_close(q_rot, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["phase"].double(), phase_ref, atol=1e-5, rtol=1e-5)
    assert state["phase"].dtype == torch.float64


@pytest.mark.parametrize("options", [dict(), dict(phase_conv_size=3, phase_conv_activation="silu", phase_bias=True),
                                     dict(position_embedding="rope"), dict(phase_gate_type="channel"),
                                     dict(phase_conv_type="difference", phase_proj="dense_low_rank", phase_bias=True)])
def test_state_continues_across_calls(options):
    """Two calls with the state in between equal one call; a random initial phase is honoured."""
    module = make_rotary(**options)
    x, q, k = torch.randn(2, 9, HIDDEN).double(), torch.randn(2, 9, 4, 8).double(), torch.randn(2, 9, 2, 8).double()
    q_full, k_full, state_full = module(x, q, k)
    q1, k1, state = module(x[:, :4], q[:, :4], k[:, :4])
    q2, k2, state = module(x[:, 4:5], q[:, 4:5], k[:, 4:5], state=state)  # a decode step
    q3, k3, state = module(x[:, 5:], q[:, 5:], k[:, 5:], state=state)
    torch.testing.assert_close(torch.cat([q1, q2, q3], 1), q_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([k1, k2, k3], 1), k_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["phase"], state_full["phase"])

    phase0 = torch.randn(2, 2, module.rotary_pairs, dtype=torch.float32) * 10
    history = 1 if options.get("phase_conv_type") == "difference" else max(options.get("phase_conv_size", 4) - 1, 0)
    history0 = torch.randn(2, history, 2 * module.rotary_pairs)
    state0 = {"phase": phase0, "phase_conv": history0}
    q_off, k_off, _ = module(x, q, k, state=state0)
    q_ref, k_ref, _ = reference(module, x, q, k, phase0.double(), history0.double())
    torch.testing.assert_close(q_off, q_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_off, k_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(phase_conv_size=3), dict(phase_conv_type="difference")])
def test_padding_neither_advances_phase_nor_enters_history(options):
    """Right-padded rows (`lengths`) give each row its unpadded result and a final state taken at its real end."""
    module = make_rotary(phase_bias=True, **options)
    x, q, k = torch.randn(2, 6, HIDDEN).double(), torch.randn(2, 6, 4, 8).double(), torch.randn(2, 6, 2, 8).double()
    lengths = torch.tensor([6, 2])
    q_pad, k_pad, state = module(x, q, k, lengths=lengths)
    q_short, k_short, state_short = module(x[1:, :2], q[1:, :2], k[1:, :2])
    tol = dict(atol=1e-5, rtol=1e-5)  # the increments are float32 whatever the input dtype
    torch.testing.assert_close(q_pad[1, :2], q_short[0], **tol)
    torch.testing.assert_close(k_pad[1, :2], k_short[0], **tol)
    torch.testing.assert_close(state["phase"][1], state_short["phase"][0], **tol)
    torch.testing.assert_close(state["phase_conv"][1], state_short["phase_conv"][0], **tol)


@pytest.mark.parametrize("options", [dict(phase_conv_size=4), dict(phase_conv_type="difference")])
def test_packed_sequences_restart_phase_and_convolution(options):
    module = make_rotary(phase_conv_activation="silu", **options)
    lengths = [3, 1, 5]
    xs = [torch.randn(1, n, HIDDEN).double() for n in lengths]
    qs = [torch.randn(1, n, 4, 8).double() for n in lengths]
    ks = [torch.randn(1, n, 2, 8).double() for n in lengths]
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q_packed, k_packed, state = module(torch.cat(xs, 1), torch.cat(qs, 1), torch.cat(ks, 1), cu_seqlens=cu_seqlens)
    for i, (x, q, k) in enumerate(zip(xs, qs, ks)):
        q_alone, k_alone, state_alone = module(x, q, k)
        span = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
        torch.testing.assert_close(q_packed[:, span], q_alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_packed[:, span], k_alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state["phase"][i], state_alone["phase"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state["phase_conv"][i], state_alone["phase_conv"][0], atol=1e-5, rtol=1e-5)


def test_identities_at_module_level():
    """Zeroed projection + bias exp(0) and no gate = RoPE; zeroed projection, no bias = NoPE."""
    x, q, k = torch.randn(2, 5, HIDDEN).double(), torch.randn(2, 5, 4, 8).double(), torch.randn(2, 5, 2, 8).double()
    selective = make_rotary(phase_gate=False, phase_bias=True)
    with torch.no_grad():
        selective.phase_proj.up.zero_()
        selective.phase_bias.zero_()
    rope = make_rotary(position_embedding="rope")
    for got, want in zip(selective(x, q, k)[:2], rope(x, q, k)[:2]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    nope_like = make_rotary(phase_bias=False, phase_gate_type="channel")
    with torch.no_grad():
        nope_like.phase_proj.up.zero_()
    q_rot, k_rot, _ = nope_like(x, q, k)
    torch.testing.assert_close(q_rot, q, atol=0, rtol=0)
    torch.testing.assert_close(k_rot, k, atol=0, rtol=0)


@pytest.mark.parametrize("projection", ["low_rank", "dense_low_rank", "full_rank"])
def test_difference_phase_is_the_projection_across_calls(projection):
    """``phase_conv_type="difference"`` without gate or bias: ``θ_t = P(u_t)`` at every token, whether the tokens come
    in one call or in a prefill, single-token steps and a multi-token call continuing the cache (the official cache
    restarts the difference at each call, which would give ``θ_{t-1} + P(u_t)`` after a break). Its history is the
    previous projection and it has no trainable taps."""
    module = make_rotary(phase_conv_type="difference", phase_gate=False, phase_proj=projection)
    assert not list(module.phase_conv.parameters())
    x = torch.randn(2, 11, HIDDEN, dtype=torch.float64)
    q, k = torch.randn(2, 11, 4, 8, dtype=torch.float64), torch.randn(2, 11, 2, 8, dtype=torch.float64)
    u = torch.nn.functional.normalize(x.view(2, 11, 2, HIDDEN // 2), dim=-1)
    projections = module.phase_proj(u)  # (B, T, Hk, R): what the phase must equal
    state, phases = None, []
    for span in (slice(0, 4), slice(4, 5), slice(5, 6), slice(6, 11)):
        _, _, state = module(x[:, span], q[:, span], k[:, span], state=state)
        phases.append(state["phase"])
        torch.testing.assert_close(state["phase_conv"], projections[:, span.stop - 1].reshape(2, 1, -1), rtol=1e-12,
                                   atol=1e-12)
    for phase, stop in zip(phases, (4, 5, 6, 11)):
        torch.testing.assert_close(phase, projections[:, stop - 1], rtol=1e-6, atol=1e-6)
    # ...and per token, through the rotation: k_t is rotated by τ · P(u_t).
    _, k_rot, _ = module(x, q, k)
    angle = projections * module.temperature.double()
    k1, k2 = k[..., :4], k[..., 4:]
    expected = torch.cat([k1 * angle.cos() - k2 * angle.sin(), k1 * angle.sin() + k2 * angle.cos()], -1)
    torch.testing.assert_close(k_rot, expected, rtol=1e-5, atol=1e-5)


def test_swish_is_silu_and_the_gate_rank_is_the_field():
    swish = make_rotary(phase_conv_activation="swish", phase_gate_type="low_rank", phase_gate_rank=5)
    silu = make_rotary(phase_conv_activation="silu", phase_gate_type="low_rank", phase_gate_rank=5)
    silu.load_state_dict(swish.state_dict())
    assert swish.phase_gate_proj[0].weight.shape == (5, HIDDEN)
    x, q, k = torch.randn(2, 6, HIDDEN).double(), torch.randn(2, 6, 4, 8).double(), torch.randn(2, 6, 2, 8).double()
    for got, want in zip(swish(x, q, k)[:2], silu(x, q, k)[:2]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    linear = make_rotary(phase_conv_activation=None)
    linear.load_state_dict(swish.state_dict(), strict=False)
    assert not torch.allclose(linear(x, q, k)[0], swish(x, q, k)[0])  # the activation is applied


@pytest.mark.parametrize("position_embedding", ["selective_rope", "rope"])
@pytest.mark.parametrize("trainable", [False, True])
def test_the_temperature_is_a_parameter_only_when_trainable(position_embedding, trainable):
    """Fixed (the default), the temperature is a buffer: what turns gradients on for every parameter of a module
    (PEFT's ``modules_to_save`` copy) leaves it alone, and it gets no gradient. Trainable, it is a parameter and learns.
    It is ``temperature`` in the state dict either way, so the two load each other's weights."""
    module = make_rotary(position_embedding=position_embedding, temperature_trainable=trainable)
    assert ("temperature" in dict(module.named_parameters())) is trainable
    assert "temperature" in module.state_dict()
    for param in module.parameters():  # what PEFT does to a modules_to_save copy
        param.requires_grad_(True)
    torch.manual_seed(0)
    x = torch.randn(2, 9, HIDDEN)
    q, k = torch.randn(2, 9, 4, 8, requires_grad=True), torch.randn(2, 9, 2, 8)
    q_rot, k_rot, _ = module(x, q, k, backend="torch")
    (q_rot.square().sum() + k_rot.sum()).backward()
    assert (module.temperature.grad is not None) is trainable
    if trainable:
        assert module.temperature.grad.abs().sum() > 0
    if position_embedding == "selective_rope":
        assert module.phase_proj.down.grad.abs().sum() > 0
    with torch.no_grad():  # the same rotation either way
        other = make_rotary(position_embedding=position_embedding, temperature_trainable=not trainable)
        other.load_state_dict(module.state_dict())
        torch.testing.assert_close(other(x, q, k, backend="torch")[0], q_rot, rtol=0, atol=0)


def test_casts_keep_the_module_float32():
    """``.to(torch.bfloat16)`` / ``.to(torch.float16)`` leave the module's parameters float32, bit for bit (a bf16
    temperature would move long-context angles by radians); upcasts and device moves still apply."""
    module = make_rotary(phase_bias=True, phase_gate_type="low_rank").float()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.to("cpu", torch.float16)):
        cast(module)
        for name, tensor in module.state_dict().items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name
    assert all(t.dtype == torch.float64 for t in module.double().state_dict().values())


def test_phase_math_is_float_for_bf16_inputs():
    module = make_rotary(phase_bias=True).to(torch.bfloat16)  # parameters stay float32
    x = torch.randn(1, 300, HIDDEN, dtype=torch.bfloat16)
    q, k = torch.randn(1, 300, 4, 8, dtype=torch.bfloat16), torch.randn(1, 300, 2, 8, dtype=torch.bfloat16)
    q_rot, k_rot, state = module(x, q, k)
    assert q_rot.dtype == k_rot.dtype == torch.bfloat16 and state["phase"].dtype == torch.float64
    # A bf16 running sum would stall near 256 with ~1-sized steps; ours matches a float64 sum.
    ref = make_rotary(phase_bias=True).double()
    ref.load_state_dict({n: p.double() for n, p in module.state_dict().items()})
    _, _, state_ref = ref(x.double(), q.double(), k.double())
    torch.testing.assert_close(state["phase"], state_ref["phase"], atol=1e-3, rtol=1e-5)


def test_temperature_schedules():
    rope = rotary_temperature("rope", 10000.0, 8)
    torch.testing.assert_close(rope, 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))
    rfa = rotary_temperature("rfa", 0.5, 8, scale=2.0)
    x = torch.linspace(0, 0.5 * math.pi, 4, dtype=torch.float64)
    torch.testing.assert_close(rfa, (2.0 * torch.tan(x / 2) / math.tan(0.5 * math.pi / 2)).float())
    assert rfa[0] == 0 and torch.isclose(rfa[-1], torch.tensor(2.0))
    for kind in ("gaussian", "laplace", "uniform"):
        a, b = rotary_temperature(kind, 0.5, 64, seed=1), rotary_temperature(kind, 0.5, 64, seed=1)
        assert torch.equal(a, b) and not torch.equal(a, rotary_temperature(kind, 0.5, 64, seed=2))
    assert rotary_temperature("uniform", 0.5, 256).abs().max() <= 0.5


def test_phase_convolution_starts_as_identity_and_keeps_trained_taps(family, tmp_path):
    """A fresh model's phase increments equal the projection's output (the convolution starts as the identity, not
    at N(0, initializer_range) taps that would shrink them); trained taps survive save / from_pretrained."""
    import torch.nn.functional as F

    model = family.lm_class(family.config_class(**{**family.tiny, "phase_conv_size": 3, "phase_gate": False}))
    rotary = model.model.layers[0].attn.rotary
    x = torch.randn(2, 7, family.tiny["hidden_size"])
    increment, _ = rotary.phase_increment(x, None, None, None)
    u = F.normalize(x.double().view(2, 7, rotary.num_key_heads, rotary.chunk_dim), dim=-1)
    assert torch.equal(increment, rotary.phase_proj(u).float())  # computed in float64, rounded once

    with torch.no_grad():
        rotary.phase_conv.weight.normal_()
    model.save_pretrained(tmp_path)
    loaded = family.lm_class.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[0].attn.rotary.phase_conv.weight, rotary.phase_conv.weight)


# -- precision over long contexts (issue 19) ---------------------------------------------------------------------------

def trained_looking_rotary(**options) -> SelectiveRotaryEmbedding:
    """float32, with increments of order 1 that drift upwards as trained ones do: a phase bias around exp(0) = 1, an
    open gate, convolution taps that mix neighbours."""
    config = SelectiveRopeGLAConfig(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, expand_k=2.0, phase_bias=True,
                                    temperature_theta=10000.0, **options)
    module = SelectiveRotaryEmbedding(config, 4, 2, 8)
    with torch.no_grad():
        module.phase_bias.normal_(std=0.3)
        module.phase_conv.weight.add_(0.2 * torch.randn_like(module.phase_conv.weight))
        for name, param in module.phase_gate_proj.named_parameters():
            param.copy_(torch.full_like(param, 1.0) if name.endswith("bias") else 0.3 * torch.randn_like(param))
    return module


@torch.no_grad()
def test_long_decoding_matches_prefill_and_exact_angles(decode_step):
    """8k decoding steps (θ grows past 4000): the cached phase equals the prefill's, q and k equal the prefill's,
    and both equal a rotation by exact float64 angles. With a float32 running phase the decoded angles drifted by
    ~1e-3 rad at 8k (and the prefill's by ~5e-4 from the exact ones)."""
    module = trained_looking_rotary(phase_conv_activation="silu")
    seq_len = 8192
    x = torch.randn(1, seq_len, HIDDEN)
    q, k = torch.randn(1, seq_len, 4, 8), torch.randn(1, seq_len, 2, 8)
    q_full, k_full, state_full = module(x, q, k)
    state, q_steps, k_steps = None, [], []
    for t in range(seq_len):
        q_t, k_t, state = module(x[:, t:t + 1], q[:, t:t + 1], k[:, t:t + 1], state=state)
        q_steps.append(q_t)
        k_steps.append(k_t)
    assert state["phase"].dtype == torch.float64 and state["phase"].min() > 4000
    torch.testing.assert_close(state["phase"], state_full["phase"], rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat(q_steps, 1), q_full, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat(k_steps, 1), k_full, rtol=0, atol=1e-5)
    if decode_step != "torch":  # one piece of C for both, run over the tokens in order: identical
        assert torch.equal(torch.cat(q_steps, 1), q_full) and torch.equal(state["phase"], state_full["phase"])

    increment, _ = module.phase_increment(x, None, None, None)  # (1, T, Hk, R) float32
    phase = increment.double().cumsum(1)
    torch.testing.assert_close(k_full.double(), rotate_exactly(k, phase, module.temperature), rtol=0, atol=1e-5)
    query_phase = phase.repeat_interleave(2, dim=2)
    torch.testing.assert_close(q_full.double(), rotate_exactly(q, query_phase, module.temperature), rtol=0, atol=1e-5)




@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("options", ROTATING_GRID,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_decode_step_equals_the_general_path(options, heads, decode_step):
    """Without autograd a single token takes a decoding step (compiled or torch; Selective RoPE and RoPE); with
    autograd on, the general path (``phase_increment`` + ``selective_rotary``). From the same cached state, both give
    the same q, k and state, for a real token and for a pad (``lengths`` 0), and for a first token without state."""
    module = make_rotary(*heads, **options)
    x, q, k = torch.randn(2, 6, HIDDEN), torch.randn(2, 6, heads[0], 8), torch.randn(2, 6, heads[1], 8)
    with torch.no_grad():
        _, _, state = module(x[:, :5], q[:, :5], k[:, :5])
    step = (x[:, 5:], q[:, 5:], k[:, 5:])
    for cached, lengths in [(state, None), (state, torch.tensor([1, 0])), (None, None)]:
        with torch.no_grad():
            q_fast, k_fast, state_fast = module(*step, state=cached, lengths=lengths)
        with torch.enable_grad():
            q_ref, k_ref, state_ref = module(*step, state=cached, lengths=lengths)
        torch.testing.assert_close(q_fast, q_ref.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(k_fast, k_ref.detach(), rtol=0, atol=1e-6)
        assert state_fast.keys() == state_ref.keys()
        for name in state_ref:
            assert state_fast[name].dtype == state_ref[name].dtype and state_fast[name].is_contiguous(), name
            torch.testing.assert_close(state_fast[name], state_ref[name].detach(), rtol=0, atol=1e-12)
        if lengths is not None:  # the pad row keeps its phase and history
            for name in state_ref:
                torch.testing.assert_close(state_fast[name][1], cached[name][1].to(state_fast[name].dtype))


def test_chunk_normalisation_keeps_less_for_the_same_values_and_gradients():
    """The phase path's L2 normalisation in training: the values of F.normalize bit for bit, the gradient of autograd
    through F.normalize within float64 rounding (chunks of ordinary norm, a zero chunk and one under the 1e-12
    clamp), and gradcheck; for the backward it keeps the result and the norms, not the input as well."""
    from selective_rope.modeling.rotary import L2NormalizeChunks

    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    x[0, 1, 2] = 0.0
    x[1, 3, 0] = 1e-14 * torch.randn(8, dtype=torch.float64)
    weights = torch.randn_like(x)
    results = []
    for normalize in (lambda t: torch.nn.functional.normalize(t, dim=-1), lambda t: L2NormalizeChunks.apply(t)[0]):
        leaf = x.clone().requires_grad_()
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t, lambda t: t):
            u = normalize(leaf)
        (grad,) = torch.autograd.grad((u * weights).sum(), leaf)
        results.append((u, grad, kept))
    (u_ref, grad_ref, kept_ref), (u, grad, kept) = results
    assert torch.equal(u, u_ref)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(grad).all() and torch.equal(grad[0, 1, 2], weights[0, 1, 2] / 1e-12)
    assert not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in kept)
    assert sum(t.numel() for t in kept) < sum(t.numel() for t in kept_ref)
    ordinary = x[1:, :2].clone().requires_grad_()  # (finite differences cannot see the clamp at a zero chunk)
    assert torch.autograd.gradcheck(lambda t: L2NormalizeChunks.apply(t)[0], (ordinary,))


def test_chunk_normalisation_backward_in_one_buffer_equals_the_differentiable_one():
    """The backward writes its result into one buffer (issue 51: fewer fresh float64 temporaries) unless a double
    backward needs its operations: both give the same gradient bit for bit."""
    from selective_rope.modeling.rotary import L2NormalizeChunks

    x = torch.randn(3, 4, 2, 8, dtype=torch.float64)
    x[0, 1, 1] = 0.0  # a chunk under the clamp
    weights = torch.randn_like(x)
    grads = []
    for create_graph in (False, True):
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad((L2NormalizeChunks.apply(leaf)[0] * weights).sum(), leaf,
                                      create_graph=create_graph)
        grads.append(grad.detach())
    assert torch.equal(grads[0], grads[1])


def test_training_forward_keeps_no_float64_copy_of_the_input():
    """In training, what the phase path keeps for its backward holds no float64 copy of the whole input (it keeps
    the normalised chunks, which the projection and the gate read): the largest saved tensor is one (B, T, D)."""
    module = make_rotary(dtype=torch.float32)
    x = torch.randn(2, 7, HIDDEN, requires_grad=True)
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        module.phase_increment(x, None, None, None)
    full = [t for t in storages.values() if t.dtype == torch.float64 and t.numel() == x.numel()]
    assert len(full) == 1, [tuple(t.shape) for t in full]


def test_chunk_normalisation_second_derivative_equals_autograd_through_normalize():
    """A double backward through the normalisation differentiates its backward's division by the norm too (the norm
    was once marked non-differentiable, and the second derivative lost that term)."""
    from selective_rope.modeling.rotary import L2NormalizeChunks

    x = torch.randn(2, 3, 2, 8, dtype=torch.float64)
    weights = torch.randn_like(x)
    results = []
    for normalize in (lambda t: torch.nn.functional.normalize(t, dim=-1), lambda t: L2NormalizeChunks.apply(t)[0]):
        leaf = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad((normalize(leaf) * weights).pow(2).sum(), leaf, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), leaf)
        results.append((grad.detach(), second))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-10, atol=1e-10)
