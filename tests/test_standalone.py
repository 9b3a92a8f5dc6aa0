"""A clone stands alone: the default text ships inside the package (its body byte for byte the text every
documented figure was measured on), and no tracked file points outside the repository or reads like a
lab notebook (machine paths, work-tracking names, tool calls)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rsqr_jax import data
from rsqr_jax.eval.runtime import read_text

REPO = Path(__file__).resolve().parent.parent

# SHA-256 of the Frankenstein body (Project Gutenberg #84, front and back matter stripped) as raw bytes, and
# of the text every run read from it (UTF-8 decoded with universal newlines, the BOM kept), computed once
# from the file the documented perplexities were measured on.
BODY_BYTES_SHA256 = "2a0e3b25dac67d6d34d931642df8dd612b88f327ad6d64f319acbc9c8bb24471"
BODY_TEXT_SHA256 = "4932c0e7d6ae0310441d10811761ff6e280c6cb7f670c3caa6b4c237d6641301"
BODY_TEXT_CHARS = 418919

START = b"*** START OF THE PROJECT GUTENBERG EBOOK 84 ***\r\n"
END = b"\r\n*** END OF THE PROJECT GUTENBERG EBOOK 84 ***\r\n"


def test_shipped_body_is_the_measured_text_byte_for_byte():
    raw = data.FRANKENSTEIN.read_bytes()
    assert raw.count(START) == 1 and raw.count(END) == 1
    body = raw[raw.index(START) + len(START):raw.index(END)]
    assert hashlib.sha256(body).hexdigest() == BODY_BYTES_SHA256


def test_loader_returns_exactly_the_text_runs_saw_before():
    text = data.read_text(data.FRANKENSTEIN)
    assert len(text) == BODY_TEXT_CHARS
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == BODY_TEXT_SHA256
    assert read_text(data.FRANKENSTEIN) == text  # the experiments' reader goes through the same loader
    assert "Gutenberg" not in text and text.startswith("\ufeffLetter 1")


def test_shipped_file_carries_the_gutenberg_header_and_licence_note():
    head = data.FRANKENSTEIN.read_bytes().decode("utf-8")
    for line in ("Title: Frankenstein; Or, The Modern Prometheus", "Author: Mary Wollstonecraft Shelley",
                 "Release date: October 1, 1993 [eBook #84]", "Language: English",
                 "This eBook is for the use of anyone anywhere in the United States",
                 "www.gutenberg.org/license"):
        assert line in head, line
    assert head.index("Title:") < head.index("*** START OF") < head.index("*** END OF") < head.index("/license")


def test_loader_keeps_a_file_without_markers_whole(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_bytes(b"no markers\r\n*** START OF nothing ***\r\nstill the text\n")
    assert data.read_text(plain) == "no markers\n*** START OF nothing ***\nstill the text\n"
    only_start = tmp_path / "start.txt"
    only_start.write_text("head\n*** START OF THE PROJECT GUTENBERG EBOOK 1 ***\nbody\n")
    assert data.read_text(only_start) == "head\n*** START OF THE PROJECT GUTENBERG EBOOK 1 ***\nbody\n"
    marked = tmp_path / "marked.txt"
    marked.write_text("head\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nbody\n\n"
                      "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicence\n")
    assert data.read_text(marked) == "\nbody\n"  # one line break dropped on each side, no more


def test_commands_default_text_is_the_package_data_and_naming_it_imports_no_jax():
    code = "import sys; from rsqr_jax.cli.args import DEFAULT_TEXT; print(DEFAULT_TEXT, 'jax' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO / "scripts", capture_output=True, text=True, check=True)
    path, jax_imported = proc.stdout.split()
    assert Path(path) == data.FRANKENSTEIN and jax_imported == "False"  # flags are checked before jax loads


# What a tracked file must not mention: a path outside the repository, a machine path, work-tracking names
# (sessions, issues, branches), or a tool call. The patterns are written so this file does not match them.
FORBIDDEN = {
    "a path outside the repository": r"\.\./shared",
    "a machine path": r"/wor[k]/",
    "a work session": r"\bsessions? #?\d",
    "an issue number": r"\bissues?[- ]#?\d",
    "a branch": r"\b(?:k[c]ompile|k[o]pt|l[m]eval|lmstream[s]|repro[2]|h-(?:decode|drift|latency|ppl|recall|sweep))\b"
                r"|\bthis branc[h]\b|\bmain @ ?[0-9a-f]{7}",
    "a tool call": r"\brun\(comman[d]",
    "a work session or its team": r"\bthis sessio[n]\b|\bthe tea[m]\b|\bthe issue(?:'s| not[e])",
}
DOCS_ONLY = {"a temporary machine path": r"/tm[p]/"}
BINARY = {".png", ".jpg", ".gif", ".npz", ".gguf", ".safetensors", ".pdf", ".whl", ".gz", ".zip"}


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, names.decode().split("\0")):
        path = REPO / name
        if Path(name).suffix.lower() in BINARY or not path.is_file():
            continue
        raw = path.read_bytes()
        if b"\0" in raw[:8192]:
            continue
        yield name, raw.decode("utf-8", errors="replace")


def test_no_tracked_file_points_outside_or_reads_like_a_notebook():
    try:
        files = list(_tracked_text_files())
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert any(name == "README.md" for name, _ in files)
    hits = []
    for name, text in files:
        rules = dict(FORBIDDEN)
        if name == "README.md" or name.startswith("docs/"):
            rules.update(DOCS_ONLY)
        for what, pattern in rules.items():
            for m in re.finditer(pattern, text, re.IGNORECASE):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{name}:{line}: {what}: {m.group(0)!r}")
    assert not hits, "\n".join(hits)
