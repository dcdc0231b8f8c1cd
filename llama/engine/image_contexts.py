"""The image contexts of running Llama 3.2 Vision requests: each request's
:class:`~llama.model.ImageContext` (its images' cross-attention keys and values, one set per
cross-attention layer) computed once, when its prefill first runs, held for the request's life
and given to every later forward of it (prompt chunks, decoding, verification), and let go
when the request ends (finished, cancelled, failed, aborted) or is preempted (its resumed
prefill computes it again).  The scheduler lets them go (:meth:`ImageContexts.release`, beside
the request's blocks); the runner computes and reads them.

Their memory is a second pool beside the KV cache's blocks, counted in *image slots*: one
slot holds one image's K/V (every cross-attention layer's keys and values over its real tiles;
counted at the most, ``vision_max_num_chunks`` tiles: :func:`llama.checkpoint.memory.image_kv_bytes`
for one image).  The pool has ``max_batch_size`` slots, what the memory check counts (one
image a row), and the slots in use are those of the running requests' images (preempted
requests hold none): the scheduler admits or resumes a request only while its images' slots
are free (it waits otherwise; a request of k images counts k slots, and every running request with
images counts as many as the one with the most, :meth:`ImageContexts.footprint`, so that a step's
batched copy of the rows' K/V fits the pool's size too), and a request with more images than the pool holds is refused
when submitted.  Not blocks of the paged cache: an image's K/V is one tensor per layer, read
whole by every step of its request, and its size (at most 6,404 vision tokens an image for 11B,
per cross-attention layer) is fixed per image, while blocks serve a sequence that grows; counting
it in blocks would reserve pool blocks that hold nothing (the K/V lives outside the pool) and
shrink the text's cache by as much again.

A step's rows are batched into one :class:`~llama.model.CrossAttentionInputs`: each row's
keys and values zero-padded to the longest row's vision tokens, never attended (the mask),
and rows without images (text-only requests, padding rows) masked out of the cross-attention
layers altogether, which then add exactly nothing to them."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from llama.model import CrossAttentionInputs, ImageContext, Transformer

if TYPE_CHECKING:
    from llama.engine.requests import RunningRequest

logger = logging.getLogger(__name__)


class ImageContexts:
    """Running requests' image contexts, by request id, and the pool's size in image slots
    (``capacity``: None where the model has no cross-attention layers, whose images hold none)."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"image slots must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._held: dict[int, ImageContext] = {}
        # The last step's rows (request id or None, row by row) and their batched keys and values:
        # decoding steps mostly feed the same rows, which then reuse them rather than copy every
        # row's K/V again.  Dropped when one of its requests is let go.
        self._batched: Optional[tuple[tuple[Optional[int], ...], list[tuple[torch.Tensor, torch.Tensor]]]] = None

    def slots(self, images: Sequence[Any]) -> int:
        """The slots a request with ``images`` holds while it runs (0 where the pool counts none)."""
        return len(images) if self.capacity is not None else 0

    @staticmethod
    def footprint(slots: Sequence[int]) -> int:
        """The image slots that running requests holding ``slots`` each count against the pool: the
        requests with images times the most any holds.  That bounds both their held K/V (the sum)
        and a step's batched copy of it (a row per such request, each as wide as the widest:
        :func:`batch_cross_attention`); with one image a request, the number of images."""
        held = [n for n in slots if n]
        return len(held) * max(held, default=0)

    def fits(self, slots: Sequence[int], images: Sequence[Any]) -> bool:
        """Whether a request with ``images`` may run beside running requests holding ``slots``."""
        return self.capacity is None or self.footprint([*slots, self.slots(images)]) <= self.capacity

    def check_fits(self, images: Sequence[Any]) -> None:
        """ValueError for a request with more images than the pool ever holds."""
        if self.capacity is not None and len(images) > self.capacity:
            raise ValueError(f"{len(images)} images in one request, more than the {self.capacity} the engine holds at "
                             "once (one per row: max_batch_size): send fewer images per request or build with a "
                             "larger max_batch_size")

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._held

    def request_ids(self) -> set[int]:
        """The requests whose contexts are held."""
        return set(self._held)

    def bytes_held(self) -> int:
        """Bytes of the keys and values held (every request's, every cross-attention layer's)."""
        return sum(t.numel() * t.element_size() for ctx in self._held.values() for kv in ctx.kv for t in kv)

    def bytes_batched(self) -> int:
        """Bytes of the last step's batched copy of its rows' keys and values, where one is kept."""
        return 0 if self._batched is None else sum(t.numel() * t.element_size() for kv in self._batched[1] for t in kv)

    def release(self, request_id: int) -> None:
        """``request_id`` runs no more (or is preempted): its context is let go."""
        self._held.pop(request_id, None)
        if self._batched is not None and request_id in self._batched[0]:
            self._batched = None

    def context(self, model: Transformer, request: "RunningRequest") -> Optional[ImageContext]:
        """``request``'s context (None for a text-only request), computed now if not held."""
        if not request.images:
            return None
        held = self._held.get(request.id)
        if held is None:
            from llama.images.mllama import stack_images

            images: list[Any] = list(request.images)  # MllamaPromptImage s (the engine checked them)
            batch = stack_images([images])
            tokens = torch.tensor([request.prompt], device=model.device)
            held = self._held[request.id] = model.image_context(batch.pixel_values, batch.aspect_ratio_ids, tokens)
        return held

    def cross_attention(self, model: Transformer, rows: Sequence[Optional["RunningRequest"]],
                        positions: torch.Tensor) -> Optional[CrossAttentionInputs]:
        """The cross-attention inputs of a step whose row ``i`` feeds ``rows[i]`` (None: a padding
        row) at ``positions`` (B, T); None when no row has an image (the layers are skipped)."""
        contexts = [self.context(model, r) if r is not None else None for r in rows]
        if all(c is None for c in contexts):
            return None
        key = tuple(r.id if r is not None and c is not None else None for r, c in zip(rows, contexts))
        kv = self._batched[1] if self._batched is not None and self._batched[0] == key else None
        inputs = batch_cross_attention(contexts, positions, kv)
        if sum(c is not None for c in contexts) > 1:  # a copy was made
            self._batched = (key, inputs.kv)
        return inputs


