// The rank fork server (rank_fork_server.h): a forked rank runs the entry point with exactly the
// environment and argv it was given, is the caller's child (so the launcher's waitpid and SIGCHLD
// see it) in a process group of its own, and dies with the caller; a caller that already runs
// several threads gets no server. Each case runs in a forked child of the test process, so the
// server is started from a single-threaded process whatever earlier tests left running.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include "loom/distributed/rank_fork_server.h"

namespace test_rank_fork_server {
using loom::distributed::RankForkServer;

// Runs `body` in a forked child; returns what it returned (empty: passed), or why the child died.
std::string in_child(const std::function<std::string()>& body) {
  int out[2];
  if (pipe(out) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(out[0]);
    std::string message;
    try {
      message = body();
    } catch (const std::exception& e) {
      message = std::string("threw: ") + e.what();
    }
    [[maybe_unused]] ssize_t n = write(out[1], message.data(), message.size());
    _exit(0);
  }
  close(out[1]);
  std::string message;
  char buf[512];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof(buf))) > 0) message.append(buf, static_cast<size_t>(n));
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) message += " (the test's child process failed)";
  return message;
}

std::string temp_file(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / (name + "_" + std::to_string(getpid()))).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(RankForkServer, RankRunsTheEntryWithItsOwnEnvironmentAndArgvAsTheCallersChild) {
  const std::string file = temp_file("fork_server_rank");
  std::filesystem::remove(file);
  const std::string failure = in_child([&]() -> std::string {
    auto server = RankForkServer::start([](int argc, char** argv) {
      const char* rank = std::getenv("RANK");
      const char* home = std::getenv("HOME");
      std::ofstream(argv[1]) << argc << " " << argv[2] << " " << getppid() << " " << getpgid(0) << " "
                             << (rank ? rank : "-") << " " << (home ? "home" : "no-home") << "\n";
      return 7;
    });
    if (!server) return "no server from a single-threaded process";
    const pid_t rank = server->spawn({"RANK=3", "WORLD_SIZE=4"}, {"loom", file, "train"});
    int status = 0;
    if (waitpid(rank, &status, 0) != rank) return "the rank is not the caller's child";
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 7) return "the rank did not exit with the entry's code 7";
    std::stringstream want;
    want << "3 train " << getpid() << " " << rank << " 3 no-home\n";
    const std::string got = read_file(file);
    if (got != want.str()) return "the rank wrote '" + got + "', expected '" + want.str() + "'";
    // A second rank from the same server (a restart's).
    const pid_t again = server->spawn({}, {"loom", file, "again"});
    if (waitpid(again, &status, 0) != again || WEXITSTATUS(status) != 7) return "a second rank failed";
    return "";
  });
  std::filesystem::remove(file);
  EXPECT_EQ(failure, "");
}

TEST(RankForkServer, RankDiesWithTheCaller) {
  const std::string file = temp_file("fork_server_orphan");
  std::filesystem::remove(file);
  // The caller (a child of this test) starts a rank that would sleep a minute, then exits at once.
  const std::string failure = in_child([&]() -> std::string {
    auto server = RankForkServer::start([](int, char** argv) {
      std::ofstream(argv[1]) << getpid() << "\n";
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    });
    if (!server) return "no server from a single-threaded process";
    server->spawn({}, {"loom", file});
    for (int i = 0; i < 500 && read_file(file).empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    _exit(read_file(file).empty() ? 1 : 0);  // without closing the server or reaping the rank
  });
  EXPECT_EQ(failure, "");
  const pid_t rank = std::atoi(read_file(file).c_str());
  ASSERT_GT(rank, 0);
  // Killed by PR_SET_PDEATHSIG: gone, or a zombie where the container's init does not reap.
  bool alive = true;
  for (int i = 0; i < 500 && alive; ++i) {
    const std::string stat = read_file("/proc/" + std::to_string(rank) + "/stat");
    alive = !stat.empty() && stat.find(") Z") == std::string::npos;
    if (alive) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::filesystem::remove(file);
  EXPECT_FALSE(alive) << "rank " << rank << " outlived its launcher";
  if (alive) kill(rank, SIGKILL);
}

TEST(RankForkServer, NoServerForAMultiThreadedCaller) {
  const std::string failure = in_child([]() -> std::string {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::thread other([&] {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return done; });
    });
    auto server = RankForkServer::start([](int, char**) { return 0; });
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
    other.join();
    if (server) return "a server was forked from a process with two threads";
    if (!RankForkServer::start([](int, char**) { return 0; })) return "no server once the thread had ended";
    return "";
  });
  EXPECT_EQ(failure, "");
}

}  // namespace test_rank_fork_server
