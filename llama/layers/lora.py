"""LoRA adapters served unmerged, many at once: linear layers that add, to each row of a
batch, the low-rank product of that row's adapter.

A layer ``y = x @ W.T`` targeted by adapters becomes, for a row served with the adapter in
slot ``s``, ``y = x @ W.T + (x @ A_s.T) @ B_s.T`` (``B_s`` holding the adapter's scale,
``lora_alpha / r``, folded in).  The base product is whatever the layer's was (dense, int8,
int4, packed for a CPU kernel: a quantised base with float adapters is QLoRA's serving
shape) and runs once for all rows; the low-rank products follow each row's slot.

A LoRA layer is the base layer's own class with :class:`LoraColumn` or :class:`LoraRow`
before it (:func:`lora_class`), swapped in for it (:func:`use_lora_layers_`): the same
weights (the same tensors), the same ``state_dict()`` keys, ``isinstance`` still holds.  Its
factors are buffers outside ``state_dict()``:

* ``lora_a`` (slots, r, in_local): every slot's ``A``, rank padded with zeros to ``r``
  (``max_lora_rank``);
* ``lora_b`` (slots, r, out_local): every slot's ``B`` transposed, times its scale, likewise
  padded (transposed so that a row's B, or every slot's, is a contiguous (r, out) matrix).

Slot 0 is "no adapter": its factors stay zero, so rows without an adapter get exactly the
base's output (plus zero).  Loading an adapter writes its slot in place
(:meth:`LoraWeights.set_lora_slot`): a compiled step keeps reading the same buffers, and a
new mix of adapters in a batch changes only the values of the per-row slot indices (a step
input, ``lora_slots`` (B,) int64), never a shape: no recompilation.

Under tensor parallelism a column-parallel layer holds ``A`` whole and its rows of ``B``; a
row-parallel layer its columns of ``A`` and ``B`` whole: the r-wide partial product of each
rank, times ``B``, is added to the rank's partial output *before* the layer's all-reduce,
which sums both (``B`` is linear, so summing after it is summing before it).

Two ways to compute the low-rank products (``product``):

* ``"gather"``: each row's ``A`` and ``B`` gathered by its slot, two batched products
  (B, T, in) x (B, in, r) -> (B, T, r) x (B, r, out): work proportional to the rows;
* ``"masked"``: every slot's ``A`` stacked, one product (B, T, in) x (in, slots * r), the
  columns of other slots zeroed per row, one product with every slot's ``B``: work
  proportional to the slots, no gather;
* ``"auto"`` (the default): gather for one row, masked for more.  Timed eagerly on the 150m
  shape's 32 fused groups (wq/wk/wv, wo, w1/w3, w2 of 8 blocks; rank 16, 4 adapters, float32
  factors, bfloat16 activations; one thread's CPU time, the median of 15 runs on a busy
  machine): one row, gather 5.9 ms against masked 11.0 ms (masked multiplies every slot's
  factors); eight rows of four adapters, masked 19.9 ms against gather 41.7 ms (gather copies
  each row's factors and runs batched products of one row each).  A compiled step specialises
  one row anyway (torch.compile treats a size of 1 apart), so the choice costs no graph.  (B
  kept as (r, out) per slot halved the one-row gather: 12.5 ms with B as (out, slots, r).)

Where a block's wq, wk, wv (or w1, w3) multiply as one matrix (quantised or packed weights), their
low-rank products are one pair of products too (:class:`LoraFusedProjections`): 8 low-rank
products a block instead of 14.

Llama 4's MoE layers: the shared expert is a dense feed-forward layer (LoRA layers as above);
the routed experts' stacked matrices get their factors per expert and per slot
(:class:`LoraExperts`, as vLLM's ``fused_moe_lora`` keeps them), and each expert's tokens,
sorted by slot, make one pair of low-rank products per adapter among them.

On the CPU, bfloat16/float16 models keep their factors in float32 (:func:`factor_dtype`):
torch's small half-precision products there are several times slower than float32's (the
same timing in bfloat16: one row, gather 81 ms; eight rows, masked 62 ms), and the factors
are a small share of the weights.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional, Union, cast

import torch
from torch import nn

from llama.layers.collectives import enter_parallel_region, gather_last_dim, sum_over_ranks
from llama.layers.parallel import ColumnParallel, ParallelLinear, RowParallel, replace_module_
from llama.layers.quantized import FusedProjections

__all__ = ["LoraProduct", "LORA_PRODUCTS", "LoraWeights", "LoraColumn", "LoraRow", "LoraFusedProjections",
           "LoraExperts", "ExpertMatrix", "lora_class", "lora_layer", "use_lora_layers_", "project", "LORA_TARGETS",
           "factor_dtype", "lora_factor_bytes"]

LoraProduct = Literal["auto", "gather", "masked"]
LORA_PRODUCTS: tuple[str, ...] = ("auto", "gather", "masked")

# The layers of a block an adapter may change, by their attribute: a self-attention layer's
# projections, a dense feed-forward layer's and a Llama 4 MoE layer's shared expert's (also a
# dense feed-forward layer), and the MoE layer's routed experts' stacked matrices
# (:class:`LoraExperts`).  The cross-attention layers of Llama 3.2 Vision are not served unmerged.
LORA_TARGETS = {"attention": ("wq", "wk", "wv", "wo"), "feed_forward": ("w1", "w2", "w3"),
                "shared_expert": ("w1", "w2", "w3"), "experts": ("w1", "w2", "w3")}


class LoraWeights:
    """Every loaded adapter's factors of one layer, by slot (see the module's docstring)."""

    lora_a: torch.Tensor  # (slots, r, in_local)
    lora_b: torch.Tensor  # (slots, r, out_local): B.T, scale folded in
    lora_product: str

    def lora_delta(self, x: torch.Tensor, lora_slots: torch.Tensor) -> torch.Tensor:
        """The rows' low-rank products: ``x`` (B, T, in_local) (this rank's input), ``lora_slots``
        (B,) int64 -> (B, T, out_local) in the factors' dtype (this rank's part of the output)."""
        a, b = self.lora_a, self.lora_b
        x = x.to(a.dtype)
        if self.lora_product == "gather" or (self.lora_product == "auto" and x.shape[0] == 1):
            xa = torch.bmm(x, a[lora_slots].transpose(1, 2))  # (B, T, r)
            return torch.bmm(xa, b[lora_slots])  # (B, T, out)
        n_slots, r, _ = a.shape
        xa = x @ a.reshape(n_slots * r, -1).t()  # (B, T, slots * r): every slot's
        owner = torch.arange(n_slots, device=x.device).repeat_interleave(r)  # each column's slot
        keep = (owner == lora_slots.unsqueeze(1)).to(xa.dtype)  # (B, slots * r): the row's slot's columns
        return (xa * keep.unsqueeze(1)) @ b.reshape(n_slots * r, b.shape[-1])

    @torch.no_grad()
    def set_lora_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float) -> None:
        """Put an adapter's factors of this layer in ``slot`` (1 or more; slot 0 is no adapter):
        ``a`` (r, in_local) and ``b`` (out_local, r), this rank's slices; None: the adapter does
        not change this layer (its slot is zero)."""
        if not 1 <= slot < self.lora_a.shape[0]:
            raise ValueError(f"LoRA slot {slot} is out of range 1..{self.lora_a.shape[0] - 1}")
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or r > self.lora_a.shape[1] \
                or a.shape[1] != self.lora_a.shape[2] or b.shape[0] != self.lora_b.shape[2]:
            raise ValueError(f"LoRA factors A {list(a.shape)} and B {list(b.shape)} do not fit a layer of "
                             f"{self.lora_b.shape[2]} x {self.lora_a.shape[2]} (this rank's) with rank up to "
                             f"{self.lora_a.shape[1]}")
        self.lora_a[slot, :r] = a.to(self.lora_a.dtype)
        self.lora_b[slot, :r] = (b.to(torch.float32) * scale).t().to(self.lora_b.dtype)


class LoraExperts(nn.Module):
    """Every loaded adapter's factors of one MoE layer's routed experts (:class:`llama.layers.moe.Experts`),
    for the stacked matrices adapters change (``w1``, ``w2``, ``w3``: PEFT's ``gate_up_proj`` and
    ``down_proj``), per slot *and per expert*, as vLLM's ``fused_moe_lora`` keeps them: expert
    ``e`` of a row served with slot ``s`` computes ``x @ W[e] + (x @ A[s, e].T) @ B[s, e]``.

    Buffers (outside ``state_dict()``), for each matrix ``name`` changed:

    * ``lora_a_<name>`` (slots, E, r, in_local): A of every slot and expert (what meets the input);
    * ``lora_b_<name>`` (slots, E, r, out_local): B, the adapter's scale folded in.

    The experts' matrices are ``x @ W[e]`` with ``W`` (E, in, out) (Meta's w1/w3 (E, dim, hidden),
    w2 (E, hidden, dim)); an adapter's change of ``W[e]`` is ``scale * b[e] @ a[e]``
    (:func:`llama.lora.adapter.read_adapter`'s 3-D factors: ``b`` (E, in, r), ``a`` (E, r, out)),
    so ``x @ b[e]`` is the r-wide product and ``lora_a`` holds ``b`` transposed, ``lora_b``
    ``scale * a``.  Under tensor parallelism each rank holds its slice of the hidden units, as
    the experts' matrices are split: w1/w3's B columns, w2's A columns; w2's partial products
    are summed with the MoE layer's own all-reduce.

    The rows of an expert reach it sorted by slot (:meth:`delta`'s ``counts``): each adapter's
    rows of that expert make one pair of products (the base product runs once for all of them)."""

    def __init__(self, experts: nn.Module, names: list[str], n_slots: int, max_rank: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.names = tuple(sorted(names))
        if not self.names or not set(self.names) <= {"w1", "w2", "w3"}:
            raise ValueError(f"LoRA on routed experts changes w1, w2 or w3, got {names!r}")
        tensors = [*experts.parameters(), *experts.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        n_experts = cast(int, experts.num_experts)
        for name in self.names:
            in_local, out_local = _expert_matrix_shape(experts, name)
            self.register_buffer(f"lora_a_{name}", torch.zeros(n_slots, n_experts, max_rank, in_local, dtype=dtype,
                                                               device=device), persistent=False)
            self.register_buffer(f"lora_b_{name}", torch.zeros(n_slots, n_experts, max_rank, out_local, dtype=dtype,
                                                               device=device), persistent=False)

    @property
    def n_slots(self) -> int:
        return self.factors(self.names[0])[0].shape[0]

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(``lora_a``, ``lora_b``) of matrix ``name``."""
        return getattr(self, f"lora_a_{name}"), getattr(self, f"lora_b_{name}")

    def delta(self, name: str, e: int, x: torch.Tensor, counts: list[int]) -> Optional[torch.Tensor]:
        """Expert ``e``'s low-rank products of matrix ``name`` for its rows ``x`` (n, in_local),
        sorted by slot: ``counts[s]`` rows of slot ``s`` after those of the slots before.  (n,
        out_local) in the factors' dtype; None where ``name`` has no factors."""
        if name not in self.names:
            return None
        a, b = self.factors(name)
        out = x.new_zeros((x.shape[0], b.shape[-1]), dtype=b.dtype)
        start = 0
        for slot, n in enumerate(counts):
            if slot and n:  # slot 0 (no adapter) adds nothing
                out[start : start + n] = (x[start : start + n].to(a.dtype) @ a[slot, e].t()) @ b[slot, e]
            start += n
        return out

    @torch.no_grad()
    def set_lora_slot(self, name: str, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor],
                      scale: float) -> None:
        """Put an adapter's factors of matrix ``name`` in ``slot`` (1 or more): ``a`` (E, r,
        out_local) and ``b`` (E, in_local, r), this rank's slices of
        :func:`~llama.lora.adapter.read_adapter`'s 3-D factors (the change of ``W[e]`` is
        ``scale * b[e] @ a[e]``); None: the adapter does not change it (its slot is zero)."""
        lora_a, lora_b = self.factors(name)
        if not 1 <= slot < lora_a.shape[0]:
            raise ValueError(f"LoRA slot {slot} is out of range 1..{lora_a.shape[0] - 1}")
        lora_a[slot].zero_()
        lora_b[slot].zero_()
        if a is None or b is None:
            return
        n_experts, r = a.shape[0], a.shape[1]
        if a.dim() != 3 or b.dim() != 3 or b.shape[0] != n_experts or b.shape[2] != r or n_experts != lora_a.shape[1] \
                or r > lora_a.shape[2] or b.shape[1] != lora_a.shape[3] or a.shape[2] != lora_b.shape[3]:
            raise ValueError(f"LoRA factors of experts' {name}, a {list(a.shape)} and b {list(b.shape)}, do not fit "
                             f"{lora_a.shape[1]} experts of {lora_a.shape[3]} x {lora_b.shape[3]} (this rank's) "
                             f"with rank up to {lora_a.shape[2]}")
        lora_a[slot, :, :r] = b.transpose(1, 2).to(lora_a.dtype)
        lora_b[slot, :, :r] = (a.to(torch.float32) * scale).to(lora_b.dtype)


class ExpertMatrix:
    """One stacked matrix (``w1``, ``w2`` or ``w3``) of a MoE layer's :class:`LoraExperts`, as
    the adapters' loader writes it: :meth:`set_lora_slot` as a LoRA layer's."""

    def __init__(self, lora: LoraExperts, name: str) -> None:
        self.lora, self.name = lora, name

    def set_lora_slot(self, slot: int, a: Optional[torch.Tensor], b: Optional[torch.Tensor], scale: float) -> None:
        self.lora.set_lora_slot(self.name, slot, a, b, scale)


def _expert_matrix_shape(experts: nn.Module, name: str) -> tuple[int, int]:
    """(in_local, out_local) of the routed experts' stacked matrix ``name`` on this rank, whatever
    their storage (Meta's (E, in, out); int8/int4's per-expert (out, in) layers): from the model's
    split, w1/w3 (dim, hidden_local) and w2 (hidden_local, dim)."""
    dim, hidden = cast(tuple[int, int], experts.local_shape)
    return (dim, hidden) if name in ("w1", "w3") else (hidden, dim)


class LoraColumn(LoraWeights, ColumnParallel):
    """A column-parallel layer (its class after this one) with every slot's low-rank products."""

    def forward(self, input_: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = enter_parallel_region(input_)
        out = self.local_matmul(x)
        if lora_slots is not None:
            out = out + self.lora_delta(x, lora_slots).to(out.dtype)
        return gather_last_dim(out) if self.gather_output else out


class LoraRow(LoraWeights, RowParallel):
    """A row-parallel layer (its class after this one) with every slot's low-rank products,
    added to this rank's partial output before the layer's all-reduce."""

    def forward(self, input_: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        return sum_over_ranks(self.local_output(input_, lora_slots))

    def local_output(self, input_: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's partial output, before the sum over ranks (a MoE layer's shared expert
        adds it to the routed experts' before their one all-reduce)."""
        out = self.local_matmul(input_)
        if lora_slots is not None:
            out = out + self.lora_delta(input_, lora_slots).to(out.dtype)
        return out


_CLASSES: dict[type, type] = {}


def lora_class(base: type[ParallelLinear]) -> type[ParallelLinear]:
    """The LoRA class of layers of class ``base`` (made once): ``base`` with :class:`LoraColumn`
    or :class:`LoraRow` first, so that its forward adds the low-rank products and its product
    stays ``base``'s."""
    if issubclass(base, LoraWeights):
        return base
    made = _CLASSES.get(base)
    if made is None:
        mixin = LoraColumn if issubclass(base, ColumnParallel) else LoraRow
        if not issubclass(base, (ColumnParallel, RowParallel)):
            raise TypeError(f"{base.__name__} is not a column- or row-parallel layer")
        made = _CLASSES[base] = type(f"Lora{base.__name__}", (mixin, base), {"__module__": __name__})
    return made


def factor_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA factors are kept and multiplied in for a model of ``dtype`` on ``device``:
    float32 for half-precision models on the CPU (see the module's docstring), else ``dtype``."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def lora_layer(layer: ParallelLinear, n_slots: int, max_rank: int, dtype: torch.dtype,
               product: str = "auto") -> ParallelLinear:
    """A LoRA layer with ``layer``'s weights (the same tensors) and its product, and zero factors
    for ``n_slots`` slots (slot 0, no adapter, included) of rank up to ``max_rank`` in ``dtype``."""
    if product not in LORA_PRODUCTS:
        raise ValueError(f"LoRA product {product!r}: choose one of {', '.join(LORA_PRODUCTS)}")
    new = layer.swapped_to(lora_class(type(layer)))
    for key, value in vars(layer).items():
        if key in ("_parameters", "_buffers", "_non_persistent_buffers_set"):
            vars(new)[key].update(value)  # the same tensors
        elif key != "_modules":
            # the kind's own weights and attributes (int8, int4, packed) and hooks (a packed layer's
            # state-dict hook, which gives its weight back as a tensor)
            vars(new)[key] = copy.copy(value) if isinstance(value, (dict, set)) else value
    # The base layer stays alive with it: what it registered, it registered for its own life (a
    # packed layer's matrix, which compiled steps find by a key forgotten when its owner is freed).
    vars(new)["_lora_base_layer"] = (layer,)
    tensors = [*layer.parameters(), *layer.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    if isinstance(layer, ColumnParallel):
        in_local, out_local = layer.in_features, layer.output_size_per_partition
    else:
        in_local, out_local = layer.input_size_per_partition, layer.out_features
    new.register_buffer("lora_a", torch.zeros(n_slots, max_rank, in_local, dtype=dtype, device=device),
                        persistent=False)
    new.register_buffer("lora_b", torch.zeros(n_slots, max_rank, out_local, dtype=dtype, device=device),
                        persistent=False)
    cast(LoraWeights, new).lora_product = product
    return new


class LoraFusedProjections(LoraWeights, FusedProjections):
    """Fused projections (wq, wk, wv; w1, w3 multiplied as one matrix) whose layers have LoRA
    factors: the fused base product once, and the low-rank products of all its layers as one
    pair of products too.  Its ``lora_a`` (slots, k * r, in) stacks the k layers' A, its
    ``lora_b`` (slots, k * r, sum(sizes)) holds their B.T block-diagonally (layer i's r rows by
    its output columns, zeros elsewhere), so that ``(x @ A.T) @ B.T`` is every layer's change side
    by side, added to the fused product before it is split.  Each LoRA layer's own ``lora_a``
    and ``lora_b`` become views of its blocks: writing a layer's slot
    (:meth:`LoraWeights.set_lora_slot`) writes the fused factors.  ``layers``: the fused layers
    in order, None where one has no factors (its block stays zero)."""

    def __init__(self, inner: FusedProjections, layers: list[Optional[LoraWeights]]) -> None:
        super().__init__(inner.sizes)
        self.inner = inner
        given = [layer for layer in layers if layer is not None]
        if not given or len(layers) != len(inner.sizes):
            raise ValueError("fused LoRA projections need one entry per fused layer, at least one with factors")
        n_slots, rank, in_features = given[0].lora_a.shape
        like = given[0].lora_a
        k = len(layers)
        self.register_buffer("lora_a", torch.zeros(n_slots, k * rank, in_features, dtype=like.dtype,
                                                   device=like.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(n_slots, k * rank, sum(inner.sizes), dtype=like.dtype,
                                                   device=like.device), persistent=False)
        self.lora_product = given[0].lora_product
        row = 0
        for i, (layer, size) in enumerate(zip(layers, inner.sizes)):
            if layer is not None:
                if layer.lora_a.shape != (n_slots, rank, in_features) or layer.lora_b.shape != (n_slots, rank, size):
                    raise ValueError("fused LoRA projections need layers of the same slots, rank and input")
                columns = slice(i * rank, (i + 1) * rank)
                with torch.no_grad():
                    self.lora_a[:, columns] = layer.lora_a
                    self.lora_b[:, columns, row : row + size] = layer.lora_b
                layer.lora_a = self.lora_a[:, columns]
                layer.lora_b = self.lora_b[:, columns, row : row + size]
            row += size

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.product(x)

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        out = self.inner.product(x)
        if lora_slots is not None:
            out = out + self.lora_delta(x, lora_slots).to(out.dtype)
        return out.split(self.sizes, dim=-1)


def lora_factor_bytes(model: nn.Module) -> int:
    """Bytes of every LoRA factor buffer of ``model`` (the slots of :class:`LoraWeights` layers,
    fused projections and :class:`LoraExperts`), each storage once (a fused layer's factors are
    views of its fused projections')."""
    storages: dict[int, int] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name.rpartition(".")[2].startswith("lora_"):
            storage = buffer.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def project(layer: nn.Module, x: torch.Tensor, lora_slots: Optional[torch.Tensor]) -> torch.Tensor:
    """``layer(x)``, with each row's low-rank products where ``layer`` is a LoRA layer and the
    rows' slots are given."""
    if lora_slots is not None and isinstance(layer, LoraWeights):
        return layer(x, lora_slots)
    return layer(x)


def use_lora_layers_(model: nn.Module, targets: list[str], n_slots: int, max_rank: int, dtype: torch.dtype,
                     product: str = "auto") -> dict[str, Union[LoraWeights, ExpertMatrix]]:
    """Swap a LoRA layer (zero factors: :func:`lora_layer`) in for each of ``model``'s layers
    named in ``targets`` (as ``named_modules()`` names them, e.g. ``layers.0.attention.wq``),
    and wrap fused projections that hold any of them (:class:`LoraFusedProjections`); give a
    MoE layer's routed experts named there (``layers.1.feed_forward.experts.w1``, their
    tensor's name) their :class:`LoraExperts` (``experts.lora``).  Returns what each target's
    factors are written to (:meth:`set_lora_slot`), by name.  ValueError for a name that is not
    a layer adapters may change (:data:`LORA_TARGETS`)."""
    modules = dict(model.named_modules())
    made: dict[str, LoraWeights] = {}
    experts: dict[str, list[str]] = {}  # the experts' module -> the matrices changed
    for name in sorted(set(targets)):
        parent_name, _, attr = name.rpartition(".")
        block_name, _, kind = parent_name.rpartition(".")
        layer = modules.get(name)
        parent = modules.get(parent_name)
        if kind == "experts" and attr in LORA_TARGETS["experts"] and hasattr(parent, "grouped"):
            experts.setdefault(parent_name, []).append(attr)
            continue
        allowed = attr in LORA_TARGETS.get(kind, ()) and block_name.startswith("layers.") \
            and hasattr(parent, "packable_input_projections")  # Attention and FeedForward (dense or shared expert)
        if not allowed or not isinstance(layer, (ColumnParallel, RowParallel)):
            raise ValueError(f"an adapter changes {name!r}, which is not a layer LoRA adapters can change served "
                             "unmerged (layers.N.attention.wq/wk/wv/wo, layers.N.feed_forward.w1/w2/w3 of dense "
                             "feed-forward layers, Llama 4's shared_expert.w1/w2/w3 and experts.w1/w2/w3): merge it "
                             "into the checkpoint instead (merge_lora)")
        if isinstance(layer, LoraWeights):
            made[name] = layer
            continue
        new = lora_layer(layer, n_slots, max_rank, dtype, product)
        replace_module_(model, layer, new)
        made[name] = cast(LoraWeights, new)
    for parent_name in {name.rpartition(".")[0] for name in made}:
        parent = model.get_submodule(parent_name)
        fused = getattr(parent, "fused", None)
        if isinstance(fused, FusedProjections) and not isinstance(fused, LoraFusedProjections):
            names = getattr(parent, "packable_input_projections")
            parent.fused = LoraFusedProjections(fused, [made.get(f"{parent_name}.{n}") for n in names])
    writers: dict[str, Union[LoraWeights, ExpertMatrix]] = dict(made)
    for experts_name, matrices in experts.items():
        module = model.get_submodule(experts_name)  # llama.layers.moe.Experts, which imports this module
        lora = cast(Optional[LoraExperts], getattr(module, "lora", None))
        if lora is None:
            lora = LoraExperts(module, matrices, n_slots, max_rank, dtype)
            module.lora = lora
        elif not set(matrices) <= set(lora.names):
            raise ValueError(f"{experts_name} already serves LoRA adapters of {', '.join(lora.names)}: load every "
                             "adapter at once")
        for matrix in matrices:
            writers[f"{experts_name}.{matrix}"] = ExpertMatrix(lora, matrix)
    return writers
