"""download.sh against a fake Meta download server on 127.0.0.1.

The fake release is written here by hand from Meta's published layouts (server paths, local
folders, shard counts), not read from the script, so the tests check the script against an
independent statement of where every file lives. Files are a few hundred bytes each.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "download.sh"
BASH = shutil.which("bash")
TIMEOUT = 60  # seconds; no script run may hang the suite

pytestmark = pytest.mark.skipif(
    BASH is None or shutil.which("curl") is None, reason="download.sh needs bash and curl"
)

# model name -> (folder on the server, folder on disk, number of shards)
LLAMA2_MODELS = {
    "7B": ("llama-2-7b", "llama-2-7b", 1),
    "13B": ("llama-2-13b", "llama-2-13b", 2),
    "70B": ("llama-2-70b", "llama-2-70b", 8),
    "7B-chat": ("llama-2-7b-chat", "llama-2-7b-chat", 1),
    "13B-chat": ("llama-2-13b-chat", "llama-2-13b-chat", 2),
    "70B-chat": ("llama-2-70b-chat", "llama-2-70b-chat", 8),
}
LLAMA3_MODELS = {
    "8B": ("8b_pre_trained", "Meta-Llama-3-8B", 1),
    "8B-instruct": ("8b_instruction_tuned", "Meta-Llama-3-8B-Instruct", 1),
    "70B": ("70b_pre_trained", "Meta-Llama-3-70B", 8),
    "70B-instruct": ("70b_instruction_tuned", "Meta-Llama-3-70B-Instruct", 8),
}
MODELS: dict = {2: LLAMA2_MODELS, 3: LLAMA3_MODELS}

# Llama 3.1 and later as Meta's own tooling names them: llama-models' sku_list gives each model
# id its folder on the server and its files (what `llama model download --source meta` fetches);
# the local folder is the model id with ':' as '-' (llama_models.utils.model_utils.model_local_dir).
# Only the bf16 text models this library runs: no FP8 (fp8_scales_*.pt), int4 or vision builds.
META_TOOLING_PREFIX = {"3.1": "Llama3.1-", "3.2": "Llama3.2-", "3.3": "Llama3.3-", "4": "Llama-4-"}


def meta_tooling_models(version: str) -> dict[str, tuple[str, str, list[str]]]:
    """model id -> (folder on the server, folder on disk, files), from llama-models."""
    sku_list = pytest.importorskip("llama_models.sku_list")
    models = {}
    for model in sku_list.all_registered_models():
        name = model.descriptor()
        if not name.startswith(META_TOOLING_PREFIX[version]) or "Vision" in name or "Guard" in name:
            continue
        info = sku_list.llama_meta_net_info(model)
        if any(f.startswith("fp8_scales") for f in info.files) or "INT4" in info.folder:
            continue
        models[name] = (info.folder, name.replace(":", "-"), list(info.files))
    assert models, version
    return models


for _version in META_TOOLING_PREFIX:
    try:
        MODELS[_version] = meta_tooling_models(_version)
    except pytest.skip.Exception:
        pass

# The shape of a CloudFront signed URL's query; the server refuses any other query.
SIGNED_QUERY = "Policy=eyJTdGF0ZW1lbnQiOlt7fV19&Signature=c2lnbmVk~LQ__&Key-Pair-Id=K2TEST&Download-Request-ID=7"

WGET = pytest.param("wget", marks=pytest.mark.skipif(shutil.which("wget") is None, reason="no wget"))
DOWNLOADERS = ["curl", WGET]


def file_pairs(version, models) -> list[tuple[str, str]]:
    """(path on disk under TARGET_FOLDER, path on the server) for every file of these models."""
    if version in META_TOOLING_PREFIX:  # no files outside the models' folders
        return [(f"{local}/{f}", f"{remote}/{f}") for name in models for remote, local, files in [MODELS[version][name]]
                for f in files]
    pairs = [("LICENSE", "LICENSE"), ("USE_POLICY.md", "USE_POLICY.md" if version == 2 else "USE_POLICY")]
    if version == 2:  # one tokenizer at the top, shared by all models
        pairs += [("tokenizer.model", "tokenizer.model"), ("tokenizer_checklist.chk", "tokenizer_checklist.chk")]
    for name in models:
        remote, local, shards = MODELS[version][name]
        files = [f"consolidated.{s:02d}.pth" for s in range(shards)] + ["params.json"]
        files += ["tokenizer.model"] if version == 3 else []
        files += ["checklist.chk"]
        pairs += [(f"{local}/{f}", f"{remote}/{f}") for f in files]
    return pairs


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def write_release(root: Path, version) -> dict[str, bytes]:
    """Write every file of one family's release under root; return server path -> contents."""
    files = {}
    for _, remote in file_pairs(version, MODELS[version]):
        if not remote.endswith(".chk"):
            files[remote] = hashlib.sha256(f"llama {version} {remote}".encode()).digest() * 7
    for _, remote in file_pairs(version, MODELS[version]):
        if remote.endswith(".chk"):  # md5sum lines for the checksummed files beside it
            folder = posixpath.dirname(remote)
            listed = sorted(
                p for p in files if posixpath.dirname(p) == folder and not p.startswith(("LICENSE", "USE_POLICY"))
            )
            files[remote] = "".join(f"{md5(files[p])}  {posixpath.basename(p)}\n" for p in listed).encode()
    for remote, data in files.items():
        (root / remote).parent.mkdir(parents=True, exist_ok=True)
        (root / remote).write_bytes(data)
    return files


