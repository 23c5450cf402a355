"""The helpers the example scripts share (examples/example_utils.py): writing a table between a page's markers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from example_utils import MarkersNotFound, write_between_markers  # noqa: E402

START, END = "<!-- results:x:start -->", "<!-- results:x:end -->"


def test_replaces_only_the_text_between_the_markers(tmp_path):
    doc = tmp_path / "page.md"
    before, after = "# Title\nintro ± θ\n", "\nclosing text\n<!-- results:y:start -->\nother\n<!-- results:y:end -->\n"
    doc.write_text(f"{before}{START}\nold\nrows\n{END}{after}", encoding="utf-8")
    write_between_markers(doc, START, END, "| a | b |\n|---|---|")
    assert doc.read_text(encoding="utf-8") == f"{before}{START}\n| a | b |\n|---|---|\n{END}{after}"
    write_between_markers(doc, START, END, "new")  # writing again replaces the previous table, nothing else
    assert doc.read_text(encoding="utf-8") == f"{before}{START}\nnew\n{END}{after}"


@pytest.mark.parametrize(
    "content, message",
    [
        (f"intro\n{START}\nold\n", "'<!-- results:x:end -->' 0 times"),
        (f"intro\nold\n{END}\n", "'<!-- results:x:start -->' 0 times"),
        ("no markers at all\n", "'<!-- results:x:start -->' 0 times, '<!-- results:x:end -->' 0 times"),
        (f"{START}\na\n{END}\n{START}\nb\n{END}\n", "'<!-- results:x:start -->' 2 times"),
        (f"{END}\nold\n{START}\n", "the end marker '<!-- results:x:end -->' comes before the start marker"),
    ],
)
def test_refuses_a_page_without_one_marker_pair_and_leaves_it_unchanged(tmp_path, content, message):
    doc = tmp_path / "page.md"
    doc.write_text(content, encoding="utf-8")
    with pytest.raises(MarkersNotFound, match="page.md: ") as raised:
        write_between_markers(doc, START, END, "table")
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert doc.read_text(encoding="utf-8") == content


def test_a_missing_page_is_not_created(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_between_markers(tmp_path / "missing.md", START, END, "table")
    assert not (tmp_path / "missing.md").exists()


def test_an_interrupted_write_leaves_the_old_page_whole_and_no_temporary_file(tmp_path, monkeypatch):
    doc = tmp_path / "page.md"
    content = f"intro\n{START}\nold\n{END}\nend\n"
    doc.write_text(content, encoding="utf-8")
    doc.chmod(0o640)

    def interrupted(source, destination):
        raise KeyboardInterrupt

    monkeypatch.setattr("example_utils.os.replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_between_markers(doc, START, END, "new table")
    assert doc.read_text(encoding="utf-8") == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"]
    monkeypatch.undo()
    write_between_markers(doc, START, END, "new table")
    assert doc.stat().st_mode & 0o777 == 0o640 and "new table" in doc.read_text(encoding="utf-8")


def test_a_linked_page_is_written_through_its_link(tmp_path):
    target = tmp_path / "real.md"
    target.write_text(f"{START}\nold\n{END}\n", encoding="utf-8")
    link = tmp_path / "page.md"
    link.symlink_to(target)
    write_between_markers(link, START, END, "new")
    assert link.is_symlink() and target.read_text(encoding="utf-8") == f"{START}\nnew\n{END}\n"


def test_a_store_keeps_one_line_per_run_and_a_rerun_replaces_its_line(tmp_path):
    from example_utils import read_runs, runs_below, store_run

    store = tmp_path / "results" / "runs.jsonl"
    first, second = {"seed": 0, "loss": [0.5, 0.25], "x": 1 / 3}, {"seed": 1, "nested": {"a": None}}
    store_run(store, "parity/a_seed0", first)
    store_run(store, "parity/sweep/b_seed1", second)
    assert read_runs(store) == {"parity/a_seed0": first, "parity/sweep/b_seed1": second}  # floats exactly
    store_run(store, "parity/a_seed0", {"seed": 0, "loss": [0.1]})
    lines = store.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == {"run": "parity/a_seed0", "seed": 0, "loss": [0.1]}
    assert runs_below(read_runs(store), "parity/") == {"a_seed0": {"seed": 0, "loss": [0.1]}}


def test_a_folder_of_json_files_reads_as_a_store(tmp_path):
    from example_utils import read_runs

    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "nope_seed0.json").write_text('{"seed": 0}')
    assert read_runs(tmp_path) == {"copy/nope_seed0": {"seed": 0}}
    assert read_runs(tmp_path / "missing.jsonl") == {}


def test_a_line_that_is_not_a_stored_run_is_refused(tmp_path):
    from example_utils import read_runs

    store = tmp_path / "runs.jsonl"
    store.write_text('{"run": "a", "seed": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"runs.jsonl:2: not a stored run"):
        read_runs(store)
