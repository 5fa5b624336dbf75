"""Hugging Face transformers: models from configs (no weights, no downloads)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("muonkit's Hugging Face integration needs transformers: pip install 'muonkit[hf]'") from e
    return transformers


def model_from_config(config: str | os.PathLike[str] | Mapping[str, Any], *, device: str = "meta") -> nn.Module:
    """Build a causal-LM (or base) model from a ``config.json`` path or dict, on ``device``.

    On the meta device no memory is allocated: a 16B-parameter model is built in seconds, which is
    all :func:`muonkit.explain` and the memory benchmark need.
    """
    transformers = _transformers()
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no 'model_type'; expected a Hugging Face config.json")
    for key in ("auto_map", "architectures", "_name_or_path", "transformers_version", "quantization_config"):
        data.pop(key, None)
    cfg = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device(device):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:
            return transformers.AutoModel.from_config(cfg)
