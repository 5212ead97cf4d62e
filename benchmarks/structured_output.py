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
"""

import argparse
import json
import statistics
import time
from pathlib import Path

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
    args = parser.parse_args()
    result = run()
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()
