#include "loom/train/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <string>

#include "loom/core/error.h"
#include "loom/core/strings.h"

namespace loom::train {
namespace fs = std::filesystem;

namespace {

std::string read_all(int fd) {
  std::string text;
  char buf[512];
  ssize_t n;
  if (lseek(fd, 0, SEEK_SET) != 0) return text;
  while ((n = read(fd, buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

std::string holder_description() {
  char host[256] = "unknown";
  gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  return c10::str("pid ", getpid(), " on host ", host, ", started ", when);
}

}  // namespace

RunFolderLock::RunFolderLock(const fs::path& folder, const char* setting)
    : path_(folder / ".loom.lock") {
  std::error_code ec;
  fs::create_directories(folder, ec);
  LOOM_REQUIRE_USAGE(!ec, "cannot create ", setting, " '", folder.string(), "': ", ec.message(),
                     "; set ", setting, " to a writable path");
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  LOOM_REQUIRE_USAGE(fd_ >= 0, "cannot create '", path_.string(), "': ", std::strerror(errno),
                     "; set ", setting, " to a writable path");
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder = err == EWOULDBLOCK ? read_all(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK) {
      fail_usage("cannot lock '", path_.string(), "': ", std::strerror(err), "; set ", setting,
                 " to a folder on a file system that supports locks");
    }
    fail_usage(setting, " '", folder.string(), "' is in use by another Loom run (",
               holder.empty() ? std::string("holder unknown") : holder,
               "); wait for it to finish or set ", setting, " to another folder");
  }
  const std::string me = holder_description() + "\n";
  if (ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] ssize_t n = pwrite(fd_, me.data(), me.size(), 0);
  }
}

RunFolderLock::~RunFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // closing drops the flock
}

void require_writable_folder(const fs::path& folder, int rank, const char* what) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  LOOM_REQUIRE_USAGE(!ec, "cannot create ", what, " '", folder.string(), "': ", ec.message(),
                     "; point it at a writable folder");
  const fs::path probe = folder / c10::str(".write-test-rank", rank);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = errno;
  if (fd >= 0) {
    const bool wrote = ::write(fd, "ok\n", 3) == 3;
    const int werr = errno;
    ::close(fd);
    fs::remove(probe, ec);
    LOOM_REQUIRE_USAGE(wrote, "cannot write into ", what, " '", folder.string(), "': ",
                       std::strerror(werr), "; free space or point it at another folder");
    return;
  }
  fail_usage(what, " '", folder.string(), "' is not writable: ", std::strerror(err),
             "; fix its permissions or point it at a writable folder");
}

void write_file_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_REQUIRE(fd >= 0, "cannot write '", path.string(), "': cannot create '", tmp.string(), "': ",
               errno_text(), "; free space in job.dump_folder or point it at a writable folder");
  size_t done = 0;
  int err = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;  // a write of 0 bytes: nothing more fits
      break;
    }
    done += static_cast<size_t>(n);
  }
  // Some file systems (NFS, quotas) report a full disk only when the data reaches it.
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  std::string why = err != 0 ? std::strerror(err) : std::string();
  std::error_code ec;
  if (err == 0) {
    fs::rename(tmp, path, ec);
    if (!ec) return;
    why = ec.message();
  }
  fs::remove(tmp, ec);  // no half-written file is left behind
  fail("cannot write '", path.string(), "': ", why,
       "; free space in job.dump_folder or point it at a writable folder");
}

}  // namespace loom::train
