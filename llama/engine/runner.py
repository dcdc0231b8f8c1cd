"""Running a step's plan on the model: its tokens and positions as tensors, one ragged
prefill pass and one decoding pass, and the logits of every request that needs a token
(and the log-probabilities of the prompt tokens a request asked to score).  The runner
reads the requests and their block tables and changes neither: what it returns
(:class:`RunnerOutput`) is recorded by the scheduler's update
(:meth:`~llama.engine.scheduler.Scheduler.update_from_output`).

The decoding pass may be compiled (:meth:`ModelRunner.compile`).  A compiled step sees
few shapes: its rows are rounded up to a power of two (1, 2, 4 ... ``max_batch_size``)
and the cache positions it attends to, the *context*, to a bucket
(:func:`context_buckets`: 256, 512, ... ``max_seq_len``; on the CPU also 64 and 128,
:func:`attended_buckets`), so attention reads about what the live contexts hold, never the
whole cache.  With speculative decoding the passes
that verify proposals (several positions a row) run a compiled step of their own, in every
(rows, positions per row) a step may verify, the context bucketed alike.  Every shape is
compiled (and on a GPU captured as a CUDA graph) when the engine is built
(:meth:`ModelRunner.warm_up`), so that no request waits for a compilation while serving.

On a GPU the step's inputs (token ids, positions, block tables, the rows whose logits are
needed) are written into pinned host buffers and copied without waiting
(:mod:`llama.engine.staging`): the host never waits for the device while it feeds a step,
and the step's one wait is the sampler's read of the chosen tokens.  On the CPU they are
made as plain tensors."""

from __future__ import annotations

import bisect
import logging
import sys
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch

from llama.engine.cpu_threads import ThreadTuner
from llama.engine.image_contexts import ImageContexts
from llama.engine.kv_cache_manager import KVCacheManager
from llama.engine.lora import ServedAdapters
from llama.engine.requests import RunningRequest
from llama.engine.sampling import RowSummary
from llama.engine.scheduler import PrefillChunk, StepPlan
from llama.engine.staging import InputStaging
from llama.images.prompt import MAX_IMAGE_TILES, PromptImage
from llama.model import Transformer
from llama.runtime import distributed
from llama.runtime.finite import NonFiniteError, check_finite_logits
from llama.runtime.progress import Progress

logger = logging.getLogger(__name__)

# (tokens (B, 1), positions (B, 1), kv_len, cache[, block_table (B, W): default rows 0..B-1[, lora_slots (B,):
# each row's LoRA adapter slot, None without adapters]]) -> logits (B, V)
DecodeStep = Callable[..., torch.Tensor]
# (tokens (B, T), positions (B, T), kv_len, cache, block_table (B, W)[, lora_slots (B,)]) -> logits (B, T, V) of every
# position
VerifyStep = Callable[..., torch.Tensor]

# The smallest context a compiled step attends to: below it, attention costs little
# beside the weights, and fewer buckets mean fewer CUDA graphs.
SMALLEST_CONTEXT_BUCKET = 256


def context_buckets(max_seq_len: int) -> list[int]:
    """The context lengths a compiled decoding step attends to: powers of two from
    :data:`SMALLEST_CONTEXT_BUCKET`, then ``max_seq_len`` (all in [1, max_seq_len])."""
    buckets = []
    length = SMALLEST_CONTEXT_BUCKET
    while length < max_seq_len:
        buckets.append(length)
        length *= 2
    return buckets + [max_seq_len]


# On the CPU, contexts shorter than the smallest bucket go in buckets of these lengths: there the
# compiled step's context is a dynamic dimension (one graph serves every length, no CUDA graph
# per shape), and attention over 256 positions costs about twice attention over 64 (one row of
# the 150m shape: 43 against 24 us a layer; eight rows: 231 against 99; bfloat16, 1 thread,
# AMD Zen 4).
CPU_SHORT_CONTEXT_BUCKETS = (64, 128)


def attended_buckets(max_seq_len: int, device: torch.device) -> list[int]:
    """The context lengths a compiled decoding step attends to on ``device``:
    :func:`context_buckets`, and on the CPU :data:`CPU_SHORT_CONTEXT_BUCKETS` below them."""
    buckets = context_buckets(max_seq_len)
    if device.type != "cpu":
        return buckets
    return [length for length in CPU_SHORT_CONTEXT_BUCKETS if length < buckets[0]] + buckets


def row_buckets(max_rows: int) -> list[int]:
    """The row counts a compiled decoding step runs: powers of two, then ``max_rows``."""
    buckets = []
    rows = 1
    while rows < max_rows:
        buckets.append(rows)
        rows *= 2
    return buckets + [max_rows]


# The compiled step's Python wrapper checks, at every call, the sizes, strides and alignment
# of what each kernel it does not generate returns (ours, a view of the rotations): about 120
# checks of 0.2-0.6 us each a 150m step.  They check torch's own bookkeeping against the
# operators' shape functions, which tests/test_compiled.py compares with the eager step.
CPU_WRAPPER_CHECKS_OFF: dict[str, Union[str, int, bool, Callable[..., Any]]] = {
    "size_asserts": False, "alignment_asserts": False}


