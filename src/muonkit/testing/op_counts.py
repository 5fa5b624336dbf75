"""Count what a step asks of the device: aten calls (kernel launches, roughly) and blocking host reads.

:class:`OpCounter` is a ``TorchDispatchMode``: every aten op run inside it is one **call** (on a
GPU each is about one kernel launch; views and other metadata-only ops are counted too, and are
also reported apart as ``views``). A nested op is not seen twice: the mode is off while it runs an
op, so ``torch._foreach_*`` is one call however many tensors it takes.

A **blocking read** is an op that makes the host wait for the device to deliver a value:

* the aten ops in :data:`HOST_READ_OPS`: ``_local_scalar_dense`` (what ``.item()``, ``float(t)``,
  ``bool(t)``, ``if t:`` run), ``equal``, ``is_nonzero`` and the ops whose output shape depends on
  the data (``nonzero``, ``masked_select``, ``unique``..., indexing with a boolean mask);
* ``Tensor.tolist()`` and ``Tensor.numpy()`` (``np.asarray(t)``): they read a CPU tensor's memory
  without any aten op, so the counter wraps them while it is active (each call is one read);
* a copy from an accelerator to the CPU (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor),
  unless ``non_blocking=True``.

A read counts when the tensor read lives on the device: on a GPU, any non-CPU tensor. A CPU run
stands in for a device run (every tensor is "on the device") except the tensors passed as
``host=``, those that would be on the CPU in a device run too (AdamW step counters, which
torch.optim and muonkit keep on the CPU): reads of them are free on a GPU and are not counted.
``host`` may be a callable, asked at each read (step counters a first step creates).
:func:`count_ops` on the CPU runs muonkit's accelerator path (:func:`as_on_an_accelerator`): on
the CPU itself muonkit reads values where a read waits for nothing and that is cheaper.

Example::

    with OpCounter(host=lambda: step_tensors(opt)) as counts:
        opt.step()
    print(counts.calls, counts.reads, counts.reads_by_op)
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GPT2_SCALE",
    "HOST_READ_OPS",
    "OpCounter",
    "OpCounts",
    "as_on_an_accelerator",
    "count_ops",
    "gpt2_hidden_params",
    "step_tensors",
]

HOST_READ_OPS = frozenset(
    {
        "_local_scalar_dense",
        "equal",
        "is_nonzero",
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "bincount",
    }
)
"""aten ops (overload packets) whose result the host must wait for: a Python scalar or a data-dependent shape."""

_COPIES = frozenset({"_to_copy", "copy_", "to"})


@dataclass
class OpCounts:
    """What the counted code did: aten calls (``views`` of them metadata-only) and blocking reads."""

    calls: int = 0
    views: int = 0
    reads: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    reads_by_op: Counter[str] = field(default_factory=Counter)


class OpCounter(TorchDispatchMode):
    """Counts aten calls and blocking host reads into :attr:`counts` (see the module docstring)."""

    def __init__(
        self,
        *,
        host: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]] = (),
        device: str | torch.device = "cpu",
    ) -> None:
        """``device``: where the counted code computes; on an accelerator every CPU tensor is a host
        tensor, on the CPU only those in ``host`` are."""
        super().__init__()
        self.counts = OpCounts()
        self._host = host
        self._cpu_run = torch.device(device).type == "cpu"
        self._patched: dict[str, Callable[..., Any]] = {}
        self._inside_read = 0

    def __enter__(self) -> OpCounts:
        super().__enter__()
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original
            setattr(torch.Tensor, name, self._reading(name, original))
        return self.counts

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        super().__exit__(*exc)

    def _reading(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._inside_read == 0:
                self._read(name, t)
            self._inside_read += 1  # the copy to the CPU a device tensor's tolist() makes is the same read
            try:
                return original(t, *args, **kwargs)
            finally:
                self._inside_read -= 1

        return wrapper

    def _read(self, name: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or not self._on_device(t):
            return
        self.counts.reads += 1
        self.counts.reads_by_op[name] += 1

    def _on_device(self, t: torch.Tensor) -> bool:
        if t.device.type == "meta":
            return False
        if t.device.type != "cpu":
            return True
        if not self._cpu_run:
            return False
        host = self._host() if callable(self._host) else self._host  # a callable: asked at each read
        return all(_storage(h) != _storage(t) for h in host)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.counts.calls += 1
        self.counts.by_op[name] += 1
        if func.is_view:
            self.counts.views += 1
        if self._inside_read == 0:
            if name in HOST_READ_OPS or (name == "index" and _boolean_index(args)):
                self._read(name, args[0] if args else None)
            elif name in _COPIES and _device_to_host(name, args, kwargs):
                self._read(name, args[1] if name == "copy_" else args[0])
        return func(*args, **kwargs)


def _boolean_index(args: tuple[Any, ...]) -> bool:
    """``x[mask]``: the output's size is the mask's count of true values, read from the device."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A blocking copy from an accelerator to the CPU (never counted in a CPU run: nothing moves)."""
    if kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]):
        return False
    if name == "copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"
    src, device = args[0], kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and src.device.type != "cpu"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


