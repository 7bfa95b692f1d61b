"""Batch files on disk: generated ids only, another tenant's file is not there, and the limits."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pipeline.batch.errors import Invalid, NotFound, TooLarge
from pipeline.batch.files import FileStore
from pipeline.batch.records import valid_file_id
from tests.unit.batch.helpers import jsonl


def store(tmp: Path, **limits: int) -> FileStore:
    return FileStore(tmp / "files", **{"max_bytes": 10_000, "max_lines": 5, **limits})


def test_an_upload_gets_a_generated_id_and_keeps_the_name_only_for_display(tmp_path: Path) -> None:
    files = store(tmp_path)
    record = files.upload("acme", "../../etc/passwd", io.BytesIO(jsonl(["a"])))
    assert valid_file_id(record.id) and record.filename == "passwd" and record.purpose == "batch"
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f"{record.id}.json", f"{record.id}.jsonl"]
    assert files.path(files.get("acme", record.id)).read_bytes() == jsonl(["a"])


def test_another_tenants_file_and_ids_that_are_not_ids_are_not_found(tmp_path: Path) -> None:
    files = store(tmp_path)
    record = files.upload("acme", "in.jsonl", io.BytesIO(jsonl(["a"])))
    with pytest.raises(NotFound):
        files.get("globex", record.id)
    for bad in ("../files/" + record.id, record.id + "/..", "file-../../x", "", record.id.upper()):
        with pytest.raises(NotFound):
            files.get("acme", bad)
    with pytest.raises(NotFound):
        files.delete("globex", record.id)
    assert files.get("acme", record.id) == record


@pytest.mark.parametrize(("data", "error", "says"), [
    (b"", Invalid, "empty"),
    (b"\n  \n", Invalid, "empty"),
    (b"\xff\xfe{}\n", Invalid, "UTF-8"),
    (b"hello\nworld\n", Invalid, "JSON object"),
    (jsonl(["q"] * 6), Invalid, "more than 5 lines"),
    (jsonl(["q"]) + "\u00a0\n".encode() * 5, Invalid, "more than 5 lines"),  # lines the worker reads and refuses
    (b"{}" + b" " * 10_000, TooLarge, "10000 bytes"),
])
def test_files_that_cannot_be_batch_input_are_refused_and_leave_nothing_behind(
    tmp_path: Path, data: bytes, error: type[Exception], says: str,
) -> None:
    files = store(tmp_path)
    with pytest.raises(error, match=says):
        files.upload("acme", "in.jsonl", io.BytesIO(data))
    assert list((tmp_path / "files").iterdir()) == []


def test_an_output_written_twice_is_one_file_with_the_same_content(tmp_path: Path) -> None:
    files = store(tmp_path)
    from pipeline.batch.records import derived_file_id

    file_id = derived_file_id("batch_" + "0" * 24, "output")
    files.write_output(file_id, "acme", "out.jsonl", [b'{"a": 1}', b'{"b": 2}'])
    again = files.write_output(file_id, "acme", "out.jsonl", [b'{"a": 1}', b'{"b": 2}'])
    assert files.path(again).read_bytes() == b'{"a": 1}\n{"b": 2}\n' and again.purpose == "batch_output"
    assert len(list((tmp_path / "files").iterdir())) == 2


def test_a_tenant_lists_its_own_files_newest_first_in_pages(tmp_path: Path) -> None:
    files = store(tmp_path)
    mine = [files.upload("acme", f"in{i}.jsonl", io.BytesIO(jsonl(["a"]))) for i in range(5)]
    files.upload("globex", "theirs.jsonl", io.BytesIO(jsonl(["a"])))
    output = files.write_output("file-" + "0" * 24, "acme", "out.jsonl", [b"{}"])
    every, more = files.list("acme")
    assert not more and {f.id for f in every} == {f.id for f in mine} | {output.id}
    assert [(f.created_at, f.id) for f in every] == sorted(((f.created_at, f.id) for f in every), reverse=True)
    first, more = files.list("acme", purpose="batch", limit=2)
    rest, more_after = files.list("acme", purpose="batch", after=first[-1].id)
    assert more and not more_after and [f.id for f in first + rest] == [f.id for f in every if f.purpose == "batch"]
    assert [f.id for f in files.list("acme", newest_first=False)[0]] == [f.id for f in reversed(every)]
    assert [f.filename for f in files.list("globex")[0]] == ["theirs.jsonl"]
    with pytest.raises(NotFound):  # another tenant's id is no cursor either
        files.list("globex", after=mine[0].id)
