"""`MoELayer.forward` as a `torch.library` custom op, so compilers see one opaque node.

`torch.compile` cannot trace into a backend's kernels (Triton launches, vendor extensions,
host-side plan objects) without graph breaks, and it must not: the layer already chose its
pipeline at build. So while Dynamo traces, `MoELayer.forward` emits one of

    moehal::moe_forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer_id) -> Tensor
    moehal::moe_forward_logits(Tensor hidden, Tensor router_logits, int layer_id) -> Tensor

and at run time the op calls the layer's ordinary eager forward. `layer_id` names the layer in
a process-wide registry of weak references that every `MoELayer` joins at construction; the
registry never keeps a layer alive.

The fake (meta) implementations check, at trace time, everything the eager forward checks
without reading values: ranks, the hidden size, dtypes, top-k width, devices, that the
layer exists and has its weights, and (symbolically, with `torch._check`) that the token
counts agree. A shape error therefore fails the compile with the same message as eager,
instead of a kernel fault later. The output is a fresh contiguous `[T, H]` tensor of the
layer dtype, never an alias of an input (the real op clones in the one case where a
pipeline would hand an input back).

CUDA graphs: the op itself adds no host work that matters to a capture (a dict lookup at
capture time); whether the forward captures depends on the chosen pipeline, declared by
each implementation's `graph_capturable` (see `is_graph_capturable`).

Inference only: no autograd formula is registered. Inputs that require grad are detached
while tracing, as the eager forward runs without recording autograd.
"""

from __future__ import annotations

import itertools
import threading
import weakref
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from moehal.errors import InputError, MoEHalError, WeightsNotLoadedError

if TYPE_CHECKING:  # pragma: no cover
    from moehal.layer import MoELayer

__all__ = [
    "adopt_id",
    "get_layer",
    "is_graph_capturable",
    "moe_forward",
    "moe_forward_logits",
    "register_layer",
    "set_refresher",
    "traced_forward",
]

# re-entrant: a layer's weakref callback (`_forget`) runs inside whatever allocation set off the
# garbage collector, `register_layer`'s own included, on the thread holding the lock
_lock = threading.RLock()
_ids = itertools.count()
_layers: dict[int, weakref.ReferenceType[MoELayer]] = {}
# layer_id -> a callable the real ops call first: it brings the layer up to date (e.g. rebuilds
# it after its source weights changed) and may hand the id to a new layer (`adopt_id`)
_refreshers: dict[int, Callable[[], object]] = {}


def _forget(ref: weakref.ReferenceType[MoELayer], layer_id: int) -> None:
    with _lock:
        if _layers.get(layer_id) is ref:  # not a layer that adopted the id since
            del _layers[layer_id]
            _refreshers.pop(layer_id, None)


def _fingerprint(layer: MoELayer) -> int:
    """24 bits of what the layer computes (config, scheme, pipeline), stable across processes."""
    what = f"{layer.config!r}|{layer.quant.name}|{layer.plan.pipeline.name}"
    return zlib.crc32(what.encode()) & _FINGERPRINT_MASK


_FINGERPRINT_BITS = 24
_FINGERPRINT_MASK = (1 << _FINGERPRINT_BITS) - 1


def register_layer(layer: MoELayer) -> int:
    """Give `layer` a process-unique id for the custom ops (called by `MoELayer.__init__`, and
    again for a copy: a deep copy or an unpickled layer is another layer).

    An id is the layer's order of construction in the process and a fingerprint of its config,
    scheme and pipeline: the same model built the same way gets the same ids in every process
    (compile caches keep working), and a program exported in one process (`torch.export.save`,
    AOTInductor) that a process with other layers loads finds no layer of that id, rather than
    running whichever layer was built in that place."""
    with _lock:
        layer_id = (next(_ids) << _FINGERPRINT_BITS) | _fingerprint(layer)
        _layers[layer_id] = weakref.ref(layer, lambda ref, i=layer_id: _forget(ref, i))
    return layer_id


