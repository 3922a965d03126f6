"""The demo sets up only what it uses, the test command the rest, and README.md says which installs what.

tests/setup_build.sh (sourced by examples/run_demo.sh) installs what building tutel and the demo
need; tests/setup_env.sh (sourced by tests/run_all.sh) adds the test tools.  README.md's first
paragraph names both lists; these tests hold the scripts and that paragraph to each other.
"""
import os
import re

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _read(path):
    with open(os.path.join(REPO, path)) as handle:
        return handle.read()


def _installed_by(script):
    """The pip (pinned) and apt packages a set-up script installs itself (not through what it sources)."""
    text = re.sub(r"^\s*#.*\n", "", re.sub(r"\\\n\s*", " ", _read(script)), flags=re.M)
    pip = [spec.split("==")[0] for line in re.findall(r"^install_pinned (.+)$", text, re.M) for spec in line.split()]
    apt = re.findall(r"install_apt ([\w+-]+)", text) + re.findall(r"need_apt\+=\(([\w+-]+)\)", text)
    return pip, apt


def _readme_paragraph(start, end):
    text = " ".join(_read("README.md").split())
    return text[text.index(start):text.index(end)]


def test_the_demo_sources_only_the_build_set_up():
    demo = _read("examples/run_demo.sh")
    assert "source tests/setup_build.sh" in demo and "setup_env.sh" not in demo
    assert "source tests/setup_build.sh" in _read("tests/setup_env.sh")
    assert "source tests/setup_env.sh" in _read("tests/run_all.sh")


def test_the_demo_installs_no_test_tool():
    demo_pip, demo_apt = _installed_by("tests/setup_build.sh")
    test_pip, test_apt = _installed_by("tests/setup_env.sh")
    assert set(demo_pip) >= {"scikit-learn", "ninja"} and "g++" in demo_apt
    assert {"pytest", "hypothesis", "transformers", "nvidia-cuda-nvrtc"} <= set(test_pip)
    assert {"cmake", "libgtest-dev", "openmpi-bin"} <= set(test_apt)
    assert not set(demo_pip) & set(test_pip) and not set(demo_apt) & set(test_apt)


def test_readme_names_what_each_command_installs():
    demo = _readme_paragraph("The demo installs", "The test command installs")
    tests = _readme_paragraph("The test command installs", "Every duration")
    for package in sum(_installed_by("tests/setup_build.sh"), ["torch"]):
        assert package in demo, f"README.md does not say that the demo installs {package}"
    for package in sum(_installed_by("tests/setup_env.sh"), []):
        name = "NVRTC" if package.startswith("nvidia-cuda") else package
        assert name in tests and package not in demo, f"README.md misplaces the test tool {package}"
