"""Llama 3.2 Vision's image encoder (11B- and 90B-Vision), as Meta's reference builds it
(llama-models' ``llama3/multimodal/model.py``: ``CrossAttentionTransformerVision``), tensor-parallel
the same way.  The text model's cross-attention layers that attend to its output are in
:mod:`llama.model` (:class:`~llama.model.CrossAttention`, beside ``Attention``).

An image arrives as ``max_num_chunks`` tiles ``[3, S, S]`` (S = ``vision_chunk_size``; the image's
own ``a * b`` tiles first, row-major over its canvas of ``a`` x ``b`` tiles, then zero tiles) and an
aspect-ratio id: the 1-based index of its canvas ``(a, b)`` in :func:`supported_aspect_ratios`
(0: no image), as Hugging Face's ``aspect_ratio_ids``.  Per tile: the P x P patches (P =
``patch_size``) are projected to width ``dim``; a learnt per-tile embedding of the tile's place
on the canvas is added (tanh-gated, "pre-tile"); a class token is put *first*; a position
embedding is added: ``(1 - tanh(gate))`` times one shared by all tiles plus ``tanh(gate)`` times
one learnt per place on the canvas; layer norm.  Each tile's ``grid**2 + 1`` tokens are padded
with zeros to a multiple of 8, and one ViT runs over all of an image's tiles at once, where a
token may attend to every token except that padding tokens (of padded places or of tiles past the
image's own) do not attend to each other (Meta's mask: real tokens do see padding).  Meta runs
every tile slot; here only the image's real tiles and one padding tile that stands for the rest
(:meth:`MllamaVisionEncoder.forward`), the same features over the real tiles at a fraction of
the cost for small images (2 tiles run of 4 for a 1-tile image).  The inputs of
the blocks ``intermediate_layers`` are kept.  Then layer norm, a second tile embedding
("post-tile"), and the gated global transformer (``n_global_layers`` blocks, each residual branch
scaled by ``tanh`` of its gate) with the same mask; padding tokens are dropped and the kept
intermediate features concatenated after the final ones (feature ``d * K + k`` of the
intermediate part is layer k's channel d, Meta's ``stack(dim=-1)``).  ``vision_projection``
(with bias) takes that ``dim * (K + 1)`` width to the text model's.

Parameter names are Meta's checkpoint keys under ``vision_model.`` (``vision_encoder.conv1._linear``,
``vision_encoder.transformer.resblocks.N.attn.wq`` ..., ``vision_projection``).  The split over
ranks is Meta's: the patch projection, q/k/v, the MLPs' first layers and the projection
column-parallel; attention's output and the MLPs' second layers row-parallel (their bias whole on
every rank, added after the sum); embeddings, norms and gates replicated.  Every rank computes all
of an image's features.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from llama.args import MllamaVisionArgs, ModelArgs
from llama.layers.parallel import split_size
from llama.vision import LayerNorm, PatchEmbedding, VisionColumnParallelLinear, VisionMLP, VisionRowParallelLinear

__all__ = ["supported_aspect_ratios", "tile_counts", "MllamaVisionEncoder", "MllamaVisionModel"]


@lru_cache(maxsize=None)
def supported_aspect_ratios(max_num_chunks: int) -> tuple[tuple[int, int], ...]:
    """The canvases ``(a, b)`` of at most ``max_num_chunks`` tiles, in the order whose 1-based
    index is an aspect-ratio id (Hugging Face's ``get_all_supported_aspect_ratios``; for 4:
    (1,1), (1,2), (1,3), (1,4), (2,1), (2,2), (3,1), (4,1)).  A tile table is indexed
    ``[:a, :b]`` (Meta's ``embed[:h, :w]`` with ``(h, w)`` the ratio its transform returns)."""
    return tuple((a, b) for a in range(1, max_num_chunks + 1) for b in range(1, max_num_chunks + 1)
                 if a * b <= max_num_chunks)


def _check_ratio_ids(aspect_ratio_ids: torch.Tensor, max_num_chunks: int) -> None:
    n = len(supported_aspect_ratios(max_num_chunks))
    if aspect_ratio_ids.dtype.is_floating_point or aspect_ratio_ids.dtype == torch.bool:
        raise ValueError(f"aspect_ratio_ids must be integers, got {aspect_ratio_ids.dtype}")
    if aspect_ratio_ids.numel() and (int(aspect_ratio_ids.min()) < 0 or int(aspect_ratio_ids.max()) > n):
        raise ValueError(f"aspect_ratio_ids must lie in 0..{n} (0: no image; i: the i-th canvas of "
                         f"{list(supported_aspect_ratios(max_num_chunks))}), got {aspect_ratio_ids.tolist()}")


def tile_counts(aspect_ratio_ids: torch.Tensor, max_num_chunks: int) -> torch.Tensor:
    """The number of real tiles of each image (``a * b`` of its canvas; 0 for id 0), the ids' shape."""
    _check_ratio_ids(aspect_ratio_ids, max_num_chunks)
    counts = torch.tensor([0] + [a * b for a, b in supported_aspect_ratios(max_num_chunks)],
                          device=aspect_ratio_ids.device)
    return counts[aspect_ratio_ids.long()]


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _canvas_table(table: torch.Tensor, ratios: list[tuple[int, int]], max_num_chunks: int) -> torch.Tensor:
    """Per image, the rows of a per-place ``table`` [T, T, n, dim] its canvas (a, b) uses,
    ``table[:a, :b]`` row-major, zero for the tiles past its a * b: [M, max_num_chunks, n, dim]."""
    out = table.new_zeros(len(ratios), max_num_chunks, *table.shape[2:])
    for i, (a, b) in enumerate(ratios):
        if a:
            out[i, : a * b] = table[:a, :b].reshape(a * b, *table.shape[2:])
    return out


class TilePositionEmbedding(nn.Module):
    """A learnt vector per place of a canvas of at most T x T tiles, added to all of a tile's
    tokens, scaled by ``tanh(gate)`` (Meta's gated ``TilePositionEmbedding``)."""

    def __init__(self, max_num_chunks: int, dim: int) -> None:
        super().__init__()
        self.embedding = _parameter(max_num_chunks, max_num_chunks, 1, dim)
        self.gate = _parameter(1)

    def forward(self, x: torch.Tensor, ratios: list[tuple[int, int]]) -> torch.Tensor:
        """x [M, chunks, tokens, dim]."""
        embed = _canvas_table(self.embedding, ratios, x.shape[1]).to(x.dtype)
        return x + embed * self.gate.tanh().to(x.dtype)


class ImageAttention(nn.Module):
    """Multi-head attention without biases over an image's tokens; heads split over ranks."""

    def __init__(self, args: MllamaVisionArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.n_local_heads = split_size(args.n_heads, "vision attention heads")
        self.wq = VisionColumnParallelLinear(args.dim, args.dim, bias=False, gather_output=False)
        self.wk = VisionColumnParallelLinear(args.dim, args.dim, bias=False, gather_output=False)
        self.wv = VisionColumnParallelLinear(args.dim, args.dim, bias=False, gather_output=False)
        self.wo = VisionRowParallelLinear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [M, L, dim]; mask [M, 1, L, L], True where a token may attend."""
        m, length, _ = x.shape
        q, k, v = (w(x).view(m, length, self.n_local_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # [M, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(m, length, -1))


class ImageTransformerBlock(nn.Module):
    """A pre-norm ViT block; ``gated``: each residual branch scaled by ``tanh`` of its gate
    (the global transformer's)."""

    def __init__(self, args: MllamaVisionArgs, gated: bool) -> None:
        super().__init__()
        self.attn = ImageAttention(args)
        self.ln_1 = LayerNorm(args.dim)
        self.mlp = VisionMLP(args.dim, args.hidden_dim)  # Llama 4's: the same c_fc/c_proj keys
        self.ln_2 = LayerNorm(args.dim)
        self.gated = gated
        if gated:
            self.gate_attn = _parameter(1)
            self.gate_ffn = _parameter(1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            x = x + self.attn(self.ln_1(x), mask)
            return x + self.mlp(self.ln_2(x))
        x = x + self.gate_attn.tanh().to(x.dtype) * self.attn(self.ln_1(x), mask)
        return x + self.gate_ffn.tanh().to(x.dtype) * self.mlp(self.ln_2(x))


class ImageTransformer(nn.Module):
    def __init__(self, args: MllamaVisionArgs, n_layers: int, gated: bool) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(ImageTransformerBlock(args, gated) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                keep: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The output, and the inputs of the blocks ``keep`` (Meta's ``return_intermediate``)."""
        kept = []
        for i, block in enumerate(self.resblocks):
            if i in keep:
                kept.append(x)
            x = block(x, mask)
        return x, kept


class MllamaVisionEncoder(nn.Module):
    """Images (their tiles [M, chunks, 3, S, S] and canvases) in, features
    [M, chunks, grid**2 + 1, dim * (K + 1)] out (see the module's docstring)."""

    def __init__(self, args: MllamaVisionArgs, chunk_size: int, max_num_chunks: int) -> None:
        super().__init__()
        self.args = args
        self.chunk_size, self.max_num_chunks = chunk_size, max_num_chunks
        self.grid = chunk_size // args.patch_size
        n_tokens = self.grid**2 + 1  # the patches and the class token
        self.conv1 = PatchEmbedding(args)  # type: ignore[arg-type]  # reads patch_size and dim only
        self.class_embedding = _parameter(args.dim)
        self.positional_embedding = _parameter(n_tokens, args.dim)
        self.gated_positional_embedding = _parameter(max_num_chunks, max_num_chunks, n_tokens, args.dim)
        self.gated_positional_embedding_gate = _parameter(1)
        self.ln_pre = LayerNorm(args.dim)
        self.ln_post = LayerNorm(args.dim)
        self.transformer = ImageTransformer(args, args.n_layers, gated=False)
        self.global_transformer = ImageTransformer(args, args.n_global_layers, gated=True)
        self.pre_tile_pos_embed = TilePositionEmbedding(max_num_chunks, args.dim)
        self.post_tile_pos_embed = TilePositionEmbedding(max_num_chunks, args.dim)

    def _mask(self, n_tiles: list[int], width: int, padded_len: int, device: torch.device,
              dtype: torch.dtype) -> torch.Tensor:
        """[M, 1, W*L, W*L] additive attention bias over the ``width`` tiles run (see :meth:`forward`):
        Meta's rule, all pairs but padding to padding (padding: the tokens past each tile's
        ``grid**2 + 1`` and every token of the tiles past the image's), where tile ``n`` (the first
        padding tile) stands for all ``max_num_chunks - n`` padding tiles: its tokens are keys
        weighted by that count (``+ log(count)``), and the tiles past it are no keys at all."""
        n = torch.tensor(n_tiles, device=device)[:, None, None]  # [M, 1, 1]
        chunks = torch.arange(width, device=device)[None, :, None]
        tokens = torch.arange(padded_len, device=device)[None, None, :]
        pad = ((chunks >= n) | (tokens >= self.grid**2 + 1)).reshape(n.shape[0], -1)  # [M, W*L]
        count = torch.where(chunks < n, 1, torch.where(chunks == n, self.max_num_chunks - n, 0))
        count = count.expand(-1, -1, padded_len).reshape(n.shape[0], -1).to(torch.float32)  # [M, W*L]
        allowed = ~(pad[:, :, None] & pad[:, None, :]) & (count[:, None, :] > 0)
        bias = torch.where(allowed, count.log()[:, None, :], torch.tensor(float("-inf"), device=device))
        return bias.to(dtype).unsqueeze(1)

    def forward(self, images: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """Features [M, chunks, grid**2 + 1, dim * (K + 1)]: each image's real tiles', zeros past them.

        Only an image's real tiles and one padding tile are run (Meta and Hugging Face run every
        tile slot).  That gives Meta's features over the real tiles: the padding tiles of an image
        are identical (zero pixels, zero tile embeddings) and attend to the same real tokens, so
        they stay identical through every block, and a real token's attention over ``k`` equal
        keys is its attention over one of them with its score raised by ``log(k)`` (:meth:`_mask`).
        The tiles past an image's are read as the zeros preprocessing gives them."""
        m, chunks = images.shape[:2]
        ratios = [(0, 0) if int(i) == 0 else supported_aspect_ratios(self.max_num_chunks)[int(i) - 1]
                  for i in aspect_ratio_ids.tolist()]
        n_tiles = [a * b for a, b in ratios]
        width = max((min(n + 1, chunks) for n in n_tiles), default=0)  # real tiles and the stand-in
        dtype = self.class_embedding.dtype

        pixels = images[:, :width].to(dtype)
        x = self.conv1(pixels.reshape(m * width, *images.shape[2:]))  # [M*W, grid**2, dim]
        x = x.view(m, width, -1, x.shape[-1])
        x = self.pre_tile_pos_embed(x, ratios)
        cls = self.class_embedding.expand(m, width, 1, -1)
        x = torch.cat([cls, x], dim=2)  # [M, W, T, dim], T = grid**2 + 1: the class token first
        gate = self.gated_positional_embedding_gate.tanh()
        x = x + self.positional_embedding * (1 - gate)
        x = x + _canvas_table(self.gated_positional_embedding, ratios, width) * gate
        x = self.ln_pre(x)

        n_tokens = x.shape[2]
        n_pad = -n_tokens % 8
        x = F.pad(x, (0, 0, 0, n_pad))  # [M, W, L, dim], L a multiple of 8
        length = n_tokens + n_pad
        mask = self._mask(n_tiles, width, length, x.device, x.dtype)
        x, kept = self.transformer(x.view(m, width * length, -1), mask, self.args.intermediate_layers)
        x = self.ln_post(x)
        x = self.post_tile_pos_embed(x.view(m, width, length, -1), ratios)
        x, _ = self.global_transformer(x.view(m, width * length, -1), mask)

        x = x.view(m, width, length, -1)[:, :, :n_tokens]
        intermediate = torch.stack(kept, dim=-1).view(m, width, length, -1)[:, :, :n_tokens]
        features = torch.cat([x, intermediate], dim=-1)
        out = features.new_zeros(m, chunks, n_tokens, features.shape[-1])
        for i, n in enumerate(n_tiles):
            out[i, :n] = features[i, :n]
        return out


class MllamaVisionModel(nn.Module):
    """The encoder and its projection to the text width (Meta's ``vision_model``): tiles
    [M, chunks, 3, S, S] and aspect-ratio ids [M] in, vision tokens [M, chunks, grid**2 + 1, text dim]
    out, in the encoder's dtype."""

    def __init__(self, params: ModelArgs) -> None:
        super().__init__()
        args = params.mllama_vision_args
        if args is None:
            raise ValueError("params: a Llama 3.2 Vision encoder needs vision_chunk_size > 0")
        self.chunk_size, self.max_num_chunks = params.vision_chunk_size, params.vision_max_num_chunks
        self.vision_encoder = MllamaVisionEncoder(args, params.vision_chunk_size, params.vision_max_num_chunks)
        self.vision_projection = VisionColumnParallelLinear(args.output_dim, params.dim, bias=True,
                                                            gather_output=True)

    def check_pixels(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> None:
        """ValueError for what is not a batch of images this encoder takes."""
        c, s = self.max_num_chunks, self.chunk_size
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise ValueError("pixel_values must be a floating-point tensor [images, max_num_chunks, 3, S, S] "
                             "(Llama 3.2 Vision's preprocessing gives one per image)")
        if pixel_values.dim() != 5 or tuple(pixel_values.shape[1:]) != (c, 3, s, s):
            raise ValueError(f"pixel_values must have shape [images, {c}, 3, {s}, {s}] (vision_max_num_chunks tiles "
                             f"of vision_chunk_size pixels), got {list(pixel_values.shape)}")
        if not isinstance(aspect_ratio_ids, torch.Tensor) or tuple(aspect_ratio_ids.shape) != pixel_values.shape[:1]:
            raise ValueError(f"aspect_ratio_ids must be a tensor of one id per image ({pixel_values.shape[0]}), "
                             f"got {aspect_ratio_ids!r}")
        _check_ratio_ids(aspect_ratio_ids, c)

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """Vision tokens [M, chunks, grid**2 + 1, text dim] of each image's real tiles, zeros past
        them (padding tiles are never attended; neither encoded nor projected)."""
        self.check_pixels(pixel_values, aspect_ratio_ids)
        n_tiles = tile_counts(aspect_ratio_ids, self.max_num_chunks).to(pixel_values.device)
        width = int(n_tiles.max()) if n_tiles.numel() else 0
        features = self.vision_encoder(pixel_values, aspect_ratio_ids)[:, :width]
        projected = self.vision_projection(features)
        out = projected.new_zeros(features.shape[0], self.max_num_chunks, features.shape[2], projected.shape[-1])
        real = torch.arange(width, device=out.device)[None, :] < n_tiles[:, None]  # [M, W]
        out[:, :width] = projected * real[:, :, None, None].to(projected.dtype)
        return out
