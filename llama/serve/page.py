"""What the chat page (``static/chat.html``) asks the server for besides the API: the prompts its
suggestion buttons offer, chosen for the model served (``GET /props``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

# The bundled demo model was trained on Shakespeare's plays: it answers in a play's voice, and
# only prompts of that kind give it a chance.
DEMO_SUGGESTIONS = (
    "Who art thou?",
    "What news from Verona?",
    "Speak, good Romeo: dost thou love her?",
)

# Any other model: what a newcomer would try first with an assistant.
GENERIC_SUGGESTIONS = (
    "Explain what a large language model is, in three sentences",
    "Write a Python function that tells whether a word is a palindrome",
    "Give me three ideas for a rainy weekend",
)


def chat_suggestions(ckpt_dir: Optional[Path], demo_dir: Optional[Path] = None) -> tuple[str, ...]:
    """The suggestion buttons' prompts for the checkpoint ``ckpt_dir``: the demo's Shakespeare
    prompts when it is the bundled demo model (``demo_dir``, default the examples' ``demo/``),
    generic ones for any other checkpoint (or none given)."""
    if demo_dir is None:
        from llama.cli.examples import DEMO_DIR

        demo_dir = DEMO_DIR
    if ckpt_dir is not None and Path(ckpt_dir).resolve() == Path(demo_dir).resolve():
        return DEMO_SUGGESTIONS
    return GENERIC_SUGGESTIONS
