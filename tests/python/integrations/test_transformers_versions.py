"""The transformers releases the integration supports: one clear error at import for an older
release, the flags a release does not set read as that release's code implies, and the supported
range declared alike in the extra, the README and the integration pages."""
import os
import re
import subprocess
import sys

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")
import tutel.integrations.transformers as tutel_hf  # noqa: E402
from tutel.integrations.transformers import versions  # noqa: E402

from tiny_transformers_experts import make_inputs, make_pair  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EXACT = dict(rtol=1e-10, atol=1e-10)


def _import_with_transformers(tmp_path, version):
    """Imports the integration in a fresh process whose `transformers` is a stand-in of `version`."""
    package = tmp_path / "transformers"
    package.mkdir()
    (package / "__init__.py").write_text(f'__version__ = "{version}"\n')
    return subprocess.run([sys.executable, "-c", "import tutel.integrations.transformers"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))


@pytest.mark.parametrize("version", ["5.6.2"])  # the newest release below the range (each case is a fresh process)
def test_an_older_release_is_refused_at_import_naming_both_versions(tmp_path, version):
    result = _import_with_transformers(tmp_path, version)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("tutel.integrations.transformers.versions.UnsupportedTransformersVersion: "), \
        result.stderr
    assert f"transformers {version} is installed" in last_line and ">= 5.7.0" in last_line, last_line
    assert 'pip install "transformers>=5.7.0,<6"' in last_line
    assert result.stderr.count("Traceback") == 1, result.stderr  # one error, not one raised while handling another


def test_the_oldest_release_passes_the_check(tmp_path):
    # the stand-in has nothing else: the check passed when the import goes on to fail on a submodule
    result = _import_with_transformers(tmp_path, versions.OLDEST)
    assert "UnsupportedTransformersVersion" not in result.stderr and "No module named 'transformers." in result.stderr


def test_the_installed_release_is_in_the_range():
    from packaging.version import Version
    assert Version(versions.installed_version()) >= Version(versions.OLDEST)
    assert versions.check_supported() == versions.installed_version()


@pytest.mark.parametrize("release, implied", [
    ("5.7.0", {"has_post_expert_norm": False, "_is_expert_parallel": False}),
    ("5.17.0", {"has_post_expert_norm": False, "_is_expert_parallel": False}),
    ("5.18.0", {"has_post_expert_norm": False}),
    ("5.20.0", {}),
    ("5.24.0", {}),
])
def test_the_flags_each_release_implies(release, implied):
    assert versions.implied_flags(release) == implied


@pytest.mark.parametrize("release", ["5.17.0", "5.19.0"])
def test_a_module_without_the_flags_its_release_does_not_set_runs_as_that_release_implies(monkeypatch, release):
    from tutel.integrations.transformers import layout
    implied = versions.implied_flags(release)
    monkeypatch.setattr(layout, "_IMPLIED_FLAGS", implied)
    eager, ours = make_pair("mixtral")
    for flag in versions.LATER_FLAGS:  # as that release builds the module
        if flag in implied and hasattr(ours, flag):
            delattr(ours, flag)
        elif flag not in implied:
            setattr(ours, flag, False)
    layout_read = tutel_hf.read_layout(ours)
    assert layout_read.post_fn is None and layout_read.expert_parallel is False
    inputs = make_inputs(9, 2)
    with torch.no_grad():
        torch.testing.assert_close(ours(*inputs), eager(*inputs), **EXACT)
    for flag in set(versions.LATER_FLAGS) - set(implied):  # set by that release: a module without it is refused
        delattr(ours, flag)
        with pytest.raises(tutel_hf.UnsupportedExpertsLayout, match=rf"MixtralExperts \({flag}\): the flag is not set"):
            tutel_hf.read_layout(ours)
        setattr(ours, flag, False)


def test_the_supported_range_is_declared_in_the_extra_the_readme_and_the_pages():
    with open(os.path.join(REPO, "setup.py")) as handle:
        extra = re.search(r'"transformers": \["([^"]+)"\]', handle.read())
    assert extra and extra.group(1) == versions.REQUIREMENT == f"transformers>={versions.OLDEST},<6"
    for page in ("README.md", "docs/integrations/transformers.md", "docs/integrations/replace-moe-blocks.md"):
        with open(os.path.join(REPO, page)) as handle:
            text = handle.read()
        assert f"transformers {versions.OLDEST}" in text and versions.NEWEST_TESTED in text, page
    with open(os.path.join(REPO, "tests", "setup_env.sh")) as handle:  # the main run tests the newest
        assert f"transformers=={versions.NEWEST_TESTED}" in handle.read()
    with open(os.path.join(REPO, "tests", "integration", "transformers", "run.sh")) as handle:  # and CI the oldest
        assert f'TUTEL_TRANSFORMERS_OLDEST:-{versions.OLDEST}' in handle.read()
