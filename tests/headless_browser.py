"""A headless Chromium driven over the DevTools protocol on a pipe (no extra Python packages).

``--remote-debugging-pipe`` makes Chromium read protocol commands from file descriptor 3 and
write replies and events to descriptor 4, each message a JSON text ended by a NUL byte. That
is all a test needs to load a page, read what it logged, run a script in it, move the mouse
and take a screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--remote-debugging-pipe"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One Chromium process with one page; ``events`` keeps every event the page sent."""

    def __init__(self, executable: str, *, width: int = 1400, height: int = 1000, timeout: float = 60.0):
        self.timeout = timeout
        self.events: list[dict] = []
        self._ids = iter(range(1, 1 << 30))
        self._buffer = b""
        self._profile = tempfile.mkdtemp(prefix="ssmshard-chromium-")
        to_child, self._write = os.pipe()  # the browser reads commands on fd 3
        self._read, from_child = os.pipe()  # and writes replies on fd 4

        def wire_pipes():  # in the child, before exec; through high numbers in case either end is 3 or 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            preexec_fn=wire_pipes, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        try:
            page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
            # Commands for the page go through its DevTools sessionId ("flat" mode: one pipe for all).
            self.page_id = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.page(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    # -------------------------------------------------------------- protocol
    def send(self, method: str, target: str | None = None, **params) -> dict:
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params}
        if target:
            message["sessionId"] = target
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._next_message(deadline)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def page(self, method: str, **params) -> dict:
        return self.send(method, self.page_id, **params)

    def _next_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its protocol pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def wait_for_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for event in self.events:
                if event["method"] == method:
                    return event
            self.events.append(self._next_message(deadline))

    # -------------------------------------------------------------- what tests use
    def load(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        self.wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def hover(self, x: float, y: float) -> None:
        self.page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: str) -> None:
        data = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries, as text."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"])
        return found

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e["method"] == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._read)
        os.close(self._write)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