def cpu_compile_options() -> Optional[dict[str, Union[str, int, bool, Callable[..., Any]]]]:
    """Inductor's options for a CPU step: the vector width (``cpp.simdlen``, in bits) of the
    instructions it generates C++ for in this process, set to what it would pick by itself
    (torch's ``ATEN_CPU_CAPABILITY`` where set, else the widest this CPU runs), and
    :data:`CPU_WRAPPER_CHECKS_OFF`.

    The width is said explicitly so that it is part of the compiled-graph cache's key: left unset, the key
    (torch 2.13) holds neither the width nor ``ATEN_CPU_CAPABILITY``, and a graph compiled for
    AVX2 is found again by an AVX-512 process (or one compiled for AVX-512 by an AVX2 one, or on
    another CPU sharing the cache folder).  Its C++ then runs with the other width's vectors:
    NaN logits, or a corrupted heap and an abort (seen on AMD Zen 4, BENCHMARKS.md "Compiled
    steps").  None where Inductor's choice cannot be read (its module moved): its default."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:
        return None
    try:
        width = pick_vec_isa().bit_width()
    except (AttributeError, RuntimeError, OSError) as error:  # no C++ compiler: nothing is generated anyway
        logger.debug("Inductor's CPU vector width unread (%s): its default", error)
        return None
    return {"cpp.simdlen": width, **CPU_WRAPPER_CHECKS_OFF}


def keep_guard_unless_on_model(entries: Sequence[Any]) -> list[bool]:
    """Which of Dynamo's guards a compiled step checks at every call (``guard_filter_fn``): all
    but those on the model's own modules (the step's ``model``: their attributes, hooks and
    tensors), about a thousand on a small model, which took 0.3-0.4 ms of a 150m step of
    4-6 ms on the CPU (BENCHMARKS.md).  The model is fixed once built (adapters are written into
    its LoRA buffers in place, llama.layers.lora), so they could only ever pass; the guards on
    the step's inputs stay, the KV caches' tensors among them, and the global state (grad
    mode, the thread count).  A module swapped into a model after its compiled step was made
    is not seen by that step."""
    return [not (entry.name.startswith("model.") and entry.orig_guard.source.is_unspecialized_nn_module())
            for entry in entries]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``value``."""
    return next(b for b in buckets if b >= value)


# Seconds a shape of the decoding step took to compile at a first start (Inductor's disk
# cache empty), measured (BENCHMARKS.md): on a quiet AMD Zen 4 CPU, the demo model in
# bfloat16 (3 shapes, 37.9 s with a 32-token reply); on an H100, a 4-layer model of the 8B's
# widths (30 shapes, 83.5 s).  Larger models and busy machines take longer: the demo's 3 shapes
# took 271 s on 2 CPU cores shared with a dozen busy processes (2026-11-27).
FIRST_COMPILE_S_PER_SHAPE = {"cpu": 12.0, "cuda": 3.0}
# What the verification step (speculative decoding) adds to a first start, as a share of the
# decoding step's own warm-up.  On the CPU its two graphs (one row, several rows) serve all its
# shapes, each further shape costing one run, so it costs about what the decoding step's two
# graphs cost.  Measured in bfloat16 (4 rows, max_seq_len 1024, 1 thread; 9 decoding shapes,
# 11 x 3 verification shapes; 2 CPU cores shared with other work, 2026-11-28): the demo model
# warmed up in 354.1 s against 201.5 s without speculation, the 150m shape in 185.2 s (about
# 98 s of it the verification's) against 133.7 s.  On a GPU each shape is a CUDA graph of its
# own (not measured yet: FIRST_COMPILE_S_PER_SHAPE each).
VERIFY_COMPILE_SHARE = {"cpu": 1.0}


def compile_announcement(device: torch.device, shapes: int, verified: int = 0) -> str:
    """The line that opens a compilation: what it is, what a first start costs, how to skip it.
    ``verified``: shapes of the verification step (speculative decoding) among ``shapes``."""
    per_shape = FIRST_COMPILE_S_PER_SHAPE.get(device.type)
    what = f"{shapes} shape(s)" if not verified else \
        f"{shapes - verified} shape(s), and its verification of proposals for {verified},"
    share = VERIFY_COMPILE_SHARE.get(device.type)
    seconds = per_shape and (per_shape * (shapes - verified) * (1 + share) if verified and share is not None
                             else per_shape * shapes)
    expected = f": about {seconds:.0f} s at a first start on a quiet machine (several times that on a " \
        "busy one; less once Inductor's disk cache holds it)" if seconds else ""
    return f"compiling the decoding step for {what} before the first request{expected}; " \
        "compile=False or --no-compile skips it"


def _compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process so far (0 before anything imported
    ``torch._dynamo``: reading its counters would import it, 1-3 s, in processes that never compile)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@dataclass
