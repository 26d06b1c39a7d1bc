// The C interface of libloom_arrow_reader.so, the one part of Loom linked against Apache Arrow and
// Parquet (the pyarrow wheel's libraries). arrow_sources.cpp loads it with dlopen the first time a
// Parquet or Arrow file is read: libarrow starts a thread when it is loaded (jemalloc's background
// thread), and a `loom` process that is multi-threaded from its first instruction could no longer
// fork ranks from its fork server (distributed/rank_fork_server.h). Plain C types only, so the
// module shares no C++ ABI or exception types with the program.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

// What a read ended with.
enum LoomArrowStatus : int32_t {
  kLoomArrowOk = 0,
  kLoomArrowUnreadable = 1,     // message: Arrow's reason (not a valid / a truncated file)
  kLoomArrowMissingColumn = 2,  // message: the file's columns, comma-separated
  kLoomArrowNotText = 3,        // message: the column's type
  kLoomArrowStopped = 4,        // the callback asked to stop (it threw; the caller rethrows)
};

// Called once per document: its UTF-8 bytes. Returns 0 to go on, non-zero to stop.
typedef int32_t (*LoomArrowEmit)(void* context, const char* text, size_t size);

// Reads the string column `column` of a Parquet file (parquet != 0, one row group at a time) or an
// Arrow IPC stream or file (memory-mapped, one record batch at a time), calling `emit` for each
// non-null value (and empty ones only when skip_empty == 0). On failure writes a NUL-terminated
// message of at most message_size bytes.
int32_t loom_arrow_read_text(const char* path, int32_t parquet, const char* column, int32_t skip_empty,
                             LoomArrowEmit emit, void* context, char* message, size_t message_size);
typedef int32_t (*LoomArrowReadText)(const char*, int32_t, const char*, int32_t, LoomArrowEmit, void*, char*,
                                     size_t);
}