class FakeMeta:
    """Serves a release like Meta's CDN: GET /<server path>?<signed query>, byte ranges, 403 for a
    wrong or expired signature, 404 for a missing file. Records (path, Range, status, bytes sent)."""

    def __init__(self, root: Path):
        self.root = root
        self.expired = False
        self.requests: list[tuple[str, str | None, int, int]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: bytes, headers=()):
                self.send_response(status)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                fake.requests.append((self.file_path, self.headers.get("Range"), status, len(body)))

            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                path = self.file_path = urllib.parse.unquote(url.path).lstrip("/")
                file = fake.root / path
                if fake.expired or url.query != SIGNED_QUERY:
                    return self.reply(403, b"<Error><Code>AccessDenied</Code></Error>")
                if ".." in path.split("/") or not file.is_file():
                    return self.reply(404, b"<Error><Code>NoSuchKey</Code></Error>")
                data = file.read_bytes()
                wanted = self.headers.get("Range")
                if wanted is None:
                    return self.reply(200, data)
                start = int(re.fullmatch(r"bytes=(\d+)-", wanted).group(1))
                if start >= len(data):
                    body = b"<Error><Code>InvalidRange</Code></Error>"
                    return self.reply(416, body, [("Content-Range", f"bytes */{len(data)}")])
                content_range = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self.reply(206, data[start:], [("Content-Range", content_range)])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/*?{SIGNED_QUERY}"

    def requested(self, path: str) -> list[tuple[str, str | None, int, int]]:
        return [r for r in self.requests if r[0] == path]


@pytest.fixture
def serve(tmp_path):
    """serve(version) -> (FakeMeta, release contents by server path) for a fresh fake release."""
    started = []

    def _serve(version):
        if version not in MODELS:
            pytest.skip("llama-models is not installed")
        root = tmp_path / f"release{version}"
        files = write_release(root, version)
        fake = FakeMeta(root)
        fake.thread.start()
        started.append(fake)
        return fake, files

    yield _serve
    for fake in started:
        fake.server.shutdown()
        fake.server.server_close()


@pytest.fixture
def target(tmp_path) -> Path:
    return tmp_path / "my models"  # a space, to catch unquoted paths


@pytest.fixture
def run(tmp_path, target):
    """run(answers, *args, downloader=, path=, default_target=) runs download.sh in a clean environment;
    with default_target it runs inside target without TARGET_FOLDER."""
    home = tmp_path / "home"  # no ~/.curlrc or ~/.wgetrc of the machine's user
    home.mkdir()

    def _run(answers: str, *args: str, downloader="curl", path: str | None = None, default_target=False):
        env = {
            "PATH": path or os.environ["PATH"],
            "HOME": str(home),
            "TMPDIR": str(tmp_path),
            "LC_ALL": "C",
            "TARGET_FOLDER": str(target),
            "DOWNLOADER": downloader,
        }
        if default_target:
            del env["TARGET_FOLDER"]
            target.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [BASH, str(SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=target if default_target else tmp_path,
            start_new_session=True,  # so a timeout can kill curl/wget too, not only bash
        )
        try:
            stdout, stderr = proc.communicate(answers, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    return _run


def assert_layout(target: Path, version, models, files: dict[str, bytes]):
    """Exactly the expected files, byte for byte, and nothing else (no leftover partials)."""
    expected = {local: files[remote] for local, remote in file_pairs(version, models)}
    found = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert sorted(found) == sorted(expected)
    for local, data in expected.items():
        assert found[local] == data, local


def files_under(target: Path) -> list[Path]:
    return [p for p in target.rglob("*") if p.is_file()] if target.exists() else []


# --- good downloads --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_llama2_models_land_in_meta_layout(serve, run, target, downloader):
    fake, files = serve(2)
    result = run(f"{fake.url}\n7B,13B,70B-chat\n", "2", downloader=downloader)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 2, ["7B", "13B", "70B-chat"], files)
    assert {status for _, _, status, _ in fake.requests} == {200}


@pytest.mark.slow
@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_llama3_version_asked_and_names_case_insensitive(serve, run, target, downloader):
    fake, files = serve(3)
    result = run(f"{fake.url}\n3\n8b,70B-Instruct\n", downloader=downloader)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 3, ["8B", "70B-instruct"], files)
    # Meta's server names Llama 3 folders differently from the folders on disk.
    assert fake.requested("70b_instruction_tuned/consolidated.07.pth")
    assert (target / "USE_POLICY.md").read_bytes() == files["USE_POLICY"]


@pytest.mark.slow
def test_enter_means_every_model_of_the_version(serve, run, target):
    fake, files = serve(3)
    result = run(f"{fake.url}\n\n", "llama3")
    assert result.returncode == 0, result.stderr
    assert_layout(target, 3, list(LLAMA3_MODELS), files)


def test_default_target_is_the_current_folder(serve, run, target):
    fake, files = serve(2)
    result = run(f"{fake.url}\n7B-chat\n", "2", default_target=True)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 2, ["7B-chat"], files)


# --- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, models, server_path, local_path",
    [
        (2, "7B", "llama-2-7b/consolidated.00.pth", "llama-2-7b/consolidated.00.pth"),
        (2, "7B", "tokenizer.model", "tokenizer.model"),
        (3, "8B", "8b_pre_trained/params.json", "Meta-Llama-3-8B/params.json"),
    ],
)
def test_checksum_mismatch_fails_naming_the_file(serve, run, version, models, server_path, local_path):
    fake, files = serve(version)
    (fake.root / server_path).write_bytes(b"corrupted" + files[server_path][9:])
    result = run(f"{fake.url}\n{models}\n", str(version))
    assert result.returncode != 0
    assert f"checksum mismatch: {local_path}" in result.stderr


@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_missing_file_404_fails_naming_the_file(serve, run, downloader):
    fake, _ = serve(2)
    (fake.root / "llama-2-13b/consolidated.01.pth").unlink()
    result = run(f"{fake.url}\n13B,7B\n", "2", downloader=downloader)
    assert result.returncode != 0
    assert "llama-2-13b/consolidated.01.pth: HTTP 404" in result.stderr
    assert not fake.requested("llama-2-7b/checklist.chk")  # stopped at the first failure


@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_expired_link_403_fails_with_a_clear_message(serve, run, target, downloader):
    fake, _ = serve(3)
    fake.expired = True
    result = run(f"{fake.url}\n8B\n", "3", downloader=downloader)
    # (once, under 99 % CPU pressure, the curl case failed here without a message: now it has one)
    assert result.returncode != 0, result.stderr
    assert "HTTP 403" in result.stderr and "expired" in result.stderr, result.stderr
    assert len(fake.requests) == 1, (fake.requests, result.stderr)  # stopped at the first file
    assert files_under(target) == []  # no half-written LICENSE left behind


@pytest.mark.parametrize(
    "version, models, bad",
    [(2, "7B,8B", "8B"), (2, "70B-instruct", "70B-instruct"), (3, "8B,13B", "13B"), (3, "70B,70B-chat", "70B-chat")],
)
def test_unknown_model_name_fails_before_any_download(serve, run, version, models, bad):
    fake, _ = serve(version)
    result = run(f"{fake.url}\n{models}\n", str(version))
    assert result.returncode != 0
    assert f"unknown Llama {version} model '{bad}'" in result.stderr
    assert fake.requests == []


@pytest.mark.parametrize(
    "answers, args, message",
    [
        ("http://127.0.0.1:9/no-star\n7B\n", ["2"], "has no '*'"),
        ("http://127.0.0.1:9/*\n5\n7B\n", [], "unknown model '5'"),
        ("http://127.0.0.1:9/*\n", ["2"], "input ended"),  # never downloads "all" by accident
        ("", [], "input ended"),
    ],
)
def test_bad_answers_fail_before_any_download(run, target, answers, args, message):
    result = run(answers, *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert files_under(target) == []


# --- resuming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_resume_requests_only_the_rest_of_a_partial_file(serve, run, target, downloader):
    fake, files = serve(2)
    shard = files["llama-2-13b/consolidated.01.pth"]
    (target / "llama-2-13b").mkdir(parents=True)
    (target / "llama-2-13b/consolidated.01.pth").write_bytes(shard[:100])
    result = run(f"{fake.url}\n13B\n", "2", downloader=downloader)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 2, ["13B"], files)
    assert fake.requested("llama-2-13b/consolidated.01.pth") == [
        ("llama-2-13b/consolidated.01.pth", "bytes=100-", 206, len(shard) - 100)
    ]


@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_rerun_fetches_no_verified_file_again(serve, run, target, downloader):
    fake, files = serve(3)
    assert run(f"{fake.url}\n8B\n", "3", downloader=downloader).returncode == 0
    fake.requests.clear()
    result = run(f"{fake.url}\n8B\n", "3", downloader=downloader)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 3, ["8B"], files)
    for name in ("consolidated.00.pth", "params.json", "tokenizer.model"):  # asked only past their end
        path = f"8b_pre_trained/{name}"
        requests = [(wanted, status) for _, wanted, status, _ in fake.requested(path)]
        assert requests == [(f"bytes={len(files[path])}-", 416)]


def test_wrong_partial_file_is_caught_not_trusted(serve, run, target):
    fake, files = serve(2)
    (target / "llama-2-7b").mkdir(parents=True)
    (target / "llama-2-7b/consolidated.00.pth").write_bytes(b"not the start of the shard")
    result = run(f"{fake.url}\n7B\n", "2")
    assert result.returncode != 0
    assert "checksum mismatch: llama-2-7b/consolidated.00.pth" in result.stderr
    assert "Delete these files" in result.stderr


# --- macOS: no md5sum, only `md5 -r` ---------------------------------------------------------

MD5_SHIM = """#!{python}
# Stands in for macOS md5: only `md5 -r FILE...`, printing "<md5> <file>".
import hashlib, sys
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if len(sys.argv) < 3 or sys.argv[1] != "-r":
    sys.exit("md5 shim: only -r is supported")
for name in sys.argv[2:]:
    with open(name, "rb") as f:
        print(hashlib.md5(f.read()).hexdigest(), name)
"""


# What a Mac has besides md5: the usual command-line tools, bash, curl (wget from Homebrew).
MACOS_COMMANDS = """awk basename bash cat cmp cp curl cut date dirname env grep head ls mkdir mktemp mv printf
    rm sed sh sleep sort tail tee test touch tr uname uniq wc wget xargs""".split()


@pytest.fixture(scope="module")
def macos_bin(tmp_path_factory) -> tuple[str, Path]:
    """A PATH folder with this machine's usual commands but no md5sum, plus an `md5` shim; its call log."""
    bin_dir = tmp_path_factory.mktemp("macos-bin")
    for name in MACOS_COMMANDS:
        found = shutil.which(name)
        if found:
            (bin_dir / name).symlink_to(found)
    log = bin_dir.parent / "md5-calls.log"
    shim = bin_dir / "md5"
    shim.write_text(MD5_SHIM.format(python=sys.executable, log=str(log)))
    shim.chmod(0o755)
    assert shutil.which("md5sum", path=str(bin_dir)) is None
    return str(bin_dir), log


@pytest.fixture
def macos_path(macos_bin) -> tuple[str, Path]:
    """PATH for a machine without md5sum, and the shim's call log, emptied for this test."""
    path, log = macos_bin
    log.write_text("")
    return path, log


@pytest.mark.slow
def test_macos_md5_verifies_good_files(serve, run, target, macos_path):
    path, log = macos_path
    fake, files = serve(2)
    result = run(f"{fake.url}\n7B\n", "2", path=path)
    assert result.returncode == 0, result.stderr
    assert_layout(target, 2, ["7B"], files)
    assert "-r" in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("version, models, server_path, local_path", [
    (2, "7B", "llama-2-7b/consolidated.00.pth", "llama-2-7b/consolidated.00.pth"),
    (3, "8B-instruct", "8b_instruction_tuned/tokenizer.model", "Meta-Llama-3-8B-Instruct/tokenizer.model"),
])
def test_macos_md5_still_catches_a_mismatch(serve, run, macos_path, version, models, server_path, local_path):
    path, log = macos_path
    fake, files = serve(version)
    (fake.root / server_path).write_bytes(files[server_path][::-1])
    result = run(f"{fake.url}\n{models}\n", str(version), path=path)
    assert result.returncode != 0
    assert f"checksum mismatch: {local_path}" in result.stderr
    assert log.read_text()


# --- the script itself -------------------------------------------------------------------------


def test_script_parses():
    subprocess.run([BASH, "-n", str(SCRIPT)], check=True, timeout=TIMEOUT)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_script_passes_shellcheck():
    result = subprocess.run(
        ["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout


def test_help_prints_the_header(run):
    result = run("", "--help")
    assert result.returncode == 0
    assert "Enter the URL from email: " in result.stdout and "TARGET_FOLDER" in result.stdout


# --- Meta's own flow: no version argument, the version asked only when the names leave it open --

@pytest.mark.parametrize("version, models", [(2, "7B,13B-chat"), (3, "8B-instruct"), (3, "70b,8B")])
def test_meta_flow_url_then_models_needs_no_version(serve, run, target, version, models):
    """Answered as Meta's llama and llama3 download.sh ask: the URL, then the model list, and
    nothing else (a version question would find the input ended and fail)."""
    fake, files = serve(version)
    result = run(f"{fake.url}\n{models}\n")
    assert result.returncode == 0, result.stderr
    assert_layout(target, version,
                  [dict((k.lower(), k) for k in MODELS[version])[m.lower()] for m in models.split(",")], files)


@pytest.mark.parametrize("version", [2, 3])
def test_version_is_asked_when_the_names_leave_it_open(serve, run, target, version):
    fake, files = serve(version)
    result = run(f"{fake.url}\n70B\n{version}\n")
    assert result.returncode == 0, result.stderr  # the third answer was read: the version was asked
    assert_layout(target, version, ["70B"], files)


def test_open_version_without_an_answer_downloads_nothing(serve, run, target):
    fake, _ = serve(2)
    result = run(f"{fake.url}\n70B\n")
    assert result.returncode != 0 and "input ended" in result.stderr
    assert fake.requests == [] and not target.exists()


def test_version_answered_where_models_are_asked(serve, run, target):
    """This script's earlier order (URL, version, models) still works."""
    fake, files = serve(2)
    result = run(f"{fake.url}\n2\n7B\n")
    assert result.returncode == 0, result.stderr
    assert_layout(target, 2, ["7B"], files)


def test_models_of_two_versions_are_refused(serve, run, target):
    fake, _ = serve(3)
    result = run(f"{fake.url}\n8B,Llama3.1-8B\n")
    assert result.returncode != 0 and "different Llama versions" in result.stderr
    assert fake.requests == [] and not target.exists()


# --- Llama 3.1, 3.2, 3.3 and 4: Meta's model ids, folders and files ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.2", "3.3", "4"])
def test_enter_downloads_every_model_of_a_newer_version_as_metas_tooling_lays_it_out(serve, run, target, version):
    fake, files = serve(version)
    result = run(f"{fake.url}\n\n", version)
    assert result.returncode == 0, result.stderr
    assert_layout(target, version, list(MODELS[version]), files)


@pytest.mark.slow
@pytest.mark.parametrize(
    "version, answer, names",
    [
        ("3.1", "Llama3.1-8B-Instruct,llama3.1-405b:BF16-MP16", ["Llama3.1-8B-Instruct", "Llama3.1-405B:bf16-mp16"]),
        ("3.1", "Llama3.1-70B,Llama3.1-405B-Instruct:bf16-mp8", ["Llama3.1-70B", "Llama3.1-405B-Instruct:bf16-mp8"]),
        ("3.2", "Llama3.2-1B-Instruct", ["Llama3.2-1B-Instruct"]),
        ("3.3", "Llama3.3-70B-Instruct", ["Llama3.3-70B-Instruct"]),
        ("4", "Llama-4-Scout-17B-16E,Llama-4-Maverick-17B-128E-Instruct",
         ["Llama-4-Scout-17B-16E", "Llama-4-Maverick-17B-128E-Instruct"]),
    ],
)
def test_model_ids_name_their_version(serve, run, target, version, answer, names):
    """Meta's model ids need no version argument and no version question (the input ends
    after the model list)."""
    fake, files = serve(version)
    result = run(f"{fake.url}\n{answer}\n")
    assert result.returncode == 0, result.stderr
    assert_layout(target, version, names, files)


def test_short_names_with_a_version_argument(serve, run, target):
    fake, files = serve("3.1")
    result = run(f"{fake.url}\n8B,70B-instruct\n", "3.1")
    assert result.returncode == 0, result.stderr
    assert_layout(target, "3.1", ["Llama3.1-8B", "Llama3.1-70B-Instruct"], files)


@pytest.mark.parametrize("downloader", DOWNLOADERS)
def test_failure_leaves_no_empty_folder(serve, run, target, downloader):
    fake, _ = serve("3.2")
    (fake.root / "Llama-3.2-3B/checklist.chk").unlink()
    result = run(f"{fake.url}\nLlama3.2-3B\n", downloader=downloader)
    assert result.returncode != 0 and "Llama3.2-3B/checklist.chk: HTTP 404" in result.stderr
    assert not target.exists()  # neither the model folder nor the target folder it made


def test_failure_keeps_folders_that_hold_files(serve, run, target):
    """A partial shard stays to be resumed, and so do the folders holding it; a folder that
    was there before is never removed."""
    fake, files = serve("3.2")
    target.mkdir()
    (fake.root / "Llama-3.2-1B/params.json").unlink()
    result = run(f"{fake.url}\nLlama3.2-1B,Llama3.2-3B\n")
    assert result.returncode != 0 and "params.json: HTTP 404" in result.stderr
    assert (target / "Llama3.2-1B/consolidated.00.pth").read_bytes() == files["Llama-3.2-1B/consolidated.00.pth"]
    assert not (target / "Llama3.2-3B").exists()
    fake.requests.clear()
    (fake.root / "Llama-3.2-1B/params.json").write_bytes(files["Llama-3.2-1B/params.json"])
    result = run(f"{fake.url}\nLlama3.2-1B\n")
    assert result.returncode == 0, result.stderr
    empty = target / "empty-before"
    empty.mkdir()
    fake.expired = True
    assert run(f"{fake.url}\nLlama3.2-3B\n").returncode != 0
    assert empty.is_dir() and target.is_dir()
