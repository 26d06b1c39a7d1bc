// Opening files a user names (data, tokenizer, ...) so that no open can block: a FIFO without a
// writer would make a plain open() wait forever, and no watchdog covers loading.
#pragma once
#include <string>

namespace loom {

// Opens `path` for reading and returns the descriptor; the caller closes it. The open is
// non-blocking, anything but a regular file is refused with loom::UsageError naming the path and
// what it is (fail_not_regular_file), and blocking mode is restored for the reads. `what` names the
// file's role ("tokenizer", "JSONL file", ...). loom::Error with errno's text if it cannot open.
int open_regular_file(const std::string& path, const std::string& what);

// "a FIFO (named pipe)", "a character device", "a directory", ...: what a stat() mode that is not
// a regular file's is, for errors.
const char* file_kind(unsigned mode);

// loom::UsageError "<who> is <file_kind>, not a regular file: ...; point it at a regular file, a
// directory of them or a glob" ("<who> is a directory, not a file; ..." for a directory, which
// only open_regular_file's callers refuse).
[[noreturn]] void fail_not_regular_file(const std::string& who, unsigned mode);

}  // namespace loom
