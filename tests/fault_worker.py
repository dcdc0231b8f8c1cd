"""Worker for fault tests: ranks that die, hang or fail while others generate.

Usage: torchrun ... tests/fault_worker.py MODE CKPT TOKENIZER OUT_DIR
MODE: die (rank 1 is SIGKILLed mid-generation), hang (rank 1 stops answering
mid-generation), fail_build (rank 1 raises during build), run (everyone generates
until interrupted), slow_load (rank 1 reads its shards SLOW_LOAD_S seconds late, then
all ranks exit after building; "3,90" builds twice, late by each in turn; the ranks meet
in torchrun's store before they build, so that
a short LLAMA_CONTROL_TIMEOUT_S, which bounds joining the process group too, times the
loading wait alone however far apart a loaded machine starts them).  Each rank writes
OUT_DIR/rank{R}.pid when generation starts, and rank 0 writes OUT_DIR/error.txt with the exception that ended it.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

from llama import Llama


def main(mode: str, ckpt: str, tokenizer: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    out = Path(out_dir)
    if mode == "fail_build" and rank == 1:
        tokenizer = str(out / "no-such-tokenizer.model")
    if mode == "slow_load":
        _meet_before_joining(rank)
        # SLOW_LOAD_S: one delay, or several ("3,90"): one build per delay, in turn, each rank
        # saying "rank R built I" on standard error when its build I is done.
        for i, delay in enumerate(os.environ["SLOW_LOAD_S"].split(",")):
            if rank == 1:
                _delay_loading(float(delay))
            Llama.build(ckpt, tokenizer, max_seq_len=512, max_batch_size=2, device="cpu")
            print(f"rank {rank} built {i}", file=sys.stderr, flush=True)
        return
    llama = Llama.build(ckpt, tokenizer, max_seq_len=512, max_batch_size=2, device="cpu")
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1 and mode == "die":
        # half a second into generation (both ranks are generating by then; the 2 s it was were only waiting)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    if rank == 1 and mode == "hang":
        time.sleep(2.0)
        time.sleep(3600)  # alive but never joins another collective
    try:
        while True:
            llama.generate([[1, 2, 3]], max_gen_len=500, temperature=0.8)
    except Exception as e:
        if rank == 0:
            (out / "error.txt").write_text(f"{time.time()}\n{type(e).__name__}: {e}")
        raise


def _meet_before_joining(rank: int) -> None:
    """Wait (up to 120 s) until every rank has started, in the key-value store torchrun's agent
    runs for its workers."""
    import datetime

    import torch.distributed as dist

    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    store.set(f"test/started/{rank}", "1")
    store.wait([f"test/started/{r}" for r in range(world_size)])


def _delay_loading(seconds: float) -> None:
    """Sleep before reading the first shard once the process group exists (so the
    other ranks wait in the barrier after loading, not in the rendezvous)."""
    import torch.distributed as dist

    import llama.checkpoint.shards

    open_shard = getattr(llama.checkpoint.shards, "_unpatched_open_shard", llama.checkpoint.shards.open_shard)
    llama.checkpoint.shards._unpatched_open_shard = open_shard  # type: ignore[attr-defined]

    def slow_open_shard(path):
        if dist.is_initialized():
            time.sleep(seconds)
        return open_shard(path)

    llama.checkpoint.shards.open_shard = slow_open_shard


if __name__ == "__main__":
    main(*sys.argv[1:5])
