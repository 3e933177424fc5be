"""``flashot solve`` / ``flashot demo`` against hostile options and malformed files (issue 34).

Numeric options that overflow or make no sense exit with status 2 and one argparse line naming the
option, before any file is read or any solve runs; malformed files are one-line errors (status 1)
naming the file, the line and the field, never a silently dropped or garbled row."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flashot
import flashot.cli
from flashot import io as fio

RNG = np.random.default_rng(3)
X = RNG.normal(size=(12, 3))


def _no_solve(monkeypatch):
    """Make any solve fail loudly: the checks under test must come before it."""

    def boom(*a, **k):
        raise AssertionError("solve_sample was called")

    monkeypatch.setattr(flashot, "solve_sample", boom)


def option_error(capsys, argv, cmd="solve"):
    """Run ``flashot <cmd> argv``: expect exit status 2 (argparse's usage, then one error line, no
    traceback or warning); return the error line."""
    with pytest.raises(SystemExit) as e:
        flashot.cli.main([cmd, *map(str, argv)])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and "Warning" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"flashot {cmd}: error: "), err
    return last


def file_error(capsys, argv):
    """Run ``flashot solve argv``: expect exit status 1 and exactly one line on stderr."""
    rc = flashot.cli.main(["solve", *map(str, argv)])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashot solve: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# numeric options (finding 6)

BIG = "9" * 26


@pytest.mark.parametrize(
    "argv, frag",
    [
        (["--blur", "1e200"], "--blur: blur^2 = 1e+400 overflows"),
        (["--blur", "1e-200"], "--blur: blur^2 = 1e-400 underflows"),
        (["--reg", "1", "--max-iter", BIG], "--max-iter: expected at most 2,147,483,647"),
        (["--reg", "1e-320"], "--reg: expected a positive finite number of at least 2.2e-308"),
        (["--reg", "1", "--tol", "1e-320"], "--tol: expected a positive finite number of at least"),
        (["--reg", "1", "--unbalanced", "1e-320"], "--unbalanced: expected a positive number of at least"),
        (["--reg", "1", "--max-points", BIG], "--max-points: expected at most"),
        (["--reg", "1", "--max-bytes", BIG], "--max-bytes: expected at most"),
        (["--reg", "1", "--out", "r.npz", "--topk", BIG], "--topk: expected at most"),
        (["--reg", "1", "--out", "r.npz", "--topk", "13"], "--topk: 13 is above the number of target points (12)"),
    ],
)
def test_absurd_numbers_exit_2_before_solving(tmp_path, capsys, monkeypatch, argv, frag):
    np.save(tmp_path / "x.npy", X)
    _no_solve(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = option_error(capsys, [tmp_path / "x.npy", tmp_path / "x.npy", *argv])
    assert frag in line, line


def test_blur_range_edges_are_accepted(tmp_path, capsys):
    """The bounds are those of float64: blur^2 must be a positive normal float64."""
    from flashot.cli.options import blur as _blur

    assert _blur("1e150") == 1e150 and _blur("1e-150") == 1e-150
    for bad in ("1e155", "1e-155"):
        with pytest.raises(Exception, match="blur"):
            _blur(bad)


@pytest.mark.parametrize(
    "argv, frag",
    [
        (["--blur", "1e200"], "--blur: blur^2 = 1e+400 overflows"),
        (["--seed", BIG], "--seed: expected an integer from"),
        (["--n", BIG], "--n: expected at most 10,000,000"),
        (["--reg", "1e-300"], "error: reg: eps = 1e-300 is too small"),  # float32 demo: the solver refuses it
    ],
)
def test_demo_absurd_numbers_exit_2(capsys, argv, frag):
    line = option_error(capsys, ["--n", "8", "--no-png", *argv], cmd="demo")
    assert frag in line, line


# ---------------------------------------------------------------------------------------------
# backends (finding 11)


@pytest.mark.parametrize("backend", ["tensorized", "online", "gpu"])
def test_unknown_backend_is_refused_before_reading_the_files(tmp_path, capsys, monkeypatch, backend):
    _no_solve(monkeypatch)
    line = option_error(
        capsys, [tmp_path / "missing.npy", tmp_path / "missing.npy", "--reg", "1", "--backend", backend]
    )
    assert "--backend: expected 'auto' or one of" in line and repr(backend) in line, line


def test_triton_on_the_cpu_is_an_option_error(tmp_path, capsys, monkeypatch):
    """The command computes on the CPU: the triton engine (a CUDA kernel) cannot run it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    np.save(tmp_path / "x.npy", X)
    _no_solve(monkeypatch)
    line = option_error(capsys, [tmp_path / "x.npy", tmp_path / "x.npy", "--reg", "1", "--backend", "triton"])
    assert "--backend: 'triton' cannot run here" in line, line


