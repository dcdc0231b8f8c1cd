"""Complete a few text prompts, printing the text as it is generated.

    python example_text_completion.py                      # the bundled demo model
    torchrun --nproc_per_node 2 example_text_completion.py  # the same, split over 2 processes
    torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir llama-2-7b/ --tokenizer_path tokenizer.model
"""

import sys
from pathlib import Path
from typing import Optional

import fire

from llama import Llama
from llama.examples import is_first_rank, resolve_checkpoint, setup_logging


DEMO_DIR = Path(__file__).resolve().parent / "demo"  # the bundled model


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
    device: Optional[str] = None,
    seed: int = 1,
):
    """Generate text from a pretrained model.

    Args:
        ckpt_dir: directory with params.json and consolidated.NN.pth (default: the bundled demo model).
        tokenizer_path: the model's tokenizer.model (default: the one in ckpt_dir).
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        max_seq_len: longest prompt + generation.
        max_gen_len: most new tokens per prompt.
        max_batch_size: most prompts per batch.
        device: "cuda" or "cpu"; default CUDA when available.
        seed: sampling seed.
    """
    setup_logging()
    ckpt, tokenizer = resolve_checkpoint(ckpt_dir, tokenizer_path, DEMO_DIR)
    generator = Llama.build(
        ckpt_dir=ckpt,
        tokenizer_path=tokenizer,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        device=device,
        seed=seed,
    )
    prompts = [
        "To be, or not to be,",
        "The old lighthouse keeper climbed the stairs one last time, and",
        "Friends, Romans, countrymen,",
    ]
    for prompt in prompts:
        # Every rank steps through the stream together; only the first one prints.
        pieces = generator.text_completion_stream(prompt, temperature=temperature, top_p=top_p, max_gen_len=max_gen_len)
        if is_first_rank():
            print(prompt)
            print("> ", end="", flush=True)
        for piece in pieces:
            if is_first_rank():
                print(piece, end="", flush=True)
        if is_first_rank():
            print("\n\n==================================\n", flush=True)


if __name__ == "__main__":
    try:
        fire.Fire(main)
    except KeyboardInterrupt:
        sys.exit(130)
