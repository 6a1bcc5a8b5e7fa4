"""The attention variants a command runs at, as its users spell them: one meaning for every
command (drift, the property suites, validate) and its flags.

    --documents LEN,LEN,...   explicit document lengths (with --pad they add up to seq_len)
    --documents random:K      K seeded random lengths that include the adversarial placements:
                              a boundary on a rank boundary and on a zig-zag chunk boundary, a
                              document of one token (where the layout allows it)
    --pad N                   N padding tokens at the tail
    --window LEFT,RIGHT       sliding window, -1 unbounded on that side
    --softcap X               logit softcap
    --sinks                   seeded per-head sink logits around ln(seq_len) (so they matter)
    --head-dim-v D            a value head dim other than the query/key one

`VariantOptions.resolve(seq_len, ring, seed)` turns them into the `Variant`, sink kind and
value head dim of one case; with ``random:K`` the documents depend on the seed and on the
ring (per-document zig-zag needs lengths in multiples of 2P).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import RingSpec, Variant, check_int, check_positive_int, check_softcap, check_window

__all__ = ["VariantOptions", "parse_documents", "parse_window"]


def parse_documents(text: str) -> str:
    """Check a --documents value ("LEN,LEN,..." or "random:K"); returns it unchanged."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--documents takes LEN,LEN,... or random:K, got {text!r}")
    if text.startswith("random:"):
        count = text.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--documents random:K needs a count K >= 1, got {text!r} (e.g. random:8)")
        return text
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--documents takes document lengths (ints >= 0) separated by commas, or random:K; "
                         f"got {text!r} (e.g. 1000,24,3072)")
    return text


def parse_window(text: str) -> tuple[int, int]:
    """A --window value "LEFT,RIGHT" as a pair (-1 unbounded)."""
    parts = text.split(",") if isinstance(text, str) else []
    try:
        window = tuple(int(p) for p in parts)
    except ValueError:
        window = ()
    if len(window) != 2:
        raise ValueError(f"--window takes LEFT,RIGHT (ints, -1 for unbounded), got {text!r} (e.g. 4096,0)")
    return check_window(window)


