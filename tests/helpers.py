"""Fixture builders for the tests: tiny tokenizers and checkpoints written to temp dirs.

Shards are split here with Meta's conventions written out by hand (not with the
library's shard table), so loading tests check the library against an independent
statement of the layout.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# For tests that hold on any device: parametrize("device", DEVICES).  The CUDA case carries the
# cuda marker (pytest -m cuda selects it; conftest.py skips it where there is no GPU).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# Some English to train a small SentencePiece model on (tests must not need ../shared).
TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows
of outrageous fortune, or to take arms against a sea of troubles and by opposing end them.
All the world's a stage, and all the men and women merely players; they have their exits and their entrances.
Once upon a time there was a little girl who lived in a village near the forest.
Whenever she went out, the little girl wore a red riding cloak, so everyone in the village called her Little Red Riding Hood.
Simply put, the theory of relativity states that the laws of physics are the same for all observers.
I believe the meaning of life is to find your gift. The purpose of life is to give it away.
Translate English to French: sea otter => loutre de mer, peppermint => menthe poivrée, cheese => fromage.
What is the recipe of mayonnaise? Mix egg yolk, mustard and oil slowly while whisking, then add lemon juice.
Hello! How are you today? I am fine, thank you. Please tell me a story about a dragon and a knight.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024. Symbols: ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ! ? : ; , .
Ünïcödé: café, naïve, façade, jalapeño, Zürich, São Paulo, 東京, Москва, ελληνικά, 😀.
"""  # noqa: E501  (training text: its lines are data)


def train_sentencepiece(out_dir: Path, vocab_size: int = 400, user_defined_symbols: tuple[str, ...] = ()) -> Path:
    """A Llama 2-style SentencePiece BPE model (unk 0, BOS 1, EOS 2, byte fallback, no pad).

    ``user_defined_symbols`` become pieces of their own, ids 3, 4, ... (Code Llama's
    ``▁<PRE>``, ``<step>``, ...)."""
    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.txt"
    corpus.write_text(TRAINING_TEXT * 3, encoding="utf-8")
    prefix = out_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        user_defined_symbols=list(user_defined_symbols),
    )
    path = out_dir / "tokenizer.model"
    (prefix.with_suffix(".model")).rename(path)
    return path


def write_tiny_tiktoken(out_dir: Path) -> Path:
    """A small tiktoken rank file: the 256 bytes plus a few merges (vocab 256 + merges + 256 specials)."""
    ranks: list[bytes] = [bytes([b]) for b in range(256)]
    for merge in [b"th", b"he", b"the", b" t", b" the", b"in", b"an", b"er", b"on", b" a", b"re", b"at", b"en", b"nd",
                  b"ing"]:
        ranks.append(merge)
    # Pad to 300 base tokens so the full vocabulary (300 + 256 specials) splits evenly
    # over 1, 2 and 4 ranks.
    extra = [bytes([a, b]) for a in b"aeiou" for b in b"bcdfglmnprst"]
    ranks.extend(x for x in extra if x not in ranks)
    ranks = ranks[:300]
    path = Path(out_dir) / "tokenizer.model"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return path


def llama3_tokenizer_path() -> Path:
    """Meta's real Llama 3 tokenizer.model, shipped inside the llama-models package."""
    import llama_models

    path = Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"
    assert path.is_file(), path
    return path


