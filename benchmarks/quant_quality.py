"""What weight quantisation costs in quality, measured on the bundled demo model.

    python benchmarks/quant_quality.py [--ckpt_dir demo] [--max_chunks 40] [--max_gen_len 48]

For float32 (the reference), bfloat16, int8, w8a8 and int4 (group sizes 32, 64, 128) it
prints a table of:

- **held-out bits per character** on the demo's held-out play (Macbeth, never seen in
  training), scored through ``text_completion(..., max_gen_len=0, logprobs=True,
  echo=True)`` exactly as ``tools/eval_demo.py`` does (the first ``--max_chunks``
  chunks, to keep it quick);
- **greedy agreement with float32**: for each of the demo's sample prompts, the greedy
  continuation of ``--max_gen_len`` tokens; the share of positions whose token equals
  float32's, and how many tokens in a row agree from the start (mean).

Needs the demo's training corpus (``LLAMA_CORPUS_DIR``: see demo/MODEL_CARD.md) for the held-out play.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import fire
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import demo_data  # noqa: E402
from llama import Llama  # noqa: E402

SETTINGS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 (bf16 activations)": dict(dtype="bfloat16", quantize="int8"),
    # One row per step, so that decoding steps take int8 activations (w8a8 keeps bfloat16
    # ones for prompts and batched steps); bits/char scored token by token, as one-row steps.
    "w8a8 (int8 activations when decoding)": dict(dtype="bfloat16", quantize="w8a8", max_batch_size=1),
    "int4 g32": dict(dtype="float32", quantize="int4", quantize_group_size=32),
    "int4 g64": dict(dtype="float32", quantize="int4", quantize_group_size=64),
    "int4 g128": dict(dtype="float32", quantize="int4", quantize_group_size=128),
}


def greedy(llama: Llama, prompts: list[str], max_gen_len: int) -> list[list[int]]:
    tokens = [llama.tokenizer.encode(p, bos=True, eos=False) for p in prompts]
    out = []
    for start in range(0, len(tokens), llama.max_batch_size):
        out += llama.generate(tokens[start : start + llama.max_batch_size], max_gen_len=max_gen_len, temperature=0)[0]
    return out


def bits_per_char_one_row_steps(llama: Llama, chunks: list[str]) -> dict:
    """Held-out bits per character as ``demo_data.bits_per_char`` scores them, but each token
    through a one-row decoding step after the ones before it (the products a batch-1
    generation makes; for w8a8, its int8-activation path) instead of one prompt pass."""
    import math

    nll, n_chars = 0.0, 0
    with torch.inference_mode():
        for chunk in chunks:
            tokens = torch.tensor([llama.tokenizer.encode(chunk, bos=True, eos=False)])
            for i in range(tokens.shape[1] - 1):
                logits = llama.model.forward(tokens[:, i : i + 1], i)[0, -1].float()
                nll -= torch.log_softmax(logits, -1)[tokens[0, i + 1]].item()
            n_chars += len(chunk)
    return {"bits_per_char": nll / n_chars / math.log(2)}


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    same = total = 0
    runs = []
    for ref, oth in zip(reference, other):
        n = min(len(ref), len(oth))
        same += sum(a == b for a, b in zip(ref[:n], oth[:n]))
        total += max(len(ref), len(oth))
        run = 0
        while run < n and ref[run] == oth[run]:
            run += 1
        runs.append(run)
    return same / max(total, 1), statistics.mean(runs)


def main(ckpt_dir: str = str(ROOT / "demo"), max_chunks: int = 40, max_gen_len: int = 48, threads: int = 2,
         settings: str = "", torch_kernels: bool = False) -> None:
    """``settings``: the names of SETTINGS to run, comma-separated (float32, the reference, always
    runs); default all.  ``torch_kernels``: int8/int4 products through torch's kernels, not our
    CPU kernels (llama.layers.cpu_kernels), to compare the two."""
    torch.set_num_threads(threads)
    ckpt = Path(ckpt_dir)
    _, held_file = demo_data.split_corpus()
    rows, reference = [], None
    wanted = {"float32", *(n.strip() for n in settings.split(",") if n.strip())} if settings else set(SETTINGS)
    unknown = wanted - set(SETTINGS)
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; known: {list(SETTINGS)}")
    if torch_kernels:
        from llama.layers import cpu_kernels

        cpu_kernels.load = lambda: False  # type: ignore[assignment]  # prepare_model_ then keeps torch's kernels
    for name, options in SETTINGS.items():
        if name not in wanted:
            continue
        llama = Llama.build(ckpt, ckpt / "tokenizer.model", **{**dict(max_seq_len=256, max_batch_size=8, device="cpu"),
                                                               **options})
        chunks = demo_data.chunk_text(demo_data.read_text(held_file), llama.tokenizer, 255)[:max_chunks]
        score = (bits_per_char_one_row_steps(llama, chunks) if options.get("quantize") == "w8a8"
                 else demo_data.bits_per_char(llama, chunks, llama.max_batch_size))
        outputs = greedy(llama, demo_data.SAMPLE_PROMPTS, max_gen_len)
        if reference is None:
            reference = outputs
        share, run = agreement(reference, outputs)
        rows.append((name, score["bits_per_char"], share, run))
        del llama
    print(f"| weights | held-out bits/char ({max_chunks} chunks) | greedy tokens equal to float32 | "
          f"agreeing prefix (mean tokens of {max_gen_len}) |")
    print("| --- | --- | --- | --- |")
    for name, bpc, share, run in rows:
        print(f"| {name} | {bpc:.3f} | {share:.1%} | {run:.1f} |")


if __name__ == "__main__":
    fire.Fire(main)
