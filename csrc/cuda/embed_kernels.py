"""Generates the C++ file that embeds the files of kernels/ into the extension.

setup.py runs it at build time, writing into the build directory (the output
is not committed).  Each file becomes a raw string literal in the table that
csrc/cuda/kernel_sources.h declares.

    python csrc/cuda/embed_kernels.py KERNEL_DIR OUTPUT.cpp
"""
import os
import sys

_DELIMITER = "tutel_kernel"


def kernel_file_names(kernel_dir: str) -> list:
    """The embedded files: everything in kernel_dir except hidden files, sorted."""
    return sorted(name for name in os.listdir(kernel_dir)
                  if not name.startswith(".") and os.path.isfile(os.path.join(kernel_dir, name)))


def render(kernel_dir: str) -> str:
    """The C++ source defining kEmbeddedKernelFiles for the files in kernel_dir."""
    lines = ["// Generated from kernels/ by csrc/cuda/embed_kernels.py at build time; do not edit.",
             '#include "cuda/kernel_sources.h"', "", "namespace tutel {", "namespace cuda {", ""]
    entries = []
    for index, name in enumerate(kernel_file_names(kernel_dir)):
        with open(os.path.join(kernel_dir, name), encoding="utf-8") as handle:
            text = handle.read()
        if f"){_DELIMITER}\"" in text:
            raise ValueError(f"kernels/{name} contains the raw-string delimiter ){_DELIMITER}\"")
        lines.append(f'static const char kFile{index}[] = R"{_DELIMITER}({text}){_DELIMITER}";')
        entries.append(f'    {{"{name}", kFile{index}, sizeof(kFile{index}) - 1}},')
    lines += ["", "const EmbeddedFile kEmbeddedKernelFiles[] = {", *entries, "};",
              f"const size_t kEmbeddedKernelFileCount = {len(entries)};", "",
              "}  // namespace cuda", "}  // namespace tutel", ""]
    return "\n".join(lines)


def write_if_changed(kernel_dir: str, output_path: str) -> None:
    """Writes the generated file, leaving it untouched (no rebuild) when it is up to date."""
    text = render(kernel_dir)
    if os.path.exists(output_path):
        with open(output_path, encoding="utf-8") as handle:
            if handle.read() == text:
                return
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with open(output_path, "w", encoding="utf-8") as handle:
        handle.write(text)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    write_if_changed(sys.argv[1], sys.argv[2])
