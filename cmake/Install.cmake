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
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/scaletrain
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
if(TARGET scaletrain_cli)
  install(TARGETS scaletrain_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  install(TARGETS scaletrain_tool RUNTIME DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/scaletrain)
endif()

set(SCALETRAIN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/scaletrain)
install(EXPORT scaletrainTargets NAMESPACE scaletrain:: DESTINATION ${SCALETRAIN_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/scaletrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/scaletrainConfig.cmake INSTALL_DESTINATION ${SCALETRAIN_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/scaletrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/scaletrainConfig.cmake
  ${PROJECT_BINARY_DIR}/scaletrainConfigVersion.cmake DESTINATION ${SCALETRAIN_CMAKE_DIR})
