# Included before find_package(Torch) by HyperParallel and by its installed package config.
#
# A CUDA build of LibTorch (PyPI's default wheel) makes Torch's CMake config enable the
# CUDA language and look for the toolkit (nvcc on PATH or CUDAToolkit_ROOT). HyperParallel
# has no CUDA sources, it reaches CUDA only through LibTorch's C++ API; so CUDA is set up
# the way that needs no GPU at configure time: the CUDA dialect CMake >= 3.22 knows for
# nvcc, and the architecture list given instead of probed on the machine's GPUs
# (TORCH_CUDA_ARCH_LIST, as for any Torch extension, overrides it).
if(NOT DEFINED CMAKE_CUDA_STANDARD)
  set(CMAKE_CUDA_STANDARD 17)
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST Common)
endif()
