"""Complete text prompts, printing the text as it is generated: three example prompts, or
your own (``--prompt``, repeatable; ``--prompt -`` reads one from standard input).

    python example_text_completion.py                      # the bundled demo model
    python example_text_completion.py --prompt "Once upon a time" --prompt "The sea"
    echo "A poem about rain:" | python example_text_completion.py --prompt -
    torchrun --nproc_per_node 2 example_text_completion.py  # the same, split over 2 processes
    torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir llama-2-7b/ --tokenizer_path tokenizer.model
"""

import argparse
import sys
from typing import List

from llama.cli.examples import (
    MAX_SEQ_LEN_HELP,
    check_device,
    compile_choice,
    example_parser,
    is_first_rank,
    resolve_checkpoint,
    resolve_lengths,
    run_script,
    say,
    setup_logging,
)
from llama.cli.flags import add_flag, model_options, positive_int

PROG = "example_text_completion.py"
PROMPTS = [
    "To be, or not to be,",
    "The old lighthouse keeper climbed the stairs one last time, and",
    "Friends, Romans, countrymen,",
]


def build_parser() -> argparse.ArgumentParser:
    parser = example_parser(PROG, "Generate text from a pretrained model: three example prompts, or yours, streamed.")
    add_flag(parser, "prompt", action="append", default=None, metavar="TEXT",
             help="a prompt to complete; repeat for several; '-' reads one from standard input "
                  "(default: three example prompts)")
    add_flag(parser, "max_seq_len", type=positive_int, default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    add_flag(parser, "max_gen_len", type=positive_int, default=64, metavar="N",
             help="most new tokens per prompt (default: %(default)s)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_prompts(given: List[str], stdin=None) -> List[str]:
    """The prompts to complete: ``--prompt`` values in order, ``-`` replaced by standard
    input's text (read once, its final newline dropped); the example prompts when none."""
    if not given:
        return list(PROMPTS)
    if given.count("-") > 1:
        raise ValueError("--prompt -: standard input can be read once; give '-' once")
    prompts = []
    for prompt in given:
        if prompt == "-":
            prompt = (stdin if stdin is not None else sys.stdin).read().removesuffix("\n")
        if not prompt:
            raise ValueError("--prompt: an empty prompt (give some text)")
        prompts.append(prompt)
    return prompts


def main(args: argparse.Namespace) -> None:
    setup_logging()
    # Under torchrun only the first rank may read standard input: it shares what it read.
    from_stdin = "-" in (args.prompt or [])
    prompts = read_prompts(args.prompt) if is_first_rank() or not from_stdin else None
    ckpt, tokenizer = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path)
    check_device(args.device)  # before the model loads
    from llama import Llama  # imports torch: after the arguments are read and checked
    from llama.runtime.distributed import share_from_first_rank

    generator = Llama.build(
        ckpt_dir=ckpt,
        tokenizer_path=tokenizer,
        max_seq_len=resolve_lengths(args.ckpt_dir, args.max_seq_len),
        max_batch_size=args.max_batch_size,
        device=args.device,
        seed=args.seed,
        **{**model_options(args), "compile": compile_choice(args.compile, long_lived=False)},
    )
    if from_stdin:
        prompts = share_from_first_rank(prompts)
    for prompt in prompts:
        # Every rank steps through the stream together; only the first one prints.
        pieces = generator.text_completion_stream(
            prompt, temperature=args.temperature, top_p=args.top_p, max_gen_len=args.max_gen_len
        )
        say(prompt)
        say("> ", end="")
        for piece in pieces:
            say(piece, end="")
        say("\n\n==================================\n")


if __name__ == "__main__":
    options = parse_args()
    run_script(PROG, lambda: main(options))
