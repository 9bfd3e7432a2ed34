"""The README stays a front door and the docs stay one site: size, strict build, links, each figure quoted once.

The docs rule (issue 21): a measured figure appears once in the tree, with its command and conditions, so that
re-measuring it changes one place. The headline figures live in the README's table (the site includes it into
docs/performance.md with pymdownx.snippets, so it is still written once); every other figure in one docs page.
A measured range with a unit ("119–161 ms") is distinctive enough to find a copy, so the checks below look for
those; single round numbers ("10 s", a default) are left alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from bucketrl.gateway.settings import GatewaySettings
from bucketrl.relay.settings import RelaySettings
from tests.deploy.support import SERVICES, env_names, settings_class

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_CHARS = 15_000

# A measured range with its unit: "48–65 s", "0.70–0.76 ms", "1,420–1,550 req/s", "0–1.9 %".
RANGE_WITH_UNIT = re.compile(r"\d[\d,.]*\s?[–-]\s?\d[\d,.]*\s?(?:ms|s|min|MB|GB|MiB|req/s|%|x|×)(?![\w/])")
# A figure's number without a unit as the headline table writes it: a decimal (range), a thousands number or a
# 1e-7 float; those of fewer than 3 digits ("0.3") are too common to mean a copy.
FIGURE_NUMBER = re.compile(r"\d[\d,]*\.\d+(?:e-?\d+)?(?:[–-]\d[\d,]*\.\d+)?|\d+(?:\.\d+)?e-\d+|\d,\d{3}(?:\.\d+)?")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _headline_figure_cells() -> list[str]:
    """The README's headline table, figure column (the second): the figures quoted there and only there."""
    text = README.read_text()
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    return [row.split(" | ")[1] for row in rows]


def test_the_readme_is_a_front_door_and_names_the_test_command() -> None:
    text = README.read_text()
    assert len(text) <= MAX_README_CHARS, f"README.md is {len(text)} characters; move detail into docs/"
    assert "make test" in text and "make demo" in text


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    # --strict turns every warning (a broken link or anchor, a page missing from the nav: mkdocs.yml's validation
    # section) into a failure.
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readmes_links_into_the_repo_resolve_to_files_and_headings() -> None:
    # The README is not part of the site, so mkdocs does not check it; GitHub renders these relative links.
    broken = []
    for target in LINK.findall(README.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        if not file.exists():
            broken.append(target)
            continue
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            if anchor not in {slugify(h.replace("`", ""), "-") for h in headings}:
                broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


def test_the_headline_figures_are_quoted_only_in_the_readme() -> None:
    cells = _headline_figure_cells()
    assert len(cells) >= 5, "the README's headline table was not found"
    numbers = {n for cell in cells for n in RANGE_WITH_UNIT.findall(cell)}
    numbers |= {n for cell in cells for n in FIGURE_NUMBER.findall(cell) if len(re.sub(r"\D", "", n)) >= 3}
    assert len(numbers) >= 10, numbers
    copies = {
        number: page.relative_to(ROOT).as_posix()
        for page in sorted(DOCS.rglob("*.md"))
        for number in numbers
        if re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", page.read_text())
    }
    assert not copies, f"headline figures quoted again in docs (link to the README's table instead): {copies}"


def test_no_measured_range_is_quoted_in_two_files() -> None:
    seen: dict[str, set[str]] = {}
    for page in _pages():
        for figure in RANGE_WITH_UNIT.findall(page.read_text()):
            seen.setdefault(re.sub(r"\s", "", figure), set()).add(page.relative_to(ROOT).as_posix())
    twice = {figure: sorted(files) for figure, files in seen.items() if len(files) > 1}
    assert not twice, f"figures quoted in more than one file (keep one, link to it): {twice}"


def test_every_setting_the_docs_name_is_one_a_service_reads() -> None:
    # A renamed or removed setting must not live on in the docs (tests/deploy checks the deploy files the same way).
    known = set().union(*(env_names(settings_class(component)) for component in SERVICES))
    known |= set(env_names(RelaySettings))  # the regional relay: no chart template (yet), so not in SERVICES
    known |= set(env_names(GatewaySettings))  # the TRL gateway (docs/trl.md): none either
    unknown = {
        page.relative_to(ROOT).as_posix(): sorted(names - known)
        for page in _pages()
        if (names := set(re.findall(r"\bBUCKETRL_[A-Z0-9_]*[A-Z0-9]\b", page.read_text()))) - known
    }
    assert not unknown, f"settings named in the docs that no service reads: {unknown}"
