"""`selective-rope generate` and `selective-rope bench`: smoke runs on tiny models and their error messages."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selective_rope import cli

from families import FAMILIES

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(57)]  # 61 = the tiny vocabulary


# Tiny tensors: intra-op threads only wait for each other on a shared 2-core machine (about 10x slower).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GLA saved twice: without a tokenizer, and with a local word-level one (no downloads)."""
    family = FAMILIES["gla"]
    torch.manual_seed(0)
    model = family.lm_class(family.config_class(**family.tiny)).eval()
    root = tmp_path_factory.mktemp("cli")
    model.save_pretrained(root / "plain")
    model.save_pretrained(root / "with_tokenizer")
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.save_pretrained(root / "with_tokenizer")
    return {"model": model, "plain": root / "plain", "tokenized": root / "with_tokenizer", "tokenizer": tokenizer}


def _greedy(model, ids, new_tokens=5):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split()]


def test_generate_prints_token_ids_without_a_tokenizer(saved, capsys):
    assert cli.main(["generate", str(saved["plain"]), "--ids", "5 6 7", "--max-new-tokens", "5"]) == 0
    assert _ints(capsys.readouterr().out) == _greedy(saved["model"], [5, 6, 7])
    assert cli.main(["generate", str(saved["plain"]), "--ids", "5,6,7", "--max-new-tokens", "5",
                     "--num-beams", "2"]) == 0  # beam search: printed at the end
    assert len(_ints(capsys.readouterr().out)) == 5
    cli.main(["generate", str(saved["plain"]), "--max-new-tokens", "3"])  # no prompt: starts from BOS
    assert _ints(capsys.readouterr().out) == _greedy(saved["model"], [1], 3)


