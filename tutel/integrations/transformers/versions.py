"""The transformers releases this integration supports, and what each release declares.

transformers 5.7.0 is the first release whose model classes accept an experts implementation
registered in ``ExpertsInterface`` (5.0-5.6 check ``experts_implementation`` against a fixed list
of their own backends, so "tutel" could be registered but never chosen); the supported range runs
from there to the newest release the tests ran against.  ``check_supported`` refuses an older
release at ``import tutel.integrations.transformers`` with one error naming both versions.

The ``@use_experts_implementation`` decorator gained flags over the range; a release that does not
set one behaves as the value in ``LATER_FLAGS`` says (``implied_flags``).
"""
from typing import Dict

OLDEST = "5.7.0"
NEWEST_TESTED = "5.24.0"
# The requirement of the "transformers" extra (setup.py) and of the messages below.
REQUIREMENT = f"transformers>={OLDEST},<6"

# flag -> (first release whose decorator sets it, what older releases' code does instead)
LATER_FLAGS = {
    # before 5.18 no experts module was marked: every experts function treated ids >= num_experts as
    # choices other processes own, which tutel's routed experts skip whatever the flag says
    "_is_expert_parallel": ("5.18.0", False),
    # before 5.20 no experts class had a norm after each expert
    "has_post_expert_norm": ("5.20.0", False),
}


class UnsupportedTransformersVersion(ImportError):
    """The installed transformers is older than the first release the integration supports."""


def _release(version: str):
    from packaging.version import Version  # a requirement of transformers itself
    return Version(version)


def installed_version() -> str:
    """The version of the transformers that ``import transformers`` finds."""
    import transformers
    return str(getattr(transformers, "__version__", "unknown"))


def check_supported() -> str:
    """Returns the installed transformers version.

    Raises:
        UnsupportedTransformersVersion: transformers is older than ``OLDEST`` (or has no version).
        ImportError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f'tutel.integrations.transformers needs {REQUIREMENT}, which is not installed: '
                          f'pip install "{REQUIREMENT}"') from error
    version = installed_version()
    try:
        too_old = _release(version) < _release(OLDEST)
    except ValueError:  # not a release number at all
        too_old = True
    if too_old:
        raise UnsupportedTransformersVersion(
            f"tutel.integrations.transformers needs transformers >= {OLDEST} (the first release whose "
            f'experts_implementation accepts a registered implementation such as "tutel"), but transformers '
            f"{version} is installed ({getattr(transformers, '__file__', '?')}); upgrade it: "
            f'pip install "{REQUIREMENT}"')
    return version


def implied_flags(release: str) -> Dict[str, bool]:
    """The experts-decorator flags that transformers `release` does not set, each with the value
    that release's code implies (a flag the release sets must be on every experts module)."""
    return {flag: value for flag, (since, value) in LATER_FLAGS.items() if _release(release) < _release(since)}
