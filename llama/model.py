"""The Llama transformer (Llama 2, Llama 3.x and Llama 4's text model), tensor-parallel with fairscale.

Parameter names are Meta's checkpoint keys (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1`` ...), so a checkpoint shard loads with no renaming.

Shapes below: B batch rows, T tokens fed in this call, S cached positions attended to,
H query heads and Hkv key/value heads *on this rank*, D head dim.

Every forward takes ``positions`` (B, T): the absolute position of each fed token.
It decides the token's rotary angle, the KV-cache slot it is written to, and which
cached slots it may attend to (slots <= its position).  The same mechanism serves a
whole prompt (positions 0..T-1), a later chat turn fed after a cached history
(positions start_pos..start_pos+T-1), and a ragged batch where every row is at its
own position.

Llama 4's image encoder (:mod:`llama.vision`, built when ``params.vision_args`` is set) turns
image tiles into features (:meth:`Transformer.encode_images`) that take the place of the
embeddings of a prompt's ``<|patch|>`` tokens (``image_features`` / ``image_positions`` of
:meth:`Transformer.hidden_states`): images touch only prefill.

Llama 3.2 Vision (``params.vision_chunk_size`` > 0) keeps this text model and adds, before the
self-attention layers of Meta's fusion schedule, gated cross-attention blocks
(:class:`CrossAttentionTransformerBlock`, beside :class:`TransformerBlock`) that attend to the
image features of :mod:`llama.vision_mllama`; the ``<|image|>`` token (id ``vocab_size``) is one of
8 learnt rows (``learnable_embedding``) after the vocabulary.  A request's images become an
:class:`ImageContext` once (:meth:`Transformer.image_context`: each cross-attention layer's K/V
and where each image's ``<|image|>`` token sits), which every later forward of the request is
given (``cross_attention=context.inputs(positions)``).

Llama 4 adds, all decided by ``params.json``: mixture-of-experts feed-forward layers
(:class:`MoE`) interleaved with dense ones; layers without positional encoding
("NoPE", global attention, query temperature tuning) every few layers; chunked local
attention with QK norm in the RoPE layers.  Chunked attention is driven by positions
like the rest: a token at position p sees slot s when s <= p and s // C == p // C, in
a prompt, in a decoding step past a chunk boundary and in a later turn alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Literal, Optional, cast

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import initialize as fs_init
from torch import nn

from llama.args import ModelArgs
from llama.layers.attention import masked_attention
from llama.layers.kv_cache import KVCache, cache_slots, consecutive_start, context_slots
from llama.layers.lora import LoraFusedProjections, LoraRow, project
from llama.layers.moe import MoE
from llama.layers.parallel import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallel,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from llama.layers.policy import KernelPolicy
from llama.layers.quantized import FusedProjections
from llama.layers.tensor_parallel import heads_per_rank
from llama.vision import VisionColumnParallelLinear, VisionEmbeddings
from llama.vision_mllama import MllamaVisionModel, tile_counts

__all__ = [
    "ModelArgs",
    "RMSNorm",
    "precompute_freqs_cis",
    "apply_rotary_emb",
    "AttentionInputs",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "CrossAttentionInputs",
    "CrossAttention",
    "CrossAttentionTransformerBlock",
    "ImageContext",
    "Transformer",
    "EmbeddingLayout",
]

# How ``tok_embeddings`` is split over model-parallel ranks: along the embedding
# dimension (Meta's Llama 2 checkpoints) or along the vocabulary (Llama 3).
EmbeddingLayout = Literal["dim", "vocab"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 whatever the weights' dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _scale_rope_frequencies(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1 long-context scaling: divide low frequencies by the scale factor,
    keep high ones, and blend smoothly in between (by wavelength)."""
    factor = cast(float, args.rope_scaling_factor)  # set by ModelArgs.__post_init__ with use_scaled_rope
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_context_len
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = old_len / low  # wavelengths longer than this are scaled fully
    high_freq_wavelen = old_len / high  # wavelengths shorter than this are kept
    if high > low:
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
    else:  # Llama 4 Scout (high == low == 1): a hard cut, nothing to blend
        blended = freqs / factor
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float = 10000.0, args: Optional[ModelArgs] = None, device=None
) -> torch.Tensor:
    """Rotations ``e^{i * pos * freq_k}`` as complex64, shape (end, head_dim // 2).

    With ``args.use_scaled_rope`` the frequencies are scaled Llama 3.1-style.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    if args is not None and args.use_scaled_rope:
        freqs = _scale_rope_frequencies(freqs, args)
    t = torch.arange(end, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries (B, T, H, D) and keys (B, T, Hkv, D) by ``freqs_cis`` (B or 1, T, D/2),
    complex, or by its real view ``torch.view_as_real(freqs_cis)`` (B or 1, T, D/2, 2), which
    compiled forward passes give (:func:`_rotate_in_real_arithmetic`).

    Meta's convention: dimensions (0,1), (2,3), ... are the (real, imaginary) parts of
    one complex number.  (Hugging Face pairs dimension k with k + D/2 instead, which is
    why its q/k weights are stored permuted.)
    """
    if not freqs_cis.is_complex():  # its real view (B or 1, T, D/2, 2): a compiled forward pass's
        return _rotate_in_real_arithmetic(xq, freqs_cis), _rotate_in_real_arithmetic(xk, freqs_cis)
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    rot = freqs_cis.unsqueeze(2)  # (B, T, 1, D/2): the same rotation for every head
    xq_out = torch.view_as_real(xq_ * rot).flatten(3)
    xk_out = torch.view_as_real(xk_ * rot).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _rotate_in_real_arithmetic(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary_emb`'s complex product ``(a + ib)(c + is) = (ac - bs) + i(as + bc)``
    written out in float32, ``rotations`` (B or 1, T, D/2, 2) being ``freqs_cis``'s real view
    (cos, sin).  For compiled graphs: Inductor generates no code for complex tensors, so each
    complex operation would run alone, seven per layer (0.2 ms of a 150m decoding step on a
    CPU; the complex products a kernel launch each on a GPU), where these real ones fuse with
    the operations around them.  The same float32 products and sums as the complex multiply,
    so the same values up to the rounding of a fused multiply-add."""
    rotation = rotations.unsqueeze(2)  # (B, T, 1, D/2, 2): the same rotation for every head
    cos, sin = rotation[..., 0], rotation[..., 1]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


@dataclass
class AttentionInputs:
    """What every attention layer of one forward pass needs besides its input x (B, T, dim).

    ``freqs_cis`` (B or 1, T, D/2): the tokens' rotations (complex; in a compiled forward pass
    their real view, (B or 1, T, D/2, 2): see :func:`apply_rotary_emb`); ``positions`` (B, T): their
    positions (their cache slots), None without a cache (training); ``mask`` (B or 1, 1, T, S):
    True where a token of a global layer may attend to a cached slot, None when the T tokens
    are a whole context (positions 0..T-1: plain causal attention, which lets SDPA use its
    fastest kernels); ``chunked_mask``: the same for chunked (local) layers;
    ``write_slots`` (B, T): the KV-cache slots the tokens are written to; ``read_slots``
    (B, S): the slots of the S positions attended to (see :mod:`llama.layers.kv_cache`);
    ``read_start``: where those slots are one consecutive run, its first (read in place);
    ``lora_slots`` (B,) int64: each row's LoRA adapter slot (0: none; :mod:`llama.layers.lora`),
    None where the model serves no adapters."""

    freqs_cis: torch.Tensor
    positions: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    chunked_mask: Optional[torch.Tensor]
    write_slots: Optional[torch.Tensor] = None
    read_slots: Optional[torch.Tensor] = None
    read_start: Optional[int] = None
    lora_slots: Optional[torch.Tensor] = None


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale for no-RoPE layers at ``positions``: 1 up to position
    floor_scale - 2, then growing like ``attn_scale * log`` of the position, so very long
    contexts keep sharp attention (arXiv 2501.19399).  float32, positions' shape."""
    return torch.log(torch.floor((positions.float() + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0


def qk_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight, over the head dim, computed in float32 (Llama 4's QK norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Attention(nn.Module):
    """Grouped-query self-attention with a KV cache; heads are split over ranks.

    Llama 4 layers, by ``layer_id``: a no-RoPE layer skips the rotation and, with
    ``attn_temperature_tuning``, scales its queries by :func:`attention_temperature`;
    a RoPE layer of a model with ``use_qk_norm`` normalises queries and keys after the
    rotation, and with ``attention_chunk_size`` attends only within its chunk (the
    mask it is given says so; :attr:`chunk_size` tells the caller which mask).
    """

    packable_input_projections = ("wq", "wk", "wv")
    policy: KernelPolicy = KernelPolicy()  # the model's kernel policy (llama.layers.prepare)

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        world = fs_init.get_model_parallel_world_size()
        self.use_rope = not args.is_nope_layer(layer_id)
        self.use_qk_norm = args.use_qk_norm and self.use_rope
        self.norm_eps = args.norm_eps
        tuned = args.attn_temperature_tuning and not self.use_rope
        self.temperature = (args.floor_scale, args.attn_scale) if tuned else None  # query scaling of NoPE layers
        self.chunk_size = args.attention_chunk(layer_id)  # None: global attention
        self.head_dim = args.head_dim
        self.n_local_heads, self.n_local_kv_heads, self.kv_replicas = heads_per_rank(args, world)
        self.n_rep = self.n_local_heads // self.n_local_kv_heads  # query heads per K/V head
        kv_width = args.n_kv_heads * self.kv_replicas * self.head_dim

        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, gather_output=False)
        self.wk = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wv = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim)
        # wq, wk, wv multiplied as one matrix, where quantisation or packing makes them one
        # (llama.layers.quantize, llama.layers.packed).
        self.fused: Optional[FusedProjections] = None

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache: Optional[KVCache] = None) -> torch.Tensor:
        """x (B, T, dim) attending through ``inputs`` (see :class:`AttentionInputs`) to this
        layer's KV ``cache``, which it updates; ``cache=None`` reads and writes no cache."""
        freqs_cis, positions = inputs.freqs_cis, inputs.positions
        mask = inputs.chunked_mask if self.chunk_size else inputs.mask
        bsz, seqlen, _ = x.shape
        lora = inputs.lora_slots
        if self.fused is not None:  # rank-local, as wq/wk/wv's (gather_output=False)
            xq, xk, xv = self.fused(x, lora) if lora is not None and isinstance(self.fused, LoraFusedProjections) \
                else self.fused(x)
        else:
            xq, xk, xv = project(self.wq, x, lora), project(self.wk, x, lora), project(self.wv, x, lora)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if self.use_qk_norm:
            xq, xk = qk_norm(xq, self.norm_eps), qk_norm(xk, self.norm_eps)
        if self.temperature is not None:
            pos = positions if positions is not None else torch.arange(seqlen, device=x.device).unsqueeze(0)
            scale = attention_temperature(pos, *self.temperature)  # (B or 1, T)
            xq = (xq * scale[:, :, None, None]).to(xq.dtype)

        kv_len = seqlen if mask is None else mask.shape[-1]
        if cache is not None:
            cache.write(cast(torch.Tensor, inputs.write_slots), xk, xv)  # given with a cache
        if cache is None or mask is None:
            # A whole context (or no cache): the keys are exactly this call's.
            keys, values = xk.transpose(1, 2), xv.transpose(1, 2)  # (B, Hkv, T, D)
        else:
            # (B, Hkv, S, D); read_slots: given with a cache and a mask
            keys, values = cache.read(cast(torch.Tensor, inputs.read_slots), inputs.read_start)

        if mask is None:
            out = F.scaled_dot_product_attention(
                xq.transpose(1, 2), keys, values, is_causal=True, enable_gqa=self.n_rep > 1
            )  # (B, H, T, D)
            return project(self.wo, out.transpose(1, 2).reshape(bsz, seqlen, -1), lora)

        # Grouped-query attention without copying K/V per query head: the n_rep query
        # heads that share one K/V head are stacked along the query axis, so each K/V
        # head meets a (n_rep * T)-long block of queries.
        q = xq.view(bsz, seqlen, self.n_local_kv_heads, self.n_rep, self.head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(bsz, self.n_local_kv_heads, self.n_rep * seqlen, self.head_dim)
        if self.n_rep > 1 and seqlen > 1:  # one token: its mask row broadcasts over the n_rep queries
            mask = mask.unsqueeze(2).expand(-1, -1, self.n_rep, -1, -1).reshape(mask.shape[0], 1, -1, kv_len)
        out = masked_attention(q, keys, values, mask, self.policy)  # (B, Hkv, n_rep*T, D)
        out = out.view(bsz, self.n_local_kv_heads, self.n_rep, seqlen, self.head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(bsz, seqlen, -1)  # (B, T, H*D), heads in wq's order
        return project(self.wo, out, lora)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; the hidden units are split over ranks."""

    packable_input_projections = ("w1", "w3")

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, hidden_dim, gather_output=False)
        self.w2 = RowParallelLinear(hidden_dim, dim)
        self.w3 = ColumnParallelLinear(dim, hidden_dim, gather_output=False)
        # w1 and w3 multiplied as one matrix, where quantisation or packing makes them one.
        self.fused: Optional[FusedProjections] = None

    def hidden(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``silu(w1 x) * w3 x``: this rank's slice of the hidden units (``lora_slots``: each row's
        LoRA adapter, :class:`AttentionInputs`)."""
        if self.fused is not None:
            gate, up = self.fused(x, lora_slots) \
                if lora_slots is not None and isinstance(self.fused, LoraFusedProjections) else self.fused(x)
        else:
            gate, up = project(self.w1, x, lora_slots), project(self.w3, x, lora_slots)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        return project(self.w2, self.hidden(x, lora_slots), lora_slots)

    def partial(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's partial output, not yet summed over ranks (as a MoE layer's shared expert
        adds it to the routed experts' partial sums before their one all-reduce)."""
        hidden = self.hidden(x, lora_slots)
        w2 = cast(RowParallel, self.w2)
        if lora_slots is not None and isinstance(w2, LoraRow):
            return w2.local_output(hidden, lora_slots)
        return w2.local_matmul(hidden)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, layer_id)
        self.feed_forward: nn.Module = (
            MoE(args, FeedForward(args.dim, args.moe_hidden_dim)) if args.is_moe_layer(layer_id)
            else FeedForward(args.dim, args.ffn_hidden_dim)
        )
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache: Optional[KVCache] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), inputs, cache)
        if inputs.lora_slots is not None and isinstance(self.feed_forward, (FeedForward, MoE)):
            return h + self.feed_forward(self.ffn_norm(h), inputs.lora_slots)
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass
class CrossAttentionInputs:
    """What every cross-attention layer of one forward pass needs besides its input x (B, T, dim).

    ``kv``: per cross-attention layer (in the fusion schedule's order), its keys and values
    (B, Hkv, S, D) over the S vision tokens of the rows' images (this rank's K/V heads, keys
    already k-normed: :meth:`Transformer.image_context`); ``mask`` (B, 1, T, S): True where a
    token attends to a vision token; ``rows`` (B, T, 1): 1 for tokens that attend to some image,
    0 for the rest (text before any image), whose cross-attention output is zeroed."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    rows: torch.Tensor
    # The rows of x these inputs are for, (R,) ascending (kv, mask and rows then have R rows; the
    # other rows, which attend to no image, skip the layers); None: every row.
    row_index: Optional[torch.Tensor] = None


def attended_images(image_token_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, T, N) bool: which of each row's N images the tokens at ``positions`` (B, T) attend to,
    given where the images' ``<|image|>`` tokens are (``image_token_positions`` (B, N), increasing,
    -1 past a row's images).  Meta's ``create_vision_mask``: an image is attended from its token
    until the next image token, except that consecutive image tokens form one group whose images
    are all attended until the token after the group's next image token; the last group is
    attended to the end (generated tokens included, as Hugging Face's generation continues the
    last row).  It depends only on image tokens at or before each position."""
    loc = image_token_positions
    valid = loc >= 0
    # Each image's group: the position of the first image token of its run of consecutive ones.
    previous = torch.cat([loc.new_full((loc.shape[0], 1), -2), loc[:, :-1]], dim=1)
    starts = torch.where(valid & (loc != previous + 1), loc, loc.new_full((), -1))
    group = torch.cummax(starts, dim=1).values  # (B, N)
    seen = valid[:, None, :] & (loc[:, None, :] <= positions[:, :, None])  # (B, T, N)
    latest = torch.where(seen, group[:, None, :], group.new_full((), -1)).amax(dim=-1, keepdim=True)
    return seen & (group[:, None, :] == latest)


@dataclass
class ImageContext:
    """A batch's images as its cross-attention layers see them, computed once per request
    (:meth:`Transformer.image_context`) and held for its life: the engine's per-request image
    cache.  ``kv`` as :class:`CrossAttentionInputs`' (B, Hkv, S, D) per layer over each row's
    vision tokens of its images' real tiles only, image after image, tile after tile
    (``tokens_per_tile`` each; padding tiles are never attended, so they hold no K/V), rows with
    fewer zero-padded to the longest; ``token_images`` (B, S): the image (0..N-1) each vision
    token is of, -1 for a row's padding; ``image_token_positions`` (B, N): where each image's
    ``<|image|>`` token is (-1 for a row's padding images); ``n_tiles`` (B, N): each image's
    real tiles."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    image_token_positions: torch.Tensor
    n_tiles: torch.Tensor
    token_images: torch.Tensor
    tokens_per_tile: int

    def inputs(self, positions: torch.Tensor) -> CrossAttentionInputs:
        """The cross-attention inputs of tokens at ``positions`` (B, T) (prompt or generated)."""
        positions = positions.to(self.image_token_positions.device)
        images = attended_images(self.image_token_positions, positions)  # (B, T, N)
        b, t = positions.shape
        owner = self.token_images[:, None, :].expand(b, t, -1)  # (B, T, S)
        mask = torch.gather(images, 2, owner.clamp(min=0)) & (owner >= 0)
        rows = images.any(dim=-1)  # (B, T)
        # A row attending to nothing would give NaN; it attends to everything and is zeroed instead.
        mask = mask | ~rows[:, :, None]
        return CrossAttentionInputs(self.kv, mask.unsqueeze(1), rows.unsqueeze(-1))


class CrossAttention(nn.Module):
    """Grouped-query attention from text tokens to vision tokens (Meta's ``CrossAttention``): no
    rotation, queries and keys RMS-normed per head (``q_norm``, ``k_norm``, with weights); heads
    split over ranks as :class:`Attention`'s.  The keys and values of the vision tokens are
    computed once per request (:meth:`kv`), not per forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        world = fs_init.get_model_parallel_world_size()
        self.head_dim = args.head_dim
        self.n_local_heads, self.n_local_kv_heads, self.kv_replicas = heads_per_rank(args, world)
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        kv_width = args.n_kv_heads * self.kv_replicas * self.head_dim
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, gather_output=False)
        self.wk = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wv = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps)

    def kv(self, vision_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k-normed) and values (B, Hkv, S, D) of ``vision_tokens`` (B, S, dim)."""
        bsz, length, _ = vision_tokens.shape
        xk = self.wk(vision_tokens).view(bsz, length, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(vision_tokens).view(bsz, length, self.n_local_kv_heads, self.head_dim)
        return self.k_norm(xk).transpose(1, 2), xv.transpose(1, 2)

    def forward(self, x: torch.Tensor, inputs: CrossAttentionInputs, layer: int) -> torch.Tensor:
        """x (B, T, dim) attending to the vision tokens of ``inputs.kv[layer]``."""
        bsz, seqlen, _ = x.shape
        keys, values = inputs.kv[layer]
        xq = self.q_norm(self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim))
        # As in Attention: the n_rep query heads sharing a K/V head stacked along the query axis.
        q = xq.view(bsz, seqlen, self.n_local_kv_heads, self.n_rep, self.head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(bsz, self.n_local_kv_heads, self.n_rep * seqlen, self.head_dim)
        mask = inputs.mask
        if self.n_rep > 1:
            mask = mask.unsqueeze(2).expand(-1, -1, self.n_rep, -1, -1).reshape(mask.shape[0], 1, -1, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
        out = out.view(bsz, self.n_local_kv_heads, self.n_rep, seqlen, self.head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(bsz, seqlen, -1)  # (B, T, H*D)
        return self.wo(out) * inputs.rows.to(x.dtype)


class CrossAttentionTransformerBlock(nn.Module):
    """Meta's gated cross-attention block: ``h = x + tanh(gate_attn) * attention(attention_norm(x))``,
    then ``h + tanh(gate_ffwd) * feed_forward(ffn_norm(h))``, both branches zero for text before
    any image.  Runs before the self-attention layer the fusion schedule places it at."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index  # its place among the cross-attention layers (its K/V in CrossAttentionInputs.kv)
        self.attention = CrossAttention(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.gate_attn = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.gate_ffwd = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, x: torch.Tensor, inputs: CrossAttentionInputs) -> torch.Tensor:
        if inputs.row_index is not None:  # only these rows attend to images; the others pass unchanged
            index = inputs.row_index.to(x.device)
            return x.index_copy(0, index, self.forward(x.index_select(0, index), replace(inputs, row_index=None)))
        h = x + self.gate_attn.tanh().to(x.dtype) * self.attention(self.attention_norm(x), inputs, self.index)
        ffn = self.feed_forward(self.ffn_norm(h)) * inputs.rows.to(x.dtype)
        return h + self.gate_ffwd.tanh().to(x.dtype) * ffn


class Transformer(nn.Module):
    """Token ids in, logits out.

    Build it inside ``torch.device("meta")`` and load weights with
    ``load_state_dict(..., assign=True)`` followed by :meth:`setup_rope` (what
    ``Llama.build`` does), or on a real device and fill the weights yourself.

    The KV caches belong to whoever runs the model (:meth:`new_kv_cache`): the engine
    holds one with a row per slot; :meth:`forward`, Meta's call for use without an
    engine, keeps its own, made on first use.
    """

    def __init__(self, params: ModelArgs, embedding_layout: EmbeddingLayout = "vocab") -> None:
        super().__init__()
        if params.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (params.json's -1 is resolved from the tokenizer)")
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.embedding_layout = embedding_layout
        if embedding_layout == "vocab":
            self.tok_embeddings = VocabParallelEmbedding(params.vocab_size, params.dim)
        elif embedding_layout == "dim":
            self.tok_embeddings = ParallelEmbedding(params.vocab_size, params.dim)
        else:
            raise ValueError(f"embedding_layout must be 'vocab' or 'dim', got {embedding_layout!r}")
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        # forward()'s own KV caches, made on first use; in a list, so that they are not submodules
        # (state_dict, parameters and the engine's walks over modules() never see them)
        self._forward_cache: list[nn.ModuleList] = []
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnParallelLinear(params.dim, params.vocab_size, gather_output=True)
        self.vision_embeddings: Optional[VisionEmbeddings] = None
        self.vision_projection: Optional[VisionColumnParallelLinear] = None
        if params.vision_args is not None:  # Llama 4's image encoder, and its projection to the text width
            self.vision_embeddings = VisionEmbeddings(params.vision_args)
            self.vision_projection = VisionColumnParallelLinear(params.vision_args.output_dim, params.dim, bias=False,
                                                                gather_output=True)
        # Llama 3.2 Vision: the tiled encoder, the 8 learnt rows after the vocabulary (``<|image|>`` is
        # the first), and a cross-attention block before each self-attention layer of the schedule.
        self.vision_model: Optional[MllamaVisionModel] = None
        self.learnable_embedding: Optional[VocabParallelEmbedding] = None
        self.fusion_schedule = params.fusion_schedule()
        self.cross_attention_layers = nn.ModuleList(
            CrossAttentionTransformerBlock(params, i) for i in range(len(self.fusion_schedule)))
        if params.has_cross_attention:
            self.vision_model = MllamaVisionModel(params)
            world = fs_init.get_model_parallel_world_size()
            self.learnable_embedding = VocabParallelEmbedding(max(world, 8), params.dim)
        self.freqs_cis: torch.Tensor
        if self.tok_embeddings.weight.is_meta:
            # Only its shape is needed until setup_rope (computing it on meta would
            # load torch's meta kernels, ~75 MB per process, for nothing).
            freqs = torch.empty(params.max_seq_len + 1, params.head_dim // 2, dtype=torch.complex64)
        else:
            freqs = self._freqs(None)
        self.register_buffer("freqs_cis", freqs, persistent=False)

    def _freqs(self, device) -> torch.Tensor:
        p = self.params
        # One row more than max_seq_len: the KV cache's scratch position (see llama.layers.kv_cache).
        return precompute_freqs_cis(p.head_dim, p.max_seq_len + 1, p.rope_theta, p, device=device)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of activations and of the KV cache (the embedding table's; linear
        layers may be stored quantised)."""
        return self.tok_embeddings.weight.dtype

    def setup_rope(self, device: Optional[torch.device] = None) -> None:
        """Compute the RoPE table on ``device`` (default: where the weights are).  Needed
        after loading into a meta-built model."""
        self.freqs_cis = self._freqs(self.device if device is None else device)
        if self.vision_embeddings is not None:
            self.vision_embeddings.vision_encoder.setup_rope(self.device if device is None else device)

    @property
    def takes_images(self) -> bool:
        """Whether this model has an image encoder (a Llama 4 checkpoint with ``vision_args``,
        loaded without ``vision=False``)."""
        return self.vision_embeddings is not None

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Features of image tiles ``pixel_values`` [n_tiles, 3, S, S] (preprocessed: S the
        encoder's ``image_size``), [n_tiles, patches_per_tile, dim] in the model's dtype: tile
        by tile, each tile's in the order of its ``<|patch|>`` tokens (what
        :meth:`hidden_states` takes as ``image_features``, flattened).  Every rank computes all
        of them (the encoder is split over ranks as the text model is)."""
        if self.vision_embeddings is None or self.vision_projection is None:
            raise ValueError("this model takes no images: its checkpoint has no vision encoder (params.json's "
                             "vision_args), or it was loaded with vision=False")
        features = self.vision_projection(self.vision_embeddings(pixel_values.to(self.device)))
        return features.to(self.dtype)

    @property
    def image_token_id(self) -> int:
        """The id of ``<|image|>`` in a Llama 3.2 Vision prompt: the first row past the vocabulary
        (Meta's chat format writes 128256; Hugging Face's tokenizer has it there too)."""
        return self.vocab_size

    @torch.no_grad()
    def image_context(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                      tokens: torch.Tensor) -> ImageContext:
        """A Llama 3.2 Vision model's view of a batch's images, to give every forward of it
        (:class:`ImageContext`).  ``pixel_values`` [B, N, max_num_chunks, 3, S, S] (each image's
        tiles, zero-padded), ``aspect_ratio_ids`` [B, N] (0 for a row's padding images, which come
        after its real ones), ``tokens`` [B, L]: the prompts, whose ``<|image|>`` tokens
        (:attr:`image_token_id`) are the images', in order, one each.  The encoder runs once over
        the real images; each cross-attention layer's K/V is computed from its features."""
        if self.vision_model is None:
            raise ValueError("this model takes no Llama 3.2 Vision images (params.json has no vision_chunk_size)")
        if pixel_values.dim() != 6 or aspect_ratio_ids.shape != pixel_values.shape[:2] \
                or tokens.dim() != 2 or tokens.shape[0] != pixel_values.shape[0]:
            raise ValueError(f"pixel_values [B, N, chunks, 3, S, S], aspect_ratio_ids [B, N] and tokens [B, L] must "
                             f"agree; got {list(pixel_values.shape)}, {list(aspect_ratio_ids.shape)}, "
                             f"{list(tokens.shape)}")
        bsz, n_images = aspect_ratio_ids.shape
        chunks = self.params.vision_max_num_chunks
        n_tiles = tile_counts(aspect_ratio_ids, chunks)  # ValueError for ids out of range
        real = n_tiles > 0
        if (real[:, 1:] & ~real[:, :-1]).any():
            raise ValueError("aspect_ratio_ids: a row's padding images (id 0) must come after its real ones")
        marks = tokens == self.image_token_id
        for row in range(bsz):
            held, wanted = int(marks[row].sum()), int(real[row].sum())
            if held != wanted:
                raise ValueError(f"row {row} has {held} <|image|> tokens (id {self.image_token_id}) for {wanted} "
                                 "images: each image needs exactly one, in the order of the images")
        positions = torch.full((bsz, n_images), -1, dtype=torch.long, device=tokens.device)
        for row in range(bsz):
            found = marks[row].nonzero().flatten()
            positions[row, : found.numel()] = found
        flat_pixels = pixel_values.reshape(bsz * n_images, *pixel_values.shape[2:]).to(self.device)
        flat_ids = aspect_ratio_ids.reshape(-1).to(self.device)
        keep = real.reshape(-1).to(self.device)
        per_tile = self.vision_model.vision_encoder.grid ** 2 + 1
        encoded = self.vision_model(flat_pixels[keep], flat_ids[keep]).to(self.dtype) if bool(keep.any()) else None
        # Each row's vision tokens: its images' real tiles, packed; rows zero-padded to the longest.
        counts = n_tiles.tolist()
        width = max(1, max(sum(row) for row in counts)) * per_tile  # (one zero tile where no row has an image)
        vision_tokens = torch.zeros(bsz, width, self.params.dim, device=self.device, dtype=self.dtype)
        token_images = torch.full((bsz, width), -1, dtype=torch.long, device=self.device)
        index = 0
        for row in range(bsz):
            start = 0
            for image, n in enumerate(counts[row]):
                if n:
                    assert encoded is not None
                    vision_tokens[row, start : start + n * per_tile] = encoded[index, :n].reshape(-1, self.params.dim)
                    token_images[row, start : start + n * per_tile] = image
                    start += n * per_tile
                    index += 1
        kv = [cast(CrossAttentionTransformerBlock, layer).attention.kv(vision_tokens)
              for layer in self.cross_attention_layers]
        return ImageContext(kv, positions.to(self.device), n_tiles.to(self.device), token_images, per_tile)

    def _embed(self, tokens: torch.Tensor, image_features: Optional[torch.Tensor],
               image_positions: Optional[torch.Tensor]) -> torch.Tensor:
        """The token embeddings (B, T, dim), with ``image_features`` (K, dim) in place of the
        K embeddings where ``image_positions`` (B, T, bool) is True, in row-major order."""
        if self.learnable_embedding is not None:
            # Ids past the vocabulary (``<|image|>`` = vocab_size) are rows of learnable_embedding.
            learnt = tokens >= self.vocab_size
            h = torch.where(learnt.unsqueeze(-1),
                            self.learnable_embedding((tokens - self.vocab_size).clamp(min=0)),
                            self.tok_embeddings(tokens.clamp(max=self.vocab_size - 1)))
        else:
            h = self.tok_embeddings(tokens)
        if image_features is None and image_positions is None:
            return h
        if image_features is None or image_positions is None:
            raise ValueError("give image_features and image_positions together")
        if image_positions.dtype != torch.bool or image_positions.shape != tokens.shape:
            raise ValueError(f"image_positions must be a bool tensor of the tokens' shape {list(tokens.shape)}, "
                             f"got {image_positions.dtype} {list(image_positions.shape)}")
        features = image_features.reshape(-1, h.shape[-1]) if image_features.dim() == 3 else image_features
        if features.dim() != 2 or features.shape[-1] != h.shape[-1]:
            raise ValueError(f"image_features must be (K, {h.shape[-1]}) (or [tiles, patches, {h.shape[-1]}]), "
                             f"got {list(image_features.shape)}")
        count = int(image_positions.sum())
        if features.shape[0] != count:
            raise ValueError(f"{features.shape[0]} image features for {count} image positions: each <|patch|> "
                             "token takes one feature")
        return h.masked_scatter(image_positions.unsqueeze(-1).to(h.device), features.to(h.dtype))

    def new_kv_cache(self, rows: Optional[int] = None, *, n_blocks: Optional[int] = None,
                     block_size: Optional[int] = None) -> nn.ModuleList:
        """Zeroed KV caches, one per layer (:class:`~llama.layers.kv_cache.KVCache`), on the
        model's device in its dtype: ``rows`` sequences (default ``max_batch_size``) of
        ``max_seq_len`` positions and a scratch slot, one block each (the block table of
        :meth:`hidden_states`' default); or, given ``n_blocks`` and ``block_size``, a pool of
        blocks for block tables of the caller's (the engine's paged cache)."""
        p = self.params
        if n_blocks is None:
            n_blocks = p.max_batch_size if rows is None else rows
            block_size = p.max_seq_len + 1
        elif rows is not None or block_size is None:
            raise ValueError("give either rows, or n_blocks and block_size")
        return nn.ModuleList(
            KVCache(n_blocks, block_size, block.attention.n_local_kv_heads, block.attention.head_dim,
                    self.device, self.dtype)
            for block in cast(Iterable[TransformerBlock], self.layers)
        )

    def _check_bounds(self, bsz: int, end: int) -> None:
        p = self.params
        if bsz > p.max_batch_size:
            raise ValueError(f"batch of {bsz} rows exceeds max_batch_size={p.max_batch_size}")
        if end > p.max_seq_len:
            raise ValueError(f"positions up to {end} exceed max_seq_len={p.max_seq_len}")

    def hidden_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        cache: nn.ModuleList,
        from_start: bool = False,
        block_table: Optional[torch.Tensor] = None,
        image_features: Optional[torch.Tensor] = None,
        image_positions: Optional[torch.Tensor] = None,
        cross_attention: Optional[CrossAttentionInputs] = None,
        lora_slots: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, dim) for ``tokens`` (B, T) at ``positions`` (B, T).

        Attends to positions ``[0, kv_len)``; ``kv_len`` must exceed every real position
        (padding may sit at the scratch position ``max_seq_len``).  Updates the KV caches
        ``cache`` (one per layer, :meth:`new_kv_cache`) at ``positions``, in the blocks of
        ``block_table`` (B, W) (default: block b for row b, the one-block-per-row layout;
        see :mod:`llama.layers.kv_cache`).  ``from_start``: the caller promises positions are
        0..T-1 on every row (a new context, kv_len = T), so attention is plainly causal and
        needs no mask.  ``image_features`` (K, dim) (e.g. :meth:`encode_images`' flattened) replace
        the embeddings of the K tokens where ``image_positions`` (B, T, bool) is True, taken in
        row-major order (Meta's and Hugging Face's masked scatter); both None: text only.
        ``cross_attention`` (a Llama 3.2 Vision model's: :meth:`ImageContext.inputs` at ``positions``):
        what the cross-attention layers attend to; None skips them (text only, as Meta's
        ``text_only_inference``: with no image they would add nothing).  ``lora_slots`` (B,) int64:
        each row's LoRA adapter slot (0: none) in a model with LoRA layers
        (:mod:`llama.layers.lora`); None: the base model.
        """
        block_size = cast(KVCache, cache[0]).block_size
        if block_table is None:
            block_table = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1)
        h = self._embed(tokens, image_features, image_positions)
        # (B, T, D/2) complex; compiled, its real view (B, T, D/2, 2), which Inductor can fuse
        # (apply_rotary_emb takes either)
        rotations = torch.view_as_real(self.freqs_cis) if torch.compiler.is_compiling() else self.freqs_cis
        freqs_cis = rotations[positions]
        mask = None
        if not from_start:
            # Causal mask over the cache: the token at position p sees slots 0..p.  This
            # is right however many tokens are fed at once and wherever they start.
            cached = torch.arange(kv_len, device=tokens.device)
            mask = (cached <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)
        chunked_mask = self._chunked_mask(positions, kv_len, mask)
        read_slots = read_start = None  # a whole context attends to its own keys: nothing is read back
        if mask is not None or chunked_mask is not None:
            read_slots = context_slots(block_table, kv_len, block_size)
            read_start = consecutive_start(read_slots)
        inputs = AttentionInputs(freqs_cis, positions, mask, chunked_mask,
                                 cache_slots(block_table, positions, block_size), read_slots, read_start,
                                 lora_slots)
        if cross_attention is not None and not len(self.cross_attention_layers):
            raise ValueError("cross_attention given to a model without cross-attention layers (not Llama 3.2 Vision)")
        before = dict(zip(self.fusion_schedule, self.cross_attention_layers)) if cross_attention is not None else {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if i in before:
                h = before[i](h, cross_attention)
            h = layer(h, inputs, layer_cache)
        return self.norm(h)

    def _chunked_mask(
        self, positions: torch.Tensor, kv_len: int, causal: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """The mask of chunked (local) attention layers, (B, 1, T, S): slot s is seen from
        position p when s <= p and both lie in the same chunk (s // C == p // C).
        ``causal`` None (a context from position 0) stays None while every position is
        in the first chunk, where chunked and causal attention are the same."""
        chunk = self.params.attention_chunk_size
        if chunk is None or (causal is None and positions.shape[1] <= chunk):
            return causal
        if causal is None:
            positions = positions[:1]  # every row at 0..T-1: one (1, 1, T, T) mask serves all
        slots = torch.arange(kv_len, device=positions.device)
        pos = positions.unsqueeze(-1)  # (B, T, 1)
        return ((slots <= pos) & (slots // chunk == pos // chunk)).unsqueeze(1)

    def forward_uncached(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) for whole sequences starting at position 0, computed
        without reading or writing the KV cache.  Differentiable: used for training."""
        bsz, seqlen = tokens.shape
        self._check_bounds(0, seqlen)
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen].unsqueeze(0)
        local_mask = self._chunked_mask(torch.arange(seqlen, device=tokens.device).unsqueeze(0), seqlen, None)
        inputs = AttentionInputs(freqs_cis, None, None, local_mask)
        for layer in self.layers:
            h = layer(h, inputs)
        return self.logits(self.norm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the full vocabulary for hidden states (..., dim)."""
        return self.output(hidden).float()

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                      cache: nn.ModuleList, block_table: Optional[torch.Tensor] = None,
                      lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decoding step: logits (B, vocab_size), float32, for one new token per row
        (``tokens`` and ``positions`` both (B, 1)), attending to positions ``[0, kv_len)`` of
        each row's blocks in ``block_table`` (default: ``cache``'s rows 0..B-1).

        With ``kv_len`` fixed (the cache length) every step has the same shapes, which
        is what a compiled or graph-captured step needs.
        """
        return self.logits(self.hidden_states(tokens, positions, kv_len, cache, block_table=block_table,
                                              lora_slots=lora_slots)[:, -1])

    def forward_cache(self) -> nn.ModuleList:
        """The KV caches :meth:`forward` reads and writes (made on first use, on the model's
        device and in its dtype): pass them to :meth:`decode_logits` or :meth:`hidden_states`
        to go on from what ``forward`` fed."""
        if not self._forward_cache or self._forward_cache[0][0].k.device != self.device \
                or self._forward_cache[0][0].k.dtype != self.dtype:
            self._forward_cache[:] = [self.new_kv_cache()]
        return self._forward_cache[0]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, image_features: Optional[torch.Tensor] = None,
                image_positions: Optional[torch.Tensor] = None, *,
                images: Optional[ImageContext] = None) -> torch.Tensor:
        """Logits (B, T, vocab_size), float32, for ``tokens`` (B, T) placed at positions
        ``start_pos .. start_pos + T - 1`` after whatever this model's own KV cache holds
        before ``start_pos`` (Meta's call; the engine keeps a cache of its own).  Image
        features replace embeddings as :meth:`hidden_states` says; ``images`` (Llama 3.2 Vision:
        :meth:`image_context` of the whole prompt, given with every call of the request) are what
        the cross-attention layers attend to."""
        bsz, seqlen = tokens.shape
        self._check_bounds(bsz, start_pos + seqlen)
        cache = self.forward_cache()
        positions = torch.arange(start_pos, start_pos + seqlen, device=tokens.device).expand(bsz, seqlen)
        cross_attention = images.inputs(positions) if images is not None else None
        return self.logits(self.hidden_states(tokens, positions, start_pos + seqlen, cache, from_start=start_pos == 0,
                                              image_features=image_features, image_positions=image_positions,
                                              cross_attention=cross_attention))
