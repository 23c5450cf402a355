"""push_to_hub and from_pretrained through the real huggingface_hub client, against a Hub on loopback
(tests/loopback_hub.py): config, weights, modeling code and our model card go up; the model comes back down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from isolation import import_blocker
from loopback_hub import LoopbackHub

TOKEN = "hf_loopback_fake_token"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with LoopbackHub() as server:
        server.patch_endpoint(monkeypatch, cache_dir=tmp_path / "hf_cache")
        yield server
        assert not server.unhandled, f"requests the loopback hub does not implement: {server.unhandled}"


def _model(family):
    torch.manual_seed(0)
    return family.lm_class(family.config_class(**family.tiny)).eval()


def _ids(family):
    return torch.randint(3, family.tiny["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))


def _card(hub, repo_id, revision="main") -> ModelCard:
    return ModelCard(hub.files(repo_id, revision)["README.md"].decode())


def test_push_to_hub_uploads_config_weights_code_and_our_card_then_loads(family, hub, tmp_path):
    model = _model(family)
    repo_id = f"user/tiny-{family.name}"
    commit = model.push_to_hub(repo_id, token=TOKEN)

    files = hub.files(repo_id)
    model.save_pretrained(tmp_path / "local")
    code = {p.name for p in (tmp_path / "local").glob("*.py")}
    assert code and code <= set(files)  # the flat modeling code travels (trust_remote_code)
    for name in code:
        assert files[name] == (tmp_path / "local" / name).read_bytes()
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert not any(name.endswith(".bin") for name in files)
    assert files["model.safetensors"] == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert hub.files(repo_id, commit.oid) == files  # the returned commit is the head of main

    card = _card(hub, repo_id)
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert "selective-rope" in card.data.tags
    assert card.data.license == "apache-2.0"
    assert family.lm_class.__name__.removesuffix("ForCausalLM") in card.text
    assert f'from_pretrained("{repo_id}")' in card.text  # the loading snippet names the repository

    ids = _ids(family)
    with torch.no_grad():
        expected = model(ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(repo_id, cache_dir=tmp_path / "cache", token=TOKEN).eval()
    assert type(loaded) is family.lm_class
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)
    assert any(method == "GET" and path.endswith("/model.safetensors") for method, path in hub.requests)


# A fresh interpreter in which `import selective_rope` fails: the model must come from the Hub's code files, found
# through HF_ENDPOINT alone (the user-facing way to name a Hub), with fresh caches.
_LOAD_FROM_HUB_WITHOUT_PACKAGE = import_blocker("selective_rope") + textwrap.dedent("""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    repo_id, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    model = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(ids).logits
    print(json.dumps({"module": type(model).__module__, "logits": logits.tolist()}))
""")


def test_trust_remote_code_loads_from_the_hub_without_the_package(hub, tmp_path):
    from families import FAMILIES

    family = FAMILIES["gla"]
    model = _model(family)
    model.push_to_hub("user/remote", token=TOKEN)
    ids = _ids(family)
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    run = subprocess.run([sys.executable, "-c", _LOAD_FROM_HUB_WITHOUT_PACKAGE, "user/remote",
                          json.dumps(ids.tolist())], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["module"].startswith("transformers_modules.")
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(report["logits"]), model(ids).logits, atol=0, rtol=0)


def test_push_again_updates_weights_and_keeps_our_card(hub, tmp_path):
    from families import FAMILIES

    family = FAMILIES["gla"]
    model = _model(family)
    repo_id = "user/tiny-again"
    model.push_to_hub(repo_id, token=TOKEN,
                      model_card={"base_model": "user/source", "license": "mit", "provenance": "Made in a test."})
    card = _card(hub, repo_id)
    assert card.data.base_model == "user/source" and card.data.base_model_relation == "finetune"
    assert card.data.license == "mit"
    assert "Made in a test." in card.text
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    model.push_to_hub(repo_id, token=TOKEN, tags=["my-tag"], commit_message="Second upload")
    assert "Second upload" in hub.history(repo_id)
    card = _card(hub, repo_id)
    assert {"selective-rope", "my-tag"} <= set(card.data.tags)
    loaded = AutoModelForCausalLM.from_pretrained(repo_id, cache_dir=tmp_path / "cache", token=TOKEN)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_push_to_a_pull_request_and_without_our_card(hub):
    from families import FAMILIES

    family = FAMILIES["fox"]
    model = _model(family)
    model.push_to_hub("user/plain", token=TOKEN, model_card=False)
    main = hub.files("user/plain")
    assert "selective-rope" not in (ModelCard(main["README.md"].decode()).data.tags or [])  # transformers' card

    with torch.no_grad():
        model.lm_head.weight.add_(1)
    commit = model.push_to_hub("user/plain", token=TOKEN, create_pr=True)
    assert commit.pr_revision == "refs/pr/1" and commit.pr_url.endswith("/discussions/1")
    assert hub.files("user/plain") == main  # main untouched
    pr = hub.files("user/plain", "refs/pr/1")
    assert pr["model.safetensors"] != main["model.safetensors"]
    assert "selective-rope" in _card(hub, "user/plain", "refs/pr/1").data.tags  # the card joined the PR

    # Nothing new for transformers to upload (it makes no commit and no PR): the card alone opens the PR.
    model.push_to_hub("user/plain", token=TOKEN, model_card=False)
    commit = model.push_to_hub("user/plain", token=TOKEN, create_pr=True)
    assert commit.pr_revision == "refs/pr/2"
    assert "selective-rope" in _card(hub, "user/plain", "refs/pr/2").data.tags
    assert "selective-rope" not in (_card(hub, "user/plain").data.tags or [])


def test_save_pretrained_writes_our_card_on_request(family, tmp_path):
    model = _model(family)
    model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "README.md").exists()
    model.save_pretrained(tmp_path / "carded", model_card={"license": "mit"})
    card = ModelCard.load(tmp_path / "carded" / "README.md")
    assert card.data.license == "mit" and "selective-rope" in card.data.tags
    assert 'from_pretrained("carded")' in card.text
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "x", push_to_hub=True, model_card=True)
    with pytest.raises(TypeError, match="model_card must be"):
        model.save_pretrained(tmp_path / "y", model_card=3)


def test_a_card_naming_a_base_model_needs_its_license(family):
    """A model made from another one is under that model's license: never the apache-2.0 default."""
    model = _model(family)
    assert model.model_card("me/new").data.license == "apache-2.0"
    with pytest.raises(ValueError, match="license: a model made from 'meta-llama/Llama-3.2-1B' is under that "
                                         "model's license; name it"):
        model.model_card("me/new", base_model="meta-llama/Llama-3.2-1B")
    card = model.model_card("me/new", base_model="meta-llama/Llama-3.2-1B", license="llama3.2")
    assert (card.data.license, card.data.base_model) == ("llama3.2", "meta-llama/Llama-3.2-1B")
    assert "pip install selective-rope" not in card.text and "trust_remote_code=True" in card.text
    # what to install, without a repository to name: the distribution, not on PyPI, from a wheel or a checkout
    text = " ".join(card.text.split())
    assert "distribution `selective-rope`, import package `selective_rope`" in text
    assert "`pip install selective_rope-*.whl`, or `pip install .` in the checkout" in text
