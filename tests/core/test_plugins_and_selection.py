"""Discovery through real entry points, failure reporting, and negotiated selection."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
import types

import moehal
import pytest
import torch
from moe_testing import build_problem
from moehal.capability import accept
from moehal.formats import ActivationFormat, Layout, MaskedInput, ScaleKind
from moehal.interfaces import BackendInfo, Dispatcher, Experts, FusedForward, WeightProcessor

TOY_PLUGIN = '''
from __future__ import annotations
import torch
import moehal
from moehal.capability import accept, decline
from moehal.formats import ActivationFormat, Layout, ScaleKind, MaskedOutput
from moehal.interfaces import BackendInfo, Dispatcher, Experts, ExpertsRunner
from moehal.reference.dispatcher import LocalDispatchRunner
from moehal.reference.experts import ReferenceExpertsRunner


@moehal.hookimpl
def moehal_backend_info():
    return BackendInfo("toy", "0.0.1", "throwaway test plugin")


class BF16OnlyDispatcher(Dispatcher):
    """Moves only unquantized rows (like an all-to-all that sends BF16)."""
    name = "bf16_only"
    priority = 50

    def can_produce(self, fmt, req):
        if fmt.is_quantized:
            return decline("sends unquantized rows only", "format")
        return accept(predicate="format") if fmt.layout is Layout.MASKED else decline("masked only", "format")

    def build(self, req, fmt):
        return LocalDispatchRunner(req, fmt)


class ToyExperts(Experts):
    name = "fp8_masked"
    priority = 50
    quant_schemes = frozenset({moehal.QuantScheme.parse("fp8_block")})
    activations = frozenset({moehal.Activation.SILU})

    def input_formats(self, req):
        return [ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128)]

    def build(self, req, fmt):
        return ReferenceExpertsRunner(req, fmt)


class ToyStaticExperts(Experts):
    """fp8 per-tensor experts that take their input quantized with the static input scale."""
    name = "fp8_tensor_masked"
    priority = 50
    quant_schemes = frozenset({moehal.QuantScheme.parse("fp8_tensor")})
    activations = frozenset({moehal.Activation.SILU})

    def input_formats(self, req):
        return [ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.STATIC_TENSOR)]

    def build(self, req, fmt):
        return ReferenceExpertsRunner(req, fmt)


@moehal.hookimpl
def moehal_dispatchers():
    return [BF16OnlyDispatcher()]


@moehal.hookimpl
def moehal_experts():
    return [ToyExperts(), ToyStaticExperts()]
'''

BROKEN_IMPORT = "raise ImportError('vendor library libacme.so not found')\n"
BROKEN_HOOK = """
import moehal
from moehal.interfaces import BackendInfo

@moehal.hookimpl
def moehal_backend_info():
    return BackendInfo("hookfail", "1.0", "hook raises")

@moehal.hookimpl
def moehal_experts():
    raise RuntimeError("probe of device failed")
