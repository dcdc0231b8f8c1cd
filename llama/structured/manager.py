"""The structured-output manager: compiles and keeps the grammars that constrain replies, for
one tokenizer, so that neither front door (the Python API in :mod:`llama.generation`, the
server in :mod:`llama.serve`) nor the engine compiles anything itself.  The engine receives
compiled grammars (``RequestSettings.grammar``) and only applies their masks.

A grammar is compiled once per exact format: the cache key is the format's JSON with its keys
in their order (a schema's property order is the order of a reply's properties) and the
request's tenant scope (what one scope sends, no other scope reuses, nor can time: as the
prefix cache, :func:`llama.serve.auth.cache_scope`).  The last :data:`KEPT_GRAMMARS` are kept.
Every compile goes through the tokenizer's :class:`~llama.structured.compiler.GrammarCompiler`
(bounded in time, tried first in a worker process) and the depth limits of
:mod:`~llama.structured.limits` (checked before llguidance sees it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping, Optional, Sequence, cast

from llama.formats.tool_calls import ToolPromptFormat
from llama.structured.compiler import COMPILE_PROCESSES, COMPILE_TIMEOUT_S, GrammarCompiler
from llama.structured.response_format import Grammar, compile_response_format
from llama.structured.tool_choice import check_tool_choice, tool_call_grammar
from llama.structured.vocabulary import GrammarTokenizer

__all__ = ["KEPT_GRAMMARS", "StructuredOutputs"]

# Compiled grammars kept per manager: clients repeat their formats; a compiled grammar is a
# few hundred KB at most beside the vocabulary the tokenizer holds once.
KEPT_GRAMMARS = 64


class StructuredOutputs:
    """Compiles response formats and tool choices for ``tokenizer`` and keeps the last
    :data:`KEPT_GRAMMARS` compiled, by exact JSON and tenant scope.

    ``compile_timeout_s``: each compile's budget (a ``ValueError`` naming the field past it);
    None compiles in-process with no budget and no worker process (tests of other things).
    ``compile_processes``: the worker processes that try grammars first.  Both are read when
    the first grammar is compiled, which also builds the tokenizer as grammars see it (about
    a second for a 128k vocabulary).  Thread-safe: the server compiles on threads of its own."""

    def __init__(self, tokenizer: Any, *, compile_timeout_s: Optional[float] = COMPILE_TIMEOUT_S,
                 compile_processes: int = COMPILE_PROCESSES, kept: int = KEPT_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.compile_timeout_s = compile_timeout_s
        self.compile_processes = compile_processes
        self.kept = kept
        self._grammar_tokenizer: Optional[GrammarTokenizer] = None
        self._grammars: OrderedDict[str, Optional[Grammar]] = OrderedDict()
        self._lock = threading.Lock()

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The tokenizer as grammars see it (built on first use, then shared), with its
        compiler bounding each compile to ``compile_timeout_s``."""
        with self._lock:
            if self._grammar_tokenizer is None:
                grammar_tokenizer = GrammarTokenizer(self.tokenizer)
                if self.compile_timeout_s is not None:
                    grammar_tokenizer.compiler = GrammarCompiler(grammar_tokenizer, timeout_s=self.compile_timeout_s,
                                                                 processes=self.compile_processes)
                self._grammar_tokenizer = grammar_tokenizer
            return self._grammar_tokenizer

    def response_format(self, response_format: Optional[Mapping[str, Any]], *,
                        scope: Optional[str] = None) -> Optional[Grammar]:
        """``response_format`` (OpenAI's shapes, :mod:`llama.structured`) compiled: None for free
        text, ValueError naming the field where it cannot be."""
        if response_format is None:
            return None
        return self._kept(["response_format", scope, response_format],
                          lambda: compile_response_format(response_format, self.grammar_tokenizer()))

    def tool_choice(self, tools: Optional[Sequence[object]], tool_choice: object, tool_prompt_format: str = "json",
                    parallel_tool_calls: bool = True, *, scope: Optional[str] = None) -> Optional[Grammar]:
        """The grammar of a chat reply that ``tool_choice`` constrains to calls of ``tools``
        (:func:`~llama.structured.tool_choice.tool_call_grammar`): None for "auto" and "none",
        ValueError for a bad choice or a schema that cannot be compiled."""
        if not check_tool_choice(tool_choice, tools).constrained:
            return None
        return self._kept(["tool_choice", scope, tools, tool_choice, tool_prompt_format, parallel_tool_calls],
                          lambda: tool_call_grammar(tools or (), tool_choice, self.grammar_tokenizer(),
                                                    cast(ToolPromptFormat, tool_prompt_format),  # checked there
                                                    parallel_tool_calls))

    def _kept(self, key: list, compile: Callable[[], Optional[Grammar]]) -> Optional[Grammar]:
        """``compile()``'s grammar, or the one kept by ``key`` (its JSON, keys in their order).
        Compiled outside the lock: a slow compile holds up no other request's."""
        text = json.dumps(key, default=repr)
        with self._lock:
            if text in self._grammars:
                self._grammars.move_to_end(text)
                return self._grammars[text]
        grammar = compile()
        with self._lock:
            self._grammars[text] = grammar
            while len(self._grammars) > self.kept:
                self._grammars.popitem(last=False)
        return grammar
