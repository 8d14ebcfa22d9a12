"""moehal: one API for Mixture-of-Experts layers on any hardware.

import moehal
cfg = moehal.MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512)
layer = moehal.MoELayer(cfg, quant="bf16")
layer.load_weights(w13=w13, w2=w2)
out = layer(x, topk_ids, topk_weights)
print(layer.plan)
"""

from __future__ import annotations

__version__ = "0.1.0"

from moehal.capability import Decision, accept, decline, require
from moehal.config import Activation, MoEConfig
from moehal.errors import (
    ConfigError,
    ContractError,
    DeprecatedSettingWarning,
    FallbackWarning,
    InferenceOnlyWarning,
    InputError,
    MoEHalError,
    MoEHalWarning,
    NoBackendError,
    NotSupportedError,
    PluginCheckError,
    PluginLoadError,
    SettingsWarning,
    UnknownBackendError,
    WeightError,
    WeightsAlreadyProcessedError,
    WeightsNotLoadedError,
)
from moehal.formats import (
    ActivationFormat,
    ContiguousInput,
    ContiguousOutput,
    Layout,
    MaskedInput,
    MaskedOutput,
    ScaleKind,
    SmallBatchFormat,
    StandardInput,
    StandardOutput,
)
from moehal.hardware import HardwareInfo, detect
from moehal.hookspecs import hookimpl
from moehal.interfaces import (
    BackendInfo,
    BuildRequest,
    Dispatcher,
    DispatchRunner,
    Experts,
    ExpertsRunner,
    FusedForward,
    FusedRunner,
    TunedShape,
    WeightProcessor,
)
from moehal.layer import MoELayer
from moehal.plugins import Registry, discover
from moehal.quant import QuantKind, QuantScheme, ScaleFormat
from moehal.routing import RoutingConfig, RoutingMethod, TopK, route
from moehal.selection import Plan, enumerate_pipelines, select
from moehal.settings import Settings
from moehal.weights import ExpertWeights, dequantize_weights, from_per_expert, quantize_weights

__all__ = [
    "Activation",
    "ActivationFormat",
    "BackendInfo",
    "BuildRequest",
    "ConfigError",
    "ContiguousInput",
    "ContiguousOutput",
    "ContractError",
    "Decision",
    "DeprecatedSettingWarning",
    "DispatchRunner",
    "Dispatcher",
    "ExpertWeights",
    "Experts",
    "ExpertsRunner",
    "FallbackWarning",
    "FusedForward",
    "FusedRunner",
    "HardwareInfo",
    "InferenceOnlyWarning",
    "InputError",
    "Layout",
    "MaskedInput",
    "MaskedOutput",
    "MoEConfig",
    "MoEHalError",
    "MoEHalWarning",
    "MoELayer",
    "NoBackendError",
    "NotSupportedError",
    "Plan",
    "PluginCheckError",
    "PluginLoadError",
    "QuantKind",
    "QuantScheme",
    "Registry",
    "RoutingConfig",
    "RoutingMethod",
    "ScaleFormat",
    "ScaleKind",
    "Settings",
    "SettingsWarning",
    "SmallBatchFormat",
    "StandardInput",
    "StandardOutput",
    "TopK",
    "TunedShape",
    "UnknownBackendError",
    "WeightError",
    "WeightProcessor",
    "WeightsAlreadyProcessedError",
    "WeightsNotLoadedError",
    "accept",
    "decline",
    "dequantize_weights",
    "detect",
    "discover",
    "enumerate_pipelines",
    "from_per_expert",
    "hookimpl",
    "quantize_weights",
    "require",
    "route",
    "select",
    "__version__",
]
