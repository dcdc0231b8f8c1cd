"""Chat with a Llama chat/instruct checkpoint: a few example dialogs, or an
interactive conversation (``--interactive``).

    python example_chat_completion.py                                  # the bundled demo model
    python example_chat_completion.py --interactive                    # type, read, repeat
    torchrun --nproc_per_node 2 example_chat_completion.py --interactive
    torchrun --nproc_per_node 1 example_chat_completion.py --ckpt_dir llama-2-7b-chat/ --tokenizer_path tokenizer.model

Interactive mode: the first rank reads your lines and shares them with every rank,
all ranks generate together, and the answer streams out as it is decoded.  The
conversation is kept (trimmed from the oldest exchanges to fit max_seq_len, with a
notice); ``/reset`` starts over; end of input (Ctrl-D) quits.
"""

import sys
from pathlib import Path
from typing import List, Optional

import fire

from llama import Dialog, Llama
from llama.chat_session import ChatSession
from llama.distributed import share_from_first_rank
from llama.examples import is_first_rank, resolve_checkpoint, setup_logging


DEMO_DIR = Path(__file__).resolve().parent / "demo"  # the bundled model


def say(*args, **kwargs) -> None:
    if is_first_rank():
        print(*args, **kwargs, flush=True)


def run_examples(generator: Llama, temperature: float, top_p: float, max_gen_len: Optional[int]) -> None:
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
    for dialog in dialogs:
        for msg in dialog:
            say(f"{msg['role'].capitalize()}: {msg['content']}\n")
        say("> Assistant: ", end="")
        for piece in generator.chat_completion_stream(dialog, temperature=temperature, top_p=top_p,
                                                      max_gen_len=max_gen_len):
            say(piece, end="")
        say("\n\n==================================\n")


def read_line() -> Optional[str]:
    """The first rank reads a line (None at end of input) and every rank receives it."""
    line = None
    if is_first_rank():
        try:
            line = input("You: ")
        except EOFError:
            line = None
    return share_from_first_rank(line)


def run_interactive(generator: Llama, temperature: float, top_p: float, system_prompt: Optional[str]) -> None:
    session = ChatSession(generator, system_prompt=system_prompt)
    say("Interactive chat: /reset clears the conversation, Ctrl-D ends it.")
    while True:
        line = read_line()
        if line is None:
            say("\nBye.")
            return
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            session.reset()
            say("(conversation cleared)")
            continue
        try:
            answer = session.ask(line, temperature=temperature, top_p=top_p)
        except ValueError as e:
            say(f"(not sent: {e})")
            continue
        if session.trimmed:
            say(f"(dropped the {session.trimmed} oldest exchange(s) to fit max_seq_len)")
        say("Assistant: ", end="")
        for piece in answer:
            say(piece, end="")
        say("")


def main(
    ckpt_dir: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    temperature: float = 0.6,
    top_p: float = 0.9,
    max_seq_len: int = 512,
    max_batch_size: int = 4,
    max_gen_len: Optional[int] = None,
    device: Optional[str] = None,
    interactive: bool = False,
    system_prompt: Optional[str] = None,
    seed: int = 1,
):
    """Answer example dialogs, or chat interactively.

    Args:
        ckpt_dir: directory with params.json and consolidated.NN.pth (default: the bundled demo model).
        tokenizer_path: the model's tokenizer.model (default: the one in ckpt_dir).
        temperature: sampling temperature (0 = greedy).
        top_p: nucleus sampling threshold.
        max_seq_len: longest dialog + reply.
        max_batch_size: most dialogs per batch.
        max_gen_len: most reply tokens (default: up to max_seq_len).
        device: "cuda" or "cpu"; default CUDA when available.
        interactive: read your messages from standard input and answer each.
        system_prompt: system message for interactive mode.
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
    if interactive:
        run_interactive(generator, temperature, top_p, system_prompt)
    else:
        run_examples(generator, temperature, top_p, max_gen_len)


if __name__ == "__main__":
    try:
        fire.Fire(main)
    except KeyboardInterrupt:
        sys.exit(130)
