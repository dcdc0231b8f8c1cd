"""Reading a Hugging Face checkpoint's weights lazily, by Meta name, checked against its config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Sequence

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import CheckpointError, open_shard
from llama.convert.files import safetensors_file
from llama.convert.names import LLAMA4_TEXT_PREFIXES, ROPE_PERMUTED, hf_name, hf_to_meta_rope_rows, layer_pattern
from llama.layers.tensor_parallel import full_shapes, is_vision_tensor
from llama.runtime.json_file import read_json_object

# safetensors' dtype names (a header's "dtype")
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class HFWeights:
    """Lazy access to an HF checkpoint's tensors by name: headers, and the part of a tensor asked for."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.location: dict[str, Path] = {}
        self._bin_states: dict[Path, dict[str, torch.Tensor]] = {}
        self._headers: dict[Path, dict[str, tuple[tuple[int, ...], str]]] = {}  # per file: name -> (shape, dtype)
        st_index = src / "model.safetensors.index.json"
        bin_index = src / "pytorch_model.bin.index.json"
        if st_index.exists():  # one that is not a regular file is refused by read_json_object
            self._read_index(st_index)
            self.kind = "safetensors"
        elif list(src.glob("*.safetensors")):
            self.kind = "safetensors"
            for path in sorted(src.glob("*.safetensors")):
                with safetensors_file(path) as f:
                    for name in f.keys():
                        self.location[name] = path
        elif bin_index.exists():
            self._read_index(bin_index)
            self.kind = "bin"
        elif list(src.glob("pytorch_model*.bin")):
            self.kind = "bin"
            for path in sorted(src.glob("pytorch_model*.bin")):
                for name in self._bin_state(path):
                    self.location[name] = path
        else:
            raise FileNotFoundError(
                f"no weights in {src}: expected model.safetensors, model-*.safetensors with "
                "model.safetensors.index.json, or pytorch_model*.bin"
            )

    def _read_index(self, index: Path) -> None:
        weight_map = read_json_object(index, "beside the weights it lists", "tensor locations").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} is not a valid weight index (no 'weight_map' from tensor names to files)")
        for name, file in weight_map.items():
            path = self.src / file
            if not path.exists():  # one that is not a regular file is refused when opened
                raise FileNotFoundError(f"{index} lists {file} for {name!r}, but {path} does not exist")
            self.location[name] = path

    def _bin_state(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._bin_states:
            self._bin_states[path] = open_shard(path)  # mmap + weights_only: nothing read yet, no code run
        return self._bin_states[path]

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) of tensor ``name`` from its file's header, each file's read once."""
        path = self.location[name]
        if path not in self._headers:
            if self.kind == "bin":
                self._headers[path] = {k: (tuple(t.shape), str(t.dtype)) for k, t in self._bin_state(path).items()}
            else:
                with safetensors_file(path) as f:
                    slices = {k: f.get_slice(k) for k in f.keys()}
                    self._headers[path] = {k: (tuple(t.get_shape()), t.get_dtype()) for k, t in slices.items()}
        if name not in self._headers[path]:
            raise CheckpointError(f"{path} has no tensor {name!r}, though its weight index lists it there")
        return self._headers[path][name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (in the location table), from the file's header only."""
        return self._header(name)[0]

    def get_region(self, name: str, region: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The ``region`` ([start, end) along every axis) of tensor ``name``, reading only
        that part of the file (safetensors' ``get_slice``; a ``.bin`` is memory-mapped)."""
        if name not in self.location:
            raise CheckpointError(f"{self.src} has no tensor {name!r}: is it a Llama checkpoint?")
        path = self.location[name]
        index = tuple(slice(start, end) for start, end in region)
        if self.kind == "bin":
            state = self._bin_state(path)
            if name not in state:
                raise CheckpointError(f"{path} has no tensor {name!r}, though its weight index lists it there")
            return state[name][index]
        self._header(name)  # listed by the index but absent from the file: named
        with safetensors_file(path) as f:
            return f.get_slice(name)[index]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name`` (in the location table), from the file's header only."""
        stored = self._header(name)[1]
        if self.kind == "bin":
            return getattr(torch, stored.removeprefix("torch."))
        if stored not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.location[name]}: tensor {name!r} has dtype {stored}, which this library "
                                  "cannot load")
        return _SAFETENSORS_DTYPES[stored]


