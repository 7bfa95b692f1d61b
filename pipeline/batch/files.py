"""Batch files on disk: `<dir>/<file id>.jsonl` holds the bytes, `<dir>/<file id>.json` the record.

Ids are generated (records.new_file_id) and checked against their pattern before they become a path,
so no client-supplied name is ever used as one; the client's filename is kept only to be shown. Every
write goes to a temporary file in the same directory and is renamed into place, so a reader (or a
worker restarted mid-write) sees a whole file or none. A file belongs to the tenant that created it:
`get` answers `NotFound` for another tenant's, exactly as for a missing one.

Past one machine the directory is replaced by an object store (S3, GCS): the same operations (put whole,
get record, open for reading, list records), keyed by the same ids; see docs/backfill.md. `list` reads
every record in the directory (fine for the thousands of files one machine keeps; an object store would
list by a tenant prefix).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import msgspec

from pipeline.batch.errors import Invalid, NotFound, TooLarge
from pipeline.batch.records import FileRecord, new_file_id, valid_file_id

COPY_BYTES = 1 << 20
MAX_FILENAME = 255


class FileStore:
    def __init__(self, root: Path, *, max_bytes: int, max_lines: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self._decode = msgspec.json.Decoder(FileRecord)

    def upload(self, tenant: str, filename: str, source: BinaryIO, *, file_id: str | None = None) -> FileRecord:
        """A batch input file from `source` (blocking: call it in a thread). Refused when it is over the
        size or line limit, empty, not UTF-8, or has no line that is a JSON object. `file_id`: one
        sluice derived itself (`sluice batch run` names a file by its content); else a new one."""
        self.root.mkdir(parents=True, exist_ok=True)
        file_id = file_id or new_file_id()
        assert valid_file_id(file_id), file_id
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                size = 0
                while piece := source.read(COPY_BYTES):
                    size += len(piece)
                    if size > self.max_bytes:
                        raise TooLarge(f"the file is over the limit of {self.max_bytes} bytes", "file")
                    out.write(piece)
            check_input(Path(tmp), self.max_lines)
            record = FileRecord(file_id, tenant, "batch", size, int(time.time()), _display_name(filename))
            os.replace(tmp, self._data(file_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._write_record(record)
        return record

    def write_output(self, file_id: str, tenant: str, filename: str, lines: Iterable[bytes]) -> FileRecord:
        """An output or error file (blocking). Written whole and renamed into place, so writing the same
        id again (a finalize that ran twice) replaces it with the same content."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".output-")
        try:
            with os.fdopen(fd, "wb") as out:
                for line in lines:
                    out.write(line + b"\n")
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp, self._data(file_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        record = FileRecord(file_id, tenant, "batch_output", size, int(time.time()), filename)
        self._write_record(record)
        return record

    def get(self, tenant: str, file_id: str) -> FileRecord:
        """The file's record; NotFound when there is none or it is another tenant's."""
        if not valid_file_id(file_id):
            raise NotFound(f"no file {file_id[:64]!r}")
        try:
            record = self._decode.decode(self._meta(file_id).read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            raise NotFound(f"no file {file_id!r}") from None
        if record.tenant != tenant:
            raise NotFound(f"no file {file_id!r}")
        return record

    def list(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             newest_first: bool = True) -> tuple[list[FileRecord], bool]:
        """The tenant's files (blocking), newest first by default, from just past the file `after`; and
        whether there are more. Another tenant's files are never listed, nor usable as `after`."""
        records = []
        for meta in self.root.glob("*.json") if self.root.is_dir() else ():
            try:
                record = self._decode.decode(meta.read_bytes())
            except (OSError, msgspec.DecodeError):
                continue  # deleted meanwhile, or being replaced
            if record.tenant == tenant and (purpose is None or record.purpose == purpose):
                records.append(record)
        records.sort(key=lambda r: (r.created_at, r.id), reverse=newest_first)
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise NotFound(f"no file {after[:64]!r}")
            records = records[ids.index(after) + 1:]
        return records[:limit], len(records) > limit

    def path(self, record: FileRecord) -> Path:
        """Where the file's bytes are (for reading); `record` comes from `get`, so its id is checked."""
        return self._data(record.id)

    def delete(self, tenant: str, file_id: str) -> None:
        record = self.get(tenant, file_id)
        self._meta(record.id).unlink(missing_ok=True)
        self._data(record.id).unlink(missing_ok=True)

    def _write_record(self, record: FileRecord) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".record-")
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.encode(record))
        os.replace(tmp, self._meta(record.id))

    def _data(self, file_id: str) -> Path:
        assert valid_file_id(file_id), file_id
        return self.root / f"{file_id}.jsonl"

    def _meta(self, file_id: str) -> Path:
        assert valid_file_id(file_id), file_id
        return self.root / f"{file_id}.json"




def check_input(path: Path, max_lines: int) -> int:
    """The number of non-blank lines of an input file; Invalid when it is empty, not UTF-8, over
    `max_lines`, or no line is a JSON object (then it cannot be a batch file at all)."""
    lines = 0
    any_object = False
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise Invalid(f"the file is not UTF-8 text (line {number})", "file") from None
            if not raw.strip():  # ASCII whitespace, as the worker reads lines: a line of U+00A0 is a line
                continue
            lines += 1
            if lines > max_lines:
                raise Invalid(f"the file has more than {max_lines} lines", "file")
            if not any_object:
                any_object = text.lstrip().startswith("{") and _is_object(raw)
    if lines == 0:
        raise Invalid("the file is empty", "file")
    if not any_object:
        raise Invalid("no line of the file is a JSON object: it is not a batch input file (JSONL)", "file")
    return lines


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(raw), dict)
    except (msgspec.DecodeError, RecursionError):
        return False


def _display_name(filename: str) -> str:
    """The client's filename, for display: its last path part, printable, at most 255 characters."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())[:MAX_FILENAME]
    return name or "input.jsonl"
