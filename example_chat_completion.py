"""Chat with a Llama chat/instruct checkpoint: a few example dialogs, or an
interactive conversation (``--interactive``).

    python example_chat_completion.py                                  # the bundled demo model
    python example_chat_completion.py --interactive                    # type, read, repeat
    torchrun --nproc_per_node 2 example_chat_completion.py --interactive
    torchrun --nproc_per_node 1 example_chat_completion.py --ckpt_dir llama-2-7b-chat/ --tokenizer_path tokenizer.model

Interactive mode: the first rank reads your lines and shares them with every rank,
all ranks generate together, and the answer streams out as it is decoded.  The
conversation is kept (trimmed from the oldest exchanges to fit max_seq_len, with a
notice); ``/reset`` starts over; ``/image PATH`` attaches a picture to your next message
(Llama 4 and Llama 3.2 Vision checkpoints with their vision weights); ``/help`` lists the
commands; end of input (Ctrl-D) quits, and so does Ctrl-C at the prompt; Ctrl-C during a reply stops the reply.  At a
terminal, Ctrl-C is read as a key by the first rank (llama.cli.terminal), so under torchrun it
too ends quietly.
"""

import argparse
import json
from pathlib import Path
from typing import List, Optional, Union

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

PROG = "example_chat_completion.py"


def build_parser() -> argparse.ArgumentParser:
    parser = example_parser(PROG, "Answer three example dialogs, or chat interactively (--interactive).")
    add_flag(parser, "max_seq_len", type=positive_int, default=None, metavar="N", help=MAX_SEQ_LEN_HELP)
    add_flag(parser, "max_gen_len", type=positive_int, default=None, metavar="N",
             help="most reply tokens (default: up to max_seq_len)")
    add_flag(parser, "interactive", action="store_true",
             help="read your messages from standard input and answer each (default: off, answer three example dialogs)")
    add_flag(parser, "system_prompt", metavar="TEXT", default=None,
             help="system message for interactive mode (default: none)")
    add_flag(parser, "image", action="append", default=None, metavar="PATH",
             help="an image attached to the first user message of each example dialog (repeatable; Llama 4 "
                  "and Llama 3.2 Vision checkpoints with their vision weights; default: none)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def with_images(dialog, images: List[str]):
    """``dialog`` with ``images`` (paths) as image parts before the text of its first user message."""
    out, attached = [], False
    for msg in dialog:
        if msg["role"] == "user" and not attached and images:
            msg = {**msg, "content": [{"type": "image", "image": path} for path in images]
                   + [{"type": "text", "text": msg["content"]}]}
            attached = True
        out.append(msg)
    return out


def run_examples(generator, temperature: float, top_p: float, max_gen_len: Optional[int],
                 images: Optional[List[str]] = None) -> None:
    from llama import Dialog

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
        dialog = with_images(dialog, images or [])
        for msg in dialog:
            content = msg["content"]
            if isinstance(content, list):  # its images, then its text
                content = " ".join(f"[image {p['image']}]" if p["type"] == "image" else p["text"] for p in content)
            say(f"{msg['role'].capitalize()}: {content}\n")
        say("> Assistant: ", end="")
        for piece in generator.chat_completion_stream(dialog, temperature=temperature, top_p=top_p,
                                                      max_gen_len=max_gen_len):
            say(piece, end="")
        say("\n\n==================================\n")
    run_tool_example(generator, max_gen_len)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "The city's name"}}}}}


def run_tool_example(generator, max_gen_len: Optional[int]) -> None:
    """A tool-call round trip: declare a function, read the call from the reply, answer it
    as the tool would, and let the model finish (Llama 3.1 and later)."""
    if not generator.formatter.has_tools:
        say("(tool calling needs a Llama 3.1 or later checkpoint; this model's chat format has none)")
        return
    dialog = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    needed = len(generator.formatter.encode_dialog_prompt(dialog, tools=[WEATHER_TOOL]))
    if needed >= generator.max_seq_len:
        say(f"(the tool example's prompt needs {needed} tokens: raise --max_seq_len to see it)")
        return
    say(f"User: {dialog[0]['content']}   [tools: get_weather]\n")
    for _ in range(3):  # a reply, then (if it called the tool) the answer after the tool's result
        reply = generator.chat_completion([dialog], tools=[WEATHER_TOOL], temperature=0, max_gen_len=max_gen_len)
        message = reply[0]["generation"]
        calls = message["tool_calls"]
        say(f"> Assistant ({message['stop_reason']}): {message['content']}"
            + "".join(f"\n  calls {c['tool_name']}({json.dumps(c['arguments'])})" for c in calls) + "\n")
        if not calls:
            break
        dialog.append(message)
        for call in calls:
            result = json.dumps({"city": call["arguments"].get("city"), "temperature_c": 18, "sky": "clear"})
            say(f"Tool: {result}\n")
            dialog.append({"role": "ipython", "content": result})


def shared_line(user_input) -> Optional[str]:
    """The first rank reads a line and every rank receives it: None ends the chat (end of
    input, or Ctrl-C at the prompt, which the first rank reports in one line)."""
    from llama.cli.terminal import INTERRUPTED
    from llama.runtime.distributed import share_from_first_rank

    line = None
    if is_first_rank():
        line = user_input.read_line("You: ")
        if line is INTERRUPTED:
            say("\n(interrupted)")
            line = None
    return share_from_first_rank(line)


