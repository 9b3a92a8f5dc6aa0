"""The text the project streams by default, shipped inside the package, and the one reader of text files.

`FRANKENSTEIN` is Project Gutenberg eBook #84 (Mary Wollstonecraft Shelley, "Frankenstein; Or, The Modern
Prometheus", public domain in the USA) with a short Gutenberg header and end line around the unchanged
body. Every documented perplexity and recall figure is of that body, so `read_text` returns it, and only
it: the text between the "*** START OF ..." and "*** END OF ..." marker lines when a file has them, the
whole file otherwise (any other text a user passes is streamed as it is).

`LICENSES` holds verbatim copies of common free-software licence texts (as Debian's base-files package ships
them; each may be copied verbatim, not changed). `GPL3` is the fact probe's second filler: a text not used to
build the recall tier; the lm-eval test data (tests/data/lm_eval_builtin) cuts its passages from the others.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FRANKENSTEIN = Path(__file__).resolve().parent / "frankenstein.txt"
LICENSES = Path(__file__).resolve().parent / "licenses"
GPL3 = LICENSES / "GPL-3"

# A Project Gutenberg marker line: "*** START OF THE PROJECT GUTENBERG EBOOK 84 ***" (older files: "THIS").
_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK[^\n]*\*\*\*[ \t]*$", re.MULTILINE)
_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK[^\n]*\*\*\*[ \t]*$", re.MULTILINE)


def gutenberg_body(text: str) -> str:
    """The text between a Project Gutenberg START line and the next END line (without the line break that
    ends the START line and the one before the END line); `text` itself when it has no such pair."""
    start = _START.search(text)
    if start is None:
        return text
    end = _END.search(text, start.end())
    if end is None:
        return text
    lo = start.end() + 1 if text.startswith("\n", start.end()) else start.end()
    hi = end.start() - 1 if end.start() > lo and text[end.start() - 1] == "\n" else end.start()
    return text[lo:hi]


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a file (universal newlines, as `open(path, encoding="utf-8")` reads it), reduced to
    its Project Gutenberg body when it has the marker lines. OSError / UnicodeDecodeError pass through."""
    with open(os.fspath(path), encoding="utf-8") as f:
        return gutenberg_body(f.read())
