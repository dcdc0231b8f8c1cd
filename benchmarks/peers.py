"""The same random weights for this library, Hugging Face transformers and llama.cpp, and one
engine's measurement in a fresh process: the pieces of ``benchmarks/bench.py peers`` (and the
checkpoint and GGUF files of ``benchmarks/bench_serve.py``).

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

One measurement (``python benchmarks/peers.py worker SPEC_JSON``, started by bench.py): load one
engine at one precision and thread count, warm it up, time three completions, print one JSON line
(``bench.py peers_batch``: time the decoding steps of one row and of several decoded together).
This module imports nothing heavy at the top, so llama.cpp's process never loads torch.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# w8a8: this library's int8 weights with int8 activations in decoding steps (quantize="w8a8"),
# against the same Q8_0 file as int8 (llama.cpp quantises activations for Q8_0 products too).
PRECISIONS = ("float32", "bfloat16", "int8", "w8a8", "int4")
# "llama-compiled": this library with compile=True (its warm-up completion compiles the step).
ENGINES = ("llama", "llama-compiled", "transformers", "llama.cpp")
DEFAULT_ENGINES = ("llama", "transformers", "llama.cpp")
OURS = ("llama", "llama-compiled")
# llama.cpp's name for each precision, and the converter's --outtype (int4: quantised afterwards)
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int8": "Q8_0", "w8a8": "Q8_0", "int4": "Q4_0"}
CONVERTER_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}
RESULT_PREFIX = "RESULT "


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

    from common import CONFIGS, LLAMA3_VOCAB, llama3_tokenizer, random_weights
    from llama import ModelArgs
    from llama.runtime import devices

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = llama3_tokenizer()
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB)
    model, state = random_weights(args, devices.resolve_dtype(dtype, torch.device("cpu")))
    names = {n for n, _ in model.named_parameters()}
    state = {n: t for n, t in state.items() if n in names}
    if silent_specials:
        state["output.weight"][min(tokenizer.special_tokens.values()):] = 0
    (out / "params.json").write_text(json.dumps({**CONFIGS[config], "vocab_size": LLAMA3_VOCAB}))
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
    if precision == "w8a8":
        return make_gguf(ckpt, work, "int8", converter)
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


# -- prompts ---------------------------------------------------------------------------------------

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under a pale moon and every river bends toward the distant sea carrying stories of old").split()


def make_prompt(tokenizer, number: int, n_tokens: int) -> str:
    """A text of exactly ``n_tokens`` tokens, BOS included, starting with ``number`` (100-999, one
    token): prompts of different numbers share no prefix beyond BOS, so no engine reuses a previous
    call's cache for them."""
    if not 100 <= number <= 999:
        raise ValueError(f"number must be in [100, 999], got {number}")
    words = [f"{number}."]
    for word in itertools.cycle(WORDS):
        n = len(tokenizer.encode(" ".join(words), bos=True, eos=False))
        if n == n_tokens:
            return " ".join(words)
        if n > n_tokens:
            raise ValueError(f"cannot make a prompt of {n_tokens} tokens (the shortest has {n})")
        words.append(word)
    raise AssertionError("unreachable")


# Each role of a measurement gets its own prompt (its own number), the same in every engine.
PROMPT_ROLES = {"warm": 101, "long": 102, "short": 103, "agree": 104, "warm_prefill": 201, "prefill": 202}


def make_prompts(tokenizer, prompt_tokens: int, prefill_tokens: int) -> dict[str, str]:
    return {role: make_prompt(tokenizer, number, prefill_tokens if "prefill" in role else prompt_tokens)
            for role, number in PROMPT_ROLES.items()}


