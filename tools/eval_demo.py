"""Measure the demo model through the library's own inference path.

    python tools/eval_demo.py --ckpt_dir demo

Two figures, printed as a table (and written as JSON with ``--out_json``):

- **Held-out bits per character**: the held-out play (never seen in training, nor by
  the tokenizer) is cut into consecutive chunks of whole lines, each at most
  ``max_seq_len - 1`` tokens, and scored with
  ``Llama.text_completion(chunks, max_gen_len=0, logprobs=True, echo=True)``.  The sum
  of -log p over every token but each chunk's BOS (which carries 0.0), divided by the
  characters of the chunks (the whole play: they decode back to it exactly) and by
  ln 2.  Each chunk starts from nothing but BOS: the first words of a chunk are
  predicted without the text before them, which costs a little against scoring the
  play as one stream.
- **Corpus-word percentage**: ``--samples_per_prompt`` generations from each of
  ``demo_data.SAMPLE_PROMPTS`` (temperature ``--temperature``, top-p ``--top_p``,
  ``--max_gen_len`` tokens); of the lowercase alphabetic words of the generated text
  (letters with inner apostrophes, e.g. "o'er"), the share that occur anywhere in the
  41 works of the corpus.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_data  # noqa: E402
from llama import Llama  # noqa: E402


def sample_generations(
    llama: Llama, prompts: list[str], samples_per_prompt: int, temperature: float, top_p: float, max_gen_len: int
) -> list[tuple[str, str]]:
    """(prompt, generated text) pairs, each prompt ``samples_per_prompt`` times."""
    batch = [p for p in prompts for _ in range(samples_per_prompt)]
    out = []
    for start in range(0, len(batch), llama.max_batch_size):
        part = batch[start : start + llama.max_batch_size]
        results = llama.text_completion(part, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len)
        out.extend((p, r["generation"]) for p, r in zip(part, results))
    return out


def main(
    ckpt_dir: str = "demo",
    tokenizer_path: Optional[str] = None,
    corpus_dir: str = str(demo_data.DEFAULT_CORPUS),
    held_out: str = demo_data.HELD_OUT,
    max_seq_len: int = 256,
    max_batch_size: int = 16,
    max_chunks: Optional[int] = None,
    samples_per_prompt: int = 4,
    temperature: float = 0.8,
    top_p: float = 1.0,
    max_gen_len: int = 128,
    seed: int = 1,
    threads: int = 2,
    show_samples: int = 2,
    out_json: Optional[str] = None,
) -> None:
    """Score the held-out play and the corpus-word share of sampled text.

    Args:
        ckpt_dir: the model directory (params.json, consolidated.00.pth).
        tokenizer_path: default: ckpt_dir/tokenizer.model.
        corpus_dir: the Shakespeare texts (*.txt).
        held_out: file stem of the held-out play.
        max_seq_len: tokens per scored chunk, BOS included (the training length is 256).
        max_batch_size: chunks / prompts per forward.
        max_chunks: score only the first N chunks (default: the whole play).
        samples_per_prompt, temperature, top_p, max_gen_len: the sampled generations.
        seed: sampling seed (Llama.build's).
        threads: torch CPU threads.
        show_samples: how many generations to print.
        out_json: also write the figures here.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    tokenizer_path = tokenizer_path or str(Path(ckpt_dir) / "tokenizer.model")
    train_files, held_file = demo_data.split_corpus(corpus_dir, held_out)

    start = time.perf_counter()
    llama = Llama.build(ckpt_dir, tokenizer_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size, seed=seed,
                        device="cpu")
    chunks = demo_data.chunk_text(demo_data.read_text(held_file), llama.tokenizer, max_seq_len - 1)
    if max_chunks is not None:
        chunks = chunks[:max_chunks]
    score = demo_data.bits_per_char(llama, chunks, max_batch_size)
    score_s = time.perf_counter() - start

    start = time.perf_counter()
    samples = sample_generations(llama, demo_data.SAMPLE_PROMPTS, samples_per_prompt, temperature, top_p, max_gen_len)
    vocabulary = demo_data.corpus_vocabulary(train_files + [held_file])
    fraction, n_words = demo_data.corpus_word_fraction([g for _, g in samples], vocabulary)
    sample_s = time.perf_counter() - start

    rows = [
        ("held-out play", f"{held_file.name} ({score['chunks']} chunks of <= {max_seq_len} tokens)"),
        ("characters / tokens scored", f"{score['chars']} / {score['tokens']}"),
        ("held-out bits/char", f"{score['bits_per_char']:.3f}"),
        ("held-out bits/token", f"{score['bits_per_token']:.3f}"),
        ("generations", f"{len(samples)} (T={temperature}, top_p={top_p}, {max_gen_len} tokens)"),
        ("generated words in corpus", f"{100 * fraction:.1f}% of {n_words}"),
        ("time (scoring, sampling)", f"{score_s:.1f} s, {sample_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}} | value")
    print(f"{'-' * width}-+-{'-' * 40}")
    for k, v in rows:
        print(f"{k:<{width}} | {v}")
    for prompt, generation in samples[: show_samples * samples_per_prompt : samples_per_prompt]:
        print(f"\n--- prompt {prompt!r}\n{prompt}{generation}")
    if out_json:
        Path(out_json).write_text(
            json.dumps(
                {
                    **score,
                    "held_out": held_file.name,
                    "max_seq_len": max_seq_len,
                    "corpus_word_fraction": fraction,
                    "generated_words": n_words,
                    "temperature": temperature,
                    "top_p": top_p,
                    "samples": [{"prompt": p, "generation": g} for p, g in samples],
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    fire.Fire(main)
