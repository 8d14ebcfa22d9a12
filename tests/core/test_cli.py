"""The `moehal` command line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import moehal
import pytest
import torch
from moehal.cli import common, explain
from moehal.cli.main import build_parser, main
from moehal.formats import ActivationFormat, Layout
from moehal.interfaces import BackendInfo, Experts
from packaging.version import Version


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setattr(common.console, "width", 250)  # no wrapping inside the strings we look for


def test_doctor_json_lists_reference_available_and_others_with_reason():
    out = subprocess.run(
        [sys.executable, "-m", "moehal.cli.main", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MOEHAL_")},  # not the developer's settings
    ).stdout
    report = json.loads(out)
    by_name = {b["name"]: b for b in report["backends"]}
    assert by_name["reference"]["available"] is True
    for name in ("cuda", "npu", "rocm"):
        assert name in by_name
        b = by_name[name]
        assert b["reason"], f"{name} must say why it is (un)available"
        if name != "cuda" or not torch.cuda.is_available():  # a GPU machine has cuda
            assert b["available"] is False, f"{name} is available on this machine?"
    assert report["hardware"]["kind"] == ("cuda" if torch.cuda.is_available() else "cpu")
    ref = {c["name"]: c for c in by_name["reference"]["components"]}
    assert ref["reference.experts"]["kind"] == "experts" and ref["reference.experts"]["runs_here"] is True
    assert ref["reference.local"]["kind"] == "dispatcher"
    npu = by_name["npu"]["components"]
    assert npu and all(not c["runs_here"] and c["reason"] for c in npu)  # no NPU here: each says why
    if importlib.util.find_spec("torch_npu") is None:  # the line names the torch_npu release for this torch
        release = Version(torch.__version__).base_version
        assert f'pip install "torch-npu=={release}.*"' in by_name["npu"]["reason"], by_name["npu"]["reason"]


def test_doctor_table(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "Backends" in out
    assert "Components of the available backends" in out and "reference.experts" in out


def test_doctor_shows_every_setting_and_where_it_came_from(capsys, monkeypatch):
    """Doctor showed the settings only when a backend, disabled plugins or emulation were set,
    and never the workspace budget or the variables behind them."""
    monkeypatch.setattr(moehal.plugins, "_default", None)  # restored after the test
    for name in [k for k in os.environ if k.startswith("MOEHAL_")]:  # not the developer's settings
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOEHAL_MASKED_WORKSPACE_GIB", "4")
    assert main(["doctor", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["settings"]
    assert s["masked_workspace_gib"] == 4.0 and s["environment"]["MOEHAL_MASKED_WORKSPACE_GIB"] == "4"
    assert isinstance(s["triton_interpret"], bool)
    moehal.plugins._default = None
    assert main(["doctor"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("settings:"))
    assert "masked_workspace_gib=4.0" in line and "from MOEHAL_MASKED_WORKSPACE_GIB=4" in line


def test_explain_shows_decisions_and_plan(capsys):
    assert main(["explain", "--experts", "8", "--hidden", "256", "--intermediate", "128", "--quant", "fp8_block"]) == 0
    out = capsys.readouterr().out
    assert "reference.experts" in out and "moehal plan" in out and "masked[float8_e4m3fn+group128]" in out


def test_explain_json_and_no_pipeline_exit_code(capsys):
    assert (
        main(
            [
                "explain",
                "--json",
                "--hidden",
                "256",
                "--intermediate",
                "128",
                "--backend",
                "reference",
                "--layout",
                "masked",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["format"].startswith("masked")
    assert main(["explain", "--backend", "cuda", "--hidden", "256", "--intermediate", "128"]) == 1  # none here
    assert "No pipeline" in capsys.readouterr().out
    # a layout no one declares (plugins may declare their own): every candidate says so
    assert main(["explain", "--layout", "no_such_layout", "--hidden", "256", "--intermediate", "128"]) == 1
    assert "consumes no 'no_such_layout' format here" in capsys.readouterr().out


def test_explain_shows_which_dispatchers_drop_padding_ids(capsys, monkeypatch):
    monkeypatch.setenv("MOEHAL_EMULATE", "npu")  # the NPU dispatchers, which do not declare it
    reg = moehal.Registry(moehal.Settings.from_env())
    reg.load_entry_points()
    monkeypatch.setattr(moehal.plugins, "_default", reg)  # what `moehal.discover()` returns here
    args = ["explain", "--json", "--hidden", "512", "--intermediate", "512", "--backend", "npu", "--topk-padding"]
    args += ["--device", "cpu"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert "-1 ids" in data["config"]
    declined = {d["name"]: d["reason"] for d in data["decisions"] if d["predicate"] == "padding_ids" and not d["ok"]}
    assert "npu.local_flat" in declined and "drops_padding_ids" in declined["npu.local_flat"], declined
    assert data["chosen"]["dispatcher"] == "reference.local", data["chosen"]


def test_explain_rejects_an_invalid_config(capsys):
    assert main(["explain", "--top-k", "9", "--experts", "4"]) == 2
    assert "exceeds num_experts" in capsys.readouterr().err


def test_explain_backend_auto_means_any_and_a_misspelt_one_is_named(capsys):
    """`--backend auto` means no restriction, as `MoELayer(backend="auto")` does (it declined
    every candidate as "not of the requested backend 'auto'"); an unknown name is the unknown-
    backend error with the loaded backends, not a table of declines."""
    args = ["explain", "--experts", "8", "--hidden", "256", "--intermediate", "128", "--device", "cpu"]
    assert main([*args, "--backend", "auto"]) == 0
    assert "moehal plan" in capsys.readouterr().out
    assert main([*args, "--backend", "refrence"]) == 2
    out = capsys.readouterr().err
    assert "unknown backend 'refrence'" in out and "reference" in out


def test_list(capsys):
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"reference.local", "reference.experts"} <= {r["name"] for r in rows}


def test_list_describes_every_in_tree_implementation(capsys):
    """`moehal list` is where a user learns what each component does: every implementation the
    in-tree backends declare says so (six CUDA weight processors once had an empty column)."""
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    in_tree = [r for r in rows if r["name"].split(".")[0] in ("cuda", "npu", "rocm", "reference")]
    assert {"cuda.deepgemm_weights", "cuda.cutedsl_nvfp4_weights", "npu.gmm_weights"} <= {r["name"] for r in in_tree}
    assert [r["name"] for r in in_tree if not r["description"].strip()] == []


class _NoWeightOnInput(Experts):
    """Declares what cuda.trtllm_* declares: no apply_router_weight_on_input."""

    name, priority = "no_weight_on_input", 100
    quant_schemes = frozenset({moehal.QuantScheme.parse("bf16")})
    supports_router_weight_on_input = False

    def input_formats(self, req):
        return [ActivationFormat(Layout.STANDARD, req.config.dtype)]

    def build(self, req, fmt):
        raise NotImplementedError


class _Interpreted(_NoWeightOnInput):
    """Capturable as declared, but runs under an interpreter here."""

    name = "interpreted"
    supports_router_weight_on_input = True
    graph_capturable = True

    def execution_mode(self, req):
        return "interpreted"


class _RaisingCheck(_NoWeightOnInput):
    name = "raising_check"
    supports_router_weight_on_input = True

    def check_shape(self, req):
        raise KeyError("oops")


class _NoQuant(_NoWeightOnInput):
    name = "no_quant"
    quant_schemes = frozenset()  # an experts kernel declaring no scheme takes none


def _with_toy_backend(monkeypatch, *experts):
    """`moehal.discover()` answers the installed plugins plus a `toy` backend of `experts`."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: BackendInfo("toy", "0", "toy")),
        moehal_experts=moehal.hookimpl(lambda: list(experts)),
    )
    assert reg.register(plugin, "toy").status == "loaded"
    monkeypatch.setattr(moehal.plugins, "_default", reg)
    return reg


