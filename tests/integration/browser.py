"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: open a page, collect its
console errors and uncaught exceptions, evaluate expressions, take a screenshot. A small client of our
own: the packages that wrap this (pyppeteer, playwright) download their own browser."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect


class Page:
    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []  # console errors, uncaught exceptions, failed loads
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if "id" in message and message["id"] in self._waiting:
                self._waiting.pop(message["id"]).set_result(message)
                continue
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                self.errors.append("exception: " + str(details.get("exception", {}).get("description", details.get("text"))))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluation failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))


class Browser:
    """`async with Browser() as browser: page = await browser.open(url)`."""

    def __init__(self, width: int = 1400, height: int = 1500) -> None:
        self._size = f"{width},{height}"
        self._process: subprocess.Popen[bytes] | None = None
        self._profile = tempfile.mkdtemp(prefix="sluice-chromium-")
        self._log = Path(self._profile) / "chromium.log"
        self._pages: list[tuple[Page, ClientConnection]] = []
        self._port = 0

    async def __aenter__(self) -> Browser:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            raise RuntimeError("chromium is not installed (make setup installs Debian's chromium)")
        self._log_file = self._log.open("wb")
        self._process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", f"--user-data-dir={self._profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--window-size={self._size}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self._log_file,
        )
        async with asyncio.timeout(60):
            while not (found := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", self._log.read_text(errors="replace"))):
                if self._process.poll() is not None:
                    raise RuntimeError(f"chromium exited before its DevTools endpoint was up: {self._log.read_text()[-2000:]}")
                await asyncio.sleep(0.1)
        self._port = int(found.group(1))
        return self

    async def open(self, url: str) -> Page:
        async with httpx.AsyncClient() as http:
            targets = (await http.get(f"http://127.0.0.1:{self._port}/json/list")).json()
        target = next(t for t in targets if t.get("type") == "page")
        ws = await connect(target["webSocketDebuggerUrl"], max_size=None)
        page = Page(ws)
        self._pages.append((page, ws))
        for domain in ("Runtime", "Log", "Page"):
            await page.send(f"{domain}.enable")
        await page.send("Page.navigate", url=url)
        return page

    async def __aexit__(self, *exc: object) -> None:
        for page, ws in self._pages:
            await ws.close()
            page._reader.cancel()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log_file.close()
        shutil.rmtree(self._profile, ignore_errors=True)
