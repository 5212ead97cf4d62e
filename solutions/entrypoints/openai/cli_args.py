"""The server's command line: where to listen, and every engine option as a flag.

The engine flags are `AsyncEngineArgs.add_cli_args` (`max_num_seqs` → `--max-num-seqs`, a bool →
`--x / --no-x`), so the server takes exactly the offline engine's options, with the same defaults and checks,
plus `--engine-core` (the core in its own process, or a thread of the server's).

Where this lives in vLLM: `vllm/entrypoints/openai/cli_args.py` (`make_arg_parser`) and
`vllm/engine/arg_utils.py` (`AsyncEngineArgs.add_cli_args`).
"""

import argparse

from solutions.engine.arg_utils import AsyncEngineArgs


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m solutions.serve",
                                     description="An OpenAI-compatible server (completions, chat, streaming).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return AsyncEngineArgs.add_cli_args(parser)
