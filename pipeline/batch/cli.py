"""`sluice batch`: batch jobs from the command line.

    sluice batch submit in.jsonl [--wait] [-o out.jsonl]   upload and start a job on the bridge; --wait shows
                                                           a progress bar (done, failed, rate, ETA), then -o
                                                           writes the results
    sluice batch status|cancel ID                           the job as JSON
    sluice batch results ID -o out.jsonl [--errors e.jsonl] its output (and error) file
    sluice batch list                                       your jobs, newest first
    sluice batch run in.jsonl -o out.jsonl                  direct mode for services on Kafka: no bridge;
                                                           progress in Redis, so running the same command
                                                           again resumes the job where it stopped
    sluice batch worker                                     run jobs in this process (the bridge does too)

The bridge commands talk HTTP to `--base-url` (default: the configured bridge) with `--api-key`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from pipeline.batch.errors import BatchError
from pipeline.batch.records import TERMINAL, Batch, Status
from pipeline.settings import Settings

ENDPOINT = "/v1/chat/completions"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    batch = sub.add_parser("batch", help="batch jobs (OpenAI's Batch API) through the pipeline")
    actions = batch.add_subparsers(dest="action", required=True)

    def bridge_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--base-url", default=None, help="the bridge's /v1 URL (default: the configured bridge)")
        p.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                       help="an API key from `sluice keys create`; default $SLUICE_API_KEY (an argument is visible to every local user in ps)")

    submit = actions.add_parser("submit", help="upload a JSONL file and start a job on the bridge")
    submit.add_argument("input", type=Path)
    submit.add_argument("--endpoint", default=ENDPOINT, choices=["/v1/chat/completions", "/v1/completions"])
    submit.add_argument("--wait", action="store_true", help="show progress until the job ends")
    submit.add_argument("-o", "--output", type=Path, default=None, help="with --wait: write the results here")
    submit.add_argument("--errors", type=Path, default=None, help="with --wait: write the error file here")
    bridge_args(submit)
    for name, text in (("status", "the job as JSON"), ("cancel", "cancel the job")):
        p = actions.add_parser(name, help=text)
        p.add_argument("batch_id")
        bridge_args(p)
    results = actions.add_parser("results", help="download a job's output (and error) file")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", type=Path, required=True)
    results.add_argument("--errors", type=Path, default=None)
    bridge_args(results)
    bridge_args(actions.add_parser("list", help="your jobs, newest first"))
    run = actions.add_parser("run", help="direct mode: run a JSONL file over Kafka, no bridge; resumable")
    run.add_argument("input", type=Path)
    run.add_argument("-o", "--output", type=Path, required=True)
    run.add_argument("--errors", type=Path, default=None, help="default: OUTPUT with .errors.jsonl")
    run.add_argument("--endpoint", default=ENDPOINT, choices=["/v1/chat/completions", "/v1/completions"])
    run.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY"),
                       help="an API key from `sluice keys create`; default $SLUICE_API_KEY (an argument is visible to every local user in ps)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    actions.add_parser("worker", help="run batch jobs in this process")


async def run(settings: Settings, args: argparse.Namespace) -> int:
    try:
        if args.action == "run":
            return await _direct(settings, args)
        if args.action == "worker":
            return await _worker(settings)
        async with _http(settings, args) as http:
            if args.action == "submit":
                return await _submit(http, args)
            if args.action == "list":
                page = await _call(http.get("/batches", params={"limit": 100}))
                for b in page["data"]:
                    c = b["request_counts"]
                    print(f"{b['id']}\t{b['status']}\t{c['completed']}+{c['failed']}/{c['total']}\t{b['created_at']}")
                return 0
            if args.action == "status":
                print(json.dumps(await _call(http.get(f"/batches/{args.batch_id}")), indent=2))
                return 0
            if args.action == "cancel":
                print(json.dumps(await _call(http.post(f"/batches/{args.batch_id}/cancel")), indent=2))
                return 0
            batch = await _call(http.get(f"/batches/{args.batch_id}"))
            return await _download(http, batch, args.output, args.errors)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


class _Refused(Exception):
    pass


class _Unreachable(_Refused):
    """The bridge did not answer at all."""


def _http(settings: Settings, args: argparse.Namespace) -> httpx.AsyncClient:
    base = args.base_url or _bridge_url(settings)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(60.0, connect=5.0))


def _bridge_url(settings: Settings) -> str:
    """The configured bridge's /v1 URL: https where `[gateway.tls]` serves it (the certificate is checked
    against httpx's CA bundle, or the file SSL_CERT_FILE names), an IPv6 host in brackets."""
    scheme = "https" if settings.gateway.tls.certfile else "http"
    host = settings.bridge.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{settings.bridge.port}/v1"


async def _call(pending: Any) -> dict[str, Any]:
    try:
        response: httpx.Response = await pending
    except httpx.HTTPError as exc:
        raise _Unreachable(f"the bridge did not answer ({type(exc).__name__}): is `make run` up?") from None
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise _Refused(f"{response.status_code}: {message}")
    result: dict[str, Any] = response.json()
    return result


