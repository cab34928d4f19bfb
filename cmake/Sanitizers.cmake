# -DSCALETRAIN_SANITIZE=ON builds everything with ASan + UBSan (make asan-test).
# cmake/sanitizer_defaults.cpp is added to every executable (see src/CMakeLists.txt).
if(SCALETRAIN_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer
                      -fno-sanitize-recover=undefined -fno-sanitize=vptr)
  add_link_options(-fsanitize=address,undefined)
endif()
