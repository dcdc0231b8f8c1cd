"""Images on a small Llama 4 that sees, or a small Llama 3.2 Vision, on the CPU: how long the
encoder takes for one image, and what one image adds to a chat's time to first token.

    python benchmarks/bench_images.py                          # float32 and bfloat16, 2 threads (~1-2 min)
    python benchmarks/bench_images.py --model mllama           # the Llama 3.2 Vision shape below
    python benchmarks/bench_images.py --threads 8 --repeats 9
    python benchmarks/bench_images.py --dtypes float32

The model (random weights, seeded): the encoder at Llama 4's tile geometry (336-pixel tiles in
14-pixel patches: 577 tokens a tile through the ViT, 144 ``<|patch|>`` features after the pixel
shuffle) but 256 wide, 2 layers, 4 heads (Scout's: 1408 wide, 34 layers, 16 heads); a text model
of width 256, 4 layers, 4 heads (2 K/V), 4 experts top-1 on every 2nd layer, with Llama 4's
vocabulary and tokenizer (llama-models' ``tokenizer.model``), so that the chat format lays out
the image tokens as for Scout.

``--model mllama``: Llama 3.2 Vision's Instruct geometry (560-pixel tiles in 14-pixel patches,
1,601 tokens a tile, at most 4 tiles) with an encoder 256 wide, 4 + 2 global layers, 4 heads
(11B's: 1280 wide, 32 + 8 layers, 16 heads) and a text model of width 256, 4 self-attention layers
and 2 cross-attention layers, with Llama 3's vocabulary and tokenizer; its largest image has 4 tiles.

Rows:
  encode 1 tile         ``model.encode_images`` of one tile (an image of at most 336 x 336)
  encode N tiles        of the largest image (a 4 x 4 grid and the global tile: N = 17)
  TTFT text             a one-question chat, text only: the chat format, the engine's prefill,
                        the first token (``max_new_tokens=1``)
  TTFT + 1-tile image   the same question after a 336 x 336 picture (its preprocessing included)
  TTFT + N-tile image   after a 1344 x 1344 picture (the largest: N tiles)
Each cell: median [min-max] ms over ``--repeats`` repetitions, the rows interleaved within each
repetition (after one warm-up round); every repetition gets a new picture and question, so the
prefix cache never serves a prompt (checked).  Prints a markdown table.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama import Llama, ModelArgs  # noqa: E402
from llama.engine import RequestSettings  # noqa: E402
from llama.engine.build import assemble_engine  # noqa: E402
from llama.images.prompt import MAX_IMAGE_TILES, MllamaLayout  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.runtime import distributed, host  # noqa: E402
from llama.tokenizer import load_tokenizer  # noqa: E402

LLAMA4_VOCAB = 202048
TEXT = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, ffn_dim_multiplier=1.2, ffn_exp=2.0,
            norm_eps=1e-5, rope_theta=500000.0, moe_args=dict(num_experts=4, top_k=1, interleave_moe_layer_step=2),
            attention_chunk_size=8192, nope_layer_interval=4, use_qk_norm=True, vocab_size=LLAMA4_VOCAB)
VISION = dict(image_size=336, patch_size=14, dim=256, n_layers=2, n_heads=4, mlp_ratio=4.0, output_dim=256,
              pixel_shuffle_ratio=0.5)
MLLAMA_TEXT = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, ffn_dim_multiplier=1.2,
                   norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256, vision_chunk_size=560,
                   vision_max_num_chunks=4, vision_num_cross_attention_layers=2)
MLLAMA_VISION = dict(dim=256, n_layers=4, n_global_layers=2, n_heads=4, patch_size=14, mlp_ratio=4.0,
                     intermediate_layers=[1, 3])
QUESTION = "Question {}: what is in this picture?"


def llama3_tokenizer_path() -> Path:
    import llama_models

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def llama4_tokenizer_path() -> Path:
    import llama_models

    return Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"


def build(dtype: torch.dtype, tokenizer, max_seq_len: int, mllama: bool = False) -> Llama:
    """The model with seeded random weights (activations of order 1), its engine on the CPU, eager."""
    distributed.init_model_parallel(torch.device("cpu"))
    shape = {**MLLAMA_TEXT, "mllama_vision_args": MLLAMA_VISION} if mllama else {**TEXT, "vision_args": VISION}
    args = ModelArgs.from_dict({**shape, "max_seq_len": max_seq_len, "max_batch_size": 1})
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or ".ln_" in name):
                p.fill_(1.0)
            elif p.dim() == 1:  # biases, the class token
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, p.shape[-2 if "experts.w" in name else -1] ** -0.5)
            p.data = p.data.to(dtype)  # parameters only: the rotation tables stay complex
    model.setup_rope()
    model.eval()
    return Llama._holding(assemble_engine(model, tokenizer, compile=False))


def picture(side: int, seed: int) -> bytes:
    """A PNG of ``side`` x ``side`` random pixels (a new one for each seed: no cache can serve it)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (side * side * 3,), dtype=torch.uint8, generator=g).numpy().tobytes()
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), data).save(buf, format="PNG")
    return buf.getvalue()


def time_to_first_token(llama: Llama, text: str, image: bytes | None) -> tuple[float, int]:
    """(seconds, prompt tokens) from the dialog to its first token: the chat format (and the
    picture's preprocessing), then the engine's prefill (the encoder included) and first token."""
    content = text if image is None else [{"type": "image", "image": image}, {"type": "text", "text": text}]
    start = time.perf_counter()
    encoded = llama.formatter.encode_dialog([{"role": "user", "content": content}])
    result = llama.engine.submit(encoded.tokens, RequestSettings(max_new_tokens=1, temperature=0.0),
                                 images=encoded.images).result()
    seconds = time.perf_counter() - start
    if result.n_cached_prompt_tokens:
        raise RuntimeError("the prefix cache served part of a timed prompt: the timing is not a full prefill")
    return seconds, len(encoded.tokens)


