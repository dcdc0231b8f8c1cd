"""Llama 3.2 Vision's model (llama/vision_mllama.py and the cross-attention layers of
llama/model.py) and its Hugging Face conversion (llama/convert/mllama.py), against independent
statements: Meta's reference (llama-models' ``create_vision_mask``, fusion schedule and
``VisionEncoder``), the published configs, and a tiny random ``MllamaForConditionalGeneration``
(logits and greedy tokens).  The shapes: see ``mllama_helpers``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import helpers
import mllama_helpers as mh
from llama.args import MllamaVisionArgs, ModelArgs
from llama.convert.mllama import (
    _precompute,
    _unprecompute,
    hf_cross_attention_layers,
    mllama_config_to_params,
    mllama_hf_to_meta,
    mllama_meta_to_hf,
)
from llama.model import Transformer, attended_images
from llama.runtime import distributed
from llama.vision_mllama import supported_aspect_ratios, tile_counts

TOL = 1e-4

# Meta's params.json of Llama 3.2 11B-Vision-Instruct and 90B-Vision-Instruct, as published.
PARAMS_11B = {"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32, "n_kv_heads": 8,
              "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
              "vision_chunk_size": 560, "vision_max_num_chunks": 4, "vision_num_cross_attention_layers": 8,
              "vocab_size": 128256}
PARAMS_90B = {**PARAMS_11B, "dim": 8192, "n_heads": 64, "n_layers": 80, "vision_num_cross_attention_layers": 20,
              "multiple_of": 4096}
# Their Hugging Face configs' text_config.cross_attention_layers.
HF_CROSS_11B = [3, 8, 13, 18, 23, 28, 33, 38]
HF_CROSS_90B = [3, 8, 13, 18, 23, 28, 33, 38, 43, 48, 53, 58, 63, 68, 73, 78, 83, 88, 93, 98]

TINY_PARAMS = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": mh.VOCAB, "norm_eps": 1e-05,
               "rope_theta": 10000.0, "multiple_of": 16, "vision_chunk_size": mh.TILE, "vision_max_num_chunks": 4,
               "vision_num_cross_attention_layers": 2,
               "mllama_vision_args": {"dim": 32, "n_layers": 4, "n_global_layers": 2, "n_heads": 2, "patch_size": 14,
                                      "mlp_ratio": 2.0, "intermediate_layers": mh.META_INTERMEDIATE}}


def _dense_meta_mask(tokens: list[int], total: int) -> torch.Tensor:
    """(total, N) bool from Meta's own create_vision_mask spans, read as its _pad_masks reads them."""
    from llama_models.llama3.chat_format import create_vision_mask

    spans = create_vision_mask(tokens, mh.IMAGE)
    dense = torch.zeros(total, len(spans), dtype=torch.bool)
    for i, (start, end) in enumerate(spans):
        end = total if end == -1 else min(end, total)
        dense[start:end, i] = True
    return dense


@pytest.mark.parametrize("layout", [
    [], [3], [0], [2, 6], [2, 3], [2, 3, 7], [1, 4, 5, 9], [1, 2, 3], [5, 11],
])
def test_attended_images_are_meta_create_vision_mask(layout):
    """Over the prompt: Meta's spans exactly.  Past it (generated tokens): one image is attended to
    the end (Meta's -1), and with several the last prompt row goes on (Hugging Face's generation;
    Meta's own, whose last span ends at the prompt's length, would attend to nothing)."""
    length, generated = 12, 4
    tokens = [mh.IMAGE if i in layout else 5 for i in range(length)]
    located = torch.tensor([layout or [-1]])
    ours = attended_images(located, torch.arange(length + generated).unsqueeze(0))[0]
    if not layout:
        assert not ours.any()
        return
    assert torch.equal(ours[:length], _dense_meta_mask(tokens, length))
    if len(layout) == 1:
        assert torch.equal(ours, _dense_meta_mask(tokens, length + generated))
    assert torch.equal(ours[length:], ours[length - 1].expand(generated, -1))


