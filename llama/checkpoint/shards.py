"""Checkpoint I/O: finding shards, safe lazy loading, and resharding.

A Meta checkpoint is ``params.json`` plus ``consolidated.00.pth .. consolidated.NN.pth``,
one file per model-parallel rank of the run that saved it.  Here any number of
processes M can load a checkpoint of N shards: each rank works out which slice of
each full ("logical") tensor it needs (:mod:`llama.layers.tensor_parallel`), and copies just
that from the shards that hold it.  Shards are opened with
``torch.load(mmap=True, weights_only=True)``: nothing is read until it is copied, and a
pickle that would run code is refused.
"""

from __future__ import annotations

import codecs
import ctypes
import ctypes.util
import io
import itertools
import logging
import mmap
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from llama.args import ModelArgs
from llama.layers.tensor_parallel import (
    IGNORED_KEYS,
    LAYER_INDEX,
    Region,
    full_shapes,
    holder_region,
    is_vision_tensor,
    shard_shape,
    tensor_names,
)
from llama.runtime.finite import check_finite_weight

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used as it is (names the file and the tensor)."""


def find_shards(ckpt_dir: PathLike) -> list[Path]:
    """The ``*.pth`` shards of a checkpoint directory, in rank order."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    shards = sorted(ckpt_dir.glob("*.pth"))
    if not shards:
        raise FileNotFoundError(f"no checkpoint shards (*.pth) in {ckpt_dir}")
    numbered = {}
    for path in shards:
        match = re.fullmatch(r"consolidated\.(\d+)\.pth", path.name)
        if match:
            numbered[int(match.group(1))] = path
    if not numbered:
        return shards  # not Meta's naming: take the files in name order
    others = [p.name for p in shards if p not in numbered.values()]
    if others:
        logger.warning("%s: ignoring %s (not consolidated.NN.pth shards)", ckpt_dir, others)
    missing = [i for i in range(max(numbered) + 1) if i not in numbered]
    if missing:
        names = ", ".join(f"consolidated.{i:02d}.pth" for i in missing)
        raise FileNotFoundError(f"{ckpt_dir} is missing shard(s) {names}: the download is incomplete")
    return [numbered[i] for i in sorted(numbered)]


def open_shard(path: PathLike) -> dict[str, torch.Tensor]:
    """Map a shard lazily (nothing is read yet) without running any pickled code."""
    path = Path(path)
    if path.exists() and not path.is_file():  # torch.load would wait forever on a FIFO
        raise CheckpointError(f"checkpoint shard {path} is not a regular file (a directory, FIFO or device?)")
    try:
        # Meta's Llama 4 shards also hold small byte buffers (``*._extra_state``, left by
        # the training framework): allowing io.BytesIO (and the codecs.encode its bytes are
        # pickled with) lets them be read as data; nothing else is allowed.
        with torch.serialization.safe_globals([io.BytesIO, codecs.encode]):
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor checkpoint, and loading it would run code "
            f"stored in the file ({str(e).splitlines()[-1][:200]}). Re-save it as a dict of tensors."
        ) from None
    except FileNotFoundError:
        raise
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"cannot read checkpoint shard {path}: the file is truncated, corrupted or not a torch.save "
            f"zip file ({str(e).splitlines()[0][:200]}). Download it again (download.sh verifies checksums)."
        ) from None
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if not (isinstance(v, io.BytesIO) and str(k).endswith("._extra_state"))}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a dict of tensors")
    return state


# Meta's released Llama 4 shards name some tensors as its training code stored them (the
# names llama-models' load hooks translate).  Per shard: attention's q, k and v rows are
# one ``wqkv`` (this shard's q rows, then its k rows, then its v rows); a dense layer's w1
# and w3 are one ``mlp.fc1_weight`` (w1 rows, then w3 rows); the experts' weights are
# flattened to 2-D (E * dim, hidden / shards) and (E * hidden / shards, dim).
_RELEASE_RENAMES = {
    "attention.wqkv.layer_norm_weight": "attention_norm.weight",
    "feed_forward.norm.weight": "ffn_norm.weight",
    "feed_forward.mlp.layer_norm_weight": "ffn_norm.weight",
    "feed_forward.mlp.fc2_weight": "feed_forward.w2.weight",
    "feed_forward.w_in_shared_FD.weight": "feed_forward.shared_expert.w1.weight",
    "feed_forward.w_swiglu_FD.weight": "feed_forward.shared_expert.w3.weight",
    "feed_forward.w_out_shared_DF.weight": "feed_forward.shared_expert.w2.weight",
}
# Meta's flattened experts' weights: (our name, whether their rows are experts x dim).
_RELEASE_EXPERTS = {"moe_w_in_eD_F": ("w1", True), "moe_w_swiglu_eD_F": ("w3", True), "moe_w_out_eF_D": ("w2", False)}
# Routing statistics kept by training; not part of the model.
_RELEASE_IGNORED_SUFFIXES = ("global_gate_stats_3E", "running_gate_stats_3E", "expert_activation_DE")


