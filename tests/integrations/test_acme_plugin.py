"""The example third-party plugin (examples/acme_plugin): pip-installed as its own
distribution, discovered through its entry point, selected, and right against the reference."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import moehal
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "acme_plugin"
H, INTER, E, K = 64, 32, 8, 2


@pytest.fixture(scope="module")
def acme_site(tmp_path_factory) -> Path:
    """pip install ./examples/acme_plugin into a private --target dir (moehal and torch are
    already importable, so --no-deps; no build isolation keeps it offline and fast)."""
    target = tmp_path_factory.mktemp("acme-site")
    src = tmp_path_factory.mktemp("acme-src") / "acme_plugin"  # build outside the checkout (no build/ left)
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--target", str(target), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(target.glob("acme_moehal-*.dist-info")), sorted(p.name for p in target.iterdir())
    return target


@pytest.fixture
def registry(acme_site, monkeypatch):
    monkeypatch.syspath_prepend(str(acme_site))
    for name in [m for m in sys.modules if m == "acme_moehal" or m.startswith("acme_moehal.")]:
        monkeypatch.delitem(sys.modules, name)
    reg = moehal.Registry(moehal.Settings())
    reg.load_entry_points()
    return reg


def _problem(dtype, seed=0, t=13):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype)
    x = torch.randn(t, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, K, generator=gen)
    return w13, w2, x, ids, wts


def _layer(cfg, registry, backend, w13, w2):
    layer = moehal.MoELayer(cfg, backend=backend, device="cpu", registry=registry)
    layer.load_weights(w13=w13, w2=w2)
    return layer


def test_discovered_from_its_own_distribution(registry, acme_site):
    rec = registry.plugins["acme"]
    assert rec.status == "loaded", rec.error
    assert rec.distribution == "acme-moehal" and rec.version == "0.1.0"
    assert rec.implementations == ["acme.experts"]
    import acme_moehal

    assert Path(acme_moehal.__file__).is_relative_to(acme_site)  # the installed copy, not the source tree


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selected_and_matches_reference(registry, dtype):
    cfg = moehal.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, dtype=dtype)
    w13, w2, x, ids, wts = _problem(dtype)
    acme = _layer(cfg, registry, "acme", w13, w2)
    assert acme.plan.pipeline.experts.qualname == "acme.experts"
    auto = moehal.MoELayer(cfg, device="cpu", registry=registry)
    assert auto.plan.pipeline.experts.qualname == "acme.experts"  # priority 5 beats the reference's 0 on CPU
    ref = _layer(cfg, registry, "reference", w13, w2)
    out = acme(x, ids, wts)
    tol = {} if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)  # bf16: one rounding apart at most
    torch.testing.assert_close(out.float(), ref(x, ids, wts).float(), **tol)
    # and against float64 written out here, independent of both
    want = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(K):
            e = int(ids[t, k])
            g, u = (w13[e].double() @ x[t].double()).chunk(2)
            want[t] += float(wts[t, k]) * (w2[e].double() @ (g * torch.sigmoid(g) * u))
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=atol)


def test_expert_parallel_slice_and_scaling(registry):
    cfg = moehal.MoEConfig(
        num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, dtype=torch.float32,
        ep_rank=1, ep_size=2, routed_scaling_factor=2.5,
    )  # fmt: skip
    w13, w2, x, ids, wts = _problem(torch.float32, seed=1)
    local = slice(E // 2, E)
    acme = _layer(cfg, registry, "acme", w13[local], w2[local])
    ref = _layer(cfg, registry, "reference", w13[local], w2[local])
    torch.testing.assert_close(acme(x, ids, wts), ref(x, ids, wts), rtol=1e-5, atol=1e-6)


def test_declines_what_it_does_not_support(registry):
    cfg = moehal.MoEConfig(
        num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, activation="gelu", dtype=torch.float32
    )
    with pytest.raises(moehal.NoBackendError, match="activation gelu not in"):
        moehal.MoELayer(cfg, backend="acme", device="cpu", registry=registry)
    auto = moehal.MoELayer(cfg, device="cpu", registry=registry)  # falls back to the reference
    assert auto.plan.pipeline.experts.backend == "reference"
