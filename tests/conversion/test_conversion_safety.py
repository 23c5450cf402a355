"""`selective-rope convert` never loses data and always ends in one line: OUTPUT apart from SOURCE, publishing that
never replaces unless asked, signals and kills sent to a real process, full and read-only filesystems, corrupt
sources, bad numbers."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_conversion import earlier_model, leftovers, llama_source, tree

from selective_rope.cli import main as cli_main
from selective_rope.conversion import ConversionError, RetrofitOptions, convert

convert_module = importlib.import_module("selective_rope.conversion.convert")
output_module = importlib.import_module("selective_rope.conversion.output")


def cli_error(*args: str) -> str:
    """Run `selective-rope convert ARGS` expecting failure; its one-line message."""
    with pytest.raises(SystemExit) as exit:
        cli_main(["convert", *args, "--no-progress"])
    message = exit.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith("selective-rope convert: ")
    return message


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("source") / "llama"
    llama_source(directory, "llama")
    return directory


@pytest.fixture(params=["renameat2", "fallback"])
def publishing(request, monkeypatch):
    """Both ways of publishing: Linux's renameat2 (no-replace rename, atomic exchange) and the portable fallback."""
    if request.param == "renameat2" and output_module._renameat2 is None:
        pytest.skip("renameat2 is not available here")
    if request.param == "fallback":
        monkeypatch.setattr(output_module, "_renameat2", None)
    return request.param


# ---------------------------------------------------------------------------------------------- case 1: apart


@pytest.mark.parametrize("where", ["parent", "same", "inside", "symlink-to-source", "inside-via-symlink"])
def test_an_output_overlapping_the_source_is_refused_before_anything_is_written(where, tmp_path):
    models = tmp_path / "models"
    llama_source(models / "llama", "llama")
    (models / "other-project").mkdir()
    (models / "other-project" / "notes.txt").write_text("unrelated work")
    (tmp_path / "link").symlink_to(models / "llama")
    before = tree(tmp_path)
    output = {"parent": models, "same": models / "llama", "inside": models / "llama" / "converted",
              "symlink-to-source": tmp_path / "link", "inside-via-symlink": tmp_path / "link" / "converted"}[where]
    relation = {"parent": "contains", "same": "is", "inside": "lies inside", "symlink-to-source": "is",
                "inside-via-symlink": "lies inside"}[where]

    message = cli_error(str(models / "llama"), str(output), "--overwrite")
    assert f"OUTPUT {output} {relation} the source {models / 'llama'}" in message
    assert tree(tmp_path) == before  # the source, the unrelated sibling: all there, nothing added
    with pytest.raises(ValueError, match=f"OUTPUT .* {relation} the source"):
        convert(models / "llama", output, overwrite=True, progress=False)
    assert tree(tmp_path) == before


def test_an_output_holding_a_file_the_source_reads_is_refused(tmp_path):
    """The source's files may be symlinks (a Hub snapshot's point into the cache's blobs/): their folder is off
    limits too."""
    llama_source(tmp_path / "store", "llama")
    (tmp_path / "source").mkdir()
    for file in (tmp_path / "store").iterdir():
        (tmp_path / "source" / file.name).symlink_to(file)
    before = tree(tmp_path)
    message = cli_error(str(tmp_path / "source"), str(tmp_path / "store"), "--overwrite")
    store = tmp_path / "store"
    assert f"OUTPUT {store} contains {os.path.realpath(store)}/" in message and "which the source" in message
    assert tree(tmp_path) == before


REAL_ALIASES = """
import json, subprocess, sys
from pathlib import Path
from selective_rope.cli import main

models, alias, data, out = map(Path, sys.argv[1:5])
mount = lambda *args: subprocess.run(["mount", "--bind", *map(str, args)], check=True)
mount(models, alias)  # the same folder at a second path, as a container volume or a second mount would be
mount(data, out)  # OUTPUT is itself a mount point
results = {}
for output in [alias / "llama", alias, alias / "llama" / "converted", out]:
    try:
        main(["convert", str(models / "llama"), str(output), "--overwrite", "--no-progress"])
        results[str(output)] = "converted"
    except SystemExit as exit:
        results[str(output)] = exit.code
print(json.dumps(results))
"""


