"""The package as a user installs it: a built wheel holds every module the commands, the lm-eval model and the
public API import, under the one import name `rsqr_jax`, and nothing of lab/ (the studies, benchmarks, device
tools and test support: rsqr_lab), nor matplotlib as a requirement; installed into a fresh virtual environment
(offline, its dependencies reused from this one) it runs the README's library example and the `rsqr-decode` entry
point from a directory outside the checkout."""

from __future__ import annotations

import ast
import os
import re
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the checkout's sources (an in-tree build/ would keep modules since removed)."""
    src, out = tmp_path_factory.mktemp("src") / "rsqr_jax", tmp_path_factory.mktemp("dist")
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "runs", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "-w", str(out), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("rsqr_jax-*.whl")
    return whl


def test_wheel_holds_every_module_under_one_import_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    (dist_info,) = [t for t in top if t.endswith(".dist-info")]
    assert top == {"rsqr_jax", dist_info}, top  # no generic top-level names (models, pallas_kernels, ...), no rsqr_lab
    in_wheel = {n for n in names if n.endswith(".py")}
    in_checkout = {p.relative_to(REPO).as_posix() for p in (REPO / "rsqr_jax").rglob("*.py")}
    assert in_checkout and in_checkout == in_wheel, sorted(in_checkout ^ in_wheel)
    assert "rsqr_jax/data/frankenstein.txt" in names
    assert "rsqr_jax/data/licenses/GPL-3" in names  # the second filler ships too
    assert "rsqr_jax/kernels/block_matvec.cc" in names  # the CPU kernels' sources, compiled on first use
    assert "rsqr_jax/kernels/page_scores.cc" in names
    assert "rsqr_jax/kernels/recalled_attention.cc" in names
    lab = [n for n in names if n.split("/")[1:2] in (["studies"], ["devtools"], ["testing"])]
    assert not lab, lab  # the studies, benchmarks, device tools and test support are lab/'s
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    for command, target in [("rsqr-decode", "rsqr_jax.cli.decode:run"), ("rsqr-eval-stream", "rsqr_jax.cli.eval_stream:run"),
                            ("rsqr-eval-tasks", "rsqr_jax.cli.eval_tasks:run")]:
        assert re.search(rf"^{command} = {re.escape(target)}$", entry_points, re.M), entry_points


def test_wheel_requires_no_plotting_library(wheel):
    """matplotlib (the studies' plots, the RULER command's --plot) is the `plot` extra's, not a requirement."""
    (meta,) = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA")]
    requires = re.findall(r"^Requires-Dist: (.+)$", zipfile.ZipFile(wheel).read(meta).decode(), re.M)
    plotting = [r for r in requires if r.lower().startswith("matplotlib")]
    assert plotting and all("extra ==" in r for r in plotting), plotting
    assert any(r.startswith("matplotlib") and 'extra == "plot"' in r for r in plotting), plotting


