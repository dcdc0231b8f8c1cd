"""Complete a few text prompts, printing the text as it is generated.

    python example_text_completion.py                      # the bundled demo model
    torchrun --nproc_per_node 2 example_text_completion.py  # the same, split over 2 processes
    torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir llama-2-7b/ --tokenizer_path tokenizer.model
"""

import argparse

from llama.cli.examples import (
    example_parser,
    is_first_rank,
    resolve_checkpoint,
    resolve_lengths,
    run_script,
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
    parser = example_parser(PROG, "Generate text from a pretrained model: three example prompts, streamed.")
    add_flag(parser, "max_seq_len", type=positive_int, default=None, metavar="N",
             help="longest prompt + generation (default: 128; the demo model: 256, its training length)")
    add_flag(parser, "max_gen_len", type=positive_int, default=64, metavar="N",
             help="most new tokens per prompt (default: %(default)s)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(args: argparse.Namespace) -> None:
    setup_logging()
    ckpt, tokenizer = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path)
    from llama import Llama  # imports torch: after the arguments are read and checked

    generator = Llama.build(
        ckpt_dir=ckpt,
        tokenizer_path=tokenizer,
        max_seq_len=resolve_lengths(args.ckpt_dir, args.max_seq_len, 128),
        max_batch_size=args.max_batch_size,
        device=args.device,
        seed=args.seed,
        **model_options(args),
    )
    for prompt in PROMPTS:
        # Every rank steps through the stream together; only the first one prints.
        pieces = generator.text_completion_stream(
            prompt, temperature=args.temperature, top_p=args.top_p, max_gen_len=args.max_gen_len
        )
        if is_first_rank():
            print(prompt)
            print("> ", end="", flush=True)
        for piece in pieces:
            if is_first_rank():
                print(piece, end="", flush=True)
        if is_first_rank():
            print("\n\n==================================\n", flush=True)


if __name__ == "__main__":
    options = parse_args()
    run_script(PROG, lambda: main(options))
