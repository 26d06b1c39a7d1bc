// A run folder (job.dump_folder) belongs to one training job at a time. Two jobs writing the same
// metrics.jsonl and checkpoint folder would interleave their lines and mix their checkpoints, so
// rank 0 holds an exclusive lock on <dump_folder>/.loom.lock for the whole run (flock: the kernel
// drops it when the process ends, however it ends, so a crashed or killed run never leaves a stale
// lock, and a restarted job takes it again). The file records the holder for the error a second
// job gets:
//   error: job.dump_folder 'outputs' is in use by another Loom run (pid 4242 on host n1, started
//   2026-11-24 10:00:00); wait for it to finish or set job.dump_folder to another folder
#pragma once
#include <filesystem>
#include <string>

namespace loom::train {

//
// The checkpoint folder gets the same lock (checkpoint.folder may point outside the dump folder,
// e.g. an absolute path shared by mistake between two runs, which would then resume from and prune
// each other's checkpoints). `setting` names the config key that chose the folder, for the error.
class RunFolderLock {
 public:
  // Creates the folder and takes the lock; loom::UsageError (exit 2, never restarted) when another
  // process holds it or the folder cannot be created.
  explicit RunFolderLock(const std::filesystem::path& folder, const char* setting = "job.dump_folder");
  ~RunFolderLock();  // releases the lock (the file stays)
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

// Checks that `folder` (created if missing) accepts new files, by creating and removing a probe
// file named after `rank`. `what` names the config keys that set it. loom::UsageError naming the
// folder and the reason otherwise: found at start, not after the first interval's compute.
void require_writable_folder(const std::filesystem::path& folder, int rank, const char* what);

// Writes `text` to `path` whole or not at all: into "<path>.tmp", flushed to disk and checked at
// every call (a full disk fails the write or the close, not a later reader of a 0-byte file),
// then renamed over `path`. loom::Error naming the path and errno's text otherwise; the temporary
// file is removed.
void write_file_atomically(const std::filesystem::path& path, const std::string& text);

}  // namespace loom::train
