"""The docs as a reader meets them: snippets that paste into a Python prompt, links that exist,
no work log, and the numbers they state about the code equal to the code's."""

from __future__ import annotations

import code
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# How the work was done is history (CHANGELOG.md and git), never what the docs or the code say.
WORK_LOG = re.compile(r"pass(es)? *[0-9]|(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                      r"eleventh|twelfth) pass|device minutes|session|this wave|earlier wave", re.IGNORECASE)


def python_blocks(doc: Path) -> list[tuple[int, str]]:
    """(line, source) of every ```python block in a markdown file."""
    blocks, lines, start = [], doc.read_text().split("\n"), None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = i
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines[start:i - 1])))
            start = None
    return blocks


class _Prompt(code.InteractiveConsole):
    """Python's interactive prompt, fed a pasted block line by line, compiling without running."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    def runcode(self, code_obj) -> None:  # compiled is enough: nothing is run
        pass

    def showsyntaxerror(self, filename=None, **kwargs) -> None:
        self.errors.append(str(sys.exc_info()[1]))


def paste_errors(source: str) -> list[str]:
    """The syntax errors a Python prompt reports when `source` is pasted into it (then Enter)."""
    prompt = _Prompt()
    more = False
    for line in source.split("\n"):
        more = prompt.push(line)
    if more:
        prompt.push("")
    return prompt.errors


def test_paste_errors_sees_what_a_prompt_refuses():
    assert paste_errors("for x in y:\n    print(x)\nprint()") == ["invalid syntax (<console>, line 3)"]
    assert paste_errors("for x in y:\n    print(x)\n\nprint()") == []
    assert paste_errors("class A:\n    x = 1\n\n    y = 2")  # a blank line ends the class at a prompt
    assert paste_errors("a = f(\n    1,\n)\nprint(a)") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_snippets_paste_into_a_prompt(doc):
    blocks = python_blocks(doc)
    bad = {line: errs for line, src in blocks if (errs := paste_errors(src))}
    assert not bad, f"{doc.name}: blocks (by first line) a Python prompt refuses: {bad}"


def test_readme_has_its_snippets_and_its_server_example_is_greedy():
    readme = (ROOT / "README.md").read_text()
    blocks = [src for _, src in python_blocks(ROOT / "README.md")]
    assert any("LoRARequest(" in b and "generate_stream" in b for b in blocks)
    client = next(b for b in blocks if "OpenAI(" in b)
    calls = client.count("chat.completions.create(")
    assert calls and client.count("temperature=0") == calls  # the API's default 1.0 garbles a 135M model
    assert '"temperature": 0' in readme.partition("curl")[2]


def test_doc_links_exist():
    for doc in [*DOCS, ROOT / "CHANGELOG.md"]:
        for ref in set(re.findall(r"`?((?:docs|tests|jlora|notebooks|adapters)/[\w./-]+\.(?:md|py|ipynb|json))", doc.read_text())):
            assert (ROOT / ref).exists(), f"{doc.name} names {ref}, which does not exist"


def _comments_and_strings(path: Path) -> list[tuple[int, str]]:
    toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in toks if t.type in (tokenize.COMMENT, tokenize.STRING)]


def test_no_work_log_in_the_docs_or_the_code():
    hits = [f"{doc.name}:{i}: {line.strip()}" for doc in DOCS
            for i, line in enumerate(doc.read_text().split("\n"), 1) if WORK_LOG.search(line)]
    hits += [f"{p.relative_to(ROOT)}:{line}: {text.strip()[:80]}" for p in sorted((ROOT / "jlora").rglob("*.py"))
             for line, text in _comments_and_strings(p) if WORK_LOG.search(text)]
    assert not hits, "\n".join(hits)


def test_the_pallas_chunk_the_docs_state_is_the_code_s():
    from jlora.kernels.paged_attention_tpu import cache_lanes, default_chunk

    # The 1B shape (8 KV heads x 64, bf16) and the 8B's (8 x 128): 1,024 and 512, as docs/tpu.md says.
    assert default_chunk(cache_lanes(8, 64), 2) == 1024
    assert default_chunk(cache_lanes(8, 128), 2) == 512
    tpu = (ROOT / "docs" / "tpu.md").read_text()
    assert "1,024 key positions a loop step" in tpu and "else 512 (the 8B's 2 KB rows)" in tpu
