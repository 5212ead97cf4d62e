"""What a chapter's tests run against: the learner's notebook, the live kernel, the reference, or a mutant.

Tests ask `impl.rms_norm(...)`; `Implementation` hands back the chosen object and, for functions, wraps the
call so that an exception inside the learner's code is reported as that exercise's failure, with the input.
"""

import functools
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class ExerciseError(AssertionError):
    """An exercise could not be graded: it is not implemented, failed to load, or raised."""


def describe(value: Any) -> str:
    """A short, readable rendering of a test input or output for failure messages."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"tensor{tuple(shape)} {str(getattr(value, 'dtype', '')).replace('torch.', '')}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class Implementation:
    """A namespace of exercises: `impl.<name>` is the implementation under test."""

    def __init__(self, kind: str, objects: Mapping[str, Any], errors: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._objects = dict(objects)
        self._errors = dict(errors or {})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._errors:
            raise ExerciseError(f"exercise `{name}`: {self._errors[name]}")
        if name not in self._objects:
            raise ExerciseError(f"exercise `{name}` is not defined in the {self.kind} implementation")
        obj = self._objects[name]
        if inspect.isfunction(obj):
            return _reported(name, obj)
        if inspect.isclass(obj):
            return _reported_class(name, obj)
        return obj


def _reported(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, with its failures attributed to exercise `name` (for a coroutine function, those raised while it
    is awaited).

    A stub's NotImplementedError becomes an ExerciseError saying so. Any other exception keeps its type (a
    test may expect a ValueError) and gains a note naming the exercise and the input it failed on.
    """

    def attributed(error: Exception, args: tuple, kwargs: dict) -> Exception:
        if isinstance(error, NotImplementedError):
            return ExerciseError(f"exercise `{name}` is not implemented yet ({error or 'see its hint'})")
        if not isinstance(error, AssertionError) and not getattr(error, "_attributed", False):
            inputs = ", ".join([describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()])
            error.add_note(f"exercise `{name}` raised {type(error).__name__}\n  on input: ({inputs})")
            error._attributed = True  # nested exercise calls add no second note
        return error

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as error:
                reported = attributed(error, args, kwargs)
                if reported is error:
                    raise
                raise reported from None

        return call_async

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            reported = attributed(error, args, kwargs)
            if reported is error:
                raise
            raise reported from None

    return call


def _reported_class(name: str, cls: type) -> type:
    """A subclass of `cls` whose own methods report failures like `_reported` (instances stay `cls` instances)."""
    methods = {
        attr: _reported(f"{name}.{attr}", fn)
        for attr, fn in vars(cls).items()
        if inspect.isfunction(fn) and (not attr.startswith("_") or attr == "__init__")
    }
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **methods})


def _mutants_module(chapter: str) -> Any:
    path = ROOT / "tests" / "mutants" / f"ch{chapter[:2]}.py"
    spec = importlib.util.spec_from_file_location(f"mutants_ch{chapter[:2]}", path)
    if spec is None or spec.loader is None or not path.exists():
        raise ValueError(f"no mutants for chapter {chapter}: {path} is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_mutants(chapter: str) -> dict[str, dict[str, Any]]:
    """Plausible wrong implementations for a chapter, from tests/mutants/ch<NN>.py (`MUTANTS`)."""
    return _mutants_module(chapter).MUTANTS


def load_capstone_mutants(chapter: str) -> dict[str, str]:
    """exercise -> the name of one of its mutants that must make the chapter's capstone fail (`CAPSTONE_MUTANTS`)."""
    return getattr(_mutants_module(chapter), "CAPSTONE_MUTANTS", {})


def load_decisive(chapter: str) -> dict[str, list[str]]:
    """exercise -> the reference statements its question is about (`DECISIVE`, beside the mutants). They live on
    the grader's side because a learner reads the chapter's test file: no Hint 2, and nothing under chapters/, may
    show them (tests/test_hints.py)."""
    return getattr(_mutants_module(chapter), "DECISIVE", {})
