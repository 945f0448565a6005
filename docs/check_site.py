"""Check the built site in a real browser: Debian's Chromium, headless, driven over the
DevTools protocol on a pipe (no browser-automation package).

    python docs/check_site.py [SITE_DIR]      # `make docs-check` builds the site first

A small HTTP server on 127.0.0.1 serves SITE_DIR (default `site`); Chromium loads every
page at a window 1280 px wide and the check fails (exit status 1) when

- a page logs a console error, throws, or a request fails (a status of 400 or more, a
  network error, a request to a host other than the local server);
- an internal link (`<a href>`, fragment included) or an image (`<img src>`) does not
  resolve to a file of the site (or to an element id of the page it names);
- a code block (`pre > code`) scrolls sideways: its scrolling element is wider than
  its box by more than 1 px (a wide table may scroll in its own frame, the page may not);
- the site's search, given `sliding_window` in its box, lists no result naming it.

Chromium runs with `--remote-debugging-pipe`: it reads the protocol's JSON commands from
its file descriptor 3 and writes replies and events to its descriptor 4, each message
ended by a NUL byte. Host names other than 127.0.0.1 do not resolve in it, so the check
never leaves the machine; the hosts in `--allow-external` (the theme's web fonts, which
fall back to local fonts) may fail without failing the check.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import posixpath
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urldefrag, urlsplit

WIDTH, HEIGHT = 1280, 900
SEARCH_TERM = "sliding_window"
FONT_HOSTS = ("fonts.googleapis.com", "fonts.gstatic.com")

# per page: every link's and image's resolved URL, every element id, and the code blocks
# that scroll sideways (the scrolling element is `code` in mkdocs-material, else `pre`)
PAGE_SCAN = """(() => {
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const images = [...document.querySelectorAll('img')].map(i => ({
    src: i.currentSrc || i.src, broken: i.complete && i.naturalWidth === 0}));
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id)
    .concat([...document.querySelectorAll('a[name]')].map(a => a.name));
  const wide = [];
  for (const code of document.querySelectorAll('pre > code')) {
    const overflow = getComputedStyle(code).overflowX;
    const el = (overflow === 'auto' || overflow === 'scroll') ? code : code.parentElement;
    if (el.clientWidth === 0) continue;  // not displayed (a closed <details>)
    if (el.scrollWidth > el.clientWidth + 1) {
      const line = code.textContent.split('\\n')
        .reduce((a, b) => (b.length > a.length ? b : a), '');
      wide.push({scroll: el.scrollWidth, client: el.clientWidth, line: line.trim()});
    }
  }
  const page = document.documentElement;  // a wide table scrolls in its own frame only
  return {links, images, ids, wide, page: [page.scrollWidth, page.clientWidth]};
})()"""

SEARCH_RESULTS = """(() => {
  const items = [...document.querySelectorAll('.md-search-result__item')];
  const meta = document.querySelector('.md-search-result__meta');
  return {meta: meta ? meta.textContent.trim() : '',
          results: items.map(li => {
            const a = li.querySelector('a');
            return {href: a ? a.href : '', text: li.textContent.replace(/\\s+/g, ' ').trim()};
          })};
})()"""


class DevTools:
    """A DevTools protocol client over Chromium's pipe (descriptors 3 and 4)."""

    def __init__(self, chromium: str, args: list[str]) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def descriptors() -> None:  # in the child: its 3 reads commands, its 4 writes replies
            read, write = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.process = subprocess.Popen(
            [chromium, *args],
            preexec_fn=descriptors,
            close_fds=False,  # keeps 3 and 4 (the other pipe ends close on exec)
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_browser, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._lock:
                        reply = self._replies.pop(message["id"], None)
                    if reply is not None:
                        reply.put(message)
                else:
                    self.events.put(message)
        self.events.put({"method": "closed"})

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        reply: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._next_id += 1
            message: dict[str, Any] = {"id": self._next_id, "method": method}
            self._replies[self._next_id] = reply
        message["params"] = params or {}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=60)
        except queue.Empty:
            raise RuntimeError(f"Chromium did not answer {method} within 60 s") from None
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error'].get('message')}")
        return dict(answer.get("result", {}))

    def close(self) -> None:
        with suppress(OSError, RuntimeError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._to_browser)


