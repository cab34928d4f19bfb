# `cmake --install BUILD --prefix PREFIX`: the library, its headers and a CMake package, so that a
# project of its own builds against scaletrain with
#   find_package(scaletrain 0.1 REQUIRED)        # -DCMAKE_PREFIX_PATH=PREFIX
#   target_link_libraries(app PRIVATE scaletrain::scaletrain)
# (docs/library.md). The tool, when built, is installed too: the front `scaletrain` in bin/, the
# full tool it hands subcommands to in libexec/scaletrain/ (Note [Front] in cli/commands.h).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS scaletrain EXPORT scaletrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET scaletrain_nccl)  # opened by the library from its own folder
  install(TARGETS scaletrain_nccl LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/scaletrain
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
if(TARGET scaletrain_cli)
  install(TARGETS scaletrain_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(TARGETS scaletrain_tool RUNTIME DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/scaletrain)
endif()

set(SCALETRAIN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/scaletrain)
# A relocatable package: the libraries that LibTorch's config lists by absolute path (c10,
# c10_cuda, nvrtc) are this build's and stay in its build interface; the installed config adds
# those of the LibTorch the consumer finds (scaletrainConfig.cmake.in). Torch's targets are
# exported by name. (Regression: Install.RelocatedPrefixWithBuildTreeGone.)
get_target_property(_scaletrain_links scaletrain INTERFACE_LINK_LIBRARIES)
set(_scaletrain_exported_links)
foreach(_l IN LISTS _scaletrain_links)
  if(IS_ABSOLUTE "${_l}")
    list(APPEND _scaletrain_exported_links "$<BUILD_INTERFACE:${_l}>")
  else()
    list(APPEND _scaletrain_exported_links "${_l}")
  endif()
endforeach()
set_property(TARGET scaletrain PROPERTY INTERFACE_LINK_LIBRARIES "${_scaletrain_exported_links}")
install(EXPORT scaletrainTargets NAMESPACE scaletrain:: DESTINATION ${SCALETRAIN_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/scaletrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/scaletrainConfig.cmake INSTALL_DESTINATION ${SCALETRAIN_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/scaletrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/scaletrainConfig.cmake
  ${PROJECT_BINARY_DIR}/scaletrainConfigVersion.cmake DESTINATION ${SCALETRAIN_CMAKE_DIR})
