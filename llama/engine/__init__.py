"""The generation engine: one continuous-batching loop under every entry point.

The KV cache is a pool of blocks (``kv_cache_tokens`` tokens in blocks of ``block_size``).
A request waits in a queue until one of ``max_batch_size`` rows and blocks for its prompt
are free, has its prompt prefilled (several prompts in one ragged forward pass, a long one
in chunks of at most ``prefill_chunk`` tokens per step so that it does not stall the
others), then decodes one token per step together with every other running request,
taking a block whenever its last one is full, and gives its blocks back the moment it
finishes, is cancelled or fails.  Full blocks stay in a prefix cache shared by every
request (and a request's last, partly written block when it ends): a later request whose
prompt starts with the same tokens (the next turn of a chat, a shared system prompt), in
the same cache scope, prefills only the rest.  When the blocks run out, the newest request
is preempted and later resumed (see the scheduler).

Each request has its own sampling settings and its own seeded generator, so a seeded
request gives the same text whatever else shares the batch.

Speculative decoding (``Llama.build(..., speculative={"method": "ngram", "num_tokens": 4})``,
:mod:`~llama.engine.speculative`): the plan gives some decoding rows tokens *proposed* for the
positions after their pending one (prompt lookup: what followed the reply's last tokens where
they occurred before), with blocks for them taken from the free ones; the runner feeds them
after the pending token in the step's one decoding pass and returns the logits of every fed
position; the sampler accepts proposals while each is the token it chooses at the position
before it, exactly as without them; the update keeps the accepted run (several tokens, each
told to the caller as its own event, a stop inside the run ending the reply exactly there),
counts only those as fed, so the keys and values of rejected positions lie beyond the fed
count and are overwritten, and gives back the blocks that held only those.  Every rank
computes the same proposals from the same tokens.  A draft model (``"method": "draft"``,
:mod:`~llama.engine.draft`) proposes over a KV cache of its own; its proposals for a sampled
request come with its distribution, for the general rejection rule.

Driving.  Without a server, whichever thread waits on a request runs the steps (one at a
time, under a lock); the others' requests advance with them.  A server calls
:meth:`Engine.run_forever` instead, on every rank's main thread.  In a multi-rank job
only the main thread ever runs steps (the ranks must take the same steps in the same
order), so there, requests from other threads need ``run_forever``.  A server announces
each request while it reads and tokenises it (:meth:`Engine.arriving`): an idle engine waits
for the announced ones (at most ``arrival_wait_s``) so that requests sent together start in
one step.

Ranks.  Under torchrun every rank holds a slice of the model and runs the same steps.
The first rank decides each step (requests admitted, with their tokens and settings, and
cancellations) and shares the decisions before computing; it also samples every token and
shares those (:func:`llama.runtime.distributed.broadcast_from_first_rank`).  The other
ranks only follow: they never wait on a client, and requests they submit themselves (the
Python API, where every rank makes the same calls) are matched to the first rank's by order.

One step reads plan -> run -> sample -> update -> output, each a unit of its own, as in
vLLM v1: the runner and the sampler return data, the scheduler's update alone changes a
request's progress (what the cache holds of it, its tokens, its end), and the output
processor tells the callers.

* :mod:`~llama.engine.scheduler`: the wait queue, admissions, cancellations, the step's plan
  (which prompt chunks are prefilled, which rows decode), and the update
  (:meth:`~llama.engine.scheduler.Scheduler.update_from_output`) that records what the
  step did to each request and ends the ones that are done;
* :mod:`~llama.engine.kv_cache_manager`: the paged cache, each request's block table (kept
  there under the request's id) and the prefix cache (the accounting:
  :mod:`~llama.engine.block_manager`);
* :mod:`~llama.engine.runner`: the plan as tensors, the model's forward passes (the
  decoding one possibly compiled), logits and the prompt tokens' log-probabilities asked
  for, changing no request; on a GPU the tensors go through pinned buffers
  (:mod:`~llama.engine.staging`), so that feeding a step never waits for the device;
* :mod:`~llama.engine.sampler`: logits processors, temperature / top-k / top-p with each
  request's seeded generator (the arithmetic in :mod:`~llama.engine.sampling`), and the
  acceptance of proposals;
* :mod:`~llama.engine.speculative`: what proposes tokens, and how many each row proposes;
  :mod:`~llama.engine.draft`: a draft model as proposer, with a paged KV cache of its own;
* :mod:`~llama.engine.output`: the chosen tokens' log-probabilities; events, results and
  errors, told through each request's handle (the text, detokenised incrementally and cut
  at stop strings by each request's assembler: :mod:`~llama.engine.detokenize`);
* :mod:`~llama.engine.core`: :class:`Engine`, which drives them; :mod:`~llama.engine.requests`:
  what a request is (settings, handle, events, result, and the running request's state with
  the methods that change it).

Built by :mod:`~llama.engine.build`: a checkpoint loaded on this rank with its tokenizer,
chat format and engine, what both ``llama.Llama.build`` and the server start from.
"""

from llama.engine.core import Engine, StepOutcome
from llama.engine.requests import (
    EngineBusy,
    EngineStopped,
    LogitsProcessor,
    RequestHandle,
    RequestResult,
    RequestSettings,
    TokenEvent,
)

__all__ = [
    "Engine",
    "StepOutcome",
    "RequestSettings",
    "RequestHandle",
    "TokenEvent",
    "RequestResult",
    "EngineBusy",
    "EngineStopped",
    "LogitsProcessor",
]
