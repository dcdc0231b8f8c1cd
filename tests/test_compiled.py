"""The compiled decoding step (Llama.build(compile=True)) against eager steps: float32 under
either one-row policy, packed bfloat16 weights reached through the llama::packed_linear
operator, w8a8, the eager fallback, and Inductor's on-disk cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from helpers import build, rel_err
from llama.engine import RequestSettings
from llama.engine.runner import _compiled_graphs
from llama.engine.speculative import SpeculativeConfig
from llama.layers import packing
from llama.layers.cpu import CpuFeatures
from llama.layers.packed import PackedFusedProjections, PackedWeight
from llama.layers.policy import KernelPolicy
from test_packing import needs_fbgemm, packed_kind_is_this_cpus

pytestmark = [pytest.mark.slow, pytest.mark.compile]


def _one_layer_checkpoint(root: Path, tokenizer: Path, base: dict, seed: int, layout: str,
                          padding: int = 0) -> helpers.Checkpoint:
    """A checkpoint of ``base``'s shape (conftest.py's Llama 2 or Llama 3 one) with one layer, the
    vocabulary ``tokenizer``'s: compiling takes longer the more layers a step has, and none of
    these tests is about depth (a step cut per layer would show in one layer as a cut at its
    collectives: test_compiled_step_is_one_graph_on_two_ranks counts the graphs).  ``padding``: ids
    the model has past the tokenizer's (as checkpoints with a padded vocabulary do)."""
    from llama.tokenizer import load_tokenizer

    vocab = load_tokenizer(tokenizer).n_words + padding
    params = {**base, "n_layers": 1, "vocab_size": vocab}
    weights = helpers.random_weights(params, vocab, seed=seed)
    return helpers.Checkpoint(helpers.write_checkpoint(root, params, weights, 1, layout), tokenizer, params, weights)


@pytest.fixture(scope="module")
def llama2_one_layer(tmp_path_factory, sp_tokenizer_path):
    """The llama2_checkpoint's shape (MHA, theta 1e4), one layer."""
    from conftest import LLAMA2_PARAMS

    return _one_layer_checkpoint(tmp_path_factory.mktemp("llama2-1"), sp_tokenizer_path, LLAMA2_PARAMS, 2, "dim")


@pytest.fixture(scope="module")
def llama3_one_layer(tmp_path_factory, tiny_tiktoken_path):
    """The llama3_checkpoint's shape (GQA, scaled RoPE), one layer, 556 tokens.  Seed 6: its
    w8a8 model's ten greedy tokens after test_w8a8's prompt have no near-tie (the best two
    logits at least 0.09 apart, on an AVX-512 CPU), so that test compares every one."""
    from conftest import LLAMA3_PARAMS

    return _one_layer_checkpoint(tmp_path_factory.mktemp("llama3-1"), tiny_tiktoken_path, LLAMA3_PARAMS, 6, "vocab")


# The float32 engines' shapes: two context buckets (256, 320) and rows 1, 2, 3
FLOAT32_OPTIONS = dict(dtype="float32", max_seq_len=320, max_batch_size=3)


@pytest.mark.parametrize("device, reduction", [
    ("cpu", True), ("cpu", False), pytest.param("cuda", None, marks=pytest.mark.cuda)],
    ids=["multiply-and-sum", "mkl", "cuda"])
def test_compiled_decode_step_matches_eager(llama3_one_layer, device, reduction):
    """Compiled float32 steps write one-row products as multiply-and-sum where MKL's are
    slow (AVX2, AMD) and leave them to MKL elsewhere: both give the eager tokens.  On CUDA
    (the device's own policy) the compiled step runs as CUDA graphs, and gives them too."""
    torch._dynamo.reset()  # a step compiled under another policy must not be reused
    policy = None
    if device == "cpu":
        policy = dataclasses.replace(KernelPolicy.decide(torch.device("cpu"), torch.float32, compile=True),
                                     one_row_as_reduction=reduction, column_major=not reduction)
    # The shapes of test_compiled_verification_is_warmed_up_whole_...'s engine: under the policy
    # this CPU decides, its decoding step is this one's, which Inductor's disk cache then serves
    eager = build(llama3_one_layer, device=device, compile=False, **FLOAT32_OPTIONS)
    compiled = build(llama3_one_layer, device=device, compile=True, policy=policy, **FLOAT32_OPTIONS)
    assert compiled.compiled
    prompts = [[1, 5, 9, 11], [1, 2]]
    runner, contexts = compiled.engine.runner, []
    step = runner.decode_step

    def recording(tokens, positions, kv_len, *rest):
        contexts.append(kv_len)
        return step(tokens, positions, kv_len, *rest)

    runner.decode_step = recording
    graphs, threads = _compiled_graphs(), torch.get_num_threads()
    a, lp_a = eager.generate(prompts, max_gen_len=12, temperature=0, logprobs=True)
    # torch.compile's guards check the process's CPU threads, which an eager engine's steps choose
    # (and a user may set): the compiled steps set the count they were compiled with back first,
    # rather than compiling every shape again
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        b, lp_b = compiled.generate(prompts, max_gen_len=12, temperature=0, logprobs=True)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)
    assert _compiled_graphs() == graphs
    assert a == b
    for x, y in zip(lp_a, lp_b):
        assert x == pytest.approx(y, abs=1e-4)
    # contexts of at most 16 positions: on the CPU attention reads 64 of them (the context a dynamic
    # dimension of the one graph), on a GPU the first bucket's 256 (a CUDA graph a bucket)
    assert set(contexts) == ({64} if device == "cpu" else {256})