SMALL = ["--hidden", "128", "--intermediate", "64", "--device", "cpu"]


def test_explain_router_weight_on_input_picks_what_the_layer_picks(capsys, monkeypatch):
    """A kernel that declines apply_router_weight_on_input: explain could not say the layer has
    it, so it showed that kernel chosen where MoELayer picks another."""
    reg = _with_toy_backend(monkeypatch, _NoWeightOnInput())
    args = ["explain", "--json", "--experts", "8", "--top-k", "1", *SMALL]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["experts"] == "toy.no_weight_on_input"
    cfg = moehal.MoEConfig(8, 1, 128, 64, apply_router_weight_on_input=True)
    layer = moehal.MoELayer(cfg, device="cpu", registry=reg)
    assert main([*args, "--router-weight-on-input"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["name"] == layer.plan.pipeline.name, (data["chosen"], layer.plan.pipeline.name)
    declined = {d["name"]: d["reason"] for d in data["decisions"] if not d["ok"]}
    assert "apply_router_weight_on_input" in declined["toy.no_weight_on_input"]


def test_explain_flags_set_every_field_selection_reads():
    flags = ["--routing", "deepseek_v3", "--n-group", "4", "--topk-group", "2", "--correction-bias"]
    flags += ["--no-renormalize", "--routed-scaling-factor", "2.5", "--w13-bias", "--experts", "16", "--top-k", "1"]
    cfg = explain.config_from_args(build_parser().parse_args(["explain", *flags, "--router-weight-on-input"]))
    routing = moehal.RoutingConfig("deepseek_v3", renormalize=False, n_group=4, topk_group=2, has_correction_bias=True)
    assert cfg.routing == routing and cfg.routed_scaling_factor == 2.5 and cfg.apply_router_weight_on_input
    assert cfg.has_w13_bias and not cfg.has_w2_bias
    cfg = explain.config_from_args(build_parser().parse_args(["explain", "--w2-bias"]))
    assert cfg.has_w2_bias and not cfg.has_w13_bias and cfg.routing is None
    with pytest.raises(moehal.ConfigError, match="--n-group: routing options need --routing"):
        explain.config_from_args(build_parser().parse_args(["explain", "--n-group", "2"]))


def test_explain_json_errors_are_json_with_exit_code_2(capsys):
    for extra, kind in ((["--backend", "nope"], "UnknownBackendError"), (["--experts", "0"], "ConfigError")):
        assert main(["explain", "--json", *SMALL, *extra]) == 2
        data = json.loads(capsys.readouterr().out)
        assert data["type"] == kind and data["error"], data


def test_explain_errors_go_to_stderr_and_json_usage_errors_are_json(capsys):
    """`explain --backend nosuch` and `--quant fp9` printed their errors on stdout; `explain
    --json --experts x` printed nothing there, though the help promises one JSON object."""
    for extra in (["--backend", "nosuch"], ["--quant", "fp9"]):
        assert main(["explain", *SMALL, *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and ("nosuch" in err or "fp9" in err), (out, err)
    for extra, said in ((["--experts", "x"], "invalid int value: 'x'"), (["--bogus"], "unrecognized arguments")):
        with pytest.raises(SystemExit) as exc:  # argparse's own exit, without --json
            main(["explain", *extra])
        assert exc.value.code == 2 and capsys.readouterr().out == ""
        assert main(["explain", "--json", *extra]) == 2
        out, err = capsys.readouterr()
        data = json.loads(out)
        assert data["type"] == "UsageError" and said in data["error"] and said in err
    assert main(["explain", "--js", "--experts", "x"]) == 2  # argparse takes a flag's prefix: --json still
    assert json.loads(capsys.readouterr().out)["type"] == "UsageError"


def test_explain_json_mode_and_graph_capture_agree_with_the_text_plan(capsys, monkeypatch):
    _with_toy_backend(monkeypatch, _Interpreted())
    args = ["explain", *SMALL, "--backend", "toy"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "graphs       not capturable" in out and "INTERPRETED" in out
    assert main([*args, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["experts"] == "toy.interpreted"
    assert chosen["mode"] == "interpreted" and chosen["graph_capturable"] is False, chosen


def test_explain_reports_a_raising_plugin_check_with_exit_code_2(capsys, monkeypatch):
    _with_toy_backend(monkeypatch, _RaisingCheck())
    assert main(["explain", *SMALL]) == 2
    assert "toy.raising_check: a capability check raised KeyError" in capsys.readouterr().err
    assert main(["explain", "--json", *SMALL]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["type"] == "PluginCheckError" and "MOEHAL_DISABLE_PLUGINS=toy" in data["error"]


def test_a_device_this_machine_lacks_is_a_config_error(capsys):
    with pytest.raises(moehal.ConfigError, match="'cuda:99' asked for"):
        moehal.detect("cuda:99")  # no GPU, a CPU-only torch, or fewer than 100 GPUs: each says so
    if getattr(torch, "npu", None) is None:
        with pytest.raises(moehal.ConfigError, match="import torch_npu"):
            moehal.detect("npu")
    assert main(["explain", "--hidden", "128", "--intermediate", "64", "--device", "cuda:99"]) == 2
    assert "'cuda:99' asked for" in capsys.readouterr().err
    assert main(["doctor", "--device", "cuda:99"]) == 2
    assert "hardware: device 'cuda:99' asked for" in capsys.readouterr().out
    assert main(["doctor", "--json", "--device", "cuda:99"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert "'cuda:99' asked for" in report["hardware"]["error"]
    assert report["backends"] and not any(b["available"] for b in report["backends"])


def test_list_says_none_for_an_experts_kernel_without_quant_schemes(capsys, monkeypatch):
    """No schemes: dispatchers and weight processors take any, experts kernels and fused forwards none."""
    _with_toy_backend(monkeypatch, _NoQuant())
    assert main(["list"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 7:
            rows[cells[0]] = cells
    assert rows["toy.no_quant"][4] == "none", rows["toy.no_quant"]
    assert rows["reference.local"][4] == "any", rows["reference.local"]


def test_doctor_reports_every_failing_plugin_under_strict(capsys, monkeypatch, tmp_path):
    for n in (1, 2):
        (tmp_path / f"moehal_cli_bad{n}.py").write_text(f"raise ImportError('vendor lib {n} missing')\n")
        info = tmp_path / f"moehal_cli_bad{n}-0.0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: moehal_cli_bad{n}\nVersion: 0.0.1\n")
        (info / "entry_points.txt").write_text(f"[moehal.backends]\nclibad{n} = moehal_cli_bad{n}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(moehal.plugins, "_default", None)  # restored after the test
    monkeypatch.setenv("MOEHAL_STRICT_PLUGINS", "0")
    assert main(["doctor", "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("MOEHAL_STRICT_PLUGINS", "1")
    moehal.plugins._default = None  # as in a fresh process (it raised PluginLoadError on clibad1)
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    failed = {b["name"]: b["error"] for b in report["backends"] if b["status"] == "failed"}
    assert "vendor lib 1 missing" in failed["clibad1"] and "vendor lib 2 missing" in failed["clibad2"], failed
    assert report["settings"]["strict"] is True
    assert main(["doctor"]) == 1
    assert "MOEHAL_STRICT_PLUGINS is set and 2 plugin(s) failed" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["moehal.cli.main bench", "moehal.kernels.tune_fused_moe", "moehal_cuda.tuning"])
def test_help_works_with_docstrings_stripped(module):
    """`python -OO` strips docstrings: parsers built from a module's `__doc__` raised on None."""
    run = subprocess.run(
        [sys.executable, "-OO", "-m", *module.split(), "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_every_subcommand_turns_moehal_errors_into_exit_2(tmp_path, capsys):
    """Only ConfigError was caught, and bench and conformance not at all: `moehal goals` on a
    missing or foreign file printed a traceback."""
    (tmp_path / "list.json").write_text("[{}]")
    for path, said in ((tmp_path / "none.json", "FileNotFoundError"), (tmp_path / "list.json", "AttributeError")):
        assert main(["goals", str(path)]) == 2
        err = capsys.readouterr().err
        assert "is not a readable `moehal bench --out` JSON file" in err and said in err
