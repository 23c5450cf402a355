"""Smoke tests of the synthetic-task evidence (examples/synthetic/): the generators' labels against independent
computations, one tiny training run per task end to end (results JSON), the loss falling on a memorisable batch.
The full runs are `bash examples/synthetic/run_all.sh` (see docs/synthetic.md); one headline check is marked slow."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from selective_rope.kernels import rotary_cpu

SYNTHETIC = Path(__file__).resolve().parents[2] / "examples" / "synthetic"
sys.path.insert(0, str(SYNTHETIC))

_matplotlib_before = "matplotlib" in sys.modules
import phase_drift  # noqa: E402
import summarize  # noqa: E402
import summarize_paper  # noqa: E402
import train  # noqa: E402
from tasks import IGNORE, MQAR, Copy, Parity  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads cost more than they give

TINY = dict(hidden=16, heads=2, steps=3, batch=4, eval_batch=4)
TINY_EVAL = {"parity": [6, 12], "mqar": [2, 4], "copy": [3, 6]}
TINY_TRAIN = {"parity": 6, "mqar": 3, "copy": 4}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_shift(batch):
    assert (batch.labels[:, 0] == IGNORE).all()
    assert torch.equal(batch.labels[:, 1:], batch.targets[:, :-1])
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.labels.shape == batch.targets.shape


def test_parity_labels_are_the_running_parity():
    batch = Parity.sample(32, 17, gen())
    check_shift(batch)
    for ids, targets in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        assert ids[0] == Parity.BOS and ids[-1] == Parity.END and set(ids[1:-1]) <= {0, 1}
        parity = 0
        for t, bit in enumerate(ids[1:-1], start=1):
            parity ^= bit
            assert targets[t] == parity
        assert targets[0] == IGNORE and targets[-1] == IGNORE
        assert targets[Parity.final_position(17)] == sum(ids[1:-1]) % 2
    # both classes appear, and the bits are not constant
    assert 0.3 < batch.targets[:, 1:-1].float().mean() < 0.7


def test_parity_bit_densities():
    """``half`` is the original fair-bit stream; ``uniform`` gives each string its own density of 1s; ``mixed``
    alternates the two; the labels are the running parity for every density."""
    batch = Parity.sample(8, 12, gen(3), "half")
    bits = torch.randint(0, 2, (8, 12), generator=gen(3))
    assert torch.equal(batch.input_ids[:, 1:-1], bits)
    for density in ("uniform", "mixed"):
        batch = Parity.sample(400, 64, gen(), density)
        bits = batch.input_ids[:, 1:-1]
        assert torch.equal(batch.targets[:, 1:-1], bits.cumsum(1) % 2)
        per_string = bits.float().mean(1)
        spread = per_string[1::2] if density == "mixed" else per_string
        assert (spread < 0.1).sum() > 10 and (spread > 0.9).sum() > 10  # long runs of either bit
        if density == "mixed":
            assert ((per_string[::2] - 0.5).abs() < 0.3).all()
    with pytest.raises(ValueError, match="unknown bit density 'sparse'"):
        Parity.sample(2, 4, gen(), "sparse")


def test_bit_density_applies_to_parity_training_only(tmp_path):
    settings = train.task_settings("parity", bit_density="uniform")
    task = train.make_task("parity", settings)
    evaluation = train.sample(task, settings, 16, 20, gen(1), train=False)
    assert torch.equal(evaluation.input_ids, Parity.sample(16, 20, gen(1), "half").input_ids)
    training = train.sample(task, settings, 16, 20, gen(1), train=True)
    assert torch.equal(training.input_ids, Parity.sample(16, 20, gen(1), "uniform").input_ids)
    output = tmp_path / "parity.json"
    assert train.main(["--task", "parity", "--variant", "selective", "--hidden", "16", "--steps", "1", "--batch", "2",
                       "--train-length", "4", "--eval-lengths", "4", "--bit-density", "uniform",
                       "--output", str(output)]) == 0
    assert json.loads(output.read_text())["task_settings"]["bit_density"] == "uniform"
    with pytest.raises(SystemExit):
        train.main(["--task", "mqar", "--variant", "nope", "--bit-density", "uniform"])


def test_mqar_answers_are_the_values_of_the_queried_keys():
    task = MQAR(num_keys=16)
    pairs = 6
    batch = task.sample(16, pairs, gen(), queries=4)
    check_shift(batch)
    assert batch.input_ids.max() < task.vocab_size
    for ids, targets in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        assert ids[0] == task.BOS
        context = ids[1:1 + 2 * pairs]
        keys, values = context[0::2], context[1::2]
        assert len(set(keys)) == pairs and all(k < 16 for k in keys) and all(16 <= v < 32 for v in values)
        table = dict(zip(keys, values))
        scored = [t for t, target in enumerate(targets) if target != IGNORE]
        assert len(scored) == 4
        for t in scored:
            assert ids[t] in table and targets[t] == table[ids[t]]  # the query's answer is its key's value
            assert ids[t + 1] == targets[t]  # teacher forcing: the answer is the next input token
    assert len(MQAR(8).sample(2, 8, gen()).input_ids[0]) == 1 + 4 * 8  # default: every key asked once


def test_copy_targets_reproduce_the_source():
    task = Copy(alphabet=5)
    batch = task.sample(24, 2, 7, gen())
    check_shift(batch)
    lengths = set()
    for ids, mask, targets in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), batch.targets.tolist()):
        n = ids.index(task.COPY) - 1
        lengths.add(n)
        assert ids[0] == task.BOS and 2 <= n <= 7
        source = ids[1:n + 1]
        assert all(token < 5 for token in source)
        answers = [target for target in targets if target != IGNORE]
        assert answers == source + [task.EOS]  # after COPY: the string, then EOS
        assert sum(mask) == 2 * n + 3 and all(mask[:2 * n + 3]) and not any(mask[2 * n + 3:])
        assert all(token == task.PAD for token in ids[2 * n + 3:])
    assert len(lengths) > 1  # lengths vary within a batch (right padding)
    assert (task.sample(3, 9, 9, gen()).attention_mask == 1).all()


@pytest.mark.parametrize("task", ["parity", "mqar", "copy"])
def test_tiny_training_run_writes_a_results_json(tmp_path, task):
    output = tmp_path / task / "selective_seed0.json"
    train.run(task, "selective", seed=0, output=output, quiet=True, train_length=TINY_TRAIN[task],
              eval_lengths=TINY_EVAL[task], **TINY)
    result = json.loads(output.read_text())
    for key in ("task", "variant", "seed", "model_config", "budget", "eval", "wall_seconds", "torch_version",
                "transformers_version", "machine", "loss_curve"):
        assert key in result
    assert result["task"] == task and result["seed"] == 0 and result["budget"]["steps_done"] == 3
    assert result["model_config"]["model_type"] == "selective_rope_gla"
    assert result["model_config"]["position_embedding"] == "selective_rope"
    assert result["torch_version"] == torch.__version__
    assert [row["length"] for row in result["eval"]] == TINY_EVAL[task]
    for row in result["eval"]:
        assert 0.0 <= row["token_accuracy"] <= 1.0 and 0.0 <= row["sequence_accuracy"] <= 1.0
        assert ("final_token_accuracy" in row) == (task == "parity")
    # the summary reads it back (tables only; the plots need matplotlib)
    groups = summarize.load(tmp_path)[task]
    assert "Selective RoPE" in summarize.task_tables(task, groups)


@pytest.mark.parametrize("variant", ["nope", "rope", "selective_gate_bias"])
def test_variants_set_the_position_embedding(variant):
    config = train.build_config(Parity(), "gla", variant, 1, 16, 2, {"phase_conv_size": 0})
    assert config.position_embedding == train.VARIANTS[variant]["position_embedding"]
    if variant == "selective_gate_bias":
        assert config.phase_gate and config.phase_bias and config.phase_conv_size == 0


def test_loss_decreases_on_a_memorisable_batch():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    task = Parity()
    config = train.build_config(task, "gla", "selective", 1, 32, 2, {"phase_conv_size": 0})
    model = AutoModelForCausalLM.from_config(config)
    batch = task.sample(4, 8, gen(1))
    settings = train.task_settings("parity", steps=25, lr=1e-2)
    curve = train.train(model, task, settings, seed=0, log_every=5, fixed_batch=batch, quiet=True)["loss_curve"]
    assert curve[-1]["loss"] < 0.5 * curve[0]["loss"], curve


def test_training_loss_is_the_models_loss_and_smooths_like_an_independent_computation():
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    task = Parity()
    model = AutoModelForCausalLM.from_config(train.build_config(task, "gla", "selective", 1, 16, 2, {})).eval()
    batch = task.sample(3, 7, gen(2))
    own = model(batch.input_ids, labels=batch.labels).loss
    assert torch.equal(train.training_loss(model, batch, 0.0), own)

    smoothing = 0.2
    log_probs = model(batch.input_ids).logits.float().log_softmax(-1)  # (B, T, V); targets are unshifted
    scored = batch.targets != IGNORE
    chosen = log_probs.gather(-1, batch.targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)[scored]
    uniform = log_probs.mean(-1)[scored]  # smoothing spreads `smoothing` evenly over all V classes
    expected = -((1 - smoothing) * chosen + smoothing * uniform).mean()
    torch.testing.assert_close(train.training_loss(model, batch, smoothing), expected, rtol=1e-6, atol=1e-6)


def test_learning_rate_schedule_warms_up_and_decays_to_the_floor():
    steps, lr = 200, 1e-2
    assert train.lr_at(0, steps, lr) == pytest.approx(lr / 10)  # 5 % warm-up = 10 steps
    assert train.lr_at(9, steps, lr) == pytest.approx(lr)
    for floor in (0.0, 0.1):
        schedule = [train.lr_at(step, steps, lr, floor=floor) for step in range(10, steps)]
        assert all(a >= b for a, b in zip(schedule, schedule[1:]))
        assert schedule[-1] == pytest.approx(floor * lr, abs=lr * 1e-3)


def test_onecycle_schedule_is_torchs_onecycle():
    steps, lr = 120, 3e-3
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    for step in range(steps):
        assert train.onecycle_lr_at(step, steps, lr) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9)
        optimizer.step()
        scheduler.step()


def test_paper_variants_change_one_field_each_and_keep_their_convolution():
    """``paper`` is the ``state_tracking`` preset; each ablation differs from it in exactly one field; the parity
    task's ``phase_conv_size=0`` default applies to the other variants only."""
    from selective_rope import SelectiveRopeGLAConfig

    paper = train.VARIANTS["paper"]
    assert paper == {**paper, "temperature_theta": 1.0, "phase_gate": False, "phase_bias": True, "phase_conv_size": 4}
    changed = {name: {k for k in paper if train.VARIANTS[name][k] != paper[k]}
               for name in ("paper_theta500k", "paper_gate", "paper_nobias", "paper_noconv")}
    assert changed == {"paper_theta500k": {"temperature_theta"}, "paper_gate": {"phase_gate"},
                       "paper_nobias": {"phase_bias"}, "paper_noconv": {"phase_conv_size"}}
    preset = SelectiveRopeGLAConfig.from_preset("state_tracking", hidden_size=16, num_heads=2)
    assert all(getattr(preset, key) == value for key, value in paper.items())
    for variant, conv in (("paper", 4), ("selective", 0)):
        result = train.run("parity", variant, seed=0, quiet=True, train_length=6, eval_lengths=[6], **TINY)
        assert result["model_config"].get("phase_conv_size", 4) == conv