def test_fusion_schedule_is_meta_and_matches_published_configs():
    CrossAttentionTransformerText = mh.meta_multimodal().CrossAttentionTransformerText

    for n_layers, n_cross in [(32, 8), (80, 20), (4, 2), (40, 8), (10, 3), (6, 6)]:
        args = ModelArgs(**{**PARAMS_11B, "n_layers": n_layers, "vision_num_cross_attention_layers": n_cross})
        meta = CrossAttentionTransformerText._init_fusion_schedule(SimpleNamespace(n_llama_layers=n_layers), n_cross)
        assert args.fusion_schedule() == meta
    assert hf_cross_attention_layers(ModelArgs(**PARAMS_11B)) == HF_CROSS_11B
    assert hf_cross_attention_layers(ModelArgs(**PARAMS_90B)) == HF_CROSS_90B


def test_published_params_build_meta_encoder_shape():
    args = ModelArgs(**PARAMS_11B)
    assert args.has_cross_attention and args.mllama_vision_args == MllamaVisionArgs()
    encoder = args.mllama_vision_args
    assert (encoder.dim, encoder.n_layers, encoder.n_global_layers, encoder.n_heads, encoder.patch_size) == \
        (1280, 32, 8, 16, 14)
    assert encoder.output_dim == 7680 and encoder.intermediate_layers == (3, 7, 15, 23, 30)
    assert not ModelArgs(**{k: v for k, v in PARAMS_11B.items() if not k.startswith("vision")}).has_cross_attention


@pytest.mark.parametrize("change, message", [
    ({"vision_num_cross_attention_layers": 33}, "between 1 and n_layers=32"),
    ({"vision_num_cross_attention_layers": -1}, "between 1 and n_layers"),
    ({"vision_chunk_size": 500}, "not a multiple of the encoder's patch_size=14"),
    ({"vision_chunk_size": "560"}, "vision_chunk_size must be a positive integer or -1"),
    ({"vision_max_num_chunks": 0}, "vision_max_num_chunks must be a positive integer"),
    ({"mllama_vision_args": {"intermediate_layers": [3, 40]}}, "below n_layers=32"),
    ({"mllama_vision_args": {"n_heads": 3}}, "not divisible by n_heads=3"),
])
def test_bad_vision_params_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs(**{**PARAMS_11B, **change})


def test_canvases_and_tile_counts():
    assert list(supported_aspect_ratios(4)) == mh.CANVASES
    ids = torch.tensor([[0, 1, 6, 8], [2, 3, 4, 5]])
    assert tile_counts(ids, 4).tolist() == [[0, 1, 4, 4], [2, 3, 4, 2]]
    with pytest.raises(ValueError, match=r"aspect_ratio_ids must lie in 0..8"):
        tile_counts(torch.tensor([9]), 4)


def test_tile_rows_round_trip_and_disagreeing_rows_are_refused():
    table = torch.randn(4, 4, 5, 3)
    rows = _precompute(table, 4)
    assert torch.equal(rows, mh.precomputed_rows(table))
    back = _unprecompute(rows, 4, 5, "t")
    used = torch.zeros(4, 4, dtype=torch.bool)
    for a, b in mh.CANVASES:
        used[:a, :b] = True
    assert torch.equal(back[used], table[used]) and not back[~used].any()  # places no canvas uses: zero
    bad = rows.clone().view(9, 4, 5, 3)
    bad[2, 0] += 1  # canvas (1, 2)'s first tile now disagrees with (1, 1)'s
    with pytest.raises(ValueError, match="aspect ratios disagree on the embedding of canvas place"):
        _unprecompute(bad.flatten(1), 4, 5, "t")
    bad = rows.clone().view(9, 4, 5, 3)
    bad[1, 3] = 1.0  # a tile past canvas (1, 1)'s one
    with pytest.raises(ValueError, match="non-zero row for tile 3"):
        _unprecompute(bad.flatten(1), 4, 5, "t")


