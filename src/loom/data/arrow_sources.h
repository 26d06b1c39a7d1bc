// Parquet files and Arrow IPC files as document sources (training.dataset_format = "parquet" /
// "arrow"), read with Apache Arrow's C++ libraries from the pyarrow wheel, through the module
// bin/libloom_arrow_reader.so that this file dlopens on the first read (arrow_reader/arrow_reader.h
// says why it is not linked into `loom`).
//
// Parquet: one row group at a time, only the text column (FineWeb's and the Hub's shards hold
// ~100 MB row groups of many columns); a shard is never read whole. Arrow: the IPC stream files
// of a `datasets` cache (`data-00000-of-00002.arrow`, what `save_to_disk` and `load_dataset`
// write) or IPC files ("ARROW1"), memory-mapped and read one record batch at a time. Either way
// each non-null value of the text column (string, large_string or string_view) is one document,
// in row order; null values are skipped, and so are empty strings unless skip_empty is off.
#pragma once
#include <functional>
#include <string>
#include <string_view>

#include "loom/data/sources.h"

namespace loom::data {

// Whether this build reads Parquet and Arrow (its reader module, built with pyarrow's libraries, loads).
bool arrow_formats_available();

// Whether the file starts like a Parquet file ("PAR1") / an Arrow IPC stream or file.
bool has_parquet_magic(const std::string& path);
bool has_arrow_magic(const std::string& path);

// Calls fn(text) for every document of a Parquet (format kParquet) or Arrow (kArrow) file, in row
// order. Throws loom::UsageError (exit 2) naming the file and the fix for a file that is not
// valid Parquet/Arrow or is truncated, for a missing text column (listing the columns there are,
// and naming options.text_column_setting) and for a column that holds no strings.
void for_each_table_document(const std::string& path, SourceFormat format, const SourceOptions& options,
                             const std::function<void(std::string_view)>& fn);

}  // namespace loom::data
