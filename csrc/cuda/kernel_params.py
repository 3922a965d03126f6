"""Generates csrc/cuda/kernel_params.h: every kernel in kernels/ with its file and its parameter list
as the host code must pass it to cuLaunchKernel.

The driver copies each parameter's size from the address the host gives, so an argument of another
size (an int for an i64, a bool for an int) is read wrong on the GPU and nothing on a machine
without one would notice.  The host code names each kernel by its entry here
(ops::cuda_ops::Kernel<cuda::kernels::NAME>), and cuda::launch_kernel checks the arguments' types
against its list at compile time.

Each kernel file is run through the C preprocessor (the kernels declare some of their entry points
with macros) with each variant option the host builds it with (TUTEL_DTYPE_*, TUTEL_MASK_*, or
none); every variant must give the same lists.  A pointer parameter is cuda::AnyPointer (the
element type is the variant's: the host passes void pointers); i64 is int64_t; int, unsigned,
float, double and the structs of kernels/kernel_abi.h and expert_abi.h are themselves.

    python csrc/cuda/kernel_params.py            # rewrites csrc/cuda/kernel_params.h
    python csrc/cuda/kernel_params.py --check    # exit 1 when the header is not what the kernels say
"""
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "kernels")
HEADER = os.path.join(ROOT, "csrc", "cuda", "kernel_params.h")
# The variant options of csrc/cuda/launch_plan.cpp, and none.
VARIANTS = (None, "TUTEL_DTYPE_FLOAT32", "TUTEL_DTYPE_FLOAT64", "TUTEL_DTYPE_FLOAT16", "TUTEL_DTYPE_BFLOAT16",
            "TUTEL_MASK_BOOL", "TUTEL_MASK_UINT8", "TUTEL_MASK_INT8", "TUTEL_MASK_INT16", "TUTEL_MASK_INT32",
            "TUTEL_MASK_INT64", "TUTEL_MASK_FLOAT32", "TUTEL_MASK_FLOAT64")
SCALARS = {"i64": "int64_t", "int": "int", "unsigned": "unsigned", "float": "float", "double": "double"}
STRUCT = re.compile(r"(?:struct\s+)?(Tutel\w+)")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
                     r"(\w+)\s*\(([^)]*)\)")


def _preprocessed(path: str, variant) -> str:
    """`path` after the C preprocessor with `variant` defined; None where the file refuses it."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("cpp")
    if compiler is None:
        raise RuntimeError("kernel_params.py needs a C preprocessor (g++ or cpp)")
    command = [compiler, "-E", "-P", "-x", "c++", f"-I{KERNELS}"] + ([f"-D{variant}"] if variant else []) + [path]
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def parameter_kind(declaration: str, where: str) -> str:
    """The C++ type the host passes for one kernel parameter declaration (`const int* ends`)."""
    text = " ".join(declaration.replace("__restrict__", " ").split())
    if "*" in text:
        return "AnyPointer"
    type_words = text.rsplit(" ", 1)[0].replace("const ", "").strip()
    if type_words in SCALARS:
        return SCALARS[type_words]
    struct = STRUCT.fullmatch(type_words)
    if struct:
        return struct.group(1)
    raise ValueError(f"{where}: parameter `{declaration}` has a type the host cannot name "
                     f"(allowed: pointers, {', '.join(SCALARS)}, the Tutel* structs)")


def kernel_parameters(path: str) -> Dict[str, List[str]]:
    """{kernel: [host type of each parameter]} of one kernel file, the same under every variant."""
    name = os.path.basename(path)
    found = None
    for variant in VARIANTS:
        text = _preprocessed(path, variant)
        if text is None:
            continue
        kernels = {match.group(1): [parameter_kind(p, f"kernels/{name}: {match.group(1)}")
                                    for p in match.group(2).split(",") if p.strip()]
                   for match in _KERNEL.finditer(text)}
        if found is not None and kernels != found:
            raise ValueError(f"kernels/{name}: the kernels' parameters differ between variants ({variant})")
        found = kernels
    if found is None:
        raise ValueError(f"kernels/{name}: no variant option preprocesses it")
    return found


def all_kernels() -> List[Tuple[str, str, List[str]]]:
    """(file, kernel, host types) of every kernel in kernels/, by file and then by name."""
    rows = []
    for name in sorted(os.listdir(KERNELS)):
        if name.endswith(".cu"):
            for kernel, kinds in sorted(kernel_parameters(os.path.join(KERNELS, name)).items()):
                rows.append((name, kernel, kinds))
    return rows


def render() -> str:
    lines = ["// Generated from kernels/*.cu by csrc/cuda/kernel_params.py; do not edit (a test keeps it current).",
             "// Each kernel: its file, its name and its parameters as the host passes them to cuLaunchKernel",
             "// (cuda::launch_kernel checks a launch's arguments against them at compile time).",
             "#pragma once", "", "#include <cstdint>", "", '#include "../../kernels/expert_abi.h"',
             '#include "../../kernels/kernel_abi.h"', '#include "kernel_param_kinds.h"', "",
             "namespace tutel {", "namespace cuda {", "namespace kernels {", ""]
    current = None
    for file_name, kernel, kinds in all_kernels():
        if file_name != current:
            if current is not None:
                lines.append("")
            lines.append(f"// kernels/{file_name}")
            current = file_name
        lines += [f"struct {kernel} {{",
                  f'  static constexpr const char* file = "{file_name}";',
                  f'  static constexpr const char* function = "{kernel}";',
                  f"  using params = KernelParams<{', '.join(kinds)}>;",
                  "};"]
    lines += ["", "}  // namespace kernels", "}  // namespace cuda", "}  // namespace tutel", ""]
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    text = render()
    if argv == ["--check"]:
        with open(HEADER) as handle:
            if handle.read() != text:
                print(f"{os.path.relpath(HEADER, ROOT)} is out of date: run python csrc/cuda/kernel_params.py")
                return 1
        return 0
    if argv:
        print(__doc__)
        return 2
    with open(HEADER, "w") as handle:
        handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
