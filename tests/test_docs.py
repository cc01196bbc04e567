"""The documentation site (docs/): it builds without warnings, its internal links resolve, every code
block of its pages runs or is marked as not run, the API reference covers every public name, and
the generated O1 table is current.

A code block is run when it is a ``python`` block; any other block (a shell command, an output, a
fragment that needs several processes or a GPU) carries ``<!-- not run: why -->`` on the line
above it. The Python blocks of a page run in order, in one namespace, in a temporary folder.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

import pytest

from apex_amp.amp.casting import docs_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<why>\S.*?) -->\s*$")
INCLUDE = re.compile(r"^```\{include\}\s+(?P<path>\S+)", re.M)
# The public modules whose __all__ the API reference must cover, and the page of each.
API_PAGES = {
    "apex_amp.amp": "api/amp.html",
    "apex_amp.optimizers": "api/optimizers.html",
    "apex_amp.optimizers.state_formats": "api/optimizers.html",
    "apex_amp.optimizers.state_conversion": "api/optimizers.html",
    "apex_amp.memory": "api/memory.html",
    "apex_amp.ops": "api/ops.html",
    "apex_amp.integrations.lightning": "api/integrations.html",
    "apex.parallel": "api/compat_apex.html",
    "apex.normalization": "api/compat_apex.html",
    "apex_C": "api/compat_apex.html",
}


@dataclass
class Block:
    source: str  # "page.md:line"
    language: str
    code: str
    not_run: Optional[str]


def code_blocks(text: str, name: str) -> list[Block]:
    """The fenced code blocks of a Markdown page (MyST directives other than code are not blocks)."""
    blocks, lines, index = [], text.split("\n"), 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        language = info.split()[0] if info else ""
        if not language.startswith("{"):
            indent = len(opening["indent"])
            code = "\n".join(line[indent:] for line in lines[index + 1:end])
            previous = NOT_RUN.match(lines[index - 1]) if index > 0 else None
            blocks.append(Block(f"{name}:{index + 1}", language, code, previous["why"] if previous else None))
        index = end + 1
    return blocks


def pages() -> dict[str, Path]:
    """Every Markdown page of the site, and every file a page includes, by path relative to docs/."""
    found = {}
    for path in sorted(DOCS.rglob("*.md")):
        if "_build" in path.parts:
            continue
        found[str(path.relative_to(DOCS))] = path
        for include in INCLUDE.finditer(path.read_text(encoding="utf-8")):
            included = (path.parent / include["path"]).resolve()
            found[str(included.relative_to(ROOT))] = included
    return found


PAGES = pages()


def page_blocks(name: str) -> list[Block]:
    return code_blocks(PAGES[name].read_text(encoding="utf-8"), name)


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_code_block_runs_or_is_marked_as_not_run(name, tmp_path, monkeypatch, one_thread):
    blocks = page_blocks(name)
    unmarked = [block.source for block in blocks if block.language != "python" and block.not_run is None]
    assert not unmarked, (f"code blocks that are not Python and not marked `<!-- not run: why -->`: {unmarked}")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs:{name}"}
    for block in blocks:
        if block.language == "python" and block.not_run is None:
            exec(compile(block.code, block.source, "exec"), namespace)  # noqa: S102 - the page's own code


def test_the_block_finder_sees_unmarked_marked_and_indented_blocks():
    text = ("```bash\nls\n```\n<!-- not run: needs two GPUs -->\n```python\nx = 1\n```\n"
            "- item\n\n  ```python\n  y = 2\n  ```\n```{toctree}\nindex\n```\n")
    blocks = code_blocks(text, "page.md")
    assert [(b.source, b.language, b.code, b.not_run) for b in blocks] == [
        ("page.md:1", "bash", "ls", None), ("page.md:5", "python", "x = 1", "needs two GPUs"),
        ("page.md:10", "python", "y = 2", None)]


def test_the_o1_rules_page_table_is_generated_from_the_rule_table():
    text = (DOCS / "o1_rules.md").read_text(encoding="utf-8")
    assert docs_table.replace_section(text) == text, (
        "docs/o1_rules.md's table is stale: run `python -m apex_amp.amp.casting.docs_table --update docs/o1_rules.md`")


class _Links(HTMLParser):
    """The ids of one HTML file and the href/src values it points to."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)
            elif key in ("href", "src") and value:
                self.targets.append(value)


def broken_internal_links(site: Path) -> list[str]:
    """Every link of the built site to a file of the site that is missing, or to an id it lacks."""
    parsed = {}
    for path in site.rglob("*.html"):
        links = _Links()
        links.feed(path.read_text(encoding="utf-8"))
        parsed[path.resolve()] = links
    broken = []
    for path, links in parsed.items():
        for target in links.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith("//"):
                continue  # external: not checked (no network)
            file = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                broken.append(f"{path.relative_to(site)}: {target} (no such file)")
            elif parts.fragment and file.suffix == ".html" and unquote(parts.fragment) not in parsed[file].ids:
                broken.append(f"{path.relative_to(site)}: {target} (no such anchor)")
    return broken


def test_the_link_checker_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "a.html").write_text('<a href="b.html#there">b</a><a href="#here">x</a><p id="here"></p>'
                                     '<a href="c.html">c</a><a href="b.html#nowhere">b</a><a href="https://x.org">x</a>')
    (tmp_path / "b.html").write_text('<h1 id="there">b</h1>')
    assert broken_internal_links(tmp_path) == ["a.html: c.html (no such file)", "a.html: b.html#nowhere (no such anchor)"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built from a clean state as docs/conf.py documents it, with warnings as errors."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, f"sphinx -W failed:\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
    return out / "html"


def test_the_site_builds_without_warnings_and_every_page_is_in_it(site):
    markdown_pages = [name for name in PAGES if not name.startswith("..") and (DOCS / name).exists()]
    for name in markdown_pages:
        assert (site / name).with_suffix(".html").exists(), f"docs/{name} was not built"
    assert (site / "digits_results.png").exists() or (site / "_images" / "digits_results.png").exists()


def test_every_internal_link_of_the_site_resolves(site):
    assert broken_internal_links(site) == []


def public_names(module_name: str) -> list[str]:
    # In a process of its own: the compat `apex` package must not be imported into the suite's.
    done = subprocess.run(
        [sys.executable, "-c", f"import sys, json; sys.path.insert(0, {str(ROOT / 'compat' / 'apex')!r}); "
                               f"import {module_name} as m; print(json.dumps(list(m.__all__)))"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module_name", sorted(API_PAGES))
def test_the_api_reference_documents_every_public_name(site, module_name):
    links = _Links()
    links.feed((site / API_PAGES[module_name]).read_text(encoding="utf-8"))
    missing = [name for name in public_names(module_name) if f"{module_name}.{name}" not in links.ids]
    assert not missing, (
        f"{API_PAGES[module_name]} lacks {missing}: autodoc leaves out names without a docstring of their own "
        f"(constants, re-exported data); give each an `.. autodata::` entry with a line of text in "
        f"docs/{API_PAGES[module_name].replace('.html', '.rst')}")
