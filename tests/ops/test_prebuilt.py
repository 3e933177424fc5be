"""The wheel's prebuilt kernels (flashot.ops.cpu.prebuilt): which level a CPU gets, from its own
feature flags; what the wheel build compiles; and the rule that a prebuilt library is loaded only
from the installed package's directory.  The wheel itself, built and run without a compiler:
tests/docs/test_packaging.py (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from flashot.ops.cpu import build, prebuilt, wheel

# /proc/cpuinfo flag sets of real CPU generations (the flags the levels look at, plus some noise)
NEHALEM = {"fpu", "sse2", "cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
HASWELL = NEHALEM | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
ZEN4 = HASWELL | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512ifma"}
ALL = prebuilt.VARIANTS["x86_64"]


@pytest.mark.parametrize(
    "flags,want",
    [
        (ZEN4, "x86-64-v4"),
        (HASWELL, "x86-64-v3"),
        (ZEN4 - {"avx512vl"}, "x86-64-v3"),  # every one of F/BW/CD/DQ/VL, or no v4
        (ZEN4 - {"avx512bw"}, "x86-64-v3"),  # Knights Landing: F/CD but no BW/DQ/VL
        (HASWELL - {"movbe"}, "x86-64-v2"),
        (HASWELL - {"abm"}, "x86-64-v2"),  # LZCNT
        (HASWELL - {"bmi2"}, "x86-64-v2"),
        (NEHALEM, "x86-64-v2"),
        (NEHALEM - {"popcnt"}, None),  # below every shipped level: compile for it instead
        ({"avx512f", "avx2", "fma"}, None),  # a level's flags without the levels below it
        (set(), None),  # unknown flags (no /proc/cpuinfo): never guess
    ],
)
def test_x86_levels_from_the_cpu_flags(flags, want):
    assert prebuilt.select_variant(flags, "x86_64", ALL) == want


def test_selection_only_among_shipped_variants_and_this_architecture():
    assert prebuilt.select_variant(ZEN4, "x86_64", ["x86-64-v3", "x86-64-v2"]) == "x86-64-v3"
    assert prebuilt.select_variant(ZEN4, "AMD64", ["x86-64-v4"]) == "x86-64-v4"
    assert prebuilt.select_variant(HASWELL, "x86_64", ["x86-64-v4"]) is None
    assert prebuilt.select_variant(ZEN4, "x86_64", ["armv8-a"]) is None
    assert prebuilt.select_variant({"fp", "asimd"}, "aarch64", ["armv8-a"]) == "armv8-a"
    assert prebuilt.select_variant(set(), "aarch64", [*ALL, "armv8-a"]) == "armv8-a"
    assert prebuilt.select_variant(ZEN4, "ppc64le", [*ALL, "armv8-a"]) is None


def test_the_level_flags_are_the_psabi_ones():
    """x86-64-v4 needs AVX-512 F/BW/CD/DQ/VL; v3 AVX2/FMA/BMI1/BMI2/F16C/MOVBE/LZCNT; v2 SSE4.2/POPCNT/SSSE3."""
    v2, v3, v4 = (set(prebuilt.level_flags(v)) for v in ("x86-64-v2", "x86-64-v3", "x86-64-v4"))
    assert {"sse4_2", "popcnt", "ssse3"} <= v2 < v3 < v4
    assert {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"} <= v3 - v2
    assert v4 - v3 == {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_wheel_variants_follow_the_platform_and_the_setting(monkeypatch):
    assert wheel.variants_for_platform("linux_x86_64") == ALL
    assert wheel.variants_for_platform("manylinux_2_28_aarch64") == ("armv8-a",)
    assert wheel.variants_for_platform("win_amd64") == ALL
    assert wheel.variants_for_platform("linux_riscv64") == ()
    assert wheel.wheel_variants("linux_x86_64", "none") == ([], ["FLASHOT_WHEEL_KERNELS=none: no prebuilt kernels"])
    assert wheel.wheel_variants("linux_x86_64", "x86-64-v3, x86-64-v2")[0] == ["x86-64-v3", "x86-64-v2"]
    with pytest.raises(build.BuildError, match="armv8-a not a variant of linux_x86_64"):
        wheel.wheel_variants("linux_x86_64", "armv8-a")
    monkeypatch.setattr(wheel, "compiler_for", lambda v: "c++")  # a compiler for each: every level
    assert wheel.wheel_variants("linux_x86_64", None) == (list(ALL), [])
    assert wheel.wheel_variants("linux_x86_64", "auto") == (list(ALL), [])
    monkeypatch.setattr(wheel, "compiler_for", lambda v: None)  # no compiler: a source-only wheel
    got, notes = wheel.wheel_variants("linux_x86_64", None)
    assert got == [] and len(notes) == 3


def _predefined(cxx: str, march: str) -> set[str]:
    out = subprocess.run(
        [cxx, f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
    ).stdout
    return {ln.split()[1] for ln in out.splitlines() if ln.startswith("#define ")}


def test_native_compiles_the_code_paths_of_the_x86_64_v4_level():
    """The kernels choose their code paths by instruction-set macros that x86-64-v4 defines, never by one that
    only -march=native defines on this CPU (an AVX-512 CPU defines many more: VNNI, BF16, VBMI, ...).  So on an
    AVX-512 CPU the default run's native build compiles the v4 level's code paths (the tuning differs, not the
    code), and the wheel test need not compile that level a second time (tests/docs/test_packaging.py)."""
    import platform

    cxx = build.find_compiler()
    if cxx is None or prebuilt.arch(platform.machine()) != "x86_64":
        pytest.skip("needs a C++ compiler on an x86-64 machine")
    src = os.path.dirname(build.__file__)
    used = set()
    for name in build.SOURCES:
        with open(os.path.join(src, name)) as f:
            for line in f:
                if re.match(r"\s*#\s*(if|elif)", line):
                    used |= set(re.findall(r"\b(__[A-Za-z0-9_]+__)\b", line))
    baseline, v4, native = (_predefined(cxx, m) for m in ("x86-64", "x86-64-v4", "native"))
    assert "__AVX512F__" in used and "__AVX512F__" in v4  # the test sees the sources' macros
    only_native = sorted(m for m in used & (native - baseline) if m not in v4)
    assert not only_native, f"kernel code paths chosen by macros x86-64-v4 does not define: {only_native}"


# ---- loading: only from the package directory --------------------------------------------------


def _fake_install(tmp_path, variant="x86-64-v3", key=None):
    """A prebuilt directory laid out as a wheel installs it (the libraries are empty files here)."""
    root = tmp_path / "prebuilt"
    (root / variant).mkdir(parents=True)
    for library in build.LIBRARIES:
        (root / variant / f"{library}.so").write_bytes(b"")
    key = build.source_key(build.read_sources(), variant) if key is None else key
    man = {
        "format": prebuilt.FORMAT,
        "abi_version": build.ABI_VERSION,
        "variants": {variant: {"key": key, "compiler": "g++ 12"}},
    }
    (root / prebuilt.MANIFEST).write_text(json.dumps(man))
    return root


def _key(v):
    return build.source_key(build.read_sources(), v)


def _find(library, root, target=None, flags=HASWELL):
    return prebuilt.find(library, _key, set(flags), "x86_64", target, root=str(root))


def _status(root, target=None, flags=HASWELL):
    return prebuilt.status(_key, set(flags), "x86_64", target, root=str(root))


def test_the_selected_variant_is_found_with_its_facts(tmp_path):
    root = _fake_install(tmp_path)
    path, facts = _find("blocksparse_f64", root)
    assert path == str(root / "x86-64-v3" / "blocksparse_f64.so")
    assert facts == {"prebuilt": "x86-64-v3", "march": "x86-64-v3", "compiler": "g++ 12"}
    assert _find("core_f32", root, "native") is None  # FLASHOT_CPU_MARCH=native compiles
    st = _status(root, "x86-64-v2")
    assert st["selected"] is None and "not a prebuilt variant" in st["reason"]


def test_stale_or_unrunnable_prebuilt_kernels_are_not_used(tmp_path):
    root = _fake_install(tmp_path, key="0" * 16)  # built from other sources than this package's
    st = _status(root)
    assert st["selected"] is None and "other sources" in st["reason"]
    assert _find("core_f32", root) is None
    root = _fake_install(tmp_path / "b")
    st = _status(root, flags=NEHALEM)
    assert st["selected"] is None and "runs none" in st["reason"] and st["shipped"] == ["x86-64-v3"]


def test_the_load_path_takes_the_prebuilt_library(tmp_path, monkeypatch):
    """build._open loads what prebuilt.find names, checked as a prebuilt one (here: a fake package dir
    holding this tree's compiled library, so the ABI checks pass) -- and BUILD_INFO names the level."""
    import shutil

    lib, *_ = build.build(quiet=True)
    root = _fake_install(tmp_path)
    shutil.copyfile(lib, root / "x86-64-v3" / "core_f32.so")
    monkeypatch.setattr(prebuilt, "package_dir", lambda: str(root))
    real_flags = build._cpu_flags
    monkeypatch.setattr(build, "_cpu_flags", lambda: set(HASWELL))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("FLASHOT_CPU_MARCH", raising=False)
    _, info = build._open("core_f32", quiet=True)
    assert info["prebuilt"] == "x86-64-v3" and info["path"] == str(root / "x86-64-v3" / "core_f32.so")
    assert build.prebuilt_status()["selected"] == "x86-64-v3"
    monkeypatch.setenv("FLASHOT_CPU_MARCH", "native")
    monkeypatch.setattr(build, "_cpu_flags", real_flags)  # the native library's cache key: no new compile
    _, info = build._open("core_f32", quiet=True)
    assert info["prebuilt"] is None and info["march"] == "native"


def test_no_manifest_means_compile_on_first_use(tmp_path):
    st = _status(tmp_path)
    assert st["selected"] is None and st["shipped"] == [] and "source or editable" in st["reason"]
    # this source tree ships none: build.load() compiles (or finds the cache), as before
    assert not os.path.exists(os.path.join(prebuilt.package_dir(), prebuilt.MANIFEST))


def test_a_library_outside_the_package_dir_is_refused(tmp_path):
    lib = tmp_path / "core.so"
    lib.write_bytes(b"")
    with pytest.raises(prebuilt.PrebuiltError, match="not inside the installed package"):
        prebuilt.check_package_file(str(lib))  # the default root: this package's prebuilt/
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "core.so").symlink_to(lib)  # a link out of the package
    with pytest.raises(prebuilt.PrebuiltError, match="not inside the installed package"):
        prebuilt.check_package_file(str(root / "core.so"), str(root))
    (root / "inner.so").write_bytes(b"")
    (root / "link.so").symlink_to(root / "inner.so")  # a link, even within
    with pytest.raises(prebuilt.PrebuiltError, match="not a regular file"):
        prebuilt.check_package_file(str(root / "link.so"), str(root))
    prebuilt.check_package_file(str(root / "inner.so"), str(root))  # fine


