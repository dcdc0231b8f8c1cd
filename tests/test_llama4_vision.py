"""Llama 4's image encoder (llama/vision.py), its weights and their conversion, against two
independent implementations: transformers' ``Llama4ForConditionalGeneration`` (a tiny random one,
float32, saved with save_pretrained, converted with ``hf_to_meta``, loaded with ``Llama.build``)
and Meta's reference encoder (llama-models' ``llama4/vision``) on the same weights.

The tiny shape: tiles of 56 pixels in 7-pixel patches (an 8 x 8 grid, 16 features a tile after
the pixel shuffle), a 2-layer ViT of width 32 with 4 heads, an adapter to 48, a Llama 4 text
model of width 64 (MoE every 2nd layer, a NoPE layer, chunked attention)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import helpers
from llama import Llama
from llama.args import ModelArgs, VisionArgs
from llama.checkpoint.memory import memory_need
from llama.convert import hf_to_meta, meta_to_hf
from llama.layers.tensor_parallel import (
    VISION_SHARD_AXES,
    Split,
    full_shapes,
    holder_region,
    shard_key,
    split_of,
    valid_model_parallel_sizes,
)
from llama.model import Transformer
from llama.runtime import distributed
from llama.vision import pixel_shuffle, vision_freqs_cis
from vision_helpers import IMAGE_SIZE, IMAGE_TOKEN, PATCH_SIZE, pixels, prompt_with_images

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

VOCAB = 556  # the tiny tiktoken tokenizer's
PATCHES = (IMAGE_SIZE // PATCH_SIZE // 2) ** 2  # features a tile gives (ratio 0.5)
TOL = 1e-4


def hf_config(vocab_size: int = VOCAB, image_token: int = IMAGE_TOKEN):
    text = transformers.Llama4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, intermediate_size_mlp=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=1, num_local_experts=4,
        interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=32, use_qk_norm=True,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, pixel_shuffle_ratio=0.5, vision_output_dim=48, projector_input_dim=48,
        projector_output_dim=48,
    )
    config = transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       image_token_index=image_token, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    return config


def random_hf_model(config=None):
    """A random Llama4ForConditionalGeneration (of ``config``, default :func:`hf_config`'s) whose
    activations stay of order 1 (so that a relative error of 1e-4 means something): weights ~
    1/sqrt(fan-in), norms near 1, biases small."""
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(config or hf_config()).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-2 if "experts" in name else -1] ** -0.5)
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_tiktoken_path):
    """(HF model, its folder, the Meta checkpoint hf_to_meta wrote, the Llama loaded from it)."""
    root = tmp_path_factory.mktemp("llama4_vision")
    hf = random_hf_model()
    hf.save_pretrained(root / "hf")
    shutil.copyfile(tiny_tiktoken_path, root / "hf" / "tokenizer.model")
    hf_to_meta(root / "hf", root / "meta")
    llama = Llama.build(root / "meta", max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32")
    return hf, root / "hf", root / "meta", llama


def hf_features(hf, tiles: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf.multi_modal_projector(hf.vision_model(tiles).last_hidden_state)


# -- quick checks of the pieces -----------------------------------------------------------


SCOUT_VISION = {"image_size": {"height": 336, "width": 336}, "patch_size": {"height": 14, "width": 14}, "dim": 1408,
                "n_layers": 34, "n_heads": 16, "mlp_ratio": 4.0, "output_dim": 4096, "pixel_shuffle_ratio": 0.5}


def test_vision_args_read_as_meta_writes_them():
    v = ModelArgs(dim=5120, n_layers=1, n_heads=40, n_kv_heads=8, vocab_size=202048,
                  vision_args=SCOUT_VISION).vision_args
    assert isinstance(v, VisionArgs)
    # Meta's chat format: (336 / 14 * 0.5)**2 = 144 <|patch|> tokens a tile; the adapter takes 4 * 1408
    assert (v.image_size, v.patch_size, v.patches_per_tile, v.hidden_dim, v.adapter_dim) == (336, 14, 144, 5632, 5632)
    assert VisionArgs.from_value(v.to_params()) == v


@pytest.mark.parametrize("change, says", [
    ({"image_size": {"height": 336, "width": 448}}, "square"),
    ({"patch_size": 15}, "multiple of patch_size"),
    ({"n_heads": 12}, "head width divisible by 4"),
    ({"pixel_shuffle_ratio": 0.3}, "pixel_shuffle_ratio"),
    ({"dim": "1408"}, "vision_args.dim"),
])
def test_bad_vision_args_are_refused_by_name(change, says):
    with pytest.raises(ValueError, match=says):
        VisionArgs.from_value({**SCOUT_VISION, **change})


def test_missing_vision_args_are_named():
    with pytest.raises(ValueError, match=r"vision_args lacks \['output_dim'\]"):
        ModelArgs(dim=64, n_layers=1, n_heads=4, vision_args={k: v for k, v in SCOUT_VISION.items()
                                                              if k != "output_dim"})


@pytest.mark.slow  # importing transformers' modeling code takes seconds
def test_rotations_are_transformers_2d_rope():
    """Our 2-D rotations against transformers' Llama4VisionRotaryEmbedding (written apart from Meta's)."""
    from transformers.models.llama4.modeling_llama4 import Llama4VisionRotaryEmbedding

    config = hf_config().vision_config
    theirs = Llama4VisionRotaryEmbedding(config).freqs_ci.squeeze(1)  # (tokens, head_dim / 2)
    args = VisionArgs.from_value({**SCOUT_VISION, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "dim": 32,
                                  "n_heads": 4})
    ours = vision_freqs_cis(args)
    assert ours.shape == theirs.shape == ((IMAGE_SIZE // PATCH_SIZE) ** 2 + 1, 4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert torch.equal(ours[-1], torch.ones(4, dtype=torch.complex64))  # the class token is not turned


@pytest.mark.slow  # importing transformers' modeling code takes seconds
def test_pixel_shuffle_is_transformers():
    from transformers.models.llama4.modeling_llama4 import pixel_shuffle as theirs

    x = torch.randn(3, 64, 32)
    assert torch.equal(pixel_shuffle(x, 0.5), theirs(x, 0.5))
    # each output feature is one 2 x 2 neighbourhood of patches: feature (0, 0) holds patches 0, 1, 8, 9
    grid = torch.arange(64.0).view(1, 64, 1).expand(1, 64, 4)
    assert set(pixel_shuffle(grid, 0.5)[0, 0].tolist()) == {0.0, 1.0, 8.0, 9.0}


def test_encoder_tensors_split_as_meta_splits_them():
    """Meta's split (llama-models: fairscale's Column/RowParallelLinear where its encoder uses them;
    transformers' converter lists the replicated ones), written out by hand."""
    block = "vision_embeddings.vision_encoder.transformer.resblocks.7."
    expected = {
        "vision_embeddings.vision_encoder.conv1._linear.weight": Split.COLUMN,
        "vision_embeddings.vision_encoder.class_embedding": Split.REPLICATED,
        "vision_embeddings.vision_encoder.positional_embedding_vlm": Split.REPLICATED,
        "vision_embeddings.vision_encoder.ln_post.bias": Split.REPLICATED,
        block + "attn.wq.weight": Split.COLUMN, block + "attn.wk.bias": Split.COLUMN,
        block + "attn.wo.weight": Split.ROW, block + "attn.wo.bias": Split.REPLICATED,
        block + "mlp.c_fc.bias": Split.COLUMN, block + "mlp.c_proj.weight": Split.ROW,
        block + "mlp.c_proj.bias": Split.REPLICATED, block + "ln_2.weight": Split.REPLICATED,
        "vision_embeddings.vision_adapter.mlp.c_fc.weight": Split.COLUMN,
        "vision_embeddings.vision_adapter.mlp.c_proj.weight": Split.ROW,
        "vision_projection.weight": Split.COLUMN,
    }
    assert {name: split_of(name) for name in expected} == expected
    # The encoder's 16 heads are never cut: sizes the text model alone allows but 16 heads do not
    # divide into are refused with the encoder.
    text = dict(dim=5120, n_layers=1, n_heads=40, n_kv_heads=8, vocab_size=202040, multiple_of=1280)
    alone = valid_model_parallel_sizes(ModelArgs(**text))
    assert any(16 % m for m in alone)
    assert valid_model_parallel_sizes(ModelArgs(**text, vision_args=SCOUT_VISION)) == [m for m in alone if 16 % m == 0]