"""


def _make_dist(root, dist, module, source, ep_name):
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[moehal.backends]\n{ep_name} = {module}\n")


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    _make_dist(tmp_path, "moehal_toy", "moehal_toy_plugin", textwrap.dedent(TOY_PLUGIN), "toy")
    _make_dist(tmp_path, "moehal_broken", "moehal_broken_plugin", BROKEN_IMPORT, "broken")
    _make_dist(tmp_path, "moehal_hookfail", "moehal_hookfail_plugin", BROKEN_HOOK, "hookfail")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("moehal_toy_plugin", "moehal_broken_plugin", "moehal_hookfail_plugin"):
        sys.modules.pop(m, None)


def _registry(**settings):
    reg = moehal.Registry(moehal.Settings(**settings))
    reg.load_entry_points()
    return reg


# The toy plugin's tests build their layers on the CPU: on a GPU machine cuda.permute, which
# produces the toy experts' fp8 format itself, would be chosen over the bf16-only dispatcher.


def test_throwaway_plugin_is_discovered_and_selected(plugin_path):
    reg = _registry()
    rec = reg.plugins["toy"]
    assert rec.status == "loaded" and rec.distribution == "moehal_toy" and rec.version == "0.0.1"
    assert "toy.fp8_masked" in rec.implementations
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    layer = moehal.MoELayer(cfg, "fp8_block", device="cpu", registry=reg)
    p = layer.plan.pipeline
    assert p.experts.qualname == "toy.fp8_masked"
    # Negotiation: the experts want fp8 masked; the best dispatcher sends bf16 only, so an
    # adapter quantizes between them.
    assert p.dispatcher.qualname == "toy.bf16_only" and p.adapter == "quantize"
    assert p.dispatch_fmt == ActivationFormat(Layout.MASKED, torch.bfloat16)
    assert p.fmt == ActivationFormat(Layout.MASKED, torch.float8_e4m3fn, ScaleKind.GROUP_128)
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("fp8_block"), 6)
    layer.load_weights(weights)
    ref = moehal.MoELayer(cfg, "fp8_block", backend="reference", layout="masked", device="cpu", registry=reg)
    ref.load_weights(weights)
    torch.testing.assert_close(layer(x, ids, wts), ref(x, ids, wts))
    # A scheme the toy does not claim falls back to the reference, and the plan says so.
    plan = moehal.MoELayer(cfg, "bf16", device="cpu", registry=reg).plan
    assert plan.pipeline.experts.backend == "reference" and "slow reference fallback" in str(plan)


def test_static_input_scale_reaches_the_quantize_adapter(plugin_path):
    """fp8_tensor experts that consume rows quantized with the checkpoint's static scale: the
    adapter behind a bf16-only dispatcher gets that scale from the layer when the weights are
    processed, and the layer's output is the oracle's."""
    reg = _registry()
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    layer = moehal.MoELayer(cfg, "fp8_tensor", device="cpu", registry=reg)
    p = layer.plan.pipeline
    assert p.experts.qualname == "toy.fp8_tensor_masked" and p.adapter == "quantize"
    assert p.fmt.scales is ScaleKind.STATIC_TENSOR
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("fp8_tensor"), 6)
    with pytest.raises(ValueError, match="static input scale"):  # no weights yet: no scale to quantize with
        layer._adapter(MaskedInput(x[None], None, torch.tensor([6], dtype=torch.int32), 6))
    layer.load_weights(weights)
    assert torch.equal(layer._adapter.static_scale, weights.a13_scale.reshape(1).float())
    ref = moehal.MoELayer(cfg, "fp8_tensor", backend="reference", layout="masked", device="cpu", registry=reg)
    ref.load_weights(weights)
    torch.testing.assert_close(layer(x, ids, wts), ref(x, ids, wts))


def test_no_quantize_adapter_for_a_dtype_the_reference_quantizers_do_not_make():
    """The adapter quantizes with the reference quantizers, which make fp8 e4m3fn and int8.
    Experts that want e4m3fnuz 1x128 rows (what an MI300 kernel computes in) behind a
    dispatcher that sends bf16 only get no adapter, since it would hand them e4m3fn bits whose
    values are off by 2x. With no other way to feed them, they are declined, and the
    refusal names the dispatcher's reason."""
    import types

    from moehal.capability import accept, decline
    from moehal.interfaces import BackendInfo, BuildRequest, Dispatcher, Experts
    from moehal.plugins import Registry
    from moehal.selection import QuantizeAdapter, select

    fnuz = ActivationFormat(Layout.STANDARD, torch.float8_e4m3fnuz, ScaleKind.GROUP_128)
    fn = ActivationFormat(Layout.STANDARD, torch.float8_e4m3fn, ScaleKind.GROUP_128)
    assert QuantizeAdapter.source_format(fnuz, torch.bfloat16) is None
    assert QuantizeAdapter.source_format(fn, torch.bfloat16) == fn.unquantized(torch.bfloat16)

    class Bf16Only(Dispatcher):
        name, priority = "bf16_only", 5

        def can_produce(self, fmt, req):
            if fmt.is_quantized:
                return decline("sends bf16 only", "format")
            return accept(predicate="format")

        def build(self, req, fmt):
            raise NotImplementedError

    class FnuzExperts(Experts):
        name, priority = "fnuz", 5
        quant_schemes = frozenset({moehal.QuantScheme.parse("fp8_block")})

        def input_formats(self, req):
            return [fnuz]

        def build(self, req, fmt):
            raise NotImplementedError

    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: BackendInfo("toyfnuz", "0", "toy")),
        moehal_dispatchers=moehal.hookimpl(lambda: [Bf16Only()]),
        moehal_experts=moehal.hookimpl(lambda: [FnuzExperts()]),
    )
    reg = Registry(moehal.Settings())
    reg.register(plugin, "toyfnuz")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("fp8_block"), moehal.detect("cpu"), moehal.Settings())
    with pytest.raises(moehal.NoBackendError, match="sends bf16 only"):
        select(req, reg, backend="toyfnuz")


def test_broken_plugins_are_reported_and_skipped(plugin_path):
    reg = _registry()
    broken, hookfail = reg.plugins["broken"], reg.plugins["hookfail"]
    assert broken.status == "failed" and "libacme.so" in broken.error and broken.distribution == "moehal_broken"
    assert hookfail.status == "failed" and "probe of device failed" in hookfail.error
    assert "reference" in reg.loaded_backends() and "broken" not in reg.loaded_backends()
    assert not any(i.backend == "hookfail" for i in reg.all_implementations())


def test_strict_mode_raises_on_a_broken_plugin(plugin_path):
    with pytest.raises(moehal.PluginLoadError, match="broken"):
        _registry(strict=True)


