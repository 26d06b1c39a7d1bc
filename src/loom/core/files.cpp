#include "loom/core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loom/core/error.h"
#include "loom/core/strings.h"

namespace loom {
namespace {

// Closes a descriptor on every way out.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

// What a file that is not a regular one is, for errors.
const char* file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

void fail_not_regular_file(const std::string& who, unsigned mode) {
  if (S_ISDIR(mode)) fail_usage(who, " is a directory, not a file; point it at a file");
  fail_usage(who, " is ", file_kind(mode), ", not a regular file: reading it could block or never end; ",
             "point it at a regular file, a directory of them or a glob");
}

int open_regular_file(const std::string& path, const std::string& what) {
  // A plain open() of a FIFO waits for a writer, forever if none comes; O_NONBLOCK returns at
  // once, and fstat() on the descriptor (not the name, which could change in between) decides.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const std::string why = errno_text();
    // A socket cannot be opened at all (ENXIO): say what it is rather than "no such device".
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) fail_not_regular_file(c10::str(what, " '", path, "'"), st.st_mode);
    fail("cannot read ", what, " '", path, "': ", why);
  }
  FdGuard guard{fd};
  struct stat st {};
  LOOM_REQUIRE(::fstat(fd, &st) == 0, "cannot read ", what, " '", path, "': ", errno_text());
  if (!S_ISREG(st.st_mode)) fail_not_regular_file(c10::str(what, " '", path, "'"), st.st_mode);
  // Reads of a regular file never block anyway; blocking mode is restored so none can return EAGAIN.
  const int flags = ::fcntl(fd, F_GETFL);
  LOOM_REQUIRE(flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0, "cannot read ", what, " '", path,
               "': ", errno_text());
  guard.fd = -1;
  return fd;
}

}  // namespace loom
