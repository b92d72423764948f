"""Every figure a page quotes comes from a results file committed beside the docs, and the headline
figures are the values in their files.

A page names a run by its results file, `results/NAME.json`: the path the benchmark's command wrote
(results/ is not kept), whose committed copy is docs/results/NAME.json. Every file a page names is
committed; a paragraph or table that quotes a speed names one; the README's headline rows each link
theirs, and the first screen's figures are computed here from theirs.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"(?<![\w/.-])(?:docs/)?results/([\w.-]+\.json)")


def cited() -> dict[str, list[str]]:
    """Each results file a page names, with the pages that name it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in CITED.findall(page.read_text()):
            found.setdefault(name, []).append(str(page.relative_to(ROOT)))
    return found


def test_every_results_file_a_page_cites_is_committed_beside_the_docs():
    committed = {p.name for p in (ROOT / "docs" / "results").glob("*.json")}
    missing = {f"{name} (cited by {', '.join(sorted(set(pages)))})" for name, pages in cited().items()
               if name not in committed}
    assert not missing, "cited, not committed in docs/results/: " + "; ".join(sorted(missing))


def test_every_committed_results_file_says_what_made_it():
    """The command, the commit and the CPU, as results.write_json records them."""
    lacking = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        meta = json.loads(path.read_text()).get("meta", {})
        if not all(meta.get(key) for key in ("command", "commit", "cpu")):
            lacking.append(path.name)
    assert not lacking, f"no command, commit or CPU recorded: {lacking}"


SPEED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)|\d+(?:\.\d+)?\s*tokens/s")


def blocks(text: str) -> list[str]:
    """A page's paragraphs and list blocks, each one string, and each table with the paragraph just
    before it (its caption); code blocks and headings left out."""
    groups: list[tuple[str, list[str]]] = []  # (kind, lines); kind: text, table, gap or wall
    fenced = False
    for line in text.splitlines():
        fence = line.startswith("```")
        fenced ^= fence
        kind = ("wall" if fence or fenced or line.startswith("#") else "gap" if not line.strip()
                else "table" if line.startswith("|") else "text")
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(line)
        else:
            groups.append((kind, [line]))
    found: list[str] = []
    for i, (kind, lines) in enumerate(groups):
        before = [k for k, _ in groups[max(0, i - 2):i]]
        if kind == "table" and (before[-1:] == ["text"] or before == ["text", "gap"]):
            found[-1] += " " + " ".join(lines)
        elif kind in ("text", "table"):
            found.append(" ".join(lines))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name if p.parent == ROOT else f"docs/{p.name}")
def test_every_speed_figure_names_the_committed_file_that_holds_it(page):
    """A paragraph or table row that quotes a speed (a ratio such as 1.04x, or tokens/s) names a
    results file committed in docs/results/, or the paper it quotes (arXiv)."""
    committed = {p.name for p in (ROOT / "docs" / "results").glob("*.json")}
    bare = [b[:160] for b in blocks(page.read_text())
            if SPEED.search(b) and not set(CITED.findall(b)) & committed and "arXiv" not in b]
    assert not bare, f"{len(bare)} figures without their data:\n" + "\n".join(bare)


def headline_rows() -> list[list[str]]:
    """The README's headline table, a list of cells per row (the header and its rule left out)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Headline figures"):].split("\n\n| ", 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in ("| " + row if i == 0 else row).strip("|").split("|")]
            for i, row in enumerate(table.splitlines())][2:]


def test_every_headline_row_says_what_ran_and_links_its_committed_data():
    """Each row: a kind that says what was real, and data that is a committed results file (or the
    test suite, for what a test checks)."""
    committed = {p.name for p in (ROOT / "docs" / "results").glob("*.json")}
    kinds = ("real", "emulated", "replay", "test", "model")
    rows = headline_rows()
    assert len(rows) > 10
    for what, figure_, host, kind, data, detail in rows:
        assert any(k in kind for k in kinds), (what, kind)
        links = re.findall(r"\(docs/results/([\w.-]+\.json)\)", data)
        assert links and set(links) <= committed or data == "`make test`", (what, data)


def figure(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def first_screen_figures() -> dict[str, str]:
    """What the README's first screen quotes, as computed from its committed files."""
    demo = figure("demo-epyc-avx2.json")
    steps = sum(r["target_steps"] for r in demo["requests"])
    amx = figure("demo-xeon-amx.json")
    split = figure("vllm-split.json")["figures"]
    two = figure("vllm-split-x2.json")["figures"]
    split_epyc = figure("vllm-split-epyc-2.json")["figures"]
    two_epyc = figure("vllm-split-x2-epyc-2.json")["figures"]
    star = figure("vllm-serve-bf16-epyc-3.json")["runs"]
    sync = figure("vllm-serve-async-bf16-epyc.json")["runs"]
    return {
        "demo requests": f"served {len(demo['requests'])} requests at once",
        "demo ratio": f"at {demo['system']['tokens_per_s'] / demo['system']['target_only_tokens_per_s']:.2f}x of",
        "demo drafted": f"drafting {sum(r['drafts'] for r in demo['requests'])} of {steps} steps",
        "demo on AMX": f"at {amx['system']['tokens_per_s'] / amx['system']['target_only_tokens_per_s']:.2f}x, drafting "
                       f"{sum(r['drafts'] for r in amx['requests'])} of {sum(r['target_steps'] for r in amx['requests'])}",
        "one instance": f"{split['star-real@0']['tokens_per_s'] / split['vllm-draft-4@0']['tokens_per_s']:.2f}x",
        "two instances": f"{two['star-real-x2@0']['tokens_per_s'] / two['vllm-draft-4-x2@0']['tokens_per_s']:.2f}x",
        "one instance, EPYC": f"{split_epyc['star-real@0']['tokens_per_s'] / split_epyc['vllm-draft-4@0']['tokens_per_s']:.2f}x",
        "two instances, EPYC": f"{two_epyc['star-real-x2@0']['tokens_per_s'] / two_epyc['vllm-draft-4-x2@0']['tokens_per_s']:.2f}x",
        "vllm serve": f"at {over_passes(star, 'star', '1'):.3f}x for 1 request and {over_passes(star, 'star', '3'):.3f}x "
                      f"for 3, over 9 passes each",
        "async off": f"ran at {over_passes(sync, 'alone-sync', '1'):.3f}x and {over_passes(sync, 'alone-sync', '3'):.3f}x",
    }


def over_passes(runs: list[dict], mode: str, n: str, reference: str = "alone") -> float:
    """A bench vllm-serve mode's mean tokens/s over every pass of every run, over its reference's."""
    def mean(m: str) -> float:
        speeds = [x for run in runs for x in run[m]["sets"][n]["passes_tokens_per_s"]]
        return sum(speeds) / len(speeds)
    return mean(mode) / mean(reference)


def test_the_readmes_first_screen_quotes_its_committed_files():
    """The figures a newcomer reads first are the values in the files it links, as they are now."""
    screen = " ".join((ROOT / "README.md").read_text().splitlines()[:45])
    wrong = {k: v for k, v in first_screen_figures().items() if v not in screen}
    assert not wrong, f"the README's first screen does not say: {wrong}"