def _hf_config_dict(**text_changes) -> dict:
    """A MllamaForConditionalGeneration config.json (as a dict, written out) of the tiny shape."""
    text = {"model_type": "mllama_text_model", "vocab_size": mh.VOCAB, "hidden_size": 64, "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
            "cross_attention_layers": [1, 4], "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **text_changes}
    vision = {"hidden_size": 32, "num_hidden_layers": 4, "num_global_layers": 2, "attention_heads": 2,
              "intermediate_size": 64, "vision_output_dim": 96, "image_size": mh.TILE, "patch_size": 14,
              "max_num_tiles": 4, "intermediate_layers_indices": [1, 3], "hidden_act": "gelu",
              "supported_aspect_ratios": [list(c) for c in mh.CANVASES]}
    return {"model_type": "mllama", "image_token_index": mh.IMAGE, "text_config": text, "vision_config": vision}


def test_hf_config_to_params():
    params = mllama_config_to_params(_hf_config_dict())
    assert params == {**TINY_PARAMS, "mllama_vision_args": {**TINY_PARAMS["mllama_vision_args"],
                                                            "intermediate_layers": [1, 3]}}
    with pytest.raises(ValueError, match=r"cross_attention_layers=\[1, 3\] are not Meta's schedule .* \(\[1, 4\]\)"):
        mllama_config_to_params(_hf_config_dict(cross_attention_layers=[1, 3]))
    wrong_token = {**_hf_config_dict(), "image_token_index": 3}
    with pytest.raises(ValueError, match="image_token_index=3 is not the first row past the vocabulary"):
        mllama_config_to_params(wrong_token)
    other_canvases = _hf_config_dict()
    other_canvases["vision_config"]["supported_aspect_ratios"] = [[1, 1], [2, 2]]
    with pytest.raises(ValueError, match="are not Meta's canvases"):
        mllama_config_to_params(other_canvases)
    from llama.convert.config import hf_config_to_params

    with pytest.raises(ValueError, match="convert it to Meta's layout first"):
        hf_config_to_params(_hf_config_dict())


@pytest.fixture(scope="module")
def tiny_model():
    """Our model with random weights (no conversion involved)."""
    distributed.init_model_parallel(torch.device("cpu"))
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY_PARAMS, max_seq_len=32, max_batch_size=2))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def test_memory_need_counts_the_encoder_and_the_image_kv(tiny_model):
    """The weights counted are every parameter, the encoder's and the cross-attention layers'
    included; the KV side holds one image's K/V per row, at its largest: 2 layers x (K, V) x 4 tiles
    x 5 tokens x 2 K/V heads x 16 wide, float32, and a step's batched copy of as many."""
    from llama.checkpoint.memory import image_kv_bytes, memory_need

    per_row = 2 * 2 * (4 * 5) * 2 * 16 * 4
    assert image_kv_bytes(tiny_model, 3, torch.float32) == 3 * per_row
    need = memory_need(tiny_model, torch.float32, world_size=1)
    params = sum(p.numel() for p in tiny_model.parameters()) * 4
    encoder = sum(p.numel() for p in tiny_model.vision_model.parameters()) * 4
    assert need.weights >= params > encoder > 0
    text_params = {k: v for k, v in TINY_PARAMS.items() if not k.startswith(("vision", "mllama"))}
    with torch.device("meta"):
        text_only = Transformer(ModelArgs(**text_params, max_seq_len=32, max_batch_size=2))
    # max_batch_size (2) rows' images held, and a step's batched copy of them (as large: the scheduler's bound)
    assert need.kv_cache - memory_need(text_only, torch.float32, world_size=1).kv_cache == 2 * 2 * per_row
    # The count is the most an image holds: a 2-tile image's context holds its 2 tiles' K/V, half of it.
    values, ids = mh.pixels([(1, 2)])
    context = tiny_model.image_context(values, ids, torch.tensor([[1, mh.IMAGE]]))
    assert sum(t.numel() * t.element_size() for kv in context.kv for t in kv) == per_row // 2


