"""Llama 4's image encoder, as Meta's reference builds it (llama-models' ``llama4/vision/encoder.py``
and ``embedding.py``), tensor-parallel the same way.

A tile ``[3, S, S]`` (S = ``image_size``, normalised pixels) is cut into ``(S / P)**2`` patches of
P x P pixels (``patch_size``), each flattened and projected to width ``dim``; a class token is
appended *after* the patches, a learnt positional embedding added, and ``n_layers`` pre-norm ViT
blocks run over the tile (bidirectional attention, biases, GELU MLPs), each attention turning
queries and keys by a 2-D rotary embedding: of a head's ``D / 2`` complex pairs, the first half
turn with the patch's column (x + 1), the second half with its row (y + 1); the class token is
not turned.  After a final layer norm the class token is dropped, the pixel shuffle merges
each 2 x 2 neighbourhood of patches into one feature of 4x the width (ratio 0.5), and an MLP
adapter (two bias-free layers, GELU after each) takes it to ``output_dim``; the text model's
``vision_projection`` then takes it to the text width.  One tile gives
``(S / P * ratio)**2`` features (144 for Scout and Maverick), in row-major order of the
shuffled grid: the order of the tile's ``<|patch|>`` tokens.

Parameter names are Meta's checkpoint keys (``vision_embeddings.vision_encoder.conv1._linear``,
``...transformer.resblocks.N.attn.wq`` ...), under :class:`VisionEmbeddings`, which the text
model holds as ``vision_embeddings`` beside ``vision_projection``.  The split over ranks is
Meta's: the patch projection, q/k/v, the MLPs' first layers and ``vision_projection`` are
column-parallel (split outputs), attention's output and the MLPs' second layers row-parallel
(split inputs, summed over ranks, then the bias, which every rank holds whole); norms,
embeddings and those biases are replicated.  Every rank computes every tile's features.

The linear layers here subclass fairscale's (``isinstance`` holds) but not this library's
:class:`~llama.layers.parallel.ParallelLinear`: quantisation and CPU weight packing, which
swap those, leave the encoder in its dtype (it runs once per image, at prefill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel import layers as fs_layers
from torch import nn

from llama.args import VisionArgs
from llama.layers.collectives import enter_parallel_region, gather_last_dim, sum_over_ranks
from llama.layers.parallel import split_size

__all__ = ["VisionColumnParallelLinear", "VisionRowParallelLinear", "VisionEncoder", "PixelShuffleMLP",
           "VisionEmbeddings", "vision_freqs_cis", "pixel_shuffle"]


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class VisionColumnParallelLinear(fs_layers.ColumnParallelLinear):
    """fairscale's ColumnParallelLinear (output features split over ranks, the bias with them),
    holding only this rank's slice, allocated on the current default device."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, gather_output: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.world_size = fs_init.get_model_parallel_world_size()
        self.gather_output = gather_output
        self.output_size_per_partition = split_size(out_features, "vision output features")
        self.weight = _parameter(self.output_size_per_partition, in_features)
        if bias:
            self.bias = _parameter(self.output_size_per_partition)
        else:
            self.register_parameter("bias", None)
        self.master_weight = None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = F.linear(enter_parallel_region(input_), self.weight, self.bias)
        return gather_last_dim(out) if self.gather_output else out


class VisionRowParallelLinear(fs_layers.RowParallelLinear):
    """fairscale's RowParallelLinear (input features split over ranks, partial products summed;
    the bias, whole on every rank, added once after the sum), holding this rank's slice."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.world_size = fs_init.get_model_parallel_world_size()
        self.input_is_parallel = True
        self.input_size_per_partition = split_size(in_features, "vision input features")
        self.weight = _parameter(out_features, self.input_size_per_partition)
        if bias:
            self.bias = _parameter(out_features)
        else:
            self.register_parameter("bias", None)
        self.master_weight = None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = sum_over_ranks(F.linear(input_, self.weight))
        return out if self.bias is None else out + self.bias


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (eps 1e-5, Meta's), its weights loaded rather than initialised."""

    def __init__(self, dim: int) -> None:
        nn.Module.__init__(self)
        self.normalized_shape = (dim,)
        self.eps = 1e-5
        self.elementwise_affine = True
        self.weight = _parameter(dim)
        self.bias = _parameter(dim)


