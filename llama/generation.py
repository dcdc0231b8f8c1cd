"""Loading a checkpoint (``Llama.build``) and the generation loop.

One loop serves Llama 2 and Llama 3.x: the family only decides which tokenizer
and chat format :meth:`Llama.build` picks from the files.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, TypedDict, Union

import torch

from . import distributed
from .args import ModelArgs
from .chat_format import ChatFormat, Dialog, Message, chat_format_for
from .checkpoint import (
    choose_embedding_layout,
    find_shards,
    inspect_checkpoint,
    load_rank_state_dict,
    valid_model_parallel_sizes,
)
from .layers import aten_cpu_matmuls, use_column_major_weights_
from .model import Transformer
from .quantize import QUANTIZATION_MODES, quantize_int8_
from .sampling import SamplingParams, sample_next_token
from .streaming import TextAssembler, check_stop_strings
from .tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["Llama", "CompletionPrediction", "ChatPrediction", "Dialog", "Message"]


class CompletionPrediction(TypedDict, total=False):
    generation: str
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


class ChatPrediction(TypedDict, total=False):
    generation: Message
    tokens: List[str]  # not required
    logprobs: List[float]  # not required


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_memory(model: Transformer, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse to start loading what cannot fit: this rank's weights and KV cache
    (sized on the meta-built model) against the memory ``device`` has free."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    cache = sum(b.numel() for name, b in model.named_buffers() if "cache" in name) * itemsize
    cache += model.freqs_cis.numel() * model.freqs_cis.element_size()  # the RoPE table grows with max_seq_len too
    need = weights + cache
    available = distributed.available_memory(device)
    logger.debug("memory per rank: weights %.2f GiB + KV cache %.2f GiB", weights / 2**30, cache / 2**30)
    if available is not None and need > available:
        gib = 2**30
        raise RuntimeError(
            f"not enough memory on {device}: this rank needs {need / gib:.2f} GiB "
            f"(weights {weights / gib:.2f} GiB + KV cache and RoPE table {cache / gib:.2f} GiB for max_batch_size="
            f"{model.params.max_batch_size} x max_seq_len={model.params.max_seq_len}) but {available / gib:.2f} GiB "
            "is available. Lower max_batch_size or max_seq_len, run more processes (torchrun --nproc_per_node), "
            "or use a smaller dtype (bfloat16)."
        )


class Llama:
    """A loaded model with its tokenizer and chat format."""

    @staticmethod
    def build(
        ckpt_dir: Union[str, Path],
        tokenizer_path: Union[str, Path],
        max_seq_len: int,
        max_batch_size: int,
        model_parallel_size: Optional[int] = None,
        seed: int = 1,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        quantize: Optional[str] = None,
        compile: Optional[bool] = None,
    ) -> "Llama":
        """Load a Meta-format checkpoint on this process's share of the model.

        Run one process per model-parallel rank (``torchrun --nproc_per_node N``) or a
        plain ``python`` process for one rank.  Any number of processes the model's
        shapes allow can load a checkpoint of any shard count.

        Args:
            ckpt_dir: directory with ``params.json`` and ``consolidated.NN.pth`` shards.
            tokenizer_path: ``tokenizer.model`` (SentencePiece for Llama 2, tiktoken for Llama 3).
            max_seq_len: longest prompt + generation; sizes the KV cache.
            max_batch_size: most sequences per call; sizes the KV cache.
            model_parallel_size: number of processes; default (and only allowed
                value) is the number started.
            seed: seed of the sampling generator (identical on every rank).
            device: ``"cuda"``, ``"cuda:N"``, ``"cpu"``; default CUDA if available.
            dtype: weights/activations dtype (``torch.dtype`` or name); default bfloat16
                on CUDA (float16 where bf16 is unsupported), float32 on CPU.
            quantize: ``"int8"`` stores the linear layers' weights as int8 with a scale
                per output channel (weight-only; activations stay in ``dtype``).
            compile: compile the decoding step with ``torch.compile`` (CUDA graphs on
                GPU).  Default: on for CUDA, off for CPU (where it does not pay).
        """
        start = time.perf_counter()
        _positive_int("max_seq_len", max_seq_len)
        _positive_int("max_batch_size", max_batch_size)
        if model_parallel_size is not None:
            _positive_int("model_parallel_size", model_parallel_size)
        if quantize is not None and quantize not in QUANTIZATION_MODES:
            raise ValueError(f"quantize must be None or one of {QUANTIZATION_MODES}, got {quantize!r}")
        device = distributed.resolve_device(device)
        dtype = distributed.resolve_dtype(dtype, device)
        ckpt_dir = Path(ckpt_dir)
        # Check the files before joining the process group: a typo should fail fast.
        shards = find_shards(ckpt_dir)
        tokenizer = load_tokenizer(tokenizer_path)
        args = ModelArgs.from_json(ckpt_dir / "params.json", max_seq_len=max_seq_len, max_batch_size=max_batch_size)
        if args.vocab_size == -1:
            args.vocab_size = tokenizer.n_words
        if tokenizer.n_words > args.vocab_size:
            raise ValueError(
                f"the tokenizer {tokenizer_path} has {tokenizer.n_words} tokens but the model's vocabulary "
                f"has {args.vocab_size}: use the tokenizer.model that came with this checkpoint"
            )
        info = inspect_checkpoint(shards, args)
        world_size = distributed.planned_world_size()
        if world_size not in valid_model_parallel_sizes(args):
            raise ValueError(
                f"this model cannot be split over {world_size} processes; "
                f"model-parallel sizes that work: {valid_model_parallel_sizes(args)}"
            )
        rank, world_size = distributed.init_model_parallel(device, model_parallel_size)
        layout = choose_embedding_layout(info.embedding_layout, args, world_size)
        with torch.device("meta"):
            model = Transformer(args, embedding_layout=layout)
        _check_memory(model, dtype, device)
        local_shapes = {name: t.shape for name, t in model.state_dict().items()}
        state = load_rank_state_dict(info, args, local_shapes, layout, world_size, rank, device, dtype)
        model.load_state_dict(state, strict=True, assign=True)
        del state
        if quantize == "int8":
            quantize_int8_(model)
        model.setup_caches(device, dtype)
        model.eval()
        distributed.wait_for_all_ranks()  # ranks finish loading at their own pace
        logger.info(
            "loaded %s (%d shard(s)) as rank %d/%d on %s in %s%s, %.1f s",
            ckpt_dir, info.n_shards, rank, world_size, device, dtype,
            f" ({quantize} weights)" if quantize else "", time.perf_counter() - start,
        )
        return Llama(model, tokenizer, seed=seed, compile=compile)

    def __init__(self, model: Transformer, tokenizer: Tokenizer, seed: int = 1, compile: Optional[bool] = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.formatter: ChatFormat = chat_format_for(tokenizer)
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        on_cuda = model.device.type == "cuda"
        # CPU kernel choices for one-token steps, measured on this project's benchmark
        # machine (see BENCHMARKS.md): float32 matrix-vector products stream column-major
        # weights faster; bfloat16/float16 matrix-*vector* products (batch 1) are faster
        # in ATen's kernel than oneDNN's, while oneDNN wins as soon as there are rows to batch.
        self.compiled = on_cuda if compile is None else bool(compile)
        self._decode_kernels = contextlib.nullcontext
        if model.device.type == "cpu" and not self.compiled:
            if model.dtype == torch.float32:
                use_column_major_weights_(model)
            else:
                self._decode_kernels = aten_cpu_matmuls
        self._decode_step = model.decode_logits
        if self.compiled:
            # Every step has the same shapes (the whole cache is attended to, masked),
            # so one compiled graph (per batch size) serves the whole generation.
            compiled = torch.compile(model.decode_logits, mode="reduce-overhead" if on_cuda else None, dynamic=False)
            self._decode_step = self._with_eager_fallback(compiled)
        # Deciding to stop needs the host to read the device; on CUDA do it every few
        # steps rather than every token (a finished row just idles meanwhile).
        self._check_done_every = 16 if on_cuda else 1

    def _with_eager_fallback(self, compiled):
        """The compiled step, falling back to eager (with a warning) if compilation
        fails: a slower run beats a crash."""

        def step(tokens, positions, kv_len):
            try:
                return compiled(tokens, positions, kv_len)
            except torch._dynamo.exc.TorchDynamoException as e:
                logger.warning("compiling the decoding step failed, continuing without it: %s", str(e).splitlines()[0])
                self.compiled = False
                self._decode_step = self.model.decode_logits
                return self.model.decode_logits(tokens, positions, kv_len)

        return step

    @property
    def max_seq_len(self) -> int:
        return self.model.params.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.model.params.max_batch_size

    # -- argument checks, all before any compute ---------------------------------------

    def _check_request(self, temperature, top_p, top_k, max_gen_len, stop, seed) -> tuple[SamplingParams, int, tuple]:
        """Sampling settings, the token budget (None: up to max_seq_len - 1) and stop strings, checked
        (with the seed)."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        return SamplingParams(temperature, top_p, top_k), self._check_max_gen_len(max_gen_len), check_stop_strings(stop)

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
        checked = []
        for i, toks in enumerate(prompt_tokens):
            if not isinstance(toks, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in toks
            ):
                raise TypeError(f"prompt {i} must be a list of int token ids")
            if not toks:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. BOS)")
            if len(toks) > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(toks)} tokens, more than max_seq_len={self.max_seq_len}: "
                    "shorten it or build with a larger max_seq_len"
                )
            if not all(0 <= t < self.model.vocab_size for t in toks):
                raise ValueError(f"prompt {i} holds token ids outside [0, {self.model.vocab_size})")
            checked.append(list(toks))
        return checked

    def _check_text_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        return self._check_prompt_tokens([self.tokenizer.encode(p, bos=True, eos=False) for p in prompts])

    def _check_dialogs(self, dialogs: Sequence[Dialog]) -> list[list[int]]:
        if not isinstance(dialogs, (list, tuple)):
            raise TypeError(f"dialogs must be a list of dialogs, got {type(dialogs).__name__}")
        prompt_tokens = []
        for i, dialog in enumerate(dialogs):
            try:
                prompt_tokens.append(self.formatter.encode_dialog_prompt(dialog))
            except (ValueError, TypeError) as e:
                raise type(e)(f"dialog {i}: {e}") from None
        return self._check_prompt_tokens(prompt_tokens)

    # -- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
        *,
        top_k: Optional[int] = None,
        seed: Optional[int] = None,
    ) -> tuple[List[List[int]], Optional[List[List[float]]]]:
        """Continue each prompt by up to ``max_gen_len`` tokens.

        Every prompt is processed in one forward pass (however their lengths differ),
        then all rows decode together; a row ends at its first stop token (not
        returned) or when it reaches ``max_gen_len`` new tokens or ``max_seq_len``.

        Returns (tokens, logprobs): per prompt the new tokens (with ``echo``, the
        prompt followed by them) and, with ``logprobs``, the log-probability of each
        returned token given those before it (the first prompt token has none: 0.0).
        ``top_k`` limits sampling to the k most likely tokens; ``seed`` reseeds the
        sampler for this call.
        """
        if max_gen_len is None or isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int):
            raise TypeError("max_gen_len must be an int")
        sampling, max_gen_len, _ = self._check_request(temperature, top_p, top_k, max_gen_len, None, seed)
        prompts = self._check_prompt_tokens(prompt_tokens)
        if not prompts:
            return [], ([] if logprobs else None)
        batch = self._start(prompts, max_gen_len, sampling, logprobs, seed, echo=echo)
        with self._computing():
            batch.run()
            return batch.results(echo)

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
        *,
        top_k: Optional[int] = None,
        stop: Optional[List[str]] = None,
        seed: Optional[int] = None,
    ) -> List[CompletionPrediction]:
        """Complete each text prompt (BOS is prepended).

        ``max_gen_len`` None: up to ``max_seq_len - 1`` tokens.  ``stop``: strings that
        end a completion (not included in it).  Returns one dict per prompt:
        ``generation`` (text), and with ``logprobs`` also ``tokens`` (each token's text)
        and ``logprobs``.
        """
        sampling, max_gen_len, stop = self._check_request(temperature, top_p, top_k, max_gen_len, stop, seed)
        prompt_tokens = self._check_text_prompts(prompts)
        if not prompt_tokens:
            return []
        batch = self._start(prompt_tokens, max_gen_len, sampling, logprobs, seed, stop, echo=echo)
        with self._computing():
            batch.run()
            tokens, lps = batch.results(echo)
            texts = batch.texts(echo)
        return [self._prediction(text, t, lps, i) for i, (text, t) in enumerate(zip(texts, tokens))]

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        *,
        top_k: Optional[int] = None,
        stop: Optional[List[str]] = None,
        seed: Optional[int] = None,
    ) -> List[ChatPrediction]:
        """The assistant's reply to each dialog.

        A dialog is a list of ``{"role", "content"}`` messages: an optional system
        message, then user and assistant in turn, ending with user.  Returns one dict
        per dialog: ``generation`` = ``{"role": "assistant", "content": ...}``, and with
        ``logprobs`` also ``tokens`` and ``logprobs``.
        """
        sampling, max_gen_len, stop = self._check_request(temperature, top_p, top_k, max_gen_len, stop, seed)
        prompt_tokens = self._check_dialogs(dialogs)
        if not prompt_tokens:
            return []
        batch = self._start(prompt_tokens, max_gen_len, sampling, logprobs, seed, stop)
        with self._computing():
            batch.run()
            tokens, lps = batch.results(False)
            texts = batch.texts(False)
        return [
            self._prediction({"role": "assistant", "content": text}, t, lps, i)
            for i, (text, t) in enumerate(zip(texts, tokens))
        ]

    def text_completion_stream(
        self,
        prompt: str,
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        *,
        top_k: Optional[int] = None,
        stop: Optional[List[str]] = None,
        seed: Optional[int] = None,
    ) -> Iterator[str]:
        """Complete one prompt, yielding the text as it is decoded.

        The pieces concatenate to exactly what :meth:`text_completion` returns for the
        same arguments and seed.  Every rank must iterate the generator (each piece
        costs one decoding step, which all ranks take together).
        """
        sampling, max_gen_len, stop = self._check_request(temperature, top_p, top_k, max_gen_len, stop, seed)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        prompt_tokens = self._check_text_prompts([prompt])
        return self._stream(prompt_tokens, max_gen_len, sampling, seed, stop)

    def chat_completion_stream(
        self,
        dialog: Dialog,
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        *,
        top_k: Optional[int] = None,
        stop: Optional[List[str]] = None,
        seed: Optional[int] = None,
    ) -> Iterator[str]:
        """The assistant's reply to one dialog, yielded piece by piece as it is decoded
        (see :meth:`text_completion_stream`)."""
        sampling, max_gen_len, stop = self._check_request(temperature, top_p, top_k, max_gen_len, stop, seed)
        prompt_tokens = self._check_dialogs([dialog])
        return self._stream(prompt_tokens, max_gen_len, sampling, seed, stop)

    def _stream(self, prompt_tokens, max_gen_len, sampling, seed, stop) -> Iterator[str]:
        # Arguments are checked above, before this generator starts: errors surface
        # at the call, not at the first next().
        batch = self._start(prompt_tokens, max_gen_len, sampling, False, seed, stop, stream=True)
        while not batch.finished():
            with self._computing():
                piece = batch.step()[0]
            if piece:
                yield piece
        tail = batch.assemblers[0].finish()
        if tail:
            yield tail

    @staticmethod
    @contextlib.contextmanager
    def _computing() -> Iterator[None]:
        """Around every piece of model compute: autograd off, failed collectives explained.
        (Entered per step, never held across a streaming ``yield``, so the caller's own
        grad mode is untouched between pieces.)"""
        with distributed.explain_peer_failures(), torch.inference_mode():
            yield

    def _start(self, prompts, max_gen_len, sampling, logprobs, seed, stop=(), stream=False, echo=False) -> "_DecodeBatch":
        """Reseed if asked, and prefill a :class:`_DecodeBatch` for these checked prompts.
        With ``logprobs`` and ``echo``, the prompts are scored too."""
        if seed is not None:
            self.generator.manual_seed(seed)
        with self._computing():
            return _DecodeBatch(self, prompts, max_gen_len, sampling, logprobs, stop, stream, score_prompts=echo)

    def _prediction(self, generation, tokens: List[int], logprobs: Optional[List[List[float]]], i: int) -> dict:
        if logprobs is None:
            return {"generation": generation}
        return {
            "generation": generation,
            "tokens": [self.tokenizer.decode([x]) for x in tokens],
            "logprobs": logprobs[i],
        }