def test_image_context_checks_its_inputs(tiny_model):
    values, ids = mh.pixels([(1, 2), (2, 1)])
    tokens = torch.tensor([[1, mh.IMAGE, 5, 6]])
    with pytest.raises(ValueError, match=rf"row 0 has 1 <\|image\|> tokens \(id {mh.IMAGE}\) for 2 images"):
        tiny_model.image_context(values, ids, tokens)
    with pytest.raises(ValueError, match="padding images .* must come after"):
        tiny_model.image_context(values, torch.tensor([[0, 2]]), tokens)
    with pytest.raises(ValueError, match="aspect_ratio_ids must lie in 0..8"):
        tiny_model.image_context(values, torch.tensor([[9, 2]]), tokens)
    with pytest.raises(ValueError, match=r"must agree"):
        tiny_model.image_context(values[0], ids, tokens)
    with pytest.raises(ValueError, match=r"pixel_values must have shape \[images, 4, 3, 28, 28\]"):
        tiny_model.image_context(values[:, :, :, :, :14], ids, torch.tensor([[mh.IMAGE, mh.IMAGE]]))


def test_text_before_any_image_is_untouched_by_images(tiny_model):
    """Meta's row mask: the logits of text before the first image are those of the text alone,
    whatever the image; after it they depend on it."""
    tokens = torch.tensor([[1, 5, 6, mh.IMAGE, 7, 8]])
    first, ids = mh.pixels([(2, 2)], seed=1)
    second, _ = mh.pixels([(2, 2)], seed=2)
    with_first = tiny_model.forward(tokens, 0, images=tiny_model.image_context(first, ids, tokens))
    with_second = tiny_model.forward(tokens, 0, images=tiny_model.image_context(second, ids, tokens))
    text_only = tiny_model.forward(tokens, 0)
    assert torch.equal(with_first[:, :3], text_only[:, :3]) and torch.equal(with_second[:, :3], text_only[:, :3])
    assert (with_first[:, 3:] - with_second[:, 3:]).abs().max() > 1e-3


def test_padding_tiles_and_images_do_not_change_the_logits(tiny_model):
    """An image's tiles past its canvas are not attended; a row's padding image neither (a batch of
    two rows, one with two images, one with one)."""
    values, ids = mh.pixels([(1, 2), (1, 3)])
    tokens = torch.tensor([[1, mh.IMAGE, 5, mh.IMAGE, 6], [1, mh.IMAGE, 7, 8, 9]])
    batch_values = torch.cat([values, values])
    batch_ids = torch.tensor([ids[0].tolist(), [ids[0, 0].item(), 0]])
    batch = tiny_model.forward(tokens, 0, images=tiny_model.image_context(batch_values, batch_ids, tokens))
    alone = tiny_model.forward(tokens[1:], 0, images=tiny_model.image_context(values[:, :1], ids[:, :1], tokens[1:]))
    assert helpers.rel_err(batch[1:], alone) < 1e-6


def test_decoding_after_prefill_equals_a_whole_forward(tiny_model):
    tokens = torch.tensor([[1, 5, mh.IMAGE, 6, mh.IMAGE, mh.IMAGE, 7, 8, 9]])
    values, ids = mh.pixels([(1, 1), (2, 2), (4, 1)])
    context = tiny_model.image_context(values, ids, tokens)
    whole = tiny_model.forward(tokens, 0, images=context)
    tiny_model.forward(tokens[:, :5], 0, images=context)
    steps = [tiny_model.forward(tokens[:, i:i + 1], i, images=context) for i in range(5, tokens.shape[1])]
    assert helpers.rel_err(torch.cat(steps, dim=1), whole[:, 5:]) < 1e-5