def test_training_lengths_are_drawn_per_batch_within_the_range(monkeypatch):
    lengths = []
    original = train.sample

    def recording(task, settings, batch, length, generator, is_train):
        lengths.append(length)
        return original(task, settings, batch, length, generator, is_train)

    monkeypatch.setattr(train, "sample", recording)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(train.build_config(Parity(), "gla", "nope", 1, 16, 2, {}))
    settings = train.task_settings("parity", steps=40, batch=2, train_length=9, min_train_length=4)
    train.train(model, Parity(), settings, seed=0, quiet=True)
    assert len(lengths) == 40 and set(lengths) <= set(range(4, 10)) and len(set(lengths)) >= 4


@pytest.mark.parametrize("arguments, message", [
    (["--min-train-length", "0"], "must be in"),
    (["--min-train-length", "50"], "must be in"),
    (["--min-train-length", "4", "--curriculum-steps", "10"], "give one"),
])
def test_min_train_length_is_checked(arguments, message, capsys):
    with pytest.raises(SystemExit):
        train.main(["--task", "parity", "--variant", "nope", "--train-length", "32", *arguments])
    assert message in capsys.readouterr().err


def test_a_run_without_output_goes_into_the_store_under_its_key_and_skip_done_skips_it(tmp_path, monkeypatch,
                                                                                      capsys):
    store = tmp_path / "synthetic.jsonl"
    monkeypatch.setattr(train, "RESULTS", store)
    tiny = ["--task", "parity", "--hidden", "16", "--steps", "1", "--batch", "2", "--train-length", "4",
            "--eval-lengths", "4"]
    assert train.main([*tiny, "--variant", "nope", "--tag", "_t"]) == 0
    assert train.main([*tiny, "--variant", "rope", "--run", "parity/sweep/x_seed0"]) == 0
    runs = summarize.read_runs(store)
    assert list(runs) == ["parity/nope_t_seed0", "parity/sweep/x_seed0"] and runs["parity/nope_t_seed0"]["seed"] == 0
    assert list(summarize.load(store)["parity"]) == ["nope_t"]  # the sweep's run is not a main run
    before = store.read_text()
    assert train.main([*tiny, "--variant", "rope", "--run", "parity/sweep/x_seed0", "--skip-done"]) == 0
    assert store.read_text() == before and "already in" in capsys.readouterr().out


