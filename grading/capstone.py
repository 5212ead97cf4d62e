"""Capstones: the learner's pieces, all of them, run together inside the reference engine on SmolLM2.

Each chapter grades its exercises one at a time; its capstone then runs them *together*, on the real model, and
holds the result to an oracle that owes nothing to this repository: the tokens Hugging Face `transformers`
produces. There is no second engine for this. `swap_in` puts each exercise object in place of the reference
object wherever a module of `solutions/`, `kernels/` or `benchmarks/` holds it as an attribute — the engine's
`Scheduler`, the scheduler module's `allocate_or_preempt`, the block manager's `BlockPool`, the Triton backend's kernels —
so the reference engine, unchanged, runs on the learner's parts, and on no reference part an exercise replaces.

    with swap_in(impl, REFERENCE) as mine:          # in a chapter's test file
        tokens = mine.generate_naive(model, CAPSTONE_PROMPTS[0], 8)
        expect_equal(tokens, smollm2_greedy(0, 8), inputs="...")

    with using_my_code("05_continuous_batching"):   # in a notebook: the cells you have run
        ...

The oracle is stored (`smollm2_oracle.json`, written by `python -m grading.capstone`) so that a capstone needs
no Hugging Face model load; `tests/test_capstone_oracle.py` recomputes it with `transformers` and requires the
same tokens, so it can never go stale.
"""

import contextlib
import dataclasses
import functools
import inspect
import json
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from grading.impl import Implementation
from grading.waits import run_bounded

ORACLE_PATH = Path(__file__).with_name("smollm2_oracle.json")
SWAPPED_PACKAGES = ("solutions", "kernels", "benchmarks")

# Texts of the capstone prompts: chat turns (they share the chat template's system prompt, a prefix that prefix
# caching finds) and plain text, from 6 to about 80 tokens.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then say which colour sunsets are and why they differ.",
    "List three primary colours.",
]
PLAIN_TEXTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. The dog",
    "def fibonacci(n):",
    "A paged KV cache splits the keys and values of every sequence into fixed-size blocks, so that memory is "
    "allocated on demand rather than reserved for the longest possible output. The block table of a sequence maps",
]
NUM_GREEDY_TOKENS = 32  # stored per prompt; a capstone takes a prefix (greedy continuations nest)
HF_BEAM_WIDTH = 3
HF_BEAM_TOKENS = 8
NUM_BEAM_PROMPTS = 2
CAPSTONE_SECONDS = 150  # a capstone's engine run: seconds on an idle machine; beyond this, something never returns


@functools.cache
def smollm2() -> tuple[Any, Any]:
    """(our `LlamaForCausalLM`, the tokenizer) of SmolLM2-135M-Instruct, loaded once per process."""
    from solutions.model.loader import load_model, load_tokenizer

    return load_model("smollm2-135m"), load_tokenizer("smollm2-135m")


def prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    """The capstone prompts as token ids: chat questions through the chat template, then the plain texts."""
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in CHAT_QUESTIONS
    ]
    texts = [chats[0], PLAIN_TEXTS[0], chats[1], PLAIN_TEXTS[1], chats[2], PLAIN_TEXTS[2], chats[3], PLAIN_TEXTS[3]]
    return [tokenizer.encode(text) for text in texts]


@functools.cache
def _oracle() -> dict[str, Any]:
    return json.loads(ORACLE_PATH.read_text())


# The prompts as token ids, from the stored oracle (empty only while `python -m grading.capstone` first writes it).
CAPSTONE_PROMPTS: list[list[int]] = [entry["prompt"] for entry in _oracle()["greedy"]] if ORACLE_PATH.exists() else []


def smollm2_greedy(index: int, max_tokens: int) -> list[int]:
    """Hugging Face's greedy tokens (EOS ignored) for `CAPSTONE_PROMPTS[index]`: the first `max_tokens` of them."""
    if not 0 < max_tokens <= NUM_GREEDY_TOKENS:
        raise ValueError(f"max_tokens must be in 1..{NUM_GREEDY_TOKENS} (the stored oracle's length), got {max_tokens}")
    return _oracle()["greedy"][index]["tokens"][:max_tokens]


def smollm2_beams(index: int) -> list[list[int]]:
    """Hugging Face's beam search for `CAPSTONE_PROMPTS[index]` (index < NUM_BEAM_PROMPTS): `HF_BEAM_WIDTH` beams
    of `HF_BEAM_TOKENS` generated tokens each (EOS ignored), best first."""
    if not 0 <= index < NUM_BEAM_PROMPTS:
        raise ValueError(f"index must be in 0..{NUM_BEAM_PROMPTS - 1} (prompts with stored beams), got {index}")
    return _oracle()["beams"][index]["beams"]