def batch_cross_attention(contexts: Sequence[Optional[ImageContext]], positions: torch.Tensor,
                          kv: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> CrossAttentionInputs:
    """One step's :class:`CrossAttentionInputs` from each row's context (None: no image) and the
    rows' ``positions`` (B, T), for the R rows with a context only (``row_index``, where R < B;
    the others skip the cross-attention layers): keys and values (R, Hkv, S, D) with S the
    longest of those rows' vision tokens (shorter rows zero-padded and masked; ``kv``: those
    already batched for these contexts, row for row; one row's are its own, not copied), the mask
    (R, 1, T, S) and the rows (R, T, 1).  The copy holds R x S vision tokens per layer, which the
    scheduler keeps within the image pool's size (:meth:`ImageContexts.footprint`)."""
    present = [(i, c) for i, c in enumerate(contexts) if c is not None]
    if not present:
        raise ValueError("no row has an image context")
    index = None if len(present) == len(contexts) else torch.tensor([i for i, _ in present])
    if len(present) == 1:
        i, c = present[0]
        return replace(c.inputs(positions[i : i + 1]), row_index=index)
    r, t = len(present), positions.shape[1]
    device = present[0][1].kv[0][0].device
    width = max(c.kv[0][0].shape[2] for _, c in present)
    if kv is None:
        kv = _batched_kv([c for _, c in present], width)
    mask = torch.zeros(r, 1, t, width, dtype=torch.bool, device=device)
    attending = torch.zeros(r, t, 1, dtype=torch.bool, device=device)
    for j, (i, c) in enumerate(present):
        row = c.inputs(positions[i : i + 1])
        mask[j, :, :, : row.mask.shape[-1]] = row.mask[0]
        attending[j] = row.rows[0]
    return CrossAttentionInputs(kv, mask, attending, index)


def _batched_kv(contexts: Sequence[ImageContext], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values (R, Hkv, width, D) of the R contexts, zeros past a row's own
    vision tokens."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer, (k0, _) in enumerate(contexts[0].kv):
        keys = k0.new_zeros(len(contexts), k0.shape[1], width, k0.shape[3])
        values = torch.zeros_like(keys)
        for j, c in enumerate(contexts):
            k, v = c.kv[layer]
            keys[j, :, : k.shape[2]] = k[0]
            values[j, :, : v.shape[2]] = v[0]
        kv.append((keys, values))
    return kv