def llama4_prefixes(weights: HFWeights) -> tuple[str, str]:
    """(prefix of the text model's body, prefix of its lm_head) in a Llama 4 repository."""
    for body, head in LLAMA4_TEXT_PREFIXES:
        if body + "embed_tokens.weight" in weights.location:
            return body, head
    raise CheckpointError(f"{weights.src} has no Llama 4 text model (no '*embed_tokens.weight' tensor)")


def llama4_vision_prefix(body: str) -> str:
    """Where a Llama 4 repository whose text model's body is under ``body`` keeps ``vision_model.``
    and ``multi_modal_projector.``: under ``model.`` where transformers 5 saved it
    (``model.language_model.``), at the top as published (``language_model.model.``)."""
    return "model." if body == "model.language_model." else ""


def hf_source_name(name: str, args: ModelArgs, prefixes: tuple[str, str]) -> str:
    """The HF tensor holding Meta's ``name`` (a Llama 4 repository's own prefixes applied)."""
    if not args.is_llama4:
        return hf_name(name)
    hf = hf_name(name, llama4=True)
    body, head = prefixes
    if is_vision_tensor(name):
        return llama4_vision_prefix(body) + hf
    return head + hf[len("lm_head."):] if hf.startswith("lm_head.") else body + hf[len("model."):]


