"""Saved models carry their modeling code: they load with ``trust_remote_code=True`` where selective_rope cannot be
imported, give identical logits, and save again from the flat copy."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.dynamic_module_utils import get_imports

from families import FAMILIES, OPTION_VARIANTS
from isolation import import_blocker

# Run in a fresh interpreter in which `import selective_rope` fails outright, so the travelling code cannot lean on
# the installed package even lazily.
_LOAD_WITHOUT_PACKAGE = import_blocker("selective_rope") + textwrap.dedent("""
    import json, os
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    directory = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(directory, trust_remote_code=True).eval()
    config = AutoConfig.from_pretrained(directory, trust_remote_code=True)
    ids = torch.load(os.path.join(directory, "ids.pt"))
    with torch.no_grad():
        logits = model(ids).logits
        hidden = base(ids).last_hidden_state
    model.save_pretrained(os.path.join(directory, "again"))
    torch.save({"logits": logits, "hidden": hidden}, os.path.join(directory, "remote.pt"))
    print(json.dumps({"classes": [type(model).__name__, type(base).__name__, type(config).__name__],
                      "modules": [type(model).__module__],
                      "package_imported": any(m.split(".")[0] == "selective_rope" for m in sys.modules)}))
""")


@pytest.mark.parametrize("family", [*FAMILIES.values(), FAMILIES["gla"].with_options("official",
                                                                                 OPTION_VARIANTS["official"])],
                         ids=[*FAMILIES.keys(), "gla-official"])
def test_remote_code_loads_without_the_package(family, tmp_path):
    torch.manual_seed(0)
    model = family.lm_class(family.config_class(**family.tiny)).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, family.tiny["vocab_size"], (2, 11))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected_logits = model(ids).logits
        expected_hidden = model.model(ids).last_hidden_state

    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    stem = family.config_class.model_type.removeprefix("selective_rope_")
    assert auto_map == {
        "AutoConfig": f"configuration_{stem}.{family.config_class.__name__}",
        "AutoModel": f"modeling_{stem}.{family.model_class.__name__}",
        "AutoModelForCausalLM": f"modeling_{stem}.{family.lm_class.__name__}",
    }

    run = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_PACKAGE, str(tmp_path)], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["classes"] == [family.lm_class.__name__, family.model_class.__name__,
                                 family.config_class.__name__]
    assert report["modules"][0].startswith("transformers_modules.")
    assert not report["package_imported"]
    remote = torch.load(tmp_path / "remote.pt")
    assert torch.equal(remote["logits"], expected_logits)
    assert torch.equal(remote["hidden"], expected_hidden)

    # The remote-loaded model saved again: the same code files and auto_map, weights unchanged.
    again = tmp_path / "again"
    assert sorted(p.name for p in again.glob("*.py")) == sorted(p.name for p in tmp_path.glob("*.py"))
    assert json.loads((again / "config.json").read_text())["auto_map"] == auto_map
    reloaded = family.lm_class.from_pretrained(again).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected_logits)


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_travelling_code_needs_only_torch_transformers_and_hub(family, tmp_path):
    """transformers refuses remote code whose imports are not installed: the bundle must not need triton, fla or
    the package itself (imports inside try/except are optional and allowed)."""
    family.lm_class(family.config_class(**family.tiny)).save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.py"))
    assert files
    needed = set().union(*(get_imports(path) for path in files)) - sys.stdlib_module_names
    assert needed <= {"torch", "transformers", "huggingface_hub"}, needed
    for path in files:  # only flat sibling imports remain
        text = path.read_text()
        assert not re.search(r"^\s*from\s+\.\.", text, re.M), path.name
        assert not re.search(r"^\s*(from|import)\s+selective_rope\b", text, re.M), path.name


def test_model_card_from_a_saved_model(tmp_path):
    family = FAMILIES["fox"]
    model = family.lm_class(family.config_class(**family.tiny))
    card = model.model_card("someone/tiny-fox", base_model="someone/tiny-llama", license="mit",
                            provenance="Converted for a test.")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "mit"
    assert card.data.base_model == "someone/tiny-llama"
    assert card.data.base_model_relation == "finetune"
    assert "selective-rope" in card.data.tags
    text = str(card)
    assert 'from_pretrained("someone/tiny-fox")' in text
    assert "Converted for a test." in text
    assert f"| `phase_proj_rank` | `{model.config.phase_proj_rank!r}` |" in text
    assert f"{model.num_parameters() / 1e6:.1f}M parameters" in text


def test_unknown_model_type_has_no_card():
    from selective_rope.modeling.model_card import render_model_card

    class Config:
        model_type = "llama"

    with pytest.raises(ValueError, match="no model-card template for model_type 'llama'"):
        render_model_card(Config())


def test_each_copy_of_the_travelling_code_runs_its_own_attention_op(tmp_path):
    """FoX's attention is a torch.library op, and registering an op name again replaces its implementation for every
    caller: each flat copy (and the package) registers ops of its own, so two saved models loaded in one process run
    their own code. One copy's op is altered here; the other must still give the original logits."""
    family = FAMILIES["fox"]
    torch.manual_seed(0)
    model = family.lm_class(family.config_class(**family.tiny)).eval()
    ids = torch.randint(3, family.tiny["vocab_size"], (2, 9))
    for name in ("plain", "altered"):
        model.save_pretrained(tmp_path / name)
        torch.save(ids, tmp_path / name / "ids.pt")
    kernel = tmp_path / "altered" / "kernels_forgetting_attention_torch.py"
    # the eager path calls the op's function directly (no dispatch); torch.compile calls the op itself
    original = "        return _attention_merged(q, k, v, cum, scale, block_size)\n"
    assert kernel.read_text().count(original) == 1
    kernel.write_text(kernel.read_text().replace(original, original.replace("return ", "return 1.0 + ")))
    code = import_blocker("selective_rope") + textwrap.dedent("""
        import os, torch
        from transformers import AutoModelForCausalLM
        models = {name: AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True).eval()
                  for name in ("plain", "altered")}  # the altered copy loads last
        with torch.no_grad():
            logits = {name: m(torch.load(os.path.join(name, "ids.pt"))).logits for name, m in models.items()}
        torch.save(logits, "logits.pt")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        expected = model(ids).logits
    assert torch.equal(logits["plain"], expected)
    assert not torch.allclose(logits["altered"], expected)  # the alteration is real, and stays in its own copy


def test_a_saved_model_carries_only_its_own_familys_code(tmp_path):
    """Each family's bundle holds its own mixer, kernels and card template, none of another family's, and not the
    bundler (a flat copy is saved again by transformers' custom_object_save)."""
    own = {"gla": ("modeling_gla.py", "kernels_gla.py", "kernels_gla_torch.py"),
           "gated_deltanet": ("modeling_gated_deltanet.py", "kernels_gated_delta.py", "kernels_gated_delta_torch.py"),
           "fox": ("modeling_fox.py", "kernels_forgetting_attention.py", "kernels_forgetting_attention_torch.py")}
    # The hybrid's layers are Gated DeltaNet's and FoX's mixers: it carries their code, and none of GLA's.
    own["hybrid"] = ("modeling_hybrid.py", *own["gated_deltanet"], *own["fox"])
    for name, family in FAMILIES.items():
        directory = tmp_path / name
        family.lm_class(family.config_class(**family.tiny)).save_pretrained(directory)
        files = {path.name for path in directory.glob("*.py")}
        assert set(own[name]) <= files, name
        for other, other_files in own.items():
            if other != name:
                assert not (set(other_files) - set(own[name])) & files, (name, other)
        assert "modeling_remote_code.py" not in files
        card_module = (directory / "modeling_model_card.py").read_text()
        assert f"'{family.config_class.model_type}':" in card_module
        assert not any(f"'selective_rope_{other}':" in card_module for other in own if other != name)
