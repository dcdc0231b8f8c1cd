"""The server as a process, with the fake engine (tests/fake_engine.py ``main``: ``llama.serve.serve``
with uvicorn on a thread and the engine loop on the main thread): what one client can cost the
others (bodies, connections, logs), and shutdown.  Real sockets, no model.

The tests that neither end the server nor need limits of their own share one server with the
default limits (the ``server`` fixture: idle as each test begins, which reads only the log its
own requests made); the others start their own, with the limits they are about.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

import helpers
from helpers import REPO

pytestmark = pytest.mark.slow  # server processes, a browser, torchrun, waits on timeouts (seconds)

httpx = pytest.importorskip("httpx")


class Forks:
    """tests/fake_server_forks.py, for the module: it has imported what a fake server runs, and forks
    one on request (a process of its own that starts at once, where a new interpreter takes seconds
    to import torch and the server), reporting each one's exit."""

    def __init__(self, tmp_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
        self.log_path = tmp_path / "forks.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_server_forks.py")], env=env,
                                         cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True)
        self._changed = threading.Condition()
        self._forked: list[int] = []
        self._exits: dict[int, int] = {}
        self._ended = False
        self._asking = threading.Lock()
        first = self.proc.stdout.readline()
        assert first.strip() == "ready", first + self.log_path.read_text()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    self._forked.append(message["pid"])
                else:
                    self._exits[message["exited"]] = message["returncode"]
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def fork(self, port: int, options: dict, log: Path, nofile: Optional[int]) -> "ForkedProcess":
        with self._asking, self._changed:
            self.proc.stdin.write(json.dumps({"port": port, "options": options, "log": str(log),
                                              "nofile": nofile}) + "\n")
            self.proc.stdin.flush()
            assert self._changed.wait_for(lambda: self._forked or self._ended, 30) and self._forked, \
                self.log_path.read_text()
            return ForkedProcess(self, self._forked.pop())

    def returncode(self, pid: int) -> Optional[int]:
        with self._changed:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: Optional[float]) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: pid in self._exits or self._ended, timeout):
                raise subprocess.TimeoutExpired(f"fake server {pid}", timeout or 0)
            assert pid in self._exits, f"the forking process ended:\n{self.log_path.read_text()}"
            return self._exits[pid]

    def close(self) -> None:
        self.proc.stdin.close()  # it kills the servers left, and exits
        self.proc.wait(30)
        self._reader.join(10)


