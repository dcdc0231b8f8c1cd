"""Reading a Hugging Face checkpoint's weights lazily, by Meta name, checked against its config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from llama.args import ModelArgs
from llama.checkpoint.shards import CheckpointError, open_shard
from llama.convert.files import safetensors_file
from llama.convert.names import LLAMA4_TEXT_PREFIXES, ROPE_PERMUTED, hf_name, hf_to_meta_rope_rows, layer_pattern
from llama.layers.tensor_parallel import full_shapes
from llama.runtime.json_file import read_json_object


class HFWeights:
    """Lazy access to an HF checkpoint's tensors by name, one tensor in memory at a time."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.location: dict[str, Path] = {}
        self._bin_states: dict[Path, dict[str, torch.Tensor]] = {}
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

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (in the location table), from the file's header only."""
        path = self.location[name]
        if self.kind == "bin":
            state = self._bin_state(path)
            if name not in state:
                raise CheckpointError(f"{path} has no tensor {name!r}, though its weight index lists it there")
            return tuple(state[name].shape)
        with safetensors_file(path) as f:
            return tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise CheckpointError(f"{self.src} has no tensor {name!r}: is it a LlamaForCausalLM checkpoint?")
        path = self.location[name]
        if self.kind == "bin":
            return self._bin_state(path)[name]
        with safetensors_file(path) as f:
            return f.get_tensor(name)


def llama4_prefixes(weights: HFWeights) -> tuple[str, str]:
    """(prefix of the text model's body, prefix of its lm_head) in a Llama 4 repository."""
    for body, head in LLAMA4_TEXT_PREFIXES:
        if body + "embed_tokens.weight" in weights.location:
            return body, head
    raise CheckpointError(f"{weights.src} has no Llama 4 text model (no '*embed_tokens.weight' tensor)")


def hf_source_name(name: str, args: ModelArgs, prefixes: tuple[str, str]) -> str:
    """The HF tensor holding Meta's ``name`` (a Llama 4 repository's own prefixes applied)."""
    if not args.is_llama4:
        return hf_name(name)
    hf = hf_name(name, llama4=True)
    body, head = prefixes
    return head + hf[len("lm_head."):] if hf.startswith("lm_head.") else body + hf[len("model."):]


def _from_hf_tensor(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Meta's tensor ``name`` from the HF tensor that holds it (RoPE rows, router, experts)."""
    key = layer_pattern(name)[0]
    heads_field = ROPE_PERMUTED.get(key)
    if heads_field is not None and not args.is_llama4:
        return hf_to_meta_rope_rows(t, getattr(args, heads_field))
    if key.endswith("router_DE"):
        return t.t()
    if key.endswith(("experts.w1", "experts.w3")):  # gate_up_proj (E, dim, 2*hidden): w1 | w3
        half = t.shape[-1] // 2
        return t[..., :half] if key.endswith("w1") else t[..., half:]
    return t


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
    Llama 4's router transposed and experts' w1/w3 taken from gate_up_proj)."""
    shapes = full_shapes(args)
    prefixes = llama4_prefixes(weights) if args.is_llama4 else ("model.", "lm_head.")

    def read(name: str) -> torch.Tensor:
        source = hf_source_name(name, args, prefixes)
        if name == "output.weight" and source not in weights.location and tied:
            source = hf_source_name("tok_embeddings.weight", args, prefixes)  # tied: the output layer reuses them
        t = weights.get(source)
        if tuple(t.shape) != _hf_shape(name, args, shapes[name]):
            raise CheckpointError(
                f"{weights.location[source]}: tensor {source!r} has shape {list(t.shape)}, but config.json "
                f"implies {list(_hf_shape(name, args, shapes[name]))} for Meta's {name!r}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{weights.location[source]}: tensor {source!r} has dtype {t.dtype}")
        return _from_hf_tensor(name, t, args)

    return read


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
