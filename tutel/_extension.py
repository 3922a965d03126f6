"""Loads the compiled extension (tutel._C), which registers torch.ops.tutel.*."""
import glob
import importlib.machinery
import importlib.util
import os
import sys

_HOW_TO_BUILD = (
    "Build it against the installed PyTorch from the source tree with\n"
    "    pip install --no-build-isolation .          (or: pip install --no-build-isolation -e .)\n"
    "or, for an in-place build, `python setup.py build_ext --inplace`."
)


def _extension_file(package_dir: str):
    """This package's own _C built for the running Python, or None."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(package_dir, "_C" + suffix)
        if os.path.isfile(path):
            return path
    return None


def load_extension():
    """Imports tutel._C and returns it; raises ImportError with build instructions on failure.

    The extension is loaded from this package's own directory, so that another
    tutel checkout installed in the environment (an editable install, say)
    can never lend its _C to this one.
    """
    # _C links against PyTorch's shared libraries (libc10, libtorch); importing
    # torch first loads them, so `import tutel` works on its own.
    import torch  # noqa: F401

    package_dir = os.path.dirname(os.path.abspath(__file__))
    path = _extension_file(package_dir)
    if path is None:
        others = glob.glob(os.path.join(package_dir, "_C*.so")) + glob.glob(os.path.join(package_dir, "_C*.pyd"))
        reason = "tutel's compiled extension (tutel._C) is not built"
        if others:
            reason += f" for this Python (found only {os.path.basename(others[0])})"
        raise ImportError(reason + ".\n" + _HOW_TO_BUILD)
    name = __name__.rsplit(".", 1)[0] + "._C"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ImportError(
            f"tutel's compiled extension exists ({os.path.basename(path)}) but failed to load: {error}.\n"
            "This usually means it was built against a different PyTorch than the one installed now. "
            "Rebuild it:\n" + _HOW_TO_BUILD) from error
    sys.modules[name] = module
    return module