class ForkedProcess:
    """What the tests use of ``subprocess.Popen``'s interface, for a server that :class:`Forks` forked."""

    def __init__(self, forks: Forks, pid: int) -> None:
        self.forks, self.pid = forks, pid

    @property
    def returncode(self) -> Optional[int]:
        return self.forks.returncode(self.pid)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.forks.wait(self.pid, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (not reaped yet: the pid is still this process's)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def forks(tmp_path_factory) -> Iterator[Forks]:
    forks = Forks(tmp_path_factory.mktemp("forks"))
    yield forks
    forks.close()


class FakeServer:
    """``options``: the server's ``ServerLimits``; ``nofile``: its file-descriptor limit."""

    def __init__(self, forks: Forks, tmp_path: Path, options: dict, nofile: Optional[int] = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.log_start = 0  # (the shared server's: where its log stood as the running test began)
        self.proc = forks.fork(self.port, options, self.log_path, nofile)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)

    def log(self, since: int = 0) -> str:
        """The server's output, from character ``since`` on."""
        return self.log_path.read_text(errors="replace")[since:] if self.log_path.exists() else ""

    def reset_peak_rss(self) -> None:
        """Make the peak resident size (VmHWM) the present one (Linux's clear_refs, value 5), so that
        :meth:`peak_rss_mb` measures from now on, whatever earlier requests to this server cost."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def fake_server(forks: Forks, tmp_path: Path, nofile: Optional[int] = None, **options) -> Iterator[FakeServer]:
    server = FakeServer(forks, tmp_path, options, nofile)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def shared_server(forks, tmp_path_factory) -> Iterator[FakeServer]:
    with fake_server(forks, tmp_path_factory.mktemp("shared-server")) as server:
        yield server


@pytest.fixture
def server(shared_server: FakeServer) -> FakeServer:
    """The module's server with the default limits, running and idle (nothing queued or running);
    ``server.log_start``: where its log stood as the test began."""
    assert shared_server.proc.poll() is None, f"the shared server exited:\n{shared_server.log()[-3000:]}"
    deadline = time.monotonic() + 10
    while helpers.serving_state(shared_server.url) != {"queued": 0, "slots_in_use": 0}:
        assert time.monotonic() < deadline, helpers.serving_state(shared_server.url)
        time.sleep(0.02)
    shared_server.log_start = len(shared_server.log())
    return shared_server


def requests_total(url: str, path: str, status: str) -> float:
    """``llama_requests_total`` of an endpoint and status, read from ``/metrics`` (0 before the first)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(rf'^llama_requests_total{{endpoint="{re.escape(path)}",status="{status}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


# The longest /health may take while a big body is refused.  What these tests catch took seconds
# (19-26 s for a 51 MB body, several for tokenising 4 M characters on the event loop); an answer
# on a quiet machine takes under 20 ms, but a loaded one (CI's 2 cores, other tests beside)
# delays it past 0.1 s now and then, so the bound sits between the two.
STALL_BOUND_S = 1.0


class HealthProbe:
    """GET /health every ``every_s`` on a thread (one kept-alive connection), recording each
    answer's latency, until stopped."""

    def __init__(self, url: str, every_s: float = 0.02) -> None:
        self.url, self.every_s = url, every_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def wait_for_answers(self, n: int, timeout: float = 10) -> None:
        """Go on probing until ``n`` answers have come (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while len(self.latencies) < n and time.monotonic() < deadline:
            time.sleep(self.every_s)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code != 200:
                        self.failures.append(f"status {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.latencies.append(time.perf_counter() - start)
                self._stop.wait(self.every_s)


def post_large_body(port: int, path: str, body: bytes, *, chunked: bool, piece: int = 1 << 20,
                    timeout: float = 120) -> tuple[Optional[int], bytes]:
    """POST ``body`` over a raw socket (``Content-Length`` or chunked), reading the answer
    while still sending (a server may answer before the body is through and drop the rest).
    Returns (status, response body) or (None, b"") if no answer came."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(body)}\r\n\r\n"
    received = bytearray()
    done = threading.Event()

    def read() -> None:
        try:
            while not done.is_set():
                data = sock.recv(65536)
                if not data:
                    break
                received.extend(data)
                head_end = received.find(b"\r\n\r\n")
                if head_end >= 0:
                    headers = received[:head_end].decode("latin-1").lower()
                    length = next((int(line.split(":", 1)[1]) for line in headers.split("\r\n")
                                   if line.startswith("content-length:")), None)
                    if length is not None and len(received) >= head_end + 4 + length:
                        break
        except OSError:
            pass
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sock.sendall(head.encode())
        for start in range(0, len(body), piece):
            if done.is_set():
                break
            data = body[start : start + piece]
            sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked and not done.is_set():
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server stopped reading: its answer is what counts
        pass
    done.wait(timeout)
    sock.close()
    reader.join(5)
    head_end = received.find(b"\r\n\r\n")
    if not received.startswith(b"HTTP/1.1 ") or head_end < 0:
        return None, b""
    return int(received[9:12]), bytes(received[head_end + 4 :])


# -- latency --


def test_answers_on_a_kept_alive_connection_are_not_held_back(server):
    """The listening socket did not say it was TCP, so asyncio left Nagle's algorithm on for the
    connections it accepted: a response's second write waited for the client's delayed ACK, and
    every request on a kept-alive connection took 40+ ms (each streamed token could wait as long)."""
    with httpx.Client(timeout=5) as client:
        latencies = []
        for _ in range(15):
            start = time.perf_counter()
            assert client.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - start)
    # Held back, every answer waits 40+ ms; a loaded machine delays many answers too, but not
    # all of them: the quickest of 15 tells the two apart.
    assert min(latencies) < 0.03, latencies


# -- the chat page --


@contextlib.contextmanager
def headless_chromium(tmp_path: Path, size: tuple[int, int] = (1100, 760)):
    """A selenium driver of Debian's chromium, headless (skips where it is not installed)."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (browser and driver_path):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-extensions", "--no-first-run",
                 f"--window-size={size[0]},{size[1]}", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One headless browser for this module's chat-page tests (starting one is seconds): each test
    sets its window size and loads its own server's page, whose origin (another port) keeps its
    storage apart from the other test's."""
    with headless_chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


def record_requests(driver) -> Callable[[], list[dict]]:
    """Wraps the page's ``fetch`` to keep the body of every chat request it sends from now on (until
    the page is loaded again); returns a function that reads them."""
    driver.execute_script("""
        window.__sent = [];
        const original = window.fetch;
        window.fetch = (url, options) => {
          if (String(url).endsWith("/v1/chat/completions")) window.__sent.push(JSON.parse(options.body));
          return original.call(window, url, options);
        };""")
    return lambda: driver.execute_script("return window.__sent")


def test_the_chat_page_asks_for_the_api_key_a_server_wants(forks, chromium, tmp_path):
    """A server with --api_key answers the page's requests with 401: the page shows a key field,
    keeps the key in sessionStorage and sends it as a bearer token.  Model text is shown as text:
    fenced code in a <pre>, markup in it never becomes elements; markdown (headings, lists, bold,
    italic, links, tables) becomes elements the page builds, a <script> and a javascript: link stay text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium
    driver.set_window_size(900, 600)
    with fake_server(forks, tmp_path, api_keys=["key-of-the-test"]) as server:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 30, poll_frequency=0.1)  # (selenium polls every 0.5 s unless told)
        wait.until(lambda d: d.find_element(By.ID, "keybar").is_displayed())
        assert "API key" in driver.find_element(By.ID, "model").text
        driver.save_screenshot(str(tmp_path / "key-needed.png"))
        driver.find_element(By.ID, "apikey").send_keys("a wrong key\n")
        time.sleep(0.5)
        assert driver.find_element(By.ID, "keybar").is_displayed()
        driver.find_element(By.ID, "apikey").send_keys("key-of-the-test\n")
        wait.until(lambda d: "fake" in d.find_element(By.ID, "model").text)
        assert not driver.find_element(By.ID, "keybar").is_displayed()
        assert driver.execute_script("return sessionStorage.getItem('llama-serve-api-key')") == "key-of-the-test"
        max_tokens = driver.find_element(By.ID, "max_tokens")
        max_tokens.clear()
        max_tokens.send_keys("12")
        driver.find_element(By.ID, "input").send_keys("Hello\n")
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-state") == "done")
        reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text
        assert reply.startswith("Once upon a time")
        # the page's own renderer, on text a model could write
        driver.execute_script("addMessage('assistant', arguments[0])",
                              "Run:\n```html\n<b id='injected'>x</b>\n```\nthen <img src=x onerror=alert(1)>.")
        last = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1]
        assert last.find_element(By.CSS_SELECTOR, "pre code").text == "<b id='injected'>x</b>"
        assert last.find_element(By.TAG_NAME, "pre").get_attribute("data-lang") == "html"
        assert not driver.find_elements(By.ID, "injected") and not last.find_elements(By.TAG_NAME, "img")
        assert "<img src=x onerror=alert(1)>" in last.text
        # markdown beyond code, and what must stay text
        driver.execute_script("addMessage('assistant', arguments[0])", MARKDOWN)
        last = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1]
        assert last.find_element(By.TAG_NAME, "h2").text == "A plan"
        assert [li.text for li in last.find_elements(By.CSS_SELECTOR, "ol > li")] == ["first step", "second, with docs"]
        assert last.find_element(By.CSS_SELECTOR, "ol strong").text == "first"
        assert last.find_element(By.CSS_SELECTOR, "ol em").text == "second"
        assert [li.text for li in last.find_elements(By.CSS_SELECTOR, "ul > li")] == ["apples", "pears"]
        assert [c.text for c in last.find_elements(By.CSS_SELECTOR, "table th, table td")] == ["fruit", "count",
                                                                                              "apples", "3"]
        assert last.find_element(By.CSS_SELECTOR, "td code").text == "apples"
        links = last.find_elements(By.TAG_NAME, "a")
        assert [(a.text, a.get_attribute("href")) for a in links] == [("docs", "https://example.com/docs")]
        assert not last.find_elements(By.TAG_NAME, "script") and driver.title == "llama chat"
        assert "<script>document.title='pwned'</script>" in last.text
        assert "[run](javascript:alert(1))" in last.text and "snake_case_name" in last.text
        driver.save_screenshot(str(tmp_path / "with-key.png"))
    access = [line for line in server.log().splitlines()
              if "llama.serve.access" in line and ("/v1/" in line or "/props" in line)]
    assert any('"GET /props" 401' in line for line in access) and any('"POST /v1/chat/completions" 200' in line
                                                                      for line in access), access


MARKDOWN = """## A plan
1. **first** step
2. *second*, with [docs](https://example.com/docs)

- apples
- pears

| fruit | count |
|---|---:|
| `apples` | 3 |

<script>document.title='pwned'</script> [run](javascript:alert(1)) snake_case_name"""


def test_the_chat_page_keeps_conversations_and_edits_them(server, chromium, tmp_path):
    """The page against the fake engine (12-token replies): suggestions for a model that is not the
    demo, a system prompt and the sampling settings sent with every request, the token count and
    tokens/s under each reply, regenerate (the reply replaced, the turn asked again without it),
    edit (the message changed, what followed dropped), copy, and conversations kept across a
    reload, listed, reopened and deleted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from llama.serve.page import GENERIC_SUGGESTIONS

    def done(n: int):
        return lambda d: [e.get_attribute("data-state") for e in d.find_elements(By.CSS_SELECTOR, ".msg.assistant")] \
            == ["done"] * n

    def shown(driver) -> list[tuple[str, str]]:
        return [(e.get_attribute("class").split()[1], e.find_element(By.CSS_SELECTOR, ".body").text)
                for e in driver.find_elements(By.CSS_SELECTOR, ".msg")]

    system = {"role": "system", "content": "Be brief."}
    driver = chromium
    driver.set_window_size(1100, 760)
    driver.get(server.url + "/")
    wait = WebDriverWait(driver, 30, poll_frequency=0.1)  # (selenium polls every 0.5 s unless told)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#suggestions button"))
    assert "fake" in driver.find_element(By.ID, "model").text
    suggestions = [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#suggestions button")]
    assert suggestions == list(GENERIC_SUGGESTIONS)
    assert driver.find_element(By.ID, "top_p").get_attribute("value") == "0.9"  # the server's defaults
    assert driver.find_element(By.ID, "temperature").get_attribute("value") == "0.6"
    sent = record_requests(driver)
    driver.find_element(By.ID, "settings_toggle").click()
    driver.find_element(By.ID, "system").send_keys(system["content"])
    for name, value in (("max_tokens", "12"), ("top_p", "0.5")):
        driver.find_element(By.ID, name).clear()
        driver.find_element(By.ID, name).send_keys(value)
    question = GENERIC_SUGGESTIONS[0]
    driver.find_element(By.CSS_SELECTOR, "#suggestions button").click()
    wait.until(done(1))
    first = sent()[0]
    assert first["messages"] == [system, {"role": "user", "content": question}]
    assert (first["max_tokens"], first["top_p"], first["temperature"]) == (12, 0.5, 0.6)
    assert first["stream"] and first["stream_options"] == {"include_usage": True}
    reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text
    assert reply.startswith("Once upon a time")
    note = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .note").text
    speed = re.fullmatch(r"cut at max tokens · 12 tokens · ([\d.]+) tokens/s", note)
    assert speed and float(speed.group(1)) > 0, note
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#conversations .open")] == [question]

    # regenerate: the same turn asked again, without the old reply, which the new one replaces
    driver.find_element(By.CSS_SELECTOR, ".msg.assistant .regenerate").click()
    wait.until(lambda d: len(sent()) == 2)
    wait.until(done(1))
    assert sent()[1]["messages"] == first["messages"]
    assert shown(driver) == [("user", question), ("assistant", reply)]

    # edit the question: it is sent changed, and what followed it is replaced
    driver.find_element(By.CSS_SELECTOR, ".msg.user .edit").click()
    editor = driver.find_element(By.CSS_SELECTOR, ".msg.user .editor textarea")
    editor.clear()
    editor.send_keys("Tell me a *short* story")
    driver.find_element(By.CSS_SELECTOR, ".msg.user .editor .save").click()
    wait.until(lambda d: len(sent()) == 3)
    wait.until(done(1))
    assert sent()[2]["messages"] == [system, {"role": "user", "content": "Tell me a *short* story"}]
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user .body em").text == "short"

    # a second turn carries the first, as kept
    driver.find_element(By.ID, "input").send_keys("And then?\n")
    wait.until(done(2))
    assert sent()[3]["messages"] == [system, {"role": "user", "content": "Tell me a *short* story"},
                                     {"role": "assistant", "content": reply},
                                     {"role": "user", "content": "And then?"}]
    before = shown(driver)
    notes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .note")]

    # copy: the text as written (markdown and all)
    driver.execute_script("""window.__copied = null;
        Object.defineProperty(navigator, "clipboard", {configurable: true,
          value: {writeText: (text) => { window.__copied = text; return Promise.resolve(); }}});""")
    driver.find_element(By.CSS_SELECTOR, ".msg.user .copy").click()
    wait.until(lambda d: d.execute_script("return window.__copied") == "Tell me a *short* story")

    # a reload: the conversation, its notes and the settings are kept
    driver.refresh()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 4)
    assert shown(driver) == before
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .note")] == notes
    assert driver.find_element(By.ID, "system").get_attribute("value") == system["content"]
    assert (driver.find_element(By.ID, "max_tokens").get_attribute("value"),
            driver.find_element(By.ID, "top_p").get_attribute("value")) == ("12", "0.5")
    assert driver.find_element(By.CSS_SELECTOR, "#conversations li.active .open").text == question
    driver.save_screenshot(str(tmp_path / "kept.png"))

    # New chat leaves it listed; it opens again; deleted, it is gone for good
    driver.find_element(By.ID, "reset").click()
    assert driver.find_element(By.ID, "empty").is_displayed() and not driver.find_elements(By.CSS_SELECTOR, ".msg")
    driver.find_element(By.CSS_SELECTOR, "#conversations .open").click()
    assert shown(driver) == before
    driver.find_element(By.CSS_SELECTOR, "#conversations .delete").click()
    assert not driver.find_elements(By.CSS_SELECTOR, "#conversations li")
    assert driver.find_element(By.ID, "empty").is_displayed()
    driver.refresh()
    wait.until(lambda d: "fake" in d.find_element(By.ID, "model").text)
    assert not driver.find_elements(By.CSS_SELECTOR, "#conversations li")
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg")


# -- bodies --


@pytest.mark.parametrize("chunked", [False, True], ids=["Content-Length", "chunked"])
def test_a_50_mb_body_is_refused_while_health_answers(server, chunked):
    """A 51 MB prompt used to be read whole, then parsed and tokenised on the event loop:
    /health stalled for 19-26 s and the server's memory grew by gigabytes.  Now it is a 413
    once 4 MiB (the default --max_request_bytes) have come, or at once from Content-Length."""
    body = b'{"prompt": "' + b"All the world's a stage. " * (50 * 2**20 // 25) + b'"}'
    server.reset_peak_rss()  # (the shared server's peak so far is other tests')
    rss_before = server.peak_rss_mb()
    with HealthProbe(server.url) as probe:
        time.sleep(0.2)
        status, answer = post_large_body(server.port, "/v1/completions", body, chunked=chunked)
        time.sleep(0.2)
        probe.wait_for_answers(6)  # (a 413 from Content-Length comes at once: a loaded machine probes seldom)
    assert status == 413, (status, answer[:300], server.log()[-2000:])
    err = json.loads(answer)["error"]
    assert err["code"] == "request_too_large" and "--max_request_bytes" in err["message"]
    assert not probe.failures and len(probe.latencies) > 5
    assert max(probe.latencies) < STALL_BOUND_S, sorted(probe.latencies)[-5:]
    assert server.peak_rss_mb() - rss_before < 40, (rss_before, server.peak_rss_mb())
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(server):
    """A prompt just under the body limit, far longer than any text the context holds: a 400
    from its length alone, while /health answers (tokenising 4 million characters on the
    event loop used to take seconds)."""
    prompt = "All the world's a stage. " * (4 * 2**20 // 25 - 1)
    with HealthProbe(server.url) as probe:
        time.sleep(0.2)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt}, timeout=120)
        time.sleep(0.2)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and f"{len(prompt)} characters" in err["message"]
    assert not probe.failures and max(probe.latencies) < STALL_BOUND_S, sorted(probe.latencies)[-5:]


# -- connections and logs --


def open_idle(port: int, n: int, first_bytes: bytes = b"") -> list[socket.socket]:
    """``n`` connections that send ``first_bytes`` (nothing, or the start of a request) and then
    nothing more."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            sock.sendall(first_bytes)
        socks.append(sock)
    return socks


def closed_by_server(socks: list[socket.socket], wait_s: float = 0.05) -> list[bool]:
    """Whether the server has closed each of ``socks`` (end of file, or a reset), the closes given
    ``wait_s`` to arrive.  (Waiting for each socket in turn took 0.05 s for every one left open:
    half a minute for the hundreds of the file-limit test.)"""
    time.sleep(wait_s)
    closed = []
    for sock in socks:
        sock.setblocking(False)
        try:
            closed.append(sock.recv(1) == b"")
        except BlockingIOError:  # nothing to read: still open
            closed.append(False)
        except OSError:  # reset
            closed.append(True)
    return closed


def test_idle_connections_are_closed_after_the_header_timeout(forks, tmp_path):
    """Connections that never send a request, or never finish its headers (a byte now and then
    is not enough), used to be held forever."""
    with fake_server(forks, tmp_path, header_timeout_s=0.5) as server:
        silent = open_idle(server.port, 150)
        partial = open_idle(server.port, 150, b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with HealthProbe(server.url) as probe:
            for _ in range(4):  # ~1 s of trickling headers, past the timeout
                time.sleep(0.25)
                for sock in partial[:10]:
                    try:
                        sock.sendall(b"X")
                    except OSError:
                        pass
        assert not probe.failures and max(probe.latencies) < 0.5, sorted(probe.latencies)[-5:]
        time.sleep(0.5)
        still_open = [s for s, closed in zip(silent + partial, closed_by_server(silent + partial)) if not closed]
        assert not still_open, f"{len(still_open)} of 300 idle connections still open"
        for sock in silent + partial:
            sock.close()
        # a client that sends its request at once is not affected
        with httpx.Client() as client:
            assert client.get(server.url + "/health").status_code == 200
            time.sleep(0.75)  # longer than the header timeout, shorter than the keep-alive one (5 s)
            assert client.get(server.url + "/health").status_code == 200


def test_idle_connections_past_the_file_limit_do_not_lock_clients_out(forks, tmp_path):
    """With 1024 file descriptors, 1100 idle connections used to exhaust them: the server could
    accept no one (and logged a traceback a second).  Now the cap (lowered to fit) closes the
    longest-idle connection for each new one, and /health answers."""
    with fake_server(forks, tmp_path, nofile=1024) as server:
        idle = open_idle(server.port, 1100)
        try:
            time.sleep(1.5)  # (the burst overflowed the kernel's accept queue: its connects are retried after 1 s)
            start = time.perf_counter()
            r = httpx.get(server.url + "/health", timeout=5)
            took = time.perf_counter() - start
            assert r.status_code == 200 and took < 1, took
            with HealthProbe(server.url) as probe:
                time.sleep(0.3)
                more = open_idle(server.port, 200)
                time.sleep(0.5)
                probe.wait_for_answers(11)  # (a loaded machine probes seldom)
            assert not probe.failures and len(probe.latencies) > 10, (probe.failures, probe.latencies)
            # (accepting and closing 200 connections takes the event loop some tens of ms; a
            # busy machine's noise comes on top)
            assert max(probe.latencies) < 0.5, probe.latencies
            n_closed = sum(closed_by_server(idle + more))
            assert n_closed >= 1300 - 576, n_closed
        finally:
            for sock in idle:
                sock.close()
        log = server.log()
    assert "--max_connections 1024 lowered to 576: this process may open 1024 files" in log
    assert "Traceback" not in log and len(log) < 20_000, log[-3000:]


@pytest.fixture(scope="module")
def flooded_then_sigterm(forks, tmp_path_factory) -> dict:
    """A server (a long grace period: 30 s) sent 200 malformed requests, then SIGTERM with no
    request in flight: how it answered, how soon it exited and with what status, and its log.
    Two tests read it."""
    import signal

    with fake_server(forks, tmp_path_factory.mktemp("flooded"), shutdown_grace_s=30.0) as server:
        for sock in open_idle(server.port, 200, b"NOT HTTP AT ALL\r\n\r\n"):
            sock.close()
        time.sleep(0.5)
        health = httpx.get(server.url + "/health").status_code
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            status: Optional[int] = server.proc.wait(30)
        except subprocess.TimeoutExpired:
            status = None
        return {"health": health, "status": status, "exited_s": time.monotonic() - sent, "log": server.log()}


def test_a_flood_of_one_warning_is_logged_once(flooded_then_sigterm):
    """Each malformed request is a warning from uvicorn: 200 of them were 200 log lines.  Now one,
    and, at shutdown, the last with the count of the others."""
    assert flooded_then_sigterm["health"] == 200
    lines = [line for line in flooded_then_sigterm["log"].splitlines() if "Invalid HTTP request received" in line]
    assert len(lines) == 2, lines
    assert lines[1].endswith("(198 more like this within 10 s were not logged)"), lines


# -- shutdown --


def read_stream(url: str, body: dict, chunks: list, first: threading.Event) -> None:
    """POST a streamed request, appending each ``data:`` payload to ``chunks`` (``first`` set at the first)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line[len("data:"):].strip())
                    first.set()
    except httpx.HTTPError as e:
        chunks.append(f"transport error: {e!r}")
    first.set()


def start_stream(url: str, **body) -> tuple[list, threading.Thread]:
    chunks: list = []
    first = threading.Event()
    thread = threading.Thread(target=read_stream, args=(url, {"prompt": "x", **body}, chunks, first), daemon=True)
    thread.start()
    assert first.wait(30), "no first chunk"
    return chunks, thread


def streamed_text(chunks: list) -> str:
    return "".join(json.loads(c)["choices"][0]["text"] for c in chunks
                   if c.startswith("{") and json.loads(c).get("choices"))


def test_sigterm_lets_requests_in_flight_finish_within_the_grace_period(forks, tmp_path):
    """SIGTERM used to end every request in flight at once ("finishing the requests in flight"
    said the log).  Now: no new requests (503), those in flight go on for --shutdown_grace_s,
    the rest end with an error event, the process exits 0 and logs what it did."""
    import signal

    with fake_server(forks, tmp_path, shutdown_grace_s=2.0) as server:  # the fake decodes a token per 0.02 s
        short, short_thread = start_stream(server.url, max_tokens=40)  # ~0.8 s: finishes
        long, long_thread = start_stream(server.url, max_tokens=250)  # ~5 s: cut at the grace period's end
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503 and h.json() == {"status": "stopping"}
        short_thread.join(10)
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short[-3:]
        assert len(streamed_text(short)) > 0 and not any("error" in c for c in short)
        long_thread.join(10)
        ended = time.monotonic() - sent
        assert long[-1] == "[DONE]" and "shutting down" in json.loads(long[-2])["error"]["message"], long[-3:]
        # Not before the grace period's end.  The upper bound is generous (a loaded machine delays
        # the threads that read the streams): that the long stream was cut rather than left to run
        # is its error event above, and the server's own "finished in 2.0 s" below.
        assert 1.8 < ended < 10, ended
        assert server.proc.wait(10) == 0
        exited = time.monotonic() - sent
        log = server.log()
    assert exited < 15, exited
    assert "SIGTERM: taking no new requests; waiting up to 2 s for the 2 in flight" in log, log[-2000:]
    assert "shutdown: 1 of the 2 requests in flight finished in 2.0 s; ending the other 1 with an error" in log, \
        log[-2000:]


def test_sigterm_without_requests_exits_at_once_and_a_second_signal_ends_the_grace(forks, tmp_path,
                                                                                  flooded_then_sigterm):
    """(The first part is the flooded server's SIGTERM: no request was in flight.)"""
    import signal

    assert flooded_then_sigterm["status"] == 0 and flooded_then_sigterm["exited_s"] < 3, flooded_then_sigterm
    assert "SIGTERM: no requests in flight: exiting" in flooded_then_sigterm["log"]
    with fake_server(forks, tmp_path, shutdown_grace_s=30.0) as server:
        chunks, thread = start_stream(server.url, max_tokens=250)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C, as a second signal: no more waiting
        thread.join(10)
        assert "shutting down" in chunks[-2] and time.monotonic() - sent < 2
        assert server.proc.wait(10) == 0
        assert "SIGINT again: ending the requests in flight now" in server.log()


def test_the_server_process_streams_and_a_client_that_goes_away_frees_its_slot(forks, tmp_path):
    """``llama.serve.serve`` in its own process (uvicorn in a thread, the engine loop on the main
    thread): a real HTTP stream; a client that reads a few chunks and goes away cancels its request.
    (Moved from test_serve_api.py, where it also checked that SIGTERM ended the stream at once:
    SIGTERM now lets it finish within the grace period, tested above; here the grace period is
    short, so the stream is still ended with an error event.)"""
    import signal

    with fake_server(forks, tmp_path, shutdown_grace_s=0.5) as server:
        body = {"prompt": "x", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(3)]
            assert helpers.serving_state(server.url)["slots_in_use"] == 1
        deadline = time.monotonic() + 5
        while helpers.serving_state(server.url)["slots_in_use"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert helpers.serving_state(server.url)["slots_in_use"] == 0
        # SIGTERM while a request streams: past the short grace period the stream ends with an
        # error event, and the process exits 0
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
        assert server.proc.wait(15) == 0
        access = [line for line in server.log().splitlines() if "llama.serve.access" in line]
    # the client that went away after a few chunks: 499, with the tokens it was sent by then
    gone = [line for line in access if '"POST /v1/completions" 499' in line]
    assert len(gone) == 1 and re.search(r"prompt_tokens=\d+ completion_tokens=\d+ ", gone[0]), access
    assert int(re.search(r"completion_tokens=(\d+)", gone[0]).group(1)) < 200


def test_clients_that_leave_answers_not_streamed_free_the_batch_and_the_queue(server):
    """A request that is not streamed, whose client gave up, used to run to its max_tokens (the
    gate, a BaseHTTPMiddleware, hid ``http.disconnect`` from it), holding its slot or its place
    in the queue: here six of them (2 running, 4 queued, ~5 s each) kept a new request waiting
    ~15 s.  Now each is cancelled as its client leaves, on both endpoints."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 240}
    abandoned = [("/v1/completions", {"prompt": "x", "max_tokens": 250}), ("/v1/chat/completions", chat)] * 3
    paths = ("/v1/completions", "/v1/chat/completions")
    gone_before = {path: requests_total(server.url, path, "499") for path in paths}
    answered: list = []

    def give_up(path: str, body: dict) -> None:
        try:  # the client waits 1 s for its answer, then closes the connection
            answered.append(httpx.post(server.url + path, json=body, timeout=httpx.Timeout(10, read=1.0)))
        except httpx.ReadTimeout:
            pass

    clients = [threading.Thread(target=give_up, args=call) for call in abandoned]
    for c in clients:
        c.start()
        time.sleep(0.05)  # (in order: the first two run, the others wait)
    for c in clients:
        c.join(10)
    left = time.monotonic()
    assert not answered, [r.text for r in answered]
    while helpers.serving_state(server.url) != {"queued": 0, "slots_in_use": 0} and time.monotonic() - left < 5:
        time.sleep(0.02)
    freed = time.monotonic() - left
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
    served = time.monotonic() - left
    gone = {path: requests_total(server.url, path, "499") - gone_before[path] for path in paths}
    assert freed < 1.0, freed  # the fake steps every 0.02 s: a few steps, not 15 s
    assert r.status_code == 200 and served < 2.0, (r.text, served)
    assert gone == {path: 3 for path in paths}, gone
    access = [line for line in server.log(since=server.log_start).splitlines() if "llama.serve.access" in line]
    assert sum(" 499 " in line for line in access) == 6, access
    log = server.log()  # (all of it, start-up included, as when the test had a server of its own)
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]  # (the answers no one reads go nowhere)


def test_the_start_up_heap_is_frozen_before_serving(server):
    """A full garbage collection walked every object of the loaded model and tokenizer (170-270 ms
    on the 150m config, a stall between requests); the server freezes what start-up made."""
    log = server.log()
    found = re.search(r"(\d+) objects made at start-up are kept out of garbage collection", log)
    assert found and int(found.group(1)) > 10_000, log


FREEZE_PROBE = """
import gc, json
from llama.runtime.host import freeze_startup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

kept = cycle()
n = freeze_startup_heap()
walked = any(o is kept for o in gc.get_objects())
later = cycle()
later_walked = any(o is later for o in gc.get_objects())
print(json.dumps({"frozen": n, "count": gc.get_freeze_count(), "walked": walked, "later_walked": later_walked}))
"""


def test_freezing_keeps_what_exists_out_of_collections_and_not_what_comes_later():
    """:func:`llama.runtime.host.freeze_startup_heap` in a fresh process (freezing this one would keep
    every later test's garbage cycles): the objects alive at the call leave the collector's
    generations, objects made after it stay in them."""
    import json

    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["frozen"] == result["count"] > 1000
    assert not result["walked"] and result["later_walked"], result


def _read_until(fd: int, out: bytearray, marker: bytes, deadline: float) -> None:
    import select

    while marker not in out and time.monotonic() < deadline:
        if select.select([fd], [], [], 1)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:  # EIO: every process holding the terminal has gone
                return


@pytest.mark.multiprocess
def test_ctrl_c_at_a_terminal_ends_a_torchrun_server_cleanly(tmp_path):
    """A person at a terminal serves the demo model under torchrun and presses Ctrl-C: the
    server shuts down, torchrun exits 0 and prints no traceback.  Before, the Ctrl-C reached
    torchrun's agent as SIGINT, which printed its SignalException traceback (status 1); now the
    first rank reads it as a key and shuts the job down itself."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)

    def own_terminal():  # a new session whose controlling terminal is the pty, as a shell's job
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "llama.serve",
           "--port", "0", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
                            start_new_session=False)
    out = bytearray()
    try:
        _read_until(master, out, b"objects made at start-up", time.monotonic() + 180)
        assert b"objects made at start-up" in out, out.decode(errors="replace")[-3000:]
        time.sleep(0.5)
        os.write(master, b"\x03")
        proc.wait(timeout=60)
        after = termios.tcgetattr(slave)
        os.close(slave)  # the terminal's last holder: reading what is left ends at its end (EIO), not at a timeout
        slave = -1
        _read_until(master, out, b"\x00", time.monotonic() + 2)  # whatever is left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        if slave != -1:
            os.close(slave)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "SIGINT: " in text  # the server's own shutdown line
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert after == before  # the terminal's settings are given back
