"""Which kind of checkpoint a directory holds, and where its tokenizer is, read from its files
(without torch: the command lines check a directory before torch is imported).

Two layouts load:

* Meta's: ``params.json`` and ``consolidated.NN.pth`` shards (what ``download.sh`` and
  llama-models write), tokenizer in ``tokenizer.model``;
* Hugging Face's: ``config.json`` and ``*.safetensors`` weights (``model.safetensors``, or
  ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``; also
  ``pytorch_model*.bin``), as ``huggingface-cli download meta-llama/...`` leaves them,
  tokenizer in ``tokenizer.model`` (Llama 2 / Code Llama), ``original/tokenizer.model``
  (Llama 3.x) or ``tokenizer.json`` (Llama 3.x and 4: byte-level BPE, read by
  :func:`llama.tokenizer.load_tokenizer`).

A directory that is neither is refused by one error naming both layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

PathLike = Union[str, Path]
Layout = Literal["meta", "hf"]

META_LAYOUT = "params.json + consolidated.NN.pth (Meta's download)"
HF_LAYOUT = "config.json + *.safetensors (a Hugging Face model folder)"
HF_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
# Where each layout keeps its tokenizer, in the order they are tried.
META_TOKENIZERS = ("tokenizer.model",)
HF_TOKENIZERS = ("tokenizer.model", "original/tokenizer.model", "tokenizer.json")


def _has_weights(ckpt_dir: Path) -> bool:
    return any(any(ckpt_dir.glob(pattern)) for pattern in HF_WEIGHT_GLOBS)


def checkpoint_layout(ckpt_dir: PathLike) -> Layout:
    """``"meta"`` for a directory with ``params.json`` and ``*.pth`` shards, ``"hf"`` for one
    with ``config.json`` and safetensors (or ``pytorch_model*.bin``) weights.

    FileNotFoundError for a missing directory, NotADirectoryError for a file, and
    FileNotFoundError naming both layouts (what is there, what to do) for anything else."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        raise FileNotFoundError(f"checkpoint directory not found: {ckpt_dir}")
    if not ckpt_dir.is_dir():
        raise NotADirectoryError(f"checkpoint path {ckpt_dir} is not a directory")
    has_params, has_config = (ckpt_dir / "params.json").exists(), (ckpt_dir / "config.json").exists()
    has_shards, has_weights = any(ckpt_dir.glob("*.pth")), _has_weights(ckpt_dir)
    if has_params and has_shards:
        return "meta"
    if has_config and has_weights:
        return "hf"
    if (has_shards or has_params) and not has_config:
        return "meta"  # an incomplete Meta download: its loader names the missing file
    if has_config and not has_params and (ckpt_dir / "model.safetensors.index.json").exists():
        return "hf"  # an incomplete Hugging Face download: its loader names the missing weight files
    held = sorted(p.name for p in ckpt_dir.iterdir())
    shown = (", ".join(held[:8]) + (", ..." if len(held) > 8 else "")) if held else "nothing"
    original = ckpt_dir / "original"
    # A Hugging Face repository of which only Meta's copy (original/) was downloaded
    hint = f" Its original/ folder holds Meta's files: pass {original}." if (original / "params.json").exists() else ""
    raise FileNotFoundError(
        f"no checkpoint shards (*.pth) with params.json nor safetensors weights with config.json in {ckpt_dir} "
        f"(it holds {shown}): a checkpoint directory holds either {META_LAYOUT} or {HF_LAYOUT}.{hint} Pass the "
        "folder that holds those files (for a Hugging Face download, the folder with config.json), or download a "
        "model: ./download.sh (Meta's files) or `huggingface-cli download meta-llama/<model> --local-dir <dir>`"
    )


def find_tokenizer(ckpt_dir: PathLike, layout: Optional[Layout] = None) -> Path:
    """The checkpoint's own tokenizer file (see the module's docstring for where each layout
    keeps it); FileNotFoundError naming the files looked for and ``--tokenizer_path``."""
    ckpt_dir = Path(ckpt_dir)
    layout = layout or checkpoint_layout(ckpt_dir)
    candidates = HF_TOKENIZERS if layout == "hf" else META_TOKENIZERS
    for name in candidates:
        if (ckpt_dir / name).exists():  # one that is not a regular file is refused by load_tokenizer
            return ckpt_dir / name
    kind = "Hugging Face" if layout == "hf" else "Meta"
    raise FileNotFoundError(
        f"no tokenizer in the {kind} checkpoint {ckpt_dir} (looked for {', '.join(candidates)}): "
        "pass the model's tokenizer file with --tokenizer_path (Llama.build's tokenizer_path): "
        "tokenizer.model (Llama 2 and Code Llama: SentencePiece; Llama 3.x and 4: the tiktoken file Meta ships, "
        "original/tokenizer.model in Hugging Face's Llama 3 repositories) or a byte-level tokenizer.json "
        "(Llama 3.x and 4)"
    )
