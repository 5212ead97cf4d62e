"""The serving benchmark's pure parts: Poisson arrivals, the workload, vLLM's latency metrics and goodput on a
hand-made timeline, the sustainable-rate rule of the Fig. 12 comparison; and, without starting vLLM (CI has no
vLLM venv), the command line, the commands that start vLLM's server and client, the reading of vLLM's result
JSON, and the side-by-side table and plot."""

import math
import os
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import (
    DEFAULT_GOODPUT,
    MAX_MODEL_LEN,
    SCALE,
    THIS_SERVER,
    VLLM_CLIENT,
    VLLM_CLIENT_MAX_MODEL_LEN,
    VLLM_SERVER,
    RequestTimeline,
    comparison_table,
    make_requests,
    normalized_latency,
    parse_args,
    parse_goodput,
    plot_serving,
    poisson_arrivals,
    rate_ratio,
    serving_metrics,
    summary,
    sustainable_rate,
    vllm_client_command,
    vllm_result_row,
    vllm_server_command,
    vllm_server_env,
)
from benchmarks.workload import SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_MEAN_PROMPT_LEN


def test_poisson_arrivals_have_mean_gap_one_over_the_rate():
    arrivals = poisson_arrivals(20_000, rate=4.0, seed=0)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0.0
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 4.0, rel=0.05)  # exponential: standard deviation = mean


def test_poisson_arrivals_are_seeded_and_scale_with_the_rate():
    assert np.array_equal(poisson_arrivals(50, 2.0, seed=3), poisson_arrivals(50, 2.0, seed=3))
    assert not np.array_equal(poisson_arrivals(50, 2.0, seed=3), poisson_arrivals(50, 2.0, seed=4))
    assert np.allclose(poisson_arrivals(50, 8.0, seed=3), poisson_arrivals(50, 2.0, seed=3) / 4)


def test_requests_are_scaled_sharegpt_lengths_of_random_ids():
    requests = make_requests(4000, vocab_size=1000, seed=0)
    prompt_lens = np.array([len(r.prompt_token_ids) for r in requests])
    output_lens = np.array([r.output_len for r in requests])
    assert prompt_lens.min() >= 1 and output_lens.min() >= 1
    assert np.all(prompt_lens + output_lens <= MAX_MODEL_LEN)
    assert all(100 <= t < 1000 for r in requests[:50] for t in r.prompt_token_ids)
    assert prompt_lens.mean() == pytest.approx(SHAREGPT_MEAN_PROMPT_LEN / SCALE, rel=0.15)
    assert output_lens.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN / SCALE, rel=0.15)
    assert make_requests(10, 1000, seed=0) == make_requests(10, 1000, seed=0)
    assert make_requests(10, 1000, seed=1) != make_requests(10, 1000, seed=0)


def timeline(sent: float, chunks: list[float], end: float, tokens: int) -> RequestTimeline:
    return RequestTimeline(sent=sent, chunk_times=chunks, end=end, output_tokens=tokens)


def test_latency_metrics_of_one_request():
    t = timeline(10.0, [10.5, 10.7, 11.0, 11.1], end=11.2, tokens=4)
    assert t.ttft == pytest.approx(0.5)
    assert t.e2e == pytest.approx(1.2)
    assert t.tpot == pytest.approx((1.2 - 0.5) / 3)  # vLLM: (e2e - ttft) / (output tokens - 1)
    assert t.itls == pytest.approx([0.2, 0.3, 0.1])
    assert timeline(0.0, [0.3], end=0.3, tokens=1).tpot is None


