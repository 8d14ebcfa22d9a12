"""Every fenced python block of README.md and docs/**/*.md (not docs/device-runs/, the device
runs' own records) runs as written, each in a fresh process with a timeout.

A block's marker is an HTML comment alone on the line right before its opening fence; mkdocs
passes it through as a comment, so readers see nothing. No marker: the block runs on the CPU as
written (and in full where there is a GPU). Otherwise `<!-- sample: WORD key=value ... -->`:

- `continues`: runs after the page's previous python block, in the same process (its names
  are defined there). The first block of the chain carries the chain's other marker words.
- `gpu`: needs a CUDA GPU. With one it runs in full (`nproc=N`: under torchrun, N ranks; it
  needs N GPUs). Without one it is not skipped: the static check below must pass and, with
  `raises=ERROR`, running it must stop with that typed moehal error (e.g. `ConfigError` for
  `device="cuda"` on a CPU build of torch) and no other.
- `pythonpath=DIR`: runs with DIR (from the repository root) on PYTHONPATH, nothing installed.
- `installed=DIR`: runs with the package in DIR as `pip install --target` leaves it: its
  sources (`[tool.setuptools.packages.find] where`) on the path, and a dist-info that carries the
  entry points of DIR/pyproject.toml, so `moehal` discovers it; no pip, no network.
- `checkpoint=VAR`: the block's `VAR = "<hub id>"` is pointed at a tiny random checkpoint of
  that model family, made locally for the run (no download; HF_HUB_OFFLINE=1); the rest of the
  block runs as written.
- `skip reason="..."`: not run, with the reason (a multi-process launch, a download); only
  with a reason.

Every block, whatever its marker, also gets the static check: each `moehal` module it imports
and each attribute it reads off one (`moehal.X.Y`, `dc.run_ep_case`) must resolve, and each call
of a moehal callable must bind to its signature, in code the run does not reach too. A block
that is only a `--8<--` include (mkdocs snippets) shows a file that CI runs where it lives: it is
skipped with that reason once the file is found and compiles. A marker word or key not listed
here, a marker not right before a python block, `continues` with nothing to continue, or `skip`
without a reason fails `test_every_block_is_accounted_for` and the block's own test.

The runs go two at a time (CI has 2 cores), longest chains first; TRITON_INTERPRET=1 without a
GPU, as CI sets it. A failing block's traceback names its page: the script keeps the page's line
numbers (every line that is not the block's code is blank).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import moehal
import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(
    p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] not in ("device-runs", "_hooks")
)
TIMEOUT_S = 150  # one block or chain; the whole file takes well under a minute on 2 cores
WORKERS = max(1, min(2, os.cpu_count() or 1))
ON_GPU = torch.cuda.is_available()

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*sample:(.*?)-->\s*$")
_ANY_MARKER = re.compile(r"^\s*<!--\s*sample:")
_PYTHON = {"python", "py", "python3"}
_WORDS = {"continues", "gpu", "skip"}
_KEYS = {"raises": "gpu", "nproc": "gpu", "reason": "skip", "pythonpath": None, "installed": None, "checkpoint": None}
_INCLUDE = re.compile(r"""^\s*--8<--\s+["']?([^"'\s]+)["']?\s*$""")


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # the opening fence's line (1-based)
    code_lines: list[tuple[int, str]]  # (page line, code dedented)
    words: set[str] = field(default_factory=set)
    opts: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def code(self) -> str:
        return "\n".join(text for _, text in self.code_lines)

    @property
    def includes(self) -> list[str] | None:
        """The files a block made only of `--8<--` lines includes, else None."""
        lines = [text for _, text in self.code_lines if text.strip()]
        found = [_INCLUDE.match(text) for text in lines]
        if lines and all(found):
            return [m.group(1) for m in found if m]
        return None


@dataclass
class Chain:
    blocks: list[Block]

    @property
    def head(self) -> Block:
        return self.blocks[0]

    @property
    def id(self) -> str:
        return self.head.where + "".join(f"+{b.line}" for b in self.blocks[1:])

    @property
    def errors(self) -> list[str]:
        return [e for b in self.blocks for e in b.errors]


def _parse_marker(text: str, where: str) -> tuple[set[str], dict[str, str], list[str]]:
    words: set[str] = set()
    opts: dict[str, str] = {}
    errors: list[str] = []
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        return words, opts, [f"{where}: marker {text!r} does not parse: {exc}"]
    for tok in tokens:
        key, eq, value = tok.partition("=")
        if not eq:
            if tok not in _WORDS:
                errors.append(f"{where}: unknown marker word {tok!r} (known: {sorted(_WORDS)}, {sorted(_KEYS)})")
            words.add(tok)
        elif key not in _KEYS:
            errors.append(f"{where}: unknown marker key {key!r} (known: {sorted(_KEYS)})")
        elif not value:
            errors.append(f"{where}: marker key {key!r} has no value")
        else:
            opts[key] = value
    for key in opts:
        needs = _KEYS.get(key)
        if needs and needs not in words:
            errors.append(f"{where}: {key}= goes with the word {needs!r}")
    if "skip" in words and not opts.get("reason", "").strip():
        errors.append(f'{where}: skip needs reason="..."')
    if "continues" in words and (words - {"continues"} or opts):
        errors.append(f"{where}: a continued block takes no other marker: put it on the chain's first block")
    if "nproc" in opts and not opts["nproc"].isdigit():
        errors.append(f"{where}: nproc must be a number of ranks")
    if "raises" in opts and not (
        isinstance(getattr(moehal, opts["raises"], None), type)
        and issubclass(getattr(moehal, opts["raises"]), moehal.MoEHalError)
    ):
        errors.append(f"{where}: raises={opts['raises']} is no moehal error type")
    return words, opts, errors


def extract(pages: list[Path] = PAGES) -> tuple[list[Block], list[str]]:
    """Every python block of `pages`, with its marker; and the errors outside any block (a
    marker before something that is not a python block)."""
    blocks: list[Block] = []
    stray: list[str] = []
    for path in pages:
        page = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m:
                if _ANY_MARKER.search(lines[i]) and not (
                    _MARKER.match(lines[i]) and i + 1 < len(lines) and _FENCE.match(lines[i + 1])
                ):
                    stray.append(f"{page}:{i + 1}: a sample marker must stand alone right before a python block")
                i += 1
                continue
            indent, fence, lang, _ = m.groups()
            j = i + 1
            while j < len(lines) and not (
                lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
            ):
                j += 1
            marker = _MARKER.match(lines[i - 1]) if i else None
            if lang.lower() in _PYTHON:
                code = [
                    (n + 1, lines[n][len(indent) :] if lines[n].startswith(indent) else lines[n])
                    for n in range(i + 1, j)
                ]
                block = Block(page, i + 1, code)
                if marker:
                    block.words, block.opts, block.errors = _parse_marker(marker.group(1), f"{page}:{i}")
                blocks.append(block)
            elif marker:
                stray.append(f"{page}:{i}: a sample marker before a {lang or 'plain'} block, not a python one")
            i = j + 1
    return blocks, stray


def chains(blocks: list[Block]) -> list[Chain]:
    out: list[Chain] = []
    for b in blocks:
        if "continues" in b.words:
            prev = out[-1] if out and out[-1].head.page == b.page else None
            if prev is None:
                b.errors.append(f"{b.where}: continues, but it is the page's first python block")
            elif prev.head.includes is not None or prev.head.words & {"skip"}:
                b.errors.append(f"{b.where}: continues a block that is not run ({prev.head.where})")
            else:
                prev.blocks.append(b)
                continue
        out.append(Chain([b]))
    return out


BLOCKS, STRAY = extract()
CHAINS = chains(BLOCKS)


# --- the static check ---------------------------------------------------------------------------


def _resolve(dotted: str) -> object:
    """A moehal module, or an attribute of one (`moehal.weights.local_slice`)."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[: k + 1]))  # a submodule not imported yet
            except ModuleNotFoundError:
                raise AttributeError(f"{'.'.join(parts[:k])} has no {part!r}") from None
    return obj


