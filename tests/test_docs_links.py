"""Every link from the README and docs/ to a file of the repository leads to a file that is there: a
figure's committed results (docs/results/), a plot, another page."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)  # [text](target) and [ref]: target


def test_every_link_to_a_file_of_the_repository_leads_to_one():
    broken = []
    for page in [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in LINK.finditer(page.read_text()):
            target = (match.group(1) or match.group(2)).split("#")[0]
            if not target or re.match(r"[a-z]+:", target):  # an anchor on the page, or http(s):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)
