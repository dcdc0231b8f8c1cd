"""Train the bundled demo model (``demo/``) on the Shakespeare corpus, on CPU.

The exact command that made the shipped files, run from the repository root (20.5
minutes on a 2-core machine shared with other jobs, about 11 on an idle one)::

    python tools/train_demo.py --out_dir demo

It reads ``$LLAMA_CORPUS_DIR/shakespeare/*.txt`` (see tools/demo_data.py), keeps the held-out play
(``tools/demo_data.HELD_OUT``) out of everything, and writes Llama 2-layout files:

- ``tokenizer.model``: SentencePiece BPE, byte fallback, unk 0 / BOS 1 / EOS 2, no pad;
- ``params.json``: Meta's keys;
- ``consolidated.00.pth``: a plain dict of bfloat16 tensors named as the
  ``llama.model.Transformer`` state dict (Meta's checkpoint names).

The model is ``llama.model.Transformer`` itself, trained through
``forward_uncached`` with AdamW, linear warmup and cosine decay, bfloat16 autocast.
Everything random is seeded (``--seed``), and the number of steps is fixed, so a run
is repeatable on the same machine and thread count.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import fire
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_data  # noqa: E402
from llama.args import ModelArgs  # noqa: E402
from llama.formats.chat import B_INST, E_INST  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.runtime.distributed import init_model_parallel  # noqa: E402
from llama.tokenizer import SentencePieceTokenizer  # noqa: E402

logger = logging.getLogger("train_demo")


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the kernel.

    Every training step allocates and frees the same few large activation tensors.
    By default glibc serves blocks over 32 MiB (and, after trimming, smaller ones)
    with fresh ``mmap`` pages, so each step pays page faults and kernel zeroing for
    them; on this 2-core machine that cost about 40% of the step time.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_max = -1, -4  # from malloc.h
    libc.mallopt(m_mmap_max, 0)  # never mmap: all blocks from the heap
    libc.mallopt(m_trim_threshold, 1 << 30)  # and do not give the heap back


# -- tokenizer ---------------------------------------------------------------------------


def _pieces(texts: list[str], size: int = 2000):
    """The training texts in pieces of about ``size`` characters, each cut after a newline."""
    for text in texts:
        start = 0
        while start < len(text):
            end = text.find("\n", start + size)
            end = len(text) if end < 0 else end + 1
            yield text[start:end]
            start = end


def train_tokenizer(texts: list[str], vocab_size: int, out_path: Path) -> None:
    """A Llama 2-style SentencePiece BPE model trained on ``texts``.

    Same settings as Llama 2's (BPE, byte fallback, digits split, unk 0 / BOS 1 / EOS 2,
    no pad, text kept as is).  One difference in how text is fed: SentencePiece's
    trainer normally reads one line per sentence, which leaves the newline out of every
    piece (Llama 2 spells it as the byte token <0x0A>) and learns line-initial words
    only in their space-prefixed form ("▁When"), though in running text they follow a
    newline ("\\nWhen" -> "When").  Feeding ~2000-character multi-line pieces instead
    lets BPE learn ".\\n", ",\\n", "?\\n\\n" and unprefixed line-initial words: 14% fewer
    tokens for the same text, so more text per training step.
    """
    import sentencepiece as spm

    prefix = out_path.with_suffix("")
    spm.SentencePieceTrainer.train(
        sentence_iterator=_pieces(texts),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        max_sentence_length=1 << 16,
    )
    if prefix.with_suffix(".model") != out_path:
        prefix.with_suffix(".model").replace(out_path)
    prefix.with_suffix(".vocab").unlink(missing_ok=True)


# -- data ----------------------------------------------------------------------------------


class MixedSampler:
    """Batches of ``chat`` rows with probability ``chat_fraction``, else of ``text`` rows
    (whole batches of one kind, so a chat batch can be cut to its longest row)."""

    def __init__(self, text: "WindowSampler", chat: Optional["DialogSampler"], chat_fraction: float, seed: int) -> None:
        self.text, self.chat, self.chat_fraction = text, chat, chat_fraction
        self.rng = random.Random(seed + 2)

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        source = self.chat if self.chat is not None and self.rng.random() < self.chat_fraction else self.text
        rows = [source.row() for _ in range(batch_size)]
        x, y = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
        # Cut the padding every row has in common (chat rows are short): less compute, same loss.
        used = int((y != -100).any(dim=0).nonzero().max()) + 1
        return x[:, :used], y[:, :used]


class WindowSampler:
    """Training rows like the evaluation's chunks: each starts at the start of a
    (non-blank) line, is encoded on its own (so its first word gets SentencePiece's
    dummy-prefix space, as a chunk's does), and is fed after BOS.

    Row: inputs ``[BOS, t0 .. t(T-2)]``, targets ``[t0 .. t(T-1)]``.  A row that runs
    off the end of its work ends with EOS; targets past it are ignored (-100).
    """

    def __init__(self, texts: list[str], tokenizer: SentencePieceTokenizer, seq_len: int, seed: int) -> None:
        self.texts = texts
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rng = random.Random(seed)
        # Every line start of every work, drawn uniformly: works weigh by their length.
        self.starts = [(i, s) for i, t in enumerate(texts) for s in demo_data.unit_starts(t)]

    def row(self) -> tuple[list[int], list[int]]:
        doc, start = self.starts[self.rng.randrange(len(self.starts))]
        text = self.texts[doc]
        n_chars = 8 * self.seq_len  # ~3 characters a token: plenty
        while True:
            piece = text[start : start + n_chars]
            ids = self.tokenizer.encode(piece, bos=False, eos=False)
            at_end = start + n_chars >= len(text)
            # Leave a margin so the last kept token is not cut by the window's end.
            if at_end or len(ids) >= self.seq_len + 16:
                break
            n_chars *= 2
        if at_end:
            ids = ids + [self.tokenizer.eos_id]
        ids = ids[: self.seq_len]
        targets = ids + [-100] * (self.seq_len - len(ids))
        inputs = [self.tokenizer.bos_id] + ids[: self.seq_len - 1]
        inputs += [self.tokenizer.eos_id] * (self.seq_len - len(inputs))  # never a target's context
        return inputs, targets

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row() for _ in range(batch_size)]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


class DialogSampler:
    """Chat rows in the Llama 2 chat format, drawn from the plays' dialog: one speech is
    the user's message, the next speaker's reply is the assistant's answer.

    A row is 1 to ``max_pairs`` consecutive exchanges of one run of speeches
    (:func:`demo_data.dialog_turns`), encoded exactly as
    :class:`llama.formats.chat.Llama2ChatFormat` renders a conversation's history: each
    exchange is ``BOS [INST] {user} [/INST] {answer} EOS``.
    Only the answers and their EOS are targets (the prompt tokens are context, -100), so the model learns to answer
    and to end its answer; the rest of the row is padding (-100).  Exchanges whose
    answer encodes to more than ``max_answer`` tokens are never drawn.
    """

    def __init__(self, runs: list[list[str]], tokenizer: SentencePieceTokenizer, seq_len: int, seed: int,
                 max_pairs: int = 4, max_answer: int = 160) -> None:
        self.runs = runs
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.max_pairs = max_pairs
        self.max_answer = max_answer
        self.rng = random.Random(seed + 1)
        # Every (run, position) whose speech at position+1 is a short enough answer.
        self.starts = [
            (r, i)
            for r, run in enumerate(runs)
            for i in range(len(run) - 1)
            if len(tokenizer.encode(run[i + 1], bos=False, eos=False)) <= max_answer
        ]

    def exchange(self, user: str, answer: str) -> tuple[list[int], list[int]]:
        """(tokens, targets) of one exchange; targets are -100 over the prompt."""
        prompt = self.tokenizer.encode(f"{B_INST} {user.strip()} {E_INST}", bos=True, eos=False)
        tokens = self.tokenizer.encode(f"{B_INST} {user.strip()} {E_INST} {answer.strip()} ", bos=True, eos=True)
        n_prompt = len(prompt) if tokens[: len(prompt)] == prompt else len(prompt) - 1
        return tokens, [-100] * n_prompt + tokens[n_prompt:]

    def row(self) -> tuple[list[int], list[int]]:
        while True:
            r, i = self.starts[self.rng.randrange(len(self.starts))]
            run = self.runs[r]
            n_pairs = self.rng.randint(1, self.max_pairs)
            tokens, targets = self.exchange(run[i], run[i + 1])
            if len(tokens) <= self.seq_len + 1:
                break
        for k in range(1, n_pairs):
            j = i + 2 * k
            if j + 1 >= len(run):
                break
            more, more_targets = self.exchange(run[j], run[j + 1])
            if len(tokens) + len(more) > self.seq_len + 1:
                break
            tokens, targets = tokens + more, targets + more_targets
        # Next-token rows: input t[0..n-2], target t[1..n-1] (where it is an answer token).
        inputs, targets = tokens[:-1], targets[1:]
        pad = self.seq_len - len(inputs)
        return inputs + [self.tokenizer.eos_id] * pad, targets + [-100] * pad


def encode_chunks(chunks: list[str], tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Evaluation chunks as (inputs, targets) rows like the sampler's, and their characters."""
    inputs, targets = [], []
    for chunk in chunks:
        ids = tokenizer.encode(chunk, bos=True, eos=False)
        pad = seq_len + 1 - len(ids)
        inputs.append(ids[:-1] + [tokenizer.eos_id] * pad)
        targets.append(ids[1:] + [-100] * pad)
    return torch.tensor(inputs), torch.tensor(targets), sum(len(c) for c in chunks)


@torch.no_grad()
def held_out_bits_per_char(model: Transformer, inputs, targets, n_chars: int, batch_size: int, autocast: bool) -> float:
    model.eval()
    nll = 0.0
    for start in range(0, len(inputs), batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model.forward_uncached(x)
        nll += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
    model.train()
    return nll / n_chars / math.log(2)


# -- model ---------------------------------------------------------------------------------


def init_weights(model: Transformer, n_layers: int, generator: torch.Generator) -> None:
    """GPT-2-style initialisation: N(0, 0.02) matrices, the two projections back into the
    residual stream (``wo``, ``w2``) scaled by 1/sqrt(2 * n_layers), norms at 1.

    The library creates parameters uninitialised and frozen (it is made for loading
    checkpoints); here they are filled and made trainable.
    """
    for name, p in model.named_parameters():
        if p.ndim == 1:
            torch.nn.init.ones_(p)
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            torch.nn.init.normal_(p, mean=0.0, std=std, generator=generator)
        p.requires_grad_(True)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_ratio: float) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(model: Transformer, params: dict, out_dir: Path) -> None:
    state = {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in model.state_dict().items()}
    torch.save(state, out_dir / "consolidated.00.pth")
    (out_dir / "params.json").write_text(json.dumps(params, indent=2) + "\n")


# -- main ------------------------------------------------------------------------------


def main(
    out_dir: str = "demo",
    corpus_dir: str = str(demo_data.DEFAULT_CORPUS),
    held_out: str = demo_data.HELD_OUT,
    vocab_size: int = 4096,
    dim: int = 256,
    n_layers: int = 6,
    n_heads: int = 8,
    n_kv_heads: Optional[int] = 4,
    multiple_of: int = 256,
    seq_len: int = 256,
    batch_size: int = 16,
    steps: int = 1000,
    lr: float = 2e-3,
    min_lr_ratio: float = 0.1,
    warmup: int = 100,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    seed: int = 1234,
    eval_every: int = 100,
    eval_chunks: int = 48,
    log_every: int = 50,
    threads: int = 2,
    autocast: bool = True,
    init_from: Optional[str] = None,
    chat_fraction: float = 0.0,
    tokenizer_from: Optional[str] = None,
) -> None:
    """Train the demo model and write tokenizer.model, params.json and consolidated.00.pth.

    Args:
        out_dir: where the model files go (created).
        corpus_dir: the Shakespeare texts (*.txt).
        held_out: file stem of the play kept out of training and used for evaluation.
        vocab_size: SentencePiece vocabulary (a multiple of 4 so it splits over 1/2/4 ranks).
        dim, n_layers, n_heads, n_kv_heads, multiple_of: the params.json shape.
        seq_len: tokens per training row (BOS included).
        batch_size: rows per step.
        steps: optimiser steps (fixed, so runs repeat).
        lr, min_lr_ratio, warmup: peak learning rate, final fraction of it, warmup steps.
        weight_decay: AdamW decay on matrices (not on norm weights).
        grad_clip: global gradient-norm clip.
        seed: seeds the data order and the initial weights.
        eval_every: steps between held-out evaluations (on the first eval_chunks chunks).
        eval_chunks: chunks of the held-out play scored during training.
        log_every: steps between progress lines.
        threads: torch CPU threads.
        autocast: bfloat16 autocast for the matrix products (float32 master weights).
        init_from: fine-tune: start from this model directory's weights and tokenizer
            (its params.json shape) instead of training a tokenizer and initialising
            at random.
        chat_fraction: share of the rows that are chat exchanges drawn from the plays
            (:class:`DialogSampler`) rather than plain text windows.
        tokenizer_from: a model directory whose tokenizer.model is used instead of training
            one (the weights still start at random, in this run's shape): a model that shares
            another's tokenizer, such as a draft model for speculative decoding
            (benchmarks/bench_speculative.py).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wall_start = time.perf_counter()
    keep_freed_memory()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    train_files, held_file = demo_data.split_corpus(corpus_dir, held_out)
    texts = [demo_data.read_text(f) for f in train_files]
    logger.info(
        "corpus: %d training works, %d characters; held out: %s (%d characters)",
        len(texts), sum(map(len, texts)), held_file.name, len(demo_data.read_text(held_file)),
    )

    t0 = time.perf_counter()
    tok_path = out / "tokenizer.model"
    if init_from and tokenizer_from:
        raise ValueError("give init_from (its weights and tokenizer) or tokenizer_from (its tokenizer alone), not both")
    if init_from or tokenizer_from:
        source = Path(init_from or tokenizer_from) / "tokenizer.model"
        if not source.is_file():
            raise FileNotFoundError(f"no tokenizer.model in {source.parent}: give a model directory that holds one")
        if source.resolve() != tok_path.resolve():
            shutil.copyfile(source, tok_path)
    else:
        train_tokenizer(texts, vocab_size, tok_path)
    tokenizer = SentencePieceTokenizer(tok_path)
    n_train_tokens = sum(len(tokenizer.encode(t, bos=False, eos=False)) for t in texts)
    logger.info(
        "tokenizer: %d pieces, %.1f s; training text is %d tokens (%.2f characters/token)",
        tokenizer.n_words, time.perf_counter() - t0, n_train_tokens, sum(map(len, texts)) / n_train_tokens,
    )

    start_state = None
    if init_from:
        params = json.loads((Path(init_from) / "params.json").read_text())
        start_state = torch.load(Path(init_from) / "consolidated.00.pth", map_location="cpu", weights_only=True)
        n_layers = params["n_layers"]
    else:
        params = {
            "dim": dim,
            "n_layers": n_layers,
            "n_heads": n_heads,
            **({"n_kv_heads": n_kv_heads} if n_kv_heads else {}),
            "vocab_size": tokenizer.n_words,
            "multiple_of": multiple_of,
            "norm_eps": 1e-5,
            "rope_theta": 10000.0,
        }
    args = ModelArgs.from_dict(params, max_seq_len=seq_len, max_batch_size=1)
    init_model_parallel(torch.device("cpu"))
    model = Transformer(args)
    if start_state is None:
        init_weights(model, n_layers, torch.Generator().manual_seed(seed))
    else:
        model.load_state_dict(start_state)  # bfloat16 weights into float32 parameters
        for p in model.parameters():
            p.requires_grad_(True)
        logger.info("fine-tuning from %s", init_from)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %s, FFN hidden %d, %.2fM parameters", params, args.ffn_hidden_dim, n_params / 1e6)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    chat = None
    if chat_fraction > 0:
        runs = [run for t in texts for run in demo_data.dialog_turns(t)]
        chat = DialogSampler(runs, tokenizer, seq_len, seed)
        logger.info("chat: %d runs of dialog, %d exchanges to draw from, %.0f%% of rows",
                    len(runs), len(chat.starts), 100 * chat_fraction)
    sampler = MixedSampler(WindowSampler(texts, tokenizer, seq_len, seed), chat, chat_fraction, seed)
    chunks = demo_data.chunk_text(demo_data.read_text(held_file), tokenizer, seq_len - 1)
    eval_x, eval_y, eval_n_chars = encode_chunks(chunks[:eval_chunks], tokenizer, seq_len)
    logger.info(
        "training: %d steps x %d rows x %d tokens = %.2fM tokens (%.1f passes over the training text)",
        steps, batch_size, seq_len, steps * batch_size * seq_len / 1e6, steps * batch_size * seq_len / n_train_tokens,
    )

    model.train()
    train_start = time.perf_counter()
    running = None
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, min_lr_ratio)
        x, y = sampler.batch(batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model.forward_uncached(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        done = step + 1
        if done % log_every == 0 or done == steps:
            elapsed = time.perf_counter() - train_start
            logger.info(
                "step %d/%d  loss %.3f (avg %.3f)  grad norm %.2f  lr %.2e  %.0f tokens/s  %.1f min, ~%.1f min left",
                done, steps, loss.item(), running, grad_norm, optimizer.param_groups[0]["lr"],
                done * batch_size * seq_len / elapsed, elapsed / 60, elapsed / done * (steps - done) / 60,
            )
        if done % eval_every == 0 or done == steps:
            bpc = held_out_bits_per_char(model, eval_x, eval_y, eval_n_chars, batch_size, autocast)
            logger.info("step %d: held-out %.3f bits/char (first %d chunks of %s)", done, bpc, len(eval_x), held_out)

    train_time = time.perf_counter() - train_start
    save_checkpoint(model, params, out)
    total = time.perf_counter() - wall_start
    logger.info("training %.1f min; whole run %.1f min; wrote %s", train_time / 60, total / 60, out)
    summary = {
        "params": params,
        "n_params": n_params,
        "steps": steps,
        "tokens_seen": steps * batch_size * seq_len,
        "train_tokens": n_train_tokens,
        "train_minutes": train_time / 60,
        "total_minutes": total / 60,
        "final_loss_avg": running,
    }
    logger.info("summary: %s", json.dumps(summary))


if __name__ == "__main__":
    fire.Fire(main)
