"""The configs' types as type checkers read them.

The documented calls `MoEConfig(..., activation="silu")` and `RoutingConfig("softmax")` work at
run time (`__post_init__` converts the name to the enum), but mypy flagged them: the dataclass
fields are annotated with the enums, and a type checker builds `__init__` from the fields. Each
config below declares, under `if TYPE_CHECKING:`, an `__init__` that also takes the names; at run
time there is no such method and the dataclass makes `__init__` as before. These tests keep each
such stub equal to its class's fields, its names equal to the enums' values, and (where mypy is
installed) check that mypy accepts the documented calls and still reads the fields as the enums.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
from moehal.config import MoEConfig
from moehal.formats import ActivationFormat
from moehal.quant import QuantScheme
from moehal.routing import RoutingConfig
from moehal.settings import Settings

# The configs with an `__init__` stub, and the parameters the stub widens (annotation as written
# in the stub); every other parameter is annotated as its field is.
WIDENED: dict[type, dict[str, str]] = {
    MoEConfig: {"activation": "Activation | _ActivationName"},
    RoutingConfig: {"method": "RoutingMethod | _RoutingMethodName"},
    QuantScheme: {"kind": "QuantKind | _QuantKindName", "scale_format": "ScaleFormat | _ScaleFormatName"},
    ActivationFormat: {"scales": "ScaleKind | _ScaleKindName"},
    Settings: {"disabled_plugins": "AbstractSet[str]", "emulate": "AbstractSet[str]"},
}


def _stub(cls: type) -> ast.FunctionDef:
    """The `__init__` declared under `if TYPE_CHECKING:` in `cls`'s body."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    stubs = [
        f
        for node in body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for f in node.body
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
    ]
    assert len(stubs) == 1, f"{cls.__name__}: {len(stubs)} __init__ stubs under `if TYPE_CHECKING:`"
    return stubs[0]


