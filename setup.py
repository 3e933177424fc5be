"""Build hook: a wheel carries the CPU kernels prebuilt for each instruction-set level of its platform.

Everything else is in pyproject.toml.  ``build_py`` compiles (or takes from the kernel cache) the
libraries with the recipe of first use, ``flashot.ops.cpu.wheel.build_variants``, into the wheel's
``flashot/ops/cpu/prebuilt/``; the package loads the best level the running CPU supports.  The wheel is
tagged ``py3-none-<platform>``: the libraries are plain C ABI (loaded with ctypes), so any Python 3 runs
them, but only on the platform they were compiled for.

``FLASHOT_WHEEL_KERNELS``: unset or ``auto`` (every level a compiler is found for), ``none`` (a pure
source wheel, kernels compiled on first use), or a comma-separated list such as ``x86-64-v3,x86-64-v2``.
Editable installs never prebuild (they compile on first use, from the working tree).  An AArch64 wheel
is built on an x86-64 machine with Debian's ``g++-aarch64-linux-gnu`` and
``python -m build --wheel -C--build-option=--plat-name=linux_aarch64``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
CPU = os.path.join(HERE, "src", "flashot", "ops", "cpu")


def _wheel_module():
    """``flashot.ops.cpu.wheel``, loaded on its own: the build environment has no torch, which
    ``flashot/__init__.py`` imports (``flashot.ops.cpu`` itself imports nothing but the standard library)."""
    name = "_flashot_cpu_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(CPU, "__init__.py"), submodule_search_locations=[CPU]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(name + ".wheel")


def _platform(dist) -> str:
    bw = dist.command_obj.get("bdist_wheel")
    plat = getattr(bw, "plat_name", None) or sysconfig.get_platform()
    return plat.replace("-", "_").replace(".", "_")


def _variants(dist) -> list[str]:
    key = (_platform(dist), os.environ.get("FLASHOT_WHEEL_KERNELS"))
    if getattr(dist, "_flashot_variants", (None,))[0] != key:
        variants, notes = _wheel_module().wheel_variants(*key)
        for note in notes:
            print(f"flashot: {note}", file=sys.stderr)
        dist._flashot_variants = (key, variants)
    return dist._flashot_variants[1]


class KernelDistribution(Distribution):
    """Not pure when kernels will be prebuilt: the wheel gets a platform tag."""

    def has_ext_modules(self):
        return bool(_variants(self))


class build_py_kernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install compiles on first use, from the working tree
        variants = _variants(self.distribution)
        if variants:
            wheel = _wheel_module()
            out = os.path.join(self.build_lib, "flashot", "ops", "cpu", wheel.prebuilt.DIRNAME)
            wheel.build_variants(out, variants, log=lambda s: print(s, file=sys.stderr))


class bdist_wheel_kernels(bdist_wheel):
    def get_tag(self):
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (python, abi, plat)


setup(distclass=KernelDistribution, cmdclass={"build_py": build_py_kernels, "bdist_wheel": bdist_wheel_kernels})