class Tab:
    """One page of the browser: navigation, evaluation, and the problems it reports."""

    def __init__(
        self, browser: DevTools, origin: str, allowed: tuple[str, ...], width: int
    ) -> None:
        self.browser, self.origin, self.allowed = browser, origin, allowed
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self.send(method)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        # the search's web worker: its console and requests count too
        self.send(
            "Target.setAutoAttach",
            {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True},
        )
        self.problems: list[str] = []
        self._urls: dict[str, str] = {}
        self._pending: set[str] = set()
        self._loaded = False

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def _external(self, url: str) -> str | None:
        """The host of a request that leaves the local server, None for the site's own."""
        parts = urlsplit(url)
        if parts.scheme in ("data", "blob", "about", "chrome-error"):
            return None
        if f"{parts.scheme}://{parts.netloc}" == self.origin:
            return None
        return parts.hostname or url

    def _problem(self, text: str, url: str = "") -> None:
        host = self._external(url) if url else None
        if host in self.allowed:
            return  # an allowed outside host (the theme's web fonts): failing is fine
        self.problems.append(text)

    def _handle(self, event: dict[str, Any]) -> None:
        method, params = event.get("method", ""), event.get("params", {})
        if method == "Target.attachedToTarget":  # a worker: listen to it too
            session, worker = params["sessionId"], params["targetInfo"]["url"]
            # its script's request finishes in the worker's session, which may report
            # it before it listens: the worker running is the script loaded (a failed
            # load shows in the server's log, see `serve`)
            self._pending -= {r for r in self._pending if self._urls.get(r) == worker}
            for worker_method in ("Runtime.enable", "Network.enable", "Log.enable"):
                with suppress(RuntimeError):  # a worker without that domain
                    self.browser.send(worker_method, None, session)
        elif method == "Page.loadEventFired":
            self._loaded = True
        elif method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            self._urls[params["requestId"]] = url
            self._pending.add(params["requestId"])
            host = self._external(url)
            if host is not None and host not in self.allowed:
                self.problems.append(f"request outside the site: {url}")
        elif method in ("Network.loadingFinished", "Network.loadingFailed"):
            self._pending.discard(params["requestId"])
            if method == "Network.loadingFailed":
                url = self._urls.get(params["requestId"], "?")
                self._problem(f"request failed ({params.get('errorText')}): {url}", url)
        elif method == "Network.responseReceived":
            status, url = params["response"]["status"], params["response"]["url"]
            if status >= 400:
                self._problem(f"HTTP {status}: {url}", url)
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self._problem(f"uncaught exception: {text}", details.get("url", ""))
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self._problem(f"console.{params['type']}: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            self._problem(
                f"console error: {entry['text']} {entry.get('url', '')}", entry.get("url", "")
            )

    def pump(self, seconds: float) -> None:
        """Handle the browser's events for `seconds`."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            try:
                event = self.browser.events.get(timeout=left)
            except queue.Empty:
                return
            if event.get("method") == "closed":
                raise RuntimeError("Chromium exited")
            self._handle(event)

    def load(self, url: str, timeout: float = 30.0) -> None:
        """Navigate and wait for the load event and then 0.5 s without a request in flight."""
        self.problems, self._loaded, self._pending = [], False, set()
        reply = self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            self.problems.append(f"navigation failed: {reply['errorText']}")
            return
        end, quiet_since = time.monotonic() + timeout, None
        while time.monotonic() < end:
            self.pump(0.1)
            if self._loaded and not self._pending:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= 0.5:
                    return
            else:
                quiet_since = None
        waiting = ", ".join(self._urls.get(r, r) for r in self._pending) or "the load event"
        self.problems.append(f"did not finish loading within {timeout:.0f} s: {waiting}")

    def press(self, key: str, text: str = "") -> None:
        """A key pressed and released in the focused element, as a keyboard does."""
        down: dict[str, Any] = {"type": "keyDown" if text else "rawKeyDown", "key": key}
        if text:
            down |= {"text": text, "unmodifiedText": text}
        elif key == "Backspace":
            down |= {"code": "Backspace", "windowsVirtualKeyCode": 8}
        self.send("Input.dispatchKeyEvent", down)
        self.send("Input.dispatchKeyEvent", {**down, "type": "keyUp"})

    def evaluate(self, expression: str) -> Any:
        reply = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"evaluating in the page: {reply['exceptionDetails']}")
        return reply["result"].get("value")


@contextmanager
def serve(root: Path, errors: list[str] | None = None) -> Iterator[str]:
    """Serve `root` on 127.0.0.1 at a free port, quietly; yields the origin. Each
    answer of status 400 or more is appended to `errors` (the browser's view of a
    request can miss one, a worker's for example)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            if errors is not None and int(code) >= 400:
                errors.append(f"the server answered {code}: {self.path}")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def site_file(root: Path, origin: str, url: str) -> Path | None:
    """The file of the site a same-origin URL names (`dir/` names `dir/index.html`)."""
    path = unquote(urlsplit(url).path)
    relative = posixpath.normpath(path).lstrip("/")
    candidate = root / relative if relative not in ("", ".") else root
    if path.endswith("/") or candidate.is_dir():
        candidate = candidate / "index.html"
    return candidate if candidate.is_file() else None


def layout_problems(scan: dict[str, Any]) -> list[str]:
    """The code blocks that scroll sideways, and the page if it does."""
    found = [
        f"code scrolls sideways ({w['scroll']} > {w['client']} px): {w['line'][:100]}"
        for w in scan["wide"]
    ]
    if scan["page"][0] > scan["page"][1] + 1:
        found.append("the page scrolls sideways ({} > {} px)".format(*scan["page"]))
    return found


def check_links(root: Path, origin: str, scans: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Links and images that do not resolve, per page."""
    ids = {site_file(root, origin, url): set(scan["ids"]) for url, scan in scans.items()}
    problems: dict[str, list[str]] = {}
    for url, scan in scans.items():
        found = problems.setdefault(url, [])
        for link in dict.fromkeys(scan["links"]):
            if not link.startswith(origin + "/"):
                continue  # outside the site: not checked
            target, fragment = urldefrag(link)
            file = site_file(root, origin, target)
            if file is None:
                found.append(f"broken link: {link}")
            elif fragment and file in ids and unquote(fragment) not in ids[file]:
                found.append(f"broken anchor: {link}")
        for image in scan["images"]:
            src = image["src"]
            if src.startswith(origin + "/") and site_file(root, origin, src) is None:
                found.append(f"broken image: {src}")
            elif image["broken"]:
                found.append(f"image does not decode: {src}")
    return problems


def check_search(tab: Tab, url: str, timeout: float = 30.0) -> list[str]:
    """Type the term into the search box and read the results (the index loads in a
    web worker: retype until it answers)."""
    tab.load(url)
    end = time.monotonic() + timeout
    found: dict[str, Any] = {"meta": "", "results": []}
    while time.monotonic() < end:
        # empty the box and type the term key by key (the search reads the box on key
        # events): a query typed before the worker had its index may go unanswered
        tab.evaluate(
            "(() => { const i = document.querySelector('input.md-search__input');"
            " i.focus(); i.select(); })()"
        )
        tab.press("Backspace")
        for char in SEARCH_TERM:
            tab.press(char, text=char)
        tab.pump(1.0)
        found = tab.evaluate(SEARCH_RESULTS)
        if found["results"]:
            break
    named = [r for r in found["results"] if SEARCH_TERM in r["text"]]
    print(f"search {SEARCH_TERM!r}: {found['meta'] or 'no answer'}")
    for result in found["results"][:5]:
        print(f"  {result['href'].removeprefix(tab.origin)}  {result['text'][:90]}")
    problems = list(tab.problems)
    if not named:
        problems.append(f"search for {SEARCH_TERM!r} lists no result naming it ({found['meta']!r})")
    return problems


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("check_site: no chromium on PATH (Debian: apt-get install chromium)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="site", type=Path)
    parser.add_argument("--chromium", default=None, help="the browser (default: chromium on PATH)")
    parser.add_argument(
        "--allow-external",
        nargs="*",
        default=list(FONT_HOSTS),
        metavar="HOST",
        help="outside hosts whose requests may fail (default: the theme's web fonts)",
    )
    parser.add_argument("--width", type=int, default=WIDTH, help="window width, px (1280)")
    parser.add_argument("--only", default="", help="check the pages whose path holds this")
    options = parser.parse_args()
    root = options.site.resolve()
    pages = [p for p in sorted(root.rglob("*.html")) if options.only in p.as_posix()]
    if not pages:
        sys.exit(f"check_site: no pages in {root} (build the site first: make docs)")
    start = time.monotonic()
    served_errors: list[str] = []
    with tempfile.TemporaryDirectory() as profile, serve(root, served_errors) as origin:
        args = [
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            f"--window-size={options.width},{HEIGHT}",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--mute-audio",
            *(["--no-sandbox"] if os.geteuid() == 0 else []),  # root (CI containers)
            "about:blank",
        ]
        browser = DevTools(options.chromium or find_chromium(), args)
        try:
            tab = Tab(browser, origin, tuple(options.allow_external), options.width)
            problems: dict[str, list[str]] = {}
            scans: dict[str, dict[str, Any]] = {}
            for page in pages:
                relative = page.relative_to(root).as_posix()
                url = f"{origin}/{relative.removesuffix('index.html')}"
                served_errors.clear()
                tab.load(url)
                scan = tab.evaluate(PAGE_SCAN)
                scans[url] = scan
                problems[url] = tab.problems + served_errors + layout_problems(scan)
            for url, found in check_links(root, origin, scans).items():
                problems[url] += found
            search = check_search(tab, f"{origin}/")
        finally:
            browser.close()
    failed = 0
    for url, found in problems.items():
        path = url.removeprefix(origin) or "/"
        print(f"{'ok  ' if not found else 'FAIL'} {path}")
        for problem in dict.fromkeys(found):
            print(f"       {problem}")
        failed += bool(found)
    for problem in search:
        print(f"FAIL search: {problem}")
    print(
        f"check_site: {len(pages)} pages at {options.width} px, {failed} with problems, search "
        f"{'ok' if not search else 'FAILED'}; {time.monotonic() - start:.0f} s"
    )
    return 1 if failed or search else 0


if __name__ == "__main__":
    sys.exit(main())