def test_disabled_plugins_are_not_imported(plugin_path):
    reg = _registry(disabled_plugins=frozenset({"broken", "hookfail", "toy"}))
    assert reg.plugins["broken"].status == "disabled"
    assert "moehal_broken_plugin" not in sys.modules


def test_a_name_two_distributions_provide_loads_neither(tmp_path, monkeypatch):
    """Which of two distributions declaring one backend name would load first is install
    order: neither is imported, and the failure names both. Disabling the name skips it quietly,
    strict mode included."""
    _make_dist(tmp_path, "moehal_dup_a", "moehal_dup_a_plugin", BROKEN_IMPORT, "dup")
    _make_dist(tmp_path, "moehal_dup_b", "moehal_dup_b_plugin", textwrap.dedent(TOY_PLUGIN), "dup")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = _registry()
    rec = reg.plugins["dup"]
    assert rec.status == "failed" and "provided by 2 distributions" in rec.error
    assert "moehal_dup_a" in rec.error and "moehal_dup_b" in rec.error and "install order" in rec.error
    assert "moehal_dup_a_plugin" not in sys.modules and "moehal_dup_b_plugin" not in sys.modules
    assert "dup" not in reg.loaded_backends()
    with pytest.raises(moehal.PluginLoadError, match="provided by 2 distributions"):
        _registry(strict=True)
    quiet = _registry(strict=True, disabled_plugins=frozenset({"dup"}))
    assert quiet.plugins["dup"].status == "disabled"


def test_settings_read_from_env():
    s = moehal.Settings.from_env(
        {
            "MOEHAL_BACKEND": "cuda",
            "MOEHAL_DISABLE_PLUGINS": "a, b",
            "MOEHAL_EMULATE": "npu",
            "MOEHAL_STRICT_PLUGINS": "true",
        }
    )
    assert s == moehal.Settings("cuda", frozenset({"a", "b"}), True, frozenset({"npu"}))
    assert moehal.Settings.from_env({"MOEHAL_BACKEND": "auto"}).backend is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"MOEHAL_STRICT_PLUGINS": "ture"}, "MOEHAL_STRICT_PLUGINS='ture' is not a boolean"),
        ({"MOEHAL_NPU_EMULATE": "y es"}, "MOEHAL_NPU_EMULATE='y es' is not a boolean"),
        ({"MOEHAL_EMULATE": "npu", "MOEHAL_NPU_EMULATE": "0"}, "turns it off: unset MOEHAL_NPU_EMULATE"),
    ],
)
def test_settings_refuse_what_they_would_misread(env, match):
    """A typo in a boolean read as false, silently; and the NPU's two switches could disagree, the
    one that turned emulation on winning."""
    with pytest.raises(moehal.ConfigError, match=match):
        moehal.Settings.from_env(env)


def test_the_npu_switch_is_a_deprecated_alias_that_warns(recwarn):
    """MOEHAL_NPU_EMULATE named the setting that MOEHAL_EMULATE=npu names: two variables for one
    setting (security review 2026-11-29, finding 9). It still works, joined to MOEHAL_EMULATE,
    and warns, naming the variable to use: a FutureWarning too, which Python shows by default
    (a DeprecationWarning is hidden outside __main__). Disagreeing with MOEHAL_EMULATE raises."""
    with pytest.warns(
        moehal.DeprecatedSettingWarning, match=r"MOEHAL_NPU_EMULATE='1' is deprecated.*MOEHAL_EMULATE=npu"
    ):
        s = moehal.Settings.from_env({"MOEHAL_NPU_EMULATE": "1", "MOEHAL_EMULATE": "rocm"})
    assert s.emulate == frozenset({"npu", "rocm"})
    with pytest.warns(FutureWarning, match="MOEHAL_NPU_EMULATE='off' is deprecated"):
        assert moehal.Settings.from_env({"MOEHAL_NPU_EMULATE": "off"}).emulate == frozenset()
    recwarn.clear()
    assert moehal.Settings.from_env({"MOEHAL_EMULATE": "npu"}).emulate == frozenset({"npu"})
    with pytest.raises(moehal.ConfigError, match="unset MOEHAL_NPU_EMULATE"):
        moehal.Settings.from_env({"MOEHAL_EMULATE": "npu", "MOEHAL_NPU_EMULATE": "no"})
    assert not [w for w in recwarn if issubclass(w.category, moehal.SettingsWarning)]  # the new name: quiet


def test_settings_made_in_code_are_checked_as_the_variables_are():
    assert moehal.Settings(backend="auto").backend is None
    assert moehal.Settings.from_env({"MOEHAL_BACKEND": "AUTO"}).backend is None
    assert moehal.Settings(emulate={"npu"}).emulate == frozenset({"npu"})
    for kwargs, match in [
        (dict(emulate="npu,rocm"), "emulate must be a set of names"),  # `in` matched substrings
        (dict(strict="no"), "strict must be a bool"),
        (dict(masked_workspace_gib="8"), "masked_workspace_gib must be a number"),
    ]:
        with pytest.raises(moehal.ConfigError, match=match):
            moehal.Settings(**kwargs)


