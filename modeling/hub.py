"""Saving with code, uploading with a card: the Hub side of every selective-rope model (a mixin of the shared
``PreTrainedModel``; the architecture is in :mod:`.base`)."""

from __future__ import annotations

import importlib
import os

from huggingface_hub import HfApi, ModelCard
from transformers.dynamic_module_utils import custom_object_save

from .model_card import render_model_card, template_texts


def flat_module_name(module: str) -> str:
    """The flat file (without ``.py``) a class's module is saved as: ``selective_rope.modeling.gla`` ->
    ``modeling_gla``; a module loaded from a saved model's flat files keeps its name (``...modeling_gla``)."""
    parts = module.split(".")
    return f"{parts[1]}_{parts[2]}" if len(parts) == 3 and parts[0] == "selective_rope" else parts[-1]


def auto_map(lm_class: type, config_class: type, base_class: type) -> dict[str, str]:
    """The ``auto_map`` of ``config.json``: AutoConfig, AutoModel and AutoModelForCausalLM in the flat files."""
    def ref(cls: type) -> str:
        return f"{flat_module_name(cls.__module__)}.{cls.__name__}"

    return {"AutoConfig": ref(config_class), "AutoModel": ref(base_class), "AutoModelForCausalLM": ref(lm_class)}


def unsharded_class(cls: type) -> type:
    """``cls``, or the class FSDP2 derived ``cls`` from: ``fully_shard`` swaps a module's class for
    ``FSDP<Class>(FSDPModule, Class)``, defined in torch, which must not name the code we save."""
    original = cls.__bases__[-1]
    return original if cls.__name__ == f"FSDP{original.__name__}" else cls


