"""The functional collectives of llama.layers.collectives, on a one-process gloo group."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from llama.layers.collectives import gather_dim0


@pytest.fixture
def one_rank_group(tmp_path):
    """This process's one-rank default group: the one an earlier test in this process left
    (``Llama.build`` joins one and keeps it for the process's life), or one made here."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield dist.group.WORLD
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_gather_warns_nothing(one_rank_group):
    """Our own gather calls no deprecated torch API: torch 2.13's ``all_gather_tensor`` warns
    (FutureWarning) at every eager call, printed under torchrun beside the answer."""
    x = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole = gather_dim0(x, one_rank_group)
    torch.testing.assert_close(torch.as_tensor(whole), x)  # one rank: the gather is the tensor itself