def test_compiled_cpu_step_summarises_its_logits_for_sampling(tiny_tiktoken_path, tmp_path):
    """The compiled CPU decoding step also gives each row's argmax below the decodable vocabulary
    and its sum (llama.engine.sampling.RowSummary), which the sampler reads instead of reducing
    the logits again after the step: they are those of the logits it gives, computed as torch
    computes them; a step that prefills gives none (its logits are not the compiled step's); and
    the greedy tokens are still those of an eager engine.  The model's vocabulary is padded past
    the tokenizer's, and the padding's random logits win some argmaxes of the whole row."""
    from conftest import LLAMA3_PARAMS

    padded = _one_layer_checkpoint(tmp_path, tiny_tiktoken_path, LLAMA3_PARAMS, 6, "vocab", padding=200)
    eager = build(padded, compile=False, **FLOAT32_OPTIONS)
    compiled = build(padded, compile=True, **FLOAT32_OPTIONS)
    runner = compiled.engine.runner
    n_decodable = compiled.engine.n_decodable
    assert runner.n_decodable == n_decodable == compiled.model.vocab_size - 200
    seen = []
    run = runner.run

    def recording(plan):
        out = run(plan)
        logits = None if out.logits is None else out.logits.clone()
        seen.append((bool(plan.prefill), logits, out.summary))
        return out

    runner.run = recording
    prompts = [[1, 5, 9, 11], [1, 2]]
    tokens, _ = compiled.generate(prompts, max_gen_len=8, temperature=0)
    assert tokens == eager.generate(prompts, max_gen_len=8, temperature=0)[0]
    decoding = [(logits, summary) for prefill, logits, summary in seen if not prefill and logits is not None]
    assert decoding and all(summary is None for prefill, _, summary in seen if prefill)
    beyond: list[bool] = []
    for logits, summary in decoding:
        assert summary is not None and summary.greedy.shape == summary.totals.shape == (logits.shape[0],)
        assert torch.equal(summary.greedy, logits[:, :n_decodable].argmax(-1))
        beyond.append(bool((logits.argmax(-1) >= n_decodable).any()))
        # (a sum of the vocabulary's logits in another order: equal to float32's rounding of it)
        scale = logits.abs().sum(-1)
        assert ((summary.totals - logits.sum(-1)).abs() <= 1e-5 * scale).all()
    assert any(beyond), "no step's best logit was a padding id: the cut at n_decodable went untested"


def test_attended_contexts():
    """On the CPU, contexts below the first bucket go in buckets of 64 and 128; a GPU keeps its
    buckets (each a CUDA graph)."""
    from llama.engine.runner import attended_buckets

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attended_buckets(320, cpu) == [64, 128, 256, 320]
    assert attended_buckets(320, cuda) == [256, 320]
    assert attended_buckets(2048, cpu) == [64, 128, 256, 512, 1024, 2048]
    assert attended_buckets(100, cpu) == [64, 100] and attended_buckets(64, cpu) == [64]


