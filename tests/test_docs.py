"""The README and the guides in docs/: every ``python`` example runs, and the README stays short.

The ```` ```python ```` blocks of one page run in order in one namespace, as a reader would
type them, in a scratch directory, with warnings as errors. A block may be preceded by one
marker comment:

* ``<!-- not-run: REASON -->``: not run, for a thing this machine cannot have (several GPUs,
  several processes); the reason must be given.
* ``<!-- requires: MODULE -->``: run only where ``MODULE`` imports (an optional dependency).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


_BLOCK = re.compile(
    r"(?:<!--\s*(?P<marker>[\w-]+):\s*(?P<value>.*?)\s*-->\s*\n)?^```python\n(?P<code>.*?)^```",
    re.S | re.M,
)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _blocks(page: Path) -> list[tuple[int, str | None, str, str]]:
    text = page.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        found.append((line, m.group("marker"), m.group("value") or "", m.group("code")))
    return found


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks(page)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    ran = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for line, marker, value, code in blocks:
            where = f"{page.relative_to(ROOT)}:{line}"
            if marker == "not-run":
                assert value, f"{where}: a not-run marker must say why"
                continue
            if marker == "requires":
                if importlib.util.find_spec(value) is None:
                    continue
            elif marker is not None:
                raise AssertionError(f"{where}: unknown marker {marker!r}")
            exec(compile(code, where, "exec"), namespace)
            ran += 1
    if blocks:
        assert ran or all(m for _, m, _, _ in blocks)


def test_pages_have_examples_that_run() -> None:
    # The parser finds the blocks (a broken pattern would make every page pass).
    readme = _blocks(ROOT / "README.md")
    assert len(readme) >= 2 and all(m is None or m == "requires" for _, m, _, _ in readme)
    assert sum(len(_blocks(p)) for p in _pages()) >= 20


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300, len(lines)


def test_readme_links_resolve() -> None:
    # mkdocs --strict checks the links inside docs/; the README lies outside it.
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links to its guides"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing
