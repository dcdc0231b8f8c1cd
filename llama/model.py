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

Llama 4 adds, all decided by ``params.json``: mixture-of-experts feed-forward layers
(:class:`MoE`) interleaved with dense ones; layers without positional encoding
("NoPE", global attention, query temperature tuning) every few layers; chunked local
attention with QK norm in the RoPE layers.  Chunked attention is driven by positions
like the rest: a token at position p sees slot s when s <= p and s // C == p // C, in
a prompt, in a decoding step past a chunk boundary and in a later turn alike.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel.mappings import reduce_from_model_parallel_region
from torch import nn

from llama.checkpoint.params import ModelArgs
from llama.layers.parallel import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    int4_linear,
    int8_linear,
)
from llama.layers.packing import PackedProjections

__all__ = [
    "ModelArgs",
    "RMSNorm",
    "precompute_freqs_cis",
    "apply_rotary_emb",
    "Attention",
    "FeedForward",
    "Experts",
    "MoE",
    "TransformerBlock",
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
    factor = args.rope_scaling_factor
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
    """Rotate queries (B, T, H, D) and keys (B, T, Hkv, D) by ``freqs_cis`` (B or 1, T, D/2).

    Meta's convention: dimensions (0,1), (2,3), ... are the (real, imaginary) parts of
    one complex number.  (Hugging Face pairs dimension k with k + D/2 instead, which is
    why its q/k weights are stored permuted.)
    """
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    rot = freqs_cis.unsqueeze(2)  # (B, T, 1, D/2): the same rotation for every head
    xq_out = torch.view_as_real(xq_ * rot).flatten(3)
    xk_out = torch.view_as_real(xk_ * rot).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def kv_heads_per_rank(args: ModelArgs, world_size: int) -> tuple[int, int]:
    """(K/V heads this rank holds, how many copies of each K/V head exist over all ranks).

    With more ranks than K/V heads, each K/V head is replicated so that every rank
    holds one whole head (e.g. 8 K/V heads on 16 ranks: 2 copies each).
    """
    n_kv = args.n_kv_heads
    if world_size <= n_kv:
        if n_kv % world_size:
            raise ValueError(f"n_kv_heads={n_kv} cannot be split over {world_size} model-parallel processes")
        return n_kv // world_size, 1
    if world_size % n_kv:
        raise ValueError(
            f"{world_size} model-parallel processes cannot share n_kv_heads={n_kv}: "
            f"with more processes than K/V heads the count must be a multiple of {n_kv}"
        )
    return 1, world_size // n_kv


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

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        world = fs_init.get_model_parallel_world_size()
        if args.n_heads % world:
            raise ValueError(f"n_heads={args.n_heads} cannot be split over {world} model-parallel processes")
        self.use_rope = not args.is_nope_layer(layer_id)
        self.use_qk_norm = args.use_qk_norm and self.use_rope
        self.norm_eps = args.norm_eps
        tuned = args.attn_temperature_tuning and not self.use_rope
        self.temperature = (args.floor_scale, args.attn_scale) if tuned else None  # query scaling of NoPE layers
        self.chunk_size = args.attention_chunk(layer_id)  # None: global attention
        self.head_dim = args.head_dim
        self.n_local_heads = args.n_heads // world
        self.n_local_kv_heads, self.kv_replicas = kv_heads_per_rank(args, world)
        self.n_rep = self.n_local_heads // self.n_local_kv_heads  # query heads per K/V head
        kv_width = args.n_kv_heads * self.kv_replicas * self.head_dim

        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, gather_output=False)
        self.wk = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wv = ColumnParallelLinear(args.dim, kv_width, gather_output=False)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim)
        # Set when the three are packed as one matrix (llama.layers.packing.use_packed_weights_).
        self.packed_input_projections: Optional[PackedProjections] = None
        self.cache_k: torch.Tensor
        self.cache_v: torch.Tensor
        self.allocate_cache(args.max_batch_size, args.max_seq_len)

    def allocate_cache(self, max_batch_size: int, max_seq_len: int, device=None, dtype=None) -> None:
        """(Re)create the KV cache, (max_batch_size, Hkv, max_seq_len + 1, D), zeroed.

        The extra last position is scratch: padding tokens of a ragged step are written
        there (position ``max_seq_len``), so they never touch a row's real slots."""
        shape = (max_batch_size, self.n_local_kv_heads, max_seq_len + 1, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        positions: Optional[torch.Tensor],
        mask: Optional[torch.Tensor],
        cache_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x (B, T, dim); freqs_cis (B or 1, T, D/2); positions (B, T) cache slots to write;
        mask (B or 1, 1, T, S) True where a query may attend to a cached slot;
        cache_rows (B,) the KV-cache row of each batch row (default: rows 0..B-1).

        ``mask=None``: the T tokens are a whole context (positions 0..T-1), so plain
        causal attention applies, which lets SDPA use its fastest (flash) kernels.
        ``positions=None`` bypasses the cache (training).
        """
        bsz, seqlen, _ = x.shape
        if self.packed_input_projections is not None:
            xq, xk, xv = self.packed_input_projections(x)  # rank-local, as wq/wk/wv's (gather_output=False)
        else:
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
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
        if positions is not None:
            # Write this call's keys/values at their positions.  Indexing the cache
            # (B, Hkv, S, D) with rows (B, 1) and positions (B, T) around the head slice
            # addresses a (B, T, Hkv, D) block: exactly xk's layout, no transpose.
            rows = (torch.arange(bsz, device=x.device) if cache_rows is None else cache_rows).unsqueeze(1)
            self.cache_k[rows, :, positions] = xk
            self.cache_v[rows, :, positions] = xv
        if positions is None or mask is None:
            # A whole context (or no cache): the keys are exactly this call's.
            keys, values = xk.transpose(1, 2), xv.transpose(1, 2)  # (B, Hkv, T, D)
        elif cache_rows is None:
            keys = self.cache_k[:bsz, :, :kv_len]  # (B, Hkv, S, D), a view
            values = self.cache_v[:bsz, :, :kv_len]
        else:
            keys = self.cache_k[cache_rows, :, :kv_len]  # gathered rows (a copy)
            values = self.cache_v[cache_rows, :, :kv_len]

        if mask is None:
            out = F.scaled_dot_product_attention(
                xq.transpose(1, 2), keys, values, is_causal=True, enable_gqa=self.n_rep > 1
            )  # (B, H, T, D)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

        # Grouped-query attention without copying K/V per query head: the n_rep query
        # heads that share one K/V head are stacked along the query axis, so each K/V
        # head meets a (n_rep * T)-long block of queries.
        q = xq.view(bsz, seqlen, self.n_local_kv_heads, self.n_rep, self.head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(bsz, self.n_local_kv_heads, self.n_rep * seqlen, self.head_dim)
        if self.n_rep > 1 and seqlen > 1:  # one token: its mask row broadcasts over the n_rep queries
            mask = mask.unsqueeze(2).expand(-1, -1, self.n_rep, -1, -1).reshape(mask.shape[0], 1, -1, kv_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (B, Hkv, n_rep*T, D)
        out = out.view(bsz, self.n_local_kv_heads, self.n_rep, seqlen, self.head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(bsz, seqlen, -1)  # (B, T, H*D), heads in wq's order
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; the hidden units are split over ranks."""

    packable_input_projections = ("w1", "w3")

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = ColumnParallelLinear(dim, hidden_dim, gather_output=False)
        self.w2 = RowParallelLinear(hidden_dim, dim)
        self.w3 = ColumnParallelLinear(dim, hidden_dim, gather_output=False)
        # Set when w1 and w3 are packed as one matrix (llama.layers.packing.use_packed_weights_).
        self.packed_input_projections: Optional[PackedProjections] = None

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(w1 x) * w3 x``: this rank's slice of the hidden units."""
        if self.packed_input_projections is not None:
            gate, up = self.packed_input_projections(x)
        else:
            gate, up = self.w1(x), self.w3(x)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(x))