# -- one engine in this process --------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Ours:
    """This library as its README shows it: ``Llama.build`` then ``text_completion``."""

    def __init__(self, spec: dict) -> None:
        import torch

        from llama import Llama

        torch.set_num_threads(spec["threads"])
        precision = spec["precision"]
        quantize = precision if precision in ("int8", "w8a8", "int4") else None
        ckpt = Path(spec["ckpt"])
        self.llama = Llama.build(
            ckpt_dir=ckpt, tokenizer_path=ckpt / "tokenizer.model", max_seq_len=spec["max_seq_len"],
            max_batch_size=spec.get("batch", 1), device="cpu", dtype=spec["quant_dtype"] if quantize else precision,
            quantize=quantize, quantize_group_size=spec["int4_group_size"] if quantize == "int4" else None,
            compile=spec["engine"] == "llama-compiled")
        self.threads = torch.get_num_threads()

    def complete(self, prompt: str, n: int) -> tuple[float, int, int]:
        """(seconds, new tokens, prompt tokens) of one greedy completion of up to ``n`` tokens."""
        before = self.llama.engine.stats()
        start = time.perf_counter()
        self.llama.text_completion([prompt], temperature=0.0, max_gen_len=n)
        seconds = time.perf_counter() - start
        after = self.llama.engine.stats()
        return (seconds, after["tokens_generated_total"] - before["tokens_generated_total"],
                after["prompt_tokens_total"] - before["prompt_tokens_total"])

    def greedy_ids(self, prompt: str, n: int) -> tuple[list[int], list[int]]:
        tokens = self.llama.tokenizer.encode(prompt, bos=True, eos=False)
        out, _ = self.llama.generate([tokens], max_gen_len=n, temperature=0.0)
        return tokens, out[0]

    def weight_bytes(self) -> int:
        from common import decode_weight_bytes

        return decode_weight_bytes(self.llama.model)

    def decode_rows(self, prompts: list[str], n: int) -> float:
        """Seconds per decoding step of the rows of ``prompts`` decoded together (``generate``,
        greedy), past each row's first token: ``n`` steps, as ``rate_past_first_token`` times them."""
        from common import rate_past_first_token

        ids = [self.llama.tokenizer.encode(p, bos=True, eos=False) for p in prompts]

        def run(k: int) -> float:
            start = time.perf_counter()
            self.llama.generate(ids, max_gen_len=k, temperature=0.0)
            return time.perf_counter() - start

        return len(ids) / rate_past_first_token(run, n, rows=len(ids))


class Transformers:
    """``AutoModelForCausalLM.from_pretrained`` at the same dtype, greedy ``generate``."""

    def __init__(self, spec: dict) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(spec["threads"])
        self.tokenizer = AutoTokenizer.from_pretrained(spec["hf"])
        self.model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=getattr(torch, spec["precision"])).eval()
        self.threads = torch.get_num_threads()

    def _generate(self, inputs, n: int):
        # temperature/top_p None: the checkpoint's generation_config.json asks for sampling
        return self.model.generate(**inputs, max_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                                   pad_token_id=self.tokenizer.eos_token_id)

    def complete(self, prompt: str, n: int) -> tuple[float, int, int]:
        start = time.perf_counter()
        inputs = self.tokenizer(prompt, return_tensors="pt")
        out = self._generate(inputs, n)
        prompt_len = inputs["input_ids"].shape[1]
        self.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)
        return time.perf_counter() - start, out.shape[1] - prompt_len, prompt_len

    def greedy_ids(self, prompt: str, n: int) -> tuple[list[int], list[int]]:
        inputs = self.tokenizer(prompt, return_tensors="pt")
        out = self._generate(inputs, n)
        prompt_len = inputs["input_ids"].shape[1]
        return inputs["input_ids"][0].tolist(), out[0, prompt_len:].tolist()

    def weight_bytes(self) -> int:
        from common import decode_weight_bytes

        return decode_weight_bytes(self.model)