def test_lab_is_its_own_project_and_the_library_never_imports_it():
    """lab/ is the project rsqr_lab (the studies, benchmarks, device tools and test support), requiring rsqr_jax and
    matplotlib; nothing under rsqr_jax/ imports it, even inside a function, nor names it."""
    lab = tomllib.loads((REPO / "lab" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "rsqr_lab"
    assert {d.split(";")[0].strip() for d in lab["project"]["dependencies"]} >= {"rsqr_jax", "matplotlib"}
    assert lab["tool"]["setuptools"]["packages"]["find"]["include"] == ["rsqr_lab", "rsqr_lab.*"]
    for sub in ("studies", "devtools", "testing"):
        assert (REPO / "lab" / "rsqr_lab" / sub / "__init__.py").is_file(), sub
        assert not list((REPO / "rsqr_jax" / sub).rglob("*.py")), sub
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert root["tool"]["setuptools"]["packages"]["find"]["include"] == ["rsqr_jax", "rsqr_jax.*"]
    assert not [d for d in root["project"]["dependencies"] if d.startswith("matplotlib")]
    bad = []
    for path, module in package_modules():
        bad += [f"{module} imports {m}" for m in imported_names(path, module) if m.split(".")[0] == "rsqr_lab"]
        if "rsqr_lab" in path.read_text():
            bad.append(f"{path.relative_to(REPO)} names rsqr_lab")
    assert not bad, bad


def readme_library_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Library\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


@pytest.mark.slow
def test_wheel_in_a_fresh_environment_runs_the_readme_example_and_decode_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies (and the embedded model's package) come from this environment; rsqr_jax from the wheel only
    # (a path listed in a .pth file is added without running its own .pth files, so this environment's editable
    # install of the checkout stays out).
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    # a cache of its own: the installed copy's kernel source is compiled here, not a build from the checkout reused
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"RSQR_JAX_CACHE": str(tmp_path / "cache")}

    def run(*cmd, **kw):
        return subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True, text=True, timeout=900, **kw)

    probe = run(py, "-c", "import importlib.util as u, rsqr_jax; print(rsqr_jax.__file__); "
                          "print([n for n in ('models', 'pallas_kernels', 'scripts', 'tests', 'rsqr_lab') "
                          "if u.find_spec(n)])")
    assert probe.returncode == 0, probe.stderr
    location, stray = probe.stdout.splitlines()
    assert location.startswith(purelib) and stray == "[]", probe.stdout

    if shutil.which("c++"):  # the kernel builds from the installed source and is what decode runs on
        kernel = run(py, "-c", "from rsqr_jax.kernels import block_matvec as B; print(B.unavailable_reason())")
        assert kernel.returncode == 0 and kernel.stdout.strip() == "None", kernel.stdout + kernel.stderr[-2000:]
        assert list((tmp_path / "cache").glob("block_matvec-*.so"))
    (work / "example.py").write_text(readme_library_example())
    example = run(py, "example.py")
    assert example.returncode == 0, example.stderr[-3000:]
    assert example.stdout.strip(), "the example printed nothing"

    decode = run(venv / "bin" / "rsqr-decode", "--raw", "--prompt", "The capital of France is", "--max-new-tokens", "8",
                 "--temperature", "0", "--window", "64")
    assert decode.returncode == 0, decode.stderr[-3000:]
    assert decode.stdout.strip(), decode.stderr[-3000:]


# The layers of docs/design.md §7, lowest first, and what each may import of the package.
LAYERS = {
    "host": set(),  # rsqr_jax.host: imports nothing of ours
    "kernels": {"host", "kernels"},
    "core": {"host", "kernels", "core"},
    "models": {"host", "kernels", "core", "models"},
    "api": {"host", "kernels", "core", "models", "api"},  # the front door: a model and its preset
    "eval": {"host", "kernels", "core", "models", "api", "eval"},
}
APPS = {"cli"}  # may import any layer; nothing in a layer imports them (the studies and device tools are lab/'s)


def kind_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in set(LAYERS) | APPS:
        return parts[1]
    return "core"  # rsqr_jax itself, rsqr_jax.<module>, rsqr_jax.data


def imported_names(path: Path, module: str) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def imported_modules(path: Path, module: str) -> set[str]:
    """Every rsqr_jax module a file imports, at any depth (lazy imports inside functions count)."""
    return {m for m in imported_names(path, module) if m == "rsqr_jax" or m.startswith("rsqr_jax.")}


def package_modules():
    for path in sorted((REPO / "rsqr_jax").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        yield path, ".".join(parts)


def test_library_layers_import_downwards_only_and_never_a_study_or_a_command():
    known = {m for _, m in package_modules()}
    bad = []
    for path, module in package_modules():
        kind = kind_of(module)
        if kind in APPS or module == "rsqr_jax":
            continue
        for dep in imported_modules(path, module):
            if dep not in known and dep.rsplit(".", 1)[0] in known:
                dep = dep.rsplit(".", 1)[0]  # `from pkg import name`: the name is not a module
            if kind_of(dep) not in LAYERS[kind]:
                bad.append(f"{module} ({kind}) imports {dep} ({kind_of(dep)})")
    assert not bad, "\n".join(bad)


def test_no_code_imports_a_generic_top_level_name():
    bad = []
    for path in sorted(p for d in ("rsqr_jax", "lab", "scripts", "tests") for p in (REPO / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(REPO)}: {n}" for n in names
                    if n.split(".")[0] in {"models", "pallas_kernels", "experiments", "_common"}]
    assert not bad, bad


def test_module_names_are_unique_across_the_package_the_lab_and_the_scripts():
    seen: dict[str, list[str]] = {}
    for path in sorted(p for d in ("rsqr_jax", "lab/rsqr_lab") for p in (REPO / d).rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(path.relative_to(REPO).as_posix())
    for path in sorted((REPO / "scripts").glob("*.py")):
        # A launcher of an installed command shares its command's name and holds nothing else.
        if re.fullmatch(rf'(#![^\n]*\n)?"""[^\n]*"""\s+from rsqr_jax\.cli\.{path.stem} import run\s+'
                        r'if __name__ == "__main__":\s+run\(\)\s*', path.read_text()):
            continue
        seen.setdefault(path.stem, []).append(path.relative_to(REPO).as_posix())
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared
