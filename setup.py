"""Builds the tutel package and its compiled extension against the installed PyTorch.

    pip install --no-build-isolation .        # or: pip install --no-build-isolation -e .

`--no-build-isolation` matters: the extension must be compiled against the very
PyTorch that will import it, not against a fresh copy pip would download.

With a CUDA build of PyTorch and a CUDA toolkit (found through CUDA_HOME) the
CUDA operators are built too; TUTEL_WITH_CUDA=1 insists on them and
TUTEL_WITH_CUDA=0 leaves them out.  Their kernels are compiled at run time by
NVRTC, so the build itself needs no nvcc.
"""
import glob
import importlib.util
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    from torch.utils import cpp_extension
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


def cuda_build_requested():
    """Whether to build the CUDA operators.

    TUTEL_WITH_CUDA=1 requires them and TUTEL_WITH_CUDA=0 (or the reference's
    NO_CUDA=1) leaves them out; by default they are built when the installed
    PyTorch is a CUDA build and a CUDA toolkit (for the headers) is found.
    """
    setting = os.environ.get("TUTEL_WITH_CUDA", "").strip().lower()
    if setting in ("0", "false", "no", "off") or os.environ.get("NO_CUDA", "0") not in ("", "0"):
        return False
    required = setting in ("1", "true", "yes", "on")
    if torch.version.cuda is None:
        if required:
            sys.exit(f"TUTEL_WITH_CUDA=1, but the installed PyTorch {torch.__version__} is not a CUDA build "
                     "(torch.version.cuda is None). The CUDA operators run on PyTorch's CUDA streams, so "
                     "install a CUDA build of PyTorch, or unset TUTEL_WITH_CUDA for a CPU-only build.")
        return False
    if cpp_extension.CUDA_HOME is None:
        message = ("PyTorch is a CUDA build but no CUDA toolkit was found (set CUDA_HOME to it); "
                   "the CUDA headers are needed to build tutel's CUDA operators.")
        if required:
            sys.exit(message)
        print(f"WARNING: {message} Building the CPU operators only.", file=sys.stderr)
        return False
    return True


WITH_CUDA = cuda_build_requested()


def openmp_flags():
    """With PyTorch's OpenMP backend, at::parallel_for expands to `#pragma omp parallel` inside the
    extension's own code: without -fopenmp every kernel would run on one thread.  (The OpenMP
    runtime is the one PyTorch already loaded.)"""
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        return ["-fopenmp"]
    return []


def extension():
    sources = relative_sources("csrc/core/*.cpp", "csrc/gemm/*.cpp", "csrc/ops/*.cpp", "csrc/ops/cpu/*.cpp")
    include_dirs = [os.path.join(ROOT, "csrc")]
    compile_args = {"cxx": ["-O3", "-fvisibility=hidden"] + openmp_flags()}
    if not WITH_CUDA:
        return CppExtension(name="tutel._C", sources=sources, include_dirs=include_dirs,
                            extra_compile_args=compile_args, extra_link_args=openmp_flags())
    # Plain C++ host code: the kernels are compiled by NVRTC at run time, and
    # the extension opens NVRTC and the driver with dlopen.
    return cpp_extension.CUDAExtension(
        name="tutel._C",
        sources=sources + relative_sources("csrc/cuda/*.cpp", "csrc/ops/cuda/*.cpp"),
        include_dirs=include_dirs,
        define_macros=[("TUTEL_WITH_CUDA", None)],
        libraries=["dl"],
        extra_compile_args=compile_args,
        extra_link_args=openmp_flags(),
    )


def load_kernel_embedder():
    spec = importlib.util.spec_from_file_location("embed_kernels", os.path.join(ROOT, "csrc", "cuda", "embed_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(BuildExtension):
    """Embeds kernels/* into a generated source in the build directory before compiling."""

    def build_extensions(self):
        if WITH_CUDA:
            generated = os.path.relpath(os.path.join(self.build_temp, "generated", "kernel_sources.cpp"), ROOT)
            load_kernel_embedder().write_if_changed(os.path.join(ROOT, "kernels"), generated)
            for ext in self.extensions:
                if generated not in ext.sources:
                    ext.sources.append(generated)
        super().build_extensions()


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
    # The text tutel.examples.transformers_moe trains on; the decode kernel's measured lines.
    package_data={"tutel.examples": ["data/*.txt"], "tutel.ops": ["decode_lines.json"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildWithKernels.with_options(use_ninja=True)},
    install_requires=["torch>=2.1"],
    # pip install --no-build-isolation ".[examples]": what tutel.examples use besides PyTorch
    # (moe_mnist's bundled digits, progress bars, loss curves).  ".[transformers]": the releases
    # tutel.integrations.transformers supports (its versions.REQUIREMENT).
    extras_require={"examples": ["scikit-learn>=1.3", "tqdm>=4.60", "matplotlib>=3.5"],
                    "transformers": ["transformers>=5.7.0,<6"]},
    zip_safe=False,
)