@pytest.mark.slow  # transformers' Llama 4 config module is imported on first use: about a second
def test_scout_vision_config_converts_both_ways():
    """Scout's vision_config as transformers' converter writes it from Meta's params.json (width
    1408, 34 layers, 16 heads, image 336; its MLP width and projector dims are transformers'
    defaults, 5632 and 4096) reads back as Meta's vision_args, and vision_args write it again."""
    from llama.convert.config import llama4_vision_config_to_params, vision_args_to_hf_config

    hf = transformers.Llama4VisionConfig(hidden_act="gelu", num_hidden_layers=34, image_size=336,
                                         num_attention_heads=16, hidden_size=1408, vision_output_dim=4096)
    params = llama4_vision_config_to_params(hf.to_diff_dict())  # only what differs from the defaults
    assert params == SCOUT_VISION
    again = transformers.Llama4VisionConfig(**vision_args_to_hf_config(VisionArgs.from_value(params)))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                "patch_size", "pixel_shuffle_ratio", "vision_output_dim", "projector_input_dim",
                "projector_output_dim"):
        assert getattr(again, key) == getattr(hf, key), key


@pytest.mark.parametrize("change, says", [
    ({"intermediate_size": 4096}, "intermediate_size=4096 is not hidden_size / pixel_shuffle_ratio"),
    ({"projector_output_dim": 2048}, "differ"),
    ({"hidden_act": "silu"}, "hidden_act='silu'"),
    ({"multi_modal_projector_bias": True}, "bias"),
])
def test_vision_configs_meta_has_no_equivalent_for_are_named(change, says):
    from llama.convert.config import llama4_vision_config_to_params

    with pytest.raises(ValueError, match=says):
        llama4_vision_config_to_params({"hidden_size": 1408, "image_size": 336, **change})


