"""Closable: `close()` once, `with` blocks, and a clear error when a closed object is used."""

from __future__ import annotations

from typing import Any


class Closable:
    """Subclasses free what they hold in `_release()`; `close()` runs it once (idempotent), `with`
    closes on leaving, and `_check_open()` raises RuntimeError naming `_closed_name` after it."""

    closed: bool = False
    _closed_name = "this engine"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._release()

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self._closed_name} is closed")