# --- against Hugging Face's MllamaForConditionalGeneration (transformers) and Meta's reference ---

PROMPTS = {  # name: (tokens, canvases of its images)
    "image at the start": ([1, mh.IMAGE, 5, 6, 7, 8, 9], [(2, 2)]),
    "image mid-dialog": ([1, 10, 11, 12, 2, 1, 13, mh.IMAGE, 14, 15], [(1, 3)]),
    "two images": ([1, mh.IMAGE, 5, 6, mh.IMAGE, 7, 8], [(2, 2), (1, 2)]),
    "text before the first image, two together": ([1, 5, 6, mh.IMAGE, mh.IMAGE, 7, 8], [(2, 1), (3, 1)]),
}


def greedy(model: Transformer, tokens: list[int], values: torch.Tensor, ids: torch.Tensor, new: int) -> list[int]:
    """``new`` greedy tokens after ``tokens`` with its images, by the model's own forward and cache."""
    t = torch.tensor([tokens])
    context = model.image_context(values, ids, t)
    logits = model.forward(t, 0, images=context)
    generated = [int(logits[0, -1].argmax())]
    for step in range(new - 1):
        logits = model.forward(torch.tensor([[generated[-1]]]), len(tokens) + step, images=context)
        generated.append(int(logits[0, -1].argmax()))
    return generated


@pytest.fixture(scope="module")
def hf_and_ours():
    pytest.importorskip("transformers")
    distributed.init_model_parallel(torch.device("cpu"))
    hf = mh.random_hf_model()
    params = mllama_config_to_params(hf.config.to_dict())
    assert params["mllama_vision_args"]["intermediate_layers"] == mh.HF_INTERMEDIATE
    params["mllama_vision_args"]["intermediate_layers"] = mh.META_INTERMEDIATE  # transformers 5's shift (helpers)
    args = ModelArgs.from_dict(params, max_seq_len=64, max_batch_size=1)
    meta = mllama_hf_to_meta(hf.state_dict(), args)
    with torch.device("meta"):
        ours = Transformer(args)
    ours.load_state_dict({k.removeprefix("text_model."): v for k, v in meta.items()}, strict=True, assign=True)
    ours.setup_rope()
    return hf, ours.eval(), args, meta


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_match_transformers(hf_and_ours, name):
    hf, ours, _, _ = hf_and_ours
    tokens, canvases = PROMPTS[name]
    values, ids = mh.pixels(canvases)
    cross_mask, aspect_mask = mh.hf_masks(tokens, canvases)
    t = torch.tensor([tokens])
    with torch.no_grad(), mh.meta_row_masking():
        theirs = hf(input_ids=t, pixel_values=values, aspect_ratio_ids=ids, aspect_ratio_mask=aspect_mask,
                    cross_attention_mask=cross_mask).logits
    logits = ours.forward(t, 0, images=ours.image_context(values, ids, t))
    assert (logits - theirs).abs().max() < TOL
    assert helpers.rel_err(logits, theirs) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_tokens_match_transformers(hf_and_ours, name):
    hf, ours, _, _ = hf_and_ours
    tokens, canvases = PROMPTS[name]
    values, ids = mh.pixels(canvases)
    cross_mask, aspect_mask = mh.hf_masks(tokens, canvases)
    t = torch.tensor([tokens])
    new = 8
    with torch.no_grad(), mh.meta_row_masking():
        theirs = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=values, aspect_ratio_ids=ids,
                             aspect_ratio_mask=aspect_mask, cross_attention_mask=cross_mask, do_sample=False,
                             max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)[0, len(tokens):]
    assert greedy(ours, tokens, values, ids, new) == theirs.tolist()


@pytest.mark.slow
def test_conversion_round_trips(hf_and_ours):
    hf, _, args, meta = hf_and_ours
    back = mllama_meta_to_hf(meta, args)
    state = hf.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.slow