class RunnerOutput:
    """What a step's forward passes give: the requests that need a token now, in the order
    of the rows of ``logits`` (R, V) float32 (prompts completed first, then decoding rows);
    the log-probabilities of the prompt tokens scored this step, by request id, as (the
    first one's position, the values); the errors of requests whose prompt scoring failed,
    by request id (their chunk's tokens do not count as fed).  Every other token of the plan
    was fed."""

    requests: list[RunningRequest] = field(default_factory=list)
    logits: Optional[torch.Tensor] = None
    prompt_logprobs: dict[int, tuple[int, list[float]]] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    # By index into ``requests``: the proposals fed after a decoding row's pending token
    # (llama.engine.speculative).  Such a row has 1 + len(proposals) rows of logits, one per
    # fed position in order; ``rows[i]`` is the first row of request i's.
    proposals: dict[int, list[int]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    # Of ``logits``, computed with them by a compiled decoding step on the CPU (None otherwise)
    summary: Optional[RowSummary] = None


class ModelRunner:
    """Feeds the model a plan's tokens, each request's through its block table.  Decoding
    rows are the decoding requests, oldest first; a compiled step's extra rows are padding
    tokens at the scratch position, in the scratch block.

    ``prefill_chunk`` (the scheduler's: most prompt tokens a step feeds) sizes the pinned
    buffers of prefill inputs on a GPU; a step that needs more grows them.  ``verify_shapes``:
    the (rows, positions per row) of the steps that verify proposals
    (:meth:`~llama.engine.speculative.SpeculativeConfig.verified_shapes`), which
    :meth:`compile` compiles a verification step for."""

    def __init__(self, model: Transformer, kv: KVCacheManager, max_batch_size: int, *,
                 prefill_chunk: int = 512, verify_shapes: Sequence[tuple[int, int]] = (),
                 image_contexts: Optional[ImageContexts] = None, n_decodable: Optional[int] = None) -> None:
        self.model = model
        # ids from this one up are never sampled (the sampler's): the compiled CPU step's greedy
        # tokens are chosen below it (RowSummary)
        self.n_decodable = model.vocab_size if n_decodable is None else n_decodable
        self.kv = kv
        self.device = model.device
        self.max_seq_len = model.params.max_seq_len
        self.scratch = self.max_seq_len  # the KV cache's scratch position: padding goes there
        self.decode_step: DecodeStep = model.decode_logits
        # The RowSummary of the logits the last compiled CPU decoding step gave (None: not computed)
        self.step_summary: Optional[RowSummary] = None
        self.fixed_shape = False  # run decoding steps in few shapes (compiled steps)
        self.row_buckets = row_buckets(max_batch_size)
        self.context_buckets = context_buckets(self.max_seq_len)  # a compilation each (CUDA graphs)
        self.attended_buckets = attended_buckets(self.max_seq_len, self.device)  # what steps attend to
        self.warmed_up = False  # every shape of the compiled step has been compiled
        # The compiled verification step (None: steps with proposals run eagerly) and the
        # (rows, positions per row) it runs once compiled; other shapes are verified eagerly.
        self.verify_step: Optional[VerifyStep] = None
        self.verify_shapes = frozenset(verify_shapes)
        # Chooses the CPU threads of eager steps by timing them (llama.engine.cpu_threads); None:
        # the count stays as the process set it.
        self.threads: Optional[ThreadTuner] = None
        # The CPU threads torch had when the compiled step was compiled (None: not compiled yet).
        # torch.compile's guards check the process's thread count, so a count changed between
        # steps (another engine's tuner, the user's torch.set_num_threads) would compile every
        # shape again while serving: compiled steps set this count back first.
        self.compiled_threads: Optional[int] = None
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        # Where step inputs are staged on their way to the device (None: made as plain tensors)
        self.staging: Optional[InputStaging] = None
        self.use_staging(InputStaging.for_device(self.device))
        # The vision features of the images of requests being prefilled, by request id: one
        # (n_tiles * patches_per_tile, dim) tensor per image, computed once per request when a
        # chunk first reaches an image's patches and dropped once its prefill is past them (or
        # it holds no blocks: ended, or preempted, when its resumed prefill computes them again).
        self.image_features: dict[int, list[torch.Tensor]] = {}
        # A Llama 3.2 Vision model's requests' image contexts (cross-attention K/V), held for each
        # request's life and let go by the scheduler (llama.engine.image_contexts)
        self.image_contexts = ImageContexts() if image_contexts is None else image_contexts
        self.cross_attending = len(getattr(model, "cross_attention_layers", ())) > 0
        self._eager_images_logged = False  # the compiled step's fallback for rows with images was logged
        # The LoRA adapters the model serves unmerged (llama.engine.lora): every step then gives each
        # row's adapter slot (0: none) as a step input, ``lora_slots`` (B,); None: no adapters.
        self.lora: Optional[ServedAdapters] = None

    def use_staging(self, staging: Optional[InputStaging]) -> None:
        """Stage step inputs through ``staging``'s buffers (None: plain tensors, ``.to(device)``),
        reserving what a step of ``max_batch_size`` rows and ``prefill_chunk`` prompt tokens
        needs, so that steps allocate none."""
        self.staging = staging
        if staging is None:
            return
        rows, width = self.max_batch_size, self.kv.table_width
        staging.reserve("decode", rows * (3 + width))  # tokens, positions (rows, 1); tables (rows, width); LoRA slots
        # tokens and positions of prompts of prefill_chunk tokens in all (ragged rows are padded
        # to the longest: more grows the buffers), their tables, the rows and columns of logits
        staging.reserve("prefill", 2 * self.prefill_chunk + rows * (width + 3))  # ... and the rows' LoRA slots

    # -- the decoding step, eager or compiled -----------------------------------------------

    @property
    def compiled(self) -> bool:
        """Whether decoding steps run compiled (False again after a failed compilation)."""
        return self.fixed_shape

    def compile(self) -> None:
        """Decode through ``torch.compile`` (CUDA graphs on a GPU).  Rows and context are
        dynamic dimensions of the compiled graph, so one compilation serves every bucket
        (on a GPU, each bucket is captured as its own CUDA graph).

        The steps that verify proposals, in :attr:`verify_shapes` (rows, positions per row),
        then run a compiled step of their own, giving the logits of every fed position: rows and
        positions per row exact (a verifying pass feeds few positions, and padding rows would
        add to them), context in buckets.  Its rows, positions per row and context are dynamic
        dimensions too: on the CPU two graphs (one row, several rows) serve every shape; on a
        GPU each shape is captured as its own CUDA graph at the warm-up."""
        # The rotations' buffer is complex: its view as real numbers (apply_rotary_emb) is left
        # to an eager call inside the compiled graph, for which Inductor warns once per graph;
        # the step is still one graph, and the rotation itself is fused.
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        model, n_decodable = self.model, self.n_decodable

        def decode_over(tokens: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                        cache: torch.nn.ModuleList, block_table: Optional[torch.Tensor],
                        lora_slots: Optional[torch.Tensor]) -> torch.Tensor:
            # the context's length is a tensor's size, so that it can be a dynamic dimension
            return model.decode_logits(tokens, positions, context.shape[0], cache, block_table, lora_slots)

        def decode_and_summarise(tokens: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                                 cache: torch.nn.ModuleList, block_table: Optional[torch.Tensor],
                                 lora_slots: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
            # model.decode_logits itself, not decode_over: keep_guard_unless_on_model knows the
            # model's guards by their source, this closure's ``model`` (through decode_over's they
            # would be named after decode_over, and all be kept: ~1000 guards checked every step)
            logits = model.decode_logits(tokens, positions, context.shape[0], cache, block_table, lora_slots)
            return logits, logits[:, :n_decodable].argmax(-1), logits.sum(-1)

        if self.device.type == "cpu":  # (on a GPU the step is as it was: unmeasured there)
            self.use_compiled_step(self._summarising(self._compiled(decode_and_summarise, dynamic_positions=False)))
        else:
            self.use_compiled_step(self._compiled(decode_over, dynamic_positions=False))
        if self.verify_shapes:
            def verify_over(tokens: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                            cache: torch.nn.ModuleList, block_table: Optional[torch.Tensor],
                            lora_slots: Optional[torch.Tensor]) -> torch.Tensor:
                # the logits of every fed position (B, T, V): the runner picks the rows' own
                return model.logits(model.hidden_states(tokens, positions, context.shape[0], cache,
                                                        block_table=block_table, lora_slots=lora_slots))

            self.use_compiled_verification(self._compiled(verify_over, dynamic_positions=True))

    def _compiled(self, over: Callable[..., Any], dynamic_positions: bool) -> Callable[..., Any]:
        """``over(tokens, positions, context, cache, block_table, lora_slots)`` through ``torch.compile``,
        called as a :data:`DecodeStep` (``kv_len`` an int): rows (and with
        ``dynamic_positions``, positions per row) and context dynamic dimensions."""
        on_cuda = self.device.type == "cuda"
        # A code object of this runner's own: torch.compile keeps compiled graphs per code
        # object, and another model's (another Llama in this process) would share this one's
        # recompile limit (8 graphs) and be tried before it at every step.
        over = types.FunctionType(over.__code__.replace(), over.__globals__, over.__name__,
                                  over.__defaults__, over.__closure__)
        # On a GPU: CUDA graphs (what mode="reduce-overhead" sets), and coordinate-descent
        # tuning, under which Inductor writes one-row products of bfloat16 weights as a
        # multiply-and-sum kernel it tunes (gpt-fast's setting).  int8 products of decoding steps
        # and batches (KernelPolicy.int8_direct_up_to_rows) are opaque calls to
        # llama::int8_weight_mm (llama.layers.triton_int8), which it leaves alone.
        options: dict[str, Union[str, int, bool, Callable[..., Any]]] = (
            {"triton.cudagraphs": True, "coordinate_descent_tuning": True} if on_cuda
            else cpu_compile_options() or CPU_WRAPPER_CHECKS_OFF)
        compiled = torch.compile(over, options={**options, "guard_filter_fn": keep_guard_unless_on_model})
        context_ids = torch.empty(self.max_seq_len, 0, device=self.device)  # holds no data, only its length

        def step(tokens: torch.Tensor, positions: torch.Tensor, kv_len: int,
                 cache: torch.nn.ModuleList, block_table: Optional[torch.Tensor] = None,
                 lora_slots: Optional[torch.Tensor] = None) -> Any:
            context = context_ids[:kv_len]
            # the rows' LoRA slots are values, not shapes: a new mix of adapters reuses the graph
            for tensor in (tokens, positions, context, block_table, lora_slots):
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
            if dynamic_positions:
                torch._dynamo.maybe_mark_dynamic(tokens, 1)
                torch._dynamo.maybe_mark_dynamic(positions, 1)
            return compiled(tokens, positions, context, cache, block_table, lora_slots)

        return step

    def _summarising(self, compiled: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> DecodeStep:
        """A :data:`DecodeStep` of ``compiled``, which gives (logits, greedy, totals): the logits,
        the rest kept as :attr:`step_summary` until the next step."""

        def step(*args: Any) -> torch.Tensor:
            logits, greedy, totals = compiled(*args)
            self.step_summary = RowSummary(greedy, totals)
            return logits

        return step

    def use_compiled_step(self, compiled: DecodeStep) -> None:
        """Decode through ``compiled``, falling back to eager (with a warning) if compiling
        fails: a slower run beats a crash."""

        def step(tokens, positions, kv_len, cache, block_table=None, lora_slots=None):
            try:
                return compiled(tokens, positions, kv_len, cache, block_table, lora_slots)
            except torch._dynamo.exc.TorchDynamoException as e:
                logger.warning("compiling the decoding step failed, continuing without it: %s", str(e).splitlines()[0])
                self.decode_step, self.fixed_shape = self.model.decode_logits, False
                return self.model.decode_logits(tokens, positions, kv_len, cache, block_table, lora_slots)

        self.decode_step, self.fixed_shape = step, True
        self.warmed_up = False

    def use_compiled_verification(self, compiled: VerifyStep) -> None:
        """Verify proposals in steps of :attr:`verify_shapes` through ``compiled``, falling
        back to eager verification (with a warning) if compiling fails."""

        def step(tokens, positions, kv_len, cache, block_table, lora_slots=None):
            try:
                return compiled(tokens, positions, kv_len, cache, block_table, lora_slots)
            except torch._dynamo.exc.TorchDynamoException as e:
                logger.warning("compiling the verification step failed, continuing without it: %s",
                               str(e).splitlines()[0])
                self.verify_step = None
                return self.model.logits(self.model.hidden_states(tokens, positions, kv_len, cache,
                                                                  block_table=block_table, lora_slots=lora_slots))

        self.verify_step = step
        self.warmed_up = False

    def warm_up(self) -> None:
        """Run the compiled step once in every shape the engine can ask for (rows x context
        buckets, and the verification step's rows x positions per row x context buckets;
        three times each on a GPU, where CUDA graphs are captured on a later call), on
        padding tokens at the scratch position, so that compiling happens now rather than
        while serving.  The collectives of these steps may wait up to LLAMA_COMPILE_TIMEOUT_S
        for ranks that compile more slowly."""
        if not self.fixed_shape:
            return
        start, graphs = time.perf_counter(), _compiled_graphs()
        self.compiled_threads = torch.get_num_threads()
        calls = 3 if self.device.type == "cuda" else 1
        shapes = [(rows, 1, context) for rows in self.row_buckets for context in self.attended_buckets]
        verified = [(rows, width, context) for rows, width in sorted(self.verify_shapes)
                    for context in self.attended_buckets] if self.verify_step is not None else []
        shapes += verified
        # The CPU's short contexts run on the graphs of the others (a dynamic context): not compilations
        compiled = [shape for shape in shapes if shape[2] in self.context_buckets]
        n_verified = sum(1 for shape in verified if shape[2] in self.context_buckets)
        with Progress("compiling the decoding step", len(shapes), unit="shapes", logger=logger,
                      announce=compile_announcement(self.device, len(compiled), n_verified)) as progress, \
                distributed.compile_timeout_for_collectives(), torch.inference_mode():
            for rows, width, context in shapes:
                tokens = torch.zeros((rows, width), dtype=torch.long, device=self.device)
                positions = torch.full((rows, width), self.scratch, dtype=torch.long, device=self.device)
                table = self.kv.block_table([None] * rows, self.device)
                lora = self._lora_slots([None] * rows)
                for _ in range(calls):
                    if width == 1:
                        self.decode_step(tokens, positions, context, self.kv.cache, table, lora)
                        if not self.fixed_shape:  # compiling failed: eager from now on
                            return
                    elif self.verify_step is not None:
                        self.verify_step(tokens, positions, context, self.kv.cache, table, lora)
                progress.advance(detail=f"{rows} row(s) x {context} positions done" if width == 1
                                 else f"{rows} row(s) of {width} x {context} positions done")
        self.warmed_up = True
        logger.info("compiled the decoding step (%d graph(s)) for %s rows and contexts of %s positions%s in %.1f s",
                    _compiled_graphs() - graphs, "/".join(map(str, self.row_buckets)),
                    "/".join(map(str, self.attended_buckets)),
                    f", and its verification of proposals for {len(self.verify_shapes)} shapes of rows x positions"
                    if verified and self.verify_step is not None else "", time.perf_counter() - start)

    # -- one step ---------------------------------------------------------------------------

    def _lora_slot_list(self, rows: Sequence[Optional[RunningRequest]]) -> list[int]:
        lora = cast(ServedAdapters, self.lora)
        return [0 if request is None else lora.slot_of(request.settings.lora) for request in rows]

    def _lora_slots(self, rows: Sequence[Optional[RunningRequest]]) -> Optional[torch.Tensor]:
        """Each row's LoRA adapter slot (len(rows),) int64 on the device (padding rows and requests
        without an adapter: 0, the base); None where the model serves no adapters."""
        if self.lora is None:
            return None
        return torch.tensor(self._lora_slot_list(rows), dtype=torch.long).to(self.device)

    def run(self, plan: StepPlan) -> RunnerOutput:
        """The plan's prefill pass, then its decoding pass; the logits of the requests that
        need a token (prefilled ones first; every fed position of a row that verifies
        proposals).  Changes no request."""
        out = RunnerOutput()
        tuner = None if self.fixed_shape else self.threads
        if self.fixed_shape:
            self._keep_compiled_threads()
        if tuner is not None:
            # a step that prefills or verifies is not a plain decoding step: never timed
            tuner.before_step(0 if plan.prefill or plan.proposals else len(plan.decode))
            start = time.perf_counter()
        prefilled, prefilled_logits = self._prefill(plan.prefill, out) if plan.prefill else ([], None)
        decoded: list[RunningRequest]
        decoded_logits: Optional[torch.Tensor]
        if not plan.decode:
            decoded, decoded_logits = [], None
        elif plan.proposals:
            decoded, decoded_logits = self._verify(plan.decode, plan.proposals)
        else:
            decoded, decoded_logits = self._decode(plan.decode)
        if tuner is not None:
            tuner.after_step(time.perf_counter() - start)
        out.requests = prefilled + decoded
        out.proposals = {len(prefilled) + k: plan.proposals[r.id] for k, r in enumerate(decoded)
                         if r.id in plan.proposals}
        out.rows = first_rows(len(out.requests), out.proposals)
        parts = [logits for logits in (prefilled_logits, decoded_logits) if logits is not None]
        if parts:
            # (R, V) float32; one part alone is used as it is (a batch of 8 saves copying 4 MB a step)
            out.logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        if decoded_logits is not None and not prefilled and not plan.proposals:
            out.summary = self.step_summary  # of the decoding rows' logits: all of them
        return out

    def _keep_compiled_threads(self) -> None:
        """Set torch's CPU threads back to the count the compiled step was compiled with (the
        first compiled step's count where nothing was warmed up), so that its guards hold."""
        threads = torch.get_num_threads()
        if self.compiled_threads is None:
            self.compiled_threads = threads
        elif threads != self.compiled_threads:
            logger.debug("setting torch's CPU threads back from %d to the compiled step's %d",
                         threads, self.compiled_threads)
            torch.set_num_threads(self.compiled_threads)

    def _prefill(self, chunks: list[PrefillChunk], out: RunnerOutput) -> tuple[list[RunningRequest],
                                                                                Optional[torch.Tensor]]:
        """Feed the prompt chunks in one ragged forward pass, scoring the prompt tokens of the
        requests that asked (into ``out``).  Returns the requests whose chunk samples
        (:attr:`PrefillChunk.samples`) and their logits (R, V), made in one product: the
        output matrix is read once, not once per request."""
        width = max(c.end - c.start for c in chunks)
        from_start = all(c.start == 0 for c in chunks)
        kv_len = width if from_start else max(c.end for c in chunks)
        # The rows (and their last token's columns) whose logits give a token, unless scoring
        # their prompt fails
        expected_rows = [i for i, c in enumerate(chunks) if c.samples]
        expected_columns = [chunks[i].end - chunks[i].start - 1 for i in expected_rows]
        if self.staging is None:
            tokens = torch.zeros((len(chunks), width), dtype=torch.long)
            positions = torch.full((len(chunks), width), self.scratch, dtype=torch.long)
            for i, c in enumerate(chunks):
                tokens[i, : c.end - c.start] = torch.tensor(c.request.context()[c.start : c.end])
                positions[i, : c.end - c.start] = torch.arange(c.start, c.end)
            if from_start:
                # A new context on every row: plain causal attention over the fed tokens (padding
                # after a short prompt writes later slots of the row's own last block, overwritten
                # before use, or, past its blocks, the scratch block).
                positions = torch.arange(width).expand(len(chunks), width)
            tokens, positions = tokens.to(self.device), positions.to(self.device)
            table = self.kv.block_table([c.request for c in chunks], self.device)
            lora = self._lora_slots([c.request for c in chunks])
            staged_rows = None
        else:
            tokens, positions, table, *staged_rows = self._staged_prefill_inputs(
                chunks, width, from_start, expected_rows, expected_columns)
            lora = staged_rows.pop() if self.lora is not None else None
        features = feature_positions = cross = None
        if self.cross_attending:
            cross = self.image_contexts.cross_attention(self.model, [c.request for c in chunks], positions)
        else:
            features, feature_positions = self._image_inputs(chunks, width)
        hidden = self.model.hidden_states(tokens, positions, kv_len, self.kv.cache, from_start=from_start,
                                          block_table=table, image_features=features,
                                          image_positions=feature_positions, cross_attention=cross,
                                          lora_slots=lora)
        requests, rows, columns = [], [], []
        for i, c in enumerate(chunks):
            request = c.request
            if request.prompt_logprobs is not None and c.start < len(request.prompt):
                try:
                    out.prompt_logprobs[request.id] = self._score_prompt(
                        request, hidden[i, : c.end - c.start], c.start, min(c.end, len(request.prompt)))
                except NonFiniteError as e:  # every rank scores the same logits: all fail it here
                    out.errors[request.id] = e
                    continue
            if c.samples:
                requests.append(request)
                rows.append(i)
                columns.append(c.end - c.start - 1)  # its last token's
        if not requests:
            return [], None
        if staged_rows is not None and rows == expected_rows:
            index = staged_rows
        else:  # unstaged, or a prompt's scoring failed (which read the device already)
            index = [torch.tensor(rows, device=hidden.device), torch.tensor(columns, device=hidden.device)]
        last = hidden[index[0], index[1]]
        return requests, self.model.logits(last)  # (R, V)

    def _image_inputs(self, chunks: list[PrefillChunk],
                      width: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The vision features of the image patches the chunks feed (K, dim), in row-major
        order, and where they go (len(chunks), width) bool; (None, None) where they feed none.
        The features of the requests whose images are reached now and not yet encoded are
        computed here, in ``encode_images`` calls of at most one largest image's tiles (what the
        memory check counts, :data:`~llama.images.prompt.MAX_IMAGE_TILES`); a chunk that cuts an
        image's patches takes those in its range, the next chunk the rest."""
        if self.image_features:  # forget those of requests that hold no blocks now
            for request_id in [i for i in self.image_features if not self.kv.held(i)]:
                del self.image_features[request_id]
        if not any(c.request.images for c in chunks):
            return None, None
        spans = []  # (chunk row, image, its features' index, first and last patch index fed)
        encode: list[RunningRequest] = []
        for i, c in enumerate(chunks):
            for k, image in enumerate(c.request.images):
                lo = bisect.bisect_left(image.patch_positions, c.start)
                hi = bisect.bisect_left(image.patch_positions, c.end)
                if lo < hi:
                    spans.append((i, image, k, lo, hi))
                    if c.request.id not in self.image_features and c.request not in encode:
                        encode.append(c.request)
        if not spans:
            return None, None
        if encode:
            images = [image for request in encode for image in request.images]
            encoded = torch.cat([self.model.encode_images(torch.cat([image.pixel_values for image in group]).to(
                self.device)) for group in _tile_groups(images)])  # (tiles, patches_per_tile, dim)
            per_image = iter(torch.split(encoded, [image.n_tiles for image in images]))
            for request in encode:
                self.image_features[request.id] = [next(per_image).flatten(0, 1) for _ in request.images]
        mask = torch.zeros((len(chunks), width), dtype=torch.bool)
        parts = []
        for i, image, k, lo, hi in spans:
            c = chunks[i]
            mask[i, torch.tensor(image.patch_positions[lo:hi]) - c.start] = True
            parts.append(self.image_features[c.request.id][k][lo:hi])
        for c in chunks:  # its prefill is past its images: their features are not needed again
            if c.request.images and c.end >= c.request.images[-1].patch_positions[-1] + 1:
                self.image_features.pop(c.request.id, None)
        return torch.cat(parts), mask.to(self.device)

    def _staged_prefill_inputs(self, chunks: list[PrefillChunk], width: int, from_start: bool, rows: list[int],
                               columns: list[int]) -> list[torch.Tensor]:
        """On the device, through the pinned buffers: tokens and positions (len(chunks), width)
        (padding: token 0 at the scratch position), block tables (len(chunks), table_width),
        then ``rows`` and ``columns`` (k,), and with LoRA adapters the rows' slots (len(chunks),):
        the prefill's tensors, as the plain path makes them."""
        n = len(chunks)
        shapes = [(n, width), (n, width), (n, self.kv.table_width), (len(rows),), (len(rows),)]
        staged = cast(InputStaging, self.staging).take("prefill", shapes + ([(n,)] if self.lora is not None else []))
        tokens, positions, table, row_index, column_index, *lora = staged.arrays
        tokens.fill(0)
        for i, c in enumerate(chunks):
            tokens[i, : c.end - c.start] = c.request.context()[c.start : c.end]
        if from_start:
            positions[:] = range(width)  # every row 0..width-1: see the plain path
        else:
            positions.fill(self.scratch)
            for i, c in enumerate(chunks):
                positions[i, : c.end - c.start] = range(c.start, c.end)
        self.kv.write_block_table([c.request for c in chunks], table)
        row_index[:], column_index[:] = rows, columns
        if lora:
            lora[0][:] = self._lora_slot_list([c.request for c in chunks])
        return staged.to_device()

    def _score_prompt(self, request: RunningRequest, hidden: torch.Tensor, start: int, end: int,
                      chunk: int = 256) -> tuple[int, list[float]]:
        """Log-probability of prompt tokens start+1..end (within the prompt) given those
        before, as (start + 1, the values); logits are made ``chunk`` positions at a time to
        bound memory."""
        last = min(end, len(request.prompt) - 1)  # position whose successor is the last prompt token scored
        values: list[float] = []
        for a in range(start, last, chunk):
            b = min(a + chunk, last)
            logits = self.model.logits(hidden[a - start : b - start])
            check_finite_logits(logits, f"scoring prompt tokens {a + 1}..{b} of request {request.id}")
            log_probs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(request.prompt[a + 1 : b + 1], device=log_probs.device)
            values += log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
        return start + 1, values

    def _decode(self, feeding: list[RunningRequest]) -> tuple[list[RunningRequest], torch.Tensor]:
        """Feed every request's last sampled token, one per row.  Returns the requests and
        their logits (n, V), row for row (a view of the step's, without its padding rows); the
        compiled CPU step's summary of them in :attr:`step_summary` (None otherwise)."""
        self.step_summary = None
        n = len(feeding)
        kv_len = 1 + max(request.n_fed for request in feeding)
        if self.fixed_shape:  # few distinct shapes for a compiled step
            n, kv_len = bucket(n, self.row_buckets), bucket(kv_len, self.attended_buckets)
        rows = feeding + [None] * (n - len(feeding))
        if self.staging is None:
            # Each made at once from a list: writing rows into a tensor one element at a time cost
            # 0.05 ms more a step (each write a torch operation).  A decoding request has its next token.
            padding = n - len(feeding)
            tokens = torch.tensor([cast(int, request.pending) for request in feeding] + [0] * padding)
            positions = torch.tensor([request.n_fed for request in feeding] + [self.scratch] * padding)
            tokens, positions = tokens.view(n, 1).to(self.device), positions.view(n, 1).to(self.device)
            table = self.kv.block_table(rows, self.device)
            lora = self._lora_slots(rows)
        else:
            shapes = [(n, 1), (n, 1), (n, self.kv.table_width)] + ([(n,)] if self.lora is not None else [])
            staged = self.staging.take("decode", shapes)
            token_array, position_array, table_array, *lora_array = staged.arrays
            token_array[:, 0] = [request.pending for request in feeding] + [0] * (n - len(feeding))
            position_array[:, 0] = [request.n_fed for request in feeding] + [self.scratch] * (n - len(feeding))
            self.kv.write_block_table(rows, table_array)
            if self.lora is not None:
                lora_array[0][:] = self._lora_slot_list(rows)
            tokens, positions, table, *staged_lora = staged.to_device()
            lora = staged_lora[0] if staged_lora else None
        cross = self.image_contexts.cross_attention(self.model, rows, positions) if self.cross_attending else None
        if cross is not None:
            # Rows with images: their cross-attention K/V are the requests' own, which the compiled
            # step does not take yet; the step runs eagerly (its shapes bucketed all the same).
            if self.fixed_shape and not self._eager_images_logged:
                logger.info("decoding steps with rows that hold images run eagerly: the compiled decoding "
                            "step takes no image cross-attention yet")
                self._eager_images_logged = True
            hidden = self.model.hidden_states(tokens, positions, kv_len, self.kv.cache, block_table=table,
                                              cross_attention=cross, lora_slots=lora)
            logits = self.model.logits(hidden[:, -1])
            return feeding, (logits if len(feeding) == logits.shape[0] else logits[: len(feeding)])
        graphs = _compiled_graphs()
        logits = self.decode_step(tokens, positions, kv_len, self.kv.cache, table, lora)  # (n, V)
        if self.step_summary is not None:
            self.step_summary = self.step_summary.first(len(feeding))
        if self.warmed_up and _compiled_graphs() > graphs:
            logger.warning("the decoding step was compiled again while serving (%d rows, context %d): a shape "
                           "the warm-up missed", n, kv_len)
        return feeding, (logits if len(feeding) == logits.shape[0] else logits[: len(feeding)])

    def _verify(self, feeding: list[RunningRequest],
                proposals: dict[int, list[int]]) -> tuple[list[RunningRequest], torch.Tensor]:
        """Feed every request's pending token and, on the rows that propose, the proposed tokens
        after it (``proposals``, by request id) at the positions that follow, in one forward
        pass (a ragged one, as a later prompt chunk's: shorter rows padded at the scratch
        position).  Returns the requests and the logits of every fed position (sum of 1 +
        proposals, V), row after row, each row's positions in order.  Compiled where decoding
        is and the pass's rows and positions per row are among the compiled verification's
        shapes (:meth:`compile`; the context then in a bucket), else eager."""
        fed = [[cast(int, request.pending)] + proposals.get(request.id, []) for request in feeding]
        width = max(len(row) for row in fed)
        tokens = torch.zeros((len(feeding), width), dtype=torch.long)
        positions = torch.full((len(feeding), width), self.scratch, dtype=torch.long)
        for row, (request, row_tokens) in enumerate(zip(feeding, fed)):
            tokens[row, : len(row_tokens)] = torch.tensor(row_tokens)
            positions[row, : len(row_tokens)] = torch.arange(request.n_fed, request.n_fed + len(row_tokens))
        kv_len = max(request.n_fed + len(row_tokens) for request, row_tokens in zip(feeding, fed))
        table = self.kv.block_table(feeding, self.device)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        index_rows = torch.tensor([row for row, row_tokens in enumerate(fed) for _ in row_tokens], device=self.device)
        index_columns = torch.tensor([column for row_tokens in fed for column in range(len(row_tokens))],
                                     device=self.device)
        cross = self.image_contexts.cross_attention(self.model, feeding, positions) if self.cross_attending else None
        lora = self._lora_slots(feeding)
        if self.verify_step is not None and (len(feeding), width) in self.verify_shapes and cross is None:
            kv_len = bucket(kv_len, self.attended_buckets)
            graphs = _compiled_graphs()
            logits = self.verify_step(tokens, positions, kv_len, self.kv.cache, table, lora)  # (rows, width, V)
            if self.warmed_up and _compiled_graphs() > graphs:
                logger.warning("the verification step was compiled again while serving (%d rows of %d positions, "
                               "context %d): a shape the warm-up missed", len(feeding), width, kv_len)
            return feeding, logits[index_rows, index_columns]
        hidden = self.model.hidden_states(tokens, positions, kv_len, self.kv.cache, block_table=table,
                                          cross_attention=cross, lora_slots=lora)  # (rows, width, dim)
        return feeding, self.model.logits(hidden[index_rows, index_columns])


def _tile_groups(images: Sequence[PromptImage], max_tiles: int = MAX_IMAGE_TILES) -> list[list[PromptImage]]:
    """``images`` in order, in groups of at most ``max_tiles`` tiles (an image of more tiles
    alone): each group is one ``encode_images`` call, whose activations the memory check
    counts for ``max_tiles`` tiles."""
    groups: list[list[PromptImage]] = []
    tiles = 0
    for image in images:
        if not groups or tiles + image.n_tiles > max_tiles:
            groups.append([])
            tiles = 0
        groups[-1].append(image)
        tiles += image.n_tiles
    return groups


def first_rows(n_requests: int, proposals: dict[int, list[int]]) -> list[int]:
    """The row of logits where each of ``n_requests`` requests' rows begin: one row each, and
    one more per proposal (``proposals``, by request index)."""
    rows, row = [], 0
    for i in range(n_requests):
        rows.append(row)
        row += 1 + len(proposals.get(i, ()))
    return rows