@dataclass(frozen=True)
class VariantOptions:
    """The variant flags of a command (None / False / 0: not used)."""

    documents: str | None = None
    pad: int = 0
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        if self.documents is not None:
            parse_documents(self.documents)
        check_int("pad", self.pad, low=0)
        if self.pad and self.documents is None:
            raise ValueError(f"--pad {self.pad} needs --documents: padding is what follows the last document "
                             f"(e.g. --documents random:4 --pad {self.pad})")
        if self.window is not None:
            object.__setattr__(self, "window", check_window(tuple(self.window)))
        check_softcap(self.softcap)
        if not isinstance(self.sinks, bool):
            raise TypeError(f"sinks must be True or False, got {self.sinks!r}")
        if self.head_dim_v is not None:
            check_positive_int("head_dim_v", self.head_dim_v)

    @property
    def used(self) -> bool:
        return (self.documents is not None or self.window not in (None, (-1, -1)) or self.softcap is not None
                or self.sinks or self.head_dim_v is not None)

    def describe(self) -> str:
        """The variants in words, for headers ('plain attention (no variants)' when none)."""
        words = []
        if self.documents is not None:
            words.append(f"documents {self.documents}" + (f" + {self.pad} padding" if self.pad else ""))
        if self.window not in (None, (-1, -1)):
            words.append(f"window {self.window[0]},{self.window[1]}")
        if self.softcap is not None:
            words.append(f"softcap {self.softcap:g}")
        if self.sinks:
            words.append("sinks")
        if self.head_dim_v is not None:
            words.append(f"head_dim_v {self.head_dim_v}")
        return ", ".join(words) if words else "plain attention (no variants)"

    def flags(self) -> list[str]:
        """The command-line flags that give these options (none for plain attention); values
        as `str` writes them, so a re-run gets the same numbers."""
        out: list[str] = []
        if self.documents is not None:
            out += ["--documents", self.documents] + (["--pad", str(self.pad)] if self.pad else [])
        if self.window is not None:
            out += ["--window", f"{self.window[0]},{self.window[1]}"]
        if self.softcap is not None:
            out += ["--softcap", str(self.softcap)]
        if self.sinks:
            out.append("--sinks")
        if self.head_dim_v is not None:
            out += ["--head-dim-v", str(self.head_dim_v)]
        return out

    def to_json(self) -> dict:
        """The options that are set (an empty dict for plain attention)."""
        doc: dict = {}
        if self.documents is not None:
            doc.update(documents=self.documents, pad=self.pad)
        if self.window not in (None, (-1, -1)):
            doc["window"] = list(self.window)
        if self.softcap is not None:
            doc["softcap"] = self.softcap
        if self.sinks:
            doc["sinks"] = True
        if self.head_dim_v is not None:
            doc["head_dim_v"] = self.head_dim_v
        return doc

    def scaled(self, seq_len: int, full_len: int, ring: RingSpec) -> VariantOptions:
        """The options at a scaled-down length of a `full_len` target (validate's small cases):
        documents become ``random:K`` (K as many as asked for, as many as fit), so every scale
        meets the placements ``random`` makes; --pad and the window's sides scale with the
        length (0 and -1 stay)."""
        if not self.used or seq_len == full_len:
            return self
        unit = 2 * ring.world_size if ring.layout == "zigzag_docs" else 1
        documents, pad = None, 0
        if self.documents is not None:
            asked = (int(self.documents.split(":")[1]) if self.documents.startswith("random:")
                     else len(self.documents.split(",")))
            pad = min(round(self.pad * seq_len / full_len / unit) * unit, seq_len - unit)
            documents = f"random:{max(1, min(asked, (seq_len - pad) // unit))}"
        window = None if self.window is None else tuple(
            side if side <= 0 else max(1, round(side * seq_len / full_len)) for side in self.window)
        return VariantOptions(documents=documents, pad=pad, window=window, softcap=self.softcap, sinks=self.sinks,
                              head_dim_v=self.head_dim_v)

    def resolve(self, seq_len: int, ring: RingSpec, seed: int = 0) -> tuple[Variant, str | None, int | None]:
        """(Variant, sink kind or None, value head dim or None) of one case."""
        cu = None if self.documents is None else tuple(self._boundaries(seq_len, ring, seed))
        if ring.layout == "zigzag_docs" and cu is None:
            raise ValueError("the zigzag_docs layout balances documents: give --documents (e.g. random:8)")
        variant = Variant(cu_seqlens=cu, window=self.window or (-1, -1), softcap=self.softcap)
        return variant, ("typical" if self.sinks else None), self.head_dim_v

    def _boundaries(self, seq_len: int, ring: RingSpec, seed: int) -> list[int]:
        total = seq_len - self.pad
        if total < 0:
            raise ValueError(f"--pad {self.pad} is longer than the sequence (seq_len={seq_len})")
        if self.documents.startswith("random:"):
            lengths = _random_lengths(int(self.documents.split(":")[1]), total, seq_len, ring, seed)
        else:
            lengths = [int(p) for p in self.documents.split(",")]
            if sum(lengths) != total:
                raise ValueError(f"--documents {self.documents} adds up to {sum(lengths)} tokens, but seq_len={seq_len} "
                                 f"minus --pad {self.pad} leaves {total}; make the lengths add up to {total}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cu


def _random_lengths(count: int, total: int, seq_len: int, ring: RingSpec, seed: int) -> list[int]:
    """`count` seeded document lengths adding up to `total`, with boundaries on a rank and on a
    zig-zag chunk boundary and a one-token document where the layout allows them."""
    unit = 2 * ring.world_size if ring.layout == "zigzag_docs" else 1
    if total % unit:
        raise ValueError(f"the documents hold {total} tokens, not a multiple of 2 x world_size={unit} as the "
                         f"zigzag_docs layout needs; change --seq-len or --pad")
    # the adversarial cuts, most telling first: a rank boundary, a one-token document (two cuts;
    # odd lengths are where per-document splitting drops tokens), a zig-zag chunk boundary
    wanted = [[seq_len // ring.world_size], [total // 2, total // 2 + 1] if unit == 1 else [],
              [seq_len // (2 * ring.world_size)]]
    cuts: set[int] = set()
    for group in wanted:
        fresh = [c for c in group if 0 < c < total and c % unit == 0 and c not in cuts]
        if group and len(fresh) == len(group) and len(cuts) + len(fresh) <= count - 1:
            cuts |= set(fresh)
    gen = torch.Generator().manual_seed(7919 * seed + count)
    free = [c for c in range(unit, total, unit) if c not in cuts]
    extra = max(count - 1 - len(cuts), 0)
    for i in torch.randperm(len(free), generator=gen)[:extra].tolist():
        cuts.add(free[i])
    edges = [0, *sorted(cuts)[:count - 1], total]
    edges += [total] * (count + 1 - len(edges))  # too short to cut: empty documents at the end
    return [b - a for a, b in zip(edges, edges[1:])]
