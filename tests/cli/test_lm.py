"""The language-modelling evidence (examples/lm/): the split by file, the tokenizer trained on training files only,
the held-out perplexity against a direct per-window computation, one tiny run end to end and its summary. Everything
runs on a small corpus written to a temporary folder (nothing is downloaded; the real corpus is the stdlib)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

LM = Path(__file__).resolve().parents[2] / "examples" / "lm"
sys.path.insert(0, str(LM))

import summarize_lm as lm_summarize  # noqa: E402
import train_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MARKER = "zqxvjkwzqxvjkw"  # a word written only into held-out files


def make_corpus(root: Path, files: int = 40) -> list[Path]:
    """A fake stdlib: ``files`` modules in packages, plus a test suite and site-packages that must be left out."""
    paths = []
    for index in range(files):
        path = root / f"pkg{index % 3}" / f"module_{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        held_out = train_lm.is_held_out(path.relative_to(root).as_posix(), 0.25)
        word = MARKER if held_out else "commonword"
        path.write_text("".join(f"def {word}_{i}(x):\n    return x + {i}  # {word}\n" for i in range(30)))
        paths.append(path)
    for excluded in ("test/test_x.py", "site-packages/pkg/mod.py", "pkg0/tests/test_y.py"):
        (root / excluded).parent.mkdir(parents=True, exist_ok=True)
        (root / excluded).write_text("EXCLUDED = 1\n")
    return sorted(paths)


def test_split_is_by_file_and_a_function_of_the_relative_path(tmp_path):
    files = make_corpus(tmp_path / "a")
    assert train_lm.stdlib_files(tmp_path / "a") == files  # the test suites and site-packages are left out
    train, held_out = train_lm.split_by_file(files, tmp_path / "a", 0.25)
    assert sorted(train + held_out) == files and not set(train) & set(held_out) and held_out
    # the same relative paths under another root split the same way
    other = make_corpus(tmp_path / "b")
    train_b, held_out_b = train_lm.split_by_file(other, tmp_path / "b", 0.25)
    relative = [[p.relative_to(root).as_posix() for p in side]
                for side, root in ((held_out, tmp_path / "a"), (held_out_b, tmp_path / "b"))]
    assert relative[0] == relative[1]
    with pytest.raises(ValueError, match="held_out_fraction"):
        train_lm.is_held_out("x.py", 1.0)


def test_prepare_trains_the_tokenizer_on_training_files_only_and_encodes_losslessly(tmp_path):
    from tokenizers import Tokenizer

    root = tmp_path / "stdlib"
    files = make_corpus(root)
    summary = train_lm.prepare(tmp_path / "cache", vocab_size=300, held_out_fraction=0.25, root=root)
    train, held_out = train_lm.split_by_file(files, root, 0.25)
    assert (summary["train_files"], summary["held_out_files"]) == (len(train), len(held_out))
    assert summary["held_out_file_list"] == [p.relative_to(root).as_posix() for p in held_out]
    tokenizer = Tokenizer.from_file(str(tmp_path / "cache" / "tokenizer.json"))
    # the held-out word never merged (it was never seen), while the training words did
    assert not any("zqx" in token for token in tokenizer.get_vocab())
    assert any("commonword" in token for token in tokenizer.get_vocab())
    tokens = torch.load(tmp_path / "cache" / "tokens.pt")
    eos = tokenizer.token_to_id(train_lm.EOS)
    for ids, side in ((tokens["held_out"], held_out), (tokens["train"], train)):
        assert ids.numel() == summary["held_out_tokens" if side is held_out else "train_tokens"]
        texts = tokenizer.decode(ids.tolist(), skip_special_tokens=False).split(train_lm.EOS)
        assert texts[:-1] == [p.read_text() for p in side] and texts[-1] == ""
        assert (ids == eos).sum() == len(side)


def tiny_model(vocab_size: int = 50, family: str = "gla", variant: str = "selective"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = train_lm.build_config(family, variant, vocab_size, hidden=16, layers=1, heads=2)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", train_lm.FAMILIES)
def test_perplexity_is_the_direct_per_window_computation(family):
    """Against a loop over windows, one token at a time from log-softmax: exp(mean NLL), and the positions at or
    past the training length (predicting token t + 1 with t + 1 >= train_length tokens of context)."""
    model = tiny_model(family=family)
    ids = torch.randint(0, 50, (200,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    length, count, train_length = 12, 5, 4
    result = train_lm.perplexity(model, ids, length, count, train_length, chunk=2)

    nll, beyond = [], []
    for w in range(count):
        window = ids[w * length: (w + 1) * length].long()
        log_probs = torch.log_softmax(model(window[None]).logits[0].double(), dim=-1)  # (length, V)
        for t in range(length - 1):
            value = -log_probs[t, window[t + 1]].item()
            nll.append(value)
            if t + 1 >= train_length:
                beyond.append(value)
    assert result["predicted_tokens"] == count * (length - 1) == len(nll)
    assert result["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert result["beyond_train_length"]["predicted_tokens"] == len(beyond)
    assert result["beyond_train_length"]["perplexity"] == pytest.approx(math.exp(sum(beyond) / len(beyond)), rel=1e-5)
    assert "beyond_train_length" not in train_lm.perplexity(model, ids, 4, 3, train_length)
    with pytest.raises(ValueError, match="need 240 tokens"):
        train_lm.perplexity(model, ids[:100], length, 20, train_length)


def test_variants_set_the_position_embedding():
    for variant, fields in train_lm.VARIANTS.items():
        config = train_lm.build_config("gated_deltanet", variant, 50, hidden=16, layers=1, heads=2)
        assert {key: getattr(config, key) for key in fields} == fields
    with pytest.raises(ValueError, match="unknown variant"):
        train_lm.build_config("gla", "alibi", 50, 16, 1, 2)
    with pytest.raises(ValueError, match="unknown family"):
        train_lm.build_config("mamba", "nope", 50, 16, 1, 2)


def test_tiny_run_end_to_end_and_its_summary(tmp_path):
    root = tmp_path / "stdlib"
    make_corpus(root)
    cache = tmp_path / "cache"
    train_lm.prepare(cache, vocab_size=300, held_out_fraction=0.25, root=root)
    results = tmp_path / "results"
    for variant in ("nope", "selective"):
        for seed in (0, 1):
            assert train_lm.main(["--cache", str(cache), "train", "--family", "gla", "--variant", variant,
                                  "--seed", str(seed), "--hidden", "16", "--layers", "1", "--heads", "2",
                                  "--length", "8", "--batch", "2", "--steps", "2", "--eval-windows", "3",
                                  "--output", str(results / "gla" / f"{variant}_seed{seed}.json")]) == 0
    result = json.loads((results / "gla" / "nope_seed1.json").read_text())
    assert [row["length"] for row in result["eval"]] == [8, 16, 32]
    assert [row["windows"] for row in result["eval"]] == [12, 6, 3]  # the same held-out tokens at every length
    assert result["settings"]["steps"] == 2 and result["model_config"]["position_embedding"] == "nope"
    rows = lm_summarize.summarize(lm_summarize.load(results))
    assert [(row["variant"], row["seeds"]) for row in rows] == [("nope", [0, 1]), ("selective", [0, 1])]
    ppl = [run["eval"][2]["perplexity"] for run in lm_summarize.load(results)["gla"]["selective"]]
    assert rows[1]["perplexity"][32][0] == pytest.approx(sum(ppl) / 2)
    nope = [run["eval"][0]["perplexity"] for run in lm_summarize.load(results)["gla"]["nope"]]
    selective = [run["eval"][0]["perplexity"] for run in lm_summarize.load(results)["gla"]["selective"]]
    assert rows[1]["paired_vs_nope"][8][0] == pytest.approx((selective[0] - nope[0] + selective[1] - nope[1]) / 2)
    assert "Selective RoPE" in lm_summarize.table(rows)
    doc = tmp_path / "lm.md"
    doc.write_text("intro\n<!-- results:lm:start -->\nold\n<!-- results:lm:end -->\nafter\n")
    assert lm_summarize.main(["--results", str(results), "--doc", str(doc), "--no-plot",
                              "--summary", str(tmp_path / "summary.json")]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- results:lm:start -->\n| model |") and text.endswith("-->\nafter\n")
    assert "old" not in text and (tmp_path / "summary.json").exists()
    with pytest.raises(FileNotFoundError, match="prepare"):
        train_lm.run("gla", "nope", 0, cache=tmp_path / "missing")
