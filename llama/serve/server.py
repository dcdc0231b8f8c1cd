"""Running the server under torchrun: the listening socket, every rank's engine loop,
signals and the command line (``llama-serve``, ``python -m llama.serve``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from llama.cli.examples import DEMO_DIR
from llama.cli.flags import add_model_flags, model_options
from llama.formats.tool_calls import TOOL_PROMPT_FORMATS
from llama.images.prompt import DEFAULT_MAX_PIXELS
from llama.serve import limits, logs
from llama.serve.limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGES_PER_REQUEST, MediaLimits, ServerLimits
from llama.serve.page import GENERIC_SUGGESTIONS, chat_suggestions
from llama.serve.protocols import ServedModel
from llama.serve.shutdown import Shutdown

logger = logging.getLogger(__name__)

# --engine_process's default, as --help and docs/serving.md say it (measurements: BENCHMARKS.md).
ENGINE_PROCESS_RULE = "on for CUDA, off on the CPU"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a busy port fails at once.

    ``RuntimeError`` says which flag to change: ``--port`` for a port in use or one
    that needs privileges, ``--host`` for a name that does not resolve or an address
    this machine does not have."""
    import errno

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be a port number from 1 to 65535 (or 0: any free port), got {port!r}")
    where = f"cannot listen on {host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on accepted sockets whose protocol says TCP;
    # without it every small write (a streamed token) could wait up to 40 ms (Nagle + delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (socket.gaierror, UnicodeError) as e:  # a name the resolver does not know, or not a name at all
        sock.close()
        reason = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
        raise RuntimeError(f"{where}: --host {host} does not resolve to an address ({reason}): check --host") from None
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            advice = "another program is listening there: pick another --port"
        elif e.errno == errno.EACCES:
            advice = "ports below 1024 need privileges: pick another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            advice = (f"{host} is not an address of this machine: check --host (127.0.0.1: this machine only; "
                      "0.0.0.0: all its addresses)")
        else:
            advice = "check --host and --port"
        raise RuntimeError(f"{where} ({e.strerror}): {advice}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(llama: ServedModel, sock: Optional[socket.socket], model_name: str, max_queue: Optional[int] = None, *,
          api_keys: Sequence[str] = (), shared_prefix_cache: bool = False,
          limits: ServerLimits = ServerLimits(), tool_prompt_format: Optional[str] = None,
          chat_suggestions: Sequence[str] = GENERIC_SUGGESTIONS, media: Optional[MediaLimits] = None,
          request_timeout_s: Optional[float] = None) -> int:
    """Run the engine on this rank's main thread until SIGTERM/SIGINT or a failure; the rank given
    ``sock`` also answers HTTP on it (``max_queue``, ``api_keys``, ``shared_prefix_cache``, ``tool_prompt_format``,
    ``chat_suggestions``, ``media``, ``request_timeout_s``:
    :func:`~llama.serve.app.create_app`'s; ``limits``: what one client may cost the others).
    Returns the exit status (0 after a signal, 1 after a failure)."""
    import uvicorn

    engine = llama.engine
    stop = threading.Event()
    failed = threading.Event()
    server = http_thread = app = None
    repeats = logs.install()  # every rank: a flood of one message is logged once per interval
    if sock is not None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from llama.serve.app import create_app
        from llama.serve.connections import ACCEPT_BACKLOG, ACCEPT_BURSTS, connection_budget, guarded_protocol

        app = create_app(llama, model_name, max_queue=max_queue, api_keys=api_keys,
                         shared_prefix_cache=shared_prefix_cache, max_request_bytes=limits.max_request_bytes,
                         tool_prompt_format=tool_prompt_format,
                         chat_suggestions=chat_suggestions, media=media, request_timeout_s=request_timeout_s)
        max_connections = connection_budget(limits.max_connections)
        config = uvicorn.Config(
            app, lifespan="off", timeout_graceful_shutdown=5,
            http=guarded_protocol(AutoHTTPProtocol, max_connections=max_connections,
                                  header_timeout_s=limits.header_timeout_s),
            # A backstop: the connection cap keeps connections (and so requests) below it, but for
            # the bursts accepted before idle ones are closed.  Past it uvicorn answers 503 itself.
            limit_concurrency=max_connections + ACCEPT_BURSTS * ACCEPT_BACKLOG, backlog=ACCEPT_BACKLOG,
            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
            # uvicorn's messages go to the root logger's handlers, as ours do (and get the RepeatFilter)
            log_config=None, log_level="warning",
        )
        server = uvicorn.Server(config)

        def run_http() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException:
                logger.exception("the HTTP server failed")
            if not stop.is_set():  # the server ended without being asked: stop the job
                failed.set()
                stop.set()

        http_thread = threading.Thread(target=run_http, name="http", daemon=True)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d (chat page at /, OpenAI API under /v1)", model_name, host, port)

    from llama.runtime.host import freeze_startup_heap

    frozen = freeze_startup_heap()  # the model, tokenizer and app made above: no full collection walks them
    logger.info("%d objects made at start-up are kept out of garbage collection", frozen)
    shutdown = Shutdown(engine, stop, app=app, http=server, grace_s=limits.shutdown_grace_s)
    # Under torchrun, Ctrl-C at the terminal reaches torchrun's agent, which prints a
    # SignalException traceback: the first rank reads it as a key instead and shuts the job
    # down itself (every rank exits 0).  Before shutdown.install, so that its handlers win.
    terminal = _ctrl_c_as_a_key(shutdown) if sock is not None else None
    shutdown.install()
    if http_thread is not None:
        http_thread.start()
    code = 0
    try:
        engine.run_forever(stop)
    except BaseException as e:  # a failed step: a rank died, a collective timed out
        logger.error("the engine stopped on an error, exiting: %s", e)
        code = 1
        shutdown.begin("the engine failed", grace_s=0)
    if failed.is_set():
        code = 1
    if http_thread is not None:
        http_thread.join(timeout=10)
    logs.uninstall(repeats)
    if terminal is not None:
        terminal.close()
    return code


