# Unity builds for the targets built on LibTorch. Every file that includes LibTorch pays about
# 6 s of GCC's deferred template instantiation for the headers alone, precompiled header or not,
# however little code it holds: with ~115 such files that is most of a fresh build on two cores.
# A batch of files compiled as one unit pays it once. Files with their own compile options
# (the -O3 loops) are compiled alone, as CMake does for any file with source properties.
#
# SCALETRAIN_UNITY_BUILD=OFF compiles every file alone: for clang-tidy (which needs one compile
# command per file) and for an edit-compile loop on one file.
option(SCALETRAIN_UNITY_BUILD "Compile the LibTorch-based targets in batches of files" ON)

# scaletrain_unity(<target> <files per batch>)
function(scaletrain_unity target batch)
  if(SCALETRAIN_UNITY_BUILD)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${batch})
  endif()
endfunction()
