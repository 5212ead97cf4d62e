"""Where and when a benchmark ran: its numbers mean nothing without the machine (standard library only)."""

import os
import platform
import subprocess
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


def source_commit() -> str:
    """The short hash of the repository's HEAD, `+dirty` if tracked files differ from it; "unknown" outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def threads_note(fixed: int | None = None) -> str:
    """What a benchmark's engines ran on: the CPUs this process may use, and who sets torch's thread count — `fixed`
    threads, or the engine's thread policy step by step (`torch.get_num_threads()` after a run is only its last
    choice)."""
    who = f"{fixed} torch threads, fixed" if fixed else "torch's threads set by the engine's thread policy"
    return f"{len(os.sched_getaffinity(0))} CPUs, {who}"
