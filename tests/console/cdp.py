"""A headless Chromium driven over the Chrome DevTools Protocol (its websocket, with aiohttp): just
what the console tests need. Debian's ``chromium`` package (scripts/test.sh installs it)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

LISTENING = re.compile(r"DevTools listening on (ws://\S+)")
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One Chromium process with a fresh profile, and one page of it. ``errors`` collects what the
    page's console reports as errors (console.error, uncaught exceptions, failed loads)."""

    def __init__(self, profile: Path) -> None:
        self.profile = profile
        self.proc: subprocess.Popen[bytes] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.errors: list[str] = []
        self._ids = 0
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        exe = chromium_path()
        assert exe is not None
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             "--disable-extensions", "--mute-audio", "--window-size=1400,1000", f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        browser_ws = await asyncio.wait_for(asyncio.to_thread(self._read_ws_url), START_TIMEOUT_S)
        port = int(browser_ws.split(":")[2].split("/")[0])
        self.session = aiohttp.ClientSession()
        page_ws = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while page_ws is None and time.monotonic() < deadline:
            async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t.get("type") == "page"]
            if pages:
                page_ws = pages[0]["webSocketDebuggerUrl"]
            else:
                await asyncio.sleep(0.1)
        assert page_ws is not None, "chromium opened no page"
        self.ws = await self.session.ws_connect(page_ws, max_msg_size=64 << 20)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        for domain in ("Runtime", "Log", "Page", "Network"):
            await self.send(f"{domain}.enable")

    def _read_ws_url(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            m = LISTENING.search(raw.decode(errors="replace"))
            if m:
                # Keep draining stderr so chromium never blocks on a full pipe.
                threading.Thread(target=_drain, args=(self.proc.stderr,), daemon=True).start()
                return m.group(1)
        raise RuntimeError("chromium exited before it listened for DevTools")

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    if "error" in data:
                        fut.set_exception(RuntimeError(f"CDP error: {data['error']}"))
                    else:
                        fut.set_result(data.get("result", {}))
                continue
            self._event(data.get("method", ""), data.get("params", {}))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description", "")))
                                                           for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(details.get("exception", {}).get("description")
                                                   or details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.ws is not None
        self._ids += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[self._ids] = fut
        await self.ws.send_str(json.dumps({"id": self._ids, "method": method, "params": params or {}}))
        return await asyncio.wait_for(fut, COMMAND_TIMEOUT_S)  # type: ignore[no-any-return]

    async def set_auth(self, header: str | None) -> None:
        await self.send("Network.setExtraHTTPHeaders", {"headers": {"Authorization": header} if header else {}})

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})

    async def eval(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                 "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluate {expression!r}: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    async def wait_for(self, what: str, expression: str, timeout: float) -> Any:
        """Evaluates ``expression`` until it is truthy; AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = await self.eval(expression)
            except RuntimeError as exc:  # the page is navigating
                last = exc
            if last:
                return last
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")

    async def screenshot(self, path: Path) -> None:
        r = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(r["data"]))

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait, 5)