def test_serving_metrics_over_requests_skip_the_failed_ones():
    a = timeline(0.0, [0.5, 0.7, 1.0], end=1.0, tokens=3)  # ttft 0.5, e2e 1.0, tpot 0.25, itls 0.2 0.3
    b = timeline(1.0, [1.1, 1.5], end=2.0, tokens=2)  # ttft 0.1, e2e 1.0, tpot 0.9, itl 0.4
    failed = RequestTimeline(sent=0.5, end=0.6, error="ConnectionError")
    m = serving_metrics([a, b, failed], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["ttft_s"] == pytest.approx(dict(mean=0.3, p50=0.3, p99=0.1 + 0.99 * 0.4))
    assert m["tpot_s"]["mean"] == pytest.approx((0.25 + 0.9) / 2)
    assert m["itl_s"] == pytest.approx(dict(mean=0.3, p50=0.3, p99=np.percentile([0.2, 0.3, 0.4], 99)))
    assert m["e2e_s"]["p50"] == pytest.approx(1.0)
    assert m["normalized_latency_s_per_token"] == pytest.approx((1.0 / 3 + 1.0 / 2) / 2)
    assert normalized_latency([a, b]) == m["normalized_latency_s_per_token"]


def test_summary_of_nothing_is_nan():
    assert all(math.isnan(v) for v in summary([]).values())


def test_sustainable_rate_interpolates_the_crossing():
    rate, crossed = sustainable_rate([1, 2, 4, 8], [0.1, 0.2, 0.3, 0.7], threshold=0.5)
    assert crossed
    assert rate == pytest.approx(4 + (0.5 - 0.3) * (8 - 4) / (0.7 - 0.3))  # 6.0


def test_sustainable_rate_without_a_crossing_is_a_lower_bound():
    assert sustainable_rate([1, 2, 4], [0.1, 0.2, 0.3], threshold=0.5) == (4, False)


def test_sustainable_rate_is_none_when_even_the_lowest_rate_is_over():
    assert sustainable_rate([1, 2], [0.6, 0.9], threshold=0.5) == (None, True)


def test_rate_ratio_says_when_it_is_only_a_bound():
    assert rate_ratio((6.0, True), (2.0, True)) == (3.0, "exact")
    assert rate_ratio((16.0, False), (4.0, True)) == (4.0, "at least")  # paged never crossed: it sustains more
    assert rate_ratio((6.0, True), (16.0, False)) == (6.0 / 16.0, "at most")
    assert rate_ratio((16.0, False), (16.0, False)) == (None, "unknown")
    assert rate_ratio((6.0, True), (None, True)) == (None, "unknown")


# --- goodput --------------------------------------------------------------------------------------------------


def test_goodput_counts_the_requests_that_met_every_slo():
    a = timeline(0.0, [0.5, 0.7, 1.0], end=1.0, tokens=3)  # ttft 0.5, tpot 0.25
    b = timeline(1.0, [1.1, 1.5], end=2.0, tokens=2)  # ttft 0.1, tpot 0.9
    c = timeline(1.5, [1.8], end=1.8, tokens=1)  # ttft 0.3; one token: tpot counts as 0 (vLLM)
    failed = RequestTimeline(sent=0.5, end=0.6, error="ConnectionError")
    assert serving_metrics([a, b, c, failed], 2.0, slo={"ttft": 0.4, "tpot": 1.0})["goodput"] == pytest.approx(1.0)
    assert serving_metrics([a, b, c], 2.0, slo={"ttft": 1.0, "tpot": 0.5})["goodput"] == pytest.approx(1.0)  # a, c
    assert serving_metrics([a, b, c], 2.0, slo={"e2el": 0.5})["goodput"] == pytest.approx(0.5)  # c
    assert "goodput" not in serving_metrics([a, b], 2.0)


def test_parse_goodput_takes_vllms_key_ms_pairs():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == pytest.approx(dict(ttft=0.5, tpot=0.05, e2el=2.0))
    assert parse_goodput(DEFAULT_GOODPUT) == pytest.approx(dict(ttft=1.0, tpot=0.1))
    for bad in ("itl:10", "ttft", "ttft:fast", "tpot:0"):
        with pytest.raises(ValueError, match=bad):
            parse_goodput([bad])


# --- the command line -------------------------------------------------------------------------------------------


def test_command_line_defaults_depend_on_the_client():
    ours = parse_args([])
    assert (ours.client, ours.max_model_len, ours.rates, ours.vllm_python) == ("ours", MAX_MODEL_LEN, [2, 4, 8], None)
    vllm = parse_args(["--client", "vllm", "--vllm-python", "venv/bin/python", "--rates", "4", "--duration", "2"])
    assert (vllm.client, vllm.max_model_len, vllm.rates) == ("vllm", VLLM_CLIENT_MAX_MODEL_LEN, [4])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--client", "vllm"], "--vllm-python"),
        (["--fig12", "--vllm-python", "python"], "--fig12"),
        (["--goodput", "ttft:soon"], "--goodput"),
        (["--client", "vllm", "--vllm-python", "python", "--input-len", "2000"], "--max-model-len=2048"),
        (["--rates", "8", "2"], "ascending"),
    ],
)
def test_command_line_refuses_what_cannot_run(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


def test_vllm_server_command_and_environment(tmp_path):
    """vLLM's server from its venv, the same checkpoint under this server's model name and max_model_len, its CPU
    settings in the environment; LD_PRELOAD ends with the venv's Intel OpenMP, which is found beside its python."""
    python = tmp_path / "venv" / "bin" / "python"
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    iomp.parent.mkdir(parents=True)
    iomp.write_bytes(b"")
    args = parse_args(["--vllm-python", str(python), "--vllm-model", "/models/smollm2", "--max-model-len", "512"])
    command = vllm_server_command(args, "http://127.0.0.1:8123")
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=True))
    assert flags == {"--model": "/models/smollm2", "--served-model-name": "smollm2-135m", "--dtype": "float32",
                     "--max-model-len": "512", "--seed": "0", "--host": "127.0.0.1", "--port": "8123",
                     "--uvicorn-log-level": "warning"}
    env = vllm_server_env(args)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"], env["HF_HUB_OFFLINE"]) == ("0-1", "4", "1")
    preloaded = env["LD_PRELOAD"].split(":")
    assert preloaded[-1] == str(iomp) and all(Path(library).exists() for library in preloaded)
    assert "LD_PRELOAD" not in vllm_server_env(parse_args(["--vllm-python", str(python), "--vllm-preload", "none"]))