def test_encoder_matches_meta_reference(hf_and_ours):
    """llama-models' own VisionEncoder (fairscale, one process) on our encoder's weights, loaded
    strictly under Meta's names: the same features (so our intermediate layers are Meta's), in a
    batch and image by image.  Meta runs every tile slot; ours runs an image's real tiles and one
    padding tile standing for all of them (without it the features differ by about 2 %)."""
    RefEncoder = mh.meta_multimodal().VisionEncoder
    _, ours, args, _ = hf_and_ours
    encoder = args.mllama_vision_args
    ref = RefEncoder(max_num_tiles=mh.CHUNKS, image_size=mh.TILE, patch_size=encoder.patch_size, width=encoder.dim,
                     layers=encoder.n_layers, heads=encoder.n_heads, mlp_ratio=encoder.mlp_ratio,
                     n_global_layers=encoder.n_global_layers, global_model=True,
                     return_intermediate=list(encoder.intermediate_layers)).float().eval()
    ref.load_state_dict(ours.vision_model.vision_encoder.state_dict(), strict=True)
    canvases = [(1, 1), (1, 2), (1, 3), (2, 2)]  # 3, 2, 1 and 0 padding tiles (ours runs one for them all)
    values, ids = mh.pixels(canvases, seed=5)
    with torch.no_grad():
        theirs = ref(values, torch.tensor([canvases]))[0]
        mine = ours.vision_model.vision_encoder(values[0], ids[0])
        alone = [ours.vision_model.vision_encoder(values[0, i : i + 1], ids[0, i : i + 1])[0]
                 for i in range(len(canvases))]  # runs 2, 3, 4 and 4 tiles
    for i, (a, b) in enumerate(canvases):  # the real tiles (padding tiles are never attended)
        assert helpers.rel_err(mine[i, : a * b], theirs[i, : a * b]) < TOL
        assert helpers.rel_err(alone[i][: a * b], theirs[i, : a * b]) < TOL
        assert not mine[i, a * b :].any() and not alone[i][a * b :].any()  # zeros past them


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROMPTS))
def test_logits_match_meta_reference_text_model(hf_and_ours, name):
    """llama-models' CrossAttentionTransformerText on our text weights, fed as Meta's generation
    feeds it (create_vision_mask, _pad_masks, _get_xattn_mask, compute_xattn_kv_cache) with our
    encoder's vision tokens: the same logits, Meta's rule for text before an image included."""
    from llama_models.llama3.args import ModelArgs as RefArgs
    from llama_models.llama3.chat_format import create_vision_mask

    meta_model = mh.meta_multimodal()
    _, ours, args, meta = hf_and_ours
    tokens, canvases = PROMPTS[name]
    ref_args = RefArgs(**{k: v for k, v in TINY_PARAMS.items() if k != "mllama_vision_args"},
                       max_seq_len=len(tokens), max_batch_size=1)
    ref = meta_model.CrossAttentionTransformerText(ref_args).float()
    text = {k.removeprefix("text_model."): v for k, v in meta.items() if k.startswith("text_model.")}
    ref.load_state_dict(text, strict=True)
    ref.setup_cache(1, torch.device("cpu"), torch.float32)
    values, ids = mh.pixels(canvases)
    with torch.no_grad():
        vision = ours.vision_model(values[0], ids[0]).unsqueeze(0)  # [1, N, chunks, tokens, dim]
        caches = torch.stack([layer.compute_xattn_kv_cache(vision.view(1, -1, args.dim))
                              for layer in ref.cross_attention_layers])
        padded = meta_model._pad_masks([create_vision_mask(tokens, mh.IMAGE)], [[a * b for a, b in canvases]],
                                       len(tokens), mh.CHUNKS)
        xattn_mask, rows = ref._get_xattn_mask(len(tokens), "cpu", torch.float32, vision, padded)
        positions = torch.arange(len(tokens))
        t = torch.tensor([tokens])
        theirs = ref.forward(positions, ref.get_partially_trainable_embedding(t), xattn_mask, rows, caches)
    logits = ours.forward(t, 0, images=ours.image_context(values, ids, t))
    assert helpers.rel_err(logits, theirs) < TOL