def with_release_names(
    state: dict[str, torch.Tensor], args: ModelArgs, n_shards: int, path: PathLike = "checkpoint"
) -> dict[str, torch.Tensor]:
    """``state`` (one shard of ``n_shards``, read from ``path``) with Meta's Llama 4 release
    names turned into this library's (views of the mapped tensors: nothing is read).
    Llama 3.2 Vision's shards keep the text model under ``text_model.`` (llama-models'
    ``CrossAttentionTransformer``): the prefix is dropped, as the model holds those tensors.
    Other checkpoints come back as they are.  A fused tensor that ``params.json``'s head
    counts or expert count cannot split is refused with :class:`CheckpointError`."""
    if any(k.startswith("text_model.") for k in state):
        state = {k.removeprefix("text_model."): t for k, t in state.items()}
    if not any(".wqkv." in k or ".mlp.fc1_weight" in k or ".experts.moe_w_" in k for k in state):
        return state
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        match = LAYER_INDEX.match(key)
        if match is None:
            out[key] = t
            continue
        prefix, rest = match.group(0), key[match.end():]
        if rest.endswith(_RELEASE_IGNORED_SUFFIXES):
            continue
        if rest == "attention.wqkv.weight":
            n_kv_local = args.n_kv_heads // n_shards if n_shards <= args.n_kv_heads else 1
            q_rows, kv_rows = args.n_heads // n_shards * args.head_dim, n_kv_local * args.head_dim
            if t.dim() != 2 or t.shape[0] != q_rows + 2 * kv_rows:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has shape {list(t.shape)}, but params.json (n_heads={args.n_heads}, "
                    f"n_kv_heads={args.n_kv_heads}, head_dim={args.head_dim}, over {n_shards} shard(s)) implies "
                    f"{q_rows + 2 * kv_rows} rows: check that params.json belongs to this checkpoint"
                )
            wq, wk, wv = t.split([q_rows, kv_rows, kv_rows])
            out.update({prefix + "attention.wq.weight": wq, prefix + "attention.wk.weight": wk,
                        prefix + "attention.wv.weight": wv})
        elif rest == "feed_forward.mlp.fc1_weight":
            w1, w3 = t.chunk(2, dim=0)
            out.update({prefix + "feed_forward.w1.weight": w1, prefix + "feed_forward.w3.weight": w3})
        elif rest.rsplit(".", 1)[-1] in _RELEASE_EXPERTS and rest.startswith("feed_forward.experts."):
            if args.moe_args is None:
                raise CheckpointError(f"{path} holds experts ({key!r}) but params.json has no moe_args")
            e, dim = args.moe_args.num_experts, args.dim
            ours, rows_are_dim = _RELEASE_EXPERTS[rest.rsplit(".", 1)[1]]
            # (E * dim, hidden / N) for w1 and w3, (E * hidden / N, dim) for w2
            if rows_are_dim:
                fits = t.dim() == 2 and t.shape[0] == e * dim
            else:
                fits = t.dim() == 2 and t.shape[1] == dim and t.shape[0] % e == 0
            if not fits:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has shape {list(t.shape)}, which does not hold "
                    f"moe_args.num_experts={e} experts of dim={dim} as params.json says: check that "
                    "params.json belongs to this checkpoint"
                )
            out[prefix + "feed_forward.experts." + ours] = t.view(e, dim, -1) if rows_are_dim else t.view(e, -1, dim)
        else:
            out[prefix + _RELEASE_RENAMES.get(rest, rest)] = t
    return out


