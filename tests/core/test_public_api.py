"""The public surface a vendor and an engine build against: exported, and documented."""

from __future__ import annotations


def test_what_a_vendor_subclasses_or_returns_is_exported_and_documented():
    """A third-party backend subclasses the runners and returns the dispatch and experts
    outputs, yet `moehal.ExpertsRunner` and the six input/output types were missing from the
    package, `moehal.interfaces` and `moehal.formats` had no `__all__`, and `FusedRunner`,
    `accept`, `decline`, `require`, `Decision`, `Settings`, `Layout`, `QuantKind` and
    `ScaleFormat` had no docstring of their own (a dataclass's generated signature is none)."""
    import inspect

    import moehal
    import moehal.formats
    import moehal.interfaces
    from moehal.integrations import transformers

    vendor = {"DispatchRunner", "ExpertsRunner", "FusedRunner"}
    vendor |= {f"{layout}{side}" for layout in ("Standard", "Contiguous", "Masked") for side in ("Input", "Output")}
    assert vendor <= set(moehal.__all__), sorted(vendor - set(moehal.__all__))
    assert "UntrackedWeightsWarning" in transformers.__all__  # the user guide names it
    undocumented = []
    for module in (moehal, moehal.interfaces, moehal.formats):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = (obj.__doc__ or "").strip()
                if not doc or doc.startswith(f"{name}("):
                    undocumented.append(f"{module.__name__}.{name}")
    assert not undocumented, undocumented
