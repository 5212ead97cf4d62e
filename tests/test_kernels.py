"""The Triton kernels against their PyTorch references: natively on a GPU when there is one, else in Triton's
interpreter on the CPU. Every kernel input is made on `grading.devices.DEVICE` (through `on_device`); the PyTorch
references run on CPU copies of the same inputs, so a GPU result is checked against an oracle computed apart.

Shapes are drawn at random (fixed seeds) over the grid that matters: ragged lengths (1, exact multiples of the
block size, partial last blocks), shuffled block tables whose unused entries point at real blocks full of
garbage, block sizes 16/32/64, GQA ratios 1/3/4/8, head dims 64/128, fp32/fp16/bf16.

An unmasked out-of-bounds load can segfault the interpreter. So every case that launches a kernel runs in a
worker process (this file run as a script); the worker reports each case as it finishes, and when it dies the
case it was running is reported as crashed and a fresh worker takes the remaining cases. One worker normally
serves the whole module.
"""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grading.devices import DEVICE

ROOT = Path(__file__).resolve().parents[1]

# Tolerances against the fp32 reference, per dtype: the output is rounded to the dtype once, at the end.
TOLERANCES = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}  # (atol, rtol)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# --- case generation (shared by the test process and the worker) ---------------------------------------------------


def on_device(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` where the kernels run: CUDA memory natively, CPU memory in the interpreter. Inputs are drawn
    on the CPU first (same seeds, same values on every machine), then moved."""
    return t.to(DEVICE)


def draw_lengths(rng: random.Random, num_seqs: int, block_size: int, max_len: int) -> list[int]:
    """Ragged lengths that always include 1, an exact block multiple and a partial last block."""
    special = [1, block_size * rng.randint(1, 2), block_size * rng.randint(1, 2) + rng.randint(1, block_size - 1)]
    lengths = special + [rng.randint(1, max_len) for _ in range(max(0, num_seqs - len(special)))]
    rng.shuffle(lengths)
    return lengths[:num_seqs]


def make_cases() -> list[dict[str, Any]]:
    rng = random.Random(2023)
    cases = []
    for i in range(8):
        cases.append(dict(kind="store", seed=i, block_size=rng.choice([16, 32, 64]), num_kv_heads=rng.choice([1, 2, 3]),
                          head_dim=rng.choice([64, 128]), dtype=list(DTYPES)[i % 3], num_tokens=rng.randint(1, 24)))
    grid = [(g, d, dt) for g in (1, 3, 4, 8) for d in (64, 128) for dt in DTYPES]  # 24 combinations
    for i, (group, head_dim, dtype) in enumerate(grid):
        block_size = [16, 32, 64][i % 3]
        common = dict(seed=100 + i, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype,
                      num_kv_heads=rng.choice([1, 2]), num_seqs=rng.randint(3, 4))
        cases.append(dict(kind="decode", num_splits=1, max_len=3 * block_size, **common))
        if i % 2 == 0:
            cases.append(dict(kind="decode", num_splits=rng.choice([2, 3, 4]), max_len=4 * block_size, **common))
        if i % 2 == 1:
            cases.append(dict(kind="unified", max_len=3 * block_size, **common))
    cases.append(dict(kind="decode", num_splits=1, seed=7, block_size=16, group=4, head_dim=64, dtype="float32",
                      num_kv_heads=2, num_seqs=3, max_len=80, score_scale=400.0))  # scores in the thousands
    cases.append(dict(kind="decode", num_splits=4, seed=8, block_size=16, group=4, head_dim=64, dtype="float32",
                      num_kv_heads=2, num_seqs=3, max_len=80, score_scale=400.0))
    cases.append(dict(kind="unified", seed=9, block_size=16, group=4, head_dim=64, dtype="float32",
                      num_kv_heads=2, num_seqs=3, max_len=80, score_scale=400.0))
    cases.append(dict(kind="decode_vs_unified", seed=10, block_size=32, group=3, head_dim=64, dtype="float32",
                      num_kv_heads=2, num_seqs=4, max_len=100))
    for name in ("llama-gqa", "qwen2-bias-mqa", "mistral-linear-rope"):
        cases.append(dict(kind="model", seed=0, model=name))
    cases.append(dict(kind="engine", seed=0))
    for case in cases:
        case["id"] = "-".join(f"{v}" for k, v in case.items() if k not in ("seed",))
    return cases


CASES = make_cases()


def paged_inputs(case: dict[str, Any], lengths: list[int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A cache full of random values, each sequence's blocks scattered over it in shuffled order, table rows
    padded to the longest with more real (garbage-holding) block ids."""
    dtype, bs, hkv, d = DTYPES[case["dtype"]], case["block_size"], case["num_kv_heads"], case["head_dim"]
    max_blocks = max(-(-n // bs) for n in lengths) + 1  # one spare column: never read
    num_blocks = len(lengths) * max_blocks + 3
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(lengths) * max_blocks].reshape(len(lengths), -1)
    return dict(key_cache=key_cache, value_cache=value_cache, block_tables=block_tables.to(torch.int32).contiguous(),
                seq_lens=torch.tensor(lengths, dtype=torch.int32))


def run_case(case: dict[str, Any]) -> str | None:
    """Run one case; None if it passed, else what went wrong."""
    import kernels

    if case["kind"] == "engine":
        return run_engine_case()
    if case["kind"] == "model":
        return run_model_case(case["model"])
    gen = torch.Generator().manual_seed(case["seed"])
    rng = random.Random(case["seed"])
    dtype = DTYPES[case["dtype"]]
    atol, rtol = TOLERANCES[case["dtype"]]
    if "score_scale" in case:  # scores in the thousands: fp32 rounding of a score moves exp() by ~1e-4
        atol, rtol = 1e-3, 1e-3  # still catches an overflow (inf/nan) or a wrong maximum by far
    if case["kind"] == "store":
        bs, hkv, d, t = case["block_size"], case["num_kv_heads"], case["head_dim"], case["num_tokens"]
        num_blocks = -(-t // bs) + 2
        key_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
        value_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
        slots[torch.rand(t, generator=gen) < 0.25] = -1  # padding tokens
        key = torch.randn(t, hkv, d, generator=gen).to(dtype)
        value = torch.randn(t, hkv, d, generator=gen).to(dtype)
        want_k, want_v = key_cache.clone(), value_cache.clone()
        kernels.store_kv_cache_reference(key, value, want_k, want_v, slots)
        got_k, got_v = on_device(key_cache), on_device(value_cache)
        kernels.store_kv_cache(on_device(key), on_device(value), got_k, got_v, on_device(slots))
        key_cache, value_cache = got_k.cpu(), got_v.cpu()
        if not (torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)):
            return f"store: the caches differ from the reference at {int((key_cache != want_k).any(-1).any(-1).sum())} slots"
        return None
    lengths = draw_lengths(rng, case["num_seqs"], case["block_size"], case["max_len"])
    inputs = paged_inputs(case, lengths, gen)
    num_heads = case["num_kv_heads"] * case["group"]
    scale = case["head_dim"] ** -0.5 * case.get("score_scale", 1.0)
    device_inputs = {name: on_device(t) for name, t in inputs.items()}
    if case["kind"] in ("decode", "decode_vs_unified"):
        query = torch.randn(len(lengths), num_heads, case["head_dim"], generator=gen).to(dtype)
        want = kernels.paged_decode_attention_reference(query, scale=scale, **inputs)
        if case["kind"] == "decode_vs_unified":
            query_start_loc = on_device(torch.arange(len(lengths) + 1, dtype=torch.int32))
            got = kernels.unified_attention(on_device(query), scale=scale, query_start_loc=query_start_loc,
                                            **device_inputs)
        else:
            got = kernels.paged_decode_attention(on_device(query), scale=scale, num_splits=case["num_splits"],
                                                 **device_inputs)
    else:
        query_lens = [rng.randint(1, n) for n in lengths]
        query_lens[0] = lengths[0]  # one whole prefill
        query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        query = torch.randn(int(query_start_loc[-1]), num_heads, case["head_dim"], generator=gen).to(dtype)
        want = kernels.unified_attention_reference(query, scale=scale, query_start_loc=query_start_loc, **inputs)
        got = kernels.unified_attention(on_device(query), scale=scale, query_start_loc=on_device(query_start_loc),
                                        **device_inputs)
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"output {got.dtype} {tuple(got.shape)}, the reference {want.dtype} {tuple(want.shape)}"
    if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
        diff = (got.float() - want.float()).abs()
        return f"lengths {lengths}: largest difference {diff.max().item():.3g} (atol={atol}, rtol={rtol})"
    return None


def greedy_with_backend(model: Any, backend_cls: type, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy generation driven by hand, one flat batch per step: the first step prefills all but the last
    prompt, the next mixes the last prompt's prefill with decodes, then pure decode steps. Blocks are handed
    out shuffled, so every sequence's table is out of order. Runs where `model`'s weights are (the metadata
    stays on the host; the backend moves what it needs)."""
    from solutions.attention.paged import AttentionMetadata, KVCache

    device = next(model.parameters()).device

    block_size = 16
    tokens = [list(p) for p in prompts]
    max_blocks = -(-(max(map(len, prompts)) + max_new_tokens) // block_size)
    num_blocks = len(prompts) * max_blocks + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [order[i * max_blocks : (i + 1) * max_blocks] for i in range(len(prompts))]
    kv_cache = KVCache.allocate(model.config, num_blocks, block_size, device=device)
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens + 1):
        active = [i for i in range(len(prompts)) if step > 0 or i < len(prompts) - 1]
        active = [i for i in active if len(outputs[i]) < max_new_tokens]
        input_ids, positions, slots, starts = [], [], [], [0]
        for i in active:
            new = range(computed[i], len(tokens[i]))
            input_ids += tokens[i][computed[i] :]
            positions += new
            slots += [tables[i][p // block_size] * block_size + p % block_size for p in new]
            starts.append(starts[-1] + len(new))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor([len(tokens[i]) for i in active]),
            block_tables=[tables[i][: -(-len(tokens[i]) // block_size)] for i in active],
        )
        with torch.no_grad():
            ids, pos = torch.tensor(input_ids, device=device), torch.tensor(positions, device=device)
            hidden = model(ids, pos, backend_cls(kv_cache, metadata))
            logits = model.compute_logits(hidden[torch.tensor(starts[1:]) - 1]).cpu()  # (B, V)
        for row, i in enumerate(active):
            computed[i] = len(tokens[i])
            token = int(logits[row].argmax())
            tokens[i].append(token)
            outputs[i].append(token)
    return outputs


def run_model_case(name: str) -> str | None:
    """Greedy tokens through the model with TritonAttentionBackend (on DEVICE) equal those with chapter 3's
    PagedAttention (on the CPU)."""
    from grading.tiny_models import tiny_model
    from solutions.attention.paged import PagedAttention
    from solutions.attention.triton_backend import TritonAttentionBackend

    model = tiny_model(name)
    prompts = [[(7 * i + 3 * j + 1) % 256 for j in range(n)] for i, n in enumerate([5, 16, 23, 40])]
    want = greedy_with_backend(model, PagedAttention, prompts, 10)
    got = greedy_with_backend(model.to(DEVICE), TritonAttentionBackend, prompts, 10)
    return None if got == want else f"{name}: triton tokens {got} != torch tokens {want}"


def run_engine_case() -> str | None:
    """Greedy tokens of the Triton backend equal the torch backend's, through the engine on DEVICE."""
    from grading.tiny_models import tiny_checkpoint
    from solutions import LLM, SamplingParams

    folder = str(tiny_checkpoint("llama-gqa"))
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate([5, 16, 23, 40])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=folder, block_size=16, max_num_seqs=4, max_model_len=128, attention_backend=backend,
                  device=DEVICE.type)
        got[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    return None if got["triton"] == got["torch"] else f"triton tokens {got['triton']} != torch tokens {got['torch']}"


# --- the crash guard ----------------------------------------------------------------------------------------------


def run_guarded(cases: list[dict[str, Any]], timeout: float = 600) -> dict[str, str | None]:
    """case id -> None (passed) or a failure message, each case run in a worker process that may crash."""
    results: dict[str, str | None] = {}
    pending = list(cases)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": python_path}
    while pending:
        proc = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(pending), capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=timeout)
        if "READY" not in proc.stdout.splitlines():  # died before its first case: no case is to blame
            raise RuntimeError(f"the kernel worker could not start (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("CASE "):
                row = json.loads(line.removeprefix("CASE "))
                results[row["id"]] = row["error"]
        pending = [c for c in pending if c["id"] not in results]
        if pending:  # the worker died in the middle of pending[0]
            how = f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
            results[pending[0]["id"]] = f"the kernel crashed the worker process ({how}):\n{proc.stderr[-2000:]}"
            pending = pending[1:]
    return results


def worker_main() -> None:
    print("READY", flush=True)  # imports done: from here a death is the running case's
    for case in json.loads(sys.stdin.read()):
        if case["kind"] == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        try:
            error = run_case(case) if case["kind"] != "noop" else None
        except Exception as exc:  # reported as the case's failure; the next case still runs
            error = f"{type(exc).__name__}: {exc}"
        print("CASE " + json.dumps({"id": case["id"], "error": error}), flush=True)


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    return run_guarded(CASES)


@pytest.mark.quick
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_kernel_matches_its_reference(case, results):
    error = results[case["id"]]
    assert error is None, f"{case}: {error}"


def test_a_crash_fails_its_case_and_the_rest_still_run():
    cases = [dict(id="a", kind="noop"), dict(id="b", kind="crash"), dict(id="c", kind="noop")]
    results = run_guarded(cases, timeout=120)
    assert results["a"] is None and results["c"] is None
    assert "crashed" in results["b"] and "SIGSEGV" in results["b"]


# --- in-process: argument checks and the split heuristic (no kernel launch) ---------------------------------------


def small_inputs() -> dict[str, Any]:
    return dict(
        query=on_device(torch.zeros(2, 4, 16)),
        key_cache=on_device(torch.zeros(4, 16, 2, 16)),
        value_cache=on_device(torch.zeros(4, 16, 2, 16)),
        block_tables=on_device(torch.zeros(2, 2, dtype=torch.int32)),
        seq_lens=on_device(torch.ones(2, dtype=torch.int32)),
        scale=0.25,
    )


@pytest.mark.parametrize(
    "name, bad",
    [
        ("query", torch.zeros(2, 4, 16, dtype=torch.float64)),
        ("query", lambda: on_device(torch.zeros(2, 4, 32))[:, :, ::2]),  # strided last dimension (made on the device)
        ("query", torch.zeros(2, 3, 16)),  # 3 heads over 2 KV heads
        ("value_cache", torch.zeros(4, 16, 2, 8)),
        ("block_tables", torch.zeros(2, 2, dtype=torch.int64)),
        ("block_tables", torch.zeros(3, 2, dtype=torch.int32)),
        ("seq_lens", torch.ones(3, dtype=torch.int32)),
        ("num_splits", 0),
    ],
)
def test_decode_wrapper_names_the_bad_argument(name, bad):
    import kernels

    bad = bad() if callable(bad) else bad
    args = small_inputs() | {name: on_device(bad) if isinstance(bad, torch.Tensor) else bad}
    with pytest.raises(ValueError, match=name):
        kernels.paged_decode_attention(**args)


def test_store_and_unified_wrappers_name_the_bad_argument():
    import kernels

    cache = on_device(torch.zeros(4, 16, 2, 16))
    kv, short_kv = on_device(torch.zeros(3, 2, 16)), on_device(torch.zeros(3, 1, 16))
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kv_cache(kv, kv.clone(), cache, cache.clone(), on_device(torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="key"):
        kernels.store_kv_cache(short_kv, kv, cache, cache.clone(), on_device(torch.zeros(3, dtype=torch.long)))
    args = small_inputs()
    del args["seq_lens"]
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.unified_attention(seq_lens=on_device(torch.ones(2, dtype=torch.int32)),
                                  query_start_loc=on_device(torch.zeros(2, dtype=torch.int32)), **args)


@pytest.mark.parametrize(
    "num_seqs, num_kv_heads, max_seq_len, num_sms, expected",
    [
        (64, 8, 2048, 132, 1),  # 512 programs: about four per SM already
        (64, 3, 2048, 132, 2),  # 192 programs: one wave and a half on 132 SMs; two segments each
        (8, 8, 8192, 132, 8),  # 64 programs: two per SM needs 8 segments (256 programs are not yet 264)
        (1, 8, 8192, 132, 32),  # one sequence: as many segments as allowed
        (1, 8, 300, 132, 2),  # two segments of 150 positions; four would be shorter than 128
        (2, 3, 2048, 132, 16),  # lengths cap it: 2048 / 128
    ],
)
def test_split_heuristic_fills_the_device_without_tiny_segments(num_seqs, num_kv_heads, max_seq_len, num_sms, expected):
    import kernels

    assert kernels.choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) == expected


def test_tile_rule_is_wide_on_a_gpu_and_follows_the_block_in_the_interpreter():
    from kernels.paged_decode import choose_tile

    for block_size in (1, 16, 32, 128):
        assert choose_tile(block_size, torch.device("cuda")) == (128, 4)  # the sweep's rule, whatever the block
    assert [choose_tile(b, torch.device("cpu"))[0] for b in (1, 8, 16, 32, 64, 128, 24)] == [16, 16, 16, 32, 64, 64, 16]


@pytest.mark.parametrize("num_splits, tile_n, num_warps", [(1, 32, 2), (1, 128, 4), (3, 64, 8), (2, 16, None)])
def test_a_launch_override_gives_the_same_attention(num_splits, tile_n, num_warps):
    """The sweep's overrides change how the work is cut, never the result: tiles that span several blocks or
    part of one, over ragged lengths and a shuffled table."""
    import kernels

    gen = torch.Generator().manual_seed(5)
    case = dict(dtype="float32", block_size=16, num_kv_heads=2, head_dim=64)
    inputs = paged_inputs(case, [1, 16, 37, 90], gen)
    query = torch.randn(4, 6, 64, generator=gen)
    want = kernels.paged_decode_attention_reference(query, **inputs, scale=0.125)
    got = kernels.paged_decode_attention(on_device(query), *(on_device(inputs[k]) for k in inputs), 0.125,
                                         num_splits, tile_n=tile_n, num_warps=num_warps).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- Triton's interpreter switch, whatever imported Triton first ------------------------------------------------

_CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter switch matters only without a GPU")
def test_triton_backend_works_after_a_torch_engine_loaded_transformers():
    """The user's path: `from solutions import LLM`, a torch-backend engine (its loading imports Triton through
    transformers), then a Triton-backend engine with the same greedy tokens — in a fresh process."""
    script = (
        "from solutions import LLM, SamplingParams\n"
        "from grading.tiny_models import tiny_checkpoint\n"
        "folder, params = str(tiny_checkpoint('llama-gqa')), SamplingParams(temperature=0.0, max_tokens=6)\n"
        "outs = [LLM(model=folder, attention_backend=b).generate([[1, 2, 3]], params, use_tqdm=False) for b in ('torch', 'triton')]\n"
        "print([o[0].outputs[0].token_ids for o in outs])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_CLEAN_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_tokens, triton_tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert triton_tokens == torch_tokens and len(torch_tokens) == 6


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    sys.path.insert(0, str(ROOT))
    worker_main()
