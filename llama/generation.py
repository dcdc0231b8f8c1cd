"""Loading a checkpoint (``Llama.build``) and the generation loop.

One loop serves Llama 2 and Llama 3.x: the family only decides which tokenizer
and chat format :meth:`Llama.build` picks from the files.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import List, Optional, Sequence, TypedDict, Union

import torch
import torch.nn.functional as F

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
from .model import Transformer
from .sampling import sample_next_token
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
    need = weights + cache
    available = distributed.available_memory(device)
    logger.debug("memory per rank: weights %.2f GiB + KV cache %.2f GiB", weights / 2**30, cache / 2**30)
    if available is not None and need > available:
        gib = 2**30
        raise RuntimeError(
            f"not enough memory on {device}: this rank needs {need / gib:.2f} GiB "
            f"(weights {weights / gib:.2f} GiB + KV cache {cache / gib:.2f} GiB for max_batch_size="
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
    ) -> "Llama":
        """Load a Meta-format checkpoint on this process's share of the model.

        Run one process per model-parallel rank (``torchrun --nproc_per_node N``) or a
        plain ``python`` process for one rank.

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
        """
        start = time.perf_counter()
        _positive_int("max_seq_len", max_seq_len)
        _positive_int("max_batch_size", max_batch_size)
        if model_parallel_size is not None:
            _positive_int("model_parallel_size", model_parallel_size)
        device = distributed.resolve_device(device)
        dtype = distributed.resolve_dtype(dtype, device)
        ckpt_dir = Path(ckpt_dir)
        params_path = ckpt_dir / "params.json"
        # Check the files before joining the process group: a typo should fail fast.
        shards = find_shards(ckpt_dir)
        tokenizer = load_tokenizer(tokenizer_path)
        args = ModelArgs.from_json(params_path, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
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
        model.setup_caches(device, dtype)
        model.eval()
        distributed.wait_for_all_ranks()  # ranks finish loading at their own pace
        logger.info(
            "loaded %s (%d shard(s)) as rank %d/%d on %s in %s, %.1f s",
            ckpt_dir, info.n_shards, rank, world_size, device, dtype, time.perf_counter() - start,
        )
        return Llama(model, tokenizer, seed=seed)

    def __init__(self, model: Transformer, tokenizer: Tokenizer, seed: int = 1) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.formatter: ChatFormat = chat_format_for(tokenizer)
        self.generator = torch.Generator(device=model.device).manual_seed(seed)

    @property
    def max_seq_len(self) -> int:
        return self.model.params.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.model.params.max_batch_size

    # -- argument checks, all before any compute ---------------------------------------

    def _check_sampling(self, temperature: float, top_p: float, max_gen_len: Optional[int]) -> None:
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not temperature >= 0 or temperature == float("inf"):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if max_gen_len is not None:
            if isinstance(max_gen_len, bool) or not isinstance(max_gen_len, int):
                raise TypeError(f"max_gen_len must be an int or None, got {type(max_gen_len).__name__}")
            if not 0 <= max_gen_len < self.max_seq_len:
                raise ValueError(f"max_gen_len must be in [0, {self.max_seq_len - 1}] (max_seq_len - 1), got {max_gen_len}")

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

    # -- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompt_tokens: List[List[int]],
        max_gen_len: int,
        temperature: float = 0.6,
        top_p: float = 0.9,
        logprobs: bool = False,
        echo: bool = False,
    ) -> tuple[List[List[int]], Optional[List[List[float]]]]:
        """Continue each prompt by up to ``max_gen_len`` tokens.

        Every prompt is processed in one forward pass (however their lengths differ),
        then all rows decode together; a row ends at its first stop token (not
        returned) or when it reaches ``max_gen_len`` new tokens or ``max_seq_len``.

        Returns (tokens, logprobs): per prompt the new tokens (with ``echo``, the
        prompt followed by them) and, with ``logprobs``, the log-probability of each
        returned token given those before it (the first prompt token has none: 0.0).
        """
        self._check_sampling(temperature, top_p, max_gen_len)
        if not isinstance(max_gen_len, int):
            raise TypeError("max_gen_len must be an int")
        prompts = self._check_prompt_tokens(prompt_tokens)
        if not prompts:
            return [], ([] if logprobs else None)
        with distributed.explain_peer_failures(), torch.inference_mode():
            return self._generate(prompts, max_gen_len, temperature, top_p, logprobs, echo)

    def _generate(
        self, prompts: list[list[int]], max_gen_len: int, temperature: float, top_p: float, logprobs: bool, echo: bool
    ) -> tuple[List[List[int]], Optional[List[List[float]]]]:
        model, device = self.model, self.model.device
        bsz = len(prompts)
        lens = [len(p) for p in prompts]
        budgets = [min(max_gen_len, self.max_seq_len - n) for n in lens]  # new tokens allowed per row
        max_prompt = max(lens)
        total_len = max(n + b for n, b in zip(lens, budgets))

        tokens = torch.zeros((bsz, total_len), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        token_logprobs = torch.zeros((bsz, total_len), dtype=torch.float32, device=device) if logprobs else None
        lens_t = torch.tensor(lens, device=device)
        rows = torch.arange(bsz, device=device)

        # Prefill: all prompts at once, right-padded.  Each row's tokens sit at their
        # true positions 0..len-1; a row never attends past its own position, so the
        # padding after a short prompt is never seen (and is overwritten by decoding).
        positions = torch.arange(max_prompt, device=device).expand(bsz, max_prompt)
        hidden = model.hidden_states(tokens[:, :max_prompt], positions, kv_len=max_prompt)
        if logprobs and (echo or max_gen_len == 0):
            self._score_prompts(hidden, tokens, token_logprobs, lens)
        next_logits = model.logits(hidden[rows, lens_t - 1])  # (B, V)

        stop_tokens = torch.tensor(sorted(self.tokenizer.stop_tokens), device=device)
        budgets_t = torch.tensor(budgets, device=device)
        n_new = torch.zeros(bsz, dtype=torch.long, device=device)  # tokens generated per row
        done = budgets_t == 0
        for step in range(max(budgets)):
            next_token = sample_next_token(next_logits, temperature, top_p, generator=self.generator)
            next_token = distributed.broadcast_from_first_rank(next_token)
            write_at = lens_t + step
            active = ~done
            # Finished rows keep what they have (no boolean indexing: no host sync).
            slot = torch.clamp(write_at, max=total_len - 1)
            tokens[rows, slot] = torch.where(active, next_token, tokens[rows, slot])
            if logprobs:
                lp = torch.log_softmax(next_logits, dim=-1).gather(-1, next_token.unsqueeze(-1)).squeeze(-1)
                token_logprobs[rows, slot] = torch.where(active, lp, token_logprobs[rows, slot])
            n_new += active.long()
            done |= torch.isin(next_token, stop_tokens) | (n_new >= budgets_t)
            if bool(done.all()):
                break
            # Feed the new token at its position; finished rows idle at a valid slot.
            feed_at = torch.clamp(write_at, max=self.max_seq_len - 1).unsqueeze(1)
            kv_len = min(max_prompt + step, self.max_seq_len - 1) + 1
            hidden = model.hidden_states(next_token.unsqueeze(1), feed_at, kv_len=kv_len)
            next_logits = model.logits(hidden[:, -1])

        out_tokens, out_logprobs = [], []
        for i, n in enumerate(lens):
            generated = tokens[i, n : n + int(n_new[i])].tolist()
            for j, t in enumerate(generated):
                if t in self.tokenizer.stop_tokens:
                    generated = generated[:j]
                    break
            end = n + len(generated)
            start = 0 if echo else n
            out_tokens.append(tokens[i, start:end].tolist())
            if logprobs:
                out_logprobs.append(token_logprobs[i, start:end].tolist())
        return out_tokens, (out_logprobs if logprobs else None)

    def _score_prompts(
        self, hidden: torch.Tensor, tokens: torch.Tensor, token_logprobs: torch.Tensor, lens: list[int], chunk: int = 256
    ) -> None:
        """Log-probability of each prompt token given the ones before it, into
        ``token_logprobs[:, 1:len]``.  Logits are made ``chunk`` positions at a time
        to bound memory (each position is a vocabulary-wide float32 row)."""
        seqlen = hidden.shape[1]
        for start in range(0, seqlen - 1, chunk):
            end = min(start + chunk, seqlen - 1)
            log_probs = torch.log_softmax(self.model.logits(hidden[:, start:end]), dim=-1)  # predicts start+1..end
            targets = tokens[:, start + 1 : end + 1]
            token_logprobs[:, start + 1 : end + 1] = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        for i, n in enumerate(lens):
            token_logprobs[i, n:] = 0.0  # padding past the prompt (generation overwrites what it uses)

    def text_completion(
        self,
        prompts: List[str],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
        echo: bool = False,
    ) -> List[CompletionPrediction]:
        """Complete each text prompt (BOS is prepended).

        ``max_gen_len`` None: up to ``max_seq_len - 1`` tokens.  Returns one dict per
        prompt: ``generation`` (text), and with ``logprobs`` also ``tokens`` (each token's
        text) and ``logprobs``.
        """
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts must be a list of str")
        self._check_sampling(temperature, top_p, max_gen_len)
        if max_gen_len is None:
            max_gen_len = self.max_seq_len - 1
        prompt_tokens = [self.tokenizer.encode(x, bos=True, eos=False) for x in prompts]
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens, max_gen_len, temperature=temperature, top_p=top_p, logprobs=logprobs, echo=echo
        )
        return [self._prediction(self.tokenizer.decode(t), t, generation_logprobs, i) for i, t in enumerate(generation_tokens)]

    def chat_completion(
        self,
        dialogs: List[Dialog],
        temperature: float = 0.6,
        top_p: float = 0.9,
        max_gen_len: Optional[int] = None,
        logprobs: bool = False,
    ) -> List[ChatPrediction]:
        """The assistant's reply to each dialog.

        A dialog is a list of ``{"role", "content"}`` messages: an optional system
        message, then user and assistant in turn, ending with user.  Returns one dict
        per dialog: ``generation`` = ``{"role": "assistant", "content": ...}``, and with
        ``logprobs`` also ``tokens`` and ``logprobs``.
        """
        if not isinstance(dialogs, (list, tuple)):
            raise TypeError(f"dialogs must be a list of dialogs, got {type(dialogs).__name__}")
        self._check_sampling(temperature, top_p, max_gen_len)
        if max_gen_len is None:
            max_gen_len = self.max_seq_len - 1
        prompt_tokens = []
        for i, dialog in enumerate(dialogs):
            try:
                prompt_tokens.append(self.formatter.encode_dialog_prompt(dialog))
            except (ValueError, TypeError) as e:
                raise type(e)(f"dialog {i}: {e}") from None
        generation_tokens, generation_logprobs = self.generate(
            prompt_tokens, max_gen_len, temperature=temperature, top_p=top_p, logprobs=logprobs
        )
        return [
            self._prediction({"role": "assistant", "content": self.tokenizer.decode(t)}, t, generation_logprobs, i)
            for i, t in enumerate(generation_tokens)
        ]

    def _prediction(self, generation, tokens: List[int], logprobs: Optional[List[List[float]]], i: int) -> dict:
        if logprobs is None:
            return {"generation": generation}
        return {
            "generation": generation,
            "tokens": [self.tokenizer.decode([x]) for x in tokens],
            "logprobs": logprobs[i],
        }
