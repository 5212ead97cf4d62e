"""The server's command line: where to listen, where the engine core runs, and every keyword of `LLM` as a flag.

The engine flags are read off `LLM`'s signature (`max_num_seqs` → `--max-num-seqs`, a bool → `--x / --no-x`),
so the server takes exactly the offline engine's options, with the same defaults, and a keyword added to `LLM`
is a flag here without another edit. `engine_argv` goes the other way, for starting a server in a subprocess.

Where this lives in vLLM: `vllm/entrypoints/openai/cli_args.py` (`make_arg_parser`) and
`vllm/engine/arg_utils.py` (`EngineArgs.add_cli_args`, which also builds its flags from a dataclass's fields).
"""

import argparse
import inspect
import types
from typing import Any

from solutions.engine.core_client import ENGINE_CORE_KINDS
from solutions.llm import LLM
from solutions.model.loader import DEFAULT_MODEL


def engine_parameters() -> list[inspect.Parameter]:
    """`LLM`'s keywords, except `model` (the server's own flag)."""
    return [p for name, p in inspect.signature(LLM).parameters.items() if name != "model"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """`int` for `int` and for `int | None`."""
    if isinstance(annotation, types.UnionType):
        (kind,) = [arg for arg in annotation.__args__ if arg is not type(None)]
        return kind
    return annotation


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m solutions.serve", description="An OpenAI-compatible server (completions, chat, streaming)."
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{DEFAULT_MODEL} or a local Hugging Face folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--engine-core", choices=ENGINE_CORE_KINDS, default="process",
                        help="run the engine core in its own process, or in a thread of the server's")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    engine = parser.add_argument_group("engine", "LLM's keywords (see solutions/llm.py)")
    for p in engine_parameters():
        kind = _value_type(p.annotation)
        if kind is bool:
            engine.add_argument(_flag(p.name), action=argparse.BooleanOptionalAction, default=p.default)
        else:
            engine.add_argument(_flag(p.name), type=kind, default=p.default, help=f"default: {p.default}")
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags, as `LLM` keywords."""
    return {p.name: getattr(args, p.name) for p in engine_parameters()}


def engine_argv(llm_kwargs: dict[str, Any]) -> list[str]:
    """`LLM` keywords as command-line flags (unknown keywords raise ValueError naming them)."""
    known = {p.name for p in engine_parameters()}
    if unknown := sorted(set(llm_kwargs) - known):
        raise ValueError(f"unknown engine options {unknown}; the engine takes {sorted(known)}")
    argv = []
    for name, value in llm_kwargs.items():
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        elif value is not None:
            argv += [_flag(name), str(value)]
    return argv
