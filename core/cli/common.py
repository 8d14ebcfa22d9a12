"""Shared CLI helpers: rich console, JSON output, decision rendering."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Width of tables written to a file or a pipe (a device run's log, CI): rich would assume 80
# columns there and cut the benchmark's cells to "…" (session 25's first logs were unreadable).
LOG_WIDTH = 220


def make_console(**kwargs: Any) -> Console:
    """A rich console; where it writes to no terminal and `COLUMNS` is unset, `LOG_WIDTH` wide."""
    c = Console(**kwargs)
    if not c.is_terminal and "width" not in kwargs and not os.environ.get("COLUMNS"):
        c = Console(width=LOG_WIDTH, **kwargs)
    return c


console = make_console()


def finite(data: Any) -> Any:
    """`data` with every NaN and infinity as None (JSON's null): JSON has no NaN, and parsers
    other than Python's (JavaScript's, jq) refuse the `NaN` that `json.dumps` writes by default."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def json_text(data: Any) -> str:
    """Strict JSON of moehal's machine-readable outputs (`finite`; anything else as its str)."""
    return json.dumps(finite(data), indent=2, default=str, allow_nan=False) + "\n"


def print_json(data: Any) -> None:
    print(json_text(data), end="")


def status_text(ok: bool, yes: str = "yes", no: str = "no") -> str:
    return f"[green]{yes}[/green]" if ok else f"[red]{no}[/red]"


def table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def cell(value: object) -> str:
    """Escape text for a rich table cell (format names contain square brackets)."""
    return escape(str(value))


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type`: an integer of at least `low` (a usage error, exit 2, otherwise)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    return parse


# --- output files (bench --out, conformance --report) ---------------------------------------


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (`os.umask` can only
    read it by setting it, which another thread's file creation could catch in between)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """`path` replaced in one step: `write(part)` writes a new file beside it, which is then
    renamed over it, so a run stopped mid-write (a time limit's SIGTERM, a full disk) leaves the
    previous file whole, not a truncated one that the next run's `output_problem` would refuse
    as not its own. Makes `path`'s folder where it is missing: here, when there is something to
    write, not in `output_problem` before the run (a run refused or stopped before its output
    left an empty folder behind). OSError as the folder, `write` or the rename raise it.

    `part` is made by `tempfile.mkstemp` (a random `.<name>.*.part` name created with O_EXCL, so
    never a file or link planted in the folder beforehand, and never another run's), written,
    synced to disk, given the mode of the file it replaces (or, for a new file, the umask's
    default rather than mkstemp's 0600), then renamed over `path`. On any failure it is removed
    and `path` is left as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode) & 0o777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        write(Path(name))
        made, now = os.fstat(fd), os.lstat(name)
        if (now.st_dev, now.st_ino) != (made.st_dev, made.st_ino):  # swapped in a shared folder
            raise OSError(errno.EEXIST, "the temporary file was replaced while it was written", name)
        os.fsync(fd)
        if os.chmod in os.supports_fd:
            os.chmod(fd, mode)
        else:
            os.chmod(name, mode)
        os.close(fd)
        fd = -1
        os.replace(name, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def output_files(path: str | Path, suffixes: tuple[str, ...]) -> tuple[Path, ...]:
    """The files a run writes for an output path (`bench --out`, `conformance --report`): PATH
    plus each of `suffixes`, where a PATH ending in one of them has it replaced (`run.json` ->
    run.json, run.png) and any other suffix is part of the name (`run.v2` -> run.v2.json, not
    run.json; `acme-0.1.2` keeps its `.2`). ValueError where PATH names no file ('.', '..', '',
    `runs/..`): such a path wrote hidden `./.json` files."""
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in suffixes else p
    if stem.name in ("", ".", ".."):
        raise ValueError(f"{str(path)!r} names no file")
    return tuple(stem.parent / f"{stem.name}{suffix}" for suffix in suffixes)


def output_problem(paths: Sequence[Path], ours: Callable[[Path], bool], what: str) -> str | None:
    """Why `paths` (files of one folder) could not be written, found before a run of minutes
    whose output would then be lost; None where they can. An existing file is replaced only
    where `ours(file)` says it is an earlier output of the same command (`what` names such a
    file): `--report README` once overwrote a project's README. Makes nothing: a missing folder
    is checked at its deepest existing ancestor (can a file, hence the folder, be made there?),
    and made when the files are written (`replace_file`)."""
    for f in paths:
        if f.is_dir():
            return f"{f} is a directory, not a file"
        if (f.exists() or f.is_symlink()) and not f.is_file():
            return f"{f} exists and is not a file"
        if f.exists() and not ours(f):
            return f"{f} exists and is not {what}: not overwritten (move it, or choose another path)"
    base = paths[0].parent
    while not (base.exists() or base.is_symlink()) and base != base.parent:
        base = base.parent  # (a dangling link stops here: the folder could not be made through it)
    if not base.is_dir():
        return f"cannot write to {base}: not a directory"
    try:
        with tempfile.TemporaryFile(dir=base):  # can a file be made there?
            pass
        for f in paths:
            if f.exists():
                with f.open("ab"):  # writable (opened without a change)
                    pass
    except OSError as exc:
        return f"cannot write to {exc.filename or base}: {exc.strerror or exc}"
    return None
