"""`kernels` and `solutions` import in any order and any install mode, and their kernels then launch.

Each case runs in a fresh Python process, since what matters is what was imported first:

- not installed, the checkout on PYTHONPATH (a fresh clone, a notebook started in the repository, `PYTHONPATH=.`):
  the process is started with `python -S` (no site-packages processing, so the editable install's finder and
  `.pth` never load) and given a view of site-packages — a folder of links to every entry but the course's own
  `.pth`, finder and `.dist-info` — with `site.addsitedir`. PYTHONPATH is a view of the checkout: links to its
  packages, without the `*.egg-info` an editable install leaves behind (a fresh clone has none). Every other
  dependency loads as usual, and the process checks that the course's distribution is not visible
  (`importlib.metadata` cannot find it) and that `kernels` comes from the checkout. There `transformers` finds
  the course's `kernels` folder when it probes for the Hub's `kernels` package, and imports it;
- installed (editable), from another directory.

Orders: transformers first (it imports Triton, without `TRITON_INTERPRET`, then `solutions`); Triton itself first;
and, with no GPU, `TRITON_INTERPRET=0`, where no interpreter may be switched on: importing still works and the
first launch raises, saying what to do.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DIST_NAME = "paged_attention_from_scratch"  # the course's distribution, as site-packages spells its files
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}

# A store and a decode launched on the device the kernels run on, checked against the PyTorch references.
LAUNCH = """
import torch, kernels
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
g = torch.Generator().manual_seed(0)
cache = torch.randn(4, 16, 2, 16, generator=g)
key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
slots = torch.tensor([0, 17, 40])
want_k, want_v = cache.clone(), cache.clone()
kernels.store_kv_cache_reference(key, value, want_k, want_v, slots)
got_k, got_v = cache.clone().to(device), cache.clone().to(device)
kernels.store_kv_cache(key.to(device), value.to(device), got_k, got_v, slots.to(device))
query, tables = torch.randn(2, 4, 16, generator=g), torch.tensor([[2, 1], [0, 3]], dtype=torch.int32)
seq_lens = torch.tensor([20, 7], dtype=torch.int32)
want = kernels.paged_decode_attention_reference(query, want_k, want_v, tables, seq_lens, 0.25)
got = kernels.paged_decode_attention(query.to(device), got_k, got_v, tables.to(device), seq_lens.to(device), 0.25,
                                     num_splits=2)
assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v), "store differs"
assert torch.allclose(got.cpu(), want, atol=1e-5), "decode differs"
print("LAUNCHED", kernels.interpreted())
"""

NOT_INSTALLED_CHECK = f"""
import importlib.metadata, importlib.util, sys
try:
    importlib.metadata.version({DIST_NAME!r})
    raise SystemExit("the course's distribution is visible: this process does not test the not-installed mode")
except importlib.metadata.PackageNotFoundError:
    pass
from pathlib import Path
origin = Path(importlib.util.find_spec("kernels").origin).resolve()
assert origin.is_relative_to({str(ROOT)!r}), f"kernels comes from {{origin}}, not from the checkout"
assert "triton" not in sys.modules and "kernels" not in sys.modules
"""


PACKAGES = ("kernels", "solutions", "grading", "benchmarks")


@pytest.fixture(scope="module")
def site_packages_without_the_course(tmp_path_factory) -> Path:
    """A folder of links to every site-packages entry except the course's own install files."""
    view = tmp_path_factory.mktemp("site-packages")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if DIST_NAME not in entry.name.lower().replace("-", "_"):
            (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def checkout_without_build_files(tmp_path_factory) -> Path:
    """A folder of links to the checkout's packages: what a fresh clone puts on PYTHONPATH."""
    view = tmp_path_factory.mktemp("checkout")
    for name in PACKAGES:
        (view / name).symlink_to(ROOT / name)
    return view


@pytest.fixture(scope="module")
def not_installed(site_packages_without_the_course, checkout_without_build_files) -> tuple[Path, Path]:
    return site_packages_without_the_course, checkout_without_build_files


def run_fresh(
    code: str, cwd: Path, *, view: tuple[Path, Path] | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: with `view` (site-packages view, checkout view), not installed (python -S,
    the first as site-packages, the second on PYTHONPATH); without, as installed."""
    env = dict(CLEAN_ENV if env is None else env)
    if view is not None:
        view, checkout = view
        env["PYTHONPATH"] = str(checkout)
        code = f"import site; site.addsitedir({str(view)!r})\n{NOT_INSTALLED_CHECK}\n{code}"
        argv = [sys.executable, "-S", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_launched(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LAUNCHED" in proc.stdout, proc.stdout[-2000:]


TRANSFORMERS_FIRST = """
import sys
from transformers import LlamaConfig
assert "triton" in sys.modules, "this case needs transformers to import Triton first"
from transformers.utils import is_kernels_available
assert not is_kernels_available(), "the course's kernels/ is not the Hub's `kernels` package"
import solutions
"""


def test_transformers_first_not_installed_then_solutions_then_a_launch(not_installed, tmp_path):
    assert_launched(run_fresh(TRANSFORMERS_FIRST + LAUNCH, tmp_path, view=not_installed))


def test_transformers_first_installed_then_solutions_then_a_launch(tmp_path):
    assert_launched(run_fresh(TRANSFORMERS_FIRST + LAUNCH, tmp_path))


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "not-installed"])
def test_triton_first_then_kernels_then_a_launch(installed, not_installed, tmp_path):
    code = "import triton, triton.language as tl\nimport kernels\n" + LAUNCH
    assert_launched(run_fresh(code, tmp_path, view=None if installed else not_installed))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels compile natively: nothing to switch")
def test_triton_first_then_a_triton_backend_engine(not_installed, tmp_path):
    """The whole engine, Triton imported first: greedy tokens of the Triton backend equal the torch backend's."""
    code = (
        "import triton\n"
        "from grading.tiny_models import tiny_checkpoint\n"
        "from solutions import LLM, SamplingParams\n"
        "folder, params = str(tiny_checkpoint('llama-gqa')), SamplingParams(temperature=0.0, max_tokens=4)\n"
        "llms = [LLM(model=folder, attention_backend=b) for b in ('torch', 'triton')]\n"
        "outs = [llm.generate([[1, 2, 3]], params, use_tqdm=False) for llm in llms]\n"
        "print(json.dumps([o[0].outputs[0].token_ids for o in outs]))\n"
    )
    proc = run_fresh("import json\n" + code, tmp_path, view=not_installed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_tokens, triton_tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert triton_tokens == torch_tokens and len(torch_tokens) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, TRITON_INTERPRET=0 is the native mode")
def test_no_interpreter_and_no_gpu_imports_and_fails_at_the_first_launch(tmp_path):
    env = CLEAN_ENV | {"TRITON_INTERPRET": "0"}
    code = "import kernels\nimport solutions\nprint('IMPORTED')\n" + LAUNCH
    proc = run_fresh(code, tmp_path, env=env)
    assert "IMPORTED" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode != 0 and "LAUNCHED" not in proc.stdout
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("RuntimeError: TRITON_INTERPRET=0 and there is no GPU"), proc.stderr[-3000:]
    assert "Unset TRITON_INTERPRET (or set it to 1)" in last_line
