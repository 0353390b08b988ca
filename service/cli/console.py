"""The CLI's consoles, each a rich Console made on first use.

rich is a fifth of a client command's start (~40 ms): `trainjobs --help`, a bad argument and `trainjobs logs`
print nothing rich draws, so a command imports it only when it prints through a console (issue 43). Modules
that draw a table or a styled line import rich.table or rich.text in the function that does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


class LazyConsole:
    """`Console(**options)`, made at the first attribute asked of it (`console.print`, `console.is_terminal`)."""

    def __init__(self, **options: Any):
        self._options, self._console = options, None

    @property
    def real(self) -> Console:
        """The Console itself: what rich's own objects are handed (Progress, Live: `with console:`)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def real(console: Console | LazyConsole) -> Console:
    return console.real if isinstance(console, LazyConsole) else console
