"""The modeling code that travels with a saved model, so it loads with ``trust_remote_code=True`` anywhere.

transformers loads remote code from *flat* files next to ``config.json`` and follows only ``from .name import``
between them. Our code lives in packages (``configuration/fox.py`` imports ``..kernels.y``), so ``save_pretrained``
writes a flat copy: ``<package>/<module>.py`` becomes ``<package>_<module>.py`` (``modeling_fox.py``,
``configuration_fox.py``, ``kernels_gla_torch.py``) with its relative imports rewritten to match. Only the modules
the family's model module reaches are written (a GLA model carries no FoX or Gated DeltaNet code), and they import
nothing but themselves and installed libraries.

This module does not travel: a model loaded from such a bundle is saved again by transformers' ``custom_object_save``
(see ``hub.HubMixin._save_code``), which copies the flat files and their relative imports as they are.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# `from .x import` / `from ..pkg.mod import` at any indentation (transformers follows indented ones too).
_RELATIVE_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.+)(?P<target>[\w.]*)[ \t]+import", re.M)
CARD_MODULE = "modeling_model_card"  # the flat module that reads BUNDLED_TEMPLATES


def _resolve(package: str, dots: int, target: str, source: str) -> tuple[str, str]:
    """(package, module) that ``from <dots><target> import`` in ``package`` refers to."""
    parts = target.split(".") if target else []
    if dots == 1 and len(parts) == 1:
        return package, parts[0]
    if dots == 2 and len(parts) == 2:
        return parts[0], parts[1]
    raise ValueError(f"{source}: relative import {'.' * dots}{target} must name a module (`.module` or "
                     "`..package.module`) for the remote-code bundle")


def _source_path(package: str, module: str) -> Path:
    """The source file of a module, found through the import system (pyproject maps each ``selective_rope.<package>``
    onto a repository folder, which an installed wheel copies and an editable install points at)."""
    return Path(importlib.util.find_spec(f"selective_rope.{package}.{module}").origin)


def code_bundle(model_module: str, templates: dict[str, str] | None = None) -> dict[str, str]:
    """``{file name: source}`` of the flat copy of ``model_module`` (``selective_rope.<package>.<module>``) and every
    module it imports relatively.

    ``templates`` (``{model_type: model-card template text}``) are assigned to ``BUNDLED_TEMPLATES`` at the end of the
    flat ``modeling_model_card.py`` (if it is part of the bundle), since only ``.py`` files travel.
    """
    root, package, module = model_module.split(".")
    if root != "selective_rope":
        raise ValueError(f"code_bundle flattens the selective_rope package's modules, not {model_module!r}")
    bundle: dict[str, str] = {}
    pending = [(package, module)]
    while pending:
        package, module = pending.pop()
        name = f"{package}_{module}"
        if f"{name}.py" in bundle:
            continue
        path = _source_path(package, module)
        source = path.read_text()

        def rewrite(match: re.Match, package=package, path=path) -> str:
            target = _resolve(package, len(match["dots"]), match["target"], str(path))
            pending.append(target)
            return f"{match['indent']}from .{target[0]}_{target[1]} import"

        source = _RELATIVE_IMPORT.sub(rewrite, source)
        if name == CARD_MODULE and templates is not None:
            source += ("\n\n# The model-card templates, bundled with the code (only .py files travel).\n"
                       f"BUNDLED_TEMPLATES = {templates!r}\n")
        bundle[f"{name}.py"] = source
    return bundle


def write_code_bundle(directory: str | Path, model_module: str, templates: dict[str, str] | None = None) -> list[str]:
    """Write the flat bundle into ``directory``; returns the file names written."""
    bundle = code_bundle(model_module, templates)
    for name, source in bundle.items():
        (Path(directory) / name).write_text(source)
    return sorted(bundle)