def detect_embedding_layout(
    shard_embedding_shape: Sequence[int], args: ModelArgs, n_shards: int, path: PathLike = "checkpoint"
) -> Optional[str]:
    """How a checkpoint split ``tok_embeddings``: ``"vocab"``, ``"dim"``, or None when unsplit.

    Read from the shard's shape against ``params.json``, not from a version flag.
    """
    shape = tuple(shard_embedding_shape)
    if n_shards == 1 and shape == (args.vocab_size, args.dim):
        return None
    if n_shards > 1:
        if shape == (args.vocab_size // n_shards, args.dim) and args.vocab_size % n_shards == 0:
            return "vocab"
        if shape == (args.vocab_size, args.dim // n_shards) and args.dim % n_shards == 0:
            return "dim"
    raise CheckpointError(
        f"{path}: tok_embeddings.weight has shape {list(shape)}, which fits neither a vocabulary split "
        f"nor an embedding-dim split of ({args.vocab_size}, {args.dim}) over {n_shards} shard(s); "
        "check that params.json and the tokenizer belong to this checkpoint"
    )


@dataclass(frozen=True)
class CheckpointInfo:
    """What the shard files say about how they were split."""

    shards: tuple[Path, ...]
    embedding_layout: Optional[str]  # None: unsplit (one shard)
    dtype: torch.dtype

    @property
    def n_shards(self) -> int:
        return len(self.shards)


def inspect_checkpoint(shards: Sequence[Path], args: ModelArgs) -> CheckpointInfo:
    """Learn the embedding split and dtype, and check every shard's tensor names and
    shapes against ``params.json`` before anything is built.

    Shards are mapped, not read: only their tables of contents are looked at.  A
    ``params.json`` that does not describe these shards (another n_layers, dim, head
    count, FFN width) is refused here with :class:`CheckpointError`, rather than
    building a model of the wrong size (or a truncated one) first.
    """
    first = with_release_names(open_shard(shards[0]), args, len(shards), shards[0])
    if "tok_embeddings.weight" not in first:
        raise CheckpointError(f"{shards[0]} has no tensor 'tok_embeddings.weight': is it a Meta Llama checkpoint?")
    emb = first["tok_embeddings.weight"]
    layout = detect_embedding_layout(emb.shape, args, len(shards), shards[0])
    for index, path in enumerate(shards):
        state = first if index == 0 else with_release_names(open_shard(path), args, len(shards), path)
        _check_contents(state, args, path, index, len(shards), layout or "vocab")
    return CheckpointInfo(tuple(shards), layout, emb.dtype)


_LAYER_NUMBER = re.compile(r"^layers\.(\d+)\.")


def _check_contents(
    state: Mapping[str, torch.Tensor], args: ModelArgs, path: Path, shard: int, n_shards: int, layout: str
) -> None:
    """Refuse a shard whose layers or tensor shapes are not those ``params.json`` declares."""
    layers = {int(m.group(1)) for m in map(_LAYER_NUMBER.match, state) if m}
    # Distinct indices from 0: as many as n_layers, the largest n_layers - 1, is exactly
    # 0 .. n_layers - 1.  Compared without enumerating range(n_layers), which a hostile
    # params.json (n_layers 10**9) would make exhaust memory.
    if len(layers) != args.n_layers or max(layers, default=-1) != args.n_layers - 1:
        held = f"{len(layers)} layers (layers.{min(layers)} .. layers.{max(layers)})" if layers else "no layers"
        # The first few gaps: at most len(layers) + 5 indices are looked at.
        gaps = list(itertools.islice((i for i in range(max(layers, default=-1) + 1) if i not in layers), 5))
        raise CheckpointError(
            f"{path} holds {held}{f', with layers {gaps[:5]} missing' if gaps else ''}, but params.json says "
            f"n_layers={args.n_layers}: the params.json does not belong to these shards (or a shard is "
            "damaged); use the params.json that came with the checkpoint"
        )
    missing = [name for name in tensor_names(args) if name not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{path} is missing tensor {missing[0]!r}{more}: is it a complete Meta Llama checkpoint?"
        )
    for name, full_shape in full_shapes(args).items():
        expected = shard_shape(name, full_shape, n_shards, shard, layout, args.head_dim)
        if tuple(state[name].shape) != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(state[name].shape)}, but params.json "
                f"(and {n_shards} shard(s)) imply {list(expected)}: check that params.json belongs to "
                "this checkpoint"
            )




