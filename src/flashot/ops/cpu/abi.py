"""The ctypes side of the kernels' C ABI (``abi.h``): argument structs, signatures and the load-time checks.

Each kernel entry point takes one pointer to an argument struct; the classes here mirror those structs
field by field (same names, same order, same C types).  When a library is loaded, :func:`check_layout`
compares the layout the library was compiled with (``flashot_abi_layout()``: each struct's size and its
fields' offsets, from ``sizeof`` / ``offsetof``) with these classes, and :func:`abi_version` (a hash of
``abi.h``'s bytes, passed to the compiler as ``-DFLASHOT_ABI_VERSION``) with the library's own, so a
library built from another ``abi.h`` is refused with a clear message instead of reading arguments from
the wrong offsets.  The version is derived, never bumped by hand: any edit of ``abi.h`` is a new ABI.
"""

from __future__ import annotations

import ctypes
import hashlib
from importlib import resources

__all__ = [
    "STRUCTS",
    "AbiError",
    "Blocks",
    "CachedArgs",
    "LseArgs",
    "LseBsArgs",
    "PairBsArgs",
    "PlanArgs",
    "PlanBsArgs",
    "PruneArgs",
    "RowColArgs",
    "Stream",
    "WeightsArgs",
    "abi_version",
    "bind",
    "call",
    "check_layout",
    "layout_text",
]

_P, _I, _L, _D = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_double


class AbiError(RuntimeError):
    """A compiled library does not match this package's ``abi.h`` (stale build: rebuild it)."""


class Stream(ctypes.Structure):
    """``flashot_stream``: the streamed point clouds (pointers are data addresses, or None)."""

    _fields_ = [
        ("x", _P),
        ("yT", _P),
        ("yy", _P),
        ("hs", _P),
        ("N", _L),
        ("Mp", _L),
        ("l2", _L),
        ("kcoef", _D),
        ("minsq", _D),
        ("B", _I),
        ("D", _I),
        ("kind", _I),
        ("cfg", _I),
        ("nth", _I),
        ("pad_", _I),
    ]


class LseArgs(ctypes.Structure):
    """``flashot_lse_args``: ``flashot_softmin``."""

    _fields_ = [("s", Stream), ("out", _P), ("oscale", _D)]


class RowColArgs(ctypes.Structure):
    """``flashot_rowcol_args``: ``flashot_pair`` (``sym``) and ``flashot_alt`` (``lam``)."""

    _fields_ = [("s", Stream), ("hx", _P), ("rows", _P), ("cols", _P), ("lam", _D), ("sym", _I), ("pad_", _I)]


class PlanArgs(ctypes.Structure):
    """``flashot_plan_args``: ``flashot_plan``."""

    _fields_ = [
        ("s", Stream),
        ("lse", _P),
        ("alpha", _P),
        ("V", _P),
        ("out", _P),
        ("mass", _P),
        ("wconst", _D),
        ("K", _I),
        ("single", _I),
        ("wk", _I),
        ("narrow", _I),
    ]


class CachedArgs(ctypes.Structure):
    """``flashot_cached_args``: ``flashot_rows_lse``, ``flashot_cols_lse``, ``flashot_cached_alt``."""

    _fields_ = [
        ("C", _P),
        ("h", _P),
        ("ha", _P),
        ("out", _P),
        ("cols", _P),
        ("N", _L),
        ("M", _L),
        ("k", _D),
        ("oscale", _D),
        ("lam", _D),
        ("B", _I),
        ("nth", _I),
    ]


class WeightsArgs(ctypes.Structure):
    """``flashot_weights_args``: ``flashot_cached_weights``."""

    _fields_ = [
        ("C", _P),
        ("rb", _P),
        ("cb", _P),
        ("P", _P),
        ("R", _L),
        ("M", _L),
        ("k", _D),
        ("wthr", _D),
        ("wk", _I),
        ("nth", _I),
    ]


class Blocks(ctypes.Structure):
    """``flashot_blocks``: a block pattern (tasks, CSR of kept column ranges, the clusters' offsets, whether its
    column ranges move right with the task)."""

    _fields_ = [("tasks", _P), ("cptr", _P), ("cr", _P), ("coff", _P), ("ntasks", _L), ("banded", _L)]


class LseBsArgs(ctypes.Structure):
    """``flashot_lse_bs_args``: ``flashot_softmin_bs``."""

    _fields_ = [("a", LseArgs), ("b", Blocks)]


class PairBsArgs(ctypes.Structure):
    """``flashot_pair_bs_args``: ``flashot_pair_bs``."""

    _fields_ = [
        ("a", RowColArgs),
        ("b", Blocks),
        ("rb", _P),
        ("fx", _P),
        ("gy", _P),
        ("fxo", _P),
        ("gyo", _P),
        ("evaluated", _P),
        ("thr", _D),
        ("cb", _I),
        ("pad_", _I),
    ]


class PlanBsArgs(ctypes.Structure):
    """``flashot_plan_bs_args``: ``flashot_plan_bs``."""

    _fields_ = [("a", PlanArgs), ("b", Blocks)]


class PruneArgs(ctypes.Structure):
    """``flashot_prune_args``: ``flashot_block_keep``."""

    _fields_ = [
        ("X", _P),
        ("Y", _P),
        ("cptr", _P),
        ("ccols", _P),
        ("px", _P),
        ("py", _P),
        ("keep", _P),
        ("Ky", _L),
        ("Kcx", _L),
        ("s", _D),
        ("minsq", _D),
        ("margin", _D),
        ("D", _I),
        ("kind", _I),
        ("linear", _I),
        ("nth", _I),
    ]


