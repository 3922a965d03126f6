"""`import tutel` loads this package's own extension, in a fresh interpreter."""
import glob
import os
import shutil
import subprocess
import sys

import tutel

PACKAGE_DIR = os.path.dirname(os.path.abspath(tutel.__file__))


def run_python(code: str, cwd, pythonpath: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)


def test_import_tutel_first_thing(tmp_path):
    """tutel._C links libtorch without an rpath: `import tutel` must load PyTorch itself."""
    result = run_python("import tutel, tutel.moe, torch; print(torch.ops.tutel.route_topk)", tmp_path,
                        os.path.dirname(PACKAGE_DIR))
    assert result.returncode == 0, result.stderr


def test_extension_found_outside_the_package_is_refused(tmp_path):
    """A finder (such as another checkout's editable install) offering a foreign tutel._C is not obeyed."""
    shutil.copytree(PACKAGE_DIR, tmp_path / "tutel", ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    foreign = glob.glob(os.path.join(PACKAGE_DIR, "_C*.so"))[0]
    code = (
        "import importlib.util, sys\n"
        "class Elsewhere:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        return importlib.util.spec_from_file_location(name, {foreign!r}) if name == 'tutel._C' else None\n"
        "sys.meta_path.append(Elsewhere())\n"
        "import tutel\n"
    )
    result = run_python(code, tmp_path, str(tmp_path))
    assert result.returncode != 0
    assert "tutel._C resolved to" in result.stderr and "outside this package" in result.stderr
    assert "tutel's compiled extension (tutel._C) is not built" in result.stderr