def adopt_id(layer: MoELayer, layer_id: int) -> None:
    """Make `layer` the one that `layer_id` names, in place of the layer that had it: graphs
    compiled on the old layer run the new one. For a rebuild of the same layer (same config),
    as the transformers integration does when a module's weights change."""
    with _lock:
        _layers[layer_id] = weakref.ref(layer, lambda ref, i=layer_id: _forget(ref, i))
    layer._op_id = layer_id


def set_refresher(layer_id: int, refresh: Callable[[], object] | None) -> None:
    """Have the real ops call `refresh()` before running layer `layer_id` (None: stop). The fake
    implementations never call it: a rebuild cannot run while a compiler traces."""
    with _lock:
        if refresh is None:
            _refreshers.pop(layer_id, None)
        else:
            _refreshers[layer_id] = refresh


def _live_layer(layer_id: int) -> MoELayer:
    refresh = _refreshers.get(layer_id)
    if refresh is not None:
        refresh()
    return get_layer(layer_id)


def get_layer(layer_id: int) -> MoELayer:
    """The live layer registered under `layer_id`."""
    ref = _layers.get(layer_id)
    layer = ref() if ref is not None else None
    if layer is None:
        raise MoEHalError(
            f"no moehal layer has id {layer_id} in this process: it was garbage collected while a compiled "
            "graph or CUDA graph still refers to it (keep the MoELayer alive as long as the compiled model), "
            "or the program was exported in a process that built other layers, or built them in another "
            "order (programs call layers by id: build the same layers in the same order before loading one)"
        )
    return layer


def is_graph_capturable(layer: MoELayer) -> bool:
    """Whether every implementation in the layer's pipeline declares `graph_capturable`."""
    p = layer.plan.pipeline
    parts = [p.fused] if p.kind == "fused" else [p.dispatcher, p.experts]
    return all(x is not None and x.graph_capturable for x in parts)


