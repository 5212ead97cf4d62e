"""How many threads the CPU forward pass uses: the cores this process can really get, step by step.

torch runs a matmul as one OpenMP parallel region, and every thread waits at its end for the slowest. So a thread
whose core another process keeps busy holds up all the others: on a 2-core Intel Xeon (2026-11-27, issue 41) one
32-token request took 1.25–1.39 s alone, 9.1–25.4 s beside one busy-loop process pinned to a core (14.6×), and
2.1 s there with one thread. A thread the process cannot get is worse than no thread.

So the engine sizes its threads from what it can get, and keeps checking:
- the CPUs it may run on: its affinity mask (`taskset`, a cpuset), capped by a cgroup CPU quota (`cpu.max`);
- what other processes use of them: `/proc/stat` less this process's own time (`/proc/self/stat`), over about a
  second; a core others keep at least 40% busy is not counted (a busy neighbour sharing a core with one of our
  threads gets only about half of it);
- the step clock, because a server's own front end and a local client count as "other processes" too, and load
  alone would drop a thread for good once they are busy (measured on a 2-core AMD EPYC: 300-318 output tok/s
  against 482 with two fixed threads). Every few seconds a *probe* runs `PROBE_PAIRS` steps at the other count in
  turns with as many at the current one and keeps the cheaper per token (by `PROBE_MARGIN`); a far costlier step
  ends it at once. A probe's choice holds until the load moves by a core's worth (`BUSY_CORE`).

`cpu_threads=N` (`--cpu-threads`) fixes the count instead, as `VLLM_CPU_OMP_THREADS_BIND` and `OMP_NUM_THREADS` do
for vLLM's CPU worker. Without `/proc` (not Linux) torch's default stays; on a GPU nothing here applies.

Where this lives in vLLM: `vllm/v1/worker/cpu_worker.py` (`CPUWorker.init_device` binds one OpenMP thread per core
of `VLLM_CPU_OMP_THREADS_BIND`; `VLLM_CPU_NUM_OF_RESERVED_CPU` leaves some to the front end), sized once at
start-up, not adapting to other processes.
"""

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

SAMPLE_SECONDS = 1.0  # how often the policy looks at what other processes use
BUSY_CORE = 0.4  # a core others keep at least this busy is left to them
PROBE_PAIRS = 3  # a probe times this many steps at each of two counts, in turns
PROBE_MARGIN = 0.9  # the other count is taken when its steps cost at most this fraction of the current count's
PROBE_ABORT = 2.0  # a probe step this many times the usual cost ends the probe at once: the other count lost
PROBE_EVERY = (4.0, 16.0)  # seconds between probes: the first after a change, doubling while the count holds
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The CPUs' worth of time a cgroup v2 quota allows ("max" or no file: no quota)."""
    try:
        quota, period = Path(path).read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def max_threads() -> int:
    """Threads this process can use at best: its CPUs, within its quota."""
    quota = cpu_quota()
    cpus = len(usable_cpus())
    return max(1, min(cpus, math.floor(quota) if quota is not None else cpus))


@dataclass(frozen=True)
class CpuTimes:
    """Busy seconds of the process's CPUs (everyone's) and of this process alone, at one moment."""

    busy: float
    own: float
    at: float


def read_cpu_times(cpus: list[int]) -> CpuTimes | None:
    """`/proc/stat`'s busy time of `cpus` and `/proc/self/stat`'s own time, in seconds; None without /proc."""
    names = {f"cpu{cpu}" for cpu in cpus}
    try:
        busy = 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if name in names:
                    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
                    busy += user + nice + system + irq + softirq + steal
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        own = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    except (OSError, ValueError, IndexError):
        return None
    return CpuTimes(busy / _TICKS, own / _TICKS, time.monotonic())


def threads_for(others: float, limit: int) -> int:
    """Threads to use when other processes keep `others` cores busy: one per core they leave mostly free."""
    return max(1, limit - math.floor(others + 1 - BUSY_CORE))