TINY = dict(dim=64, n_layers=1, n_heads=4, vocab_size=100,
            vision_args={**SCOUT_VISION, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "dim": 32, "n_heads": 4,
                         "n_layers": 2, "output_dim": 48})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_table_matches_the_encoder(world):
    """Every tensor of the encoder has an entry in the shard table, and the table's slice is what
    the model's layers hold on rank 0 of ``world``; the text model's tensors are unchanged by it."""
    import fairscale.nn.model_parallel.initialize as fs_init

    args = ModelArgs(**TINY)
    shapes = full_shapes(args)
    distributed.init_model_parallel(torch.device("cpu"))
    real = fs_init.get_model_parallel_world_size
    fs_init.get_model_parallel_world_size = lambda: world
    try:
        with torch.device("meta"):
            model = Transformer(args)
            text = Transformer(ModelArgs(**{**TINY, "vision_args": None}))
    finally:
        fs_init.get_model_parallel_world_size = real
    state = model.state_dict()
    assert set(state) == set(shapes)
    for name, t in state.items():
        region = holder_region(name, shapes[name], world, 0, "vocab", args.head_dim)
        assert tuple(t.shape) == tuple(e - s for s, e in region), name
    vision = {name for name in state if name.startswith("vision")}
    assert {shard_key(name) for name in vision} == set(VISION_SHARD_AXES)
    assert {k: v.shape for k, v in state.items() if k not in vision} == {k: v.shape for k, v in
                                                                          text.state_dict().items()}


# -- against transformers, through hf_to_meta and Llama.build -------------------------------


@pytest.mark.slow
def test_params_json_carries_the_vision_args(converted):
    _, _, meta, llama = converted
    params = json.loads((meta / "params.json").read_text())
    assert params["vision_args"] == {"image_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                     "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE}, "dim": 32,
                                     "n_layers": 2, "n_heads": 4, "mlp_ratio": 4.0, "output_dim": 48,
                                     "pixel_shuffle_ratio": 0.5}
    assert llama.model.takes_images and llama.model.params.vision_args.patches_per_tile == PATCHES