def test_compiled_rotary_embedding_is_real_arithmetic_inductor_fuses(llama3_one_layer):
    """A compiled step rotates queries and keys in real arithmetic (Inductor generates no code
    for complex numbers: each complex operation ran alone, seven per layer) and its logits are
    the eager step's, which rotates them as complex numbers."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = build(llama3_one_layer, compile=False, dtype="float32", max_batch_size=2).model
    cache = model.new_kv_cache(2)
    tokens, positions = torch.tensor([[5], [9]]), torch.tensor([[3], [7]])
    expected = model.decode_logits(tokens, positions, 16, cache)
    with torch.inference_mode():
        logits, code = run_and_get_code(torch.compile(model.decode_logits, dynamic=False),
                                        tokens, positions, 16, cache)
    calls = [line.split("= torch.ops.")[1].split("(")[0] for line in "\n".join(code).splitlines()
             if "= torch.ops." in line and "(" in line.split("= torch.ops.")[1]]
    # the one complex operation left: the view of the rotations' buffer as (cos, sin) pairs
    assert calls.count("aten.view_as_real.default") == 1, calls
    assert not [call for call in calls if "complex" in call or call.startswith("aten.mul")], calls
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("values_by_matmul", [False, True], ids=["fused sum", "values by matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_attention_as_reductions_matches_sdpa(dtype, values_by_matmul):
    """Under torch.compile on the CPU the masked attention (decoding, verification) is written as
    multiply-and-sum that Inductor fuses (no call to torch's flash-attention kernel is left in
    the generated code), the values' weighted sum fused too or (on AVX2) a matrix product; it
    gives SDPA's output, for one and several query rows, grouped queries stacked as the model
    stacks them, masks that hide part of the context, and a row that sees nothing (zeros, not
    NaN: a Llama 4 model's experts would mix it into the others)."""
    from torch._inductor.utils import run_and_get_code

    from llama.layers.attention import masked_attention

    torch._dynamo.reset()
    policy = KernelPolicy(attention_as_reduction=True, attention_values_by_matmul=values_by_matmul)
    generator = torch.Generator().manual_seed(0)
    for batch, heads, rows, context in [(1, 2, 4, 64), (3, 8, 1, 100), (2, 2, 32, 300)]:
        q = torch.randn(batch, heads, rows, 64, generator=generator).to(dtype)
        keys = torch.randn(batch, heads, context, 64, generator=generator).to(dtype)
        values = torch.randn(batch, heads, context, 64, generator=generator).to(dtype)
        seen = torch.randint(1, context + 1, (batch, 1, rows, 1), generator=generator)
        mask = torch.arange(context) < seen  # (B, 1, R, S): each row sees its own prefix
        mask[-1, :, -1] = False  # a row that sees nothing (a padding row): zeros, as from SDPA
        expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        assert torch.equal(masked_attention(q, keys, values, mask, policy), expected)  # eager: SDPA itself
        compiled = torch.compile(masked_attention, dynamic=False)
        out, code = run_and_get_code(compiled, q, keys, values, mask, policy)
        assert "flash_attention" not in "\n".join(code)
        # (a product of one query row Inductor writes as a multiply-and-sum itself)
        assert ("extern_kernels.bmm(" in "\n".join(code)) == (values_by_matmul and rows > 1)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output apart
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_cpu_steps_compiled_without_the_wrapper_s_checks(llama3_one_layer):
    """A compiled CPU step's options (cpu_compile_options) leave out the Python wrapper's size,
    stride and alignment checks of every kernel Inductor calls but does not generate (about
    120 a 150m step); the logits stay the eager step's."""
    from torch._inductor.utils import run_and_get_code

    from llama.engine.runner import cpu_compile_options

    torch._dynamo.reset()
    model = build(llama3_one_layer, compile=False, dtype="float32", max_batch_size=2).model
    cache = model.new_kv_cache(2)
    tokens, positions = torch.tensor([[5], [9]]), torch.tensor([[3], [7]])
    expected = model.decode_logits(tokens, positions, 16, cache)
    compiled = torch.compile(model.decode_logits, dynamic=False, options=cpu_compile_options())
    with torch.inference_mode():
        logits, code = run_and_get_code(compiled, tokens, positions, 16, cache)
    wrapper = "\n".join(code)
    assert "extern_kernels.mm(" in wrapper or "torch.ops." in wrapper  # kernels it calls, unchecked:
    assert "assert_size_stride(" not in wrapper and "assert_alignment(" not in wrapper
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_failed_compilation_falls_back_to_eager(llama3_checkpoint, caplog):
    import torch._dynamo.exc

    llama = build(llama3_checkpoint)
    expected = llama.generate([[1, 5, 9]], max_gen_len=8, temperature=0)

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("simulated compiler failure")

    llama.engine.runner.use_compiled_step(broken)
    assert llama.compiled
    assert llama.generate([[1, 5, 9]], max_gen_len=8, temperature=0) == expected
    assert not llama.compiled and "continuing without it" in caplog.text


SPECULATIVE = {"method": "ngram", "num_tokens": 4}


@pytest.fixture(scope="module")
def llama3_bfloat16_speculating(llama3_one_layer):
    """llama3_one_layer in bfloat16 (packed weights where this CPU packs them), compiled with
    n-gram speculation (the decoding step and the verification step), built at 2 threads:
    one build for test_compiled_step_uses_the_packed_weights and
    test_compiled_verification_in_bfloat16_..., which follow each other (no
    torch._dynamo.reset() between them, which would throw its compiled steps away)."""
    from llama.runtime import host

    host.configure_cpu_threads()  # its once-per-process choice, before ours
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return build(llama3_one_layer, dtype="bfloat16", compile=True, speculative=SPECULATIVE)
    finally:
        torch.set_num_threads(saved)


@needs_fbgemm
def test_compiled_step_uses_the_packed_weights(llama3_bfloat16_speculating, monkeypatch):
    """compile=True in bfloat16 keeps the packed weights: the compiled step calls them
    through the llama::packed_linear operator (once per packed matrix), and its logits are
    the eager step's up to bfloat16 roundings that Inductor's fused kernels skip (they keep
    intermediates in float32; measured 0.7% relative, 2e-2 allowed, as between fbgemm's and
    torch's bfloat16).  Greedy tokens of a random model are not compared: its near-ties flip
    at that level.  Here Llama 3's shape (GQA, scaled RoPE) at 2 threads (fbgemm's threaded
    entry point), on two rows and one; Llama 2's shape (MHA, embedding split over dim) at 1
    thread (the single-threaded entry point) is checked the same way, on one row, by each
    process of test_compiled_steps_of_another_model_cached_on_disk_are_not_reused.  What the
    other two pairs would add is covered: the entry point is chosen per thread count whatever
    the shape (test_packing.py's test_bfloat16_model_packs_its_weights_... checks both pairs of
    each model)."""
    from llama.runtime import host

    threads = 2  # the fixture's build
    host.configure_cpu_threads()  # its once-per-process choice, before ours
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = llama3_bfloat16_speculating
        model = compiled.model
        assert isinstance(model.output, PackedWeight)
        assert isinstance(model.layers[0].attention.fused, PackedFusedProjections)
        assert packed_kind_is_this_cpus([m for m in model.modules() if isinstance(m, PackedWeight)], threads)
        calls = []

        class CountingTable(dict):
            def __getitem__(self, key):
                calls.append(key)
                return super().__getitem__(key)

        monkeypatch.setattr(packing, "_PACKED_BY_KEY", CountingTable(packing._PACKED_BY_KEY))
        # On the engine's own cache and block table, in shapes the warm-up compiled (inputs made in
        # inference mode and contiguous, as the runner's: the graph's guards check both), so that
        # the warm-up's graph serves the step (the model's forward_cache() would be another graph)
        runner = compiled.engine.runner
        kv, context, graphs = runner.kv, runner.context_buckets[0], _compiled_graphs()
        with torch.inference_mode():
            table = kv.whole_sequences(2, model.device)
            model.hidden_states(torch.tensor([[1, 5, 9, 11], [1, 2, 3, 4]]), torch.arange(4).expand(2, 4), 4,
                                kv.cache, from_start=True, block_table=table)
            tokens, positions = torch.tensor([[5], [7]]), torch.tensor([[4], [2]])
            eager = model.decode_logits(tokens, positions, context, kv.cache, table)
            assert not calls  # eager steps call the kernels directly
            out = runner.decode_step(tokens, positions, context, kv.cache, table)
        assert compiled.compiled  # no fallback to eager
        assert _compiled_graphs() == graphs, "the warm-up's graph did not serve the step"
        assert len(calls) == 4 * model.n_layers + 1
        assert rel_err(out, eager) < 2e-2
        assert len(compiled.generate([[1, 5, 9]], max_gen_len=5, temperature=0)[0][0]) == 5 and compiled.compiled
    finally:
        torch.set_num_threads(saved)


def test_compiled_verification_in_bfloat16_gives_the_eager_and_the_decoding_step_s_logits(
        llama3_bfloat16_speculating):
    """bfloat16 (packed weights where this CPU packs them): the compiled verification step's
    logits at every fed position are the eager pass's, and the compiled decoding step's fed the
    same tokens one at a time, up to the roundings Inductor's fused kernels skip (relative
    error, as test_compiled_step_uses_the_packed_weights allows); no graph is made for them."""
    llama = llama3_bfloat16_speculating
    runner, model = llama.engine.runner, llama.model
    kv = runner.kv
    context = runner.context_buckets[0]
    graphs = _compiled_graphs()
    with torch.inference_mode():  # inputs made in it, as the runner's are (guards see the difference)
        table = kv.whole_sequences(2, model.device)
        prompt = torch.tensor([[1, 5, 9, 11], [1, 2, 3, 4]])
        fed = torch.tensor([[5, 9, 11], [7, 2, 9]])  # a pending token and two proposals a row
        positions = torch.arange(4, 7).repeat(2, 1)  # contiguous, as the runner's (strides are guarded too)
        model.hidden_states(prompt, torch.arange(4).expand(2, 4), 4, kv.cache, from_start=True, block_table=table)
        eager = model.logits(model.hidden_states(fed, positions, 7, kv.cache, block_table=table))  # (2, 3, V)
        verified = runner.verify_step(fed, positions, context, kv.cache, table)
        decoded = torch.stack([runner.decode_step(fed[:, j : j + 1].contiguous(), positions[:, j : j + 1].contiguous(),
                                                  context, kv.cache, table) for j in range(3)], dim=1)
    assert llama.compiled and runner.verify_step is not None and _compiled_graphs() == graphs
    assert verified.shape == eager.shape
    assert rel_err(verified, eager) < 2e-2
    assert rel_err(verified, decoded) < 2e-2


# Prompts that llama3_one_layer's model continues by repeating parts of them, or of its reply
# (prompt lookup's case: proposals accepted and rejected), one it does not, and one past the
# first context bucket (256)
SPECULATED_PROMPTS = [[1, 343, 431, 149, 176, 77, 83, 149, 134, 4], [1, 20, 30, 20, 30, 20], [1, 7, 4, 7, 4, 7]]
PLAIN_PROMPT = [1, 2, 3, 2, 3]
LONG_PROMPT = [1] + [5 + i % 50 for i in range(270)]


def _speculated_workload(llama) -> list[list[int]]:
    """Greedy replies: the prompts alone, batched by 2 and by 3 (with one not speculating), and a
    long one."""
    engine = llama.engine

    def reply(prompt: list[int], n: int = 32, **settings):
        return engine.submit(prompt, RequestSettings(max_new_tokens=n, temperature=0, **settings))

    out = [reply(p).result().tokens for p in SPECULATED_PROMPTS]
    for batch in (SPECULATED_PROMPTS[:2], SPECULATED_PROMPTS[:2] + [PLAIN_PROMPT]):
        handles = [reply(p, speculative=p is not PLAIN_PROMPT) for p in batch]
        out += [h.result().tokens for h in handles]
    return out + [reply(LONG_PROMPT, 24).result().tokens]


@pytest.fixture(scope="module")
def plain_replies(llama3_one_layer) -> list[list[int]]:
    """_speculated_workload's greedy replies from an eager engine without speculation (float32),
    the reference of the two tests below."""
    return _speculated_workload(build(llama3_one_layer, **FLOAT32_OPTIONS))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_verification_is_warmed_up_whole_and_gives_the_eager_tokens(llama3_one_layer, plain_replies, device,
                                                                           monkeypatch, caplog):
    """With speculation, compile=True compiles a verification step beside the decoding step and
    warms up every shape a step with proposals may have (SpeculativeConfig.verified_shapes x
    the context buckets; on CUDA each captured as a CUDA graph): no graph break, and no graph
    made afterwards while requests alone and batched (3 rows, one not speculating) and one past
    the first context bucket propose tokens, some accepted and some not.  Every verification
    runs compiled, and the greedy tokens are those of an eager engine with speculation and of
    one without (float32)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    options = dict(device=device, **FLOAT32_OPTIONS)
    compiled = build(llama3_one_layer, compile=True, speculative=SPECULATIVE, **options)
    runner = compiled.engine.runner
    assert compiled.compiled and runner.verify_step is not None
    assert runner.verify_shapes == set(SpeculativeConfig(num_tokens=4).verified_shapes(3))
    graphs, breaks = _compiled_graphs(), sum(counters["graph_break"].values())
    assert breaks == 0
    compiled_shapes, verifications = [], []
    verify_step, verify = runner.verify_step, runner._verify

    def counting_step(tokens, *args):
        compiled_shapes.append(tuple(tokens.shape))
        return verify_step(tokens, *args)

    def counting_verify(feeding, proposals):
        verifications.append(len(feeding))
        return verify(feeding, proposals)

    monkeypatch.setattr(runner, "verify_step", counting_step)
    monkeypatch.setattr(runner, "_verify", counting_verify)
    got = _speculated_workload(compiled)
    assert _compiled_graphs() == graphs and sum(counters["graph_break"].values()) == 0
    assert "compiled again" not in caplog.text
    assert len(compiled_shapes) == len(verifications)  # every verification ran compiled ...
    assert {rows for rows, _ in compiled_shapes} == {1, 2, 3}  # ... alone and batched
    stats = compiled.engine.stats()
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_proposed_tokens_total"]
    if device == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == 0  # every compiled step a CUDA graph
    # (afterwards: an eager engine's steps choose this process's CPU threads, which a compiled
    # CPU step's guards see)
    eager = build(llama3_one_layer, compile=False, speculative=SPECULATIVE, **options)
    assert _speculated_workload(eager) == got, "not the tokens of an eager engine with speculation"
    plain = plain_replies if device == "cpu" else _speculated_workload(build(llama3_one_layer, **options))
    assert plain == got, "not the tokens of an eager engine without speculation"


def test_a_verification_step_that_fails_to_compile_falls_back_to_eager(llama3_one_layer, plain_replies, caplog):
    """A compiler failure in the verification step: a warning, that step eager from then on (the
    same tokens), and the decoding step left as it was."""
    import torch._dynamo.exc

    llama = build(llama3_one_layer, speculative=SPECULATIVE, **FLOAT32_OPTIONS)
    runner = llama.engine.runner

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("simulated compiler failure")

    runner.use_compiled_verification(broken)
    assert _speculated_workload(llama) == plain_replies
    assert runner.verify_step is None and "compiling the verification step failed" in caplog.text
    assert llama.engine.stats()["spec_accepted_tokens_total"] > 0


@needs_fbgemm
def test_compiled_steps_of_another_model_cached_on_disk_are_not_reused(llama2_one_layer, tiny_tiktoken_path,
                                                                       tmp_path):
    """Inductor caches compiled graphs on disk.  Two processes that build models of
    different vocabularies number their packed matrices alike, so the output projection has
    the same key in both, 400 wide in one and 556 wide in the other: the second process must
    not take the first one's graph (it did when the operator found the width by key).  The
    two models differ in nothing else (one layer each, the same shape otherwise), so that
    only the width tells their graphs apart.

    Each process (bfloat16, one row, at 1 thread: fbgemm's single-threaded entry point, on
    Llama 2's shape: MHA, embedding split over dim) also checks what
    test_compiled_step_uses_the_packed_weights checks at 2 threads: the weights packed as this
    CPU's kind, the compiled step calling them through the llama::packed_linear operator once
    per packed matrix (eager steps never), its logits the eager step's within 2e-2 relative
    (a graph of the other width could not give them), and greedy decoding compiled to the end
    (packed_compile_worker.py)."""
    from conftest import LLAMA2_PARAMS

    wide = _one_layer_checkpoint(tmp_path / "vocab556", tiny_tiktoken_path, LLAMA2_PARAMS, 3, "dim")
    # Inductor's own cache folder, shared with the other tests (a folder of its own would
    # probe the CPU's vector instructions anew, with a build and a load for each, 7 s a process)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    worker = Path(__file__).parent / "packed_compile_worker.py"
    seen = []
    for i, (path, tok, params, _) in enumerate((llama2_one_layer, wide)):
        out = tmp_path / f"process{i}.json"
        run = subprocess.run([sys.executable, str(worker), str(path), str(tok), str(out)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        seen.append(json.loads(out.read_text()))
        assert seen[-1]["vocab"] == params["vocab_size"]
    assert [s["vocab"] for s in seen] == [400, 556], "not the two widths this test is about"
    for s in seen:
        assert s["threads"] == 1 and s["n_layers"] == 1, s
        assert s["output_packed"] and s["fused_packed"], f"a linear layer is not packed: {s}"
        assert s["kind_is_this_cpus"], f"not packed for this CPU's single-threaded kernel: {s}"
        assert s["eager_calls"] == 0, f"an eager step went through the operator: {s}"
        assert s["compiled_calls"] == 4 * s["n_layers"] + 1, f"not one operator call per packed matrix: {s}"
        assert s["graphs_made"] == 0, f"the warm-up's graph did not serve the step: {s}"
        assert s["rel_err"] is not None and s["rel_err"] < 2e-2, f"compiled logits are not the eager step's: {s}"
        assert s["generated"] == 5 and s["compiled"], f"decoding did not stay compiled: {s}"


def test_compiled_step_checks_its_inputs_not_the_model(llama3_one_layer, monkeypatch):
    """Dynamo checks a compiled step's guards at every call; those on the model's own modules
    (about a thousand on the 150m, 0.2-0.4 ms a step) are dropped
    (llama.engine.runner.keep_guard_unless_on_model), those on its inputs stay: a KV cache of
    another size is compiled for anew, and gives the eager step's logits, rather than being
    run with the first cache's sizes."""
    from llama.engine import runner as runner_module

    seen: list[tuple[str, bool]] = []
    original = runner_module.keep_guard_unless_on_model

    def counting(entries):
        keep = original(entries)
        seen.extend((entry.name, kept) for entry, kept in zip(entries, keep))
        return keep

    monkeypatch.setattr(runner_module, "keep_guard_unless_on_model", counting)
    torch._dynamo.reset()
    llama = build(llama3_one_layer, compile=True, dtype="float32", max_seq_len=64, max_batch_size=1)
    dropped = [name for name, kept in seen if not kept]
    assert len(dropped) > 20 and all(name.startswith("model.") for name in dropped), dropped[:5]
    assert "cache._modules['0']._buffers['k']" in {name for name, kept in seen if kept}

    runner, model = llama.engine.runner, llama.model
    block_size, width = runner.kv.block_size, runner.kv.table_width
    n_blocks = runner.kv.cache[0].n_blocks + 3
    other = model.new_kv_cache(n_blocks=n_blocks, block_size=block_size)
    table = torch.arange(1, width + 1).unsqueeze(0)  # blocks 1..width of the larger pool
    context, graphs = runner.context_buckets[0], _compiled_graphs()
    with torch.inference_mode():
        model.hidden_states(torch.tensor([[1, 5, 9, 11]]), torch.arange(4).unsqueeze(0), 4, other,
                            from_start=True, block_table=table)
        tokens, positions = torch.tensor([[7]]), torch.tensor([[4]])
        eager = model.decode_logits(tokens, positions, context, other, table)
        out = runner.decode_step(tokens, positions, context, other, table)
    assert llama.compiled and _compiled_graphs() == graphs + 1, "the other cache did not get a graph of its own"
    assert rel_err(out, eager) < 1e-4


def test_disk_cache_keeps_each_vector_width_apart(llama3_one_layer, tmp_path):
    """Inductor's disk cache keys a compiled graph without the vector width it generated C++ for
    (torch 2.13), which ``ATEN_CPU_CAPABILITY`` chooses: an AVX-512 process that found an AVX2
    process's graph ran it with 512-bit vectors and aborted on a corrupted heap, and an AVX2
    process that found an AVX-512 one's gave NaN logits.  The runner names the width in its
    options (llama.engine.runner.cpu_compile_options), which the key holds.  Two processes on one
    cache folder, AVX2 then this CPU's widest (the order that aborted; the other one is the same
    key): each compiled step gives the eager step's greedy tokens (vector_width_worker.py).
    Meaningful only on a CPU with AVX-512."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if {isa.bit_width() for isa in valid_vec_isa_list()} != {256, 512}:
        pytest.skip("needs a CPU with AVX-512 and AVX2: two vector widths for the one cache")
    ckpt, tokenizer = llama3_one_layer.ckpt_dir, llama3_one_layer.tokenizer_path
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    # The cache folder the other tests use: there both widths' graphs are found again after a
    # first run (fast), and without the width in the key one would be found for the other.
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")]))
    worker = Path(__file__).parent / "vector_width_worker.py"
    widths = []
    for i, capability in enumerate(("avx2", None)):
        out = tmp_path / f"process{i}.json"
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        run = subprocess.run([sys.executable, str(worker), str(ckpt), str(tokenizer), str(out)], env=run_env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"process {i} ({capability or 'default'}): exit {run.returncode}\n" \
                                    f"{run.stderr[-3000:]}"
        seen = json.loads(out.read_text())
        assert seen["compiled"] == seen["eager"], f"process {i} ({capability or 'default'}): {seen}"
        assert len(seen["eager"]) == 12
        widths.append(seen["width"])
    assert widths == [256, 512], widths


@pytest.mark.skipif(CpuFeatures.probe().int8_activation_reduce_range is None,
                    reason="this torch build has no fbgemm int8 product (x86 builds of torch have it)")
def test_w8a8_compiled_step_matches_eager(llama3_one_layer):
    """Compiled steps reach fbgemm's int8 product through the llama::packed_linear operator
    (by key): the same kernel on the same rows, so the same tokens as eager steps up to the
    first step where eager's two best logits are within the two paths' rounding difference
    (either token is then right), and log-probabilities within that difference.  (One row
    at most: one prompt is decoded, and the warm-up compiles no graph of several rows.)"""
    torch._dynamo.reset()
    eager = build(llama3_one_layer, dtype="bfloat16", quantize="w8a8", max_batch_size=1)
    compiled = build(llama3_one_layer, dtype="bfloat16", quantize="w8a8", compile=True, max_batch_size=1)
    # Compiled bfloat16 steps fuse the ops around the products without rounding between them:
    # their log-probabilities differ from eager ones by up to 0.02 already with int8 (0.017
    # measured on an AVX-512 CPU, 0.042 on an AVX2 one), and an activation near a code
    # boundary then lands on the next code.  On the AVX2 CPU the sixth token's two best eager
    # logits are one bfloat16 step (0.016) apart, and the compiled step picks the other one.
    _same_greedy_tokens_until_a_tie(eager, compiled, max_gen_len=10, tie_within=5e-2, logprobs_within=5e-2)


def _same_greedy_tokens_until_a_tie(eager, compiled, *, max_gen_len: int, tie_within: float,
                                    logprobs_within: float) -> None:
    """Greedy decoding of one prompt, the compiled engine first (see
    test_compiled_decode_step_matches_eager): the same tokens as eager's up to the first step
    whose two best eager logits are within ``tie_within`` (either token is then right; all of
    them where there is none), and log-probabilities within ``logprobs_within`` up to it.  The
    first of a few prompts that gives at least 5 such steps is compared (where a random model's
    near-ties fall moves with its weights: a change of quantiser moved the first prompt's first
    to the 4th step)."""
    for prompt in ([1, 5, 9, 11], [2, 7, 3, 8], [4, 12, 6, 10], [3, 14, 1, 7], [5, 2, 13, 9], [6, 11, 8, 2]):
        b, lp_b = compiled.generate([prompt], max_gen_len=max_gen_len, temperature=0, logprobs=True)
        a, lp_a = eager.generate([prompt], max_gen_len=max_gen_len, temperature=0, logprobs=True)
        with torch.inference_mode():
            logits = eager.model.forward(torch.tensor([prompt + a[0]]), 0)[0, len(prompt) - 1 : -1].float()
        best_two = logits.topk(2, dim=-1).values
        ties = (best_two[:, 0] - best_two[:, 1] <= tie_within).nonzero().flatten().tolist()
        decided = ties[0] if ties else len(a[0])  # tokens before the first near-tie
        if decided >= 5:
            break
    assert decided >= 5, "the prompts give too few clear steps to compare"
    assert a[0][:decided] == b[0][:decided]
    if not ties:
        assert a == b
    assert lp_a[0][:decided + 1] == pytest.approx(lp_b[0][:decided + 1], abs=logprobs_within)


@pytest.mark.multiprocess
def test_compiled_step_is_one_graph_on_two_ranks(tiny_tiktoken_path, tmp_path):
    """Under tensor parallelism the compiled steps stay whole: fairscale's collectives, which
    Dynamo cannot trace (``ctx.mark_dirty``), go through functional collectives in inference.
    Built with speculation (the decoding step and the verification step compiled), no graph
    break on either rank, and the build's warm-up makes the two graphs of each step that
    ModelRunner.compile describes on the CPU (one row, several rows): a step cut at its
    collectives would make more.  None is made after the warm-up while batches of 1 to 3 rows
    and a context past the first bucket are decoded with proposals (every verification
    compiled) and without, and the tokens are those of one eager process without speculation.
    (One layer: a cut at the collectives shows in one layer as in many, and compiling takes
    longer the more layers a step has.)"""
    from conftest import LLAMA3_PARAMS

    ckpt, tokenizer = _one_layer_checkpoint(tmp_path / "ckpt", tiny_tiktoken_path, LLAMA3_PARAMS, 1, "vocab")[:2]
    out = tmp_path / "out"
    out.mkdir()
    proc = helpers.torchrun(Path(__file__).parent / "compile_worker.py", [str(tokenizer), str(out), str(ckpt)],
                            nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for (on_rank,) in ranks:
        assert on_rank["compiled"]
        assert on_rank["at_build"]["breaks"] == 0 and on_rank["breaks_after"] == 0
        assert on_rank["at_build"]["graphs"] == 2 * 2, "not two graphs for each of the two steps"
        assert on_rank["graphs_after"] == 0
        assert 0 < on_rank["accepted"] < on_rank["proposed"]
        assert on_rank["verifications"]["compiled"] == on_rank["verifications"]["all"] > 0
    from compile_worker import MAX_SEQ_LEN, batches

    eager = build((ckpt, tokenizer), max_seq_len=MAX_SEQ_LEN, max_batch_size=4)
    expected = [eager.generate(batch, max_gen_len=12, temperature=0)[0] for batch in batches(eager)]
    assert ranks[0][0]["tokens"] == expected
    assert ranks[0][0]["plain"] == expected
    assert ranks[0] == ranks[1]


def test_int4_compiled_step_matches_eager_through_our_kernel(llama3_one_layer):
    """int4 on a CPU where our kernel runs: the layers hold its layout only (torch's packing
    dropped), so eager and compiled steps multiply through the same operator
    (llama_qcpu::q4_matmul, opaque to Inductor) on the same rows, and give the same greedy
    tokens.  Compiled bfloat16 steps fuse the ops around the products without rounding between
    them, and the kernel quantises its activations to int8 (a value one bfloat16 step off can
    take the next code), so log-probabilities differ by a bfloat16 step or so, and tokens are
    compared up to the first step whose two best eager logits are that close (either is then
    right; on the 150m shape's random weights, eager's own bfloat16 logits tie exactly)."""
    from llama.layers import cpu_kernels
    from llama.layers.quantized import Int4Weight

    if CpuFeatures.probe().int8_dot is None or not cpu_kernels.load():
        pytest.skip("our int4 kernel does not run here")
    torch._dynamo.reset()
    kw = dict(dtype="bfloat16", quantize="int4", quantize_group_size=32, max_batch_size=1)
    eager = build(llama3_one_layer, **kw)
    compiled = build(llama3_one_layer, compile=True, **kw)
    layers = [m for m in compiled.model.modules() if isinstance(m, Int4Weight)]
    assert layers and all(m.int4_kernel_rows is not None and m.weight_int4 is None for m in layers)
    # Log-probabilities up to 0.028 apart on an AVX-512 VNNI CPU, so the best two logits' gap can
    # move by twice that: a gap of 3/64 (0.047, three bfloat16 steps at these logits) was seen to
    # change sides (int4 weights of the least-squares quantiser), so gaps up to 0.06 are ties.
    _same_greedy_tokens_until_a_tie(eager, compiled, max_gen_len=16, tie_within=6e-2, logprobs_within=4e-2)
