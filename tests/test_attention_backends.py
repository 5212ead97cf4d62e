"""The attention backends' registry: one name -> one class, and each class says what it runs with (its devices,
where the forward pass is compiled around it, tensor parallelism). The engine's arguments and the model runner read
the class, so a new backend is a class and one line in `registry.py`: shown here with a backend the registry is
given by the test alone."""

import inspect

import pytest

from grading.tiny_models import tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.attention import registry
from solutions.attention.backend import AttentionBackend
from solutions.attention.torch_backend import TorchAttentionBackend
from solutions.engine.arg_utils import EngineArgs
from solutions.exceptions import ParameterError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("name", registry.ATTENTION_BACKENDS)
def test_every_backend_declares_what_the_protocol_asks(name):
    cls = registry.get_attention_backend(name)
    assert inspect.signature(cls.__init__).parameters.keys() == inspect.signature(
        AttentionBackend.__init__).parameters.keys(), "built as backend_cls(kv_cache, metadata)"
    assert set(cls.compiles_on) <= set(cls.devices) <= {"cpu", "cuda"}
    assert isinstance(cls.supports_tensor_parallel, bool)


def test_an_unknown_backend_is_refused_naming_the_option():
    for make in (lambda: registry.get_attention_backend("flash"), lambda: EngineArgs(attention_backend="flash")):
        with pytest.raises(ParameterError, match=r"attention_backend must be one of \('torch', 'inductor', 'triton'\)"):
            make()


class CountingBackend(TorchAttentionBackend):
    """The torch backend, counting the steps it is built for; CPU only, no tensor parallelism."""

    devices = ("cpu",)
    supports_tensor_parallel = False
    num_built = 0

    def __init__(self, kv_cache, metadata) -> None:
        type(self).num_built += 1
        super().__init__(kv_cache, metadata)


@pytest.fixture
def counting(monkeypatch):
    monkeypatch.setitem(registry._BACKEND_CLASSES, "counting", f"{__name__}.CountingBackend")
    monkeypatch.setattr(CountingBackend, "num_built", 0)


def test_a_registered_backend_runs_the_engine_with_no_other_change(counting):
    folder = str(tiny_checkpoint("llama-gqa"))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    want = [o.outputs[0].token_ids for o in LLM(model=folder).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(model=folder, attention_backend="counting")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert CountingBackend.num_built >= GREEDY.max_tokens, "the runner builds the registered class every step"


def test_the_engine_arguments_read_what_the_class_says(counting):
    with pytest.raises(ParameterError, match="tensor_parallel_size=2 runs with attention_backend 'torch' or 'triton'"
                       ) as e:
        EngineArgs(attention_backend="counting", tensor_parallel_size=2)
    assert e.value.parameter == "tensor_parallel_size"
    with pytest.raises(ParameterError, match="attention_backend='counting' runs on device 'cpu': on device='cuda' use "
                       "attention_backend 'torch' or 'triton'") as e:
        EngineArgs(attention_backend="counting", device="cuda")
    assert e.value.parameter == "attention_backend"
