"""Readers for point-cloud files (``flashot solve``): .npy, .npz, .csv / .txt and .ply.

Files are untrusted input.  Every reader

* opens the path without following it into anything but a regular file (directories, FIFOs,
  sockets and devices such as ``/dev/zero`` are refused after ``open(O_NONBLOCK)`` + ``fstat``,
  so a FIFO cannot block and a path swapped after a check is still checked);
* checks sizes before reading the data: the ``.npy`` header (also inside a ``.npz``) and the
  ``.ply`` header are parsed first, and the number of points and the bytes the array would take
  are compared with caps (:class:`Limits`); text files are capped by their size on disk;
* never unpickles (``allow_pickle=False``; object and structured dtypes are refused);
* takes a file for exactly what it says or refuses it: a ``.npy`` must hold the bytes its header
  announces and no more, a ``.ply`` body the lines (or bytes) its elements announce, and a text
  field must look like a decimal number (a first row without any number is a header; a row
  mixing numbers and anything else is an error naming the line and the field), so that damage
  shows up as an error, not as a dropped or garbled row;
* raises :class:`InputError` with a one-line message that names the file.

Points come back as a float64 ``(n, d)`` array, weights (when the file carries them) as ``(n,)``.
"""

from __future__ import annotations

import math
import os
import re
import stat
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_POINTS",
    "SUFFIXES",
    "Cloud",
    "InputError",
    "Limits",
    "read_points",
    "read_weights",
]

DEFAULT_MAX_POINTS = 10_000_000
DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB per array (or per text file)
MAX_DIM = 65_536  # coordinates per point
_NPY_MAX_HEADER = 10_000  # numpy's own default for read_array_header
_NPZ_MAX_MEMBERS = 64
_PLY_MAX_HEADER = 64 << 10
SUFFIXES = (".npy", ".npz", ".csv", ".txt", ".ply")


class InputError(ValueError):
    """A file that cannot be used as input; the message is one line and names the file."""


@dataclass(frozen=True)
class Limits:
    max_points: int = DEFAULT_MAX_POINTS
    max_bytes: int = DEFAULT_MAX_BYTES

    def check(self, path: str, n: int, d: int, itemsize: int, what: str = "points") -> None:
        if n > self.max_points:
            raise InputError(f"{path}: {n:,} {what}, above the cap of {self.max_points:,} (raise it with --max-points)")
        if d > MAX_DIM:
            raise InputError(f"{path}: {d:,} coordinates per point, above {MAX_DIM:,}")
        nbytes = n * max(d, 1) * itemsize
        if nbytes > self.max_bytes:
            raise InputError(
                f"{path}: the array would take {nbytes:,} bytes, above the cap of "
                f"{self.max_bytes:,} (raise it with --max-bytes)"
            )


@dataclass
class Cloud:
    points: np.ndarray  # (n, d) float64
    weights: np.ndarray | None  # (n,) float64, or None
    source: str  # where the weights came from, for the report ("" when none)


# ---------------------------------------------------------------------------------------------
# opening