@pytest.mark.slow
@pytest.mark.parametrize("n_tiles", [1, 5])
def test_features_are_transformers_vision_tower_and_projector(converted, n_tiles):
    hf, _, _, llama = converted
    tiles = pixels(n_tiles, seed=n_tiles)
    ours = llama.model.encode_images(tiles)
    theirs = hf_features(hf, tiles)
    assert ours.shape == theirs.shape == (n_tiles, PATCHES, 64) and ours.dtype == torch.float32
    assert helpers.rel_err(ours, theirs) < TOL
    # tiles are encoded independently: a tile's features do not depend on the others
    assert helpers.rel_err(llama.model.encode_images(tiles[-1:])[0], ours[-1]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("images", [[1], [5], [1, 5]], ids=["one-tile", "five-tiles", "two-images"])
def test_logits_with_images_are_transformers(converted, images):
    """The prompt's <|patch|> positions filled with the encoder's features give transformers'
    Llama4ForConditionalGeneration logits (it encodes pixel_values itself), and its greedy token."""
    hf, _, _, llama = converted
    tiles = torch.cat([pixels(n, seed=10 + i) for i, n in enumerate(images)])
    tokens = prompt_with_images(images, PATCHES, seed=len(images))
    assert int((tokens == IMAGE_TOKEN).sum()) == len(tiles) * PATCHES
    with torch.no_grad():
        theirs = hf(input_ids=tokens, pixel_values=tiles).logits
    features = llama.model.encode_images(tiles)
    ours = llama.model.forward(tokens, 0, image_features=features, image_positions=tokens == IMAGE_TOKEN)
    assert helpers.rel_err(ours, theirs) < TOL
    assert torch.equal(ours[0, -1].argmax(), theirs[0, -1].argmax())
    # ... and the images made a difference (the features are not ignored)
    assert helpers.rel_err(llama.model.forward(tokens, 0), theirs) > 100 * TOL


@pytest.mark.slow
def test_hugging_face_folder_loads_with_its_encoder(converted):
    """Llama.build on transformers' folder itself (no conversion written) builds the encoder too."""
    hf, src, _, _ = converted
    direct = Llama.build(src, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32")
    tiles = pixels(5, seed=6)
    assert helpers.rel_err(direct.model.encode_images(tiles), hf_features(hf, tiles)) < TOL


@pytest.mark.slow
def test_meta_to_hf_gives_transformers_its_tensors_back(converted, tmp_path):
    hf, src, meta, _ = converted
    meta_to_hf(meta, tmp_path / "hf2")
    config = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert config["architectures"] == ["Llama4ForConditionalGeneration"]
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(before) == set(after)
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    again = transformers.Llama4ForConditionalGeneration.from_pretrained(
        tmp_path / "hf2", dtype=torch.float32, attn_implementation="eager").eval()
    # the image token's id comes from the tokenizer's <|patch|>: the tiny test tokenizer has none
    assert config["image_token_index"] == 200092 and again.config.image_token_index == 200092
    again.config.image_token_index = IMAGE_TOKEN
    tiles, tokens = pixels(5, seed=3), prompt_with_images([5], PATCHES)
    with torch.no_grad():
        assert torch.equal(again(input_ids=tokens, pixel_values=tiles).logits,
                           hf(input_ids=tokens, pixel_values=tiles).logits)


@pytest.mark.slow
def test_without_vision_the_text_model_is_unchanged(converted):
    hf, _, meta, llama = converted
    text = Llama.build(meta, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32", vision=False)
    assert not text.model.takes_images and text.model.vision_embeddings is None
    assert not any(name.startswith("vision") for name in text.model.state_dict())
    tokens = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(7))
    logits = text.model.forward(tokens, 0)
    assert torch.equal(logits, llama.model.forward(tokens, 0))
    with torch.no_grad():
        assert helpers.rel_err(logits, hf(input_ids=tokens).logits) < TOL
    with pytest.raises(ValueError, match="takes no images"):
        text.model.encode_images(pixels(1))
    # The memory check counts the encoder's weights: transformers' vision tower and projector, in float32.
    encoder = sum(p.numel() for m in (hf.vision_model, hf.multi_modal_projector) for p in m.parameters())
    need = [memory_need(m.model, torch.float32, world_size=1).weights for m in (llama, text)]
    assert need[0] - need[1] == 4 * encoder


@pytest.mark.slow
def test_quantised_text_model_keeps_the_encoder_in_its_dtype(converted):
    """int8 quantises the text model's linear layers while loading; the encoder's stay as read."""
    _, _, meta, llama = converted
    quantised = Llama.build(meta, max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32", quantize="int8")
    tiles = pixels(2, seed=9)
    assert torch.equal(quantised.model.encode_images(tiles), llama.model.encode_images(tiles))
    assert type(quantised.model.layers[0].attention.wq).__name__ == "Int8ColumnParallelLinear"
    assert quantised.model.vision_projection.weight.dtype == torch.float32


@pytest.mark.slow
def test_meta_reference_encoder_gives_the_same_features(converted):
    """llama-models' own VisionEmbeddings (fairscale, one process; its KV caches kept on the CPU)
    with our model's encoder weights, loaded strictly under Meta's names."""
    from llama_models.llama4.args import VisionArgs as RefVisionArgs
    from llama_models.llama4.vision.embedding import VisionEmbeddings as RefEmbeddings

    import llama4_helpers

    _, _, meta, llama = converted
    params = json.loads((meta / "params.json").read_text())["vision_args"]
    with llama4_helpers.reference_on_cpu():
        ref = RefEmbeddings(RefVisionArgs(**params))
    ref = ref.float().eval()  # Meta's constructor makes its encoder bfloat16: float32 before loading
    ref.load_state_dict(llama.model.vision_embeddings.state_dict(), strict=True)
    tiles = pixels(5, seed=4)
    with torch.no_grad():
        encoded = ref.vision_adapter(ref.vision_encoder(tiles.unsqueeze(1)))
        theirs = torch.nn.functional.linear(encoded, llama.model.vision_projection.weight)
    assert helpers.rel_err(llama.model.encode_images(tiles), theirs) < TOL


@pytest.mark.slow
def test_image_features_must_match_their_positions(converted):
    _, _, _, llama = converted
    tokens = prompt_with_images([1], PATCHES)
    features = llama.model.encode_images(pixels(1))
    with pytest.raises(ValueError, match="16 image features for 15 image positions"):
        mask = tokens == IMAGE_TOKEN
        mask[0, mask[0].nonzero()[0]] = False
        llama.model.forward(tokens, 0, image_features=features, image_positions=mask)
    with pytest.raises(ValueError, match="together"):
        llama.model.forward(tokens, 0, image_features=features)
    with pytest.raises(ValueError, match=r"pixel_values must have shape \[n_tiles, 3, 56, 56\]"):
        llama.model.encode_images(torch.zeros(1, 3, 336, 336))


@pytest.mark.slow
def test_two_ranks_equal_one(converted, tmp_path):
    """The checkpoint written in 2 shards, loaded on 2 processes (gloo): the encoder split over them
    (2 of its 4 heads each) gives one process's features and logits; loaded on one, the same
    features as the 1-shard checkpoint."""
    _, src, _, llama = converted
    hf_to_meta(src, tmp_path / "meta2", model_parallel_size=2)
    out = tmp_path / "out"
    out.mkdir()
    result = helpers.torchrun(helpers.REPO / "tests" / "vision_mp_worker.py",
                              [str(tmp_path / "meta2"), str(src / "tokenizer.model"), str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    tiles = pixels(5, seed=1)
    features = llama.model.encode_images(tiles)
    tokens = prompt_with_images([5], PATCHES)
    logits = llama.model.forward(tokens, 0, image_features=features, image_positions=tokens == IMAGE_TOKEN)
    # the 2 shards read back whole by one process are the 1-shard checkpoint's weights, bit for bit
    one = Llama.build(tmp_path / "meta2", max_seq_len=128, max_batch_size=2, device="cpu", dtype="float32")
    assert torch.equal(one.model.encode_images(tiles), features)
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert got["local_heads"] == 2
        assert helpers.rel_err(got["features"], features) < 1e-5
        assert helpers.rel_err(got["logits"], logits) < 1e-5


@pytest.mark.slow
def test_a_model_with_an_encoder_and_llama4s_tokenizer_lays_out_images(converted):
    """The build gives a model with an encoder a chat format that lays out image tokens, when its
    tokenizer is Llama 4's (this fixture's is a tiny tiktoken one: its format stays text-only): one
    tile's PATCHES <|patch|> positions.  (This model's 556 ids cannot embed Llama 4's token ids, so
    its engine refuses the prompt for them; tests/test_engine_images.py answers chat turns with
    images on a model of Llama 4's vocabulary.)"""
    import llama_models
    from PIL import Image

    from llama.engine.build import assemble_engine
    from llama.tokenizer import load_tokenizer

    _, _, _, llama = converted
    assert llama.formatter.image_layout is None  # the tiny tiktoken tokenizer: no image tokens
    tokenizer = load_tokenizer(Path(llama_models.__file__).parent / "llama4" / "tokenizer.model")
    with_images = Llama._holding(assemble_engine(llama.model, tokenizer))
    layout = with_images.formatter.image_layout
    assert layout is not None and layout.patches_per_tile == PATCHES
    picture = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 30, 30))
    dialog = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "What?"}]}]
    encoded = with_images.formatter.encode_dialog(dialog)
    (image,) = encoded.images
    patch = tokenizer.special_tokens["<|patch|>"]
    assert [encoded.tokens[p] for p in image.patch_positions] == [patch] * PATCHES
    with pytest.raises(ValueError, match="token ids outside"):
        with_images.chat_completion([dialog], max_gen_len=4)