def _ctrl_c_as_a_key(shutdown: Shutdown):
    """Under torchrun with a terminal on standard input, Ctrl-C read as a key that begins the
    shutdown (:func:`llama.cli.terminal.watch_ctrl_c`); None elsewhere (Ctrl-C stays SIGINT,
    which :class:`Shutdown` handles)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import signal

    from llama.cli.terminal import watch_ctrl_c

    return watch_ctrl_c(lambda: shutdown.on_signal(signal.SIGINT))


# The flags of ServerLimits' fields (the reasons for each default are in llama/serve/limits.py).
_LIMIT_HELP = {
    "max_request_bytes": "largest request body; a larger one gets 413 before it is read (default %(default)s = 4 MiB)",
    "max_connections": "most open connections; past it, the one idle longest is closed (default %(default)s)",
    "header_timeout_s": "seconds a connection may take to send a request's headers (default %(default)s)",
    "keep_alive_s": "seconds an idle connection stays open; behind a load balancer, above its idle timeout "
                    "(default %(default)s)",
    "shutdown_grace_s": "on SIGTERM or Ctrl-C, seconds the requests in flight may take to finish; under torchrun "
                        "below 15 (default %(default)s)",
}


def _parser() -> argparse.ArgumentParser:
    from llama.cli.examples import MAX_SEQ_LEN_HELP
    from llama.cli.flags import (
        Parser,
        add_flag,
        device_name,
        fraction_below_one,
        non_negative_number,
        port,
        positive_int,
        positive_number,
    )

    p = Parser(  # a bad flag is one line, as in the other commands
        prog="llama-serve",
        description="Serve a Llama checkpoint over an OpenAI-compatible HTTP API "
        "(run it under torchrun for several model-parallel processes).",
        epilog=f"Per request: at most {limits.MAX_STOP_STRINGS} stop strings of at most "
               f"{limits.MAX_STOP_STRING_CHARS} characters each (OpenAI allows 4; they are checked after every "
               "token, inside the step every request waits for), and a body of at most --max_request_bytes.",
    )
    add_flag(p, "ckpt_dir", help="checkpoint directory: Meta's params.json + consolidated.NN.pth, or a "
             "Hugging Face folder (config.json + *.safetensors) (default: the bundled demo model)")
    add_flag(p, "tokenizer_path", help="tokenizer.model or tokenizer.json (default: the one in --ckpt_dir)")
    add_flag(p, "host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    add_flag(p, "port", type=port, default=8000,
             help="port to listen on, 1..65535, or 0 for any free one (default %(default)s)")
    add_flag(p, "max_batch_size", type=positive_int, default=8, metavar="N",
             help="requests decoded together at most (default %(default)s)")
    add_flag(p, "max_seq_len", type=positive_int, default=None, metavar="N",
             help=MAX_SEQ_LEN_HELP + " per request")
    add_flag(p, "kv_cache_tokens", type=positive_int, default=None, metavar="N",
             help="the paged KV cache's size in tokens, shared by all requests (each holds blocks for the "
                  "tokens it has; prompts that begin alike share their cached blocks); at least "
                  "--max_seq_len; default: --max_batch_size x --max_seq_len")
    add_flag(p, "kv_cache_memory", type=fraction_below_one, default=None, metavar="F",
             help="on CUDA, instead of --kv_cache_tokens: the share (0 < F < 1, e.g. 0.9) of the GPU's total "
                  "memory this server may fill, as vLLM's --gpu-memory-utilization: the KV cache gets what is "
                  "left once the weights, the largest prefill and decoding steps and the compiled steps' CUDA "
                  "graphs are counted, measured by running them at start (memory the CUDA context and other "
                  "processes hold is not counted, but the cache must fit in what is free) (default: none, "
                  "--kv_cache_tokens decides)")
    add_flag(p, "max_queue", type=positive_int, default=64, metavar="N",
             help="requests waiting to run before new ones get 429 (default %(default)s)")
    add_flag(p, "request_timeout_s", type=positive_number, default=None, metavar="S",
             help="seconds after which a request is ended, waiting or running, its KV-cache blocks freed "
                  "(504, code request_timeout); a request's \"timeout\" field may shorten it, not lengthen "
                  "it (default: none, only requests that give a timeout have one)")
    p.add_argument("--engine_process", "--engine-process", dest="engine_process",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="run HTTP, chat templates, tokenising and streaming in a process of their own, the engine "
                        "(scheduling and the model) in the first rank's, connected by a pipe "
                        "(llama.serve.engine_process), so that neither waits for the other's share of one "
                        "interpreter; --no-engine_process: one process (default: " + ENGINE_PROCESS_RULE + ")")
    add_flag(p, "data_parallel", type=positive_int, default=1, metavar="N",
             help="N engine replicas behind one API process (implies --engine_process), which sends each request "
                  "to the replica that already caches the longest prefix of its prompt, else to the least loaded; "
                  "without torchrun each replica is a process of its own with the whole model (started with these "
                  "flags; on the CPU each gets 1/N of the cores unless OMP_NUM_THREADS says); under torchrun "
                  "each is a model-parallel group of nproc / N consecutive ranks, whose first ranks must be on "
                  "rank 0's machine (default 1)")
    add_flag(p, "routing", choices=("prefix", "round_robin"), default="prefix",
             help="with --data_parallel: prefix (the replica caching the longest prefix, else the least loaded) or "
                  "round_robin (default %(default)s)")
    add_flag(p, "device", type=device_name, metavar="{cpu,cuda,cuda:N}",
             help="where the model runs (default: CUDA if available, else the CPU)")
    add_flag(p, "model_name", help="the model id clients name (default: the checkpoint directory's name)")
    add_flag(p, "lora", action="append", metavar="NAME=PATH", default=None,
             help="serve a LoRA adapter (a Hugging Face PEFT folder: adapter_config.json, "
                  "adapter_model.safetensors) unmerged, under the model id NAME: a request whose \"model\" is "
                  "NAME generates with it, the base's id without; repeat for several (rows of different "
                  "adapters decode together) (default: none)")
    add_flag(p, "max_loras", type=positive_int, default=None, metavar="N",
             help="with --lora: adapter slots (default: the number of --lora flags)")
    add_flag(p, "max_lora_rank", type=positive_int, default=None, metavar="R",
             help="with --lora: the largest rank an adapter may have (default: the largest given)")
    add_flag(p, "api_key", action="append", metavar="KEY",
             help="require 'Authorization: Bearer KEY' on every path but / (the chat page) and /health: "
                  "/v1/*, /metrics, /docs and /openapi.json among them; repeat for several keys (default: "
                  "the comma-separated keys in LLAMA_API_KEY, which must then name one; else none: anyone "
                  "may call)")
    add_flag(p, "shared_prefix_cache", action="store_true",
             help="let requests of different API keys reuse each other's cached prompt prefixes (faster for "
                  "a shared system prompt, but a client can then tell from timing whether another key's "
                  "prompt started the same way); default: each key its own")
    add_flag(p, "tool_prompt_format", choices=TOOL_PROMPT_FORMATS, default=None,
             help="how a chat request's tools are declared to the model and its calls written: json or "
                  "function_tag (Llama 3.1), python_list (Llama 3.2, 3.3, 4); default: the model's own "
                  "(json for Llama 3, python_list for Llama 4)")
    add_flag(p, "speculative", choices=("ngram", "draft"), default=None,
             help="speculative decoding: ngram (prompt lookup) proposes what followed the reply's last tokens "
                  "where they occurred before in the prompt or reply, and each decoding step checks those "
                  "proposals too, keeping what the model agrees with: the same tokens, faster where replies "
                  "quote their context and few requests decode at once; draft: a smaller model with the same "
                  "tokenizer (--draft_ckpt_dir) proposes instead, e.g. Llama 3.2 1B for Llama 3.1 8B "
                  "(default: off; a request turns it off with \"speculative\": false)")
    add_flag(p, "num_speculative_tokens", type=positive_int, default=None, metavar="N",
             help="with --speculative: most tokens a request proposes per step, 1..16 (default 4)")
    add_flag(p, "draft_ckpt_dir", default=None, metavar="DIR",
             help="the draft model's checkpoint (Meta's files or a Hugging Face folder, with the target's "
                  "tokenizer) for --speculative draft; loaded whole on every rank (see "
                  "--draft_tensor_parallel_size), with a KV cache as large as the target's (default: none)")
    add_flag(p, "draft_tensor_parallel_size", type=positive_int, default=None, metavar="N",
             help="with --speculative draft: 1 loads the draft whole on every rank; the number of ranks "
                  "(torchrun's processes) shards it over them as the target is (default 1)")
    for field in dataclasses.fields(limits.ServerLimits):
        kind: Callable[[str], float]
        if field.type == "int":
            kind, metavar = positive_int, "N"
        else:  # seconds; no grace period at all is a choice too
            kind, metavar = (non_negative_number if field.name == "shutdown_grace_s" else positive_number), "S"
        add_flag(p, field.name, type=kind, default=field.default, metavar=metavar,
                 help=_LIMIT_HELP[field.name])
    add_flag(p, "max_images_per_request", type=positive_int, default=DEFAULT_MAX_IMAGES_PER_REQUEST, metavar="N",
             help="most images one chat request may hold (default %(default)s)")
    add_flag(p, "max_image_bytes", type=positive_int, default=DEFAULT_MAX_IMAGE_BYTES, metavar="N",
             help="largest image file, in bytes (default %(default)s = 8 MiB; a data URI travels in the body, "
                  "base64-encoded, within --max_request_bytes)")
    add_flag(p, "max_image_pixels", type=positive_int, default=DEFAULT_MAX_PIXELS, metavar="N",
             help="largest image, width x height, refused before its pixels are decoded (default %(default)s = "
                  "32 Mi; Llama 4 sees at most 1344 x 1344 of it)")
    add_flag(p, "allowed_media_domains", default="", metavar="HOST[,HOST...]",
             help="hosts whose http(s) image URLs a chat request may name; the server fetches them (within 10 s "
                  "and --max_image_bytes, no redirects) (default: none, only data: URIs)")
    add_flag(p, "allowed_local_media_path", default=None, metavar="DIR",
             help="a folder whose files a chat request may name as images (file:///... or a path; resolved, "
                  "nothing outside it) (default: none)")
    add_model_flags(p)
    return p


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The limits on chat requests' images from the command line's flags (ValueError for a
    host list or folder that cannot be used)."""
    return MediaLimits(max_images_per_request=args.max_images_per_request, max_image_bytes=args.max_image_bytes,
                       max_image_pixels=args.max_image_pixels,
                       allowed_media_domains=tuple(d for d in args.allowed_media_domains.split(",") if d.strip()),
                       allowed_local_media_path=args.allowed_local_media_path)