def _stub_parameters(cls: type) -> list[tuple[str, inspect._ParameterKind, object, str]]:
    """(name, kind, default, annotation) of the stub's parameters after `self`, defaults
    evaluated in the class's module."""
    fn = _stub(cls)
    a = fn.args
    namespace = vars(sys.modules[cls.__module__])
    P = inspect.Parameter
    positional = [(arg, P.POSITIONAL_ONLY) for arg in a.posonlyargs]
    positional += [(arg, P.POSITIONAL_OR_KEYWORD) for arg in a.args]
    defaults = [P.empty] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = list(zip(positional, defaults, strict=True))
    if a.vararg:
        params.append(((a.vararg, P.VAR_POSITIONAL), P.empty))
    params += [((arg, P.KEYWORD_ONLY), d or P.empty) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        params.append(((a.kwarg, P.VAR_KEYWORD), P.empty))
    (self_arg, _), _ = params.pop(0)
    assert self_arg.arg == "self"
    assert fn.returns is not None and ast.unparse(fn.returns) == "None"
    out = []
    for (arg, kind), default in params:
        value = default if default is P.empty else eval(compile(ast.Expression(default), "<stub>", "eval"), namespace)
        out.append((arg.arg, kind, value, ast.unparse(arg.annotation) if arg.annotation else ""))
    return out


def _field_parameters(cls: type) -> list[tuple[str, inspect._ParameterKind, object, str]]:
    """The same of the `__init__` the dataclass generated (defaults from the fields, as the
    generated signature shows a default_factory as `<factory>`)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        f = fields[p.name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = inspect.Parameter.empty
        annotation = ast.unparse(ast.parse(f.type, mode="eval").body) if isinstance(f.type, str) else f.type
        out.append((p.name, p.kind, default, WIDENED[cls].get(p.name, annotation)))
    return out


@pytest.mark.parametrize("cls", list(WIDENED), ids=lambda c: c.__name__)
def test_the_init_stub_is_the_fields(cls):
    """Names, order, kinds, defaults and annotations (a field's, or the widened one above) of
    the type checkers' `__init__` equal those of the dataclass's own: a field added, renamed,
    reordered or given another default without the stub would make type checkers refuse a
    right call or accept a wrong one."""
    assert _stub_parameters(cls) == _field_parameters(cls)


@pytest.mark.parametrize("cls", list(WIDENED), ids=lambda c: c.__name__)
def test_the_stub_is_for_type_checkers_only(cls):
    """At run time `__init__` is the dataclass's (the stub is never defined), so `help()` and
    `inspect.signature` show the fields as they are."""
    assert cls.__init__.__code__.co_filename != inspect.getsourcefile(cls)
    assert list(inspect.signature(cls).parameters) == [f.name for f in dataclasses.fields(cls) if f.init]


def _enum_parameters() -> list[tuple[type, str, type[enum.Enum]]]:
    """(class, parameter, enum) of each widened parameter whose field is an enum."""
    out = []
    for cls, widened in WIDENED.items():
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name in widened:
            kind = eval(types[name], vars(sys.modules[cls.__module__]))
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                out.append((cls, name, kind))
    return out


@pytest.mark.parametrize("cls, name, kind", _enum_parameters(), ids=lambda v: getattr(v, "__name__", v))
def test_the_names_a_stub_takes_are_the_enum_values(cls, name, kind):
    """The Literal names type checkers accept for an enum field are exactly the values its
    `__post_init__` converts (a member added to the enum is a name to add)."""
    names = eval(WIDENED[cls][name].partition(" | ")[2], vars(sys.modules[cls.__module__]))
    assert get_args(names) == tuple(m.value for m in kind)


# The documented calls (README.md, docs/user-guide.md, docs/backends/npu.md) and the other
# string forms the configs take, and what their fields read as; run here too, so the snippet
# cannot claim a call that fails at run time.
_ACCEPTED = """
    from typing_extensions import assert_type

    import torch
    import moehal
    from moehal import Activation, Layout, QuantKind, RoutingMethod, ScaleFormat, ScaleKind

    cfg = moehal.MoEConfig(
        num_experts=64,
        top_k=6,
        hidden_size=2048,
        intermediate_size=1408,
        activation="silu",
        dtype=torch.bfloat16,
    )
    assert_type(cfg.activation, Activation)
    routing = moehal.RoutingConfig("softmax")
    assert_type(routing.method, RoutingMethod)
    deepseek = moehal.RoutingConfig("deepseek_v3", n_group=8, topk_group=4, has_correction_bias=True)
    assert_type(deepseek.method, RoutingMethod)
    routed = cfg.with_(routing=routing)
    assert_type(moehal.MoEConfig(8, 2, 64, 32, Activation.GELU, gated=False).activation, Activation)
    settings = moehal.Settings(emulate={"npu"})
    assert_type(settings.emulate, frozenset[str])
    scheme = moehal.QuantScheme("fp8_block", "ue8m0")
    assert_type(scheme.kind, QuantKind)
    assert_type(scheme.scale_format, ScaleFormat)
    fmt = moehal.ActivationFormat(Layout.CONTIGUOUS, torch.float8_e4m3fn, "group128", row_alignment=128)
    assert_type(fmt.scales, ScaleKind)
"""

# Wrong calls mypy must still refuse, each with a word of its error
_REFUSED = [
    ('moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, activation="relu")', "activation"),
    ("moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=64)", "intermediate_size"),
    ('moehal.RoutingConfig("Softmax")', "RoutingConfig"),
    ('moehal.RoutingConfig(mehtod="softmax")', "mehtod"),
    ('moehal.QuantScheme("fp8_block:ue8m0")', "QuantScheme"),
    ('moehal.Settings(emulate="npu")', "emulate"),
]


def test_the_documented_calls_run():
    """The calls mypy checks below also run, and at run time too the fields are the enums."""
    from moehal import Activation, QuantKind, RoutingMethod, ScaleFormat, ScaleKind

    ns: dict = {}
    exec(compile(textwrap.dedent(_ACCEPTED), "<documented calls>", "exec"), ns)
    assert ns["cfg"].activation is Activation.SILU and ns["routed"].routing is ns["routing"]
    assert ns["routing"].method is RoutingMethod.SOFTMAX and ns["deepseek"].method is RoutingMethod.DEEPSEEK_V3
    assert ns["settings"].emulate == frozenset({"npu"})
    assert (ns["scheme"].kind, ns["scheme"].scale_format) == (QuantKind.FP8_BLOCK, ScaleFormat.UE8M0)
    assert isinstance(ns["fmt"].scales, ScaleKind)


def test_mypy_accepts_the_documented_calls_and_reads_the_enums(tmp_path):
    """mypy (where installed: CI does not install it) accepts the string forms (and a set for
    Settings' frozensets), still reads the fields as the enums (`assert_type`), and refuses a
    wrong name, a string for a set or a missing argument. moehal
    is found through a link in MYPYPATH, as an editable install's import hook is invisible to
    mypy; its modules are checked only as far as the snippets need (`--follow-imports=silent`)."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        pytest.skip("mypy is not installed (pip install mypy to run this check)")
    import moehal

    src = tmp_path / "src"
    src.mkdir()
    (src / "moehal").symlink_to(Path(moehal.__file__).parent, target_is_directory=True)
    (tmp_path / "accepted.py").write_text(textwrap.dedent(_ACCEPTED))
    (tmp_path / "refused.py").write_text("\n".join(["import moehal", *(call for call, _ in _REFUSED)]) + "\n")
    (tmp_path / "mypy.ini").write_text("[mypy]\n")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--follow-imports=silent", "--no-error-summary"]
        + ["--cache-dir", str(tmp_path / "cache"), "--hide-error-context", "accepted.py", "refused.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(src)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if not e.startswith("refused.py:")], result.stdout + result.stderr
    refused = {int(e.split(":")[1]): e for e in errors}  # refused.py's line 1 is the import
    assert sorted(refused) == list(range(2, 2 + len(_REFUSED))), result.stdout + result.stderr
    for line, (call, word) in enumerate(_REFUSED, start=2):
        assert word in refused[line], (call, refused[line])
