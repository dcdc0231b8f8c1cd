"""What structured output costs (llama.structured), on Meta's real Llama 3 tokenizer (128,256 ids).

    python benchmarks/bench_grammar.py masks                  # 2 torch threads, masks on 1 and 2 threads
    python benchmarks/bench_grammar.py masks --steps 500 --mask_threads 1,2,4
    python benchmarks/bench_grammar.py decode                 # whole steps of the 150m model, bf16, 1 and 8 rows

Prints, in microseconds (median [min-max] unless said):

* the grammar tokenizer's build (``GrammarTokenizer``: once per tokenizer);
* compiling a response format (``compile_response_format``: check, build, first mask), for a
  typical schema (an object of 8 fields: nested object, enum, booleans, bounded array, nullable
  string, pattern, integer range) and for json_object, a regex and a Lark grammar; and starting a
  matcher from a compiled grammar (``Grammar.matcher``: a copy);
* compiling the grammar of ``tool_choice`` "required" for a typical set of three functions
  (``tool_call_grammar``), in each tool prompt format;
* the mask of one decoding step, for 1 and 8 constrained rows, each row a matcher walking the
  typical schema (uniform random choice among the allowed ids; a finished one starts again):
  ``fill`` = llguidance computing the bitmask (with the per-request end-id fix-up), ``apply`` =
  fill plus applying it to ``(rows, 128256)`` logits (float32 and bfloat16) in place, for
  contiguous rows and for rows scattered among 16 (index_select/index_copy_); then, on a
  bitmask already computed, the integer operations that apply it (``mask_logits_``) against
  the ``masked_fill_`` they replaced.

Timings alternate between the settings step by step, in an order that rotates.  Each setting walks matchers of its own
of its own compiled grammar along the same tokens, so that every mask it times is the first
computed in that state (llguidance keeps work done on a state, and its copies share it: a
second mask of the same state is cheaper).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import fire
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama.structured import GrammarMasker, GrammarTokenizer, compile_response_format, tool_call_grammar  # noqa: E402
from llama.structured.matcher import GrammarMatcher, mask_logits_  # noqa: E402
from llama.tokenizer import load_tokenizer  # noqa: E402

# A typical structured reply: what a client's pydantic model gives (closed objects).
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["person", "company", "place"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "kind", "active", "address", "tags", "note", "score", "verified"],
    "additionalProperties": False,
}
OTHER_FORMATS = {
    "json_object": {"type": "json_object"},
    "regex (e-mail)": {"type": "regex", "regex": r"[a-z]{1,16}@[a-z]{1,16}\.(com|org|net)"},
    "Lark (arithmetic)": {"type": "grammar", "grammar": 'start: expr\nexpr: term (("+" | "-") term)*\n'
                                                      'term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'},
}


def _function(name: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


# A typical tool set: functions whose arguments are strings, enums, numbers, booleans and a list.
TOOLS = [
    _function("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                              "days": {"type": "integer", "minimum": 1, "maximum": 14}}, ["city"]),
    _function("search_flights", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                 "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                 "date": {"type": "string", "format": "date"},
                                 "passengers": {"type": "integer", "minimum": 1}}, ["origin", "destination"]),
    _function("set_reminder", {"text": {"type": "string", "maxLength": 200}, "minutes": {"type": "number"},
                               "tags": {"type": "array", "items": {"type": "string"}}, "urgent": {"type": "boolean"}},
              ["text", "minutes"]),
]


def llama3_tokenizer_path() -> Path:
    import llama_models  # test-only dependency: ships Meta's tokenizer.model

    return Path(llama_models.__file__).parent / "llama3" / "tokenizer.model"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    return f"{statistics.median(us):9.1f} [{us[0]:.1f}-{us[-1]:.1f}]"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(steps: int = 300, threads: int = 2, mask_threads: str = "1,2", rounds: int = 5) -> None:
    torch.set_num_threads(threads)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {threads} threads; "
          f"llguidance {__import__('llguidance').__version__}")
    tok = load_tokenizer(llama3_tokenizer_path())

    builds = [timed(lambda: GrammarTokenizer(tok)) for _ in range(rounds)]
    gt = GrammarTokenizer(tok)
    print(f"\nGrammarTokenizer(Llama 3, {gt.n_words} ids), {rounds} builds:     {summary(builds)} us")

    print(f"\ncompile_response_format, {rounds * 4} compiles each (us):")
    typical = {"type": "json_schema", "json_schema": {"name": "entity", "schema": TYPICAL_SCHEMA, "strict": True}}
    for name, rf in {"typical schema (8 fields)": typical, **OTHER_FORMATS}.items():
        print(f"  {name:28s}{summary([timed(lambda: compile_response_format(rf, gt)) for _ in range(rounds * 4)])}")
    print(f"\ntool_call_grammar, tool_choice 'required', 3 functions of 3-4 arguments, {rounds * 4} compiles "
          "each (us):")
    for tool_prompt_format in ("json", "function_tag", "python_list"):
        times = [timed(lambda: tool_call_grammar(TOOLS, "required", gt, tool_prompt_format)) for _ in range(rounds * 4)]
        print(f"  {tool_prompt_format:28s}{summary(times)}")
    grammar = compile_response_format(typical, gt)
    print(f"  {'Grammar.matcher() (a copy)':28s}{summary([timed(grammar.matcher) for _ in range(rounds * 20)])}")

    rng = random.Random(0)
    end_ids = {tok.eot_id}
    thread_counts = _ints(mask_threads)
    maskers = {t: GrammarMasker(gt, num_threads=t) for t in thread_counts}
    masker = maskers[max(thread_counts)]
    print(f"\nmask of one step, {steps} steps along random walks of the typical schema (us; apply: "
          f"{max(thread_counts)} mask thread(s)):")
    for n in (1, 8):
        lead = rng.randrange(1, 20)  # the walks out of step with each other
        x32 = torch.randn(n, gt.n_words)
        x16 = torch.randn(n, gt.n_words).to(torch.bfloat16)
        wide = torch.randn(16, gt.n_words, dtype=torch.bfloat16)
        scattered = list(range(1, 16, 2))[:n]
        settings: dict[str, Callable[[list[GrammarMatcher]], object]] = {
            **{f"fill, {t} mask thread(s)": maskers[t].fill for t in thread_counts},
            "apply float32, contiguous rows": lambda ms: masker.apply(x32, range(n), ms),
            "apply bfloat16, contiguous rows": lambda ms: masker.apply(x16, range(n), ms),
            "apply bfloat16, rows scattered in 16": lambda ms: masker.apply(wide, scattered, ms),
        }
        # Each setting walks matchers of its own grammar (llguidance keeps work done on a
        # state, shared by the copies of one compiled grammar), all along the same tokens,
        # chosen from a driver's masks.
        walks = {}
        for name in ["driver", *settings]:
            own = compile_response_format(typical, gt)
            walks[name] = [own.matcher(end_ids) for _ in range(n)]
        times: dict[str, list[float]] = {name: [] for name in settings}
        times["  bit operations alone (mask_logits_), bfloat16"] = []
        times["  unpack + masked_fill_ alone, bfloat16"] = []
        for step in range(lead + steps):
            if step >= lead:
                order = list(settings)
                order = order[step % len(order):] + order[: step % len(order)]  # no setting always first
                for name in order:
                    times[name].append(timed(lambda: settings[name](walks[name])))
            bits = masker.fill(walks["driver"])
            if step >= lead:
                times["  bit operations alone (mask_logits_), bfloat16"].append(timed(lambda: mask_logits_(x16, bits)))
                times["  unpack + masked_fill_ alone, bfloat16"].append(
                    timed(lambda: x16.masked_fill_(_unpacked(bits, gt.n_words) == 0, float("-inf"))))
            allowed = _unpacked(bits, gt.n_words)
            for i in range(n):
                token = rng.choice(allowed[i].nonzero().flatten().tolist())
                for ms in walks.values():
                    ms[i].consume(token)
                    if ms[i].is_ended:
                        ms[i].reset()
        print(f"  {n} row{'s' if n > 1 else ''}:")
        for name, ts in times.items():
            print(f"    {name:50s}{summary(ts)}")


def _ints(value: object) -> list[int]:
    """fire gives "1,2" as a tuple, "2" as an int."""
    if isinstance(value, (tuple, list)):
        return [int(v) for v in value]
    return [int(v) for v in str(value).split(",")]


def _unpacked(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :width]


def decode(config: str = "150m", dtype: str = "bfloat16", threads: int = 2, rows: str = "1,8", tokens: int = 64,
           rounds: int = 3) -> None:
    """The whole decoding step, constrained against free: ``rows`` requests decoded together,
    ``tokens`` tokens each at temperature 1, on a random-weight ``config`` model (Llama 3's
    128k vocabulary; benchmarks/bench.py builds it).  The constrained requests follow a list of
    objects of the typical schema (which a random model does not finish before ``tokens``).
    Prints the median and range, over ``rounds`` interleaved runs, of the time per step, for
    free rows, constrained rows whose masks are computed after the model has run, and
    constrained rows as the engine runs them (masks computed while the model runs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dataclasses import replace

    from bench import build_ours
    from common import set_threads
    from llama.engine import RequestSettings

    set_threads(threads)
    row_counts = _ints(rows)
    llama = build_ours(config, getattr(torch, dtype), max_seq_len=tokens + 16, max_batch_size=max(row_counts))
    engine, tokenizer = llama.engine, llama.tokenizer
    schema = {"type": "array", "items": TYPICAL_SCHEMA, "minItems": 20}  # no end within `tokens`
    grammar = llama.structured.response_format({"type": "json_schema",
                                                "json_schema": {"name": "list", "schema": schema}})
    prompt = tokenizer.encode("Entities:", bos=True, eos=False)
    base = RequestSettings(max_new_tokens=tokens, temperature=1.0, top_p=1.0, stop_tokens=frozenset({tokenizer.eot_id}))

    start_masks = engine.sampler.start_masks
    modes = {  # name: (grammar, whether masks are computed while the model runs)
        "free": (None, True),
        "constrained, masks after the model": (grammar, False),
        "constrained": (grammar, True),
    }

    def run(n: int, mode: str, seed: int) -> tuple[float, int]:
        grammar_, early = modes[mode]
        engine.sampler.start_masks = start_masks if early else (lambda requests, proposals=None: None)
        settings = replace(base, grammar=grammar_)
        start = time.perf_counter()
        handles = [engine.submit(prompt, replace(settings, seed=seed + i)) for i in range(n)]
        steps = max(len(h.result().tokens) for h in handles)
        return time.perf_counter() - start, steps

    for mode in modes:  # warm up every path
        run(max(row_counts), mode, 0)
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, {threads} threads; {config} {dtype}, "
          f"{tokens} tokens a request, {rounds} rounds (us per step: median [min-max]; ratio to free, of medians)")
    names = list(modes)
    for n in row_counts:
        per_step: dict[str, list[float]] = {mode: [] for mode in modes}
        for r in range(rounds):
            for mode in names[r % len(names):] + names[:r % len(names)]:  # the order rotates
                seconds, steps = run(n, mode, 1000 * r)
                if steps < tokens:
                    print(f"  (a run of {n} row(s) ended after {steps} steps)")
                per_step[mode].append(seconds / steps)
        free = statistics.median(per_step["free"])
        print(f"  {n} row(s):")
        for mode, times in per_step.items():
            print(f"    {mode:36s}{summary(times)}  {statistics.median(times) / free:.3f}")


if __name__ == "__main__":
    fire.Fire({"masks": main, "decode": decode})