def test_names_of_no_installed_plugin_are_warned_about():
    reg = moehal.Registry(moehal.Settings(disabled_plugins=frozenset({"cdua"}), emulate=frozenset({"nup"})))
    with pytest.warns(UserWarning) as rec:
        reg.load_entry_points()
    said = [str(w.message) for w in rec]
    assert any(m.startswith("MOEHAL_DISABLE_PLUGINS") and "names cdua, which no installed plugin is" in m for m in said)
    assert any(m.startswith("MOEHAL_EMULATE") and "names nup" in m for m in said)


def test_discover_with_settings_of_its_own_leaves_the_shared_registry(monkeypatch):
    """`discover(settings=...)` replaced the registry every layer built without `registry=`
    selects from: one caller's emulation turned on another's."""
    monkeypatch.setattr(moehal.plugins, "_default", None)
    shared = moehal.discover()
    own = moehal.discover(settings=moehal.Settings(emulate=frozenset({"npu"})))
    assert own is not shared and moehal.discover() is shared
    assert moehal.discover(strict=False) is not shared and moehal.discover() is shared
    assert moehal.discover(refresh=True) is not shared


def test_forced_backend_restricts_experts(plugin_path):
    reg = _registry(backend="reference")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    layer = moehal.MoELayer(cfg, "fp8_block", device="cpu", registry=reg)  # backend='auto' defers to settings
    assert layer.plan.pipeline.experts.backend == "reference"
    assert any(d.reason.startswith("not of the requested backend") for d in layer.plan.decisions)


def test_padding_ids_select_only_dispatchers_that_drop_them(plugin_path):
    """`MoEConfig.topk_padding` keeps the toy experts but not the toy dispatcher, which does not
    declare dropping -1 ids: the reference dispatcher (which does) moves their tokens, the
    decision says why, and the padded slots contribute nothing."""
    reg = _registry()
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    plain = moehal.MoELayer(cfg, "fp8_block", device="cpu", registry=reg)
    assert plain.plan.pipeline.dispatcher.qualname == "toy.bf16_only"
    padded = cfg.with_(topk_padding=True)
    layer = moehal.MoELayer(padded, "fp8_block", device="cpu", registry=reg)
    p = layer.plan.pipeline
    assert p.experts.qualname == "toy.fp8_masked" and p.dispatcher.qualname == "reference.local"
    why = [d for d in layer.plan.decisions if d.name == "toy.bf16_only"]
    assert why and all(not d.ok and d.predicate == "padding_ids" for d in why), why
    assert "drops_padding_ids" in why[0].reason and "-1 ids" in str(layer.plan)
    weights, x, ids, wts = build_problem(cfg, moehal.QuantScheme.parse("fp8_block"), 6)
    layer.load_weights(weights)
    ids = ids.clone()
    ids[::3] = -1
    ids[1, 0] = -1
    out = layer(x, ids, wts)
    assert torch.equal(out[::3], torch.zeros_like(out[::3]))
    # a dropped slot is a slot with no weight: the same token routed there with weight 0
    live = torch.where(ids < 0, torch.tensor(0), ids)
    live[::3] = torch.tensor([0, 1])
    live[1, 0] = int(({0, 1, 2, 3} - {int(live[1, 1])}).pop())
    ref = moehal.MoELayer(cfg, "fp8_block", backend="reference", layout="masked", device="cpu", registry=reg)
    ref.load_weights(weights)
    want = ref(x, live, torch.where(ids < 0, 0.0, wts))
    torch.testing.assert_close(out[1::3], want[1::3])
    torch.testing.assert_close(out[2::3], want[2::3])


def test_no_backend_error_lists_every_candidate(plugin_path):
    reg = _registry()
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, activation="gelu")
    with pytest.raises(moehal.NoBackendError) as info:
        moehal.MoELayer(cfg, "fp8_block", backend="toy", device="cpu", registry=reg)
    msg = str(info.value)
    assert "toy.fp8_masked: declined" in msg and "activation gelu not in ['silu']" in msg
    assert "reference.experts: declined: not of the requested backend" in msg


def test_unknown_backend_is_a_typed_error(registry):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.UnknownBackendError, match="loaded backends"):
        moehal.MoELayer(cfg, backend="nonesuch", registry=registry)