def _expert_slice(hidden_dim: int) -> int:
    world = fs_init.get_model_parallel_world_size()
    if hidden_dim % world:
        raise ValueError(f"expert hidden size {hidden_dim} cannot be split over {world} model-parallel processes")
    return hidden_dim // world


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked: SwiGLU ``w2[e](silu(x w1[e]) * x w3[e])``.

    Each rank holds its slice of every expert's hidden units (as Meta's reference
    splits them): w1, w3 (E, dim, hidden/world); w2 (E, hidden/world, dim).  Outputs
    are rank-partial sums, all-reduced by the caller.

    After :mod:`llama.layers.quantize` (``quantized`` = "int8" or "int4") each matrix is stored
    per expert the way the linear layers store theirs, (out, in): ``w1_int8`` (E, out,
    in) and ``w1_scale`` (E, out); or ``w1_int4`` (E, packed by torch for the device),
    ``w1_scales_and_zeros`` (E, in / group, out, 2), with ``int4_group_size`` and
    ``int4_out_features`` (by name; stored rows are padded to a multiple of 16).
    """

    matrices = ("w1", "w2", "w3")

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        local = _expert_slice(hidden_dim)
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, local), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, local, dim), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, local), requires_grad=False)
        self.quantized: Optional[Literal["int8", "int4"]] = None
        self.int4_group_size = 0
        self.int4_out_features: dict[str, int] = {}

    def product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W[e]`` for the matrix ``name`` of expert ``e``; x (N, in)."""
        if self.quantized is None:
            return x @ getattr(self, name)[e]
        if self.quantized == "int8":
            return int8_linear(x, getattr(self, name + "_int8")[e], getattr(self, name + "_scale")[e])
        out = int4_linear(x, getattr(self, name + "_int4")[e], getattr(self, name + "_scales_and_zeros")[e],
                          self.int4_group_size)
        width = self.int4_out_features[name]
        return out if out.shape[-1] == width else out[..., :width]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on tokens x (N, dim): this rank's partial (N, dim)."""
        return self.product("w2", e, F.silu(self.product("w1", e, x)) * self.product("w3", e, x))

    # Runs eagerly inside a compiled step: the per-expert token counts decide the loop,
    # and compiling it would recompile for every new routing.
    @torch.compiler.disable
    def grouped(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts of expert(gate * token): x (N, dim),
        experts and gates (N, k).  Tokens are sorted by expert and each expert runs
        once on just its tokens (experts no token chose cost nothing)."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)
        token = order // k  # which token each sorted entry came from
        routed_in = x[token] * gates.reshape(-1)[order].unsqueeze(1)  # (N*k, dim), grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host sync
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.expert(e, routed_in[start : start + n]))
                start += n
        return torch.zeros_like(x).index_add_(0, token, torch.cat(outs))

    def dense(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """The same sum computed as Meta's reference does: every token through every
        expert, with a gate of 0 where the expert was not chosen (for comparison)."""
        full = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device).scatter_(1, experts, gates)
        if self.quantized is not None:
            return sum(self.expert(e, x * full[:, e : e + 1]) for e in range(self.num_experts))
        routed_in = x.unsqueeze(0) * full.t().unsqueeze(2)  # (E, N, dim)
        out = torch.bmm(F.silu(torch.bmm(routed_in, self.w1)) * torch.bmm(routed_in, self.w3), self.w2)
        return out.sum(0)


