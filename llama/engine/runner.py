"""Running a step's plan on the model: its tokens and positions as tensors, one ragged
prefill pass and one decoding pass, and the logits of every request that needs a token.
The decoding pass may be compiled (:meth:`ModelRunner.compile`)."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from llama.engine.cpu_threads import ThreadTuner
from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.requests import RunningRequest
from llama.engine.scheduler import PrefillChunk, StepPlan
from llama.model import Transformer
from llama.runtime.finite import NonFiniteError, check_finite_logits

logger = logging.getLogger(__name__)

# (tokens (B, 1), positions (B, 1), kv_len, cache) -> logits (B, V)
DecodeStep = Callable[[torch.Tensor, torch.Tensor, int, torch.nn.ModuleList], torch.Tensor]


@dataclass
class StepLogits:
    """What a step's forward passes give: the requests that need a token now, in the order
    of the rows of ``logits`` (R, V) float32; prompts fed in full that may not generate
    (``done``: echo scoring with no new token); requests whose prompt scoring failed."""

    requests: list[RunningRequest] = field(default_factory=list)
    logits: Optional[torch.Tensor] = None
    done: list[RunningRequest] = field(default_factory=list)
    errors: dict[int, BaseException] = field(default_factory=dict)  # by request id


class ModelRunner:
    """Feeds the model a plan's tokens.  Decoding rows are the cache's slots 0..n-1 (a view
    of the cache, no copy); a slot in that range with nothing to feed gets a padding token
    at the cache's scratch position."""

    def __init__(self, model: Transformer, kv: KVCacheManager) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.max_seq_len = model.params.max_seq_len
        self.scratch = self.max_seq_len  # the KV cache's scratch position: padding goes there
        self.decode_step: DecodeStep = model.decode_logits
        self.fixed_shape = False  # attend to the whole cache every step, in few shapes (compiled steps)
        # Chooses the CPU threads of eager steps by timing them (llama.engine.cpu_threads); None:
        # the count stays as the process set it.
        self.threads: Optional[ThreadTuner] = None

    # -- the decoding step, eager or compiled -----------------------------------------------

    @property
    def compiled(self) -> bool:
        """Whether decoding steps run compiled (False again after a failed compilation)."""
        return self.fixed_shape

    def compile(self) -> None:
        """Decode through ``torch.compile`` (CUDA graphs on a GPU).  Every step then has the
        same shapes (the whole cache is attended to, masked), so one compiled graph per row
        count (1, 2, 4, ...) serves the whole generation."""
        # RoPE multiplies complex numbers, which Inductor leaves to an eager kernel inside
        # the compiled graph (it says so once per graph); the step is still one graph.
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        on_cuda = self.device.type == "cuda"
        self.use_compiled_step(torch.compile(self.model.decode_logits, mode="reduce-overhead" if on_cuda else None,
                                             dynamic=False))

    def use_compiled_step(self, compiled: DecodeStep) -> None:
        """Decode through ``compiled``, falling back to eager (with a warning) if compiling
        fails: a slower run beats a crash."""

        def step(tokens, positions, kv_len, cache):
            try:
                return compiled(tokens, positions, kv_len, cache)
            except torch._dynamo.exc.TorchDynamoException as e:
                logger.warning("compiling the decoding step failed, continuing without it: %s", str(e).splitlines()[0])
                self.decode_step, self.fixed_shape = self.model.decode_logits, False
                return self.model.decode_logits(tokens, positions, kv_len, cache)

        self.decode_step, self.fixed_shape = step, True

    # -- one step ---------------------------------------------------------------------------

    def run(self, plan: StepPlan) -> StepLogits:
        """The plan's prefill pass, then its decoding pass; the logits of the requests that
        need a token (prefilled ones first)."""
        out = StepLogits()
        tuner = None if self.fixed_shape else self.threads
        if tuner is not None:
            tuner.before_step(0 if plan.prefill else len(plan.decode))
            start = time.perf_counter()
        prefilled = self._prefill(plan.prefill, out) if plan.prefill else []
        decoded, decoded_logits = self._decode(plan.decode) if plan.decode else ([], None)
        if tuner is not None:
            tuner.after_step(time.perf_counter() - start)
        rows = prefilled + decoded
        out.requests = [request for request, _ in rows]
        if decoded_logits is not None and not prefilled:
            out.logits = decoded_logits  # the decoding step's rows are the requests', in order: no copy
        elif rows:
            out.logits = torch.stack([row for _, row in rows])  # (R, V) float32
        return out

    def _prefill(self, chunks: list[PrefillChunk], out: StepLogits) -> list[tuple[RunningRequest, torch.Tensor]]:
        """Feed the prompt chunks in one ragged forward pass.  Returns the logits of requests
        whose prompt is now complete (and whose budget allows a token)."""
        width = max(c.end - c.start for c in chunks)
        from_start = all(c.start == 0 for c in chunks)
        tokens = torch.zeros((len(chunks), width), dtype=torch.long)
        positions = torch.full((len(chunks), width), self.scratch, dtype=torch.long)
        for i, c in enumerate(chunks):
            tokens[i, : c.end - c.start] = torch.tensor(c.request.prompt[c.start : c.end])
            positions[i, : c.end - c.start] = torch.arange(c.start, c.end)
        if from_start:
            # A new context on every row: plain causal attention over the fed tokens (padding
            # after a short prompt writes future slots of its own row, overwritten before use).
            positions = torch.arange(width).expand(len(chunks), width)
        slots = torch.tensor([c.request.slot for c in chunks])
        kv_len = width if from_start else max(c.end for c in chunks)
        hidden = self.model.hidden_states(
            tokens.to(self.device), positions.to(self.device), kv_len, self.kv.cache, from_start=from_start,
            cache_rows=slots.to(self.device),
        )
        rows = []
        for i, c in enumerate(chunks):
            request = c.request
            if request.prompt_logprobs is not None:
                try:
                    self._score_prompt(request, hidden[i, : c.end - c.start], c.start, c.end)
                except NonFiniteError as e:  # every rank scores the same logits: all fail it here
                    out.errors[request.id] = e
                    continue
            request.n_fed = c.end
            self.kv.record(request.slot, request.prompt[c.start : c.end], c.start)
            if c.end == len(request.prompt):
                if request.budget == 0:
                    out.done.append(request)
                else:
                    rows.append((request, self.model.logits(hidden[i, c.end - c.start - 1])))
        return rows

    def _score_prompt(self, request: RunningRequest, hidden: torch.Tensor, start: int, end: int,
                      chunk: int = 256) -> None:
        """Log-probability of prompt tokens start+1..end (within the prompt) given those
        before; logits are made ``chunk`` positions at a time to bound memory."""
        last = min(end, len(request.prompt) - 1)  # position whose successor is the last prompt token scored
        for a in range(start, last, chunk):
            b = min(a + chunk, last)
            logits = self.model.logits(hidden[a - start : b - start])
            check_finite_logits(logits, f"scoring prompt tokens {a + 1}..{b} of request {request.id}")
            log_probs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(request.prompt[a + 1 : b + 1], device=log_probs.device)
            request.prompt_logprobs[a + 1 : b + 1] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()

    def _decode(self, feeding: list[RunningRequest]) -> tuple[list[tuple[RunningRequest, torch.Tensor]],
                                                               Optional[torch.Tensor]]:
        """Feed every request's last sampled token, one per row.  Returns each request's
        logits row, and the step's (n, V) logits where its rows are exactly those rows in
        that order (else None): a batch of 8 saves copying 4 MB a step."""
        n = 1 + max(request.slot for request in feeding)
        if self.fixed_shape:  # few distinct shapes for a compiled step: 1, 2, 4, 8 ... rows
            n = min(self.kv.n_slots, 1 << (n - 1).bit_length())
        tokens = torch.zeros((n, 1), dtype=torch.long)
        positions = torch.full((n, 1), self.scratch, dtype=torch.long)
        for request in feeding:
            tokens[request.slot, 0] = request.pending
            positions[request.slot, 0] = request.n_fed
        kv_len = self.max_seq_len if self.fixed_shape else 1 + max(request.n_fed for request in feeding)
        logits = self.decode_step(tokens.to(self.device), positions.to(self.device), kv_len, self.kv.cache)  # (n, V)
        rows = []
        for request in feeding:
            self.kv.record(request.slot, [request.pending], request.n_fed)
            request.n_fed += 1
            request.pending = None
            rows.append((request, logits[request.slot]))
        in_order = [request.slot for request in feeding] == list(range(logits.shape[0]))
        return rows, (logits if in_order else None)