def static_problems(code: str) -> list[str]:
    """What in `code` names a moehal module or attribute that does not exist, or calls a moehal
    callable with arguments its signature does not take."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"does not parse: {exc}"]
    bound: dict[str, str] = {}  # local name -> the dotted moehal path it stands for
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "moehal":
                    bound[a.asname or "moehal"] = a.name if a.asname else "moehal"
                    try:
                        importlib.import_module(a.name)
                    except ImportError as exc:
                        problems.append(f"line {node.lineno}: import {a.name}: {exc}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "moehal":
            for a in node.names:
                try:
                    _resolve(f"{node.module}.{a.name}")
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
                except (ImportError, AttributeError) as exc:
                    problems.append(f"line {node.lineno}: from {node.module} import {a.name}: {exc}")

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return f"{base}.{expr.attr}" if base else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and (path := dotted(node)):
            try:
                _resolve(path)
            except (ImportError, AttributeError) as exc:
                problems.append(f"line {node.lineno}: {path}: {exc}")
        if isinstance(node, ast.Call) and (path := dotted(node.func)):
            try:
                fn = _resolve(path)
                sig = inspect.signature(fn)
            except (ImportError, AttributeError, TypeError, ValueError):
                continue  # unresolvable: reported above; no signature: nothing to bind
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            try:
                sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
            except TypeError as exc:
                problems.append(f"line {node.lineno}: {path}{sig}: {exc}")
    return sorted(set(problems))


# --- running ------------------------------------------------------------------------------------

# Tiny random stand-ins for hub checkpoints, by model family (a word of the hub id).
_TINY = {
    "mixtral": (
        "from transformers import MixtralConfig as C, MixtralForCausalLM as M\n"
        "cfg = C(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,"
        " num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)\n"
    ),
}
_DRIVER = """
import runpy, sys
import torch
torch.manual_seed(0)
{make}M(cfg).save_pretrained(sys.argv[1])
runpy.run_path(sys.argv[2], run_name="__main__")
"""


@dataclass
class Outcome:
    rc: int
    out: str
    seconds: float

    def tail(self, n: int = 4000) -> str:
        return self.out[-n:]


def aligned(chain: Chain) -> list[str]:
    """The chain's code at the page's line numbers (every other line blank)."""
    lines = [""] * max(n for b in chain.blocks for n, _ in b.code_lines or [(b.line, "")])
    for b in chain.blocks:
        for n, text in b.code_lines:
            lines[n - 1] = text
    return lines


def _script(chain: Chain, tmp: Path) -> tuple[Path, list[str]]:
    """The chain's code as a script that keeps the page's line numbers."""
    lines = aligned(chain)
    path = tmp / (chain.head.page.replace("/", "__") + ".py")
    path.write_text("\n".join(lines) + "\n")
    return path, lines


def _point_at_checkpoint(chain: Chain, path: Path, lines: list[str], tiny: Path) -> str:
    """Replace the value of the block's `VAR = "<hub id>"` by `tiny`; returns the hub id."""
    var = chain.head.opts["checkpoint"]
    tree = ast.parse("\n".join(lines))
    hits = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign)
        and [t.id for t in n.targets if isinstance(t, ast.Name)] == [var]
        and isinstance(n.value, ast.Constant)
        and isinstance(n.value.value, str)
    ]
    assert len(hits) == 1, f'{chain.id}: checkpoint={var} needs exactly one `{var} = "<hub id>"`'
    v = hits[0].value
    raw = lines[v.lineno - 1].encode()
    lines[v.lineno - 1] = (raw[: v.col_offset] + repr(str(tiny)).encode() + raw[v.end_col_offset :]).decode()
    path.write_text("\n".join(lines) + "\n")
    return v.value


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> Outcome:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's own children (spawned ranks) too
        out, _ = proc.communicate()
        out += f"\n[timed out after {TIMEOUT_S} s]"
        return Outcome(-9, out, time.monotonic() - t0)
    return Outcome(proc.returncode, out, time.monotonic() - t0)


