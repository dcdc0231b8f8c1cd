"""Structured output: replies constrained to a JSON schema, a regular expression or a
Lark grammar, with llguidance as the grammar engine.

Four units, each owning one job:

* :mod:`~llama.structured.vocabulary`: our tokenizers (SentencePiece, Llama 3's and
  Llama 4's tiktoken) as llguidance sees them: each id's bytes, which ids are control
  tokens, which ids may end a reply.  Built once per tokenizer (about a second for a
  128k vocabulary).
* :mod:`~llama.structured.response_format`: an OpenAI-shaped ``response_format`` checked
  and compiled into a :class:`Grammar`, or a ``ValueError`` naming what is wrong, before
  anything is generated.
* :mod:`~llama.structured.limits`: what a grammar or schema may be before llguidance compiles
  it: no deeper than its compiler's recursion can go without overflowing the stack (which
  would kill the process), no keyword llguidance would silently ignore.
* :mod:`~llama.structured.matcher`: one :class:`GrammarMatcher` per constrained request
  (which tokens may come next, advanced by each accepted token), and
  :class:`GrammarMasker`, which computes the masks of a step's constrained rows together
  and applies them to the logits in one operation on their device (the engine computes
  each row's mask on a thread of its own: :class:`~llama.structured.matcher.MaskWorkers`).
* :mod:`~llama.structured.compiler`: compiles bounded in time, each grammar tried first in
  a worker process (:mod:`~llama.structured.compile_worker`) that is killed past the budget.
* :mod:`~llama.structured.manager`: :class:`StructuredOutputs`, which the Python API and the
  server ask for a request's grammar: it compiles response formats and tool choices and keeps
  the last ones compiled, by exact JSON and tenant scope.

It is a package of its own, not part of :mod:`llama.formats` (text formats, no torch) nor of
:mod:`llama.engine`: the engine applies the masks of grammars it is given compiled, the
manager compiles them for the Python API and the server, and the chat calls constrain tool
calls with grammars built here
(:mod:`~llama.structured.tool_choice`: ``tool_choice`` "required" or a named function).
"""

from llama.structured.manager import StructuredOutputs
from llama.structured.matcher import GrammarMasker, GrammarMatcher
from llama.structured.response_format import Grammar, compile_response_format
from llama.structured.tool_choice import ToolChoice, check_tool_choice, tool_call_grammar
from llama.structured.vocabulary import GrammarTokenizer, default_end_ids

__all__ = [
    "Grammar",
    "GrammarMasker",
    "GrammarMatcher",
    "GrammarTokenizer",
    "StructuredOutputs",
    "ToolChoice",
    "check_tool_choice",
    "compile_response_format",
    "default_end_ids",
    "tool_call_grammar",
]
