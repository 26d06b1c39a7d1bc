// Minimal rank-aware logging to stderr/stdout. Rank is set once by the dist layer; messages from
// rank 0 go to stdout by default, other ranks log only warnings unless LOOM_LOG_ALL_RANKS=1.
#pragma once
#include <c10/util/StringUtil.h>

#include <string>

namespace loom::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_rank(int rank);
int rank();
void set_level(Level level);
void write(Level level, const std::string& message);

// A transient progress line (rank 0): on a terminal, `line` replaces the previous status line in
// place (carriage return, erase line) and stays until the next status() or write(), which erases
// it first, so warnings and log lines never land in the middle of it. Where stdout is not a
// terminal (a file, a pipe, CI) nothing is written: logs keep one plain line per log step.
// Returns whether the line was shown.
bool status(const std::string& line);
// Whether stdout is a terminal (isatty), checked once.
bool stdout_is_terminal();

template <typename... Args>
void info(const Args&... args) { write(Level::kInfo, c10::str(args...)); }
template <typename... Args>
void warn(const Args&... args) { write(Level::kWarn, c10::str(args...)); }
template <typename... Args>
void error(const Args&... args) { write(Level::kError, c10::str(args...)); }
template <typename... Args>
void debug(const Args&... args) { write(Level::kDebug, c10::str(args...)); }

}  // namespace loom::log