def _not_aliasing(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    # custom ops must not return a view of an input; a pipeline returning an input unchanged
    # (no work to do) would otherwise violate the op's contract.
    ptr = out.untyped_storage().data_ptr()
    if any(ptr == t.untyped_storage().data_ptr() for t in inputs):
        return out.clone()
    return out


@torch.library.custom_op("moehal::moe_forward", mutates_args=())
def moe_forward(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_id: int
) -> torch.Tensor:
    """Run layer `layer_id` on caller-routed tokens (eager forward of `MoELayer`)."""
    out = _live_layer(layer_id).forward(hidden, topk_ids, topk_weights)
    return _not_aliasing(out, hidden, topk_ids, topk_weights)


@torch.library.custom_op("moehal::moe_forward_logits", mutates_args=())
def moe_forward_logits(hidden: torch.Tensor, router_logits: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Run layer `layer_id`, routing from `router_logits` (eager forward of `MoELayer`)."""
    out = _live_layer(layer_id).forward(hidden, router_logits=router_logits)
    return _not_aliasing(out, hidden, router_logits)


def _fake_hidden(layer: MoELayer, hidden: torch.Tensor) -> None:
    c = layer.config
    if not layer.weights_ready:
        raise WeightsNotLoadedError("the layer has no weights: call layer.load_weights(...) before compiling")
    if hidden.dim() != 2 or hidden.shape[1] != c.hidden_size:
        raise InputError(f"hidden_states must be [T, {c.hidden_size}], got {list(hidden.shape)}")
    if hidden.dtype != c.dtype:
        raise InputError(f"hidden_states dtype is {hidden.dtype}; this layer was built for {c.dtype}")
    want = layer.device
    if hidden.device.type != want.type or (want.index is not None and hidden.device.index not in (None, want.index)):
        raise InputError(f"hidden_states is on {hidden.device}; the layer is on {want}")  # (cuda:1 too, as eager)
    if c.max_tokens is not None:
        torch._check(
            hidden.shape[0] <= c.max_tokens,
            lambda: f"{hidden.shape[0]} tokens exceed MoEConfig.max_tokens={c.max_tokens}",
        )


def _traced_layer(layer_id: int | torch.SymInt) -> MoELayer:
    """The layer a fake implementation checks against. Compiling one block for many layers
    (regional compilation, with `torch._dynamo.config.allow_unspec_int_on_nn_module`) makes the
    id symbolic: its trace-time value names one of those layers, and reading it adds no guard,
    so the block is not recompiled per layer."""
    if isinstance(layer_id, torch.SymInt):
        hint = getattr(layer_id.node, "hint", None)  # the example value; no guard
        if not isinstance(hint, int):
            raise InputError("moehal's custom op got a layer id with no known value while tracing")
        return get_layer(hint)
    return get_layer(layer_id)


@moe_forward.register_fake
def _moe_forward_fake(
    hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_id: int
) -> torch.Tensor:
    layer = _traced_layer(layer_id)
    _fake_hidden(layer, hidden)
    k = layer.config.top_k
    if topk_ids.dim() != 2 or topk_weights.dim() != 2 or topk_ids.shape[1] != k or topk_weights.shape[1] != k:
        raise InputError(
            f"topk_ids and topk_weights must be [T, {k}], got {list(topk_ids.shape)} and {list(topk_weights.shape)}"
        )
    torch._check(
        topk_ids.shape[0] == hidden.shape[0] and topk_weights.shape[0] == hidden.shape[0],
        lambda: f"topk tensors have {topk_ids.shape[0]}/{topk_weights.shape[0]} rows, hidden_states {hidden.shape[0]}",
    )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise InputError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.device != hidden.device or topk_weights.device != hidden.device:
        raise InputError(
            f"topk tensors are on {topk_ids.device}/{topk_weights.device}, hidden_states on {hidden.device}"
        )
    if not layer._accepts_topk:
        raise InputError(f"{layer.plan.pipeline.name} routes inside the kernel and takes router_logits only")
    return hidden.new_empty(hidden.shape)


@moe_forward_logits.register_fake
def _moe_forward_logits_fake(hidden: torch.Tensor, router_logits: torch.Tensor, layer_id: int) -> torch.Tensor:
    layer = _traced_layer(layer_id)
    _fake_hidden(layer, hidden)
    c = layer.config
    if c.routing is None:
        raise InputError("router_logits given, but MoEConfig.routing is None: set a RoutingConfig")
    if router_logits.dim() != 2 or router_logits.shape[1] != c.num_experts:
        raise InputError(f"router_logits must be [T, {c.num_experts}], got {list(router_logits.shape)}")
    torch._check(
        router_logits.shape[0] == hidden.shape[0],
        lambda: f"router_logits has {router_logits.shape[0]} rows, hidden_states {hidden.shape[0]}",
    )
    if not router_logits.is_floating_point():
        raise InputError(f"router_logits must be floating point, got {router_logits.dtype}")
    if router_logits.device != hidden.device:
        raise InputError(f"router_logits is on {router_logits.device}, hidden_states on {hidden.device}")
    return hidden.new_empty(hidden.shape)


def traced_forward(
    layer: MoELayer,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    router_logits: torch.Tensor | None,
) -> torch.Tensor:
    """What `MoELayer.forward` does while a compiler traces it: emit the custom op."""
    if torch.is_grad_enabled():  # inference only, as the eager forward: no gradient through the op
        hidden_states, topk_ids, topk_weights, router_logits = _detached(
            hidden_states, topk_ids, topk_weights, router_logits
        )
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise InputError("pass either topk_ids/topk_weights or router_logits, not both")
        return torch.ops.moehal.moe_forward_logits(hidden_states, router_logits, layer._op_id)
    if topk_ids is None or topk_weights is None:
        raise InputError("pass topk_ids and topk_weights (or router_logits=...)")
    return torch.ops.moehal.moe_forward(hidden_states, topk_ids, topk_weights, layer._op_id)


def _detached(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Inputs cut from autograd: the op has no backward, and an input that requires grad made
    the compilers fail ("no autograd formula was registered") where the eager forward runs
    without recording (`InferenceOnlyWarning`; no warning here: it would break the graph)."""
    return tuple(t.detach() if t is not None and t.requires_grad else t for t in tensors)
