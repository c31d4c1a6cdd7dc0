"""Where benchmarks write their results: marked blocks in docs/*.md, rewritten in place.

docs/benchmarks.md holds several benchmarks' blocks (each between its own BEGIN/END markers) above
a hand-written analysis that starts at ANALYSIS_MARKER; `--write` replaces a benchmark's own
block and leaves everything else as it is.
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"  # the repository's docs/
# docs/benchmarks.md: `jlora bench --write` regenerates what is above this line and keeps the hand-written analysis below it.
ANALYSIS_MARKER = "<!-- hand-written analysis below: kept by `jlora bench --write` -->"


def write_block(doc: Path, begin: str, end: str, md: str, *, above_analysis: bool = True) -> None:
    """Put `md` between `begin`/`end` in `doc`: replacing the old block, else (`above_analysis`)
    just above the analysis marker, else at the end (creating the file)."""
    block = f"{begin}\n{md}\n{end}\n"
    text = doc.read_text() if doc.exists() else ""
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        text = head + block + "\n" + rest.partition(end)[2].lstrip("\n")
    elif above_analysis and ANALYSIS_MARKER in text:
        head, _, rest = text.partition(ANALYSIS_MARKER)
        text = head + block + "\n" + ANALYSIS_MARKER + rest
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + "\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def kept_block(text: str, begin: str, end: str) -> str:
    """The `begin`..`end` block of an existing document (with a blank line after), or ""."""
    if begin not in text or end not in text:
        return ""
    return begin + text.partition(begin)[2].partition(end)[0] + end + "\n\n"
