"""Model registry: HF architecture name -> our implementation, imported lazily."""

from __future__ import annotations

from typing import Any

from chunkserve_contracts.registry import Registry

MODELS: Registry[type] = Registry(
    "model architecture",
    {
        "LlamaForCausalLM": "executor_svc.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "executor_svc.models.llama:MistralForCausalLM",
        "Qwen2ForCausalLM": "executor_svc.models.llama:Qwen2ForCausalLM",
    },
)


def supported_architectures() -> list[str]:
    return MODELS.names()


def check_architectures(architectures: list[str] | None) -> str:
    """The first supported name in a config's `architectures`; ValueError if there is none."""
    for arch in architectures or []:
        if arch in MODELS:
            return arch
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(supported_architectures())}"
    )


def get_model_class(config: Any) -> type:
    """The model class for an HF config (reads `config.architectures`)."""
    return MODELS.get(check_architectures(getattr(config, "architectures", None)))
