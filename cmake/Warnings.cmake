# scaletrain_warnings: strict warnings for our own code only. Third-party headers (LibTorch,
# gloo, CLI11...) come in as system includes and are not held to these.
add_library(scaletrain_warnings INTERFACE)
target_compile_options(scaletrain_warnings INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow=local -Wnon-virtual-dtor -Wcast-align -Wunused
  -Woverloaded-virtual -Wformat=2 -Wimplicit-fallthrough)
if(SCALETRAIN_WERROR)
  target_compile_options(scaletrain_warnings INTERFACE -Werror)
endif()
