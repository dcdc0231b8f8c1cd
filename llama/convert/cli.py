"""The ``python -m llama.convert`` command line.

Arguments are parsed and checked here, and the source and destination directories
(:mod:`llama.convert.paths`), before torch is imported, so ``--help``, a mistyped value and
a wrong directory answer at once; the conversion itself runs in :mod:`llama.convert`.
Errors print as one line (``...: error: ...``) with exit status 2 for a bad command line
and 1 for a failed conversion; Ctrl-C exits with 130 and leaves no partial output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from llama.cli.flags import Parser, add_flag, fail, positive_int, positive_number

DESCRIPTION = """\
Convert Llama checkpoints between Meta's format (params.json, consolidated.NN.pth,
tokenizer.model) and Hugging Face's (config.json, safetensors, tokenizer files), or
rewrite a Meta checkpoint in another number of shards, or fold a LoRA adapter into one.

The output directory must not exist or be empty.  It is written under a temporary
name beside it and renamed when complete, so a failed or interrupted run leaves
nothing behind.  Round trips are exact; the weights keep their dtype."""

EPILOG = """\
examples:
  python -m llama.convert hf_to_meta Meta-Llama-3.1-8B-Instruct-hf/ llama3.1-8b/ --model_parallel_size 2
  python -m llama.convert meta_to_hf Meta-Llama-3-8B/ llama3-8b-hf/
  python -m llama.convert reshard llama-2-70b/ llama-2-70b-mp4/ --model_parallel_size 4
  python -m llama.convert merge_lora llama3.1-8b/ my-lora-adapter/ llama3.1-8b-tuned/"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m llama.convert", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "hf_to_meta", aliases=["hf-to-meta"], help="Hugging Face Llama directory -> Meta checkpoint",
        description="Convert a Hugging Face Llama directory (config.json and safetensors or pytorch_model*.bin) "
        "to a Meta checkpoint: params.json, consolidated.NN.pth and tokenizer.model (from original/ or the "
        "top level).",
    )
    p.add_argument("src", metavar="HF_DIR", help="the Hugging Face model directory")
    p.add_argument("dst", metavar="META_DIR", help="output directory (absent or empty)")
    add_flag(p, "model_parallel_size", type=positive_int, default=1, metavar="N",
              help="number of shards to write (default: 1); must divide the model's heads and widths")

    p = commands.add_parser(
        "meta_to_hf", aliases=["meta-to-hf"], help="Meta checkpoint -> Hugging Face Llama directory",
        description="Convert a Meta checkpoint (any number of shards) to a Hugging Face directory: config.json, "
        "safetensors, and, from tokenizer.model, tokenizer.json, tokenizer_config.json (with the chat template), "
        "special_tokens_map.json and generation_config.json, so transformers' LlamaForCausalLM and AutoTokenizer "
        "load it directly.",
    )
    p.add_argument("src", metavar="META_DIR", help="the Meta checkpoint directory")
    p.add_argument("dst", metavar="HF_DIR", help="output directory (absent or empty)")
    add_flag(p, "max_position_embeddings", type=positive_int, default=None, metavar="L",
              help="context length written to config.json (default: 131072 with scaled RoPE, "
              "8192 for rope_theta >= 5e5, else 4096)")
    add_flag(p, "max_shard_size_gb", type=positive_number, default=5.0, metavar="G",
              help="largest safetensors file in GB (default: 5)")

    p = commands.add_parser(
        "reshard", help="Meta checkpoint -> the same in N shards",
        description="Rewrite a Meta checkpoint split over another number of shards (what Llama.build does at "
        "load time, done once offline). params.json and tokenizer.model are copied.",
    )
    p.add_argument("src", metavar="META_DIR", help="the Meta checkpoint directory")
    p.add_argument("dst", metavar="OUT_DIR", help="output directory (absent or empty)")
    add_flag(p, "model_parallel_size", type=positive_int, required=True, metavar="N",
              help="number of shards to write; must be one the model allows")

    p = commands.add_parser(
        "merge_lora", aliases=["merge-lora"], help="Meta checkpoint + PEFT LoRA adapter -> merged Meta checkpoint",
        description="Fold a Hugging Face PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors) "
        "into a Meta checkpoint's weights (W += scale * B @ A, in float32, stored in the checkpoint's dtype) and "
        "write the result as a Meta checkpoint. params.json and tokenizer.model are copied.",
    )
    p.add_argument("src", metavar="BASE_DIR", help="the base model's Meta checkpoint directory")
    p.add_argument("adapter", metavar="ADAPTER_DIR", help="the PEFT adapter folder")
    p.add_argument("dst", metavar="OUT_DIR", help="output directory (absent or empty)")
    add_flag(p, "model_parallel_size", type=positive_int, default=None, metavar="N",
              help="number of shards to write (default: the base's); must be one the model allows")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    options = vars(build_parser().parse_args(argv))  # exits with status 2 and one error line when wrong
    command = options.pop("command").replace("-", "_")  # hf-to-meta is hf_to_meta
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from llama.convert.paths import check_destination, source_dir

        # The directories first, as the command would: before torch is imported, a wrong one is told at once.
        check_destination(options["dst"], source_dir(options["src"]))
        from llama.convert import commands

        getattr(commands, command)(**options)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        fail(f"python -m llama.convert {command}", str(e))
    return 0
