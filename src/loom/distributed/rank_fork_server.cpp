#include "loom/distributed/rank_fork_server.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "loom/core/error.h"

namespace loom::distributed {
namespace {

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // MSG_NOSIGNAL: a server that died must not kill the launcher with SIGPIPE.
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A request: the counts of environment entries and arguments, then each string NUL-terminated.
std::string encode(const std::vector<std::string>& environment, const std::vector<std::string>& argv) {
  std::string out(2 * sizeof(uint32_t), '\0');
  const uint32_t counts[2] = {static_cast<uint32_t>(environment.size()), static_cast<uint32_t>(argv.size())};
  std::memcpy(out.data(), counts, sizeof(counts));
  for (const auto* list : {&environment, &argv}) {
    for (const auto& s : *list) out.append(s.c_str(), s.size() + 1);
  }
  return out;
}

bool decode(const std::string& in, std::vector<std::string>& environment, std::vector<std::string>& argv) {
  uint32_t counts[2];
  if (in.size() < sizeof(counts)) return false;
  std::memcpy(counts, in.data(), sizeof(counts));
  size_t at = sizeof(counts);
  for (auto [list, n] : {std::pair{&environment, counts[0]}, std::pair{&argv, counts[1]}}) {
    for (uint32_t i = 0; i < n; ++i) {
      const size_t end = in.find('\0', at);
      if (end == std::string::npos) return false;
      list->push_back(in.substr(at, end - at));
      at = end + 1;
    }
  }
  return !argv.empty();
}

int thread_count() {
  std::error_code ec;
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/task", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

// The rank: becomes the launcher's child, then runs the entry point as a freshly exec'd rank would.
[[noreturn]] void run_rank(int server_socket, pid_t launcher, const RankEntry& entry,
                           const std::vector<std::string>& environment, const std::vector<std::string>& argv) {
  close(server_socket);
  setpgid(0, 0);
  // The intermediate process exits right after forking this one; until the launcher has adopted
  // it, PR_SET_PDEATHSIG would fire on the intermediate's exit. 10 s without adoption: the
  // launcher is gone.
  for (int waited_us = 0; getppid() != launcher; waited_us += 100) {
    if (waited_us > 10'000'000) _exit(1);
    usleep(100);
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(1);  // the launcher died before prctl took effect
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) signal(sig, SIG_DFL);
  clearenv();
  for (const auto& e : environment) putenv(strdup(e.c_str()));  // putenv keeps the pointer
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(strdup(a.c_str()));
  args.push_back(nullptr);
  const int code = entry(static_cast<int>(argv.size()), args.data());
  // As apps/main.cpp ends `loom`: flushed, then _exit, without libtorch's static destructors.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(code);
}

// The server's loop: one request, one rank, one reply (the rank's pid, or -errno), until the
// launcher closes the connection.
[[noreturn]] void serve(int socket, pid_t launcher, const RankEntry& entry) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) _exit(0);
  // Ctrl-C and a SIGTERM to the launcher's process group are the launcher's to handle (it stops the
  // ranks); the server ends when the launcher closes the connection or dies.
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) signal(sig, SIG_IGN);
  for (;;) {
    uint32_t size = 0;
    if (!read_all(socket, &size, sizeof(size))) _exit(0);
    std::string request(size, '\0');
    if (!read_all(socket, request.data(), size)) _exit(0);
    std::vector<std::string> environment, argv;
    int64_t reply = -EINVAL;
    if (decode(request, environment, argv)) {
      int pid_pipe[2];
      if (pipe(pid_pipe) != 0) {
        reply = -errno;
      } else {
        const pid_t intermediate = fork();
        if (intermediate == 0) {
          close(pid_pipe[0]);
          const pid_t rank = fork();
          if (rank == 0) {
            close(pid_pipe[1]);
            run_rank(socket, launcher, entry, environment, argv);
          }
          const int64_t pid = rank < 0 ? -errno : rank;
          [[maybe_unused]] ssize_t n = write(pid_pipe[1], &pid, sizeof(pid));
          _exit(0);
        }
        close(pid_pipe[1]);
        if (intermediate < 0) {
          reply = -errno;
        } else {
          if (!read_all(pid_pipe[0], &reply, sizeof(reply))) reply = -EIO;
          // Reaped before replying: the rank has been re-parented to the launcher by then.
          while (waitpid(intermediate, nullptr, 0) < 0 && errno == EINTR) {
          }
        }
        close(pid_pipe[0]);
      }
    }
    if (!write_all(socket, &reply, sizeof(reply))) _exit(0);
  }
}

}  // namespace

std::unique_ptr<RankForkServer> RankForkServer::start(RankEntry entry) {
  // A copy of a multi-threaded process would hold whatever locks the other threads held.
  if (!entry || thread_count() != 1) return nullptr;
  int sockets[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets) != 0) return nullptr;
  std::fflush(nullptr);  // buffered output would otherwise be written again by every rank
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(sockets[0]);
    close(sockets[1]);
    return nullptr;
  }
  if (pid == 0) {
    close(sockets[0]);
    serve(sockets[1], launcher, entry);
  }
  close(sockets[1]);
  return std::unique_ptr<RankForkServer>(new RankForkServer(pid, sockets[0]));
}

RankForkServer::~RankForkServer() {
  close(socket_);
  while (waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
  }
}

pid_t RankForkServer::spawn(const std::vector<std::string>& environment, const std::vector<std::string>& argv) {
  const std::string request = encode(environment, argv);
  const uint32_t size = static_cast<uint32_t>(request.size());
  // While the rank is forked this process is a child subreaper, so it adopts the rank when the
  // server's intermediate process exits.
  int was_subreaper = 0;
  prctl(PR_GET_CHILD_SUBREAPER, &was_subreaper);
  LOOM_REQUIRE(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "loom launch: cannot become a child subreaper: ",
               std::strerror(errno), "; use --start-method exec");
  int64_t reply = -EPIPE;
  const bool ok = write_all(socket_, &size, sizeof(size)) && write_all(socket_, request.data(), request.size()) &&
                  read_all(socket_, &reply, sizeof(reply));
  prctl(PR_SET_CHILD_SUBREAPER, was_subreaper);
  if (!ok) gone_ = true;
  LOOM_REQUIRE(ok, "loom launch: the rank fork server (pid ", pid_, ") has gone; use --start-method exec");
  LOOM_REQUIRE(reply > 0, "loom launch: the rank fork server cannot fork a rank: ",
               std::strerror(static_cast<int>(-reply)));
  return static_cast<pid_t>(reply);
}

}  // namespace loom::distributed
