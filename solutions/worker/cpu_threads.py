"""How many threads the CPU forward pass uses: the cores this process can really get, step by step.

torch runs a matmul or an attention call as one OpenMP parallel region: the work is split over its threads and
every thread waits at the end for the slowest. On a machine shared with other work that is the trap. With two
threads on two cores and one busy process beside them, one thread shares its core with the busy process and runs
half the time; the other finishes its half, then waits at the barrier, so each region takes at least twice as
long, and far longer when the waiting thread spins and the scheduler's time slices line up badly. Measured on a
2-core Intel Xeon, 2026-11-27 (issue 41): one 32-token request through the server took 1.25–1.39 s alone and
9.1–25.4 s beside one busy-loop process pinned to a core (14.6×, medians of three alternating pairs); with one
thread, 2.1 s. A thread the process cannot get is worse than no thread.

So the engine sizes its threads from what it can get, and keeps checking:
- the CPUs it may run on: its affinity mask (`taskset`, a container's cpuset), capped by a cgroup CPU quota
  (`cpu.max`: 150000/100000 allows 1.5 CPUs' worth of time, so at most 1 thread that never waits for quota);
- what other processes use of those CPUs, from `/proc/stat` (busy time of those CPUs) less this process's own CPU
  time (`/proc/self/stat`), averaged over about a second; a core that others keep at least 40% busy is not
  counted, so two threads become one beside one busy process and two again when it ends. (40%, not more: while
  two threads run, a busy neighbour gets only about half of the core it shares with one of them.)

`cpu_threads=N` (the `--cpu-threads` flag) fixes the count instead, as `VLLM_CPU_OMP_THREADS_BIND` and
`OMP_NUM_THREADS` do for vLLM's CPU worker; `cpu_threads=None` (the default) is the adaptive policy above. Where
`/proc` is missing (not Linux) the policy keeps torch's default. On a GPU nothing here applies.

Where this lives in vLLM: `vllm/v1/worker/cpu_worker.py` (`CPUWorker.init_device` binds one OpenMP thread per core
of `VLLM_CPU_OMP_THREADS_BIND`, "auto" meaning the cores of one NUMA node; `VLLM_CPU_NUM_OF_RESERVED_CPU` leaves
some to the front end). vLLM binds and sizes once, at start-up; it does not adapt to other processes.
"""

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SAMPLE_SECONDS = 1.0  # how often the policy looks at what other processes use
BUSY_CORE = 0.4  # a core others keep at least this busy is left to them
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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
    """Sets torch's intra-op threads before each step: `fixed` threads, or (None) as many as the cores that other
    processes leave free, checked every `SAMPLE_SECONDS`. An `OMP_NUM_THREADS` in the environment is a fixed count
    too (the user's choice, as for any OpenMP program); `restore()` gives the process its count back."""

    def __init__(self, fixed: int | None = None) -> None:
        self.initial = torch.get_num_threads()
        if fixed is None and "OMP_NUM_THREADS" in os.environ:
            fixed = self.initial
        self.cpus = usable_cpus()
        self.limit = min(max_threads(), self.initial)  # never above a count the process was already held to
        self.num_threads = fixed or self.limit
        self._last = None if fixed else read_cpu_times(self.cpus)
        torch.set_num_threads(self.num_threads)

    def restore(self) -> None:
        torch.set_num_threads(self.initial)

    def before_step(self) -> int:
        """Set the thread count for the coming step (a new one only when a sample is due and says so)."""
        due = self._last is not None and time.monotonic() - self._last.at >= SAMPLE_SECONDS
        now = read_cpu_times(self.cpus) if due else None
        if now is not None:
            others = max(0.0, (now.busy - self._last.busy) - (now.own - self._last.own)) / (now.at - self._last.at)
            self.num_threads, self._last = threads_for(others, self.limit), now
        if torch.get_num_threads() != self.num_threads:  # another engine in this process may have changed it
            torch.set_num_threads(self.num_threads)
        return self.num_threads
