"""Batch files on disk, one directory per tenant: `<dir>/<tenant dir>/<file id>.jsonl` holds the bytes,
`<file id>.json` beside it the record. The tenant directory is named by a digest of the tenant, so no
tenant string becomes a path either.

Ids are generated (records.new_file_id) and checked against their pattern before they become a path,
so no client-supplied name is ever used as one; the client's filename is kept only to be shown. Every
write goes to a temporary file in the tenant's directory and is renamed into place, so a reader (or a
worker restarted mid-write) sees a whole file or none. A file belongs to the tenant that created it:
`get` answers `NotFound` for another tenant's, exactly as for a missing one.

Bounds: an upload is refused past `max_bytes`, `max_lines`, or the tenant's quota (`max_tenant_bytes`,
counting every byte in its directory, outputs and uploads in progress included; an output file is always
written, and may take the tenant past it). Files expire: an upload `upload_keep_s` after it was made, an
output or error file `output_keep_s` after it was written (with its job's record); `sweep` deletes them
(the batch worker calls it), except an upload an unfinished job still reads. `list` and the quota read
only the tenant's own directory.

Past one machine the directory is replaced by an object store (S3, GCS): the same operations (put whole,
get record, open for reading, list by the tenant's prefix, delete), keyed by the same ids; see
docs/backfill.md.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import BinaryIO

import msgspec

from pipeline.batch.errors import Invalid, NotFound, TooLarge
from pipeline.batch.records import FileRecord, new_file_id, valid_file_id

COPY_BYTES = 1 << 20
MAX_FILENAME = 255
TEMPORARY_MAX_AGE_S = 24 * 3600.0  # a temporary file this old was left by a process that died mid-write


class FileStore:
    def __init__(self, root: Path, *, max_bytes: int, max_lines: int, max_tenant_bytes: int | None = None,
                 upload_keep_s: float | None = None, output_keep_s: float | None = None) -> None:
        """None for `max_tenant_bytes`: no quota; for a keep: such files are kept until deleted."""
        self.root = root
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.max_tenant_bytes = max_tenant_bytes
        self._keep = {"batch": upload_keep_s, "batch_output": output_keep_s}
        self._decode = msgspec.json.Decoder(FileRecord)
        self._move_flat_files()

    def upload(self, tenant: str, filename: str, source: BinaryIO, *, file_id: str | None = None) -> FileRecord:
        """A batch input file from `source` (blocking: call it in a thread). Refused when it is over the
        size or line limit or the tenant's quota, empty, not UTF-8, or has no line that is a JSON object.
        `file_id`: one sluice derived itself (`sluice batch run` names a file by its content); else a new one."""
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        file_id = file_id or new_file_id()
        assert valid_file_id(file_id), file_id
        room = self._room(tenant)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                size = 0
                while piece := source.read(COPY_BYTES):
                    size += len(piece)
                    if size > self.max_bytes:
                        raise TooLarge(f"the file is over the limit of {self.max_bytes} bytes", "file")
                    if size > room:
                        raise TooLarge(f"the tenant's stored files would be over their quota of {self.max_tenant_bytes} "
                                       f"bytes ({self.max_tenant_bytes - room} in use): delete files you no longer "
                                       "need (DELETE /v1/files/{id}), or wait for them to expire", "file")
                    out.write(piece)
            check_input(Path(tmp), self.max_lines)
            record = FileRecord(file_id, tenant, "batch", size, int(time.time()), _display_name(filename))
            os.replace(tmp, self._data(tenant, file_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._write_record(record)
        return record

    def write_output(self, file_id: str, tenant: str, filename: str, lines: Iterable[bytes]) -> FileRecord:
        """An output or error file (blocking). Written whole and renamed into place, so writing the same
        id again (a finalize that ran twice) replaces it with the same content. Never refused for the
        quota: the job's results would be lost."""
        folder = self._dir(tenant)
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".output-")
        try:
            with os.fdopen(fd, "wb") as out:
                for line in lines:
                    out.write(line + b"\n")
                out.flush()
                os.fsync(out.fileno())
                size = out.tell()
            os.replace(tmp, self._data(tenant, file_id))
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
            record = self._decode.decode(self._meta(tenant, file_id).read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            raise NotFound(f"no file {file_id!r}") from None
        if record.tenant != tenant:
            raise NotFound(f"no file {file_id!r}")
        return record

    def list(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             newest_first: bool = True) -> tuple[list[FileRecord], bool]:
        """The tenant's files (blocking), newest first by default, from just past the file `after`; and
        whether there are more. Another tenant's files are never listed, nor usable as `after`."""
        records = [r for r in self._records(self._dir(tenant)) if r.tenant == tenant and (purpose is None or r.purpose == purpose)]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=newest_first)
        if after is not None:
            ids = [r.id for r in records]
            if after not in ids:
                raise NotFound(f"no file {after[:64]!r}")
            records = records[ids.index(after) + 1:]
        return records[:limit], len(records) > limit

    def path(self, record: FileRecord) -> Path:
        """Where the file's bytes are (for reading); `record` comes from `get`, so its id is checked."""
        return self._data(record.tenant, record.id)

    def delete(self, tenant: str, file_id: str) -> None:
        record = self.get(tenant, file_id)
        self._meta(tenant, record.id).unlink(missing_ok=True)
        self._data(tenant, record.id).unlink(missing_ok=True)

    def expires_at(self, record: FileRecord) -> int | None:
        """When `sweep` deletes the file (an upload an unfinished job reads waits for that job); None: never."""
        keep = self._keep[record.purpose]
        return record.created_at + int(keep) if keep else None

    def usage(self, tenant: str) -> int:
        """The bytes in the tenant's directory: its files and records, and uploads being written."""
        used = 0
        folder = self._dir(tenant)
        for path in folder.iterdir() if folder.is_dir() else ():
            try:
                used += path.stat().st_size
            except FileNotFoundError:  # deleted or renamed meanwhile
                continue
        return used

    def sweep(self, now: float, in_use: Collection[str] = ()) -> list[FileRecord]:
        """Deletes every file past `expires_at` (blocking), except the ids in `in_use` (inputs of unfinished
        jobs), and temporary files left by a process that died mid-write; returns the records deleted."""
        deleted = []
        folders = [p for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []
        for folder in folders:
            for record in self._records(folder):
                expires = self.expires_at(record)
                if expires is not None and expires <= now and record.id not in in_use:
                    self._meta(record.tenant, record.id).unlink(missing_ok=True)
                    self._data(record.tenant, record.id).unlink(missing_ok=True)
                    deleted.append(record)
        for folder in (self.root, *folders):
            for temporary in folder.glob(".*") if folder.is_dir() else ():
                try:
                    if temporary.stat().st_mtime < now - TEMPORARY_MAX_AGE_S:
                        temporary.unlink(missing_ok=True)
                except FileNotFoundError:
                    continue
        return deleted

    def _room(self, tenant: str) -> int:
        """How many more bytes the tenant may upload (refused before reading any when there is no room)."""
        if self.max_tenant_bytes is None:
            return self.max_bytes
        room = self.max_tenant_bytes - self.usage(tenant)
        if room <= 0:
            raise TooLarge(f"the tenant's stored files are at their quota of {self.max_tenant_bytes} bytes: delete "
                           "files you no longer need (DELETE /v1/files/{id}), or wait for them to expire", "file")
        return room

    def _records(self, folder: Path) -> list[FileRecord]:
        records = []
        for meta in folder.glob("*.json") if folder.is_dir() else ():
            try:
                records.append(self._decode.decode(meta.read_bytes()))
            except (OSError, msgspec.DecodeError):
                continue  # deleted meanwhile, or being replaced
        return records

    def _move_flat_files(self) -> None:
        """Files kept before the per-tenant directories (`<dir>/<file id>.*`) move into their tenant's."""
        for meta in self.root.glob("*.json") if self.root.is_dir() else ():
            try:
                record = self._decode.decode(meta.read_bytes())
                self._dir(record.tenant).mkdir(exist_ok=True)
                flat = self.root / f"{record.id}.jsonl"
                if flat.exists():  # the bytes first: a record is never where its bytes are not
                    os.replace(flat, self._data(record.tenant, record.id))
                os.replace(meta, self._meta(record.tenant, record.id))
            except (OSError, msgspec.DecodeError):
                continue  # another process moved it first, or it is no record of ours

    def _write_record(self, record: FileRecord) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._dir(record.tenant), prefix=".record-")
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.encode(record))
        os.replace(tmp, self._meta(record.tenant, record.id))

    def _dir(self, tenant: str) -> Path:
        return self.root / ("t" + hashlib.sha256(tenant.encode()).hexdigest()[:32])

    def _data(self, tenant: str, file_id: str) -> Path:
        assert valid_file_id(file_id), file_id
        return self._dir(tenant) / f"{file_id}.jsonl"

    def _meta(self, tenant: str, file_id: str) -> Path:
        assert valid_file_id(file_id), file_id
        return self._dir(tenant) / f"{file_id}.json"


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