async def _submit(http: httpx.AsyncClient, args: argparse.Namespace) -> int:
    with args.input.open("rb") as f:
        uploaded = await _call(http.post("/files", data={"purpose": "batch"}, files={"file": (args.input.name, f)}))
    body = {"input_file_id": uploaded["id"], "endpoint": args.endpoint, "completion_window": "24h"}
    batch = await _call(http.post("/batches", json=body))
    print(f"{batch['id']} ({uploaded['id']}, {uploaded['bytes']} bytes)", file=sys.stderr)
    if not args.wait:
        print(batch["id"])
        return 0

    async def poll() -> dict[str, Any]:
        """The job; while the bridge is away (restarting), the job goes on without it: keep asking."""
        while True:
            try:
                return await _call(http.get(f"/batches/{batch['id']}"))
            except _Unreachable:
                await asyncio.sleep(2.0)

    batch = await _follow(poll, lambda b: b["request_counts"], lambda b: b["status"] in {s.value for s in TERMINAL})
    print(json.dumps({k: batch[k] for k in ("id", "status", "request_counts", "output_file_id", "error_file_id")}))
    code = _verdict(batch["status"], batch["request_counts"])
    if args.output is not None:
        await _download(http, batch, args.output, args.errors)
    return code


async def _download(http: httpx.AsyncClient, batch: dict[str, Any], output: Path, errors: Path | None) -> int:
    if batch["status"] not in {s.value for s in TERMINAL}:
        raise _Refused(f"batch {batch['id']} is {batch['status']}: no results yet")
    for file_id, path in ((batch["output_file_id"], output), (batch["error_file_id"], errors)):
        if path is None:
            continue
        if file_id is None:
            path.write_bytes(b"")
            continue
        async with http.stream("GET", f"/files/{file_id}/content") as response:
            if response.status_code >= 400:
                raise _Refused(f"{response.status_code} downloading {file_id}")
            with path.open("wb") as out:
                async for piece in response.aiter_bytes():
                    out.write(piece)
        print(f"wrote {path}", file=sys.stderr)
    return 0


async def _follow(poll: Any, counts_of: Any, ended: Any) -> Any:
    """Polls until `ended`, showing done, failed, rate and ETA; returns the last poll."""
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TextColumn("done {task.fields[done]}  failed {task.fields[failed]}  {task.fields[rate]:.1f} lines/s"),
               TimeRemainingColumn())
    started = time.monotonic()
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("batch", total=None, done=0, failed=0, rate=0.0)
        while True:
            current = await poll()
            counts = counts_of(current)
            finished = counts["completed"] + counts["failed"]
            rate = finished / max(time.monotonic() - started, 1e-6)
            progress.update(task, total=counts["total"] or None, completed=finished, done=counts["completed"],
                            failed=counts["failed"], rate=rate)
            if ended(current):
                return current
            await asyncio.sleep(0.5)


def _verdict(status: str, counts: dict[str, int]) -> int:
    """0 when the job completed with at least one answer; 1 otherwise (failed, cancelled, expired, or
    every line failed: a job with nothing to show is not a success)."""
    if status != Status.completed.value:
        print(f"the batch ended {status}", file=sys.stderr)
        return 1
    if counts["total"] and counts["failed"] == counts["total"]:
        print(f"every one of the {counts['total']} lines failed: see the error file", file=sys.stderr)
        return 1
    if counts["failed"]:
        print(f"{counts['failed']} of {counts['total']} lines failed: see the error file", file=sys.stderr)
    return 0


async def _direct(settings: Settings, args: argparse.Namespace) -> int:
    """`sluice batch run`: the job's id comes from the caller and the file's bytes, so the same command
    finds the job it started before and resumes it."""
    from pipeline.batch.direct import DirectJob

    data = args.input.read_bytes()
    errors = args.errors or args.output.with_suffix(".errors.jsonl")
    try:
        job = DirectJob(settings, args.api_key)
        await job.start()
    except BatchError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    try:
        try:
            batch = await job.prepare(io.BytesIO(data), args.input.name, hashlib.sha256(data).hexdigest(), args.endpoint)
        except BatchError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
        print(f"{batch.id}: {'resuming' if batch.status is not Status.validating else 'starting'}", file=sys.stderr)
        batch = await job.run(batch, show=None if args.quiet else _follow)
        job.copy_results(batch, args.output, errors)
        counts = await job.store.counts(batch.id)
        shown = {"id": batch.id, "status": batch.status.value, "total": batch.total, "completed": counts.completed,
                 "failed": counts.failed, "output": str(args.output), "errors": str(errors)}
        print(json.dumps(shown))
        return _verdict(batch.status.value, {"total": batch.total, "completed": counts.completed, "failed": counts.failed})
    finally:
        await job.stop()


async def _worker(settings: Settings) -> int:
    from pipeline.batch.service import run_worker
    from pipeline.serve import configure_logging

    configure_logging()
    await run_worker(settings)
    return 0


__all__ = ["Batch", "add_parser", "run"]
