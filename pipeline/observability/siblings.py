"""One view of the metrics of `sluice run`'s processes when each runs a bridge on the shared port.

With `[run] bridges = "every"` the kernel hands each new connection to one of the processes, so a scrape
of /metrics (or a poll of /dashboard/data) would see one process at random and its counters would jump
between scrapes. Instead each process also answers on a Unix socket of its own (`<dir>/<index>.sock`,
in a directory of mode 700 that `sluice run` creates and removes), and whichever process is asked
gathers the others' and answers for all of them, each sample labelled `sluice_process="<index>"` (sum
it away in queries: `sum without (sluice_process) (...)`). A process that does not answer within
`TIMEOUT_S` (restarting, say) is left out of that one answer.

Protocol on the socket: the asker writes `metrics\\n` or `dashboard\\n`; the process writes the Prometheus
text, or the dashboard's JSON snapshot, and closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

LABEL = "sluice_process"
TIMEOUT_S = 1.0
RECENT = 20  # the dashboard's last finished requests, over all the processes
MAX_ANSWER = 16 * 1024 * 1024


class Siblings:
    """This process's socket, and the way to the others'. `dashboard` gives this process's snapshot."""

    def __init__(self, directory: Path, index: int, dashboard: Callable[[], dict[str, Any]]) -> None:
        self.directory, self.index, self._dashboard = directory, index, dashboard
        self._server: asyncio.AbstractServer | None = None

    @classmethod
    def from_env(cls, dashboard: Callable[[], dict[str, Any]]) -> Siblings | None:
        """The siblings `sluice run` set up (`SLUICE_RUN_DIR`, `SLUICE_PROCESS`), else None."""
        directory, index = os.environ.get("SLUICE_RUN_DIR"), os.environ.get("SLUICE_PROCESS")
        if not directory or index is None or not index.isdigit():
            return None
        return cls(Path(directory), int(index), dashboard)

    def _own(self, what: str) -> bytes:
        return generate_latest() if what == "metrics" else json.dumps(self._dashboard()).encode()

    async def start(self) -> None:
        path = self.directory / f"{self.index}.sock"
        path.unlink(missing_ok=True)  # this index's socket from before a restart

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                what = (await asyncio.wait_for(reader.readline(), TIMEOUT_S)).strip().decode()
                if what in ("metrics", "dashboard"):
                    writer.write(self._own(what))
                    await writer.drain()
            except (OSError, TimeoutError, UnicodeDecodeError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_unix_server(answer, path=str(path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _ask(self, path: Path, what: str) -> bytes | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), TIMEOUT_S)
        except (OSError, TimeoutError):
            return None
        try:
            writer.write(f"{what}\n".encode())
            return await asyncio.wait_for(_until_closed(reader), TIMEOUT_S)
        except (OSError, TimeoutError):
            return None
        finally:
            writer.close()

    async def gather(self, what: str) -> dict[str, bytes]:
        """Every process's answer to `what`, by index: this one's own, the others' over their sockets."""
        others = sorted(p for p in self.directory.glob("*.sock") if p.stem.isdigit() and int(p.stem) != self.index)
        answers = await asyncio.gather(*(self._ask(path, what) for path in others))
        found = {path.stem: answer for path, answer in zip(others, answers, strict=True) if answer}
        return {str(self.index): self._own(what), **found}

    async def metrics(self) -> bytes:
        return merged_metrics({index: text.decode() for index, text in (await self.gather("metrics")).items()})

    async def dashboard(self) -> dict[str, Any]:
        snapshots = {}
        for index, raw in (await self.gather("dashboard")).items():
            try:
                snapshots[index] = json.loads(raw)
            except ValueError:
                log.warning("process %s sent an unreadable dashboard snapshot", index)
        return merged_snapshot(snapshots, str(self.index))


async def _until_closed(reader: asyncio.StreamReader) -> bytes | None:
    """All the peer wrote before it closed; None past MAX_ANSWER bytes."""
    parts, size = [], 0
    while chunk := await reader.read(65536):
        parts.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER:
            return None
    return b"".join(parts)


class _Families:
    """What generate_latest reads: a `collect()`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merged_metrics(texts: Mapping[str, str]) -> bytes:
    """The Prometheus texts of several processes as one, each sample labelled with its process."""
    families: dict[str, Metric] = {}
    for index, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            into.samples += [sample._replace(labels={**sample.labels, LABEL: index}) for sample in family.samples]
    return generate_latest(_Families(list(families.values())))  # type: ignore[arg-type]


def merged_snapshot(snapshots: Mapping[str, dict[str, Any]], own: str) -> dict[str, Any]:
    """The dashboard snapshots of several processes as one: every sample labelled with its process, the
    last finished requests of all of them, and this process's last trace (else another's)."""
    samples: dict[str, list[list[Any]]] = {}
    for index, snapshot in snapshots.items():
        for name, rows in snapshot.get("samples", {}).items():
            samples.setdefault(name, []).extend([{**labels, LABEL: index}, value] for labels, value in rows)
    requests = sorted((r for s in snapshots.values() for r in s.get("requests", [])), key=lambda r: r.get("at", 0))
    waterfalls = [snapshot.get("waterfall") for _, snapshot in sorted(snapshots.items(), key=lambda item: item[0] != own)]
    return {"at": time.time(), "samples": samples, "requests": requests[-RECENT:],
            "waterfall": next((w for w in waterfalls if w), None)}
