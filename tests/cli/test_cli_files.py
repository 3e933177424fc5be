"""``flashot solve``: the file readers (flashot.io) and the command, against direct solve_sample calls.

Files are untrusted input: every malformed, oversized or non-regular file gets a one-line error
and exit status 1, before any large allocation and without unpickling anything."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import flashot
import flashot.cli
from flashot import io as fio

RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 3))
Y = RNG.normal(size=(30, 3)) + np.array([1.0, 0.0, 0.5])
WX = RNG.uniform(0.5, 2.0, size=40)
WY = RNG.uniform(0.5, 2.0, size=30)


def run(*argv, capsys):
    rc = flashot.cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------
# writers for every format


def write_ply_ascii(path, pts, extra=None):
    props = "".join(f"property double {c}\n" for c in "xyz") + ("property float w\n" if extra is not None else "")
    with open(path, "w") as f:
        f.write(
            f"ply\nformat ascii 1.0\ncomment made by a test\nelement vertex {len(pts)}\n{props}"
            "element face 1\nproperty list uchar int vertex_indices\nend_header\n"
        )
        for i, r in enumerate(pts):
            f.write(" ".join(repr(float(v)) for v in r) + (f" {float(extra[i])!r}" if extra is not None else "") + "\n")
        f.write("3 0 1 2\n")


def write_ply_binary(path, pts, extra=None, before=0):
    """binary_little_endian, float32 coordinates, a uchar colour between them, an element of
    ``before`` scalar records before the vertices (skipped) and a face list after them."""
    fields = [("x", "<f4"), ("red", "u1"), ("y", "<f4"), ("z", "<f4")] + ([("w", "<f8")] if extra is not None else [])
    rec = np.zeros(len(pts), dtype=np.dtype(fields))
    rec["x"], rec["y"], rec["z"], rec["red"] = pts[:, 0], pts[:, 1], pts[:, 2], 200
    if extra is not None:
        rec["w"] = extra
    head = (
        "ply\nformat binary_little_endian 1.0\n"
        + (f"element camera {before}\nproperty double cx\nproperty short cy\n" if before else "")
        + f"element vertex {len(pts)}\nproperty float x\nproperty uchar red\nproperty float y\nproperty float z\n"
        + ("property double w\n" if extra is not None else "")
        + "element face 1\nproperty list uchar int vertex_indices\nend_header\n"
    )
    with open(path, "wb") as f:
        f.write(head.encode())
        f.write(b"\x00" * (10 * before))
        f.write(rec.tobytes())
        f.write(bytes([3]) + np.array([0, 1, 2], "<i4").tobytes())


def write(fmt, path, pts, w=None):
    """Write ``pts`` (and weights ``w``, as a column named w / array 'weights') in format ``fmt``."""
    if fmt == "npy":
        np.save(path, pts if w is None else np.c_[pts, w])
    elif fmt == "npy-fortran-f32":
        np.save(path, np.asfortranarray((pts if w is None else np.c_[pts, w]).astype(np.float32)))
    elif fmt == "npz":
        np.savez(path, points=pts, **({} if w is None else {"weights": w}))
    elif fmt == "npz-compressed-single":
        np.savez_compressed(path, pts if w is None else np.c_[pts, w])
    elif fmt == "csv":
        cols = pts if w is None else np.c_[pts, w]
        names = "x,y,z" + ("" if w is None else ",w")
        with open(path, "w") as f:
            f.write("# a comment line\n" + names + "\n")
            for r in cols:
                f.write(",".join(repr(float(v)) for v in r) + "\n")
    elif fmt == "txt":
        np.savetxt(path, pts if w is None else np.c_[pts, w], fmt="%.17g")
    elif fmt == "ply-ascii":
        write_ply_ascii(path, pts, w)
    elif fmt == "ply-binary":
        write_ply_binary(path, pts, w, before=2)
    else:  # pragma: no cover
        raise ValueError(fmt)


FORMATS = {
    "npy": ".npy",
    "npy-fortran-f32": ".npy",
    "npz": ".npz",
    "npz-compressed-single": ".npz",
    "csv": ".csv",
    "txt": ".txt",
    "ply-ascii": ".ply",
    "ply-binary": ".ply",
}
LOW = {"npy-fortran-f32", "ply-binary"}  # float32 on disk


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_reads_back_the_points_and_weights(tmp_path, fmt):
    p = str(tmp_path / ("pts" + FORMATS[fmt]))
    write(fmt, p, X, WX)
    col = None if fmt == "npz" else ("w" if fmt in ("csv", "ply-ascii", "ply-binary") else "-1")
    c = fio.read_points(p, weights_column=col)
    tol = 1e-6 if fmt in LOW else 0.0
    assert c.points.shape == X.shape and c.points.dtype == np.float64
    np.testing.assert_allclose(c.points, X, rtol=tol, atol=tol)
    np.testing.assert_allclose(c.weights, WX, rtol=tol)
    assert c.source  # says where the weights came from
    # without the weights
    write(fmt, p, X)
    c = fio.read_points(p)
    np.testing.assert_allclose(c.points, X, rtol=tol, atol=tol)
    assert c.weights is None


def test_weights_files(tmp_path):
    np.save(tmp_path / "w.npy", WX)
    np.savetxt(tmp_path / "w.txt", WX, fmt="%.17g")
    np.savez(tmp_path / "w.npz", weights=WX, other=np.zeros(2))
    for name in ("w.npy", "w.txt", "w.npz"):
        np.testing.assert_array_equal(fio.read_weights(str(tmp_path / name), 40), WX)
    with pytest.raises(fio.InputError, match="40 weights for 41 points"):
        fio.read_weights(str(tmp_path / "w.npy"), 41)


# ---------------------------------------------------------------------------------------------
# the command against solve_sample


def direct(x, y, a=None, b=None, **kw):
    kw = {"reg": 0.3, "backend": "dense", "tol": 1e-6, "max_iter": 1000, **kw}
    return flashot.solve_sample(x, y, a, b, **kw)


def test_solve_writes_what_solve_sample_returns(tmp_path, capsys):
    write("npy", tmp_path / "x.npy", X)
    write("csv", tmp_path / "y.csv", Y)
    out = tmp_path / "r.npz"
    rc, stdout, err = run(
        "solve",
        tmp_path / "x.npy",
        tmp_path / "y.csv",
        "--reg",
        "0.3",
        "--backend",
        "dense",
        "--out",
        out,
        "--map",
        "--topk",
        "4",
        capsys=capsys,
    )
    assert rc == 0, err
    ref = direct(X, Y)
    r = np.load(out, allow_pickle=False)
    assert float(r["value"]) == pytest.approx(float(ref.value), rel=1e-12)
    np.testing.assert_allclose(r["f"], ref.potentials[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r["g"], ref.potentials[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(r["barycentric_map"], ref.plan.barycentric_map(), rtol=1e-12, atol=1e-12)
    vals, idx = ref.plan.topk(4)
    np.testing.assert_allclose(r["topk_values"], vals, rtol=1e-12)
    np.testing.assert_array_equal(r["topk_indices"], idx)
    assert int(r["n_iter"]) == ref.n_iter and bool(r["converged"]) and str(r["cost"]) == "sqeuclidean"
    assert float(r["reg"]) == 0.3 and str(r["version"]) == flashot.__version__
    np.testing.assert_allclose(r["a"], np.full(40, 1 / 40))
    # the printed summary: value, iterations, convergence, time
    assert f"value = {float(ref.value):.10g}" in stdout
    assert f"iterations = {ref.n_iter}  converged = True" in stdout
    assert "time = " in stdout and f"wrote {out}" in stdout


def test_json_output(tmp_path, capsys):
    write("npz", tmp_path / "x.npz", X)
    write("ply-ascii", tmp_path / "y.ply", Y)
    rc, stdout, err = run(
        "solve", tmp_path / "x.npz", tmp_path / "y.ply", "--reg", "0.3", "--backend", "dense", "--json", capsys=capsys
    )
    assert rc == 0, err
    res = json.loads(stdout)
    ref = direct(X, Y)
    assert res["value"] == pytest.approx(float(ref.value), rel=1e-12)
    assert res["n_iter"] == ref.n_iter and res["converged"] is True and res["error"] == pytest.approx(ref.error)
    assert (res["n"], res["m"], res["d"], res["cost"], res["reg"]) == (40, 30, 3, "sqeuclidean", 0.3)
    assert res["time_s"] > 0 and res["out"] is None


def test_blur_means_geomloss_convention(tmp_path, capsys):
    """--blur B: cost |x-y|^2/2 and eps = B^2, as GeomLoss' SamplesLoss(p=2, blur=B) (debias=False
    gives OT_eps, the same value)."""
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", Y)
    rc, stdout, err = run(
        "solve", tmp_path / "x.npy", tmp_path / "y.npy", "--blur", "0.5", "--json", "--backend", "dense", capsys=capsys
    )
    assert rc == 0, err
    v = json.loads(stdout)["value"]
    ref = direct(X, Y, reg=0.25, cost="half_sqeuclidean")
    assert v == pytest.approx(float(ref.value), rel=1e-12)
    import torch

    gl = flashot.SamplesLoss("sinkhorn", p=2, blur=0.5, debias=False, scaling=0.99, backend="dense")(
        torch.from_numpy(X), torch.from_numpy(Y)
    )
    assert v == pytest.approx(float(gl), rel=2e-4)  # GeomLoss stops after its eps schedule (3.6e-5 here)
    # not the |x-y|^2 cost with eps = blur, nor eps = blur^2 with |x-y|^2
    assert abs(v - float(direct(X, Y, reg=0.25).value)) > 0.1 * abs(v)


@pytest.mark.parametrize("how", ["column-name", "column-index", "files", "npz"])
def test_weights_are_used_and_normalised(tmp_path, capsys, how):
    px, py = tmp_path / "x.csv", tmp_path / "y.csv"
    extra = []
    if how in ("column-name", "column-index"):
        write("csv", px, X, WX)
        write("csv", py, Y, WY)
        extra = ["--weights-column", "w" if how == "column-name" else "3"]
    elif how == "files":
        write("csv", px, X)
        write("txt", py := tmp_path / "y.txt", Y)
        np.save(tmp_path / "wx.npy", WX)
        np.savetxt(tmp_path / "wy.csv", WY, fmt="%.17g")
        extra = ["--source-weights", tmp_path / "wx.npy", "--target-weights", tmp_path / "wy.csv"]
    else:
        write("npz", px := tmp_path / "x.npz", X, WX)
        write("npz", py := tmp_path / "y.npz", Y, WY)
    out = tmp_path / "r.npz"
    rc, stdout, err = run("solve", px, py, "--reg", "0.3", "--backend", "dense", "--out", out, *extra, capsys=capsys)
    assert rc == 0, err
    a, b = WX / WX.sum(), WY / WY.sum()
    ref = direct(X, Y, a, b)
    r = np.load(out)
    assert float(r["value"]) == pytest.approx(float(ref.value), rel=1e-12)
    np.testing.assert_allclose(r["a"], a, rtol=1e-15)
    np.testing.assert_allclose(r["f"], ref.potentials[0], rtol=1e-10, atol=1e-12)
    assert abs(float(r["value"]) - float(direct(X, Y).value)) > 1e-3  # the weights changed the answer
    assert "weights from" in stdout


def test_unbalanced_and_float32(tmp_path, capsys):
    write("csv", tmp_path / "x.csv", X, WX)
    write("csv", tmp_path / "y.csv", Y, WY)
    rc, stdout, err = run(
        "solve",
        tmp_path / "x.csv",
        tmp_path / "y.csv",
        "--weights-column",
        "w",
        "--reg",
        "0.3",
        "--unbalanced",
        "2.0,inf",
        "--backend",
        "dense",
        "--json",
        capsys=capsys,
    )
    assert rc == 0, err
    ref = direct(X, Y, WX, WY, unbalanced=(2.0, None))  # weights kept as given: masses matter
    assert json.loads(stdout)["value"] == pytest.approx(float(ref.value), rel=1e-10)
    rc, stdout, err = run(
        "solve",
        tmp_path / "x.csv",
        tmp_path / "y.csv",
        "--weights-column",
        "w",
        "--reg",
        "0.3",
        "--float32",
        "--tol",
        "1e-4",
        "--max-iter",
        "300",
        "--backend",
        "dense",
        "--json",
        capsys=capsys,
    )
    assert rc == 0, err
    res = json.loads(stdout)
    ref = direct(
        X.astype(np.float32),
        Y.astype(np.float32),
        (WX / WX.sum()).astype(np.float32),
        (WY / WY.sum()).astype(np.float32),
        tol=1e-4,
        max_iter=300,
    )
    assert res["dtype"] == "float32" and res["value"] == pytest.approx(float(ref.value), rel=1e-6)


def test_not_converged_warns_in_one_line(tmp_path, capsys):
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", Y)
    rc, stdout, err = run(
        "solve", tmp_path / "x.npy", tmp_path / "y.npy", "--reg", "0.01", "--max-iter", "3", "--json", capsys=capsys
    )
    assert rc == 0 and json.loads(stdout)["converged"] is False
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashot solve: warning: ") and "tol" in lines[0]


def test_progress_bar_on_long_solves_and_quiet(tmp_path, capsys):
    big = RNG.normal(size=(1000, 2))
    np.save(tmp_path / "x.npy", big)
    np.save(tmp_path / "y.npy", big + 1.0)
    opts = ["--reg", "1", "--max-iter", "30", "--tol", "1e-3"]
    assert flashot.cli.main(["solve", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), *opts]) == 0
    assert "sinkhorn" in capsys.readouterr().err  # tqdm's bar, or the plain line printer without tqdm
    assert flashot.cli.main(["solve", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), *opts, "--quiet"]) == 0
    q = capsys.readouterr()
    assert q.err == "" and "value = " in q.out
    np.save(tmp_path / "s.npy", big[:100])  # small problems: no bar
    assert flashot.cli.main(["solve", str(tmp_path / "s.npy"), str(tmp_path / "s.npy"), *opts]) == 0
    assert "sinkhorn" not in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        flashot.cli.main(["solve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: flashot solve" in out
    # the blur convention is stated
    assert "cost C = |x - y|^2 / 2 and epsilon = B^2" in out
    for opt in (
        "--reg",
        "--blur",
        "--unbalanced",
        "--tol",
        "--max-iter",
        "--backend",
        "--json",
        "--quiet",
        "--out",
        "--map",
        "--topk",
        "--weights-column",
        "--source-weights",
        "--target-weights",
        "--max-points",
        "--max-bytes",
    ):
        assert opt in out, opt


@pytest.mark.parametrize(
    "argv, msg",
    [
        ([], "one of the arguments --reg --blur is required"),
        (["--reg", "0.1", "--blur", "0.1"], "not allowed with argument"),
        (["--reg", "0.1", "--map"], "need --out"),
        (["--blur", "0.1", "--cost", "euclidean"], "--cost: not with --blur"),
        (["--reg", "-1"], "--reg: expected a positive"),
        (["--reg", "1", "--unbalanced", "x"], "--unbalanced: invalid value"),
        (["--reg", "1", "--backend", "gpu"], "--backend: expected 'auto' or one of"),
        (["--reg", "1", "--weights-column", "w", "--source-weights", "w.npy"], "--weights-column: not with"),
    ],
)
def test_bad_options_exit_2(tmp_path, capsys, argv, msg):
    np.save(tmp_path / "x.npy", X)
    with pytest.raises(SystemExit) as e:
        flashot.cli.main(["solve", str(tmp_path / "x.npy"), str(tmp_path / "x.npy"), *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# untrusted files: one-line errors, exit status 1


class Boom:
    """Unpickling this would create a marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def bad_files(tmp):
    """name -> (source path, extra argv, expected message fragment)."""
    t = str(tmp)
    np.save(f"{t}/ok.npy", X)
    cases = {}

    def case(name, path, frag, *extra):
        cases[name] = (path, list(extra), frag)

    case("missing", f"{t}/nope.npy", "no such file")
    os.mkdir(f"{t}/dir.npy")
    case("directory", f"{t}/dir.npy", "is a directory")
    os.mkfifo(f"{t}/fifo.npy")
    case("fifo", f"{t}/fifo.npy", "is a FIFO, not a regular file")
    os.symlink("/dev/zero", f"{t}/zero.npy")
    case("device-symlink", f"{t}/zero.npy", "is a device, not a regular file")
    case("dev-null", "/dev/null", "is a device, not a regular file")
    with open(f"{t}/pts.xyz", "w") as f:
        f.write("1 2 3\n")
    case("unknown-suffix", f"{t}/pts.xyz", "unknown file type '.xyz'")
    with open(f"{t}/ok.npy", "rb") as f:
        blob = f.read()
    with open(f"{t}/trunc.npy", "wb") as f:
        f.write(blob[:200])
    case("truncated-npy", f"{t}/trunc.npy", "truncated")
    with open(f"{t}/garbage.npy", "wb") as f:
        f.write(b"hello world, not numpy at all")
    case("not-npy", f"{t}/garbage.npy", "not a .npy file")
    marker = f"{t}/PWNED"
    np.save(f"{t}/pickle.npy", np.array([Boom(marker)], dtype=object), allow_pickle=True)
    case("pickle-npy", f"{t}/pickle.npy", "unsupported array dtype object")
    with zipfile.ZipFile(f"{t}/pickle.npz", "w") as z:
        z.writestr("points.npy", pickle.dumps(Boom(marker)))
    case("pickle-npz", f"{t}/pickle.npz", "not a .npy array")
    # a header announcing 10^12 x 3 float64 (24 TB) in a tiny file: refused from the header
    hdr = np.lib.format.header_data_from_array_1_0(X)
    hdr["shape"] = (10**12, 3)
    with open(f"{t}/huge.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, hdr)
        f.write(b"\0" * 64)
    case("huge-header", f"{t}/huge.npy", "above the cap of 10,000,000")
    case(
        "huge-header-cap-raised", f"{t}/huge.npy", "truncated", "--max-points", str(10**13), "--max-bytes", str(10**14)
    )
    case(
        "max-points", f"{t}/ok.npy", "40 points, above the cap of 39 (raise it with --max-points)", "--max-points", "39"
    )
    case("max-bytes", f"{t}/ok.npy", "above the cap of 100 (raise it with --max-bytes)", "--max-bytes", "100")
    np.save(f"{t}/3d.npy", np.zeros((2, 3, 4)))
    case("ndim", f"{t}/3d.npy", "expected a 2-D array of points")
    np.save(f"{t}/empty.npy", np.zeros((0, 3)))
    case("empty", f"{t}/empty.npy", "no points")
    np.save(f"{t}/complex.npy", np.zeros((3, 3), complex))
    case("complex", f"{t}/complex.npy", "unsupported array dtype complex128")
    nan = X.copy()
    nan[7, 1] = np.nan
    np.save(f"{t}/nan.npy", nan)
    case("nan", f"{t}/nan.npy", "1 NaN value(s), first at row 7")
    inf = X.copy()
    inf[3, 0] = np.inf
    write("csv", f"{t}/inf.csv", inf)
    case("inf-csv", f"{t}/inf.csv", "1 Inf value(s), first at row 3")
    np.save(f"{t}/d2.npy", X[:, :2])
    case("dimension-mismatch", f"{t}/d2.npy", "dimensions differ: ")
    with open(f"{t}/ragged.csv", "w") as f:
        f.write("1,2,3\n4,5\n")
    case("ragged-csv", f"{t}/ragged.csv", "line 2 has 2 columns, expected 3")
    with open(f"{t}/word.txt", "w") as f:
        f.write("1 2 3\n4 five 6\n")
    case("not-a-number", f"{t}/word.txt", "line 2, field 2: not a number: 'five'")
    with open(f"{t}/bin.csv", "wb") as f:
        f.write(b"\xff\xfe\x00\x01" * 10)
    case("binary-csv", f"{t}/bin.csv", "not a UTF-8 text file")
    with open(f"{t}/big.txt", "w") as f:
        f.write("1 2 3\n" * 100)
    case("text-over-cap", f"{t}/big.txt", "600 bytes, above the cap of 500", "--max-bytes", "500")
    with open(f"{t}/be.ply", "w") as f:
        f.write("ply\nformat binary_big_endian 1.0\nelement vertex 1\nproperty float x\nend_header\n")
    case("ply-big-endian", f"{t}/be.ply", "format 'binary_big_endian' is not supported")
    with open(f"{t}/noz.ply", "w") as f:
        f.write("ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nproperty float y\nend_header\n1 2\n")
    case("ply-no-z", f"{t}/noz.ply", "the vertex element has no z property")
    with open(f"{t}/noend.ply", "w") as f:
        f.write("ply\nformat ascii 1.0\n" + "comment padding padding padding\n" * 3000)
    case("ply-header-unbounded", f"{t}/noend.ply", "no 'end_header' in the first 65,536 bytes")
    write_ply_binary(f"{t}/short.ply", X)
    with open(f"{t}/short.ply", "rb") as f:
        blob = f.read()
    with open(f"{t}/short.ply", "wb") as f:
        f.write(blob[: len(blob) // 2])
    case("ply-truncated", f"{t}/short.ply", "truncated: 40 vertices need")
    with open(f"{t}/many.ply", "w") as f:
        f.write(
            "ply\nformat binary_little_endian 1.0\nelement vertex 99999999999\nproperty float x\n"
            "property float y\nproperty float z\nend_header\n"
        )
    case("ply-huge-count", f"{t}/many.ply", "99,999,999,999 points, above the cap")
    with open(f"{t}/asciitrunc.ply", "w") as f:
        f.write(
            "ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\nproperty float z\n"
            "end_header\n1 2 3\n"
        )
    case("ply-ascii-truncated", f"{t}/asciitrunc.ply", "3 vertices announced, 1 found")
    return cases, marker


def _bad_case_ids():
    return [
        "missing",
        "directory",
        "fifo",
        "device-symlink",
        "dev-null",
        "unknown-suffix",
        "truncated-npy",
        "not-npy",
        "pickle-npy",
        "pickle-npz",
        "huge-header",
        "huge-header-cap-raised",
        "max-points",
        "max-bytes",
        "ndim",
        "empty",
        "complex",
        "nan",
        "inf-csv",
        "dimension-mismatch",
        "ragged-csv",
        "not-a-number",
        "binary-csv",
        "text-over-cap",
        "ply-big-endian",
        "ply-no-z",
        "ply-header-unbounded",
        "ply-truncated",
        "ply-huge-count",
        "ply-ascii-truncated",
    ]


@pytest.mark.parametrize("name", _bad_case_ids())
def test_bad_file_is_one_line_error(tmp_path, capsys, name):
    cases, marker = bad_files(tmp_path)
    assert set(cases) == set(_bad_case_ids())
    path, extra, frag = cases[name]
    rc, out, err = run("solve", path, tmp_path / "ok.npy", "--reg", "0.5", *extra, capsys=capsys)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("flashot solve: error: ") and frag in lines[0], lines[0]
    assert not os.path.exists(marker)  # nothing was unpickled


@pytest.mark.parametrize(
    "weights, frag",
    [
        (np.r_[np.nan, np.ones(39)], "1 NaN value(s), first at row 0"),
        (np.r_[np.ones(39), -1.0], "negative weight -1 at row 39"),
        (np.zeros(40), "the weights sum to zero"),
        (np.ones(39), "39 weights for 40 points"),
        (np.ones((40, 2)), "expected a 1-D array of weights"),
    ],
)
def test_bad_weights_are_one_line_errors(tmp_path, capsys, weights, frag):
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "w.npy", weights)
    rc, out, err = run(
        "solve",
        tmp_path / "x.npy",
        tmp_path / "x.npy",
        "--reg",
        "0.5",
        "--source-weights",
        tmp_path / "w.npy",
        capsys=capsys,
    )
    assert rc == 1 and len(err.strip().splitlines()) == 1 and frag in err, err


def test_weights_column_errors(tmp_path, capsys):
    write("csv", tmp_path / "x.csv", X, WX)
    np.save(tmp_path / "y.npy", Y)
    rc, _, err = run(
        "solve", tmp_path / "x.csv", tmp_path / "x.csv", "--reg", "0.5", "--weights-column", "mass", capsys=capsys
    )
    assert rc == 1 and "no column named 'mass' for --weights-column (columns: x, y, z, w)" in err
    rc, _, err = run(
        "solve", tmp_path / "x.csv", tmp_path / "x.csv", "--reg", "0.5", "--weights-column", "9", capsys=capsys
    )
    assert rc == 1 and "--weights-column 9 is out of range for 4 columns" in err


def test_solver_errors_and_output_errors_are_one_line(tmp_path, capsys):
    np.save(tmp_path / "x.npy", X)
    rc, _, err = run("solve", tmp_path / "x.npy", tmp_path / "x.npy", "--reg", "1e-300", "--float32", capsys=capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("flashot solve: error: reg")
    rc, _, err = run(
        "solve", tmp_path / "x.npy", tmp_path / "x.npy", "--reg", "1", "--out", tmp_path / "no" / "r.npz", capsys=capsys
    )
    assert rc == 1 and "does not exist" in err
    rc, _, err = run("solve", tmp_path / "x.npy", tmp_path / "x.npy", "--reg", "1", "--out", tmp_path, capsys=capsys)
    assert rc == 1 and "is a directory" in err


def test_no_traceback_in_a_real_process(tmp_path, capsys):
    """The console script: stderr holds the one line and nothing else (no traceback); in a real process for
    one input, in-process (the same entry point) for the others."""
    os.mkfifo(tmp_path / "pipe.csv")
    nan = X.copy()
    nan[0, 0] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    np.save(tmp_path / "x.npy", X)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashot.cli",
            "solve",
            str(tmp_path / "pipe.csv"),
            str(tmp_path / "x.npy"),
            "--reg",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "is a FIFO" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for src, frag in ((tmp_path / "nan.npy", "NaN"), ("/dev/zero", "device")):
        assert flashot.cli.main(["solve", str(src), str(tmp_path / "x.npy"), "--reg", "1"]) == 1
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and frag in out.err and "Traceback" not in out.err, out.err


def test_damaged_npy_header_gives_the_same_message_every_time(tmp_path):
    """numpy's header parser names an AST node with its address; the error keeps the message, not the address
    (found by tests/cli/test_cli_fuzz.py::test_npy_reader, which compares two reads of one file)."""
    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1, 1), }<0"
    blob = b"\x93NUMPY\x01\x00v\x00" + header + b" " * (118 - len(header) - 1) + b"\n" + bytes(8)
    path = tmp_path / "p.npy"
    path.write_bytes(blob)
    messages = set()
    for _ in range(3):
        with pytest.raises(fio.InputError, match="not a valid .npy file") as e:
            fio.read_points(str(path))
        messages.add(str(e.value))
    assert len(messages) == 1 and " at 0x" not in messages.pop()