def generate_batch(engine: Any, requests: list[tuple[str | list[int], Any]]) -> list[Any]:
    """`LLM.generate` on an `LLMEngine`: every (prompt, SamplingParams) request in one batch, the finished
    `RequestOutput`s in request order (a capstone builds its engine itself, to run it inside `swap_in`)."""
    from solutions.sampling_params import RequestOutputKind

    def run() -> list[Any]:
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
        finished: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[str(i)] for i in range(len(requests))]

    return run_bounded(run, CAPSTONE_SECONDS, what="the capstone's engine (add_request, then step until done)",
                       likely="one of your pieces inside the engine loops or waits for ever (a scheduler loop that "
                       "never ends, a mask fill or kernel that never returns)")


# --- the swap ----------------------------------------------------------------------------------------------------


def _sites(reference: object) -> list[tuple[types.ModuleType, str]]:
    """Every (module, attribute) of the swapped packages that holds `reference`."""
    sites = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in SWAPPED_PACKAGES:
            continue
        for attr, value in list(vars(module).items()):
            if value is reference:
                sites.append((module, attr))
    return sites


@contextlib.contextmanager
def swap_in(parts: Implementation | Mapping[str, Any], reference: Mapping[str, Any]) -> Iterator[types.SimpleNamespace]:
    """Run the block with every exercise of `parts` in place of its reference object; yields the swapped objects.

    `parts` is the `impl` a chapter test grades (the notebook, a mutant, or the reference itself) or a namespace
    (a notebook's globals). Failures inside a swapped piece are reported against its exercise, as in the
    chapter's own tests. An exercise missing from `parts` raises ExerciseError before anything is swapped.
    Everything is put back on exit, whatever happens. (That a capstone really runs through every piece is proved
    per chapter by `CAPSTONE_MUTANTS`: one mutant of each exercise must make it fail.)
    """
    impl = parts if isinstance(parts, Implementation) else Implementation(
        "notebook kernel", {n: parts[n] for n in reference if n in parts}
    )
    swapped = {name: getattr(impl, name) for name in reference}  # raises if an exercise is missing
    patches = [(module, attr, reference[name], swapped[name]) for name in reference for module, attr in _sites(reference[name])]
    for module, attr, _, new in patches:
        setattr(module, attr, new)
    try:
        yield types.SimpleNamespace(**swapped)
    finally:
        for module, attr, old, _ in reversed(patches):
            setattr(module, attr, old)


@contextlib.contextmanager
def using_my_code(chapter: str, namespace: Mapping[str, Any] | None = None) -> Iterator[types.SimpleNamespace]:
    """`swap_in` for a notebook: the exercises of `chapter` as the caller's globals define them."""
    from grading.notebooks import chapter_reference

    if namespace is None:
        namespace = inspect.currentframe().f_back.f_back.f_globals  # the caller of the `with` (past contextlib)
    with swap_in(namespace, chapter_reference(chapter)) as mine:
        yield mine


# --- writing the oracle ------------------------------------------------------------------------------------------


def compute_oracle() -> dict[str, Any]:
    """Hugging Face's greedy tokens and beams for the capstone prompts, with each greedy step's top-2 margin."""
    import torch

    from grading.tiny_models import hf_model
    from solutions.model.loader import load_tokenizer, resolve_model

    folder = resolve_model("smollm2-135m")
    hf, tokenizer = hf_model(folder), load_tokenizer("smollm2-135m")
    greedy, beams = [], []
    with torch.inference_mode():
        for prompt in prompt_token_ids(tokenizer):
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0, output_scores=True, return_dict_in_generate=True,
            )
            top2 = [scores[0].topk(2).values for scores in out.scores]
            margins = [float(v[0] - v[1]) for v in top2]
            greedy.append({"prompt": prompt, "tokens": out.sequences[0, len(prompt):].tolist(), "min_margin": min(margins)})
        for entry in greedy[:NUM_BEAM_PROMPTS]:
            prompt = entry["prompt"]
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=HF_BEAM_TOKENS, num_beams=HF_BEAM_WIDTH,
                num_return_sequences=HF_BEAM_WIDTH, do_sample=False, early_stopping=True, eos_token_id=None,
                pad_token_id=0,
            )
            beams.append({"prompt": prompt, "beams": [row[len(prompt):] for row in out.tolist()]})
    return {"model": "smollm2-135m", "transformers_generate": "greedy and beam search, EOS ignored, fp32, eager attention",
            "greedy": greedy, "beams": beams}


def main() -> None:
    oracle = compute_oracle()
    ORACLE_PATH.write_text(json.dumps(oracle, indent=1) + "\n")
    for i, entry in enumerate(oracle["greedy"]):
        print(f"prompt {i}: {len(entry['prompt'])} tokens, min top-2 margin {entry['min_margin']:.3f}")
    print(f"wrote {ORACLE_PATH}")


if __name__ == "__main__":
    main()
