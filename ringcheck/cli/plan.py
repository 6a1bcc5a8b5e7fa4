"""`ringcheck plan`: its flags, the settings, the document, the exit code (0 it fits, 1 it does
not, 2 bad input)."""

from __future__ import annotations

import argparse
import time

from ..documents import PLAN_SCHEMA, header, save
from ..plan import DEVICES, EXIT_OF, KERNELS, LINKS, ModelShape, Settings, default_ffn, plan_document
from ..plan.hardware import DEFAULT_RESERVE_GIB
from ..plan.settings import DTYPE_BYTES, LAYOUTS
from ..render.plan_report import print_plan, write_plan_reports
from ..render.terminal import make_console
from .common import UsageError, command_meta, present

DEFAULT_VOCAB = 32000  # Llama 2's; Llama 3's is 128256


# flag -> (kind, default, what it is); every value is read here so that a bad one is one line (exit 2)
_VALUES = {
    "layers": (int, None, "transformer layers"), "hidden": (int, None, "hidden size"),
    "heads": (int, None, "query heads"), "kv_heads": (int, None, "key/value heads"),
    "head_dim": (int, None, "head dim"), "vocab": (int, DEFAULT_VOCAB, "vocabulary"),
    "ffn_hidden": (int, None, "feed-forward size"), "seq_len": (int, None, "tokens of one sequence"),
    "cp": (int, None, "GPUs in the ring"), "dp": (int, 1, "data-parallel replicas"), "batch": (int, 1, "sequences"),
    "micro_batches": (int, 1, "micro-batches"), "zero": (int, 0, "ZeRO stage"), "loss_chunk": (int, None, "tokens"),
    "memory_gib": (float, None, "GiB"), "tflops": (float, None, "TFLOPS"),
    "reserve_gib": (float, DEFAULT_RESERVE_GIB, "GiB"), "compute_efficiency": (float, 1.0, "share"),
    "link_efficiency": (float, 1.0, "share"),
}
_REQUIRED = ("layers", "hidden", "heads", "kv_heads", "seq_len", "cp")


def _values(args: argparse.Namespace) -> dict:
    found = {}
    for name, (kind, default, what) in _VALUES.items():
        text, flag = getattr(args, name), "--" + name.replace("_", "-")
        if text is None:
            if name in _REQUIRED:
                raise UsageError(f"{flag} is required ({what}); the required flags: "
                                 + " ".join("--" + r.replace("_", "-") for r in _REQUIRED))
            found[name] = default
            continue
        try:
            found[name] = kind(text)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: expected {'a whole number' if kind is int else 'a number'} "
                             f"({what})") from None
    return found


def plan_settings(args: argparse.Namespace) -> Settings:
    """The settings of the flags; a bad or missing value is a UsageError naming the flag (exit 2)."""
    v = _values(args)
    try:
        head_dim = v["head_dim"]
        if head_dim is None and v["heads"] > 0:
            if v["hidden"] % v["heads"]:
                raise ValueError(f"--hidden {v['hidden']} is not a multiple of --heads {v['heads']}: pass --head-dim")
            head_dim = v["hidden"] // v["heads"]
        model = ModelShape(layers=v["layers"], hidden=v["hidden"], heads=v["heads"], kv_heads=v["kv_heads"],
                           head_dim=head_dim, ffn=v["ffn_hidden"] or default_ffn(max(v["hidden"], 1)),
                           vocab=v["vocab"], tied=args.tied_embeddings)
        return Settings(model=model, seq_len=v["seq_len"], cp=v["cp"], dp=v["dp"], batch=v["batch"],
                        micro_batches=v["micro_batches"], dtype=args.dtype, checkpointing=args.checkpointing,
                        optimizer=args.optimizer, zero=v["zero"], device=args.device, link=args.link,
                        memory_gib=v["memory_gib"], tflops=v["tflops"], reserve_gib=v["reserve_gib"],
                        layout=args.layout, causal=args.causal, kernel=args.kernel, loss_chunk=v["loss_chunk"],
                        compute_efficiency=v["compute_efficiency"], link_efficiency=v["link_efficiency"])
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def _cmd_plan(args: argparse.Namespace) -> int:
    settings = plan_settings(args)
    start = time.perf_counter()
    doc = {**header(PLAN_SCHEMA), **plan_document(settings)}
    doc["meta"] = command_meta(args, start)
    console = make_console()
    present(doc, console, args.report, print_plan, write_plan_reports)
    if args.json:
        console.print(f"wrote {save(doc, args.json)}", highlight=False, markup=False)
    return EXIT_OF[doc["verdict"]]