@pytest.fixture(scope="module")
def converted_files(hf_and_ours, tmp_path_factory, tiny_tiktoken_path):
    """The HF model saved (safetensors), ``hf_to_meta`` into 1 and 2 shards (params.json's
    intermediate layers then moved by transformers 5's shift, see mllama_helpers)."""
    import json
    import shutil

    from llama.convert import hf_to_meta

    hf = hf_and_ours[0]
    root = tmp_path_factory.mktemp("mllama")
    hf.save_pretrained(root / "hf")
    shutil.copyfile(tiny_tiktoken_path, root / "hf" / "tokenizer.model")
    for n in (1, 2):
        hf_to_meta(root / "hf", root / f"meta{n}", model_parallel_size=n)
        params = json.loads((root / f"meta{n}" / "params.json").read_text())
        assert params["mllama_vision_args"]["intermediate_layers"] == mh.HF_INTERMEDIATE
        params["mllama_vision_args"]["intermediate_layers"] = mh.META_INTERMEDIATE
        (root / f"meta{n}" / "params.json").write_text(json.dumps(params))
    return root


@pytest.mark.slow
def test_meta_checkpoint_holds_meta_names_and_builds(hf_and_ours, converted_files):
    """hf_to_meta writes llama-models' key layout (text_model.* / vision_model.*), split as Meta's
    fairscale layers split; Llama.build reads it (1 and 2 shards read by one process) into a model
    whose logits are the in-memory conversion's (to 1e-5: the build lays out weights for this CPU)."""
    from llama import Llama
    from llama.checkpoint.shards import open_shard

    _, ours, args, meta = hf_and_ours
    one = open_shard(converted_files / "meta1" / "consolidated.00.pth")
    assert set(one) == set(meta) and all(torch.equal(one[k], meta[k]) for k in meta)
    halves = [open_shard(converted_files / "meta2" / f"consolidated.{r:02d}.pth") for r in range(2)]
    for name, rows in (("text_model.cross_attention_layers.0.attention.wq.weight", 0),
                       ("text_model.learnable_embedding.weight", 0),
                       ("vision_model.vision_encoder.transformer.resblocks.1.attn.wq.weight", 0),
                       ("vision_model.vision_projection.bias", 0)):
        assert torch.equal(torch.cat([h[name] for h in halves], dim=rows), meta[name])
    for name in ("text_model.cross_attention_layers.1.attention.wo.weight",
                 "vision_model.vision_encoder.global_transformer.resblocks.0.mlp.c_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves], dim=1), meta[name])
    for name in ("vision_model.vision_encoder.gated_positional_embedding",
                 "text_model.cross_attention_layers.0.gate_attn",
                 "vision_model.vision_encoder.global_transformer.resblocks.1.mlp.c_proj.bias"):
        assert torch.equal(halves[0][name], meta[name]) and torch.equal(halves[1][name], meta[name])
    tokens, canvases = PROMPTS["two images"]
    values, ids = mh.pixels(canvases)
    t = torch.tensor([tokens])
    expected = ours.forward(t, 0, images=ours.image_context(values, ids, t))
    for n in (1, 2):
        built = Llama.build(converted_files / f"meta{n}", max_seq_len=64, max_batch_size=1, device="cpu",
                            dtype="float32").model
        assert helpers.rel_err(built.forward(t, 0, images=built.image_context(values, ids, t)), expected) < 1e-5
    # vision=False: the text model alone, which is the full model's text-only forward
    text = torch.tensor([[1, 5, 6, 7, 8]])
    alone = Llama.build(converted_files / "meta2", max_seq_len=64, max_batch_size=1, device="cpu", dtype="float32",
                        vision=False).model
    assert alone.vision_model is None and not len(alone.cross_attention_layers) and alone.learnable_embedding is None
    assert helpers.rel_err(alone.forward(text, 0), ours.forward(text, 0)) < 1e-5


@pytest.mark.slow
def test_meta_to_hf_gives_back_the_hf_model(hf_and_ours, converted_files, tmp_path):
    import json

    from safetensors.torch import load_file

    from llama.convert import meta_to_hf

    hf = hf_and_ours[0]
    meta_to_hf(converted_files / "meta2", tmp_path / "hf")
    back = load_file(tmp_path / "hf" / "model.safetensors")
    state = hf.state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["text_config"]["cross_attention_layers"] == hf.config.text_config.cross_attention_layers
    assert config["vision_config"]["supported_aspect_ratios"] == [list(r) for r in mh.CANVASES]
    assert config["image_token_index"] == mh.IMAGE
    # The tokenizer files number <|image|> as the model does (tiktoken's 311 is a reserved token there).
    tokenizer_json = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    assert added["<|image|>"] == mh.IMAGE and added["<|reserved_special_token_2|>"] == 311
    assert len(added) == 257 and sorted(added.values()) == list(range(300, mh.IMAGE + 1))


def test_vision_tokenizer_files_are_hugging_face_s(llama3_tokenizer_path, tmp_path):
    """Llama 3's tokenizer.model written for a Llama 3.2 Vision model: transformers reads
    ``<|image|>`` as 128256 (Meta's chat format's id, the model's image_token_index; tiktoken has it
    at 128011, which transformers' Mllama conversion names <|reserved_special_token_2|>), and the
    ids of a prompt with an image are those of Meta's chat format; a text model's files keep tiktoken's."""
    import json

    from llama.convert.hf_tokenizer import hf_tokenizer_files
    from llama.tokenizer import load_tokenizer

    transformers = pytest.importorskip("transformers")

    tok = load_tokenizer(llama3_tokenizer_path)
    assert tok.special_tokens["<|image|>"] == 128011
    for name, content in hf_tokenizer_files(tok, 4096, image_row=True).items():
        (tmp_path / name).write_text(json.dumps(content))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(hf) == 128257
    assert hf.convert_tokens_to_ids("<|image|>") == 128256
    assert hf.convert_ids_to_tokens([128011, 128012, 128255]) == [
        "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|reserved_special_token_246|>"]
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>What is this?<|eot_id|>"
    piece = lambda t: tok.encode(t, bos=False, eos=False)  # noqa: E731
    # Meta's message layout (tests/test_mllama_chat_format.py checks ours against llama-models'), <|image|> 128256
    expected = [128000, 128006, *piece("user"), 128007, *piece("\n\n"), 128256, *piece("What is this?"), 128009]
    assert hf.encode(text, add_special_tokens=False) == expected
    assert hf_tokenizer_files(tok, 4096)["tokenizer.json"]["added_tokens"][11]["content"] == "<|image|>"  # text models


@pytest.mark.slow
def test_two_ranks_equal_one(hf_and_ours, converted_files, tmp_path, tiny_tiktoken_path):
    """The 2-shard checkpoint on 2 processes (gloo): the cross-attention heads and the encoder's
    heads split over them; each rank's logits and greedy tokens are one process's."""
    _, ours, _, _ = hf_and_ours
    result = helpers.torchrun(helpers.REPO / "tests" / "mllama_mp_worker.py",
                              [str(converted_files / "meta2"), str(tiny_tiktoken_path), str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["local_heads"] == 2 and got["vision_local_heads"] == 1
        for name, (tokens, canvases) in PROMPTS.items():
            values, ids = mh.pixels(canvases)
            t = torch.tensor([tokens])
            logits = ours.forward(t, 0, images=ours.image_context(values, ids, t))
            assert helpers.rel_err(got[name]["logits"], logits) < 1e-5
            assert got[name]["greedy"] == greedy(ours, tokens, values, ids, 8)
