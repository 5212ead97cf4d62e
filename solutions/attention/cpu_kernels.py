"""Chapter 6's paged decode kernel, hand-written in C for the CPU (`csrc/paged_decode.c`), called from PyTorch.

The inductor backend's decode attention is eight lines of PyTorch that `torch.compile` fuses into one loop; the
loop it emits pads every sequence to the longest in the batch and reads the cache at a fraction of the machine's
bandwidth. This kernel does what chapter 6's Triton kernel does on a GPU, the CPU's way: a task per sequence (per
sequence and K/V head when there are fewer sequences than twice the cores), its queries held while the sequence's
keys stream past once, an exact softmax over the row of scores a core can keep (where a GPU program keeps an
online one), then its values, nothing read past the sequence's own length. A speculative verify's 1 + k tokens are
more queries of the same task: the context is still read once.

The source is compiled on first use with the machine's C compiler (`gcc -O3 -march=native -fopenmp`, or `$CC`)
into the course's cache folder, keyed by the source, the flags and the CPU, and loaded with `ctypes`; OpenMP
binds to the runtime torch already loaded (the same `libgomp.so.1`), so the kernel and torch share one thread
pool. It reads an fp32 or a bf16 cache on the CPU, computing in fp32 (a bf16 query's scores, on a CPU with
AVX512-BF16, by the instruction that multiplies bf16 pairs exactly and adds them in fp32); `supports` says whether
a call qualifies.

Where this lives in vLLM: `csrc/cpu/attention.cpp` (`paged_attention_v1` / `_v2` for the CPU, in C++ with
vector intrinsics), called from `vllm/v1/attention/backends/cpu_attn.py`.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from solutions.envs import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MAX_HEAD_DIM = 256  # the C source's one fixed buffer
LANES = 16  # floats per vector in the C source: a head is a whole number of vectors


def _cpu_identity() -> str:
    """The CPU model and its feature flags: a library built with -march=native runs only where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))


@functools.cache
def _library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load the kernel library. `extra_flags` follow `FLAGS`: the tests
    build it with an instruction set turned off (`-mno-avx512bf16`), so that every path the source has for a CPU
    without it runs here too."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("the CPU paged-decode kernel needs a C compiler (gcc, or $CC); install gcc")
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *flags)).encode() + _cpu_identity().encode())
    target = cache_dir() / "cpu_kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        build = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True, text=True
        )
        if build.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{build.stderr}")
        os.replace(partial, target)  # atomic: a concurrent build never loads half a file
    library = ctypes.CDLL(str(target))
    for entry in (library.paged_decode_attention, library.paged_decode_attention_bf16):
        entry.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 8 + [ctypes.c_float]
        entry.restype = None
    return library


CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel reads the cache as; it computes in fp32


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors: on the CPU, a cache and queries of one dtype in `CACHE_DTYPES`,
    heads of a multiple of LANES up to MAX_HEAD_DIM."""
    head_dim = key_cache.shape[3]
    return (
        q.device.type == "cpu" and q.dtype == key_cache.dtype and key_cache.dtype in CACHE_DTYPES
        and head_dim % LANES == 0 and head_dim <= MAX_HEAD_DIM
    )


def c_paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, window: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q (Bd, Hq, D), over each sequence's paged context -> (Bd, Hq, D), in C.

    Or Q queries per sequence, q (Bd, Q, Hq, D) -> (Bd, Q, Hq, D): a speculative verify's 1 + k tokens, the last
    seeing `seq_lens[b]` tokens and each earlier one a token less (causal), all scored while the context is read
    once. `block_tables` (Bd, max_blocks) and `seq_lens` (Bd,) as the torch backend takes them. With a sliding
    `window`, each query sees only the last `window` of its positions (the C code's 0 is no window).
    """
    num_seqs, num_queries = q.shape[0], q.shape[1] if q.dim() == 4 else 1
    num_q_heads, head_dim = q.shape[-2:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    # Every tensor the C code reads is held by a name here until it returns: its memory must outlive the call.
    # The queries and the output are in the cache's dtype (the kernel computes in fp32).
    queries, keys, values = q.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    tables, lens = block_tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(queries)
    library = _library()
    entry = library.paged_decode_attention_bf16 if keys.dtype == torch.bfloat16 else library.paged_decode_attention
    entry(
        queries.data_ptr(), keys.data_ptr(), values.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
        num_seqs, num_queries, num_q_heads, num_kv_heads, head_dim, block_size, tables.shape[1], window or 0, scale,
    )
    return out
