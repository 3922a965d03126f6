"""A minimal NVRTC binding through ctypes, for compiling kernels/*.cu without a GPU.

Independent of tutel's own (C++) loader on purpose: the compile test should
not depend on the code it checks.  The library is found with
tutel.cuda_libraries, like the extension does at run time.
"""
import ctypes
import glob
import os
import re
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "kernels")


def kernel_variants(source_text: str) -> List[Optional[str]]:
    """The -D defines a kernels/*.cu file is compiled with, from its `// variants:` line."""
    match = re.search(r"^// variants: (.*)$", source_text, re.MULTILINE)
    if match is None:
        raise ValueError("kernel source has no `// variants:` line")
    names = match.group(1).split()
    return [None] if names == ["(none)"] else names


def kernel_files() -> Tuple[Dict[str, str], Dict[str, str]]:
    """({name: text} of the .cu programs, {name: text} of the headers they may include)."""
    programs, headers = {}, {}
    for path in sorted(glob.glob(os.path.join(KERNELS, "*"))):
        name = os.path.basename(path)
        with open(path) as handle:
            text = handle.read()
        (programs if name.endswith(".cu") else headers)[name] = text
    return programs, headers


_uselocale = ctypes.CDLL(None).uselocale  # the C library's: the calling thread's locale (None: just ask)
_uselocale.restype, _uselocale.argtypes = ctypes.c_void_p, [ctypes.c_void_p]


class Nvrtc:
    """The few NVRTC calls the tests need."""

    def __init__(self, library_path: str):
        directory = os.path.dirname(library_path)
        # NVRTC opens its builtins library by name at compile time.
        for builtins in glob.glob(os.path.join(directory, "libnvrtc-builtins.so.*")):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(library_path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> Tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        return major.value, minor.value

    def supported_archs(self) -> List[int]:
        count = ctypes.c_int()
        self._check(self.lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)))
        archs = (ctypes.c_int * count.value)()
        self._check(self.lib.nvrtcGetSupportedArchs(archs))
        return list(archs)

    def compile(self, source: str, name: str, headers: Dict[str, str], options: List[str]) -> Tuple[bool, str, bytes]:
        """(success, log, cubin) for one program."""
        program = ctypes.c_void_p()
        header_texts = (ctypes.c_char_p * len(headers))(*[text.encode() for text in headers.values()])
        header_names = (ctypes.c_char_p * len(headers))(*[key.encode() for key in headers])
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(),
                                                len(headers), header_texts, header_names))
        # NVRTC 12 (PyTorch 2.6's wheel) switches the calling thread to the "C" locale (uselocale) when
        # it reports an error, which turns Python's default text encoding to ASCII for the rest of the
        # thread: the thread's locale is put back.
        saved_locale = _uselocale(None)
        try:
            encoded = (ctypes.c_char_p * len(options))(*[option.encode() for option in options])
            result = self.lib.nvrtcCompileProgram(program, len(options), encoded)
            _uselocale(saved_locale)
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)))
            log = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetProgramLog(program, log))
            cubin = b""
            if result == 0:
                self._check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(size)))
                image = ctypes.create_string_buffer(size.value)
                self._check(self.lib.nvrtcGetCUBIN(program, image))
                cubin = image.raw
            return result == 0, log.value.decode(errors="replace"), cubin
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NVRTC call failed: {self.lib.nvrtcGetErrorString(result).decode()}")
