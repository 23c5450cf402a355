"""Smoke tests of docs/evidence.md's experiments: the A3 and MAD generators against independent computations, the
compression auto-encoder, and each script's ``--quick`` run (examples/synthetic/evidence.py, examples/lm/retrofit.py).
The full runs: `python examples/synthetic/evidence.py a3|mad`, `python examples/lm/retrofit.py run`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
for folder in (EXAMPLES / "synthetic", EXAMPLES / "lm"):
    sys.path.insert(0, str(folder))

import evidence  # noqa: E402
import mad  # noqa: E402
import retrofit  # noqa: E402
import summarize  # noqa: E402
import train  # noqa: E402
from tasks import A3, IGNORE, compose  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_layout(batch, length: int, vocab_size: int) -> None:
    assert batch.input_ids.shape[1] == length
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.labels.shape == batch.targets.shape
    assert torch.equal(batch.labels[:, 1:], batch.targets[:, :-1]) and (batch.labels[:, 0] == IGNORE).all()
    assert 0 <= int(batch.input_ids.min()) and int(batch.input_ids.max()) < vocab_size
    scored = batch.targets[batch.targets != IGNORE]
    assert scored.numel() > 0 and int(scored.max()) < vocab_size


# ---------------------------------------------------------------------------------------------------------- A3

def test_a3_elements_are_the_even_permutations_of_three():
    from itertools import permutations

    even = {p for p in permutations(range(3)) if sum(p[i] > p[j] for i in range(3) for j in range(i + 1, 3)) % 2 == 0}
    assert set(A3.ELEMENTS) == even and A3.ELEMENTS[0] == (0, 1, 2)


def test_a3_labels_are_the_composed_permutations():
    batch = A3.sample(16, 24, gen())
    check_layout(batch, 26, A3.vocab_size)
    for row in range(16):
        product = A3.ELEMENTS[0]
        for t in range(1, 25):  # BOS g_1 ... g_24 END
            product = compose(product, A3.ELEMENTS[int(batch.input_ids[row, t])])
            assert A3.ELEMENTS[int(batch.targets[row, t])] == product
        assert int(batch.targets[row, A3.final_position(24)]) == A3.ELEMENTS.index(product)
    assert (batch.targets[:, [0, 25]] == IGNORE).all()


def test_compose_applies_the_first_permutation_first():
    swap01, swap12 = (1, 0, 2), (0, 2, 1)
    assert compose(swap01, swap12) == (2, 0, 1)  # 0 -> 1 -> 2, 1 -> 0 -> 0, 2 -> 2 -> 1
    assert compose(swap12, swap01) == (1, 2, 0)  # S3 is not abelian: the order matters


# --------------------------------------------------------------------------------------------------------- MAD

def recall_reference(ids: list[int], keys: int, noise_start: int) -> dict[int, int]:
    """{position of a key whose value is recallable: that value}, by a plain scan of the pairs."""
    table, answers = {}, {}
    for i in range(0, len(ids), 2):
        key, value = ids[i], ids[i + 1]
        if key >= noise_start:  # a noise pair
            continue
        assert key < keys <= value < noise_start
        if key in table:
            assert table[key] == value  # one value per key within a sequence
            answers[i] = value
        table[key] = value
    return answers


@pytest.mark.parametrize("task", [mad.InContextRecall(), mad.NoisyRecall()])
def test_in_context_recall_scores_exactly_the_recallable_values(task):
    batch = task.sample(8, 64, gen(), train=False)
    check_layout(batch, 64, task.vocab_size)
    for row in range(8):
        ids = batch.input_ids[row].tolist()
        expected = recall_reference(ids, task.keys, task.noise_start)
        scored = {t: int(v) for t, v in enumerate(batch.targets[row].tolist()) if v != IGNORE}
        assert scored == expected and (len(ids) - 2) in scored  # the last pair always probes a seen key
    training = task.sample(8, 64, gen(), train=True)  # next-token prediction everywhere
    assert torch.equal(training.targets[:, :-1], training.input_ids[:, 1:])


def test_noisy_recall_noise_fraction():
    task = mad.NoisyRecall(frac_noise=0.5)
    ids = task.sample(64, 64, gen(), train=False).input_ids
    pairs_noisy = (ids[:, 0::2] >= task.noise_start).float().mean().item()
    assert 0.4 < pairs_noisy < 0.55 and ((ids[:, 1::2] >= task.noise_start) == (ids[:, 0::2] >= task.noise_start)).all()


def test_fuzzy_recall_scores_next_tokens_of_recalled_values():
    task = mad.FuzzyRecall()
    batch = task.sample(8, 64, gen(), train=False)
    check_layout(batch, 64, task.vocab_size)
    values = set(task.value_vocab)
    for row in range(8):
        ids, targets = batch.input_ids[row].tolist(), batch.targets[row].tolist()
        for t, target in enumerate(targets):
            if target != IGNORE:  # next-token layout: the value token that follows, never a key or a pad
                assert target == ids[t + 1] and target in values
        assert targets[-2] != IGNORE  # the final probe's value is scored
        pads = batch.attention_mask[row] == 0
        assert all(i == task.PAD for i in batch.input_ids[row][pads].tolist())
    training = task.sample(8, 64, gen(), train=True)
    real = (training.input_ids[:, :-1] != task.PAD) & (training.input_ids[:, 1:] != task.PAD)
    assert (training.targets[:, :-1][~real] == IGNORE).all()
    assert torch.equal(training.targets[:, :-1][real], training.input_ids[:, 1:][real])


def test_memorize_uses_one_fixed_map():
    task, again = mad.Memorize(), mad.Memorize()
    assert torch.equal(task.table, again.table) and len(set(task.table.tolist())) == task.num_keys
    batch = task.sample(4, 32, gen(), train=True)
    check_layout(batch, 32, task.vocab_size)
    assert (batch.input_ids[:, 1::2] == task.INSERT).all()
    assert torch.equal(batch.targets[:, 1::2], task.table[batch.input_ids[:, 0::2]])
    assert (batch.targets[:, 0::2] == IGNORE).all()


def test_selective_copy_targets_are_the_scattered_tokens_in_order():
    task = mad.SelectiveCopy(tokens_to_copy=8)
    batch = task.sample(8, 48, gen(), train=False)
    check_layout(batch, 48, task.vocab_size)
    for row in range(8):
        ids = batch.input_ids[row].tolist()
        copy_at = ids.index(task.COPY)
        assert copy_at == 48 - 8 - 1 and ids[copy_at + 1:] == [task.BLANK] * 8
        assert [i for i in ids[:copy_at] if i != task.BLANK] == batch.targets[row, copy_at + 1:].tolist()
        assert (batch.targets[row, :copy_at + 1] == IGNORE).all()


def test_compress_rebuilds_every_token_from_the_last_state():
    task = mad.Compress()
    batch = task.sample(4, 16, gen())
    check_layout(batch, 16, task.vocab_size)
    assert torch.equal(batch.targets, batch.input_ids) and (batch.input_ids[:, -1] == task.COMPRESS).all()
    model = task.wrap_model(_tiny_gla(task.vocab_size))
    out = model(batch.input_ids, labels=batch.labels)
    assert out.logits.shape == (4, 16, task.vocab_size) and out.loss.ndim == 0
    # every position is decoded from the backbone's last hidden state alone
    encoder_last = model.encoder(batch.input_ids).last_hidden_state[:, -1]
    torch.testing.assert_close(out.logits, model.decoder(encoder_last[:, None] + model.positions[:16]))


def _tiny_gla(vocab_size: int):
    from transformers import AutoModelForCausalLM

    import selective_rope  # noqa: F401

    config = train.build_config(type("T", (), {"vocab_size": vocab_size})(), "gla", "selective_plain", 1, 16, 2, {})
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name, length", [("compress", 16), ("in_context_recall", 16), ("noisy_recall", 16),
                                          ("fuzzy_recall", 32), ("memorize", 16), ("selective_copy", 24)])
def test_mad_tasks_sample_at_the_given_length(name, length):
    settings = train.task_settings(name)
    task = train.make_task(name, settings)
    batch = train.sample(task, settings, 2, length, gen(), train=False)
    assert batch.input_ids.shape == (2, length)
    if name in ("in_context_recall", "noisy_recall"):
        with pytest.raises(ValueError, match="even length"):
            task.sample(2, 15, gen(), train=False)


# ------------------------------------------------------------------------------------------------ quick runs

@pytest.mark.parametrize("section, runs", [("a3", 6), ("mad", 18)])
def test_evidence_quick_runs_every_configuration(section, runs, capsys):
    assert evidence.main([section, "--quick"]) == 0
    assert f"quick: {runs} runs" in capsys.readouterr().out


def test_retrofit_quick_converts_exactly_and_finetunes_every_arm(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(retrofit.tempfile, "TemporaryDirectory", lambda: _Keep(tmp_path))
    assert retrofit.main(["run", "--quick"]) == 0
    runs = evidence.read_runs(tmp_path / "retrofit.jsonl")
    assert set(runs) == {"pretrain"} | {f"{arm}_seed0" for arm in retrofit.ARMS}
    exact = [arm for arm, flags in retrofit.ARMS.items() if "--tolerance" not in (flags or [])]
    before = [[row["perplexity"] for row in runs[f"{arm}_seed0"]["eval_before"]] for arm in exact]
    assert len(exact) == 3
    for other in before[1:]:  # these conversions start computing what the Llama computes
        assert other == pytest.approx(before[0], rel=1e-4)
    assert runs["selective_forget_seed0"]["config"]["use_forget_gate"] is True
    assert "use_forget_gate" not in runs["selective_seed0"]["config"] or not runs["selective_seed0"]["config"][
        "use_forget_gate"]


def test_retrofit_skip_done_leaves_a_stored_run_alone(tmp_path):
    store = tmp_path / "retrofit.jsonl"
    evidence.store_run(store, "llama_seed0", {"arm": "llama", "seed": 0})
    before = store.read_text()
    # the model path does not exist: only a skipped run returns without loading it
    retrofit.finetune("llama", tmp_path / "missing", 0, {}, retrofit.QUICK, store, skip_done=True)
    assert store.read_text() == before
    with pytest.raises(OSError):
        retrofit.finetune("llama", tmp_path / "missing", 0, {}, retrofit.QUICK, store, skip_done=False)


# ------------------------------------------------------------------------------------------------------ stores

def _fake_run(task, variant, seed, quiet, **settings):
    lengths = settings.get("eval_lengths", [64])
    return {"task": task, "variant": variant, "seed": seed, "settings": settings,
            "eval": [{"length": n, "token_accuracy": 0.5, "final_token_accuracy": 1.0 if variant == "paper" else 0.3}
                     for n in lengths]}


def test_evidence_runs_go_into_the_store_under_their_keys_and_skip_done_skips_them(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(evidence.train, "run", lambda *a, **k: calls.append(a) or _fake_run(*a, **k))
    store = tmp_path / "synthetic.jsonl"
    evidence.store_run(store, "parity/nope_seed0", {"task": "parity"})  # a run of another experiment stays
    evidence.run_a3([0], store, quick=False, skip_done=False)
    evidence.run_mad([0], store, quick=False, skip_done=False)
    runs = evidence.read_runs(store)
    a3 = {f"a3/{v}{n}_seed0" for v in evidence.A3_VARIANTS for n in ("", "_negeig")}
    mad_keys = {f"mad/{t}/{v}_seed0" for t in evidence.MAD_TASKS for v in evidence.MAD_VARIANTS}
    assert set(runs) == {"parity/nope_seed0"} | a3 | mad_keys and len(calls) == 6 + 18
    assert runs["a3/rope_negeig_seed0"]["settings"]["overrides"] == {"allow_neg_eigval": True}
    before = store.read_text()
    evidence.run_a3([0], store, quick=False, skip_done=True)
    evidence.run_mad([0, 1], store, quick=False, skip_done=True)  # only seed 1 is new
    assert len(calls) == 24 + 18 and store.read_text().startswith(before)
    evidence.run_a3([0], store, quick=False, skip_done=False)  # a rerun replaces its lines
    assert len(calls) == 48 and len(evidence.read_runs(store)) == 1 + 6 + 36
    # the summary reads the store; the synthetic summary leaves these runs alone
    a3_markdown, a3_summary = evidence.a3_table(evidence.read_runs(store))
    assert set(a3_summary) == {k[3:-6] for k in a3} and "| Selective RoPE | (0, 1) | 1 | 100.0 (100–100)" in a3_markdown
    _, mad_summary = evidence.mad_table(evidence.read_runs(store))
    assert all(len(seeds) == 2 for row in mad_summary.values() for seeds in row.values())
    assert set(summarize.load(store)) == {"parity"}


class _Keep:
    """A stand-in for TemporaryDirectory that leaves the folder to pytest's tmp_path."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return str(self.path)

    def __exit__(self, *exc):
        return False