def test_vllm_client_command_is_vllm_bench_serve(tmp_path):
    args = parse_args(["--client", "vllm", "--vllm-python", "py", "--vllm-model", "/models/smollm2", "--rates", "4",
                       "--duration", "2", "--goodput", "ttft:500", "tpot:50"])
    result_file = tmp_path / "result.json"
    command = vllm_client_command(args, "http://127.0.0.1:9000", 4.0, result_file)
    assert command[:3] == ["py", "-c", VLLM_CLIENT]
    flags = " ".join(command[3:])
    for expected in ("--backend openai --base-url http://127.0.0.1:9000 --endpoint /v1/completions",
                     "--model /models/smollm2 --served-model-name smollm2-135m --tokenizer /models/smollm2",
                     "--dataset-name random --random-input-len 128 --random-output-len 128",
                     "--num-prompts 8 --request-rate 4 --seed 0 --ignore-eos --temperature 0",
                     "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --goodput ttft:500 tpot:50",
                     f"--save-result --save-detailed --result-dir {tmp_path} --result-filename result.json"):
        assert expected in flags


# A result as vllm/benchmarks/serve.py (vllm-cpu 0.32.0) saves it with --save-detailed: the keys this benchmark reads.
VLLM_RESULT = {
    "duration": 4.0, "completed": 7, "failed": 1, "request_throughput": 1.75, "request_goodput": 1.5,
    "output_throughput": 224.0, "latencies": [2.0, 1.0, 0.0], "output_lens": [128, 64, 0],
    "errors": ["", "", "Bad Request", "Bad Request"],
    **{f"{stat}_{metric}_ms": value for metric, base in (("ttft", 100.0), ("tpot", 20.0), ("itl", 18.0),
                                                         ("e2el", 2600.0))
       for stat, value in (("mean", base * 1.1), ("median", base), ("std", 1.0), ("p99", base * 3))},
}