def random_weights(params: dict, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full (unsplit) float32 weights in Meta's names, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    dim, n_layers, n_heads = params["dim"], params["n_layers"], params["n_heads"]
    n_kv = params.get("n_kv_heads") or n_heads
    hd = dim // n_heads
    hidden = int(2 * 4 * dim / 3)
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(params["ffn_dim_multiplier"] * hidden)
    m = params.get("multiple_of", 256)
    hidden = m * ((hidden + m - 1) // m)

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    w = {"tok_embeddings.weight": torch.randn(vocab_size, dim, generator=g)}
    for i in range(n_layers):
        p = f"layers.{i}."
        w[p + "attention.wq.weight"] = lin(n_heads * hd, dim)
        w[p + "attention.wk.weight"] = lin(n_kv * hd, dim)
        w[p + "attention.wv.weight"] = lin(n_kv * hd, dim)
        w[p + "attention.wo.weight"] = lin(dim, n_heads * hd)
        w[p + "feed_forward.w1.weight"] = lin(hidden, dim)
        w[p + "feed_forward.w2.weight"] = lin(dim, hidden)
        w[p + "feed_forward.w3.weight"] = lin(hidden, dim)
        w[p + "attention_norm.weight"] = norm()
        w[p + "ffn_norm.weight"] = norm()
    w["norm.weight"] = norm()
    w["output.weight"] = lin(vocab_size, dim)
    return w


def zero_weights(params: dict, vocab_size: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """:func:`random_weights`' names and shapes, all zeros in ``dtype``: for tests that assert only
    memory or layout, where no value is ever compared (drawing ~150M normal numbers is seconds)."""
    dim, n_heads = params["dim"], params["n_heads"]
    n_kv, hd = params.get("n_kv_heads") or n_heads, params["dim"] // params["n_heads"]
    hidden = int(2 * 4 * dim / 3)
    if params.get("ffn_dim_multiplier") is not None:
        hidden = int(params["ffn_dim_multiplier"] * hidden)
    m = params.get("multiple_of", 256)
    hidden = m * ((hidden + m - 1) // m)
    per_layer = {"attention.wq.weight": (n_heads * hd, dim), "attention.wk.weight": (n_kv * hd, dim),
                 "attention.wv.weight": (n_kv * hd, dim), "attention.wo.weight": (dim, n_heads * hd),
                 "feed_forward.w1.weight": (hidden, dim), "feed_forward.w2.weight": (dim, hidden),
                 "feed_forward.w3.weight": (hidden, dim), "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,)}
    w = {"tok_embeddings.weight": torch.zeros(vocab_size, dim, dtype=dtype)}
    for i in range(params["n_layers"]):
        w.update({f"layers.{i}.{k}": torch.zeros(s, dtype=dtype) for k, s in per_layer.items()})
    w["norm.weight"] = torch.zeros(dim, dtype=dtype)
    w["output.weight"] = torch.zeros(vocab_size, dim, dtype=dtype)
    return w


# Meta's layout, written out independently of llama.layers.tensor_parallel.SHARD_AXES.
_COLUMN = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.", "output.")
_ROW = ("attention.wo.", "feed_forward.w2.")


def split_for_rank(name: str, t: torch.Tensor, n_shards: int, rank: int, embedding_layout: str) -> torch.Tensor:
    if name.startswith("tok_embeddings."):
        axis = 1 if embedding_layout == "dim" else 0
    elif any(k in name for k in _COLUMN):
        axis = 0
    elif any(k in name for k in _ROW):
        axis = 1
    else:
        return t.clone()
    return t.chunk(n_shards, dim=axis)[rank].clone()


def write_checkpoint(
    ckpt_dir: Path,
    params: dict,
    weights: dict[str, torch.Tensor],
    n_shards: int = 1,
    embedding_layout: str = "vocab",
    dtype: torch.dtype = torch.float32,
    extra: Optional[dict[str, torch.Tensor]] = None,
) -> Path:
    """params.json + consolidated.NN.pth, split Meta's way over ``n_shards``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "params.json").write_text(json.dumps(params))
    for rank in range(n_shards):
        shard = {k: split_for_rank(k, v, n_shards, rank, embedding_layout).to(dtype) for k, v in weights.items()}
        if extra:
            shard.update(extra)
        torch.save(shard, ckpt_dir / f"consolidated.{rank:02d}.pth")
    return ckpt_dir


def torchrun(script: Path, args: list[str], nproc: int = 2, timeout: float = 300, env: Optional[dict] = None):
    """Run ``script`` under ``torchrun --standalone`` on gloo, one thread per rank."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        "LLAMA_COLLECTIVE_TIMEOUT_S": "120",
        "CUDA_VISIBLE_DEVICES": "",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def serving_state(url: str, headers: Optional[dict] = None) -> dict:
    """``{"queued", "slots_in_use"}`` of a running server, read from its Prometheus ``/metrics``
    (``/health`` says only whether it is up)."""
    import httpx

    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("llama_queue_depth", "llama_slots_in_use"):
            values[name] = int(float(value))
    return {"queued": values["llama_queue_depth"], "slots_in_use": values["llama_slots_in_use"]}


@contextlib.contextmanager
def memory_cap(extra_gib: float = 2.0):
    """Within the block, this process cannot map more than ``extra_gib`` GiB beyond what it
    has mapped now (RLIMIT_AS): code that tries to allocate for a hostile size fails with
    MemoryError at once instead of waking the machine's OOM killer.  Linux only."""
    import resource

    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc to measure the address space")
    status = Path("/proc/self/status").read_text()
    mapped = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = mapped + int(extra_gib * 2**30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def fifo_feeder(path: Path):
    """Within the block, whatever opens the FIFO ``path`` for reading gets a few bytes of
    garbage and end of file: code that wrongly reads a FIFO fails instead of waiting forever."""
    stop = threading.Event()

    def feed():
        while not stop.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # fails while no reader has it open
            except OSError:
                stop.wait(0.05)
                continue
            try:
                os.write(fd, b"not a checkpoint")
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()


class Checkpoint(NamedTuple):
    """A test checkpoint: its directory, its tokenizer file, its params.json as a dict and
    its full (unsplit) weights by Meta's names."""

    ckpt_dir: Path
    tokenizer_path: Path
    params: dict
    weights: dict


def rel_err(a, b) -> float:
    """Relative error of ``a`` against the reference ``b``: ||a - b|| / ||b|| (float32 norms)."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def build(checkpoint, *, max_seq_len: int = 64, max_batch_size: int = 3, policy=None, **kw):
    """A Llama of a test checkpoint (ckpt_dir, tokenizer_path, ...) on the CPU (unless ``device``
    says otherwise), as Llama.build makes it, or, given a kernel ``policy``, loaded and
    prepared under that policy instead of the one this CPU's probe would decide (for tests of
    the kernel choices)."""
    from llama import Llama

    ckpt, tok = checkpoint[:2]
    kw.setdefault("device", "cpu")
    if policy is None:
        return Llama.build(ckpt, tok, max_seq_len=max_seq_len, max_batch_size=max_batch_size, **kw)
    from llama.checkpoint.loader import LoadOptions, load_model

    compile = kw.pop("compile", None)
    options = LoadOptions(max_seq_len=max_seq_len, max_batch_size=max_batch_size, **kw)
    model, tokenizer = load_model(ckpt, tok, options, policy)
    return Llama(model, tokenizer, compile=compile, policy=policy)


def demo_llama(max_seq_len: int, max_batch_size: int = 2):
    """The bundled demo model in this process (float32, CPU): the reference a served demo's
    greedy answers are compared with."""
    from llama import Llama

    demo = REPO / "demo"
    return Llama.build(ckpt_dir=demo, tokenizer_path=demo / "tokenizer.model", max_seq_len=max_seq_len,
                       max_batch_size=max_batch_size, device="cpu")


def openai_greedy_chat(client, model: str, messages: list, stream: bool, max_tokens: int = 8):
    """(text, usage) of a greedy chat through the official ``openai`` client, whole or streamed
    (the usage of a stream from its last chunk, asked for with ``include_usage``); a non-200
    answer raises."""
    kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**kw)
        return reply.choices[0].message.content, reply.usage
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage


# -- servers started as subprocesses ---------------------------------------------------------------


def free_port() -> int:
    """A TCP port nothing listens on now (on 127.0.0.1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float, tail) -> bool:
    """Poll ``url``/health every 50 ms until it answers 200 (True) or ``timeout_s`` passes (False);
    the test fails at once, with the server's log (``tail()``), if ``proc`` exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited ({proc.returncode}) before answering:\n{tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def openai_client(url: str, timeout: float = 60):
    """The official client of the server at ``url`` (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def metric_by_label(url: str, name: str, label: str = "replica") -> dict[str, float]:
    """The samples of metric ``name`` on the server's /metrics page, by their ``label`` ("" where
    a sample has none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get(label, "")] = sample.value
    return out


def tokens_lasting(chunks, seconds: float, sent: float, least: int = 12, most: int = 400) -> int:
    """How many tokens a request decoding beside the stream `chunks` (an OpenAI completion stream
    sent at `time.monotonic()` == `sent`, its first chunk read) writes in about `seconds`.  The
    SIGTERM tests need a request still in flight when the signal lands and finished well within the
    grace period: a fixed count raced the machine's speed (12 tokens took 0.13 s on CI, done before
    the signal was sent).  The pace is chunks over time since the request was sent, read for at
    least half a second: timing only the next few chunks read ones the server had already
    buffered, near-instantly, and CI then asked 400 tokens that outlasted the 4 s grace."""
    read = 1
    while read < 10 or time.monotonic() - sent < 0.5:
        next(chunks)
        read += 1
    per_token = (time.monotonic() - sent) / read
    return max(least, min(most, round(seconds / per_token)))


def delay_masks(monkeypatch, sampler, delays: dict[int, float]) -> None:
    """Every grammar mask of the grammars in ``delays`` (by ``id``; read at each mask, so entries
    added later count) takes that many seconds more.  Given a ``sampler``, a grammar delayed past
    its ``mask_budget_s`` also has its first mask held until a step has decided without it (the
    sampler's ``_apply_grammars`` returned), so at least one of its rows is deferred however long
    this machine takes for the model's forward pass: a delay alone defers nothing where the
    forward pass (which the budget includes) outlasts it, as on a loaded CI machine."""
    from llama.structured import GrammarMasker

    fill = GrammarMasker.fill
    apply_grammars = sampler._apply_grammars if sampler is not None else None
    decided = threading.Condition()
    steps = [0]
    first_held: set[int] = set()

    def after_step(*args, **kw):
        try:
            return apply_grammars(*args, **kw)
        finally:
            with decided:
                steps[0] += 1
                decided.notify_all()

    def slowed(self, matchers, **kw):
        with decided:
            seen = steps[0]
        ids = {id(m.grammar) for m in matchers}
        late = set() if sampler is None else {g for g in ids if delays.get(g, 0.0) > sampler.mask_budget_s}
        late -= first_held
        if late:
            first_held.update(late)
            with decided:
                decided.wait_for(lambda: steps[0] > seen, timeout=10)
        delay = max((delays.get(g, 0.0) for g in ids), default=0.0)
        if delay:
            time.sleep(delay)
        return fill(self, matchers, **kw)

    monkeypatch.setattr(GrammarMasker, "fill", slowed)
    if sampler is not None:
        monkeypatch.setattr(sampler, "_apply_grammars", after_step)
