"""Batch files on disk: generated ids only, another tenant's file is not there, and the limits."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pipeline.batch.errors import Invalid, NotFound, TooLarge
from pipeline.batch.files import FileStore
from pipeline.batch.records import valid_file_id
from tests.unit.batch.helpers import jsonl


def store(tmp: Path, **limits: float) -> FileStore:
    return FileStore(tmp / "files", **{"max_bytes": 10_000, "max_lines": 5, **limits})  # type: ignore[arg-type]


def stored(tmp: Path) -> list[Path]:
    """Every file under the store's directory (tenant directories hold them)."""
    return sorted(p for p in (tmp / "files").rglob("*") if p.is_file())


def test_an_upload_gets_a_generated_id_and_keeps_the_name_only_for_display(tmp_path: Path) -> None:
    files = store(tmp_path)
    record = files.upload("acme", "../../etc/passwd", io.BytesIO(jsonl(["a"])))
    assert valid_file_id(record.id) and record.filename == "passwd" and record.purpose == "batch"
    assert [p.name for p in stored(tmp_path)] == [f"{record.id}.json", f"{record.id}.jsonl"]
    folder = stored(tmp_path)[0].parent  # the tenant's directory, named by a digest: no tenant string is a path
    assert folder.parent == tmp_path / "files" and "acme" not in folder.name
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
    assert stored(tmp_path) == []


def test_an_output_written_twice_is_one_file_with_the_same_content(tmp_path: Path) -> None:
    files = store(tmp_path)
    from pipeline.batch.records import derived_file_id

    file_id = derived_file_id("batch_" + "0" * 24, "output")
    files.write_output(file_id, "acme", "out.jsonl", [b'{"a": 1}', b'{"b": 2}'])
    again = files.write_output(file_id, "acme", "out.jsonl", [b'{"a": 1}', b'{"b": 2}'])
    assert files.path(again).read_bytes() == b'{"a": 1}\n{"b": 2}\n' and again.purpose == "batch_output"
    assert len(stored(tmp_path)) == 2


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


def test_an_upload_past_the_tenants_quota_is_refused_and_another_tenant_is_not_held_back(tmp_path: Path) -> None:
    files = store(tmp_path, max_tenant_bytes=300)
    data = jsonl(["a"])  # about 120 bytes, and a small record beside it
    files.upload("acme", "one.jsonl", io.BytesIO(data))
    with pytest.raises(TooLarge, match="quota of 300 bytes"):
        files.upload("acme", "two.jsonl", io.BytesIO(data))
    assert len(files.list("acme")[0]) == 1 and files.usage("acme") < 300
    files.upload("globex", "theirs.jsonl", io.BytesIO(data))
    files.write_output("file-" + "1" * 24, "acme", "out.jsonl", [b"{}" * 200])  # results are always kept
    with pytest.raises(TooLarge, match="at their quota"):  # refused before a byte is read
        files.upload("acme", "three.jsonl", io.BytesIO(b""))
    files.delete("acme", "file-" + "1" * 24)
    assert files.upload("acme", "three.jsonl", io.BytesIO(b"{}\n")).bytes == 3


def test_a_sweep_deletes_expired_files_but_those_in_use_and_what_a_dead_writer_left(tmp_path: Path) -> None:
    files = store(tmp_path, upload_keep_s=100, output_keep_s=1000)
    old, used = (files.upload("acme", "in.jsonl", io.BytesIO(jsonl(["a"]))) for _ in range(2))
    output = files.write_output("file-" + "2" * 24, "acme", "out.jsonl", [b"{}"])
    assert files.expires_at(old) == old.created_at + 100 and files.expires_at(output) == output.created_at + 1000
    left = files.path(old).parent / ".upload-dead"
    left.write_bytes(b"{}")
    now = old.created_at + 101
    assert {r.id for r in files.sweep(now, in_use={used.id})} == {old.id}
    assert {f.id for f in files.list("acme")[0]} == {used.id, output.id} and left.exists()  # being written, maybe
    assert {r.id for r in files.sweep(now + 2 * 86400)} == {used.id, output.id}
    assert stored(tmp_path) == []
    assert store(tmp_path).expires_at(output) is None  # no keep: kept until deleted


def test_listing_reads_only_the_tenants_own_records(tmp_path: Path) -> None:
    files = store(tmp_path)
    files.upload("acme", "mine.jsonl", io.BytesIO(jsonl(["a"])))
    for _ in range(20):
        files.upload("globex", "theirs.jsonl", io.BytesIO(jsonl(["a"])))
    read: list[bytes] = []
    decoder = files._decode

    class Counting:
        def decode(self, raw: bytes) -> object:
            read.append(raw)
            return decoder.decode(raw)

    files._decode = Counting()  # type: ignore[assignment]
    assert len(files.list("acme")[0]) == 1 and len(read) == 1


def test_files_kept_in_the_directory_itself_before_move_into_their_tenants(tmp_path: Path) -> None:
    files = store(tmp_path)
    record = files.upload("acme", "in.jsonl", io.BytesIO(jsonl(["a"])))
    for path in stored(tmp_path):  # as an earlier version kept them: <dir>/<file id>.json(l)
        path.rename(tmp_path / "files" / path.name)
    again = store(tmp_path)
    assert again.get("acme", record.id) == record and again.path(record).read_bytes() == jsonl(["a"])
    assert [p.parent for p in stored(tmp_path)] == [again.path(record).parent] * 2
