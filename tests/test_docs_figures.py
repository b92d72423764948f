"""Every figure a page quotes comes from a results file committed beside the docs, and the headline
figures are the values in their files.

A page names a run by its results file, `results/NAME.json`: the path the benchmark's command wrote
(results/ is not kept), whose committed copy is docs/results/NAME.json. UNCOMMITTED lists the files
that pages still cite from runs made before results were committed, which are to be measured again
or their figures removed: the list may only shrink (a file cited anew must be committed, and a
file committed or no longer cited must leave the list).
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"(?<![\w/.-])(?:docs/)?results/([\w.-]+\.json)")

UNCOMMITTED = {
    "colocated-6-amx-carry.json", "colocated-6-amx-p05.json", "colocated-6-amx.json",
    "colocated-6-epyc-auto.json", "colocated-6-epyc-deep-2.json", "colocated-6-epyc-deep.json",
    "colocated-6-p015.json", "colocated-6.json", "colocated-6b.json", "colocated.json", "demo.json",
    "depth-chat-star.json", "depth-chat.json", "depth-he-t07-before.json", "depth-llamacpp-chat2.json",
    "depth-llamacpp-he.json", "depth-llamacpp-he3.json", "depth-replay-he.json", "depth-replay-humaneval.json",
    "depth-tf-chat-epyc-auto-6.json", "depth-tf-chat-epyc-deep-6.json", "depth-tf-he-amx-2.json",
    "depth-tf-he-amx.json", "depth-tf-he-epyc-auto-2.json", "depth-tf-he-epyc-auto-6.json",
    "depth-tf-he-epyc-auto.json", "depth-tf-he-epyc-deep-6.json", "depth-tf-he.json",
    "depth-trace-humaneval.json", "depth-trace-tf-chat.json", "depth-trace-tf-he.json", "distributed-4.json",
    "distributed.json", "eagle-colocated.json", "fairness.json", "fuzz.json", "gateway.json",
    "latency-verify-latency.json", "latency.json", "llamacpp-chat.json", "llamacpp-remote-depth3.json",
    "llamacpp-remote.json", "memory.json", "multihost.json", "replay-check.json", "sampled-link.json",
    "sampled-q.json", "scale-ahead.json", "scale-amx-1-verify-latency.json", "scale-amx-2.json",
    "scale-amx-3.json", "scale-amx-4.json", "scale-amx-wait-1.json", "scale-depth-avx2.json",
    "scale-n4-epyc.json", "scale-n8-epyc.json", "scale-nfull-epyc-verify-latency.json", "scale-nfull-epyc.json",
    "scale-nfull.json", "scale.json", "serve-streams4-amx.json", "serve-streams4.json", "serve.json",
    "servers-model.json", "servers-verify-latency.json", "service.json", "slow-server-epyc.json",
    "slow-server.json", "soak.json", "soak2.json", "streams.json", "vllm-1row-stop.json", "vllm-1row.json",
    "vllm-2.json", "vllm-3.json", "vllm-3p.json", "vllm-4.json", "vllm-5.json", "vllm-6.json", "vllm-7.json",
    "vllm-9.json", "vllm-blocktime0.json", "vllm-fp32.json", "vllm-pre.json", "vllm.json",
}


def cited() -> dict[str, list[str]]:
    """Each results file a page names, with the pages that name it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for name in CITED.findall(page.read_text()):
            found.setdefault(name, []).append(str(page.relative_to(ROOT)))
    return found


def test_every_results_file_a_page_cites_is_committed_beside_the_docs():
    committed = {p.name for p in (ROOT / "docs" / "results").glob("*.json")}
    names = cited()
    missing = {f"{name} (cited by {', '.join(sorted(set(pages)))})" for name, pages in names.items()
               if name not in committed and name not in UNCOMMITTED}
    assert not missing, "cited, not committed in docs/results/: " + "; ".join(sorted(missing))
    stale = UNCOMMITTED & committed | UNCOMMITTED - set(names)
    assert not stale, f"committed or no longer cited: take them out of UNCOMMITTED: {sorted(stale)}"


def test_every_committed_results_file_says_what_made_it():
    """The command, the commit and the CPU, as results.write_json records them."""
    lacking = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        meta = json.loads(path.read_text()).get("meta", {})
        if not all(meta.get(key) for key in ("command", "commit", "cpu")):
            lacking.append(path.name)
    assert not lacking, f"no command, commit or CPU recorded: {lacking}"


def figure(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def first_screen_figures() -> dict[str, str]:
    """What the README's first screen quotes, as computed from its committed files."""
    demo = figure("demo-epyc-avx2.json")
    steps = sum(r["target_steps"] for r in demo["requests"])
    amx = figure("demo-xeon-amx.json")
    split = figure("vllm-split.json")["figures"]
    two = figure("vllm-split-x2.json")["figures"]
    serve = [x for f in ("vllm-serve-bf16.json", "vllm-serve-fp32.json")
             for per in figure(f)["figures"]["star"].values() for x in per["vs_alone"]]
    return {
        "demo requests": f"served {len(demo['requests'])} requests at once",
        "demo ratio": f"at {demo['system']['tokens_per_s'] / demo['system']['target_only_tokens_per_s']:.2f}x of",
        "demo drafted": f"drafting {sum(r['drafts'] for r in demo['requests'])} of {steps} steps",
        "demo on AMX": f"at {amx['system']['tokens_per_s'] / amx['system']['target_only_tokens_per_s']:.2f}x, drafting "
                       f"{sum(r['drafts'] for r in amx['requests'])} of {sum(r['target_steps'] for r in amx['requests'])}",
        "one instance": f"{split['star-real@0']['tokens_per_s'] / split['vllm-draft-4@0']['tokens_per_s']:.2f}x",
        "two instances": f"{two['star-real-x2@0']['tokens_per_s'] / two['vllm-draft-4-x2@0']['tokens_per_s']:.2f}x",
        "vllm serve": f"{min(serve):.2f}-{max(serve):.2f}x of `vllm serve` alone in {len(serve)} runs",
    }


def test_the_readmes_first_screen_quotes_its_committed_files():
    """The figures a newcomer reads first are the values in the files it links, as they are now."""
    screen = " ".join((ROOT / "README.md").read_text().splitlines()[:45])
    wrong = {k: v for k, v in first_screen_figures().items() if v not in screen}
    assert not wrong, f"the README's first screen does not say: {wrong}"
