"""QK-Clip's observation of transformers models, through the library's own attention interface.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)``. :func:`prepare` registers two attention functions,
``"muonkit_qk_clip_eager"`` and ``"muonkit_qk_clip_sdpa"`` (each with the mask function of the
implementation it wraps, so the model builds the same masks), and points the configs of the
observed modules at the one that wraps their implementation. The wrapper records the per-head
maximum of ``q . k * scale`` over the positions the wrapped function attends to (the mask it
gets; sdpa's ``is_causal`` when it gets none), then calls the original: the model's own
``eager_attention_forward``, or the registered ``sdpa``. Outputs are untouched.

Implementations that never form the logits (``flash_attention_*``, ``flex_attention``, paged
kernels) are refused with the name to use instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from muonkit.qk_clip.observe import slot_of

__all__ = ["WRAPPED", "prepare"]

WRAPPED = {"eager": "muonkit_qk_clip_eager", "sdpa": "muonkit_qk_clip_sdpa"}
"""Observable implementation -> the name of its observing wrapper."""


def _eager_of(module: nn.Module) -> Callable[..., Any] | None:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _sdpa_causal(
    module: nn.Module, query: Tensor, mask: Tensor | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """transformers' sdpa_attention_forward's own rule for passing ``is_causal`` to sdpa."""
    is_causal = kwargs.get("is_causal", args[2] if len(args) > 2 else None)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(query.shape[2] > 1 and mask is None and is_causal)


def _wrapper(implementation: str) -> Callable[..., Any]:
    def forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if implementation == "eager":
            delegate = _eager_of(module)
            if delegate is None:
                raise RuntimeError(f"QKClip: {type(module).__module__} has no eager_attention_forward to call")
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            delegate = ALL_ATTENTION_FUNCTIONS["sdpa"]
        slot = slot_of(module)
        if slot is not None:
            scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
            scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
            causal = implementation == "sdpa" and _sdpa_causal(module, query, attention_mask, args, kwargs)
            slot.observe(query, key, scale=scale, mask=attention_mask, causal=causal)
        return delegate(module, query, key, value, attention_mask, *args, **kwargs)

    forward.__name__ = f"muonkit_qk_clip_{implementation}"
    return forward


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for implementation, name in WRAPPED.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _wrapper(implementation))
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])


def prepare(modules: Sequence[nn.Module]) -> Callable[[], Callable[[], None]]:
    """Check that every module's attention implementation can be observed; return the switch.

    Raises ``ValueError`` (nothing changed yet) for an implementation other than eager/sdpa.
    Calling the returned function switches the configs and returns the function that undoes it.
    """
    configs: dict[int, tuple[Any, str]] = {}
    for module in modules:
        config: Any = module.config
        current = config._attn_implementation
        if current not in WRAPPED:
            raise ValueError(
                f"QKClip cannot observe attn_implementation={current!r} ({type(module).__name__}): it never forms the "
                f"logits; build or load the model with attn_implementation='sdpa' (or 'eager') to use QK-Clip"
            )
        if current == "eager" and _eager_of(module) is None:
            raise ValueError(
                f"QKClip cannot observe eager attention of {type(module).__name__}: {type(module).__module__} has no "
                "eager_attention_forward; use attn_implementation='sdpa'"
            )
        configs[id(config)] = (config, current)

    def switch() -> Callable[[], None]:
        if configs:
            _register()
        for config, current in configs.values():
            config._attn_implementation_internal = WRAPPED[current]

        def restore() -> None:
            for config, current in configs.values():
                if config._attn_implementation_internal == WRAPPED[current]:
                    config._attn_implementation_internal = current

        return restore

    return switch
