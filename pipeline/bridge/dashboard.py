"""`/dashboard`: a live page on the metrics /metrics serves (Chart.js 4.6.1, vendored from npm into
static/vendor/; no CDN: the page works offline).

    GET /dashboard              the page (static HTML, no data in it)
    GET /dashboard/static/...   its script, style sheet and the vendored chart library
    GET /dashboard/data         this process's sluice_* samples, its last finished requests and the
                                waterfall of its last trace, as JSON (with a bridge in every process of
                                `sluice run`: every process's, observability/siblings.py); the browser
                                turns successive snapshots into rates and percentiles

`/dashboard/data` is guarded like /metrics (edges.metrics_allowed): with a metrics token the page sends
it from the URL's fragment (`/dashboard#token=...`, never sent to the server in the URL).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from pipeline.bridge.edges import metrics_allowed
from pipeline.bridge.openai_format import Unauthorized
from pipeline.observability import recent
from pipeline.observability.siblings import Siblings
from pipeline.settings import Settings

STATIC = Path(__file__).resolve().parent / "static" / "dashboard"
PREFIX = "sluice_"


def snapshot() -> dict[str, Any]:
    """Every sluice_* sample of this process: {name: [[labels, value], ...]}."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith(PREFIX):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return {"at": time.time(), "samples": samples, "requests": recent.REQUESTS.items(), "waterfall": recent.TRACES.waterfall()}


def routes(settings: Settings, siblings: Siblings | None = None) -> list[BaseRoute]:
    """The page's routes; with `siblings` its data covers every process serving the bridge's port."""
    token, auth_required = settings.bridge.metrics_token, settings.gateway.auth_required

    async def page(request: HttpRequest) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    async def data(request: HttpRequest) -> Response:
        if not metrics_allowed(request, token, auth_required):
            if token:
                raise Unauthorized("/dashboard/data needs the metrics token")
            raise HTTPException(404, "Not Found")
        return JSONResponse(await siblings.dashboard() if siblings else snapshot(), headers={"cache-control": "no-store"})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/data", data, methods=["GET"]),
        Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static"),
    ]