def _open_regular(path: str):
    """A binary file object for ``path``, which must be a regular file (refused otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a device"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket"
                if stat.S_ISSOCK(st.st_mode)
                else "not a regular file"
            )
            raise InputError(f"{path}: is {kind}, not a regular file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return f, st.st_size


def _suffix(path: str) -> str:
    """The file type from the suffix; the path is first checked to be a readable regular file (so
    that ``/dev/zero`` is named a device, not an unknown type)."""
    f, _ = _open_regular(path)
    f.close()
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUFFIXES:
        raise InputError(f"{path}: unknown file type {ext or '(no suffix)'!r}; expected one of {', '.join(SUFFIXES)}")
    return ext


# ---------------------------------------------------------------------------------------------
# .npy / .npz


def _npy_header(f, path: str):
    """Shape, Fortran order and dtype from a .npy header, without reading the data."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=_NPY_MAX_HEADER)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=_NPY_MAX_HEADER)
        else:  # pragma: no cover - read_magic accepts only these
            raise ValueError(f"unsupported .npy version {version}")
    except Exception as e:  # noqa: BLE001 - numpy's parser of the header (a Python literal) raises ValueError,
        # SyntaxError, tokenize.TokenError, ... on damaged bytes: all mean "not a valid .npy header"
        raise InputError(f"{path}: not a valid .npy file ({_first_line(e)})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf":
        raise InputError(f"{path}: unsupported array dtype {dtype} (expected integers or floats)")
    return shape, fortran, dtype


def _check_shape(path: str, shape: tuple, dtype, limits: Limits, what: str) -> None:
    if any(s < 0 for s in shape):  # pragma: no cover - numpy's header parser refuses these
        raise InputError(f"{path}: bad shape {shape}")
    if what == "points" and len(shape) != 2:
        raise InputError(f"{path}: expected a 2-D array of points (n, d), got shape {shape}")
    if what == "weights" and not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise InputError(f"{path}: expected a 1-D array of weights (n,), got shape {shape}")
    n = shape[0]
    d = shape[1] if len(shape) == 2 else 1
    limits.check(path, n, d, dtype.itemsize, what=what)


def _read_npy_stream(f, path: str, limits: Limits, what: str, total: int) -> np.ndarray:
    """The array of a .npy stream positioned at its start, ``total`` bytes long (header included)."""
    shape, fortran, dtype = _npy_header(f, path)
    _check_shape(path, shape, dtype, limits, what)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    left = total - f.tell()
    if left < nbytes:
        raise InputError(
            f"{path}: truncated: the header announces {nbytes:,} bytes of data, the file holds {max(left, 0):,}"
        )
    if left > nbytes:  # np.save writes nothing after the data: a longer file is not what the header says
        raise InputError(
            f"{path}: {left - nbytes:,} bytes after the array's data (the header announces "
            f"{nbytes:,} bytes; the file is damaged or not one .npy array)"
        )
    arr = np.frombuffer(_read_exact(f, nbytes, path), dtype=dtype, count=count)
    return arr.reshape(shape, order="F" if fortran else "C")


def _read_exact(f, nbytes: int, path: str) -> bytes:
    buf = bytearray()
    while len(buf) < nbytes:
        chunk = f.read(min(nbytes - len(buf), 1 << 24))
        if not chunk:
            raise InputError(f"{path}: truncated: expected {nbytes:,} bytes of data, found {len(buf):,}")
        buf += chunk
    return bytes(buf)


def _read_npy(path: str, limits: Limits, what: str) -> np.ndarray:
    f, size = _open_regular(path)
    with f:
        if f.read(6) != b"\x93NUMPY":
            raise InputError(f"{path}: not a .npy file (no NUMPY magic)")
        f.seek(0)
        return _read_npy_stream(f, path, limits, what, size)


def _read_npz(path: str, limits: Limits, what: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """The points array (named ``points`` or the only one) and a ``weights`` array if present."""
    f, _ = _open_regular(path)
    with f:
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise InputError(f"{path}: not a valid .npz (zip) file ({_first_line(e)})") from None
        with zf:
            infos = zf.infolist()
            if len(infos) > _NPZ_MAX_MEMBERS:
                raise InputError(f"{path}: {len(infos)} members, above {_NPZ_MAX_MEMBERS}")
            members = {i.filename[:-4]: i for i in infos if i.filename.endswith(".npy")}
            if not members:
                raise InputError(f"{path}: no arrays (.npy members) in this .npz")

            def load(key: str, kind: str) -> np.ndarray:
                info = members[key]
                where = f"{path}[{key!r}]"
                if info.file_size > limits.max_bytes + _NPY_MAX_HEADER + 16:
                    raise InputError(
                        f"{where}: {info.file_size:,} bytes uncompressed, above the cap of "
                        f"{limits.max_bytes:,} (raise it with --max-bytes)"
                    )
                try:
                    with zf.open(info) as m:
                        if m.read(6) != b"\x93NUMPY":
                            raise InputError(f"{where}: not a .npy array")
                    with zf.open(info) as m:
                        return _read_npy_stream(m, where, limits, kind, info.file_size)
                except (
                    zipfile.BadZipFile,
                    zipfile.LargeZipFile,
                    OSError,
                    EOFError,
                    RuntimeError,
                    NotImplementedError,
                    zlib.error,
                ) as e:
                    raise InputError(f"{where}: cannot read ({_first_line(e)})") from None

            if what == "weights":
                key = "weights" if "weights" in members else (next(iter(members)) if len(members) == 1 else None)
                if key is None:
                    raise InputError(f"{path}: several arrays ({', '.join(members)}) and none named 'weights'")
                return load(key, "weights"), None, ""
            if "points" in members:
                key = "points"
            elif len(members) == 1:
                key = next(iter(members))
            else:
                others = [k for k in members if k != "weights"]
                if len(others) != 1:
                    raise InputError(
                        f"{path}: several arrays ({', '.join(members)}): name the points "
                        f"'points' (and their weights 'weights')"
                    )
                key = others[0]
            pts = load(key, "points")
            if "weights" in members and key != "weights":
                return pts, load("weights", "weights"), f"{path}['weights']"
            return pts, None, ""


# ---------------------------------------------------------------------------------------------
# text


def _read_text(path: str, limits: Limits, what: str) -> tuple[np.ndarray, list[str] | None]:
    """A numeric table from .csv (comma) or .txt (spaces / tabs, or comma if the first row has one).

    Lines end with ``\\n``, ``\\r\\n`` or ``\\r``; ``#`` starts a comment.  A first row none of whose
    fields is a number is a header (column names); any other row must be all numbers
    (``_NUMBER``): a row mixing numbers and anything else is an error naming the line and the
    field, never a header that silently drops a data row."""
    f, size = _open_regular(path)
    with f:
        if size > limits.max_bytes:
            raise InputError(
                f"{path}: {size:,} bytes, above the cap of {limits.max_bytes:,} for text "
                f"files (raise it with --max-bytes)"
            )
        raw = f.read(limits.max_bytes + 1)
    if len(raw) > limits.max_bytes:  # the file grew after fstat
        raise InputError(f"{path}: above the cap of {limits.max_bytes:,} bytes (raise it with --max-bytes)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a UTF-8 text file (byte {e.start})") from None
    if "\x00" in text:
        raise InputError(f"{path}: not a text file (NUL bytes)")
    rows = []  # (line number, text)
    for no, line in enumerate(_LINES.split(text), 1):
        line = line.split("#", 1)[0].strip(" \t")
        if line:
            rows.append((no, line))
    if not rows:
        raise InputError(f"{path}: no data rows")
    ext = os.path.splitext(path)[1].lower()
    split = _CSV.split if ext == ".csv" or "," in rows[0][1] else _BLANKS.split
    names = None
    first = [t.strip(" \t") for t in split(rows[0][1])]
    if not any(_NUMBER.fullmatch(t) for t in first):
        names = first
        rows = rows[1:]
        if not rows:
            raise InputError(f"{path}: a header row and no data rows")
    if len(rows) > limits.max_points:
        raise InputError(
            f"{path}: {len(rows):,} rows, above the cap of {limits.max_points:,} (raise it with --max-points)"
        )
    ncol = len(split(rows[0][1])) if names is None else len(names)
    if ncol > MAX_DIM + 1:
        raise InputError(f"{path}: {ncol:,} columns, above {MAX_DIM + 1:,}")
    out = np.empty((len(rows), ncol), dtype=np.float64)
    for i, (no, line) in enumerate(rows):
        fields = split(line)
        if len(fields) != ncol:
            raise InputError(f"{path}: line {no} has {len(fields)} columns, expected {ncol}")
        out[i] = _numbers(path, no, fields)
    if what == "weights" and ncol != 1:
        raise InputError(f"{path}: expected one column of weights, got {ncol}")
    return out, names


# A number in a text file: decimal, with an optional exponent, or inf / infinity / nan (refused
# later as not finite).  Stricter than float(), which also takes "1_000", non-ASCII digits and
# surrounding whitespace: a field must look like a number to be read as one.
_NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)", re.ASCII | re.IGNORECASE)
_LINES = re.compile(r"\r\n|\r|\n")
_CSV = re.compile(r"[ \t]*,[ \t]*")
_BLANKS = re.compile(r"[ \t]+")


def _numbers(path: str, no: int, fields: list[str]) -> list[float]:
    """The fields of line ``no`` as floats; the first one that is not a number is an error."""
    for k, t in enumerate(fields, 1):
        if not _NUMBER.fullmatch(t):
            raise InputError(f"{path}: line {no}, field {k}: not a number: {t[:40]!r}")
    return [float(t) for t in fields]


# ---------------------------------------------------------------------------------------------
# .ply

_PLY_TYPES = {
    "char": "i1",
    "int8": "i1",
    "uchar": "u1",
    "uint8": "u1",
    "short": "i2",
    "int16": "i2",
    "ushort": "u2",
    "uint16": "u2",
    "int": "i4",
    "int32": "i4",
    "uint": "u4",
    "uint32": "u4",
    "float": "f4",
    "float32": "f4",
    "double": "f8",
    "float64": "f8",
}


_PLY_END = re.compile(rb"\nend_header[ \t\r]*\n")
_COUNT = re.compile(r"\d+", re.ASCII)


def _read_ply(path: str, limits: Limits) -> tuple[np.ndarray, list[str]]:
    """The vertex element of an ASCII or binary_little_endian .ply: (n, number of properties)
    float64 and the property names.  Elements before ``vertex`` must have scalar properties.

    Every count is checked against the body: an ASCII body must hold exactly the lines its
    elements announce (list lengths included) and nothing after them; a binary body exactly the
    bytes of its elements, except that the bytes after the vertex element are not checked when an
    element there has list properties (walking every face would cost more than reading the points)."""
    f, size = _open_regular(path)
    with f:
        fmt, elements, body_start, head_lines = _ply_header(f, path)
        vi = _ply_vertex(path, elements)
        _, n, props = elements[vi]
        limits.check(path, n, len(props), 8)
        pnames = [p[0] for p in props]
        if fmt == "binary_little_endian":
            return _ply_binary(f, path, size, body_start, elements, vi), pnames
        if size > limits.max_bytes:
            raise InputError(
                f"{path}: {size:,} bytes, above the cap of {limits.max_bytes:,} for text "
                f"files (raise it with --max-bytes)"
            )
        f.seek(body_start)
        body = f.read(limits.max_bytes + 1)
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        raise InputError(f"{path}: ASCII .ply body has non-ASCII bytes") from None
    return _ply_ascii(path, text, elements, vi, head_lines + 1), pnames


def _ply_header(f, path: str) -> tuple[str, list, int, int]:
    """Format, elements ``[name, count, [(property, numpy type or None for a list)]]``, the offset
    of the body and the number of header lines (``end_header`` included)."""
    header = f.read(_PLY_MAX_HEADER)
    if not header.startswith(b"ply") or header[3:4] not in (b"\n", b"\r"):
        raise InputError(f"{path}: not a .ply file (no 'ply' magic line)")
    m = _PLY_END.search(header)
    if m is None:
        if re.search(rb"\nend_header[ \t\r]*$", header):
            raise InputError(f"{path}: truncated after 'end_header'")
        raise InputError(f"{path}: no 'end_header' in the first {_PLY_MAX_HEADER:,} bytes")
    try:
        lines = _LINES.split(header[: m.start()].decode("ascii"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: the .ply header is not ASCII") from None
    fmt: str | None = None
    elements: list[list[Any]] = []  # [name, count, [(property, dtype or None for a list)]]
    for no, line in enumerate(lines[1:], 2):
        tok = line.split()
        if not tok or tok[0] in ("comment", "obj_info"):
            continue
        try:
            if tok[0] == "format" and len(tok) == 3 and fmt is None:
                fmt = tok[1]
                if fmt not in ("ascii", "binary_little_endian"):
                    raise InputError(
                        f"{path}: .ply format {fmt!r} is not supported (ascii and binary_little_endian are)"
                    )
            elif tok[0] == "element" and len(tok) == 3 and _COUNT.fullmatch(tok[2]):
                if any(e[0] == tok[1] for e in elements):
                    raise InputError(f"{path}: header line {no}: a second element named {tok[1]!r}")
                elements.append([tok[1], int(tok[2]), []])
            elif tok[0] == "property" and elements and (len(tok) == 3 or (len(tok) == 5 and tok[1] == "list")):
                if any(p[0] == tok[-1] for p in elements[-1][2]):
                    raise InputError(
                        f"{path}: header line {no}: a second property named {tok[-1]!r} in element {elements[-1][0]!r}"
                    )
                for t in tok[2:4] if len(tok) == 5 else tok[1:2]:
                    if t not in _PLY_TYPES:
                        raise KeyError(t)
                elements[-1][2].append((tok[-1], None if len(tok) == 5 else _PLY_TYPES[tok[1]]))
            else:
                raise ValueError
        except InputError:
            raise
        except KeyError as e:
            raise InputError(f"{path}: header line {no}: unknown property type {e.args[0]!r}") from None
        except ValueError:  # also int() of a count too long for Python
            raise InputError(f"{path}: header line {no}: cannot parse {line[:60]!r}") from None
    if fmt is None:
        raise InputError(f"{path}: the .ply header has no 'format' line")
    return fmt, elements, m.end(), header[: m.end()].count(b"\n")


def _ply_vertex(path: str, elements: list) -> int:
    """The index of the vertex element, after checking what the readers below rely on."""
    names = [e[0] for e in elements]
    if "vertex" not in names:
        raise InputError(f"{path}: no 'vertex' element")
    vi = names.index("vertex")
    props = elements[vi][2]
    if any(t is None for _, t in props):
        raise InputError(f"{path}: list properties in 'vertex' are not supported")
    missing = [c for c in "xyz" if c not in [p[0] for p in props]]
    if missing:
        raise InputError(
            f"{path}: the vertex element has no {', '.join(missing)} propert{'y' if len(missing) == 1 else 'ies'}"
        )
    for name, _, eprops in elements[:vi]:
        if any(t is None for _, t in eprops):
            raise InputError(f"{path}: element {name!r} before 'vertex' has list properties (not supported)")
    return vi


def _ply_binary(f, path: str, size: int, body_start: int, elements: list, vi: int) -> np.ndarray:
    def nbytes(e) -> int:
        return e[1] * sum(np.dtype(t).itemsize for _, t in e[2])

    _, n, props = elements[vi]
    need = body_start + sum(nbytes(e) for e in elements[: vi + 1])
    if size < need:
        raise InputError(f"{path}: truncated: {n:,} vertices need {need:,} bytes, the file has {size:,}")
    after = elements[vi + 1 :]
    if all(t is not None for e in after for _, t in e[2]):  # scalar elements only: the size is known
        end = need + sum(nbytes(e) for e in after)
        if size < end:
            raise InputError(
                f"{path}: truncated: the elements after 'vertex' need {end:,} bytes, the file has {size:,}"
            )
        if size > end:
            raise InputError(f"{path}: {size - end:,} bytes after the last element")
    dt = np.dtype([(f"p{i}", "<" + t) for i, (_, t) in enumerate(props)])
    f.seek(need - n * dt.itemsize)
    rec = np.frombuffer(_read_exact(f, n * dt.itemsize, path), dtype=dt, count=n)
    out = np.empty((n, len(props)), dtype=np.float64)
    for i in range(len(props)):
        out[:, i] = rec[f"p{i}"]
    return out


def _ply_ascii(path: str, text: str, elements: list, vi: int, first_no: int) -> np.ndarray:
    """The vertex rows of an ASCII body whose line ``i`` is line ``first_no + i`` of the file; every
    element's lines are checked (count of values, list lengths, numbers), and nothing may follow."""
    lines = _LINES.split(text)
    pos = 0
    out = np.empty((elements[vi][1], len(elements[vi][2])), dtype=np.float64)
    for ei, (name, count, props) in enumerate(elements):
        for r in range(count):
            if pos == len(lines) or (pos == len(lines) - 1 and not lines[pos].strip(" \t")):
                what = (
                    f"{count:,} vertices announced, {r:,} found"
                    if ei == vi
                    else f"element {name!r} announces {count:,} lines, {r:,} found"
                )
                raise InputError(f"{path}: truncated: {what}")
            no, line = first_no + pos, lines[pos].strip(" \t")
            pos += 1
            tok = _BLANKS.split(line) if line else []
            if ei == vi:
                if len(tok) != len(props):
                    raise InputError(f"{path}: line {no} (element 'vertex'): {len(tok)} values, expected {len(props)}")
                out[r] = _numbers(path, no, tok)
            else:
                _ply_check_line(path, no, name, props, tok)
    for k in range(pos, len(lines)):
        if lines[k].strip(" \t"):
            raise InputError(f"{path}: line {first_no + k}: data after the last element")
    return out


def _ply_check_line(path: str, no: int, name: str, props: list, tok: list[str]) -> None:
    """One ASCII line of a non-vertex element: scalars and lists (a length, then that many values)."""
    want = 0
    for _, t in props:
        if t is None:
            if want >= len(tok) or not _COUNT.fullmatch(tok[want]):
                got = repr(tok[want][:40]) if want < len(tok) else "nothing"
                raise InputError(
                    f"{path}: line {no} (element {name!r}), field {want + 1}: expected a list length, got {got}"
                )
            want += int(tok[want])
        want += 1
    if len(tok) != want:
        raise InputError(f"{path}: line {no} (element {name!r}): {len(tok)} values, expected {want}")
    _numbers(path, no, tok)


# ---------------------------------------------------------------------------------------------
# public


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message, without object addresses (``<ast.Compare object at
    0x7f...>`` from numpy's header parser): the same bad file gives the same message on every run."""
    s = str(e).strip().splitlines()
    return re.sub(r" at 0x[0-9a-fA-F]+", "", s[0])[:200] if s else type(e).__name__


def _column(path: str, spec: str, names: list[str] | None, ncol: int) -> int:
    """The index of the weights column ``spec``: an integer (negative counts from the end) or a name."""
    try:
        i = int(spec)
    except ValueError:
        if names is None or spec not in names:
            have = f"columns: {', '.join(names)}" if names else "the file has no column names"
            raise InputError(f"{path}: no column named {spec!r} for --weights-column ({have})") from None
        return names.index(spec)
    if not -ncol <= i < ncol:
        raise InputError(f"{path}: --weights-column {i} is out of range for {ncol} columns")
    return i % ncol


def read_points(path: str, limits: Limits = Limits(), weights_column: str | None = None) -> Cloud:
    """Points (and weights, from ``weights_column`` or a .npz ``weights`` array) of one file."""
    ext = _suffix(path)
    weights, wsrc = None, ""
    names: list[str] | None = None  # the columns' names (a header, or the .ply vertex properties)
    ply_names: list[str] = []
    if ext == ".npy":
        arr = _read_npy(path, limits, "points")
    elif ext == ".npz":
        arr, weights, wsrc = _read_npz(path, limits, "points")
    elif ext == ".ply":
        arr, ply_names = _read_ply(path, limits)
        names = ply_names
    else:
        arr, names = _read_text(path, limits, "points")
    arr = np.asarray(arr, dtype=np.float64)
    if weights_column is not None:
        if arr.shape[1] < 2:
            raise InputError(f"{path}: --weights-column needs at least two columns, the file has {arr.shape[1]}")
        j = _column(path, weights_column, names, arr.shape[1])
        weights, wsrc = arr[:, j].copy(), f"{path} column {names[j] if names else j}"
        if ext == ".ply" and ply_names[j] in ("x", "y", "z"):
            raise InputError(f"{path}: --weights-column {weights_column!r} is a coordinate")
        if ext != ".ply":
            arr = np.delete(arr, j, axis=1)
    if ext == ".ply":  # the coordinates are x, y, z; other vertex properties (colours, normals) are not
        arr = arr[:, [ply_names.index(c) for c in "xyz"]]
    if arr.shape[0] == 0:
        raise InputError(f"{path}: no points")
    if arr.shape[1] == 0:
        raise InputError(f"{path}: points with no coordinates")
    _check_finite(path, arr, "coordinate")
    if weights is not None:
        weights = _check_weights(wsrc or path, np.asarray(weights, dtype=np.float64).reshape(-1), arr.shape[0])
    return Cloud(np.ascontiguousarray(arr), weights, wsrc)


def read_weights(path: str, n: int, limits: Limits = Limits()) -> np.ndarray:
    """A weights file: one value per point (1-D .npy, .npz ``weights`` or only array, one text column)."""
    ext = _suffix(path)
    if ext == ".npy":
        w = _read_npy(path, limits, "weights")
    elif ext == ".npz":
        w = _read_npz(path, limits, "weights")[0]
    elif ext == ".ply":
        raise InputError(
            f"{path}: weights from a .ply file are not supported; use --weights-column "
            f"with the vertex property's name on the points file"
        )
    else:
        w = _read_text(path, limits, "weights")[0]
    return _check_weights(path, np.asarray(w, dtype=np.float64).reshape(-1), n)


def _check_finite(path: str, arr: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        kind = "NaN" if np.isnan(arr[bad]).any() else "Inf"
        raise InputError(
            f"{path}: {int(bad.sum()):,} {kind} value(s), first at row {i} (a {what} must be a finite number)"
        )


def _check_weights(path: str, w: np.ndarray, n: int) -> np.ndarray:
    if w.shape[0] != n:
        raise InputError(f"{path}: {w.shape[0]:,} weights for {n:,} points")
    _check_finite(path, w, "weight")
    if (w < 0).any():
        i = int(np.argmax(w < 0))
        raise InputError(f"{path}: negative weight {w[i]:g} at row {i}")
    with np.errstate(over="ignore"):  # an overflow is reported below, in one line
        total = w.sum()
    if not np.isfinite(total):
        raise InputError(
            f"{path}: the weights sum to more than the largest float64 "
            f"({np.finfo(np.float64).max:.3g}); divide them by a common factor"
        )
    if not total > 0:
        raise InputError(f"{path}: the weights sum to zero")
    return w
