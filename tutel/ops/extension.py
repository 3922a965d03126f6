"""Loads the compiled extension (tutel._C), which registers torch.ops.tutel.*.

tutel.ops is the one package that reaches the extension: every other module gets the compiled
operators and functions through tutel.ops (tests/python/import_layers.py checks it).
"""
import glob
import os
from types import ModuleType

# tutel/, where the extension is built (this file lives in tutel/ops/).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HOW_TO_BUILD = (
    "Build it against the installed PyTorch from the source tree with\n"
    "    pip install --no-build-isolation .          (or: pip install --no-build-isolation -e .)\n"
    "or, for an in-place build, `python setup.py build_ext --inplace`."
)


def load_extension() -> ModuleType:
    """Imports tutel._C and returns it; raises ImportError with build instructions on failure."""
    import torch  # noqa: F401  (loads libtorch / libc10, which _C links against)

    try:
        from .. import _C
        # An editable install of another checkout can resolve tutel._C to that
        # checkout's build, whose operators need not match this Python code.
        if os.path.dirname(os.path.abspath(_C.__file__)) != _PACKAGE_DIR:
            raise ImportError(f"tutel._C resolved to {_C.__file__}, outside this package ({_PACKAGE_DIR})")
    except ImportError as error:
        built = glob.glob(os.path.join(_PACKAGE_DIR, "_C*.so")) + glob.glob(
            os.path.join(_PACKAGE_DIR, "_C*.pyd")
        )
        if built:
            reason = (
                f"tutel's compiled extension exists ({os.path.basename(built[0])}) but failed to load: "
                f"{error}.\nThis usually means it was built against a different PyTorch than the one "
                "installed now. Rebuild it:\n"
            )
        else:
            reason = "tutel's compiled extension (tutel._C) is not built.\n"
        raise ImportError(reason + _HOW_TO_BUILD) from error
    return _C


__all__ = ["load_extension"]
