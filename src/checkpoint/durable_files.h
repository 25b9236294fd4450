#pragma once
// File system steps that survive a crash or a power loss in a known state: data is
// flushed to the disk (fsync) before a rename makes it visible, and the directory holding
// a renamed entry is flushed too. Errors throw c10::Error naming the path.

#include <string>

namespace hp::detail {

// Writes `text` to `path` (created or truncated) and flushes it to the disk.
void write_file_durably(const std::string& path, const std::string& text);

// Flushes the entries of directory `dir` (new or renamed files in it) to the disk.
void sync_directory(const std::string& dir);

// Makes the complete directory `staged` appear as `target`, replacing a directory there
// (moved aside to "<target>.old" first, removed last). A crash leaves `target` either as
// it was, as `staged`, or absent with the old one at "<target>.old".
void replace_directory(const std::string& staged, const std::string& target);

}  // namespace hp::detail
