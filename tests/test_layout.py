"""The architecture as rules a test can check: which part may import which, and what the light
commands load. A newcomer finds each part by its folder; no part reaches into a higher one."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import starsd

ROOT = Path(starsd.__file__).parent
BASE = {"config", "errors", "prompts", "results"}
ALLOWED = {  # part -> the parts it may import besides itself
    "errors": set(), "config": {"errors"}, "prompts": {"errors"}, "results": set(),
    "theory": {"errors", "results"},  # analytical model and simulator: arithmetic, no torch
    "spec_decode": {"config", "errors"},  # the speculative core: pure tensor code
    "models": BASE | {"spec_decode"},
    "star": BASE | {"spec_decode", "models"},
    "emulate": BASE | {"theory", "spec_decode", "models", "star"},
    "serve": BASE | {"star"},  # the HTTP gateway: talks to target servers over the star's wire
    "vllm": BASE | {"spec_decode", "models", "star"},  # the proposer plug-in an unmodified vLLM drafts with
    "bench": BASE | {"theory", "spec_decode", "models", "star", "emulate", "serve", "vllm"},
    "train": BASE | {"spec_decode", "models"},  # training drafters offline: EAGLE heads on the target's features
    "cli": BASE | {"theory", "spec_decode", "models", "star", "emulate", "serve", "bench", "train", "vllm"},
}


def part(module: str) -> str:
    """starsd.star.server -> star; starsd.config -> config."""
    return module.split(".")[1]


def imports(path: Path) -> set[str]:
    """Every starsd module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("starsd.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("starsd"):
            package = ROOT.parent / node.module.replace(".", "/")
            if package.is_dir():  # from starsd import config; from starsd.star import protocol
                found |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                found.add(node.module)
    return found


def modules() -> dict[str, Path]:
    return {"starsd." + ".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in sorted(ROOT.rglob("*.py"))}


SHARED_BY_BENCHMARKS = {"harness", "metrics", "profiles", "recorded", "rss", "vllm_runs"}  # bench/'s helpers, no command


def test_no_benchmark_imports_another():
    """A benchmark takes what it shares with others from bench/'s helper modules, not from another."""
    leaning = []
    for module, path in modules().items():
        if part(module) == "bench" and module.count(".") == 2:
            leaning += [f"{module} imports {m}" for m in imports(path) if part(m) == "bench" and m.count(".") == 2
                        and m.split(".")[2] not in SHARED_BY_BENCHMARKS | {"__init__"}]
    assert not leaning, "\n".join(leaning)


def test_no_import_circle():
    """No module imports, through others, a module that imports it: at the top or inside a function
    (an import hidden in a function to break a circle is a circle all the same)."""
    graph = {m: {i for i in imports(p) if i in modules()} for m, p in modules().items()}
    circles = []

    def visit(module: str, path: list[str], seen: set[str]) -> None:
        for nxt in sorted(graph[module]):
            if nxt == path[0]:
                circles.append(" -> ".join(path + [nxt]))
            elif nxt not in seen and nxt > path[0]:  # each circle once, from its least module
                seen.add(nxt)
                visit(nxt, path + [nxt], seen)

    for start in sorted(graph):
        visit(start, [start], {start})
    assert not circles, "\n".join(circles)


def test_module_docstrings_say_what_in_a_screen():
    """A module's docstring says what it does and defines its terms; figures, runs and what was tried
    live on the docs page of its area."""
    long = []
    for module, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if doc.count("\n") + 1 > 20:
            long.append(f"{module}: {doc.count(chr(10)) + 1} lines")
    assert not long, "\n".join(long)


def test_no_part_imports_a_higher_one():
    broken = []
    for path in sorted(ROOT.rglob("*.py")):
        module = "starsd." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module == "starsd.__init__":
            continue
        mine = part(module)
        assert mine in ALLOWED, f"{module}: a part the rules do not know; add it to ALLOWED"
        broken += [f"{module} imports {m}" for m in imports(path) if part(m) not in ALLOWED[mine] | {mine}]
    assert not broken, "\n".join(broken)


def test_arithmetic_commands_load_no_torch_transformers_or_zmq(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"service_ms": {"1": 100.0, "8": 300.0}, "return_ms": 200.0,
                                   "tokens_per_iteration": 4.0, "target_only_ms_per_token": 150.0, "max_batch": 8}))
    probe = ("import sys; from starsd.cli import main; "
             "rc = main(sys.argv[1:]); heavy = [m for m in ('torch', 'transformers', 'zmq') if m in sys.modules]; "
             "print('HEAVY', heavy); sys.exit(rc)")
    for argv in (["model", "--from", str(profile), "--targets", "1,4"],
                 ["simulate", "--from", str(profile), "--targets", "1,4"]):
        run = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "HEAVY []" in run.stdout, (argv[0], run.stdout[-300:])


def test_auto_dtype_follows_the_hardware():
    """bf16 only where it is computed natively: on an AVX2-only CPU it is emulated, several times slower."""
    from starsd.config import PairConfig, resolve_dtype

    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("auto", "cuda:1") == "bfloat16"
    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    pair = PairConfig(device="cpu", draft_device="cuda", draft_quantize="none")
    assert pair.target_model().dtype == resolve_dtype("auto", "cpu") and pair.draft_model().dtype == "bfloat16"


def test_the_suites_schedule_names_modules_that_exist():
    """conftest's ALONE names test modules: a renamed module must not fall out of it unseen (it would run
    beside others)."""
    import conftest

    here = {p.stem for p in Path(__file__).parent.glob("test_*.py")}
    assert set(conftest.ALONE) <= here