class LlamaCpp:
    """llama-cpp-python's ``Llama`` with its defaults, ``create_completion`` at temperature 0."""

    def __init__(self, spec: dict) -> None:
        import llama_cpp

        self.path = Path(spec["gguf"])
        self.threads, self.max_seq_len = spec["threads"], spec["max_seq_len"]
        self._batch_contexts: dict = {}  # rows -> (context, batch) of decode_rows
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=spec["max_seq_len"], n_threads=spec["threads"],
                                   n_threads_batch=spec["threads"], verbose=False)

    def complete(self, prompt: str, n: int) -> tuple[float, int, int]:
        start = time.perf_counter()
        out = self.llm.create_completion(prompt, max_tokens=n, temperature=0.0, repeat_penalty=1.0)
        seconds = time.perf_counter() - start
        return seconds, out["usage"]["completion_tokens"], out["usage"]["prompt_tokens"]

    def greedy_ids(self, prompt: str, n: int) -> tuple[list[int], list[int]]:
        tokens = self.llm.tokenize(prompt.encode(), add_bos=True, special=False)
        self.llm.reset()
        out = list(itertools.islice(self.llm.generate(tokens, temp=0.0, repeat_penalty=1.0), n))
        return tokens, out

    def weight_bytes(self) -> int:
        return gguf_decode_weight_bytes(self.path)

    def decode_rows(self, prompts: list[str], n: int) -> float:
        """Seconds per decoding step of the rows of ``prompts`` decoded together through llama.cpp's
        own batch API, as llama-server decodes its slots: a context of one sequence a row
        (``n_seq_max``), each prompt prefilled as its sequence, then ``n`` timed steps of one
        ``llama_decode`` each, a token a row, each row's next token the argmax of its logits."""
        import llama_cpp
        import numpy as np

        rows = len(prompts)
        ctx, batch = self._batch_contexts.get(rows) or self._batch_context(rows)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.llm.model))

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits?)
            batch.n_tokens = len(entries)
            for i, (token, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed ({rows} rows)")

        def greedy(i: int) -> int:
            return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        tokens = [self.llm.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]
        last = []
        for seq, ids in enumerate(tokens):
            decode([(t, pos, seq, pos == len(ids) - 1) for pos, t in enumerate(ids)])
            last.append(greedy(len(ids) - 1))
        start = time.perf_counter()
        for step in range(n):
            decode([(last[r], len(tokens[r]) + step, r, True) for r in range(rows)])
            last = [greedy(r) for r in range(rows)]
        return (time.perf_counter() - start) / n

    def _batch_context(self, rows: int):
        """A llama.cpp context (and batch) of ``rows`` sequences, each of the spec's context length."""
        import llama_cpp

        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = self.max_seq_len * rows, rows
        params.n_batch = params.n_ubatch = max(512, self.max_seq_len)
        params.n_threads = params.n_threads_batch = self.threads
        ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {rows} sequences")
        self._batch_contexts[rows] = ctx, llama_cpp.llama_batch_init(params.n_batch, 0, rows)
        return self._batch_contexts[rows]


ENGINE_CLASSES = {"llama": Ours, "llama-compiled": Ours, "transformers": Transformers, "llama.cpp": LlamaCpp}


def _import_engine_modules(engine: str) -> None:
    """Import what the engine needs before the memory baseline (imports are not the model)."""
    if engine == "llama.cpp":
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    else:
        import torch  # noqa: F401

        import common  # noqa: F401
        from llama import Llama  # noqa: F401
        if engine == "transformers":
            import transformers  # noqa: F401


def measure(spec: dict) -> dict:
    """One engine, one precision, one thread count.  mode "agree": the first ``check_tokens``
    greedy token ids of the "agree" prompt.  mode "time": a warm-up completion of each prompt
    length, then (timed) ``new_tokens + 1`` new tokens, 1 new token (a prompt of the same length)
    and 1 new token after the long prompt; then the "agree" ids."""
    if spec["mode"] == "bandwidth":
        import torch

        import common

        torch.set_num_threads(spec["threads"])
        return {"bandwidth": common.measure_bandwidth(spec["threads"], mib=spec.get("mib", 1024))}
    _import_engine_modules(spec["engine"])
    base = rss()
    start = time.perf_counter()
    engine = ENGINE_CLASSES[spec["engine"]](spec)
    result: dict = {"load_s": time.perf_counter() - start, "threads": engine.threads}
    if engine.threads != spec["threads"]:
        raise RuntimeError(f"{spec['engine']} runs {engine.threads} threads, not {spec['threads']}")
    prompts, n = spec["prompts"], spec["new_tokens"]
    if spec["mode"] == "batch":  # 1 row and spec["batch"] rows, interleaved, spec["reps"] times each
        rows = [1, spec["batch"]]
        for r in rows:
            engine.decode_rows(prompts["rows"][:r], 2)  # warm-up (a compiled engine compiles here)
        step_s: dict[str, list[float]] = {str(r): [] for r in rows}
        for _ in range(spec["reps"]):
            for r in rows:
                step_s[str(r)].append(engine.decode_rows(prompts["rows"][:r], n))
        result["step_s"] = step_s
        return result
    if spec["mode"] == "time":
        engine.complete(prompts["warm"], n + 1)
        engine.complete(prompts["warm_prefill"], 1)
        result["model_bytes"] = rss() - base
        runs = {"long": (prompts["long"], n + 1), "short": (prompts["short"], 1), "prefill": (prompts["prefill"], 1)}
        for name, (prompt, want) in runs.items():
            seconds, got, prompt_tokens = engine.complete(prompt, want)
            if got != want:
                raise RuntimeError(f"{spec['engine']} generated {got} tokens, not {want} ({name} run): the "
                                   "timings would not compare")
            result[f"{name}_s"], result[f"{name}_prompt_tokens"] = seconds, prompt_tokens
        result["weight_bytes"] = engine.weight_bytes()
    result["agree_prompt"], result["agree_ids"] = engine.greedy_ids(prompts["agree"], spec["check_tokens"])
    return result


def run_worker(spec: dict, timeout: float = 7200) -> dict:
    """``measure(spec)`` in a fresh Python process, with the thread count in its environment too."""
    threads = str(spec["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "CUDA_VISIBLE_DEVICES": "",
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("LLAMA_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(spec)], env=env,
                          cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        what = spec.get("engine", spec["mode"])
        raise RuntimeError(f"{what} ({spec.get('precision', '')}, {threads} threads) failed with exit code "
                           f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        raise SystemExit("usage: python benchmarks/peers.py worker SPEC_JSON (started by benchmarks/bench.py peers)")
    print(RESULT_PREFIX + json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
