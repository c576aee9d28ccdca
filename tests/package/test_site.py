"""The documentation site as a reader sees it: the HTML MkDocs renders, not the Markdown it was written in.

``mkdocs build --strict`` catches broken links between pages and docstrings it cannot read, but not Markdown that
renders as something else: a table cell's ``\\|`` shown with its backslash, a list that ends at a code block (its next
item shown as a paragraph starting with "- "), an image or link to a file the site does not have. The site is built
once here, into a temporary folder, and every page is read.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import processes
import pytest
from processes import REPO, repo_env

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "material", "mkdocstrings")),
    reason="building the site needs the docs extra: pip install -e '.[docs]'",
)


class Page(HTMLParser):
    """What a reader meets on one page: its text, its paragraphs, and where its links and images point."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.paragraphs: list[str] = []
        self.links: list[str] = []
        self.images: list[str] = []
        self._paragraph: list[str] | None = None
        self._hidden = 0  # inside <script> or <style>: not shown

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag in ("script", "style"):
            self._hidden += 1
        elif tag == "p":
            self._paragraph = []
        elif tag == "a" and found.get("href"):
            self.links.append(str(found["href"]))
        elif tag == "img" and found.get("src"):
            self.images.append(str(found["src"]))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._hidden -= 1
        elif tag == "p" and self._paragraph is not None:
            self.paragraphs.append("".join(self._paragraph))
            self._paragraph = None

    def handle_data(self, data: str) -> None:
        if self._hidden:
            return
        self.text.append(data)
        if self._paragraph is not None:
            self._paragraph.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(folder)]
    done = processes.run(argv, timeout=300, env=repo_env({"NO_MKDOCS_2_WARNING": "1"}), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def pages(site: Path) -> dict[str, tuple[Path, Page, str]]:
    """Every page a reader can open (not the search index's or the theme's files), read."""
    found = {}
    for path in sorted(site.rglob("*.html")):
        relative = path.relative_to(site)
        if relative.parts[0] in ("assets", "search") or relative.name == "404.html":
            continue
        html = path.read_text()
        page = Page()
        page.feed(html)
        found[str(relative)] = (path, page, html)
    return found


def resolves(site: Path, page: Path, target: str) -> bool:
    """Whether a link or image of ``page`` names a file of the site (a folder: its index.html)."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith(("mailto:", "#")) or not parts.path:
        return True  # another site, or a place on this page
    path = unquote(parts.path)
    where = (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
    where = where.resolve()
    return where.is_file() or (where / "index.html").is_file()


def test_the_site_has_every_page_of_the_nav(site: Path) -> None:
    names = set(pages(site))
    assert {"index.html", "cli/index.html", "resuming/index.html", "monitor/index.html"} <= names
    assert len(names) >= 15


def test_no_page_shows_an_escaped_pipe(site: Path) -> None:
    shown = {name: re.findall(r".{0,30}\\\|.{0,30}", "".join(page.text)) for name, (_, page, _) in pages(site).items()}
    assert {name: found for name, found in shown.items() if found} == {}


def test_no_paragraph_is_a_list_item_that_fell_out_of_its_list(site: Path) -> None:
    # A list item after an indented code block that did not belong to the list renders as "<p>- **item**...".
    fallen = {
        name: [p[:80] for p in page.paragraphs if re.search(r"(^|\n)\s*[-*] \S", p)]
        for name, (_, page, _) in pages(site).items()
    }
    assert {name: found for name, found in fallen.items() if found} == {}


def test_no_list_item_announcing_a_code_block_ends_its_list_before_it(site: Path) -> None:
    # "...near misses:" as the last item of a list, the code block after the list: the block was meant inside the item
    # (indented too little), and the items after it start a new list.
    cut = {
        name: [
            m.group(0)[-120:] for m in re.finditer(r"[^<>]{0,80}:\s*</li>\s*</[ou]l>\s*<div class=\"highlight\"", html)
        ]
        for name, (_, _, html) in pages(site).items()
    }
    assert {name: found for name, found in cut.items() if found} == {}


def test_every_image_and_internal_link_names_a_file_of_the_site(site: Path) -> None:
    broken = {}
    for name, (path, page, _) in pages(site).items():
        missing = [target for target in page.images + page.links if not resolves(site, path, target)]
        if missing:
            broken[name] = sorted(set(missing))
    assert broken == {}
    images = [image for _, page, _ in pages(site).values() for image in page.images]
    assert any(image.endswith("headroom_chart.png") for image in images)  # the pages' own images were looked at


def test_no_guide_page_lists_api_members_in_its_table_of_contents(site: Path) -> None:
    # fp8.md's mkdocstrings blocks put about 70 internal classes, functions and attributes in its table of contents,
    # below the guide's 13 sections: the API is documented under api/, where every page lists its members.
    flooded = {}
    for name, (_, _, html) in pages(site).items():
        if name.startswith("api/") or "md-sidebar--secondary" not in html:
            continue
        sidebar = html.split("md-sidebar--secondary", 1)[1].split("md-content", 1)[0]
        members = re.findall(r'href="#(lightning_amp_plus\.[^"]+)"', sidebar)
        if members:
            flooded[name] = len(members)
    assert flooded == {}
    assert "#lightning_amp_plus.weights.fp8.convert" in pages(site)["api/fp8/index.html"][2]  # documented there


def test_a_name_in_a_tables_first_column_is_not_broken_mid_word(site: Path) -> None:
    # Material lets inline code break between any two letters: monitor.md's option names read `check_inter` / `val`
    # at 1300 px. The site's stylesheet lets code in a table's first column break only where text does.
    _, _, html = pages(site)["monitor/index.html"]
    assert 'href="../stylesheets/extra.css"' in html
    css = re.sub(r"/\*.*?\*/", "", (site / "stylesheets" / "extra.css").read_text(), flags=re.DOTALL)
    rule = re.search(r"\.md-typeset table:not\(\[class\]\) td:first-child code\s*\{([^}]*)\}", css)
    assert rule is not None
    assert "word-break: normal" in rule.group(1) and "overflow-wrap: normal" in rule.group(1)
    assert "<td><code>check_interval</code></td>" in html
