"""LoRA adapters merged: ``Llama.build(..., lora=path)`` and ``python -m llama.convert merge_lora``
against PEFT + transformers, an independent implementation.

Tiny random Llama 3 and Llama 2 models are made and saved by transformers, converted to
Meta's format by ``llama.convert``; random adapters for them are made and saved by PEFT
(:mod:`lora_helpers`), and PEFT's own model (``PeftModel.from_pretrained``, unmerged) gives the
reference logits and greedy tokens.  Every test here builds models (seconds on two shared
cores): all are ``slow``; the quick checks of reading and splitting are in test_lora_load.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import helpers
import lora_helpers as L
from llama import Llama

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

SEQ = 24
# (family, r, alpha, target modules, rsLoRA): rank 8 and 16, all seven layers and subsets.
CASES = {
    "llama3-r8-all": ("llama3", 8, 16, L.ALL_TARGETS, False),
    "llama3-r16-subset-rslora": ("llama3", 16, 8, ("q_proj", "k_proj", "down_proj"), True),
    "llama2-r8-all": ("llama2", 8, 16, L.ALL_TARGETS, False),
    "llama2-r16-subset-rslora": ("llama2", 16, 32, ("k_proj", "o_proj", "up_proj"), True),
}
WORKER = Path(__file__).parent / "lora_mp_worker.py"


@pytest.fixture(scope="module")
def bases(tmp_path_factory, sp_tokenizer_path, tiny_tiktoken_path):
    """family -> (HF folder, the transformers model, its Meta conversion)."""
    out = {}
    for family, tokenizer, seed in (("llama3", tiny_tiktoken_path, 31), ("llama2", sp_tokenizer_path, 32)):
        hf, model = L.tiny_hf_llama(tmp_path_factory.mktemp(f"hf_{family}"), family, seed=seed,
                                    tokenizer_path=tokenizer)
        out[family] = (hf, model, L.meta_conversion(hf, tmp_path_factory.mktemp(f"meta_{family}")))
    return out


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory):
    """case -> adapter folder (PEFT's files)."""
    out = {}
    for i, (case, (family, r, alpha, targets, rslora)) in enumerate(CASES.items()):
        out[case] = L.make_peft_adapter(bases[family][1], tmp_path_factory.mktemp(case), r=r, alpha=alpha,
                                        target_modules=targets, use_rslora=rslora, seed=40 + i)
    return out


def build(ckpt: Path, **kw) -> Llama:
    return Llama.build(ckpt, max_seq_len=64, max_batch_size=3, device="cpu", dtype="float32", **kw)


def tokens_for(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def check_parity(bases, adapters, case: str) -> None:
    family = CASES[case][0]
    _, hf_model, meta = bases[family]
    llama = build(meta, lora=adapters[case])
    tokens = tokens_for(hf_model.config.vocab_size)
    ours = llama.model.forward(tokens, 0)
    theirs = L.reference_logits(L.peft_model(hf_model, adapters[case]), tokens)
    base = L.reference_logits(hf_model, tokens)
    assert helpers.rel_err(base, theirs) > 0.05  # the adapter changes the logits far beyond the tolerance
    assert helpers.rel_err(ours, theirs) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_build_with_lora_gives_pefts_logits(bases, adapters, case):
    check_parity(bases, adapters, case)


@pytest.mark.parametrize("case", ["llama3-r16-subset-rslora", "llama2-r8-all"])
def test_build_with_lora_gives_pefts_greedy_tokens(bases, adapters, case):
    family = CASES[case][0]
    _, hf_model, meta = bases[family]
    llama = build(meta, lora=adapters[case])
    reference = L.peft_model(hf_model, adapters[case])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf_model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 7)]
    ours, _ = llama.generate(prompts, max_gen_len=12, temperature=0)
    stops = llama.tokenizer.stop_tokens
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        for i, t in enumerate(expected):
            if t in stops:
                expected = expected[:i]
                break
        assert got == expected
    assert sum(len(x) for x in ours) > 12  # the comparison covered real decoding


def test_merge_lora_checkpoint_in_two_shards_equals_build_time_merge(bases, adapters, tmp_path):
    from llama.checkpoint.shards import find_shards
    from llama.convert import merge_lora

    meta = bases["llama3"][2]
    out = tmp_path / "merged"
    merge_lora(meta, adapters["llama3-r16-subset-rslora"], out, model_parallel_size=2)
    assert [p.name for p in find_shards(out)] == ["consolidated.00.pth", "consolidated.01.pth"]
    assert (out / "params.json").read_text() == (meta / "params.json").read_text()
    assert (out / "tokenizer.model").read_bytes() == (meta / "tokenizer.model").read_bytes()
    tokens = tokens_for(bases["llama3"][1].config.vocab_size, seed=1)
    merged = build(out).model.forward(tokens, 0)
    at_load = build(meta, lora=adapters["llama3-r16-subset-rslora"]).model.forward(tokens, 0)
    base = build(meta).model.forward(tokens, 0)
    assert helpers.rel_err(base, at_load) > 0.05
    assert helpers.rel_err(merged, at_load) < 1e-6


