"""Flax NNX's `traversals.flatten_to_sequence` without its reference cycle.

Flax 0.12's version recurses through a nested function that closes over its result list and over
itself, so every call (under `nnx.state` + `nnx.to_flat_state`, `nnx.merge`, `nnx.update`) leaves a
cycle holding the flattened Variables. They are the model's own Variables, so the arrays they hold,
or are given later (the streaming loader fills the abstract model's Params), stay alive until the
cyclic collector's next full pass: with the collector off, a dropped tiny-model `LLM` kept its
25 MB of weights. This version recurses through a module-level function and returns the same list.
`install()` (jlora.models does it at import) puts it in place of Flax's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax.nnx import traversals


def flatten_to_sequence(xs: Mapping[Any, Any], /, *,
                        is_leaf: Callable[[tuple[Any, ...], Any], bool] | None = None) -> list[tuple[Any, Any]]:
    """`flax.nnx.traversals.flatten_to_sequence`: [(key path, leaf)] in the mapping's order."""
    assert isinstance(xs, Mapping), f"expected Mapping; got {type(xs).__qualname__}"
    result: list[tuple[Any, Any]] = []
    _flatten(xs, (), is_leaf, result)
    return result


def _flatten(xs: Any, prefix: tuple[Any, ...], is_leaf: Any, result: list[tuple[Any, Any]]) -> None:
    if not isinstance(xs, Mapping) or (is_leaf and is_leaf(prefix, xs)):
        result.append((prefix, xs))
    else:
        for key, value in xs.items():
            _flatten(value, (*prefix, key), is_leaf, result)


def install() -> None:
    traversals.flatten_to_sequence = flatten_to_sequence
