"""The tensor-parallel group of this process, and the two collectives the model uses.

Every rank runs the same forward pass on its slice of the weights; an all-reduce sums a row-parallel layer's
partial outputs, and an all-gather joins the vocabulary slices' logits (the step itself reaches the ranks through
their pipes, `solutions/executor/worker_proc.py`). gloo runs them on the CPU, NCCL on GPUs. A gloo collective
returns once every rank has called it, so a dead rank would leave the others waiting forever: the group is made
with a timeout (`COLLECTIVE_TIMEOUT_SECONDS`, read then, so a test may shorten it) and a collective that does not
complete within it raises.

Where this lives in vLLM: `vllm/distributed/parallel_state.py` (`init_distributed_environment`,
`GroupCoordinator`) and `vllm/distributed/communication_op.py` (`tensor_model_parallel_all_reduce`, ...).
"""

import datetime
import socket

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_SECONDS = 60.0  # a step never takes this long here; a peer that is silent this long is dead


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now: where rank 0 meets the others (`tcp://...:port`)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, timeout: float = COLLECTIVE_TIMEOUT_SECONDS, device: str = "cpu"
) -> None:
    """Join the group of `world_size` ranks at `init_method` (e.g. "tcp://127.0.0.1:29500") as `rank`: gloo for
    tensors on the CPU, NCCL for tensors on GPUs (`device="cuda"`)."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the sum."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Join each rank's (..., sizes[rank]) slice along the last dimension (..., sum(sizes)), on every rank.
    gloo gathers equal shapes only: each slice is padded to the largest, and the padding cut off again."""
    if tp_size() == 1:
        return x
    width = max(sizes)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[..., :size] for part, size in zip(parts, sizes, strict=True)], dim=-1)