def test_a_library_others_can_write_is_refused(tmp_path):
    root = _fake_install(tmp_path)
    lib = root / "x86-64-v3" / "core_f32.so"
    os.chmod(lib, 0o666)
    with pytest.raises(prebuilt.PrebuiltError, match="written by others"):
        _find("core_f32", root)
    os.chmod(lib, 0o644)
    os.chmod(root / "x86-64-v3", 0o777)  # or its directory
    with pytest.raises(prebuilt.PrebuiltError, match="written by others"):
        _find("core_f32", root)
    os.chmod(root / "x86-64-v3", 0o755)
    assert _find("core_f32", root)[0] == str(lib)


def test_build_info_of_a_source_tree_says_compile_on_first_use():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHOT_")}
    r = subprocess.run(
        [sys.executable, "-m", "flashot.cli", "build", "--info"], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "prebuilt variants in this install: none" in r.stdout and "compiled on first use" in r.stdout


def test_an_aarch64_wheel_on_x86_uses_the_cross_compiler(monkeypatch, tmp_path):
    """``--plat-name=linux_aarch64`` on an x86-64 machine: armv8-a, compiled by aarch64-linux-gnu-g++;
    without it, none (and an explicit request fails before writing anything)."""
    monkeypatch.setattr(wheel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(wheel.shutil, "which", lambda c: f"/usr/bin/{c}" if c == wheel.CROSS_CXX["aarch64"] else None)
    assert wheel.compiler_for("armv8-a") == "/usr/bin/aarch64-linux-gnu-g++"
    assert wheel.wheel_variants("linux_aarch64", None) == (["armv8-a"], [])
    monkeypatch.setattr(wheel.shutil, "which", lambda c: None)
    assert wheel.wheel_variants("linux_aarch64", None)[0] == []
    with pytest.raises(build.BuildError, match="aarch64-linux-gnu-g\\+\\+"):
        wheel.build_variants(str(tmp_path / "out"), ["armv8-a"])
    assert not (tmp_path / "out").exists()
