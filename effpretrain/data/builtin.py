"""The built-in corpus: the Python standard library's own sources and the pydoc topics text."""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

from effpretrain.errors import ConfigError

log = logging.getLogger("effpretrain")


_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


# ----------------------------------------------------------------------------------------------
# Documents


def builtin_documents() -> list[str]:
    """The standard library's .py sources (sorted by path, tests excluded) + pydoc topics."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test_"))
        paths.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    docs = []
    for p in sorted(paths, key=lambda q: q.relative_to(root).as_posix()):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(text)
    try:
        from pydoc_data.topics import topics

        docs.extend(topics[k] for k in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data
        pass
    if not docs:
        raise ConfigError(f"built-in corpus is empty: no .py sources found under the stdlib ({root.name})")
    return docs