def main(threads: int = 2, repeats: int = 5, dtypes: tuple = ("float32", "bfloat16"), model: str = "llama4") -> None:
    """Print a markdown table of encoding times and times to first token (see the module's help).
    ``model``: ``llama4`` or ``mllama`` (Llama 3.2 Vision)."""
    if model not in ("llama4", "mllama"):
        raise ValueError(f"--model must be llama4 or mllama, got {model!r}")
    mllama = model == "mllama"
    host.configure_cpu_threads()  # (so that it does not replace the count set next)
    torch.set_num_threads(threads)
    dtypes = tuple(dtypes) if isinstance(dtypes, (list, tuple)) else (str(dtypes),)
    tokenizer = load_tokenizer(llama3_tokenizer_path() if mllama else llama4_tokenizer_path())
    models = {name: build(getattr(torch, name), tokenizer, max_seq_len=4096, mllama=mllama) for name in dtypes}
    if mllama:
        layout = MllamaLayout(int(MLLAMA_TEXT["vision_chunk_size"]), int(MLLAMA_TEXT["vision_max_num_chunks"]))
        size, most = layout.chunk_size, layout.max_num_chunks
        grids = {1: (1, 1), most: (2, 2)}  # one tile; the largest canvas (2 x 2 tiles)
        sides = {1: size, most: 2 * size}
    else:
        size, most = int(VISION["image_size"]), MAX_IMAGE_TILES
        sides = {1: size, most: 4 * size}  # one tile; a 4 x 4 grid and the global tile
    tiles = {n: torch.rand(n, 3, size, size) * 2 - 1 for n in (1, most)}

    def encoder(llama: Llama, n: int) -> Callable[[], object]:
        """One call of the model's image encoder on ``n`` tiles (Llama 3.2 Vision: with each
        cross-attention layer's K/V, which the engine computes with it)."""
        if not mllama:
            return lambda: llama.model.encode_images(tiles[n])
        pixels = torch.zeros(1, 1, most, 3, size, size)
        pixels[0, 0, :n] = tiles[n]
        ratio = torch.tensor([[layout.aspect_ratio_id(grids[n])]])
        prompt = torch.tensor([[llama.model.image_token_id]])
        return lambda: llama.model.image_context(pixels.to(llama.model.dtype), ratio, prompt)

    rows = ["encode 1 tile", f"encode {most} tiles", "TTFT text", "TTFT + 1-tile image", f"TTFT + {most}-tile image"]
    times: dict[tuple[str, str], list[float]] = {}
    prompt_tokens: dict[str, int] = {}

    def run_round(rep: int, record: bool) -> None:
        for dtype, llama in models.items():
            cases: list[tuple[str, Callable[[], float]]] = []
            for n in tiles:
                def encode(call=encoder(llama, n)) -> float:
                    start = time.perf_counter()
                    call()
                    return time.perf_counter() - start
                cases.append((rows[0] if n == 1 else rows[1], encode))
            for row, n in ((rows[2], 0), (rows[3], 1), (rows[4], most)):
                def ttft(row=row, n=n) -> float:
                    image = picture(sides[n], seed=1000 * rep + n) if n else None
                    seconds, count = time_to_first_token(llama, QUESTION.format(rep), image)
                    prompt_tokens[row] = count
                    return seconds
                cases.append((row, ttft))
            for row, case in cases:
                seconds = case()
                if record:
                    times.setdefault((row, dtype), []).append(seconds)

    with torch.inference_mode():
        run_round(-1, record=False)  # warm-up: kernels, the allocator, the tokenizer's caches
        for rep in range(repeats):
            run_round(rep, record=True)

    if mllama:
        v = MLLAMA_VISION
        t = MLLAMA_TEXT
        print(f"Llama 3.2 Vision shape: text dim {t['dim']}, {t['n_layers']} self-attention and "
              f"{t['vision_num_cross_attention_layers']} cross-attention layers, {t['n_heads']} heads "
              f"({MLLAMA_TEXT['n_kv_heads']} K/V), vocabulary {MLLAMA_TEXT['vocab_size']}; encoder {size}-pixel tiles "
              f"in {v['patch_size']}-pixel patches, at most {most} tiles, dim {v['dim']}, {v['n_layers']} + "
              f"{v['n_global_layers']} global layers, {v['n_heads']} heads.  CPU, {threads} thread(s), eager, "
              f"{repeats} interleaved repetitions; ms: median [min-max].")
    else:
        print(f"Llama 4 shape: text dim {TEXT['dim']}, {TEXT['n_layers']} layers, {TEXT['n_heads']} heads "
              f"({TEXT['n_kv_heads']} K/V), 4 experts top-1 every 2nd layer, vocabulary {LLAMA4_VOCAB}; encoder "
              f"{VISION['image_size']}-pixel tiles in {VISION['patch_size']}-pixel patches, dim {VISION['dim']}, "
              f"{VISION['n_layers']} layers, {VISION['n_heads']} heads.  CPU, {threads} thread(s), eager, "
              f"{repeats} interleaved repetitions; ms: median [min-max].")
    print()
    print("| step | prompt tokens | " + " | ".join(f"{d} ms" for d in dtypes) + " |")
    print("|---|---:|" + "---:|" * len(dtypes))
    for row in rows:
        cells = []
        for dtype in dtypes:
            ts = [t * 1e3 for t in times[(row, dtype)]]
            cells.append(f"{statistics.median(ts):.1f} [{min(ts):.1f}-{max(ts):.1f}]")
        print(f"| {row} | {prompt_tokens.get(row, '')} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    fire.Fire(main)