def test_layout_restriction_and_enumeration(registry):
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    req = moehal.BuildRequest(cfg, moehal.QuantScheme.parse("w8a8_int8"), moehal.detect("cpu"))
    pipes, decisions = moehal.enumerate_pipelines(req, registry, backend="reference")
    fmts = {(str(p.fmt.layout_name), p.fmt.scales) for p in pipes}
    assert {("masked", ScaleKind.PER_TOKEN), ("contiguous", ScaleKind.NONE), ("standard", ScaleKind.PER_TOKEN)} <= fmts
    plan = moehal.select(req, registry, "reference", "masked")
    assert plan.pipeline.fmt.layout is Layout.MASKED and plan.pipeline.fmt.scales is ScaleKind.PER_TOKEN
    assert "masked" in str(plan) and plan.as_dict()["pipeline"]["format"].startswith("masked")


def test_reference_layer_is_the_pure_reference_pipeline_or_says_what_is_missing(registry):
    from moehal.reference.oracle import reference_layer

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    layer = reference_layer(cfg, "fp8_block", "cpu", layout="masked", registry=registry)
    assert layer.plan.pipeline.name.startswith("reference.local -> reference.experts [masked")
    assert {d.qualname for d in registry.dispatchers} > {"reference.local"}, "the caller's registry is unchanged"
    with pytest.raises(ValueError, match="register the reference plugin"):
        reference_layer(cfg, "bf16", "cpu", registry=moehal.Registry(moehal.Settings()))


# A plugin's answers at selection and registration: malformed ones name the plugin ---------------

_BF16 = moehal.QuantScheme.parse("bf16")


class _AnyDispatcher(Dispatcher):
    name, priority = "any", 5

    def can_produce(self, fmt, req):
        return accept(predicate="format")

    def build(self, req, fmt):
        raise NotImplementedError


class _StandardExperts(Experts):
    name, priority = "k", 5
    quant_schemes = frozenset({_BF16})

    def input_formats(self, req):
        return [ActivationFormat(Layout.STANDARD, req.config.dtype)]

    def build(self, req, fmt):
        raise NotImplementedError


class _Fused(FusedForward):
    name, priority = "f", 5
    quant_schemes = frozenset({_BF16})

    def build(self, req):
        raise NotImplementedError


def _raise(*args):
    raise RuntimeError("probe failed")


def _answers_plugin(**hooks):
    """A well-formed plugin 'test' (a dispatcher that produces anything, standard bf16 experts),
    any of whose hooks a test replaces."""
    answers = {
        "moehal_backend_info": lambda: BackendInfo("test", "1", "malformed answers"),
        "moehal_dispatchers": lambda: [_AnyDispatcher()],
        "moehal_experts": lambda: [_StandardExperts()],
        **hooks,
    }
    return types.SimpleNamespace(**{hook: moehal.hookimpl(answer) for hook, answer in answers.items()})


def _select_test_plugin(plugin):
    reg = moehal.Registry(moehal.Settings())
    assert reg.register(plugin, "test").status == "loaded"
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    return moehal.select(moehal.BuildRequest(cfg, _BF16, moehal.detect("cpu"), moehal.Settings()), reg)


@pytest.mark.parametrize(
    "hook, kind, method, answer, match",
    [
        ("moehal_experts", _StandardExperts, "input_formats", lambda s, req: None, "input_formats answered None"),
        ("moehal_experts", _StandardExperts, "input_formats", lambda s, req: ["standard"], "input_formats answered"),
        ("moehal_experts", _StandardExperts, "execution_mode", _raise, "execution_mode raised RuntimeError"),
        ("moehal_experts", _StandardExperts, "execution_mode", lambda s, req: "fast", "execution_mode answered 'fast'"),
        (
            "moehal_experts",
            _StandardExperts,
            "small_batch_format",
            lambda s, req: s.input_formats(req)[0],
            "small_batch_format answered",
        ),
        ("moehal_dispatchers", _AnyDispatcher, "can_produce", lambda s, fmt, req: True, "can_produce answered True"),
        ("moehal_dispatchers", _AnyDispatcher, "supports", lambda s, req: True, "a capability check answered True"),
        ("moehal_fused_forwards", _Fused, "routes_internally", _raise, "routes_internally raised RuntimeError"),
        ("moehal_fused_forwards", _Fused, "routes_internally", lambda s, req: "yes", "routes_internally answered"),
    ],
)
def test_a_malformed_plugin_answer_at_selection_is_a_plugin_check_error(hook, kind, method, answer, match):
    """A plugin answer that raises, or is not what the contract says (a Decision, a list of
    ActivationFormat, a bool, a known execution mode...), stops selection with PluginCheckError
    naming the implementation and the hook, not an anonymous error from inside selection (or,
    worse, a silent acceptance)."""
    assert _select_test_plugin(_answers_plugin()).pipeline.name == "test.any -> test.k [standard[bfloat16]]"
    bad = type(f"Bad{kind.__name__}", (kind,), {method: answer})
    with pytest.raises(moehal.PluginCheckError, match=match) as info:
        _select_test_plugin(_answers_plugin(**{hook: lambda: [bad()]}))
    assert f"test.{kind.name}: " in str(info.value) and "plugin 'test'" in str(info.value)


