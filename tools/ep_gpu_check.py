"""Expert parallelism on GPUs: the moehal EP suite over NCCL, one process per GPU.

    torchrun --nproc-per-node 2 tools/ep_gpu_check.py --out ep-gpu.md [--bench]

Every rank runs every case of `moehal.distributed_check.ep_cases` (the same cases CI runs
with gloo on the CPU) and compares its rows with the single-process reference layer; rank 0
prints a PASS/FAIL table and writes it as markdown to --out. `--bench` adds dispatch+combine
timings of the generic path at a DeepSeek-V3 shape (H=7168, top-8, 256 experts), bf16 and
fp8 with group-128 scales. Runs from a source tree: moehal need not be installed.
Exit status: 0 when every case passed on every rank, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import stat
import sys
import tempfile
import time
from pathlib import Path


def _use_source_tree() -> None:
    """Make `import moehal` resolve to this checkout (like tools/devpath.sh, without git)."""
    root = Path(__file__).resolve().parent.parent
    link_dir = Path(tempfile.gettempdir()) / f"moehal-devpath-{root.name}-{os.getuid()}"
    link_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = link_dir.lstat()  # a predictable name: another user may have made it first
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise SystemExit(f"{link_dir} is not a folder of yours (a link, or another user's): not put on sys.path")
    link_dir.chmod(0o700)
    mapping = {"moehal": "core", "moehal_cuda": "backends_cuda", "moehal_npu": "backends_npu"}
    mapping |= {"moehal_rocm": "backends_rocm", "moehal_conformance": "conformance"}
    for name, folder in mapping.items():
        link = link_dir / name
        try:
            if not link.is_symlink() or os.readlink(link) != str(root / folder):
                tmp = link_dir / f".{name}.{os.getpid()}"
                tmp.symlink_to(root / folder)
                tmp.replace(link)  # atomic: several ranks may do this at once
        except FileExistsError:
            pass
    sys.path.insert(0, str(link_dir))


def _bench(rank: int, world: int, device, group, iters: int, token_counts: list[int]) -> list[str]:  # noqa: ANN001
    """Dispatch + combine of the generic path alone (experts replaced by a zero output)."""
    import torch
    import torch.distributed as dist
    from moehal import MoEConfig
    from moehal.ep_dispatcher import TorchDistributedDispatcher
    from moehal.formats import ActivationFormat, ContiguousOutput, Layout, ScaleKind
    from moehal.hardware import detect
    from moehal.interfaces import BuildRequest
    from moehal.quant import BF16
    from moehal.routing import TopK

    lines = []
    h, k, e = 7168, 8, 256
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)
    for tokens in token_counts:
        for label, fmt in (
            ("bf16", ActivationFormat(Layout.CONTIGUOUS, torch.bfloat16)),
            ("fp8+scales", ActivationFormat(Layout.CONTIGUOUS, torch.float8_e4m3fn, ScaleKind.GROUP_128)),
        ):
            cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=2048, ep_rank=rank, ep_size=world)
            req = BuildRequest(cfg, BF16, detect(device), process_group=group)
            runner = TorchDistributedDispatcher().build(req, fmt)
            g = torch.Generator(device="cpu").manual_seed(rank)
            x = torch.randn(tokens, h, generator=g).to(device, torch.bfloat16)
            ids = torch.rand(tokens, e, generator=g).topk(k, dim=1).indices.to(device)
            w = torch.rand(tokens, k, generator=g).to(device)
            topk = TopK(ids, w)

            def step(runner=runner, x=x, topk=topk) -> tuple:  # noqa: ANN001
                inp, handle = runner.dispatch(x, topk)
                out = runner.combine(ContiguousOutput(torch.zeros_like(inp.hidden, dtype=torch.bfloat16)), handle)
                return out, handle

            for _ in range(3):
                step()
            sync(device)
            dist.barrier(group)
            t0 = time.perf_counter()
            for _ in range(iters):
                _, handle = step()
            sync(device)
            ms = (time.perf_counter() - t0) / iters * 1e3
            sent = sum(n for r, n in enumerate(handle.send_splits) if r != rank)
            row = runner.wire.row
            mb = (sent * row + sent * h * 2) / 1e6  # dispatch rows out + combine rows back, off-rank
            t = torch.tensor([ms], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            lines.append(
                f"| {tokens} | {label} | {row} | {h * 2} | {sent} | {mb:.1f} | {float(t):.3f} | "
                f"{mb / 1e3 / (float(t) / 1e3):.3g} |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ep-gpu-check.md", help="markdown result path (written by rank 0)")
    parser.add_argument("--backend", default="reference", help="experts backend of the EP layer")
    parser.add_argument("--dispatcher", default="reference.torch_distributed", help="dispatcher qualname to force")
    parser.add_argument("--pg-backend", default=None, help="process group backend (default: nccl with GPUs, else gloo)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    parser.add_argument("--bench", action="store_true", help="also time dispatch+combine at DeepSeek-V3 shape")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--bench-tokens", default="128,4096", help="tokens per rank to time, comma-separated")
    args = parser.parse_args()

    try:
        import moehal  # noqa: F401
    except ImportError:
        _use_source_tree()
    import torch
    import torch.distributed as dist
    from moehal import distributed_check as dc

    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # the oracle compares float32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    pg = args.pg_backend or ("nccl" if use_cuda else "gloo")
    init = {"device_id": device} if use_cuda else {}
    dist.init_process_group(pg, timeout=datetime.timedelta(seconds=args.timeout), **init)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    reg = dc.default_registry()
    results = []
    for case in dc.ep_cases(world):
        try:
            results.append(
                dc.run_ep_case(
                    case, group, device=device, backend=args.backend, dispatcher=args.dispatcher, registry=reg
                )
            )
        except dc.NoBackendError as exc:  # the backend declines this case on every rank: record, go on
            results.append(dc.declined_result(case, rank, world, str(device), exc))
        except Exception as exc:  # a raise on one rank leaves peers in a collective: stop here
            print(f"[rank {rank}] case {case.name!r} raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            raise
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results, group=group)
    tokens = [int(t) for t in args.bench_tokens.split(",")]
    bench = _bench(rank, world, device, group, args.iters, tokens) if args.bench else []

    ok = True
    if rank == 0:
        rows = dc.summarize(gathered)
        ok = all(r.verdict != "FAIL" for r in rows)
        hw = torch.cuda.get_device_name(device) if use_cuda else "cpu"
        header = (
            f"{world} ranks, process group `{pg}`, device {hw}, torch {torch.__version__}, "
            f"experts backend `{args.backend}`, dispatcher `{args.dispatcher}`. "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}."
        )
        md = dc.to_markdown(rows, "moehal expert parallelism check", header)
        if bench:
            md += (
                "\n## Generic dispatch + combine (experts skipped), DeepSeek-V3 shape, contiguous layout\n\n"
                "H=7168, top-8 of 256 experts (experts return bf16 zeros), uniform random routing; "
                "MB = rows leaving this rank in dispatch "
                "plus rows coming back in combine, off-rank only; ms = slowest rank, mean of "
                f"{args.iters} iterations.\n\n"
                "| tokens/rank | dispatch dtype | dispatch row bytes | combine row bytes | rows sent off-rank "
                "| MB moved | ms | GB/s |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(bench) + "\n"
            )
        width = max(len(r.case) for r in rows)
        print(f"\n{'case'.ljust(width)}  verdict  max abs err")
        for r in rows:
            print(f"{r.case.ljust(width)}  {r.verdict:7}  {r.max_abs_err:.3g}" + (f"  {r.detail}" if r.detail else ""))
        if bench:
            print("\n" + "\n".join(bench))
        print(f"\n{'PASS' if ok else 'FAIL'}: {sum(r.verdict == 'PASS' for r in rows)}/{len(rows)} cases")
        Path(args.out).write_text(md)
        print(f"wrote {args.out}")
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.broadcast(flag, 0, group=group)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