def test_overwrite_never_replaces_the_source_seen_through_a_bind_mount_or_a_link(source, tmp_path):
    """SOURCE reached by another path: a real bind mount of its parent (``unshare -Urm``, a private mount
    namespace) and a symlink. Paths differ, identities do not: each is refused, and nothing is touched."""
    models, alias, data, out = (tmp_path / name for name in ("models", "alias", "data", "out"))
    shutil.copytree(source, models / "llama")
    (tmp_path / "link").symlink_to(models)
    earlier_model(data)
    for folder in (alias, out):
        folder.mkdir()
    before = tree(tmp_path)
    for output, relation in [(tmp_path / "link" / "llama", "is"), (tmp_path / "link", "contains"),
                             (tmp_path / "link" / "llama" / "converted", "lies inside")]:
        assert cli_error(str(models / "llama"), str(output), "--overwrite") == (
            f"selective-rope convert: OUTPUT {output} {relation} the source {models / 'llama'}: write the converted "
            "model somewhere else (OUTPUT must not be, contain or lie inside SOURCE)")
    assert tree(tmp_path) == before
    if not _can_mount_tmpfs(alias):
        pytest.skip("cannot mount in a user namespace here (the symlinked alias above still ran)")
    script = tmp_path / "aliases.py"
    script.write_text(REAL_ALIASES)
    before = tree(tmp_path)
    run = subprocess.run(["unshare", "-Urm", sys.executable, str(script), *map(str, (models, alias, data, out))],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    source_line = f"the source {models / 'llama'}: write the converted model somewhere else (OUTPUT must not be, " \
                  "contain or lie inside SOURCE)"
    assert results == {
        str(alias / "llama"): f"selective-rope convert: OUTPUT {alias / 'llama'} is {source_line}",
        str(alias): f"selective-rope convert: OUTPUT {alias} contains {source_line}",
        str(alias / "llama" / "converted"): f"selective-rope convert: OUTPUT {alias / 'llama' / 'converted'} lies "
                                            f"inside {source_line}",
        str(out): f"selective-rope convert: OUTPUT {out} is a mount point: --overwrite would delete what is mounted "
                  "there; choose another OUTPUT"}
    assert tree(tmp_path) == before


FIFO_SOURCES = """
import json, os, shutil, sys
from pathlib import Path
from safetensors import safe_open
from selective_rope.cli import main

source, work = map(Path, sys.argv[1:3])
results = {}
for name in ["config.json", "model.safetensors", "tokenizer.json", "shards/model-00001-of-00001.safetensors",
             "notes.fifo"]:
    copy, output = work / "source", work / "out"
    shutil.copytree(source, copy)
    if name.startswith("shards/"):  # a sharded source whose index names a FIFO in a subfolder
        with safe_open(copy / "model.safetensors", "pt") as weights:
            index = {"metadata": {}, "weight_map": dict.fromkeys(weights.keys(), name)}
        (copy / "model.safetensors.index.json").write_text(json.dumps(index))
        (copy / "model.safetensors").unlink()
        (copy / "shards").mkdir()
    (copy / name).unlink(missing_ok=True)
    os.mkfifo(copy / name)
    try:
        main(["convert", str(copy), str(output), "--no-progress"])
        results[name] = "converted"
    except SystemExit as exit:
        results[name] = exit.code
    shutil.rmtree(copy)
    shutil.rmtree(output, ignore_errors=True)
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_the_source_never_hangs_the_command(source, tmp_path):
    """A real FIFO (``os.mkfifo``) in the source folder, in a child process with a time limit, so that a regression
    fails instead of hanging: in a model file's place it is refused by name before anything is opened (reading it
    would wait for a writer forever); anywhere else it is never opened."""
    script = tmp_path / "fifo.py"
    script.write_text(FIFO_SOURCES)
    (tmp_path / "work").mkdir()
    run = subprocess.run([sys.executable, str(script), str(source), str(tmp_path / "work")], capture_output=True,
                         text=True, timeout=300)  # killed (and the test failed) should it hang
    assert run.returncode == 0, run.stderr
    fifo = "is a FIFO, not a regular file: convert reads only regular files"
    work = tmp_path / "work" / "source"
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        **{name: f"selective-rope convert: {work / name} {fifo}"
           for name in ["config.json", "model.safetensors", "tokenizer.json",
                        "shards/model-00001-of-00001.safetensors"]},
        "notes.fifo": "converted"}
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == []


# -------------------------------------------------------------------------------------------- case 2: publish


@pytest.mark.parametrize("appears", ["directory", "empty directory", "file"])
def test_an_output_that_appears_while_converting_is_never_replaced(appears, publishing, source, tmp_path,
                                                                   monkeypatch):
    output = tmp_path / "out"
    real_save = convert_module.save_file

    def save_while_someone_creates_output(*args, **kwargs):
        real_save(*args, **kwargs)
        if appears == "file":
            output.write_text("theirs")
        else:
            output.mkdir()
            if appears == "directory":
                (output / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(convert_module, "save_file", save_while_someone_creates_output)
    with pytest.raises(FileExistsError, match="appeared while converting and was left as it is"):
        convert(source, output, progress=False)
    if appears == "file":
        assert output.read_text() == "theirs"
    else:  # POSIX rename would replace an empty directory: the fallback must not
        assert [(p.name, p.read_text()) for p in output.iterdir()] == ([("theirs.txt", "theirs")]
                                                                      if appears == "directory" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("existing", ["earlier model", "empty folder"])
def test_overwrite_replaces_output_and_leaves_nothing_else(existing, publishing, source, tmp_path):
    output = tmp_path / "out"
    output.mkdir()
    if existing == "earlier model":
        earlier_model(output)
    convert(source, output, overwrite=True, progress=False)
    assert output.is_dir() and json.loads((output / "config.json").read_text())["model_type"] == "selective_rope_fox"
    assert (output / "model.safetensors").read_bytes() != b"the previous model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no .partial-*, no .replaced-*


NOT_OURS = ("; it only replaces a folder this tool could have written (a config.json with a model_type and model "
            "files, no subfolders): choose another OUTPUT, or remove them yourself")


def _project(output: Path) -> None:  # someone's project that happens to hold a config.json
    (output / "app" / ".git").mkdir(parents=True)
    (output / "config.json").write_text('{"debug": true}')
    (output / "app" / "main.py").write_text("print('hello')")
    (output / "app" / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (output / "notes.txt").write_text("my notes")


def _training_run(output: Path) -> None:  # a Trainer's output_dir: a real model config, and much more
    earlier_model(output)
    (output / "checkpoint-1000").mkdir()
    (output / "checkpoint-1000" / "optimizer.pt").write_bytes(b"optimizer state")
    (output / "trainer_state.json").write_text("{}")
    (output / "training_args.bin").write_bytes(b"args")


@pytest.mark.parametrize("existing, what", [
    ("project", "is not a model folder (a config.json with no model_type): --overwrite would delete app/, "
                "config.json, notes.txt" + NOT_OURS),
    ("training run", "is not a model folder (it holds more than model files): --overwrite would delete "
                     "checkpoint-1000/, trainer_state.json, training_args.bin" + NOT_OURS),
    ("model and a subfolder", "is not a model folder (it holds more than model files): --overwrite would delete "
                              "original/" + NOT_OURS),
    ("model and a FIFO", "is not a model folder (it holds more than model files): --overwrite would delete "
                         "tokenizer.json" + NOT_OURS),
    ("file", "is a file, not a model folder: --overwrite only replaces a model folder; choose another OUTPUT, or "
             "remove it yourself"),
    ("symlink", "is a symlink, not a model folder: --overwrite only replaces a model folder; choose another "
                "OUTPUT, or remove it yourself")], ids=lambda value: value if len(value) < 30 else "")
def test_overwrite_refuses_what_this_tool_could_not_have_written(existing, what, source, tmp_path):
    """A config.json is no proof of a model folder: a project, a training run, anything with a subfolder or a file
    that is not a model file is refused whole, naming what would have been deleted; so is a file or a link."""
    output = tmp_path / "out"
    if existing in ("file", "symlink"):
        (tmp_path / "elsewhere").mkdir()
        earlier_model(tmp_path / "elsewhere")
        output.write_text("mine") if existing == "file" else output.symlink_to(tmp_path / "elsewhere")
    else:
        output.mkdir()
        {"project": _project, "training run": _training_run}.get(existing, earlier_model)(output)
        if existing == "model and a subfolder":
            (output / "original").mkdir()
            (output / "original" / "consolidated.00.pth").write_bytes(b"the original weights")
        elif existing == "model and a FIFO":
            os.mkfifo(output / "tokenizer.json")  # a model file's name, but no file we write
    before = tree(tmp_path)
    assert cli_error(str(source), str(output), "--overwrite") == f"selective-rope convert: OUTPUT {output} {what}"
    with pytest.raises(ValueError) as refused:
        convert(source, output, overwrite=True, progress=False)
    assert str(refused.value) == f"OUTPUT {output} {what}"
    assert tree(tmp_path) == before  # nothing deleted, nothing left behind


def test_a_folder_this_tool_wrote_is_replaced(source, tmp_path):
    """A genuine earlier output of convert, and a transformers save_pretrained folder with tokenizer files, are
    model folders: --overwrite replaces them."""
    output, saved = tmp_path / "out", tmp_path / "saved"
    convert(source, output, progress=False)
    earlier = tree(output)
    convert(source, output, RetrofitOptions(seed=1), overwrite=True, progress=False)  # other starting factors
    assert tree(output) != earlier and tree(output).keys() == earlier.keys()
    shutil.copytree(source, saved)
    (saved / "tokenizer.json").write_text("{}")
    (saved / "tokenizer_config.json").write_text("{}")
    convert(source, saved, overwrite=True, progress=False)
    assert json.loads((saved / "config.json").read_text())["model_type"] == "selective_rope_fox"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "saved"]


def test_files_added_to_output_while_converting_are_never_deleted(publishing, source, tmp_path, monkeypatch):
    """OUTPUT is checked again right before it is replaced: a file someone put into it meanwhile keeps it."""
    output = tmp_path / "out"
    earlier_model(output)
    real_save = convert_module.save_file

    def save_while_someone_writes_into_output(*args, **kwargs):
        real_save(*args, **kwargs)
        (output / "notes.txt").write_text("mine")

    monkeypatch.setattr(convert_module, "save_file", save_while_someone_writes_into_output)
    with pytest.raises(ValueError, match=f"OUTPUT {output} is not a model folder .* would delete notes.txt;"):
        convert(source, output, overwrite=True, progress=False)
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("name", ["x" * 255, "ü" * 127 + "x"], ids=["ascii", "two-byte"])  # 255 bytes: legal
def test_an_output_name_of_255_bytes_works(name, source, tmp_path, caplog):
    """The staging folder's name adds 26 bytes to OUTPUT's: a long name is cut short and a digest of the whole added,
    so it fits NAME_MAX, and the next run still finds a killed run's partial by it."""
    output = tmp_path / name
    assert len(os.fsencode(output.name)) == 255
    convert(source, output, progress=False)
    dead = tmp_path / f"{output_module.partial_prefix(name)}.partial-{'0' * 16}"  # as a SIGKILLed run leaves it
    (dead / "model").mkdir(parents=True)
    (dead / output_module.MARKER).write_text(json.dumps({"tool": output_module.TOOL}))
    with caplog.at_level(logging.WARNING, logger=output_module.__name__):
        convert(source, output, RetrofitOptions(seed=1), overwrite=True, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == output_module.__name__] == [
        f"removed {dead}: the partial output of an interrupted conversion (no running conversion holds its lock)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_staging_names_fit_and_stay_one_per_output():
    """Every OUTPUT name up to 255 bytes gets a staging name within 255 bytes; short names keep the plain
    ``.<name>.partial-`` form; long names that differ only at the end get different ones."""
    for character in ("x", "ü", "字"):
        for length in range(1, 256 // len(character.encode()) + 1):
            staging = f"{output_module.partial_prefix(character * length)}.partial-{'0' * 16}"
            assert len(staging.encode()) <= 255
    assert output_module.partial_prefix("out") == ".out"
    assert output_module.partial_prefix("x" * 254 + "a") != output_module.partial_prefix("x" * 254 + "b")


def test_a_failed_run_removes_the_folders_it_created_and_only_those(source, tmp_path):
    (tmp_path / "existing").mkdir()
    output = tmp_path / "existing" / "new" / "deeper" / "out"
    failing = RetrofitOptions(forget_gate_bias=0.0)  # forgets half of everything per token: the probe fails
    with pytest.raises(ConversionError, match="does not reproduce the source"):
        convert(source, output, failing, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert list((tmp_path / "existing").iterdir()) == []


# ---------------------------------------------------------------------------------------- case 4: one line


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_a_broken_source_shard_is_named(damage, tmp_path):
    from transformers import LlamaForCausalLM

    llama_source(tmp_path / "whole", "llama")
    LlamaForCausalLM.from_pretrained(tmp_path / "whole").save_pretrained(tmp_path / "source", max_shard_size="50KB")
    index = json.loads((tmp_path / "source" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "source" / sorted(set(index["weight_map"].values()))[-1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "garbage":
        shard.write_bytes(b"this is not a safetensors file")
    else:
        shard.unlink()
    message = cli_error(str(tmp_path / "source"), str(tmp_path / "out"), "--license", "apache-2.0")
    assert str(shard) in message
    assert ("No such file" in message) if damage == "missing" else ("not a valid safetensors file" in message)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", ["full disk at a shard", "full disk at a shard, safetensors 0.4",
                                     "read-only at a shard", "full disk at a code file"])
def test_write_failures_are_one_line_and_keep_the_old_output(failure, source, tmp_path, monkeypatch):
    """An injected write failure; the real thing (a small tmpfs) is in the next test, where the machine allows."""
    if "at a shard" in failure:  # safetensors reports I/O failures as its own error type, the errno in the message
        code = 28 if failure.startswith("full") else 30
        detail = (f"IoError(Os {{ code: {code}, kind: StorageFull, message: \"{os.strerror(code)}\" }})"
                  if failure.endswith("0.4") else f"I/O error: {os.strerror(code)} (os error {code})")

        def failing_save(tensors, path, metadata=None):
            Path(path).write_bytes(b"half a shard")
            raise SafetensorError(f"Error while serializing: {detail}")

        monkeypatch.setattr(convert_module, "save_file", failing_save)
    else:
        code = 28

        def failing_bundle(directory, *args, **kwargs):
            (directory / "modeling_fox.py").write_text("# half")
            raise OSError(code, os.strerror(code))  # shutil's sendfile copy raises it naming no file

        monkeypatch.setattr(convert_module, "write_code_bundle", failing_bundle)
    output = tmp_path / "out"
    earlier_model(output)
    before = tree(tmp_path)
    message = cli_error(str(source), str(output), "--overwrite")
    assert message == (f"selective-rope convert: cannot write {output}: {os.strerror(code)}; the existing {output} "
                       "is unchanged")
    assert tree(tmp_path) == before
    message = cli_error(str(source), str(tmp_path / "new" / "out"))
    assert message.endswith(f"{os.strerror(code)}; nothing was left behind")
    assert tree(tmp_path) == before


REAL_FILESYSTEM = """
import json, os, shutil, subprocess, sys
from pathlib import Path
from selective_rope.cli import main

source, old, mount = map(Path, sys.argv[1:4])

def run(*args):
    try:
        main(["convert", str(source), *map(str, args), "--no-progress"])
    except SystemExit as exit:
        return exit.code
    return 0

def tree(root):
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else " " + p.read_bytes().hex()[:64])
                  for p in root.rglob("*"))

mount_ = lambda *options: subprocess.run(["mount", *options], check=True)
mount_("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount))
shutil.copytree(old, mount / "out")
stats = os.statvfs(mount)
used_kb = (stats.f_blocks - stats.f_bfree) * stats.f_frsize // 1024
mount_("-o", f"remount,size={used_kb + 48}k", str(mount))  # room for less than one weights file
results = {"old": tree(mount / "out"), "full": run(mount / "out", "--overwrite"), "after_full": tree(mount),
           "full_new": run(mount / "made" / "here"), "after_full_new": tree(mount)}
mount_("-o", "remount,ro", str(mount))
results.update(read_only=run(mount / "new" / "out"), read_only_overwrite=run(mount / "out", "--overwrite"),
               after_read_only=tree(mount))
print(json.dumps(results))
"""


def _can_mount_tmpfs(directory: Path) -> bool:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = subprocess.run(["unshare", "-Urm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
                           capture_output=True)
    return probe.returncode == 0


def test_a_real_full_and_read_only_filesystem(source, tmp_path):
    """A small tmpfs in a private mount namespace (``unshare -Urm``): a full disk keeps the old OUTPUT and removes
    the folders the run made; a read-only one fails at once; each ends in one line."""
    mount = tmp_path / "mount"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs in a user namespace here (the injected failures above still run)")
    convert(source, tmp_path / "old", progress=False)
    script = tmp_path / "real_filesystem.py"
    script.write_text(REAL_FILESYSTEM)
    run = subprocess.run(["unshare", "-Urm", sys.executable, str(script), str(source), str(tmp_path / "old"),
                          str(mount)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    old_listing = results["old"]
    assert results["full"] == (f"selective-rope convert: cannot write {mount / 'out'}: No space left on device; "
                               f"the existing {mount / 'out'} is unchanged")
    assert results["after_full"] == ["out/"] + [f"out/{line}" for line in old_listing]
    assert results["full_new"] == (f"selective-rope convert: cannot write {mount / 'made' / 'here'}: No space left "
                                   "on device; nothing was left behind")
    assert results["after_full_new"] == results["after_full"]  # made/ is gone again
    assert results["read_only"] == (f"selective-rope convert: cannot write {mount / 'new' / 'out'}: Read-only file "
                                    "system; nothing was left behind")
    assert results["read_only_overwrite"].endswith(f"Read-only file system; the existing {mount / 'out'} is "
                                                   "unchanged")
    assert results["after_read_only"] == results["after_full"]


def test_bad_numbers_are_refused_by_the_command_and_the_api(source, tmp_path, capsys):
    for option, value, message in [("--forget-gate-bias", "inf", "inf must be a finite number"),
                                   ("--forget-gate-bias", "nan", "nan must be a finite number"),
                                   ("--tolerance", "nan", "nan must be a finite number"),
                                   ("--tolerance", "-1", "-1 must be >= 0"),
                                   ("--tolerance", "x", "'x' is not a number"),
                                   ("--max-shard-size", "0", "max shard size '0' is invalid: must be at least 1 byte"),
                                   ("--max-shard-size", "0.5B", "max shard size '0.5B' is invalid: must be at least "
                                                                "1 byte"),
                                   ("--max-shard-size", "5XB", "max shard size '5XB': expected bytes or a size such "
                                                               "as '5GB' or '500MB'")]:
        with pytest.raises(SystemExit) as exit:
            cli_main(["convert", str(source), str(tmp_path / "out"), option, value])
        assert exit.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (f"selective-rope convert: error: argument "
                                                                     f"{option}: {message}")
    for tolerance in (math.nan, -1.0, math.inf):
        with pytest.raises(ValueError, match=rf"tolerance={tolerance!r} is invalid: must be a finite number >= 0"):
            convert(source, tmp_path / "out", tolerance=tolerance, progress=False)
    for size in (0, -5, "0KB", True):
        with pytest.raises(ValueError, match=f"max shard size {size!r}"):
            convert(source, tmp_path / "out", max_shard_size=size, progress=False)
    with pytest.raises(ValueError, match="probe_length=0 is invalid: must be an integer >= 1"):
        convert(source, tmp_path / "out", probe_length=0, progress=False)
    with pytest.raises(ValueError, match="`forget_gate_bias`=inf is invalid: must be finite"):
        convert(source, tmp_path / "out", RetrofitOptions(forget_gate_bias=math.inf), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ case 3: signals and kills

# A launcher process imports the command once (seconds on a loaded machine), then forks one child per conversion:
# a real process running the real `selective-rope convert`, which stops at a known point, says "paused" and waits
# there (interruptibly) for the test's signal. The launcher reports how the child ended. The wrappers only add the
# pause; everything else is the command's own code. Protocol, one JSON line each way:
#   test -> launcher: [stop_at, args, stderr_path];  launcher -> test: {"pid": ...}, then {"exit": status}
LAUNCHER = """
import importlib, json, os, sys, time, traceback
from pathlib import Path
from selective_rope.cli import main

convert_module = importlib.import_module("selective_rope.conversion.convert")
output_module = importlib.import_module("selective_rope.conversion.output")

def pause_after(owner, name, when):
    real = getattr(owner, name)
    def wrapper(*a, **k):
        result = real(*a, **k)
        if when(*a):
            print("paused", flush=True)
            time.sleep(3600)
        return result
    setattr(owner, name, wrapper)

def stop(at):
    if at == "write":  # a shard written, more to come
        pause_after(convert_module, "save_file", lambda *a: True)
    elif at == "exchange":  # --overwrite: right after the atomic swap of old and new
        pause_after(output_module, "_rename_flagged", lambda *a: a[2] == output_module.RENAME_EXCHANGE)
    elif at == "fallback":  # --overwrite without renameat2: old OUTPUT moved aside, the new one not yet in
        output_module._renameat2 = None
        pause_after(os, "rename", lambda *a: Path(a[1]).name == "previous")
    elif at == "fallback-claimed":  # the same, a step later: OUTPUT created empty (claimed), the new one not yet in
        output_module._renameat2 = None
        pause_after(os, "mkdir", lambda *a: Path(a[0]).name == "out")

def run(args):  # `python -m selective_rope convert ARGS`, as the interpreter ends it
    try:
        return main(["convert", *args, "--no-progress"])
    except SystemExit as exit:
        if isinstance(exit.code, str):
            print(exit.code, file=sys.stderr)
            return 1
        return exit.code or 0
    except BaseException:
        traceback.print_exc()
        return 1

for line in sys.stdin:
    stop_at, args, stderr_path = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        stop(stop_at)
        code = run(args)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""


class Launcher:
    def __init__(self, directory: Path):
        script = directory / "launcher.py"
        script.write_text(LAUNCHER)
        self.process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        bufsize=0)
        self.pending = b""
        self.child: int | None = None

    def _line(self, timeout: float = 300) -> bytes:
        """The next line the launcher or its child prints (generous timeout: imports take long on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.process.stdout.fileno(), 4096) if ready else b""
            if not chunk:
                pytest.fail("the launcher ended or hung (see its stderr above)")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line

    def start(self, stop_at: str, *args, stderr: Path) -> None:
        """Run `selective-rope convert ARGS` in a new child; return once it paused at ``stop_at``."""
        self.process.stdin.write(json.dumps([stop_at, list(map(str, args)), str(stderr)]).encode() + b"\n")
        seen = set()
        while seen != {"pid", "paused"}:
            line = self._line()
            if line == b"paused":
                seen.add("paused")
            elif line.startswith(b'{"pid"'):
                self.child = json.loads(line)["pid"]
                seen.add("pid")
            else:
                pytest.fail(f"the conversion ended before {stop_at!r}: {line!r}, {stderr.read_text()[-3000:]}")

    def finish(self, signum: int) -> int:
        """Send ``signum`` to the paused child; its exit status (-N when a signal N ended it). A child that does not
        end is killed, so that the launcher (waiting for it) serves the next test."""
        child, self.child = self.child, None
        os.kill(child, signum)
        try:
            return json.loads(self._line())["exit"]
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            self._line()  # its exit
            raise

    def close(self) -> None:
        if self.child is not None:  # a failed test left one paused
            self.finish(signal.SIGKILL)
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.process.stdout.close()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    launcher = Launcher(tmp_path_factory.mktemp("launcher"))
    yield launcher
    launcher.close()


@pytest.fixture
def paused_conversion(launcher, tmp_path):
    """``start(stop_at, *args)`` -> ``finish(signum)`` -> (exit status, the child's stderr)."""
    stderr = tmp_path / "child.err"

    def start(stop_at: str, *args):
        launcher.start(stop_at, *args, stderr=stderr)
        return lambda signum: (launcher.finish(signum), stderr.read_text())

    yield start
    if launcher.child is not None:
        launcher.finish(signal.SIGKILL)


def partials(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if ".partial-" in p.name)


@pytest.mark.skipif(output_module.fcntl is None, reason="needs flock")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_clean_up_and_a_live_conversion_is_never_disturbed(signum, paused_conversion, source,
                                                                             tmp_path, caplog):
    output = tmp_path / "out"
    finish = paused_conversion("write", source, output, "--max-shard-size", "30KB")
    [partial] = partials(tmp_path)
    assert (partial / output_module.MARKER).is_file() and any((partial / "model").glob("*.safetensors"))

    # Another conversion into the same OUTPUT meanwhile: it must leave the live one's staging directory alone.
    with caplog.at_level(logging.WARNING):
        convert(source, output, progress=False)
    assert partials(tmp_path) == [partial] and (partial / "model").is_dir()
    assert [r for r in caplog.records if r.name == output_module.__name__] == []
    published = tree(output)

    code, stderr = finish(signum)
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (f"selective-rope convert: interrupted by {signum.name}; the partial "
                                               "output was removed")
    assert partials(tmp_path) == [] and tree(output) == published


@pytest.mark.skipif(output_module.fcntl is None, reason="needs flock")
def test_after_sigkill_the_next_run_removes_the_partial_and_nothing_else(paused_conversion, source, tmp_path,
                                                                        caplog):
    output = tmp_path / "out"
    finish = paused_conversion("write", source, output, "--max-shard-size", "30KB")
    code, _ = finish(signal.SIGKILL)
    assert code == -signal.SIGKILL
    [partial] = partials(tmp_path)
    assert any((partial / "model").glob("*.safetensors"))  # a model-sized leftover, until the next run

    # Look-alikes that are not this OUTPUT's dead partials: never touched.
    unmarked = tmp_path / ".out.partial-0123456789abcdef"  # our name, no marker
    (unmarked / "model").mkdir(parents=True)
    other_output = tmp_path / ".other.partial-0123456789abcdef"  # a dead partial of another OUTPUT
    shutil.copytree(partial, other_output, ignore=shutil.ignore_patterns("model"))
    file_named_alike = tmp_path / ".out.partial-fedcba9876543210"
    file_named_alike.write_text("a file")
    bad_marker = tmp_path / ".out.partial-00000000000000ff"  # a marker that is not ours
    bad_marker.mkdir()
    (bad_marker / output_module.MARKER).write_text('{"tool": "something else"}')
    before = tree(tmp_path)

    with caplog.at_level(logging.WARNING, logger=output_module.__name__):
        convert(source, output, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == output_module.__name__] == [
        f"removed {partial}: the partial output of an interrupted conversion (no running conversion holds its lock)"]
    assert partials(tmp_path) == sorted([unmarked, other_output, file_named_alike, bad_marker])
    for decoy in (unmarked, other_output, file_named_alike, bad_marker):
        name = decoy.name
        assert {k: v for k, v in tree(tmp_path).items() if k.startswith(name)} == \
            {k: v for k, v in before.items() if k.startswith(name)}
    assert (output / "config.json").exists()


@pytest.mark.skipif(output_module.fcntl is None, reason="needs flock")
@pytest.mark.parametrize("stop_at", ["exchange", "fallback", "fallback-claimed"])
def test_a_kill_during_overwrite_leaves_the_old_or_the_new_model(stop_at, paused_conversion, source, tmp_path,
                                                                 caplog):
    if stop_at == "exchange" and output_module._renameat2 is None:
        pytest.skip("renameat2 is not available here")
    output = tmp_path / "out"
    earlier_model(output)
    old = tree(output)
    finish = paused_conversion(stop_at, source, output, "--overwrite")
    code, _ = finish(signal.SIGKILL)
    assert code == -signal.SIGKILL
    [partial] = partials(tmp_path)
    if stop_at == "exchange":  # one atomic step: the new model is in place, the old one waits in the partial
        assert (output / "config.json").exists() and tree(partial / "model") == old
    elif stop_at == "fallback":  # two renames: between them OUTPUT is missing and the old model is in the partial
        assert not output.exists() and tree(partial / "previous") == old
    else:  # OUTPUT claimed (created empty) for the second rename: the old model is in the partial
        assert output.is_dir() and not any(output.iterdir()) and tree(partial / "previous") == old
    new_or_nothing = tree(output) if output.exists() else None

    with caplog.at_level(logging.WARNING, logger=output_module.__name__), pytest.raises(FileExistsError):
        convert(source, output, progress=False)  # the next run, without --overwrite
    messages = [r.getMessage() for r in caplog.records if r.name == output_module.__name__]
    removed = (f"removed {partial}: the partial output of an interrupted conversion (no running conversion holds "
               "its lock)")
    if stop_at == "exchange":
        assert messages == [removed] and tree(output) == new_or_nothing
    else:
        assert messages == [f"restored {output} from {partial}: an interrupted --overwrite had moved it there",
                            removed]
        assert tree(output) == old
    assert partials(tmp_path) == []


def test_signals_are_held_while_publishing_even_with_other_threads(source, tmp_path, monkeypatch, capsys):
    """A SIGTERM that arrives while OUTPUT is being replaced is acted on once the new model is in place, whichever
    thread the kernel hands it to (a signal mask would hold it for the main thread only; torch runs others), and the
    command says that OUTPUT holds the converted model."""
    helper = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)  # a thread not blocking it
    helper.start()
    output = tmp_path / "out"
    convert(source, output, progress=False)  # an earlier model, replaced below
    old = tree(output)
    real_exchange = output_module._rename_flagged
    steps = []

    def exchange_then_signal(source_path, target, flags):
        os.kill(os.getpid(), signal.SIGTERM)  # in the middle of publishing
        time.sleep(0.2)  # time for the signal to land on some thread
        steps.append("swapped")
        return real_exchange(source_path, target, flags)

    monkeypatch.setattr(output_module, "_rename_flagged", exchange_then_signal)
    with pytest.raises(SystemExit) as exit:
        cli_main(["convert", str(source), str(output), "--overwrite", "--no-progress", "--seed", "1"])
    assert exit.value.code == 128 + signal.SIGTERM and steps
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"selective-rope convert: interrupted by SIGTERM; {output} holds the converted model")
    assert (output / "config.json").exists() and tree(output) != old and partials(tmp_path) == []


def test_signals_deferred_acts_on_each_held_signal_once_afterwards():
    seen = []
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    original = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(("handler", signum)))
    try:
        with output_module.signals_deferred():
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            seen.append("block done")
        assert seen == ["block done", ("handler", signal.SIGINT)]
        with output_module.signals_deferred(), output_module.signals_deferred():  # nested: held to the outer end
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            seen.append("inner done")
        assert seen[-2:] == ["inner done", ("handler", signal.SIGINT)]
    finally:
        signal.signal(signal.SIGINT, original)
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("where", ["output", "nested"])
def test_overwrite_never_deletes_across_a_mount_point(where, source, tmp_path, monkeypatch):
    """A folder mounted inside OUTPUT (a bind mount of someone's data) is never deleted: --overwrite refuses such an
    OUTPUT, and removing a tree never crosses one. (Mount points are simulated: mounting needs privileges.)"""
    output = tmp_path / "out"
    convert(source, output, progress=False)
    mounted = output / "data" if where == "output" else output / "a" / "b"
    mounted.mkdir(parents=True)
    (mounted / "theirs.txt").write_text("someone's file")
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mounted)
    before = tree(output)
    message = cli_error(str(source), str(output), "--overwrite")
    assert message == (f"selective-rope convert: OUTPUT {output} holds a mount point ({mounted}): --overwrite would "
                       "delete what is mounted there; choose another OUTPUT")
    assert tree(output) == before and partials(tmp_path) == []
    with pytest.raises(OSError, match="is a mount point"):
        output_module._remove(output)
    assert tree(output) == before


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "3", "null"])
def test_a_config_that_is_not_an_object_is_one_line(content, source, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text(content)
    kind = type(json.loads(content)).__name__
    assert cli_error(str(bad), str(tmp_path / "out")) == (
        f"selective-rope convert: {bad / 'config.json'} holds a JSON {kind}, not an object of config fields")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, named", [("hidden_size", "64", "hidden_size"),
                                                 ("rope_scaling", [1, 2], "rope_parameters")])  # transformers' name
def test_a_source_config_transformers_refuses_is_one_line(field, value, named, source, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, field: value}))
    message = cli_error(str(bad), str(tmp_path / "out"))
    assert message.startswith(f"selective-rope convert: {bad / 'config.json'} is invalid: ") and named in message
    assert not (tmp_path / "out").exists()