@pytest.mark.parametrize(
    "hook, answer, why",
    [
        ("moehal_backend_info", lambda: {"name": "test", "version": "1"}, "not a moehal.BackendInfo"),
        ("moehal_backend_info", lambda: BackendInfo("test", 1, "x"), r"BackendInfo.version is 1 \(int\), not a str"),
        ("moehal_experts", lambda: _StandardExperts(), "moehal_experts returned .* not a list of Experts"),
    ],
)
def test_a_malformed_hook_answer_fails_the_plugin_and_adds_nothing(hook, answer, why, monkeypatch):
    """A plugin whose hooks answer the wrong type is recorded failed, with the reason, and none
    of its implementations is registered (auto-selection cannot use what doctor does not know);
    doctor reports it; strict mode raises."""
    from moehal.cli.doctor import collect

    plugin = _answers_plugin(**{hook: answer})
    reg = moehal.Registry(moehal.Settings())
    rec = reg.register(plugin, "test")
    assert rec.status == "failed" and reg.plugins["test"] is rec
    assert rec.error.startswith("PluginLoadError: ") and re.search(why, rec.error), rec.error
    assert not reg.all_implementations() and rec.implementations == [] and "test" not in reg.loaded_backends()
    monkeypatch.setattr(moehal, "discover", lambda **kw: reg)
    (entry,) = collect("cpu")["backends"]
    assert entry["status"] == "failed" and entry["available"] is False and entry["components"] == []
    strict = moehal.Registry(moehal.Settings(strict=True))
    with pytest.raises(moehal.PluginLoadError, match=why):
        strict.register(plugin, "test")
    assert not strict.all_implementations() and "test" not in strict.loaded_backends()


def test_a_format_the_dispatcher_produces_exactly_beats_an_earlier_one_that_needs_an_adapter():
    """Ranking is priority, then fewer adapters, then the experts' format preference: experts
    that list an fp8 format first (reachable only through the quantize adapter behind a
    dispatcher that sends bf16) and bf16 second get the bf16 format, dispatched as is. The
    adapter pipeline stays an alternative, ranked after it."""
    from moehal.capability import decline
    from moehal.interfaces import BuildRequest
    from moehal.plugins import Registry
    from moehal.selection import select

    fp8 = ActivationFormat(Layout.STANDARD, torch.float8_e4m3fn, ScaleKind.GROUP_128)
    bf16 = ActivationFormat(Layout.STANDARD, torch.bfloat16)

    class Bf16Only(Dispatcher):
        name, priority = "bf16_only", 5

        def can_produce(self, fmt, req):
            return decline("sends bf16 only", "format") if fmt.is_quantized else accept(predicate="format")

        def build(self, req, fmt):
            raise NotImplementedError

    class Fp8FirstExperts(Experts):
        name, priority = "fp8_first", 5
        quant_schemes = frozenset({moehal.QuantScheme.parse("fp8_block")})

        def input_formats(self, req):
            return [fp8, bf16]  # fp8 preferred; bf16 quantized inside the kernel

        def build(self, req, fmt):
            raise NotImplementedError

    plugin = types.SimpleNamespace(
        moehal_backend_info=moehal.hookimpl(lambda: BackendInfo("toyexact", "0", "toy")),
        moehal_dispatchers=moehal.hookimpl(lambda: [Bf16Only()]),
        moehal_experts=moehal.hookimpl(lambda: [Fp8FirstExperts()]),
    )
    reg = Registry(moehal.Settings())
    reg.register(plugin, "toyexact")
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=256, intermediate_size=128)
    req = BuildRequest(cfg, moehal.QuantScheme.parse("fp8_block"), moehal.detect("cpu"), moehal.Settings())
    plan = select(req, reg, backend="toyexact")
    p = plan.pipeline
    assert p.experts.qualname == "toyexact.fp8_first" and p.dispatcher.qualname == "toyexact.bf16_only"
    assert p.adapter is None and p.fmt == bf16 and p.dispatch_fmt == bf16, p.name
    via_adapter = [a for a in plan.alternatives if a.adapter == "quantize"]
    assert [(a.fmt, a.dispatch_fmt) for a in via_adapter] == [(fp8, bf16)], [a.name for a in plan.alternatives]


def test_a_plugin_that_fails_to_load_is_logged_and_named_when_nothing_else_accepts(caplog):
    """Recorded was not enough: a layer built on what remained said nothing, and a
    NoBackendError did not mention the plugin that might have served it."""
    reg = moehal.Registry(moehal.Settings())
    with caplog.at_level("WARNING", logger="moehal.plugins"):
        rec = reg.register(_answers_plugin(moehal_experts=_raise), "test")
    assert rec.status == "failed"
    assert any("'test' failed to load" in r.getMessage() and "probe failed" in r.getMessage() for r in caplog.records)
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    with pytest.raises(moehal.NoBackendError, match="Plugins that failed to load .*: test"):
        moehal.MoELayer(cfg, device="cpu", registry=reg)


