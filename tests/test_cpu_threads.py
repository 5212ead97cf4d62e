"""The CPU forward pass's thread policy: a fixed count when asked (`cpu_threads`, `OMP_NUM_THREADS`), else one thread
per core that other processes leave free, re-read every second, so a busy neighbour never holds a step at a barrier.

The contention test is real: a busy-loop process pinned to one of this process's CPUs, and the policy reading
`/proc` as it does in the engine."""

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from grading.tiny_models import tiny_checkpoint
from solutions.engine.arg_utils import EngineArgs, ParameterError
from solutions.executor.uniproc_executor import UniProcExecutor
from solutions.worker import cpu_threads
from solutions.worker.cpu_threads import CpuThreadPolicy, CpuTimes, cpu_quota, read_cpu_times, threads_for

ON_LINUX = read_cpu_times(cpu_threads.usable_cpus()) is not None


@pytest.mark.parametrize("others, limit, expected", [
    (0.0, 2, 2), (0.3, 2, 2), (0.5, 2, 1), (1.0, 2, 1), (2.0, 2, 1),
    (0.0, 4, 4), (1.0, 4, 3), (2.9, 4, 1), (0.0, 1, 1),
])
def test_one_thread_per_core_the_others_leave_mostly_free(others, limit, expected):
    assert threads_for(others, limit) == expected


def test_a_cgroup_quota_caps_the_threads(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cpu_quota(str(quota)) == 1.5
    quota.write_text("max 100000\n")
    assert cpu_quota(str(quota)) is None
    assert cpu_quota(str(tmp_path / "missing")) is None


def test_cpu_threads_is_validated_by_name():
    with pytest.raises(ParameterError, match="cpu_threads"):
        EngineArgs(cpu_threads=0)


def test_a_fixed_count_holds_for_the_engine_and_is_given_back(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    config = EngineArgs(model=str(tiny_checkpoint("llama-gqa")), cpu_threads=1).create_engine_config()
    executor = UniProcExecutor(config)
    try:
        assert torch.get_num_threads() == 1
        assert executor.cpu_threads.before_step() == 1
    finally:
        executor.shutdown()
    assert torch.get_num_threads() == before


def test_omp_num_threads_in_the_environment_is_a_fixed_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    policy = CpuThreadPolicy()
    try:
        assert policy._last is None, "with OMP_NUM_THREADS set the policy must not adapt"
    finally:
        policy.restore()


def _wait_for(policy: CpuThreadPolicy, wanted: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if policy.before_step() == wanted:
            return wanted
        time.sleep(0.1)
    return policy.num_threads


@pytest.mark.skipif(not ON_LINUX or len(cpu_threads.usable_cpus()) < 2, reason="needs /proc and two CPUs")
def test_a_busy_neighbour_on_one_core_takes_a_thread_away_until_it_ends(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "SAMPLE_SECONDS", 0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    policy = CpuThreadPolicy()
    try:
        assert policy.limit == 2
        if _wait_for(policy, 2, 3.0) != 2:
            pytest.skip("the machine is already busy: no quiet baseline to compare with")
        core = cpu_threads.usable_cpus()[-1]
        code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
        busy = subprocess.Popen([sys.executable, "-c", code])
        try:
            assert _wait_for(policy, 1, 5.0) == 1, "a busy loop holds a core, yet the policy kept two threads"
            assert torch.get_num_threads() == 1
        finally:
            busy.kill()
            busy.wait(timeout=10)
        assert _wait_for(policy, 2, 5.0) == 2, "the busy loop ended, yet the policy stayed at one thread"
    finally:
        policy.restore()
        torch.set_num_threads(threads)


class SteppedMachine:
    """A virtual clock and a virtual `/proc` for the policy: other processes keep `others` cores busy, and a step
    at t threads costs `cost[t]` seconds per token; time moves only as steps run."""

    def __init__(self, monkeypatch, others: float, cost: dict[int, float]) -> None:
        self.now, self.busy, self.others, self.cost = 100.0, 0.0, others, cost
        self.threads_run: list[int] = []
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_threads, "time", SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(cpu_threads, "read_cpu_times", lambda cpus: CpuTimes(self.busy, 0.0, self.now))
        monkeypatch.setattr(cpu_threads, "max_threads", lambda: 2)
        torch.set_num_threads(2)

    def steps(self, policy: CpuThreadPolicy, count: int, tokens: int = 8) -> None:
        for _ in range(count):
            threads = policy.before_step()
            seconds = self.cost[threads] * tokens
            self.now += seconds
            self.busy += self.others * seconds
            policy.after_step(seconds, tokens)
            self.threads_run.append(threads)


@pytest.fixture
def threads_back():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_probe_brings_back_a_thread_the_load_took_when_it_runs_steps_faster(monkeypatch, threads_back):
    # the front end and a client keep 0.7 of a core busy: the load says one thread, the steps say two
    machine = SteppedMachine(monkeypatch, others=0.7, cost={1: 0.010, 2: 0.006})
    policy = CpuThreadPolicy()
    machine.steps(policy, 200)
    assert policy.num_threads == 2, "two threads run the steps 40% faster, yet the policy stayed at one"
    assert machine.threads_run[-100:].count(2) >= 90, "the count the clock chose must hold while the load holds"


def test_a_probe_into_a_busy_core_costs_one_step_and_the_count_stays(monkeypatch, threads_back):
    # a busy neighbour on one core: a second thread makes every step 6x slower
    machine = SteppedMachine(monkeypatch, others=1.0, cost={1: 0.010, 2: 0.060})
    policy = CpuThreadPolicy()
    machine.steps(policy, 400)
    assert policy.num_threads == 1
    slow = machine.threads_run[5:].count(2)
    probes = 1 + int((machine.now - 100.0) / cpu_threads.PROBE_EVERY[1])
    assert 1 <= slow <= probes, f"{slow} steps at two threads in {machine.now - 100:.0f} s: probes must stop early"


def test_a_count_the_clock_chose_still_drops_when_a_neighbour_arrives(monkeypatch, threads_back):
    machine = SteppedMachine(monkeypatch, others=0.3, cost={1: 0.010, 2: 0.006})
    policy = CpuThreadPolicy()
    machine.steps(policy, 200)
    assert policy.num_threads == 2
    machine.others, machine.cost = 1.0, {1: 0.010, 2: 0.060}  # a busy loop starts
    start = machine.now
    while policy.num_threads == 2 and machine.now - start < 10:
        machine.steps(policy, 1)
    assert policy.num_threads == 1 and machine.now - start < 2 * cpu_threads.SAMPLE_SECONDS + 0.5, (
        "a busy neighbour must take the thread at the next load sample, not wait for a probe")


def test_on_a_quiet_machine_probes_keep_every_thread(monkeypatch, threads_back):
    machine = SteppedMachine(monkeypatch, others=0.0, cost={1: 0.010, 2: 0.006})
    policy = CpuThreadPolicy()
    machine.steps(policy, 300)
    assert policy.num_threads == 2
    assert machine.threads_run.count(1) <= 3 * (1 + int((machine.now - 100.0) / cpu_threads.PROBE_EVERY[0]))