def vision_freqs_cis(args: VisionArgs, theta: float = 10000.0, device=None) -> torch.Tensor:
    """The 2-D rotations of one tile's tokens, complex64 ``(grid**2 + 1, head_dim // 2)``: the
    patches in row-major order, then the class token (no rotation).  Pair k < head_dim / 4 turns
    by ``(x + 1) * f_k``, pair head_dim / 4 + k by ``(y + 1) * f_k``, with x, y the patch's column
    and row and ``f_k = theta ** (-4k / head_dim)`` (Meta's frequencies of a quarter head)."""
    quarter = args.head_dim // 4
    freqs = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2, device=device)[:quarter].float() / (2 * quarter)))
    index = torch.arange(args.grid**2, device=device)
    x, y = (index % args.grid + 1).float(), (index // args.grid + 1).float()
    angles = torch.cat([torch.outer(x, freqs), torch.outer(y, freqs)], dim=-1)  # (grid**2, head_dim / 2)
    angles = torch.cat([angles, angles.new_zeros(1, angles.shape[1])])  # the class token: not turned
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (N, T, H, D) turned by ``freqs_cis`` (T, D/2): pairs (0,1), (2,3) ... as complex numbers."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs_cis[:, None, :]).flatten(3).type_as(x)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's tokens, with biases; heads split over ranks."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_local_heads = split_size(args.n_heads, "vision attention heads")
        self.wq = VisionColumnParallelLinear(args.dim, args.dim, bias=True, gather_output=False)
        self.wk = VisionColumnParallelLinear(args.dim, args.dim, bias=True, gather_output=False)
        self.wv = VisionColumnParallelLinear(args.dim, args.dim, bias=True, gather_output=False)
        self.wo = VisionRowParallelLinear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = (w(x).view(n, t, self.n_local_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(n, t, -1))


class VisionMLP(nn.Module):
    """``c_proj(gelu(c_fc x))`` with biases; the hidden units split over ranks."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.c_fc = VisionColumnParallelLinear(dim, hidden_dim, bias=True, gather_output=False)
        self.c_proj = VisionRowParallelLinear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class VisionBlock(nn.Module):
    """A pre-norm ViT block (Meta's ``_TransformerBlock``, ungated)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.attn = VisionAttention(args)
        self.ln_1 = LayerNorm(args.dim)
        self.mlp = VisionMLP(args.dim, args.hidden_dim)
        self.ln_2 = LayerNorm(args.dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), freqs_cis)
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(VisionBlock(args) for _ in range(args.n_layers))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, freqs_cis)
        return x


class PatchEmbedding(nn.Module):
    """Meta's ``ColumnParallelConv2dPatch``: each P x P patch (channels, then rows, then columns:
    ``torch.nn.Unfold``'s order) projected by a column-parallel linear layer, gathered."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self._unfold = nn.Unfold(kernel_size=args.patch_size, stride=args.patch_size)
        self._linear = VisionColumnParallelLinear(3 * args.patch_size**2, args.dim, bias=False, gather_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self._unfold(x).permute(0, 2, 1))  # (N, patches, dim)


class VisionEncoder(nn.Module):
    """The ViT: tiles ``(N, 3, S, S)`` in, ``(N, grid**2, dim)`` out (class token dropped)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.conv1 = PatchEmbedding(args)
        self.class_embedding = _parameter(args.dim)
        self.positional_embedding_vlm = _parameter(args.grid**2 + 1, args.dim)
        self.ln_pre = LayerNorm(args.dim)
        self.ln_post = LayerNorm(args.dim)
        self.transformer = VisionTransformer(args)
        self.freqs_cis: torch.Tensor
        if self.class_embedding.is_meta:  # only its shape is needed until setup_rope
            freqs = torch.empty(args.grid**2 + 1, args.head_dim // 2, dtype=torch.complex64)
        else:
            freqs = vision_freqs_cis(args, device=self.class_embedding.device)
        self.register_buffer("freqs_cis", freqs, persistent=False)

    def setup_rope(self, device: torch.device) -> None:
        """Compute the rotations on ``device`` (after loading into a meta-built encoder)."""
        self.freqs_cis = vision_freqs_cis(self.args, device=device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv1(images)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)
        x = self.transformer(self.ln_pre(x), self.freqs_cis)
        return self.ln_post(x)[:, :-1]


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Meta's pixel shuffle of patches ``(N, g*g, C)`` into ``(N, (g*r)**2, C / r**2)``: with r = 0.5,
    each 2 x 2 neighbourhood of patches becomes one feature, its channels those of the patches
    (row-major over the shuffled grid).  Exactly llama-models' ``pixel_shuffle_op`` (whose
    axis names swap rows and columns twice, which cancels)."""
    n, tokens, c = x.shape
    g = int(round(tokens**0.5))
    h = int(g * ratio)
    x = x.reshape(n, g, h, int(c / ratio))
    x = x.permute(0, 2, 1, 3).reshape(n, h, h, int(c / ratio**2))
    return x.permute(0, 2, 1, 3).reshape(n, h * h, -1)


class _AdapterMLP(nn.Module):
    """Meta's ``SimpleMLP`` without biases: ``gelu(c_proj(gelu(c_fc x)))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.c_fc = VisionColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False)
        self.c_proj = VisionRowParallelLinear(hidden_dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.c_proj(F.gelu(self.c_fc(x))))


class PixelShuffleMLP(nn.Module):
    """The adapter: pixel shuffle, then the MLP to ``output_dim``."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.ratio = args.pixel_shuffle_ratio
        self.mlp = _AdapterMLP(args.adapter_dim, args.output_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(patches, self.ratio))


class VisionEmbeddings(nn.Module):
    """The encoder and its adapter: tiles ``(N, 3, S, S)`` in, ``(N, patches_per_tile, output_dim)``
    out (the text model's ``vision_projection`` comes after)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_encoder = VisionEncoder(args)
        self.vision_adapter = PixelShuffleMLP(args)

    def check_pixels(self, pixel_values: torch.Tensor) -> None:
        """ValueError for what is not a batch of tiles this encoder takes."""
        size = self.args.image_size
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise ValueError("pixel_values must be a floating-point tensor [n_tiles, 3, H, W] "
                             "(llama.images' preprocessing gives one)")
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, size, size) or pixel_values.shape[0] == 0:
            raise ValueError(f"pixel_values must have shape [n_tiles, 3, {size}, {size}] with n_tiles >= 1, "
                             f"got {list(pixel_values.shape)}")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.check_pixels(pixel_values)
        dtype = self.vision_encoder.class_embedding.dtype
        return self.vision_adapter(self.vision_encoder(pixel_values.to(dtype)))