REAL_BIND_MOUNT = """
import json, subprocess, sys
from pathlib import Path
from selective_rope.cli import main
from selective_rope.conversion import output as output_module

source, output, data = map(Path, sys.argv[1:4])
(output / "data").mkdir()
subprocess.run(["mount", "--bind", str(data), str(output / "data")], check=True)
try:
    main(["convert", str(source), str(output), "--overwrite", "--no-progress"])
    refused = None
except SystemExit as exit:
    refused = exit.code
try:
    output_module._remove(output)
    removed = "removed"
except OSError as error:
    removed = str(error)
print(json.dumps({"refused": refused, "removed": removed, "data": sorted(p.name for p in data.iterdir())}))
"""


def test_a_real_bind_mount_inside_output_is_never_deleted(source, tmp_path):
    """A folder bind-mounted into OUTPUT in a private mount namespace (``unshare -Urm``): --overwrite refuses, and
    removing the tree stops at the mount point; the mounted folder's files are all still there."""
    probe = tmp_path / "probe"
    probe.mkdir()
    if not _can_mount_tmpfs(probe):
        pytest.skip("cannot mount in a user namespace here (the simulated mount points above still run)")
    output, data = tmp_path / "out", tmp_path / "data"
    convert(source, output, progress=False)
    data.mkdir()
    (data / "theirs.txt").write_text("someone's file")
    script = tmp_path / "bind_mount.py"
    script.write_text(REAL_BIND_MOUNT)
    run = subprocess.run(["unshare", "-Urm", sys.executable, str(script), str(source), str(output), str(data)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["refused"] == (f"selective-rope convert: OUTPUT {output} holds a mount point ({output / 'data'}): "
                                 "--overwrite would delete what is mounted there; choose another OUTPUT")
    assert result["removed"].endswith(f"not removed: {output / 'data'} is a mount point: '{output}'")
    assert result["data"] == ["theirs.txt"] and (data / "theirs.txt").read_text() == "someone's file"