class _DecodeBatch:
    """The state of one generation call: prompts, what each row has produced, and
    which rows are done.

    Layout: row i's prompt sits at positions 0..len_i-1 of ``tokens`` (right-padded);
    its n-th new token goes to position len_i + n, which is also its KV-cache slot.
    All prompts are prefilled in one forward pass; a row never attends past its own
    position, so padding after a short prompt is never seen (and is overwritten as
    that row decodes).
    """

    def __init__(self, llama: Llama, prompts, max_gen_len, sampling, logprobs, stop, stream, score_prompts) -> None:
        self.llama = llama
        self.sampling = sampling
        self.logprobs = logprobs
        self.stop_strings = stop
        model, device = llama.model, llama.model.device
        self.device = device
        self.bsz = len(prompts)
        self.lens = [len(p) for p in prompts]
        self.budgets = [min(max_gen_len, llama.max_seq_len - n) for n in self.lens]  # new tokens allowed per row
        self.max_prompt = max(self.lens)
        self.total_len = max(n + b for n, b in zip(self.lens, self.budgets))
        self.max_steps = max(self.budgets)
        self.step_count = 0
        tokens = torch.zeros((self.bsz, self.total_len), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.tokens = tokens.to(device)  # one transfer for the whole batch
        self.token_logprobs = torch.zeros(self.tokens.shape, dtype=torch.float32, device=device) if logprobs else None
        self.lens_t = torch.tensor(self.lens, device=device)
        self.rows = torch.arange(self.bsz, device=device)
        self.stop_tokens = torch.tensor(sorted(llama.tokenizer.stop_tokens), dtype=torch.long, device=device)
        self.budgets_t = torch.tensor(self.budgets, device=device)
        self.n_new = torch.zeros(self.bsz, dtype=torch.long, device=device)  # tokens generated per row
        self.done = self.budgets_t == 0
        self._all_done = self.max_steps == 0
        # Text is assembled as tokens arrive only when needed (stop strings, streaming).
        self.assemblers = [TextAssembler(llama.tokenizer, stop) for _ in prompts] if (stop or stream) else None

        positions = torch.arange(self.max_prompt, device=device).expand(self.bsz, self.max_prompt)
        hidden = model.hidden_states(self.tokens[:, : self.max_prompt], positions, self.max_prompt, from_start=True)
        if logprobs and score_prompts:
            self._score_prompts(hidden)
        self.next_logits = model.logits(hidden[self.rows, self.lens_t - 1])  # (B, V)

    def _score_prompts(self, hidden: torch.Tensor, chunk: int = 256) -> None:
        """Log-probability of each prompt token given the ones before it, into
        ``token_logprobs[:, 1:len]``.  Logits are made ``chunk`` positions at a time
        to bound memory (each position is a vocabulary-wide float32 row)."""
        seqlen = hidden.shape[1]
        for start in range(0, seqlen - 1, chunk):
            end = min(start + chunk, seqlen - 1)
            log_probs = torch.log_softmax(self.llama.model.logits(hidden[:, start:end]), dim=-1)  # predicts start+1..end
            targets = self.tokens[:, start + 1 : end + 1]
            self.token_logprobs[:, start + 1 : end + 1] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        for i, n in enumerate(self.lens):
            self.token_logprobs[i, n:] = 0.0  # past the prompt: padding

    def finished(self) -> bool:
        return self._all_done or self.step_count >= self.max_steps

    def run(self) -> None:
        while not self.finished():
            self.step()

    def step(self) -> list[str]:
        """Choose every row's next token, record it, and feed it to the model.
        Returns the text each row released (when text is being assembled)."""
        llama, step = self.llama, self.step_count
        next_token = sample_next_token(self.next_logits, self.sampling, llama.generator)
        next_token = distributed.broadcast_from_first_rank(next_token)  # one rank decides for all
        write_at = self.lens_t + step
        active = ~self.done
        # Finished rows keep what they have (no boolean indexing: no host sync).
        slot = torch.clamp(write_at, max=self.total_len - 1)
        self.tokens[self.rows, slot] = torch.where(active, next_token, self.tokens[self.rows, slot])
        if self.logprobs:
            lp = torch.log_softmax(self.next_logits, dim=-1).gather(-1, next_token.unsqueeze(-1)).squeeze(-1)
            self.token_logprobs[self.rows, slot] = torch.where(active, lp, self.token_logprobs[self.rows, slot])
        self.n_new += active.long()
        self.done |= torch.isin(next_token, self.stop_tokens) | (self.n_new >= self.budgets_t)
        self.step_count += 1

        pieces = [""] * self.bsz
        if self.assemblers is not None:
            pieces = self._assemble(next_token.tolist(), active.tolist())
        if self.step_count % llama._check_done_every == 0 or self.step_count >= self.max_steps:
            self._all_done = bool(self.done.all())
        if not self.finished():
            # Feed the new token at its position; finished rows idle at a valid slot.
            feed_at = torch.clamp(write_at, max=llama.max_seq_len - 1).unsqueeze(1)
            kv_len = llama.max_seq_len if llama.compiled else min(self.max_prompt + step, llama.max_seq_len - 1) + 1
            kernels = llama._decode_kernels if self.bsz == 1 else contextlib.nullcontext
            with kernels():
                self.next_logits = llama._decode_step(next_token.unsqueeze(1), feed_at, kv_len)
        return pieces

    def _assemble(self, next_token: list[int], active: list[bool]) -> list[str]:
        pieces = [""] * self.bsz
        stopped = []
        for i, assembler in enumerate(self.assemblers):
            if not active[i] or assembler.stopped:
                continue
            if next_token[i] in self.llama.tokenizer.stop_tokens:
                continue
            pieces[i] = assembler.push(next_token[i])
            if assembler.stopped:
                stopped.append(i)
        if stopped:
            # A stop string ended these rows (decided on every rank alike: all ranks
            # hold the same tokens).
            self.done[stopped] = True
        return pieces

    def results(self, echo: bool) -> tuple[List[List[int]], Optional[List[List[float]]]]:
        """Per row: (prompt if ``echo``) + new tokens up to the first stop token or stop
        string; and their log-probabilities when asked for."""
        n_new = self.n_new.tolist()
        stop_tokens = self.llama.tokenizer.stop_tokens
        out_tokens, out_logprobs = [], []
        for i, n in enumerate(self.lens):
            generated = self.tokens[i, n : n + n_new[i]].tolist()
            for j, t in enumerate(generated):
                if t in stop_tokens:
                    generated = generated[:j]
                    break
            if self.assemblers is not None and self.assemblers[i].stopped:
                generated = generated[: self.assemblers[i].tokens_before_stop()]
            start, end = (0 if echo else n), n + len(generated)
            out_tokens.append(self.tokens[i, start:end].tolist())
            if self.logprobs:
                out_logprobs.append(self.token_logprobs[i, start:end].tolist())
        return out_tokens, (out_logprobs if self.logprobs else None)

    def texts(self, echo: bool) -> list[str]:
        """Per row, the completion's text (cut at a stop string); with ``echo``, the text
        of prompt and completion decoded together (so spacing at the seam is right)."""
        decode = self.llama.tokenizer.decode
        tokens, _ = self.results(echo=False)
        texts = []
        for i, generated in enumerate(tokens):
            assembler = self.assemblers[i] if self.assemblers is not None else None
            if assembler is not None:
                assembler.finish()
            if not echo:
                texts.append(assembler.text if assembler is not None else decode(generated))
                continue
            prompt = self.tokens[i, : self.lens[i]].tolist()
            if assembler is None or not assembler.stopped:
                texts.append(decode(prompt + generated))
                continue
            full = decode(prompt + assembler.ids)
            after_prompt = len(decode(prompt))
            hits = [h for h in (full.find(s, after_prompt) for s in self.stop_strings) if h >= 0]
            texts.append(full[: min(hits)] if hits else decode(prompt + generated))
        return texts
