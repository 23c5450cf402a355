"""transformers' own common model tests, taken from the installed version's source distribution at test time.

``pip download transformers==<installed> --no-binary :all: --no-deps`` gives the sdist, whose ``tests/`` folder holds
``test_modeling_common.py`` (``ModelTesterMixin``) and ``test_configuration_common.py`` (``ConfigTester``). They are
extracted, unmodified, into ``.cache/transformers-tests/<version>/`` at the repository root (git-ignored; reused by
later runs, deleted by nobody but the user) and imported as the package ``transformers_tests``. Nothing of
transformers' code is copied into this repository.

The sdist does not ship every module those two files import (checked for 5.10.1 and 5.24.0): ``tests/generation/``,
``tests/exporters/``, ``tests/utils/`` and ``tests/causal_lm_tester.py`` are missing. What the two files import from
them is provided here (``SHIMS``), each said plainly:

- ``generation.test_utils.GenerationTesterMixin``: our own generation checks (``generation_checks.py``), the suite's
  stand-in for transformers' (the mixin asserts that a tester of a model that can generate inherits it);
- ``exporters.test_export.ExportTesterMixin``: an empty mixin, so the ``torch.export`` tests are not run;
- ``utils.test_configuration_utils.config_common_kwargs``: a non-default value for each attribute every
  ``PreTrainedConfig`` takes (``COMMON_CONFIG_KWARGS``), which ``ConfigTester`` checks the config keeps.

``ModelTesterMixin`` finds base models and causal-LM heads by class name in transformers' static tables
(``MODEL_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``); ``register_names`` adds ours (``AutoModel.register``
does not reach those tables).
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "transformers-tests"
PACKAGE = "transformers_tests"
# What the suite takes from the sdist's tests/ folder: the two modules and everything they import that it ships.
FILES = ("test_modeling_common.py", "test_configuration_common.py")

# ConfigTester.check_config_arguments_init builds a config with these and checks that each is kept: one non-default
# value for each attribute every PreTrainedConfig takes (not a copy of transformers' list: its file is not shipped).
COMMON_CONFIG_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["SelectiveRopeConformanceModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}


def version_dir(version: str = transformers.__version__) -> Path:
    """``.cache/transformers-tests/<version>``, holding ``transformers_tests/`` once fetched."""
    return CACHE / version


def fetch(version: str = transformers.__version__) -> Path:
    """The extracted ``transformers_tests`` package of ``version``, downloading the sdist on first use.

    Writes only inside ``version_dir(version)``: the sdist goes into its ``download/`` folder, the files into a
    temporary folder renamed into place once complete (an interrupted run leaves no half package)."""
    target = version_dir(version)
    package = target / PACKAGE
    if (package / "__init__.py").exists():
        return package
    download = target / "download"
    download.mkdir(parents=True, exist_ok=True)
    sdist = download / f"transformers-{version}.tar.gz"
    if not sdist.exists():
        command = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                   "--no-deps", "--quiet", "--dest", str(download)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not sdist.exists():
            raise RuntimeError(f"could not download the transformers {version} sdist ({' '.join(command)}): "
                               f"{result.stderr.strip().splitlines()[-1:] or result.returncode}")
    partial = target / f"{PACKAGE}.partial"
    if partial.exists():  # left by an interrupted run of ours: only extracted files in it
        for path in sorted(partial.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        partial.rmdir()
    partial.mkdir()
    with tarfile.open(sdist) as archive:
        for name in FILES:
            member = archive.getmember(f"transformers-{version}/tests/{name}")
            (partial / name).write_bytes(archive.extractfile(member).read())
    (partial / "__init__.py").write_text(f'"""tests/ of the transformers {version} sdist (unmodified)."""\n')
    partial.rename(package)
    return package


def _shim(name: str, **attributes) -> None:
    """Register ``transformers_tests.<name>`` (and its parent packages) holding ``attributes``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        full = ".".join([PACKAGE, *parts[:i]])
        if full not in sys.modules:
            module = types.ModuleType(full, "provided by tests/conformance/upstream.py (not in the sdist)")
            module.__path__ = []  # a package, so submodules resolve
            sys.modules[full] = module
    sys.modules[f"{PACKAGE}.{name}"].__dict__.update(attributes)


def load(generation_mixin: type) -> types.SimpleNamespace:
    """Import the sdist's common tests (fetched if needed) with the shims above: ``ModelTesterMixin``,
    ``ConfigTester`` and the module ``test_modeling_common`` itself."""
    package = fetch()
    _probe_kernels_package()
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
        _shim("generation.test_utils", GenerationTesterMixin=generation_mixin)
        _shim("exporters.test_export", ExportTesterMixin=type("ExportTesterMixin", (), {}))
        _shim("utils.test_configuration_utils", config_common_kwargs=COMMON_CONFIG_KWARGS)
    modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    return types.SimpleNamespace(ModelTesterMixin=modeling.ModelTesterMixin, ConfigTester=configuration.ConfigTester,
                                 test_modeling_common=modeling)


def _probe_kernels_package() -> None:
    """Ask transformers once, with our source folders out of sight, whether the ``kernels`` package is installed.

    ``python -m pytest`` puts the working directory (the repository root, holding our ``kernels/``) on ``sys.path``
    and pytest puts ``tests/`` there (holding ``tests/kernels/``); transformers 5.10's ``integrations.hub_kernels``
    then even imports our folder as the module ``kernels`` (its ``from kernels import ...`` fails and is caught, the
    module stays). Its ``is_kernels_available()``, which the mixin's ``@require_kernels`` calls at import, takes that
    for the ``kernels`` package and fails on its version ("N/A"). The answer is cached (``lru_cache``), so the mixin
    then reads the true one. ``sys.path`` and ``sys.modules`` are restored as found."""
    from transformers.utils import import_utils

    ours = {ROOT, ROOT / "tests", ROOT / "tests" / "conformance"}
    shadow = sys.modules.get("kernels")
    shadowed = shadow is not None and ROOT in Path(getattr(shadow, "__file__", None) or "/").resolve().parents
    saved = sys.path[:]
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() not in ours]
    if shadowed:
        del sys.modules["kernels"]
    try:
        import_utils.is_kernels_available()
    finally:
        sys.path[:] = saved
        if shadowed:
            sys.modules["kernels"] = shadow


def register_names(model_type: str, model_class: type, lm_class: type) -> None:
    """Add a family's classes to the static name tables the mixin reads (transformers' auto mappings)."""
    from transformers.models.auto import modeling_auto

    modeling_auto.MODEL_MAPPING_NAMES.setdefault(model_type, model_class.__name__)
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(model_type, lm_class.__name__)
