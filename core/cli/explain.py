"""`moehal explain`: the decision table for one configuration given as flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import moehal
import torch
from moehal.cli.common import cell, console, print_json, status_text, table
from moehal.errors import MoEHalError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", "-E", type=int, default=8, help="global expert count")
    p.add_argument("--top-k", "-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--activation", default="silu", choices=[a.value for a in moehal.Activation])
    p.add_argument("--non-gated", action="store_true")
    p.add_argument("--bias", action="store_true", help="w13 and w2 biases")
    p.add_argument("--quant", default="bf16", help="bf16, fp8_block[:ue8m0], fp8_tensor, nvfp4, w8a8_int8")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--ep-rank", type=int, default=0)
    p.add_argument(
        "--routing",
        default=None,
        choices=[m.value for m in moehal.RoutingMethod],
        help="route inside the layer from router logits with this method",
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--topk-padding", action="store_true", help="top-k ids may be -1 (padded tokens' slots)")


def config_from_args(args: argparse.Namespace) -> moehal.MoEConfig:
    routing = moehal.RoutingConfig(args.routing) if args.routing else None
    return moehal.MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        activation=args.activation,
        gated=not args.non_gated,
        has_w13_bias=args.bias,
        has_w2_bias=args.bias,
        dtype=_DTYPES[args.dtype],
        ep_size=args.ep_size,
        ep_rank=args.ep_rank,
        routing=routing,
        max_tokens=args.max_tokens,
        topk_padding=args.topk_padding,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show why each candidate was accepted or declined for a configuration")
    add_config_flags(p)
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default=None, help="restrict experts/fused forwards to this backend")
    p.add_argument("--layout", default=None, help="restrict to experts consuming this layout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    try:
        cfg = config_from_args(args)
        quant = moehal.QuantScheme.parse(args.quant)
    except MoEHalError as exc:
        console.print(f"[red]invalid configuration:[/red] {exc}")
        return 2
    reg = moehal.discover()
    req = moehal.BuildRequest(cfg, quant, moehal.detect(args.device), reg.settings)
    # `auto` (or no flag) defers to MOEHAL_BACKEND, as `MoELayer(backend="auto")` does
    backend = args.backend if args.backend not in (None, "auto") else reg.settings.backend
    if backend is not None:
        try:
            reg.check_backend(backend)
        except MoEHalError as exc:
            console.print(str(exc), style="red", markup=False, highlight=False)
            return 2
    pipelines, decisions = moehal.enumerate_pipelines(req, reg, backend, args.layout)
    if args.json:
        print_json(
            {
                "config": cfg.describe(),
                "quant": quant.name,
                "hardware": req.hardware.describe(),
                "chosen": pipelines[0].as_dict() if pipelines else None,
                "pipelines": [p.as_dict() for p in pipelines],
                "decisions": [d.as_dict() for d in decisions],
            }
        )
        return 0 if pipelines else 1
    console.print(f"[bold]{cfg.describe()}[/bold] | quant {quant.name} | {req.hardware.describe()}")
    t = table("Decisions", "candidate", "kind", "accepted", "check", "reason")
    for d in decisions:
        t.add_row(cell(d.name), d.kind, status_text(d.ok), d.predicate, cell(d.reason))
    console.print(t)
    if not pipelines:
        console.print("[red]No pipeline accepts this configuration.[/red]")
        return 1
    plan = moehal.select(req, reg, backend, args.layout)
    console.print(str(plan), markup=False, highlight=False)
    if len(pipelines) > 1:
        console.print("Ranked alternatives: " + "; ".join(p.name for p in pipelines[1:6]), markup=False)
    return 0
