"""The step a new maintainer can hold in their head: ``HybridMuon.step`` on one screen, a small strategy contract.

``HybridMuon.step`` (with the private method it is a wrapper of) is at most ~30 lines of code and
has McCabe cyclomatic complexity at most 10; the :class:`~muonkit.distributed.Strategy` ABC has at
most 8 public methods (whether a step applies is its guard's, :mod:`muonkit.distributed.guard`).
Each measure is checked against a fake that breaks it, so the test can fail.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

import muonkit
from muonkit.distributed import SingleDeviceStrategy, Strategy
from muonkit.distributed.guard import Guard

MAX_METHODS = 8
MAX_LINES = 30
MAX_COMPLEXITY = 10


def public_methods(cls: type) -> list[str]:
    """The public methods (functions, properties, cached properties) ``cls`` itself defines."""
    kinds = (property, functools.cached_property, staticmethod, classmethod)
    return sorted(
        name
        for name, value in vars(cls).items()
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, kinds))
    )


def complexity(node: ast.FunctionDef) -> int:
    """McCabe's cyclomatic complexity: 1 + one per branch (if, loop, except, ternary, comprehension
    loop and condition, match case) + one per extra operand of ``and``/``or``."""
    count = 1
    branches = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.match_case)
    for sub in ast.walk(node):
        if isinstance(sub, branches):
            count += 1
        elif isinstance(sub, ast.comprehension):
            count += 1 + len(sub.ifs)
        elif isinstance(sub, ast.BoolOp):
            count += len(sub.values) - 1
    return count


def measured(fn: Callable[..., Any]) -> tuple[ast.FunctionDef, int]:
    """``fn``'s tree and its lines of code a reader sees: its ``def`` and body, less its docstring,
    blank and comment-only lines (decorators not counted)."""
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef) and node.end_lineno is not None
    skip: set[int] = set()
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and first.end_lineno is not None:
        skip = set(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    code = [
        n
        for n in range(node.lineno, node.end_lineno + 1)
        if n not in skip and lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
    ]
    return node, len(code)


def delegate(cls: type, node: ast.FunctionDef) -> Callable[..., Any] | None:
    """The private method of ``cls`` that ``node`` returns the result of (``return self._x(...)``): what a
    trivial wrapper hands its whole work to."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Call):
            func = sub.value.func
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
                continue
            if func.attr.startswith("_") and inspect.isfunction(getattr(cls, func.attr, None)):
                return getattr(cls, func.attr)  # type: ignore[no-any-return]
    return None


def step_shape(cls: type) -> tuple[int, int]:
    """``(lines, complexity)`` of ``cls.step`` with the private methods it is a wrapper of."""
    fn: Callable[..., Any] | None = inspect.unwrap(cls.step)  # type: ignore[attr-defined]
    lines = total = 0
    seen = 0
    while fn is not None and seen < 4:
        node, count = measured(fn)
        lines += count
        total += complexity(node) - (1 if seen else 0)  # one function's worth of "1 +"
        fn = delegate(cls, node)
        seen += 1
    return lines, total


# ---------------------------------------------------------------- the library


def check_contract(cls: type) -> None:
    """``cls`` defines at most :data:`MAX_METHODS` public methods."""
    methods = public_methods(cls)
    assert len(methods) <= MAX_METHODS, f"{cls.__name__} has {len(methods)} methods: {methods}"


def check_step(cls: type) -> None:
    """``cls.step`` (with the method it wraps) fits on one screen, with few branches."""
    lines, total = step_shape(cls)
    assert lines <= MAX_LINES, f"{cls.__name__}.step is {lines} lines (with the method it wraps)"
    assert total <= MAX_COMPLEXITY, f"{cls.__name__}.step has cyclomatic complexity {total}"


def test_the_strategy_contract_has_at_most_eight_methods() -> None:
    check_contract(Strategy)
    assert "guard" in public_methods(Strategy)


def test_the_strategy_makes_the_guard_once() -> None:
    strategy = SingleDeviceStrategy()
    assert isinstance(strategy.guard, Guard) and strategy.guard is strategy.guard


def test_the_step_fits_on_one_screen() -> None:
    check_step(muonkit.HybridMuon)


# ---------------------------------------------------------------- the measures can fail


class _NineMethods(Strategy):
    def a(self) -> None: ...
    def b(self) -> None: ...
    def c(self) -> None: ...
    def d(self) -> None: ...
    def e(self) -> None: ...
    def f(self) -> None: ...

    @property
    def h(self) -> int:
        return 0

    @functools.cached_property
    def i(self) -> int:
        return 0

    def _private(self) -> None: ...

    def directions(self, params: list[torch.Tensor], updates: list[torch.Tensor], config: Any) -> list[torch.Tensor]:
        raise NotImplementedError


def test_a_contract_of_nine_methods_fails() -> None:
    assert len(public_methods(_NineMethods)) == 9  # a..f, h, i, directions; not _private, not inherited ones
    with pytest.raises(AssertionError, match="_NineMethods has 9 methods"):
        check_contract(_NineMethods)


class _Tangled:
    """A step whose wrapped method is long and branchy."""

    def step(self, closure: Any = None) -> Any:
        """Docstring lines are not counted."""
        try:
            return self._step(closure)
        except ValueError:
            raise

    def _step(self, closure: Any) -> Any:
        x = 0
        if closure and x:  # 2
            x += 1
        for i in range(3):  # 1
            x += i if i else 0  # 1
        while x > 10:  # 1
            x -= 1
        y = [i for i in range(3) if i]  # 2
        if x or y or closure:  # 3
            x = 1
        # a comment
        return x
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1
        x += 1


def test_a_long_branchy_step_is_measured_so_and_fails() -> None:
    lines, total = step_shape(_Tangled)
    assert total == 1 + 1 + 10 == 12  # step's except, _step's ten branches
    assert lines == 5 + 28  # the def lines counted, the docstring, the comment and blanks not
    with pytest.raises(AssertionError, match=r"^_Tangled\.step is 33 lines"):
        check_step(_Tangled)
    assert step_shape(_Branchy) == (8, 11)
    with pytest.raises(AssertionError, match=r"^_Branchy\.step has cyclomatic complexity 11"):
        check_step(_Branchy)


class _Branchy:
    """A short step with one branch too many."""

    def step(self, x: int) -> int:
        if x:  # 1
            return self._step(x)
        return 0

    def _step(self, x: int) -> int:
        while x and x > 1 and x > 2 and x > 3:  # 4
            x = 1 if x > 4 else 2  # 1
        return sum(i for i in range(x) if i if i > 1) or 0  # 4
