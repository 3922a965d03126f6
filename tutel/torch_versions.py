"""The PyTorch releases tutel supports: from the oldest release on which its whole test suite passes
to the newest one it was tested on.

This module is the one place that says so: setup.py's requirement, the test scripts (which install
both ends) and ``import tutel`` read it, and a test holds README.md and docs/getting-started.md to
it.  ``import tutel`` refuses an older PyTorch with one error naming both versions
(``check_supported``); a release newer than ``NEWEST_TESTED`` is allowed, untested.

It imports nothing but the standard library, so scripts can read the versions without importing torch.
"""
import re
from typing import Optional, Tuple

# The floor: the custom-operator API (torch.library.custom_op, register_fake) that tutel's Python
# operators are registered with first ships in 2.4; the whole suite passes on 2.4.1.
OLDEST = "2.6.0"
NEWEST_TESTED = "2.15.0"
# The requirement setup.py declares and the messages below name.
REQUIREMENT = f"torch>={OLDEST}"


class UnsupportedTorchVersion(ImportError):
    """The installed PyTorch is older than the oldest release tutel supports."""


def release(version: str) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of a PyTorch version string ("2.6.0+cpu" -> (2, 6, 0); a missing patch
    is 0; pre-release and local labels are ignored), or None when it starts with no release number."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def is_supported(version: str) -> bool:
    """Whether PyTorch `version` is at least ``OLDEST`` (compared as numbers: 2.10 is newer than 2.6);
    a string that is no release number at all is not supported."""
    found = release(version)
    return found is not None and found >= release(OLDEST)


def check_supported(version: Optional[str] = None) -> str:
    """Returns the installed PyTorch's version (or `version`, when given).

    Raises:
        UnsupportedTorchVersion: that release is older than ``OLDEST``.
    """
    import torch
    found = str(torch.__version__ if version is None else version)
    if not is_supported(found):
        raise UnsupportedTorchVersion(
            f"tutel needs PyTorch >= {OLDEST} (tested from {OLDEST} to {NEWEST_TESTED}), but torch {found} is "
            f"installed ({getattr(torch, '__file__', '?')}); upgrade it (pip install \"{REQUIREMENT}\"), then "
            "rebuild tutel against it: pip install --no-build-isolation .")
    return found
