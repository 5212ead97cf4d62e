"""Command line: `python -m solutions.serve --model smollm2-135m --port 8000` — an OpenAI-compatible server.

    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Once upon a time", "max_tokens": 32, "stream": true}'

Every engine option (`EngineArgs`) is a flag (`--max-num-seqs 32`, `--num-kv-blocks 256`, `--no-enable-prefix-caching`);
`--engine-core thread` runs the engine core in a thread instead of its own process. Ctrl-C or SIGTERM stops the
server cleanly: open requests finish (for up to 5 s), then the engine core process exits.

Where this lives in vLLM: `vllm serve` (`vllm/entrypoints/cli/serve.py`).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> None:
    from solutions.engine.arg_utils import AsyncEngineArgs
    from solutions.entrypoints.openai.api_server import run_server
    from solutions.entrypoints.openai.cli_args import make_arg_parser
    from solutions.exceptions import ParameterError

    parser = make_arg_parser()
    args = parser.parse_args(argv)
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except ParameterError as error:  # a bad option: its flag and why, as argparse says it (exit status 2)
        parser.error(f"--{error.parameter.replace('_', '-')}: {error}")
    run_server(engine_args, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