def test_multiscale_backend_is_usable(tmp_path, capsys):
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "y.npy", X[::-1] + 0.5)
    rc = flashot.cli.main(
        ["solve", str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), "--reg", "0.5", "--backend", "multiscale", "--json"]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    ref = flashot.solve_sample(X, X[::-1] + 0.5, reg=0.5, backend="multiscale", tol=1e-6, max_iter=1000)
    res = json.loads(out)
    assert res["backend"] == "multiscale" and res["value"] == pytest.approx(float(ref.value), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# weights (finding 11)


def test_weights_that_overflow_their_sum_are_one_clear_error(tmp_path, capsys):
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "w.npy", np.full(12, 1e308))
    line = file_error(
        capsys, [tmp_path / "x.npy", tmp_path / "x.npy", "--reg", "1", "--source-weights", tmp_path / "w.npy"]
    )
    assert "w.npy: the weights sum to more than the largest float64" in line, line


def test_ply_weights_property_named_like_two_coordinates(tmp_path):
    """``xy`` is a property of its own, not a coordinate (exact names, not a substring test)."""
    p = tmp_path / "p.ply"
    p.write_text(
        "ply\nformat ascii 1.0\nelement vertex 2\nproperty float x\nproperty float y\n"
        "property float z\nproperty float xy\nend_header\n1 2 3 0.25\n4 5 6 0.75\n"
    )
    c = fio.read_points(str(p), weights_column="xy")
    np.testing.assert_array_equal(c.points, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(c.weights, [0.25, 0.75])
    with pytest.raises(fio.InputError, match="'y' is a coordinate"):
        fio.read_points(str(p), weights_column="y")


# ---------------------------------------------------------------------------------------------
# malformed files (finding 7)


@pytest.mark.parametrize(
    "text, frag",
    [
        ("1,,3\n4,5,6\n", "line 1, field 2: not a number: ''"),
        ("1,2,3o\n4,5,6\n", "line 1, field 3: not a number: '3o'"),
        ("x,y,z\n1,2,3\n4,5,6o\n", "line 3, field 3: not a number: '6o'"),
        ("x,y,7\n1,2,3\n", "line 1, field 1: not a number: 'x'"),
        ("1,2,1_0\n", "line 1, field 3: not a number: '1_0'"),  # Python's float() would take it as 10
        ("1,2,\uff13\n", "line 1, field 3: not a number"),  # a full-width digit 3
    ],
)
def test_csv_first_row_mixing_numbers_and_garbage_is_an_error(tmp_path, capsys, text, frag):
    p = tmp_path / "p.csv"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(fio.InputError) as e:
        fio.read_points(str(p))
    assert str(e.value).startswith(f"{p}: ") and frag in str(e.value), str(e.value)
    np.save(tmp_path / "y.npy", X)
    assert frag in file_error(capsys, [p, tmp_path / "y.npy", "--reg", "1"])


def test_csv_header_rows_are_still_headers(tmp_path):
    """A first row without any number names the columns (also pandas' empty index name)."""
    p = tmp_path / "p.csv"
    p.write_text(",x,y,z\n0,1,2,3\n1,4,5,6\n")
    c = fio.read_points(str(p), weights_column="0")
    np.testing.assert_array_equal(c.points, [[1, 2, 3], [4, 5, 6]])
    p.write_text("x y z\n1 2 3\r\n4\t5  6\r7 8 9")  # .txt via the suffix below; any line ending
    q = tmp_path / "p.txt"
    p.rename(q)
    np.testing.assert_array_equal(fio.read_points(str(q)).points, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])