@pytest.mark.parametrize(
    "attr, value, why",
    [
        ("priority", "10", r"'10' \(str\), not an int"),
        ("priority", True, "not an int"),
        ("quant_schemes", frozenset({"bf16"}), r"QuantScheme.parse\('bf16'\)"),
        ("devices", ["cpu"], "not a frozenset of str"),
        ("activations", frozenset({"silu"}), "not a frozenset of Activation"),
        ("deterministic", 1, "not a bool"),
        ("name", "a.b", "without dots"),
    ],
)
def test_malformed_declarations_fail_their_plugin_not_every_layer(attr, value, why):
    """A `priority = "10"` was accepted at load and then broke every layer's selection on the
    machine (`backend="reference"` too) and `moehal doctor`, with an anonymous TypeError."""
    bad = type("BadExperts", (_StandardExperts,), {attr: value})
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    rec = reg.register(_answers_plugin(moehal_experts=lambda: [bad()]), "test")
    assert rec.status == "failed" and re.search(f"moehal_experts: BadExperts.{attr} .*{why}", rec.error), rec.error
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    assert moehal.MoELayer(cfg, device="cpu", backend="reference", registry=reg).plan is not None


class _Processor(WeightProcessor):
    name, priority, layout = "weights", 5, "test_layout"

    def process(self, weights, req):
        return weights


class _NoLayoutProcessor(WeightProcessor):  # what a vendor wrote from the guide, which never named `layout`
    name, priority = "weights", 100

    def process(self, weights, req):
        return weights


@pytest.mark.parametrize(
    "hook, impl, why",
    [
        ("moehal_weight_processors", _NoLayoutProcessor, r"_NoLayoutProcessor.layout is None .*not a non-empty str"),
        (
            "moehal_weight_processors",
            type("Canonical", (_Processor,), {"layout": "canonical"}),
            "other than 'canonical'",
        ),
        ("moehal_experts", type("Bad", (_StandardExperts,), {"weight_layout": 3}), "Bad.weight_layout is 3"),
        ("moehal_dispatchers", type("Bad", (_AnyDispatcher,), {"drops_padding_ids": "no"}), "drops_padding_ids"),
        ("moehal_dispatchers", type("Bad", (_AnyDispatcher,), {"zero_padding": None}), "zero_padding .*a bool"),
        ("moehal_fused_forwards", type("Bad", (_Fused,), {"drops_padding_ids": "yes"}), "drops_padding_ids .*a bool"),
        ("moehal_fused_forwards", type("Bad", (_Fused,), {"accepts": frozenset({"ids"})}), "accepts .*'topk' and/or"),
        ("moehal_fused_forwards", type("Bad", (_Fused,), {"routing_methods": {"softmax"}}), "routing_methods .*Rou"),
    ],
)
def test_each_kinds_own_declarations_are_checked_at_load(hook, impl, why):
    """Only the attributes every implementation shares were checked. A weight processor
    without `layout` loaded, then every layer's selection on the machine raised
    AttributeError (the lookup reads each processor's layout, whatever the backend), and a
    dispatcher's `drops_padding_ids = "no"` was read as a claim to drop -1 ids. Each now fails
    its own plugin at load, and other backends' layers still build."""
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    rec = reg.register(_answers_plugin(**{hook: lambda: [impl()]}), "test")
    assert rec.status == "failed" and re.search(why, rec.error), rec.error
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    assert moehal.MoELayer(cfg, device="cpu", registry=reg).plan is not None


def _layout_plugin(backend: str, priority: int, with_experts: bool):
    """Backend `backend`: a processor of layout 'shared' at `priority`, and (with_experts)
    standard experts that ask for that layout."""

    class Proc(_Processor):
        layout = "shared"

    Proc.priority = priority
    experts = type("LayoutExperts", (_StandardExperts,), {"weight_layout": "shared"})
    hooks = {
        "moehal_backend_info": lambda: BackendInfo(backend, "1", "layouts"),
        "moehal_weight_processors": lambda: [Proc()],
        "moehal_experts": (lambda: [experts()]) if with_experts else (lambda: []),
        "moehal_dispatchers": (lambda: [_AnyDispatcher()]) if with_experts else (lambda: []),
    }
    return types.SimpleNamespace(**{hook: moehal.hookimpl(answer) for hook, answer in hooks.items()})


