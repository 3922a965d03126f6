// The files of kernels/ (CUDA sources, their headers, the NVRTC options),
// embedded into the extension: setup.py generates their definition at build
// time with csrc/cuda/embed_kernels.py, so the kernels are compiled from the
// very text the extension was built with and need no files at run time.
#pragma once

#include <cstddef>

namespace tutel {
namespace cuda {

struct EmbeddedFile {
  const char* name;  // file name inside kernels/, e.g. "dispatch.cu"
  const char* text;
  size_t size;
};

extern const EmbeddedFile kEmbeddedKernelFiles[];
extern const size_t kEmbeddedKernelFileCount;

}  // namespace cuda
}  // namespace tutel