def test_npy_with_bytes_after_the_data_is_an_error(tmp_path, capsys):
    np.save(tmp_path / "x.npy", X)
    with open(tmp_path / "x.npy", "ab") as f:
        f.write(b"garbage")
    with pytest.raises(fio.InputError, match=r"7 bytes after the array's data"):
        fio.read_points(str(tmp_path / "x.npy"))
    # the same inside a .npz member
    import zipfile

    with open(tmp_path / "x.npy", "rb") as f:
        blob = f.read()
    with zipfile.ZipFile(tmp_path / "z.npz", "w") as z:
        z.writestr("points.npy", blob)
    with pytest.raises(fio.InputError, match=r"z.npz\['points'\]: 7 bytes after the array's data"):
        fio.read_points(str(tmp_path / "z.npz"))


_HEAD = "ply\nformat ascii 1.0\nelement vertex {n}\nproperty float x\nproperty float y\nproperty float z\n"


@pytest.mark.parametrize(
    "text, frag",
    [
        (
            _HEAD.format(n=2) + "element vertex 1\nproperty float x\nend_header\n1 2 3\n4 5 6\n7\n",
            "header line 7: a second element named 'vertex'",
        ),
        (_HEAD.format(n=1) + "property float x\nend_header\n1 2 3 4\n", "header line 7: a second property named 'x'"),
        (_HEAD.format(n=2) + "end_header\n1 2 3\n4 5 6\n7 8 9\n", "line 10: data after the last element"),
        (
            _HEAD.format(n=2) + "element face 1\nproperty list uchar int vertex_indices\nend_header\n"
            "1 2 3\n4 5 6\n7 8 9\n3 0 1 1\n",
            "line 12 (element 'face'): 3 values, expected 8",
        ),
        (
            _HEAD.format(n=2) + "element face 1\nproperty list uchar int vertex_indices\nend_header\n"
            "1 2 3\n4 5 6\n3 0 1 1\n",
            "",
        ),  # correct: accepted
        (_HEAD.format(n=1) + "end_header\n1 2 3o\n", "line 8, field 3: not a number: '3o'"),
    ],
)
def test_ply_counts_and_elements_are_checked(tmp_path, text, frag):
    p = tmp_path / "p.ply"
    p.write_text(text)
    if not frag:
        assert fio.read_points(str(p)).points.shape == (2, 3)
        return
    with pytest.raises(fio.InputError) as e:
        fio.read_points(str(p))
    assert frag in str(e.value), str(e.value)


def test_binary_ply_with_bytes_after_the_last_element_is_an_error(tmp_path):
    head = (
        "ply\nformat binary_little_endian 1.0\nelement vertex 2\nproperty double x\nproperty double y\n"
        "property double z\nend_header\n"
    )
    body = np.arange(6, dtype="<f8").tobytes()
    (tmp_path / "p.ply").write_bytes(head.encode() + body)
    np.testing.assert_array_equal(fio.read_points(str(tmp_path / "p.ply")).points, [[0, 1, 2], [3, 4, 5]])
    (tmp_path / "p.ply").write_bytes(head.encode() + body + b"\0" * 24)
    with pytest.raises(fio.InputError, match="24 bytes after the last element"):
        fio.read_points(str(tmp_path / "p.ply"))


def test_npy_header_that_numpy_cannot_tokenize_is_an_error(tmp_path):
    """numpy's header parser raises tokenize.TokenError (not ValueError) on some damaged headers
    (found by tests/cli/test_cli_fuzz.py): still the reader's one-line error."""
    np.save(tmp_path / "x.npy", np.zeros((1, 1)))
    blob = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(blob.replace(b"'shape': (", b"'shape'\x00", 1))
    with pytest.raises(fio.InputError, match=r"x.npy: not a valid .npy file \("):
        fio.read_points(str(tmp_path / "x.npy"))
