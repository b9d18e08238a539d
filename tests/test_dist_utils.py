import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_ranks


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_allreduce(world):
    assert run_ranks(_allreduce, world, timeout=60) == [world * (world + 1) / 2] * world


def test_rank_traceback_surfaces():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_raise_on_one, 2, timeout=60)
