# FLASHJAX_MANYLINUX_LINK: link libflashjax.so against glibc 2.28's ABI, so that its wheel is manylinux_2_28.
# Everything is still compiled by nvcc + the host gcc as before; only the final link differs:
#   -L<glibc228 dir>: -lc -lm -ldl -lpthread -lrt resolve to zig's glibc-2.28 ABI stubs (version nodes <= 2.28) and
#                     2.28's libc_nonshared.a (fstat64 -> __fxstat64 ...); -lgcc_eh (from -static-libgcc) to gcc 10's
#                     unwinder, which uses dl_iterate_phdr instead of _dl_find_object (glibc 2.35).
#   glibc228_shim.c:  hidden __libc_single_threaded (= 0: always atomic) and arc4random (getrandom), which gcc 12's
#                     libstdc++.a references.
#   -lpthread -lrt:   in 2.28 pthread_*/sem_* live in libpthread.so.0 and shm_open/shm_unlink in librt.so.1.
# A post-link check fails the build if any GLIBC_x.y above 2.28 or an unexpected NEEDED entry slipped in.
option(FLASHJAX_MANYLINUX_LINK "link libflashjax.so against glibc 2.28's ABI (manylinux_2_28 wheels)" OFF)
if(FLASHJAX_MANYLINUX_LINK)
  enable_language(C)
  # Made at configure time unless given (tools/make_glibc228_libdir.sh needs ziglang and deb.debian.org).
  if(NOT FLASHJAX_GLIBC228_DIR)
    set(FLASHJAX_GLIBC228_DIR "${CMAKE_BINARY_DIR}/glibc228")
  endif()
  if(NOT EXISTS "${FLASHJAX_GLIBC228_DIR}/libc.so.6")
    execute_process(COMMAND "${CMAKE_COMMAND}" -E env "ZIG_PYTHON=${Python3_EXECUTABLE}"
                            "${PROJECT_SOURCE_DIR}/tools/make_glibc228_libdir.sh" "${FLASHJAX_GLIBC228_DIR}"
                    RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "flashjax: tools/make_glibc228_libdir.sh failed (needs: pip install ziglang; curl; dpkg-deb)")
    endif()
  endif()
  # Linker scripts that send -lc -lm ... to the stubs: written here, with this build's absolute paths.
  file(WRITE "${FLASHJAX_GLIBC228_DIR}/libc.so" "GROUP ( ${FLASHJAX_GLIBC228_DIR}/libc.so.6 \
${FLASHJAX_GLIBC228_DIR}/libc_nonshared.a AS_NEEDED ( ${FLASHJAX_GLIBC228_DIR}/ld-linux-x86-64.so.2 ) )\n")
  foreach(pair m:libm.so.6 pthread:libpthread.so.0 dl:libdl.so.2 rt:librt.so.1)
    string(REPLACE ":" ";" pair "${pair}")
    list(GET pair 0 short)
    list(GET pair 1 file)
    file(WRITE "${FLASHJAX_GLIBC228_DIR}/lib${short}.so" "GROUP ( ${FLASHJAX_GLIBC228_DIR}/${file} )\n")
  endforeach()
  target_sources(flashjax PRIVATE csrc/ffi/glibc228_shim.c)
  target_link_options(flashjax PRIVATE "-L${FLASHJAX_GLIBC228_DIR}")
  target_link_libraries(flashjax PRIVATE pthread rt)
  add_custom_command(TARGET flashjax POST_BUILD VERBATIM COMMAND sh -c
    "objdump -T \"$0\" | grep -oE 'GLIBC_2\\.(29|[3-9][0-9])[.0-9]*' | sort -u | grep . && { echo \"flashjax: $0 needs glibc > 2.28\" >&2; exit 1; }; \
     readelf -d \"$0\" | sed -n 's/.*(NEEDED).*\\[\\(.*\\)\\]/\\1/p' | grep -vxE 'lib(c|m|dl|pthread|rt)\\.so\\.[0-9]+|ld-linux-x86-64\\.so\\.2' && { echo \"flashjax: $0 has unexpected NEEDED entries\" >&2; exit 1; }; exit 0"
    "$<TARGET_FILE:flashjax>")
endif()
