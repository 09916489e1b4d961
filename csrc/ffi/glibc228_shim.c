/* Definitions for the two glibc symbols newer than 2.28 that gcc 12's libstdc++.a (built on a glibc-2.36 host)
 * references. Both are hidden: they bind only inside libflashjax.so and are never exported.
 *
 * __libc_single_threaded (glibc 2.32): libstdc++ (ext/atomicity.h) skips atomic read-modify-write ops when it is
 * non-zero. Keeping it 0 means "always assume threads", so every reference-count update stays atomic: the
 * behaviour of a libstdc++ built for a glibc without the variable. Never wrong, at most a few ns slower.
 *
 * arc4random (glibc 2.36): std::random_device's "arc4random" source. Same contract as glibc's (32 bits from the
 * kernel CSPRNG, never fails; glibc aborts if the kernel cannot supply them): getrandom(2) (glibc 2.25), then
 * /dev/urandom for kernels without getrandom, else abort.  flashjax itself never constructs a random_device; the
 * member random.o is linked only because cow-string-inst.o refers to random_device::_M_init.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/random.h>
#include <unistd.h>

__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

__attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t v;
  unsigned char *p = (unsigned char *)&v;
  size_t got = 0;
  while (got < sizeof v) {
    ssize_t n = getrandom(p + got, sizeof v - got, 0);
    if (n > 0) { got += (size_t)n; continue; }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == ENOSYS) break;
    abort();
  }
  if (got < sizeof v) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) abort();
    while (got < sizeof v) {
      ssize_t n = read(fd, p + got, sizeof v - got);
      if (n > 0) got += (size_t)n;
      else if (n < 0 && errno == EINTR) continue;
      else abort();
    }
    close(fd);
  }
  return v;
}
