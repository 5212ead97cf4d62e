"""Run a function on every rank of a real tensor-parallel group, and bring each rank's result back.

    results = run_on_ranks(fn, 2, x)   # fn(rank, x) in 2 processes joined by gloo; [fn(0, x), fn(1, x)]

Chapter 9's layers call collectives, so they can only be judged inside a group. The ranks are forked from this
process, so they run whatever it runs (a notebook's cells, a grader's swapped-in exercise) without importing
anything again; each uses 1 torch thread, because GNU OpenMP's thread pool does not survive a fork. A rank that
raises is reported with its error, and one that waits forever on a collective its peers never join is stopped by
the group's timeout: a wrong layer fails, it does not hang. The message says which rank, and for a rank that gave no
result, which wait never returned and what usually causes it.

A rank sends its result back as plain pickled bytes. Put on a `multiprocessing.Queue` as it is, a tensor would
travel as a file descriptor that the parent fetches from the rank's process, and a rank that has already
exited (likely on a busy machine) leaves the parent with `ConnectionResetError` or `FileNotFoundError`.
"""

import multiprocessing
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from solutions.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel

COLLECTIVE_TIMEOUT_SECONDS = 20.0
OUT_OF_STEP = ("a rank waited in a collective that another rank never called (one all-reduces and another does not, "
               "or they call different collectives), until the group's timeout")


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world_size, init_method, timeout=COLLECTIVE_TIMEOUT_SECONDS)
        dist.barrier()  # every rank connected: one that finishes early cannot close a connection a peer still makes
        results.put((rank, True, pickle.dumps(fn(rank, *args))))  # bytes: nothing to fetch from this process later
    except BaseException as error:  # reported to the parent, which raises it
        results.put((rank, False, "".join(traceback.format_exception_only(error)).strip()))
    finally:
        destroy_tensor_parallel()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`[fn(rank, *args) for rank in range(world_size)]`, each call on its own rank of one gloo group; a rank's
    collective gives up after COLLECTIVE_TIMEOUT_SECONDS, and the parent after 30 s more."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=_rank_main, args=(fn, rank, world_size, init_method, args, results), daemon=True)
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    try:
        for _ in ranks:
            rank, ok, value = results.get(timeout=COLLECTIVE_TIMEOUT_SECONDS + 30)
            outcomes[rank] = (ok, value)
    except queue.Empty:
        pass
    finally:
        for process in ranks:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    errors = [f"rank {rank}: {value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
    silent = [rank for rank in range(world_size) if rank not in outcomes]
    if errors or silent:
        lost = [f"rank {rank}: no result within {COLLECTIVE_TIMEOUT_SECONDS + 30:g} s (the grader stopped waiting "
                "for it; it hung outside any collective, or died)" for rank in silent]
        likely = [f"Likely cause: {OUT_OF_STEP}"] if any("Timed out" in e for e in errors) else []
        raise AssertionError(f"on {world_size} ranks:\n  " + "\n  ".join(errors + lost + likely))
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