class HubMixin:
    """``save_pretrained`` with the modeling code and ``auto_map``, ``push_to_hub`` with our model card, and
    ``model_card``. Mixed into a ``PreTrainedModel`` whose ``_auto_classes`` names its family's base and LM classes."""

    def _auto_classes(self) -> tuple[type, type]:
        """(base model class, causal-LM class) of this family."""
        raise NotImplementedError

    def save_pretrained(self, save_directory: str | os.PathLike, *args, is_main_process: bool = True,
                        model_card: bool | dict | ModelCard | str | None = None, **kwargs):
        """transformers' ``save_pretrained``, plus the modeling code as flat files and the ``auto_map`` naming
        AutoConfig, AutoModel and AutoModelForCausalLM, so the directory also loads with ``trust_remote_code=True``
        where ``selective_rope`` is not installed. The code is written first so ``push_to_hub=True`` uploads it.

        ``model_card``: also write this model's card as ``README.md`` (``True``: rendered from the family's template
        with the directory's name; a dict: arguments of :meth:`model_card`; a ``ModelCard`` or markdown: as given).
        Not with ``push_to_hub=True``, which uploads transformers' generic card: use :meth:`push_to_hub` instead."""
        if model_card not in (None, False) and kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained(push_to_hub=True) uploads transformers' generic model card; to upload "
                             "this model's card use model.push_to_hub(repo_id, model_card=...)")
        self.config.validate()  # transformers validates the config too, but only after the files below are written
        base_class, lm_class = self._auto_classes()
        self.config.auto_map = auto_map(lm_class, type(self.config), base_class)
        # Under tensor parallelism every rank calls save_pretrained (the shards are gathered) and transformers writes
        # on rank 0 only (5.16 on): the code and the card follow the same rule.
        writes = self.should_save_on_this_rank(is_main_process) if hasattr(self, "should_save_on_this_rank") \
            else is_main_process
        if writes:
            os.makedirs(save_directory, exist_ok=True)
            self._save_code(save_directory)
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if model_card not in (None, False) and writes:
            name = os.path.basename(os.path.normpath(os.fspath(save_directory)))
            self._resolve_card(model_card, name).save(os.path.join(save_directory, "README.md"))
        return result

    def _save_code(self, save_directory) -> None:
        """The flat modeling code of this model's family (its own modules and what they import, nothing of the other
        families). From the installed package it is written by the bundler (``remote_code``), which does not travel:
        a model loaded from flat files is saved again by transformers' ``custom_object_save``, which copies the module
        and its relative imports as they are (``save_pretrained`` calls it for models loaded through an Auto class; it
        is called here for the others)."""
        module = unsharded_class(type(self)).__module__
        if module.startswith("selective_rope."):
            model_type = self.config.model_type
            bundler = importlib.import_module(f"{__package__}.remote_code")  # not a relative import: it stays behind
            bundler.write_code_bundle(save_directory, module, templates={model_type: template_texts()[model_type]})
        elif not self.is_remote_code():
            custom_object_save(self, save_directory)

    def push_to_hub(self, repo_id: str, *, model_card: bool | dict | ModelCard | str = True, **kwargs):
        """Upload config, safetensors weights and the modeling code (transformers' ``push_to_hub``, through our
        :meth:`save_pretrained`), then this model's card as ``README.md``.

        transformers puts a generic card into its upload (or keeps the card the repository already has), so ours
        follows in a second commit to the same branch or pull request.

        Args:
            model_card: ``True`` (default): rendered from the family's template (:meth:`model_card`) for ``repo_id``;
                a dict: arguments of :meth:`model_card` (``model_name``, ``license``, ``base_model``,
                ``base_model_relation``, ``provenance``); a ``huggingface_hub.ModelCard`` or markdown text: uploaded as
                given; ``False``: only transformers' upload (the repository's existing card is kept).
            kwargs: transformers' ``push_to_hub`` arguments (``commit_message``, ``private``, ``token``,
                ``revision``, ``create_pr``, ``max_shard_size``, ``tags``; tags are added to our card too).

        Returns:
            The ``CommitInfo`` of the last commit (the card's); with ``create_pr=True``, that of the pull request
            (``pr_url``, ``pr_revision``), which received both commits.
        """
        commit = super().push_to_hub(repo_id, **kwargs)
        if model_card is False:
            return commit
        repo_id = commit.repo_url.repo_id  # as the Hub names it (namespace included)
        tags = kwargs.get("tags") or []
        card = self._resolve_card(model_card, repo_id, [*(self.model_tags or []),
                                                        *([tags] if isinstance(tags, str) else tags)])
        # With create_pr=True the card joins transformers' pull request, or opens one if transformers had nothing new
        # to upload (then it made no commit and returned the branch's head).
        card_commit = HfApi(endpoint=commit.repo_url.endpoint).upload_file(
            path_or_fileobj=str(card).encode(), path_in_repo="README.md", repo_id=repo_id,
            token=kwargs.get("token"), revision=commit.pr_revision or kwargs.get("revision"),
            create_pr=bool(kwargs.get("create_pr")) and commit.pr_revision is None,
            commit_message="Add the selective-rope model card",
        )
        return commit if commit.pr_url else card_commit

    def _resolve_card(self, model_card, repo_id: str, tags: list[str] | None = None) -> ModelCard:
        if model_card is True:
            card = self.model_card(repo_id)
        elif isinstance(model_card, dict):
            card = self.model_card(repo_id, **model_card)
        elif isinstance(model_card, ModelCard):
            card = model_card
        elif isinstance(model_card, str):
            card = ModelCard(model_card)
        else:
            raise TypeError(f"model_card must be True, False, a dict of model_card() arguments, a ModelCard or "
                            f"markdown text; got {type(model_card).__name__}")
        if tags:
            card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *tags]))
        return card

    def model_card(self, repo_id: str = "path/to/model", **card_info):
        """This model's card (a ``huggingface_hub.ModelCard``) from its family's template in ``model_cards/``.

        ``card_info``: ``model_name``, ``license`` (default ``apache-2.0``; required with ``base_model``: a model
        made from another one is under its license), ``base_model`` (a Hub id), ``base_model_relation``,
        ``provenance`` (markdown for "How it was made"). Save it with ``card.save(directory + "/README.md")``.
        """
        return render_model_card(self.config, repo_id=repo_id, num_parameters=self.num_parameters(), **card_info)


