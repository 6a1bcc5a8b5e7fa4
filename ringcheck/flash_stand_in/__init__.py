"""A CPU stand-in for flash-attn 2's Python API, so rings built on flash-attn run on a CPU runner.

ring-flash-attn, yunchang and most production rings call flash-attn's block kernels
(``flash_attn.flash_attn_interface._flash_attn_forward`` and friends), which exist only with
CUDA. `install()` makes ``import flash_attn`` resolve to this package's `interface` (flash-attn
2.7's signatures, float32 math rounded once to the input dtype, see `interface` and `kernel`)
when, and only when, the real flash-attn is not installed; it never shadows a real one.

The commands call it on every rank before they import the implementation
(``ringcheck validate|bench --flash-attn-stand-in``) and say in their report that it was used.
Other entry points (drift, the pytest plugin) call `install` the same way and report
`StandIn.describe()`::

    from ringcheck.flash_stand_in import install
    status = install()        # StandIn(installed=True, real_version=None, ...)
    print("flash-attn stand-in:", status.describe())  # "used: ..." or "not used: ..." for the report
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass

STAND_IN_VERSION = "2.7.4"   # the flash-attn version whose Python API the stand-in mimics
MARK = "__ringcheck_stand_in__"  # attribute set on the stand-in's `flash_attn` module


@dataclass(frozen=True)
class StandIn:
    """What `install` did: `installed` is True when ``import flash_attn`` now gives the stand-in
    (now or by an earlier call); `real_version` is the version of a real flash-attn found
    instead (then nothing was installed)."""

    installed: bool
    real_version: str | None = None
    api_version: str = STAND_IN_VERSION

    def describe(self) -> str:
        if self.installed:
            return (f"used: `import flash_attn` gives ringcheck's CPU stand-in for flash-attn {self.api_version}'s "
                    f"Python API (float32 math, one rounding to the input dtype), not flash-attn's CUDA kernels")
        return f"not used: the real flash-attn {self.real_version} is installed"


def active() -> bool:
    """Whether ``import flash_attn`` resolves to the stand-in in this process."""
    module = sys.modules.get("flash_attn")
    return module is not None and getattr(module, MARK, False)


def _real_flash_attn() -> str | None:
    """The version of an installed real flash-attn (without importing its CUDA extension where
    the metadata says it), or None."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return None if getattr(module, MARK, False) else str(getattr(module, "__version__", "unknown"))
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    try:
        from importlib.metadata import PackageNotFoundError, version  # only when a flash_attn is on the path
        return version("flash-attn")
    except PackageNotFoundError:
        return "unknown"


def install() -> StandIn:
    """Make ``import flash_attn`` and ``from flash_attn.flash_attn_interface import ...`` give the
    stand-in in this process, unless a real flash-attn is installed (then it is left alone).
    Idempotent; returns what it found or did. Call it before the ring library is imported."""
    real = _real_flash_attn()
    if real is not None:
        return StandIn(installed=False, real_version=real)
    if active():
        return StandIn(installed=True)
    from . import interface  # the API module itself: only loaded when it is installed

    package = types.ModuleType("flash_attn", "ringcheck's CPU stand-in for flash-attn (ringcheck.flash_stand_in)")
    package.__path__ = []  # a package, so `flash_attn.flash_attn_interface` imports from sys.modules
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)  # find_spec answers
    package.__version__ = STAND_IN_VERSION
    package.flash_attn_interface = interface
    package.flash_attn_func = interface.flash_attn_func
    package.flash_attn_varlen_func = interface.flash_attn_varlen_func
    setattr(package, MARK, True)
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface
    _install_padding(package)
    return StandIn(installed=True)


def _install_padding(package) -> None:
    """`flash_attn.bert_padding` and `flash_attn.utils.distributed` (`padding`), where transformers
    is installed (they are transformers' own unpad and pad); without it they are absent."""
    try:
        from .padding import modules  # only when the stand-in is installed (it imports einops)
        padding, distributed = modules()
    except ImportError:
        return
    utils = types.ModuleType("flash_attn.utils", "ringcheck's stand-in")
    utils.__path__ = []
    utils.distributed = distributed
    package.bert_padding, package.utils = padding, utils
    sys.modules.update({"flash_attn.bert_padding": padding, "flash_attn.utils": utils,
                        "flash_attn.utils.distributed": distributed})


def uninstall() -> None:
    """Remove the stand-in from ``sys.modules`` (tests); a real flash-attn is never touched."""
    if active():
        del sys.modules["flash_attn"]
        for name in ("flash_attn.flash_attn_interface", "flash_attn.bert_padding", "flash_attn.utils",
                     "flash_attn.utils.distributed"):
            sys.modules.pop(name, None)
