"""OTLP export from a child process: the spans of each batch leave the stage process as a pickled list of
plain tuples on a pipe (`pipeline.observability.otlp.flatten`: the form the encoder reads), and a child
(`python -m pipeline.observability.export_child`) encodes and POSTs them with `OtlpHttpExporter`, as a
collector beside the process would.

Why: encoding and posting in the batch processor's thread hold the GIL the event loop needs; at the knee
they were about 2-3 points of the ~6% that tracing cost a stage process (docs/benchmarks.md, tracing
overhead). Flattening and pickling a span costs less than half of encoding it (bench/span_cost.py: 4.0
against 9.0 µs); the child unpickles and encodes the tuples as they are (6 µs a span, on its own GIL and
core; bench/tracing_overhead.py counts its CPU with the stage process's).

The pipe: each frame is a 4-byte big-endian length and that many bytes of pickle (a list of `flatten()`
tuples); a length of 0 is a flush, followed by a 4-byte token the child writes back on its stdout once
it has posted every batch before it. The child trusts its pipe (only its parent writes to it), exits
when the pipe closes (its parent shut down or died), and ignores SIGINT so that a Ctrl-C in a terminal
leaves it to post the last spans its parent hands it while shutting down. It runs at a lower priority
(NICE): exporting is background work, and at the knee of a busy host its CPU would otherwise be taken
from the stages and the broker; the pipe and the batch processor's queue absorb the delay. A child that
died is started again on the next batch, at most every RESTART_S seconds (batches that find no child are
dropped and logged, as a failed post is).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pipeline.observability.otlp import OtlpHttpExporter, flatten

log = logging.getLogger(__name__)
_LENGTH = struct.Struct(">I")
ROOT = Path(__file__).resolve().parents[2]  # the directory holding the `pipeline` package
RESTART_S = 5.0  # a child is started at most this often: batches in between are dropped (and logged)
NICE = 10  # the child's niceness: on a busy host the stages and the broker come first, export catches up after


class ChildExporter(SpanExporter):
    """A SpanExporter for the batch processor: hands each batch to the export child, started on the
    first batch (and again after it died)."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        OtlpHttpExporter(endpoint, timeout_s)  # refuses a bad endpoint here, in the parent, as the in-process one does
        self._argv = [sys.executable, "-m", "pipeline.observability.export_child", endpoint, str(timeout_s)]
        self._child: subprocess.Popen[bytes] | None = None
        self._origins: dict[tuple[int, int], tuple[Any, Any, tuple]] = {}
        self._lock = threading.Lock()  # the batch processor's worker and a force_flush may both write
        self._token = 0
        self._next_start = 0.0  # monotonic time before which no new child is started

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def _started(self) -> subprocess.Popen[bytes] | None:
        """The running child, started (again) if it is not running; None while a child that died is not
        yet due to be replaced (one that cannot start must not cost an interpreter's start-up per batch)."""
        if self._child is None or self._child.poll() is not None:
            if self._child is not None:
                log.warning("the span export child exited (%s); starting another", self._child.returncode)
                _close_pipes(self._child)
                self._child = None
            if time.monotonic() < self._next_start:
                return None
            self._next_start = time.monotonic() + RESTART_S
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
            self._child = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._child

    def _write(self, data: bytes) -> bool:
        child = self._started()
        if child is None:
            return False
        try:
            assert child.stdin is not None
            child.stdin.write(data)
            child.stdin.flush()
            return True
        except (OSError, ValueError) as exc:  # the child died: this batch is lost, the next starts another
            log.warning("span export child unreachable: %s", type(exc).__name__)
            return False

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        origins = self._origins
        payload = pickle.dumps([flatten(span, origins) for span in spans], protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            ok = self._write(_LENGTH.pack(len(payload)) + payload)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Waits until the child has posted every batch handed to it before this call."""
        with self._lock:
            if self._child is None:
                return True
            self._token = (self._token + 1) % (1 << 32)
            token = _LENGTH.pack(self._token)
            if not self._write(_LENGTH.pack(0) + token):
                return False
            assert self._child.stdout is not None
            out = self._child.stdout.fileno()
            deadline = time.monotonic() + timeout_millis / 1000
            while (left := deadline - time.monotonic()) > 0:
                if not select.select([out], [], [], left)[0]:
                    break
                answer = os.read(out, 4)  # tokens are 4 bytes, written whole on a pipe
                if not answer:
                    return False
                if answer == token:
                    return True
            return False

    def shutdown(self, timeout_millis: int = 30000) -> None:
        """Closes the pipe; the child posts what it holds and exits (or is killed past the timeout)."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        try:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout_millis / 1000)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()
        _close_pipes(child)


def _close_pipes(child: subprocess.Popen[bytes]) -> None:
    for pipe in (child.stdin, child.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:  # a broken pipe's buffered bytes cannot be flushed: they were for a dead child
            pass


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s sluice-export %(message)s")
    exporter = OtlpHttpExporter(argv[1], float(argv[2]))
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    try:
        while len(head := source.read(4)) == 4:
            length = _LENGTH.unpack(head)[0]
            if length == 0:  # a flush: every batch before it has been posted
                answers.write(source.read(4))
                answers.flush()
                continue
            exporter.export_flat(pickle.loads(source.read(length)))  # noqa: S301 (its parent's pipe)
    finally:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
