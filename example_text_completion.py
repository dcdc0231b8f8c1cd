"""Complete a few text prompts with a Llama checkpoint.

    torchrun --nproc_per_node 1 example_text_completion.py --ckpt_dir llama-2-7b/ --tokenizer_path tokenizer.model
    python example_text_completion.py --ckpt_dir ... --tokenizer_path ... --device cpu
"""

import logging
import os
from typing import Optional

import fire

from llama import Llama


def main(
    ckpt_dir: str,
    tokenizer_path: str,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 128,
    max_gen_len: int = 64,
    max_batch_size: int = 4,
    device: Optional[str] = None,
):
    """Generate text from a pretrained model.

    Args:
        ckpt_dir: directory with params.json and consolidated.NN.pth.
        tokenizer_path: the model's tokenizer.model.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        max_seq_len: longest prompt + generation.
        max_gen_len: most new tokens per prompt.
        max_batch_size: most prompts per batch.
        device: "cuda" or "cpu"; default CUDA when available.
    """
    first_rank = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if first_rank else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    generator = Llama.build(
        ckpt_dir=ckpt_dir,
        tokenizer_path=tokenizer_path,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        device=device,
    )
    prompts = [
        # Plain continuation.
        "The old lighthouse keeper climbed the stairs one last time, and",
        "The three things every good bread recipe needs are",
        # A few-shot pattern to continue.
        """Translate English to German:

cat => Katze
house => Haus
good morning =>""",
    ]
    results = generator.text_completion(prompts, max_gen_len=max_gen_len, temperature=temperature, top_p=top_p)
    if first_rank:
        for prompt, result in zip(prompts, results):
            print(prompt)
            print(f"> {result['generation']}")
            print("\n==================================\n")


if __name__ == "__main__":
    fire.Fire(main)