def _hf_shape(name: str, args: ModelArgs, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor holding Meta's ``name`` of ``shape``."""
    key = layer_pattern(name)[0]
    if args.is_llama4 and key.endswith("router_DE"):
        return shape[::-1]
    if args.is_llama4 and key.endswith(("experts.w1", "experts.w3")):
        return shape[:-1] + (2 * shape[-1],)
    return shape


def meta_tensor_reader(weights: HFWeights, args: ModelArgs, tied: bool) -> Callable[[str], torch.Tensor]:
    """A function giving the full Meta tensor ``name`` (renamed, RoPE rows reordered;
    Llama 4's router transposed and experts' w1/w3 taken from gate_up_proj): a
    :class:`MetaRegionReader` asked for the whole of each tensor."""
    reader = MetaRegionReader(weights, args, tied)
    return lambda name: reader(name, [(0, n) for n in reader.shapes[name]])


class MetaRegionReader:
    """Reads ``region`` of the full Meta tensor ``name`` (the part a rank holds,
    :func:`llama.layers.tensor_parallel.holder_region`) from an HF checkpoint, reading only
    that part of the HF tensor that holds it.  ``reader(name, region)``.

    The HF part of each region: the same rows for q/k (a rank holds whole heads, and HF's
    RoPE order only permutes rows within a head: the rows read are reordered per head), the
    transposed region for Llama 4's router, ``gate_up_proj``'s first or second half for the
    experts' w1 or w3, the same region for everything else."""

    def __init__(self, weights: HFWeights, args: ModelArgs, tied: bool) -> None:
        self.weights, self.args, self.tied = weights, args, tied
        self.shapes = full_shapes(args)
        self.prefixes = llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")

    def source(self, name: str) -> str:
        """The HF tensor holding Meta's ``name``."""
        source = hf_source_name(name, self.args, self.prefixes)
        if name == "output.weight" and source not in self.weights.location and self.tied:
            source = hf_source_name("tok_embeddings.weight", self.args, self.prefixes)  # tied: reuses the embedding
        return source

    def file(self, name: str) -> Path:
        return self.weights.location[self.source(name)]

    def check(self, name: str) -> str:
        """The HF tensor holding ``name``, checked from the file's header (nothing read):
        present, floating point, of the shape ``config.json`` implies; CheckpointError otherwise."""
        source = self.source(name)
        if source not in self.weights.location:
            raise CheckpointError(f"{self.weights.src} has no tensor {source!r} (for Meta's {name!r}): "
                                  "is it a complete Llama checkpoint?")
        expected = _hf_shape(name, self.args, self.shapes[name])
        shape = self.weights.shape(source)
        if shape != expected:
            raise CheckpointError(
                f"{self.weights.location[source]}: tensor {source!r} has shape {list(shape)}, but config.json "
                f"implies {list(expected)} for Meta's {name!r}: use the config.json that came with these weights"
            )
        if not self.weights.dtype(source).is_floating_point:
            raise CheckpointError(f"{self.weights.location[source]}: tensor {source!r} has dtype "
                                  f"{self.weights.dtype(source)}, expected floating point")
        return source

    def __call__(self, name: str, region: Sequence[tuple[int, int]]) -> torch.Tensor:
        source = self.check(name)
        key = layer_pattern(name)[0]
        region = [(int(start), int(end)) for start, end in region]
        if self.args.is_llama4 and key.endswith("router_DE"):
            return self.weights.get_region(source, region[::-1]).t()
        if self.args.is_llama4 and key.endswith(("experts.w1", "experts.w3")):
            start, end = region[-1]
            offset = self.shapes[name][-1] if key.endswith("w3") else 0  # gate_up_proj: w1 | w3 on its last axis
            return self.weights.get_region(source, region[:-1] + [(start + offset, end + offset)])
        t = self.weights.get_region(source, region)
        heads_field = ROPE_PERMUTED.get(key)
        if heads_field is not None and not self.args.is_llama4:
            (r0, r1), head_dim = region[0], self.args.head_dim
            if r0 % head_dim or r1 % head_dim:
                raise ValueError(f"internal error: rows {r0}..{r1} of {name!r} are not whole heads")
            t = hf_to_meta_rope_rows(t, (r1 - r0) // head_dim)
        return t


def check_config_against_weights(weights: HFWeights, args: ModelArgs, body: str) -> None:
    """Refuse a config.json whose layer count, vocabulary or width the weights do not have,
    from the weights' names and header shapes alone (nothing is read), before anything is
    listed or sized per layer: a config.json claiming 10**9 layers or a 10**12-token
    vocabulary ends here in one line, not in a MemoryError."""
    pattern = re.compile(re.escape(body) + r"layers\.(\d+)\.")
    layers = {int(m.group(1)) for m in map(pattern.match, weights.location) if m}
    if len(layers) != args.n_layers or max(layers, default=-1) != args.n_layers - 1:
        held = f"{len(layers)} layers ({body}layers.{min(layers)} .. {max(layers)})" if layers else "no layers"
        raise CheckpointError(
            f"{weights.src} holds {held}, but config.json says num_hidden_layers={args.n_layers}: "
            "use the config.json that came with these weights"
        )
    embedding = body + "embed_tokens.weight"
    if embedding not in weights.location:
        raise CheckpointError(f"{weights.src} has no tensor {embedding!r}: is it a Llama checkpoint?")
    shape = weights.shape(embedding)
    if shape != (args.vocab_size, args.dim):
        raise CheckpointError(
            f"{weights.location[embedding]}: tensor {embedding!r} has shape {list(shape)}, but config.json says "
            f"vocab_size={args.vocab_size}, hidden_size={args.dim}: use the config.json that came with these weights"
        )


def read_meta_args(src: Path, shards: list[Path]) -> ModelArgs:
    """params.json, with vocab_size -1 (Llama 2) resolved from the embedding's shape."""
    args = ModelArgs.from_json(src / "params.json")
    if args.vocab_size == -1:
        emb = open_shard(shards[0]).get("tok_embeddings.weight")
        if emb is None or emb.dim() != 2:
            raise CheckpointError(f"{shards[0]} has no 2-D tensor 'tok_embeddings.weight'")
        # Split over the vocabulary, the rows are 1/N of it; over dim, all of it.
        vocab = emb.shape[0] * len(shards) if emb.shape[1] == args.dim else emb.shape[0]
        args.vocab_size = vocab
    return args
