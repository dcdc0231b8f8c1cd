"""Chat with a Llama chat/instruct checkpoint.

    torchrun --nproc_per_node 1 example_chat_completion.py --ckpt_dir llama-2-7b-chat/ --tokenizer_path tokenizer.model
    python example_chat_completion.py --ckpt_dir ... --tokenizer_path ... --device cpu
"""

import logging
import os
from typing import List, Optional

import fire

from llama import Dialog, Llama


def main(
    ckpt_dir: str,
    tokenizer_path: str,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 512,
    max_batch_size: int = 4,
    max_gen_len: Optional[int] = None,
    device: Optional[str] = None,
):
    """Answer a few example dialogs.

    Args:
        ckpt_dir: directory with params.json and consolidated.NN.pth.
        tokenizer_path: the model's tokenizer.model.
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        max_seq_len: longest dialog + reply.
        max_batch_size: most dialogs per batch.
        max_gen_len: most reply tokens (default: up to max_seq_len).
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
    dialogs: List[Dialog] = [
        [{"role": "user", "content": "What should I pack for a weekend of hiking?"}],
        [
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
        [
            {"role": "user", "content": "Suggest a name for a grey cat."},
            {"role": "assistant", "content": "How about Pebble?"},
            {"role": "user", "content": "Something longer, please."},
        ],
    ]
    results = generator.chat_completion(dialogs, max_gen_len=max_gen_len, temperature=temperature, top_p=top_p)
    if first_rank:
        for dialog, result in zip(dialogs, results):
            for msg in dialog:
                print(f"{msg['role'].capitalize()}: {msg['content']}\n")
            print(f"> {result['generation']['role'].capitalize()}: {result['generation']['content']}")
            print("\n==================================\n")


if __name__ == "__main__":
    fire.Fire(main)