def api_keys_from(flags: Optional[Sequence[str]], environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys ``--api_key`` gives, else those of ``LLAMA_API_KEY`` (comma-separated).
    A key must be non-empty printable ASCII without spaces or commas (it travels in a header).
    ``LLAMA_API_KEY`` set but naming no key (``""``, ``","``) is a ValueError, not an open server."""
    if flags:
        keys = list(flags)
    else:
        listed = environ.get("LLAMA_API_KEY")
        keys = [k.strip() for k in (listed or "").split(",") if k.strip()]
        if listed is not None and not keys:
            raise ValueError(f"LLAMA_API_KEY is set but names no key ({listed!r}): set it to one or more keys "
                             "separated by commas, or unset it to serve without keys")
    for key in keys:
        if not key or not key.isascii() or not key.isprintable() or any(c in key for c in " ,"):
            raise ValueError("an API key must be printable ASCII without spaces or commas (--api_key / LLAMA_API_KEY)")
    return keys


def speculative_options(args: argparse.Namespace) -> Optional[dict]:
    """``Llama.build``'s ``speculative`` from ``--speculative``, ``--num_speculative_tokens``,
    ``--draft_ckpt_dir`` and ``--draft_tensor_parallel_size``; ValueError for a combination that
    cannot be served."""
    draft_flags = ("draft_ckpt_dir", "draft_tensor_parallel_size")
    if args.speculative is None:
        given = [flag for flag in ("num_speculative_tokens", *draft_flags) if getattr(args, flag) is not None]
        if given:
            raise ValueError(f"--{given[0]} goes with --speculative: add --speculative "
                             f"{'draft' if given[0] in draft_flags else 'ngram'}")
        return None
    if args.speculative == "draft" and args.draft_ckpt_dir is None:
        raise ValueError("--speculative draft needs --draft_ckpt_dir: the draft model's checkpoint directory "
                         "(its tokenizer must be the target's)")
    for flag in draft_flags:
        if args.speculative != "draft" and getattr(args, flag) is not None:
            raise ValueError(f"--{flag} goes with --speculative draft, not --speculative {args.speculative}")
    if args.draft_ckpt_dir is not None and not Path(args.draft_ckpt_dir).is_dir():
        raise FileNotFoundError(f"draft checkpoint directory {args.draft_ckpt_dir} not found: check --draft_ckpt_dir")
    options: dict = {"method": args.speculative}
    if args.draft_ckpt_dir is not None:
        options["draft_ckpt_dir"] = args.draft_ckpt_dir
    if args.draft_tensor_parallel_size is not None:
        options["draft_tensor_parallel_size"] = args.draft_tensor_parallel_size
    if args.num_speculative_tokens is not None:
        options["num_tokens"] = args.num_speculative_tokens
    return options


def lora_options(args: argparse.Namespace) -> Optional[dict[str, str]]:
    """``Llama.build``'s ``lora_adapters`` from the ``--lora NAME=PATH`` flags (None: none);
    ValueError for a flag not of that form, a name given twice, or ``--max_loras`` /
    ``--max_lora_rank`` without ``--lora``; FileNotFoundError for a folder that is not there."""
    if not args.lora:
        for flag in ("max_loras", "max_lora_rank"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag} limits the adapters of --lora: add --lora NAME=PATH")
        return None
    adapters: dict[str, str] = {}
    for given in args.lora:
        name, sep, path = given.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {given!r}: give NAME=PATH, the model id requests use and the adapter's folder")
        if name in adapters:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        if not Path(path).is_dir():
            raise FileNotFoundError(f"LoRA adapter folder {path} not found: check --lora {given}")
        adapters[name] = path
    return adapters


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    api_keys = api_keys_from(args.api_key)
    speculative = speculative_options(args)
    adapters = lora_options(args)
    media = media_limits(args)
    from llama.cli.examples import check_device, is_first_rank, resolve_checkpoint, resolve_lengths, setup_logging

    setup_logging()
    # The files are checked before torch is imported (seconds), so that a mistyped path is told at once.
    if args.ckpt_dir and not Path(args.ckpt_dir).is_dir():
        raise FileNotFoundError(f"checkpoint directory {args.ckpt_dir} not found: check --ckpt_dir")
    if not args.ckpt_dir and not DEMO_DIR.is_dir():
        raise FileNotFoundError(f"the bundled demo model ({DEMO_DIR}) comes with a source checkout: pass --ckpt_dir")
    ckpt, tokenizer_path = resolve_checkpoint(args.ckpt_dir, args.tokenizer_path, DEMO_DIR)
    max_seq_len = resolve_lengths(args.ckpt_dir, args.max_seq_len)
    check_device(args.device)  # before the port is taken and the model loads
    from llama.serve.engine_process import REPLICA_FD_ENV

    replica_fd = os.environ.pop(REPLICA_FD_ENV, None)  # a replica another process started (--data_parallel)
    replicas: list = []
    replica_ends: list = []
    under_torchrun = False  # --data_parallel over torchrun's ranks (llama.runtime.distributed.plan_replicas)
    if args.data_parallel > 1 and replica_fd is None:
        from llama.runtime.distributed import plan_replicas, planned_world_size

        if args.engine_process is False:
            raise ValueError("--data_parallel needs the API process of --engine_process: drop --no-engine_process")
        if planned_world_size() > 1:
            try:
                plan_replicas(args.data_parallel)
            except ValueError as e:  # not a divisor of the ranks
                raise ValueError(f"--data_parallel {args.data_parallel}: {e}") from None
            under_torchrun = True
    if args.data_parallel > 1 and replica_fd is None and not under_torchrun:
        if "OMP_NUM_THREADS" not in os.environ:  # the same cores, shared
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.data_parallel))
        from llama.serve.engine_process import start_replicas

        replicas, replica_ends = start_replicas(args.data_parallel - 1, list(argv) if argv is not None
                                                else sys.argv[1:])
    sock = bind_socket(args.host, args.port) if is_first_rank() and replica_fd is None else None
    from llama.engine.build import build_engine

    loaded = build_engine(
        ckpt_dir=ckpt, tokenizer_path=tokenizer_path, max_seq_len=max_seq_len,
        max_batch_size=args.max_batch_size, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory=args.kv_cache_memory, speculative=speculative,
        lora_adapters=adapters, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        **model_options(args),
    )
    if not api_keys and is_first_rank():
        logger.warning("no API key set (--api_key or LLAMA_API_KEY): anyone who can reach %s:%d may use this "
                       "server and read /metrics", args.host, args.port)
    api_options = dict(model_name=args.model_name or ckpt.resolve().name, max_queue=args.max_queue,
                       api_keys=api_keys, shared_prefix_cache=args.shared_prefix_cache,
                       tool_prompt_format=args.tool_prompt_format,
                       chat_suggestions=chat_suggestions(ckpt), media=media, request_timeout_s=args.request_timeout_s,
                       limits=ServerLimits(max_request_bytes=args.max_request_bytes,
                                           max_connections=args.max_connections,
                                           header_timeout_s=args.header_timeout_s, keep_alive_s=args.keep_alive_s,
                                           shutdown_grace_s=args.shutdown_grace_s))
    if replica_fd is not None:
        from llama.serve.engine_process import serve_replica

        return serve_replica(loaded, int(replica_fd))
    if under_torchrun:
        from llama.serve.engine_process import join_replicas, serve_replica

        replica_ends, replica_conn = join_replicas(args.data_parallel)  # (every rank)
        if replica_conn is not None:  # another replica's first rank
            return serve_replica(loaded, replica_conn, grace_s=args.shutdown_grace_s)
    separate = default_engine_process(loaded.model.device) if args.engine_process is None else args.engine_process
    if (separate or replica_ends) and sock is not None:
        from llama.checkpoint.layout import find_tokenizer
        from llama.serve.engine_process import serve_with_api_process

        logger.info("the engine runs in this process, HTTP in an API process of its own (--engine_process)%s",
                    f", with {len(replica_ends)} more replica(s)" if replica_ends else "")
        return serve_with_api_process(loaded, sock, str(tokenizer_path or find_tokenizer(ckpt)), api_options,
                                      grace_s=args.shutdown_grace_s, replicas=replicas, replica_ends=replica_ends,
                                      routing=args.routing)
    return serve(loaded, sock, **api_options)



def default_engine_process(device) -> bool:
    """Whether the API runs in a process of its own by default on ``device``: on CUDA yes (a step
    loop that must launch kernels back to back should not share one interpreter's lock with
    HTTP, JSON and tokenising); on the CPU no (measured under load, BENCHMARKS.md: neither design
    faster outside the noise, and one process is the simpler: no second interpreter, no pickling)."""
    import torch

    return torch.device(device).type == "cuda"


def cli() -> None:
    """The ``llama-serve`` console script, run as the example scripts are
    (:func:`llama.cli.examples.run_script`): a bad flag, checkpoint or environment found before
    serving (build_engine's errors, as Llama.build's, a port in use) ends in one line ``llama-serve: error:
    ...`` and status 1, Ctrl-C while the model loads in one line and status 130."""
    from llama.cli.examples import run_script

    run_script("llama-serve", main)