class CpuThreadPolicy:
    """Sets torch's intra-op threads before each step (`before_step()`; `after_step()` gets the step's time): `fixed`
    threads (an `OMP_NUM_THREADS` in the environment counts as fixed), or the count the load suggests (`threads_for`,
    sampled every `SAMPLE_SECONDS`) tested by the step clock every `PROBE_EVERY` seconds. `restore()` gives the
    process its count back."""

    def __init__(self, fixed: int | None = None) -> None:
        self.initial = torch.get_num_threads()
        if fixed is None and "OMP_NUM_THREADS" in os.environ:
            fixed = self.initial
        self.cpus = usable_cpus()
        self.limit = min(max_threads(), self.initial)  # never above a count the process was already held to
        self.num_threads = fixed or self.limit
        self._last = None if fixed else read_cpu_times(self.cpus)
        self._held: tuple[float, float] | None = None  # a probe chose the count: (least, most) load seen since
        self._usual: deque[float] = deque(maxlen=8)  # recent steps' seconds per token at `num_threads`
        self._probe: list[tuple[int, float]] | None = None  # while probing: its steps so far, (threads, cost)
        self._interval = PROBE_EVERY[0]
        self._next_probe = time.monotonic() + self._interval
        self._step_threads = self.num_threads
        torch.set_num_threads(self.num_threads)

    @property
    def adaptive(self) -> bool:
        return self._last is not None

    def restore(self) -> None:
        torch.set_num_threads(self.initial)

    def before_step(self) -> int:
        """Set the thread count for the coming step and return it."""
        now = time.monotonic()
        if self.adaptive and self._probe is None:
            sample = read_cpu_times(self.cpus) if now - self._last.at >= SAMPLE_SECONDS else None
            if sample is not None:
                others = (sample.busy - self._last.busy) - (sample.own - self._last.own)
                self._on_load(max(0.0, others) / (sample.at - self._last.at), now)
                self._last = sample
            if self.limit > 1 and now >= self._next_probe and len(self._usual) >= PROBE_PAIRS:
                self._probe = []
        self._step_threads = self.num_threads
        if self._probe is not None and len(self._probe) % 2 == 0:  # the other count first, then ours, in turns
            self._step_threads = self._other()
        if torch.get_num_threads() != self._step_threads:  # another engine in this process may have changed it
            torch.set_num_threads(self._step_threads)
        return self._step_threads

    def after_step(self, seconds: float, num_tokens: int) -> None:
        """Count the step just run (`seconds` of forward pass for `num_tokens` tokens) toward the running probe,
        or toward the usual cost of a step at the current count."""
        if not self.adaptive or num_tokens == 0:
            return
        cost = seconds / num_tokens
        if self._probe is None:
            self._usual.append(cost)
            return
        self._probe.append((self._step_threads, cost))
        if self._step_threads != self.num_threads and cost > PROBE_ABORT * statistics.median(self._usual):
            self._end_probe(other_wins=False)  # clearly worse: no need to pay for more such steps
        elif len(self._probe) == 2 * PROBE_PAIRS:
            ratios = [other / ours for (_, other), (_, ours) in zip(self._probe[::2], self._probe[1::2])]
            self._end_probe(other_wins=statistics.median(ratios) <= PROBE_MARGIN)

    def _other(self) -> int:
        """The count a probe tries: one fewer at the limit, else one more."""
        return self.num_threads - 1 if self.num_threads == self.limit else self.num_threads + 1

    def _end_probe(self, other_wins: bool) -> None:
        now = time.monotonic()
        if other_wins:
            self._switch(self._other(), now)
        else:
            self._interval = min(2 * self._interval, PROBE_EVERY[1])
            self._next_probe = now + self._interval
        self._probe = None
        self._held = (math.inf, -math.inf)  # the count is the measured one until the load moves a core's worth

    def _on_load(self, others: float, now: float) -> None:
        """Follow the load's suggestion, unless a probe chose the count and the load has not changed since."""
        suggested = threads_for(others, self.limit)
        if self._held is not None:
            least, most = min(self._held[0], others), max(self._held[1], others)
            rose, fell = others >= least + BUSY_CORE, others <= most - BUSY_CORE
            if not (suggested < self.num_threads and rose or suggested > self.num_threads and fell):
                self._held = (least, most)
                return
            self._held = None
        if suggested != self.num_threads:
            self._switch(suggested, now)

    def _switch(self, num_threads: int, now: float) -> None:
        self.num_threads = num_threads
        self._usual.clear()  # a step's cost at the old count says nothing of the new one
        self._interval = PROBE_EVERY[0]
        self._next_probe = now + self._interval
