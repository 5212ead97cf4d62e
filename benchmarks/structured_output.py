"""What structured output costs per step: compiling a constraint, filling the token masks, applying them.

    python -m benchmarks.structured_output                     # the table (about 2 minutes on 2 cores)
    python -m benchmarks.structured_output --json --save chapters/08_structured_output/structured_output.json

Three measurements, SmolLM2-135M (vocabulary 49,152), one JSON schema of four fields (a person):
    compile   `StructuredOutputManager.grammar_init` of a schema never seen (cold: llguidance compiles it) and of
              one seen before (cached: a new matcher from the compiled grammar), median over 20 distinct schemas;
              and, once, wrapping the tokenizer (the first constrained request pays it)
    masks     at batch 1, 8 and 64: filling every row's mask (one after the other, as the engine's worker thread
              does) and applying the (B, V) mask to the logits, median over the positions of a real JSON output
    steps     the engine's step time (all stages) at the same batch sizes, greedy decode of B requests, median over
              decode steps, unconstrained and constrained: the difference is what the engine pays per step, with
              the fill overlapping the forward pass
If xgrammar is installed (`pip install xgrammar==0.2.8`; not a requirement), its compile and fill times are
measured beside llguidance's, which is how the course chose its backend.

    python -m benchmarks.structured_output --validity          # about 6 minutes on 2 cores

counts instead the valid outputs of 30 seeded samples at temperature 1 (max_tokens 120, the prompt "JSON:") for an
object, an array and a nested schema, each compiled three ways: with llguidance's flexible whitespace (any run in
every gap; this engine's default before issue 52), with the bounded default (`BOUNDED_WHITESPACE`), and with none
(as `disable_any_whitespace` compiles it). Valid: finished with "stop", parses, and validates against the schema.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from solutions import LLM, SamplingParams, StructuredOutputsParams
from solutions.structured_output import StructuredOutputManager
from solutions.structured_output.bitmask import allocate_token_bitmask, apply_token_bitmask

MODEL = "smollm2-135m"
BATCH_SIZES = (1, 8, 64)
PROMPT = "Describe a person as a JSON object:"
ANSWER = '{"name":"Alice Smith","age":31,"city":"Paris","vegan":false}'  # the output whose positions the masks walk


def person_schema(max_name_length: int = 12) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": max_name_length},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
            "vegan": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "vegan"],
        "additionalProperties": False,
    }


def string(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def closed_object(**properties: dict) -> dict:
    """An object with exactly these properties, in this order."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Bounded schemas (strings, arrays and numbers all have limits), so only whitespace can run a sample out of tokens.
VALIDITY_SCHEMAS = {
    "object": closed_object(name=string(12), age={"type": "integer", "minimum": 0, "maximum": 120}),
    "array": {"type": "array", "items": string(16), "minItems": 1, "maxItems": 4},
    "nested": closed_object(
        name=string(12),
        address=closed_object(city=string(12), zip={"type": "string", "pattern": "^[0-9]{5}$"}),
        tags={"type": "array", "items": string(8), "maxItems": 3},
    ),
}
# How each column compiles a schema: its own `x-guidance`, which wins over the engine's default (None: the default).
WHITESPACE = {"flexible": {"whitespace_flexible": True}, "bounded": None, "none": {"whitespace_flexible": False}}
VALIDITY_PROMPT, VALIDITY_SEEDS, VALIDITY_MAX_TOKENS = "JSON:", range(30), 120


def is_valid(output, schema: dict) -> bool:
    """Did the sample finish on its own with JSON that the schema accepts?"""
    try:
        jsonschema.validate(json.loads(output.text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return output.finish_reason == "stop"


def count_valid(llm: LLM, schema: dict, whitespace: dict | None) -> int:
    """Valid outputs of the seeded samples for `schema`, compiled with the `whitespace` options."""
    compiled = schema if whitespace is None else {**schema, "x-guidance": whitespace}
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=VALIDITY_MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(json=compiled))
        for seed in VALIDITY_SEEDS
    ]
    outputs = llm.generate([VALIDITY_PROMPT] * len(params), params, use_tqdm=False)
    return sum(is_valid(output.outputs[0], schema) for output in outputs)


def run_validity() -> dict:
    llm = LLM(MODEL, max_model_len=512, max_num_seqs=len(VALIDITY_SEEDS))
    counts = {name: {column: count_valid(llm, schema, whitespace) for column, whitespace in WHITESPACE.items()}
              for name, schema in VALIDITY_SCHEMAS.items()}
    return {"model": MODEL, "samples": len(VALIDITY_SEEDS), "valid": counts}