class MoE(nn.Module):
    """Llama 4's mixture-of-experts feed-forward layer.

    A sigmoid router picks ``top_k`` experts per token; the token *scaled by its
    router score* goes through each chosen expert (the score scales the input, not the
    output); a shared expert sees every token.  Both outputs are rank-partial sums,
    added before the layer's one all-reduce.  ``expert_compute`` = "dense" runs every
    expert on every token instead (Meta's way; same result, for benchmarks).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.moe_args is not None
        self.top_k = args.moe_args.top_k
        hidden = args.moe_hidden_dim
        self.experts = Experts(args.moe_args.num_experts, args.dim, hidden)
        # (dim, E), Meta's name and layout; replicated on every rank
        self.router_DE = nn.Parameter(torch.empty(args.dim, args.moe_args.num_experts), requires_grad=False)
        self.shared_expert = FeedForward(args.dim, hidden)
        self.expert_compute: Literal["grouped", "dense"] = "grouped"
        self.world_size = fs_init.get_model_parallel_world_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        scores = x @ self.router_DE  # (N, E), replicated on every rank
        top_scores, experts = torch.topk(scores, self.top_k, dim=-1)  # (N, k)
        gates = torch.sigmoid(top_scores.float()).to(x.dtype)
        shared = self.shared_expert
        out = shared.w2.local_matmul(shared.hidden(x))  # rank-partial, not yet reduced
        compute = self.experts.grouped if self.expert_compute == "grouped" else self.experts.dense
        out = out + compute(x, experts, gates)
        if self.world_size > 1:
            out = reduce_from_model_parallel_region(out)
        return out.view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, layer_id)
        self.feed_forward: nn.Module = (
            MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args.dim, args.ffn_hidden_dim)
        )
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        positions: Optional[torch.Tensor],
        mask: Optional[torch.Tensor],
        cache_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, positions, mask, cache_rows)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids in, logits out.

    Build it inside ``torch.device("meta")`` and load weights with
    ``load_state_dict(..., assign=True)`` followed by :meth:`setup_caches` (what
    ``Llama.build`` does), or on a real device and fill the weights yourself.
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
        self.cache_overwrites = 0  # calls of forward(), which writes cache rows 0..B-1 behind any engine's back
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = ColumnParallelLinear(params.dim, params.vocab_size, gather_output=True)
        self.freqs_cis: torch.Tensor
        if self.tok_embeddings.weight.is_meta:
            # Only its shape is needed until setup_caches (computing it on meta would
            # load torch's meta kernels, ~75 MB per process, for nothing).
            freqs = torch.empty(params.max_seq_len + 1, params.head_dim // 2, dtype=torch.complex64)
        else:
            freqs = self._freqs(None)
        self.register_buffer("freqs_cis", freqs, persistent=False)

    def _freqs(self, device) -> torch.Tensor:
        p = self.params
        # One row more than max_seq_len: the KV cache's scratch position (see Attention.allocate_cache).
        return precompute_freqs_cis(p.head_dim, p.max_seq_len + 1, p.rope_theta, p, device=device)

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of activations and of the KV cache (the embedding table's; linear
        layers may be stored quantised)."""
        return self.tok_embeddings.weight.dtype

    def setup_caches(self, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        """Create the RoPE table and zeroed KV caches on ``device`` in ``dtype``
        (default: where the weights are).  Needed after loading into a meta-built model."""
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        self.freqs_cis = self._freqs(device)
        for layer in self.layers:
            layer.attention.allocate_cache(self.params.max_batch_size, self.params.max_seq_len, device, dtype)

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
        from_start: bool = False,
        cache_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, T, dim) for ``tokens`` (B, T) at ``positions`` (B, T).

        Attends to cache slots ``[0, kv_len)``; ``kv_len`` must exceed every real position
        (padding may sit at the scratch position ``max_seq_len``).  Updates the KV cache
        at ``positions``, in cache rows ``cache_rows`` (B,) (default 0..B-1).  ``from_start``:
        the caller promises positions are 0..T-1 on every row (a new context, kv_len = T),
        so attention is plainly causal and needs no mask.
        """
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[positions]  # (B, T, D/2)
        mask = None
        if not from_start:
            # Causal mask over the cache: the token at position p sees slots 0..p.  This
            # is right however many tokens are fed at once and wherever they start.
            cached = torch.arange(kv_len, device=tokens.device)
            mask = (cached <= positions.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, S)
        local_mask = self._chunked_mask(positions, kv_len, mask)
        for layer in self.layers:
            h = layer(h, freqs_cis, positions, local_mask if layer.attention.chunk_size else mask, cache_rows)
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
        for layer in self.layers:
            h = layer(h, freqs_cis, None, local_mask if layer.attention.chunk_size else None)
        return self.logits(self.norm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the full vocabulary for hidden states (..., dim)."""
        return self.output(hidden).float()

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One decoding step: logits (B, vocab_size), float32, for one new token per row
        (``tokens`` and ``positions`` both (B, 1)), attending to cache slots ``[0, kv_len)``.

        With ``kv_len`` fixed (the cache length) every step has the same shapes, which
        is what a compiled or graph-captured step needs.
        """
        return self.logits(self.hidden_states(tokens, positions, kv_len)[:, -1])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits (B, T, vocab_size), float32, for ``tokens`` (B, T) placed at positions
        ``start_pos .. start_pos + T - 1`` after whatever the KV cache holds before ``start_pos``."""
        bsz, seqlen = tokens.shape
        self._check_bounds(bsz, start_pos + seqlen)
        self.cache_overwrites += 1  # the generation engine's record of what each cache row holds is stale now
        positions = torch.arange(start_pos, start_pos + seqlen, device=tokens.device).expand(bsz, seqlen)
        return self.logits(self.hidden_states(tokens, positions, start_pos + seqlen, from_start=start_pos == 0))