def test_optimizer_settings_reach_the_results_json(tmp_path):
    output = tmp_path / "parity.json"
    assert train.main(["--task", "parity", "--variant", "selective", "--hidden", "16", "--steps", "2", "--batch", "2",
                       "--train-length", "4", "--eval-lengths", "4", "--weight-decay", "0.05", "--lr-floor", "0",
                       "--label-smoothing", "0.1", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    settings = result["task_settings"]
    assert (settings["weight_decay"], settings["lr_floor"], settings["label_smoothing"]) == (0.05, 0.0, 0.1)
    assert "weight decay 0.05" in result["budget"]["schedule"] and "cosine to 0 x lr" in result["budget"]["schedule"]
    assert "label smoothing 0.1" in result["budget"]["loss"]
    with pytest.raises(ValueError, match="unknown task"):
        train.task_settings("sorting")


def test_recipe_sweep_table_names_what_each_recipe_changed(tmp_path):
    tiny = dict(TINY, train_length=4, eval_lengths=[4, 8, 16])
    train.run("parity", "selective_gate_bias", seed=0, quiet=True,
              output=tmp_path / "parity" / "selective_gate_bias_seed0.json", **tiny)
    for seed in (0, 1):
        train.run("parity", "selective_gate_bias", seed=seed, quiet=True, label_smoothing=0.1, lr_floor=0.0,
                  overrides={"temperature_max": 2.5},
                  output=tmp_path / "parity" / "sweep" / f"selective_gate_bias_ls_seed{seed}.json", **tiny)
    longer = dict(tiny, train_length=3, eval_lengths=[3, 6, 12])  # 2L and 4L are read at each recipe's own L
    train.run("parity", "selective", seed=0, quiet=True, bit_density="uniform",
              output=tmp_path / "parity" / "sweep" / "selective_density_seed0.json", **longer)
    main_groups = summarize.load(tmp_path)["parity"]
    assert list(main_groups) == ["selective_gate_bias"]  # the sweep stays out of the main tables
    text = summarize.recipe_sweep(tmp_path, main_groups)
    rows = [line for line in text.splitlines() if line.startswith("| Selective")]
    assert len(rows) == 3
    assert rows[0].startswith("| Selective RoPE (gate + bias) | main runs | 4 | 1 |")
    assert rows[1].startswith("| Selective RoPE (gate) | hidden 16, training length 3, steps 3, batch 4, "
                              "bit density uniform | 3 | 1 |")
    assert ("| hidden 16, training length 4, steps 3, batch 4, lr floor 0, label smoothing 0.1, temperature_max=2.5 "
            "| 4 | 2 |") in rows[2]
    density_run = summarize.load(tmp_path / "parity")["parity"]["selective_density"][0]
    at = {row["length"]: f"{100 * row['final_token_accuracy']:.1f}" for row in density_run["eval"]}
    assert rows[1].endswith(f"| {at[6]} |")  # the mean at 2L = 6 bits (one seed)
    assert summarize.recipe_sweep(tmp_path / "nowhere", main_groups) is None


def test_saved_parity_model_reloads_and_is_diagnosed(tmp_path, capsys):
    train.run("parity", "selective", seed=0, quiet=True, save_model=tmp_path / "model", train_length=6,
              eval_lengths=[6], **TINY)
    assert phase_drift.main([str(tmp_path / "model"), "--length", "20", "--zero-phase", "1:3"]) == 0
    out = capsys.readouterr().out
    assert out.count("layer 0 head") == TINY["heads"] and "accuracy by blocks" in out
    assert "with the phase of head 1 frequency 3 zeroed" in out
    assert "zeros (20 bits):" in out and "alternating (20 bits):" in out


def test_pattern_errors_are_the_wrong_running_parities():
    class AlwaysZero(torch.nn.Module):  # answers 0 after every bit: wrong exactly where the running parity is 1
        def forward(self, ids):
            logits = torch.zeros(*ids.shape, Parity.vocab_size)
            logits[..., 0] = 1.0
            return type("Output", (), {"logits": logits})()

    errors = phase_drift.errors_on_patterns(AlwaysZero(), length=7)
    assert errors == {"zeros": [], "ones": [1, 3, 5, 7], "alternating": [2, 3, 6, 7]}


def test_zeroing_a_heads_phase_leaves_its_queries_and_keys_unrotated(tmp_path, monkeypatch):
    """Also where the compiled CPU kernel would serve (no autograd): the patch keeps the layers on the general path,
    so the reference for the other heads is that path's result (the kernel agrees with it to rounding only)."""
    train.run("parity", "selective_gate_bias", seed=0, quiet=True, save_model=tmp_path / "model", train_length=6,
              eval_lengths=[6], **TINY)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    rotary = model.model.layers[0].attn.rotary
    x, q, k = torch.randn(1, 5, 16), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    with torch.no_grad():
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "0")
        q_rotated, k_rotated, _ = rotary(x, q, k)
        monkeypatch.setenv(rotary_cpu.ENV_SWITCH, "1")
        q_compiled, _, _ = rotary(x, q, k)
        with phase_drift.phase_zeroed(model, head=1):
            q_head1_off, k_head1_off, _ = rotary(x, q, k)
        with phase_drift.phase_zeroed(model, head=0, frequency=2):
            q_freq_off, _, _ = rotary(x, q, k)
        q_after, _, _ = rotary(x, q, k)
    assert torch.equal(q_head1_off[:, :, 1], q[:, :, 1]) and torch.equal(k_head1_off[:, :, 1], k[:, :, 1])
    assert torch.equal(q_head1_off[:, :, 0], q_rotated[:, :, 0]) and not torch.allclose(q_rotated[:, :, 1], q[:, :, 1])
    # GPT-NeoX halves: frequency 2 of a head of 8 is the pair (2, 6); the other pairs keep their rotation
    assert torch.equal(q_freq_off[:, :, 0, [2, 6]], q[:, :, 0, [2, 6]])
    assert torch.equal(q_freq_off[:, :, 0, [0, 1, 3, 4, 5, 7]], q_rotated[:, :, 0, [0, 1, 3, 4, 5, 7]])
    assert torch.equal(q_after, q_compiled)  # the patch is gone after the block
    with pytest.raises(ValueError, match="no key head 2"):
        with phase_drift.phase_zeroed(model, head=2):
            pass


def test_paper_summary_counts_the_seeds_at_the_target(tmp_path):
    """The table of the paper's setup: mean final-token accuracy per length and k/n seeds >= 95 % at 2x and 4x."""
    for seed in (0, 1):
        train.run("parity", "paper", seed=seed, quiet=True, train_length=4, min_train_length=2, eval_lengths=[8, 16],
                  output=tmp_path / "small" / f"paper_seed{seed}.json", **TINY)
    runs = summarize_paper.load(tmp_path, below="")["small"]["paper"]
    assert [run["seed"] for run in runs] == [0, 1]
    # overwrite the accuracies with known values: seed 0 passes at 8 bits only, seed 1 at neither
    for run, (at8, at16) in zip(runs, ((0.96, 0.5), (0.94, 0.99))):
        run["eval"][0]["final_token_accuracy"], run["eval"][1]["final_token_accuracy"] = at8, at16
    row = summarize_paper.table("small", {"paper": runs}).splitlines()[-1]
    assert row.endswith("| 95.0 [94–96] | 74.5 [50–99] | 1/2 | 1/2 |"), row


def test_matplotlib_is_imported_only_to_plot():
    if not _matplotlib_before:
        assert "matplotlib" not in sys.modules


@pytest.mark.slow
def test_parity_target_gla_selective_rope_length_extrapolates():
    """The headline claim (about 1-2 min): GLA + Selective RoPE >= 95 % final-token parity at 2x the training length
    on one of seeds 0-4, GLA + NoPE near chance. Seed-dependent: 2 of 5 seeds reach it (docs/synthetic.md), and which
    ones moves with the last bits of the gradients (seed 0 reached it until 72fca7d's convolution backward, equal to
    autograd's within rounding; seeds 1 and 2 since), so the seeds are tried in order until one does: a regression
    check of the library and the recipe, not an estimate of the success rate."""
    tried = {}
    for seed in range(5):
        tried[seed] = train.run("parity", "selective", seed=seed, quiet=True, eval_lengths=[80])["eval"][0][
            "final_token_accuracy"]
        if tried[seed] >= 0.95:
            break
    nope = train.run("parity", "nope", seed=0, quiet=True, eval_lengths=[80])["eval"][0]["final_token_accuracy"]
    assert max(tried.values()) >= 0.95 and nope < 0.65, (tried, nope)


@pytest.mark.slow
def test_parity_papers_selective_rope_extrapolates_at_small_scale():
    """The paper's state-tracking Selective RoPE (the ``state_tracking`` preset) at the small scale of
    docs/synthetic.md ("The paper's setup": hidden 64, 4 heads, lengths 4-32, OneCycle, 1500 steps; about 1.5 min per
    run on an idle core): >= 95 % final-token parity at twice the longest training length on seed 0, NoPE near chance.
    One seed, so a regression check of the library and the recipe; the docs give the rate over seeds."""
    settings = dict(heads=4, train_length=32, min_train_length=4, steps=1500, schedule="onecycle", lr=3e-3,
                    eval_lengths=[64])
    accuracy = {variant: train.run("parity", variant, seed=0, quiet=True, **settings)["eval"][0]["final_token_accuracy"]
                for variant in ("paper", "nope")}
    assert accuracy["paper"] >= 0.95 and accuracy["nope"] < 0.65, accuracy
