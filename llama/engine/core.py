"""The engine: requests in, one step at a time, events and results out.

A step reads plan -> run -> sample -> update -> output: the scheduler decides (on the
first rank, shared with the others) and plans the step's tokens, the runner feeds them to
the model and returns logits, the sampler chooses each request's next token, the
scheduler's update records what the step did to each request (the one place a request's
progress changes) and ends the requests that are done, the output processor tells their
callers.  See :mod:`llama.engine` for the KV blocks, driving and ranks.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, cast

import torch

from llama.engine.cpu_threads import ThreadTuner
from llama.engine.draft import DraftProposer
from llama.engine.image_contexts import ImageContexts
from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.kv_sizing import CudaMemory, DeviceMemory, check_kv_cache_memory, size_kv_cache
from llama.engine.lora import ServedAdapters
from llama.engine.output import OutputProcessor
from llama.engine.requests import (
    Admission,
    EngineBusy,
    EngineStopped,
    RequestHandle,
    RequestSettings,
    RunningRequest,
    TokenEvent,
)
from llama.engine.runner import ModelRunner
from llama.engine.sampler import Sampler
from llama.engine.sampling import RowSummary
from llama.engine.scheduler import Decisions, RequestOutput, Sampled, Scheduler
from llama.engine.speculative import Proposer, SpeculativeConfig, Speculator, check_speculative
from llama.images.prompt import MllamaPromptImage, PromptImage
from llama.model import Transformer
from llama.runtime import distributed, host
from llama.runtime.options import DEFAULT_KV_BLOCK_SIZE, check_kv_cache_tokens
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.structured import Grammar

logger = logging.getLogger(__name__)

# What a prompt with images gets from an engine whose model has no vision encoder.
IMAGES_NOT_TAKEN = ("this model takes no images (it has no vision encoder: a Llama 4 or Llama 3.2 Vision checkpoint "
                    "with its vision weights does); send text only")


def mllama_image_token(model: Any) -> Optional[int]:
    """The id of ``<|image|>`` in a prompt of ``model`` when it is a Llama 3.2 Vision model with its
    encoder (past the tokenizer's ids: one of the model's learnt rows); None for any other model."""
    if getattr(model, "vision_model", None) is None:
        return None
    return model.image_token_id


class StepOutcome(enum.Enum):
    """What :meth:`Engine.step` did."""

    RAN = "ran"
    IDLE = "idle"  # a follower rank was told that no work is coming for now
    SHUTDOWN = "shutdown"  # the first rank stopped serving


class Engine:
    """Continuous batching over a paged KV cache (see :mod:`llama.engine`).

    ``model``: a :class:`~llama.model.Transformer` with its weights loaded; ``tokenizer``:
    stop tokens and text; ``generator``: draws the seeds of requests that give none;
    ``prefill_chunk``: most prompt tokens fed per step; ``max_queue``: most requests
    waiting beyond the free rows (:class:`EngineBusy` past it; None: no limit);
    ``compile``: decode through ``torch.compile``; ``arrival_wait_s``: most seconds an idle
    served engine waits for the requests announced by :meth:`arriving` before its first step.
    ``kv_cache_tokens``: the KV cache's size (default ``max_batch_size * max_seq_len``); or
    ``kv_cache_memory``: the share in (0, 1) of the GPU's total memory this process may fill,
    the KV cache getting what the weights and the largest steps, measured by running them,
    leave of it (:mod:`llama.engine.kv_sizing`; CUDA only, unless ``device_memory`` gives
    the readings: tests).  ``speculative``: propose tokens and verify them in the decoding
    steps (:mod:`llama.engine.speculative`): None (off), a dict such as ``{"method": "ngram",
    "num_tokens": 4}`` or a :class:`~llama.engine.speculative.SpeculativeConfig`; ``proposer``
    replaces the method's own (benchmarks).  ``draft``: the draft model of the ``"draft"``
    method (:func:`llama.engine.build.load_draft`: whole on this rank, or sharded as ``model``
    with ``draft_tensor_parallel_size``), which proposes
    over a KV cache of its own as large as the engine's (:mod:`llama.engine.draft`; with
    ``kv_cache_memory`` the two pools share what is left, by their K/V bytes per token).
    ``lora``: the LoRA adapters ``model`` serves unmerged (:func:`llama.engine.lora.load_lora_adapters`),
    which requests name (``RequestSettings.lora``); rows of any adapters and none decode in one step.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, generator: torch.Generator,
                 prefill_chunk: int = 512, max_queue: Optional[int] = None, compile: bool = False,
                 kv_cache_tokens: Optional[int] = None, block_size: int = DEFAULT_KV_BLOCK_SIZE,
                 arrival_wait_s: float = 0.025, kv_cache_memory: Optional[float] = None,
                 device_memory: Optional[DeviceMemory] = None, speculative: Optional[Any] = None,
                 proposer: Optional[Proposer] = None, draft: Optional[Transformer] = None,
                 lora: Optional[ServedAdapters] = None) -> None:
        self.model = model
        config = check_speculative(speculative)
        if lora is not None and lora.slots and (config is not None or proposer is not None):
            raise ValueError("speculative decoding with LoRA adapters served unmerged is not supported (a draft "
                             "or prompt lookup would propose for the base, and verification would need each row's "
                             "adapter): leave speculative unset, or merge the adapter (merge_lora)")
        # The LoRA adapters served unmerged (llama.engine.lora), by name; None: none
        self.lora = lora if lora is not None and lora.slots else None
        drafting = config is not None and config.method == "draft" and proposer is None
        if drafting:
            check_draft_model(draft, model)
        if isinstance(arrival_wait_s, bool) or not isinstance(arrival_wait_s, (int, float)) or not arrival_wait_s >= 0:
            raise ValueError(f"arrival_wait_s must be a number of seconds >= 0, got {arrival_wait_s!r}")
        self.arrival_wait_s = float(arrival_wait_s)
        self.tokenizer = tokenizer
        self.max_batch_size = model.params.max_batch_size
        self.max_seq_len = model.params.max_seq_len
        self.first_rank = distributed.model_parallel_rank() == 0
        self.multi_rank = distributed.model_parallel_world_size() > 1
        # Ids the tokenizer cannot turn into text (a checkpoint may pad its vocabulary) are
        # never sampled, nor taken in a prompt.
        self.n_decodable = min(tokenizer.n_words, model.vocab_size)

        self.lock = threading.Condition(threading.RLock())
        sizing = None
        # The (rows, positions per row) of the steps that verify proposals: compiled with the decoding step
        verified = config.verified_shapes(self.max_batch_size) if config is not None else []
        if kv_cache_memory is not None:
            # Measured before the pool below exists: the passes and graphs it must leave room for.
            fraction = check_kv_cache_memory(kv_cache_memory)
            # With a draft, its pool (as many blocks) shares what is left with the target's.
            sizing = size_kv_cache(model, fraction, self._device_memory(kv_cache_tokens, device_memory),
                                   max_batch_size=self.max_batch_size, prefill_chunk=prefill_chunk,
                                   block_size=block_size, compile=compile, verify_shapes=verified,
                                   draft=draft if drafting else None,
                                   draft_rows=config.disable_by_batch_size if config is not None else 0,
                                   draft_whole=config is None or config.draft_tensor_parallel_size == 1,
                                   lora=self.lora)
            kv_cache_tokens, compile = sizing.tokens, sizing.compiled
        kv_cache_tokens = check_kv_cache_tokens(kv_cache_tokens, self.max_batch_size, self.max_seq_len)
        n_blocks = 1 + -(-kv_cache_tokens // block_size)  # and the scratch block
        self.kv = KVCacheManager(model.new_kv_cache(n_blocks=n_blocks, block_size=block_size), n_blocks, block_size,
                                 self.max_seq_len)
        self.draft: Optional[DraftProposer] = None
        if drafting:  # a pool of the draft's own, as large as the engine's
            self.draft = DraftProposer(cast(Transformer, draft), n_blocks=n_blocks, block_size=block_size,
                                       n_decodable=self.n_decodable, prefill_chunk=prefill_chunk,
                                       multi_rank=self.multi_rank,
                                       whole=cast(SpeculativeConfig, config).draft_tensor_parallel_size == 1)
        self.speculator = Speculator(config, proposer or self.draft) if config is not None else None
        # Llama 3.2 Vision requests' image contexts: the runner computes them, the scheduler lets them go
        # (a pool of max_batch_size image slots, one image a row: what the memory check counts)
        takes_mllama = getattr(model, "vision_model", None) is not None and len(model.cross_attention_layers) > 0
        self.image_contexts = ImageContexts(self.max_batch_size if takes_mllama else None)
        self.scheduler = Scheduler(self.kv, self.lock, first_rank=self.first_rank, prefill_chunk=prefill_chunk,
                                   max_queue=max_queue, max_batch_size=self.max_batch_size, speculator=self.speculator,
                                   check_proposals=self._proposals_within_grammars, image_contexts=self.image_contexts)
        self.runner = ModelRunner(model, self.kv, self.max_batch_size, prefill_chunk=prefill_chunk,
                                  verify_shapes=verified, image_contexts=self.image_contexts,
                                  n_decodable=self.n_decodable)
        self.runner.lora = self.lora
        if compile:
            self.runner.compile()
            self.runner.warm_up()  # captured against this pool, the only one from now on
        elif model.device.type == "cpu" and (threads := host.threads_chosen_here()) is not None and threads > 1:
            self.runner.threads = ThreadTuner(ThreadTuner.candidates_for(threads))
        if sizing is not None:
            pools = [self.kv.cache] + ([self.draft.cache] if self.draft is not None else [])
            sizing.check_use(sum(t.numel() * t.element_size() for pool in pools for t in pool.buffers()))
        self.sampler = Sampler(self.n_decodable, generator, model.device, first_rank=self.first_rank,
                               multi_rank=self.multi_rank)
        self.output = OutputProcessor(self.lock)

        self._drive = threading.Lock()  # held by whichever thread runs a step
        self._ids = itertools.count()
        self._stepping: Optional[int] = None  # the thread running a step, while it runs one
        self._serving = False
        self._arriving = 0  # requests announced by arriving() and not yet submitted
        self._failed: Optional[BaseException] = None
        self._counters = dict(requests_total=0, prompt_tokens_total=0, cached_prompt_tokens_total=0,
                              prefix_cache_hits_total=0)

    def _device_memory(self, kv_cache_tokens: Optional[int], device_memory: Optional[DeviceMemory]) -> DeviceMemory:
        """Where ``kv_cache_memory`` reads the device's memory; ValueError where it cannot."""
        if kv_cache_tokens is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if device_memory is not None:
            return device_memory
        if self.model.device.type != "cuda":
            raise ValueError("kv_cache_memory sizes the KV cache from the GPU's memory: it needs a CUDA device; "
                             "on the CPU give kv_cache_tokens")
        return CudaMemory(self.model.device)

    @property
    def max_queue(self) -> Optional[int]:
        return self.scheduler.max_queue

    @max_queue.setter
    def max_queue(self, value: Optional[int]) -> None:
        self.scheduler.max_queue = value

    @property
    def prefill_chunk(self) -> int:
        return self.scheduler.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value: int) -> None:
        self.scheduler.prefill_chunk = value

    # -- submitting ----------------------------------------------------------------------

    def check_prompt(self, prompt: Sequence[int], what: str = "prompt") -> list[int]:
        """``prompt`` as a list of token ids the tokenizer can decode; TypeError/ValueError
        saying what is wrong otherwise."""
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TypeError(f"{what} must be a list of int token ids")
        if not prompt:
            raise ValueError(f"{what} is empty: give at least one token (e.g. BOS)")
        if len(prompt) > self.max_seq_len:
            raise ValueError(
                f"{what} has {len(prompt)} tokens, more than max_seq_len={self.max_seq_len}: "
                "shorten it or build with a larger max_seq_len"
            )
        image_token = mllama_image_token(self.model)
        if not all(0 <= t < self.n_decodable or t == image_token for t in prompt):
            raise ValueError(f"{what} holds token ids outside [0, {self.n_decodable}) (the tokenizer's vocabulary)")
        return list(prompt)

    def _check_mllama_images(self, images: Sequence[Any], prompt: Optional[Sequence[int]],
                             prompt_length: int) -> tuple[MllamaPromptImage, ...]:
        """A Llama 3.2 Vision prompt's images (:meth:`check_images`): each cut for this model's
        tiles, at an ``<|image|>`` token of the prompt, one image per such token, in order."""
        image_token = mllama_image_token(self.model)
        if images and image_token is None:
            raise ValueError("this model takes no Llama 3.2 Vision images: it has no vision encoder (params.json's "
                             "vision_chunk_size), or it was loaded with vision=False")
        if images and (not isinstance(images, (list, tuple))
                       or not all(isinstance(i, MllamaPromptImage) for i in images)):
            raise TypeError("images must be a list of MllamaPromptImage (a chat format's EncodedDialog.images)")
        params = self.model.params
        shape = (params.vision_max_num_chunks, 3, params.vision_chunk_size, params.vision_chunk_size)
        previous = -1
        for k, image in enumerate(images):
            if not isinstance(image.pixel_values, torch.Tensor) or tuple(image.pixel_values.shape) != shape:
                raise ValueError(f"image {k}: pixel_values must be a {list(shape)} tensor (this model's tiles), got "
                                 f"{getattr(image.pixel_values, 'shape', type(image.pixel_values).__name__)}")
            if not previous < image.start < prompt_length:
                raise ValueError(f"image {k}: its <|image|> token's position {image.start} is not within the prompt "
                                 f"({prompt_length} tokens) after the image before it")
            if prompt is not None and prompt[image.start] != image_token:
                raise ValueError(f"image {k}: the prompt holds no <|image|> token (id {image_token}) at its position "
                                 f"{image.start}: encode the dialog with this model's chat format")
            previous = image.start
        if prompt is not None and image_token is not None:
            marks = sum(1 for t in prompt if t == image_token)
            if marks != len(images):
                raise ValueError(f"the prompt holds {marks} <|image|> token(s) (id {image_token}) for {len(images)} "
                                 "image(s): each image needs exactly one, and each such token its image")
        self.image_contexts.check_fits(images)
        return tuple(images)

    def check_images(self, images: Sequence[Any], prompt_length: int,
                     prompt: Optional[Sequence[int]] = None) -> tuple[Any, ...]:
        """``images`` as a tuple of :class:`~llama.images.prompt.PromptImage` (Llama 4) or
        :class:`~llama.images.prompt.MllamaPromptImage` (Llama 3.2 Vision) in prompt order,
        within a prompt of ``prompt_length`` tokens (``prompt``, where given, is checked to hold
        one ``<|image|>`` token per Llama 3.2 Vision image), for this model's encoder; TypeError
        or ValueError saying what is wrong otherwise."""
        if mllama_image_token(self.model) is not None or (images and isinstance(images, (list, tuple))
                                                      and any(isinstance(i, MllamaPromptImage) for i in images)):
            return self._check_mllama_images(images, prompt, prompt_length)
        if not images:
            return ()
        if not isinstance(images, (list, tuple)) or not all(isinstance(i, PromptImage) for i in images):
            raise TypeError("images must be a list of PromptImage (a chat format's EncodedDialog.images)")
        if not self.model.takes_images:
            raise ValueError(IMAGES_NOT_TAKEN)
        previous_end = 0
        for k, image in enumerate(images):
            pixels, positions = image.pixel_values, image.patch_positions
            if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or pixels.shape[1] != 3:
                raise ValueError(f"image {k}: pixel_values must be a [n_tiles, 3, H, W] tensor")
            if not positions or len(positions) % pixels.shape[0]:
                raise ValueError(f"image {k}: {len(positions)} patch positions for {pixels.shape[0]} tiles")
            if not previous_end <= image.start <= positions[0] or not positions[-1] < image.end <= prompt_length:
                raise ValueError(f"image {k}: its positions ({image.start}..{image.end}) are not within the prompt "
                                 f"({prompt_length} tokens) after the image before it")
            if any(b <= a for a, b in zip(positions, positions[1:])):
                raise ValueError(f"image {k}: its patch positions are not increasing")
            previous_end = image.end
        return tuple(images)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Announce a request on its way (its prompt being read and tokenised) for the time of
        the ``with`` block, which ends once it is submitted (or refused).  A served engine that
        is idle when requests come waits for the ones announced, at most ``arrival_wait_s``, so
        that requests sent together start in one step: otherwise the first starts alone and the
        others wait for that step to end (16 clients sharing a system prompt, 15 of them at
        once: their median first token came a whole step later, BENCHMARKS.md "Paged KV cache").
        A request that comes alone waits for nothing."""
        with self.lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self.lock:
                self._arriving -= 1
                self.lock.notify_all()

    def _wait_for_arrivals(self, should_stop: threading.Event) -> None:
        """Under the lock, with requests queued and none running: wait while others are
        announced (:meth:`arriving`), at most ``arrival_wait_s``."""
        deadline = time.monotonic() + self.arrival_wait_s
        while self._arriving and not should_stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.lock.wait(timeout=left)

    def lora_slot(self, name: Optional[str]) -> int:
        """The slot of LoRA adapter ``name`` (0: None, the base); ValueError naming the adapters
        loaded for any other name."""
        if name is None:
            return 0
        if self.lora is None:
            raise ValueError(f"unknown LoRA adapter {name!r}: this model serves no adapters "
                             "(Llama.build's lora_adapters, the server's --lora name=path)")
        return self.lora.slot_of(name)

    def submit(self, prompt_tokens: Sequence[int], settings: RequestSettings,
               on_event: Optional[Callable] = None, *, images: Sequence[Any] = ()) -> RequestHandle:
        """Queue a request (thread-safe).  Raises ValueError/TypeError for bad input and
        :class:`EngineBusy` when ``max_queue`` requests already wait to run.
        ``on_event`` is called (from the stepping thread) with each :class:`TokenEvent`, then
        the :class:`RequestResult` or the error.  ``images``: the prompt's images
        (:class:`~llama.images.prompt.PromptImage`, in prompt order, as a chat format lays them
        out), whose vision features replace the embeddings at their ``<|patch|>`` positions when
        the prompt is prefilled; a model without a vision encoder refuses them (ValueError,
        :data:`IMAGES_NOT_TAKEN`) rather than dropping them."""
        if self._stepping == threading.get_ident():
            raise RuntimeError(
                "a generation call was made from inside the engine's step (a logits_processor or event "
                "callback calling back into the same Llama): the step cannot wait for itself. Make such "
                "calls before or after generating, or on another Llama"
            )
        prompt = self.check_prompt(prompt_tokens)
        prompt_images = self.check_images(images, len(prompt), prompt)
        if not isinstance(settings, RequestSettings):
            raise TypeError(f"settings must be a RequestSettings, got {type(settings).__name__}")
        settings = settings.checked()
        if settings.lora is not None:
            self.lora_slot(settings.lora)
        if settings.grammar is not None:
            if settings.grammar.tokenizer.n_words != self.tokenizer.n_words:
                raise ValueError(f"the grammar was compiled for a tokenizer of {settings.grammar.tokenizer.n_words} "
                                 f"ids, not this model's ({self.tokenizer.n_words}): compile it with this Llama's")
            self.grammar_end_ids(settings)  # refused now, not in a step
        with self.lock:
            if self._failed is not None:
                raise RuntimeError(f"the engine stopped after an error: {self._failed}") from self._failed
            waiting = self.scheduler.waiting_beyond_free_slots()
            if self.max_queue is not None and waiting >= self.max_queue:
                raise EngineBusy(f"{waiting} requests are already waiting to run (max_queue={self.max_queue})")
            handle = RequestHandle(self, next(self._ids), prompt, settings, on_event, prompt_images)
            self.scheduler.add(handle)
            self.lock.notify_all()
        return handle

    def grammar_end_ids(self, settings: RequestSettings) -> frozenset[int]:
        """The ids that may end a reply constrained by ``settings.grammar``: its stop tokens
        (the tokenizer's by default) that the grammar's tokenizer knows as ends; ValueError
        where there are none."""
        stops = self.tokenizer.stop_tokens if settings.stop_tokens is None else settings.stop_tokens
        end_ids = cast("Grammar", settings.grammar).tokenizer.end_ids  # asked of constrained requests only
        ends = frozenset(stops) & end_ids
        if not ends:
            raise ValueError(f"none of the request's stop tokens {sorted(stops)} can end a constrained reply "
                             f"(the grammar's end ids: {sorted(end_ids)})")
        return ends

    def stats(self) -> dict:
        with self.lock:
            running = len(self.scheduler.running)
            blocks = self.kv.blocks
            return dict(queued=len(self.scheduler.queue) + len(self.scheduler.preempted), running=running,
                        slots_in_use=running, preempted=len(self.scheduler.preempted),
                        kv_blocks_total=blocks.usable, kv_blocks_in_use=blocks.in_use,
                        kv_blocks_cached=blocks.cached, kv_block_size=self.kv.block_size,
                        preemptions_total=self.scheduler.preemptions,
                        tokens_generated_total=self.scheduler.tokens_generated,
                        spec_proposed_tokens_total=self.speculator.proposed_total if self.speculator else 0,
                        spec_accepted_tokens_total=self.speculator.accepted_total if self.speculator else 0,
                        **self._counters)

    # -- driving -------------------------------------------------------------------------

    def next_event(self, handle: RequestHandle) -> Optional[TokenEvent]:
        """The handle's next event, running steps or waiting for whoever runs them.  None
        once the request has finished; its error is raised."""
        while True:
            with self.lock:
                if handle.ready:
                    return handle.take_event()
                if not self._may_drive() or not self._drive.acquire(blocking=False):
                    self.lock.wait(timeout=0.5)
                    continue
            try:
                self.step()
            finally:
                self._drive.release()

    def _may_drive(self) -> bool:
        """Whether a thread waiting on a request may run steps itself: not while the
        engine is served, and in a multi-rank job only from the main thread (the other
        ranks follow the first rank's steps in one order, which two driving threads on
        the first rank would not keep; there, other threads wait for run_forever)."""
        if self._serving:
            return False
        return not self.multi_rank or threading.current_thread() is threading.main_thread()

    def run_forever(self, should_stop: threading.Event, poll_s: float = 0.1) -> None:
        """Serve: step whenever there is work, until ``should_stop`` is set on the first
        rank.  Call it on every rank's main thread; the other ranks follow the first.
        Requests still queued or running when it stops fail with :class:`EngineStopped`."""
        with self.lock:
            self._serving = True
        try:
            if self.first_rank:
                self._lead(should_stop, poll_s)
            else:
                self._follow()
        finally:
            with self.lock:
                self._serving = False
                self.lock.notify_all()

    def _lead(self, should_stop: threading.Event, poll_s: float) -> None:
        awake = False  # have the other ranks been told that steps are coming?
        while True:
            with self.lock:
                while not (should_stop.is_set() or self.scheduler.has_work or awake):
                    self.lock.wait(timeout=poll_s)
                if not (self.scheduler.running or self.scheduler.preempted):  # idle until now
                    self._wait_for_arrivals(should_stop)
                has_work = self.scheduler.has_work
            if should_stop.is_set():
                if self.multi_rank:
                    if not awake:
                        distributed.share_from_first_rank("wake")
                    self._share(Decisions(shutdown=True))
                self._stop_all()
                return
            if not has_work:
                # Nothing left: the other ranks go back to waiting on the long-timeout group
                # (a follower whose step brings no decisions and runs nothing is idle).
                if self.multi_rank:
                    self._share(None)
                awake = False
                continue
            if self.multi_rank and not awake:
                distributed.share_from_first_rank("wake")
                awake = True
            with self._drive:
                self.step()

    def _follow(self) -> None:
        while True:
            distributed.share_from_first_rank(None)  # wait (long timeout) until the first rank has work
            while True:
                with self._drive:
                    outcome = self.step()
                if outcome is StepOutcome.IDLE:
                    break
                if outcome is StepOutcome.SHUTDOWN:
                    self._stop_all()
                    return

    def _stop_all(self) -> None:
        error = EngineStopped("the server is shutting down")
        with self.lock:
            outputs, waiting = self.scheduler.abort_all(error)
            self.output.end_unstarted(waiting, error)
            self.output.deliver(outputs)
            self.lock.notify_all()

    # -- one step ------------------------------------------------------------------------

    def step(self) -> StepOutcome:
        """Plan (admissions and cancellations decided by the first rank and shared; the
        tokens to feed), run the model, sample, update the requests, deliver."""
        self._stepping = threading.get_ident()
        try:
            with distributed.explain_peer_failures(), torch.inference_mode():
                decisions = self.scheduler.decide() if self.first_rank else None
                if decisions is not None and self.sampler.holding:  # the first rank's
                    decisions.masks_ready, decisions.masks_overdue = self.sampler.mask_decisions()
                if decisions is not None and self.speculator is not None:  # what steps cost: the first rank's times
                    decisions.speculation_costs = self.speculator.costs_to_share()
                if self.multi_rank:
                    decisions = self._share(decisions)
                decisions = cast(Decisions, decisions)  # the first rank's, or shared with every rank
                if decisions.shutdown:
                    return StepOutcome.SHUTDOWN
                if not self.first_rank and not decisions and not self.scheduler.running:
                    return StepOutcome.IDLE
                self._apply(decisions)
                if decisions.speculation_costs is not None and self.speculator is not None:
                    self.speculator.use_costs(decisions.speculation_costs)
                released = self._sample_released(decisions.masks_ready)
                started = self.speculator.clock() if self.speculator is not None else 0.0
                plan = self.scheduler.plan()
                self.sampler.forget_held(self.scheduler.running)  # preempted ones compute their logits again
                if plan:
                    # Grammar masks are computed on the host while the model runs.
                    self.sampler.start_masks(plan.decode + [chunk.request for chunk in plan.prefill], plan.proposals)
                    ran = self.runner.run(plan)  # logits; no request changes
                    sampled = self._sample(ran.requests, ran.logits, ran.rows, ran.proposals, ran.summary)
                    with self.lock:
                        outputs = self.scheduler.update_from_output(plan, ran, sampled)  # the one writer
                        self.output.deliver(outputs)
                    if self.speculator is not None:  # what the step cost, by its shape (llama.engine.speculative)
                        width = 1 + max(map(len, plan.proposals.values()), default=0)
                        seconds = self.speculator.clock() - started if self.first_rank else None
                        self.speculator.observe(len(plan.decode), width, bool(plan.prefill) or released, seconds)
                elif not released and self.first_rank and self.sampler.holding:
                    self.sampler.wait_for_masks()  # nothing else to do: not a busy loop
            return StepOutcome.RAN
        except BaseException as e:
            self._fail_all(e)
            raise
        finally:
            self._stepping = None

    def _proposals_within_grammars(self, proposals: dict[int, list[int]]) -> dict[int, list[int]]:
        """``proposals`` (by request id) with a constrained request's cut at the first token its
        grammar does not allow there (:meth:`Sampler.grammar_allows
        <llama.engine.sampler.Sampler.grammar_allows>`): such a proposal could never be accepted,
        and would only take a position of the step.  The first rank's matchers decide; the
        other ranks, which every rank knows are constrained, are told how many are kept, so
        that every rank feeds the same positions."""
        running = self.scheduler.running
        constrained = [i for i in proposals if running[i].constrained]
        if not constrained:
            return proposals
        kept: Optional[list[int]] = None
        if self.first_rank:
            kept = [self.sampler.grammar_allows(running[i], proposals[i]) for i in constrained]
        if self.multi_rank:
            kept = distributed.broadcast_object_from_first_rank(kept)
        out = dict(proposals)
        for i, n in zip(constrained, cast(list[int], kept)):
            if n:
                out[i] = proposals[i][:n]
            else:
                del out[i]
        return out

    def _share(self, decisions: Optional[Decisions]) -> Decisions:
        # Most steps decide nothing: one small broadcast says so; decisions only travel when
        # there are some.
        return distributed.broadcast_object_from_first_rank(decisions if decisions else None) or Decisions()

    def _apply(self, decisions: Decisions) -> None:
        """End the cancelled requests, those past their deadlines and those whose grammar's mask
        is overdue; start the admitted ones, each with its blocks."""
        with self.lock:
            outputs: list[RequestOutput] = []
            unstarted: list[RequestHandle] = []
            expired: list[RequestHandle] = []
            for request in self.scheduler.active():
                if request.id in decisions.cancellations:
                    outputs.append(self.scheduler.finish(request, "cancelled"))
                elif request.id in decisions.expirations:
                    logger.info("request %d is past its deadline (%s s): ended", request.id,
                                request.settings.timeout_s)
                    outputs.append(self.scheduler.finish(request, "timeout"))
                elif request.id in decisions.masks_overdue:
                    outputs.append(self.scheduler.fail(request, self.sampler.too_slow(request)))
            for admission in decisions.admissions:
                handle = self.scheduler.handle_of(admission, self._serving)
                if admission.cancelled:
                    if handle is not None:
                        (expired if admission.expired else unstarted).append(handle)
                    continue
                request = self._start(admission, handle)
                if request.budget == 0 and not request.prompt_logprobs:
                    outputs.append(self.scheduler.finish(request, "length"))
            self.output.end_unstarted(unstarted)
            self.output.end_unstarted(expired, reason="timeout")
            self.output.deliver(outputs)

    def _start(self, admission: Admission, handle: Optional[RequestHandle]) -> RunningRequest:
        budget = min(admission.settings.max_new_tokens, self.max_seq_len - len(admission.prompt))
        grammar = handle.settings.grammar if handle is not None else None  # the first rank's alone
        matcher = (grammar.matcher(self.grammar_end_ids(handle.settings))
                   if grammar is not None and handle is not None else None)  # a grammar is the handle's
        request = RunningRequest(admission, handle, self.tokenizer, budget,
                                 self.sampler.generator_for(admission.settings), matcher)
        self.scheduler.admit(request)
        if handle is not None:
            handle.started()
        self._counters["requests_total"] += 1
        self._counters["prompt_tokens_total"] += len(admission.prompt)
        self._counters["cached_prompt_tokens_total"] += request.reused
        self._counters["prefix_cache_hits_total"] += request.reused > 0
        return request

    def _sample(self, requests: list[RunningRequest], logits: Optional[torch.Tensor], rows: Optional[list[int]] = None,
                proposals: Optional[dict[int, list[int]]] = None,
                summary: Optional[RowSummary] = None) -> Optional[Sampled]:
        """Each request's next token (from row ``rows[i]`` of ``logits``, default row i; a row
        that verifies ``proposals`` (by index) chooses a run of them, from a row per fed
        position) and the log-probabilities asked for (``summary``: the compiled step's, of
        ``logits``)."""
        if not requests:
            return None
        logits = cast(torch.Tensor, logits)  # the model ran for the requests
        rows = list(range(len(requests))) if rows is None else rows
        # the distributions a draft drew sampled requests' proposals from (llama.engine.draft)
        probs = self.speculator.probs if self.speculator is not None and proposals else {}
        proposal_probs = {i: probs[r.id] for i, r in enumerate(requests) if i in (proposals or {}) and r.id in probs}
        tokens, errors, accepted = self.sampler.sample(requests, logits, rows, proposals, proposal_probs, summary)
        sampled = Sampled(requests, tokens, errors, proposals=dict(proposals or {}), accepted=accepted)
        sampled.log_probs = self.output.log_probs(requests, logits, [sampled.run(i) for i in range(len(requests))],
                                                  rows)
        return sampled

    def _sample_released(self, request_ids: list[int]) -> bool:
        """Sample the deferred requests whose masks are ready (:mod:`llama.engine.sampler`) from
        their held logits, before the plan: their tokens are fed this step.  Whether any was."""
        requests, logits = self.sampler.take_held(request_ids, self.scheduler.running)
        sampled = self._sample(requests, logits)
        if sampled is None:
            return False
        with self.lock:
            self.output.deliver(self.scheduler.update_from_sampled(sampled))
        return True

    def _fail_all(self, error: BaseException) -> None:
        """A step failed (a peer died, a collective timed out): every request in flight gets
        the error; the cache's contents are no longer trusted."""
        with self.lock:
            if not isinstance(error, Exception):  # KeyboardInterrupt and the like
                error = RuntimeError(f"generation was interrupted ({type(error).__name__})")
            # In a multi-rank job the ranks may now disagree on what happened: nothing further
            # can be trusted, the requests still waiting included.
            outputs, waiting = self.scheduler.abort_all(error, waiting=self.multi_rank)
            self.kv.forget_all()
            if self.multi_rank:
                self._failed = error
            self.output.deliver(outputs)
            self.output.end_unstarted(waiting, error)
            self.lock.notify_all()


def check_draft_model(draft: Optional[Transformer], model: Transformer) -> None:
    """ValueError unless ``draft`` can propose for ``model`` (the ``"draft"`` method)."""
    if draft is None:
        raise ValueError("speculative method 'draft' needs the draft model: Llama.build loads it from "
                         "draft_ckpt_dir (Engine(..., draft=model) given one)")
    if draft.vocab_size != model.vocab_size:
        raise ValueError(f"the draft model's vocab_size ({draft.vocab_size}) is not the target's ({model.vocab_size}): "
                         "a draft must share the target's vocabulary (its params.json or config.json)")
    if draft.params.max_seq_len < model.params.max_seq_len:
        raise ValueError(f"the draft model was loaded for max_seq_len={draft.params.max_seq_len}, less than the "
                         f"target's {model.params.max_seq_len}: load it with the target's")
    if draft.device != model.device:
        raise ValueError(f"the draft model is on {draft.device}, the target on {model.device}: load them on one device")