def add_plan_command(sub) -> None:
    p = sub.add_parser(
        "plan", help="per-GPU memory and ring-step timing of a ring-attention training run: does it fit?",
        description="The arithmetic of a ring-attention training run, per GPU: weights, gradients, optimizer state, "
                    "activations per layer (the ring's attention and the rest, under the checkpointing policy), the "
                    "ring's buffers; whether it fits the device, the smallest ring that fits, and each ring step's "
                    "transfer against its compute. Exit 0 if it fits, 1 if it does not, 2 on bad input.")
    m = p.add_argument_group("the model (Llama-style)")
    m.add_argument("--layers", metavar="L", help="transformer layers (required)")
    m.add_argument("--hidden", metavar="H", help="hidden size (required)")
    m.add_argument("--heads", metavar="A", help="query heads (required)")
    m.add_argument("--kv-heads", dest="kv_heads", metavar="K", help="key/value heads, the GQA groups (required)")
    m.add_argument("--head-dim", dest="head_dim", metavar="D", help="head dim (default hidden / heads)")
    m.add_argument("--vocab", metavar="V", help=f"vocabulary (default {DEFAULT_VOCAB})")
    m.add_argument("--ffn-hidden", dest="ffn_hidden", metavar="F",
                   help="feed-forward inner size (default Llama's: 8/3 hidden rounded up to a multiple of 256)")
    m.add_argument("--tied-embeddings", dest="tied_embeddings", action="store_true",
                   help="one matrix for the input embedding and the output head")
    r = p.add_argument_group("the run")
    r.add_argument("--seq-len", dest="seq_len", metavar="N", help="tokens of one sequence (required)")
    r.add_argument("--cp", metavar="P", help="GPUs in the ring, the context-parallel size (required)")
    r.add_argument("--dp", metavar="D", help="data-parallel replicas of the ring (default 1)")
    r.add_argument("--batch", metavar="B", help="sequences per micro-batch (default 1)")
    r.add_argument("--micro-batches", dest="micro_batches", metavar="M",
                   help="micro-batches per optimizer step, run one after another (default 1): the step's time, "
                        "not the peak")
    r.add_argument("--dtype", default="bf16", metavar="bf16|fp16|fp32",
                   help=f"the model's dtype: {', '.join(DTYPE_BYTES)} (default bf16)")
    r.add_argument("--checkpointing", default="none", metavar="none|full|every-K",
                   help="activation checkpointing: none (default), full (every layer), every-K (segments of K layers)")
    r.add_argument("--optimizer", default="adam-mixed", metavar="adam-mixed|adam|sgd",
                   help="adam-mixed (default: weights and gradients in the model dtype, float32 master and two "
                        "float32 moments, 16 bytes per parameter in bf16), adam (moments in the model dtype), "
                        "sgd (no state)")
    r.add_argument("--zero", metavar="0|1|2|3",
                   help="shard over the dp x cp GPUs: 0 nothing (default), 1 optimizer state, 2 and gradients, "
                        "3 and weights (FSDP)")
    r.add_argument("--layout", default="zigzag", metavar="zigzag|contiguous|striped",
                   help=f"the ring's sequence layout: {', '.join(LAYOUTS)} (default zigzag)")
    r.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal attention (default) or bidirectional (--no-causal)")
    r.add_argument("--kernel", default="flash-attn2", metavar="flash-attn2|torch-cpu|torch-cuda",
                   help=f"the block kernel whose tensors count: {', '.join(KERNELS)} (default flash-attn2; torch-cpu: "
                        "ringcheck's CPU backend; torch-cuda: ringcheck's torch backend on CUDA, its scores by tiles "
                        "of query rows)")
    r.add_argument("--loss-chunk", dest="loss_chunk", metavar="TOKENS",
                   help="the loss's logits exist for this many tokens at a time (a chunked or fused cross-entropy; "
                        "default: every token of the micro-batch at once)")
    h = p.add_argument_group("the hardware")
    h.add_argument("--device", default="h100", metavar="NAME", help=f"one of {', '.join(DEVICES)} (default h100)")
    h.add_argument("--link", metavar="NAME|GB/s",
                   help=f"the link between ring neighbours: nvlink (the device's), {', '.join(LINKS)}, or GB/s per "
                        f"direction (default: the device's usual one)")
    h.add_argument("--memory-gib", dest="memory_gib", metavar="GIB", help="override the device's memory (GiB)")
    h.add_argument("--tflops", metavar="TFLOPS", help="override the device's dense rate for the dtype (TFLOPS)")
    h.add_argument("--reserve-gib", dest="reserve_gib", metavar="GIB",
                   help=f"memory no tensor gets: CUDA context, NCCL, fragmentation (default {DEFAULT_RESERVE_GIB:g})")
    h.add_argument("--compute-efficiency", dest="compute_efficiency", metavar="SHARE",
                   help="share of the datasheet rate the kernels reach (default 1)")
    h.add_argument("--link-efficiency", dest="link_efficiency", metavar="SHARE",
                   help="share of the datasheet bandwidth the transfers reach (default 1)")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON (schema ringcheck.plan) to FILE")
    p.add_argument("--report", metavar="DIR", help="write plan.json and plan.md to DIR")
    p.set_defaults(func=_cmd_plan)