def _installed(pkg: Path, site: Path) -> list[str]:
    """pkg as `pip install --target site` leaves it, for entry-point discovery: a dist-info with
    its pyproject's entry points in `site`; returns the folders to put on the path."""
    meta = tomllib.loads((pkg / "pyproject.toml").read_text())
    project = meta["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    eps = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
        for group, entries in project.get("entry-points", {}).items()
    )
    (info / "entry_points.txt").write_text(eps)
    where = meta.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
    return [str(site)] + [str(pkg / w) for w in where]


def run_chain(chain: Chain, tmp: Path) -> Outcome:
    path, lines = _script(chain, tmp)
    head = chain.head
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    extra: list[str] = []
    if "pythonpath" in head.opts:
        extra.append(str(ROOT / head.opts["pythonpath"]))
    if "installed" in head.opts:
        extra += _installed(ROOT / head.opts["installed"], tmp / "site")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(path)]
    if "checkpoint" in head.opts:
        hub_id = _point_at_checkpoint(chain, path, lines, tmp / "checkpoint")
        family = [k for k in _TINY if k in hub_id.lower()]
        assert family, f"{chain.id}: no tiny stand-in for {hub_id!r}; add its family to _TINY"
        cmd = [sys.executable, "-c", _DRIVER.format(make=_TINY[family[0]]), str(tmp / "checkpoint"), str(path)]
    if ON_GPU and "nproc" in head.opts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={head.opts['nproc']}"]
        cmd.append(str(path))
    return _run(cmd, env, tmp)


