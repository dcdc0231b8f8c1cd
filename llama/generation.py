"""The public, Meta-shaped API: ``Llama.build`` and the completion calls.

Every call is a client of one :class:`~llama.engine.Engine` (continuous batching over
a paged KV cache): a batch call submits one request per prompt and waits for them,
a stream yields each request's text as the engine produces it.  One loop serves Llama 2
and Llama 3.x; the family only decides which tokenizer and chat format are used.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, TypedDict, Union, cast

import torch
from typing_extensions import Unpack

from llama.engine import LogitsProcessor, RequestResult, RequestSettings
from llama.engine.build import LoadedModel, assemble_engine, build_engine
from llama.engine.detokenize import check_stop_strings, reference_echo_text
from llama.engine.sampling import SamplingParams
from llama.engine.stream import GenerationStream
from llama.formats.chat import ChatFormat, Dialog, Message
from llama.formats.chat_request import ChatRequestPlan, plan_chat_request
from llama.formats.infilling import (
    InfillingPrediction,
    decode_infilling,
    infilling_prompt_tokens,
    infilling_stop_tokens,
)
from llama.images.prompt import PromptImage
from llama.layers.policy import KernelPolicy
from llama.model import Transformer
from llama.structured import Grammar
from llama.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["Llama", "CompletionPrediction", "ChatPrediction", "InfillingPrediction", "GenerationStream", "Dialog",
           "Message"]



class SamplingOptions(TypedDict, total=False):
    """The keyword options every completion call takes beside Meta's arguments.

    ``top_k``: sample among the k most likely tokens only; ``stop``: strings that end a
    completion (not included in it; not for :meth:`Llama.generate` and infilling, which
    return tokens); ``seed``: seeds this call's sampling (prompt i of a call samples with
    ``seed + i``, any int); ``logits_processor(tokens, logits)``: called at every step with
    one sequence's tokens so far (1, L) and its logits (1, V), returns the logits to choose
    from (as in Meta's reference ``generate``); ``response_format``: constrain the reply, in
    OpenAI's shapes — ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}}}`` — or ``{"type": "regex", "regex": ...}``, ``{"type":
    "grammar", "grammar": <Lark grammar>}`` (``{"type": "text"}``: none); a format that cannot
    be compiled is a ValueError before anything is generated.  A constrained reply ends with
    the model's stop token once its grammar is complete; cut by ``max_gen_len`` it may be
    incomplete.  Its log-probabilities are those of the masked distribution it was sampled
    from (see :mod:`llama.structured`).  ``priority``: where the call's requests wait among
    others (threads sharing the Llama, a server): lower first, then in order of arrival, and
    the last to be preempted when the KV cache runs short (default 0).  ``timeout_s``: seconds
    after which the call's requests are ended, running or waiting, their blocks freed, and the
    call raises ``TimeoutError`` (a stream: after the pieces it gave); default: none.
    ``lora``: the name of a LoRA adapter the model was built
    with (:meth:`Llama.build`'s ``lora_adapters``) to generate with; None (default): the base
    model.  An unknown name is a ValueError listing the adapters loaded."""

    top_k: Optional[int]
    stop: Optional[List[str]]
    seed: Optional[int]
    logits_processor: Optional[LogitsProcessor]
    response_format: Optional[Mapping[str, Any]]
    priority: int
    timeout_s: Optional[float]
    lora: Optional[str]


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class Llama:
    """A loaded model with its tokenizer, chat format and generation engine."""

    @staticmethod
    def build(
        ckpt_dir: Union[str, Path],
        tokenizer_path: Union[str, Path, None] = None,
        *,
        max_seq_len: int,
        max_batch_size: int,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        quantize: Optional[str] = None,
        compile: Optional[bool] = None,
        quantize_group_size: Optional[int] = None,
        chat_format: Optional[str] = None,
        prefill_chunk: int = 512,
        cpu_packing: Optional[str] = None,
        kv_cache_tokens: Optional[int] = None,
        kv_block_size: int = 16,
        kv_cache_memory: Optional[float] = None,
        speculative: Optional[Mapping[str, Any]] = None,
        vision: bool = True,
        lora: Union[str, Path, None] = None,
        lora_adapters: Optional[Mapping[str, Any]] = None,
        max_loras: Optional[int] = None,
        max_lora_rank: Optional[int] = None,
    ) -> "Llama":
        """Load a checkpoint (Meta's, or a Hugging Face folder) on this process's share of the model.

        Every option after the two paths is given by keyword (as Meta's examples do).  Run one
        process per model-parallel rank (``torchrun --nproc_per_node N``) or a plain
        ``python`` process for one rank.  Any number of processes the model's
        shapes allow can load a checkpoint of any shard count.  The work is
        :func:`llama.engine.build.build_engine`'s (the server builds its model with it too);
        this wraps what it returns in the completion calls below.

        Args:
            ckpt_dir: directory with ``params.json`` and ``consolidated.NN.pth`` shards (Meta's
                layout), or a Hugging Face model folder: ``config.json`` and ``*.safetensors``
                (Llama 2 / Code Llama, Llama 3.x, Llama 4's text model), read directly, each rank
                reading only its slices (:mod:`llama.checkpoint.hf`).  Told apart by the files
                (:func:`llama.checkpoint.layout.checkpoint_layout`).
            tokenizer_path: ``tokenizer.model`` (SentencePiece for Llama 2, tiktoken for Llama 3
                and 4), or a byte-level BPE ``tokenizer.json`` (Llama 3 and 4); default (None):
                the checkpoint's own (:func:`llama.checkpoint.layout.find_tokenizer`).
            max_seq_len: longest prompt + generation; sizes the KV cache.
            max_batch_size: sequences decoded together at most; with ``max_seq_len``, the KV cache's
                default size (``kv_cache_tokens``).
            model_parallel_size: number of processes; default (and only allowed
                value) is the number started.
            seed: seeds the generator that draws each unseeded request's sampling seed
                (identical on every rank).
            device: ``"cuda"``, ``"cuda:N"``, ``"cpu"``; default CUDA if available.
            dtype: weights/activations dtype (``torch.dtype`` or name); default bfloat16
                on CUDA (float16 where bf16 is unsupported), float32 on CPU.  bfloat16 and
                float16 on an x86 CPU: the linear weights are packed for oneDNN's native
                bfloat16 kernels or fbgemm's half-precision one, whichever this CPU
                runs fastest (see :mod:`llama.layers.packing`).
            quantize: ``"int8"`` stores the linear layers' weights as int8 with a scale
                per output channel; ``"int4"`` as 4-bit codes with a scale and offset per
                group of ``quantize_group_size`` input columns (32, 64, 128 or 256; default
                128; refused with the other modes, which have no groups).
                Weight-only: activations stay in ``dtype`` (rounded to bfloat16 inside the int4
                kernels and CPU int8 decoding steps, see :mod:`llama.layers.quantize`).  ``"w8a8"``
                (CPU only): int8's weights, and one-row products (decoding at batch 1) take
                their activations as 8-bit codes too, per token, through fbgemm's int8 product,
                as llama.cpp's Q8_0 does (prompts and batched steps as int8; it holds a second
                copy of the int8 weights).
            compile: compile the decoding step with ``torch.compile`` (CUDA graphs on
                GPU), every shape it can take while the engine is built.  Default
                (:func:`llama.layers.policy.compile_by_default`): on for CUDA; on the CPU
                where a C++ compiler is found, for bfloat16 and quantised models (where
                compiled steps beat eager ones on every CPU measured, BENCHMARKS.md), not
                for float32; ``LLAMA_COMPILE=1`` or ``0`` overrides the default.  The first
                start compiles (tens of seconds); Inductor's on-disk cache makes later ones
                shorter.
            chat_format: ``"llama2"``, ``"llama3"`` or ``"codellama-70b-instruct"``; default:
                read from the tokenizer (no file tells CodeLlama-70B-Instruct apart: name it).
            prefill_chunk: most prompt tokens prefilled per engine step (a longer prompt is
                prefilled over several steps, so running requests keep decoding meanwhile).
            cpu_packing: for a bfloat16/float16 model on the CPU, the kernel its linear
                weights are packed for: ``"onednn"`` or ``"fbgemm"``; default (None): the one
                that decodes fastest on this CPU (:func:`llama.layers.policy.fastest_packing`).
                On a CPU with AVX-512 BF16 but no AMX the default is fbgemm, which decodes
                faster there and prefills slower than oneDNN: ``"onednn"`` for long prompts and
                short answers (measurements in BENCHMARKS.md).
            kv_cache_tokens: the paged KV cache's size in tokens, shared by every request
                (each holds blocks for the tokens it has; full blocks are shared between
                requests whose prompts begin alike); at least ``max_seq_len``; default
                ``max_batch_size * max_seq_len``.  ``max_batch_size`` requests decode together
                at most; the blocks free decide how many run.
            kv_block_size: tokens per block of the KV cache.
            kv_cache_memory: on CUDA, instead of ``kv_cache_tokens``: the share, in (0, 1), of
                the GPU's *total* memory this process may fill (as vLLM's
                ``gpu_memory_utilization``; e.g. 0.9).  The KV cache gets what is left of it
                once the weights, the largest prefill (``max_batch_size`` rows sharing
                ``prefill_chunk`` tokens, over ``max_seq_len`` positions), the largest decoding
                batch and the compiled steps' CUDA graphs are counted, all measured by running
                them while the engine is built (:mod:`llama.engine.kv_sizing`).  Memory held
                outside torch before that (the CUDA context, other processes) is not counted
                against it, but the cache must fit in what is free.  RuntimeError where what is
                left holds fewer than ``max_seq_len`` tokens.  With ``compile``, the steps are
                compiled twice at start (once to measure their CUDA graphs).
            speculative: speculative decoding (:mod:`llama.engine.speculative`), e.g.
                ``{"method": "ngram", "num_tokens": 4}``: each decoding step also feeds up to
                ``num_tokens`` (1..16) tokens proposed for the positions after a request's next
                one and keeps those the model agrees with, so one step may give several
                tokens.  The tokens (greedy) and their distribution (sampled; and a seeded
                request's very tokens) are those without it.  ``"ngram"`` (prompt lookup)
                proposes what followed the last ``prompt_lookup_max`` .. ``prompt_lookup_min``
                tokens (default 3 .. 1) where they occurred before in the prompt or reply: it
                pays where replies repeat their context (quoting, summaries, code edits), with
                few requests decoding at once: steps with more rows propose fewer tokens a row,
                and none beyond ``disable_by_batch_size`` rows (default 4).  ``"draft"``
                (``{"method": "draft", "draft_ckpt_dir": ..., "num_tokens": 4}``): a smaller
                model proposes, loaded from ``draft_ckpt_dir`` (Meta's files or a Hugging Face
                folder) with this model's device and dtype, whole on every rank (or, with
                ``draft_tensor_parallel_size`` the number of ranks, sharded over them as this
                model is; no other size), with a KV cache of its own as large as this
                one's (``kv_cache_tokens``; with ``kv_cache_memory`` the two caches share what
                is left, by their K/V bytes per token, and the draft's largest pass is measured
                too).  Its
                tokenizer must be this model's and its vocab_size the same (ValueError naming
                what differs): Llama 3.2 1B or 3B for Llama 3.1 8B or 70B.  Greedy requests get
                its argmax tokens proposed; sampled ones a draw from its distribution, which the
                standard rejection rule turns into a draw from exactly this model's (a seed
                gives the same text again, not the text it gives without speculation).  The
                options: ``method``, ``num_tokens`` (default 4), ``prompt_lookup_max``,
                ``prompt_lookup_min``, ``disable_by_batch_size``, ``draft_ckpt_dir``,
                ``draft_tensor_parallel_size`` (default 1).  A request may turn it off
                (``RequestSettings.speculative``).  Requests with a ``response_format`` or a
                forced ``tool_choice`` (a grammar) speculate too: their proposals are cut where
                the grammar forbids them, and each position is chosen under its grammar's mask,
                so they get the replies they get without it.  Default None: off.
            vision: build Llama 4's image encoder where the checkpoint has one (``params.json``'s
                ``vision_args``; its weights are loaded on every rank, split as Meta's are, in
                ``dtype`` and never quantised).  ``False`` skips its weights, to save memory:
                the model then runs text only.  For a Llama 3.2 Vision checkpoint (Meta's
                files), ``False`` skips the encoder, the cross-attention layers and the learnt
                ``<|image|>`` rows: the text model alone, as Meta's text-only inference runs it.
            lora: a Hugging Face PEFT LoRA adapter folder (``adapter_config.json`` +
                ``adapter_model.safetensors``) for this checkpoint, folded into the weights as
                they are read (``W += scale * B @ A`` on each rank's slice, in float32), before
                quantisation, packing and compilation: the fine-tune runs at the base's speed
                (``quantize`` quantises the merged weights).  Read and checked against the
                model before its weights (:func:`llama.lora.adapter.read_adapter`: DoRA,
                ``modules_to_save``, biases, the embedding or output layer, and shapes that do
                not fit are ValueErrors).  ``python -m llama.convert merge_lora`` writes the
                merged checkpoint once instead.  Default None: the base alone.
            lora_adapters: LoRA adapters served unmerged, many at once: ``{"name": adapter, ...}``,
                each a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
                or a :class:`~llama.lora.adapter.LoraAdapter`, loaded on every rank (each keeps its
                slice).  A call's ``lora="name"`` (:class:`SamplingOptions`) picks one; rows of
                different adapters and none decode in one step, the base product once for all
                (:mod:`llama.layers.lora`); the prefix cache is keyed by adapter.  Quantised bases
                (int8, int4) keep their kernels; the adapters run in ``dtype``.  Not with
                ``speculative``.
            max_loras: adapter slots (default: as many as ``lora_adapters`` gives; fewer is a
                ValueError).
            max_lora_rank: the largest rank an adapter may have (default: the largest given;
                an adapter above it is a ValueError).  Every adapter's factors are padded to it.
        """
        return Llama._holding(build_engine(
            ckpt_dir, tokenizer_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
            model_parallel_size=model_parallel_size, seed=seed, device=device, dtype=dtype, quantize=quantize,
            compile=compile, quantize_group_size=quantize_group_size, chat_format=chat_format,
            prefill_chunk=prefill_chunk, cpu_packing=cpu_packing, kv_cache_tokens=kv_cache_tokens,
            kv_block_size=kv_block_size, kv_cache_memory=kv_cache_memory, speculative=speculative, vision=vision,
            lora=lora, lora_adapters=lora_adapters, max_loras=max_loras, max_lora_rank=max_lora_rank))

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        seed: int = 1,
        compile: Optional[bool] = None,
        chat_format: Optional[str] = None,
        prefill_chunk: int = 512,
        cpu_packing: Optional[str] = None,
        policy: Optional[KernelPolicy] = None,
        kv_cache_tokens: Optional[int] = None,
        kv_block_size: int = 16,
        kv_cache_memory: Optional[float] = None,
        speculative: Optional[Mapping[str, Any]] = None,
        lora_adapters: Optional[Mapping[str, Any]] = None,
        max_loras: Optional[int] = None,
        max_lora_rank: Optional[int] = None,
    ) -> None:
        """A loaded ``model`` ready to generate.  ``policy``: its kernel policy (default:
        decided here from its device and dtype, ``compile`` and ``cpu_packing``, as
        :meth:`build` does); ``kv_cache_tokens``, ``kv_block_size``, ``kv_cache_memory``,
        ``speculative``, ``lora_adapters``, ``max_loras``, ``max_lora_rank``: see :meth:`build`.
        (:func:`llama.engine.build.assemble_engine` does the work.)"""
        self._hold(assemble_engine(model, tokenizer, seed=seed, compile=compile, chat_format=chat_format,
                                   prefill_chunk=prefill_chunk, cpu_packing=cpu_packing, policy=policy,
                                   kv_cache_tokens=kv_cache_tokens, kv_block_size=kv_block_size,
                                   kv_cache_memory=kv_cache_memory, speculative=speculative,
                                   lora_adapters=lora_adapters, max_loras=max_loras, max_lora_rank=max_lora_rank))

    @classmethod
    def _holding(cls, loaded: LoadedModel) -> "Llama":
        llama = cls.__new__(cls)
        llama._hold(loaded)
        return llama

    def _hold(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.formatter: ChatFormat = loaded.formatter
        self.generator = loaded.generator  # draws the seeds of unseeded requests
        self.policy = loaded.policy
        self.engine = loaded.engine
        # Compiles and keeps the grammars of response formats and tool choices; the engine gets them compiled.
        self.structured = loaded.structured

    @property
    def compiled(self) -> bool:
        """Whether decoding steps run compiled (False again after a failed compilation)."""
        return self.engine.runner.compiled

    @property
    def max_seq_len(self) -> int:
        return self.model.params.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.model.params.max_batch_size

    # -- argument checks, all before any compute ---------------------------------------

    def _settings(self, temperature, top_p, max_gen_len, logprobs: bool = False, echo: bool = False,
                  **options: Unpack[SamplingOptions]) -> RequestSettings:
        """One call's settings, checked (``max_gen_len`` None: up to max_seq_len - 1)."""
        unknown = sorted(set(options) - set(SamplingOptions.__annotations__))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; the options are "
                            f"{sorted(SamplingOptions.__annotations__)}")
        top_k = options.get("top_k")
        SamplingParams(temperature, top_p, top_k)  # type and range checks, in the order users read them
        settings = RequestSettings(
            max_new_tokens=self._check_max_gen_len(max_gen_len), temperature=temperature, top_p=top_p,
            top_k=top_k, seed=options.get("seed"), stop=check_stop_strings(options.get("stop")),
            logprobs=bool(logprobs), echo=bool(echo) and bool(logprobs),
            logits_processor=options.get("logits_processor"), text_follows_prompt=bool(echo),
            grammar=self._grammar(options.get("response_format")),
            priority=options.get("priority", 0), timeout_s=options.get("timeout_s"),
            lora=options.get("lora"),
        )
        settings = settings.checked()
        if settings.lora is not None:
            self.engine.lora_slot(settings.lora)  # an unknown name: ValueError before anything is submitted
        return settings

    def _grammar(self, response_format: Optional[Mapping[str, Any]]) -> Optional[Grammar]:
        """``response_format`` compiled for this model's tokenizer (ValueError if it cannot be)."""
        return self.structured.response_format(response_format)

    def _check_max_gen_len(self, max_gen_len: Optional[int]) -> int:
        if max_gen_len is None:
            return self.max_seq_len - 1
        if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int):
            raise TypeError(f"max_gen_len must be an int or None, got {type(max_gen_len).__name__}")
        if not 0 <= max_gen_len < self.max_seq_len:
            raise ValueError(f"max_gen_len must be in [0, {self.max_seq_len - 1}] (max_seq_len - 1), got {max_gen_len}")
        return max_gen_len

    def _check_prompt_tokens(self, prompt_tokens: Sequence[Sequence[int]]) -> list[list[int]]:
        if not isinstance(prompt_tokens, (list, tuple)):
            raise TypeError(f"prompt_tokens must be a list of token-id lists, got {type(prompt_tokens).__name__}")
        if len(prompt_tokens) > self.max_batch_size:
            raise ValueError(
                f"{len(prompt_tokens)} prompts exceed max_batch_size={self.max_batch_size}: "
                "pass fewer per call or build with a larger max_batch_size"
            )
        return [self.engine.check_prompt(toks, f"prompt {i}") for i, toks in enumerate(prompt_tokens)]

    def _check_text_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        return self._check_prompt_tokens([self.tokenizer.encode(p, bos=True, eos=False) for p in prompts])

    def _check_dialogs(self, dialogs: Sequence[Dialog], tools=None,
                       tool_prompt_format=None) -> tuple[list[list[int]], list[list[PromptImage]]]:
        """Each dialog's prompt tokens and images (checked here, before any dialog is run)."""
        if not isinstance(dialogs, (list, tuple)):
            raise TypeError(f"dialogs must be a list of dialogs, got {type(dialogs).__name__}")
        prompt_tokens, images = [], []
        for i, dialog in enumerate(dialogs):
            try:
                encoded = self.formatter.encode_dialog(dialog, tool_prompt_format, tools=tools)
                if encoded.images:
                    self.engine.check_images(encoded.images, len(encoded.tokens))
                prompt_tokens.append(encoded.tokens)
                images.append(encoded.images)
            except (ValueError, TypeError) as e:
                raise type(e)(f"dialog {i}: {e}") from None
        return self._check_prompt_tokens(prompt_tokens), images

    # -- generation ----------------------------------------------------------------------

    def _submit_all(self, prompts: list[list[int]], settings: RequestSettings,
                    images: Optional[list[list[PromptImage]]] = None) -> list[RequestResult]:
        """One request per prompt (with its ``images``, where given); wait for all.  With a
        seed, prompt i is sampled with seed + i, so each row's text does not depend on the others."""
        handles = [
            self.engine.submit(p, settings if settings.seed is None else replace(settings, seed=settings.seed + i),
                               images=images[i] if images is not None else ())
            for i, p in enumerate(prompts)
        ]
        try:
            results = [h.result() for h in handles]
            for r in results:
                check_not_timed_out(r, settings)
            return results
        finally:
            for h in handles:
                if not h.finished:
                    h.cancel()

    def generate(self, prompt_tokens: List[List[int]], max_gen_len: int, temperature: float = 0.6,
                 top_p: float = 0.9, logprobs: bool = False, echo: bool = False,
                 **options: Unpack[SamplingOptions]) -> tuple[List[List[int]], Optional[List[List[float]]]]:
        """Continue each prompt by up to ``max_gen_len`` tokens.

        All prompts are prefilled together (one ragged forward pass) and decode
        together; a row ends at its first stop token (not returned) or when it reaches
        ``max_gen_len`` new tokens or ``max_seq_len``.

        Returns (tokens, logprobs): per prompt the new tokens (with ``echo``, the
        prompt followed by them) and, with ``logprobs``, the log-probability of each
        returned token given those before it (the first prompt token has none: 0.0).
        ``options``: see :class:`SamplingOptions` (no ``stop``: this call returns tokens).
        """
        if max_gen_len is None or isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int):
            raise TypeError("max_gen_len must be an int")
        _no_stop("generate", options)
        settings = self._settings(temperature, top_p, max_gen_len, logprobs, echo, **options)
        prompts = self._check_prompt_tokens(prompt_tokens)
        if not prompts:
            return [], ([] if logprobs else None)
        results = self._submit_all(prompts, settings)
        tokens = [(p if echo else []) + r.tokens for p, r in zip(prompts, results)]
        if not logprobs:
            return tokens, None
        # logprobs asked for: every result has them
        return tokens, [((r.prompt_logprobs or []) if echo else []) + cast(list[float], r.logprobs) for r in results]

    def text_completion(self, prompts: List[str], temperature: float = 0.6, top_p: float = 0.9,
                        max_gen_len: Optional[int] = None, logprobs: bool = False, echo: bool = False,
                        **options: Unpack[SamplingOptions]) -> List[CompletionPrediction]:
        """Complete each text prompt (BOS is prepended).

        ``max_gen_len`` None: up to ``max_seq_len - 1`` tokens.  ``options``: see
        :class:`SamplingOptions`.  Returns one dict per prompt: ``generation`` (text; with
        ``echo``, the prompt's text followed by it, every token decoded as Meta's reference
        does: ``<|begin_of_text|>`` first for Llama 3 and 4, while the server's echo is
        OpenAI's, without it), and with ``logprobs`` also ``tokens``
        (each token's text) and ``logprobs``.
        """
        settings = self._settings(temperature, top_p, max_gen_len, logprobs, echo, **options)
        prompt_tokens = self._check_text_prompts(prompts)
        if not prompt_tokens:
            return []
        results = self._submit_all(prompt_tokens, settings)
        out = []
        for prompt, r in zip(prompt_tokens, results):
            text = reference_echo_text(self.tokenizer, prompt) + r.text if echo else r.text
            tokens = (prompt if echo else []) + r.tokens
            lps = ((r.prompt_logprobs or [0.0] * len(prompt)) if echo else []) + (r.logprobs or [])
            out.append(self._prediction(text, tokens, lps if logprobs else None))
        return cast(List[CompletionPrediction], out)  # _prediction's dicts, in the shape of the call's

    def chat_completion(self, dialogs: List[Dialog], temperature: float = 0.6, top_p: float = 0.9,
                        max_gen_len: Optional[int] = None, logprobs: bool = False, *,
                        tools: Optional[Sequence[object]] = None, tool_prompt_format: Optional[str] = None,
                        tool_choice: Union[str, Mapping[str, Any], None] = None, parallel_tool_calls: bool = True,
                        **options: Unpack[SamplingOptions]) -> List[ChatPrediction]:
        """The assistant's reply to each dialog.

        A dialog is a list of ``{"role", "content"}`` messages (assistant messages may
        carry ``tool_calls``; tool results come as ``ipython``/``tool`` messages), in the
        order the model's chat format allows, ending with user or tool.  A message's
        ``content`` is a string or a list of parts, ``{"type": "text", "text": ...}`` and
        ``{"type": "image", "image": <PIL.Image | bytes | path>}`` (or llama-models'
        ``RawTextItem``/``RawMediaItem``: :mod:`llama.formats.content`); a text-only model given an
        image raises ``ValueError`` (it takes no images); a model with a vision encoder (a Llama 4
        checkpoint with its vision weights) sees them.  ``tools``
        (Llama 3.1+): built-in tool names and OpenAI-shaped function definitions,
        declared in ``tool_prompt_format`` (``"json"``, ``"function_tag"`` or
        ``"python_list"``; default: the model's own, ``"json"`` for Llama 3, ``"python_list"``
        for Llama 4, which takes no other).  ``tool_choice`` (OpenAI's): ``"auto"`` (default: the model
        chooses), ``"none"`` (the tools are not declared; the reply is content),
        ``"required"`` (the reply is calls of the tools) or ``{"type": "function",
        "function": {"name": ...}}`` (calls of that one); ``parallel_tool_calls=False``
        makes a required or named reply a single call.  A required or named reply is
        constrained to well-formed calls in the model's tool format, with arguments valid
        against each function's ``parameters`` schema (:mod:`llama.structured.tool_choice`).
        Returns one dict per dialog: ``generation`` =
        ``{"role": "assistant", "content", "stop_reason", "tool_calls"}`` (``stop_reason``:
        ``"end_of_turn"``, ``"end_of_message"`` or ``"out_of_tokens"``), and with
        ``logprobs`` also ``tokens`` and ``logprobs``.  ``options``: see :class:`SamplingOptions`.
        Built-in tools may also be declared as Meta's prompts do, in the system message
        (``Environment: ipython`` / ``Tools: brave_search, wolfram_alpha``): a reply calling
        them is then read as calls, as llama-models reads it.
        """
        settings, prompt_tokens, plan, images = self._chat_request(dialogs, temperature, top_p, max_gen_len,
                                                                   logprobs, tools, tool_prompt_format, tool_choice,
                                                                   parallel_tool_calls, options)
        if not prompt_tokens:
            return []
        results = self._submit_all(prompt_tokens, settings, images)
        return [
            cast(ChatPrediction,
                 self._prediction(plan.with_system_tools(dialog).reply(self.formatter, r), r.tokens,
                                  r.logprobs if logprobs else None))
            for dialog, r in zip(dialogs, results)
        ]

    def _chat_request(self, dialogs, temperature, top_p, max_gen_len, logprobs, tools, tool_prompt_format,
                      tool_choice, parallel_tool_calls,
                      options: Mapping[str, Any]) -> tuple[RequestSettings, list[list[int]], ChatRequestPlan,
                                                           list[list[PromptImage]]]:
        """A chat call's settings, its prompts, its plan (which tools are declared, which
        its reply may call: :func:`llama.formats.chat_request.plan_chat_request`) and its prompts'
        images; everything
        checked before anything is generated.  A reply the plan constrains to calls gets the
        tool-call grammar; one that follows a ``response_format`` gets that format's."""
        if not isinstance(parallel_tool_calls, bool):
            raise TypeError(f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}")
        plan = plan_chat_request(tool_choice, tools, options.get("response_format"))
        tool_prompt_format = self.formatter.check_tool_prompt_format(tool_prompt_format)
        settings = self._chat_settings(temperature, top_p, max_gen_len, logprobs, **options)
        prompt_tokens, images = self._check_dialogs(dialogs, plan.tools, tool_prompt_format)
        if plan.reply_is_calls:
            grammar = self.structured.tool_choice(tools, tool_choice, tool_prompt_format, parallel_tool_calls)
            settings = replace(settings, grammar=grammar)
        return settings, prompt_tokens, plan, images

    def _chat_settings(self, temperature, top_p, max_gen_len, logprobs, **options: Unpack[SamplingOptions]):
        settings = self._settings(temperature, top_p, max_gen_len, logprobs, False, **options)
        return replace(settings, stop_tokens=self.formatter.stop_tokens)  # e.g. <step> for CodeLlama-70B


    def text_infilling(self, prefixes: List[str], suffixes: List[str], temperature: float = 0.0, top_p: float = 0.9,
                       max_gen_len: Optional[int] = None, logprobs: bool = False, suffix_first: bool = False,
                       **options: Unpack[SamplingOptions]) -> List[InfillingPrediction]:
        """Code Llama: the code between each prefix and suffix (``<PRE>``, ``<SUF>``,
        ``<MID>`` as Meta's codellama builds the prompt; ``suffix_first`` is its SPM
        variant).  Returns one dict per pair: ``generation`` (the middle) and
        ``full_text`` (prefix + middle + suffix), with ``logprobs`` also ``tokens`` and
        ``logprobs``.  Generation stops at ``<EOT>``.  ``options``: see :class:`SamplingOptions`
        (no ``stop``)."""
        if not isinstance(prefixes, (list, tuple)) or not isinstance(suffixes, (list, tuple)):
            raise TypeError("prefixes and suffixes must be lists of str")
        if len(prefixes) != len(suffixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(suffixes)} suffixes: give one suffix per prefix")
        _no_stop("text_infilling", options)
        settings = self._settings(temperature, top_p, max_gen_len, logprobs, False, **options)
        settings = replace(settings, stop_tokens=infilling_stop_tokens(self.tokenizer))
        prompts = self._check_prompt_tokens(
            [infilling_prompt_tokens(self.tokenizer, p, s, suffix_first=suffix_first)
             for p, s in zip(prefixes, suffixes)]
        )
        if not prompts:
            return []
        out = []
        for prefix, suffix, r in zip(prefixes, suffixes, self._submit_all(prompts, settings)):
            middle = decode_infilling(self.tokenizer, r.tokens)
            prediction = self._prediction(middle, r.tokens, r.logprobs if logprobs else None)
            prediction["full_text"] = prefix + middle + suffix
            out.append(prediction)
        return cast(List[InfillingPrediction], out)

    def text_completion_stream(self, prompt: str, temperature: float = 0.6, top_p: float = 0.9,
                               max_gen_len: Optional[int] = None,
                               **options: Unpack[SamplingOptions]) -> GenerationStream:
        """Complete one prompt, yielding the text as it is decoded.

        The pieces concatenate to exactly what :meth:`text_completion` returns for the
        same arguments and seed.  Under torchrun every rank must iterate the generator
        (each piece costs decoding steps, which all ranks take together).  Closing the
        stream early cancels the request; once exhausted, its ``result`` is the
        request's :class:`~llama.engine.RequestResult`.
        """
        settings = self._settings(temperature, top_p, max_gen_len, **options)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        (prompt_tokens,) = self._check_text_prompts([prompt])
        return GenerationStream(self.engine, prompt_tokens, settings)

    def chat_completion_stream(self, dialog: Dialog, temperature: float = 0.6, top_p: float = 0.9,
                               max_gen_len: Optional[int] = None, *, tools: Optional[Sequence[object]] = None,
                               tool_prompt_format: Optional[str] = None,
                               tool_choice: Union[str, Mapping[str, Any], None] = None,
                               parallel_tool_calls: bool = True,
                               **options: Unpack[SamplingOptions]) -> GenerationStream:
        """The assistant's reply to one dialog, yielded piece by piece as it is decoded
        (see :meth:`text_completion_stream`; ``tools``, ``tool_choice``: see
        :meth:`chat_completion`).  Once exhausted, the stream's ``message`` holds the reply
        as :meth:`chat_completion` returns it (``stop_reason``, ``tool_calls``)."""
        settings, (prompt_tokens,), plan, (images,) = self._chat_request(
            [dialog], temperature, top_p, max_gen_len, False, tools, tool_prompt_format, tool_choice,
            parallel_tool_calls, options)
        plan = plan.with_system_tools(dialog)
        return GenerationStream(self.engine, prompt_tokens, settings,
                                lambda result: cast(dict, plan.reply(self.formatter, result)), images=images)

    def _prediction(self, generation, tokens: List[int], logprobs: Optional[List[float]]) -> dict:
        if logprobs is None:
            return {"generation": generation}
        return {"generation": generation, "tokens": [self.tokenizer.decode([x]) for x in tokens], "logprobs": logprobs}


def check_not_timed_out(result: RequestResult, settings: RequestSettings) -> None:
    """TimeoutError if the engine ended the request at its deadline (``timeout_s``)."""
    if result.finish_reason == "timeout":
        raise TimeoutError(f"the request ran past its timeout_s={settings.timeout_s:g} s and was ended (after "
                           f"{len(result.tokens)} tokens): give a longer timeout_s or a smaller max_gen_len")


def _no_stop(call: str, options: Mapping[str, Any]) -> None:
    if options.get("stop") is not None:
        raise TypeError(f"{call}() takes no stop strings (it returns tokens): use text_completion for stop=")
