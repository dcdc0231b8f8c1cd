"""Llama 4's mixture-of-experts feed-forward layers: the routed experts, stacked
(:class:`Experts`), and the layer that routes tokens to them beside a shared expert (:class:`MoE`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, Optional, TypeVar, cast

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import initialize as fs_init
from torch import nn

from llama.args import ModelArgs
from llama.layers import cpu_kernels
from llama.layers.collectives import sum_over_ranks
from llama.layers.lora import LoraExperts
from llama.layers.parallel import split_size
from llama.layers.policy import KernelPolicy
from llama.layers.products import int4_product, int8_product

E = TypeVar("E", bound="Experts")
Fn = TypeVar("Fn", bound=Callable[..., Any])


def eager_inside_compiled_steps(fn: Fn) -> Fn:
    """``fn`` as ``torch.compiler.disable(fn)``: a compiled step calls it eagerly instead of
    tracing it.  The disabled function is made the first time a compiled step reaches ``fn``
    (decorating with ``torch.compiler.disable`` imports ``torch._dynamo`` at import time, 1-3 s
    of every process's start, and most processes never compile)."""
    made: dict[str, Callable[..., Any]] = {}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if "disabled" not in made:  # under tracing: Dynamo runs this line eagerly, then the call below
            made["disabled"] = torch.compiler.disable(fn)
        return made["disabled"](*args, **kwargs)

    return cast(Fn, call)


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked: SwiGLU ``w2[e](silu(x w1[e]) * x w3[e])``.

    Each rank holds its slice of every expert's hidden units (as Meta's reference
    splits them): w1, w3 (E, dim, hidden/world); w2 (E, hidden/world, dim).  Outputs
    are rank-partial sums, all-reduced by the caller.

    :mod:`llama.layers.quantize` swaps them for :class:`Int8Experts` or :class:`Int4Experts`.

    ``lora``: LoRA adapters served unmerged on them (:class:`llama.layers.lora.LoraExperts`,
    given by :func:`llama.layers.lora.use_lora_layers_`); None: none.
    """

    quantized: Optional[Literal["int8", "int4"]] = None
    policy: KernelPolicy = KernelPolicy()  # the model's kernel policy (llama.layers.prepare)

    matrices = ("w1", "w2", "w3")
    num_experts: int

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        local = split_size(hidden_dim, "expert hidden size")
        self.num_experts = num_experts
        self.local_shape = (dim, local)  # (dim, this rank's hidden units), whatever the matrices' storage
        self.lora: Optional[LoraExperts] = None
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, local), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, local, dim), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, local), requires_grad=False)

    def product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W[e]`` for the matrix ``name`` of expert ``e``; x (N, in)."""
        return x @ getattr(self, name)[e]

    def swapped_to(self, cls: type[E]) -> E:
        """Experts of class ``cls`` with these ones' count, holding no matrices yet."""
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        experts.num_experts = self.num_experts
        experts.local_shape = self.local_shape
        experts.lora = None
        if "policy" in self.__dict__:
            experts.policy = self.policy
        return experts

    def expert(self, e: int, x: torch.Tensor, slot_counts: Optional[list[int]] = None) -> torch.Tensor:
        """Expert ``e`` on tokens x (N, dim): this rank's partial (N, dim).  ``slot_counts``: the
        tokens are sorted by LoRA slot, ``slot_counts[s]`` of slot ``s`` (:attr:`lora`'s); None:
        the base experts."""
        hidden = F.silu(self._product("w1", e, x, slot_counts)) * self._product("w3", e, x, slot_counts)
        return self._product("w2", e, hidden, slot_counts)

    def _product(self, name: str, e: int, x: torch.Tensor, slot_counts: Optional[list[int]]) -> torch.Tensor:
        """``x @ W[e]``, plus each slot's low-rank product of its tokens where adapters change ``W``."""
        out = self.product(name, e, x)
        if slot_counts is None or self.lora is None:
            return out
        delta = self.lora.delta(name, e, x, slot_counts)
        return out if delta is None else out + delta.to(out.dtype)

    # Runs eagerly inside a compiled step: the per-expert token counts decide the loop,
    # and compiling it would recompile for every new routing.
    @eager_inside_compiled_steps
    def grouped(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
                token_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum over each token's chosen experts of expert(gate * token): x (N, dim),
        experts and gates (N, k).  Tokens are sorted by expert and each expert runs
        once on just its tokens (experts no token chose cost nothing).

        ``token_slots`` (N,) int64: each token's LoRA slot (0: no adapter), where :attr:`lora`
        is set.  Within an expert its tokens are sorted by slot too, as vLLM's fused_moe_lora
        groups them by (adapter, expert): the base product once for the expert's tokens, the
        low-rank products once per adapter among them."""
        k = experts.shape[1]
        flat = experts.reshape(-1)  # (N*k,)
        n_slots = 1
        key = flat
        if token_slots is not None and self.lora is not None:
            n_slots = self.lora.n_slots
            key = flat * n_slots + token_slots.repeat_interleave(k)  # (expert, slot), expert-major
        order = torch.argsort(key, stable=True)
        token = order // k  # which token each sorted entry came from
        routed_in = x[token] * gates.reshape(-1)[order].unsqueeze(1)  # (N*k, dim), grouped by expert
        counts = torch.bincount(key, minlength=self.num_experts * n_slots).view(-1, n_slots).tolist()  # the one sync
        outs, start = [], 0
        for e, by_slot in enumerate(counts):
            n = sum(by_slot)
            if n:
                outs.append(self.expert(e, routed_in[start : start + n], by_slot if n_slots > 1 else None))
                start += n
        return torch.zeros_like(x).index_add_(0, token, torch.cat(outs))

    def dense(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
              token_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The same sum computed as Meta's reference does: every token through every
        expert, with a gate of 0 where the expert was not chosen (for comparison)."""
        full = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device).scatter_(1, experts, gates)
        if token_slots is not None and self.lora is not None:
            # every expert on every token, the tokens sorted by LoRA slot
            order = torch.argsort(token_slots, stable=True)
            counts = torch.bincount(token_slots, minlength=self.lora.n_slots).tolist()
            x, full = x[order], full[order]
            out = cast(torch.Tensor, sum(self.expert(e, x * full[:, e : e + 1], counts)
                                         for e in range(self.num_experts)))
            return torch.empty_like(out).index_copy_(0, order, out)
        if self.quantized:
            return cast(torch.Tensor, sum(self.expert(e, x * full[:, e : e + 1]) for e in range(self.num_experts)))
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

    def __init__(self, args: ModelArgs, shared_expert: nn.Module) -> None:
        """``shared_expert``: a dense SwiGLU layer (:class:`llama.model.FeedForward`) of
        width ``args.moe_hidden_dim``, which every token goes through."""
        super().__init__()
        if args.moe_args is None:
            raise ValueError("params: an MoE layer needs moe_args")
        self.top_k = args.moe_args.top_k
        hidden = args.moe_hidden_dim
        self.experts = Experts(args.moe_args.num_experts, args.dim, hidden)
        # (dim, E), Meta's name and layout; replicated on every rank
        self.router_DE = nn.Parameter(torch.empty(args.dim, args.moe_args.num_experts), requires_grad=False)
        self.shared_expert = shared_expert
        self.expert_compute: Literal["grouped", "dense"] = "grouped"
        self.world_size = fs_init.get_model_parallel_world_size()

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, dim); ``lora_slots`` (B,) int64: each row's LoRA adapter slot (0: none;
        :mod:`llama.layers.lora`), for the shared expert's LoRA layers and the routed experts'
        :class:`~llama.layers.lora.LoraExperts`; None: the base model."""
        shape = x.shape
        # rank-partial, not yet reduced; the shared expert is llama.model.FeedForward, which this layer
        # does not import (the model sits above its layers), so its members are not typed here
        shared = self.shared_expert.partial(x, lora_slots).reshape(-1, shape[-1])  # type: ignore[operator]
        x = x.reshape(-1, shape[-1])  # (N, dim)
        scores = x @ self.router_DE  # (N, E), replicated on every rank
        top_scores, experts = torch.topk(scores, self.top_k, dim=-1)  # (N, k)
        gates = torch.sigmoid(top_scores.float()).to(x.dtype)
        # each token's row's slot: (B,) -> (B * T,)
        token_slots = None if lora_slots is None else lora_slots.repeat_interleave(x.shape[0] // lora_slots.shape[0])
        compute = self.experts.grouped if self.expert_compute == "grouped" else self.experts.dense
        out = shared + compute(x, experts, gates, token_slots)
        return sum_over_ranks(out).view(shape)


class Int8Experts(Experts):
    """Experts whose matrices are stored per expert as the int8 linear layers store theirs,
    (out, in): ``w1_int8`` (E, out, in) and ``w1_scale`` (E, out), and so on for w2, w3."""

    quantized = "int8"

    def product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        return int8_product(x, getattr(self, name + "_int8")[e], getattr(self, name + "_scale")[e], self.policy)


class Int4Experts(Experts):
    """Experts whose matrices are stored per expert as the int4 linear layers store theirs:
    ``w1_int4`` (E, packed by torch for the device), ``w1_scales_and_zeros`` (E, in / group,
    out, 2), with ``int4_group_size`` and ``int4_out_features`` (by name; stored rows are
    padded to a multiple of 16).  Where the policy uses our CPU kernel, each matrix is held in
    its layout instead, as the int4 linear layers do (:class:`llama.layers.quantized.Int4Weight`):
    ``int4_kernel_rows`` (by name, (E, rows, bytes)), ``int4_in_features`` (by name); torch's
    packing dropped, and made again for ``state_dict()``."""

    quantized = "int4"
    int4_group_size: int
    int4_out_features: dict[str, int]
    # (llama.layers.prepare.use_cpu_int4_layout_)  None: torch's kernel (and its packing) multiplies.
    int4_kernel_rows: Optional[dict[str, torch.Tensor]] = None
    int4_in_features: dict[str, int]

    def product(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.int4_kernel_rows is not None:
            out = int4_product(x, None, None, self.int4_group_size, self.int4_kernel_rows[name][e], self.policy)
        else:
            out = int4_product(x, getattr(self, name + "_int4")[e], getattr(self, name + "_scales_and_zeros")[e],
                               self.int4_group_size, None, self.policy)
        width = self.int4_out_features[name]
        return out if out.shape[-1] == width else out[..., :width]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.int4_kernel_rows is None:
            return
        for name, stack in self.int4_kernel_rows.items():
            parts = [cpu_kernels.torch_int4_from_kernel_layout(rows, self.int4_in_features[name], self.int4_group_size)
                     for rows in stack]
            destination[prefix + name + "_int4"] = torch.stack([p for p, _ in parts])
            destination[prefix + name + "_scales_and_zeros"] = torch.stack([sz for _, sz in parts])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.int4_kernel_rows is not None:
            taken = set()
            for name, stack in self.int4_kernel_rows.items():
                keys = (prefix + name + "_int4", prefix + name + "_scales_and_zeros")
                taken.update(keys)
                if not all(key in state_dict for key in keys):
                    if strict:
                        missing_keys.extend(key for key in keys if key not in state_dict)
                    continue
                packed, sz = state_dict[keys[0]], state_dict[keys[1]]
                per_group = cpu_kernels.holds_scale_per_group(stack[0], self.int4_in_features[name])
                rows = torch.stack([cpu_kernels.pack_int4_from_torch(packed[e], sz[e], self.int4_in_features[name],
                                                                     per_group=per_group)
                                    for e in range(packed.shape[0])])
                if rows.shape != stack.shape:
                    error_msgs.append(f"size mismatch for {keys[0]}: the checkpoint's int4 experts "
                                      f"{tuple(packed.shape)} do not fit these "
                                      f"({tuple(stack.shape)} in the kernel's layout)")
                else:
                    self.int4_kernel_rows[name] = rows
            state_dict = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in taken}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