CHAT_HELP = """Commands:
  /image PATH   attach the picture at PATH to your next message (JPEG, PNG, WebP or GIF; Llama 4 and
                Llama 3.2 Vision checkpoints with their vision weights); repeat it to attach several
  /reset        clear the conversation (and any picture not yet sent)
  /help         this list
Ctrl-C stops a reply; Ctrl-D (or Ctrl-C at the prompt) ends the chat."""


def read_image_file(path: str) -> Union[bytes, str]:
    """The bytes of the file at ``path``, or a line saying why it cannot be read."""
    try:
        return Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        return f"no file at {path}"
    except IsADirectoryError:
        return f"{path} is a directory, not an image file"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"


def shared_image(generator, argument: str) -> Union[bytes, str]:
    """``/image PATH``: the image's bytes, read by the first rank and shared with every rank (so
    that each rank attaches the same picture, wherever its files are), checked by every rank; or
    a line saying why it is not attached (the same on every rank)."""
    from llama.images.preprocess import load_image
    from llama.runtime.distributed import share_from_first_rank

    if generator.formatter.image_layout is None:  # the same on every rank: nothing to share
        return ("this model takes no images (" + generator.formatter.why_no_images() + "): /image needs a Llama 4 "
                "or Llama 3.2 Vision checkpoint with its vision weights")
    if not argument:
        return "say which image: /image PATH"
    got = share_from_first_rank(read_image_file(argument) if is_first_rank() else None)
    if isinstance(got, str):
        return got
    try:
        load_image(got)  # decodable, and within the pixel limits: the same answer on every rank
    except ValueError as e:
        return f"{argument}: {e}"
    return got


def run_interactive(generator, temperature: float, top_p: float, system_prompt: Optional[str]) -> None:
    from llama.cli.terminal import StreamInput, open_input
    from llama.formats.session import ChatSession

    session = ChatSession(generator, system_prompt=system_prompt)
    reply_limit = min(session.reply_room, generator.max_seq_len - 1)  # what ChatSession.ask allows a reply
    images: List[bytes] = []  # attached by /image, sent with the next message
    say("Interactive chat: /help lists the commands (/image PATH attaches a picture, /reset clears the "
        "conversation); Ctrl-C stops a reply, Ctrl-D (or Ctrl-C) ends the chat.")
    # Only the first rank reads; at a terminal Ctrl-C becomes a key it reads (see llama.cli.terminal).
    with (open_input() if is_first_rank() else StreamInput()) as user_input:
        while True:
            line = shared_line(user_input)
            if line is None:
                say("\nBye.")
                return
            line = line.strip()
            if not line:
                continue
            if line == "/reset":
                session.reset()
                images.clear()
                say("(conversation cleared)")
                continue
            if line == "/help":
                say(CHAT_HELP)
                continue
            if line == "/image" or line.startswith("/image "):
                image = shared_image(generator, line[len("/image"):].strip())
                if isinstance(image, str):
                    say(f"(no image attached: {image})")
                else:
                    images.append(image)
                    say(f"(image attached to your next message: {len(images)} so far)")
                continue
            try:
                answer = session.ask(line, images=images, temperature=temperature, top_p=top_p)
            except ValueError as e:
                kept = f"; the {len(images)} attached image(s) wait for your next message, /reset drops them" \
                    if images else ""
                say(f"(not sent: {e}{kept})")
                continue
            images = []  # sent with this message: it is in the conversation now
            if session.trimmed:
                say(f"(dropped the {session.trimmed} oldest exchange(s) to fit max_seq_len)")
            say("Assistant: ", end="")
            for piece in answer:
                # A Ctrl-C typed while this piece was decoded stops the reply before it is
                # printed.  The first rank cancels; the cancellation reaches the other ranks'
                # engines at the next step and ends their copy of this loop too.
                if is_first_rank() and user_input.interrupt_typed():
                    answer.close()
                    break
                say(piece, end="")
            say("")
            if session.last_finish_reason == "cancelled":
                say("(reply stopped; this exchange is not kept in the conversation)")
            elif session.last_finish_reason == "length":  # the limit ended it, not the model
                say(f"(reply cut at the {reply_limit}-token limit; raise --max_seq_len for longer replies)")


def main(args: argparse.Namespace) -> None:
    # Interactive chat logs warnings only (--verbose: everything), so that the conversation reads clean.
    setup_logging(verbose=args.verbose or not args.interactive)
    ckpt, tokenizer = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path)
    check_device(args.device)  # before the model loads
    from llama import Llama  # imports torch: after the arguments are read and checked

    generator = Llama.build(
        ckpt_dir=ckpt,
        tokenizer_path=tokenizer,
        max_seq_len=resolve_lengths(args.ckpt_dir, args.max_seq_len),
        max_batch_size=args.max_batch_size,
        device=args.device,
        seed=args.seed,
        # A conversation is long-lived: it compiles where compiled steps pay; the examples do not.
        **{**model_options(args), "compile": compile_choice(args.compile, long_lived=args.interactive)},
    )
    if args.interactive:
        run_interactive(generator, args.temperature, args.top_p, args.system_prompt)
    else:
        run_examples(generator, args.temperature, args.top_p, args.max_gen_len, args.image)


if __name__ == "__main__":
    options = parse_args()
    run_script(PROG, lambda: main(options))
