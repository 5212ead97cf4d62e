"""Assertions whose failure messages teach: what was tried, what the reference produced, what you produced."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from grading.impl import ExerciseError, describe


def _preview(t: torch.Tensor) -> str:
    flat = t.detach().flatten()[:6].tolist()
    return f"{describe(t)} starting {[round(x, 5) for x in flat]}"


def expect_close(got: Any, want: torch.Tensor, *, inputs: str, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """`got` must be a tensor of `want`'s shape whose values match within atol + rtol·|want|."""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"on input {inputs}: expected a tensor, got {describe(got)}")
    if got.shape != want.shape:
        raise AssertionError(
            f"on input {inputs}: shape {tuple(got.shape)}, but the reference produced shape {tuple(want.shape)}"
        )
    got_f, want_f = got.detach().float(), want.detach().float()
    if not torch.allclose(got_f, want_f, atol=atol, rtol=rtol, equal_nan=False):
        diff = (got_f - want_f).abs()
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"on input {inputs}:\n"
            f"  the reference produced {_preview(want)}\n"
            f"  you produced           {_preview(got)}\n"
            f"  largest difference {diff.max().item():.3g} at index {worst} (tolerance atol={atol}, rtol={rtol})"
        )


def expect_equal(got: Any, want: Any, *, inputs: str) -> None:
    """Exact equality (token ids, block tables, counts), with both sides in the message."""
    if got != want:
        raise AssertionError(
            f"on input {inputs}:\n  the reference produced {describe(want)}\n  you produced           {describe(got)}"
        )


@contextlib.contextmanager
def exercising(name: str, inputs: str) -> Iterator[None]:
    """Report an exception raised inside a class exercise (a stub, or a bug) as that exercise's failure."""
    try:
        yield
    except NotImplementedError as error:
        raise ExerciseError(f"exercise `{name}` is not implemented yet ({error or 'see its hint'})") from None
    except AssertionError:
        raise
    except Exception as error:
        raise ExerciseError(f"exercise `{name}` raised {type(error).__name__}: {error}\n  on input: {inputs}") from error


def expect_raises(error_type: type[Exception], action: Callable[[], object], *, inputs: str) -> None:
    """`action()` must raise `error_type` — and not `NotImplementedError`, which a stub raises (a RuntimeError)."""
    try:
        action()
    except NotImplementedError:
        raise  # `exercising` reports it as "not implemented yet"
    except error_type:  # the grader keeps a learner's exception type, so this sees the real error
        return
    raise AssertionError(f"on input {inputs}: expected {error_type.__name__}, but nothing was raised")
