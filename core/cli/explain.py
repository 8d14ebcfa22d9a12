"""`moehal explain`: the decision table for one configuration given as flags."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import moehal
import torch
from moehal.cli.common import cell, console, make_console, print_json, status_text, table
from moehal.errors import ConfigError, MoEHalError
from moehal.selection import Pipeline

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", "-E", type=int, default=8, help="global expert count")
    p.add_argument("--top-k", "-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--activation", default="silu", choices=[a.value for a in moehal.Activation])
    p.add_argument("--non-gated", action="store_true")
    p.add_argument("--bias", action="store_true", help="w13 and w2 biases (--w13-bias and --w2-bias)")
    p.add_argument("--w13-bias", action="store_true", help="a w13 bias (MoEConfig.has_w13_bias)")
    p.add_argument("--w2-bias", action="store_true", help="a w2 bias (MoEConfig.has_w2_bias)")
    p.add_argument(
        "--router-weight-on-input",
        action="store_true",
        help="scale the input by the router weight, not the output (MoEConfig.apply_router_weight_on_input; top-k 1)",
    )
    p.add_argument("--routed-scaling-factor", type=float, default=1.0, help="MoEConfig.routed_scaling_factor")
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
    p.add_argument("--no-renormalize", action="store_true", help="with --routing: RoutingConfig.renormalize=False")
    p.add_argument("--n-group", type=int, default=None, help="with --routing deepseek_v3: RoutingConfig.n_group")
    p.add_argument("--topk-group", type=int, default=None, help="with --routing deepseek_v3: RoutingConfig.topk_group")
    p.add_argument(
        "--correction-bias",
        action="store_true",
        help="with --routing deepseek_v3: RoutingConfig.has_correction_bias",
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--topk-padding", action="store_true", help="top-k ids may be -1 (padded tokens' slots)")


def config_from_args(args: argparse.Namespace) -> moehal.MoEConfig:
    routing_flags = {
        "--no-renormalize": args.no_renormalize,
        "--n-group": args.n_group is not None,
        "--topk-group": args.topk_group is not None,
        "--correction-bias": args.correction_bias,
    }
    routing = None
    if args.routing:
        routing = moehal.RoutingConfig(
            args.routing,
            renormalize=not args.no_renormalize,
            n_group=1 if args.n_group is None else args.n_group,
            topk_group=1 if args.topk_group is None else args.topk_group,
            has_correction_bias=args.correction_bias,
        )
    elif any(routing_flags.values()):
        given = ", ".join(f for f, on in routing_flags.items() if on)
        raise ConfigError(f"{given}: routing options need --routing METHOD (e.g. --routing deepseek_v3)")
    return moehal.MoEConfig(
        num_experts=args.experts,
        top_k=args.top_k,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        activation=args.activation,
        gated=not args.non_gated,
        has_w13_bias=args.bias or args.w13_bias,
        has_w2_bias=args.bias or args.w2_bias,
        routed_scaling_factor=args.routed_scaling_factor,
        apply_router_weight_on_input=args.router_weight_on_input,
        dtype=_DTYPES[args.dtype],
        ep_size=args.ep_size,
        ep_rank=args.ep_rank,
        routing=routing,
        max_tokens=args.max_tokens,
        topk_padding=args.topk_padding,
    )


_EXIT_CODES = """exit status:
  0  a pipeline accepts the configuration (the plan is shown)
  1  no pipeline accepts it (the decision table says why each candidate declined)
  2  the question cannot be answered: an invalid configuration or quant scheme, an unknown
     backend, a device this machine lacks, a plugin whose check raised (a plugin bug), or a
     usage error (a flag argparse refuses); the message is on stderr
with --json, every outcome is one JSON object on stdout; errors are {"error": ..., "type": ...}
(a usage error's type is "UsageError")"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="show why each candidate was accepted or declined for a configuration",
        epilog=_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p)
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default=None, help="restrict experts/fused forwards to this backend")
    p.add_argument("--layout", default=None, help="restrict to experts consuming this layout")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _error(args: argparse.Namespace, exc: MoEHalError, prefix: str = "") -> int:
    """Report `exc` (as a JSON object on stdout with --json, else on stderr) and return exit status 2."""
    if args.json:
        print_json({"error": str(exc), "type": type(exc).__name__})
    else:
        make_console(stderr=True).print(f"{prefix}{exc}", style="red", markup=False, highlight=False, soft_wrap=True)
    return 2


def _pipeline_dict(p: Pipeline, req: moehal.BuildRequest) -> dict[str, object]:
    """`p.as_dict()` with its execution mode, and graph capture as the text plan says it
    (`Plan.__str__`): an interpreted pipeline runs on the host, so it is not capturable."""
    mode = p.execution_mode(req)
    return {**p.as_dict(), "mode": mode, "graph_capturable": p.graph_capturable and mode != "interpreted"}


def run(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    try:
        cfg = config_from_args(args)
        quant = moehal.QuantScheme.parse(args.quant)
    except MoEHalError as exc:
        return _error(args, exc, "invalid configuration: ")
    try:
        return _explain(args, cfg, quant)
    except MoEHalError as exc:  # an unknown backend or device, a plugin whose check raised
        return _error(args, exc)


def _explain(args: argparse.Namespace, cfg: moehal.MoEConfig, quant: moehal.QuantScheme) -> int:
    reg = moehal.discover()
    req = moehal.BuildRequest(cfg, quant, moehal.detect(args.device), reg.settings)
    # `auto` (or no flag) defers to MOEHAL_BACKEND, as `MoELayer(backend="auto")` does
    backend = args.backend if args.backend not in (None, "auto") else reg.settings.backend
    if backend is not None:
        reg.check_backend(backend)
    pipelines, decisions = moehal.enumerate_pipelines(req, reg, backend, args.layout)
    if args.json:
        ranked = [_pipeline_dict(p, req) for p in pipelines]
        print_json(
            {
                "config": cfg.describe(),
                "quant": quant.name,
                "hardware": req.hardware.describe(),
                "chosen": ranked[0] if ranked else None,
                "pipelines": ranked,
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
