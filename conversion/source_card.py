"""What a converted model's card says about its source: the license it carries over and the ``base_model`` it names.

A converted model is the source's weights plus a few new parameters, so it is under the source's license. The
converter reads that license from the source itself (the ``license:`` of its model card's YAML header, README.md, or
a ``license`` field of its config.json) and refuses to guess when neither names one: ``--license`` then says it.
Licenses the Hub does not know by an identifier are ``license: other`` with ``license_name`` / ``license_link``; those
travel too.

``base_model`` links the card to the source's Hub page, so it is only ever a Hub repository id: the id converted
from, or ``--base-model``. A local folder's name is not an id of anything and is never written there.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub.repocard import metadata_load
from huggingface_hub.utils import HFValidationError, validate_repo_id

LICENSE_FIELDS = ("license", "license_name", "license_link")


def source_license(directory: Path) -> dict[str, str] | None:
    """``{"license": ..., "license_name": ..., "license_link": ...}`` (the fields the source sets) from the YAML
    header of ``directory/README.md``, else from ``directory/config.json``; None when neither names a license.

    ``ValueError`` when the card's header is not valid YAML (the license cannot be read, and is not guessed).
    """
    card = directory / "README.md"
    if card.is_file():
        try:
            metadata = metadata_load(card) or {}
        except Exception as error:  # yaml's errors (multi-line: keep their one-line problem)
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ValueError(f"cannot read the license in {card}: its YAML header does not parse ({problem}); pass "
                             "--license") from None
        if metadata.get("license"):
            return {field: str(metadata[field]) for field in LICENSE_FIELDS if metadata.get(field)}
    config = directory / "config.json"
    if config.is_file():
        license = json.loads(config.read_text()).get("license")
        if license:
            return {"license": str(license)}
    return None


def check_license(license: str) -> str:
    """``license`` (an identifier the Hub knows, e.g. ``apache-2.0``, ``llama3.2``, or ``other``) as given; a
    ``ValueError`` naming it when it is empty or has whitespace (it is one YAML word in the card)."""
    if not license or license != license.strip() or any(character.isspace() for character in license):
        raise ValueError(f"--license {license!r}: expected a license identifier such as 'apache-2.0', 'mit' or "
                         "'llama3.2' (one word)")
    return license


def check_base_model(base_model: str) -> str:
    """``base_model`` when it is a Hub repository id (``name`` or ``namespace/name``); ``ValueError`` otherwise."""
    try:
        validate_repo_id(base_model)
    except HFValidationError:
        raise ValueError(f"--base-model {base_model!r}: not a Hub repository id ('namespace/name'); base_model "
                         "names the source's Hub repository, not a local path") from None
    return base_model
