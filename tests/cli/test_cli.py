"""The console entry point, and the package as released: one version, metadata that twine accepts.

``flashot solve`` is tested in tests/cli/test_cli_files.py."""

import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile

import pytest

import flashot
import flashot.cli
from flashot.data import two_moons_3d

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_demo_prints_the_solution_it_computed(tmp_path):
    png = tmp_path / "demo.png"
    r = subprocess.run(
        [sys.executable, "-m", "flashot.cli", "demo", "--n", "800", "--backend", "tiled", "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    value = float(re.search(r"value \(OT_eps, POT convention\) = ([0-9.eE+-]+)", out).group(1))
    n_iter = int(re.search(r"iterations = (\d+)", out).group(1))
    div = float(re.search(r"S\(x, y\) = ([0-9.eE+-]+)", out).group(1))
    assert re.search(r"peak RSS = \d+ MiB", out)
    x, y = two_moons_3d(800)
    ref = flashot.solve_sample(x, y, reg=1e-2, tol=1e-3, max_iter=500, backend="dense")
    assert abs(value - float(ref.value)) < 1e-4 * abs(float(ref.value))
    assert abs(n_iter - ref.n_iter) <= 1
    ref_div = flashot.SamplesLoss(blur=0.05, backend="dense")(x, y)
    assert abs(div - float(ref_div)) < 1e-4 * abs(float(ref_div)) + 1e-7
    if _has_matplotlib():  # the picture: a real PNG of a real size, and the demo says where it is
        assert f"picture: {png}" in out
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 800 and height >= 300, (width, height)
        assert len(data) > 50_000  # two panels of points and arrows (about 180 kB); a blank figure is ~10 kB
        assert os.listdir(tmp_path) == ["demo.png"]  # nothing written elsewhere
    else:
        assert "pip install matplotlib" in out and not png.exists()


def test_demo_default_png_path_and_no_png(tmp_path, monkeypatch, capsys):
    """In-process (the real process is test_demo_prints_the_solution_it_computed): the picture goes to the
    working directory by default, and nowhere with --no-png."""
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed (it is in the test extra)")
    monkeypatch.chdir(tmp_path)
    assert flashot.cli.main(["demo", "--n", "200"]) == 0
    path = tmp_path / flashot.cli.DEMO_PNG
    assert path.read_bytes()[:4] == b"\x89PNG" and f"picture: {path}" in capsys.readouterr().out
    path.unlink()
    assert flashot.cli.main(["demo", "--n", "200", "--no-png"]) == 0
    assert "picture" not in capsys.readouterr().out and os.listdir(tmp_path) == []


def test_demo_without_matplotlib_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert flashot.cli.demo_png(str(tmp_path / "x.png"), "dense", 0) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed: pip install matplotlib" in out and not (tmp_path / "x.png").exists()


def test_demo_png_unwritable_is_one_line_error(capsys, tmp_path):
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed (it is in the test extra)")
    assert flashot.cli.demo_png(str(tmp_path / "no" / "x.png"), "dense", 0) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashot demo: error: cannot write") and err.count("\n") == 1


@pytest.mark.parametrize("cmd", ["solve", "demo", "build", "bench"])
def test_every_command_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        flashot.cli.main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flashot {cmd}") and "--help" in out


def test_top_level_help_lists_every_command(capsys):
    assert flashot.cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("solve", "demo", "build", "bench"):
        assert re.search(rf"^  {cmd} ", out, re.M), cmd


def test_unknown_command_is_an_error(capsys):
    # in this process: ``python -m flashot.cli`` and its exit status are the demo and bad-march tests'
    assert flashot.cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and "unknown command 'frobnicate'" in err


def test_version_flag(capsys):
    assert flashot.cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flashot {flashot.__version__}"


def test_build_command_reports_the_isa_and_the_library(shared_build_cache):
    import os

    from flashot.ops.cpu import build

    if build._find_compiler() is None:
        import pytest

        pytest.skip("no C++ compiler on PATH")
    # native, in the run's shared cache: compiled at session start (tests/conftest.py), so found here;
    # the compiling branch's messages are checked by tests/ops/test_cpu_build.py's fresh build (slow)
    cache = shared_build_cache
    env = {**os.environ, "FLASHOT_CACHE_DIR": str(cache)}
    args = [sys.executable, "-m", "flashot.cli", "build", "--march", "native"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert str(cache) in r.stdout and "threads" in r.stdout and "-march=native" in r.stdout, r.stdout
    compiled = "compiled in" in r.stdout
    assert compiled == ("compiling the CPU kernels once" in r.stderr), (r.stdout, r.stderr)
    assert compiled or "found in the cache" in r.stdout, r.stdout
    if compiled:  # then the second call finds it
        r2 = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
        assert r2.returncode == 0 and "found in the cache" in r2.stdout


def test_build_command_refuses_a_bad_march():
    """In a process of its own: a failed load is remembered for the rest of the process."""
    bad = subprocess.run(
        [sys.executable, "-m", "flashot.cli", "build", "--march", "x; rm -rf /"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "FLASHOT_CPU_MARCH" in bad.stderr


# ---------------------------------------------------------------------------------------------
# release: one version, metadata that twine accepts, the license


def test_version_lives_in_one_place():
    """pyproject.toml reads the version from flashot.__version__ (no second copy to forget)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("needs the source tree (pyproject.toml)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flashot.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", flashot.__version__)
    assert meta["project"]["license"] == "MIT" and "LICENSE" in meta["project"]["license-files"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert f.read().startswith("MIT License")
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        log = f.read()
    assert "Keep a Changelog" in log and "## [Unreleased]" in log


def test_build_and_twine_check(tmp_path):
    """``python -m build --sdist --wheel`` then ``twine check --strict``, on a copy of the tree (the build
    writes build/ and *.egg-info next to the sources). No isolation: the test extra installs
    setuptools, build and twine, so the check runs offline."""
    pytest.importorskip("build", reason="needs the 'build' package (pip install -e '.[test]')")
    pytest.importorskip("twine", reason="needs twine (pip install -e '.[test]')")
    if not os.path.exists(os.path.join(ROOT, "pyproject.toml")):
        pytest.skip("needs the source tree (pyproject.toml)")
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            "*.png",
            ".whl",
            ".gl",
        ),
    )
    dist = tmp_path / "dist"
    # a source-only wheel (py3-none-any): the wheel with prebuilt kernels is tests/docs/test_packaging.py's (slow)
    env = {**os.environ, "FLASHOT_WHEEL_KERNELS": "none"}
    r = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env=env,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    files = sorted(os.listdir(dist))
    v = flashot.__version__
    assert files == [f"flashot-{v}-py3-none-any.whl", f"flashot-{v}.tar.gz"], files
    r = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *[str(dist / f) for f in files]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.count("PASSED") == 2, r.stdout + r.stderr
    with zipfile.ZipFile(dist / files[0]) as z:
        meta = z.read(f"flashot-{v}.dist-info/METADATA").decode()
        names = z.namelist()
    assert f"flashot-{v}.dist-info/licenses/LICENSE" in names and "flashot/io.py" in names
    fields = [line.split(": ", 1) for line in meta.split("\n\n", 1)[0].splitlines() if ": " in line]
    get = lambda k: [b for a, b in fields if a == k]  # noqa: E731
    assert get("Version") == [v] and get("License-Expression") == ["MIT"]
    assert "Homepage, https://github.com/flashot/flashot" in get("Project-URL")
    assert {"test", "examples", "bench"} <= set(get("Provides-Extra"))
    assert any(c.startswith("Programming Language :: Python :: 3") for c in get("Classifier"))
    assert get("Description-Content-Type") == ["text/markdown"]
    with tarfile.open(dist / files[1]) as tf:
        pkg_info = tf.extractfile(f"flashot-{v}/PKG-INFO").read().decode()
        assert f"flashot-{v}/LICENSE" in tf.getnames()
    assert f"\nVersion: {v}\n" in pkg_info
