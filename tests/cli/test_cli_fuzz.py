"""Property-based fuzzing (hypothesis) of the point-cloud readers behind ``flashot solve`` (flashot.io).

Files are written from random points, then damaged at random: truncated, garbage inserted, a span
deleted, a line duplicated, a header count or header byte changed, bytes appended.  The reader
must either return exactly what the damaged file says, or raise :class:`flashot.io.InputError`
with one line naming the file, and ``flashot solve`` must then exit with status 1 and that one
line on stderr: never a traceback, never a dropped or garbled row.

What "what the file says" means, per format:

* .csv / .txt: :func:`ref_text`, the documented format written out here independently (lines end
  with \\n, \\r\\n or \\r; ``#`` comments; comma or blank separated; a first row without any
  number is a header; every other field a decimal number, inf or nan; all rows equally long).
  Text has no row count, so a truncation at a line end or inside the last number reads as a
  shorter, valid file: the reference says so too.
* .npy: numpy's own reading (``np.load``) of a file whose length is exactly what its header
  announces; a truncated file or one with bytes appended is an error.
* .ply: the points written, or an error.  A cut inside the last line of an ASCII body whose last
  element is the vertex element is the one undetectable damage (the last row reads as the cut
  line says).  Damage that makes a different valid file (changed data bytes; a larger vertex
  count over a binary list element, whose records are not walked) is not generated.

Profiles as in tests/fuzzing.py (:func:`fuzz_settings`: few derandomized examples in CI,
``FLASHOT_FUZZ=long`` for many fresh ones).
"""

from __future__ import annotations

import io
import math
import os
import re
import tempfile

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given, note
from hypothesis import strategies as st

import flashot.cli
from flashot import io as fio
from fuzzing import fuzz_settings

# ---------------------------------------------------------------------------------------------
# shared


def points(max_n: int = 6, dims=(1, 2, 3, 4), lim: float = 1e300):
    return (
        st.tuples(st.integers(1, max_n), st.sampled_from(dims))
        .flatmap(
            lambda nd: st.lists(
                st.lists(st.floats(-lim, lim, allow_nan=False), min_size=nd[1], max_size=nd[1]),
                min_size=nd[0],
                max_size=nd[0],
            )
        )
        .map(lambda r: np.array(r, dtype=np.float64))
    )


GARBAGE = st.one_of(
    st.text(alphabet="0123456789.,-+eE \t\n\r#xo_", max_size=6).map(str.encode),
    st.sampled_from([b"\x00", b"\xff\xfe", "\u00e9".encode(), "\uff13".encode(), b"\xef\xbb\xbf", b"\x0c"]),
)


@st.composite
def damage(draw, data: bytes, kinds=("none", "truncate", "insert", "delete", "duplicate", "field")):
    """(kind, damaged bytes); "field" replaces one field (a run of bytes without separators) by an
    empty or garbled one, as in ``1,,3`` or ``1,2,3o``."""
    kind = draw(st.sampled_from(kinds))
    k = draw(st.integers(0, max(len(data) - 1, 0)))
    if kind == "field":
        spans = [m.span() for m in re.finditer(rb"[^,\s]+", data)]
        a, b = spans[draw(st.integers(0, len(spans) - 1))]
        bad = draw(st.sampled_from([b"", b"3o", b"1_0", b"x", b"--1", "\uff13".encode(), data[a:b] + b"o"]))
        return kind, data[:a] + bad + data[b:]
    if kind == "truncate":
        return kind, data[:k]
    if kind == "insert":
        return kind, data[:k] + draw(GARBAGE) + data[k:]
    if kind == "delete":
        return kind, data[:k] + data[k + draw(st.integers(1, 8)) :]
    if kind == "duplicate":
        lines = data.split(b"\n")
        i = draw(st.integers(0, len(lines) - 1))
        return kind, b"\n".join(lines[: i + 1] + lines[i:])
    return kind, data