def test_vllm_result_row_reads_vllms_json_into_this_benchmarks_row():
    row = vllm_result_row(VLLM_RESULT, rate=2.0)
    assert (row["rate"], row["num_requests"], row["completed"], row["failed"]) == (2.0, 8, 7, 1)
    assert row["errors"] == ["Bad Request"]
    assert row["ttft_s"] == pytest.approx(dict(mean=0.11, p50=0.1, p99=0.3))
    assert row["e2e_s"]["p99"] == pytest.approx(7.8)
    assert row["normalized_latency_s_per_token"] == pytest.approx((2.0 / 128 + 1.0 / 64) / 2)
    assert (row["goodput"], row["request_throughput"], row["output_throughput"]) == (1.5, 1.75, 224.0)


def serving_result() -> dict:
    """A two-server result: this server's rows from hand-made timelines, vLLM's from its JSON."""
    fast = timeline(0.0, [0.1, 0.12, 0.14], end=0.14, tokens=3)
    slow = timeline(0.0, [0.5, 0.7, 0.9], end=0.9, tokens=3)
    rows = [dict(rate=rate, num_requests=2, errors=[], **serving_metrics([fast, slow], 1.0, parse_goodput(
        DEFAULT_GOODPUT))) for rate in (2.0, 8.0)]
    return dict(model="smollm2-135m", client="vllm", workload=dict(input_len=128, output_len=128),
                goodput_slo_ms=DEFAULT_GOODPUT, rows=rows,
                vllm=dict(rows=[vllm_result_row(VLLM_RESULT, rate) for rate in (2.0, 8.0)]))


def test_comparison_table_puts_each_rates_servers_together():
    lines = comparison_table(serving_result()).splitlines()
    assert [line.split()[:2] for line in lines[3:]] == [["2", "this"], ["2", "vLLM"], ["8", "this"], ["8", "vLLM"]]
    assert THIS_SERVER in lines[3] and VLLM_SERVER in lines[4]
    assert "100.0/ 300.0" in lines[4] and lines[4].endswith("1.50 req/s")  # vLLM's TTFT p50/p99 in ms, goodput
    assert lines[3].endswith("1.00 req/s")  # of 2 requests in 1 s, the slow one's TPOT (200 ms) missed the SLO


def test_comparison_table_says_the_machines_load():
    assert "machine load: quiet;" in comparison_table(serving_result()).splitlines()[0]
    busy = comparison_table({**serving_result(), "competitor_cpu": 1}).splitlines()[0]
    assert "machine load: a busy loop on CPU 1;" in busy


def test_competitor_keeps_a_cpu_busy_for_the_run_and_stops_after():
    """`--competitor`'s neighbour: a process pinned to the last usable CPU, burning it, gone once the run ends."""
    import time

    from benchmarks.serving import competing
    from solutions.worker.cpu_threads import usable_cpus

    with competing(False) as cpu:
        assert cpu is None
    with competing(True) as cpu:
        assert cpu == usable_cpus()[-1]
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent_of(int(p)) == os.getpid()]
        busy = [pid for pid in children if os.sched_getaffinity(pid) == {cpu}]
        assert len(busy) == 1, f"one child pinned to CPU {cpu}, got {children}"
        deadline = time.monotonic() + 10  # a loaded machine gives it less than its CPU: wait, bounded
        while _cpu_seconds(busy[0]) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _cpu_seconds(busy[0]) >= 0.5, "the competitor burns its CPU"
    time.sleep(0.1)
    assert not os.path.exists(f"/proc/{busy[0]}") or _state(busy[0]) == "Z", "the competitor is gone after the run"


def _parent_of(pid: int) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_plot_serving_draws_both_servers(tmp_path):
    path = tmp_path / "serving.png"
    plot_serving(serving_result(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
