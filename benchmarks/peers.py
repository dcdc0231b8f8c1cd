"""The same random weights for this library, Hugging Face transformers and llama.cpp: the
checkpoint and GGUF files of ``benchmarks/bench_serve.py``.

Files, written once per config under a work directory and reused:
  meta/               params.json, consolidated.00.pth (bench.py's random weights) and
                      Meta's real Llama 3 tokenizer.model (from the llama-models package)
  hf/                 ``python -m llama.convert meta_to_hf meta hf``, laid out as Meta's Llama 3
                      HF repositories are (tokenizer.model moved to original/)
  model-float32.gguf  llama.cpp's ``convert_hf_to_gguf.py hf --outtype f32``; likewise bf16 and
  model-bfloat16.gguf q8_0 for bfloat16 and int8
  model-int8.gguf
  model-int4.gguf     ``llama_cpp.llama_model_quantize`` of the F32 file to Q4_0 with ``pure``
                      set: every matrix, output.weight included, in Q4_0 (llama.cpp's own default
                      would keep output.weight in Q6_K; ``quantize="int4"`` quantises the output
                      layer too, so this is the same work)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
# llama.cpp's name for each precision, and the converter's --outtype (int4: quantised afterwards)
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "Q8_0", "int4": "Q4_0"}
CONVERTER_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}


# -- the weights, once for every engine ------------------------------------------------------------


def write_checkpoint(config: str, dtype: str, out: Path, silent_specials: bool = False) -> Path:
    """A Meta-format checkpoint (params.json, consolidated.00.pth, tokenizer.model) of bench.py's
    random weights for ``config``, in ``dtype``.

    ``silent_specials``: the output rows of the 256 special tokens are zero.  Their logits are then
    exactly 0 while the largest of the other 128,000 (unit-scale) logits is about 4, so greedy
    decoding never emits one: no end-of-text token cuts a generation short, in any engine and at
    any precision (a zero row stays zero in int8, int4, Q8_0 and Q4_0)."""
    if (out / "consolidated.00.pth").is_file():
        return out
    import torch

    import bench
    from llama import ModelArgs, distributed

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = bench._llama3_tokenizer()
    args = ModelArgs(**bench.CONFIGS[config], vocab_size=bench.LLAMA3_VOCAB)
    model, state = bench.random_weights(args, distributed.resolve_dtype(dtype, torch.device("cpu")))
    names = {n for n, _ in model.named_parameters()}
    state = {n: t for n, t in state.items() if n in names}
    if silent_specials:
        state["output.weight"][min(tokenizer.special_tokens.values()):] = 0
    (out / "params.json").write_text(json.dumps({**bench.CONFIGS[config], "vocab_size": bench.LLAMA3_VOCAB}))
    shutil.copyfile(tokenizer.model_path, out / "tokenizer.model")
    torch.save(state, out / "consolidated.00.pth.partial")  # renamed once complete: an interrupted
    (out / "consolidated.00.pth.partial").rename(out / "consolidated.00.pth")  # run is not reused
    return out


def find_converter(converter: Optional[str]) -> Optional[Path]:
    """llama.cpp's convert_hf_to_gguf.py: ``converter`` or an unpacked llama-cpp-python sdist in /tmp."""
    candidates = [converter] if converter else []
    candidates += [c for c in glob.glob("/tmp/*/*/vendor/llama.cpp/convert_hf_to_gguf.py") if "pip-" not in c]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


def make_hf(ckpt: Path, work: Path) -> Path:
    """Meta checkpoint -> ``work/hf`` (this library's converter), laid out as Meta's Llama 3 HF
    repositories are, so that both transformers and llama.cpp's converter read it."""
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "llama.convert", "meta_to_hf", str(ckpt), str(hf)], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    # Meta's Llama 3 HF repositories keep tokenizer.model in original/ (llama.cpp's converter would
    # read a top-level one as SentencePiece) and ship tokenizer.json.
    if (hf / "tokenizer.model").is_file():
        (hf / "original").mkdir(exist_ok=True)
        (hf / "tokenizer.model").rename(hf / "original" / "tokenizer.model")
    write_hf_tokenizer(ckpt / "tokenizer.model", hf)
    return hf


def make_gguf(ckpt: Path, work: Path, precision: str, converter: Path) -> Path:
    """Meta checkpoint -> HF (this library's converter) -> GGUF (llama.cpp's converter) at
    ``precision`` (float32, bfloat16, float16, int8 = Q8_0; int4 = Q4_0, quantised from F32)."""
    out = work / f"model-{precision}.gguf"
    if out.is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    if precision == "int4":
        quantize_gguf_q4_0(make_gguf(ckpt, work, "float32", converter), partial)
    else:
        hf = make_hf(ckpt, work)
        subprocess.run([sys.executable, str(converter), str(hf), "--outfile", str(partial),
                        "--outtype", CONVERTER_OUTTYPES[precision]], check=True)
    partial.rename(out)
    return out


def quantize_gguf_q4_0(src: Path, out: Path) -> None:
    """llama.cpp's own quantiser (``llama-quantize --pure SRC OUT Q4_0``, through llama-cpp-python):
    every 2-D weight in Q4_0, blocks of 32 weights with one scale."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.pure = True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {out} (Q4_0) failed")


def write_hf_tokenizer(tiktoken_file: Path, hf_dir: Path) -> None:
    """tokenizer.json etc. for llama.cpp's converter, made from the tiktoken file with transformers'
    converter (what Meta's Llama 3 HF repositories ship), where meta_to_hf did not write them."""
    if (hf_dir / "tokenizer.json").is_file():
        return
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from llama.tokenizer import LLAMA3_SPLIT_PATTERN, llama3_special_tokens, load_tokenizer

    specials = llama3_special_tokens()
    backend = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=LLAMA3_SPLIT_PATTERN,
                                additional_special_tokens=specials).converted()
    # BOS before every text, as in Meta's tokenizer.json (both servers then start prompts with it)
    bos = "<|begin_of_text|>"
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, load_tokenizer(tiktoken_file).bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", model_input_names=["input_ids", "attention_mask"])
    tok.chat_template = LLAMA3_CHAT_TEMPLATE
    tok.save_pretrained(hf_dir)


# Llama 3's chat template in Jinja, so llama.cpp renders chats the way this library does.
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def gguf_decode_weight_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors that one decode step reads: all but the token embedding
    table (one row of it), unless the output layer is tied to it."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors
               if t.name != "rope_freqs.weight" and (tied or t.name != "token_embd.weight"))


# -- prompts ----------------------------------------------------------------------------------------

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under a pale moon and every river bends toward the distant sea carrying stories of old").split()