# C name -> mirror, in abi.h's FLASHOT_ABI_LAYOUT order
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "flashot_stream": Stream,
    "flashot_lse_args": LseArgs,
    "flashot_rowcol_args": RowColArgs,
    "flashot_plan_args": PlanArgs,
    "flashot_cached_args": CachedArgs,
    "flashot_weights_args": WeightsArgs,
    "flashot_blocks": Blocks,
    "flashot_lse_bs_args": LseBsArgs,
    "flashot_pair_bs_args": PairBsArgs,
    "flashot_plan_bs_args": PlanBsArgs,
    "flashot_prune_args": PruneArgs,
}

# entry point (without _f32 / _f64) -> its argument struct; block_keep has no dtype suffix
_KERNELS = {
    "core": {
        "flashot_softmin": LseArgs,
        "flashot_pair": RowColArgs,
        "flashot_alt": RowColArgs,
        "flashot_plan": PlanArgs,
        "flashot_rows_lse": CachedArgs,
        "flashot_cols_lse": CachedArgs,
        "flashot_cached_alt": CachedArgs,
        "flashot_cached_weights": WeightsArgs,
    },
    "blocksparse": {"flashot_softmin_bs": LseBsArgs, "flashot_pair_bs": PairBsArgs, "flashot_plan_bs": PlanBsArgs},
}
_PLAIN = {  # entry points with plain arguments: name -> argtypes (restype int)
    "core": {
        "flashot_abi_version": [],
        "flashot_fp_probe": [ctypes.c_int],
        "flashot_fp_probe_read": [_P, ctypes.c_int],
        "flashot_fp_bits": [],
        "flashot_fp_bits_workers": [_P, ctypes.c_int],
        "flashot_isa": [],
        "flashot_vector_bytes": [],
        "flashot_vexp_f32": [_P, _P, _L, ctypes.c_int],
        "flashot_vexp_f64": [_P, _P, _L, ctypes.c_int],
    },
    "blocksparse": {
        "flashot_bs_abi_version": [],
        "flashot_bs_vector_bytes": [],
        "flashot_block_keep": [ctypes.POINTER(PruneArgs)],
    },
}
_LAYOUT_FN = {"core": "flashot_abi_layout", "blocksparse": "flashot_bs_abi_layout"}
_VERSION_FN = {"core": "flashot_abi_version", "blocksparse": "flashot_bs_abi_version"}


def abi_version(text: bytes | None = None) -> int:
    """The ABI version of ``abi.h`` (``text``: its bytes; default the packaged file): the first 28 bits of its
    SHA-256, a positive C ``int``."""
    if text is None:
        text = resources.files(__package__).joinpath("abi.h").read_bytes()
    return int(hashlib.sha256(text).hexdigest()[:7], 16)


def layout_text(structs: dict[str, type[ctypes.Structure]] | None = None) -> str:
    """The mirrors' layout in the library's format: ``name size field@offset ...`` per struct, ``;``-separated."""
    parts = []
    for name, cls in (STRUCTS if structs is None else structs).items():
        fields = " ".join(f"{f[0]}@{getattr(cls, f[0]).offset}" for f in cls._fields_)
        parts.append(f"{name} {ctypes.sizeof(cls)} {fields}")
    return ";".join(parts)


def family(library: str) -> str:
    """The family of a library name: ``core`` for ``core_f32`` / ``core_f64`` / ``core``, ``blocksparse`` for
    the block-sparse ones."""
    return library.split("_", 1)[0]


def check_layout(
    lib: ctypes.CDLL, library: str, path: str = "", structs: dict[str, type[ctypes.Structure]] | None = None
) -> None:
    """Raise :class:`AbiError` unless ``lib``'s argument structs are laid out as the ctypes mirrors."""
    fn = getattr(lib, _LAYOUT_FN[family(library)])
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    theirs = fn().decode().split(";")
    ours = layout_text(structs).split(";")
    if theirs != ours:
        diff = next(
            ((t, o) for t, o in zip(theirs, ours) if t != o),
            (";".join(theirs[len(ours) :]) or "(none)", ";".join(ours[len(theirs) :]) or "(none)"),
        )
        raise AbiError(
            f"{path or library}: the compiled argument structs differ from flashot/ops/cpu/abi.py "
            f"(library: {diff[0]!r}; abi.py: {diff[1]!r}). The library was built from other sources: "
            f"rebuild it (delete it, or clear the cache directory: flashot.ops.cpu.build.cache_dir())"
        )


def check_version(lib: ctypes.CDLL, library: str, path: str = "") -> None:
    """Raise :class:`AbiError` unless ``lib`` was compiled from this package's ``abi.h``."""
    fn = getattr(lib, _VERSION_FN[family(library)])
    fn.argtypes, fn.restype = [], ctypes.c_int
    have, want = fn(), abi_version()
    if have != want:
        raise AbiError(
            f"{path or library}: ABI version {have}, this package's abi.h is {want}: the library was "
            f"built from other sources; rebuild it (delete it, or clear the cache directory: "
            f"flashot.ops.cpu.build.cache_dir())"
        )


def bind(lib: ctypes.CDLL, library: str = "core_f32") -> None:
    """Set the argument and result types of ``library``'s entry points (``core_f32``, ``core_f64``,
    ``blocksparse_f32``, ``blocksparse_f64``: its family's kernels of its dtype, and the dtype-free ones)."""
    fam, dt = family(library), library.rsplit("_", 1)[-1]
    for name, cls in _KERNELS[fam].items():
        f = getattr(lib, f"{name}_{dt}")
        f.argtypes, f.restype = [ctypes.POINTER(cls)], ctypes.c_int
    for name, args in _PLAIN[fam].items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, ctypes.c_int


def call(fn, args: ctypes.Structure) -> int:
    """``fn(&args)``: one kernel call with its argument struct."""
    return fn(ctypes.byref(args))
