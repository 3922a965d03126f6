"""Builds the tutel package and its compiled extension against the installed PyTorch.

    pip install --no-build-isolation .        # or: pip install --no-build-isolation -e .

`--no-build-isolation` matters: the extension must be compiled against the very
PyTorch that will import it, not against a fresh copy pip would download.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - only reached on a machine without torch
    sys.exit(
        "tutel compiles against the installed PyTorch, but `import torch` failed.\n"
        "Install PyTorch first (https://pytorch.org), then run\n"
        "    pip install --no-build-isolation .\n"
        "(--no-build-isolation lets the build see that PyTorch.)"
    )


def relative_sources(*patterns):
    """Source files matching the patterns, relative to this file (setuptools wants relative paths)."""
    found = []
    for pattern in patterns:
        found.extend(sorted(glob.glob(os.path.join(ROOT, pattern))))
    return [os.path.relpath(path, ROOT) for path in found]


def extension():
    sources = relative_sources("csrc/core/*.cpp", "csrc/ops/*.cpp", "csrc/ops/cpu/*.cpp")
    return CppExtension(
        name="tutel._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-fvisibility=hidden"]},
    )


def version():
    about = {}
    with open(os.path.join(ROOT, "tutel", "_version.py")) as handle:
        exec(handle.read(), about)
    return about["__version__"]


setup(
    name="tutel",
    version=version(),
    description="Fast, correct Mixture-of-Experts layers for PyTorch, drop-in compatible with Microsoft Tutel",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.8",
    packages=find_packages(include=["tutel", "tutel.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=["torch>=2.1"],
    zip_safe=False,
)
