"""Replay one property on one case against an implementation: the command a failure of the
in-package suite (`pytest --ring-impl`) prints.

    python -m ringcheck.testing.impl_check --impl MOD:FN [--forward-only] [--timeout S] \\
        [--flash-attn-stand-in] [--mesh DIM=N,...] [--sinks-grad partial|reduced] \\
        'check_budget(Case(spec=AttentionSpec(...), ring=RingSpec(...), ...))'
    torchrun --standalone --nproc-per-node=P -m ringcheck.testing.impl_check --impl MOD:FN '...'

The call names a property of `ringcheck.testing.properties` or `variant_properties` (the
implementation is supplied) with a case and its parameters, as printed. It runs on local
gloo rings (on the torchrun world under torchrun), prints the verdict, and exits 0 when the
property holds, 1 when it fails, 2 when the command is wrong.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import sys

from ..harness import Mesh
from ..judge.check import Case
from ..launch import open_ring
from ..spec import AttentionSpec, RingSpec, Variant
from . import embedded_properties, properties, variant_properties, wrapped_properties
from .impl_runner import Refused, RingImpl, ring_impl

# properties whose bit-exact comparisons assume our ring's block plan: for another ring they compare within budgets
_PLAN_AWARE = ("check_full_window_is_no_window", "check_padding_is_inert")


def checks(impl: RingImpl) -> dict:
    """Every property body by name, with `impl` supplied."""
    found = {}
    for module in (properties, variant_properties, embedded_properties, wrapped_properties):
        for name in dir(module):
            fn = getattr(module, name)
            if name.startswith("check_") and callable(fn) and "impl" in inspect.signature(fn).parameters:
                extra = {"our_plan": impl.is_ours} if name in _PLAN_AWARE else {}
                found[name] = functools.partial(fn, impl=impl, **extra)
    return found


def parse_call(text: str, known) -> tuple[str, tuple, dict]:
    """`check_x(Case(...), k=v)` -> (name, args, kwargs): a call of a known property whose
    arguments are literals and the spec constructors only (nothing else is evaluated)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not a call of a property: {text!r} ({exc.msg})") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.func.id not in known:
        raise ValueError(f"expected one of {sorted(known)}(Case(...), ...), got {text!r}")
    allowed = {"Case": Case, "AttentionSpec": AttentionSpec, "RingSpec": RingSpec, "Variant": Variant}
    foreign = [node.id if isinstance(node, ast.Name) else type(node).__name__ for node in ast.walk(call)
               if (isinstance(node, ast.Name) and node.id not in allowed and node is not call.func)
               or isinstance(node, (ast.Attribute, ast.Lambda, ast.Subscript, ast.NamedExpr))]
    if foreign:
        raise ValueError(f"{text!r} uses {foreign}; only literals and Case, AttentionSpec, RingSpec and Variant may "
                         f"appear in the arguments")
    namespace = {"__builtins__": {}, **allowed}
    args = tuple(eval(compile(ast.Expression(a), "<case>", "eval"), namespace) for a in call.args)
    kwargs = {k.arg: eval(compile(ast.Expression(k.value), "<case>", "eval"), namespace) for k in call.keywords}
    return call.func.id, args, kwargs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringcheck.testing.impl_check", description=__doc__.split("\n")[0])
    parser.add_argument("--impl", required=True, metavar="MOD:FN|ADAPTER", help="the implementation under test")
    parser.add_argument("--forward-only", action="store_true", help="run no backward")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on every ring wait (seconds)")
    parser.add_argument("--flash-attn-stand-in", action="store_true",
                        help="where flash-attn is not installed, `import flash_attn` gives ringcheck's CPU stand-in "
                             "(here and on every rank), as the suite's --ring-flash-attn-stand-in did")
    parser.add_argument("--mesh", default=None, metavar="DIM=N,...",
                        help="the mesh whose other dims replicate the case's ring, as the suite's --ring-mesh "
                             "(default: cp=P,tp=2 where it fits)")
    parser.add_argument("--sinks-grad", dest="sinks_grad", default="partial", choices=["partial", "reduced"],
                        help="what each rank's sinks.grad holds (default partial)")
    parser.add_argument("call", help="the property call a failure printed, e.g. 'check_budget(Case(...))'")
    args = parser.parse_args(argv)
    setup = None
    if args.flash_attn_stand_in:  # in this process (a torchrun rank), and in every local ring's workers
        # start-up time: the stand-in is imported only when asked for
        from ..adapters.flash import stand_in_task
        from ..flash_stand_in import install

        print(f"flash-attn stand-in: {install().describe()}", file=sys.stderr)
        setup = stand_in_task
    try:
        ring = open_ring(timeout=args.timeout, setup=setup)
    except (ValueError, RuntimeError) as exc:
        print(f"impl_check: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            impl = ring_impl(args.impl, ring, forward_only=args.forward_only, stand_in=args.flash_attn_stand_in,
                             sinks_grad=args.sinks_grad, mesh=None if args.mesh is None else Mesh.parse(args.mesh))
            name, call_args, call_kwargs = parse_call(args.call, checks(impl))
        except (ValueError, TypeError, RuntimeError) as exc:
            print(f"impl_check: error: {exc}", file=sys.stderr)
            return 2
        speaks = getattr(ring, "is_main", True)
        try:
            checks(impl)[name](*call_args, **call_kwargs)
        except Refused as exc:
            print(f"impl_check: error: {exc}", file=sys.stderr)
            return 2
        except AssertionError as exc:
            if speaks:  # the bodies' own reproduce line replays our simulated ring: left out
                said = "\n".join(line for line in str(exc).splitlines() if "reproduce:" not in line)
                print(f"FAILED {name} against --impl {args.impl}\n{said}")
            return 1
        if speaks:
            print(f"PASSED {name} for {call_args[0].describe() if call_args else ''}")
        return 0
    finally:
        ring.close()


if __name__ == "__main__":
    sys.exit(main())
