"""The modeling code that travels with a saved model, so it loads with ``trust_remote_code=True`` anywhere.

transformers loads remote code from *flat* files next to ``config.json`` and follows only ``from .name import``
between them. Our code lives in packages (``configuration/fox.py`` imports ``..kernels.y``), so ``save_pretrained``
writes a flat copy: ``<package>/<module>.py`` becomes ``<package>_<module>.py`` (``modeling_fox.py``,
``configuration_fox.py``, ``kernels_gla_torch.py``) with its relative imports rewritten to match. Only the modules
the family's model module reaches are written, and they import nothing but themselves and installed libraries.

A model loaded from such a bundle saves again from its own flat files (their imports are already flat).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

# `from .x import` / `from ..pkg.mod import` at any indentation (transformers follows indented ones too).
_RELATIVE_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.+)(?P<target>[\w.]*)[ \t]+import", re.M)
# Filled in by `code_bundle` in the flat copy of modeling/model_card.py: templates do not travel as files.
TEMPLATES_PLACEHOLDER = "BUNDLED_TEMPLATES: dict[str, str] | None = None"


def _flat_name(package: str | None, module: str) -> str:
    return module if package is None else f"{package}_{module}"


def _resolve(package: str | None, dots: int, target: str, source: str) -> tuple[str | None, str]:
    """(package, module) that ``from <dots><target> import`` in ``package`` refers to."""
    if package is None:  # already flat: `.name` is a sibling file
        if dots != 1 or "." in target:
            raise ValueError(f"{source}: unexpected relative import {'.' * dots}{target} in a flat bundle")
        return None, target
    parts = target.split(".") if target else []
    if dots == 1 and len(parts) == 1:
        return package, parts[0]
    if dots == 2 and len(parts) == 2:
        return parts[0], parts[1]
    raise ValueError(f"{source}: relative import {'.' * dots}{target} must name a module (`.module` or "
                     "`..package.module`) for the remote-code bundle")


def _module_location(model_module: str) -> tuple[Path | None, str | None, str]:
    """(directory, package, module) of an imported module: packaged (``selective_rope.modeling.fox`` -> ``(None,
    "modeling", "fox")``) or a flat bundle's file (``(its directory, None, "modeling_fox")``)."""
    parts = model_module.split(".")
    if len(parts) == 3 and parts[0] == "selective_rope":
        return None, parts[1], parts[2]
    return Path(sys.modules[model_module].__file__).parent, None, parts[-1]


def _source_path(directory: Path | None, package: str | None, module: str) -> Path:
    """The source file of a module: found through the import system for the package (pyproject maps each
    ``selective_rope.<package>`` onto a repository folder, which an installed wheel copies and an editable install
    points at), next to the others in a flat bundle."""
    if package is None:
        return directory / f"{module}.py"
    return Path(importlib.util.find_spec(f"selective_rope.{package}.{module}").origin)


def code_bundle(model_module: str, extra_files: dict[str, str] | None = None) -> dict[str, str]:
    """``{file name: source}`` of the flat copy of ``model_module`` and every module it imports relatively.

    ``extra_files`` maps model-card template names to their text; they are embedded into the flat
    ``modeling_model_card.py`` (if it is part of the bundle) since only ``.py`` files travel.
    """
    directory, package, module = _module_location(model_module)
    bundle: dict[str, str] = {}
    pending = [(package, module)]
    while pending:
        package, module = pending.pop()
        name = _flat_name(package, module)
        if f"{name}.py" in bundle:
            continue
        path = _source_path(directory, package, module)
        source = path.read_text()

        def rewrite(match: re.Match, package=package, path=path) -> str:
            target = _resolve(package, len(match["dots"]), match["target"], str(path))
            pending.append(target)
            return f"{match['indent']}from .{_flat_name(*target)} import"

        source = _RELATIVE_IMPORT.sub(rewrite, source)
        if name == "modeling_model_card" and extra_files is not None:
            bundled = TEMPLATES_PLACEHOLDER.replace("None = None", f"None = {extra_files!r}")
            source = source.replace(TEMPLATES_PLACEHOLDER, bundled)
        bundle[f"{name}.py"] = source
    return bundle


def bundle_auto_map(model_class: type, config_class: type, base_model_class: type) -> dict[str, str]:
    """The ``auto_map`` entries of ``config.json`` for the flat bundle of ``model_class``'s module."""

    def ref(cls: type) -> str:
        _, package, module = _module_location(cls.__module__)
        return f"{_flat_name(package, module)}.{cls.__name__}"

    return {"AutoConfig": ref(config_class), "AutoModel": ref(base_model_class),
            "AutoModelForCausalLM": ref(model_class)}


def write_code_bundle(directory: str | Path, model_module: str, extra_files: dict[str, str] | None = None) -> list[str]:
    """Write the flat bundle into ``directory``; returns the file names written."""
    bundle = code_bundle(model_module, extra_files)
    for name, source in bundle.items():
        (Path(directory) / name).write_text(source)
    return sorted(bundle)