def test_a_kernels_own_backend_prepares_its_weights_whatever_another_plugins_priority():
    """Layout names are plain strings, matched across plugins by priority alone: a vendor's
    processor at priority 100 that happened to name its layout as another backend's did got
    that backend's weights (the plan read `weights shared via vendor.weights`) and returned
    something its kernel cannot use. The kernel's own backend comes first now; a layout that
    only another backend prepares is still shared (the CUDA and ROCm Triton kernels share one)."""
    cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64)
    req = moehal.BuildRequest(cfg, _BF16, moehal.detect("cpu"), moehal.Settings())
    reg = moehal.Registry(moehal.Settings())
    assert reg.register(_layout_plugin("own", 1, with_experts=True), "own").status == "loaded"
    assert reg.register(_layout_plugin("vendor", 100, with_experts=False), "vendor").status == "loaded"
    assert moehal.select(req, reg, backend="own").pipeline.processor.qualname == "own.weights"
    shared = moehal.Registry(moehal.Settings())  # the kernel's backend prepares no such layout itself
    shared.register(_layout_plugin("vendor", 100, with_experts=False), "vendor")
    plugin = _layout_plugin("own", 1, with_experts=True)
    plugin.moehal_weight_processors = moehal.hookimpl(lambda: [])
    shared.register(plugin, "own")
    assert moehal.select(req, shared, backend="own").pipeline.processor.qualname == "vendor.weights"


def test_moehals_own_backend_names_load_from_moehal_only(tmp_path, monkeypatch):
    """A third-party entry point named `reference` made the two-provider rule load neither:
    every CPU layer and the oracle were gone. moehal's own loads; the other is refused by name."""
    _make_dist(tmp_path, "zeta_clone", "zeta_clone_plugin", textwrap.dedent(TOY_PLUGIN), "reference")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = _registry()
    assert reg.plugins["reference"].status == "loaded" and reg.plugins["reference"].distribution == "moehal"
    (clone,) = [r for r in reg.failed() if r.distribution == "zeta_clone"]
    assert "'reference' is moehal's own" in clone.error and "another entry-point name" in clone.error
    assert "zeta_clone_plugin" not in sys.modules


def test_a_fallback_chosen_on_an_accelerator_warns_and_one_asked_for_by_name_does_not(monkeypatch):
    """vLLM once fell back to the CPU silently. Here a layer on a GPU that no native kernel takes
    runs the reference experts: right, but float32 weights dequantized at load (4x an fp8
    checkpoint) and a loop over experts. Chosen by `auto`, that is a `FallbackWarning`; asked
    for by name, or on a CPU, it is what the caller meant."""
    import warnings

    from moehal import layer as layer_mod
    from moehal.hardware import HardwareInfo
    from moehal.reference import plugin as reference_plugin

    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    reg = moehal.Registry(moehal.Settings())
    reg.register(reference_plugin, "reference")
    # an A100 as the selection sees it (fp8 has no native kernel there); the tensors stay on the CPU
    a100 = HardwareInfo("cuda", torch.device("cpu"), "NVIDIA A100-SXM4-80GB", (8, 0))
    monkeypatch.setattr(layer_mod, "detect", lambda device=None: a100)
    with pytest.warns(moehal.FallbackWarning, match=r"fp8_block on the slow fallback reference\.experts") as rec:
        moehal.MoELayer(cfg, "fp8_block", registry=reg)
    assert rec[0].filename == __file__  # the user's line
    # which layer, and the explain line for its configuration (explain's defaults are another model's)
    message = str(rec[0].message)
    assert "E=4 top2 H=128 I=64" in message
    assert "moehal explain -E 4 -k 2 --hidden 128 --intermediate 64 --quant fp8_block" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", moehal.FallbackWarning)
        moehal.MoELayer(cfg, "fp8_block", backend="reference", registry=reg)
        monkeypatch.setattr(layer_mod, "detect", lambda device=None: moehal.detect("cpu"))
        moehal.MoELayer(cfg, "fp8_block", registry=reg)


def test_the_plan_is_logged_once_per_distinct_configuration(monkeypatch, caplog):
    """An operator reads from the logs which pipeline each kind of layer got: one line for a
    model's identical layers, one more for a layer of another shape (an observability review:
    48 layers built with DEBUG logging gave no line at all)."""
    import logging

    from moehal import layer as layer_mod

    monkeypatch.setattr(layer_mod, "_LOGGED_PLANS", set())
    cfg = moehal.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    with caplog.at_level(logging.INFO, logger="moehal.layer"):
        layers = [moehal.MoELayer(cfg, "bf16", backend="reference", device="cpu") for _ in range(5)]
        moehal.MoELayer(dataclasses.replace(cfg, intermediate_size=128), "bf16", backend="reference", device="cpu")
    lines = [r.message for r in caplog.records if r.name == "moehal.layer"]
    assert len(lines) == 2, lines
    assert "E=4 top2 H=128 I=64" in lines[0] and "reference.experts" in lines[0] and "(native)" in lines[0]
    assert "I=128" in lines[1]
    assert "device=cpu" in repr(layers[0])
