"""The house rules that a reader can check without running anything: no import circle in profiler/ (lazy imports
inside functions count too: a circle is a circle), and no function in profiler/ or dashboards/ over 60 lines but
the few named below with why."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
LONG = {  # function: why it may stay long (each still one idea); none may be added without a reason here
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The profiler modules this module imports anywhere in it (relative imports resolved; `from . import x` counts
    as module x where x is one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_circle_in_profiler():
    paths = {(_module(p)): p for p in (ROOT / "profiler").rglob("*.py")}
    graph = {name: _imports(path, name, set(paths)) for name, path in paths.items()}
    graph = {n: {m for m in deps if not n.startswith(m + ".") and m != n} for n, deps in graph.items()}  # a
    # module importing its own package's __init__ is not a circle of modules
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_function_over_60_lines_but_the_named_ones():
    long = {}
    for path in [*(ROOT / "profiler").rglob("*.py"), *(ROOT / "dashboards").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long[(str(path.relative_to(ROOT)), node.name)] = lines
    assert set(long) <= set(LONG), {k: v for k, v in long.items() if k not in LONG}
    assert set(LONG) <= set(long), f"no longer long, take off the list: {set(LONG) - set(long)}"


def test_the_command_lines_parser_and_help_import_no_torch():
    """attnprof --help (and every command's parser, built for each invocation) starts without torch: a second of CPU
    in every process that imports it, here 1.64 s of CPU against 0.48 s without."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom profiler.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n        main(['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'attnprof' in out.getvalue(), out.getvalue()\n"
            "print(sorted(m for m in ('torch', 'diffusers', 'pandas') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert "torch" not in done.stdout and "diffusers" not in done.stdout, done.stdout


# The roles of profiler/, lowest first (docs/layout.md): a module may import its own role and those below it, never one
# above. The commands sit on top and are not listed.
ROLES = [
    {"profiler.errors", "profiler.fmt", "profiler.spec", "profiler.env", "profiler.gpus", "profiler.devices"},
    {"profiler.unet"},
    {"profiler.attention"},
    {"profiler.store", "profiler.report.frame"},  # the stored rows, normalised as every reader reads them
    {"profiler.planner", "profiler.measure", "profiler.report"},
]


def _role(module: str) -> int:
    for rank, members in enumerate(ROLES):
        if any(module == m or module.startswith(m + ".") for m in members):
            return rank
    return len(ROLES)


def test_imports_run_down_the_roles():
    paths = {(_module(p)): p for p in (ROOT / "profiler").rglob("*.py")}
    upward = sorted((name, dep) for name, path in paths.items() for dep in _imports(path, name, set(paths))
                    if _role(dep) > _role(name) and dep != "profiler")
    assert not upward, upward


def test_no_folder_of_profiler_over_20_modules():
    """DESIGN.md: group files by role rather than letting one folder pass ~20 modules."""
    crowded = {str(d.relative_to(ROOT)): n for d in [ROOT / "profiler", *(ROOT / "profiler").rglob("*/")]
               if d.is_dir() and (n := len([*d.glob("*.py")])) > 20}
    assert not crowded, crowded