def validity_table(result: dict) -> str:
    total = result["samples"]
    lines = [f"{'schema':>8}" + "".join(f"{column + ' ws':>14}" for column in WHITESPACE)]
    for name, counts in result["valid"].items():
        lines.append(f"{name:>8}" + "".join(f"{f'{counts[column]}/{total}':>14}" for column in WHITESPACE))
    return "\n".join(lines)


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def measure_compile(manager: StructuredOutputManager) -> dict[str, float]:
    start = time.perf_counter()
    manager.backend  # wraps the tokenizer: once per engine
    tokenizer_seconds = time.perf_counter() - start
    cold, cached = [], []
    for length in range(20, 40):  # distinct schemas: each compiles once
        params = StructuredOutputsParams(json=person_schema(length))
        for times in (cold, cached):
            start = time.perf_counter()
            manager.grammar_init(params, 1)
            times.append(time.perf_counter() - start)
    return {"tokenizer": ms(tokenizer_seconds), "cold": ms(statistics.median(cold)), "cached": ms(statistics.median(cached))}


def measure_masks(manager: StructuredOutputManager, answer_ids: list[int], batch: int) -> dict[str, float]:
    grammars = manager.grammar_init(StructuredOutputsParams(json=person_schema()), batch)
    bitmask = allocate_token_bitmask(batch, manager.vocab_size)
    logits = torch.randn(batch, manager.vocab_size)
    fill, apply = [], []
    for token_id in answer_ids:
        start = time.perf_counter()
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        apply.append(time.perf_counter() - start)
        for grammar in grammars:
            assert grammar.accept_tokens([token_id])
    return {"fill_ms": ms(statistics.median(fill)), "apply_ms": ms(statistics.median(apply))}


def median_decode_step(llm: LLM, batch: int, constraint: StructuredOutputsParams | None) -> float:
    """Median seconds of the engine's decode-only steps for `batch` greedy requests."""
    engine = llm.llm_engine
    first = len(engine.stats.steps)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=constraint is None, structured_outputs=constraint)
    llm.generate([f"{PROMPT} (person {i})" for i in range(batch)], params, use_tqdm=False)
    steps = [s for s in engine.stats.steps[first:] if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch]
    return statistics.median(sum(s.seconds.values()) for s in steps)


def measure_xgrammar(tokenizer, vocab_size: int, answer_ids: list[int]) -> dict[str, float] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    cold = []
    for length in range(20, 40):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(person_schema(length)), any_whitespace=False, separators=(",", ":"))
        cold.append(time.perf_counter() - start)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    fill = []
    for token_id in answer_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fill.append(time.perf_counter() - start)
        assert matcher.accept_token(token_id)
    return {"cold_ms": ms(statistics.median(cold)), "fill_ms_per_request": ms(statistics.median(fill))}


def run() -> dict:
    llm = LLM(MODEL, max_model_len=512, max_num_seqs=max(BATCH_SIZES))
    config = llm.llm_engine.vllm_config.model_config  # the checkpoint's vocab_size and eos_token_id
    manager = StructuredOutputManager(llm.tokenizer, config.vocab_size, config.eos_token_id)
    answer_ids = llm.tokenizer.encode(ANSWER) + [config.eos_token_id]
    compile_ms = measure_compile(manager)
    constraint = StructuredOutputsParams(json=person_schema())
    rows = []
    for batch in BATCH_SIZES:
        masks = measure_masks(manager, answer_ids[:-1], batch)
        free = median_decode_step(llm, batch, None)
        constrained = median_decode_step(llm, batch, constraint)
        rows.append({"batch": batch, **masks, "step_ms": ms(free), "constrained_step_ms": ms(constrained)})
    return {
        "model": MODEL,
        "compile_ms": compile_ms,
        "rows": rows,
        "xgrammar": measure_xgrammar(llm.tokenizer, config.vocab_size, answer_ids[:-1]),
    }


def table(result: dict) -> str:
    c = result["compile_ms"]
    lines = [
        f"compile (llguidance): tokenizer {c['tokenizer']:.0f} ms once; a schema cold {c['cold']:.2f} ms, "
        f"cached {c['cached']:.3f} ms",
        f"{'batch':>5} {'fill ms':>9} {'apply ms':>9} {'step ms':>9} {'constrained step ms':>20} {'overhead':>9}",
    ]
    for r in result["rows"]:
        overhead = r["constrained_step_ms"] / r["step_ms"] - 1
        lines.append(f"{r['batch']:>5} {r['fill_ms']:>9.3f} {r['apply_ms']:>9.3f} {r['step_ms']:>9.1f} "
                     f"{r['constrained_step_ms']:>20.1f} {overhead:>+9.1%}")
    x = result["xgrammar"]
    lines.append("xgrammar: not installed (pip install xgrammar==0.2.8 to compare)" if x is None else
                 f"xgrammar: a schema cold {x['cold_ms']:.1f} ms; fill {x['fill_ms_per_request'] * 1e3:.1f} µs per request "
                 f"(llguidance: {result['rows'][0]['fill_ms'] * 1e3:.1f} µs)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--save", type=Path, help="also write the JSON object to this file")
    parser.add_argument("--validity", action="store_true", help="count valid seeded samples instead of timing")
    args = parser.parse_args()
    result = run_validity() if args.validity else run()
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else (validity_table if args.validity else table)(result))


if __name__ == "__main__":
    main()