def test_merge_lora_command_line(bases, adapters, tmp_path, root_logger_kept):
    from llama.checkpoint.shards import find_shards
    from llama.convert.cli import main

    meta, out = bases["llama2"][2], tmp_path / "merged"
    assert main(["merge_lora", str(meta), str(adapters["llama2-r8-all"]), str(out)]) == 0
    assert len(find_shards(out)) == 1  # the base's shard count
    tokens = tokens_for(bases["llama2"][1].config.vocab_size, seed=2)
    theirs = L.reference_logits(L.peft_model(bases["llama2"][1], adapters["llama2-r8-all"]), tokens)
    assert helpers.rel_err(build(out).model.forward(tokens, 0), theirs) < 1e-4


def test_merge_lora_refuses_a_bad_adapter_and_writes_nothing(bases, tmp_path, root_logger_kept, capsys):
    from llama.convert.cli import main

    meta, out = bases["llama3"][2], tmp_path / "merged"
    with pytest.raises(SystemExit) as e:
        main(["merge_lora", str(meta), str(tmp_path / "no-adapter"), str(out)])
    assert e.value.code == 1
    assert "no-adapter" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_quantised_base_quantises_the_merged_weights(bases, adapters, tmp_path):
    """int8 with lora= equals int8 of the merged checkpoint: the adapter is merged before the
    weights are quantised (after, it could not be: int8 weights have no room for it)."""
    from llama.convert import merge_lora

    meta, case = bases["llama3"][2], "llama3-r8-all"
    merge_lora(meta, adapters[case], tmp_path / "merged")
    tokens = tokens_for(bases["llama3"][1].config.vocab_size, seed=3)
    at_load = build(meta, lora=adapters[case], quantize="int8").model.forward(tokens, 0)
    merged = build(tmp_path / "merged", quantize="int8").model.forward(tokens, 0)
    assert torch.equal(at_load, merged)
    theirs = L.reference_logits(L.peft_model(bases["llama3"][1], adapters[case]), tokens)
    assert helpers.rel_err(at_load, theirs) < 2e-2  # int8's rounding, not the adapter's change (> 0.05)


def test_merge_into_a_loaded_model_equals_build_time_merge(bases, adapters):
    from llama.lora.adapter import read_adapter
    from llama.lora.merge import merge_lora_

    meta, case = bases["llama2"][2], "llama2-r16-subset-rslora"
    llama = build(meta)
    adapter = read_adapter(adapters[case], llama.model.params)
    assert merge_lora_(llama.model, adapter, llama.model.params) == len(adapter.factors)
    tokens = tokens_for(bases["llama2"][1].config.vocab_size, seed=4)
    at_load = build(meta, lora=adapters[case]).model.forward(tokens, 0)
    assert helpers.rel_err(llama.model.forward(tokens, 0), at_load) < 1e-6


@pytest.mark.multiprocess
def test_two_ranks_on_gloo_equal_one(bases, adapters, tmp_path):
    meta, case = bases["llama3"][2], "llama3-r16-subset-rslora"
    tokens = tokens_for(bases["llama3"][1].config.vocab_size, seed=6)
    torch.save(tokens, tmp_path / "tokens.pt")
    proc = helpers.torchrun(WORKER, [str(meta), str(adapters[case]), str(tmp_path)], nproc=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = torch.load(tmp_path / "logits.pt")
    one = build(meta, lora=adapters[case]).model.forward(tokens, 0)
    assert helpers.rel_err(two, one) < 1e-5
    theirs = L.reference_logits(L.peft_model(bases["llama3"][1], adapters[case]), tokens)
    assert helpers.rel_err(two, theirs) < 1e-4


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tiny_tiktoken_path):
    """(HF folder, transformers model, adapter folder): a tiny Llama 4 text model and a PEFT adapter
    of its linear layers and its routed experts (target_parameters)."""
    hf, model = L.tiny_hf_llama4(tmp_path_factory.mktemp("hf4"), tiny_tiktoken_path, seed=51)
    adapter = L.make_peft_adapter(model, tmp_path_factory.mktemp("adapter4"), r=8, alpha=16, seed=52,
                                  target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                                  target_parameters=["feed_forward.experts.gate_up_proj",
                                                     "feed_forward.experts.down_proj"])
    return hf, model, adapter


def test_llama4_build_with_lora_gives_pefts_logits(llama4):
    """The Hugging Face folder loaded directly, the adapter (experts included) merged while
    loading, against PEFT's unmerged model."""
    hf, model, adapter = llama4
    tokens = tokens_for(model.config.vocab_size, seed=7)
    ours = build(hf, lora=adapter).model.forward(tokens, 0)
    theirs = L.reference_logits(L.peft_model(model, adapter), tokens)
    assert helpers.rel_err(L.reference_logits(model, tokens), theirs) > 0.05
    assert helpers.rel_err(ours, theirs) < 1e-4


def test_llama4_merge_lora_in_two_shards(llama4, tmp_path):
    """merge_lora splits the experts' merged stacks over two shards as the loader reads them."""
    from llama.convert import merge_lora

    hf, model, adapter = llama4
    meta = L.meta_conversion(hf, tmp_path / "meta")
    merge_lora(meta, adapter, tmp_path / "merged", model_parallel_size=2)
    tokens = tokens_for(model.config.vocab_size, seed=8)
    merged = build(tmp_path / "merged").model.forward(tokens, 0)
    theirs = L.reference_logits(L.peft_model(model, adapter), tokens)
    assert helpers.rel_err(merged, theirs) < 1e-4


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