def test_generate_streams_text_with_a_tokenizer(saved, capsys):
    assert cli.main(["generate", str(saved["tokenized"]), "--prompt", "w1 w2 w3", "--max-new-tokens", "5"]) == 0
    prompt = saved["tokenizer"]("w1 w2 w3").input_ids
    expected = saved["tokenizer"].decode(prompt + _greedy(saved["model"], prompt), skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()
    cli.main(["generate", str(saved["tokenized"]), "--ids", "5 6 7", "--max-new-tokens", "5", "--print-ids"])
    assert _ints(capsys.readouterr().out) == _greedy(saved["model"], [5, 6, 7])


def test_the_docs_example_attaches_a_tokenizer_that_generate_then_uses(saved, tmp_path, monkeypatch, capsys):
    """docs/usage.md, "Attach a tokenizer to a model you trained yourself": its example runs as written, and the
    directory it leaves answers ``generate --prompt`` with the model's own greedy continuation of the prompt."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    doc = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    example = doc.split("<!-- tokenizer-example:start -->")[1].split("<!-- tokenizer-example:end -->")[0]
    code = example.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="has no tokenizer"):  # a model alone
        cli.main(["generate", str(saved["plain"]), "--prompt", "the cat"])
    exec(compile(code, "docs/usage.md", "exec"), {})
    tokenizer = AutoTokenizer.from_pretrained("my-model")
    model = AutoModelForCausalLM.from_pretrained("my-model").eval()
    prompt = tokenizer("the cat").input_ids
    assert max(prompt) < model.config.vocab_size == len(tokenizer)
    assert cli.main(["generate", "my-model", "--prompt", "the cat", "--max-new-tokens", "4"]) == 0
    expected = tokenizer.decode(prompt + _greedy(model, prompt, 4), skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()


@pytest.mark.parametrize("beams", ["1", "2"])
def test_generated_text_shows_no_special_tokens(saved, capsys, beams):
    """--ids starting with BOS (id 1, <s>): the echoed prompt and the continuation are text without <s> / </s>."""
    prompt = [1, 5, 6]
    assert cli.main(["generate", str(saved["tokenized"]), "--ids", "1 5 6", "--max-new-tokens", "5",
                     "--num-beams", beams]) == 0
    out = capsys.readouterr().out
    assert "<s>" not in out and "</s>" not in out
    if beams == "1":
        tokens = prompt + _greedy(saved["model"], prompt)
        assert out.strip() == saved["tokenizer"].decode(tokens, skip_special_tokens=True).strip()
    assert out.split()[:2] == ["w1", "w2"]  # ids 5, 6


def test_generate_sampling_is_reproducible_with_a_seed(saved, capsys):
    args = ["generate", str(saved["plain"]), "--ids", "5 6 7", "--max-new-tokens", "6", "--do-sample",
            "--temperature", "1.5", "--top-k", "20", "--top-p", "0.95", "--seed", "3"]
    cli.main(args)
    first = _ints(capsys.readouterr().out)
    cli.main(args)
    assert _ints(capsys.readouterr().out) == first and 1 <= len(first) <= 6  # may stop at EOS (id 2)


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--ids", "1"], "no model directory at"),
    (["{empty}", "--ids", "1"], "has no config.json"),
    (["{plain}", "--prompt", "w1"], "has no tokenizer: pass the prompt as token ids with --ids"),
    (["{plain}", "--ids", "999"], r"token ids \[999\] are outside the vocabulary \(size 61\)"),
    (["{plain}", "--ids", "1", "--temperature", "0.5"], "need --do-sample"),
    (["{plain}", "--ids", "1", "--do-sample", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["{plain}", "--ids", "1", "--device", "nonsense"], "invalid --device"),
])
def test_generate_errors_are_messages(saved, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "plain": saved["plain"]}
    with pytest.raises(SystemExit) as error:
        cli.main(["generate", *[a.format(**paths) for a in args]])
    assert str(error.value).startswith("selective-rope generate: ")
    assert re.search(message, str(error.value)), str(error.value)


@pytest.mark.parametrize("args, message", [
    (["--ids", "1,x"], "argument --ids: '1,x' is not a list of non-negative token ids"),
    (["--ids", "1", "--max-new-tokens", "0"], "argument --max-new-tokens: 0 must be > 0"),
    (["--ids", "1", "--num-beams", "two"], "argument --num-beams: 'two' is not an integer"),
    (["--ids", "1", "--prompt", "w1"], "not allowed with argument"),
])
def test_generate_bad_arguments_are_usage_errors(saved, capsys, args, message):
    with pytest.raises(SystemExit) as error:
        cli.main(["generate", str(saved["plain"]), *args])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


TINY_BENCH = ["--hidden-size", "32", "--layers", "1", "--vocab-size", "64", "--seq-len", "8", "--decode-tokens", "2",
              "--repeats", "1", "--threads", "1"]


def test_bench_runs_and_writes_json(tmp_path, capsys):
    assert cli.main(["bench", *TINY_BENCH, "--family", "all", "--output", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    assert "prefill tok/s" in out and "load average" in out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [row["family"] for row in report["results"]] == ["gla", "gated_deltanet", "fox", "hybrid"]
    for row in report["results"]:
        assert row["prefill_tokens_per_s"] > 0 and row["decode_ms_per_token"] > 0 and row["train_tokens_per_s"] > 0
        assert row["config"]["hidden_size"] == 32
    assert report["machine"]["threads"] == 1 and report["settings"]["seq_len"] == 8


def test_bench_threads_apply_to_its_run_only(tmp_path):
    """``--threads`` sets torch's thread count for the benchmark and gives the caller's back after it."""
    torch.set_num_threads(2)  # the autouse fixture restores the session's count after this test
    assert cli.main(["bench", *TINY_BENCH, "--family", "gla", "--threads", "1",
                     "--output", str(tmp_path / "bench.json")]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["threads"] == 1
    assert torch.get_num_threads() == 2


def test_bench_careful_scripts_are_not_part_of_the_command(capsys):
    """The careful benchmarks are scripts of the source repository (benchmarks/), not of the installed command."""
    with pytest.raises(SystemExit) as error:
        cli.main(["bench", "--full"])
    assert error.value.code == 2 and "unrecognized arguments: --full" in capsys.readouterr().err


def test_bench_errors(capsys):
    with pytest.raises(SystemExit, match="must split into 1 heads of an even size"):
        cli.main(["bench", "--family", "gla", "--hidden-size", "33", "--layers", "1", "--seq-len", "4",
                  "--repeats", "1"])
    with pytest.raises(SystemExit) as error:
        cli.main(["bench", "--seq-len", "-4"])
    assert error.value.code == 2 and "argument --seq-len: -4 must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as error:
        cli.main(["bench", "--family", "mamba"])
    assert error.value.code == 2 and "invalid choice: 'mamba'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_explains_each_command(command, capsys):
    with pytest.raises(SystemExit) as error:
        cli.main([command, "--help"])
    assert error.value.code == 0
    text = capsys.readouterr().out
    assert {"generate": "Generate from a saved model directory", "bench": "A quick benchmark"}[command] in text