def _read_plan(
    name: str,
    full_shape: tuple[int, ...],
    info: CheckpointInfo,
    target_layout: str,
    world_size: int,
    rank: int,
    head_dim: int,
) -> Iterator[tuple[int, Region, Region]]:
    """Where this rank's slice of ``name`` comes from.

    Yields (shard index, region of the shard's tensor, region of the rank's tensor),
    regions relative to each tensor: copy the first into the second.  Shards holding
    copies of the same data (replicated norms, replicated K/V heads) are read once.
    """
    want = holder_region(name, full_shape, world_size, rank, target_layout, head_dim)
    source_layout = info.embedding_layout or target_layout
    seen: set[Region] = set()
    for shard in range(info.n_shards):
        have = holder_region(name, full_shape, info.n_shards, shard, source_layout, head_dim)
        if have in seen:
            continue
        seen.add(have)
        overlap = tuple((max(w0, h0), min(w1, h1)) for (w0, w1), (h0, h1) in zip(want, have))
        if all(start < end for start, end in overlap):
            yield (
                shard,
                tuple((start - h0, end - h0) for (start, end), (h0, _) in zip(overlap, have)),
                tuple((start - w0, end - w0) for (start, end), (w0, _) in zip(overlap, want)),
            )


def _narrow(t: torch.Tensor, region: Region) -> torch.Tensor:
    for axis, (start, end) in enumerate(region):
        if (start, end) != (0, t.shape[axis]):
            t = t.narrow(axis, start, end - start)
    return t


def _release_pages(t: torch.Tensor) -> None:
    """Tell the kernel the mapped pages under ``t`` can be dropped (they are re-read
    from the file if touched again), so a rank's resident memory holds its own
    weights plus about one tensor rather than every page it has copied from."""
    if _libc is None or t.numel() == 0:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    aligned = start - start % page
    _libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), 4)  # MADV_DONTNEED


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError, TypeError):
        return None


_libc = _load_libc()


def iter_rank_tensors(
    info: CheckpointInfo,
    args: ModelArgs,
    local_shapes: Mapping[str, torch.Size],
    target_layout: str,
    world_size: int,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's tensors named in ``local_shapes``, one at a time and in that order:
    (name, tensor of that shape on ``device`` in ``dtype``).  Each is made when asked for
    and copied from every shard that holds part of it (a rank's slice may span several
    shards), so a caller that turns each into something smaller (quantised weights) and
    lets it go holds one full-precision tensor at a time.  Shards are mapped once, on first
    use, and the pages of each source tensor are released once copied."""
    shapes = full_shapes(args)
    unknown = set(local_shapes) - set(shapes)
    if unknown:
        raise KeyError(f"not tensors of this model: {sorted(unknown)[:5]}")
    plans = {
        name: list(_read_plan(name, shapes[name], info, target_layout, world_size, rank, args.head_dim))
        for name in local_shapes
    }
    opened: dict[int, dict[str, torch.Tensor]] = {}
    for name, shape in local_shapes.items():
        out = torch.empty(shape, dtype=dtype, device=device)
        for shard, src, dst in plans[name]:
            if shard not in opened:
                opened[shard] = _open_for_reading(info, args, shard, shapes)
            path, state = info.shards[shard], opened[shard]
            if name not in state:
                raise CheckpointError(f"{path} is missing tensor {name!r}")
            tensor = state[name]
            expected = shard_shape(
                name, shapes[name], info.n_shards, shard, info.embedding_layout or target_layout, args.head_dim
            )
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {list(tensor.shape)}, but params.json "
                    f"(and {info.n_shards} shard(s)) imply {list(expected)}"
                )
            if not tensor.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
            source, target = _narrow(tensor, src), _narrow(out, dst)
            target.copy_(source)
            check_finite_weight(target, name, path, source)
            _release_pages(tensor)
        yield name, out
        del out  # the caller holds the only reference now: letting it go frees the tensor


def _open_for_reading(
    info: CheckpointInfo, args: ModelArgs, shard: int, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Shard ``shard`` mapped (nothing read yet) with this library's names; tensors that are
    not the text model's are named in the log."""
    path = info.shards[shard]
    state = with_release_names(open_shard(path), args, info.n_shards, path)
    extra = set(state) - set(shapes) - set(IGNORED_KEYS)
    vision = {name for name in extra if is_vision_tensor(name)}
    if vision:
        logger.info("%s: skipping %d vision tensors (the image encoder is not loaded; text only)", path, len(vision))
    if extra - vision:
        logger.warning("%s: ignoring unexpected tensors %s", path, sorted(extra - vision)[:5])
    return state


def load_full_tensors(info: CheckpointInfo, args: ModelArgs, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors, unsplit, on the CPU in the checkpoint's dtype (for offline tools:
    ask for a group at a time to bound memory)."""
    shapes = full_shapes(args)
    local = {name: torch.Size(shapes[name]) for name in names}
    return dict(iter_rank_tensors(info, args, local, info.embedding_layout or "vocab", 1, 0, torch.device("cpu"),
                                  info.dtype))