def read_or_error(path: str, data: bytes):
    """The points read from ``data`` written at ``path``, or None after checking the error: one
    line naming the file, and exit status 1 with that one line through ``flashot solve``."""
    with open(path, "wb") as f:
        f.write(data)
    try:
        return fio.read_points(path).points
    except fio.InputError as e:
        msg = str(e)
        note(f"error: {msg}")
        assert msg.startswith(f"{path}") and "\n" not in msg and len(msg) < 400, msg
        check_cli_error(path, msg)
        return None


def check_cli_error(path: str, msg: str) -> None:
    import contextlib

    ok = os.path.join(os.path.dirname(path), "ok.npy")
    np.save(ok, np.zeros((2, 1)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        rc = flashot.cli.main(["solve", path, ok, "--reg", "1"])
    assert rc == 1 and out.getvalue() == "", (rc, err.getvalue())
    assert err.getvalue() == f"flashot solve: error: {msg}\n", err.getvalue()


# ---------------------------------------------------------------------------------------------
# .csv / .txt


def is_number(t: str) -> bool:
    """The documented number syntax, stated differently from the reader's regular expression:
    float() of a string made of ASCII digits, '.', exponent and signs, or [+-]inf / infinity / nan."""
    core = t[1:] if t[:1] in ("+", "-") else t
    if core.lower() in ("inf", "infinity", "nan"):
        return True
    if not core or not set(core) <= set("0123456789.eE+-"):
        return False
    try:
        float(t)
    except ValueError:
        return False
    return True


def ref_text(data: bytes, ext: str) -> np.ndarray | None:
    """What a damaged text file says, or None where it must be an error."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.removeprefix("\ufeff")
    if "\x00" in text:
        return None
    rows = [r.split("#")[0].strip(" \t") for r in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    rows = [r for r in rows if r]
    if not rows:
        return None
    comma = ext == ".csv" or "," in rows[0]

    def fields(r: str) -> list[str]:
        return [t.strip(" \t") for t in r.split(",")] if comma else re.split("[ \t]+", r)

    if not any(is_number(t) for t in fields(rows[0])):  # a header
        ncol, rows = len(fields(rows[0])), rows[1:]
        if not rows:
            return None
    else:
        ncol = len(fields(rows[0]))
    table = [fields(r) for r in rows]
    if any(len(f) != ncol or not all(map(is_number, f)) for f in table):
        return None
    out = np.array([[float(t) for t in f] for f in table], dtype=np.float64)
    return out if np.isfinite(out).all() else None


@st.composite
def text_files(draw):
    x = draw(points())
    ext = draw(st.sampled_from([".csv", ".txt"]))
    sep = draw(st.sampled_from([",", ", ", " ,\t"] if ext == ".csv" else [" ", "\t", "  "]))
    eol = draw(st.sampled_from(["\n", "\r\n"]))
    lines = []
    if draw(st.booleans()):
        lines.append("# written by the fuzzer")
    if draw(st.booleans()):
        lines.append(sep.join(f"c{j}" for j in range(x.shape[1])))
    lines += [sep.join(repr(float(v)) for v in r) for r in x]
    return x, ext, (eol.join(lines) + (eol if draw(st.booleans()) else "")).encode()


@fuzz_settings(80, 3000)
@given(f=text_files(), data=st.data())
def test_text_reader(f, data):
    x, ext, blob = f
    kind, bad = data.draw(damage(blob))
    note(f"{kind}: {bad!r}")
    want = ref_text(bad, ext)
    if kind == "none":
        np.testing.assert_array_equal(want, x)  # the reference reads what was written
    with tempfile.TemporaryDirectory() as d:
        got = read_or_error(os.path.join(d, "p" + ext), bad)
    if want is None:
        assert got is None, got
    else:
        assert got is not None and got.shape == want.shape and np.array_equal(got, want), (got, want)


# ---------------------------------------------------------------------------------------------
# .npy


def ref_npy(data: bytes) -> np.ndarray | None:
    """numpy's reading of a .npy whose length is exactly what its header announces (and a dtype,
    shape and values the points allow), or None."""
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    except Exception:  # noqa: BLE001 - whatever numpy refuses
        return None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf" or len(shape) != 2:
        return None
    if len(data) - f.tell() != math.prod(shape) * dtype.itemsize or 0 in shape:
        return None
    out = np.load(io.BytesIO(data), allow_pickle=False).astype(np.float64)
    return out if np.isfinite(out).all() else None


@st.composite
def npy_files(draw):
    x = draw(points(lim=1e30))
    kind = draw(st.sampled_from(["<f8", ">f8", "<f4", "<i4", "|u1"]))
    arr = (
        x.astype(kind)
        if kind[1] == "f"
        else np.clip(np.round(x), 0 if kind == "|u1" else -1e9, 255 if kind == "|u1" else 1e9).astype(kind)
    )
    if draw(st.booleans()):
        arr = np.asfortranarray(arr)
    b = io.BytesIO()
    np.save(b, arr)
    return arr.astype(np.float64), b.getvalue()


@fuzz_settings(60, 3000)
@given(f=npy_files(), data=st.data())
def test_npy_reader(f, data):
    x, blob = f
    head = blob.index(b"\n") + 1  # the header ends with a newline, then the data
    kind = data.draw(st.sampled_from(["none", "truncate", "append", "header"]))
    if kind == "truncate":
        bad = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "append":
        bad = blob + data.draw(st.binary(min_size=1, max_size=9))
    elif kind == "header":
        k = data.draw(st.integers(0, head - 1))
        bad = blob[:k] + data.draw(st.binary(min_size=1, max_size=3)) + blob[k + data.draw(st.integers(1, 3)) :]
    else:
        bad = blob
    note(f"{kind}: {bad[: head + 8]!r}...")
    with tempfile.TemporaryDirectory() as d:
        got = read_or_error(os.path.join(d, "p.npy"), bad)
    if kind == "none":
        np.testing.assert_array_equal(got, x)
    elif kind in ("truncate", "append"):
        assert got is None
    else:
        want = ref_npy(bad)
        assert (got is None) == (want is None) and (got is None or np.array_equal(got, want)), (got, want)


# ---------------------------------------------------------------------------------------------
# .ply


@st.composite
def ply_files(draw):
    """(points expected, format, header text, body bytes, number of faces after the vertices)."""
    x = draw(points(dims=(3,), lim=1e30))
    fmt = draw(st.sampled_from(["ascii", "binary_little_endian"]))
    extra, before, faces = draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 3))
    if fmt == "ascii":
        props = (
            "property double x\nproperty double y\n" + ("property double w\n" if extra else "") + "property double z\n"
        )
        want = x
    else:
        props = "property float x\nproperty float y\n" + ("property uchar w\n" if extra else "") + "property float z\n"
        want = x.astype(np.float32).astype(np.float64)
    head = (
        f"ply\nformat {fmt} 1.0\ncomment fuzz\n"
        + ("element camera 1\nproperty double cx\nproperty short cy\n" if before else "")
        + f"element vertex {len(x)}\n"
        + props
        + (f"element face {faces}\nproperty list uchar int vertex_indices\n" if faces else "")
        + "end_header\n"
    )
    if fmt == "ascii":
        body = ("0.5 -2\n" if before else "") + "".join(
            f"{float(x[i, 0])!r} {float(x[i, 1])!r}" + (f" {float(i)!r}" if extra else "") + f" {float(x[i, 2])!r}\n"
            for i in range(len(x))
        )
        body = (body + "".join(f"3 {i} {i} {i}\n" for i in range(faces))).encode()
    else:
        dt = [("x", "<f4"), ("y", "<f4")] + ([("w", "u1")] if extra else []) + [("z", "<f4")]
        rec = np.zeros(len(x), dtype=dt)
        rec["x"], rec["y"], rec["z"] = x[:, 0], x[:, 1], x[:, 2]
        body = (
            (np.array([(0.5, -2)], dtype=[("cx", "<f8"), ("cy", "<i2")]).tobytes() if before else b"")
            + rec.tobytes()
            + b"".join(bytes([3]) + np.array([i] * 3, "<i4").tobytes() for i in range(faces))
        )
    return want, fmt, head, body, faces


def ply_truncation(x, fmt, blob: bytes, body: bytes, faces: int, k: int) -> list[np.ndarray]:
    """The results allowed (besides an error) for the .ply ``blob`` cut to ``k`` bytes: [] when it
    must be an error."""
    if fmt != "ascii":  # only the list records after the vertices are not checked (13 bytes a face)
        return [x] if faces and k >= len(blob) - 13 * faces else []
    if k == len(blob) - 1:  # only the final newline lost
        return [x]
    last = body.split(b"\n")[-2]  # the last line (the last vertex when no face follows)
    start = len(blob) - len(last) - 1
    tok = blob[start:k].decode().split()
    if faces or k <= start or len(tok) != len(last.split()) or not all(map(is_number, tok)):
        return []
    row = np.array([float(t) for t in tok])[[0, 1, -1]]  # x, y, (w,) z
    return [np.r_[x[:-1], row[None]]]


@fuzz_settings(80, 3000)
@given(f=ply_files(), data=st.data())
def test_ply_reader(f, data):
    x, fmt, head, body, faces = f
    kinds = ["none", "truncate", "append", "duplicate-element", "garbage-field"]
    if fmt == "ascii" or not faces:  # a binary list element after the vertices is not walked
        kinds.append("count")
    kind = data.draw(st.sampled_from(kinds if fmt == "ascii" else kinds[:4] + kinds[5:]))
    blob = head.encode() + body
    ok = [x]  # the results allowed besides an error; [] when it must be an error
    if kind == "truncate":
        k = data.draw(st.integers(0, len(blob) - 1))
        bad = blob[:k]
        ok = ply_truncation(x, fmt, blob, body, faces, k)
    elif kind == "append":
        tail = data.draw(st.binary(min_size=1, max_size=9))
        bad = blob + tail
        ok = [x] if (fmt == "ascii" and not tail.strip(b" \t\r\n")) or (fmt != "ascii" and faces) else []
    elif kind == "count":
        m = data.draw(st.integers(0, len(x) + 3).filter(lambda v: v != len(x)))
        bad = blob.replace(f"element vertex {len(x)}\n".encode(), f"element vertex {m}\n".encode(), 1)
        ok = []
    elif kind == "duplicate-element":
        bad = blob.replace(b"end_header\n", b"element vertex 1\nproperty double x\nend_header\n", 1)
        ok = []
    elif kind == "garbage-field":
        lines = blob.split(b"\n")
        i = data.draw(st.integers(0, len(x) - 1)) + head.count("\n") + ("element camera" in head)
        tok = lines[i].split(b" ")
        tok[data.draw(st.integers(0, len(tok) - 1))] = data.draw(
            st.sampled_from([b"", b"3o", b"x", b"1_0", b"1,5", b"--1", b"na"])
        )
        lines[i] = b" ".join(tok)
        bad, ok = b"\n".join(lines), []
    else:
        bad = blob
    note(f"{kind}: {bad!r}")
    with tempfile.TemporaryDirectory() as d:
        got = read_or_error(os.path.join(d, "p.ply"), bad)
    if kind == "none":
        np.testing.assert_array_equal(got, x)
    elif got is None:
        assert kind != "append" or not ok, "harmless bytes after the data were refused"
    else:
        assert ok, f"accepted a damaged file: {got}"
        assert any(got.shape == w.shape and np.array_equal(got, w) for w in ok), (got, ok)