@contextmanager
def as_on_an_accelerator() -> Iterator[None]:
    """muonkit's steps run their accelerator path on the CPU (for counting): no decision read to the host.

    On the CPU, where a read waits for nothing, muonkit reads values when that is cheaper
    (:func:`muonkit.functional.orthogonalize.host_read_waits`); a CPU run that stands in for a
    device run counts the path a device takes.
    """
    orthogonalize: Any = importlib.import_module("muonkit.functional.orthogonalize")  # the module, not the function
    saved = orthogonalize.SYNCHRONOUS_DEVICES
    orthogonalize.SYNCHRONOUS_DEVICES = frozenset()
    try:
        yield
    finally:
        orthogonalize.SYNCHRONOUS_DEVICES = saved


def count_ops(
    fn: Callable[[], Any],
    *,
    host: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]] = (),
    device: str | torch.device = "cpu",
) -> OpCounts:
    """Run ``fn()`` under an :class:`OpCounter` and return its counts; on the CPU
    :func:`as_on_an_accelerator`."""
    cpu = torch.device(device).type == "cpu"
    with as_on_an_accelerator() if cpu else nullcontext(), OpCounter(host=host, device=device) as counts:
        fn()
    return counts


def step_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors of ``optimizer`` that live on the CPU in a device run too: its ``step`` counters and
    a muonkit strategy's host tensors (the agreement vector, :meth:`~muonkit.distributed.guard.Guard.host_tensors`).

    torch.optim (without ``capturable``/``fused``) and muonkit keep step counters on the CPU
    whatever the params' device, and muonkit's distributed strategies reduce what ranks must agree
    on over a CPU group, so reading them costs no sync; in a CPU run they are passed as ``host=``.
    """
    state = getattr(optimizer, "state", {})
    steps = [s.get("step") for s in state.values() if isinstance(s, dict)]
    host = [s for s in steps if isinstance(s, torch.Tensor) and s.device.type == "cpu"]
    guard = getattr(getattr(optimizer, "strategy", None), "guard", None)
    strategy_host = getattr(guard, "host_tensors", None)
    return host + list(strategy_host()) if callable(strategy_host) else host


GPT2_SCALE = 8
"""How much smaller than GPT-2's the matrices of :func:`gpt2_hidden_params` are, per side."""


def gpt2_hidden_params(layers: int) -> list[torch.nn.Parameter]:
    """The matrices calls per step are counted on: GPT-2's four hidden matrices per block (c_attn
    2304x768, attn c_proj 768x768, c_fc 3072x768, mlp c_proj 768x3072, as Linear weights) at
    1/:data:`GPT2_SCALE` of each side, fp32, with gradients; seeded, the same on every call.

    What decides the count is the chunking, so a count on them emulates the full-size chunks with
    budgets divided by ``GPT2_SCALE**2`` (the 2^22-element CPU chunks, 1/64 of a GPU's memory).
    """
    n = GPT2_SCALE
    shapes = [(2304 // n, 768 // n), (768 // n, 768 // n), (3072 // n, 768 // n), (768 // n, 3072 // n)]
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes * layers]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return params
