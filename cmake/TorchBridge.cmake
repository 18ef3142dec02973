# The torch bridge (gpumem._bridge) is built against the torch installed in the Python that builds
# gpumem, and only when that torch has CUDA. Paths come from torch itself rather than its CMake
# package, which would pull in a full CUDA toolchain search.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import torch, os, torch.utils.cpp_extension as e; print(torch.__version__); print(torch.version.cuda or ''); print(','.join(e.include_paths())); print(os.path.join(os.path.dirname(torch.__file__), 'lib')); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE GPUMEM_TORCH_INFO
  ERROR_VARIABLE GPUMEM_TORCH_ERROR
  RESULT_VARIABLE GPUMEM_TORCH_RESULT
  OUTPUT_STRIP_TRAILING_WHITESPACE)

# Every .cpp of csrc/torch_bridge/ (as the core's sources are globbed): a file left out of a list
# links into an extension that fails to load with an undefined symbol, on the GPU machine only.
file(GLOB GPUMEM_BRIDGE_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/csrc/torch_bridge/*.cpp)

if(NOT GPUMEM_TORCH_RESULT EQUAL 0)
  message(STATUS "gpumem: torch bridge skipped: torch is not importable by ${Python_EXECUTABLE}")
elseif(NOT GPUMEM_CUDA_INCLUDE)
  message(STATUS "gpumem: torch bridge skipped: the CUDA toolkit headers were not found")
else()
  string(REPLACE "\n" ";" GPUMEM_TORCH_INFO "${GPUMEM_TORCH_INFO}")
  list(GET GPUMEM_TORCH_INFO 0 GPUMEM_TORCH_VERSION)
  list(GET GPUMEM_TORCH_INFO 1 GPUMEM_TORCH_CUDA)
  if(GPUMEM_TORCH_CUDA STREQUAL "")
    message(STATUS "gpumem: torch bridge skipped: torch ${GPUMEM_TORCH_VERSION} is a CPU-only build")
  else()
    list(GET GPUMEM_TORCH_INFO 2 GPUMEM_TORCH_INCLUDES)
    list(GET GPUMEM_TORCH_INFO 3 GPUMEM_TORCH_LIBDIR)
    list(GET GPUMEM_TORCH_INFO 4 GPUMEM_TORCH_ABI)
    string(REPLACE "," ";" GPUMEM_TORCH_INCLUDES "${GPUMEM_TORCH_INCLUDES}")
    message(STATUS "gpumem: building the torch bridge against torch ${GPUMEM_TORCH_VERSION} (CUDA ${GPUMEM_TORCH_CUDA})")
    # Compiled with torch's bundled pybind11 (first in torch's include paths), not the pip one, so
    # that objects of torch's registered types (its allocator handles) pass between the modules.
    Python_add_library(_bridge MODULE WITH_SOABI ${GPUMEM_BRIDGE_SOURCES})
    set_target_properties(_bridge PROPERTIES CXX_VISIBILITY_PRESET hidden)
    # torch's headers need C++20 from 2.12 on (std::strong_ordering in c10); 2.11 and older build
    # with the project's C++17, as measured on the GPU machine.
    string(REGEX MATCH "^[0-9]+\\.[0-9]+" GPUMEM_TORCH_MAJOR_MINOR "${GPUMEM_TORCH_VERSION}")
    if(GPUMEM_TORCH_MAJOR_MINOR VERSION_GREATER_EQUAL 2.12)
      set_target_properties(_bridge PROPERTIES CXX_STANDARD 20)
    endif()
    target_include_directories(_bridge PRIVATE ${GPUMEM_TORCH_INCLUDES} ${GPUMEM_CUDA_INCLUDE})
    target_compile_definitions(_bridge PRIVATE _GLIBCXX_USE_CXX11_ABI=${GPUMEM_TORCH_ABI} USE_CUDA=1)
    target_link_directories(_bridge PRIVATE ${GPUMEM_TORCH_LIBDIR})
    # The CUDA runtime torch itself loaded (same soname) resolves the bridge's cuda* calls.
    find_package(CUDAToolkit REQUIRED)
    target_link_libraries(_bridge PRIVATE gpumem_core c10 c10_cuda torch torch_cpu torch_cuda torch_python
                                          CUDA::cudart)
    # Found at run time next to torch's own libraries, which torch has already loaded.
    set_target_properties(_bridge PROPERTIES INSTALL_RPATH "${GPUMEM_TORCH_LIBDIR}")
    install(TARGETS _bridge LIBRARY DESTINATION gpumem)
  endif()
endif()
