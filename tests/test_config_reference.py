"""The docs stay true to the code: docs/config.md is what `dynjax.config_reference` writes
today, and every relative link of README.md and docs/ reaches a file (and its #anchor)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dynjax import config_reference
from dynjax.config import default_config, valid_keys

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_config_md_is_what_the_generator_writes():
    # A fresh process: tests register toy plugins, whose sections are no part of the reference.
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-m", "dynjax.config_reference", "--check", "docs/config.md"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_descriptions_table_holds_only_keys_without_a_source_comment():
    keys = set(valid_keys(default_config()))
    comments = config_reference.all_comments()
    assert set(config_reference.DESCRIPTIONS) <= keys
    assert not [k for k in config_reference.DESCRIPTIONS if comments.get(k)]


def test_key_comments_reads_the_lines_above_and_the_end_of_the_line():
    source = """
    def config():
        c = ConfigDict()
        c.a = ConfigDict()  # section a
        # first line
        # second line
        c.a.b = 1  # and its end
        c.a.c = 2

        c.d = 3
    """
    assert config_reference.key_comments(source, "p") == {
        "p.a": "section a",
        "p.a.b": "first line second line and its end",
        "p.a.c": "",
        "p.d": "",
    }


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, a repeated
    one numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)