def _runs_here(chain: Chain) -> bool:
    """Whether the chain is run (in full, or to its expected error) on this machine."""
    head = chain.head
    if chain.errors or head.includes is not None or "skip" in head.words:
        return False
    if "gpu" in head.words:
        if not ON_GPU:
            return "raises" in head.opts
        return torch.cuda.device_count() >= int(head.opts.get("nproc", 1))
    return True


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every chain that runs here, started at once, WORKERS at a time, longest chains first."""
    todo = sorted((c for c in CHAINS if _runs_here(c)), key=lambda c: (-len(c.blocks), -len(c.head.code_lines)))
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    started: dict[str, Future[Outcome]] = {
        c.id: pool.submit(run_chain, c, tmp_path_factory.mktemp("doc-sample")) for c in todo
    }
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


def test_blocks_found():
    assert any(b.page == "README.md" for b in BLOCKS), "README.md's python blocks were not found"
    assert len(BLOCKS) >= 10, [b.where for b in BLOCKS]


def test_every_block_is_accounted_for():
    problems = STRAY + [e for c in CHAINS for e in c.errors]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_doc_sample(chain: Chain, jobs):
    head = chain.head
    assert not chain.errors, "\n".join(chain.errors)
    files = head.includes
    if files is not None:
        for f in files:
            src = ROOT / f
            assert src.is_file(), f"{head.where}: includes {f}, which does not exist"
            compile(src.read_text(), str(src), "exec")
        pytest.skip(f"a --8<-- include of {', '.join(files)}: the file runs where it lives (its own tests)")
    problems = static_problems("\n".join(aligned(chain)))
    assert not problems, f"{chain.id}: moehal names that do not resolve or calls that do not bind (page lines):\n" + (
        "\n".join(problems)
    )
    if "skip" in head.words:
        pytest.skip(head.opts["reason"])
    if "gpu" in head.words and ON_GPU and not _runs_here(chain):
        pytest.skip(f"needs {head.opts['nproc']} GPUs, {torch.cuda.device_count()} here; names checked")
    if chain.id not in jobs:
        assert "gpu" in head.words and not ON_GPU and "raises" not in head.opts
        return  # a GPU block without a cheap CPU run: the static check is its check here
    res = jobs[chain.id].result()
    if "gpu" in head.words and not ON_GPU:
        err = getattr(moehal, head.opts["raises"])
        last = [ln for ln in res.out.splitlines() if ln.strip()][-1:] or [""]
        assert res.rc != 0 and last[0].startswith(f"{err.__module__}.{err.__qualname__}:"), (
            f"{chain.id}: on a CPU this GPU sample should stop with moehal.{head.opts['raises']}; "
            f"exit {res.rc} after {res.seconds:.1f} s:\n{res.tail()}"
        )
        return
    assert res.rc == 0, f"{chain.id}: exit {res.rc} after {res.seconds:.1f} s (lines are the page's):\n{res.tail()}"
