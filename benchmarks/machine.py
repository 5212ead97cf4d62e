"""Where and when a benchmark ran: its numbers mean nothing without the machine (standard library only)."""

import os
import platform
import sys
import time
from pathlib import Path


def measured_on(module: str) -> dict[str, str]:
    """The CPU model and its logical cores, the UTC date and time, and the command (`python -m <module> ...`)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        cpu = None
    return {"machine": f"{cpu or platform.processor() or 'unknown CPU'}, {os.cpu_count()} logical cores",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": f"python -m {module} " + " ".join(sys.argv[1:])}


def threads_note(fixed: int | None = None) -> str:
    """What a benchmark's engines ran on: the CPUs this process may use, and who sets torch's thread count — `fixed`
    threads, or the engine's thread policy step by step (`torch.get_num_threads()` after a run is only its last
    choice)."""
    who = f"{fixed} torch threads, fixed" if fixed else "torch's threads set by the engine's thread policy"
    return f"{len(os.sched_getaffinity(0))} CPUs, {who}"
